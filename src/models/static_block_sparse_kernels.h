// The static block-sparse layer's device kernels (src/cuda/indexers/static_block_sparse.cu)
// behind plain C++ signatures, with their CPU twins (src/models/static_block_sparse.cc);
// src/models/static_block_sparse_no_cuda.cc stands in for the CUDA ones when
// the library is built without CUDA.
#pragma once

#include <cstdint>

#include "models/static_block_pattern.h"

namespace sparsepage::detail {

/// One step's page matrix and counts from the device-side lengths. For
/// request r = b * num_qo_heads + h (query head h of sequence b):
///   pages[r]     = the kept blocks at kv_lens[b] in increasing order (the
///                  final, possibly partial, block last), then -1 up to `width`;
///   seq_lens[r]  = the tokens they cover (the final block cut at kv_lens[b]);
/// and window_lens[b * num_kv_heads + k] = kv_lens[b] for each KV head k.
/// A request keeping more than `width` blocks (a length past the sized
/// capacity) gets only `width` page ids but its full count, which the decode
/// then rejects (NaN and its error flag) instead of reading a wrong row.
struct StaticPagesArgs {
  StaticPattern pattern;
  const int32_t* kv_lens = nullptr;  // [batch] live tokens per sequence
  int32_t batch = 0, num_qo_heads = 0, num_kv_heads = 0;
  int32_t width = 0;               // page ids per request row
  int32_t* pages = nullptr;        // out [batch * num_qo_heads, width]
  int32_t* seq_lens = nullptr;     // out [batch * num_qo_heads]
  int32_t* window_lens = nullptr;  // out [batch * num_kv_heads]
};
void static_pages_cpu(const StaticPagesArgs& args);
void static_pages_cuda(const StaticPagesArgs& args, void* stream);

/// The additive mask [batch * num_qo_heads, pitch] of the same pattern,
/// straight from the rule: 0 at position t of request r when t < kv_lens[b]
/// and static_block_kept(h, (kv_lens[b] - 1) / block_size, t / block_size),
/// -inf elsewhere (up to `pitch`).
struct StaticMaskArgs {
  StaticPattern pattern;
  const int32_t* kv_lens = nullptr;  // [batch]
  int32_t batch = 0, num_qo_heads = 0;
  int64_t pitch = 0;      // floats per request row (the capacity)
  float* mask = nullptr;  // out [batch * num_qo_heads, pitch]
};
void static_mask_cpu(const StaticMaskArgs& args);
void static_mask_cuda(const StaticMaskArgs& args, void* stream);

}  // namespace sparsepage::detail
