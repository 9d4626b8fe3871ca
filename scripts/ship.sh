#!/usr/bin/env bash
# Packs what a CUDA build made here for one GPU call, so that the GPU
# machine runs it without building: the GPU and CPU test programs, the
# benchmark programs and the Python extension, stripped and xz-compressed
# (about 35 MB; a device call carries at most 64 MB with the tree).
#   scripts/ship.sh [BUILD [DIR]]   # BUILD: default build; DIR: default .xfer/head
# DIR mirrors BUILD's layout (tests/cuda/..., tools/..., python/...), so
# `BUILD_DIR=DIR scripts/gpu_check.sh` there finds it (it unpacks the .xz
# files first). DIR/commit.txt names the tree: the commit, and "+ changes"
# when the working tree differs from it. Keep DIR out of git
# (`echo /.xfer/ >> .git/info/exclude`) and name it in the call's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
dir=${2:-.xfer/head}
[ -x "$build/tests/cuda/sparsepage_cuda_tests" ] || { echo "ship: $build holds no CUDA build (tests/cuda/sparsepage_cuda_tests)"; exit 1; }
rm -rf "$dir"
mkdir -p "$dir/tests/cuda" "$dir/tools" "$dir/python"
pack() {  # a path under BUILD -> the same path under DIR, stripped and compressed
  strip -o "$dir/$1" "$build/$1"
  xz -T0 -3 -f "$dir/$1"
}
pack tests/cuda/sparsepage_cuda_tests
if [ -x "$build/tests/sparsepage_cpu_tests" ]; then pack tests/sparsepage_cpu_tests; fi
for tool in "$build"/tools/*; do
  if [ -f "$tool" ] && [ -x "$tool" ]; then pack "tools/$(basename "$tool")"; fi
done
# The newest extension only: one built for another Python earlier is stale.
so=$(find "$build/python" -maxdepth 1 -name '_core*.so' -printf '%T@ %f\n' 2>/dev/null | sort -rn | head -1 | cut -d' ' -f2)
if [ -n "$so" ]; then pack "python/$so"; fi
{ git rev-parse HEAD; git diff --quiet HEAD -- . ':!.xfer' || echo "+ changes"; } > "$dir/commit.txt"
echo "ship: $(du -sh "$dir" | cut -f1) in $dir ($(tr '\n' ' ' < "$dir/commit.txt"))"
