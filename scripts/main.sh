#!/usr/bin/env bash
# The main job: a click-through-rate model trained hybrid-parallel (examples/hybrid_train): its
# 26 embedding tables on 2 parameter-server ranks, its MLP replicated on the other ranks under
# the DDP reducer; all ranks as local processes. Installs what is missing and builds first.
#   bash scripts/main.sh [-n RANKS] [training options...]
# -n (default 4) is weftrun's rank count, 2 of them servers; the rest goes to hybrid_train
# (--help lists its options). dp_train, the data-parallel MLP on Fashion-MNIST, stays an example.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
weft_install_missing "${WEFT_PACKAGES[@]}"
weft_build build

ranks=4
if [ "${1:-}" = "-n" ]; then
  ranks="$2"
  shift 2
fi
exec build/tools/weftrun -n "$ranks" --servers 2 build/examples/hybrid_train "$@"
