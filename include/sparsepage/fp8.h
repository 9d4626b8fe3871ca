// FP8 KV caches: the DSA / MLA engines' 656-byte row format and its
// quantizer (CPU and CUDA), plus the RowViews a decode reads it through
// (decode.h, KvFormat::kE4m3Mla).
#pragma once

#include <cstdint>

#include "sparsepage/decode.h"
#include "sparsepage/types.h"

namespace sparsepage {

/// One cache row of the MLA FP8 format, as DeepSeek-V3.2's engines store it:
///   bytes [0, 512)    512 e4m3 latent values
///   bytes [512, 528)  4 fp32 scales, scale i for latent values [128 i, 128 i + 128)
///   bytes [528, 656)  64 bf16 rope values, unquantized
/// A latent value dequantizes as e4m3_to_float(byte) * scale[i].
struct MlaFp8Row {
  static constexpr int32_t kLatent = 512;
  static constexpr int32_t kRope = 64;
  static constexpr int32_t kBlock = 128;                                    // latent values per scale
  static constexpr int32_t kScaleOffset = kLatent;                          // bytes
  static constexpr int32_t kRopeOffset = kLatent + 4 * (kLatent / kBlock);  // 528
  static constexpr int32_t kBytes = kRopeOffset + 2 * kRope;                // 656
};

/// The decode's K, V and second-stream views of `rows` rows of the format at
/// `data`, `row_bytes` apart (>= 656, a multiple of 16 for CUDA). Set
/// DecodeParams::kv_format = KvFormat::kE4m3Mla with them.
struct MlaFp8Views {
  RowView k, v, k_extra;
};
MlaFp8Views mla_fp8_views(const void* data, int64_t rows, int64_t row_bytes = MlaFp8Row::kBytes);

/// Quantizes `rows` rows of [512 latent | 64 rope] bf16 values (`dtype` must
/// be bf16; `src_row_stride` elements apart) into 656-byte rows at `dst`,
/// `dst_row_bytes` apart (>= 656, a multiple of 16): per 128 latent values
/// scale = amax / 448 (1 for an all-zero block), value = e4m3(x / scale)
/// rounded to nearest even and saturated; the rope is copied. A NaN in a
/// block makes its scale NaN (NaN never passes silently). The CPU and CUDA
/// versions give the same bytes. Throws sparsepage::Error naming a bad
/// argument. Bytes of a row past 656 are not written.
void quantize_mla_fp8_cpu(DType dtype, const void* src, int64_t rows, int64_t src_row_stride, void* dst,
                          int64_t dst_row_bytes = MlaFp8Row::kBytes);
/// The CUDA kernel (device pointers, asynchronous on `stream`, a cudaStream_t;
/// src and dst 16-byte aligned and src_row_stride a multiple of 8).
void quantize_mla_fp8_cuda(DType dtype, const void* src, int64_t rows, int64_t src_row_stride, void* dst,
                           int64_t dst_row_bytes = MlaFp8Row::kBytes, void* stream = nullptr);

}  // namespace sparsepage
