#!/usr/bin/env bash
# Builds everything this machine can build (the CUDA sources too when nvcc is
# present) with warnings as errors, then runs the whole test suite. GPU tests
# skip, saying so, when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
build=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSEPAGE_WERROR=ON
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"
