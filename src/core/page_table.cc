#include "sparsepage/page_table.h"

#include <limits>
#include <sstream>

#include "sparsepage/types.h"

namespace sparsepage {

int64_t PageTableStructure::total_tokens() const {
  int64_t total = 0;
  for (int32_t len : seq_lens) total += len;
  return total;
}

PageTableStructure build_page_table_structure(const std::vector<int32_t>& seq_lens, int32_t page_size,
                                              const std::vector<int32_t>& first_page_offsets) {
  if (page_size < 1) {
    throw Error("page table: page_size = " + std::to_string(page_size) + " must be at least 1");
  }
  if (!first_page_offsets.empty() && first_page_offsets.size() != seq_lens.size()) {
    throw Error("page table: first_page_offsets has " + std::to_string(first_page_offsets.size()) + " entries for " +
                std::to_string(seq_lens.size()) + " requests");
  }
  PageTableStructure table;
  table.page_size = page_size;
  table.seq_lens = seq_lens;
  table.indptr.assign(seq_lens.size() + 1, 0);
  table.last_page_len.assign(seq_lens.size(), 0);
  table.first_page_offset.assign(seq_lens.size(), 0);
  int64_t pages_so_far = 0;
  for (size_t r = 0; r < seq_lens.size(); ++r) {
    const int64_t len = seq_lens[r];
    const int64_t offset = first_page_offsets.empty() ? 0 : first_page_offsets[r];
    if (len < 0) {
      throw Error("page table: seq_lens[" + std::to_string(r) + "] = " + std::to_string(len) + " is negative");
    }
    if (offset < 0 || offset >= page_size) {
      throw Error("page table: first_page_offsets[" + std::to_string(r) + "] = " + std::to_string(offset) +
                  " is outside [0, page_size = " + std::to_string(page_size) + ")");
    }
    const int64_t span = offset + len;
    const int64_t pages = len == 0 ? 0 : (span + page_size - 1) / page_size;
    pages_so_far += pages;
    if (pages_so_far > std::numeric_limits<int32_t>::max()) {
      throw Error("page table: more than 2^31 - 1 pages in total (at request " + std::to_string(r) + ")");
    }
    table.indptr[r + 1] = static_cast<int32_t>(pages_so_far);
    table.first_page_offset[r] = static_cast<int32_t>(offset);
    table.last_page_len[r] = len == 0 ? 0 : static_cast<int32_t>(span - (pages - 1) * page_size);
  }
  return table;
}

std::string page_table_problem(const PageTableStructure& t, const std::vector<int32_t>* indices,
                               int64_t num_pool_pages) {
  std::ostringstream why;
  const size_t n = t.seq_lens.size();
  if (t.page_size < 1) {
    why << "page_size = " << t.page_size << " must be at least 1";
    return why.str();
  }
  if (t.indptr.size() != n + 1) {
    why << "indptr has " << t.indptr.size() << " entries, expected num_requests + 1 = " << n + 1;
    return why.str();
  }
  if (t.last_page_len.size() != n) {
    why << "last_page_len has " << t.last_page_len.size() << " entries, expected " << n;
    return why.str();
  }
  if (t.first_page_offset.size() != n) {
    why << "first_page_offset has " << t.first_page_offset.size() << " entries, expected " << n;
    return why.str();
  }
  if (t.indptr[0] != 0) {
    why << "indptr[0] = " << t.indptr[0] << ", expected 0";
    return why.str();
  }
  for (size_t r = 0; r < n; ++r) {
    if (t.indptr[r + 1] < t.indptr[r]) {
      why << "indptr decreases at request " << r << ": indptr[" << r << "] = " << t.indptr[r] << " > indptr[" << r + 1
          << "] = " << t.indptr[r + 1];
      return why.str();
    }
    const int64_t len = t.seq_lens[r];
    const int64_t offset = t.first_page_offset[r];
    if (len < 0) {
      why << "seq_lens[" << r << "] = " << len << " is negative";
      return why.str();
    }
    if (offset < 0 || offset >= t.page_size) {
      why << "first_page_offset[" << r << "] = " << offset << " is outside [0, page_size = " << t.page_size << ")";
      return why.str();
    }
    const int64_t expected_pages = len == 0 ? 0 : (offset + len + t.page_size - 1) / t.page_size;
    const int64_t pages = int64_t{t.indptr[r + 1]} - t.indptr[r];
    if (pages != expected_pages) {
      why << "request " << r << " has " << pages << " pages, expected ceil((first_page_offset " << offset
          << " + seq_len " << len << ") / page_size " << t.page_size << ") = " << expected_pages;
      return why.str();
    }
    if (len == 0 && t.last_page_len[r] != 0) {
      why << "last_page_len[" << r << "] = " << t.last_page_len[r] << " on an empty request, expected 0";
      return why.str();
    }
    if (len > 0) {
      const int64_t last = t.last_page_len[r];
      if (last < 1 || last > t.page_size) {
        why << "last_page_len[" << r << "] = " << last << " is outside [1, page_size = " << t.page_size << "]";
        return why.str();
      }
      const int64_t expected_last = offset + len - (expected_pages - 1) * t.page_size;
      if (last != expected_last) {
        why << "last_page_len[" << r << "] = " << last << " disagrees with first_page_offset " << offset
            << " + seq_len " << len << " (expected " << expected_last << ")";
        return why.str();
      }
    }
  }
  if (indices != nullptr) {
    if (static_cast<int64_t>(indices->size()) != t.num_pages()) {
      why << "indices has " << indices->size() << " entries, indptr[num_requests] = " << t.num_pages();
      return why.str();
    }
    if (num_pool_pages > 0) {
      for (size_t i = 0; i < indices->size(); ++i) {
        const int32_t page = (*indices)[i];
        if (page < 0 || page >= num_pool_pages) {
          why << "indices[" << i << "] = " << page << " is outside the pool [0, " << num_pool_pages << ")";
          return why.str();
        }
      }
    }
  }
  return "";
}

void check_page_table(const PageTableStructure& table, const std::vector<int32_t>* indices, int64_t num_pool_pages) {
  const std::string problem = page_table_problem(table, indices, num_pool_pages);
  if (!problem.empty()) throw Error("page table: " + problem);
}

}  // namespace sparsepage
