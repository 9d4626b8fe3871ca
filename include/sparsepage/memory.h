// Owning buffers on the host or the GPU, and the few copies the library needs.
// The CUDA variants throw sparsepage::Error when the library was built
// without CUDA or no GPU is present.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "sparsepage/types.h"

namespace sparsepage {

/// True when the library was built with CUDA and a GPU is visible.
bool cuda_available();

/// A move-only allocation. Host buffers are 64-byte aligned.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Device device, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* as() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  bool empty() const { return bytes_ == 0; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::kCpu;
};

/// Copies `bytes` between any two memories (synchronous).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

/// Copies `height` rows of `width` bytes; rows start every `dst_pitch` /
/// `src_pitch` bytes (synchronous). This is how caches grow and append.
void copy_2d(void* dst, Device dst_device, size_t dst_pitch, const void* src, Device src_device, size_t src_pitch,
             size_t width, size_t height);

/// Fills `bytes` of `dst` with the byte `value` (0xFF makes f32/f16/bf16 NaN).
void fill_bytes(void* dst, Device device, int value, size_t bytes);

/// Uploads a host vector into a new buffer on `device`.
template <typename T>
Buffer upload(Device device, const std::vector<T>& values) {
  Buffer buffer(device, values.size() * sizeof(T));
  if (!values.empty()) copy_bytes(buffer.data(), device, values.data(), Device::kCpu, buffer.bytes());
  return buffer;
}

/// Reads `count` elements of T back from `src` on `device`.
template <typename T>
std::vector<T> download(Device device, const void* src, size_t count) {
  std::vector<T> values(count);
  if (count != 0) copy_bytes(values.data(), Device::kCpu, src, device, count * sizeof(T));
  return values;
}

}  // namespace sparsepage
