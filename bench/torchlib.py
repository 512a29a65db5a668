"""Helpers shared by the torch peers of the benchmarks (torch_rpc.py, torch_rref.py, torch_ps.py,
torch_gloo.py, torch_ddp_train.py, torch_ps_train.py): sizes, percentiles, their JSON lines and
starting their ranks on 127.0.0.1. torch is imported only inside the functions that need it, so
that a peer can say it is missing and skip."""
import argparse
import datetime
import importlib.util
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

from benchlib import size_label

__all__ = ["add_rank_args", "emit", "fork_ranks", "free_port", "join_gloo", "parse_size", "percentile",
           "rpc_main", "size_label"]

_stores = []  # a rank's TCPStore client lives as long as the rank


def parse_size(s):
    """"4K", "16M", "1G" or a plain count."""
    s = s.strip()
    mult = 1
    for suffix, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if s.upper().endswith(suffix):
            s, mult = s[:-1], m
            break
    return int(s) * mult


def percentile(sorted_v, p):
    """Nearest rank, as bench_common.h."""
    k = int(p / 100.0 * len(sorted_v) + 0.999999)
    return sorted_v[min(max(k, 1), len(sorted_v)) - 1]


def emit(system, metric, value, unit, **fields):
    """One measurement line on stdout: system, metric, value (6 significant digits), unit, then
    fields in their order."""
    line = {"system": system, "metric": metric, "value": float("%.6g" % value), "unit": unit}
    line.update(fields)
    print(json.dumps(line, separators=(",", ":")), flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ torch.distributed.rpc peers


def add_rank_args(p):
    """The hidden options by which rank 0 starts the others (see rpc_main)."""
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def rpc_main(prog, script, argv, a, world, run_rank):
    """The main of a peer whose ranks are processes of its script: rank 0 (this one, a.rank 0)
    picks a free port (a.port) and starts ranks 1 .. world-1 as `python SCRIPT ARGV --rank R
    --port P`, then every rank runs run_rank(a). Without torch it says so on stderr and returns 0.
    Returns the exit status: 1 if a rank failed."""
    if a.rank != 0:
        run_rank(a)
        return 0
    if importlib.util.find_spec("torch") is None:
        print("%s: torch is not installed for %s; skipping" % (prog, sys.executable), file=sys.stderr)
        return 0
    a.port = free_port()
    children = [subprocess.Popen([sys.executable, os.path.abspath(script)] + argv +
                                 ["--rank", str(r), "--port", str(a.port)])
                for r in range(1, world)]
    try:
        run_rank(a)
    except BaseException:
        for c in children:
            c.kill()
            c.wait()
        raise
    bad = 0
    for r, c in enumerate(children, 1):
        try:
            rc = c.wait(timeout=60)
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
            rc = -1
        if rc != 0:
            print("%s: rank %d exited with %d" % (prog, r, rc), file=sys.stderr)
            bad = 1
    return bad


# ------------------------------------------------------------------ forked ranks (gloo)


def _rank_process(prog, rank_main, args, failed_text):
    code = 0
    try:
        if rank_main(*args) is False:
            print("%s[rank %d]: %s" % (prog, args[1], failed_text), file=sys.stderr)
            code = 1
    except BaseException as e:  # noqa: B902 - report anything, then leave without destructors
        print("%s[rank %d]: %s: %s" % (prog, args[1], type(e).__name__, e), file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join_gloo(rank, world, port, timeout_s):
    """In a forked rank: joins the gloo process group of world ranks through the parent's TCPStore
    on port, with a timeout of timeout_s seconds for its operations."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    _stores.append(store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def fork_ranks(prog, n, rank_main, a, timeout, extra_args=tuple, failed_text=None):
    """Forks n ranks over loopback: the parent holds a TCPStore on a free port, then rank r runs
    rank_main(a, r, store_port, *extra_args()) (extra_args is called once the store has its port)
    and exits without destructors, 1 if it raised or returned False (failed_text says why). The
    ranks are killed when one fails or after timeout seconds. Returns the exit status: 1 if any
    failed."""
    deadline = time.monotonic() + timeout
    import torch.distributed as dist  # imported once here: the forked ranks share it

    warnings.simplefilter("ignore")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    extra = tuple(extra_args())
    ctx = multiprocessing.get_context("fork")
    procs = []
    for r in range(n):
        p = ctx.Process(target=_rank_process, args=(prog, rank_main, (a, r, store.port) + extra, failed_text),
                        daemon=True)
        p.start()
        procs.append(p)
    bad = False
    while any(p.is_alive() for p in procs):
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            print("%s: %s; killing the ranks" % (prog, "a rank failed" if failed else "timed out"), file=sys.stderr)
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            bad = True
            break
        time.sleep(0.02)
    for p in procs:
        p.join(5)
        if p.exitcode != 0:
            bad = True
    return 1 if bad else 0
