// The CPU mask path and the host side of the gather path.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/cuda_hooks.h"
#include "core/require.h"
#include "cpu/parallel.h"
#include "cpu/plan_runner.h"
#include "sparsepage/mask_path.h"

#define REQUIRE(ok, ...) SPARSEPAGE_REQUIRE(ok, "masked decode: ", __VA_ARGS__)

namespace sparsepage {
namespace {

void check_stream(const RowView& s, const char* name, const MaskedDecodeParams& p) {
  const std::string problem = row_view_problem(s, name, p.batch, p.num_kv_heads, p.live_len, dtype_size(p.dtype));
  REQUIRE(problem.empty(), problem);
}

}  // namespace

void check_masked_decode_params(const MaskedDecodeParams& p) {
  REQUIRE(p.dtype == DType::kF32 || p.dtype == DType::kF16 || p.dtype == DType::kBF16,
          "dtype " + std::to_string(static_cast<int32_t>(p.dtype)) + " is not a DType");
  REQUIRE(p.batch >= 0, "batch = " + std::to_string(p.batch) + " is negative");
  REQUIRE(p.num_kv_heads >= 1, "num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be at least 1");
  REQUIRE(p.group_size >= 1, "group_size = " + std::to_string(p.group_size) + " must be at least 1");
  REQUIRE(p.live_len >= 0, "live_len = " + std::to_string(p.live_len) + " is negative");
  REQUIRE(p.live_len <= std::numeric_limits<int32_t>::max(),
          "live_len = " + std::to_string(p.live_len) + " exceeds 2^31 - 1 tokens");
  REQUIRE(std::isfinite(p.scale), "scale is not finite");
  REQUIRE(p.mask_pitch == 0 || p.mask_pitch >= p.live_len,
          "mask_pitch = " + std::to_string(p.mask_pitch) + " is smaller than live_len = " + std::to_string(p.live_len));
  REQUIRE(int64_t{p.batch} * p.num_kv_heads <= std::numeric_limits<int32_t>::max(),
          "batch * num_kv_heads = " + std::to_string(int64_t{p.batch} * p.num_kv_heads) + " exceeds 2^31 - 1 requests");
  if (p.batch == 0) return;
  REQUIRE(p.q != nullptr, "q is null");
  REQUIRE(p.o != nullptr, "o is null");
  check_stream(p.k, "k", p);
  check_stream(p.v, "v", p);
  REQUIRE((p.k_extra.data != nullptr) == (p.q_extra != nullptr),
          "q_extra and k_extra.data must both be set or both be null");
  if (p.k_extra.data) check_stream(p.k_extra, "k_extra", p);
}

namespace {

// Host live lengths each within [0, live_len] (the CUDA kernel, which cannot
// read them on the host, poisons such a sequence's outputs instead).
void check_live_lens_cpu(const MaskedDecodeParams& p) {
  if (p.live_lens == nullptr) return;
  for (int32_t b = 0; b < p.batch; ++b) {
    REQUIRE(p.live_lens[b] >= 0 && p.live_lens[b] <= p.live_len,
            "live_lens[" + std::to_string(b) + "] = " + std::to_string(p.live_lens[b]) +
                " is outside [0, live_len = " + std::to_string(p.live_len) + "]");
  }
}

}  // namespace

void run_masked_decode_cpu(const MaskedDecodeParams& p) {
  check_masked_decode_params(p);
  check_live_lens_cpu(p);
  const int64_t num_requests = int64_t{p.batch} * p.num_kv_heads;  // int64: the product may pass 2^31
  if (num_requests == 0) return;
  PlanShape shape;
  shape.group_size = p.group_size;
  shape.head_dim_v = p.v.dim;
  shape.num_sms = cpu::hardware_threads();
  shape.min_chunk_tokens = 512;
  const DecodePlan plan = make_decode_plan(
      std::vector<int32_t>(static_cast<size_t>(num_requests), static_cast<int32_t>(p.live_len)), shape);
  Buffer workspace(Device::kCpu, plan.workspace.total);
  const int32_t de = p.k_extra.data ? p.k_extra.dim : 0;
  const int64_t esize = static_cast<int64_t>(dtype_size(p.dtype));
  const cpu::PlanOutputs out{
      p.dtype, p.group_size, p.k.dim,
      p.v.dim, de,           p.num_kv_heads,
      p.q,     p.q_extra,    p.scale,
      p.o,     p.lse,        cpu::packed_qo_strides(p.num_kv_heads, p.group_size, p.k.dim, de, p.v.dim)};
  auto row_start = [&](const RowView& s, int32_t r) {
    return static_cast<const char*>(s.data) + s.offset(r / p.num_kv_heads, r % p.num_kv_heads, 0) * esize;
  };
  auto rows_of = [&](int32_t r) {
    const char* k = row_start(p.k, r);
    const char* v = row_start(p.v, r);
    const char* e = de > 0 ? row_start(p.k_extra, r) : nullptr;
    return [&p, esize, k, v, e](int64_t t) {
      return cpu::TokenRows{k + t * p.k.row_stride * esize, v + t * p.v.row_stride * esize,
                            e ? e + t * p.k_extra.row_stride * esize : nullptr};
    };
  };
  const int64_t pitch = p.mask_pitch > 0 ? p.mask_pitch : p.live_len;
  auto bias_of = [&](int32_t r) {
    const float* mask = p.mask ? p.mask + static_cast<int64_t>(r) * pitch : nullptr;
    return [mask](int64_t t) { return mask ? mask[t] : 0.0f; };
  };
  auto visible = [&p](int32_t r) { return p.live_lens ? int64_t{p.live_lens[r / p.num_kv_heads]} : p.live_len; };
  cpu::run_plan(plan, out, workspace.data(), rows_of, bias_of, visible);
}

void gather_rows(Device device, const int32_t* rows, const int32_t* offsets, int32_t num_requests, int64_t max_rows,
                 DType dtype, const RowView& pool, int64_t num_pool_rows, void* dst, void* stream) {
  if (num_requests < 0 || max_rows < 0) throw Error("gather_rows: num_requests and max_rows must not be negative");
  if (pool.data == nullptr || pool.dim < 1 || pool.row_stride < pool.dim) {
    throw Error("gather_rows: pool needs data, dim >= 1 and row_stride >= dim");
  }
  if (num_requests == 0) return;
  if (offsets == nullptr) throw Error("gather_rows: offsets is null");
  if (max_rows > 0 && (dst == nullptr || rows == nullptr)) throw Error("gather_rows: rows and dst must not be null");
  if (num_pool_rows < 0) throw Error("gather_rows: num_pool_rows is negative");
  if (static_cast<long double>(num_requests) * static_cast<long double>(max_rows) * pool.dim * dtype_size(dtype) >=
      4.6e18L) {
    throw Error("gather_rows: num_requests * max_rows * pool.dim elements span more than 2^62 bytes");
  }
  if (device == Device::kCuda) {
    detail::gather_rows_cuda(rows, offsets, num_requests, max_rows, dtype, pool, num_pool_rows, dst, stream);
    return;
  }
  const size_t esize = dtype_size(dtype);
  const size_t row_bytes = static_cast<size_t>(pool.dim) * esize;
  std::vector<char> nan_row(row_bytes);
  {
    std::vector<float> nan_values(static_cast<size_t>(pool.dim), std::numeric_limits<float>::quiet_NaN());
    from_float(dtype, nan_values.data(), nan_row.data(), nan_values.size());
  }
  // Host offsets are checked before any row is read: negative or decreasing
  // offsets would index before `rows`.
  // All of them first, so a refused call writes nothing.
  if (offsets[0] != 0) throw Error("gather_rows: offsets[0] = " + std::to_string(offsets[0]) + ", expected 0");
  for (int32_t r = 0; r < num_requests; ++r) {
    const int64_t count = int64_t{offsets[r + 1]} - offsets[r];
    if (count < 0 || count > max_rows) {
      throw Error("gather_rows: request " + std::to_string(r) + " has " + std::to_string(count) +
                  " rows, outside [0, max_rows = " + std::to_string(max_rows) + "]");
    }
  }
  for (int32_t r = 0; r < num_requests; ++r) {
    const int64_t count = int64_t{offsets[r + 1]} - offsets[r];
    char* out = static_cast<char*>(dst) + static_cast<size_t>(r) * static_cast<size_t>(max_rows) * row_bytes;
    for (int64_t i = 0; i < max_rows; ++i) {
      char* target = out + static_cast<size_t>(i) * row_bytes;
      if (i >= count) {
        std::fill(target, target + row_bytes, 0);
        continue;
      }
      const int64_t row = rows[offsets[r] + i];
      if (row < 0 || row >= num_pool_rows) {  // never read outside the pool
        std::copy(nan_row.begin(), nan_row.end(), target);
        continue;
      }
      const char* src = static_cast<const char*>(pool.data) + row * pool.row_stride * static_cast<int64_t>(esize);
      std::copy(src, src + row_bytes, target);
    }
  }
}

}  // namespace sparsepage

#undef REQUIRE
