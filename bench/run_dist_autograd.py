#!/usr/bin/env python3
"""weft's distributed autograd against torch.distributed.autograd, side by side in one run.

Runs every measurement of both systems in one go, interleaved (for each repeat, for each
measurement, each system in turn, the order rotating between repeats) so that drift of a shared
machine hits both alike, and prints one JSON object per metric on stdout:

  {"bench":"dist_autograd","metric":"a1_p50","value":290.1,"unit":"us","vs":{"torch_rpc":3.1},
   "ratio":"peer/weft","peers":{"torch_rpc":900.0},"runs":2,"target":{"torch_rpc":3.0},
   "meets_target":true}

value is weft's (median over the repeats); vs is the peer's value over weft's (> 1: weft is
better; every metric here is lower-is-better). target is the issue's goal where it sets one: A1
at least 3x faster than torch; A3 no live context after 1 s and RSS growth under 5 MiB (absolute,
in "limit"); A4 every survivor's error within 2 s (absolute); the pipeline faster than torch's at
every split count, and its best split's speedup over 1 split at least torch's
(pipeline_best_speedup, higher is better). Each raw line goes to stderr (and to --raw FILE);
--out FILE appends the result lines (bench/results-dist-autograd-<date>.jsonl).

Systems and their programs (same counts and warm-up for both):
  weft       BUILDDIR/bench/bench_dist_autograd (bench/dist_autograd.c); the pipeline:
             BUILDDIR/tools/weftrun -n 3 BUILDDIR/examples/pipeline_train --epochs 0 --json
  torch_rpc  bench/torch_dist_autograd.py under a python that has torch (Debian's python3-torch at
             /usr/bin/python3 when this python has none)

Metrics: a1_p50, a1_p99 (us: the design doc's example, context to release); a2_p50_h<H>,
a2_p99_h<H> for H = 1..4 hops; a3_seconds, a3_rss_growth_mb_rank0/1, a3_live_contexts_after_1s
(N contexts with 2 RPCs and a backward each); a4_error_after_ms, a4_survivor_contexts_after_1s
(the callee killed during backward); pipeline_s<K>_ms for K = 1, 2, 4, 8 (ms per batch of 128, the
tutorial's pipeline over 3 processes) and pipeline_best_speedup. Python 3 standard library only.
"""
import os
import sys
import time

from benchlib import Values, as_is, emit_results, fmt, run_rounds, runner_args, say_done, torch_python_for, versus

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "torch_rpc"]
HIGHER_IS_BETTER = {"pipeline_best_speedup"}
RATIO_TARGETS = {"a1_p50": {"torch_rpc": 3.0}}
LIMITS = {"a3_live_contexts_after_1s": 0, "a3_rss_growth_mb_rank0": 5.0, "a3_rss_growth_mb_rank1": 5.0,
          "a4_error_after_ms": 2000.0}
SPLITS = [1, 2, 4, 8]


def plan(quick, hops):
    iters = 300 if quick else 1000
    return ([("a1", [str(iters)])] + [("a2", [str(h), str(iters // 2)]) for h in hops] +
            [("a3", ["2000" if quick else "10000"]), ("a4", [])])


def pipeline_mapper(ln):
    """weftrun's output of pipeline_train --json: one line with every split's time."""
    out = []
    for k in SPLITS:
        key = "pipeline_s%d_ms" % k
        if key in ln:
            out.append((key, "weft", ln[key], "ms"))
    return out


def main():
    a = runner_args(__doc__, "fewer iterations, hops 1 and 4 only",
                    "also append the result JSON lines to this file", "do not run torch.distributed.autograd")
    bench = os.path.join(a.builddir, "bench", "bench_dist_autograd")
    weftrun = os.path.join(a.builddir, "tools", "weftrun")
    pipeline = os.path.join(a.builddir, "examples", "pipeline_train")
    if not os.access(bench, os.X_OK):
        print("run_dist_autograd: %s missing; run meson compile -C %s" % (bench, a.builddir), file=sys.stderr)
        return 1
    torch_python = torch_python_for(a, "run_dist_autograd", "torch_rpc")
    torch_cmd = [torch_python, os.path.join(HERE, "torch_dist_autograd.py")] if torch_python else None
    hops = [1, 4] if a.quick else [1, 2, 3, 4]
    groups = []
    for mode, args in plan(a.quick, hops):
        g = [("weft", [bench, mode] + args, " ".join([mode] + args), as_is)]
        if torch_cmd:
            g.append(("torch_rpc", torch_cmd + [mode] + args, " ".join([mode] + args), as_is))
        groups.append(g)
    batches = 4 if a.quick else 10
    if os.access(pipeline, os.X_OK) and os.access(weftrun, os.X_OK):
        g = [("weft", [weftrun, "-n", "3", "--no-prefix", pipeline, "--epochs", "0", "--json",
                       "--timing-batches", str(batches)], "pipeline", pipeline_mapper)]
        if torch_cmd:
            for k in SPLITS:
                g.append(("torch_rpc", torch_cmd + ["pipeline", str(k), str(batches)], "pipeline %d" % k, as_is))
        groups.append(g)
    else:
        print("run_dist_autograd: %s missing: no pipeline figures" % pipeline, file=sys.stderr)

    values = Values()
    t_start = time.monotonic()
    failures = run_rounds("run_dist_autograd", a, groups, values.add)

    results = []
    weft_missing = False
    for m in values.order:
        med = values.medians(m)
        vs, peers = versus(med, [s for s in SYSTEMS if s != "weft"], True)
        if med.get("weft") is None:
            weft_missing = True
        res = {"bench": "dist_autograd", "metric": m, "value": fmt(med.get("weft")), "unit": values.units[m],
               "vs": vs, "ratio": "peer/weft", "peers": peers, "runs": values.runs(m)}
        if m in RATIO_TARGETS:
            res["target"] = RATIO_TARGETS[m]
            res["meets_target"] = all(vs.get(s) is not None and vs[s] >= t for s, t in RATIO_TARGETS[m].items())
        if m in LIMITS and med.get("weft") is not None:
            res["limit"] = LIMITS[m]
            res["meets_target"] = med["weft"] <= LIMITS[m]
        if m.startswith("pipeline_s"):
            res["meets_target"] = vs.get("torch_rpc") is not None and vs["torch_rpc"] > 1.0
        results.append(res)
    # The pipeline's best split against one split, for each system.
    speed = {}
    for s in SYSTEMS:
        t = {k: values.medians("pipeline_s%d_ms" % k).get(s) for k in SPLITS
             if "pipeline_s%d_ms" % k in values.values}
        if t.get(1) and all(v for v in t.values()):
            speed[s] = t[1] / min(t.values())
    if "weft" in speed:
        res = {"bench": "dist_autograd", "metric": "pipeline_best_speedup", "value": round(speed["weft"], 3),
               "unit": "x", "peers": {"torch_rpc": round(speed["torch_rpc"], 3) if "torch_rpc" in speed else None},
               "ratio": "weft/peer"}
        if "torch_rpc" in speed:
            res["vs"] = {"torch_rpc": round(speed["weft"] / speed["torch_rpc"], 3)}
            res["meets_target"] = speed["weft"] >= speed["torch_rpc"]
        results.append(res)
    emit_results(results, a.out, "a")
    say_done("run_dist_autograd", a.repeat, t_start, failures)
    return 1 if weft_missing or not values.order else 0


if __name__ == "__main__":
    sys.exit(main())
