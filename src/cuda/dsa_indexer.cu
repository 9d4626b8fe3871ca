// The DSA lightning indexer on the GPU (rule in include/sparsepage/models/
// dsa.h). Grids and the workspace are sized from the host bound max_kv_len;
// each sequence's live length is read on the device, so one captured graph
// serves a growing context. On the caller's stream:
//   0. a memset clears the coarse histograms;
//   1. dsa_score_kernel scores positions on warpgroup MMAs (fp32
//      accumulation: positions x index heads x dim), the index keys arriving
//      by TMA; it applies the ReLU and the weighted sum over heads, writes
//      fp32 scores and histograms the top 12 bits of each score's order key;
//   2. dsa_select_kernel (one CTA per sequence, a programmatic dependent
//      launch) finds the histogram bin holding the k-th largest key, ranks
//      that bin's keys to find the k-th largest (key, position) composite and
//      writes every position whose composite reaches it: increasing
//      positions, padded with -1, and the count.
// Ties go to the lower position and NaN ranks last through the composite
// (radix_select.cuh). Nothing here allocates, synchronizes or reads back.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <limits>
#include <string>

#include "core/cuda_hooks.h"
#include "models/dsa_kernels.h"
#include "cuda/common.cuh"
#include "cuda/radix_select.cuh"
#include "cuda/wgmma.cuh"
#include "sparsepage/models/dsa.h"

namespace sparsepage {
namespace {

// ---- geometry ---------------------------------------------------------------

// Score CTAs: one warpgroup computes S = K Q^T for 64 positions x 64 index
// heads per wgmma chain (M = positions, N = heads, K = the index head dim).
constexpr int kScoreThreads = 128;
constexpr int kTileTokens = 64;   // wgmma M: positions per pipeline stage
constexpr int kHeadChunk = 64;    // wgmma N: index heads per chain
constexpr int kStages = 4;        // three tiles in flight while one is scored
constexpr int kScoreCtasPerSm = 2;  // resident score CTAs per SM the grid is sized for
// Both operands sit in 128-byte swizzled slabs of 64 rows x 64 columns: row
// r at bytes [128 r, 128 r + 128), its 16-byte pieces permuted by piece ^ (r % 8).
constexpr int kSlabBytes = 64 * 128;
// Coarse histogram of the score keys' top 12 bits (sign, exponent, 3
// mantissa bits): the bin of the k-th largest holds the only ambiguous keys.
constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;
constexpr int kLowKeyBits = 32 - kBinBits;
// The top-k: one cluster of kClusterCtas CTAs per sequence, each CTA a
// contiguous range of positions, 16 consecutive positions per thread per chunk.
constexpr int kClusterCtas = 8;
constexpr int kSelectThreads = 512;
constexpr int kSelectPer = 16;
constexpr int kSelectChunk = kSelectThreads * kSelectPer;
constexpr int kSelectCands = 8192;  // threshold-bin candidates CTA 0 collects in shared memory
constexpr int kCutItems = 2048;     // fine-bin candidates ranked in shared memory; more: a wide tie
constexpr int kRowAlign = 16;       // score rows start at multiples of 16 floats (float4 reads)

// Shared memory of a score CTA, byte offsets from its 1024-aligned base: the
// queries of every head chunk, the key stages, the weights, the histogram.
struct ScoreLayout {
  int slabs, chunks;
  size_t q, keys, weights, hist, barriers, bytes;
  __host__ __device__ ScoreLayout(int heads, int dim) {
    slabs = (dim + 63) / 64;
    chunks = (heads + kHeadChunk - 1) / kHeadChunk;
    q = 0;
    keys = q + static_cast<size_t>(chunks) * slabs * kSlabBytes;
    weights = keys + static_cast<size_t>(kStages) * slabs * kSlabBytes;
    hist = weights + static_cast<size_t>(chunks) * kHeadChunk * sizeof(float);
    barriers = hist + kBins * sizeof(int32_t);
    bytes = barriers + kStages * sizeof(uint64_t);
  }
  size_t smem_bytes() const { return bytes + 1024; }  // + alignment slack
};

// ---- workspace --------------------------------------------------------------

// Byte offsets inside the caller's workspace; the first `cleared` bytes (the
// histograms) are zeroed by every launch.
struct Workspace {
  size_t hist, cleared, scores, total;
  int64_t pitch;  // max_kv_len rounded up to kRowAlign
  Workspace(int32_t batch, int64_t max_kv_len) {
    const auto up = [](size_t x) { return (x + 255) / 256 * 256; };
    const size_t b = static_cast<size_t>(batch);
    pitch = (max_kv_len + kRowAlign - 1) / kRowAlign * kRowAlign;
    hist = 0;
    cleared = up(hist + b * kBins * sizeof(int32_t));
    scores = cleared;
    total = scores + b * static_cast<size_t>(pitch) * sizeof(float);
  }
};

struct IndexerParams {
  CUtensorMap keys;        // the index keys for TMA (key_tensor_map)
  const void* k_cache;     // [batch * capacity, row_stride]; index key at columns key_offset .. key_offset + dim
  const void* q_index;     // [batch, heads, dim]
  const float* weights;    // [batch, heads]
  const int32_t* kv_lens;  // [batch], device
  int64_t row_stride, capacity;
  int64_t pitch;           // row pitch of scores
  int32_t batch, key_offset, heads, dim, topk;
  int32_t position_bits;   // bits of a position below max_kv_len
  int32_t* hist;           // [batch, kBins]: score keys' top 12 bits
  float* scores;           // [batch, pitch]
  int32_t* positions;      // out [batch, topk]
  int32_t* counts;         // out [batch]
};

// ---- tensor-memory-access copies ---------------------------------------------

// A score CTA's key tiles arrive by the tensor memory accelerator: one
// thread issues a 64-row x 64-column box per slab, the hardware writes it in
// the 128-byte swizzle the MMAs read and counts the bytes on an mbarrier.
__device__ __forceinline__ void mbarrier_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until phase `parity` of the barrier has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Box (x, y, z) of the 3-d tensor `map` into shared memory at dst; its bytes
// complete on `bar`. Out-of-bounds elements arrive as zeros.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

// ---- 1. scores on warpgroup MMAs --------------------------------------------

// max(x, 0) exactly as the CPU rule's std::max(dot, 0.0f): NaN stays NaN.
__device__ __forceinline__ float relu_keep_nan(float x) { return x < 0.0f ? 0.0f : x; }

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
    for (int kk = 0; kk < kKSteps; ++kk) mma_m64n64k16<T>(d, kd + offset(kk), qd + offset(kk), kk > 0);
  } else {
    for (int kk = 0; kk < ksteps; ++kk) mma_m64n64k16<T>(d, kd + offset(kk), qd + offset(kk), kk > 0);
  }
  cuda::wgmma::commit();
  cuda::wgmma::wait<0>();
  cuda::wgmma::pin(d);
}

// Each thread's accumulator rows are two positions and its columns 16 heads,
// so the weighted ReLU sum over heads is 32 multiply-adds and two quad
// shuffles, with no cross-warp reduction. The CTAs of a sequence split its
// live tiles evenly (the length is read on the device) and each CTA keeps a
// shared histogram that it adds to the sequence's once, at the end.
template <typename T, int kKSteps>
__global__ void __launch_bounds__(kScoreThreads) dsa_score_kernel(const __grid_constant__ IndexerParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.y;
  const int64_t len = p.kv_lens[b];
  if (len <= p.topk) return;  // the window fits the top-k: nothing to score
  const int64_t tiles = (len + kTileTokens - 1) / kTileTokens;
  const int64_t per_cta = (tiles + gridDim.x - 1) / gridDim.x;
  const int64_t tile0 = int64_t{blockIdx.x} * per_cta;
  const int64_t ntiles = min(per_cta, tiles - tile0);
  if (ntiles <= 0) return;
  const ScoreLayout L(p.heads, p.dim);
  const uint32_t raw = cuda::smem_u32(smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* gen = smem + (base - raw);
  float* w_s = reinterpret_cast<float*>(gen + L.weights);
  int32_t* hist_s = reinterpret_cast<int32_t*>(gen + L.hist);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int pieces = kKSteps > 0 ? 2 * kKSteps : p.dim / 8;  // 16-byte pieces per key or query row
  const uint32_t bars = base + static_cast<uint32_t>(L.barriers);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbarrier_init(bars + 8 * s);
    mbarrier_init_fence();
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
    w_s[h] = h < p.heads ? p.weights[int64_t{b} * p.heads + h] : 0.0f;
  }
  for (int i = tid; i < kBins; i += kScoreThreads) hist_s[i] = 0;
  __syncthreads();  // the barriers are initialised before any copy counts on them

  const auto stage_of = [&](int64_t i) {
    return base + static_cast<uint32_t>(L.keys + (i % kStages) * L.slabs * kSlabBytes);
  };
  // The index keys of this CTA's tile i: thread 0 issues one box per slab
  // onto the stage's barrier. Rows past the capacity arrive as zeros; rows
  // past the window are read but never scored.
  const auto load_tile = [&](int64_t i) {
    if (tid == 0 && i < ntiles) {
      const uint32_t bar = bars + 8 * static_cast<uint32_t>(i % kStages);
      mbarrier_expect_bytes(bar, static_cast<uint32_t>(L.slabs * kSlabBytes));
      for (int sl = 0; sl < L.slabs; ++sl) {
        tma_load_3d(stage_of(i) + sl * kSlabBytes, &p.keys, bar, sl * 64, static_cast<int>((tile0 + i) * kTileTokens), b);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load_tile(s);
  cuda::cp_async_wait<0>();          // the queries landed for this thread
  cuda::wgmma::fence_proxy_async();  // ... and are visible to the tensor cores (the loop's barrier: for all)

  float* out = p.scores + int64_t{b} * p.pitch;
  for (int64_t i = 0; i < ntiles; ++i) {
    mbarrier_wait(bars + 8 * static_cast<uint32_t>(i % kStages), static_cast<uint32_t>((i / kStages) & 1));
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
    if (live) out[t] = s;
    // Shared histogram, one atomic per distinct bin among the lanes.
    const uint32_t bin = live ? cuda::score_key(s) >> kLowKeyBits : 0xFFFFFFFFu;
    const uint32_t peers = __match_any_sync(0xffffffffu, bin);
    if (live && lane == __ffs(peers) - 1) atomicAdd(&hist_s[bin], __popc(peers));
  }
  __syncthreads();  // every position is in the shared histogram (every issued tile was waited for)
  int32_t* hist = p.hist + int64_t{b} * kBins;
  for (int i = tid; i < kBins; i += kScoreThreads) {
    const int32_t v = hist_s[i];
    if (v != 0) atomicAdd(&hist[i], v);
  }
}

// ---- 2. the top-k on one CTA per sequence ------------------------------------

// The rule "keep the top k of (score key, position), ties to the lower
// position" is one comparison once the k-th largest composite C is known:
// position t is kept iff (key(t) << P | (2^P - 1 - t)) >= C. The coarse
// histogram narrows C to one bin; only the keys in that bin (the
// candidates) are ranked.

// The bin holding the keep-th largest count and how many lie in higher
// bins, into bin_out[0], bin_out[1], and that bin's count into bin_out[2].
// Thread t holds the counts c of bins kBins - 1 - (t kPer + e), e < kPer
// (descending); CUB's block scan gives each thread the count above it.
template <int kThreads, int kPer>
__device__ void find_threshold_bin(const int32_t (&c)[kPer], int32_t keep,
                                   typename cub::BlockScan<int32_t, kThreads>::TempStorage& scan, int32_t* bin_out) {
  static_assert(kPer * kThreads == kBins, "every bin on one thread");
  int32_t sum = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) sum += c[e];
  int32_t before;
  cub::BlockScan<int32_t, kThreads>(scan).ExclusiveSum(sum, before);
  if (before < keep && keep <= before + sum) {
    int32_t run = before;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (run < keep && keep <= run + c[e]) {
        bin_out[0] = kBins - 1 - (threadIdx.x * kPer + e);
        bin_out[1] = run;
        bin_out[2] = c[e];
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

// After the scores, the top-k of a sequence is a chain of dependent steps
// (threshold bin, candidates, cut, ordered output). Spread over a grid,
// each step costs a grid-wide round trip through global memory; on one CTA
// the passes over the scores are issue-bound on one SM. A cluster of
// kClusterCtas CTAs per sequence, each over a contiguous range of
// positions, shares the steps through distributed shared memory:
//   every CTA: the threshold bin T from the coarse histogram (while the
//     cluster barrier that publishes CTA 0's zeroed counters completes);
//     pass 1 over its range counts its keys above T and sends its keys in T
//     (the candidates) to CTA 0's list;                             [sync 1]
//   CTA 0: a histogram of the candidates' next 12 key bits, the fine bin
//     of the wanted-th, its items radix-selected: C = the smallest kept
//     composite; each CTA's kept count (its keys above T plus its kept
//     candidates) gives the CTAs' output offsets;                   [sync 2]
//   every CTA: pass 2 over its range keeps the positions whose composite
//     reaches C and writes them from its offset, in order (a block scan
//     per chunk).
// When the candidates overflow CTA 0's list, or more than kCutItems of them
// share the fine bin (a wide tie), CTA 0 finds C and the counts from every
// position's score in global memory instead (correct, slow).
struct SelectShared {
  uint64_t cands[kSelectCands];  // CTA 0: the candidates (the first kSelectCands)
  uint64_t items[kCutItems];     // CTA 0: the candidates in the fine bin
  int32_t fine_hist[kBins];      // CTA 0: the candidates' next 12 key bits
  cuda::RadixSelect<kSelectThreads>::Storage select;
  typename cub::BlockScan<int32_t, kSelectThreads>::TempStorage scan;
  int32_t bin[3];
  int32_t n;                    // CTA 0: candidates sent (may exceed kSelectCands)
  int32_t item_count;           // CTA 0
  int32_t above[kClusterCtas];  // CTA 0: each CTA's keys above T, then its kept count
  int32_t offset[kClusterCtas]; // CTA 0: each CTA's first output slot
  unsigned long long min_kept;  // CTA 0
  unsigned long long cut;       // CTA 0: the k-th largest composite
  int32_t my_offset;
};

// Scores of positions t0 .. t0 + 15, t0 = c0 + kSelectPer * tid (zeros from
// `valid` on; a float4 that starts below len lies inside the row, whose
// pitch is a multiple of 4).
__device__ __forceinline__ void load_select_chunk(const float* s, int64_t t0, int valid, float (&v)[kSelectPer]) {
#pragma unroll
  for (int q = 0; q < kSelectPer / 4; ++q) {
    const float4 x = 4 * q < valid ? *reinterpret_cast<const float4*>(s + t0 + 4 * q) : make_float4(0, 0, 0, 0);
    v[4 * q] = x.x;
    v[4 * q + 1] = x.y;
    v[4 * q + 2] = x.z;
    v[4 * q + 3] = x.w;
  }
}

// The composite order as two compares: (key, position) ranks at or above
// the cut iff its key is larger, or equal at a position no later.
struct Cut {
  uint32_t key;
  int64_t t;
  __device__ Cut(uint64_t composite, int bits) {
    const uint64_t low = (uint64_t{1} << bits) - 1;
    key = static_cast<uint32_t>(composite >> bits);
    t = static_cast<int64_t>(low - (composite & low));
  }
  __device__ bool keeps(uint32_t k, int64_t pos) const { return k > key || (k == key && pos <= t); }
};

__global__ void __cluster_dims__(kClusterCtas, 1, 1) __launch_bounds__(kSelectThreads, 2)
    dsa_select_kernel(const __grid_constant__ IndexerParams p) {
  namespace cg = cooperative_groups;
  using Scan = cub::BlockScan<int32_t, kSelectThreads>;
  using Select = cuda::RadixSelect<kSelectThreads>;
  constexpr int kPer = kBins / kSelectThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  SelectShared& sh = *reinterpret_cast<SelectShared*>(smem);
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int b = blockIdx.y, tid = threadIdx.x, lane = tid % 32;
  const int64_t len = p.kv_lens[b];
  cuda::pdl_launch_dependents();  // a PDL-launched consumer (the attention) may start its prologue
  int32_t* out = p.positions + int64_t{b} * p.topk;
  if (len <= p.topk) {  // the window fits the top-k (the whole cluster returns): every position
    if (rank == 0) {
      for (int32_t i = tid; i < p.topk; i += kSelectThreads) out[i] = i < len ? i : -1;
      if (tid == 0) p.counts[b] = static_cast<int32_t>(len);
    }
    return;
  }
  if (tid == 0) {
    sh.n = 0;
    sh.item_count = 0;
    sh.min_kept = ~0ull;
  }
  cluster.barrier_arrive();  // 0: CTA 0's counters are set (waited for before the first remote write)
  // CTA r's positions: [first, last), span a multiple of 16.
  const int64_t span = ((len + kClusterCtas - 1) / kClusterCtas + kSelectPer - 1) / kSelectPer * kSelectPer;
  const int64_t first = min(len, int64_t{rank} * span), last = min(len, first + span);
  const auto valid_of = [&](int64_t t0) {
    const int64_t left = last - t0;
    return static_cast<int>(left < 0 ? 0 : left > kSelectPer ? kSelectPer : left);
  };
  cuda::pdl_wait_primary();  // the scores and the histogram are complete and visible
  const float* s = p.scores + int64_t{b} * p.pitch;
  const int bits = p.position_bits;
  int32_t c[kPer];
  const int32_t* hist = p.hist + int64_t{b} * kBins;
#pragma unroll
  for (int e = 0; e < kPer; ++e) c[e] = hist[kBins - 1 - (tid * kPer + e)];
  find_threshold_bin<kSelectThreads>(c, p.topk, sh.scan, sh.bin);  // its barrier also orders the setup above
  const uint32_t threshold = static_cast<uint32_t>(sh.bin[0]);
  const int32_t wanted = p.topk - sh.bin[1];  // from the threshold bin: >= 1

  // Pass 1: keys above T counted, keys in T sent to CTA 0 (one remote
  // atomic per warp and chunk reserves their slots).
  uint64_t* cands0 = cluster.map_shared_rank(sh.cands, 0);
  int32_t* n0 = cluster.map_shared_rank(&sh.n, 0);
  int32_t above = 0;
  cluster.barrier_wait();  // 0
  for (int64_t c0 = first; c0 < last; c0 += kSelectChunk) {
    const int64_t t0 = c0 + int64_t{kSelectPer} * tid;
    const int valid = valid_of(t0);
    float v[kSelectPer];
    load_select_chunk(s, t0, valid, v);
    uint32_t mine = 0, high = 0;
#pragma unroll
    for (int j = 0; j < kSelectPer; ++j) {
      const uint32_t bin = cuda::score_key(v[j]) >> kLowKeyBits;
      mine |= (bin == threshold ? 1u : 0u) << j;
      high |= (bin > threshold ? 1u : 0u) << j;
    }
    mine &= (1u << valid) - 1;  // valid <= 16
    above += __popc(high & ((1u << valid) - 1));
    const int32_t count = __popc(mine);
    int32_t before = count;  // inclusive scan over the warp
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t x = __shfl_up_sync(0xffffffffu, before, d);
      if (lane >= d) before += x;
    }
    int32_t slot = 0;
    if (lane == 31 && before > 0) slot = atomicAdd(n0, before);
    slot = __shfl_sync(0xffffffffu, slot, 31) + before - count;
#pragma unroll
    for (int j = 0; j < kSelectPer; ++j) {
      if ((mine >> j) & 1u) {
        if (slot < kSelectCands) cands0[slot] = candidate_composite(cuda::score_key(v[j]), t0 + j, bits);
        ++slot;
      }
    }
  }
  int32_t ignore, cta_above;
  Scan(sh.scan).ExclusiveSum(above, ignore, cta_above);
  if (tid == 0) cluster.map_shared_rank(sh.above, 0)[rank] = cta_above;
  cluster.sync();  // 1: CTA 0 holds every candidate and every CTA's count above T

  if (rank == 0) {
    const int32_t n = sh.n;
    const int fine_shift = bits + (kLowKeyBits - kBinBits);  // candidate bits below the fine bin
    const uint64_t fine_mask = (uint64_t{1} << fine_shift) - 1;
    const uint64_t low = (uint64_t{1} << bits) - 1;
    const auto fine_of = [&](uint64_t x) { return static_cast<uint32_t>(x >> fine_shift) & (kBins - 1); };
    const auto owner = [&](int64_t t) { return static_cast<int>(t / span); };
    bool exact = n <= kSelectCands;  // every candidate is in the list
    int32_t fine_n = 0;
    uint32_t fine_bin = 0;
    int32_t fine_wanted = 0;
    if (exact) {
      for (int i = tid; i < kBins; i += kSelectThreads) sh.fine_hist[i] = 0;
      __syncthreads();
      for (int32_t i = tid; i < n; i += kSelectThreads) atomicAdd(&sh.fine_hist[fine_of(sh.cands[i])], 1);
      __syncthreads();
#pragma unroll
      for (int e = 0; e < kPer; ++e) c[e] = sh.fine_hist[kBins - 1 - (tid * kPer + e)];
      find_threshold_bin<kSelectThreads>(c, wanted, sh.scan, sh.bin);
      fine_bin = static_cast<uint32_t>(sh.bin[0]);
      fine_wanted = wanted - sh.bin[1];  // from the fine bin: 1 <= fine_wanted <= fine_n
      fine_n = sh.bin[2];
      exact = fine_n <= kCutItems;
    }
    if (exact) {
      // Candidates of higher fine bins are kept outright; the fine bin's are ranked.
      for (int32_t i = tid; i < n; i += kSelectThreads) {
        const uint64_t x = sh.cands[i];
        const uint32_t fine = fine_of(x);
        if (fine > fine_bin) atomicAdd(&sh.above[owner(static_cast<int64_t>(low - (x & low)))], 1);
        if (fine == fine_bin) sh.items[atomicAdd(&sh.item_count, 1)] = x;
      }
      __syncthreads();
      const cuda::RadixCut fine_cut =
          Select::run([&](int32_t i) { return sh.items[i] & fine_mask; }, fine_n, fine_wanted, fine_shift, sh.select);
      for (int32_t i = tid; i < fine_n; i += kSelectThreads) {
        const uint64_t x = sh.items[i];
        if (fine_cut.keeps(x & fine_mask)) {
          atomicAdd(&sh.above[owner(static_cast<int64_t>(low - (x & low)))], 1);
          atomicMin(&sh.min_kept, static_cast<unsigned long long>(x));
        }
      }
      __syncthreads();
      if (tid == 0) sh.cut = (static_cast<uint64_t>(threshold) << (kLowKeyBits + bits)) | sh.min_kept;
    } else {
      // Every position's composite (key << bits | 2^bits - 1 - t); the cut
      // keeps (x & mask) >= prefix with mask a run of high bits: x >= prefix.
      const cuda::RadixCut all = Select::run(
          [&](int32_t i) { return (static_cast<uint64_t>(cuda::score_key(s[i])) << bits) | (low - static_cast<uint64_t>(i)); },
          static_cast<int32_t>(len), p.topk, 32 + bits, sh.select);
      const Cut cut(all.prefix, bits);
      if (tid < kClusterCtas) sh.above[tid] = 0;
      __syncthreads();
      for (int64_t t = tid; t < len; t += kSelectThreads) {
        if (cut.keeps(cuda::score_key(s[t]), t)) atomicAdd(&sh.above[owner(t)], 1);
      }
      if (tid == 0) sh.cut = all.prefix;
    }
    __syncthreads();
    if (tid == 0) {
      int32_t run = 0;
      for (int r = 0; r < kClusterCtas; ++r) {
        sh.offset[r] = run;
        run += sh.above[r];
      }
    }
  }
  cluster.sync();  // 2: the cut and every CTA's offset are known

  if (tid == 0) {
    sh.cut = *cluster.map_shared_rank(&sh.cut, 0);
    sh.my_offset = cluster.map_shared_rank(sh.offset, 0)[rank];
  }
  cluster.barrier_arrive();  // done with the other CTAs' shared memory (waited for before exit)
  __syncthreads();
  const Cut cut(sh.cut, bits);
  // Pass 2: the kept positions, in order.
  int32_t base = sh.my_offset;
  for (int64_t c0 = first; c0 < last; c0 += kSelectChunk) {
    const int64_t t0 = c0 + int64_t{kSelectPer} * tid;
    const int valid = valid_of(t0);
    float v[kSelectPer];
    load_select_chunk(s, t0, valid, v);
    uint32_t keep = 0;
#pragma unroll
    for (int j = 0; j < kSelectPer; ++j) keep |= (cut.keeps(cuda::score_key(v[j]), t0 + j) ? 1u : 0u) << j;
    keep &= (1u << valid) - 1;
    int32_t slot, total;
    __syncthreads();  // the scan storage is free
    Scan(sh.scan).ExclusiveSum(__popc(keep), slot, total);
    slot += base;
    for (uint32_t m = keep; m != 0; m &= m - 1) {
      if (slot < p.topk) out[slot] = static_cast<int32_t>(t0 + __ffs(m) - 1);
      ++slot;
    }
    base += total;
  }
  if (rank == 0 && tid == 0) p.counts[b] = p.topk;
  cluster.barrier_wait();  // no CTA leaves while another may read its shared memory
}

// ---- launch -----------------------------------------------------------------

// The keys as a 3-d tensor for TMA: (column, position, sequence), boxes of
// 64 x 64 x 1 in the 128-byte swizzle. Encoded on the host at each call
// (the pointer may change); no device work.
CUtensorMap key_tensor_map(const IndexerParams& p, DType dtype) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    SP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    if (fn == nullptr || status != cudaDriverEntryPointSuccess) throw Error("dsa_select_tokens_cuda: no cuTensorMapEncodeTiled");
    return reinterpret_cast<Encode>(fn);
  }();
  const size_t row_bytes = static_cast<size_t>(p.row_stride) * 2;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.dim), static_cast<cuuint64_t>(p.capacity),
                              static_cast<cuuint64_t>(p.batch)};
  const cuuint64_t strides[2] = {row_bytes, row_bytes * static_cast<cuuint64_t>(p.capacity)};
  const cuuint32_t box[3] = {64, kTileTokens, 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  CUtensorMap map{};
  void* start = static_cast<unsigned char*>(const_cast<void*>(p.k_cache)) + static_cast<size_t>(p.key_offset) * 2;
  const CUresult r = encode(&map, dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            3, start, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw Error("dsa_select_tokens_cuda: cuTensorMapEncodeTiled failed (" + std::to_string(r) + ")");
  return map;
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
  dsa_score_kernel<T, kKSteps><<<grid, kScoreThreads, smem, stream>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_scores(IndexerParams p, int32_t batch, int64_t max_kv_len, DType dtype, cudaStream_t stream) {
  p.keys = key_tensor_map(p, dtype);
  // The production head dim (128) gets an unrolled k-chain; others loop.
  if (p.dim == 128) {
    launch_scores<T, 8>(p, batch, max_kv_len, stream);
  } else {
    launch_scores<T, 0>(p, batch, max_kv_len, stream);
  }
}

void require(bool ok, const std::string& message) {
  if (!ok) throw Error("dsa_select_tokens_cuda: " + message);
}

}  // namespace

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
  const size_t smem = ScoreLayout(c.index_heads, c.index_head_dim).smem_bytes();
  require(smem <= 227 * 1024, "index_heads = " + std::to_string(c.index_heads) + " with index_head_dim = " +
                                  std::to_string(c.index_head_dim) + " needs " + std::to_string(smem) +
                                  " bytes of shared memory (max 232448)");
  auto* base = static_cast<unsigned char*>(a.workspace);
  IndexerParams p{};
  p.k_cache = a.k_cache;
  p.q_index = a.q_index;
  p.weights = a.weights;
  p.kv_lens = a.kv_lens;
  p.row_stride = int64_t{c.latent_dim} + c.index_head_dim;
  p.capacity = a.capacity;
  p.pitch = ws.pitch;
  p.batch = batch;
  p.key_offset = c.latent_dim;
  p.heads = c.index_heads;
  p.dim = c.index_head_dim;
  p.topk = c.index_topk;
  p.position_bits = cuda::position_bits(a.max_kv_len);
  p.hist = reinterpret_cast<int32_t*>(base + ws.hist);
  p.scores = reinterpret_cast<float*>(base + ws.scores);
  p.positions = a.positions;
  p.counts = a.counts;
  auto s = static_cast<cudaStream_t>(stream);
  cuda::configure_smem_once(dsa_select_kernel, sizeof(SelectShared));
  const dim3 select_grid(kClusterCtas, static_cast<unsigned>(batch));  // one cluster per sequence
  if (a.max_kv_len > c.index_topk) {  // some sequence may need scoring
    SP_CUDA_CHECK(cudaMemsetAsync(a.workspace, 0, ws.cleared, s));
    if (a.dtype == DType::kBF16) {
      launch_scores<__nv_bfloat16>(p, batch, a.max_kv_len, a.dtype, s);
    } else {
      launch_scores<__half>(p, batch, a.max_kv_len, a.dtype, s);
    }
    // Scheduled while the score grid drains; it waits for the scores.
    cuda::launch_with_pdl(dsa_select_kernel, select_grid, dim3(kSelectThreads), sizeof(SelectShared), s, p);
  } else {
    // Nothing of ours ran before: a plain launch, ordered after all earlier work.
    dsa_select_kernel<<<select_grid, kSelectThreads, sizeof(SelectShared), s>>>(p);
    SP_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparsepage
