#!/usr/bin/env python3
"""Chaos runs for weft (docs/chaos.md).

For each seed: starts a world of chaos_rank processes on 127.0.0.1 running a mixed workload (RPCs,
collectives, RRef forks, parameter-server push/pull with checkpoints, distributed backward with the
distributed optimizer), then SIGKILLs or SIGSTOPs one rank at a moment drawn from the seed: when a
chosen rank reports a chosen phase of a chosen iteration, plus a drawn delay of under 20 ms. Then
it checks:

  - every survivor reported an error (WEFT_ERR_PEER_LOST or WEFT_ERR_OWNER_LOST, with a text that
    names the lost rank) before the error deadline, and none before the fault; the time from the
    fault to each survivor's error is measured (CLOCK_MONOTONIC, shared by the processes of a host)
    and times over 2 s are flagged;
  - no process hung: every process has exited by the seed's deadline (a stopped victim is resumed
    once the survivors are gone and must end cleanly too); otherwise its stacks are taken with gdb
    and it is killed;
  - every process that was not SIGKILLed exited 0 with no sanitizer report (leaks included, in the
    ASan build);
  - no value read was wrong, and a fresh world restarted from the last checkpoint holds exactly the
    pushes of the steps before the checkpoint's clock (which is at least the last checkpoint any
    rank saw acknowledged) and reaches the fault-free final values.

    driver.py --builddir build --seeds 1-200 [--json results.json]

Exit status 0 when every seed passed (times over 2 s are reported, not failed, unless
--strict-2s).
"""
import argparse
import atexit
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PHASES = ("rpc", "coll", "rref", "ps", "dist")
SERVERS = (0, 1)
GOOD_STATUSES = ("WEFT_ERR_PEER_LOST", "WEFT_ERR_OWNER_LOST")
SANITIZER_RE = re.compile(r"ERROR: (Address|Leak|Undefined|Thread)Sanitizer|runtime error:")
MASK64 = (1 << 64) - 1


class SplitMix64:
    """The plan's generator: a seed gives the same plan on any Python."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n


def plan_of(seed, world, iters):
    """What seed @seed does: the victim, the signal, and the moment."""
    rng = SplitMix64(seed * 0x1000193 + 17)
    return {
        "victim": rng.below(world),
        "signal": "SIGSTOP" if rng.below(2) else "SIGKILL",
        "trigger_rank": rng.below(world),
        "trigger_iter": 1 + rng.below(max(1, iters - 4)),
        "trigger_phase": PHASES[rng.below(len(PHASES))],
        "delay_us": rng.below(20000),
    }


def parse_seeds(text):
    seeds = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            seeds.extend(range(int(lo), int(hi) + 1))
        elif part:
            seeds.append(int(part))
    return seeds


class Rank:
    def __init__(self, rank, proc, err_path):
        self.rank = rank
        self.proc = proc
        self.err_path = err_path
        self.buf = b""
        self.lines = []
        self.error = None  # (t_ns, status, where, text)
        self.saved = []
        self.bad = []
        self.loaded = None
        self.final = None
        self.shutdown = None
        self.code = None
        self.eof = False


class World:
    """A world of chaos_rank processes and their line protocol (chaos_rank.c's header)."""

    def __init__(self, args, mode, seed, tmp, tag):
        self.args = args
        self.ranks = []
        self.sel = selectors.DefaultSelector()
        self.mode = mode
        self.seed = seed
        self.tmp = tmp
        self.tag = tag

    def spawn(self, rank, port):
        err_path = os.path.join(self.tmp, "%s-rank%d.stderr" % (self.tag, rank))
        cmd = [self.args.rank_bin, self.mode, str(rank), str(self.args.world), str(port),
               str(self.seed), str(self.args.iters), os.path.join(self.tmp, "ckpt"),
               str(self.args.peer_timeout_ms)]
        env = None
        if self.args.tls_dir is not None:
            # Every connection under TLS, on the network path (ranks of one host otherwise talk
            # through shared memory, which TLS does not wrap): the direct connections' sealed
            # records take the faults too.
            d = self.args.tls_dir
            env = dict(os.environ, WEFT_SHM="0", WEFT_TLS_CA=os.path.join(d, "ca.pem"),
                       WEFT_TLS_CERT=os.path.join(d, "rank%d.pem" % rank),
                       WEFT_TLS_KEY=os.path.join(d, "rank%d.key" % rank))
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, start_new_session=True, env=env)
        os.set_blocking(proc.stdout.fileno(), False)
        r = Rank(rank, proc, err_path)
        self.ranks.append(r)
        self.sel.register(proc.stdout, selectors.EVENT_READ, r)
        return r

    def start(self, deadline):
        r0 = self.spawn(0, 0)
        port = None
        while port is None and time.monotonic() < deadline and r0.proc.poll() is None:
            for line in self.pump(0.1):
                rank, text = line
                if text.startswith("PORT "):
                    port = int(text.split()[1])
        if port is None:
            return False
        for rank in range(1, self.args.world):
            self.spawn(rank, port)
        return True

    def pump(self, timeout):
        """Reads what the ranks wrote; returns [(Rank, line)] for the new lines."""
        out = []
        for key, _ in self.sel.select(timeout):
            r = key.data
            try:
                data = os.read(r.proc.stdout.fileno(), 65536)
            except BlockingIOError:
                continue
            if not data:
                r.eof = True
                self.sel.unregister(r.proc.stdout)
                continue
            r.buf += data
            while b"\n" in r.buf:
                raw, r.buf = r.buf.split(b"\n", 1)
                text = raw.decode("utf-8", "replace")
                r.lines.append(text)
                self.note(r, text)
                out.append((r, text))
        return out

    @staticmethod
    def note(r, text):
        if text.startswith("E ") and r.error is None:
            parts = text.split(" ", 5)
            r.error = (int(parts[1]), parts[2], "iter %s %s" % (parts[3], parts[4]),
                       parts[5] if len(parts) > 5 else "")
        elif text.startswith("SAVED "):
            r.saved.append(int(text.split()[1]))
        elif text.startswith("BAD"):
            r.bad.append(text)
        elif text.startswith("LOADED "):
            r.loaded = int(text.split()[1])
        elif text.startswith("FINAL "):
            r.final = int(text.split()[1])
        elif text.startswith("SHUTDOWN "):
            r.shutdown = text.split()[1]

    def tell(self, r, text):
        try:
            r.proc.stdin.write((text + "\n").encode())
            r.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def reap(self):
        for r in self.ranks:
            if r.code is None:
                c = r.proc.poll()
                if c is not None:
                    r.code = c

    def alive(self, ranks=None):
        self.reap()
        return [r for r in (ranks if ranks is not None else self.ranks) if r.code is None]

    def wait_exit(self, ranks, deadline):
        while self.alive(ranks) and time.monotonic() < deadline:
            self.pump(0.05)
        self.pump(0)
        return self.alive(ranks)

    def kill_all(self):
        for r in self.ranks:
            if r.proc.poll() is None:
                try:
                    os.kill(r.proc.pid, signal.SIGKILL)
                    os.kill(r.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        for r in self.ranks:
            try:
                r.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if r.code is None:
                r.code = r.proc.returncode
        self.pump(0)
        for r in self.ranks:
            for f in (r.proc.stdin, r.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.sel.close()

    def stacks(self, r, why):
        """gdb's stacks of every thread of a hung process, into a file; returns its path."""
        path = os.path.join(self.tmp, "%s-rank%d.stacks" % (self.tag, r.rank))
        gdb = shutil.which("gdb")
        if gdb is None:
            return None
        with open(path, "w") as f:
            f.write("# %s\n" % why)
            f.flush()
            try:
                subprocess.run([gdb, "-p", str(r.proc.pid), "-batch", "-nx",
                                "-ex", "thread apply all bt"],
                               stdout=f, stderr=subprocess.STDOUT, timeout=120)
            except subprocess.TimeoutExpired:
                f.write("gdb timed out\n")
        return path


def sanitizer_report(path):
    try:
        with open(path, "r", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    m = SANITIZER_RE.search(text)
    if m is None:
        return None
    return text[max(0, m.start() - 200):m.start() + 1500]


def names_rank(text, victim):
    return re.search(r"\brank %d\b|\bworker ?%d\b" % (victim, victim), text) is not None


def run_seed(args, seed):
    p = plan_of(seed, args.world, args.iters)
    scale = 3.0 if args.sanitized else 1.0
    res = {"seed": seed, "plan": p, "failures": [], "hang": False, "lost_updates": False,
           "latencies_ms": {}, "statuses": {}}
    fail = res["failures"]
    tmp = tempfile.mkdtemp(prefix="weft-chaos-%d-" % seed)
    res["tmp"] = tmp
    world = World(args, "run", seed, tmp, "run")
    victim_sig = signal.SIGSTOP if p["signal"] == "SIGSTOP" else signal.SIGKILL
    t_fault = None
    seed_deadline = time.monotonic() + args.deadline_s * scale
    try:
        if not world.start(time.monotonic() + 60 * scale):
            fail.append("rank 0 never gave its port")
            return res
        victim = world.ranks[p["victim"]]
        survivors = [r for r in world.ranks if r is not victim]
        fire_at = None
        # Run until the trigger, then the fault.
        while t_fault is None and time.monotonic() < seed_deadline:
            for r, text in world.pump(0.01):
                if (fire_at is None and r.rank == p["trigger_rank"] and
                        text == "P %d %s" % (p["trigger_iter"], p["trigger_phase"])):
                    fire_at = time.monotonic() + p["delay_us"] / 1e6
            if fire_at is not None and time.monotonic() >= fire_at:
                t_fault = time.monotonic_ns()
                os.kill(victim.proc.pid, victim_sig)
                break
            if any(r.error is not None for r in world.ranks):
                fail.append("an error before the fault: rank %d: %s" % next(
                    (r.rank, r.error) for r in world.ranks if r.error is not None))
                return res
            if world.alive() != world.ranks:
                fail.append("a rank ended before the fault: %s" % [
                    (r.rank, r.code) for r in world.ranks if r.code is not None])
                return res
        if t_fault is None:
            fail.append("the trigger never came (iteration %d, phase %s of rank %d)" % (
                p["trigger_iter"], p["trigger_phase"], p["trigger_rank"]))
            return res
        res["fault_ns"] = t_fault
        # Every survivor must fail, with the lost rank named.
        err_deadline = time.monotonic() + args.error_deadline_s * scale
        while time.monotonic() < err_deadline and any(r.error is None for r in survivors):
            world.pump(0.02)
            world.reap()
            if any(r.error is None and r.code is not None for r in survivors):
                break
        for r in survivors:
            if r.error is None:
                fail.append("rank %d: no error within %.0f s of the fault" % (
                    r.rank, args.error_deadline_s * scale))
                continue
            t_ns, status, where, text = r.error
            ms = (t_ns - t_fault) / 1e6
            res["latencies_ms"][r.rank] = ms
            res["statuses"][r.rank] = "%s at %s: %s" % (status, where, text)
            if ms < 0:
                fail.append("rank %d: an error %.1f ms before the fault: %s %s" % (
                    r.rank, -ms, status, text))
            if status not in GOOD_STATUSES:
                fail.append("rank %d: status %s (%s): %s" % (r.rank, status, where, text))
            elif not names_rank(text, victim.rank):
                fail.append("rank %d: the error does not name rank %d: %s" % (
                    r.rank, victim.rank, text))
        # Then the end: survivors first, a stopped victim resumed after them.
        for r in survivors:
            world.tell(r, "STOP")
        exit_deadline = time.monotonic() + args.exit_deadline_s * scale
        left = world.wait_exit(survivors, exit_deadline)
        if victim_sig == signal.SIGSTOP:
            if left:
                # The stopped victim must not be what holds the survivors: resume it anyway,
                # after their stacks are taken.
                pass
            else:
                world.tell(victim, "STOP")
                os.kill(victim.proc.pid, signal.SIGCONT)
                left = world.wait_exit([victim], time.monotonic() + args.exit_deadline_s * scale)
        else:
            world.wait_exit([victim], time.monotonic() + 10)
        for r in left:
            res["hang"] = True
            path = world.stacks(r, "seed %d rank %d still running at the deadline" % (seed, r.rank))
            fail.append("rank %d hung (stacks: %s)" % (r.rank, path))
    finally:
        world.kill_all()
    # Exit codes and sanitizer reports.
    for r in world.ranks:
        killed = r is world.ranks[p["victim"]] and victim_sig == signal.SIGKILL
        if not killed and r.code != 0 and not res["hang"]:
            fail.append("rank %d exited with %s (shutdown %s)" % (r.rank, r.code, r.shutdown))
        rep = sanitizer_report(r.err_path)
        if rep is not None:
            fail.append("rank %d: sanitizer report in %s:\n%s" % (r.rank, r.err_path, rep))
        if r.bad:
            fail.append("rank %d: wrong values: %s" % (r.rank, "; ".join(r.bad[:3])))
            res["lost_updates"] = True
        if r is world.ranks[p["victim"]] and victim_sig == signal.SIGSTOP:
            res["victim_after_resume"] = {"code": r.code, "error": r.error,
                                          "shutdown": r.shutdown}
    res["acked_checkpoint"] = max([c for r in world.ranks for c in r.saved], default=-1)
    res["acked_by_rank"] = {r.rank: max(r.saved, default=-1) for r in world.ranks}
    if p["victim"] in SERVERS or args.restart_all:
        restart(args, seed, tmp, res)
    return res


def restart(args, seed, tmp, res):
    """A fresh world from the last checkpoint: exact values at its clock and at the end."""
    fail = res["failures"]
    scale = 3.0 if args.sanitized else 1.0
    world = World(args, "restart", seed, tmp, "restart")
    try:
        if not world.start(time.monotonic() + 60 * scale):
            fail.append("restart: rank 0 never gave its port")
            return
        left = world.wait_exit(world.ranks, time.monotonic() + args.deadline_s * scale)
        for r in left:
            res["hang"] = True
            path = world.stacks(r, "seed %d restart rank %d still running" % (seed, r.rank))
            fail.append("restart: rank %d hung (stacks: %s)" % (r.rank, path))
    finally:
        world.kill_all()
    loaded = {r.loaded for r in world.ranks}
    res["restart"] = {"loaded": sorted(x for x in loaded if x is not None),
                      "final": [r.final for r in world.ranks]}
    acked = res["acked_checkpoint"]
    for r in world.ranks:
        if r.code != 0 or r.error is not None:
            fail.append("restart: rank %d exited with %s: %s" % (r.rank, r.code, r.error))
        if r.bad:
            fail.append("restart: rank %d: wrong values: %s" % (r.rank, "; ".join(r.bad[:3])))
            res["lost_updates"] = True
        if r.final != args.iters:
            fail.append("restart: rank %d did not reach the final values (FINAL %s)" % (
                r.rank, r.final))
        rep = sanitizer_report(r.err_path)
        if rep is not None:
            fail.append("restart: rank %d: sanitizer report in %s:\n%s" % (r.rank, r.err_path, rep))
    if len(loaded) != 1 or None in loaded:
        fail.append("restart: ranks loaded clocks %s" % sorted(loaded, key=str))
    elif next(iter(loaded)) < acked:
        fail.append("restart: the checkpoint at clock %d is older than the acknowledged one (%d; "
                    "the last each rank saw acknowledged: %s)"
                    % (next(iter(loaded)), acked, res["acked_by_rank"]))
        res["lost_updates"] = True


def save_lost(args):
    """The regression of a save that waited for a lost worker's request until its deadline: the
    last rank is killed while the others save; each save must fail with WEFT_ERR_PEER_LOST naming
    it. Returns the failures."""
    fail = []
    scale = 3.0 if args.sanitized else 1.0
    tmp = tempfile.mkdtemp(prefix="weft-chaos-savelost-")
    world = World(args, "savelost", 0, tmp, "savelost")
    last = args.world - 1
    try:
        if not world.start(time.monotonic() + 60 * scale):
            return ["save-lost: rank 0 never gave its port"], tmp
        deadline = time.monotonic() + 60 * scale
        saving = set()
        while len(saving) < last and time.monotonic() < deadline:
            for r, text in world.pump(0.05):
                if text == "SAVING":
                    saving.add(r.rank)
            if world.alive() != world.ranks:
                break
        if len(saving) < last:
            return ["save-lost: the ranks never all began saving"], tmp
        # Let the requests reach the servers (if they do not yet, the loss comes first: both
        # orders must fail the save at once).
        time.sleep(0.2)
        t_fault = time.monotonic_ns()
        os.kill(world.ranks[last].proc.pid, signal.SIGKILL)
        survivors = world.ranks[:last]
        err_deadline = time.monotonic() + args.error_deadline_s * scale
        while time.monotonic() < err_deadline and any(r.error is None for r in survivors):
            world.pump(0.02)
        left = world.wait_exit(survivors, time.monotonic() + args.exit_deadline_s * scale)
        for r in left:
            fail.append("save-lost: rank %d hung (stacks: %s)" % (
                r.rank, world.stacks(r, "save-lost rank %d" % r.rank)))
    finally:
        world.kill_all()
    for r in world.ranks[:last]:
        if r.error is None or r.error[1] != "WEFT_ERR_PEER_LOST" or not names_rank(r.error[3], last):
            fail.append("save-lost: rank %d: %s" % (r.rank, r.error))
        elif (r.error[0] - t_fault) / 1e6 > args.error_deadline_s * 1000 * scale:
            fail.append("save-lost: rank %d failed late" % r.rank)
        if r.code != 0 or r.bad:
            fail.append("save-lost: rank %d exited with %s %s" % (r.rank, r.code, r.bad))
        rep = sanitizer_report(r.err_path)
        if rep is not None:
            fail.append("save-lost: rank %d: sanitizer report:\n%s" % (r.rank, rep))
    return fail, tmp


def percentile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = max(0, min(len(xs) - 1, int(round(q * (len(xs) - 1)))))
    return xs[k]


def describe(res):
    p = res["plan"]
    kind = "server" if p["victim"] in SERVERS else "worker"
    lat = res["latencies_ms"]
    head = "seed %d: %s rank %d (%s) at rank %d's iter %d %s +%.1f ms" % (
        res["seed"], p["signal"], p["victim"], kind, p["trigger_rank"], p["trigger_iter"],
        p["trigger_phase"], p["delay_us"] / 1000)
    errs = ", ".join("%d: %.0f ms" % (k, v) for k, v in sorted(lat.items()))
    extra = ""
    if "restart" in res:
        extra = "; restart from clock %s" % (res["restart"]["loaded"] or "?")
    return "%s -> errors {%s}%s" % (head, errs, extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builddir", help="meson build directory (finds tests/chaos/chaos_rank)")
    ap.add_argument("--rank-bin", help="the chaos_rank program")
    ap.add_argument("--seeds", default="1-4", help="e.g. 1-200 or 3,7,9")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12, help="workload iterations (PS steps)")
    ap.add_argument("--peer-timeout-ms", type=int, default=1000)
    ap.add_argument("--sanitized", action="store_true", help="deadlines x3 (ASan build)")
    ap.add_argument("--deadline-s", type=float, default=60, help="a world's whole run")
    ap.add_argument("--error-deadline-s", type=float, default=30,
                    help="every survivor's error after the fault")
    ap.add_argument("--exit-deadline-s", type=float, default=30, help="the exits after STOP")
    ap.add_argument("--restart-all", action="store_true",
                    help="restart from the checkpoint after every seed (default: server victims)")
    ap.add_argument("--strict-2s", action="store_true", help="fail a seed with an error after 2 s")
    ap.add_argument("--save-lost", action="store_true",
                    help="first the regression of a checkpoint with a lost worker")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="start no seed after this many seconds (0: no limit)")
    ap.add_argument("--json", help="write every seed's result here")
    ap.add_argument("--keep", action="store_true", help="keep every seed's directory")
    ap.add_argument("--plan", action="store_true", help="print the seeds' plans and exit")
    ap.add_argument("--tls", action="store_true",
                    help="every connection under TLS with a job CA (and WEFT_SHM=0, the network "
                         "path)")
    args = ap.parse_args()
    args.tls_dir = None
    seeds = parse_seeds(args.seeds)
    # Terminated: unwind, so that the running world is killed (its ranks have sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.plan:
        for s in seeds:
            print(s, plan_of(s, args.world, args.iters))
        return 0
    if args.rank_bin is None:
        if args.builddir is None:
            ap.error("--rank-bin or --builddir")
        args.rank_bin = os.path.join(args.builddir, "tests", "chaos", "chaos_rank")
    if args.world < 4:
        ap.error("a world of 4 ranks at least")
    if args.tls:
        args.tls_dir = tempfile.mkdtemp(prefix="weft-chaos-tls-")
        atexit.register(shutil.rmtree, args.tls_dir, True)
        made = subprocess.run([args.rank_bin, "certs", args.tls_dir, str(args.world)])
        if made.returncode != 0:
            print("chaos: could not make the job's certificates", file=sys.stderr)
            return 1
    results = []
    t0 = time.monotonic()
    if args.save_lost:
        fail, tmp = save_lost(args)
        print("save-lost regression: %s" % ("FAIL" if fail else "ok"), flush=True)
        for f in fail:
            print("    " + f.replace("\n", "\n    "), flush=True)
        if fail:
            print("    kept: %s" % tmp)
            return 1
        shutil.rmtree(tmp, ignore_errors=True)
    for seed in seeds:
        if args.max_seconds and time.monotonic() - t0 > args.max_seconds:
            print("stopping: --max-seconds %g passed before seed %d" % (args.max_seconds, seed))
            break
        t = time.monotonic()
        res = run_seed(args, seed)
        res["seconds"] = time.monotonic() - t
        lat = res["latencies_ms"]
        slow = [r for r, ms in lat.items() if ms > 2000]
        if slow:
            res["over_2s"] = slow
            if args.strict_2s:
                res["failures"].append("ranks %s got their error after more than 2 s" % slow)
        verdict = "FAIL" if res["failures"] else ("ok, >2s: %s" % slow if slow else "ok")
        print("%s [%s, %.1f s]" % (describe(res), verdict, res["seconds"]), flush=True)
        for f in res["failures"]:
            print("    " + f.replace("\n", "\n    "), flush=True)
        if res["failures"]:
            print("    kept: %s" % res["tmp"], flush=True)
        elif not args.keep:
            shutil.rmtree(res["tmp"], ignore_errors=True)
        results.append(res)
    # The summary.
    all_lat = [ms for r in results for ms in r["latencies_ms"].values()]
    kinds = {}
    for r in results:
        p = r["plan"]
        k = "%s %s" % (p["signal"], "server" if p["victim"] in SERVERS else "worker")
        kinds[k] = kinds.get(k, 0) + 1
    bad = [r["seed"] for r in results if r["failures"]]
    print("\n%d seeds in %.0f s; faults: %s" % (len(results), time.monotonic() - t0,
                                               ", ".join("%s %d" % kv for kv in sorted(kinds.items()))))
    print("hangs: %d; lost acknowledged updates: %d; restarts checked: %d" % (
        sum(r["hang"] for r in results), sum(r["lost_updates"] for r in results),
        sum("restart" in r for r in results)))
    for sig in ("SIGKILL", "SIGSTOP"):
        xs = [ms for r in results if r["plan"]["signal"] == sig for ms in r["latencies_ms"].values()]
        if xs:
            print("%s: survivor errors %d, fault to error: median %.0f ms, p99 %.0f ms, max %.0f ms"
                  % (sig, len(xs), percentile(xs, 0.5), percentile(xs, 0.99), max(xs)))
    over = [(r["seed"], r["over_2s"]) for r in results if r.get("over_2s")]
    print("survivor errors over 2 s: %d of %d%s" % (
        sum(len(x[1]) for x in over), len(all_lat), (" (seed, ranks): %s" % over) if over else ""))
    print("failed seeds: %s" % (bad or "none"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
