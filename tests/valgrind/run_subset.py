#!/usr/bin/env python3
"""valgrind memcheck over a quick subset of the suite (docs/testing.md).

    run_subset.py VALGRIND SUPPRESSIONS BINARY=FILTER [BINARY=FILTER ...]

Runs each criterion test BINARY with --filter=FILTER ("suite/test", globs allowed) under valgrind,
following every process the test forks (the ranks of a multi-rank test, criterion's workers), and
fails if valgrind reported anything in any of them or a test failed (criterion reports a test's
result before its process exits, so valgrind's exit code alone is not enough: each process writes
its own log, and any non-empty log is a failure). SUPPRESSIONS is a valgrind suppression file for
third-party code. Prints how long each part took.
"""
import glob
import os
import subprocess
import sys
import tempfile
import time


def main():
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    valgrind, supp, parts = sys.argv[1], sys.argv[2], sys.argv[3:]
    failed = False
    t_all = time.monotonic()
    for part in parts:
        binary, _, pattern = part.partition('=')
        name = f'{os.path.basename(binary)} --filter={pattern}'
        with tempfile.TemporaryDirectory(prefix='weft-valgrind-') as d:
            cmd = [valgrind, '-q', '--trace-children=yes', '--track-origins=yes',
                   '--leak-check=no', f'--suppressions={supp}', '--error-exitcode=99',
                   f'--log-file={d}/vg.%p', binary, '--jobs=1', f'--filter={pattern}']
            t0 = time.monotonic()
            r = subprocess.run(cmd, capture_output=True, text=True)
            took = time.monotonic() - t0
            reports = []
            for path in sorted(glob.glob(os.path.join(d, 'vg.*'))):
                with open(path) as f:
                    text = f.read().strip()
                if text:
                    reports.append(text)
        # "Tested: 0" would mean the filter matched nothing: a subset that silently shrank.
        synthesis = [line for line in r.stderr.splitlines() if 'Synthesis' in line]
        ran = bool(synthesis) and 'Tested: 0 ' not in synthesis[-1]
        ok = r.returncode == 0 and not reports and ran
        print(f'{"ok  " if ok else "FAIL"} {took:5.1f} s  {name}'
              f'{"" if ran else ": no test matched the filter"}', flush=True)
        if not ok:
            failed = True
            print(r.stdout + r.stderr)
            for text in reports:
                print(text)
            if reports:
                print(f'valgrind reported problems in {len(reports)} process(es)')
    print(f'{"FAIL" if failed else "ok"}: {len(parts)} parts in {time.monotonic() - t_all:.1f} s')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
