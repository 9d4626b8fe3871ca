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

static uint8_t e4m3_exact_byte(int64_t i, uint64_t seed) {
  if (i % 128 == 0) return 0x7E;  // 448: the block's amax
  uint64_t x = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  const auto b = static_cast<uint8_t>(x >> 40);
  return (b & 0x7F) == 0x7F ? 0 : b;  // no NaN
}

void fill_e4m3_exact_cpu(void* data, int64_t count, uint64_t seed) {
  auto* out = static_cast<uint16_t*>(data);
  for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(e4m3_to_float(e4m3_exact_byte(i, seed)) / 256.0f);
}

void to_e4m3_times_256_cpu(const void* src, void* dst, int64_t count) {
  const auto* in = static_cast<const uint16_t*>(src);
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < count; ++i) out[i] = float_to_e4m3(bf16_to_float(in[i]) * 256.0f);
}

#ifndef SPARSEPAGE_BENCH_CUDA
void fill_e4m3_exact(Device device, void* data, int64_t count, uint64_t seed) {
  if (device == Device::kCuda) throw Error("bench: built without CUDA");
  fill_e4m3_exact_cpu(data, count, seed);
}
void to_e4m3_times_256(Device device, const void* src, void* dst, int64_t count) {
  if (device == Device::kCuda) throw Error("bench: built without CUDA");
  to_e4m3_times_256_cpu(src, dst, count);
}
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
