// The CPU reference backend of the paged decode: the plan's work items run
// in parallel, each writing its chunk's partial (or the output directly),
// then the merge combines partials by lse. Same structures as the CUDA
// backend, so tests compare the two one to one.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cpu/plan_runner.h"
#include "sparsepage/decode.h"

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

}  // namespace cpu

namespace {

// The table is checked before any thread starts, and its structure before
// any index is read, so the loops below can never read outside `indices` or
// the pool whatever the arrays say.
void check_indices_cpu(const DecodeParams& p) {
  const bool window = p.addressing == PageAddressing::kWindow;
  const auto fail = [](const std::string& message) { throw Error("decode: " + message); };
  if (p.num_requests == 0) return;  // indptr may be null then
  if (p.num_indices < 0) fail("num_indices = " + std::to_string(p.num_indices) + " is negative");
  if (p.indptr[0] != 0) fail("indptr[0] = " + std::to_string(p.indptr[0]) + ", expected 0");
  for (int32_t r = 0; r < p.num_requests; ++r) {
    if (p.indptr[r + 1] < p.indptr[r]) {
      fail("indptr decreases at request " + std::to_string(r) + ": indptr[" + std::to_string(r) + "] = " +
           std::to_string(p.indptr[r]) + " > indptr[" + std::to_string(r + 1) + "] = " + std::to_string(p.indptr[r + 1]));
    }
  }
  if (p.indptr[p.num_requests] > p.num_indices) {
    fail("indptr[num_requests] = " + std::to_string(p.indptr[p.num_requests]) + " is past the end of indices (" +
         "num_indices = " + std::to_string(p.num_indices) + ")");
  }
  for (int32_t r = 0; r < p.num_requests; ++r) {
    const int64_t offset = p.first_page_offset ? p.first_page_offset[r] : 0;
    if (offset < 0 || offset >= p.page_size) {
      fail("first_page_offset[" + std::to_string(r) + "] = " + std::to_string(offset) +
           " is outside [0, page_size = " + std::to_string(p.page_size) + ")");
    }
    const int64_t len = p.seq_lens[r];
    const int64_t needed = len == 0 ? 0 : (offset + len + p.page_size - 1) / p.page_size;
    const int64_t have = int64_t{p.indptr[r + 1]} - p.indptr[r];
    if (have < needed) {
      fail("request " + std::to_string(r) + " needs " + std::to_string(needed) + " pages (first_page_offset " +
           std::to_string(offset) + ", seq_len " + std::to_string(len) + ") but indptr gives " + std::to_string(have));
    }
    const int64_t window_len = p.window_lens ? p.window_lens[r / p.num_kv_heads] : p.window_len;
    for (int64_t i = p.indptr[r]; i < p.indptr[r] + needed; ++i) {
      const int32_t page = p.indices[i];
      if (window) {
        // Window mode: the page's last visible position must be in the window.
        const int64_t last = std::min<int64_t>(p.page_size, offset + len - (i - p.indptr[r]) * p.page_size) - 1;
        if (page < 0 || int64_t{page} * p.page_size + last >= window_len) {
          fail("indices[" + std::to_string(i) + "] = " + std::to_string(page) + " names positions outside request " +
               std::to_string(r) + "'s window of " + std::to_string(window_len) + " tokens");
        }
        continue;
      }
      if (page < 0 || page >= p.num_pool_pages) {
        fail("indices[" + std::to_string(i) + "] = " + std::to_string(page) + " is outside the pool [0, " +
             std::to_string(p.num_pool_pages) + ")");
      }
    }
  }
}

}  // namespace

void run_decode_cpu(const DecodeParams& p, const DecodePlan& plan, void* workspace) {
  check_decode_plan(plan);  // its fields are public; the loops below index with them
  check_decode_params(p, plan);
  if (plan.workspace.total > 0 && workspace == nullptr) throw Error("decode: workspace is null");
  for (int32_t r = 0; r < p.num_requests; ++r) {
    if (p.seq_lens[r] < 0 || p.seq_lens[r] > plan.seq_lens[static_cast<size_t>(r)]) {
      throw Error("decode: seq_lens[" + std::to_string(r) + "] = " + std::to_string(p.seq_lens[r]) +
                  " must lie in [0, " + std::to_string(plan.seq_lens[static_cast<size_t>(r)]) +
                  "], the count the plan was made for");
    }
  }
  check_indices_cpu(p);
  const int64_t esize = static_cast<int64_t>(dtype_size(p.dtype));
  const int32_t de = p.k_extra.data ? p.k_extra.dim : 0;
  const cpu::PlanOutputs out{p.dtype, p.group_size, p.k.dim, p.v.dim, de, p.q, p.q_extra, p.scale, p.o, p.lse};
  // Where request r's rows start in a stream (elements -> bytes, 64-bit).
  auto start = [&p, esize](const RowView& s, int32_t r) {
    const int64_t seq = r / p.num_kv_heads, head = r % p.num_kv_heads;
    return static_cast<const char*>(s.data) + (seq * s.seq_stride + head * s.head_stride) * esize;
  };
  auto rows_of = [&](int32_t r) {
    const int64_t offset = p.first_page_offset ? p.first_page_offset[r] : 0;
    const int32_t* pages = p.indices + p.indptr[r];
    const char* k = start(p.k, r);
    const char* v = start(p.v, r);
    const char* e = de > 0 ? start(p.k_extra, r) : nullptr;
    return [&p, esize, offset, pages, k, v, e](int64_t t) {
      const int64_t slot = offset + t;
      const int64_t row = int64_t{pages[slot / p.page_size]} * p.page_size + slot % p.page_size;
      return cpu::TokenRows{k + row * p.k.row_stride * esize, v + row * p.v.row_stride * esize,
                            e ? e + row * p.k_extra.row_stride * esize : nullptr};
    };
  };
  auto no_bias = [](int32_t) { return [](int64_t) { return 0.0f; }; };
  auto visible = [&p](int32_t r) { return int64_t{p.seq_lens[r]}; };
  cpu::run_plan(plan, out, workspace, rows_of, no_bias, visible);
}

}  // namespace sparsepage
