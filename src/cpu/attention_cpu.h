// The CPU backend's one attention loop, shared by the paged decode, the mask
// path and the gather path: online softmax over a token range of one request,
// rows converted to fp32 a tile at a time so the dot products vectorize.
// Scores are fp32 (as on the GPU); the softmax sum and the weighted V sum are
// fp64, because this backend is the oracle every GPU result is judged by: an
// fp32 running sum over a 1M-token chunk stops absorbing small weights once
// the sum is 2^24 times larger than they are.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/dot.h"
#include "sparsepage/decode.h"
#include "sparsepage/types.h"

namespace sparsepage::cpu {

/// Row pointers of one token: K, V and (optional) second K stream.
struct TokenRows {
  const void* k;
  const void* v;
  const void* k_extra;  // null without a second stream
};

/// The per-request inputs of one attention chunk.
struct ChunkQuery {
  DType dtype;
  int32_t group_size;
  int32_t dim_qk, dim_v, dim_extra;
  const float* q;        // [group_size, dim_qk] fp32
  const float* q_extra;  // [group_size, dim_extra] fp32 or null
  float scale;
  // How K and V rows are stored (decode.h's KvFormat) and, for
  // kE4m3PerHead, this request's head scales.
  KvFormat kv_format = KvFormat::kNative;
  float k_scale = 1.0f, v_scale = 1.0f;
};

/// One K or V row as fp32: `dtype` elements, or e4m3 times the head's
/// scale, or the MLA rows' e4m3 latent times its per-128 scales (which sit
/// at byte 512 of the row).
inline void load_kv_row(const ChunkQuery& q, const void* row, float* dst, int dim, float head_scale) {
  const auto* bytes = static_cast<const uint8_t*>(row);
  switch (q.kv_format) {
    case KvFormat::kNative: to_float(q.dtype, row, dst, static_cast<size_t>(dim)); return;
    case KvFormat::kE4m3PerHead:
      for (int i = 0; i < dim; ++i) dst[i] = e4m3_to_float(bytes[i]) * head_scale;
      return;
    case KvFormat::kE4m3Mla: {
      float scales[4];
      std::memcpy(scales, bytes + 512, sizeof(scales));
      for (int i = 0; i < dim; ++i) dst[i] = e4m3_to_float(bytes[i]) * scales[i / 128];
      return;
    }
  }
}

/// Softmax state of one chunk: normalized output [group_size, dim_v] and the
/// natural-log (base e) sum of exponentials per head (-inf when nothing was
/// attended).
struct ChunkState {
  std::vector<float> o;
  std::vector<float> lse;
};

constexpr int kTokenTile = 32;

/// Attends tokens [begin, end); `rows(t)` resolves token t, `bias(t)` gives
/// its additive mask term (0 when unmasked), or `bias(t, g)` query row g's
/// when the rows differ (a multi-token step's causal limit). A position whose bias is -inf
/// contributes nothing whatever its K or V rows hold: its weight is skipped,
/// never multiplied (0 * NaN would be NaN).
template <typename Rows, typename Bias>
ChunkState attend_chunk(const ChunkQuery& q, int64_t begin, int64_t end, Rows&& rows, Bias&& bias) {
  const int g_count = q.group_size;
  const int dk = q.dim_qk, dv = q.dim_v, de = q.dim_extra;
  std::vector<float> k_tile(static_cast<size_t>(kTokenTile) * dk);
  std::vector<float> e_tile(static_cast<size_t>(kTokenTile) * std::max(de, 1));
  std::vector<float> v_tile(static_cast<size_t>(kTokenTile) * dv);
  std::vector<float> scores(static_cast<size_t>(g_count) * kTokenTile);
  std::vector<float> running_max(g_count, -std::numeric_limits<float>::infinity());
  std::vector<double> running_sum(g_count, 0.0);
  std::vector<double> acc(static_cast<size_t>(g_count) * dv, 0.0);  // unnormalized output
  std::vector<bool> poisoned(g_count, false);
  ChunkState state;
  state.o.assign(static_cast<size_t>(g_count) * dv, 0.0f);
  state.lse.assign(g_count, -std::numeric_limits<float>::infinity());

  for (int64_t tile = begin; tile < end; tile += kTokenTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTokenTile, end - tile));
    for (int j = 0; j < n; ++j) {
      const TokenRows r = rows(tile + j);
      load_kv_row(q, r.k, &k_tile[static_cast<size_t>(j) * dk], dk, q.k_scale);
      load_kv_row(q, r.v, &v_tile[static_cast<size_t>(j) * dv], dv, q.v_scale);
      if (de > 0) to_float(q.dtype, r.k_extra, &e_tile[static_cast<size_t>(j) * de], static_cast<size_t>(de));
    }
    for (int g = 0; g < g_count; ++g) {
      const float* qg = q.q + static_cast<size_t>(g) * dk;
      float* s = &scores[static_cast<size_t>(g) * kTokenTile];
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < n; ++j) {
        float dot = cpu::dot(qg, &k_tile[static_cast<size_t>(j) * dk], static_cast<size_t>(dk));
        if (de > 0) {
          dot += cpu::dot(q.q_extra + static_cast<size_t>(g) * de, &e_tile[static_cast<size_t>(j) * de],
                          static_cast<size_t>(de));
        }
        // A masked-out position is excluded whatever its score; a NaN score
        // of a visible position poisons the row (NaN never passes).
        float b;
        if constexpr (std::is_invocable_v<Bias&, int64_t, int>)
          b = bias(tile + j, g);  // per query row
        else
          b = bias(tile + j);
        s[j] = b == -std::numeric_limits<float>::infinity() ? b : dot * q.scale + b;
        poisoned[g] = poisoned[g] || std::isnan(s[j]);
        tile_max = std::max(tile_max, s[j]);
      }
      const float new_max = std::max(running_max[g], tile_max);
      if (new_max == -std::numeric_limits<float>::infinity()) continue;  // all masked so far: nothing to add
      // exp(-inf - finite) = 0 rescales an empty accumulator harmlessly.
      const double correction = std::exp(static_cast<double>(running_max[g]) - new_max);
      double* og = &acc[static_cast<size_t>(g) * dv];
      if (correction != 1.0) {
        for (int d = 0; d < dv; ++d) og[d] *= correction;
      }
      double sum = running_sum[g] * correction;
      for (int j = 0; j < n; ++j) {
        if (s[j] == -std::numeric_limits<float>::infinity()) continue;  // masked out: adds nothing, reads no V
        // exp in fp32 (relative error ~1e-7 per weight); the sums are fp64,
        // which is where long chunks lost mass.
        const double p = std::exp(s[j] - new_max);
        sum += p;
        const float* vj = &v_tile[static_cast<size_t>(j) * dv];
        for (int d = 0; d < dv; ++d) og[d] += p * vj[d];
      }
      running_sum[g] = sum;
      running_max[g] = new_max;
    }
  }
  for (int g = 0; g < g_count; ++g) {
    if (poisoned[g] || std::isnan(running_sum[g])) {
      std::fill(state.o.begin() + static_cast<std::ptrdiff_t>(g) * dv,
                state.o.begin() + static_cast<std::ptrdiff_t>(g + 1) * dv, std::numeric_limits<float>::quiet_NaN());
      state.lse[g] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (running_sum[g] > 0.0) {
      float* og = &state.o[static_cast<size_t>(g) * dv];
      const double* ag = &acc[static_cast<size_t>(g) * dv];
      const double inv = 1.0 / running_sum[g];
      for (int d = 0; d < dv; ++d) og[d] = static_cast<float>(ag[d] * inv);
      state.lse[g] = static_cast<float>(running_max[g] + std::log(running_sum[g]));
    }
  }
  return state;
}

/// Merges chunk states by their lse. Empty chunks (lse = -inf) weigh nothing;
/// if all are empty the result is o = 0, lse = -inf.
void merge_states(const std::vector<const float*>& o_parts, const std::vector<const float*>& lse_parts,
                  int32_t group_size, int32_t dim_v, float* o_out, float* lse_out);

/// The merge's finalize (decode_merge.cuh's sink and empty-row lse), on a
/// merged state of `rows` rows: with `sink` set, an attended row g's o is
/// scaled by exp(lse) / (exp(lse) + exp(sink[g])) (lse unchanged: -inf
/// leaves o as it is, +inf makes it 0); a row that attended nothing (lse
/// -inf, o 0) gets lse = empty_lse. NaN rows stay NaN.
void finalize_states(float* o, float* lse, int32_t rows, int32_t dim_v, const float* sink, float empty_lse);

}  // namespace sparsepage::cpu
