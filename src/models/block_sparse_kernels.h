// The block-sparse layer's device kernels (src/cuda/indexers/block_indexer.cu), behind
// plain C++ signatures; src/models/block_sparse_no_cuda.cc stands in for
// them when the library is built without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sparsepage/index_keys.h"
#include "sparsepage/types.h"

namespace sparsepage::detail {

/// The block indexer on the GPU (src/cuda/indexers/block_indexer.cu): block scores by
/// the rule in models/block_sparse.h, then per request the top-k plus the
/// final block. Live lengths are read on the device; grids and workspace are
/// sized from the host bound max_kv_len, so one captured graph serves every
/// length up to it. Allocates nothing, synchronizes nothing.
/// Limits (Error naming the argument): f16/bf16; 1 <= num_kv_heads <= 8;
/// head_dim a multiple of 32 up to 128 (the tensor-core score layout); batch <= 65535.
struct BlockIndexerArgs {
  DType dtype = DType::kBF16;
  const void* k_alloc = nullptr;  // [batch, num_kv_heads + 1, capacity, head_dim]; index key at head num_kv_heads
  // Or the index keys in a cache of their own: sequence b's rows (head_dim
  // apart) start at index_keys + b * key_seq_stride elements. Set: k_alloc is not read.
  const void* index_keys = nullptr;
  int64_t key_seq_stride = 0;
  /// Or an engine's paged keys (paged.pool set; k_alloc and index_keys are
  /// not read): native rows of `dtype`, or vLLM's FP8 blocks (head_dim 128),
  /// position p of sequence b at slot p % paged.block_size of block
  /// paged.block_table[b * block_table_stride + p / block_size]. One-token
  /// steps only. A length past max_blocks x block_size is refused like one
  /// past max_kv_len; a scored block whose key rows lie in a block outside
  /// [0, num_blocks) is never read and refuses its sequence (both with
  /// block_ids -1 and seq_lens -1, which the decode flags).
  PagedIndexKeys paged{};
  const void* index_q = nullptr;  // [batch, q_len, num_kv_heads, head_dim]
  /// Query tokens per sequence (a multi-token step, models/block_sparse.h):
  /// a block scores the max over every token's index query, and the block of
  /// the first new token is force-kept. q_len * num_kv_heads <= 32.
  int32_t q_len = 1;
  int32_t batch = 0, num_kv_heads = 0, head_dim = 0;
  int64_t capacity = 0;
  const int32_t* kv_lens = nullptr;  // device [batch]: live tokens per sequence, 0 <= kv_lens[b] <= max_kv_len (0:
                                     // a free slot, which keeps nothing)
  int64_t max_kv_len = 0;            // host bound (<= capacity) sizing the grids and the workspace
  int32_t block_size = 0, topk = 0, local_blocks = 0;
  int32_t width = 0;  // entries per request row in block_ids, >= topk + 1
  /// Sequences of at most this many tokens (the model's dense regime) keep
  /// every block, so their rows must fit `width`; 0: none.
  int64_t dense_len = 0;
  int32_t* block_ids = nullptr;  // out [batch * num_kv_heads, width]: the top blocks (increasing id), then the
                                 // final block (possibly partial), then -1
  int32_t* seq_lens = nullptr;   // out [batch * num_kv_heads]: tokens those blocks cover
  int32_t* error = nullptr;      // device, may be null: IndexKeyError bits of refused sequences (or'ed)
  void* workspace = nullptr;     // caller-owned scratch
  size_t workspace_bytes = 0;    // >= block_indexer_workspace_bytes(...)
};
size_t block_indexer_workspace_bytes(int32_t batch, int32_t num_kv_heads, int64_t max_kv_len, int32_t block_size);
void block_indexer_cuda(const BlockIndexerArgs& args, void* stream);

/// The block-sparse layer's prefill selection from the prefill indexer's
/// (models/block_sparse.h: chunked prefill): list (b, i, h) of query block i
/// whose key block is own = (kv_lens[b] - num_tokens) / block_size + i and
/// whose last position ends at end = min((own + 1) * block_size, kv_lens[b])
/// keeps every block 0 .. own (count end) when end <= dense_len, the
/// decode's dense regime; else the indexer's list (its count, its ids, then
/// -1 up to width). Lists are [batch, num_query_blocks, num_kv_heads].
struct BlockPrefillRegimeArgs {
  const int32_t* kv_lens = nullptr;  // [batch] each slot's length with the chunk
  int32_t batch = 0, num_tokens = 0, num_kv_heads = 0, block_size = 0;
  int64_t dense_len = 0;
  const int32_t* indexer_ids = nullptr;     // [lists, indexer_width]
  const int32_t* indexer_counts = nullptr;  // [lists]
  int32_t indexer_width = 0;
  int32_t* block_ids = nullptr;  // out [lists, width]; width >= indexer_width and >= dense_len / block_size
  int32_t* counts = nullptr;     // out [lists]
  int32_t width = 0;
};
void block_prefill_regime_cpu(const BlockPrefillRegimeArgs& args);
void block_prefill_regime_cuda(const BlockPrefillRegimeArgs& args, void* stream);

#if defined(__CUDACC__)
#define SP_REGIME_FN __host__ __device__ inline
#else
#define SP_REGIME_FN inline
#endif
/// List l of the rule above, with nqb query blocks per slot: the CPU loop
/// and the CUDA kernel both run it.
SP_REGIME_FN void block_prefill_regime_list(const BlockPrefillRegimeArgs& a, int32_t nqb, int64_t l) {
  const int32_t b = static_cast<int32_t>(l / (int64_t{nqb} * a.num_kv_heads));
  const int32_t i = static_cast<int32_t>(l / a.num_kv_heads % nqb);
  const int64_t len = a.kv_lens[b];
  const int64_t own = (len - a.num_tokens) / a.block_size + i;
  const int64_t block_end = (own + 1) * a.block_size;
  const int64_t end = block_end < len ? block_end : len;
  int32_t* ids = a.block_ids + l * a.width;
  if (end <= a.dense_len) {
    for (int32_t j = 0; j < a.width; ++j) ids[j] = j <= own ? j : -1;
    a.counts[l] = static_cast<int32_t>(end);
  } else {
    const int32_t* from = a.indexer_ids + l * a.indexer_width;
    for (int32_t j = 0; j < a.width; ++j) ids[j] = j < a.indexer_width ? from[j] : -1;
    a.counts[l] = a.indexer_counts[l];
  }
}
#undef SP_REGIME_FN

/// Block mask [batch * num_kv_heads, max_kv_len] (row pitch max_kv_len): 0
/// where the token's block is one of the request's `width` entries of
/// block_ids (-1 entries match nothing) and t < kv_lens[b] (device [batch]),
/// else -inf.
void block_mask_cuda(const int32_t* block_ids, int32_t batch, int32_t num_kv_heads, int32_t width, int32_t block_size,
                     const int32_t* kv_lens, int64_t max_kv_len, float* mask, void* stream);

}  // namespace sparsepage::detail
