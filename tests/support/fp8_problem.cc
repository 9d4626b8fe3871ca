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
    const float value = e4m3_to_float(bytes[d]) * scale;  // the product in fp32, as the kernels form it
    return round_to_bf16 ? bf16_to_float(float_to_bf16(value)) : value;
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
      f.k[static_cast<size_t>(row * f.k_row_bytes + d)] =
          float_to_e4m3(k[static_cast<size_t>(row * base.k_row_stride + d)] * 448.0f);
    for (int32_t d = 0; d < s.dim_v; ++d)
      f.v[static_cast<size_t>(row * f.v_row_bytes + d)] =
          float_to_e4m3(v[static_cast<size_t>(row * base.v_row_stride + d)] * 448.0f);
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

Fp8RoundingBound mla_rounding_bound(const Fp8Problem& f, const std::vector<std::vector<int64_t>>& all_rows) {
  // u: bf16's unit roundoff (8 significant bits, round to nearest). Each
  // latent value the tensor cores read is k (1 + d), |d| <= u, where k is
  // the exact dequantization (the fp32 product e4m3 x scale is exact to
  // 2^-24, folded into the fp32 term). Score j then moves by at most
  //   ds_j <= u A_j + g (B_j + |s_j|),   A_j = scale sum_i |q_i k_ji| (latent),
  //   B_j = A_j + scale sum_i |qe_i e_ji| (rope, exact in bf16),
  // g covering the fp32 sums of the 576 products and the log2(e) scaling.
  // lse = log sum exp s is 1-Lipschitz in the max norm: dlse <= max_j ds_j,
  // plus the fp32 sum of the softmax denominator over n tokens and the
  // exp2 / log2 approximations. Each weight p_j = exp(s_j - lse) moves by a
  // factor within exp(+-2 max ds), so with W_d = sum_j p_j |v_jd|:
  //   |do_d| <= (e^{2 max ds} - 1)(1 + u) W_d   the weights
  //           + u W_d                            V's own rounding (V is the latent)
  //           + u W_d                            P rounded to bf16 for the P.V MMA
  //           + 2 n 2^-24 W_d                    the fp32 sums of P.V and of the weights
  //           + u (|o_d| + that)                 o written as bf16
  //           + 1e-5 W_d                         exp2 approximation, the merge's fp32 weights.
  const double u = std::ldexp(1.0, -8), g = 600 * std::ldexp(1.0, -24);
  const PagedProblem& pb = *f.base;
  const auto& s = pb.spec;
  Fp8Problem exact = f;
  exact.round_to_bf16 = false;
  const std::vector<float> q = as_float(s.dtype, pb.q);
  const std::vector<float> qe = as_float(s.dtype, pb.q_extra);
  const std::vector<float> e = as_float(s.dtype, pb.e_pool);
  Fp8RoundingBound bound;
  bound.o.assign(all_rows.size() * s.group_size * s.dim_v, 0.0);
  bound.lse.assign(all_rows.size() * s.group_size, 0.0);
  for (size_t r = 0; r < all_rows.size(); ++r) {
    std::vector<int64_t> rows;
    for (int64_t row : all_rows[r]) {
      if (row >= 0) rows.push_back(row);
    }
    if (rows.empty()) continue;
    const auto req = static_cast<int32_t>(r);
    std::vector<std::vector<double>> kr;
    for (int64_t row : rows) {
      kr.emplace_back(static_cast<size_t>(s.dim_qk));
      for (int32_t d = 0; d < s.dim_qk; ++d) kr.back()[static_cast<size_t>(d)] = exact.k_value(req, row, d);
    }
    const double n = static_cast<double>(rows.size());
    for (int32_t gi = 0; gi < s.group_size; ++gi) {
      const size_t qrow = r * s.group_size + gi;
      std::vector<double> score(rows.size());
      double ds_max = 0;
      for (size_t j = 0; j < rows.size(); ++j) {
        double dot = 0, a = 0, b = 0;
        for (int32_t d = 0; d < s.dim_qk; ++d) {
          const double x = double{q[qrow * s.dim_qk + d]} * kr[j][static_cast<size_t>(d)];
          dot += x;
          a += std::fabs(x);
        }
        for (int32_t d = 0; d < s.dim_extra; ++d) {
          const double x = double{qe[qrow * s.dim_extra + d]} * e[static_cast<size_t>(rows[j] * pb.e_row_stride + d)];
          dot += x;
          b += std::fabs(x);
        }
        score[j] = dot * pb.scale;
        a *= pb.scale;
        b = a + b * pb.scale;
        bound.largest_score_sum = std::max(bound.largest_score_sum, a);
        ds_max = std::max(ds_max, u * a + g * (b + std::fabs(score[j])));
      }
      const double m = *std::max_element(score.begin(), score.end());
      double sum = 0;
      for (double x : score) sum += std::exp(x - m);
      const double lse = m + std::log(sum);
      bound.lse[qrow] = ds_max + 2 * n * std::ldexp(1.0, -24) + 1e-5 * (1 + std::fabs(lse));
      const double weights = std::expm1(2 * ds_max) * (1 + u);
      for (int32_t d = 0; d < s.dim_v; ++d) {
        double w = 0, o = 0;
        for (size_t j = 0; j < rows.size(); ++j) {
          const double p = std::exp(score[j] - lse);
          const double v = exact.v_value(req, rows[j], d);
          w += p * std::fabs(v);
          o += p * v;
        }
        const double inner = (weights + 2 * u + 2 * n * std::ldexp(1.0, -24) + 1e-5) * w;
        // 1e-30: weights below fp32's normal range, which the kernels flush to zero.
        bound.o[qrow * s.dim_v + d] = inner + u * (std::fabs(o) + inner) + 1e-30;
      }
    }
  }
  return bound;
}

std::string outside_bound(const Fp8Problem& f, const Reference& ref, const Fp8RoundingBound& bound,
                          const std::vector<float>& o, const std::vector<float>& lse) {
  const auto& s = f.base->spec;
  std::string out;
  int reported = 0;
  auto report = [&](size_t row, const std::string& what) {
    if (reported++ < 4) {
      out += "request " + std::to_string(row / s.group_size) + " head " + std::to_string(row % s.group_size) + ": " +
             what + "; ";
    }
  };
  for (size_t row = 0; row < ref.lse.size(); ++row) {
    if (std::isinf(ref.lse[row])) {
      if (!(std::isinf(lse[row]) && lse[row] < 0)) report(row, "lse " + std::to_string(lse[row]) + ", expected -inf");
      continue;
    }
    const double lse_err = std::fabs(double{lse[row]} - ref.lse[row]);
    if (!(lse_err <= bound.lse[row])) {
      report(row, "lse off by " + std::to_string(lse_err) + " > bound " + std::to_string(bound.lse[row]));
    }
    for (int32_t d = 0; d < s.dim_v; ++d) {
      const size_t i = row * s.dim_v + d;
      const double err = std::fabs(double{o[i]} - ref.o[i]);
      if (!(err <= bound.o[i])) {
        report(row,
               "o[" + std::to_string(d) + "] off by " + std::to_string(err) + " > bound " + std::to_string(bound.o[i]));
      }
    }
  }
  if (reported > 4) out += std::to_string(reported - 4) + " more";
  return out;
}

double max_finite_lse(const Reference& ref) {
  double m = 0;
  for (double x : ref.lse) m = std::isfinite(x) ? std::max(m, std::fabs(x)) : m;
  return m;
}

}  // namespace sparsepage::testing
