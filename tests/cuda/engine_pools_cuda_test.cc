// The layers' steps over engine-owned pools on the GPU
// (tests/support/engine_pools.h, tests/support/block_sparse_pools.h).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>

#include "cuda/cuda_test_util.h"
#include "cuda/graph_runner.h"
#include "support/block_sparse_pools.h"
#include "support/engine_pools.h"

namespace sparsepage {
namespace {
TEST(EnginePoolsCuda, DsaStepOverBf16Pools) {
  SKIP_WITHOUT_CUDA();
  testing::check_dsa_engine_pools(Device::kCuda, false);
}
TEST(EnginePoolsCuda, DsaStepOverFp8Pools) {
  SKIP_WITHOUT_CUDA();
  testing::check_dsa_engine_pools(Device::kCuda, true);
}

TEST(EnginePoolsCuda, BlockSparseRaggedBatchOverBf16Pools) {
  SKIP_WITHOUT_CUDA();
  testing::expect_block_pools_coverage(testing::check_block_sparse_engine_pools(Device::kCuda, {}), true);
}
TEST(EnginePoolsCuda, BlockSparseRaggedBatchOverFp8Keys) {
  SKIP_WITHOUT_CUDA();
  testing::BlockPoolsRun run;
  run.fp8_keys = true;
  testing::expect_block_pools_coverage(testing::check_block_sparse_engine_pools(Device::kCuda, run), true);
}
// One step captured and replayed while the lengths change, requests leave
// and their blocks are reused.
TEST(EnginePoolsCuda, BlockSparseCapturedStepReplayedAsLengthsChange) {
  SKIP_WITHOUT_CUDA();
  for (const bool fp8 : {false, true}) {
    testing::GraphRunner graph;
    testing::BlockPoolsRun run;
    run.fp8_keys = fp8;
    run.runner = [&graph](const std::function<LayerStep(void*)>& step) { return graph(step); };
    testing::expect_block_pools_coverage(testing::check_block_sparse_engine_pools(Device::kCuda, run), false);
    EXPECT_GE(graph.replays(), 12) << (fp8 ? "FP8 keys" : "bf16 keys");
  }
}
TEST(EnginePoolsCuda, BlockSparseRefusesBadLengthsAndBlocks) {
  SKIP_WITHOUT_CUDA();
  testing::check_block_sparse_engine_pools_refusals(Device::kCuda, false);
  testing::check_block_sparse_engine_pools_refusals(Device::kCuda, true);
}
}  // namespace
}  // namespace sparsepage
