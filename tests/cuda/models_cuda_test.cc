// The model-layer checks of tests/support/layer_checks.h on the GPU: the
// indexer, block expansion, mask building, fused decode and mask path all
// run on the device.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "sparsepage/sparse_decode.h"
#include "support/layer_checks.h"

namespace sparsepage {
namespace {

TEST(BlockSparseCuda, SetEqualityWithTheMaskPath) {
  SKIP_WITHOUT_CUDA();
  testing::check_block_sparse_set_equality(Device::kCuda);
}

TEST(BlockSparseCuda, GreedyDecodeEquality) {
  SKIP_WITHOUT_CUDA();
  testing::check_block_sparse_greedy_equality(Device::kCuda);
}

// A selection naming a position past the live window must never read another
// request's rows: NaN output, the error flag, and check_errors() throws.
TEST(SparseDecodeCuda, PositionOutsideTheWindowIsRejected) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(5);
  const int64_t cap = 256, live = 200;
  Buffer k = upload(Device::kCuda, testing::random_values(DType::kBF16, size_t(2 * cap * 64), rng));
  Buffer v = upload(Device::kCuda, testing::random_values(DType::kBF16, size_t(2 * cap * 64), rng));
  Buffer q = upload(Device::kCuda, testing::random_values(DType::kBF16, size_t(2 * 4 * 64), rng));
  Buffer o = upload(Device::kCuda, testing::nan_values(DType::kBF16, size_t(2 * 4 * 64)));
  SparseAttentionInputs in;
  in.device = Device::kCuda;
  in.batch = 1;
  in.num_qo_heads = 8;
  in.num_kv_heads = 2;
  in.live_len = live;
  in.k = {k.data(), 2, cap, 64, 64};
  in.v = {v.data(), 2, cap, 64, 64};
  in.q = q.data();
  in.o = o.data();
  in.scale = 0.125f;
  DispatchConfig config = DispatchConfig::defaults();
  config.min_kv_tokens_per_request = 0;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCuda, config);
  // Request 0 names position 230: inside the allocation (capacity 256) but past the window.
  const SparseSelection bad = make_selection(Device::kCuda, {{3, 230, 7}, {1, 2, 3}});
  ASSERT_TRUE(decoder.try_fused(in, bad).fused());
  EXPECT_THROW(decoder.check_errors(), Error);
  const auto out = testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  for (int i = 0; i < 4 * 64; ++i) ASSERT_TRUE(std::isnan(out[size_t(i)])) << "request 0 must be poisoned";
  for (int i = 4 * 64; i < 8 * 64; ++i) ASSERT_TRUE(std::isfinite(out[size_t(i)])) << "request 1 is valid";
  const SparseSelection good = make_selection(Device::kCuda, {{3, 199, 7}, {1, 2, 3}});
  ASSERT_TRUE(decoder.try_fused(in, good).fused());
  EXPECT_NO_THROW(decoder.check_errors());
}

}  // namespace
}  // namespace sparsepage
