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

void expect_block_coverage(const testing::BlockPoolsStats& s, bool bitwise) {
  EXPECT_GE(s.compared_rows, 40);
  EXPECT_GE(s.sparse_rows, 20) << "sequences in their sparse regime";
  EXPECT_GE(s.compared_rows - s.sparse_rows, 10) << "sequences in their dense regime";
  EXPECT_GE(s.free_rows, 4);
  EXPECT_GT(s.reused_blocks, 0) << "a released request's blocks must be handed out again";
  if (bitwise) {
    EXPECT_EQ(s.bitwise_rows, s.compared_rows);
  }
}

TEST(EnginePools, BlockSparseRaggedBatchOverBf16Pools) {
  testing::BlockPoolsRun run;
  expect_block_coverage(testing::check_block_sparse_engine_pools(Device::kCpu, run), true);
}
TEST(EnginePools, BlockSparseRaggedBatchOverFp8Keys) {
  testing::BlockPoolsRun run;
  run.fp8_keys = true;
  expect_block_coverage(testing::check_block_sparse_engine_pools(Device::kCpu, run), true);
}
// The engine's fixed bound rather than the longest length (a captured
// step's form): each plan covers the bound, so outputs are compared within
// 1e-2 rather than bit for bit, and selections stay exact.
TEST(EnginePools, BlockSparseRaggedBatchAtTheEnginesBound) {
  testing::BlockPoolsRun run;
  run.runner = [](const std::function<LayerStep(void*)>& step) { return step(nullptr); };
  expect_block_coverage(testing::check_block_sparse_engine_pools(Device::kCpu, run), false);
}
TEST(EnginePools, BlockSparseRefusesBadLengthsAndBlocks) {
  testing::check_block_sparse_engine_pools_refusals(Device::kCpu, false);
  testing::check_block_sparse_engine_pools_refusals(Device::kCpu, true);
}
}  // namespace
}  // namespace sparsepage
