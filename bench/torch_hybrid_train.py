#!/usr/bin/env python3
"""torch twin of weft's examples/hybrid_train (bench/run_hybrid.py): torch's "Combining
Distributed DataParallel with Distributed RPC Framework" tutorial pattern (RemoteModule embedding
tables on parameter servers, the dense part under DistributedDataParallel, distributed autograd,
DistributedOptimizer) applied to examples/ctr_train.c's click-through-rate model and data.

World 4 on 127.0.0.1, forked from this process (bench/torchlib.py fork_ranks; TensorPipe RPC,
rendezvous on a free port hosted by rank 0): ranks 0 and 1 are "ps0" and "ps1", the parameter
servers (weftrun --servers 2's layout: the first ranks serve); ranks 2 and 3 are "trainer0" and
"trainer1", which also form a gloo process group of their own for DDP (through the launcher's
TCPStore). Every rank uses one torch thread (torch.set_num_threads(1), one interop thread;
OMP/OPENBLAS/MKL_NUM_THREADS default to 1) and --rpc-threads TensorPipe worker threads (16,
torch's default).

The model (ctr_train's):
  - 26 tables nn.EmbeddingBag(--rows, --dim, mode="sum", sparse=True), one per categorical
    feature C1..C26, each sample a bag of its one id (sum = the row), initialised uniform in
    [-0.01, 0.01) (ctr_train's initializer; another random stream, seeded --seed + server);
    sharded by table: C1..C13 on ps0, C14..C26 on ps1, each server's 13 tables one module
    (EmbeddingShard) created by trainer0 with torch.distributed.nn.RemoteModule("psS/cpu", ...)
    and handed to trainer1 over RPC (the tutorial's master creates the RemoteModule and passes it
    to the trainers the same way);
  - the MLP 13 + 26 * dim -> --hidden 64,32 -> 1 (nn.Linear, ReLU between layers; torch's
    default init after torch.manual_seed(--seed), i.e. uniform(+-1/sqrt(fan_in)), ctr_train's
    distribution) wrapped in DistributedDataParallel over the trainers' gloo group;
  - input: the 13 dense features then the 26 embeddings, concatenated in feature order; loss:
    F.binary_cross_entropy_with_logits (mean over the trainer's samples).
Optimizers (ctr_train's hyperparameters):
  - embeddings: DistributedOptimizer(torch.optim.Adagrad, every table's parameter RRef
    (RemoteModule.remote_parameters), lr=--emb-lr 0.05, initial_accumulator_value=3e-5 *
    (1024 / --batch)^2, eps 1e-10); torch maps it to its TorchScript functional Adagrad
    (_FunctionalAdagrad), which takes the sparse gradients of the tables and updates only the
    rows they touch, as weft's servers do. torch's DistributedOptimizer makes one optimizer per
    (caller, parameter owner): each trainer's DistributedOptimizer holds its own Adagrad
    accumulators on the servers and applies its own trainer's gradients (torch's pattern; weft
    keeps one accumulator per row on the server). So that the two trainers' embedding gradients
    add up to the gradient of the global batch's mean loss (what ctr_train's sync servers
    apply), each trainer scales the gradient that flows back into the embeddings by 1 / 2
    (e / W + e.detach() * (1 - 1 / W): the same values, the gradient scaled);
  - the MLP: DistributedOptimizer(torch.optim.Adam, RRefs of the trainer's own DDP parameters,
    lr=--lr 0.002) (the tutorial puts the local parameters' RRefs in the DistributedOptimizer
    too; its step is an RPC to the trainer itself, applying the DDP-averaged gradients that
    distributed autograd keeps in the context).

Data (examples/criteo.c's rules): --data FILE, a Criteo TSV file (label, 13 integers, 26
hexadecimal categories; any field but the label may be empty), read by each trainer: dense
feature j -> log(1 + max(x, 0)) (0 when empty), category value v -> id 1 + v mod (rows - 1)
(0 when empty); a line with another number of fields, a bad label, a bad integer or a category of
more than 8 hexadecimal digits is skipped (Python's int() accepts a little more than criteo.c:
signs and surrounding spaces). The last n // 10 samples (at least 1) are held out.

Steps (ctr_train's): each epoch is torch.randperm of the training samples (generator seeded
--seed * 1000 + epoch; the same on both trainers; another permutation than weft's), cut into
batches of --batch (global, 1024) samples, the remainder dropped; trainer w takes the batch's
positions w, w + 2, .... Per step, in a dist_autograd.context():
  futs = [shard.forward_async(ids of its 13 features) for both servers]; e = cat(wait);
  z = ddp_mlp(cat([dense, e / W + e.detach() * (1 - 1 / W)])); loss = bce_with_logits(z, y);
  dist_autograd.backward(cid, [loss]); emb_opt.step(cid); mlp_opt.step(cid).
The training clock (trainer0's, from before the forward to after the optimizer steps) stops for
evaluation. Evaluation: trainer0 scores the held-out samples in chunks of 8192 (the shards'
forward with no autograd, its own MLP under torch.no_grad), computes the logloss and the exact
AUC (ties at their mean rank: ctr_train's), then both trainers meet (gloo barrier); after every
--eval-every steps (0: none) and after each epoch. time_to_target_s: trainer0's training seconds
at the first evaluation whose AUC reaches --target-auc (null if none, or without --target-auc).

Prints one JSON line (trainer0, at the end; --json is accepted for symmetry with hybrid_train):

  {"system":"torch_rpc_ddp","example":"hybrid_train","servers":2,"trainers":2,"batch":1024,
   "dim":16,"rows":1000000,"epochs":2,"steps":..,"train_samples":..,"eval_samples":..,
   "samples_per_s":..,"logloss":..,"auc":..,"train_logloss":..,"time_to_target_s":..,
   "target_auc":..,"steps_to_target":..,"eval_every":..,"epoch_auc":[..],"train_s":..,
   "eval_s":..,"wall_s":..,"peak_rss_mb":..,"peak_rss_mb_ranks":[r0,r1,r2,r3],
   "peak_rss_mb_sum":..,"emb_optimizer":"Adagrad","mlp_optimizer":"Adam","seed":1}

samples_per_s: steps x global batch / trainer0's training seconds (ctr_train's count);
logloss, auc: the last evaluation (after the last epoch); train_logloss: the mean of trainer0's
step losses in the last epoch; wall_s: from this script's start (before importing torch) to the
line; peak_rss_mb: the max over the 4 ranks of getrusage(RUSAGE_SELF).ru_maxrss (MiB; each rank
asked over RPC; a forked rank counts the pages of torch it shares with the launcher, as a
started one would count its own), _ranks per rank, _sum their sum.

  torch_hybrid_train.py --data FILE [--epochs 2] [--batch 1024] [--lr 0.002] [--emb-lr 0.05]
                        [--dim 16] [--rows 1000000] [--hidden 64,32] [--seed 1]
                        [--target-auc X] [--eval-every N] [--rpc-threads 16] [--json]
                        [--verbose] [--timeout 900]

Without torch it prints nothing on stdout, says so on stderr and exits 0. Exit status 1 if a
rank failed (fork_ranks kills the others), 2 for bad options.
"""
import os
import sys
import time

T_START = time.monotonic()  # wall_s counts from here, before torch is imported

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

try:
    import torch  # noqa: E402 - after the thread variables
except ImportError:
    print("torch_hybrid_train.py: torch is not installed for %s; skipping" % sys.executable, file=sys.stderr)
    sys.exit(0)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import queue  # noqa: E402
import resource  # noqa: E402
import warnings  # noqa: E402
from array import array  # noqa: E402

import torch.distributed.rpc as rpc  # noqa: E402
import torch.nn as nn  # noqa: E402

from gen_ctr_data import auc  # noqa: E402
from torchlib import fork_ranks, free_port, join_gloo  # noqa: E402

SYSTEM = "torch_rpc_ddp"
N_DENSE = 13
N_SPARSE = 26
SERVERS = 2
TRAINERS = 2
EMB_INIT = 0.01
EMB_ACC = 3e-5  # ctr_train's Adagrad accumulator for a batch of EMB_ACC_BATCH
EMB_ACC_BATCH = 1024
EVAL_CHUNK = 8192
# trainer0's step, timed in parts (phase_ms): the embeddings' RPC forward (both servers at once),
# the local forward (DDP MLP and loss), dist_autograd.backward (DDP's all_reduce and the servers'
# backward inside), the embeddings' DistributedOptimizer step, the MLP's, leaving the context
PHASES = ("emb_forward", "mlp_forward", "backward", "emb_step", "mlp_step", "context_exit")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="Criteo TSV file")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024, help="samples per step, over both trainers")
    p.add_argument("--lr", type=float, default=0.002, help="Adam learning rate of the MLP")
    p.add_argument("--emb-lr", type=float, default=0.05, help="Adagrad learning rate of the embeddings")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--rows", type=int, default=1000000, help="rows per embedding table (the id bound)")
    p.add_argument("--hidden", default="64,32")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--target-auc", type=float, default=None, help="held-out AUC for time_to_target_s")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: epoch ends only)")
    p.add_argument("--rpc-threads", type=int, default=16, help="TensorPipe num_worker_threads")
    p.add_argument("--json", action="store_true", help="accepted for symmetry with hybrid_train (always JSON)")
    p.add_argument("--verbose", action="store_true", help="print each evaluation on stderr")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run (and RPC timeout)")
    a = p.parse_args()
    try:
        a.hidden = [int(h) for h in a.hidden.split(",") if h]
    except ValueError:
        p.error("--hidden: comma separated integers")
    if (a.epochs < 1 or a.batch < TRAINERS or a.dim < 1 or a.rows < 2 or not a.hidden or min(a.hidden) < 1
            or a.eval_every < 0 or a.rpc_threads < 1 or a.lr < 0 or a.emb_lr < 0):
        p.error("--epochs, --dim, --hidden, --rpc-threads must be positive, --batch >= %d, --rows >= 2, "
                "--eval-every, --lr, --emb-lr >= 0" % TRAINERS)
    if not os.access(a.data, os.R_OK):
        p.error("cannot read --data %s" % a.data)
    return a


# ------------------------------------------------------------------ data


def load_tsv(path, rows):
    """criteo.c's loader: (labels f32 [n], dense f32 [n, 13], ids i64 [n, 26], skipped)."""
    labels, dense, cats = array("f"), array("f"), array("q")
    skipped = 0
    m = rows - 1
    log1p = math.log1p
    with open(path) as f:
        for line in f:
            p = line.rstrip("\r\n").split("\t")
            if len(p) != 1 + N_DENSE + N_SPARSE or p[0] not in ("0", "1"):
                skipped += 1
                continue
            try:
                d = [int(x) if x else 0 for x in p[1:1 + N_DENSE]]
                c = [1 + int(x, 16) % m if x else 0 for x in p[1 + N_DENSE:]]
            except ValueError:
                skipped += 1
                continue
            if any(len(x) > 8 for x in p[1 + N_DENSE:]):
                skipped += 1
                continue
            labels.append(1.0 if p[0] == "1" else 0.0)
            dense.extend([log1p(v) if v > 0 else 0.0 for v in d])
            cats.extend(c)
    n = len(labels)
    if n == 0:
        raise RuntimeError("%s: no valid Criteo line (%d skipped)" % (path, skipped))
    return (torch.frombuffer(labels, dtype=torch.float32).clone(),
            torch.frombuffer(dense, dtype=torch.float32).clone().view(n, N_DENSE),
            torch.frombuffer(cats, dtype=torch.int64).clone().view(n, N_SPARSE), skipped)


# ------------------------------------------------------------------ what lives on the servers


class EmbeddingShard(nn.Module):
    """One server's tables: nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) per feature."""

    def __init__(self, n_tables, rows, dim, seed):
        super().__init__()
        g = torch.Generator()
        g.manual_seed(seed)
        self.tables = nn.ModuleList()
        for _ in range(n_tables):
            w = torch.empty(rows, dim).uniform_(-EMB_INIT, EMB_INIT, generator=g)
            self.tables.append(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, _weight=w))

    def forward(self, ids, train=True):
        """ids i64 [B, n_tables] -> the rows, concatenated in table order: [B, n_tables * dim]."""
        with torch.set_grad_enabled(train):
            return torch.cat([t(ids[:, i:i + 1]) for i, t in enumerate(self.tables)], 1)


def build_mlp(sizes):
    layers = []
    for l in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[l], sizes[l + 1]))
        if l + 2 < len(sizes):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def shard_features(s):
    """The features (columns of the ids) server s holds: a contiguous half."""
    per = (N_SPARSE + SERVERS - 1) // SERVERS
    return s * per, min(N_SPARSE, (s + 1) * per)


_tables_q = queue.Queue()  # trainer1: the RemoteModules trainer0 sends


def _receive_tables(shards):
    _tables_q.put(shards)


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ------------------------------------------------------------------ trainers


def trainer_main(a, w, store_port):
    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    import torch.nn.functional as F
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
    from torch.nn.parallel import DistributedDataParallel as DDP

    W = TRAINERS
    join_gloo(w, W, store_port, a.timeout)
    label, dense, cats, skipped = load_tsv(a.data, a.rows)
    n = label.shape[0]
    n_eval = n // 10 if n // 10 > 0 else 1
    n_train = n - n_eval
    batch = min(a.batch, n_train)
    steps = n_train // batch
    if batch < W:
        raise RuntimeError("%d training samples for %d trainers" % (n_train, W))

    if w == 0:
        shards = [RemoteModule("ps%d/cpu" % s, EmbeddingShard,
                               args=(shard_features(s)[1] - shard_features(s)[0], a.rows, a.dim, a.seed + s))
                  for s in range(SERVERS)]
        for v in range(1, W):
            rpc.rpc_sync("trainer%d" % v, _receive_tables, args=(shards,))
    else:
        shards = _tables_q.get(timeout=a.timeout)
    cols = [shard_features(s) for s in range(SERVERS)]

    torch.manual_seed(a.seed)
    sizes = [N_DENSE + N_SPARSE * a.dim] + a.hidden + [1]
    mlp = build_mlp(sizes)
    ddp = DDP(mlp)
    emb_params = [p for sh in shards for p in sh.remote_parameters()]
    r = EMB_ACC_BATCH / float(a.batch)
    emb_opt = DistributedOptimizer(torch.optim.Adagrad, emb_params, lr=a.emb_lr,
                                   initial_accumulator_value=EMB_ACC * r * r, eps=1e-10)
    mlp_opt = DistributedOptimizer(torch.optim.Adam, [RRef(p) for p in ddp.parameters()], lr=a.lr)
    if w == 0 and a.verbose:
        print("torch_hybrid: %d samples (%d skipped), %d train / %d held out, %d steps per epoch, "
              "functional optimizers: emb %s, mlp %s" % (n, skipped, n_train, n_eval, steps,
                                                         emb_opt.is_functional_optim, mlp_opt.is_functional_optim),
              file=sys.stderr, flush=True)

    def evaluate():
        scores = []
        loss = 0.0
        with torch.no_grad():
            for start in range(n_train, n, EVAL_CHUNK):
                end = min(n, start + EVAL_CHUNK)
                futs = [sh.forward_async(cats[start:end, lo:hi].contiguous(), False)
                        for sh, (lo, hi) in zip(shards, cols)]
                e = torch.cat([f.wait() for f in futs], 1)
                z = mlp(torch.cat([dense[start:end], e], 1)).squeeze(1)
                loss += float(F.binary_cross_entropy_with_logits(z, label[start:end], reduction="sum"))
                scores.extend(z.tolist())
        return loss / n_eval, auc(scores, [int(y) for y in label[n_train:].tolist()])

    dist.barrier()
    train_s = eval_s = 0.0
    step = 0
    ll = au = train_ll = None
    t_target = step_target = None
    epoch_auc = []

    def checkpoint():
        """trainer0 evaluates (the clock stopped), then the trainers meet."""
        nonlocal ll, au, t_target, step_target, eval_s
        if w == 0:
            t0 = time.perf_counter()
            ll, au = evaluate()
            eval_s += time.perf_counter() - t0
            if a.target_auc is not None and t_target is None and au is not None and au >= a.target_auc:
                t_target, step_target = train_s, step
            if a.verbose:
                print("torch_hybrid: step %d: held-out logloss %.4f AUC %.4f, %.1f s training"
                      % (step, ll, au if au is not None else float("nan"), train_s), file=sys.stderr, flush=True)
        dist.barrier()

    now = time.perf_counter
    phase = dict.fromkeys(PHASES, 0.0)
    for epoch in range(a.epochs):
        g = torch.Generator()
        g.manual_seed(a.seed * 1000 + epoch)
        perm = torch.randperm(n_train, generator=g)
        loss_sum = 0.0
        for s in range(steps):
            t0 = now()
            idx = perm[s * batch:(s + 1) * batch][w::W]
            ids, x, y = cats[idx], dense[idx], label[idx]
            with dist_autograd.context() as cid:
                futs = [sh.forward_async(ids[:, lo:hi].contiguous()) for sh, (lo, hi) in zip(shards, cols)]
                e = torch.cat([f.wait() for f in futs], 1)
                t1 = now()
                e = e / W + e.detach() * (1.0 - 1.0 / W)  # the embeddings' gradient scaled by 1 / W
                z = ddp(torch.cat([x, e], 1)).squeeze(1)
                loss = F.binary_cross_entropy_with_logits(z, y)
                t2 = now()
                dist_autograd.backward(cid, [loss])
                t3 = now()
                emb_opt.step(cid)
                t4 = now()
                mlp_opt.step(cid)
                t5 = now()
            t6 = now()
            for k, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                phase[k] += dt
            train_s += t6 - t0
            step += 1
            loss_sum += float(loss)
            if a.eval_every > 0 and step % a.eval_every == 0 and s + 1 < steps:
                checkpoint()
        train_ll = loss_sum / steps if steps else None
        checkpoint()
        epoch_auc.append(None if au is None else round(au, 5))

    if w == 0:
        rss = [rpc.rpc_sync("ps%d" % s, _rss_mb) for s in range(SERVERS)] + [_rss_mb()]
        rss += [rpc.rpc_sync("trainer%d" % v, _rss_mb) for v in range(1, W)]

        def r5(v):
            return None if v is None or not math.isfinite(v) else round(v, 5)

        res = {"system": SYSTEM, "example": "hybrid_train", "servers": SERVERS, "trainers": W, "batch": batch,
               "dim": a.dim, "rows": a.rows, "hidden": a.hidden, "epochs": a.epochs, "steps": step,
               "train_samples": n_train, "eval_samples": n_eval, "skipped": skipped,
               "samples_per_s": round(step * batch / train_s, 1) if train_s > 0 else None,
               "logloss": r5(ll), "auc": r5(au), "train_logloss": r5(train_ll),
               "time_to_target_s": None if t_target is None else round(t_target, 4),
               "target_auc": a.target_auc, "steps_to_target": step_target, "eval_every": a.eval_every,
               "epoch_auc": epoch_auc, "train_s": round(train_s, 4), "eval_s": round(eval_s, 4),
               "wall_s": round(time.monotonic() - T_START, 3),
               "peak_rss_mb": round(max(rss), 1), "peak_rss_mb_ranks": [round(x, 1) for x in rss],
               "peak_rss_mb_sum": round(sum(rss), 1), "emb_optimizer": "Adagrad", "emb_lr": a.emb_lr,
               "mlp_optimizer": "Adam", "lr": a.lr, "functional_optim": emb_opt.is_functional_optim,
               "seed": a.seed,
               "phase_ms": {k: round(1e3 * v / step, 3) if step else None for k, v in phase.items()}}
        print(json.dumps(res, separators=(",", ":")), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return True


def rank_main(a, rank, store_port, rpc_port):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    is_server = rank < SERVERS
    name = "ps%d" % rank if is_server else "trainer%d" % (rank - SERVERS)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=a.rpc_threads, rpc_timeout=a.timeout,
                                           init_method="tcp://127.0.0.1:%d" % rpc_port)
    rpc.init_rpc(name, rank=rank, world_size=SERVERS + TRAINERS, rpc_backend_options=opts)
    ok = True
    if not is_server:
        ok = trainer_main(a, rank - SERVERS, store_port)
    rpc.shutdown()  # graceful: the servers serve until every rank is done
    return ok


def main():
    a = parse_args()
    return fork_ranks("torch_hybrid_train", SERVERS + TRAINERS, rank_main, a, a.timeout,
                      extra_args=lambda: (free_port(),))


if __name__ == "__main__":
    sys.exit(main())
