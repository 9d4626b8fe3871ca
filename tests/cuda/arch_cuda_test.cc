// GPUs other than the one the kernels were tuned for: the dispatch, told the
// device is an sm_80 (the A100 class), declines the MLA shape by name before
// anything launches, and the DSA layer then falls back to its mask path and
// gives exactly the mask path's answer. Runs on the H200, where the mask
// path exists; on a real sm_80 the launchers refuse the MLA shape by the
// same name (cuda_arch_problem).
#include <cmath>
#include <random>
#include <string>

#include "cuda/cuda_test_util.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/models/dsa.h"
#include "support/layer_checks.h"

namespace sparsepage {
namespace {

// One decode token of a small DSA layer (the MLA attention shape 512 + 64).
struct Token {
  Buffer q, q_pe, q_index, weights, k_row, k_pe, o;
  Token(const DsaConfig& c, int32_t batch, std::mt19937_64& rng) {
    const size_t b = size_t(batch);
    q = upload(Device::kCuda, testing::random_values(DType::kBF16, b * c.num_qo_heads * c.latent_dim, rng));
    q_pe = upload(Device::kCuda, testing::random_values(DType::kBF16, b * c.num_qo_heads * c.rope_dim, rng));
    q_index = upload(Device::kCuda, testing::random_values(DType::kBF16, b * c.index_heads * c.index_head_dim, rng));
    weights = upload(Device::kCuda, std::vector<float>(b * c.index_heads, 0.5f));
    k_row = upload(Device::kCuda, testing::random_values(DType::kBF16, b * (c.latent_dim + c.index_head_dim), rng));
    k_pe = upload(Device::kCuda, testing::random_values(DType::kBF16, b * c.rope_dim, rng));
    o = upload(Device::kCuda, testing::nan_values(DType::kBF16, b * c.num_qo_heads * c.latent_dim));
  }
  DsaTokens view() {
    return {q.data(), q_pe.data(), q_index.data(), weights.as<float>(), k_row.data(), k_pe.data(), o.data()};
  }
  std::vector<uint8_t> output() const { return download<uint8_t>(Device::kCuda, o.data(), o.bytes()); }
};

DispatchConfig as_if(int32_t sm) {
  DispatchConfig config = testing::always_fuse();
  config.assume_sm = sm;
  return config;
}

TEST(ArchCuda, AnSm80DeclinesTheMlaShapeByNameAndTheLayerFallsBack) {
  SKIP_WITHOUT_CUDA();
  if (cuda_device_sm() != 90) GTEST_SKIP() << "needs an sm_90 device, found sm_" << cuda_device_sm();
  const DsaConfig c{16, 512, 64, 4, 128, 64, 0.0f, 128};
  const int32_t batch = 2;
  DsaAttention sm80(Device::kCuda, DType::kBF16, c, batch, as_if(80));
  DsaAttention masked(Device::kCuda, DType::kBF16, c, batch, testing::kill_switch());
  DsaAttention here(Device::kCuda, DType::kBF16, c, batch, testing::always_fuse());
  std::mt19937_64 rng(81);
  // Past twice the top-64 either way (the fused path's minimum sparsity);
  // the sanitizers' quick size is the shorter prompt.
  const int32_t tokens = testing::quick_mode() ? 140 : 200;
  for (int32_t t = 0; t < tokens; ++t) {
    std::mt19937_64 rng_b = rng, rng_d = rng;  // the three layers get the very same token
    Token a(c, batch, rng), b(c, batch, rng_b), d(c, batch, rng_d);
    if (t < tokens - 3) {
      sm80.prefill_token(a.view());
      masked.prefill_token(b.view());
      here.prefill_token(d.view());
      continue;
    }
    const LayerStep declined = sm80.decode(a.view());
    const LayerStep dense = masked.decode(b.view());
    const LayerStep fused = here.decode(d.view());
    ASSERT_TRUE(declined.sparse);
    EXPECT_FALSE(declined.fused);
    EXPECT_EQ(declined.outcome.kind, OutcomeKind::kUnsupportedArch) << declined.outcome.describe();
    EXPECT_NE(declined.outcome.reason.find("no fused kernel for sm_80 at the MLA shape"), std::string::npos)
        << declined.outcome.reason;
    EXPECT_TRUE(fused.fused) << "on the real device the same layer fuses: " << fused.outcome.describe();
    EXPECT_EQ(dense.outcome.kind, OutcomeKind::kKillSwitch);
    // The fallback is the mask path itself: the same bits.
    EXPECT_EQ(a.output(), b.output()) << "step " << t;
    const auto o = testing::as_float(DType::kBF16, a.output());
    for (float x : o) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(ArchCuda, TheDeviceAndTheBuildAgreeOnWhatRuns) {
  SKIP_WITHOUT_CUDA();
  const int32_t sm = cuda_device_sm();
  ASSERT_GE(sm, 80) << "the kernels need sm_80 or newer";
  // This device runs the GQA kernel (the test binary runs, so the build has it).
  EXPECT_EQ(cuda_arch_problem(sm, 128, 128, 0), "") << "built for " << cuda_built_architectures();
  if (sm == 90) {
    EXPECT_EQ(cuda_arch_problem(sm, 512, 512, 64), "");
  }
}

}  // namespace
}  // namespace sparsepage
