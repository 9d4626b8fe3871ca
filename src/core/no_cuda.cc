// Built instead of src/cuda/ when the library has no CUDA backend: every
// CUDA entry point reports that clearly instead of failing to link.
#include "core/cuda_hooks.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/fp8.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/types.h"

namespace sparsepage {
namespace {
[[noreturn]] void no_cuda(const char* what) { throw Error(std::string(what) + ": sparsepage was built without CUDA"); }
}  // namespace

namespace detail {
bool cuda_device_present() { return false; }
void* cuda_malloc(size_t) { no_cuda("Buffer(Device::kCuda)"); }
void cuda_free(void*) noexcept {}
void cuda_copy(void*, bool, const void*, bool, size_t) { no_cuda("copy_bytes"); }
void cuda_copy_2d(void*, bool, size_t, const void*, bool, size_t, size_t, size_t) { no_cuda("copy_2d"); }
void cuda_fill(void*, int, size_t) { no_cuda("fill_bytes"); }
void cuda_fill_async(void*, int, size_t, void*) { no_cuda("cuda_fill_async"); }
void cuda_stream_sync(void*) { no_cuda("stream synchronize"); }
bool cuda_stream_capturing(void*) { return false; }
void cuda_record_event(void* event, void*) {
  if (event != nullptr) no_cuda("cuda_record_event");
}
void append_token_cuda(const AppendTokenArgs&, void*) { no_cuda("DenseKVCache::append_token(Device::kCuda)"); }
void merge_partials_cuda(const MergePartialsArgs&, void*) { no_cuda("mla_sparse merge (CUDA)"); }
}  // namespace detail

bool cuda_supports_head_dims(int32_t, int32_t, int32_t) { return false; }
CudaLaunchShape cuda_launch_shape(int32_t, int32_t, int32_t, int32_t, int32_t) {
  throw Error("cuda_launch_shape: sparsepage was built without CUDA");
}
int32_t cuda_multiprocessor_count() { no_cuda("cuda_multiprocessor_count"); }
int32_t cuda_device_sm() { return 0; }
void upload_plan_cuda(const DecodePlan&, void*, void*) { no_cuda("upload_plan_cuda"); }
const char* run_decode_cuda(const DecodeParams&, const DecodePlan&, void*, void*) { no_cuda("run_decode_cuda"); }
int32_t cuda_merge_cluster_size(const DecodeParams&, const DecodePlan&) { no_cuda("cuda_merge_cluster_size"); }
uint32_t read_decode_error_flag(const DecodePlan&, void*, void*) { no_cuda("read_decode_error_flag"); }
DecodeErrors read_decode_errors(const DecodePlan&, void*, void*) { no_cuda("read_decode_errors"); }
const char* cuda_decode_kernel_name(const DecodeParams&, const DecodePlan&) { no_cuda("cuda_decode_kernel_name"); }
void cuda_check_kernel_switches() {}  // no CUDA kernels, no switches
size_t masked_decode_workspace_bytes(const MaskedDecodeParams&, int32_t) { no_cuda("masked_decode_workspace_bytes"); }
void run_masked_decode_cuda(const MaskedDecodeParams&, void*, void*) { no_cuda("run_masked_decode_cuda"); }
void quantize_mla_fp8_cuda(DType, const void*, int64_t, int64_t, void*, int64_t, void*) {
  no_cuda("quantize_mla_fp8_cuda");
}

}  // namespace sparsepage

namespace sparsepage::detail {
void gather_rows_cuda(const int32_t*, const int32_t*, int32_t, int64_t, DType, const RowView&, int64_t, void*, void*) {
  throw Error("gather_rows(Device::kCuda): sparsepage was built without CUDA");
}
}  // namespace sparsepage::detail

namespace sparsepage::detail {
void selection_mask_cuda(const int32_t*, const int32_t*, int32_t, int64_t, float*, void*) {
  throw Error("build_selection_mask(Device::kCuda): sparsepage was built without CUDA");
}
}  // namespace sparsepage::detail
