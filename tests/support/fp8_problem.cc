#include "support/fp8_problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "sparsepage/fp8.h"

namespace sparsepage::testing {

DecodeParams Fp8Problem::host_params(void* o, float* lse) const {
  DecodeParams p = base->host_params(o, lse);
  p.kv_format = format;
  p.num_kv_heads = num_kv_heads;
  if (format == KvFormat::kE4m3Mla) {
    const MlaFp8Views views = mla_fp8_views(k.data(), base->pool_rows(), k_row_bytes);
    p.k = views.k;
    p.v = views.v;
    p.k_extra = views.k_extra;
  } else {
    p.k = RowView{k.data(), k_row_bytes, base->spec.dim_qk};
    p.v = RowView{v.data(), v_row_bytes, base->spec.dim_v};
    p.k_scale = k_scale.data();
    p.v_scale = v_scale.data();
  }
  return p;
}

float Fp8Problem::k_value(int32_t r, int64_t row, int32_t d) const {
  const uint8_t* bytes = k.data() + row * k_row_bytes;
  if (format == KvFormat::kE4m3Mla) {
    float scale;
    std::memcpy(&scale, bytes + MlaFp8Row::kScaleOffset + 4 * (d / MlaFp8Row::kBlock), 4);
    return e4m3_to_float(bytes[d]) * scale;
  }
  return e4m3_to_float(bytes[d]) * k_scale[static_cast<size_t>(r % num_kv_heads)];
}

float Fp8Problem::v_value(int32_t r, int64_t row, int32_t d) const {
  if (format == KvFormat::kE4m3Mla) return k_value(r, row, d);
  return e4m3_to_float(v[static_cast<size_t>(row * v_row_bytes + d)]) * v_scale[static_cast<size_t>(r % num_kv_heads)];
}

Fp8Problem make_fp8_per_head(const PagedProblem& base, int32_t num_kv_heads) {
  Fp8Problem f;
  f.base = &base;
  f.format = KvFormat::kE4m3PerHead;
  f.num_kv_heads = num_kv_heads;
  const auto& s = base.spec;
  const int64_t rows = base.pool_rows();
  const std::vector<float> k = as_float(s.dtype, base.k_pool);
  const std::vector<float> v = as_float(s.dtype, base.v_pool);
  f.k_row_bytes = base.k_row_stride;
  f.v_row_bytes = base.v_row_stride;
  f.k.assign(static_cast<size_t>(rows * f.k_row_bytes), 0x7F);
  f.v.assign(static_cast<size_t>(rows * f.v_row_bytes), 0x7F);
  for (int64_t row = 0; row < rows; ++row) {
    for (int32_t d = 0; d < s.dim_qk; ++d)
      f.k[static_cast<size_t>(row * f.k_row_bytes + d)] = float_to_e4m3(k[static_cast<size_t>(row * base.k_row_stride + d)] * 448.0f);
    for (int32_t d = 0; d < s.dim_v; ++d)
      f.v[static_cast<size_t>(row * f.v_row_bytes + d)] = float_to_e4m3(v[static_cast<size_t>(row * base.v_row_stride + d)] * 448.0f);
  }
  for (int32_t h = 0; h < num_kv_heads; ++h) {
    f.k_scale.push_back(static_cast<float>(h + 1) / 448.0f);
    f.v_scale.push_back(static_cast<float>(2 * h + 1) / 896.0f);
  }
  return f;
}

Fp8Problem make_fp8_mla(const PagedProblem& base, int64_t row_bytes) {
  Fp8Problem f;
  f.base = &base;
  f.format = KvFormat::kE4m3Mla;
  const int64_t rows = base.pool_rows();
  // The quantizer's source: [rows, 512 latent | 64 rope] bf16.
  std::vector<uint16_t> src(static_cast<size_t>(rows * 576));
  for (int64_t row = 0; row < rows; ++row) {
    std::memcpy(&src[static_cast<size_t>(row * 576)], base.k_pool.data() + row * base.k_row_stride * 2, 512 * 2);
    std::memcpy(&src[static_cast<size_t>(row * 576 + 512)], base.e_pool.data() + row * base.e_row_stride * 2, 64 * 2);
  }
  f.k_row_bytes = row_bytes;
  f.k.assign(static_cast<size_t>(rows * row_bytes), 0xFF);
  quantize_mla_fp8_cpu(DType::kBF16, src.data(), rows, 576, f.k.data(), row_bytes);
  return f;
}

Reference reference_attention(const Fp8Problem& f) { return reference_attention(f, f.base->token_rows()); }

Reference reference_attention(const Fp8Problem& f, const std::vector<std::vector<int64_t>>& all_rows) {
  const PagedProblem& pb = *f.base;
  std::vector<std::vector<int64_t>> rows;
  for (const auto& request : all_rows) {
    rows.emplace_back();
    for (int64_t row : request) {
      if (row >= 0) rows.back().push_back(row);
    }
  }
  const auto& s = pb.spec;
  const std::vector<float> q = as_float(s.dtype, pb.q);
  const std::vector<float> qe = s.dim_extra > 0 ? as_float(s.dtype, pb.q_extra) : std::vector<float>{};
  const std::vector<float> e = s.dim_extra > 0 ? as_float(s.dtype, pb.e_pool) : std::vector<float>{};
  Reference ref;
  ref.o.assign(rows.size() * s.group_size * s.dim_v, 0.0);
  ref.lse.assign(rows.size() * s.group_size, -std::numeric_limits<double>::infinity());
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto req = static_cast<int32_t>(r);
    // The request's rows dequantized once.
    std::vector<std::vector<double>> kr, vr;
    for (int64_t row : rows[r]) {
      std::vector<double> kd(static_cast<size_t>(s.dim_qk)), vd(static_cast<size_t>(s.dim_v));
      for (int32_t d = 0; d < s.dim_qk; ++d) kd[static_cast<size_t>(d)] = f.k_value(req, row, d);
      for (int32_t d = 0; d < s.dim_v; ++d) vd[static_cast<size_t>(d)] = f.v_value(req, row, d);
      kr.push_back(std::move(kd));
      vr.push_back(std::move(vd));
    }
    for (int32_t g = 0; g < s.group_size; ++g) {
      const size_t qrow = r * s.group_size + g;
      std::vector<double> scores;
      for (size_t j = 0; j < rows[r].size(); ++j) {
        double dot = 0.0;
        for (int32_t d = 0; d < s.dim_qk; ++d) dot += double{q[qrow * s.dim_qk + d]} * kr[j][static_cast<size_t>(d)];
        for (int32_t d = 0; d < s.dim_extra; ++d)
          dot += double{qe[qrow * s.dim_extra + d]} * e[static_cast<size_t>(rows[r][j] * pb.e_row_stride + d)];
        scores.push_back(dot * pb.scale);
      }
      ref.lse[qrow] = softmax_weighted_sum(
          scores, s.dim_v, [&](size_t j, int64_t d) { return vr[j][static_cast<size_t>(d)]; }, &ref.o[qrow * s.dim_v]);
    }
  }
  return ref;
}

Fp8Problem make_fp8_far_queries(PagedProblem& pb) {
  std::mt19937_64 rng(46);
  ProblemSpec spec;
  spec.seq_lens = {300, 64, 129, 500};
  spec.group_size = 16;
  spec.pool_pages = 2048;
  pb = make_problem(spec, rng);
  std::vector<float> q = as_float(spec.dtype, pb.q);
  const size_t per_request = q.size() / spec.seq_lens.size();
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] *= (i / per_request) % 2 == 0 ? std::ldexp(1.0f, 40) : std::ldexp(1.0f, -40);
  }
  from_float(spec.dtype, q.data(), pb.q.data(), q.size());
  return make_fp8_per_head(pb, 2);
}

double max_finite_lse(const Reference& ref) {
  double m = 0;
  for (double x : ref.lse) m = std::isfinite(x) ? std::max(m, std::fabs(x)) : m;
  return m;
}

}  // namespace sparsepage::testing
