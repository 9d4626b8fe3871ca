// FP8 versions of a PagedProblem (support/reference.h) for the CPU and CUDA
// FP8 tests: the same page table and q, with K and V stored as e4m3 (per-KV-
// head scales, or the MLA 656-byte rows), and an fp64 reference over the
// dequantized values. Pool rows no visible token reaches stay NaN (e4m3 0x7F,
// or a NaN scale), so a wrong read still shows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "support/reference.h"

namespace sparsepage::testing {

struct Fp8Problem {
  const PagedProblem* base = nullptr;  // page table, q, q_extra, the bf16 rope pool
  KvFormat format = KvFormat::kNative;
  int32_t num_kv_heads = 1;
  std::vector<uint8_t> k, v;  // e4m3 rows (kE4m3Mla: the 656-byte rows in k)
  int64_t k_row_bytes = 0, v_row_bytes = 0;
  std::vector<float> k_scale, v_scale;  // kE4m3PerHead: [num_kv_heads]

  /// kE4m3Mla: model the CUDA kernels' dequantization, which rounds each
  /// value (e4m3 times its block's scale, in fp32) to bf16 before the
  /// tensor cores read it (docs/RELIABILITY.md, "FP8 MLA rounding"). Off:
  /// the format's exact dequantization (the CPU backend's).
  bool round_to_bf16 = false;

  /// Host params of the format (pass output buffers).
  DecodeParams host_params(void* o, float* lse) const;
  /// K (or V) value `d` of pool row `row` as the kernels must see it, for request r.
  float k_value(int32_t r, int64_t row, int32_t d) const;
  float v_value(int32_t r, int64_t row, int32_t d) const;
};

/// How far the FP8 MLA kernels may lie from the fp64 attention over the
/// exact dequantization (docs/RELIABILITY.md, "FP8 MLA rounding"), from the
/// data: per (request, head) the lse bound, per output element the o bound.
struct Fp8RoundingBound {
  std::vector<double> o;         // [R, G, dim_v]
  std::vector<double> lse;       // [R, G]
  double largest_score_sum = 0;  // the largest A = scale * sum |q k| met (for messages)
};
Fp8RoundingBound mla_rounding_bound(const Fp8Problem& exact, const std::vector<std::vector<int64_t>>& rows);
/// The elements of `o` / `lse` outside the bound, as "request r head g: ..."
/// (the first few), or "" when all lie within it.
std::string outside_bound(const Fp8Problem& exact, const Reference& ref, const Fp8RoundingBound& bound,
                          const std::vector<float>& o, const std::vector<float>& lse);

/// e4m3 K and V with scales k_scale[h] = (h + 1) / 448 and v_scale[h] =
/// (2 h + 1) / 896: each row's values (in [-1, 1]) are stored as
/// e4m3(x * 448), so the heads' dequantized values differ.
Fp8Problem make_fp8_per_head(const PagedProblem& base, int32_t num_kv_heads);
/// The MLA rows quantize_mla_fp8_cpu makes from base's latent (K) and rope
/// (second stream) pools; base must be the MLA shape with V aliasing K.
Fp8Problem make_fp8_mla(const PagedProblem& base, int64_t row_bytes = 656);

/// The far-query problem both backends' FP8 tests run: 4 requests of group
/// 16 whose bf16 queries are scaled by 2^40 and 2^-40 (request by request),
/// far outside f16's range, so a kernel that narrows q shows. `pb` keeps the
/// base problem the returned FP8 problem points into.
Fp8Problem make_fp8_far_queries(PagedProblem& pb);
/// The largest finite |lse| of a reference (an lse near 1e12 is judged
/// relatively: its fp32 ulp is 65536).
double max_finite_lse(const Reference& ref);

/// fp64 attention over the dequantized values of each request's rows
/// (default: the base problem's token_rows(); negative rows are skipped,
/// as -1 padding is).
Reference reference_attention(const Fp8Problem& problem);
Reference reference_attention(const Fp8Problem& problem, const std::vector<std::vector<int64_t>>& rows);

}  // namespace sparsepage::testing
