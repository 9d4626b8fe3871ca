#include "support/prefill_layers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "sparsepage/memory.h"
#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr DType kDtype = DType::kBF16;

// Decode twins fuse whenever they can: a multi-token step that the sparsity
// gate sent token by token would select by the one-token rule instead.
DispatchConfig fused_decode() { return always_fuse().without_performance_gates(); }

// One input of a layer's token struct, per (slot, token).
struct Field {
  int64_t elems = 0;
  bool token_major = false;  // the cache rows: [tokens, batch, ...]; else [batch, tokens, ...]
  DType dtype = kDtype;
};

// A chunk's inputs on the host, every (slot, token) row of every field.
struct Chunk {
  int32_t batch = 0, n = 0;
  std::vector<Field> fields;
  std::vector<std::vector<float>> rows;  // per field [batch, n, elems]

  Chunk(int32_t batch_, int32_t n_, std::vector<Field> fields_, std::mt19937_64& rng)
      : batch(batch_), n(n_), fields(std::move(fields_)) {
    for (const Field& f : fields) rows.push_back(quarter_grid(rng, static_cast<size_t>(int64_t{batch} * n * f.elems)));
  }
  const float* row(size_t f, int32_t b, int32_t t) const {
    return rows[f].data() + (int64_t{b} * n + t) * fields[f].elems;
  }
  // Tokens [t0, t1) of every field, each in its layout, on `device`.
  std::vector<Buffer> slice(Device device, int32_t t0, int32_t t1) const {
    std::vector<Buffer> out;
    const int32_t q = t1 - t0;
    for (size_t f = 0; f < fields.size(); ++f) {
      const int64_t e = fields[f].elems;
      std::vector<float> x(static_cast<size_t>(int64_t{batch} * q * e));
      for (int32_t b = 0; b < batch; ++b) {
        for (int32_t t = t0; t < t1; ++t) {
          const int64_t dst = fields[f].token_major ? int64_t{t - t0} * batch + b : int64_t{b} * q + (t - t0);
          std::copy(row(f, b, t), row(f, b, t) + e, x.begin() + dst * e);
        }
      }
      out.push_back(to_device(device, fields[f].dtype, x));
    }
    return out;
  }
};

// The host copy of each slot's cache rows: position p of slot b holds
// heads * dim values of K (and of V), [p, head, dim].
struct HostRows {
  int32_t heads = 0, dim = 0;
  std::vector<std::vector<float>> slot;
  const float* at(int32_t b, int64_t p, int32_t head) const {
    return slot[static_cast<size_t>(b)].data() + (p * heads + head) * dim;
  }
};

// What a model contributes to the generic check below.
struct DsaDriver {
  using Layer = DsaAttention;
  using Tokens = DsaTokens;
  DsaConfig c;
  int32_t k_heads() const { return 1; }
  int32_t k_dim() const { return c.latent_dim + c.index_head_dim; }
  int32_t v_heads() const { return 1; }
  int32_t v_dim() const { return c.rope_dim; }
  std::vector<Field> fields() const {
    const int64_t h = c.num_qo_heads;
    return {{h * c.latent_dim},
            {h * c.rope_dim},
            {int64_t{c.index_heads} * c.index_head_dim},
            {c.index_heads, false, DType::kF32},
            {k_dim(), true},
            {v_dim(), true}};
  }
  int64_t o_elems() const { return int64_t{c.num_qo_heads} * c.latent_dim; }
  int32_t rows_per_token() const { return 1; }  // last_prefill_positions rows per (slot, token)
  std::unique_ptr<Layer> make(Device device, int32_t batch) const {
    return std::make_unique<Layer>(device, kDtype, c, batch, fused_decode());
  }
  Tokens tokens(const std::vector<Buffer>& in, void* o) const {
    return {in[0].data(), in[1].data(), in[2].data(), in[3].as<float>(), in[4].data(), in[5].data(), o};
  }
  bool dense(int64_t len) const { return len <= c.index_topk; }
  // fp64 MLA attention of token t of slot b over `kept` (row b * n + t).
  std::vector<double> reference(const Chunk& chunk, const HostRows& k, const HostRows& v, int32_t b, int32_t t,
                                const std::vector<std::vector<int32_t>>& kept) const {
    const int32_t h = c.num_qo_heads, dl = c.latent_dim, dr = c.rope_dim;
    const std::vector<int32_t>& set = kept[static_cast<size_t>(int64_t{b} * chunk.n + t)];
    std::vector<double> out(static_cast<size_t>(o_elems()), 0.0);
    for (int32_t head = 0; head < h; ++head) {
      const float* q = chunk.row(0, b, t) + int64_t{head} * dl;
      const float* q_pe = chunk.row(1, b, t) + int64_t{head} * dr;
      std::vector<double> scores;
      for (int32_t p : set) {
        double s = 0;
        for (int32_t i = 0; i < dl; ++i) s += double{q[i]} * k.at(b, p, 0)[i];
        for (int32_t i = 0; i < dr; ++i) s += double{q_pe[i]} * v.at(b, p, 0)[i];
        scores.push_back(s * c.scale);
      }
      softmax_weighted_sum(
          scores, dl, [&](size_t j, int64_t i) { return double{k.at(b, set[j], 0)[i]}; },
          out.data() + int64_t{head} * dl);
    }
    return out;
  }
};

// The GQA layers' reference: query head h of token t of slot b over its row
// (b * n + t) * num_qo_heads + h of `kept`.
std::vector<double> gqa_reference(const Chunk& chunk, const HostRows& k, const HostRows& v, int32_t b, int32_t t,
                                  const std::vector<std::vector<int32_t>>& kept, int32_t hq, int32_t hkv, int32_t d) {
  std::vector<double> out(static_cast<size_t>(int64_t{hq} * d), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int32_t h = 0; h < hq; ++h) {
    const std::vector<int32_t>& set = kept[static_cast<size_t>((int64_t{b} * chunk.n + t) * hq + h)];
    const float* q = chunk.row(0, b, t) + int64_t{h} * d;
    const int32_t kv = h / (hq / hkv);
    std::vector<double> scores;
    for (int32_t p : set) {
      double s = 0;
      for (int32_t i = 0; i < d; ++i) s += double{q[i]} * k.at(b, p, kv)[i];
      scores.push_back(s * scale);
    }
    softmax_weighted_sum(
        scores, d, [&](size_t j, int64_t i) { return double{v.at(b, set[j], kv)[i]}; }, out.data() + int64_t{h} * d);
  }
  return out;
}

struct BlockSparseDriver {
  using Layer = BlockSparseAttention;
  using Tokens = BlockSparseTokens;
  BlockSparseConfig c;
  int32_t k_heads() const { return c.num_kv_heads + 1; }  // the index key rides at head num_kv_heads
  int32_t k_dim() const { return c.head_dim; }
  int32_t v_heads() const { return c.num_kv_heads; }
  int32_t v_dim() const { return c.head_dim; }
  std::vector<Field> fields() const {
    return {{int64_t{c.num_qo_heads} * c.head_dim},
            {int64_t{c.num_kv_heads} * c.head_dim},
            {int64_t{k_heads()} * c.head_dim, true},
            {int64_t{c.num_kv_heads} * c.head_dim, true}};
  }
  int64_t o_elems() const { return int64_t{c.num_qo_heads} * c.head_dim; }
  int32_t rows_per_token() const { return c.num_qo_heads; }
  std::unique_ptr<Layer> make(Device device, int32_t batch) const {
    return std::make_unique<Layer>(device, kDtype, c, batch, fused_decode());
  }
  Tokens tokens(const std::vector<Buffer>& in, void* o) const {
    return {in[0].data(), in[1].data(), in[2].data(), in[3].data(), o};
  }
  bool dense(int64_t len) const { return !c.sparse_regime(len); }
  std::vector<double> reference(const Chunk& chunk, const HostRows& k, const HostRows& v, int32_t b, int32_t t,
                                const std::vector<std::vector<int32_t>>& kept) const {
    return gqa_reference(chunk, k, v, b, t, kept, c.num_qo_heads, c.num_kv_heads, c.head_dim);
  }
};

struct StaticDriver {
  using Layer = StaticBlockSparseAttention;
  using Tokens = StaticBlockSparseTokens;
  StaticBlockSparseConfig c;
  int32_t k_heads() const { return c.num_kv_heads; }
  int32_t k_dim() const { return c.head_dim; }
  int32_t v_heads() const { return c.num_kv_heads; }
  int32_t v_dim() const { return c.head_dim; }
  std::vector<Field> fields() const {
    return {{int64_t{c.num_qo_heads} * c.head_dim},
            {int64_t{c.num_kv_heads} * c.head_dim, true},
            {int64_t{c.num_kv_heads} * c.head_dim, true}};
  }
  int64_t o_elems() const { return int64_t{c.num_qo_heads} * c.head_dim; }
  int32_t rows_per_token() const { return c.num_qo_heads; }
  std::unique_ptr<Layer> make(Device device, int32_t batch) const {
    return std::make_unique<Layer>(device, kDtype, c, batch, fused_decode());
  }
  Tokens tokens(const std::vector<Buffer>& in, void* o) const { return {in[0].data(), in[1].data(), in[2].data(), o}; }
  bool dense(int64_t /*len*/) const { return false; }  // no prefill_token: decode is its oracle
  std::vector<double> reference(const Chunk& chunk, const HostRows& k, const HostRows& v, int32_t b, int32_t t,
                                const std::vector<std::vector<int32_t>>& kept) const {
    return gqa_reference(chunk, k, v, b, t, kept, c.num_qo_heads, c.num_kv_heads, c.head_dim);
  }
};

// prefill_token() where the layer has one.
void prefill_token(DsaAttention& layer, const DsaTokens& t) { layer.prefill_token(t); }
void prefill_token(BlockSparseAttention& layer, const BlockSparseTokens& t) { layer.prefill_token(t); }
void prefill_token(StaticBlockSparseAttention& /*layer*/, const StaticBlockSparseTokens& /*t*/) {
  ADD_FAILURE() << "the static layer has no prefill_token";
}

// A batch with its prompts admitted (the same rows into every layer made by
// `make`) and the host copy of the rows.
template <class Driver>
struct Batch {
  const Driver& driver;
  Device device;
  LayerPrefillCase c;
  int32_t batch;
  HostRows k, v;
  std::vector<std::vector<float>> prompt_k, prompt_v;  // per slot, in admit()'s [heads, tokens, dim]

  Batch(const Driver& d, Device dev, const LayerPrefillCase& cs, std::mt19937_64& rng)
      : driver(d), device(dev), c(cs), batch(static_cast<int32_t>(cs.prompt.size())) {
    k.heads = d.k_heads();
    k.dim = d.k_dim();
    v.heads = d.v_heads();
    v.dim = d.v_dim();
    k.slot.resize(static_cast<size_t>(batch));
    v.slot.resize(static_cast<size_t>(batch));
    for (int32_t b = 0; b < batch; ++b) {
      const int64_t len = std::max<int64_t>(c.prompt[static_cast<size_t>(b)], 0);
      prompt_k.push_back(quarter_grid(rng, static_cast<size_t>(len * k.heads * k.dim)));
      prompt_v.push_back(quarter_grid(rng, static_cast<size_t>(len * v.heads * v.dim)));
      for (auto [rows, from] : {std::make_pair(&k, &prompt_k.back()), std::make_pair(&v, &prompt_v.back())}) {
        auto& dst = rows->slot[static_cast<size_t>(b)];
        dst.resize(static_cast<size_t>(len * rows->heads * rows->dim));
        for (int32_t h = 0; h < rows->heads; ++h) {
          for (int64_t p = 0; p < len; ++p) {
            std::copy_n(from->begin() + (h * len + p) * rows->dim, rows->dim,
                        dst.begin() + (p * rows->heads + h) * rows->dim);
          }
        }
      }
    }
  }
  bool active(int32_t b) const { return c.prompt[static_cast<size_t>(b)] >= 0; }
  std::unique_ptr<typename Driver::Layer> make(Device dev) const {
    auto layer = driver.make(dev, batch);
    for (int32_t b = 0; b < batch; ++b) {
      if (!active(b)) {
        layer->release(b);
        continue;
      }
      const int64_t len = c.prompt[static_cast<size_t>(b)];
      const Buffer kb = to_device(dev, kDtype, prompt_k[static_cast<size_t>(b)]);
      const Buffer vb = to_device(dev, kDtype, prompt_v[static_cast<size_t>(b)]);
      layer->admit(b, kb.data(), vb.data(), len);
    }
    return layer;
  }
  // Appends the chunk's rows to the host copy (fields kf and vf hold them).
  void append(const Chunk& chunk, size_t kf, size_t vf) {
    for (int32_t b = 0; b < batch; ++b) {
      if (!active(b)) continue;
      for (int32_t t = 0; t < chunk.n; ++t) {
        auto& kd = k.slot[static_cast<size_t>(b)];
        auto& vd = v.slot[static_cast<size_t>(b)];
        kd.insert(kd.end(), chunk.row(kf, b, t), chunk.row(kf, b, t) + int64_t{k.heads} * k.dim);
        vd.insert(vd.end(), chunk.row(vf, b, t), chunk.row(vf, b, t) + int64_t{v.heads} * v.dim);
      }
    }
  }
};

std::string where(int32_t b, int32_t t) { return "slot " + std::to_string(b) + ", token " + std::to_string(t); }

// Runs `step` over query blocks [t0, t1) of the chunk on `layer`, placing
// each block's output rows into `out` ([batch, n, o_elems]).
template <class Driver, class Step>
void run_pieces(const Driver& d, const Chunk& chunk, Device device, int32_t piece, std::vector<float>& out,
                Step&& step) {
  const int64_t e = d.o_elems();
  for (int32_t t0 = 0; t0 < chunk.n; t0 += piece) {
    const int32_t t1 = std::min(chunk.n, t0 + piece), q = t1 - t0;
    const std::vector<Buffer> in = chunk.slice(device, t0, t1);
    Buffer o = poisoned(device, static_cast<size_t>(int64_t{chunk.batch} * q * e));
    step(d.tokens(in, o.data()), t0, t1);
    const std::vector<float> got = read_bf16(device, o, static_cast<size_t>(int64_t{chunk.batch} * q * e));
    for (int32_t b = 0; b < chunk.batch; ++b) {
      std::copy_n(got.begin() + int64_t{b} * q * e, q * e, out.begin() + (int64_t{b} * chunk.n + t0) * e);
    }
  }
}

template <class Driver>
void check_prefill(Device device, const Driver& d, const LayerPrefillCase& c, const PrefillOracles& oracles,
                   size_t k_field, size_t v_field) {
  std::mt19937_64 rng(c.seed);
  Batch<Driver> batch(d, device, c, rng);
  const Chunk chunk(batch.batch, c.num_tokens, d.fields(), rng);
  const int32_t n = c.num_tokens, rows = d.rows_per_token();
  const int64_t e = d.o_elems();
  const auto row_of = [&](int32_t b, int32_t t, int32_t r) {
    return static_cast<size_t>((int64_t{b} * n + t) * rows + r);
  };

  // The chunk.
  auto layer = batch.make(device);
  std::vector<float> got(static_cast<size_t>(int64_t{batch.batch} * n * e));
  run_pieces(d, chunk, device, n, got, [&](const typename Driver::Tokens& t, int32_t, int32_t) {
    layer->prefill(t, n);
    layer->check_errors();
  });
  const std::vector<std::vector<int32_t>> kept = layer->last_prefill_positions();
  ASSERT_EQ(kept.size(), static_cast<size_t>(int64_t{batch.batch} * n * rows));
  batch.append(chunk, k_field, v_field);
  bool all_dense = true;
  for (int32_t b = 0; b < batch.batch; ++b) {
    const int64_t before = c.prompt[static_cast<size_t>(b)];
    EXPECT_EQ(layer->kv_lens()[static_cast<size_t>(b)], batch.active(b) ? before + n : 0) << "slot " << b;
    if (batch.active(b)) all_dense = all_dense && d.dense(before + n);
  }

  // Against fp64 over the reported sets, each within the token's window.
  for (int32_t b = 0; b < batch.batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const std::vector<float> o(got.begin() + (int64_t{b} * n + t) * e, got.begin() + (int64_t{b} * n + t + 1) * e);
      if (!batch.active(b)) {
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float x) { return x == 0.0f; })) << "free " << where(b, t);
        continue;
      }
      const int64_t pos = c.prompt[static_cast<size_t>(b)] + t;
      for (int32_t r = 0; r < rows; ++r) {
        const auto& set = kept[row_of(b, t, r)];
        ASSERT_FALSE(set.empty()) << where(b, t);
        EXPECT_LE(set.back(), pos) << where(b, t) << ": a position past the token's own";
        EXPECT_TRUE(std::is_sorted(set.begin(), set.end()) && std::adjacent_find(set.begin(), set.end()) == set.end());
      }
      EXPECT_LT(relative_l2(o, d.reference(chunk, batch.k, batch.v, b, t, kept)), oracles.fp64_tol)
          << where(b, t) << " against fp64 over its set";
    }
  }

  const auto compare = [&](const std::vector<float>& other, const char* what) {
    for (int32_t b = 0; b < batch.batch; ++b) {
      if (!batch.active(b)) continue;
      for (int32_t t = 0; t < n; ++t) {
        const std::vector<float> o(got.begin() + (int64_t{b} * n + t) * e, got.begin() + (int64_t{b} * n + t + 1) * e);
        const std::vector<double> ref(other.begin() + (int64_t{b} * n + t) * e,
                                      other.begin() + (int64_t{b} * n + t + 1) * e);
        EXPECT_LT(relative_l2(o, ref), oracles.tol) << where(b, t) << " against " << what;
      }
    }
  };

  // Decode on a twin: one token at a time (a block-sparse twin: one
  // multi-token step per query block, whose selection the block shares).
  if (oracles.decode) {
    auto twin = batch.make(device);
    std::vector<float> out(got.size());
    int32_t piece = 1;
    if constexpr (std::is_same_v<Driver, BlockSparseDriver>) piece = d.c.block_size;
    run_pieces(d, chunk, device, piece, out, [&](const typename Driver::Tokens& tokens, int32_t t0, int32_t t1) {
      if constexpr (std::is_same_v<Driver, BlockSparseDriver>) {
        twin->decode(tokens, t1 - t0);
      } else {
        twin->decode(tokens);
      }
      twin->check_errors();
      auto sets = twin->last_selected_positions();
      for (auto& set : sets) std::sort(set.begin(), set.end());                  // decode lists blocks by score
      const int32_t per_slot = static_cast<int32_t>(sets.size()) / batch.batch;  // decode requests per slot
      for (int32_t b = 0; b < batch.batch; ++b) {
        if (!batch.active(b)) continue;
        for (int32_t r = 0; r < rows; ++r) {
          // Query head r reads its KV head's request (block-sparse) or its own (static); DSA has one.
          const int32_t request = per_slot == rows ? r : r / (rows / per_slot);
          EXPECT_EQ(kept[row_of(b, t1 - 1, r)], sets[static_cast<size_t>(b * per_slot + request)])
              << where(b, t1 - 1) << ", row " << r << ": the decode twin's set";
        }
      }
    });
    compare(out, "the decode twin");
  }

  // prefill_token() on a twin while every window is in the dense regime.
  if (oracles.dense && all_dense) {
    auto twin = batch.make(device);
    std::vector<float> out(got.size());
    run_pieces(d, chunk, device, 1, out,
               [&](const typename Driver::Tokens& tokens, int32_t, int32_t) { prefill_token(*twin, tokens); });
    compare(out, "prefill_token");
    for (int32_t b = 0; b < batch.batch; ++b) {
      if (!batch.active(b)) continue;
      for (int32_t t = 0; t < n; ++t) {
        std::vector<int32_t> window(static_cast<size_t>(c.prompt[static_cast<size_t>(b)] + t + 1));
        std::iota(window.begin(), window.end(), 0);
        for (int32_t r = 0; r < rows; ++r) EXPECT_EQ(kept[row_of(b, t, r)], window) << where(b, t) << ": dense";
      }
    }
  }

  // The same chunk on the CPU backend.
  if (oracles.cpu_twin) {
    auto twin = batch.make(Device::kCpu);
    std::vector<float> out(got.size());
    run_pieces(d, chunk, Device::kCpu, n, out,
               [&](const typename Driver::Tokens& tokens, int32_t, int32_t) { twin->prefill(tokens, n); });
    compare(out, "the CPU backend");
    EXPECT_EQ(twin->last_prefill_positions(), kept) << "the CPU backend's sets";
  }
}

template <class Driver>
void check_replay(Device device, const Driver& d, const LayerPrefillCase& c, int32_t chunks,
                  const PrefillOracles& oracles, const ChunkRunner& run) {
  std::mt19937_64 rng(c.seed);
  Batch<Driver> batch(d, device, c, rng);
  const int32_t n = c.num_tokens;
  const int64_t e = d.o_elems();
  auto layer = batch.make(device);
  auto twin = batch.make(device);
  int64_t longest = 0;
  for (int64_t p : c.prompt) longest = std::max(longest, p);
  layer->reserve(longest + int64_t{chunks} * n);  // a captured chunk cannot grow the cache
  // The captured chunk reads these buffers: each chunk's inputs are written into them.
  const std::vector<Field> fields = d.fields();
  std::vector<Buffer> in;
  for (const Field& f : fields) {
    in.emplace_back(
        device, std::max<size_t>(16, static_cast<size_t>(int64_t{batch.batch} * n * f.elems) * dtype_size(f.dtype)));
  }
  const size_t o_count = static_cast<size_t>(int64_t{batch.batch} * n * e);
  Buffer o = poisoned(device, o_count);
  const typename Driver::Tokens tokens = d.tokens(in, o.data());
  for (int32_t i = 0; i < chunks; ++i) {
    const Chunk chunk(batch.batch, n, fields, rng);
    const std::vector<Buffer> fresh = chunk.slice(device, 0, n);
    for (size_t f = 0; f < fields.size(); ++f) {
      copy_bytes(in[f].data(), device, fresh[f].data(), device,
                 static_cast<size_t>(int64_t{batch.batch} * n * fields[f].elems) * dtype_size(fields[f].dtype));
    }
    fill_bytes(o.data(), device, 0xFF, o.bytes());
    run([&](void* stream) { layer->prefill(tokens, n, stream); });
    const std::vector<float> got = read_bf16(device, o, o_count);
    Buffer want_o = poisoned(device, o_count);
    twin->prefill(d.tokens(fresh, want_o.data()), n);
    const std::vector<float> want = read_bf16(device, want_o, o_count);
    for (int32_t b = 0; b < batch.batch; ++b) {
      if (!batch.active(b)) {  // a free slot's rows are zeroed by every chunk (o was poisoned before it)
        EXPECT_TRUE(std::all_of(got.begin() + int64_t{b} * n * e, got.begin() + int64_t{b + 1} * n * e,
                                [](float x) { return x == 0.0f; }))
            << "chunk " << i << ", free slot " << b;
        continue;
      }
      for (int32_t t = 0; t < n; ++t) {
        const std::vector<float> row(got.begin() + (int64_t{b} * n + t) * e,
                                     got.begin() + (int64_t{b} * n + t + 1) * e);
        const std::vector<double> ref(want.begin() + (int64_t{b} * n + t) * e,
                                      want.begin() + (int64_t{b} * n + t + 1) * e);
        EXPECT_LT(relative_l2(row, ref), oracles.tol) << "chunk " << i << ", " << where(b, t);
      }
    }
  }
  layer->check_errors();
  layer->sync_live_len();
  EXPECT_EQ(layer->kv_lens(), twin->kv_lens());
}

}  // namespace

void check_dsa_prefill_replay(Device device, const DsaConfig& config, const LayerPrefillCase& c, int32_t chunks,
                              const PrefillOracles& o, const ChunkRunner& run) {
  check_replay(device, DsaDriver{config}, c, chunks, o, run);
}

void check_block_sparse_prefill_replay(Device device, const BlockSparseConfig& config, const LayerPrefillCase& c,
                                       int32_t chunks, const PrefillOracles& o, const ChunkRunner& run) {
  check_replay(device, BlockSparseDriver{config}, c, chunks, o, run);
}

void check_static_prefill_replay(Device device, const StaticBlockSparseConfig& config, const LayerPrefillCase& c,
                                 int32_t chunks, const PrefillOracles& o, const ChunkRunner& run) {
  check_replay(device, StaticDriver{config}, c, chunks, o, run);
}

void check_dsa_prefill(Device device, const DsaConfig& config, const LayerPrefillCase& c, const PrefillOracles& o) {
  DsaDriver d{config};
  if (d.c.scale == 0.0f) d.c.scale = 1.0f / std::sqrt(static_cast<float>(config.latent_dim + config.rope_dim));
  check_prefill(device, d, c, o, 4, 5);
}

void check_block_sparse_prefill(Device device, const BlockSparseConfig& config, const LayerPrefillCase& c,
                                const PrefillOracles& o) {
  check_prefill(device, BlockSparseDriver{config}, c, o, 2, 3);
}

void check_static_prefill(Device device, const StaticBlockSparseConfig& config, const LayerPrefillCase& c,
                          const PrefillOracles& o) {
  check_prefill(device, StaticDriver{config}, c, o, 1, 2);
}

void check_prefill_refusals(Device device) {
  // A block-sparse batch of two slots at 32 and 48 tokens (blocks of 16).
  BlockSparseConfig config{8, 2, 64, 16, 2, 1, 64};
  if (device == Device::kCuda) {
    config.head_dim = 128;
    config.block_size = 64;
  }
  const int32_t bs = config.block_size;
  BlockSparseDriver d{config};
  LayerPrefillCase c{{2 * bs, 3 * bs}, bs, 5};
  std::mt19937_64 rng(c.seed);
  Batch<BlockSparseDriver> batch(d, device, c, rng);
  auto layer = batch.make(device);
  const std::vector<int64_t> lens = layer->kv_lens();
  const auto unchanged = [&](const char* what) {
    EXPECT_EQ(layer->kv_lens(), lens) << what << " changed the lengths";
    EXPECT_TRUE(layer->last_prefill_positions().empty()) << what << " left a selection";
  };
  const Chunk chunk(2, bs + 1, d.fields(), rng);
  std::vector<Buffer> in = chunk.slice(device, 0, bs + 1);
  Buffer o = poisoned(device, static_cast<size_t>(2 * (bs + 1) * d.o_elems()));
  const BlockSparseTokens good = d.tokens(in, o.data());

  EXPECT_TRUE(throws_error_naming([&] { layer->prefill(good, 0); }, "BlockSparseAttention::prefill: num_tokens = 0"));
  unchanged("num_tokens 0");
  BlockSparseTokens no_q = good;
  no_q.q = nullptr;
  EXPECT_TRUE(throws_error_naming([&] { layer->prefill(no_q, bs); }, "q, index_q, k, v, o) must be set"));
  unchanged("a null q");
  // bs + 1 tokens: the slots' next chunk would start off the block grid.
  layer->prefill(good, bs + 1);
  const std::vector<int64_t> after = layer->kv_lens();
  EXPECT_TRUE(throws_error_naming(
      [&] { layer->prefill(good, bs); },
      "slot 0's chunk would start at position " + std::to_string(3 * bs + 1) + ", not a multiple of block_size"));
  EXPECT_EQ(layer->kv_lens(), after);

  // Every slot free.
  auto empty = batch.make(device);
  empty->release(0);
  empty->release(1);
  EXPECT_TRUE(throws_error_naming([&] { empty->prefill(good, bs); }, "every slot is free"));
  EXPECT_EQ(empty->kv_lens(), std::vector<int64_t>({0, 0}));

  // An engine-paged layer.
  BlockSparseConfig paged = config;
  paged.kv_storage = KVStorage::kEnginePaged;
  BlockSparseAttention engine(device, kDtype, paged, 2, always_fuse());
  EXPECT_TRUE(throws_error_naming([&] { engine.prefill(good, bs); }, "an engine-paged layer's rows are the engine's"));
  EXPECT_EQ(engine.kv_lens(), std::vector<int64_t>({0, 0}));

  // A DSA shape the fused MLA prefill cannot take (latent 64 + rope 16: the
  // CPU backend's decode takes it, the prefill kernel does not).
  if (device == Device::kCpu) {
    DsaConfig small{4, 64, 16, 2, 32, 16, 0.0f, 64};
    DsaDriver dd{small};
    LayerPrefillCase dc{{8}, 4, 6};
    Batch<DsaDriver> db(dd, device, dc, rng);
    auto dsa = db.make(device);
    const Chunk dchunk(1, 4, dd.fields(), rng);
    const std::vector<Buffer> din = dchunk.slice(device, 0, 4);
    Buffer dout = poisoned(device, static_cast<size_t>(4 * dd.o_elems()));
    EXPECT_TRUE(throws_error_naming([&] { dsa->prefill(dd.tokens(din, dout.data()), 4); },
                                    "DsaAttention::prefill: the fused MLA prefill takes latent_dim 512"));
    EXPECT_EQ(dsa->kv_lens(), std::vector<int64_t>({8}));
  }
}

}  // namespace sparsepage::testing
