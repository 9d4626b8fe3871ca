// What the DSA indexer's translation units share (dsa_indexer.cu: the
// launcher, the native score kernels and the top-k; dsa_score_fp8.cu: the
// FP8 score kernel): the tile geometry, the params, the checked lengths, the
// key-tile addressing over dense rows or an engine's block table, and the
// score epilogue's helpers. Rules in include/sparsepage/models/dsa.h and
// include/sparsepage/index_keys.h.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/index_key_map.h"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/radix_select.cuh"
#include "cuda/primitives/wgmma.cuh"
#include "sparsepage/index_keys.h"

namespace sparsepage {
namespace dsa {

constexpr int kTileTokens = 64;  // positions per key tile (the wgmma M)
static_assert(kTileTokens == detail::kIndexKeyTileRows && detail::kIndexKeySlabColumns * 2 == 128,
              "the key maps' boxes (core/index_key_map.h) fill the tiles' 128-byte swizzled slabs");
// Operands sit in 128-byte swizzled slabs of 64 rows x 128 bytes: row r at
// bytes [128 r, 128 r + 128), its 16-byte pieces permuted by piece ^ (r % 8).
constexpr int kSlabBytes = 64 * 128;
// Coarse histogram of the score keys' top 12 bits (sign, exponent, 3
// mantissa bits): the bin of the k-th largest holds the only ambiguous keys.
constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;
constexpr int kLowKeyBits = 32 - kBinBits;
// The production index geometry the grouped score kernels are built for.
constexpr int kGroupHeads = 64;
constexpr int kGroupDim = 128;
// Two consumer warpgroups take the tiles in turn, each fed by its own
// producer warp through its own stages (tile i goes to warpgroup i % 2), so
// a late copy for one warpgroup never holds back the other's. One producer
// for both read the FP8 keys markedly slower (docs/PERFORMANCE.md, "Tried
// and rejected").
constexpr int kGroupConsumers = 2;
constexpr int kGroupThreads = kGroupConsumers * (128 + 32);

struct IndexerParams {
  CUtensorMap keys;        // the key values for TMA (core/index_key_map.h): (column, position, sequence) dense,
                           // (column, row, block) paged; FP8: the blocks' e4m3 values, 128 bytes a row
  const void* k_cache;     // dense: [batch * capacity, row_stride]; index key at columns key_offset .. key_offset + dim
  const void* q_index;     // [batch, heads, dim]: dtype, or e4m3 when q_e4m3
  const float* weights;    // [batch, heads]
  const int32_t* kv_lens;  // [sequences], device
  int64_t row_stride, capacity;
  int64_t pitch;       // row pitch of scores and candidates (whole slices)
  int64_t slices;      // kSlice-position slices per sequence
  int64_t max_kv_len;  // the host bound: a longer (or negative) length refuses its sequence's rows
  int32_t batch, key_offset, heads, dim, topk;
  int32_t position_bits;  // bits of a position below max_kv_len
  int32_t* hist;          // [batch, kBins]: score keys' top 12 bits
  int32_t* cand_count;    // [batch]
  int32_t* done;          // [batch]: classify CTAs finished (the last one picks the cut)
  int32_t* slice_kept;    // [batch, slices]: kept positions per slice
  int32_t* row_error;     // [batch]: IndexKeyError bits of a row the score kernel refused (cleared by the clear kernel)
  uint64_t* cut;          // [batch]: the smallest kept (score key, position) composite
  float* scores;          // [batch, pitch]
  uint64_t* candidates;   // [batch, pitch]: threshold-bin composites, in arrival order
  int32_t* positions;     // out [batch, topk]
  int32_t* counts;        // out [batch]
  int32_t* error;         // out, may be null: IndexKeyError bits of refused rows
  // Multi-token steps: `batch` rows are (sequence, token) pairs, row b =
  // sequence b / q_len, token b % q_len, which reads its sequence's keys
  // below kv_lens[sequence] - (q_len - 1 - token): its own causal window.
  int32_t q_len;
  // Paged keys (IndexKeyLayout::kPaged): position p of sequence s is row p %
  // block_size of block block_table[s * table_stride + p / block_size].
  int32_t paged;               // 0: dense rows, 1: paged blocks
  const int32_t* block_table;  // [sequences, table_stride]
  int64_t table_stride;
  int32_t max_blocks;  // entries of a row that may be read
  int32_t block_size;
  int32_t box_rows;  // rows per TMA box: 64 dense, min(64, block_size) paged
  int64_t num_blocks;
  const unsigned char* pool;  // FP8: the blocks (the scales' bulk copies)
  int64_t block_bytes;        // FP8: bytes between blocks
  int32_t q_e4m3;             // FP8: q_index is e4m3 with the scales in the weights (else native, quantized here)
  DType dtype;                // of q_index (and native keys)
  int32_t wave;               // grouped score grids: resident CTAs the live tiles are shared among (group_work)
};

// Sequence `seq`'s live length, or -1 when it is refused: negative, past
// the host bound, or longer than its block-table row holds. From L2: the
// step's append wrote the lengths.
__device__ __forceinline__ int64_t checked_seq_len(const IndexerParams& p, int seq) {
  const int64_t len = __ldcg(&p.kv_lens[seq]);
  const bool bad = len < 0 || len > p.max_kv_len || (p.paged != 0 && len > int64_t{p.max_blocks} * p.block_size);
  return bad ? -1 : len;
}

// A window of `len` positions for the token `tok` of q_len new tokens (-1 stays -1).
__device__ __forceinline__ int64_t token_window(int64_t len, int q_len, int tok) {
  return len < 0 ? -1 : max(int64_t{0}, len - (q_len - 1 - tok));
}

// Row b's live positions (-1: refused).
__device__ __forceinline__ int64_t row_len(const IndexerParams& p, int b) {
  if (p.q_len == 1) return checked_seq_len(p, b);
  const int seq = b / p.q_len;
  return token_window(checked_seq_len(p, seq), p.q_len, b - seq * p.q_len);
}

// max(x, 0) as the CPU rule's ReLU: NaN stays NaN, in one instruction
// (max.NaN). A -0 dot gives +0 where the rule keeps -0; the weighted sums
// are the same, since they start at +0 and adding a zero of either sign to
// +0 gives +0.
__device__ __forceinline__ float relu_keep_nan(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}

// A lane's score v of position t into its row's scores and its bin into the
// row's shared histogram (one atomic per distinct bin among the lanes);
// lanes that are not `live` write nothing. All 32 lanes call it.
__device__ __forceinline__ void record_score(float* scores, int32_t* hist, int64_t t, float v, bool live, int lane) {
  if (live) scores[t] = v;
  const uint32_t bin = live ? cuda::score_key(v) >> kLowKeyBits : 0xFFFFFFFFu;
  const uint32_t peers = __match_any_sync(0xffffffffu, bin);
  if (live && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

// The producer warp's window on a sequence's block-table row: entries come
// 32 at a time, one per lane, and the next 32 are requested while the
// current ones are used, so a tile rarely waits for its block id. Every
// lane calls get() with the same, non-decreasing entry. Entries at or past
// `limit` (the row's max_blocks) are never loaded.
struct TableWindow {
  const int32_t* row;
  int64_t limit, base;
  int32_t cur, nxt;
  int lane;
  __device__ TableWindow(const int32_t* row_, int64_t limit_, int64_t first, int lane_)
      : row(row_), limit(limit_), base(first - first % 32), lane(lane_) {
    cur = load(base + lane);
    nxt = load(base + 32 + lane);
  }
  __device__ int32_t load(int64_t e) const { return e < limit ? __ldg(row + e) : -1; }
  __device__ int32_t get(int64_t e) {
    while (e >= base + 32) {
      cur = nxt;
      base += 32;
      nxt = load(base + 32 + lane);
    }
    return __shfl_sync(0xffffffffu, cur, static_cast<int>(e - base));
  }
};

// Box j of a key tile: rows [first, first + box_rows) of the sequence, at
// TMA coordinates (y, z) = (position, sequence) for dense rows or (row in
// block, block id) for paged ones. Boxes past the window are not loaded; a
// paged box whose block id lies outside the pool is not `ok` (not loaded,
// and its rows refused).
struct KeyBox {
  int64_t first;
  int32_t y, z;
  bool live, ok;
};

// Box j of tile `tile` of sequence `seq`, whose longest window is `len`;
// lookup(entry) gives a block id of the sequence's table row (paged only,
// called only for live boxes: warp-uniformly when it shuffles).
template <typename Lookup>
__device__ __forceinline__ KeyBox key_box(const IndexerParams& p, int seq, int64_t tile, int j, int64_t len,
                                          Lookup&& lookup) {
  KeyBox b;
  b.first = tile * kTileTokens + int64_t{j} * p.box_rows;
  b.live = b.first < len;
  if (p.paged == 0) {
    b.y = static_cast<int32_t>(tile * kTileTokens);
    b.z = seq;
    b.ok = b.live;
    return b;
  }
  const int32_t id = b.live ? lookup(b.first / p.block_size) : -1;
  b.ok = b.live && id >= 0 && id < p.num_blocks;
  b.y = static_cast<int32_t>(b.first % p.block_size);
  b.z = id;
  return b;
}

// The box's first table entry, for the producer's TableWindow.
__device__ __forceinline__ int64_t first_entry(const IndexerParams& p, int64_t tile) {
  return p.paged == 0 ? 0 : tile * kTileTokens / p.block_size;
}

// The grouped score grids' work split, made on the device from the live
// lengths so that a captured step follows them: the tiles every token group
// (sequence, kTokens of its tokens) must score are shared among one wave of
// resident CTAs (p.wave) in proportion to each group's tiles, so a ragged
// batch (1K next to 128K) keeps every CTA as busy as a uniform one of the
// same total. A group of `tiles` gets n = ceil(tiles / share) CTAs, share =
// ceil(total / (wave - groups)), so that all of them fit one wave, and
// splits its tiles evenly among them. Groups whose windows all fit the
// top-k (or are refused) get none; the host launches wave + groups CTAs
// (the bound with one group) and those past the last run have nothing to
// do (ntiles = 0). Every thread of the CTA calls it (it synchronizes).
struct GroupWork {
  int seq = 0, first = 0;         // the group's sequence and first token
  int64_t tile0 = 0, ntiles = 0;  // the CTA's run of the group's tiles (0: none)
  int ntok = 0;                   // the group's tokens (<= kTokens); set by read_rows
  int64_t seq_len = 0;            // the sequence's checked length (-1: refused); set by read_rows

  // Only a CTA with tiles reads its sequence's length.
  template <int kTokens>
  __device__ __forceinline__ void read_rows(const IndexerParams& p) {
    ntok = min(kTokens, p.q_len - first);
    seq_len = checked_seq_len(p, seq);
  }
  // Whether the CTA has tiles to score (then its rows are read); one with
  // none (the group's windows fit the top-k, or it is past the last run)
  // only waits for the clear kernel before it exits.
  template <int kTokens>
  __device__ __forceinline__ bool begin(const IndexerParams& p) {
    if (ntiles <= 0) {
      cuda::pdl_wait_primary();
      return false;
    }
    read_rows<kTokens>(p);
    return true;
  }
  // Token tl's causal window.
  __device__ __forceinline__ int64_t window(const IndexerParams& p, int tl) const {
    return token_window(seq_len, p.q_len, first + tl);
  }
  // Each token's window where it is scored (present, its window longer
  // than the top-k), else 0.
  template <int kTokens>
  __device__ __forceinline__ void scored_windows(const IndexerParams& p, int64_t (&out)[kTokens]) const {
#pragma unroll
    for (int tl = 0; tl < kTokens; ++tl) out[tl] = tl < ntok && window(p, tl) > p.topk ? window(p, tl) : 0;
  }
};

// After a grouped score CTA's last tile (every thread calls it): the rows
// whose blocks the producers refused (bit tl of *refused_s) and the shared
// histograms (hist_s, [kTokens, kBins]) into the group's global rows from
// row0. The histograms are added only once the clear kernel has zeroed
// them, and only for rows that are scored at all.
__device__ __forceinline__ void publish_group(const IndexerParams& p, const GroupWork& work, int64_t row0, int ntok,
                                              const uint32_t* refused_s, const int32_t* hist_s, int tid) {
  __syncthreads();           // every scored position is in its row's shared histogram
  cuda::pdl_wait_primary();  // the clear kernel has zeroed the histograms and the row errors
  if (tid < ntok && ((*refused_s >> tid) & 1u) != 0) atomicOr(&p.row_error[row0 + tid], kIndexErrorBlock);
  for (int i = tid; i < ntok * kBins; i += kGroupThreads) {
    const int tl = i / kBins;
    const int32_t v = hist_s[i];
    if (v != 0 && work.window(p, tl) > p.topk) atomicAdd(&p.hist[(row0 + tl) * kBins + i % kBins], v);
  }
}

// A grouped score kernel's epilogue sums for chain c of one key tile:
// d[32 u + 4 j + e] is head 8 j + 2 q4 + e of the chain's token u at the
// thread's first row (position), d[32 u + 4 j + 2 + e] at its second. Each
// token's ReLU'd dots weighted by its heads' weights (w_s, [tokens, 64]),
// summed over the quad's heads: part[u][0] the first row, part[u][1] the
// second. The tokens' sums are formed, then reduced together, so their
// dependency chains overlap.
template <int kChainTokens>
__device__ __forceinline__ void weighted_head_sums(const float (&d)[32 * kChainTokens], const float* w_s, int c, int q4,
                                                   float (&part)[kChainTokens][2]) {
#pragma unroll
  for (int u = 0; u < kChainTokens; ++u) {
    const int tl = c * kChainTokens + u;
    part[u][0] = part[u][1] = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float2 w = *reinterpret_cast<const float2*>(&w_s[tl * kGroupHeads + 8 * j + 2 * q4]);
      part[u][0] += w.x * relu_keep_nan(d[32 * u + 4 * j]);
      part[u][1] += w.x * relu_keep_nan(d[32 * u + 4 * j + 2]);
      part[u][0] += w.y * relu_keep_nan(d[32 * u + 4 * j + 1]);
      part[u][1] += w.y * relu_keep_nan(d[32 * u + 4 * j + 3]);
    }
  }
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
#pragma unroll
    for (int u = 0; u < kChainTokens; ++u) {
      part[u][0] += __shfl_xor_sync(0xffffffffu, part[u][0], m);
      part[u][1] += __shfl_xor_sync(0xffffffffu, part[u][1], m);
    }
  }
}

// A group kernel's barriers, by thread 0: per stage s, full[s] (at full +
// 8 s) completes on the producer's arrival with the expected bytes (TMA,
// and bulk copies, deliver them) and empty[s] (at empty + 8 s) on the 128
// threads of the warpgroup that scored the stage; the refused-rows flags
// cleared.
template <int kStages>
__device__ __forceinline__ void init_group_barriers(int tid, uint32_t full, uint32_t empty, uint32_t* refused_s) {
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      cuda::mbar::init(full + 8 * s, 1);
      cuda::mbar::init(empty + 8 * s, 128);
    }
    cuda::mbar::init_fence();
    *refused_s = 0;
  }
}

// The epilogue of a group kernel's tile from chain c on, each chain's
// running while the later chains' MMAs do: wait for the chain's commit
// group, release the stage at `empty_bar` after the last chain (this
// thread's reads of it are done), then score each token at position t:
// lane 4g writes the first row of group g, lane 4g + 1 the second
// (scaled(sum, 0) and scaled(sum, 1): times the key's scale for FP8 keys);
// rows that are absent or not scored (tlen 0: their window fits the top-k)
// write nothing. t is taken by reference, as the kernels' lambdas once
// captured it: by value, ptxas writes one compare the other way round and
// the kernels' SASS changes.
template <int c, int kChains, int kChainFloats, typename Scaled>
__device__ __forceinline__ void score_chains(float (&d)[kChains][kChainFloats], const float* w_s, int q4,
                                             uint32_t empty_bar, const int64_t& t, const int64_t* tlen,
                                             const IndexerParams& p, int64_t row0, int32_t* hist_s, int lane,
                                             Scaled scaled) {
  constexpr int kChainTokens = kChainFloats / 32;
  cuda::wgmma::wait<kChains - 1 - c>();
  cuda::wgmma::pin(d[c]);
  if (c == kChains - 1) cuda::mbar::arrive(empty_bar);
  float part[kChainTokens][2];
  weighted_head_sums<kChainTokens>(d[c], w_s, c, q4, part);
#pragma unroll
  for (int u = 0; u < kChainTokens; ++u) {
    const int tl = c * kChainTokens + u;
    const bool live = q4 < 2 && t < tlen[tl];
    const float v = q4 == 1 ? scaled(part[u][1], 1) : scaled(part[u][0], 0);
    record_score(p.scores + (row0 + tl) * p.pitch, hist_s + tl * kBins, t, v, live, lane);
  }
  if constexpr (c + 1 < kChains) score_chains<c + 1>(d, w_s, q4, empty_bar, t, tlen, p, row0, hist_s, lane, scaled);
}

// Exclusive prefix of x over the CTA's threads (kThreads, a multiple of 32),
// and the total; `sums` holds kThreads / 32 values of shared memory.
template <int kThreads>
__device__ __forceinline__ int64_t cta_exclusive_sum(int64_t x, int64_t* sums, int64_t& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t inclusive = x;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int64_t y = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += y;
  }
  if (lane == 31) sums[warp] = inclusive;
  __syncthreads();
  int64_t before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    const int64_t v = sums[w];
    before += w < warp ? v : 0;
    total += v;
  }
  __syncthreads();  // sums may be written again
  return before + inclusive - x;
}

template <int kTokens, int kThreads>
__device__ GroupWork group_work(const IndexerParams& p) {
  __shared__ int64_t scratch[kThreads / 32 + 3];
  const int per_seq = (p.q_len + kTokens - 1) / kTokens;
  const int64_t groups = int64_t{p.batch / p.q_len} * per_seq;
  const auto group_tiles = [&](int64_t g) -> int64_t {
    const int seq = static_cast<int>(g / per_seq), first = static_cast<int>(g % per_seq) * kTokens;
    const int64_t len = token_window(checked_seq_len(p, seq), p.q_len, first + min(kTokens, p.q_len - first) - 1);
    return len > p.topk ? (len + kTileTokens - 1) / kTileTokens : 0;
  };
  GroupWork w;
  if (groups == 1) {  // one group: no exchange needed
    const int64_t tiles = group_tiles(0);
    const int64_t run = max(int64_t{1}, (tiles + p.wave - 1) / p.wave);
    w.tile0 = int64_t{blockIdx.x} * run;
    w.ntiles = max(int64_t{0}, min(run, tiles - w.tile0));
    return w;
  }
  // Thread t owns groups [g0, g1); the first four of them keep their tiles
  // in registers (the usual case: batch <= 4 x the CTA's threads).
  const int64_t per_thread = (groups + kThreads - 1) / kThreads;
  const int64_t g0 = min(groups, int64_t{threadIdx.x} * per_thread), g1 = min(groups, g0 + per_thread);
  constexpr int kKept = 4;
  int64_t kept[kKept];
  int64_t mine = 0;
#pragma unroll
  for (int j = 0; j < kKept; ++j) {
    kept[j] = g0 + j < g1 ? group_tiles(g0 + j) : 0;
    mine += kept[j];
  }
  for (int64_t g = g0 + kKept; g < g1; ++g) mine += group_tiles(g);
  int64_t total = 0;
  cta_exclusive_sum<kThreads>(mine, scratch, total);
  const int64_t slots = max(int64_t{1}, int64_t{p.wave} - groups);
  const int64_t share = max(int64_t{1}, (total + slots - 1) / slots);
  const auto ctas = [&](int64_t tiles) { return (tiles + share - 1) / share; };
  int64_t my_ctas = 0;
#pragma unroll
  for (int j = 0; j < kKept; ++j) my_ctas += ctas(kept[j]);
  for (int64_t g = g0 + kKept; g < g1; ++g) my_ctas += ctas(group_tiles(g));
  int64_t all = 0;
  int64_t before = cta_exclusive_sum<kThreads>(my_ctas, scratch, all);
  if (threadIdx.x == 0) scratch[kThreads / 32] = -1;
  __syncthreads();
  const int64_t c = blockIdx.x;
  const auto claim = [&](int64_t g, int64_t tiles) {  // is CTA c in group g's runs?
    const int64_t n = ctas(tiles);
    if (c >= before && c < before + n) {
      const int64_t run = (tiles + n - 1) / n;  // the group's tiles evenly over its n CTAs
      scratch[kThreads / 32] = g;
      scratch[kThreads / 32 + 1] = (c - before) * run;
      scratch[kThreads / 32 + 2] = min(run, tiles - (c - before) * run);
    }
    before += n;
  };
#pragma unroll
  for (int j = 0; j < kKept; ++j) {
    if (g0 + j < g1) claim(g0 + j, kept[j]);
  }
  for (int64_t g = g0 + kKept; g < g1; ++g) claim(g, group_tiles(g));
  __syncthreads();
  const int64_t g = scratch[kThreads / 32];
  if (g < 0) return w;  // past the last run
  w.seq = static_cast<int>(g / per_seq);
  w.first = static_cast<int>(g % per_seq) * kTokens;
  w.tile0 = scratch[kThreads / 32 + 1];
  w.ntiles = scratch[kThreads / 32 + 2];
  return w;
}

// The grid group_work expects: a wave of resident CTAs, or one per group
// when there are more groups than that.
inline unsigned group_grid(const IndexerParams& p, int tokens_per_group) {
  const int64_t groups = int64_t{p.batch / p.q_len} * ((p.q_len + tokens_per_group - 1) / tokens_per_group);
  return static_cast<unsigned>(std::max<int64_t>(p.wave, groups));
}

// Everything from here on uses sm_90a instructions (TMA, bulk copies,
// mbarrier transactions); other device passes skip it.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
// Box (x, y, z) of the 3-d tensor `map` into shared memory at dst; its bytes
// complete on `bar`. Out-of-bounds elements arrive as zeros.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int x, int y, int z) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
               : "memory");
}
// `bytes` (a multiple of 16, 16-byte aligned ends) from global memory to
// shared memory at dst, completing on `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// A producer warp of a grouped score CTA (every lane calls it): tiles i =
// first, first + step, ... of the CTA's tiles [tile0, tile0 + ntiles) (its
// warpgroup's share; step divides kStages, so each stage has one producer)
// each go to stage i % kStages once
// the consumers have released the stage's previous tile (its empty barrier,
// phase by phase). Lane 0 issues each box that is live and in the pool with
// issue(box, j, i) (returning the box's bytes) and then expects the stage's
// bytes on its full barrier, so a stage with no box to load completes at
// once. Returns the refused rows: bit tl when a live box with a block id
// outside the pool holds a position of row tl's scored window
// (windows[tl], 0 for rows not scored).
template <int kStages, int kTokens, typename Issue>
__device__ __forceinline__ uint32_t produce_key_tiles(const IndexerParams& p, int seq, int64_t tile0, int64_t ntiles,
                                                      int64_t len, const int64_t (&windows)[kTokens], uint32_t full,
                                                      uint32_t empty, int lane, Issue&& issue, int first = 0,
                                                      int step = 1) {
  TableWindow table(p.paged != 0 ? p.block_table + int64_t{seq} * p.table_stride : nullptr,
                    p.paged != 0 ? p.max_blocks : 0, first_entry(p, tile0 + first), lane);
  const int boxes = kTileTokens / p.box_rows;
  uint32_t refused = 0;
  for (int64_t i = first; i < ntiles; i += step) {
    const uint32_t s = static_cast<uint32_t>(i % kStages);
    if (i >= kStages) {
      if (lane == 0) cuda::mbar::wait(empty + 8 * s, static_cast<uint32_t>((i / kStages - 1) & 1));
      __syncwarp();
    }
    uint32_t bytes = 0;
    for (int j = 0; j < boxes; ++j) {
      const KeyBox box = key_box(p, seq, tile0 + i, j, len, [&](int64_t e) { return table.get(e); });
      if (box.live && !box.ok) {
#pragma unroll
        for (int tl = 0; tl < kTokens; ++tl) refused |= (box.first < windows[tl] ? 1u : 0u) << tl;
      }
      if (box.ok) bytes += issue(box, j, i, full + 8 * s);  // lane 0 issues; every lane counts
    }
    if (lane == 0) cuda::mbar::arrive_expect_tx(full + 8 * s, bytes);
  }
  return refused;
}
#endif

}  // namespace dsa

/// The FP8 score grid over p (FP8 paged keys, 64 heads x 128, p.keys
/// encoded over the values; dsa_score_fp8.cu).
namespace dsa {
void launch_fp8_scores(const IndexerParams& p, cudaStream_t stream);
}  // namespace dsa

}  // namespace sparsepage
