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
/// Block-sparse indexer on the GPU (src/cuda/block_indexer.cu): block scores
/// by the rule in models/block_sparse.h, then per request the top-k plus the
/// final block. Live lengths are read on the device; grids and workspace are
/// sized from the host bound max_kv_len, so one captured graph serves every
/// length up to it. Allocates nothing, synchronizes nothing.
/// Limits (Error naming the argument): f16/bf16; 1 <= num_kv_heads <= 8;
/// head_dim a multiple of 32 up to 128; batch <= 65535.
struct BlockIndexerArgs {
  DType dtype;
  const void* k_alloc;      // [batch, num_kv_heads + 1, capacity, head_dim]; index key at head num_kv_heads; 16-byte aligned
  const void* index_q;      // [batch, num_kv_heads, head_dim]
  int32_t batch, num_kv_heads, head_dim;
  int64_t capacity;
  const int32_t* kv_lens;   // DEVICE [batch]: live tokens per sequence, read on the device (1 <= kv_lens[b] <= max_kv_len)
  int64_t max_kv_len;       // HOST bound (<= capacity) that sizes the grids and the workspace
  int32_t block_size, topk, local_blocks;
  int32_t width;            // entries per request row in block_ids, >= topk + 1
  int32_t* block_ids;       // out [batch * num_kv_heads, width]: min(topk, nb - 1) top blocks (increasing id), then
                            // the final block (nb - 1, possibly partial); entries after those are -1.
                            // nb = ceil(kv_lens[b] / block_size)
  int32_t* seq_lens;        // out [batch * num_kv_heads]: tokens those blocks cover
                            // = (selected - 1) * block_size + (kv_lens[b] - (nb - 1) * block_size)
  void* workspace;          // caller-owned, >= block_indexer_workspace_bytes(...) bytes
  size_t workspace_bytes;
};
size_t block_indexer_workspace_bytes(int32_t batch, int32_t num_kv_heads, int64_t max_kv_len, int32_t block_size);
void block_indexer_cuda(const BlockIndexerArgs& args, void* stream);
/// Block mask [batch * num_kv_heads, max_kv_len] (row pitch max_kv_len): 0 where
/// the token's block is one of the request's `width` entries of block_ids (-1
/// entries match nothing) and t < kv_lens[b] (device [batch]), else -inf.
void block_mask_cuda(const int32_t* block_ids, int32_t batch, int32_t num_kv_heads, int32_t width, int32_t block_size,
                     const int32_t* kv_lens, int64_t max_kv_len, float* mask, void* stream);
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
