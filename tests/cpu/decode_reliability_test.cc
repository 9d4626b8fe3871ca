// The CPU decode as the oracle: fp64 comparisons per request with
// lse, distinct K / V / second-stream row strides, page sizes above 1 with
// offsets, forced splits, softmax mass over a 1M-token chunk, and the page
// table checked before any index is read.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <tuple>

#include "sparsepage/decode.h"
#include "sparsepage/sparse_decode.h"
#include "support/expect_error.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::make_problem;
using testing::PagedProblem;
using testing::ProblemSpec;
using testing::throws_error_naming;

struct Result {
  std::vector<float> o, lse;
  DecodePlan plan;
};

Result run(const PagedProblem& pb, int32_t fixed_chunk) {
  PlanShape shape;
  shape.group_size = pb.spec.group_size;
  shape.head_dim_v = pb.spec.dim_v;
  shape.num_sms = 3;
  shape.min_chunk_tokens = 0;
  shape.chunk_granule = fixed_chunk > 0 ? 1 : 64;
  shape.fixed_chunk_tokens = fixed_chunk;
  Result r;
  r.plan = make_decode_plan(pb.table.seq_lens, shape);
  const size_t rows = size_t(pb.num_requests()) * pb.spec.group_size;
  std::vector<uint8_t> o = testing::nan_values(pb.spec.dtype, rows * pb.spec.dim_v);
  r.lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  Buffer ws(Device::kCpu, r.plan.workspace.total);
  fill_bytes(ws.data(), Device::kCpu, 0xFF, ws.bytes());
  run_decode_cpu(pb.host_params(o.data(), r.lse.data()), r.plan, ws.data());
  r.o = testing::as_float(pb.spec.dtype, o);
  return r;
}

// (dtype, page_size, fixed chunk: 0 lets the plan choose; 7 forces splits)
class DistinctStrides : public ::testing::TestWithParam<std::tuple<DType, int, int>> {};

// K, V and the second stream each carry their own padding, so a backend that
// swaps two strides reads the NaN padding or another row and fails here.
TEST_P(DistinctStrides, MatchesFp64PerRequestWithLse) {
  const auto [dtype, page_size, chunk] = GetParam();
  std::mt19937_64 rng(1300 + page_size * 10 + chunk);
  ProblemSpec spec;
  spec.dtype = dtype;
  spec.seq_lens = {37, 0, 200, 1, 64};
  spec.page_size = page_size;
  spec.random_first_page_offset = true;
  spec.group_size = 3;
  spec.dim_qk = 24;
  spec.dim_v = 16;
  spec.dim_extra = 8;
  spec.k_row_padding = 5;
  spec.v_row_padding = 11;
  spec.extra_row_padding = 3;
  spec.pool_pages = 512;
  spec.scale = 0.37f;  // not 1/sqrt(d): a dropped scale shows
  const PagedProblem pb = make_problem(spec, rng);
  ASSERT_NE(pb.k_row_stride, pb.v_row_stride);
  ASSERT_NE(pb.v_row_stride, pb.e_row_stride);
  const Result got = run(pb, chunk);
  if (chunk > 0) {
    EXPECT_TRUE(got.plan.needs_merge());
  }
  const auto ref = testing::reference_attention(pb, pb.token_rows());
  // bf16 outputs are rounded to 8 bits of mantissa (2^-9 relative); lse is fp32.
  const double o_tol = dtype == DType::kF32 ? 1e-5 : 4e-3;
  EXPECT_EQ(testing::compare_per_request(pb, ref, got.o, got.lse, o_tol, 1e-3), "");
  EXPECT_EQ(testing::compare_per_request(pb, ref, got.o, got.lse, o_tol, dtype == DType::kF32 ? 1e-5 : 1e-4), "");
}

INSTANTIATE_TEST_SUITE_P(Grid, DistinctStrides,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16), ::testing::Values(1, 3, 16),
                                            ::testing::Values(0, 7)));

// Softmax mass in a long chunk: one 1M-token chunk whose first token dominates and
// whose other 2^20 - 1 tokens each weigh 2^-25 of it. Together they hold
// about 3% of the softmax mass; an fp32 running sum absorbs none of them.
TEST(DecodeOracle, NoSoftmaxMassIsLostOverAOneMillionTokenChunk) {
  const int32_t n = 1 << 20;
  const double small = std::ldexp(1.0, -25);
  const float k_small = static_cast<float>(std::log(small));  // score of every token but the first
  std::vector<float> k(size_t(n), k_small), v(size_t(n), 1.0f);
  k[0] = 0.0f;
  v[0] = 0.0f;
  std::vector<int32_t> indices(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) indices[size_t(i)] = i;
  const std::vector<int32_t> lens = {n};
  const PageTableStructure table = build_page_table_structure(lens, 1);
  PlanShape shape;
  shape.group_size = 1;
  shape.head_dim_v = 1;
  shape.fixed_chunk_tokens = n;  // one chunk: no merge to hide the loss in
  const DecodePlan plan = make_decode_plan(lens, shape);
  ASSERT_EQ(plan.work.size(), 1u);
  const float q = 1.0f;
  float o = NAN, lse = NAN;
  DecodeParams p;
  p.dtype = DType::kF32;
  p.indptr = table.indptr.data();
  p.indices = indices.data();
  p.num_indices = n;
  p.seq_lens = table.seq_lens.data();
  p.num_requests = 1;
  p.num_pool_pages = n;
  p.q = &q;
  p.k = {k.data(), 1, 1};
  p.v = {v.data(), 1, 1};
  p.scale = 1.0f;
  p.o = &o;
  p.lse = &lse;
  Buffer ws(Device::kCpu, plan.workspace.total);
  run_decode_cpu(p, plan, ws.data());
  // fp64 from the definition, with the fp32 scores the kernel computes.
  double sum = 1.0, weighted = 0.0;
  const double w = std::exp(static_cast<double>(k_small));
  sum += (n - 1) * w;
  weighted += (n - 1) * w;
  EXPECT_NEAR(lse, std::log(sum), 1e-6) << "natural-log lse over the whole chunk";
  EXPECT_NEAR(o, weighted / sum, 1e-6);
}

// Random 1M-token chunk against the fp64 reference, lse included.
TEST(DecodeOracle, OneMillionRandomTokensMatchFp64) {
  std::mt19937_64 rng(1301);
  ProblemSpec spec;
  spec.dtype = DType::kF32;
  spec.seq_lens = {1 << 20};
  spec.group_size = 1;
  spec.dim_qk = 2;
  spec.dim_v = 2;
  spec.pool_pages = 1 << 20;
  spec.allow_duplicates = false;
  spec.scale = 2.0f;
  const PagedProblem pb = make_problem(spec, rng);
  const Result got = run(pb, 1 << 20);
  ASSERT_FALSE(got.plan.needs_merge());
  const auto ref = testing::reference_attention(pb, pb.token_rows());
  EXPECT_EQ(testing::compare_per_request(pb, ref, got.o, got.lse, 1e-5, 1e-5), "");
}

// The structure of the table is checked before any index
// is read. These tables would read `indices` past its end.
TEST(DecodeTableChecks, BadIndptrIsNamedBeforeAnyIndexIsRead) {
  std::mt19937_64 rng(1302);
  ProblemSpec spec;
  spec.dtype = DType::kF32;
  spec.seq_lens = {4, 0};
  spec.dim_qk = spec.dim_v = 8;
  spec.group_size = 1;
  const PagedProblem pb = make_problem(spec, rng);
  PlanShape shape;
  shape.group_size = 1;
  shape.head_dim_v = 8;
  const DecodePlan plan = make_decode_plan({4, 0}, shape);
  Buffer ws(Device::kCpu, plan.workspace.total);
  std::vector<float> o(16);
  const std::vector<int32_t> one_index = {0};
  const std::vector<int32_t> lens = {4, 0};
  DecodeParams p = pb.host_params(o.data(), nullptr);
  p.seq_lens = lens.data();
  p.indices = one_index.data();
  p.num_indices = 1;
  const std::vector<int32_t> decreasing = {0, 4, 1};
  p.indptr = decreasing.data();
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "indptr decreases at request 1"));
  const std::vector<int32_t> shifted = {1, 5, 5};
  p.indptr = shifted.data();
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "indptr[0] = 1, expected 0"));
  const std::vector<int32_t> past_end = {0, 4, 4};  // 4 pages, 1 index
  p.indptr = past_end.data();
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "indptr[num_requests] = 4 is past the end of indices (num_indices = 1)"));
  p.num_indices = -1;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "num_indices = -1 is negative"));
}

// In window mode a page naming a position at or beyond
// the live window is rejected on the CPU, never read (it would be another
// request's row, or the slack past live_len).
TEST(DecodeTableChecks, WindowModeRejectsPositionsAtOrPastTheWindow) {
  const int32_t dim = 8;
  const int64_t cap = 16, live = 10;
  std::vector<float> k(size_t(2 * cap * dim), 1.0f), v = k;
  const std::vector<float> q(size_t(2 * dim), 1.0f);
  std::vector<float> o(static_cast<size_t>(2 * dim));
  for (int32_t bad : {10, 15, 16, -1}) {
    const std::vector<int32_t> lens = {2, 1};
    const std::vector<int32_t> indices = {0, 9, bad};
    const PageTableStructure table = build_page_table_structure(lens, 1);
    PlanShape shape;
    shape.group_size = 1;
    shape.head_dim_v = dim;
    const DecodePlan plan = make_decode_plan(lens, shape);
    Buffer ws(Device::kCpu, plan.workspace.total);
    DecodeParams p;
    p.dtype = DType::kF32;
    p.indptr = table.indptr.data();
    p.indices = indices.data();
    p.num_indices = 3;
    p.seq_lens = table.seq_lens.data();
    p.num_requests = 2;
    p.addressing = PageAddressing::kWindow;  // request r's window: rows r * cap ..
    p.window_len = live;
    p.q = q.data();
    p.k = {k.data(), dim, dim, cap * dim};
    p.v = {v.data(), dim, dim, cap * dim};
    p.o = o.data();
    EXPECT_TRUE(
        throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                            "indices[2] = " + std::to_string(bad) + " names positions outside request 1's window"))
        << bad;
    // Page size 4: the last page's last visible slot decides.
    const std::vector<int32_t> lens4 = {6};
    const PageTableStructure t4 = build_page_table_structure(lens4, 4, {3});  // slots 3..8: pages 0, 1, 2
    const DecodePlan plan4 = make_decode_plan(lens4, shape);
    const std::vector<int32_t> pages = {0, 1, 2};
    p.indptr = t4.indptr.data();
    p.first_page_offset = t4.first_page_offset.data();
    p.seq_lens = t4.seq_lens.data();
    p.indices = pages.data();
    p.num_requests = 1;
    p.page_size = 4;
    p.window_len = 8;  // position 8 (page 2, slot 0) is past it
    EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan4, ws.data()); }, "indices[2] = 2 names positions"));
    p.window_len = 9;
    EXPECT_NO_THROW(run_decode_cpu(p, plan4, ws.data()));
    // A window longer than the rows between two requests' windows would
    // reach the next request's rows: refused before anything is read.
    p.indptr = table.indptr.data();
    p.first_page_offset = nullptr;
    p.seq_lens = table.seq_lens.data();
    p.indices = indices.data();
    p.num_requests = 2;
    p.page_size = 1;
    p.window_len = cap + 1;
    EXPECT_TRUE(
        throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "rows of different sequences would overlap"));
    p.first_page_offset = nullptr;
    p.page_size = 1;
  }
}

// The same through the public entry a layer uses.
TEST(DecodeTableChecks, SparseDecoderRejectsASelectedPositionAtLiveLen) {
  const int32_t dim = 8;
  const int64_t cap = 32, live = 20;
  std::vector<float> k(size_t(cap * dim), 0.5f), v = k, q(size_t(dim), 1.0f), o(static_cast<size_t>(dim));
  SparseAttentionInputs in;
  in.dtype = DType::kF32;
  in.batch = 1;
  in.num_qo_heads = 1;
  in.num_kv_heads = 1;
  in.live_len = live;
  in.k = RowView::dense(k.data(), 1, cap, dim);
  in.v = RowView::dense(v.data(), 1, cap, dim);
  in.q = q.data();
  in.o = o.data();
  DispatchConfig config;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCpu, config);
  EXPECT_TRUE(decoder.try_fused(in, make_selection(Device::kCpu, {{0, 19}})).fused());
  EXPECT_TRUE(throws_error_naming(
      [&] {
        decoder.try_fused(in, make_selection(Device::kCpu, {{0, 20}}));
      },
      "names positions outside request 0's window of 20 tokens"));
}

}  // namespace
}  // namespace sparsepage
