// An engine's paged allocations for the engine-form checks: pools of rows
// in blocks of kEngineBlock rows, handed to the slots through a shuffled
// block table (a few blocks spare), every row NaN until the test, as the
// engine, writes it; and the engine's index keys in such a pool
// (EngineKeys). Header-only: the layer and the prefill checks share them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "sparsepage/fp8.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/memory.h"
#include "sparsepage/sparse_decode.h"
#include "support/reference.h"

namespace sparsepage::testing {

constexpr int32_t kEngineBlock = 16;  // the engine's block size (vLLM's default)

struct EnginePool {
  Device device;
  int32_t batch, max_blocks;
  int64_t row_elems, num_blocks;
  std::vector<int32_t> table;  // [batch, max_blocks]
  std::vector<Buffer> pools;
  Buffer table_dev;

  /// `num_pools` pools of rows `elems` bf16 values wide, `blocks_per_slot` blocks a slot.
  EnginePool(Device d, int32_t b, int32_t blocks_per_slot, int64_t elems, int32_t num_pools, std::mt19937_64& rng)
      : device(d),
        batch(b),
        max_blocks(blocks_per_slot),
        row_elems(elems),
        num_blocks(int64_t{b} * blocks_per_slot + 3) {
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    table.assign(ids.begin(), ids.begin() + int64_t{b} * blocks_per_slot);
    for (int32_t i = 0; i < num_pools; ++i)
      pools.push_back(upload(d, nan_values(DType::kBF16, static_cast<size_t>(num_blocks * kEngineBlock * row_elems))));
    table_dev = upload(d, table);
  }
  /// The pool row of position `pos` of slot `b`.
  int64_t slot(int32_t b, int64_t pos) const {
    return int64_t{table[static_cast<size_t>(int64_t{b} * max_blocks + pos / kEngineBlock)]} * kEngineBlock +
           pos % kEngineBlock;
  }
  /// Writes a row's bytes as they are (row_elems * 2 of them) at position `pos` of slot `b` of pool `i`.
  void write_bytes(int32_t i, int32_t b, int64_t pos, const uint8_t* row) {
    copy_bytes(static_cast<char*>(pools[static_cast<size_t>(i)].data()) + slot(b, pos) * row_elems * 2, device, row,
               Device::kCpu, static_cast<size_t>(row_elems) * 2);
  }
  /// The same from row_elems float values, as bf16.
  void write(int32_t i, int32_t b, int64_t pos, const float* row) {
    std::vector<uint8_t> bytes(static_cast<size_t>(row_elems) * 2);
    from_float(DType::kBF16, row, bytes.data(), static_cast<size_t>(row_elems));
    write_bytes(i, b, pos, bytes.data());
  }
  BlockTable block_table() const {
    BlockTable t;
    t.data = table_dev.as<int32_t>();
    t.row_stride = max_blocks;
    t.max_blocks = max_blocks;
    t.num_rows = batch;
    t.block_size = kEngineBlock;
    t.num_blocks = num_blocks;
    return t;
  }
  /// `dim` values at column `column` of pool i's rows, `heads` heads `dim` apart.
  RowView rows(int32_t i, int64_t column, int32_t dim, int32_t heads) const {
    RowView v;
    v.data = static_cast<const char*>(pools[static_cast<size_t>(i)].data()) + column * 2;
    v.row_stride = row_elems;
    v.dim = dim;
    v.head_stride = heads > 1 ? dim : 0;
    v.capacity = num_blocks * kEngineBlock;
    return v;
  }
  /// Pools 0 and 1 as K and V: [num_blocks, 16, heads, dim], head h at column h * dim.
  EnginePagedKV kv(int32_t dim, int32_t heads) const {
    EnginePagedKV kv;
    kv.k = rows(0, 0, dim, heads);
    kv.v = rows(1, 0, dim, heads);
    kv.block_table = block_table();
    return kv;
  }
  /// Pool 0 as MLA rows: [latent | rope] bf16, or with `fp8` the engines' 656-byte FP8 rows.
  EnginePagedKV mla_kv(int32_t latent, int32_t rope, bool fp8) const {
    EnginePagedKV kv;
    if (fp8) {
      const MlaFp8Views v = mla_fp8_views(pools[0].data(), num_blocks * kEngineBlock);
      kv.k = v.k;
      kv.v = v.v;
      kv.k_extra = v.k_extra;
      kv.kv_format = KvFormat::kE4m3Mla;
    } else {
      kv.k = rows(0, 0, latent, 1);
      kv.v = kv.k;
      kv.k_extra = rows(0, latent, rope, 1);
    }
    kv.block_table = block_table();
    return kv;
  }
};

// The engine's index keys `dim` values wide (bf16 rows, or with fp8 vLLM's
// FP8 blocks) in blocks of 16 through the pool's table, every unwritten byte
// 0xFF (NaN), written on the host; then, with the engine's lengths, on the device.
struct EngineKeys {
  const EnginePool& pool;
  int32_t dim;
  PagedIndexKeys host;
  std::vector<uint8_t> bytes;
  Buffer keys_dev, lens_dev;

  EngineKeys(const EnginePool& p, bool fp8, int32_t key_dim) : pool(p), dim(key_dim) {
    host.format = fp8 ? IndexKeyFormat::kE4m3 : IndexKeyFormat::kNative;
    host.dtype = DType::kBF16;
    host.num_blocks = pool.num_blocks;
    host.block_size = kEngineBlock;
    host.block_table = pool.table.data();
    host.block_table_stride = pool.max_blocks;
    host.max_blocks = pool.max_blocks;
    bytes.assign(static_cast<size_t>(pool.num_blocks * index_key_block_bytes(host, dim)), 0xFF);
    host.pool = bytes.data();
  }
  // Slot b's key at position p (dim values).
  void write(int32_t b, int64_t p, const float* key) {
    std::vector<uint8_t> row(static_cast<size_t>(dim) * 2);
    from_float(DType::kBF16, key, row.data(), static_cast<size_t>(dim));
    const int64_t slot = pool.slot(b, p);
    write_index_keys_cpu(host, dim, DType::kBF16, row.data(), dim, &slot, 1);
  }
  // `kv` for the pools form: the keys, and the lengths `lens` (with the chunk; 0 free) under `bound`.
  EnginePagedKV pools_kv(EnginePagedKV kv, const std::vector<int32_t>& lens, int64_t bound) {
    keys_dev = upload(pool.device, bytes);
    lens_dev = upload(pool.device, lens);
    kv.index_keys = host;
    kv.index_keys.pool = const_cast<void*>(keys_dev.data());
    kv.index_keys.block_table = pool.table_dev.as<int32_t>();
    kv.seq_lens = lens_dev.as<int32_t>();
    kv.max_seq_len = bound;
    return kv;
  }
};

}  // namespace sparsepage::testing
