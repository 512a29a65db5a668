#!/usr/bin/env python3
"""The DDP reducer's benchmark (bench/RESULTS.md, "The DDP reducer"): weft's dp_train with the
bucketed reducer against its flat all_reduce path and torch DistributedDataParallel (gloo), in
one run, world 2 on this host, one thread per rank.

Rows (each a median over --repeat rounds; in each round the systems run in turn, the order
rotating between rounds):

  overlap   MLP 784-4096-4096-10, batch 256 per rank, --limit LIMIT samples (1 epoch):
            step_ms (training seconds / steps) of weft --reducer ddp, weft --reducer flat and
            torch_ddp (bench/torch_ddp_train.py --hidden 4096,4096); comm_hidden (weft ddp: the
            share of the reductions' time that came before backward ended). Targets: weft ddp's
            step <= 0.8x torch's; comm_hidden >= 0.5.
  compress  MLP 784-256-10, batch 64, 2 epochs: final_acc and wire_mib_per_step of weft ddp
            with --compress none, fp16 and bf16. Targets: fp16 bytes on the wire halved and its
            accuracy within 0.005 of f32's.
  default   dp_train's defaults (MLP 784-256-10, batch 64), 1 epoch: samples_per_s of weft ddp,
            weft flat and torch_ddp (the reducer must not be slower than the flat path).

Each program prints one JSON line (weftrun's "[rank 0] " prefix is stripped); the runner prints
one JSON object per (row, metric, system) with the median and the ratios against the peers, and
appends them to --out (default bench/results-ddp-DATE.jsonl; --quick: 1 round, not saved).
Python 3 standard library only.
"""
import datetime
import os
import sys

from benchlib import (emit_results, find_torch_python, median_of, train_bench_args, train_bench_tail,
                      train_rounds)

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args():
    p = train_bench_args(__doc__, "1 round, smaller runs, not saved", 3)
    p.add_argument("--limit", type=int, default=10240, help="samples of the overlap row (default 10240: 20 steps)")
    a = train_bench_tail(p, "results file (default bench/results-ddp-DATE.jsonl)")
    if a.quick:
        a.repeat, a.limit = 1, 2048
    return a


def main():
    a = parse_args()
    torch_python = None if a.skip_torch else find_torch_python(a)
    if torch_python is None:
        print("run_ddp: no python with torch (or --skip-torch): torch_ddp rows skipped", file=sys.stderr)
    weftrun = os.path.join(a.builddir, "tools", "weftrun")
    dp = os.path.join(a.builddir, "examples", "dp_train")
    torch_ddp = os.path.join(HERE, "torch_ddp_train.py")

    def weft(*opts):
        return [weftrun, "-n", "2", dp, "--json", "--data", a.data] + list(opts)

    def torch(*opts):
        return [torch_python, torch_ddp, "2", "--json", "--data", a.data] + list(opts)

    big = ["--epochs", "1", "--limit", str(a.limit), "--batch", "256", "--hidden", "4096,4096"]
    small2 = ["--epochs", "1" if a.quick else "2"]
    small1 = ["--epochs", "1"] + (["--limit", "6000"] if a.quick else [])
    rows = [
        ("overlap", [("weft_ddp", weft(*big, "--reducer", "ddp")),
                     ("weft_flat", weft(*big, "--reducer", "flat"))]
         + ([("torch_ddp", torch(*big))] if torch_python else [])),
        ("compress", [("weft_f32", weft(*small2)), ("weft_fp16", weft(*small2, "--compress", "fp16")),
                      ("weft_bf16", weft(*small2, "--compress", "bf16"))]),
        ("default", [("weft_ddp", weft(*small1, "--reducer", "ddp")),
                     ("weft_flat", weft(*small1, "--reducer", "flat"))]
         + ([("torch_ddp", torch(*small1))] if torch_python else [])),
    ]
    got, failures = train_rounds("run_ddp", rows, a.repeat, a.timeout, tag=lambda row: {"row": row})

    def med(row, system, key):
        return median_of(got, row, system, key)

    date = datetime.date.today().isoformat()
    results = []

    def emit(row, metric, system, unit, vs=None, target=None):
        v = med(row, system, metric)
        if v is None:
            return
        r = {"bench": "ddp", "row": row, "metric": metric, "system": system, "value": v, "unit": unit,
             "runs": len(got.get((row, system), [])), "date": date}
        if vs:
            r["vs"] = {p: (round(v / pv, 3) if pv else None) for p, pv in vs.items() if pv is not None}
        if target is not None:
            r["target"] = target
        results.append(r)

    emit("overlap", "step_ms", "weft_ddp", "ms",
         vs={"torch_ddp": med("overlap", "torch_ddp", "step_ms"),
             "weft_flat": med("overlap", "weft_flat", "step_ms")},
         target="step_ms vs torch_ddp <= 0.8")
    emit("overlap", "step_ms", "weft_flat", "ms", vs={"torch_ddp": med("overlap", "torch_ddp", "step_ms")})
    emit("overlap", "step_ms", "torch_ddp", "ms")
    emit("overlap", "comm_hidden", "weft_ddp", "fraction", target=">= 0.5")
    for s in ("weft_f32", "weft_fp16", "weft_bf16"):
        emit("compress", "final_acc", s, "fraction",
             vs=None if s == "weft_f32" else {"weft_f32": med("compress", "weft_f32", "final_acc")},
             target=None if s == "weft_f32" else "within 0.005 of weft_f32")
        emit("compress", "wire_mib_per_step", s, "MiB",
             vs=None if s == "weft_f32" else {"weft_f32": med("compress", "weft_f32", "wire_mib_per_step")},
             target=None if s == "weft_f32" else "0.5 of weft_f32")
    emit("default", "samples_per_s", "weft_ddp", "samples/s",
         vs={"weft_flat": med("default", "weft_flat", "samples_per_s"),
             "torch_ddp": med("default", "torch_ddp", "samples_per_s")},
         target="vs weft_flat >= 1 (no regression)")
    emit("default", "samples_per_s", "weft_flat", "samples/s")
    emit("default", "samples_per_s", "torch_ddp", "samples/s")
    emit_results(results, None if a.quick else a.out or os.path.join(HERE, "results-ddp-%s.jsonl" % date), "a")
    print("run_ddp: %d rounds, %d failures" % (a.repeat, failures), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
