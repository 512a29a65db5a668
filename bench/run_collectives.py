#!/usr/bin/env python3
"""weft's collectives benchmark against torch.distributed (gloo) and Open MPI.

For each op and world size, every system runs all sizes in turn (the order of
the systems rotating from one (op, world) to the next, and between repeats) so
that drift of a shared machine hits all systems alike. Prints two JSON objects
per (op, world, bytes) on stdout, one per metric:

  {"bench":"collectives","op":"all_reduce","world":2,"bytes":1048576,
   "metric":"busbw","value":1.9,"unit":"GB/s",
   "vs":{"torch_gloo":1.4,"mpi":0.3,"mpi_tcp":1.1},"ratio":"weft/peer",
   "peers":{"torch_gloo":1.36,...},"time_us":540.1}

value is weft's (median over the repeats); every ratio is weft/peer, so > 1
means weft is better; null where the peer did not run the point (gloo in
torch 1.13 has no reduce_scatter). Definitions are those of nccl-tests (see
bench/coll_common.h): bytes is the tensor of all_reduce and broadcast, the
OUTPUT of all_gather, the INPUT of reduce_scatter and all_to_all; algbw =
bytes / time; busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
reduce_scatter, all_to_all), 1 (broadcast). Each raw line goes to stderr (and
to --raw FILE).

Systems and their programs (same sizes, warm-up and iteration rules for all):
  weft        BUILDDIR/bench/bench_collectives WORLD  (bench/collectives.c; ranks of one host:
              shared-memory rings and cross-memory reads)
  weft_noshm  the same with WEFT_SHM=0 WEFT_COLL_CMA=0 (the network transports only: what
              ranks on different hosts use)
  torch_gloo  bench/torch_gloo.py WORLD under a python that has torch
  mpi         mpirun -np WORLD BUILDDIR/bench/mpi_collectives (bench/mpi_collectives.c,
              compiled here with mpicc), Open MPI's default transports
  mpi_tcp     the same with --mca btl tcp,self

Sizes 4K..256M in powers of 4 (f32); --quick: 4K, 1M, 16M and a shorter
budget per point. Python 3 standard library only.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

from benchlib import emit_results, fmt, record_raw, run_one, say_done, torch_python_for

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["weft", "weft_noshm", "torch_gloo", "mpi", "mpi_tcp"]
OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"]
METRICS = ["algbw", "busbw"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builddir", default="build", help="meson build directory (default: build)")
    p.add_argument("--quick", action="store_true", help="sizes 4K, 1M, 16M only, fewer iterations")
    p.add_argument("--out", help="also write the result JSON lines to this file")
    p.add_argument("--raw", help="also write every raw measurement line to this file")
    p.add_argument("--worlds", default="2,4", help="comma list of world sizes (default 2,4)")
    p.add_argument("--ops", default=",".join(OPS), help="comma list of ops (default: all)")
    p.add_argument("--sizes", help="comma list of sizes (K/M suffixes), instead of the default ones")
    p.add_argument("--budget", type=float, help="timed seconds per point (default 0.4, --quick 0.1)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of everything; medians are reported")
    p.add_argument("--skip-torch", action="store_true", help="do not run torch.distributed (gloo)")
    p.add_argument("--skip-mpi", action="store_true", help="do not run Open MPI")
    p.add_argument("--torch-python", help="python with torch (default: this one, else /usr/bin/python3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one (system, op, world) run may take")
    p.add_argument("--verbose", action="store_true", help="pass the programs' stderr through")
    a = p.parse_args()
    a.worlds = [int(w) for w in a.worlds.split(",")]
    a.ops = a.ops.split(",")
    for op in a.ops:
        if op not in OPS:
            p.error("unknown op %s (one of %s)" % (op, ", ".join(OPS)))
    return a


def build_mpi(builddir):
    """Compiles bench/mpi_collectives.c with mpicc into BUILDDIR/bench when stale; returns its path or None."""
    mpicc = shutil.which("mpicc")
    if mpicc is None or shutil.which("mpirun") is None:
        print("run_collectives: mpicc or mpirun not found; mpi skipped", file=sys.stderr)
        return None
    exe = os.path.join(builddir, "bench", "mpi_collectives")
    srcs = [os.path.join(HERE, f) for f in ("mpi_collectives.c", "coll_common.h", "bench_common.h")]
    if os.path.exists(exe) and all(os.path.getmtime(s) <= os.path.getmtime(exe) for s in srcs):
        return exe
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    cmd = [mpicc, "-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-o", exe, srcs[0]]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    if r.returncode != 0:
        print("run_collectives: %s failed; mpi skipped:\n%s" % (" ".join(cmd), r.stdout), file=sys.stderr)
        return None
    return exe


def commands(a, torch_python, mpi_exe):
    """system -> function(world) -> argv, without the common options."""
    exe = os.path.join(a.builddir, "bench", "bench_collectives")
    cmds = {"weft": lambda w: [exe, str(w)],
            "weft_noshm": lambda w: ["/usr/bin/env", "WEFT_SHM=0", "WEFT_COLL_CMA=0", exe, str(w),
                                     "--system", "weft_noshm"]}
    if torch_python:
        cmds["torch_gloo"] = lambda w: [torch_python, os.path.join(HERE, "torch_gloo.py"), str(w)]
    if mpi_exe:
        mpirun = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe"]
        cmds["mpi"] = lambda w: mpirun + ["-np", str(w), mpi_exe]
        cmds["mpi_tcp"] = lambda w: mpirun + ["--mca", "btl", "tcp,self", "-np", str(w), mpi_exe,
                                              "--system", "mpi_tcp"]
    return cmds


def common_opts(a, op):
    opts = ["--ops", op, "--timeout", "%g" % max(10.0, a.timeout - 10.0)]
    if a.quick:
        opts.append("--quick")
    if a.sizes:
        opts += ["--sizes", a.sizes]
    if a.budget:
        opts += ["--budget", "%g" % a.budget]
    return opts


def main():
    a = parse_args()
    torch_python = torch_python_for(a, "run_collectives", "torch_gloo")
    mpi_exe = None if a.skip_mpi else build_mpi(a.builddir)
    cmds = commands(a, torch_python, mpi_exe)
    if not os.access(cmds["weft"](2)[0], os.X_OK):
        print("run_collectives: %s missing; run ninja -C %s bench/bench_collectives"
              % (cmds["weft"](2)[0], a.builddir), file=sys.stderr)
    systems = [s for s in SYSTEMS if s in cmds]
    raw_f = open(a.raw, "w") if a.raw else None

    values = {}  # (op, world, bytes) -> system -> {"algbw": [..], "busbw": [..], "time_us": [..]}
    order = []
    skipped = {}  # (system, op, world) -> text
    failures = []
    t_start = time.monotonic()
    k = 0
    for rnd in range(a.repeat):
        for op in a.ops:
            for world in a.worlds:
                r = k % len(systems)
                k += 1
                for system in systems[r:] + systems[:r]:
                    cmd = cmds[system](world) + common_opts(a, op)
                    t0 = time.monotonic()
                    lines, err = run_one(cmd, a.timeout, a.verbose)
                    if err:
                        failures.append((system, op, world, err))
                        print("run_collectives: %s %s world %d failed: %s" % (system, op, world, err),
                              file=sys.stderr)
                    for ln in lines:
                        record_raw(ln, rnd, raw_f)
                        if "skipped" in ln:
                            skipped[(ln["system"], ln["op"], ln["world"])] = ln["skipped"]
                            continue
                        key = (ln["op"], ln["world"], ln["bytes"])
                        if key not in values:
                            values[key] = {}
                            order.append(key)
                        v = values[key].setdefault(ln["system"], {"algbw": [], "busbw": [], "time_us": []})
                        for m in ("algbw", "busbw", "time_us"):
                            v[m].append(ln[m])
                    print("run_collectives: %s %s world %d: %.1f s" % (system, op, world, time.monotonic() - t0),
                          file=sys.stderr)
    if raw_f:
        raw_f.close()

    results = []
    weft_missing = False
    for key in order:
        op, world, nbytes = key
        med = {s: {m: statistics.median(x) for m, x in d.items() if x} for s, d in values[key].items()}
        w = med.get("weft")
        if w is None:
            weft_missing = True
        for metric in METRICS:
            wv = w[metric] if w else None
            vs = {}
            peers = {}
            for s in systems:
                if s == "weft":
                    continue
                pv = med[s][metric] if s in med else None
                peers[s] = fmt(pv)
                vs[s] = round(wv / pv, 3) if wv and pv else None
            res = {"bench": "collectives", "op": op, "world": world, "bytes": nbytes, "metric": metric,
                   "value": fmt(wv), "unit": "GB/s", "vs": vs, "ratio": "weft/peer", "peers": peers,
                   "time_us": fmt(w["time_us"]) if w else None}
            notes = {s: skipped[(s, op, world)] for s in systems if (s, op, world) in skipped}
            if notes:
                res["skipped"] = notes
            results.append(res)
    emit_results(results, a.out, "w")
    for (s, op, world), text in sorted(skipped.items()):
        print("run_collectives: %s %s world %d skipped: %s" % (s, op, world, text), file=sys.stderr)
    say_done("run_collectives", a.repeat, t_start, len(failures), "round(s)")
    return 1 if weft_missing or not order else 0


if __name__ == "__main__":
    sys.exit(main())
