#!/usr/bin/env python3
"""torch side of the GPU all_reduce benchmark (bench/run_cuda.py): torch.distributed's gloo
backend with CUDA tensors (ProcessGroupGloo copies them to pinned host memory, runs its CPU
all_reduce, and copies back), world 2 on one host: two processes sharing device 0 (devices 0 and
1 when there are two), f32 sum from 1 to 256 MiB, the median of ITERS runs after 2 warm-up runs,
timed on rank 0 between barriers, as bench/cuda.c times weft. One JSON line per size:

  {"system":"torch_gloo_cuda","op":"all_reduce","world":2,"bytes":..,"time_us":..,"algbw":..}

or {"system":"torch_gloo_cuda","skipped":"<why>"} where this torch has no CUDA (Debian's
python3-torch is built without it) or sees no device.

  torch_gloo_cuda.py [ITERS]
"""
import json
import sys
import time
import warnings

from torchlib import fork_ranks, join_gloo

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def rank_main(a, rank, port):
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    join_gloo(rank, 2, port, 600)
    dev = torch.device("cuda", rank % min(2, torch.cuda.device_count()))
    for size in SIZES:
        x = torch.zeros(size // 4, dtype=torch.float32, device=dev)
        for _ in range(2):
            dist.all_reduce(x)
        torch.cuda.synchronize(dev)
        v = []
        for _ in range(a):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            torch.cuda.synchronize(dev)
            v.append((time.perf_counter() - t0) * 1e6)
        v.sort()
        if rank == 0:
            us = v[len(v) // 2]
            print(json.dumps({"system": "torch_gloo_cuda", "op": "all_reduce", "world": 2,
                              "bytes": size, "time_us": round(us, 1),
                              "algbw": round(size / us / 1e3, 3)}), flush=True)
    return True


def main():
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    try:
        import torch
    except ImportError as e:
        print(json.dumps({"system": "torch_gloo_cuda", "skipped": "no torch: %s" % e}))
        return 0
    if not torch.backends.cuda.is_built():
        print(json.dumps({"system": "torch_gloo_cuda",
                          "skipped": "torch %s is built without CUDA" % torch.__version__}))
        return 0
    # Asked in a child: CUDA initialised here would not survive the ranks' fork.
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=lambda: q.put(__import__("torch").cuda.device_count()))
    p.start()
    p.join()
    n = q.get() if p.exitcode == 0 else 0
    if n == 0:
        print(json.dumps({"system": "torch_gloo_cuda", "skipped": "torch sees no CUDA device"}))
        return 0
    return fork_ranks("torch_gloo_cuda", 2, rank_main, iters, 3600)


if __name__ == "__main__":
    sys.exit(main())
