// The multi-token CTA of the partial kernel on mma.sync (DecodeParams::q_len
// > 1; multi_token_cta_kind in launch_partial.cuh says when it runs, and when
// its wgmma form, decode_partial_multi_wgmma.cuh): one CTA owns 64 query rows (the
// heads x tokens of a request, four MMA M tiles), and its four warps split
// the rows instead of the gathered tokens. Each gathered K/V row is copied
// into shared memory once for all 64 rows, where the 16-row kernel runs a
// CTA per 16 rows and each of them gathers every row again (from L2).
//
// Everything but the math is the 16-row CTA's (PartialCta): work item, row
// gathering, pipeline and page-id prefetch. Per tile, warp w computes
// S = Q_w K^T for its 16 query rows against all 64 gathered rows (8 n8
// tiles), applies each row's causal limit, runs the online softmax over the
// 64 columns and accumulates P V over four k16 steps. A warp's rows are its
// own, so the final state needs no cross-warp merge: each warp writes its
// rows (o or the fp32 partial, and lse) from registers.
#pragma once

#include <type_traits>

#include "cuda/attention/gqa/decode_partial.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparsepage {
namespace cuda {

constexpr int kMultiRows = kWarps * 16;  // query rows per multi-token CTA

/// The 16-row CTA's tile with two stages: with the 64-row Q tile, two CTAs
/// then fit on an SM (three stages would leave one: 115 KB each).
template <int DK, int DV>
struct MultiTileConfig : TileConfig<DK, DV, false> {
  static constexpr int kStages = 2;
  static constexpr int kIdSlots = 2 * kStages - 1;
  static constexpr size_t kStageBytes = size_t{kStages} * TileConfig<DK, DV, false>::kStageElems * 2;
  static constexpr size_t kIdBytes = size_t{kIdSlots} * kIdSlotInts * 4;
};

template <typename T, int DK, int DV, class Source, class Config = MultiTileConfig<DK, DV>>
struct MultiTokenCta : PartialCta<T, DK, DV, Source, Config> {
  using Base = PartialCta<T, DK, DV, Source, Config>;
  using Cfg = typename Base::Cfg;
  using Tr = typename Base::Tr;
  using Params = typename Source::Params;
  using Base::acc;
  using Base::bad;
  using Base::head0;
  using Base::heads;
  using Base::k_tile;
  using Base::kKChunks;
  using Base::kS;
  using Base::l;
  using Base::lane;
  using Base::len;
  using Base::m;
  using Base::p;
  using Base::partial;
  using Base::q_tile;
  using Base::request;
  using Base::src;
  using Base::tid;
  using Base::tok_begin;
  using Base::warp;
  static_assert(!Source::kHasBias && !Source::kMaySkip, "the multi-token CTA runs the library's own page tables");
  static_assert(Cfg::kQInRegs, "Q fragments stay in registers (DK <= 128)");
  // After the page ids: one byte per (stage, warp), set when the warp's rows
  // of the tile in that stage hold a position some token may not see.
  static constexpr size_t kLateBytes = 32;
  static_assert(kS * kWarps <= static_cast<int>(kLateBytes), "a late byte per stage and warp");
  static constexpr size_t kSmemBytes = Cfg::kStageBytes + size_t{kMultiRows} * DK * 2 + Cfg::kIdBytes + kLateBytes;

  __device__ MultiTokenCta(const Params& params, unsigned char* smem) : Base(params, smem, kMultiRows) {}

  static_assert(kWarps == 4, "softmax() reads a stage's four late bytes as one 32-bit word");
  __device__ uint8_t* late_bytes() { return reinterpret_cast<uint8_t*>(this->ids + Cfg::kIdSlots * kIdSlotInts); }

  /// The base copy, and whether this warp's rows of the tile lie at or past
  /// the first token's causal limit (live length - (q_len - 1)): only such
  /// tiles pay for the per-position limit in softmax(). The row PagedSource
  /// resolves is the position itself under window addressing, the only one a
  /// multi-token step over PagedSource takes (pool page ids are refused).
  __device__ void issue_tile(int tile) {
    const int64_t r = Base::issue_tile(tile);
    const bool late = __any_sync(0xffffffffu, r >= src.live_len() - (p.q_len - 1));
    if (lane == 0) late_bytes()[(tile % kS) * kWarps + warp] = late;
  }

  /// S = Q_w K^T: this warp's 16 query rows against the tile's 64 rows;
  /// s[j] covers gathered rows 8j .. 8j + 7.
  __device__ void scores(int stage, float (&s)[8][4]) const {
    const T* kt = k_tile(stage);
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      uint32_t a[4];
      this->q_fragment(kk, a);
#pragma unroll
      for (int kg = 0; kg < 4; ++kg) {
        const int key = kg * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t b[4];
        ldmatrix_x4(b, smem_u32(kt + swizzle(key, 2 * kk + ((lane >> 3) & 1), kKChunks)));
        mma_16816<T>(s[2 * kg], a, b[0], b[1]);
        mma_16816<T>(s[2 * kg + 1], a, b[2], b[3]);
      }
    }
  }

  /// Masks each row's positions at or past its token's causal limit, then
  /// the online softmax over the 64 columns: s becomes P (unnormalized),
  /// and acc is rescaled where the running maximum moved.
  __device__ void softmax(int tile, float (&s)[8][4]) {
    const int32_t n = this->tile_tokens(tile);
    const int32_t* slot = this->id_slot(tile);
    const int32_t tok0 = tok_begin + tile * kTileRows;
    float tile_max[2] = {neg_inf_f32(), neg_inf_f32()};
    // The four warps' late bytes of this stage (written before the barrier
    // that made the tile visible): a whole tile every token sees, the common
    // case, needs no per-position test.
    const uint32_t late = *reinterpret_cast<const uint32_t*>(late_bytes() + (tile % kS) * kWarps);
    if (late == 0 && n == kTileRows) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] *= p.scale_log2;
          tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[j][e]);
        }
      }
    } else {
      int64_t limit[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int32_t row = head0 + warp * 16 + (lane >> 2) + 8 * i;
        limit[i] = src.live_len() - (p.q_len - 1 - row / p.group_size);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = 8 * j + 2 * (lane & 3) + c;
          bool live[2] = {key < n, key < n};
          if (key < n) {
            const int64_t pos = src.position(slot, tok0, tok0 + key);
            live[0] = pos < limit[0];
            live[1] = pos < limit[1];
          }
          s[j][c] = live[0] ? s[j][c] * p.scale_log2 : neg_inf_f32();
          s[j][c + 2] = live[1] ? s[j][c + 2] * p.scale_log2 : neg_inf_f32();
          tile_max[0] = fmaxf(tile_max[0], s[j][c]);
          tile_max[1] = fmaxf(tile_max[1], s[j][c + 2]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
    }
    float alpha[2], base[2];
    const bool rescale = online_softmax_rebase(tile_max, m, l, alpha, base);  // lazy, as in the 16-row CTA
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2_ftz(s[j][e] - base[e >> 1]);
        l[e >> 1] += s[j][e];
      }
    }
    if (rescale) {
#pragma unroll
      for (int nt = 0; nt < DV / 8; ++nt) {
        acc[nt][0] *= alpha[0], acc[nt][1] *= alpha[0], acc[nt][2] *= alpha[1], acc[nt][3] *= alpha[1];
      }
    }
  }

  /// acc += P V over the tile's 64 gathered rows (four k16 steps).
  __device__ void pv(int tile, const float (&s)[8][4]) {
    const T* vt = this->v_tile(tile % kS);
    const int pitch = this->v_pitch();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {  // 16 gathered rows per k16 step
      const uint32_t a[4] = {Tr::pack2(s[2 * ks][0], s[2 * ks][1]), Tr::pack2(s[2 * ks][2], s[2 * ks][3]),
                             Tr::pack2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             Tr::pack2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
      this->pv_k16(a, vt, ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), pitch);
    }
  }

  __device__ void run() {
    static_assert(std::is_same_v<Config, MultiTileConfig<DK, DV>>,
                  "the mma.sync math (scores, pv, the Q fragments) reads the ldmatrix tile layout");
    this->zero_v_tail();  // ordered before the first P V by the prologue's barrier
    this->template pipeline<false>(
        [&] {  // this warp's 16 query rows of the 64, into registers
#pragma unroll
          for (int kk = 0; kk < DK / 16; ++kk)
            ldmatrix_x4(this->qf[kk],
                        smem_u32(q_tile + swizzle(warp * 16 + (lane & 15), 2 * kk + (lane >> 4), kKChunks)));
        },
        [&](int t) { issue_tile(t); },
        [&](int t) {
          float s[8][4] = {};
          scores(t % kS, s);
          softmax(t, s);
          pv(t, s);
        });
    finish();
  }

  /// Each warp writes its own rows: o (or the fp32 partial) and lse.
  __device__ void finish() {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    const bool any_bad = __syncthreads_or(bad);
    const int32_t rows = p.group_size * p.q_len;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int local = warp * 16 + (lane >> 2) + 8 * i;
      if (local >= heads) continue;
      const int32_t row = head0 + local;
      // Nothing seen: o = 0, lse = -inf; a rejected page or NaN inputs: NaN.
      const bool poisoned = any_bad || isnan(l[i]);
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      T* o_row =
          partial < 0 ? static_cast<T*>(p.o) + query_row_offset(p, p.o_seq, p.o_tok, p.o_head, request, row) : nullptr;
      float* part_row = partial < 0 ? nullptr : p.partial_o + (int64_t{partial} * rows + row) * p.partial_dv;
#pragma unroll
      for (int nt = 0; nt < DV / 8; ++nt) {
        if (nt * 8 >= p.dv) break;
        const int col = nt * 8 + 2 * (lane & 3);
        const float x = poisoned ? nan_f32() : acc[nt][2 * i] * inv;
        const float y = poisoned ? nan_f32() : acc[nt][2 * i + 1] * inv;
        if (partial < 0) {
          *reinterpret_cast<uint32_t*>(o_row + col) = Tr::pack2(x, y);
        } else {
          *reinterpret_cast<float2*>(part_row + col) = make_float2(x, y);
        }
      }
      if ((lane & 3) == 0) {
        const float lse = poisoned     ? nan_f32()
                          : l[i] > 0.f ? ((m[i] == neg_inf_f32() ? 0.f : m[i]) + log2f(l[i])) * kLn2
                                       : neg_inf_f32();
        if (partial < 0) {
          if (p.lse) p.lse[lse_row(p, request, row)] = lse;
        } else {
          p.partial_lse[int64_t{partial} * rows + row] = lse;
        }
      }
    }
    if (any_bad && tid == 0) report_rejected(p, request);
  }
};

template <typename T, int DK, int DV, class Source>
__global__ void __launch_bounds__(kThreads, 2)
    multi_token_kernel(const __grid_constant__ typename Source::Params params) {
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait_primary();
  pdl_launch_dependents();
  MultiTokenCta<T, DK, DV, Source> cta(params, smem);
  cta.run();
}

}  // namespace cuda
}  // namespace sparsepage
