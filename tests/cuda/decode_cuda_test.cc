// The fused paged decode on the GPU against the fp64 reference and the CPU
// backend, over a sweep of shapes: page sizes 1, 3 and 16, first-page
// offsets, partial pages, unsorted and duplicated pages, empty requests,
// group sizes 1..24, head dims 64/128/256, V aliasing K, the second K
// stream, bf16 and f16; each with the plan's splits forced on and off, and
// split requests merged by the merge kernel and in place.
#include <cstdlib>
#include <random>
#include <string>

#include "cuda/cuda_test_util.h"
#include "sparsepage/detail/cuda_introspection.h"

namespace sparsepage::testing {
namespace {

struct Case {
  const char* name;
  DType dtype;
  int32_t page_size;
  bool first_page_offset;
  int32_t group_size;
  int32_t dim_qk, dim_v, dim_extra;
  bool v_aliases_k;
  int32_t k_row_padding;
  std::vector<int32_t> seq_lens;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

class DecodeCuda : public ::testing::TestWithParam<Case> {};

PagedProblem make_case_problem(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  ProblemSpec spec;
  spec.dtype = c.dtype;
  spec.seq_lens = quick_lens(c.seq_lens);  // under the sanitizers: at most 512 tokens each
  spec.page_size = c.page_size;
  spec.random_first_page_offset = c.first_page_offset;
  spec.group_size = c.group_size;
  spec.dim_qk = c.dim_qk;
  spec.dim_v = c.dim_v;
  spec.dim_extra = c.dim_extra;
  spec.v_aliases_k = c.v_aliases_k;
  spec.k_row_padding = c.k_row_padding;
  // Enough pages that most pool rows stay unselected (and NaN).
  spec.pool_pages = c.page_size == 1 ? 16384 : 2048;
  return make_problem(spec, rng);
}

TEST_P(DecodeCuda, MatchesReferenceAndCpuWithAndWithoutSplits) {
  SKIP_WITHOUT_CUDA();
  const Case& c = GetParam();
  ASSERT_TRUE(cuda_supports_head_dims(c.dim_qk, c.dim_v, c.dim_extra));
  const PagedProblem pb = make_case_problem(c, 0x5eed0000u + static_cast<uint64_t>(c.group_size));
  const Reference ref = reference_attention(pb, pb.token_rows());

  const DecodeOutput split = run_gpu(pb, cuda_plan_shape(c.group_size, c.dim_v, 64));
  const DecodeOutput whole = run_gpu(pb, cuda_plan_shape(c.group_size, c.dim_v, 1 << 20));
  const DecodeOutput automatic = run_gpu(pb, cuda_plan_shape(c.group_size, c.dim_v));
  expect_matches_reference(pb, split, ref, "split into 64-token chunks");
  expect_matches_reference(pb, whole, ref, "one chunk per request");
  expect_matches_reference(pb, automatic, ref, "plan's own split");
  EXPECT_EQ(split.error_flag, 0u);
  EXPECT_EQ(whole.error_flag, 0u);
  // The result does not depend on the split.
  EXPECT_LT(relative_l2(split.o, to_double(whole.o)), 1e-2);

  const DecodeOutput cpu = run_cpu(pb, cuda_plan_shape(c.group_size, c.dim_v));
  EXPECT_LT(relative_l2(automatic.o, to_double(cpu.o)), 1e-2) << "GPU vs CPU backend";
}

const DType kBF16 = DType::kBF16;
const DType kF16 = DType::kF16;

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeCuda,
    ::testing::Values(
        // name, dtype, page, offset, G, qk, v, extra, alias, pad, seq_lens
        Case{"bf16_p1_g16_d128", kBF16, 1, false, 16, 128, 128, 0, false, 0, {2048, 0, 333, 1000}},
        Case{"f16_p1_g16_d128", kF16, 1, false, 16, 128, 128, 0, false, 0, {2048, 0, 333, 1000}},
        Case{"bf16_p16_offset_g4_d128", kBF16, 16, true, 4, 128, 128, 0, false, 0, {500, 17, 0, 1024, 1}},
        Case{"f16_p16_offset_g8_d256", kF16, 16, true, 8, 256, 256, 0, false, 0, {700, 0, 65}},
        Case{"bf16_p1_g1_d64", kBF16, 1, false, 1, 64, 64, 0, false, 0, {300, 1, 0, 129}},
        Case{"bf16_p3_offset_g16_d256_v128", kBF16, 3, true, 16, 256, 128, 0, false, 0, {400, 63, 64}},
        Case{"f16_p1_g4_d128_v64", kF16, 1, false, 4, 128, 64, 0, false, 0, {256, 10}},
        Case{"bf16_p16_g2_d256_v64", kBF16, 16, true, 2, 256, 64, 0, false, 0, {180, 40}},
        Case{"bf16_alias_p1_g16_d128", kBF16, 1, false, 16, 128, 128, 0, true, 64, {1500, 0, 90}},
        Case{"f16_alias_p16_offset_g8_d256_v128", kF16, 16, true, 8, 256, 128, 0, true, 8, {640, 3}},
        Case{"bf16_extra_p1_g16_d64_e64", kBF16, 1, false, 16, 64, 64, 64, false, 0, {600, 5, 0}},
        Case{"f16_extra_alias_p16_offset_g4_d128_e64", kF16, 16, true, 4, 128, 128, 64, true, 64, {777, 64}},
        Case{"bf16_extra_p1_g8_d128_v64_e64", kBF16, 1, false, 8, 128, 64, 64, false, 8, {1200, 31}},
        Case{"bf16_p1_g24_d128", kBF16, 1, false, 24, 128, 128, 0, false, 0, {400, 0, 129}},
        // Equal counts: the uniform split (items computed from the CTA index).
        Case{"bf16_uniform_p16_offset_g16_d128", kBF16, 16, true, 16, 128, 128, 0, false, 0, {1000, 1000, 1000}},
        Case{"f16_uniform_p1_g8_d256_v128", kF16, 1, false, 8, 256, 128, 0, false, 0, {333, 333}},
        Case{"bf16_uniform_mla_p1_g128_d512_e64", kBF16, 1, false, 128, 512, 512, 64, true, 128, {700, 700}},
        // DSA/MLA: 128 heads, 512 latent (K row stride 640) + 64 rope, V = K's latent.
        Case{"bf16_mla_p1_g128_d512_e64", kBF16, 1, false, 128, 512, 512, 64, true, 128, {1100, 0, 77}},
        Case{"f16_mla_p16_offset_g16_d512_e64", kF16, 16, true, 16, 512, 512, 64, true, 128, {300, 5}},
        // A partial second head tile (80 = 64 + 16) and one exact tile.
        Case{"f16_mla_p1_g80_d512_e64", kF16, 1, false, 80, 512, 512, 64, true, 128, {2100, 64, 1}},
        Case{"bf16_mla_p2_offset_g64_d512_e64", kBF16, 2, true, 64, 512, 512, 64, true, 128, {129, 0, 640}},
        // Batch 1 of the DSA step (top-2048): one request is a uniform split,
        // its items computed from the CTA index; 64-token chunks give the
        // merge 32 partials per head, the most a 2048-row request makes.
        Case{"bf16_batch1_mla_p1_g128_d512_e64", kBF16, 1, false, 128, 512, 512, 64, true, 128, {2048}}),
    [](const ::testing::TestParamInfo<Case>& param) { return std::string(param.param.name); });

// The merge inside thread-block clusters: which plans take it (uniform
// splits of 2 CTAs per request; every other split request merges in the
// merge kernel), and that both match the reference and the unsplit launch.
struct ClusterCase {
  DType dtype;
  int32_t group_size;
  std::vector<int32_t> seq_lens;
  int32_t fixed_chunk;
  int32_t cluster;  // what cuda_merge_cluster_size reports: 2, or 0 for the merge kernel
};

TEST(DecodeCudaClusterMerge, TakesUniformSplitsOfTwoCtasAndMatchesTheReference) {
  SKIP_WITHOUT_CUDA();
  const std::vector<ClusterCase> cases = {
      {kBF16, 16, {2048, 2048, 2048, 2048}, 128, 0},  // the batch-1 shape: 16 chunks per request
      {kBF16, 16, {2048, 2048, 2048, 2048}, 256, 0},  // 8 chunks
      {kBF16, 16, {2048, 2048, 2048}, 1024, 2},       // the batch-32 and 64 shape: 2 chunks
      {kF16, 16, {1000, 1000}, 512, 2},               // a short second chunk
      {kF16, 16, {2048, 2048}, 64, 0},                // 32 chunks
      {kBF16, 16, {8192}, 64, 0},                     // 128 chunks: 8 merge lanes of two batches each
      {kF16, 16, {4480, 4480}, 64, 0},                // 70 chunks: a lane's second batch mostly past the end
      {kBF16, 32, {1024, 1024}, 128, 0},              // 8 chunks x 2 head tiles
      {kBF16, 32, {1024, 1024}, 1024, 0},             // 1 chunk x 2 head tiles: nothing split
      {kF16, 4, {700, 700, 700}, 64, 0},              // 4 heads of the 16-row tile, a short last chunk
      {kBF16, 24, {640, 640}, 128, 0},                // a partial second head tile, 5 chunks
      {kBF16, 16, {2048, 1000}, 128, 0},              // not uniform: the merge kernel
      {kBF16, 16, {100, 100}, 1 << 20, 0},            // nothing split
  };
  for (const ClusterCase& c : cases) {
    // Under the sanitizers the cases of more than 4096 tokens in all stay out
    // (every cluster size, the merge kernel and the unsplit launch remain).
    int64_t tokens = 0;
    for (int32_t len : c.seq_lens) tokens += len;
    if (quick_mode() && tokens > 4096) continue;
    ProblemSpec spec;
    spec.dtype = c.dtype;
    spec.seq_lens = c.seq_lens;
    spec.group_size = c.group_size;
    spec.pool_pages = 16384;
    std::mt19937_64 rng(0xc1u + static_cast<uint64_t>(c.fixed_chunk) + static_cast<uint64_t>(c.group_size));
    const PagedProblem pb = make_problem(spec, rng);
    const std::string what = "group " + std::to_string(c.group_size) + ", " + std::to_string(c.seq_lens.size()) +
                             " x " + std::to_string(c.seq_lens[0]) + ", chunk " + std::to_string(c.fixed_chunk);
    const PlanShape shape = cuda_plan_shape(c.group_size, 128, c.fixed_chunk);
    const DecodePlan plan = make_decode_plan(pb.table.seq_lens, shape);
    const DeviceProblem dp(pb);
    Buffer o(Device::kCuda, o_count(pb) * 2);
    EXPECT_EQ(cuda_merge_cluster_size(dp.params(pb, o.data(), nullptr), plan), c.cluster) << what;
    const Reference ref = reference_attention(pb, pb.token_rows());
    const DecodeOutput split = run_gpu(pb, shape);
    const DecodeOutput whole = run_gpu(pb, cuda_plan_shape(c.group_size, 128, 1 << 20));
    expect_matches_reference(pb, split, ref, what);
    EXPECT_EQ(split.error_flag, 0u) << what;
    EXPECT_LT(relative_l2(split.o, to_double(whole.o)), 1e-2) << what;
    for (size_t i = 0; i < split.lse.size(); ++i)
      EXPECT_NEAR(split.lse[i], whole.lse[i], 1e-3) << what << ", lse " << i;
  }
}

TEST(DecodeCudaSupport, ReportsExactlyTheBuiltHeadDims) {
  // Built: qk in {64, 128, 256}, v in {64, 128, 256} with v <= qk, a
  // 64-wide second stream with qk <= 128, and the MLA shape 512 + 64 (V = K).
  EXPECT_TRUE(cuda_supports_head_dims(128, 128, 0));
  EXPECT_TRUE(cuda_supports_head_dims(256, 64, 0));
  EXPECT_TRUE(cuda_supports_head_dims(64, 64, 64));
  EXPECT_TRUE(cuda_supports_head_dims(128, 64, 64));
  EXPECT_FALSE(cuda_supports_head_dims(64, 128, 0));  // v wider than qk
  EXPECT_FALSE(cuda_supports_head_dims(96, 96, 0));
  EXPECT_FALSE(cuda_supports_head_dims(256, 256, 64));
  EXPECT_TRUE(cuda_supports_head_dims(512, 512, 64));  // MLA, V aliasing K
  EXPECT_FALSE(cuda_supports_head_dims(512, 512, 0));
  EXPECT_FALSE(cuda_supports_head_dims(512, 256, 64));
  EXPECT_FALSE(cuda_supports_head_dims(128, 128, 32));
}

}  // namespace
}  // namespace sparsepage::testing
