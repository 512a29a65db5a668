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
import os
import sys
import time

from benchlib import Values, as_is, emit_results, fmt, run_rounds, runner_args, say_done, torch_python_for, versus

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "raw_grpc_bidi", "raw_tcp", "torch_rpc"]
LOWER_IS_BETTER_UNITS = {"us"}
MiB = 1 << 20


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
    a = runner_args(__doc__, "fewer iterations; bandwidth at 1 and 16 MiB only",
                    "also write the result JSON lines to this file", "do not run torch.distributed.rpc")
    torch_python = torch_python_for(a, "run_rpc", "torch_rpc")
    cmds = commands(a, torch_python)
    for name, cmd in cmds.items():
        if name != "torch_rpc" and not os.access(cmd[0], os.X_OK):
            print("run_rpc: %s not built (%s missing); run meson compile -C %s" % (name, cmd[0], a.builddir),
                  file=sys.stderr)
    systems = [s for s in SYSTEMS if s in cmds]
    groups = [[(s, cmds[s] + [mode] + args, " ".join([mode] + args), as_is) for s in systems]
              for mode, args in plan(a.quick)]
    values = Values()
    t_start = time.monotonic()
    failures = run_rounds("run_rpc", a, groups, values.add)

    results = []
    weft_missing = False
    for m in values.order:
        med = values.medians(m)
        lower_better = values.units[m] in LOWER_IS_BETTER_UNITS
        vs, peers = versus(med, [s for s in systems if s != "weft"], lower_better)
        if med.get("weft") is None:
            weft_missing = True
        results.append({"bench": "rpc", "metric": m, "value": fmt(med.get("weft")), "unit": values.units[m],
                        "vs": vs, "ratio": "peer/weft" if lower_better else "weft/peer", "peers": peers,
                        "runs": values.runs(m)})
    emit_results(results, a.out, "w")
    say_done("run_rpc", a.repeat, t_start, failures)
    return 1 if weft_missing or not values.order else 0


if __name__ == "__main__":
    sys.exit(main())
