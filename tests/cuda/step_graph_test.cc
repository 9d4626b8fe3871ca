// Serving steps replayed from a CUDA graph while the context grows: one
// decode step of each layer is captured with global capture mode (so any
// allocation, synchronization or host read inside the step fails the
// capture), then replayed step after step across a block boundary and
// through partial final blocks. A twin layer fed the same tokens runs the
// same steps eagerly; the outputs must be identical bit for bit, on the
// fused path and under the kill switch (the mask path).
//
// Under the sanitizers (testing::quick_mode()) each test replays a quarter
// as many steps from a prompt that much closer to the same boundary.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

/// Device buffers of one step's inputs, refilled in place before each step.
struct StepBuffers {
  std::vector<Buffer> inputs;  // in the order the layer's token struct takes them
  Buffer o;
};

/// Fresh random bf16 contents for every input buffer (fp32 buffers hold floats).
void refill(StepBuffers& s, const std::vector<bool>& is_f32, std::mt19937_64& rng, cudaStream_t stream) {
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    const size_t bytes = s.inputs[i].bytes();
    std::vector<uint8_t> host;
    if (is_f32[i]) {
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      std::vector<float> f(bytes / 4);
      for (float& x : f) x = u(rng);
      host.assign(reinterpret_cast<uint8_t*>(f.data()), reinterpret_cast<uint8_t*>(f.data()) + bytes);
    } else {
      host = testing::random_values(DType::kBF16, bytes / 2, rng);
    }
    testing::cuda_ok(cudaMemcpyAsync(s.inputs[i].data(), host.data(), bytes, cudaMemcpyHostToDevice, stream), "refill");
    testing::cuda_ok(cudaStreamSynchronize(stream), "refill sync");
  }
}

StepBuffers make_buffers(const std::vector<size_t>& bytes, size_t o_bytes) {
  StepBuffers s;
  for (size_t b : bytes) s.inputs.emplace_back(Device::kCuda, b);
  s.o = Buffer(Device::kCuda, o_bytes);
  return s;
}

/// The eager twin's inputs become the graphed one's, ordered on `stream`.
void mirror(const StepBuffers& from, StepBuffers& to, cudaStream_t stream) {
  for (size_t i = 0; i < from.inputs.size(); ++i) {
    testing::cuda_ok(cudaMemcpyAsync(to.inputs[i].data(), from.inputs[i].data(), from.inputs[i].bytes(),
                                     cudaMemcpyDeviceToDevice, stream),
                     "mirror");
  }
}

std::vector<uint8_t> read(const Buffer& b, cudaStream_t stream) {
  testing::cuda_ok(cudaStreamSynchronize(stream), "read sync");
  return download<uint8_t>(Device::kCuda, b.data(), b.bytes());
}

/// The same random bf16 prompt in both twins' caches (its attention ran
/// elsewhere): `k_elems` and `v_elems` elements in append_tokens' layouts.
template <class Layer>
void append_same_prompt(Layer& a, Layer& b, size_t k_elems, size_t v_elems, int64_t prompt, std::mt19937_64& rng) {
  const Buffer k = upload(Device::kCuda, testing::random_values(DType::kBF16, k_elems, rng));
  const Buffer v = upload(Device::kCuda, testing::random_values(DType::kBF16, v_elems, rng));
  a.append_tokens(k.data(), v.data(), prompt);
  b.append_tokens(k.data(), v.data(), prompt);
}

/// Runs `steps` steps on two twin layers: `graphed` through one captured
/// step replayed, `eager` by calling decode. `step(layer, buffers, stream)`
/// issues one decode.
template <class Layer, class Step>
void replay_against_eager(Layer& graphed, Layer& eager, StepBuffers& g, StepBuffers& e, const std::vector<bool>& is_f32,
                          int steps, Step&& step) {
  // The prefix was written on the legacy default stream, which a
  // non-blocking stream does not wait for.
  testing::cuda_ok(cudaDeviceSynchronize(), "prefix");
  testing::StreamGraph graph;
  cudaStream_t stream = graph.stream();
  std::mt19937_64 rng(2026);
  // One eager step first: the first step at a shape plans and sizes buffers.
  refill(g, is_f32, rng, stream);
  mirror(g, e, stream);
  step(graphed, g, stream);
  step(eager, e, stream);
  ASSERT_EQ(read(g.o, stream), read(e.o, stream));

  graph.capture([&](cudaStream_t s) { step(graphed, g, s); });

  for (int s = 0; s < steps; ++s) {
    refill(g, is_f32, rng, stream);
    mirror(g, e, stream);
    fill_bytes(g.o.data(), Device::kCuda, 0xFF, g.o.bytes());  // NaN: an unwritten output fails
    graph.launch();
    step(eager, e, stream);
    const auto got = read(g.o, stream);
    ASSERT_EQ(got, read(e.o, stream)) << "step " << s << " differs from the eager step";
    const auto f = testing::as_float(DType::kBF16, got);
    ASSERT_TRUE(std::none_of(f.begin(), f.end(), [](float x) { return std::isnan(x); })) << "step " << s;
  }
  graphed.sync_live_len(stream);
  EXPECT_EQ(graphed.cache().live_len(), eager.cache().live_len()) << "the device length advanced once per replay";
}

class StepGraph : public ::testing::TestWithParam<bool> {};  // true: fused path; false: kill switch

TEST_P(StepGraph, BlockSparseStepReplaysAsTheContextGrows) {
  SKIP_WITHOUT_CUDA();
  const bool fused = GetParam();
  const DispatchConfig dispatch = fused ? testing::always_fuse() : testing::kill_switch();
  // Blocks of 128, top 4: the sparse regime starts past 1024 tokens and the
  // 2x sparsity gate passes from about 1300. The replays run 1381 -> 1461
  // (quick: 1397 -> 1417), across the block boundary at 1408.
  const BlockSparseConfig c{16, 2, 128, 128, 4, 2, 4096};
  const int32_t batch = 3;
  const bool quick = testing::quick_mode();
  BlockSparseAttention graphed(Device::kCuda, DType::kBF16, c, batch, dispatch);
  BlockSparseAttention eager(Device::kCuda, DType::kBF16, c, batch, dispatch);
  const size_t d = 128, b = batch;
  const std::vector<size_t> bytes = {b * c.num_qo_heads * d * 2, b * c.num_kv_heads * d * 2,
                                     b * (c.num_kv_heads + 1) * d * 2, b * c.num_kv_heads * d * 2};
  StepBuffers g = make_buffers(bytes, b * c.num_qo_heads * d * 2);
  StepBuffers e = make_buffers(bytes, b * c.num_qo_heads * d * 2);
  const std::vector<bool> is_f32(4, false);
  // The same prompt in both caches (its attention ran elsewhere).
  std::mt19937_64 rng(7);
  const int64_t prompt = quick ? 1396 : 1380;
  append_same_prompt(graphed, eager, b * (c.num_kv_heads + 1) * prompt * d, b * c.num_kv_heads * prompt * d, prompt,
                     rng);
  graphed.reserve(1600);
  eager.reserve(1600);
  auto step = [fused](BlockSparseAttention& layer, StepBuffers& s, cudaStream_t stream) {
    const BlockSparseTokens tok{s.inputs[0].data(), s.inputs[1].data(), s.inputs[2].data(), s.inputs[3].data(),
                                s.o.data()};
    const LayerStep r = layer.decode(tok, stream);
    ASSERT_TRUE(r.sparse);
    ASSERT_EQ(r.fused, fused) << r.outcome.describe();
  };
  replay_against_eager(graphed, eager, g, e, is_f32, quick ? 20 : 80, step);
}

TEST_P(StepGraph, DsaStepReplaysAsTheContextGrows) {
  SKIP_WITHOUT_CUDA();
  const bool fused = GetParam();
  const DispatchConfig dispatch = fused ? testing::always_fuse() : testing::kill_switch();
  // Top 32 of a window that grows 100 -> 180 (quick: 116 -> 136), past
  // twice the top-k, so the sparsity gate lets the fused path run, and
  // across the indexer's 64-token key tiles at 128.
  const DsaConfig c{16, 512, 64, 4, 64, 32, 0.0f, 256};
  const int32_t batch = 2;
  const bool quick = testing::quick_mode();
  DsaAttention graphed(Device::kCuda, DType::kBF16, c, batch, dispatch);
  DsaAttention eager(Device::kCuda, DType::kBF16, c, batch, dispatch);
  const size_t b = batch, h = c.num_qo_heads;
  // q_latent, q_pe, q_index, index_weights (f32), k_cache_row, k_pe
  const std::vector<size_t> bytes = {b * h * 512 * 2, b * h * 64 * 2,     b * 4 * 64 * 2,
                                     b * 4 * 4,       b * (512 + 64) * 2, b * 64 * 2};
  const std::vector<bool> is_f32 = {false, false, false, true, false, false};
  StepBuffers g = make_buffers(bytes, b * h * 512 * 2);
  StepBuffers e = make_buffers(bytes, b * h * 512 * 2);
  auto tokens = [](StepBuffers& s) {
    return DsaTokens{s.inputs[0].data(), s.inputs[1].data(), s.inputs[2].data(), s.inputs[3].as<float>(),
                     s.inputs[4].data(), s.inputs[5].data(), s.o.data()};
  };
  // The same prompt in both caches: a few tokens through prefill, the rest
  // appended (their attention ran elsewhere).
  std::mt19937_64 rng(8);
  const int64_t bulk = quick ? 112 : 96;
  append_same_prompt(graphed, eager, b * (512 + 64) * bulk, b * 64 * bulk, bulk, rng);
  for (int t = 0; t < 4; ++t) {
    refill(g, is_f32, rng, nullptr);
    graphed.prefill_token(tokens(g));
    eager.prefill_token(tokens(g));
  }
  graphed.reserve(256);
  eager.reserve(256);
  auto step = [fused, &tokens](DsaAttention& layer, StepBuffers& s, cudaStream_t stream) {
    const LayerStep r = layer.decode(tokens(s), stream);
    ASSERT_TRUE(r.sparse);
    ASSERT_EQ(r.fused, fused) << r.outcome.describe();
  };
  replay_against_eager(graphed, eager, g, e, is_f32, quick ? 20 : 80, step);
}

TEST_P(StepGraph, StaticBlockSparseStepReplaysAsTheContextGrows) {
  SKIP_WITHOUT_CUDA();
  const bool fused = GetParam();
  const DispatchConfig dispatch = fused ? testing::always_fuse() : testing::kill_switch();
  // Phi-3-small's pattern (blocks of 64, 16 local, vertical stride 8, 32
  // query heads over 8): the replays run 4001 -> 4081 (quick: 4021 ->
  // 4041), across the block boundary at 4032 (a new query block moves the
  // local run and the vertical blocks) and through partial final blocks.
  const StaticBlockSparseConfig c;
  const int32_t batch = 3;
  const bool quick = testing::quick_mode();
  StaticBlockSparseAttention graphed(Device::kCuda, DType::kBF16, c, batch, dispatch);
  StaticBlockSparseAttention eager(Device::kCuda, DType::kBF16, c, batch, dispatch);
  const size_t d = 128, b = batch;
  const std::vector<size_t> bytes = {b * c.num_qo_heads * d * 2, b * c.num_kv_heads * d * 2,
                                     b * c.num_kv_heads * d * 2};
  StepBuffers g = make_buffers(bytes, b * c.num_qo_heads * d * 2);
  StepBuffers e = make_buffers(bytes, b * c.num_qo_heads * d * 2);
  const std::vector<bool> is_f32(3, false);
  std::mt19937_64 rng(9);
  const int64_t prompt = quick ? 4020 : 4000;
  append_same_prompt(graphed, eager, b * c.num_kv_heads * prompt * d, b * c.num_kv_heads * prompt * d, prompt, rng);
  graphed.reserve(4200);
  eager.reserve(4200);
  auto step = [fused](StaticBlockSparseAttention& layer, StepBuffers& s, cudaStream_t stream) {
    const LayerStep r = layer.decode({s.inputs[0].data(), s.inputs[1].data(), s.inputs[2].data(), s.o.data()}, stream);
    ASSERT_EQ(r.fused, fused) << r.outcome.describe();
  };
  replay_against_eager(graphed, eager, g, e, is_f32, quick ? 20 : 80, step);
}

// Multi-token steps (speculative verification, MTP): the fused q_len = 4
// step captured once and replayed, each replay appending four tokens. Only
// the fused path is capturable (token by token, the step stages copies).
TEST(StepGraphMultiToken, BlockSparseFourTokenStepReplaysAsTheContextGrows) {
  SKIP_WITHOUT_CUDA();
  // As the one-token test: blocks of 128, top 4; the replays run 1384 -> 1464
  // (quick: 1400 -> 1420) four tokens at a time, across the block boundary
  // at 1408 (a step whose tokens straddle it has causal limits cutting the
  // final blocks).
  const BlockSparseConfig c{16, 2, 128, 128, 4, 2, 4096};
  const int32_t batch = 2, q_len = 4;
  const bool quick = testing::quick_mode();
  BlockSparseAttention graphed(Device::kCuda, DType::kBF16, c, batch, testing::always_fuse());
  BlockSparseAttention eager(Device::kCuda, DType::kBF16, c, batch, testing::always_fuse());
  const size_t d = 128, b = batch, t = q_len;
  // q [b, t, Hq, d], index_q [b, t, Hkv, d], k [t, b, Hkv + 1, d], v [t, b, Hkv, d]
  const std::vector<size_t> bytes = {b * t * c.num_qo_heads * d * 2, b * t * c.num_kv_heads * d * 2,
                                     t * b * (c.num_kv_heads + 1) * d * 2, t * b * c.num_kv_heads * d * 2};
  StepBuffers g = make_buffers(bytes, b * t * c.num_qo_heads * d * 2);
  StepBuffers e = make_buffers(bytes, b * t * c.num_qo_heads * d * 2);
  const std::vector<bool> is_f32(4, false);
  std::mt19937_64 rng(17);
  const int64_t prompt = quick ? 1396 : 1380;
  append_same_prompt(graphed, eager, b * (c.num_kv_heads + 1) * prompt * d, b * c.num_kv_heads * prompt * d, prompt,
                     rng);
  graphed.reserve(1600);
  eager.reserve(1600);
  auto step = [](BlockSparseAttention& layer, StepBuffers& s, cudaStream_t stream) {
    const BlockSparseTokens tok{s.inputs[0].data(), s.inputs[1].data(), s.inputs[2].data(), s.inputs[3].data(),
                                s.o.data()};
    const LayerStep r = layer.decode(tok, q_len, stream);
    ASSERT_TRUE(r.sparse);
    ASSERT_TRUE(r.fused) << r.outcome.describe();
  };
  replay_against_eager(graphed, eager, g, e, is_f32, quick ? 5 : 20, step);
}

TEST(StepGraphMultiToken, DsaTwoTokenStepReplaysAsTheContextGrows) {
  SKIP_WITHOUT_CUDA();
  // Top 32 per token of a window that grows 100 -> 180 (quick: 114 -> 134,
  // across the indexer's key tile boundary at 128), two tokens a step.
  const DsaConfig c{16, 512, 64, 4, 64, 32, 0.0f, 256};
  const int32_t batch = 2, q_len = 2;
  const bool quick = testing::quick_mode();
  DsaAttention graphed(Device::kCuda, DType::kBF16, c, batch, testing::always_fuse());
  DsaAttention eager(Device::kCuda, DType::kBF16, c, batch, testing::always_fuse());
  const size_t b = batch, h = c.num_qo_heads, t = q_len;
  // q_latent, q_pe, q_index [b, t, ...], index_weights (f32) [b, t, 4], k_cache_row, k_pe [t, b, ...]
  const std::vector<size_t> bytes = {b * t * h * 512 * 2, b * t * h * 64 * 2,     b * t * 4 * 64 * 2,
                                     b * t * 4 * 4,       t * b * (512 + 64) * 2, t * b * 64 * 2};
  const std::vector<bool> is_f32 = {false, false, false, true, false, false};
  StepBuffers g = make_buffers(bytes, b * t * h * 512 * 2);
  StepBuffers e = make_buffers(bytes, b * t * h * 512 * 2);
  std::mt19937_64 rng(18);
  const int64_t prompt = quick ? 112 : 100;
  append_same_prompt(graphed, eager, b * (512 + 64) * prompt, b * 64 * prompt, prompt, rng);
  graphed.reserve(256);
  eager.reserve(256);
  auto step = [](DsaAttention& layer, StepBuffers& s, cudaStream_t stream) {
    const DsaTokens tok{s.inputs[0].data(), s.inputs[1].data(), s.inputs[2].data(), s.inputs[3].as<float>(),
                        s.inputs[4].data(), s.inputs[5].data(), s.o.data()};
    const LayerStep r = layer.decode(tok, q_len, stream);
    ASSERT_TRUE(r.sparse);
    ASSERT_TRUE(r.fused) << r.outcome.describe();
  };
  replay_against_eager(graphed, eager, g, e, is_f32, quick ? 10 : 40, step);
}

INSTANTIATE_TEST_SUITE_P(Paths, StepGraph, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "fused" : "mask_path"; });

}  // namespace
}  // namespace sparsepage
