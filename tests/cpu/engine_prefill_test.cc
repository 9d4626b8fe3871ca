// Chunked prefill over an engine's paged pool on the CPU backend
// (prefill(tokens, kv, num_tokens), KVStorage::kEnginePaged): against the
// layer over its own cache, fp64 and token-by-token engine-paged decode, in
// ragged batches with a free slot; bad chunks refused by name, the layer
// unchanged.
#include <gtest/gtest.h>

#include "support/engine_prefill.h"

namespace sparsepage {
namespace {

using testing::EnginePrefillCase;

// Blocks of 16, top-2 (the dense regime ends at 64 tokens).
BlockSparseConfig block_config() { return {8, 2, 64, 16, 2, 1, 64}; }

// The MLA prefill's shape at 4 heads, top-24.
DsaConfig dsa_config() { return {4, 512, 64, 4, 64, 24, 0.0f, 64}; }

TEST(EnginePrefillCpu, BlockSparseMatchesItsOwnCacheFp64AndDecode) {
  // Dense, sparse, and crossing into the sparse regime inside the chunk.
  for (const EnginePrefillCase& c :
       {EnginePrefillCase{{0}, 48, 1}, EnginePrefillCase{{64}, 40, 2}, EnginePrefillCase{{32}, 64, 3}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_engine_paged_block_prefill(Device::kCpu, block_config(), c);
  }
}

TEST(EnginePrefillCpu, BlockSparseRaggedBatchWithAFreeSlot) {
  testing::check_engine_paged_block_prefill(Device::kCpu, block_config(), {{0, 48, 96}, 32, 4});
  testing::check_engine_paged_block_prefill(Device::kCpu, block_config(), {{16, -1, 80}, 20, 5});  // a partial block
}

TEST(EnginePrefillCpu, DsaMatchesItsOwnCacheFp64AndDecode) {
  for (const EnginePrefillCase& c :
       {EnginePrefillCase{{0}, 16, 1}, EnginePrefillCase{{40}, 12, 2}, EnginePrefillCase{{16}, 16, 3}}) {
    SCOPED_TRACE("prompt " + std::to_string(c.prompt[0]) + ", chunk " + std::to_string(c.num_tokens));
    testing::check_engine_paged_dsa_prefill(Device::kCpu, dsa_config(), c);
  }
}

TEST(EnginePrefillCpu, DsaRaggedBatchWithAFreeSlot) {
  testing::check_engine_paged_dsa_prefill(Device::kCpu, dsa_config(), {{5, 40, 17}, 8, 4});
  testing::check_engine_paged_dsa_prefill(Device::kCpu, dsa_config(), {{30, -1, 9}, 6, 5});
}

TEST(EnginePrefillCpu, DsaOverFp8RowsMatchesFp64AndDecode) {
  testing::check_engine_paged_dsa_prefill_fp8(Device::kCpu, dsa_config(), {{0}, 16, 6});
  testing::check_engine_paged_dsa_prefill_fp8(Device::kCpu, dsa_config(), {{40}, 12, 7});
  testing::check_engine_paged_dsa_prefill_fp8(Device::kCpu, dsa_config(), {{5, -1, 30}, 8, 8});
}

// The pools form: index keys of 128 values (vLLM's FP8 blocks hold 128).
DsaConfig pools_config() { return {4, 512, 64, 4, 128, 24, 0.0f, 64}; }

TEST(EnginePoolsPrefillCpu, DsaOverBf16KeysMatchesTheEnginePagedPrefill) {
  testing::check_engine_pools_dsa_prefill(Device::kCpu, pools_config(), {{0}, 16, 1}, false, false);
  testing::check_engine_pools_dsa_prefill(Device::kCpu, pools_config(), {{40, -1, 9}, 20, 2}, false, false);
  testing::check_engine_pools_dsa_prefill(Device::kCpu, pools_config(), {{40, 9, 70}, 8, 5}, false, false);
}

TEST(EnginePoolsPrefillCpu, DsaOverFp8KeysMatchesTheEnginePagedPrefill) {
  testing::check_engine_pools_dsa_prefill(Device::kCpu, pools_config(), {{40}, 12, 3}, true, false);
  testing::check_engine_pools_dsa_prefill(Device::kCpu, pools_config(), {{5, 33, -1}, 18, 4}, true, true);
}

// Blocks of 16 at head_dim 128 (vLLM's FP8 key blocks hold 128 values), top-2.
BlockSparseConfig pools_block_config() { return {8, 2, 128, 16, 2, 1, 64}; }

TEST(EnginePoolsPrefillCpu, BlockSparseOverBf16AndFp8KeysMatchesTheEnginePagedPrefill) {
  for (const bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8 keys" : "bf16 keys");
    testing::check_engine_pools_block_prefill(Device::kCpu, pools_block_config(), {{64}, 48, 1}, fp8);
    testing::check_engine_pools_block_prefill(Device::kCpu, pools_block_config(), {{0, 96, 32}, 32, 2}, fp8);
    testing::check_engine_pools_block_prefill(Device::kCpu, pools_block_config(), {{80, -1, 16}, 20, 3}, fp8);
  }
}

// An engine step with one slot prefilling and the others decoding, over
// engine pools: each request as it is alone (support/engine_prefill.h).
TEST(EnginePoolsMixedStepCpu, BlockSparsePrefillBesideDecodesEqualsEachRequestAlone) {
  for (const bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8 keys" : "bf16 keys");
    testing::check_engine_pools_mixed_block_step(Device::kCpu, pools_block_config(), 48, 100, 40, fp8);
  }
}

TEST(EnginePoolsMixedStepCpu, DsaPrefillBesideDecodesEqualsEachRequestAlone) {
  for (const bool fp8 : {false, true}) {
    SCOPED_TRACE(fp8 ? "fp8 keys" : "bf16 keys");
    testing::check_engine_pools_mixed_dsa_step(Device::kCpu, pools_config(), 16, 50, 10, fp8);
  }
}

TEST(EnginePrefillCpu, BadChunksAreRefusedByNameAndChangeNothing) {
  testing::check_engine_prefill_refusals(Device::kCpu);
}

}  // namespace
}  // namespace sparsepage
