// Reading an engine's paged index keys on the device (core/paged_keys.h):
// where a position's key lies through the sequence's table row, and a
// 16-byte piece of it as T. The block decode indexer (block_indexer.cu) and
// the block prefill scores (block_prefill_indexer.cu) read keys through
// these; a block id outside the pool is never read, it refuses what needed it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/paged_keys.h"
#include "cuda/primitives/fp8_convert.cuh"

namespace sparsepage::detail {

/// Where a score kernel reads the index keys.
enum class KeySource : int {
  kRows = 0,      // the layer's rows (dense)
  kPaged = 1,     // an engine's pool of native rows, through its block table
  kPagedFp8 = 2,  // an engine's pool of vLLM's FP8 blocks (index_keys.h), through its block table
};

/// One key's bytes (null: not to be read) and, for FP8 keys, its scale.
struct KeyRow {
  const unsigned char* ptr;
  float scale;
};

/// Position `pos` of the sequence whose table row is `row`. A block id
/// outside the pool is not followed: the row is null and `refused` is set.
template <KeySource Src>
__device__ __forceinline__ KeyRow paged_key_row(const PagedKeys& k, const int32_t* row, int64_t pos, bool& refused) {
  static_assert(Src != KeySource::kRows, "paged sources only");
  const int64_t entry = pos / k.block_size, slot = pos - entry * k.block_size;
  const int32_t id = __ldg(row + entry);
  if (id < 0 || id >= k.num_blocks) {
    refused = true;
    return {nullptr, 0.0f};
  }
  const unsigned char* block = k.pool + int64_t{id} * k.block_bytes;
  if constexpr (Src == KeySource::kPaged) return {block + slot * k.token_bytes, 1.0f};
  // The format's offsets (index_keys.h, IndexKeyFp8): the values at 128 x
  // slot, the scales after the block's values.
  return {block + slot * 128, __ldg(reinterpret_cast<const float*>(block + int64_t{k.block_size} * 128) + slot)};
}

/// Elements first .. first + 7 of key row `r` (first a multiple of 8) as T
/// (zeros for a null row): 16 bytes of native keys, or 8 e4m3 values
/// widened to T (exact); an FP8 key's scale is the caller's to apply to its
/// products.
template <typename T, KeySource Src>
__device__ __forceinline__ uint4 key_piece(const KeyRow& r, int first) {
  if (r.ptr == nullptr) return make_uint4(0, 0, 0, 0);
  if constexpr (Src == KeySource::kPagedFp8) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(r.ptr + first));
    const uint2 lo = cuda::e4m3x4_to<T>(raw.x), hi = cuda::e4m3x4_to<T>(raw.y);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(r.ptr + first * int(sizeof(T))));
  }
}

}  // namespace sparsepage::detail
