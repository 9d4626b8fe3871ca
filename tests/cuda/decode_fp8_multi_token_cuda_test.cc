// The decode's multi-token step over e4m3 K/V with per-KV-head scales
// (KvFormat::kE4m3PerHead) on the GPU, on both e4m3 CTAs: 64 query rows per
// request (16 heads x 4 tokens) on the 64-row wgmma CTA where sm_90a code
// runs, 16 rows (4 x 4) on the 16-row tile, each with every query row's
// causal limit, split and merged; against the CPU backend, the native step
// over the same values (power-of-two scales: exact in bf16) and fp64 per
// token. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/memory.h"
#include "sparsepage/plan.h"
#include "sparsepage/types.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

void check_fp8_multi_token(int32_t g, const char* kernel) {
  const DType dtype = DType::kBF16;
  const int32_t batch = 2, hkv = 2, d = 128, q_len = 4, page = 16;
  const int64_t len = 1000;  // each sequence's live length; its last q_len positions are the step's tokens
  std::mt19937_64 rng(31);
  std::uniform_int_distribution<int> byte(0, 255);
  const size_t rows = static_cast<size_t>(batch) * hkv * static_cast<size_t>(len);
  std::vector<uint8_t> k8(rows * d), v8(rows * d);
  for (auto* stream : {&k8, &v8}) {
    for (uint8_t& x : *stream) {
      do x = static_cast<uint8_t>(byte(rng));
      while ((x & 0x7F) == 0x7F || (x & 0x78) == 0x78);  // no NaN, |x| < 256: keeps the softmax spread
    }
  }
  const std::vector<float> k_scale = {1.0f / 64, 1.0f / 16}, v_scale = {1.0f / 8, 1.0f / 32};
  std::vector<float> kf(k8.size()), vf(v8.size());
  for (size_t i = 0; i < k8.size(); ++i) {
    const size_t h = (i / (static_cast<size_t>(len) * d)) % hkv;
    kf[i] = e4m3_to_float(k8[i]) * k_scale[h];
    vf[i] = e4m3_to_float(v8[i]) * v_scale[h];
  }
  std::vector<uint8_t> kn(kf.size() * 2), vn(vf.size() * 2);
  from_float(dtype, kf.data(), kn.data(), kf.size());
  from_float(dtype, vf.data(), vn.data(), vf.size());
  const auto q = testing::random_values(dtype, static_cast<size_t>(batch) * q_len * hkv * g * d, rng, 0.5f);

  // Every position of each window, as pages of 16 (window addressing).
  std::vector<int32_t> indptr = {0}, indices, seq_lens;
  for (int32_t r = 0; r < batch * hkv; ++r) {
    for (int32_t j = 0; j * page < len; ++j) indices.push_back(j);
    indptr.push_back(static_cast<int32_t>(indices.size()));
    seq_lens.push_back(static_cast<int32_t>(len));
  }
  const DecodePlan plan = make_decode_plan(seq_lens, testing::cuda_plan_shape(g * q_len, d));
  ASSERT_TRUE(plan.needs_merge());  // split requests: the merge sees q_len x g rows
  const size_t out_elems = static_cast<size_t>(batch) * q_len * hkv * g * d;
  const size_t lse_elems = static_cast<size_t>(batch) * q_len * hkv * g;

  struct Run {
    std::vector<float> o, lse;
    const char* kernel = "";
  };
  const auto step = [&](Device device, bool fp8) {
    Buffer dq = upload(device, q), dk = upload(device, fp8 ? k8 : kn), dv = upload(device, fp8 ? v8 : vn);
    Buffer ks = upload(device, k_scale), vs = upload(device, v_scale);
    Buffer dindptr = upload(device, indptr), dindices = upload(device, indices), dlens = upload(device, seq_lens);
    Buffer o(device, out_elems * 2), lse(device, lse_elems * 4), ws(device, plan.workspace.total + 256);
    fill_bytes(o.data(), device, 0xFF, o.bytes());  // NaN first
    fill_bytes(lse.data(), device, 0xFF, lse.bytes());
    DecodeParams p;
    p.dtype = dtype;
    p.q = dq.data();
    p.k = RowView::dense(dk.data(), hkv, len, d);
    p.v = RowView::dense(dv.data(), hkv, len, d);
    p.scale = 1.0f / 16;
    if (fp8) {
      p.kv_format = KvFormat::kE4m3PerHead;
      p.k_scale = ks.as<float>();
      p.v_scale = vs.as<float>();
    }
    p.o = o.data();
    p.lse = lse.as<float>();
    p.indptr = dindptr.as<int32_t>();
    p.indices = dindices.as<int32_t>();
    p.num_indices = static_cast<int64_t>(indices.size());
    p.seq_lens = dlens.as<int32_t>();
    p.num_requests = batch * hkv;
    p.num_kv_heads = hkv;
    p.page_size = page;
    p.addressing = PageAddressing::kWindow;
    p.window_len = len;
    p.group_size = g;
    p.q_len = q_len;
    Run r;
    if (device == Device::kCuda) {
      upload_plan_cuda(plan, ws.data());
      r.kernel = run_decode_cuda(p, plan, ws.data());
      EXPECT_EQ(read_decode_error_flag(plan, ws.data()), 0u);
    } else {
      run_decode_cpu(p, plan, ws.data());
    }
    r.o = testing::as_float(dtype, download<uint8_t>(device, o.data(), o.bytes()));
    r.lse = download<float>(device, lse.as<float>(), lse_elems);
    return r;
  };
  const Run gpu = step(Device::kCuda, true);
  EXPECT_STREQ(gpu.kernel, kernel);
  const Run cpu = step(Device::kCpu, true);
  const Run native = step(Device::kCuda, false);
  const auto as_double = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
  EXPECT_LT(testing::relative_l2(gpu.o, as_double(cpu.o)), 1e-2) << "against the CPU backend";
  EXPECT_LT(testing::relative_l2(gpu.lse, as_double(cpu.lse)), 1e-3) << "lse against the CPU backend";
  EXPECT_LT(testing::relative_l2(gpu.o, as_double(native.o)), 1e-2)
      << "against the native step (" << native.kernel << ")";
  // fp64 of token t, head (h, j) of sequence b: positions below len - (q_len - 1 - t).
  const std::vector<float> qf = testing::as_float(dtype, q);
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < q_len; ++t) {
      for (int32_t h = 0; h < hkv; ++h) {
        const size_t base = (static_cast<size_t>(b) * hkv + h) * static_cast<size_t>(len);  // the head's rows
        for (int32_t j = 0; j < g; ++j) {
          const size_t row = ((static_cast<size_t>(b) * q_len + t) * hkv + h) * g + j;
          std::vector<double> s;
          for (int64_t pos = 0; pos < len - (q_len - 1 - t); ++pos) {
            double dot = 0.0;
            for (int32_t i = 0; i < d; ++i)
              dot += double{qf[row * d + static_cast<size_t>(i)]} *
                     kf[(base + static_cast<size_t>(pos)) * d + static_cast<size_t>(i)];
            s.push_back(dot / 16);
          }
          std::vector<double> want(static_cast<size_t>(d));
          const double lse = testing::softmax_weighted_sum(
              s, d, [&](size_t p, int64_t i) { return double{vf[(base + p) * d + static_cast<size_t>(i)]}; },
              want.data());
          const std::vector<float> got(gpu.o.begin() + static_cast<std::ptrdiff_t>(row * d),
                                       gpu.o.begin() + static_cast<std::ptrdiff_t>((row + 1) * d));
          ASSERT_LT(testing::relative_l2(got, want), 1e-2)
              << "sequence " << b << " token " << t << " head " << h * g + j;
          ASSERT_NEAR(gpu.lse[row], lse, 2e-2) << "sequence " << b << " token " << t << " head " << h * g + j;
        }
      }
    }
  }
}

TEST(DecodeFp8MultiTokenCuda, SixtyFourRowsMatchTheCpuBackendTheNativeStepAndFp64) {
  SKIP_WITHOUT_CUDA();
  const char* choice = std::getenv("SPARSEPAGE_MULTI_TOKEN_CTA");
  const bool wgmma = (choice == nullptr || std::string(choice) != "mma") && cuda_sm90a_code_runs(cuda_device_sm());
  check_fp8_multi_token(16,
                        wgmma ? "64-row multi-token CTA, wgmma, FP8 e4m3 K/V" : "16-row tiles, mma.sync, FP8 e4m3 K/V");
}

TEST(DecodeFp8MultiTokenCuda, SixteenRowsMatchTheCpuBackendTheNativeStepAndFp64) {
  SKIP_WITHOUT_CUDA();
  check_fp8_multi_token(4, "16-row tiles, mma.sync, FP8 e4m3 K/V");
}

}  // namespace
}  // namespace sparsepage
