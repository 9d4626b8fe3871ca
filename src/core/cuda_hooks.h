// The few CUDA runtime services host code needs, behind plain C++
// signatures. src/cuda/memory.cu implements them; src/core/no_cuda.cc, used
// when the library is built without CUDA, makes each one report that.
#pragma once

#include <cstddef>

namespace sparsepage::detail {

bool cuda_device_present();
void* cuda_malloc(size_t bytes);
void cuda_free(void* ptr) noexcept;
/// Synchronous copies; `dst_on_device` / `src_on_device` pick the direction.
void cuda_copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes);
void cuda_copy_2d(void* dst, bool dst_on_device, size_t dst_pitch, const void* src, bool src_on_device,
                  size_t src_pitch, size_t width, size_t height);
void cuda_fill(void* dst, int value, size_t bytes);
/// Waits for the work queued on `stream` (a cudaStream_t; null: the default stream).
void cuda_stream_sync(void* stream);

}  // namespace sparsepage::detail

#include <cstdint>

#include "sparsepage/decode.h"

namespace sparsepage::detail {

/// Device half of gather_rows (src/cuda/dense_paths.cu).
void gather_rows_cuda(const int32_t* rows, const int32_t* offsets, int32_t num_requests, int64_t max_rows,
                      DType dtype, const PoolView& pool, int64_t num_pool_rows, void* dst, void* stream);

/// Device half of selection_from_blocks (src/cuda/selection.cu). All arrays
/// are device arrays; offending rows are written as -1.
void selection_from_blocks_cuda(const int32_t* block_ids, const int32_t* block_offsets, const int32_t* row_offsets,
                                const int64_t* row_base, const int64_t* live_lens, int32_t num_requests,
                                int32_t block_size, int32_t* rows_out, void* stream);

}  // namespace sparsepage::detail

namespace sparsepage::detail {
/// Device half of build_selection_mask (src/cuda/selection.cu).
void selection_mask_cuda(const int32_t* positions, const int32_t* offsets, int32_t num_requests, int64_t live_len,
                         float* mask, void* stream);
}  // namespace sparsepage::detail

namespace sparsepage::detail {
/// Block-sparse indexer on the GPU (src/cuda/indexer.cu): block scores by the
/// rule in models/block_sparse.h and the per-request top-k plus the final
/// block, written to `block_ids` [batch * num_kv_heads, blocks_per_request].
struct BlockTopkArgs {
  DType dtype;
  const void* k_alloc;   // K allocation [batch, num_kv_heads + 1, capacity, head_dim]; index key at head num_kv_heads
  const void* index_q;   // [batch, num_kv_heads, head_dim]
  int32_t batch, num_kv_heads, head_dim;
  int64_t capacity, kv_len;
  int32_t block_size, topk, local_blocks, blocks_per_request;
  int32_t* block_ids;
};
void block_topk_cuda(const BlockTopkArgs& args, void* stream);
/// Block mask [requests, kv_len]: 0 where the token's block is selected and t < kv_len, else -inf.
void block_mask_cuda(const int32_t* block_ids, int32_t num_requests, int32_t blocks_per_request, int32_t block_size,
                     int64_t kv_len, float* mask, void* stream);
}  // namespace sparsepage::detail

namespace sparsepage {
struct DsaConfig;
}  // namespace sparsepage

namespace sparsepage::detail {
/// Throws Error naming the first limit of the CUDA DSA indexer
/// (src/cuda/dsa_indexer.cu) that `config` at `batch` breaks; without CUDA,
/// says the library was built without it.
void check_dsa_indexer_cuda(const DsaConfig& config, int32_t batch);
}  // namespace sparsepage::detail
