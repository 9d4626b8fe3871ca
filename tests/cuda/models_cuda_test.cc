// The model-layer checks of tests/support/layer_checks.h on the GPU: the
// indexer, block expansion, mask building, fused decode and mask path all
// run on the device.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <set>

#include "cuda_test_util.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/sparse_decode.h"
#include "support/layer_checks.h"

namespace sparsepage {
namespace {

TEST(BlockSparseCuda, SetEqualityWithTheMaskPath) {
  SKIP_WITHOUT_CUDA();
  if (!testing::quick_mode()) {
    testing::check_block_sparse_set_equality(Device::kCuda);
    return;
  }
  // Under the sanitizers: top-2 blocks of 16 (sparse past 64 tokens, not
  // 128), one of them the force-kept block before the final one, and the
  // same kinds of context, each holding twice its selection (the sparsity
  // gate): a partial final block, a full one (exactly twice, as 160 is), one
  // token past a block edge at batch 3, and batch 8; 347 prefill tokens,
  // not 1,063.
  const BlockSparseConfig quick{8, 2, 64, 16, 2, 2, 64};
  testing::check_block_sparse_set_equality(Device::kCuda, quick, {{1, 86}, {1, 96}, {3, 81}, {8, 88}});
}

TEST(BlockSparseCuda, GreedyDecodeEquality) {
  SKIP_WITHOUT_CUDA();
  testing::check_block_sparse_greedy_equality(Device::kCuda, 1, testing::quick_steps(64));
}

TEST(BlockSparseCuda, GreedyDecodeEqualityAtBatch3) {
  SKIP_WITHOUT_CUDA();
  testing::check_block_sparse_greedy_equality(Device::kCuda, 3, testing::quick_steps(64));
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
  in.k = RowView::dense(k.data(), 2, cap, 64);
  in.v = RowView::dense(v.data(), 2, cap, 64);
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

namespace sparsepage {
namespace {

// Two requests over a [1, 2, 512, 64] bf16 cache, 300 selected positions each.
struct SmallDecode {
  Buffer k, v, q, o_fused, o_mask;
  SparseAttentionInputs in;
  SparseSelection selection;
  explicit SmallDecode(std::mt19937_64& rng) {
    const int64_t cap = 512;
    k = upload(Device::kCuda, testing::random_values(DType::kBF16, size_t(2 * cap * 64), rng));
    v = upload(Device::kCuda, testing::random_values(DType::kBF16, size_t(2 * cap * 64), rng));
    q = upload(Device::kCuda, testing::random_values(DType::kBF16, size_t(2 * 4 * 64), rng));
    o_fused = upload(Device::kCuda, testing::nan_values(DType::kBF16, size_t(2 * 4 * 64)));
    o_mask = upload(Device::kCuda, testing::nan_values(DType::kBF16, size_t(2 * 4 * 64)));
    in.device = Device::kCuda;
    in.batch = 1;
    in.num_qo_heads = 8;
    in.num_kv_heads = 2;
    in.live_len = 480;
    in.k = RowView::dense(k.data(), 2, cap, 64);
    in.v = RowView::dense(v.data(), 2, cap, 64);
    in.q = q.data();
    in.scale = 0.125f;
    selection = make_selection(Device::kCuda, {positions(rng), positions(rng)});
  }
  static std::vector<int32_t> positions(std::mt19937_64& rng) {
    std::vector<int32_t> all(480);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(300);
    return all;
  }
  std::vector<float> read(const Buffer& o) const {
    return testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  }
};

DispatchConfig fuse_always() {
  DispatchConfig c = DispatchConfig::defaults();
  c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0;
  return c;
}

// The entry points, not just the raw launcher, are graph-capturable: capture
// try_fused and MaskPath::run, change the selection and queries in place,
// replay, and both arms give the new answer.
TEST(SparseDecodeCuda, TryFusedAndMaskPathReplayFromAGraph) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(41);
  SmallDecode t(rng);
  SparseDecoder decoder(Device::kCuda, fuse_always());
  MaskPath mask(Device::kCuda);
  SparseAttentionInputs fused_in = t.in, mask_in = t.in;
  fused_in.o = t.o_fused.data();
  mask_in.o = t.o_mask.data();
  ASSERT_TRUE(decoder.try_fused(fused_in, t.selection).fused());  // plans and uploads outside capture
  mask.prepare(mask_in, t.selection);
  testing::StreamGraph graph;
  graph.capture(
      [&](cudaStream_t s) {
        decoder.try_fused(fused_in, t.selection, s);
        mask.run(mask_in, t.selection, s);
      },
      cudaStreamCaptureModeThreadLocal);
  // New contents, same counts.
  const SparseSelection fresh =
      make_selection(Device::kCuda, {SmallDecode::positions(rng), SmallDecode::positions(rng)});
  copy_bytes(t.selection.indices.data(), Device::kCuda, fresh.indices.data(), Device::kCuda, fresh.indices.bytes());
  const auto q_new = testing::random_values(DType::kBF16, size_t(2 * 4 * 64), rng);
  copy_bytes(t.q.data(), Device::kCuda, q_new.data(), Device::kCpu, q_new.size());
  fill_bytes(t.o_fused.data(), Device::kCuda, 0xFF, t.o_fused.bytes());
  fill_bytes(t.o_mask.data(), Device::kCuda, 0xFF, t.o_mask.bytes());
  graph.replay();
  const auto from_graph = t.read(t.o_fused);
  const auto masked = t.read(t.o_mask);
  // The reference: the same inputs through the CPU backend.
  std::vector<uint8_t> k_host = download<uint8_t>(Device::kCuda, t.k.data(), t.k.bytes());
  std::vector<uint8_t> v_host = download<uint8_t>(Device::kCuda, t.v.data(), t.v.bytes());
  std::vector<uint8_t> o_cpu(t.o_fused.bytes());
  SparseAttentionInputs cpu_in = t.in;
  cpu_in.device = Device::kCpu;
  cpu_in.k.data = k_host.data();
  cpu_in.v.data = v_host.data();
  cpu_in.q = q_new.data();
  cpu_in.o = o_cpu.data();
  const SparseSelection host_sel = make_selection(Device::kCpu, fresh.materialize());
  SparseDecoder cpu(Device::kCpu, fuse_always());
  ASSERT_TRUE(cpu.try_fused(cpu_in, host_sel).fused());
  const auto expected = testing::as_float(DType::kBF16, o_cpu);
  const std::vector<double> ref(expected.begin(), expected.end());
  EXPECT_LT(testing::relative_l2(from_graph, ref), 1e-2);
  EXPECT_LT(testing::relative_l2(masked, ref), 1e-2);
}

// Unselected rows contribute nothing on the GPU mask path, whatever they
// hold: with every unselected K and V row (and the rows past the live
// window) NaN, the mask path's output is finite and matches the fused path,
// which never reads them.
TEST(MaskPathCuda, NanInUnselectedRowsIsNeverRead) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(43);
  SmallDecode t(rng);
  const auto picks = t.selection.materialize();
  const int64_t cap = 512;
  auto k_host = download<uint8_t>(Device::kCuda, t.k.data(), t.k.bytes());
  auto v_host = download<uint8_t>(Device::kCuda, t.v.data(), t.v.bytes());
  const auto nan_row = testing::nan_values(DType::kBF16, 64);
  for (int32_t r = 0; r < 2; ++r) {
    const std::set<int32_t> kept(picks[size_t(r)].begin(), picks[size_t(r)].end());
    for (int64_t row = 0; row < cap; ++row) {
      if (kept.count(static_cast<int32_t>(row))) continue;
      const size_t at = size_t((r * cap + row) * 64 * 2);
      std::copy(nan_row.begin(), nan_row.end(), k_host.begin() + static_cast<std::ptrdiff_t>(at));
      std::copy(nan_row.begin(), nan_row.end(), v_host.begin() + static_cast<std::ptrdiff_t>(at));
    }
  }
  copy_bytes(t.k.data(), Device::kCuda, k_host.data(), Device::kCpu, k_host.size());
  copy_bytes(t.v.data(), Device::kCuda, v_host.data(), Device::kCpu, v_host.size());
  SparseAttentionInputs fused_in = t.in, mask_in = t.in;
  fused_in.o = t.o_fused.data();
  mask_in.o = t.o_mask.data();
  SparseDecoder decoder(Device::kCuda, fuse_always());
  ASSERT_TRUE(decoder.try_fused(fused_in, t.selection).fused());
  MaskPath mask(Device::kCuda);
  mask.prepare(mask_in, t.selection);
  mask.run(mask_in, t.selection);
  testing::cuda_ok(cudaDeviceSynchronize(), "sync");
  const auto fused = t.read(t.o_fused);
  const auto masked = t.read(t.o_mask);
  ASSERT_TRUE(std::none_of(masked.begin(), masked.end(), [](float x) { return std::isnan(x); }))
      << "a NaN in an unselected row reached the mask path's output";
  EXPECT_LT(testing::relative_l2(masked, std::vector<double>(fused.begin(), fused.end())), 1e-2);
}

// NaN never passes on the GPU either: a NaN query head poisons its output and
// lse whether the plan splits the request or not; other heads stay finite.
TEST(SparseDecodeCuda, NanQueryPoisonsItsHeadWhateverTheSplit) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(42);
  SmallDecode t(rng);
  const auto nan = testing::nan_values(DType::kBF16, 64);
  copy_bytes(t.q.data(), Device::kCuda, nan.data(), Device::kCpu, nan.size());  // request 0, head 0
  Buffer lse = upload(Device::kCuda, std::vector<float>(8, 0.0f));
  for (int32_t min_chunk : {64, 1024}) {
    SparseDecoder decoder(Device::kCuda, fuse_always());
    decoder.set_plan_tuning(8, min_chunk);
    SparseAttentionInputs in = t.in;
    in.o = t.o_fused.data();
    in.lse = lse.as<float>();
    fill_bytes(t.o_fused.data(), Device::kCuda, 0, t.o_fused.bytes());
    ASSERT_TRUE(decoder.try_fused(in, t.selection).fused());
    EXPECT_EQ(decoder.plan().needs_merge(), min_chunk == 64);
    const auto o = t.read(t.o_fused);
    const auto l = download<float>(Device::kCuda, lse.data(), 8);
    EXPECT_TRUE(std::isnan(l[0])) << "min chunk " << min_chunk;
    for (int d = 0; d < 64; ++d) ASSERT_TRUE(std::isnan(o[size_t(d)])) << "min chunk " << min_chunk;
    for (size_t i = 64; i < o.size(); ++i) ASSERT_TRUE(std::isfinite(o[i])) << "min chunk " << min_chunk;
    for (int h = 1; h < 8; ++h) EXPECT_TRUE(std::isfinite(l[size_t(h)]));
  }
}

// The GPU indexer follows the CPU rule (max-pooled scores, top-k, local
// force-keep, final block appended) on the same cache.
TEST(BlockSparseCuda, IndexerMatchesTheCpuRule) {
  SKIP_WITHOUT_CUDA();
  // Under the sanitizers top-2 of 6 blocks (81 tokens), not top-4 of 19 (301).
  const bool quick = testing::quick_mode();
  const BlockSparseConfig config{8, 2, 64, 16, quick ? 2 : 4, 2, 64};
  const int32_t context = quick ? 81 : 301;
  ASSERT_TRUE(config.sparse_regime(context));
  std::mt19937_64 rng(43);
  BlockSparseAttention layer(Device::kCuda, DType::kBF16, config, 1, fuse_always());
  std::vector<uint8_t> iq;
  for (int t = 0; t < context; ++t) {
    const auto q = testing::random_values(DType::kBF16, 8 * 64, rng);
    iq = testing::random_values(DType::kBF16, 2 * 64, rng);
    const auto k = testing::random_values(DType::kBF16, 3 * 64, rng);
    const auto v = testing::random_values(DType::kBF16, 2 * 64, rng);
    Buffer dq = upload(Device::kCuda, q), diq = upload(Device::kCuda, iq), dk = upload(Device::kCuda, k),
           dv = upload(Device::kCuda, v), o(Device::kCuda, 8 * 64 * 2);
    const BlockSparseTokens tok{dq.data(), diq.data(), dk.data(), dv.data(), o.data()};
    if (t + 1 < context) {
      layer.prefill_token(tok);
    } else {
      ASSERT_TRUE(layer.decode(tok).sparse);
    }
  }
  const DenseKVCache& cache = layer.cache();
  const RowView k_rows = cache.k_rows().value();
  const auto k_all = testing::as_float(
      DType::kBF16, download<uint8_t>(Device::kCuda, k_rows.data, size_t(cache.k_heads() * cache.capacity() * 64 * 2)));
  // The index key is head 2 of the K allocation.
  std::vector<float> index_k(k_all.begin() + k_rows.offset(0, 2, 0), k_all.begin() + k_rows.offset(0, 2, context));
  const auto q_idx = testing::as_float(DType::kBF16, iq);
  const std::vector<int32_t> expected = select_top_blocks_cpu(config, 1, context, q_idx.data(), index_k);
  const auto blocks = layer.last_blocks();
  const auto kept = std::ptrdiff_t(config.topk_blocks + 1);  // the top blocks, then the final one
  ASSERT_EQ(blocks.size(), 2u);
  ASSERT_EQ(expected.size(), 2 * size_t(kept));
  for (size_t r = 0; r < 2; ++r) {
    // The CUDA indexer lists its top blocks by increasing id, the CPU rule by
    // score: compare them as sets; the final block comes last in both.
    std::vector<int32_t> want(expected.begin() + std::ptrdiff_t(r) * kept,
                              expected.begin() + std::ptrdiff_t(r + 1) * kept);
    std::vector<int32_t> got = blocks[r];
    ASSERT_EQ(got.size(), size_t(kept));
    EXPECT_EQ(got.back(), want.back()) << "request " << r << ": the final block";
    std::sort(want.begin(), want.end() - 1);
    std::sort(got.begin(), got.end() - 1);
    EXPECT_EQ(got, want) << "request " << r;
  }
}

}  // namespace
}  // namespace sparsepage
