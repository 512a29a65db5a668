"""Helpers shared by the benchmark runners (run_rpc.py, run_collectives.py)."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time


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


def run_one(cmd, timeout, verbose):
    """Runs one program in its own process group; returns (json lines, error text or None)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if verbose else subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err = "timed out after %.0f s" % timeout
        return parse_lines(out), err
    lines = parse_lines(out)
    if p.returncode != 0:
        tail = (err or "").strip().splitlines()[-5:]
        return lines, "exit %d after %.1f s: %s" % (p.returncode, time.monotonic() - t0, " | ".join(tail))
    return lines, None


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


def fmt(v):
    return None if v is None else float("%.4g" % v)
