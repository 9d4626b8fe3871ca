// The FlashMLA-shaped sparse decode on the CPU backend (mla_sparse.h),
// against an fp64 reference written from FlashMLA's documented semantics:
// both cache formats, -1 ids, topk_length shorter than the rows, several
// query tokens, the extra cache (and that it equals one cache holding both
// sets), the attention sink (no effect at -inf, o = 0 when huge, the exact
// factor otherwise), queries that attend nothing, and bad arguments named.
// Every cache byte no visible id reaches is NaN, and the outputs start NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/memory.h"
#include "sparsepage/mla_sparse.h"
#include "support/expect_error.h"
#include "support/mla_sparse_problem.h"

namespace sparsepage {
namespace {

using testing::MlaSparseProblem;
using testing::MlaSparseSpec;

struct CpuRun {
  std::vector<float> o, lse;
};

CpuRun run_cpu(const MlaSparseProblem& pb, int32_t fixed_chunk_tokens = 0, const MlaSparseParams* override = nullptr) {
  const MlaSparsePlan plan = make_mla_sparse_plan(pb.shape(), testing::mla_sparse_cpu_machine(fixed_chunk_tokens));
  const size_t queries = static_cast<size_t>(int64_t{pb.spec.batch} * pb.spec.q_len * pb.spec.num_heads);
  std::vector<uint16_t> o(queries * kMlaSparseHeadDimV, 0xFFFF);  // NaN until written
  CpuRun run;
  run.lse.assign(queries, std::numeric_limits<float>::quiet_NaN());
  std::vector<uint8_t> ws(plan.workspace.total, 0xFF);
  MlaSparseParams p = override ? *override : pb.host_params(o.data(), run.lse.data());
  p.o = o.data();
  p.lse = run.lse.data();
  run_mla_sparse_cpu(p, plan, ws.data());
  run.o.resize(o.size());
  to_float(DType::kBF16, o.data(), run.o.data(), o.size());
  return run;
}

void expect_reference(const MlaSparseProblem& pb, const CpuRun& run, const std::string& what) {
  const testing::MlaSparseReference ref = testing::mla_sparse_reference(pb);
  // bf16 output: 2^-9 relative rounding per value; the fp32 scores cost far less.
  EXPECT_EQ(testing::compare_mla_sparse(pb, ref, run.o, run.lse, 1e-2, 1e-4), "") << what;
  size_t attended = 0;
  for (double x : ref.lse) attended += std::isfinite(x) ? 1 : 0;
  EXPECT_GT(attended, ref.lse.size() / 2) << what << ": the problem should attend something for most queries";
}

TEST(MlaSparse, V32RowsMatchTheReference) {
  for (int32_t block_size : {1, 61, 64}) {
    for (int32_t fixed : {0, 32}) {  // one chunk per request, and forced splits
      // topk 96: not a multiple of 64
      MlaSparseSpec spec = testing::mla_sparse_spec(3, 2, 16, 96, 512 / block_size + 3, 0,
                                                    static_cast<uint64_t>(10 + block_size + fixed));
      spec.block_size = block_size;
      spec.topk_length = true;
      const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
      expect_reference(pb, run_cpu(pb, fixed),
                       "block_size " + std::to_string(block_size) + ", fixed chunk " + std::to_string(fixed));
    }
  }
}

TEST(MlaSparse, PaddedRowsAndBlocksOnTheCpu) {
  MlaSparseSpec spec;
  spec.row_pad = 16;     // 672-byte rows
  spec.block_pad = 656;  // and a spare row's bytes after each block (poisoned)
  spec.num_heads = 8;
  spec.seed = 3;
  const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  expect_reference(pb, run_cpu(pb), "padded rows and blocks");
}

TEST(MlaSparse, Model1RowsMatchTheReference) {
  for (int32_t block_size : {2, 64}) {
    MlaSparseSpec spec =
        testing::mla_sparse_spec(3, 2, 16, 80, 256 / block_size + 2, 40, static_cast<uint64_t>(20 + block_size));
    spec.format = MlaCacheFormat::kModel1;
    spec.block_size = block_size;
    // FlashMLA's own MODEL1 blocks are padded to a multiple of 576 bytes.
    spec.block_pad = (576 - int64_t{block_size} * 584 % 576) % 576;
    spec.topk_length = spec.extra_topk_length = true;
    spec.extra_block_size = 3;
    spec.extra_num_blocks = 30;
    spec.sink = true;
    const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
    expect_reference(pb, run_cpu(pb, 32), "MODEL1, block_size " + std::to_string(block_size));
  }
}

TEST(MlaSparse, ExtraCacheAndSinkMatchTheReference) {
  // 14 heads: sinks of every kind (h % 7) on two heads each
  MlaSparseSpec spec = testing::mla_sparse_spec(4, 1, 14, 70, 8, 33, 7);
  spec.topk_length = spec.extra_topk_length = true;
  spec.sink = true;
  const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  expect_reference(pb, run_cpu(pb), "extra cache and sink");
  expect_reference(pb, run_cpu(pb, 64), "extra cache and sink, split");
}

// Attending a main and an extra cache is attending one cache that holds both
// sets of rows, with both sets of ids (FlashMLA's definition of the extra cache).
TEST(MlaSparse, TheExtraCacheIsTheUnionOfBothSets) {
  MlaSparseSpec spec = testing::mla_sparse_spec(3, 2, 8, 64, 12, 48, 5);
  spec.block_size = spec.extra_block_size = 16;
  spec.extra_num_blocks = 6;
  spec.topk_length = spec.extra_topk_length = true;
  const MlaSparseProblem two = testing::make_mla_sparse_problem(spec);
  const MlaSparseProblem one = testing::merge_into_one_cache(two);
  const CpuRun a = run_cpu(two), b = run_cpu(one);
  ASSERT_EQ(a.o.size(), b.o.size());
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.o.size(); ++i) {
    ASSERT_TRUE(std::isfinite(a.o[i]) && std::isfinite(b.o[i])) << i;
    diff += (double{a.o[i]} - b.o[i]) * (double{a.o[i]} - b.o[i]);
    norm += double{b.o[i]} * b.o[i];
  }
  EXPECT_LT(std::sqrt(diff / norm), 4e-3);  // two bf16 roundings of the same fp64-summed values
  for (size_t i = 0; i < a.lse.size(); ++i) {
    if (std::isinf(b.lse[i]))
      EXPECT_EQ(a.lse[i], b.lse[i]) << i;
    else
      EXPECT_NEAR(a.lse[i], b.lse[i], 1e-5 * std::max(1.0f, std::fabs(b.lse[i]))) << i;
  }
  // And without the extra cache's rows the outputs differ: the test can fail.
  MlaSparseProblem main_only = two;
  main_only.spec.extra_topk = 0;
  main_only.relink();
  const CpuRun c = run_cpu(main_only);
  double changed = 0.0;
  for (size_t i = 0; i < a.o.size(); ++i) changed += std::fabs(double{a.o[i]} - c.o[i]);
  EXPECT_GT(changed, 1.0);
}

// The sink's effect, analytically: a sink of -inf changes nothing (bit for
// bit), a huge one drives o to 0, a sink equal to the query's lse halves o,
// and lse never includes it.
TEST(MlaSparse, TheSinkScalesOByItsShareOfTheDenominator) {
  MlaSparseSpec spec = testing::mla_sparse_spec(2, 1, 8, 50, 8, 20, 9);
  MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  const CpuRun none = run_cpu(pb);
  pb.sink.assign(8, -std::numeric_limits<float>::infinity());
  const CpuRun minus_inf = run_cpu(pb);
  EXPECT_EQ(std::memcmp(none.o.data(), minus_inf.o.data(), none.o.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(none.lse.data(), minus_inf.lse.data(), none.lse.size() * sizeof(float)), 0);
  for (float huge : {1e4f, std::numeric_limits<float>::infinity()}) {
    pb.sink.assign(8, huge);
    const CpuRun zero = run_cpu(pb);
    for (float x : zero.o) ASSERT_EQ(x, 0.0f) << "sink " << huge;
    EXPECT_EQ(std::memcmp(none.lse.data(), zero.lse.data(), none.lse.size() * sizeof(float)), 0);
  }
  // sink[h] = lse of query (b = 0, h): that query's o halves (the others' shrink by their own factor).
  pb.sink.assign(none.lse.begin(), none.lse.begin() + 8);
  const CpuRun half = run_cpu(pb);
  for (int32_t h = 0; h < 8; ++h) {
    for (int32_t i = 0; i < kMlaSparseHeadDimV; ++i) {
      const size_t at = static_cast<size_t>(h) * kMlaSparseHeadDimV + i;
      EXPECT_NEAR(half.o[at], none.o[at] / 2, 4e-3 * std::fabs(none.o[at]) + 1e-6) << h << ", " << i;
    }
  }
}

TEST(MlaSparse, QueriesThatAttendNothingGiveZeroAndPlusInfinity) {
  MlaSparseSpec spec = testing::mla_sparse_spec(2, 2, 4, 16, 8, 8, 11);
  spec.sink = true;
  MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  // Sequence 0: every id -1 in both caches; sequence 1, token 0: only -1 in the main cache.
  for (int32_t t = 0; t < 2; ++t) {
    std::fill_n(pb.cache.indices.begin() + t * 16, 16, -1);
    std::fill_n(pb.extra.indices.begin() + t * 8, 8, -1);
  }
  std::fill_n(pb.cache.indices.begin() + 2 * 16, 16, -1);
  const CpuRun run = run_cpu(pb);
  for (size_t query = 0; query < 2 * 2 * 4; ++query) {
    const bool empty = query < 8;
    if (empty) {
      EXPECT_TRUE(std::isinf(run.lse[query]) && run.lse[query] > 0) << query;
      for (int32_t i = 0; i < kMlaSparseHeadDimV; ++i) ASSERT_EQ(run.o[query * kMlaSparseHeadDimV + i], 0.0f) << query;
    } else {
      EXPECT_TRUE(std::isfinite(run.lse[query])) << query;
    }
  }
  EXPECT_EQ(testing::compare_mla_sparse(pb, testing::mla_sparse_reference(pb), run.o, run.lse, 1e-2, 1e-4), "");
  // topk_length 0 reads nothing either, whatever the ids say.
  pb.cache.topk_length = {0, 0};
  pb.extra.topk_length = {0, 0};
  pb.relink();
  const CpuRun none = run_cpu(pb);
  for (float x : none.lse) EXPECT_TRUE(std::isinf(x) && x > 0);
  for (float x : none.o) ASSERT_EQ(x, 0.0f);
}

TEST(MlaSparse, Float32QueriesOnTheCpu) {
  MlaSparseSpec spec;
  spec.num_heads = 4;
  spec.seed = 13;
  const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  const MlaSparsePlan plan = make_mla_sparse_plan(pb.shape(), testing::mla_sparse_cpu_machine());
  std::vector<float> q32(pb.q.size()), o(static_cast<size_t>(2 * 4 * 512), std::nanf("")), lse(8, std::nanf(""));
  to_float(DType::kBF16, pb.q.data(), q32.data(), q32.size());
  MlaSparseParams p = pb.host_params(o.data(), lse.data());
  p.dtype = DType::kF32;
  p.q = q32.data();
  std::vector<uint8_t> ws(plan.workspace.total);
  run_mla_sparse_cpu(p, plan, ws.data());
  EXPECT_EQ(testing::compare_mla_sparse(pb, testing::mla_sparse_reference(pb), o, lse, 1e-5, 1e-5), "");
}

TEST(MlaSparse, BadArgumentsAreNamed) {
  MlaSparseSpec spec = testing::mla_sparse_spec(2, 1, 4, 16, 4, 8, 17);
  spec.block_size = 8;
  spec.topk_length = true;
  const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  const MlaSparsePlan plan = make_mla_sparse_plan(pb.shape(), testing::mla_sparse_cpu_machine());
  std::vector<uint16_t> o(2 * 4 * 512);
  std::vector<float> lse(8);
  std::vector<uint8_t> ws(plan.workspace.total);
  const MlaSparseParams good = pb.host_params(o.data(), lse.data());
  run_mla_sparse_cpu(good, plan, ws.data());  // the baseline runs
  const auto fails = [&](const MlaSparseParams& p, const std::string& needle) {
    return testing::throws_error_naming([&] { run_mla_sparse_cpu(p, plan, ws.data()); }, needle);
  };
  // An id outside the pool (32 slots), in either cache, and a -2.
  MlaSparseProblem bad = pb;
  bad.cache.topk_length = {16, 16};
  bad.cache.indices[16 + 5] = 32;
  bad.relink();
  EXPECT_TRUE(fails(bad.host_params(o.data(), lse.data()), "indices[1, 0, 5] = 32 is outside the cache's 32 slots"));
  bad = pb;
  bad.extra.indices[3] = -2;
  bad.relink();
  EXPECT_TRUE(fails(bad.host_params(o.data(), lse.data()), "extra_indices[0, 0, 3] = -2"));
  // A bad id past topk_length is never read, so it is no error.
  bad = pb;
  bad.cache.topk_length = {3, 16};
  bad.cache.indices[10] = 1 << 30;
  bad.relink();
  EXPECT_NO_THROW(run_mla_sparse_cpu(bad.host_params(o.data(), lse.data()), plan, ws.data()));
  bad.cache.topk_length = {17, 16};
  bad.relink();
  EXPECT_TRUE(fails(bad.host_params(o.data(), lse.data()), "topk_length[0] = 17 must lie in [0, 16]"));
  // Row and block geometry.
  MlaSparseParams p = good;
  p.cache.row_stride = 640;
  EXPECT_TRUE(fails(p, "cache.row_stride = 640 bytes is smaller than the 656-byte V3.2 row"));
  p = good;
  p.cache.block_stride = 8 * 656 - 16;
  EXPECT_TRUE(fails(p, "cache.block_stride = 5232 bytes is smaller than the 5248 bytes"));
  p = good;
  p.format = MlaCacheFormat::kModel1;
  p.cache.block_stride = 8 * 584 - 1;
  p.extra.block_stride = 8 * 584;
  EXPECT_TRUE(fails(p, "cache.block_stride = 4671 bytes is smaller than the 4672 bytes a block of 8 model1 tokens"));
  // Shapes against the plan, null pointers, the extra cache's presence.
  p = good;
  p.num_heads = 8;
  EXPECT_TRUE(fails(p, "but the plan was made for 2, 1, 4"));
  p = good;
  p.cache.topk = 17;
  EXPECT_TRUE(fails(p, "cache.topk = 17 but the plan was made for 16"));
  p = good;
  p.extra = MlaSparseCache{};
  EXPECT_TRUE(fails(p, "the plan was made for an extra cache of topk 8 but extra.data is null"));
  p = good;
  p.cache.data = nullptr;
  EXPECT_TRUE(fails(p, "cache.data is null"));
  p = good;
  p.q = nullptr;
  EXPECT_TRUE(fails(p, "q is null"));
  p = good;
  p.scale = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(fails(p, "scale is not finite"));
  p = good;
  p.format = static_cast<MlaCacheFormat>(5);
  EXPECT_TRUE(fails(p, "format 5 is not an MlaCacheFormat"));
  EXPECT_TRUE(testing::throws_error_naming([&] { run_mla_sparse_cpu(good, plan, nullptr); }, "workspace is null"));
  // Query tokens must be heads apart (they are folded as requests).
  MlaSparseSpec two_tokens = spec;
  two_tokens.q_len = 2;
  const MlaSparseProblem pb2 = testing::make_mla_sparse_problem(two_tokens);
  const MlaSparsePlan plan2 = make_mla_sparse_plan(pb2.shape(), testing::mla_sparse_cpu_machine());
  std::vector<uint16_t> o2(2 * 2 * 4 * 512);
  std::vector<float> lse2(16);
  std::vector<uint8_t> ws2(plan2.workspace.total);
  p = pb2.host_params(o2.data(), lse2.data());
  p.q_token_stride += 8;
  EXPECT_TRUE(testing::throws_error_naming([&] { run_mla_sparse_cpu(p, plan2, ws2.data()); },
                                           "q_token_stride = 2312 must be num_heads * q_head_stride = 2304"));
}

TEST(MlaSparse, WhatCudaCannotRunIsNamed) {
  MlaSparseSpec spec;
  spec.num_heads = 4;
  spec.seed = 19;
  const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  std::vector<uint16_t> o(2 * 4 * 512);
  std::vector<float> lse(8);
  MlaSparseParams p = pb.host_params(o.data(), lse.data());
  p.format = MlaCacheFormat::kModel1;
  EXPECT_NE(cuda_mla_sparse_problem(p).find("MODEL1 caches (d_qk 512, 584 bytes a token) have no CUDA kernel"),
            std::string::npos);
  p = pb.host_params(o.data(), lse.data());
  p.dtype = DType::kF32;
  EXPECT_NE(cuda_mla_sparse_problem(p).find("q and o must be bf16 on CUDA, not f32"), std::string::npos);
  p = pb.host_params(o.data(), lse.data());
  p.cache.block_stride += 656;
  EXPECT_NE(cuda_mla_sparse_problem(p).find("cache.block_stride = 42640 bytes: the CUDA kernel reads a cache whose "
                                            "blocks follow each other without gaps"),
            std::string::npos)
      << cuda_mla_sparse_problem(p);
  p = pb.host_params(o.data(), lse.data());
  p.cache.row_stride = 664;
  p.cache.block_stride = 64 * 664;
  EXPECT_NE(cuda_mla_sparse_problem(p).find("cache.row_stride = 664 must be a multiple of 16 bytes on CUDA"),
            std::string::npos);
  // The epilogue scales o in 16-byte pieces: the decode's own layout check already asks for that.
  p = pb.host_params(o.data() + 2, lse.data());  // 4-byte aligned, not 16
  EXPECT_NE(cuda_mla_sparse_problem(p).find("o must be 16-byte aligned on CUDA"), std::string::npos)
      << cuda_mla_sparse_problem(p);
}

TEST(MlaSparse, EditedPlansAreRefused) {
  const MlaSparsePlan plan = make_mla_sparse_plan({3, 2, 8, 100, 40}, testing::mla_sparse_cpu_machine(32));
  EXPECT_NO_THROW(check_mla_sparse_plan(plan));
  EXPECT_EQ(plan.num_requests(), 6);
  EXPECT_EQ(plan.max_partials, 4 + 2);  // 100 tokens in chunks of 32, and 40
  MlaSparsePlan bad = plan;
  bad.extra.work[0].partial = bad.main.work[0].partial;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); },
                                           "outside request 0's merge range or already used"));
  bad = plan;
  bad.main.work[1].token_begin += 1;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "main.work[1] covers [33, 64)"));
  bad = plan;
  bad.workspace.total -= 256;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "overlaps or runs past"));
  bad = plan;
  bad.main.uniform_chunks = 1;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "no uniform split"));
  EXPECT_TRUE(testing::throws_error_naming(
      [&] {
        make_mla_sparse_plan({1, 1, 8, 0, 0}, testing::mla_sparse_cpu_machine());
      },
      "topk = 0 must be at least 1"));
}

TEST(MlaSparse, WithoutAnExtraCacheThePlanIsTheDecodesOwn) {
  // 100 ids in chunks of 32: every request split, merged by main's own lists.
  const MlaSparsePlan plan = make_mla_sparse_plan({3, 2, 8, 100, 0}, testing::mla_sparse_cpu_machine(32));
  EXPECT_NO_THROW(check_mla_sparse_plan(plan));
  EXPECT_TRUE(plan.direct());
  EXPECT_TRUE(plan.merge_indptr.empty() && plan.merge_requests.empty() && plan.extra.work.empty());
  EXPECT_EQ(plan.main.merge_requests.size(), 6u);
  EXPECT_EQ(plan.max_partials, 4);
  EXPECT_GE(plan.lse_scratch, plan.main.workspace.total);
  EXPECT_GE(plan.workspace.total, plan.lse_scratch + 6 * 8 * sizeof(float));
  // 16 ids in chunks of 32: no request split, every item writes o directly.
  const MlaSparsePlan whole = make_mla_sparse_plan({3, 2, 8, 16, 0}, testing::mla_sparse_cpu_machine(32));
  EXPECT_NO_THROW(check_mla_sparse_plan(whole));
  EXPECT_EQ(whole.num_partials, 0);
  for (const WorkItem& w : whole.main.work) EXPECT_LT(w.partial, 0);
  // On CUDA the first is finished by the decode's own merge, the second by
  // the epilogue; so is a plan that splits some requests and not others.
  EXPECT_TRUE(merge_writes_every_row(plan.main));
  EXPECT_FALSE(merge_writes_every_row(whole.main));
  PlanShape mixed_shape;
  mixed_shape.group_size = 8;
  mixed_shape.head_dim_v = kMlaSparseHeadDimV;
  mixed_shape.fixed_chunk_tokens = 32;
  const DecodePlan mixed = make_decode_plan({100, 16}, mixed_shape);
  ASSERT_EQ(mixed.merge_requests.size(), 1u);
  EXPECT_FALSE(merge_writes_every_row(mixed));

  MlaSparsePlan bad = plan;
  bad.merge_indptr = {0};
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "the plan's must be empty"));
  bad = plan;
  bad.lse_scratch = plan.main.workspace.total - 256;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "overlaps main's workspace"));
  bad = plan;
  bad.workspace.total -= 256;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "runs past workspace.total"));
  bad = plan;
  bad.lse_scratch += 4;  // a float's alignment, not the region's
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "is not a multiple of 256 bytes"));
  bad = plan;
  bad.max_partials = 6;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "disagree with main's"));
  bad = plan;
  bad.main.work[1].token_begin += 1;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "main: "));
  bad = plan;
  bad.main.seq_lens[0] = 99;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(bad); }, "main"));
  // A plan with an extra cache keeps no scratch.
  MlaSparsePlan with_extra = make_mla_sparse_plan({3, 2, 8, 100, 40}, testing::mla_sparse_cpu_machine(32));
  with_extra.lse_scratch = 256;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_mla_sparse_plan(with_extra); },
                                           "lse_scratch = 256 with an extra cache"));
}

}  // namespace
}  // namespace sparsepage
