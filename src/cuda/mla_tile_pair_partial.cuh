// The tile-pair MLA partial kernel: the work of mla_partial.cuh (64 query
// heads per CTA, 512 latent + 64 rope columns, V = the latent columns), with
// the gathered tiles taken two at a time and split between the consumer
// warpgroups. Warpgroup 0 computes S, the softmax and P of tile A = 2j,
// warpgroup 1 those of tile B = 2j + 1, each on wgmma m64n64k16, so Q is read
// from shared memory once per 64 tokens (the ws kernel's m64n32 halves read
// it once per 32). Each warpgroup owns half of O's 512 columns and adds both
// tiles to it: its own tile's P V with P from registers, the other tile's
// with P through shared memory.
//
// CTA: 3 warpgroups (384 threads), one CTA per SM.
//   warpgroups 0, 1  consumers (setmaxnreg kConsumerRegs): 128 fp32 O
//                    accumulators, 32 of S, 16 of P in bf16;
//   warpgroup 2      producer (kProducerRegs): the ws kernel's gather (eight
//                    neighbouring threads copy one 128-byte slab row), by
//                    stage halves.
//
// Stages: tile A in stage 0, tile B in stage 1, each in two halves, L =
// columns 0-255 (slabs 0-3) and R = columns 256-575 (slabs 4-8, the rope in
// slab 8), each with its own `full` and `empty` mbarrier, so a half is
// refilled as soon as its last reader is done:
//   A.L  S_A, P_A V_L (wg 0)                    released by wg 0
//   B.R  S_B, P_B V_R (wg 1)                    released by wg 1
//   A.R  S_A (wg 0), then P_A V_R (wg 1)        released by wg 1
//   B.L  S_B (wg 1), then P_B V_L (wg 0)        released by wg 0
// The producer fills them in that order, the order the consumers need them
// (warpgroup 1 starts S_B on B.R). P_A is written over stage 0's rope slab
// (S_A has read it, and A.R is released only after the last read of P_A);
// P_B has a slab of its own.
//
// One pair (j), the two warpgroups staggered so that one's softmax runs
// beside the other's MMAs:
//   wg 0: softmax(A) against base m0 -> sM, signal `max A`; P_A V_A.L;
//         release A.L; wait for `max B` (wg 1's base M); move P_A and O to M
//         if it differs from m0; P_A -> shared memory, signal `P_A`; wait
//         for `P_B`; P_B V_B.L; S of the next A (its L half first); release
//         B.L once P_B V_B.L is done.
//   wg 1: S_B (R half, then L); wait for `max A`; softmax(B) against
//         M = max(m0, B's max) -> sM, signal `max B`; P_B V_B.R; P_B ->
//         shared memory; wait for `P_A`; P_A V_A.R; signal `P_B`; release
//         B.R, then A.R.
// The signals are one-way named barriers (bar.arrive on one side, bar.sync
// on the other), so neither warpgroup waits where it needs nothing. Bases
// move lazily (online_softmax_rebase's rule: only when a row's max grows by
// 2^8), so most pairs rescale nothing. Both warpgroups end on the same base;
// each holds the row sums of its own tiles, added at the end.
//
// The structure follows FlashMLA's sparse sm90 kernel (read to learn, not
// copied), adapted to this library's row sources, page tables, bad-id
// poisoning and lazy rescale.
#pragma once

#include "cuda/mla_ws_partial.cuh"

namespace sparsepage {
namespace cuda {

struct MlaTilePairTile {
  using L = MlaTile;
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerRegs = 224;  // 2 x 224 + 56 = 3 x 168, all that 384 threads get
  static constexpr int kProducerRegs = 56;   // 40 spills inside the engine forms' 64-bit block division
  static constexpr int kLeftSlabs = 4;       // half L: V columns 0-255
  static constexpr int kRowsPerThread = L::kTokens / (kProducerThreads / 8);  // 4
  // Page ids of three pairs: the producer writes pair j + 1's while the
  // consumers may still read pair j - 1's (the empty barriers it waited for
  // in pair j - 1 guarantee no older ones).
  static constexpr int kIdSlots = 6;
  // Byte offsets from the 1024-aligned base.
  static constexpr int kQ = 0;
  static constexpr int kStage0 = kQ + L::kTileBytes;       // tile A
  static constexpr int kStage1 = kStage0 + L::kTileBytes;  // tile B
  static constexpr int kPA = kStage0 + (L::kSlabs - 1) * L::kSlabBytes;  // P_A over A's rope slab
  static constexpr int kPB = kStage1 + L::kTileBytes;
  static constexpr int kIds = kPB + L::kSlabBytes;
  static constexpr int kBases = kIds + kIdSlots * kIdSlotInts * 4;  // [64] floats: a row base handed over
  // full[4] and empty[4] (stage * 2 + half), done: 8 bytes each; then the
  // producers' rejected-id flag.
  static constexpr int kBarriers = kBases + L::kHeads * 4;
  static constexpr int kBadFlag = kBarriers + 9 * 8;
  static constexpr int kBytes = kBadFlag + 8;
  static constexpr size_t kSmemBytes = size_t{kBytes} + 1024;
  static_assert(kSmemBytes <= 232448, "one CTA per SM on sm_90");
  static_assert(L::kHeads * 128 == L::kSlabBytes, "a P tile is one slab");
  static_assert(kBarriers % 8 == 0, "mbarriers are 8-byte aligned");
  static_assert(2 * kConsumerRegs + kProducerRegs <= 3 * 168, "setmaxnreg asks for more than the launch gave");
  // Named barriers (0 is __syncthreads; the hand-overs are one-way).
  static constexpr int kBaseA = 1;        // wg 0's bases in sM: wg 0 arrives, wg 1 waits
  static constexpr int kBaseB = 2;        // wg 1's bases in sM: wg 1 arrives, wg 0 waits
  static constexpr int kPAReady = 3;      // P_A in shared memory: wg 0 arrives, wg 1 waits
  static constexpr int kPBReady = 4;      // P_B in shared memory: wg 1 arrives, wg 0 waits
  static constexpr int kConsumerBar = 5;  // both consumer warpgroups
  static constexpr int kProducerBar = 6;
};

/// kVariant, bits of the variants measured (docs/PERFORMANCE.md):
///   1  warpgroup 1 signals P_B as soon as it is stored and releases B.R as
///      soon as P_B V_B.R is done, before it waits for P_A;
///   2  the producer starts bringing the next pair's rows into L2 once it
///      has issued this pair's copies;
///   4  diagnostic only, wrong results: no row is copied, so the consumers
///      run at the speed their own schedule allows.
template <typename T, class Source, int kVariant = 0>
struct MlaTilePairCta : MlaCtaShare<T, Source> {
  static constexpr bool kEarlyRelease = (kVariant & 1) != 0;
  static constexpr bool kL2Prefetch = (kVariant & 2) != 0;
  static constexpr bool kNoCopies = (kVariant & 4) != 0;
  using Tr = ElemTraits<T>;
  using L = MlaTile;
  using W = MlaTilePairTile;
  using S = MlaCtaShare<T, Source>;
  using Params = typename S::Params;
  using KernelParams = Params;  // what mla_partial_kernel takes
  static constexpr int kThreads = W::kThreads;
  using S::p, S::src, S::base, S::gen, S::k_base, S::e_base, S::tid, S::wg, S::wt, S::lane;
  using S::request, S::tok_begin, S::len, S::partial, S::head0, S::heads, S::tile_tokens;
  using S::bad;  // set by producer threads only

  __device__ MlaTilePairCta(const Params& params, unsigned char* smem) : S(params, smem) {}

  __device__ int num_pairs() const { return (len + 2 * L::kTokens - 1) / (2 * L::kTokens); }
  __device__ int32_t* id_slot(int tile) const {
    return reinterpret_cast<int32_t*>(gen + W::kIds) + (tile % W::kIdSlots) * kIdSlotInts;
  }
  __device__ uint32_t stage(int s) const { return base + (s == 0 ? W::kStage0 : W::kStage1); }
  /// Half h (0: L, 1: R) of stage s holds its rows.
  __device__ uint32_t full_bar(int s, int h) const { return base + W::kBarriers + (2 * s + h) * 8; }
  /// Half h of stage s is no longer read.
  __device__ uint32_t empty_bar(int s, int h) const { return base + W::kBarriers + 32 + (2 * s + h) * 8; }
  /// Every producer thread is done; the rejected-id flag is set before.
  __device__ uint32_t done_bar() const { return base + W::kBarriers + 64; }
  __device__ unsigned int* bad_flag() const { return reinterpret_cast<unsigned int*>(gen + W::kBadFlag); }
  __device__ float* bases() const { return reinterpret_cast<float*>(gen + W::kBases); }

  // ---- producer -------------------------------------------------------------

  __device__ void prefetch_pair_ids(int pair) {
    for (int t = 2 * pair; t < 2 * pair + 2; ++t) {
      const int32_t n = tile_tokens(t);
      if (n > 0) src.prefetch(id_slot(t), tok_begin + t * L::kTokens, n, wt);
    }
  }

  /// Copies half H of `tile`'s rows into stage `s`: thread t copies the
  /// 16-byte piece t % 8 of each of the half's slabs of rows t / 8 + 16 i
  /// (tail, masked and rejected rows are zero-filled), then arrives on the
  /// half's `full` barrier when its copies have landed. Each half resolves
  /// its rows again: cheaper than keeping eight 64-bit rows live at the
  /// producer's register budget.
  template <int H>
  __device__ void copy_half(int tile, int s) {
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    const int32_t n = tile_tokens(tile);
    const int32_t* slot = id_slot(tile);
    const int piece = wt & 7;
    const uint32_t dst0 = stage(s);
#pragma unroll
    for (int i = 0; i < W::kRowsPerThread; ++i) {
      const int row = wt / 8 + 16 * i;
      const T* k_row = k_base;
      const T* e_row = e_base;
      int fill = 0;
      if (row < n) {
        const int64_t r = src.row(slot, tok0, tok0 + row, p);
        bad |= r == kRejectedRow;  // a masked row (kMaskedRow) is just not read
        if (r >= 0) {
          fill = 16;
          k_row += r * p.k_stride;
          e_row += r * p.e_stride;
        }
      }
      const uint32_t dst = dst0 + row * 128 + ((piece ^ (row & 7)) << 4);
      constexpr int kFirst = H == 0 ? 0 : W::kLeftSlabs;
      constexpr int kLast = H == 0 ? W::kLeftSlabs : L::kSlabs - 1;  // latent slabs of this half
      if (kNoCopies) fill = 0, k_row = k_base, e_row = e_base;
#pragma unroll
      for (int sl = kFirst; sl < kLast; ++sl) if (!kNoCopies) cp_async_16_latent(dst + sl * L::kSlabBytes, k_row + (sl * 8 + piece) * 8, fill);
      if constexpr (H == 1 && !kNoCopies) cp_async_16_n(dst + (L::kSlabs - 1) * L::kSlabBytes, e_row + piece * 8, fill);
    }
    mbar::arrive_on_copies(full_bar(s, H));
  }

  /// Starts bringing pair `pair`'s rows into L2 (one row per thread), so
  /// that its copies, issued when the consumers release the stages, read L2.
  __device__ void prefetch_pair_l2(int pair) {
    const int tile = 2 * pair + wt / L::kTokens, row = wt % L::kTokens;
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    if (row < tile_tokens(tile)) {
      const int64_t r = src.row(id_slot(tile), tok0, tok0 + row, p);
      if (r >= 0) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(k_base + r * p.k_stride), "r"(L::kLatent * 2) : "memory");
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(e_base + r * p.e_stride), "r"(L::kRope * 2) : "memory");
      }
    }
  }

  __device__ void run_producer() {
    const int pairs = num_pairs();
    if (pairs > 0) prefetch_pair_ids(0);
    cp_async_commit();
    for (int j = 0; j < pairs; ++j) {
      // The ids of pair j: committed before the rows of pair j - 1, which
      // may still be landing.
      if (j == 0) {
        cp_async_wait<0>();
      } else {
        cp_async_wait<1>();
      }
      named_barrier(W::kProducerBar, W::kProducerThreads);  // every thread's ids of pair j are visible
      if (j + 1 < pairs) prefetch_pair_ids(j + 1);
      cp_async_commit();
      // A fresh barrier's "previous phase" counts as complete.
      const uint32_t parity = (j & 1) ^ 1;
      mbar::wait(empty_bar(0, 0), parity);
      copy_half<0>(2 * j, 0);
      mbar::wait(empty_bar(1, 1), parity);
      copy_half<1>(2 * j + 1, 1);
      mbar::wait(empty_bar(0, 1), parity);
      copy_half<1>(2 * j, 0);
      mbar::wait(empty_bar(1, 0), parity);
      copy_half<0>(2 * j + 1, 1);
      cp_async_commit();
      if constexpr (kL2Prefetch) {
        if (j + 1 < pairs) {
          cp_async_wait<1>();  // the ids of pair j + 1
          named_barrier(W::kProducerBar, W::kProducerThreads);
          prefetch_pair_l2(j + 1);
        }
      }
    }
    cp_async_wait<0>();
  }

  // ---- consumers ------------------------------------------------------------

  float m[2], l[2];  // the rows' base (the same in both warpgroups) and this warpgroup's sum
  float acc[128];    // O: rows as below, columns 256 wg + 8 j + 2 (lane % 4) + {0, 1}

  /// This thread's rows: wrow() and wrow() + 8; its quad lane (columns
  /// 2 quad(), 2 quad() + 1 of each 8). Read from threadIdx, not the shared
  /// members, so that ptxas rematerializes them instead of keeping (or
  /// spilling) a register across the warpgroups' branch.
  __device__ static int wrow() { return static_cast<int>(threadIdx.x % 128 / 32 * 16 + threadIdx.x % 32 / 4); }
  __device__ static int quad() { return static_cast<int>(threadIdx.x & 3); }

  __device__ void wait_full(int s, int h, int pair) {
    mbar::wait(full_bar(s, h), pair & 1);
    wgmma::fence_proxy_async();  // the copies (generic proxy) before the wgmma reads (async proxy)
  }
  /// Releases half h of stage s once this warp's MMAs reading it are done.
  __device__ void release(int s, int h) {
    __syncwarp();
    if (lane == 0) mbar::arrive(empty_bar(s, h));
  }

  /// Issues S += Q K^T over k-steps [K0, K1) (16 columns each) of the tile
  /// in stage s; K0 == first starts the accumulator.
  template <int K0, int K1, bool kFirst>
  __device__ void issue_scores(int s, float (&sc)[8][4]) const {
    const uint64_t qd = wgmma::desc_sw128(base + W::kQ, 16, 1024);
    const uint64_t kd = wgmma::desc_sw128(stage(s), 16, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = K0; kk < K1; ++kk) {
      const uint64_t off = static_cast<uint64_t>(((kk >> 2) * L::kSlabBytes + (kk & 3) * 32) >> 4);
      wgmma::mma_m64n64k16<T>(sc, qd + off, kd + off, kFirst && kk == K0 ? 0 : 1);
    }
    wgmma::commit();
  }

  /// Scores of `tile` in base 2 with masked keys at -inf; the rows' maxima.
  __device__ void scale_and_mask(int tile, float (&sc)[8][4], float (&tmax)[2]) const {
    const int32_t n = tile_tokens(tile);
    const int32_t* slot = id_slot(tile);
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    tmax[0] = tmax[1] = neg_inf_f32();
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j * 8 + 2 * quad() + (e & 1);
        float x = sc[j][e] * p.scale_log2;
        if constexpr (Source::kHasBias) {
          if (key < n) {
            const float b = src.bias(slot, key);
            x = b == neg_inf_f32() ? b : x + b * kLog2e;
          }
        }
        if (key >= n) x = neg_inf_f32();
        if constexpr (Source::kMaySkip) {
          if (src.skip_minus_one && key < n && src.skipped(slot, tok0, tok0 + key)) x = neg_inf_f32();
        }
        sc[j][e] = x;
        tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    }
  }

  /// The lazy base after a tile of maxima `tmax` over base `from`: moved
  /// (to the larger of the two) only when some row of the warp grew by more
  /// than 2^8 (online_softmax_rebase's rule).
  __device__ static void next_base(const float (&from)[2], const float (&tmax)[2], float (&to)[2]) {
    constexpr float kRescaleLog2 = 8.f;
    const bool move = __any_sync(0xffffffffu, tmax[0] > from[0] + kRescaleLog2 || tmax[1] > from[1] + kRescaleLog2);
#pragma unroll
    for (int r = 0; r < 2; ++r) to[r] = move ? fmaxf(from[r], tmax[r]) : from[r];
  }
  /// What a value relative to base `from` is multiplied by to be relative to
  /// `to` (>= from): 1 when unchanged (both -inf too), 0 from -inf.
  __device__ static float rebase_factor(float from, float to) { return from == to ? 1.f : exp2f(from - to); }
  /// Whether any row of the warp moves.
  __device__ static bool any_moves(const float (&f)[2]) { return __any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f); }

  __device__ void scale_acc(const float (&f)[2]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] *= f[(i >> 1) & 1];
  }

  /// P = exp2(scores - base) in place, its row sums added to l.
  __device__ void exponentiate(float (&sc)[8][4], const float (&mb)[2]) {
    const float b[2] = {mb[0] == neg_inf_f32() ? 0.f : mb[0], mb[1] == neg_inf_f32() ? 0.f : mb[1]};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[j][e] = exp2f(sc[j][e] - b[e >> 1]);
        l[e >> 1] += sc[j][e];
      }
    }
  }

  /// P in the A-fragment layout of k-step kk (tokens 16 kk .. 16 kk + 15):
  /// rows r, r + 8 of tokens 16 kk + 2 (lane % 4) + {0, 1}, then of 16 kk + 8 + ...
  __device__ static void pack_p(const float (&sc)[8][4], uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      pa[kk][0] = Tr::pack2(sc[2 * kk][0], sc[2 * kk][1]);
      pa[kk][1] = Tr::pack2(sc[2 * kk][2], sc[2 * kk][3]);
      pa[kk][2] = Tr::pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[kk][3] = Tr::pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
  }
  /// As pack_p, each row's P multiplied by its factor f.
  __device__ static void pack_p_scaled(const float (&sc)[8][4], const float (&f)[2], uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      pa[kk][0] = Tr::pack2(sc[2 * kk][0] * f[0], sc[2 * kk][1] * f[0]);
      pa[kk][1] = Tr::pack2(sc[2 * kk][2] * f[1], sc[2 * kk][3] * f[1]);
      pa[kk][2] = Tr::pack2(sc[2 * kk + 1][0] * f[0], sc[2 * kk + 1][1] * f[0]);
      pa[kk][3] = Tr::pack2(sc[2 * kk + 1][2] * f[1], sc[2 * kk + 1][3] * f[1]);
    }
  }

  /// Writes P (A fragments) as a 64 x 64 K-major tile with the 128-byte
  /// swizzle at byte offset `offset`, for the other warpgroup's P V.
  __device__ void store_p(int offset, const uint32_t (&pa)[4][4]) const {
    uint32_t* tile = reinterpret_cast<uint32_t*>(gen + offset);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = (2 * kk + c) * 8 + 2 * quad();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wrow() + 8 * h;
          tile[(row * 128 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2) / 4] = pa[kk][2 * c + h];
        }
      }
    }
    wgmma::fence_proxy_async();  // the stores (generic proxy) before the other warpgroup's wgmma reads
  }

  /// O += P V over V's half `half` (columns 256 half ..) of the tile in
  /// stage s, P from registers.
  __device__ void issue_pv_local(const uint32_t (&pa)[4][4], int s, int half) {
    const uint64_t vd = wgmma::desc_sw128(stage(s) + half * W::kLeftSlabs * L::kSlabBytes, L::kSlabBytes, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma::mma_m64n256k16_rs<T>(acc, pa[kk], vd + static_cast<uint64_t>(kk * 128), 1);
    wgmma::commit();
  }
  /// O += P V as above with P from the shared tile at byte offset `p_offset`.
  __device__ void issue_pv_shared(int p_offset, int s, int half) {
    const uint64_t pd = wgmma::desc_sw128(base + p_offset, 16, 1024);
    const uint64_t vd = wgmma::desc_sw128(stage(s) + half * W::kLeftSlabs * L::kSlabBytes, L::kSlabBytes, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma::mma_m64n256k16<T>(acc, pd + static_cast<uint64_t>(kk * 2), vd + static_cast<uint64_t>(kk * 128), 1);
    wgmma::commit();
  }

  /// Warpgroup 0: tile A of each pair, O columns 0-255.
  __device__ void run_wg0(int pairs) {
    float sc[8][4];
    uint32_t pa[4][4];
    if (pairs > 0) {
      wait_full(0, 0, 0);
      issue_scores<0, 16, true>(0, sc);
      wait_full(0, 1, 0);
      issue_scores<16, L::kCols / 16, false>(0, sc);
      wgmma::wait<0>();
      wgmma::pin(sc);
    }
    for (int j = 0; j < pairs; ++j) {
      float tmax[2], m0[2];
      scale_and_mask(2 * j, sc, tmax);
      next_base(m, tmax, m0);
      const float a[2] = {rebase_factor(m[0], m0[0]), rebase_factor(m[1], m0[1])};
      if (any_moves(a)) scale_acc(a);
      l[0] *= a[0];
      l[1] *= a[1];
      exponentiate(sc, m0);
      pack_p(sc, pa);
      if (quad() == 0) bases()[wrow()] = m0[0], bases()[wrow() + 8] = m0[1];
      named_arrive(W::kBaseA, W::kConsumerThreads);
      issue_pv_local(pa, 0, 0);
      wgmma::wait<0>();
      wgmma::pin(acc);
      release(0, 0);
      // Warpgroup 1's base M for this pair (>= m0): P_A and O move to it.
      named_barrier(W::kBaseB, W::kConsumerThreads);
      const float mb[2] = {bases()[wrow()], bases()[wrow() + 8]};
      __syncwarp();  // read before this warp's next write of the bases
      const float c[2] = {rebase_factor(m0[0], mb[0]), rebase_factor(m0[1], mb[1])};
      if (any_moves(c)) {
        scale_acc(c);
        pack_p_scaled(sc, c, pa);
      }
      l[0] *= c[0];
      l[1] *= c[1];
      m[0] = mb[0];
      m[1] = mb[1];
      store_p(W::kPA, pa);
      named_arrive(W::kPAReady, W::kConsumerThreads);
      named_barrier(W::kPBReady, W::kConsumerThreads);
      issue_pv_shared(W::kPB, 1, 0);
      if (j + 1 < pairs) {
        // S of the next A behind P_B V_B.L: its L half is usually in already.
        wait_full(0, 0, j + 1);
        issue_scores<0, 16, true>(0, sc);
        wgmma::wait<1>();
        wgmma::pin(acc);
        release(1, 0);
        wait_full(0, 1, j + 1);
        issue_scores<16, L::kCols / 16, false>(0, sc);
        wgmma::wait<0>();
        wgmma::pin(sc);
      } else {
        wgmma::wait<0>();
        wgmma::pin(acc);
        release(1, 0);
      }
    }
  }

  /// Warpgroup 1: tile B of each pair, O columns 256-511.
  __device__ void run_wg1(int pairs) {
    float sc[8][4];
    uint32_t pb[4][4];
    for (int j = 0; j < pairs; ++j) {
      wait_full(1, 1, j);
      issue_scores<L::kCols / 16 - 20, L::kCols / 16, true>(1, sc);
      wait_full(1, 0, j);
      issue_scores<0, 16, false>(1, sc);
      wgmma::wait<0>();
      wgmma::pin(sc);
      float tmax[2], mb[2];
      scale_and_mask(2 * j + 1, sc, tmax);
      named_barrier(W::kBaseA, W::kConsumerThreads);
      const float m0[2] = {bases()[wrow()], bases()[wrow() + 8]};
      __syncwarp();  // every lane read m0 before this warp writes M over it
      next_base(m0, tmax, mb);
      if (quad() == 0) bases()[wrow()] = mb[0], bases()[wrow() + 8] = mb[1];
      named_arrive(W::kBaseB, W::kConsumerThreads);
      const float a[2] = {rebase_factor(m[0], mb[0]), rebase_factor(m[1], mb[1])};
      if (any_moves(a)) scale_acc(a);
      l[0] *= a[0];
      l[1] *= a[1];
      m[0] = mb[0];
      m[1] = mb[1];
      exponentiate(sc, mb);
      pack_p(sc, pb);
      issue_pv_local(pb, 1, 1);
      store_p(W::kPB, pb);
      if constexpr (kEarlyRelease) {
        named_arrive(W::kPBReady, W::kConsumerThreads);
        wgmma::wait<0>();
        wgmma::pin(acc);
        release(1, 1);
        named_barrier(W::kPAReady, W::kConsumerThreads);
        issue_pv_shared(W::kPA, 0, 1);
        wgmma::wait<0>();
        wgmma::pin(acc);
        release(0, 1);
      } else {
        named_barrier(W::kPAReady, W::kConsumerThreads);
        issue_pv_shared(W::kPA, 0, 1);
        named_arrive(W::kPBReady, W::kConsumerThreads);
        wgmma::wait<1>();
        wgmma::pin(acc);
        release(1, 1);
        wgmma::wait<0>();
        wgmma::pin(acc);
        release(0, 1);
      }
    }
  }

  __device__ void run_consumers() {
    m[0] = m[1] = neg_inf_f32();
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    mla_load_q<T>(p, base + W::kQ, request, head0, heads, tid, W::kConsumerThreads);
    cp_async_commit();
    cp_async_wait<0>();
    wgmma::fence_proxy_async();
    named_barrier(W::kConsumerBar, W::kConsumerThreads);  // Q landed
    const int pairs = num_pairs();
    if (wg == 0) {
      run_wg0(pairs);
    } else {
      run_wg1(pairs);
    }
  }

  /// Adds the two warpgroups' row sums and writes o / lse or the partial
  /// slot. The sums go over Q: both warpgroups' last S is done by the time
  /// either gets here (each waited for the other's last P).
  __device__ void finish_consumers(bool any_bad) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    float* sums = reinterpret_cast<float*>(gen + W::kQ);
    if (quad() == 0) sums[wg * L::kHeads + wrow()] = l[0], sums[wg * L::kHeads + wrow() + 8] = l[1];
    named_barrier(W::kConsumerBar, W::kConsumerThreads);
    float sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) sum[r] = sums[wrow() + 8 * r] + sums[L::kHeads + wrow() + 8 * r];
    mla_store_rows<T>(p, acc, m, sum, wrow(), lane, wg, request, partial, head0, heads, any_bad);
    if (any_bad && tid == 0 && p.error_flag) atomicOr(p.error_flag, 1u);
  }

  __device__ void run() {
    if (tid == 0) {
      for (int b = 0; b < 4; ++b) {
        mbar::init(full_bar(b / 2, b % 2), W::kProducerThreads);  // each producer thread's copies (the ids' too)
        mbar::init(empty_bar(b / 2, b % 2), 4);                   // the releasing warpgroup's four warps
      }
      mbar::init(done_bar(), W::kProducerThreads);
      *bad_flag() = 0;
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // As in the ws kernel: the producers' rejected ids reach the consumers
    // through a shared flag and the `done` mbarrier, not a CTA barrier met
    // from both branches.
    if (tid >= W::kConsumerThreads) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(W::kProducerRegs));
      run_producer();
      if (bad) atomicOr(bad_flag(), 1u);
      mbar::arrive(done_bar());  // release: the flag, before
    } else {
      asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(W::kConsumerRegs));
      run_consumers();
      mbar::wait(done_bar(), 0);
      finish_consumers(*static_cast<volatile unsigned int*>(bad_flag()) != 0);
    }
  }
};

}  // namespace cuda
}  // namespace sparsepage
