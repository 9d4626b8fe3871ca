// e4m3 -> bf16 / f16 conversions of the FP8 decode kernels. Every e4m3
// value is exact in f16 (and in bf16): the hardware's e4m3x2 -> f16x2
// conversion (sm_89+) is one instruction per pair; bf16 goes through fp32,
// where the MLA rows' per-block scale is applied before the one rounding.
#pragma once

#include <cuda_fp8.h>

#include "cuda/primitives/common.cuh"

namespace sparsepage {
namespace cuda {

/// Two e4m3 values (the low two bytes of `pair`) as two floats.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xFFFFu), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

/// Four e4m3 values (one word) as two packed T pairs, unscaled (exact).
template <typename T>
__device__ __forceinline__ uint2 e4m3x4_to(uint32_t word) {
  if constexpr (ElemTraits<T>::kBF16) {
    const float2 lo = e4m3x2_to_float2(word), hi = e4m3x2_to_float2(word >> 16);
    return make_uint2(ElemTraits<T>::pack2(lo.x, lo.y), ElemTraits<T>::pack2(hi.x, hi.y));
  } else {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word & 0xFFFFu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> 16), __NV_E4M3);
    return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  }
}

/// Eight e4m3 values times `scale` in fp32, then rounded to bf16: one 16-byte
/// piece.
__device__ __forceinline__ uint4 e4m3x8_to_bf16_scaled(uint32_t w0, uint32_t w1, float scale) {
  using Tr = ElemTraits<__nv_bfloat16>;
  const float2 a = e4m3x2_to_float2(w0), b = e4m3x2_to_float2(w0 >> 16);
  const float2 c = e4m3x2_to_float2(w1), d = e4m3x2_to_float2(w1 >> 16);
  return make_uint4(Tr::pack2(a.x * scale, a.y * scale), Tr::pack2(b.x * scale, b.y * scale),
                    Tr::pack2(c.x * scale, c.y * scale), Tr::pack2(d.x * scale, d.y * scale));
}

/// The fp8 kernels' params: the partial kernel's, plus the per-KV-head
/// scales of KvFormat::kE4m3PerHead (null for the MLA rows, whose scales
/// are in the rows). K and V strides are in bytes.
template <class Base>
struct Fp8Params : Base {
  const float* k_scale = nullptr;  // [num_kv_heads]
  const float* v_scale = nullptr;  // [num_kv_heads]
};

}  // namespace cuda
}  // namespace sparsepage
