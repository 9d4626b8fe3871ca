// A refused sparse prefill writes nothing (CPU backend): every launch of a
// chunk is checked before the first one writes, so an engine that catches
// the error finds its output buffers as they were. Found by the fuzzer's
// prefill target: a bad entry in a later sequence was refused after the
// earlier sequences' rows were written.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "sparsepage/prefill.h"
#include "sparsepage/types.h"
#include "support/prefill_problem.h"

namespace sparsepage {
namespace {

TEST(PrefillRefusal, MlaEntryOfTheLastSequenceRefusesTheWholeChunk) {
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

TEST(PrefillRefusal, BlockListOfTheLastSequenceRefusesTheWholeChunk) {
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

}  // namespace
}  // namespace sparsepage
