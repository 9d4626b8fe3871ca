// The DSA layer's device kernels (src/cuda/dsa_indexer.cu), behind plain
// C++ signatures; src/models/dsa_no_cuda.cc stands in for them when the
// library is built without CUDA.
#pragma once

#include <cstdint>

namespace sparsepage {
struct DsaConfig;
}  // namespace sparsepage

namespace sparsepage::detail {
/// Throws Error naming the first limit of the CUDA DSA indexer
/// (src/cuda/dsa_indexer.cu) that `config` at `batch` breaks; without CUDA,
/// says the library was built without it.
void check_dsa_indexer_cuda(const DsaConfig& config, int32_t batch);
}  // namespace sparsepage::detail
