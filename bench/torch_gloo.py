#!/usr/bin/env python3
"""torch.distributed (gloo) side of the collectives benchmark (bench/run_collectives.py).

Forks WORLD ranks over loopback (the parent holds the TCPStore on a free port) and runs
the points of bench/coll_common.h with the same rules: f32 zeros, sum, root 0, blocking
calls; warm-up iterations, then about --budget seconds of timed iterations (at least 3
unless one takes longer than the budget), the maximum over the ranks of each rank's time.
Rank 0 prints one JSON line per point:

  {"system":"torch_gloo","op":"all_reduce","world":2,"bytes":4096,"time_us":..,
   "algbw":..,"busbw":..,"iters":..}

and, for an op that the gloo backend does not implement, one line
{"system":"torch_gloo","op":..,"world":..,"skipped":"<torch's error text>"}.
With torch 1.13: reduce_scatter (and _reduce_scatter_base) is not supported by
ProcessGroupGloo, so it is skipped; all_gather goes to a list of views of one flat
output (all_gather_into_tensor is not supported either); all_to_all uses
all_to_all_single (the list form all_to_all is not supported).

  torch_gloo.py WORLD [--quick] [--ops OP,...] [--sizes SIZE,...] [--budget S]
                [--max-iters N] [--timeout S]
"""
import argparse
import json
import sys
import time
import warnings

from torchlib import fork_ranks, join_gloo, parse_size

OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"]
FULL_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "4K,1M,16M"
SYSTEM = "torch_gloo"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("world", type=int)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes")
    p.add_argument("--budget", type=float)
    p.add_argument("--max-iters", type=int)
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args()
    a.ops = a.ops.split(",")
    for op in a.ops:
        if op not in OPS:
            p.error("unknown op %s" % op)
    a.sizes = [parse_size(s) for s in (a.sizes or (QUICK_SIZES if a.quick else FULL_SIZES)).split(",")]
    if a.budget is None:
        a.budget = 0.1 if a.quick else 0.4
    if a.max_iters is None:
        a.max_iters = 1000 if a.quick else 10000
    if a.world < 2 or any(b % 4 or (b // 4) % a.world for b in a.sizes):
        p.error("every size must split into WORLD f32 parts")
    return a


def counts(op, nbytes, world):
    """f32 elements of the input and output on each rank (coll_counts of coll_common.h)."""
    n = nbytes // 4
    if op == "all_gather":
        return n // world, n
    if op == "reduce_scatter":
        return n, n // world
    if op == "all_to_all":
        return n, n
    return n, 0


def busbw_factor(op, n):
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def warmup_iters(a, nbytes):
    if nbytes <= 256 << 10:
        return 5 if a.quick else 10
    if nbytes <= 4 << 20:
        return 3
    return 2 if nbytes <= 16 << 20 else 1


def timed_iters(a, est):
    if est <= 0:
        return a.max_iters
    want = a.budget / est
    n = (3 if want < 3 else int(want + 0.5)) if est <= a.budget else 1
    return min(n, a.max_iters)


def rank_main(a, rank, port):
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    join_gloo(rank, a.world, port, 120)
    W = a.world

    def max_over_ranks(v):
        t = torch.tensor([v], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def make_fn(op, x, y):
        if op == "all_reduce":
            return lambda: dist.all_reduce(x)
        if op == "broadcast":
            return lambda: dist.broadcast(x, 0)
        if op == "all_gather":
            outs = list(y.chunk(W))
            return lambda: dist.all_gather(outs, x)
        if op == "reduce_scatter":
            ins = list(x.chunk(W))
            return lambda: dist.reduce_scatter(y, ins)
        return lambda: dist.all_to_all_single(y, x)

    for op in a.ops:
        # Probe once on a small tensor: an unsupported op fails locally on every rank alike.
        n_in, n_out = counts(op, 64 * W, W)
        x = torch.zeros(n_in)
        y = torch.zeros(n_out) if n_out else None
        try:
            make_fn(op, x, y)()
        except RuntimeError as e:
            if rank == 0:
                msg = str(e).splitlines()[0]
                print(json.dumps({"system": SYSTEM, "op": op, "world": W, "skipped": msg},
                                 separators=(",", ":")), flush=True)
                print("torch_gloo: %s skipped: %s" % (op, msg), file=sys.stderr, flush=True)
            dist.barrier()
            continue
        for nbytes in a.sizes:
            n_in, n_out = counts(op, nbytes, W)
            x = torch.zeros(n_in)
            y = torch.zeros(n_out) if n_out else None
            fn = make_fn(op, x, y)
            w = warmup_iters(a, nbytes)
            t0 = time.perf_counter()
            t_first = t0
            for i in range(w):
                fn()
                if i == 0:
                    t_first = time.perf_counter()
            t1 = time.perf_counter()
            est = (t1 - t_first) / (w - 1) if w > 1 else t1 - t0
            iters = timed_iters(a, max_over_ranks(est))
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            t1 = time.perf_counter()
            per_op = max_over_ranks((t1 - t0) / iters)
            if rank == 0:
                algbw = nbytes / per_op / 1e9
                print(json.dumps({"system": SYSTEM, "op": op, "world": W, "bytes": nbytes,
                                  "time_us": round(per_op * 1e6, 3), "algbw": float("%.6g" % algbw),
                                  "busbw": float("%.6g" % (algbw * busbw_factor(op, W))),
                                  "iters": iters}, separators=(",", ":")), flush=True)
            del fn, x, y
    dist.barrier()
    dist.destroy_process_group()


def main():
    a = parse_args()
    return fork_ranks("torch_gloo", a.world, rank_main, a, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
