// Host copies of a block-sparse layer's last selection, for tests and
// debugging: the kept block matrix read back, and the positions a
// block-granular page table attends. The block-sparse and static-pattern
// layers both keep their selection in this form.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/memory.h"

namespace sparsepage::detail {

/// Per request, the ids >= 0 of its row of a [requests, width] int32 block
/// matrix on `device` (the -1 padding dropped).
inline std::vector<std::vector<int32_t>> download_kept_blocks(Device device, const void* ids, int32_t requests,
                                                              int32_t width) {
  const auto flat = download<int32_t>(device, ids, static_cast<size_t>(requests) * static_cast<size_t>(width));
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(requests));
  for (size_t i = 0; i < flat.size(); ++i) {
    if (flat[i] >= 0) out[i / static_cast<size_t>(width)].push_back(flat[i]);
  }
  return out;
}

/// The positions request r attends: tokens 0 .. counts[r] - 1 of its block
/// list, page i covering tokens i * block_size .. (the kernel's own reading
/// of a block-granular table). `counts` is a [requests] int32 array on `device`.
inline std::vector<std::vector<int32_t>> kept_block_positions(Device device,
                                                              const std::vector<std::vector<int32_t>>& blocks,
                                                              const void* counts, int32_t block_size) {
  const auto lens = download<int32_t>(device, counts, blocks.size());
  std::vector<std::vector<int32_t>> out(blocks.size());
  for (size_t r = 0; r < blocks.size(); ++r) {
    for (int64_t token = 0; token < lens[r]; ++token) {
      const size_t page = static_cast<size_t>(token / block_size);
      out[r].push_back(static_cast<int32_t>(int64_t{blocks[r].at(page)} * block_size + token % block_size));
    }
  }
  return out;
}

}  // namespace sparsepage::detail
