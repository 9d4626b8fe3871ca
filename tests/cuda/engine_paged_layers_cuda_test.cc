// The layers over an engine's paged pool (KVStorage::kEnginePaged) on the
// CUDA backend: the same checks as the CPU suite's
// (tests/support/engine_layer_checks.cc). Skipped without a GPU.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "support/engine_layer_checks.h"

namespace sparsepage {
namespace {

TEST(EnginePagedLayersCuda, BlockSparseMatchesItsOwnCacheAndFp64) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_block_sparse(Device::kCuda);
}

TEST(EnginePagedLayersCuda, DsaMatchesItsOwnCache) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_dsa(Device::kCuda);
}

TEST(EnginePagedLayersCuda, DsaOverAnFp8PoolMatchesItsOwnCache) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_dsa_fp8(Device::kCuda);
}

TEST(EnginePagedLayersCuda, MisuseIsRefusedByNameAndAppendsNothing) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_errors(Device::kCuda);
}

}  // namespace
}  // namespace sparsepage
