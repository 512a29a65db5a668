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
  weft           BUILDDIR/bench/bench_rpc      (bench/rpc.c; ranks of one host: shared-memory rings)
  weft_noshm     the same with WEFT_SHM=0      (the network transports: gRPC stream, direct TCP)
  raw_grpc_bidi  BUILDDIR/bench/baseline_grpc  (bench/baseline_grpc.c)
  raw_tcp        BUILDDIR/bench/baseline_tcp   (bench/baseline_tcp.c)
  torch_rpc      bench/torch_rpc.py under a python that has torch

Metrics: latency_p50_<SIZE>, latency_p99_<SIZE> (us, ping-pong of a payload of 64 B, and
with the full run 4 KiB, 64 KiB and 1 MiB too),
async_throughput (calls/s, 64-byte echoes, 64 in flight), bandwidth_<SIZE>
(GB/s = 1e9 B/s, one-way tensors, 4 calls in flight, the callee replies small).
With --out FILE --plot DIR, the latency and bandwidth sweeps are drawn into DIR/rpc_latency.png
and DIR/rpc_bandwidth.png by bench/plot.py (size against time or GB/s, one line per system; needs
python3-matplotlib). Python 3 standard library only otherwise.
"""
import os
import subprocess
import sys
import time

from benchlib import Values, as_is, emit_results, fmt, run_rounds, runner_args, say_done, torch_python_for, versus

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "weft_noshm", "raw_grpc_bidi", "raw_tcp", "torch_rpc"]
LOWER_IS_BETTER_UNITS = {"us"}
MiB = 1 << 20


def plan(quick):
    """The measurements: (mode, args) shared verbatim by every system."""
    iters = 1000 if quick else 3000
    calls = 2000 if quick else 5000
    total = (256 if quick else 1024) * MiB  # bytes per bandwidth measurement
    sizes = [1, 16] if quick else [1, 16, 64, 256]
    jobs = [("pingpong", ["64", str(iters)])]
    if not quick:
        jobs += [("pingpong", [str(n), str(iters)]) for n in (4096, 65536)]
        jobs.append(("pingpong", [str(MiB), str(iters // 10)]))
    jobs.append(("async", [str(calls), "64", "64"]))
    for mib in sizes:
        size = mib * MiB
        jobs.append(("stream", ["%dM" % mib, str(max(4, total // size)), "4"]))
    return jobs


def commands(a, torch_python):
    b = os.path.join(a.builddir, "bench")
    cmds = {
        "weft": [os.path.join(b, "bench_rpc")],
        "weft_noshm": ["/usr/bin/env", "WEFT_SHM=0", os.path.join(b, "bench_rpc")],
        "raw_grpc_bidi": [os.path.join(b, "baseline_grpc")],
        "raw_tcp": [os.path.join(b, "baseline_tcp")],
    }
    if torch_python:
        cmds["torch_rpc"] = [torch_python, os.path.join(HERE, "torch_rpc.py")]
    return cmds


def named(system):
    """A program's raw line under the system it was run as (weft_noshm prints "weft")."""
    return lambda ln: [(ln["metric"], system, ln["value"], ln.get("unit", ""))]


def plot(out_path, outdir):
    """Draws the sweeps of the results just written (bench/plot.py, with a python that has
    matplotlib: this one, else Debian's)."""
    try:
        import matplotlib  # noqa: F401
        py = sys.executable
    except ImportError:
        py = "/usr/bin/python3"
    rc = subprocess.call([py, os.path.join(HERE, "plot.py"), "--out", outdir, out_path])
    if rc != 0:
        print("run_rpc: plotting failed (python3-matplotlib?)", file=sys.stderr)


def main():
    a = runner_args(__doc__, "fewer iterations; bandwidth at 1 and 16 MiB only",
                    "also write the result JSON lines to this file", "do not run torch.distributed.rpc")
    torch_python = torch_python_for(a, "run_rpc", "torch_rpc")
    cmds = commands(a, torch_python)
    for name, cmd in cmds.items():
        if name != "torch_rpc" and not os.access(cmd[-1], os.X_OK):
            print("run_rpc: %s not built (%s missing); run meson compile -C %s" % (name, cmd[0], a.builddir),
                  file=sys.stderr)
    systems = [s for s in SYSTEMS if s in cmds]
    groups = [[(s, cmds[s] + [mode] + args, " ".join([mode] + args), named(s)) for s in systems]
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
    if a.plot and a.out:
        plot(a.out, a.plot)
    elif a.plot:
        print("run_rpc: --plot draws from the --out file; give both", file=sys.stderr)
    say_done("run_rpc", a.repeat, t_start, failures)
    return 1 if weft_missing or not values.order else 0


if __name__ == "__main__":
    sys.exit(main())
