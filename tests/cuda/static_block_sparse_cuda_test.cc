// The static per-query-head block-sparse layer on the GPU: the shared checks
// (set equality with the mask path, fp64 with NaN rows, greedy equality), and
// the device page matrix against its CPU twin.
#include <gtest/gtest.h>

#include <random>

#include "cuda/cuda_test_util.h"
#include "sparsepage/models/static_block_sparse.h"
#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

const StaticBlockSparseConfig kSmall{8, 2, 64, 16, 2, 4, 64};

TEST(StaticBlockSparseCuda, SetEqualityWithTheMaskPath) {
  SKIP_WITHOUT_CUDA();
  testing::check_static_set_equality(Device::kCuda, kSmall, {{1, 1}, {1, 192}, {2, 193}, {3, 257}, {2, 1000}});
}

TEST(StaticBlockSparseCuda, SetEqualityAtPhi3SmallGeometry) {
  SKIP_WITHOUT_CUDA();
  // On and off the 64-token blocks, across a 4096-token capacity step.
  if (!testing::quick_mode()) {
    testing::check_static_set_equality(Device::kCuda, StaticBlockSparseConfig{},
                                       {{2, 2560}, {3, 2600}, {2, 4096}, {2, 4109}, {1, 8192}});
    return;
  }
  // Under the sanitizers a quarter of the tokens: the two fused contexts,
  // and one token past a block edge across two capacity steps of 1024 (the
  // pattern does not depend on the step).
  StaticBlockSparseConfig quick;
  quick.capacity_step = 1024;
  testing::check_static_set_equality(Device::kCuda, quick, {{1, 2560}, {2, 2600}, {1, 2049}});
}

TEST(StaticBlockSparseCuda, MatchesTheFp64ReferenceWithUnusedRowsPoisoned) {
  SKIP_WITHOUT_CUDA();
  StaticBlockSparseConfig sparse = kSmall;
  sparse.vert_stride = 8;
  testing::check_static_against_reference(Device::kCuda, sparse, 3, 401);
  testing::check_static_against_reference(Device::kCuda, StaticBlockSparseConfig{}, 3, 4001);
}

TEST(StaticBlockSparseCuda, GreedyDecodeEquality) {
  SKIP_WITHOUT_CUDA();
  testing::check_static_greedy_equality(Device::kCuda, 2, testing::quick_steps(64));
}

// The device kernel and its CPU twin write the same page matrix, and the
// fused GPU step agrees with the fused CPU step over the same cache.
TEST(StaticBlockSparseCuda, DevicePagesEqualTheCpuTwin) {
  SKIP_WITHOUT_CUDA();
  const StaticBlockSparseConfig c;
  const int32_t batch = 2;
  StaticBlockSparseAttention gpu(Device::kCuda, DType::kBF16, c, batch, testing::always_fuse());
  StaticBlockSparseAttention cpu(Device::kCpu, DType::kBF16, c, batch, testing::always_fuse());
  std::mt19937_64 rng(44);
  const int64_t prompt = 3000;
  const size_t kv = size_t(batch) * c.num_kv_heads * c.head_dim;
  const auto k = testing::random_values(DType::kBF16, kv * prompt, rng);
  const auto v = testing::random_values(DType::kBF16, kv * prompt, rng);
  const Buffer kd = upload(Device::kCuda, k), vd = upload(Device::kCuda, v);
  gpu.append_tokens(kd.data(), vd.data(), prompt);
  cpu.append_tokens(k.data(), v.data(), prompt);
  for (int step = 0; step < 3; ++step) {  // 3001 .. 3003 tokens
    const auto q = testing::random_values(DType::kBF16, size_t(batch) * c.num_qo_heads * c.head_dim, rng);
    const auto k1 = testing::random_values(DType::kBF16, kv, rng);
    const auto v1 = testing::random_values(DType::kBF16, kv, rng);
    std::vector<uint8_t> o_cpu = testing::nan_values(DType::kBF16, size_t(batch) * c.num_qo_heads * c.head_dim);
    const Buffer qd = upload(Device::kCuda, q), k1d = upload(Device::kCuda, k1), v1d = upload(Device::kCuda, v1);
    Buffer od = upload(Device::kCuda, o_cpu);
    const LayerStep g = gpu.decode({qd.data(), k1d.data(), v1d.data(), od.data()});
    const LayerStep h = cpu.decode({q.data(), k1.data(), v1.data(), o_cpu.data()});
    ASSERT_TRUE(g.fused && h.fused) << g.outcome.describe() << " / " << h.outcome.describe();
    EXPECT_EQ(gpu.last_blocks(), cpu.last_blocks()) << "step " << step;
    EXPECT_EQ(gpu.last_selected_positions(), cpu.last_selected_positions()) << "step " << step;
    const auto o_gpu = testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, od.data(), od.bytes()));
    const auto o_ref = testing::as_float(DType::kBF16, o_cpu);
    EXPECT_LT(testing::relative_l2(o_gpu, std::vector<double>(o_ref.begin(), o_ref.end())), 1e-2) << "step " << step;
  }
}

// Host-side: refused by name before anything is allocated (no GPU needed).
TEST(StaticBlockSparseCuda, RefusesAHeadDimWithoutAKernel) {
  StaticBlockSparseConfig c;
  c.head_dim = 96;
  EXPECT_TRUE(testing::throws_error_naming([&] { StaticBlockSparseAttention(Device::kCuda, DType::kBF16, c, 1); },
                                           "no CUDA kernel for head_dim 96"));
}

}  // namespace
}  // namespace sparsepage
