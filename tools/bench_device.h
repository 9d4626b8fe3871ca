// What the benchmark needs from the device, behind plain C++: timing with
// CUDA graphs and events, the measured read bandwidth, random fills. The CPU
// variants time with the steady clock.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sparsepage/types.h"

namespace sparsepage::bench {

struct DeviceFacts {
  std::string name;  // "NVIDIA H200" or "cpu (N threads)"
  int32_t multiprocessors = 0;
  int64_t l2_bytes = 0;
  int64_t memory_bytes = 0;
};
DeviceFacts device_facts(Device device);

/// Median microseconds per launch: `launch(stream)` is captured `steps`
/// times into one CUDA graph (or called `steps` times on the CPU), replayed
/// after warm-up `reps` times, each replay timed with events.
double median_us_per_launch(Device device, const std::function<void(void*)>& launch, int32_t steps, int32_t reps);

/// Median microseconds per eager call: each of `reps` runs calls
/// `launch(stream)` `steps` times between two events (wall clock on the
/// CPU), after one warm-up call; the host's launch overhead counts.
double median_us_eager(Device device, const std::function<void(void*)>& launch, int32_t steps, int32_t reps);

/// CUDA events for splitting a step into phases (null on the CPU).
class Events {
 public:
  Events(Device device, int32_t count);
  ~Events();
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  void* operator[](int32_t i) const { return events_[static_cast<size_t>(i)]; }
  void record(int32_t i, void* stream);
  /// Microseconds from event a to event b (after both completed).
  double elapsed_us(int32_t a, int32_t b) const;
  bool available() const { return !events_.empty() && events_[0] != nullptr; }

 private:
  std::vector<void*> events_;
};

/// Streams `bytes` of device memory through a read-only reduction and
/// returns the median read bandwidth in GB/s (1e9 bytes per second).
double measured_read_bandwidth_gbs(Device device, int64_t bytes);

/// Fills `count` elements of `dtype` at `data` (on `device`) with values
/// uniform in [-1, 1) from `seed`.
void fill_random(Device device, DType dtype, void* data, int64_t count, uint64_t seed);

/// Fills `count` bf16 values at `data` with numbers that FP8 caches hold
/// exactly: e4m3 values times 2^-8 (magnitudes up to 1.75), every 128th one
/// 1.75. Quantized with a per-head scale of 2^-8, or into MLA rows (each
/// 128-value block's amax is 1.75, so its scale is 2^-8), they lose nothing,
/// so an fp8 arm and a bf16 arm over them attend the same numbers.
void fill_e4m3_exact(Device device, void* data, int64_t count, uint64_t seed);
/// dst[i] = e4m3(src[i] * 256) for `count` bf16 values (exact for the values
/// fill_e4m3_exact writes).
void to_e4m3_times_256(Device device, const void* src, void* dst, int64_t count);

}  // namespace sparsepage::bench
