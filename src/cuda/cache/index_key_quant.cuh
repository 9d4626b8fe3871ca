// One 128-value key or query quantized by a warp, as vLLM's
// indexer_k_quant_and_cache_kernel lays the work out: lane l holds values
// [4 l, 4 l + 4), the warp reduces amax by xor shuffles, and each lane
// converts its four values into one 32-bit word of e4m3 bytes (value 4 l
// in the low byte). The scale rules and the division are the CPU twin's
// (core/index_keys_rule.h), and the conversion is CUDA's satfinite
// round-to-nearest-even, which float_to_e4m3 reproduces on the host: the
// same bytes on both sides. Used by the write op, the query quantizer and
// the FP8 score kernel's in-kernel query quantization.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/index_keys_rule.h"
#include "cuda/primitives/common.cuh"

namespace sparsepage {
namespace cuda {

/// Lane l's four values [4 l, 4 l + 4) of a 128-value row of T (8 bytes at `row`).
template <typename T>
__device__ __forceinline__ void load4(const T* row, int lane, float (&x)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(row + 4 * lane);
  const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = ElemTraits<T>::to_float(h[i]);
}

/// The largest |x| over the warp's 128 values (fmaxf from 0: NaN ignored).
__device__ __forceinline__ float warp_amax(const float (&x)[4]) {
  float a = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) a = fmaxf(a, fabsf(x[i]));
#pragma unroll
  for (int m = 16; m > 0; m /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, m));
  return a;
}

/// e4m3(x[i] / scale) for the lane's four values, packed low byte first.
__device__ __forceinline__ uint32_t e4m3x4(const float (&x)[4], float scale) {
  const __nv_fp8x2_storage_t lo =
      __nv_cvt_float2_to_fp8x2(make_float2(index_div(x[0], scale), index_div(x[1], scale)), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi =
      __nv_cvt_float2_to_fp8x2(make_float2(index_div(x[2], scale), index_div(x[3], scale)), __NV_SATFINITE, __NV_E4M3);
  return uint32_t{lo} | (uint32_t{hi} << 16);
}

}  // namespace cuda
}  // namespace sparsepage
