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

}  // namespace sparsepage
