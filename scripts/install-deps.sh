#!/usr/bin/env bash
# Installs what building and testing sparsepage needs, from Debian's packages.
# Idempotent: does nothing when everything is already there. The CUDA
# toolkit (nvcc) is optional; without it only the CPU backend is built.
#   --fuzz  also clang and its runtime libraries (libFuzzer, sanitizers) for
#           the fuzz target (SPARSEPAGE_FUZZ=ON; .ci/run uses it).
set -euo pipefail
packages=(cmake ninja-build g++ libgtest-dev googletest nlohmann-json3-dev libcli11-dev)
if [ "${1:-}" = "--fuzz" ]; then
  packages+=(clang libclang-rt-dev)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "install-deps: nvcc found; the CUDA backend will be built"
else
  echo "install-deps: no nvcc; building the CPU backend only"
fi
