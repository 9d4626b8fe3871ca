// FP8 KV caches on the CPU backend: the e4m3 conversions, the MLA row
// quantizer, the decode over e4m3-per-head and MLA-row caches against an
// fp64 reference over the dequantized values, and the refusals by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "sparsepage/dispatch.h"
#include "sparsepage/fp8.h"
#include "sparsepage/sparse_decode.h"
#include "support/expect_error.h"
#include "support/fp8_problem.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::throws_error_naming;

TEST(E4m3, EveryEncodingRoundTrips) {
  int nans = 0;
  for (int b = 0; b < 256; ++b) {
    const float x = e4m3_to_float(static_cast<uint8_t>(b));
    if (std::isnan(x)) {
      ++nans;
      EXPECT_TRUE((b & 0x7F) == 0x7F) << b;
      EXPECT_EQ(float_to_e4m3(x), 0x7F);  // one NaN encoding, as CUDA writes it
      EXPECT_EQ(float_to_e4m3(-x), 0x7F);
      continue;
    }
    EXPECT_EQ(float_to_e4m3(x), b) << "byte " << b << " = " << x;
  }
  EXPECT_EQ(nans, 2);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
}

TEST(E4m3, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);  // halfway 1 / 1.125: even (1)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);  // halfway 1.125 / 1.25: even (1.25)
  EXPECT_EQ(float_to_e4m3(1.05f), 0x38);
  EXPECT_EQ(float_to_e4m3(1.07f), 0x39);
  EXPECT_EQ(float_to_e4m3(-1.2f), 0xBA);
  EXPECT_EQ(float_to_e4m3(3.0f * std::ldexp(1.0f, -10)), 0x02);  // subnormal tie 1.5 -> 2
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);         // tie 0.5 -> 0
  EXPECT_EQ(float_to_e4m3(0.015f), 0x08);                        // rounds up into the smallest normal
  EXPECT_EQ(float_to_e4m3(460.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(1e9f), 0x7E);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

std::vector<uint16_t> random_bf16_rows(int64_t rows, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  std::vector<uint16_t> src(static_cast<size_t>(rows * 576));
  for (auto& x : src) x = float_to_bf16(u(rng));
  return src;
}

TEST(QuantizeMlaFp8, RoundTripWithinE4m3Precision) {
  std::mt19937_64 rng(11);
  const int64_t rows = 37;
  std::vector<uint16_t> src = random_bf16_rows(rows, rng);
  for (int i = 0; i < 128; ++i) src[576 + 128 + i] = 0;  // row 1, block 1: all zero
  src[2 * 576 + 5] = float_to_bf16(1e-6f);               // a value far below its block's amax
  std::vector<uint8_t> dst(static_cast<size_t>(rows * 672), 0xAB);
  quantize_mla_fp8_cpu(DType::kBF16, src.data(), rows, 576, dst.data(), 672);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = dst.data() + r * 672;
    float scales[4];
    std::memcpy(scales, row + 512, 16);
    double err = 0, norm = 0;
    for (int b = 0; b < 4; ++b) {
      float amax = 0;
      for (int i = 0; i < 128; ++i) amax = std::fmax(amax, std::fabs(bf16_to_float(src[r * 576 + b * 128 + i])));
      EXPECT_EQ(scales[b], amax > 0 ? amax / 448.0f : 1.0f) << "row " << r << " block " << b;
      for (int i = 0; i < 128; ++i) {
        const float x = bf16_to_float(src[r * 576 + b * 128 + i]);
        const float back = e4m3_to_float(row[b * 128 + i]) * scales[b];
        // 3 mantissa bits: half an ulp is 2^-4 relative; below the normals, half of 2^-9 times the scale.
        EXPECT_LE(std::fabs(back - x), std::fmax(std::fabs(x) * 0.0625f, scales[b] * std::ldexp(1.0f, -10)) * 1.0001f)
            << "row " << r << " value " << b * 128 + i;
        err += (back - x) * double{back - x};
        norm += double{x} * x;
      }
    }
    EXPECT_LT(std::sqrt(err / norm), 0.05) << "row " << r;
    EXPECT_EQ(std::memcmp(row + 528, &src[r * 576 + 512], 128), 0) << "rope of row " << r << " is copied exactly";
    for (int i = 656; i < 672; ++i) EXPECT_EQ(row[i], 0xAB) << "padding past the row is not written";
  }
}

TEST(QuantizeMlaFp8, NanBlockGetsNanScale) {
  std::mt19937_64 rng(12);
  std::vector<uint16_t> src = random_bf16_rows(1, rng);
  src[300] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> dst(656);
  quantize_mla_fp8_cpu(DType::kBF16, src.data(), 1, 576, dst.data());
  float scales[4];
  std::memcpy(scales, dst.data() + 512, 16);
  EXPECT_TRUE(std::isnan(scales[2]));
  EXPECT_FALSE(std::isnan(scales[0]) || std::isnan(scales[1]) || std::isnan(scales[3]));
}

TEST(QuantizeMlaFp8, RefusesBadArgumentsByName) {
  std::vector<uint16_t> src(576);
  std::vector<uint8_t> dst(1024);
  EXPECT_TRUE(
      throws_error_naming([&] { quantize_mla_fp8_cpu(DType::kF16, src.data(), 1, 576, dst.data()); }, "dtype f16"));
  EXPECT_TRUE(throws_error_naming([&] { quantize_mla_fp8_cpu(DType::kBF16, src.data(), 1, 500, dst.data()); },
                                  "src_row_stride = 500"));
  EXPECT_TRUE(throws_error_naming([&] { quantize_mla_fp8_cpu(DType::kBF16, src.data(), 1, 576, dst.data(), 640); },
                                  "dst_row_bytes = 640"));
  EXPECT_TRUE(throws_error_naming([&] { quantize_mla_fp8_cpu(DType::kBF16, src.data(), 1, 576, dst.data(), 664); },
                                  "multiple of 16"));
  EXPECT_TRUE(
      throws_error_naming([&] { quantize_mla_fp8_cpu(DType::kBF16, nullptr, 1, 576, dst.data()); }, "src is null"));
  EXPECT_TRUE(
      throws_error_naming([&] { quantize_mla_fp8_cpu(DType::kBF16, src.data(), -1, 576, dst.data()); }, "rows = -1"));
  EXPECT_TRUE(throws_error_naming([] { mla_fp8_views(nullptr, 4, 600); }, "row_bytes = 600"));
}

PlanShape shape_of(const testing::ProblemSpec& spec) {
  PlanShape shape;
  shape.group_size = spec.group_size;
  shape.head_dim_v = spec.dim_v;
  shape.num_sms = 4;
  shape.fixed_chunk_tokens = 64;  // several chunks per request: the merge runs
  return shape;
}

struct CpuRun {
  std::vector<float> o, lse;
};

CpuRun run_cpu(const testing::Fp8Problem& f) {
  const auto& spec = f.base->spec;
  const DecodePlan plan = make_decode_plan(f.base->table.seq_lens, shape_of(spec));
  EXPECT_TRUE(plan.needs_merge());
  const size_t rows = static_cast<size_t>(f.base->num_requests()) * spec.group_size;
  std::vector<uint8_t> o = testing::nan_values(spec.dtype, rows * spec.dim_v);
  CpuRun run;
  run.lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> workspace(plan.workspace.total, 0xFF);
  run_decode_cpu(f.host_params(o.data(), run.lse.data()), plan, workspace.data());
  run.o = testing::as_float(spec.dtype, o);
  return run;
}

void expect_matches(const testing::Fp8Problem& f, const CpuRun& got) {
  const testing::Reference ref = testing::reference_attention(f);
  EXPECT_EQ(testing::compare_per_request(*f.base, ref, got.o, got.lse, 1e-2, 1e-3), "");
}

TEST(DecodeCpuFp8, E4m3PerHeadMatchesFp64Reference) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    std::mt19937_64 rng(21);
    testing::ProblemSpec spec;
    spec.dtype = dtype;
    spec.seq_lens = {300, 0, 129, 64, 1, 200, 77, 256};  // 2 sequences x 4 KV heads
    spec.group_size = 16;
    spec.pool_pages = 4096;
    const testing::PagedProblem pb = testing::make_problem(spec, rng);
    const testing::Fp8Problem f = testing::make_fp8_per_head(pb, 4);
    expect_matches(f, run_cpu(f));
  }
}

TEST(DecodeCpuFp8, E4m3PerHeadWithQueriesOf2To40And2ToMinus40) {
  // The GPU test of the same name's problem: an lse near 1e12 is judged relatively.
  testing::PagedProblem pb;
  const testing::Fp8Problem f = testing::make_fp8_far_queries(pb);
  const testing::Reference ref = testing::reference_attention(f);
  const double max_lse = testing::max_finite_lse(ref);
  EXPECT_GT(max_lse, 1e9);
  const CpuRun got = run_cpu(f);
  EXPECT_EQ(testing::compare_per_request(pb, ref, got.o, got.lse, 1e-2, std::max(1e-2, 1e-6 * max_lse)), "");
}

TEST(DecodeCpuFp8, MlaRowsMatchFp64Reference) {
  std::mt19937_64 rng(22);
  testing::ProblemSpec spec;
  spec.seq_lens = {300, 0, 77};
  spec.group_size = 128;
  spec.dim_qk = spec.dim_v = 512;
  spec.dim_extra = 64;
  spec.v_aliases_k = true;
  spec.pool_pages = 1024;
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  const testing::Fp8Problem f = testing::make_fp8_mla(pb);
  expect_matches(f, run_cpu(f));
}

// A problem whose params are valid for the fp8 formats, to break one field at a time.
struct Fixture {
  testing::PagedProblem gqa, mla;
  testing::Fp8Problem gqa8, mla8;
  std::vector<uint8_t> o = std::vector<uint8_t>(1 << 20);
  std::vector<float> lse = std::vector<float>(1024);
  Fixture() {
    std::mt19937_64 rng(23);
    testing::ProblemSpec spec;
    spec.seq_lens = {40, 30, 20, 10};
    spec.group_size = 4;
    spec.pool_pages = 256;
    gqa = testing::make_problem(spec, rng);
    gqa8 = testing::make_fp8_per_head(gqa, 2);
    spec.seq_lens = {40};
    spec.dim_qk = spec.dim_v = 512;
    spec.dim_extra = 64;
    spec.v_aliases_k = true;
    mla = testing::make_problem(spec, rng);
    mla8 = testing::make_fp8_mla(mla);
  }
};

TEST(DecodeCpuFp8, BadCombinationsAreRefusedByName) {
  Fixture fx;
  const DecodePlan gplan = make_decode_plan(fx.gqa.table.seq_lens, shape_of(fx.gqa.spec));
  const DecodePlan mplan = make_decode_plan(fx.mla.table.seq_lens, shape_of(fx.mla.spec));
  const auto gqa = [&] { return fx.gqa8.host_params(fx.o.data(), fx.lse.data()); };
  const auto mla = [&] { return fx.mla8.host_params(fx.o.data(), fx.lse.data()); };
  const auto refuses = [](const DecodeParams& p, const DecodePlan& plan, const std::string& needle) {
    return throws_error_naming([&] { check_decode_params(p, plan); }, needle);
  };
  EXPECT_NO_THROW(check_decode_params(gqa(), gplan));
  EXPECT_NO_THROW(check_decode_params(mla(), mplan));
  DecodeParams p = gqa();
  p.k_scale = nullptr;
  EXPECT_TRUE(refuses(p, gplan, "k_scale or v_scale is null"));
  p = gqa();
  p.kv_format = static_cast<KvFormat>(7);
  EXPECT_TRUE(refuses(p, gplan, "kv_format 7 is not a KvFormat"));
  p = gqa();
  p.kv_format = KvFormat::kNative;
  EXPECT_TRUE(refuses(p, gplan, "has no per-head scales"));
  p = mla();
  p.dtype = DType::kF16;
  EXPECT_TRUE(refuses(p, mplan, "dtype must be bf16"));
  p = mla();
  p.v.row_stride = 672;
  EXPECT_TRUE(refuses(p, mplan, "v must be the same view as k"));
  p = mla();
  p.k.row_stride = p.v.row_stride = 520;
  EXPECT_TRUE(refuses(p, mplan, "k.row_stride = 520 bytes"));
  p = mla();
  p.k_extra = RowView{};
  p.q_extra = nullptr;
  EXPECT_TRUE(refuses(p, mplan, "needs the rope as k_extra"));

  // CUDA layouts: the fp8 kernels' shapes and byte strides.
  p = gqa();
  EXPECT_EQ(cuda_layout_problem(p), "");
  p.k.row_stride = 136;
  EXPECT_NE(cuda_layout_problem(p).find("k.row_stride = 136 must be a multiple of 16 bytes"), std::string::npos)
      << cuda_layout_problem(p);
  p = gqa();
  p.k.dim = p.v.dim = 64;
  EXPECT_NE(cuda_layout_problem(p).find("head dim 128 only"), std::string::npos) << cuda_layout_problem(p);
  p = mla();
  EXPECT_EQ(cuda_layout_problem(p), "");
}

TEST(SparseDecoderFp8, FusesOnTheCpuAndTheMaskPathRefusesByName) {
  // One sequence, 2 KV heads of 8 query heads, e4m3 K and V of 64 over a
  // dense [1, 2, 256, 64] allocation; 40 selected positions of 256 per head.
  std::mt19937_64 rng(51);
  const int32_t heads = 2, group = 8, dim = 64, cap = 256;
  std::vector<uint8_t> k(static_cast<size_t>(heads * cap * dim)), v(k.size());
  std::uniform_int_distribution<int> byte(0, 0x7E);
  for (auto& x : k) x = static_cast<uint8_t>(byte(rng));
  for (auto& x : v) x = static_cast<uint8_t>(byte(rng));
  const std::vector<float> k_scale = {0.01f, 0.02f}, v_scale = {0.03f, 0.005f};
  const auto q = testing::random_values(DType::kBF16, static_cast<size_t>(heads * group * dim), rng);
  std::vector<uint8_t> o = testing::nan_values(DType::kBF16, static_cast<size_t>(heads * group * dim));
  SparseAttentionInputs in;
  in.device = Device::kCpu;
  in.batch = 1;
  in.num_qo_heads = heads * group;
  in.num_kv_heads = heads;
  in.live_len = cap;
  in.kv_format = KvFormat::kE4m3PerHead;
  in.k = RowView::dense(k.data(), heads, cap, dim);
  in.v = RowView::dense(v.data(), heads, cap, dim);
  in.k_scale = k_scale.data();
  in.v_scale = v_scale.data();
  in.q = q.data();
  in.scale = 0.125f;
  in.o = o.data();
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(heads));
  for (auto& r : rows) {
    for (int32_t t = 0; t < 40; ++t) r.push_back(t * 6 + 1);
  }
  const SparseSelection selection = make_selection(Device::kCpu, rows);
  SparseDecoder decoder(Device::kCpu, DispatchConfig::defaults());
  const SparseDecodeOutcome outcome = decoder.try_fused(in, selection);
  ASSERT_TRUE(outcome.fused()) << outcome.describe();
  // fp64 reference over the dequantized rows, per KV head.
  const std::vector<float> qf = testing::as_float(DType::kBF16, q), of = testing::as_float(DType::kBF16, o);
  double err = 0, norm = 0;
  for (int32_t h = 0; h < heads; ++h) {
    for (int32_t g = 0; g < group; ++g) {
      const float* qg = &qf[static_cast<size_t>((h * group + g) * dim)];
      std::vector<double> w;
      for (int32_t t : rows[static_cast<size_t>(h)]) {
        double dot = 0;
        for (int32_t d = 0; d < dim; ++d)
          dot += double{qg[d]} * e4m3_to_float(k[static_cast<size_t>((h * cap + t) * dim + d)]) * k_scale[h];
        w.push_back(dot * 0.125);
      }
      const double mx = *std::max_element(w.begin(), w.end());
      double sum = 0;
      for (double& x : w) sum += (x = std::exp(x - mx));
      for (int32_t d = 0; d < dim; ++d) {
        double ref = 0;
        for (size_t j = 0; j < w.size(); ++j)
          ref += w[j] / sum * e4m3_to_float(v[static_cast<size_t>((h * cap + rows[h][j]) * dim + d)]) * v_scale[h];
        const double got = of[static_cast<size_t>((h * group + g) * dim + d)];
        err += (got - ref) * (got - ref);
        norm += ref * ref;
      }
    }
  }
  EXPECT_LT(std::sqrt(err / norm), 1e-2);
  MaskPath mask(Device::kCpu);
  EXPECT_TRUE(
      throws_error_naming([&] { mask.prepare(in, selection); }, "kv_format e4m3 per head has only the fused path"));
}

TEST(DispatchFp8, DeclinesByTheLayoutProblemItIsGiven) {
  DispatchInput in;
  in.num_requests = 4;
  in.selected_rows = 4 * 2048;
  in.live_len = 65536;
  in.layout_supported = false;
  in.layout_problem = "kv_format e4m3 per head runs on CUDA at head dim 128 only";
  const SparseDecodeOutcome out = decide_sparse_decode(in, DispatchConfig::defaults());
  EXPECT_EQ(out.kind, OutcomeKind::kUnsupportedLayout);
  EXPECT_NE(out.reason.find("head dim 128 only"), std::string::npos) << out.reason;
  in.layout_supported = true;
  in.layout_problem.clear();
  EXPECT_TRUE(decide_sparse_decode(in, DispatchConfig::defaults()).fused());
}

}  // namespace
}  // namespace sparsepage
