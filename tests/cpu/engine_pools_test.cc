// The layers' steps over engine-owned pools on the CPU backend
// (tests/support/engine_pools.h, tests/support/block_sparse_pools.h).
#include <gtest/gtest.h>

#include <functional>

#include "support/block_sparse_pools.h"
#include "support/engine_pools.h"

namespace sparsepage {
namespace {
TEST(EnginePools, DsaStepOverBf16Pools) { testing::check_dsa_engine_pools(Device::kCpu, false); }
TEST(EnginePools, DsaStepOverFp8Pools) { testing::check_dsa_engine_pools(Device::kCpu, true); }

TEST(EnginePools, BlockSparseRaggedBatchOverBf16Pools) {
  testing::BlockPoolsRun run;
  testing::expect_block_pools_coverage(testing::check_block_sparse_engine_pools(Device::kCpu, run), true);
}
TEST(EnginePools, BlockSparseRaggedBatchOverFp8Keys) {
  testing::BlockPoolsRun run;
  run.fp8_keys = true;
  testing::expect_block_pools_coverage(testing::check_block_sparse_engine_pools(Device::kCpu, run), true);
}
// The engine's fixed bound rather than the longest length (a captured
// step's form): each plan covers the bound, so outputs are compared within
// 1e-2 rather than bit for bit, and selections stay exact.
TEST(EnginePools, BlockSparseRaggedBatchAtTheEnginesBound) {
  testing::BlockPoolsRun run;
  run.runner = [](const std::function<LayerStep(void*)>& step) { return step(nullptr); };
  testing::expect_block_pools_coverage(testing::check_block_sparse_engine_pools(Device::kCpu, run), false);
}
TEST(EnginePools, BlockSparseRefusesBadLengthsAndBlocks) {
  testing::check_block_sparse_engine_pools_refusals(Device::kCpu, false);
  testing::check_block_sparse_engine_pools_refusals(Device::kCpu, true);
}
}  // namespace
}  // namespace sparsepage
