// The FP8 MLA kernel for 128 query heads (two head tiles of one work item) as
// a pair of CTAs in one thread-block cluster: each CTA gathers and
// dequantizes half of every tile's rows and sends them into the other's
// stage, so each latent row is read from memory once per item instead of
// twice, and each CTA dequantizes 32 rows per tile instead of 64.
//
// Rows: the engines' 656-byte format (sparsepage/fp8.h: 512 e4m3 latent
// values, 4 fp32 scales, 64 bf16 rope values). The consumers and the shared
// layout are those of mla_ws_partial.cuh (Q, two bf16 stages); W sets
// kClusterCtas = 2, which makes the consumers release each refilled stage to
// the peer too (its `peer_empty`), and the CTAs meet the cluster once after
// the barriers are made.
//
// Producer thread t (256 per CTA, rank r of the pair), per tile u:
//   1. the ids of u have landed (they are fetched two tiles ahead): resolve
//      rows t / 8 and t / 8 + 32, and load 64 latent bytes (pieces t % 8 +
//      8 j, j < 4) and the 4 scales of own row 32 r + t / 8 into registers;
//   2. wait for the stage: `empty` (this CTA's consumers released u - 2)
//      and `peer_empty` (the peer's did);
//   3. copy the rope of both rows into slab 8 (cp.async: each CTA gathers
//      all 64 rope rows for itself, 8 KB); thread 0 arrives on `peer_full`
//      expecting the peer's 32 KB;
//   4. dequantize (the scale applied in fp32, one rounding to bf16) into
//      this CTA's stage; wait for the rope, fence the stores for the async
//      proxy, arrive on `full`;
//   5. a producer barrier; thread 0 sends the own rows of the 8 latent slabs
//      (4 KB contiguous each, swizzled alike in both CTAs) into the peer's
//      stage with the bulk-copy engine, which completes the peer's
//      `peer_full` bytes.
// The consumers wait on `full` and `peer_full`.
// Tail, masked and rejected rows are written as zeros, so every phase gets
// the same 32 KB from the peer. Both CTAs resolve all 64 ids, so both see a
// rejected one.
//
// Measured on the H200 (docs/PERFORMANCE.md, "FP8 KV caches"): faster than
// one CTA per head tile or level at every batch measured (1-8, 16-128), so
// decode_fp8.cu runs pairs wherever the device places them. Variants
// that lost: the rows sent with st.async (16 bytes per store, each completing
// the peer's barrier), 10% slower than one CTA per head tile; each warp
// converting and sending one slab (a lane per row), 8% slower. Loading the
// next tile's row before converting this one changed nothing.
//
// Used when a work item has exactly two head tiles (65 to 128 query heads)
// and the device places clusters of two of these CTAs; otherwise the
// one-CTA kernel (mla_ws_fp8_partial.cuh) runs.
#pragma once

#include "cuda/attention/mla/mla_ws_fp8_partial.cuh"
#include "cuda/primitives/fp8_convert.cuh"
#include "sparsepage/fp8.h"

namespace sparsepage {
namespace cuda {

struct MlaWsFp8PairTile : MlaWsFp8Threads<MlaWsColumnTile> {  // the bf16 kernel's shared layout, no scale ring
  using L = MlaTile;
  static constexpr int kClusterCtas = 2;
  static constexpr int kOwnRows = L::kTokens / kClusterCtas;  // rows each CTA dequantizes per tile
  static constexpr uint32_t kPeerBytes = kOwnRows * 512 * 2;  // their bf16 latent, sent to the peer
  static_assert(kProducerThreads == kOwnRows * 8, "eight producer threads per own row");
};

template <class Source>
struct MlaWsFp8PairCta : MlaWsFp8CtaBase<Source, MlaWsFp8PairTile> {
  using Base = MlaWsFp8CtaBase<Source, MlaWsFp8PairTile>;
  using L = MlaTile;
  using W = MlaWsFp8PairTile;
  using Params = typename Source::Params;
  using Base::k8, Base::pt, Base::prefetch_ids;

  uint32_t rank;  // in the pair: which 32 rows of a tile this CTA dequantizes

  __device__ MlaWsFp8PairCta(const Fp8Params<Params>& params, unsigned char* smem) : Base(params, smem) {
    rank = cluster::rank();
  }

  /// This thread's own row of tile `tile` in registers: 4 latent pieces and
  /// the row's 4 scales (zeros for a tail, masked or rejected row), and both
  /// rows' rope sources (`rope_fill` 0: zero-fill).
  struct Gathered {
    uint4 raw[4];
    float4 scale;
    const __nv_bfloat16* rope[2];
    int rope_fill[2];
  };

  __device__ void gather(int tile, Gathered& g) {
    const int32_t tok0 = this->tok_begin + tile * L::kTokens;
    const int32_t n = this->tile_tokens(tile);
    const int32_t* slot = this->id_slot(tile);
    const int piece = pt & 7;
    // Both rows first: the engines' block tables may divide by the block
    // size, which wants registers the loaded row would hold.
    int64_t r[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = pt / 8 + W::kOwnRows * i;
      r[i] = kMaskedRow;
      if (row < n) {
        r[i] = this->src.row(slot, tok0, tok0 + row, this->p);
        this->bad |= r[i] == kRejectedRow;  // a masked row (kMaskedRow) is just not read
      }
      g.rope[i] = this->e_base + (r[i] >= 0 ? r[i] * this->p.e_stride : 0) + piece * 8;
      g.rope_fill[i] = r[i] >= 0 ? 16 : 0;
    }
    const int64_t own = rank == 0 ? r[0] : r[1];
    const unsigned char* k_row = k8 + (own >= 0 ? own * this->p.k_stride : 0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      g.raw[j] =
          own >= 0 ? __ldg(reinterpret_cast<const uint4*>(k_row + (piece + 8 * j) * 16)) : make_uint4(0, 0, 0, 0);
    g.scale = own >= 0 ? __ldg(reinterpret_cast<const float4*>(k_row + MlaFp8Row::kScaleOffset))
                       : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  /// Rope of both rows into slab 8 of the stage (the 128-byte swizzle).
  __device__ void copy_rope(int tile, const Gathered& g) const {
    const uint32_t st = this->stage(tile);
    const int piece = pt & 7;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = pt / 8 + W::kOwnRows * i;
      cp_async_16_n(st + kMlaRopeSlab * L::kSlabBytes + row * 128 + ((piece ^ (row & 7)) << 4), g.rope[i],
                    g.rope_fill[i]);
    }
  }

  /// Piece t % 8 + 8 j of the own row (16 values, scale group j) into chunks
  /// 2 q and 2 q + 1 (q = t % 4) of slab t % 8 / 4 + 2 j of this CTA's stage.
  __device__ void convert_tile(int tile, const Gathered& g) const {
    const int piece = pt & 7;
    const int row = static_cast<int>(rank) * W::kOwnRows + pt / 8;
    const uint32_t row_off = this->stage_offset(tile) + static_cast<uint32_t>(row * 128);
    const float scales[4] = {g.scale.x, g.scale.y, g.scale.z, g.scale.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t slab_off = row_off + static_cast<uint32_t>((piece / 4 + 2 * j) * L::kSlabBytes);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v =
            e4m3x8_to_bf16_scaled(h == 0 ? g.raw[j].x : g.raw[j].z, h == 0 ? g.raw[j].y : g.raw[j].w, scales[j]);
        *reinterpret_cast<uint4*>(this->gen + slab_off + ((((piece & 3) * 2 + h) ^ (row & 7)) << 4)) = v;
      }
    }
  }

  /// The own rows of the 8 latent slabs (4 KB contiguous each: 32 rows of
  /// 128 bytes, swizzled alike in both CTAs) into the peer's stage by the
  /// bulk-copy engine, completing the peer's `peer_full` bytes. One thread.
  __device__ void share_tile(int tile) const {
    const uint32_t peer = rank ^ 1u;
    const uint32_t peer_full = cluster::map(this->peer_full_bar(tile), peer);
    const uint32_t own = this->stage(tile) + rank * W::kOwnRows * 128;
    const uint32_t peer_own = cluster::map(own, peer);  // the peer's window is contiguous
#pragma unroll
    for (int s = 0; s < kMlaRopeSlab; ++s)
      cluster::copy_bulk(peer_own + s * L::kSlabBytes, own + s * L::kSlabBytes, W::kOwnRows * 128, peer_full);
    cluster::bulk_commit();
  }

  /// The CTA's work, for mla_partial_kernel: this producer beside the bf16 consumers.
  __device__ void run() {
    this->run_with([this] { run_producer(); });
  }

  __device__ void run_producer() {
    const int tiles = this->prefetch_first_ids();
#pragma unroll 1
    for (int u = 0; u < tiles; ++u) {
      // Groups in flight here: the rope of u - 1 and the ids of u + 1; the
      // ids of u (two tiles ago) have landed.
      if (u > 0) cp_async_wait<1>();
      this->producer_sync(MlaWsBarrier::kTileIdsVisible);
      Gathered g;
      gather(u, g);
      // The stage is free once both CTAs' consumers released tile u - 2
      // (this one's own stage, and the peer's, which the bulk copy fills).
      if (u >= 2) {
        mbar::wait(this->peer_empty_bar(u), ((u >> 1) & 1) ^ 1);
        mbar::wait(this->empty_bar(u), ((u >> 1) & 1) ^ 1);
      }
      copy_rope(u, g);
      cp_async_commit();
      if (pt == 0) {
        mbar::arrive(this->full_bar(u));  // publishes the ids (visible since the barrier above)
        mbar::arrive_expect_tx(this->peer_full_bar(u), W::kPeerBytes);
      }
      // Slot (u + 2) % 4 held tile u - 2, which both CTAs' consumers released.
      if (u + 2 < tiles) prefetch_ids(u + 2);
      cp_async_commit();
      convert_tile(u, g);
      cp_async_wait<1>();          // this thread's rope copies of tile u
      wgmma::fence_proxy_async();  // the stores and copies, before the tensor cores and the bulk copies read them
      mbar::arrive(this->full_bar(u));
      this->producer_sync(MlaWsBarrier::kOwnRowsConverted);
      if (pt == 0) share_tile(u);
    }
    cp_async_wait<0>();
    if (pt == 0) cluster::bulk_wait_read();  // the copies read this CTA's shared memory: it must outlive them
  }
};

}  // namespace cuda
}  // namespace sparsepage
