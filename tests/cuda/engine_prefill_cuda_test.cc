// Chunked prefill over an engine's paged pool on CUDA (prefill(tokens, kv,
// num_tokens), KVStorage::kEnginePaged): the CPU suite's checks
// (tests/cpu/engine_prefill_test.cc) at the shapes the CUDA prefill kernels
// take: against the layer over its own cache, fp64 and token-by-token
// engine-paged decode, in ragged batches with a free slot, and bad chunks
// refused by name. Every test skips without a GPU.
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "support/engine_prefill.h"

namespace sparsepage {
namespace {

using testing::EnginePrefillCase;

// The CUDA prefill indexer scores 64- or 128-token blocks at head_dim 128;
// top-2: the dense regime ends at 256 tokens.
BlockSparseConfig block_config() { return {8, 2, 128, 64, 2, 1, 256}; }

// 64 query heads: the MLA prefill runs 64 heads per CTA.
DsaConfig dsa_config() { return {64, 512, 64, 8, 64, 64, 0.0f, 256}; }

TEST(EnginePrefillCuda, BlockSparseMatchesItsOwnCacheFp64AndDecode) {
  SKIP_WITHOUT_CUDA();
  for (const EnginePrefillCase& c : {EnginePrefillCase{{0}, 128, 1}, EnginePrefillCase{{256}, 192, 2}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_engine_paged_block_prefill(Device::kCuda, block_config(), c);
  }
}

TEST(EnginePrefillCuda, BlockSparseRaggedBatchWithAFreeSlot) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_block_prefill(Device::kCuda, block_config(), {{0, -1, 320}, 100, 3});
}

TEST(EnginePrefillCuda, DsaMatchesItsOwnCacheFp64AndDecode) {
  SKIP_WITHOUT_CUDA();
  for (const EnginePrefillCase& c : {EnginePrefillCase{{0}, 32, 1}, EnginePrefillCase{{100}, 24, 2}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_engine_paged_dsa_prefill(Device::kCuda, dsa_config(), c);
  }
}

TEST(EnginePrefillCuda, DsaRaggedBatchWithAFreeSlot) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_dsa_prefill(Device::kCuda, dsa_config(), {{10, 90, -1}, 16, 3});
}

TEST(EnginePrefillCuda, DsaOverFp8RowsMatchesFp64AndDecode) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_dsa_prefill_fp8(Device::kCuda, dsa_config(), {{0}, 32, 6});
  testing::check_engine_paged_dsa_prefill_fp8(Device::kCuda, dsa_config(), {{100, -1, 10}, 24, 7});
}

// The pools form at the indexer's production geometry (64 index heads x
// 128: the FP8 keys' scoring kernel takes only that).
DsaConfig pools_config() { return {64, 512, 64, 64, 128, 64, 0.0f, 256}; }

TEST(EnginePoolsPrefillCuda, DsaOverBf16KeysMatchesTheEnginePagedPrefill) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_pools_dsa_prefill(Device::kCuda, pools_config(), {{0}, 32, 1}, false, false);
  testing::check_engine_pools_dsa_prefill(Device::kCuda, pools_config(), {{100, 40, 70}, 24, 2}, false, false);
  testing::check_engine_pools_dsa_prefill(Device::kCuda, pools_config(), {{100, -1, 10}, 24, 3}, false, false);
}

TEST(EnginePoolsPrefillCuda, DsaOverFp8KeysMatchesTheEnginePagedPrefill) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_pools_dsa_prefill(Device::kCuda, pools_config(), {{100, 40, 70}, 24, 4}, true, false);
  testing::check_engine_pools_dsa_prefill(Device::kCuda, pools_config(), {{100, -1, 10}, 24, 5}, true, true);
}

// The pools form over 16-token engine blocks: dense, sparse with a free
// slot, and a chunk of two query blocks crossing into the sparse regime.
TEST(EnginePoolsPrefillCuda, BlockSparseOverBf16KeysMatchesTheEnginePagedPrefillAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_pools_block_prefill(Device::kCuda, block_config(), {{64, 128}, 64, 6}, false);
  testing::check_engine_pools_block_prefill(Device::kCuda, block_config(), {{256, -1, 128}, 128, 7}, false);
  testing::check_engine_pools_block_prefill(Device::kCuda, block_config(), {{192, 320}, 100, 8}, false);
}

TEST(EnginePoolsPrefillCuda, BlockSparseOverFp8KeysMatchesTheEnginePagedPrefillAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_pools_block_prefill(Device::kCuda, block_config(), {{64, 128}, 64, 9}, true);
  testing::check_engine_pools_block_prefill(Device::kCuda, block_config(), {{256, -1, 128}, 128, 10}, true);
  // 128-token blocks: the other score kernel shape.
  BlockSparseConfig wide = block_config();
  wide.block_size = 128;
  wide.capacity_step = 512;
  testing::check_engine_pools_block_prefill(Device::kCuda, wide, {{512, 640}, 128, 11}, true);
  testing::check_engine_pools_block_prefill(Device::kCuda, wide, {{512, -1, 256}, 128, 12}, false);
}

// An engine step with one slot prefilling and the others decoding, over
// engine pools: each request bit for bit as it is alone.
TEST(EnginePoolsMixedStepCuda, BlockSparsePrefillBesideDecodesEqualsEachRequestAlone) {
  SKIP_WITHOUT_CUDA();
  for (const bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8 keys" : "bf16 keys");
    testing::check_engine_pools_mixed_block_step(Device::kCuda, block_config(), 192, 300, 100, fp8);
  }
}

TEST(EnginePoolsMixedStepCuda, DsaPrefillBesideDecodesEqualsEachRequestAlone) {
  SKIP_WITHOUT_CUDA();
  for (const bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8 keys" : "bf16 keys");
    testing::check_engine_pools_mixed_dsa_step(Device::kCuda, pools_config(), 48, 100, 30, fp8);
  }
}

TEST(EnginePrefillCuda, BadChunksAreRefusedByNameAndChangeNothing) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_prefill_refusals(Device::kCuda);
}

}  // namespace
}  // namespace sparsepage
