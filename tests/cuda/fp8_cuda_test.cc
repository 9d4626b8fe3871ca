// FP8 KV caches on the GPU: the MLA row quantizer against its CPU twin (bit
// for bit), and both fp8 decode kernels against an fp64 reference over the
// dequantized values, with outputs and workspace poisoned (NaN), unused pool
// rows NaN, with and without splits, and through the engines' -1 padding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "sparsepage/fp8.h"
#include "support/expect_error.h"
#include "support/fp8_problem.h"

namespace sparsepage {
namespace {

using testing::Fp8Problem;

TEST(QuantizeMlaFp8Cuda, SameBytesAsTheCpuQuantizer) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(31);
  const int64_t rows = 1000;
  std::uniform_real_distribution<float> u(-5.f, 5.f);
  std::vector<uint16_t> src(static_cast<size_t>(rows * 576));
  for (auto& x : src) x = float_to_bf16(u(rng) * std::exp2(u(rng)));
  for (int i = 0; i < 128; ++i) src[7 * 576 + 256 + i] = 0;                    // an all-zero block
  src[9 * 576 + 17] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());  // a NaN block
  src[11 * 576 + 3] = float_to_bf16(std::numeric_limits<float>::infinity());   // an inf block
  std::vector<uint8_t> cpu(static_cast<size_t>(rows * 672), 0xAB);
  quantize_mla_fp8_cpu(DType::kBF16, src.data(), rows, 576, cpu.data(), 672);
  const Buffer dsrc = upload(Device::kCuda, src);
  Buffer ddst(Device::kCuda, cpu.size());
  fill_bytes(ddst.data(), Device::kCuda, 0xAB, ddst.bytes());
  quantize_mla_fp8_cuda(DType::kBF16, dsrc.data(), rows, 576, ddst.data(), 672);
  const std::vector<uint8_t> gpu = download<uint8_t>(Device::kCuda, ddst.data(), ddst.bytes());
  size_t differ = 0, first = 0;
  for (size_t i = cpu.size(); i-- > 0;) {
    if (cpu[i] != gpu[i]) ++differ, first = i;
  }
  EXPECT_EQ(differ, 0u) << "bytes differ between the CPU and CUDA quantizers; the first: row " << first / 672
                        << ", byte " << first % 672 << ": cpu " << int{cpu[first]} << ", gpu " << int{gpu[first]};
  EXPECT_TRUE(testing::throws_error_naming(
      [&] { quantize_mla_fp8_cuda(DType::kBF16, dsrc.data(), rows, 572, ddst.data(), 672); }, "src_row_stride = 572"));
}

struct Fp8Device {
  Buffer k, v, k_scale, v_scale, indptr, indices, first_page_offset, seq_lens, q, q_extra, e;
};

struct GpuRun {
  std::vector<float> o, lse;
  uint32_t error_flag = 0;
};

// Runs `f` on the GPU with `indices` (the base's, or a padded copy).
GpuRun run_gpu(const Fp8Problem& f, const PlanShape& shape, const std::vector<int32_t>& indices, bool skip_minus_one) {
  const testing::PagedProblem& pb = *f.base;
  Fp8Device d;
  d.k = upload(Device::kCuda, f.k);
  if (!f.v.empty()) d.v = upload(Device::kCuda, f.v);
  if (!f.k_scale.empty()) {
    d.k_scale = upload(Device::kCuda, f.k_scale);
    d.v_scale = upload(Device::kCuda, f.v_scale);
  }
  d.indptr = upload(Device::kCuda, pb.table.indptr);
  d.indices = upload(Device::kCuda, indices);
  d.first_page_offset = upload(Device::kCuda, pb.table.first_page_offset);
  d.seq_lens = upload(Device::kCuda, pb.table.seq_lens);
  d.q = upload(Device::kCuda, pb.q);
  if (!pb.q_extra.empty()) d.q_extra = upload(Device::kCuda, pb.q_extra);
  const size_t esize = dtype_size(pb.spec.dtype);
  Buffer o(Device::kCuda, testing::o_count(pb) * esize);
  Buffer lse(Device::kCuda, testing::lse_count(pb) * sizeof(float));
  fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
  fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  DecodeParams p = f.host_params(o.data(), lse.as<float>());
  p.indptr = d.indptr.as<int32_t>();
  p.indices = d.indices.as<int32_t>();
  p.first_page_offset = d.first_page_offset.as<int32_t>();
  p.seq_lens = d.seq_lens.as<int32_t>();
  p.q = d.q.data();
  if (f.format == KvFormat::kE4m3Mla) {
    const MlaFp8Views views = mla_fp8_views(d.k.data(), pb.pool_rows(), f.k_row_bytes);
    p.k = views.k;
    p.v = views.v;
    p.k_extra = views.k_extra;
    p.q_extra = d.q_extra.data();
  } else {
    p.k.data = d.k.data();
    p.v.data = d.v.data();
    p.k_scale = d.k_scale.as<float>();
    p.v_scale = d.v_scale.as<float>();
  }
  if (skip_minus_one) p.padding = IndexPadding::kMinusOneSkips;
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, shape);
  Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
  fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());
  upload_plan_cuda(plan, ws.data());
  run_decode_cuda(p, plan, ws.data());
  testing::cuda_ok(cudaDeviceSynchronize(), "fp8 decode");
  GpuRun run;
  run.o = testing::as_float(pb.spec.dtype, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  run.lse = download<float>(Device::kCuda, lse.data(), testing::lse_count(pb));
  run.error_flag = read_decode_error_flag(plan, ws.data());
  return run;
}

// Every third index -1 (padding the engines skip), and the rows the reference then sees.
std::vector<int32_t> padded(const testing::PagedProblem& pb, std::vector<std::vector<int64_t>>& rows) {
  std::vector<int32_t> indices = pb.indices;
  for (size_t i = 0; i < indices.size(); i += 3) indices[i] = -1;
  rows.clear();
  for (int32_t r = 0; r < pb.num_requests(); ++r) {
    rows.emplace_back();
    for (int32_t i = pb.table.indptr[r]; i < pb.table.indptr[r + 1]; ++i) rows.back().push_back(indices[i]);
  }
  return indices;
}

void check_all_ways(const Fp8Problem& f, const std::string& what, double lse_tol = 1e-2) {
  const testing::PagedProblem& pb = *f.base;
  const auto& spec = pb.spec;
  const testing::Reference ref = testing::reference_attention(f);
  for (int32_t chunk : {0, 64, 256}) {
    const GpuRun got = run_gpu(f, testing::cuda_plan_shape(spec.group_size, spec.dim_v, chunk), pb.indices, false);
    EXPECT_EQ(got.error_flag, 0u) << what;
    EXPECT_EQ(testing::compare_per_request(pb, ref, got.o, got.lse, 1e-2, lse_tol), "") << what << ", chunk " << chunk;
  }
  std::vector<std::vector<int64_t>> rows;
  const std::vector<int32_t> indices = padded(pb, rows);
  const testing::Reference pref = testing::reference_attention(f, rows);
  const GpuRun got = run_gpu(f, testing::cuda_plan_shape(spec.group_size, spec.dim_v, 64), indices, true);
  EXPECT_EQ(got.error_flag, 0u) << what;
  EXPECT_EQ(testing::compare_per_request(pb, pref, got.o, got.lse, 1e-2, lse_tol), "") << what << ", -1 padding";
}

TEST(DecodeCudaFp8, E4m3PerHeadMatchesFp64Reference) {
  SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    std::mt19937_64 rng(41);
    testing::ProblemSpec spec;
    spec.dtype = dtype;
    spec.seq_lens = testing::quick_lens({2048, 0, 129, 64, 1, 700, 77, 300});  // 2 sequences x 4 KV heads
    spec.group_size = 16;
    spec.pool_pages = 8192;
    const testing::PagedProblem pb = testing::make_problem(spec, rng);
    check_all_ways(testing::make_fp8_per_head(pb, 4), dtype_name(dtype));
  }
}

TEST(DecodeCudaFp8, E4m3PerHeadWithGroupOf32) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(42);
  testing::ProblemSpec spec;
  spec.seq_lens = {500, 33};
  spec.group_size = 32;  // two head tiles
  spec.pool_pages = 2048;
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  check_all_ways(testing::make_fp8_per_head(pb, 2), "group 32");
}

TEST(DecodeCudaFp8, E4m3PerHeadQueriesFarOutsideF16Range) {
  // bf16 queries of 2^40 and 2^-40 (each request its own), far outside f16's
  // range, must still match: the kernel's MMAs must not narrow q. An lse near
  // 1e12 is judged relatively (its fp32 ulp is 65536).
  SKIP_WITHOUT_CUDA();
  testing::PagedProblem pb;
  const testing::Fp8Problem f = testing::make_fp8_far_queries(pb);
  const double max_lse = testing::max_finite_lse(testing::reference_attention(f));
  EXPECT_GT(max_lse, 1e9);
  check_all_ways(f, "q of 2^40 and 2^-40", std::max(1e-2, 1e-6 * max_lse));
}

TEST(DecodeCudaFp8, MlaRowsMatchFp64Reference) {
  SKIP_WITHOUT_CUDA();
  if (!cuda_arch_problem(cuda_device_sm(), 512, 512, 64).empty()) GTEST_SKIP() << "no MLA kernel for this GPU";
  std::mt19937_64 rng(43);
  testing::ProblemSpec spec;
  spec.seq_lens = testing::quick_lens({2048, 300, 0, 77});
  spec.group_size = 128;
  spec.dim_qk = spec.dim_v = 512;
  spec.dim_extra = 64;
  spec.v_aliases_k = true;
  spec.pool_pages = 8192;
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  check_all_ways(testing::make_fp8_mla(pb), "mla");
  // Rows wider than the format (a padded pool), and a group of 16 heads (tensor parallel).
  check_all_ways(testing::make_fp8_mla(pb, 672), "mla, 672-byte rows");
  spec.group_size = 16;
  std::mt19937_64 rng2(44);
  const testing::PagedProblem small = testing::make_problem(spec, rng2);
  check_all_ways(testing::make_fp8_mla(small), "mla, 16 heads");
}

TEST(DecodeCudaFp8, MlaBatchOneMatchesFp64ReferenceAtEverySplit) {
  // Batch 1 of the DSA step: one request of 2048 rows is a uniform split
  // (items from the CTA index), run in 64-, 128- (the library plan's
  // batch-1 split), 256-token chunks (32, 16 and 8 partials per head for
  // the merge) and whole, then with every third id -1 (skipped).
  // Unselected pool rows and the outputs start as NaN (make_problem,
  // run_gpu).
  SKIP_WITHOUT_CUDA();
  if (!cuda_arch_problem(cuda_device_sm(), 512, 512, 64).empty()) GTEST_SKIP() << "no MLA kernel for this GPU";
  std::mt19937_64 rng(47);
  testing::ProblemSpec spec;
  spec.seq_lens = testing::quick_lens({2048});
  spec.group_size = 128;
  spec.dim_qk = spec.dim_v = 512;
  spec.dim_extra = 64;
  spec.v_aliases_k = true;
  spec.pool_pages = 16384;
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  const testing::Fp8Problem f = testing::make_fp8_mla(pb);
  check_all_ways(f, "mla, batch 1");
  const testing::Reference ref = testing::reference_attention(f);
  for (int32_t chunk : {128, 1 << 20}) {
    const GpuRun got = run_gpu(f, testing::cuda_plan_shape(spec.group_size, spec.dim_v, chunk), pb.indices, false);
    EXPECT_EQ(got.error_flag, 0u);
    EXPECT_EQ(testing::compare_per_request(pb, ref, got.o, got.lse, 1e-2, 1e-2), "") << "mla, batch 1, chunk " << chunk;
  }
}

TEST(DecodeCudaFp8, MlaIdOutsideThePoolPoisonsThatRequestOnly) {
  // 128 heads run as CTA pairs (each CTA dequantizes half of a tile's rows,
  // both resolve every id); 16 heads as one CTA. The bad id sits in the
  // second half of a tile (row 40) in request 1, which must come out NaN
  // with the error flag set while the others match the reference.
  SKIP_WITHOUT_CUDA();
  if (!cuda_arch_problem(cuda_device_sm(), 512, 512, 64).empty()) GTEST_SKIP() << "no MLA kernel for this GPU";
  for (const int32_t heads : {128, 16}) {
    std::mt19937_64 rng(46);
    testing::ProblemSpec spec;
    spec.seq_lens = {300, 300, 300};
    spec.group_size = heads;
    spec.dim_qk = spec.dim_v = 512;
    spec.dim_extra = 64;
    spec.v_aliases_k = true;
    spec.pool_pages = 4096;
    const testing::PagedProblem pb = testing::make_problem(spec, rng);
    const Fp8Problem f = testing::make_fp8_mla(pb);
    std::vector<std::vector<int64_t>> rows = pb.token_rows();
    rows[1].clear();
    const testing::Reference ref = testing::reference_attention(f, rows);
    for (const int32_t bad : {static_cast<int32_t>(spec.pool_pages), -3}) {
      std::vector<int32_t> indices = pb.indices;
      indices[static_cast<size_t>(pb.table.indptr[1] + 64 + 40)] = bad;
      for (const int32_t chunk : {64, 0}) {
        const GpuRun got = run_gpu(f, testing::cuda_plan_shape(heads, 512, chunk), indices, false);
        const std::string what =
            std::to_string(heads) + " heads, id " + std::to_string(bad) + ", chunk " + std::to_string(chunk);
        EXPECT_NE(got.error_flag, 0u) << what;
        const size_t per_request = static_cast<size_t>(heads) * 512;
        size_t finite = 0;
        for (size_t i = per_request; i < 2 * per_request; ++i) finite += !std::isnan(got.o[i]);
        for (size_t i = static_cast<size_t>(heads); i < 2 * static_cast<size_t>(heads); ++i)
          finite += !std::isnan(got.lse[i]);
        EXPECT_EQ(finite, 0u) << what << ": request 1's o and lse must be NaN";
        for (const int r : {0, 2}) {
          const std::vector<float> o(got.o.begin() + r * per_request, got.o.begin() + (r + 1) * per_request);
          const std::vector<double> want(ref.o.begin() + r * per_request, ref.o.begin() + (r + 1) * per_request);
          EXPECT_LT(testing::relative_l2(o, want), 1e-2) << what << ", request " << r;
        }
      }
    }
  }
}

TEST(DecodeCudaFp8, UnsupportedShapesAreRefusedByName) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(45);
  testing::ProblemSpec spec;
  spec.seq_lens = {64};
  spec.dim_qk = spec.dim_v = 64;
  spec.pool_pages = 128;
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  const Fp8Problem f = testing::make_fp8_per_head(pb, 1);
  EXPECT_TRUE(testing::throws_error_naming(
      [&] { run_gpu(f, testing::cuda_plan_shape(spec.group_size, spec.dim_v), pb.indices, false); },
      "head dim 128 only"));
}

}  // namespace
}  // namespace sparsepage
