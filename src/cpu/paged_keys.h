// An engine's index keys read on the host, as the CPU block indexers (the
// decode's and the prefill's) read them: position t of a sequence through
// its key-table row, native keys widened to float, FP8 keys as each e4m3
// value times the key's scale.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "sparsepage/index_keys.h"
#include "sparsepage/types.h"

namespace sparsepage::cpu {

/// Key `t` of the sequence whose key-table row is `table` (every entry the
/// caller reaches already judged inside the pool), `d` floats into `out`.
inline void paged_key_row(const PagedIndexKeys& k, int64_t block_bytes, int64_t token_bytes, size_t d,
                          const int32_t* table, int64_t t, float* out) {
  const char* block = static_cast<const char*>(k.pool) + table[t / k.block_size] * block_bytes;
  const auto slot = static_cast<int32_t>(t % k.block_size);
  if (k.format == IndexKeyFormat::kNative) {
    to_float(k.dtype, block + slot * token_bytes, out, d);
    return;
  }
  float scale;
  std::memcpy(&scale, block + IndexKeyFp8::scale_offset(k.block_size, slot), sizeof(float));
  const auto* values = reinterpret_cast<const uint8_t*>(block + IndexKeyFp8::value_offset(k.block_size, slot));
  for (size_t i = 0; i < d; ++i) out[i] = e4m3_to_float(values[i]) * scale;
}

}  // namespace sparsepage::cpu
