// The block-sparse indexer on the GPU (rule in include/sparsepage/models/
// block_sparse.h): one CTA per (sequence, KV head) scores every block but the
// final one by max-pooled q_idx . k_idx, force-keeps the local blocks, takes
// the top-k by repeated arg-max (ties to the lower block id, as the CPU
// reference's stable sort does) and appends the final block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "core/cuda_hooks.h"
#include "cuda/common.cuh"

namespace sparsepage {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxHeadDim = 256;
// Scores of up to this many blocks live in shared memory (1M tokens at 128).
constexpr int kMaxScoredBlocks = 8192;

struct TopkParams {
  const void* k_alloc;  // [batch, kv_heads + 1, capacity, head_dim]
  const void* index_q;  // [batch, kv_heads, head_dim]
  int32_t kv_heads, head_dim;
  int64_t capacity, kv_len;
  int32_t block_size, topk, local_blocks, blocks_per_request;
  int32_t* block_ids;   // [batch * kv_heads, blocks_per_request]
};

// True when (score a, id a) ranks before (score b, id b).
__device__ __forceinline__ bool ranks_before(float sa, int ia, float sb, int ib) {
  return sa > sb || (sa == sb && ia < ib);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) block_topk_kernel(const __grid_constant__ TopkParams p) {
  __shared__ float q[kMaxHeadDim];
  __shared__ float scores[kMaxScoredBlocks];
  __shared__ float best_score[kWarps];
  __shared__ int best_id[kWarps];
  const int r = blockIdx.x;
  const int b = r / p.kv_heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const T* qr = static_cast<const T*>(p.index_q) + int64_t{r} * p.head_dim;
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) q[d] = cuda::ElemTraits<T>::to_float(qr[d]);
  __syncthreads();

  // Index key rows of sequence b: head kv_heads of the K allocation.
  const T* keys = static_cast<const T*>(p.k_alloc) +
                  ((int64_t{b} * (p.kv_heads + 1) + p.kv_heads) * p.capacity) * p.head_dim;
  const int64_t num_blocks = (p.kv_len + p.block_size - 1) / p.block_size;
  const int scored = static_cast<int>(num_blocks - 1);
  for (int j = warp; j < scored; j += kWarps) {
    float best = cuda::neg_inf_f32();
    for (int t = lane; t < p.block_size; t += 32) {  // scored blocks are full
      const T* row = keys + (int64_t{j} * p.block_size + t) * p.head_dim;
      float dot = 0.0f;
      for (int d = 0; d < p.head_dim; ++d) dot += q[d] * cuda::ElemTraits<T>::to_float(row[d]);
      best = fmaxf(best, dot);
    }
    for (int off = 16; off > 0; off /= 2) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, off));
    if (lane == 0) scores[j] = j >= num_blocks - p.local_blocks ? __int_as_float(0x7f800000) : best;
  }
  __syncthreads();

  int32_t* out = p.block_ids + int64_t{r} * p.blocks_per_request;
  for (int k = 0; k < p.blocks_per_request - 1; ++k) {
    float s = cuda::neg_inf_f32();
    int id = 0x7fffffff;
    for (int j = threadIdx.x; j < scored; j += kThreads) {
      if (ranks_before(scores[j], j, s, id)) {
        s = scores[j];
        id = j;
      }
    }
    for (int off = 16; off > 0; off /= 2) {
      const float os = __shfl_xor_sync(0xffffffffu, s, off);
      const int oid = __shfl_xor_sync(0xffffffffu, id, off);
      if (ranks_before(os, oid, s, id)) {
        s = os;
        id = oid;
      }
    }
    if (lane == 0) {
      best_score[warp] = s;
      best_id[warp] = id;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) {
        if (ranks_before(best_score[w], best_id[w], s, id)) {
          s = best_score[w];
          id = best_id[w];
        }
      }
      out[k] = id;
      scores[id] = cuda::neg_inf_f32();  // taken; real scores are finite or +inf
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[p.blocks_per_request - 1] = static_cast<int32_t>(num_blocks - 1);
}

__global__ void block_mask_kernel(const int32_t* block_ids, int32_t per_request, int32_t block_size, int64_t kv_len,
                                  int64_t total, float* mask) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / kv_len, t = i % kv_len;
    const int32_t block = static_cast<int32_t>(t / block_size);
    bool kept = false;
    for (int32_t k = 0; k < per_request; ++k) kept |= block_ids[r * per_request + k] == block;
    mask[i] = kept ? 0.0f : cuda::neg_inf_f32();
  }
}

__global__ void fill_neg_inf_kernel(float* mask, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    mask[i] = cuda::neg_inf_f32();
  }
}

// One CTA per request: 0 at each selected position inside the window.
__global__ void scatter_positions_kernel(const int32_t* positions, const int32_t* offsets, int64_t live_len,
                                         float* mask) {
  const int r = blockIdx.x;
  for (int32_t i = offsets[r] + threadIdx.x; i < offsets[r + 1]; i += blockDim.x) {
    const int32_t t = positions[i];
    if (t >= 0 && t < live_len) mask[int64_t{r} * live_len + t] = 0.0f;
  }
}

int grid_for(int64_t total) { return static_cast<int>(std::min<int64_t>((total + 255) / 256, 132 * 16)); }

}  // namespace

namespace detail {

void block_topk_cuda(const BlockTopkArgs& a, void* stream) {
  const int64_t num_blocks = (a.kv_len + a.block_size - 1) / a.block_size;
  if (a.head_dim > kMaxHeadDim || num_blocks - 1 > kMaxScoredBlocks) {
    throw Error("block-sparse indexer (CUDA): head_dim " + std::to_string(a.head_dim) + " (max " +
                std::to_string(kMaxHeadDim) + ") or " + std::to_string(num_blocks - 1) + " scored blocks (max " +
                std::to_string(kMaxScoredBlocks) + ") out of range");
  }
  const TopkParams p{a.k_alloc, a.index_q, a.num_kv_heads, a.head_dim, a.capacity, a.kv_len, a.block_size, a.topk,
                     a.local_blocks, a.blocks_per_request, a.block_ids};
  const int grid = a.batch * a.num_kv_heads;
  auto s = static_cast<cudaStream_t>(stream);
  if (a.dtype == DType::kBF16) {
    block_topk_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(p);
  } else if (a.dtype == DType::kF16) {
    block_topk_kernel<__half><<<grid, kThreads, 0, s>>>(p);
  } else {
    throw Error("block-sparse indexer (CUDA): dtype must be f16 or bf16");
  }
  SP_CUDA_CHECK_LAUNCH();
}

void block_mask_cuda(const int32_t* block_ids, int32_t num_requests, int32_t blocks_per_request, int32_t block_size,
                     int64_t kv_len, float* mask, void* stream) {
  const int64_t total = int64_t{num_requests} * kv_len;
  if (total == 0) return;
  block_mask_kernel<<<grid_for(total), 256, 0, static_cast<cudaStream_t>(stream)>>>(block_ids, blocks_per_request,
                                                                                    block_size, kv_len, total, mask);
  SP_CUDA_CHECK_LAUNCH();
}

void selection_mask_cuda(const int32_t* positions, const int32_t* offsets, int32_t num_requests, int64_t live_len,
                         float* mask, void* stream) {
  const int64_t total = int64_t{num_requests} * live_len;
  if (total == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  fill_neg_inf_kernel<<<grid_for(total), 256, 0, s>>>(mask, total);
  SP_CUDA_CHECK_LAUNCH();
  scatter_positions_kernel<<<num_requests, 256, 0, s>>>(positions, offsets, live_len, mask);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace detail
}  // namespace sparsepage
