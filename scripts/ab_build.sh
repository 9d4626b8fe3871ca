#!/usr/bin/env bash
# Builds the benchmark programs of another commit (the A/B's base) beside the
# working tree's, so that one GPU call can run both on the same card,
# alternated (scripts/gpu_check.sh, stage "ab"). Builds here, on the
# development machine with nvcc, for sm_90a; the GPU machine then only runs
# them (carry the output folder with the call).
#   scripts/ab_build.sh BASE [OUT]   # BASE: a commit; OUT: default build-ab
# OUT/tools holds the base's sparse_step_bench, sparse_paged_decode_bench,
# sparse_prefill_bench and mla_sparse_bench (those the base has), stripped;
# OUT/base.txt names the commit. The base is checked out in a worktree under
# OUT/src and built in OUT/build (both reused by a later run for the same
# commit). AB_CUDA=OFF builds the CPU backend only (a dry run of the script
# on a machine without nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: scripts/ab_build.sh BASE [OUT]}
out=${2:-build-ab}
commit=$(git rev-parse --verify "$base^{commit}")
mkdir -p "$out/tools"
if [ ! -d "$out/src" ] || [ "$(git -C "$out/src" rev-parse HEAD 2>/dev/null)" != "$commit" ]; then
  rm -rf "$out/src" "$out/build"
  git worktree prune
  git worktree add --detach "$out/src" "$commit" >/dev/null
fi
cmake -S "$out/src" -B "$out/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSEPAGE_CUDA="${AB_CUDA:-ON}" \
  -DSPARSEPAGE_BUILD_TESTS=OFF > "$out/configure.log"
built=()
for tool in sparse_step_bench sparse_paged_decode_bench sparse_prefill_bench mla_sparse_bench; do
  if cmake --build "$out/build" -j "${JOBS:-$(nproc)}" --target "$tool" >> "$out/build.log" 2>&1; then
    strip -o "$out/tools/$tool" "$out/build/tools/$tool"
    built+=("$tool")
  else
    echo "ab_build: $tool does not build at $commit (see $out/build.log); left out"
  fi
done
echo "$commit" > "$out/base.txt"
echo "ab_build: $commit -> $out/tools: ${built[*]}"
