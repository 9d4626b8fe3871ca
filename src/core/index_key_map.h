// The tensor map through which the CUDA DSA indexer's score kernels read
// their index keys by TMA (src/cuda/indexers/dsa_indexer.cu), as plain host
// data: what cuTensorMapEncodeTiled is handed for each key source, and the
// driver's documented rules for such a map, checked before the driver sees
// it. Host C++ with no CUDA types, so the CPU tests check every form the GPU
// tests run without a GPU (tests/cpu/index_key_map_test.cc).
//
// Every map is 3-d, tiled, no interleave, 128-byte swizzle, element strides
// 1, and its boxes land in the 64-row x 128-byte swizzled slabs the warpgroup
// MMAs read:
//   dense rows   (column, position, sequence): boxes of 64 columns x 64 positions
//   native pool  (column, row in block, block): boxes of 64 columns x
//                min(block_size, 64) rows, token_bytes apart in a block
//   FP8 pool     (byte, row in block, block) over the blocks' e4m3 values
//                only: a block's values are its first 128 x block_size
//                bytes, 128 bytes per token (index_keys.h), so rows are 128
//                bytes apart, not 132; the fp32 scales after them are read
//                by bulk copies. Boxes of all 128 bytes x min(block_size, 64) rows.
#pragma once

#include <cstdint>
#include <string>

#include "sparsepage/index_keys.h"
#include "sparsepage/types.h"

namespace sparsepage::detail {

/// Positions per key tile of the score kernels (the wgmma M); a paged box
/// holds min(block_size, kIndexKeyTileRows) rows of one block.
inline constexpr int32_t kIndexKeyTileRows = 64;
/// Native key columns per box: one 128-byte swizzled slab of f16 / bf16.
inline constexpr int32_t kIndexKeySlabColumns = 64;

/// The element type of a key map (the .cu maps it to CUtensorMapDataType).
enum class KeyMapElement : int32_t { kU8 = 0, kF16 = 1, kBF16 = 2 };

/// cuTensorMapEncodeTiled's arguments for one key map. Dimension 0 is the
/// innermost; strides are in bytes, for dimensions 1 and 2.
struct KeyTensorMap {
  KeyMapElement element = KeyMapElement::kBF16;
  const void* address = nullptr;
  uint64_t dims[3] = {0, 0, 0};
  uint64_t strides[2] = {0, 0};
  uint32_t box[3] = {0, 0, 0};
  uint32_t element_strides[3] = {1, 1, 1};
};

/// Bytes of one element of `e` (1 or 2).
int32_t key_map_element_bytes(KeyMapElement e);

/// "dims {..} strides {..} box {..} (<element>, address 0x..)": for errors.
std::string describe_key_map(const KeyTensorMap& map);

/// The first rule of cuTensorMapEncodeTiled (CUDA driver API, tensor map
/// object management: tiled maps with no interleave and the 128-byte swizzle)
/// that `map` breaks, named with its value and the rule, or "":
///   globalAddress non-null and 16-byte aligned;
///   globalDim[i] in [1, 2^32];
///   globalStrides[i] a multiple of 16, below 2^40, and at least the
///     previous dimension's extent (dims[0] x element bytes, then
///     dims[1] x strides[0]);
///   boxDim[i] in [1, 256]; boxDim[0] x element bytes a multiple of 16 and
///     at most 128 (the swizzle span);
///   elementStrides[i] in [1, 8].
/// (The rank, 3, is within the driver's 5 by construction.)
std::string key_map_problem(const KeyTensorMap& map);

/// Rows per TMA box of a paged pool with `block_size` tokens per block: the
/// whole block, or a 64-row piece of one.
int32_t paged_key_box_rows(int32_t block_size);

/// The map over the layer's dense K rows: `sequences` x `capacity` rows of
/// `row_elements` elements of `dtype`, the index key at column `key_offset`,
/// `dim` columns wide.
KeyTensorMap dense_key_map(DType dtype, const void* k_cache, int64_t row_elements, int32_t key_offset, int32_t dim,
                           int64_t capacity, int32_t sequences);

/// The map over an engine's paged pool (keys.format: native keys of
/// index_head_dim values, or the FP8 blocks' e4m3 values).
KeyTensorMap paged_key_map(const PagedIndexKeys& keys, int32_t index_head_dim);

}  // namespace sparsepage::detail
