// The layers over an engine's paged pool (KVStorage::kEnginePaged) on the
// CPU backend; the checks live in tests/support/engine_layer_checks.cc.
#include <gtest/gtest.h>

#include "support/engine_layer_checks.h"

namespace sparsepage {
namespace {

TEST(EnginePagedLayers, BlockSparseMatchesItsOwnCacheAndFp64) {
  testing::check_engine_paged_block_sparse(Device::kCpu);
}

TEST(EnginePagedLayers, DsaMatchesItsOwnCache) { testing::check_engine_paged_dsa(Device::kCpu); }
TEST(EnginePagedLayers, DsaOverAnFp8PoolMatchesItsOwnCache) { testing::check_engine_paged_dsa_fp8(Device::kCpu); }

TEST(EnginePagedLayers, MisuseIsRefusedByNameAndAppendsNothing) { testing::check_engine_paged_errors(Device::kCpu); }

}  // namespace
}  // namespace sparsepage
