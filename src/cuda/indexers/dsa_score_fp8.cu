// The DSA indexer's scores over FP8 paged keys (include/sparsepage/
// index_keys.h: vLLM's DeepSeek-V3.2 indexer cache, 132 bytes per token) on
// e4m3 warpgroup MMAs, at the production index geometry (64 heads x 128).
// The rest of the indexer (the clear, the top-k) is dsa_indexer.cu's.
//
//   I(r, t) = scale[t] * sum_j w'[r, j] ReLU(q8[r, j] . k8[t])
//
// One CTA per (sequence, group of up to kTokens of its tokens) and tile
// range, as dsa_score_group_kernel:
// * a producer warp per consumer warpgroup streams that warpgroup's
//   64-position tiles through its own stages: per block
//   of the tile (one, or 64 / block_size), one TMA box of the e4m3 values
//   (block id from the engine's table, the hardware writing the 128-byte
//   swizzle the MMAs read) and one bulk copy of its fp32 scales, both
//   counted on the stage's full barrier; 132 bytes per position, each read
//   once for all 64 heads and every token of the group;
// * two consumer warpgroups take alternate tiles: m64nNk32 e4m3 MMAs (four
//   k-steps over the 128 values; N = 64 per token, two tokens per chain),
//   fp32 accumulation, then per position the ReLU, the weights (with each
//   query's scale folded in), a quad shuffle over heads and one multiply by
//   the key's scale (after the head sum, as DeepGEMM's fp8_paged_mqa_logits
//   applies it), the score written and histogrammed.
// The queries arrive as e4m3 (IndexQueryFormat::kE4m3: copied) or in their
// own dtype, quantized here by the rule of quantize_index_queries_cuda (one
// warp per (token, head), the same helpers), which saves the step a launch
// and a global round trip; the consumers do it while the producer's first
// tiles are in flight.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/cache/index_key_quant.cuh"
#include "cuda/indexers/dsa_indexer.cuh"
#include "cuda/indexers/wgmma_e4m3.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/mbarrier.cuh"
#include "cuda/primitives/wgmma.cuh"
#include "sparsepage/decode.h"

namespace sparsepage {
namespace dsa {
namespace {

// Key stages and resident CTAs per SM by the tokens a tile is scored
// against. A stage is 8.25 KB: one token's CTAs keep eight each at two per
// SM (~130 KB in flight per SM). Two or four tokens' accumulators do not fit
// two CTAs' registers (ptxas spills at the 96 a thread gets then), so they
// run one CTA per SM with twelve or ten stages.
template <int kTokens>
struct Fp8Shape {
  static constexpr int kStages = kTokens == 1 ? 8 : kTokens == 2 ? 12 : 10;
  static constexpr int kCtasPerSm = kTokens == 1 ? 2 : 1;
  static_assert(kStages % kGroupConsumers == 0, "a stage always serves the same warpgroup");
};

constexpr int kKeyTileBytes = kTileTokens * 128;  // 64 keys of 128 e4m3 values: one swizzled slab
constexpr int kConsumerThreads = kGroupConsumers * 128;

// Named barriers (bar.sync ids); 0 is __syncthreads.
enum NamedBarrier : int { kQueriesReady = 1 };  // the consumers' queries are in shared memory

// Shared memory, byte offsets from the 1024-aligned base.
template <int kTokens>
struct Fp8Layout {
  static constexpr int kStages = Fp8Shape<kTokens>::kStages;
  static constexpr size_t kQ = 0;  // kTokens x 64 rows of 128 e4m3 values, row tl * 64 + h, one swizzled slab
  static constexpr size_t kKeys = kQ + size_t{kTokens} * kGroupHeads * 128;        // [kStages] key tiles
  static constexpr size_t kScales = kKeys + size_t{kStages} * kKeyTileBytes;       // [kStages][64] fp32
  static constexpr size_t kWeights = kScales + size_t{kStages} * kTileTokens * 4;  // [kTokens * 64] fp32 w'
  static constexpr size_t kHist = kWeights + size_t{kTokens} * kGroupHeads * 4;    // [kTokens][kBins]
  static constexpr size_t kBarriers = kHist + size_t{kTokens} * kBins * 4;         // full[kStages], empty[kStages]
  static constexpr size_t kFlags = kBarriers + 2 * size_t{kStages} * 8;            // int32: refused rows (bit tl)
  static constexpr size_t kSmemBytes = kFlags + 16 + 1024;                         // + alignment slack
  static_assert(kKeys % 1024 == 0, "key tiles sit on the 128-byte swizzle's 1024-byte period");
  static_assert((kSmemBytes + 1024) * Fp8Shape<kTokens>::kCtasPerSm <= 228 * 1024,
                "the CTAs per SM the grid is sized for fit its shared memory");
};

using cuda::named_barrier;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The group's queries into the swizzled slab (row r = tl * 64 + h; rows of
// absent tokens zero) and their weights w' into w_s, by the 256 consumer
// threads. e4m3 queries are copied (their weights already carry the
// scales); native ones are quantized, each warp taking eight rows at a time
// with all eight loads in flight before any is used.
template <int kTokens>
__device__ __forceinline__ void stage_queries(const IndexerParams& p, int64_t row0, int ntok, uint32_t q_base,
                                              float* w_s, int tid) {
  const int lane = tid % 32, warp = tid / 32;
  if (p.q_e4m3 != 0) {
    const auto* q = static_cast<const unsigned char*>(p.q_index) + row0 * kGroupHeads * 128;
    for (int i = tid; i < kTokens * kGroupHeads * 8; i += kConsumerThreads) {
      const int r = i / 8, piece = i % 8;
      const bool live = r / kGroupHeads < ntok;
      cuda::cp_async_16(q_base + static_cast<uint32_t>(r * 128 + ((piece ^ (r % 8)) << 4)),
                        live ? q + int64_t{r} * 128 + piece * 16 : q, live);
    }
    cuda::cp_async_commit();
    for (int r = tid; r < kTokens * kGroupHeads; r += kConsumerThreads) {
      w_s[r] = r / kGroupHeads < ntok ? __ldcg(&p.weights[row0 * kGroupHeads + r]) : 0.0f;
    }
    cuda::cp_async_wait<0>();
    return;
  }
  constexpr int kBatch = 8;  // rows per warp per round
  // Raw 2-byte elements (bf16 and fp16 alike), so the loads carry no
  // conversion and all sixteen are in flight before the first is used.
  const auto* q16 = static_cast<const uint16_t*>(p.q_index);
  for (int r0 = warp * kBatch; r0 < kTokens * kGroupHeads; r0 += kConsumerThreads / 32 * kBatch) {
    uint2 raw[kBatch];
    float x[kBatch][4], w[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = r0 + u;
      const bool live = r / kGroupHeads < ntok;    // warp-uniform
      const int64_t row = row0 * kGroupHeads + r;  // (token row, head)
      raw[u] = live ? __ldcg(reinterpret_cast<const uint2*>(q16 + row * 128) + lane) : make_uint2(0u, 0u);
      w[u] = live ? __ldcg(&p.weights[row]) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (p.dtype == DType::kBF16) {
        cuda::load4(reinterpret_cast<const __nv_bfloat16*>(&raw[u]), 0, x[u]);
      } else {
        cuda::load4(reinterpret_cast<const __half*>(&raw[u]), 0, x[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int r = r0 + u;
      const float s = index_query_scale(cuda::warp_amax(x[u]));
      const uint32_t word = cuda::e4m3x4(x[u], s);  // zeros for absent rows
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(
                       q_base + static_cast<uint32_t>(r * 128 + (((lane / 4) ^ (r % 8)) << 4) + (lane % 4) * 4)),
                   "r"(word)
                   : "memory");
      if (lane == 0) w_s[r] = w[u] * s;
    }
  }
}
#endif

template <int kTokens>
__global__ void __launch_bounds__(kGroupThreads, Fp8Shape<kTokens>::kCtasPerSm)
    dsa_score_fp8_kernel(const __grid_constant__ IndexerParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Fp8Layout<kTokens>;
  constexpr int kChainTokens = kTokens < 2 ? kTokens : 2;  // N = 64 or 128 per chain
  constexpr int kChains = kTokens / kChainTokens;
  constexpr int kStages = L::kStages;
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
  const float* scales_s = reinterpret_cast<const float*>(gen + L::kScales);
  float* w_s = reinterpret_cast<float*>(gen + L::kWeights);
  int32_t* hist_s = reinterpret_cast<int32_t*>(gen + L::kHist);
  uint32_t* refused_s = reinterpret_cast<uint32_t*>(gen + L::kFlags);
  const int tid = threadIdx.x, lane = tid % 32;
  const uint32_t full = base + static_cast<uint32_t>(L::kBarriers);  // full[s] at full + 8 s
  const uint32_t empty = full + 8 * kStages;                         // empty[s] at empty + 8 s
  init_group_barriers<kStages>(tid, full, empty, refused_s);
  for (int i = tid; i < kTokens * kBins; i += kGroupThreads) hist_s[i] = 0;
  __syncthreads();  // the barriers are initialised, the histograms cleared

  const int64_t row0 = int64_t{seq} * p.q_len + first;  // the group's first (sequence, token) row
  const auto stage_of = [&](int64_t i) {
    return base + static_cast<uint32_t>(L::kKeys + (i % kStages) * kKeyTileBytes);
  };
  if (tid >= kConsumerThreads) {
    // A producer warp, for its warpgroup's tiles: per box (a block, or a 64-row piece of one) its
    // values by TMA and its scales by a bulk copy, onto the stage's barrier.
    int64_t windows[kTokens];
    work.scored_windows(p, windows);
    const uint32_t refused = produce_key_tiles<kStages, kTokens>(
        p, seq, tile0, ntiles, len, windows, full, empty, lane,
        [&](const KeyBox& box, int j, int64_t i, uint32_t bar) {
          const uint32_t rows = static_cast<uint32_t>(p.box_rows);
          if (lane == 0) {
            tma_load_3d(stage_of(i) + j * rows * 128, &p.keys, bar, 0, box.y, box.z);
            const unsigned char* block = p.pool + int64_t{box.z} * p.block_bytes;
            const uint32_t scales = base + static_cast<uint32_t>(L::kScales + (i % kStages) * kTileTokens * 4);
            bulk_load(scales + j * rows * 4, block + IndexKeyFp8::scale_offset(p.block_size, box.y), rows * 4, bar);
          }
          return rows * (128 + 4);
        },
        (tid - kConsumerThreads) / 32, kGroupConsumers);
    if (lane == 0 && refused != 0) atomicOr(refused_s, refused);
    __syncwarp();
  } else {
    stage_queries<kTokens>(p, row0, ntok, base + static_cast<uint32_t>(L::kQ), w_s, tid);
    cuda::wgmma::fence_proxy_async();  // the queries' generic-proxy writes, visible to the tensor cores
    named_barrier(kQueriesReady, kConsumerThreads);

    // The warpgroup index from lane 0, so the compiler knows it is uniform
    // and keeps the tile's descriptors in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
    const int warp = (tid % 128) / 32, q4 = lane % 4;  // warp within the warpgroup
    const uint64_t qd = cuda::wgmma::desc_sw128(base + static_cast<uint32_t>(L::kQ), 16, 1024);
    int64_t tlen[kTokens];  // each row's window, 0 for rows absent or not scored
    work.scored_windows(p, tlen);
    const int r_lo = warp * 16 + lane / 4;  // the thread's first row (position) of a tile; the second is + 8
    for (int64_t i = wg; i < ntiles; i += kGroupConsumers) {
      const uint32_t s = static_cast<uint32_t>(i % kStages);
      cuda::mbar::wait(full + 8 * s, static_cast<uint32_t>((i / kStages) & 1));
      const float ks0 = scales_s[s * kTileTokens + r_lo], ks1 = scales_s[s * kTileTokens + r_lo + 8];
      const uint64_t kd = cuda::wgmma::desc_sw128(stage_of(i), 16, 1024);
      const int64_t t = (tile0 + i) * kTileTokens + r_lo + (q4 == 1 ? 8 : 0);
      // The tile against the queries of up to two tokens per chain, each
      // chain its own commit group; k-step kk is 32 bytes into the rows.
      float d[kChains][32 * kChainTokens];
      cuda::wgmma::fence();
#pragma unroll
      for (int c = 0; c < kChains; ++c) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t a = kd + static_cast<uint64_t>(kk * 2);
          const uint64_t b = qd + static_cast<uint64_t>((c * kChainTokens * kGroupHeads * 128 + kk * 32) >> 4);
          if constexpr (kChainTokens == 1) {
            cuda::wgmma::mma_m64n64k32_e4m3(d[c], a, b, kk > 0);
          } else {
            cuda::wgmma::mma_m64n128k32_e4m3(d[c], a, b, kk > 0);
          }
        }
        cuda::wgmma::commit();
      }
      score_chains<0>(d, w_s, q4, empty + 8 * s, t, tlen, p, row0, hist_s, lane,
                      [&](float sum, int second) { return sum * (second ? ks1 : ks0); });
    }
  }
  publish_group(p, work, row0, ntok, refused_s, hist_s, tid);
#else
  __trap();  // warpgroup MMA and TMA exist on sm_90a only; the launcher refuses other GPUs first
#endif
}

// The grid: a wave of resident CTAs and one per token group, the live tiles
// shared among them on the device (group_work).
template <int kTokens>
void launch(const IndexerParams& p, cudaStream_t stream) {
  constexpr size_t smem = Fp8Layout<kTokens>::kSmemBytes;
  cuda::configure_smem_once(dsa_score_fp8_kernel<kTokens>, smem);
  IndexerParams q = p;
  q.wave = Fp8Shape<kTokens>::kCtasPerSm * cuda_multiprocessor_count();
  cuda::launch_with_pdl(dsa_score_fp8_kernel<kTokens>, dim3(group_grid(q, kTokens)), dim3(kGroupThreads), smem, stream,
                        q);
}

}  // namespace

void launch_fp8_scores(const IndexerParams& p, cudaStream_t stream) {
  if (p.q_len == 1)
    launch<1>(p, stream);
  else if (p.q_len == 2)
    launch<2>(p, stream);
  else
    launch<4>(p, stream);
}

}  // namespace dsa
}  // namespace sparsepage
