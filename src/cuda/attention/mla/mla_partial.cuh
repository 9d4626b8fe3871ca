// What every MLA partial kernel shares (the split-KV partial, docs/DESIGN.md:
// the paged decode, at the DSA / DeepSeek MLA shape): 512 latent + 64 rope
// columns of K with V = the latent columns, and many query heads per KV head
// (128 for the full model, 16-64 under tensor parallelism). One CTA computes
// 64 query heads of one work item with Hopper warpgroup MMAs, so each
// gathered row is read once per 64 heads. The kernels themselves are the
// warp-specialized CTAs (mla_ws_partial.cuh, mla_ws_fp8_partial.cuh,
// mla_ws_fp8_pair.cuh); this file holds their geometry, the 128-byte
// swizzle of their shared tiles, the Q load, the epilogue, the CTA's share
// of its work item and the kernel entry.
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
  static constexpr int kHeads = 64;    // query heads per CTA: the wgmma M
  static constexpr int kTokens = 64;   // gathered rows per stage
  static constexpr int kLatent = 512;  // V = K's first 512 columns
  static constexpr int kRope = 64;     // the second K stream
  static constexpr int kCols = kLatent + kRope;
  static constexpr int kSlabs = kCols / 64;    // 128-byte column slabs per tile
  static constexpr int kPieces = kCols / 8;    // 16-byte pieces per row
  static constexpr int kSlabBytes = 64 * 128;  // one slab of 64 rows
  static constexpr int kTileBytes = kSlabs * kSlabBytes;
  static_assert(kTokens <= kIdSlotInts, "a tile's page ids fit a slot");
};

/// Byte offset of 16-byte piece `piece` (column 8 * piece) of `row` in a
/// swizzled 64-row tile.
__device__ __forceinline__ uint32_t mla_swizzle(int row, int piece) {
  return static_cast<uint32_t>((piece >> 3) * MlaTile::kSlabBytes + row * 128 + (((piece & 7) ^ (row & 7)) << 4));
}

/// Every MLA CTA: the Q rows of a CTA's heads (q, then q_extra as
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

/// Every MLA CTA's epilogue for one thread: its two rows `wrow`, `wrow + 8`
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
/// (request, tokens, partial slot, head tile, the rows' bases). The
/// warp-specialized CTAs (mla_ws_partial.cuh) are built on it. The CTA's
/// grid is (work items x head tiles), head tile fastest.
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
  bool bad = false;  // this thread met a page id outside the pool

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

/// The entry of every MLA kernel: one CTA of class Cta per head tile of a
/// work item, Cta::kThreads threads, one CTA per SM. Cta is a
/// warp-specialized CTA (mla_ws_partial.cuh, mla_ws_fp8_partial.cuh,
/// mla_ws_fp8_pair.cuh); Cta::KernelParams is what its launch passes, and
/// Cta::run() is the CTA's whole work.
template <class Cta>
__global__ void __launch_bounds__(Cta::kThreads, 1)
    mla_partial_kernel(const __grid_constant__ typename Cta::KernelParams params) {
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
