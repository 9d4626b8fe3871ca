// Sparse prefill (sparsepage/prefill.h) on the CPU backend: MLA over
// per-token selections and GQA over key blocks against fp64 per token with
// every unattended cache row NaN, against the paged decode run one query
// token at a time over the same selections, and against the mask path
// (columns and outputs); the DSA, block and static selections against their
// rules written out here; bad inputs refused by name.
#include "sparsepage/prefill.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/mask_path.h"
#include "sparsepage/memory.h"
#include "sparsepage/models/static_block_sparse.h"
#include "sparsepage/sparse_decode.h"
#include "support/expect_error.h"
#include "support/prefill_problem.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::GqaPrefillSpec;
using testing::MlaPrefillSpec;

constexpr float kInf = std::numeric_limits<float>::infinity();

struct MlaOutputs {
  std::vector<uint16_t> out;
  std::vector<float> lse, max_logits;
  std::vector<float> out_f() const {
    std::vector<float> f(out.size());
    to_float(DType::kBF16, out.data(), f.data(), f.size());
    return f;
  }
};

MlaOutputs run_mla_cpu(const testing::MlaPrefillProblem& pb, bool max_logits = true) {
  MlaOutputs r;
  const size_t rows = static_cast<size_t>(pb.spec.batch) * pb.spec.num_tokens * pb.spec.num_heads;
  r.out.assign(rows * 512, 0xFFFF);  // NaN: every output must be written
  r.lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  r.max_logits.assign(rows, std::numeric_limits<float>::quiet_NaN());
  MlaSparsePrefill prefill(Device::kCpu);
  prefill.run(pb.host_params(r.out.data(), r.lse.data(), max_logits ? r.max_logits.data() : nullptr));
  EXPECT_STREQ(prefill.kernel_name(), "cpu");
  return r;
}

std::vector<MlaPrefillSpec> mla_specs() {
  std::vector<MlaPrefillSpec> specs;
  MlaPrefillSpec a;  // one sequence, early tokens whose windows are shorter than topk
  a.num_tokens = 24;
  a.starts = {10};
  specs.push_back(a);
  MlaPrefillSpec b;  // two sequences of different lengths, 128 heads, per-token counts, duplicates, a sink
  b.batch = 2;
  b.num_tokens = 9;
  b.num_heads = 128;
  b.topk = 40;
  b.starts = {3, 90};
  b.topk_length = true;
  b.duplicates = true;
  b.sink = true;
  b.empty_tokens = 2;
  b.seed = 7;
  specs.push_back(b);
  MlaPrefillSpec c = a;  // FP8 rows
  c.fp8 = true;
  c.sink = true;
  c.seed = 11;
  specs.push_back(c);
  return specs;
}

TEST(MlaPrefillCpu, MatchesFp64PerTokenWithUnattendedRowsNaN) {
  for (const MlaPrefillSpec& spec : mla_specs()) {
    const auto pb = testing::make_mla_prefill_problem(spec);
    const MlaOutputs got = run_mla_cpu(pb);
    const auto ref = testing::mla_prefill_reference(pb);
    const std::string diff =
        testing::compare_mla_prefill(pb, ref, got.out_f(), got.lse, &got.max_logits, 1e-2, 1e-4, 1e-4);
    EXPECT_EQ(diff, "") << "spec seed " << spec.seed;
  }
}

TEST(MlaPrefillCpu, EmptyRowsFollowFlashMlaConventions) {
  MlaPrefillSpec spec = mla_specs()[1];
  const auto pb = testing::make_mla_prefill_problem(spec);
  const MlaOutputs got = run_mla_cpu(pb);
  const int32_t heads = spec.num_heads;
  // Tokens 0 and 1 of sequence 0 select nothing: out 0, lse +inf, max_logits -inf, whatever the sink.
  for (int32_t t = 0; t < 2; ++t) {
    for (int32_t h = 0; h < heads; ++h) {
      const size_t r = static_cast<size_t>(t) * heads + static_cast<size_t>(h);
      EXPECT_EQ(got.lse[r], kInf);
      EXPECT_EQ(got.max_logits[r], -kInf);
      for (int i = 0; i < 512; ++i) ASSERT_EQ(got.out[r * 512 + static_cast<size_t>(i)], 0) << "token " << t;
    }
  }
  // Head 1's sink is +inf: its outputs are 0 everywhere, its lse untouched (finite where something was attended).
  size_t finite = 0;
  for (size_t row = 2; row < got.lse.size() / heads; ++row) {
    const size_t r = row * heads + 1;
    for (int i = 0; i < 512; ++i) ASSERT_EQ(got.out[r * 512 + static_cast<size_t>(i)] & 0x7FFF, 0) << "row " << row;
    finite += std::isfinite(got.lse[r]);
  }
  EXPECT_GT(finite, 0u);
}

TEST(MlaPrefillCpu, EqualsTheDecodeRunOneTokenAtATime) {
  for (const MlaPrefillSpec& spec : mla_specs()) {
    MlaPrefillSpec no_sink = spec;
    no_sink.sink = false;  // the decode has no sink
    const auto plain = testing::make_mla_prefill_problem(no_sink);
    const MlaOutputs got = run_mla_cpu(plain, false);
    std::vector<float> oracle_out, oracle_lse;
    testing::mla_token_by_token_cpu(plain, oracle_out, oracle_lse);
    const std::vector<float> out = got.out_f();
    ASSERT_EQ(out.size(), oracle_out.size());
    const size_t rows = oracle_lse.size();
    for (size_t r = 0; r < rows; ++r) {
      const float want_lse = oracle_lse[r] == -kInf ? kInf : oracle_lse[r];  // the decode's empty lse is -inf
      if (std::isinf(want_lse)) {
        EXPECT_EQ(got.lse[r], want_lse) << "row " << r;
        continue;
      }
      ASSERT_NEAR(got.lse[r], want_lse, 1e-5f * std::max(1.0f, std::fabs(want_lse))) << "row " << r;
      std::vector<double> want(oracle_out.begin() + static_cast<std::ptrdiff_t>(r * 512),
                               oracle_out.begin() + static_cast<std::ptrdiff_t>((r + 1) * 512));
      const std::vector<float> row(out.begin() + static_cast<std::ptrdiff_t>(r * 512),
                                   out.begin() + static_cast<std::ptrdiff_t>((r + 1) * 512));
      ASSERT_LT(testing::relative_l2(row, want), 5e-3) << "row " << r;
    }
  }
}

// Each token's valid entries as the mask path's selection: its columns are
// what the prefill attends, and the dense masked decode over them gives the
// prefill's outputs.
TEST(MlaPrefillCpu, AttendsTheMaskPathsColumns) {
  MlaPrefillSpec spec = mla_specs()[0];
  spec.pad_fraction = 0.3;
  const auto pb = testing::make_mla_prefill_problem(spec);
  const MlaOutputs got = run_mla_cpu(pb, false);
  const MlaPrefillParams p = pb.host_params(nullptr, nullptr, nullptr);
  const auto attended = testing::mla_prefill_attended(p);
  const int32_t n = spec.num_tokens, heads = spec.num_heads;
  const int64_t live = pb.kv_len;
  std::vector<int32_t> offsets = {0}, positions;
  for (int32_t t = 0; t < n; ++t) {
    positions.insert(positions.end(), pb.indices.begin() + int64_t{t} * spec.topk,
                     pb.indices.begin() + int64_t{t + 1} * spec.topk);  // -1 entries are ignored by the builder
    offsets.push_back(static_cast<int32_t>(positions.size()));
  }
  std::vector<float> mask(static_cast<size_t>(n) * live);
  build_selection_mask(Device::kCpu, positions.data(), offsets.data(), n, live, mask.data());
  const auto columns = mask_kept_columns(Device::kCpu, mask.data(), n, live);
  ASSERT_EQ(columns.size(), attended.size());
  for (int32_t t = 0; t < n; ++t)
    EXPECT_EQ(columns[static_cast<size_t>(t)], attended[static_cast<size_t>(t)]) << "token " << t;

  // The masked decode: each token a sequence of the window's rows, its live length pos + 1.
  std::vector<uint16_t> q(static_cast<size_t>(n) * heads * 512), qr(static_cast<size_t>(n) * heads * 64);
  const auto* q576 = reinterpret_cast<const uint16_t*>(pb.q.data());
  for (size_t r = 0; r < static_cast<size_t>(n) * heads; ++r) {
    std::copy(q576 + r * 576, q576 + r * 576 + 512, q.begin() + static_cast<std::ptrdiff_t>(r * 512));
    std::copy(q576 + r * 576 + 512, q576 + r * 576 + 576, qr.begin() + static_cast<std::ptrdiff_t>(r * 64));
  }
  std::vector<int32_t> lens(static_cast<size_t>(n));
  for (int32_t t = 0; t < n; ++t) lens[static_cast<size_t>(t)] = static_cast<int32_t>(pb.kv_lens[0] - n + t + 1);
  std::vector<uint16_t> o(static_cast<size_t>(n) * heads * 512);
  MaskedDecodeParams m;
  m.dtype = DType::kBF16;
  m.batch = n;
  m.num_kv_heads = 1;
  m.group_size = heads;
  m.live_len = live;
  m.live_lens = lens.data();
  m.q = q.data();
  m.k = {pb.kv.data(), 576, 512, 0, 0, pb.capacity};
  m.v = m.k;
  m.q_extra = qr.data();
  m.k_extra = {reinterpret_cast<const uint16_t*>(pb.kv.data()) + 512, 576, 64, 0, 0, pb.capacity};
  m.mask = mask.data();
  m.mask_pitch = live;
  m.scale = pb.scale;
  m.o = o.data();
  run_masked_decode_cpu(m);
  std::vector<float> of(o.size());
  to_float(DType::kBF16, o.data(), of.data(), of.size());
  const std::vector<float> out = got.out_f();
  for (size_t r = 0; r < static_cast<size_t>(n) * heads; ++r) {
    const std::vector<float> row(out.begin() + static_cast<std::ptrdiff_t>(r * 512),
                                 out.begin() + static_cast<std::ptrdiff_t>((r + 1) * 512));
    const std::vector<double> want(of.begin() + static_cast<std::ptrdiff_t>(r * 512),
                                   of.begin() + static_cast<std::ptrdiff_t>((r + 1) * 512));
    if (attended[r / static_cast<size_t>(heads)].empty()) continue;
    ASSERT_LT(testing::relative_l2(row, want), 5e-3) << "row " << r;
  }
}

TEST(MlaPrefillCpu, RefusesBadInputByName) {
  MlaPrefillSpec spec = mla_specs()[0];
  spec.topk_length = true;
  auto pb = testing::make_mla_prefill_problem(spec);
  std::vector<uint16_t> out(static_cast<size_t>(spec.num_tokens) * spec.num_heads * 512);
  std::vector<float> lse(static_cast<size_t>(spec.num_tokens) * spec.num_heads);
  MlaSparsePrefill prefill(Device::kCpu);
  const auto run = [&](const MlaPrefillParams& p) { return [&prefill, p] { prefill.run(p); }; };
  // A later position than the token's own: token 0 sits at position start.
  auto future = pb;
  future.indices[0] = spec.starts[0] + 1;
  future.topk_length[0] = spec.topk;
  EXPECT_TRUE(testing::throws_error_naming(
      run(future.host_params(out.data(), lse.data(), nullptr)),
      "names positions outside request 0's window of " + std::to_string(spec.starts[0] + 1)));
  auto negative = pb;
  negative.indices[1] = -2;
  negative.topk_length[0] = spec.topk;
  EXPECT_TRUE(
      testing::throws_error_naming(run(negative.host_params(out.data(), lse.data(), nullptr)), "indices[1] = -2"));
  auto long_count = pb;
  long_count.topk_length[3] = spec.topk + 1;
  EXPECT_TRUE(testing::throws_error_naming(run(long_count.host_params(out.data(), lse.data(), nullptr)),
                                           "seq_lens[3] = " + std::to_string(spec.topk + 1)));
  MlaPrefillParams short_chunk = pb.host_params(out.data(), lse.data(), nullptr);
  short_chunk.chunk.kv_len = spec.num_tokens - 1;
  short_chunk.chunk.kv_lens = nullptr;
  EXPECT_TRUE(testing::throws_error_naming(run(short_chunk), "chunk.kv_len = " + std::to_string(spec.num_tokens - 1)));
  MlaPrefillParams bad_len = pb.host_params(out.data(), lse.data(), nullptr);
  std::vector<int32_t> lens = {static_cast<int32_t>(pb.kv_len + 1)};
  bad_len.chunk.kv_lens = lens.data();
  EXPECT_TRUE(testing::throws_error_naming(run(bad_len), "chunk.kv_lens[0]"));
  MlaPrefillParams dims = pb.host_params(out.data(), lse.data(), nullptr);
  dims.kv.dim = 448;
  EXPECT_TRUE(testing::throws_error_naming(run(dims), "kv.dim = 448"));
  MlaPrefillParams no_index = pb.host_params(out.data(), lse.data(), nullptr);
  no_index.indices = nullptr;
  EXPECT_TRUE(testing::throws_error_naming(run(no_index), "q, q_rope, indices and out must be set"));
}

// ---- the DSA prefill indexer ----------------------------------------------------

/// The rule written out: per token, scores over positions 0 .. pos in fp64
/// (exact for the small integers used), the top k by (score, lower position).
std::vector<std::vector<int32_t>> dsa_rule(int32_t n, int64_t start, int32_t heads, int32_t dim, int32_t topk,
                                           int32_t key_column, const std::vector<float>& keys,
                                           const std::vector<float>& q, const std::vector<float>& w) {
  std::vector<std::vector<int32_t>> out;
  const int32_t row = key_column + dim;
  for (int32_t t = 0; t < n; ++t) {
    const int64_t window = start + t + 1;
    std::vector<std::pair<double, int32_t>> scored;
    for (int64_t p = 0; p < window; ++p) {
      double total = 0.0;
      for (int32_t j = 0; j < heads; ++j) {
        double dot = 0.0;
        for (int32_t i = 0; i < dim; ++i) {
          dot += double{q[(static_cast<size_t>(t) * heads + j) * dim + i]} *
                 keys[static_cast<size_t>(p) * row + key_column + i];
        }
        total += w[static_cast<size_t>(t) * heads + j] * std::max(dot, 0.0);
      }
      scored.emplace_back(-total, static_cast<int32_t>(p));
    }
    std::sort(scored.begin(), scored.end());
    std::vector<int32_t> kept;
    for (int64_t i = 0; i < std::min<int64_t>(topk, window); ++i) kept.push_back(scored[static_cast<size_t>(i)].second);
    std::sort(kept.begin(), kept.end());
    out.push_back(kept);
  }
  return out;
}

TEST(DsaPrefillIndexerCpu, KeepsEachTokensTopKOverItsOwnWindow) {
  std::mt19937_64 rng(5);
  const int32_t n = 20, heads = 4, dim = 16, topk = 12, key_column = 8;
  const int64_t start = 30, capacity = start + n + 3;
  const auto keys = testing::integer_values(DType::kBF16, static_cast<size_t>(capacity) * (key_column + dim), rng, 2);
  const auto q = testing::integer_values(DType::kBF16, static_cast<size_t>(n) * heads * dim, rng, 2);
  std::vector<float> w(static_cast<size_t>(n) * heads);
  for (float& x : w) x = static_cast<float>(std::uniform_int_distribution<int>(0, 3)(rng));
  std::vector<int32_t> positions(static_cast<size_t>(n) * topk, 12345), counts(static_cast<size_t>(n), -7);
  DsaPrefillIndexerParams p;
  p.dtype = DType::kBF16;
  p.chunk = {1, n, start + n, nullptr};
  p.index_heads = heads;
  p.index_head_dim = dim;
  p.topk = topk;
  p.k_cache = keys.data();
  p.key_column = key_column;
  p.capacity = capacity;
  p.q_index = q.data();
  p.weights = w.data();
  p.positions = positions.data();
  p.counts = counts.data();
  DsaPrefillIndexer indexer(Device::kCpu);
  indexer.run(p);
  const auto want = dsa_rule(n, start, heads, dim, topk, key_column, testing::as_float(DType::kBF16, keys),
                             testing::as_float(DType::kBF16, q), w);
  for (int32_t t = 0; t < n; ++t) {
    const int32_t* row = &positions[static_cast<size_t>(t) * topk];
    EXPECT_EQ(counts[static_cast<size_t>(t)], topk);
    const std::vector<int32_t> got(row, row + counts[static_cast<size_t>(t)]);
    EXPECT_EQ(got, want[static_cast<size_t>(t)]) << "token " << t;
  }
  // A chunk at the start of a prompt: every window fits the top-k until position topk.
  p.chunk = {1, n, n, nullptr};
  indexer.run(p);
  for (int32_t t = 0; t < n; ++t) {
    const int32_t* row = &positions[static_cast<size_t>(t) * topk];
    const int32_t expect = std::min(t + 1, topk);
    EXPECT_EQ(counts[static_cast<size_t>(t)], expect);
    for (int32_t i = 0; i < topk; ++i) {
      if (t + 1 <= topk) {
        EXPECT_EQ(row[i], i < t + 1 ? i : -1) << "token " << t;
      }
    }
    EXPECT_TRUE(std::is_sorted(row, row + expect));
  }
}

// ---- the block indexer -------------------------------------------------------------

TEST(BlockPrefillIndexerCpu, KeepsTheMaxPooledTopBlocksOfEachQueryBlock) {
  std::mt19937_64 rng(9);
  const int32_t n = 40, heads = 2, dim = 16, bs = 8, top = 3, local = 2;
  for (int32_t start : {0, 48}) {
    const int64_t kv_len = start + n, capacity = kv_len;
    const auto keys = testing::integer_values(DType::kBF16, static_cast<size_t>(capacity) * dim, rng, 1);  // many ties
    const auto q = testing::integer_values(DType::kBF16, static_cast<size_t>(n) * heads * dim, rng, 1);
    const int32_t nqb = (n + bs - 1) / bs;
    std::vector<int32_t> ids(static_cast<size_t>(nqb) * heads * (top + 1), 777),
        counts(static_cast<size_t>(nqb) * heads);
    BlockPrefillIndexerParams p;
    p.dtype = DType::kBF16;
    p.chunk = {1, n, kv_len, nullptr};
    p.num_kv_heads = heads;
    p.head_dim = dim;
    p.block_size = bs;
    p.top_blocks = top;
    p.local_blocks = local;
    p.index_keys = {keys.data(), dim, dim, 0, 0, capacity};
    p.q_index = q.data();
    p.block_ids = ids.data();
    p.counts = counts.data();
    BlockPrefillIndexer indexer(Device::kCpu);
    indexer.run(p);
    const auto kf = testing::as_float(DType::kBF16, keys), qf = testing::as_float(DType::kBF16, q);
    for (int32_t i = 0; i < nqb; ++i) {
      const int32_t own = start / bs + i;
      for (int32_t h = 0; h < heads; ++h) {
        std::vector<std::pair<double, int32_t>> scored;  // (-score, block)
        for (int32_t j = 0; j < own; ++j) {
          double best = -1e300;
          for (int32_t t = i * bs; t < std::min(n, (i + 1) * bs); ++t) {
            for (int32_t pos = j * bs; pos < (j + 1) * bs; ++pos) {
              double dot = 0.0;
              for (int32_t e = 0; e < dim; ++e)
                dot +=
                    double{qf[(static_cast<size_t>(t) * heads + h) * dim + e]} * kf[static_cast<size_t>(pos) * dim + e];
              best = std::max(best, dot);
            }
          }
          scored.emplace_back(j >= own + 1 - local ? -1e301 : -best, j);
        }
        std::sort(scored.begin(), scored.end());
        std::vector<int32_t> want;
        for (int32_t e = 0; e < std::min(top, own); ++e) want.push_back(scored[static_cast<size_t>(e)].second);
        std::sort(want.begin(), want.end());
        want.push_back(own);
        const int32_t* row = &ids[(static_cast<size_t>(i) * heads + h) * (top + 1)];
        const std::vector<int32_t> got(row, row + want.size());
        EXPECT_EQ(got, want) << "start " << start << " query block " << i << " head " << h;
        for (int32_t e = static_cast<int32_t>(want.size()); e < top + 1; ++e) EXPECT_EQ(row[e], -1);
        const int32_t diag = std::min(n, (i + 1) * bs) - i * bs;
        EXPECT_EQ(counts[static_cast<size_t>(i) * heads + h], (static_cast<int32_t>(want.size()) - 1) * bs + diag);
      }
    }
  }
}

// ---- the static pattern --------------------------------------------------------------

TEST(StaticPrefillCpu, ListsFollowTheRule) {
  StaticBlockSparseConfig config;  // the rule's own statement (models/static_block_sparse.h)
  config.num_qo_heads = 8;
  config.num_kv_heads = 2;
  config.block_size = 4;
  config.local_blocks = 3;
  config.vert_stride = 5;
  const int32_t n = 30, start = 12, batch = 2;
  StaticPrefillParams p;
  p.chunk = {batch, n, start + 8 + n, nullptr};
  std::vector<int32_t> lens = {start + n, start + 8 + n};
  p.chunk.kv_lens = lens.data();
  p.num_qo_heads = config.num_qo_heads;
  p.num_kv_heads = config.num_kv_heads;
  p.block_size = config.block_size;
  p.local_blocks = config.local_blocks;
  p.vert_stride = config.vert_stride;
  p.width = static_prefill_width(p, p.chunk.kv_len);
  const int32_t nqb = (n + 3) / 4, g = 4;
  std::vector<int32_t> ids(static_cast<size_t>(batch) * 2 * nqb * g * p.width),
      counts(static_cast<size_t>(batch) * 2 * nqb * g);
  p.block_ids = ids.data();
  p.counts = counts.data();
  static_prefill_blocks(Device::kCpu, p);
  for (int32_t b = 0; b < batch; ++b) {
    const int32_t s = lens[static_cast<size_t>(b)] - n;
    for (int32_t kv = 0; kv < 2; ++kv) {
      for (int32_t i = 0; i < nqb; ++i) {
        for (int32_t gg = 0; gg < g; ++gg) {
          const int32_t h = kv * g + gg, own = s / 4 + i;
          std::vector<int32_t> want;
          for (int32_t j = 0; j <= own; ++j) {
            if (config.keeps(h, own, j)) want.push_back(j);
          }
          const size_t list = ((static_cast<size_t>(b) * 2 + kv) * nqb + i) * g + gg;
          ASSERT_LE(static_cast<int32_t>(want.size()), p.width);
          const std::vector<int32_t> got(&ids[list * p.width], &ids[list * p.width] + want.size());
          EXPECT_EQ(got, want) << "b " << b << " head " << h << " query block " << i;
          const int32_t end = s + std::min(n, (i + 1) * 4);
          EXPECT_EQ(counts[list], (static_cast<int32_t>(want.size()) - 1) * 4 + (end - own * 4));
        }
      }
    }
  }
}

// ---- GQA over blocks ------------------------------------------------------------------

std::vector<GqaPrefillSpec> gqa_specs() {
  std::vector<GqaPrefillSpec> specs;
  GqaPrefillSpec a;  // a partial last query block
  specs.push_back(a);
  GqaPrefillSpec b;  // two sequences, f16, block-aligned ends
  b.dtype = DType::kF16;
  b.batch = 2;
  b.num_tokens = 32;
  b.starts = {0, 48};
  b.num_qo_heads = 4;
  b.num_kv_heads = 1;
  b.head_dim = 32;
  b.block_size = 8;
  b.width = 3;
  b.seed = 3;
  specs.push_back(b);
  GqaPrefillSpec c = a;  // per-query-head lists (a static pattern's layout)
  c.layout = BlockSelectionLayout::kPerQueryHead;
  c.seed = 5;
  specs.push_back(c);
  GqaPrefillSpec d = b;
  d.layout = BlockSelectionLayout::kPerQueryHead;
  d.num_kv_heads = 2;
  d.num_tokens = 29;
  d.seed = 6;
  specs.push_back(d);
  return specs;
}

struct GqaOutputs {
  std::vector<uint8_t> out;
  std::vector<float> lse;
};

GqaOutputs run_gqa_cpu(const testing::GqaPrefillProblem& pb) {
  GqaOutputs r;
  const size_t rows = static_cast<size_t>(pb.spec.batch) * pb.spec.num_tokens * pb.spec.num_qo_heads;
  r.out = testing::nan_values(pb.spec.dtype, rows * pb.spec.head_dim);
  r.lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  GqaBlockPrefill prefill(Device::kCpu);
  prefill.run(pb.host_params(r.out.data(), r.lse.data()));
  return r;
}

TEST(GqaBlockPrefillCpu, MatchesFp64PerTokenWithUnattendedRowsNaN) {
  for (const GqaPrefillSpec& spec : gqa_specs()) {
    const auto pb = testing::make_gqa_prefill_problem(spec);
    const GqaOutputs got = run_gqa_cpu(pb);
    const auto ref = testing::gqa_prefill_reference(pb);
    EXPECT_EQ(testing::compare_gqa_prefill(pb, ref, testing::as_float(spec.dtype, got.out), got.lse, 1e-2, 1e-4), "")
        << "seed " << spec.seed;
  }
}

TEST(GqaBlockPrefillCpu, EqualsTheDecodeRunOneTokenAtATime) {
  for (const GqaPrefillSpec& spec : gqa_specs()) {
    const auto pb = testing::make_gqa_prefill_problem(spec);
    const GqaOutputs got = run_gqa_cpu(pb);
    std::vector<float> out, lse;
    testing::gqa_token_by_token_cpu(pb, out, lse);
    const std::vector<float> mine = testing::as_float(spec.dtype, got.out);
    const size_t d = static_cast<size_t>(spec.head_dim);
    for (size_t r = 0; r < lse.size(); ++r) {
      ASSERT_NEAR(got.lse[r], lse[r], 1e-5f * std::max(1.0f, std::fabs(lse[r]))) << "row " << r;
      const std::vector<float> row(mine.begin() + static_cast<std::ptrdiff_t>(r * d),
                                   mine.begin() + static_cast<std::ptrdiff_t>((r + 1) * d));
      const std::vector<double> want(out.begin() + static_cast<std::ptrdiff_t>(r * d),
                                     out.begin() + static_cast<std::ptrdiff_t>((r + 1) * d));
      ASSERT_LT(testing::relative_l2(row, want), 5e-3) << "seed " << spec.seed << " row " << r;
    }
  }
}

// A token attends exactly the columns the mask path keeps for it (the
// positions of its list's blocks up to its own), and removing the causal
// limit would change the earlier tokens of every query block.
TEST(GqaBlockPrefillCpu, AttendsTheMaskPathsColumns) {
  for (const GqaPrefillSpec& spec : gqa_specs()) {
    const auto pb = testing::make_gqa_prefill_problem(spec);
    const GqaPrefillParams p = pb.host_params(nullptr, nullptr);
    const auto attended = gqa_prefill_attended(p);
    const int32_t n = spec.num_tokens, hq = spec.num_qo_heads, bs = spec.block_size;
    // The mask path's selection of row (token, head): its list's blocks expanded, cut at the count.
    std::vector<int32_t> offsets = {0}, positions;
    std::vector<int32_t> lens;
    for (size_t r = 0; r < attended.size(); ++r) {
      const int64_t t = static_cast<int64_t>(r / static_cast<size_t>(hq)) % n;
      const int64_t b = static_cast<int64_t>(r) / (int64_t{hq} * n);
      const int32_t h = static_cast<int32_t>(r % static_cast<size_t>(hq)), kv = h / (hq / spec.num_kv_heads);
      const int32_t i = static_cast<int32_t>(t / bs), g = hq / spec.num_kv_heads;
      const int32_t nqb = pb.query_blocks();
      const int64_t list = spec.layout == BlockSelectionLayout::kPerKvHead
                               ? (b * nqb + i) * spec.num_kv_heads + kv
                               : ((b * spec.num_kv_heads + kv) * nqb + i) * g + h % g;
      const int32_t* ids = &pb.block_ids[static_cast<size_t>(list) * spec.width];
      for (int32_t e = 0; e < pb.counts[static_cast<size_t>(list)]; ++e) positions.push_back(ids[e / bs] * bs + e % bs);
      offsets.push_back(static_cast<int32_t>(positions.size()));
      lens.push_back(static_cast<int32_t>(pb.kv_lens[static_cast<size_t>(b)] - n + t + 1));
    }
    // The builder drops positions outside [0, live_len): one request at a time with its own window.
    for (size_t r = 0; r < attended.size(); ++r) {
      const int64_t live = lens[r];
      std::vector<float> mask(static_cast<size_t>(live));
      const std::vector<int32_t> off = {0, offsets[r + 1] - offsets[r]};
      build_selection_mask(Device::kCpu, positions.data() + offsets[r], off.data(), 1, live, mask.data());
      const auto columns = mask_kept_columns(Device::kCpu, mask.data(), 1, live);
      ASSERT_EQ(columns[0], attended[r]) << "seed " << spec.seed << " row " << r;
    }
  }
}

// fp64 attention of query row `row` (token t, head h of sequence 0) over `positions`.
std::vector<double> attend_fp64(const testing::GqaPrefillProblem& pb, size_t row,
                                const std::vector<int32_t>& positions) {
  const int32_t d = pb.spec.head_dim, g = pb.spec.num_qo_heads / pb.spec.num_kv_heads;
  const int32_t h = static_cast<int32_t>(row % static_cast<size_t>(pb.spec.num_qo_heads));
  const std::vector<float> q = testing::as_float(pb.spec.dtype, pb.q), k = testing::as_float(pb.spec.dtype, pb.k),
                           v = testing::as_float(pb.spec.dtype, pb.v);
  const int64_t base = int64_t{h / g} * pb.capacity;
  std::vector<double> s, out(static_cast<size_t>(d), 0.0);
  for (int32_t p : positions) {
    double dot = 0.0;
    for (int32_t i = 0; i < d; ++i)
      dot += double{q[row * d + static_cast<size_t>(i)]} * k[static_cast<size_t>((base + p) * d + i)];
    s.push_back(dot * pb.scale);
  }
  testing::softmax_weighted_sum(
      s, d, [&](size_t j, int64_t i) { return double{v[static_cast<size_t>((base + positions[j]) * d + i)]}; },
      out.data());
  return out;
}

// The causal limit inside the own block: each token sees its own block only
// up to its position (the attended set says so), and the kernel applies it:
// the output of a block's first token matches fp64 over its cut set and not
// over the whole block's.
TEST(GqaBlockPrefillCpu, TheCausalLimitCutsTheOwnBlock) {
  GqaPrefillSpec spec = gqa_specs()[0];
  const auto pb = testing::make_gqa_prefill_problem(spec);
  const auto attended = gqa_prefill_attended(pb.host_params(nullptr, nullptr));
  const GqaOutputs got = run_gqa_cpu(pb);
  const std::vector<float> out = testing::as_float(spec.dtype, got.out);
  const int32_t hq = spec.num_qo_heads, bs = spec.block_size, d = spec.head_dim;
  int checked = 0;
  for (int32_t t = 0; t < spec.num_tokens; ++t) {
    const int64_t pos = spec.starts[0] + t;
    const size_t r = static_cast<size_t>(t) * hq;
    const auto& row = attended[r];
    ASSERT_FALSE(row.empty());
    EXPECT_EQ(row.back(), pos) << "token " << t;
    const int64_t own_first = pos / bs * bs;
    EXPECT_EQ(std::count_if(row.begin(), row.end(), [&](int32_t x) { return x >= own_first; }), pos - own_first + 1);
    if (t % bs != 0 || t + 1 >= spec.num_tokens) continue;
    // The block's last token's set (the whole own block) against this first token's.
    const int32_t last = std::min(spec.num_tokens - 1, (t / bs + 1) * bs - 1);
    const std::vector<float> mine(out.begin() + static_cast<std::ptrdiff_t>(r * d),
                                  out.begin() + static_cast<std::ptrdiff_t>((r + 1) * d));
    EXPECT_LT(testing::relative_l2(mine, attend_fp64(pb, r, row)), 1e-2) << "token " << t;
    EXPECT_GT(testing::relative_l2(mine, attend_fp64(pb, r, attended[static_cast<size_t>(last) * hq])), 5e-2)
        << "token " << t;
    ++checked;
  }
  EXPECT_GT(checked, 1);
}

TEST(GqaBlockPrefillCpu, RefusesBadInputByName) {
  const auto pb = testing::make_gqa_prefill_problem(gqa_specs()[0]);
  GqaOutputs r;
  r.out.assign(pb.q.size(), 0);
  r.lse.assign(pb.q.size(), 0.0f);
  GqaBlockPrefill prefill(Device::kCpu);
  const auto run = [&](const GqaPrefillParams& p) { return [&prefill, p] { prefill.run(p); }; };
  GqaPrefillParams misaligned = pb.host_params(r.out.data(), r.lse.data());
  std::vector<int32_t> lens = {static_cast<int32_t>(pb.kv_len - 3)};
  misaligned.chunk.kv_lens = lens.data();
  EXPECT_TRUE(testing::throws_error_naming(run(misaligned), "not a multiple of block_size"));
  auto future = pb;
  future.block_ids[0] =
      (future.spec.starts[0] + future.spec.num_tokens) / future.spec.block_size + 1;  // past the chunk
  EXPECT_TRUE(testing::throws_error_naming(run(future.host_params(r.out.data(), r.lse.data())),
                                           "names positions outside request 0's window"));
  GqaPrefillParams heads = pb.host_params(r.out.data(), r.lse.data());
  heads.num_qo_heads = 7;
  EXPECT_TRUE(testing::throws_error_naming(run(heads), "num_qo_heads = 7 must be a positive multiple"));
  GqaPrefillParams big = pb.host_params(r.out.data(), r.lse.data());
  big.block_size = 512;
  EXPECT_TRUE(testing::throws_error_naming(run(big), "block_size = 512 must lie in [1, 256]"));
}

// The block indexer's lists feed the attention: fp64 over what they keep.
TEST(BlockPrefillCpu, IndexerThenAttention) {
  GqaPrefillSpec spec;
  spec.num_tokens = 48;
  spec.starts = {64};
  spec.block_size = 16;
  spec.width = 3;
  auto pb = testing::make_gqa_prefill_problem(spec);
  std::mt19937_64 rng(13);
  const int32_t hkv = spec.num_kv_heads, d = spec.head_dim;
  const auto keys = testing::random_values(DType::kBF16, static_cast<size_t>(pb.capacity) * d, rng);
  const auto q_index = testing::random_values(DType::kBF16, static_cast<size_t>(spec.num_tokens) * hkv * d, rng);
  BlockPrefillIndexerParams ip;
  ip.chunk = {1, spec.num_tokens, pb.kv_len, nullptr};
  ip.num_kv_heads = hkv;
  ip.head_dim = d;
  ip.block_size = spec.block_size;
  ip.top_blocks = spec.width - 1;
  ip.local_blocks = 1;
  ip.index_keys = {keys.data(), d, d, 0, 0, pb.capacity};
  ip.q_index = q_index.data();
  ip.block_ids = pb.block_ids.data();  // the problem's lists replaced by the indexer's
  ip.counts = pb.counts.data();
  BlockPrefillIndexer indexer(Device::kCpu);
  indexer.run(ip);
  // The problem's K/V were poisoned for its random lists: refill them, and
  // poison every row the indexer's lists leave out.
  pb.k = testing::random_values(DType::kBF16, pb.k.size() / 2, rng);
  pb.v = testing::random_values(DType::kBF16, pb.v.size() / 2, rng);
  const auto attended = gqa_prefill_attended(pb.host_params(nullptr, nullptr));
  std::vector<char> used(static_cast<size_t>(hkv * pb.capacity), 0);
  const int32_t g = spec.num_qo_heads / hkv;
  for (size_t r = 0; r < attended.size(); ++r) {
    for (int32_t pos : attended[r])
      used[static_cast<size_t>((r % static_cast<size_t>(spec.num_qo_heads)) / static_cast<size_t>(g)) * pb.capacity +
           static_cast<size_t>(pos)] = 1;
  }
  const auto nan_row = testing::nan_values(DType::kBF16, static_cast<size_t>(d));
  for (size_t row = 0; row < used.size(); ++row) {
    if (used[row]) continue;
    std::copy(nan_row.begin(), nan_row.end(), pb.k.begin() + static_cast<std::ptrdiff_t>(row * nan_row.size()));
    std::copy(nan_row.begin(), nan_row.end(), pb.v.begin() + static_cast<std::ptrdiff_t>(row * nan_row.size()));
  }
  const GqaOutputs got = run_gqa_cpu(pb);
  const auto ref = testing::gqa_prefill_reference(pb);
  EXPECT_EQ(testing::compare_gqa_prefill(pb, ref, testing::as_float(DType::kBF16, got.out), got.lse, 1e-2, 1e-4), "");
}

}  // namespace
}  // namespace sparsepage
