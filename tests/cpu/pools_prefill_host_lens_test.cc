// Chunked prefill over engine-owned pools given the engine's host copy of
// the lengths (EnginePagedKV::host_seq_lens) on the CPU backend: chunk
// after chunk bit-identical to the form that reads kv.seq_lens, with a
// slot out of the call and every slot in it; bad host copies refused by
// name before o is written (tests/support/pools_prefill_chunks.h).
#include <gtest/gtest.h>

#include "support/pools_prefill_chunks.h"

namespace sparsepage {
namespace {

using testing::PoolsChunks;

// Blocks of 16 at head_dim 128, top-2: the sparse regime starts past 64 tokens.
BlockSparseConfig block_config() { return {8, 2, 128, 16, 2, 1, 64}; }

// The MLA prefill's shape at 4 heads, index keys of 128, top-24.
DsaConfig dsa_config() { return {4, 512, 64, 4, 128, 24, 0.0f, 64}; }

TEST(PoolsPrefillHostLensCpu, BlockSparseEqualsTheReadBackFormAndRefusesBadCopies) {
  testing::check_pools_host_lens(PoolsChunks(Device::kCpu, block_config(), {{64, -1, 32}, 32, 2, 1}));
  testing::check_pools_host_lens(PoolsChunks(Device::kCpu, block_config(), {{96, 48}, 48, 2, 2}));
}

TEST(PoolsPrefillHostLensCpu, DsaEqualsTheReadBackFormAndRefusesBadCopies) {
  testing::check_pools_host_lens(PoolsChunks(Device::kCpu, dsa_config(), {{40, -1, 9}, 12, 2, 3}));
  testing::check_pools_host_lens(PoolsChunks(Device::kCpu, dsa_config(), {{30, 50}, 16, 2, 4}));
}

}  // namespace
}  // namespace sparsepage
