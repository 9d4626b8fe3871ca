// The block-sparse layer's device kernels (src/cuda/block_indexer.cu), behind
// plain C++ signatures; src/models/block_sparse_no_cuda.cc stands in for
// them when the library is built without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sparsepage/types.h"

namespace sparsepage::detail {

/// The block indexer on the GPU, by the rule in models/block_sparse.h, with
/// live lengths read on the device (graph-replayable as the context grows).
struct BlockIndexerArgs {
  DType dtype = DType::kBF16;
  const void* k_alloc = nullptr;   // [batch, num_kv_heads + 1, capacity, head_dim]; index key at head num_kv_heads
  const void* index_q = nullptr;   // [batch, num_kv_heads, head_dim]
  int32_t batch = 0, num_kv_heads = 0, head_dim = 0;
  int64_t capacity = 0;
  const int32_t* kv_lens = nullptr;  // device [batch]: live tokens per sequence, 1 <= kv_lens[b] <= max_kv_len
  int64_t max_kv_len = 0;            // host bound (<= capacity) sizing the grids and the workspace
  int32_t block_size = 0, topk = 0, local_blocks = 0;
  int32_t width = 0;                 // entries per request row in block_ids, >= topk + 1
  int32_t* block_ids = nullptr;      // out [batch * num_kv_heads, width]: kept blocks, the final block last, then -1
  int32_t* seq_lens = nullptr;       // out [batch * num_kv_heads]: tokens those blocks cover
  void* workspace = nullptr;         // caller-owned scratch
  size_t workspace_bytes = 0;        // >= block_indexer_workspace_bytes(...)
};
size_t block_indexer_workspace_bytes(int32_t batch, int32_t num_kv_heads, int64_t max_kv_len, int32_t block_size);
void block_indexer_cuda(const BlockIndexerArgs& args, void* stream);

/// Block mask [num_requests, pitch]: 0 at the live positions t < kv_lens[r /
/// num_kv_heads] of each listed block (entries of -1 unused), else -inf.
void block_mask_cuda(const int32_t* block_ids, int32_t num_requests, int32_t num_kv_heads, int32_t width,
                     int32_t block_size, const int32_t* kv_lens, int64_t pitch, float* mask, void* stream);

}  // namespace sparsepage::detail
