// The decode's multi-token step over e4m3 K/V with per-KV-head scales
// (KvFormat::kE4m3PerHead), which a GQA block prefill's query blocks run:
// the same bits as the native step over the same values and fp64 per token
// under its causal limit, on the CPU backend.
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/plan.h"
#include "sparsepage/types.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

// The decode's multi-token step over e4m3-per-head rows (what a prefill
// query block runs): random e4m3 rows (no NaN code) with power-of-two head
// scales, every position of the window read; the same bits as the native
// step over the same values, and fp64 per token under its causal limit.
TEST(DecodeFp8MultiToken, EqualsTheNativeStepOverTheSameValues) {
  const DType dtype = DType::kBF16;
  const int32_t hkv = 2, g = 4, d = 64, q_len = 5, page = 8;
  const int64_t len = 45;  // tokens 40 .. 44 are the step's
  std::mt19937_64 rng(21);
  std::uniform_int_distribution<int> byte(0, 255);
  const size_t rows = static_cast<size_t>(hkv) * static_cast<size_t>(len);
  std::vector<uint8_t> k8(rows * d), v8(rows * d);
  for (auto* stream : {&k8, &v8}) {
    for (uint8_t& x : *stream) {
      do x = static_cast<uint8_t>(byte(rng));
      while ((x & 0x7F) == 0x7F);  // no NaN
    }
  }
  const std::vector<float> k_scale = {0.25f, 2.0f}, v_scale = {4.0f, 0.125f};
  std::vector<float> kf(k8.size()), vf(v8.size());
  for (size_t i = 0; i < k8.size(); ++i) {
    const size_t h = i / (static_cast<size_t>(len) * d);
    kf[i] = e4m3_to_float(k8[i]) * k_scale[h];
    vf[i] = e4m3_to_float(v8[i]) * v_scale[h];
  }
  std::vector<uint8_t> kn(kf.size() * 2), vn(vf.size() * 2);
  from_float(dtype, kf.data(), kn.data(), kf.size());
  from_float(dtype, vf.data(), vn.data(), vf.size());
  ASSERT_EQ(testing::as_float(dtype, kn), kf);  // exact: e4m3 x a power of two is a bf16 value
  ASSERT_EQ(testing::as_float(dtype, vn), vf);
  const auto q = testing::random_values(dtype, static_cast<size_t>(q_len) * hkv * g * d, rng, 0.05f);

  std::vector<int32_t> indptr = {0}, indices, seq_lens;
  for (int32_t h = 0; h < hkv; ++h) {
    for (int32_t j = 0; j * page < len; ++j) indices.push_back(j);
    indptr.push_back(static_cast<int32_t>(indices.size()));
    seq_lens.push_back(static_cast<int32_t>(len));
  }
  PlanShape shape;
  shape.group_size = g * q_len;
  shape.head_dim_v = d;
  shape.num_sms = 3;
  const DecodePlan plan = make_decode_plan(seq_lens, shape);
  const auto step = [&](bool fp8, std::vector<uint8_t>& o, std::vector<float>& lse) {
    DecodeParams p;
    p.dtype = dtype;
    p.q = q.data();
    p.k = RowView::dense(fp8 ? static_cast<const void*>(k8.data()) : kn.data(), hkv, len, d);
    p.v = RowView::dense(fp8 ? static_cast<const void*>(v8.data()) : vn.data(), hkv, len, d);
    p.scale = 0.125f;
    if (fp8) {
      p.kv_format = KvFormat::kE4m3PerHead;
      p.k_scale = k_scale.data();
      p.v_scale = v_scale.data();
    }
    o = testing::nan_values(dtype, static_cast<size_t>(q_len) * hkv * g * d);
    lse.assign(static_cast<size_t>(q_len) * hkv * g, std::numeric_limits<float>::quiet_NaN());
    p.o = o.data();
    p.lse = lse.data();
    p.indptr = indptr.data();
    p.indices = indices.data();
    p.num_indices = static_cast<int64_t>(indices.size());
    p.num_requests = hkv;
    p.num_kv_heads = hkv;
    p.page_size = page;
    p.addressing = PageAddressing::kWindow;
    p.window_len = len;
    p.group_size = g;
    p.q_len = q_len;
    std::vector<char> ws(plan.workspace.total + 256);
    run_decode_cpu(p, plan, ws.data());
  };
  std::vector<uint8_t> o8, on;
  std::vector<float> l8, ln;
  step(true, o8, l8);
  step(false, on, ln);
  EXPECT_EQ(o8, on);
  EXPECT_EQ(l8, ln);
  // fp64 of token t, head (h, j): positions below len - (q_len - 1 - t).
  const std::vector<float> qf = testing::as_float(dtype, q), of = testing::as_float(dtype, o8);
  for (int32_t t = 0; t < q_len; ++t) {
    for (int32_t h = 0; h < hkv; ++h) {
      for (int32_t j = 0; j < g; ++j) {
        const size_t row = (static_cast<size_t>(t) * hkv + h) * g + j;  // [q_len, heads] packed
        std::vector<double> s;
        const int64_t seen = len - (q_len - 1 - t);
        for (int64_t pos = 0; pos < seen; ++pos) {
          double dot = 0.0;
          for (int32_t i = 0; i < d; ++i)
            dot += double{qf[row * d + static_cast<size_t>(i)]} *
                   kf[(static_cast<size_t>(h) * len + static_cast<size_t>(pos)) * d + static_cast<size_t>(i)];
          s.push_back(dot * 0.125);
        }
        std::vector<double> want(static_cast<size_t>(d));
        testing::softmax_weighted_sum(
            s, d,
            [&](size_t p, int64_t i) {
              return double{vf[(static_cast<size_t>(h) * len + p) * d + static_cast<size_t>(i)]};
            },
            want.data());
        const std::vector<float> got(of.begin() + static_cast<std::ptrdiff_t>(row * d),
                                     of.begin() + static_cast<std::ptrdiff_t>((row + 1) * d));
        EXPECT_LT(testing::relative_l2(got, want), 1e-2) << "token " << t << " head " << h * g + j;
      }
    }
  }
}

}  // namespace
}  // namespace sparsepage
