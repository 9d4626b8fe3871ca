// The MLA partial kernel: the split-KV partial (docs/DESIGN.md: the paged decode) for the DSA /
// DeepSeek MLA shape, 512 latent + 64 rope columns of K with V = the latent
// columns, and many query heads per KV head (128 for the full model, 16-64
// under tensor parallelism). One CTA computes 64 query heads of one work item
// with Hopper warpgroup MMAs, so each gathered row is read once per 64 heads
// (the mma.sync tile read it once per 16 heads and once per 128 V columns).
//
// CTA: 2 warpgroups (256 threads), one CTA per SM (225 KiB of shared memory).
//   Q tile      64 heads x 576 columns, loaded once.
//   K stages    2 x 64 tokens x 576 columns, cp.async double buffer: the
//               rows of tile t+1 are copied while tile t is computed.
//   P tile      64 heads x 64 tokens of softmax weights (bf16/f16).
// Per tile, warpgroup w (0, 1):
//   S_w = Q K[32w .. 32w+31]^T             36 x wgmma m64n32k16 (K-major both)
//   row max: each warpgroup's half, exchanged through shared memory, so both
//            hold the same running max and the same rescale decisions;
//   P_w = exp2(S_w - max) -> P tile columns 32w .. 32w+31;
//   O_w += P V[:, 256w .. 256w+255]         4 x wgmma m64n256k16 (V MN-major)
// and each warpgroup keeps its own partial row sums (same max, so the sums
// add at the end). O_w is 64 x 256 fp32 = 128 registers per thread.
//
// Shared tiles use the 128-byte swizzle: a tile is 9 slabs of 64 columns;
// in a slab, row r occupies bytes [128 r, 128 r + 128) with its 16-byte
// pieces permuted by piece ^ (r % 8). The same bytes serve as K (K-major for
// S) and V (MN-major for P V), since V is K's first 512 columns.
//
// Work items come from the plan (or the uniform split) exactly as in the
// mma.sync kernel: the grid is (items x head tiles), head tile fastest, so
// the CTAs sharing a work item's rows run together and the second reads them
// from L2.
#pragma once

#include "cuda/attention/gqa/decode_partial.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparsepage {
namespace cuda {

struct MlaTile {
  static constexpr int kHeads = 64;       // query heads per CTA: the wgmma M
  static constexpr int kTokens = 64;      // gathered rows per stage
  static constexpr int kThreads = 256;    // two warpgroups
  static constexpr int kLatent = 512;     // V = K's first 512 columns
  static constexpr int kRope = 64;        // the second K stream
  static constexpr int kCols = kLatent + kRope;
  static constexpr int kSlabs = kCols / 64;           // 128-byte column slabs per tile
  static constexpr int kPieces = kCols / 8;           // 16-byte pieces per row
  static constexpr int kSlabBytes = 64 * 128;         // one slab of 64 rows
  static constexpr int kTileBytes = kSlabs * kSlabBytes;
  static constexpr int kIdSlots = 3;                  // page ids run two tiles ahead of the math
  // Byte offsets from the 1024-aligned base (the swizzle repeats every 1024 B).
  static constexpr int kQ = 0;
  static constexpr int kStage0 = kQ + kTileBytes;
  static constexpr int kP = kStage0 + 2 * kTileBytes;
  static constexpr int kIds = kP + kHeads * 128;
  static constexpr int kExchange = kIds + kIdSlots * kIdSlotInts * 4;  // [2][64] floats
  static constexpr int kSkipFlags = kExchange + 2 * kHeads * 4;          // [2 stages][8 warps] bytes
  static constexpr int kBytes = kSkipFlags + 2 * 8;
  static constexpr size_t kSmemBytes = size_t{kBytes} + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 232448, "one CTA per SM on sm_90");
  static_assert(kTokens <= kIdSlotInts, "a tile's page ids fit a slot");
};

/// Byte offset of 16-byte piece `piece` (column 8 * piece) of `row` in a
/// swizzled 64-row tile.
__device__ __forceinline__ uint32_t mla_swizzle(int row, int piece) {
  return static_cast<uint32_t>((piece >> 3) * MlaTile::kSlabBytes + row * 128 + (((piece & 7) ^ (row & 7)) << 4));
}

/// Both MLA kernels: the Q rows of a CTA's heads (q, then q_extra as
/// columns 512..575) copied into the swizzled tile at `q_tile` by `threads`
/// threads (this one is `tid`); heads past the group are zero.
template <typename T>
__device__ __forceinline__ void mla_load_q(const PartialCommon& p, uint32_t q_tile, int32_t request, int32_t head0,
                                           int32_t heads, int tid, int threads) {
  using L = MlaTile;
  // This CTA's first head in q and q_extra (one division per CTA, not per piece).
  const T* q0 = static_cast<const T*>(p.q) + head_offset(p, p.q_seq, p.q_head, request, head0);
  const T* e0 = static_cast<const T*>(p.q_extra) + head_offset(p, p.qe_seq, p.qe_head, request, head0);
  for (int idx = tid; idx < L::kHeads * L::kPieces; idx += threads) {
    const int row = idx / L::kPieces, piece = idx % L::kPieces;
    const T* g = piece < L::kLatent / 8 ? q0 + row * p.q_head + piece * 8 : e0 + row * p.qe_head + (piece - 64) * 8;
    cp_async_16(q_tile + mla_swizzle(row, piece), row < heads ? g : p.q, row < heads);
  }
}

/// Both MLA kernels' epilogue for one thread: its two rows `wrow`, `wrow + 8`
/// of warpgroup `wg`'s 256 O columns (`acc`), divided by the rows' summed
/// softmax denominators `sum`, go to o (with lse) or, for a split request,
/// to the fp32 partial slot `partial`. Nothing seen: o = 0, lse = -inf; a
/// rejected page or a NaN input (`any_bad`, a NaN sum): NaN.
template <typename T>
__device__ __forceinline__ void mla_store_rows(const PartialCommon& p, const float (&acc)[128], const float (&m)[2],
                                               const float (&sum)[2], int wrow, int lane, int wg, int32_t request,
                                               int32_t partial, int32_t head0, int32_t heads, bool any_bad) {
  using Tr = ElemTraits<T>;
  T* o0 = static_cast<T*>(p.o) + head_offset(p, p.o_seq, p.o_head, request, head0);  // the CTA's first head
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = wrow + 8 * r;
    if (row >= heads) continue;
    const bool poison = any_bad || isnan(sum[r]);
    const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
    const int64_t out_row = int64_t{partial < 0 ? request : partial} * p.group_size + head0 + row;
    T* o_row = o0 + row * p.o_head;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = wg * 256 + j * 8 + 2 * (lane & 3);
      float v0 = acc[4 * j + 2 * r] * inv, v1 = acc[4 * j + 2 * r + 1] * inv;
      if (poison) v0 = v1 = nan_f32();
      if (partial < 0) {
        *reinterpret_cast<uint32_t*>(o_row + col) = Tr::pack2(v0, v1);
      } else {
        *reinterpret_cast<float2*>(p.partial_o + out_row * p.partial_dv + col) = make_float2(v0, v1);
      }
    }
    if (wg == 0 && (lane & 3) == 0) {
      const float lse = poison ? nan_f32() : sum[r] > 0.f ? (m[r] + log2f(sum[r])) * kLn2 : neg_inf_f32();
      if (partial < 0) {
        if (p.lse) p.lse[out_row] = lse;
      } else {
        p.partial_lse[out_row] = lse;
      }
    }
  }
}

/// What every MLA CTA holds of its launch and its work: the params and the
/// index source, the 1024-aligned shared memory (as a shared address and a
/// generic pointer), the thread's place, and the CTA's share of a work item
/// (request, tokens, partial slot, head tile, the rows' bases). The classic
/// CTA (MlaCta) and the warp-specialized ones (mla_ws_partial.cuh) are built
/// on it. The CTA's grid is (work items x head tiles), head tile fastest.
template <typename T, class Source>
struct MlaCtaShare {
  using L = MlaTile;
  using Params = typename Source::Params;

  const Params& p;
  Source src;
  uint32_t base;       // shared address of the aligned tile area
  unsigned char* gen;  // generic pointer to the same
  const T* k_base;
  const T* e_base;
  int tid, wg, wt, lane;
  int32_t request, tok_begin, len, partial, head0, heads;
  bool bad = false;    // this thread met a page id outside the pool

  __device__ MlaCtaShare(const Params& params, unsigned char* smem) : p(params) {
    const uint32_t raw = smem_u32(smem);
    const uint32_t aligned = (raw + 1023u) & ~1023u;
    base = aligned;
    gen = smem + (aligned - raw);
    tid = threadIdx.x;
    // Broadcast from lane 0 so that ptxas can prove the warpgroup index
    // warp-uniform: the wgmma descriptors built from it (each warpgroup's K
    // rows, its V columns) then live in uniform registers. Computed from tid
    // alone they took a 64-bit vector add and two R2UR moves before every
    // wgmma of S (nvdisasm), 252 of a consumer warp's 681 instructions per tile.
    wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    wt = tid % 128;
    lane = tid % 32;
    const int32_t head_tiles = (p.group_size + L::kHeads - 1) / L::kHeads;
    const int32_t item = static_cast<int32_t>(blockIdx.x) / head_tiles;
    head0 = static_cast<int32_t>(blockIdx.x) % head_tiles * L::kHeads;
    heads = min(L::kHeads, p.group_size - head0);
    const ItemShare<T> share = open_item<T>(p, item, src);
    request = share.request;
    tok_begin = share.tok_begin;
    len = share.len;
    partial = share.partial;
    k_base = share.k_base;
    e_base = share.e_base;
  }

  __device__ int32_t tile_tokens(int tile) const { return min(L::kTokens, len - tile * L::kTokens); }
};

template <typename T, class Source>
struct MlaCta : MlaCtaShare<T, Source> {
  using Tr = ElemTraits<T>;
  using L = MlaTile;

  using S = MlaCtaShare<T, Source>;
  using Params = typename S::Params;
  using KernelParams = Params;  // what mla_partial_kernel takes
  static constexpr int kThreads = L::kThreads;
  using S::p, S::src, S::base, S::gen, S::k_base, S::e_base, S::tid, S::wg, S::wt, S::lane;
  using S::request, S::tok_begin, S::len, S::partial, S::head0, S::heads, S::bad, S::tile_tokens;

  // Online-softmax state of this thread's two rows (warp-in-group * 16 +
  // lane / 4, and + 8), the same in both warpgroups.
  float m[2], l[2];
  float acc[128];      // O_w: rows as above, columns 256 wg + 8 j + 2 (lane % 4) + {0, 1}

  __device__ MlaCta(const Params& params, unsigned char* smem) : S(params, smem) {}

  __device__ int32_t* id_slot(int tile) const {
    return reinterpret_cast<int32_t*>(gen + L::kIds) + (tile % L::kIdSlots) * kIdSlotInts;
  }
  __device__ uint32_t stage(int tile) const { return base + L::kStage0 + (tile & 1) * L::kTileBytes; }

  __device__ void load_q() { mla_load_q<T>(p, base + L::kQ, request, head0, heads, tid, L::kThreads); }

  __device__ void prefetch_ids(int tile) {
    src.prefetch(id_slot(tile), tok_begin + tile * L::kTokens, tile_tokens(tile), tid);
  }

  /// Starts the copies of tile `tile`'s rows: thread t copies pieces
  /// t % 4 + 4 i (i < 18) of row t / 4, so four neighbouring threads read
  /// 64 contiguous bytes. Tail and rejected rows are zero-filled.
  __device__ void issue_tile(int tile) {
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    const int row = tid >> 2, q4 = tid & 3;
    const T* k_row = k_base;
    const T* e_row = e_base;
    int fill = 0;
    bool masked = false;
    if (row < tile_tokens(tile)) {
      const int64_t r = src.row(id_slot(tile), tok0, tok0 + row, p);
      bad |= r == kRejectedRow;  // a masked row (kMaskedRow) is just not read
      masked = r == kMaskedRow;
      if (r >= 0) {
        fill = 16;
        k_row += r * p.k_stride;
        e_row += r * p.e_stride;
      }
    }
    if constexpr (Source::kMaySkip) {
      // Per warp: whether its rows of the tile hold padding; softmax_pv reads
      // its warpgroup's four flags (after the next tile barrier) and looks the
      // ids up only for such tiles. Nothing of this runs without the padding mode.
      if (src.skip_minus_one) {
        const bool any = __any_sync(0xffffffffu, masked);
        if (lane == 0) gen[L::kSkipFlags + (tile & 1) * 8 + tid / 32] = any ? 1 : 0;
      }
    }
    const uint32_t dst = stage(tile) + row * 128;
#pragma unroll
    for (int i = 0; i < L::kPieces / 4; ++i) {
      const int piece = 4 * i + q4;
      const T* g = piece < L::kLatent / 8 ? k_row + piece * 8 : e_row + (piece - L::kLatent / 8) * 8;
      cp_async_16_n(dst + (piece >> 3) * L::kSlabBytes + (((piece & 7) ^ (row & 7)) << 4), g, fill);
    }
  }

  /// Issues S_w = Q K^T over this warpgroup's 32 tokens of the stage (the
  /// caller waits for it).
  __device__ void start_scores(uint32_t stage_addr, float (&s)[16]) const {
    const uint64_t qd = wgmma::desc_sw128(base + L::kQ, 16, 1024);
    const uint64_t kd = wgmma::desc_sw128(stage_addr + wg * 32 * 128, 16, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < L::kCols / 16; ++kk) {
      // k-step kk: slab kk / 4, 32 bytes per step inside the 128-byte row.
      const uint64_t off = static_cast<uint64_t>(((kk >> 2) * L::kSlabBytes + (kk & 3) * 32) >> 4);
      wgmma::mma_m64n32k16<T>(s, qd + off, kd + off, kk > 0);
    }
    wgmma::commit();
  }

  /// Softmax of this warpgroup's scores against the CTA-wide running max,
  /// P into shared memory, then O_w += P V.
  __device__ void softmax_pv(int tile, float (&s)[16]) {
    const int32_t n = tile_tokens(tile);
    const int32_t* slot = id_slot(tile);
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    const int wrow = (wt / 32) * 16 + lane / 4;  // rows wrow and wrow + 8
    float tmax[2] = {neg_inf_f32(), neg_inf_f32()};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int key = wg * 32 + (i / 4) * 8 + 2 * (lane & 3) + (i & 1);
      float x = s[i] * p.scale_log2;
      if constexpr (Source::kHasBias) {
        const float b = src.bias(slot, key);
        x = b == neg_inf_f32() ? b : x + b * kLog2e;
      }
      if (key >= n) x = neg_inf_f32();
      s[i] = x;
    }
    if constexpr (Source::kMaySkip) {
      // Padding ids: their rows were not read and weigh nothing. The flags of
      // this warpgroup's four warps (rows wg * 32 .. wg * 32 + 31), one word.
      if (src.skip_minus_one &&
          *reinterpret_cast<const uint32_t*>(gen + L::kSkipFlags + (tile & 1) * 8 + wg * 4) != 0u) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int key = wg * 32 + (i / 4) * 8 + 2 * (lane & 3) + (i & 1);
          if (key < n && src.skipped(slot, tok0, tok0 + key)) s[i] = neg_inf_f32();
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) tmax[(i >> 1) & 1] = fmaxf(tmax[(i >> 1) & 1], s[i]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    }
    float* xchg = reinterpret_cast<float*>(gen + L::kExchange);
    if ((lane & 3) == 0) xchg[wg * L::kHeads + wrow] = tmax[0], xchg[wg * L::kHeads + wrow + 8] = tmax[1];
    __syncthreads();
    tmax[0] = fmaxf(tmax[0], xchg[(1 - wg) * L::kHeads + wrow]);
    tmax[1] = fmaxf(tmax[1], xchg[(1 - wg) * L::kHeads + wrow + 8]);

    // Lazy rescale (online_softmax_rebase); the decision depends only on
    // values both warpgroups share, so they stay in step.
    float alpha[2], b[2];
    const bool rescale = online_softmax_rebase(tmax, m, l, alpha, b);
    uint32_t* ptile = reinterpret_cast<uint32_t*>(gen + L::kP);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = wg * 32 + j * 8 + 2 * (lane & 3);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = exp2_ftz(s[4 * j + 2 * h] - b[h]), p1 = exp2_ftz(s[4 * j + 2 * h + 1] - b[h]);
        l[h] += p0 + p1;
        const int row = wrow + 8 * h;
        ptile[(row * 128 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2) / 4] = Tr::pack2(p0, p1);
      }
    }
    if (rescale) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] *= alpha[(i >> 1) & 1];
    }
    wgmma::fence_proxy_async();
    __syncthreads();  // the P tile is complete

    const uint64_t pd = wgmma::desc_sw128(base + L::kP, 16, 1024);
    // V: MN-major, 64-column slabs 8192 B apart (leading), 8-token groups 1024 B apart (stride).
    const uint64_t vd = wgmma::desc_sw128(stage(tile) + wg * 4 * L::kSlabBytes, L::kSlabBytes, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < L::kTokens / 16; ++kk)
      wgmma::mma_m64n256k16<T>(acc, pd + static_cast<uint64_t>(kk * 2), vd + static_cast<uint64_t>(kk * 128), 1);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(acc);
  }

  __device__ void run() {
    m[0] = m[1] = neg_inf_f32();
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    const int num_tiles = (len + L::kTokens - 1) / L::kTokens;
    load_q();
    for (int t = 0; t < 2 && t < num_tiles; ++t) prefetch_ids(t);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (num_tiles > 0) issue_tile(0);
    cp_async_commit();
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<0>();
      wgmma::fence_proxy_async();
      __syncthreads();  // tile t (and the ids of t + 1) landed; the other stage is free
      float s[16];
      start_scores(stage(t), s);
      // The next tile's copies are issued while the tensor cores run S.
      if (t + 1 < num_tiles) issue_tile(t + 1);
      if (t + 2 < num_tiles) prefetch_ids(t + 2);
      cp_async_commit();
      wgmma::wait<0>();
      wgmma::pin(s);
      softmax_pv(t, s);
    }
    cp_async_wait<0>();
    finish();
  }

  /// Adds the two warpgroups' row sums and writes o / lse or the partial slot.
  __device__ void finish() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const int wrow = (wt / 32) * 16 + lane / 4;
    float* xchg = reinterpret_cast<float*>(gen + L::kExchange);
    __syncthreads();  // the last tile's max exchange is read
    if ((lane & 3) == 0) xchg[wg * L::kHeads + wrow] = l[0], xchg[wg * L::kHeads + wrow + 8] = l[1];
    const bool any_bad = __syncthreads_or(bad);
    float sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) sum[r] = xchg[wrow + 8 * r] + xchg[L::kHeads + wrow + 8 * r];
    mla_store_rows<T>(p, acc, m, sum, wrow, lane, wg, request, partial, head0, heads, any_bad);
    if (any_bad && tid == 0) report_rejected(p, request);
  }
};

/// The entry of every MLA kernel: one CTA of class Cta per head tile of a
/// work item, Cta::kThreads threads, one CTA per SM. Cta is MlaCta here, the
/// classic FP8 kernel's MlaFp8Cta (mla_fp8_partial.cuh), or a
/// warp-specialized CTA (mla_ws_partial.cuh, mla_ws_fp8_partial.cuh,
/// mla_ws_fp8_pair.cuh); Cta::KernelParams is what its launch passes, and
/// Cta::run() is the CTA's whole work.
template <class Cta>
__global__ void __launch_bounds__(Cta::kThreads, 1) mla_partial_kernel(const __grid_constant__ typename Cta::KernelParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait_primary();
  pdl_launch_dependents();
  Cta cta(params, smem);
  cta.run();
#else
  // wgmma exists on sm_90a only; the launchers refuse other GPUs first
  // (cuda_arch_problem), so this is never reached.
  __trap();
#endif
}

}  // namespace cuda
}  // namespace sparsepage
