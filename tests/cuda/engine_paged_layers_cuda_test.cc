// The layers over an engine's paged pool (KVStorage::kEnginePaged) on the
// CUDA backend: the same checks as the CPU suite's
// (tests/support/engine_layer_checks.cc). Skipped without a GPU.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "support/engine_layer_checks.h"

namespace sparsepage {
namespace {

// The full sizes (the CPU suite's), or under the sanitizers
// (testing::quick_mode()) the same regimes at about a third of the tokens:
// block-sparse top-2 (sparse past 256 tokens, not 512) from prompts of 150
// (dense) and 330 (sparse, twice the selection for the layer cache's
// sparsity gate) instead of 300 and 900, misuse at 200 instead of 600; DSA
// top-32 from prompts of 20 and 70 instead of 40 and 150, misuse at 40
// instead of 100.
testing::EnginePagedSizes sizes() {
  testing::EnginePagedSizes s;
  if (!testing::quick_mode()) return s;
  s.block_topk = 2;
  s.block_dense_prompt = 150;
  s.block_dense_table = 12;
  s.block_sparse_prompt = 330;
  s.block_sparse_table = 24;
  s.block_misuse_prompt = 200;
  s.dsa_topk = 32;
  s.dsa_short_prompt = 20;
  s.dsa_long_prompt = 70;
  s.dsa_misuse_prompt = 40;
  return s;
}

TEST(EnginePagedLayersCuda, BlockSparseMatchesItsOwnCacheAndFp64) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_block_sparse(Device::kCuda, sizes());
}

TEST(EnginePagedLayersCuda, DsaMatchesItsOwnCache) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_dsa(Device::kCuda, sizes());
}

TEST(EnginePagedLayersCuda, DsaOverAnFp8PoolMatchesItsOwnCache) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_dsa_fp8(Device::kCuda, sizes());
}

TEST(EnginePagedLayersCuda, MisuseIsRefusedByNameAndAppendsNothing) {
  SKIP_WITHOUT_CUDA();
  testing::check_engine_paged_errors(Device::kCuda, sizes());
}

}  // namespace
}  // namespace sparsepage
