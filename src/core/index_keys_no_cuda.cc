// Built instead of src/cuda/cache/index_keys_write.cu when the library has no
// CUDA backend: the index keys' device ops report that clearly.
#include "sparsepage/index_keys.h"

namespace sparsepage {
void write_index_keys_cuda(const PagedIndexKeys&, int32_t, DType, const void*, int64_t, const int64_t*, int64_t,
                           IndexScaleFormat, int32_t*, void*) {
  throw Error("write_index_keys_cuda: sparsepage was built without CUDA");
}
void quantize_index_queries_cuda(DType, const void*, const float*, int64_t, int32_t, void*, float*, void*) {
  throw Error("quantize_index_queries_cuda: sparsepage was built without CUDA");
}
}  // namespace sparsepage
