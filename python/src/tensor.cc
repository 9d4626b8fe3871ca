#include "tensor.h"

#include "dlpack_exchange.h"

#include <limits>
#include <sstream>

#include <nanobind/stl/vector.h>

#ifdef SPARSEPAGE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace sparsepage::py {
namespace {

constexpr int kDLCPU = 1;
constexpr int kDLCUDA = 2;

Device device_of(int32_t dlpack_device_type, const std::string& op, const std::string& name) {
  if (dlpack_device_type == kDLCPU) return Device::kCpu;
  if (dlpack_device_type == kDLCUDA) return Device::kCuda;
  throw Error(op + ": " + name + " lives on DLPack device type " + std::to_string(dlpack_device_type) +
              "; sparsepage reads CPU and CUDA memory");
}

template <typename A>
Tensor describe_any(const A& a, const std::string& op, const std::string& name) {
  Tensor t;
  t.op = op;
  t.name = name;
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = a.dtype();
  t.device_id = a.device_id();
  t.device = device_of(a.device_type(), op, name);
  for (size_t i = 0; i < a.ndim(); ++i) {
    t.shape.push_back(static_cast<int64_t>(a.shape(i)));
    t.strides.push_back(a.stride(i));
  }
  return t;
}

}  // namespace

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

size_t Tensor::nbytes() const { return static_cast<size_t>(numel()) * dtype.bits * dtype.lanes / 8; }

bool Tensor::contiguous() const {
  if (numel() == 0) return true;  // nothing to read: its strides are whatever the producer chose
  int64_t expected = 1;
  for (int i = ndim() - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string Tensor::shape_str() const {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < ndim(); ++i) s << (i ? ", " : "") << shape[i];
  if (ndim() == 1) s << ",";
  s << ")";
  return s.str();
}

std::string Tensor::dtype_str() const {
  using nb::dlpack::dtype_code;
  const char* kind = "?";
  switch (static_cast<dtype_code>(dtype.code)) {
    case dtype_code::Int: kind = "int"; break;
    case dtype_code::UInt: kind = "uint"; break;
    case dtype_code::Float: kind = "float"; break;
    case dtype_code::Bfloat: kind = "bfloat"; break;
    case dtype_code::Bool: kind = "bool"; break;
    default: break;
  }
  return std::string(kind) + std::to_string(dtype.bits);
}

void Tensor::fail(const std::string& what) const { throw Error(op + ": " + name + " " + what); }

int32_t Tensor::extent_int32(int i, const char* what) const {
  const int64_t n = shape[static_cast<size_t>(i)];
  if (n < std::numeric_limits<int32_t>::min() || n > std::numeric_limits<int32_t>::max())
    return to_int32(n, op, name + "'s " + what);  // throws
  return static_cast<int32_t>(n);
}

DType Tensor::float_dtype() const {
  using nb::dlpack::dtype_code;
  if (dtype.lanes == 1) {
    if (dtype.code == static_cast<uint8_t>(dtype_code::Float) && dtype.bits == 32) return DType::kF32;
    if (dtype.code == static_cast<uint8_t>(dtype_code::Float) && dtype.bits == 16) return DType::kF16;
    if (dtype.code == static_cast<uint8_t>(dtype_code::Bfloat) && dtype.bits == 16) return DType::kBF16;
  }
  fail("has dtype " + dtype_str() + "; expected float32, float16 or bfloat16");
}

void Tensor::require_same_dtype(const Tensor& ref) const {
  const DType expected = ref.float_dtype(), own = float_dtype();
  if (own != expected)
    fail(std::string("has dtype ") + dtype_name(own) + " but " + ref.name + " has " + dtype_name(expected));
}

void Tensor::require_ndim(int n, const char* layout) const {
  if (ndim() != n) fail("must be " + std::to_string(n) + "-D " + layout + ", got shape " + shape_str());
}

void Tensor::require_contiguous(const char* why) const {
  if (!contiguous()) fail(std::string("must be contiguous") + (why ? why : ""));
}

void Tensor::require_unit_stride_last(const char* what) const {
  // An empty tensor's strides are whatever its producer chose (numpy 2.5 exports 0), as in contiguous().
  if (ndim() > 0 && shape.back() > 1 && strides.back() != 1 && numel() != 0)
    fail(std::string("must have unit stride in its last dim") + (what ? std::string(" (") + what + ")" : ""));
}

void Tensor::require_device(Device expected, const char* owner) const {
  if (device != expected)
    fail(std::string("lives on ") + device_name(device) + " but " + owner + " on " + device_name(expected));
}

void Tensor::require_int32() const {
  if (!(dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) && dtype.bits == 32 && dtype.lanes == 1))
    fail("has dtype " + dtype_str() + "; expected int32");
}

void Tensor::require_float32() const {
  if (!(dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float) && dtype.bits == 32 && dtype.lanes == 1))
    fail("has dtype " + dtype_str() + "; expected float32");
}

void Tensor::require_shape(std::initializer_list<int64_t> expected, const char* layout) const {
  bool ok = static_cast<int>(expected.size()) == ndim();
  int i = 0;
  for (int64_t e : expected) {
    if (ok && shape[i] != e) ok = false;
    ++i;
  }
  if (ok) return;
  std::ostringstream s;
  s << "(";
  i = 0;
  for (int64_t e : expected) s << (i++ ? ", " : "") << e;
  if (expected.size() == 1) s << ",";
  s << ")";
  fail("must have shape " + s.str() + " " + layout + ", got " + shape_str());
}

void Tensor::require_int32_array(std::initializer_list<int64_t> expected, const char* layout) const {
  require_int32();
  require_shape(expected, layout);
  require_contiguous();
}

void Tensor::require_int32_vector(const char* layout) const {
  require_int32();
  require_ndim(1, layout);
  require_contiguous();
}

void Tensor::require_float32_array(std::initializer_list<int64_t> expected, const char* layout) const {
  require_float32();
  require_shape(expected, layout);
  require_contiguous();
}

void Tensor::require_workspace(size_t needed) const {
  require_contiguous();
  if (nbytes() < needed) fail("holds " + std::to_string(nbytes()) + " bytes; the plan needs " + std::to_string(needed));
}

Tensor describe(const In& a, const std::string& op, const std::string& name) { return describe_any(a, op, name); }
Tensor describe(const Out& a, const std::string& op, const std::string& name) { return describe_any(a, op, name); }
std::optional<Tensor> describe(const std::optional<In>& a, const std::string& op, const std::string& name) {
  if (!a) return std::nullopt;
  return describe_any(*a, op, name);
}
std::optional<Tensor> describe(const std::optional<Out>& a, const std::string& op, const std::string& name) {
  if (!a) return std::nullopt;
  return describe_any(*a, op, name);
}

const dlpack_abi::ExchangeApi* exchange_api_of(nb::handle obj) {
  // One type at a time in practice (torch.Tensor): a one-entry cache.
  static PyTypeObject* cached_type = nullptr;
  static const dlpack_abi::ExchangeApi* cached_api = nullptr;
  PyTypeObject* type = Py_TYPE(obj.ptr());
  if (type == cached_type) return cached_api;
  const dlpack_abi::ExchangeApi* api = nullptr;
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_CheckExact(capsule) && PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
      api = static_cast<const dlpack_abi::ExchangeApi*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
      // Walk to a table of the major version this binding reads.
      while (api != nullptr && api->header.version.major != 1) {
        api = reinterpret_cast<const dlpack_abi::ExchangeApi*>(api->header.prev_api);
      }
      if (api != nullptr && api->managed_tensor_from_py_object_no_sync == nullptr) api = nullptr;
    }
    Py_DECREF(capsule);  // the type keeps the table alive for the process
  }
  cached_type = type;
  cached_api = api;
  return api;
}

Tensor describe_exchange(const dlpack_abi::ExchangeApi* api, nb::handle obj, const std::string& op,
                         const std::string& name) {
  dlpack_abi::DLTensor dl{};
  dlpack_abi::ManagedTensorVersioned* managed = nullptr;
  if (api->dltensor_from_py_object_no_sync != nullptr) {
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &dl) != 0) nb::raise_python_error();
  } else {
    if (api->managed_tensor_from_py_object_no_sync(obj.ptr(), &managed) != 0) nb::raise_python_error();
    dl = managed->dl_tensor;
  }
  Tensor t;
  t.op = op;
  t.name = name;
  t.data = static_cast<char*>(dl.data) + dl.byte_offset;
  t.dtype = nb::dlpack::dtype{dl.dtype.code, dl.dtype.bits, dl.dtype.lanes};
  t.device_id = dl.device.device_id;
  t.shape.assign(dl.shape, dl.shape + dl.ndim);
  t.strides.resize(static_cast<size_t>(dl.ndim));
  int64_t packed = 1;  // null strides: compact row-major
  for (int32_t i = dl.ndim - 1; i >= 0; --i) {
    t.strides[static_cast<size_t>(i)] = dl.strides != nullptr ? dl.strides[i] : packed;
    packed *= dl.shape[i];
  }
  const int32_t device_type = dl.device.device_type;
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);  // the tensor itself stays alive
  t.device = device_of(device_type, op, name);
  return t;
}

Tensor describe_handle(nb::handle h, const std::string& op, const std::string& name,
                       const dlpack_abi::ExchangeApi* same_as_q) {
  const dlpack_abi::ExchangeApi* api = exchange_api_of(h);
  if (same_as_q != nullptr && api != same_as_q)
    throw Error(op + ": " + name + " is not a tensor of q's type (the exchange entry takes one tensor type)");
  if (api != nullptr) return describe_exchange(api, h, op, name);
  In array;
  if (!nb::try_cast(h, array)) throw Error(op + ": " + name + " is not a tensor (no DLPack export)");
  return describe(array, op, name);
}

std::optional<Tensor> describe_optional_handle(nb::handle h, const std::string& op, const std::string& name,
                                               const dlpack_abi::ExchangeApi* same_as_q) {
  if (h.is_none()) return std::nullopt;
  return describe_handle(h, op, name, same_as_q);
}

void* current_work_stream(const dlpack_abi::ExchangeApi* api, const Tensor& t, void* fallback) {
  if (t.device != Device::kCuda || api == nullptr || api->current_work_stream == nullptr) return fallback;
  void* stream = nullptr;
  if (api->current_work_stream(kDLCUDA, t.device_id, &stream) != 0) nb::raise_python_error();
  return stream;
}

Device common_device(const std::string& op, std::initializer_list<TensorArg> tensors) {
  const Tensor* first = nullptr;
  for (const TensorArg& arg : tensors) {
    const Tensor* t = arg.tensor;
    if (t == nullptr) continue;
    if (first == nullptr) {
      first = t;
      continue;
    }
    if (t->device != first->device || t->device_id != first->device_id) {
      throw Error(op + ": " + t->name + " lives on " + device_name(t->device) + ":" + std::to_string(t->device_id) +
                  " but " + first->name + " on " + device_name(first->device) + ":" + std::to_string(first->device_id));
    }
  }
  if (first == nullptr) throw Error(op + ": no tensor arguments");
  return first->device;
}

BlockTable block_table_of(const Tensor& t, const char* layout) {
  t.require_int32();
  t.require_ndim(2, layout);
  t.require_unit_stride_last();
  BlockTable b;
  b.data = static_cast<const int32_t*>(t.data);
  b.num_rows = t.extent_int32(0, "rows");
  b.max_blocks = t.extent_int32(1, "width");
  b.row_stride = t.stride_or(0, t.shape[1]);
  return b;
}

RowView pool_of(const Tensor& t, int64_t* num_rows) {
  if (t.ndim() < 2) t.fail("must be a pool of rows (at least 2-D, rows last), got shape " + t.shape_str());
  const int last = t.ndim() - 1;
  t.require_unit_stride_last("the row");
  // The leading dims must address rows uniformly: row r at r * row_stride.
  int64_t row_stride = t.strides[last - 1];
  int64_t expected = row_stride;
  for (int i = last - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected)
      t.fail("is not a uniform pool of rows: stride " + std::to_string(t.strides[i]) + " of dim " + std::to_string(i) +
             " should be " + std::to_string(expected));
    expected *= t.shape[i];
  }
  int64_t rows = 1;
  for (int i = 0; i < last; ++i) rows *= t.shape[i];
  if (rows <= 1 && row_stride < t.shape[last]) row_stride = t.shape[last];  // one row: any stride reads it
  RowView pool;
  pool.data = t.data;
  pool.row_stride = row_stride;
  pool.dim = t.extent_int32(last, "row width");
  if (num_rows) *num_rows = rows;
  return pool;
}

RowView dense_of(const Tensor& t, int32_t* batch, size_t element_size) {
  t.require_ndim(4, "[batch, heads, capacity, head_dim]");
  t.require_unit_stride_last();
  // Any strides over batch, heads and positions: RowView carries all three
  // (a dim of size 1 has no second entry to reach, so its stride is moot).
  RowView s;
  s.data = t.data;
  s.seq_stride = t.stride_or(0, 0);
  s.head_stride = t.stride_or(1, 0);
  s.row_stride = t.stride_or(2, t.shape[3]);
  s.dim = t.extent_int32(3, "head_dim");
  s.capacity = t.shape[2];
  for (const int64_t stride : {s.seq_stride, s.head_stride, s.row_stride}) {
    if (stride < 0) t.fail("has a negative stride");
  }
  const std::string problem = row_view_problem(s, t.name.c_str(), t.shape[0], t.shape[1], t.shape[2],
                                               element_size > 0 ? element_size : dtype_size(t.float_dtype()));
  if (!problem.empty()) throw Error(t.op + ": " + problem);
  if (batch) *batch = t.extent_int32(0, "batch");
  return s;
}

DeviceGuard::DeviceGuard(const Tensor& t) {
#ifdef SPARSEPAGE_WITH_CUDA
  if (t.device != Device::kCuda) return;
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) throw Error(t.op + ": cannot query the current CUDA device");
  if (current != t.device_id) {
    if (cudaSetDevice(t.device_id) != cudaSuccess)
      throw Error(t.op + ": cannot make CUDA device " + std::to_string(t.device_id) + " current");
    previous_ = current;
  }
#else
  if (t.device == Device::kCuda)
    throw Error(t.op + ": " + t.name + " is a CUDA tensor but this sparsepage build has no CUDA backend");
#endif
}

DeviceGuard::~DeviceGuard() {
#ifdef SPARSEPAGE_WITH_CUDA
  if (previous_ >= 0) cudaSetDevice(previous_);
#endif
}

std::vector<int32_t> host_int32(nb::handle values, const std::string& op, const std::string& name) {
  In array;
  if (nb::try_cast(values, array)) {
    Tensor t = describe(array, op, name);
    if (t.device != Device::kCpu) t.fail("must be host values (a list or a CPU array), not a CUDA tensor");
    t.require_ndim(1, "of counts");
    using nb::dlpack::dtype_code;
    std::vector<int32_t> out(static_cast<size_t>(t.shape[0]));
    const bool is_int = t.dtype.code == static_cast<uint8_t>(dtype_code::Int);
    if (!(is_int && (t.dtype.bits == 32 || t.dtype.bits == 64)))
      t.fail("has dtype " + t.dtype_str() + "; expected int32 or int64");
    for (size_t i = 0; i < out.size(); ++i) {
      const char* p = static_cast<const char*>(t.data) + static_cast<int64_t>(i) * t.strides[0] * (t.dtype.bits / 8);
      const int64_t v =
          t.dtype.bits == 32 ? *reinterpret_cast<const int32_t*>(p) : *reinterpret_cast<const int64_t*>(p);
      out[i] = to_int32(v, op, name + "[" + std::to_string(i) + "]");
    }
    return out;
  }
  std::vector<int64_t> list;
  if (!nb::try_cast(values, list)) throw Error(op + ": " + name + " must be a sequence of ints or a CPU int array");
  std::vector<int32_t> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) out.push_back(to_int32(list[i], op, name + "[" + std::to_string(i) + "]"));
  return out;
}

nb::object numpy_int32(std::vector<int32_t> values, std::vector<size_t> shape) {
  auto* heap = new std::vector<int32_t>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
  return nb::ndarray<nb::numpy, int32_t>(heap->data(), shape.size(), shape.data(), owner).cast();
}

int32_t to_int32(int64_t value, const std::string& op, const std::string& what) {
  if (value < std::numeric_limits<int32_t>::min() || value > std::numeric_limits<int32_t>::max())
    throw Error(op + ": " + what + " = " + std::to_string(value) + " does not fit in int32");
  return static_cast<int32_t>(value);
}

}  // namespace sparsepage::py
