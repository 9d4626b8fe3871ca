// The bf16 MLA kernel for 128 query heads (two head tiles of one work item)
// as a pair of CTAs in one thread-block cluster: each CTA gathers the latent
// half of 32 of every tile's 64 rows and sends them into the other's stage,
// so each CTA's producer issues 20 copies per thread and tile instead of 36.
// The consumers and the shared layout are the bf16 kernel's
// (mla_ws_partial.cuh, S split by columns); W sets kClusterCtas = 2, which
// makes the consumers wait for the peer's rows (`peer_full`) and release
// each refilled stage to the peer too (its `peer_empty`).
//
// Producer thread t (128 per CTA, rank r of the pair), per tile u:
//   1. the ids of u have landed (fetched two tiles ahead): resolve rows
//      t / 8 + 16 i (i < 4), as the one-CTA producer does;
//   2. wait for the stage: `empty` (this CTA's consumers released u - 2)
//      and `peer_empty` (the peer's did);
//   3. copy the latent of the own rows (32 r .. 32 r + 31: i = 2 r, 2 r + 1)
//      and the rope of all four rows into the stage (cp.async; each CTA
//      gathers all 64 rope rows for itself, 8 KB), arriving on `full` when
//      they land; thread 0 arrives on `peer_full` expecting the peer's 32 KB;
//   4. wait for its own copies, fence them for the async proxy, a producer
//      barrier; thread 0 sends the own rows of the 8 latent slabs (4 KB
//      contiguous each, swizzled alike in both CTAs) into the peer's stage
//      with the bulk-copy engine, which completes the peer's `peer_full`.
// Tail, masked and rejected rows are zero-filled, so every phase gets the
// same 32 KB from the peer. Both CTAs resolve all 64 ids, so both see a
// rejected one.
#pragma once

#include "cuda/mla_ws_partial.cuh"

namespace sparsepage {
namespace cuda {

struct MlaWsPairTile : MlaWsColumnTile {
  using L = MlaTile;
  static constexpr int kClusterCtas = 2;
  static constexpr int kOwnRows = L::kTokens / kClusterCtas;          // latent rows each CTA gathers per tile
  static constexpr uint32_t kPeerBytes = kOwnRows * L::kLatent * 2;   // their latent, sent to the peer
  static_assert(kRowsPerThread == 4 && kProducerThreads == 128, "rows t / 8 + 16 i: i = 2 r, 2 r + 1 are rank r's");
};

/// Sends the own rows (32 rank .. 32 rank + 31) of the 8 latent slabs of
/// the stage at `stage` (this CTA's shared address) to the same place in
/// the peer's stage, completing `bytes` on the peer's barrier at `peer_full`
/// (this CTA's address of it). One thread; the CTAs' windows are alike.
__device__ __forceinline__ void mla_share_own_rows(uint32_t stage, uint32_t peer_full, uint32_t rank, int own_rows) {
  const uint32_t peer = rank ^ 1u;
  const uint32_t bar = cluster::map(peer_full, peer);
  const uint32_t own = stage + rank * static_cast<uint32_t>(own_rows) * 128;
  const uint32_t peer_own = cluster::map(own, peer);
#pragma unroll
  for (int s = 0; s < MlaTile::kSlabs - 1; ++s)
    cluster::copy_bulk(peer_own + s * MlaTile::kSlabBytes, own + s * MlaTile::kSlabBytes, own_rows * 128, bar);
  cluster::bulk_commit();
}

template <typename T, class Source>
struct MlaWsPairCta : MlaWsCta<T, Source, MlaWsPairTile> {
  using Base = MlaWsCta<T, Source, MlaWsPairTile>;
  using W = MlaWsPairTile;
  using L = MlaTile;
  using Params = typename Base::Params;
  using KernelParams = Params;
  using typename Base::TileRows;
  using Base::wt;

  uint32_t rank;  // in the pair: which 32 latent rows of a tile this CTA gathers

  __device__ MlaWsPairCta(const Params& params, unsigned char* smem) : Base(params, smem) { rank = cluster::rank(); }

  /// The own rows' latent and all four rows' rope of tile `tile` into its
  /// stage; this thread arrives on `full` when they land.
  __device__ void copy_tile(int tile, const TileRows& rows) const {
    const int piece = wt & 7;
    const uint32_t dst0 = this->stage(tile);
#pragma unroll
    for (int i = 0; i < W::kRowsPerThread; ++i) {
      const int row = wt / 8 + 16 * i;
      const int64_t r = rows.row[i];
      const int fill = r >= 0 ? 16 : 0;
      const T* k_row = this->k_base + (r >= 0 ? r * this->p.k_stride : 0) + piece * 8;
      const T* e_row = this->e_base + (r >= 0 ? r * this->p.e_stride : 0) + piece * 8;
      const uint32_t dst = dst0 + row * 128 + ((piece ^ (row & 7)) << 4);
      if (static_cast<uint32_t>(i >> 1) == rank) {
#pragma unroll
        for (int s = 0; s < L::kSlabs - 1; ++s) cp_async_16_latent(dst + s * L::kSlabBytes, k_row + s * 64, fill);
      }
      cp_async_16_n(dst + (L::kSlabs - 1) * L::kSlabBytes, e_row, fill);
    }
    mbar::arrive_on_copies(this->full_bar(tile));
  }

  /// Commit groups in order: ids 0, ids 1, rows 0, ids 2, rows 1, ids 3,
  /// ...; each tile's rows are waited for in its own trip (they are sent on),
  /// so at the top of trip u only ids u + 1 may still be in flight.
  __device__ void run_producer() {
    const int tiles = this->num_tiles();
    for (int u = 0; u < 2; ++u) {
      if (u < tiles) this->src.prefetch(this->id_slot(u), this->tok_begin + u * L::kTokens, this->tile_tokens(u), wt);
      cp_async_commit();
    }
    for (int u = 0; u < tiles; ++u) {
      cp_async_wait<1>();
      named_barrier(W::kProducerBar, W::kProducerThreads);  // every thread's ids of tile u are visible
      TileRows rows;
      this->resolve_tile(u, rows);
      // Both CTAs' consumers must have released tile u - 2: this CTA's stage,
      // and the peer's, which the bulk copy fills.
      if (u >= 2) {
        mbar::wait(this->peer_empty_bar(u), ((u >> 1) & 1) ^ 1);
        mbar::wait(this->empty_bar(u), ((u >> 1) & 1) ^ 1);
      }
      if (wt == 0) {
        mbar::arrive(this->full_bar(u));  // publishes the ids (visible since the barrier above)
        mbar::arrive_expect_tx(this->peer_full_bar(u), W::kPeerBytes);
      }
      copy_tile(u, rows);
      cp_async_commit();
      // Slot (u + 2) % 4 held tile u - 2, which both CTAs' consumers released.
      if (u + 2 < tiles)
        this->src.prefetch(this->id_slot(u + 2), this->tok_begin + (u + 2) * L::kTokens, this->tile_tokens(u + 2), wt);
      cp_async_commit();
      cp_async_wait<1>();          // this thread's rows of tile u
      wgmma::fence_proxy_async();  // the copies (generic proxy), before the bulk copy reads them
      named_barrier(W::kProducerBar, W::kProducerThreads);  // every own row of tile u has landed
      if (wt == 0) mla_share_own_rows(this->stage(u), this->peer_full_bar(u), rank, W::kOwnRows);
    }
    cp_async_wait<0>();
    if (wt == 0) cluster::bulk_wait_read();  // the copies read this CTA's shared memory: it must outlive them
  }

  /// The CTA's work, for mla_partial_kernel: this producer beside the bf16 consumers.
  __device__ void run() {
    this->run_with([this] { run_producer(); });
  }
};

}  // namespace cuda
}  // namespace sparsepage
