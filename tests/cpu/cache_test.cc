#include <gtest/gtest.h>

#include <random>

#include "sparsepage/cache.h"
#include "support/paged_block_pool.h"
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
    cache.append(ks.back().data(), vs.back().data(), DType::kBF16, n);
    EXPECT_EQ(cache.capacity() % 16, 0);
    EXPECT_GE(cache.capacity(), cache.live_len());
  }
  EXPECT_EQ(cache.live_len(), 37);
  EXPECT_EQ(cache.capacity(), 48);
  // Token t of (b, h) came from the update that covered t.
  const auto window = testing::cache_window(cache, true);
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
  // The rows as the kernels read them: [B, H, Cap, D] with the capacity as
  // the head stride, and K's extra head in its own sequence stride.
  const auto k = cache.k_rows(), v = cache.v_rows();
  ASSERT_TRUE(k.has_value() && v.has_value());
  EXPECT_EQ(k->dim, 8);
  EXPECT_EQ(k->row_stride, 8);
  EXPECT_EQ(k->head_stride, 48 * 8);
  EXPECT_EQ(k->seq_stride, 3 * 48 * 8);
  EXPECT_EQ(v->head_stride, 48 * 4);
  EXPECT_EQ(v->seq_stride, 2 * 48 * 4);
  EXPECT_EQ(cache.dtype(), DType::kBF16);
  // Row t of (b, h) through the view holds what the window says.
  const auto* rows = static_cast<const uint16_t*>(k->data);
  for (int b = 0; b < 2; ++b) {
    for (int h = 0; h < 3; ++h) {
      for (int64_t t = 0; t < 37; t += 6) {
        ASSERT_EQ(bf16_to_float(rows[k->offset(b, h, t) + 5]), window[size_t(((b * 3 + h) * 37 + t) * 8 + 5)]);
      }
    }
  }
}

TEST(DenseCache, RowsOnceAllocated) {
  DenseKVCache raw(Device::kCpu, CacheMode::kF16, 1, 2, 2, 8, 8);
  EXPECT_FALSE(raw.k_rows().has_value()) << "nothing is allocated before the first append";
  std::vector<uint16_t> kv(2 * 3 * 8, float_to_f16(0.5f));
  raw.append(kv.data(), kv.data(), DType::kF16, 3);
  ASSERT_TRUE(raw.k_rows().has_value());
  EXPECT_EQ(raw.dtype(), DType::kF16);
}

TEST(DenseCache, RejectsBadInput) {
  EXPECT_THROW(DenseKVCache(Device::kCpu, CacheMode::kBF16, 0, 1, 1, 8, 8), Error);
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 1, 1, 1, 8, 8);
  std::vector<uint16_t> kv(8);
  EXPECT_THROW(cache.append(kv.data(), kv.data(), DType::kF16, 1), Error);
  EXPECT_THROW(cache.append(nullptr, kv.data(), DType::kBF16, 1), Error);
  EXPECT_THROW(cache.append(kv.data(), kv.data(), DType::kBF16, -1), Error);
}

TEST(Layout, DenseRowsUseCapacityAsHeadStride) {
  const RowView rows = RowView::dense(nullptr, 4, 1000, 128);
  EXPECT_EQ(rows.offset(0, 0, 0), 0);
  EXPECT_EQ(rows.offset(0, 1, 0), 1000 * 128);
  EXPECT_EQ(rows.offset(1, 2, 7), ((1 * 4 + 2) * 1000 + 7) * 128);
  const RowView wide = RowView::dense(nullptr, 1, 10, 512, 576);  // the first 512 columns of 576-wide rows
  EXPECT_EQ(wide.offset(0, 0, 3), 3 * 576);
  EXPECT_EQ(wide.dim, 512);
}

TEST(Layout, RowViewProblemNamesOverlappingRows) {
  const int x = 0;
  const RowView dense = RowView::dense(&x, 4, 1000, 128);
  EXPECT_EQ(row_view_problem(dense, "k", 2, 4, 1000, 2), "");
  // More positions than the capacity: refused by the capacity, and without
  // one by the strides (head h's rows would run into head h + 1's).
  EXPECT_EQ(row_view_problem(dense, "k", 2, 4, 1001, 2), "k: 1001 rows per head exceed k.capacity = 1000");
  RowView unknown = dense;
  unknown.capacity = RowView::kUnknownCapacity;
  const std::string long_window = row_view_problem(unknown, "k", 2, 4, 1001, 2);
  EXPECT_NE(long_window.find("k.head_stride"), std::string::npos) << long_window;
  EXPECT_NE(long_window.find("heads would overlap"), std::string::npos) << long_window;
  // More heads than the allocation: sequence b's heads run into b + 1's.
  const std::string many_heads = row_view_problem(dense, "v", 2, 5, 10, 2);
  EXPECT_NE(many_heads.find("v.seq_stride"), std::string::npos) << many_heads;
  // An engine's paged layout [blocks, block_size, heads, dim] interleaves heads: fine.
  const RowView paged{&x, 4 * 128, 128, 0, 128};
  EXPECT_EQ(row_view_problem(paged, "k", 1, 4, 1 << 20, 2), "");
  EXPECT_NE(row_view_problem({&x, 4 * 128, 128, 0, 64}, "k", 1, 4, 8, 2).find("heads would overlap"),
            std::string::npos);
  EXPECT_NE(row_view_problem({&x, 64, 128, 0, 0}, "k", 1, 1, 8, 2).find("row_stride"), std::string::npos);
  EXPECT_NE(row_view_problem({nullptr, 128, 128, 0, 0}, "q", 1, 1, 8, 2).find("q.data is null"), std::string::npos);
  EXPECT_NE(row_view_problem({&x, 1 << 30, 128, 0, 0}, "k", 1, 1, int64_t{1} << 33, 2).find("2^62"), std::string::npos);
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
  EXPECT_EQ(page_table_problem(table, &indices, pool.num_pages()), "");
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

// Continuous batching at the cache: slots join with their own prompts,
// leave, and the step appends land at each slot's own length, skipping free
// slots; a slot reused after release starts from its new prompt.
TEST(DenseCache, SlotsJoinLeaveAndGrowAtTheirOwnLengths) {
  std::mt19937_64 rng(7);
  const int B = 3, H = 2, D = 4;
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, B, H, H, D, D, 8);
  // Expected rows per slot and head, as bf16 bit patterns.
  std::vector<std::vector<std::vector<uint16_t>>> expect(B, std::vector<std::vector<uint16_t>>(H));
  auto prompt = [&](int slot, int64_t n) {
    const auto k = testing::random_values(DType::kBF16, size_t(H * n * D), rng);
    const auto v = testing::random_values(DType::kBF16, size_t(H * n * D), rng);
    cache.admit(slot, k.data(), v.data(), n);
    const auto* kb = reinterpret_cast<const uint16_t*>(k.data());
    for (int h = 0; h < H; ++h) expect[slot][h].assign(kb + h * n * D, kb + (h + 1) * n * D);
  };
  auto step = [&] {
    const auto k = testing::random_values(DType::kBF16, size_t(B * H * D), rng);
    const auto v = testing::random_values(DType::kBF16, size_t(B * H * D), rng);
    cache.reserve(cache.live_len() + 1);
    cache.append_token(k.data(), v.data());
    const auto* kb = reinterpret_cast<const uint16_t*>(k.data());
    for (int b = 0; b < B; ++b) {
      if (!cache.active()[b]) continue;
      for (int h = 0; h < H; ++h)
        expect[b][h].insert(expect[b][h].end(), kb + (b * H + h) * D, kb + (b * H + h + 1) * D);
    }
  };
  prompt(0, 5);
  prompt(1, 19);  // grows the capacity past 8 while slot 0 holds rows
  cache.release(2);
  EXPECT_EQ(cache.live_lens(), (std::vector<int64_t>{5, 19, 0}));
  EXPECT_EQ(cache.live_len(), 19);
  for (int i = 0; i < 3; ++i) step();
  EXPECT_EQ(cache.live_lens(), (std::vector<int64_t>{8, 22, 0})) << "a free slot does not grow";
  cache.release(0);
  prompt(2, 2);
  step();
  prompt(0, 1);  // slot 0 reused: its new prompt, not its old rows
  step();
  EXPECT_EQ(cache.live_lens(), (std::vector<int64_t>{2, 24, 4}));
  const auto device_lens = download<int32_t>(Device::kCpu, cache.device_live_lens(), B);
  EXPECT_EQ(device_lens, (std::vector<int32_t>{2, 24, 4}));
  const auto rows = cache.k_rows().value();
  const auto* data = static_cast<const uint16_t*>(rows.data);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      ASSERT_EQ(int64_t(expect[b][h].size()), cache.live_lens()[b] * D);
      for (int64_t t = 0; t < cache.live_lens()[b]; ++t) {
        for (int d = 0; d < D; ++d) {
          ASSERT_EQ(data[rows.offset(b, h, t) + d], expect[b][h][size_t(t * D + d)]) << b << " " << h << " " << t;
        }
      }
    }
  }
  // The bulk append writes each active slot at its own length.
  const auto k = testing::random_values(DType::kBF16, size_t(B * H * 2 * D), rng);
  cache.append(k.data(), k.data(), DType::kBF16, 2);
  EXPECT_EQ(cache.live_lens(), (std::vector<int64_t>{4, 26, 6}));
  const auto* kb = reinterpret_cast<const uint16_t*>(k.data());
  const auto grown = cache.k_rows().value();  // 26 rows took the capacity past 24
  EXPECT_EQ(grown.head_stride, 32 * D);
  for (int b = 0; b < B; ++b) {
    const auto* now = static_cast<const uint16_t*>(grown.data);
    EXPECT_EQ(now[grown.offset(b, 1, cache.live_lens()[b] - 1) + 3], kb[((b * H + 1) * 2 + 1) * D + 3]);
    EXPECT_EQ(now[grown.offset(b, 0, 0)], expect[b][0][0]) << "rows before the append survive the growth";
  }
  EXPECT_THROW(cache.admit(3, k.data(), k.data(), 1), Error);
  EXPECT_THROW(cache.release(-1), Error);
}

}  // namespace
}  // namespace sparsepage
