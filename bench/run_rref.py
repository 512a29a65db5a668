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
import argparse
import json
import os
import statistics
import sys
import time

from benchlib import find_torch_python, fmt, run_one

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "torch_rpc"]
LOWER_IS_BETTER_UNITS = {"us"}
TARGETS = {"remote_to_here_p50_64B": {"torch_rpc": 4.0}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builddir", default="build", help="meson build directory (default: build)")
    p.add_argument("--quick", action="store_true", help="fewer iterations")
    p.add_argument("--out", help="also append the result JSON lines to this file")
    p.add_argument("--raw", help="also write every raw measurement line to this file")
    p.add_argument("--skip-torch", action="store_true", help="do not run torch.distributed.rpc")
    p.add_argument("--repeat", type=int, default=None,
                   help="rounds of all measurements; medians are reported (default 2, --quick 1)")
    p.add_argument("--torch-python", help="python interpreter with torch (default: this one, else /usr/bin/python3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one measurement may take")
    p.add_argument("--verbose", action="store_true", help="pass the programs' stderr through")
    a = p.parse_args()
    if a.repeat is None:
        a.repeat = 1 if a.quick else 2
    return a


def plan(quick):
    """The measurements: (mode, args) shared verbatim by both systems."""
    iters = 500 if quick else 2000
    ops = 1000 if quick else 4000
    return [("latency", ["64", str(iters)]), ("fork", [str(ops), "16"])]


def main():
    a = parse_args()
    cmds = {"weft": [os.path.join(a.builddir, "bench", "bench_rref")]}
    if not a.skip_torch:
        torch_python = find_torch_python(a)
        if torch_python is None:
            print("run_rref: no python with torch found; torch_rpc skipped", file=sys.stderr)
        else:
            cmds["torch_rpc"] = [torch_python, os.path.join(HERE, "torch_rref.py")]
    if not os.access(cmds["weft"][0], os.X_OK):
        print("run_rref: %s missing; run meson compile -C %s" % (cmds["weft"][0], a.builddir), file=sys.stderr)
        return 1
    systems = [s for s in SYSTEMS if s in cmds]
    raw_f = open(a.raw, "w") if a.raw else None

    values = {}  # metric -> system -> [values]
    units = {}
    order = []
    failures = 0
    t_start = time.monotonic()
    for rnd in range(a.repeat):
        for mode, args in plan(a.quick):
            k = rnd % len(systems)
            for system in systems[k:] + systems[:k]:
                lines, err = run_one(cmds[system] + [mode] + args, a.timeout, a.verbose)
                if err:
                    failures += 1
                    print("run_rref: %s %s failed: %s" % (system, " ".join([mode] + args), err), file=sys.stderr)
                for ln in lines:
                    ln["round"] = rnd
                    text = json.dumps(ln, separators=(",", ":"))
                    print(text, file=sys.stderr)
                    if raw_f:
                        raw_f.write(text + "\n")
                        raw_f.flush()
                    m = ln["metric"]
                    if m not in values:
                        values[m] = {}
                        order.append(m)
                    values[m].setdefault(ln["system"], []).append(ln["value"])
                    units[m] = ln.get("unit", "")
    if raw_f:
        raw_f.close()

    out_f = open(a.out, "a") if a.out else None
    weft_missing = False
    for m in order:
        med = {s: statistics.median(v) for s, v in values[m].items() if v}
        w = med.get("weft")
        lower_better = units[m] in LOWER_IS_BETTER_UNITS
        vs, peers = {}, {}
        for s in systems:
            if s == "weft":
                continue
            p = med.get(s)
            peers[s] = fmt(p)
            vs[s] = None if w is None or p is None or w == 0 or p == 0 else round(p / w if lower_better else w / p, 3)
        if w is None:
            weft_missing = True
        res = {"bench": "rref", "metric": m, "value": fmt(w), "unit": units[m], "vs": vs,
               "ratio": "peer/weft" if lower_better else "weft/peer", "peers": peers,
               "runs": len(values[m].get("weft", []))}
        if m in TARGETS:
            res["target"] = TARGETS[m]
            res["meets_target"] = all(vs.get(s) is not None and vs[s] >= t for s, t in TARGETS[m].items())
        text = json.dumps(res, separators=(",", ":"))
        print(text, flush=True)
        if out_f:
            out_f.write(text + "\n")
    if out_f:
        out_f.close()
    print("run_rref: %d rounds in %.0f s%s" % (a.repeat, time.monotonic() - t_start,
                                               ", %d failed runs" % failures if failures else ""),
          file=sys.stderr)
    return 1 if weft_missing or not order else 0


if __name__ == "__main__":
    sys.exit(main())
