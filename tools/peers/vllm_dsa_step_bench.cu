// vllm_dsa_step_bench - vLLM's DeepSeek-V3.2 sparse (DSA) decode step, composed of the peers'
// own kernels and replayed from one CUDA graph per step, beside each piece timed alone.
// Our driver; no peer source is copied here: the peers' headers and .cu files are compiled
// from $PEERS_DIR/peers-bench/third_party by tools/peers/build.sh.
//
// One decode step of one DSA layer as vLLM (b317d150) runs it on an H200 (sm_90a):
//   per step (shared by all layers):
//     dg_paged_mqa_logits_metadata  DeepGEMM get_paged_mqa_logits_metadata (SM schedule of the
//                                   indexer logits over the batch's context lengths)
//     flashmla_sched_meta           FlashMLA get_decoding_sched_meta (split-KV schedule of the
//                                   sparse decode; top-2048 per request)
//   per layer:
//     dg_fp8_paged_mqa_logits       DeepGEMM fp8_paged_mqa_logits (sm90): 64 index heads x 128,
//                                   FP8 q [B, next_n=1, 64, 128], fp32 weights [B, 64], paged FP8
//                                   index keys (block 64: 64 rows of 128 e4m3, then 64 fp32
//                                   scales), fp32 logits [B, align(S, 256)], clean_logits=False
//     vllm_cooperative_topk (B<=32) vLLM's indexer top-2048 over the logits (cooperative_topk
//     vllm_filtered_topk (B>32)     for <= 32 rows, else what persistent_topk launches on a GPU
//                                   with >= 128 KiB of shared memory: FilteredTopK)
//     slots_ours                    token positions -> cache slot ids through the block table
//                                   (vLLM does this in a Triton kernel; this one is ours)
//     flashmla_sparse_decode_fp8    FlashMLA sm90 sparse FP8 decode (V3.2 rows of 656 bytes:
//                                   512 e4m3 + 4 fp32 scales + 64 bf16 rope, page 64, 128 heads,
//                                   top-2048) + its combine kernel
// CSV rows: dsa_step (metadata + one layer), dsa_layer (one layer, no metadata) and every piece
// alone, each from its own graph. B = batch, S = context length of every request.
//
// The file has three parts, compiled as three translation units (build.sh):
//   -DVLLM_DSA_PART_DEEPGEMM  DeepGEMM's templates, instantiated with the parameters its host
//                             code picks on an H200, and their host launchers (TMA descriptors
//                             built as DeepGEMM builds them). DeepGEMM's CUTLASS, C++20.
//   -DVLLM_DSA_PART_TOPK      vLLM's top-k kernels (cooperative_topk.cuh, persistent_topk.cuh);
//                             vLLM's own launchers (cooperative_topk.cu, topk.cu) take torch
//                             tensors, so this part is a minimal launcher of ours that makes the
//                             same launch decisions with raw pointers.
//   (neither)                 the driver: FlashMLA's headers (FlashMLA's CUTLASS), data, checks,
//                             timing (peers_common.cuh).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dsa_peers_common.h"

// ------------------------------------------------------------------ interface between the parts
namespace dsa {
constexpr int kIndexHeads = 64, kIndexDim = 128, kBlock = 64, kTopK = 2048;
constexpr int kIndexRowBytes = kIndexDim + 4;              // 132: 128 e4m3 + one fp32 scale
constexpr int kIndexBlockBytes = kBlock * kIndexRowBytes;  // 8448: 64 key rows, then 64 scales
constexpr int kSplitKV = 256;                              // DeepGEMM's split_kv (paged logits)
constexpr int kDgSms = 132;  // H200/H100 SXM SM count, compiled into DeepGEMM's schedule (see below)

// One fp8_paged_mqa_logits launch: TMA descriptors over one set of buffers.
struct PagedLogitsPlan {
  CUtensorMap q, kv, kv_scales, weights;
  int batch = 0, logits_stride = 0, block_table_stride = 0, smem = 0;
  const int* context_lens = nullptr;  // [batch][1]
  float* logits = nullptr;            // [batch][logits_stride]
  const int* block_table = nullptr;   // [batch][block_table_stride]
  const int* schedule = nullptr;      // [kDgSms + 1][2] from paged_logits_metadata
};
// q: e4m3 [batch][64][128]; kv_cache: num_blocks x 8448 bytes; weights: fp32 [batch][64]
void make_paged_logits_plan(PagedLogitsPlan* p, const void* q, const void* kv_cache, int num_blocks,
                            const float* weights, int batch, const int* context_lens, float* logits, int logits_stride,
                            const int* block_table, int block_table_stride, const int* schedule);
void paged_logits(const PagedLogitsPlan& p, cudaStream_t s);
void paged_logits_metadata(const int* context_lens, int* schedule, int batch, cudaStream_t s);

// vLLM top-2048: rows <= 32 -> cooperative_topk, else FilteredTopK. tie_ws: rows x 2048 x 8 bytes.
void vllm_cooperative_topk(const float* logits, int stride, const int* lengths, int* out, void* tie_ws, int rows,
                           cudaStream_t s);
void vllm_filtered_topk(const float* logits, int stride, const int* lengths, int* out, int rows, cudaStream_t s);
}  // namespace dsa

#if defined(VLLM_DSA_PART_DEEPGEMM)
// =================================================================== part 1: DeepGEMM
// The kernels DeepGEMM's JIT would build for this shape on an H200 (csrc/jit_kernels/impls/
// sm90_fp8_mqa_logits.hpp and csrc/apis/attention.hpp at 54e22612):
//   sm90_fp8_paged_mqa_logits<next_n 1, heads 64, head_dim 128, block_kv 64, context_lens 2D,
//       not varlen, 3 q stages, 3 kv stages, split_kv 256, 128 TMA threads,
//       512 math threads (= split_kv / 64 warpgroups x 128), float logits>, grid = SMs
//   sm90_paged_mqa_logits_metadata<align(batch, 32), split_kv 256, SMs, not varlen>
// kNumSMs is a template parameter of the schedule and the logits grid must match it, so both
// are fixed at 132 (H200 / H100 SXM). On a card with another SM count the kernels stay correct
// (the grid is simply 132 CTAs), only the schedule is not the one DeepGEMM would pick there.
#include <deep_gemm/impls/sm90_fp8_paged_mqa_logits.cuh>
#include <deep_gemm/scheduler/sm90_paged_mqa_logits.cuh>

namespace dsa {
namespace {

using dsa_peers::tma_desc;

constexpr int kQStages = 3, kKVStages = 3, kTmaThreads = 128;
constexpr int kMathThreads = (kSplitKV / 64) * 128;  // 512
constexpr auto kPagedKernel =
    &deep_gemm::sm90_fp8_paged_mqa_logits<1, kIndexHeads, kIndexDim, kBlock, true, false, kQStages, kKVStages, kSplitKV,
                                          kTmaThreads, kMathThreads, float>;

constexpr int align_up(int x, int a) { return (x + a - 1) / a * a; }

// Dynamic shared memory, as DeepGEMM's host computes it for this kernel.
constexpr int paged_smem_bytes() {
  const int swz = kIndexDim * 8;
  const int q_stage = 1 * kIndexHeads * kIndexDim;
  const int w_stage = align_up(1 * kIndexHeads * 4, swz);
  const int q_pipe = kQStages * (q_stage + w_stage) + align_up(kQStages * 8 * 2, swz);
  const int kv_stage = kBlock * kIndexDim;
  const int s_stage = align_up(kBlock * 4, swz);
  const int kv_pipe = kKVStages * (kv_stage + s_stage) + align_up(kKVStages * 8 * 2, swz);
  const int wgs = kSplitKV / 64;
  return q_pipe + wgs * kv_pipe + wgs * 2 * 8 + 4;
}

// DeepGEMM launches with programmatic stream serialization (PDL) on; so do we (pdl_launch_config).

template <uint32_t kAlignedBatch>
void launch_metadata(const int* context_lens, int* schedule, int batch, cudaStream_t s) {
  auto kernel = &deep_gemm::sched::sm90_paged_mqa_logits_metadata<kAlignedBatch, kSplitKV, kDgSms, false>;
  const int smem = int(kAlignedBatch * sizeof(int));
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t c = dsa_peers::pdl_launch_config(dim3(1), dim3(32), smem, s, attr);
  uint32_t b = uint32_t(batch), next_n = 1;
  bool ctx2d = true;
  const uint32_t* lens = reinterpret_cast<const uint32_t*>(context_lens);
  const uint32_t* indices = nullptr;
  uint32_t* meta = reinterpret_cast<uint32_t*>(schedule);
  void* args[] = {&b, &next_n, &ctx2d, &lens, &indices, &meta};
  DSA_CK(cudaLaunchKernelExC(&c, reinterpret_cast<const void*>(kernel), args));
}

}  // namespace

void paged_logits_metadata(const int* context_lens, int* schedule, int batch, cudaStream_t s) {
  // aligned_batch_size = align(batch, 32) is a template parameter: four instantiations, B <= 128.
  const int ab = align_up(batch, 32);
  switch (ab) {
    case 32: launch_metadata<32>(context_lens, schedule, batch, s); break;
    case 64: launch_metadata<64>(context_lens, schedule, batch, s); break;
    case 96: launch_metadata<96>(context_lens, schedule, batch, s); break;
    case 128: launch_metadata<128>(context_lens, schedule, batch, s); break;
    default: fprintf(stderr, "paged_logits_metadata: batch %d > 128 not instantiated\n", batch); exit(3);
  }
}

void make_paged_logits_plan(PagedLogitsPlan* p, const void* q, const void* kv_cache, int num_blocks,
                            const float* weights, int batch, const int* context_lens, float* logits, int logits_stride,
                            const int* block_table, int block_table_stride, const int* schedule) {
  // The views DeepGEMM derives from vLLM's [num_blocks, 64, 1, 132] uint8 cache: keys
  // [num_blocks, 64, 128] e4m3 with block stride 8448, scales [num_blocks, 64] fp32 starting at
  // byte 64 x 128 with block stride 8448 / 4.
  const int next_n_atom = 1;
  {
    uint64_t d[2] = {uint64_t(kIndexDim), uint64_t(batch) * kIndexHeads};
    uint64_t st[1] = {uint64_t(kIndexDim)};
    uint32_t box[2] = {uint32_t(kIndexDim), uint32_t(next_n_atom * kIndexHeads)};
    p->q = tma_desc(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, q, 2, d, st, box, kIndexDim);
  }
  {
    uint64_t d[3] = {uint64_t(kIndexDim), uint64_t(kBlock), uint64_t(num_blocks)};
    uint64_t st[2] = {uint64_t(kIndexDim), uint64_t(kIndexBlockBytes)};
    uint32_t box[3] = {uint32_t(kIndexDim), uint32_t(kBlock), 1};
    p->kv = tma_desc(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, kv_cache, 3, d, st, box, kIndexDim);
  }
  {
    const char* scales = static_cast<const char*>(kv_cache) + kBlock * kIndexDim;
    uint64_t d[2] = {uint64_t(kBlock), uint64_t(num_blocks)};
    uint64_t st[1] = {uint64_t(kIndexBlockBytes / 4)};
    uint32_t box[2] = {uint32_t(kBlock), 1};
    p->kv_scales = tma_desc(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, scales, 2, d, st, box, 0);
  }
  {
    uint64_t d[2] = {uint64_t(kIndexHeads), uint64_t(batch)};
    uint64_t st[1] = {uint64_t(kIndexHeads)};
    uint32_t box[2] = {uint32_t(kIndexHeads), uint32_t(next_n_atom)};
    p->weights = tma_desc(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, weights, 2, d, st, box, 0);
  }
  p->batch = batch;
  p->logits_stride = logits_stride;
  p->block_table_stride = block_table_stride;
  p->context_lens = context_lens;
  p->logits = logits;
  p->block_table = block_table;
  p->schedule = schedule;
  p->smem = paged_smem_bytes();
  if (logits_stride % kSplitKV != 0) {
    fprintf(stderr, "paged logits: stride %d not a multiple of %d\n", logits_stride, kSplitKV);
    exit(3);
  }
  DSA_CK(cudaFuncSetAttribute(kPagedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p->smem));
}

void paged_logits(const PagedLogitsPlan& p, cudaStream_t s) {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t c = dsa_peers::pdl_launch_config(dim3(kDgSms), dim3(kTmaThreads + kMathThreads), p.smem, s, attr);
  uint32_t batch = uint32_t(p.batch), stride = uint32_t(p.logits_stride), bts = uint32_t(p.block_table_stride);
  const uint32_t* lens = reinterpret_cast<const uint32_t*>(p.context_lens);
  float* logits = p.logits;
  const uint32_t* bt = reinterpret_cast<const uint32_t*>(p.block_table);
  const uint32_t* indices = nullptr;
  const uint32_t* sched = reinterpret_cast<const uint32_t*>(p.schedule);
  CUtensorMap q = p.q, kv = p.kv, sc = p.kv_scales, w = p.weights;
  void* args[] = {&batch, &stride, &bts, &lens, &logits, &bt, &indices, &sched, &q, &kv, &sc, &w};
  DSA_CK(cudaLaunchKernelExC(&c, reinterpret_cast<const void*>(kPagedKernel), args));
}

}  // namespace dsa

#elif defined(VLLM_DSA_PART_TOPK)
// =================================================================== part 2: vLLM top-k
// vLLM's kernels from third_party/vllm/csrc/libtorch_stable (b317d150), launched the way its
// torch-facing launchers do for k = 2048 on an sm_90 card:
//   cooperative_topk.cu: rows <= 8 -> cluster of 8 CTAs per row (smem kSmemSize8); rows <= 32
//     -> cluster of 4 (kSmemSize4); clusters of 16 only on sm_100+. Tie workspace rows x 2048.
//   topk.cu (persistent_topk): rows > 32 with >= 128 KiB opt-in shared memory ->
//     FilteredTopKRaggedTransform<float, int32_t, 2048>(logits, out, lengths, rows, 2048,
//     logits.stride(0)) (one 1024-thread CTA per row).
#include <cstdio>
#include <cstdlib>

#include "cooperative_topk.cuh"
#include "persistent_topk.cuh"

namespace dsa {
namespace {
void topk_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    exit(2);
  }
}
template <uint32_t CS>
void launch_cluster(vllm::cooperative::CooperativeTopKParams<kTopK>& params, size_t smem, cudaStream_t s) {
  namespace ct = vllm::cooperative;
  auto kernel = CS == 8 ? &ct::cooperative_topk_cs8<kTopK> : &ct::cooperative_topk_cs4<kTopK>;
  topk_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cooperative_topk smem attribute");
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(params.num_rows, CS);
  cfg.blockDim = dim3(vllm::topk_histogram_4096::kBlockSize);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = CS;
  attr[0].val.clusterDim.z = 1;
  cfg.numAttrs = 1;
  cfg.attrs = attr;
  topk_check(cudaLaunchKernelEx(&cfg, kernel, params), "cooperative_topk launch");
}
}  // namespace

void vllm_cooperative_topk(const float* logits, int stride, const int* lengths, int* out, void* tie_ws, int rows,
                           cudaStream_t s) {
  if (rows > 32 || stride % 4 != 0) {
    fprintf(stderr, "cooperative_topk: rows %d (<= 32) stride %d (multiple of 4)\n", rows, stride);
    exit(3);
  }
  vllm::cooperative::CooperativeTopKParams<kTopK> params;
  params.input = logits;
  params.output = out;
  params.lengths = lengths;
  params.num_rows = uint32_t(rows);
  params.stride = uint32_t(stride);
  params.tie_ws = static_cast<vllm::topk_histogram_4096::Tie*>(tie_ws);
  if (rows <= 8)
    launch_cluster<8>(params, vllm::cooperative::kSmemSize8, s);
  else
    launch_cluster<4>(params, vllm::cooperative::kSmemSize4, s);
}

void vllm_filtered_topk(const float* logits, int stride, const int* lengths, int* out, int rows, cudaStream_t s) {
  topk_check(vllm::FilteredTopKRaggedTransform<float, int32_t, kTopK>(logits, out, lengths, uint32_t(rows),
                                                                      uint32_t(kTopK), uint32_t(stride), s),
             "FilteredTopK launch");
}

}  // namespace dsa

#else
// =================================================================== part 3: the driver
#include <cuda_fp8.h>

#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

#include "peers_common.cuh"
#include "dsa_peers_device.cuh"

namespace {
using bf16 = cutlass::bfloat16_t;
constexpr int H = 128, D_QK = 576, D_V = 512, D_ROPE = 64;
constexpr int MLA_ROW = 512 + 4 * 4 + D_ROPE * 2;  // 656 bytes: V3.2 FP8 MLA row
constexpr float LOG2E = 1.44269504f;
using dsa::kBlock;
using dsa::kIndexBlockBytes;
using dsa::kIndexDim;
using dsa::kIndexHeads;
using dsa::kTopK;

// ---------------------------------------------------------------- random data (ours)
using dsa_peers::fill_e4m3_kernel;
using dsa_peers::fill_f32_kernel;
using dsa_peers::hash_uniform;
using dsa_peers::to_e4m3;

// Index keys in vLLM's paged layout: per block 64 rows of 128 e4m3, then 64 fp32 scales; per
// token the scale is a power of two (ue8m0, as vLLM's indexer_k_quant_and_cache with
// scale_fmt "ue8m0"): scale = 2^ceil(log2(amax / 448)). One warp per token.
__global__ void fill_index_cache_kernel(uint8_t* cache, size_t ntok, uint64_t seed) {
  const size_t tok = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (tok >= ntok) return;
  uint8_t bytes[4];
  const float scale = dsa_peers::warp_fp8_key(seed, tok, bytes);
  uint8_t* blk = cache + (tok / kBlock) * size_t(kIndexBlockBytes);
  const int row = int(tok % kBlock);
  for (int i = 0; i < 4; ++i) blk[row * kIndexDim + lane * 4 + i] = bytes[i];
  if (lane == 0) reinterpret_cast<float*>(blk + kBlock * kIndexDim)[row] = scale;
}

// MLA rows in DeepSeek-V3.2's FP8 format (FlashMLA's tests/quant.py): per 128-wide tile of the
// 512 latent values a power-of-two scale 2^ceil(log2(max(amax/448, 1e-4))), e4m3 values, the 4
// scales as fp32, then the 64 rope values as bf16. One warp per token.
__global__ void fill_mla_cache_kernel(uint8_t* cache, size_t ntok, uint64_t seed) {
  size_t tok = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  if (tok >= ntok) return;
  uint8_t* row = cache + tok * MLA_ROW;
  for (int t = 0; t < 4; ++t) {
    float v[4], amax = 0.f;
    for (int i = 0; i < 4; ++i) {
      v[i] = __bfloat162float(__float2bfloat16(hash_uniform(seed, tok * D_QK + t * 128 + lane * 4 + i)));
      amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float scale = exp2f(ceilf(log2f(fmaxf(amax / 448.f, 1e-4f))));
    for (int i = 0; i < 4; ++i) row[t * 128 + lane * 4 + i] = to_e4m3(v[i] / scale);
    if (lane == 0) reinterpret_cast<float*>(row + 512)[t] = scale;
  }
  __nv_bfloat16* rope = reinterpret_cast<__nv_bfloat16*>(row + 528);
  for (int i = lane; i < D_ROPE; i += 32) rope[i] = __float2bfloat16(hash_uniform(seed, tok * D_QK + 512 + i));
}

// Reference input for the attention check: the selected MLA rows of every request, dequantized
// to bf16 (exact: power-of-two scales), [B * 2048][576]. One warp per (request, selected row).
__global__ void gather_dequant_kernel(const uint8_t* cache, const int* slots, __nv_bfloat16* dst, size_t nrows) {
  size_t r = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  if (r >= nrows) return;
  int slot = slots[r];
  __nv_bfloat16* d = dst + r * D_QK;
  if (slot < 0) {
    for (int i = lane; i < D_QK; i += 32) d[i] = __float2bfloat16(0.f);
    return;
  }
  const uint8_t* s = cache + size_t(slot) * MLA_ROW;
  const float* sc = reinterpret_cast<const float*>(s + 512);
  for (int i = lane; i < 512; i += 32) {
    __nv_fp8_e4m3 q8;
    *reinterpret_cast<uint8_t*>(&q8) = s[i];
    d[i] = __float2bfloat16(float(q8) * sc[i / 128]);
  }
  const __nv_bfloat16* rope = reinterpret_cast<const __nv_bfloat16*>(s + 528);
  for (int i = lane; i < D_ROPE; i += 32) d[512 + i] = rope[i];
}

// ---------------------------------------------------------------- slots_ours
// vLLM turns the indexer's per-request token positions into global cache slots (a Triton kernel
// in its FlashMLA sparse backend): slot = block_table[req][pos / 64] * 64 + pos % 64, -1 stays -1.
__global__ void positions_to_slots_kernel(const int* topk, const int* block_table, int bt_stride, int* slots) {
  const int b = blockIdx.x;
  const int* bt = block_table + size_t(b) * bt_stride;
  for (int j = threadIdx.x; j < kTopK; j += blockDim.x) {
    const int pos = topk[size_t(b) * kTopK + j];
    slots[size_t(b) * kTopK + j] = pos < 0 ? -1 : bt[pos / kBlock] * kBlock + pos % kBlock;
  }
}

__global__ void count_nonfinite_f32_kernel(const float* p, int rows, size_t stride, int len, unsigned long long* n) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(rows) * len;
       i += size_t(gridDim.x) * blockDim.x)
    if (!isfinite(p[(i / len) * stride + i % len])) ++c;
  if (c) atomicAdd(n, c);
}

// ---------------------------------------------------------------- host helpers
using dsa_peers::dalloc;
using dsa_peers::e4m3_to_float;
using dsa_peers::grid_for;
using dsa_peers::to_host;

// ---------------------------------------------------------------- one configuration
// A "world" is everything one layer of one step reads: index keys, MLA rows, block table, the
// layer's queries and weights, and its own logits / top-k / slots buffers. Cold mode rotates the
// launches of a graph over P worlds so that what they read exceeds ~2.5x the L2.
struct World {
  uint8_t* q_index;      // e4m3 [B][64][128]
  float* weights;        // [B][64]
  __nv_bfloat16* q_mla;  // [B][128][576]
  int* block_table;      // [B][S / 64] global block ids (index keys and MLA rows share them)
  float* logits;         // [B][stride]
  int* topk;             // [B][2048] positions in the request's context
  int* slots;            // [B][2048] global slot ids
  dsa::PagedLogitsPlan plan;
};

struct Bench {
  const peers::Options& opt;
  const peers::DeviceInfo& dev;
  cudaStream_t s;
  int B, S, stride, nbps, P = 1, L = 1;
  uint8_t* index_cache = nullptr;  // P*B*nbps blocks x 8448 bytes
  uint8_t* mla_cache = nullptr;    // P*B*S rows x 656 bytes (blocks of 64 rows)
  int* ctx_lens = nullptr;         // [B][1] = S
  int* dg_sched = nullptr;         // [kDgSms + 1][2]
  void* tie_ws = nullptr;
  std::vector<World> w;
  std::vector<std::vector<int> > h_bt;  // per world, host copy of the block table
  // FlashMLA decode
  DecodingSchedMeta* fm_sched = nullptr;
  int* fm_splits = nullptr;
  int num_sm_parts = 0;
  float *lse = nullptr, *lse_accum = nullptr, *o_accum = nullptr;
  __nv_bfloat16* out = nullptr;  // [B][128][512]
  GetDecodeSchedMetaParams sp;
  SparseAttnDecodeParams dp;
  CombineParams cp;

  Bench(const peers::Options& o, const peers::DeviceInfo& d, cudaStream_t st, int b, int sl)
      : opt(o), dev(d), s(st), B(b), S(sl) {}

  // ----- the pieces
  void meta() {
    dsa::paged_logits_metadata(ctx_lens, dg_sched, B, s);
    smxx::decode::run_get_decoding_sched_meta_kernel(sp);
  }
  void logits(int i) { dsa::paged_logits(w[i].plan, s); }
  void topk(int i) {
    if (B <= 32)
      dsa::vllm_cooperative_topk(w[i].logits, stride, ctx_lens, w[i].topk, tie_ws, B, s);
    else
      dsa::vllm_filtered_topk(w[i].logits, stride, ctx_lens, w[i].topk, B, s);
  }
  void slots(int i) {
    positions_to_slots_kernel<<<B, 256, 0, s>>>(w[i].topk, w[i].block_table, nbps, w[i].slots);
    CK(cudaGetLastError());
  }
  void decode(int i) {
    SparseAttnDecodeParams p = dp;
    p.q = reinterpret_cast<bf16*>(w[i].q_mla);
    p.indices = w[i].slots;
    sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, H>(p);
    smxx::decode::run_flash_mla_combine_kernel<bf16>(cp);
  }
  void layer(int i) { logits(i), topk(i), slots(i), decode(i); }

  void setup();
  void run();
  // checks of world i; each returns ok plus figures for the CSV
  peers::CheckResult check_logits(int i);
  peers::CheckResult check_topk(int i);
  peers::CheckResult check_slots(int i);
  peers::CheckResult check_decode(int i);
  void poison(int i) {
    CK(cudaMemsetAsync(w[i].logits, 0xFF, size_t(B) * stride * 4, s));  // NaN
    CK(cudaMemsetAsync(w[i].topk, 0x7F, size_t(B) * kTopK * 4, s));     // out of range
    CK(cudaMemsetAsync(w[i].slots, 0x7F, size_t(B) * kTopK * 4, s));
    peers::poison_bf16(out, size_t(B) * H * D_V, s);
  }
};

void Bench::setup() {
  REQUIRE(S % 256 == 0 && S > kTopK, "S=%d: needs S %% 256 == 0 and S > 2048", S);
  REQUIRE(B >= 1 && B <= 128, "B=%d: 1..128", B);
  nbps = S / kBlock;
  // vLLM sizes the logits for max_model_len; here max_model_len = S, so the row stride is
  // align(align(S, 256), 256 floats = 1024 bytes) as DeepGEMM allocates it.
  stride = (S + 255) / 256 * 256;

  // Bytes each piece reads per launch; cold mode needs the smallest of the two big ones
  // (index keys, selected MLA rows) to exceed the target over one graph replay.
  const double idx_bytes = double(B) * S * dsa::kIndexRowBytes;
  const double mla_bytes = double(B) * kTopK * MLA_ROW;
  const double step_bytes = idx_bytes + 2.0 * B * stride * 4 + mla_bytes;
  const double world_bytes = double(B) * S * (dsa::kIndexRowBytes + MLA_ROW) + double(B) * stride * 4;
  L = opt.launches;
  if (opt.rotate) {
    const double target = peers::cold_target_bytes(opt, dev);
    P = int(std::ceil(target / std::min(idx_bytes, mla_bytes)));
    size_t free_b = 0, total_b = 0;
    CK(cudaMemGetInfo(&free_b, &total_b));
    const int cap = std::max(1, int(0.6 * double(free_b) / world_bytes));
    P = std::max(1, std::min(P, cap));
    L = peers::cold_launches(step_bytes, target, opt.launches);
    L = std::max(L, P);
  }
  REQUIRE(double(P) * B * S < 2147483647.0, "too many cache rows for int32 slots");

  const size_t nblocks = size_t(P) * B * nbps;
  index_cache = dalloc<uint8_t>(nblocks * kIndexBlockBytes);
  mla_cache = dalloc<uint8_t>(nblocks * kBlock * MLA_ROW);
  fill_index_cache_kernel<<<grid_for(nblocks * kBlock * 32), 256, 0, s>>>(index_cache, nblocks * kBlock,
                                                                            opt.seed * 11 + 1);
  CK(cudaGetLastError());
  fill_mla_cache_kernel<<<grid_for(nblocks * kBlock * 32), 256, 0, s>>>(mla_cache, nblocks * kBlock,
                                                                          opt.seed * 11 + 2);
  CK(cudaGetLastError());

  std::vector<int> h_ctx(B, S);
  ctx_lens = dalloc<int>(B);
  CK(cudaMemcpy(ctx_lens, h_ctx.data(), B * 4, cudaMemcpyHostToDevice));
  dg_sched = dalloc<int>((dsa::kDgSms + 1) * 2);
  tie_ws = dalloc<uint8_t>(size_t(std::max(B, 1)) * kTopK * 8);

  w.resize(P);
  h_bt.resize(P);
  std::mt19937_64 rng(opt.seed * 13 + uint64_t(B) * 1000003 + S);
  for (int i = 0; i < P; ++i) {
    World& x = w[i];
    x.q_index = dalloc<uint8_t>(size_t(B) * kIndexHeads * kIndexDim);
    x.weights = dalloc<float>(size_t(B) * kIndexHeads);
    x.q_mla = dalloc<__nv_bfloat16>(size_t(B) * H * D_QK);
    x.block_table = dalloc<int>(size_t(B) * nbps);
    x.logits = dalloc<float>(size_t(B) * stride);
    x.topk = dalloc<int>(size_t(B) * kTopK);
    x.slots = dalloc<int>(size_t(B) * kTopK);
    const uint64_t sd = opt.seed * 17 + uint64_t(i) * 7919;
    fill_e4m3_kernel<<<grid_for(size_t(B) * kIndexHeads * kIndexDim), 256, 0, s>>>(
        x.q_index, size_t(B) * kIndexHeads * kIndexDim, sd + 1, 448.f);
    fill_f32_kernel<<<grid_for(size_t(B) * kIndexHeads), 256, 0, s>>>(x.weights, size_t(B) * kIndexHeads, sd + 2,
                                                                        1.f);
    peers::fill_uniform_bf16(x.q_mla, size_t(B) * H * D_QK, sd + 3, 6.f, s);
    // This world's blocks, in a random order (an allocator's blocks are not contiguous).
    std::vector<int>& bt = h_bt[i];
    bt.resize(size_t(B) * nbps);
    std::iota(bt.begin(), bt.end(), i * B * nbps);
    std::shuffle(bt.begin(), bt.end(), rng);
    CK(cudaMemcpy(x.block_table, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
    dsa::make_paged_logits_plan(&x.plan, x.q_index, index_cache, int(nblocks), x.weights, B, ctx_lens, x.logits, stride,
                                x.block_table, nbps, dg_sched);
  }

  // FlashMLA sparse FP8 decode: split-KV schedule over 64-row blocks of the 2048 selected rows,
  // num_sm_parts = SMs / (s_q x h_q / 64), scratch for B + num_sm_parts splits.
  num_sm_parts = std::max(dev.sms / (H / 64), 1);
  const int total_splits = B + num_sm_parts;
  fm_sched = dalloc<DecodingSchedMeta>(num_sm_parts);
  fm_splits = dalloc<int>(B + 1);
  lse = dalloc<float>(size_t(B) * H);
  lse_accum = dalloc<float>(size_t(total_splits) * H);
  o_accum = dalloc<float>(size_t(total_splits) * H * D_V);
  out = dalloc<__nv_bfloat16>(size_t(B) * H * D_V);
  memset(&sp, 0, sizeof(sp));
  sp.b = B;
  sp.s_q = 1;
  sp.block_size_n = 64;
  sp.fixed_overhead_num_blocks = 5;
  sp.topk = kTopK;
  sp.extra_topk = 0;
  sp.tile_scheduler_metadata_ptr = fm_sched;
  sp.num_splits_ptr = fm_splits;
  sp.num_sm_parts = num_sm_parts;
  sp.stream = s;

  memset(&dp, 0, sizeof(dp));
  dp.b = B;
  dp.s_q = 1;
  dp.h_q = H;
  dp.h_kv = 1;
  dp.d_qk = D_QK;
  dp.d_v = D_V;
  dp.sm_scale = 1.f / std::sqrt(float(D_QK));
  dp.sm_scale_div_log2 = dp.sm_scale * LOG2E;
  dp.num_blocks = int(nblocks);
  dp.page_block_size = kBlock;
  dp.topk = kTopK;
  dp.model_type = ModelType::V32;
  dp.kv = reinterpret_cast<bf16*>(mla_cache);
  dp.lse = lse;
  dp.out = reinterpret_cast<bf16*>(out);
  dp.stride_q_b = H * D_QK;
  dp.stride_q_s_q = H * D_QK;
  dp.stride_q_h_q = D_QK;
  dp.stride_kv_block = kBlock * MLA_ROW;
  dp.stride_kv_row = MLA_ROW;
  dp.stride_indices_b = kTopK;
  dp.stride_indices_s_q = kTopK;
  dp.stride_lse_b = H;
  dp.stride_lse_s_q = H;
  dp.stride_o_b = H * D_V;
  dp.stride_o_s_q = H * D_V;
  dp.stride_o_h_q = D_V;
  dp.stream = s;
  dp.lse_accum = lse_accum;
  dp.o_accum = o_accum;
  dp.stride_lse_accum_split = H;
  dp.stride_lse_accum_s_q = H;
  dp.stride_o_accum_split = H * D_V;
  dp.stride_o_accum_s_q = H * D_V;
  dp.stride_o_accum_h_q = D_V;
  dp.tile_scheduler_metadata_ptr = fm_sched;
  dp.num_splits_ptr = fm_splits;
  dp.num_sm_parts = num_sm_parts;

  memset(&cp, 0, sizeof(cp));
  cp.b = B;
  cp.s_q = 1;
  cp.h_q = H;
  cp.d_v = D_V;
  cp.lse = lse;
  cp.out = out;
  cp.stride_lse_b = H;
  cp.stride_lse_s_q = H;
  cp.stride_o_b = H * D_V;
  cp.stride_o_s_q = H * D_V;
  cp.stride_o_h_q = D_V;
  cp.lse_accum = lse_accum;
  cp.o_accum = o_accum;
  cp.stride_lse_accum_split = H;
  cp.stride_lse_accum_s_q = H;
  cp.stride_o_accum_split = H * D_V;
  cp.stride_o_accum_s_q = H * D_V;
  cp.stride_o_accum_h_q = D_V;
  cp.tile_scheduler_metadata_ptr = fm_sched;
  cp.num_splits_ptr = fm_splits;
  cp.num_sm_parts = num_sm_parts;
  cp.stream = s;
  CK(cudaStreamSynchronize(s));
}

// Logits of sampled requests at sampled positions against fp32 dot products of the dequantized
// keys: sum_h relu(q_h . k_t) * w_h * scale_t (DeepGEMM: relu of the FP8 product, times the head
// weight, summed over heads, times the key's scale). Plus a scan of every valid logit.
peers::CheckResult Bench::check_logits(int i) {
  peers::CheckResult r;
  unsigned long long* d_n = dalloc<unsigned long long>(1);
  CK(cudaMemset(d_n, 0, 8));
  count_nonfinite_f32_kernel<<<1024, 256, 0, s>>>(w[i].logits, B, size_t(stride), S, d_n);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));
  r.nonfinite = (long long)to_host(d_n, 1)[0];
  CK(cudaFree(d_n));
  const std::vector<uint8_t> q = to_host(w[i].q_index, size_t(B) * kIndexHeads * kIndexDim);
  const std::vector<float> wt = to_host(w[i].weights, size_t(B) * kIndexHeads);
  std::mt19937 rng(uint32_t(opt.seed + i));
  dsa_peers::ErrorSum err;
  std::vector<uint8_t> blk(kIndexBlockBytes);
  for (int b : peers::sample_requests(B, opt.check_all)) {
    std::vector<int> pos;
    for (int k = 0; k < 1024; ++k) pos.push_back(int(rng() % uint32_t(S)));
    for (int t = S - 64; t < S; ++t) pos.push_back(t);
    const std::vector<float> row = to_host(w[i].logits + size_t(b) * stride, size_t(S));
    for (int t : pos) {
      const int block = h_bt[i][size_t(b) * nbps + t / kBlock];
      CK(cudaMemcpy(blk.data(), index_cache + size_t(block) * kIndexBlockBytes, kIndexBlockBytes,
                    cudaMemcpyDeviceToHost));
      float scale;
      memcpy(&scale, blk.data() + kBlock * kIndexDim + (t % kBlock) * 4, 4);
      double acc = 0;
      for (int h = 0; h < kIndexHeads; ++h) {
        double dot = 0;
        for (int d = 0; d < kIndexDim; ++d)
          dot += double(e4m3_to_float(q[(size_t(b) * kIndexHeads + h) * kIndexDim + d])) *
                 e4m3_to_float(blk[(t % kBlock) * kIndexDim + d]);
        acc += std::max(dot, 0.0) * wt[size_t(b) * kIndexHeads + h];
      }
      acc *= scale;
      err.add(row[t], acc);
    }
  }
  // 2e-3: Hopper accumulates FP8 WGMMA products with fewer than fp32's mantissa bits; a layout
  // or scale mistake gives errors of order 1.
  dsa_peers::judge(r, err, 2e-3, 0.0, "logits");
  return r;
}

// The selected positions of sampled requests against a top-2048 of the same (GPU) logits: all
// distinct and inside the context, none below the 2048th largest value, and every position
// strictly above it selected (which of several equal values at the boundary is free).
peers::CheckResult Bench::check_topk(int i) {
  peers::CheckResult r;
  r.rel_l2 = 0, r.max_abs = 0, r.max_ref = 1;
  int bad = 0;
  for (int b : peers::sample_requests(B, opt.check_all)) {
    const std::vector<float> row = to_host(w[i].logits + size_t(b) * stride, size_t(S));
    const std::vector<int> sel = to_host(w[i].topk + size_t(b) * kTopK, size_t(kTopK));
    std::vector<float> sorted(row);
    std::nth_element(sorted.begin(), sorted.begin() + (kTopK - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[kTopK - 1];
    size_t above = 0;
    for (float v : row) above += v > kth;
    std::vector<char> seen(S, 0);
    size_t sel_above = 0;
    for (int p : sel) {
      if (p < 0 || p >= S || seen[p] || !(row[p] >= kth)) {
        ++bad;
        break;
      }
      seen[p] = 1;
      sel_above += row[p] > kth;
    }
    if (sel_above != above) ++bad;
  }
  r.ok = bad == 0;
  if (!r.ok) r.why = "topk: " + std::to_string(bad) + " sampled rows differ from the reference";
  return r;
}

peers::CheckResult Bench::check_slots(int i) {
  peers::CheckResult r;
  r.rel_l2 = 0, r.max_abs = 0, r.max_ref = 1;
  const std::vector<int> sel = to_host(w[i].topk, size_t(B) * kTopK);
  const std::vector<int> sl = to_host(w[i].slots, size_t(B) * kTopK);
  long long bad = 0;
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < kTopK; ++j) {
      const int p = sel[size_t(b) * kTopK + j];
      const int want = (p < 0 || p >= S) ? -1 : h_bt[i][size_t(b) * nbps + p / kBlock] * kBlock + p % kBlock;
      bad += (p < 0 || p >= S) || sl[size_t(b) * kTopK + j] != want;
    }
  r.ok = bad == 0;
  if (!r.ok) r.why = "slots: " + std::to_string(bad) + " wrong";
  return r;
}

// Reference attention (fp32, peers_common.cuh) over the rows the slots name, dequantized.
peers::CheckResult Bench::check_decode(int i) {
  __nv_bfloat16* dq = dalloc<__nv_bfloat16>(size_t(B) * kTopK * D_QK);
  int* ident = dalloc<int>(size_t(B) * kTopK);
  std::vector<int> h_id(size_t(B) * kTopK);
  std::iota(h_id.begin(), h_id.end(), 0);
  CK(cudaMemcpy(ident, h_id.data(), h_id.size() * 4, cudaMemcpyHostToDevice));
  gather_dequant_kernel<<<grid_for(size_t(B) * kTopK * 32), 256, 0, s>>>(mla_cache, w[i].slots, dq,
                                                                           size_t(B) * kTopK);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(s));
  peers::RefProblem rp;
  rp.nreq = B;
  rp.nheads = H;
  rp.S = kTopK;
  rp.dA = D_QK;
  rp.dB = 0;
  rp.dv = D_V;
  rp.q = w[i].q_mla;
  rp.q_stride_req = H * D_QK;
  rp.q_stride_h = D_QK;
  rp.kA = dq;
  rp.kA_stride = D_QK;
  rp.v = dq;
  rp.v_stride = D_QK;
  rp.idx = ident;
  rp.idx_stride = kTopK;
  rp.scale = dp.sm_scale;
  const std::vector<int> reqs = peers::sample_requests(B, opt.check_all);
  peers::CheckResult r = peers::check_output(out, B, H, D_V, H * D_V, D_V, reqs, peers::run_reference(rp, reqs));
  CK(cudaFree(dq));
  CK(cudaFree(ident));
  return r;
}

// Combine the checks of several stages into one result (the first failure explains).
peers::CheckResult all_of(std::initializer_list<peers::CheckResult> cs) {
  peers::CheckResult r;
  r.ok = true;
  r.rel_l2 = 0, r.max_abs = 0;
  for (const auto& c : cs) {
    r.ok = r.ok && c.ok;
    if (!c.ok && r.why.empty()) r.why = c.why;
    r.nonfinite += c.nonfinite;
    r.rel_l2 = std::max(r.rel_l2, c.rel_l2);  // the largest relative error of the stages
    r.max_abs = std::max(r.max_abs, c.max_abs);
  }
  return r;
}

void Bench::run() {
  setup();
  // 1. Eager step over world 0, every stage checked (outputs poisoned first), then every other
  //    world computed once so that each piece alone finds valid inputs.
  poison(0);
  meta();
  layer(0);
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  const peers::CheckResult c_log = check_logits(0), c_top = check_topk(0), c_slot = check_slots(0),
                           c_dec = check_decode(0);
  const peers::CheckResult c_all = all_of({c_log, c_top, c_slot, c_dec});
  for (int i = 1; i < P; ++i) layer(i);
  CK(cudaStreamSynchronize(s));

  struct Piece {
    const char* lib;
    const char* kernel;
    std::function<void(int)> enqueue;  // launch i of a graph
    int hq, dqk, dv;
    double bytes, flops;
    const peers::CheckResult* first;
    std::function<peers::CheckResult(int)> check;  // after the graph: the last launch's world
  };
  const double b_idx = double(B) * S * dsa::kIndexRowBytes, b_log = double(B) * S * 4;
  const double b_mla = double(B) * kTopK * MLA_ROW, b_slots = double(B) * kTopK * 4 * 3;
  const double f_log = 2.0 * B * S * kIndexHeads * kIndexDim, f_mla = 2.0 * B * H * kTopK * (D_QK + D_V);
  const bool coop = B <= 32;
  auto chk_layer = [&](int i) { return all_of({check_logits(i), check_topk(i), check_slots(i), check_decode(i)}); };
  std::vector<Piece> pieces = {
      {"vllm", "dsa_step",
       [&](int i) {
         meta();
         layer(i % P);
       },
       H, D_QK, D_V, b_idx + 2 * b_log + b_slots + b_mla, f_log + f_mla, &c_all, chk_layer},
      {"vllm", "dsa_layer", [&](int i) { layer(i % P); }, H, D_QK, D_V, b_idx + 2 * b_log + b_slots + b_mla,
       f_log + f_mla, &c_all, chk_layer},
      {"deepgemm", "dg_fp8_paged_mqa_logits", [&](int i) { logits(i % P); }, kIndexHeads, kIndexDim, 0, b_idx + b_log,
       f_log, &c_log, [&](int i) { return check_logits(i); }},
      {"vllm", coop ? "vllm_cooperative_topk" : "vllm_filtered_topk", [&](int i) { topk(i % P); }, 0, 0, 0, b_log, 0,
       &c_top, [&](int i) { return check_topk(i); }},
      {"ours", "slots_ours", [&](int i) { slots(i % P); }, 0, 0, 0, b_slots, 0, &c_slot,
       [&](int i) { return check_slots(i); }},
      {"flashmla", "flashmla_sparse_decode_fp8", [&](int i) { decode(i % P); }, H, D_QK, D_V, b_mla, f_mla, &c_dec,
       [&](int i) { return check_decode(i); }},
      {"deepgemm", "dg_paged_mqa_logits_metadata", [&](int) { dsa::paged_logits_metadata(ctx_lens, dg_sched, B, s); },
       0, 0, 0, 0, 0, &c_all, nullptr},
      {"flashmla", "flashmla_sched_meta", [&](int) { smxx::decode::run_get_decoding_sched_meta_kernel(sp); }, 0, 0, 0,
       0, 0, &c_all, nullptr},
  };
  for (const Piece& pc : pieces) {
    peers::Row row;
    row.c1 = *pc.first;
    peers::GraphRunner runner(s, L, opt.eager, pc.enqueue);
    row.t = runner.time(opt.warmup, opt.reps);
    const int last = (L - 1) % P;
    if (pc.check) {
      // Poison what this piece writes for the last launch's world, replay, check again.
      if (std::string(pc.kernel) == "dsa_step" || std::string(pc.kernel) == "dsa_layer")
        poison(last);
      else if (std::string(pc.kernel) == "dg_fp8_paged_mqa_logits")
        CK(cudaMemsetAsync(w[last].logits, 0xFF, size_t(B) * stride * 4, s));
      else if (std::string(pc.kernel) == "slots_ours")
        CK(cudaMemsetAsync(w[last].slots, 0x7F, size_t(B) * kTopK * 4, s));
      else if (std::string(pc.kernel) == "flashmla_sparse_decode_fp8")
        peers::poison_bf16(out, size_t(B) * H * D_V, s);
      else
        CK(cudaMemsetAsync(w[last].topk, 0x7F, size_t(B) * kTopK * 4, s));
      runner.replay();
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      row.c2 = pc.check(last);
    } else {
      // Schedules: the step's outputs must still be right with the schedule this graph made.
      runner.replay();
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      poison(0);
      layer(0);
      CK(cudaStreamSynchronize(s));
      row.c2 = chk_layer(0);
    }
    row.lib = pc.lib;
    row.kernel = pc.kernel;
    row.mode = opt.rotate ? "cold" : "warm";
    row.pool = "paged";
    row.B = B;
    row.S = S;
    row.hq = pc.hq;
    row.requests = B;
    row.dqk = pc.dqk;
    row.dv = pc.dv;
    row.launches = L;
    row.selections = P;
    row.bytes = pc.bytes;
    row.flops = pc.flops;
    char notes[256];
    snprintf(notes, sizeof(notes), "worlds=%d world_MB=%.0f topk=%s max_model_len=%d logits_stride=%d dg_sms=%d %s", P,
             (double(B) * S * (dsa::kIndexRowBytes + MLA_ROW)) / 1e6,
             coop ? (B <= 8 ? "cooperative_cs8" : "cooperative_cs4") : "filtered", S, stride, dsa::kDgSms,
             opt.eager ? "timing=eager" : "timing=graph");
    row.notes = notes;
    peers::print_row(row);
  }
}

void free_all(Bench& b) {
  for (World& x : b.w) {
    cudaFree(x.q_index), cudaFree(x.weights), cudaFree(x.q_mla), cudaFree(x.block_table);
    cudaFree(x.logits), cudaFree(x.topk), cudaFree(x.slots);
  }
  cudaFree(b.index_cache), cudaFree(b.mla_cache), cudaFree(b.ctx_lens), cudaFree(b.dg_sched), cudaFree(b.tie_ws);
  cudaFree(b.fm_sched), cudaFree(b.fm_splits), cudaFree(b.lse), cudaFree(b.lse_accum), cudaFree(b.o_accum);
  cudaFree(b.out);
  CK(cudaGetLastError());
}
}  // namespace

int main(int argc, char** argv) {
  peers::Options opt = peers::parse_options(
      argc, argv,
      "\n  configs: B:S[,B:S...] (batch : context of every request; default 1:8192,8:32768,64:131072)\n"
      "  rows: dsa_step dsa_layer dg_fp8_paged_mqa_logits vllm_cooperative_topk|vllm_filtered_topk slots_ours\n"
      "        flashmla_sparse_decode_fp8 dg_paged_mqa_logits_metadata flashmla_sched_meta");
  if (opt.header) printf("%s\n", peers::csv_header());
  fflush(stdout);
  if (opt.configs.empty()) opt.configs = "1:8192,8:32768,64:131072";
  const auto configs = peers::parse_configs(opt.configs, 32768);
  peers::DeviceInfo dev = peers::device_info();
  REQUIRE(dev.cc_major == 9 && dev.cc_minor == 0, "built for sm_90a, found sm_%d%d (%s)", dev.cc_major, dev.cc_minor,
          dev.name.c_str());
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (auto [B, S] : configs) {
    Bench b(opt, dev, stream, B, S);
    b.run();
    free_all(b);
  }
  CK(cudaStreamDestroy(stream));
  return peers::fail_count() ? 1 : 0;
}
#endif
