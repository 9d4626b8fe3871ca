// The static per-query-head block-sparse layer's checks (declared in
// layer_checks.h), run unchanged by the CPU and CUDA suites.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>

#include "support/layer_checks.h"
#include "support/reference.h"
#include "support/toy_model.h"

namespace sparsepage::testing {
namespace {

struct StaticTokenBuffers {
  Buffer q, k, v, o;
  StaticBlockSparseTokens view() { return {q.data(), k.data(), v.data(), o.data()}; }
};

size_t q_elements(const StaticBlockSparseConfig& c, int32_t batch) {
  return static_cast<size_t>(batch) * c.num_qo_heads * c.head_dim;
}
size_t kv_elements(const StaticBlockSparseConfig& c, int32_t batch, int64_t tokens) {
  return static_cast<size_t>(batch) * c.num_kv_heads * static_cast<size_t>(tokens) * c.head_dim;
}

StaticTokenBuffers random_static_tokens(Device device, const StaticBlockSparseConfig& c, int32_t batch,
                                        std::mt19937_64& rng) {
  StaticTokenBuffers t;
  t.q = upload(device, random_values(DType::kBF16, q_elements(c, batch), rng));
  t.k = upload(device, random_values(DType::kBF16, kv_elements(c, batch, 1), rng));
  t.v = upload(device, random_values(DType::kBF16, kv_elements(c, batch, 1), rng));
  t.o = upload(device, nan_values(DType::kBF16, q_elements(c, batch)));
  return t;
}

std::vector<float> read_bf16(Device device, const Buffer& b) {
  return as_float(DType::kBF16, download<uint8_t>(device, b.data(), b.bytes()));
}

}  // namespace

void check_static_set_equality(Device device, const StaticBlockSparseConfig& config,
                               const std::vector<std::pair<int32_t, int64_t>>& batch_contexts) {
  const int32_t hq = config.num_qo_heads, group = config.group_size();
  int fused_cases = 0;
  for (const auto& [batch, context] : batch_contexts) {
    SCOPED_TRACE("batch " + std::to_string(batch) + " context " + std::to_string(context));
    std::mt19937_64 rng(static_cast<uint64_t>(context * 31 + batch));
    StaticBlockSparseAttention fused(device, DType::kBF16, config, batch, always_fuse());
    StaticBlockSparseAttention masked(device, DType::kBF16, config, batch, kill_switch());
    if (context > 1) {
      const Buffer k = upload(device, random_values(DType::kBF16, kv_elements(config, batch, context - 1), rng));
      const Buffer v = upload(device, random_values(DType::kBF16, kv_elements(config, batch, context - 1), rng));
      fused.append_tokens(k.data(), v.data(), context - 1);
      masked.append_tokens(k.data(), v.data(), context - 1);
    }
    StaticTokenBuffers tok = random_static_tokens(device, config, batch, rng);
    const LayerStep a = fused.decode(tok.view());
    const auto o_fused = read_bf16(device, tok.o);
    fill_bytes(tok.o.data(), device, 0xFF, tok.o.bytes());
    const LayerStep b = masked.decode(tok.view());
    const auto o_masked = read_bf16(device, tok.o);
    ASSERT_EQ(fused.kv_len(), context);
    EXPECT_FALSE(b.fused);
    EXPECT_EQ(b.outcome.kind, OutcomeKind::kKillSwitch);
    // The default sparsity gate (2x): fused exactly when the window holds
    // at least twice what the widest head keeps.
    const int64_t most = fused.max_kept_tokens(context);
    EXPECT_EQ(a.fused, context / 2 >= most) << a.outcome.describe();
    fused_cases += a.fused ? 1 : 0;

    const auto positions = fused.last_selected_positions();
    const auto blocks = fused.last_blocks();
    const auto columns = fused.last_mask_columns();
    ASSERT_EQ(positions.size(), static_cast<size_t>(batch) * hq);
    EXPECT_EQ(masked.last_mask_columns(), columns) << "the mask-path layer keeps the same columns";
    const int64_t query_block = (context - 1) / config.block_size;
    const int64_t num_blocks = query_block + 1;
    for (size_t r = 0; r < positions.size(); ++r) {
      const int32_t h = static_cast<int32_t>(r % static_cast<size_t>(hq));
      std::vector<int32_t> rule_blocks;
      for (int64_t j = 0; j <= query_block; ++j) {
        if (config.keeps(h, query_block, j)) rule_blocks.push_back(static_cast<int32_t>(j));
      }
      EXPECT_EQ(blocks[r], rule_blocks) << "request " << r << ": the page list is the rule's blocks, in order";
      const std::set<int32_t> attended(positions[r].begin(), positions[r].end());
      const std::set<int32_t> kept(columns[r].begin(), columns[r].end());
      EXPECT_EQ(attended, kept) << "request " << r << " (query head " << h << ")";
      EXPECT_EQ(attended.size(), positions[r].size()) << "distinct blocks give distinct positions";
      EXPECT_EQ(static_cast<int64_t>(positions[r].size()), config.kept_tokens(h, context)) << "request " << r;
      ASSERT_FALSE(attended.empty());
      EXPECT_EQ(*attended.rbegin(), context - 1) << "the query's own token is attended";
    }
    // Heterogeneous heads: once every head has a vertical block below its
    // local run, the heads sharing a KV head keep different blocks.
    if (num_blocks >= config.local_blocks + config.vert_stride && group <= config.vert_stride) {
      for (size_t r = 0; r < positions.size(); r += static_cast<size_t>(group)) {
        for (int32_t g = 1; g < group; ++g) {
          EXPECT_NE(blocks[r], blocks[r + static_cast<size_t>(g)]) << "query heads " << r << " and " << r + g;
        }
      }
    }
    if (a.fused) {
      const std::vector<double> ref(o_masked.begin(), o_masked.end());
      EXPECT_LT(relative_l2(o_fused, ref), 1e-2) << "fused vs mask path over the same set";
    }
  }
  EXPECT_GT(fused_cases, 0) << "the contexts must include steps that fuse";
}

void check_static_against_reference(Device device, const StaticBlockSparseConfig& c, int32_t batch, int64_t context) {
  const int32_t hq = c.num_qo_heads, hkv = c.num_kv_heads, group = c.group_size(), dim = c.head_dim;
  const int64_t prompt = context - 1;
  const int64_t query_block = (context - 1) / c.block_size;
  std::mt19937_64 rng(2027);
  auto to_bits = [](const std::vector<uint8_t>& bytes) {
    std::vector<uint16_t> bits(bytes.size() / 2);
    std::copy_n(bytes.data(), bytes.size(), reinterpret_cast<uint8_t*>(bits.data()));
    return bits;
  };
  std::vector<uint16_t> k = to_bits(random_values(DType::kBF16, kv_elements(c, batch, prompt), rng));
  std::vector<uint16_t> v = to_bits(random_values(DType::kBF16, kv_elements(c, batch, prompt), rng));
  // Rows that no query head of their KV head keeps become NaN: reading one
  // shows up in the output.
  const uint16_t nan_bits = float_to_bf16(std::nanf(""));
  int64_t poisoned = 0;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t kv = 0; kv < hkv; ++kv) {
      for (int64_t t = 0; t < prompt; ++t) {
        bool used = false;
        for (int32_t g = 0; g < group; ++g) used |= c.keeps(kv * group + g, query_block, t / c.block_size);
        if (used) continue;
        const size_t row = ((static_cast<size_t>(b) * hkv + kv) * static_cast<size_t>(prompt) + t) * dim;
        std::fill_n(k.begin() + static_cast<std::ptrdiff_t>(row), dim, nan_bits);
        std::fill_n(v.begin() + static_cast<std::ptrdiff_t>(row), dim, nan_bits);
        ++poisoned;
      }
    }
  }
  ASSERT_GT(poisoned, 0) << "the context must leave rows that no head keeps";
  auto as_bytes = [](const std::vector<uint16_t>& bits) {
    const auto* p = reinterpret_cast<const uint8_t*>(bits.data());
    return std::vector<uint8_t>(p, p + bits.size() * 2);
  };
  const Buffer kd = upload(device, as_bytes(k)), vd = upload(device, as_bytes(v));
  StaticBlockSparseAttention fused(device, DType::kBF16, c, batch, always_fuse());
  StaticBlockSparseAttention masked(device, DType::kBF16, c, batch, kill_switch());
  fused.append_tokens(kd.data(), vd.data(), prompt);
  masked.append_tokens(kd.data(), vd.data(), prompt);

  const auto q_bytes = random_values(DType::kBF16, q_elements(c, batch), rng);
  const auto k1 = to_bits(random_values(DType::kBF16, kv_elements(c, batch, 1), rng));
  const auto v1 = to_bits(random_values(DType::kBF16, kv_elements(c, batch, 1), rng));
  StaticTokenBuffers tok;
  tok.q = upload(device, q_bytes);
  tok.k = upload(device, as_bytes(k1));
  tok.v = upload(device, as_bytes(v1));
  tok.o = upload(device, nan_values(DType::kBF16, q_elements(c, batch)));
  const LayerStep a = fused.decode(tok.view());
  ASSERT_TRUE(a.fused) << a.outcome.describe();
  const auto o_fused = read_bf16(device, tok.o);
  fill_bytes(tok.o.data(), device, 0xFF, tok.o.bytes());
  const LayerStep m = masked.decode(tok.view());
  ASSERT_FALSE(m.fused);
  const auto o_masked = read_bf16(device, tok.o);

  // fp64 attention of each query head over exactly its kept positions.
  const auto q = as_float(DType::kBF16, q_bytes);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t h = 0; h < hq; ++h) {
      const int32_t kv = h / group;
      auto row = [&](const std::vector<uint16_t>& cache, const std::vector<uint16_t>& last, int64_t t) {
        return t < prompt ? &cache[((static_cast<size_t>(b) * hkv + kv) * static_cast<size_t>(prompt) + t) * dim]
                          : &last[(static_cast<size_t>(b) * hkv + kv) * dim];
      };
      std::vector<int64_t> kept;
      for (int64_t t = 0; t < context; ++t) {
        if (c.keeps(h, query_block, t / c.block_size)) kept.push_back(t);
      }
      std::vector<double> s;
      for (int64_t t : kept) {
        const uint16_t* kr = row(k, k1, t);
        double dot = 0;
        for (int32_t d = 0; d < dim; ++d) dot += double(q[(size_t(b) * hq + h) * dim + d]) * bf16_to_float(kr[d]);
        s.push_back(dot * scale);
      }
      const double mx = *std::max_element(s.begin(), s.end());
      double sum = 0;
      std::vector<double> ref(static_cast<size_t>(dim), 0.0);
      for (size_t i = 0; i < kept.size(); ++i) {
        const double p = std::exp(s[i] - mx);
        sum += p;
        const uint16_t* vr = row(v, v1, kept[i]);
        for (int32_t d = 0; d < dim; ++d) ref[size_t(d)] += p * bf16_to_float(vr[d]);
      }
      for (double& x : ref) x /= sum;
      const size_t at = (size_t(b) * hq + h) * dim;
      const std::vector<float> got_f(o_fused.begin() + static_cast<std::ptrdiff_t>(at),
                                     o_fused.begin() + static_cast<std::ptrdiff_t>(at + dim));
      const std::vector<float> got_m(o_masked.begin() + static_cast<std::ptrdiff_t>(at),
                                     o_masked.begin() + static_cast<std::ptrdiff_t>(at + dim));
      EXPECT_LT(relative_l2(got_f, ref), 1e-2) << "fused, sequence " << b << " query head " << h;
      EXPECT_LT(relative_l2(got_m, ref), 1e-2) << "mask path, sequence " << b << " query head " << h;
    }
  }
}

void check_static_greedy_equality(Device device, int32_t batch, int32_t steps) {
  ToyModelConfig config;
  config.kind = ToyAttention::kStaticBlockSparse;
  config.batch = batch;
  std::mt19937_64 rng(98);
  std::uniform_int_distribution<int32_t> token(0, config.vocab - 1);
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch), std::vector<int32_t>(160));
  for (auto& prompt : prompts) {
    for (int32_t& t : prompt) t = token(rng);
  }
  ToyModel fused(device, config, always_fuse());
  ToyModel masked(device, config, kill_switch());
  const auto a = fused.generate(prompts, steps);
  const auto b = masked.generate(prompts, steps);
  EXPECT_EQ(fused.sparse_steps(), steps * config.layers) << "every decode step drops blocks";
  EXPECT_EQ(fused.fused_steps(), steps * config.layers) << "every decode step must have run the fused path";
  EXPECT_EQ(masked.fused_steps(), 0) << "the kill switch must pin the mask path";
  expect_same_greedy_tokens(a, b, masked.margins(), "static pattern, fused vs mask path");
}

}  // namespace sparsepage::testing
