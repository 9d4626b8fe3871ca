// The FlashMLA-shaped sparse decode on the GPU (mla_sparse.h) against the
// fp64 reference of FlashMLA's documented semantics and against its CPU
// twin: V3.2 caches at 16, 64 and 128 heads, one to three query tokens,
// topk 96 to 2048, -1 ids, topk_length, the extra cache, the attention sink,
// forced splits; the union rule, the sink's limits bit for bit, an
// out-of-range id flagged and confined to its query, a captured CUDA graph
// replayed over new ids and lengths, and what CUDA cannot run refused by
// name. Outputs and workspace start NaN; cache bytes no id reaches are NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/mla_sparse.h"
#include "support/expect_error.h"
#include "support/mla_sparse_problem.h"

namespace sparsepage {
namespace {

using testing::MlaSparseProblem;
using testing::MlaSparseSpec;

PlanShape cuda_machine(int32_t heads, int32_t fixed_chunk_tokens = 0) {
  const CudaLaunchShape launch = cuda_launch_shape(512, 512, 64, heads);
  PlanShape shape;
  shape.num_sms = cuda_multiprocessor_count();
  shape.items_per_sm = launch.ctas_per_sm;
  shape.ctas_per_item = launch.ctas_per_item;
  shape.fixed_chunk_tokens = fixed_chunk_tokens;
  return shape;
}

size_t queries(const MlaSparseProblem& pb) {
  return static_cast<size_t>(int64_t{pb.spec.batch} * pb.spec.q_len * pb.spec.num_heads);
}

// A problem's arrays in device memory.
struct DeviceMla {
  Buffer q, k, ids, len, ek, eids, elen, sink;

  explicit DeviceMla(const MlaSparseProblem& pb) {
    q = upload(Device::kCuda, pb.q);
    k = upload(Device::kCuda, pb.cache.bytes);
    ids = upload(Device::kCuda, pb.cache.indices);
    len = upload(Device::kCuda, pb.cache.topk_length);
    if (pb.spec.extra_topk > 0) {
      ek = upload(Device::kCuda, pb.extra.bytes);
      eids = upload(Device::kCuda, pb.extra.indices);
      elen = upload(Device::kCuda, pb.extra.topk_length);
    }
    sink = upload(Device::kCuda, pb.sink);
  }

  MlaSparseParams params(const MlaSparseProblem& pb, void* o, float* lse) const {
    MlaSparseParams p = pb.host_params(o, lse);
    p.q = q.data();
    p.cache.data = k.data();
    p.cache.indices = ids.as<int32_t>();
    p.cache.topk_length = pb.cache.topk_length.empty() ? nullptr : len.as<int32_t>();
    if (pb.spec.extra_topk > 0) {
      p.extra.data = ek.data();
      p.extra.indices = eids.as<int32_t>();
      p.extra.topk_length = pb.extra.topk_length.empty() ? nullptr : elen.as<int32_t>();
    }
    p.attn_sink = pb.sink.empty() ? nullptr : sink.as<float>();
    return p;
  }
};

struct MlaRun {
  std::vector<float> o, lse;
  uint32_t error_flag = 0;
  std::vector<uint32_t> lse_scratch;  // direct form, no lse array: the workspace's scratch rows as left
};

// Outputs and workspace poisoned (0xFF: NaN), the plan uploaded, one launch
// (with_lse false: no lse array passed, the lse read back stays poison).
MlaRun run_gpu(const MlaSparseProblem& pb, int32_t fixed_chunk_tokens = 0, bool with_lse = true) {
  const DeviceMla d(pb);
  const MlaSparsePlan plan = make_mla_sparse_plan(pb.shape(), cuda_machine(pb.spec.num_heads, fixed_chunk_tokens));
  Buffer o(Device::kCuda, queries(pb) * kMlaSparseHeadDimV * 2), lse(Device::kCuda, queries(pb) * sizeof(float));
  Buffer ws(Device::kCuda, plan.workspace.total);
  for (Buffer* b : {&o, &lse, &ws}) fill_bytes(b->data(), Device::kCuda, 0xFF, b->bytes());
  upload_mla_sparse_plan_cuda(plan, ws.data());
  run_mla_sparse_cuda(d.params(pb, o.data(), with_lse ? lse.as<float>() : nullptr), plan, ws.data());
  testing::cuda_ok(cudaDeviceSynchronize(), "mla_sparse");
  MlaRun run;
  run.o = testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  run.lse = download<float>(Device::kCuda, lse.data(), queries(pb));
  run.error_flag = read_mla_sparse_error_flag(plan, ws.data());
  if (plan.direct() && !with_lse) {
    run.lse_scratch =
        download<uint32_t>(Device::kCuda, static_cast<unsigned char*>(ws.data()) + plan.lse_scratch, queries(pb));
  }
  return run;
}

MlaRun run_cpu(const MlaSparseProblem& pb) {
  const MlaSparsePlan plan = make_mla_sparse_plan(pb.shape(), testing::mla_sparse_cpu_machine());
  std::vector<uint16_t> o(queries(pb) * kMlaSparseHeadDimV, 0xFFFF);
  MlaRun run;
  run.lse.assign(queries(pb), std::nanf(""));
  std::vector<uint8_t> ws(plan.workspace.total, 0xFF);
  run_mla_sparse_cpu(pb.host_params(o.data(), run.lse.data()), plan, ws.data());
  run.o = testing::as_float(DType::kBF16, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(o.data()),
                                                               reinterpret_cast<uint8_t*>(o.data() + o.size())));
  return run;
}

struct Case {
  int32_t heads, q_len, topk, extra_topk;
  bool sink, lengths;
  int32_t fixed_chunk_tokens;
};

TEST(MlaSparseCuda, V32MatchesTheReferenceAndTheCpu) {
  SKIP_WITHOUT_CUDA();
  const Case cases[] = {
      {128, 1, 2048, 0, false, false, 0},  // the DSA shape, one query token
      {128, 2, 2048, 128, true, true, 0},  // MTP, the extra cache, the sink, lengths
      {64, 2, 512, 64, true, true, 128},   // one head tile, forced splits
      {16, 3, 96, 40, true, true, 64},     // a part-filled head tile, topk off the 64-row tile
      {128, 1, 128, 0, true, true, 64},    // short rows split in two
  };
  for (const Case& c : cases) {
    MlaSparseSpec spec = testing::mla_sparse_spec(3, c.q_len, c.heads, c.topk, std::max(8, c.topk / 32), c.extra_topk,
                                                  static_cast<uint64_t>(c.heads * 100 + c.q_len * 10 + c.topk));
    spec.topk_length = spec.extra_topk_length = c.lengths;
    spec.extra_block_size = 64;
    spec.sink = c.sink;
    const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
    const std::string what = "heads " + std::to_string(c.heads) + ", q_len " + std::to_string(c.q_len) + ", topk " +
                             std::to_string(c.topk) + ", extra " + std::to_string(c.extra_topk) + ", fixed chunk " +
                             std::to_string(c.fixed_chunk_tokens);
    const MlaRun gpu = run_gpu(pb, c.fixed_chunk_tokens);
    EXPECT_EQ(gpu.error_flag, 0u) << what;
    const testing::MlaSparseReference ref = testing::mla_sparse_reference(pb);
    EXPECT_EQ(testing::compare_mla_sparse(pb, ref, gpu.o, gpu.lse, 1e-2, 1e-3), "") << what;
    const MlaRun cpu = run_cpu(pb);
    EXPECT_LT(testing::relative_l2(gpu.o, std::vector<double>(cpu.o.begin(), cpu.o.end())), 1e-2) << what;
  }
}

TEST(MlaSparseCuda, TheExtraCacheIsTheUnionOfBothSets) {
  SKIP_WITHOUT_CUDA();
  MlaSparseSpec spec = testing::mla_sparse_spec(4, 2, 128, 512, 16, 192, 41);
  spec.extra_block_size = 64;
  spec.extra_num_blocks = 6;
  spec.topk_length = spec.extra_topk_length = true;
  const MlaSparseProblem two = testing::make_mla_sparse_problem(spec);
  const MlaSparseProblem one = testing::merge_into_one_cache(two);
  const MlaRun a = run_gpu(two), b = run_gpu(one);
  EXPECT_LT(testing::relative_l2(a.o, std::vector<double>(b.o.begin(), b.o.end())), 1e-2);
  for (size_t i = 0; i < a.lse.size(); ++i) {
    if (std::isinf(b.lse[i]))
      EXPECT_EQ(a.lse[i], b.lse[i]) << i;
    else
      EXPECT_NEAR(a.lse[i], b.lse[i], 1e-3 * std::max(1.0f, std::fabs(b.lse[i]))) << i;
  }
  EXPECT_EQ(testing::compare_mla_sparse(two, testing::mla_sparse_reference(two), a.o, a.lse, 1e-2, 1e-3), "");
}

// Which kernel finishes the rows without an extra cache: the decode's own
// merge when every request is split, else the epilogue
// (merge_writes_every_row). The tests below take both; the sink test
// without an lse array also sees which ran (only the epilogue writes the
// lse scratch).
bool merge_finishes_every_row(const MlaSparseProblem& pb, int32_t fixed_chunk_tokens) {
  const MlaSparsePlan plan = make_mla_sparse_plan(pb.shape(), cuda_machine(pb.spec.num_heads, fixed_chunk_tokens));
  return plan.direct() && merge_writes_every_row(plan.main);
}

TEST(MlaSparseCuda, TheSinksLimitsBitForBit) {
  SKIP_WITHOUT_CUDA();
  // With an extra cache the plan's merge applies the sink; without one, the
  // decode's merge (every request split: chunks of 64) or the epilogue (none
  // split: one chunk of up to 4096 rows).
  for (int32_t extra_topk : {64, 0}) {
    for (int32_t fixed : {64, 4096}) {
      const std::string what = "extra_topk " + std::to_string(extra_topk) + ", fixed chunk " + std::to_string(fixed);
      MlaSparseProblem pb =
          testing::make_mla_sparse_problem(testing::mla_sparse_spec(2, 1, 128, 256, 8, extra_topk, 43));
      if (extra_topk == 0) {
        ASSERT_EQ(merge_finishes_every_row(pb, fixed), fixed == 64) << what;
      }
      const MlaRun none = run_gpu(pb, fixed);
      pb.sink.assign(128, -std::numeric_limits<float>::infinity());
      const MlaRun minus_inf = run_gpu(pb, fixed);
      EXPECT_EQ(std::memcmp(none.o.data(), minus_inf.o.data(), none.o.size() * sizeof(float)), 0) << what;
      EXPECT_EQ(std::memcmp(none.lse.data(), minus_inf.lse.data(), none.lse.size() * sizeof(float)), 0) << what;
      for (float huge : {1e4f, std::numeric_limits<float>::infinity()}) {
        pb.sink.assign(128, huge);
        const MlaRun zero = run_gpu(pb, fixed);
        for (float x : zero.o) ASSERT_EQ(x, 0.0f) << "sink " << huge << ", " << what;
        EXPECT_EQ(std::memcmp(none.lse.data(), zero.lse.data(), none.lse.size() * sizeof(float)), 0) << what;
      }
    }
  }
}

TEST(MlaSparseCuda, ASinkWithoutAnLseArrayScalesTheSame) {
  SKIP_WITHOUT_CUDA();
  // Without an extra cache the epilogue's sink factor needs each row's
  // lse: with no lse array it comes from the plan's scratch (lse_scratch);
  // the decode's merge needs none. Requests all split (the merge), none
  // split and the plan's own choice, against the same run with an lse
  // array, bit for bit.
  for (int32_t fixed : {0, 64, 4096}) {
    MlaSparseSpec spec = testing::mla_sparse_spec(3, 2, 64, 256, 16, 0, static_cast<uint64_t>(59 + fixed));
    spec.sink = spec.topk_length = true;
    const MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
    if (fixed != 0) {
      ASSERT_EQ(merge_finishes_every_row(pb, fixed), fixed == 64) << "fixed " << fixed;
    }
    const MlaRun with = run_gpu(pb, fixed), without = run_gpu(pb, fixed, false);
    ASSERT_EQ(with.o.size(), without.o.size());
    // The scratch was poisoned (0xFF) with the workspace: the merge form
    // leaves it so, the epilogue form fills it with the rows' lse.
    if (fixed != 0) {
      const bool untouched = std::all_of(without.lse_scratch.begin(), without.lse_scratch.end(),
                                         [](uint32_t w) { return w == 0xFFFFFFFFu; });
      const bool all_written = std::none_of(without.lse_scratch.begin(), without.lse_scratch.end(),
                                            [](uint32_t w) { return w == 0xFFFFFFFFu; });
      EXPECT_TRUE(fixed == 64 ? untouched : all_written) << "fixed " << fixed;
    }
    EXPECT_EQ(std::memcmp(with.o.data(), without.o.data(), with.o.size() * sizeof(float)), 0) << "fixed " << fixed;
    EXPECT_EQ(without.error_flag, 0u);
    const testing::MlaSparseReference ref = testing::mla_sparse_reference(pb);
    EXPECT_EQ(testing::compare_mla_sparse(pb, ref, with.o, with.lse, 1e-2, 1e-3), "") << "fixed " << fixed;
  }
}

TEST(MlaSparseCuda, AnOutOfRangeIdIsFlaggedAndPoisonsOnlyItsQuery) {
  SKIP_WITHOUT_CUDA();
  MlaSparseProblem pb = testing::make_mla_sparse_problem(testing::mla_sparse_spec(3, 2, 64, 128, 4, 32, 47));
  pb.extra.indices[(1 * 2 + 1) * 32 + 5] =
      static_cast<int32_t>(pb.extra.slots());  // (b 1, t 1): one past the extra pool
  pb.relink();
  const MlaRun run = run_gpu(pb);
  EXPECT_NE(run.error_flag, 0u);
  const size_t dv = kMlaSparseHeadDimV;
  for (size_t query = 0; query < queries(pb); ++query) {
    const bool bad = query / 64 == 3;  // request (b 1, t 1)
    EXPECT_EQ(std::isnan(run.lse[query]), bad) << query;
    EXPECT_EQ(std::isnan(run.o[query * dv]), bad) << query;
  }
}

TEST(MlaSparseCuda, ACapturedGraphFollowsNewIdsAndLengths) {
  SKIP_WITHOUT_CUDA();
  MlaSparseSpec spec = testing::mla_sparse_spec(4, 2, 128, 1024, 40, 128, 53);
  spec.topk_length = spec.extra_topk_length = true;
  spec.sink = true;
  MlaSparseProblem pb = testing::make_mla_sparse_problem(spec);
  DeviceMla d(pb);
  const MlaSparsePlan plan = make_mla_sparse_plan(pb.shape(), cuda_machine(spec.num_heads));
  Buffer o(Device::kCuda, queries(pb) * kMlaSparseHeadDimV * 2), lse(Device::kCuda, queries(pb) * sizeof(float));
  Buffer ws(Device::kCuda, plan.workspace.total);
  testing::StreamGraph graph;
  cudaStream_t stream = graph.stream();
  upload_mla_sparse_plan_cuda(plan, ws.data(), stream);
  const MlaSparseParams params = d.params(pb, o.data(), lse.as<float>());
  run_mla_sparse_cuda(params, plan, ws.data(), stream);  // eager first: the launch-once setup outside capture
  testing::cuda_ok(cudaStreamSynchronize(stream), "eager");
  graph.capture([&](cudaStream_t s) { run_mla_sparse_cuda(params, plan, ws.data(), s); });
  for (int step = 0; step < 3; ++step) {
    // New ids and lengths for the step, written where the graph reads them.
    MlaSparseSpec next = spec;
    next.seed = spec.seed + 1 + static_cast<uint64_t>(step);
    MlaSparseProblem fresh = testing::make_mla_sparse_problem(next);
    pb.q = fresh.q;
    pb.cache = fresh.cache;
    pb.extra = fresh.extra;
    pb.relink();
    const DeviceMla nd(pb);
    for (auto [dst, src] : {std::pair{&d.q, &nd.q},
                            {&d.k, &nd.k},
                            {&d.ids, &nd.ids},
                            {&d.len, &nd.len},
                            {&d.ek, &nd.ek},
                            {&d.eids, &nd.eids},
                            {&d.elen, &nd.elen}}) {
      copy_bytes(dst->data(), Device::kCuda, src->data(), Device::kCuda, src->bytes());
    }
    fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
    graph.replay();
    const std::vector<float> got_o =
        testing::as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
    const std::vector<float> got_lse = download<float>(Device::kCuda, lse.data(), queries(pb));
    EXPECT_EQ(testing::compare_mla_sparse(pb, testing::mla_sparse_reference(pb), got_o, got_lse, 1e-2, 1e-3), "")
        << "replay " << step;
    const MlaRun eager = run_gpu(pb);
    EXPECT_EQ(std::memcmp(eager.o.data(), got_o.data(), got_o.size() * sizeof(float)), 0) << "replay " << step;
  }
  EXPECT_EQ(read_mla_sparse_error_flag(plan, ws.data(), stream), 0u);
}

TEST(MlaSparseCuda, WhatCudaCannotRunIsRefusedByName) {
  SKIP_WITHOUT_CUDA();
  MlaSparseSpec spec;
  spec.format = MlaCacheFormat::kModel1;
  spec.num_heads = 64;
  spec.seed = 59;
  const MlaSparseProblem m1 = testing::make_mla_sparse_problem(spec);
  const MlaSparsePlan plan = make_mla_sparse_plan(m1.shape(), cuda_machine(64));
  Buffer o(Device::kCuda, queries(m1) * kMlaSparseHeadDimV * 2), lse(Device::kCuda, queries(m1) * sizeof(float));
  Buffer ws(Device::kCuda, plan.workspace.total);
  upload_mla_sparse_plan_cuda(plan, ws.data());
  const DeviceMla d1(m1);
  EXPECT_TRUE(testing::throws_error_naming(
      [&] { run_mla_sparse_cuda(d1.params(m1, o.data(), lse.as<float>()), plan, ws.data()); },
      "MODEL1 caches (d_qk 512, 584 bytes a token) have no CUDA kernel"));
  spec.format = MlaCacheFormat::kV32;
  spec.block_pad = 656;
  const MlaSparseProblem padded = testing::make_mla_sparse_problem(spec);
  const DeviceMla d2(padded);
  EXPECT_TRUE(testing::throws_error_naming(
      [&] { run_mla_sparse_cuda(d2.params(padded, o.data(), lse.as<float>()), plan, ws.data()); },
      "cache.block_stride = 42640 bytes: the CUDA kernel reads a cache whose blocks follow each other without gaps"));
}

}  // namespace
}  // namespace sparsepage
