"""Helpers shared by the benchmark runners (run_rpc.py, run_rref.py, run_ps.py, run_collectives.py,
run_train.py, run_cnn.py, run_ddp.py): their common options, finding a python with torch, running a program, the raw
measurement lines and the result lines. Python 3 standard library only."""
import argparse
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time


# ------------------------------------------------------------------ options


def runner_args(doc, quick_help, out_help, skip_torch_help):
    """The command line of a runner that measures weft against its peers in rounds (run_rpc.py,
    run_rref.py, run_ps.py), parsed; --repeat defaults to 2 rounds, 1 with --quick."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builddir", default="build", help="meson build directory (default: build)")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", help=out_help)
    p.add_argument("--raw", help="also write every raw measurement line to this file")
    p.add_argument("--skip-torch", action="store_true", help=skip_torch_help)
    p.add_argument("--repeat", type=int, default=None,
                   help="rounds of all measurements; medians are reported (default 2, --quick 1)")
    p.add_argument("--torch-python", help="python interpreter with torch (default: this one, else /usr/bin/python3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one measurement may take")
    p.add_argument("--verbose", action="store_true", help="pass the programs' stderr through")
    p.add_argument("--plot", metavar="DIR", help="draw the sweeps into PNG files in DIR (python3-matplotlib)")
    a = p.parse_args()
    if a.repeat is None:
        a.repeat = 1 if a.quick else 2
    return a


def train_bench_args(doc, quick_help, repeat, repeat_help=None):
    """The start of a training runner's command line (run_cnn.py, run_ddp.py): --builddir, --quick
    and --repeat (default repeat). The caller adds its own options, then train_bench_tail."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builddir", default="build")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--repeat", type=int, default=repeat, help=repeat_help)
    return p


def train_bench_tail(p, out_help):
    """The options every training runner's command line ends with: --out, --skip-torch,
    --torch-python, --timeout and --data; returns the parsed arguments (the caller applies
    --quick)."""
    p.add_argument("--out", help=out_help)
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--torch-python")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--data", default=os.environ.get("WEFT_DATA_DIR") or "/usr/share/datasets/fashion-mnist")
    return p.parse_args()


# ------------------------------------------------------------------ torch


def has_torch(python):
    try:
        r = subprocess.run([python, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('torch') is None)"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_torch_python(a):
    cands = [a.torch_python] if a.torch_python else [sys.executable, "/usr/bin/python3"]
    for py in cands:
        if py == sys.executable:
            ok = importlib.util.find_spec("torch") is not None
        else:
            ok = os.path.exists(py) and has_torch(py)
        if ok:
            return py
    return None


def torch_python_for(a, prog, skipped):
    """The python that runs the torch peers: None with --skip-torch, or when none has torch (then
    "PROG: no python with torch found; SKIPPED skipped" goes to stderr)."""
    if a.skip_torch:
        return None
    python = find_torch_python(a)
    if python is None:
        print("%s: no python with torch found; %s skipped" % (prog, skipped), file=sys.stderr)
    return python


# ------------------------------------------------------------------ running


def run_proc(cmd, timeout, verbose=False, env=None):
    """Runs one program in its own process group (all of it killed at the timeout); returns
    (stdout, stderr or None when passed through with verbose, error text or None, wall seconds).
    Raises OSError when the program cannot start."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if verbose else subprocess.PIPE,
                         text=True, start_new_session=True, env=env)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return out, err, "timed out after %.0f s" % timeout, time.monotonic() - t0
    wall = time.monotonic() - t0
    if p.returncode != 0:
        tail = (err or "").strip().splitlines()[-5:]
        return out, err, "exit %d after %.1f s: %s" % (p.returncode, wall, " | ".join(tail)), wall
    return out, err, None, wall


def run_one(cmd, timeout, verbose):
    """Runs one program in its own process group; returns (json lines, error text or None)."""
    out, _, err, _ = run_proc(cmd, timeout, verbose)
    return parse_lines(out), err


RANK_PREFIX = re.compile(r"^\[rank (\d+)\] ")


def rank0_results(out):
    """The JSON result lines (objects with a "system") of a program run under weftrun: weftrun's
    "[rank R] " prefix stripped, only rank 0's prefixed lines kept."""
    lines = []
    for ln in (out or "").splitlines():
        m = RANK_PREFIX.match(ln)
        if m:
            if m.group(1) != "0":
                continue
            ln = ln[m.end():]
        ln = ln.strip()
        if ln.startswith("{"):
            try:
                d = json.loads(ln)
            except ValueError:
                continue
            if isinstance(d, dict) and "system" in d:
                lines.append(d)
    return lines


def parse_lines(out):
    lines = []
    for ln in (out or "").splitlines():
        ln = ln.strip()
        if ln.startswith("{"):
            try:
                lines.append(json.loads(ln))
            except ValueError:
                pass
    return lines


def as_is(ln):
    """A program's raw line as (metric, system, value, unit) for the results."""
    return [(ln["metric"], ln["system"], ln["value"], ln.get("unit", ""))]


def run_rounds(prog, a, groups, collect):
    """Runs the measurements a.repeat times. Each group is a list of (system, argv, label, mapper),
    measured back to back, the order rotating between rounds so that drift of a shared machine
    hits every system alike. Every JSON line a program prints goes to stderr (and --raw's file)
    with its round, and unless it says "skipped", mapper(line) gives the (metric, system, value,
    unit) that go to collect. A program that is not executable, or that fails, counts as a failed
    run ("PROG: SYSTEM LABEL failed: why" on stderr for the latter). Returns the failed runs."""
    raw_f = open(a.raw, "w") if a.raw else None
    failures = 0
    for rnd in range(a.repeat):
        for g in groups:
            k = rnd % len(g)
            for system, argv, label, mapper in g[k:] + g[:k]:
                if not os.access(argv[0], os.X_OK):
                    failures += 1
                    continue
                lines, err = run_one(argv, a.timeout, a.verbose)
                if err:
                    failures += 1
                    print("%s: %s %s failed: %s" % (prog, system, label, err), file=sys.stderr)
                for ln in lines:
                    record_raw(ln, rnd, raw_f)
                    if ln.get("skipped"):
                        continue
                    for metric, sysname, value, unit in mapper(ln):
                        collect(metric, sysname, value, unit)
    if raw_f:
        raw_f.close()
    return failures


def train_rounds(prog, rows, repeat, timeout, env=None, label=str, tag=None):
    """Runs the training programs repeat times. rows is a list of (key, [(system, argv)]): each
    row's systems run back to back, the order rotating between rounds. Each run's first rank-0
    result line gets tag(key) (if tag), then "as", "round" and "wall_s", goes to stderr and is
    kept; a run that fails or prints none counts as a failure ("PROG: label(key) SYSTEM: why" on
    stderr). Returns ({(key, system): [result dicts]}, failures)."""
    got = {}
    failures = 0
    for rnd in range(repeat):
        for key, systems in rows:
            k = rnd % len(systems)
            for system, argv in systems[k:] + systems[:k]:
                out, _, err, wall = run_proc(argv, timeout, env=env)
                res = rank0_results(out)
                if err is not None or not res:
                    failures += 1
                    print("%s: %s %s: %s" % (prog, label(key), system, err or "no result line"), file=sys.stderr)
                    continue
                d = res[0]
                if tag:
                    d.update(tag(key))
                d.update({"as": system, "round": rnd, "wall_s": round(wall, 2)})
                print(jline(d), file=sys.stderr, flush=True)
                got.setdefault((key, system), []).append(d)
    return got, failures


def median_of(got, key, system, metric):
    """The median of metric over the results train_rounds got for (key, system); None if none."""
    xs = [d[metric] for d in got.get((key, system), []) if d.get(metric) is not None]
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------ results


def jline(d):
    """One JSON line, compact."""
    return json.dumps(d, separators=(",", ":"))


def record_raw(ln, rnd, raw_f):
    """A program's raw line, with its round, to stderr and to --raw's file."""
    ln["round"] = rnd
    text = jline(ln)
    print(text, file=sys.stderr)
    if raw_f:
        raw_f.write(text + "\n")
        raw_f.flush()


class Values:
    """The measurements of a run: metric -> system -> [values], their units, the metrics in the
    order first seen."""

    def __init__(self):
        self.values = {}
        self.units = {}
        self.order = []

    def add(self, metric, system, value, unit):
        if metric not in self.values:
            self.values[metric] = {}
            self.order.append(metric)
        self.values[metric].setdefault(system, []).append(value)
        self.units[metric] = unit

    def medians(self, metric):
        return {s: statistics.median(v) for s, v in self.values[metric].items() if v}

    def runs(self, metric, system="weft"):
        return len(self.values[metric].get(system, []))


def versus(med, peers, lower_better):
    """weft's median against each of peers': ({peer: ratio, > 1 when weft is better, None where
    either is missing or 0}, {peer: its median})."""
    w = med.get("weft")
    vs, got = {}, {}
    for s in peers:
        p = med.get(s)
        got[s] = fmt(p)
        vs[s] = None if w is None or p is None or w == 0 or p == 0 else round(p / w if lower_better else w / p, 3)
    return vs, got


def emit_results(results, path, mode):
    """Prints each result line on stdout (flushed), and writes them to path (mode "a" or "w")."""
    out_f = open(path, mode) if path else None
    for res in results:
        text = jline(res)
        print(text, flush=True)
        if out_f:
            out_f.write(text + "\n")
    if out_f:
        out_f.close()


def say_done(prog, rounds, t_start, failures, word="rounds"):
    print("%s: %d %s in %.0f s%s" % (prog, rounds, word, time.monotonic() - t_start,
                                     ", %d failed runs" % failures if failures else ""), file=sys.stderr)


def fmt(v):
    return None if v is None else float("%.4g" % v)


def size_label(size):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= (1 << shift) and size % (1 << shift) == 0:
            return "%d%s" % (size >> shift, unit)
    return "%dB" % size
