// DLPack tensors (numpy, torch CPU/CUDA) seen as the library's plain inputs:
// pointers, dtypes, devices, pools of rows and dense streams. Every check
// here throws sparsepage::Error naming the operation and the argument, so a
// Python caller gets a sparsepage.Error (a ValueError) with that message.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/types.h"

namespace sparsepage::py {

namespace nb = nanobind;

/// Any DLPack tensor the bindings read (read-only arrays accepted).
using In = nb::ndarray<nb::ro>;
/// Any DLPack tensor the bindings write.
using Out = nb::ndarray<>;

/// Raised for what the library cannot do yet (a Python NotImplementedError).
struct NotImplemented : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// One tensor argument, described.
struct Tensor {
  std::string op, name;  // for messages: "<op>: <name> ..."
  void* data = nullptr;
  Device device = Device::kCpu;
  int device_id = 0;
  nb::dlpack::dtype dtype{};
  std::vector<int64_t> shape, strides;  // strides in elements

  int ndim() const { return static_cast<int>(shape.size()); }
  int64_t numel() const;
  /// Bytes of its elements (numel times the element size).
  size_t nbytes() const;
  bool contiguous() const;
  std::string shape_str() const;
  std::string dtype_str() const;
  [[noreturn]] void fail(const std::string& what) const;

  /// The stride of dim `i`, or `packed` where that dim has extent 0 or 1:
  /// it reaches no second entry, so producers report any stride there.
  int64_t stride_or(int i, int64_t packed) const { return shape[i] > 1 ? strides[i] : packed; }
  /// The extent of dim `i` as int32; an error naming "<name>'s <what>" when
  /// it does not fit (the message is built only then).
  int32_t extent_int32(int i, const char* what) const;

  /// The float dtype (f32, f16, bf16); anything else is an error.
  DType float_dtype() const;
  /// Whether it holds uint8 elements (an FP8 format passed as its bytes).
  bool is_uint8() const { return dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) && dtype.bits == 8; }
  /// The same float dtype as `ref` (e.g. k, v and o as q).
  void require_same_dtype(const Tensor& ref) const;
  void require_ndim(int n, const char* layout) const;
  void require_contiguous(const char* why = nullptr) const;
  /// Unit stride in the last dim (where it has more than one entry); `what`
  /// names that dim in the message, e.g. "the row".
  void require_unit_stride_last(const char* what = nullptr) const;
  void require_int32() const;
  void require_float32() const;
  void require_shape(std::initializer_list<int64_t> expected, const char* layout) const;
  /// Living on `expected`, the device of `owner` (e.g. "the layer", "q").
  void require_device(Device expected, const char* owner) const;

  /// Plain arrays the library indexes directly: the dtype, then the shape,
  /// then contiguity. The vector form takes any length.
  void require_int32_array(std::initializer_list<int64_t> expected, const char* layout) const;
  void require_int32_vector(const char* layout) const;
  void require_float32_array(std::initializer_list<int64_t> expected, const char* layout) const;
  /// A workspace: contiguous, holding at least `needed` bytes.
  void require_workspace(size_t needed) const;
};

Tensor describe(const In& a, const std::string& op, const std::string& name);
Tensor describe(const Out& a, const std::string& op, const std::string& name);
std::optional<Tensor> describe(const std::optional<In>& a, const std::string& op, const std::string& name);
std::optional<Tensor> describe(const std::optional<Out>& a, const std::string& op, const std::string& name);

/// A tensor argument or an optional one (None: skipped), as common_device
/// takes them; implicit, so a call lists the arguments themselves.
struct TensorArg {
  TensorArg(const Tensor& t) : tensor(&t) {}
  TensorArg(const std::optional<Tensor>& t) : tensor(t ? &*t : nullptr) {}
  const Tensor* tensor;
};

/// The device every tensor lives on; an error when they differ.
Device common_device(const std::string& op, std::initializer_list<TensorArg> tensors);

/// A block table: int32 [rows, max_blocks] (`layout`) with unit stride in its
/// last dim, as the library's BlockTable; block_size, num_blocks and
/// row_of_sequence are the caller's.
BlockTable block_table_of(const Tensor& t, const char* layout);

/// A pool of rows from a tensor whose last dim is the row (stride 1) and
/// whose leading dims collapse into one row index with a uniform stride
/// (e.g. a [rows, dim] view of a wider buffer, or a whole [B, H, Cap, D]
/// allocation). `num_rows` receives the row count.
RowView pool_of(const Tensor& t, int64_t* num_rows);

/// The rows of a [batch, heads, capacity, dim] tensor with any strides over
/// its first three dims (a whole allocation, or a slice of one: the last dim
/// may be a slice of wider rows); rows must not overlap. `batch` receives
/// the leading dim.
/// `element_size` 0: the float dtype's; 1 for e4m3 bytes (the fp8 formats' views count bytes).
RowView dense_of(const Tensor& t, int32_t* batch, size_t element_size = 0);

/// Makes the tensor's CUDA device current for the lifetime of the guard
/// (no-op on the CPU).
class DeviceGuard {
 public:
  explicit DeviceGuard(const Tensor& t);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

/// f() with the workspace's CUDA device current, returning what it returns;
/// for a CPU workspace nothing runs and the result is R{} (the CPU backends
/// read their plans themselves and raise where CUDA flags an error).
template <class F>
auto on_cuda_workspace(const Tensor& ws, F f) -> decltype(f()) {
  if (ws.device != Device::kCuda) return decltype(f())();
  DeviceGuard guard(ws);
  return f();
}

/// Host int32 values of a sequence argument given as a list or a CPU array.
std::vector<int32_t> host_int32(nb::handle values, const std::string& op, const std::string& name);

/// A new numpy array owning a copy of `values`.
nb::object numpy_int32(std::vector<int32_t> values, std::vector<size_t> shape);

inline void* stream_ptr(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

/// Narrowing with a named error instead of a silent wrap.
int32_t to_int32(int64_t value, const std::string& op, const std::string& what);

}  // namespace sparsepage::py
