// The DSA lightning indexer on the GPU (rule in include/sparsepage/models/
// dsa.h). Grids and the workspace are sized from the host bound max_kv_len;
// each sequence's live length is read on the device, so one captured graph
// serves a growing context. On the caller's stream:
//   0. a memset clears the coarse histograms and candidate counters;
//   1. dsa_score_kernel scores a slice of positions per CTA on tensor cores
//      (mma.sync m16n8k16, fp32 accumulation: index heads x tokens x dim),
//      applies the ReLU and the weighted sum over heads, writes fp32 scores
//      and histograms the top 12 bits of each score's order key;
//   2. dsa_filter_kernel (many CTAs per sequence) finds the histogram bin
//      holding the k-th largest key, marks every position in a higher bin in
//      a bitmap, appends the positions of that bin as candidates and
//      histograms the candidates' next 12 key bits;
//   3. dsa_finish_kernel (one CTA per sequence) keeps the candidates of the
//      higher fine bins, radix-selects the missing count inside the fine bin
//      by (score, position) composites (ties to the lower position), adds
//      them to the bitmap and compacts the bitmap into increasing positions,
//      padding with -1 and writing the count.
// The filter and the finish are programmatic dependent launches.
// Nothing here allocates, synchronizes or reads back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>
#include <string>

#include "core/cuda_hooks.h"
#include "models/dsa_kernels.h"
#include "cuda/common.cuh"
#include "cuda/radix_select.cuh"
#include "sparsepage/models/dsa.h"

namespace sparsepage {
namespace {

// ---- geometry ---------------------------------------------------------------

constexpr int kScoreThreads = 128;
constexpr int kScoreWarps = kScoreThreads / 32;
constexpr int kTileTokens = 64;     // index keys per pipeline stage
constexpr int kStages = 3;          // two tiles in flight while one is scored
constexpr int kMaxTilesPerCta = 8;  // queries loaded once serve up to 512 positions
// The limits check_dsa_indexer_cuda enforces (models/dsa_kernels.h).
constexpr int kMaxIndexHeadDim = detail::kDsaMaxIndexHeadDim;
// Coarse histogram of the score keys' top 12 bits (sign, exponent, 3
// mantissa bits): the bin of the k-th largest holds the only ambiguous keys.
constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;
constexpr int kLowKeyBits = 32 - kBinBits;
constexpr int kFilterThreads = 256;
constexpr int kSlice = 2048;  // positions per filter CTA (a multiple of 32)
constexpr int kFinishThreads = 256;
constexpr int kSmemCandidates = 4096;  // fine-bin candidates ranked in shared memory; more rank from global memory

// Padded shared rows: dim + 8 elements is an odd number of 16-byte units
// (dim a multiple of 16), so the eight rows of an ldmatrix phase hit distinct banks.
__host__ __device__ constexpr int padded_dim(int dim) { return dim + 8; }
__host__ __device__ constexpr int padded_heads(int heads) { return (heads + 15) / 16 * 16; }

// Key stages, then the weights and the per-warp partial sums. The queries
// live in registers as mma fragments, not in shared memory.
size_t score_smem_bytes(int32_t heads, int32_t dim) {
  const size_t ld = static_cast<size_t>(padded_dim(dim));
  return 2 * kStages * kTileTokens * ld + sizeof(float) * (static_cast<size_t>(padded_heads(heads)) +
                                                           kScoreWarps * kTileTokens);
}

// ---- workspace --------------------------------------------------------------

// Byte offsets inside the caller's workspace; the first `cleared` bytes are
// zeroed by every launch.
struct Workspace {
  size_t hist, hist2, cand_count, cleared, bitmap, scores, candidates, total;
  int64_t words;  // bitmap words per sequence
  Workspace(int32_t batch, int64_t max_kv_len) {
    const auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t b = static_cast<size_t>(batch), n = static_cast<size_t>(max_kv_len);
    words = (max_kv_len + 31) / 32;
    hist = 0;
    hist2 = up(hist + b * kBins * sizeof(int32_t));
    cand_count = up(hist2 + b * kBins * sizeof(int32_t));
    cleared = up(cand_count + b * sizeof(int32_t));
    bitmap = cleared;
    scores = up(bitmap + b * static_cast<size_t>(words) * sizeof(uint32_t));
    candidates = up(scores + b * n * sizeof(float));
    total = candidates + b * n * sizeof(uint64_t);
  }
};

struct IndexerParams {
  const void* k_cache;     // [batch * capacity, row_stride]; index key at columns key_offset .. key_offset + dim
  const void* q_index;     // [batch, heads, dim]
  const float* weights;    // [batch, heads]
  const int32_t* kv_lens;  // [batch], device
  int64_t row_stride, capacity;
  int64_t pitch;           // max_kv_len: row pitch of scores and candidates
  int64_t words;           // bitmap words per sequence
  int32_t key_offset, heads, dim, topk;
  int32_t tiles_per_cta;
  int32_t position_bits;   // bits of a position below max_kv_len
  int32_t* hist;           // [batch, kBins]: score keys' top 12 bits
  int32_t* hist2;          // [batch, kBins]: the next 12 bits of the threshold bin's keys
  int32_t* cand_count;     // [batch]
  uint32_t* bitmap;        // [batch, words]
  float* scores;           // [batch, pitch]
  uint64_t* candidates;    // [batch, pitch]
  int32_t* positions;      // out [batch, topk]
  int32_t* counts;         // out [batch]
};

// ---- 1. scores on tensor cores ----------------------------------------------

// max(x, 0) exactly as the CPU rule's std::max(dot, 0.0f): NaN stays NaN.
__device__ __forceinline__ float relu_keep_nan(float x) { return x < 0.0f ? 0.0f : x; }

// Index keys of positions t0 .. t0 + kTileTokens - 1 into a padded stage by
// 16-byte cp.async (one commit group per call, possibly empty); positions
// past `end` are zero-filled, never read.
template <typename T>
__device__ void load_key_tile(const IndexerParams& p, int b, int64_t end, int64_t t0, T* stage) {
  const int chunks = p.dim / 8;
  const T* seq = static_cast<const T*>(p.k_cache) + int64_t{b} * p.capacity * p.row_stride + p.key_offset;
  if (t0 < end) {
    for (int i = threadIdx.x; i < kTileTokens * chunks; i += kScoreThreads) {
      const int r = i / chunks, c = i % chunks;
      const bool live = t0 + r < end;
      const T* src = seq + (live ? (t0 + r) * p.row_stride : 0) + c * 8;
      cuda::cp_async_16(cuda::smem_u32(stage + r * padded_dim(p.dim) + c * 8), src, live);
    }
  }
  cuda::cp_async_commit();
}

// The A operand of m-tile mt (heads mt * 16 ..) straight from global memory
// into mma fragment order: a0 (row g, k 2c..), a1 (row g + 8), a2 (k + 8),
// a3 (row g + 8, k + 8), g = lane / 4, c = lane % 4. Rows past the heads are 0.
template <typename T, int kKTiles>
__device__ __forceinline__ void load_query_fragments(const IndexerParams& p, int b, int mt, uint32_t (&a)[kKTiles][4]) {
  const int lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q_index) + int64_t{b} * p.heads * p.dim;
  const int h0 = mt * 16 + lane / 4, h1 = h0 + 8, col = (lane % 4) * 2;
#pragma unroll
  for (int kt = 0; kt < kKTiles; ++kt) {
    const bool k_ok = kt * 16 < p.dim;
    const int k0 = kt * 16 + col;
    a[kt][0] = k_ok && h0 < p.heads ? *reinterpret_cast<const uint32_t*>(q + h0 * p.dim + k0) : 0u;
    a[kt][1] = k_ok && h1 < p.heads ? *reinterpret_cast<const uint32_t*>(q + h1 * p.dim + k0) : 0u;
    a[kt][2] = k_ok && h0 < p.heads ? *reinterpret_cast<const uint32_t*>(q + h0 * p.dim + k0 + 8) : 0u;
    a[kt][3] = k_ok && h1 < p.heads ? *reinterpret_cast<const uint32_t*>(q + h1 * p.dim + k0 + 8) : 0u;
  }
}

// One m-tile's contribution to a staged tile: for heads mt * 16 .. + 15, the
// per-lane sums over its two head rows of w_h * ReLU(q_h . k_t), added to acc.
// Lane l holds tokens np * 16 + nt * 8 + 2 (l % 4) + {0, 1}; the sum over the
// warp's eight row groups happens once per tile.
template <typename T, int kKTiles>
__device__ __forceinline__ void score_m_tile(const IndexerParams& p, int mt, const uint32_t (&a)[kKTiles][4],
                                             const float* w_s, const T* k_s, float (&acc)[kTileTokens / 16][2][2]) {
  const int lane = threadIdx.x % 32;
  const int ld = padded_dim(p.dim);
  const int h0 = mt * 16 + lane / 4, h1 = h0 + 8;
  // Padded head rows are never added: a zero query against an inf key is
  // NaN, which the CPU rule (which has no such head) would not see.
  const float w0 = h0 < p.heads ? w_s[h0] : 0.0f, w1 = h1 < p.heads ? w_s[h1] : 0.0f;
#pragma unroll
  for (int np = 0; np < kTileTokens / 16; ++np) {
    float c[2][4] = {};
    const T* krow = k_s + (np * 16 + (lane % 8) + (lane / 16) * 8) * ld + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int kt = 0; kt < kKTiles; ++kt) {
      if (kt * 16 < p.dim) {
        uint32_t bf[4];
        cuda::ldmatrix_x4(bf, cuda::smem_u32(krow + kt * 16));
        cuda::mma_16816<T>(c[0], a[kt], bf[0], bf[1]);
        cuda::mma_16816<T>(c[1], a[kt], bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = 0.0f;
        if (h0 < p.heads) v += w0 * relu_keep_nan(c[nt][e]);
        if (h1 < p.heads) v += w1 * relu_keep_nan(c[nt][2 + e]);
        acc[np][nt][e] += v;
      }
    }
  }
}

template <typename T, int kKTiles>
__global__ void __launch_bounds__(kScoreThreads) dsa_score_kernel(const __grid_constant__ IndexerParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];
  const int64_t per_cta = int64_t{kTileTokens} * p.tiles_per_cta;
  const int64_t first = int64_t{blockIdx.x} * per_cta;
  if (len <= p.topk || first >= len) return;  // the window fits the top-k, or this slice is past it
  const int64_t end = min(len, first + per_cta);
  const int ld = padded_dim(p.dim), hp = padded_heads(p.heads);
  T* k_s = reinterpret_cast<T*>(smem);                                      // [kStages][kTileTokens][ld]
  float* w_s = reinterpret_cast<float*>(k_s + kStages * kTileTokens * ld);  // [hp]
  float* part_s = w_s + hp;                                                 // [kScoreWarps][kTileTokens]

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load_key_tile<T>(p, b, end, first + s * kTileTokens, k_s + s * kTileTokens * ld);
  for (int h = threadIdx.x; h < hp; h += kScoreThreads) w_s[h] = h < p.heads ? p.weights[int64_t{b} * p.heads + h] : 0.0f;
  // With at most one m-tile per warp (up to 64 heads) the warp's query
  // fragments stay in registers for every tile; more heads reload them.
  const int m_tiles = hp / 16;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool resident = m_tiles <= kScoreWarps;
  uint32_t a[kKTiles][4];
  if (resident && warp < m_tiles) load_query_fragments<T, kKTiles>(p, b, warp, a);

  float* out = p.scores + int64_t{b} * p.pitch;
  int32_t* hist = p.hist + int64_t{b} * kBins;
  int stage = 0;
  for (int64_t t0 = first; t0 < end; t0 += kTileTokens, stage = (stage + 1) % kStages) {
    load_key_tile<T>(p, b, end, t0 + (kStages - 1) * kTileTokens, k_s + ((stage + kStages - 1) % kStages) * kTileTokens * ld);
    cuda::cp_async_wait<kStages - 1>();  // this tile's group has landed
    __syncthreads();                     // ... for every thread; the weights are in place
    float acc[kTileTokens / 16][2][2] = {};
    for (int mt = warp; mt < m_tiles; mt += kScoreWarps) {
      if (!resident) load_query_fragments<T, kKTiles>(p, b, mt, a);
      score_m_tile<T, kKTiles>(p, mt, a, w_s, k_s + stage * kTileTokens * ld, acc);
    }
    // Sum over the eight head-row groups of the warp (lanes with equal l % 4).
#pragma unroll
    for (int np = 0; np < kTileTokens / 16; ++np) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = acc[np][nt][e];
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (lane < 4) part_s[warp * kTileTokens + np * 16 + nt * 8 + lane * 2 + e] = v;
        }
      }
    }
    __syncthreads();  // partials in place; the stage just read may be refilled next pass
    if (threadIdx.x < kTileTokens && t0 + threadIdx.x < end) {
      float s = 0.0f;
      for (int w = 0; w < kScoreWarps; ++w) s += part_s[w * kTileTokens + threadIdx.x];
      out[t0 + threadIdx.x] = s;
      // Coarse histogram, one global atomic per distinct bin among the lanes.
      const uint32_t bin = cuda::score_key(s) >> kLowKeyBits;
      const uint32_t peers = __match_any_sync(__activemask(), bin);
      if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
    }
  }
  cuda::cp_async_wait<0>();  // no copy may still target shared memory at exit
}

// ---- 2. the threshold bin and the filter ------------------------------------

// The bin holding the keep-th largest key of sequence b and how many keys lie
// in higher bins, into bin_out[0], bin_out[1]. Thread t sums 16 bins in
// descending order; CUB's block scan gives each thread the count above it.
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

__global__ void __launch_bounds__(kFilterThreads) dsa_filter_kernel(const __grid_constant__ IndexerParams p) {
  using Scan = cub::BlockScan<int32_t, kFilterThreads>;
  constexpr int kWordsPerWarp = kSlice / 32 / (kFilterThreads / 32);
  __shared__ typename Scan::TempStorage scan;
  __shared__ int32_t bin[2];
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];  // written before the score kernel started: safe before the wait
  const int64_t first = int64_t{blockIdx.x} * kSlice;
  if (len <= p.topk || first >= len) return;
  cuda::pdl_wait_primary();  // the scores and the histogram are complete and visible
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // This warp's words: all its scores are requested before the histogram is scanned.
  const int64_t w_first = first + int64_t{warp} * kWordsPerWarp * 32;
  const float* s = p.scores + int64_t{b} * p.pitch;
  float v[kWordsPerWarp];
#pragma unroll
  for (int e = 0; e < kWordsPerWarp; ++e) {
    const int64_t t = w_first + e * 32 + lane;
    v[e] = t < len ? s[t] : 0.0f;
  }
  find_threshold_bin<kFilterThreads>(p.hist + int64_t{b} * kBins, p.topk, scan, bin);
  const uint32_t threshold = static_cast<uint32_t>(bin[0]);
  uint32_t* words = p.bitmap + int64_t{b} * p.words;
  uint32_t cand[kWordsPerWarp];
  int32_t total = 0;
#pragma unroll
  for (int e = 0; e < kWordsPerWarp; ++e) {
    const int64_t t = w_first + e * 32 + lane;
    const uint32_t key_bin = cuda::score_key(v[e]) >> kLowKeyBits;
    const bool live = t < len;
    const uint32_t above = __ballot_sync(0xffffffffu, live && key_bin > threshold);
    cand[e] = __ballot_sync(0xffffffffu, live && key_bin == threshold);
    if (lane == 0 && w_first + e * 32 < len) words[(w_first + e * 32) / 32] = above;
    total += __popc(cand[e]);
  }
  // One atomic per warp reserves its candidates' slots.
  int32_t slot = 0;
  if (lane == 0 && total > 0) slot = atomicAdd(&p.cand_count[b], total);
  slot = __shfl_sync(0xffffffffu, slot, 0);
  uint64_t* cands = p.candidates + int64_t{b} * p.pitch;
  int32_t* hist2 = p.hist2 + int64_t{b} * kBins;
#pragma unroll
  for (int e = 0; e < kWordsPerWarp; ++e) {
    if ((cand[e] >> lane) & 1u) {
      const int64_t t = w_first + e * 32 + lane;
      const uint32_t key = cuda::score_key(v[e]);
      cands[slot + __popc(cand[e] & ((1u << lane) - 1))] = candidate_composite(key, t, p.position_bits);
      // Second-level histogram of the candidates, one atomic per distinct bin among the lanes.
      const uint32_t fine = (key >> (kLowKeyBits - kBinBits)) & (kBins - 1);
      const uint32_t peers = __match_any_sync(__activemask(), fine);
      if (lane == __ffs(peers) - 1) atomicAdd(&hist2[fine], __popc(peers));
    }
    slot += __popc(cand[e]);
  }
}

// ---- 3. the final select and the ordered output -----------------------------

__global__ void __launch_bounds__(kFinishThreads) dsa_finish_kernel(const __grid_constant__ IndexerParams p) {
  using Select = cuda::RadixSelect<kFinishThreads>;
  using Scan = cub::BlockScan<int32_t, kFinishThreads>;
  __shared__ uint64_t items[kSmemCandidates];
  __shared__ typename Select::Storage select_storage;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int32_t bin[2];
  __shared__ int32_t fine_count;
  const int b = blockIdx.x;
  const int64_t len = p.kv_lens[b];
  cuda::pdl_launch_dependents();  // a PDL-launched consumer (the attention) may start its prologue
  int32_t* out = p.positions + int64_t{b} * p.topk;
  if (len <= p.topk) {  // the window fits the top-k: every position, no scores needed
    for (int32_t i = threadIdx.x; i < p.topk; i += kFinishThreads) out[i] = i < len ? i : -1;
    if (threadIdx.x == 0) p.counts[b] = static_cast<int32_t>(len);
    return;
  }
  cuda::pdl_wait_primary();  // the filter (and so the score kernel) is complete and visible
  const int32_t n = p.cand_count[b];
  find_threshold_bin<kFinishThreads>(p.hist + int64_t{b} * kBins, p.topk, scan, bin);
  const int32_t wanted = p.topk - bin[1];  // from the threshold bin, >= 1
  const uint64_t* cands = p.candidates + int64_t{b} * p.pitch;
  uint32_t* words = p.bitmap + int64_t{b} * p.words;
  const uint64_t low = (uint64_t{1} << p.position_bits) - 1;
  const auto mark = [&](uint64_t x) {
    const int64_t t = static_cast<int64_t>(low - (x & low));
    atomicOr(&words[t / 32], 1u << (t % 32));
  };
  // Second level: the filter histogrammed the candidates' next 12 key bits.
  // Candidates in a higher fine bin are kept outright; the fine bin of the
  // wanted-th largest (usually a handful) is ranked in shared memory.
  find_threshold_bin<kFinishThreads>(p.hist2 + int64_t{b} * kBins, wanted, scan, bin);
  const uint32_t fine_bin = static_cast<uint32_t>(bin[0]);
  const int32_t fine_wanted = wanted - bin[1];
  const int32_t fine_n = p.hist2[int64_t{b} * kBins + fine_bin];
  const int fine_shift = p.position_bits + (kLowKeyBits - kBinBits);  // composite bits below the fine bin
  const uint64_t fine_mask = (uint64_t{1} << fine_shift) - 1;
  if (fine_n <= kSmemCandidates) {
    if (threadIdx.x == 0) fine_count = 0;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < n; i += kFinishThreads) {
      const uint64_t x = cands[i];
      const uint32_t fine = static_cast<uint32_t>(x >> fine_shift) & (kBins - 1);
      if (fine > fine_bin) mark(x);
      if (fine == fine_bin) items[atomicAdd(&fine_count, 1)] = x;
    }
    __syncthreads();
    const cuda::RadixCut cut =
        Select::run([&](int32_t i) { return items[i] & fine_mask; }, fine_n, fine_wanted, fine_shift, select_storage);
    for (int32_t i = threadIdx.x; i < fine_n; i += kFinishThreads) {
      if (cut.keeps(items[i] & fine_mask)) mark(items[i]);
    }
  } else {  // a wide tie (e.g. many equal scores): rank every candidate from global memory
    const cuda::RadixCut cut =
        Select::run([&](int32_t i) { return cands[i]; }, n, wanted, kLowKeyBits + p.position_bits, select_storage);
    for (int32_t i = threadIdx.x; i < n; i += kFinishThreads) {
      if (cut.keeps(cands[i])) mark(cands[i]);
    }
  }
  __syncthreads();  // every kept bit is in the bitmap (global atomics, visible to the CTA after the barrier)
  // Compaction in position order: each thread owns 8 consecutive words per round.
  constexpr int kWordsPerThread = 8;
  const int64_t num_words = (len + 31) / 32;
  int32_t base = 0;
  for (int64_t w0 = 0; w0 < num_words; w0 += int64_t{kFinishThreads} * kWordsPerThread) {
    uint32_t v[kWordsPerThread];
    int32_t count = 0;
#pragma unroll
    for (int e = 0; e < kWordsPerThread; ++e) {
      const int64_t w = w0 + int64_t{threadIdx.x} * kWordsPerThread + e;
      v[e] = w < num_words ? __ldcg(&words[w]) : 0u;
      count += __popc(v[e]);
    }
    int32_t slot, total;
    Scan(scan).ExclusiveSum(count, slot, total);
    slot += base;
#pragma unroll
    for (int e = 0; e < kWordsPerThread; ++e) {
      const int64_t w = w0 + int64_t{threadIdx.x} * kWordsPerThread + e;
      for (uint32_t bits = v[e]; bits != 0; bits &= bits - 1) {
        if (slot < p.topk) out[slot] = static_cast<int32_t>(w * 32 + __ffs(bits) - 1);
        ++slot;
      }
    }
    base += total;
    __syncthreads();  // the scan storage is reused next round
  }
  if (threadIdx.x == 0) p.counts[b] = p.topk;
}

// ---- launch -----------------------------------------------------------------

// Tiles per CTA: the grid is about one wave of resident CTAs (shared
// memory allows ctas_per_sm of them, at most 4 by the register budget), with
// more tiles per CTA only when the context does not fit one wave at a tile
// each, up to kMaxTilesPerCta so that every CTA's queries serve many tiles.
int32_t tiles_per_cta(int64_t max_kv_len, int32_t batch, size_t smem) {
  const int64_t tiles = (max_kv_len + kTileTokens - 1) / kTileTokens;
  const int64_t ctas_per_sm = std::clamp<int64_t>(static_cast<int64_t>((227 * 1024) / (smem + 1024)), 1, 4);
  const int64_t wave = ctas_per_sm * cuda_multiprocessor_count();
  return static_cast<int32_t>(std::clamp<int64_t>((tiles * batch + wave - 1) / wave, 1, kMaxTilesPerCta));
}

template <typename T, int kKTiles>
void launch_scores(IndexerParams p, int32_t batch, cudaStream_t stream) {
  const size_t smem = score_smem_bytes(p.heads, p.dim);
  cuda::configure_smem_once(dsa_score_kernel<T, kKTiles>, 227 * 1024);
  p.tiles_per_cta = tiles_per_cta(p.pitch, batch, smem);
  const int64_t per_cta = int64_t{kTileTokens} * p.tiles_per_cta;
  const dim3 grid(static_cast<unsigned>((p.pitch + per_cta - 1) / per_cta), static_cast<unsigned>(batch));
  dsa_score_kernel<T, kKTiles><<<grid, kScoreThreads, smem, stream>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_scores(const IndexerParams& p, int32_t batch, cudaStream_t stream) {
  // Templated on the k-tile count only so the query fragments of the common
  // head dims (<= 128) take half the registers.
  if (p.dim <= 128) {
    launch_scores<T, 8>(p, batch, stream);
  } else {
    launch_scores<T, kMaxIndexHeadDim / 16>(p, batch, stream);
  }
}

void require(bool ok, const std::string& message) {
  if (!ok) throw Error("dsa_select_tokens_cuda: " + message);
}

}  // namespace

namespace detail {

}  // namespace detail

size_t dsa_indexer_workspace_bytes(const DsaConfig& c, int32_t batch, int64_t max_kv_len) {
  detail::check_dsa_indexer_cuda(c, batch);
  if (max_kv_len < 1) throw Error("dsa_indexer_workspace_bytes: max_kv_len must be at least 1");
  return Workspace(batch, max_kv_len).total;
}

void dsa_select_tokens_cuda(const DsaConfig& c, int32_t batch, const DsaIndexerArgs& a, void* stream) {
  detail::check_dsa_indexer_cuda(c, batch);
  require(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
          std::string("dtype must be f16 or bf16, got ") + dtype_name(a.dtype));
  require(a.k_cache != nullptr && a.q_index != nullptr && a.weights != nullptr && a.kv_lens != nullptr &&
              a.positions != nullptr && a.counts != nullptr,
          "k_cache, q_index, weights, kv_lens, positions and counts must be set");
  require(reinterpret_cast<uintptr_t>(a.k_cache) % 16 == 0 && reinterpret_cast<uintptr_t>(a.q_index) % 16 == 0,
          "k_cache and q_index must be 16-byte aligned");
  require(a.capacity >= 1 && a.max_kv_len >= 1 && a.max_kv_len <= a.capacity,
          "need 1 <= max_kv_len <= capacity (max_kv_len " + std::to_string(a.max_kv_len) + ", capacity " +
              std::to_string(a.capacity) + ")");
  require(a.max_kv_len <= std::numeric_limits<int32_t>::max(),
          "max_kv_len = " + std::to_string(a.max_kv_len) + " does not fit int32 positions");
  const Workspace ws(batch, a.max_kv_len);
  require(a.workspace != nullptr && a.workspace_bytes >= ws.total,
          "the workspace holds " + std::to_string(a.workspace_bytes) + " bytes, dsa_indexer_workspace_bytes asks for " +
              std::to_string(ws.total));
  const size_t smem = score_smem_bytes(c.index_heads, c.index_head_dim);
  require(smem <= 227 * 1024, "index_heads = " + std::to_string(c.index_heads) + " with index_head_dim = " +
                                  std::to_string(c.index_head_dim) + " needs " + std::to_string(smem) +
                                  " bytes of shared memory (max 232448)");
  auto* base = static_cast<unsigned char*>(a.workspace);
  IndexerParams p;
  p.k_cache = a.k_cache;
  p.q_index = a.q_index;
  p.weights = a.weights;
  p.kv_lens = a.kv_lens;
  p.row_stride = int64_t{c.latent_dim} + c.index_head_dim;
  p.capacity = a.capacity;
  p.pitch = a.max_kv_len;
  p.words = ws.words;
  p.key_offset = c.latent_dim;
  p.heads = c.index_heads;
  p.dim = c.index_head_dim;
  p.topk = c.index_topk;
  p.tiles_per_cta = 1;  // launch_scores sizes it
  p.position_bits = cuda::position_bits(a.max_kv_len);
  p.hist = reinterpret_cast<int32_t*>(base + ws.hist);
  p.hist2 = reinterpret_cast<int32_t*>(base + ws.hist2);
  p.cand_count = reinterpret_cast<int32_t*>(base + ws.cand_count);
  p.bitmap = reinterpret_cast<uint32_t*>(base + ws.bitmap);
  p.scores = reinterpret_cast<float*>(base + ws.scores);
  p.candidates = reinterpret_cast<uint64_t*>(base + ws.candidates);
  p.positions = a.positions;
  p.counts = a.counts;
  auto s = static_cast<cudaStream_t>(stream);
  if (a.max_kv_len > c.index_topk) {  // some sequence may need scoring
    SP_CUDA_CHECK(cudaMemsetAsync(a.workspace, 0, ws.cleared, s));
    if (a.dtype == DType::kBF16) {
      launch_scores<__nv_bfloat16>(p, batch, s);
    } else {
      launch_scores<__half>(p, batch, s);
    }
    // The filter and the finish are programmatic dependent launches: each
    // grid is scheduled while the one before drains and waits for its writes.
    const dim3 grid(static_cast<unsigned>((a.max_kv_len + kSlice - 1) / kSlice), static_cast<unsigned>(batch));
    cuda::launch_with_pdl(dsa_filter_kernel, grid, dim3(kFilterThreads), 0, s, p);
    cuda::launch_with_pdl(dsa_finish_kernel, dim3(static_cast<unsigned>(batch)), dim3(kFinishThreads), 0, s, p);
  } else {
    // Nothing of ours ran before: a plain launch, ordered after all earlier work.
    dsa_finish_kernel<<<batch, kFinishThreads, 0, s>>>(p);
    SP_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparsepage
