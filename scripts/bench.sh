#!/usr/bin/env bash
# The main job: builds, then runs sparse_paged_decode_bench — the mask arm
# against the fused sparse arm over the same selection, at the block-sparse
# geometry — on the GPU when one is present, otherwise on the CPU backend
# (the program says which). Arguments go to the benchmark (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh >/dev/null
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target sparse_paged_decode_bench >/dev/null
exec "$build/tools/sparse_paged_decode_bench" "$@"
