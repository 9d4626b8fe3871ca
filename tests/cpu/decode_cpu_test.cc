// The CPU backend against the fp64 reference over the grid the core issue
// names: page sizes, offsets, partial pages, duplicates, empty requests,
// group sizes, head dims, the MLA shape, and splits.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "sparsepage/decode.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::make_problem;
using testing::PagedProblem;
using testing::ProblemSpec;

struct CpuResult {
  std::vector<float> o;
  std::vector<float> lse;
  DecodePlan plan;
};

PlanShape cpu_shape(const ProblemSpec& spec, int32_t fixed_chunk = 0) {
  PlanShape shape;
  shape.group_size = spec.group_size;
  shape.head_dim_v = spec.dim_v;
  shape.num_sms = 4;
  shape.fixed_chunk_tokens = fixed_chunk;
  return shape;
}

// Runs the CPU decode with NaN-poisoned outputs, so unwritten entries fail.
CpuResult run_cpu(const PagedProblem& pb, const PlanShape& shape) {
  CpuResult result;
  result.plan = make_decode_plan(pb.table.seq_lens, shape);
  const size_t rows = static_cast<size_t>(pb.num_requests()) * pb.spec.group_size;
  std::vector<uint8_t> o = testing::nan_values(pb.spec.dtype, rows * pb.spec.dim_v);
  result.lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  Buffer workspace(Device::kCpu, result.plan.workspace.total);
  fill_bytes(workspace.data(), Device::kCpu, 0xFF, workspace.bytes());
  run_decode_cpu(pb.host_params(o.data(), result.lse.data()), result.plan, workspace.data());
  result.o = testing::as_float(pb.spec.dtype, o);
  return result;
}

double tolerance(DType dtype) { return dtype == DType::kF32 ? 1e-5 : 1e-2; }

void expect_matches_reference(const PagedProblem& pb, const CpuResult& got) {
  const auto ref = testing::reference_attention(pb, pb.token_rows());
  EXPECT_LT(testing::relative_l2(got.o, ref.o), tolerance(pb.spec.dtype));
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_TRUE(std::isinf(got.lse[i]) && got.lse[i] < 0) << "lse[" << i << "] = " << got.lse[i];
    } else {
      EXPECT_NEAR(got.lse[i], ref.lse[i], 1e-3 * std::max(1.0, std::fabs(ref.lse[i]))) << "lse[" << i << "]";
    }
  }
}

// (page_size, group_size, head_dim)
class DecodeGrid : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(DecodeGrid, MatchesFp64Reference) {
  const auto [page_size, group_size, head_dim] = GetParam();
  std::mt19937_64 rng(1000 + page_size * 7 + group_size * 13 + head_dim);
  ProblemSpec spec;
  spec.seq_lens = {0, 37, 300, 129, 1};  // empty, partial pages, one token
  spec.page_size = page_size;
  spec.random_first_page_offset = page_size > 1;
  spec.group_size = group_size;
  spec.dim_qk = spec.dim_v = head_dim;
  spec.pool_pages = 2048 / page_size + 64;
  const PagedProblem pb = make_problem(spec, rng);
  const CpuResult got = run_cpu(pb, cpu_shape(spec, 64));
  EXPECT_TRUE(got.plan.needs_merge()) << "the grid should exercise the merge";
  expect_matches_reference(pb, got);
}

INSTANTIATE_TEST_SUITE_P(Grid, DecodeGrid,
                         ::testing::Combine(::testing::Values(1, 16), ::testing::Values(1, 4, 16, 128),
                                            ::testing::Values(64, 128, 256)),
                         [](const auto& param_info) {
                           return "page" + std::to_string(std::get<0>(param_info.param)) + "_g" +
                                  std::to_string(std::get<1>(param_info.param)) + "_d" +
                                  std::to_string(std::get<2>(param_info.param));
                         });

TEST(DecodeCpu, Float16MatchesReference) {
  std::mt19937_64 rng(7);
  ProblemSpec spec;
  spec.dtype = DType::kF16;
  spec.seq_lens = {200, 65, 3};
  spec.page_size = 8;
  spec.random_first_page_offset = true;
  const PagedProblem pb = make_problem(spec, rng);
  expect_matches_reference(pb, run_cpu(pb, cpu_shape(spec, 32)));
}

TEST(DecodeCpu, MlaShapeWithSecondStreamAndVAliasingK) {
  // DSA decode: K rows are 512 latent + 128 indexer key (stride 640), the
  // second stream is the 64-wide rope key, V is the first 512 columns of K.
  std::mt19937_64 rng(8);
  ProblemSpec spec;
  spec.seq_lens = {300, 0, 77};
  spec.group_size = 128;
  spec.dim_qk = 512;
  spec.dim_v = 512;
  spec.dim_extra = 64;
  spec.v_aliases_k = true;
  spec.k_row_padding = 128;
  spec.pool_pages = 1024;
  const PagedProblem pb = make_problem(spec, rng);
  expect_matches_reference(pb, run_cpu(pb, cpu_shape(spec, 64)));
}

TEST(DecodeCpu, VAliasingKWithNarrowerV) {
  std::mt19937_64 rng(9);
  ProblemSpec spec;
  spec.seq_lens = {90, 41};
  spec.dim_qk = 128;
  spec.dim_v = 64;
  spec.v_aliases_k = true;
  const PagedProblem pb = make_problem(spec, rng);
  expect_matches_reference(pb, run_cpu(pb, cpu_shape(spec)));
}

TEST(DecodeCpu, EmptyRequestsGiveZeroOutputAndNegativeInfinityLse) {
  std::mt19937_64 rng(10);
  ProblemSpec spec;
  spec.seq_lens = {0, 5, 0};
  const PagedProblem pb = make_problem(spec, rng);
  const CpuResult got = run_cpu(pb, cpu_shape(spec));
  for (int r : {0, 2}) {
    for (int g = 0; g < spec.group_size; ++g) {
      const size_t row = static_cast<size_t>(r * spec.group_size + g);
      EXPECT_TRUE(std::isinf(got.lse[row]) && got.lse[row] < 0);
      for (int d = 0; d < spec.dim_v; ++d) ASSERT_EQ(got.o[row * spec.dim_v + d], 0.0f);
    }
  }
  expect_matches_reference(pb, got);
}

TEST(DecodeCpu, DuplicatedRowsEachCount) {
  std::mt19937_64 rng(11);
  ProblemSpec spec;
  spec.dtype = DType::kF32;
  spec.seq_lens = {4};
  spec.allow_duplicates = false;
  PagedProblem pb = make_problem(spec, rng);
  const std::vector<int32_t> distinct = pb.indices;
  // Same page three times, in an unsorted list: [a, a, a, b].
  pb = make_problem(spec, rng);
  pb.indices = {distinct[1], distinct[1], distinct[1], distinct[0]};
  // Refill the pool rows of the new indices (make_problem only filled its own).
  std::mt19937_64 fill(12);
  for (int32_t page : {distinct[0], distinct[1]}) {
    const auto k = testing::random_values(spec.dtype, static_cast<size_t>(spec.dim_qk), fill);
    const auto v = testing::random_values(spec.dtype, static_cast<size_t>(spec.dim_v), fill);
    std::copy(k.begin(), k.end(), pb.k_pool.begin() + static_cast<std::ptrdiff_t>(page) * spec.dim_qk * 4);
    std::copy(v.begin(), v.end(), pb.v_pool.begin() + static_cast<std::ptrdiff_t>(page) * spec.dim_v * 4);
  }
  const CpuResult got = run_cpu(pb, cpu_shape(spec));
  const auto counted = testing::reference_attention(pb, pb.token_rows());
  EXPECT_LT(testing::relative_l2(got.o, counted.o), 1e-5);
  const auto deduplicated = testing::reference_attention(pb, {{distinct[1], distinct[0]}});
  EXPECT_GT(testing::relative_l2(got.o, deduplicated.o), 1e-3) << "duplicates must weigh each occurrence";
}

TEST(DecodeCpu, ResultDoesNotDependOnTheSplit) {
  std::mt19937_64 rng(13);
  ProblemSpec spec;
  spec.dtype = DType::kF32;
  spec.seq_lens = {1000, 64, 0, 513};
  spec.page_size = 4;
  spec.random_first_page_offset = true;
  const PagedProblem pb = make_problem(spec, rng);
  const CpuResult whole = run_cpu(pb, cpu_shape(spec, 4096));
  const CpuResult split = run_cpu(pb, cpu_shape(spec, 32));
  EXPECT_FALSE(whole.plan.needs_merge());
  EXPECT_TRUE(split.plan.needs_merge());
  std::vector<double> whole_o(whole.o.begin(), whole.o.end());
  EXPECT_LT(testing::relative_l2(split.o, whole_o), 1e-5);
  for (size_t i = 0; i < whole.lse.size(); ++i) {
    if (std::isinf(whole.lse[i])) {
      EXPECT_EQ(whole.lse[i], split.lse[i]);
    } else {
      EXPECT_NEAR(split.lse[i], whole.lse[i], 1e-4);
    }
  }
}

// NaN never passes: a NaN query poisons its request's output and lse,
// whether or not the plan splits it, and never reads as an empty request.
TEST(DecodeCpu, NanQueryPoisonsTheRequestWhateverTheSplit) {
  std::mt19937_64 rng(16);
  ProblemSpec spec;
  spec.seq_lens = {300, 40};
  PagedProblem pb = make_problem(spec, rng);
  const auto nan = testing::nan_values(spec.dtype, static_cast<size_t>(spec.dim_qk));
  std::copy(nan.begin(), nan.end(), pb.q.begin());  // request 0, head 0
  for (int32_t chunk : {0, 64}) {
    const CpuResult got = run_cpu(pb, cpu_shape(spec, chunk));
    EXPECT_TRUE(std::isnan(got.lse[0])) << "chunk " << chunk;
    for (int d = 0; d < spec.dim_v; ++d) ASSERT_TRUE(std::isnan(got.o[static_cast<size_t>(d)])) << "chunk " << chunk;
    for (size_t i = static_cast<size_t>(spec.group_size) * spec.dim_v; i < got.o.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got.o[i])) << "other heads and requests stay finite";
    }
  }
}

TEST(DecodeCpu, IndexOutsideThePoolIsAnErrorNotARead) {
  std::mt19937_64 rng(14);
  ProblemSpec spec;
  spec.seq_lens = {10, 10};
  spec.pool_pages = 64;
  PagedProblem pb = make_problem(spec, rng);
  pb.indices[13] = 64;
  std::vector<uint8_t> o(pb.q.size());
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, cpu_shape(spec));
  Buffer workspace(Device::kCpu, plan.workspace.total);
  try {
    run_decode_cpu(pb.host_params(o.data(), nullptr), plan, workspace.data());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("indices[13] = 64 is outside the pool [0, 64)"), std::string::npos)
        << e.what();
  }
  pb.indices[13] = -1;
  EXPECT_THROW(run_decode_cpu(pb.host_params(o.data(), nullptr), plan, workspace.data()), Error);
}

// The serving-step plan: made once for a bound, while each request's table
// count (seq_lens) is anything up to it. Forced 64-token chunks put some
// chunks wholly past the live count; those must write empty partials that
// the merge ignores, and the result must be the exact-plan result.
TEST(DecodeCpu, PlanForABoundServesSmallerCounts) {
  std::mt19937_64 rng(16);
  ProblemSpec spec;
  spec.seq_lens = {100, 0, 257, 64};
  spec.page_size = 16;
  spec.random_first_page_offset = true;
  const PagedProblem pb = make_problem(spec, rng);
  const CpuResult exact = run_cpu(pb, cpu_shape(spec, 64));
  expect_matches_reference(pb, exact);
  const DecodePlan bound = make_decode_plan({512, 512, 512, 512}, cpu_shape(spec, 64));
  ASSERT_GT(bound.work.size(), exact.plan.work.size());
  const size_t rows = static_cast<size_t>(pb.num_requests()) * spec.group_size;
  std::vector<uint8_t> o = testing::nan_values(spec.dtype, rows * spec.dim_v);
  CpuResult got;
  got.lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  Buffer workspace(Device::kCpu, bound.workspace.total);
  fill_bytes(workspace.data(), Device::kCpu, 0xFF, workspace.bytes());
  run_decode_cpu(pb.host_params(o.data(), got.lse.data()), bound, workspace.data());
  got.o = testing::as_float(spec.dtype, o);
  expect_matches_reference(pb, got);
  EXPECT_EQ(got.o, exact.o) << "the same 64-token chunks, merged the same way";
}

TEST(DecodeCpu, ParamsInconsistentWithThePlanAreRejected) {
  std::mt19937_64 rng(15);
  ProblemSpec spec;
  spec.seq_lens = {10, 20};
  const PagedProblem pb = make_problem(spec, rng);
  std::vector<uint8_t> o(pb.q.size());
  // A plan may be made for more tokens than a request sees (a step's
  // bound), never for fewer.
  const DecodePlan plan = make_decode_plan({10, 19}, cpu_shape(spec));
  Buffer workspace(Device::kCpu, plan.workspace.total);
  EXPECT_THROW(run_decode_cpu(pb.host_params(o.data(), nullptr), plan, workspace.data()), Error);
  const DecodePlan ok = make_decode_plan(pb.table.seq_lens, cpu_shape(spec));
  DecodeParams bad = pb.host_params(o.data(), nullptr);
  bad.k.row_stride = 10;
  try {
    run_decode_cpu(bad, ok, workspace.data());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k.row_stride = 10"), std::string::npos) << e.what();
  }
  bad = pb.host_params(o.data(), nullptr);
  bad.group_size = 3;
  EXPECT_THROW(run_decode_cpu(bad, ok, workspace.data()), Error);
  bad = pb.host_params(o.data(), nullptr);
  bad.indices = nullptr;
  EXPECT_THROW(run_decode_cpu(bad, ok, workspace.data()), Error) << "null indices must be named, not dereferenced";
  bad = pb.host_params(o.data(), nullptr);
  bad.num_pool_pages = 0;
  EXPECT_THROW(run_decode_cpu(bad, ok, workspace.data()), Error);
}

}  // namespace
}  // namespace sparsepage
