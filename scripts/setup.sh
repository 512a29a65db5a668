#!/usr/bin/env bash
# Installs what weft needs (Debian 12 packages) when it is missing, then
# configures and builds. Sourced by main.sh and test.sh; also runnable alone:
#   bash scripts/setup.sh [builddir [meson options...]]
set -euo pipefail

WEFT_PACKAGES=(
  gcc g++ pkg-config meson ninja-build python3
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler libssl-dev zlib1g-dev
  libcriterion-dev libopenblas-dev
  clang libclang-rt-14-dev valgrind iproute2
  python3-grpcio python3-protobuf python3-cryptography protobuf-compiler
  python3-matplotlib
  dataset-fashion-mnist
)

weft_install_missing() {
  local missing=()
  for p in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  echo "weft: installing ${missing[*]}" >&2
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# weft_build DIR [meson options...]: configure once, then build.
weft_build() {
  local dir="$1"
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" --werror "$@" >/dev/null
  fi
  ninja -C "$dir" >/dev/null
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  cd "$(dirname "$0")/.."
  weft_install_missing "${WEFT_PACKAGES[@]}"
  weft_build "${1:-build}" "${@:2}"
fi
