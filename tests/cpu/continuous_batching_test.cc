// Continuous batching on the CPU backend: ragged batches whose requests
// join and leave at random, each live request checked against a lone run of
// itself every step (tests/support/continuous_batching.h).
#include <gtest/gtest.h>

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
