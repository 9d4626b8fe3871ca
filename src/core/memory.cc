#include "sparsepage/memory.h"

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include "core/cuda_hooks.h"

namespace sparsepage {

bool cuda_available() { return detail::cuda_device_present(); }

Buffer::Buffer(Device device, size_t bytes) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  if (device == Device::kCuda) {
    data_ = detail::cuda_malloc(bytes);
    return;
  }
  constexpr size_t kAlign = 64;
  // Rounding up to the alignment must not wrap (SIZE_MAX - 10 would become 0
  // bytes that "succeed"); beyond PTRDIFF_MAX no pointer arithmetic is valid.
  if (bytes > static_cast<size_t>(std::numeric_limits<std::ptrdiff_t>::max()) - kAlign) {
    bytes_ = 0;
    throw Error("Buffer: bytes = " + std::to_string(bytes) + " exceeds the largest host allocation (2^63 - 1)");
  }
  data_ = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  if (data_ == nullptr) {
    bytes_ = 0;
    throw Error("Buffer: host allocation of " + std::to_string(bytes) + " bytes failed");
  }
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_), device_(other.device_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    bytes_ = other.bytes_;
    device_ = other.device_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void Buffer::release() {
  if (data_ == nullptr) return;
  if (device_ == Device::kCuda) {
    detail::cuda_free(data_);
  } else {
    std::free(data_);
  }
  data_ = nullptr;
  bytes_ = 0;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) throw Error("copy_bytes: dst and src must not be null");
  if (dst_device == Device::kCpu && src_device == Device::kCpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
  detail::cuda_copy(dst, dst_device == Device::kCuda, src, src_device == Device::kCuda, bytes);
}

void copy_2d(void* dst, Device dst_device, size_t dst_pitch, const void* src, Device src_device, size_t src_pitch,
             size_t width, size_t height) {
  if (width == 0 || height == 0) return;
  if (dst == nullptr || src == nullptr) throw Error("copy_2d: dst and src must not be null");
  if (width > dst_pitch || width > src_pitch) {
    throw Error("copy_2d: width " + std::to_string(width) + " exceeds a pitch (dst " + std::to_string(dst_pitch) +
                ", src " + std::to_string(src_pitch) + ")");
  }
  if (dst_device == Device::kCpu && src_device == Device::kCpu) {
    for (size_t row = 0; row < height; ++row) {
      std::memcpy(static_cast<char*>(dst) + row * dst_pitch, static_cast<const char*>(src) + row * src_pitch, width);
    }
    return;
  }
  detail::cuda_copy_2d(dst, dst_device == Device::kCuda, dst_pitch, src, src_device == Device::kCuda, src_pitch, width,
                       height);
}

void fill_bytes(void* dst, Device device, int value, size_t bytes) {
  if (bytes == 0) return;
  if (dst == nullptr) throw Error("fill_bytes: dst must not be null");
  if (device == Device::kCpu) {
    std::memset(dst, value, bytes);
    return;
  }
  detail::cuda_fill(dst, value, bytes);
}

}  // namespace sparsepage
