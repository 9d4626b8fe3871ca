#include "support/block_sparse_pools.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/index_keys.h"
#include "sparsepage/models/block_sparse.h"
#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr DType kDt = DType::kBF16;
constexpr int32_t kSlots = 4;
constexpr int32_t kKvBlock = 16;   // the engine's K/V block size
constexpr int32_t kKeyBlock = 32;  // its index-key blocks: another size, another table
constexpr int64_t kBound = 1280;   // the engine's max_seq_len

BlockSparseConfig pools_config(KVStorage storage) {
  // {qo heads, kv heads, head dim (the FP8 key format's 128 values), block size, topk, local blocks,
  // capacity step, storage}
  return {16, 2, 128, 64, 4, 2, 256, storage};
}

// A free list of block ids, shuffled; released blocks go to the front so the
// next request reuses them.
struct FreeList {
  std::vector<int32_t> ids;
  std::vector<bool> used_before;
  FreeList(int32_t n, std::mt19937_64& rng) : ids(static_cast<size_t>(n)), used_before(static_cast<size_t>(n), false) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
  }
  int32_t take(int64_t& reused) {
    const int32_t id = ids.back();
    ids.pop_back();
    if (used_before[static_cast<size_t>(id)]) ++reused;
    used_before[static_cast<size_t>(id)] = true;
    return id;
  }
  void give(int32_t id) { ids.push_back(id); }
};

// The engine: K and V pools [blocks, 16, heads, dim] bf16, an index-key pool
// (native bf16 rows or FP8 blocks) of its own geometry, host copies written
// here and uploaded before each step into device buffers that stay put.
struct Engine {
  Device device;
  BlockSparseConfig c;
  bool fp8;
  int32_t kv_blocks, key_blocks, kv_max_blocks, key_max_blocks;
  int64_t row_elems, key_token_bytes;
  std::vector<uint8_t> k_pool, v_pool, key_pool;
  std::vector<int32_t> kv_table, key_table, lens;
  Buffer d_k, d_v, d_keys, d_kv_table, d_key_table, d_lens;
  FreeList kv_free, key_free;
  int64_t reused = 0;

  Engine(Device d, bool fp8_keys, std::mt19937_64& rng)
      : device(d),
        c(pools_config(KVStorage::kEnginePools)),
        fp8(fp8_keys),
        kv_blocks(static_cast<int32_t>(kSlots * kBound / kKvBlock + 8)),
        key_blocks(static_cast<int32_t>(kSlots * kBound / kKeyBlock + 4)),
        kv_max_blocks(static_cast<int32_t>(kBound / kKvBlock)),
        key_max_blocks(static_cast<int32_t>(kBound / kKeyBlock)),
        row_elems(int64_t{c.num_kv_heads} * c.head_dim),
        key_token_bytes(fp8_keys ? IndexKeyFp8::kTokenBytes : int64_t{c.head_dim} * 2),
        kv_table(static_cast<size_t>(kSlots) * kv_max_blocks, -1),
        key_table(static_cast<size_t>(kSlots) * key_max_blocks, -1),
        lens(kSlots, 0),
        kv_free(kv_blocks, rng),
        key_free(key_blocks, rng) {
    k_pool.assign(static_cast<size_t>(int64_t{kv_blocks} * kKvBlock * row_elems * 2), 0xFF);  // NaN
    v_pool = k_pool;
    key_pool.assign(static_cast<size_t>(int64_t{key_blocks} * kKeyBlock * key_token_bytes),
                    0xFF);  // NaN values and scales
    d_k = Buffer(d, k_pool.size());
    d_v = Buffer(d, v_pool.size());
    d_keys = Buffer(d, key_pool.size());
    d_kv_table = Buffer(d, kv_table.size() * 4);
    d_key_table = Buffer(d, key_table.size() * 4);
    d_lens = Buffer(d, lens.size() * 4);
  }
  // The key pool as the write op and the twin read it, over host or device memory.
  PagedIndexKeys keys(bool on_device) const {
    PagedIndexKeys k;
    k.format = fp8 ? IndexKeyFormat::kE4m3 : IndexKeyFormat::kNative;
    k.pool = on_device ? const_cast<void*>(d_keys.data()) : const_cast<uint8_t*>(key_pool.data());
    k.num_blocks = key_blocks;
    k.block_size = kKeyBlock;
    k.dtype = kDt;
    k.block_table = on_device ? d_key_table.as<int32_t>() : key_table.data();
    k.block_table_stride = key_max_blocks;
    k.max_blocks = key_max_blocks;
    return k;
  }
  // Appends one token's rows to slot b: K and V [heads, dim], its index key
  // [dim]; returns the key as the twin's cache holds it (FP8: dequantized).
  std::vector<uint8_t> write(int32_t b, const std::vector<uint8_t>& k, const std::vector<uint8_t>& v,
                             const std::vector<uint8_t>& key) {
    const int64_t pos = lens[static_cast<size_t>(b)];
    int32_t& kv_entry = kv_table[static_cast<size_t>(b * kv_max_blocks + pos / kKvBlock)];
    if (pos % kKvBlock == 0) kv_entry = kv_free.take(reused);
    int32_t& key_entry = key_table[static_cast<size_t>(b * key_max_blocks + pos / kKeyBlock)];
    if (pos % kKeyBlock == 0) key_entry = key_free.take(reused);
    const size_t row = static_cast<size_t>((int64_t{kv_entry} * kKvBlock + pos % kKvBlock) * row_elems * 2);
    std::memcpy(&k_pool[row], k.data(), static_cast<size_t>(row_elems) * 2);
    std::memcpy(&v_pool[row], v.data(), static_cast<size_t>(row_elems) * 2);
    const int64_t slot = int64_t{key_entry} * kKeyBlock + pos % kKeyBlock;
    write_index_keys_cpu(keys(false), c.head_dim, kDt, key.data(), c.head_dim, &slot, 1);
    ++lens[static_cast<size_t>(b)];
    if (!fp8) return key;
    const uint8_t* block = key_pool.data() + int64_t{key_entry} * kKeyBlock * key_token_bytes;
    float scale;
    std::memcpy(&scale, block + IndexKeyFp8::scale_offset(kKeyBlock, static_cast<int32_t>(pos % kKeyBlock)), 4);
    std::vector<uint8_t> out(static_cast<size_t>(c.head_dim) * 2);
    for (int32_t i = 0; i < c.head_dim; ++i) {
      // e4m3 x a power-of-two scale: exact in bf16.
      const uint16_t bits = float_to_bf16(
          e4m3_to_float(block[IndexKeyFp8::value_offset(kKeyBlock, static_cast<int32_t>(pos % kKeyBlock)) + i]) *
          scale);
      std::memcpy(&out[size_t(i) * 2], &bits, 2);
    }
    return out;
  }
  // Ends slot b's request: its blocks poisoned again and back on the free lists.
  void release(int32_t b) {
    for (int32_t e = 0; e < kv_max_blocks; ++e) {
      int32_t& id = kv_table[static_cast<size_t>(b * kv_max_blocks + e)];
      if (id < 0) continue;
      const size_t first = static_cast<size_t>(int64_t{id} * kKvBlock * row_elems * 2);
      std::fill(k_pool.begin() + first, k_pool.begin() + first + size_t(kKvBlock * row_elems * 2), uint8_t{0xFF});
      std::fill(v_pool.begin() + first, v_pool.begin() + first + size_t(kKvBlock * row_elems * 2), uint8_t{0xFF});
      kv_free.give(id);
      id = -1;
    }
    for (int32_t e = 0; e < key_max_blocks; ++e) {
      int32_t& id = key_table[static_cast<size_t>(b * key_max_blocks + e)];
      if (id < 0) continue;
      const size_t first = static_cast<size_t>(int64_t{id} * kKeyBlock * key_token_bytes);
      std::fill(key_pool.begin() + first, key_pool.begin() + first + size_t(kKeyBlock * key_token_bytes),
                uint8_t{0xFF});
      key_free.give(id);
      id = -1;
    }
    lens[static_cast<size_t>(b)] = 0;
  }
  void upload_all() {
    copy_bytes(d_k.data(), device, k_pool.data(), Device::kCpu, k_pool.size());
    copy_bytes(d_v.data(), device, v_pool.data(), Device::kCpu, v_pool.size());
    copy_bytes(d_keys.data(), device, key_pool.data(), Device::kCpu, key_pool.size());
    copy_bytes(d_kv_table.data(), device, kv_table.data(), Device::kCpu, kv_table.size() * 4);
    copy_bytes(d_key_table.data(), device, key_table.data(), Device::kCpu, key_table.size() * 4);
    copy_bytes(d_lens.data(), device, lens.data(), Device::kCpu, lens.size() * 4);
  }
  // The K/V pools as both arms read them (the twin: without keys and lengths).
  EnginePagedKV kv(bool pools, int64_t max_seq_len) const {
    EnginePagedKV kv;
    const auto rows = [&](const Buffer& b) {
      RowView v;
      v.data = b.data();
      v.row_stride = row_elems;
      v.dim = c.head_dim;
      v.head_stride = c.head_dim;
      v.capacity = int64_t{kv_blocks} * kKvBlock;
      return v;
    };
    kv.k = rows(d_k);
    kv.v = rows(d_v);
    kv.block_table.data = d_kv_table.as<int32_t>();
    kv.block_table.row_stride = kv_max_blocks;
    kv.block_table.max_blocks = kv_max_blocks;
    kv.block_table.num_rows = kSlots;
    kv.block_table.block_size = kKvBlock;
    kv.block_table.num_blocks = kv_blocks;
    if (pools) {
      kv.seq_lens = d_lens.as<int32_t>();
      kv.max_seq_len = max_seq_len;
      kv.index_keys = keys(true);
    }
    return kv;
  }
};

// One step's device inputs, in buffers that stay put (a captured step reads them on every replay).
struct StepInputs {
  Buffer q, iq, twin_key, o, twin_o;
  size_t q_elems, iq_elems, key_elems;
  StepInputs(Device d, const BlockSparseConfig& c)
      : q_elems(size_t(c.num_qo_heads) * c.head_dim),
        iq_elems(size_t(c.num_kv_heads) * c.head_dim),
        key_elems(size_t(c.head_dim)) {
    q = Buffer(d, kSlots * q_elems * 2);
    iq = Buffer(d, kSlots * iq_elems * 2);
    twin_key = Buffer(d, kSlots * key_elems * 2);
    o = Buffer(d, kSlots * q_elems * 2);
    twin_o = Buffer(d, kSlots * q_elems * 2);
  }
};

struct Request {
  int64_t prompt = 0, remaining = 0;
};

// The scripted run: step -> (slot, prompt) joins (prompt 0: the slot's request leaves).
const std::multimap<int32_t, std::pair<int32_t, int64_t>> kScript = {
    {0, {1, 200}}, {0, {2, 700}}, {0, {3, 1100}},  // slot 0 starts empty
    {4, {3, 0}},   {5, {0, 900}},                  // slot 3 leaves; slot 0 takes its blocks
    {8, {1, 0}},   {9, {1, 30}},  {9, {3, 508}},   // slot 3 crosses into the sparse regime (512)
    {12, {2, 0}},
};
constexpr int32_t kSteps = 15;

// The run (gtest assertions inside, so it returns void and reports through `stats`).
void drive(Device device, const BlockPoolsRun& run, BlockPoolsStats& stats) {
  std::mt19937_64 rng(run.fp8_keys ? 811 : 812);
  Engine eng(device, run.fp8_keys, rng);
  const BlockSparseConfig& c = eng.c;
  const size_t hd = size_t(c.num_kv_heads) * c.head_dim, d = size_t(c.head_dim);
  BlockSparseAttention layer(device, kDt, c, kSlots);
  BlockSparseAttention twin(device, kDt, pools_config(KVStorage::kEnginePaged), kSlots,
                            always_fuse().without_performance_gates());
  layer.reserve(kBound);
  twin.reserve(kBound);
  for (int32_t s = 0; s < kSlots; ++s) twin.release(s);
  StepInputs in(device, c);
  std::vector<bool> live(kSlots, false);

  for (int32_t step = 0; step < kSteps; ++step) {
    const auto [first, last] = kScript.equal_range(step);
    for (auto it = first; it != last; ++it) {
      const auto [slot, prompt] = it->second;
      if (prompt == 0) {
        eng.release(slot);
        twin.release(slot);
        live[size_t(slot)] = false;
        continue;
      }
      std::vector<uint8_t> keys;  // the twin's prompt keys [1, prompt, dim]
      for (int64_t t = 0; t < prompt; ++t) {
        const auto k = random_values(kDt, hd, rng), v = random_values(kDt, hd, rng), key = random_values(kDt, d, rng);
        const auto held = eng.write(slot, k, v, key);
        keys.insert(keys.end(), held.begin(), held.end());
      }
      const Buffer dk = upload(device, keys);
      twin.admit(slot, dk.data(), nullptr, prompt);
      live[size_t(slot)] = true;
    }
    // This step's token of every live slot (the engine writes it first); free slots' inputs NaN.
    std::vector<uint8_t> q = nan_values(kDt, kSlots * in.q_elems), iq = nan_values(kDt, kSlots * in.iq_elems),
                         twin_key = nan_values(kDt, kSlots * d);
    for (int32_t s = 0; s < kSlots; ++s) {
      if (!live[size_t(s)]) continue;
      const auto k = random_values(kDt, hd, rng), v = random_values(kDt, hd, rng), key = random_values(kDt, d, rng);
      const auto held = eng.write(s, k, v, key);
      std::copy(held.begin(), held.end(), twin_key.begin() + std::ptrdiff_t(s * d * 2));
      const auto qs = random_values(kDt, in.q_elems, rng), iqs = random_values(kDt, in.iq_elems, rng);
      std::copy(qs.begin(), qs.end(), q.begin() + std::ptrdiff_t(s * in.q_elems * 2));
      std::copy(iqs.begin(), iqs.end(), iq.begin() + std::ptrdiff_t(s * in.iq_elems * 2));
    }
    eng.upload_all();
    copy_bytes(in.q.data(), device, q.data(), Device::kCpu, q.size());
    copy_bytes(in.iq.data(), device, iq.data(), Device::kCpu, iq.size());
    copy_bytes(in.twin_key.data(), device, twin_key.data(), Device::kCpu, twin_key.size());
    fill_bytes(in.o.data(), device, 0xFF, in.o.bytes());
    fill_bytes(in.twin_o.data(), device, 0xFF, in.twin_o.bytes());
    const int64_t longest = *std::max_element(eng.lens.begin(), eng.lens.end());
    const int64_t bound = run.runner ? kBound : std::max<int64_t>(longest, 1);

    const EnginePagedKV kv = eng.kv(true, bound);
    BlockSparseTokens t;
    t.q = in.q.data();
    t.index_q = in.iq.data();
    t.o = in.o.data();
    const auto one_step = [&](void* stream) { return layer.decode(t, kv, stream); };
    const LayerStep got = run.runner ? run.runner(one_step) : one_step(nullptr);
    ASSERT_TRUE(got.fused) << got.outcome.reason;
    ASSERT_NO_THROW(layer.check_errors()) << "step " << step << ": a good step flags nothing";
    BlockSparseTokens tt;
    tt.q = in.q.data();
    tt.index_q = in.iq.data();
    tt.index_k = in.twin_key.data();
    tt.o = in.twin_o.data();
    const LayerStep want = twin.decode(tt, eng.kv(false, 0));
    ASSERT_TRUE(want.fused) << want.outcome.reason;

    const auto blocks = layer.last_blocks(), twin_blocks = twin.last_blocks();
    const auto o = download<uint16_t>(device, in.o.data(), kSlots * in.q_elems);
    const auto twin_o = download<uint16_t>(device, in.twin_o.data(), kSlots * in.q_elems);
    for (int32_t s = 0; s < kSlots; ++s) {
      const std::string at = "step " + std::to_string(step) + ", slot " + std::to_string(s) + ", length " +
                             std::to_string(eng.lens[size_t(s)]);
      const auto first_o = o.begin() + std::ptrdiff_t(s * in.q_elems);
      if (!live[size_t(s)]) {
        for (auto x = first_o; x != first_o + std::ptrdiff_t(in.q_elems); ++x)
          ASSERT_EQ(*x & 0x7FFF, 0) << at << ": free slot";
        for (int32_t h = 0; h < c.num_kv_heads; ++h) EXPECT_TRUE(blocks[size_t(s * c.num_kv_heads + h)].empty()) << at;
        ++stats.free_rows;
        continue;
      }
      ASSERT_EQ(twin.kv_lens()[size_t(s)], eng.lens[size_t(s)]) << at;
      for (int32_t h = 0; h < c.num_kv_heads; ++h) {
        const size_t r = size_t(s * c.num_kv_heads + h);
        ASSERT_EQ(blocks[r], twin_blocks[r]) << at << ", KV head " << h;
      }
      std::vector<float> mine(in.q_elems);
      std::vector<double> ref(in.q_elems);
      bool same_bits = true;
      for (size_t i = 0; i < in.q_elems; ++i) {
        const uint16_t a = first_o[std::ptrdiff_t(i)], b = twin_o[s * in.q_elems + i];
        mine[i] = bf16_to_float(a);
        ref[i] = bf16_to_float(b);
        ASSERT_FALSE(std::isnan(mine[i])) << at << ": NaN (a poisoned row read, or an unwritten output)";
        same_bits = same_bits && a == b;
      }
      if (!run.runner) {
        EXPECT_TRUE(same_bits) << at << ": the pools step differs from its twin in the bits";
        ++stats.bitwise_rows;
      }
      EXPECT_LT(relative_l2(mine, ref), 1e-2) << at;
      ++stats.compared_rows;
      stats.sparse_rows += c.sparse_regime(eng.lens[size_t(s)]) ? 1 : 0;
    }
  }
  stats.reused_blocks = eng.reused;
}

}  // namespace

BlockPoolsStats check_block_sparse_engine_pools(Device device, const BlockPoolsRun& run) {
  BlockPoolsStats stats;
  drive(device, run, stats);
  return stats;
}

void check_block_sparse_engine_pools_refusals(Device device, bool fp8_keys) {
  std::mt19937_64 rng(fp8_keys ? 913 : 914);
  Engine eng(device, fp8_keys, rng);
  const BlockSparseConfig& c = eng.c;
  const size_t hd = size_t(c.num_kv_heads) * c.head_dim, d = size_t(c.head_dim);
  // Slot 0 in its sparse regime, slot 1 long and sparse too, slots 2 and 3 empty.
  for (const auto& [slot, n] : {std::pair<int32_t, int64_t>{0, 800}, {1, 1000}}) {
    for (int64_t i = 0; i < n; ++i) {
      eng.write(slot, random_values(kDt, hd, rng), random_values(kDt, hd, rng), random_values(kDt, d, rng));
    }
  }
  eng.upload_all();
  StepInputs in(device, c);
  copy_bytes(in.q.data(), device, random_values(kDt, kSlots * in.q_elems, rng).data(), Device::kCpu, in.q.bytes());
  copy_bytes(in.iq.data(), device, random_values(kDt, kSlots * in.iq_elems, rng).data(), Device::kCpu, in.iq.bytes());
  BlockSparseAttention layer(device, kDt, c, kSlots);
  layer.reserve(kBound);
  BlockSparseTokens t;
  t.q = in.q.data();
  t.index_q = in.iq.data();
  t.o = in.o.data();
  // A bound below the key table's reach (1280), so a length past it is refused for the bound alone.
  constexpr int64_t kStepBound = 1100;
  const EnginePagedKV kv = eng.kv(true, kStepBound);
  fill_bytes(in.o.data(), device, 0xFF, in.o.bytes());
  ASSERT_TRUE(layer.decode(t, kv).fused);
  ASSERT_NO_THROW(layer.check_errors());
  const auto good = download<uint16_t>(device, in.o.data(), kSlots * in.q_elems);
  const auto blocks = layer.last_blocks();
  const auto pools_before = [&] {
    std::vector<uint8_t> all = download<uint8_t>(device, eng.d_k.data(), eng.d_k.bytes());
    const auto v = download<uint8_t>(device, eng.d_v.data(), eng.d_v.bytes());
    const auto k = download<uint8_t>(device, eng.d_keys.data(), eng.d_keys.bytes());
    all.insert(all.end(), v.begin(), v.end());
    all.insert(all.end(), k.begin(), k.end());
    return all;
  };
  const std::vector<uint8_t> pools = pools_before();

  // A refusal of slot 1. On the CPU a length (host memory there) is named
  // by the step itself before anything runs; a bad key block is refused by
  // the indexer, and the CPU decode then refuses the step. On CUDA the step
  // runs, poisons slot 1 alone and flags it. A flag is named by
  // check_errors(), and the pools are unchanged either way.
  const auto refused = [&](const std::string& what, const std::function<void(Engine&)>& spoil,
                           const std::string& needle) {
    Engine& e = eng;
    spoil(e);
    e.upload_all();
    fill_bytes(in.o.data(), device, 0xFF, in.o.bytes());
    bool named_by_the_step = false;
    if (device == Device::kCpu) {
      try {
        layer.decode(t, kv);
        ADD_FAILURE() << what << ": accepted";
      } catch (const Error& err) {
        named_by_the_step = std::string(err.what()).find(needle) != std::string::npos;
      }
    } else {
      layer.decode(t, kv);
    }
    if (named_by_the_step) {
      EXPECT_NO_THROW(layer.check_errors()) << what << ": refused up front, yet flagged too";
    } else {
      try {
        layer.check_errors();
        ADD_FAILURE() << what << ": not reported";
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << what << ": " << err.what();
      }
    }
    EXPECT_NO_THROW(layer.check_errors()) << what << ": reading the flags clears them";
    if (device == Device::kCuda) {
      const auto o = download<uint16_t>(device, in.o.data(), kSlots * in.q_elems);
      for (size_t i = 0; i < in.q_elems; ++i) ASSERT_EQ(o[i], good[i]) << what << ": slot 0 must stand";
      const auto after = layer.last_blocks();
      EXPECT_TRUE(after[2].empty() && after[3].empty()) << what << ": slot 1 selected blocks";
    }
  };
  const int32_t saved_len = eng.lens[1];
  refused(
      "a length past max_seq_len", [&](Engine& e) { e.lens[1] = static_cast<int32_t>(kStepBound + 3); }, "max_seq_len");
  refused(
      "a negative length", [&](Engine& e) { e.lens[1] = -5; }, "max_seq_len");
  eng.lens[1] = saved_len;
  int32_t& entry = eng.key_table[size_t(1 * eng.key_max_blocks + 3)];  // a scored block's keys
  const int32_t saved_entry = entry;
  refused(
      "a key block past the pool", [&](Engine& e) { e.key_table[size_t(1 * e.key_max_blocks + 3)] = e.key_blocks + 2; },
      "outside the index-key pool");
  refused(
      "a negative key block", [&](Engine& e) { e.key_table[size_t(1 * e.key_max_blocks + 3)] = -7; },
      "outside the index-key pool");
  entry = saved_entry;
  eng.upload_all();
  EXPECT_EQ(pools_before(), pools) << "a refused step wrote into the engine's pools";
  // Restored, the same step selects and writes what it did before.
  fill_bytes(in.o.data(), device, 0xFF, in.o.bytes());
  layer.decode(t, kv);
  ASSERT_NO_THROW(layer.check_errors());
  EXPECT_EQ(layer.last_blocks(), blocks);
  EXPECT_EQ(download<uint16_t>(device, in.o.data(), kSlots * in.q_elems), good);

  // Refused on the host, before anything runs.
  EnginePagedKV no_lens = kv;
  no_lens.seq_lens = nullptr;
  EXPECT_TRUE(throws_error_naming([&] { layer.decode(t, no_lens); }, "seq_lens"));
  BlockSparseTokens with_key = t;
  with_key.index_k = in.iq.data();
  EXPECT_TRUE(throws_error_naming([&] { layer.decode(with_key, kv); }, "index_k must be null"));
  EnginePagedKV narrow = kv;
  narrow.index_keys.max_blocks = 8;
  EXPECT_TRUE(throws_error_naming([&] { layer.decode(t, narrow); }, "fewer than max_seq_len"));
  if (!fp8_keys) {
    EnginePagedKV f16_keys = kv;
    f16_keys.index_keys.dtype = DType::kF16;
    EXPECT_TRUE(throws_error_naming([&] { layer.decode(t, f16_keys); }, "f16 keys"));
  }
  EnginePagedKV no_pool = kv;
  no_pool.index_keys.pool = nullptr;
  EXPECT_TRUE(throws_error_naming([&] { layer.decode(t, no_pool); }, "kv.index_keys"));
  EXPECT_TRUE(throws_error_naming([&] { layer.admit(0, in.iq.data(), nullptr, 1); }, "keeps no sequences"));
  EXPECT_TRUE(throws_error_naming([&] { layer.release(0); }, "keeps no sequences"));
  EXPECT_TRUE(throws_error_naming([&] { layer.decode(t); }, "decode(tokens, kv)"));
  // The engine-paged twin refuses the pools' fields.
  BlockSparseAttention paged(device, kDt, pools_config(KVStorage::kEnginePaged), kSlots);
  BlockSparseTokens pt = t;
  pt.index_k = in.twin_key.data();
  EXPECT_TRUE(throws_error_naming([&] { paged.decode(pt, kv); }, "KVStorage::kEnginePools"));
}

void expect_block_pools_coverage(const BlockPoolsStats& s, bool bitwise) {
  EXPECT_GE(s.compared_rows, 40);
  EXPECT_GE(s.sparse_rows, 20) << "sequences in their sparse regime";
  EXPECT_GE(s.compared_rows - s.sparse_rows, 10) << "sequences in their dense regime";
  EXPECT_GE(s.free_rows, 4);
  EXPECT_GT(s.reused_blocks, 0) << "a released request's blocks must be handed out again";
  if (bitwise) {
    EXPECT_EQ(s.bitwise_rows, s.compared_rows);
  }
}

}  // namespace sparsepage::testing
