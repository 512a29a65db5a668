#!/usr/bin/env python3
"""The shared library exports exactly weft's public API: every symbol `nm -D --defined-only`
lists is a weft_* function or object declared WEFT_API in include/weft/, and every such
declaration is exported (a definition that does not see its declaration would be hidden)."""
import pathlib
import re
import subprocess
import sys

lib, include = sys.argv[1], pathlib.Path(sys.argv[2])
# Headers of features this build lacks (cuda.h without the cuda feature) declare nothing here.
skip = set(sys.argv[3:])
decl = re.compile(r'^WEFT_API\s[^(;]*?\b(weft_[a-z0-9_]+)\s*\(', re.M)
declared = set()
for h in include.glob('*.h'):
    if h.name not in skip:
        declared.update(decl.findall(h.read_text()))
out = subprocess.run(['nm', '-D', '--defined-only', lib], check=True, capture_output=True,
                     text=True).stdout
exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
exported = {s for s in exported if not s.startswith('_')}  # _init, _fini, linker symbols
leaked = sorted(exported - declared)
missing = sorted(declared - exported)
for s in leaked:
    print(f'exported but not declared WEFT_API in include/weft: {s}')
for s in missing:
    print(f'declared WEFT_API but not exported (does its definition see the declaration?): {s}')
print(f'{len(exported)} symbols exported, {len(declared)} declared')
sys.exit(1 if leaked or missing else 0)
