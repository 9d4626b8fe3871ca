// The mask and gather paths, and their agreement with the paged decode over
// the same set, on dense caches whose capacity has slack.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>

#include "sparsepage/cache.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/sparse_decode.h"
#include "support/expect_error.h"
#include "support/quantized_rows.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A bf16 cache [B, H(+extra K heads), Cap, D] with live length < capacity.
struct DenseSetup {
  int32_t batch = 2, kv_heads = 2, extra_k_heads = 1, group = 4, dim = 64;
  int64_t live = 100;
  DenseKVCache cache{Device::kCpu, CacheMode::kBF16, 2, 3, 2, 64, 64, 128};
  std::vector<uint8_t> q;
  std::vector<float> mask;  // [B * kv_heads, live]

  explicit DenseSetup(std::mt19937_64& rng) {
    const auto k = testing::random_values(DType::kBF16, size_t(batch) * 3 * live * dim, rng);
    const auto v = testing::random_values(DType::kBF16, size_t(batch) * 2 * live * dim, rng);
    cache.append(k.data(), v.data(), DType::kBF16, live);
    q = testing::random_values(DType::kBF16, size_t(batch) * kv_heads * group * dim, rng);
    std::bernoulli_distribution keep(0.3);
    for (int64_t i = 0; i < int64_t{batch} * kv_heads * live; ++i) mask.push_back(keep(rng) ? 0.0f : kNegInf);
  }
  MaskedDecodeParams masked(void* o, float* lse) const {
    MaskedDecodeParams p;
    p.batch = batch;
    p.num_kv_heads = kv_heads;
    p.group_size = group;
    p.live_len = live;
    p.q = q.data();
    p.k = cache.k_rows().value();
    p.v = cache.v_rows().value();
    p.mask = mask.data();
    p.scale = 0.125f;
    p.o = o;
    p.lse = lse;
    return p;
  }
};

std::vector<float> run_masked(const MaskedDecodeParams& p, std::vector<float>* lse) {
  const size_t rows = size_t(p.batch) * p.num_kv_heads * p.group_size;
  std::vector<uint8_t> o = testing::nan_values(p.dtype, rows * p.v.dim);
  lse->assign(rows, std::nanf(""));
  MaskedDecodeParams q = p;
  q.o = o.data();
  q.lse = lse->data();
  run_masked_decode_cpu(q);
  return testing::as_float(p.dtype, o);
}

// fp64 masked attention over the window, straight from the definition.
std::vector<double> reference_masked(const DenseSetup& s) {
  const auto k = testing::cache_window(s.cache, true);   // [B, 3, L, D]
  const auto v = testing::cache_window(s.cache, false);  // [B, 2, L, D]
  const auto q = testing::as_float(DType::kBF16, s.q);
  std::vector<double> out;
  for (int32_t r = 0; r < s.batch * s.kv_heads; ++r) {
    const int32_t b = r / s.kv_heads, h = r % s.kv_heads;
    for (int32_t g = 0; g < s.group; ++g) {
      std::vector<double> w(size_t(s.live));
      double max = -INFINITY, sum = 0;
      for (int64_t t = 0; t < s.live; ++t) {
        double dot = 0;
        for (int d = 0; d < s.dim; ++d) {
          dot += double(q[(size_t(r) * s.group + g) * s.dim + d]) * k[((size_t(b) * 3 + h) * s.live + t) * s.dim + d];
        }
        w[size_t(t)] = dot * 0.125 + s.mask[size_t(r) * s.live + t];
        max = std::max(max, w[size_t(t)]);
      }
      std::vector<double> o(size_t(s.dim), 0.0);
      for (int64_t t = 0; t < s.live; ++t) {
        const double p = std::exp(w[size_t(t)] - max);
        sum += p;
        for (int d = 0; d < s.dim; ++d) o[size_t(d)] += p * v[((size_t(b) * 2 + h) * s.live + t) * s.dim + d];
      }
      for (double x : o) out.push_back(x / sum);
    }
  }
  return out;
}

TEST(MaskPath, MatchesFp64ReferenceWithWiderKAtBatchTwo) {
  std::mt19937_64 rng(21);
  const DenseSetup s(rng);
  std::vector<float> lse;
  const auto o = run_masked(s.masked(nullptr, nullptr), &lse);
  EXPECT_LT(testing::relative_l2(o, reference_masked(s)), 1e-2);
}

// The fused path over the kept columns of a [B=2, H=2, Cap, D] cache, all
// four requests in one launch: pool rows come from the layout of the whole
// allocation with `head_stride` between heads.
std::vector<float> run_paged_over_kept(const DenseKVCache& cache, const std::vector<uint8_t>& q,
                                       const std::vector<float>& mask, int64_t live, int64_t head_stride) {
  const RowView k_rows = cache.k_rows().value(), v_rows = cache.v_rows().value();
  std::vector<int32_t> lens, rows;
  for (int32_t r = 0; r < 4; ++r) {
    int32_t kept = 0;
    for (int64_t t = 0; t < live; ++t) {
      if (mask[size_t(r * live + t)] != 0.0f) continue;
      rows.push_back(int32_t(r * head_stride + t));  // r = b * H + h
      ++kept;
    }
    lens.push_back(kept);
  }
  const auto table = build_page_table_structure(lens, 1);
  const DecodePlan plan = make_decode_plan(lens, PlanShape{4, 64, 2, 2, 1, 64, 32, 0});
  std::vector<uint8_t> o = testing::nan_values(DType::kBF16, size_t(4) * 4 * 64);
  DecodeParams p;
  p.indptr = table.indptr.data();
  p.indices = rows.data();
  p.num_indices = int64_t(rows.size());
  p.seq_lens = table.seq_lens.data();
  p.num_requests = 4;
  p.num_pool_pages = int64_t{cache.batch()} * cache.k_heads() * cache.capacity();
  p.group_size = 4;
  p.q = q.data();
  p.k = {k_rows.data, 64, 64};  // one pool of rows shared by every request
  p.v = {v_rows.data, 64, 64};
  p.scale = 0.125f;
  p.o = o.data();
  Buffer ws(Device::kCpu, plan.workspace.total);
  run_decode_cpu(p, plan, ws.data());
  return testing::as_float(DType::kBF16, o);
}

TEST(MaskPath, PagedDecodeOverKeptRowsAgreesAndHeadStrideIsCapacity) {
  std::mt19937_64 rng(22);
  const int64_t live = 100;
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 2, 2, 2, 64, 64, 128);
  const auto k = testing::random_values(DType::kBF16, size_t(4 * live * 64), rng);
  const auto v = testing::random_values(DType::kBF16, size_t(4 * live * 64), rng);
  cache.append(k.data(), v.data(), DType::kBF16, live);
  ASSERT_GT(cache.capacity(), live) << "the test needs slack between live length and capacity";
  const auto q = testing::random_values(DType::kBF16, size_t(4 * 4 * 64), rng);
  std::vector<float> mask;
  std::bernoulli_distribution keep(0.3);
  for (int64_t i = 0; i < 4 * live; ++i) mask.push_back(keep(rng) ? 0.0f : kNegInf);

  MaskedDecodeParams p;
  p.batch = 2;
  p.num_kv_heads = 2;
  p.group_size = 4;
  p.live_len = live;
  p.q = q.data();
  p.k = cache.k_rows().value();
  p.v = cache.v_rows().value();
  p.mask = mask.data();
  p.scale = 0.125f;
  std::vector<float> lse;
  const auto masked = run_masked(p, &lse);
  const std::vector<double> masked_d(masked.begin(), masked.end());
  EXPECT_EQ(p.k.offset(1, 1, 5), (3 * cache.capacity() + 5) * 64);
  EXPECT_LT(testing::relative_l2(run_paged_over_kept(cache, q, mask, live, cache.capacity()), masked_d), 1e-2);
  // With the live length as head stride the rows alias other heads: wrong.
  EXPECT_GT(testing::relative_l2(run_paged_over_kept(cache, q, mask, live, live), masked_d), 0.1);
}

TEST(MaskPath, QuantizedWindowsDequantize) {
  for (testing::QuantBits bits : {testing::QuantBits::kInt8, testing::QuantBits::kInt4}) {
    std::mt19937_64 rng(23);
    const auto k = testing::random_values(DType::kF32, 50 * 64, rng);
    const auto v = testing::random_values(DType::kF32, 50 * 64, rng);
    const auto kf = testing::as_float(DType::kF32, k);
    const auto kd = testing::quantize_round_trip(bits, kf, 64);
    const std::vector<double> kref(kf.begin(), kf.end());
    const double err = testing::relative_l2(kd, kref);
    EXPECT_LT(err, bits == testing::QuantBits::kInt8 ? 0.01 : 0.15) << testing::quant_bits_name(bits);
    EXPECT_GT(err, 0.0) << "a quantized window cannot be exact on random data";
    // The mask path runs over the dequantized (f32) window.
    const auto vd = testing::quantize_round_trip(bits, testing::as_float(DType::kF32, v), 64);
    const auto q = testing::random_values(DType::kF32, 2 * 64, rng);
    MaskedDecodeParams p = testing::one_request_masked_params(DType::kF32, 2, 50, 64, q.data(), kd.data(), vd.data());
    std::vector<float> o(2 * 64, std::nanf(""));
    p.o = o.data();
    p.scale = 0.125f;
    run_masked_decode_cpu(p);
    for (float x : o) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(GatherPath, GatherThenDenseEqualsPagedDecode) {
  std::mt19937_64 rng(24);
  testing::ProblemSpec spec;
  spec.seq_lens = {40, 7, 0};
  spec.group_size = 4;
  spec.dim_qk = spec.dim_v = 64;
  spec.pool_pages = 256;
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  const auto ref = testing::reference_attention(pb, pb.token_rows());
  // Gather K and V rows per request into [R, max_rows, D].
  const std::vector<int32_t> rows = pb.indices;  // page_size 1: pages are rows
  const std::vector<int32_t> offsets = pb.table.indptr;
  const int64_t max_rows = 40;
  std::vector<uint8_t> gk(3 * max_rows * 64 * 2), gv(gk.size());
  const DecodeParams dp = pb.host_params(nullptr, nullptr);
  gather_rows(Device::kCpu, rows.data(), offsets.data(), 3, max_rows, DType::kBF16, dp.k, pb.pool_rows(), gk.data());
  gather_rows(Device::kCpu, rows.data(), offsets.data(), 3, max_rows, DType::kBF16, dp.v, pb.pool_rows(), gv.data());
  std::vector<float> mask(3 * max_rows, kNegInf);
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < spec.seq_lens[size_t(r)]; ++i) mask[size_t(r * max_rows + i)] = 0.0f;
  }
  MaskedDecodeParams p;
  p.batch = 3;
  p.num_kv_heads = 1;
  p.group_size = 4;
  p.live_len = max_rows;
  p.q = pb.q.data();
  p.k = RowView::dense(gk.data(), 1, max_rows, 64);
  p.v = RowView::dense(gv.data(), 1, max_rows, 64);
  p.mask = mask.data();
  p.scale = pb.scale;
  std::vector<float> lse;
  const auto o = run_masked(p, &lse);
  EXPECT_LT(testing::relative_l2(o, ref.o), 1e-2);
  // A fully masked request: o = 0, lse = -inf, like the paged decode.
  for (int g = 0; g < 4; ++g) EXPECT_TRUE(std::isinf(lse[size_t(8 + g)]) && lse[size_t(8 + g)] < 0);
}

TEST(GatherPath, RowsOutsideThePoolAreNotRead) {
  std::vector<uint16_t> pool(4 * 8, float_to_bf16(1.0f));
  const std::vector<int32_t> rows = {0, 4, -1};
  const std::vector<int32_t> offsets = {0, 3};
  std::vector<uint16_t> out(3 * 8);
  gather_rows(Device::kCpu, rows.data(), offsets.data(), 1, 3, DType::kBF16, RowView{pool.data(), 8, 8}, 4, out.data());
  EXPECT_EQ(bf16_to_float(out[0]), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(out[8])));
  EXPECT_TRUE(std::isnan(bf16_to_float(out[16])));
}

// A masked-out position is excluded even when its score is not finite.
TEST(MaskPath, MaskedOutNonFiniteRowsAreExcluded) {
  std::mt19937_64 rng(26);
  std::vector<float> k = testing::as_float(DType::kF32, testing::random_values(DType::kF32, 8 * 64, rng));
  std::vector<float> v = testing::as_float(DType::kF32, testing::random_values(DType::kF32, 8 * 64, rng));
  for (int d = 0; d < 64; ++d) k[3 * 64 + d] = INFINITY;  // row 3 scores inf (or NaN): masked, so excluded
  std::vector<float> mask(8, 0.0f);
  mask[3] = kNegInf;
  const auto q = testing::as_float(DType::kF32, testing::random_values(DType::kF32, 64, rng));
  std::vector<float> o(64, NAN);
  float lse = NAN;
  MaskedDecodeParams p = testing::one_request_masked_params(DType::kF32, 1, 8, 64, q.data(), k.data(), v.data());
  p.mask = mask.data();
  p.scale = 0.125f;
  p.o = o.data();
  p.lse = &lse;
  run_masked_decode_cpu(p);
  for (float x : o) ASSERT_TRUE(std::isfinite(x));
  EXPECT_TRUE(std::isfinite(lse));
}

// An unselected row whose V holds NaN or Inf contributes
// nothing on the mask path (its masked weight is skipped, not multiplied by
// 0). The fused path never reads it; both must give the same answer.
TEST(MaskPath, MaskedOutNonFiniteValuesAreExcluded) {
  for (const float poison : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> k(8 * 4, 0.0f), v(8 * 4, 1.0f);
    for (int d = 0; d < 4; ++d) v[3 * 4 + d] = poison;  // row 3, masked
    std::vector<float> mask(8, kNegInf);
    mask[0] = mask[1] = 0.0f;
    const std::vector<float> q(4, 1.0f);
    std::vector<float> o(4, NAN);
    float lse = NAN;
    MaskedDecodeParams p = testing::one_request_masked_params(DType::kF32, 1, 8, 4, q.data(), k.data(), v.data());
    p.mask = mask.data();
    p.scale = 1.0f;
    p.o = o.data();
    p.lse = &lse;
    run_masked_decode_cpu(p);
    for (float x : o) EXPECT_EQ(x, 1.0f) << "poison " << poison;
    EXPECT_NEAR(lse, std::log(2.0f), 1e-6) << "poison " << poison;
  }
}

// The same through the public pair a layer uses: SparseDecoder (fused) and
// MaskPath (its fallback), at batch 2 with two KV heads, NaN V rows outside
// every selection, and a split forced on the mask path by a long window.
TEST(MaskPath, FusedAndMaskPathAgreeWhenUnselectedRowsHoldNaN) {
  const int32_t batch = 2, heads = 2, group = 2, dim = 8;
  const int64_t live = 1500, cap = 1536;
  std::mt19937_64 rng(131);
  std::vector<uint8_t> k = testing::random_values(DType::kBF16, size_t(batch) * heads * cap * dim, rng);
  std::vector<uint8_t> v = testing::random_values(DType::kBF16, size_t(batch) * heads * cap * dim, rng);
  const std::vector<std::vector<int32_t>> rows = {{0, 1}, {5, 1499, 700}, {3}, {1000, 2, 1, 0}};
  // Every V row outside the selection is NaN.
  auto* vv = reinterpret_cast<uint16_t*>(v.data());
  for (int32_t r = 0; r < batch * heads; ++r) {
    for (int64_t t = 0; t < cap; ++t) {
      if (std::find(rows[size_t(r)].begin(), rows[size_t(r)].end(), t) != rows[size_t(r)].end()) continue;
      for (int d = 0; d < dim; ++d) vv[(size_t(r) * cap + t) * dim + d] = 0x7FC0;
    }
  }
  const std::vector<uint8_t> q = testing::random_values(DType::kBF16, size_t(batch) * heads * group * dim, rng);
  SparseAttentionInputs in;
  in.device = Device::kCpu;
  in.dtype = DType::kBF16;
  in.batch = batch;
  in.num_qo_heads = heads * group;
  in.num_kv_heads = heads;
  in.live_len = live;
  in.k = RowView::dense(k.data(), heads, cap, dim);
  in.v = RowView::dense(v.data(), heads, cap, dim);
  in.q = q.data();
  in.scale = 0.3f;
  const SparseSelection sel = make_selection(Device::kCpu, rows);
  const size_t out_rows = size_t(batch) * heads * group;
  std::vector<uint8_t> fused_o = testing::nan_values(DType::kBF16, out_rows * dim), mask_o = fused_o;
  std::vector<float> fused_lse(out_rows, NAN), mask_lse(out_rows, NAN);
  DispatchConfig config;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCpu, config);
  in.o = fused_o.data();
  in.lse = fused_lse.data();
  ASSERT_TRUE(decoder.try_fused(in, sel).fused());
  MaskPath mask_path(Device::kCpu);
  in.o = mask_o.data();
  in.lse = mask_lse.data();
  mask_path.prepare(in, sel);
  mask_path.run(in, sel);
  const auto a = testing::as_float(DType::kBF16, fused_o), b = testing::as_float(DType::kBF16, mask_o);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(b[i])) << "mask path output " << i << " = " << b[i];
    EXPECT_NEAR(a[i], b[i], 1e-2) << i;
  }
  for (size_t i = 0; i < out_rows; ++i) EXPECT_NEAR(fused_lse[i], mask_lse[i], 1e-4) << i;
}

// A position outside its window: the fused path refuses it, and so does
// the mask path on the CPU (it once left the position out and answered),
// whichever path the dispatch picks; o is left as it was.
TEST(MaskPath, APositionOutsideItsWindowIsRefusedAsTheFusedPathRefusesIt) {
  const int32_t dim = 8;
  const int64_t live = 80, cap = 96;
  std::mt19937_64 rng(132);
  const std::vector<uint8_t> k = testing::random_values(DType::kBF16, size_t(cap) * dim, rng);
  const std::vector<uint8_t> q = testing::random_values(DType::kBF16, size_t(2) * dim, rng);
  SparseAttentionInputs in;
  in.device = Device::kCpu;
  in.dtype = DType::kBF16;
  in.batch = 1;
  in.num_qo_heads = 2;
  in.num_kv_heads = 1;
  in.live_len = live;
  in.k = in.v = RowView::dense(k.data(), 1, cap, dim);
  in.q = q.data();
  in.scale = 0.3f;
  std::vector<uint8_t> o = testing::nan_values(DType::kBF16, size_t(2) * dim);
  in.o = o.data();
  for (const int32_t bad : {int32_t{80}, int32_t{-5}, int32_t{1000000}}) {
    const SparseSelection sel = make_selection(Device::kCpu, {{3, 7, bad}});
    DispatchConfig config;
    config.min_sparsity = 0;
    SparseDecoder decoder(Device::kCpu, config);
    EXPECT_TRUE(testing::throws_error_naming([&] { (void)decoder.try_fused(in, sel); }, "outside"));
    MaskPath mask_path(Device::kCpu);
    mask_path.prepare(in, sel);
    EXPECT_TRUE(testing::throws_error_naming(
        [&] { mask_path.run(in, sel); },
        "positions[2] = " + std::to_string(bad) + " is outside request 0's window of 80 tokens"));
    for (float x : testing::as_float(DType::kBF16, o)) EXPECT_TRUE(std::isnan(x)) << "a refused call wrote o";
  }
}

TEST(MaskPath, BadParamsAreNamed) {
  std::mt19937_64 rng(25);
  const DenseSetup s(rng);
  MaskedDecodeParams p = s.masked(nullptr, nullptr);
  std::vector<float> o(1000);
  p.o = o.data();
  // A capacity of 50 rows per head for a live length of 100: each head's
  // window would run into the next head's rows.
  p.k.head_stride = 50 * p.k.row_stride;
  try {
    run_masked_decode_cpu(p);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k.head_stride = 3200 is smaller than"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rows of different heads would overlap"), std::string::npos) << e.what();
  }
  // V with one head's worth of sequence stride for two heads.
  p = s.masked(o.data(), nullptr);
  p.v.seq_stride = p.v.head_stride;
  try {
    run_masked_decode_cpu(p);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows of different sequences would overlap"), std::string::npos) << e.what();
  }
}

// The entry point's inputs convert to the mask path by their shared
// operands: every operand arrives, and the path's own fields come from the
// inputs. (The fused path's conversion is exercised by every fused test.)
TEST(MaskPath, InputsConvertWithEveryOperand) {
  int32_t cells[8] = {};
  float lse[1] = {};
  SparseAttentionInputs in;
  in.dtype = DType::kF16;
  in.batch = 3;
  in.num_qo_heads = 8;
  in.num_kv_heads = 2;
  in.live_len = 40;
  in.live_lens = &cells[0];
  in.q = &cells[1];
  in.q_extra = &cells[2];
  in.k = RowView::dense(&cells[3], 2, 64, 16);
  in.v = RowView::dense(&cells[4], 2, 64, 8);
  in.k_extra = RowView::dense(&cells[5], 2, 64, 4);
  in.scale = 0.25f;
  in.o = &cells[6];
  in.lse = lse;
  const auto same_operands = [&](const AttentionOperands& got) {
    EXPECT_EQ(got.dtype, in.dtype);
    EXPECT_EQ(got.q, in.q);
    EXPECT_EQ(got.q_extra, in.q_extra);
    EXPECT_EQ(got.k.data, in.k.data);
    EXPECT_EQ(got.k.head_stride, in.k.head_stride);
    EXPECT_EQ(got.v.data, in.v.data);
    EXPECT_EQ(got.v.dim, in.v.dim);
    EXPECT_EQ(got.k_extra.data, in.k_extra.data);
    EXPECT_EQ(got.k_extra.dim, in.k_extra.dim);
    EXPECT_EQ(got.scale, in.scale);
    EXPECT_EQ(got.o, in.o);
    EXPECT_EQ(got.lse, in.lse);
  };
  const MaskedDecodeParams m = masked_params(in);
  same_operands(m);
  EXPECT_EQ(m.batch, 3);
  EXPECT_EQ(m.num_kv_heads, 2);
  EXPECT_EQ(m.group_size, 4);
  EXPECT_EQ(m.live_len, 40);
  EXPECT_EQ(m.live_lens, in.live_lens);
  EXPECT_EQ(m.mask, nullptr);
}

// The conversion divides by num_kv_heads: a head count of 0 (or one that
// does not divide num_qo_heads) is refused by name, not a division trap.
TEST(MaskPath, BadHeadCountsAreRefusedBeforeTheyDivide) {
  SparseAttentionInputs in;
  in.batch = 1;
  in.live_len = 8;
  for (const auto& heads : {std::pair<int32_t, int32_t>{8, 0}, {8, -2}, {8, 3}, {0, 2}}) {
    in.num_qo_heads = heads.first;
    in.num_kv_heads = heads.second;
    EXPECT_TRUE(testing::throws_error_naming(
        [&] { (void)masked_params(in); },
        "num_qo_heads = " + std::to_string(heads.first) +
            " must be a positive multiple of num_kv_heads = " + std::to_string(heads.second)));
  }
}

}  // namespace
}  // namespace sparsepage
