#!/usr/bin/env bash
# The main job, on the GPU when one is present, otherwise on the CPU backend
# (each program says which):
#   1. sparse_step_bench: whole decode steps of the block-sparse, DSA and
#      static block-sparse layers (append + indexer or page matrix +
#      attention), the context growing one token
#      per step, eager and replayed from a CUDA graph, beside the mask-path
#      step and the read-time floor; JSON and plots (build/bench/);
#   2. on a GPU, the steps engines run: the DSA layer over engine-owned FP8
#      pools (656-byte MLA rows, vLLM's FP8 index-key blocks) behind
#      shuffled block tables, uniform and ragged batches, and the
#      block-sparse layer over engine pools with FP8 index keys;
#   3. sparse_paged_decode_bench: the attention kernel alone, the mask arm
#      against the fused sparse arm over the same selection;
#   4. prefill: sparse_prefill_bench (prompts prefilled in chunks per layer
#      kind, checked before timing), then python/benchmarks/prefill_vs_dense.py
#      (dense causal attention of the same prompts; skips without torch),
#      and plots of both (build/bench/prefill_<kind>.png).
# STEP_ARGS, POOLS_ARGS, KERNEL_ARGS and PREFILL_ARGS pass options to each
# (see their --help); BENCH_PREFILL=0 leaves stage 4 out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh >/dev/null
build=${BUILD_DIR:-build}
out=$build/bench
mkdir -p "$out"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target sparse_step_bench sparse_paged_decode_bench sparse_prefill_bench >/dev/null
echo "== whole decode steps (sparse_step_bench)"
"$build/tools/sparse_step_bench" --json "$out/steps.json" ${STEP_ARGS:-}
if bash scripts/install-python-deps.sh --plots >/dev/null 2>&1; then
  .venv/bin/python scripts/plot_steps.py "$out/steps.json" "$out" || echo "plots: skipped (see the message above)"
else
  echo "plots: skipped (could not install matplotlib into .venv)"
fi
echo "== the steps over engine-owned FP8 pools (sparse_step_bench --pools fp8; GPU only)"
# Exit status 77: the stage does not apply here (no GPU), which is a skip, not a failure.
pools_stage() {
  local name=$1 rc=0
  shift
  "$build/tools/sparse_step_bench" "$@" ${POOLS_ARGS:-} || rc=$?
  if [ "$rc" -eq 77 ]; then echo "$name pools stage: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then echo "$name pools stage: failed (exit $rc)"; fi
}
pools_stage DSA --layers dsa --pools fp8 --ragged --batches 1 8 32 --contexts 32768 131072 --json "$out/pools_dsa.json"
pools_stage block-sparse --layers blocksparse --pools fp8 --batches 1 8 32 --contexts 32768 131072 \
  --json "$out/pools_blocksparse.json"
echo "== the attention kernel alone (sparse_paged_decode_bench)"
"$build/tools/sparse_paged_decode_bench" --json "$out/kernel.json" ${KERNEL_ARGS:-}
if [[ ${BENCH_PREFILL:-1} != 0 ]]; then
  echo "== prefill in chunks (sparse_prefill_bench), then dense attention of the same prompts"
  "$build/tools/sparse_prefill_bench" --json "$out/prefill.json" ${PREFILL_ARGS:-}
  python3 python/benchmarks/prefill_vs_dense.py --json "$out/prefill_dense.json" || echo "prefill_vs_dense: failed"
  dense=(); [ -s "$out/prefill_dense.json" ] && dense=(--dense "$out/prefill_dense.json")
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import matplotlib" 2>/dev/null; then
    .venv/bin/python scripts/plot_prefill.py "$out/prefill.json" "$out" "${dense[@]}" || echo "prefill plots: failed"
  fi
fi
