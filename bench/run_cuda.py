#!/usr/bin/env python3
"""The GPU benchmark (issue: CUDA gradient reduction): bench_cuda (pinned vs pageable copies, the
sum kernel against a device-to-device copy, all_reduce of device tensors at world 2 through CUDA
IPC and staged through pinned memory) and its torch twin (bench/torch_gloo_cuda.py: gloo with
CUDA tensors), in one run. Writes every JSON line to --out and prints the figures the issue asks
for. Where no GPU is present both say so ("skipped") and the run ends there.

  python3 bench/run_cuda.py --builddir build [--iters 10] [--out bench/results-cuda-DATE.jsonl]
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


FAILED = []


def lines(cmd, env=None):
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    sys.stderr.write(out.stderr)
    if out.returncode != 0:
        FAILED.append("%s exited with %d" % (os.path.basename(cmd[-2] if cmd[0] == sys.executable else cmd[0]),
                                            out.returncode))
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builddir", default="build")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args()
    rows = lines([os.path.join(a.builddir, "bench", "bench_cuda"), "all", str(a.iters)])
    rows += lines([sys.executable, os.path.join(HERE, "torch_gloo_cuda.py"), str(a.iters)])
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    for r in rows:
        if "skipped" in r:
            print("%s: skipped: %s" % (r["system"], r["skipped"]))
    copies = [r for r in rows if r.get("bench") == "copy"]
    if copies:
        print("\n64 MiB copies, GB/s")
        for r in copies:
            print("  %-8s %s  %6.2f" % (r["memory"], r["dir"], r["gbps"]))
    for r in rows:
        if r.get("bench") == "kernel":
            print("\nsum kernel %.1f GB/s, device copy %.1f GB/s: %.0f%% (target >= 70%%)" %
                  (r["sum_gbps"], r["copy_gbps"], 100 * r["sum_over_copy"]))
    ar = {}
    ipc_before = 0
    for r in rows:
        if r.get("op") == "all_reduce":
            t = r["time_us"]
            if r["system"] == "weft_cuda_ipc":
                # the counter is cumulative: a row that did not raise it was staged after all
                if r.get("ipc_ops", 0) <= ipc_before:
                    t = "%s (staged!)" % t
                ipc_before = r.get("ipc_ops", 0)
            ar.setdefault(r["bytes"], {})[r["system"]] = t
    if ar:
        print("\nall_reduce f32 sum, world 2, median us (ratio: torch's time / weft's)")
        print("  %10s %12s %12s %12s %8s" % ("bytes", "weft ipc", "weft staged", "torch gloo", "ratio"))
        for b in sorted(ar):
            d = ar[b]
            weft = [v for k, v in d.items() if k.startswith("weft") and isinstance(v, (int, float))]
            best = min(weft) if weft else None
            t = d.get("torch_gloo_cuda")
            print("  %10d %12s %12s %12s %8s" % (
                b, d.get("weft_cuda_ipc", "-"), d.get("weft_cuda_staged", "-"), t if t else "-",
                "%.2fx" % (t / best) if t and best else "-"))
    for f in FAILED:
        print("FAILED: %s (the figures above are incomplete)" % f, file=sys.stderr)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
