// The block-sparse layer's prefill selection (models/block_sparse_kernels.h):
// the prefill indexer's lists, widened to every block for the query blocks
// still in the decode's dense regime. One thread per list, on the caller's
// stream, lengths read on the device: capturable.
#include <algorithm>

#include "cuda/primitives/common.cuh"
#include "models/block_sparse_kernels.h"

namespace sparsepage::detail {
namespace {

constexpr int kThreads = 128;

__global__ void block_prefill_regime_kernel(const BlockPrefillRegimeArgs a) {
  const int32_t nqb = (a.num_tokens + a.block_size - 1) / a.block_size;
  const int64_t lists = int64_t{a.batch} * nqb * a.num_kv_heads;
  for (int64_t l = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; l < lists; l += int64_t{gridDim.x} * blockDim.x) {
    block_prefill_regime_list(a, nqb, l);
  }
}

}  // namespace

void block_prefill_regime_cuda(const BlockPrefillRegimeArgs& a, void* stream) {
  const int64_t lists = int64_t{a.batch} * ((a.num_tokens + a.block_size - 1) / a.block_size) * a.num_kv_heads;
  if (lists == 0) return;
  const int grid = static_cast<int>(std::min<int64_t>((lists + kThreads - 1) / kThreads, 4096));
  block_prefill_regime_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage::detail
