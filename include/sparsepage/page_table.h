// The CSR page table (docs/DESIGN.md: the page table). Visible token i of request r lives at
//   pool page indices[indptr[r] + (first_page_offset[r] + i) / page_size],
//   slot (first_page_offset[r] + i) % page_size of that page,
// i.e. pool row page * page_size + slot. Pages may repeat, come in any order
// and need not be adjacent: each occurrence is read and counts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsepage {

/// Everything but `indices`, derived on the host from counts alone, so
/// building it never reads device memory.
struct PageTableStructure {
  int32_t page_size = 1;
  std::vector<int32_t> indptr;             // [num_requests + 1], indptr[0] == 0
  std::vector<int32_t> last_page_len;      // [num_requests], 0 for an empty request
  std::vector<int32_t> first_page_offset;  // [num_requests], in [0, page_size)
  std::vector<int32_t> seq_lens;           // [num_requests], visible tokens

  int32_t num_requests() const { return static_cast<int32_t>(seq_lens.size()); }
  /// Number of page entries (the length `indices` must have).
  int64_t num_pages() const { return indptr.empty() ? 0 : indptr.back(); }
  /// Sum of seq_lens.
  int64_t total_tokens() const;
};

/// Derives the structure from per-request visible counts. `first_page_offsets`
/// may be empty (all zero) or hold one offset per request.
/// Throws sparsepage::Error naming the argument on bad input (negative counts,
/// page_size < 1, an offset outside [0, page_size), more than 2^31-1 pages).
PageTableStructure build_page_table_structure(const std::vector<int32_t>& seq_lens, int32_t page_size,
                                              const std::vector<int32_t>& first_page_offsets = {});

/// The first invariant `table` breaks, or "" when it keeps them all (the
/// library's "problem" convention). With `indices` (host copy) and
/// `num_pool_pages` > 0 it also checks that every page id lies in
/// [0, num_pool_pages).
std::string page_table_problem(const PageTableStructure& table, const std::vector<int32_t>* indices = nullptr,
                               int64_t num_pool_pages = 0);

/// Throws sparsepage::Error with the validator's message when `table` is invalid.
void check_page_table(const PageTableStructure& table, const std::vector<int32_t>* indices = nullptr,
                      int64_t num_pool_pages = 0);

}  // namespace sparsepage
