// DLPack's C exchange table (DLPack 1.2+): a tensor type publishes, as the
// PyCapsule `type(t).__dlpack_c_exchange_api__` named "dlpack_exchange_api",
// a table of C functions that describe one of its tensors without a capsule
// or a Python call (torch.Tensor does from torch 2.11). The declarations
// below are the ABI the DLPack specification fixes (dlpack.h), written out
// here because the DLPack headers Debian ships (0.6) predate it; only the
// entries this binding calls are typed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tensor.h"

namespace sparsepage::py::dlpack_abi {

struct Version {
  uint32_t major;
  uint32_t minor;
};
struct Device {
  int32_t device_type;  // 1: CPU, 2: CUDA
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};
struct ExchangeApiHeader {
  Version version;
  ExchangeApiHeader* prev_api;
};
struct ExchangeApi {
  ExchangeApiHeader header;
  void* managed_tensor_allocator;
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, ManagedTensorVersioned** out);
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);  // may be null
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

}  // namespace sparsepage::py::dlpack_abi

namespace sparsepage::py {

/// The exchange table `type(obj)` publishes (major version 1), or null when
/// it publishes none: the caller then takes the DLPack capsule path.
const dlpack_abi::ExchangeApi* exchange_api_of(nb::handle obj);

/// `obj` described through `api` (one C call): as `describe` gives it.
Tensor describe_exchange(const dlpack_abi::ExchangeApi* api, nb::handle obj, const std::string& op,
                         const std::string& name);

/// A tensor argument passed as a Python object: described through its type's
/// exchange table when it publishes one, else as a DLPack tensor (a capsule,
/// a numpy array). With `same_as_q` (q's table) it must be a tensor of q's
/// type. The optional form gives nullopt for None.
Tensor describe_handle(nb::handle h, const std::string& op, const std::string& name,
                       const dlpack_abi::ExchangeApi* same_as_q = nullptr);
std::optional<Tensor> describe_optional_handle(nb::handle h, const std::string& op, const std::string& name,
                                               const dlpack_abi::ExchangeApi* same_as_q = nullptr);

/// The producer's current stream for the CUDA tensor `t`, through its type's
/// table `api` (torch's current stream); `fallback` for a CPU tensor or where
/// the table (null: none) cannot tell.
void* current_work_stream(const dlpack_abi::ExchangeApi* api, const Tensor& t, void* fallback);

}  // namespace sparsepage::py
