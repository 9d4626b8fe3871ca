#!/usr/bin/env bash
# The main job: builds, then runs the sparse decode demo on the CPU backend.
# Arguments are passed to the program.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh >/dev/null
build=${BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target sparsepage_demo >/dev/null
exec "$build/tools/sparsepage_demo" "$@"
