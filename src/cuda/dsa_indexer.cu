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
//      a bitmap and appends the positions of that bin as candidates;
//   3. dsa_finish_kernel (one CTA per sequence) radix-selects the missing
//      count among the candidates by (score, position) composites (ties to the
//      lower position), adds them to the bitmap and compacts the bitmap into
//      increasing positions, padding with -1 and writing the count.
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
constexpr int kTileTokens = 64;    // index keys staged per pipeline stage
constexpr int kMaxTilesPerCta = 8;  // queries staged once serve up to 512 positions
constexpr int kMaxIndexHeadDim = 256;
constexpr int kMaxKTiles = kMaxIndexHeadDim / 16;
constexpr int kMaxQueryElements = 16384;
constexpr int kMaxGridY = 65535;
// Coarse histogram of the score keys' top 12 bits (sign, exponent, 3
// mantissa bits): the bin of the k-th largest holds the only ambiguous keys.
constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;
constexpr int kLowKeyBits = 32 - kBinBits;
constexpr int kFilterThreads = 256;
constexpr int kSlice = 2048;  // positions per filter CTA (a multiple of 32)
constexpr int kFinishThreads = 256;
constexpr int kSmemCandidates = 4096;  // candidates ranked from shared memory; more re-read global memory

// Padded shared rows: dim + 8 elements is an odd number of 16-byte units
// (dim a multiple of 16), so the eight rows of an ldmatrix phase hit distinct banks.
__host__ __device__ constexpr int padded_dim(int dim) { return dim + 8; }
__host__ __device__ constexpr int padded_heads(int heads) { return (heads + 15) / 16 * 16; }

size_t score_smem_bytes(int32_t heads, int32_t dim) {
  const size_t ld = static_cast<size_t>(padded_dim(dim));
  return 2 * (static_cast<size_t>(padded_heads(heads)) * ld + 2 * kTileTokens * ld) +
         sizeof(float) * (static_cast<size_t>(padded_heads(heads)) + kScoreWarps * kTileTokens) +
         sizeof(int32_t) * kBins;
}

// ---- workspace --------------------------------------------------------------

// Byte offsets inside the caller's workspace; the first `cleared` bytes are
// zeroed by every launch.
struct Workspace {
  size_t hist, cand_count, cleared, bitmap, scores, candidates, total;
  int64_t words;  // bitmap words per sequence
  Workspace(int32_t batch, int64_t max_kv_len) {
    const auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t b = static_cast<size_t>(batch), n = static_cast<size_t>(max_kv_len);
    words = (max_kv_len + 31) / 32;
    hist = 0;
    cand_count = up(hist + b * kBins * sizeof(int32_t));
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
  int32_t* hist;           // [batch, kBins]
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
// 16-byte cp.async; positions past the window are zero-filled, never read.
template <typename T>
__device__ void load_key_tile(const IndexerParams& p, int b, int64_t len, int64_t t0, T* stage) {
  const int chunks = p.dim / 8;
  const T* seq = static_cast<const T*>(p.k_cache) + int64_t{b} * p.capacity * p.row_stride + p.key_offset;
  for (int i = threadIdx.x; i < kTileTokens * chunks; i += kScoreThreads) {
    const int r = i / chunks, c = i % chunks;
    const bool live = t0 + r < len;
    const T* src = seq + (live ? (t0 + r) * p.row_stride : 0) + c * 8;
    cuda::cp_async_16(cuda::smem_u32(stage + r * padded_dim(p.dim) + c * 8), src, live);
  }
  cuda::cp_async_commit();
}

// Warp `warp`'s share of a staged tile: for its 16-head m-tiles, the per-lane
// sums over its two head rows of w_h * ReLU(q_h . k_t), added to acc. Lane l
// holds tokens np * 16 + nt * 8 + 2 (l % 4) + {0, 1}; the sum over the warp's
// eight row groups happens once per tile in reduce_tile.
template <typename T>
__device__ void score_tile(const IndexerParams& p, const T* q_s, const float* w_s, const T* k_s,
                           float (&acc)[kTileTokens / 16][2][2]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int ld = padded_dim(p.dim), ktiles = p.dim / 16;
  for (int mt = warp; mt * 16 < p.heads; mt += kScoreWarps) {
    uint32_t a[kMaxKTiles][4];
#pragma unroll
    for (int kt = 0; kt < kMaxKTiles; ++kt) {
      if (kt < ktiles) cuda::ldmatrix_x4(a[kt], cuda::smem_u32(q_s + (mt * 16 + lane % 16) * ld + kt * 16 + (lane / 16) * 8));
    }
    const int h0 = mt * 16 + lane / 4, h1 = h0 + 8;
    // Padded head rows are never added: a zero query against an inf key is
    // NaN, which the CPU rule (which has no such head) would not see.
    const float w0 = h0 < p.heads ? w_s[h0] : 0.0f, w1 = h1 < p.heads ? w_s[h1] : 0.0f;
#pragma unroll
    for (int np = 0; np < kTileTokens / 16; ++np) {
      float c[2][4] = {};
      const T* krow = k_s + (np * 16 + (lane % 8) + (lane / 16) * 8) * ld + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int kt = 0; kt < kMaxKTiles; ++kt) {
        if (kt < ktiles) {
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
}

template <typename T>
__global__ void __launch_bounds__(kScoreThreads) dsa_score_kernel(const __grid_constant__ IndexerParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];
  const int64_t per_cta = int64_t{kTileTokens} * p.tiles_per_cta;
  const int64_t first = int64_t{blockIdx.x} * per_cta;
  if (len <= p.topk || first >= len) return;  // the window fits the top-k, or this slice is past it
  const int64_t end = min(len, first + per_cta);
  const int ld = padded_dim(p.dim), hp = padded_heads(p.heads);
  T* q_s = reinterpret_cast<T*>(smem);                  // [hp][ld]
  T* k_s = q_s + hp * ld;                               // [2][kTileTokens][ld]
  float* w_s = reinterpret_cast<float*>(k_s + 2 * kTileTokens * ld);  // [hp]
  float* part_s = w_s + hp;                             // [kScoreWarps][kTileTokens]
  int32_t* hist_s = reinterpret_cast<int32_t*>(part_s + kScoreWarps * kTileTokens);  // [kBins]

  load_key_tile<T>(p, b, len, first, k_s);  // the first tile flies while the queries are staged
  const int chunks = p.dim / 8;
  const T* qb = static_cast<const T*>(p.q_index) + int64_t{b} * p.heads * p.dim;
  for (int i = threadIdx.x; i < hp * chunks; i += kScoreThreads) {
    const int h = i / chunks, c = i % chunks;
    const uint4 v = h < p.heads ? *reinterpret_cast<const uint4*>(qb + h * p.dim + c * 8) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(q_s + h * ld + c * 8) = v;
  }
  for (int h = threadIdx.x; h < hp; h += kScoreThreads) w_s[h] = h < p.heads ? p.weights[int64_t{b} * p.heads + h] : 0.0f;
  for (int i = threadIdx.x; i < kBins; i += kScoreThreads) hist_s[i] = 0;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* out = p.scores + int64_t{b} * p.pitch;
  int stage = 0;
  for (int64_t t0 = first; t0 < end; t0 += kTileTokens, stage ^= 1) {
    const bool more = t0 + kTileTokens < end;
    if (more) load_key_tile<T>(p, b, len, t0 + kTileTokens, k_s + (stage ^ 1) * kTileTokens * ld);
    if (more) {
      cuda::cp_async_wait<1>();
    } else {
      cuda::cp_async_wait<0>();
    }
    __syncthreads();  // the tile (and on the first pass the queries) are in place
    float acc[kTileTokens / 16][2][2] = {};
    score_tile<T>(p, q_s, w_s, k_s + stage * kTileTokens * ld, acc);
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
      atomicAdd(&hist_s[cuda::score_key(s) >> kLowKeyBits], 1);
    }
  }
  __syncthreads();
  int32_t* hist = p.hist + int64_t{b} * kBins;
  for (int i = threadIdx.x; i < kBins; i += kScoreThreads) {
    if (hist_s[i] != 0) atomicAdd(&hist[i], hist_s[i]);
  }
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
  __shared__ typename Scan::TempStorage scan;
  __shared__ int32_t bin[2];
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];
  const int64_t first = int64_t{blockIdx.x} * kSlice;
  if (len <= p.topk || first >= len) return;
  find_threshold_bin<kFilterThreads>(p.hist + int64_t{b} * kBins, p.topk, scan, bin);
  const uint32_t threshold = static_cast<uint32_t>(bin[0]);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float* s = p.scores + int64_t{b} * p.pitch;
  uint32_t* words = p.bitmap + int64_t{b} * p.words;
  uint64_t* cands = p.candidates + int64_t{b} * p.pitch;
  const int64_t end = min(len, first + kSlice);
  // One warp per 32 positions: a ballot is the bitmap word of the higher bins.
  for (int64_t w0 = first; w0 < end; w0 += int64_t{32} * (kFilterThreads / 32)) {
    const int64_t base = w0 + int64_t{warp} * 32;
    if (base >= end) break;  // warp-uniform
    const int64_t t = base + lane;
    const uint32_t key = t < len ? cuda::score_key(s[t]) : 0u;
    const uint32_t key_bin = key >> kLowKeyBits;
    const bool live = t < len;
    const uint32_t above = __ballot_sync(0xffffffffu, live && key_bin > threshold);
    const uint32_t cand = __ballot_sync(0xffffffffu, live && key_bin == threshold);
    int32_t slot = 0;
    if (lane == 0) {
      words[base / 32] = above;
      if (cand != 0) slot = atomicAdd(&p.cand_count[b], __popc(cand));
    }
    slot = __shfl_sync(0xffffffffu, slot, 0);
    if ((cand >> lane) & 1u) {
      cands[slot + __popc(cand & ((1u << lane) - 1))] = candidate_composite(key, t, p.position_bits);
    }
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
  const int b = blockIdx.x;
  const int64_t len = p.kv_lens[b];
  int32_t* out = p.positions + int64_t{b} * p.topk;
  if (len <= p.topk) {  // the window fits the top-k: every position, no scores needed
    for (int32_t i = threadIdx.x; i < p.topk; i += kFinishThreads) out[i] = i < len ? i : -1;
    if (threadIdx.x == 0) p.counts[b] = static_cast<int32_t>(len);
    return;
  }
  find_threshold_bin<kFinishThreads>(p.hist + int64_t{b} * kBins, p.topk, scan, bin);
  const int32_t wanted = p.topk - bin[1];  // from the threshold bin, >= 1
  const int32_t n = p.cand_count[b];
  const uint64_t* cands = p.candidates + int64_t{b} * p.pitch;
  const bool in_smem = n <= kSmemCandidates;
  if (in_smem) {
    for (int32_t i = threadIdx.x; i < n; i += kFinishThreads) items[i] = cands[i];
    __syncthreads();
  }
  const auto get = [&](int32_t i) { return in_smem ? items[i] : cands[i]; };
  const cuda::RadixCut cut = Select::run(get, n, wanted, kLowKeyBits + p.position_bits, select_storage);
  uint32_t* words = p.bitmap + int64_t{b} * p.words;
  const uint64_t low = (uint64_t{1} << p.position_bits) - 1;
  for (int32_t i = threadIdx.x; i < n; i += kFinishThreads) {
    const uint64_t x = get(i);
    if (cut.keeps(x)) {
      const int64_t t = static_cast<int64_t>(low - (x & low));
      atomicOr(&words[t / 32], 1u << (t % 32));
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

// Tiles per CTA: as many as kMaxTilesPerCta while the grid still gives every
// multiprocessor two CTAs; a short window or a small batch gets one tile per
// CTA, trading repeated query staging for a full GPU.
int32_t tiles_per_cta(int64_t max_kv_len, int32_t batch) {
  const int64_t tiles = (max_kv_len + kTileTokens - 1) / kTileTokens;
  const int64_t target_ctas = 2 * int64_t{cuda_multiprocessor_count()};
  return static_cast<int32_t>(std::clamp<int64_t>(tiles * batch / target_ctas, 1, kMaxTilesPerCta));
}

template <typename T>
void launch_scores(const IndexerParams& p, int32_t batch, cudaStream_t stream) {
  const size_t smem = score_smem_bytes(p.heads, p.dim);
  cuda::configure_smem_once(dsa_score_kernel<T>, 227 * 1024);
  const int64_t per_cta = int64_t{kTileTokens} * p.tiles_per_cta;
  const dim3 grid(static_cast<unsigned>((p.pitch + per_cta - 1) / per_cta), static_cast<unsigned>(batch));
  dsa_score_kernel<T><<<grid, kScoreThreads, smem, stream>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

void require(bool ok, const std::string& message) {
  if (!ok) throw Error("dsa_select_tokens_cuda: " + message);
}

}  // namespace

namespace detail {

void check_dsa_indexer_cuda(const DsaConfig& c, int32_t batch) {
  const std::string what = "DSA indexer (CUDA): ";
  if (batch < 1 || batch > kMaxGridY) {
    throw Error(what + "batch = " + std::to_string(batch) + " must lie in [1, " + std::to_string(kMaxGridY) + "]");
  }
  if (c.index_topk < 1 || c.index_heads < 1 || c.latent_dim < 0) {
    throw Error(what + "index_topk and index_heads must be at least 1 and latent_dim not negative");
  }
  if (c.index_head_dim < 16 || c.index_head_dim % 16 != 0 || c.index_head_dim > kMaxIndexHeadDim) {
    throw Error(what + "index_head_dim = " + std::to_string(c.index_head_dim) + " must be a multiple of 16 in [16, " +
                std::to_string(kMaxIndexHeadDim) + "] (the scores are m16n8k16 tensor-core products)");
  }
  if (c.latent_dim % 8 != 0) {
    throw Error(what + "latent_dim = " + std::to_string(c.latent_dim) +
                " must be a multiple of 8 (the index key starts at that column and is read 16 bytes at a time)");
  }
  if (int64_t{c.index_heads} * c.index_head_dim > kMaxQueryElements) {
    throw Error(what + "index_heads * index_head_dim = " + std::to_string(int64_t{c.index_heads} * c.index_head_dim) +
                " exceeds " + std::to_string(kMaxQueryElements) + " (one sequence's index queries are staged in "
                "shared memory)");
  }
}

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
  p.tiles_per_cta = tiles_per_cta(a.max_kv_len, batch);
  p.position_bits = cuda::position_bits(a.max_kv_len);
  p.hist = reinterpret_cast<int32_t*>(base + ws.hist);
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
    const dim3 grid(static_cast<unsigned>((a.max_kv_len + kSlice - 1) / kSlice), static_cast<unsigned>(batch));
    dsa_filter_kernel<<<grid, kFilterThreads, 0, s>>>(p);
    SP_CUDA_CHECK_LAUNCH();
  }
  dsa_finish_kernel<<<batch, kFinishThreads, 0, s>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage
