// What the block-sparse and static-pattern layers share: host copies of
// their last selection for tests and debugging (the kept block matrix read
// back, the positions a block-granular page table attends), and the GQA
// half of their prefill chunks.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sparsepage/layer.h"
#include "sparsepage/memory.h"
#include "sparsepage/prefill.h"

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

/// Why a block layer cannot prefill a chunk of `num_tokens` tokens that
/// leaves its slots at `lens` (only `active` slots count), or "": the block
/// prefill's query blocks must be key blocks, so every chunk starts on a
/// block boundary, and a query block holds at most kMaxQueryBlockTokens.
/// `tail` says what serves the prompt's last partial block instead.
inline std::string block_chunk_refusal(int32_t block_size, const std::vector<uint8_t>& active,
                                       const std::vector<int64_t>& lens, int32_t num_tokens, const char* tail) {
  if (block_size > kMaxQueryBlockTokens) {
    return "block_size = " + std::to_string(block_size) + " is above the block prefill's " +
           std::to_string(kMaxQueryBlockTokens) + " tokens per query block";
  }
  for (size_t b = 0; b < lens.size(); ++b) {
    if (active[b] == 0) continue;
    const int64_t start = lens[b] - num_tokens;
    if (start % block_size != 0) {
      return "slot " + std::to_string(b) + "'s chunk would start at position " + std::to_string(start) +
             ", not a multiple of block_size = " + std::to_string(block_size) +
             " (query blocks must be key blocks: prefill whole blocks, the prompt's tail with " + tail + ")";
    }
  }
  return {};
}

/// The GQA shape of a block layer (block-sparse or static pattern), from
/// its config.
struct GqaChunkGeometry {
  int32_t num_qo_heads, num_kv_heads, block_size, head_dim;
};
template <class Config>
GqaChunkGeometry gqa_geometry(const Config& c) {
  return {c.num_qo_heads, c.num_kv_heads, c.block_size, c.head_dim};
}

/// The attention half of a block layer's prefill chunk: GQA over the kept
/// blocks of `kept` for the chunk's slots, reading K and V through `k` and
/// `v` (the layer's own rows from the chunk's first slot on; or an engine's
/// pool, with `table` its block table from that slot on) and the chunk's q
/// and o from `tokens`.
inline void run_gqa_chunk(GqaBlockPrefill& prefill, DType dtype, const RowView& k, const RowView& v,
                          const BlockTable& table, const PrefillChunk& chunk, const GqaChunkGeometry& g,
                          const StepTokens& tokens, BlockPrefillSelection kept, void* stream) {
  GqaPrefillParams p;
  p.dtype = dtype;
  p.chunk = chunk;
  p.num_qo_heads = g.num_qo_heads;
  p.num_kv_heads = g.num_kv_heads;
  p.block_size = g.block_size;
  p.q = tokens.q;
  p.k = k;
  p.v = v;
  p.block_table = table;
  p.scale = 1.0f / std::sqrt(static_cast<float>(g.head_dim));
  p.o = tokens.o;
  p.selection = kept;
  prefill.run(p, stream);
}

/// The positions the last prefill chunk of a GQA layer attended, per
/// (slot, chunk token, query head): `selection` is the chunk's selection on
/// `device` over every slot of the batch (`lists_per_block` lists per query
/// block of a slot), `lens` the slots' lengths after the chunk (0: a free
/// slot, whose rows stay empty). The library's gqa_prefill_attended per
/// active slot.
inline std::vector<std::vector<int32_t>> gqa_chunk_positions(Device device, BlockPrefillSelection selection,
                                                             int32_t lists_per_block, const GqaChunkGeometry& g,
                                                             const std::vector<int64_t>& lens, int32_t num_tokens) {
  const int64_t lists_per_slot = int64_t{(num_tokens + g.block_size - 1) / g.block_size} * lists_per_block;
  const auto batch = static_cast<int64_t>(lens.size());
  const auto width = static_cast<size_t>(selection.width);
  const auto lists = static_cast<size_t>(batch * lists_per_slot);
  const auto ids = download<int32_t>(device, selection.block_ids, lists * width);
  const auto counts = download<int32_t>(device, selection.counts, lists);
  const int64_t rows_per_slot = int64_t{num_tokens} * g.num_qo_heads;
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(batch * rows_per_slot));
  for (int64_t b = 0; b < batch; ++b) {
    if (lens[static_cast<size_t>(b)] == 0) continue;
    GqaPrefillParams p;
    p.chunk.num_tokens = num_tokens;
    p.chunk.kv_len = lens[static_cast<size_t>(b)];
    p.num_qo_heads = g.num_qo_heads;
    p.num_kv_heads = g.num_kv_heads;
    p.block_size = g.block_size;
    p.selection = selection;
    p.selection.block_ids = ids.data() + static_cast<size_t>(b * lists_per_slot) * width;
    p.selection.counts = counts.data() + static_cast<size_t>(b * lists_per_slot);
    auto rows = gqa_prefill_attended(p);
    for (size_t r = 0; r < rows.size(); ++r) out[static_cast<size_t>(b * rows_per_slot) + r] = std::move(rows[r]);
  }
  return out;
}

}  // namespace sparsepage::detail
