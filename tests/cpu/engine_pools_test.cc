// The DSA step over engine-owned pools on the CPU backend (tests/support/engine_pools.h).
#include <gtest/gtest.h>

#include "support/engine_pools.h"

namespace sparsepage {
namespace {
TEST(EnginePools, DsaStepOverBf16Pools) { testing::check_dsa_engine_pools(Device::kCpu, false); }
TEST(EnginePools, DsaStepOverFp8Pools) { testing::check_dsa_engine_pools(Device::kCpu, true); }
}  // namespace
}  // namespace sparsepage
