// The MLA partial kernel with its consumer warpgroups split by role, not by
// tokens: the same work, producer, stages and shared tile layout as the
// warp-specialized kernel (mla_ws_partial.cuh), but
//
//   warpgroup 0 (the scorer)  S of all 64 tokens of a tile on wgmma m64n64
//                             (Q and the tile's K, 36 k-steps), the whole
//                             softmax (a row's 64 scores live in one quad of
//                             threads, so no maxima are exchanged), the P
//                             tile into the stage's rope slab for warpgroup 1,
//                             then P V over V columns 0-255 with P taken from
//                             its registers;
//   warpgroup 1 (the second   P V over V columns 256-511 with P from the
//   accumulator)              shared tile, after rescaling its O by the
//                             factors the scorer left beside it.
//
// The two meet only through mbarriers: `p_ready[s]` (the 128 scorer threads
// arrive once their P and rescale factors of the tile in stage s are
// written) and, at the end, `rows_ready` (the rows' maxima and sums). So P V
// of tile t on warpgroup 1 runs while the scorer computes S of tile t + 1:
// the tensor cores are fed across the softmax, which the token-split kernel
// runs on both warpgroups at once with the tensor cores idle. S on m64n64
// also reads Q once per 64 tokens rather than once per 32.
//
// A stage is released (its `empty` barrier) by the scorer's warps after its
// P V and by warpgroup 1's after theirs: 8 warp arrivals, as before.
//
// Registers (setmaxnreg): the scorer 240 (O: 128, S: 32, P: 16), warpgroup 1
// 160 (O: 128), the producer 40: 440 x 128 of the 168 x 384 the launch gives.
#pragma once

#include "cuda/mla_ws_partial.cuh"

namespace sparsepage {
namespace cuda {

struct MlaRolesTile : MlaWsTile {
  static constexpr int kScorerRegs = 240;
  static constexpr int kAccumulatorRegs = 160;
  // The exchange area (1 KB) holds the scorer's per-row rescale factors of
  // the last two tiles ([2][64] floats) and, at the end, the rows' maxima
  // and sums ([64][2] floats).
  static constexpr int kAlpha = kExchange;
  static constexpr int kRows = kExchange + 2 * L::kHeads * 4;
  // p_ready[2] and rows_ready after the warp-specialized kernel's barriers.
  static constexpr int kRoleBarriers = (MlaWsTile::kBytes + 7) / 8 * 8;
  static constexpr int kBytes = kRoleBarriers + 3 * 8;
  static constexpr size_t kSmemBytes = size_t{kBytes} + 1024;
  static_assert(kSmemBytes <= 232448, "one CTA per SM on sm_90");
  static_assert(kRows + L::kHeads * 2 * 4 <= kBarriers, "the factors and row sums fit the exchange area");
};

template <typename T, class Source>
struct MlaRolesCta : MlaWsCta<T, Source, MlaRolesTile> {
  using W = MlaRolesTile;
  using Ws = MlaWsCta<T, Source, W>;
  using Tr = ElemTraits<T>;
  using L = MlaTile;
  using Params = typename Ws::Params;
  using KernelParams = Params;
  static constexpr int kThreads = W::kThreads;
  using Ws::p, Ws::src, Ws::base, Ws::gen, Ws::tid, Ws::wg, Ws::wt, Ws::lane;
  using Ws::request, Ws::tok_begin, Ws::len, Ws::partial, Ws::head0, Ws::heads, Ws::tile_tokens;
  using Ws::bad, Ws::m, Ws::l, Ws::acc;
  using Ws::num_tiles, Ws::id_slot, Ws::stage, Ws::full_bar, Ws::empty_bar, Ws::done_bar, Ws::bad_flag;

  __device__ MlaRolesCta(const Params& params, unsigned char* smem) : Ws(params, smem) {}

  __device__ uint32_t p_ready_bar(int tile) const { return base + W::kRoleBarriers + (tile & 1) * 8; }
  __device__ uint32_t rows_ready_bar() const { return base + W::kRoleBarriers + 16; }
  __device__ float* alpha_slot(int tile) const {
    return reinterpret_cast<float*>(gen + W::kAlpha) + (tile & 1) * L::kHeads;
  }
  __device__ float* row_slot() const { return reinterpret_cast<float*>(gen + W::kRows); }
  /// This thread's accumulator rows (both warpgroups use the wgmma layout).
  __device__ int first_row() const { return (wt / 32) * 16 + lane / 4; }

  /// S = Q K^T of the tile in `stage_addr` over its 64 tokens (m64n64,
  /// accumulators as [n8 tile][4]).
  __device__ void scores(uint32_t stage_addr, float (&s)[8][4]) const {
    const uint64_t qd = wgmma::desc_sw128(base + W::kQ, 16, 1024);
    const uint64_t kd = wgmma::desc_sw128(stage_addr, 16, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < L::kCols / 16; ++kk) {
      const uint64_t off = static_cast<uint64_t>(((kk >> 2) * L::kSlabBytes + (kk & 3) * 32) >> 4);
      wgmma::mma_m64n64k16<T>(s, qd + off, kd + off, kk > 0);
    }
    wgmma::commit();
  }

  /// The scorer's softmax of tile `tile`: scale and mask, the rows' maxima
  /// (within each quad), the lazy rebase (O rescaled here, the factors left
  /// for warpgroup 1), the weights into `pa` (the A fragments of P V) and
  /// into the stage's P slab.
  __device__ void weigh(int tile, float (&s)[8][4], uint32_t (&pa)[4][4]) {
    const int32_t n = tile_tokens(tile);
    const int32_t* slot = id_slot(tile);
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    float tmax[2] = {neg_inf_f32(), neg_inf_f32()};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j * 8 + 2 * (lane & 3) + (e & 1);
        float x = s[j][e] * p.scale_log2;
        if constexpr (Source::kHasBias) {
          const float b = src.bias(slot, key);
          x = b == neg_inf_f32() ? b : x + b * kLog2e;
        }
        if (key >= n) x = neg_inf_f32();
        if constexpr (Source::kMaySkip) {
          if (src.skip_minus_one && key < n && src.skipped(slot, tok0, tok0 + key)) x = neg_inf_f32();
        }
        s[j][e] = x;
        tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    }
    float alpha[2], b[2];
    const bool rescale = online_softmax_rebase(tmax, m, l, alpha, b);
    if (rescale) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] *= alpha[(i >> 1) & 1];
    }
    const int row0 = first_row();
    if ((lane & 3) == 0) {
      float* a = alpha_slot(tile);
      a[row0] = alpha[0];
      a[row0 + 8] = alpha[1];
    }
    uint32_t* ptile = reinterpret_cast<uint32_t*>(gen + W::kStage0 + (tile & 1) * L::kTileBytes + W::kPSlab);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = j * 8 + 2 * (lane & 3);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = exp2_ftz(s[j][2 * h] - b[h]), p1 = exp2_ftz(s[j][2 * h + 1] - b[h]);
        l[h] += p0 + p1;
        const uint32_t packed = Tr::pack2(p0, p1);
        // The A fragment of k-step j / 2: rows g, g + 8 (h), columns
        // 2c + {0, 1} (even j) or 2c + 8 + {0, 1} (odd j).
        pa[j >> 1][(j & 1) * 2 + h] = packed;
        const int row = row0 + 8 * h;
        ptile[(row * 128 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2) / 4] = packed;
      }
    }
  }

  /// O[:, 256 w ..] += P V of the tile in `tile`'s stage; the scorer's P from
  /// `pa`, warpgroup 1's from the P slab.
  __device__ void scorer_pv(int tile, const uint32_t (&pa)[4][4]) {
    const uint64_t vd = wgmma::desc_sw128(stage(tile), L::kSlabBytes, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < L::kTokens / 16; ++kk)
      wgmma::mma_m64n256k16_rs<T>(acc, pa[kk], vd + static_cast<uint64_t>(kk * 128), 1);
    wgmma::commit();
  }
  __device__ void second_pv(int tile) {
    const uint32_t st = stage(tile);
    const uint64_t pd = wgmma::desc_sw128(st + W::kPSlab, 16, 1024);
    const uint64_t vd = wgmma::desc_sw128(st + 4 * L::kSlabBytes, L::kSlabBytes, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < L::kTokens / 16; ++kk)
      wgmma::mma_m64n256k16<T>(acc, pd + static_cast<uint64_t>(kk * 2), vd + static_cast<uint64_t>(kk * 128), 1);
    wgmma::commit();
  }

  __device__ void release(int tile) {
    __syncwarp();
    if (lane == 0) mbar::arrive(empty_bar(tile));
  }

  __device__ void run_scorer() {
    const int tiles = num_tiles();
    float s[8][4];
    uint32_t pa[4][4];
    for (int t = 0; t < tiles; ++t) {
      this->wait_full(t);
      scores(stage(t), s);
      wgmma::wait<0>();
      wgmma::pin(s);
      weigh(t, s, pa);
      // The P slab and the factors, for warpgroup 1's wgmma reads (async
      // proxy) and its loads; each scorer thread releases its own stores.
      wgmma::fence_proxy_async();
      mbar::arrive(p_ready_bar(t));
      scorer_pv(t, pa);
      wgmma::wait<0>();
      wgmma::pin(acc);
      release(t);
    }
  }

  __device__ void run_second() {
    const int tiles = num_tiles();
    const int row0 = first_row();
    for (int t = 0; t < tiles; ++t) {
      mbar::wait(p_ready_bar(t), (t >> 1) & 1);
      wgmma::fence_proxy_async();
      const float* a = alpha_slot(t);
      const float a0 = a[row0], a1 = a[row0 + 8];
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] *= (i >> 1) & 1 ? a1 : a0;
      }
      second_pv(t);
      wgmma::wait<0>();
      wgmma::pin(acc);
      release(t);
    }
  }

  /// The scorer publishes its rows' maxima and sums; both warpgroups then
  /// write their 256 columns (and the scorer the lse).
  __device__ void finish(bool any_bad) {
    const int row0 = first_row();
    float* rows = row_slot();
    float sum[2];
    if (wg == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sum[r] = l[r] + __shfl_xor_sync(0xffffffffu, l[r], 1);
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
      }
      if ((lane & 3) == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) rows[2 * (row0 + 8 * r)] = m[r], rows[2 * (row0 + 8 * r) + 1] = sum[r];
      }
      mbar::arrive(rows_ready_bar());
    } else {
      mbar::wait(rows_ready_bar(), 0);
#pragma unroll
      for (int r = 0; r < 2; ++r) m[r] = rows[2 * (row0 + 8 * r)], sum[r] = rows[2 * (row0 + 8 * r) + 1];
    }
    mla_store_rows<T>(p, acc, m, sum, row0, lane, wg, request, partial, head0, heads, any_bad);
    if (any_bad && tid == 0 && p.error_flag) atomicOr(p.error_flag, 1u);
  }

  __device__ void run() {
    constexpr int kLaunchRegs = 65536 / W::kThreads / 8 * 8;
    static_assert((W::kScorerRegs + W::kAccumulatorRegs + W::kProducerRegs) * 128 <= W::kThreads * kLaunchRegs,
                  "setmaxnreg asks for more than the launch gave");
    if (tid == 0) {
      for (int s = 0; s < 2; ++s) {
        mbar::init(full_bar(s), W::kProducerThreads + 1);
        mbar::init(empty_bar(s), W::kConsumerThreads / 32);
        mbar::init(p_ready_bar(s), 128);
      }
      mbar::init(done_bar(), W::kProducerThreads);
      mbar::init(rows_ready_bar(), 128);
      *bad_flag() = 0;
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid >= W::kConsumerThreads) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(W::kProducerRegs));
      this->run_producer();
      if (bad) atomicOr(bad_flag(), 1u);
      mbar::arrive(done_bar());
      return;
    }
    m[0] = m[1] = neg_inf_f32();
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    this->load_q();
    cp_async_commit();
    cp_async_wait<0>();
    wgmma::fence_proxy_async();
    named_barrier(W::kConsumerBar, W::kConsumerThreads);  // Q landed
    // Each branch ends on its own copy of the epilogue, so that each is
    // compiled under its own register limit.
    if (wg == 0) {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(W::kScorerRegs));
      run_scorer();
      mbar::wait(done_bar(), 0);
      finish(*static_cast<volatile unsigned int*>(bad_flag()) != 0);
    } else {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(W::kAccumulatorRegs));
      run_second();
      mbar::wait(done_bar(), 0);
      finish(*static_cast<volatile unsigned int*>(bad_flag()) != 0);
    }
  }
};

}  // namespace cuda
}  // namespace sparsepage
