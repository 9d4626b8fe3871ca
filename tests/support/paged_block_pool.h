// A paged block pool for tests: blocks of `block_size` tokens, each
// sequence with its own block table, K and V appended from the host. The
// tests build block-granular page tables over it (page_size = block_size) and
// check the decode's pool-page addressing and the pool's own bounds. It is no
// part of the library (engines bring their own pools: EnginePagedKV), and it
// is header-only so that every test target, the fuzzer included, can use it
// without another source file.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "sparsepage/memory.h"
#include "sparsepage/page_table.h"
#include "sparsepage/types.h"

namespace sparsepage {

/// A paged cache: blocks of `block_size` tokens; the allocation is
/// `[num_blocks, heads, block_size, head_dim]` for K and for V, so block id
/// `blk` of head `h` is pool page `blk * heads + h` at page_size = block_size.
/// Each sequence owns a block table.
class PagedBlockPool {
 public:
  PagedBlockPool(Device device, DType dtype, int32_t num_blocks, int32_t heads, int32_t block_size, int32_t k_head_dim,
                 int32_t v_head_dim);

  /// Adds a sequence and returns its id.
  int32_t add_sequence();
  /// Appends `new_tokens` tokens of `[heads, new_tokens, head_dim]` K and V
  /// (host memory, pool dtype) to sequence `seq`, taking blocks from the free
  /// list. Throws when the pool is full.
  void append(int32_t seq, const void* k_new, const void* v_new, int64_t new_tokens);
  const std::vector<int32_t>& block_table(int32_t seq) const;
  int64_t seq_len(int32_t seq) const;

  /// Pool page of block `block_id` for head `head`.
  int32_t page(int32_t block_id, int32_t head) const { return block_id * heads_ + head; }

  /// Block-granular page table for requests (seq, head) with the given
  /// selected block ids (indices into each sequence's block table) — no
  /// expansion to tokens: page_size = block_size. The final partial block
  /// must be last when selected. Returns the
  /// structure and the host indices (pool pages) to upload.
  std::pair<PageTableStructure, std::vector<int32_t>> block_page_table(
      const std::vector<int32_t>& seqs, const std::vector<int32_t>& heads,
      const std::vector<std::vector<int32_t>>& selected_blocks) const;

  const void* k_data() const { return k_.data(); }
  const void* v_data() const { return v_.data(); }
  int64_t num_pages() const { return int64_t{num_blocks_} * heads_; }
  int32_t block_size() const { return block_size_; }
  int32_t heads() const { return heads_; }
  int32_t k_head_dim() const { return k_head_dim_; }
  int32_t v_head_dim() const { return v_head_dim_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

 private:
  Device device_;
  DType dtype_;
  int32_t num_blocks_, heads_, block_size_, k_head_dim_, v_head_dim_;
  Buffer k_, v_;
  std::vector<int32_t> free_blocks_;
  std::vector<std::vector<int32_t>> block_tables_;
  std::vector<int64_t> seq_lens_;
};

inline PagedBlockPool::PagedBlockPool(Device device, DType dtype, int32_t num_blocks, int32_t heads, int32_t block_size,
                                      int32_t k_head_dim, int32_t v_head_dim)
    : device_(device),
      dtype_(dtype),
      num_blocks_(num_blocks),
      heads_(heads),
      block_size_(block_size),
      k_head_dim_(k_head_dim),
      v_head_dim_(v_head_dim) {
  if (num_blocks < 1 || heads < 1 || block_size < 1 || k_head_dim < 1 || v_head_dim < 1) {
    throw Error("PagedBlockPool: num_blocks, heads, block_size and head dims must be at least 1");
  }
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    throw Error("PagedBlockPool: dtype " + std::to_string(static_cast<int32_t>(dtype)) + " is not a DType");
  }
  if (int64_t{num_blocks} * heads * block_size > std::numeric_limits<int32_t>::max()) {
    throw Error("PagedBlockPool: num_blocks * heads * block_size exceeds 2^31 - 1 rows");
  }
  const size_t rows = static_cast<size_t>(num_blocks) * heads * block_size;
  k_ = Buffer(device, rows * k_head_dim * dtype_size(dtype));
  v_ = Buffer(device, rows * v_head_dim * dtype_size(dtype));
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_blocks_.push_back(b);
}

inline int32_t PagedBlockPool::add_sequence() {
  block_tables_.emplace_back();
  seq_lens_.push_back(0);
  return static_cast<int32_t>(block_tables_.size() - 1);
}

inline const std::vector<int32_t>& PagedBlockPool::block_table(int32_t seq) const {
  if (seq < 0 || seq >= static_cast<int32_t>(block_tables_.size())) {
    throw Error("PagedBlockPool: sequence " + std::to_string(seq) + " does not exist");
  }
  return block_tables_[static_cast<size_t>(seq)];
}

inline int64_t PagedBlockPool::seq_len(int32_t seq) const {
  block_table(seq);
  return seq_lens_[static_cast<size_t>(seq)];
}

inline void PagedBlockPool::append(int32_t seq, const void* k_new, const void* v_new, int64_t new_tokens) {
  block_table(seq);
  if (new_tokens < 0 || (new_tokens > 0 && (k_new == nullptr || v_new == nullptr))) {
    throw Error("PagedBlockPool::append: need new_tokens >= 0 and non-null k_new / v_new (new_tokens = " +
                std::to_string(new_tokens) + ")");
  }
  auto& table = block_tables_[static_cast<size_t>(seq)];
  int64_t& len = seq_lens_[static_cast<size_t>(seq)];
  // Check capacity before touching anything, so a failed append leaves the
  // sequence and the free list as they were.
  // Room left in the sequence's blocks plus the free ones, compared without
  // forming len + new_tokens (INT64_MAX tokens used to overflow here).
  const int64_t room =
      (static_cast<int64_t>(table.size()) + static_cast<int64_t>(free_blocks_.size())) * block_size_ - len;
  if (new_tokens > room) {
    throw Error("PagedBlockPool::append: " + std::to_string(new_tokens) +
                " tokens do not fit: " + std::to_string(room) + " token slots are left (" +
                std::to_string(free_blocks_.size()) + " of " + std::to_string(num_blocks_) + " blocks free)");
  }
  const int64_t blocks_needed = (len + new_tokens + block_size_ - 1) / block_size_ - static_cast<int64_t>(table.size());
  if (blocks_needed > static_cast<int64_t>(free_blocks_.size())) {
    throw Error("PagedBlockPool::append: " + std::to_string(new_tokens) + " tokens need " +
                std::to_string(blocks_needed) + " more blocks; " + std::to_string(free_blocks_.size()) + " of " +
                std::to_string(num_blocks_) + " are free");
  }
  const size_t esize = dtype_size(dtype_);
  int64_t t = 0;
  while (t < new_tokens) {
    const int64_t slot = len % block_size_;
    if (slot == 0 && static_cast<int64_t>(table.size()) * block_size_ <= len) {
      if (free_blocks_.empty()) {
        throw Error("PagedBlockPool::append: the pool's " + std::to_string(num_blocks_) + " blocks are all in use");
      }
      table.push_back(free_blocks_.back());
      free_blocks_.pop_back();
    }
    const int64_t run = std::min<int64_t>(block_size_ - slot, new_tokens - t);
    const int64_t block = table.back();
    // One 2-D copy per block run: each head's rows are contiguous in both.
    auto put = [&](Buffer& dst, const void* src, int32_t dim) {
      const size_t row_bytes = static_cast<size_t>(dim) * esize;
      char* target =
          static_cast<char*>(dst.data()) + static_cast<size_t>((block * heads_ * block_size_ + slot)) * row_bytes;
      copy_2d(target, device_, static_cast<size_t>(block_size_) * row_bytes,
              static_cast<const char*>(src) + static_cast<size_t>(t) * row_bytes, Device::kCpu,
              static_cast<size_t>(new_tokens) * row_bytes, static_cast<size_t>(run) * row_bytes,
              static_cast<size_t>(heads_));
    };
    put(k_, k_new, k_head_dim_);
    put(v_, v_new, v_head_dim_);
    len += run;
    t += run;
  }
}

inline std::pair<PageTableStructure, std::vector<int32_t>> PagedBlockPool::block_page_table(
    const std::vector<int32_t>& seqs, const std::vector<int32_t>& heads,
    const std::vector<std::vector<int32_t>>& selected_blocks) const {
  if (seqs.size() != heads.size() || seqs.size() != selected_blocks.size()) {
    throw Error("PagedBlockPool::block_page_table: seqs, heads and selected_blocks need one entry per request");
  }
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> indices;
  for (size_t r = 0; r < seqs.size(); ++r) {
    const auto& table = block_table(seqs[r]);
    const int64_t len = seq_lens_[static_cast<size_t>(seqs[r])];
    if (heads[r] < 0 || heads[r] >= heads_) {
      throw Error("PagedBlockPool::block_page_table: head " + std::to_string(heads[r]) + " is outside [0, " +
                  std::to_string(heads_) + ")");
    }
    int64_t visible = 0;
    const auto& blocks = selected_blocks[r];
    for (size_t i = 0; i < blocks.size(); ++i) {
      const int32_t b = blocks[i];
      if (b < 0 || b >= static_cast<int32_t>(table.size())) {
        throw Error("PagedBlockPool::block_page_table: request " + std::to_string(r) + " selects block " +
                    std::to_string(b) + " of a sequence with " + std::to_string(table.size()) + " blocks");
      }
      const int64_t rows = std::min<int64_t>(block_size_, len - int64_t{b} * block_size_);
      if (rows < block_size_ && i + 1 != blocks.size()) {
        throw Error("PagedBlockPool::block_page_table: request " + std::to_string(r) +
                    " lists the partial final block before its last entry");
      }
      visible += rows;
      indices.push_back(page(table[static_cast<size_t>(b)], heads[r]));
    }
    if (visible > std::numeric_limits<int32_t>::max()) {
      throw Error("PagedBlockPool::block_page_table: request " + std::to_string(r) + " selects " +
                  std::to_string(visible) + " tokens, more than 2^31 - 1");
    }
    seq_lens.push_back(static_cast<int32_t>(visible));
  }
  return {build_page_table_structure(seq_lens, block_size_), indices};
}

}  // namespace sparsepage
