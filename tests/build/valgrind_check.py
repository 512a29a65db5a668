#!/usr/bin/env python3
"""Runs a criterion test binary under valgrind, following the processes criterion forks for each
test, and fails if valgrind reported anything in any of them (criterion reports a test's result
before its process exits, so valgrind's exit code alone is not enough)."""
import glob
import os
import subprocess
import sys
import tempfile

valgrind, binary = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as d:
    cmd = [valgrind, '-q', '--trace-children=yes', '--track-origins=yes', '--leak-check=no',
           f'--log-file={d}/vg.%p', binary, '--jobs=1']
    rc = subprocess.run(cmd).returncode
    reports = []
    for path in sorted(glob.glob(os.path.join(d, 'vg.*'))):
        text = open(path).read().strip()
        if text:
            reports.append(text)
    for r in reports:
        print(r)
    if reports:
        print(f'valgrind reported problems in {len(reports)} process(es)')
        sys.exit(1)
    sys.exit(rc)
