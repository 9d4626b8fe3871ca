// The index keys' write op and the FP8 query quantizer on CUDA
// (sparsepage/index_keys.h). One warp per key (or per query head): lane l
// holds values [4 l, 4 l + 4) (cuda/cache/index_key_quant.cuh). Both write
// the bytes their CPU twins write (src/core/index_keys.cc). Asynchronous
// and capturable: the slots are read on the device, so a slot past the pool
// is skipped and reported in the error word.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "core/index_keys_checks.h"
#include "cuda/cache/index_key_quant.cuh"
#include "cuda/primitives/common.cuh"
#include "sparsepage/index_keys.h"

namespace sparsepage {
namespace {

constexpr int kWarpsPerCta = 8;

struct WriteArgs {
  const void* keys;      // [num_tokens, key_stride] in T
  int64_t key_stride;    // elements
  const int64_t* slots;  // [num_tokens]: block * block_size + offset, -1 skips
  int64_t num_tokens;
  unsigned char* pool;
  int64_t pool_slots;  // num_blocks * block_size
  int32_t block_size;
  int64_t block_bytes;  // bytes between blocks
  int64_t token_bytes;  // native: bytes between a block's tokens
  int32_t dim;          // values per key (128 for FP8)
  int32_t fp8;          // 1: quantize into the FP8 format; 0: copy native keys
  IndexScaleFormat scale_format;
  int32_t* error;  // may be null
};

template <typename T>
__global__ void __launch_bounds__(kWarpsPerCta * 32) write_index_keys_kernel(const __grid_constant__ WriteArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t i = int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32;
  if (i >= a.num_tokens) return;
  const int64_t slot = a.slots[i];
  if (slot == -1) return;
  if (slot < -1 || slot >= a.pool_slots) {
    if (lane == 0 && a.error != nullptr) atomicOr(a.error, kIndexErrorSlot);
    return;
  }
  const int64_t block = slot / a.block_size;
  const auto offset = static_cast<int32_t>(slot % a.block_size);
  unsigned char* b = a.pool + block * a.block_bytes;
  const T* key = static_cast<const T*>(a.keys) + i * a.key_stride;
  if (a.fp8 != 0) {
    float x[4];
    cuda::load4(key, lane, x);
    const float scale = index_key_scale(cuda::warp_amax(x), a.scale_format);
    *reinterpret_cast<uint32_t*>(b + IndexKeyFp8::value_offset(a.block_size, offset) + 4 * lane) =
        cuda::e4m3x4(x, scale);
    if (lane == 0) *reinterpret_cast<float*>(b + IndexKeyFp8::scale_offset(a.block_size, offset)) = scale;
  } else {
    // 8 bytes (4 values) per lane and step.
    auto* dst = reinterpret_cast<uint2*>(b + offset * a.token_bytes);
    const auto* src = reinterpret_cast<const uint2*>(key);
    for (int w = lane; w < a.dim / 4; w += 32) dst[w] = src[w];
  }
}

struct QueryArgs {
  const void* q;         // [rows * heads, 128] in T
  const float* weights;  // [rows * heads]
  int64_t count;         // rows * heads
  unsigned char* q_fp8;  // [rows * heads, 128]
  float* weights_out;    // [rows * heads]
};

template <typename T>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    quantize_index_queries_kernel(const __grid_constant__ QueryArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t r = int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32;
  if (r >= a.count) return;
  float x[4];
  cuda::load4(static_cast<const T*>(a.q) + r * IndexKeyFp8::kDim, lane, x);
  const float s = index_query_scale(cuda::warp_amax(x));
  *reinterpret_cast<uint32_t*>(a.q_fp8 + r * IndexKeyFp8::kDim + 4 * lane) = cuda::e4m3x4(x, s);
  if (lane == 0) a.weights_out[r] = a.weights[r] * s;  // one lane reads and writes it: weights_out may alias weights
}

unsigned ctas_for(int64_t warps, const char* who) {
  const int64_t ctas = (warps + kWarpsPerCta - 1) / kWarpsPerCta;
  if (ctas > INT32_MAX)
    throw Error(std::string(who) + ": " + std::to_string(warps) + " rows are too many for one launch");
  return static_cast<unsigned>(ctas);
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void write_index_keys_cuda(const PagedIndexKeys& pool, int32_t dim, DType key_dtype, const void* keys,
                           int64_t key_stride, const int64_t* slots, int64_t num_tokens, IndexScaleFormat format,
                           int32_t* error, void* stream) {
  std::string problem = detail::write_index_keys_problem(pool, dim, key_dtype, keys, key_stride, slots, num_tokens);
  if (problem.empty() && format != IndexScaleFormat::kUe8m0 && format != IndexScaleFormat::kFp32)
    problem = "scale_format is not an IndexScaleFormat";
  if (problem.empty() && num_tokens > 0 && (!aligned(keys, 8) || key_stride % 4 != 0))
    problem = "keys must be 8-byte aligned and key_stride a multiple of 4 on CUDA (keys are read 4 values at a time)";
  if (!problem.empty()) throw Error("write_index_keys_cuda: " + problem);
  if (num_tokens == 0) return;
  WriteArgs a{};
  a.keys = keys;
  a.key_stride = key_stride;
  a.slots = slots;
  a.num_tokens = num_tokens;
  a.pool = static_cast<unsigned char*>(pool.pool);
  a.pool_slots = pool.num_blocks * pool.block_size;
  a.block_size = pool.block_size;
  a.block_bytes = index_key_block_bytes(pool, dim);
  a.token_bytes = index_key_token_bytes(pool, dim);
  a.dim = dim;
  a.fp8 = pool.format == IndexKeyFormat::kE4m3 ? 1 : 0;
  a.scale_format = format;
  a.error = error;
  const unsigned ctas = ctas_for(num_tokens, "write_index_keys_cuda");
  const auto s = static_cast<cudaStream_t>(stream);
  if (key_dtype == DType::kBF16) {
    write_index_keys_kernel<__nv_bfloat16><<<ctas, kWarpsPerCta * 32, 0, s>>>(a);
  } else {
    write_index_keys_kernel<__half><<<ctas, kWarpsPerCta * 32, 0, s>>>(a);
  }
  SP_CUDA_CHECK_LAUNCH();
}

void quantize_index_queries_cuda(DType dtype, const void* q, const float* weights, int64_t rows, int32_t heads,
                                 void* q_fp8, float* weights_out, void* stream) {
  std::string problem = detail::quantize_index_queries_problem(dtype, q, weights, rows, heads, q_fp8, weights_out);
  if (problem.empty() && rows > 0 && (!aligned(q, 8) || !aligned(q_fp8, 4)))
    problem = "q must be 8-byte and q_fp8 4-byte aligned on CUDA";
  if (!problem.empty()) throw Error("quantize_index_queries_cuda: " + problem);
  if (rows == 0) return;
  const QueryArgs a{q, weights, rows * heads, static_cast<unsigned char*>(q_fp8), weights_out};
  const unsigned ctas = ctas_for(a.count, "quantize_index_queries_cuda");
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == DType::kBF16) {
    quantize_index_queries_kernel<__nv_bfloat16><<<ctas, kWarpsPerCta * 32, 0, s>>>(a);
  } else {
    quantize_index_queries_kernel<__half><<<ctas, kWarpsPerCta * 32, 0, s>>>(a);
  }
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage
