#!/usr/bin/env bash
# Interleaves an old and a new build on the network path (no shared memory, no cross-memory
# reads: what ranks on different hosts use), so that the new one is shown to lose nothing there.
#   bash bench/before_after.sh OLD_BUILDDIR NEW_BUILDDIR [ROUNDS]
# Prints one line per measurement and round: "<metric> old <v> new <v>".
set -euo pipefail
old="$1" new="$2" rounds="${3:-3}"
net=(env WEFT_SHM=0 WEFT_COLL_CMA=0)
val() { grep -o '"value":[0-9.e+-]*' | head -1 | cut -d: -f2; }
coll() { grep -o '"time_us":[0-9.]*' | head -1 | cut -d: -f2; }
for r in $(seq "$rounds"); do
  for m in "pingpong 64 3000" "async 5000 64 64" "stream 16M 32 4"; do
    o=$("${net[@]}" "$old/bench/bench_rpc" $m 2>/dev/null | val)
    n=$("${net[@]}" "$new/bench/bench_rpc" $m 2>/dev/null | val)
    echo "rpc ${m// /_} old $o new $n"
  done
  for w in 2 4; do
    for p in "all_reduce 4K" "all_reduce 1M" "broadcast 1M" "all_gather 1M"; do
      set -- $p
      o=$("${net[@]}" "$old/bench/bench_collectives" "$w" --ops "$1" --sizes "$2" 2>/dev/null | coll)
      n=$("${net[@]}" "$new/bench/bench_collectives" "$w" --ops "$1" --sizes "$2" --system weft 2>/dev/null | coll)
      echo "coll_us w$w $1_$2 old $o new $n"
    done
  done
done
