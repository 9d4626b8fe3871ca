// The CPU backend's dot product. A plain `sum += a[i] * b[i]` loop is one
// dependent chain the compiler may not reorder (fp addition is not
// associative), so it runs at one FMA per latency. Eight independent
// partial sums let it run at vector width; the result differs from the
// sequential sum only by fp32 rounding.
#pragma once

#include <cstddef>

namespace sparsepage::cpu {

inline float dot(const float* a, const float* b, size_t n) {
  constexpr size_t kLanes = 8;
  float acc[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (size_t l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

}  // namespace sparsepage::cpu
