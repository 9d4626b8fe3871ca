// Target 11 of the fuzzer: the layers' engine forms, where the attention
// rows (and, for the engine-pools form, the index keys and the lengths) are
// an engine's, read through its block tables:
//   - DsaAttention over an engine's paged MLA pool (KVStorage::kEnginePaged),
//     bf16 rows or the 656-byte FP8 rows; the layer keeps its index keys and
//     its slots (admit / release);
//   - DsaAttention over engine pools (KVStorage::kEnginePools): MLA rows and
//     index keys (bf16 / f16, or vLLM's FP8 blocks) with tables of their own,
//     lengths passed each step;
//   - BlockSparseAttention over engine pools: K and V pools, index keys
//     native or FP8.
// An engine simulated on the host hands out blocks from a shuffled free list
// (a released request's blocks are poisoned with NaN and reused), writes each
// token's rows where its tables say, leaves every unused row NaN and every
// table entry no position reaches out of range. Valid steps are mixed with
// hostile ones: a block id a live position reaches outside the pool, a
// row_of_sequence outside the table, a table too narrow or with too few
// rows, pool views whose dims or formats do not fit, null or extra token
// pointers, lengths past the bound or negative, key blocks outside their
// pool, the wrong form's fields, calls an engine layer has no use for.
// Asserted:
//   - a refusal is a sparsepage::Error naming the layer; o is unchanged and
//     its canaries hold; the layer's lengths and slots are as they were (the
//     next accepted step checks that nothing was appended); a refusal before
//     the step runs leaves the last selection and the error flags alone;
//   - an edit no position reaches (a table entry past every length, a key
//     block an unscored sequence holds) runs like the untouched step;
//   - an accepted step flags nothing; each slot's selection is the rule's
//     (the indexer's definition over the engine's own values: the top-k of
//     the index scores, the kept blocks of the block rule, every position
//     in the dense regime) and its output the fp64 attention over the rows
//     the engine wrote there, dequantized by this file's own e4m3 decoder;
//     free and empty slots output zeros;
//   - prefill chunks (prefill(tokens, kv, n)) interleave with the steps,
//     with the edits an engine-form chunk must refuse (prefill_chunk below
//     says which and what an accepted chunk must give);
//   - a twin layer given only the accepted calls, over the same pools,
//     writes the same bits for every accepted step and chunk.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_support.h"
#include "sparsepage/fp8.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/memory.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "support/reference.h"

namespace sparsepage {
namespace engine_forms {
namespace {

enum class Form { kDsaPaged = 0, kDsaPools = 1, kBlockPools = 2 };

// e4m3 (the OCP format: bias 7, no infinities, S.1111.111 NaN), decoded
// here rather than by the library it checks.
double e4m3(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  if (exp == 0xF && man == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

double load(DType dt, const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return dt == DType::kBF16 ? bf16_to_float(bits) : f16_to_float(bits);
}

// One pool's blocks as an engine hands them out: a shuffled free list, each
// slot's blocks in table row row_of[slot]. Entries no position reaches hold
// ids outside the pool, so a read of one is caught.
struct Blocks {
  int32_t block_size = 1, max_blocks = 1, rows = 1;
  int64_t num_blocks = 1;
  std::vector<int32_t> free, table, row_of;  // table [rows, max_blocks]
  std::vector<int32_t> held;                 // blocks each slot holds

  // mapped: slots sit in shuffled rows of a taller table (row_of_sequence); else slot b in row b.
  Blocks(int32_t batch, int32_t bs, int32_t width, bool mapped, int32_t extra_rows, int32_t spare, std::mt19937_64& rng)
      : block_size(bs), max_blocks(width), rows(batch + extra_rows) {
    num_blocks = int64_t{batch} * width + spare;
    free.resize(static_cast<size_t>(num_blocks));
    std::iota(free.begin(), free.end(), 0);
    std::shuffle(free.begin(), free.end(), rng);
    const int32_t junk[] = {-1, -2, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                            static_cast<int32_t>(num_blocks)};
    table.resize(static_cast<size_t>(rows) * static_cast<size_t>(width));
    for (auto& e : table) e = junk[rng() % 5];
    row_of.resize(static_cast<size_t>(rows));
    std::iota(row_of.begin(), row_of.end(), 0);
    if (mapped) std::shuffle(row_of.begin(), row_of.end(), rng);
    row_of.resize(static_cast<size_t>(batch));
    held.assign(static_cast<size_t>(batch), 0);
  }
  int32_t* row(int32_t b) { return &table[static_cast<size_t>(row_of[size_t(b)]) * size_t(max_blocks)]; }
  // Gives slot b blocks for positions [0, len) (len <= max_blocks * block_size).
  void cover(int32_t b, int64_t len) {
    while (int64_t{held[size_t(b)]} * block_size < len) {
      row(b)[held[size_t(b)]++] = free.back();
      free.pop_back();
    }
  }
  // Slot b's blocks back on the free list (their ids, to poison).
  std::vector<int32_t> release(int32_t b, std::mt19937_64& rng) {
    std::vector<int32_t> ids(row(b), row(b) + held[size_t(b)]);
    for (int32_t j = 0; j < held[size_t(b)]; ++j) row(b)[j] = -1 - static_cast<int32_t>(rng() % 3);
    held[size_t(b)] = 0;
    free.insert(free.begin(), ids.begin(), ids.end());  // handed out again, in a shuffled order
    std::shuffle(free.begin(), free.end(), rng);
    return ids;
  }
  int64_t slot(int32_t b, int64_t p) { return int64_t{row(b)[p / block_size]} * block_size + p % block_size; }
};

// The hostile edits. kRefused: must throw; kMayFlag: must throw, and may
// leave the indexer's flag and a new selection behind (the CPU indexer flags
// the row, then the decode refuses the step); kRuns: must run as untouched.
enum class Expect { kRefused, kMayFlag, kRuns };

struct Run {
  Form form;
  DType dt = DType::kBF16;
  int32_t batch = 1;
  uint64_t seed = 0;
  bool fp8_rows = false, fp8_keys = false, mapped = false;
  DsaConfig dsa;
  BlockSparseConfig bs;
  std::unique_ptr<SparseLayer> layer;
  std::unique_ptr<SparseLayer> twin;  // given only the accepted calls, over the same pools
  std::string name;
  std::string tag;      // the run's form, for findings
  int64_t max_len = 0;  // the longest a request may grow
  // Row sizes: the attention pool's (bytes per row), the query, key and output elements.
  int64_t row_bytes = 0;
  int32_t latent = 0, rope = 0, key_dim = 0, heads = 0, kv_heads = 0, head_dim = 0, index_heads = 0;
  std::unique_ptr<Blocks> att, keys;
  Buffer mla, k_pool, v_pool, key_pool;
  // The engine's requests: per slot, active, request id and length.
  std::vector<uint8_t> active;
  std::vector<int64_t> id, len;
  int64_t next_id = 0;

  bool dsa_model() const { return form != Form::kBlockPools; }
  bool pools() const { return form != Form::kDsaPaged; }
  int64_t token_key_bytes() const { return fp8_keys ? IndexKeyFp8::kTokenBytes : int64_t{key_dim} * 2; }
  int64_t key_block_bytes() const { return token_key_bytes() * keys->block_size; }
  size_t o_elems() const { return static_cast<size_t>(batch) * heads * (dsa_model() ? latent : head_dim); }

  // ---- the engine's values: each (request, position)'s rows, the same wherever written ----
  std::vector<uint8_t> values(int64_t request, int64_t pos, int64_t what, size_t count, float amp = 1.0f) const {
    std::mt19937_64 rng(mix(seed, request, pos * 8 + what));
    return testing::random_values(dt, count, rng, amp);
  }
  std::vector<uint8_t> index_key(int64_t request, int64_t pos) const {
    return values(request, pos, 0, static_cast<size_t>(key_dim));
  }
  // Writes position p of slot b: the attention rows, and the index key into the key pool (pools forms).
  void write(int32_t b, int64_t p) {
    const int64_t request = id[size_t(b)];
    att->cover(b, p + 1);
    const int64_t s = att->slot(b, p);
    if (dsa_model()) {
      const auto row = values(request, p, 1, static_cast<size_t>(latent + rope), 2.0f);
      uint8_t* dst = static_cast<uint8_t*>(mla.data()) + s * row_bytes;
      if (fp8_rows) {
        quantize_mla_fp8_cpu(DType::kBF16, row.data(), 1, latent + rope, dst, row_bytes);
      } else {
        std::memcpy(dst, row.data(), row.size());
      }
    } else {
      const size_t n = static_cast<size_t>(kv_heads) * static_cast<size_t>(head_dim);
      const auto k = values(request, p, 1, n), v = values(request, p, 2, n);
      std::memcpy(static_cast<uint8_t*>(k_pool.data()) + s * int64_t(n) * 2, k.data(), k.size());
      std::memcpy(static_cast<uint8_t*>(v_pool.data()) + s * int64_t(n) * 2, v.data(), v.size());
    }
    if (pools()) {
      keys->cover(b, p + 1);
      const int64_t ks = keys->slot(b, p);
      const auto key = index_key(request, p);
      write_index_keys_cpu(key_desc(), key_dim, dt, key.data(), key_dim, &ks, 1);
    }
  }
  // The engine's paged keys as PagedIndexKeys (pools forms).
  PagedIndexKeys key_desc() {
    PagedIndexKeys k;
    k.format = fp8_keys ? IndexKeyFormat::kE4m3 : IndexKeyFormat::kNative;
    k.pool = key_pool.data();
    k.num_blocks = keys->num_blocks;
    k.block_size = keys->block_size;
    k.dtype = dt;
    k.block_table = keys->table.data();
    k.block_table_stride = keys->max_blocks;
    k.max_blocks = keys->max_blocks;
    return k;
  }
  void poison_released(int32_t b, std::mt19937_64& rng) {
    for (int32_t block : att->release(b, rng)) {
      const int64_t first = int64_t{block} * att->block_size;
      if (dsa_model()) {
        std::memset(static_cast<uint8_t*>(mla.data()) + first * row_bytes, 0xFF,
                    static_cast<size_t>(att->block_size * row_bytes));
      } else {
        const int64_t bytes = int64_t{att->block_size} * kv_heads * head_dim * 2;
        std::memset(static_cast<uint8_t*>(k_pool.data()) + first * kv_heads * head_dim * 2, 0xFF, size_t(bytes));
        std::memset(static_cast<uint8_t*>(v_pool.data()) + first * kv_heads * head_dim * 2, 0xFF, size_t(bytes));
      }
    }
    if (pools()) {
      for (int32_t block : keys->release(b, rng))
        std::memset(static_cast<uint8_t*>(key_pool.data()) + block * key_block_bytes(), 0xFF,
                    static_cast<size_t>(key_block_bytes()));
    }
  }

  // ---- the engine's values as the reference reads them ----
  // Position p of slot b, column c of the MLA row (c < latent: the latent, else the rope).
  double mla_value(int32_t b, int64_t p, int32_t c) {
    const uint8_t* r = static_cast<const uint8_t*>(mla.data()) + att->slot(b, p) * row_bytes;
    if (!fp8_rows) return load(dt, r + int64_t{c} * 2);
    if (c >= latent) return load(DType::kBF16, r + MlaFp8Row::kRopeOffset + int64_t{c - latent} * 2);
    float scale;
    std::memcpy(&scale, r + MlaFp8Row::kScaleOffset + 4 * (c / MlaFp8Row::kBlock), 4);
    return e4m3(r[c]) * scale;
  }
  // K or V of head h at position p of slot b, element i.
  double kv_value(const Buffer& pool, int32_t b, int64_t p, int32_t h, int32_t i) {
    const int64_t e = (att->slot(b, p) * kv_heads + h) * head_dim + i;
    return load(dt, static_cast<const uint8_t*>(pool.data()) + e * 2);
  }
  // The index key of position p of slot b as the indexer scores it (pools: dequantized from the pool).
  std::vector<float> key_values(int32_t b, int64_t p) {
    std::vector<float> out(static_cast<size_t>(key_dim));
    if (!pools() || !fp8_keys) {
      const auto bytes = index_key(id[size_t(b)], p);
      for (int32_t i = 0; i < key_dim; ++i) out[size_t(i)] = static_cast<float>(load(dt, bytes.data() + i * 2));
      return out;
    }
    const int64_t block = keys->row(b)[p / keys->block_size];
    const int32_t slot = static_cast<int32_t>(p % keys->block_size);
    const uint8_t* base = static_cast<const uint8_t*>(key_pool.data()) + block * key_block_bytes();
    float scale;
    std::memcpy(&scale, base + IndexKeyFp8::scale_offset(keys->block_size, slot), 4);
    for (int32_t i = 0; i < key_dim; ++i)
      out[size_t(i)] = static_cast<float>(e4m3(base[IndexKeyFp8::value_offset(keys->block_size, slot) + i])) * scale;
    return out;
  }
};

// One step's per-slot inputs (rows of free slots NaN).
struct Inputs {
  std::vector<uint8_t> q, q_extra, index_q, index_k;
  std::vector<float> weights;
};

Inputs make_inputs(const Run& r, int64_t step) {
  Inputs in;
  const size_t b = static_cast<size_t>(r.batch);
  const int32_t q_dim = r.dsa_model() ? r.latent : r.head_dim;
  const int32_t iq_heads = r.dsa_model() ? r.index_heads : r.kv_heads;
  in.q = testing::nan_values(r.dt, b * r.heads * q_dim);
  in.q_extra = testing::nan_values(r.dt, b * r.heads * r.rope);
  in.index_q = testing::nan_values(r.dt, b * iq_heads * r.key_dim);
  in.index_k = testing::nan_values(r.dt, b * r.key_dim);
  in.weights.assign(b * r.index_heads, std::numeric_limits<float>::quiet_NaN());
  for (int32_t s = 0; s < r.batch; ++s) {
    if (!r.active[size_t(s)]) continue;
    const int64_t request = r.id[size_t(s)];
    const auto put = [&](std::vector<uint8_t>& dst, size_t per, int64_t what) {
      const auto v = r.values(request, 1000000 + step, what, per);
      std::copy(v.begin(), v.end(), dst.begin() + static_cast<std::ptrdiff_t>(s * per * 2));
    };
    put(in.q, size_t(r.heads) * q_dim, 0);
    put(in.q_extra, size_t(r.heads) * r.rope, 1);
    put(in.index_q, size_t(iq_heads) * r.key_dim, 2);
    if (r.form == Form::kDsaPaged) {  // this step's key: the engine's, at the slot's position
      const auto key = r.index_key(request, r.len[size_t(s)]);
      std::copy(key.begin(), key.end(), in.index_k.begin() + static_cast<std::ptrdiff_t>(s * r.key_dim * 2));
    }
    std::mt19937_64 rng(mix(r.seed, request, 2000000 + step));
    std::uniform_real_distribution<float> w(0.1f, 1.0f);
    for (int32_t j = 0; j < r.index_heads; ++j) in.weights[size_t(s * r.index_heads + j)] = w(rng);
  }
  return in;
}

// The engine's views of its pools.
EnginePagedKV make_kv(Run& r, const std::vector<int32_t>& lens, int64_t bound) {
  EnginePagedKV kv;
  const int64_t rows = r.att->num_blocks * r.att->block_size;
  if (r.dsa_model()) {
    if (r.fp8_rows) {
      const MlaFp8Views v = mla_fp8_views(r.mla.data(), rows, r.row_bytes);
      kv.k = v.k;
      kv.v = v.v;
      kv.k_extra = v.k_extra;
      kv.kv_format = KvFormat::kE4m3Mla;
    } else {
      kv.k.data = r.mla.data();
      kv.k.row_stride = r.latent + r.rope;
      kv.k.dim = r.latent;
      kv.k.capacity = rows;
      kv.v = kv.k;
      kv.k_extra = kv.k;
      kv.k_extra.data = static_cast<const uint8_t*>(r.mla.data()) + int64_t{r.latent} * 2;
      kv.k_extra.dim = r.rope;
    }
  } else {
    kv.k.data = r.k_pool.data();
    kv.k.row_stride = int64_t{r.kv_heads} * r.head_dim;
    kv.k.dim = r.head_dim;
    kv.k.head_stride = r.kv_heads > 1 ? r.head_dim : 0;
    kv.k.capacity = rows;
    kv.v = kv.k;
    kv.v.data = r.v_pool.data();
  }
  kv.block_table.data = r.att->table.data();
  kv.block_table.row_stride = r.att->max_blocks;
  kv.block_table.max_blocks = r.att->max_blocks;
  kv.block_table.num_rows = r.att->rows;
  kv.block_table.block_size = r.att->block_size;
  kv.block_table.num_blocks = r.att->num_blocks;
  kv.block_table.row_of_sequence = r.mapped ? r.att->row_of.data() : nullptr;
  if (r.pools()) {
    kv.seq_lens = lens.data();
    kv.max_seq_len = bound;
    kv.index_keys = r.key_desc();
  }
  return kv;
}

// The form's tokens over `in` and `o`, the token pointer `drop` (if >= 0) null.
DsaTokens dsa_tokens(const Run& r, const Inputs& in, void* o, int drop) {
  std::vector<const void*> p = {in.q.data(),
                                in.q_extra.data(),
                                in.index_q.data(),
                                in.weights.data(),
                                o,
                                r.form == Form::kDsaPaged ? in.index_k.data() : nullptr};
  if (drop >= 0) p[size_t(drop)] = nullptr;
  DsaTokens t;
  t.q_latent = p[0];
  t.q_pe = p[1];
  t.q_index = p[2];
  t.index_weights = static_cast<const float*>(p[3]);
  t.o = const_cast<void*>(p[4]);
  t.index_k = p[5];
  return t;
}
BlockSparseTokens block_tokens(const Inputs& in, void* o, int drop) {
  std::vector<const void*> p = {in.q.data(), in.index_q.data(), o};
  if (drop >= 0) p[size_t(drop)] = nullptr;
  BlockSparseTokens t;
  t.q = p[0];
  t.index_q = p[1];
  t.o = const_cast<void*>(p[2]);
  return t;
}

LayerStep call(Run& r, const Inputs& in, void* o, const EnginePagedKV& kv, int drop, bool extra) {
  if (r.dsa_model()) {
    DsaTokens t = dsa_tokens(r, in, o, drop);
    if (extra) t.k_cache_row = in.index_k.data();  // the layer-cache form's row: the engine wrote it
    return static_cast<DsaAttention&>(*r.layer).decode(t, kv);
  }
  BlockSparseTokens t = block_tokens(in, o, drop);
  if (extra) t.index_k = in.index_q.data();  // the engine-paged form's key: the engine's pool has it
  return static_cast<BlockSparseAttention&>(*r.layer).decode(t, kv);
}

// A prefill chunk's inputs: q, q_extra, index_q, weights and o [batch, n,
// ...], index_k token-major [n, batch, dim] (the engine-paged DSA form);
// rows of free slots NaN. Token t of slot s is position r.len[s] + t.
Inputs make_chunk_inputs(const Run& r, int32_t n, int64_t step) {
  Inputs in;
  const size_t rows = static_cast<size_t>(r.batch) * static_cast<size_t>(n);
  const int32_t q_dim = r.dsa_model() ? r.latent : r.head_dim;
  const int32_t iq_heads = r.dsa_model() ? r.index_heads : r.kv_heads;
  const size_t q_row = size_t(r.heads) * q_dim, e_row = size_t(r.heads) * r.rope, i_row = size_t(iq_heads) * r.key_dim;
  in.q = testing::nan_values(r.dt, rows * q_row);
  in.q_extra = testing::nan_values(r.dt, std::max<size_t>(rows * e_row, 1));
  in.index_q = testing::nan_values(r.dt, rows * i_row);
  in.index_k = testing::nan_values(r.dt, rows * r.key_dim);
  in.weights.assign(std::max<size_t>(rows * r.index_heads, 1), std::numeric_limits<float>::quiet_NaN());
  for (int32_t s = 0; s < r.batch; ++s) {
    if (!r.active[size_t(s)]) continue;
    const int64_t request = r.id[size_t(s)];
    for (int32_t t = 0; t < n; ++t) {
      const size_t row = size_t(s) * size_t(n) + size_t(t);
      const auto put = [&](std::vector<uint8_t>& dst, size_t per, int64_t what) {
        const auto v = r.values(request, 3000000 + step * 64 + t, what, per);
        std::copy(v.begin(), v.end(), dst.begin() + static_cast<std::ptrdiff_t>(row * per * 2));
      };
      put(in.q, q_row, 0);
      put(in.q_extra, e_row, 1);
      put(in.index_q, i_row, 2);
      if (r.form == Form::kDsaPaged) {
        const auto key = r.index_key(request, r.len[size_t(s)] + t);
        std::copy(key.begin(), key.end(),
                  in.index_k.begin() + static_cast<std::ptrdiff_t>((size_t(t) * r.batch + s) * r.key_dim * 2));
      }
      std::mt19937_64 rng(mix(r.seed, request, 4000000 + step * 64 + t));
      std::uniform_real_distribution<float> w(0.1f, 1.0f);
      for (int32_t j = 0; j < r.index_heads; ++j) in.weights[row * r.index_heads + size_t(j)] = w(rng);
    }
  }
  return in;
}

// One chunk through prefill(tokens, kv, n), token pointer `drop` (if >= 0)
// null; `extra`: the field the form does not take set; `own_cache`: the
// layer-cache form prefill(tokens, n), which an engine layer refuses.
void call_chunk(Run& r, const Inputs& in, void* o, const EnginePagedKV& kv, int32_t n, int drop, bool extra,
                bool own_cache) {
  if (r.dsa_model()) {
    DsaTokens t = dsa_tokens(r, in, o, drop);
    if (extra) t.index_k = r.form == Form::kDsaPaged ? nullptr : in.index_k.data();
    auto& l = static_cast<DsaAttention&>(*r.layer);
    return own_cache ? l.prefill(t, n) : l.prefill(t, kv, n);
  }
  BlockSparseTokens t = block_tokens(in, o, drop);
  if (extra) t.index_k = in.index_k.data();  // the engine-paged form's keys: the engine's pool has them
  auto& l = static_cast<BlockSparseAttention&>(*r.layer);
  return own_cache ? l.prefill(t, n) : l.prefill(t, kv, n);
}

// Runs `run` (a call on r.layer) on the twin instead, which never saw a
// refused call, into a buffer filled as o was; with `o` given, the twin
// must write exactly o's bytes (a refused call left no trace in the layer).
void on_twin(Run& r, const Guarded* o, const std::string& what, const std::function<void(void*)>& run) {
  Guarded o_twin(o ? o->bytes() : 8);  // 0xFF throughout, as the layer's o was before its call
  std::swap(r.layer, r.twin);
  std::string why;
  try {
    run(o_twin.data());
  } catch (const Error& e) {
    why = e.what();
  }
  std::swap(r.layer, r.twin);
  FUZZ_CHECK(why.empty(), r.tag + ": the twin refused " + what + ": " + why);
  o_twin.check_canaries("twin o");
  if (o) {
    FUZZ_CHECK(o_twin.payload() == o->payload(),
               r.tag + ": " + what + ": the layer's output differs from its twin's (a refused call left a trace)");
  }
}

// ---- the oracle ----
// Each slot's positions by the selection rule over the engine's values.
std::vector<std::vector<int32_t>> expected_selection(Run& r, const Inputs& in, const std::vector<int32_t>& lens,
                                                     int64_t bound) {
  std::vector<std::vector<int32_t>> want;
  if (r.form == Form::kDsaPools) {  // the indexer's twin over the engine's pools
    const int32_t topk = r.dsa.index_topk;
    std::vector<int32_t> pos(size_t(r.batch) * topk), cnt(size_t(r.batch));
    DsaIndexerArgs a;
    a.dtype = r.dt;
    a.key_layout = IndexKeyLayout::kPaged;
    a.paged = r.key_desc();
    a.kv_lens = lens.data();
    a.max_kv_len = bound;
    a.q_index = in.index_q.data();
    a.weights = in.weights.data();
    a.positions = pos.data();
    a.counts = cnt.data();
    dsa_select_tokens_cpu(r.dsa, r.batch, a);
    for (int32_t b = 0; b < r.batch; ++b)
      want.emplace_back(pos.begin() + b * topk, pos.begin() + b * topk + std::max(cnt[size_t(b)], 0));
    return want;
  }
  for (int32_t b = 0; b < r.batch; ++b) {
    const int64_t n = lens[size_t(b)];
    std::vector<float> keys;
    for (int64_t p = 0; p < n; ++p) {
      const auto k = r.key_values(b, p);
      keys.insert(keys.end(), k.begin(), k.end());
    }
    if (r.form == Form::kDsaPaged) {
      std::vector<float> q(size_t(r.index_heads) * r.key_dim);
      to_float(r.dt, in.index_q.data() + size_t(b) * q.size() * 2, q.data(), q.size());
      std::vector<int32_t> kept;
      if (n > 0) kept = dsa_select_tokens_cpu(r.dsa, 1, n, q.data(), &in.weights[size_t(b) * r.index_heads], keys)[0];
      want.push_back(kept);
      continue;
    }
    const BlockSparseConfig& c = r.bs;
    const int32_t h_kv = c.num_kv_heads;
    const int64_t nb = (n + c.block_size - 1) / c.block_size;
    std::vector<float> q(size_t(h_kv) * c.head_dim);
    to_float(r.dt, in.index_q.data() + size_t(b) * q.size() * 2, q.data(), q.size());
    std::vector<int32_t> kept;
    int64_t per = nb;
    if (c.sparse_regime(n)) {
      kept = select_top_blocks_cpu(c, 1, n, q.data(), keys);
      per = static_cast<int64_t>(kept.size()) / h_kv;
    }
    for (int32_t h = 0; h < h_kv; ++h) {
      std::vector<int32_t> positions;
      for (int64_t i = 0; i < per; ++i) {
        const int64_t block = kept.empty() ? i : kept[size_t(h * per + i)];
        for (int64_t p = block * c.block_size; p < std::min<int64_t>((block + 1) * c.block_size, n); ++p)
          positions.push_back(static_cast<int32_t>(p));
      }
      want.push_back(positions);
    }
  }
  return want;
}

// Checks an accepted step's selection and output against the oracle.
void check_step(Run& r, const Inputs& in, const Guarded& o, const std::vector<int32_t>& lens, int64_t bound) {
  std::vector<std::vector<int32_t>> got;
  FUZZ_CHECK(accepted([&] { r.layer->check_errors(); }, "check_errors"),
             r.name + ": an accepted engine step left an error flag");
  FUZZ_CHECK(accepted([&] { got = r.layer->last_selected_positions(); }, "last_selected_positions"),
             r.name + ": last_selected_positions was refused");
  const auto want = expected_selection(r, in, lens, bound);
  const int32_t per_slot = r.dsa_model() ? 1 : r.kv_heads;
  FUZZ_CHECK(got.size() == want.size(), r.name + ": the selection has " + std::to_string(got.size()) + " rows, not " +
                                            std::to_string(want.size()));
  const int32_t dim = r.dsa_model() ? r.latent : r.head_dim;
  const int32_t group = r.dsa_model() ? r.heads : r.heads / r.kv_heads;
  std::vector<float> out(static_cast<size_t>(dim));
  for (int32_t b = 0; b < r.batch; ++b) {
    const bool live = r.active[size_t(b)] && lens[size_t(b)] > 0;
    for (int32_t h = 0; h < r.heads; ++h) {
      const size_t at = (size_t(b) * r.heads + h) * dim;
      for (int32_t i = 0; i < dim; ++i) out[size_t(i)] = static_cast<float>(load(r.dt, o.begin() + (at + i) * 2));
      if (!live) {
        for (float x : out)
          FUZZ_CHECK(x == 0.0f, r.name + ": slot " + std::to_string(b) + " (free or empty) has a nonzero output");
        continue;
      }
      const size_t row = size_t(b) * per_slot + size_t(h / group);
      auto have = got[row], expect = want[row];
      std::sort(have.begin(), have.end());
      std::sort(expect.begin(), expect.end());
      FUZZ_CHECK(have == expect, r.name + ": slot " + std::to_string(b) + " selected " + std::to_string(have.size()) +
                                     " positions, not the rule's " + std::to_string(expect.size()));
      FUZZ_CHECK(!expect.empty(), r.name + ": a live slot selected nothing");
      // fp64 attention over the engine's rows at those positions.
      std::vector<double> scores, ref(size_t(dim), 0.0);
      for (int32_t p : expect) {
        double dot = 0.0;
        if (r.dsa_model()) {
          for (int32_t i = 0; i < r.latent + r.rope; ++i) {
            const double qv =
                i < r.latent ? load(r.dt, in.q.data() + (at + i) * 2)
                             : load(r.dt, in.q_extra.data() + ((size_t(b) * r.heads + h) * r.rope + i - r.latent) * 2);
            dot += qv * r.mla_value(b, p, i);
          }
          scores.push_back(dot * r.dsa.scale);
        } else {
          for (int32_t i = 0; i < dim; ++i)
            dot += load(r.dt, in.q.data() + (at + i) * 2) * r.kv_value(r.k_pool, b, p, h / group, i);
          scores.push_back(dot / std::sqrt(double(dim)));
        }
      }
      const double m = *std::max_element(scores.begin(), scores.end());
      double sum = 0.0;
      for (size_t j = 0; j < scores.size(); ++j) {
        const double w = std::exp(scores[j] - m);
        sum += w;
        for (int32_t i = 0; i < dim; ++i)
          ref[size_t(i)] +=
              w * (r.dsa_model() ? r.mla_value(b, expect[j], i) : r.kv_value(r.v_pool, b, expect[j], h / group, i));
      }
      for (double& x : ref) x /= sum;
      for (float x : out) FUZZ_CHECK(!std::isnan(x), r.name + ": NaN in a live slot's output");
      const double err = testing::relative_l2(out, ref);
      FUZZ_CHECK(err < o_tolerance(r.dt), r.tag + ": slot " + std::to_string(b) + " head " + std::to_string(h) +
                                              " is " + std::to_string(err) + " from fp64");
    }
  }
}

// ---- the run ----
void setup(Run& r, FuzzedDataProvider& in, Form form) {
  r.form = form;
  r.batch = in.ConsumeIntegralInRange<int32_t>(1, 3);
  r.seed = in.ConsumeIntegral<uint64_t>();
  std::mt19937_64 rng(r.seed);
  r.mapped = in.ConsumeBool();
  DispatchConfig dispatch = DispatchConfig::defaults().without_performance_gates();
  if (r.dsa_model()) {
    r.fp8_rows = in.ConsumeBool();
    r.fp8_keys = form == Form::kDsaPools && in.ConsumeBool();
    r.dt = r.fp8_rows || in.ConsumeBool() ? DType::kBF16 : DType::kF16;
    DsaConfig& c = r.dsa;
    c.num_qo_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
    // The FP8 rows fix the MLA shape (512 + 64), which the fused prefill
    // takes; bf16 rows may be small (their chunks refused) or that shape.
    c.latent_dim = r.fp8_rows ? MlaFp8Row::kLatent : 8 * in.ConsumeIntegralInRange<int32_t>(1, 3);
    c.rope_dim = r.fp8_rows ? MlaFp8Row::kRope : 4 * in.ConsumeIntegralInRange<int32_t>(1, 2);
    if (c.latent_dim == 24) {
      c.latent_dim = MlaFp8Row::kLatent;
      c.rope_dim = MlaFp8Row::kRope;
    }
    c.index_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
    c.index_head_dim = r.fp8_keys ? IndexKeyFp8::kDim : 8 * in.ConsumeIntegralInRange<int32_t>(1, 2);
    c.index_topk = in.ConsumeIntegralInRange<int32_t>(1, 6);
    c.capacity_step = in.ConsumeIntegralInRange<int64_t>(1, 8);
    c.kv_storage = form == Form::kDsaPaged ? KVStorage::kEnginePaged : KVStorage::kEnginePools;
    r.layer = std::make_unique<DsaAttention>(Device::kCpu, r.dt, c, r.batch, dispatch);
    c.scale = static_cast<DsaAttention&>(*r.layer).config().scale;  // the default filled in
    r.twin = std::make_unique<DsaAttention>(Device::kCpu, r.dt, c, r.batch, dispatch);
    r.name = "DsaAttention";
    r.latent = c.latent_dim;
    r.rope = c.rope_dim;
    r.key_dim = c.index_head_dim;
    r.heads = c.num_qo_heads;
    r.index_heads = c.index_heads;
    r.max_len = 3 * c.index_topk + 4;
    const int64_t pitches[] = {MlaFp8Row::kBytes, 672, 1024};
    r.row_bytes = r.fp8_rows ? pitches[in.ConsumeIntegralInRange<int>(0, 2)] : int64_t{r.latent + r.rope} * 2;
  } else {
    r.fp8_keys = in.ConsumeBool();
    r.dt = r.fp8_keys || in.ConsumeBool() ? DType::kBF16 : DType::kF16;
    BlockSparseConfig& c = r.bs;
    c.num_kv_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
    c.num_qo_heads = c.num_kv_heads * in.ConsumeIntegralInRange<int32_t>(1, 2);
    c.head_dim = r.fp8_keys ? IndexKeyFp8::kDim : 8 * in.ConsumeIntegralInRange<int32_t>(1, 2);
    c.block_size = in.ConsumeIntegralInRange<int32_t>(1, 4);
    c.topk_blocks = in.ConsumeIntegralInRange<int32_t>(1, 2);
    c.local_blocks = in.ConsumeIntegralInRange<int32_t>(1, 2);
    c.capacity_step = in.ConsumeIntegralInRange<int64_t>(1, 8);
    c.kv_storage = KVStorage::kEnginePools;
    r.layer = std::make_unique<BlockSparseAttention>(Device::kCpu, r.dt, c, r.batch, dispatch);
    r.twin = std::make_unique<BlockSparseAttention>(Device::kCpu, r.dt, c, r.batch, dispatch);
    r.name = "BlockSparseAttention";
    r.heads = c.num_qo_heads;
    r.kv_heads = c.num_kv_heads;
    r.head_dim = c.head_dim;
    r.key_dim = c.head_dim;
    r.index_heads = 0;
    r.max_len = 4 * int64_t{c.topk_blocks} * c.block_size + 6;
  }
  const int32_t ab = in.ConsumeIntegralInRange<int32_t>(1, 5);
  const auto width = [&](int32_t block) {
    return static_cast<int32_t>((r.max_len + block - 1) / block) + in.ConsumeIntegralInRange<int32_t>(0, 1);
  };
  const int32_t att_width = width(ab);
  r.att = std::make_unique<Blocks>(r.batch, ab, att_width, r.mapped,
                                   r.mapped ? in.ConsumeIntegralInRange<int32_t>(0, 2) : 0,
                                   in.ConsumeIntegralInRange<int32_t>(1, 3), rng);
  const int64_t rows = r.att->num_blocks * ab;
  if (r.dsa_model()) {
    r.mla = Buffer(Device::kCpu, static_cast<size_t>(rows * r.row_bytes));
    std::memset(r.mla.data(), 0xFF, r.mla.bytes());
  } else {
    const size_t bytes = static_cast<size_t>(rows * r.kv_heads * r.head_dim * 2);
    r.k_pool = Buffer(Device::kCpu, bytes);
    r.v_pool = Buffer(Device::kCpu, bytes);
    std::memset(r.k_pool.data(), 0xFF, bytes);
    std::memset(r.v_pool.data(), 0xFF, bytes);
  }
  if (r.pools()) {
    const int32_t kb = 8 << in.ConsumeIntegralInRange<int>(0, 1);
    const int32_t key_width = width(kb);
    r.keys = std::make_unique<Blocks>(r.batch, kb, key_width, false, 0, in.ConsumeIntegralInRange<int32_t>(1, 2), rng);
    r.key_pool = Buffer(Device::kCpu, static_cast<size_t>(r.keys->num_blocks * r.key_block_bytes()));
    std::memset(r.key_pool.data(), 0xFF, r.key_pool.bytes());
  }
  r.tag = r.name + (form == Form::kDsaPaged ? " (engine-paged" : " (engine pools") + (r.fp8_rows ? ", FP8 rows" : "") +
          (r.fp8_keys ? ", FP8 keys" : "") + (r.mapped ? ", row_of_sequence" : "") + ", " + dtype_name(r.dt) + ")";
  // Every slot starts with an empty request (as a layer's own slots do).
  r.active.assign(size_t(r.batch), 1);
  r.id.resize(size_t(r.batch));
  std::iota(r.id.begin(), r.id.end(), 0);
  r.next_id = r.batch;
  r.len.assign(size_t(r.batch), 0);
}

// What a call may change, read before and after a refusal.
struct Snapshot {
  std::vector<int64_t> lens;
  int64_t kv_len = 0;
  std::vector<std::vector<int32_t>> selection;
  explicit Snapshot(const SparseLayer& l) : lens(l.kv_lens()), kv_len(l.kv_len()) {
    FUZZ_CHECK(accepted([&] { selection = l.last_selected_positions(); }, "last_selected_positions"),
               l.name() + ": last_selected_positions was refused");
  }
};

void expect_refused(Run& r, Guarded& o, Expect expect, const char* what, const std::function<void()>& call) {
  const Snapshot before(*r.layer);
  const auto o_before = o.payload();
  std::string message;
  bool refused = false;
  try {
    call();
  } catch (const Error& e) {
    message = e.what();
    refused = true;
  } catch (const std::exception& e) {
    finding(r.name + ": " + what + " threw a non-sparsepage exception: " + e.what());
  }
  o.check_canaries(what);
  if (expect == Expect::kRuns) {
    FUZZ_CHECK(!refused, r.name + ": " + what + " (never read) was refused: " + message);
    return;
  }
  FUZZ_CHECK(refused, r.name + ": " + what + " was accepted");
  FUZZ_CHECK(o.payload() == o_before, r.name + ": " + what + ": a refused step wrote its output");
  const Snapshot after(*r.layer);
  FUZZ_CHECK(after.lens == before.lens && after.kv_len == before.kv_len,
             r.name + ": " + what + ": a refused call changed the layer's lengths");
  bool flagged = false;
  try {
    r.layer->check_errors();
  } catch (const Error& e) {
    flagged = true;
    FUZZ_CHECK(std::string(e.what()).find(r.name) == 0,
               r.name + ": check_errors does not start with the layer's name: " + e.what());
  }
  // The error names the layer, or (a row the indexer refused, then the
  // decode) check_errors() does.
  FUZZ_CHECK(message.find(r.name) != std::string::npos || (expect == Expect::kMayFlag && flagged),
             r.name + ": " + what + ": the error does not name the layer: " + message);
  if (expect == Expect::kRefused) {
    FUZZ_CHECK(!flagged, r.name + ": " + what + ": refused by its arguments, but left an error flag behind");
    FUZZ_CHECK(after.selection == before.selection, r.name + ": " + what + ": a refused call changed the selection");
  }
  FUZZ_CHECK(accepted([&] { r.layer->check_errors(); }, "check_errors"), r.name + ": check_errors did not clear");
}

// A prefill chunk of n tokens per active slot, the engine having written
// their rows (and, engine pools, their keys) first; sometimes one hostile
// edit. A refusal: Error naming the layer, o and the layer as they were
// (expect_refused), and the next step still matches fp64. Accepted: no NaN
// in a live slot's rows, zeros for free slots, every attended position in
// the token's causal window, the lengths advanced by n.
void prefill_chunk(Run& r, FuzzedDataProvider& in, int64_t step) {
  int32_t n = in.ConsumeIntegralInRange<int32_t>(1, 6);
  if (!r.dsa_model() && in.ConsumeBool()) n = r.bs.block_size * in.ConsumeIntegralInRange<int32_t>(1, 2);
  bool any_active = false, aligned = true;
  for (int32_t b = 0; b < r.batch; ++b) {
    if (!r.active[size_t(b)]) continue;
    if (r.len[size_t(b)] + n > r.max_len) return;  // past the engine's longest request: not this op
    any_active = true;
    if (!r.dsa_model()) aligned = aligned && r.len[size_t(b)] % r.bs.block_size == 0;
  }
  for (int32_t b = 0; b < r.batch; ++b)
    if (r.active[size_t(b)])
      for (int32_t t = 0; t < n; ++t) r.write(b, r.len[size_t(b)] + t);
  const Inputs inputs = make_chunk_inputs(r, n, step);
  std::vector<int32_t> lens(size_t(r.batch), 0);  // after the chunk
  int64_t longest = 0;
  for (int32_t b = 0; b < r.batch; ++b) {
    lens[size_t(b)] = r.active[size_t(b)] ? static_cast<int32_t>(r.len[size_t(b)] + n) : 0;
    longest = std::max<int64_t>(longest, lens[size_t(b)]);
  }
  int64_t bound = std::max<int64_t>(1, longest + in.ConsumeIntegralInRange<int64_t>(0, 3));
  bound = std::min<int64_t>(bound, int64_t{r.att->max_blocks} * r.att->block_size);
  if (r.pools()) bound = std::min<int64_t>(bound, int64_t{r.keys->max_blocks} * r.keys->block_size);
  std::vector<int32_t> bad_lens = lens;
  EnginePagedKV kv = make_kv(r, bad_lens, bound);
  Blocks att_copy = *r.att;  // edits of the table go to a copy
  std::vector<int32_t> identity(size_t(r.att->rows));
  std::iota(identity.begin(), identity.end(), 0);
  kv.block_table.data = att_copy.table.data();
  // The prefill reads row b for slot b: a shuffled table cannot be prefilled.
  const char* what = r.mapped ? "a chunk with row_of_sequence set" : "";
  if (r.mapped) kv.block_table.row_of_sequence = att_copy.row_of.data();
  int drop = -1;
  bool extra = false, own_cache = false;
  int32_t live = -1;
  for (int32_t b = 0; b < r.batch; ++b)
    if (lens[size_t(b)] > 0 && (live < 0 || in.ConsumeBool())) live = b;
  const int32_t junk[] = {-1, -2, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                          static_cast<int32_t>(r.att->num_blocks)};
  switch (in.ConsumeIntegralInRange<int>(0, 11)) {
    case 0: {
      const int32_t bad[] = {0, -1, std::numeric_limits<int32_t>::min()};
      n = bad[in.ConsumeIntegralInRange<int>(0, 2)];
      what = "a chunk of num_tokens < 1";
      break;
    }
    case 1:
      drop = in.ConsumeIntegralInRange<int>(0, r.dsa_model() ? (r.form == Form::kDsaPaged ? 5 : 4) : 2);
      what = "a chunk with a null token pointer";
      break;
    case 2:
      extra = true;
      what = "a chunk with a token field its form does not take";
      break;
    case 3:
      own_cache = true;
      what = "the layer-cache prefill on an engine layer";
      break;
    case 4:
      if (r.mapped) break;
      kv.block_table.row_of_sequence = identity.data();
      what = "a chunk with row_of_sequence set";
      break;
    case 5:  // a table row too short for a length after the chunk
      if (longest <= r.att->block_size) break;
      kv.block_table.max_blocks = static_cast<int32_t>((longest - 1) / r.att->block_size);
      what = "a block table row too short for the chunk";
      break;
    case 6: {  // a block id a chunk position reaches, outside the pool
      if (live < 0 || r.mapped) break;
      const int64_t reach = (lens[size_t(live)] + r.att->block_size - 1) / r.att->block_size;
      att_copy.row(live)[in.ConsumeIntegralInRange<int64_t>(0, reach - 1)] = junk[in.ConsumeIntegralInRange<int>(0, 4)];
      what = "a chunk reaching a block id outside the pool";
      break;
    }
    case 7:  // engine pools: a length past max_seq_len, below the chunk, or negative
      if (!r.pools() || live < 0) break;
      {
        const int32_t bad[] = {static_cast<int32_t>(bound + 1), n - 1, -1, std::numeric_limits<int32_t>::max()};
        const int32_t v = bad[in.ConsumeIntegralInRange<int>(0, 3)];
        if (v == 0) break;  // a free slot: valid
        bad_lens[size_t(live)] = v;
      }
      what = "a chunk length outside [num_tokens, max_seq_len]";
      break;
    case 8: {  // engine pools: a key block a chunk position reaches, outside the key pool
      if (!r.pools() || live < 0 || r.mapped) break;
      std::vector<int32_t> key_table = r.keys->table;
      const int64_t reach = (lens[size_t(live)] + r.keys->block_size - 1) / r.keys->block_size;
      key_table[size_t(live) * r.keys->max_blocks + size_t(in.ConsumeIntegralInRange<int64_t>(0, reach - 1))] =
          junk[in.ConsumeIntegralInRange<int>(0, 3)];
      kv.index_keys.block_table = key_table.data();
      // Judged where it is read: refused by name, or run with the tokens
      // that needed it selecting nothing and check_errors() naming it.
      // Either way no NaN, nothing outside o, and the flags clear.
      Guarded o(static_cast<size_t>(int64_t{r.batch} * n * r.heads * (r.dsa_model() ? r.latent : r.head_dim)) * 2);
      std::string refused, flagged;
      try {
        call_chunk(r, inputs, o.data(), kv, n, -1, false, false);
      } catch (const Error& e) {
        refused = e.what();
      }
      o.check_canaries("chunk o, a key block outside the pool");
      try {
        r.layer->check_errors();
      } catch (const Error& e) {
        flagged = e.what();
      }
      for (const std::string& m : {refused, flagged})
        FUZZ_CHECK(m.empty() || m.find(r.name) == 0,
                   r.tag + ": a key block outside the pool: the error does not name the layer: " + m);
      if (refused.empty()) {  // ran: the tokens that needed the block select nothing (zeros), no NaN
        for (float x : testing::as_float(r.dt, o.payload()))
          FUZZ_CHECK(!std::isnan(x), r.tag + ": a key block outside the pool: NaN in o");
      } else {
        FUZZ_CHECK(o.payload() == std::vector<uint8_t>(o.bytes(), 0xFF),
                   r.tag + ": a key block outside the pool: a refused chunk wrote its output");
      }
      FUZZ_CHECK(accepted([&] { r.layer->check_errors(); }, "check_errors"), r.name + ": check_errors did not clear");
      return;  // the engine retries these tokens: the next step rewrites the same rows
    }
    case 9:  // engine pools without their lengths or bound
      if (!r.pools()) break;
      if (in.ConsumeBool()) {
        kv.seq_lens = nullptr;
      } else {
        kv.max_seq_len = in.ConsumeBool() ? 0 : int64_t{std::numeric_limits<int32_t>::max()} + 1;
      }
      what = "engine pools without their lengths or bound";
      break;
    default: break;  // a good chunk
  }
  // Which good chunks the layer takes: an active slot, and for the block
  // layer every chunk starting on a block.
  if (*what == 0 && !any_active) what = "a chunk with every slot free";
  if (*what == 0 && !aligned) what = "a chunk off the block grid";
  if (*what == 0 && r.dsa_model() && (r.latent != 512 || r.rope != 64))
    what = "a DSA shape the fused MLA prefill cannot take";
  const int64_t o_elems = int64_t{r.batch} * n * r.heads * (r.dsa_model() ? r.latent : r.head_dim);
  Guarded o(static_cast<size_t>(std::max<int64_t>(o_elems, 1)) * 2);
  if (*what != 0) {
    expect_refused(r, o, Expect::kRefused, what,
                   [&] { call_chunk(r, inputs, o.data(), kv, n, drop, extra, own_cache); });
    return;  // the rows written stay; the next step writes the same values there
  }
  std::string why;
  try {
    call_chunk(r, inputs, o.data(), kv, n, -1, false, false);
  } catch (const Error& e) {
    why = e.what();
  } catch (const std::exception& e) {
    finding(r.name + ": a prefill chunk threw a non-sparsepage exception: " + e.what());
  }
  o.check_canaries("chunk o");
  FUZZ_CHECK(why.empty(), r.tag + ": a valid chunk of " + std::to_string(n) + " tokens was refused: " + why);
  FUZZ_CHECK(accepted([&] { r.layer->check_errors(); }, "check_errors"), r.tag + ": an accepted chunk left a flag");
  on_twin(r, &o, "a valid chunk", [&](void* out) { call_chunk(r, inputs, out, kv, n, -1, false, false); });
  const size_t row = size_t(n) * r.heads * (r.dsa_model() ? r.latent : r.head_dim);
  const std::vector<float> out = testing::as_float(r.dt, o.payload());
  const auto positions = r.layer->last_prefill_positions();
  FUZZ_CHECK(positions.size() % size_t(r.batch) == 0, r.tag + ": last_prefill_positions: not one row set per slot");
  const size_t per_slot = positions.size() / size_t(r.batch);
  for (int32_t b = 0; b < r.batch; ++b) {
    for (size_t i = 0; i < row; ++i) {
      const float x = out[size_t(b) * row + i];
      FUZZ_CHECK(r.active[size_t(b)] ? !std::isnan(x) : x == 0.0f,
                 r.tag + ": slot " + std::to_string(b) +
                     (r.active[size_t(b)] ? ": NaN in a chunk row" : ": a free slot's chunk row is not zero"));
    }
    for (size_t i = 0; i < per_slot; ++i) {
      const auto& kept = positions[size_t(b) * per_slot + i];
      if (!r.active[size_t(b)]) {
        FUZZ_CHECK(kept.empty(), r.tag + ": a free slot attended positions");
        continue;
      }
      const int64_t own = r.len[size_t(b)] + static_cast<int64_t>(i / (per_slot / size_t(n)));
      FUZZ_CHECK(!kept.empty() && std::is_sorted(kept.begin(), kept.end()) && kept.front() >= 0 && kept.back() <= own,
                 r.tag + ": a chunk token attended positions outside its causal window");
    }
    if (r.active[size_t(b)]) r.len[size_t(b)] += n;
  }
  if (!r.pools()) {
    for (int32_t b = 0; b < r.batch; ++b)
      FUZZ_CHECK(r.layer->kv_lens()[size_t(b)] == r.len[size_t(b)], r.tag + ": a chunk did not advance a length by n");
  }
}

}  // namespace

void fuzz(FuzzedDataProvider& in, int which) {
  Run r;
  setup(r, in, static_cast<Form>(which));
  std::mt19937_64 rng(r.seed ^ 0x5eed);
  Guarded o(r.o_elems() * 2);
  const int32_t calls = in.ConsumeIntegralInRange<int32_t>(1, 10);
  for (int64_t step = 0; step < calls; ++step) {
    const int op = in.ConsumeIntegralInRange<int>(0, 11);
    if (op >= 10) {
      prefill_chunk(r, in, step);
      continue;
    }
    // A request joins a free slot with a prompt the engine has written.
    if (op == 0) {
      int32_t b = 0;
      while (b < r.batch && r.active[size_t(b)]) ++b;
      if (b == r.batch) continue;
      const int64_t prompt = in.ConsumeIntegralInRange<int64_t>(0, r.max_len - 1);
      r.active[size_t(b)] = 1;
      r.id[size_t(b)] = r.next_id++;
      r.len[size_t(b)] = prompt;
      for (int64_t p = 0; p < prompt; ++p) r.write(b, p);
      if (r.form == Form::kDsaPaged) {
        std::vector<uint8_t> keys;
        for (int64_t p = 0; p < prompt; ++p) {
          const auto k = r.index_key(r.id[size_t(b)], p);
          keys.insert(keys.end(), k.begin(), k.end());
        }
        FUZZ_CHECK(accepted([&] { r.layer->admit(b, prompt ? keys.data() : nullptr, nullptr, prompt); }, "admit"),
                   r.name + ": admit of a valid prompt was refused");
        r.twin->admit(b, prompt ? keys.data() : nullptr, nullptr, prompt);
      }
      continue;
    }
    // A request leaves; its blocks are poisoned and go back to the free list.
    if (op == 1) {
      const int32_t b = in.ConsumeIntegralInRange<int32_t>(0, r.batch - 1);
      if (!r.active[size_t(b)]) continue;
      if (r.form == Form::kDsaPaged) {
        FUZZ_CHECK(accepted([&] { r.layer->release(b); }, "release"), r.name + ": release was refused");
        r.twin->release(b);
      }
      r.active[size_t(b)] = 0;
      r.len[size_t(b)] = 0;
      r.poison_released(b, rng);
      continue;
    }
    // A step: each active slot's token written at its length; a request at
    // its longest leaves first.
    for (int32_t b = 0; b < r.batch; ++b) {
      if (r.active[size_t(b)] && r.len[size_t(b)] >= r.max_len) {
        if (r.form == Form::kDsaPaged) {
          r.layer->release(b);
          r.twin->release(b);
        }
        r.active[size_t(b)] = 0;
        r.len[size_t(b)] = 0;
        r.poison_released(b, rng);
      }
    }
    for (int32_t b = 0; b < r.batch; ++b)
      if (r.active[size_t(b)]) r.write(b, r.len[size_t(b)]);
    const Inputs inputs = make_inputs(r, step);
    std::vector<int32_t> lens(size_t(r.batch), 0);  // after this step's token
    int64_t longest = 0;
    for (int32_t b = 0; b < r.batch; ++b) {
      lens[size_t(b)] = r.active[size_t(b)] ? static_cast<int32_t>(r.len[size_t(b)] + 1) : 0;
      longest = std::max<int64_t>(longest, lens[size_t(b)]);
    }
    // The engine's bound: the longest length or more (a captured step's
    // fixed bound), up to what its table rows hold.
    int64_t bound = std::max<int64_t>(1, longest + in.ConsumeIntegralInRange<int64_t>(0, 3));
    bound = std::min<int64_t>(bound, int64_t{r.att->max_blocks} * r.att->block_size);
    if (r.pools()) bound = std::min<int64_t>(bound, int64_t{r.keys->max_blocks} * r.keys->block_size);
    o.fill(0xFF);
    if (op <= 6) {
      const EnginePagedKV kv = make_kv(r, lens, bound);
      bool ran = accepted([&] { call(r, inputs, o.data(), kv, -1, false); }, "an engine step");
      o.check_canaries("engine step o");
      std::string why;
      if (!ran) {
        try {
          call(r, inputs, o.data(), kv, -1, false);
        } catch (const Error& e) {
          why = e.what();
        }
      }
      FUZZ_CHECK(ran, r.name + ": a valid engine step was refused: " + why);
      check_step(r, inputs, o, lens, bound);
      on_twin(r, &o, "a valid step", [&](void* out) { call(r, inputs, out, kv, -1, false); });
      for (int32_t b = 0; b < r.batch; ++b)
        if (r.active[size_t(b)]) ++r.len[size_t(b)];
      continue;
    }
    // A hostile call: one edit, then the same checks on a refusal; an edit
    // no position reaches must run as the untouched step.
    std::vector<int32_t> bad_lens = lens;
    EnginePagedKV kv = make_kv(r, bad_lens, bound);
    Blocks att_copy = *r.att;  // edits of the table go to a copy
    std::vector<int32_t> map_copy = r.att->row_of;
    kv.block_table.data = att_copy.table.data();
    if (r.mapped) kv.block_table.row_of_sequence = map_copy.data();
    std::vector<int32_t> key_table = r.pools() ? r.keys->table : std::vector<int32_t>{};
    if (r.pools()) kv.index_keys.block_table = key_table.data();
    int drop = -1;
    bool extra = false;
    Expect expect = Expect::kRefused;
    const char* what = "";
    // A live slot for the edits that need one (-1: none).
    int32_t live = -1;
    for (int32_t b = 0; b < r.batch; ++b)
      if (lens[size_t(b)] > 0 && (live < 0 || in.ConsumeBool())) live = b;
    const int kind = in.ConsumeIntegralInRange<int>(0, 13);
    const int32_t junk[] = {-1, -2, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
                            static_cast<int32_t>(r.att->num_blocks)};
    switch (kind) {
      case 0: {  // a block id a live position reaches, outside the pool
        if (live < 0) continue;
        const int64_t reach = (lens[size_t(live)] + r.att->block_size - 1) / r.att->block_size;
        const int64_t e = in.ConsumeIntegralInRange<int64_t>(0, reach - 1);
        att_copy.row(live)[e] = junk[in.ConsumeIntegralInRange<int>(0, 4)];
        what = "a block id outside the pool";
        break;
      }
      case 1: {  // an entry past every length: never read
        const int32_t b = in.ConsumeIntegralInRange<int32_t>(0, r.batch - 1);
        const int64_t reach = (lens[size_t(b)] + r.att->block_size - 1) / r.att->block_size;
        if (reach >= r.att->max_blocks) continue;
        att_copy.row(b)[in.ConsumeIntegralInRange<int64_t>(reach, r.att->max_blocks - 1)] = junk[rng() % 5];
        expect = Expect::kRuns;
        what = "a table entry no position reaches";
        break;
      }
      case 2: {  // row_of_sequence outside the table
        if (!r.mapped || live < 0) continue;
        map_copy[size_t(live)] = in.ConsumeBool() ? -1 - in.ConsumeIntegralInRange<int32_t>(0, 3)
                                                  : r.att->rows + in.ConsumeIntegralInRange<int32_t>(0, 3);
        what = "a row_of_sequence entry outside the table";
        break;
      }
      case 3:  // a table narrower than a live length
        if (longest <= r.att->block_size) continue;
        kv.block_table.max_blocks = static_cast<int32_t>((longest - 1) / r.att->block_size);
        kv.block_table.row_stride = r.att->max_blocks;
        what = "a block table narrower than a length";
        break;
      case 4:  // fewer rows than slots
        kv.block_table.num_rows = in.ConsumeIntegralInRange<int32_t>(-1, r.batch - 1);
        kv.block_table.row_of_sequence = nullptr;
        what = "a block table with fewer rows than slots";
        break;
      case 5: {  // a pool view whose dims or format do not fit
        switch (in.ConsumeIntegralInRange<int>(0, 4)) {
          case 0: kv.k.dim += in.ConsumeBool() ? 1 : -1; break;
          case 1: kv.v.dim += 8; break;
          case 2:
            if (r.dsa_model()) {
              kv.k_extra.data = in.ConsumeBool() ? nullptr : kv.k_extra.data;
              kv.k_extra.dim = kv.k_extra.data ? kv.k_extra.dim + 2 : kv.k_extra.dim;
            } else {
              kv.k_extra = kv.k;  // a second K stream the layer has no use for
            }
            break;
          case 3:
            kv.kv_format = r.dsa_model() ? (in.ConsumeBool() ? KvFormat::kE4m3PerHead : static_cast<KvFormat>(7))
                                         : KvFormat::kE4m3Mla;
            break;
          default:  // rows shorter than a row holds
            if (r.fp8_rows) {
              kv.k.row_stride = 512;
              kv.v.row_stride = 512;
              kv.k_extra.row_stride = 512;
            } else {
              kv.k.row_stride = kv.k.dim - 1;
            }
            break;
        }
        what = "a pool view that does not fit the layer";
        break;
      }
      case 6:  // a token pointer missing, or the other form's
        if (in.ConsumeBool()) {
          drop = in.ConsumeIntegralInRange<int>(0, r.dsa_model() ? (r.form == Form::kDsaPaged ? 5 : 4) : 2);
          what = "a null token pointer";
        } else {
          extra = true;
          what = "a token row the engine form does not take";
        }
        break;
      case 7:  // the other engine form's fields
        if (r.pools()) {
          if (in.ConsumeBool()) {
            kv.seq_lens = nullptr;
          } else {
            kv.max_seq_len = in.ConsumeBool() ? 0 : int64_t{std::numeric_limits<int32_t>::max()} + 1;
          }
          what = "engine pools without their lengths or bound";
        } else {
          kv.seq_lens = bad_lens.data();
          kv.index_keys.pool = r.mla.data();
          what = "engine-pools fields on an engine-paged layer";
        }
        break;
      case 8: {  // a length past the bound or negative
        if (!r.pools()) continue;
        const int32_t b = in.ConsumeIntegralInRange<int32_t>(0, r.batch - 1);
        const int32_t bad[] = {static_cast<int32_t>(bound + 1), -1, std::numeric_limits<int32_t>::min(),
                               std::numeric_limits<int32_t>::max()};
        bad_lens[size_t(b)] = bad[in.ConsumeIntegralInRange<int>(0, 3)];
        expect = Expect::kRefused;  // the step reads the host lengths first and names it
        what = "a length past max_seq_len or negative";
        break;
      }
      case 9: {  // a key block an indexer reads, outside its pool
        if (!r.pools() || live < 0) continue;
        key_table[size_t(live) * r.keys->max_blocks] = junk[rng() % 4];
        const int64_t n = lens[size_t(live)];
        const bool scored = r.dsa_model() ? n > r.dsa.index_topk : r.bs.sparse_regime(n);
        expect = scored ? Expect::kMayFlag : Expect::kRuns;
        what = "a key block outside the key pool";
        break;
      }
      case 10:  // a key pool that cannot be read as the layer's keys
        if (!r.pools()) continue;
        switch (in.ConsumeIntegralInRange<int>(0, 3)) {
          case 0: kv.index_keys.block_size = 12; break;
          case 1: kv.index_keys.pool = nullptr; break;
          case 2:
            if (r.fp8_keys) continue;
            kv.index_keys.dtype = r.dt == DType::kBF16 ? DType::kF16 : DType::kBF16;
            break;
          default: kv.index_keys.block_table_stride = kv.index_keys.max_blocks - 1; break;
        }
        what = "an index-key pool that does not fit";
        break;
      case 11:  // a key table narrower than the bound
        if (!r.pools() || bound <= r.keys->block_size) continue;
        kv.index_keys.max_blocks = static_cast<int32_t>((bound - 1) / r.keys->block_size);
        what = "an index-key table narrower than max_seq_len";
        break;
      case 12: {  // the calls an engine layer has no use for
        const std::vector<uint8_t> keys = testing::nan_values(r.dt, size_t(r.key_dim) * 2);
        switch (in.ConsumeIntegralInRange<int>(0, 3)) {
          case 0:
            expect_refused(r, o, Expect::kRefused, "last_mask_columns", [&] { (void)r.layer->last_mask_columns(); });
            break;
          case 1:
            expect_refused(r, o, Expect::kRefused, "the layer-cache step", [&] {
              if (r.dsa_model()) {
                DsaTokens t;
                t.q_latent = inputs.q.data();
                t.q_pe = inputs.q_extra.data();
                t.q_index = inputs.index_q.data();
                t.index_weights = inputs.weights.data();
                t.k_cache_row = keys.data();
                t.k_pe = keys.data();
                t.o = o.data();
                static_cast<DsaAttention&>(*r.layer).decode(t);
              } else {
                BlockSparseTokens t{inputs.q.data(), inputs.index_q.data(), keys.data(), keys.data(), o.data()};
                static_cast<BlockSparseAttention&>(*r.layer).decode(t);
              }
            });
            break;
          case 2:
            if (!r.pools()) {  // a slot outside the batch
              expect_refused(r, o, Expect::kRefused, "admit outside the batch", [&] {
                r.layer->admit(r.batch + in.ConsumeIntegralInRange<int32_t>(0, 2), keys.data(), nullptr, 1);
              });
            } else {
              expect_refused(r, o, Expect::kRefused, "admit on an engine-pools layer",
                             [&] { r.layer->admit(0, keys.data(), nullptr, 1); });
            }
            break;
          default:
            if (!r.pools()) {
              const bool null_keys = in.ConsumeBool();
              expect_refused(r, o, Expect::kRefused, "admit with a negative or null prompt", [&] {
                r.layer->admit(0, null_keys ? nullptr : keys.data(), nullptr, null_keys ? 2 : -1);
              });
            } else {
              expect_refused(r, o, Expect::kRefused, "release or append_tokens on an engine-pools layer", [&] {
                if (in.ConsumeBool()) r.layer->release(0);
                r.layer->append_tokens(keys.data(), nullptr, 1);
              });
            }
            break;
        }
        continue;
      }
      default:  // a pool capacity below the rows the table reaches
        if (live < 0) continue;
        kv.k.capacity = in.ConsumeIntegralInRange<int64_t>(0, int64_t{att_copy.row(live)[0]} * r.att->block_size);
        kv.v.capacity = kv.k.capacity;
        if (kv.k_extra.data) kv.k_extra.capacity = kv.k.capacity;
        what = "a pool view shorter than the table's blocks";
        break;
    }
    expect_refused(r, o, expect, what, [&] { call(r, inputs, o.data(), kv, drop, extra); });
    if (expect == Expect::kRuns) {  // ran: as the untouched step, bit for bit
      check_step(r, inputs, o, lens, bound);
      const EnginePagedKV untouched = make_kv(r, lens, bound);
      on_twin(r, &o, "an edit no position reaches", [&](void* out) { call(r, inputs, out, untouched, -1, false); });
      for (int32_t b = 0; b < r.batch; ++b)
        if (r.active[size_t(b)]) ++r.len[size_t(b)];
    }
  }
}

}  // namespace engine_forms
}  // namespace sparsepage
