// Host-side checks shared by both backends: everything that can be checked
// without reading the arrays. Each message names the field and the bound.
#include <algorithm>
#include <cmath>
#include <string>

#include "sparsepage/decode.h"

namespace sparsepage {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw Error("decode: " + message);
}

void check_pool(const PoolView& pool, const char* name) {
  const std::string n(name);
  require(pool.data != nullptr, n + ".data is null");
  require(pool.dim >= 1, n + ".dim = " + std::to_string(pool.dim) + " must be at least 1");
  require(pool.row_stride >= pool.dim, n + ".row_stride = " + std::to_string(pool.row_stride) +
                                           " is smaller than " + n + ".dim = " + std::to_string(pool.dim));
}

// The byte span `rows` rows of `pool` cover must fit a signed 64-bit offset,
// or the backends' 64-bit address arithmetic would wrap.
void check_extent(const PoolView& pool, int64_t rows, size_t esize, const char* name) {
  const long double bytes = static_cast<long double>(rows) * static_cast<long double>(pool.row_stride) *
                            static_cast<long double>(esize);
  require(bytes < 4.6e18L, std::string(name) + ": " + std::to_string(rows) + " rows of row_stride " +
                               std::to_string(pool.row_stride) + " span more than 2^62 bytes");
}

}  // namespace

void check_decode_params(const DecodeParams& p, const DecodePlan& plan) {
  require(p.dtype == DType::kF32 || p.dtype == DType::kF16 || p.dtype == DType::kBF16,
          "dtype " + std::to_string(static_cast<int32_t>(p.dtype)) + " is not a DType");
  require(p.num_requests >= 0, "num_requests = " + std::to_string(p.num_requests) + " is negative");
  require(p.num_requests == plan.num_requests, "num_requests = " + std::to_string(p.num_requests) +
                                                   " but the plan was made for " +
                                                   std::to_string(plan.num_requests));
  require(p.group_size >= 1, "group_size = " + std::to_string(p.group_size) + " must be at least 1");
  require(p.group_size == plan.group_size, "group_size = " + std::to_string(p.group_size) +
                                               " but the plan was made for " + std::to_string(plan.group_size));
  require(p.page_size >= 1, "page_size = " + std::to_string(p.page_size) + " must be at least 1");
  require(p.num_indices >= 0, "num_indices = " + std::to_string(p.num_indices) + " is negative");
  require(p.num_pool_pages >= 0, "num_pool_pages = " + std::to_string(p.num_pool_pages) + " is negative");
  require(std::isfinite(p.scale), "scale is not finite");
  require(p.request_row_stride >= 0, "request_row_stride is negative");
  require(p.request_row_stride == 0 || (p.window_len >= 0 && p.window_len <= p.request_row_stride),
          "window_len = " + std::to_string(p.window_len) + " must lie in [0, request_row_stride = " +
              std::to_string(p.request_row_stride) + "]");
  if (p.num_requests == 0) return;
  require(p.indptr != nullptr, "indptr is null");
  int64_t planned_tokens = 0;
  for (int32_t len : plan.seq_lens) planned_tokens += len;
  if (planned_tokens > 0) {
    require(p.indices != nullptr, "indices is null but the plan has " + std::to_string(planned_tokens) + " tokens");
    require(p.request_row_stride > 0 || p.num_pool_pages >= 1,
            "num_pool_pages = " + std::to_string(p.num_pool_pages) +
                ": a pool-page table needs the pool's page count (or window mode)");
  }
  require(p.seq_lens != nullptr, "seq_lens is null");
  require(p.q != nullptr, "q is null");
  require(p.o != nullptr, "o is null");
  check_pool(p.k, "k");
  check_pool(p.v, "v");
  require(p.v.dim == plan.head_dim_v,
          "v.dim = " + std::to_string(p.v.dim) + " but the plan was made for " + std::to_string(plan.head_dim_v));
  const bool has_extra = p.k_extra.data != nullptr;
  require(has_extra == (p.q_extra != nullptr), "q_extra and k_extra.data must both be set or both be null");
  if (has_extra) check_pool(p.k_extra, "k_extra");
  // Rows the page ids (or windows) can reach, for the address arithmetic.
  const int64_t rows = p.request_row_stride > 0
                           ? static_cast<int64_t>(std::min<long double>(
                                 static_cast<long double>(p.request_row_stride) * p.num_requests, 9.2e18L))
                           : static_cast<int64_t>(std::min<long double>(
                                 static_cast<long double>(p.num_pool_pages) * p.page_size, 9.2e18L));
  const size_t esize = dtype_size(p.dtype);
  check_extent(p.k, rows, esize, "k");
  check_extent(p.v, rows, esize, "v");
  if (has_extra) check_extent(p.k_extra, rows, esize, "k_extra");
}

}  // namespace sparsepage
