// The warp-specialized MLA kernel over the engines' 656-byte FP8 rows
// (KvFormat::kE4m3Mla, sparsepage/fp8.h): the consumers of mla_ws_partial.cuh
// (bf16 tiles in the same shared layout), with two producer warpgroups that
// copy the rows as they are stored and dequantize them in shared memory.
//
// There is no room beside Q and the two bf16 stages for a separate FP8
// staging buffer, so each tile's e4m3 bytes land inside its own stage and
// are converted in place. The 512 latent bytes of a row form eight blocks of
// 64 (one per output slab s, columns 64 s .. 64 s + 63); block s of all 64
// rows (4 KB, "R(s)") is copied to half s % 2 of the area of slab 4 + s / 2.
// The producers then convert:
//   slabs 0-3   from R(0)-R(3) (all four loaded into registers first), written
//               outside the raw area;
//   a producer barrier: R(0)-R(3) are read;
//   slabs 4-7   R(4)-R(7) loaded into registers; slabs 4 and 5 (over R(0)-R(3))
//               written; a second barrier; slabs 6 and 7 (over R(4)-R(7)).
// The four fp32 scales of each row go to a small ring beside the stages,
// the 64 bf16 rope values straight into slab 8 as in the bf16 kernel.
//
// Producer order per tile u (tiles 0 and 1 are copied up front, both stages
// being free): wait for the stage (`empty`), copy the raw rows, wait for
// them, convert, fence the stores for the tensor cores (async proxy), arrive
// on `full`. A tile's copy and conversion run while the consumers compute
// the tile before it.
//
// The CTA has 512 threads: 256 consumers, 256 producers. The launch gives
// 128 registers per thread; setmaxnreg moves them to 208 per consumer and 48
// per producer (ptxas reports no spills). At 128 ptxas cannot compile
// m64n256k16 (it asks for 154), so this CTA runs P V as two m64n128k16 per
// k-step (MlaWsFp8Tile::kPvHalves).
//
// It replaced an FP8 kernel in which each thread dequantized a row's
// quarter from registers after P V. Measured and rejected on the way (the
// figures are in docs/PERFORMANCE.md, "Tried and rejected"): one producer
// warpgroup (216 / 72 registers), an L2 prefetch of the next tile's rows,
// and copies split in two halves (the first converted while the second
// lands). Loading four blocks before any store beat two and one.
#pragma once

#include "cuda/attention/mla/mla_ws_partial.cuh"
#include "cuda/primitives/fp8_convert.cuh"
#include "sparsepage/fp8.h"

namespace sparsepage {
namespace cuda {

/// The threads of an FP8 warp-specialized CTA (this file's, and the CTA
/// pairs' of mla_ws_fp8_pair.cuh), over a bf16 kernel's shared layout
/// (Layout: MlaWsTile, S split by tokens, here: its 2 KB scale ring and
/// the column split's 8 KB exchange would need 234064 bytes, over the
/// 232448 of one SM; MlaWsColumnTile for the pairs, which have no ring):
/// two producer warpgroups, so the conversion has twice the threads. The
/// launch gives 128 registers per thread (65536 / 512); setmaxnreg moves them
/// to the consumers: 2 x 208 + 2 x 48 = 4 x 128. At 128 launch registers
/// ptxas cannot compile m64n256k16, so P V runs as two m64n128k16 (kPvHalves).
template <class Layout>
struct MlaWsFp8Threads : Layout {
  static constexpr int kThreads = 512;
  static constexpr int kProducerThreads = 256;
  static constexpr int kConsumerRegs = 208;
  static constexpr int kProducerRegs = 48;
  static constexpr bool kPvHalves = true;
};

/// The one-CTA FP8 kernel's shared memory: the token split's, then a ring
/// of the rows' block scales for the two stages.
struct MlaWsFp8Smem {
  MlaWsSmemHead head;
  float maxima[2][2][MlaTile::kHeads];  // [tile parity][warpgroup][head]
  float4 scales[2][MlaTile::kTokens];   // [stage][row]: the row's 4 fp32 block scales
};

struct MlaWsFp8Tile : MlaWsFp8Threads<MlaWsTile> {
  using L = MlaTile;
  using Smem = MlaWsFp8Smem;
  static constexpr int kRowsPerThread = L::kTokens / (kProducerThreads / 8);  // 2
  static constexpr int kRawBlockBytes = 64 * 64;                              // R(s): 64 rows x 64 e4m3 bytes
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "one CTA per SM on sm_90");
  static_assert(2 * kRawBlockBytes == L::kSlabBytes, "two raw blocks per slab area");

  /// Where R(s) starts within a stage (the raw bytes over slabs 4-7's area).
  __device__ static constexpr uint32_t raw_block(int s) {
    return static_cast<uint32_t>((4 + s / 2) * L::kSlabBytes + (s % 2) * kRawBlockBytes);
  }
};

/// What the FP8 warp-specialized CTAs (this file's, and the CTA pairs of
/// mla_ws_fp8_pair.cuh) add to the bf16 consumers: the request's rows as
/// bytes, the producer thread's index, and the page-id prefetch.
template <class Source, class W>
struct MlaWsFp8CtaBase : MlaWsCta<__nv_bfloat16, Source, W> {
  using Base = MlaWsCta<__nv_bfloat16, Source, W>;
  using L = MlaTile;
  using Params = typename Source::Params;
  using KernelParams = Fp8Params<Params>;  // what mla_partial_kernel takes

  const unsigned char* k8;  // this request's rows (bytes)
  int pt;                   // producer thread, 0 .. W::kProducerThreads - 1

  __device__ MlaWsFp8CtaBase(const Fp8Params<Params>& params, unsigned char* smem) : Base(params, smem) {
    pt = this->tid - W::kConsumerThreads;
    const int64_t seq = this->request / params.num_kv_heads, head = this->request % params.num_kv_heads;
    k8 = static_cast<const unsigned char*>(params.k) + seq * params.k_seq + head * params.k_head;
  }

  __device__ void prefetch_ids(int tile) {
    this->src.prefetch(this->id_slot(tile), this->tok_begin + tile * L::kTokens, this->tile_tokens(tile), pt);
  }

  /// The producer's start: the first two tiles' ids, landed for this thread.
  /// Returns the number of tiles.
  __device__ __forceinline__ int prefetch_first_ids() {
    const int tiles = this->num_tiles();
    for (int u = 0; u < 2 && u < tiles; ++u) prefetch_ids(u);
    cp_async_commit();
    cp_async_wait<0>();
    return tiles;
  }
};

template <class Source>
struct MlaWsFp8Cta : MlaWsFp8CtaBase<Source, MlaWsFp8Tile> {
  using Base = MlaWsFp8CtaBase<Source, MlaWsFp8Tile>;
  using L = MlaTile;
  using W = MlaWsFp8Tile;
  using Params = typename Source::Params;
  using Base::k8, Base::pt, Base::prefetch_ids;

  __device__ MlaWsFp8Cta(const Fp8Params<Params>& params, unsigned char* smem) : Base(params, smem) {}

  // Byte offsets of the plan's stages and scale ring (int, as the
  // conversion's address arithmetic is).
  static constexpr int kStages = static_cast<int>(offsetof(MlaWsFp8Smem, head.stage));
  static constexpr int kScales = static_cast<int>(offsetof(MlaWsFp8Smem, scales));
  static constexpr int kScaleStageBytes = static_cast<int>(sizeof(MlaWsFp8Smem::scales[0]));

  /// Shared address of the scales of tile `tile`'s stage, [64 rows] x 4 fp32.
  __device__ uint32_t scales(int tile) const { return this->base + kScales + (tile & 1) * kScaleStageBytes; }

  /// Copies tile `tile`'s rows as stored: producer thread t takes 16-byte
  /// piece t % 8 of each 128-byte line of rows t / 8 + 32 i (i < 2), i.e.
  /// latent pieces t % 8 + 8 j (j < 4), rope piece t % 8, and the scales
  /// with t % 8 == 0. Tail, masked and rejected rows are zero-filled.
  __device__ void copy_tile(int tile) {
    const int32_t tok0 = this->tok_begin + tile * L::kTokens;
    const int32_t n = this->tile_tokens(tile);
    const int32_t* slot = this->id_slot(tile);
    const int piece = pt & 7;
    const uint32_t st = this->stage(tile), sc = scales(tile);
#pragma unroll 1
    for (int i = 0; i < W::kRowsPerThread; ++i) {
      const int row = pt / 8 + (W::kProducerThreads / 8) * i;
      const unsigned char* k_row = k8;
      const __nv_bfloat16* e_row = this->e_base;
      int fill = 0;
      if (row < n) {
        const int64_t r = this->src.row(slot, tok0, tok0 + row, this->p);
        this->bad |= r == kRejectedRow;  // a masked row (kMaskedRow) is just not read
        if (r >= 0) {
          fill = 16;
          k_row += r * this->p.k_stride;
          e_row += r * this->p.e_stride;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int lp = piece + 8 * j;  // latent piece: block lp / 4, position lp % 4
        cp_async_16_n(st + W::raw_block(lp / 4) + row * 64 + (lp % 4) * 16, k_row + lp * 16, fill);
      }
      cp_async_16_n(st + kMlaRopeSlab * L::kSlabBytes + row * 128 + ((piece ^ (row & 7)) << 4), e_row + piece * 8,
                    fill);
      if (piece == 0) cp_async_16_n(sc + row * 16, k_row + MlaFp8Row::kScaleOffset, fill);
    }
  }

  /// Raw piece (row, q) of block s: 16 e4m3 values and their scale.
  __device__ void load_piece(int tile, int s, int row, int q, uint4& raw, float& scale) const {
    raw = *reinterpret_cast<const uint4*>(this->gen + this->stage_offset(tile) + W::raw_block(s) + row * 64 + q * 16);
    scale =
        *reinterpret_cast<const float*>(this->gen + kScales + (tile & 1) * kScaleStageBytes + row * 16 + (s / 2) * 4);
  }

  /// The piece's 16 values, times the scale in fp32 and rounded to bf16, into chunks
  /// 2 q and 2 q + 1 of row `row` of slab s (the 128-byte swizzle).
  __device__ void store_piece(int tile, int s, int row, int q, const uint4& raw, float scale) const {
    unsigned char* row_ptr = this->gen + kStages + (tile & 1) * L::kTileBytes + s * L::kSlabBytes + row * 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint4*>(row_ptr + (((2 * q + h) ^ (row & 7)) << 4)) =
          e4m3x8_to_bf16_scaled(h == 0 ? raw.x : raw.z, h == 0 ? raw.y : raw.w, scale);
    }
  }

  /// Producer thread t converts piece (row t / 4, q = t % 4) of each block:
  /// a warp reads 512 contiguous raw bytes and writes eight rows of distinct
  /// swizzle, so neither side has bank conflicts. Blocks s0 .. s0 + kBlocks - 1
  /// are loaded before any is stored.
  template <int kBlocks>
  __device__ void load_blocks(int tile, int s0, uint4 (&raw)[kBlocks], float (&scale)[kBlocks]) const {
#pragma unroll
    for (int i = 0; i < kBlocks; ++i) load_piece(tile, s0 + i, pt / 4, pt % 4, raw[i], scale[i]);
  }
  template <int kBlocks>
  __device__ void store_blocks(int tile, int s0, const uint4 (&raw)[kBlocks], const float (&scale)[kBlocks], int first,
                               int count) const {
#pragma unroll
    for (int i = first; i < first + count; ++i) store_piece(tile, s0 + i, pt / 4, pt % 4, raw[i], scale[i]);
  }
  /// Dequantizes tile `tile` in its stage (the order in the file comment).
  __device__ void convert_tile(int tile) const {
    uint4 raw[4];
    float scale[4];
    load_blocks<4>(tile, 0, raw, scale);
    store_blocks<4>(tile, 0, raw, scale, 0, 4);
    this->producer_sync(MlaWsBarrier::kRawLowRead);
    load_blocks<4>(tile, 4, raw, scale);
    store_blocks<4>(tile, 4, raw, scale, 0, 2);
    this->producer_sync(MlaWsBarrier::kRawHighRead);
    store_blocks<4>(tile, 4, raw, scale, 2, 2);
    wgmma::fence_proxy_async();  // the stores, before the consumers' tensor cores read them
    mbar::arrive(this->full_bar(tile));
  }

  /// The CTA's work, for mla_partial_kernel: this producer beside the bf16 consumers.
  __device__ void run() {
    this->run_with([this] { run_producer(); });
  }

  __device__ void run_producer() {
    const int tiles = this->prefetch_first_ids();
    this->producer_sync(MlaWsBarrier::kFirstIdsVisible);
    // The ids are visible to the consumers through these (release) arrivals;
    // the converters' arrivals, after the same barrier, would publish them
    // too, but `full` counts as in the bf16 kernel.
    if (pt == 0)
      for (int u = 0; u < 2 && u < tiles; ++u) mbar::arrive(this->full_bar(u));
    // Both stages are free: tile 1's rows fly while tile 0 is converted.
    for (int u = 0; u < 2; ++u) {
      if (u < tiles) copy_tile(u);
      cp_async_commit();
    }
    if (tiles > 2) prefetch_ids(2);
    cp_async_commit();
    for (int u = 0; u < tiles; ++u) {
      if (u >= 2) {
        // The stage is free once the consumers released tile u - 2.
        mbar::wait(this->empty_bar(u), ((u >> 1) & 1) ^ 1);
        cp_async_wait<0>();  // the ids of tile u
        this->producer_sync(MlaWsBarrier::kTileIdsVisible);
        if (pt == 0) mbar::arrive(this->full_bar(u));
        copy_tile(u);
        cp_async_commit();
        // Slot (u + 1) % 4 held tile u - 3, which the consumers released.
        if (u + 1 < tiles) prefetch_ids(u + 1);
        cp_async_commit();
      }
      // Groups in flight: tile u's rows, tile 1's (u == 0 only), the next ids.
      if (u == 0)
        cp_async_wait<2>();
      else
        cp_async_wait<1>();
      this->producer_sync(MlaWsBarrier::kRowsLanded);
      convert_tile(u);
    }
    cp_async_wait<0>();
  }
};

}  // namespace cuda
}  // namespace sparsepage
