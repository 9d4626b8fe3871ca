// Chunked prefill of the three layers on the CPU backend
// (SparseLayer::prefill_chunk): each chunk against fp64 over the positions it
// reports, against decoding the same tokens on a twin layer (the same sets,
// the same outputs), against prefill_token() in the dense regime, in ragged
// batches with free slots; a toy model's greedy tokens after a chunked
// prompt; and bad chunks refused by name before anything changes.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "support/layer_checks.h"
#include "support/prefill_layers.h"
#include "support/toy_model.h"

namespace sparsepage {
namespace {

using testing::LayerPrefillCase;
using testing::PrefillOracles;

// The MLA prefill kernel's shape (latent 512, rope 64) at 4 heads; top-24,
// so the regimes change within a short prompt.
DsaConfig dsa_config() { return {4, 512, 64, 4, 64, 24, 0.0f, 64}; }

// Blocks of 16 (a query block is one multi-token decode step, <= 16 tokens),
// top-2: the dense regime ends at 64 tokens.
BlockSparseConfig block_config() { return {8, 2, 64, 16, 2, 1, 64}; }

StaticBlockSparseConfig static_config() { return {8, 2, 64, 16, 2, 3, 64}; }

TEST(LayerPrefillCpu, DsaMatchesDecodeAndDenseOracles) {
  // A dense chunk, a sparse one, and one crossing top-k inside the chunk.
  for (const LayerPrefillCase& c :
       {LayerPrefillCase{{0}, 16, 1}, LayerPrefillCase{{40}, 12, 2}, LayerPrefillCase{{16}, 16, 3}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_dsa_prefill(Device::kCpu, dsa_config(), c, PrefillOracles{});
  }
}

TEST(LayerPrefillCpu, DsaRaggedBatchWithAFreeSlot) {
  testing::check_dsa_prefill(Device::kCpu, dsa_config(), {{5, 40, 17}, 8, 4}, PrefillOracles{});
  testing::check_dsa_prefill(Device::kCpu, dsa_config(), {{30, -1, 9}, 6, 5}, PrefillOracles{});
}

TEST(LayerPrefillCpu, BlockSparseMatchesDecodeAndDenseOracles) {
  for (const LayerPrefillCase& c :
       {LayerPrefillCase{{0}, 48, 1}, LayerPrefillCase{{64}, 40, 2}, LayerPrefillCase{{32}, 64, 3}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_block_sparse_prefill(Device::kCpu, block_config(), c, PrefillOracles{});
  }
  // Forced local blocks besides the own one.
  testing::check_block_sparse_prefill(Device::kCpu, {8, 2, 64, 16, 3, 2, 64}, {{96}, 32, 4}, PrefillOracles{});
}

TEST(LayerPrefillCpu, BlockSparseRaggedBatchWithAFreeSlot) {
  testing::check_block_sparse_prefill(Device::kCpu, block_config(), {{0, 48, 96}, 32, 5}, PrefillOracles{});
  // A partial last query block (20 = 16 + 4).
  testing::check_block_sparse_prefill(Device::kCpu, block_config(), {{16, -1, 80}, 20, 6}, PrefillOracles{});
}

TEST(LayerPrefillCpu, StaticMatchesDecode) {
  for (const LayerPrefillCase& c : {LayerPrefillCase{{0}, 64, 1}, LayerPrefillCase{{48}, 50, 2}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_static_prefill(Device::kCpu, static_config(), c, PrefillOracles{});
  }
}

TEST(LayerPrefillCpu, StaticRaggedBatchWithAFreeSlot) {
  testing::check_static_prefill(Device::kCpu, static_config(), {{0, 32, 112}, 32, 3}, PrefillOracles{});
  testing::check_static_prefill(Device::kCpu, static_config(), {{16, -1, 64}, 17, 4}, PrefillOracles{});
}

// The toy transformer: a prompt prefilled in chunks, then greedy decode,
// gives the same tokens as the prompt token by token. Block-sparse: the
// prompt stays in the dense regime (prefill_token() is dense) and decode
// runs into the sparse one; static: the pattern holds at every position, so
// a long prompt compares with decode() token by token.
TEST(LayerPrefillCpu, ToyModelGreedyTokensAfterAChunkedPrompt) {
  for (const auto kind : {testing::ToyAttention::kBlockSparse, testing::ToyAttention::kStaticBlockSparse}) {
    const bool is_static = kind == testing::ToyAttention::kStaticBlockSparse;
    testing::ToyModelConfig config;
    config.kind = kind;
    config.batch = 2;
    const size_t prompt_len = is_static ? 129 : 97;
    std::vector<std::vector<int32_t>> prompts(2);
    for (size_t i = 0; i < prompt_len; ++i) {
      prompts[0].push_back(static_cast<int32_t>((i * 7 + 3) % 96));
      prompts[1].push_back(static_cast<int32_t>((i * 13 + 5) % 96));
    }
    testing::ToyModel tokenwise(Device::kCpu, config, testing::always_fuse());
    config.prefill_chunk = 32;
    testing::ToyModel chunked(Device::kCpu, config, testing::always_fuse());
    const auto want = tokenwise.generate(prompts, 40);
    const auto got = chunked.generate(prompts, 40);
    EXPECT_EQ(got, want) << (is_static ? "static" : "block-sparse");
    EXPECT_GT(chunked.sparse_steps(), 0) << "decode must reach the sparse regime";
  }
}

// The DSA toy model at the MLA prefill's shape: a prompt within top-k
// (prefill_token() is dense, and so is the chunk) in chunks of 16, then
// greedy decode past top-k.
TEST(LayerPrefillCpu, DsaToyModelGreedyTokensAfterAChunkedPrompt) {
  testing::DsaToyConfig config = testing::DsaToyConfig::cuda_shape();
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 33; ++i) prompt.push_back((i * 11 + 2) % 96);
  testing::DsaToyModel tokenwise(Device::kCpu, config, testing::always_fuse());
  config.prefill_chunk = 16;
  testing::DsaToyModel chunked(Device::kCpu, config, testing::always_fuse());
  EXPECT_EQ(chunked.generate(prompt, 24), tokenwise.generate(prompt, 24));
  EXPECT_GT(chunked.sparse_steps(), 0) << "decode must pass top-k";
}

// Chunks through fixed input buffers, rewritten in place (the form a
// captured chunk replays on CUDA), against the same chunks run afresh.
TEST(LayerPrefillCpu, ChunksThroughFixedBuffers) {
  const auto eager = [](const std::function<void(void*)>& chunk) { chunk(nullptr); };
  const PrefillOracles o;
  testing::check_dsa_prefill_replay(Device::kCpu, dsa_config(), {{0, 30, 64}, 8, 6}, 4, o, eager);
  testing::check_block_sparse_prefill_replay(Device::kCpu, block_config(), {{0, 16, 64}, 32, 7}, 4, o, eager);
  testing::check_static_prefill_replay(Device::kCpu, static_config(), {{0, 32, 16}, 16, 8}, 4, o, eager);
  // A free slot: each active slot a chunk of its own, the free slot's rows zeroed every chunk.
  testing::check_dsa_prefill_replay(Device::kCpu, dsa_config(), {{30, -1, 64}, 8, 9}, 3, o, eager);
  testing::check_block_sparse_prefill_replay(Device::kCpu, block_config(), {{16, -1, 64}, 32, 10}, 3, o, eager);
  testing::check_static_prefill_replay(Device::kCpu, static_config(), {{32, -1, 16}, 16, 11}, 3, o, eager);
}

TEST(LayerPrefillCpu, BadChunksAreRefusedByNameBeforeAnythingChanges) { testing::check_prefill_refusals(Device::kCpu); }

}  // namespace
}  // namespace sparsepage
