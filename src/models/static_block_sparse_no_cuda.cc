// Built instead of src/cuda/indexers/static_block_sparse.cu when the library has no
// CUDA backend: the static block-sparse layer's kernels report that clearly.
#include "models/static_block_sparse_kernels.h"
#include "sparsepage/types.h"

namespace sparsepage::detail {
void static_pages_cuda(const StaticPagesArgs&, void*) {
  throw Error("static block-sparse pages on Device::kCuda: sparsepage was built without CUDA");
}
void static_mask_cuda(const StaticMaskArgs&, void*) {
  throw Error("static block-sparse mask on Device::kCuda: sparsepage was built without CUDA");
}
}  // namespace sparsepage::detail
