// The static block-sparse layer's step kernels (models/static_block_sparse_kernels.h):
// the page matrix and counts of each query head, and the mask of the same
// pattern, both from the device-side lengths and the rule in
// models/static_block_pattern.h. One launch each on the caller's stream,
// grid-stride over their outputs: no allocation, no synchronization, no host
// read, so a captured step keeps following the growing context.
#include <algorithm>

#include "cuda/primitives/common.cuh"
#include "models/static_block_sparse_kernels.h"

namespace sparsepage::detail {
namespace {

constexpr int kThreads = 256;

int grid_for(int64_t total) { return static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 132 * 16)); }

__global__ void static_pages_kernel(const StaticPagesArgs a) {
  const int64_t total = int64_t{a.batch} * a.num_qo_heads * a.width;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / a.width, slot = i % a.width;
    const int32_t b = static_cast<int32_t>(r / a.num_qo_heads), h = static_cast<int32_t>(r % a.num_qo_heads);
    const int64_t len = a.kv_lens[b];
    const StaticKeptBlocks kept = static_kept_blocks(a.pattern, h, len);
    a.pages[i] = slot < kept.count() ? static_cast<int32_t>(kept.at(slot)) : -1;
    if (slot == 0) {
      a.seq_lens[r] = static_cast<int32_t>(static_kept_tokens(a.pattern, h, len));
      const int32_t group = a.num_qo_heads / a.num_kv_heads;
      if (h % group == 0) a.window_lens[int64_t{b} * a.num_kv_heads + h / group] = static_cast<int32_t>(len);
    }
  }
}

__global__ void static_mask_kernel(const StaticMaskArgs a) {
  const int64_t total = int64_t{a.batch} * a.num_qo_heads * a.pitch;
  const float neg_inf = cuda::neg_inf_f32();
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / a.pitch, t = i % a.pitch;
    const int32_t b = static_cast<int32_t>(r / a.num_qo_heads), h = static_cast<int32_t>(r % a.num_qo_heads);
    const int64_t len = a.kv_lens[b];
    const bool kept =
        t < len && static_block_kept(a.pattern, h, (len - 1) / a.pattern.block_size, t / a.pattern.block_size);
    a.mask[i] = kept ? 0.0f : neg_inf;
  }
}

}  // namespace

void static_pages_cuda(const StaticPagesArgs& a, void* stream) {
  const int64_t total = int64_t{a.batch} * a.num_qo_heads * a.width;
  if (total == 0) return;
  static_pages_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

void static_mask_cuda(const StaticMaskArgs& a, void* stream) {
  const int64_t total = int64_t{a.batch} * a.num_qo_heads * a.pitch;
  if (total == 0) return;
  static_mask_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage::detail
