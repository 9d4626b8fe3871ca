// The DSA lightning indexer on the GPU (rule in include/sparsepage/models/
// dsa.h; key sources in include/sparsepage/index_keys.h). The workspace and
// the top-k grids are sized from the host bound max_kv_len, the grouped
// score grids from the card (group_work shares the live tiles among a wave
// of CTAs); each sequence's live length is read on the device, so one
// captured graph serves a growing context and a changing batch. On the caller's stream:
//   0. dsa_clear_kernel clears the coarse histograms and the counters;
//   1. dsa_score_group_kernel (the production geometry, 64 heads x 128;
//      dsa_score_kernel for others) scores positions on warpgroup MMAs
//      (fp32 accumulation: positions x index heads x dim), the index keys
//      arriving by TMA, each key tile against the queries of up to four of a
//      sequence's tokens in a multi-token step; it applies the ReLU and the
//      weighted sum over heads, writes fp32 scores and histograms the top 12
//      bits of each score's order key. The keys are the layer's dense rows or
//      an engine's paged blocks through its block table (a tile of 64
//      positions is one TMA box per block, dsa_indexer.cuh); FP8 blocks are
//      scored by dsa_score_fp8_kernel (dsa_score_fp8.cu) on e4m3 MMAs;
//   2. dsa_classify_kernel (one CTA per slice of kSlice positions) finds the
//      histogram bin holding the k-th largest key, counts the slice's keys in
//      higher bins and appends the keys of that bin as candidates; the last
//      CTA of a sequence to finish picks the k-th largest (key, position)
//      composite among the candidates and counts the kept ones per slice;
//   3. dsa_compact_kernel (one CTA per slice) writes the slice's positions
//      whose composite reaches the k-th, at the offset of the earlier slices:
//      increasing positions, padded with -1, and the count.
// Ties go to the lower position and NaN ranks last through the composite
// (radix_select.cuh). A row whose length is refused (negative, past
// max_kv_len or its table row) or whose needed block id lies outside the
// pool selects nothing and raises its IndexKeyError bit; nothing outside
// the bound or the pool is read. When anything is scored, every kernel is a
// programmatic dependent launch. Nothing here allocates, synchronizes or
// reads back.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>
#include <string>

#include <cub/block/block_reduce.cuh>

#include "core/cuda_hooks.h"
#include "core/index_key_map.h"
#include "core/index_keys_checks.h"
#include "core/require.h"
#include "cuda/indexers/dsa_indexer.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/radix_select.cuh"
#include "cuda/primitives/wgmma.cuh"
#include "models/dsa_kernels.h"
#include "sparsepage/models/dsa.h"

#define REQUIRE(ok, ...) SPARSEPAGE_REQUIRE(ok, "dsa_select_tokens_cuda: ", __VA_ARGS__)

namespace sparsepage {
namespace {

using namespace dsa;

// ---- geometry ---------------------------------------------------------------

// dsa_score_kernel's CTAs (index geometries other than 64 heads x 128): one
// warpgroup computes S = K Q^T for 64 positions x 64 index heads per wgmma
// chain (M = positions, N = heads, K = the index head dim).
constexpr int kScoreThreads = 128;
constexpr int kHeadChunk = 64;      // wgmma N: index heads per chain
constexpr int kStages = 4;          // three tiles in flight while one is scored
constexpr int kScoreCtasPerSm = 2;  // resident score CTAs per SM the grid is sized for
constexpr int kSlice = 2048;        // positions per classify and compact CTA
constexpr int kClassifyThreads = 256;
constexpr int kCompactThreads = kSlice / 8;  // 8 consecutive positions per thread
constexpr int kCutItems = 2048;  // fine-bin candidates ranked in shared memory; more rank from global memory

// dsa_score_group_kernel's CTAs, at the production index geometry
// (kGroupHeads x kGroupDim): up to kTokens (sequence, token) rows of one
// sequence per CTA (one at q_len 1, two at q_len 2, else four), so each key
// tile is read once for all of them.
// Key stages and resident CTAs per SM: six stages, one CTA, when a tile is
// scored against two or four tokens; four stages, two CTAs, for one token.
template <int kTokens>
struct GroupShape {
  static constexpr int kStages = kTokens == 1 ? 4 : 6;
  static constexpr int kCtasPerSm = kTokens == 1 ? 2 : 1;
  static_assert(kStages % kGroupConsumers == 0, "a stage always serves the same warpgroup");
};

// Shared memory of a score CTA, byte offsets from its 1024-aligned base: the
// queries of every head chunk, the key stages, the weights, the histogram,
// the barriers and the row's error flags.
struct ScoreLayout {
  int slabs, chunks;
  size_t q, keys, weights, hist, barriers, flags, bytes;  // flags: IndexKeyError bits of the row
  __host__ __device__ ScoreLayout(int heads, int dim) {
    slabs = (dim + 63) / 64;
    chunks = (heads + kHeadChunk - 1) / kHeadChunk;
    q = 0;
    keys = q + static_cast<size_t>(chunks) * slabs * kSlabBytes;
    weights = keys + static_cast<size_t>(kStages) * slabs * kSlabBytes;
    hist = weights + static_cast<size_t>(chunks) * kHeadChunk * sizeof(float);
    barriers = hist + kBins * sizeof(int32_t);
    flags = barriers + kStages * sizeof(uint64_t);
    bytes = flags + sizeof(int32_t);
  }
  size_t smem_bytes() const { return bytes + 1024; }  // + alignment slack
};

// Shared memory of a group score CTA of kTokens rows, byte offsets
// from its 1024-aligned base: the queries (two 64-column slabs of
// kTokens x 64 rows, row tl * 64 + h), the key stages, the weights, one
// histogram per row, the full and empty barriers, the refused rows.
template <int kTokens>
struct GroupScoreLayout {
  static constexpr size_t kQSlab = size_t{kTokens} * kGroupHeads * 128;
  static constexpr size_t kStageBytes = 2 * kSlabBytes;
  static constexpr size_t kQ = 0;
  static constexpr size_t kKeys = kQ + 2 * kQSlab;
  static constexpr int kStages = GroupShape<kTokens>::kStages;
  static constexpr size_t kWeights = kKeys + kStages * kStageBytes;
  static constexpr size_t kHist = kWeights + size_t{kTokens} * kGroupHeads * sizeof(float);
  static constexpr size_t kBarriers = kHist + size_t{kTokens} * kBins * sizeof(int32_t);
  static constexpr size_t kFlags = kBarriers + 2 * kStages * sizeof(uint64_t);  // int32: rows refused (bit tl)
  static constexpr size_t kSmemBytes = kFlags + 16 + 1024;                      // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "a multi-token score CTA fits one SM's shared memory");
};

// ---- workspace --------------------------------------------------------------

// Byte offsets inside the caller's workspace; the first `cleared` bytes are
// zeroed by every launch. Scores and candidates have a row pitch of whole
// slices, so a slice never leaves its row.
struct Workspace {
  size_t hist, cand_count, done, row_error, slice_kept, cleared, cut, scores, candidates, total;
  int64_t slices;  // kSlice-position slices per sequence
  int64_t pitch;   // slices * kSlice
  Workspace(int32_t batch, int64_t max_kv_len) {
    const auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t b = static_cast<size_t>(batch);
    slices = (max_kv_len + kSlice - 1) / kSlice;
    pitch = slices * kSlice;
    const size_t n = static_cast<size_t>(pitch);
    hist = 0;
    cand_count = up(hist + b * kBins * sizeof(int32_t));
    done = up(cand_count + b * sizeof(int32_t));
    row_error = up(done + b * sizeof(int32_t));
    slice_kept = up(row_error + b * sizeof(int32_t));
    cleared = up(slice_kept + b * static_cast<size_t>(slices) * sizeof(int32_t));  // whole 16-byte words
    cut = cleared;
    scores = up(cut + b * sizeof(uint64_t));
    candidates = up(scores + b * n * sizeof(float));
    total = candidates + b * n * sizeof(uint64_t);
  }
};

// ---- tensor-memory-access copies ---------------------------------------------

// Everything from here to the score kernel uses sm_90a instructions (TMA,
// mbarrier transactions, warpgroup MMAs); other device passes skip it.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)

// A score CTA's key tiles arrive by the tensor memory accelerator: one thread
// issues a box of rows x 64 columns per slab (dsa::tma_load_3d), the
// hardware writes it in the 128-byte swizzle the MMAs read and counts the
// bytes on an mbarrier (cuda/primitives/mbarrier.cuh).

// ---- 1. scores on warpgroup MMAs --------------------------------------------

// Shared byte offset of 16-byte piece `piece` (columns 8 piece ..) of row r
// in a stack of swizzled slabs.
__device__ __forceinline__ uint32_t slab_offset(int r, int piece) {
  return static_cast<uint32_t>((piece >> 3) * kSlabBytes + r * 128 + (((piece & 7) ^ (r & 7)) << 4));
}

// d = keys (64 positions) . queries (64 heads) over the k-steps of 16
// columns: kKSteps of them, or `ksteps` when kKSteps is 0 (a head dim other
// than 128, looped at run time).
template <typename T, int kKSteps>
__device__ __forceinline__ void score_chunk(uint32_t keys, uint32_t queries, int ksteps, float (&d)[32]) {
  const uint64_t kd = cuda::wgmma::desc_sw128(keys, 16, 1024);
  const uint64_t qd = cuda::wgmma::desc_sw128(queries, 16, 1024);
  // k-step kk: slab kk / 4, 32 bytes per step inside the 128-byte row.
  const auto offset = [](int kk) { return static_cast<uint64_t>(((kk >> 2) * kSlabBytes + (kk & 3) * 32) >> 4); };
  cuda::wgmma::fence();
  if constexpr (kKSteps > 0) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) cuda::wgmma::mma_m64n64k16<T>(d, kd + offset(kk), qd + offset(kk), kk > 0);
  } else {
    for (int kk = 0; kk < ksteps; ++kk) cuda::wgmma::mma_m64n64k16<T>(d, kd + offset(kk), qd + offset(kk), kk > 0);
  }
  cuda::wgmma::commit();
  cuda::wgmma::wait<0>();
  cuda::wgmma::pin(d);
}
#endif  // sm_90a

// Each thread's accumulator rows are two positions and its columns 16 heads,
// so the weighted ReLU sum over heads is 32 multiply-adds and two quad
// shuffles, with no cross-warp reduction. The CTAs of a sequence split its
// live tiles evenly (the length is read on the device) and each CTA keeps a
// shared histogram that it adds to the sequence's once, at the end.
template <typename T, int kKSteps>
__global__ void __launch_bounds__(kScoreThreads) dsa_score_kernel(const __grid_constant__ IndexerParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char smem[];
  // Only the histogram adds wait for the clear kernel (see dsa_clear_kernel).
  const int b = blockIdx.y;
  const int64_t len = row_len(p, b);
  if (len <= p.topk) {  // the window fits the top-k: nothing to score
    cuda::pdl_wait_primary();
    return;
  }
  const int key_seq = p.q_len == 1 ? b : b / p.q_len;  // whose keys this row scores
  const int64_t tiles = (len + kTileTokens - 1) / kTileTokens;
  const int64_t per_cta = (tiles + gridDim.x - 1) / gridDim.x;
  const int64_t tile0 = int64_t{blockIdx.x} * per_cta;
  const int64_t ntiles = min(per_cta, tiles - tile0);
  if (ntiles <= 0) {
    cuda::pdl_wait_primary();
    return;
  }
  const ScoreLayout L(p.heads, p.dim);
  const uint32_t raw = cuda::smem_u32(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* gen = smem + (base - raw);
  float* w_s = reinterpret_cast<float*>(gen + L.weights);
  int32_t* hist_s = reinterpret_cast<int32_t*>(gen + L.hist);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int pieces = kKSteps > 0 ? 2 * kKSteps : p.dim / 8;  // 16-byte pieces per key or query row
  const uint32_t bars = base + static_cast<uint32_t>(L.barriers);
  int32_t* flags_s = reinterpret_cast<int32_t*>(gen + L.flags);  // thread 0's alone until the end
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) cuda::mbar::init(bars + 8 * s, 1);
    cuda::mbar::init_fence();
    *flags_s = 0;
  }

  // The queries of every head chunk (padded heads zero), by cp.async.
  const T* q = static_cast<const T*>(p.q_index) + int64_t{b} * p.heads * p.dim;
  for (int i = tid; i < L.chunks * kHeadChunk * pieces; i += kScoreThreads) {
    const int h = i / pieces, piece = i % pieces;
    const bool live = h < p.heads;
    cuda::cp_async_16(base + L.q + (h / kHeadChunk) * L.slabs * kSlabBytes + slab_offset(h % kHeadChunk, piece),
                      live ? q + h * p.dim + piece * 8 : q, live);
  }
  cuda::cp_async_commit();
  for (int h = tid; h < L.chunks * kHeadChunk; h += kScoreThreads) {
    w_s[h] = h < p.heads ? __ldcg(&p.weights[int64_t{b} * p.heads + h]) : 0.0f;
  }
  for (int i = tid; i < kBins; i += kScoreThreads) hist_s[i] = 0;
  __syncthreads();  // the barriers are initialised before any copy counts on them

  const auto stage_of = [&](int64_t i) {
    return base + static_cast<uint32_t>(L.keys + (i % kStages) * L.slabs * kSlabBytes);
  };
  // The index keys of this CTA's tile i: thread 0 issues its boxes (one per
  // slab and block, key_box) onto the stage's barrier, then expects their
  // bytes. Dense rows past the capacity arrive as zeros; rows past the window
  // are read but never scored; a block id outside the pool is not read and
  // refuses the row.
  const auto load_tile = [&](int64_t i) {
    if (tid == 0 && i < ntiles) {
      const uint32_t bar = bars + 8 * static_cast<uint32_t>(i % kStages);
      uint32_t bytes = 0;
      for (int j = 0; j < kTileTokens / p.box_rows; ++j) {
        const KeyBox box = key_box(p, key_seq, tile0 + i, j, len, [&](int64_t e) {
          return e < p.max_blocks ? __ldg(&p.block_table[int64_t{key_seq} * p.table_stride + e]) : -1;
        });
        if (box.live && !box.ok) *flags_s = kIndexErrorBlock;
        if (!box.ok) continue;
        for (int sl = 0; sl < L.slabs; ++sl) {
          tma_load_3d(stage_of(i) + sl * kSlabBytes + j * p.box_rows * 128, &p.keys, bar, sl * 64, box.y, box.z);
        }
        bytes += static_cast<uint32_t>(L.slabs * p.box_rows * 128);
      }
      cuda::mbar::arrive_expect_tx(bar, bytes);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load_tile(s);
  cuda::cp_async_wait<0>();          // the queries landed for this thread
  cuda::wgmma::fence_proxy_async();  // ... and are visible to the tensor cores (the loop's barrier: for all)

  float* out = p.scores + int64_t{b} * p.pitch;
  for (int64_t i = 0; i < ntiles; ++i) {
    cuda::mbar::wait(bars + 8 * static_cast<uint32_t>(i % kStages), static_cast<uint32_t>((i / kStages) & 1));
    __syncthreads();  // every thread is past tile i - 1: its stage is free
    load_tile(i + kStages - 1);
    float part[2] = {0.0f, 0.0f};  // rows (positions) warp * 16 + lane / 4, and + 8
    for (int c = 0; c < L.chunks; ++c) {
      float d[32];
      score_chunk<T, kKSteps>(stage_of(i), base + static_cast<uint32_t>(L.q + c * L.slabs * kSlabBytes), p.dim / 16, d);
      // d[4j + e] is head 8j + 2 (lane % 4) + e at the first row, d[4j + 2 + e] at the second.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int h = c * kHeadChunk + 8 * j + 2 * (lane % 4) + e;
          // Padded heads are never added: a zero query against an inf key
          // is NaN, which the CPU rule (which has no such head) would not see.
          if (h < p.heads) {
            const float w = w_s[h];
            part[0] += w * relu_keep_nan(d[4 * j + e]);
            part[1] += w * relu_keep_nan(d[4 * j + 2 + e]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      part[r] += __shfl_xor_sync(0xffffffffu, part[r], 1);
      part[r] += __shfl_xor_sync(0xffffffffu, part[r], 2);
    }
    // Lane 4g writes the first row of group g, lane 4g + 1 the second.
    const int q4 = lane % 4;
    const int64_t t = (tile0 + i) * kTileTokens + warp * 16 + lane / 4 + (q4 == 1 ? 8 : 0);
    const bool live = q4 < 2 && t < len;
    const float s = q4 == 1 ? part[1] : part[0];
    record_score(out, hist_s, t, s, live, lane);
  }
  __syncthreads();           // every position is in the shared histogram (every issued tile was waited for)
  cuda::pdl_wait_primary();  // the clear kernel has zeroed the histograms and the row errors
  if (tid == 0 && *flags_s != 0) atomicOr(&p.row_error[b], *flags_s);
  int32_t* hist = p.hist + int64_t{b} * kBins;
  for (int i = tid; i < kBins; i += kScoreThreads) {
    const int32_t v = hist_s[i];
    if (v != 0) atomicAdd(&hist[i], v);
  }
#else
  __trap();  // warpgroup MMA and TMA exist on sm_90a only; the launcher refuses other GPUs first
#endif
}

// Scores at the production index geometry (64 heads x 128 dims), of
// one-token and multi-token steps: blockIdx.y is (sequence, group of up to
// kTokens tokens), and each key tile, staged once, is scored against all of
// the group's (token, head) queries: wgmma chains of up to two tokens each
// (N = 64 or 128), so the keys are read from global memory once for the
// group. Two producer warps stream the CTA's key tiles by TMA through the
// stages of GroupShape (full and empty mbarriers), one for each of the two
// consumer warpgroups, which take alternate tiles, so one warpgroup's epilogue (ReLU,
// weights, the sum over heads, the histogram) runs under the other's MMAs,
// and with four tokens the first chain's epilogue runs under the second
// chain's MMAs. Each row keeps its own causal window (its
// scores and histogram stop at its length; a row whose window fits the
// top-k is not scored, as in dsa_score_kernel) and its own histogram.
template <typename T, int kTokens>
__global__ void __launch_bounds__(kGroupThreads, GroupShape<kTokens>::kCtasPerSm)
    dsa_score_group_kernel(const __grid_constant__ IndexerParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = GroupScoreLayout<kTokens>;
  // Two tokens per wgmma chain (N = 128), each chain its own commit group,
  // so the first chain's epilogue overlaps the second one's MMAs (measured
  // against one N = 256 chain per tile: PERFORMANCE.md).
  constexpr int kChainTokens = kTokens < 2 ? kTokens : 2;
  constexpr int kChains = kTokens / kChainTokens;
  constexpr int kGroupStages = L::kStages;
  extern __shared__ __align__(16) unsigned char smem[];
  // Only the histogram adds wait for the clear kernel (see dsa_clear_kernel).
  GroupWork work = group_work<kTokens, kGroupThreads>(p);
  if (!work.begin<kTokens>(p)) return;
  const int seq = work.seq, first = work.first, ntok = work.ntok;
  const int64_t len = work.window(p, ntok - 1);  // the group's longest window
  const int64_t tile0 = work.tile0, ntiles = work.ntiles;
  const uint32_t raw = cuda::smem_u32(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* gen = smem + (base - raw);
  float* w_s = reinterpret_cast<float*>(gen + L::kWeights);
  int32_t* hist_s = reinterpret_cast<int32_t*>(gen + L::kHist);
  const int tid = threadIdx.x, lane = tid % 32;
  const uint32_t full = base + static_cast<uint32_t>(L::kBarriers);  // full[s] at full + 8 s
  const uint32_t empty = full + 8 * kGroupStages;                    // empty[s] at empty + 8 s
  uint32_t* refused_s = reinterpret_cast<uint32_t*>(gen + L::kFlags);
  init_group_barriers<kGroupStages>(tid, full, empty, refused_s);
  // The queries: row tl * 64 + h of two 64-column slabs (rows of absent
  // tokens zero), by cp.async; the weights; the histograms cleared.
  const int64_t row0 = int64_t{seq} * p.q_len + first;  // the group's first (sequence, token) row
  const T* q = static_cast<const T*>(p.q_index) + row0 * kGroupHeads * kGroupDim;
  for (int i = tid; i < kTokens * kGroupHeads * 16; i += kGroupThreads) {
    const int r = i / 16, piece = i % 16;  // r = tl * 64 + h
    const bool live = r / kGroupHeads < ntok;
    cuda::cp_async_16(
        base + static_cast<uint32_t>(L::kQ + (piece / 8) * L::kQSlab + r * 128) + (((piece % 8) ^ (r % 8)) << 4),
        live ? q + int64_t{r} * kGroupDim + piece * 8 : q, live);
  }
  cuda::cp_async_commit();
  for (int r = tid; r < kTokens * kGroupHeads; r += kGroupThreads) {
    w_s[r] = r / kGroupHeads < ntok ? __ldcg(&p.weights[row0 * kGroupHeads + r]) : 0.0f;
  }
  for (int i = tid; i < kTokens * kBins; i += kGroupThreads) hist_s[i] = 0;
  cuda::cp_async_wait<0>();          // the queries landed for this thread
  cuda::wgmma::fence_proxy_async();  // ... and are visible to the tensor cores
  __syncthreads();                   // for all, and the barriers are initialised

  const auto stage_of = [&](int64_t i) {
    return base + static_cast<uint32_t>(L::kKeys + (i % kGroupStages) * L::kStageBytes);
  };
  if (tid >= kGroupConsumers * 128) {
    // A producer warp, for its warpgroup's tiles: tile i once the stage's
    // previous tile (i - kGroupStages) has been released, one box per slab
    // and block (produce_key_tiles).
    int64_t windows[kTokens];
    work.scored_windows(p, windows);
    const uint32_t refused = produce_key_tiles<kGroupStages, kTokens>(
        p, seq, tile0, ntiles, len, windows, full, empty, lane,
        [&](const KeyBox& box, int j, int64_t i, uint32_t bar) {
          if (lane == 0) {
            for (int sl = 0; sl < 2; ++sl) {
              tma_load_3d(stage_of(i) + sl * kSlabBytes + j * p.box_rows * 128, &p.keys, bar, sl * 64, box.y, box.z);
            }
          }
          return static_cast<uint32_t>(2 * p.box_rows * 128);
        },
        (tid - kGroupConsumers * 128) / 32, kGroupConsumers);
    if (lane == 0 && refused != 0) atomicOr(refused_s, refused);
    __syncwarp();
  } else {
    // The warpgroup index from lane 0, so the compiler knows it is uniform
    // and keeps the tile's descriptors in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    const int warp = (tid % 128) / 32, q4 = lane % 4;  // warp within the warpgroup
    const uint64_t qd = cuda::wgmma::desc_sw128(base + static_cast<uint32_t>(L::kQ), 16, 1024);
    int64_t tlen[kTokens];  // each row's window, 0 for rows absent or not scored
    work.scored_windows(p, tlen);
    for (int64_t i = wg; i < ntiles; i += kGroupConsumers) {
      const uint32_t s = static_cast<uint32_t>(i % kGroupStages);
      cuda::mbar::wait(full + 8 * s, static_cast<uint32_t>((i / kGroupStages) & 1));
      const uint64_t kd = cuda::wgmma::desc_sw128(stage_of(i), 16, 1024);
      const int64_t t = (tile0 + i) * kTileTokens + warp * 16 + lane / 4 + (q4 == 1 ? 8 : 0);
      // The tile against the queries of two tokens per chain (N = 128: B
      // rows 128 c ..), each chain its own commit group.
      float d[kChains][32 * kChainTokens];  // chain c's accumulators: tokens c * kChainTokens ..
      cuda::wgmma::fence();
#pragma unroll
      for (int c = 0; c < kChains; ++c) {
#pragma unroll
        for (int kk = 0; kk < kGroupDim / 16; ++kk) {
          // k-step kk: slab kk / 4, 32 bytes per step inside the 128-byte row.
          const uint64_t a = kd + static_cast<uint64_t>(((kk / 4) * kSlabBytes + (kk % 4) * 32) >> 4);
          const uint64_t b =
              qd +
              static_cast<uint64_t>(((kk / 4) * L::kQSlab + c * kChainTokens * kGroupHeads * 128 + (kk % 4) * 32) >> 4);
          if constexpr (kChainTokens == 1) {
            cuda::wgmma::mma_m64n64k16<T>(d[c], a, b, kk > 0);
          } else {
            cuda::wgmma::mma_m64n128k16<T, cuda::wgmma::BMajor::kK>(d[c], a, b, kk > 0);
          }
        }
        cuda::wgmma::commit();
      }
      score_chains<0>(d, w_s, q4, empty + 8 * s, t, tlen, p, row0, hist_s, lane, [](float sum, int) { return sum; });
    }
  }
  publish_group(p, work, row0, ntok, refused_s, hist_s, tid);
#else
  __trap();  // warpgroup MMA and TMA exist on sm_90a only; the launcher refuses other GPUs first
#endif
}

// ---- 2. classify and the cut ------------------------------------------------

// The rule "keep the top k of (score key, position), ties to the lower
// position" is one comparison once the k-th largest composite C is known:
// position t is kept iff (key(t) << P | (2^P - 1 - t)) >= C. The coarse
// histogram narrows C to one bin; only the keys in that bin (the
// candidates) are ranked, and only by the last classify CTA of a sequence.

// The bin holding the keep-th largest key and how many keys lie in higher
// bins, into bin_out[0], bin_out[1]. Thread t sums 16 bins in descending
// order; CUB's block scan gives each thread the count above it.
template <int kThreads>
__device__ void find_threshold_bin(const int32_t* hist, int32_t keep,
                                   typename cub::BlockScan<int32_t, kThreads>::TempStorage& scan, int32_t* bin_out) {
  constexpr int kPer = kBins / kThreads;
  int32_t c[kPer];
  int32_t sum = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    c[e] = hist[kBins - 1 - (threadIdx.x * kPer + e)];
    sum += c[e];
  }
  int32_t before;
  cub::BlockScan<int32_t, kThreads>(scan).ExclusiveSum(sum, before);
  if (before < keep && keep <= before + sum) {
    int32_t run = before;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (run < keep && keep <= run + c[e]) {
        bin_out[0] = kBins - 1 - (threadIdx.x * kPer + e);
        bin_out[1] = run;
      }
      run += c[e];
    }
  }
  __syncthreads();
}

// (low key bits, position) as one composite: larger ranks first.
__device__ __forceinline__ uint64_t candidate_composite(uint32_t key, int64_t t, int bits) {
  return (static_cast<uint64_t>(key & ((1u << kLowKeyBits) - 1)) << bits) | ((uint64_t{1} << bits) - 1 - t);
}

struct CutStorage {
  int32_t hist[kBins];  // the candidates' next 12 key bits
  uint64_t items[kCutItems];
  cuda::RadixSelect<kClassifyThreads>::Storage select;
  typename cub::BlockScan<int32_t, kClassifyThreads>::TempStorage scan;
  int32_t bin[2];
  int32_t fine_count;
  unsigned long long min_kept;
};

// Adds one kept candidate to its slice's count: one atomic per distinct slice
// among the converged lanes (a classify CTA's candidates are contiguous in
// the list, so neighbours mostly share a slice).
__device__ __forceinline__ void count_in_slice(int32_t* slice_kept, int64_t t) {
  const int64_t s = t / kSlice;
  const uint32_t peers = __match_any_sync(__activemask(), static_cast<uint32_t>(s));
  if (static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) atomicAdd(&slice_kept[s], __popc(peers));
}

// Calls f(x) for every candidate x of the list, kCandBatch loads per thread
// in flight at a time: a loop of one load each would wait an L2 round trip
// per iteration.
constexpr int kCandBatch = 8;
template <typename F>
__device__ __forceinline__ void for_each_candidate(const uint64_t* cands, int32_t n, F f) {
  for (int32_t first = 0; first < n; first += kClassifyThreads * kCandBatch) {
    uint64_t x[kCandBatch];
#pragma unroll
    for (int u = 0; u < kCandBatch; ++u) {
      const int32_t i = first + u * kClassifyThreads + static_cast<int32_t>(threadIdx.x);
      x[u] = i < n ? __ldcg(&cands[i]) : 0;
    }
#pragma unroll
    for (int u = 0; u < kCandBatch; ++u) {
      if (first + u * kClassifyThreads + static_cast<int32_t>(threadIdx.x) < n) f(x[u]);
    }
  }
}

// The last classify CTA of sequence b: the cut C and the candidates' slice
// counts. `above` keys lie in bins above the threshold bin `threshold`.
// Second level: a histogram of the candidates' next 12 key bits; those in a
// higher fine bin are kept outright, and the fine bin of the wanted-th
// largest (usually a handful) is radix-selected in shared memory.
__device__ void pick_cut(const IndexerParams& p, int b, uint32_t threshold, int32_t above, CutStorage& sh) {
  using Select = cuda::RadixSelect<kClassifyThreads>;
  const int tid = threadIdx.x;
  const int32_t n = __ldcg(&p.cand_count[b]);
  const int32_t wanted = p.topk - above;  // from the threshold bin: 1 <= wanted <= n
  const uint64_t* cands = p.candidates + int64_t{b} * p.pitch;
  int32_t* slice_kept = p.slice_kept + int64_t{b} * p.slices;
  const int fine_shift = p.position_bits + (kLowKeyBits - kBinBits);  // composite bits below the fine bin
  const uint64_t fine_mask = (uint64_t{1} << fine_shift) - 1;
  const uint64_t low = (uint64_t{1} << p.position_bits) - 1;
  const auto fine_of = [&](uint64_t x) { return static_cast<uint32_t>(x >> fine_shift) & (kBins - 1); };
  const auto position_of = [&](uint64_t x) { return static_cast<int64_t>(low - (x & low)); };

  for (int i = tid; i < kBins; i += kClassifyThreads) sh.hist[i] = 0;
  if (tid == 0) {
    sh.fine_count = 0;
    sh.min_kept = ~0ull;
  }
  __syncthreads();
  for_each_candidate(cands, n, [&](uint64_t x) { atomicAdd(&sh.hist[fine_of(x)], 1); });
  __syncthreads();
  find_threshold_bin<kClassifyThreads>(sh.hist, wanted, sh.scan, sh.bin);
  const uint32_t fine_bin = static_cast<uint32_t>(sh.bin[0]);
  const int32_t fine_wanted = wanted - sh.bin[1];  // from the fine bin: 1 <= fine_wanted <= fine_n
  const int32_t fine_n = sh.hist[fine_bin];
  const bool in_smem = fine_n <= kCutItems;
  for_each_candidate(cands, n, [&](uint64_t x) {
    const uint32_t fine = fine_of(x);
    if (fine > fine_bin) count_in_slice(slice_kept, position_of(x));
    if (fine == fine_bin && in_smem) sh.items[atomicAdd(&sh.fine_count, 1)] = x;
  });
  __syncthreads();
  const auto keep = [&](uint64_t x) {
    count_in_slice(slice_kept, position_of(x));
    atomicMin(&sh.min_kept, static_cast<unsigned long long>(x));
  };
  if (in_smem) {
    const cuda::RadixCut cut =
        Select::run([&](int32_t i) { return sh.items[i] & fine_mask; }, fine_n, fine_wanted, fine_shift, sh.select);
    for (int32_t i = tid; i < fine_n; i += kClassifyThreads) {
      if (cut.keeps(sh.items[i] & fine_mask)) keep(sh.items[i]);
    }
  } else {  // a wide tie (e.g. many equal scores): rank every candidate from global memory
    const cuda::RadixCut cut =
        Select::run([&](int32_t i) { return __ldcg(&cands[i]); }, n, wanted, kLowKeyBits + p.position_bits, sh.select);
    for_each_candidate(cands, n, [&](uint64_t x) {
      if (fine_of(x) == fine_bin && cut.keeps(x)) keep(x);
    });
  }
  __syncthreads();
  if (tid == 0) p.cut[b] = (static_cast<uint64_t>(threshold) << (kLowKeyBits + p.position_bits)) | sh.min_kept;
}

// One CTA per slice: lanes read consecutive positions, each warp 8 words of 32.
__global__ void __launch_bounds__(kClassifyThreads) dsa_classify_kernel(const __grid_constant__ IndexerParams p) {
  using Reduce = cub::BlockReduce<int32_t, kClassifyThreads>;
  constexpr int kWordsPerWarp = kSlice / 32 / (kClassifyThreads / 32);
  __shared__ CutStorage sh;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ int32_t bin[2];
  __shared__ int32_t last;
  const int b = blockIdx.y;
  const int64_t len = row_len(p, b);  // written before the score kernel started: safe before the wait
  const int64_t first = int64_t{blockIdx.x} * kSlice;
  if (len <= p.topk || first >= len) {
    cuda::pdl_wait_primary();  // no grid of the chain completes before the one it follows
    return;
  }
  cuda::pdl_launch_dependents();  // the compaction may be scheduled; it waits for this grid
  cuda::pdl_wait_primary();       // the scores and the histogram are complete and visible
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t w_first = first + int64_t{warp} * kWordsPerWarp * 32;
  const float* s = p.scores + int64_t{b} * p.pitch;
  float v[kWordsPerWarp];  // requested before the histogram is scanned
#pragma unroll
  for (int e = 0; e < kWordsPerWarp; ++e) {
    const int64_t t = w_first + e * 32 + lane;
    v[e] = t < len ? s[t] : 0.0f;
  }
  find_threshold_bin<kClassifyThreads>(p.hist + int64_t{b} * kBins, p.topk, sh.scan, bin);
  const uint32_t threshold = static_cast<uint32_t>(bin[0]);
  uint32_t cand[kWordsPerWarp];
  int32_t above = 0, total = 0;
#pragma unroll
  for (int e = 0; e < kWordsPerWarp; ++e) {
    const int64_t t = w_first + e * 32 + lane;
    const uint32_t key_bin = cuda::score_key(v[e]) >> kLowKeyBits;
    const bool live = t < len;
    above += __popc(__ballot_sync(0xffffffffu, live && key_bin > threshold));
    cand[e] = __ballot_sync(0xffffffffu, live && key_bin == threshold);
    total += __popc(cand[e]);
  }
  // One atomic per warp reserves its candidates' slots.
  int32_t slot = 0;
  if (lane == 0 && total > 0) slot = atomicAdd(&p.cand_count[b], total);
  slot = __shfl_sync(0xffffffffu, slot, 0);
  uint64_t* cands = p.candidates + int64_t{b} * p.pitch;
#pragma unroll
  for (int e = 0; e < kWordsPerWarp; ++e) {
    if ((cand[e] >> lane) & 1u) {
      const int64_t t = w_first + e * 32 + lane;
      cands[slot + __popc(cand[e] & ((1u << lane) - 1))] =
          candidate_composite(cuda::score_key(v[e]), t, p.position_bits);
    }
    slot += __popc(cand[e]);
  }
  const int32_t slice_above = Reduce(reduce).Sum(lane == 0 ? above : 0);
  if (threadIdx.x == 0 && slice_above > 0) atomicAdd(&p.slice_kept[int64_t{b} * p.slices + blockIdx.x], slice_above);
  // Arrival: the last CTA of the sequence sees every other CTA's candidates.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t active = static_cast<int32_t>((len + kSlice - 1) / kSlice);
    last = atomicAdd(&p.done[b], 1) == active - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  pick_cut(p, b, threshold, bin[1], sh);
}

// ---- 3. the ordered output --------------------------------------------------

// One CTA per slice: the kept count of the earlier slices is its offset;
// each thread tests its 8 consecutive positions against the cut, and a block
// scan gives every kept position its slot.
__global__ void __launch_bounds__(kCompactThreads) dsa_compact_kernel(const __grid_constant__ IndexerParams p) {
  using Scan = cub::BlockScan<int32_t, kCompactThreads>;
  using Reduce = cub::BlockReduce<int32_t, kCompactThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int32_t offset;
  const int b = blockIdx.y;
  const int64_t len = row_len(p, b);
  cuda::pdl_launch_dependents();  // a PDL-launched consumer (the attention) may start its prologue
  int32_t* out = p.positions + int64_t{b} * p.topk;
  // A refused row selects nothing: every entry -1, its bits raised, and its
  // count -1, which the decode reads as a bad length: it poisons and flags
  // that request (the rest of the batch is untouched).
  const auto refuse = [&](int32_t bits) {
    if (blockIdx.x != 0) return;
    for (int32_t i = threadIdx.x; i < p.topk; i += kCompactThreads) out[i] = -1;
    if (threadIdx.x == 0) {
      p.counts[b] = -1;
      if (p.error != nullptr) atomicOr(p.error, bits);
    }
  };
  if (len <= p.topk) {  // the window fits the top-k: every position, no scores needed
    if (len < 0) {
      refuse(kIndexErrorLength);
    } else if (blockIdx.x == 0) {
      for (int32_t i = threadIdx.x; i < p.topk; i += kCompactThreads) out[i] = i < len ? i : -1;
      if (threadIdx.x == 0) p.counts[b] = static_cast<int32_t>(len);
    }
    cuda::pdl_wait_primary();  // no grid of the chain completes before the one it follows
    return;
  }
  cuda::pdl_wait_primary();  // the classify grid (and so the scores and the row errors) is complete and visible
  const int32_t refused = __ldcg(&p.row_error[b]);
  if (refused != 0) {
    refuse(refused);
    return;
  }
  const int64_t first = int64_t{blockIdx.x} * kSlice;
  if (first >= len) return;
  // Every read is requested before any is used: one round trip. The row's
  // last slice reads only what the score kernel wrote (below len), so no
  // stale score is ever loaded, even one the cut would ignore.
  const int64_t t0 = first + 8 * int64_t{threadIdx.x};
  const float* row = p.scores + int64_t{b} * p.pitch + t0;
  float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
  if (t0 + 8 <= len) {
    lo = reinterpret_cast<const float4*>(row)[0];
    hi = reinterpret_cast<const float4*>(row)[1];
  } else if (t0 < len) {  // the thread that holds len: one score at a time
    const int64_t n = len - t0;
    lo.x = row[0];
    if (n > 1) lo.y = row[1];
    if (n > 2) lo.z = row[2];
    if (n > 3) lo.w = row[3];
    if (n > 4) hi.x = row[4];
    if (n > 5) hi.y = row[5];
    if (n > 6) hi.z = row[6];
  }
  const uint64_t cut = p.cut[b];
  int32_t before = 0;
  for (int64_t s = threadIdx.x; s < int64_t{blockIdx.x}; s += kCompactThreads) {
    before += p.slice_kept[int64_t{b} * p.slices + s];
  }
  before = Reduce(tmp.reduce).Sum(before);
  if (threadIdx.x == 0) offset = before;
  __syncthreads();  // the reduce storage is free for the scan
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const uint64_t low = (uint64_t{1} << p.position_bits) - 1;
  uint32_t keep = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t t = t0 + j;
    const uint64_t x =
        (static_cast<uint64_t>(cuda::score_key(v[j])) << p.position_bits) | (low - static_cast<uint64_t>(t));
    if (t < len && x >= cut) keep |= 1u << j;
  }
  int32_t slot;
  Scan(tmp.scan).ExclusiveSum(__popc(keep), slot);
  slot += offset;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if ((keep >> j) & 1u) {
      if (slot < p.topk) out[slot] = static_cast<int32_t>(t0 + j);
      ++slot;
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) p.counts[b] = p.topk;
}

// ---- launch -----------------------------------------------------------------

// Step 0: the coarse histograms and the counters cleared (`n` 16-byte
// words), as a programmatic dependent launch rather than a memset, so that
// in a captured step it is scheduled while the kernel before it drains. It
// waits first (the previous call's classify and compact kernels read these
// words), and only then lets the score grid start. So everything the score
// kernels read (the step's appended keys and lengths, the queries and
// weights the caller produced before this call) was complete before their
// grid launched, and they score under the clear; only their histogram adds
// wait for it. Every score CTA waits before it exits, so the score grid
// never completes before this one.
struct ClearArgs {
  uint4* words;
  int64_t n;
};

__global__ void dsa_clear_kernel(const __grid_constant__ ClearArgs a) {
  cuda::pdl_wait_primary();
  cuda::pdl_launch_dependents();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.n; i += int64_t{gridDim.x} * blockDim.x) {
    a.words[i] = make_uint4(0, 0, 0, 0);
  }
}

void launch_clear(void* workspace, size_t bytes, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const ClearArgs a{static_cast<uint4*>(workspace), static_cast<int64_t>(bytes / sizeof(uint4))};
  const int64_t ctas = std::min<int64_t>((a.n + kThreads - 1) / kThreads, 4 * int64_t{cuda_multiprocessor_count()});
  cuda::launch_with_pdl(dsa_clear_kernel, dim3(static_cast<unsigned>(ctas)), dim3(kThreads), 0, stream, a);
}

// The keys' tensor map (core/index_key_map.h: dense rows, a native pool,
// or an FP8 pool's values), checked against the driver's rules first so a
// map it would refuse is named with the value and the rule it breaks.
// Encoded on the host at each call (the pointers may change); no device work.
CUtensorMap encode_key_map(const detail::KeyTensorMap& m) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  const std::string problem = detail::key_map_problem(m);
  REQUIRE(problem.empty(), "the index keys' tensor map breaks a cuTensorMapEncodeTiled rule: " + problem);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    SP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    if (fn == nullptr || status != cudaDriverEntryPointSuccess)
      throw Error("dsa_select_tokens_cuda: no cuTensorMapEncodeTiled");
    return reinterpret_cast<Encode>(fn);
  }();
  const CUtensorMapDataType type = m.element == detail::KeyMapElement::kU8    ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : m.element == detail::KeyMapElement::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                              : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[3] = {m.dims[0], m.dims[1], m.dims[2]};
  const cuuint64_t strides[2] = {m.strides[0], m.strides[1]};
  const cuuint32_t box[3] = {m.box[0], m.box[1], m.box[2]};
  const cuuint32_t element_strides[3] = {m.element_strides[0], m.element_strides[1], m.element_strides[2]};
  CUtensorMap map{};
  const CUresult r = encode(&map, type, 3, const_cast<void*>(m.address), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  REQUIRE(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (" + std::to_string(r) +
                                 ") on the index keys' map: " + detail::describe_key_map(m));
  return map;
}

// The keys as a 3-d tensor for TMA (core/index_key_map.h). Dense rows:
// (column, position, sequence), boxes of 64 columns x 64 positions. Paged
// blocks: (column, row in block, block), boxes of 64 columns (native) or the
// 128 value bytes (FP8) x box_rows rows.
CUtensorMap key_tensor_map(const IndexerParams& p, DType dtype, const PagedIndexKeys& paged) {
  if (p.paged == 0) {
    return encode_key_map(detail::dense_key_map(dtype, p.k_cache, p.row_stride, p.key_offset, p.dim, p.capacity,
                                                p.batch / p.q_len));  // key sequences
  }
  return encode_key_map(detail::paged_key_map(paged, p.dim));
}

// The score grid: per sequence, an equal share of one wave of resident CTAs
// (at least one), never more CTAs than tiles. Each CTA loads the queries
// once and streams its tiles.
template <typename T, int kKSteps>
void launch_scores(const IndexerParams& p, int32_t batch, int64_t max_kv_len, cudaStream_t stream) {
  const size_t smem = ScoreLayout(p.heads, p.dim).smem_bytes();
  cuda::configure_smem_once(dsa_score_kernel<T, kKSteps>, 227 * 1024);
  const int64_t fit = std::clamp<int64_t>(static_cast<int64_t>((228 * 1024) / (smem + 1024)), 1, kScoreCtasPerSm);
  const int64_t wave = fit * cuda_multiprocessor_count();
  const int64_t tiles = (max_kv_len + kTileTokens - 1) / kTileTokens;
  const int64_t per_sequence = std::clamp<int64_t>(wave / batch, 1, tiles);
  const dim3 grid(static_cast<unsigned>(per_sequence), static_cast<unsigned>(batch));
  cuda::launch_with_pdl(dsa_score_kernel<T, kKSteps>, grid, dim3(kScoreThreads), smem, stream, p);
}

// The group score grid: a wave of resident CTAs (GroupShape's CTAs per SM)
// and one per token group, the live tiles shared among them on the device
// (group_work).
template <typename T, int kTokens>
void launch_group_scores(const IndexerParams& p, cudaStream_t stream) {
  constexpr size_t smem = GroupScoreLayout<kTokens>::kSmemBytes;
  cuda::configure_smem_once(dsa_score_group_kernel<T, kTokens>, smem);
  IndexerParams q = p;
  q.wave = GroupShape<kTokens>::kCtasPerSm * cuda_multiprocessor_count();
  cuda::launch_with_pdl(dsa_score_group_kernel<T, kTokens>, dim3(group_grid(q, kTokens)), dim3(kGroupThreads), smem,
                        stream, q);
}

template <typename T>
void launch_scores(const IndexerParams& p, int32_t batch, int64_t max_kv_len, cudaStream_t stream) {
  if (p.heads == kGroupHeads && p.dim == kGroupDim) {
    // The production geometry: the (token, head) queries of one, two or
    // four tokens per key tile (one token too: the producer warp and the
    // two consumer warpgroups beat dsa_score_kernel's one warpgroup per CTA
    // at every measured shape, PERFORMANCE.md).
    if (p.q_len == 1)
      launch_group_scores<T, 1>(p, stream);
    else if (p.q_len == 2)
      launch_group_scores<T, 2>(p, stream);
    else
      launch_group_scores<T, 4>(p, stream);
  } else if (p.dim == 128) {
    // Each (sequence, token) row on its own; the production head dim (128)
    // gets an unrolled k-chain, others loop.
    launch_scores<T, 8>(p, batch, max_kv_len, stream);
  } else {
    launch_scores<T, 0>(p, batch, max_kv_len, stream);
  }
}

}  // namespace

size_t dsa_indexer_workspace_bytes(const DsaConfig& c, int32_t batch, int64_t max_kv_len) {
  detail::check_dsa_indexer_cuda(c, batch);
  if (max_kv_len < 1) throw Error("dsa_indexer_workspace_bytes: max_kv_len must be at least 1");
  return Workspace(batch, max_kv_len).total;
}

void dsa_select_tokens_cuda(const DsaConfig& c, int32_t sequences, const DsaIndexerArgs& a, void* stream) {
  detail::dsa_select_tokens_cuda(c, sequences, a, kMaxQueryTokens, stream);
}

void detail::dsa_select_tokens_cuda(const DsaConfig& c, int32_t sequences, const DsaIndexerArgs& a, int32_t max_q_len,
                                    void* stream) {
  // Warpgroup MMAs and TMA: the MLA kernel's requirement (an sm_90 GPU and sm_90a code), asked of the same rule.
  const std::string arch = cuda_arch_problem(cuda_device_sm(), 512, 512, 64);
  REQUIRE(arch.empty(), "the DSA indexer scores with warpgroup MMAs and TMA, as the MLA kernel does: " + arch);
  REQUIRE(a.q_len >= 1 && a.q_len <= max_q_len,
          "q_len = " + std::to_string(a.q_len) + " must lie in [1, " + std::to_string(max_q_len) + "]");
  REQUIRE(int64_t{sequences} * a.q_len <= 65535,
          "batch * q_len = " + std::to_string(int64_t{sequences} * a.q_len) + " rows exceed 65535");
  const int32_t batch = sequences * a.q_len;  // (sequence, token) rows
  detail::check_dsa_indexer_cuda(c, batch);
  REQUIRE(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
          std::string("dtype must be f16 or bf16, got ") + dtype_name(a.dtype));
  const bool paged = a.key_layout == IndexKeyLayout::kPaged;
  REQUIRE(a.q_index != nullptr && a.weights != nullptr && a.kv_lens != nullptr && a.positions != nullptr &&
              a.counts != nullptr && (paged || a.k_cache != nullptr),
          "q_index, weights, kv_lens, positions, counts and (dense keys) k_cache must be set");
  REQUIRE(reinterpret_cast<uintptr_t>(a.q_index) % 16 == 0, "q_index must be 16-byte aligned");
  REQUIRE(a.max_kv_len >= 1 && a.max_kv_len <= std::numeric_limits<int32_t>::max(),
          "max_kv_len = " + std::to_string(a.max_kv_len) + " must lie in [1, 2^31) (int32 positions)");
  const std::string source = detail::index_source_problem(c, a);
  REQUIRE(source.empty(), source);
  const bool fp8 = paged && a.paged.format == IndexKeyFormat::kE4m3;
  if (paged) {
    REQUIRE(!fp8 || (c.index_heads == kGroupHeads && c.index_head_dim == kGroupDim),
            "FP8 index keys are scored at 64 index heads x 128 only (index_heads = " + std::to_string(c.index_heads) +
                ", index_head_dim = " + std::to_string(c.index_head_dim) + ")");
  } else {
    REQUIRE(reinterpret_cast<uintptr_t>(a.k_cache) % 16 == 0, "k_cache must be 16-byte aligned");
    REQUIRE(a.capacity >= 1 && a.max_kv_len <= a.capacity, "need 1 <= max_kv_len <= capacity (max_kv_len " +
                                                               std::to_string(a.max_kv_len) + ", capacity " +
                                                               std::to_string(a.capacity) + ")");
  }
  const Workspace ws(batch, a.max_kv_len);
  REQUIRE(a.workspace != nullptr && a.workspace_bytes >= ws.total,
          "the workspace holds " + std::to_string(a.workspace_bytes) + " bytes, dsa_indexer_workspace_bytes asks for " +
              std::to_string(ws.total));
  REQUIRE(reinterpret_cast<uintptr_t>(a.workspace) % 16 == 0, "the workspace must be 16-byte aligned");
  const size_t smem = ScoreLayout(c.index_heads, c.index_head_dim).smem_bytes();
  REQUIRE(smem <= 227 * 1024, "index_heads = " + std::to_string(c.index_heads) +
                                  " with index_head_dim = " + std::to_string(c.index_head_dim) + " needs " +
                                  std::to_string(smem) + " bytes of shared memory (max 232448)");
  auto* base = static_cast<unsigned char*>(a.workspace);
  IndexerParams p{};
  p.k_cache = a.k_cache;
  p.q_index = a.q_index;
  p.weights = a.weights;
  p.kv_lens = a.kv_lens;
  p.row_stride = int64_t{c.latent_dim} + c.index_head_dim;
  p.capacity = a.capacity;
  p.max_kv_len = a.max_kv_len;
  p.pitch = ws.pitch;
  p.slices = ws.slices;
  p.batch = batch;
  p.q_len = a.q_len;
  p.key_offset = c.latent_dim;
  p.heads = c.index_heads;
  p.dim = c.index_head_dim;
  p.topk = c.index_topk;
  p.position_bits = cuda::position_bits(a.max_kv_len);
  p.hist = reinterpret_cast<int32_t*>(base + ws.hist);
  p.cand_count = reinterpret_cast<int32_t*>(base + ws.cand_count);
  p.done = reinterpret_cast<int32_t*>(base + ws.done);
  p.row_error = reinterpret_cast<int32_t*>(base + ws.row_error);
  p.slice_kept = reinterpret_cast<int32_t*>(base + ws.slice_kept);
  p.cut = reinterpret_cast<uint64_t*>(base + ws.cut);
  p.scores = reinterpret_cast<float*>(base + ws.scores);
  p.candidates = reinterpret_cast<uint64_t*>(base + ws.candidates);
  p.positions = a.positions;
  p.counts = a.counts;
  p.error = a.error;
  p.dtype = a.dtype;
  p.box_rows = kTileTokens;
  if (paged) {
    p.paged = 1;
    p.block_table = a.paged.block_table;
    p.table_stride = a.paged.block_table_stride;
    p.max_blocks = a.paged.max_blocks;
    p.block_size = a.paged.block_size;
    p.box_rows = detail::paged_key_box_rows(a.paged.block_size);
    p.num_blocks = a.paged.num_blocks;
    p.pool = static_cast<const unsigned char*>(a.paged.pool);
    p.block_bytes = index_key_block_bytes(a.paged, c.index_head_dim);
    p.q_e4m3 = a.q_format == IndexQueryFormat::kE4m3 ? 1 : 0;
  }
  auto s = static_cast<cudaStream_t>(stream);
  const dim3 slices(static_cast<unsigned>(ws.slices), static_cast<unsigned>(batch));
  if (a.max_kv_len > c.index_topk) {  // some sequence may need scoring
    p.keys = key_tensor_map(p, a.dtype, a.paged);
    launch_clear(a.workspace, ws.cleared, s);
    if (fp8) {
      launch_fp8_scores(p, s);
    } else if (a.dtype == DType::kBF16) {
      launch_scores<__nv_bfloat16>(p, batch, a.max_kv_len, s);
    } else {
      launch_scores<__half>(p, batch, a.max_kv_len, s);
    }
    // Each grid is scheduled while the one before drains and waits for its writes.
    cuda::launch_with_pdl(dsa_classify_kernel, slices, dim3(kClassifyThreads), 0, s, p);
    cuda::launch_with_pdl(dsa_compact_kernel, slices, dim3(kCompactThreads), 0, s, p);
  } else {
    // Nothing of ours ran before: a plain launch, ordered after all earlier work.
    dsa_compact_kernel<<<slices, kCompactThreads, 0, s>>>(p);
    SP_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparsepage

#undef REQUIRE
