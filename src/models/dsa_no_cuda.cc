// Built instead of src/cuda/indexers/dsa_indexer.cu when the library has no CUDA
// backend: the DSA layer's kernels report that clearly.
#include "models/dsa_kernels.h"
#include "sparsepage/models/dsa.h"

namespace sparsepage {
size_t dsa_indexer_workspace_bytes(const DsaConfig&, int32_t, int64_t) { return 0; }
void dsa_select_tokens_cuda(const DsaConfig&, int32_t, const DsaIndexerArgs&, void*) {
  throw Error("dsa_select_tokens_cuda: sparsepage was built without CUDA");
}
namespace detail {
void dsa_select_tokens_cuda(const DsaConfig&, int32_t, const DsaIndexerArgs&, int32_t, void*) {
  throw Error("dsa_select_tokens_cuda: sparsepage was built without CUDA");
}
}  // namespace detail
}  // namespace sparsepage
