// The FP8 MLA kernels' numerics, exactly: each dequantized latent value
// (e4m3 x its block's fp32 scale) is rounded to bf16 before the tensor
// cores read it (mla_ws_fp8_partial.cuh and mla_ws_fp8_pair.cuh both
// convert with e4m3x8_to_bf16_scaled; FlashMLA's FP8 decode, too, feeds
// its MMAs bf16). So each kernel is checked twice
// against fp64:
//   1. against the attention over the rounded values (the kernels' own
//      arithmetic), at the tolerances the bf16 MLA path meets: per head o
//      within 1e-2 relative L2 and lse within 1e-3;
//   2. against the attention over the format's exact dequantization (what
//      the CPU backend computes), element by element within the bound
//      derived in docs/RELIABILITY.md ("FP8 MLA rounding",
//      support/fp8_problem.h's mla_rounding_bound).
// Both kernels run, with and without splits: the CTA pairs at 128 heads
// (two head tiles per item, where the device places the clusters) and the
// one-CTA kernel at 16 heads (one head tile); each case names its kernel. Outputs and the
// workspace are poisoned (NaN); pool rows no token reads are NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/fp8.h"
#include "support/fp8_problem.h"

namespace sparsepage {
namespace {

struct GpuResult {
  std::vector<float> o, lse;
  DecodeErrors errors;
};

GpuResult run_mla_fp8(const testing::Fp8Problem& f, int32_t chunk) {
  const testing::PagedProblem& pb = *f.base;
  const Buffer k = upload(Device::kCuda, f.k);
  const Buffer indptr = upload(Device::kCuda, pb.table.indptr);
  const Buffer indices = upload(Device::kCuda, pb.indices);
  const Buffer offsets = upload(Device::kCuda, pb.table.first_page_offset);
  const Buffer lens = upload(Device::kCuda, pb.table.seq_lens);
  const Buffer q = upload(Device::kCuda, pb.q);
  const Buffer q_extra = upload(Device::kCuda, pb.q_extra);
  Buffer o(Device::kCuda, testing::o_count(pb) * 2);
  Buffer lse(Device::kCuda, testing::lse_count(pb) * sizeof(float));
  fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
  fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  DecodeParams p = f.host_params(o.data(), lse.as<float>());
  const MlaFp8Views views = mla_fp8_views(k.data(), pb.pool_rows(), f.k_row_bytes);
  p.k = views.k;
  p.v = views.v;
  p.k_extra = views.k_extra;
  p.indptr = indptr.as<int32_t>();
  p.indices = indices.as<int32_t>();
  p.first_page_offset = offsets.as<int32_t>();
  p.seq_lens = lens.as<int32_t>();
  p.q = q.data();
  p.q_extra = q_extra.data();
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, testing::cuda_plan_shape(pb.spec.group_size, 512, chunk));
  Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
  fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());
  upload_plan_cuda(plan, ws.data());
  run_decode_cuda(p, plan, ws.data());
  testing::cuda_ok(cudaDeviceSynchronize(), "fp8 mla decode");
  GpuResult r;
  r.o = testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  r.lse = download<float>(Device::kCuda, lse.data(), testing::lse_count(pb));
  r.errors = read_decode_errors(plan, ws.data());
  return r;
}

testing::PagedProblem mla_problem(int32_t heads, std::vector<int32_t> lens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  testing::ProblemSpec spec;
  spec.seq_lens = std::move(lens);
  spec.group_size = heads;
  spec.dim_qk = spec.dim_v = 512;
  spec.dim_extra = 64;
  spec.v_aliases_k = true;
  spec.pool_pages = 8192;
  return testing::make_problem(spec, rng);
}

TEST(Fp8MlaRounding, MatchesTheRoundedDequantizationAndStaysWithinTheBoundOfTheExactOne) {
  SKIP_WITHOUT_CUDA();
  if (!cuda_arch_problem(cuda_device_sm(), 512, 512, 64).empty()) GTEST_SKIP() << "no MLA kernel for this GPU";
  const bool quick = testing::quick_mode();
  for (const int32_t heads : {128, 16}) {
    const testing::PagedProblem pb =
        mla_problem(heads, quick ? std::vector<int32_t>{300, 0, 77} : std::vector<int32_t>{2048, 300, 0, 77, 1000}, 51);
    testing::Fp8Problem exact = testing::make_fp8_mla(pb);
    testing::Fp8Problem rounded = exact;
    rounded.round_to_bf16 = true;
    const testing::Reference exact_ref = testing::reference_attention(exact);
    const testing::Reference rounded_ref = testing::reference_attention(rounded);
    const testing::Fp8RoundingBound bound = testing::mla_rounding_bound(exact, pb.token_rows());
    for (const int32_t chunk : {0, 64}) {
      const std::string what =
          std::to_string(heads) + " heads, chunk " + std::to_string(chunk) + ", kernel \"" +
          cuda_decode_kernel_name(exact.host_params(nullptr, nullptr),
                                  make_decode_plan(pb.table.seq_lens, testing::cuda_plan_shape(heads, 512, chunk))) +
          "\"";
      const GpuResult got = run_mla_fp8(exact, chunk);
      EXPECT_EQ(got.errors.kinds, 0u) << what;
      EXPECT_EQ(testing::compare_per_request(pb, rounded_ref, got.o, got.lse, 1e-2, 1e-3), "")
          << what << ": against fp64 over the bf16-rounded dequantization";
      EXPECT_EQ(testing::outside_bound(exact, exact_ref, bound, got.o, got.lse), "")
          << what
          << ": against fp64 over the exact dequantization (largest scale * sum |q k| = " << bound.largest_score_sum
          << ")";
    }
  }
}

}  // namespace
}  // namespace sparsepage
