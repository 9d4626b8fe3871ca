#include <gtest/gtest.h>

#include <random>

#include "sparsepage/models/static_block_sparse.h"
#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

// 8 query heads over 2 KV heads, head dim 64, blocks of 16, 2 local blocks,
// vertical stride 4: small enough for the CPU, heterogeneous like Phi-3-small.
const StaticBlockSparseConfig kSmall{8, 2, 64, 16, 2, 4, 64};

TEST(StaticBlockSparse, Phi3SmallGeometryByHand) {
  const StaticBlockSparseConfig c;  // the defaults are Phi-3-small's
  EXPECT_EQ(c.num_qo_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.block_size, 64);
  EXPECT_EQ(c.local_blocks, 16);
  EXPECT_EQ(c.vert_stride, 8);
  EXPECT_EQ(c.head_sliding_step(), 1) << "max(1, 8 / 32)";
  // 32K tokens: 512 blocks, the query in block 511, the local run 496..511.
  // Head 0 keeps j = 7 (mod 8) below it: 7, 15, ..., 495 (62 blocks).
  EXPECT_TRUE(c.keeps(0, 511, 7));
  EXPECT_FALSE(c.keeps(0, 511, 6));
  EXPECT_TRUE(c.keeps(1, 511, 6)) << "head 1 shifts its vertical blocks by one";
  EXPECT_TRUE(c.keeps(3, 511, 4));
  EXPECT_FALSE(c.keeps(3, 511, 7)) << "heads 0 and 3 share KV head 0 but not their vertical blocks";
  EXPECT_TRUE(c.keeps(5, 511, 500)) << "local run";
  EXPECT_FALSE(c.keeps(5, 511, 512)) << "never past the query block";
  for (int32_t h = 0; h < 32; ++h) {
    EXPECT_EQ(c.kept_blocks(h, 32768), 78) << "head " << h;
    EXPECT_EQ(c.kept_tokens(h, 32768), 78 * 64) << "head " << h;
  }
  // A partial final block: 32768 + 10 tokens make block 512 the query's own.
  EXPECT_EQ(c.kept_tokens(0, 32778), 77 * 64 + 10);
  // Wider strides slide by more: vert_stride 64 over 32 heads steps by 2.
  StaticBlockSparseConfig wide = c;
  wide.vert_stride = 64;
  EXPECT_EQ(wide.head_sliding_step(), 2);
  EXPECT_TRUE(wide.keeps(1, 511, 61)) << "(61 + 1 * 2 + 1) % 64 == 0";
}

TEST(StaticBlockSparse, ATinyPatternByHand) {
  // 2 heads, blocks of 2, 1 local block, vertical stride 3 (step max(1, 3 / 2) = 1).
  const StaticBlockSparseConfig c{2, 1, 8, 2, 1, 3, 64};
  // 9 tokens: blocks 0..4, the query in block 4 (one token).
  // Head 0 keeps (j + 1) % 3 == 0 -> block 2, and its own block 4.
  // Head 1 keeps (j + 2) % 3 == 0 -> block 1, and block 4 (vertical and local).
  EXPECT_EQ(c.kept_blocks(0, 9), 2);
  EXPECT_EQ(c.kept_tokens(0, 9), 3);
  EXPECT_EQ(c.kept_blocks(1, 9), 2);
  EXPECT_TRUE(c.keeps(0, 4, 2));
  EXPECT_TRUE(c.keeps(1, 4, 1));
  EXPECT_FALSE(c.keeps(1, 4, 2));
}

// The page lists are enumerated in closed form; the mask scans the rule.
// Over many shapes and lengths both give the same blocks.
TEST(StaticBlockSparse, EnumerationMatchesTheRuleEverywhere) {
  for (int32_t heads : {1, 4, 32, 40}) {
    for (int32_t local : {1, 2, 16}) {
      for (int32_t vert : {1, 3, 8, 64}) {
        const StaticBlockSparseConfig c{heads, 1, 8, 4, local, vert, 64};
        for (int64_t len = 0; len <= 4 * 300; len += 3) {
          const int64_t query_block = len > 0 ? (len - 1) / 4 : -1;
          for (int32_t h = 0; h < heads; ++h) {
            int64_t scanned = 0;
            for (int64_t j = 0; j <= query_block; ++j) scanned += c.keeps(h, query_block, j) ? 1 : 0;
            ASSERT_EQ(c.kept_blocks(h, len), scanned)
                << "heads " << heads << " local " << local << " vert " << vert << " len " << len << " head " << h;
          }
        }
      }
    }
  }
}

TEST(StaticBlockSparse, SetEqualityWithTheMaskPath) {
  // Contexts on and off block boundaries (16), below and above the sparsity gate.
  testing::check_static_set_equality(Device::kCpu, kSmall,
                                     {{1, 1}, {1, 40}, {1, 192}, {2, 193}, {1, 256}, {3, 257}, {2, 400}, {1, 1000}});
}

TEST(StaticBlockSparse, SetEqualityAtPhi3SmallGeometry) {
  testing::check_static_set_equality(Device::kCpu, StaticBlockSparseConfig{}, {{1, 2560}, {2, 2600}});
}

TEST(StaticBlockSparse, MatchesTheFp64ReferenceWithUnusedRowsPoisoned) {
  // Vertical stride 8 over groups of 4: half the blocks below the local run
  // are kept by no head of a KV head, so their rows are NaN.
  StaticBlockSparseConfig sparse = kSmall;
  sparse.vert_stride = 8;
  testing::check_static_against_reference(Device::kCpu, sparse, 2, 401);
  testing::check_static_against_reference(Device::kCpu, StaticBlockSparseConfig{}, 1, 2600);
}

TEST(StaticBlockSparse, GreedyDecodeEquality) { testing::check_static_greedy_equality(Device::kCpu, 1); }

TEST(StaticBlockSparse, GreedyDecodeEqualityAtBatch2) { testing::check_static_greedy_equality(Device::kCpu, 2); }

TEST(StaticBlockSparse, RefusesBadConfigurationsByName) {
  StaticBlockSparseConfig c = kSmall;
  c.vert_stride = 0;
  EXPECT_TRUE(testing::throws_error_naming([&] { StaticBlockSparseAttention(Device::kCpu, DType::kBF16, c, 1); },
                                           "vert_stride 0"));
  c = kSmall;
  c.num_qo_heads = 7;
  EXPECT_TRUE(testing::throws_error_naming([&] { StaticBlockSparseAttention(Device::kCpu, DType::kBF16, c, 1); },
                                           "7 query heads over 2"));
  c = kSmall;
  c.local_blocks = 0;
  EXPECT_TRUE(testing::throws_error_naming([&] { StaticBlockSparseAttention(Device::kCpu, DType::kBF16, c, 1); },
                                           "local_blocks 0"));
  EXPECT_TRUE(testing::throws_error_naming([&] { StaticBlockSparseAttention(Device::kCpu, DType::kF32, kSmall, 1); },
                                           "f16 or bf16"));
  EXPECT_TRUE(testing::throws_error_naming([&] { StaticBlockSparseAttention(Device::kCpu, DType::kBF16, kSmall, 0); },
                                           "batch = 0"));
}

// The rule's own entry points divide by block_size and vert_stride: a config
// no layer would take is refused there by name too (vert_stride 0 was a
// division trap), and group_size() of zero KV heads is 0, not a trap.
TEST(StaticBlockSparse, TheRuleRefusesAConfigThatWouldDivideByZero) {
  for (int field = 0; field < 4; ++field) {
    StaticBlockSparseConfig c = kSmall;
    (field == 0 ? c.vert_stride : field == 1 ? c.block_size : field == 2 ? c.local_blocks : c.num_qo_heads) = 0;
    EXPECT_TRUE(testing::throws_error_naming([&] { (void)c.keeps(0, 3, 1); }, "StaticBlockSparseConfig::keeps: "));
    EXPECT_TRUE(testing::throws_error_naming([&] { (void)c.kept_tokens(0, 100); }, "must be at least 1"));
    EXPECT_TRUE(testing::throws_error_naming([&] { (void)c.kept_blocks(0, 100); }, "kept_blocks"));
  }
  // A head outside [0, num_qo_heads) or a negative block is refused by name:
  // the arithmetic alone would answer for it.
  for (int32_t head : {-1, kSmall.num_qo_heads}) {
    EXPECT_TRUE(testing::throws_error_naming([&] { (void)kSmall.keeps(head, 3, 1); }, "keeps: head = "));
    EXPECT_TRUE(testing::throws_error_naming([&] { (void)kSmall.kept_blocks(head, 100); }, "lies outside [0, "));
    EXPECT_TRUE(testing::throws_error_naming([&] { (void)kSmall.kept_tokens(head, 100); }, "kept_tokens: head"));
  }
  EXPECT_TRUE(testing::throws_error_naming([&] { (void)kSmall.keeps(0, -1, 0); }, "must not be negative"));
  EXPECT_TRUE(testing::throws_error_naming([&] { (void)kSmall.keeps(0, 3, -2); }, "key_block = -2"));
  EXPECT_NO_THROW((void)kSmall.keeps(kSmall.num_qo_heads - 1, 3, 1));
  StaticBlockSparseConfig c = kSmall;
  c.num_kv_heads = 0;
  EXPECT_EQ(c.group_size(), 0);
  EXPECT_EQ(kSmall.group_size(), kSmall.num_qo_heads / kSmall.num_kv_heads);
}

TEST(StaticBlockSparse, ABadDecodeAppendsNothing) {
  StaticBlockSparseAttention layer(Device::kCpu, DType::kBF16, kSmall, 1, testing::always_fuse());
  std::mt19937_64 rng(5);
  const auto q = testing::random_values(DType::kBF16, 8 * 64, rng);
  const auto kv = testing::random_values(DType::kBF16, 2 * 64, rng);
  std::vector<uint8_t> o(8 * 64 * 2);
  EXPECT_TRUE(testing::throws_error_naming(
      [&] {
        layer.decode({q.data(), kv.data(), kv.data(), nullptr});
      },
      "(q, k, v, o) must be set"));
  EXPECT_EQ(layer.kv_len(), 0);
  layer.decode({q.data(), kv.data(), kv.data(), o.data()});
  EXPECT_EQ(layer.kv_len(), 1);
  EXPECT_TRUE(layer.last_mask_columns().size() == 8u);
}

// The static layer has no fused multi-token form: decode(tokens, q_len)
// runs q_len one-token steps, which must equal calling decode q_len times.
TEST(StaticBlockSparse, AMultiTokenDecodeEqualsOneTokenSteps) {
  constexpr int32_t kBatch = 2, kQLen = 3, kHeads = 8, kKvHeads = 2, kDim = 64;
  StaticBlockSparseAttention multi(Device::kCpu, DType::kBF16, kSmall, kBatch, testing::always_fuse());
  StaticBlockSparseAttention single(Device::kCpu, DType::kBF16, kSmall, kBatch, testing::always_fuse());
  std::mt19937_64 rng(9);
  const size_t q_row = size_t{kHeads} * kDim, kv_row = size_t{kKvHeads} * kDim;
  const auto prompt = testing::random_values(DType::kBF16, kBatch * kv_row * 40, rng);
  multi.append_tokens(prompt.data(), prompt.data(), 40);
  single.append_tokens(prompt.data(), prompt.data(), 40);
  const auto q = testing::random_values(DType::kBF16, kBatch * kQLen * q_row, rng);   // [batch, q_len, heads, dim]
  const auto k = testing::random_values(DType::kBF16, kQLen * kBatch * kv_row, rng);  // [q_len, batch, ...]
  const auto v = testing::random_values(DType::kBF16, kQLen * kBatch * kv_row, rng);
  std::vector<uint8_t> o(kBatch * kQLen * q_row * 2, 0xFF), o_one(kBatch * q_row * 2);
  multi.decode({q.data(), k.data(), v.data(), o.data()}, kQLen);
  for (size_t t = 0; t < kQLen; ++t) {
    std::vector<uint8_t> q_t(kBatch * q_row * 2);
    for (size_t b = 0; b < kBatch; ++b)
      std::copy_n(q.data() + (b * kQLen + t) * q_row * 2, q_row * 2, q_t.data() + b * q_row * 2);
    const size_t kv_at = t * kBatch * kv_row * 2;
    single.decode({q_t.data(), k.data() + kv_at, v.data() + kv_at, o_one.data()});
    for (size_t b = 0; b < kBatch; ++b) {
      EXPECT_TRUE(std::equal(o_one.begin() + b * q_row * 2, o_one.begin() + (b + 1) * q_row * 2,
                             o.begin() + (b * kQLen + t) * q_row * 2))
          << "token " << t << " of slot " << b;
    }
  }
  EXPECT_EQ(multi.kv_lens(), single.kv_lens());
  EXPECT_EQ(multi.kv_len(), 43);
}

}  // namespace
}  // namespace sparsepage
