// Built instead of src/cuda/indexers/block_indexer.cu when the library has no CUDA
// backend: the block-sparse layer's kernels report that clearly.
#include "models/block_sparse_kernels.h"

namespace sparsepage::detail {
size_t block_indexer_workspace_bytes(int32_t, int32_t, int64_t, int32_t) { return 0; }
void block_indexer_cuda(const BlockIndexerArgs&, void*) {
  throw Error("block-sparse indexer on Device::kCuda: sparsepage was built without CUDA");
}
void block_mask_cuda(const int32_t*, int32_t, int32_t, int32_t, int32_t, const int32_t*, int64_t, float*, void*) {
  throw Error("block mask on Device::kCuda: sparsepage was built without CUDA");
}
void block_prefill_regime_cuda(const BlockPrefillRegimeArgs&, void*) {
  throw Error("block-sparse prefill selection on Device::kCuda: sparsepage was built without CUDA");
}
}  // namespace sparsepage::detail
