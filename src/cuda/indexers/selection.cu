// The selection mask of the mask path (build_selection_mask): -inf
// everywhere, then 0 at each request's selected positions.
#include "core/cuda_hooks.h"
#include "cuda/primitives/common.cuh"

namespace sparsepage {
namespace detail {

namespace {

__global__ void fill_neg_inf_kernel(float* mask, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    mask[i] = cuda::neg_inf_f32();
  }
}

// One CTA per request: 0 at each selected position inside the window.
__global__ void scatter_positions_kernel(const int32_t* positions, const int32_t* offsets, int64_t live_len,
                                         float* mask) {
  const int r = blockIdx.x;
  for (int32_t i = offsets[r] + threadIdx.x; i < offsets[r + 1]; i += blockDim.x) {
    const int32_t t = positions[i];
    if (t >= 0 && t < live_len) mask[int64_t{r} * live_len + t] = 0.0f;
  }
}

}  // namespace

void selection_mask_cuda(const int32_t* positions, const int32_t* offsets, int32_t num_requests, int64_t live_len,
                         float* mask, void* stream) {
  const int64_t total = int64_t{num_requests} * live_len;
  if (total == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  const int grid = static_cast<int>(std::min<int64_t>((total + 255) / 256, 132 * 16));
  fill_neg_inf_kernel<<<grid, 256, 0, s>>>(mask, total);
  SP_CUDA_CHECK_LAUNCH();
  scatter_positions_kernel<<<num_requests, 256, 0, s>>>(positions, offsets, live_len, mask);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace detail
}  // namespace sparsepage
