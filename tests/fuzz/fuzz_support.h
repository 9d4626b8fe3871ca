// What every fuzz target shares: the finding report, the check macro, the
// acceptance wrapper (a refusal must be a sparsepage::Error) and the
// canary-guarded output buffer (tests/fuzz/sparsepage_fuzz.cc says what
// each target asserts).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "sparsepage/types.h"

class FuzzedDataProvider;

namespace sparsepage {

[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "sparsepage_fuzz finding: %s\n", what.c_str());
  std::abort();
}

// The message is built only on failure: plans may hold millions of items.
#define FUZZ_CHECK(ok, what) \
  do { \
    if (!(ok)) ::sparsepage::finding(what); \
  } while (0)

// Runs `call`; returns whether it was accepted. Any exception other than
// sparsepage::Error is a finding (std::length_error, bad_alloc, ...).
template <typename Call>
bool accepted(Call&& call, const char* what) {
  try {
    call();
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    finding(std::string(what) + " threw a non-sparsepage exception: " + e.what());
  }
}

// A byte buffer with canaries on both sides of its payload.
class Guarded {
 public:
  static constexpr size_t kGuard = 64;
  static constexpr uint8_t kCanary = 0xA5;
  explicit Guarded(size_t bytes, uint8_t fill = 0xFF) : bytes_(bytes), data_(bytes + 2 * kGuard, kCanary) {
    std::fill(data_.begin() + kGuard, data_.begin() + static_cast<std::ptrdiff_t>(kGuard + bytes), fill);
  }
  void* data() { return data_.data() + kGuard; }
  const uint8_t* begin() const { return data_.data() + kGuard; }
  size_t bytes() const { return bytes_; }
  void check_canaries(const char* what) const {
    for (size_t i = 0; i < kGuard; ++i) {
      FUZZ_CHECK(data_[i] == kCanary && data_[kGuard + bytes_ + i] == kCanary,
                 std::string(what) + ": canary overwritten");
    }
  }
  std::vector<uint8_t> payload() const { return {begin(), begin() + bytes_}; }
  void fill(uint8_t value) {
    std::fill(data_.begin() + kGuard, data_.begin() + static_cast<std::ptrdiff_t>(kGuard + bytes_), value);
  }

 private:
  size_t bytes_;
  std::vector<uint8_t> data_;
};

// A seed for the values of input number `b` of request `a` (the same
// request's rows are the same wherever they are written).
inline uint64_t mix(uint64_t seed, int64_t a, int64_t b) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(a) * 0xBF58476D1CE4E5B9ull ^
               static_cast<uint64_t>(b + 7) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Tolerances against fp64: f32 outputs carry fp32 score rounding; bf16 and
// f16 outputs are rounded to 8 / 11 mantissa bits. lse is fp32 either way.
inline double o_tolerance(DType dtype) { return dtype == DType::kF32 ? 1e-4 : dtype == DType::kF16 ? 4e-3 : 2e-2; }

namespace engine_forms {
/// Target 11 (tests/fuzz/engine_forms_fuzz.cc): the layers' engine forms;
/// `form` picks the engine-paged DSA layer (0) or the engine-pools DSA (1)
/// or block-sparse (2) layer.
void fuzz(FuzzedDataProvider& in, int form);
}  // namespace engine_forms

namespace prefill_fuzz {
/// Target 12 (tests/fuzz/prefill_fuzz.cc): MlaSparsePrefill and
/// GqaBlockPrefill called directly, untouched or after one hostile edit.
void fuzz(FuzzedDataProvider& in);
}  // namespace prefill_fuzz

}  // namespace sparsepage
