// Continuous batching on the GPU: ragged batches whose requests join and
// leave at random, each live request checked every step against a lone run
// of itself (tests/support/continuous_batching.h) — eagerly, and with one
// step captured in a CUDA graph and replayed for every later step while
// requests come and go between replays.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "cuda/cuda_test_util.h"
#include "cuda/graph_runner.h"
#include "support/continuous_batching.h"

namespace sparsepage {
namespace {

// Under the sanitizers (testing::quick_mode()) a run takes 40 steps instead
// of 100: the same kernels and the same joins and leaves, fewer of them, so
// the coverage asked for is smaller too.
void expect_coverage(const testing::ContinuousBatchingStats& s, int64_t sparse_len) {
  const bool full = !testing::quick_mode();
  EXPECT_GE(s.compared_rows, full ? 150 : 40);
  EXPECT_GE(s.admitted, full ? 6 : 2);
  EXPECT_GE(s.released, full ? 2 : 1);
  if (full) {
    EXPECT_GT(s.longest, sparse_len) << "some sequence must reach its sparse regime";
  }
  EXPECT_GT(s.fused_steps, 0);
}

testing::ContinuousBatchingRun cuda_run(uint64_t seed) {
  testing::ContinuousBatchingRun run;
  run.seed = seed;
  run.steps = testing::quick_mode() ? 40 : 100;
  return run;
}

TEST(ContinuousBatchingCuda, BlockSparseMatchesLoneRuns) {
  SKIP_WITHOUT_CUDA();
  expect_coverage(testing::check_block_sparse_continuous_batching(Device::kCuda, cuda_run(21)), 2 * 4 * 16);
}

TEST(ContinuousBatchingCuda, DsaMatchesLoneRuns) {
  SKIP_WITHOUT_CUDA();
  expect_coverage(testing::check_dsa_continuous_batching(Device::kCuda, cuda_run(22)), 48);
}

TEST(ContinuousBatchingCuda, StaticPatternMatchesLoneRuns) {
  SKIP_WITHOUT_CUDA();
  expect_coverage(testing::check_static_continuous_batching(Device::kCuda, cuda_run(23)), 3 * 16);
}

// One graph, replayed while the batch changes under it.
TEST(ContinuousBatchingCuda, OneGraphServesAChangingBatch) {
  SKIP_WITHOUT_CUDA();
  for (int model = 0; model < 3; ++model) {
    testing::GraphRunner runner;
    testing::ContinuousBatchingRun run = cuda_run(31 + model);
    run.bad_call = 0;         // the eager tests cover refused calls
    run.always_fused = true;  // one plan for the graph: every step fuses
    run.runner = [&](const std::function<LayerStep(void*)>& step) { return runner(step); };
    const auto stats = model == 0   ? testing::check_block_sparse_continuous_batching(Device::kCuda, run)
                       : model == 1 ? testing::check_dsa_continuous_batching(Device::kCuda, run)
                                    : testing::check_static_continuous_batching(Device::kCuda, run);
    EXPECT_GE(runner.replays(), run.steps - 2) << "model " << model << ": every step after the second is a replay";
    EXPECT_GE(stats.admitted, testing::quick_mode() ? 2 : 6) << "model " << model;
    EXPECT_GE(stats.released, testing::quick_mode() ? 1 : 2) << "model " << model;
  }
}

}  // namespace
}  // namespace sparsepage

namespace sparsepage {
namespace {

// The GPU soak: each layer for SPARSEPAGE_SOAK_STEPS steps (default 300;
// scripts/gpu_check.sh's soak stage asks for thousands), or, with
// SPARSEPAGE_SOAK_SECONDS set, for a third of that many seconds each (the
// stage's timed form, sized for one device call), requests joining and
// leaving often, refused calls mixed in, every live request checked against
// its lone run at every step. Each layer prints what it covered.
TEST(ContinuousBatchingCuda, Soak) {
  SKIP_WITHOUT_CUDA();
  testing::ContinuousBatchingRun run;
  run.steps = 300;
  if (const char* s = std::getenv("SPARSEPAGE_SOAK_STEPS")) run.steps = std::max(300, std::atoi(s));
  double seconds = 0.0;
  if (const char* s = std::getenv("SPARSEPAGE_SOAK_SECONDS")) seconds = std::atof(s);
  if (seconds > 0.0) {
    run.seconds = seconds / 3.0;  // each layer its share
    run.steps = 2000;             // a request's longest decode; the capacity reserved for it
  }
  run.max_prompt = 150;
  run.leave = 0.03;
  run.join = 0.5;
  run.bad_call = 0.1;
  int64_t model = 0;
  const char* names[] = {"block-sparse", "DSA", "static"};
  for (auto check : {testing::check_block_sparse_continuous_batching, testing::check_dsa_continuous_batching,
                     testing::check_static_continuous_batching}) {
    run.seed = 200 + static_cast<uint64_t>(model);
    const auto s = check(Device::kCuda, run);
    std::printf("soak %s: %lld steps in %.1f s, %lld requests admitted, %lld released, %lld refused calls, %lld checks "
                "passed (%lld outputs and selections against lone runs, %lld refusals), longest %lld tokens\n",
                names[model], static_cast<long long>(s.steps), s.seconds, static_cast<long long>(s.admitted),
                static_cast<long long>(s.released), static_cast<long long>(s.refused_calls),
                static_cast<long long>(s.compared_rows + s.refused_calls), static_cast<long long>(s.compared_rows),
                static_cast<long long>(s.refused_calls), static_cast<long long>(s.longest));
    std::fflush(stdout);
    ++model;
    if (seconds > 0.0) {
      EXPECT_GE(s.seconds, run.seconds) << "model " << model << ": the run stopped before its time";
      EXPECT_GE(s.steps, 300) << "model " << model;
    } else {
      EXPECT_EQ(s.steps, run.steps) << "model " << model;
    }
    EXPECT_GE(s.compared_rows, 2 * s.steps) << "model " << model;
    EXPECT_GE(s.admitted, 15) << "model " << model;
  }
}

}  // namespace
}  // namespace sparsepage
