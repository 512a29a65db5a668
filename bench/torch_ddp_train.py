#!/usr/bin/env python3
"""torch DistributedDataParallel (gloo) side of the training benchmark (bench/run_train.py).

Forks WORLD ranks over loopback (the parent holds the TCPStore on a free port). Each rank
uses one torch thread (and OMP/OPENBLAS/MKL_NUM_THREADS default to 1), reads Fashion-MNIST from the IDX files itself (numpy + gzip; the
training pixels stay uint8 and each batch is scaled on the fly: x/255, then (x - 0.2860) /
0.3530), builds the MLP 784-HIDDEN-10 (nn.Linear, ReLU, nn.Linear, torch's default init
after torch.manual_seed(SEED)), wraps it in DistributedDataParallel and trains it with
SGD(lr, momentum) (no schedule, no weight decay) on the mean cross-entropy of batches of
BATCH samples per rank. Each rank's share of an epoch is that of
DistributedSampler(shuffle=True, seed=SEED, drop_last=False) with set_epoch(epoch): a
torch.randperm of the 60000 indices drawn with seed SEED+epoch, padded to a multiple of
WORLD by repeating its head, rank r taking every WORLD-th index from r; its batches are
consecutive slices of that list (the last one shorter).

Rank 0 measures test accuracy on all 10000 test images every --eval-every optimizer steps
and after the last step of every epoch (once when both fall together); the other ranks wait
for its result (a broadcast), so that all ranks stop together. The training clock starts
after setup (data read, DDP built, a barrier) and is stopped during every evaluation, so
training time excludes evaluation. With --stop-at-target the run ends at the first
evaluation whose accuracy is >= --target, otherwise after --epochs epochs. Rank 0 prints
one JSON line at the end:

  {"system":"torch_ddp","world":2,"batch":64,"lr":0.02,"momentum":0.9,"hidden":256,
   "epochs_run":1,"steps":300,"samples_per_s":..,"time_to_target_s":..,"target":0.85,
   "final_acc":..,"peak_rss_mb_max":..,"peak_rss_mb_sum":..,
   "steps_to_target":300,"train_s":..,"seed":1}

steps: optimizer steps (per rank); epochs_run: epochs started; samples_per_s: training
samples of all ranks / training seconds (the slowest rank's clock); time_to_target_s:
rank 0's training seconds up to the end of the step after which the first evaluation
reached the target (null if none did); final_acc: the accuracy of the last evaluation;
peak_rss_mb_*: getrusage(RUSAGE_SELF).ru_maxrss of each rank in MiB (a forked rank counts
the pages of torch that it shares with the launcher), the maximum and sum over the ranks.

  torch_ddp_train.py WORLD [--epochs N] [--batch B] [--lr LR] [--momentum M] [--hidden H]
                     [--seed S] [--eval-every N] [--target A] [--stop-at-target]
                     [--data DIR] [--json] [--verbose] [--timeout S]
"""
import argparse
import gzip
import json
import os
import resource
import sys
import time
import warnings

from torchlib import fork_ranks, join_gloo

SYSTEM = "torch_ddp"
MEAN = 0.2860
STD = 0.3530
DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("world", type=int)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", default="256", help="hidden sizes, N[,N...] (784-N-...-10)")
    p.add_argument("--limit", type=int, default=0, help="train on the first N samples only")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=100, help="optimizer steps between evaluations (0: epoch ends only)")
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--stop-at-target", action="store_true")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--json", action="store_true", help="accepted for symmetry with weft's dp_train (always JSON)")
    p.add_argument("--verbose", action="store_true", help="print every evaluation on stderr")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args()
    try:
        a.hidden_sizes = [int(h) for h in str(a.hidden).split(",")]
    except ValueError:
        p.error("--hidden is N[,N...]")
    a.hidden = a.hidden_sizes[0]
    if (a.world < 1 or a.batch < 1 or a.epochs < 1 or min(a.hidden_sizes) < 1 or a.eval_every < 0
            or a.limit < 0):
        p.error("WORLD, --batch, --epochs, --hidden must be >= 1, --eval-every and --limit >= 0")
    return a


def idx_path(d, name):
    for f in (name, name + ".gz"):
        path = os.path.join(d, f)
        if os.path.exists(path):
            return path
    raise FileNotFoundError("%s(.gz) not found in %s" % (name, d))


def read_idx(path):
    """An IDX file of unsigned bytes as a numpy uint8 array of its shape (read in place, no second copy)."""
    import numpy as np

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        head = f.read(4)
        if len(head) != 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08:
            raise ValueError("%s: not an IDX file of unsigned bytes" % path)
        ndim = head[3]
        dims = [int.from_bytes(f.read(4), "big") for _ in range(ndim)]
        arr = np.empty(dims, dtype=np.uint8)
        view = memoryview(arr.reshape(-1))
        got = 0
        while got < arr.size:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError("%s: truncated" % path)
            got += n
    return arr


def load(d, split):
    import torch

    x = read_idx(idx_path(d, "%s-images-idx3-ubyte" % split))
    y = read_idx(idx_path(d, "%s-labels-idx1-ubyte" % split))
    if x.shape[0] != y.shape[0] or x.shape[1:] != (28, 28):
        raise ValueError("%s: images and labels do not match" % split)
    return torch.from_numpy(x.reshape(x.shape[0], 784)), torch.from_numpy(y).long()


def scale(xb):
    """uint8 pixels -> the normalised float32 batch."""
    return xb.float().div_(255.0).sub_(MEAN).div_(STD)


def rank_main(a, rank, port):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    W = a.world
    join_gloo(rank, W, port, 300)

    xtr, ytr = load(a.data, "train")
    xte = yte = None
    if rank == 0:
        xte, yte = load(a.data, "t10k")

    torch.manual_seed(a.seed)
    layers, prev = [], 784
    for h in a.hidden_sizes:
        layers += [nn.Linear(prev, h), nn.ReLU()]
        prev = h
    model = nn.Sequential(*layers, nn.Linear(prev, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr, momentum=a.momentum)
    n_train = a.limit if 0 < a.limit < xtr.shape[0] else xtr.shape[0]
    sampler = DistributedSampler(range(n_train), num_replicas=W, rank=rank, shuffle=True,
                                 seed=a.seed, drop_last=False)

    def evaluate():
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, xte.shape[0], 1000):
                out = model(scale(xte[i:i + 1000]))
                correct += int((out.argmax(1) == yte[i:i + 1000]).sum())
        model.train()
        return correct / xte.shape[0]

    acc_t = torch.zeros(1, dtype=torch.float64)
    evals = []  # (step, train seconds, accuracy)

    def eval_point(step, train_s):
        """Rank 0 evaluates, every rank gets the accuracy; returns it."""
        if rank == 0:
            acc_t[0] = evaluate()
        dist.broadcast(acc_t, 0)
        acc = float(acc_t[0])
        evals.append((step, train_s, acc))
        if a.verbose and rank == 0:
            print("torch_ddp: step %d train %.3f s acc %.4f" % (step, train_s, acc), file=sys.stderr, flush=True)
        return acc

    dist.barrier()
    train_s = 0.0
    steps = 0
    samples = 0  # this rank's
    epochs_run = 0
    t_target = None
    step_target = None
    stop = False
    last_eval_step = -1
    for epoch in range(a.epochs):
        epochs_run += 1
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        idx = torch.tensor(list(iter(sampler)), dtype=torch.long)
        nb = (idx.shape[0] + a.batch - 1) // a.batch
        for b in range(nb):
            bi = idx[b * a.batch:(b + 1) * a.batch]
            xb = scale(xtr[bi])
            yb = ytr[bi]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
            steps += 1
            samples += bi.shape[0]
            if (a.eval_every and steps % a.eval_every == 0) or b == nb - 1:
                train_s += time.perf_counter() - t0
                acc = eval_point(steps, train_s)
                last_eval_step = steps
                if t_target is None and acc >= a.target:
                    t_target, step_target = train_s, steps
                    if a.stop_at_target:
                        stop = True
                        break
                t0 = time.perf_counter()
        else:
            continue
        break
    if last_eval_step != steps:  # not reached: every epoch ends with an evaluation
        train_s += time.perf_counter() - t0

    info = torch.tensor([train_s, float(samples), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0],
                        dtype=torch.float64)
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(W)]
    dist.all_gather(gathered, info)
    if rank == 0:
        slowest = max(float(g[0]) for g in gathered)
        total = sum(float(g[1]) for g in gathered)
        rss = [float(g[2]) for g in gathered]
        res = {"system": SYSTEM, "world": W, "batch": a.batch, "lr": a.lr, "momentum": a.momentum,
               "hidden": a.hidden, "epochs_run": epochs_run, "steps": steps,
               "samples_per_s": round(total / slowest, 1) if slowest > 0 else None,
               "step_ms": round(1e3 * slowest / steps, 3) if steps > 0 else None,
               "time_to_target_s": None if t_target is None else round(t_target, 4),
               "target": a.target, "final_acc": evals[-1][2] if evals else None,
               "peak_rss_mb_max": round(max(rss), 1), "peak_rss_mb_sum": round(sum(rss), 1),
               "steps_to_target": step_target, "train_s": round(slowest, 4), "seed": a.seed}
        print(json.dumps(res, separators=(",", ":")), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    a = parse_args()
    # One BLAS/OpenMP thread per rank from the start (torch.set_num_threads(1) in each rank
    # as well): Debian's torch uses OpenBLAS, whose results differ in the last bits with
    # the thread count it was started with; run_train.py sets the same for weft.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    return fork_ranks("torch_ddp_train", a.world, rank_main, a, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
