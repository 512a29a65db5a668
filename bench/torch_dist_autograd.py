#!/usr/bin/env python3
"""torch.distributed.autograd (RPC, TensorPipe backend) peer of weft's distributed-autograd
benchmark.

Processes on 127.0.0.1: this one is rank 0 ("worker0", the measuring side) and starts the others
("worker1" .. "worker<WORLD-1>") as subprocesses of the same script, as bench/torch_rpc.py does.
Every rank uses torch.set_num_threads(1), num_worker_threads --threads (default 8; in pipeline at
least SPLITS+1, see there) and rpc_timeout --timeout (seconds, default 300). Times are taken with
time.perf_counter_ns. If rank 0 fails (an RPC timed out, a check failed), it shuts its agent down
without waiting for the others and they are killed. Modes:

  torch_dist_autograd.py a1 ITERS
      2 ranks. torch's design-doc example (3x3 f32), per iteration:
        with dist_autograd.context() as cid:
            t1 = torch.rand(3, 3, requires_grad=True); t2 = torch.rand(3, 3, requires_grad=True)
            t3 = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
            t4 = torch.rand(3, 3, requires_grad=True)
            loss = (t3 * t4).sum(); dist_autograd.backward(cid, [loss])
            g = dist_autograd.get_gradients(cid)
      The first iteration checks that g[t1] and g[t2] equal t4. 50 warm-up iterations, then ITERS
      timed ones, each from before entering the context to after leaving it (its release
      included). Prints a1_p50 and a1_p99 (us).

  torch_dist_autograd.py a2 HOPS ITERS
      HOPS+1 ranks. A chain of HOPS hops: hop(t, k) on worker r returns t * 2 when k == 0, else
      rpc.rpc_sync("worker<r+1>", hop, args=(t * 2, k - 1)). Per iteration, in a context:
      x = torch.rand(3, 3, requires_grad=True); y = rpc.rpc_sync("worker1", hop, args=(x, HOPS-1));
      loss = y.sum(); dist_autograd.backward; dist_autograd.get_gradients. The first iteration
      checks that the gradient of x is 2**HOPS everywhere. 20 warm-up iterations, then ITERS timed
      ones (the whole context, as a1). Prints a2_p50_h<HOPS> and a2_p99_h<HOPS> (us).

  torch_dist_autograd.py a3 N
      2 ranks. Contexts in a loop, each: with dist_autograd.context(): t1, t2 = two 3x3
      requires-grad torch.rand; r1, r2 = two rpc_sync("worker1", torch.add, (t1, t2));
      loss = r1.sum() + r2.sum(); dist_autograd.backward. 100 warm-up contexts (the first checks
      that both gradients are 2 everywhere), then the RSS of rank 0 and of worker1 (an rpc_sync
      to worker1 that reads its /proc/self/statm), then N timed contexts, then at once (0 ms)
      torch.distributed.autograd._get_debug_info() on both ranks (the live contexts are its
      "num_autograd_contexts", the running backward passes its "num_current_backward_passes"),
      the RSS again, and the debug info again 1 s after the N ended. Prints a3_seconds (the N's
      wall time, s), a3_rss_growth_mb_rank0 and a3_rss_growth_mb_rank1 (RSS after the N minus
      before, MiB) and a3_live_contexts_after_1s (contexts, max over the ranks; the line also
      has the 0 ms max and the per-rank counts).

  torch_dist_autograd.py a4
      3 ranks: worker0 the root, worker1 the callee that dies, worker2 a survivor that takes
      part. Rank 0 learns worker1's pid (an rpc_sync to it). In a context, t1, t2 = two 3x3
      requires-grad torch.rand; r1 = rpc_sync("worker1", slow_add, (t1, t2)) where slow_add
      returns torch.add(t1, t2) passed through a custom autograd Function whose backward sleeps
      0.2 s; r2 = rpc_sync("worker2", torch.add, (t1, t2)); loss = r1.sum() + r2.sum(). One such
      context is first run whole (warm-up; checks both gradients are 2 everywhere, then waits
      until worker2 holds no context). In the measured one, dist_autograd.backward runs in a
      thread of rank 0; 50 ms after it started, rank 0 SIGKILLs worker1 (os.kill), so the kill
      lands in worker1's sleeping backward. Prints a4_error_after_ms: from the kill until
      backward raises or returns, capped at 120 s (with "hung": true if the cap is hit; the line
      also says whether it raised and the error), and a4_survivor_contexts_after_1s: worker2's
      num_autograd_contexts 1 s after that, with rank 0's context still held (so what torch's
      error path itself left there). Its line also has worker2's count at 0 ms (at_0ms), rank
      0's own count at 1 s, and after_release_1s: rank 0 then leaves the context as a `with`
      would (release_ms: how long that call took) and asks worker2 again 1 s later (null if
      backward hung). torch cannot shut down gracefully after the kill, so rank 0 then tells
      worker2 to leave (it ends with os._exit), kills and reaps whatever child is left, and
      ends with os._exit; workers 1 and 2 never call rpc.shutdown in this mode (and leave by
      themselves, status 1, if rank 0 has not let them go after 120 s + 2 x --timeout + 60 s).

  torch_dist_autograd.py pipeline SPLITS BATCHES
      3 ranks: worker0 the master, worker1 stage 1, worker2 stage 2; the pattern of torch's
      "Distributed Pipeline Parallelism Using RPC" tutorial with a small CNN on 1x28x28 inputs
      instead of ResNet50. Each stage is an object made with rpc.remote on its worker
      (torch.manual_seed(0) before building it): stage 1 Conv2d(1,32,3,padding=1), ReLU,
      MaxPool2d(2), Conv2d(32,64,3,padding=1), ReLU, MaxPool2d(2); stage 2 Flatten,
      Linear(64*7*7,128), ReLU, Linear(128,10); its forward(x_rref) does x_rref.to_here() and
      runs its layers under a threading.Lock. Per batch of 128 inputs (torch.randn, then
      torch.randint labels in [0, 10), batch by batch, all drawn beforehand after
      torch.manual_seed(0)), in a context: the batch is cut into SPLITS micro-batches
      (Tensor.tensor_split); per micro-batch
      x_rref = RRef(x); y_rref = p1_rref.remote().forward(x_rref);
      z_fut = p2_rref.rpc_async().forward(y_rref); then out = torch.cat(torch.futures.wait_all(
      futs)); loss = CrossEntropyLoss()(out, labels); dist_autograd.backward;
      DistributedOptimizer(optim.SGD, both stages' parameter RRefs, lr=0.05).step(cid). One
      warm-up batch (checks the output's shape, a finite loss and that stage 1's parameters
      changed), then BATCHES timed batches (context enter to exit). Prints pipeline_s<SPLITS>_ms
      (mean ms per batch: forward + backward + step). Each micro-batch's forward holds a worker
      thread of its stage while it waits in to_here, and TensorPipe completes the answers it
      waits for on the same pool, so SPLITS forwards in flight need SPLITS+1 threads (8 and 8
      deadlock): without --threads the ranks use max(8, SPLITS+1) (the tutorial uses 256), and
      an explicit --threads of SPLITS or fewer is refused. The line's "threads" field says which.

Prints {"system":"torch_rpc","metric":...,"value":...} lines on stdout. Without torch it prints
nothing, says so on stderr and exits 0.

Differences from the tutorial, forced by this file importing torch only inside functions (so
that it can say torch is missing): the stages are instances of a plain class holding an
nn.Sequential rather than nn.Module subclasses (an RRef proxy call pickles the owner's class by
name, so it must be a module-level class), and a batch is cut into exactly SPLITS micro-batches
(tensor_split) where the tutorial passes the micro-batch size to Tensor.split.
"""
import argparse
import os
import signal
import sys
import threading
import time
import traceback

from torchlib import add_rank_args, emit, parse_size, percentile, rpc_main

SYSTEM = "torch_rpc"
DEFAULT_THREADS = 8
A1_WARMUP = 50
A2_WARMUP = 20
A3_WARMUP = 100
A4_KILL_AFTER_S = 0.05
A4_SLOW_BACKWARD_S = 0.2
A4_CAP_S = 120.0
A4_QUERY_TIMEOUT_S = 10.0
SETTLE_S = 1.0
PIPE_BATCH = 128
PIPE_WARMUP = 1
PIPE_LR = 0.05

_rank = 0  # this process's rank (run_rank sets it; hop reads it)
_a4_stop = threading.Event()  # a4: set (by a4_quit) when rank 0 lets a worker leave
_slow_cls = []
_slow_lock = threading.Lock()


# ------------------------------------------------------------------ what the ranks call on each other


def hop(t, k):
    import torch.distributed.rpc as rpc

    if k == 0:
        return t * 2
    return rpc.rpc_sync("worker%d" % (_rank + 1), hop, args=(t * 2, k - 1))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def autograd_debug():
    import torch.distributed.autograd as dist_autograd

    return {k: int(v) for k, v in dist_autograd._get_debug_info().items()}


def get_pid():
    return os.getpid()


def slow_add(t1, t2):
    """torch.add(t1, t2) through an autograd Function whose backward sleeps A4_SLOW_BACKWARD_S."""
    import torch

    with _slow_lock:
        if not _slow_cls:
            class SlowBackward(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.clone()

                @staticmethod
                def backward(ctx, g):
                    time.sleep(A4_SLOW_BACKWARD_S)
                    return g

            _slow_cls.append(SlowBackward)
    return _slow_cls[0].apply(torch.add(t1, t2))


def a4_quit():
    threading.Timer(0.05, _a4_stop.set).start()  # after this answer has gone
    return 0


class Stage:
    """A pipeline stage on its worker (the tutorial's ResNetShard1 / ResNetShard2)."""

    def __init__(self, k):
        import torch
        import torch.nn as nn

        torch.manual_seed(0)
        if k == 1:
            self.seq = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                     nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        else:
            self.seq = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))
        self._lock = threading.Lock()

    def forward(self, x_rref):
        x = x_rref.to_here()
        with self._lock:
            out = self.seq(x)
        return out

    def parameter_rrefs(self):
        from torch.distributed.rpc import RRef

        return [RRef(p) for p in self.seq.parameters()]

    def param_sum(self):
        import torch

        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.seq.parameters()))


# ------------------------------------------------------------------ options


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["a1", "a2", "a3", "a4", "pipeline"])
    p.add_argument("nums", nargs="*", help="ITERS | HOPS ITERS | N | (none) | SPLITS BATCHES")
    p.add_argument("--threads", type=int, default=None,
                   help="num_worker_threads of every rank (default %d; pipeline: at least SPLITS+1)" % DEFAULT_THREADS)
    p.add_argument("--timeout", type=float, default=300.0, help="rpc_timeout in seconds")
    add_rank_args(p)
    a = p.parse_args(argv)
    n = [parse_size(x) for x in a.nums]
    want = {"a1": 1, "a2": 2, "a3": 1, "a4": 0, "pipeline": 2}[a.mode]
    if len(n) != want:
        p.error("mode %s takes %d number(s)" % (a.mode, want))
    if n and min(n) <= 0:
        p.error("counts must be positive")
    a.hops = a.splits = 0
    if a.mode == "a1":
        a.count, a.warmup, a.world = n[0], A1_WARMUP, 2
    elif a.mode == "a2":
        a.hops, a.count, a.warmup = n[0], n[1], A2_WARMUP
        a.world = a.hops + 1
    elif a.mode == "a3":
        a.count, a.warmup, a.world = n[0], A3_WARMUP, 2
    elif a.mode == "a4":
        a.count, a.warmup, a.world = 1, 1, 3
    else:
        a.splits, a.count, a.warmup, a.world = n[0], n[1], PIPE_WARMUP, 3
        if a.splits > PIPE_BATCH:
            p.error("SPLITS must be at most %d" % PIPE_BATCH)
        # Each micro-batch's forward holds a thread of its stage's worker while it waits in
        # to_here, and the answers it waits for are completed on that pool too: with SPLITS
        # threads or fewer the stages deadlock (seen with 8 splits and 8 threads).
        if a.threads is not None and a.threads <= a.splits:
            p.error("pipeline needs --threads above SPLITS (%d): each micro-batch holds a worker thread "
                    "of its stage in to_here, and the answers need a free one" % a.splits)
        if a.threads is None:
            a.threads = max(DEFAULT_THREADS, a.splits + 1)
    if a.threads is None:
        a.threads = DEFAULT_THREADS
    if a.threads <= 0:
        p.error("--threads must be positive")
    return a


def emit_line(a, metric, value, unit, **fields):
    emit(SYSTEM, metric, value, unit, mode=a.mode, count=a.count, warmup=a.warmup, world=a.world,
         threads=a.threads, **fields)


# ------------------------------------------------------------------ the modes (rank 0)


def rand3(torch):
    return torch.rand(3, 3, requires_grad=True)


def measure_a1(a, torch, rpc, dist_autograd):
    now = time.perf_counter_ns
    lat = []
    for i in range(a.warmup + a.count):
        t0 = now()
        with dist_autograd.context() as cid:
            t1 = torch.rand(3, 3, requires_grad=True)
            t2 = torch.rand(3, 3, requires_grad=True)
            t3 = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
            t4 = torch.rand(3, 3, requires_grad=True)
            loss = (t3 * t4).sum()
            dist_autograd.backward(cid, [loss])
            g = dist_autograd.get_gradients(cid)
        dt = now() - t0
        if i == 0:
            torch.testing.assert_close(g[t1], t4.detach())
            torch.testing.assert_close(g[t2], t4.detach())
        if i >= a.warmup:
            lat.append(dt)
    lat.sort()
    emit_line(a, "a1_p50", percentile(lat, 50) / 1e3, "us")
    emit_line(a, "a1_p99", percentile(lat, 99) / 1e3, "us")


def measure_a2(a, torch, rpc, dist_autograd):
    now = time.perf_counter_ns
    want = torch.full((3, 3), float(2 ** a.hops))
    lat = []
    for i in range(a.warmup + a.count):
        t0 = now()
        with dist_autograd.context() as cid:
            x = torch.rand(3, 3, requires_grad=True)
            y = rpc.rpc_sync("worker1", hop, args=(x, a.hops - 1))
            loss = y.sum()
            dist_autograd.backward(cid, [loss])
            g = dist_autograd.get_gradients(cid)
        dt = now() - t0
        if i == 0:
            torch.testing.assert_close(g[x], want)
        if i >= a.warmup:
            lat.append(dt)
    lat.sort()
    emit_line(a, "a2_p50_h%d" % a.hops, percentile(lat, 50) / 1e3, "us", hops=a.hops)
    emit_line(a, "a2_p99_h%d" % a.hops, percentile(lat, 99) / 1e3, "us", hops=a.hops)


def measure_a3(a, torch, rpc, dist_autograd):
    now = time.perf_counter_ns
    two = torch.full((3, 3), 2.0)

    def one(check):
        with dist_autograd.context() as cid:
            t1 = rand3(torch)
            t2 = rand3(torch)
            r1 = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
            r2 = rpc.rpc_sync("worker1", torch.add, args=(t1, t2))
            loss = r1.sum() + r2.sum()
            dist_autograd.backward(cid, [loss])
            if check:
                g = dist_autograd.get_gradients(cid)
                torch.testing.assert_close(g[t1], two)
                torch.testing.assert_close(g[t2], two)

    for i in range(a.warmup):
        one(i == 0)
    rss0 = [rss_bytes(), rpc.rpc_sync("worker1", rss_bytes)]
    t0 = now()
    for _ in range(a.count):
        one(False)
    t_end = now()
    dbg_0 = [autograd_debug(), rpc.rpc_sync("worker1", autograd_debug)]
    rss1 = [rss_bytes(), rpc.rpc_sync("worker1", rss_bytes)]
    time.sleep(max(0.0, (t_end + SETTLE_S * 1e9 - now()) / 1e9))
    dbg_1 = [autograd_debug(), rpc.rpc_sync("worker1", autograd_debug)]
    live_0 = [d["num_autograd_contexts"] for d in dbg_0]
    live_1 = [d["num_autograd_contexts"] for d in dbg_1]
    emit_line(a, "a3_seconds", (t_end - t0) / 1e9, "s")
    for r in (0, 1):
        emit_line(a, "a3_rss_growth_mb_rank%d" % r, (rss1[r] - rss0[r]) / float(1 << 20), "MiB",
                  rss_before_mb=round(rss0[r] / float(1 << 20), 1), rss_after_mb=round(rss1[r] / float(1 << 20), 1))
    emit_line(a, "a3_live_contexts_after_1s", max(live_1), "contexts", at_0ms=max(live_0), per_rank_0ms=live_0,
              per_rank_1s=live_1, backward_passes_0ms=[d["num_current_backward_passes"] for d in dbg_0],
              backward_passes_1s=[d["num_current_backward_passes"] for d in dbg_1])


def _children():
    """Pids of this process's children (from /proc), zombies included."""
    me, kids = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                s = f.read()
        except OSError:
            continue
        if int(s[s.rindex(")") + 2:].split()[1]) == me:
            kids.append(int(d))
    return kids


def _reap(pids, timeout):
    """Waits up to timeout s for pids to end; returns those still running."""
    left = set(pids)
    deadline = time.monotonic() + timeout
    while left:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                left.discard(pid)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return left


def end_children(rpc):
    """a4, rank 0: lets worker2 leave (a4_quit), then kills and reaps every child left."""
    try:
        rpc.rpc_async("worker2", a4_quit, timeout=A4_QUERY_TIMEOUT_S)
    except Exception:  # noqa: B902 - the agent may be broken; the kill below covers it
        pass
    left = _reap(_children(), 3.0)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = _reap(left, 10.0)
    if left:
        print("torch_dist_autograd.py: children %s still running" % sorted(left), file=sys.stderr)


def measure_a4(a, torch, rpc, dist_autograd):
    now = time.perf_counter_ns
    pid1 = rpc.rpc_sync("worker1", get_pid)

    def forward():
        t1 = rand3(torch)
        t2 = rand3(torch)
        r1 = rpc.rpc_sync("worker1", slow_add, args=(t1, t2))
        r2 = rpc.rpc_sync("worker2", torch.add, args=(t1, t2))
        return t1, t2, r1.sum() + r2.sum()

    def survivor_contexts():
        try:
            return rpc.rpc_sync("worker2", autograd_debug, timeout=A4_QUERY_TIMEOUT_S)["num_autograd_contexts"]
        except Exception as e:  # noqa: B902 - reported as -1
            print("torch_dist_autograd.py: worker2's debug info: %s: %s" % (type(e).__name__, e), file=sys.stderr)
            return -1

    # Warm-up and check: one whole context, nobody killed.
    two = torch.full((3, 3), 2.0)
    with dist_autograd.context() as cid:
        t1, t2, loss = forward()
        dist_autograd.backward(cid, [loss])
        g = dist_autograd.get_gradients(cid)
        torch.testing.assert_close(g[t1], two)
        torch.testing.assert_close(g[t2], two)
    deadline = time.monotonic() + A4_QUERY_TIMEOUT_S
    while survivor_contexts() != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("worker2 still holds the warm-up's context")
        time.sleep(0.01)

    # The measured context: entered here and left below only if backward ended.
    ctx = dist_autograd.context()
    cid = ctx.__enter__()
    t1, t2, loss = forward()
    out = {}

    def backward():
        try:
            dist_autograd.backward(cid, [loss])
            out["raised"] = False
        except Exception as e:  # noqa: B902 - what torch raises is the measurement
            out["raised"] = True
            out["error"] = ("%s: %s" % (type(e).__name__, e))[:300]
        out["t_end"] = now()

    th = threading.Thread(target=backward, daemon=True)
    t_bw = now()
    th.start()
    time.sleep(max(0.0, (t_bw + A4_KILL_AFTER_S * 1e9 - now()) / 1e9))
    os.kill(pid1, signal.SIGKILL)
    t_kill = now()
    running_at_kill = th.is_alive() and "t_end" not in out
    th.join(A4_CAP_S)
    hung = th.is_alive()
    if hung:
        t_end, after_ms = now(), A4_CAP_S * 1e3
    else:
        t_end = out["t_end"]
        after_ms = (t_end - t_kill) / 1e6
    surv_0 = survivor_contexts()
    time.sleep(max(0.0, (t_end + SETTLE_S * 1e9 - now()) / 1e9))
    surv_1 = survivor_contexts()
    rank0_1 = autograd_debug()["num_autograd_contexts"]
    # Then as a `with` would: rank 0 leaves the context (in this thread, whose current context it
    # is; the release only sends the cleanup messages, it waits for none), and worker2 is asked
    # again 1 s later.
    surv_rel = release_ms = None
    if not hung:
        t_rel = now()
        ctx.__exit__(None, None, None)
        release_ms = round((now() - t_rel) / 1e6, 3)
        time.sleep(max(0.0, (t_rel + SETTLE_S * 1e9 - now()) / 1e9))
        surv_rel = survivor_contexts()
    fields = {"hung": hung, "raised": out.get("raised"), "kill_after_ms": round((t_kill - t_bw) / 1e6, 3),
              "backward_running_at_kill": running_at_kill}
    if "error" in out:
        fields["error"] = out["error"]
    emit_line(a, "a4_error_after_ms", after_ms, "ms", **fields)
    emit_line(a, "a4_survivor_contexts_after_1s", surv_1, "contexts", at_0ms=surv_0,
              rank0_contexts_1s=rank0_1, after_release_1s=surv_rel,
              release_ms=release_ms)


def measure_pipeline(a, torch, rpc, dist_autograd):
    import torch.nn as nn
    import torch.optim as optim
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef

    now = time.perf_counter_ns
    p1_rref = rpc.remote("worker1", Stage, args=(1,))
    p2_rref = rpc.remote("worker2", Stage, args=(2,))

    def model(xs):  # the tutorial's DistResNet50.forward
        out_futures = []
        for x in xs.tensor_split(a.splits):
            x_rref = RRef(x)
            y_rref = p1_rref.remote().forward(x_rref)
            z_fut = p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    params = []
    params.extend(p1_rref.remote().parameter_rrefs().to_here())
    params.extend(p2_rref.remote().parameter_rrefs().to_here())
    loss_fn = nn.CrossEntropyLoss()
    opt = DistributedOptimizer(optim.SGD, params, lr=PIPE_LR)

    torch.manual_seed(0)
    n = a.warmup + a.count
    data = [(torch.randn(PIPE_BATCH, 1, 28, 28), torch.randint(0, 10, (PIPE_BATCH,))) for _ in range(n)]
    before = p1_rref.rpc_sync().param_sum()
    times, losses = [], []
    for i in range(n):
        t0 = now()
        with dist_autograd.context() as cid:
            outputs = model(data[i][0])
            loss = loss_fn(outputs, data[i][1])
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        dt = now() - t0
        losses.append(float(loss))
        if i == 0:
            assert tuple(outputs.shape) == (PIPE_BATCH, 10), outputs.shape
            assert torch.isfinite(loss).item(), loss
            assert p1_rref.rpc_sync().param_sum() != before, "stage 1's parameters did not change"
        if i >= a.warmup:
            times.append(dt)
    emit_line(a, "pipeline_s%d_ms" % a.splits, sum(times) / len(times) / 1e6, "ms", splits=a.splits,
              batch=PIPE_BATCH, lr=PIPE_LR, loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4))


MEASURE = {"a1": measure_a1, "a2": measure_a2, "a3": measure_a3, "a4": measure_a4, "pipeline": measure_pipeline}


# ------------------------------------------------------------------ ranks


def run_a4_rank(a, torch, rpc, dist_autograd):
    """a4 ends every rank with os._exit: after the kill torch cannot shut down gracefully."""
    code = 1
    try:
        if a.rank == 0:
            try:
                measure_a4(a, torch, rpc, dist_autograd)
                code = 0
            finally:
                end_children(rpc)
        else:
            # Bounded: rank 0 lets it go (a4_quit) or kills it long before.
            code = 0 if _a4_stop.wait(A4_CAP_S + 2 * a.timeout + 60) else 1
    except BaseException:  # noqa: B902 - said on stderr, then out without destructors
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_rank(a):
    global _rank
    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    _rank = a.rank
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(a.port)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=a.threads, rpc_timeout=a.timeout,
                                           init_method="env://")
    rpc.init_rpc("worker%d" % a.rank, rank=a.rank, world_size=a.world, rpc_backend_options=opts)
    if a.mode == "a4":
        run_a4_rank(a, torch, rpc, dist_autograd)  # does not return
    if a.rank == 0:
        try:
            MEASURE[a.mode](a, torch, rpc, dist_autograd)
        except BaseException:
            # A graceful shutdown would wait, unbounded, for ranks that may be stuck: leave at
            # once; rpc_main then kills the other ranks.
            rpc.shutdown(graceful=False)
            raise
    rpc.shutdown()  # graceful: waits for the other ranks


def main(argv):
    a = parse_args(argv)
    return rpc_main("torch_dist_autograd.py", __file__, argv, a, a.world, run_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
