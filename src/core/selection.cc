#include "sparsepage/selection.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "core/cuda_hooks.h"
#include "sparsepage/dispatch.h"

namespace sparsepage {

namespace {

// Counts are host facts every reader trusts for offsets into `indices`: a
// negative one would make a reader index before the array.
int64_t checked_total(const std::vector<int32_t>& counts) {
  int64_t sum = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    if (counts[r] < 0) {
      throw Error("SparseSelection: counts[" + std::to_string(r) + "] = " + std::to_string(counts[r]) + " is negative");
    }
    sum += counts[r];
  }
  if (sum > std::numeric_limits<int32_t>::max()) {
    throw Error("SparseSelection: counts sum to " + std::to_string(sum) + ", more than 2^31 - 1 rows");
  }
  if (counts.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw Error("SparseSelection: more than 2^31 - 1 requests");
  }
  return sum;
}

}  // namespace

int64_t SparseSelection::total() const { return checked_total(counts); }

std::vector<int32_t> SparseSelection::offsets() const {
  checked_total(counts);
  std::vector<int32_t> out(counts.size() + 1, 0);
  for (size_t r = 0; r < counts.size(); ++r) out[r + 1] = out[r] + counts[r];
  return out;
}

std::vector<std::vector<int32_t>> SparseSelection::materialize() const {
  if (static_cast<int64_t>(indices.bytes() / sizeof(int32_t)) < total()) {  // total() rejects negative counts
    throw Error("SparseSelection::materialize: counts sum to " + std::to_string(total()) + " but indices hold " +
                std::to_string(indices.bytes() / sizeof(int32_t)));
  }
  const std::vector<int32_t> flat = download<int32_t>(indices.device(), indices.data(), static_cast<size_t>(total()));
  std::vector<std::vector<int32_t>> rows(counts.size());
  size_t at = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    rows[r].assign(flat.begin() + static_cast<std::ptrdiff_t>(at),
                   flat.begin() + static_cast<std::ptrdiff_t>(at + counts[r]));
    at += static_cast<size_t>(counts[r]);
  }
  return rows;
}

SparseSelection make_selection(Device device, const std::vector<std::vector<int32_t>>& rows) {
  SparseSelection selection;
  std::vector<int32_t> flat;
  for (const auto& request : rows) {
    if (request.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()) - flat.size()) {
      throw Error("make_selection: more than 2^31 - 1 rows in total");
    }
    selection.counts.push_back(static_cast<int32_t>(request.size()));
    flat.insert(flat.end(), request.begin(), request.end());
  }
  selection.indices = upload(device, flat);
  return selection;
}

bool dump_selection_enabled() {
  static const bool enabled = parse_debug_switch(std::getenv("SPARSEPAGE_DUMP_SELECTION"));
  return enabled;
}

bool dump_selection_if_enabled(const SparseSelection& selection, const char* label) {
  if (!dump_selection_enabled()) return false;
  const auto rows = selection.materialize();
  for (size_t r = 0; r < rows.size(); ++r) {
    std::fprintf(stderr, "sparsepage selection %s request %zu (%zu rows):", label, r, rows[r].size());
    for (int32_t row : rows[r]) std::fprintf(stderr, " %d", row);
    std::fprintf(stderr, "\n");
  }
  return true;
}

SparseSelection selection_from_blocks(const Buffer& block_ids, const std::vector<int32_t>& block_counts,
                                      int32_t block_size, const std::vector<int64_t>& row_base,
                                      const std::vector<int64_t>& live_lens, void* stream) {
  const size_t n = block_counts.size();
  if (block_size < 1) throw Error("selection_from_blocks: block_size = " + std::to_string(block_size) + " < 1");
  if (row_base.size() != n || live_lens.size() != n) {
    throw Error("selection_from_blocks: block_counts, row_base and live_lens must have one entry per request (" +
                std::to_string(n) + ", " + std::to_string(row_base.size()) + ", " + std::to_string(live_lens.size()) +
                ")");
  }
  SparseSelection selection;
  std::vector<int32_t> block_offsets(n + 1, 0), row_offsets(n + 1, 0);
  for (size_t r = 0; r < n; ++r) {
    const int64_t blocks = block_counts[r];
    const int64_t live = live_lens[r];
    if (blocks < 0 || live < 0) {
      throw Error("selection_from_blocks: request " + std::to_string(r) + " has a negative count");
    }
    const int64_t tail = live % block_size;  // rows in a partial final block, 0 if none
    int64_t rows = blocks * block_size;
    if (blocks > 0 && tail != 0) rows -= block_size - tail;
    if (block_offsets[r] + blocks > std::numeric_limits<int32_t>::max() ||
        row_offsets[r] + rows > std::numeric_limits<int32_t>::max()) {
      throw Error("selection_from_blocks: more than 2^31 - 1 blocks or rows in total (at request " + std::to_string(r) +
                  ")");
    }
    block_offsets[r + 1] = block_offsets[r] + static_cast<int32_t>(blocks);
    row_offsets[r + 1] = row_offsets[r] + static_cast<int32_t>(rows);
    selection.counts.push_back(static_cast<int32_t>(rows));
  }
  const int64_t total_blocks = block_offsets[n];
  if (static_cast<int64_t>(block_ids.bytes()) < total_blocks * 4) {
    throw Error("selection_from_blocks: block_ids holds " + std::to_string(block_ids.bytes() / 4) +
                " ids, block_counts sum to " + std::to_string(total_blocks));
  }
  const Device device = block_ids.device();
  if (device == Device::kCuda) {
    // The ids are device data: the kernel writes -1 for a block outside its window.
    selection.indices = Buffer(device, static_cast<size_t>(row_offsets[n]) * 4);
    detail::cuda_stream_sync(stream);  // the ids may still be being written there
    Buffer d_block_offsets = upload(device, block_offsets);
    Buffer d_row_offsets = upload(device, row_offsets);
    Buffer d_row_base = upload(device, row_base);
    Buffer d_live = upload(device, live_lens);
    detail::selection_from_blocks_cuda(block_ids.as<int32_t>(), d_block_offsets.as<int32_t>(),
                                       d_row_offsets.as<int32_t>(), d_row_base.as<int64_t>(), d_live.as<int64_t>(),
                                       static_cast<int32_t>(n), block_size, selection.indices.as<int32_t>(), stream);
    detail::cuda_stream_sync(stream);  // the temporaries are freed on return
    return selection;
  }
  // Host ids: every one is judged before the output is allocated (counts
  // naming 2^31 rows behind one bad id used to reserve 8 GiB first).
  const int32_t* ids = block_ids.as<int32_t>();
  for (size_t r = 0; r < n; ++r) {
    const int64_t live = live_lens[r];
    int64_t at = row_offsets[r];
    for (int32_t i = block_offsets[r]; i < block_offsets[r + 1]; ++i) {
      const int64_t first = int64_t{ids[i]} * block_size;
      const bool last_entry = i + 1 == block_offsets[r + 1];
      const int64_t rows = std::min<int64_t>(block_size, live - first);
      if (ids[i] < 0 || rows <= 0 || (rows < block_size && !last_entry)) {
        throw Error("selection_from_blocks: request " + std::to_string(r) + " names block " + std::to_string(ids[i]) +
                    (rows < block_size && rows > 0
                         ? " (the partial final block) before its last entry"
                         : " outside its live window of " + std::to_string(live) + " tokens"));
      }
      if (rows < block_size && live % block_size == 0) {
        throw Error("selection_from_blocks: request " + std::to_string(r) + " block " + std::to_string(ids[i]) +
                    " is partial but the window has no partial block");
      }
      if (at + rows > row_offsets[r + 1]) {
        throw Error("selection_from_blocks: request " + std::to_string(r) + " has a partial final block (live length " +
                    std::to_string(live) + ") that is not among its blocks");
      }
      if (row_base[r] < 0 || row_base[r] + first + rows - 1 > std::numeric_limits<int32_t>::max()) {
        throw Error("selection_from_blocks: request " + std::to_string(r) + " rows from row_base " +
                    std::to_string(row_base[r]) + " do not fit int32 pool rows");
      }
      at += rows;
    }
    if (at != row_offsets[r + 1]) {
      throw Error("selection_from_blocks: request " + std::to_string(r) + " has a partial final block (live length " +
                  std::to_string(live) + ") that is not its last entry");
    }
  }
  selection.indices = Buffer(device, static_cast<size_t>(row_offsets[n]) * 4);
  int32_t* out = selection.indices.as<int32_t>();
  for (size_t r = 0; r < n; ++r) {
    int32_t at = row_offsets[r];
    for (int32_t i = block_offsets[r]; i < block_offsets[r + 1]; ++i) {
      const int64_t first = int64_t{ids[i]} * block_size;
      const int64_t rows = std::min<int64_t>(block_size, live_lens[r] - first);
      for (int64_t j = 0; j < rows; ++j) out[at++] = static_cast<int32_t>(row_base[r] + first + j);
    }
  }
  return selection;
}

}  // namespace sparsepage
