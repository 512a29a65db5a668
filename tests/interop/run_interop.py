#!/usr/bin/env python3
"""Runs tests/interop's world of three: interop_rank (C) as ranks 0 and 2, py_rank.py (the Python
peer) as rank 1, each placed by the WEFT_* variables as weftrun would. Exit 0 when all three
passed, 77 (skip) when this machine lacks the Python side's packages, 1 otherwise.

    run_interop.py C_PROGRAM PROTO_DIR OUT_DIR
"""
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

DEADLINE_S = 120
NEEDED = ("grpc", "google.protobuf", "cryptography")


def python_with_packages():
    """This interpreter, or the system's (a pyenv python may hide Debian's packages), that imports
    every NEEDED module; (None, what is missing) when none does."""
    missing = []
    for exe in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        if not os.path.exists(exe):
            continue
        code = "import importlib, sys\nfor m in sys.argv[1:]:\n    try: importlib.import_module(m)\n" \
               "    except ImportError: print(m)"
        out = subprocess.run([exe, "-c", code, *NEEDED], capture_output=True, text=True, timeout=60)
        lacks = out.stdout.split()
        if not lacks and out.returncode == 0:
            return exe, None
        missing.append("%s cannot import %s" % (exe, ", ".join(lacks) or "its modules"))
    return None, "; ".join(missing) or "no python3"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    c_program, proto_dir, out_dir = sys.argv[1:4]
    python, missing = python_with_packages()
    protoc = shutil.which("protoc")
    if python is None or protoc is None:
        print("SKIP: the Python peer needs python3-grpcio, python3-protobuf, python3-cryptography "
              "and protobuf-compiler (%s)" % (missing or "protoc is not on PATH"))
        return 77
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([protoc, "-I", proto_dir, "--python_out=" + out_dir,
                    os.path.join(proto_dir, "wire.proto")], check=True, timeout=60)

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, WEFT_WORLD_SIZE="3", WEFT_MASTER_ADDR="127.0.0.1",
               WEFT_MASTER_PORT=str(free_port()), WEFT_AUTH_TOKEN=secrets.token_hex(16),
               PYTHONPATH=os.pathsep.join([out_dir, here]), PYTHONUNBUFFERED="1")
    cmds = {0: [c_program], 1: [python, os.path.join(here, "py_rank.py")], 2: [c_program]}
    procs = {}
    try:
        for rank, cmd in cmds.items():
            procs[rank] = subprocess.Popen(cmd, env=dict(env, WEFT_RANK=str(rank), RANK=str(rank)),
                                           stdin=subprocess.DEVNULL)
        end = time.monotonic() + DEADLINE_S
        codes = {}
        while len(codes) < len(procs) and time.monotonic() < end:
            for rank, p in procs.items():
                if rank not in codes and p.poll() is not None:
                    codes[rank] = p.returncode
                    if p.returncode != 0:
                        end = min(end, time.monotonic() + 10)   # the others fail soon after
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
    for rank in cmds:
        print("rank %d: %s" % (rank, "exit %d" % codes[rank] if rank in codes
                                   else "killed after the deadline"))
    return 0 if all(codes.get(r) == 0 for r in cmds) else 1


if __name__ == "__main__":
    sys.exit(main())
