// The GQA block prefill over e4m3 K/V with per-KV-head scales
// (KvFormat::kE4m3PerHead) on the CPU backend: fp64 over the dequantized
// rows with every unattended row e4m3 NaN and the outputs NaN first, for
// per-KV-head and per-query-head lists; the same bits as the native prefill
// over the same values (power-of-two scales make them exact in bf16/f16);
// a scale read for the wrong KV head caught; the same rows through an
// engine's block table; bad formats refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/prefill.h"
#include "support/expect_error.h"
#include "support/gqa_prefill_fp8.h"
#include "support/prefill_problem.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::GqaPrefillSpec;

std::vector<GqaPrefillSpec> specs() {
  std::vector<GqaPrefillSpec> out;
  GqaPrefillSpec a;  // per-KV-head lists, a partial last query block, 4 query heads per KV head
  a.num_tokens = 40;
  a.num_qo_heads = 8;
  a.num_kv_heads = 2;
  a.head_dim = 64;
  a.starts = {32};
  out.push_back(a);
  GqaPrefillSpec b;  // f16, two sequences, four KV heads (every scale factor)
  b.dtype = DType::kF16;
  b.batch = 2;
  b.num_tokens = 32;
  b.starts = {0, 48};
  b.num_qo_heads = 8;
  b.num_kv_heads = 4;
  b.head_dim = 32;
  b.block_size = 8;
  b.width = 3;
  b.seed = 3;
  out.push_back(b);
  GqaPrefillSpec c = a;  // per-query-head lists (the static pattern's layout)
  c.layout = BlockSelectionLayout::kPerQueryHead;
  c.seed = 5;
  out.push_back(c);
  GqaPrefillSpec d = b;  // per-query-head, f16, a partial last block
  d.layout = BlockSelectionLayout::kPerQueryHead;
  d.num_tokens = 29;
  d.seed = 6;
  out.push_back(d);
  return out;
}

struct Outputs {
  std::vector<uint8_t> out;
  std::vector<float> lse;
};

Outputs poisoned(const GqaPrefillSpec& spec) {
  Outputs r;
  const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_qo_heads;
  r.out = testing::nan_values(spec.dtype, rows * spec.head_dim);
  r.lse.assign(rows, std::numeric_limits<float>::quiet_NaN());
  return r;
}

Outputs run_cpu(const GqaPrefillParams& params, const GqaPrefillSpec& spec) {
  Outputs r = poisoned(spec);
  GqaPrefillParams p = params;
  p.o = r.out.data();
  p.lse = r.lse.data();
  GqaBlockPrefill prefill(Device::kCpu);
  prefill.run(p);
  EXPECT_STREQ(prefill.kernel_name(), "cpu");
  return r;
}

Outputs run_fp8(const testing::GqaFp8Problem& pb) { return run_cpu(pb.host_params(nullptr, nullptr), pb.base.spec); }

TEST(GqaBlockPrefillFp8Cpu, MatchesFp64OverTheDequantizedRows) {
  for (const GqaPrefillSpec& spec : specs()) {
    for (bool pow2 : {true, false}) {
      const auto pb = testing::make_gqa_fp8_problem(spec, pow2);
      const Outputs got = run_fp8(pb);
      const auto ref = testing::gqa_fp8_reference(pb);
      EXPECT_EQ(testing::compare_gqa_prefill(pb.base, ref, testing::as_float(spec.dtype, got.out), got.lse, 1e-2, 1e-4),
                "")
          << "seed " << spec.seed << (pow2 ? ", power-of-two scales" : ", amax / 448 scales");
    }
  }
}

// With power-of-two scales the dequantized rows are exactly bf16/f16 values:
// the native prefill over them reads the same fp32 numbers through the same
// plan, so the FP8 prefill must give the same bits (and attend the same
// positions: an extra or missing row would change them, a NaN one poison
// them).
TEST(GqaBlockPrefillFp8Cpu, EqualsTheNativePrefillOverTheSameValues) {
  for (const GqaPrefillSpec& spec : specs()) {
    const auto pb = testing::make_gqa_fp8_problem(spec, true);
    // The quantization is exact in spec.dtype: the native rows are the FP8 rows' values.
    ASSERT_EQ(testing::as_float(spec.dtype, pb.dequantized.k).size(), pb.k_values.size());
    const std::vector<float> k_native = testing::as_float(spec.dtype, pb.dequantized.k);
    for (size_t i = 0; i < k_native.size(); ++i) {
      ASSERT_TRUE(k_native[i] == pb.k_values[i] || (std::isnan(k_native[i]) && std::isnan(pb.k_values[i])))
          << "element " << i;
    }
    const Outputs fp8 = run_fp8(pb);
    const Outputs native = run_cpu(pb.dequantized.host_params(nullptr, nullptr), spec);
    EXPECT_EQ(fp8.out, native.out) << "seed " << spec.seed;
    EXPECT_EQ(fp8.lse, native.lse) << "seed " << spec.seed;
  }
}

// The test can see a scale read for the wrong KV head: with two heads'
// scales swapped the outputs leave fp64 of the true rows far behind.
TEST(GqaBlockPrefillFp8Cpu, EachKvHeadReadsItsOwnScale) {
  for (const GqaPrefillSpec& spec : specs()) {
    auto pb = testing::make_gqa_fp8_problem(spec, false);
    const auto ref = testing::gqa_fp8_reference(pb);
    std::swap(pb.k_scale[0], pb.k_scale[1]);
    std::swap(pb.v_scale[0], pb.v_scale[1]);
    const Outputs got = run_fp8(pb);
    const std::string problem =
        testing::compare_gqa_prefill(pb.base, ref, testing::as_float(spec.dtype, got.out), got.lse, 5e-2, 1e-2);
    EXPECT_NE(problem, "") << "seed " << spec.seed << ": swapped scales went unnoticed";
  }
}

// The same rows in an engine's pool, handed out in a shuffled order through
// a block table (pool blocks of 16 positions, query blocks of 16 or 8): the
// same bits as the dense FP8 prefill (the same plan over the same values)
// and fp64.
TEST(GqaBlockPrefillFp8Cpu, ReadsAnEnginePoolThroughItsBlockTable) {
  for (const GqaPrefillSpec& spec : specs()) {
    const auto pb = testing::make_gqa_fp8_problem(spec, false);
    const auto pool = testing::make_gqa_fp8_pool(pb, 16, spec.seed + 100);
    const GqaPrefillParams paged =
        pool.paged(pb.host_params(nullptr, nullptr), pool.k.data(), pool.v.data(), pool.table.data(), spec.batch);
    const Outputs got = run_cpu(paged, spec);
    const Outputs dense = run_fp8(pb);
    EXPECT_EQ(got.out, dense.out) << "seed " << spec.seed;
    EXPECT_EQ(got.lse, dense.lse) << "seed " << spec.seed;
    const auto ref = testing::gqa_fp8_reference(pb);
    EXPECT_EQ(testing::compare_gqa_prefill(pb.base, ref, testing::as_float(spec.dtype, got.out), got.lse, 1e-2, 1e-4),
              "")
        << "seed " << spec.seed;
  }
}

TEST(GqaBlockPrefillFp8Cpu, RefusesBadFormatsByName) {
  const auto pb = testing::make_gqa_fp8_problem(specs()[0], true);
  Outputs r = poisoned(pb.base.spec);
  GqaBlockPrefill prefill(Device::kCpu);
  const auto run = [&](const GqaPrefillParams& p) { return [&prefill, p] { prefill.run(p); }; };
  const GqaPrefillParams good = pb.host_params(r.out.data(), r.lse.data());

  GqaPrefillParams unknown = good;
  unknown.kv_format = static_cast<KvFormat>(7);
  EXPECT_TRUE(testing::throws_error_naming(run(unknown), "GqaBlockPrefill: kv_format 7 is not a KvFormat"));
  GqaPrefillParams no_k_scale = good;
  no_k_scale.k_scale = nullptr;
  EXPECT_TRUE(testing::throws_error_naming(run(no_k_scale), "kv_format e4m3 per head needs k_scale and v_scale"));
  GqaPrefillParams no_v_scale = good;
  no_v_scale.v_scale = nullptr;
  EXPECT_TRUE(testing::throws_error_naming(run(no_v_scale), "k_scale or v_scale is null"));
  GqaPrefillParams native_with_scales = pb.dequantized.host_params(r.out.data(), r.lse.data());
  native_with_scales.k_scale = pb.k_scale.data();
  EXPECT_TRUE(testing::throws_error_naming(run(native_with_scales),
                                           "k_scale / v_scale are set but kv_format native has no per-head scales"));
  GqaPrefillParams mla = good;
  mla.kv_format = KvFormat::kE4m3Mla;
  EXPECT_TRUE(testing::throws_error_naming(run(mla), "kv_format e4m3 mla is the MLA rows' format"));
  // Nothing was written by a refused run.
  for (float x : r.lse) ASSERT_TRUE(std::isnan(x));

  // CUDA's refusals are host checks made before any launch (no GPU needed
  // to see them): the FP8 kernel is built for head dim 128 only, and copies
  // rows in 16-byte pieces.
  GqaBlockPrefill cuda(Device::kCuda);
  const auto run_cuda = [&](const GqaPrefillParams& p) { return [&cuda, p] { cuda.run(p); }; };
  EXPECT_TRUE(testing::throws_error_naming(run_cuda(good),
                                           "GqaBlockPrefill: kv_format e4m3 per head runs on CUDA at head dim 128 "
                                           "only (K and V 128, no second stream), not qk = 64"));
  GqaPrefillParams f32 = good;
  f32.dtype = DType::kF32;
  EXPECT_TRUE(testing::throws_error_naming(run_cuda(f32), "dtype must be bf16 or f16 (or f32 on the CPU), not f32"));
  GqaPrefillSpec wide = specs()[0];
  wide.head_dim = 128;
  const auto pb128 = testing::make_gqa_fp8_problem(wide, true);
  GqaPrefillParams odd = pb128.host_params(r.out.data(), r.lse.data());
  odd.k.row_stride = 136;  // a row of 136 bytes: not whole 16-byte pieces
  odd.k.head_stride = odd.k.row_stride * pb128.base.capacity;
  odd.k.seq_stride = odd.k.head_stride * wide.num_kv_heads;
  EXPECT_TRUE(testing::throws_error_naming(run_cuda(odd), "k.row_stride = 136 must be a multiple of 16 bytes"));
}

}  // namespace
}  // namespace sparsepage
