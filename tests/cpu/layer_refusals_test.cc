// Between steps, the layers' slot and length calls: bad arguments are
// refused under the layer's name (layer.h: every error of the layer starts
// with it), naming the argument, and change nothing; and a call that grows
// the cache leaves the last step's selection readable as it was. Both were
// found by the fuzzer's layer step sequences (tests/fuzz): the cache's own
// messages came back unprefixed, and the static layer's selection matrix
// was reallocated, unfilled, when the cache grew, so last_blocks() and
// last_selected_positions() read garbage (or threw std::out_of_range).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"
#include "support/expect_error.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

std::vector<std::unique_ptr<SparseLayer>> small_layers(int32_t batch) {
  std::vector<std::unique_ptr<SparseLayer>> layers;
  layers.push_back(std::make_unique<BlockSparseAttention>(Device::kCpu, DType::kBF16,
                                                          BlockSparseConfig{4, 2, 16, 4, 2, 1, 8}, batch));
  DsaConfig dsa;
  dsa.num_qo_heads = 2;
  dsa.latent_dim = 16;
  dsa.rope_dim = 8;
  dsa.index_heads = 2;
  dsa.index_head_dim = 16;
  dsa.index_topk = 4;
  dsa.capacity_step = 8;
  layers.push_back(std::make_unique<DsaAttention>(Device::kCpu, DType::kBF16, dsa, batch));
  layers.push_back(std::make_unique<StaticBlockSparseAttention>(Device::kCpu, DType::kBF16,
                                                                StaticBlockSparseConfig{4, 2, 8, 2, 1, 2, 8}, batch));
  return layers;
}

TEST(LayerRefusals, SlotAndLengthCallsAreRefusedUnderTheLayersName) {
  std::mt19937_64 rng(5);
  for (const auto& layer : small_layers(2)) {
    const std::string name = layer->name();
    const DenseKVCache& c = layer->cache();
    const auto k = testing::random_values(DType::kBF16, size_t(c.k_heads()) * 3 * c.k_head_dim(), rng);
    const auto v = testing::random_values(DType::kBF16, size_t(c.v_heads()) * 3 * c.v_head_dim(), rng);
    layer->admit(1, k.data(), v.data(), 3);
    const std::vector<int64_t> lens = layer->kv_lens();
    const int64_t capacity = c.capacity();
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->admit(2, k.data(), v.data(), 1); }, name + "::admit: "));
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->admit(-1, k.data(), v.data(), 1); }, "slot = -1"));
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->admit(0, k.data(), v.data(), -1); }, name + "::admit: "));
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->admit(0, k.data(), v.data(), int64_t{1} << 31); },
                                             "tokens = 2147483648"));
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->release(2); }, name + "::release: "));
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->release(std::numeric_limits<int32_t>::min()); }, "slot"));
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->reserve(-1); }, name + "::reserve: "));
    EXPECT_TRUE(testing::throws_error_naming([&] { layer->append_tokens(k.data(), v.data(), -1); },
                                             name + "::append_tokens: "));
    EXPECT_TRUE(testing::throws_error_naming(
        [&] { layer->append_tokens(k.data(), v.data(), std::numeric_limits<int64_t>::max()); }, "2^31 - 1"));
    EXPECT_EQ(layer->kv_lens(), lens) << name << ": a refused call changed the lengths";
    EXPECT_EQ(layer->cache().active(), (std::vector<uint8_t>{1, 1})) << name;
    EXPECT_EQ(layer->cache().capacity(), capacity) << name << ": a refused call grew the cache";
  }
}

TEST(LayerRefusals, StaticSelectionSurvivesTheCacheGrowing) {
  const StaticBlockSparseConfig config{4, 2, 8, 2, 1, 2, 4};  // capacity grows 4 at a time
  StaticBlockSparseAttention layer(Device::kCpu, DType::kBF16, config, 2);
  std::mt19937_64 rng(8);
  const size_t kv = size_t(config.num_kv_heads) * config.head_dim, qo = size_t(config.num_qo_heads) * config.head_dim;
  const auto prompt = testing::random_values(DType::kBF16, 2 * kv * 6, rng);
  layer.append_tokens(prompt.data(), prompt.data(), 6);
  const auto q = testing::random_values(DType::kBF16, 2 * qo, rng);
  const auto k = testing::random_values(DType::kBF16, 2 * kv, rng),
             v = testing::random_values(DType::kBF16, 2 * kv, rng);
  std::vector<uint8_t> o(2 * qo * 2);
  layer.decode(StaticBlockSparseTokens{q.data(), k.data(), v.data(), o.data()});
  const auto blocks = layer.last_blocks();
  const auto positions = layer.last_selected_positions();
  const int32_t width = layer.width();
  ASSERT_EQ(positions.size(), 2u * config.num_qo_heads);
  for (const auto& row : positions) ASSERT_FALSE(row.empty());
  layer.reserve(64);  // grows the cache, so the page matrix widens
  ASSERT_GT(layer.width(), width) << "the test needs the selection matrix to widen";
  EXPECT_EQ(layer.last_blocks(), blocks) << "the last step's blocks changed when the cache grew";
  EXPECT_EQ(layer.last_selected_positions(), positions) << "the last step's positions changed when the cache grew";
  const auto row = testing::random_values(DType::kBF16, kv * 100, rng);
  layer.release(1);
  layer.admit(1, row.data(), row.data(), 100);  // grows again
  EXPECT_EQ(layer.last_selected_positions(), positions);
}

// admit() over a slot that still holds a request would drop that request's
// rows without a word: it is refused by name and changes nothing; an
// active slot of length 0 (a fresh layer's) and a released one take it.
TEST(LayerRefusals, AdmitOverARunningRequestIsRefused) {
  const StaticBlockSparseConfig config{4, 2, 8, 2, 1, 2, 4};
  StaticBlockSparseAttention layer(Device::kCpu, DType::kBF16, config, 3);
  std::mt19937_64 rng(9);
  const size_t kv = size_t(config.num_kv_heads) * config.head_dim;
  const auto rows = testing::random_values(DType::kBF16, kv * 20, rng);
  layer.admit(0, rows.data(), rows.data(), 5);  // a fresh slot: active, empty
  layer.admit(1, rows.data(), rows.data(), 7);
  EXPECT_TRUE(testing::throws_error_naming([&] { layer.admit(1, rows.data(), rows.data(), 3); },
                                           "slot 1 holds a running request of 7 tokens; release it first"));
  EXPECT_EQ(layer.kv_lens(), (std::vector<int64_t>{5, 7, 0}));
  layer.release(1);
  layer.admit(1, rows.data(), rows.data(), 3);
  EXPECT_EQ(layer.kv_lens(), (std::vector<int64_t>{5, 3, 0}));
}

}  // namespace
}  // namespace sparsepage
