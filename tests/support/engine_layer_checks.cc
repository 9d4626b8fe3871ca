#include "support/engine_layer_checks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>

#include "sparsepage/fp8.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "support/engine_pool.h"
#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr DType kDt = DType::kBF16;

// bf16 bytes of `count` values at element `offset` of `bytes`.
const uint8_t* at(const std::vector<uint8_t>& bytes, size_t offset) { return bytes.data() + offset * 2; }

std::vector<uint8_t> host_bytes(Device device, const Buffer& b) {
  return download<uint8_t>(device, b.data(), b.bytes());
}

// ---------------------------------------------------------------- block-sparse

// {qo heads, kv heads, head dim, block size, topk, local blocks, capacity step}
const BlockSparseConfig kBlockConfig{16, 2, 128, 64, 4, 2, 256};

BlockSparseConfig block_config(int32_t topk_blocks) {
  BlockSparseConfig c = kBlockConfig;
  c.topk_blocks = topk_blocks;
  return c;
}

// Every token's rows, per sequence: attention K and V [heads, dim] and the index key [dim].
struct BlockTokens {
  int32_t heads, dim;
  std::vector<std::vector<uint8_t>> k, v, ik;  // [batch][t * heads * dim] and [batch][t * dim]
  BlockTokens(int32_t batch, int32_t h, int32_t d)
      : heads(h), dim(d), k(size_t(batch)), v(size_t(batch)), ik(size_t(batch)) {}
  void add(int32_t b, std::mt19937_64& rng) {
    auto append = [&](std::vector<uint8_t>& dst, size_t n) {
      const auto fresh = random_values(kDt, n, rng);
      dst.insert(dst.end(), fresh.begin(), fresh.end());
    };
    append(k[size_t(b)], size_t(heads) * dim);
    append(v[size_t(b)], size_t(heads) * dim);
    append(ik[size_t(b)], size_t(dim));
  }
  int64_t len(int32_t b) const { return static_cast<int64_t>(ik[size_t(b)].size() / 2 / size_t(dim)); }
};

// fp64 attention of every query head over positions [0, kv_len): [batch, qo_heads, dim].
std::vector<double> block_reference(const BlockTokens& tok, const std::vector<float>& q, int32_t batch,
                                    int32_t qo_heads, int64_t kv_len) {
  const int32_t h_kv = tok.heads, d = tok.dim, g = qo_heads / h_kv;
  std::vector<double> out(size_t(batch) * qo_heads * d, 0.0);
  for (int32_t b = 0; b < batch; ++b) {
    const auto k = as_float(kDt, tok.k[size_t(b)]);
    const auto v = as_float(kDt, tok.v[size_t(b)]);
    for (int32_t i = 0; i < qo_heads; ++i) {
      const int32_t h = i / g;
      const float* qi = &q[(size_t(b) * qo_heads + i) * d];
      std::vector<double> s(static_cast<size_t>(kv_len));
      double m = -INFINITY;
      for (int64_t t = 0; t < kv_len; ++t) {
        double dot = 0.0;
        for (int32_t x = 0; x < d; ++x) dot += double(qi[x]) * k[(size_t(t) * h_kv + h) * d + x];
        s[size_t(t)] = dot / std::sqrt(double(d));
        m = std::max(m, s[size_t(t)]);
      }
      double total = 0.0;
      for (auto& e : s) total += (e = std::exp(e - m));
      double* o = &out[(size_t(b) * qo_heads + i) * d];
      for (int64_t t = 0; t < kv_len; ++t) {
        for (int32_t x = 0; x < d; ++x) o[x] += s[size_t(t)] / total * v[(size_t(t) * h_kv + h) * d + x];
      }
    }
  }
  return out;
}

// The two layers side by side over the same tokens.
struct BlockArms {
  Device device;
  int32_t batch;
  BlockSparseConfig c;
  BlockSparseAttention dense, engine;
  EnginePool pool;
  BlockTokens tok;

  BlockArms(Device d, int32_t b, int32_t max_blocks, std::mt19937_64& rng, DispatchConfig engine_dispatch,
            const BlockSparseConfig& config = kBlockConfig)
      : device(d),
        batch(b),
        c(config),
        dense(d, kDt, config, b, always_fuse()),
        engine(d, kDt, engine_config(config), b, engine_dispatch),
        pool(d, b, max_blocks, int64_t{config.num_kv_heads} * config.head_dim, 2, rng),
        tok(b, config.num_kv_heads, config.head_dim) {}
  static BlockSparseConfig engine_config(const BlockSparseConfig& config) {
    BlockSparseConfig e = config;
    e.kv_storage = KVStorage::kEnginePaged;
    return e;
  }
  // [num_blocks, 16, heads, dim] K and V pools: head h at column h * dim of a row.
  EnginePagedKV kv() const { return pool.kv(c.head_dim, c.num_kv_heads); }
  // The prompt: `n` tokens into both arms (the engine's rows written by "the engine").
  void prompt(int64_t n, std::mt19937_64& rng) {
    const int32_t h = c.num_kv_heads, d = c.head_dim;
    std::vector<uint8_t> dk(size_t(batch) * (h + 1) * n * d * 2), dv(size_t(batch) * h * n * d * 2),
        ek(size_t(batch) * n * d * 2);
    for (int32_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < n; ++t) {
        tok.add(b, rng);
        for (int32_t hh = 0; hh < h; ++hh) {
          std::memcpy(&dk[((size_t(b) * (h + 1) + hh) * n + t) * d * 2], at(tok.k[size_t(b)], (size_t(t) * h + hh) * d),
                      d * 2);
          std::memcpy(&dv[((size_t(b) * h + hh) * n + t) * d * 2], at(tok.v[size_t(b)], (size_t(t) * h + hh) * d),
                      d * 2);
        }
        std::memcpy(&dk[((size_t(b) * (h + 1) + h) * n + t) * d * 2], at(tok.ik[size_t(b)], size_t(t) * d), d * 2);
        std::memcpy(&ek[(size_t(b) * n + t) * d * 2], at(tok.ik[size_t(b)], size_t(t) * d), d * 2);
        pool.write_bytes(0, b, t, at(tok.k[size_t(b)], size_t(t) * h * d));
        pool.write_bytes(1, b, t, at(tok.v[size_t(b)], size_t(t) * h * d));
      }
    }
    const Buffer bk = upload(device, dk), bv = upload(device, dv), be = upload(device, ek);
    dense.append_tokens(bk.data(), bv.data(), n);
    engine.append_tokens(be.data(), nullptr, n);
  }
  // One decode step on both arms; returns {dense o, engine o, q as floats}.
  struct StepOut {
    std::vector<uint8_t> dense_o, engine_o;
    std::vector<float> q;
    LayerStep dense_step, engine_step;
  };
  StepOut step(std::mt19937_64& rng) {
    const int32_t h = c.num_kv_heads, d = c.head_dim;
    const int64_t pos = engine.kv_len();
    std::vector<uint8_t> dk(size_t(batch) * (h + 1) * d * 2), dv(size_t(batch) * h * d * 2), ek(size_t(batch) * d * 2);
    for (int32_t b = 0; b < batch; ++b) {
      tok.add(b, rng);
      std::memcpy(&dk[size_t(b) * (h + 1) * d * 2], at(tok.k[size_t(b)], size_t(pos) * h * d), size_t(h) * d * 2);
      std::memcpy(&dk[(size_t(b) * (h + 1) + h) * d * 2], at(tok.ik[size_t(b)], size_t(pos) * d), size_t(d) * 2);
      std::memcpy(&dv[size_t(b) * h * d * 2], at(tok.v[size_t(b)], size_t(pos) * h * d), size_t(h) * d * 2);
      std::memcpy(&ek[size_t(b) * d * 2], at(tok.ik[size_t(b)], size_t(pos) * d), size_t(d) * 2);
      pool.write_bytes(0, b, pos, at(tok.k[size_t(b)], size_t(pos) * h * d));
      pool.write_bytes(1, b, pos, at(tok.v[size_t(b)], size_t(pos) * h * d));
    }
    const auto q = random_values(kDt, size_t(batch) * c.num_qo_heads * d, rng);
    const auto iq = random_values(kDt, size_t(batch) * h * d, rng);
    const Buffer bq = upload(device, q), biq = upload(device, iq), bk = upload(device, dk), bv = upload(device, dv),
                 be = upload(device, ek);
    Buffer o1 = upload(device, nan_values(kDt, size_t(batch) * c.num_qo_heads * d));
    Buffer o2 = upload(device, nan_values(kDt, size_t(batch) * c.num_qo_heads * d));
    StepOut out;
    BlockSparseTokens dt{bq.data(), biq.data(), bk.data(), bv.data(), o1.data()};
    out.dense_step = dense.decode(dt);
    BlockSparseTokens et;
    et.q = bq.data();
    et.index_q = biq.data();
    et.o = o2.data();
    et.index_k = be.data();
    out.engine_step = engine.decode(et, kv());
    out.dense_o = host_bytes(device, o1);
    out.engine_o = host_bytes(device, o2);
    out.q = as_float(kDt, q);
    return out;
  }
};

// ------------------------------------------------------------------------ DSA

const DsaConfig kDsaConfig{16, 512, 64, 4, 128, 64, 0.0f, 128};

DsaConfig dsa_config(int32_t index_topk) {
  DsaConfig c = kDsaConfig;
  c.index_topk = index_topk;
  return c;
}

struct DsaArms {
  Device device;
  int32_t batch;
  DsaConfig c;
  DsaAttention dense, engine;
  // The engine's pool: [latent 512 | rope 64] bf16 rows, or with `fp8` the
  // engines' 656-byte FP8 rows (fp8.h), whose dequantized latent values
  // (rounded to bf16) are what the dense arm's cache then holds.
  bool fp8;
  EnginePool pool;

  static DsaConfig engine_config(const DsaConfig& config) {
    DsaConfig e = config;
    e.kv_storage = KVStorage::kEnginePaged;
    return e;
  }
  DsaArms(Device d, int32_t b, int32_t max_blocks, std::mt19937_64& rng, DispatchConfig engine_dispatch,
          bool fp8_pool = false, const DsaConfig& config = kDsaConfig)
      : device(d),
        batch(b),
        c(config),
        dense(d, kDt, config, b, always_fuse().without_performance_gates()),
        engine(d, kDt, engine_config(config), b, engine_dispatch),
        fp8(fp8_pool),
        pool(d, b, max_blocks, fp8_pool ? MlaFp8Row::kBytes / 2 : config.latent_dim + config.rope_dim, 1, rng) {}
  EnginePagedKV kv() const { return pool.mla_kv(c.latent_dim, c.rope_dim, fp8); }
  // `n` tokens: per sequence a latent, an index key and a rope row each.
  struct Rows {
    std::vector<uint8_t> latent, ik, pe;
  };
  Rows make(int64_t n, std::mt19937_64& rng) {
    return {random_values(kDt, size_t(batch) * n * c.latent_dim, rng),
            random_values(kDt, size_t(batch) * n * c.index_head_dim, rng),
            random_values(kDt, size_t(batch) * n * c.rope_dim, rng)};
  }
  // Writes rows [b][i] (i < n) as positions first .. first + n - 1 into the engine pool,
  // and returns the dense layer's K rows [b, 1, n, latent + index] in that order.
  std::vector<uint8_t> place(const Rows& r, int64_t n, int64_t first) {
    const int32_t lw = c.latent_dim, iw = c.index_head_dim, pw = c.rope_dim;
    std::vector<uint8_t> dense_k(size_t(batch) * n * (lw + iw) * 2), row(size_t(lw + pw) * 2);
    std::vector<uint8_t> fp8_row(MlaFp8Row::kBytes);
    for (int32_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        const size_t bi = size_t(b) * n + size_t(i);
        std::memcpy(&dense_k[bi * (lw + iw) * 2], at(r.latent, bi * lw), size_t(lw) * 2);
        std::memcpy(&dense_k[(bi * (lw + iw) + lw) * 2], at(r.ik, bi * iw), size_t(iw) * 2);
        std::memcpy(row.data(), at(r.latent, bi * lw), size_t(lw) * 2);
        std::memcpy(row.data() + size_t(lw) * 2, at(r.pe, bi * pw), size_t(pw) * 2);
        if (!fp8) {
          pool.write_bytes(0, b, first + i, row.data());
          continue;
        }
        quantize_mla_fp8_cpu(kDt, row.data(), 1, lw + pw, fp8_row.data());
        pool.write_bytes(0, b, first + i, fp8_row.data());
        for (int32_t d = 0; d < lw; ++d) {  // the dense arm holds the dequantized latent, rounded to bf16
          float scale = 0.f;
          std::memcpy(&scale, &fp8_row[size_t(MlaFp8Row::kScaleOffset + 4 * (d / MlaFp8Row::kBlock))], 4);
          const uint16_t bits = float_to_bf16(e4m3_to_float(fp8_row[size_t(d)]) * scale);
          std::memcpy(&dense_k[(bi * (lw + iw) + size_t(d)) * 2], &bits, 2);
        }
      }
    }
    return dense_k;
  }
  void prompt(int64_t n, std::mt19937_64& rng) {
    const Rows r = make(n, rng);
    const auto dense_k = place(r, n, 0);
    const Buffer bk = upload(device, dense_k), bpe = upload(device, r.pe), bik = upload(device, r.ik);
    dense.append_tokens(bk.data(), bpe.data(), n);
    engine.append_tokens(bik.data(), nullptr, n);
  }
  struct StepOut {
    std::vector<uint8_t> dense_o, engine_o;
    LayerStep dense_step, engine_step;
  };
  // One sequence's engine-paged step inputs (random queries and index key,
  // unit index weights, a NaN output), for the steps that must be refused.
  struct EngineToken {
    Buffer q, pe, qi, w, ik, o;
    EngineToken(Device device, std::mt19937_64& rng)
        : q(upload(device, random_values(kDt, size_t(kDsaConfig.num_qo_heads) * kDsaConfig.latent_dim, rng))),
          pe(upload(device, random_values(kDt, size_t(kDsaConfig.num_qo_heads) * kDsaConfig.rope_dim, rng))),
          qi(upload(device, random_values(kDt, size_t(kDsaConfig.index_heads) * kDsaConfig.index_head_dim, rng))),
          w(upload(device, std::vector<float>(size_t(kDsaConfig.index_heads), 1.0f))),
          ik(upload(device, random_values(kDt, size_t(kDsaConfig.index_head_dim), rng))),
          o(upload(device, nan_values(kDt, size_t(kDsaConfig.num_qo_heads) * kDsaConfig.latent_dim))) {}
    DsaTokens tokens() const {
      DsaTokens t{q.data(), pe.data(), qi.data(), w.as<float>(), nullptr, nullptr, const_cast<void*>(o.data())};
      t.index_k = ik.data();
      return t;
    }
  };
  StepOut step(std::mt19937_64& rng) {
    const Rows r = make(1, rng);
    const auto dense_k = place(r, 1, engine.kv_len());
    const auto q = random_values(kDt, size_t(batch) * c.num_qo_heads * c.latent_dim, rng);
    const auto q_pe = random_values(kDt, size_t(batch) * c.num_qo_heads * c.rope_dim, rng);
    const auto q_index = random_values(kDt, size_t(batch) * c.index_heads * c.index_head_dim, rng);
    std::vector<float> w(size_t(batch) * c.index_heads);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (auto& x : w) x = dist(rng);
    const Buffer bq = upload(device, q), bpe = upload(device, q_pe), bqi = upload(device, q_index),
                 bw = upload(device, w), bk = upload(device, dense_k), bkpe = upload(device, r.pe),
                 bik = upload(device, r.ik);
    Buffer o1 = upload(device, nan_values(kDt, size_t(batch) * c.num_qo_heads * c.latent_dim));
    Buffer o2 = upload(device, nan_values(kDt, size_t(batch) * c.num_qo_heads * c.latent_dim));
    StepOut out;
    out.dense_step =
        dense.decode({bq.data(), bpe.data(), bqi.data(), bw.as<float>(), bk.data(), bkpe.data(), o1.data()});
    DsaTokens et{bq.data(), bpe.data(), bqi.data(), bw.as<float>(), nullptr, nullptr, o2.data()};
    et.index_k = bik.data();
    out.engine_step = engine.decode(et, kv());
    out.dense_o = host_bytes(device, o1);
    out.engine_o = host_bytes(device, o2);
    return out;
  }
};

bool has_nan(const std::vector<uint8_t>& bf16) {
  const auto f = as_float(kDt, bf16);
  return std::any_of(f.begin(), f.end(), [](float x) { return std::isnan(x); });
}

}  // namespace

void check_engine_paged_block_sparse(Device device, const EnginePagedSizes& sizes) {
  std::mt19937_64 rng(4242);
  const int32_t batch = 2;
  const BlockSparseConfig config = block_config(sizes.block_topk);
  // Dense regime (kv_len <= 2 * topk * block, 512 at the full sizes): every block, through the fused path.
  {
    BlockArms arms(device, batch, sizes.block_dense_table, rng, always_fuse(), config);
    arms.prompt(sizes.block_dense_prompt, rng);
    for (int s = 0; s < 2; ++s) {
      const auto out = arms.step(rng);
      ASSERT_FALSE(out.engine_step.sparse);
      ASSERT_TRUE(out.engine_step.fused) << out.engine_step.outcome.reason;
      ASSERT_FALSE(has_nan(out.engine_o)) << "dense-regime step " << s << ": an output unwritten or a NaN row read";
      const auto ref = block_reference(arms.tok, out.q, batch, config.num_qo_heads, arms.engine.kv_len());
      const double err = relative_l2(as_float(kDt, out.engine_o), ref);
      EXPECT_LT(err, 1e-2) << "dense-regime step " << s << " against fp64 over the whole window";
    }
  }
  // Sparse regime: the same blocks as the layer's own cache, the same bits.
  {
    BlockArms arms(device, batch, sizes.block_sparse_table, rng, always_fuse(), config);
    arms.prompt(sizes.block_sparse_prompt, rng);
    for (int s = 0; s < 3; ++s) {
      const auto out = arms.step(rng);
      ASSERT_TRUE(out.engine_step.sparse);
      ASSERT_TRUE(out.dense_step.fused) << out.dense_step.outcome.reason;
      ASSERT_TRUE(out.engine_step.fused) << out.engine_step.outcome.reason;
      EXPECT_EQ(arms.engine.last_blocks(), arms.dense.last_blocks()) << "step " << s;
      EXPECT_EQ(arms.engine.last_selected_positions(), arms.dense.last_selected_positions()) << "step " << s;
      ASSERT_FALSE(has_nan(out.engine_o)) << "step " << s;
      EXPECT_TRUE(out.engine_o == out.dense_o)
          << "step " << s << ": the engine pool's output differs from the layer cache's";
    }
    EXPECT_EQ(arms.engine.kv_len(), sizes.block_sparse_prompt + 3);
  }
}

void check_engine_paged_dsa(Device device, const EnginePagedSizes& sizes) {
  std::mt19937_64 rng(777);
  const int32_t batch = 2;
  const DsaConfig config = dsa_config(sizes.dsa_topk);
  for (const int64_t prompt : {sizes.dsa_short_prompt, sizes.dsa_long_prompt}) {  // below and above index_topk
    DsaArms arms(device, batch, 16, rng, always_fuse(), /*fp8_pool=*/false, config);
    arms.prompt(prompt, rng);
    for (int s = 0; s < 3; ++s) {
      const auto out = arms.step(rng);
      ASSERT_TRUE(out.dense_step.fused) << out.dense_step.outcome.reason;
      ASSERT_TRUE(out.engine_step.fused) << out.engine_step.outcome.reason;
      EXPECT_EQ(out.engine_step.sparse, prompt + s + 1 > config.index_topk);
      EXPECT_EQ(arms.engine.last_selected_positions(), arms.dense.last_selected_positions())
          << "prompt " << prompt << ", step " << s;
      ASSERT_FALSE(has_nan(out.engine_o)) << "prompt " << prompt << ", step " << s;
      EXPECT_TRUE(out.engine_o == out.dense_o)
          << "prompt " << prompt << ", step " << s << ": the engine pool's output differs from the layer cache's";
    }
  }
}

void check_engine_paged_dsa_fp8(Device device, const EnginePagedSizes& sizes) {
  // 16 query heads: one head tile, so the one-CTA FP8 kernel (no CTA pair).
  const std::string cuda_fp8_mla_kernel = "MLA FP8 (656-byte rows), wgmma, warp-specialized";
  std::mt19937_64 rng(4711);
  const int32_t batch = 2;
  const DsaConfig config = dsa_config(sizes.dsa_topk);
  for (const int64_t prompt : {sizes.dsa_short_prompt, sizes.dsa_long_prompt}) {  // below and above index_topk
    DsaArms arms(device, batch, 16, rng, always_fuse(), /*fp8_pool=*/true, config);
    arms.prompt(prompt, rng);
    for (int s = 0; s < 3; ++s) {
      const auto out = arms.step(rng);
      const std::string at = "prompt " + std::to_string(prompt) + ", step " + std::to_string(s);
      ASSERT_TRUE(out.dense_step.fused) << out.dense_step.outcome.reason;
      ASSERT_TRUE(out.engine_step.fused) << out.engine_step.outcome.reason;
      EXPECT_EQ(std::string(out.engine_step.outcome.kernel),
                device == Device::kCuda ? cuda_fp8_mla_kernel : "CPU loop");
      EXPECT_EQ(arms.engine.last_selected_positions(), arms.dense.last_selected_positions()) << at;
      ASSERT_FALSE(has_nan(out.engine_o)) << at;
      // The same dequantized values through two kernels: equal up to the
      // order of their fp32 sums (and, on the CPU, the bf16 rounding of the
      // dense arm's cache).
      const std::vector<float> engine_o = as_float(kDt, out.engine_o), dense_o = as_float(kDt, out.dense_o);
      const std::vector<double> ref(dense_o.begin(), dense_o.end());
      EXPECT_LT(relative_l2(engine_o, ref), 5e-3) << at;
    }
  }
  // Only the MLA row formats reach the attention.
  DsaArms arms(device, 1, 16, rng, always_fuse(), /*fp8_pool=*/true, config);
  arms.prompt(sizes.dsa_misuse_prompt, rng);
  EnginePagedKV per_head = arms.kv();
  per_head.kv_format = KvFormat::kE4m3PerHead;
  const DsaArms::EngineToken token(device, rng);
  const DsaTokens t = token.tokens();
  EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t, per_head); }, "not an MLA row format"));
  EnginePagedKV short_rows = arms.kv();  // 520-byte rows cannot hold the latent bytes and the scales
  short_rows.k.row_stride = short_rows.v.row_stride = 520;
  EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t, short_rows); }, "528"));
  EXPECT_EQ(arms.engine.kv_len(), sizes.dsa_misuse_prompt) << "a refused step appended";
}

void check_engine_paged_errors(Device device, const EnginePagedSizes& sizes) {
  std::mt19937_64 rng(99);
  {
    BlockArms arms(device, 1, 64, rng, always_fuse());
    arms.prompt(sizes.block_misuse_prompt, rng);
    const int64_t before = arms.engine.kv_len();
    const Buffer q = upload(device, random_values(kDt, size_t(kBlockConfig.num_qo_heads) * 128, rng));
    const Buffer iq = upload(device, random_values(kDt, size_t(kBlockConfig.num_kv_heads) * 128, rng));
    const Buffer ik = upload(device, random_values(kDt, 128, rng));
    Buffer o = upload(device, nan_values(kDt, size_t(kBlockConfig.num_qo_heads) * 128));
    BlockSparseTokens t;
    t.q = q.data();
    t.index_q = iq.data();
    t.index_k = ik.data();
    t.o = o.data();
    EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t); }, "decode(tokens, kv)"));
    BlockSparseTokens with_k = t;
    with_k.k = ik.data();
    EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(with_k, arms.kv()); }, "k and v must be null"));
    EnginePagedKV narrow = arms.kv();
    narrow.block_table.max_blocks = 8;  // 128 positions for a 601-token window (quick: 201)
    EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t, narrow); }, "cannot hold live_len"));
    if (device == Device::kCpu) {  // a host table: an entry outside the pool is refused before the append
      EnginePagedKV bad = arms.kv();
      std::vector<int32_t> entries(bad.block_table.data,
                                   bad.block_table.data + bad.block_table.num_rows * bad.block_table.row_stride);
      entries[3] = static_cast<int32_t>(bad.block_table.num_blocks);  // inside the 601-token window
      bad.block_table.data = entries.data();
      EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t, bad); }, "entry 3 = "));
      EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t, bad); }, "is outside the pool"));
    }
    EXPECT_TRUE(throws_error_naming([&] { arms.dense.decode(t, arms.kv()); }, "kv_storage"));
    EXPECT_EQ(arms.engine.kv_len(), before) << "a refused step appended";
    // The kill switch: the dispatch declines, and there is no mask path to take.
    BlockArms killed(device, 1, 64, rng, kill_switch());
    killed.prompt(sizes.block_misuse_prompt, rng);
    EXPECT_TRUE(throws_error_naming([&] { killed.engine.decode(t, killed.kv()); }, "declined"));
    EXPECT_EQ(killed.engine.kv_len(), sizes.block_misuse_prompt) << "a declined step appended";
    EXPECT_TRUE(throws_error_naming([&] { killed.engine.prefill_token(t); }, "no mask path"));
  }
  {
    DsaArms arms(device, 1, 16, rng, kill_switch(), /*fp8_pool=*/false, dsa_config(sizes.dsa_topk));
    arms.prompt(sizes.dsa_misuse_prompt, rng);
    const DsaArms::EngineToken token(device, rng);
    const DsaTokens t = token.tokens();
    EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t, arms.kv()); }, "declined"));
    EXPECT_TRUE(throws_error_naming([&] { arms.engine.decode(t); }, "decode(tokens, kv)"));
    EXPECT_TRUE(throws_error_naming([&] { arms.dense.decode(t, arms.kv()); }, "kv_storage"));
    EXPECT_EQ(arms.engine.kv_len(), sizes.dsa_misuse_prompt) << "a refused step appended";
  }
}

}  // namespace sparsepage::testing
