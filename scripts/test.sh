#!/usr/bin/env bash
# The whole test suite, plain and under AddressSanitizer + UBSan, with
# warnings as errors. Installs what is missing and builds first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
weft_install_missing "${WEFT_PACKAGES[@]}"

summary() {
  python3 - "$@" <<'PY'
import json, sys
ok = bad = 0
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        if r.get("result") in ("OK", "EXPECTEDFAIL", "SKIP"):
            ok += 1
        else:
            bad += 1
            print("failed:", r.get("name"), "in", path, file=sys.stderr)
print(f"{ok} passed, {bad} failed")
sys.exit(1 if bad else 0)
PY
}

status=0
echo "== plain build =="
weft_build build
meson test -C build --no-rebuild --print-errorlogs || status=1

echo "== AddressSanitizer + UBSan build =="
weft_build build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dbench=false
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
LSAN_OPTIONS=suppressions="$PWD/tests/lsan.supp" \
  meson test -C build-asan --no-rebuild --print-errorlogs --timeout-multiplier 3 || status=1

echo "== libFuzzer harnesses (clang, ASan + UBSan; docs/fuzzing.md) =="
tests/fuzz/run.sh || status=1

summary build/meson-logs/testlog.json build-asan/meson-logs/testlog.json || status=1
exit $status
