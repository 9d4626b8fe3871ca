// The DSA layer (docs/DESIGN.md: the DSA layer) on the CPU backend: the indexer rule, the fused
// decode through the second K stream against fp64 and against the mask
// path, set equality, all tokens kept below index_topk, greedy equality.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "support/layer_checks.h"
#include "support/reference.h"
#include "support/toy_model.h"

namespace sparsepage {
namespace {

const DsaConfig kSmall{16, 64, 16, 4, 32, 48, 0.0f, 64};

struct TokenSet {
  std::vector<uint8_t> q, q_pe, q_index, k_row, k_pe;
  std::vector<float> weights;
  std::vector<uint8_t> o;
  TokenSet(const DsaConfig& c, int32_t batch, std::mt19937_64& rng) {
    const size_t b = static_cast<size_t>(batch);
    q = testing::random_values(DType::kBF16, b * c.num_qo_heads * c.latent_dim, rng);
    q_pe = testing::random_values(DType::kBF16, b * c.num_qo_heads * c.rope_dim, rng);
    q_index = testing::random_values(DType::kBF16, b * c.index_heads * c.index_head_dim, rng);
    k_row = testing::random_values(DType::kBF16, b * (c.latent_dim + c.index_head_dim), rng);
    k_pe = testing::random_values(DType::kBF16, b * c.rope_dim, rng);
    std::uniform_real_distribution<float> w(-1.0f, 1.0f);
    for (size_t i = 0; i < b * c.index_heads; ++i) weights.push_back(w(rng));
    o = testing::nan_values(DType::kBF16, b * c.num_qo_heads * c.latent_dim);
  }
  DsaTokens view() {
    return {q.data(), q_pe.data(), q_index.data(), weights.data(), k_row.data(), k_pe.data(), o.data()};
  }
};

TEST(Dsa, IndexerRuleOnAHandMadeCase) {
  DsaConfig c{1, 4, 2, 2, 2, 2, 0.0f, 8};
  // Two index heads: q0 = (1, 0) weight 1, q1 = (0, 1) weight -2.
  const float q[] = {1, 0, 0, 1};
  const float w[] = {1, -2};
  // Token keys: I(t) = relu(k.x) - 2 relu(k.y).
  const std::vector<float> keys = {3,  0,    // I = 3
                                   3,  1,    // I = 1
                                   -5, -5,   // I = 0 (both ReLUs clip)
                                   2,  0,    // I = 2
                                   0,  -1};  // I = 0
  EXPECT_EQ(dsa_select_tokens_cpu(c, 1, 5, q, w, keys), (std::vector<std::vector<int32_t>>{{0, 3}}));
  c.index_topk = 4;
  EXPECT_EQ(dsa_select_tokens_cpu(c, 1, 5, q, w, keys), (std::vector<std::vector<int32_t>>{{0, 3, 1, 2}}))
      << "ties (I = 0) go to the lower position";
  EXPECT_THROW(dsa_select_tokens_cpu(c, 1, 6, q, w, keys), Error);
}

TEST(Dsa, FusedDecodeMatchesFp64TheMaskPathAndTheIndexer) {
  const int32_t batch = 2;
  std::mt19937_64 rng(51);
  DsaAttention fused(Device::kCpu, DType::kBF16, kSmall, batch, testing::always_fuse());
  DsaAttention masked(Device::kCpu, DType::kBF16, kSmall, batch, testing::kill_switch());
  // An independent copy of every token's index key (the K row's columns
  // latent_dim .. latent_dim + index_head_dim), kept by the test itself.
  std::vector<std::vector<float>> index_keys(batch);
  const auto keep_keys = [&](const TokenSet& tok) {
    const auto row = testing::as_float(DType::kBF16, tok.k_row);
    const int32_t width = kSmall.latent_dim + kSmall.index_head_dim;
    for (int32_t s = 0; s < batch; ++s) {
      index_keys[size_t(s)].insert(index_keys[size_t(s)].end(), row.begin() + s * width + kSmall.latent_dim,
                                   row.begin() + (s + 1) * width);
    }
  };
  for (int t = 0; t < 150; ++t) {
    TokenSet tok(kSmall, batch, rng);
    keep_keys(tok);
    fused.prefill_token(tok.view());
    masked.prefill_token(tok.view());
  }
  TokenSet tok(kSmall, batch, rng);
  keep_keys(tok);
  const LayerStep a = fused.decode(tok.view());
  const auto o_fused = testing::as_float(DType::kBF16, tok.o);
  tok.o = testing::nan_values(DType::kBF16, tok.o.size() / 2);  // size() counts bytes
  const LayerStep b = masked.decode(tok.view());
  const auto o_masked = testing::as_float(DType::kBF16, tok.o);
  ASSERT_TRUE(a.sparse);
  EXPECT_TRUE(a.fused) << a.outcome.describe();
  EXPECT_EQ(b.outcome.kind, OutcomeKind::kKillSwitch);

  const auto positions = fused.last_selected_positions();
  const auto columns = fused.last_mask_columns();
  std::vector<double> ref;
  for (int32_t s = 0; s < batch; ++s) {
    EXPECT_EQ(positions[size_t(s)].size(), size_t(kSmall.index_topk));
    EXPECT_EQ(std::set<int32_t>(positions[size_t(s)].begin(), positions[size_t(s)].end()),
              std::set<int32_t>(columns[size_t(s)].begin(), columns[size_t(s)].end()));
    const auto r = testing::dsa_reference(fused, kSmall, tok.q, tok.q_pe, s, positions[size_t(s)]);
    ref.insert(ref.end(), r.begin(), r.end());
  }
  EXPECT_EQ(positions, masked.last_selected_positions()) << "same cache, same indexer";
  // The indexer saw the right columns: the rule applied to the test's own copy.
  std::vector<float> keys_flat;
  for (const auto& k : index_keys) keys_flat.insert(keys_flat.end(), k.begin(), k.end());
  const auto q_index = testing::as_float(DType::kBF16, tok.q_index);
  EXPECT_EQ(positions, dsa_select_tokens_cpu(kSmall, batch, 151, q_index.data(), tok.weights.data(), keys_flat));
  EXPECT_LT(testing::relative_l2(o_fused, ref), 1e-2) << "fused vs fp64";
  EXPECT_LT(testing::relative_l2(o_masked, ref), 1e-2) << "mask path vs fp64";
}

TEST(Dsa, EveryTokenIsKeptWhileTheWindowFitsTheTopk) {
  std::mt19937_64 rng(52);
  DsaAttention layer(Device::kCpu, DType::kBF16, kSmall, 1, testing::always_fuse());
  for (int t = 0; t < 30; ++t) {
    TokenSet tok(kSmall, 1, rng);
    layer.prefill_token(tok.view());
  }
  TokenSet tok(kSmall, 1, rng);
  const LayerStep step = layer.decode(tok.view());
  EXPECT_FALSE(step.sparse);
  std::vector<int32_t> all(31);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(layer.last_selected_positions(), (std::vector<std::vector<int32_t>>{all}));
  EXPECT_EQ(step.outcome.kind, OutcomeKind::kBelowSparsity) << "a full selection is dense work: the gate declines";
  EXPECT_LT(testing::relative_l2(testing::as_float(DType::kBF16, tok.o),
                                 testing::dsa_reference(layer, kSmall, tok.q, tok.q_pe, 0, all)),
            1e-2);
}

TEST(Dsa, GreedyDecodeEquality) {
  testing::DsaToyConfig config;
  std::mt19937_64 rng(53);
  std::uniform_int_distribution<int32_t> token(0, config.vocab - 1);
  std::vector<int32_t> prompt(100);
  for (int32_t& t : prompt) t = token(rng);
  testing::DsaToyModel fused(Device::kCpu, config, testing::always_fuse());
  testing::DsaToyModel masked(Device::kCpu, config, testing::kill_switch());
  const auto a = fused.generate(prompt, 64);
  const auto b = masked.generate(prompt, 64);
  EXPECT_EQ(fused.sparse_steps(), 64 * config.layers);
  EXPECT_EQ(fused.fused_steps(), 64 * config.layers);
  EXPECT_EQ(masked.fused_steps(), 0);
  EXPECT_EQ(a, b);
  EXPECT_GE(std::set<int32_t>(a.begin(), a.end()).size(), 8u) << "a degenerate generation proves little";
}

TEST(Dsa, BadCallsAreNamedAndChangeNothing) {
  std::mt19937_64 rng(54);
  DsaAttention layer(Device::kCpu, DType::kBF16, kSmall, 1, testing::always_fuse());
  EXPECT_THROW(layer.last_mask_columns(), Error) << "no decode yet";
  TokenSet tok(kSmall, 1, rng);
  DsaTokens bad = tok.view();
  bad.q_index = nullptr;
  EXPECT_THROW(layer.decode(bad), Error);
  EXPECT_EQ(layer.cache().live_len(), 0) << "a refused call appends nothing";
  // NaN index inputs rank last instead of breaking the sort.
  const float q[] = {NAN, 1};
  const float w[] = {1};
  const DsaConfig c{1, 4, 2, 1, 2, 2, 0.0f, 8};
  const std::vector<float> keys = {1, 1, 1, 0, 0, 2};
  EXPECT_EQ(dsa_select_tokens_cpu(c, 1, 3, q, w, keys).front().size(), 2u);
}

// On CUDA the constructor names a shape its kernels cannot run, before any
// device work. The checks are host code (src/models/dsa.cc), so they name
// the limit in any build, with or without CUDA or a GPU (the test once
// accepted "built without CUDA", so it could not fail).
TEST(Dsa, CudaRefusesShapesItCannotRunByName) {
  const auto refusal = [](const DsaConfig& c) -> std::string {
    try {
      DsaAttention layer(Device::kCuda, DType::kBF16, c, 1);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const auto names = [](const std::string& what, const std::string& limit) {
    return what.find(limit) != std::string::npos;
  };
  const std::string no_mla_tile = refusal(kSmall);  // latent 64 + rope 16
  EXPECT_TRUE(names(no_mla_tile, "latent_dim 64")) << no_mla_tile;
  DsaConfig odd_key = kSmall;
  odd_key.latent_dim = 512;
  odd_key.rope_dim = 64;
  odd_key.index_head_dim = 36;  // keys are read 16 bytes at a time
  const std::string odd = refusal(odd_key);
  EXPECT_TRUE(names(odd, "index_head_dim = 36")) << odd;
  DsaConfig nan_scale = odd_key;
  nan_scale.index_head_dim = 64;
  nan_scale.scale = std::nanf("");
  const std::string nan = refusal(nan_scale);
  EXPECT_TRUE(names(nan, "scale = nan")) << nan;
}

// A bad decode call changes nothing: every input is checked before the
// token is appended (both layers, both kinds of bad input).
TEST(Layers, ABadDecodeAppendsNothing) {
  std::mt19937_64 rng(5);
  BlockSparseAttention bs(Device::kCpu, DType::kBF16, BlockSparseConfig{8, 2, 64, 16, 4, 1, 64}, 1);
  const auto q = testing::random_values(DType::kBF16, 8 * 64, rng);
  const auto iq = testing::random_values(DType::kBF16, 2 * 64, rng);
  const auto k = testing::random_values(DType::kBF16, 3 * 64, rng);
  const auto v = testing::random_values(DType::kBF16, 2 * 64, rng);
  std::vector<uint8_t> o(8 * 64 * 2);
  bs.prefill_token({q.data(), iq.data(), k.data(), v.data(), o.data()});
  EXPECT_THROW(bs.decode({q.data(), nullptr, k.data(), v.data(), o.data()}), Error);
  EXPECT_THROW(bs.decode({nullptr, iq.data(), k.data(), v.data(), o.data()}), Error);
  EXPECT_THROW(bs.decode({q.data(), iq.data(), k.data(), v.data(), nullptr}), Error);
  EXPECT_EQ(bs.kv_len(), 1) << "a refused decode appended its token";
  EXPECT_THROW(BlockSparseAttention(Device::kCpu, DType::kBF16, BlockSparseConfig{0, 2, 64, 16, 4, 1, 64}, 1), Error);

  DsaAttention dsa(Device::kCpu, DType::kBF16, kSmall, 1);
  EXPECT_THROW(dsa.decode(DsaTokens{}), Error);
  EXPECT_EQ(dsa.cache().live_len(), 0) << "a refused decode appended its token";
}

}  // namespace
}  // namespace sparsepage
