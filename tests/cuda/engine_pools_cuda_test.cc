// The layers' steps over engine-owned pools on the GPU
// (tests/support/engine_pools.h, tests/support/block_sparse_pools.h).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>

#include "cuda/cuda_test_util.h"
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

// Runs the first step eagerly (it plans), captures the second in a CUDA
// graph and replays that graph for it and every later step, on a stream of
// its own, while the engine changes lengths, tables and pools between replays.
class GraphRunner {
 public:
  GraphRunner() { testing::cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"); }
  ~GraphRunner() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    cudaStreamDestroy(stream_);
  }
  LayerStep operator()(const std::function<LayerStep(void*)>& step) {
    if (calls_++ == 0) {
      const LayerStep s = step(stream_);
      testing::cuda_ok(cudaStreamSynchronize(stream_), "eager step");
      return s;
    }
    if (exec_ == nullptr) {
      testing::cuda_ok(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), "begin capture");
      captured_ = step(stream_);
      testing::cuda_ok(cudaStreamEndCapture(stream_, &graph_), "end capture");
      testing::cuda_ok(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
    }
    testing::cuda_ok(cudaGraphLaunch(exec_, stream_), "replay");
    testing::cuda_ok(cudaStreamSynchronize(stream_), "replayed step");
    ++replays_;
    return captured_;
  }
  int64_t replays() const { return replays_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  LayerStep captured_;
  int64_t calls_ = 0, replays_ = 0;
};

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

TEST(EnginePoolsCuda, BlockSparseRaggedBatchOverBf16Pools) {
  SKIP_WITHOUT_CUDA();
  expect_block_coverage(testing::check_block_sparse_engine_pools(Device::kCuda, {}), true);
}
TEST(EnginePoolsCuda, BlockSparseRaggedBatchOverFp8Keys) {
  SKIP_WITHOUT_CUDA();
  testing::BlockPoolsRun run;
  run.fp8_keys = true;
  expect_block_coverage(testing::check_block_sparse_engine_pools(Device::kCuda, run), true);
}
// One step captured and replayed while the lengths change, requests leave
// and their blocks are reused.
TEST(EnginePoolsCuda, BlockSparseCapturedStepReplayedAsLengthsChange) {
  SKIP_WITHOUT_CUDA();
  for (const bool fp8 : {false, true}) {
    GraphRunner graph;
    testing::BlockPoolsRun run;
    run.fp8_keys = fp8;
    run.runner = [&graph](const std::function<LayerStep(void*)>& step) { return graph(step); };
    expect_block_coverage(testing::check_block_sparse_engine_pools(Device::kCuda, run), false);
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
