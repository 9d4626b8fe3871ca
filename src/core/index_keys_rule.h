// The FP8 index keys' and queries' scale rules (sparsepage/index_keys.h),
// shared by the CPU twin and the CUDA kernels so both write the same bytes:
// the same floors, one IEEE fp32 division, and the ue8m0 rounding done on the
// bits rather than through log2f / exp2f, whose results could differ between
// the host and the device libraries.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "sparsepage/index_keys.h"
#include "sparsepage/types.h"

#if defined(__CUDACC__)
#define SP_INDEX_HD __host__ __device__ __forceinline__
#else
#define SP_INDEX_HD inline
#endif

namespace sparsepage {

/// vLLM's floors under amax: keys max(amax, 1e-4) (indexer_k_quant_and_cache),
/// queries max(amax, 1e-10) (per_token_group_quant_fp8's eps, and the fused
/// rope-quant kernel's).
constexpr float kIndexKeyAmaxFloor = 1e-4f;
constexpr float kIndexQueryAmaxFloor = 1e-10f;

SP_INDEX_HD uint32_t index_float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits;
#endif
}

SP_INDEX_HD float index_bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
#endif
}

/// a / b rounded to nearest (IEEE), also on the device under any
/// -prec-div setting.
SP_INDEX_HD float index_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

/// The smallest power of two >= x, for a positive normal x or +inf (what
/// exp2f(ceilf(log2f(x))) computes exactly): x itself when its mantissa bits
/// are zero, else the next binade's first value. The scales' floors keep x
/// normal.
SP_INDEX_HD float index_pow2_ceil(float x) {
  const uint32_t bits = index_float_bits(x);
  if ((bits & 0x007FFFFFu) == 0) return x;
  return index_bits_float((bits & 0x7F800000u) + 0x00800000u);
}

/// A key's scale from the largest |value| (NaN ignored by the caller's fmaxf).
SP_INDEX_HD float index_key_scale(float amax, IndexScaleFormat format) {
  const float s = index_div(fmaxf(amax, kIndexKeyAmaxFloor), kE4m3Max);
  return format == IndexScaleFormat::kUe8m0 ? index_pow2_ceil(s) : s;
}

/// A query head's scale (always ue8m0, as vLLM quantizes the index queries).
SP_INDEX_HD float index_query_scale(float amax) {
  return index_pow2_ceil(index_div(fmaxf(amax, kIndexQueryAmaxFloor), kE4m3Max));
}

}  // namespace sparsepage

#undef SP_INDEX_HD
