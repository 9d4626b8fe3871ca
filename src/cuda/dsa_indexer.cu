// The DSA lightning indexer on the GPU (rule in include/sparsepage/models/
// dsa.h). Grids and the workspace are sized from the host bound max_kv_len;
// each sequence's live length is read on the device, so one captured graph
// serves a growing context. On the caller's stream:
//   0. a memset clears the coarse histograms and the counters;
//   1. scores: fp32 scores and a histogram of the top 12 bits of each
//      score's order key, by dsa_score_kernel (mma.sync m16n8k16) or
//      dsa_score_wgmma_kernel (warpgroup MMAs, one wave of CTAs);
//   2-3. the top-k, either
//      dsa_filter_kernel (many CTAs per sequence: threshold bin, bitmap of
//      the higher bins, candidates and their next 12 bits' histogram) and
//      dsa_finish_kernel (one CTA per sequence: the select inside the fine
//      bin and the bitmap's compaction), or
//      dsa_classify_kernel (many CTAs: threshold bin, per-slice counts and
//      candidates; the last CTA of a sequence picks the k-th composite) and
//      dsa_compact_kernel (many CTAs: each writes its slice's kept positions
//      at the offset of the earlier slices).
// MEASUREMENT BUILD: both score kernels and both top-k paths are here so one
// binary compares them (see variant()); the slower ones go once measured.
// The top-k kernels are programmatic dependent launches.
// Nothing here allocates, synchronizes or reads back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>

#include "core/cuda_hooks.h"
#include "models/dsa_kernels.h"
#include <cub/block/block_reduce.cuh>

#include "cuda/common.cuh"
#include "cuda/radix_select.cuh"
#include "cuda/wgmma.cuh"
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
// zeroed by every launch. Scores and candidates have a row pitch of whole
// slices, so a slice is always inside its row.
struct Workspace {
  size_t hist, hist2, cand_count, done, slice_kept, cleared, cut, bitmap, scores, candidates, total;
  int64_t words;   // bitmap words per sequence
  int64_t slices;  // kSlice-position slices per sequence
  int64_t pitch;   // slices * kSlice
  Workspace(int32_t batch, int64_t max_kv_len) {
    const auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t b = static_cast<size_t>(batch);
    words = (max_kv_len + 31) / 32;
    slices = (max_kv_len + kSlice - 1) / kSlice;
    pitch = slices * kSlice;
    const size_t n = static_cast<size_t>(pitch);
    hist = 0;
    hist2 = up(hist + b * kBins * sizeof(int32_t));
    cand_count = up(hist2 + b * kBins * sizeof(int32_t));
    done = up(cand_count + b * sizeof(int32_t));
    slice_kept = up(done + b * sizeof(int32_t));
    cleared = up(slice_kept + b * static_cast<size_t>(slices) * sizeof(int32_t));
    cut = cleared;
    bitmap = up(cut + b * sizeof(uint64_t));
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
  int64_t max_kv_len;      // the host bound the grids are sized for
  int64_t pitch;           // row pitch of scores and candidates (whole slices)
  int64_t words;           // bitmap words per sequence
  int64_t slices;          // kSlice-position slices per sequence
  int32_t key_offset, heads, dim, topk;
  int32_t tiles_per_cta;
  int32_t position_bits;   // bits of a position below max_kv_len
  int32_t* hist;           // [batch, kBins]: score keys' top 12 bits
  int32_t* hist2;          // [batch, kBins]: the next 12 bits of the threshold bin's keys
  int32_t* cand_count;     // [batch]
  uint32_t* bitmap;        // [batch, words]
  float* scores;           // [batch, pitch]
  uint64_t* candidates;    // [batch, pitch]
  int32_t* done;           // [batch]: classify CTAs finished (the last one picks the cut)
  int32_t* slice_kept;     // [batch, slices]: kept positions per slice
  uint64_t* cut;           // [batch]: the smallest kept (score key, position) composite
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

// ---- 1b. scores on warpgroup MMAs -------------------------------------------

// One warpgroup per CTA computes S = K Q^T for 64 positions x 64 index heads
// per wgmma chain (M = positions, N = heads, K = the index head dim), both
// operands K-major in 128-byte swizzled shared tiles: a slab holds 64 rows x
// 64 columns, row r at bytes [128 r, 128 r + 128) with its 16-byte pieces
// permuted by piece ^ (r % 8). Each thread's accumulator rows are two
// positions and its columns 16 heads, so the weighted ReLU sum over heads is
// 32 fused multiply-adds and two quad shuffles: no cross-warp reduction.
// The CTAs of a sequence split its live tiles evenly (read on the device),
// the grid is one wave, and each CTA keeps a shared histogram that it adds
// to the sequence's histogram once at the end.
constexpr int kWgThreads = 128;
constexpr int kWgTokens = 64;     // wgmma M
constexpr int kWgHeads = 64;      // wgmma N: heads per chunk
constexpr int kWgStages = 4;      // three tiles in flight while one is scored
constexpr int kSlabBytes = 64 * 128;

struct WgLayout {  // byte offsets from the 1024-aligned base
  int slabs, chunks;
  size_t q, keys, weights, hist, bytes;
  __host__ __device__ WgLayout(int heads, int dim) {
    slabs = (dim + 63) / 64;
    chunks = (heads + kWgHeads - 1) / kWgHeads;
    q = 0;
    keys = q + static_cast<size_t>(chunks) * slabs * kSlabBytes;
    weights = keys + static_cast<size_t>(kWgStages) * slabs * kSlabBytes;
    hist = weights + static_cast<size_t>(chunks) * kWgHeads * sizeof(float);
    bytes = hist + kBins * sizeof(int32_t);
  }
  size_t smem_bytes() const { return bytes + 1024; }  // + alignment slack
};

// Shared byte offset of 16-byte piece `piece` (columns 8 piece ..) of row r
// in a stack of swizzled slabs.
__device__ __forceinline__ uint32_t slab_offset(int r, int piece) {
  return static_cast<uint32_t>((piece >> 3) * kSlabBytes + r * 128 + (((piece & 7) ^ (r & 7)) << 4));
}

#define DSA_WGMMA_N64_OUTS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define DSA_WGMMA_N64(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}, %32, %33, p, 1, 1, 0, 0;\n}\n"

// D[64x64] (+)= A[64x16] B[64x16]^T, A and B K-major.
template <typename T>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (cuda::ElemTraits<T>::kBF16) {
    asm volatile(DSA_WGMMA_N64("bf16") : DSA_WGMMA_N64_OUTS : "l"(a), "l"(b), "r"(accumulate));
  } else {
    asm volatile(DSA_WGMMA_N64("f16") : DSA_WGMMA_N64_OUTS : "l"(a), "l"(b), "r"(accumulate));
  }
}
#undef DSA_WGMMA_N64_OUTS
#undef DSA_WGMMA_N64

// d = keys (64 positions) . queries (64 heads) over the k-steps of 16
// columns: kKSteps of them, or `ksteps` when kKSteps is 0 (a head dim other
// than 128; the runtime loop makes ptxas serialize the chain).
template <typename T, int kKSteps>
__device__ __forceinline__ void score_chunk(uint32_t keys, uint32_t queries, int ksteps, float (&d)[32]) {
  const uint64_t kd = cuda::wgmma::desc_sw128(keys, 16, 1024);
  const uint64_t qd = cuda::wgmma::desc_sw128(queries, 16, 1024);
  cuda::wgmma::fence();
  if constexpr (kKSteps > 0) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      // k-step kk: slab kk / 4, 32 bytes per step inside the 128-byte row.
      const uint64_t off = static_cast<uint64_t>(((kk >> 2) * kSlabBytes + (kk & 3) * 32) >> 4);
      mma_m64n64k16<T>(d, kd + off, qd + off, kk > 0);
    }
  } else {
    for (int kk = 0; kk < ksteps; ++kk) {
      const uint64_t off = static_cast<uint64_t>(((kk >> 2) * kSlabBytes + (kk & 3) * 32) >> 4);
      mma_m64n64k16<T>(d, kd + off, qd + off, kk > 0);
    }
  }
  cuda::wgmma::commit();
  cuda::wgmma::wait<0>();
  cuda::wgmma::pin(d);
}

template <typename T, int kKSteps>
__global__ void __launch_bounds__(kWgThreads) dsa_score_wgmma_kernel(const __grid_constant__ IndexerParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];
  if (len <= p.topk) return;  // the window fits the top-k: nothing to score
  const int64_t tiles = (len + kWgTokens - 1) / kWgTokens;
  const int64_t per = (tiles + gridDim.x - 1) / gridDim.x;
  const int64_t tile0 = int64_t{blockIdx.x} * per;
  const int64_t ntiles = min(per, tiles - tile0);
  if (ntiles <= 0) return;
  const WgLayout L(p.heads, p.dim);
  const uint32_t raw = cuda::smem_u32(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* gen = smem + (base - raw);
  float* w_s = reinterpret_cast<float*>(gen + L.weights);
  int32_t* hist_s = reinterpret_cast<int32_t*>(gen + L.hist);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int pieces = p.dim / 8;  // 16-byte pieces per key or query row

  // The queries of every head chunk (padded heads zero), in the first copy group.
  const T* q = static_cast<const T*>(p.q_index) + int64_t{b} * p.heads * p.dim;
  for (int i = tid; i < L.chunks * kWgHeads * pieces; i += kWgThreads) {
    const int h = i / pieces, piece = i % pieces;
    const bool live = h < p.heads;
    cuda::cp_async_16(base + L.q + (h / kWgHeads) * L.slabs * kSlabBytes + slab_offset(h % kWgHeads, piece),
                      live ? q + h * p.dim + piece * 8 : q, live);
  }
  for (int h = tid; h < L.chunks * kWgHeads; h += kWgThreads) {
    w_s[h] = h < p.heads ? p.weights[int64_t{b} * p.heads + h] : 0.0f;
  }
  for (int i = tid; i < kBins; i += kWgThreads) hist_s[i] = 0;

  const T* seq = static_cast<const T*>(p.k_cache) + int64_t{b} * p.capacity * p.row_stride + p.key_offset;
  const auto stage_of = [&](int64_t i) { return base + static_cast<uint32_t>(L.keys + (i % kWgStages) * L.slabs * kSlabBytes); };
  // The index keys of this CTA's tile i into its stage (one copy group per
  // call, empty past the CTA's tiles); positions past the window are zeros.
  const auto load_tile = [&](int64_t i) {
    if (i < ntiles) {
      const int64_t t0 = (tile0 + i) * kWgTokens;
      const uint32_t stage = stage_of(i);
      for (int idx = tid; idx < kWgTokens * pieces; idx += kWgThreads) {
        const int r = idx / pieces, piece = idx % pieces;
        const bool live = t0 + r < len;
        cuda::cp_async_16(stage + slab_offset(r, piece), seq + (live ? (t0 + r) * p.row_stride : 0) + piece * 8, live);
      }
    }
    cuda::cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kWgStages - 1; ++s) load_tile(s);

  float* out = p.scores + int64_t{b} * p.pitch;
  for (int64_t i = 0; i < ntiles; ++i) {
    cuda::cp_async_wait<kWgStages - 2>();  // tile i (and the queries) landed for this thread
    cuda::wgmma::fence_proxy_async();      // ... and is visible to the tensor cores' reads
    __syncthreads();                       // for every thread; the stage of tile i - 1 is free
    load_tile(i + kWgStages - 1);
    float part[2] = {0.0f, 0.0f};  // rows (positions) warp * 16 + lane / 4, and + 8
    for (int c = 0; c < L.chunks; ++c) {
      float d[32];
      score_chunk<T, kKSteps>(stage_of(i), base + static_cast<uint32_t>(L.q + c * L.slabs * kSlabBytes), p.dim / 16, d);
      // d[4j + e] is head 8j + 2 (lane % 4) + e at the first row, d[4j + 2 + e] at the second.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int h = c * kWgHeads + 8 * j + 2 * (lane % 4) + e;
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
    const int64_t t = (tile0 + i) * kWgTokens + warp * 16 + lane / 4 + (q4 == 1 ? 8 : 0);
    const bool live = q4 < 2 && t < len;
    const float s = q4 == 1 ? part[1] : part[0];
    if (live) out[t] = s;
    const uint32_t bin = live ? cuda::score_key(s) >> kLowKeyBits : 0xFFFFFFFFu;
    const uint32_t peers = __match_any_sync(0xffffffffu, bin);
    if (live && lane == __ffs(peers) - 1) atomicAdd(&hist_s[bin], __popc(peers));
  }
  cuda::cp_async_wait<0>();  // no copy may still target shared memory at exit
  __syncthreads();           // every position is in the shared histogram
  int32_t* hist = p.hist + int64_t{b} * kBins;
  for (int i = tid; i < kBins; i += kWgThreads) {
    const int32_t v = hist_s[i];
    if (v != 0) atomicAdd(&hist[i], v);
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

// ---- 2b/3b. classify, cut and compact ---------------------------------------

// The rule "keep the top k of (score key, position), ties to the lower
// position" is one comparison once the k-th largest composite C is known:
// position t is kept iff (key(t) << P | (2^P - 1 - t)) >= C. So:
//   classify (kSlice positions per CTA): finds the threshold bin T of the
//     coarse histogram, adds the slice's count of keys above T to
//     slice_kept, and appends the keys in T as candidates. The last CTA of a
//     sequence to finish (an arrival counter) picks C from the candidates:
//     a histogram of their next 12 key bits in shared memory, the fine bin
//     holding the wanted-th largest, a radix select inside it; it adds the
//     kept candidates to their slices' counts.
//   compact (kSlice positions per CTA): offset = the kept count of the
//     earlier slices; each thread tests its 8 consecutive positions against
//     C, and a block scan gives every kept position its slot.
constexpr int kCutItems = 2048;  // fine-bin candidates ranked in shared memory; more rank from global memory
constexpr int kCompactThreads = kSlice / 8;

struct CutStorage {
  int32_t hist[kBins];  // the candidates' fine histogram
  uint64_t items[kCutItems];
  cuda::RadixSelect<kFilterThreads>::Storage select;
  typename cub::BlockScan<int32_t, kFilterThreads>::TempStorage scan;
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

// The last classify CTA of sequence b: the cut C and the candidates' slice
// counts. `above` keys lie in bins above the threshold bin `threshold`.
__device__ void pick_cut(const IndexerParams& p, int b, uint32_t threshold, int32_t above, CutStorage& sh) {
  using Select = cuda::RadixSelect<kFilterThreads>;
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

  for (int i = tid; i < kBins; i += kFilterThreads) sh.hist[i] = 0;
  if (tid == 0) {
    sh.fine_count = 0;
    sh.min_kept = ~0ull;
  }
  __syncthreads();
  for (int32_t i = tid; i < n; i += kFilterThreads) atomicAdd(&sh.hist[fine_of(__ldcg(&cands[i]))], 1);
  __syncthreads();
  find_threshold_bin<kFilterThreads>(sh.hist, wanted, sh.scan, sh.bin);
  const uint32_t fine_bin = static_cast<uint32_t>(sh.bin[0]);
  const int32_t fine_wanted = wanted - sh.bin[1];  // from the fine bin: 1 <= fine_wanted <= fine_n
  const int32_t fine_n = sh.hist[fine_bin];
  const bool in_smem = fine_n <= kCutItems;
  // Candidates of higher fine bins are kept outright; the fine bin's are gathered.
  for (int32_t i = tid; i < n; i += kFilterThreads) {
    const uint64_t x = __ldcg(&cands[i]);
    const uint32_t fine = fine_of(x);
    if (fine > fine_bin) count_in_slice(slice_kept, position_of(x));
    if (fine == fine_bin && in_smem) sh.items[atomicAdd(&sh.fine_count, 1)] = x;
  }
  __syncthreads();
  const auto keep = [&](uint64_t x) {
    count_in_slice(slice_kept, position_of(x));
    atomicMin(&sh.min_kept, static_cast<unsigned long long>(x));
  };
  if (in_smem) {
    const cuda::RadixCut cut =
        Select::run([&](int32_t i) { return sh.items[i] & fine_mask; }, fine_n, fine_wanted, fine_shift, sh.select);
    for (int32_t i = tid; i < fine_n; i += kFilterThreads) {
      if (cut.keeps(sh.items[i] & fine_mask)) keep(sh.items[i]);
    }
  } else {  // a wide tie (e.g. many equal scores): rank every candidate from global memory
    const cuda::RadixCut cut = Select::run([&](int32_t i) { return __ldcg(&cands[i]); }, n, wanted,
                                           kLowKeyBits + p.position_bits, sh.select);
    for (int32_t i = tid; i < n; i += kFilterThreads) {
      const uint64_t x = __ldcg(&cands[i]);
      if (fine_of(x) == fine_bin && cut.keeps(x)) keep(x);
    }
  }
  __syncthreads();
  if (tid == 0) p.cut[b] = (static_cast<uint64_t>(threshold) << (kLowKeyBits + p.position_bits)) | sh.min_kept;
}

__global__ void __launch_bounds__(kFilterThreads) dsa_classify_kernel(const __grid_constant__ IndexerParams p) {
  using Reduce = cub::BlockReduce<int32_t, kFilterThreads>;
  constexpr int kWordsPerWarp = kSlice / 32 / (kFilterThreads / 32);
  __shared__ CutStorage sh;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ int32_t bin[2];
  __shared__ int32_t last;
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];  // written before the score kernel started: safe before the wait
  const int64_t first = int64_t{blockIdx.x} * kSlice;
  if (len <= p.topk || first >= len) return;
  cuda::pdl_launch_dependents();  // the compaction may be scheduled; it waits for this grid
  cuda::pdl_wait_primary();       // the scores and the histogram are complete and visible
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t w_first = first + int64_t{warp} * kWordsPerWarp * 32;
  const float* s = p.scores + int64_t{b} * p.pitch;
  float v[kWordsPerWarp];
#pragma unroll
  for (int e = 0; e < kWordsPerWarp; ++e) {
    const int64_t t = w_first + e * 32 + lane;
    v[e] = t < len ? s[t] : 0.0f;
  }
  find_threshold_bin<kFilterThreads>(p.hist + int64_t{b} * kBins, p.topk, sh.scan, bin);
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
      cands[slot + __popc(cand[e] & ((1u << lane) - 1))] = candidate_composite(cuda::score_key(v[e]), t, p.position_bits);
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

__global__ void __launch_bounds__(kCompactThreads) dsa_compact_kernel(const __grid_constant__ IndexerParams p) {
  using Scan = cub::BlockScan<int32_t, kCompactThreads>;
  using Reduce = cub::BlockReduce<int32_t, kCompactThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int32_t offset;
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];
  cuda::pdl_launch_dependents();  // a PDL-launched consumer (the attention) may start its prologue
  int32_t* out = p.positions + int64_t{b} * p.topk;
  if (len <= p.topk) {  // the window fits the top-k: every position, no scores needed
    if (blockIdx.x == 0) {
      for (int32_t i = threadIdx.x; i < p.topk; i += kCompactThreads) out[i] = i < len ? i : -1;
      if (threadIdx.x == 0) p.counts[b] = static_cast<int32_t>(len);
    }
    return;
  }
  const int64_t first = int64_t{blockIdx.x} * kSlice;
  if (first >= len) return;
  cuda::pdl_wait_primary();  // the classify grid (and so the scores) is complete and visible
  const uint64_t cut = p.cut[b];
  int32_t before = 0;
  for (int64_t s = threadIdx.x; s < blockIdx.x; s += kCompactThreads) before += p.slice_kept[int64_t{b} * p.slices + s];
  before = Reduce(tmp.reduce).Sum(before);
  if (threadIdx.x == 0) offset = before;
  __syncthreads();  // the reduce storage is free for the scan
  const int64_t t0 = first + 8 * int64_t{threadIdx.x};
  const float4* src = reinterpret_cast<const float4*>(p.scores + int64_t{b} * p.pitch + t0);  // inside the row: whole slices
  const float4 lo = src[0], hi = src[1];
  const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const uint64_t low = (uint64_t{1} << p.position_bits) - 1;
  uint32_t keep = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t t = t0 + j;
    const uint64_t x = (static_cast<uint64_t>(cuda::score_key(v[j])) << p.position_bits) | (low - static_cast<uint64_t>(t));
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
  p.tiles_per_cta = tiles_per_cta(p.max_kv_len, batch, smem);
  const int64_t per_cta = int64_t{kTileTokens} * p.tiles_per_cta;
  const dim3 grid(static_cast<unsigned>((p.max_kv_len + per_cta - 1) / per_cta), static_cast<unsigned>(batch));
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

// The wgmma score grid: per sequence, an equal share of one wave of
// resident CTAs (at least one), never more CTAs than tiles.
template <typename T, int kKSteps>
void launch_scores_wgmma(const IndexerParams& p, int32_t batch, int32_t ctas_per_sm, cudaStream_t stream) {
  const size_t smem = WgLayout(p.heads, p.dim).smem_bytes();
  cuda::configure_smem_once(dsa_score_wgmma_kernel<T, kKSteps>, 227 * 1024);
  const int64_t fit = std::clamp<int64_t>(static_cast<int64_t>((228 * 1024) / (smem + 1024)), 1, 4);
  const int64_t wave = std::min<int64_t>(fit, ctas_per_sm) * cuda_multiprocessor_count();
  const int64_t tiles = (p.max_kv_len + kWgTokens - 1) / kWgTokens;
  const int64_t per_sequence = std::clamp<int64_t>(wave / batch, 1, tiles);
  const dim3 grid(static_cast<unsigned>(per_sequence), static_cast<unsigned>(batch));
  dsa_score_wgmma_kernel<T, kKSteps><<<grid, kWgThreads, smem, stream>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_scores_wgmma(const IndexerParams& p, int32_t batch, int32_t ctas_per_sm, cudaStream_t stream) {
  // The production head dim (128) gets an unrolled k-chain; others loop.
  if (p.dim == 128) {
    launch_scores_wgmma<T, 8>(p, batch, ctas_per_sm, stream);
  } else {
    launch_scores_wgmma<T, 0>(p, batch, ctas_per_sm, stream);
  }
}

// MEASUREMENT ONLY (removed once a variant is chosen): which score kernel
// and which top-k run, from SPARSEPAGE_DSA_INDEXER_VARIANT = 0 (mma.sync
// scores, filter + finish), 1 (wgmma scores, filter + finish), 2 (mma.sync
// scores, classify + compact), 3 (wgmma scores, classify + compact; the
// default), and the wgmma grid's CTAs per SM from SPARSEPAGE_DSA_SCORE_CTAS_PER_SM.
struct Variant {
  bool wgmma = true, compact = true;
  int32_t ctas_per_sm = 2;
};
Variant variant() {
  Variant v;
  if (const char* e = std::getenv("SPARSEPAGE_DSA_INDEXER_VARIANT")) {
    const int x = std::atoi(e);
    v.wgmma = (x & 1) != 0;
    v.compact = (x & 2) != 0;
  }
  if (const char* e = std::getenv("SPARSEPAGE_DSA_SCORE_CTAS_PER_SM")) v.ctas_per_sm = std::max(1, std::atoi(e));
  return v;
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
  const size_t smem = std::max(score_smem_bytes(c.index_heads, c.index_head_dim),
                               WgLayout(c.index_heads, c.index_head_dim).smem_bytes());
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
  p.max_kv_len = a.max_kv_len;
  p.pitch = ws.pitch;
  p.words = ws.words;
  p.slices = ws.slices;
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
  p.done = reinterpret_cast<int32_t*>(base + ws.done);
  p.slice_kept = reinterpret_cast<int32_t*>(base + ws.slice_kept);
  p.cut = reinterpret_cast<uint64_t*>(base + ws.cut);
  p.positions = a.positions;
  p.counts = a.counts;
  auto s = static_cast<cudaStream_t>(stream);
  const Variant v = variant();
  const dim3 slices(static_cast<unsigned>(ws.slices), static_cast<unsigned>(batch));
  if (a.max_kv_len > c.index_topk) {  // some sequence may need scoring
    SP_CUDA_CHECK(cudaMemsetAsync(a.workspace, 0, ws.cleared, s));
    if (v.wgmma) {
      if (a.dtype == DType::kBF16) {
        launch_scores_wgmma<__nv_bfloat16>(p, batch, v.ctas_per_sm, s);
      } else {
        launch_scores_wgmma<__half>(p, batch, v.ctas_per_sm, s);
      }
    } else if (a.dtype == DType::kBF16) {
      launch_scores<__nv_bfloat16>(p, batch, s);
    } else {
      launch_scores<__half>(p, batch, s);
    }
    // The top-k kernels are programmatic dependent launches: each grid is
    // scheduled while the one before drains and waits for its writes.
    if (v.compact) {
      cuda::launch_with_pdl(dsa_classify_kernel, slices, dim3(kFilterThreads), 0, s, p);
      cuda::launch_with_pdl(dsa_compact_kernel, slices, dim3(kCompactThreads), 0, s, p);
    } else {
      cuda::launch_with_pdl(dsa_filter_kernel, slices, dim3(kFilterThreads), 0, s, p);
      cuda::launch_with_pdl(dsa_finish_kernel, dim3(static_cast<unsigned>(batch)), dim3(kFinishThreads), 0, s, p);
    }
  } else if (v.compact) {
    // Nothing of ours ran before: a plain launch, ordered after all earlier work.
    dsa_compact_kernel<<<slices, kCompactThreads, 0, s>>>(p);
    SP_CUDA_CHECK_LAUNCH();
  } else {
    dsa_finish_kernel<<<batch, kFinishThreads, 0, s>>>(p);
    SP_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparsepage
