#include "support/index_keys_problem.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>

namespace sparsepage::testing {
namespace {

std::vector<uint8_t> bytes_of(DType dtype, const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() * dtype_size(dtype));
  from_float(dtype, x.data(), out.data(), x.size());
  return out;
}

float round_to(DType dtype, float x) {
  uint8_t b[2];
  from_float(dtype, &x, b, 1);
  float y;
  to_float(dtype, b, &y, 1);
  return y;
}

}  // namespace

int64_t IndexKeysProblem::window(int32_t r) const {
  const int32_t seq = r / spec.q_len, tok = r % spec.q_len;
  return std::max<int64_t>(0, int64_t{spec.kv_lens[size_t(seq)]} - (spec.q_len - 1 - tok));
}

PagedIndexKeys IndexKeysProblem::paged(void* pool, const int32_t* table_ptr) const {
  PagedIndexKeys k;
  k.format = spec.format;
  k.pool = pool;
  k.num_blocks = num_blocks;
  k.block_size = spec.block_size;
  k.dtype = spec.dtype;
  const int64_t token = spec.format == IndexKeyFormat::kE4m3 ? IndexKeyFp8::kTokenBytes : int64_t{spec.dim} * 2;
  k.block_stride_bytes = spec.block_pad_bytes == 0 ? 0 : int64_t{spec.block_size} * token + spec.block_pad_bytes;
  k.block_table = table_ptr;
  k.block_table_stride = max_blocks;
  k.max_blocks = max_blocks;
  return k;
}

DsaIndexerArgs IndexKeysProblem::args(void* storage_ptr, const int32_t* table_ptr, const void* q_ptr,
                                      const float* w_ptr, const int32_t* lens_ptr, int32_t* positions, int32_t* counts,
                                      int32_t* error) const {
  DsaIndexerArgs a;
  a.dtype = spec.dtype;
  a.kv_lens = lens_ptr;
  a.max_kv_len = max_kv_len;
  a.q_index = q_ptr;
  a.weights = w_ptr;
  a.positions = positions;
  a.counts = counts;
  a.q_len = spec.q_len;
  a.key_layout = spec.layout;
  a.q_format = spec.q_format;
  a.error = error;
  if (spec.layout == IndexKeyLayout::kDense) {
    a.k_cache = storage_ptr;
    a.capacity = capacity;
  } else {
    a.paged = paged(storage_ptr, table_ptr);
  }
  return a;
}

std::vector<double> exact_scores(const IndexKeysProblem& pb, int32_t r) {
  const int32_t heads = pb.spec.heads, dim = pb.spec.dim;
  // The queries as the rule sees them: native values, or e4m3 values times
  // the folded scale (w' / w), which for exact problems is the query itself.
  std::vector<double> q(static_cast<size_t>(heads) * size_t(dim)), w(static_cast<size_t>(heads));
  if (pb.spec.q_format == IndexQueryFormat::kE4m3) {
    for (size_t i = 0; i < q.size(); ++i) q[i] = e4m3_to_float(pb.q[size_t(r) * q.size() + i]);
  } else {
    std::vector<float> f(q.size());
    to_float(pb.spec.dtype, pb.q.data() + size_t(r) * q.size() * 2, f.data(), f.size());
    std::copy(f.begin(), f.end(), q.begin());
  }
  for (int32_t j = 0; j < heads; ++j) w[size_t(j)] = pb.weights[size_t(r) * size_t(heads) + size_t(j)];
  const int64_t len = pb.window(r);
  std::vector<double> s(static_cast<size_t>(std::max<int64_t>(len, 0)));
  for (int64_t t = 0; t < len; ++t) {
    const float* k = pb.key(r / pb.spec.q_len, t);
    double total = 0;
    for (int32_t j = 0; j < heads; ++j) {
      double dot = 0;
      for (int32_t d = 0; d < dim; ++d) dot += q[size_t(j) * size_t(dim) + size_t(d)] * k[d];
      total += w[size_t(j)] * (std::isnan(dot) ? dot : std::max(dot, 0.0));
    }
    s[size_t(t)] = total;
  }
  return s;
}

IndexKeysProblem make_index_keys_problem(const IndexKeysSpec& spec) {
  IndexKeysProblem pb;
  pb.spec = spec;
  pb.config = DsaConfig{1, 64, 64, spec.heads, spec.dim, spec.topk, 0.0f, 64};
  pb.sequences = static_cast<int32_t>(spec.kv_lens.size());
  pb.longest = std::max<int64_t>(1, *std::max_element(spec.kv_lens.begin(), spec.kv_lens.end()));
  pb.max_kv_len = spec.max_kv_len != 0 ? spec.max_kv_len : pb.longest;
  std::mt19937_64 rng(spec.seed);
  std::uniform_int_distribution<int> small(-4, 4), half_steps(-2, 4);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const auto value = [&] { return spec.exact ? float(small(rng)) : round_to(spec.dtype, unit(rng)); };

  // Queries and weights of every (sequence, token) row.
  const int32_t rows = pb.rows();
  std::vector<float> qf(static_cast<size_t>(rows) * size_t(spec.heads) * size_t(spec.dim));
  for (float& x : qf) x = value();
  pb.weights.resize(size_t(rows) * size_t(spec.heads));
  for (float& w : pb.weights) w = spec.exact ? 0.5f * float(half_steps(rng)) : std::fabs(unit(rng));
  pb.q = bytes_of(spec.dtype, qf);
  if (spec.q_format == IndexQueryFormat::kE4m3) {
    std::vector<uint8_t> q8(qf.size());
    quantize_index_queries_cpu(spec.dtype, pb.q.data(), pb.weights.data(), rows, spec.heads, q8.data(),
                               pb.weights.data());
    pb.q = q8;
  }

  // Keys, NaN past each sequence's length.
  pb.keys.assign(size_t(pb.sequences) * size_t(pb.longest) * size_t(spec.dim), NAN);
  for (int32_t b = 0; b < pb.sequences; ++b) {
    for (int64_t t = 0; t < spec.kv_lens[size_t(b)]; ++t) {
      float* k = const_cast<float*>(pb.key(b, t));
      for (int32_t d = 0; d < spec.dim; ++d) k[d] = value();
    }
  }
  if (spec.exact) {
    // Per sequence, from its last row (the longest window): a tie block
    // across the threshold (the k-th key copied onto the dozen lowest
    // ranked) and a NaN in the best key.
    for (int32_t b = 0; b < pb.sequences; ++b) {
      const int32_t r = b * spec.q_len + spec.q_len - 1;
      const int64_t len = pb.window(r);
      if (len <= spec.topk) continue;
      const std::vector<double> s = exact_scores(pb, r);
      std::vector<int64_t> order(static_cast<size_t>(len));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return s[size_t(x)] > s[size_t(y)]; });
      if (len >= spec.topk + 14) {
        const std::vector<float> kth(pb.key(b, order[size_t(spec.topk - 1)]),
                                     pb.key(b, order[size_t(spec.topk - 1)]) + spec.dim);
        for (size_t i = 0; i < 12; ++i)
          std::copy(kth.begin(), kth.end(), const_cast<float*>(pb.key(b, order[order.size() - 1 - i])));
      }
      const_cast<float*>(pb.key(b, order[0]))[spec.dim / 2] = NAN;
    }
  }

  if (spec.layout == IndexKeyLayout::kDense) {
    // [sequences * capacity, latent + dim] rows; latent columns and rows past
    // each length stay NaN.
    pb.capacity = pb.max_kv_len + 5;
    const int64_t stride = int64_t{pb.config.latent_dim} + spec.dim;
    std::vector<float> rows_f(static_cast<size_t>(pb.sequences) * size_t(pb.capacity) * size_t(stride), NAN);
    for (int32_t b = 0; b < pb.sequences; ++b) {
      for (int64_t t = 0; t < spec.kv_lens[size_t(b)]; ++t) {
        std::copy(pb.key(b, t), pb.key(b, t) + spec.dim,
                  &rows_f[size_t((b * pb.capacity + t) * stride + pb.config.latent_dim)]);
      }
    }
    pb.storage = bytes_of(spec.dtype, rows_f);
    return pb;
  }

  // The pool: each sequence's blocks drawn from a shuffled list of ids, spare
  // blocks left over; everything starts as 0xFF (NaN in every format).
  std::vector<int64_t> need(static_cast<size_t>(pb.sequences));
  int64_t total = 0;
  for (int32_t b = 0; b < pb.sequences; ++b) {
    need[size_t(b)] = (int64_t{spec.kv_lens[size_t(b)]} + spec.block_size - 1) / spec.block_size;
    total += need[size_t(b)];
  }
  pb.num_blocks = total + spec.spare_blocks;
  pb.max_blocks = static_cast<int32_t>(std::max<int64_t>((pb.max_kv_len + spec.block_size - 1) / spec.block_size, 1) +
                                       spec.extra_table_entries);
  std::vector<int32_t> ids(static_cast<size_t>(pb.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  pb.table.assign(size_t(pb.sequences) * size_t(pb.max_blocks), 0);
  size_t next = 0;
  for (int32_t b = 0; b < pb.sequences; ++b) {
    for (int64_t e = 0; e < pb.max_blocks; ++e) {
      int32_t& entry = pb.table[size_t(b) * size_t(pb.max_blocks) + size_t(e)];
      if (e < need[size_t(b)]) {
        entry = ids[next++];
        pb.owned.push_back(entry);
      } else {
        entry = e % 2 == 0 ? -1 : static_cast<int32_t>(pb.num_blocks + 7);  // never needed, never read
      }
    }
  }
  std::sort(pb.owned.begin(), pb.owned.end());
  const PagedIndexKeys layout = pb.paged(nullptr, nullptr);
  const int64_t block_bytes = index_key_block_bytes(layout, spec.dim);
  pb.storage.assign(size_t(pb.num_blocks * block_bytes), 0xFF);
  // Every live key through the write op, in a shuffled order with skipped (-1) slots between.
  std::vector<float> src;
  std::vector<int64_t> slots;
  std::vector<std::pair<int32_t, int64_t>> live;
  for (int32_t b = 0; b < pb.sequences; ++b) {
    for (int64_t t = 0; t < spec.kv_lens[size_t(b)]; ++t) live.emplace_back(b, t);
  }
  std::shuffle(live.begin(), live.end(), rng);
  for (size_t i = 0; i < live.size(); ++i) {
    const auto [b, t] = live[i];
    src.insert(src.end(), pb.key(b, t), pb.key(b, t) + spec.dim);
    slots.push_back(int64_t{pb.table[size_t(b) * size_t(pb.max_blocks) + size_t(t / spec.block_size)]} *
                        spec.block_size +
                    t % spec.block_size);
    if (i % 7 == 3) {  // a padding token: its key is poison, its slot -1
      src.insert(src.end(), size_t(spec.dim), NAN);
      slots.push_back(-1);
    }
  }
  const std::vector<uint8_t> src_bytes = bytes_of(spec.dtype, src);
  PagedIndexKeys pool = pb.paged(pb.storage.data(), nullptr);
  write_index_keys_cpu(pool, spec.dim, spec.dtype, src_bytes.data(), spec.dim, slots.data(),
                       static_cast<int64_t>(slots.size()));
  return pb;
}

MixedLengthSteps mixed_length_steps(int32_t topk, int32_t bound) {
  MixedLengthSteps m;
  m.steps = {{0, topk, topk + 1, 0, topk / 2, bound, 64, 65},
             {bound - 1, 0, 1, 129, topk, 0, 128, 127},
             {0, 0, 0, 0, 0, 0, 0, 200},
             {0, 0, 0, 0, 0, 0, 0, 0},
             {topk + 1, topk + 1, topk + 1, topk + 1, 0, bound, bound, bound},
             {63, 64, 65, 0, 1, topk - 1, 191, 192}};
  if (bound > 4097) {
    m.steps.push_back({0, 2047, 2048, 2049, 20, 4097, 0, bound});
    m.steps.push_back({2049, 0, topk, 4096, 64, 0, 1, 2048});
  } else if (bound > 2049) {  // the first slice's edge only
    m.steps.push_back({0, 2047, 2048, 2049, 20, 0, 1, bound});
  }
  m.built.assign(8, 0);
  for (std::vector<int32_t>& step : m.steps) {
    for (size_t b = 0; b < step.size(); ++b) {
      step[b] = std::clamp(step[b], 0, bound);
      m.built[b] = std::max(m.built[b], step[b]);
    }
  }
  return m;
}

int64_t write_huge_unused_keys(IndexKeysProblem& pb) {
  const IndexKeysSpec& s = pb.spec;
  std::vector<int64_t> slots;
  for (int64_t blk = 0; blk < pb.num_blocks; ++blk) {
    for (int32_t off = 0; off < s.block_size; ++off) {
      bool live = false;
      for (int32_t b = 0; b < pb.sequences; ++b) {
        for (int64_t e = 0; e * s.block_size < s.kv_lens[size_t(b)]; ++e) {
          live |= pb.table[size_t(b) * size_t(pb.max_blocks) + size_t(e)] == blk &&
                  e * s.block_size + off < s.kv_lens[size_t(b)];
        }
      }
      if (!live) slots.push_back(blk * s.block_size + off);
    }
  }
  const std::vector<float> huge(slots.size() * size_t(s.dim), 3.0e4f);
  std::vector<uint8_t> bytes(huge.size() * 2);
  from_float(s.dtype, huge.data(), bytes.data(), huge.size());
  write_index_keys_cpu(pb.paged(pb.storage.data(), nullptr), s.dim, s.dtype, bytes.data(), s.dim, slots.data(),
                       int64_t(slots.size()));
  return int64_t(slots.size());
}

IndexSelection run_index_twin(const IndexKeysProblem& pb) {
  IndexSelection out;
  out.positions.assign(size_t(pb.rows()) * size_t(pb.spec.topk), 0x55555555);
  out.counts.assign(size_t(pb.rows()), 0x55555555);
  std::vector<uint8_t> storage = pb.storage;
  const DsaIndexerArgs a = pb.args(storage.data(), pb.table.data(), pb.q.data(), pb.weights.data(),
                                   pb.spec.kv_lens.data(), out.positions.data(), out.counts.data(), &out.error);
  dsa_select_tokens_cpu(pb.config, pb.sequences, a);
  return out;
}

std::vector<std::vector<float>> index_twin_scores(const IndexKeysProblem& pb) {
  std::vector<uint8_t> storage = pb.storage;
  const DsaIndexerArgs a = pb.args(storage.data(), pb.table.data(), pb.q.data(), pb.weights.data(),
                                   pb.spec.kv_lens.data(), nullptr, nullptr, nullptr);
  return dsa_index_scores_cpu(pb.config, pb.sequences, a);
}

void expect_same_selection(const IndexKeysProblem& pb, const IndexSelection& got, const IndexSelection& want,
                           const char* what, double tolerance) {
  const int32_t topk = pb.spec.topk;
  EXPECT_EQ(got.error, want.error) << what << ": error bits";
  std::vector<std::vector<float>> scores;
  if (tolerance > 0) scores = index_twin_scores(pb);
  for (int32_t r = 0; r < pb.rows(); ++r) {
    ASSERT_EQ(got.counts[size_t(r)], want.counts[size_t(r)]) << what << ": count of row " << r;
    const int32_t n = std::max(want.counts[size_t(r)], 0);  // a refused row (-1) keeps no entry
    const int32_t* g = &got.positions[size_t(r) * size_t(topk)];
    const int32_t* w = &want.positions[size_t(r) * size_t(topk)];
    for (int32_t i = n; i < topk; ++i) ASSERT_EQ(g[i], -1) << what << ": padding of row " << r << " at " << i;
    for (int32_t i = 0; i < n; ++i) {
      ASSERT_TRUE(g[i] >= 0 && g[i] < pb.window(r)) << what << ": row " << r << " entry " << i << " = " << g[i];
      if (i > 0) {
        ASSERT_LT(g[i - 1], g[i]) << what << ": row " << r << " not increasing at " << i;
      }
    }
    const std::vector<int32_t> gv(g, g + n), wv(w, w + n);
    if (tolerance <= 0) {
      EXPECT_EQ(gv, wv) << what << ": row " << r;
      continue;
    }
    // Swaps allowed only between positions scored within the tolerance of the threshold.
    const std::vector<float>& s = scores[size_t(r)];
    ASSERT_EQ(int64_t(s.size()), pb.window(r)) << what;
    const auto rank = [](float x) { return std::isnan(x) ? -INFINITY : double(x); };
    double threshold = INFINITY;
    for (int32_t p : wv) threshold = std::min(threshold, rank(s[size_t(p)]));
    const double slack = tolerance * (1.0 + std::fabs(threshold));
    const std::set<int32_t> gs(gv.begin(), gv.end()), ws(wv.begin(), wv.end());
    for (int32_t p : gv) {
      if (!ws.count(p)) {
        EXPECT_LE(std::fabs(rank(s[size_t(p)]) - threshold), slack) << what << ": row " << r << " took " << p;
      }
    }
    for (int32_t p : wv) {
      if (!gs.count(p)) {
        EXPECT_LE(std::fabs(rank(s[size_t(p)]) - threshold), slack) << what << ": row " << r << " dropped " << p;
      }
    }
  }
}

}  // namespace sparsepage::testing
