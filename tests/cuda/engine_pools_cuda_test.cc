// The DSA step over engine-owned pools on the GPU (tests/support/engine_pools.h).
#include <gtest/gtest.h>

#include "cuda/cuda_test_util.h"
#include "support/engine_pools.h"

namespace sparsepage {
namespace {
TEST(EnginePoolsCuda, DsaStepOverBf16Pools) {
  SKIP_WITHOUT_CUDA();
  testing::check_dsa_engine_pools(Device::kCuda, false);
}
TEST(EnginePoolsCuda, DsaStepOverFp8Pools) {
  SKIP_WITHOUT_CUDA();
  testing::check_dsa_engine_pools(Device::kCuda, true);
}
}  // namespace
}  // namespace sparsepage
