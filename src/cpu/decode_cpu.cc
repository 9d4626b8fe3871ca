// The CPU reference backend of the paged decode: the plan's work items run
// in parallel, each writing its chunk's partial (or the output directly),
// then the merge combines partials by lse. Same structures as the CUDA
// backend, so tests compare the two one to one.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/decode_limits.h"
#include "cpu/plan_runner.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/query_strides.h"

namespace sparsepage {
namespace cpu {

void merge_states(const std::vector<const float*>& o_parts, const std::vector<const float*>& lse_parts,
                  int32_t group_size, int32_t dim_v, float* o_out, float* lse_out) {
  for (int g = 0; g < group_size; ++g) {
    float max_lse = -std::numeric_limits<float>::infinity();
    bool any_nan = false;
    for (const float* lse : lse_parts) {
      any_nan |= std::isnan(lse[g]);
      max_lse = std::max(max_lse, lse[g]);
    }
    float* og = o_out + static_cast<size_t>(g) * dim_v;
    if (any_nan) {  // a poisoned partial poisons the result: NaN never passes
      for (int d = 0; d < dim_v; ++d) og[d] = std::numeric_limits<float>::quiet_NaN();
      lse_out[g] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    for (int d = 0; d < dim_v; ++d) og[d] = 0.0f;
    if (max_lse == -std::numeric_limits<float>::infinity()) {
      lse_out[g] = max_lse;
      continue;
    }
    // fp64 like attend_chunk: the oracle must not lose mass over many partials.
    std::vector<double> acc(static_cast<size_t>(dim_v), 0.0);
    double weight_sum = 0.0;
    for (size_t p = 0; p < o_parts.size(); ++p) {
      if (lse_parts[p][g] == -std::numeric_limits<float>::infinity()) continue;  // empty partial: weighs nothing
      const double w = std::exp(static_cast<double>(lse_parts[p][g]) - max_lse);
      weight_sum += w;
      const float* part = o_parts[p] + static_cast<size_t>(g) * dim_v;
      for (int d = 0; d < dim_v; ++d) acc[static_cast<size_t>(d)] += w * part[d];
    }
    for (int d = 0; d < dim_v; ++d) og[d] = static_cast<float>(acc[static_cast<size_t>(d)] / weight_sum);
    lse_out[g] = static_cast<float>(max_lse + std::log(weight_sum));
  }
}

void finalize_states(float* o, float* lse, int32_t rows, int32_t dim_v, const float* sink, float empty_lse) {
  for (int32_t g = 0; g < rows; ++g) {
    if (std::isnan(lse[g])) continue;
    if (lse[g] == -std::numeric_limits<float>::infinity()) {
      lse[g] = empty_lse;
      continue;
    }
    if (sink == nullptr) continue;
    // 1 / (1 + exp(sink - lse)) in fp64: exp overflows to +inf for a huge
    // sink and the factor is 0, its limit; a sink of -inf gives exactly 1.
    const double factor = 1.0 / (1.0 + std::exp(static_cast<double>(sink[g]) - lse[g]));
    float* og = o + static_cast<size_t>(g) * dim_v;
    for (int d = 0; d < dim_v; ++d) og[d] = static_cast<float>(og[d] * factor);
  }
}

}  // namespace cpu

namespace {

// Request r's page ids: its CSR range or its row of the index matrix.
struct RequestPages {
  const int32_t* ids;
  int64_t count;
  int64_t first;  // position of ids[0] in `indices`, for messages
};

RequestPages pages_of(const DecodeParams& p, int32_t r) {
  RequestPages pages{nullptr, 0, 0};
  if (p.index_layout == IndexLayout::kMatrix) {
    pages.first = int64_t{r / p.num_kv_heads} * p.index_seq_stride + int64_t{r % p.num_kv_heads} * p.index_head_stride;
    pages.count = p.index_width;
  } else {
    pages.first = p.indptr[r];
    pages.count = int64_t{p.indptr[r + 1]} - p.indptr[r];
  }
  // No pointer is formed for an empty row: `indices` may be null then.
  if (pages.count > 0) pages.ids = p.indices + pages.first;
  return pages;
}

// Tokens request r sees: its seq_lens entry, or the plan's count without seq_lens.
int64_t visible_tokens(const DecodeParams& p, const DecodePlan& plan, int32_t r) {
  if (p.seq_lens == nullptr) return plan.seq_lens[static_cast<size_t>(r)];
  return p.seq_lens[p.seq_lens_index == SeqLensIndex::kPerSequence ? r / p.num_kv_heads : r];
}

// The block-table row sequence `seq` reads.
const int32_t* block_table_row(const DecodeParams& p, int64_t seq) {
  const BlockTable& t = p.block_table;
  const int64_t row = t.row_of_sequence ? t.row_of_sequence[seq] : seq;
  return t.data + row * t.row_stride;
}

bool skipped_page(const DecodeParams& p, int32_t page) {
  return page == -1 && p.padding == IndexPadding::kMinusOneSkips;
}

// The table is checked before any thread starts, and its structure before
// any index is read, so the loops below can never read outside `indices` or
// the pool whatever the arrays say.
void check_indices_cpu(const DecodeParams& p, const DecodePlan& plan) {
  const bool window = p.addressing == PageAddressing::kWindow;
  const bool block_table = p.addressing == PageAddressing::kBlockTable;
  const auto fail = [](const std::string& message) { throw Error("decode: " + message); };
  if (p.num_requests == 0) return;  // indptr may be null then
  if (p.num_indices < 0) fail("num_indices = " + std::to_string(p.num_indices) + " is negative");
  if (p.index_layout == IndexLayout::kCsr) {
    if (p.indptr[0] != 0) fail("indptr[0] = " + std::to_string(p.indptr[0]) + ", expected 0");
    for (int32_t r = 0; r < p.num_requests; ++r) {
      if (p.indptr[r + 1] < p.indptr[r]) {
        fail("indptr decreases at request " + std::to_string(r) + ": indptr[" + std::to_string(r) +
             "] = " + std::to_string(p.indptr[r]) + " > indptr[" + std::to_string(r + 1) +
             "] = " + std::to_string(p.indptr[r + 1]));
      }
    }
    if (p.indptr[p.num_requests] > p.num_indices) {
      fail("indptr[num_requests] = " + std::to_string(p.indptr[p.num_requests]) + " is past the end of indices (" +
           "num_indices = " + std::to_string(p.num_indices) + ")");
    }
  }  // kMatrix: check_decode_params checked the matrix against num_indices
  if (block_table && p.block_table.row_of_sequence != nullptr) {
    for (int32_t b = 0; b < p.num_requests / p.num_kv_heads; ++b) {
      const int32_t row = p.block_table.row_of_sequence[b];
      if (row < 0 || row >= p.block_table.num_rows) {
        fail("block_table.row_of_sequence[" + std::to_string(b) + "] = " + std::to_string(row) +
             " is outside the table's " + std::to_string(p.block_table.num_rows) + " rows");
      }
    }
  }
  for (int32_t r = 0; r < p.num_requests; ++r) {
    const int64_t offset = p.first_page_offset ? p.first_page_offset[r] : 0;
    if (offset < 0 || offset >= p.page_size) {
      fail("first_page_offset[" + std::to_string(r) + "] = " + std::to_string(offset) +
           " is outside [0, page_size = " + std::to_string(p.page_size) + ")");
    }
    const int64_t len = visible_tokens(p, plan, r);
    const int64_t needed = len == 0 ? 0 : (offset + len + p.page_size - 1) / p.page_size;
    const RequestPages pages = pages_of(p, r);
    if (pages.count < needed) {
      fail("request " + std::to_string(r) + " needs " + std::to_string(needed) + " pages (first_page_offset " +
           std::to_string(offset) + ", seq_len " + std::to_string(len) + ") but " +
           (p.index_layout == IndexLayout::kMatrix ? "index_width is " : "indptr gives ") +
           std::to_string(pages.count));
    }
    const int64_t seq = r / p.num_kv_heads;
    const int64_t window_len = p.window_lens ? p.window_lens[seq] : p.window_len;
    for (int64_t i = 0; i < needed; ++i) {
      const int32_t page = pages.ids[i];
      const std::string where = "indices[" + std::to_string(pages.first + i) + "] = " + std::to_string(page);
      if (skipped_page(p, page)) continue;  // padding: nothing of it is read
      // The page's visible slots: [first, last].
      const int64_t first = i == 0 ? offset : 0;
      const int64_t last = std::min<int64_t>(p.page_size, offset + len - i * p.page_size) - 1;
      if (window) {
        // Window mode: the page's last visible position must be in the window.
        if (page < 0 || int64_t{page} * p.page_size + last >= window_len) {
          fail(where + " names positions outside request " + std::to_string(r) + "'s window of " +
               std::to_string(window_len) + " tokens");
        }
      } else if (block_table) {
        const BlockTable& t = p.block_table;
        const int64_t positions = int64_t{t.max_blocks} * t.block_size;
        if (page < 0 || int64_t{page} * p.page_size + last >= positions) {
          fail(where + " names positions of request " + std::to_string(r) + " outside its block table row of " +
               std::to_string(t.max_blocks) + " blocks x " + std::to_string(t.block_size) + " positions");
        }
        const int32_t* row = block_table_row(p, seq);
        for (int64_t pos = int64_t{page} * p.page_size + first; pos <= int64_t{page} * p.page_size + last; ++pos) {
          const int32_t block = row[pos / t.block_size];
          if (block < 0 || block >= t.num_blocks) {
            fail("block " + std::to_string(block) + " (block table entry " + std::to_string(pos / t.block_size) +
                 " of request " + std::to_string(r) + "'s row, reached through " + where + ") is outside the pool's " +
                 std::to_string(t.num_blocks) + " blocks");
          }
        }
      } else if (page < 0 || page >= p.num_pool_pages) {
        fail(where + " is outside the pool [0, " + std::to_string(p.num_pool_pages) + ")");
      }
    }
  }
}

}  // namespace

void run_decode_cpu(const DecodeParams& p, const DecodePlan& plan, void* workspace) {
  detail::run_decode_cpu(p, plan, workspace, kMaxQueryTokens);
}

void detail::check_decode_cpu(const DecodeParams& p, const DecodePlan& plan, void* workspace, int32_t max_q_len) {
  check_decode_plan(plan);  // its fields are public; the loops below index with them
  detail::check_decode_params(p, plan, max_q_len);
  if (plan.workspace.total > 0 && workspace == nullptr) throw Error("decode: workspace is null");
  for (int32_t r = 0; r < p.num_requests; ++r) {
    const int64_t len = visible_tokens(p, plan, r);
    if (len < 0 || len > plan.seq_lens[static_cast<size_t>(r)]) {
      const int32_t entry = p.seq_lens_index == SeqLensIndex::kPerSequence ? r / p.num_kv_heads : r;
      throw Error("decode: seq_lens[" + std::to_string(entry) + "] = " + std::to_string(len) + " must lie in [0, " +
                  std::to_string(plan.seq_lens[static_cast<size_t>(r)]) + "], the count the plan was made for" +
                  (entry != r ? " (request " + std::to_string(r) + ")" : std::string()));
    }
  }
  if (p.window_lens != nullptr && p.addressing != PageAddressing::kPoolPages) {
    // Each sequence's live length within the rows its window may reach (a
    // longer one would read the next head's rows) or the table's positions.
    const int64_t bound = window_lens_bound(p);
    const std::string what = p.addressing == PageAddressing::kBlockTable
                                 ? "the block table's max_blocks * block_size positions"
                                 : "the rows each (sequence, KV head) holds (the streams' capacity, else window_len)";
    for (int32_t b = 0; b < p.num_requests / p.num_kv_heads; ++b) {
      if (p.window_lens[b] < 0 || p.window_lens[b] > bound) {
        throw Error("decode: window_lens[" + std::to_string(b) + "] = " + std::to_string(p.window_lens[b]) +
                    " is outside [0, " + std::to_string(bound) + "], " + what);
      }
    }
  }
  check_indices_cpu(p, plan);
}

void detail::run_decode_cpu(const DecodeParams& p, const DecodePlan& plan, void* workspace, int32_t max_q_len) {
  check_decode_cpu(p, plan, workspace, max_q_len);
  const int64_t esize = static_cast<int64_t>(dtype_size(p.dtype));
  // K and V elements: one byte in the fp8 formats (the second stream stays dtype).
  const int64_t kv_size = p.kv_format == KvFormat::kNative ? esize : 1;
  const int32_t de = p.k_extra.data ? p.k_extra.dim : 0;
  cpu::PlanOutputs out{p.dtype, p.group_size, p.k.dim, p.v.dim,       de,     p.num_kv_heads, p.q, p.q_extra,
                       p.scale, p.o,          p.lse,   qo_strides(p), p.q_len};
  out.kv_format = p.kv_format;
  out.k_scale = p.k_scale;
  out.v_scale = p.v_scale;
  // What a skipped (-1) token "reads": zeros, never the pool; its bias of
  // -inf keeps it out of the softmax whatever the row holds.
  // (An MLA row's zeros include its scales: 528 bytes.)
  const std::vector<char> zeros(static_cast<size_t>(std::max<int64_t>({p.k.dim, p.v.dim, de, 528}) * esize), 0);
  const bool block_table = p.addressing == PageAddressing::kBlockTable;
  // Where request r's rows start in a stream (elements -> bytes, 64-bit).
  auto start = [&p](const RowView& s, int32_t r, int64_t size) {
    const int64_t seq = r / p.num_kv_heads, head = r % p.num_kv_heads;
    return static_cast<const char*>(s.data) + (seq * s.seq_stride + head * s.head_stride) * size;
  };
  // Request r's token t -> its row in the streams, or -1 for a skipped token.
  auto resolver = [&p, block_table](int32_t r) {
    const int64_t offset = p.first_page_offset ? p.first_page_offset[r] : 0;
    const int32_t* pages = pages_of(p, r).ids;
    const int32_t* table_row = block_table ? block_table_row(p, r / p.num_kv_heads) : nullptr;
    return [&p, offset, pages, table_row](int64_t t) -> int64_t {
      const int64_t slot = offset + t;
      const int32_t page = pages[slot / p.page_size];
      if (skipped_page(p, page)) return -1;
      const int64_t pos = int64_t{page} * p.page_size + slot % p.page_size;
      if (table_row == nullptr) return pos;
      const int64_t bs = p.block_table.block_size;
      return int64_t{table_row[pos / bs]} * bs + pos % bs;
    };
  };
  auto rows_of = [&](int32_t r) {
    const char* k = start(p.k, r, kv_size);
    const char* v = start(p.v, r, kv_size);
    const char* e = de > 0 ? start(p.k_extra, r, esize) : nullptr;
    const char* zero = zeros.data();
    return [&p, esize, kv_size, k, v, e, zero, row_of = resolver(r)](int64_t t) {
      const int64_t row = row_of(t);
      if (row < 0) return cpu::TokenRows{zero, zero, e ? zero : nullptr};
      return cpu::TokenRows{k + row * p.k.row_stride * kv_size, v + row * p.v.row_stride * kv_size,
                            e ? e + row * p.k_extra.row_stride * esize : nullptr};
    };
  };
  auto bias_of = [&](int32_t r) {
    return [skip = p.padding == IndexPadding::kMinusOneSkips, row_of = resolver(r)](int64_t t) {
      return skip && row_of(t) < 0 ? -std::numeric_limits<float>::infinity() : 0.0f;
    };
  };
  auto visible = [&p, &plan](int32_t r) { return visible_tokens(p, plan, r); };
  if (p.q_len == 1) {
    cpu::run_plan(plan, out, workspace, rows_of, bias_of, visible);
    return;
  }
  // A multi-token step: query row i is token i / group_size, which sees
  // positions below L - (q_len - 1 - token) (decode.h). Page ids are
  // positions here (check_decode_params refused pool pages).
  auto causal_bias_of = [&](int32_t r) {
    const int64_t seq = r / p.num_kv_heads;
    const int64_t live = p.window_lens ? p.window_lens[seq] : p.window_len;
    const int64_t offset = p.first_page_offset ? p.first_page_offset[r] : 0;
    const int32_t* pages = pages_of(p, r).ids;
    return [&p, live, offset, pages, padding = bias_of(r)](int64_t t, int g) {
      const float pad = padding(t);
      if (pad != 0.0f) return pad;
      const int64_t slot = offset + t;
      const int64_t pos = int64_t{pages[slot / p.page_size]} * p.page_size + slot % p.page_size;
      const int64_t limit = live - (p.q_len - 1 - g / p.group_size);
      return pos < limit ? 0.0f : -std::numeric_limits<float>::infinity();
    };
  };
  cpu::run_plan(plan, out, workspace, rows_of, causal_bias_of, visible);
}

}  // namespace sparsepage
