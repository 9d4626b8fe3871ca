// What the CPU and CUDA MLA FP8 quantizers share: the argument check and the
// scale rule, so the two make the same bytes.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "sparsepage/types.h"

#if defined(__CUDACC__)
#define SP_FP8_HOST_DEVICE __host__ __device__
#else
#define SP_FP8_HOST_DEVICE
#endif

namespace sparsepage {

/// Why these arguments cannot be quantized, or "".
std::string quantize_mla_fp8_problem(DType dtype, const void* src, int64_t rows, int64_t src_row_stride,
                                     const void* dst, int64_t dst_row_bytes);

/// The scale of a block of 128 values whose largest magnitude is `amax`: the
/// block's largest value maps to e4m3's largest (448); an all-zero block
/// takes 1; a block holding a NaN takes NaN, so its values dequantize to NaN
/// instead of passing as numbers. One IEEE division, the same on both sides.
SP_FP8_HOST_DEVICE inline float mla_fp8_block_scale(float amax, bool nan) {
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  return amax > 0.0f ? amax / kE4m3Max : 1.0f;
}

}  // namespace sparsepage
