// Multi-token decode steps (DecodeParams::q_len > 1) on the GPU: the
// kernels (16-row tiles, the 64-row CTA on wgmma or, in a second ctest
// process, on mma.sync) against the fp64 reference with each token's causal
// limit, against q_len single-token steps on the GPU, and against the CPU
// backend; tokens whose causal limit cuts a selected page; query-row tiles
// that hold several tokens (G * q_len <= 16) and tokens spread over several
// tiles (G * q_len > 16, G not a divisor of 16); forced splits and merges.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "sparsepage/cache.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/sparse_decode.h"
#include "support/expect_error.h"
#include "support/multi_token.h"
#include "support/multi_token_layers.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

struct Case {
  DType dtype;
  int32_t group_size, q_len, page_size, pages;
  std::vector<int32_t> live_lens;
  int32_t fixed_chunk;
  int32_t head_dim;
};

// Under the sanitizers (testing::quick_mode()) each case selects at most
// 256 tokens a request (and at least 2 pages: the final one and the one the
// causal limit cuts), with the same kernels, tiles and forced splits.
std::vector<Case> cases() {
  std::vector<Case> all = {
      {DType::kBF16, 4, 4, 64, 3, {130, 200, 64}, 0, 128},    // one 16-row tile: 4 tokens x 4 heads
      {DType::kBF16, 16, 4, 128, 17, {2200, 385}, 0, 128},    // the block-sparse geometry: 4 tiles per item
      {DType::kBF16, 16, 4, 128, 17, {2200, 385}, 128, 128},  // the same, split and merged
      {DType::kF16, 3, 3, 16, 5, {33, 47, 80}, 0, 128},       // 9 rows, tokens unaligned to tiles
      {DType::kBF16, 6, 3, 16, 12, {190, 161}, 64, 64},       // 18 rows over 2 tiles, split
      {DType::kBF16, 1, 8, 1, 300, {400, 17}, 64, 128},       // token pages, 8 tokens, split
      {DType::kBF16, 32, 2, 64, 6, {300}, 0, 256},            // 2 tiles per token, wide head
      // The 64-row multi-token CTA (head dim 128; from 17 rows on wgmma, from 33 on mma.sync):
      {DType::kBF16, 16, 2, 64, 9, {700, 333}, 0, 128},     // 32 rows: the block-sparse geometry's 2 tokens
      {DType::kF16, 10, 2, 16, 20, {300, 41}, 64, 128},     // 20 rows, 44 of the 64 padding, split
      {DType::kBF16, 6, 6, 16, 9, {150, 97}, 0, 128},       // 36 rows, 28 of the 64 padding
      {DType::kF16, 8, 8, 32, 7, {230, 180, 41}, 64, 128},  // 64 rows, split and merged
      {DType::kBF16, 12, 8, 1, 200, {260, 300}, 64, 128},   // 96 rows: two CTAs, a token across them
      {DType::kBF16, 16, 8, 128, 5, {1000}, 0, 128},        // 128 rows: two CTAs
  };
  if (testing::quick_mode()) {
    for (Case& c : all) c.pages = std::max(2, std::min(c.pages, 256 / c.page_size));
  }
  return all;
}

std::string describe(const Case& c) {
  return "G " + std::to_string(c.group_size) + " q_len " + std::to_string(c.q_len) + " page " +
         std::to_string(c.page_size) + " dim " + std::to_string(c.head_dim) + " chunk " + std::to_string(c.fixed_chunk);
}

testing::MultiTokenProblem problem_of(const Case& c, uint64_t seed) {
  testing::MultiTokenSpec spec;
  spec.dtype = c.dtype;
  spec.live_lens = c.live_lens;
  spec.group_size = c.group_size;
  spec.q_len = c.q_len;
  spec.page_size = c.page_size;
  spec.pages_per_request = c.pages;
  spec.head_dim = c.head_dim;
  spec.seed = seed;
  return testing::make_multi_token_problem(spec);
}

// The kernel the dispatch must pick for a case, as far as the name's start:
// the process's SPARSEPAGE_MULTI_TOKEN_CTA is honoured (the second ctest
// process sets `mma`).
std::string expected_kernel(const Case& c) {
  const int32_t rows = c.group_size * c.q_len;
  const char* env = std::getenv("SPARSEPAGE_MULTI_TOKEN_CTA");
  const std::string choice = env != nullptr ? env : "";
  if (c.head_dim == 128 && rows > 16) {
    if (choice != "mma" && cuda_sm90a_code_runs(cuda_device_sm())) return "64-row multi-token CTA, wgmma";
    if (rows > 32) return "64-row multi-token CTA, mma.sync";
  }
  return "16-row tiles";
}

TEST(MultiTokenCuda, MatchesFp64AndSingleTokenSteps) {
  SKIP_WITHOUT_CUDA();
  uint64_t seed = 1;
  for (const Case& c : cases()) {
    const auto pb = problem_of(c, seed++);
    const auto ref = testing::multi_token_reference(pb);
    const auto gpu = testing::run_multi_token(pb, Device::kCuda, c.fixed_chunk);
    EXPECT_EQ(gpu.kernel.rfind(expected_kernel(c), 0), 0u) << describe(c) << ": ran " << gpu.kernel;
    EXPECT_EQ(testing::compare_multi_token(pb, gpu.o, gpu.lse, ref.o, ref.lse, 1e-2, 2e-3), "") << describe(c);
    const auto single = testing::run_as_single_tokens(pb, Device::kCuda);
    const std::vector<double> o(single.o.begin(), single.o.end()), lse(single.lse.begin(), single.lse.end());
    EXPECT_EQ(testing::compare_multi_token(pb, gpu.o, gpu.lse, o, lse, 1e-2, 2e-3), "") << describe(c);
    const auto cpu = testing::run_multi_token(pb, Device::kCpu, c.fixed_chunk);
    const std::vector<double> co(cpu.o.begin(), cpu.o.end()), cl(cpu.lse.begin(), cpu.lse.end());
    EXPECT_EQ(testing::compare_multi_token(pb, gpu.o, gpu.lse, co, cl, 1e-2, 2e-3), "") << describe(c);
  }
}

// Without the limit the earlier tokens would see later positions: the GPU
// result must differ from that for every earlier token.
TEST(MultiTokenCuda, TheCausalLimitChangesTheEarlierTokens) {
  SKIP_WITHOUT_CUDA();
  // Few selected positions (3 pages of 64), so that the 1 to 3 positions a
  // limit removes move every earlier token's output by more than 5%.
  const auto pb = problem_of(cases()[0], 7);
  auto unlimited = pb;
  for (int32_t& live : unlimited.spec.live_lens) live += pb.spec.q_len - 1;
  const auto without_limit = testing::multi_token_reference(unlimited);
  const auto gpu = testing::run_multi_token(pb, Device::kCuda);
  const size_t hq = static_cast<size_t>(pb.num_qo_heads()), d = static_cast<size_t>(pb.spec.head_dim);
  int differing = 0, earlier = 0;
  for (size_t row = 0; row < gpu.lse.size(); ++row) {
    if (static_cast<int32_t>(row / hq % static_cast<size_t>(pb.spec.q_len)) == pb.spec.q_len - 1) continue;
    ++earlier;
    const std::vector<float> o(gpu.o.begin() + static_cast<std::ptrdiff_t>(row * d),
                               gpu.o.begin() + static_cast<std::ptrdiff_t>((row + 1) * d));
    const std::vector<double> all(without_limit.o.begin() + static_cast<std::ptrdiff_t>(row * d),
                                  without_limit.o.begin() + static_cast<std::ptrdiff_t>((row + 1) * d));
    differing += testing::relative_l2(o, all) > 5e-2;
  }
  EXPECT_EQ(differing, earlier);
}

TEST(MultiTokenCuda, RefusedByName) {
  SKIP_WITHOUT_CUDA();
  const auto pb = problem_of(cases()[0], 3);
  Buffer o(Device::kCuda, 1 << 20), lse(Device::kCuda, 1 << 16), ws(Device::kCuda, 1 << 20);
  DecodeParams p = pb.params(o.data(), o.data(), o.data(), lse.as<int32_t>(), lse.as<int32_t>(), lse.as<int32_t>(),
                             lse.as<int32_t>(), o.data(), lse.as<float>());
  PlanShape shape = testing::cuda_plan_shape(p.group_size * p.q_len, p.v.dim);
  const DecodePlan plan = make_decode_plan(pb.seq_lens, shape);
  DecodeParams pool = p;
  pool.addressing = PageAddressing::kPoolPages;
  pool.num_pool_pages = 1;
  EXPECT_TRUE(testing::throws_error_naming([&] { run_decode_cuda(pool, plan, ws.data()); },
                                           "kPoolPages page ids are not positions"));
  DecodeParams many = p;
  many.q_len = 99;
  EXPECT_TRUE(
      testing::throws_error_naming([&] { run_decode_cuda(many, plan, ws.data()); }, "q_len = 99 must lie in [1, 16]"));
  // The MLA kernel takes one token per request.
  DecodeParams mla = p;
  mla.group_size = 1;
  mla.q_len = 4;
  mla.k = RowView::dense(o.data(), 2, 8, 512, 576);
  mla.v = mla.k;
  mla.k_extra = RowView::dense(o.data(), 2, 8, 64);
  mla.q_extra = o.data();
  mla.window_len = 8;
  PlanShape mla_shape = testing::cuda_plan_shape(4, 512);
  const DecodePlan mla_plan = make_decode_plan(std::vector<int32_t>(pb.seq_lens.size(), 8), mla_shape);
  Buffer mla_ws(Device::kCuda, mla_plan.workspace.total + 256);
  EXPECT_TRUE(testing::throws_error_naming([&] { run_decode_cuda(mla, mla_plan, mla_ws.data()); },
                                           "its kernel takes one query token per request"));
}

// The block-sparse layer on the GPU: the CUDA indexer's multi-token scores
// (max over the tokens' index queries) give the rule's blocks exactly, and
// the fused step matches fp64 per token.
TEST(MultiTokenCuda, BlockSparseLayerFusedStep) {
  SKIP_WITHOUT_CUDA();
  const BlockSparseConfig c = testing::small_block_sparse_config();
  testing::check_block_sparse_multi_token(Device::kCuda, c, 2, 638, 4);
  testing::check_block_sparse_multi_token(Device::kCuda, c, 3, 700, 2);
  testing::check_block_sparse_multi_token(Device::kCuda, c, 1, 1000, 8);
  BlockSparseConfig wide = c;  // 4 KV heads x 8 tokens: all 32 (token, head) index queries
  wide.num_kv_heads = 4;
  wide.num_qo_heads = 64;
  testing::check_block_sparse_multi_token(Device::kCuda, wide, 2, 900, 8);
}

// The block-sparse geometry's head dim (128, 16 heads per KV head): four
// tokens are 64 query rows, the 64-row CTA's step, on wgmma where sm_90a code
// runs (unless SPARSEPAGE_MULTI_TOKEN_CTA=mma asks for mma.sync, as the
// second ctest process of these tests does). The step names its kernel.
TEST(MultiTokenCuda, BlockSparseLayerOnTheSixtyFourRowCta) {
  SKIP_WITHOUT_CUDA();
  BlockSparseConfig c = testing::small_block_sparse_config();
  c.num_kv_heads = 2;
  c.num_qo_heads = 32;
  c.head_dim = 128;
  std::string kernel;
  testing::check_block_sparse_multi_token(Device::kCuda, c, 2, 900, 4, &kernel);
  const char* env = std::getenv("SPARSEPAGE_MULTI_TOKEN_CTA");
  const std::string choice = env != nullptr ? env : "";
  const char* expected = choice == "mma" || !cuda_sm90a_code_runs(cuda_device_sm()) ? "64-row multi-token CTA, mma.sync"
                                                                                    : "64-row multi-token CTA, wgmma";
  EXPECT_EQ(kernel, expected);
}

TEST(MultiTokenCuda, BlockSparseLayerTokenByToken) {
  SKIP_WITHOUT_CUDA();
  const BlockSparseConfig c = testing::small_block_sparse_config();
  testing::check_block_sparse_multi_token_dense(Device::kCuda, c, 2, 100, 4, false);
  testing::check_block_sparse_multi_token_dense(Device::kCuda, c, 2, 638, 4, true);
}

TEST(MultiTokenCuda, DsaLayerFusedStep) {
  SKIP_WITHOUT_CUDA();
  const DsaConfig c = testing::small_dsa_config();
  testing::check_dsa_multi_token(Device::kCuda, c, 2, 300, 4, false);
  testing::check_dsa_multi_token(Device::kCuda, c, 1, 62, 4, false);
  // Under the sanitizers the eight-token steps take shorter prompts; the
  // stage-reusing 4 x 16000 step stays (it needs that many key tiles).
  const bool quick = testing::quick_mode();
  testing::check_dsa_multi_token(Device::kCuda, c, 3, quick ? 300 : 1000, 8, false);
  // The production index geometry (64 heads x 128 dims), where a CTA scores
  // each key tile against two or four tokens' queries (wgmma chains of two
  // tokens): four tokens, two, three (a group with an absent fourth row),
  // six (groups of four and two, the second group's second chain empty),
  // eight (two groups of four), and four over enough tiles that each CTA's
  // consumers reuse the six key stages (on a 132-SM H200: 33 CTAs per
  // sequence, 8 tiles each). The small geometry above scores row by row
  // (the looped k-chain), and at 62 + 4 tokens has rows whose windows fit
  // the top-k (not scored) beside one that does not.
  DsaConfig wide = c;
  wide.index_heads = 64;
  wide.index_head_dim = 128;
  testing::check_dsa_multi_token(Device::kCuda, wide, 2, 700, 4, false);
  testing::check_dsa_multi_token(Device::kCuda, wide, 2, 650, 2, false);
  testing::check_dsa_multi_token(Device::kCuda, wide, 1, 900, 3, false);
  testing::check_dsa_multi_token(Device::kCuda, wide, 2, 500, 6, false);
  testing::check_dsa_multi_token(Device::kCuda, wide, 1, quick ? 600 : 3000, 8, false);
  testing::check_dsa_multi_token(Device::kCuda, wide, 4, 16000, 4, false);
  // Windows that straddle the top-k inside one group: at 62 + 4 tokens the
  // first two rows fit it (not scored) and the last two do not.
  testing::check_dsa_multi_token(Device::kCuda, wide, 1, 62, 4, false);
}

TEST(MultiTokenCuda, DsaLayerTokenByToken) {
  SKIP_WITHOUT_CUDA();
  testing::check_dsa_multi_token(Device::kCuda, testing::small_dsa_config(), 2, 300, 3, true);
}

// A kernel switch holding a value it does not take is refused by name when a
// decoder or a layer is made, before any step could append. Runs in a ctest
// process of its own with SPARSEPAGE_MULTI_TOKEN_CTA=bogus
// (tests/cuda/CMakeLists.txt); in the main process the switch is unset and
// the test skips, saying so.
TEST(KernelSwitches, ABadValueIsRefusedWhenADecoderIsMade) {
  SKIP_WITHOUT_CUDA();
  const char* v = std::getenv("SPARSEPAGE_MULTI_TOKEN_CTA");
  if (v == nullptr || std::string(v) != "bogus")
    GTEST_SKIP() << "runs with SPARSEPAGE_MULTI_TOKEN_CTA=bogus, in its own ctest process";
  EXPECT_TRUE(testing::throws_error_naming([] { SparseDecoder d(Device::kCuda, DispatchConfig::defaults()); },
                                           "SPARSEPAGE_MULTI_TOKEN_CTA must be 'auto' or 'mma', not 'bogus'"));
  EXPECT_TRUE(testing::throws_error_naming(
      [] { BlockSparseAttention layer(Device::kCuda, DType::kBF16, testing::small_block_sparse_config(), 1); },
      "SPARSEPAGE_MULTI_TOKEN_CTA"));
  EXPECT_NO_THROW(SparseDecoder(Device::kCpu, DispatchConfig::defaults()))
      << "the CPU backend has no kernel switches to refuse";
}

TEST(MultiTokenAppendCuda, OneLaunchEqualsSingleTokenAppends) {
  SKIP_WITHOUT_CUDA();
  // Rows of whole 16-byte pieces (48 and 16 bytes) take the kernel's uint4
  // path; rows of 44 and 12 bytes its 4-byte path.
  EXPECT_EQ(testing::step_append_mismatch(Device::kCuda), "");
  EXPECT_EQ(testing::step_append_mismatch(Device::kCuda, 22, 6), "");
  // Steps of more words per sequence than one pass of the CTA takes (256
  // threads x 4 words): 2 passes of 16-byte words, 7 of 4-byte words.
  EXPECT_EQ(testing::step_append_mismatch(Device::kCuda, 1024, 8), "");
  EXPECT_EQ(testing::step_append_mismatch(Device::kCuda, 1030, 6), "");
}

TEST(MultiTokenAppendCuda, SourcesOffTheSixteenByteGridAppendTheSameRows) {
  SKIP_WITHOUT_CUDA();
  // Rows of 16 bytes whose sources sit 4 bytes past a 16-byte boundary: the
  // kernel must take 4-byte words. Against the same rows appended on the CPU.
  constexpr int32_t kBatch = 2, kHeads = 2, kDim = 8;
  std::mt19937_64 rng(11);
  const auto k = testing::random_values(DType::kBF16, size_t{kBatch} * kHeads * kDim, rng);
  const auto v = testing::random_values(DType::kBF16, size_t{kBatch} * kHeads * kDim, rng);
  const auto shifted = [](const std::vector<uint8_t>& rows, size_t by) {
    std::vector<uint8_t> out(by, 0);
    out.insert(out.end(), rows.begin(), rows.end());
    return out;
  };
  const Buffer kd = upload(Device::kCuda, shifted(k, 4)), vd = upload(Device::kCuda, shifted(v, 4));
  DenseKVCache gpu(Device::kCuda, CacheMode::kBF16, kBatch, kHeads, kHeads, kDim, kDim);
  DenseKVCache cpu(Device::kCpu, CacheMode::kBF16, kBatch, kHeads, kHeads, kDim, kDim);
  gpu.reserve(2);
  cpu.reserve(2);
  gpu.append_token(static_cast<const char*>(kd.data()) + 4, static_cast<const char*>(vd.data()) + 4, nullptr);
  cpu.append_token(k.data(), v.data(), nullptr);
  EXPECT_EQ(download<int32_t>(Device::kCuda, gpu.device_live_lens(), kBatch), (std::vector<int32_t>{1, 1}));
  for (bool key : {true, false})
    EXPECT_EQ(testing::cache_window(gpu, key), testing::cache_window(cpu, key)) << (key ? "K" : "V");
  // Off the 4-byte grid: refused by name, nothing appended.
  EXPECT_TRUE(testing::throws_error_naming(
      [&] { gpu.append_token(static_cast<const char*>(kd.data()) + 2, vd.data(), nullptr); },
      "append_token: k_new and v_new must be 4-byte aligned"));
  EXPECT_EQ(download<int32_t>(Device::kCuda, gpu.device_live_lens(), kBatch), (std::vector<int32_t>{1, 1}));
}

TEST(MultiTokenAppendCuda, RefusesPastTheCapacityByName) {
  SKIP_WITHOUT_CUDA();
  DenseKVCache cache(Device::kCuda, CacheMode::kBF16, 2, 1, 1, 8, 8, 8);
  Buffer rows(Device::kCuda, size_t{2} * 8 * 8 * 2);
  fill_bytes(rows.data(), Device::kCuda, 0, rows.bytes());
  cache.append(rows.data(), rows.data(), DType::kBF16, 6);
  EXPECT_TRUE(testing::throws_error_naming([&] { cache.append_step_tokens(rows.data(), rows.data(), 3); },
                                           "append_step_tokens: live_len = 6 plus 3 tokens exceeds capacity 8"));
  EXPECT_EQ(cache.live_len(), 6);
  EXPECT_EQ(download<int32_t>(Device::kCuda, cache.device_live_lens(), 2), (std::vector<int32_t>{6, 6}));
}

}  // namespace
}  // namespace sparsepage
