// The MLA FP8 row format (fp8.h): its views and the CPU quantizer. The CUDA
// quantizer (src/cuda/cache/fp8_quantize.cu) shares quantize_mla_fp8_problem and
// makes the same bytes.
#include "sparsepage/fp8.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/fp8_quantize.h"

namespace sparsepage {

MlaFp8Views mla_fp8_views(const void* data, int64_t rows, int64_t row_bytes) {
  if (row_bytes < MlaFp8Row::kBytes || row_bytes % 2 != 0)
    throw Error("mla_fp8_views: row_bytes = " + std::to_string(row_bytes) +
                " must be even and at least the format's 656 bytes");
  if (rows < 0) throw Error("mla_fp8_views: rows = " + std::to_string(rows) + " is negative");
  MlaFp8Views views;
  // K and V: the latent bytes; the capacity bounds the rows a decode may reach.
  views.k = RowView{data, row_bytes, MlaFp8Row::kLatent, 0, 0, rows};
  views.v = views.k;
  // The rope: bf16 elements starting at byte 528 of each row.
  const auto* rope = data ? static_cast<const unsigned char*>(data) + MlaFp8Row::kRopeOffset : nullptr;
  views.k_extra = RowView{rope, row_bytes / 2, MlaFp8Row::kRope, 0, 0, rows};
  return views;
}

std::string quantize_mla_fp8_problem(DType dtype, const void* src, int64_t rows, int64_t src_row_stride,
                                     const void* dst, int64_t dst_row_bytes) {
  if (dtype != DType::kBF16)
    return std::string("dtype ") + dtype_name(dtype) + " is not supported (the format's source and rope are bf16)";
  if (rows < 0) return "rows = " + std::to_string(rows) + " is negative";
  if (rows == 0) return {};
  if (src == nullptr) return "src is null";
  if (dst == nullptr) return "dst is null";
  constexpr int32_t kCols = MlaFp8Row::kLatent + MlaFp8Row::kRope;
  if (src_row_stride < kCols)
    return "src_row_stride = " + std::to_string(src_row_stride) + " is smaller than the row's 576 values";
  if (dst_row_bytes < MlaFp8Row::kBytes)
    return "dst_row_bytes = " + std::to_string(dst_row_bytes) + " is smaller than the format's 656 bytes";
  if (dst_row_bytes % 16 != 0)
    return "dst_row_bytes = " + std::to_string(dst_row_bytes) +
           " must be a multiple of 16 (rows are written in 16-byte pieces)";
  if (static_cast<long double>(rows) * static_cast<long double>(std::max<int64_t>(dst_row_bytes, src_row_stride * 2)) >=
      4.6e18L)
    return "rows = " + std::to_string(rows) + " span more than 2^62 bytes";
  return {};
}

void quantize_mla_fp8_cpu(DType dtype, const void* src, int64_t rows, int64_t src_row_stride, void* dst,
                          int64_t dst_row_bytes) {
  const std::string problem = quantize_mla_fp8_problem(dtype, src, rows, src_row_stride, dst, dst_row_bytes);
  if (!problem.empty()) throw Error("quantize_mla_fp8_cpu: " + problem);
  for (int64_t r = 0; r < rows; ++r) {
    const auto* in = static_cast<const uint16_t*>(src) + r * src_row_stride;
    auto* out = static_cast<unsigned char*>(dst) + r * dst_row_bytes;
    float scales[4];
    for (int b = 0; b < 4; ++b) {
      float amax = 0.0f;
      bool nan = false;
      for (int i = 0; i < MlaFp8Row::kBlock; ++i) {
        const float x = bf16_to_float(in[b * MlaFp8Row::kBlock + i]);
        nan = nan || std::isnan(x);
        amax = std::fmax(amax, std::fabs(x));
      }
      const float scale = mla_fp8_block_scale(amax, nan);
      scales[b] = scale;
      for (int i = 0; i < MlaFp8Row::kBlock; ++i)
        out[b * MlaFp8Row::kBlock + i] = float_to_e4m3(bf16_to_float(in[b * MlaFp8Row::kBlock + i]) / scale);
    }
    std::memcpy(out + MlaFp8Row::kScaleOffset, scales, sizeof(scales));
    std::memcpy(out + MlaFp8Row::kRopeOffset, in + MlaFp8Row::kLatent, 2 * MlaFp8Row::kRope);
  }
}

}  // namespace sparsepage
