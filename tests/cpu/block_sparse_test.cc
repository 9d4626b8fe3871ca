#include <gtest/gtest.h>

#include <random>

#include "sparsepage/models/block_sparse.h"
#include "support/layer_checks.h"

namespace sparsepage {
namespace {

TEST(BlockSparse, SetEqualityWithTheMaskPath) { testing::check_block_sparse_set_equality(Device::kCpu); }

TEST(BlockSparse, GreedyDecodeEquality) { testing::check_block_sparse_greedy_equality(Device::kCpu); }

TEST(BlockSparse, IndexerRuleOnAHandMadeCase) {
  // One sequence, one KV head, blocks of 2, top 1 over 3 scored blocks + final.
  const BlockSparseConfig config{1, 1, 2, 2, 1, 1, 8};
  const float q[] = {1.0f, 0.0f};
  // kv_len 7: blocks {0,1} {2,3} {4,5} {6}; block 1 holds the best single token.
  const std::vector<float> keys = {0.5f, 0, 0.5f, 0, -1, 0, 3.0f, 0, 1, 0, 1, 0, 100, 0};
  EXPECT_EQ(select_top_blocks_cpu(config, 1, 7, q, keys), (std::vector<int32_t>{1, 3}))
      << "max-pooling picks block 1; the final block 3 is appended, never scored (its 100 is ignored)";
  BlockSparseConfig local = config;
  local.local_blocks = 2;
  EXPECT_EQ(select_top_blocks_cpu(local, 1, 7, q, keys), (std::vector<int32_t>{2, 3}))
      << "local_blocks = 2 force-keeps block 2";
}

TEST(BlockSparse, BelowTheSparseRegimeAttendsEverything) {
  const BlockSparseConfig config{8, 2, 32, 16, 4, 1, 64};
  EXPECT_FALSE(config.sparse_regime(128));
  EXPECT_TRUE(config.sparse_regime(129));
}

}  // namespace
}  // namespace sparsepage
