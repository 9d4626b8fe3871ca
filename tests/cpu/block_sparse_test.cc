#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "sparsepage/models/block_sparse.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

TEST(BlockSparse, SetEqualityWithTheMaskPath) { testing::check_block_sparse_set_equality(Device::kCpu); }

TEST(BlockSparse, GreedyDecodeEquality) { testing::check_block_sparse_greedy_equality(Device::kCpu, 1); }

TEST(BlockSparse, GreedyDecodeEqualityAtBatch3) { testing::check_block_sparse_greedy_equality(Device::kCpu, 3); }

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

// Below the sparse regime decode attends the whole window: its output is
// the fp64 attention over every cached token.
TEST(BlockSparse, BelowTheSparseRegimeAttendsEverything) {
  const BlockSparseConfig config{8, 2, 64, 16, 4, 1, 64};
  EXPECT_FALSE(config.sparse_regime(128));
  EXPECT_TRUE(config.sparse_regime(129));
  std::mt19937_64 rng(77);
  DispatchConfig fuse = DispatchConfig::defaults();
  fuse.min_kv_tokens = fuse.min_kv_tokens_per_request = 0;
  BlockSparseAttention layer(Device::kCpu, DType::kBF16, config, 1, fuse);
  std::vector<uint8_t> q, o(8 * 64 * 2);
  for (int t = 0; t < 100; ++t) {
    q = testing::random_values(DType::kBF16, 8 * 64, rng);
    const auto iq = testing::random_values(DType::kBF16, 2 * 64, rng);
    const auto k = testing::random_values(DType::kBF16, 3 * 64, rng);
    const auto v = testing::random_values(DType::kBF16, 2 * 64, rng);
    const BlockSparseTokens tok{q.data(), iq.data(), k.data(), v.data(), o.data()};
    if (t < 99) {
      layer.prefill_token(tok);
    } else {
      EXPECT_FALSE(layer.decode(tok).sparse);
    }
  }
  const auto keys = testing::cache_window(layer.cache(), true);   // [1, 3, 100, 64]
  const auto vals = testing::cache_window(layer.cache(), false);  // [1, 2, 100, 64]
  const auto qf = testing::as_float(DType::kBF16, q);
  std::vector<double> ref;
  for (int h = 0; h < 8; ++h) {
    const int kv = h / 4;
    std::vector<double> w(100);
    double mx = -INFINITY, sum = 0;
    for (int t = 0; t < 100; ++t) {
      double dot = 0;
      for (int d = 0; d < 64; ++d) dot += double(qf[size_t(h * 64 + d)]) * keys[size_t((kv * 100 + t) * 64 + d)];
      w[size_t(t)] = dot / 8.0;
      mx = std::max(mx, w[size_t(t)]);
    }
    std::vector<double> out(64, 0.0);
    for (int t = 0; t < 100; ++t) {
      const double p = std::exp(w[size_t(t)] - mx);
      sum += p;
      for (int d = 0; d < 64; ++d) out[size_t(d)] += p * vals[size_t((kv * 100 + t) * 64 + d)];
    }
    for (double x : out) ref.push_back(x / sum);
  }
  EXPECT_LT(testing::relative_l2(testing::as_float(DType::kBF16, o), ref), 1e-2);
}

}  // namespace
}  // namespace sparsepage
