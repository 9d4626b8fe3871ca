// The DSA layer (docs/DESIGN.md: the DSA layer) on the GPU: the CUDA indexer against the CPU rule
// (set equality, the tie rule, NaN keys, the window-fits case, graph replay),
// the layer against the same layer on the CPU backend and an fp64 reference
// (fused when sparse, the kill switch's mask path giving the same answer),
// and greedy decoding of the toy model on the GPU against the CPU.
//
// Index queries and keys are small integers and the weights multiples of 1/2
// wherever sets are compared exactly: every score is then exact in fp32
// whatever the order of the sums, so the two indexers must agree on every
// position, ties included. The one test on real-valued inputs allows swaps
// only between scores closer than fp32 rounding.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>

#include "cuda/cuda_test_util.h"
#include "sparsepage/models/dsa.h"
#include "support/layer_checks.h"
#include "support/toy_model.h"

namespace sparsepage {
namespace {

using Rows = std::vector<std::vector<int32_t>>;

std::vector<uint8_t> bytes_of(DType dtype, const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() * dtype_size(dtype));
  from_float(dtype, x.data(), out.data(), x.size());
  return out;
}

// ---- the indexer ----------------------------------------------------------

struct IndexerCase {
  int32_t heads, dim, topk, batch;
  int64_t kv_len;
  DType dtype;
  bool zero_weights_row1;  // sequence 1 scores every position 0: the top-k is the lowest positions
};

// One indexer call's inputs on the host, as floats exact in `dtype`. The K
// rows carry NaN latent columns and NaN rows past the window: the indexer
// must read neither.
struct IndexerProblem {
  DsaConfig config;
  int32_t batch = 0;
  int64_t kv_len = 0, capacity = 0;
  DType dtype = DType::kBF16;
  std::vector<float> k_rows;   // [batch * capacity, latent_dim + index_head_dim]
  std::vector<float> q_index;  // [batch, index_heads, index_head_dim]
  std::vector<float> weights;  // [batch, index_heads]

  int64_t stride() const { return config.latent_dim + config.index_head_dim; }
  float* key(int32_t b, int64_t t) { return &k_rows[size_t((b * capacity + t) * stride() + config.latent_dim)]; }
  const float* key(int32_t b, int64_t t) const {
    return &k_rows[size_t((b * capacity + t) * stride() + config.latent_dim)];
  }
  // I(b, t) in fp64 (exact for the integer inputs), NaN ranked as -inf.
  std::vector<double> scores(int32_t b) const {
    std::vector<double> s(static_cast<size_t>(kv_len));
    for (int64_t t = 0; t < kv_len; ++t) {
      double total = 0;
      for (int32_t j = 0; j < config.index_heads; ++j) {
        const float* q = &q_index[size_t((b * config.index_heads + j) * config.index_head_dim)];
        double dot = 0;
        for (int32_t d = 0; d < config.index_head_dim; ++d) dot += double(q[d]) * key(b, t)[d];
        total += weights[size_t(b * config.index_heads + j)] * std::max(dot, 0.0);
      }
      s[size_t(t)] = std::isnan(total) ? -INFINITY : total;
    }
    return s;
  }
  Rows cpu() const {
    std::vector<float> keys;
    for (int32_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < kv_len; ++t) keys.insert(keys.end(), key(b, t), key(b, t) + config.index_head_dim);
    }
    return dsa_select_tokens_cpu(config, batch, kv_len, q_index.data(), weights.data(), keys);
  }
  // The CUDA indexer with its outputs poisoned before the call; checks the
  // device counts and the -1 padding, and returns each sequence's kept entries.
  Rows gpu() const {
    const Buffer k = upload(Device::kCuda, bytes_of(dtype, k_rows));
    const Buffer q = upload(Device::kCuda, bytes_of(dtype, q_index));
    const Buffer w = upload(Device::kCuda, weights);
    const Buffer lens = upload(Device::kCuda, std::vector<int32_t>(size_t(batch), int32_t(kv_len)));
    Buffer workspace(Device::kCuda, dsa_indexer_workspace_bytes(config, batch, kv_len));
    fill_bytes(workspace.data(), Device::kCuda, 0x7F, workspace.bytes());  // stale contents must not matter
    Buffer positions(Device::kCuda, size_t(batch * config.index_topk) * sizeof(int32_t));
    Buffer counts(Device::kCuda, size_t(batch) * sizeof(int32_t));
    fill_bytes(positions.data(), Device::kCuda, 0x55, positions.bytes());
    fill_bytes(counts.data(), Device::kCuda, 0x55, counts.bytes());
    DsaIndexerArgs a;
    a.dtype = dtype;
    a.k_cache = k.data();
    a.capacity = capacity;
    a.kv_lens = lens.as<int32_t>();
    a.max_kv_len = kv_len;
    a.q_index = q.data();
    a.weights = w.as<float>();
    a.workspace = workspace.data();
    a.workspace_bytes = workspace.bytes();
    a.positions = positions.as<int32_t>();
    a.counts = counts.as<int32_t>();
    dsa_select_tokens_cuda(config, batch, a);
    testing::cuda_ok(cudaDeviceSynchronize(), "indexer");
    return read_back(positions, counts, batch, config.index_topk, kv_len);
  }
  // Rows of a [batch, topk] output: counts must be min(topk, kv_len) and the
  // entries past them -1.
  static Rows read_back(const Buffer& positions, const Buffer& counts, int32_t batch, int32_t topk, int64_t kv_len) {
    const auto flat = download<int32_t>(Device::kCuda, positions.data(), size_t(batch) * size_t(topk));
    const auto n = download<int32_t>(Device::kCuda, counts.data(), size_t(batch));
    const int64_t keep = std::min<int64_t>(topk, kv_len);
    Rows out;
    for (int32_t b = 0; b < batch; ++b) {
      EXPECT_EQ(n[size_t(b)], keep) << "count of sequence " << b;
      for (int64_t i = keep; i < topk; ++i) EXPECT_EQ(flat[size_t(b * topk + i)], -1) << "padding of sequence " << b;
      out.emplace_back(flat.begin() + b * topk, flat.begin() + b * topk + keep);
    }
    return out;
  }
};

IndexerProblem make_exact_problem(const IndexerCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(-4, 4), half_steps(-2, 4);
  IndexerProblem pb;
  pb.config = DsaConfig{1, 64, 64, c.heads, c.dim, c.topk, 0.0f, 64};
  pb.batch = c.batch;
  pb.kv_len = c.kv_len;
  pb.capacity = c.kv_len + 37;  // rows past the window exist and are poison
  pb.dtype = c.dtype;
  pb.k_rows.assign(size_t(c.batch * pb.capacity * pb.stride()), NAN);
  for (int32_t b = 0; b < c.batch; ++b) {
    for (int64_t t = 0; t < c.kv_len; ++t) {
      for (int32_t d = 0; d < c.dim; ++d) pb.key(b, t)[d] = float(small(rng));
    }
  }
  for (size_t i = 0; i < size_t(c.batch * c.heads * c.dim); ++i) pb.q_index.push_back(float(small(rng)));
  for (size_t i = 0; i < size_t(c.batch * c.heads); ++i) pb.weights.push_back(0.5f * float(half_steps(rng)));
  if (c.zero_weights_row1) std::fill_n(pb.weights.begin() + c.heads, c.heads, 0.0f);
  const int64_t keep = std::min<int64_t>(c.topk, c.kv_len);
  for (int32_t b = 0; b < c.batch; ++b) {
    const std::vector<double> s = pb.scores(b);
    std::vector<int64_t> order(size_t(c.kv_len));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return s[size_t(x)] > s[size_t(y)]; });
    // A deliberate tie block across the threshold: the k-th ranked key copied
    // onto the dozen lowest-ranked positions, so more positions share the
    // threshold score than the top-k keeps and the tie rule decides.
    if (c.kv_len >= keep + 14) {
      const float* kth = pb.key(b, order[size_t(keep - 1)]);
      const std::vector<float> copy(kth, kth + c.dim);
      for (size_t i = 0; i < 12; ++i) std::copy(copy.begin(), copy.end(), pb.key(b, order[order.size() - 1 - i]));
    }
    // A NaN in the best-ranked key: its score is NaN and must rank last.
    pb.key(b, order[0])[c.dim / 2] = NAN;
  }
  return pb;
}

// The GPU rows in increasing position (the documented order), inside the
// window, and the same set as the CPU rule.
void expect_same_sets(const Rows& gpu, const Rows& cpu, int64_t kv_len, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  for (size_t b = 0; b < gpu.size(); ++b) {
    ASSERT_EQ(gpu[b].size(), cpu[b].size()) << what << " sequence " << b;
    for (size_t i = 0; i < gpu[b].size(); ++i) {
      ASSERT_TRUE(gpu[b][i] >= 0 && gpu[b][i] < kv_len) << what << " sequence " << b << " entry " << i;
      if (i > 0) {
        ASSERT_LT(gpu[b][i - 1], gpu[b][i]) << what << " sequence " << b << ": not increasing";
      }
    }
    std::vector<int32_t> want = cpu[b];
    std::sort(want.begin(), want.end());
    EXPECT_EQ(gpu[b], want) << what << " sequence " << b;
  }
}

TEST(DsaIndexerCuda, MatchesTheCpuRuleOnExactScores) {
  SKIP_WITHOUT_CUDA();
  const std::vector<IndexerCase> cases = {
      {4, 64, 64, 2, 50, DType::kBF16, false},     // the window fits the top-k: everything
      {4, 64, 64, 2, 64, DType::kBF16, false},     // exactly fits
      {4, 128, 256, 3, 257, DType::kBF16, false},  // one position dropped
      {4, 128, 128, 3, 4999, DType::kBF16, true},  // several CTAs and a partial tile; an all-zero row
      {4, 64, 200, 2, 3001, DType::kF16, false},
      {20, 64, 100, 2, 1000, DType::kBF16, false},    // heads not a multiple of the 16 head groups
      {64, 128, 2048, 1, 8192, DType::kBF16, false},  // the production indexer shape
      // ... over enough tiles that each score CTA's consumers reuse the key
      // stages (on a 132-SM H200: 33 CTAs per sequence, about 10 tiles each,
      // four stages), so the empty-barrier waits and parity flips run
      {64, 128, 2048, 8, 20000, DType::kBF16, false},
      {4, 64, 3000, 1, 70000, DType::kBF16, false},  // 35 slices, a long list of candidates
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const IndexerCase& c = cases[i];
    const std::string what = "heads " + std::to_string(c.heads) + " dim " + std::to_string(c.dim) + " topk " +
                             std::to_string(c.topk) + " kv_len " + std::to_string(c.kv_len);
    const IndexerProblem pb = make_exact_problem(c, 600 + i);
    const Rows cpu = pb.cpu();
    expect_same_sets(pb.gpu(), cpu, c.kv_len, what);
    if (c.kv_len > c.topk) {
      for (int32_t b = 0; b < c.batch; ++b) {
        const std::vector<double> s = pb.scores(b);
        for (int32_t t : cpu[size_t(b)]) EXPECT_TRUE(std::isfinite(s[size_t(t)])) << what << ": a NaN key was kept";
      }
    }
    if (c.zero_weights_row1) {
      // Every score ties at 0 except position 0's NaN key: positions 1 .. topk.
      std::vector<int32_t> want(size_t(c.topk));
      std::iota(want.begin(), want.end(), 1);
      EXPECT_EQ(pb.gpu()[1], want) << what;
    }
  }
}

// The rule's corners, one per sequence, over several 2048-position slices
// of the selection: (0) every kept position in the last slice, with a tie
// block straddling the threshold; (1) fewer finite scores than the top-k, so
// NaN scores (ranked last, as -inf) fill the rest from the lowest positions;
// (2) negative weights, so every score is <= 0 and zeros of either sign tie.
TEST(DsaIndexerCuda, KeepsNaNLastNegativeScoresAndTiesAcrossSlices) {
  SKIP_WITHOUT_CUDA();
  IndexerProblem pb = make_exact_problem({8, 64, 300, 3, 5000, DType::kBF16, false}, 95);
  for (int32_t b = 0; b < 3; ++b) {
    for (int64_t t = 0; t < pb.kv_len; ++t) std::fill_n(pb.key(b, t), 64, 0.0f);
  }
  // (0) score = 0.5 * 8 * (t / 40): blocks of 40 equal scores, rising with t.
  for (int32_t j = 0; j < 8; ++j) {
    std::fill_n(&pb.q_index[size_t(j * 64)], 64, 0.0f);
    pb.q_index[size_t(j * 64)] = 1.0f;
    pb.weights[size_t(j)] = 0.5f;
  }
  for (int64_t t = 0; t < pb.kv_len; ++t) pb.key(0, t)[0] = float(t / 40);
  // (1) NaN everywhere but 100 scattered positions with small-integer keys.
  std::mt19937_64 rng(96);
  std::uniform_int_distribution<int> small(-4, 4);
  for (int64_t t = 0; t < pb.kv_len; ++t) {
    if (t % 50 == 7) {
      for (int32_t d = 0; d < 64; ++d) pb.key(1, t)[d] = float(small(rng));
    } else {
      pb.key(1, t)[3] = NAN;
    }
  }
  // (2) all weights negative.
  for (int64_t t = 0; t < pb.kv_len; ++t) {
    for (int32_t d = 0; d < 64; ++d) pb.key(2, t)[d] = float(small(rng));
  }
  for (int32_t j = 0; j < 8; ++j) pb.weights[size_t(2 * 8 + j)] = -0.5f * float(1 + j % 3);
  const Rows cpu = pb.cpu();
  expect_same_sets(pb.gpu(), cpu, pb.kv_len, "corner cases");
  // The expectations the rule implies, checked on the CPU rule's own answer.
  std::vector<int32_t> want0;
  for (int32_t t = 4720; t < 5000; ++t) want0.push_back(t);  // 7 whole blocks of 40
  for (int32_t t = 4680; t < 4700; ++t) want0.push_back(t);  // the 20 lowest of the tie block 4680 .. 4719
  std::sort(want0.begin(), want0.end());
  std::vector<int32_t> got0 = cpu[0];
  std::sort(got0.begin(), got0.end());
  EXPECT_EQ(got0, want0);
  std::vector<int32_t> got1 = cpu[1];
  std::sort(got1.begin(), got1.end());
  int32_t finite = 0;
  for (int32_t t : got1) finite += t % 50 == 7;
  EXPECT_EQ(finite, 100) << "every finite score ranks above every NaN";
  int32_t nan_count = 0;
  for (int32_t t = 0; nan_count < 200; ++t) {
    if (t % 50 == 7) continue;
    EXPECT_TRUE(std::binary_search(got1.begin(), got1.end(), t)) << "NaN position " << t << " ranks by position";
    ++nan_count;
  }
}

// Every position's score in the threshold's coarse histogram bin (20000
// positions over ten slices, 4096 distinct scores, each on four or five
// positions): the last classify CTA ranks 20000 candidates by their fine
// bins, and ties at the cut go to the lower positions.
TEST(DsaIndexerCuda, ManyCandidatesInTheThresholdBin) {
  SKIP_WITHOUT_CUDA();
  IndexerProblem pb = make_exact_problem({4, 64, 98, 1, 20000, DType::kBF16, false}, 97);
  std::fill(pb.q_index.begin(), pb.q_index.end(), 0.0f);
  pb.q_index[0] = 256.0f;  // head 0: score = 256 k0 + k1, exact in bf16 and fp32
  pb.q_index[1] = 1.0f;
  std::fill(pb.weights.begin(), pb.weights.end(), 1.0f);
  for (int64_t t = 0; t < pb.kv_len; ++t) {
    const int32_t v = 32768 + int32_t(t / 2) % 4096;  // one octave, one coarse bin of 4096 values
    std::fill_n(pb.key(0, t), 64, 0.0f);
    pb.key(0, t)[0] = float(v / 256);
    pb.key(0, t)[1] = float(v % 256);
  }
  const Rows cpu = pb.cpu();
  expect_same_sets(pb.gpu(), cpu, pb.kv_len, "many candidates");
  // The top 98: the 24 highest values on four positions each (t / 2 = 4095 - i
  // and 8191 - i), then the two lowest of the 25th value's 8142, 8143, 16334, 16335.
  std::vector<int32_t> want;
  for (int32_t t = 0; t < 20000; ++t) {
    if (t / 2 % 4096 >= 4096 - 24 || t == 8142 || t == 8143) want.push_back(t);
  }
  std::vector<int32_t> got = cpu[0];
  std::sort(got.begin(), got.end());
  EXPECT_EQ(want.size(), 98u);
  EXPECT_EQ(got, want);
}

// Real-valued inputs: the sets agree except where two scores are closer than
// fp32 summation order can resolve, and any swap sits at the threshold.
TEST(DsaIndexerCuda, MatchesTheCpuRuleOnRealScoresUpToRounding) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  IndexerProblem pb = make_exact_problem({16, 128, 512, 2, 3000, DType::kBF16, false}, 77);
  for (float& x : pb.k_rows) x = std::isnan(x) ? x : bf16_to_float(float_to_bf16(unit(rng)));
  for (float& x : pb.q_index) x = bf16_to_float(float_to_bf16(unit(rng)));
  for (float& x : pb.weights) x = unit(rng);
  // Duplicate rows score identically on both sides: exact ties survive real inputs too.
  for (int32_t b = 0; b < pb.batch; ++b) {
    for (int64_t t = 100; t < 110; ++t) std::copy(pb.key(b, 7), pb.key(b, 7) + 128, pb.key(b, t));
  }
  const Rows gpu = pb.gpu(), cpu = pb.cpu();
  for (int32_t b = 0; b < pb.batch; ++b) {
    const std::vector<double> s = pb.scores(b);
    std::vector<double> sorted = s;
    std::sort(sorted.rbegin(), sorted.rend());
    const double threshold = sorted[511];
    double magnitude = 0;
    for (double x : s) magnitude = std::max(magnitude, std::fabs(x));
    std::set<int32_t> g(gpu[size_t(b)].begin(), gpu[size_t(b)].end()), c(cpu[size_t(b)].begin(), cpu[size_t(b)].end());
    ASSERT_EQ(g.size(), 512u);
    std::vector<int32_t> differ;
    std::set_symmetric_difference(g.begin(), g.end(), c.begin(), c.end(), std::back_inserter(differ));
    for (int32_t t : differ) {
      EXPECT_LT(std::fabs(s[size_t(t)] - threshold), 1e-5 * magnitude)
          << "position " << t << " swapped far from the threshold";
    }
    EXPECT_LE(differ.size(), 4u);
    // The duplicated rows are all in or all out.
    const bool in = g.count(7) != 0;
    for (int32_t t = 100; t < 110; ++t) EXPECT_EQ(g.count(t) != 0, in) << "duplicate row " << t;
  }
}

// One problem's device inputs with a device length array, for the tests that
// change the length on the device between launches of the same arguments.
struct DeviceIndexer {
  Buffer k, q, w, lens, workspace, positions, counts;
  DsaIndexerArgs args;
  DeviceIndexer(const IndexerProblem& pb, int64_t max_kv_len)
      : k(upload(Device::kCuda, bytes_of(pb.dtype, pb.k_rows))),
        q(upload(Device::kCuda, bytes_of(pb.dtype, pb.q_index))),
        w(upload(Device::kCuda, pb.weights)),
        lens(Device::kCuda, size_t(pb.batch) * sizeof(int32_t)),
        workspace(Device::kCuda, dsa_indexer_workspace_bytes(pb.config, pb.batch, max_kv_len)),
        positions(Device::kCuda, size_t(pb.batch * pb.config.index_topk) * sizeof(int32_t)),
        counts(Device::kCuda, size_t(pb.batch) * sizeof(int32_t)) {
    args.dtype = pb.dtype;
    args.k_cache = k.data();
    args.capacity = pb.capacity;
    args.kv_lens = lens.as<int32_t>();
    args.max_kv_len = max_kv_len;
    args.q_index = q.data();
    args.weights = w.as<float>();
    args.workspace = workspace.data();
    args.workspace_bytes = workspace.bytes();
    args.positions = positions.as<int32_t>();
    args.counts = counts.as<int32_t>();
  }
  void set_lens(const std::vector<int32_t>& v, cudaStream_t stream) {
    testing::cuda_ok(cudaMemcpyAsync(lens.data(), v.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
                     "lens");
    testing::cuda_ok(cudaStreamSynchronize(stream), "lens sync");
    fill_bytes(positions.data(), Device::kCuda, 0x55, positions.bytes());
    fill_bytes(counts.data(), Device::kCuda, 0x55, counts.bytes());
  }
};

// The CPU rule at a shorter live length of the same cache.
Rows cpu_at(IndexerProblem pb, int64_t kv_len) {
  pb.kv_len = kv_len;
  return pb.cpu();
}

// The launch sequence is capturable: replay with new queries gives the new answer.
TEST(DsaIndexerCuda, ReplaysFromAGraph) {
  SKIP_WITHOUT_CUDA();
  IndexerProblem pb = make_exact_problem({8, 64, 96, 2, 700, DType::kBF16, false}, 91);
  DeviceIndexer dev(pb, pb.kv_len);
  testing::StreamGraph graph;
  cudaStream_t stream = graph.stream();
  dev.set_lens({700, 700}, stream);
  dsa_select_tokens_cuda(pb.config, 2, dev.args, stream);  // first use outside the capture
  graph.capture([&](cudaStream_t s) { dsa_select_tokens_cuda(pb.config, 2, dev.args, s); });
  std::mt19937_64 rng(92);
  std::uniform_int_distribution<int> small(-4, 4);
  for (float& x : pb.q_index) x = float(small(rng));
  const auto q_new = bytes_of(pb.dtype, pb.q_index);
  copy_bytes(dev.q.data(), Device::kCuda, q_new.data(), Device::kCpu, q_new.size());
  dev.set_lens({700, 700}, stream);
  graph.replay();
  expect_same_sets(IndexerProblem::read_back(dev.positions, dev.counts, 2, 96, 700), pb.cpu(), pb.kv_len,
                   "graph replay");
}

// The live lengths are read on the device: the same arguments launched twice
// with different device lengths (per sequence, one of them inside the top-k)
// give each length's answer.
TEST(DsaIndexerCuda, ReadsTheLengthsOnTheDevice) {
  SKIP_WITHOUT_CUDA();
  const IndexerProblem pb = make_exact_problem({16, 128, 256, 3, 6000, DType::kBF16, false}, 93);
  DeviceIndexer dev(pb, pb.kv_len);
  cudaStream_t stream;
  testing::cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const std::vector<std::vector<int32_t>> steps = {{6000, 4097, 200}, {3001, 6000, 256}, {257, 1, 5999}};
  for (const auto& lens : steps) {
    dev.set_lens(lens, stream);
    dsa_select_tokens_cuda(pb.config, 3, dev.args, stream);
    testing::cuda_ok(cudaStreamSynchronize(stream), "sync");
    const auto flat = download<int32_t>(Device::kCuda, dev.positions.data(), size_t(3 * 256));
    const auto counts = download<int32_t>(Device::kCuda, dev.counts.data(), 3);
    for (int32_t b = 0; b < 3; ++b) {
      const int64_t keep = std::min<int64_t>(256, lens[size_t(b)]);
      const std::string what = "sequence " + std::to_string(b) + " at length " + std::to_string(lens[size_t(b)]);
      EXPECT_EQ(counts[size_t(b)], keep) << what;
      const Rows got = {{flat.begin() + b * 256, flat.begin() + b * 256 + keep}};
      const Rows want = {cpu_at(pb, lens[size_t(b)])[size_t(b)]};
      expect_same_sets(got, want, lens[size_t(b)], what);
      for (int64_t i = keep; i < 256; ++i) EXPECT_EQ(flat[size_t(b * 256 + i)], -1) << what;
    }
  }
  cudaStreamDestroy(stream);
}

// A graph captured once (global capture mode: an allocation or a synchronize
// inside would fail it) replays at two device lengths with the right sets.
TEST(DsaIndexerCuda, OneGraphServesAGrowingContext) {
  SKIP_WITHOUT_CUDA();
  const IndexerProblem pb = make_exact_problem({64, 128, 512, 2, 9000, DType::kBF16, false}, 94);
  DeviceIndexer dev(pb, pb.kv_len);
  testing::StreamGraph graph;
  dev.set_lens({5000, 5000}, graph.stream());
  graph.capture([&](cudaStream_t s) { dsa_select_tokens_cuda(pb.config, 2, dev.args, s); });
  for (const std::vector<int32_t>& lens :
       {std::vector<int32_t>{5000, 5000}, std::vector<int32_t>{5001, 9000}, std::vector<int32_t>{8999, 300}}) {
    dev.set_lens(lens, graph.stream());
    graph.replay();
    const auto flat = download<int32_t>(Device::kCuda, dev.positions.data(), size_t(2 * 512));
    for (int32_t b = 0; b < 2; ++b) {
      const int64_t keep = std::min<int64_t>(512, lens[size_t(b)]);
      const Rows got = {{flat.begin() + b * 512, flat.begin() + b * 512 + keep}};
      expect_same_sets(got, {cpu_at(pb, lens[size_t(b)])[size_t(b)]}, lens[size_t(b)],
                       "replay at length " + std::to_string(lens[size_t(b)]));
    }
  }
}

TEST(DsaIndexerCuda, BadArgumentsAreNamed) {
  SKIP_WITHOUT_CUDA();
  const IndexerProblem pb = make_exact_problem({4, 64, 32, 1, 100, DType::kBF16, false}, 5);
  DeviceIndexer dev(pb, 100);
  dev.set_lens({100}, nullptr);
  const DsaIndexerArgs good = dev.args;
  EXPECT_NO_THROW(dsa_select_tokens_cuda(pb.config, 1, good));
  const auto expect_error = [&](DsaConfig config, DsaIndexerArgs a, const std::string& needle) {
    try {
      dsa_select_tokens_cuda(config, 1, a);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  DsaIndexerArgs a = good;
  a.k_cache = static_cast<const char*>(dev.k.data()) + 2;
  expect_error(pb.config, a, "aligned");
  a = good;
  a.max_kv_len = pb.capacity + 1;
  expect_error(pb.config, a, "max_kv_len <= capacity");
  a = good;
  a.workspace_bytes -= 1;
  expect_error(pb.config, a, "workspace");
  a = good;
  a.kv_lens = nullptr;
  expect_error(pb.config, a, "kv_lens");
  a = good;
  a.counts = nullptr;
  expect_error(pb.config, a, "counts");
  a = good;
  a.dtype = DType::kF32;
  expect_error(pb.config, a, "f16 or bf16");
  DsaConfig c = pb.config;
  c.index_head_dim = 36;
  expect_error(c, good, "index_head_dim = 36");
  c = pb.config;
  c.index_heads = 300;  // 300 * 64 query elements do not fit the staging
  expect_error(c, good, "index_heads * index_head_dim");
  testing::cuda_ok(cudaDeviceSynchronize(), "sync");
}

// ---- the layer --------------------------------------------------------------

const DsaConfig kGpuLayer{16, 512, 64, 4, 128, 64, 0.0f, 128};

// kGpuLayer, or under the sanitizers (testing::quick_mode()) the same layer
// at top-32 with `quick_capacity_step`: a shorter context then reaches the
// same regimes (sparse past twice the top-k, as the sparsity gate asks, or a
// window that fits the top-k while the indexer still scores a capacity past
// it) and the same cache growth.
DsaConfig gpu_layer(int64_t quick_capacity_step) {
  DsaConfig c = kGpuLayer;
  if (testing::quick_mode()) {
    c.index_topk = 32;
    c.capacity_step = quick_capacity_step;
  }
  return c;
}

// One token's inputs for a batch, host bytes; index inputs exact (see the top).
struct LayerTokens {
  std::vector<uint8_t> q, q_pe, q_index, k_row, k_pe;
  std::vector<float> weights;
  LayerTokens(const DsaConfig& c, int32_t batch, std::mt19937_64& rng) {
    const size_t b = size_t(batch);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::uniform_int_distribution<int> small(-4, 4), half_steps(-2, 4);
    q = testing::random_values(DType::kBF16, b * c.num_qo_heads * c.latent_dim, rng);
    q_pe = testing::random_values(DType::kBF16, b * c.num_qo_heads * c.rope_dim, rng);
    k_pe = testing::random_values(DType::kBF16, b * c.rope_dim, rng);
    std::vector<float> qi(b * c.index_heads * c.index_head_dim), row;
    for (float& x : qi) x = float(small(rng));
    q_index = bytes_of(DType::kBF16, qi);
    for (size_t s = 0; s < b; ++s) {
      for (int32_t d = 0; d < c.latent_dim; ++d) row.push_back(unit(rng));
      for (int32_t d = 0; d < c.index_head_dim; ++d) row.push_back(float(small(rng)));
    }
    k_row = bytes_of(DType::kBF16, row);
    for (size_t i = 0; i < b * c.index_heads; ++i) weights.push_back(0.5f * float(half_steps(rng)));
  }
};

// The same token on the device, with a NaN output.
struct DeviceTokens {
  Buffer q, q_pe, q_index, weights, k_row, k_pe, o;
  DeviceTokens(const LayerTokens& t, size_t o_elems)
      : q(upload(Device::kCuda, t.q)),
        q_pe(upload(Device::kCuda, t.q_pe)),
        q_index(upload(Device::kCuda, t.q_index)),
        weights(upload(Device::kCuda, t.weights)),
        k_row(upload(Device::kCuda, t.k_row)),
        k_pe(upload(Device::kCuda, t.k_pe)),
        o(upload(Device::kCuda, testing::nan_values(DType::kBF16, o_elems))) {}
  DsaTokens view() {
    return {q.data(), q_pe.data(), q_index.data(), weights.as<float>(), k_row.data(), k_pe.data(), o.data()};
  }
  std::vector<float> output() const {
    return testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  }
};

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::set<int32_t> as_set(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

// Feeds the same `context - 1` prefill tokens and then `steps` decode tokens
// to a fused and a kill-switched GPU layer and to the CPU layer, comparing
// every decode step (and the last prefill) on outputs and attended sets.
void check_layer_against_cpu(const DsaConfig& c, int32_t batch, int64_t context, int32_t steps, uint64_t seed) {
  const size_t o_elems = size_t(batch) * c.num_qo_heads * c.latent_dim;
  std::mt19937_64 rng(seed);
  DsaAttention fused(Device::kCuda, DType::kBF16, c, batch, testing::always_fuse());
  DsaAttention masked(Device::kCuda, DType::kBF16, c, batch, testing::kill_switch());
  DsaAttention cpu(Device::kCpu, DType::kBF16, c, batch, testing::always_fuse());
  for (int64_t t = 0; t + 1 < context; ++t) {
    const LayerTokens tok(c, batch, rng);
    DeviceTokens dev(tok, o_elems);
    std::vector<uint8_t> o_cpu = testing::nan_values(DType::kBF16, o_elems);
    const DsaTokens host{tok.q.data(),     tok.q_pe.data(), tok.q_index.data(), tok.weights.data(),
                         tok.k_row.data(), tok.k_pe.data(), o_cpu.data()};
    fused.prefill_token(dev.view());
    DeviceTokens dev_masked(tok, o_elems);
    masked.prefill_token(dev_masked.view());
    cpu.prefill_token(host);
    if (t + 2 == context) {
      const auto want = to_double(testing::as_float(DType::kBF16, o_cpu));
      EXPECT_LT(testing::relative_l2(dev.output(), want), 1e-2) << "prefill vs the CPU layer";
      EXPECT_LT(testing::relative_l2(dev_masked.output(), want), 1e-2) << "prefill vs the CPU layer";
    }
  }
  for (int32_t step = 0; step < steps; ++step) {
    const int64_t kv_len = context + step;
    SCOPED_TRACE("batch " + std::to_string(batch) + " kv_len " + std::to_string(kv_len));
    const LayerTokens tok(c, batch, rng);
    DeviceTokens a_dev(tok, o_elems), b_dev(tok, o_elems);
    std::vector<uint8_t> o_cpu = testing::nan_values(DType::kBF16, o_elems);
    const DsaTokens host{tok.q.data(),     tok.q_pe.data(), tok.q_index.data(), tok.weights.data(),
                         tok.k_row.data(), tok.k_pe.data(), o_cpu.data()};
    const LayerStep a = fused.decode(a_dev.view());
    const LayerStep b = masked.decode(b_dev.view());
    const LayerStep r = cpu.decode(host);
    const bool sparse = kv_len > c.index_topk;
    EXPECT_EQ(a.sparse, sparse);
    EXPECT_EQ(r.sparse, sparse);
    if (sparse) {
      EXPECT_TRUE(a.fused) << a.outcome.describe();
      EXPECT_TRUE(r.fused) << r.outcome.describe();
    } else {
      EXPECT_EQ(a.outcome.kind, OutcomeKind::kBelowSparsity) << "a full selection is dense work: the gate declines";
    }
    EXPECT_FALSE(b.fused);
    EXPECT_EQ(b.outcome.kind, OutcomeKind::kKillSwitch);

    const Rows positions = fused.last_selected_positions();
    const Rows cpu_positions = cpu.last_selected_positions();
    const Rows columns = fused.last_mask_columns();
    EXPECT_EQ(masked.last_selected_positions(), positions) << "same cache, same indexer";
    std::vector<double> ref;
    for (int32_t s = 0; s < batch; ++s) {
      ASSERT_EQ(positions[size_t(s)].size(), size_t(std::min<int64_t>(c.index_topk, kv_len)));
      EXPECT_EQ(as_set(positions[size_t(s)]), as_set(cpu_positions[size_t(s)])) << "sequence " << s;
      EXPECT_EQ(as_set(positions[size_t(s)]), as_set(columns[size_t(s)])) << "mask columns, sequence " << s;
      const auto part = testing::dsa_reference(cpu, c, tok.q, tok.q_pe, s, cpu_positions[size_t(s)]);
      ref.insert(ref.end(), part.begin(), part.end());
    }
    const auto o_fused = a_dev.output(), o_masked = b_dev.output();
    const auto o_host = to_double(testing::as_float(DType::kBF16, o_cpu));
    EXPECT_LT(testing::relative_l2(o_fused, ref), 1e-2) << "fused vs fp64";
    EXPECT_LT(testing::relative_l2(o_masked, ref), 1e-2) << "mask path vs fp64";
    EXPECT_LT(testing::relative_l2(o_fused, o_host), 1e-2) << "fused vs the CPU layer";
    EXPECT_LT(testing::relative_l2(o_masked, to_double(o_fused)), 1e-2) << "mask path vs fused";
  }
}

TEST(DsaCuda, SparseDecodeMatchesTheCpuLayerFusedAndMasked) {
  SKIP_WITHOUT_CUDA();
  // Full: 199 prefill tokens (the cache grows 128 -> 256), top-64 of 200..202.
  // Quick: 65 prefill tokens (it grows 32 -> 64 -> 96), top-32 of 66..68.
  const DsaConfig c = gpu_layer(32);
  const int64_t context = testing::quick_mode() ? 66 : 200;
  ASSERT_GE(context, 2 * c.index_topk) << "every decode step must be sparse and pass the 2x sparsity gate";
  ASSERT_GT(context - 1, c.capacity_step) << "the prefill must grow the cache";
  check_layer_against_cpu(c, 2, context, 3, 61);
}

TEST(DsaCuda, EveryTokenIsKeptWhileTheWindowFitsTheTopk) {
  SKIP_WITHOUT_CUDA();
  // The window (40, 41; quick: 20, 21) fits the top-k (64; quick: 32) while
  // the capacity (128; quick: 64) passes it, so the indexer still scores.
  const DsaConfig c = gpu_layer(64);
  const int64_t context = testing::quick_mode() ? 20 : 40;
  ASSERT_LT(context + 1, c.index_topk);
  ASSERT_GT(c.capacity_step, c.index_topk);
  check_layer_against_cpu(c, 1, context, 2, 62);
}

// docs/DESIGN.md: greedy equality on the GPU: the fused path and the mask path decode the same
// greedy tokens, and so does the CPU backend.
TEST(DsaCuda, GreedyDecodeMatchesTheMaskPathAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  const testing::DsaToyConfig config = testing::DsaToyConfig::cuda_shape();
  std::mt19937_64 rng(63);
  std::uniform_int_distribution<int32_t> token(0, config.vocab - 1);
  std::vector<int32_t> prompt(100);
  for (int32_t& t : prompt) t = token(rng);
  const int32_t steps = testing::quick_steps(32);
  testing::DsaToyModel fused(Device::kCuda, config, testing::always_fuse());
  testing::DsaToyModel masked(Device::kCuda, config, testing::kill_switch());
  testing::DsaToyModel cpu(Device::kCpu, config, testing::always_fuse());
  const auto a = fused.generate(prompt, steps);
  const auto b = masked.generate(prompt, steps);
  const auto c = cpu.generate(prompt, steps);
  EXPECT_EQ(fused.sparse_steps(), steps * config.layers);
  EXPECT_EQ(fused.fused_steps(), steps * config.layers);
  EXPECT_EQ(masked.fused_steps(), 0);
  // Same positions, bf16 rounding in another order: equal up to near-ties
  // of the top two logits (the GPU indexer's tensor-core scores can also
  // swap two tokens whose scores tie within fp32 rounding).
  testing::expect_same_greedy_tokens({a}, {b}, masked.margins(), "fused vs mask path on the GPU");
  testing::expect_same_greedy_tokens({a}, {c}, cpu.margins(), "GPU vs CPU");
}

}  // namespace
}  // namespace sparsepage
