#!/usr/bin/env python3
"""torch.distributed.rpc (TensorPipe backend) peer of weft's RPC benchmark.

Two processes on 127.0.0.1: this one is rank 0 ("worker0", the caller) and
starts rank 1 ("worker1", the callee) as a subprocess of the same script. The
modes and their warm-up are those of bench/bench_common.h:

  torch_rpc.py pingpong SIZE ITERS        rpc_sync(echo) of a SIZE-byte uint8 tensor
  torch_rpc.py stream SIZE COUNT [WINDOW] rpc_async(sink) of a SIZE-byte tensor, WINDOW in flight;
                                          sink returns a small int
  torch_rpc.py async N [INFLIGHT [SIZE]]  rpc_async(echo), INFLIGHT futures in flight

Prints {"system":"torch_rpc","metric":...,"value":...} lines on stdout. Without
torch it prints nothing, says so on stderr and exits 0.

TensorPipe keeps its own choice of transports and channels unless told
(--transports, --channels). With Debian's torch 1.13 on the 2-vCPU VMs the
default works (the shm transport and the cma channel are both usable there),
and its 64-byte round trip was ~3x faster than with --transports uv (~350 vs
~1000 us); the default is what a torch user gets, so it is what is compared.
"""
import argparse
import collections
import os
import sys
import time

from torchlib import add_rank_args, emit, parse_size, percentile, rpc_main, size_label

DEFAULT_WINDOW = 4
DEFAULT_INFLIGHT = 64
DEFAULT_SMALL = 64


def echo(t):
    return t


def sink(t):
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["pingpong", "stream", "async"])
    p.add_argument("nums", nargs="+", help="SIZE ITERS | SIZE COUNT [WINDOW] | N [INFLIGHT [SIZE]]")
    p.add_argument("--threads", type=int, default=8, help="num_worker_threads of both ranks")
    p.add_argument("--transports", default="",
                   help="comma-separated TensorPipe transports ('' = TensorPipe's default)")
    p.add_argument("--channels", default="",
                   help="comma-separated TensorPipe channels ('' = TensorPipe's default)")
    p.add_argument("--timeout", type=float, default=300.0, help="rpc_timeout in seconds")
    add_rank_args(p)
    a = p.parse_args(argv)
    n = [parse_size(x) for x in a.nums]
    if a.mode == "pingpong" and len(n) == 2:
        a.size, a.count, a.window = n[0], n[1], 1
    elif a.mode == "stream" and len(n) in (2, 3):
        a.size, a.count = n[0], n[1]
        a.window = n[2] if len(n) == 3 else DEFAULT_WINDOW
    elif a.mode == "async" and 1 <= len(n) <= 3:
        a.count = n[0]
        a.window = n[1] if len(n) >= 2 else DEFAULT_INFLIGHT
        a.size = n[2] if len(n) == 3 else DEFAULT_SMALL
    else:
        p.error("wrong number of arguments for mode %s" % a.mode)
    if min(a.size, a.count, a.window) <= 0:
        p.error("sizes and counts must be positive")
    # Same warm-up as bench_common.h's bench_warmup.
    w = a.count // 16 if a.mode == "stream" else a.count // 10
    a.warmup = max(w, a.window, 1)
    return a


def emit_line(a, metric, value, unit):
    emit("torch_rpc", metric, value, unit, size=a.size, count=a.count, window=a.window, warmup=a.warmup,
         threads=a.threads, transports=a.transports or "default", channels=a.channels or "default")


def backend_options(a, rpc):
    kw = {"num_worker_threads": a.threads, "rpc_timeout": a.timeout, "init_method": "env://"}
    if a.transports:
        kw["_transports"] = a.transports.split(",")
    if a.channels:
        kw["_channels"] = a.channels.split(",")
    return rpc.TensorPipeRpcBackendOptions(**kw)


def measure(a, torch, rpc):
    to = rpc.get_worker_info("worker1")
    t = torch.ones(a.size, dtype=torch.uint8)
    now = time.perf_counter_ns
    if a.mode == "pingpong":
        for _ in range(a.warmup):
            rpc.rpc_sync(to, echo, args=(t,))
        rtt = []
        for _ in range(a.count):
            t0 = now()
            r = rpc.rpc_sync(to, echo, args=(t,))
            rtt.append(now() - t0)
        assert r.numel() == a.size
        rtt.sort()
        label = size_label(a.size)
        emit_line(a, "latency_p50_" + label, percentile(rtt, 50) / 1e3, "us")
        emit_line(a, "latency_p99_" + label, percentile(rtt, 99) / 1e3, "us")
        return

    fn = sink if a.mode == "stream" else echo

    def run(n):
        q = collections.deque()
        for _ in range(n):
            if len(q) >= a.window:
                q.popleft().wait()
            q.append(rpc.rpc_async(to, fn, args=(t,)))
        while q:
            q.popleft().wait()

    run(a.warmup)
    t0 = now()
    run(a.count)
    elapsed = now() - t0
    if a.mode == "stream":
        emit_line(a, "bandwidth_" + size_label(a.size), a.size * a.count / elapsed, "GB/s")
    else:
        emit_line(a, "async_throughput", a.count * 1e9 / elapsed, "calls/s")


def run_rank(a):
    import torch
    import torch.distributed.rpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    rpc.init_rpc("worker%d" % a.rank, rank=a.rank, world_size=2,
                 rpc_backend_options=backend_options(a, rpc))
    try:
        if a.rank == 0:
            measure(a, torch, rpc)
    finally:
        rpc.shutdown()  # graceful: waits for the other rank


def main(argv):
    return rpc_main("torch_rpc.py", __file__, argv, parse_args(argv), 2, run_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
