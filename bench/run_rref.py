#!/usr/bin/env python3
"""weft's remote references (RRefs) against torch.distributed.rpc's, side by side in one run.

Runs every measurement of both systems in one go, interleaved (for each repeat, for each
measurement, each system in turn, the order rotating between repeats) so that drift of a shared
machine hits both alike, and prints one JSON object per metric on stdout:

  {"bench":"rref","metric":"remote_to_here_p50_64B","value":80.1,"unit":"us",
   "vs":{"torch_rpc":4.3},"ratio":"peer/weft","peers":{"torch_rpc":344.0},"runs":2,
   "target":{"torch_rpc":4.0},"meets_target":true}

value is weft's (median over the repeats); every ratio is defined so that > 1 means weft is
better: peer/weft for latencies, weft/peer for throughputs. target is the issue's goal for that
ratio, where it sets one (remote()+to_here of 64 B at least 4x faster than torch). Each raw
measurement line goes to stderr (and to --raw FILE); --out FILE appends the result lines (e.g.
bench/results-rref-<date>.jsonl).

Systems and their programs (same sizes, counts, windows and warm-up for both):
  weft       BUILDDIR/bench/bench_rref   (bench/rref.c)
  torch_rpc  bench/torch_rref.py under a python that has torch (Debian's python3-torch at
             /usr/bin/python3 when this python has none)

Metrics: remote_to_here_p50_64B, remote_to_here_p99_64B (us: remote() of a 64-byte u8 tensor's
echo on rank 1, then to_here, one at a time, 2 ranks); fork_throughput (forks/s) and
fork_ops_throughput (ops/s): an RRef created on rank 1 by rank 0, forked to rank 2 and back,
every handle dropped, 16 operations in flight, 3 ranks, the clock stopped once rank 1 owns
nothing. Python 3 standard library only.
"""
import os
import sys
import time

from benchlib import Values, as_is, emit_results, fmt, run_rounds, runner_args, say_done, torch_python_for, versus

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "torch_rpc"]
LOWER_IS_BETTER_UNITS = {"us"}
TARGETS = {"remote_to_here_p50_64B": {"torch_rpc": 4.0}}


def plan(quick):
    """The measurements: (mode, args) shared verbatim by both systems."""
    iters = 500 if quick else 2000
    ops = 1000 if quick else 4000
    return [("latency", ["64", str(iters)]), ("fork", [str(ops), "16"])]


def main():
    a = runner_args(__doc__, "fewer iterations", "also append the result JSON lines to this file",
                    "do not run torch.distributed.rpc")
    cmds = {"weft": [os.path.join(a.builddir, "bench", "bench_rref")]}
    torch_python = torch_python_for(a, "run_rref", "torch_rpc")
    if torch_python is not None:
        cmds["torch_rpc"] = [torch_python, os.path.join(HERE, "torch_rref.py")]
    if not os.access(cmds["weft"][0], os.X_OK):
        print("run_rref: %s missing; run meson compile -C %s" % (cmds["weft"][0], a.builddir), file=sys.stderr)
        return 1
    systems = [s for s in SYSTEMS if s in cmds]
    groups = [[(s, cmds[s] + [mode] + args, " ".join([mode] + args), as_is) for s in systems]
              for mode, args in plan(a.quick)]
    values = Values()
    t_start = time.monotonic()
    failures = run_rounds("run_rref", a, groups, values.add)

    results = []
    weft_missing = False
    for m in values.order:
        med = values.medians(m)
        lower_better = values.units[m] in LOWER_IS_BETTER_UNITS
        vs, peers = versus(med, [s for s in systems if s != "weft"], lower_better)
        if med.get("weft") is None:
            weft_missing = True
        res = {"bench": "rref", "metric": m, "value": fmt(med.get("weft")), "unit": values.units[m], "vs": vs,
               "ratio": "peer/weft" if lower_better else "weft/peer", "peers": peers, "runs": values.runs(m)}
        if m in TARGETS:
            res["target"] = TARGETS[m]
            res["meets_target"] = all(vs.get(s) is not None and vs[s] >= t for s, t in TARGETS[m].items())
        results.append(res)
    emit_results(results, a.out, "a")
    say_done("run_rref", a.repeat, t_start, failures)
    return 1 if weft_missing or not values.order else 0


if __name__ == "__main__":
    sys.exit(main())
