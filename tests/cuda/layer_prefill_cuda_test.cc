// Chunked prefill of the three layers on CUDA (SparseLayer::prefill_chunk):
// the CPU suite's checks (tests/cpu/layer_prefill_test.cc) at the shapes the
// CUDA prefill kernels take, against fp64 over the reported sets, decode or
// prefill_token() twins and the same chunk on the CPU backend (sets equal,
// bf16 outputs within 1e-2), and chunks captured in a CUDA graph and
// replayed while the lengths grow. Every test skips without a GPU.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "cuda/graph_runner.h"
#include "support/layer_checks.h"
#include "support/prefill_layers.h"
#include "support/toy_model.h"

namespace sparsepage {
namespace {

using testing::LayerPrefillCase;
using testing::PrefillOracles;

// 64 query heads: the MLA prefill runs 64 heads per CTA.
DsaConfig dsa_config() { return {64, 512, 64, 8, 64, 64, 0.0f, 256}; }

// The CUDA prefill indexer scores 64- or 128-token blocks at head_dim 128;
// top-2: the dense regime ends at 256 tokens.
BlockSparseConfig block_config() { return {8, 2, 128, 64, 2, 1, 256}; }

StaticBlockSparseConfig static_config() { return {8, 2, 128, 64, 2, 3, 256}; }

PrefillOracles gpu_oracles(bool decode) {
  PrefillOracles o;
  o.decode = decode;
  o.cpu_twin = true;
  o.tol = 1e-2;
  o.fp64_tol = 1e-2;
  return o;
}

TEST(LayerPrefillCuda, DsaMatchesDecodeDenseAndCpu) {
  SKIP_WITHOUT_CUDA();
  for (const LayerPrefillCase& c :
       {LayerPrefillCase{{0}, 48, 1}, LayerPrefillCase{{100}, 40, 2}, LayerPrefillCase{{40}, 48, 3}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_dsa_prefill(Device::kCuda, dsa_config(), c, gpu_oracles(true));
  }
}

TEST(LayerPrefillCuda, DsaRaggedBatchWithAFreeSlot) {
  SKIP_WITHOUT_CUDA();
  testing::check_dsa_prefill(Device::kCuda, dsa_config(), {{5, 100, 30}, 32, 4}, gpu_oracles(true));
  testing::check_dsa_prefill(Device::kCuda, dsa_config(), {{70, -1, 9}, 24, 5}, gpu_oracles(true));
}

// A query block of 64 tokens is past the multi-token decode's 16: the
// block-sparse sets are checked against the CPU backend (whose own suite
// checks them against decode) and, dense, against prefill_token().
TEST(LayerPrefillCuda, BlockSparseMatchesDenseAndCpu) {
  SKIP_WITHOUT_CUDA();
  for (const LayerPrefillCase& c :
       {LayerPrefillCase{{0}, 192, 1}, LayerPrefillCase{{256}, 128, 2}, LayerPrefillCase{{128}, 256, 3}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_block_sparse_prefill(Device::kCuda, block_config(), c, gpu_oracles(false));
  }
}

TEST(LayerPrefillCuda, BlockSparseRaggedBatchWithAFreeSlot) {
  SKIP_WITHOUT_CUDA();
  testing::check_block_sparse_prefill(Device::kCuda, block_config(), {{0, 128, 320}, 64, 4}, gpu_oracles(false));
  testing::check_block_sparse_prefill(Device::kCuda, block_config(), {{64, -1, 256}, 80, 5}, gpu_oracles(false));
}

TEST(LayerPrefillCuda, StaticMatchesDecodeAndCpu) {
  SKIP_WITHOUT_CUDA();
  testing::check_static_prefill(Device::kCuda, static_config(), {{0}, 256, 1}, gpu_oracles(true));
  testing::check_static_prefill(Device::kCuda, static_config(), {{192}, 100, 2}, gpu_oracles(true));
  testing::check_static_prefill(Device::kCuda, static_config(), {{0, 128, 448}, 64, 3}, gpu_oracles(true));
  testing::check_static_prefill(Device::kCuda, static_config(), {{64, -1, 256}, 65, 4}, gpu_oracles(true));
}

// A chunk runner whose second call is captured in a CUDA graph and
// replayed for it and every later call.
testing::ChunkRunner runner() {
  auto graph = std::make_shared<testing::GraphRunner>();
  return [graph](const std::function<void(void*)>& chunk) {
    (*graph)([&](void* stream) {
      chunk(stream);
      return LayerStep{};
    });
  };
}

// The second chunk is captured in a CUDA graph and replayed for the rest,
// its inputs rewritten in place, the slots' lengths growing on the device.
TEST(LayerPrefillCuda, ChunksReplayFromACapturedGraph) {
  SKIP_WITHOUT_CUDA();
  const PrefillOracles o = gpu_oracles(false);
  testing::check_dsa_prefill_replay(Device::kCuda, dsa_config(), {{0, 30, 64}, 32, 6}, 4, o, runner());
  testing::check_block_sparse_prefill_replay(Device::kCuda, block_config(), {{0, 64, 256}, 128, 7}, 4, o, runner());
  testing::check_static_prefill_replay(Device::kCuda, static_config(), {{0, 128, 64}, 64, 8}, 4, o, runner());
}

// The same with a free slot in the batch: one launch per active slot and
// the free slot's rows zeroed on the stream, all inside the graph.
TEST(LayerPrefillCuda, ChunksWithAFreeSlotReplayFromACapturedGraph) {
  SKIP_WITHOUT_CUDA();
  const PrefillOracles o = gpu_oracles(false);
  testing::check_dsa_prefill_replay(Device::kCuda, dsa_config(), {{30, -1, 64}, 32, 9}, 3, o, runner());
  testing::check_block_sparse_prefill_replay(Device::kCuda, block_config(), {{64, -1, 256}, 128, 10}, 3, o, runner());
  testing::check_static_prefill_replay(Device::kCuda, static_config(), {{128, -1, 64}, 64, 11}, 3, o, runner());
}

TEST(LayerPrefillCuda, ToyModelGreedyTokensAfterAChunkedPrompt) {
  SKIP_WITHOUT_CUDA();
  testing::ToyModelConfig config;
  config.kind = testing::ToyAttention::kStaticBlockSparse;
  config.static_attention = {8, 2, 64, 16, 2, 4, 64};
  config.batch = 2;
  std::vector<std::vector<int32_t>> prompts(2);
  for (int32_t i = 0; i < 129; ++i) {
    prompts[0].push_back((i * 7 + 3) % 96);
    prompts[1].push_back((i * 13 + 5) % 96);
  }
  testing::ToyModel tokenwise(Device::kCuda, config, testing::always_fuse());
  config.prefill_chunk = 32;
  testing::ToyModel chunked(Device::kCuda, config, testing::always_fuse());
  EXPECT_EQ(chunked.generate(prompts, testing::quick_steps(40)), tokenwise.generate(prompts, testing::quick_steps(40)));
  EXPECT_GT(chunked.sparse_steps(), 0);
}

TEST(LayerPrefillCuda, DsaToyModelGreedyTokensAfterAChunkedPrompt) {
  SKIP_WITHOUT_CUDA();
  testing::DsaToyConfig config = testing::DsaToyConfig::cuda_shape();
  config.attention.num_qo_heads = 64;  // the MLA prefill runs 64 heads per CTA
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 33; ++i) prompt.push_back((i * 11 + 2) % 96);
  testing::DsaToyModel tokenwise(Device::kCuda, config, testing::always_fuse());
  config.prefill_chunk = 16;
  testing::DsaToyModel chunked(Device::kCuda, config, testing::always_fuse());
  EXPECT_EQ(chunked.generate(prompt, testing::quick_steps(24)), tokenwise.generate(prompt, testing::quick_steps(24)));
  EXPECT_GT(chunked.sparse_steps(), 0);
}

TEST(LayerPrefillCuda, BadChunksAreRefusedByNameBeforeAnythingChanges) {
  SKIP_WITHOUT_CUDA();
  testing::check_prefill_refusals(Device::kCuda);
}

}  // namespace
}  // namespace sparsepage
