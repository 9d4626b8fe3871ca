// Host-side int8 / 4-bit row quantization for tests: what storing a dense
// cache's rows quantized would cost in accuracy, and a window to run the mask
// path over. No part of the library (its caches store f16 or bf16 rows).
#pragma once

#include <cstdint>
#include <vector>

namespace sparsepage::testing {

enum class QuantBits : int32_t { kInt8, kInt4 };
/// "int8" or "int4".
const char* quant_bits_name(QuantBits bits);

/// Rows of `dim` fp32 values (`x.size()` a multiple of dim) stored
/// quantized and read back: symmetric, one fp32 scale per row (scale =
/// max|x| / qmax, so the largest magnitude maps to +-qmax: 127 for int8, 7
/// for int4, whose values are packed two a byte, low nibble first).
std::vector<float> quantize_round_trip(QuantBits bits, const std::vector<float>& x, int32_t dim);

}  // namespace sparsepage::testing
