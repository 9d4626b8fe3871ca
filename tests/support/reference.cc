#include "support/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>

namespace sparsepage::testing {

std::vector<uint8_t> random_values(DType dtype, size_t count, std::mt19937_64& rng, float amp) {
  std::uniform_real_distribution<float> dist(-amp, amp);
  std::vector<float> values(count);
  for (float& v : values) v = dist(rng);
  std::vector<uint8_t> bytes(count * dtype_size(dtype));
  from_float(dtype, values.data(), bytes.data(), count);
  return bytes;
}

std::vector<uint8_t> nan_values(DType dtype, size_t count) {
  std::vector<float> values(count, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> bytes(count * dtype_size(dtype));
  from_float(dtype, values.data(), bytes.data(), count);
  return bytes;
}

std::vector<float> as_float(DType dtype, const std::vector<uint8_t>& bytes) {
  std::vector<float> out(bytes.size() / dtype_size(dtype));
  to_float(dtype, bytes.data(), out.data(), out.size());
  return out;
}

std::vector<float> cache_window(const DenseKVCache& cache, bool key) {
  const int32_t heads = key ? cache.k_heads() : cache.v_heads();
  const int32_t dim = key ? cache.k_head_dim() : cache.v_head_dim();
  if (!key && heads == 0) return {};  // a key-only cache
  const int64_t window = cache.live_len();
  std::vector<float> out(static_cast<size_t>(cache.batch()) * heads * static_cast<size_t>(window) * dim, 0.0f);
  const std::optional<RowView> rows = key ? cache.k_rows() : cache.v_rows();
  if (window == 0 || !rows) return out;
  // The allocation [batch, heads, capacity, row_stride] to the host once, then each live row converted.
  const size_t elem = dtype_size(cache.dtype());
  std::vector<uint8_t> host(static_cast<size_t>(cache.batch() * rows->seq_stride) * elem);
  copy_bytes(host.data(), Device::kCpu, rows->data, cache.device(), host.size());
  for (int32_t b = 0; b < cache.batch(); ++b) {
    const int64_t len = cache.active()[static_cast<size_t>(b)] ? cache.live_lens()[static_cast<size_t>(b)] : 0;
    for (int32_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < len; ++t) {
        const uint8_t* src = host.data() + static_cast<size_t>(rows->offset(b, h, t)) * elem;
        to_float(cache.dtype(), src, &out[static_cast<size_t>(((int64_t{b} * heads + h) * window + t) * dim)],
                 static_cast<size_t>(dim));
      }
    }
  }
  return out;
}

std::vector<float> quarter_grid(std::mt19937_64& rng, size_t count) {
  std::uniform_int_distribution<int> level(-4, 4);
  std::vector<float> v(count);
  for (float& x : v) x = static_cast<float>(level(rng)) / 4.0f;
  return v;
}

Buffer to_device(Device device, DType dtype, const std::vector<float>& x) {
  std::vector<uint8_t> bytes(x.size() * dtype_size(dtype));
  if (!x.empty()) from_float(dtype, x.data(), bytes.data(), x.size());
  if (bytes.empty()) bytes.resize(16);
  return upload(device, bytes);
}

Buffer poisoned(Device device, size_t count) {
  Buffer o(device, std::max<size_t>(count, 8) * 2);
  fill_bytes(o.data(), device, 0xFF, o.bytes());
  return o;
}

std::vector<float> read_bf16(Device device, const Buffer& o, size_t count) {
  const auto bytes = download<uint8_t>(device, o.data(), count * 2);
  std::vector<float> x(count);
  to_float(DType::kBF16, bytes.data(), x.data(), count);
  return x;
}

std::vector<std::vector<int64_t>> PagedProblem::token_rows() const {
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(num_requests()));
  for (int32_t r = 0; r < num_requests(); ++r) {
    const int64_t offset = table.first_page_offset[static_cast<size_t>(r)];
    for (int64_t t = 0; t < table.seq_lens[static_cast<size_t>(r)]; ++t) {
      const int64_t slot = offset + t;
      rows[static_cast<size_t>(r)].push_back(
          int64_t{indices[static_cast<size_t>(table.indptr[static_cast<size_t>(r)] + slot / spec.page_size)]} *
              spec.page_size +
          slot % spec.page_size);
    }
  }
  return rows;
}

DecodeParams PagedProblem::host_params(void* o, float* lse) const {
  DecodeParams p;
  p.dtype = spec.dtype;
  p.indptr = table.indptr.data();
  p.indices = indices.data();
  p.first_page_offset = table.first_page_offset.data();
  p.seq_lens = table.seq_lens.data();
  p.num_indices = static_cast<int64_t>(indices.size());
  p.num_requests = num_requests();
  p.page_size = spec.page_size;
  p.num_pool_pages = spec.pool_pages;
  p.group_size = spec.group_size;
  p.q = q.data();
  p.k = {k_pool.data(), k_row_stride, spec.dim_qk};
  p.v = spec.v_aliases_k ? RowView{k_pool.data(), k_row_stride, spec.dim_v}
                         : RowView{v_pool.data(), v_row_stride, spec.dim_v};
  if (spec.dim_extra > 0) {
    p.q_extra = q_extra.data();
    p.k_extra = {e_pool.data(), e_row_stride, spec.dim_extra};
  }
  p.scale = scale;
  p.o = o;
  p.lse = lse;
  return p;
}

PagedProblem make_problem(const ProblemSpec& spec, std::mt19937_64& rng) {
  PagedProblem pb;
  pb.spec = spec;
  std::vector<int32_t> offsets;
  if (spec.random_first_page_offset) {
    std::uniform_int_distribution<int32_t> pick(0, spec.page_size - 1);
    for (size_t r = 0; r < spec.seq_lens.size(); ++r) offsets.push_back(pick(rng));
  }
  pb.table = build_page_table_structure(spec.seq_lens, spec.page_size, offsets);
  // Pages: distinct draws unless duplicates are allowed; order is random either way.
  std::uniform_int_distribution<int32_t> page(0, static_cast<int32_t>(spec.pool_pages - 1));
  std::vector<int32_t> unused(static_cast<size_t>(spec.pool_pages));
  for (size_t i = 0; i < unused.size(); ++i) unused[i] = static_cast<int32_t>(i);
  std::shuffle(unused.begin(), unused.end(), rng);
  for (int64_t i = 0; i < pb.table.num_pages(); ++i) {
    pb.indices.push_back(spec.allow_duplicates ? page(rng) : unused.at(static_cast<size_t>(i)));
  }
  const size_t g_rows = static_cast<size_t>(pb.num_requests()) * spec.group_size;
  pb.q = random_values(spec.dtype, g_rows * spec.dim_qk, rng);
  if (spec.dim_extra > 0) pb.q_extra = random_values(spec.dtype, g_rows * spec.dim_extra, rng);
  pb.scale = spec.scale != 0.0f ? spec.scale : 1.0f / std::sqrt(static_cast<float>(spec.dim_qk + spec.dim_extra));

  // Pools start as NaN; only rows that visible tokens resolve to get values.
  const int64_t rows = pb.pool_rows();
  const size_t esize = dtype_size(spec.dtype);
  pb.k_row_stride = spec.dim_qk + spec.k_row_padding;
  pb.v_row_stride = spec.v_aliases_k ? pb.k_row_stride : spec.dim_v + spec.v_row_padding;
  pb.e_row_stride = spec.dim_extra + spec.extra_row_padding;
  pb.k_pool = nan_values(spec.dtype, static_cast<size_t>(rows * pb.k_row_stride));
  if (!spec.v_aliases_k) pb.v_pool = nan_values(spec.dtype, static_cast<size_t>(rows * pb.v_row_stride));
  if (spec.dim_extra > 0) pb.e_pool = nan_values(spec.dtype, static_cast<size_t>(rows * pb.e_row_stride));
  auto fill_row = [&](std::vector<uint8_t>& pool, int64_t stride, int32_t dim, int64_t row) {
    const auto values = random_values(spec.dtype, static_cast<size_t>(dim), rng);
    std::copy(values.begin(), values.end(), pool.begin() + static_cast<std::ptrdiff_t>(row * stride * esize));
  };
  std::vector<bool> filled(static_cast<size_t>(rows), false);
  for (const auto& request : pb.token_rows()) {
    for (int64_t row : request) {
      if (filled[static_cast<size_t>(row)]) continue;
      filled[static_cast<size_t>(row)] = true;
      fill_row(pb.k_pool, pb.k_row_stride, spec.dim_qk, row);
      if (!spec.v_aliases_k) fill_row(pb.v_pool, pb.v_row_stride, spec.dim_v, row);
      if (spec.dim_extra > 0) fill_row(pb.e_pool, pb.e_row_stride, spec.dim_extra, row);
    }
  }
  return pb;
}

Reference reference_attention(const PagedProblem& pb, const std::vector<std::vector<int64_t>>& rows) {
  const auto& s = pb.spec;
  const std::vector<float> q = as_float(s.dtype, pb.q);
  const std::vector<float> qe = s.dim_extra > 0 ? as_float(s.dtype, pb.q_extra) : std::vector<float>{};
  const std::vector<float> k = as_float(s.dtype, pb.k_pool);
  const std::vector<float> v = s.v_aliases_k ? k : as_float(s.dtype, pb.v_pool);
  const std::vector<float> e = s.dim_extra > 0 ? as_float(s.dtype, pb.e_pool) : std::vector<float>{};
  Reference ref;
  ref.o.assign(rows.size() * s.group_size * s.dim_v, 0.0);
  ref.lse.assign(rows.size() * s.group_size, -std::numeric_limits<double>::infinity());
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int32_t g = 0; g < s.group_size; ++g) {
      const size_t qrow = r * s.group_size + g;
      std::vector<double> scores;
      for (int64_t row : rows[r]) {
        double dot = 0.0;
        for (int32_t d = 0; d < s.dim_qk; ++d) dot += double{q[qrow * s.dim_qk + d]} * k[row * pb.k_row_stride + d];
        for (int32_t d = 0; d < s.dim_extra; ++d) {
          dot += double{qe[qrow * s.dim_extra + d]} * e[row * pb.e_row_stride + d];
        }
        scores.push_back(dot * pb.scale);
      }
      ref.lse[qrow] = softmax_weighted_sum(
          scores, s.dim_v, [&](size_t j, int64_t d) { return double{v[rows[r][j] * pb.v_row_stride + d]}; },
          &ref.o[qrow * s.dim_v]);
    }
  }
  return ref;
}

double relative_l2(const std::vector<float>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    diff += (got[i] - ref[i]) * (got[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0.0) return std::sqrt(diff);
  return std::sqrt(diff / norm);
}

std::string compare_per_request(const PagedProblem& pb, const Reference& ref, const std::vector<float>& o,
                                const std::vector<float>& lse, double o_tol, double lse_tol) {
  const size_t heads = static_cast<size_t>(pb.num_requests()) * static_cast<size_t>(pb.spec.group_size);
  const size_t dv = static_cast<size_t>(pb.spec.dim_v);
  if (o.size() != heads * dv || lse.size() != heads || ref.o.size() != o.size()) return "output sizes differ";
  for (size_t i = 0; i < heads; ++i) {
    const std::string where = "request " + std::to_string(i / static_cast<size_t>(pb.spec.group_size)) + " head " +
                              std::to_string(i % static_cast<size_t>(pb.spec.group_size)) + ": ";
    const std::vector<float> got(o.begin() + static_cast<std::ptrdiff_t>(i * dv),
                                 o.begin() + static_cast<std::ptrdiff_t>((i + 1) * dv));
    const std::vector<double> want(ref.o.begin() + static_cast<std::ptrdiff_t>(i * dv),
                                   ref.o.begin() + static_cast<std::ptrdiff_t>((i + 1) * dv));
    const double err = relative_l2(got, want);
    if (!(err <= o_tol)) return where + "o relative L2 " + std::to_string(err) + " > " + std::to_string(o_tol);
    if (std::isinf(ref.lse[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0)) return where + "lse " + std::to_string(lse[i]) + ", expected -inf";
      continue;
    }
    const double lse_err = std::fabs(double{lse[i]} - ref.lse[i]);
    if (!(lse_err <= lse_tol)) {
      return where + "lse " + std::to_string(lse[i]) + " vs fp64 " + std::to_string(ref.lse[i]) + " (off by " +
             std::to_string(lse_err) + ")";
    }
  }
  return "";
}

MaskedDecodeParams one_request_masked_params(DType dtype, int32_t group_size, int64_t live_len, int32_t dim,
                                             const void* q, const void* k, const void* v) {
  MaskedDecodeParams p;
  p.dtype = dtype;
  p.batch = 1;
  p.num_kv_heads = 1;
  p.group_size = group_size;
  p.live_len = live_len;
  p.q = q;
  p.k = RowView::dense(k, 1, live_len, dim);
  p.v = RowView::dense(v, 1, live_len, dim);
  return p;
}

}  // namespace sparsepage::testing
