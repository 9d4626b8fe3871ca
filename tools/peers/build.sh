#!/usr/bin/env bash
# Builds our two DSA peer drivers for an H200 / H100 (sm_90a) into $PEERS_DIR/peers-bench/bin/:
#   vllm_dsa_step_bench     vLLM's DeepSeek-V3.2 decode step (DeepGEMM paged indexer logits,
#                           vLLM top-k, slots, FlashMLA FP8 sparse decode) and its pieces
#   vllm_dsa_prefill_bench  DeepGEMM fp8_mqa_logits and FlashMLA sparse prefill (sparse_fwd)
# The drivers live in this repository (tools/peers/); the peers' sources are read from the
# prepared copy $PEERS_DIR/peers-bench/third_party (scripts/peers.sh prepare extracts them at the
# pinned commits) and never enter the repository; objects go to $PEERS_DIR/peers-bench/build/.
# Each driver .cu is compiled up to three times, one part per translation unit (see its header):
# the DeepGEMM part (DeepGEMM's CUTLASS, C++20, the flags of DeepGEMM's JIT), the vLLM top-k part
# (CUDA's CCCL, C++17) and the driver (FlashMLA's CUTLASS and flags, as fm_sparse_bench).
# Same style as peers-bench/build.sh: sm_90a gencode, static cudart, static libstdc++,
# glibc_compat.o, stripped. FlashMLA objects are shared with peers-bench/build.sh (same names,
# same flags), so after it this redoes nothing of FlashMLA.
# Usage: PEERS_DIR=... tools/peers/build.sh [-j N]   (default -j2; make redoes only what changed)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
JOBS=2
if [ "${1:-}" = "-j" ] && [ -n "${2:-}" ]; then JOBS=$2; fi
PB=${PEERS_DIR:-$repo/../peers}/peers-bench
[ -d "$PB" ] || { echo "tools/peers/build.sh: no $PB (run scripts/peers.sh prepare)" >&2; exit 1; }
PB=$(cd "$PB" && pwd)  # absolute: make runs inside it
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
TP=$PB/third_party
for d in DeepGEMM/deep_gemm/include cutlass_dg/include FlashMLA/csrc cutlass_fm/include vllm/csrc/libtorch_stable; do
  [ -d "$TP/$d" ] || { echo "tools/peers/build.sh: missing $TP/$d (run scripts/peers.sh prepare)" >&2; exit 1; }
done
for f in cooperative_topk.cuh topk_histogram_4096.cuh persistent_topk.cuh; do
  [ -f "$TP/vllm/csrc/libtorch_stable/$f" ] || { echo "tools/peers/build.sh: missing vllm file $f" >&2; exit 1; }
done
[ -f "$PB/src/peers_common.cuh" ] && [ -f "$PB/src/glibc_compat.cpp" ] || { echo "tools/peers/build.sh: no $PB/src" >&2; exit 1; }
mkdir -p "$PB/build" "$PB/bin"

ARCH="-gencode=arch=compute_90a,code=sm_90a"
COMMON="-O3 -DNDEBUG $ARCH --expt-relaxed-constexpr -use_fast_math -Xfatbin=-compress-all -diag-suppress 177"
# DeepGEMM: its JIT's flags (csrc/jit/compiler.hpp: C++20, the same diag suppressions, register
# usage level 10, -O3, relaxed constexpr, extended lambdas), its pinned CUTLASS. No fast math:
# the JIT does not pass it.
DG_FLAGS="-std=c++20 -O3 -DNDEBUG $ARCH --expt-relaxed-constexpr --expt-extended-lambda -Xfatbin=-compress-all \
 -diag-suppress=39,161,174,177,186,940 --ptxas-options=--register-usage-level=10 \
 -I$TP/DeepGEMM/deep_gemm/include -I$TP/cutlass_dg/include -DVLLM_DSA_PART_DEEPGEMM"
# vLLM top-k: C++17 as vLLM builds its CUDA extension, the toolkit's CCCL (cub, cuda/ptx).
TOPK_FLAGS="-std=c++17 -O3 -DNDEBUG $ARCH --expt-relaxed-constexpr -Xfatbin=-compress-all -diag-suppress 177 \
 -I$TP/vllm/csrc/libtorch_stable -DVLLM_DSA_PART_TOPK"
# FlashMLA: exactly peers-bench/build.sh's FM_FLAGS (objects are shared with it).
FM=$TP/FlashMLA/csrc
FM_FLAGS="-std=c++20 $COMMON -D_USE_MATH_DEFINES -Wno-deprecated-declarations \
 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__ \
 -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-extended-lambda --ptxas-options=--register-usage-level=10 \
 -I$FM -I$FM/kerutils/include -I$FM/sm90 -I$TP/cutlass_fm/include -I$TP/cutlass_fm/tools/util/include -I$PB/src"
LDFLAGS="$ARCH -cudart static -Xcompiler -static-libstdc++"

STEP_FM="smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu smxx/decode/combine/combine.cu \
 sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu"
PREFILL_FM="sm90/prefill/sparse/instantiations/phase1_k576.cu"
fm_obj() { echo "build/fm_$(echo "$1" | tr '/' '_' | sed 's/\.cu$/.o/')"; }

MK=$PB/build/Makefile.dsa
{
  echo "NVCC := $NVCC"
  echo "DG_FLAGS := $DG_FLAGS"
  echo "TOPK_FLAGS := $TOPK_FLAGS"
  echo "FM_FLAGS := $FM_FLAGS"
  echo "LDFLAGS := $LDFLAGS"
  echo ".PHONY: all"
  echo "all: bin/vllm_dsa_step_bench bin/vllm_dsa_prefill_bench"
  for u in $STEP_FM $PREFILL_FM; do
    echo "$(fm_obj "$u"): $FM/$u"
    echo "	\$(NVCC) \$(FM_FLAGS) -c \$< -o \$@"
  done
  echo "build/glibc_compat.o: src/glibc_compat.cpp"
  echo "	g++ -O2 -c \$< -o \$@"
  for d in step prefill; do
    src=$here/vllm_dsa_${d}_bench.cu
    echo "build/dsa_${d}_dg.o: $src $here/dsa_peers_common.h"
    echo "	\$(NVCC) \$(DG_FLAGS) -c \$< -o \$@"
    echo "build/dsa_${d}_main.o: $src $here/dsa_peers_common.h $here/dsa_peers_device.cuh src/peers_common.cuh"
    echo "	\$(NVCC) \$(FM_FLAGS) -c \$< -o \$@"
  done
  echo "build/dsa_step_topk.o: $here/vllm_dsa_step_bench.cu $here/dsa_peers_common.h"
  echo "	\$(NVCC) \$(TOPK_FLAGS) -c \$< -o \$@"
  objs=""; for u in $STEP_FM; do objs="$objs $(fm_obj "$u")"; done
  echo "bin/vllm_dsa_step_bench: build/dsa_step_main.o build/dsa_step_dg.o build/dsa_step_topk.o build/glibc_compat.o$objs"
  echo "	\$(NVCC) \$(LDFLAGS) \$^ -o \$@ && strip \$@"
  objs=""; for u in $PREFILL_FM; do objs="$objs $(fm_obj "$u")"; done
  echo "bin/vllm_dsa_prefill_bench: build/dsa_prefill_main.o build/dsa_prefill_dg.o build/glibc_compat.o$objs"
  echo "	\$(NVCC) \$(LDFLAGS) \$^ -o \$@ && strip \$@"
} > "$MK"
(cd "$PB" && make -f build/Makefile.dsa -j"$JOBS" all)
ls -l "$PB/bin/vllm_dsa_step_bench" "$PB/bin/vllm_dsa_prefill_bench"
for b in "$PB/bin/vllm_dsa_step_bench" "$PB/bin/vllm_dsa_prefill_bench"; do
  printf '%s needs %s\n' "$b" "$(objdump -T "$b" | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)"
done
