#include "support/layer_checks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>

#include "sparsepage/models/block_sparse.h"
#include "support/reference.h"
#include "support/toy_model.h"

namespace sparsepage::testing {

DispatchConfig always_fuse() {
  DispatchConfig c = DispatchConfig::defaults();
  c.min_kv_tokens = 0;
  c.min_kv_tokens_per_request = 0;
  return c;
}

DispatchConfig kill_switch() {
  DispatchConfig c = always_fuse();
  c.enabled = false;
  return c;
}
namespace {

struct TokenBuffers {
  Buffer q, iq, k, v, o;
  BlockSparseTokens view() { return {q.data(), iq.data(), k.data(), v.data(), o.data()}; }
};

TokenBuffers random_tokens(Device device, const BlockSparseConfig& c, int32_t batch, std::mt19937_64& rng) {
  const size_t d = static_cast<size_t>(c.head_dim), b = static_cast<size_t>(batch);
  TokenBuffers t;
  t.q = upload(device, random_values(DType::kBF16, b * c.num_qo_heads * d, rng));
  t.iq = upload(device, random_values(DType::kBF16, b * c.num_kv_heads * d, rng));
  t.k = upload(device, random_values(DType::kBF16, b * (c.num_kv_heads + 1) * d, rng));
  t.v = upload(device, random_values(DType::kBF16, b * c.num_kv_heads * d, rng));
  t.o = upload(device, nan_values(DType::kBF16, b * c.num_qo_heads * d));
  return t;
}

}  // namespace

void check_block_sparse_set_equality(Device device, const BlockSparseConfig& config,
                                     const std::vector<std::pair<int32_t, int64_t>>& batch_contexts) {
  // K carries the index key at head num_kv_heads, so K and V have different
  // sequence strides: every batch must fuse, each stream at its own rows.
  for (const auto& [batch, context] : batch_contexts) {
    SCOPED_TRACE("batch " + std::to_string(batch) + " context " + std::to_string(context));
    std::mt19937_64 rng(static_cast<uint64_t>(context));
    BlockSparseAttention fused(device, DType::kBF16, config, batch, always_fuse());
    BlockSparseAttention masked(device, DType::kBF16, config, batch, kill_switch());
    for (int64_t t = 0; t + 1 < context; ++t) {
      TokenBuffers tok = random_tokens(device, config, batch, rng);
      fused.prefill_token(tok.view());
      masked.prefill_token(tok.view());
    }
    TokenBuffers tok = random_tokens(device, config, batch, rng);
    const LayerStep a = fused.decode(tok.view());
    const auto o_fused = as_float(DType::kBF16, download<uint8_t>(device, tok.o.data(), tok.o.bytes()));
    fill_bytes(tok.o.data(), device, 0xFF, tok.o.bytes());
    const LayerStep b = masked.decode(tok.view());
    const auto o_masked = as_float(DType::kBF16, download<uint8_t>(device, tok.o.data(), tok.o.bytes()));
    ASSERT_TRUE(a.sparse && b.sparse);
    EXPECT_TRUE(a.fused) << "per-stream strides fuse at every batch: " << a.outcome.describe();
    EXPECT_FALSE(b.fused);
    EXPECT_EQ(b.outcome.kind, OutcomeKind::kKillSwitch);

    const auto positions = fused.last_selected_positions();
    const auto columns = fused.last_mask_columns();
    const auto blocks = fused.last_blocks();
    EXPECT_EQ(blocks, masked.last_blocks()) << "same cache, same indexer";
    ASSERT_EQ(positions.size(), static_cast<size_t>(batch * config.num_kv_heads));
    const int64_t num_blocks = (context + config.block_size - 1) / config.block_size;
    const int64_t tail = context - (num_blocks - 1) * config.block_size;
    for (size_t r = 0; r < positions.size(); ++r) {
      const std::set<int32_t> attended(positions[r].begin(), positions[r].end());
      const std::set<int32_t> kept(columns[r].begin(), columns[r].end());
      EXPECT_EQ(attended, kept) << "request " << r;
      EXPECT_EQ(attended.size(), positions[r].size()) << "distinct blocks give distinct positions";
      EXPECT_EQ(static_cast<int64_t>(positions[r].size()), config.topk_blocks * config.block_size + tail);
      EXPECT_EQ(blocks[r].back(), num_blocks - 1) << "the final block is appended";
      EXPECT_NE(std::find(blocks[r].begin(), blocks[r].end(), num_blocks - 2), blocks[r].end())
          << "local_blocks = 2 force-keeps the block before the final one";
      EXPECT_LT(*attended.rbegin(), context);
    }
    std::vector<double> ref(o_masked.begin(), o_masked.end());
    EXPECT_LT(relative_l2(o_fused, ref), 1e-2) << "fused vs mask path over the same set";
  }
}

void expect_same_greedy_tokens(const std::vector<std::vector<int32_t>>& got,
                               const std::vector<std::vector<int32_t>>& ref,
                               const std::vector<std::vector<float>>& ref_margins, const std::string& what) {
  // Below this gap (logits are O(1)) bf16 rounding in another order can
  // swap the top two tokens; above it a different token is a bug.
  constexpr float kNearTie = 0.05f;
  ASSERT_EQ(got.size(), ref.size());
  ASSERT_EQ(ref_margins.size(), ref.size());
  size_t compared = 0, total = 0;
  for (size_t s = 0; s < got.size(); ++s) {
    ASSERT_EQ(got[s].size(), ref[s].size());
    total += ref[s].size();
    const auto split = std::mismatch(got[s].begin(), got[s].end(), ref[s].begin());
    const auto at = static_cast<size_t>(split.first - got[s].begin());
    compared += at;
    EXPECT_GE(std::set<int32_t>(got[s].begin(), got[s].end()).size(), std::min<size_t>(8, got[s].size() / 2))
        << "a degenerate generation proves little";
    if (at == got[s].size()) continue;
    EXPECT_LT(ref_margins[s][at], kNearTie)
        << what << ": sequence " << s << " step " << at << " chose " << got[s][at] << " and " << ref[s][at]
        << " where the top-2 logit gap is " << ref_margins[s][at] << ", not a near-tie";
    // After parting, the sequences' later tokens are not comparable.
    std::printf("greedy (%s): sequence %zu parts at step %zu on a near-tie (top-2 gap %.5f)\n", what.c_str(), s, at,
                static_cast<double>(ref_margins[s][at]));
  }
  EXPECT_GE(2 * compared, total) << what << ": fewer than half the tokens were compared before near-ties";
}

void check_block_sparse_greedy_equality(Device device, int32_t batch, int32_t steps) {
  ToyModelConfig config;
  config.batch = batch;
  std::mt19937_64 rng(99);
  std::uniform_int_distribution<int32_t> token(0, config.vocab - 1);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch), std::vector<int32_t>(160));
  for (auto& prompt : prompts) {
    for (int32_t& t : prompt) t = token(rng);
  }
  ASSERT_TRUE(config.attention.sparse_regime(160));
  ToyModel fused(device, config, always_fuse());
  ToyModel masked(device, config, kill_switch());
  const auto a = fused.generate(prompts, steps);
  const auto b = masked.generate(prompts, steps);
  EXPECT_EQ(fused.sparse_steps(), steps * config.layers);
  EXPECT_EQ(fused.fused_steps(), steps * config.layers) << "every decode step must have run the fused path";
  EXPECT_EQ(masked.fused_steps(), 0) << "the kill switch must pin the mask path";
  expect_same_greedy_tokens(a, b, masked.margins(), "fused vs mask path");
}

std::vector<double> dsa_reference(const DsaAttention& layer, const DsaConfig& c, const std::vector<uint8_t>& q_bytes,
                                  const std::vector<uint8_t>& q_pe_bytes, int32_t b,
                                  const std::vector<int32_t>& positions) {
  const RowView k_rows = layer.cache().k_rows().value(), pe_rows = layer.cache().v_rows().value();
  const auto* k = static_cast<const uint16_t*>(k_rows.data);
  const auto* pe = static_cast<const uint16_t*>(pe_rows.data);
  const auto q = as_float(DType::kBF16, q_bytes);
  const auto qpe = as_float(DType::kBF16, q_pe_bytes);
  const double scale = 1.0 / std::sqrt(double(c.latent_dim + c.rope_dim));
  std::vector<double> out;
  for (int32_t h = 0; h < c.num_qo_heads; ++h) {
    const size_t qrow = size_t(b) * c.num_qo_heads + h;
    std::vector<double> s;
    for (int32_t t : positions) {
      const int64_t kk = k_rows.offset(b, 0, t), ee = pe_rows.offset(b, 0, t);
      double dot = 0;
      for (int d = 0; d < c.latent_dim; ++d) dot += double(q[qrow * c.latent_dim + d]) * bf16_to_float(k[kk + d]);
      for (int d = 0; d < c.rope_dim; ++d) dot += double(qpe[qrow * c.rope_dim + d]) * bf16_to_float(pe[ee + d]);
      s.push_back(dot * scale);
    }
    const double mx = *std::max_element(s.begin(), s.end());
    double sum = 0;
    std::vector<double> o(size_t(c.latent_dim), 0.0);
    for (size_t j = 0; j < positions.size(); ++j) {
      const double p = std::exp(s[j] - mx);
      sum += p;
      const int64_t kk = k_rows.offset(b, 0, positions[j]);
      for (int d = 0; d < c.latent_dim; ++d) o[size_t(d)] += p * bf16_to_float(k[kk + d]);
    }
    for (double x : o) out.push_back(x / sum);
  }
  return out;
}

}  // namespace sparsepage::testing
