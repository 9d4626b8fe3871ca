// Between steps, the layers' slot and length calls: bad arguments are
// refused under the layer's name (layer.h: every error of the layer starts
// with it), naming the argument, and change nothing. Found by the fuzzer's
// layer step sequences (tests/fuzz): the cache's own messages came back
// unprefixed.
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

}  // namespace
}  // namespace sparsepage
