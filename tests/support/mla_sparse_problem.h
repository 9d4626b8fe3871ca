// Problems for the FlashMLA-shaped sparse decode (mla_sparse.h), shared by
// the CPU and CUDA tests: FP8 caches in either format written byte by byte
// (power-of-two scales, so every dequantized value is exact in fp32 and
// bf16), slot-id matrices with -1 padding, topk_length shorter than the
// rows, an optional extra cache and attention sink, and an fp64 reference
// written from FlashMLA's documented semantics. Every byte of a cache that
// no visible id reaches is 0xFF (NaN in e4m3, e8m0, fp32 and bf16), and the
// ids past a row's topk_length point at such slots, so a wrong read shows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsepage/mla_sparse.h"

namespace sparsepage::testing {

struct MlaSparseSpec {
  MlaCacheFormat format = MlaCacheFormat::kV32;
  int32_t batch = 2, q_len = 1, num_heads = 16;
  int32_t topk = 64, num_blocks = 8, block_size = 64;
  int32_t extra_topk = 0, extra_num_blocks = 4, extra_block_size = 16;  // extra_topk 0: no extra cache
  int64_t row_pad = 0;    // kV32: bytes past 656 in each row (a multiple of 16 keeps CUDA's grid)
  int64_t block_pad = 0;  // bytes past a block's own (0: contiguous blocks)
  bool topk_length = false, extra_topk_length = false;  // per-sequence lengths in [0, topk]
  double minus_one = 0.1;                               // share of visible ids that are -1
  bool sink = false;
  uint64_t seed = 1;
};

/// One cache: its bytes, view and ids, and the exact dequantized values of
/// every slot (fp64 [slots, head_dim_qk], NaN where poisoned).
struct MlaSparseHostCache {
  std::vector<uint8_t> bytes;
  std::vector<int32_t> indices;      // [batch, q_len, topk]
  std::vector<int32_t> topk_length;  // [batch] or empty
  std::vector<double> values;
  MlaSparseCache view;  // data and the arrays point into this struct (host)
  int64_t slots() const { return view.num_slots(); }
};

struct MlaSparseProblem {
  MlaSparseSpec spec;
  std::vector<uint16_t> q;  // bf16 [batch, q_len, num_heads, head_dim_qk]
  std::vector<float> sink;  // [num_heads] or empty
  float scale = 0.0f;
  MlaSparseHostCache cache, extra;

  int32_t head_dim_qk() const { return mla_head_dim_qk(spec.format); }
  MlaSparseShape shape() const { return {spec.batch, spec.q_len, spec.num_heads, spec.topk, spec.extra_topk}; }
  /// Host params over this problem's arrays (o bf16 [batch, q_len, heads, 512]).
  MlaSparseParams host_params(void* o, float* lse) const;
  /// Re-points the views into the vectors (after a copy or a move).
  void relink();
};

MlaSparseProblem make_mla_sparse_problem(const MlaSparseSpec& spec);

/// The spec of `batch` sequences of q_len tokens with `heads` heads, topk
/// ids into num_blocks blocks and extra_topk into the extra cache; the rest
/// the defaults.
inline MlaSparseSpec mla_sparse_spec(int32_t batch, int32_t q_len, int32_t heads, int32_t topk, int32_t num_blocks,
                                     int32_t extra_topk, uint64_t seed) {
  MlaSparseSpec spec;
  spec.batch = batch;
  spec.q_len = q_len;
  spec.num_heads = heads;
  spec.topk = topk;
  spec.num_blocks = num_blocks;
  spec.extra_topk = extra_topk;
  spec.seed = seed;
  return spec;
}

/// o [batch, q_len, heads, 512] and lse [batch, q_len, heads] in fp64:
/// softmax over every visible, non -1 id of both caches (scores q . k *
/// scale, k the whole dequantized row, v its first 512 values), o scaled by
/// exp(lse) / (exp(lse) + exp(sink[h])), lse without the sink; a query with
/// nothing to attend gets o = 0, lse = +inf.
struct MlaSparseReference {
  std::vector<double> o, lse;
};
MlaSparseReference mla_sparse_reference(const MlaSparseProblem& problem);

/// The same problem with one cache holding both caches' blocks (the extra
/// blocks after the main ones; same format and block size required) and
/// each query's ids [main | extra shifted by the main slots], -1 past each
/// part's topk_length, no topk_length: what attending the two together means.
MlaSparseProblem merge_into_one_cache(const MlaSparseProblem& problem);

/// Plan shape for the CPU backend (any machine size works; chunks in multiples of 16).
PlanShape mla_sparse_cpu_machine(int32_t fixed_chunk_tokens = 0);

/// Compares query row by row: a row whose reference lse is +inf must have
/// lse +inf and o exactly 0; any other must have o within `o_tol` relative
/// L2 of the reference (exactly 0 where the reference is 0: an infinite
/// sink) and |lse - ref| <= lse_tol * max(1, |ref|). NaN never passes.
/// Returns the first mismatch, described, or "".
std::string compare_mla_sparse(const MlaSparseProblem& problem, const MlaSparseReference& ref,
                               const std::vector<float>& o, const std::vector<float>& lse, double o_tol,
                               double lse_tol);

}  // namespace sparsepage::testing
