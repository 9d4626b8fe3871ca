// Multi-token decode steps (DecodeParams::q_len > 1) on the CPU backend:
// against the fp64 reference with each token's causal limit, against the
// same step run as q_len single-token steps, with tokens whose causal limit
// cuts a selected page, and bad q_len refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/decode.h"
#include "sparsepage/memory.h"
#include "sparsepage/plan.h"
#include "support/expect_error.h"
#include "support/multi_token.h"
#include "support/multi_token_layers.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::MultiTokenSpec;

struct Case {
  DType dtype;
  int32_t group_size, q_len, page_size, pages;
  std::vector<int32_t> live_lens;
  int32_t fixed_chunk;
};

std::vector<Case> cases() {
  return {
      // Block-granular pages whose new tokens straddle a page boundary (130 - 4 = 126 < 128).
      {DType::kBF16, 4, 4, 64, 3, {130, 200, 64}, 0},
      {DType::kBF16, 16, 4, 128, 4, {385, 600}, 0},
      // Token pages (DSA-like positions), every token cut differently.
      {DType::kBF16, 1, 8, 1, 40, {50, 9}, 0},
      {DType::kF16, 3, 3, 16, 5, {33, 47, 80}, 0},
      // Forced splits: the causal limit must hold in every chunk and survive the merge.
      {DType::kBF16, 4, 2, 16, 9, {140, 150}, 64},
      {DType::kBF16, 8, 8, 1, 300, {400}, 64},
  };
}

std::string describe(const Case& c) {
  return "G " + std::to_string(c.group_size) + " q_len " + std::to_string(c.q_len) + " page " +
         std::to_string(c.page_size);
}

testing::MultiTokenProblem problem_of(const Case& c, uint64_t seed) {
  MultiTokenSpec spec;
  spec.dtype = c.dtype;
  spec.live_lens = c.live_lens;
  spec.group_size = c.group_size;
  spec.q_len = c.q_len;
  spec.page_size = c.page_size;
  spec.pages_per_request = c.pages;
  spec.seed = seed;
  return testing::make_multi_token_problem(spec);
}

TEST(MultiTokenCpu, MatchesFp64ReferenceWithCausalLimit) {
  uint64_t seed = 1;
  for (const Case& c : cases()) {
    const auto pb = problem_of(c, seed++);
    const auto ref = testing::multi_token_reference(pb);
    const auto got = testing::run_multi_token(pb, Device::kCpu, c.fixed_chunk);
    EXPECT_EQ(testing::compare_multi_token(pb, got.o, got.lse, ref.o, ref.lse, 1e-2, 1e-3), "") << describe(c);
  }
}

TEST(MultiTokenCpu, EqualsSingleTokenSteps) {
  uint64_t seed = 100;
  for (const Case& c : cases()) {
    const auto pb = problem_of(c, seed++);
    const auto multi = testing::run_multi_token(pb, Device::kCpu, c.fixed_chunk);
    const auto single = testing::run_as_single_tokens(pb, Device::kCpu);
    const std::vector<double> o(single.o.begin(), single.o.end()), lse(single.lse.begin(), single.lse.end());
    EXPECT_EQ(testing::compare_multi_token(pb, multi.o, multi.lse, o, lse, 5e-3, 1e-4), "") << describe(c);
  }
}

// The tests above have teeth: every selection holds the positions of the
// later new tokens, so an output that ignored the limit would differ.
TEST(MultiTokenCpu, TheCausalLimitChangesTheEarlierTokens) {
  const auto pb = problem_of(cases()[0], 7);
  auto unlimited = pb;  // each limit moved past the window: every token sees the whole selection
  for (int32_t& live : unlimited.spec.live_lens) live += pb.spec.q_len - 1;
  const auto without_limit = testing::multi_token_reference(unlimited);
  const auto got = testing::run_multi_token(pb, Device::kCpu);
  const size_t hq = static_cast<size_t>(pb.num_qo_heads()), d = static_cast<size_t>(pb.spec.head_dim);
  int differing = 0;
  for (size_t row = 0; row < got.lse.size(); ++row) {
    const auto token = static_cast<int32_t>(row / hq % static_cast<size_t>(pb.spec.q_len));
    const std::vector<float> o(got.o.begin() + static_cast<std::ptrdiff_t>(row * d),
                               got.o.begin() + static_cast<std::ptrdiff_t>((row + 1) * d));
    const std::vector<double> all(without_limit.o.begin() + static_cast<std::ptrdiff_t>(row * d),
                                  without_limit.o.begin() + static_cast<std::ptrdiff_t>((row + 1) * d));
    const double err = testing::relative_l2(o, all);
    if (token == pb.spec.q_len - 1) {
      EXPECT_LT(err, 1e-2) << "the last token sees the whole selection (row " << row << ")";
    } else {
      differing += err > 5e-2;
    }
  }
  EXPECT_EQ(differing, static_cast<int>(got.lse.size() / static_cast<size_t>(pb.spec.q_len)) * (pb.spec.q_len - 1));
}

TEST(MultiTokenCpu, BadQLenIsRefusedByName) {
  const auto pb = problem_of(cases()[0], 3);
  Buffer o(Device::kCpu, 1 << 20), lse(Device::kCpu, 1 << 16);
  const std::vector<int32_t> live = pb.spec.live_lens;
  DecodeParams p = pb.params(pb.k.data(), pb.v.data(), pb.q.data(), pb.indptr.data(), pb.pages.data(),
                             pb.seq_lens.data(), live.data(), o.data(), lse.as<float>());
  PlanShape shape;
  shape.group_size = p.group_size * p.q_len;
  shape.head_dim_v = p.v.dim;
  const DecodePlan plan = make_decode_plan(pb.seq_lens, shape);
  Buffer ws(Device::kCpu, plan.workspace.total + 256);
  auto run = [&](const DecodeParams& params, const DecodePlan& pl) {
    return [&params, &pl, &ws] { run_decode_cpu(params, pl, ws.data()); };
  };
  DecodeParams zero = p;
  zero.q_len = 0;
  EXPECT_TRUE(testing::throws_error_naming(run(zero, plan), "q_len = 0 must lie in [1, 16]"));
  DecodeParams many = p;
  many.q_len = kMaxQueryTokens + 1;
  EXPECT_TRUE(testing::throws_error_naming(run(many, plan), "q_len = 17 must lie in [1, 16]"));
  DecodeParams pool = p;
  pool.addressing = PageAddressing::kPoolPages;
  pool.num_pool_pages = 1 << 20;
  EXPECT_TRUE(testing::throws_error_naming(run(pool, plan), "kPoolPages page ids are not positions"));
  DecodeParams table = p;
  table.addressing = PageAddressing::kBlockTable;
  table.window_lens = nullptr;
  table.window_len = 0;
  EXPECT_TRUE(testing::throws_error_naming(run(table, plan), "needs each sequence's live length"));
  PlanShape heads_only = shape;
  heads_only.group_size = p.group_size;  // planned for the heads, not heads x tokens
  const DecodePlan short_plan = make_decode_plan(pb.seq_lens, heads_only);
  EXPECT_TRUE(testing::throws_error_naming(run(p, short_plan), "group_size * q_len = 4 * 4 query rows per request"));
  DecodeParams strided = p;
  strided.qo_layout = QueryLayout::kStrided;
  strided.q_strides = {4 * 8 * 128, 128, -1};
  strided.o_strides = {4 * 8 * 128, 128, 8 * 128};
  EXPECT_TRUE(testing::throws_error_naming(run(strided, plan), "q_strides.token_stride must not be negative"));
  DecodeParams overlap = p;
  overlap.qo_layout = QueryLayout::kStrided;
  overlap.q_strides = {4 * 8 * 128, 128, 8 * 128};
  overlap.o_strides = {4 * 8 * 128, 128, 128};  // tokens land on each other's heads
  EXPECT_TRUE(testing::throws_error_naming(run(overlap, plan), "make the output rows of 128 elements overlap"));
  // The valid call runs.
  EXPECT_NO_THROW(run(p, plan)());
}

// Strided q and o views (a slice of a wider [tokens, heads, dim] buffer)
// give the same result as the packed layout.
TEST(MultiTokenCpu, StridedViewsMatchPacked) {
  const Case c = cases()[3];
  const auto pb = problem_of(c, 11);
  const auto packed = testing::run_multi_token(pb, Device::kCpu);
  const int32_t hq = pb.num_qo_heads(), d = pb.spec.head_dim, qn = pb.spec.q_len;
  const size_t esize = dtype_size(pb.spec.dtype);
  // q and o inside buffers with 2 spare heads per token.
  const int32_t wide = hq + 2;
  std::vector<uint8_t> q_wide(static_cast<size_t>(pb.batch) * qn * wide * d * esize, 0xff);
  for (int32_t row = 0; row < pb.batch * qn; ++row) {
    std::copy(pb.q.begin() + static_cast<std::ptrdiff_t>(size_t(row) * hq * d * esize),
              pb.q.begin() + static_cast<std::ptrdiff_t>(size_t(row + 1) * hq * d * esize),
              q_wide.begin() + static_cast<std::ptrdiff_t>(size_t(row) * wide * d * esize));
  }
  std::vector<uint8_t> o_wide(q_wide.size(), 0xff);  // NaN pattern in bf16/f16
  std::vector<float> lse(static_cast<size_t>(pb.batch) * qn * hq, std::numeric_limits<float>::quiet_NaN());
  const std::vector<int32_t> live = pb.spec.live_lens;
  DecodeParams p = pb.params(pb.k.data(), pb.v.data(), q_wide.data(), pb.indptr.data(), pb.pages.data(),
                             pb.seq_lens.data(), live.data(), o_wide.data(), lse.data());
  p.qo_layout = QueryLayout::kStrided;
  p.q_strides = {int64_t{qn} * wide * d, d, int64_t{wide} * d};
  p.o_strides = p.q_strides;
  PlanShape shape;
  shape.group_size = p.group_size * qn;
  shape.head_dim_v = d;
  shape.fixed_chunk_tokens = 64;
  const DecodePlan plan = make_decode_plan(pb.seq_lens, shape);
  Buffer ws(Device::kCpu, plan.workspace.total + 256);
  run_decode_cpu(p, plan, ws.data());
  std::vector<uint8_t> o(static_cast<size_t>(pb.batch) * qn * hq * d * esize);
  for (int32_t row = 0; row < pb.batch * qn; ++row) {
    std::copy(o_wide.begin() + static_cast<std::ptrdiff_t>(size_t(row) * wide * d * esize),
              o_wide.begin() + static_cast<std::ptrdiff_t>((size_t(row) * wide + hq) * d * esize),
              o.begin() + static_cast<std::ptrdiff_t>(size_t(row) * hq * d * esize));
  }
  const std::vector<float> got = testing::as_float(pb.spec.dtype, o);
  const std::vector<double> want(packed.o.begin(), packed.o.end()), want_lse(packed.lse.begin(), packed.lse.end());
  EXPECT_EQ(testing::compare_multi_token(pb, got, lse, want, want_lse, 5e-3, 1e-4), "");
}

// The block-sparse layer's multi-token step: new tokens straddling a block
// boundary (638 + 4 crosses 640), inside one block, and 8 tokens.
TEST(MultiTokenCpu, BlockSparseLayerFusedStep) {
  const BlockSparseConfig c = testing::small_block_sparse_config();
  std::string kernel;
  testing::check_block_sparse_multi_token(Device::kCpu, c, 2, 638, 4, &kernel);
  EXPECT_EQ(kernel, "CPU loop");
  testing::check_block_sparse_multi_token(Device::kCpu, c, 3, 700, 2);
  testing::check_block_sparse_multi_token(Device::kCpu, c, 1, 1000, 8);
}

TEST(MultiTokenCpu, BlockSparseLayerTokenByToken) {
  const BlockSparseConfig c = testing::small_block_sparse_config();
  testing::check_block_sparse_multi_token_dense(Device::kCpu, c, 2, 100, 4, false);
  testing::check_block_sparse_multi_token_dense(Device::kCpu, c, 2, 638, 4, true);
}

// DSA: one top-k per token over its own window (300 + 4 > 64: every window
// is sparse; 62 + 4 straddles the top-k, the early tokens keep everything).
TEST(MultiTokenCpu, DsaLayerFusedStep) {
  const DsaConfig c = testing::small_dsa_config();
  testing::check_dsa_multi_token(Device::kCpu, c, 2, 300, 4, false);
  testing::check_dsa_multi_token(Device::kCpu, c, 1, 62, 4, false);
}

TEST(MultiTokenCpu, DsaLayerTokenByToken) {
  testing::check_dsa_multi_token(Device::kCpu, testing::small_dsa_config(), 2, 300, 3, true);
}

TEST(MultiTokenCpu, BlockSparseLayerRefusesBadQLen) {
  BlockSparseAttention layer(Device::kCpu, DType::kBF16, testing::small_block_sparse_config(), 1);
  BlockSparseTokens tokens;
  EXPECT_TRUE(testing::throws_error_naming([&] { layer.decode(tokens, 0); }, "q_len = 0 must lie in [1, 16]"));
  EXPECT_TRUE(testing::throws_error_naming([&] { layer.decode(tokens, 17); }, "q_len = 17 must lie in [1, 16]"));
  EXPECT_EQ(layer.kv_len(), 0);
}

TEST(MultiTokenAppend, OneLaunchEqualsSingleTokenAppends) {
  EXPECT_EQ(testing::step_append_mismatch(Device::kCpu), "");
}

TEST(MultiTokenAppend, RefusesBadInputByName) {
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 2, 1, 1, 8, 8, 8);
  std::vector<uint16_t> rows(size_t{2} * 8 * 8);
  cache.append(rows.data(), rows.data(), DType::kBF16, 5);  // capacity 8: room for 3
  EXPECT_TRUE(testing::throws_error_naming([&] { cache.append_step_tokens(rows.data(), rows.data(), 0); },
                                           "append_step_tokens: tokens = 0 must be at least 1"));
  EXPECT_TRUE(testing::throws_error_naming([&] { cache.append_step_tokens(rows.data(), rows.data(), 4); },
                                           "append_step_tokens: live_len = 5 plus 4 tokens exceeds capacity 8"));
  EXPECT_TRUE(testing::throws_error_naming([&] { cache.append_step_tokens(nullptr, rows.data(), 2); },
                                           "append_step_tokens: k_new and v_new must not be null"));
  EXPECT_EQ(cache.live_len(), 5) << "a refused append changes nothing";
  cache.append_step_tokens(rows.data(), rows.data(), 3);  // exactly fills the capacity
  EXPECT_EQ(cache.live_len(), 8);
  EXPECT_EQ(download<int32_t>(Device::kCpu, cache.device_live_lens(), 2), (std::vector<int32_t>{8, 8}));
}

}  // namespace
}  // namespace sparsepage
