// Continuous batching on the CPU backend: ragged batches whose requests
// join and leave at random, each live request checked against a lone run of
// itself every step (tests/support/continuous_batching.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include "support/continuous_batching.h"

namespace sparsepage {
namespace {

void expect_coverage(const testing::ContinuousBatchingStats& s, int64_t sparse_len) {
  EXPECT_GE(s.compared_rows, 300) << "the run must compare many (step, request) outputs";
  EXPECT_GE(s.admitted, 10) << "requests must join";
  EXPECT_GE(s.released, 5) << "requests must leave (and slots be reused)";
  EXPECT_GT(s.longest, sparse_len) << "some sequence must reach its sparse regime";
  EXPECT_GT(s.fused_steps, 0);
  EXPECT_GT(s.refused_calls, 0);
}

TEST(ContinuousBatching, BlockSparseMatchesLoneRuns) {
  testing::ContinuousBatchingRun run;
  run.seed = 11;
  expect_coverage(testing::check_block_sparse_continuous_batching(Device::kCpu, run), 2 * 4 * 16);
}

TEST(ContinuousBatching, DsaMatchesLoneRuns) {
  testing::ContinuousBatchingRun run;
  run.seed = 12;
  expect_coverage(testing::check_dsa_continuous_batching(Device::kCpu, run), 48);
}

TEST(ContinuousBatching, StaticPatternMatchesLoneRuns) {
  testing::ContinuousBatchingRun run;
  run.seed = 13;
  expect_coverage(testing::check_static_continuous_batching(Device::kCpu, run), 3 * 16);
}

}  // namespace
}  // namespace sparsepage

namespace sparsepage {
namespace {

// The soak: a thousand steps of each layer, requests joining and leaving
// often (so slots are reused many times), a refused call tried at one step
// in ten, every live request checked against its lone run at every step.
// SPARSEPAGE_SOAK_STEPS lengthens it (scripts/gpu_check.sh's soak stage
// runs the GPU twin for minutes).
TEST(ContinuousBatching, SoakAllThreeLayers) {
  testing::ContinuousBatchingRun run;
  run.steps = 1000;
  if (const char* s = std::getenv("SPARSEPAGE_SOAK_STEPS")) run.steps = std::max(1000, std::atoi(s));
  run.max_prompt = 150;
  run.leave = 0.03;
  run.join = 0.5;
  run.bad_call = 0.1;
  int64_t model = 0;
  for (auto check : {testing::check_block_sparse_continuous_batching, testing::check_dsa_continuous_batching,
                     testing::check_static_continuous_batching}) {
    run.seed = 100 + static_cast<uint64_t>(model++);
    const auto s = check(Device::kCpu, run);
    EXPECT_GE(s.compared_rows, 2 * run.steps) << "model " << model;
    EXPECT_GE(s.admitted, 50) << "model " << model << ": slots must be reused many times";
    EXPECT_GE(s.released, 40) << "model " << model;
    EXPECT_GE(s.refused_calls, 150) << "model " << model;
    EXPECT_EQ(s.steps, run.steps) << "model " << model;
  }
}

// The timed form the GPU soak uses (SPARSEPAGE_SOAK_SECONDS): it steps until
// its time is up, and a request leaves at `steps` decode tokens, so no
// sequence outgrows the capacity reserved up front however long it runs.
TEST(ContinuousBatching, ATimedRunLastsItsTimeAndCapsEachRequest) {
  testing::ContinuousBatchingRun run;
  run.seconds = 1.0;
  run.steps = 20;  // the cap on a request's decode tokens
  run.max_prompt = 30;
  run.leave = 0.0;  // only the cap ends a request
  run.join = 1.0;
  run.seed = 14;
  const auto s = testing::check_static_continuous_batching(Device::kCpu, run);
  EXPECT_GE(s.seconds, 1.0);
  EXPECT_GT(s.steps, 2 * run.steps) << "enough steps that requests reach the cap";
  EXPECT_GE(s.compared_rows, s.steps);
  EXPECT_GE(s.released, 4) << "requests at the cap must leave";
  EXPECT_LE(s.longest, run.max_prompt + run.steps + 1) << "a request outgrew the cap";
}

}  // namespace
}  // namespace sparsepage
