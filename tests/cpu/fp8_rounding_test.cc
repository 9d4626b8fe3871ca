// The FP8 MLA error bound (support/fp8_problem.h's mla_rounding_bound,
// docs/RELIABILITY.md "FP8 MLA rounding") checked on the host, where it can
// be checked exactly: the fp64 attention over the bf16-rounded dequantization
// (what the CUDA kernels compute with) must lie within the bound of the
// fp64 attention over the exact one, element by element, and the bound must
// stay tight enough to catch a real error. The GPU test
// (tests/cuda/fp8_mla_rounding_cuda_test.cc) then holds the kernels to it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/fp8.h"
#include "support/fp8_problem.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

testing::PagedProblem mla_problem(int32_t heads, uint64_t seed) {
  std::mt19937_64 rng(seed);
  testing::ProblemSpec spec;
  spec.seq_lens = {300, 77, 0, 129};
  spec.group_size = heads;
  spec.dim_qk = spec.dim_v = 512;
  spec.dim_extra = 64;
  spec.v_aliases_k = true;
  spec.pool_pages = 1024;
  return testing::make_problem(spec, rng);
}

std::vector<float> as_floats(const std::vector<double>& x) { return {x.begin(), x.end()}; }

TEST(Fp8MlaRoundingBound, TheRoundedDequantizationLiesWithinIt) {
  for (const int32_t heads : {16, 4}) {
    const testing::PagedProblem pb = mla_problem(heads, 70 + static_cast<uint64_t>(heads));
    testing::Fp8Problem exact = testing::make_fp8_mla(pb);
    testing::Fp8Problem rounded = exact;
    rounded.round_to_bf16 = true;
    const testing::Reference want = testing::reference_attention(exact);
    const testing::Reference got = testing::reference_attention(rounded);
    const testing::Fp8RoundingBound bound = testing::mla_rounding_bound(exact, pb.token_rows());
    EXPECT_EQ(testing::outside_bound(exact, want, bound, as_floats(got.o), as_floats(got.lse)), "");
    // The rounding does move the results (so this data exercises it), and
    // the bound stays small enough to catch an error of a few percent.
    double moved = 0, widest = 0;
    for (size_t i = 0; i < want.lse.size(); ++i) {
      if (!std::isfinite(want.lse[i])) continue;
      moved = std::max(moved, std::fabs(got.lse[i] - want.lse[i]));
      widest = std::max(widest, bound.lse[i]);
    }
    EXPECT_GT(moved, 1e-5) << heads << " heads";
    EXPECT_LT(widest, 0.05) << heads << " heads: the lse bound is too loose to test anything";
    EXPECT_LT(moved, widest) << heads << " heads";
  }
}

// The same bound refuses what it must: an lse shifted by twice its bound,
// or one output moved by twice its own, is reported.
TEST(Fp8MlaRoundingBound, ItReportsAnErrorPastIt) {
  const testing::PagedProblem pb = mla_problem(4, 80);
  const testing::Fp8Problem exact = testing::make_fp8_mla(pb);
  const testing::Reference want = testing::reference_attention(exact);
  const testing::Fp8RoundingBound bound = testing::mla_rounding_bound(exact, pb.token_rows());
  std::vector<float> o = as_floats(want.o), lse = as_floats(want.lse);
  EXPECT_EQ(testing::outside_bound(exact, want, bound, o, lse), "");
  lse[1] += static_cast<float>(2 * bound.lse[1]);
  EXPECT_NE(testing::outside_bound(exact, want, bound, o, lse).find("request 0 head 1: lse off by"), std::string::npos);
  lse = as_floats(want.lse);
  o[5 * 512 + 7] += static_cast<float>(2 * bound.o[5 * 512 + 7]) + 1e-6f;
  EXPECT_NE(testing::outside_bound(exact, want, bound, o, lse).find("request 1 head 1: o[7] off by"),
            std::string::npos);
  // NaN is never within a bound.
  o = as_floats(want.o);
  o[3] = std::nanf("");
  EXPECT_NE(testing::outside_bound(exact, want, bound, o, lse), "");
}

// The CPU backend computes the exact dequantization: it meets fp64 over the
// exact values far inside the rounding bound.
TEST(Fp8MlaRoundingBound, TheCpuBackendIsTheExactDequantization) {
  const testing::PagedProblem pb = mla_problem(4, 81);
  const testing::Fp8Problem exact = testing::make_fp8_mla(pb);
  const testing::Reference want = testing::reference_attention(exact);
  PlanShape shape;
  shape.group_size = 4;
  shape.head_dim_v = 512;
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, shape);
  Buffer ws(Device::kCpu, plan.workspace.total);
  std::vector<uint8_t> o = testing::nan_values(DType::kBF16, size_t(pb.num_requests()) * 4 * 512);
  std::vector<float> lse(pb.table.seq_lens.size() * 4);
  run_decode_cpu(exact.host_params(o.data(), lse.data()), plan, ws.data());
  EXPECT_EQ(testing::compare_per_request(pb, want, testing::as_float(DType::kBF16, o), lse, 1e-2, 1e-4), "");
}

}  // namespace
}  // namespace sparsepage
