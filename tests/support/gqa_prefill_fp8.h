// GQA block prefills over e4m3 K/V with per-KV-head scales
// (KvFormat::kE4m3PerHead, vLLM's fp8 KV cache) for the CPU and CUDA
// suites: a GqaPrefillProblem's rows quantized per KV head, every row no
// query token attends e4m3 NaN (0x7F), the heads' scales far apart (so a
// scale read for the wrong head shows), an fp64 reference over the
// dequantized rows, and an engine pool (block table) holding the same rows.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/prefill.h"
#include "support/prefill_problem.h"

namespace sparsepage::testing {

struct GqaFp8Problem {
  /// The native problem (q, lists, lengths; K and V in spec.dtype, NaN where
  /// unattended). Its K and V are NOT the FP8 rows' values: see dequantized.
  GqaPrefillProblem base;
  std::vector<uint8_t> k8, v8;          // e4m3 [batch, num_kv_heads, capacity, head_dim]
  std::vector<float> k_scale, v_scale;  // [num_kv_heads]
  /// base with K and V replaced by the FP8 rows' values (e4m3 x the head's
  /// scale) in spec.dtype: exact when the scales are powers of two.
  GqaPrefillProblem dequantized;
  std::vector<float> k_values, v_values;  // the dequantized rows in fp32 (exact)
  bool pow2_scales = false;

  GqaPrefillParams params(const void* q, const void* k, const void* v, const float* ks, const float* vs,
                          const int32_t* ids, const int32_t* counts, const int32_t* kv_lens, void* o, float* lse) const;
  GqaPrefillParams host_params(void* o, float* lse) const;
};

/// `pow2_scales`: every scale a power of two (the dequantized rows then are
/// exactly spec.dtype values); otherwise amax / 448 times a per-head factor.
/// The per-head factors are 1/2, 1, 2, 4, ... (K) and 4, 2, 1, ... (V).
GqaFp8Problem make_gqa_fp8_problem(const GqaPrefillSpec& spec, bool pow2_scales);

/// fp64 over the dequantized rows at the positions each row attends.
GqaPrefillReference gqa_fp8_reference(const GqaFp8Problem& pb);

/// The FP8 rows in an engine's paged pool: pool blocks of `pool_block`
/// positions [num_blocks, pool_block, num_kv_heads, head_dim] handed out in
/// a shuffled order, one table row per sequence; pool rows no sequence
/// owns NaN (0x7F).
struct GqaFp8Pool {
  int32_t pool_block = 16;
  int32_t max_blocks = 0;
  int64_t num_blocks = 0;
  std::vector<uint8_t> k, v;
  std::vector<int32_t> table;  // [batch, max_blocks]
  /// p with k and v moved onto the pool (k_data / v_data, table_data: the
  /// copies to use, host or device).
  GqaPrefillParams paged(GqaPrefillParams p, const void* k_data, const void* v_data, const int32_t* table_data,
                         int32_t batch) const;
};
GqaFp8Pool make_gqa_fp8_pool(const GqaFp8Problem& pb, int32_t pool_block, uint64_t seed);

}  // namespace sparsepage::testing
