#!/usr/bin/env bash
# The main job: a real training run on Fashion-MNIST, all ranks as local
# processes. Installs what is missing and builds first.
#   bash scripts/main.sh [-n RANKS] [training options...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
weft_install_missing "${WEFT_PACKAGES[@]}"
weft_build build

ranks=2
if [ "${1:-}" = "-n" ]; then
  ranks="$2"
  shift 2
fi
exec build/tools/weftrun -n "$ranks" build/examples/dp_train "$@"
