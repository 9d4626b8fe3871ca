// The block-sparse indexer on the GPU (src/cuda/indexers/block_indexer.cu) against
// the CPU rule select_top_blocks_cpu: the selected sets, the final block, the
// covered token counts, the -1 padding, lengths read on the device, one
// captured graph replayed at several lengths, and named argument errors.
//
// Index queries and keys are small integers wherever sets are compared, so
// every dot product is exact in fp32 whatever the summation order: the two
// rules must agree on every block, ties (many, with integer inputs) included.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "core/cuda_hooks.h"
#include "cuda/cuda_test_util.h"
#include "models/block_sparse_kernels.h"
#include "sparsepage/models/block_sparse.h"

namespace sparsepage {
namespace {

struct BlockProblem {
  BlockSparseConfig config;
  int32_t batch = 1;
  int64_t capacity = 0;
  std::vector<float> k_alloc;  // [batch, heads + 1, capacity, dim]
  std::vector<float> index_q;  // [batch, heads, dim]

  float* key(int32_t b, int64_t t) {
    return &k_alloc[size_t(((int64_t{b} * (config.num_kv_heads + 1) + config.num_kv_heads) * capacity + t) *
                           config.head_dim)];
  }
  // The CPU rule at live length `len` for sequence b: its requests' rows.
  std::vector<int32_t> cpu(int32_t b, int64_t len) {
    std::vector<float> keys;
    for (int64_t t = 0; t < len; ++t) keys.insert(keys.end(), key(b, t), key(b, t) + config.head_dim);
    return select_top_blocks_cpu(config, 1, len, &index_q[size_t(b * config.num_kv_heads * config.head_dim)], keys);
  }
};

BlockProblem make_problem(const BlockSparseConfig& config, int32_t batch, int64_t capacity, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(-3, 3);
  BlockProblem pb;
  pb.config = config;
  pb.batch = batch;
  pb.capacity = capacity;
  // Attention heads are NaN: the indexer must read only the index head.
  pb.k_alloc.assign(size_t(batch * (config.num_kv_heads + 1) * capacity * config.head_dim), NAN);
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < capacity; ++t) {
      float* k = pb.key(b, t);
      for (int32_t d = 0; d < config.head_dim; ++d) k[d] = float(small(rng));
    }
    // A NaN row inside block 2 (dropped by the max, as std::max drops it), and
    // block 3 all NaN (scores -inf, ranks last).
    pb.key(b, 2 * config.block_size + 1)[3] = NAN;
    for (int64_t t = 3 * config.block_size; t < 4 * config.block_size && t < capacity; ++t) pb.key(b, t)[0] = NAN;
  }
  for (size_t i = 0; i < size_t(batch * config.num_kv_heads * config.head_dim); ++i) {
    pb.index_q.push_back(float(small(rng)));
  }
  return pb;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() * 2);
  from_float(DType::kBF16, x.data(), out.data(), x.size());
  return out;
}

struct DeviceBlockIndexer {
  Buffer k, q, lens, block_ids, seq_lens, workspace;
  detail::BlockIndexerArgs args{};
  DeviceBlockIndexer(const BlockProblem& pb, int64_t max_kv_len, int32_t width)
      : k(upload(Device::kCuda, bf16_bytes(pb.k_alloc))),
        q(upload(Device::kCuda, bf16_bytes(pb.index_q))),
        lens(Device::kCuda, size_t(pb.batch) * sizeof(int32_t)),
        block_ids(Device::kCuda, size_t(pb.batch * pb.config.num_kv_heads * width) * sizeof(int32_t)),
        seq_lens(Device::kCuda, size_t(pb.batch * pb.config.num_kv_heads) * sizeof(int32_t)),
        workspace(Device::kCuda, detail::block_indexer_workspace_bytes(pb.batch, pb.config.num_kv_heads, max_kv_len,
                                                                       pb.config.block_size)) {
    args.dtype = DType::kBF16;
    args.k_alloc = k.data();
    args.index_q = q.data();
    args.batch = pb.batch;
    args.num_kv_heads = pb.config.num_kv_heads;
    args.head_dim = pb.config.head_dim;
    args.capacity = pb.capacity;
    args.kv_lens = lens.as<int32_t>();
    args.max_kv_len = max_kv_len;
    args.block_size = pb.config.block_size;
    args.topk = pb.config.topk_blocks;
    args.local_blocks = pb.config.local_blocks;
    args.width = width;
    args.block_ids = block_ids.as<int32_t>();
    args.seq_lens = seq_lens.as<int32_t>();
    args.workspace = workspace.data();
    args.workspace_bytes = workspace.bytes();
  }
  void set_lens(const std::vector<int32_t>& v) {
    copy_bytes(lens.data(), Device::kCuda, v.data(), Device::kCpu, v.size() * sizeof(int32_t));
    fill_bytes(block_ids.data(), Device::kCuda, 0x55, block_ids.bytes());
    fill_bytes(seq_lens.data(), Device::kCuda, 0x55, seq_lens.bytes());
    fill_bytes(workspace.data(), Device::kCuda, 0x7F, workspace.bytes());  // stale scores must not matter
  }
};

// The GPU rows against the CPU rule at the given per-sequence lengths.
void expect_matches_cpu(BlockProblem& pb, const DeviceBlockIndexer& dev, const std::vector<int32_t>& lens,
                        const std::string& what) {
  const int32_t heads = pb.config.num_kv_heads, width = dev.args.width, bs = pb.config.block_size;
  const auto ids = download<int32_t>(Device::kCuda, dev.block_ids.data(), size_t(pb.batch * heads * width));
  const auto covered = download<int32_t>(Device::kCuda, dev.seq_lens.data(), size_t(pb.batch * heads));
  for (int32_t b = 0; b < pb.batch; ++b) {
    const int64_t len = lens[size_t(b)];
    const int32_t nb = int32_t((len + bs - 1) / bs);
    const int32_t keep = std::min(pb.config.topk_blocks, nb - 1);
    const std::vector<int32_t> want_all = pb.cpu(b, len);
    for (int32_t h = 0; h < heads; ++h) {
      const std::string at =
          what + ", sequence " + std::to_string(b) + " head " + std::to_string(h) + " length " + std::to_string(len);
      const int32_t r = b * heads + h;
      std::vector<int32_t> got(ids.begin() + r * width, ids.begin() + r * width + keep);
      std::vector<int32_t> want(want_all.begin() + h * (keep + 1), want_all.begin() + h * (keep + 1) + keep);
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      EXPECT_EQ(got, want) << at;
      EXPECT_EQ(ids[size_t(r * width + keep)], nb - 1) << at << ": the final block";
      for (int32_t i = keep + 1; i < width; ++i) EXPECT_EQ(ids[size_t(r * width + i)], -1) << at << ": padding";
      EXPECT_EQ(covered[size_t(r)], int32_t(keep * bs + (len - int64_t{nb - 1} * bs))) << at << ": seq_lens";
    }
  }
}

TEST(BlockIndexerCuda, MatchesTheCpuRuleOnExactScores) {
  SKIP_WITHOUT_CUDA();
  struct Case {
    BlockSparseConfig config;
    int32_t batch;
    std::vector<int32_t> lens;
  };
  // {qo heads, kv heads, head dim, block size, topk, local blocks, capacity step}
  const std::vector<Case> cases = {
      // the shipped geometry; a partial final block (8192 under the sanitizers)
      {{16, 4, 128, 128, 16, 1, 4096}, 2, {testing::quick_mode() ? 8192 : 32768, 5000}},
      {{8, 2, 64, 16, 4, 2, 64}, 3, {301, 64, 17}},    // scored count below topk; one block only
      {{8, 2, 64, 16, 4, 3, 64}, 1, {1}},              // a single token
      {{8, 1, 32, 16, 8, 2, 64}, 1, {16 * 5000 + 3}},  // more scored blocks than shared memory ranks
      {{8, 8, 128, 64, 32, 4, 64}, 2, {9000, 8999}},   // eight KV heads, wider top-k
      // 256, 257 and 1000 scored blocks: one per top-k thread, one more, many.
      {{8, 2, 64, 16, 8, 2, 64}, 3, {16 * 256 + 1, 16 * 257 + 1, 16 * 1000 + 5}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const int64_t max_len = *std::max_element(c.lens.begin(), c.lens.end());
    BlockProblem pb = make_problem(c.config, c.batch, max_len + 40, 300 + i);
    DeviceBlockIndexer dev(pb, max_len, c.config.topk_blocks + 3);  // wider than needed: padded with -1
    dev.set_lens(c.lens);
    detail::block_indexer_cuda(dev.args, nullptr);
    testing::cuda_ok(cudaDeviceSynchronize(), "indexer");
    expect_matches_cpu(pb, dev, c.lens, "case " + std::to_string(i));
  }
}

// Lengths come from the device: the same arguments, launched again after the
// device lengths changed (across block boundaries), give each length's answer.
TEST(BlockIndexerCuda, ReadsTheLengthsOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  const BlockSparseConfig config{16, 4, 128, 128, 16, 2, 4096};
  BlockProblem pb = make_problem(config, 3, 20000, 31);
  DeviceBlockIndexer dev(pb, 20000, config.topk_blocks + 1);
  for (const std::vector<int32_t>& lens :
       {std::vector<int32_t>{20000, 4224, 4225}, std::vector<int32_t>{130, 20000, 2049},
        std::vector<int32_t>{4353, 1, 19999}}) {
    dev.set_lens(lens);
    detail::block_indexer_cuda(dev.args, nullptr);
    testing::cuda_ok(cudaDeviceSynchronize(), "indexer");
    expect_matches_cpu(pb, dev, lens, "device lengths");
  }
}

// One graph, captured once in global mode (an allocation or synchronize
// inside would fail the capture), replayed while the context grows.
TEST(BlockIndexerCuda, OneGraphServesAGrowingContext) {
  SKIP_WITHOUT_CUDA();
  const BlockSparseConfig config{16, 4, 128, 128, 16, 1, 4096};
  BlockProblem pb = make_problem(config, 2, 12000, 32);
  DeviceBlockIndexer dev(pb, 12000, config.topk_blocks + 1);
  dev.set_lens({4100, 4100});
  testing::StreamGraph graph;
  graph.capture([&](cudaStream_t s) { detail::block_indexer_cuda(dev.args, s); });
  for (const std::vector<int32_t>& lens :
       {std::vector<int32_t>{4100, 4100}, std::vector<int32_t>{4224, 4225}, std::vector<int32_t>{12000, 5555}}) {
    dev.set_lens(lens);
    graph.replay();
    expect_matches_cpu(pb, dev, lens, "graph replay");
  }
}

// The block mask reads the lengths on the device too: kept blocks inside the
// live window are 0, everything else (including past the length) -inf.
TEST(BlockIndexerCuda, BlockMaskFollowsTheDeviceLengths) {
  SKIP_WITHOUT_CUDA();
  const std::vector<int32_t> ids = {0, 2, -1, 1, 2, 3};  // two requests of width 3, one sequence each
  const Buffer d_ids = upload(Device::kCuda, ids);
  const Buffer lens = upload(Device::kCuda, std::vector<int32_t>{10, 7});
  Buffer mask(Device::kCuda, 2 * 12 * sizeof(float));
  detail::block_mask_cuda(d_ids.as<int32_t>(), 2, 1, 3, 4, lens.as<int32_t>(), 12, mask.as<float>(), nullptr);
  const auto m = download<float>(Device::kCuda, mask.data(), 24);
  for (int t = 0; t < 12; ++t) {
    const bool kept0 = t < 10 && (t / 4 == 0 || t / 4 == 2);
    const bool kept1 = t < 7 && (t / 4 == 1 || t / 4 == 2 || t / 4 == 3);
    EXPECT_EQ(m[size_t(t)], kept0 ? 0.0f : -INFINITY) << "request 0 position " << t;
    EXPECT_EQ(m[size_t(12 + t)], kept1 ? 0.0f : -INFINITY) << "request 1 position " << t;
  }
}

TEST(BlockIndexerCuda, BadArgumentsAreNamed) {
  SKIP_WITHOUT_CUDA();
  const BlockSparseConfig config{8, 2, 64, 16, 4, 2, 64};
  BlockProblem pb = make_problem(config, 1, 400, 5);
  DeviceBlockIndexer dev(pb, 400, 5);
  dev.set_lens({400});
  const detail::BlockIndexerArgs good = dev.args;
  EXPECT_NO_THROW(detail::block_indexer_cuda(good, nullptr));
  const auto expect_error = [&](detail::BlockIndexerArgs a, const std::string& needle) {
    try {
      detail::block_indexer_cuda(a, nullptr);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto a = good;
  a.width = 4;
  expect_error(a, "width = 4");
  a = good;
  a.workspace_bytes = 4;
  expect_error(a, "workspace_bytes");
  a = good;
  a.max_kv_len = 401;
  expect_error(a, "max_kv_len = 401");
  a = good;
  a.kv_lens = nullptr;
  expect_error(a, "kv_lens");
  a = good;
  a.head_dim = 136;
  expect_error(a, "head_dim = 136");
  a = good;
  a.num_kv_heads = 9;
  expect_error(a, "num_kv_heads = 9");
  a = good;
  a.dtype = DType::kF32;
  expect_error(a, "f16 or bf16");
  testing::cuda_ok(cudaDeviceSynchronize(), "sync");
}

}  // namespace
}  // namespace sparsepage
