// Basic vocabulary shared by every sparsepage header: element types, where
// memory lives, and the error type every public entry point throws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace sparsepage {

/// Element type of a tensor or pool.
enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

/// Bytes per element of `dtype`.
size_t dtype_size(DType dtype);
/// "f32", "f16" or "bf16".
const char* dtype_name(DType dtype);

/// Where a buffer lives and which backend runs over it.
enum class Device : int32_t { kCpu = 0, kCuda = 1 };
const char* device_name(Device device);

/// Thrown by every public entry point for bad input. The message names the
/// argument and the bound it broke, e.g.
/// "decode: indices[17] = 5000 is past the pool (4096 pages)".
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

/// Half-precision conversions used by the CPU backend and by tests. Round to
/// nearest even; NaN stays NaN.
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);
float f16_to_float(uint16_t bits);

/// FP8 e4m3 ("e4m3fn": 4 exponent bits of bias 7, 3 mantissa bits, no
/// infinities, 0x7F / 0xFF are NaN, largest finite 448). float_to_e4m3 rounds
/// to nearest even and saturates to +-448 (an infinity too); NaN stays NaN.
/// The same conversion as CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
/// __NV_E4M3), so the CPU and CUDA quantizers agree bit for bit (a NaN of
/// either sign becomes 0x7F).
uint8_t float_to_e4m3(float value);
float e4m3_to_float(uint8_t bits);
constexpr float kE4m3Max = 448.0f;

/// Converts `count` elements of `dtype` at `src` to float.
void to_float(DType dtype, const void* src, float* dst, size_t count);
/// Converts `count` floats to `dtype` at `dst`.
void from_float(DType dtype, const float* src, void* dst, size_t count);

}  // namespace sparsepage
