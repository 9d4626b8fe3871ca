// CPU halves of bench_device.h; the CUDA halves are in bench_device_cuda.cu.
#include <algorithm>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "bench_device.h"

namespace sparsepage::bench {

DeviceFacts device_facts_cpu() {
  DeviceFacts facts;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  facts.name = "cpu (" + std::to_string(threads) + " threads)";
  facts.multiprocessors = static_cast<int32_t>(threads);
  return facts;
}

double median_us_cpu(const std::function<void(void*)>& launch, int32_t steps, int32_t reps) {
  launch(nullptr);  // warm-up
  std::vector<double> times;
  for (int32_t r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int32_t s = 0; s < steps; ++s) launch(nullptr);
    times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
                    steps);
  }
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  return times[times.size() / 2];
}

void fill_random_cpu(DType dtype, void* data, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> chunk(1 << 16);
  for (int64_t at = 0; at < count; at += static_cast<int64_t>(chunk.size())) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), count - at);
    for (int64_t i = 0; i < n; ++i) chunk[static_cast<size_t>(i)] = dist(rng);
    from_float(dtype, chunk.data(), static_cast<char*>(data) + at * static_cast<int64_t>(dtype_size(dtype)),
               static_cast<size_t>(n));
  }
}

#ifndef SPARSEPAGE_BENCH_CUDA
DeviceFacts device_facts(Device device) {
  if (device == Device::kCuda) throw Error("bench: built without CUDA");
  return device_facts_cpu();
}
double median_us_per_launch(Device device, const std::function<void(void*)>& launch, int32_t steps, int32_t reps) {
  if (device == Device::kCuda) throw Error("bench: built without CUDA");
  return median_us_cpu(launch, steps, reps);
}
double median_us_eager(Device device, const std::function<void(void*)>& launch, int32_t steps, int32_t reps) {
  if (device == Device::kCuda) throw Error("bench: built without CUDA");
  return median_us_cpu(launch, steps, reps);
}
Events::Events(Device, int32_t count) : events_(static_cast<size_t>(count), nullptr) {}
Events::~Events() = default;
void Events::record(int32_t, void*) {}
double Events::elapsed_us(int32_t, int32_t) const { return 0.0; }
double measured_read_bandwidth_gbs(Device, int64_t) { return 0.0; }
void fill_random(Device device, DType dtype, void* data, int64_t count, uint64_t seed) {
  if (device == Device::kCuda) throw Error("bench: built without CUDA");
  fill_random_cpu(dtype, data, count, seed);
}
#endif

}  // namespace sparsepage::bench
