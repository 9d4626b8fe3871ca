// Sparse prefill (sparsepage/prefill.h) on the GPU: MLA over per-token
// selections (bf16 and FP8 rows) and GQA over key blocks against fp64 per
// token with every unattended cache row NaN and against the CPU backend
// (bf16/f16 rows, and e4m3 rows with per-KV-head scales);
// the DSA, block and static selections against their CPU twins, exactly
// (integer-valued index inputs, whose fp32 sums are exact in any order);
// bad selections poisoning only their tokens and raising the error flag;
// chunks captured in a CUDA graph and replayed for a later chunk of the
// same shape. Every test skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/memory.h"
#include "sparsepage/prefill.h"
#include "support/expect_error.h"
#include "support/gqa_prefill_fp8.h"
#include "support/prefill_problem.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::GqaPrefillSpec;
using testing::MlaPrefillSpec;

constexpr float kInf = std::numeric_limits<float>::infinity();

// The MLA kernel and the DSA indexer need sm_90a code on an sm_90 GPU.
#define SKIP_WITHOUT_HOPPER() \
  do { \
    SKIP_WITHOUT_CUDA(); \
    if (!cuda_arch_problem(cuda_device_sm(), 512, 512, 64).empty()) \
      GTEST_SKIP() << "the MLA kernel needs sm_90a: " << cuda_arch_problem(cuda_device_sm(), 512, 512, 64); \
  } while (0)

template <typename T>
Buffer to_device(const std::vector<T>& v) {
  Buffer b(Device::kCuda, std::max<size_t>(v.size() * sizeof(T), 16));
  if (!v.empty()) copy_bytes(b.data(), Device::kCuda, v.data(), Device::kCpu, v.size() * sizeof(T));
  return b;
}

/// An MLA problem's arrays on the device and its outputs (poisoned NaN).
struct MlaDevice {
  Buffer q, kv, indices, topk_length, kv_lens, sink, out, lse;
  explicit MlaDevice(const testing::MlaPrefillProblem& pb) {
    q = to_device(pb.q);
    kv = to_device(pb.spec.fp8 ? pb.kv_fp8 : pb.kv);
    indices = to_device(pb.indices);
    topk_length = to_device(pb.topk_length);
    kv_lens = to_device(pb.kv_lens);
    sink = to_device(pb.sink);
    const size_t rows = static_cast<size_t>(pb.spec.batch) * pb.spec.num_tokens * pb.spec.num_heads;
    out = Buffer(Device::kCuda, rows * 512 * 2);
    lse = Buffer(Device::kCuda, rows * sizeof(float));
    poison();
  }
  void poison() {
    fill_bytes(out.data(), Device::kCuda, 0xFF, out.bytes());
    fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  }
  MlaPrefillParams params(const testing::MlaPrefillProblem& pb) {
    return pb.params(q.data(), kv.data(), indices.as<int32_t>(),
                     pb.spec.topk_length ? topk_length.as<int32_t>() : nullptr, kv_lens.as<int32_t>(),
                     pb.spec.sink ? sink.as<float>() : nullptr, out.data(), lse.as<float>(), nullptr);
  }
  std::vector<float> out_f() const {
    std::vector<uint16_t> raw = download<uint16_t>(Device::kCuda, out.data(), out.bytes() / 2);
    std::vector<float> f(raw.size());
    to_float(DType::kBF16, raw.data(), f.data(), f.size());
    return f;
  }
  std::vector<float> lse_f() const { return download<float>(Device::kCuda, lse.data(), lse.bytes() / 4); }
};

// Under the sanitizers (testing::quick_mode()) the two sequences of b and c
// take 11 tokens each (3 still empty) and d 6, not 33 and 24: about a third
// of the (token, head, entry) work, on the same kernels.
std::vector<MlaPrefillSpec> mla_specs() {
  const bool quick = testing::quick_mode();
  std::vector<MlaPrefillSpec> specs;
  MlaPrefillSpec a;  // 64 heads, early windows shorter than topk
  a.num_tokens = 40;
  a.topk = 64;
  a.starts = {30};
  specs.push_back(a);
  MlaPrefillSpec b;  // 128 heads, two sequences, per-token counts, duplicates, a sink, empty tokens
  b.batch = 2;
  b.num_tokens = quick ? 11 : 33;
  b.num_heads = 128;
  b.topk = 200;
  b.starts = {7, 300};
  b.topk_length = true;
  b.duplicates = true;
  b.sink = true;
  b.empty_tokens = 3;
  b.seed = 21;
  specs.push_back(b);
  MlaPrefillSpec c = b;  // the FP8 rows
  c.fp8 = true;
  c.seed = 22;
  specs.push_back(c);
  MlaPrefillSpec d;  // topk 2048 (32 row tiles per token), each token one request of two head tiles
  d.num_tokens = quick ? 6 : 24;
  d.num_heads = 128;
  d.topk = 2048;
  d.starts = {2300};
  d.pad_fraction = 0.05;
  d.seed = 23;
  specs.push_back(d);
  return specs;
}

TEST(MlaPrefillCuda, MatchesFp64AndTheCpuBackend) {
  SKIP_WITHOUT_HOPPER();
  for (const MlaPrefillSpec& spec : mla_specs()) {
    const auto pb = testing::make_mla_prefill_problem(spec);
    MlaDevice dev(pb);
    MlaSparsePrefill prefill(Device::kCuda);
    prefill.run(dev.params(pb));
    EXPECT_NO_THROW(prefill.check_errors());
    const std::vector<float> out = dev.out_f(), lse = dev.lse_f();
    const auto ref = testing::mla_prefill_reference(pb);
    EXPECT_EQ(testing::compare_mla_prefill(pb, ref, out, lse, nullptr, 1e-2, 1e-2, 0.0), "")
        << "seed " << spec.seed << " (" << prefill.kernel_name() << ")";
    // The CPU backend on the same inputs.
    std::vector<uint16_t> cpu_out(out.size());
    std::vector<float> cpu_lse(lse.size());
    MlaSparsePrefill cpu(Device::kCpu);
    cpu.run(pb.host_params(cpu_out.data(), cpu_lse.data(), nullptr));
    std::vector<float> cpu_f(cpu_out.size());
    to_float(DType::kBF16, cpu_out.data(), cpu_f.data(), cpu_f.size());
    std::vector<double> cpu_d(cpu_f.begin(), cpu_f.end());
    EXPECT_LT(testing::relative_l2(out, cpu_d), 1e-2) << "seed " << spec.seed;
  }
}

TEST(MlaPrefillCuda, WithoutTheCausalLimitAnyRowBelowTheLengthIsRead) {
  SKIP_WITHOUT_HOPPER();
  MlaPrefillSpec spec;
  spec.num_tokens = 8;
  spec.num_heads = 64;
  spec.topk = 48;
  spec.starts = {100};
  spec.pad_fraction = 0.0;
  auto pb = testing::make_mla_prefill_problem(spec);
  // Each token's first entry: a row the last token attends past the token's own position.
  const int32_t n = spec.num_tokens, topk = spec.topk;
  int32_t later = -1;
  for (int32_t i = 0; i < topk; ++i) later = std::max(later, pb.indices[static_cast<size_t>((n - 1) * topk + i)]);
  ASSERT_GT(later, 100);
  for (int32_t t = 0; t < n; ++t) pb.indices[static_cast<size_t>(t) * topk] = later;
  MlaDevice dev(pb);
  MlaPrefillParams p = dev.params(pb);
  p.causal = false;
  MlaSparsePrefill prefill(Device::kCuda);
  prefill.run(p);
  EXPECT_NO_THROW(prefill.check_errors());
  const std::vector<float> out = dev.out_f(), lse = dev.lse_f();
  EXPECT_EQ(testing::compare_mla_prefill(pb, testing::mla_prefill_reference(pb), out, lse, nullptr, 1e-2, 1e-2, 0.0),
            "");
  // The same inputs with the causal limit: the later rows are errors.
  dev.poison();
  prefill.run(dev.params(pb));
  EXPECT_THROW(prefill.check_errors(), Error);
}

TEST(MlaPrefillCuda, EqualsTheDecodeRunOneTokenAtATime) {
  SKIP_WITHOUT_HOPPER();
  MlaPrefillSpec spec = mla_specs()[1];
  spec.sink = false;
  const auto pb = testing::make_mla_prefill_problem(spec);
  MlaDevice dev(pb);
  MlaSparsePrefill prefill(Device::kCuda);
  prefill.run(dev.params(pb));
  const std::vector<float> out = dev.out_f(), lse = dev.lse_f();
  // The oracle: the paged decode (GPU) once per token over its valid entries.
  const int32_t n = spec.num_tokens, heads = spec.num_heads;
  const MlaPrefillParams full = dev.params(pb);
  Buffer o(Device::kCuda, static_cast<size_t>(heads) * 512 * 2), l(Device::kCuda, static_cast<size_t>(heads) * 4);
  for (int32_t b = 0; b < spec.batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const size_t row = static_cast<size_t>(b) * n + static_cast<size_t>(t);
      const int32_t count = pb.topk_length[row];
      std::vector<int32_t> entries;
      for (int32_t i = 0; i < count; ++i) {
        if (pb.indices[row * spec.topk + static_cast<size_t>(i)] >= 0)
          entries.push_back(pb.indices[row * spec.topk + static_cast<size_t>(i)]);
      }
      if (entries.empty()) continue;  // the prefill's convention for these is checked against fp64
      const std::vector<int32_t> lens = {static_cast<int32_t>(entries.size())};
      const std::vector<int32_t> indptr = {0, lens[0]};
      Buffer d_entries = to_device(entries), d_indptr = to_device(indptr), d_lens = to_device(lens);
      PlanShape shape = testing::cuda_plan_shape(heads, 512);
      shape.ctas_per_item = cuda_launch_shape(512, 512, 64, heads).ctas_per_item;
      const DecodePlan plan = make_decode_plan(lens, shape);
      Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
      upload_plan_cuda(plan, ws.data());
      DecodeParams d;
      d.indptr = d_indptr.as<int32_t>();
      d.indices = d_entries.as<int32_t>();
      d.num_indices = lens[0];
      d.seq_lens = d_lens.as<int32_t>();
      d.num_requests = 1;
      d.addressing = PageAddressing::kWindow;
      d.window_len = pb.kv_lens[static_cast<size_t>(b)] - n + t + 1;
      d.group_size = heads;
      d.qo_layout = QueryLayout::kStrided;
      d.q = static_cast<const uint16_t*>(full.q) + row * heads * 576;
      d.q_extra = static_cast<const uint16_t*>(full.q_rope) + row * heads * 576;
      d.q_strides = {0, 576, 0};
      d.q_extra_strides = d.q_strides;
      d.o_strides = {0, 512, 0};
      d.k = full.kv;
      d.k.data = static_cast<const uint16_t*>(full.kv.data) + b * full.kv.seq_stride;
      d.k.seq_stride = 0;
      d.v = d.k;
      d.k_extra = full.kv_rope;
      d.k_extra.data = static_cast<const uint16_t*>(full.kv_rope.data) + b * full.kv_rope.seq_stride;
      d.k_extra.seq_stride = 0;
      d.scale = pb.scale;
      d.o = o.data();
      d.lse = l.as<float>();
      run_decode_cuda(d, plan, ws.data());
      const auto one_raw = download<uint16_t>(Device::kCuda, o.data(), static_cast<size_t>(heads) * 512);
      std::vector<float> one(one_raw.size());
      to_float(DType::kBF16, one_raw.data(), one.data(), one.size());
      const auto one_lse = download<float>(Device::kCuda, l.data(), static_cast<size_t>(heads));
      for (int32_t h = 0; h < heads; ++h) {
        const size_t r = row * heads + static_cast<size_t>(h);
        ASSERT_NEAR(lse[r], one_lse[static_cast<size_t>(h)],
                    1e-3f * std::max(1.0f, std::fabs(one_lse[static_cast<size_t>(h)])))
            << "token " << row << " head " << h;
        const std::vector<float> mine(out.begin() + static_cast<std::ptrdiff_t>(r * 512),
                                      out.begin() + static_cast<std::ptrdiff_t>((r + 1) * 512));
        const std::vector<double> want(one.begin() + static_cast<std::ptrdiff_t>(h) * 512,
                                       one.begin() + static_cast<std::ptrdiff_t>(h + 1) * 512);
        ASSERT_LT(testing::relative_l2(mine, want), 1e-2) << "token " << row << " head " << h;
      }
    }
  }
}

TEST(MlaPrefillCuda, AnEntryPastItsTokenPoisonsThatTokenAndIsReported) {
  SKIP_WITHOUT_HOPPER();
  MlaPrefillSpec spec = mla_specs()[0];
  auto pb = testing::make_mla_prefill_problem(spec);
  const int32_t bad_token = 5;
  pb.indices[static_cast<size_t>(bad_token) * spec.topk] = spec.starts[0] + bad_token + 1;  // its successor's position
  MlaDevice dev(pb);
  MlaSparsePrefill prefill(Device::kCuda);
  prefill.run(dev.params(pb));
  const std::vector<float> out = dev.out_f(), lse = dev.lse_f();
  for (int32_t t = 0; t < spec.num_tokens; ++t) {
    const size_t r = static_cast<size_t>(t) * spec.num_heads;
    EXPECT_EQ(std::isnan(lse[r]), t == bad_token) << "token " << t;
    EXPECT_EQ(std::isnan(out[r * 512]), t == bad_token) << "token " << t;
  }
  EXPECT_TRUE(testing::throws_error_naming([&] { prefill.check_errors(); }, "outside its token's window"));
  EXPECT_NO_THROW(prefill.check_errors());  // read and cleared
  // max_logits has no CUDA kernel: refused by name, before anything runs.
  MlaPrefillParams with_max = dev.params(pb);
  Buffer ml(Device::kCuda, 4096);
  with_max.max_logits = ml.as<float>();
  EXPECT_TRUE(
      testing::throws_error_naming([&] { prefill.run(with_max); }, "max_logits is computed by the CPU backend"));
}

// One chunk shape captured once, replayed for a chunk at another position:
// the windows follow the device lengths.
TEST(MlaPrefillCuda, AChunkGraphReplaysForALaterChunk) {
  SKIP_WITHOUT_HOPPER();
  MlaPrefillSpec spec_a = mla_specs()[0];
  spec_a.capacity = 600;
  spec_a.sink = true;
  MlaPrefillSpec spec_b = spec_a;
  spec_b.starts = {480};
  spec_b.seed = 99;
  const auto a = testing::make_mla_prefill_problem(spec_a), b = testing::make_mla_prefill_problem(spec_b);
  MlaDevice graphed(a), eager(b);
  cudaStream_t stream;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  MlaPrefillParams p = graphed.params(a);
  p.chunk.kv_len = spec_a.capacity;  // the bound both chunks stay under
  MlaSparsePrefill prefill(Device::kCuda);
  prefill.prepare(p, stream);
  prefill.run(p, stream);  // once eagerly: the kernels' first-launch attributes are set outside the capture
  testing::cuda_ok(cudaStreamSynchronize(stream), "eager run");
  cudaGraph_t graph;
  testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  prefill.run(p, stream);
  testing::cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture: the run did something a graph cannot hold");
  cudaGraphExec_t exec;
  testing::cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (const auto* pb : {&b, &a}) {
    // Chunk pb's inputs into the captured buffers.
    copy_bytes(graphed.q.data(), Device::kCuda, pb->q.data(), Device::kCpu, pb->q.size());
    copy_bytes(graphed.kv.data(), Device::kCuda, pb->kv.data(), Device::kCpu, pb->kv.size());
    copy_bytes(graphed.indices.data(), Device::kCuda, pb->indices.data(), Device::kCpu, pb->indices.size() * 4);
    copy_bytes(graphed.kv_lens.data(), Device::kCuda, pb->kv_lens.data(), Device::kCpu, pb->kv_lens.size() * 4);
    copy_bytes(graphed.sink.data(), Device::kCuda, pb->sink.data(), Device::kCpu, pb->sink.size() * 4);
    graphed.poison();
    testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
    testing::cuda_ok(cudaStreamSynchronize(stream), "replay sync");
    const auto ref = testing::mla_prefill_reference(*pb);
    EXPECT_EQ(testing::compare_mla_prefill(*pb, ref, graphed.out_f(), graphed.lse_f(), nullptr, 1e-2, 2e-2, 0.0), "")
        << "start " << pb->spec.starts[0];
  }
  // And bit for bit what an eager run of the later chunk gives.
  MlaSparsePrefill other(Device::kCuda);
  other.run(eager.params(b));
  copy_bytes(graphed.q.data(), Device::kCuda, b.q.data(), Device::kCpu, b.q.size());
  copy_bytes(graphed.kv.data(), Device::kCuda, b.kv.data(), Device::kCpu, b.kv.size());
  copy_bytes(graphed.indices.data(), Device::kCuda, b.indices.data(), Device::kCpu, b.indices.size() * 4);
  copy_bytes(graphed.kv_lens.data(), Device::kCuda, b.kv_lens.data(), Device::kCpu, b.kv_lens.size() * 4);
  copy_bytes(graphed.sink.data(), Device::kCuda, b.sink.data(), Device::kCpu, b.sink.size() * 4);
  testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
  testing::cuda_ok(cudaStreamSynchronize(stream), "replay sync");
  EXPECT_EQ(download<uint16_t>(Device::kCuda, graphed.out.data(), graphed.out.bytes() / 2),
            download<uint16_t>(Device::kCuda, eager.out.data(), eager.out.bytes() / 2));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- the DSA prefill indexer ------------------------------------------------------

struct DsaCase {
  int32_t heads, dim, topk, num_tokens, batch;
  std::vector<int32_t> starts;
  size_t budget;  // small: several passes
};

TEST(DsaPrefillIndexerCuda, KeepsTheCpuTwinsSetsExactly) {
  SKIP_WITHOUT_HOPPER();
  const std::vector<DsaCase> cases = {
      {64, 128, 256, 200, 1, {700}, size_t{40} << 20},         // the production geometry's group kernel, several passes
      {64, 128, 2048, 96, 2, {100, 3000}, size_t{512} << 20},  // sequence 0 fits the top-k, sequence 1 does not
      {8, 64, 128, 70, 1, {500}, size_t{1} << 20},             // another geometry (one row per CTA)
  };
  std::mt19937_64 rng(31);
  for (const DsaCase& c : cases) {
    const int32_t key_column = 16;
    const int64_t kv_len = *std::max_element(c.starts.begin(), c.starts.end()) + c.num_tokens, capacity = kv_len + 5;
    const auto keys =
        testing::integer_values(DType::kBF16, static_cast<size_t>(c.batch) * capacity * (key_column + c.dim), rng, 2);
    const auto q =
        testing::integer_values(DType::kBF16, static_cast<size_t>(c.batch) * c.num_tokens * c.heads * c.dim, rng, 2);
    std::vector<float> w(static_cast<size_t>(c.batch) * c.num_tokens * c.heads);
    for (float& x : w) x = static_cast<float>(std::uniform_int_distribution<int>(0, 3)(rng));
    std::vector<int32_t> lens;
    for (int32_t s : c.starts) lens.push_back(s + c.num_tokens);
    const size_t rows = static_cast<size_t>(c.batch) * c.num_tokens;
    Buffer d_keys = to_device(keys), d_q = to_device(q), d_w = to_device(w), d_lens = to_device(lens);
    Buffer d_pos(Device::kCuda, rows * c.topk * 4), d_counts(Device::kCuda, rows * 4);
    fill_bytes(d_pos.data(), Device::kCuda, 0x7F, d_pos.bytes());
    DsaPrefillIndexerParams p;
    p.chunk = {c.batch, c.num_tokens, kv_len, d_lens.as<int32_t>()};
    p.index_heads = c.heads;
    p.index_head_dim = c.dim;
    p.topk = c.topk;
    p.k_cache = d_keys.data();
    p.key_column = key_column;
    p.capacity = capacity;
    p.q_index = d_q.data();
    p.weights = d_w.as<float>();
    p.positions = d_pos.as<int32_t>();
    p.counts = d_counts.as<int32_t>();
    DsaPrefillIndexer indexer(Device::kCuda, c.budget);
    indexer.run(p);
    testing::cuda_ok(cudaDeviceSynchronize(), "indexer");
    EXPECT_LT(indexer.rows_per_pass(), c.num_tokens) << "the case is meant to take several passes";
    std::vector<int32_t> cpu_pos(rows * c.topk), cpu_counts(rows);
    DsaPrefillIndexerParams hp = p;
    hp.chunk.kv_lens = lens.data();
    hp.k_cache = keys.data();
    hp.q_index = q.data();
    hp.weights = w.data();
    hp.positions = cpu_pos.data();
    hp.counts = cpu_counts.data();
    DsaPrefillIndexer(Device::kCpu).run(hp);
    EXPECT_EQ(download<int32_t>(Device::kCuda, d_counts.data(), rows), cpu_counts) << "heads " << c.heads;
    EXPECT_EQ(download<int32_t>(Device::kCuda, d_pos.data(), rows * c.topk), cpu_pos) << "heads " << c.heads;
  }
}

// ---- the block indexer and the static pattern ---------------------------------------------

TEST(BlockPrefillIndexerCuda, KeepsTheCpuTwinsListsExactly) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(41);
  for (int32_t bs : {64, 128}) {
    const int32_t heads = 4, dim = 128, n = 3 * bs + bs / 2, top = 5, local = 2, batch = 2;
    const std::vector<int32_t> starts = {0, 20 * bs};
    const int64_t kv_len = starts[1] + n, capacity = kv_len + 3;
    const auto keys = testing::integer_values(DType::kBF16, static_cast<size_t>(batch) * capacity * dim, rng, 1);
    const auto q = testing::integer_values(DType::kBF16, static_cast<size_t>(batch) * n * heads * dim, rng, 1);
    std::vector<int32_t> lens = {starts[0] + n, starts[1] + n};
    const int32_t nqb = (n + bs - 1) / bs;
    const size_t lists = static_cast<size_t>(batch) * nqb * heads;
    Buffer d_keys = to_device(keys), d_q = to_device(q), d_lens = to_device(lens);
    Buffer d_ids(Device::kCuda, lists * (top + 1) * 4), d_counts(Device::kCuda, lists * 4);
    BlockPrefillIndexerParams p;
    p.chunk = {batch, n, kv_len, d_lens.as<int32_t>()};
    p.num_kv_heads = heads;
    p.head_dim = dim;
    p.block_size = bs;
    p.top_blocks = top;
    p.local_blocks = local;
    p.index_keys = {d_keys.data(), dim, dim, capacity * dim, 0, capacity};
    p.q_index = d_q.data();
    p.block_ids = d_ids.as<int32_t>();
    p.counts = d_counts.as<int32_t>();
    BlockPrefillIndexer(Device::kCuda).run(p);
    std::vector<int32_t> ids(lists * (top + 1)), counts(lists);
    BlockPrefillIndexerParams hp = p;
    hp.chunk.kv_lens = lens.data();
    hp.index_keys.data = keys.data();
    hp.q_index = q.data();
    hp.block_ids = ids.data();
    hp.counts = counts.data();
    BlockPrefillIndexer(Device::kCpu).run(hp);
    EXPECT_EQ(download<int32_t>(Device::kCuda, d_ids.data(), ids.size()), ids) << "block " << bs;
    EXPECT_EQ(download<int32_t>(Device::kCuda, d_counts.data(), counts.size()), counts) << "block " << bs;
  }
}

TEST(StaticPrefillCuda, WritesTheCpuTwinsLists) {
  SKIP_WITHOUT_CUDA();
  StaticPrefillParams p;
  const int32_t n = 300, batch = 2;
  std::vector<int32_t> lens = {64 * 5 + n, 64 * 40 + n};
  p.chunk = {batch, n, lens[1], nullptr};
  p.num_qo_heads = 32;
  p.num_kv_heads = 8;
  p.width = static_prefill_width(p, lens[1]);
  const size_t lists = static_cast<size_t>(batch) * 32 * ((n + 63) / 64);
  Buffer d_lens = to_device(lens), d_ids(Device::kCuda, lists * p.width * 4), d_counts(Device::kCuda, lists * 4);
  StaticPrefillParams dp = p;
  dp.chunk.kv_lens = d_lens.as<int32_t>();
  dp.block_ids = d_ids.as<int32_t>();
  dp.counts = d_counts.as<int32_t>();
  static_prefill_blocks(Device::kCuda, dp);
  std::vector<int32_t> ids(lists * p.width), counts(lists);
  p.chunk.kv_lens = lens.data();
  p.block_ids = ids.data();
  p.counts = counts.data();
  static_prefill_blocks(Device::kCpu, p);
  EXPECT_EQ(download<int32_t>(Device::kCuda, d_ids.data(), ids.size()), ids);
  EXPECT_EQ(download<int32_t>(Device::kCuda, d_counts.data(), counts.size()), counts);
}

// ---- GQA over blocks -----------------------------------------------------------------

std::vector<GqaPrefillSpec> gqa_specs() {
  std::vector<GqaPrefillSpec> specs;
  GqaPrefillSpec a;  // the block-sparse geometry's head dim: the 64-row multi-token CTA, a partial last block
  a.num_tokens = 200;
  a.num_qo_heads = 16;
  a.num_kv_heads = 2;
  a.head_dim = 128;
  a.block_size = 64;
  a.starts = {640};
  a.width = 6;
  specs.push_back(a);
  GqaPrefillSpec b = a;  // 128-token blocks, two sequences at different positions
  b.batch = 2;
  b.block_size = 128;
  b.num_tokens = 256;
  b.starts = {0, 1024};
  b.seed = 2;
  specs.push_back(b);
  GqaPrefillSpec c = a;  // per-query-head lists (Phi-3-small's layout: 32 heads over 8)
  c.layout = BlockSelectionLayout::kPerQueryHead;
  c.num_qo_heads = 32;
  c.num_kv_heads = 8;
  c.num_tokens = 130;
  c.seed = 3;
  specs.push_back(c);
  GqaPrefillSpec d;  // head dim 64 (the 16-row tiles), f16
  d.dtype = DType::kF16;
  d.num_tokens = 100;
  d.num_qo_heads = 8;
  d.num_kv_heads = 4;
  d.head_dim = 64;
  d.block_size = 32;
  d.starts = {96};
  d.seed = 4;
  specs.push_back(d);
  return specs;
}

struct GqaDevice {
  Buffer q, k, v, ids, counts, kv_lens, out, lse;
  explicit GqaDevice(const testing::GqaPrefillProblem& pb) {
    q = to_device(pb.q);
    k = to_device(pb.k);
    v = to_device(pb.v);
    ids = to_device(pb.block_ids);
    counts = to_device(pb.counts);
    kv_lens = to_device(pb.kv_lens);
    const size_t rows = static_cast<size_t>(pb.spec.batch) * pb.spec.num_tokens * pb.spec.num_qo_heads;
    out = Buffer(Device::kCuda, rows * pb.spec.head_dim * dtype_size(pb.spec.dtype));
    lse = Buffer(Device::kCuda, rows * sizeof(float));
    fill_bytes(out.data(), Device::kCuda, 0xFF, out.bytes());
    fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  }
  GqaPrefillParams params(const testing::GqaPrefillProblem& pb) {
    return pb.params(q.data(), k.data(), v.data(), ids.as<int32_t>(), counts.as<int32_t>(), kv_lens.as<int32_t>(),
                     out.data(), lse.as<float>());
  }
};

TEST(GqaBlockPrefillCuda, MatchesFp64AndTheCpuBackend) {
  SKIP_WITHOUT_CUDA();
  for (const GqaPrefillSpec& spec : gqa_specs()) {
    const auto pb = testing::make_gqa_prefill_problem(spec);
    GqaDevice dev(pb);
    GqaBlockPrefill prefill(Device::kCuda);
    prefill.run(dev.params(pb));
    EXPECT_NO_THROW(prefill.check_errors());
    const auto out = testing::as_float(spec.dtype, download<uint8_t>(Device::kCuda, dev.out.data(), dev.out.bytes()));
    const auto lse = download<float>(Device::kCuda, dev.lse.data(), dev.lse.bytes() / 4);
    const auto ref = testing::gqa_prefill_reference(pb);
    EXPECT_EQ(testing::compare_gqa_prefill(pb, ref, out, lse, 1e-2, 2e-2), "")
        << "seed " << spec.seed << " (" << prefill.kernel_name() << ")";
    std::vector<float> oracle_out, oracle_lse;
    testing::gqa_token_by_token_cpu(pb, oracle_out, oracle_lse);
    EXPECT_LT(testing::relative_l2(out, std::vector<double>(oracle_out.begin(), oracle_out.end())), 1e-2)
        << "seed " << spec.seed << ": against the decode run one token at a time";
  }
}

TEST(GqaBlockPrefillCuda, AMisalignedChunkAndAFutureBlockAreReported) {
  SKIP_WITHOUT_CUDA();
  auto pb = testing::make_gqa_prefill_problem(gqa_specs()[0]);
  {
    GqaDevice dev(pb);
    std::vector<int32_t> lens = {static_cast<int32_t>(pb.kv_len - 5)};  // starts 5 positions off the block grid
    copy_bytes(dev.kv_lens.data(), Device::kCuda, lens.data(), Device::kCpu, 4);
    GqaBlockPrefill prefill(Device::kCuda);
    prefill.run(dev.params(pb));
    EXPECT_TRUE(
        testing::throws_error_naming([&] { prefill.check_errors(); }, "did not start at a multiple of block_size"));
  }
  pb.block_ids[0] = static_cast<int32_t>(pb.kv_len / pb.spec.block_size) + 2;  // a block past the chunk
  GqaDevice dev(pb);
  GqaBlockPrefill prefill(Device::kCuda);
  prefill.run(dev.params(pb));
  const auto lse = download<float>(Device::kCuda, dev.lse.data(), dev.lse.bytes() / 4);
  // Query block 0's tokens of KV head 0 are poisoned, the other KV head's are not.
  EXPECT_TRUE(std::isnan(lse[0]));
  EXPECT_FALSE(std::isnan(lse[static_cast<size_t>(pb.spec.num_qo_heads) - 1]));
  EXPECT_TRUE(testing::throws_error_naming([&] { prefill.check_errors(); }, "past its query block's end"));
}

// The block indexer's lists straight into the attention, captured once and
// replayed: the same bits as the eager run.
TEST(GqaBlockPrefillCuda, IndexerAndAttentionReplayFromAGraph) {
  SKIP_WITHOUT_CUDA();
  GqaPrefillSpec spec = gqa_specs()[1];
  spec.batch = 1;
  spec.starts = {512};
  auto pb = testing::make_gqa_prefill_problem(spec);
  std::mt19937_64 rng(51);
  const int32_t hkv = spec.num_kv_heads, d = spec.head_dim;
  pb.k = testing::random_values(DType::kBF16, pb.k.size() / 2, rng);  // every row live: the lists are the indexer's
  pb.v = testing::random_values(DType::kBF16, pb.v.size() / 2, rng);
  const auto keys = testing::random_values(DType::kBF16, static_cast<size_t>(pb.capacity) * d, rng);
  const auto q_index = testing::random_values(DType::kBF16, static_cast<size_t>(spec.num_tokens) * hkv * d, rng);
  GqaDevice graphed(pb), eager(pb);
  Buffer d_keys = to_device(keys), d_qi = to_device(q_index);
  const auto indexer_params = [&](GqaDevice& dev) {
    BlockPrefillIndexerParams ip;
    ip.chunk = {1, spec.num_tokens, pb.kv_len, dev.kv_lens.as<int32_t>()};
    ip.num_kv_heads = hkv;
    ip.head_dim = d;
    ip.block_size = spec.block_size;
    ip.top_blocks = spec.width - 1;
    ip.index_keys = {d_keys.data(), d, d, 0, 0, pb.capacity};
    ip.q_index = d_qi.data();
    ip.block_ids = dev.ids.as<int32_t>();
    ip.counts = dev.counts.as<int32_t>();
    return ip;
  };
  cudaStream_t stream;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  BlockPrefillIndexer g_indexer(Device::kCuda), e_indexer(Device::kCuda);
  GqaBlockPrefill g_prefill(Device::kCuda), e_prefill(Device::kCuda);
  g_indexer.prepare(indexer_params(graphed), stream);
  g_prefill.prepare(graphed.params(pb), stream);
  g_indexer.run(indexer_params(graphed), stream);  // once eagerly: first-launch attributes outside the capture
  g_prefill.run(graphed.params(pb), stream);
  testing::cuda_ok(cudaStreamSynchronize(stream), "eager run");
  fill_bytes(graphed.out.data(), Device::kCuda, 0xFF, graphed.out.bytes());  // the replay must write it again
  cudaGraph_t graph;
  testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  g_indexer.run(indexer_params(graphed), stream);
  g_prefill.run(graphed.params(pb), stream);
  testing::cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec;
  testing::cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
  e_indexer.run(indexer_params(eager), stream);
  e_prefill.run(eager.params(pb), stream);
  testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
  EXPECT_EQ(download<int32_t>(Device::kCuda, graphed.ids.data(), graphed.ids.bytes() / 4),
            download<int32_t>(Device::kCuda, eager.ids.data(), eager.ids.bytes() / 4));
  EXPECT_EQ(download<uint8_t>(Device::kCuda, graphed.out.data(), graphed.out.bytes()),
            download<uint8_t>(Device::kCuda, eager.out.data(), eager.out.bytes()));
  // And the output is the fp64 attention over what the indexer kept.
  pb.block_ids = download<int32_t>(Device::kCuda, eager.ids.data(), pb.block_ids.size());
  pb.counts = download<int32_t>(Device::kCuda, eager.counts.data(), pb.counts.size());
  const auto ref = testing::gqa_prefill_reference(pb);
  EXPECT_EQ(testing::compare_gqa_prefill(
                pb, ref,
                testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, eager.out.data(), eager.out.bytes())),
                download<float>(Device::kCuda, eager.lse.data(), eager.lse.bytes() / 4), 1e-2, 2e-2),
            "");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- GQA over blocks, FP8 K/V (e4m3 per KV head) ---------------------------------------

/// Specs at head dim 128 (the FP8 kernel's): per-KV-head lists of 64- and
/// 128-token blocks, per-query-head lists (32 heads over 8), f16.
std::vector<GqaPrefillSpec> gqa_fp8_specs() {
  std::vector<GqaPrefillSpec> specs = gqa_specs();
  specs.pop_back();             // head dim 64: no FP8 kernel
  GqaPrefillSpec f = specs[0];  // f16, four KV heads (every scale factor)
  f.dtype = DType::kF16;
  f.num_kv_heads = 4;
  f.num_tokens = 150;
  f.seed = 7;
  specs.push_back(f);
  return specs;
}

struct GqaFp8Device : GqaDevice {
  Buffer k8, v8, k_scale, v_scale;
  explicit GqaFp8Device(const testing::GqaFp8Problem& pb) : GqaDevice(pb.base) {
    k8 = to_device(pb.k8);
    v8 = to_device(pb.v8);
    k_scale = to_device(pb.k_scale);
    v_scale = to_device(pb.v_scale);
  }
  GqaPrefillParams params(const testing::GqaFp8Problem& pb) {
    return pb.params(q.data(), k8.data(), v8.data(), k_scale.as<float>(), v_scale.as<float>(), ids.as<int32_t>(),
                     counts.as<int32_t>(), kv_lens.as<int32_t>(), out.data(), lse.as<float>());
  }
  std::vector<float> out_values(DType dtype) const {
    return testing::as_float(dtype, download<uint8_t>(Device::kCuda, out.data(), out.bytes()));
  }
  std::vector<float> lse_values() const { return download<float>(Device::kCuda, lse.data(), lse.bytes() / 4); }
};

/// The CPU backend's FP8 prefill of the same problem (outputs as fp32).
void fp8_prefill_cpu(const testing::GqaFp8Problem& pb, std::vector<float>& out, std::vector<float>& lse) {
  const GqaPrefillSpec& spec = pb.base.spec;
  const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_qo_heads;
  std::vector<uint8_t> o = testing::nan_values(spec.dtype, rows * spec.head_dim);
  lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  GqaBlockPrefill cpu(Device::kCpu);
  cpu.run(pb.host_params(o.data(), lse.data()));
  out = testing::as_float(spec.dtype, o);
}

// FP8 rows run on the 64-row CTA's e4m3 form where sm_90a code runs (else
// on the 16-row e4m3 tiles): fp64 over the dequantized rows (every
// unattended row e4m3 NaN, the outputs NaN first) and the CPU backend, for
// power-of-two and amax / 448 scales.
TEST(GqaBlockPrefillCuda, Fp8MatchesFp64AndTheCpuBackend) {
  SKIP_WITHOUT_CUDA();
  for (const GqaPrefillSpec& spec : gqa_fp8_specs()) {
    for (bool pow2 : {true, false}) {
      const auto pb = testing::make_gqa_fp8_problem(spec, pow2);
      GqaFp8Device dev(pb);
      GqaBlockPrefill prefill(Device::kCuda);
      prefill.run(dev.params(pb));
      EXPECT_NO_THROW(prefill.check_errors());
      // The name is the last launch's: the chunk's last query block, whose
      // query rows (its tokens x the heads a list serves) pick the CTA.
      const int32_t tail = spec.num_tokens % spec.block_size == 0 ? spec.block_size : spec.num_tokens % spec.block_size;
      const int32_t heads =
          spec.layout == BlockSelectionLayout::kPerQueryHead ? 1 : spec.num_qo_heads / spec.num_kv_heads;
      const bool wgmma = cuda_sm90a_code_runs(cuda_device_sm()) && tail >= 2 && heads * tail > 16;
      EXPECT_STREQ(prefill.kernel_name(),
                   wgmma ? "64-row multi-token CTA, wgmma, FP8 e4m3 K/V" : "16-row tiles, mma.sync, FP8 e4m3 K/V");
      const auto out = dev.out_values(spec.dtype);
      const auto lse = dev.lse_values();
      const auto ref = testing::gqa_fp8_reference(pb);
      EXPECT_EQ(testing::compare_gqa_prefill(pb.base, ref, out, lse, 1e-2, 2e-2), "")
          << "seed " << spec.seed << (pow2 ? ", power-of-two scales" : ", amax / 448 scales");
      std::vector<float> cpu_out, cpu_lse;
      fp8_prefill_cpu(pb, cpu_out, cpu_lse);
      EXPECT_LT(testing::relative_l2(out, std::vector<double>(cpu_out.begin(), cpu_out.end())), 1e-2)
          << "seed " << spec.seed << ": against the CPU backend";
      EXPECT_LT(testing::relative_l2(lse, std::vector<double>(cpu_lse.begin(), cpu_lse.end())), 1e-3)
          << "seed " << spec.seed << ": lse against the CPU backend";
    }
  }
}

// The same rows in an engine's pool through a shuffled block table (the
// engine-input e4m3 kernel): the dense FP8 prefill's answer, and fp64.
TEST(GqaBlockPrefillCuda, Fp8ReadsAnEnginePoolThroughItsBlockTable) {
  SKIP_WITHOUT_CUDA();
  for (const GqaPrefillSpec& spec : gqa_fp8_specs()) {
    const auto pb = testing::make_gqa_fp8_problem(spec, false);
    const auto pool = testing::make_gqa_fp8_pool(pb, 16, spec.seed + 100);
    GqaFp8Device dense(pb), paged(pb);
    Buffer pool_k = to_device(pool.k), pool_v = to_device(pool.v), table = to_device(pool.table);
    GqaBlockPrefill dense_prefill(Device::kCuda), paged_prefill(Device::kCuda);
    dense_prefill.run(dense.params(pb));
    paged_prefill.run(pool.paged(paged.params(pb), pool_k.data(), pool_v.data(), table.as<int32_t>(), spec.batch));
    EXPECT_NO_THROW(paged_prefill.check_errors());
    EXPECT_STREQ(paged_prefill.kernel_name(), "16-row tiles, mma.sync, FP8 e4m3 K/V");
    const auto out = paged.out_values(spec.dtype);
    const auto lse = paged.lse_values();
    const auto dense_out = dense.out_values(spec.dtype);
    // Two CTAs where sm_90a code runs (the dense chunk on the 64-row one):
    // their sums run in another order and their lazy softmax bases differ,
    // so the rounded P and outputs differ (measured on the H200: relative L2
    // up to 3.0e-3); each is checked against fp64 on its own.
    EXPECT_LT(testing::relative_l2(out, std::vector<double>(dense_out.begin(), dense_out.end())), 1e-2)
        << "seed " << spec.seed << ": against the dense FP8 prefill";
    EXPECT_EQ(testing::compare_gqa_prefill(pb.base, testing::gqa_fp8_reference(pb), out, lse, 1e-2, 2e-2), "")
        << "seed " << spec.seed;
  }
}

// Per-query-head lists expand each KV head's scale on the device every run:
// a captured chunk replayed after the scales changed uses the new scales.
TEST(GqaBlockPrefillCuda, Fp8ReplaysFromAGraphWithTheScalesOfTheReplay) {
  SKIP_WITHOUT_CUDA();
  const GqaPrefillSpec spec = gqa_fp8_specs()[2];
  ASSERT_EQ(spec.layout, BlockSelectionLayout::kPerQueryHead);
  auto pb = testing::make_gqa_fp8_problem(spec, false);
  GqaFp8Device dev(pb);
  cudaStream_t stream;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  GqaBlockPrefill prefill(Device::kCuda);
  prefill.prepare(dev.params(pb), stream);
  prefill.run(dev.params(pb), stream);  // once eagerly: first-launch attributes outside the capture
  testing::cuda_ok(cudaStreamSynchronize(stream), "eager run");
  cudaGraph_t graph;
  testing::cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  prefill.run(dev.params(pb), stream);
  testing::cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec;
  testing::cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  // New scales (each head's doubled or halved), then the replay.
  for (size_t h = 0; h < pb.k_scale.size(); ++h) {
    pb.k_scale[h] *= h % 2 == 0 ? 2.0f : 0.5f;
    pb.v_scale[h] *= h % 2 == 0 ? 0.5f : 2.0f;
  }
  for (size_t i = 0; i < pb.k_values.size(); ++i) {
    const size_t h = (i / static_cast<size_t>(spec.head_dim * pb.base.capacity)) % pb.k_scale.size();
    pb.k_values[i] *= h % 2 == 0 ? 2.0f : 0.5f;
    pb.v_values[i] *= h % 2 == 0 ? 0.5f : 2.0f;
  }
  copy_bytes(dev.k_scale.data(), Device::kCuda, pb.k_scale.data(), Device::kCpu, pb.k_scale.size() * 4);
  copy_bytes(dev.v_scale.data(), Device::kCuda, pb.v_scale.data(), Device::kCpu, pb.v_scale.size() * 4);
  fill_bytes(dev.out.data(), Device::kCuda, 0xFF, dev.out.bytes());  // the replay must write it again
  fill_bytes(dev.lse.data(), Device::kCuda, 0xFF, dev.lse.bytes());
  testing::cuda_ok(cudaGraphLaunch(exec, stream), "replay");
  testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
  EXPECT_NO_THROW(prefill.check_errors(stream));
  EXPECT_EQ(testing::compare_gqa_prefill(pb.base, testing::gqa_fp8_reference(pb), dev.out_values(spec.dtype),
                                         dev.lse_values(), 1e-2, 2e-2),
            "");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace sparsepage
