// CUDA halves of bench_device.h: graph-replay timing with events, a
// streaming-read bandwidth probe and a hash-based random fill.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "bench_device.h"
#include "cuda/primitives/common.cuh"

namespace sparsepage::bench {

DeviceFacts device_facts_cpu();
double median_us_cpu(const std::function<void(void*)>& launch, int32_t steps, int32_t reps);
void fill_random_cpu(DType dtype, void* data, int64_t count, uint64_t seed);
void fill_e4m3_exact_cpu(void* data, int64_t count, uint64_t seed);
void to_e4m3_times_256_cpu(const void* src, void* dst, int64_t count);

namespace {

__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

template <typename T>
__global__ void fill_kernel(T* data, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = static_cast<T>(hash_uniform(static_cast<uint64_t>(i), seed));
  }
}

// The CPU twin's values (bench_device_cpu.cc, e4m3_exact_byte): the same hash.
__global__ void fill_e4m3_exact_kernel(__nv_bfloat16* data, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull + seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    unsigned b = static_cast<unsigned>(x >> 40) & 0xFFu;
    if ((b & 0x7Fu) == 0x7Fu) b = 0;
    if (i % 128 == 0) b = 0x7E;
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    data[i] = __float2bfloat16_rn(__half2float(__half(h)) * (1.0f / 256.0f));
  }
}

__global__ void to_e4m3_kernel(const __nv_bfloat16* src, unsigned char* dst, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = __nv_cvt_float_to_fp8(__bfloat162float(src[i]) * 256.0f, __NV_SATFINITE, __NV_E4M3);
}

// Reads every 16-byte vector once; the sum keeps the loads alive.
__global__ void read_kernel(const int4* data, int64_t count, int* sink) {
  int acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    const int4 v = __ldcs(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) *sink = acc;  // practically never taken
}

}  // namespace

DeviceFacts device_facts(Device device) {
  if (device == Device::kCpu) return device_facts_cpu();
  cudaDeviceProp prop{};
  int dev = 0;
  SP_CUDA_CHECK(cudaGetDevice(&dev));
  SP_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  return {prop.name, prop.multiProcessorCount, prop.l2CacheSize, static_cast<int64_t>(prop.totalGlobalMem)};
}

namespace {

// Median microseconds per step: each of `reps` runs of `run(stream)` (which
// issues `steps` steps) is timed between two events on `stream`.
double median_us_of_runs(cudaStream_t stream, int32_t steps, int32_t reps, const std::function<void()>& run) {
  cudaEvent_t start, stop;
  SP_CUDA_CHECK(cudaEventCreate(&start));
  SP_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int32_t r = 0; r < reps; ++r) {
    SP_CUDA_CHECK(cudaEventRecord(start, stream));
    run();
    SP_CUDA_CHECK(cudaEventRecord(stop, stream));
    SP_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    SP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(1e3 * ms / steps);
  }
  SP_CUDA_CHECK(cudaEventDestroy(start));
  SP_CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  return times[times.size() / 2];
}

}  // namespace

double median_us_per_launch(Device device, const std::function<void(void*)>& launch, int32_t steps, int32_t reps) {
  if (device == Device::kCpu) return median_us_cpu(launch, steps, reps);
  cudaStream_t stream;
  SP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  launch(stream);  // warm-up outside the graph (module load, first touch)
  SP_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  SP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int32_t s = 0; s < steps; ++s) launch(stream);
  SP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  SP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int w = 0; w < 3; ++w) SP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  const double us = median_us_of_runs(stream, steps, reps, [&] { SP_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
  SP_CUDA_CHECK(cudaGraphExecDestroy(exec));
  SP_CUDA_CHECK(cudaGraphDestroy(graph));
  SP_CUDA_CHECK(cudaStreamDestroy(stream));
  return us;
}

double median_us_eager(Device device, const std::function<void(void*)>& launch, int32_t steps, int32_t reps) {
  if (device == Device::kCpu) return median_us_cpu(launch, steps, reps);
  cudaStream_t stream;
  SP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  launch(stream);
  SP_CUDA_CHECK(cudaStreamSynchronize(stream));
  const double us = median_us_of_runs(stream, steps, reps, [&] {
    for (int32_t s = 0; s < steps; ++s) launch(stream);
  });
  SP_CUDA_CHECK(cudaStreamDestroy(stream));
  return us;
}

Events::Events(Device device, int32_t count) : events_(static_cast<size_t>(count), nullptr) {
  if (device == Device::kCpu) return;
  for (void*& e : events_) {
    cudaEvent_t ev;
    SP_CUDA_CHECK(cudaEventCreate(&ev));
    e = ev;
  }
}
Events::~Events() {
  for (void* e : events_) {
    if (e != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
}
void Events::record(int32_t i, void* stream) {
  if (events_[static_cast<size_t>(i)] != nullptr)
    SP_CUDA_CHECK(
        cudaEventRecord(static_cast<cudaEvent_t>(events_[static_cast<size_t>(i)]), static_cast<cudaStream_t>(stream)));
}
double Events::elapsed_us(int32_t a, int32_t b) const {
  if (!available()) return 0.0;
  SP_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[static_cast<size_t>(b)])));
  float ms = 0;
  SP_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[static_cast<size_t>(a)]),
                                     static_cast<cudaEvent_t>(events_[static_cast<size_t>(b)])));
  return 1e3 * ms;
}

double measured_read_bandwidth_gbs(Device device, int64_t bytes) {
  if (device == Device::kCpu) return 0.0;
  void* data = nullptr;
  int* sink = nullptr;
  SP_CUDA_CHECK(cudaMalloc(&data, static_cast<size_t>(bytes)));
  SP_CUDA_CHECK(cudaMalloc(&sink, sizeof(int)));
  SP_CUDA_CHECK(cudaMemset(data, 1, static_cast<size_t>(bytes)));
  const int64_t vectors = bytes / 16;
  int sms = 0;
  SP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const double us = median_us_per_launch(
      device,
      [&](void* stream) {
        read_kernel<<<sms * 8, 512, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const int4*>(data), vectors,
                                                                            sink);
      },
      4, 9);
  SP_CUDA_CHECK(cudaFree(data));
  SP_CUDA_CHECK(cudaFree(sink));
  return static_cast<double>(vectors * 16) / (us * 1e3);
}

void fill_random(Device device, DType dtype, void* data, int64_t count, uint64_t seed) {
  if (device == Device::kCpu) {
    fill_random_cpu(dtype, data, count, seed);
    return;
  }
  const int grid = 132 * 8;
  if (dtype == DType::kBF16) {
    fill_kernel<__nv_bfloat16><<<grid, 256>>>(static_cast<__nv_bfloat16*>(data), count, seed);
  } else if (dtype == DType::kF16) {
    fill_kernel<__half><<<grid, 256>>>(static_cast<__half*>(data), count, seed);
  } else {
    fill_kernel<float><<<grid, 256>>>(static_cast<float*>(data), count, seed);
  }
  SP_CUDA_CHECK_LAUNCH();
  SP_CUDA_CHECK(cudaDeviceSynchronize());
}

void fill_e4m3_exact(Device device, void* data, int64_t count, uint64_t seed) {
  if (device == Device::kCpu) return fill_e4m3_exact_cpu(data, count, seed);
  fill_e4m3_exact_kernel<<<132 * 8, 256>>>(static_cast<__nv_bfloat16*>(data), count, seed);
  SP_CUDA_CHECK_LAUNCH();
  SP_CUDA_CHECK(cudaDeviceSynchronize());
}

void to_e4m3_times_256(Device device, const void* src, void* dst, int64_t count) {
  if (device == Device::kCpu) return to_e4m3_times_256_cpu(src, dst, count);
  to_e4m3_kernel<<<132 * 8, 256>>>(static_cast<const __nv_bfloat16*>(src), static_cast<unsigned char*>(dst), count);
  SP_CUDA_CHECK_LAUNCH();
  SP_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace sparsepage::bench
