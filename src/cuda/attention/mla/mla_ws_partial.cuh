// The warp-specialized MLA partial kernel (64 query heads per CTA, 512
// latent + 64 rope columns, V = the latent columns; the shared pieces are in
// mla_partial.cuh): the gathered rows are copied by a warpgroup of their
// own, and the loop has no CTA-wide barrier.
//
// CTA: 3 warpgroups (384 threads), one CTA per SM.
//   warpgroups 0, 1  consumers: S, softmax and P V. The bf16 kernel and
//                    the FP8 CTA pairs (MlaWsColumnTile) split S by columns
//                    (288 of the 576 each, over all 64 tokens) and hand
//                    partial sums over; the one-CTA FP8 kernel splits S by
//                    tokens (32 of the 64 each, over all columns). Each
//                    warpgroup runs the softmax of 32 tokens, and P V
//                    over 256 of the 512 V columns.
//                    232 registers each (setmaxnreg), for the 128 fp32
//                    accumulators of O.
//   warpgroup 2      producer: 40 registers. Eight neighbouring threads copy
//                    one 128-byte slab row (a full line), so a warp's copy
//                    instruction touches 4 rows, not 8. After a tile's copies
//                    each thread arrives on the stage's `full` mbarrier when
//                    its copies land (cp.async.mbarrier.arrive.noinc).
// Stages: two 64-row tiles. `full[s]` completes when the rows and the page
// ids of the tile in stage s are in shared memory;
// `empty[s]` when the eight consumer warps no longer read it. The P tile of a
// tile is written over the stage's rope slab (S has consumed it by then), so
// Q + two stages still fit one SM.
//
// Consumer order per tile t:
//   wait `full` of t, S(t) (split by columns: the partial sums handed over
//   at a 256-thread named barrier); softmax: row maxima exchanged between
//   the two warpgroups at a second named barrier, P into the stage; P V(t)
//   (the own tokens' k-steps with P from registers first), a third
//   named barrier for the other warpgroup's P, the rest of P V(t); release
//   stage t (the producer starts tile t + 2 into it).
// The producer's copies of tile t + 1 run during all of tile t's math. It
// resolves a tile's rows from their page ids (fetched two tiles ahead)
// before it waits for the stage, so the copies go out once the stage is free.
//
// The end: the producer sets a shared flag if it met a rejected id and
// arrives on a `done` mbarrier; the consumers wait on it, then write o / lse
// (poisoned for such a request). No barrier of the whole CTA is met from the
// two branches.
//
// MlaWsCta is templated on the CTA's shape W: MlaWsColumnTile (the bf16
// kernel), MlaWsTile (the token split), or an FP8 kernel's over either
// (mla_ws_fp8_partial.cuh: two producer warpgroups, 512 threads, its own
// producer), which reuses the consumers and run().
#pragma once

#include <cstddef>

#include "cuda/attention/gqa/decode_partial.cuh"
#include "cuda/attention/mla/mla_partial.cuh"
#include "cuda/primitives/cluster.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparsepage {
namespace cuda {

/// A 64-row tile of 576 columns in the 128-byte swizzle (mla_swizzle): 9
/// slabs of 64 columns, each 64 rows x 128 bytes. Q, and each stage of
/// gathered rows (K and V at once).
struct MlaSwizzledTile {
  unsigned char slab[MlaTile::kSlabs][MlaTile::kSlabBytes];
};
/// The rope slab (columns 512-575) of a stage: after S, the stage's P tile
/// (and, with S split by columns, warpgroup 1's partial scores before it).
constexpr int kMlaRopeSlab = MlaTile::kSlabs - 1;
constexpr int kMlaWsIdSlots = 4;  // ids of tile u + 2 are written once tile u - 2 is released

/// What every warp-specialized MLA CTA keeps in shared memory, from its
/// 1024-aligned base (the swizzle repeats every 1024 bytes).
struct MlaWsSmemHead {
  MlaSwizzledTile q;
  MlaSwizzledTile stage[2];
  int32_t ids[kMlaWsIdSlots][kIdSlotInts];  // page ids, a ring of tiles
  uint64_t full[2];                         // per stage: its rows (and ids) landed
  uint64_t empty[2];                        // per stage: the consumers no longer read it
  uint64_t done;                            // every producer thread is done (the flag below is set)
  uint64_t peer_empty[2];                   // CTA pairs: the peer's consumers released the stage
  uint64_t peer_full[2];                    // CTA pairs: the peer's rows of the stage landed
  uint32_t bad_flag;                        // a producer met a rejected page id
};
static_assert(offsetof(MlaWsSmemHead, q) % 1024 == 0 && offsetof(MlaWsSmemHead, stage) % 1024 == 0 &&
                  sizeof(MlaSwizzledTile) % 1024 == 0,
              "swizzled tiles start on the swizzle's 1024-byte period");
static_assert(offsetof(MlaWsSmemHead, full) % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(MlaTile::kHeads * 128 == MlaTile::kSlabBytes, "a P tile is one slab");

/// S split by tokens (MlaWsTile): the row maxima's exchange by tile parity.
struct MlaWsTokenSmem {
  MlaWsSmemHead head;
  float maxima[2][2][MlaTile::kHeads];  // [tile parity][warpgroup][head]
};
/// S split by columns (MlaWsColumnTile): one maxima slot (the row sums reuse
/// it at the end), then warpgroup 0's partial scores of warpgroup 1's
/// tokens (64 heads x 32 tokens).
struct MlaWsColumnSmem {
  MlaWsSmemHead head;
  float maxima[1][2][MlaTile::kHeads];
  float4 wg0_scores[4][4][32];  // [warp][n8 tile][lane]
};
static_assert(offsetof(MlaWsTokenSmem, maxima) % 16 == 0 && offsetof(MlaWsColumnSmem, maxima) % 16 == 0,
              "the exchange starts 16-byte aligned");
static_assert(sizeof(MlaWsColumnSmem::wg0_scores) <= MlaTile::kSlabBytes, "warpgroup 1's half fits the rope slab");
static_assert(sizeof(MlaWsColumnSmem::maxima) >= 2 * MlaTile::kHeads * sizeof(float),
              "the row sums fit the maxima's slot");

struct MlaWsTile {
  using L = MlaTile;
  using Smem = MlaWsTokenSmem;
  static constexpr int kThreads = 384;  // two consumer warpgroups + one producer warpgroup
  static constexpr int kConsumerThreads = 256;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerRegs = 232;  // 2 x 232 + 40 = 3 x 168, all that 384 threads get
  static constexpr int kProducerRegs = 40;
  static constexpr bool kPvHalves = false;  // P V as one m64n256k16 per k-step
  static constexpr int kClusterCtas = 1;    // 2: the FP8 pair kernel (mla_ws_fp8_pair.cuh) shares stages
  static constexpr int kRowsPerThread = L::kTokens / (kProducerThreads / 8);  // 4
  static constexpr int kMaxSlots = 2;                                         // row maxima slots, by tile parity
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;                   // + the alignment slack
  static_assert(kSmemBytes <= 232448, "one CTA per SM on sm_90");
  // S split by tokens: each consumer warpgroup scores 32 of the tile's 64
  // tokens over all 576 columns (m64n32k16), so each reads all of Q.
  static constexpr bool kScoresByColumns = false;
};

/// The bf16 kernel's CTA (and the FP8 CTA pairs' shared layout): the same
/// threads and stages, but S split by columns. Warpgroup 0 scores all 64
/// tokens over columns 0-287, warpgroup 1 over 288-575 (m64n64k16, 18
/// k-steps each), so Q is read once per tile
/// rather than twice: 144 KB of S's shared-memory reads per tile instead of
/// 216 KB. Each then needs the other's partial sums of the 32 tokens whose
/// softmax it computes (warpgroup w: tokens 32 w .. 32 w + 31): warpgroup 1
/// hands its half over in the stage's rope slab (only its own k-steps read
/// that slab), warpgroup 0 in an 8 KB buffer of its own. That buffer fits
/// beside Q and the two stages because the row maxima are exchanged in one
/// slot, not two (see MlaWsCta::softmax).
struct MlaWsColumnTile : MlaWsTile {
  using Smem = MlaWsColumnSmem;
  static constexpr bool kScoresByColumns = true;
  static constexpr int kMaxSlots = 1;
  static constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
  static_assert(kSmemBytes <= 232448, "one CTA per SM on sm_90");
};

/// The named barriers of the warp-specialized MLA CTAs, one id per sync
/// point (0 is __syncthreads; sm_90 has 16). The consumer ones count the two
/// consumer warpgroups, the producer ones the producer warpgroup(s).
enum class MlaWsBarrier : int {
  // consumers
  kQLanded = 1,    // Q is in shared memory
  kScoresSwapped,  // S split by columns: both halves of the partial sums handed over
  kMaximaSwapped,  // the row maxima exchanged; both S(t) done, so the rope slab is free
  kPComplete,      // the other warpgroup's P is in the P tile
  kMaximaRead,     // the end: the last maxima are read, so the row sums may go over them
  kSumsWritten,    // the end: both warpgroups' row sums are written
  // producers
  kFirstIdsVisible,   // FP8 one CTA: the ids of tiles 0 and 1
  kTileIdsVisible,    // every producer thread's ids of tile u
  kRowsLanded,        // FP8 one CTA: every producer thread's raw rows of tile u
  kRawLowRead,        // FP8 one CTA: raw blocks 0-3 are read (slabs 4-5 may go over them)
  kRawHighRead,       // FP8 one CTA: raw blocks 4-7 are read (slabs 6-7 may go over them)
  kOwnRowsConverted,  // FP8 pairs: every own row of tile u is converted (the send may start)
};
static_assert(static_cast<int>(MlaWsBarrier::kOwnRowsConverted) < 16, "sm_90 has 16 named barriers");

/// One 16-byte gathered latent copy with a 256-byte L2 prefetch hint (the
/// latent half of a row is 1024 contiguous bytes); src_bytes 0 zero-fills.
/// Measured against plain copies and the hint plus an evict-last policy:
/// all three within 1% (docs/PERFORMANCE.md, the warp-specialized kernel).
__device__ __forceinline__ void cp_async_16_latent(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

/// W: the CTA's shape (MlaWsColumnTile, the bf16 kernel's; MlaWsTile; or
/// an FP8 kernel's, which has two producer warpgroups); the consumers are
/// warpgroups 0 and 1 in all.
template <typename T, class Source, class W = MlaWsColumnTile>
struct MlaWsCta : MlaCtaShare<T, Source> {
  using Tr = ElemTraits<T>;
  using L = MlaTile;
  using S = MlaCtaShare<T, Source>;
  using Params = typename S::Params;
  using KernelParams = Params;  // what mla_partial_kernel takes (the FP8 CTAs: Fp8Params)
  static constexpr int kThreads = W::kThreads;
  using S::bad;  // set by producer threads only
  using S::p, S::src, S::base, S::gen, S::k_base, S::e_base, S::tid, S::wg, S::wt, S::lane;
  using S::request, S::tok_begin, S::len, S::partial, S::head0, S::heads, S::tile_tokens;
  using Smem = typename W::Smem;

  __device__ MlaWsCta(const Params& params, unsigned char* smem) : S(params, smem) {}

  __device__ int num_tiles() const { return (len + L::kTokens - 1) / L::kTokens; }
  // The fields of the CTA's shared-memory plan (W::Smem), by their byte
  // offsets from the base: shared addresses are base + offset, generic
  // pointers gen + offset.
  __device__ int32_t* id_slot(int tile) const {
    return reinterpret_cast<int32_t*>(gen + offsetof(Smem, head.ids)) + (tile % kMlaWsIdSlots) * kIdSlotInts;
  }
  __device__ uint32_t q_tile() const { return base + static_cast<uint32_t>(offsetof(Smem, head.q)); }
  /// Byte offset of tile `tile`'s stage.
  __device__ static constexpr uint32_t stage_offset(int tile) {
    return static_cast<uint32_t>(offsetof(Smem, head.stage) + (tile & 1) * sizeof(MlaSwizzledTile));
  }
  __device__ uint32_t stage(int tile) const { return base + stage_offset(tile); }
  /// Byte offset of the stage's rope slab: P (and, split by columns,
  /// warpgroup 1's partial scores before it).
  __device__ static constexpr uint32_t p_slab_offset(int tile) {
    return stage_offset(tile) + kMlaRopeSlab * MlaTile::kSlabBytes;
  }
  __device__ uint32_t full_bar(int tile) const {
    return base + static_cast<uint32_t>(offsetof(Smem, head.full) + (tile & 1) * sizeof(uint64_t));
  }
  __device__ uint32_t empty_bar(int tile) const {
    return base + static_cast<uint32_t>(offsetof(Smem, head.empty) + (tile & 1) * sizeof(uint64_t));
  }
  /// Completes when every producer thread is done; the rejected-id flag is
  /// set before.
  __device__ uint32_t done_bar() const { return base + static_cast<uint32_t>(offsetof(Smem, head.done)); }
  /// In a CTA pair: completes when the peer's consumer warps released the
  /// stage (the producer writes into the peer's stage too).
  __device__ uint32_t peer_empty_bar(int tile) const {
    return base + static_cast<uint32_t>(offsetof(Smem, head.peer_empty) + (tile & 1) * sizeof(uint64_t));
  }
  /// In a CTA pair: completes when the peer's rows of the stage landed (the
  /// bulk copies' transaction bytes). Apart from `full`, whose arrivals are
  /// all this CTA's, so that each barrier has one kind of completion.
  __device__ uint32_t peer_full_bar(int tile) const {
    return base + static_cast<uint32_t>(offsetof(Smem, head.peer_full) + (tile & 1) * sizeof(uint64_t));
  }
  __device__ unsigned int* bad_flag() const {
    return reinterpret_cast<unsigned int*>(gen + offsetof(Smem, head.bad_flag));
  }
  /// The row maxima's exchange, [slots][2 warpgroups][64 heads] floats.
  __device__ float* maxima() const { return reinterpret_cast<float*>(gen + offsetof(Smem, maxima)); }

  /// The consumer warpgroups, or the producer warpgroup(s), meet at `id`.
  __device__ static void consumer_sync(MlaWsBarrier id) { named_barrier(id, W::kConsumerThreads); }
  __device__ static void producer_sync(MlaWsBarrier id) { named_barrier(id, W::kProducerThreads); }

  // ---- producer -------------------------------------------------------------

  /// This producer thread's 4 rows of a tile (rows t / 8 + 16 i): the pool
  /// row, or a negative value for a row not read (a tail, masked or rejected
  /// row, zero-filled).
  struct TileRows {
    int64_t row[W::kRowsPerThread];
  };

  /// Resolves this thread's rows of tile `tile` from its page ids (in their
  /// slot): the lookups run before the producer waits for the stage, so the
  /// copies go out as soon as it is free.
  __device__ void resolve_tile(int tile, TileRows& rows) {
    static_assert(W::kProducerThreads == 128, "the bf16 gather is one producer warpgroup");
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    const int32_t n = tile_tokens(tile);
    const int32_t* slot = id_slot(tile);
#pragma unroll
    for (int i = 0; i < W::kRowsPerThread; ++i) {
      const int row = wt / 8 + 16 * i;
      rows.row[i] = kMaskedRow;
      if (row < n) {
        rows.row[i] = src.row(slot, tok0, tok0 + row, p);
        bad |= rows.row[i] == kRejectedRow;  // a masked row (kMaskedRow) is just not read
      }
    }
  }

  /// Copies tile `tile`'s rows into its stage: producer thread t copies the
  /// 16-byte piece t % 8 of each of the 9 slabs of its 4 rows.
  __device__ void copy_tile(int tile, const TileRows& rows) const {
    const int piece = wt & 7;
    const uint32_t dst0 = stage(tile);
#pragma unroll
    for (int i = 0; i < W::kRowsPerThread; ++i) {
      const int row = wt / 8 + 16 * i;
      const int64_t r = rows.row[i];
      const int fill = r >= 0 ? 16 : 0;
      const T* k_row = k_base + (r >= 0 ? r * p.k_stride : 0) + piece * 8;
      const T* e_row = e_base + (r >= 0 ? r * p.e_stride : 0) + piece * 8;
      const uint32_t dst = dst0 + row * 128 + ((piece ^ (row & 7)) << 4);
#pragma unroll
      for (int s = 0; s < kMlaRopeSlab; ++s) cp_async_16_latent(dst + s * L::kSlabBytes, k_row + s * 64, fill);
      cp_async_16_n(dst + kMlaRopeSlab * L::kSlabBytes, e_row, fill);
    }
    mbar::arrive_on_copies(full_bar(tile));
  }

  /// The page ids run two tiles ahead of the rows, each tile's in a commit
  /// group of its own, so the producer waits for tile u's ids without
  /// waiting for tile u - 1's rows. Groups in order: ids 0, ids 1, rows 0,
  /// ids 2, rows 1, ids 3, ...; at tile u >= 1 two groups are newer than
  /// ids u (rows u - 1, ids u + 1).
  __device__ void run_producer() {
    const int tiles = num_tiles();
    for (int u = 0; u < 2; ++u) {
      if (u < tiles) src.prefetch(id_slot(u), tok_begin + u * L::kTokens, tile_tokens(u), wt);
      cp_async_commit();
    }
    for (int u = 0; u < tiles; ++u) {
      if (u == 0) {
        cp_async_wait<1>();
      } else {
        cp_async_wait<2>();
      }
      producer_sync(MlaWsBarrier::kTileIdsVisible);
      TileRows rows;
      resolve_tile(u, rows);
      // The stage is free once the consumers released tile u - 2 (a fresh
      // barrier's "previous phase" counts as complete).
      mbar::wait(empty_bar(u), ((u >> 1) & 1) ^ 1);
      // The ids are visible to the consumers through this (release) arrival.
      if (wt == 0) mbar::arrive(full_bar(u));
      copy_tile(u, rows);
      cp_async_commit();
      // Slot (u + 2) % 4 held tile u - 2's ids, which the consumers read
      // before they released its stage (the wait above).
      if (u + 2 < tiles) src.prefetch(id_slot(u + 2), tok_begin + (u + 2) * L::kTokens, tile_tokens(u + 2), wt);
      cp_async_commit();
    }
    cp_async_wait<0>();
  }

  // ---- consumers ------------------------------------------------------------

  float m[2], l[2];
  float acc[128];

  __device__ void load_q() { mla_load_q<T>(p, q_tile(), request, head0, heads, tid, W::kConsumerThreads); }

  __device__ void start_scores(uint32_t stage_addr, float (&s)[16]) const {
    const uint64_t qd = wgmma::desc_sw128(q_tile(), 16, 1024);
    const uint64_t kd = wgmma::desc_sw128(stage_addr + wg * 32 * 128, 16, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < L::kCols / 16; ++kk) {
      const uint64_t off = static_cast<uint64_t>(((kk >> 2) * L::kSlabBytes + (kk & 3) * 32) >> 4);
      wgmma::mma_m64n32k16<T>(s, qd + off, kd + off, kk > 0);
    }
    wgmma::commit();
  }

  /// S split by columns (W::kScoresByColumns): this warpgroup's 18 of the
  /// 36 k-steps, over all 64 tokens.
  __device__ void start_scores_columns(uint32_t stage_addr, float (&part)[8][4]) const {
    constexpr int kSteps = L::kCols / 16 / 2;
    const uint64_t qd = wgmma::desc_sw128(q_tile(), 16, 1024);
    const uint64_t kd = wgmma::desc_sw128(stage_addr, 16, 1024);
    wgmma::fence();
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      const int kk = wg * kSteps + k;
      const uint64_t off = static_cast<uint64_t>(((kk >> 2) * L::kSlabBytes + (kk & 3) * 32) >> 4);
      wgmma::mma_m64n64k16<T>(part, qd + off, kd + off, k > 0);
    }
    wgmma::commit();
  }

  /// Tile `tile`'s scores of this warpgroup's 32 tokens (warpgroup w: tokens
  /// 32 w .. 32 w + 31), in the layout of start_scores' m64n32 accumulators.
  /// Split by columns, each warpgroup adds the other's partial sums of its
  /// tokens, handed over through shared memory (MlaWsColumnTile).
  __device__ void scores(int tile, float (&s)[16]) {
    if constexpr (!W::kScoresByColumns) {
      start_scores(stage(tile), s);
      wgmma::wait<0>();
      wgmma::pin(s);
    } else {
      float part[8][4];
      start_scores_columns(stage(tile), part);
      wgmma::wait<0>();
      wgmma::pin(part);
      // Thread (warp, lane) of one warpgroup holds the same (head, token)
      // positions as thread (warp, lane) of the other, so each hands over
      // its four n8 tiles of the other's tokens in its own register order.
      // Warpgroup 1 hands over through the rope slab (the stage's P slab),
      // which only its own k-steps read; the P tile overwrites it after the
      // maxima's barrier, by which time warpgroup 0 has read it. Warpgroup 0
      // hands over through the buffer at kScoreExchange, which warpgroup 1
      // reads before that barrier, and warpgroup 0 writes again only in the
      // next tile.
      unsigned char* from_wg1 = gen + p_slab_offset(tile);
      unsigned char* from_wg0 = gen + offsetof(Smem, wg0_scores);
      const bool is_wg0 = wg == 0;
      float4* give = reinterpret_cast<float4*>(is_wg0 ? from_wg0 : from_wg1) + (wt / 32) * 4 * 32 + lane;
      const float4* take = reinterpret_cast<const float4*>(is_wg0 ? from_wg1 : from_wg0) + (wt / 32) * 4 * 32 + lane;
      // (Selects by value: an array reference picked by wg would put part
      // in local memory.)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float g[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) g[e] = is_wg0 ? part[4 + j][e] : part[j][e];
        give[j * 32] = make_float4(g[0], g[1], g[2], g[3]);
      }
      consumer_sync(MlaWsBarrier::kScoresSwapped);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 t = take[j * 32];
        const float o[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) s[4 * j + e] = (is_wg0 ? part[j][e] : part[4 + j][e]) + o[e];
      }
    }
  }

  /// Softmax of tile `tile`'s scores against the CTA-wide running max; P
  /// into the stage's P slab and, packed, into `pk` (n8 tile j, rows
  /// wrow + 8 h: the A fragments of this warpgroup's two P V k-steps). O is
  /// rescaled if the max moved. The other warpgroup's P is complete only
  /// after start_pv's barrier.
  __device__ void softmax(int tile, float (&s)[16], uint32_t (&pk)[4][2]) {
    const int32_t n = tile_tokens(tile);
    const int32_t* slot = id_slot(tile);
    const int32_t tok0 = tok_begin + tile * L::kTokens;
    const int wrow = (wt / 32) * 16 + lane / 4;
    float tmax[2] = {neg_inf_f32(), neg_inf_f32()};
    // Padding ids (-1) of this thread's eight keys: their rows were not read and weigh nothing.
    uint32_t skip = 0;
    if constexpr (Source::kMaySkip) skip = src.template skipped_pairs<4>(slot, tok0, wg * 32 + 2 * (lane & 3), n);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int key = wg * 32 + (i / 4) * 8 + 2 * (lane & 3) + (i & 1);
      float x = s[i] * p.scale_log2;
      if constexpr (Source::kHasBias) {
        const float b = src.bias(slot, key);
        x = b == neg_inf_f32() ? b : x + b * kLog2e;
      }
      if (key >= n || ((skip >> (2 * (i / 4) + (i & 1))) & 1u)) x = neg_inf_f32();
      s[i] = x;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) tmax[(i >> 1) & 1] = fmaxf(tmax[(i >> 1) & 1], s[i]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 1));
      tmax[r] = fmaxf(tmax[r], __shfl_xor_sync(0xffffffffu, tmax[r], 2));
    }
    // Every read of tile t's maxima comes before the reader's P barrier of
    // tile t, and tile t + 1's writes after it, so one slot would do; the
    // token split keeps two (by tile parity), the column split one.
    float* xchg = maxima() + (tile % W::kMaxSlots) * 2 * L::kHeads;
    if ((lane & 3) == 0) xchg[wg * L::kHeads + wrow] = tmax[0], xchg[wg * L::kHeads + wrow + 8] = tmax[1];
    consumer_sync(MlaWsBarrier::kMaximaSwapped);
    tmax[0] = fmaxf(tmax[0], xchg[(1 - wg) * L::kHeads + wrow]);
    tmax[1] = fmaxf(tmax[1], xchg[(1 - wg) * L::kHeads + wrow + 8]);

    // Lazy rescale, in step in both warpgroups (they share tmax).
    float alpha[2], b[2];
    const bool rescale = online_softmax_rebase(tmax, m, l, alpha, b);
    uint32_t* ptile = reinterpret_cast<uint32_t*>(gen + p_slab_offset(tile));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = wg * 32 + j * 8 + 2 * (lane & 3);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p0 = exp2_ftz(s[4 * j + 2 * h] - b[h]), p1 = exp2_ftz(s[4 * j + 2 * h + 1] - b[h]);
        l[h] += p0 + p1;
        const int row = wrow + 8 * h;
        pk[j][h] = Tr::pack2(p0, p1);
        ptile[(row * 128 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2) / 4] = pk[j][h];
      }
    }
    if (rescale) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] *= alpha[(i >> 1) & 1];
    }
  }

  /// P V of tile `tile` over this warpgroup's 256 V columns: the k-steps of
  /// its own 32 tokens with P from registers first, so they run while the
  /// warpgroups meet at the P barrier, then the other's two from the P tile.
  __device__ void start_pv(int tile, const uint32_t (&pk)[4][2]) {
    const uint32_t st = stage(tile);
    const uint64_t pd = wgmma::desc_sw128(base + p_slab_offset(tile), 16, 1024);
    const uint64_t vd = wgmma::desc_sw128(st + wg * 4 * L::kSlabBytes, L::kSlabBytes, 1024);
    // The FP8 CTAs take each k-step as two m64n128 (columns 0-127 and
    // 128-255 of this warpgroup's 256, two slabs apart): the 512-thread CTA
    // compiles at 128 registers per thread, and m64n256k16 alone needs more.
    constexpr uint64_t kHalf = 2 * L::kSlabBytes >> 4;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
      const uint64_t v = vd + static_cast<uint64_t>((2 * wg + kk) * 128);
      if constexpr (W::kPvHalves) {
        wgmma::mma_m64n128k16_rs<T>(acc, a, v, 1);
        wgmma::mma_m64n128k16_rs<T>(acc + 64, a, v + kHalf, 1);
      } else {
        wgmma::mma_m64n256k16_rs<T>(acc, a, v, 1);
      }
    }
    wgmma::fence_proxy_async();
    consumer_sync(MlaWsBarrier::kPComplete);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int k = 2 * (1 - wg) + kk;
      const uint64_t v = vd + static_cast<uint64_t>(k * 128);
      const uint64_t pa = pd + static_cast<uint64_t>(k * 2);
      if constexpr (W::kPvHalves) {
        wgmma::mma_m64n128k16<T>(acc, pa, v, 1);
        wgmma::mma_m64n128k16<T>(acc + 64, pa, v + kHalf, 1);
      } else {
        wgmma::mma_m64n256k16<T>(acc, pa, v, 1);
      }
    }
    wgmma::commit();
  }

  __device__ void wait_full(int tile) {
    if constexpr (W::kClusterCtas > 1) mbar::wait(peer_full_bar(tile), (tile >> 1) & 1);  // the peer's rows
    mbar::wait(full_bar(tile), (tile >> 1) & 1);
    wgmma::fence_proxy_async();  // the copies (generic proxy) before the wgmma reads (async proxy)
  }

  __device__ void run_consumers() {
    m[0] = m[1] = neg_inf_f32();
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    const int tiles = num_tiles();
    load_q();
    cp_async_commit();
    cp_async_wait<0>();
    wgmma::fence_proxy_async();
    consumer_sync(MlaWsBarrier::kQLanded);
    float s[16];
    for (int t = 0; t < tiles; ++t) {
      wait_full(t);
      scores(t, s);
      uint32_t pk[4][2];
      softmax(t, s, pk);
      start_pv(t, pk);
      // P V is waited for here, not behind S(t + 1): with a group in flight
      // across the loop's back edge ptxas serializes the kernel's wgmmas
      // (its C7514 notice).
      wgmma::wait<0>();
      wgmma::pin(acc);
      // The producer may refill this stage; it copies as soon as this
      // completes. Every consumer thread arrives, releasing its own reads
      // and P stores (one arrival per warp after __syncwarp is ordered as
      // well, but compute-sanitizer racecheck does not follow that order
      // and reports the rope copies against the P stores).
      mbar::arrive(empty_bar(t));
      // The pair's producers write into both CTAs' stages, so the peer's
      // producer waits for this release too. Only tiles that are refilled
      // are released to the peer, so no arrival reaches a peer that may
      // have finished.
      if constexpr (W::kClusterCtas > 1) {
        __syncwarp();
        if (lane == 0 && t + 2 < tiles) mbar::arrive_remote(cluster::map(peer_empty_bar(t), cluster::rank() ^ 1u));
      }
    }
  }

  /// Adds the two warpgroups' row sums and writes o / lse or the partial slot.
  __device__ void finish_consumers(bool any_bad) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    const int wrow = (wt / 32) * 16 + lane / 4;
    float* sums = maxima();  // over the maxima's slot(s), read by now
    consumer_sync(MlaWsBarrier::kMaximaRead);
    if ((lane & 3) == 0) sums[wg * L::kHeads + wrow] = l[0], sums[wg * L::kHeads + wrow + 8] = l[1];
    consumer_sync(MlaWsBarrier::kSumsWritten);
    float sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) sum[r] = sums[wrow + 8 * r] + sums[L::kHeads + wrow + 8 * r];
    mla_store_rows<T>(p, acc, m, sum, wrow, lane, wg, request, partial, head0, heads, any_bad);
    if (any_bad && tid == 0) report_rejected(p, request);
  }

  /// The CTA's work, for mla_partial_kernel: the bf16 gather (run_producer
  /// above) beside the consumers. The FP8 CTAs run their own producers the
  /// same way.
  __device__ void run() {
    run_with([this] { run_producer(); });
  }

  /// The CTA: barriers, then the producer warpgroups run `produce()` (the
  /// bf16 gather, or an FP8 kernel's gather and dequantization) while the
  /// consumer warpgroups run S, softmax and P V.
  template <class Produce>
  __device__ void run_with(Produce&& produce) {
    // setmaxnreg moves registers between the warpgroups of the CTA; it cannot
    // take more than the launch gave: 65536 / threads per thread, rounded
    // down to 8 (168 at 384 threads, 128 at 512). Asking for more hangs.
    constexpr int kLaunchRegs = 65536 / W::kThreads / 8 * 8;
    static_assert(
        W::kConsumerThreads * W::kConsumerRegs + W::kProducerThreads * W::kProducerRegs <= W::kThreads * kLaunchRegs,
        "setmaxnreg asks for more than the launch gave");
    if (tid == 0) {
      for (int s = 0; s < 2; ++s) {
        // Each producer thread's arrival (its rows landed, or converted), and the ids'.
        mbar::init(full_bar(s), W::kProducerThreads + 1);
        mbar::init(empty_bar(s), W::kConsumerThreads);
        if (W::kClusterCtas > 1) {
          mbar::init(peer_empty_bar(s), W::kConsumerThreads / 32);
          mbar::init(peer_full_bar(s), 1);  // the producer's expect_tx arrival, then the peer's bytes
        }
      }
      mbar::init(done_bar(), W::kProducerThreads);
      *bad_flag() = 0;
      mbar::init_fence();
    }
    // In a CTA pair the peer's barriers must exist before anything arrives on
    // them: the cluster meets. The CTA barrier after it is for
    // compute-sanitizer's racecheck, which, without one after the barriers'
    // initialization, reports every stage reuse as a race.
    if constexpr (W::kClusterCtas > 1) cluster::sync_relaxed();
    __syncthreads();
    // The producers' rejected ids reach the consumers through a shared flag
    // and the `done` mbarrier, not a barrier of the whole CTA: that would be
    // met from both branches (two places), or, placed after them, keep the
    // consumers' accumulators live where the producers' register limit
    // applies (ptxas spills them).
    if (tid >= W::kConsumerThreads) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(W::kProducerRegs));
      produce();
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
