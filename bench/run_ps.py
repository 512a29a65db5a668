#!/usr/bin/env python3
"""weft's parameter server (include/weft/ps.h) against weft's own RPC, raw TCP, torch.distributed.rpc
and all_reduce (gloo and weft), side by side in one run.

    python3 bench/run_ps.py [--builddir build] [--quick] [--repeat N] [--out FILE] [--raw FILE]
                            [--skip-torch] [--timeout S] [--verbose]
    (or: meson compile -C build bench-ps)

Runs every measurement of every system in one go, interleaved (for each repeat, for each
measurement, each system in turn, the order rotating between repeats) so that drift of a shared
machine hits all alike, and prints one JSON object per metric on stdout:

  {"bench":"ps","metric":"push_16MiB","value":2.7,"unit":"GB/s","vs":{"weft_rpc":0.63,...},
   "ratio":"weft/peer","peers":{"weft_rpc":4.29,...},"runs":2,"target":{"weft_rpc":0.8},
   "meets_target":false}

value is weft's PS (median over the repeats); every ratio is defined so that > 1 means weft's PS
is better: peer/weft for times (us), weft/peer for GB/s and rows/s. target is the issue's goal
for a ratio where it sets one; meets_target is null when a peer with a target did not run. Each
raw measurement line goes to stderr (and to --raw FILE); --out FILE appends the result lines
(e.g. bench/results-ps-<date>.jsonl).

P1 dense push/pull, 1 worker + 1 server (bench_ps p1): a dense f32 table of SIZE bytes (SUM,
ASYNC, default 4 MiB chunks, so one round trip per call), K calls one at a time of each of
weft_ps_push, weft_ps_pull, weft_ps_push_pull. Metrics push_<SIZE>, pull_<SIZE> (GB/s = 1e9 B/s of
SIZE bytes per call) and push_pull_<SIZE> (2 SIZE bytes per call, both ways), SIZE 4, 16, 64,
256 MiB (--quick: 16, 64 MiB). Peers, same bytes, same run:
  weft_rpc         the same bytes through weft_rpc_sync to the server rank, in the same bench_ps
                   process pair: "sink" for push (SIZE there, empty reply), "source" for pull
                   (empty call, SIZE back), "echo" for push_pull. target 0.8 for push and pull at
                   16 MiB and above (the issue: PS >= 0.8x weft's own RPC bandwidth).
  weft_rpc_stream  bench_rpc stream SIZE COUNT 4 (RPC bulk bandwidth, 4 calls in flight; the
                   figure bench/RESULTS.md quotes), as the peer of push and pull.
  raw_tcp          baseline_tcp stream SIZE COUNT 1 (one message at a time, 1-byte ack) for push
                   and pull; baseline_tcp pingpong SIZE (2 SIZE / p50 round trip) for push_pull.
  The published ps-lite figures (1 worker + 1 server: push 0.19 GB/s, pull 0.04 GB/s,
  flexps-paper-version#12; another machine) ride along as "published", outside vs.

P2 sparse (bench_ps p2 and bench/torch_ps.py p2): a 1M x 64 f32 table on 2 servers, 2 workers,
4096 Zipf(1.05) ids per batch per worker, per batch a pull of the rows then a push of their
gradients (0.01 * row), server-side Adagrad, each waited for. Metrics sparse_rows (rows/s:
pulled + pushed, 8192 a batch, summed over the workers), sparse_batch_p50, sparse_batch_p99 (us
per batch), sparse_pull_p50 (us, the pull half of a batch). Peer torch_rpc: the same with
torch.distributed.rpc, 2 PS ranks holding shards of an nn.Embedding(sparse=True) with
torch.optim.Adagrad, trainers deduplicating ids as weft's client does and calling rpc_async
get_rows / apply_grads. target 5.0 on sparse_rows. The mean distinct ids per batch rides along
as "unique_ids".

P3 sync step (bench_ps p3): a 4 MiB dense f32 table (SGD, SYNC) on 1 server, 2 and 4 workers
(and the same table spread over 2 servers in 2 MiB chunks: metrics ending in _s2); a
step is push (waited), weft_ps_clock, pull; sync_step_fused_4MiB_w<W> is the same step as
weft_ps_push_pull_async, weft_ps_clock, then the wait (one round trip less; same peers and
target). 1 server because a 4 MiB table at the default 4 MiB
chunk size is one chunk: it lives on one server however many there are (what a user running
the defaults gets). Metric sync_step_4MiB_w<W> (us per step, the slowest worker's mean). Peers:
gloo_all_reduce (bench/torch_gloo.py W --ops all_reduce --sizes 4M) and weft_all_reduce
(bench_collectives W --ops all_reduce --sizes 4M), each the time of one all_reduce of the same
4 MiB on W ranks. target 0.667 against gloo (the step <= 1.5x gloo's all_reduce).

Programs: BUILDDIR/bench/{bench_ps,bench_rpc,baseline_tcp,bench_collectives}, bench/torch_ps.py
and bench/torch_gloo.py under a python that has torch (this one, else /usr/bin/python3: Debian's
python3-torch); without torch the torch rows are skipped with a message. All ranks on one host
over loopback. Python 3 standard library only.
"""
import os
import statistics
import sys
import time

from benchlib import (Values, as_is, emit_results, fmt, run_rounds, runner_args, say_done, size_label,
                      torch_python_for, versus)

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "weft_rpc", "weft_rpc_stream", "raw_tcp", "torch_rpc", "gloo_all_reduce",
           "weft_all_reduce"]
LOWER_IS_BETTER_UNITS = {"us"}
MiB = 1 << 20
PUBLISHED = {"push": {"ps_lite": 0.19}, "pull": {"ps_lite": 0.04}}
PUBLISHED_SOURCE = "ps-lite 1 worker + 1 server, 1e8 f32 (Yuzhen11/flexps-paper-version#12)"
CONTEXT_METRICS = {"unique_ids": "sparse_rows"}  # raw metric -> the result line it rides along on


# Mappers: a program's raw line -> [(metric, system, value, unit)] (benchlib.as_is as it is).
def rpc_stream_as(system):
    def m(ln):
        if not ln["metric"].startswith("bandwidth_"):
            return []
        label = ln["metric"][len("bandwidth_"):]
        return [("push_" + label, system, ln["value"], "GB/s"), ("pull_" + label, system, ln["value"], "GB/s")]
    return m


def tcp_pingpong(ln):
    if not ln["metric"].startswith("latency_p50_"):
        return []
    size = ln["size"]
    return [("push_pull_" + size_label(size), "raw_tcp", 2.0 * size / (ln["value"] * 1e3), "GB/s")]


def all_reduce_as(system):
    """One all_reduce's time is the peer of both forms of the sync step."""
    def m(ln):
        if ln.get("op") != "all_reduce" or "time_us" not in ln:
            return []
        tail = "%s_w%d" % (size_label(ln["bytes"]), ln["world"])
        out = []
        for servers in ("", "_s2"):  # the table on 1 server, and spread over 2
            out += [("sync_step_" + tail + servers, system, ln["time_us"], "us"),
                    ("sync_step_fused_" + tail + servers, system, ln["time_us"], "us")]
        return out
    return m


def plan(a, b, torch_python):
    """Measurement groups: [(system, argv, mapper)], the systems of one group measured back to back."""
    bench = lambda name: os.path.join(b, "bench", name)  # noqa: E731
    groups = []
    total = (256 if a.quick else 1024) * MiB
    for mib in ([16, 64] if a.quick else [4, 16, 64, 256]):
        size = mib * MiB
        k = str(max(4, total // size))
        groups.append([
            ("weft", [bench("bench_ps"), "p1", "--bytes", "%dM" % mib, "--iters", k], as_is),
            ("weft_rpc_stream", [bench("bench_rpc"), "stream", "%dM" % mib, k, "4"], rpc_stream_as("weft_rpc_stream")),
            ("raw_tcp", [bench("baseline_tcp"), "stream", "%dM" % mib, k, "1"], rpc_stream_as("raw_tcp")),
            ("raw_tcp", [bench("baseline_tcp"), "pingpong", "%dM" % mib, k], tcp_pingpong),
        ])
    batches, warm = ("60", "6") if a.quick else ("300", "30")
    p2 = ["p2", "--servers", "2", "--workers", "2", "--batches", batches, "--warmup", warm, "--ids", "4096",
          "--rows", "1048576", "--dim", "64", "--zipf", "1.05"]
    g = [("weft", [bench("bench_ps")] + p2, as_is)]
    if torch_python:
        g.append(("torch_rpc", [torch_python, os.path.join(HERE, "torch_ps.py")] + p2, as_is))
    groups.append(g)
    iters, budget = ("30", "0.2") if a.quick else ("150", "1.0")
    for w in (2, 4):
        p3 = [bench("bench_ps"), "p3", "--servers", "1", "--workers", str(w), "--bytes", "4M", "--iters", iters]
        p3s2 = [bench("bench_ps"), "p3", "--servers", "2", "--chunk", "2M", "--workers", str(w), "--bytes", "4M",
                "--iters", iters]
        g = [("weft", p3, as_is),
             ("weft", p3 + ["--fused", "1"], as_is),
             ("weft", p3s2, as_is),
             ("weft", p3s2 + ["--fused", "1"], as_is),
             ("weft_all_reduce", [bench("bench_collectives"), str(w), "--ops", "all_reduce", "--sizes", "4M",
                                  "--budget", budget], all_reduce_as("weft_all_reduce"))]
        if torch_python:
            g.append(("gloo_all_reduce", [torch_python, os.path.join(HERE, "torch_gloo.py"), str(w), "--ops",
                                          "all_reduce", "--sizes", "4M", "--budget", budget],
                      all_reduce_as("gloo_all_reduce")))
        groups.append(g)
    return groups


def target_of(metric):
    for op in ("push", "pull"):
        if metric.startswith(op + "_") and metric.endswith("MiB") and not metric.startswith("push_pull"):
            mib = int(metric[len(op) + 1:-3])
            return {"weft_rpc": 0.8} if mib >= 16 else None
    if metric == "sparse_rows":
        return {"torch_rpc": 5.0}
    if metric.startswith("sync_step_"):
        return {"gloo_all_reduce": round(1 / 1.5, 3)}
    return None


def main():
    a = runner_args(__doc__, "fewer sizes and iterations", "also append the result JSON lines to this file",
                    "do not run torch (torch_rpc, gloo_all_reduce)")
    torch_python = torch_python_for(a, "run_ps", "torch_rpc and gloo_all_reduce")
    if a.skip_torch:
        print("run_ps: --skip-torch: torch_rpc and gloo_all_reduce skipped", file=sys.stderr)
    groups = plan(a, a.builddir, torch_python)
    missing = sorted({argv[0] for g in groups for s, argv, _ in g
                      if s not in ("torch_rpc", "gloo_all_reduce") and not os.access(argv[0], os.X_OK)})
    if missing:
        print("run_ps: %s missing; run meson compile -C %s" % (", ".join(missing), a.builddir), file=sys.stderr)
        return 1

    values = Values()
    context = {}  # result metric -> {name: {system: [values]}}

    def collect(metric, system, value, unit):
        if metric in CONTEXT_METRICS:
            context.setdefault(CONTEXT_METRICS[metric], {}).setdefault("unique_ids", {}).setdefault(
                system, []).append(value)
        else:
            values.add(metric, system, value, unit)

    t_start = time.monotonic()
    failures = run_rounds("run_ps", a, [[(s, argv, "(%s)" % " ".join(argv), mapper) for s, argv, mapper in g]
                                        for g in groups], collect)

    results = []
    weft_missing = False
    for m in values.order:
        med = values.medians(m)
        w = med.get("weft")
        unit = values.units[m]
        lower_better = unit in LOWER_IS_BETTER_UNITS
        tgt = target_of(m)
        vs, peers = versus(med, [s for s in SYSTEMS if s != "weft" and (s in med or (tgt and s in tgt))],
                           lower_better)
        if w is None:
            weft_missing = True
        res = {"bench": "ps", "metric": m, "value": fmt(w), "unit": unit, "vs": vs,
               "ratio": "peer/weft" if lower_better else "weft/peer", "peers": peers, "runs": values.runs(m)}
        if tgt:
            res["target"] = tgt
            res["meets_target"] = (None if any(vs.get(s) is None for s in tgt)
                                   else all(vs[s] >= t for s, t in tgt.items()))
        op = m.split("_")[0] if not m.startswith("push_pull") else None
        if op in PUBLISHED and unit == "GB/s":
            res["published"] = dict(PUBLISHED[op], source=PUBLISHED_SOURCE)
        for name, per_sys in context.get(m, {}).items():
            res[name] = {s: fmt(statistics.median(v)) for s, v in per_sys.items()}
        results.append(res)
    emit_results(results, a.out, "a")
    say_done("run_ps", a.repeat, t_start, failures)
    return 1 if weft_missing or not values.order or failures else 0


if __name__ == "__main__":
    sys.exit(main())
