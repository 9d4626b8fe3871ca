// Multi-token steps of the layers, checked on either backend
// (tests/support/multi_token_layers.h).
#include "support/multi_token_layers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>

#include "sparsepage/memory.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

// Values k / 8 with |k| <= 8: exact in bf16, and every dot product of up to
// 256 of them is exact in fp32 whatever the order, so the GPU indexer's
// choices (ties to the lower block id) equal the rule computed here.
std::vector<float> grid_values(size_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(-8, 8);
  std::vector<float> out(count);
  for (float& x : out) x = static_cast<float>(pick(rng)) / 8.0f;
  return out;
}

std::vector<uint8_t> to_dtype(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  from_float(dtype, values.data(), bytes.data(), values.size());
  return bytes;
}

struct Scenario {
  BlockSparseConfig config;
  int32_t batch = 2, q_len = 4;
  int64_t prompt = 0;
  // Host copies: keys/values per (b, h, pos) for positions < prompt + q_len.
  std::vector<float> k, v, index_k;  // [b][h][pos][d], [b][h][pos][d], [b][pos][d]
  std::vector<float> q, index_q;     // [b][t][hq][d], [b][t][hkv][d]
  std::vector<float> k_new, v_new;   // [t][b][hkv + 1][d], [t][b][hkv][d]
  int64_t len() const { return prompt + q_len; }
};

Scenario make_scenario(const BlockSparseConfig& config, int32_t batch, int64_t prompt, int32_t q_len, uint64_t seed) {
  Scenario s;
  s.config = config;
  s.batch = batch;
  s.prompt = prompt;
  s.q_len = q_len;
  std::mt19937_64 rng(seed);
  const size_t d = static_cast<size_t>(config.head_dim), hkv = static_cast<size_t>(config.num_kv_heads);
  const size_t hq = static_cast<size_t>(config.num_qo_heads), len = static_cast<size_t>(s.len());
  s.k = grid_values(static_cast<size_t>(batch) * hkv * len * d, rng);
  s.v = grid_values(static_cast<size_t>(batch) * hkv * len * d, rng);
  s.index_k = grid_values(static_cast<size_t>(batch) * len * d, rng);
  s.q = grid_values(static_cast<size_t>(batch) * q_len * hq * d, rng);
  s.index_q = grid_values(static_cast<size_t>(batch) * q_len * hkv * d, rng);
  // The new tokens' rows, token-major as decode(tokens, q_len) takes them.
  for (int32_t t = 0; t < q_len; ++t) {
    const size_t pos = static_cast<size_t>(prompt + t);
    for (size_t b = 0; b < static_cast<size_t>(batch); ++b) {
      for (size_t h = 0; h <= hkv; ++h) {
        const float* src = h < hkv ? &s.k[((b * hkv + h) * len + pos) * d] : &s.index_k[(b * len + pos) * d];
        s.k_new.insert(s.k_new.end(), src, src + d);
      }
      for (size_t h = 0; h < hkv; ++h) {
        const float* src = &s.v[((b * hkv + h) * len + pos) * d];
        s.v_new.insert(s.v_new.end(), src, src + d);
      }
    }
  }
  return s;
}

// Loads the prompt into `layer` ([batch, heads, prompt, dim] contiguous, index key last).
template <class Layer>
void load_prompt(Layer& layer, const Scenario& s, DType dtype, Device device) {
  const size_t d = static_cast<size_t>(s.config.head_dim), hkv = static_cast<size_t>(s.config.num_kv_heads);
  const size_t len = static_cast<size_t>(s.len()), prompt = static_cast<size_t>(s.prompt);
  std::vector<float> k, v;
  for (size_t b = 0; b < static_cast<size_t>(s.batch); ++b) {
    for (size_t h = 0; h <= hkv; ++h) {
      for (size_t pos = 0; pos < prompt; ++pos) {
        const float* src = h < hkv ? &s.k[((b * hkv + h) * len + pos) * d] : &s.index_k[(b * len + pos) * d];
        k.insert(k.end(), src, src + d);
      }
    }
    for (size_t h = 0; h < hkv; ++h) {
      for (size_t pos = 0; pos < prompt; ++pos) {
        const float* src = &s.v[((b * hkv + h) * len + pos) * d];
        v.insert(v.end(), src, src + d);
      }
    }
  }
  const Buffer kb = upload(device, to_dtype(dtype, k)), vb = upload(device, to_dtype(dtype, v));
  layer.append_tokens(kb.data(), vb.data(), s.prompt);
}

// The rule for a multi-token step, in fp64 (exact for grid values): the
// blocks a request keeps, as a set.
std::set<int32_t> expected_blocks(const Scenario& s, int32_t r) {
  const auto& c = s.config;
  const int32_t b = r / c.num_kv_heads, h = r % c.num_kv_heads;
  const int64_t len = s.len(), num_blocks = (len + c.block_size - 1) / c.block_size;
  const int64_t forced = std::min<int64_t>(num_blocks - c.local_blocks, (len - s.q_len) / c.block_size);
  const size_t d = static_cast<size_t>(c.head_dim);
  std::vector<std::pair<double, int32_t>> scored;  // (-score, block): sorts best first, ties to the lower id
  std::set<int32_t> kept = {static_cast<int32_t>(num_blocks - 1)};
  for (int64_t j = 0; j < num_blocks - 1; ++j) {
    if (j >= forced) {
      kept.insert(static_cast<int32_t>(j));
      continue;
    }
    double best = -std::numeric_limits<double>::infinity();
    for (int64_t pos = j * c.block_size; pos < (j + 1) * c.block_size; ++pos) {
      for (int32_t t = 0; t < s.q_len; ++t) {
        double dot = 0.0;
        for (size_t i = 0; i < d; ++i) {
          dot += double{s.index_q[((static_cast<size_t>(b) * s.q_len + t) * c.num_kv_heads + h) * d + i]} *
                 s.index_k[(static_cast<size_t>(b) * len + pos) * d + i];
        }
        best = std::max(best, dot);
      }
    }
    scored.push_back({-best, static_cast<int32_t>(j)});
  }
  std::sort(scored.begin(), scored.end());
  const size_t free_slots = static_cast<size_t>(c.topk_blocks) - (kept.size() - 1);
  for (size_t i = 0; i < std::min(free_slots, scored.size()); ++i) kept.insert(scored[i].second);
  return kept;
}

// fp64 attention of (sequence b, token t, query head) over `positions` cut at
// the token's causal limit; [hq, d] for sequence b, token t.
std::vector<double> reference_rows(const Scenario& s, int32_t b, int32_t t,
                                   const std::vector<std::vector<int32_t>>& positions_per_request) {
  const auto& c = s.config;
  const size_t d = static_cast<size_t>(c.head_dim), len = static_cast<size_t>(s.len());
  const int32_t g_count = c.group_size();
  const int64_t limit = s.len() - (s.q_len - 1 - t);
  const double scale = 1.0 / std::sqrt(static_cast<double>(static_cast<float>(c.head_dim)));
  std::vector<double> out(static_cast<size_t>(c.num_qo_heads) * d, 0.0);
  for (int32_t hq = 0; hq < c.num_qo_heads; ++hq) {
    const int32_t h = hq / g_count;
    const auto& positions = positions_per_request[static_cast<size_t>(b * c.num_kv_heads + h)];
    const float* q = &s.q[((static_cast<size_t>(b) * s.q_len + t) * c.num_qo_heads + hq) * d];
    std::vector<double> scores;
    std::vector<int32_t> kept;
    for (int32_t pos : positions) {
      if (pos >= limit) continue;
      const float* k = &s.k[((static_cast<size_t>(b) * c.num_kv_heads + h) * len + pos) * d];
      double dot = 0.0;
      for (size_t i = 0; i < d; ++i) dot += double{q[i]} * k[i];
      scores.push_back(dot * static_cast<double>(static_cast<float>(scale)));
      kept.push_back(pos);
    }
    const float* v = &s.v[(static_cast<size_t>(b) * c.num_kv_heads + h) * len * d];  // this KV head's rows
    const auto value = [&](size_t j, int64_t i) { return double{v[static_cast<size_t>(kept[j]) * d + i]}; };
    softmax_weighted_sum(scores, static_cast<int64_t>(d), value, &out[static_cast<size_t>(hq) * d]);
  }
  return out;
}

// Runs one multi-token step; returns o as float [b][t][hq][d].
std::vector<float> run_step(BlockSparseAttention& layer, const Scenario& s, DType dtype, Device device,
                            LayerStep* step) {
  const Buffer q = upload(device, to_dtype(dtype, s.q)), iq = upload(device, to_dtype(dtype, s.index_q));
  const Buffer k = upload(device, to_dtype(dtype, s.k_new)), v = upload(device, to_dtype(dtype, s.v_new));
  const size_t o_elems = s.q.size();
  Buffer o = upload(device, nan_values(dtype, o_elems));  // every element must be written
  BlockSparseTokens tokens;
  tokens.q = q.data();
  tokens.index_q = iq.data();
  tokens.k = k.data();
  tokens.v = v.data();
  tokens.o = o.data();
  *step = layer.decode(tokens, s.q_len);
  return as_float(dtype, download<uint8_t>(device, o.data(), o_elems * dtype_size(dtype)));
}

void expect_matches_reference(const Scenario& s, const std::vector<float>& o,
                              const std::vector<std::vector<int32_t>>& positions, const std::string& what) {
  const size_t d = static_cast<size_t>(s.config.head_dim), hq = static_cast<size_t>(s.config.num_qo_heads);
  for (int32_t b = 0; b < s.batch; ++b) {
    for (int32_t t = 0; t < s.q_len; ++t) {
      const std::vector<double> want = reference_rows(s, b, t, positions);
      const size_t row0 = (static_cast<size_t>(b) * s.q_len + t) * hq;
      for (size_t h = 0; h < hq; ++h) {
        const std::vector<float> got(o.begin() + static_cast<std::ptrdiff_t>((row0 + h) * d),
                                     o.begin() + static_cast<std::ptrdiff_t>((row0 + h + 1) * d));
        const std::vector<double> ref(want.begin() + static_cast<std::ptrdiff_t>(h * d),
                                      want.begin() + static_cast<std::ptrdiff_t>((h + 1) * d));
        EXPECT_LE(relative_l2(got, ref), 1e-2) << what << ": sequence " << b << " token " << t << " head " << h;
      }
    }
  }
}

}  // namespace

BlockSparseConfig small_block_sparse_config() {
  // {qo heads, kv heads, head dim, block size, topk, local blocks, capacity step}
  return {8, 2, 64, 32, 4, 1, 256};
}

void check_block_sparse_multi_token(Device device, const BlockSparseConfig& config, int32_t batch, int64_t prompt,
                                    int32_t q_len, std::string* kernel) {
  const DType dtype = DType::kBF16;
  const Scenario s = make_scenario(config, batch, prompt, q_len, 1234 + static_cast<uint64_t>(prompt));
  BlockSparseAttention layer(device, dtype, config, batch, always_fuse());
  load_prompt(layer, s, dtype, device);
  LayerStep step;
  const std::vector<float> o = run_step(layer, s, dtype, device, &step);
  ASSERT_EQ(layer.kv_len(), s.len());
  ASSERT_TRUE(step.sparse);
  ASSERT_TRUE(step.fused) << step.outcome.reason;
  if (kernel != nullptr) *kernel = step.outcome.kernel;
  const auto blocks = layer.last_blocks();
  ASSERT_EQ(blocks.size(), static_cast<size_t>(batch * config.num_kv_heads));
  const int64_t first_new_block = prompt / config.block_size, final_block = (s.len() - 1) / config.block_size;
  for (int32_t r = 0; r < batch * config.num_kv_heads; ++r) {
    const std::set<int32_t> got(blocks[static_cast<size_t>(r)].begin(), blocks[static_cast<size_t>(r)].end());
    EXPECT_EQ(blocks[static_cast<size_t>(r)].size(), static_cast<size_t>(config.topk_blocks + 1)) << "request " << r;
    EXPECT_EQ(got, expected_blocks(s, r)) << "request " << r;
    EXPECT_TRUE(got.count(static_cast<int32_t>(first_new_block)) && got.count(static_cast<int32_t>(final_block)))
        << "request " << r << " keeps the blocks of every new token";
  }
  expect_matches_reference(s, o, layer.last_selected_positions(), "fused multi-token step");
}

void check_block_sparse_multi_token_dense(Device device, const BlockSparseConfig& config, int32_t batch, int64_t prompt,
                                          int32_t q_len, bool kill) {
  const DType dtype = DType::kBF16;
  const Scenario s = make_scenario(config, batch, prompt, q_len, 99 + static_cast<uint64_t>(prompt));
  ASSERT_FALSE(config.sparse_regime(s.len()) && !kill) << "pick a context below the sparse regime";
  BlockSparseAttention layer(device, dtype, config, batch, kill ? kill_switch() : always_fuse());
  load_prompt(layer, s, dtype, device);
  LayerStep step;
  const std::vector<float> o = run_step(layer, s, dtype, device, &step);
  ASSERT_EQ(layer.kv_len(), s.len());
  EXPECT_FALSE(step.fused);
  // Token by token, each token attends everything up to its own position
  // (below the sparse regime) or its own selection (kill switch, checked
  // for the last token, whose selection the layer keeps).
  if (!kill) {
    std::vector<std::vector<int32_t>> all(static_cast<size_t>(batch * config.num_kv_heads));
    for (auto& positions : all) {
      positions.resize(static_cast<size_t>(s.len()));
      std::iota(positions.begin(), positions.end(), 0);
    }
    expect_matches_reference(s, o, all, "token-by-token step below the sparse regime");
  } else {
    ASSERT_TRUE(step.sparse);
    const auto positions = layer.last_selected_positions();
    const size_t d = static_cast<size_t>(config.head_dim), hq = static_cast<size_t>(config.num_qo_heads);
    for (int32_t b = 0; b < batch; ++b) {
      const std::vector<double> want = reference_rows(s, b, q_len - 1, positions);
      const size_t row0 = (static_cast<size_t>(b) * q_len + q_len - 1) * hq;
      const std::vector<float> got(o.begin() + static_cast<std::ptrdiff_t>(row0 * d),
                                   o.begin() + static_cast<std::ptrdiff_t>((row0 + hq) * d));
      EXPECT_LE(relative_l2(got, want), 1e-2) << "kill switch, sequence " << b << ", last token";
    }
    for (float x : o) ASSERT_FALSE(std::isnan(x)) << "every token's output is written";
  }
}

namespace {

// A DSA scenario on grid values: host copies of the cache rows (latent +
// index key, and k_pe) per (b, pos), and the step's inputs.
struct DsaScenario {
  DsaConfig config;
  int32_t batch = 2, q_len = 4;
  int64_t prompt = 0;
  std::vector<float> k_rows, pe;                 // [b][pos][latent + index], [b][pos][rope]
  std::vector<float> q, q_pe, q_index, weights;  // [b][t][...]
  int64_t len() const { return prompt + q_len; }
  size_t k_width() const { return static_cast<size_t>(config.latent_dim + config.index_head_dim); }
};

DsaScenario make_dsa_scenario(const DsaConfig& c, int32_t batch, int64_t prompt, int32_t q_len, uint64_t seed) {
  DsaScenario s;
  s.config = c;
  s.batch = batch;
  s.prompt = prompt;
  s.q_len = q_len;
  std::mt19937_64 rng(seed);
  const size_t b = static_cast<size_t>(batch), len = static_cast<size_t>(s.len()), tq = b * q_len;
  s.k_rows = grid_values(b * len * s.k_width(), rng);
  s.pe = grid_values(b * len * c.rope_dim, rng);
  s.q = grid_values(tq * c.num_qo_heads * c.latent_dim, rng);
  s.q_pe = grid_values(tq * c.num_qo_heads * c.rope_dim, rng);
  s.q_index = grid_values(tq * c.index_heads * c.index_head_dim, rng);
  s.weights = grid_values(tq * c.index_heads, rng);
  return s;
}

// Rows [from, to) of every sequence, [batch, 1, to - from, width] or token-major [to - from, batch, 1, 1, width].
std::vector<float> dsa_rows(const std::vector<float>& all, const DsaScenario& s, size_t width, int64_t from, int64_t to,
                            bool token_major) {
  std::vector<float> out;
  const size_t len = static_cast<size_t>(s.len());
  if (token_major) {
    for (int64_t pos = from; pos < to; ++pos) {
      for (size_t b = 0; b < static_cast<size_t>(s.batch); ++b) {
        const float* src = &all[(b * len + static_cast<size_t>(pos)) * width];
        out.insert(out.end(), src, src + width);
      }
    }
  } else {
    for (size_t b = 0; b < static_cast<size_t>(s.batch); ++b) {
      for (int64_t pos = from; pos < to; ++pos) {
        const float* src = &all[(b * len + static_cast<size_t>(pos)) * width];
        out.insert(out.end(), src, src + width);
      }
    }
  }
  return out;
}

// The rule for (sequence b, token t): the one-token indexer over the window
// below the token's own position.
std::vector<int32_t> dsa_expected(const DsaScenario& s, int32_t b, int32_t t) {
  const auto& c = s.config;
  const int64_t window = s.len() - (s.q_len - 1 - t);
  std::vector<int32_t> kept;
  if (window <= c.index_topk) {
    kept.resize(static_cast<size_t>(window));
    std::iota(kept.begin(), kept.end(), 0);
    return kept;
  }
  const size_t d = static_cast<size_t>(c.index_head_dim), len = static_cast<size_t>(s.len());
  std::vector<float> keys;
  for (int64_t pos = 0; pos < window; ++pos) {
    const float* src =
        &s.k_rows[(static_cast<size_t>(b) * len + static_cast<size_t>(pos)) * s.k_width() + c.latent_dim];
    keys.insert(keys.end(), src, src + d);
  }
  const size_t row = static_cast<size_t>(b) * s.q_len + t;
  const float* q = &s.q_index[row * c.index_heads * d];
  const float* w = &s.weights[row * c.index_heads];
  auto out = dsa_select_tokens_cpu(c, 1, window, q, w, keys)[0];
  std::sort(out.begin(), out.end());
  return out;
}

// fp64 MLA attention of (b, t) over `positions`: [heads, latent].
std::vector<double> dsa_rows_reference(const DsaScenario& s, int32_t b, int32_t t,
                                       const std::vector<int32_t>& positions) {
  const auto& c = s.config;
  const size_t len = static_cast<size_t>(s.len()), lat = static_cast<size_t>(c.latent_dim),
               rope = static_cast<size_t>(c.rope_dim);
  const double scale = static_cast<double>(1.0f / std::sqrt(static_cast<float>(c.latent_dim + c.rope_dim)));
  std::vector<double> out(static_cast<size_t>(c.num_qo_heads) * lat, 0.0);
  for (size_t h = 0; h < static_cast<size_t>(c.num_qo_heads); ++h) {
    const size_t qrow = (static_cast<size_t>(b) * s.q_len + t) * c.num_qo_heads + h;
    std::vector<double> sc;
    for (int32_t pos : positions) {
      const float* k = &s.k_rows[(static_cast<size_t>(b) * len + pos) * s.k_width()];
      const float* pe = &s.pe[(static_cast<size_t>(b) * len + pos) * rope];
      double dot = 0.0;
      for (size_t i = 0; i < lat; ++i) dot += double{s.q[qrow * lat + i]} * k[i];
      for (size_t i = 0; i < rope; ++i) dot += double{s.q_pe[qrow * rope + i]} * pe[i];
      sc.push_back(dot * scale);
    }
    const double mx = *std::max_element(sc.begin(), sc.end());
    double sum = 0.0;
    for (size_t j = 0; j < sc.size(); ++j) {
      const double w = std::exp(sc[j] - mx);
      sum += w;
      const float* k = &s.k_rows[(static_cast<size_t>(b) * len + positions[j]) * s.k_width()];
      for (size_t i = 0; i < lat; ++i) out[h * lat + i] += w * k[i];
    }
    for (size_t i = 0; i < lat; ++i) out[h * lat + i] /= sum;
  }
  return out;
}

}  // namespace

DsaConfig small_dsa_config() {
  // {qo heads, latent dim, rope dim, index heads, index head dim, index topk, scale (0: the default), capacity step}
  return {16, 512, 64, 8, 64, 64, 0.0f, 256};
}

void check_dsa_multi_token(Device device, const DsaConfig& config, int32_t batch, int64_t prompt, int32_t q_len,
                           bool kill) {
  const DType dtype = DType::kBF16;
  const DsaScenario s = make_dsa_scenario(config, batch, prompt, q_len, 77 + static_cast<uint64_t>(prompt));
  DispatchConfig dispatch = kill ? kill_switch() : always_fuse();
  dispatch.min_sparsity = 0;  // short windows too: the early tokens' windows may fit the top-k
  DsaAttention layer(device, dtype, config, batch, dispatch);
  {
    const Buffer k = upload(device, to_dtype(dtype, dsa_rows(s.k_rows, s, s.k_width(), 0, prompt, false)));
    const Buffer pe =
        upload(device, to_dtype(dtype, dsa_rows(s.pe, s, static_cast<size_t>(config.rope_dim), 0, prompt, false)));
    layer.append_tokens(k.data(), pe.data(), prompt);
  }
  const Buffer q = upload(device, to_dtype(dtype, s.q)), q_pe = upload(device, to_dtype(dtype, s.q_pe));
  const Buffer q_index = upload(device, to_dtype(dtype, s.q_index)), weights = upload(device, s.weights);
  const Buffer k_new = upload(device, to_dtype(dtype, dsa_rows(s.k_rows, s, s.k_width(), prompt, s.len(), true)));
  const Buffer pe_new =
      upload(device, to_dtype(dtype, dsa_rows(s.pe, s, static_cast<size_t>(config.rope_dim), prompt, s.len(), true)));
  const size_t o_elems = static_cast<size_t>(batch) * q_len * config.num_qo_heads * config.latent_dim;
  Buffer o = upload(device, nan_values(dtype, o_elems));
  DsaTokens tokens;
  tokens.q_latent = q.data();
  tokens.q_pe = q_pe.data();
  tokens.q_index = q_index.data();
  tokens.index_weights = weights.as<float>();
  tokens.k_cache_row = k_new.data();
  tokens.k_pe = pe_new.data();
  tokens.o = o.data();
  const LayerStep step = layer.decode(tokens, q_len);
  EXPECT_EQ(layer.cache().live_len(), s.len());
  EXPECT_EQ(step.fused, !kill) << step.outcome.reason;
  const std::vector<float> got = as_float(dtype, download<uint8_t>(device, o.data(), o_elems * dtype_size(dtype)));
  const auto selected = layer.last_selected_positions();
  const size_t rows_per_token = static_cast<size_t>(config.num_qo_heads) * config.latent_dim;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < q_len; ++t) {
      // Fused: row (b, t) of the step's selection; token by token: the last
      // one-token step's selection is kept (one row per sequence), the
      // earlier tokens are checked against the rule's selection.
      const std::vector<int32_t> want = dsa_expected(s, b, t);
      const bool kept = !kill || t == q_len - 1;
      std::vector<int32_t> positions(want);
      if (kept) {
        const auto& row = selected.at(kill ? static_cast<size_t>(b) : static_cast<size_t>(b) * q_len + t);
        positions.assign(row.begin(), row.end());
        std::sort(positions.begin(), positions.end());
        EXPECT_EQ(positions, want) << "sequence " << b << " token " << t << ": its own top-k over its own window";
      }
      const std::vector<double> ref = dsa_rows_reference(s, b, t, positions);
      const size_t row0 = (static_cast<size_t>(b) * q_len + t) * rows_per_token;
      const std::vector<float> o_bt(got.begin() + static_cast<std::ptrdiff_t>(row0),
                                    got.begin() + static_cast<std::ptrdiff_t>(row0 + rows_per_token));
      EXPECT_LE(relative_l2(o_bt, ref), 1e-2)
          << (kill ? "kill switch" : "fused") << ", sequence " << b << " token " << t;
    }
  }
}

}  // namespace sparsepage::testing
