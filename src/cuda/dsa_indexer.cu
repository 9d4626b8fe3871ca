// The DSA lightning indexer on the GPU (rule in include/sparsepage/models/
// dsa.h). Two launches on the caller's stream:
//   1. dsa_score_kernel writes I(b, t) for every live position into an fp32
//      workspace [batch, kv_len] (NaN stored as -inf, as the CPU rule ranks it);
//   2. dsa_topk_kernel, one CTA per sequence, finds the k-th largest score by
//      radix select over order-preserving keys and writes the kept positions
//      in increasing order: every score strictly above the threshold, plus
//      the lowest positions whose score equals it (ties to the lower position).
// The result is the set dsa_select_tokens_cpu keeps whenever fp32 summation
// order cannot swap two scores; exact ties are broken identically. Nothing
// here allocates, synchronizes or reads back, so the pair is graph-capturable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>
#include <string>

#include "core/cuda_hooks.h"
#include "cuda/common.cuh"
#include "sparsepage/models/dsa.h"

namespace sparsepage {
namespace {

// ---- score kernel -----------------------------------------------------------

constexpr int kScoreThreads = 256;
constexpr int kTileTokens = 64;  // index keys staged in shared memory per step
// A CTA scores up to this many tiles, so the index queries it stages are
// reused across up to 512 positions instead of being re-read from L2 for
// every tile; short windows get fewer tiles per CTA so the grid still fills
// the GPU (launch_scores).
constexpr int kMaxTilesPerCta = 8;
// A tile's dot products are split 16 ways over tokens and 16 ways over heads;
// each thread owns 4 tokens and accumulates 4 heads at a time: a 4 x 4
// register tile over 4 dims, so 8 16-byte shared loads feed 64 FMAs.
constexpr int kTokenGroups = 16;
constexpr int kHeadGroups = kScoreThreads / kTokenGroups;
constexpr int kTokensPerThread = kTileTokens / kTokenGroups;
constexpr int kHeadsPerPass = 4;
// Limits of the shared-memory staging: the queries of one sequence
// ([heads][dim + 4] fp32, under 100 KB at the limit) plus a key tile
// ([64][dim + 4]) stay inside the 227 KB a Hopper CTA may opt into.
constexpr int kMaxIndexHeadDim = 256;
constexpr int kMaxQueryElements = 16384;
constexpr int kMaxGridY = 65535;

struct ScoreParams {
  const void* k_cache;   // [batch * capacity, row_stride]; index key at columns key_offset .. key_offset + dim
  const void* q_index;   // [batch, heads, dim]
  const float* weights;  // [batch, heads]
  int64_t row_stride;    // elements between K rows (a multiple of 8)
  int64_t capacity;      // rows per sequence
  int64_t kv_len;        // live positions per sequence
  int32_t key_offset;    // first index-key column (a multiple of 8)
  int32_t heads, dim;    // index heads, index head dim (a multiple of 8)
  int32_t tiles_per_cta; // tiles of kTileTokens positions each CTA scores, 1 .. kMaxTilesPerCta
  float* scores;         // [batch, kv_len]
};

// Shared rows are padded to dim + 4 floats: 16-byte aligned for float4
// reads, and with dim a multiple of 8 the stride is an odd number of 16-byte
// units, so the eight rows of one float4 phase land on distinct banks.
__host__ __device__ constexpr int padded_dim(int dim) { return dim + 4; }

size_t score_smem_bytes(int32_t heads, int32_t dim) {
  const size_t row = static_cast<size_t>(padded_dim(dim));
  return sizeof(float) * (static_cast<size_t>(heads) * row + static_cast<size_t>(heads) + kTileTokens * row +
                          static_cast<size_t>(kHeadGroups) * kTileTokens);
}

// The largest score_smem_bytes over accepted shapes: heads * (dim + 5) is at
// most kMaxQueryElements plus five floats for each of at most
// kMaxQueryElements / 8 heads, and the key tile is widest at the largest dim.
constexpr size_t kMaxScoreSmemBytes =
    sizeof(float) * (kMaxQueryElements + 5 * (kMaxQueryElements / 8) + kTileTokens * padded_dim(kMaxIndexHeadDim) +
                     kHeadGroups * kTileTokens);
static_assert(kMaxScoreSmemBytes <= 227 * 1024, "the score kernel's staging must fit a Hopper CTA");

// max(x, 0) exactly as the CPU rule's std::max(dot, 0.0f): NaN stays NaN.
__device__ __forceinline__ float relu_keep_nan(float x) { return x < 0.0f ? 0.0f : x; }

template <typename T>
__device__ void stage_queries(const ScoreParams& p, int b, float* q_s, float* w_s) {
  const T* q = static_cast<const T*>(p.q_index) + int64_t{b} * p.heads * p.dim;
  for (int i = threadIdx.x; i < p.heads * p.dim; i += blockDim.x) {
    q_s[(i / p.dim) * padded_dim(p.dim) + i % p.dim] = cuda::ElemTraits<T>::to_float(q[i]);
  }
  for (int j = threadIdx.x; j < p.heads; j += blockDim.x) w_s[j] = p.weights[int64_t{b} * p.heads + j];
}

// Index keys of positions t0 .. t0 + kTileTokens - 1 of sequence b as fp32
// rows, 16 bytes per load; positions past the window become zeros and are
// never read from global memory.
template <typename T>
__device__ void load_key_tile(const ScoreParams& p, int b, int64_t t0, float* k_s) {
  const int chunks = p.dim / 8;  // 16-byte pieces per key
  const T* keys = static_cast<const T*>(p.k_cache) + p.key_offset;
  for (int i = threadIdx.x; i < kTileTokens * chunks; i += blockDim.x) {
    const int r = i / chunks, c = i % chunks;
    float* dst = k_s + r * padded_dim(p.dim) + c * 8;
    const int64_t t = t0 + r;
    if (t < p.kv_len) {
      const int64_t row = int64_t{b} * p.capacity + t;
      const uint4 raw = *reinterpret_cast<const uint4*>(keys + row * p.row_stride + c * 8);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < 8; ++k) dst[k] = cuda::ElemTraits<T>::to_float(e[k]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) dst[k] = 0.0f;
    }
  }
}

__device__ __forceinline__ float dot4(const float4& a, const float4& b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// This thread's share of the tile: for its 4 tokens (tg + 16 i) and its heads
// (hg + 16 m), sum_j w_j ReLU(q_j . k_t), written to partial[hg][token].
__device__ void score_tile(const ScoreParams& p, const float* q_s, const float* w_s, const float* k_s,
                           float* partial) {
  const int tg = threadIdx.x % kTokenGroups, hg = threadIdx.x / kTokenGroups;
  const int ld = padded_dim(p.dim);
  float total[kTokensPerThread] = {};
  for (int j0 = hg; j0 < p.heads; j0 += kHeadGroups * kHeadsPerPass) {
    // Heads past the last are computed on a duplicate row and never added, so
    // they cannot turn an inf key into a NaN the CPU rule would not see.
    const float* q_row[kHeadsPerPass];
#pragma unroll
    for (int h = 0; h < kHeadsPerPass; ++h) q_row[h] = q_s + min(j0 + h * kHeadGroups, p.heads - 1) * ld;
    float acc[kHeadsPerPass][kTokensPerThread] = {};
    for (int d = 0; d < p.dim; d += 4) {
      float4 k[kTokensPerThread];
#pragma unroll
      for (int i = 0; i < kTokensPerThread; ++i) {
        k[i] = *reinterpret_cast<const float4*>(k_s + (tg + i * kTokenGroups) * ld + d);
      }
#pragma unroll
      for (int h = 0; h < kHeadsPerPass; ++h) {
        const float4 q = *reinterpret_cast<const float4*>(q_row[h] + d);
#pragma unroll
        for (int i = 0; i < kTokensPerThread; ++i) acc[h][i] = dot4(q, k[i], acc[h][i]);
      }
    }
#pragma unroll
    for (int h = 0; h < kHeadsPerPass; ++h) {
      const int j = j0 + h * kHeadGroups;
      if (j < p.heads) {
#pragma unroll
        for (int i = 0; i < kTokensPerThread; ++i) total[i] += w_s[j] * relu_keep_nan(acc[h][i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) partial[hg * kTileTokens + tg + i * kTokenGroups] = total[i];
}

template <typename T>
__global__ void __launch_bounds__(kScoreThreads) dsa_score_kernel(const __grid_constant__ ScoreParams p) {
  extern __shared__ __align__(16) float smem[];
  const int ld = padded_dim(p.dim);
  float* q_s = smem;                        // [heads][ld]
  float* k_s = q_s + p.heads * ld;          // [kTileTokens][ld]
  float* w_s = k_s + kTileTokens * ld;      // [heads]
  float* partial = w_s + p.heads;           // [kHeadGroups][kTileTokens]
  const int b = blockIdx.y;
  stage_queries<T>(p, b, q_s, w_s);
  const int64_t per_cta = int64_t{kTileTokens} * p.tiles_per_cta;
  const int64_t first = int64_t{blockIdx.x} * per_cta;
  const int64_t end = min(p.kv_len, first + per_cta);
  float* out = p.scores + int64_t{b} * p.kv_len;
  for (int64_t t0 = first; t0 < end; t0 += kTileTokens) {
    load_key_tile<T>(p, b, t0, k_s);
    __syncthreads();  // the tile (and, on the first pass, the queries) are in place
    score_tile(p, q_s, w_s, k_s, partial);
    __syncthreads();  // every head group's partial sums are in place; k_s may be reloaded
    if (threadIdx.x < kTileTokens && t0 + threadIdx.x < p.kv_len) {
      float s = 0.0f;
      for (int g = 0; g < kHeadGroups; ++g) s += partial[g * kTileTokens + threadIdx.x];
      out[t0 + threadIdx.x] = s != s ? cuda::neg_inf_f32() : s;
    }
  }
}

// ---- top-k kernel -----------------------------------------------------------

constexpr int kTopkThreads = 512;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kRadixBins = 256;  // 8-bit digits: four passes over the 32-bit keys
// Consecutive positions per thread in the compaction: a chunk of 4096
// positions costs one block-wide scan, and the per-chunk counts fit 16 bits.
constexpr int kItemsPerThread = 8;
// One CTA streams a whole row per pass, so a pass is bound by memory latency
// unless each thread keeps many independent loads in flight.
constexpr int kLoadsInFlight = 16;

struct TopkParams {
  const float* scores;  // [batch, kv_len]; not read when keep == kv_len
  int64_t kv_len;       // live positions per sequence (< 2^31)
  int32_t keep;         // min(index_topk, kv_len)
  int32_t* positions;   // [batch, keep]
};

// Order-preserving key: a larger score has a larger key. NaN takes -inf's key
// (it ranks last, as in the CPU rule) and -0 takes +0's: the CPU compares
// scores with ==, so zeros of either sign (which the summation order decides)
// must tie.
__device__ __forceinline__ uint32_t score_key(float s) {
  if (s != s) s = cuda::neg_inf_f32();
  if (s == 0.0f) s = 0.0f;
  const uint32_t bits = __float_as_uint(s);
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

// Calls fn(key) for every score of s[0 .. n), each thread over its strided
// share, with kLoadsInFlight loads issued before any is used.
template <typename Fn>
__device__ __forceinline__ void for_each_key(const float* s, int64_t n, Fn&& fn) {
  for (int64_t base = threadIdx.x; base < n; base += int64_t{kTopkThreads} * kLoadsInFlight) {
    float v[kLoadsInFlight];
#pragma unroll
    for (int k = 0; k < kLoadsInFlight; ++k) {
      const int64_t i = base + int64_t{k} * kTopkThreads;
      v[k] = i < n ? s[i] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kLoadsInFlight; ++k) {
      if (base + int64_t{k} * kTopkThreads < n) fn(score_key(v[k]));
    }
  }
}

// The threshold key and how many keys equal to it are kept.
struct Threshold {
  uint32_t key;
  int32_t ties;
};

// Warp 0: scans the histogram from the largest digit down and stores in
// pick[0] the digit holding the `remaining`-th largest key and in pick[1] how
// many keys lie in larger digits. Lane l holds digits 255 - 8l .. 248 - 8l;
// exactly one lane's range contains the crossing, since the histogram counts
// at least `remaining` keys.
__device__ void pick_digit(const int32_t* hist, int32_t remaining, int32_t* pick) {
  const int lane = threadIdx.x;
  int32_t c[8];
  int32_t sum = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    c[e] = hist[kRadixBins - 1 - (lane * 8 + e)];
    sum += c[e];
  }
  int32_t inclusive = sum;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int32_t v = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += v;
  }
  const int32_t above = inclusive - sum;
  if (above < remaining && remaining <= inclusive) {
    int32_t run = above;
    for (int e = 0; e < 8; ++e) {
      if (run + c[e] >= remaining) {
        pick[0] = kRadixBins - 1 - (lane * 8 + e);
        pick[1] = run;
        break;
      }
      run += c[e];
    }
  }
}

// The k-th largest key of s[0 .. n), most significant digit first: each pass
// histograms the keys that share the digits chosen so far.
__device__ Threshold radix_select(const float* s, int64_t n, int32_t k, int32_t* hist, int32_t* pick) {
  uint32_t prefix = 0, mask = 0;
  int32_t remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kRadixBins; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for_each_key(s, n, [&](uint32_t key) {
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFFu], 1);
    });
    __syncthreads();
    if (threadIdx.x < 32) pick_digit(hist, remaining, pick);
    __syncthreads();
    prefix |= static_cast<uint32_t>(pick[0]) << shift;
    mask |= 0xFFu << shift;
    remaining -= pick[1];
    // The next writes to hist and pick follow two more barriers.
  }
  return {prefix, remaining};
}

// Exclusive prefix sum of `v` over the CTA in thread order; `total` gets the
// sum of all. warp_sums holds kTopkWarps + 1 entries.
__device__ uint32_t block_exclusive_sum(uint32_t v, uint32_t* warp_sums, uint32_t* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t inclusive = v;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const uint32_t n = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += n;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const uint32_t w = lane < kTopkWarps ? warp_sums[lane] : 0u;
    uint32_t w_inclusive = w;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const uint32_t n = __shfl_up_sync(0xffffffffu, w_inclusive, off);
      if (lane >= off) w_inclusive += n;
    }
    if (lane < kTopkWarps) warp_sums[lane] = w_inclusive - w;
    if (lane == kTopkWarps - 1) warp_sums[kTopkWarps] = w_inclusive;
  }
  __syncthreads();
  *total = warp_sums[kTopkWarps];
  const uint32_t before = warp_sums[warp] + inclusive - v;
  __syncthreads();  // the next call rewrites warp_sums
  return before;
}

// Writes the kept positions in increasing order. A kept position p lands at
// (keys above the threshold before p) + min(threshold keys before p, ties):
// one scan of the two counts per chunk places every position, whichever
// thread holds it, so the output does not depend on scheduling.
__device__ void write_kept(const float* s, int64_t n, Threshold th, int32_t keep, int32_t* out,
                           uint32_t* warp_sums) {
  const int32_t above_total = keep - th.ties;
  int32_t above_base = 0, tie_base = 0;  // counts over the chunks already done (CTA-uniform)
  for (int64_t chunk = 0; chunk < n; chunk += int64_t{kTopkThreads} * kItemsPerThread) {
    const int64_t first = chunk + int64_t{threadIdx.x} * kItemsPerThread;
    uint32_t above_bits = 0, tie_bits = 0;
#pragma unroll
    for (int e = 0; e < kItemsPerThread; ++e) {
      if (first + e < n) {
        const uint32_t key = score_key(s[first + e]);
        above_bits |= static_cast<uint32_t>(key > th.key) << e;
        tie_bits |= static_cast<uint32_t>(key == th.key) << e;
      }
    }
    uint32_t chunk_total;
    const uint32_t before =
        block_exclusive_sum((static_cast<uint32_t>(__popc(above_bits)) << 16) | __popc(tie_bits), warp_sums,
                            &chunk_total);
    int32_t above = above_base + static_cast<int32_t>(before >> 16);
    int32_t ties = tie_base + static_cast<int32_t>(before & 0xFFFFu);
#pragma unroll
    for (int e = 0; e < kItemsPerThread; ++e) {
      const bool is_above = (above_bits >> e) & 1u, is_tie = (tie_bits >> e) & 1u;
      if (is_above || (is_tie && ties < th.ties)) {
        const int32_t slot = above + min(ties, th.ties);
        if (slot < keep) out[slot] = static_cast<int32_t>(first + e);
      }
      above += is_above ? 1 : 0;
      ties += is_tie ? 1 : 0;
    }
    above_base += static_cast<int32_t>(chunk_total >> 16);
    tie_base += static_cast<int32_t>(chunk_total & 0xFFFFu);
    if (above_base == above_total && tie_base >= th.ties) break;  // CTA-uniform: all kept positions written
  }
}

__global__ void __launch_bounds__(kTopkThreads) dsa_topk_kernel(const __grid_constant__ TopkParams p) {
  __shared__ int32_t hist[kRadixBins];
  __shared__ int32_t pick[2];
  __shared__ uint32_t warp_sums[kTopkWarps + 1];
  const int64_t b = blockIdx.x;
  int32_t* out = p.positions + b * p.keep;
  if (p.keep >= p.kv_len) {  // the window fits the top-k: every position, no scores needed
    for (int64_t t = threadIdx.x; t < p.kv_len; t += blockDim.x) out[t] = static_cast<int32_t>(t);
    return;
  }
  const float* s = p.scores + b * p.kv_len;
  const Threshold th = radix_select(s, p.kv_len, p.keep, hist, pick);
  write_kept(s, p.kv_len, th, p.keep, out, warp_sums);
}

// Tiles per CTA: as many as kMaxTilesPerCta while the grid still gives every
// multiprocessor two CTAs; a short window or a small batch gets one tile per
// CTA, trading repeated query staging for a full GPU.
int32_t tiles_per_cta(int64_t kv_len, int32_t batch) {
  const int64_t tiles = (kv_len + kTileTokens - 1) / kTileTokens;
  const int64_t target_ctas = 2 * int64_t{cuda_multiprocessor_count()};
  return static_cast<int32_t>(std::clamp<int64_t>(tiles * batch / target_ctas, 1, kMaxTilesPerCta));
}

template <typename T>
void launch_scores(ScoreParams p, int32_t batch, cudaStream_t stream) {
  cuda::configure_smem_once(dsa_score_kernel<T>, kMaxScoreSmemBytes);
  p.tiles_per_cta = tiles_per_cta(p.kv_len, batch);
  const size_t smem = score_smem_bytes(p.heads, p.dim);
  const int64_t per_cta = int64_t{kTileTokens} * p.tiles_per_cta;
  const dim3 grid(static_cast<unsigned>((p.kv_len + per_cta - 1) / per_cta), static_cast<unsigned>(batch));
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
  if (c.index_head_dim < 8 || c.index_head_dim % 8 != 0 || c.index_head_dim > kMaxIndexHeadDim) {
    throw Error(what + "index_head_dim = " + std::to_string(c.index_head_dim) + " must be a multiple of 8 in [8, " +
                std::to_string(kMaxIndexHeadDim) + "] (keys are read 16 bytes at a time)");
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

void dsa_select_tokens_cuda(const DsaConfig& c, int32_t batch, const DsaIndexerArgs& a, void* stream) {
  detail::check_dsa_indexer_cuda(c, batch);
  require(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
          std::string("dtype must be f16 or bf16, got ") + dtype_name(a.dtype));
  require(a.k_cache != nullptr && a.q_index != nullptr && a.weights != nullptr && a.positions != nullptr,
          "k_cache, q_index, weights and positions must be set");
  require(reinterpret_cast<uintptr_t>(a.k_cache) % 16 == 0, "k_cache must be 16-byte aligned");
  require(a.capacity >= 1 && a.kv_len >= 0 && a.kv_len <= a.capacity,
          "need 0 <= kv_len <= capacity and capacity >= 1 (kv_len " + std::to_string(a.kv_len) + ", capacity " +
              std::to_string(a.capacity) + ")");
  require(a.kv_len <= std::numeric_limits<int32_t>::max(),
          "kv_len = " + std::to_string(a.kv_len) + " does not fit int32 positions");
  const int64_t keep = std::min<int64_t>(c.index_topk, a.kv_len);
  require(a.positions_count >= int64_t{batch} * keep,
          "positions holds " + std::to_string(a.positions_count) + " entries, batch * min(index_topk, kv_len) = " +
              std::to_string(int64_t{batch} * keep) + " are written");
  const bool scored = a.kv_len > c.index_topk;
  if (scored) {
    require(a.scores != nullptr && a.scores_count >= int64_t{batch} * a.kv_len,
            "the scores workspace holds " + std::to_string(a.scores_count) + " floats, batch * kv_len = " +
                std::to_string(int64_t{batch} * a.kv_len) + " are needed");
  }
  if (a.kv_len == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  if (scored) {
    ScoreParams p;
    p.k_cache = a.k_cache;
    p.q_index = a.q_index;
    p.weights = a.weights;
    p.row_stride = int64_t{c.latent_dim} + c.index_head_dim;
    p.capacity = a.capacity;
    p.kv_len = a.kv_len;
    p.key_offset = c.latent_dim;
    p.heads = c.index_heads;
    p.dim = c.index_head_dim;
    p.tiles_per_cta = 1;  // launch_scores sizes it
    p.scores = a.scores;
    if (a.dtype == DType::kBF16) {
      launch_scores<__nv_bfloat16>(p, batch, s);
    } else {
      launch_scores<__half>(p, batch, s);
    }
  }
  const TopkParams p{a.scores, a.kv_len, static_cast<int32_t>(keep), a.positions};
  dsa_topk_kernel<<<batch, kTopkThreads, 0, s>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage
