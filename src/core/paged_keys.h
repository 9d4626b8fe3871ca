// An engine's paged index keys (sparsepage/index_keys.h) as the CUDA block
// indexers read them: plain fields a kernel's params carry by value. The
// device side (the address of a position, a 16-byte piece of a key) is in
// src/cuda/indexers/paged_keys.cuh.
#pragma once

#include <cstdint>

#include "sparsepage/index_keys.h"

namespace sparsepage::detail {

/// Position p of sequence b at slot p % block_size of block
/// table[b * table_stride + p / block_size].
struct PagedKeys {
  const unsigned char* pool;  // the blocks
  const int32_t* table;       // [batch, table_stride]
  int64_t table_stride;
  int64_t block_bytes;  // bytes between blocks
  int64_t token_bytes;  // native: bytes between a block's tokens
  int64_t num_blocks;   // ids outside [0, num_blocks) are never read: they refuse what needed them
  int64_t max_len;      // max_blocks x block_size: a longer sequence is refused
  int32_t block_size;
};

/// The view of `keys` (checked by paged_index_keys_problem) holding
/// index_head_dim values per key.
inline PagedKeys paged_keys_view(const PagedIndexKeys& keys, int32_t index_head_dim) {
  return PagedKeys{static_cast<const unsigned char*>(keys.pool),
                   keys.block_table,
                   keys.block_table_stride,
                   index_key_block_bytes(keys, index_head_dim),
                   index_key_token_bytes(keys, index_head_dim),
                   keys.num_blocks,
                   int64_t{keys.max_blocks} * keys.block_size,
                   keys.block_size};
}

}  // namespace sparsepage::detail
