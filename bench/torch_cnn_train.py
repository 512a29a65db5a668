#!/usr/bin/env python3
"""torch side of the CNN training benchmark (bench/run_cnn.py): the twin of weft's
examples/cnn_train.c.

The model (torchvision's BasicBlock, written out so that torchvision is not needed; the
parameter names are torchvision's):

  conv1   Conv2d(1, 16, 3, padding=1, bias=False), bn1 BatchNorm2d(16), ReLU, max_pool2d(2)
  layer1  BasicBlock(16 -> 32, stride 2): conv3x3-BN-ReLU-conv3x3-BN + downsample
          (conv1x1 stride 2 + BN), ReLU
          adaptive_avg_pool2d(1), flatten
  fc      Linear(32, 10), log_softmax; loss: nll_loss (mean)

torch's default initialisation after torch.manual_seed(SEED); SGD(lr, momentum), no schedule,
no weight decay. Each rank uses one torch thread (OMP/OPENBLAS/MKL_NUM_THREADS default to 1)
and reads Fashion-MNIST from the IDX files itself (bench/torch_ddp_train.py's loader: uint8
pixels scaled per batch, x/255, then (x - 0.2860) / 0.3530, reshaped to [B, 1, 28, 28]).

WORLD > 1: forks WORLD ranks over loopback, gloo, the model wrapped in DistributedDataParallel
(broadcast_buffers=True, torch's default: rank 0's BatchNorm running statistics are broadcast
before each forward, as cnn_train does). WORLD 1: the plain model in this process, no process
group. Each rank's share of an epoch is DistributedSampler(shuffle=True, seed=SEED,
drop_last=False) of the first --limit samples; its batches are consecutive slices of that list;
a last batch of one sample is dropped (BatchNorm needs two; cnn_train drops it too).

Rank 0 measures test accuracy on the 10000 test images (eval mode) every --eval-every steps
and after each epoch; the training clock stops meanwhile. Rank 0 prints one JSON line:

  {"system":"torch","model":"cnn","world":2,"batch":64,"lr":0.05,"momentum":0.9,"threads":1,
   "limit":..,"epochs_run":1,"steps":..,"samples_per_s":..,"step_ms":..,"train_s":..,
   "final_acc":..,"train_loss":..,"params":15034,"peak_rss_mb_max":..}

samples_per_s: training samples of all ranks / the slowest rank's training seconds; step_ms:
those seconds / steps.

  torch_cnn_train.py WORLD [--epochs N] [--batch B] [--lr LR] [--momentum M] [--limit N]
                     [--seed S] [--eval-every N] [--threads N] [--data DIR] [--json]
                     [--timeout S]
"""
import argparse
import os
import resource
import sys
import time
import warnings

SYSTEM = "torch"
DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("world", type=int)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--limit", type=int, default=0, help="train on the first N samples only")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: epoch ends only)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--data", default=os.environ.get("WEFT_DATA_DIR") or DEFAULT_DATA)
    p.add_argument("--json", action="store_true", help="accepted for symmetry with cnn_train (always JSON)")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args()
    if a.world < 1 or a.batch < 2 or a.epochs < 1 or a.eval_every < 0 or a.limit < 0 or a.threads < 1:
        p.error("WORLD, --epochs, --threads must be >= 1, --batch >= 2, --eval-every and --limit >= 0")
    return a


def make_model():
    import torch.nn as nn
    import torch.nn.functional as F

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                                nn.BatchNorm2d(cout))

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return F.relu(out + (x if self.downsample is None else self.downsample(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(16)
            self.layer1 = BasicBlock(16, 32, 2)
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
            x = self.layer1(x)
            x = F.adaptive_avg_pool2d(x, 1).flatten(1)
            return F.log_softmax(self.fc(x), 1)

    return Net()


def rank_main(a, rank, port):
    import torch
    import torch.nn.functional as F

    from torch_ddp_train import load, scale

    warnings.simplefilter("ignore")
    torch.set_num_threads(a.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    W = a.world
    dist = None
    if W > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from torchlib import join_gloo
        join_gloo(rank, W, port, 300)

    xtr, ytr = load(a.data, "train")
    xte = yte = None
    if rank == 0:
        xte, yte = load(a.data, "t10k")

    torch.manual_seed(a.seed)
    model = make_model()
    net = DDP(model) if W > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=a.momentum)
    n_train = a.limit if 0 < a.limit < xtr.shape[0] else xtr.shape[0]
    shard_n = (n_train + W - 1) // W

    def batch(xs):
        return scale(xs).view(-1, 1, 28, 28)

    def evaluate():
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, xte.shape[0], 500):
                out = model(batch(xte[i:i + 500]))
                correct += int((out.argmax(1) == yte[i:i + 500]).sum())
        model.train()
        return correct / xte.shape[0]

    acc_t = torch.zeros(1, dtype=torch.float64)

    def eval_point():
        if rank == 0:
            acc_t[0] = evaluate()
        if dist is not None:
            dist.broadcast(acc_t, 0)
        return float(acc_t[0])

    if dist is not None:
        dist.barrier()
    train_s = 0.0
    steps = 0
    samples = 0  # this rank's
    acc = None
    loss_avg = None
    nb = shard_n // a.batch + (1 if shard_n % a.batch >= 2 else 0)
    for epoch in range(a.epochs):
        # DistributedSampler(shuffle=True, seed=SEED, drop_last=False).set_epoch(epoch)
        g = torch.Generator()
        g.manual_seed(a.seed + epoch)
        perm = torch.randperm(n_train, generator=g).tolist()
        perm += perm[:W * shard_n - n_train]
        idx = torch.tensor(perm[rank::W], dtype=torch.long)
        loss_sum, loss_n = 0.0, 0
        t0 = time.perf_counter()
        for b in range(nb):
            bi = idx[b * a.batch:(b + 1) * a.batch]
            xb = batch(xtr[bi])
            yb = ytr[bi]
            opt.zero_grad(set_to_none=True)
            loss = F.nll_loss(net(xb), yb)
            loss.backward()
            opt.step()
            loss_sum += float(loss)
            loss_n += 1
            steps += 1
            samples += bi.shape[0]
            if (a.eval_every and steps % a.eval_every == 0) or b == nb - 1:
                train_s += time.perf_counter() - t0
                acc = eval_point()
                t0 = time.perf_counter()
        loss_avg = loss_sum / loss_n if loss_n else None

    info = torch.tensor([train_s, float(samples), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0],
                        dtype=torch.float64)
    if dist is not None:
        gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(W)]
        dist.all_gather(gathered, info)
    else:
        gathered = [info]
    if rank == 0:
        import json

        slowest = max(float(g[0]) for g in gathered)
        total = sum(float(g[1]) for g in gathered)
        res = {"system": SYSTEM, "model": "cnn", "world": W, "batch": a.batch, "lr": a.lr,
               "momentum": a.momentum, "threads": a.threads, "limit": n_train, "epochs_run": a.epochs,
               "steps": steps, "samples_per_s": round(total / slowest, 1) if slowest > 0 else None,
               "step_ms": round(1e3 * slowest / steps, 3) if steps > 0 else None,
               "train_s": round(slowest, 3), "final_acc": acc,
               "train_loss": None if loss_avg is None else round(loss_avg, 4),
               "params": sum(p.numel() for p in model.parameters()),
               "peak_rss_mb_max": round(max(float(g[2]) for g in gathered), 1)}
        print(json.dumps(res, separators=(",", ":")), flush=True)
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()


def main():
    a = parse_args()
    # One BLAS/OpenMP thread per rank from the start, as bench/torch_ddp_train.py.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(a.threads))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if a.world == 1:
        rank_main(a, 0, None)
        return 0
    from torchlib import fork_ranks
    return fork_ranks("torch_cnn_train", a.world, rank_main, a, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
