// The sparse prefill's entry points as an engine calls them (CPU backend),
// for what the fuzzer's prefill target found:
// * a refused prefill writes nothing: every launch of a chunk is checked
//   before the first one writes (a bad entry in a later sequence was
//   refused after the earlier sequences' rows were written);
// * max_logits over an engine's paged pool reads the rows through the
//   table (it read pool row `position`, the wrong row);
// * a key view of known capacity 0 (an empty cache) bounds the positions
//   read like any other capacity (0 was taken as "unknown");
// * MlaPrefillParams::causal false (flash_mla_sparse_fwd's visibility): a
//   token reads any row below its sequence's length.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "sparsepage/fp8.h"
#include "sparsepage/prefill.h"
#include "sparsepage/types.h"
#include "support/prefill_problem.h"

namespace sparsepage {
namespace {

TEST(PrefillApi, MlaEntryOfTheLastSequenceRefusesTheWholeChunk) {
  testing::MlaPrefillSpec spec;
  spec.batch = 2;
  spec.num_tokens = 4;
  spec.num_heads = 2;
  spec.topk = 6;
  spec.starts = {5, 9};
  spec.pad_fraction = 0.0;
  testing::MlaPrefillProblem pb = testing::make_mla_prefill_problem(spec);
  const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_heads;
  std::vector<uint16_t> out(rows * 512, 0xFFFF);
  std::vector<float> lse(rows, -7.0f);
  // Sequence 1's last token names the position after its own.
  const size_t token = static_cast<size_t>(spec.batch) * spec.num_tokens - 1;
  pb.indices[token * spec.topk] = pb.kv_lens[1];
  MlaSparsePrefill prefill(Device::kCpu);
  EXPECT_THROW(prefill.run(pb.host_params(out.data(), lse.data(), nullptr)), Error);
  for (uint16_t v : out) ASSERT_EQ(v, 0xFFFF) << "a refused chunk wrote out";
  for (float v : lse) ASSERT_EQ(v, -7.0f) << "a refused chunk wrote lse";
}

TEST(PrefillApi, BlockListOfTheLastSequenceRefusesTheWholeChunk) {
  for (BlockSelectionLayout layout : {BlockSelectionLayout::kPerKvHead, BlockSelectionLayout::kPerQueryHead}) {
    testing::GqaPrefillSpec spec;
    spec.batch = 2;
    spec.num_tokens = 20;
    spec.block_size = 8;
    spec.starts = {8, 16};
    spec.layout = layout;
    testing::GqaPrefillProblem pb = testing::make_gqa_prefill_problem(spec);
    const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_qo_heads;
    std::vector<uint16_t> out(rows * spec.head_dim, 0xFFFF);
    std::vector<float> lse(rows, -7.0f);
    // The last list (sequence 1's) names a negative block in its first entry, which it reads.
    pb.block_ids[(pb.counts.size() - 1) * spec.width] = -5;
    ASSERT_GT(pb.counts.back(), 0);
    GqaBlockPrefill prefill(Device::kCpu);
    EXPECT_THROW(prefill.run(pb.host_params(out.data(), lse.data())), Error);
    for (uint16_t v : out) ASSERT_EQ(v, 0xFFFF) << "a refused chunk wrote o";
    for (float v : lse) ASSERT_EQ(v, -7.0f) << "a refused chunk wrote lse";
  }
}

TEST(PrefillApi, MlaOverAPagedPoolGivesTheDenseRunsBitsMaxLogitsIncluded) {
  for (const bool fp8 : {false, true}) {
    testing::MlaPrefillSpec spec;
    spec.batch = 2;
    spec.num_tokens = 5;
    spec.num_heads = 2;
    spec.topk = 7;
    spec.starts = {6, 13};
    spec.fp8 = fp8;
    const testing::MlaPrefillProblem pb = testing::make_mla_prefill_problem(spec);
    const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_heads;
    const auto run = [&](const MlaPrefillParams& p, std::vector<uint16_t>& out, std::vector<float>& lse,
                         std::vector<float>& max_logits) {
      out.assign(rows * 512, 0xFFFF);
      lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
      max_logits.assign(rows, std::numeric_limits<float>::quiet_NaN());
      MlaPrefillParams q = p;
      q.out = out.data();
      q.lse = lse.data();
      q.max_logits = max_logits.data();
      MlaSparsePrefill prefill(Device::kCpu);
      prefill.run(q);
    };
    std::vector<uint16_t> dense_out, paged_out;
    std::vector<float> dense_lse, paged_lse, dense_max, paged_max;
    run(pb.host_params(nullptr, nullptr, nullptr), dense_out, dense_lse, dense_max);
    // The rows in blocks of 4, handed out in reverse order; pool rows no position uses are NaN.
    constexpr int32_t kBlock = 4;
    const int32_t max_blocks = static_cast<int32_t>((pb.kv_len + kBlock - 1) / kBlock);
    std::vector<int32_t> order(static_cast<size_t>(spec.batch) * max_blocks + 1);
    std::iota(order.rbegin(), order.rend(), 0);
    const testing::MlaPrefillPool pool = testing::make_mla_prefill_pool(pb, kBlock, max_blocks, order);
    const MlaPrefillParams p = pool.paged(pb.host_params(nullptr, nullptr, nullptr));
    run(p, paged_out, paged_lse, paged_max);
    EXPECT_EQ(paged_out, dense_out) << "fp8 " << fp8;
    EXPECT_EQ(0, std::memcmp(paged_lse.data(), dense_lse.data(), rows * 4)) << "fp8 " << fp8;
    EXPECT_EQ(0, std::memcmp(paged_max.data(), dense_max.data(), rows * 4)) << "fp8 " << fp8;
    for (float m : paged_max) EXPECT_FALSE(std::isnan(m)) << "fp8 " << fp8;
  }
}

TEST(PrefillApi, BlockIndexerRefusesKeysPastAnEmptyViewsCapacity) {
  std::vector<uint16_t> keys(64 * 16), q(16);
  std::vector<int32_t> ids(4, -7), counts(1, -7);
  BlockPrefillIndexerParams p;
  p.chunk = {1, 1, 1, nullptr};
  p.num_kv_heads = 1;
  p.head_dim = 16;
  p.block_size = 1;
  p.top_blocks = 2;
  p.index_keys = RowView::dense(keys.data(), 1, 0, 16);  // capacity 0: no row may be read
  p.q_index = q.data();
  p.block_ids = ids.data();
  p.counts = counts.data();
  BlockPrefillIndexer indexer(Device::kCpu);
  try {
    indexer.run(p);
    FAIL() << "keys past an empty view were read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("index_keys.capacity = 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(counts[0], -7);
  p.index_keys.capacity = 1;  // the same call over one row runs
  indexer.run(p);
  EXPECT_EQ(counts[0], 1);
}

TEST(PrefillApi, MlaWithoutTheCausalLimitReadsAnyRowBelowTheLength) {
  testing::MlaPrefillSpec spec;
  spec.num_tokens = 6;
  spec.num_heads = 2;
  spec.topk = 5;
  spec.starts = {10};
  spec.pad_fraction = 0.0;
  testing::MlaPrefillProblem pb = testing::make_mla_prefill_problem(spec);
  // Token 0 (position 10) takes a row the last token attends past its own position.
  const int32_t n = spec.num_tokens, topk = spec.topk;
  int32_t later = -1;
  for (int32_t i = 0; i < topk; ++i) later = std::max(later, pb.indices[static_cast<size_t>((n - 1) * topk + i)]);
  ASSERT_GT(later, 10);
  pb.indices[0] = later;
  const size_t rows = static_cast<size_t>(n) * spec.num_heads;
  std::vector<uint16_t> out(rows * 512, 0xFFFF);
  std::vector<float> lse(rows, -7.0f), max_logits(rows, -7.0f);
  MlaSparsePrefill prefill(Device::kCpu);
  MlaPrefillParams p = pb.host_params(out.data(), lse.data(), max_logits.data());
  EXPECT_THROW(prefill.run(p), Error);  // causal: a later position
  for (uint16_t v : out) ASSERT_EQ(v, 0xFFFF);
  p.causal = false;
  prefill.run(p);
  std::vector<float> out_f(out.size());
  to_float(DType::kBF16, out.data(), out_f.data(), out_f.size());
  EXPECT_EQ(
      testing::compare_mla_prefill(pb, testing::mla_prefill_reference(pb), out_f, lse, &max_logits, 1e-2, 1e-4, 1e-4),
      "");
  // Past the length is still refused, causal or not.
  pb.indices[0] = static_cast<int32_t>(pb.kv_len);
  p = pb.host_params(out.data(), lse.data(), nullptr);
  p.causal = false;
  EXPECT_THROW(prefill.run(p), Error);
}

}  // namespace
}  // namespace sparsepage
