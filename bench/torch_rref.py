#!/usr/bin/env python3
"""torch.distributed.rpc (TensorPipe backend) peer of weft's remote-reference benchmark
(bench/rref.c; run both with bench/run_rref.py).

Processes on 127.0.0.1: this one is rank 0 ("worker0", the measuring side) and starts the
others as subprocesses of the same script, as bench/torch_rpc.py does. Modes, counts and warm-up
are those of bench/rref.c:

  torch_rref.py latency SIZE ITERS   2 ranks. rpc.remote("worker1", echo, (t,)).to_here() of a
                                     SIZE-byte uint8 tensor, one at a time; the RRef is dropped
                                     after each (outside the timing). Prints
                                     remote_to_here_p50_<SIZE> and remote_to_here_p99_<SIZE> (us).
  torch_rref.py fork N [INFLIGHT]    3 ranks. N times: rpc.remote("worker1", echo, (t,)) of 64
                                     bytes, passed to worker2's pass_back (fork 0->2), which
                                     returns it (fork 2->0); rank 0 checks the owner and drops
                                     both. INFLIGHT (default 16) in flight. The clock stops once
                                     worker1 owns no RRef any more. Prints fork_throughput
                                     (forks/s, two per operation) and fork_ops_throughput (ops/s).

Prints {"system":"torch_rpc","metric":...,"value":...} lines on stdout. Without torch it prints
nothing, says so on stderr and exits 0.
"""
import argparse
import collections
import gc
import os
import sys
import time

from torchlib import add_rank_args, emit, parse_size, percentile, rpc_main, size_label

DEFAULT_INFLIGHT = 16
SMALL = 64


def echo(t):
    return t


def pass_back(rref):
    return rref


def owner_rrefs():
    from torch.distributed.rpc import _rref_context_get_debug_info
    return int(_rref_context_get_debug_info()["num_owner_rrefs"])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["latency", "fork"])
    p.add_argument("nums", nargs="+", help="SIZE ITERS | N [INFLIGHT]")
    p.add_argument("--threads", type=int, default=8, help="num_worker_threads of every rank")
    p.add_argument("--timeout", type=float, default=300.0, help="rpc_timeout in seconds")
    add_rank_args(p)
    a = p.parse_args(argv)
    n = [parse_size(x) for x in a.nums]
    if a.mode == "latency" and len(n) == 2:
        a.size, a.count, a.window, a.world = n[0], n[1], 1, 2
    elif a.mode == "fork" and len(n) in (1, 2):
        a.size, a.count, a.world = SMALL, n[0], 3
        a.window = n[1] if len(n) == 2 else DEFAULT_INFLIGHT
    else:
        p.error("wrong number of arguments for mode %s" % a.mode)
    if min(a.size, a.count, a.window) <= 0:
        p.error("sizes and counts must be positive")
    # Same warm-up as bench_common.h's bench_warmup (a tenth, at least one window).
    a.warmup = max(a.count // 10, a.window, 1)
    return a


def emit_line(a, metric, value, unit):
    emit("torch_rpc", metric, value, unit, size=a.size, count=a.count, window=a.window, warmup=a.warmup,
         threads=a.threads)


def wait_owner_settled(rpc, timeout=60.0):
    gc.collect()
    deadline = time.monotonic() + timeout
    while rpc.rpc_sync("worker1", owner_rrefs) != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("worker1 still owns RRefs after %.0f s" % timeout)
        time.sleep(50e-6)


def measure(a, torch, rpc):
    t = torch.ones(a.size, dtype=torch.uint8)
    now = time.perf_counter_ns
    if a.mode == "latency":
        rtt = []
        for i in range(a.warmup + a.count):
            t0 = now()
            r = rpc.remote("worker1", echo, args=(t,))
            v = r.to_here()
            dt = now() - t0
            del r
            assert v.numel() == a.size
            if i >= a.warmup:
                rtt.append(dt)
        rtt.sort()
        label = size_label(a.size)
        emit_line(a, "remote_to_here_p50_" + label, percentile(rtt, 50) / 1e3, "us")
        emit_line(a, "remote_to_here_p99_" + label, percentile(rtt, 99) / 1e3, "us")
        return

    owner = rpc.get_worker_info("worker1")

    def finish(fut):
        back = fut.wait()
        assert back.owner() == owner
        del back

    def run(n):
        q = collections.deque()
        for _ in range(n):
            if len(q) >= a.window:
                finish(q.popleft())
            r = rpc.remote("worker1", echo, args=(t,))
            q.append(rpc.rpc_async("worker2", pass_back, args=(r,)))
            del r  # dropped while its fork to worker2 may be unconfirmed, as in bench/rref.c
        while q:
            finish(q.popleft())

    run(a.warmup)
    wait_owner_settled(rpc)
    t0 = now()
    run(a.count)
    wait_owner_settled(rpc)
    elapsed = now() - t0
    emit_line(a, "fork_throughput", 2 * a.count * 1e9 / elapsed, "forks/s")
    emit_line(a, "fork_ops_throughput", a.count * 1e9 / elapsed, "ops/s")


def run_rank(a):
    import torch
    import torch.distributed.rpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=a.threads, rpc_timeout=a.timeout,
                                           init_method="env://")
    rpc.init_rpc("worker%d" % a.rank, rank=a.rank, world_size=a.world, rpc_backend_options=opts)
    try:
        if a.rank == 0:
            measure(a, torch, rpc)
    finally:
        rpc.shutdown()  # graceful: waits for the other ranks


def main(argv):
    a = parse_args(argv)
    return rpc_main("torch_rref.py", __file__, argv, a, a.world, run_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
