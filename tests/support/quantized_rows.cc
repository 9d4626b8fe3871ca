#include "support/quantized_rows.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace sparsepage::testing {
namespace {

size_t stored_row_bytes(QuantBits bits, int32_t dim) {
  return bits == QuantBits::kInt8 ? static_cast<size_t>(dim) : static_cast<size_t>(dim + 1) / 2;
}

void quantize_row(QuantBits bits, const float* x, int32_t dim, uint8_t* out, float* scale) {
  const int qmax = bits == QuantBits::kInt8 ? 127 : 7;
  float absmax = 0.0f;
  for (int32_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(x[d]));
  *scale = absmax > 0.0f ? absmax / static_cast<float>(qmax) : 1.0f;
  const float inv = 1.0f / *scale;
  for (int32_t d = 0; d < dim; ++d) {
    const int q = std::clamp(static_cast<int>(std::lrint(x[d] * inv)), -qmax, qmax);
    if (bits == QuantBits::kInt8) {
      out[d] = static_cast<uint8_t>(static_cast<int8_t>(q));
    } else {
      const auto nibble = static_cast<uint8_t>(q + 8);  // 1..15
      if (d % 2 == 0) {
        out[d / 2] = nibble;
      } else {
        out[d / 2] = static_cast<uint8_t>(out[d / 2] | (nibble << 4));
      }
    }
  }
}

void dequantize_row(QuantBits bits, const uint8_t* in, float scale, int32_t dim, float* x) {
  for (int32_t d = 0; d < dim; ++d) {
    int q;
    if (bits == QuantBits::kInt8) {
      q = static_cast<int8_t>(in[d]);
    } else {
      q = static_cast<int>((in[d / 2] >> ((d % 2) * 4)) & 0xF) - 8;
    }
    x[d] = static_cast<float>(q) * scale;
  }
}

}  // namespace

const char* quant_bits_name(QuantBits bits) { return bits == QuantBits::kInt8 ? "int8" : "int4"; }

std::vector<float> quantize_round_trip(QuantBits bits, const std::vector<float>& x, int32_t dim) {
  if (dim < 1 || x.size() % static_cast<size_t>(dim) != 0) {
    throw std::invalid_argument("quantize_round_trip: x.size() must be a multiple of dim >= 1");
  }
  const size_t rows = x.size() / static_cast<size_t>(dim);
  const size_t row_bytes = stored_row_bytes(bits, dim);
  std::vector<uint8_t> stored(rows * row_bytes);
  std::vector<float> scales(rows), out(x.size());
  for (size_t r = 0; r < rows; ++r) {
    quantize_row(bits, &x[r * static_cast<size_t>(dim)], dim, &stored[r * row_bytes], &scales[r]);
  }
  for (size_t r = 0; r < rows; ++r) {
    dequantize_row(bits, &stored[r * row_bytes], scales[r], dim, &out[r * static_cast<size_t>(dim)]);
  }
  return out;
}

}  // namespace sparsepage::testing
