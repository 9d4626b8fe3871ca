// Host-side checks shared by both backends: everything that can be checked
// without reading the arrays. Each message names the field and the bound.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "sparsepage/decode.h"

namespace sparsepage {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw Error("decode: " + message);
}

void check_pool(const RowView& pool, const char* name) {
  const std::string n(name);
  require(pool.data != nullptr, n + ".data is null");
  require(pool.dim >= 1, n + ".dim = " + std::to_string(pool.dim) + " must be at least 1");
  require(pool.row_stride >= pool.dim, n + ".row_stride = " + std::to_string(pool.row_stride) +
                                           " is smaller than " + n + ".dim = " + std::to_string(pool.dim));
  require(pool.seq_stride >= 0 && pool.head_stride >= 0, n + ".seq_stride and " + n + ".head_stride must not be negative");
}

// The byte span a stream's rows cover (every sequence and head, `rows` rows
// each) must fit a signed 64-bit offset, or the backends' 64-bit address
// arithmetic would wrap.
void check_extent(const RowView& pool, int64_t sequences, int64_t heads, int64_t rows, size_t esize,
                  const char* name) {
  const auto ld = [](int64_t x) { return static_cast<long double>(x); };
  const long double elements = ld(std::max<int64_t>(sequences - 1, 0)) * ld(pool.seq_stride) +
                               ld(std::max<int64_t>(heads - 1, 0)) * ld(pool.head_stride) +
                               ld(rows) * ld(pool.row_stride);
  require(elements * ld(static_cast<int64_t>(esize)) < 4.6e18L,
          std::string(name) + ": " + std::to_string(rows) + " rows of row_stride " + std::to_string(pool.row_stride) +
              " (with its sequence and head strides) span more than 2^62 bytes");
}

}  // namespace

std::string cuda_layout_problem(DType dtype, const void* q, const void* q_extra, const RowView& k, const RowView& v,
                                const RowView& k_extra, const void* o) {
  if (dtype != DType::kBF16 && dtype != DType::kF16)
    return std::string("dtype ") + dtype_name(dtype) + " is not supported on CUDA (the tensor-core kernels take bf16 and f16)";
  const std::pair<const void*, const char*> bases[] = {{q, "q"},           {q_extra, "q_extra"}, {k.data, "k.data"},
                                                       {v.data, "v.data"}, {k_extra.data, "k_extra.data"}, {o, "o"}};
  for (const auto& [ptr, name] : bases) {
    if (ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      return std::string(name) + " must be 16-byte aligned on CUDA";
  }
  const std::pair<const RowView*, const char*> streams[] = {{&k, "k"}, {&v, "v"}, {&k_extra, "k_extra"}};
  for (const auto& [s, name] : streams) {
    if (s->data == nullptr) continue;
    const std::pair<int64_t, const char*> strides[] = {
        {s->row_stride, ".row_stride"}, {s->seq_stride, ".seq_stride"}, {s->head_stride, ".head_stride"}};
    for (const auto& [stride, field] : strides) {
      if (stride % 8 != 0)
        return std::string(name) + field + " = " + std::to_string(stride) +
               " must be a multiple of 8 elements on CUDA (rows are copied in 16-byte pieces)";
    }
  }
  if (v.dim > 256 && (v.data != k.data || v.row_stride != k.row_stride || v.seq_stride != k.seq_stride ||
                      v.head_stride != k.head_stride))
    return "a V wider than 256 (the MLA latent) must be the first columns of K's rows on CUDA";
  return {};
}

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
  require(p.num_kv_heads >= 1, "num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be at least 1");
  require(p.num_requests % p.num_kv_heads == 0, "num_requests = " + std::to_string(p.num_requests) +
                                                    " is not a multiple of num_kv_heads = " +
                                                    std::to_string(p.num_kv_heads));
  const bool window = p.addressing == PageAddressing::kWindow;
  require(window || p.addressing == PageAddressing::kPoolPages, "addressing is not a PageAddressing value");
  require(!window || p.window_len >= 0, "window_len = " + std::to_string(p.window_len) + " is negative");
  if (p.num_requests == 0) return;
  require(p.indptr != nullptr, "indptr is null");
  int64_t planned_tokens = 0;
  for (int32_t len : plan.seq_lens) planned_tokens += len;
  if (planned_tokens > 0) {
    require(p.indices != nullptr, "indices is null but the plan has " + std::to_string(planned_tokens) + " tokens");
    require(window || p.num_pool_pages >= 1,
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
  const int64_t rows = static_cast<int64_t>(std::min<long double>(
      window ? static_cast<long double>(p.window_len) : static_cast<long double>(p.num_pool_pages) * p.page_size,
      9.2e18L));
  const int64_t sequences = p.num_requests / p.num_kv_heads;
  if (window) {
    // A request's window must not reach the next head's or sequence's rows.
    const auto fits = [&](const RowView& s, const char* name) {
      const long double span = static_cast<long double>(p.window_len) * static_cast<long double>(s.row_stride);
      const auto n = std::string(name);
      require(p.num_kv_heads == 1 || s.head_stride == 0 || span <= static_cast<long double>(s.head_stride),
              "window_len = " + std::to_string(p.window_len) + " rows of " + n + " overrun " + n +
                  ".head_stride = " + std::to_string(s.head_stride));
      require(sequences <= 1 || s.seq_stride == 0 || span <= static_cast<long double>(s.seq_stride),
              "window_len = " + std::to_string(p.window_len) + " rows of " + n + " overrun " + n +
                  ".seq_stride = " + std::to_string(s.seq_stride));
    };
    fits(p.k, "k");
    fits(p.v, "v");
    if (has_extra) fits(p.k_extra, "k_extra");
  }
  const size_t esize = dtype_size(p.dtype);
  check_extent(p.k, sequences, p.num_kv_heads, rows, esize, "k");
  check_extent(p.v, sequences, p.num_kv_heads, rows, esize, "v");
  if (has_extra) check_extent(p.k_extra, sequences, p.num_kv_heads, rows, esize, "k_extra");
}

}  // namespace sparsepage
