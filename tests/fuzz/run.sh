#!/usr/bin/env bash
# Builds the libFuzzer harnesses (build-fuzz: clang, ASan + UBSan, docs/fuzzing.md) and runs each
# over a copy of its seed corpus (tests/fuzz/corpus/<harness>) and its regression inputs
# (tests/fuzz/regress/<harness>, replayed first). Fails on any crash, leak, undefined behaviour,
# hang or broken harness check; the input that did it is kept and named.
#
#   tests/fuzz/run.sh                    the fixed iterations scripts/test.sh runs
#   tests/fuzz/run.sh --time S [h ...]   S seconds per harness (a long run); new inputs go to
#                                        $WEFT_FUZZ_OUT/<harness> (default: a temporary directory)
# Harnesses: frames hello seal join stream direct rref collectives ps dist_autograd.
set -euo pipefail
cd "$(dirname "$0")/../.."

all=(frames hello seal join stream direct rref collectives ps dist_autograd)
# Iterations per harness in the test suite: the pure decoders run thousands a second, the live
# ones (a world of in-process agents behind each input) hundreds.
declare -A runs=([frames]=300000 [hello]=500000 [seal]=20000 [join]=5000 [stream]=2000 [direct]=3000
                 [rref]=20000 [collectives]=20000 [ps]=20000 [dist_autograd]=20000)
declare -A pure=([frames]=1 [hello]=1 [seal]=1)

time_s=0
if [ "${1:-}" = "--time" ]; then
  time_s="$2"
  shift 2
fi
harnesses=("$@")
if [ ${#harnesses[@]} -eq 0 ]; then
  harnesses=("${all[@]}")
fi

dir=build-fuzz
if [ ! -f "$dir/build.ninja" ]; then
  CC=clang meson setup "$dir" --werror -Dfuzz=true -Dtests=true -Dbench=false -Dexamples=false \
    -Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fsanitize=fuzzer-no-link >/dev/null
fi
ninja -C "$dir" "${harnesses[@]/#/tests/fuzz/fuzz_}" >/dev/null

tmp=$(mktemp -d /tmp/weft-fuzz.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
out="${WEFT_FUZZ_OUT:-$tmp/out}"
status=0
for h in "${harnesses[@]}"; do
  corpus="$out/$h"
  mkdir -p "$corpus"
  cp tests/fuzz/corpus/"$h"/* "$corpus"/
  dirs=("$corpus")
  if [ -d tests/fuzz/regress/"$h" ]; then
    dirs+=(tests/fuzz/regress/"$h")
  fi
  opts=(-seed=1 -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$tmp/$h-")
  if [ "$time_s" -gt 0 ]; then
    opts+=(-max_total_time="$time_s")
  else
    opts+=(-runs="${runs[$h]}")
  fi
  if [ -z "${pure[$h]:-}" ]; then
    # A live harness's agents allocate on their own threads while an input runs: libFuzzer's
    # per-input leak check would flag every input. LeakSanitizer still checks at exit.
    opts+=(-detect_leaks=0)
  fi
  start=$(date +%s%N)
  rc=0
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  LSAN_OPTIONS=suppressions="$PWD/tests/lsan.supp" \
    timeout $((time_s > 0 ? time_s + 120 : 300)) "$dir/tests/fuzz/fuzz_$h" "${opts[@]}" "${dirs[@]}" \
    >"$tmp/$h.log" 2>&1 || rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  done_runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$tmp/$h.log" | tail -1)
  if [ "$rc" -ne 0 ]; then
    status=1
    echo "fuzz/$h: FAILED (exit $rc) after ${done_runs:-?} runs; the log's end:"
    tail -n 80 "$tmp/$h.log"
    for f in "$tmp/$h"-*; do
      if [ -f "$f" ]; then
        mkdir -p "${WEFT_FUZZ_FINDINGS:-/tmp}"
        cp "$f" "${WEFT_FUZZ_FINDINGS:-/tmp}/"
        echo "fuzz/$h: the input is ${WEFT_FUZZ_FINDINGS:-/tmp}/$(basename "$f")"
      fi
    done
  else
    printf 'fuzz/%s: %s runs, %d.%01d s, no finding\n' "$h" "${done_runs:-?}" $((ms / 1000)) \
      $((ms % 1000 / 100))
  fi
done
exit $status
