#include <gtest/gtest.h>

#include <random>

#include "sparsepage/cache.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

TEST(DenseCache, GrowsInStepsAndKeepsRows) {
  std::mt19937_64 rng(31);
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 2, 3, 2, 8, 4, 16);
  std::vector<float> k_all, v_all;  // expected [B, H, L, D] after all updates
  const int64_t steps[] = {5, 11, 1, 20};
  std::vector<std::vector<uint8_t>> ks, vs;
  for (int64_t n : steps) {
    ks.push_back(testing::random_values(DType::kBF16, size_t(2 * 3 * n * 8), rng));
    vs.push_back(testing::random_values(DType::kBF16, size_t(2 * 2 * n * 4), rng));
    const CacheWindow w = cache.update_and_fetch(ks.back().data(), vs.back().data(), DType::kBF16, n);
    EXPECT_EQ(w.live_len, cache.live_len());
    EXPECT_EQ(w.k_shape.capacity % 16, 0);
    EXPECT_GE(w.k_shape.capacity, w.live_len);
  }
  EXPECT_EQ(cache.live_len(), 37);
  EXPECT_EQ(cache.capacity(), 48);
  // Token t of (b, h) came from the update that covered t.
  const auto window = cache.dequantized_window(true);
  int64_t start = 0;
  for (size_t u = 0; u < ks.size(); ++u) {
    const auto src = testing::as_float(DType::kBF16, ks[u]);
    for (int b = 0; b < 2; ++b) {
      for (int h = 0; h < 3; ++h) {
        for (int64_t t = 0; t < steps[u]; ++t) {
          for (int d = 0; d < 8; ++d) {
            ASSERT_EQ(window[size_t(((b * 3 + h) * 37 + start + t) * 8 + d)],
                      src[size_t(((b * 3 + h) * steps[u] + t) * 8 + d)]);
          }
        }
      }
    }
    start += steps[u];
  }
  const auto raw = cache.raw_kv_allocations();
  ASSERT_TRUE(raw.has_value());
  EXPECT_EQ(raw->k_shape, (CacheShape{2, 3, 48, 8}));
  EXPECT_EQ(raw->v_shape, (CacheShape{2, 2, 48, 4}));
  EXPECT_EQ(raw->live_len, 37);
}

TEST(DenseCache, RawAllocationsOnlyForRawRows) {
  DenseKVCache raw(Device::kCpu, CacheMode::kF16, 1, 2, 2, 8, 8);
  std::vector<uint16_t> kv(2 * 3 * 8, float_to_f16(0.5f));
  raw.update_and_fetch(kv.data(), kv.data(), DType::kF16, 3);
  ASSERT_TRUE(raw.raw_kv_allocations().has_value());
  EXPECT_EQ(raw.raw_kv_allocations()->dtype, DType::kF16);
  const DenseKVCache trimmed = raw.head_trimmed(1);
  EXPECT_FALSE(trimmed.raw_kv_allocations().has_value()) << "a head-trimmed window is not the allocation";
  EXPECT_EQ(trimmed.dequantized_window(true).size(), 3u * 8u);
  EXPECT_THROW(raw.head_trimmed(3), Error);
  for (CacheMode mode : {CacheMode::kInt8, CacheMode::kInt4}) {
    DenseKVCache q(Device::kCpu, mode, 1, 2, 2, 8, 8);
    std::vector<float> x(2 * 3 * 8, 0.25f);
    q.update_and_fetch(x.data(), x.data(), DType::kF32, 3);
    EXPECT_FALSE(q.raw_kv_allocations().has_value()) << cache_mode_name(mode);
  }
  PagedBlockPool pool(Device::kCpu, DType::kBF16, 4, 1, 16, 8, 8);
  EXPECT_FALSE(pool.raw_kv_allocations().has_value());
}

TEST(DenseCache, RejectsBadInput) {
  EXPECT_THROW(DenseKVCache(Device::kCpu, CacheMode::kBF16, 0, 1, 1, 8, 8), Error);
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 1, 1, 1, 8, 8);
  std::vector<uint16_t> kv(8);
  EXPECT_THROW(cache.update_and_fetch(kv.data(), kv.data(), DType::kF16, 1), Error);
  EXPECT_THROW(cache.update_and_fetch(nullptr, kv.data(), DType::kBF16, 1), Error);
  EXPECT_THROW(cache.update_and_fetch(kv.data(), kv.data(), DType::kBF16, -1), Error);
}

TEST(Layout, RowsUseCapacityAsHeadStride) {
  const auto layout = ContiguousCacheLayout::of(CacheShape{2, 4, 1000, 128});
  EXPECT_EQ(layout.row(0, 0, 0), 0);
  EXPECT_EQ(layout.row(0, 1, 0), 1000);
  EXPECT_EQ(layout.row(1, 2, 7), (1 * 4 + 2) * 1000 + 7);
  EXPECT_EQ(layout.num_rows(), 8000);
}

TEST(Layout, HeadFoldingReshapesQueries) {
  const HeadFolding f = HeadFolding::make(3, 64, 4);
  EXPECT_EQ(f.group_size(), 16);
  EXPECT_EQ(f.num_requests(), 12);
  EXPECT_EQ(f.request(2, 3), 11);
  EXPECT_THROW(HeadFolding::make(1, 64, 5), Error);
  EXPECT_THROW(HeadFolding::make(1, 0, 1), Error);
}

TEST(PagedPool, BlockTablesAndBlockGranularPages) {
  std::mt19937_64 rng(32);
  PagedBlockPool pool(Device::kCpu, DType::kBF16, 8, 2, 4, 8, 8);
  const int32_t a = pool.add_sequence();
  const int32_t b = pool.add_sequence();
  const auto k = testing::random_values(DType::kBF16, 2 * 10 * 8, rng);  // [heads, tokens, D]
  pool.append(a, k.data(), k.data(), 6);
  pool.append(b, k.data(), k.data(), 3);
  // Append the rest of a's 10 tokens in a second call: [heads, 4, D].
  std::vector<uint8_t> rest;
  for (int h = 0; h < 2; ++h) {
    rest.insert(rest.end(), k.begin() + (h * 10 + 6) * 16, k.begin() + (h * 10 + 10) * 16);
  }
  pool.append(a, rest.data(), rest.data(), 4);
  EXPECT_EQ(pool.seq_len(a), 10);
  EXPECT_EQ(pool.block_table(a).size(), 3u);
  EXPECT_EQ(pool.block_table(b).size(), 1u);
  // Token 9 of a, head 1, is at row page(block_table[2], 1) * 4 + 1.
  const int64_t row = int64_t{pool.page(pool.block_table(a)[2], 1)} * 4 + 1;
  const auto* pk = static_cast<const uint16_t*>(pool.k_data());
  const auto* src = reinterpret_cast<const uint16_t*>(k.data());
  for (int d = 0; d < 8; ++d) EXPECT_EQ(pk[row * 8 + d], src[(1 * 10 + 9) * 8 + d]);

  const auto [table, indices] = pool.block_page_table({a, a}, {0, 1}, {{0, 2}, {1}});
  EXPECT_EQ(table.page_size, 4);
  EXPECT_EQ(table.seq_lens, (std::vector<int32_t>{6, 4}));  // full block + 2-token final block; one full block
  EXPECT_EQ(indices, (std::vector<int32_t>{pool.page(pool.block_table(a)[0], 0), pool.page(pool.block_table(a)[2], 0),
                                          pool.page(pool.block_table(a)[1], 1)}));
  EXPECT_FALSE(validate_page_table(table, &indices, pool.num_pages()));
  EXPECT_THROW(pool.block_page_table({a}, {0}, {{2, 0}}), Error) << "partial final block must be last";
  EXPECT_THROW(pool.block_page_table({a}, {0}, {{3}}), Error);
  EXPECT_THROW(pool.block_page_table({a}, {2}, {{0}}), Error);
  std::vector<uint8_t> big(2 * 100 * 16);
  const auto before = pool.block_table(b);
  EXPECT_THROW(pool.append(b, big.data(), big.data(), 100), Error) << "pool exhausted";
  EXPECT_EQ(pool.seq_len(b), 3) << "a failed append changes nothing";
  EXPECT_EQ(pool.block_table(b), before);
  pool.append(b, k.data(), k.data(), 1);  // the free blocks are still there
  EXPECT_EQ(pool.seq_len(b), 4);
}

}  // namespace
}  // namespace sparsepage
