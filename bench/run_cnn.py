#!/usr/bin/env python3
"""The CNN training benchmark: weft's examples/cnn_train (conv2d, max_pool2d, batch_norm2d,
a ResNet BasicBlock, the DDP reducer) against its torch twin bench/torch_cnn_train.py (torch's
CPU conv2d; DistributedDataParallel over gloo at world > 1), in one run on this host, one
thread per rank, at world 1 and 2.

Both train the same model (conv1-bn-relu-maxpool, BasicBlock(16->32, stride 2), avgpool, fc;
15034 parameters) with the same batch per rank, SGD settings, epochs and --limit. In each round
the two systems run in turn at each world size, the order rotating between rounds; the runner
prints one JSON object per (world, metric, system) with the median over the rounds and, for
weft, the ratio to torch ("vs"): samples_per_s (all ranks' training samples / training
seconds, evaluation excluded), step_ms (training seconds / steps) and final_acc (test accuracy
after the last epoch). Each raw result goes to stderr as it comes.

  run_cnn.py [--repeat 2] [--epochs 1] [--limit 12000] [--batch 64] [--worlds 1,2]
             [--quick] [--out FILE] [--skip-torch] [--torch-python PY]

--quick: 1 round, --limit 6000. Results are appended to --out when it is given.
Python 3 standard library only.
"""
import datetime
import os
import sys

from benchlib import (emit_results, find_torch_python, median_of, train_bench_args, train_bench_tail,
                      train_rounds)

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args():
    p = train_bench_args(__doc__, "1 round, --limit 6000", 2, "rounds (default 2); medians are reported")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--limit", type=int, default=12000, help="training samples (default 12000; 0: all 60000)")
    p.add_argument("--batch", type=int, default=64, help="per rank (default 64)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--worlds", default="1,2", help="world sizes (default 1,2)")
    a = train_bench_tail(p, "append the result lines to this file")
    if a.quick:
        a.repeat, a.limit = 1, 6000
    a.world_list = [int(w) for w in a.worlds.split(",")]
    return a


def main():
    a = parse_args()
    torch_python = None if a.skip_torch else find_torch_python(a)
    if torch_python is None:
        print("run_cnn: no python with torch (or --skip-torch): torch rows skipped", file=sys.stderr)
    weftrun = os.path.join(a.builddir, "tools", "weftrun")
    cnn = os.path.join(a.builddir, "examples", "cnn_train")
    twin = os.path.join(HERE, "torch_cnn_train.py")
    common = ["--json", "--data", a.data, "--epochs", str(a.epochs), "--batch", str(a.batch),
              "--lr", repr(a.lr), "--momentum", repr(a.momentum), "--threads", "1"]
    if a.limit > 0:
        common += ["--limit", str(a.limit)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")

    rows = []
    for w in a.world_list:
        systems = [("weft", [weftrun, "-n", str(w), cnn] + common)]
        if torch_python:
            systems.append(("torch", [torch_python, twin, str(w)] + common))
        rows.append((w, systems))

    got, failures = train_rounds("run_cnn", rows, a.repeat, a.timeout, env=env, label=lambda w: "world %d" % w)

    def med(w, system, key):
        return median_of(got, w, system, key)

    date = datetime.date.today().isoformat()
    results = []
    for w, systems in rows:
        for system, _ in systems:
            for metric, unit in (("samples_per_s", "samples/s"), ("step_ms", "ms"), ("final_acc", "fraction")):
                v = med(w, system, metric)
                if v is None:
                    continue
                r = {"bench": "cnn", "world": w, "metric": metric, "system": system, "value": round(v, 4),
                     "unit": unit, "runs": len(got.get((w, system), [])), "epochs": a.epochs,
                     "limit": a.limit, "batch": a.batch, "date": date}
                peer = med(w, "torch", metric) if system == "weft" else None
                if peer:
                    r["vs"] = {"torch": round(v / peer, 3)}
                results.append(r)
    emit_results(results, a.out, "a")
    print("run_cnn: %d rounds, %d failures" % (a.repeat, failures), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
