#include "sparsepage/types.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>

namespace sparsepage {

size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "unknown";
}

const char* device_name(Device device) { return device == Device::kCuda ? "cuda" : "cpu"; }

uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep it a NaN
  bits += 0x7FFF + ((bits >> 16) & 1);                                       // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float bf16_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

uint16_t float_to_f16(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t abs = x & 0x7FFFFFFF;
  if (abs > 0x7F800000) return static_cast<uint16_t>(sign | 0x7E00);   // NaN
  if (abs >= 0x477FF000) return static_cast<uint16_t>(sign | 0x7C00);  // rounds to inf
  if (abs < 0x38800000) {                                              // subnormal or zero
    // value * 2^24 rounded to nearest even is the subnormal's mantissa.
    float magnitude;
    std::memcpy(&magnitude, &abs, 4);
    const float scaled = std::nearbyint(magnitude * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(scaled));
  }
  const uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000) >> 13));
}

float f16_to_float(uint16_t bits) {
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F;
  const uint32_t mantissa = bits & 0x3FF;
  float value;
  if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -24);
    uint32_t out;
    std::memcpy(&out, &value, 4);
    out |= sign;
    std::memcpy(&value, &out, 4);
    return value;
  }
  uint32_t out;
  if (exponent == 31) {
    out = sign | 0x7F800000 | (mantissa << 13);
  } else {
    out = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  std::memcpy(&value, &out, 4);
  return value;
}

uint8_t float_to_e4m3(float value) {
  // NaN: 0x7F whatever its sign bit, as the CUDA conversion writes it (an
  // inf / inf on the host is a negative NaN).
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float magnitude = std::fabs(value);
  if (magnitude >= kE4m3Max) return static_cast<uint8_t>(sign | 0x7E);  // saturate (infinity included)
  if (magnitude < 0.015625f) {
    // Below the smallest normal 2^-6: multiples of 2^-9. The product is exact
    // and nearbyint rounds to nearest even; 8 * 2^-9 is the smallest normal,
    // whose encoding is 8 as well.
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(std::nearbyint(magnitude * 512.0f)));
  }
  int exponent = 0;
  const float fraction = std::frexp(magnitude, &exponent);  // magnitude = fraction * 2^exponent, fraction in [0.5, 1)
  // Mantissa steps of 1/8 above 1: (2 * fraction - 1) * 8, exact in fp32.
  auto mantissa = static_cast<uint32_t>(std::nearbyint((2.0f * fraction - 1.0f) * 8.0f));
  int biased = exponent - 1 + 7;
  if (mantissa == 8) mantissa = 0, ++biased;  // rounded up into the next binade
  const uint32_t bits = (static_cast<uint32_t>(biased) << 3) | mantissa;
  return static_cast<uint8_t>(sign | (bits > 0x7E ? 0x7Eu : bits));
}

float e4m3_to_float(uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

void to_float(DType dtype, const void* src, float* dst, size_t count) {
  if (count == 0) return;  // empty vectors pass null data; memcpy(null, null, 0) is undefined
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, count * 4); return;
    case DType::kBF16: {
      // bf16 is the top half of an fp32 (NaN and inf included): a shift the
      // compiler vectorizes, where the CPU backend converts every row it reads.
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) {
        const uint32_t bits = uint32_t{in[i]} << 16;
        std::memcpy(dst + i, &bits, 4);
      }
      return;
    }
    case DType::kF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = f16_to_float(in[i]);
      return;
    }
  }
  throw Error("to_float: dtype " + std::to_string(static_cast<int32_t>(dtype)) + " is not a DType");
}

void from_float(DType dtype, const float* src, void* dst, size_t count) {
  if (count == 0) return;  // as in to_float (found by the fuzzer under UBSan)
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, count * 4); return;
    case DType::kBF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) out[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) out[i] = float_to_f16(src[i]);
      return;
    }
  }
  throw Error("from_float: dtype " + std::to_string(static_cast<int32_t>(dtype)) + " is not a DType");
}

}  // namespace sparsepage
