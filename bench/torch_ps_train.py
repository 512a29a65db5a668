#!/usr/bin/env python3
"""torch.distributed.rpc parameter-server twin of weft's examples/ps_train (bench/run_train.py).

The pattern of torch's parameter-server examples (pytorch/examples distributed/rpc/
parameter_server and distributed/rpc/batch/parameter_server.py, "batch-updating parameter
server"): parameter-server ranks hold the parameters and an optimizer, trainers call them with
rpc to get the parameters and to send gradients, and a server applies one update per step once
every trainer's gradient has arrived (a lock, a gradient sum and a torch.futures.Future per step
that @rpc.functions.async_execution hands to every trainer's call). The same job as

  weftrun -n SERVERS+WORKERS --servers SERVERS build/examples/ps_train --mode sync --json

Forks SERVERS + WORKERS ranks over loopback (TensorPipe backend): ranks 0 .. SERVERS-1 are
"ps<j>", the others "trainer<w>" (ps_train's layout: the first ranks serve). Each rank uses one
torch thread (OMP/OPENBLAS/MKL_NUM_THREADS default to 1).

Parameters: the MLP 784-HIDDEN-10 (nn.Linear, ReLU, nn.Linear; --hidden N,N.. for more layers),
initial values those of torch.manual_seed(SEED) and nn.Linear's default init, i.e. uniform
(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases (ps_train's distribution, another
random stream). Each parameter is cut, flattened, into chunks of --chunk-bytes (65536, ps_train's
default) and chunk c of every parameter lives on server c % SERVERS, as ps_train's tables land
(784-256-10: fc1.weight's 13 chunks alternate, server 0 holding 7, server 1 6; the three small
parameters sit whole on server 0). A server keeps its chunks as one flat f32 tensor with
torch.optim.SGD(lr, momentum) over it (no schedule, no weight decay) and applies, once per step,
the mean of the trainers' gradients (sync, ps_train --mode sync).

Trainer step: pull (every server's flat tensor, rpc_async to all servers at once, copied into
the trainer's model), forward, mean cross-entropy of the batch, backward, push (the gradients
cut the same way, rpc_async to all servers at once) and wait. --fetch picks how:
  fused     (default, the batch tutorial's update_and_fetch_model) a push's reply is the server's
            updated tensor, sent once every trainer has pushed, so a step's pull is the previous
            step's push reply (the first step pulls on its own): one round trip per server a step.
  separate  ps_train's calls: pull(step) waits on the server until the parameters of that step
            exist (every trainer's previous push applied), push replies at once: two round
            trips per server a step.

Data and sharding: Fashion-MNIST read from the IDX files (bench/torch_ddp_train.py's reader;
pixels x/255, then (x - 0.2860) / 0.3530), each epoch's shard of trainer w that of
DistributedSampler(shuffle=True, seed=SEED, drop_last=False) with set_epoch(epoch) over the
first --limit samples (a permutation padded by repeating its head, trainer w taking every
WORKERS-th index from w: ps_train's sharding, another permutation), batches of BATCH consecutive
indices (the last one shorter), the same number of steps on every trainer.

Evaluation, as ps_train: after the last step of every epoch only, the trainers meet (a barrier of
a gloo group of the trainers), pull, score the test images w, w + WORKERS, ... in chunks of 1000
and sum the counts (all_reduce). The training clock runs per step (pull to the end of the push),
so evaluation and setup are outside it. Trainer 0 prints one JSON line at the end, ps_train
--json's fields plus the benchmark's:

  {"system":"torch_ps","mode":"sync","servers":2,"workers":2,"batch":64,"lr":0.02,
   "momentum":0.9,"hidden":256,"epochs_run":3,"steps":1407,"samples_per_s":..,"final_acc":..,
   "train_loss":..,"staleness_mean":0.0,"params_identical":true,"time_to_target_s":..,
   "target":0.85,"steps_to_target":..,"epoch_acc":[..],"epoch_train_s":[..],
   "peak_rss_mb_max":..,"peak_rss_mb_sum":..,"train_s":..,"fetch":"fused","seed":1}

steps: steps run (per trainer); samples_per_s: trainer 0's count of samples (its batch size x
WORKERS per step, as ps_train counts) / its training seconds; time_to_target_s: trainer 0's
training seconds at the end of the first epoch whose test accuracy is >= --target (null if none);
train_loss: the mean batch loss of trainer 0's last epoch; staleness_mean: 0 (sync);
params_identical: the trainers' final parameters compared bit for bit; peak_rss_mb_*:
getrusage(RUSAGE_SELF).ru_maxrss of every rank (servers and trainers; a forked rank counts the
pages of torch it shares with the launcher), max and sum, MiB. --stop-at-target ends the run at
that evaluation (ps_train has no such option; run_train.py does not use it).

  torch_ps_train.py [--servers 2] [--workers 2] [--epochs 3] [--batch 64] [--lr 0.02]
                    [--momentum 0.9] [--hidden 256] [--seed 1] [--limit N] [--chunk-bytes 65536]
                    [--fetch fused|separate] [--target 0.85] [--stop-at-target] [--rpc-threads N]
                    [--data DIR] [--json] [--verbose] [--timeout S]
"""
import argparse
import json
import os
import resource
import sys
import threading
import time
import warnings

# One BLAS/OpenMP thread per rank from the start (OpenBLAS reads it when torch loads; each rank
# calls torch.set_num_threads(1) as well): as torch_ddp_train.py, and run_train.py sets the same.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402 - after the thread variables
import torch.distributed.rpc as rpc  # noqa: E402

from torch_ddp_train import DEFAULT_DATA, load, scale
from torchlib import fork_ranks, free_port, join_gloo

SYSTEM = "torch_ps"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", default="sync", choices=["sync"], help="only sync (ps_train --mode sync)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="samples per trainer per step")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", default="256", help="hidden layer sizes, comma separated")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--limit", type=int, default=0, help="train on the first N training samples only")
    p.add_argument("--chunk-bytes", type=int, default=65536, help="bytes per parameter chunk placed on a server")
    p.add_argument("--fetch", default="fused", choices=["fused", "separate"])
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--eval-every", type=int, default=0,
                   help="also measure test accuracy every N steps, the clock stopped (as ps_train)")
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--rpc-threads", type=int, default=16, help="TensorPipe num_worker_threads (torch's default 16)")
    p.add_argument("--transports", help="TensorPipe transports, comma separated (default: TensorPipe's choice)")
    p.add_argument("--channels", help="TensorPipe channels, comma separated (default: TensorPipe's choice)")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--json", action="store_true", help="accepted for symmetry with ps_train (always JSON)")
    p.add_argument("--verbose", action="store_true", help="print every epoch on stderr")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args()
    try:
        a.hidden = [int(h) for h in a.hidden.split(",")]
    except ValueError:
        p.error("--hidden: comma separated integers")
    if (a.servers < 1 or a.workers < 1 or a.batch < 1 or a.epochs < 1 or a.limit < 0
            or a.chunk_bytes < 4 or min(a.hidden) < 1):
        p.error("--servers, --workers, --batch, --epochs, --hidden, --chunk-bytes must be positive")
    return a


def layout(a):
    """Parameter shapes and, per server, its pieces [(param, start, end)] of the flattened parameters."""
    sizes = [784] + a.hidden + [10]
    shapes = []
    for l in range(len(sizes) - 1):
        shapes += [(sizes[l + 1], sizes[l]), (sizes[l + 1],)]
    per = max(1, a.chunk_bytes // 4)
    pieces = [[] for _ in range(a.servers)]
    for i, shp in enumerate(shapes):
        n = 1
        for d in shp:
            n *= d
        for c in range((n + per - 1) // per):
            pieces[c % a.servers].append((i, c * per, min(n, (c + 1) * per)))
    return sizes, shapes, pieces


def build_model(sizes):
    import torch.nn as nn

    layers = []
    for l in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[l], sizes[l + 1]))
        if l + 2 < len(sizes):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# --------------------------------------------------------------------- server (module state)

_srv = None


class _Server:
    """One server's chunks: a flat parameter, its SGD, the step's gradient sum and futures."""

    def __init__(self, a, idx):
        sizes, shapes, pieces = layout(a)
        torch.manual_seed(a.seed)
        params = [p.detach().reshape(-1) for p in build_model(sizes).parameters()]
        mine = pieces[idx]
        flat = torch.cat([params[i][s:e] for i, s, e in mine]) if mine else torch.zeros(0)
        self.param = torch.nn.Parameter(flat.clone())
        self.param.grad = torch.zeros_like(flat)
        self.opt = torch.optim.SGD([self.param], lr=a.lr, momentum=a.momentum)
        self.workers = a.workers
        self.lock = threading.Lock()
        self.pushed = 0
        self.version = 0  # updates applied
        self.step_fut = torch.futures.Future()  # completed with the values after the next update

    def _apply(self):
        """Under the lock, the last trainer's push: the mean gradient's update, the waiters woken."""
        self.param.grad.div_(self.workers)
        self.opt.step()
        self.param.grad.zero_()
        self.pushed = 0
        self.version += 1
        fut, self.step_fut = self.step_fut, torch.futures.Future()
        fut.set_result(self.param.detach().clone())


@rpc.functions.async_execution
def _ps_pull(step):
    """The values after `step` updates: now, or when the step's last push arrives (separate)."""
    with _srv.lock:
        if _srv.version >= step:
            fut = torch.futures.Future()
            fut.set_result(_srv.param.detach().clone())
            return fut
        return _srv.step_fut


@rpc.functions.async_execution
def _ps_push_and_fetch(grad):
    """Adds a trainer's gradient; the reply, the updated values, goes once every trainer has pushed."""
    with _srv.lock:
        _srv.param.grad.add_(grad)
        _srv.pushed += 1
        fut = _srv.step_fut
        if _srv.pushed == _srv.workers:
            _srv._apply()
    return fut


def _ps_push(grad):
    """Adds a trainer's gradient and replies at once (separate)."""
    with _srv.lock:
        _srv.param.grad.add_(grad)
        _srv.pushed += 1
        if _srv.pushed == _srv.workers:
            _srv._apply()


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ------------------------------------------------------------------------------ trainer

def trainer_main(a, w, store_port):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler

    S, W = a.servers, a.workers
    join_gloo(w, W, store_port, 300)

    xtr, ytr = load(a.data, "train")
    xte, yte = load(a.data, "t10k")
    used = a.limit if 0 < a.limit < xtr.shape[0] else xtr.shape[0]
    sizes, shapes, pieces = layout(a)
    model = build_model(sizes)
    params = list(model.parameters())
    flat_params = [p.data.view(-1) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    flat_grads = [p.grad.view(-1) for p in params]
    servers = ["ps%d" % s for s in range(S)]
    sampler = DistributedSampler(range(used), num_replicas=W, rank=w, shuffle=True, seed=a.seed, drop_last=False)
    shard_n = len(sampler)
    steps_per_epoch = (shard_n + a.batch - 1) // a.batch

    def scatter(futs):
        for s, fut in enumerate(futs):
            vals = fut.wait()
            off = 0
            for i, b, e in pieces[s]:
                flat_params[i][b:e].copy_(vals[off:off + e - b])
                off += e - b

    def grads_of(s):
        return torch.cat([flat_grads[i][b:e] for i, b, e in pieces[s]]) if pieces[s] else torch.zeros(0)

    def pull(step):
        scatter([rpc.rpc_async(servers[s], _ps_pull, args=(step,)) for s in range(S)])

    def evaluate():
        correct = 0
        with torch.no_grad():
            xs, ys = xte[w::W], yte[w::W]
            for i in range(0, xs.shape[0], 1000):
                out = model(scale(xs[i:i + 1000]))
                correct += int((out.argmax(1) == ys[i:i + 1000]).sum())
        c = torch.tensor([correct], dtype=torch.int64)
        dist.all_reduce(c)
        return int(c[0]) / xte.shape[0]

    dist.barrier()
    train_s = 0.0
    step = 0  # steps done = updates the servers have applied
    samples = 0
    epochs_run = 0
    loss_avg = 0.0
    acc = None
    t_target = step_target = None
    epoch_acc, epoch_train_s = [], []
    fresh = False  # the model holds the parameters of `step` already (fused: the push's reply)
    for epoch in range(a.epochs):
        epochs_run += 1
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(iter(sampler)), dtype=torch.long)
        t_epoch = 0.0
        loss_sum = 0.0
        for b in range(steps_per_epoch):
            t0 = time.perf_counter()
            if not fresh:
                pull(step)
            bi = idx[b * a.batch:(b + 1) * a.batch]
            for g in flat_grads:
                g.zero_()
            loss = F.cross_entropy(model(scale(xtr[bi])), ytr[bi])
            loss.backward()
            if a.fetch == "fused":
                scatter([rpc.rpc_async(servers[s], _ps_push_and_fetch, args=(grads_of(s),))
                         for s in range(S)])
                fresh = True
            else:
                torch.futures.wait_all([rpc.rpc_async(servers[s], _ps_push, args=(grads_of(s),))
                                        for s in range(S)])
            step += 1
            t_epoch += time.perf_counter() - t0
            samples += bi.shape[0] * W
            loss_sum += float(loss)
            if a.eval_every > 0 and step % a.eval_every == 0 and b + 1 < steps_per_epoch:
                # as ps_train --eval-every: the trainers meet, pull and score; the clock is stopped
                dist.barrier()
                if not fresh:
                    pull(step)
                    fresh = True
                mid = evaluate()
                if t_target is None and mid >= a.target:
                    t_target, step_target = train_s + t_epoch, step
                    if a.stop_at_target:
                        break
        train_s += t_epoch
        loss_avg = loss_sum / steps_per_epoch
        dist.barrier()
        if not fresh:
            pull(step)
            fresh = True
        acc = evaluate()
        epoch_acc.append(acc)
        epoch_train_s.append(round(train_s, 4))
        if w == 0 and a.verbose:
            print("torch_ps: epoch %d: train loss %.4f, test accuracy %.2f%%, %.1f s, %.0f samples/s"
                  % (epoch + 1, loss_avg, 100 * acc, t_epoch, samples / train_s), file=sys.stderr, flush=True)
        if t_target is None and acc >= a.target:
            t_target, step_target = train_s, step
            if a.stop_at_target:
                break

    mine = torch.cat(flat_params)
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    same = torch.tensor([int(torch.equal(mine, theirs))], dtype=torch.int32)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if w == 0:
        rss = [rpc.rpc_sync(n, _rss_mb) for n in servers] + [_rss_mb()]
        rss += [rpc.rpc_sync("trainer%d" % v, _rss_mb) for v in range(1, W)]
        res = {"system": SYSTEM, "mode": "sync", "servers": S, "workers": W, "batch": a.batch, "lr": a.lr,
               "momentum": a.momentum, "hidden": a.hidden[0], "epochs_run": epochs_run, "steps": step,
               "samples_per_s": round(samples / train_s, 1) if train_s > 0 else None,
               "final_acc": round(acc, 4) if acc is not None else None, "train_loss": round(loss_avg, 4),
               "staleness_mean": 0.0, "params_identical": bool(same[0]),
               "time_to_target_s": None if t_target is None else round(t_target, 4), "target": a.target,
               "steps_to_target": step_target, "epoch_acc": epoch_acc, "epoch_train_s": epoch_train_s,
               "peak_rss_mb_max": round(max(rss), 1), "peak_rss_mb_sum": round(sum(rss), 1),
               "train_s": round(train_s, 4), "fetch": a.fetch, "seed": a.seed}
        print(json.dumps(res, separators=(",", ":")), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return bool(same[0])


def rank_main(a, rank, store_port, rpc_port):
    global _srv
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    S = a.servers
    is_server = rank < S
    if is_server:
        _srv = _Server(a, rank)  # before init_rpc: it exists when the first call comes
    name = "ps%d" % rank if is_server else "trainer%d" % (rank - S)
    kw = {}
    if a.transports:
        kw["_transports"] = a.transports.split(",")
    if a.channels:
        kw["_channels"] = a.channels.split(",")
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=a.rpc_threads, rpc_timeout=a.timeout,
                                           init_method="tcp://127.0.0.1:%d" % rpc_port, **kw)
    rpc.init_rpc(name, rank=rank, world_size=S + a.workers, rpc_backend_options=opts)
    ok = True
    if not is_server:
        ok = trainer_main(a, rank - S, store_port)
    rpc.shutdown()  # graceful: the servers serve until every rank is done
    return ok


def main():
    a = parse_args()
    # The trainers' gloo group meets at the parent's TCPStore; rank 0 (ps0) hosts the RPC
    # rendezvous on a free port.
    return fork_ranks("torch_ps_train", a.servers + a.workers, rank_main, a, a.timeout,
                      extra_args=lambda: (free_port(),),
                      failed_text="parameters DIFFER between the trainers")


if __name__ == "__main__":
    sys.exit(main())
