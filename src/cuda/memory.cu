// The CUDA runtime services behind memory.h (core/cuda_hooks.h) and the
// device query decode.h needs. Every call is checked and a failure throws
// sparsepage::Error naming the call and CUDA's message. The copies and the
// fill are synchronous, as memory.h documents. (src/core/no_cuda.cc stands in
// for this file when the library is built without CUDA.)
#include <atomic>
#include <string>

#include "core/cuda_hooks.h"
#include "cuda/primitives/common.cuh"
#include "sparsepage/decode.h"

namespace sparsepage {

namespace {

cudaMemcpyKind copy_kind(bool dst_on_device, bool src_on_device) {
  if (dst_on_device) return src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
  return src_on_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
}

/// cudaMemcpy between two device buffers and cudaMemset may return before the
/// GPU is done; waiting keeps the documented synchronous behaviour and
/// surfaces asynchronous faults at the call that caused them.
void finish_device_work() { SP_CUDA_CHECK(cudaDeviceSynchronize()); }

}  // namespace

namespace detail {

bool cuda_device_present() {
  static const bool present = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no device: leave no error behind
      return false;
    }
    return count > 0;
  }();
  return present;
}

void* cuda_malloc(size_t bytes) {
  if (!cuda_device_present()) throw Error("Buffer(Device::kCuda): no CUDA device is available");
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it
    throw Error("Buffer(Device::kCuda): cudaMalloc of " + std::to_string(bytes) +
                " bytes failed: " + cudaGetErrorString(err));
  }
  return ptr;
}

void cuda_free(void* ptr) noexcept {
  // Called from destructors: a failure (e.g. after a sticky device fault)
  // leaks the allocation rather than terminating.
  if (ptr != nullptr && cudaFree(ptr) != cudaSuccess) (void)cudaGetLastError();
}

void cuda_copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) throw Error("copy_bytes: null pointer");
  SP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, copy_kind(dst_on_device, src_on_device)));
  if (dst_on_device && src_on_device) finish_device_work();
}

void cuda_copy_2d(void* dst, bool dst_on_device, size_t dst_pitch, const void* src, bool src_on_device,
                  size_t src_pitch, size_t width, size_t height) {
  if (width == 0 || height == 0) return;
  if (dst == nullptr || src == nullptr) throw Error("copy_2d: null pointer");
  SP_CUDA_CHECK(cudaMemcpy2D(dst, dst_pitch, src, src_pitch, width, height, copy_kind(dst_on_device, src_on_device)));
  if (dst_on_device && src_on_device) finish_device_work();
}

void cuda_stream_sync(void* stream) { SP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream))); }

void cuda_record_event(void* event, void* stream) {
  if (event != nullptr)
    SP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

bool cuda_stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  SP_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

void cuda_fill(void* dst, int value, size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr) throw Error("fill_bytes: null pointer");
  SP_CUDA_CHECK(cudaMemset(dst, value, bytes));
  finish_device_work();
}

void cuda_fill_async(void* dst, int value, size_t bytes, void* stream) {
  if (bytes == 0) return;
  if (dst == nullptr) throw Error("cuda_fill_async: null pointer");
  SP_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream)));
}

}  // namespace detail

int32_t cuda_device_sm() {
  if (!detail::cuda_device_present()) return 0;
  // Per device, asked once: launchers ask on every launch, graph capture included.
  constexpr int kMaxDevices = 64;
  static std::atomic<int32_t> known[kMaxDevices] = {};
  int device = 0;
  SP_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) throw Error("cuda_device_sm: device ordinal out of range");
  int32_t sm = known[device].load(std::memory_order_relaxed);
  if (sm == 0) {
    int major = 0, minor = 0;
    SP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    SP_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    sm = major * 10 + minor;
    known[device].store(sm, std::memory_order_relaxed);
  }
  return sm;
}

int32_t cuda_multiprocessor_count() {
  if (!detail::cuda_device_present()) throw Error("cuda_multiprocessor_count: no CUDA device is available");
  int device = 0;
  int sms = 0;
  SP_CUDA_CHECK(cudaGetDevice(&device));
  SP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

}  // namespace sparsepage
