#!/usr/bin/env python3
"""weft's RPC benchmark against raw gRPC bidi streaming, raw TCP and torch.distributed.rpc.

Runs every measurement of every system in one go, interleaved (for each
repeat, for each measurement, each system in turn, the order rotating between
repeats) so that drift of a shared machine hits all systems alike, and prints
one JSON object per metric on stdout:

  {"bench":"rpc","metric":"latency_p50_64B","value":71.2,"unit":"us",
   "vs":{"raw_grpc_bidi":0.97,"raw_tcp":0.88,"torch_rpc":4.9},"ratio":"peer/weft",
   "peers":{"raw_grpc_bidi":69.1,...},"runs":2}

value is weft's (median over the repeats); every ratio is defined so that > 1
means weft is better: peer/weft for latencies, weft/peer for throughput and
bandwidth. Each raw measurement line goes to stderr (and to --raw FILE).

Systems and their programs (same sizes, counts, windows and warm-up for all):
  weft           BUILDDIR/bench/bench_rpc      (bench/rpc.c)
  raw_grpc_bidi  BUILDDIR/bench/baseline_grpc  (bench/baseline_grpc.c)
  raw_tcp        BUILDDIR/bench/baseline_tcp   (bench/baseline_tcp.c)
  torch_rpc      bench/torch_rpc.py under a python that has torch

Metrics: latency_p50_64B, latency_p99_64B (us, ping-pong of a 64-byte payload),
async_throughput (calls/s, 64-byte echoes, 64 in flight), bandwidth_<SIZE>
(GB/s = 1e9 B/s, one-way tensors, 4 calls in flight, the callee replies small).
Python 3 standard library only.
"""
import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from benchlib import find_torch_python, fmt, parse_lines, run_one  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "raw_grpc_bidi", "raw_tcp", "torch_rpc"]
LOWER_IS_BETTER_UNITS = {"us"}
MiB = 1 << 20


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builddir", default="build", help="meson build directory (default: build)")
    p.add_argument("--quick", action="store_true", help="fewer iterations; bandwidth at 1 and 16 MiB only")
    p.add_argument("--out", help="also write the result JSON lines to this file")
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
    """The measurements: (mode, args) shared verbatim by every system."""
    iters = 1000 if quick else 3000
    calls = 2000 if quick else 5000
    total = (256 if quick else 1024) * MiB  # bytes per bandwidth measurement
    sizes = [1, 16] if quick else [1, 16, 64, 256]
    jobs = [("pingpong", ["64", str(iters)]), ("async", [str(calls), "64", "64"])]
    for mib in sizes:
        size = mib * MiB
        jobs.append(("stream", ["%dM" % mib, str(max(4, total // size)), "4"]))
    return jobs


def commands(a, torch_python):
    b = os.path.join(a.builddir, "bench")
    cmds = {
        "weft": [os.path.join(b, "bench_rpc")],
        "raw_grpc_bidi": [os.path.join(b, "baseline_grpc")],
        "raw_tcp": [os.path.join(b, "baseline_tcp")],
    }
    if torch_python:
        cmds["torch_rpc"] = [torch_python, os.path.join(HERE, "torch_rpc.py")]
    return cmds


def main():
    a = parse_args()
    torch_python = None
    if not a.skip_torch:
        torch_python = find_torch_python(a)
        if torch_python is None:
            print("run_rpc: no python with torch found; torch_rpc skipped", file=sys.stderr)
    cmds = commands(a, torch_python)
    for name, cmd in cmds.items():
        if name != "torch_rpc" and not os.access(cmd[0], os.X_OK):
            print("run_rpc: %s not built (%s missing); run meson compile -C %s" % (name, cmd[0], a.builddir),
                  file=sys.stderr)
    systems = [s for s in SYSTEMS if s in cmds]
    jobs = plan(a.quick)
    raw_f = open(a.raw, "w") if a.raw else None

    values = {}  # metric -> system -> [values]
    units = {}
    order = []  # metrics in the order first seen
    failures = []
    t_start = time.monotonic()
    for rnd in range(a.repeat):
        for mode, args in jobs:
            k = rnd % len(systems)
            for system in systems[k:] + systems[:k]:
                cmd = cmds[system] + [mode] + args
                if system != "torch_rpc" and not os.access(cmd[0], os.X_OK):
                    failures.append((system, mode, "not built"))
                    continue
                lines, err = run_one(cmd, a.timeout, a.verbose)
                if err:
                    failures.append((system, " ".join([mode] + args), err))
                    print("run_rpc: %s %s failed: %s" % (system, " ".join([mode] + args), err), file=sys.stderr)
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

    out_f = open(a.out, "w") if a.out else None
    weft_missing = False
    for m in order:
        med = {s: statistics.median(v) for s, v in values[m].items() if v}
        w = med.get("weft")
        lower_better = units[m] in LOWER_IS_BETTER_UNITS
        vs = {}
        peers = {}
        for s in systems:
            if s == "weft":
                continue
            p = med.get(s)
            peers[s] = fmt(p)
            if w is None or p is None or w == 0 or p == 0:
                vs[s] = None
            else:
                vs[s] = round(p / w if lower_better else w / p, 3)
        if w is None:
            weft_missing = True
        res = {"bench": "rpc", "metric": m, "value": fmt(w), "unit": units[m], "vs": vs,
               "ratio": "peer/weft" if lower_better else "weft/peer", "peers": peers,
               "runs": len(values[m].get("weft", []))}
        text = json.dumps(res, separators=(",", ":"))
        print(text, flush=True)
        if out_f:
            out_f.write(text + "\n")
    if out_f:
        out_f.close()
    print("run_rpc: %d rounds in %.0f s%s" % (a.repeat, time.monotonic() - t_start,
                                              ", %d failed runs" % len(failures) if failures else ""),
          file=sys.stderr)
    return 1 if weft_missing or not order else 0


if __name__ == "__main__":
    sys.exit(main())
