// Selections: which rows a sparse model keeps for each request
// (docs/DESIGN.md: selections), in the two forms the entry point takes
// (sparse_decode.h). The content is device data (a top-k output) in both.
//   SparseSelection: ragged rows with host counts. Planned for the exact
//     counts (a change of counts re-plans: allocates and uploads), and the
//     form the mask path reads (MaskPath).
//   PagedSelection: a fixed-width page matrix with device counts. Planned
//     once for the width, pages of any size (block ids feed it directly):
//     the serving step's form, capturable.
// Neither is the other without a copy: a ragged list becomes a matrix only
// by padding it, and device counts become host counts only by reading back.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/memory.h"

namespace sparsepage {

/// Ragged rows with host counts (see the header comment).
struct SparseSelection {
  Buffer indices;               // int32 pool rows, requests concatenated, on `indices.device()`
  std::vector<int32_t> counts;  // [num_requests], host

  int32_t num_requests() const { return static_cast<int32_t>(counts.size()); }
  int64_t total() const;
  /// Per-request offsets into `indices` ([num_requests + 1]).
  std::vector<int32_t> offsets() const;
  /// Reads the rows back per request. Synchronizes; for tests and the dump
  /// switch only.
  std::vector<std::vector<int32_t>> materialize() const;
};

/// A selection as a serving step produces it on the device: a fixed-width
/// matrix of page ids per request and the tokens each request attends, both
/// device data, so a step whose counts change needs no host round trip.
/// Pages are pages of the request's own window: token positions when
/// page_size is 1, blocks of page_size positions otherwise (a block-sparse
/// selection feeds its block ids directly; a partial final block is the
/// request's last page, cut by seq_lens).
struct PagedSelection {
  const int32_t* pages = nullptr;     // [num_requests, width]; entries past a request's pages are never read
  const int32_t* seq_lens = nullptr;  // [num_requests] tokens attended, in [0, width * page_size]
  int32_t num_requests = 0;
  int32_t width = 0;  // pages per row: the bound the plan is made for
  int32_t page_size = 1;
  /// Host-side upper bound on any request's seq_lens entry (<= width *
  /// page_size): what the dispatch policy counts as selected.
  int64_t max_selected = 0;
};

/// Builds a selection from host row lists, uploading to `device`.
SparseSelection make_selection(Device device, const std::vector<std::vector<int32_t>>& rows);

/// Prints each request's selected rows on stderr when SPARSEPAGE_DUMP_SELECTION
/// is set (1, true, on, yes). Synchronizes: debugging only. Returns whether it printed.
bool dump_selection_if_enabled(const SparseSelection& selection, const char* label);
/// Whether SPARSEPAGE_DUMP_SELECTION is on (read once per process).
bool dump_selection_enabled();

}  // namespace sparsepage
