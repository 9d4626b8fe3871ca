// The static per-query-head block pattern (docs/DESIGN.md: the static pattern layer, Phi-3-small's
// block-sparse attention) as plain functions that the host and the device
// share, so the page lists, the mask and the host-side counts all come from
// this one file. Included by host C++ and by CUDA sources.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SPARSEPAGE_PATTERN_FN __host__ __device__ inline
#else
#define SPARSEPAGE_PATTERN_FN inline
#endif

namespace sparsepage::detail {

/// The numbers the rule needs (checked by the layer before any use).
struct StaticPattern {
  int32_t block_size = 64;        // >= 1
  int32_t local_blocks = 16;      // >= 1: the query's own block is always kept
  int32_t vert_stride = 8;        // >= 1
  int32_t head_sliding_step = 1;  // how far each query head shifts the vertical blocks
};

/// The rule itself: key block `j` is kept for query block `i` of query head
/// `head` when j <= i and (i - j < local_blocks or
/// (j + head * head_sliding_step + 1) % vert_stride == 0).
SPARSEPAGE_PATTERN_FN bool static_block_kept(const StaticPattern& p, int32_t head, int64_t i, int64_t j) {
  if (j < 0 || j > i) return false;
  return i - j < p.local_blocks || (j + int64_t{head} * p.head_sliding_step + 1) % p.vert_stride == 0;
}

/// The kept key blocks of one query head at decode (the query sits in the
/// window's last block), enumerated in increasing order without scanning:
/// the vertical blocks below the local run, then the local run, which ends
/// with the final (possibly partial) block. Derived from the rule, not a
/// second statement of it: blocks below the local run are kept exactly when
/// j = first_vertical (mod vert_stride).
struct StaticKeptBlocks {
  int64_t num_blocks = 0;      // blocks of the window
  int64_t first_local = 0;     // first block of the local run
  int64_t first_vertical = 0;  // smallest j >= 0 meeting the vertical condition
  int64_t verticals = 0;       // vertical blocks below first_local
  int64_t vert_stride = 1;

  SPARSEPAGE_PATTERN_FN int64_t count() const { return verticals + (num_blocks - first_local); }
  /// The k-th kept block, k < count().
  SPARSEPAGE_PATTERN_FN int64_t at(int64_t k) const {
    return k < verticals ? first_vertical + k * vert_stride : first_local + (k - verticals);
  }
};

SPARSEPAGE_PATTERN_FN StaticKeptBlocks static_kept_blocks(const StaticPattern& p, int32_t head, int64_t kv_len) {
  StaticKeptBlocks s;
  s.vert_stride = p.vert_stride;
  s.num_blocks = kv_len > 0 ? (kv_len + p.block_size - 1) / p.block_size : 0;
  s.first_local = s.num_blocks > p.local_blocks ? s.num_blocks - p.local_blocks : 0;
  const int64_t shift = (int64_t{head} * p.head_sliding_step + 1) % p.vert_stride;
  s.first_vertical = (p.vert_stride - shift) % p.vert_stride;
  s.verticals = s.first_local > s.first_vertical ? (s.first_local - 1 - s.first_vertical) / p.vert_stride + 1 : 0;
  return s;
}

/// Tokens one query head attends at `kv_len`: every kept block whole, the
/// final one cut at the live length.
SPARSEPAGE_PATTERN_FN int64_t static_kept_tokens(const StaticPattern& p, int32_t head, int64_t kv_len) {
  if (kv_len <= 0) return 0;
  const StaticKeptBlocks s = static_kept_blocks(p, head, kv_len);
  return (s.count() - 1) * p.block_size + (kv_len - (s.num_blocks - 1) * p.block_size);
}

}  // namespace sparsepage::detail
