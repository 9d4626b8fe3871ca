// The MLA FP8 quantizer on CUDA (fp8.h): bf16 [rows, 512 latent | 64 rope]
// -> 656-byte rows. One warp per row: lane l owns latent values
// [16 l, 16 l + 16), so the eight lanes of a 128-value block reduce its amax
// with three shuffles; lanes 0-7 copy the rope. Same bytes as the CPU twin
// (quantize_mla_fp8_cpu): the same scale rule (core/fp8_quantize.h), an IEEE
// division, and the saturating round-to-nearest-even e4m3 conversion.
#include <cuda_fp8.h>

#include "core/fp8_quantize.h"
#include "cuda/primitives/common.cuh"
#include "sparsepage/fp8.h"

namespace sparsepage {
namespace {

constexpr int kQuantizeThreads = 256;  // 8 rows per CTA

struct QuantizeArgs {
  const __nv_bfloat16* src;
  int64_t rows, src_row_stride;
  unsigned char* dst;
  int64_t dst_row_bytes;
};

__global__ void __launch_bounds__(kQuantizeThreads) quantize_mla_fp8_kernel(const __grid_constant__ QuantizeArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t{blockIdx.x} * (kQuantizeThreads / 32) + threadIdx.x / 32;
  if (row >= a.rows) return;
  const __nv_bfloat16* in = a.src + row * a.src_row_stride;
  unsigned char* out = a.dst + row * a.dst_row_bytes;
  uint4 raw[2];
  raw[0] = *reinterpret_cast<const uint4*>(in + 16 * lane);
  raw[1] = *reinterpret_cast<const uint4*>(in + 16 * lane + 8);
  float x[16];
  const auto* h = reinterpret_cast<const __nv_bfloat16*>(raw);
  float amax = 0.f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    x[i] = __bfloat162float(h[i]);
    nan = nan || isnan(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
  // The block's eight lanes (l / 8 names the block).
#pragma unroll
  for (int d = 1; d < 8; d *= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    nan = __shfl_xor_sync(0xffffffffu, static_cast<int>(nan), d) != 0 || nan;
  }
  const float scale = mla_fp8_block_scale(amax, nan);
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i] / scale, x[4 * i + 1] / scale), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i + 2] / scale, x[4 * i + 3] / scale), __NV_SATFINITE, __NV_E4M3);
    packed[i] = uint32_t{lo} | (uint32_t{hi} << 16);
  }
  *reinterpret_cast<uint4*>(out + 16 * lane) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if (lane % 8 == 0) *reinterpret_cast<float*>(out + MlaFp8Row::kScaleOffset + 4 * (lane / 8)) = scale;
  if (lane < 8)
    *reinterpret_cast<uint4*>(out + MlaFp8Row::kRopeOffset + 16 * lane) =
        *reinterpret_cast<const uint4*>(in + MlaFp8Row::kLatent + 8 * lane);
}

}  // namespace

void quantize_mla_fp8_cuda(DType dtype, const void* src, int64_t rows, int64_t src_row_stride, void* dst,
                           int64_t dst_row_bytes, void* stream) {
  std::string problem = quantize_mla_fp8_problem(dtype, src, rows, src_row_stride, dst, dst_row_bytes);
  if (problem.empty() && rows > 0) {
    if (reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0)
      problem = "src and dst must be 16-byte aligned on CUDA";
    else if (src_row_stride % 8 != 0)
      problem = "src_row_stride = " + std::to_string(src_row_stride) +
                " must be a multiple of 8 elements on CUDA (rows are read in 16-byte pieces)";
  }
  if (!problem.empty()) throw Error("quantize_mla_fp8_cuda: " + problem);
  if (rows == 0) return;
  const int64_t ctas = (rows + kQuantizeThreads / 32 - 1) / (kQuantizeThreads / 32);
  if (ctas > INT32_MAX)
    throw Error("quantize_mla_fp8_cuda: rows = " + std::to_string(rows) + " is too many for one launch");
  QuantizeArgs a{static_cast<const __nv_bfloat16*>(src), rows, src_row_stride, static_cast<unsigned char*>(dst),
                 dst_row_bytes};
  quantize_mla_fp8_kernel<<<static_cast<unsigned>(ctas), kQuantizeThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage
