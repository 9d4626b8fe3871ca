// Device pass of selection_from_blocks: block ids -> token rows, one thread
// per output row (O(selected)), one grid row per request.
#include "core/cuda_hooks.h"
#include "cuda/primitives/common.cuh"

namespace sparsepage {
namespace detail {

namespace {

struct BlocksToRowsParams {
  const int32_t* block_ids;      // concatenated per request
  const int32_t* block_offsets;  // [num_requests + 1]
  const int32_t* row_offsets;    // [num_requests + 1]
  const int64_t* row_base;       // [num_requests]
  const int64_t* live_lens;      // [num_requests]
  int32_t block_size;
  int32_t* rows_out;  // [row_offsets[num_requests]]
};

__global__ void blocks_to_rows_kernel(const __grid_constant__ BlocksToRowsParams p) {
  const int r = blockIdx.y;
  const int32_t out_begin = p.row_offsets[r];
  const int32_t count = p.row_offsets[r + 1] - out_begin;
  const int32_t block_begin = p.block_offsets[r];
  const int32_t num_blocks = p.block_offsets[r + 1] - block_begin;
  const int64_t live = p.live_lens[r];
  const int64_t full_blocks = live / p.block_size;  // blocks entirely inside the window
  const bool has_partial = live % p.block_size != 0;
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const int32_t j = i / p.block_size;
    const int32_t slot = i - j * p.block_size;
    int64_t row = -1;
    if (j < num_blocks) {
      const int64_t block = p.block_ids[block_begin + j];
      const bool last = j == num_blocks - 1;
      // Full blocks anywhere; the partial block only as the request's last
      // entry, which is what the host-side row count assumed.
      const bool ok =
          block >= 0 && (block < full_blocks ? !(last && has_partial) : block == full_blocks && has_partial && last);
      if (ok) row = p.row_base[r] + block * p.block_size + slot;
    }
    p.rows_out[out_begin + i] = (row >= 0 && row <= INT32_MAX) ? static_cast<int32_t>(row) : -1;
  }
}

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

void selection_from_blocks_cuda(const int32_t* block_ids, const int32_t* block_offsets, const int32_t* row_offsets,
                                const int64_t* row_base, const int64_t* live_lens, int32_t num_requests,
                                int32_t block_size, int32_t* rows_out, void* stream) {
  if (num_requests <= 0) return;
  if (block_size < 1) throw Error("selection_from_blocks: block_size must be >= 1");
  if (num_requests > 65535) throw Error("selection_from_blocks: more than 65535 requests on CUDA");
  BlocksToRowsParams p{block_ids, block_offsets, row_offsets, row_base, live_lens, block_size, rows_out};
  // Rows per request are unknown on the device side of this call; 8 CTAs of
  // 256 threads per request cover 2048 rows in one pass and stride beyond.
  const dim3 grid(8, static_cast<unsigned>(num_requests));
  blocks_to_rows_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

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
