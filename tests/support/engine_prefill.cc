#include "support/engine_prefill.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/fp8.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/memory.h"
#include "support/engine_pool.h"
#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr DType kDt = DType::kBF16;

DispatchConfig fused() { return always_fuse().without_performance_gates(); }

// Per slot, the rows of every position the test writes (prompt and chunk),
// `elems` values each, and a per-(slot, token) query-side field.
using SlotRows = std::vector<std::vector<float>>;

SlotRows slot_rows(std::mt19937_64& rng, const std::vector<int64_t>& total, int64_t elems) {
  SlotRows r;
  for (int64_t p : total) r.push_back(quarter_grid(rng, static_cast<size_t>(p * elems)));
  return r;
}

// Positions [from, to) of `rows` (elems each) as [to - from, elems] head-major
// when `heads` > 1 ([heads, to - from, dim]).
std::vector<float> head_major(const std::vector<float>& rows, int64_t from, int64_t to, int32_t heads, int32_t dim) {
  std::vector<float> out(static_cast<size_t>((to - from) * heads * dim));
  for (int64_t p = from; p < to; ++p)
    for (int32_t h = 0; h < heads; ++h)
      std::copy_n(rows.begin() + (p * heads + h) * dim, dim, out.begin() + ((h * (to - from)) + (p - from)) * dim);
  return out;
}

// Token-major chunk rows [n, batch, elems] of each slot's positions [len0, len0 + n).
std::vector<float> token_major(const SlotRows& rows, const std::vector<int64_t>& len0, int32_t n, int64_t elems) {
  const auto batch = static_cast<int64_t>(rows.size());
  std::vector<float> out(static_cast<size_t>(n * batch * elems), 0.0f);
  for (int64_t b = 0; b < batch; ++b) {
    if (rows[static_cast<size_t>(b)].empty()) continue;  // a free slot: not read
    for (int32_t t = 0; t < n; ++t)
      std::copy_n(rows[static_cast<size_t>(b)].begin() + (len0[static_cast<size_t>(b)] + t) * elems, elems,
                  out.begin() + (t * batch + b) * elems);
  }
  return out;
}

// Token t of a [batch, n, elems] field: [batch, elems].
std::vector<float> token_slice(const std::vector<float>& x, int32_t batch, int32_t n, int64_t elems, int32_t t) {
  std::vector<float> out(static_cast<size_t>(batch * elems));
  for (int32_t b = 0; b < batch; ++b)
    std::copy_n(x.begin() + (int64_t{b} * n + t) * elems, elems, out.begin() + b * elems);
  return out;
}

std::vector<float> slice(const std::vector<float>& x, int64_t from, int64_t count) {
  return {x.begin() + from, x.begin() + from + count};
}
std::vector<double> widen(const std::vector<float>& x) { return {x.begin(), x.end()}; }

bool has_nan(const std::vector<float>& x) {
  return std::any_of(x.begin(), x.end(), [](float v) { return std::isnan(v); });
}

// The slots' lengths before and after the chunk (a free slot: 0 and 0).
struct Lengths {
  std::vector<int64_t> before, after;
  Lengths(const EnginePrefillCase& c) {
    for (int64_t p : c.prompt) {
      before.push_back(std::max<int64_t>(p, 0));
      after.push_back(p < 0 ? 0 : p + c.num_tokens);
    }
  }
  bool active(int32_t b) const { return after[static_cast<size_t>(b)] > 0; }
};

int32_t blocks_for(const Lengths& l) {
  return static_cast<int32_t>(*std::max_element(l.after.begin(), l.after.end()) / kEngineBlock + 2);
}

// A block-sparse chunk's data, drawn from the case's seed in this order: per
// slot the engine's K and V rows and index keys, then the chunk's queries
// and index queries ([batch, n, ...]); `rng` goes on to shuffle the pool's
// table. On `device`: the queries, and the chunk's index keys token-major.
struct BlockChunk {
  Device device;
  std::mt19937_64 rng;
  int32_t batch, n, hq, hkv, d;
  Lengths len;
  SlotRows k, v, ik;
  std::vector<float> q, iq;
  Buffer q_dev, iq_dev, index_k;

  BlockChunk(Device dev, const BlockSparseConfig& cfg, const EnginePrefillCase& c)
      : device(dev),
        rng(c.seed),
        batch(static_cast<int32_t>(c.prompt.size())),
        n(c.num_tokens),
        hq(cfg.num_qo_heads),
        hkv(cfg.num_kv_heads),
        d(cfg.head_dim),
        len(c),
        k(slot_rows(rng, len.after, int64_t{hkv} * d)),
        v(slot_rows(rng, len.after, int64_t{hkv} * d)),
        ik(slot_rows(rng, len.after, d)),
        q(quarter_grid(rng, static_cast<size_t>(int64_t{batch} * n * hq * d))),
        iq(quarter_grid(rng, static_cast<size_t>(int64_t{batch} * n * hkv * d))),
        q_dev(to_device(device, kDt, q)),
        iq_dev(to_device(device, kDt, iq)),
        index_k(to_device(device, kDt, token_major(ik, len.before, n, d))) {}
  size_t o_count() const { return static_cast<size_t>(int64_t{batch} * n * hq * d); }
  // The chunk's tokens over an engine's pools, writing o (k and v null).
  BlockSparseTokens tokens(Buffer& o, const void* index_key = nullptr) const {
    BlockSparseTokens t;
    t.q = q_dev.data();
    t.index_q = iq_dev.data();
    t.o = o.data();
    t.index_k = index_key;
    return t;
  }
};

}  // namespace

// ---------------------------------------------------------------- block-sparse

void check_engine_paged_block_prefill(Device device, const BlockSparseConfig& cfg, const EnginePrefillCase& c) {
  BlockChunk data(device, cfg, c);
  const int32_t batch = data.batch, n = data.n, hq = data.hq, hkv = data.hkv, d = data.d;
  const Lengths& len = data.len;
  const SlotRows &k = data.k, &v = data.v, &ik = data.ik;
  const std::vector<float>&q = data.q, &iq = data.iq;

  BlockSparseConfig own_cfg = cfg, engine_cfg = cfg;
  own_cfg.kv_storage = KVStorage::kLayerCache;
  engine_cfg.kv_storage = KVStorage::kEnginePaged;
  BlockSparseAttention own(device, kDt, own_cfg, batch, fused());
  BlockSparseAttention engine(device, kDt, engine_cfg, batch, fused());
  BlockSparseAttention twin(device, kDt, engine_cfg, batch, fused());  // the token-by-token oracle
  EnginePool pool(device, batch, blocks_for(len), int64_t{hkv} * d, 2, data.rng);
  for (int32_t b = 0; b < batch; ++b) {
    if (!len.active(b)) {
      for (SparseLayer* layer :
           {static_cast<SparseLayer*>(&own), static_cast<SparseLayer*>(&engine), static_cast<SparseLayer*>(&twin)})
        layer->release(b);
      continue;
    }
    const int64_t l0 = len.before[size_t(b)];
    // The own cache's K rows: the attention heads, then the index key at head hkv.
    std::vector<float> own_k = head_major(k[size_t(b)], 0, l0, hkv, d);
    const std::vector<float> keys = head_major(ik[size_t(b)], 0, l0, 1, d);
    own_k.insert(own_k.end(), keys.begin(), keys.end());
    const Buffer k_dev = to_device(device, kDt, own_k),
                 v_dev = to_device(device, kDt, head_major(v[size_t(b)], 0, l0, hkv, d));
    const Buffer ik_dev = to_device(device, kDt, keys);
    own.admit(b, k_dev.data(), v_dev.data(), l0);
    engine.admit(b, ik_dev.data(), nullptr, l0);
    twin.admit(b, ik_dev.data(), nullptr, l0);
    // The engine writes every row of the prompt and the chunk before the chunk.
    for (int64_t p = 0; p < len.after[size_t(b)]; ++p) {
      pool.write(0, b, p, k[size_t(b)].data() + p * hkv * d);
      pool.write(1, b, p, v[size_t(b)].data() + p * hkv * d);
    }
  }
  const EnginePagedKV kv = pool.kv(d, hkv);

  // The chunk: the own cache's k token-major [n, batch, hkv + 1, 1, d] (K heads, then the index key).
  SlotRows own_rows(static_cast<size_t>(batch));
  for (int32_t b = 0; b < batch; ++b) {
    if (!len.active(b)) continue;
    for (int64_t p = 0; p < len.after[size_t(b)]; ++p) {
      auto& r = own_rows[size_t(b)];
      r.insert(r.end(), k[size_t(b)].begin() + p * hkv * d, k[size_t(b)].begin() + (p + 1) * hkv * d);
      r.insert(r.end(), ik[size_t(b)].begin() + p * d, ik[size_t(b)].begin() + (p + 1) * d);
    }
  }
  const size_t o_count = data.o_count();
  const Buffer own_k = to_device(device, kDt, token_major(own_rows, len.before, n, int64_t{hkv + 1} * d));
  const Buffer own_v = to_device(device, kDt, token_major(v, len.before, n, int64_t{hkv} * d));
  Buffer own_o = poisoned(device, o_count), engine_o = poisoned(device, o_count);
  own.prefill({data.q_dev.data(), data.iq_dev.data(), own_k.data(), own_v.data(), own_o.data()}, n);
  engine.prefill(data.tokens(engine_o, data.index_k.data()), kv, n);
  engine.check_errors();
  EXPECT_EQ(engine.kv_lens(), own.kv_lens());
  EXPECT_EQ(engine.kv_lens(), len.after);

  const auto positions = engine.last_prefill_positions();
  ASSERT_EQ(positions, own.last_prefill_positions()) << "the engine form kept other positions than the own cache";
  const std::vector<float> got = read_bf16(device, engine_o, o_count), mine = read_bf16(device, own_o, o_count);
  const int64_t row = int64_t{hq} * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // The same positions either way. On the CPU both forms run one loop; on
  // CUDA the engine form runs the engine-input kernel (16-row tiles) and the
  // own cache the multi-token one (64-row tiles), so P and o are rounded to
  // bf16 from sums taken in another order (up to 3.3e-3 relative L2 on the
  // H200): there the bound is the bf16 one every fused path meets.
  const double own_tolerance = device == Device::kCuda ? 1e-2 : 1e-3;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const int64_t at = (int64_t{b} * n + t) * row;
      const std::vector<float> o = slice(got, at, row);
      if (!len.active(b)) {
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.0f; })) << "free slot " << b;
        continue;
      }
      ASSERT_FALSE(has_nan(o)) << "slot " << b << " token " << t;
      EXPECT_LT(relative_l2(o, widen(slice(mine, at, row))), own_tolerance)
          << "slot " << b << " token " << t << " vs own cache";
      // fp64 over the positions the chunk reports.
      const int64_t pos = len.before[size_t(b)] + t;
      std::vector<double> ref(static_cast<size_t>(row), 0.0);
      for (int32_t h = 0; h < hq; ++h) {
        const auto& set = positions[static_cast<size_t>((int64_t{b} * n + t) * hq + h)];
        ASSERT_FALSE(set.empty());
        const int32_t kvh = h / (hq / hkv);
        std::vector<double> scores;
        for (int32_t p : set) {
          ASSERT_LE(p, pos) << "a position past the token's own";
          double s = 0;
          for (int32_t i = 0; i < d; ++i)
            s += double{q[size_t(at + int64_t{h} * d + i)]} * k[size_t(b)][size_t((int64_t{p} * hkv + kvh) * d + i)];
          scores.push_back(s * scale);
        }
        softmax_weighted_sum(
            scores, d,
            [&](size_t j, int64_t i) { return double{v[size_t(b)][size_t((int64_t{set[j]} * hkv + kvh) * d + i)]}; },
            ref.data() + int64_t{h} * d);
      }
      EXPECT_LT(relative_l2(o, ref), 1e-2) << "slot " << b << " token " << t << " vs fp64";
    }
  }

  // Token by token through the engine-paged decode: in the dense regime a
  // one-token step keeps the whole window, as the chunk's query block does.
  const int64_t dense_len = int64_t{2} * cfg.topk_blocks * cfg.block_size;
  for (int32_t t = 0; t < n; ++t) {
    const Buffer qt = to_device(device, kDt, token_slice(q, batch, n, row, t));
    const Buffer iqt = to_device(device, kDt, token_slice(iq, batch, n, int64_t{hkv} * d, t));
    std::vector<float> keys(static_cast<size_t>(int64_t{batch} * d), 0.0f);
    for (int32_t b = 0; b < batch; ++b) {
      if (len.active(b))
        std::copy_n(ik[size_t(b)].begin() + (len.before[size_t(b)] + t) * d, d, keys.begin() + int64_t{b} * d);
    }
    const Buffer ikt = to_device(device, kDt, keys);
    Buffer ot = poisoned(device, static_cast<size_t>(int64_t{batch} * row));
    BlockSparseTokens one;
    one.q = qt.data();
    one.index_q = iqt.data();
    one.index_k = ikt.data();
    one.o = ot.data();
    twin.decode(one, kv);
    const auto selected = twin.last_selected_positions();
    const std::vector<float> o = read_bf16(device, ot, static_cast<size_t>(int64_t{batch} * row));
    for (int32_t b = 0; b < batch; ++b) {
      if (!len.active(b) || len.before[size_t(b)] + t + 1 > dense_len) continue;
      for (int32_t h = 0; h < hq; ++h) {
        EXPECT_EQ(positions[static_cast<size_t>((int64_t{b} * n + t) * hq + h)],
                  selected[static_cast<size_t>(int64_t{b} * hkv + h / (hq / hkv))])
            << "slot " << b << " token " << t << " head " << h;
      }
      EXPECT_LT(relative_l2(slice(o, int64_t{b} * row, row), widen(slice(got, (int64_t{b} * n + t) * row, row))), 1e-2)
          << "slot " << b << " token " << t << " vs decode";
    }
  }
}

// ---------------------------------------------------------------- DSA

namespace {

// The 656-byte FP8 MLA row (fp8.h) of `row` (latent then rope), and the
// values a reader takes from it: the latent e4m3 byte times its block's
// scale (CUDA rounds that to bf16 before its tensor cores read it; the CPU
// backend keeps it exact: docs/RELIABILITY.md, "FP8 MLA rounding"), the
// rope as written.
std::vector<uint8_t> fp8_row(const float* row) {
  std::vector<uint8_t> bf16(size_t{MlaFp8Row::kLatent + MlaFp8Row::kRope} * 2), out(MlaFp8Row::kBytes);
  from_float(kDt, row, bf16.data(), MlaFp8Row::kLatent + MlaFp8Row::kRope);
  quantize_mla_fp8_cpu(kDt, bf16.data(), 1, MlaFp8Row::kLatent + MlaFp8Row::kRope, out.data());
  return out;
}
void dequantize(Device device, const std::vector<uint8_t>& fp8, const float* row, float* out) {
  for (int32_t i = 0; i < MlaFp8Row::kLatent; ++i) {
    float scale = 0.0f;
    std::memcpy(&scale, &fp8[size_t(MlaFp8Row::kScaleOffset + 4 * (i / MlaFp8Row::kBlock))], 4);
    const float x = e4m3_to_float(fp8[size_t(i)]) * scale;
    out[i] = device == Device::kCuda ? bf16_to_float(float_to_bf16(x)) : x;
  }
  std::copy_n(row + MlaFp8Row::kLatent, MlaFp8Row::kRope, out + MlaFp8Row::kLatent);
}

// A DSA chunk's data, drawn from the case's seed in this order: per slot
// the engine's MLA rows (latent then rope) and index keys, then the chunk's
// queries, rope queries, index queries and weights ([batch, n, ...]); `rng`
// goes on to shuffle the pool's table. On `device`: the queries, and the
// chunk's index keys token-major.
struct DsaChunk {
  std::mt19937_64 rng;
  int32_t batch, n, h, dl, dr, ih, id;
  Lengths len;
  SlotRows mla, ik;
  int64_t q_row, pe_row, iq_row;
  std::vector<float> q, q_pe, iq, w;
  Buffer q_dev, pe_dev, iq_dev, w_dev, index_k;

  DsaChunk(Device device, const DsaConfig& cfg, const EnginePrefillCase& c)
      : rng(c.seed),
        batch(static_cast<int32_t>(c.prompt.size())),
        n(c.num_tokens),
        h(cfg.num_qo_heads),
        dl(cfg.latent_dim),
        dr(cfg.rope_dim),
        ih(cfg.index_heads),
        id(cfg.index_head_dim),
        len(c),
        mla(slot_rows(rng, len.after, dl + dr)),
        ik(slot_rows(rng, len.after, id)),
        q_row(int64_t{h} * dl),
        pe_row(int64_t{h} * dr),
        iq_row(int64_t{ih} * id),
        q(quarter_grid(rng, static_cast<size_t>(batch * n * q_row))),
        q_pe(quarter_grid(rng, static_cast<size_t>(batch * n * pe_row))),
        iq(quarter_grid(rng, static_cast<size_t>(batch * n * iq_row))),
        w(quarter_grid(rng, static_cast<size_t>(int64_t{batch} * n * ih))),
        q_dev(to_device(device, kDt, q)),
        pe_dev(to_device(device, kDt, q_pe)),
        iq_dev(to_device(device, kDt, iq)),
        w_dev(to_device(device, DType::kF32, w)),
        index_k(to_device(device, kDt, token_major(ik, len.before, n, id))) {}
  size_t o_count() const { return static_cast<size_t>(batch * n * q_row); }
  // The engine's pool of bf16 MLA rows, or (fp8) of the 656-byte FP8 rows
  // with every byte 0xFF (e4m3, fp32 scale and bf16 rope NaN alike) until written.
  EnginePool pool(Device device, bool fp8) {
    EnginePool p(device, batch, blocks_for(len), fp8 ? MlaFp8Row::kBytes / 2 : dl + dr, 1, rng);
    if (fp8) fill_bytes(p.pools[0].data(), device, 0xFF, p.pools[0].bytes());
    return p;
  }
  // The chunk's tokens over an engine's pool, writing o (k_cache_row and k_pe null).
  DsaTokens tokens(void* o, const void* index_key = nullptr) const {
    return DsaTokens{q_dev.data(), pe_dev.data(), iq_dev.data(), w_dev.as<float>(), nullptr, nullptr, o, index_key};
  }
};

// The DSA checks over a bf16 pool or (fp8) the engines' 656-byte FP8 rows.
// Over FP8 rows the own cache holds other values (the bf16 rows), so only
// its positions are compared; the outputs are checked against fp64 over
// the dequantized rows and the token-by-token decode over the same pool.
void check_dsa_prefill(Device device, const DsaConfig& cfg, const EnginePrefillCase& c, bool fp8) {
  DsaChunk data(device, cfg, c);
  const int32_t batch = data.batch, n = data.n, h = data.h, dl = data.dl, dr = data.dr, ih = data.ih, id = data.id;
  const Lengths& len = data.len;
  const SlotRows &mla = data.mla, &ik = data.ik;
  const std::vector<float>&q = data.q, &q_pe = data.q_pe, &iq = data.iq, &w = data.w;
  const int64_t q_row = data.q_row, pe_row = data.pe_row, iq_row = data.iq_row;

  DsaConfig own_cfg = cfg, engine_cfg = cfg;
  own_cfg.kv_storage = KVStorage::kLayerCache;
  engine_cfg.kv_storage = KVStorage::kEnginePaged;
  DsaAttention own(device, kDt, own_cfg, batch, fused());
  DsaAttention engine(device, kDt, engine_cfg, batch, fused());
  DsaAttention twin(device, kDt, engine_cfg, batch, fused());
  EnginePool pool = data.pool(device, fp8);
  // The own cache's rows: K = latent then index key, V = rope.
  SlotRows own_k(static_cast<size_t>(batch)), own_v(static_cast<size_t>(batch));
  SlotRows read = mla;  // the values the attention reads: over FP8 rows, dequantized
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p < len.after[size_t(b)]; ++p) {
      const float* r = mla[size_t(b)].data() + p * (dl + dr);
      own_k[size_t(b)].insert(own_k[size_t(b)].end(), r, r + dl);
      own_k[size_t(b)].insert(own_k[size_t(b)].end(), ik[size_t(b)].begin() + p * id,
                              ik[size_t(b)].begin() + (p + 1) * id);
      own_v[size_t(b)].insert(own_v[size_t(b)].end(), r + dl, r + dl + dr);
      if (!fp8) {
        pool.write(0, b, p, r);
        continue;
      }
      const std::vector<uint8_t> bytes = fp8_row(r);
      pool.write_bytes(0, b, p, bytes.data());
      dequantize(device, bytes, r, read[size_t(b)].data() + p * (dl + dr));
    }
  }
  for (int32_t b = 0; b < batch; ++b) {
    if (!len.active(b)) {
      for (SparseLayer* layer :
           {static_cast<SparseLayer*>(&own), static_cast<SparseLayer*>(&engine), static_cast<SparseLayer*>(&twin)})
        layer->release(b);
      continue;
    }
    const int64_t l0 = len.before[size_t(b)];
    const Buffer k_dev = to_device(device, kDt, slice(own_k[size_t(b)], 0, l0 * (dl + id)));
    const Buffer v_dev = to_device(device, kDt, slice(own_v[size_t(b)], 0, l0 * dr));
    const Buffer ik_dev = to_device(device, kDt, slice(ik[size_t(b)], 0, l0 * id));
    own.admit(b, k_dev.data(), v_dev.data(), l0);
    engine.admit(b, ik_dev.data(), nullptr, l0);
    twin.admit(b, ik_dev.data(), nullptr, l0);
  }
  const EnginePagedKV kv = pool.mla_kv(dl, dr, fp8);

  const size_t o_count = data.o_count();
  const Buffer k_chunk = to_device(device, kDt, token_major(own_k, len.before, n, dl + id));
  const Buffer v_chunk = to_device(device, kDt, token_major(own_v, len.before, n, dr));
  Buffer own_o = poisoned(device, o_count), engine_o = poisoned(device, o_count);
  DsaTokens ot = data.tokens(own_o.data());
  ot.k_cache_row = k_chunk.data();
  ot.k_pe = v_chunk.data();
  own.prefill(ot, n);
  engine.prefill(data.tokens(engine_o.data(), data.index_k.data()), kv, n);
  engine.check_errors();
  EXPECT_EQ(engine.kv_lens(), own.kv_lens());
  EXPECT_EQ(engine.kv_lens(), len.after);

  const auto positions = engine.last_prefill_positions();
  ASSERT_EQ(positions, own.last_prefill_positions()) << "the engine form kept other positions than the own cache";
  const std::vector<float> got = read_bf16(device, engine_o, o_count), mine = read_bf16(device, own_o, o_count);
  const double scale = own.config().scale;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const int64_t r = int64_t{b} * n + t;
      const std::vector<float> o = slice(got, r * q_row, q_row);
      if (!len.active(b)) {
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.0f; })) << "free slot " << b;
        continue;
      }
      ASSERT_FALSE(has_nan(o)) << "slot " << b << " token " << t;
      if (!fp8) {
        EXPECT_LT(relative_l2(o, widen(slice(mine, r * q_row, q_row))), 1e-3) << "slot " << b << " token " << t;
      }
      const int64_t pos = len.before[size_t(b)] + t;
      const auto& set = positions[static_cast<size_t>(r)];
      ASSERT_FALSE(set.empty());
      ASSERT_LE(static_cast<int64_t>(set.size()), int64_t{cfg.index_topk});
      std::vector<double> ref(static_cast<size_t>(q_row), 0.0);
      for (int32_t head = 0; head < h; ++head) {
        std::vector<double> scores;
        for (int32_t p : set) {
          ASSERT_LE(p, pos);
          const float* row = read[size_t(b)].data() + int64_t{p} * (dl + dr);
          double s = 0;
          for (int32_t i = 0; i < dl; ++i) s += double{q[size_t(r * q_row + int64_t{head} * dl + i)]} * row[i];
          for (int32_t i = 0; i < dr; ++i) s += double{q_pe[size_t(r * pe_row + int64_t{head} * dr + i)]} * row[dl + i];
          scores.push_back(s * scale);
        }
        softmax_weighted_sum(
            scores, dl,
            [&](size_t j, int64_t i) { return double{read[size_t(b)][size_t(int64_t{set[j]} * (dl + dr) + i)]}; },
            ref.data() + int64_t{head} * dl);
      }
      EXPECT_LT(relative_l2(o, ref), 1e-2) << "slot " << b << " token " << t << " vs fp64";
    }
  }

  // Token by token through the engine-paged decode: the DSA prefill keeps
  // each token what a one-token step at its position keeps.
  for (int32_t t = 0; t < n; ++t) {
    const Buffer qt = to_device(device, kDt, token_slice(q, batch, n, q_row, t));
    const Buffer pet = to_device(device, kDt, token_slice(q_pe, batch, n, pe_row, t));
    const Buffer iqt = to_device(device, kDt, token_slice(iq, batch, n, iq_row, t));
    const Buffer wt = to_device(device, DType::kF32, token_slice(w, batch, n, ih, t));
    std::vector<float> keys(static_cast<size_t>(int64_t{batch} * id), 0.0f);
    for (int32_t b = 0; b < batch; ++b) {
      if (len.active(b))
        std::copy_n(ik[size_t(b)].begin() + (len.before[size_t(b)] + t) * id, id, keys.begin() + int64_t{b} * id);
    }
    const Buffer ikt = to_device(device, kDt, keys);
    Buffer o_t = poisoned(device, static_cast<size_t>(batch * q_row));
    twin.decode(DsaTokens{qt.data(), pet.data(), iqt.data(), wt.as<float>(), nullptr, nullptr, o_t.data(), ikt.data()},
                kv);
    const auto selected = twin.last_selected_positions();
    const std::vector<float> o = read_bf16(device, o_t, static_cast<size_t>(batch * q_row));
    for (int32_t b = 0; b < batch; ++b) {
      if (!len.active(b)) continue;
      const int64_t r = int64_t{b} * n + t;
      std::vector<int32_t> sel = selected[static_cast<size_t>(b)];
      std::sort(sel.begin(), sel.end());
      EXPECT_EQ(positions[static_cast<size_t>(r)], sel) << "slot " << b << " token " << t;
      EXPECT_LT(relative_l2(slice(o, int64_t{b} * q_row, q_row), widen(slice(got, r * q_row, q_row))), 1e-2)
          << "slot " << b << " token " << t << " vs decode";
    }
  }
}

}  // namespace

void check_engine_paged_dsa_prefill(Device device, const DsaConfig& cfg, const EnginePrefillCase& c) {
  check_dsa_prefill(device, cfg, c, false);
}
void check_engine_paged_dsa_prefill_fp8(Device device, const DsaConfig& cfg, const EnginePrefillCase& c) {
  check_dsa_prefill(device, cfg, c, true);
}

void check_engine_pools_dsa_prefill(Device device, const DsaConfig& cfg, const EnginePrefillCase& c, bool fp8_keys,
                                    bool fp8_rows) {
  DsaChunk data(device, cfg, c);
  const int32_t batch = data.batch, n = data.n, dl = data.dl, dr = data.dr, id = data.id;
  const Lengths& len = data.len;
  const SlotRows &mla = data.mla, &ik = data.ik;
  const int64_t q_row = data.q_row;

  DsaConfig paged_cfg = cfg, pools_cfg = cfg;
  paged_cfg.kv_storage = KVStorage::kEnginePaged;
  pools_cfg.kv_storage = KVStorage::kEnginePools;
  DsaAttention paged(device, kDt, paged_cfg, batch, fused());  // the oracle: the layer keeps the keys
  DsaAttention pools(device, kDt, pools_cfg, batch, fused());
  EnginePool pool = data.pool(device, fp8_rows);
  EngineKeys keys(pool, fp8_keys, id);
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p < len.after[size_t(b)]; ++p) {
      const float* r = mla[size_t(b)].data() + p * (dl + dr);
      if (fp8_rows) {
        pool.write_bytes(0, b, p, fp8_row(r).data());
      } else {
        pool.write(0, b, p, r);
      }
      keys.write(b, p, ik[size_t(b)].data() + p * id);
    }
    if (!len.active(b)) {
      paged.release(b);
      continue;
    }
    const Buffer ik_dev = to_device(device, kDt, slice(ik[size_t(b)], 0, len.before[size_t(b)] * id));
    paged.admit(b, ik_dev.data(), nullptr, len.before[size_t(b)]);
  }
  const EnginePagedKV kv = pool.mla_kv(dl, dr, fp8_rows);
  // The pools form: the keys and the lengths (with the chunk; 0 free) the engine's, a bound above them.
  const std::vector<int32_t> lens32(len.after.begin(), len.after.end());
  const EnginePagedKV pkv = keys.pools_kv(kv, lens32, *std::max_element(len.after.begin(), len.after.end()) + 3);

  const size_t o_count = data.o_count();
  Buffer paged_o = poisoned(device, o_count), pools_o = poisoned(device, o_count);
  paged.prefill(data.tokens(paged_o.data(), data.index_k.data()), kv, n);
  const DsaTokens pt = data.tokens(pools_o.data());

  // Refused by name, nothing written: a chunk with index_k, no lengths, a length below the chunk.
  DsaTokens with_key = pt;
  with_key.index_k = data.index_k.data();
  EXPECT_TRUE(throws_error_naming([&] { pools.prefill(with_key, pkv, n); }, "index_k must be null"));
  EnginePagedKV no_lens = pkv;
  no_lens.seq_lens = nullptr;
  EXPECT_TRUE(throws_error_naming([&] { pools.prefill(pt, no_lens, n); }, "kv.seq_lens"));
  const int32_t first_active = static_cast<int32_t>(
      std::find_if(len.after.begin(), len.after.end(), [](int64_t x) { return x > 0; }) - len.after.begin());
  std::vector<int32_t> short_lens = lens32;
  short_lens[size_t(first_active)] = n - 1;
  const Buffer short_dev = upload(device, short_lens);
  EnginePagedKV too_short = pkv;
  too_short.seq_lens = short_dev.as<int32_t>();
  EXPECT_TRUE(throws_error_naming([&] { pools.prefill(pt, too_short, n); },
                                  "kv.seq_lens[" + std::to_string(first_active) + "] = " + std::to_string(n - 1)));
  const std::vector<float> untouched = read_bf16(device, pools_o, o_count);
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float x) { return std::isnan(x); }))
      << "a refused chunk wrote o";

  pools.prefill(pt, pkv, n);
  pools.check_errors();
  paged.check_errors();
  EXPECT_EQ(pools.kv_lens(), std::vector<int64_t>(size_t(batch), 0)) << "an engine-pools layer keeps no lengths";
  const auto positions = pools.last_prefill_positions();
  ASSERT_EQ(positions.size(), size_t(batch) * size_t(n));
  // The keys are multiples of 1/4 and so are the FP8 blocks' (exact at their
  // power-of-two scales): the scores, and so the sets, are the bf16 ones.
  EXPECT_EQ(positions, paged.last_prefill_positions()) << "the pools form kept other positions than the engine-paged";
  const std::vector<float> got = read_bf16(device, pools_o, o_count), want = read_bf16(device, paged_o, o_count);
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const int64_t r = int64_t{b} * n + t;
      const std::vector<float> o = slice(got, r * q_row, q_row);
      if (!len.active(b)) {
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.0f; })) << "free slot " << b;
        EXPECT_TRUE(positions[size_t(r)].empty());
        continue;
      }
      ASSERT_FALSE(has_nan(o)) << "slot " << b << " token " << t;
      EXPECT_EQ(int64_t(positions[size_t(r)].size()), std::min<int64_t>(cfg.index_topk, len.before[size_t(b)] + t + 1));
      EXPECT_LT(relative_l2(o, widen(slice(want, r * q_row, q_row))), 1e-3) << "slot " << b << " token " << t;
    }
  }

  // A key block id outside the pool is judged where it is read (on the
  // device): flagged, and the tokens that needed it (windows past the
  // top-k) select nothing, their outputs zero; the other tokens keep
  // their answers.
  std::vector<int32_t> bad_table = pool.table;
  bad_table[size_t(int64_t{first_active} * pool.max_blocks)] = static_cast<int32_t>(pool.num_blocks);
  const Buffer bad_dev = upload(device, bad_table);
  EnginePagedKV bad = pkv;
  bad.index_keys.block_table = bad_dev.as<int32_t>();
  Buffer bad_o = poisoned(device, o_count);
  DsaTokens bt = pt;
  bt.o = bad_o.data();
  pools.prefill(bt, bad, n);
  const bool scored = len.after[size_t(first_active)] > cfg.index_topk;  // some token of the slot read its keys
  if (scored) {
    EXPECT_TRUE(throws_error_naming([&] { pools.check_errors(); }, "a block id outside the index-key pool"));
  } else {
    EXPECT_NO_THROW(pools.check_errors()) << "no token read a key";
  }
  const std::vector<float> flagged = read_bf16(device, bad_o, o_count);
  for (int32_t b = 0; b < batch; ++b) {
    if (!len.active(b)) continue;
    for (int32_t t = 0; t < n; ++t) {
      const int64_t r = int64_t{b} * n + t;
      const std::vector<float> o = slice(flagged, r * q_row, q_row);
      if (b == first_active && len.before[size_t(b)] + t + 1 > cfg.index_topk) {
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.0f; }))
            << "slot " << b << " token " << t << " read a refused key block";
      } else {
        EXPECT_EQ(o, slice(got, r * q_row, q_row)) << "slot " << b << " token " << t;
      }
    }
  }
}

namespace {

// The block-sparse chunk over engine-owned pools on one device: the
// engine's K/V pools and index keys (bf16, or vLLM's FP8 blocks) through a
// shuffled table, every unwritten row NaN, its lengths with the chunk (0:
// free) under a looser bound, and the engine-paged twin over the same K/V
// rows (the layer keeping the keys). The same seed gives the same data on
// either device.
struct BlockPools : BlockChunk {
  std::unique_ptr<BlockSparseAttention> paged, pools;
  std::unique_ptr<EnginePool> pool;
  std::unique_ptr<EngineKeys> keys;
  EnginePagedKV kv, pkv;

  BlockPools(Device dev, const BlockSparseConfig& cfg, const EnginePrefillCase& c, bool fp8_keys)
      : BlockChunk(dev, cfg, c) {
    BlockSparseConfig paged_cfg = cfg, pools_cfg = cfg;
    paged_cfg.kv_storage = KVStorage::kEnginePaged;
    pools_cfg.kv_storage = KVStorage::kEnginePools;
    paged = std::make_unique<BlockSparseAttention>(device, kDt, paged_cfg, batch, fused());
    pools = std::make_unique<BlockSparseAttention>(device, kDt, pools_cfg, batch, fused());
    pool = std::make_unique<EnginePool>(device, batch, blocks_for(len), int64_t{hkv} * d, 2, rng);
    keys = std::make_unique<EngineKeys>(*pool, fp8_keys, d);
    for (int32_t b = 0; b < batch; ++b) {
      for (int64_t p = 0; p < len.after[size_t(b)]; ++p) {
        pool->write(0, b, p, k[size_t(b)].data() + p * hkv * d);
        pool->write(1, b, p, v[size_t(b)].data() + p * hkv * d);
        keys->write(b, p, ik[size_t(b)].data() + p * d);
      }
      if (!len.active(b)) {
        paged->release(b);
        continue;
      }
      const Buffer ik_dev = to_device(device, kDt, slice(ik[size_t(b)], 0, len.before[size_t(b)] * d));
      paged->admit(b, ik_dev.data(), nullptr, len.before[size_t(b)]);
    }
    kv = pool->kv(d, hkv);
    const std::vector<int32_t> lens32(len.after.begin(), len.after.end());
    pkv = keys->pools_kv(kv, lens32, *std::max_element(len.after.begin(), len.after.end()) + 5);
  }
  // The pools chunk into a NaN-poisoned output (checked, no error flagged).
  std::vector<float> run_pools() {
    Buffer o = poisoned(device, o_count());
    pools->prefill(tokens(o), pkv, n);
    pools->check_errors();
    return read_bf16(device, o, o_count());
  }
};

}  // namespace

void check_engine_pools_block_prefill(Device device, const BlockSparseConfig& cfg, const EnginePrefillCase& c,
                                      bool fp8_keys) {
  BlockPools s(device, cfg, c, fp8_keys);
  const int32_t batch = s.batch, n = s.n, hq = s.hq, d = s.d;
  const Lengths& len = s.len;
  const size_t o_count = s.o_count();
  Buffer paged_o = poisoned(device, o_count), pools_o = poisoned(device, o_count);
  const BlockSparseTokens pt = s.tokens(pools_o);
  BlockSparseTokens et = s.tokens(paged_o);
  et.index_k = s.index_k.data();
  s.paged->prefill(et, s.kv, n);
  s.paged->check_errors();

  // A chunk off the block grid (the engine's lengths one longer) is refused by name, o untouched.
  std::vector<int32_t> off(len.after.begin(), len.after.end());
  for (int32_t& x : off) x = x > 0 ? x + 1 : 0;
  const Buffer off_dev = upload(device, off);
  EnginePagedKV misaligned = s.pkv;
  misaligned.seq_lens = off_dev.as<int32_t>();
  EXPECT_TRUE(throws_error_naming([&] { s.pools->prefill(pt, misaligned, n); }, "not a multiple of block_size"));
  const std::vector<float> untouched = read_bf16(device, pools_o, o_count);
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float x) { return std::isnan(x); }));

  s.pools->prefill(pt, s.pkv, n);
  s.pools->check_errors();
  const auto positions = s.pools->last_prefill_positions();
  ASSERT_EQ(positions.size(), size_t(batch) * size_t(n) * size_t(hq));
  EXPECT_EQ(positions, s.paged->last_prefill_positions())
      << "the pools form kept other positions than the engine-paged";
  const std::vector<float> got = read_bf16(device, pools_o, o_count), want = read_bf16(device, paged_o, o_count);
  const int64_t row = int64_t{hq} * d;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const int64_t at = (int64_t{b} * n + t) * row;
      const std::vector<float> o = slice(got, at, row);
      if (!len.active(b)) {
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.0f; })) << "free slot " << b;
        continue;
      }
      ASSERT_FALSE(has_nan(o)) << "slot " << b << " token " << t;
      EXPECT_LT(relative_l2(o, widen(slice(want, at, row))), 1e-3) << "slot " << b << " token " << t;
    }
  }
  if (device == Device::kCuda) {  // the CPU twin over copies of the same pools
    BlockPools twin(Device::kCpu, cfg, c, fp8_keys);
    const std::vector<float> cpu = twin.run_pools();
    EXPECT_EQ(positions, twin.pools->last_prefill_positions()) << "the CUDA pools form kept other positions";
    for (int32_t b = 0; b < batch; ++b) {
      for (int32_t t = 0; t < n && len.active(b); ++t) {
        const int64_t at = (int64_t{b} * n + t) * row;
        EXPECT_LT(relative_l2(slice(got, at, row), widen(slice(cpu, at, row))), 1e-2) << "slot " << b << " token " << t;
      }
    }
  }

  // A key block id outside the pool that the block scores read, in the
  // first active slot or the last (after a free slot's rows and the other
  // slots'). The CPU refuses it by the layer's name before o is written (a
  // host table). CUDA judges it where it is read: flagged (check_errors()
  // names it), the lists that needed it in the sparse regime select
  // nothing (their rows zero), the dense-regime lists and the other slots
  // keep their answers.
  std::vector<int32_t> actives;
  for (int32_t b = 0; b < batch; ++b)
    if (len.active(b)) actives.push_back(b);
  for (const int32_t b : {actives.front(), actives.back()}) {
    const int64_t start = len.after[size_t(b)] - n, blocks = (n + cfg.block_size - 1) / cfg.block_size;
    const int64_t scored_end = std::max<int64_t>(0, start / cfg.block_size + blocks - cfg.local_blocks);
    if (scored_end == 0) continue;  // the scores read no key of this slot
    std::vector<int32_t> bad_table = s.pool->table;
    bad_table[size_t(int64_t{b} * s.pool->max_blocks)] = static_cast<int32_t>(s.pool->num_blocks);
    const Buffer bad_dev = upload(device, bad_table);
    EnginePagedKV bad = s.pkv;
    bad.index_keys.block_table = bad_dev.as<int32_t>();
    Buffer bad_o = poisoned(device, o_count);
    const BlockSparseTokens bt = s.tokens(bad_o);
    if (device == Device::kCpu) {
      EXPECT_TRUE(throws_error_naming([&] { s.pools->prefill(bt, bad, n); },
                                      "BlockSparseAttention::prefill(tokens, kv) (engine pools): slot " +
                                          std::to_string(b) + "'s index-key table entry 0"));
      EXPECT_TRUE(throws_error_naming([&] { s.pools->prefill(bt, bad, n); }, "outside the index-key pool"));
      const std::vector<float> kept = read_bf16(device, bad_o, o_count);
      EXPECT_TRUE(std::all_of(kept.begin(), kept.end(), [](float x) { return std::isnan(x); }))
          << "a refused chunk wrote o (slot " << b << ")";
      continue;
    }
    s.pools->prefill(bt, bad, n);
    EXPECT_TRUE(throws_error_naming([&] { s.pools->check_errors(); }, "a key block id outside the index-key pool"));
    EXPECT_NO_THROW(s.pools->check_errors()) << "check_errors() clears what it reported";
    const std::vector<float> flagged = read_bf16(device, bad_o, o_count);
    const int64_t dense_len = int64_t{2} * cfg.topk_blocks * cfg.block_size;
    for (int32_t x = 0; x < batch; ++x) {
      for (int32_t t = 0; t < n && len.active(x); ++t) {
        const int64_t at = (int64_t{x} * n + t) * row;
        const int32_t i = t / cfg.block_size;
        const int64_t end = start + std::min<int64_t>(int64_t{i + 1} * cfg.block_size, n);
        const bool needed = start / cfg.block_size + i + 1 - cfg.local_blocks > 0;  // key block 0 is scored
        const std::vector<float> o = slice(flagged, at, row);
        if (x == b && needed && end > dense_len) {
          EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float y) { return y == 0.0f; }))
              << "slot " << x << " token " << t << " read a refused key block";
        } else {
          EXPECT_EQ(o, slice(got, at, row)) << "slot " << x << " token " << t;
        }
      }
    }
  }
}

// ---------------------------------------------------------------- mixed steps

namespace {

// A slot's part in one engine step of the mixed-step scenario.
enum class Part { kNone, kPrefill, kDecode };

// The engine's schedule over three slots: slot 0 prefills two chunks of
// `chunk` tokens then decodes; slot 1 decodes every step from its prompt;
// slot 2 decodes from its prompt and leaves before the last step.
struct Schedule {
  static constexpr int32_t kBatch = 3, kSteps = 4;
  int32_t chunk;
  int64_t prompt1, prompt2;
  Part part(int32_t step, int32_t slot) const {
    if (slot == 0) return step < 2 ? Part::kPrefill : Part::kDecode;
    if (slot == 2 && step == kSteps - 1) return Part::kNone;
    return Part::kDecode;
  }
  // The slot's length with this step's tokens.
  int64_t length(int32_t step, int32_t slot) const {
    if (slot == 0) return step < 2 ? int64_t{chunk} * (step + 1) : 2 * int64_t{chunk} + (step - 1);
    return (slot == 1 ? prompt1 : prompt2) + step + 1;
  }
  int64_t longest(int32_t slot) const {
    int64_t m = 0;
    for (int32_t s = 0; s < kSteps; ++s)
      if (part(s, slot) != Part::kNone) m = std::max(m, length(s, slot));
    return m;
  }
  int64_t bound() const { return std::max({longest(0), longest(1), longest(2)}) + 7; }
};

// Per-(slot, token) query-side inputs of a model: elements and dtype of each field.
struct Field {
  int64_t elems;
  DType dtype;
};

// The layer calls a mixed step makes, for each model.
struct BlockMixed {
  BlockSparseConfig cfg;
  std::vector<Field> fields() const {
    return {{int64_t{cfg.num_qo_heads} * cfg.head_dim, kDt}, {int64_t{cfg.num_kv_heads} * cfg.head_dim, kDt}};
  }
  int64_t o_elems() const { return int64_t{cfg.num_qo_heads} * cfg.head_dim; }
  int64_t row_elems() const { return int64_t{cfg.num_kv_heads} * cfg.head_dim; }  // K and V pools
  int32_t num_pools() const { return 2; }
  int32_t key_dim() const { return cfg.head_dim; }
  std::unique_ptr<BlockSparseAttention> layer(Device device) const {
    BlockSparseConfig c = cfg;
    c.kv_storage = KVStorage::kEnginePools;
    return std::make_unique<BlockSparseAttention>(device, kDt, c, Schedule::kBatch, fused());
  }
  EnginePagedKV kv(const EnginePool& pool) const { return pool.kv(cfg.head_dim, cfg.num_kv_heads); }
  static BlockSparseTokens tokens(const std::vector<Buffer>& in, Buffer& o) {
    BlockSparseTokens t;
    t.q = in[0].data();
    t.index_q = in[1].data();
    t.o = o.data();
    return t;
  }
  void prefill(BlockSparseAttention& l, const std::vector<Buffer>& in, Buffer& o, const EnginePagedKV& kv,
               int32_t n) const {
    l.prefill(tokens(in, o), kv, n);
  }
  void decode(BlockSparseAttention& l, const std::vector<Buffer>& in, Buffer& o, const EnginePagedKV& kv) const {
    l.decode(tokens(in, o), kv);
  }
};

struct DsaMixed {
  DsaConfig cfg;
  std::vector<Field> fields() const {
    return {{int64_t{cfg.num_qo_heads} * cfg.latent_dim, kDt},
            {int64_t{cfg.num_qo_heads} * cfg.rope_dim, kDt},
            {int64_t{cfg.index_heads} * cfg.index_head_dim, kDt},
            {cfg.index_heads, DType::kF32}};
  }
  int64_t o_elems() const { return int64_t{cfg.num_qo_heads} * cfg.latent_dim; }
  int64_t row_elems() const { return int64_t{cfg.latent_dim} + cfg.rope_dim; }  // the MLA rows
  int32_t num_pools() const { return 1; }
  int32_t key_dim() const { return cfg.index_head_dim; }
  std::unique_ptr<DsaAttention> layer(Device device) const {
    DsaConfig c = cfg;
    c.kv_storage = KVStorage::kEnginePools;
    return std::make_unique<DsaAttention>(device, kDt, c, Schedule::kBatch, fused());
  }
  EnginePagedKV kv(const EnginePool& pool) const { return pool.mla_kv(cfg.latent_dim, cfg.rope_dim, false); }
  static DsaTokens tokens(const std::vector<Buffer>& in, Buffer& o) {
    return DsaTokens{in[0].data(), in[1].data(), in[2].data(), in[3].as<float>(), nullptr, nullptr, o.data()};
  }
  void prefill(DsaAttention& l, const std::vector<Buffer>& in, Buffer& o, const EnginePagedKV& kv, int32_t n) const {
    l.prefill(tokens(in, o), kv, n);
  }
  void decode(DsaAttention& l, const std::vector<Buffer>& in, Buffer& o, const EnginePagedKV& kv) const {
    l.decode(tokens(in, o), kv);
  }
};

template <class Model>
void check_mixed(Device device, const Model& m, const Schedule& sched, bool fp8_keys, uint64_t seed) {
  constexpr int32_t kB = Schedule::kBatch;
  std::mt19937_64 rng(seed);
  // The engine has written every row the scenario reaches (the layer reads
  // only positions below each call's lengths); every other pool row is NaN.
  std::vector<int64_t> longest;
  for (int32_t b = 0; b < kB; ++b) longest.push_back(sched.longest(b));
  const Lengths extent(EnginePrefillCase{longest, 0, 0});
  EnginePool pool(device, kB, blocks_for(extent), m.row_elems(), m.num_pools(), rng);
  const int32_t kd = m.key_dim();
  EngineKeys keys(pool, fp8_keys, kd);
  for (int32_t b = 0; b < kB; ++b) {
    for (int64_t p = 0; p < longest[size_t(b)]; ++p) {
      for (int32_t i = 0; i < m.num_pools(); ++i) {
        const std::vector<float> row = quarter_grid(rng, static_cast<size_t>(m.row_elems()));
        pool.write(i, b, p, row.data());
      }
      const std::vector<float> key = quarter_grid(rng, static_cast<size_t>(kd));
      keys.write(b, p, key.data());
    }
  }
  const Buffer keys_dev = upload(device, keys.bytes);
  EnginePagedKV kv = m.kv(pool);
  kv.index_keys = keys.host;
  kv.index_keys.pool = const_cast<void*>(keys_dev.data());
  kv.index_keys.block_table = pool.table_dev.as<int32_t>();
  kv.max_seq_len = sched.bound();  // one bound for every call, mixed or lone: the same plans
  const auto snapshot = [&] {
    std::vector<std::vector<uint8_t>> bytes;
    for (const Buffer& b : pool.pools) bytes.push_back(download<uint8_t>(device, b.data(), b.bytes()));
    bytes.push_back(download<uint8_t>(device, keys_dev.data(), keys_dev.bytes()));
    return bytes;
  };
  const auto pools_before = snapshot();

  // Each (step, slot)'s query-side inputs: chunk tokens for a prefill, one for a decode.
  const std::vector<Field> fields = m.fields();
  const auto tokens_of = [&](Part part) { return part == Part::kPrefill ? sched.chunk : 1; };
  std::vector<std::vector<std::vector<float>>> inputs(size_t(Schedule::kSteps) * kB);
  for (int32_t s = 0; s < Schedule::kSteps; ++s) {
    for (int32_t b = 0; b < kB; ++b) {
      const Part part = sched.part(s, b);
      if (part == Part::kNone) continue;
      for (const Field& f : fields)
        inputs[size_t(s * kB + b)].push_back(quarter_grid(rng, size_t(tokens_of(part) * f.elems)));
    }
  }
  // One call's inputs and lengths for the slots in `in_call` (the others'
  // rows NaN, their lengths 0), the output NaN-poisoned.
  struct Call {
    std::vector<Buffer> in;
    Buffer lens, o;
  };
  const auto make_call = [&](int32_t s, Part part, const std::vector<uint8_t>& in_call) {
    const int32_t t = tokens_of(part);
    Call c;
    for (size_t f = 0; f < fields.size(); ++f) {
      std::vector<float> x(size_t(kB * t * fields[f].elems), std::numeric_limits<float>::quiet_NaN());
      for (int32_t b = 0; b < kB; ++b) {
        if (in_call[size_t(b)])
          std::copy_n(inputs[size_t(s * kB + b)][f].begin(), t * fields[f].elems,
                      x.begin() + int64_t{b} * t * fields[f].elems);
      }
      c.in.push_back(to_device(device, fields[f].dtype, x));
    }
    std::vector<int32_t> lens(kB, 0);
    for (int32_t b = 0; b < kB; ++b) lens[size_t(b)] = in_call[size_t(b)] ? int32_t(sched.length(s, b)) : 0;
    c.lens = upload(device, lens);
    c.o = poisoned(device, size_t(kB * t * m.o_elems()));
    return c;
  };
  const auto run = [&](auto& layer, Part part, Call& c) {
    EnginePagedKV call_kv = kv;
    call_kv.seq_lens = c.lens.template as<int32_t>();
    if (part == Part::kPrefill) {
      m.prefill(layer, c.in, c.o, call_kv, sched.chunk);
    } else {
      m.decode(layer, c.in, c.o, call_kv);
    }
    layer.check_errors();
  };
  const auto rows_of = [&](const Call& c, Part part, int32_t b) {
    const int64_t row = int64_t{tokens_of(part)} * m.o_elems();
    return slice(read_bf16(device, c.o, size_t(kB * row)), b * row, row);
  };

  auto mixed = m.layer(device), lone = m.layer(device);
  for (int32_t s = 0; s < Schedule::kSteps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    for (const Part part : {Part::kPrefill, Part::kDecode}) {
      std::vector<uint8_t> in_call(kB, 0);
      for (int32_t b = 0; b < kB; ++b) in_call[size_t(b)] = sched.part(s, b) == part ? 1 : 0;
      if (std::find(in_call.begin(), in_call.end(), 1) == in_call.end()) continue;
      // The engine's step: one call over every slot in this part, the others' lengths 0.
      Call c = make_call(s, part, in_call);
      run(*mixed, part, c);
      for (int32_t b = 0; b < kB; ++b) {
        const std::vector<float> got = rows_of(c, part, b);
        if (!in_call[size_t(b)]) {
          EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.0f; }))
              << "slot " << b << " is not in this call: its rows must be zero";
          continue;
        }
        // The oracle: the same request alone in its call on a twin layer.
        std::vector<uint8_t> alone(kB, 0);
        alone[size_t(b)] = 1;
        Call l = make_call(s, part, alone);
        run(*lone, part, l);
        const std::vector<float> want = rows_of(l, part, b);
        ASSERT_FALSE(has_nan(got)) << "slot " << b;
        ASSERT_FALSE(has_nan(want)) << "slot " << b;
        EXPECT_FALSE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.0f; }))
            << "slot " << b << " is in this call: its rows attend something";
        EXPECT_EQ(got, want) << "slot " << b << (part == Part::kPrefill ? " (prefill)" : " (decode)")
                             << ": the mixed step differs from the request run alone";
      }
    }
  }
  EXPECT_TRUE(snapshot() == pools_before) << "a call wrote the engine's pools";
  EXPECT_EQ(mixed->kv_lens(), std::vector<int64_t>(size_t(kB), 0)) << "an engine-pools layer keeps no lengths";
}

}  // namespace

void check_engine_pools_mixed_block_step(Device device, const BlockSparseConfig& config, int32_t chunk, int64_t prompt1,
                                         int64_t prompt2, bool fp8_keys) {
  check_mixed(device, BlockMixed{config}, Schedule{chunk, prompt1, prompt2}, fp8_keys, 41);
}

void check_engine_pools_mixed_dsa_step(Device device, const DsaConfig& config, int32_t chunk, int64_t prompt1,
                                       int64_t prompt2, bool fp8_keys) {
  check_mixed(device, DsaMixed{config}, Schedule{chunk, prompt1, prompt2}, fp8_keys, 43);
}

// ---------------------------------------------------------------- refusals

void check_engine_prefill_refusals(Device device) {
  // Top-2 blocks of bs (16 on the CPU; on CUDA 64 at head_dim 128, the
  // shapes its prefill indexer takes, so that no shape refusal comes first):
  // two slots at bs and 2 bs positions, a chunk of bs.
  const BlockSparseConfig cfg = device == Device::kCuda
                                    ? BlockSparseConfig{8, 2, 128, 64, 2, 1, 256, KVStorage::kEnginePaged}
                                    : BlockSparseConfig{8, 2, 64, 16, 2, 1, 64, KVStorage::kEnginePaged};
  const int32_t bs = cfg.block_size, batch = 2, n = bs, hq = 8, hkv = 2, d = cfg.head_dim;
  std::mt19937_64 rng(7);
  const std::vector<int64_t> prompt{bs, 2 * bs};
  const int64_t per_slot = 3 * int64_t{bs};
  const SlotRows k = slot_rows(rng, {per_slot, per_slot}, int64_t{hkv} * d);
  const SlotRows v = slot_rows(rng, {per_slot, per_slot}, int64_t{hkv} * d);
  const SlotRows ik = slot_rows(rng, {per_slot, per_slot}, d);
  EnginePool pool(device, batch, static_cast<int32_t>(per_slot / kEngineBlock) + 1, int64_t{hkv} * d, 2, rng);
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p < prompt[size_t(b)] + n; ++p) {
      pool.write(0, b, p, k[size_t(b)].data() + p * hkv * d);
      pool.write(1, b, p, v[size_t(b)].data() + p * hkv * d);
    }
  }
  const EnginePagedKV kv = pool.kv(d, hkv);
  const auto make = [&] {
    auto layer = std::make_unique<BlockSparseAttention>(device, kDt, cfg, batch, fused());
    for (int32_t b = 0; b < batch; ++b) {
      const Buffer keys = to_device(device, kDt, slice(ik[size_t(b)], 0, prompt[size_t(b)] * d));
      layer->admit(b, keys.data(), nullptr, prompt[size_t(b)]);
    }
    return layer;
  };
  const Buffer q = to_device(device, kDt, quarter_grid(rng, size_t{batch} * n * hq * d));
  const Buffer iq = to_device(device, kDt, quarter_grid(rng, size_t{batch} * n * hkv * d));
  const Buffer index_k = to_device(device, kDt, token_major(ik, prompt, n, d));
  const size_t o_count = size_t{batch} * n * hq * d;
  Buffer o = poisoned(device, o_count);
  BlockSparseTokens good;
  good.q = q.data();
  good.index_q = iq.data();
  good.index_k = index_k.data();
  good.o = o.data();

  auto layer = make();
  const auto lens = layer->kv_lens();
  const auto refused = [&](const std::function<void()>& call, const std::string& needle) {
    EXPECT_TRUE(throws_error_naming(call, needle));
    EXPECT_EQ(layer->kv_lens(), lens) << "a refused chunk changed the lengths (" << needle << ")";
  };
  refused([&] { layer->prefill(good, kv, 0); }, "num_tokens = 0");
  BlockSparseTokens with_k = good;
  with_k.k = index_k.data();
  refused([&] { layer->prefill(with_k, kv, n); }, "k and v must be null");
  BlockSparseTokens no_key = good;
  no_key.index_k = nullptr;
  refused([&] { layer->prefill(no_key, kv, n); }, "index_k");
  EnginePagedKV narrow = kv;
  narrow.block_table.max_blocks = 2 * bs / kEngineBlock;  // 2 bs positions: slot 1 would hold 3 bs
  refused([&] { layer->prefill(good, narrow, n); }, "past its block-table row");
  const Buffer rows = upload(device, std::vector<int32_t>{1, 0});
  EnginePagedKV mapped = kv;
  mapped.block_table.row_of_sequence = rows.as<int32_t>();
  refused([&] { layer->prefill(good, mapped, n); }, "row_of_sequence must be null");
  refused([&] { layer->prefill(good, n); }, "pass its pool");
  if (device == Device::kCpu) {  // a host table: judged before anything is appended
    std::vector<int32_t> entries = pool.table;
    entries[size_t(kv.block_table.row_stride) + 2] = static_cast<int32_t>(pool.num_blocks);  // slot 1, positions 32..47
    EnginePagedKV bad = kv;
    bad.block_table.data = entries.data();
    refused([&] { layer->prefill(good, bad, n); }, "is outside the pool");
  }

  // A chunk starting off the block grid (slot 0 holds 8 positions).
  auto misaligned = std::make_unique<BlockSparseAttention>(device, kDt, cfg, batch, fused());
  const Buffer eight = to_device(device, kDt, slice(ik[0], 0, 8 * d));
  const Buffer sixteen = to_device(device, kDt, slice(ik[1], 0, 16 * d));
  misaligned->admit(0, eight.data(), nullptr, 8);
  misaligned->admit(1, sixteen.data(), nullptr, 16);
  EXPECT_TRUE(throws_error_naming([&] { misaligned->prefill(good, kv, n); }, "not a multiple of block_size"));
  EXPECT_EQ(misaligned->kv_lens(), (std::vector<int64_t>{8, 16}));

  // A layer over its own cache, and an engine-pools layer, refuse the form by name.
  BlockSparseConfig own_cfg = cfg;
  own_cfg.kv_storage = KVStorage::kLayerCache;
  BlockSparseAttention own(device, kDt, own_cfg, batch, fused());
  EXPECT_TRUE(throws_error_naming([&] { own.prefill(good, kv, n); }, "keeps its own cache"));
  BlockSparseConfig pools_cfg = cfg;
  pools_cfg.kv_storage = KVStorage::kEnginePools;
  BlockSparseAttention pools(device, kDt, pools_cfg, batch, fused());
  EXPECT_TRUE(throws_error_naming([&] { pools.prefill(good, kv, n); }, "engine pools"));

  // Nothing changed: a good chunk now answers as on a fresh layer.
  layer->prefill(good, kv, n);
  layer->check_errors();
  const auto got = read_bf16(device, o, o_count);
  auto fresh = make();
  Buffer o2 = poisoned(device, o_count);
  BlockSparseTokens again = good;
  again.o = o2.data();
  fresh->prefill(again, kv, n);
  EXPECT_EQ(layer->last_prefill_positions(), fresh->last_prefill_positions());
  const auto want = read_bf16(device, o2, o_count);
  ASSERT_FALSE(has_nan(got));
  EXPECT_EQ(got, want);
  EXPECT_EQ(layer->kv_lens(), (std::vector<int64_t>{2 * bs, 3 * bs}));
}

}  // namespace sparsepage::testing
