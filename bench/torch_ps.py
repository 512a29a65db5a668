#!/usr/bin/env python3
"""torch.distributed.rpc (TensorPipe backend) peer of weft's parameter-server benchmark (P2).

The sparse workload of bench_ps p2 (bench/ps.c), with the pattern of torch's parameter-server
examples (pytorch/examples distributed/rpc/parameter_server and ddp_rpc: the PS ranks hold the
tensors, the trainers call them with rpc_sync / rpc_async to get rows and to send gradients):

  SERVERS "ps" ranks each hold a shard of an R x D f32 embedding (torch.nn.Embedding(sparse=True),
  uniform(-0.01, 0.01)), rows id % SERVERS, and a torch.optim.Adagrad (lr 0.01) over it;
  get_rows(local_ids) returns weight[local_ids]; apply_grads(local_ids, grads) sets the weight's
  sparse gradient (torch.sparse_coo_tensor) and steps Adagrad under a lock (updates of one shard
  are serialised; reads are not).

  WORKERS trainers each draw WARMUP + BATCHES batches of IDS ids from Zipf(A) over [0, R) by
  inversion of the exact CDF (as bench_ps: P(id = k-1) ~ 1/k^A) beforehand; per batch they do
  what weft's client does inside weft_ps_pull_rows / weft_ps_push_rows: torch.unique the ids
  (so repeats are fetched once), rpc_async get_rows to every server holding some of them, wait,
  scatter the rows back to the batch's IDS x D tensor, gradient 0.01 * row, sum the gradients of
  repeated ids (index_add_), rpc_async apply_grads to every server, wait.

Prints, from trainer 0, {"system":"torch_rpc","metric":...} lines: sparse_rows (rows/s: 2*IDS rows
per batch, pulled + pushed, summed over the trainers' rates), sparse_batch_p50 and
sparse_batch_p99 (us per batch over every trainer's timed batches), sparse_pull_p50 (us, the pull
part of a batch) and unique_ids. Without torch it
prints nothing, says so on stderr and exits 0.

  torch_ps.py p2 [--servers S] [--workers W] [--batches K] [--warmup K0] [--ids B] [--rows R]
                 [--dim D] [--zipf A] [--threads N] [--timeout S]

Rank layout: rank 0 .. W-1 are "trainer<i>" (this process is trainer 0 and starts the others as
subprocesses of the same script), W .. W+S-1 are "ps<j>". All on 127.0.0.1.
"""
import argparse
import os
import sys
import threading
import time

from torchlib import add_rank_args, emit, parse_size, percentile, rpc_main

SYSTEM = "torch_rpc"

# ------------------------------------------------------------------ the PS side (module globals)
_ps = {}
_results = {}
_results_ready = threading.Event()


def _ps_init(rows, dim, servers, rank_in_ps, seed):
    import torch

    torch.manual_seed(seed + rank_in_ps)
    n_local = (rows - rank_in_ps + servers - 1) // servers
    emb = torch.nn.Embedding(n_local, dim, sparse=True)
    with torch.no_grad():
        emb.weight.uniform_(-0.01, 0.01)
    _ps["emb"] = emb
    _ps["opt"] = torch.optim.Adagrad(emb.parameters(), lr=0.01)
    _ps["lock"] = threading.Lock()
    _ps["n_local"] = n_local


def get_rows(local_ids):
    import torch

    with torch.no_grad():
        return _ps["emb"].weight.index_select(0, local_ids)


def apply_grads(local_ids, grads):
    import torch

    emb = _ps["emb"]
    with _ps["lock"]:
        emb.weight.grad = torch.sparse_coo_tensor(local_ids.unsqueeze(0), grads,
                                                  (_ps["n_local"], grads.shape[1]))
        _ps["opt"].step()
        emb.weight.grad = None
    return 0


def put_results(rank, res):
    _results[rank] = res
    return 0


def get_results():
    _results_ready.wait()
    return _results.get("mine")


# ------------------------------------------------------------------ the trainers


def zipf_batches(torch, rows, s, n, seed):
    k = torch.arange(1, rows + 1, dtype=torch.float64)
    cdf = torch.cumsum(k.pow(-s), 0)
    g = torch.Generator()
    g.manual_seed(seed)
    u = torch.rand(n, dtype=torch.float64, generator=g) * cdf[-1]
    return torch.searchsorted(cdf, u).clamp_(max=rows - 1)


def trainer(a, torch, rpc, widx):
    batches = a.warmup + a.batches
    all_ids = zipf_batches(torch, a.rows, a.zipf, batches * a.ids, widx + 1).view(batches, a.ids)
    ps = [rpc.get_worker_info("ps%d" % j) for j in range(a.servers)]
    S = a.servers
    batch_ns = []
    pull_ns = []
    unique = 0
    now = time.perf_counter_ns
    t0 = 0
    for b in range(batches):
        if b == a.warmup:
            t0 = now()
        tb = now()
        ids = all_ids[b]
        uniq, inv = torch.unique(ids, return_inverse=True)
        shard = uniq % S
        sel = [(shard == j).nonzero(as_tuple=True)[0] for j in range(S)]
        futs = [rpc.rpc_async(ps[j], get_rows, args=(uniq[sel[j]] // S,)) if len(sel[j]) else None
                for j in range(S)]
        rows_u = torch.empty(len(uniq), a.dim)
        for j in range(S):
            if futs[j] is not None:
                rows_u[sel[j]] = futs[j].wait()
        rows = rows_u[inv]  # the batch's IDS x D rows, as weft_ps_pull_rows fills them
        tp = now() - tb
        grads = 0.01 * rows
        g_u = torch.zeros(len(uniq), a.dim).index_add_(0, inv, grads)
        futs = [rpc.rpc_async(ps[j], apply_grads, args=(uniq[sel[j]] // S, g_u[sel[j]]))
                if len(sel[j]) else None for j in range(S)]
        for f in futs:
            if f is not None:
                f.wait()
        if b >= a.warmup:
            batch_ns.append(now() - tb)
            pull_ns.append(tp)
            unique += len(uniq)
    elapsed = now() - t0
    return {"rate": 2.0 * a.ids * a.batches * 1e9 / elapsed, "batch_ns": batch_ns, "pull_ns": pull_ns,
            "unique": unique}


def emit_line(a, metric, value, unit):
    emit(SYSTEM, metric, value, unit, servers=a.servers, workers=a.workers, ids=a.ids, iters=a.batches,
         threads=a.threads, dedup=True)


def run_rank(a):
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    # Subnormals flushed to zero, as weft's servers apply updates (its threads, made after this,
    # inherit the setting): the same arithmetic on both sides.
    torch.set_flush_denormal(True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    world = a.servers + a.workers
    name = "trainer%d" % a.rank if a.rank < a.workers else "ps%d" % (a.rank - a.workers)
    if a.rank >= a.workers:
        _ps_init(a.rows, a.dim, a.servers, a.rank - a.workers, 1)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=a.threads, rpc_timeout=a.timeout,
                                           init_method="env://")
    rpc.init_rpc(name, rank=a.rank, world_size=world, rpc_backend_options=opts)
    try:
        if a.rank < a.workers:
            res = trainer(a, torch, rpc, a.rank)
            _results["mine"] = res
            _results_ready.set()
            if a.rank == 0:
                got = [res] + [rpc.rpc_sync("trainer%d" % w, get_results) for w in range(1, a.workers)]
                all_ns = sorted(ns for r in got for ns in r["batch_ns"])
                emit_line(a, "sparse_rows", sum(r["rate"] for r in got), "rows/s")
                emit_line(a, "sparse_batch_p50", percentile(all_ns, 50) / 1e3, "us")
                emit_line(a, "sparse_batch_p99", percentile(all_ns, 99) / 1e3, "us")
                pulls = sorted(ns for r in got for ns in r["pull_ns"])
                emit_line(a, "sparse_pull_p50", percentile(pulls, 50) / 1e3, "us")
                emit_line(a, "unique_ids", sum(r["unique"] for r in got) / len(all_ns), "ids")
    finally:
        rpc.shutdown()  # graceful: waits for every rank


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["p2"])
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=parse_size, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ids", type=parse_size, default=4096)
    p.add_argument("--rows", type=parse_size, default=1 << 20)
    p.add_argument("--dim", type=parse_size, default=64)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--threads", type=int, default=8, help="num_worker_threads of every rank")
    p.add_argument("--timeout", type=float, default=300.0, help="rpc_timeout in seconds")
    add_rank_args(p)
    a = p.parse_args(argv)
    if min(a.servers, a.workers, a.batches, a.ids, a.rows, a.dim) <= 0 or a.warmup < 0:
        p.error("counts must be positive")
    return a


def main(argv):
    a = parse_args(argv)
    return rpc_main("torch_ps.py", __file__, argv, a, a.servers + a.workers, run_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
