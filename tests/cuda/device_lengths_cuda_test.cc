// Lengths the kernels read on the device, set to every value an int32 can
// hold that lies outside its range (docs/RELIABILITY.md, "what is checked
// where"): no value of one request's length may touch another request's
// output or read outside the pool. The request that carries it (every
// request of its sequence, for a per-sequence length) comes out NaN, the
// others match fp64, and the error flag names the first of them
// (read_decode_errors) with both kinds. The same through each kernel family
// that reads a device length: the 16-row tiles (merge kernel and cluster
// merge), the MLA kernel (bf16 and FP8), the mask path, window addressing
// through SparseDecoder, the block and DSA indexers, and the cache append.
#include <cuda_runtime.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_hooks.h"
#include "cuda/cuda_test_util.h"
#include "models/block_sparse_kernels.h"
#include "sparsepage/cache.h"
#include "sparsepage/fp8.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/sparse_decode.h"
#include "support/engine_problem.h"
#include "support/expect_error.h"
#include "support/fp8_problem.h"

namespace sparsepage::testing {
namespace {

constexpr int32_t kIntMin = std::numeric_limits<int32_t>::min();
constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();

struct EngineRun {
  EngineOutput out;
  DecodeErrors errors;
};

// Runs an engine problem on the GPU with its lens replaced by `lens`.
EngineRun run_engine(const EngineProblem& pb, const std::vector<int32_t>& lens, int32_t chunk) {
  const Buffer q = upload(Device::kCuda, pb.q_buf);
  const Buffer k = upload(Device::kCuda, pb.k_pool);
  const Buffer v = pb.spec.mla ? Buffer() : upload(Device::kCuda, pb.v_pool);
  const Buffer indices = upload(Device::kCuda, pb.indices);
  const Buffer d_lens = upload(Device::kCuda, lens);
  const Buffer table = pb.block_table.empty() ? Buffer() : upload(Device::kCuda, pb.block_table);
  const Buffer rows = pb.row_of_sequence.empty() ? Buffer() : upload(Device::kCuda, pb.row_of_sequence);
  Buffer o(Device::kCuda, static_cast<size_t>(pb.o_elements) * dtype_size(pb.spec.dtype));
  Buffer lse(Device::kCuda, static_cast<size_t>(pb.num_requests()) * pb.spec.group_size * sizeof(float));
  fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
  fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  EngineArrays a;
  a.q = q.data();
  if (pb.dim_extra > 0) a.q_extra = static_cast<const char*>(q.data()) + pb.q_offset_extra * 2;
  a.k = k.data();
  a.v = pb.spec.mla ? k.data() : v.data();
  a.indices = indices.as<int32_t>();
  a.lens = d_lens.as<int32_t>();
  a.block_table = table.empty() ? nullptr : table.as<int32_t>();
  a.row_of_sequence = rows.empty() ? nullptr : rows.as<int32_t>();
  a.o = o.data();
  a.lse = lse.as<float>();
  const DecodePlan plan = pb.plan(cuda_plan_shape(pb.spec.group_size, pb.dim_v, chunk));
  Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
  fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());
  upload_plan_cuda(plan, ws.data());
  run_decode_cuda(pb.params(a), plan, ws.data());
  cuda_ok(cudaDeviceSynchronize(), "decode");
  EngineRun r;
  r.out = unpack_output(pb, download<uint8_t>(Device::kCuda, o.data(), o.bytes()),
                        download<float>(Device::kCuda, lse.data(), lse.bytes() / sizeof(float)));
  r.errors = read_decode_errors(plan, ws.data());
  return r;
}

// Requests in `poisoned` are NaN everywhere (o and lse); every other one
// matches fp64 per head; a strided o's gaps are untouched.
void expect_poisoned_exactly(const EngineProblem& pb, const EngineRun& got, const std::vector<int32_t>& poisoned,
                             const std::string& what) {
  const EngineReference ref = engine_reference(pb);
  const size_t G = size_t(pb.spec.group_size), dv = size_t(pb.dim_v);
  EXPECT_TRUE(got.out.gaps_untouched) << what << ": a gap of o was written";
  for (int32_t r = 0; r < pb.num_requests(); ++r) {
    const bool bad = std::find(poisoned.begin(), poisoned.end(), r) != poisoned.end();
    for (size_t g = 0; g < G; ++g) {
      const size_t row = size_t(r) * G + g;
      const std::vector<float> o(got.out.o.begin() + std::ptrdiff_t(row * dv),
                                 got.out.o.begin() + std::ptrdiff_t((row + 1) * dv));
      if (bad) {
        size_t finite = std::isnan(got.out.lse[row]) ? 0 : 1;
        for (float x : o) finite += std::isnan(x) ? 0 : 1;
        ASSERT_EQ(finite, 0u) << what << ": request " << r << " head " << g << " must be NaN";
        continue;
      }
      const std::vector<double> want(ref.o.begin() + std::ptrdiff_t(row * dv),
                                     ref.o.begin() + std::ptrdiff_t((row + 1) * dv));
      if (std::isinf(ref.lse[row])) {
        EXPECT_TRUE(std::isinf(got.out.lse[row]) && got.out.lse[row] < 0) << what << ": request " << r;
        continue;
      }
      ASSERT_LT(relative_l2(o, want), 2e-2) << what << ": request " << r << " head " << g << " (another request's "
                                            << "length must not change it)";
      ASSERT_NEAR(got.out.lse[row], ref.lse[row], 2e-2) << what << ": request " << r << " head " << g;
    }
  }
}

void expect_named(const DecodeErrors& e, int32_t first, const std::string& what) {
  EXPECT_EQ(e.kinds, kDecodeErrorRejected | kDecodeErrorLength) << what;
  EXPECT_EQ(e.first_request, first) << what;
}

EngineSpec gqa_block_pages() {
  EngineSpec s;
  s.mla = false;
  s.num_seqs = 5;
  s.num_kv_heads = 4;
  s.group_size = 4;
  s.head_dim = 128;
  s.block_size = 16;
  s.num_blocks = 200;
  s.index = EngineIndex::kBlockPages;
  s.context = 20 * 16 + 3;
  s.strided_qo = true;
  return s;
}

// The case the adversarial pass met: a GQA engine batch whose per-sequence
// length (SeqLensIndex::kPerSequence) is negative for one sequence once
// turned other requests' outputs NaN. Sequence 2's four requests (8..11)
// must be the only ones poisoned, for every out-of-range value, split over
// the merge kernel, over clusters (the launch takes clusters of 2 for
// uniform splits in two) and unsplit.
TEST(DeviceLengthsCuda, APerSequenceLengthPoisonsOnlyItsSequence) {
  SKIP_WITHOUT_CUDA();
  const EngineProblem pb = make_engine_problem(gqa_block_pages(), 61);
  ASSERT_EQ(pb.lens.size(), 5u);
  const int32_t planned = pb.plan_counts[8];
  for (const int32_t bad : {-1, kIntMin, kIntMin + 1, planned + 1, kIntMax}) {
    std::vector<int32_t> lens = pb.lens;
    lens[2] = bad;
    for (const int32_t chunk : {64, 0, 1 << 20}) {
      const std::string what = "seq_lens[2] = " + std::to_string(bad) + ", chunk " + std::to_string(chunk);
      const EngineRun got = run_engine(pb, lens, chunk);
      expect_poisoned_exactly(pb, got, {8, 9, 10, 11}, what);
      expect_named(got.errors, 8, what);
    }
  }
  // Every length in range (the batch as made): nothing is flagged.
  EXPECT_EQ(run_engine(pb, pb.lens, 64).errors.kinds, 0u);
}

// Per-request lengths (the DSA top-k lengths) on the MLA kernel: one bad
// request among five.
TEST(DeviceLengthsCuda, APerRequestLengthPoisonsOnlyItsRequestOnTheMlaKernel) {
  SKIP_WITHOUT_CUDA();
  if (!cuda_arch_problem(cuda_device_sm(), 512, 512, 64).empty()) GTEST_SKIP() << "no MLA kernel for this GPU";
  EngineSpec s;
  s.num_seqs = 5;
  s.group_size = 64;
  s.block_size = 64;
  s.num_blocks = 64;
  s.index = EngineIndex::kSlotIds;
  s.topk = quick_mode() ? 128 : 300;
  s.lengths = true;
  const EngineProblem pb = make_engine_problem(s, 62);
  for (const int32_t bad : {-1, kIntMin, s.topk + 1}) {
    std::vector<int32_t> lens = pb.lens;
    lens[3] = bad;
    for (const int32_t chunk : {64, 0}) {
      const std::string what = "seq_lens[3] = " + std::to_string(bad) + ", chunk " + std::to_string(chunk);
      const EngineRun got = run_engine(pb, lens, chunk);
      expect_poisoned_exactly(pb, got, {3}, what);
      expect_named(got.errors, 3, what);
    }
  }
}

// The FP8 MLA kernels read the same lengths: request 1 of three poisoned.
TEST(DeviceLengthsCuda, TheFp8MlaKernelsPoisonOnlyTheBadRequest) {
  SKIP_WITHOUT_CUDA();
  if (!cuda_arch_problem(cuda_device_sm(), 512, 512, 64).empty()) GTEST_SKIP() << "no MLA kernel for this GPU";
  for (const int32_t heads : {128, 16}) {
    std::mt19937_64 rng(63);
    ProblemSpec spec;
    spec.seq_lens = {300, 200, 77};
    spec.group_size = heads;
    spec.dim_qk = spec.dim_v = 512;
    spec.dim_extra = 64;
    spec.v_aliases_k = true;
    spec.pool_pages = 2048;
    const PagedProblem pb = make_problem(spec, rng);
    Fp8Problem f = make_fp8_mla(pb);
    f.round_to_bf16 = true;
    const Reference ref = reference_attention(f);
    for (const int32_t bad : {-7, kIntMin, 201}) {
      std::vector<int32_t> lens = pb.table.seq_lens;
      lens[1] = bad;
      const Buffer k = upload(Device::kCuda, f.k);
      const Buffer indptr = upload(Device::kCuda, pb.table.indptr);
      const Buffer indices = upload(Device::kCuda, pb.indices);
      const Buffer d_lens = upload(Device::kCuda, lens);
      const Buffer q = upload(Device::kCuda, pb.q);
      const Buffer qe = upload(Device::kCuda, pb.q_extra);
      Buffer o(Device::kCuda, o_count(pb) * 2), lse(Device::kCuda, lse_count(pb) * 4);
      fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
      fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
      DecodeParams p = f.host_params(o.data(), lse.as<float>());
      const MlaFp8Views views = mla_fp8_views(k.data(), pb.pool_rows(), f.k_row_bytes);
      p.k = views.k;
      p.v = views.v;
      p.k_extra = views.k_extra;
      p.indptr = indptr.as<int32_t>();
      p.indices = indices.as<int32_t>();
      p.first_page_offset = nullptr;
      p.seq_lens = d_lens.as<int32_t>();
      p.q = q.data();
      p.q_extra = qe.data();
      const DecodePlan plan = make_decode_plan(pb.table.seq_lens, cuda_plan_shape(heads, 512, 64));
      Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
      upload_plan_cuda(plan, ws.data());
      run_decode_cuda(p, plan, ws.data());
      cuda_ok(cudaDeviceSynchronize(), "fp8 decode");
      const std::vector<float> got_o = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
      const std::vector<float> got_lse = download<float>(Device::kCuda, lse.data(), lse_count(pb));
      const std::string what = std::to_string(heads) + " heads, seq_lens[1] = " + std::to_string(bad);
      const size_t per = size_t(heads) * 512;
      for (int r = 0; r < 3; ++r) {
        const std::vector<float> o_r(got_o.begin() + r * std::ptrdiff_t(per),
                                     got_o.begin() + (r + 1) * std::ptrdiff_t(per));
        if (r == 1) {
          size_t finite = 0;
          for (float x : o_r) finite += std::isnan(x) ? 0 : 1;
          for (int g = 0; g < heads; ++g) finite += std::isnan(got_lse[size_t(heads + g)]) ? 0 : 1;
          EXPECT_EQ(finite, 0u) << what;
        } else {
          const std::vector<double> want(ref.o.begin() + r * std::ptrdiff_t(per),
                                         ref.o.begin() + (r + 1) * std::ptrdiff_t(per));
          EXPECT_LT(relative_l2(o_r, want), 1e-2) << what << ", request " << r;
        }
      }
      expect_named(read_decode_errors(plan, ws.data()), 1, what);
    }
  }
}

// Window addressing through the entry point a layer calls: live_lens may
// grow past live_len up to the cache's capacity (a captured step replayed
// while the context grows) and read exactly those rows; past the capacity,
// or negative, the sequence is poisoned and check_errors names it.
TEST(DeviceLengthsCuda, LiveLensPastTheCapacityAreFlaggedNotRead) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(64);
  const int32_t batch = 3, kv_heads = 2, group = 8, dim = 128;
  const int64_t cap = 256, live = 200;
  // Rows below 240 hold values; rows at 240 and past are NaN.
  std::vector<uint8_t> k = random_values(DType::kBF16, size_t(batch) * kv_heads * cap * dim, rng);
  std::vector<uint8_t> v = random_values(DType::kBF16, size_t(batch) * kv_heads * cap * dim, rng);
  const std::vector<uint8_t> nan_row = nan_values(DType::kBF16, dim);
  for (int64_t bh = 0; bh < batch * kv_heads; ++bh) {
    for (int64_t t = 240; t < cap; ++t) {
      std::copy(nan_row.begin(), nan_row.end(), k.begin() + std::ptrdiff_t((bh * cap + t) * dim * 2));
      std::copy(nan_row.begin(), nan_row.end(), v.begin() + std::ptrdiff_t((bh * cap + t) * dim * 2));
    }
  }
  const std::vector<uint8_t> q = random_values(DType::kBF16, size_t(batch) * kv_heads * group * dim, rng);
  const Buffer dk = upload(Device::kCuda, k), dv = upload(Device::kCuda, v), dq = upload(Device::kCuda, q);
  Buffer o(Device::kCuda, size_t(batch) * kv_heads * group * dim * 2);
  SparseAttentionInputs in;
  in.device = Device::kCuda;
  in.batch = batch;
  in.num_qo_heads = kv_heads * group;
  in.num_kv_heads = kv_heads;
  in.live_len = live;
  in.k = RowView::dense(dk.data(), kv_heads, cap, dim);
  in.v = RowView::dense(dv.data(), kv_heads, cap, dim);
  in.q = dq.data();
  in.o = o.data();
  in.scale = 0.088f;
  DispatchConfig config;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCuda, config);
  // Every request selects positions 0, 100 and 230 (230 lies past live_len).
  const SparseSelection sel = make_selection(Device::kCuda, std::vector<std::vector<int32_t>>(6, {0, 100, 230}));
  for (const int32_t bad : {257, -1, kIntMin, kIntMax}) {
    const Buffer lens = upload(Device::kCuda, std::vector<int32_t>{240, bad, 240});
    in.live_lens = lens.as<int32_t>();
    fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
    ASSERT_TRUE(decoder.try_fused(in, sel).fused());
    const std::string what = "live_lens[1] = " + std::to_string(bad);
    EXPECT_TRUE(throws_error_naming([&] { decoder.check_errors(); }, "request 2 (sequence 1, KV head 0)")) << what;
    const std::vector<float> out = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
    const size_t per_seq = size_t(kv_heads) * group * dim;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(std::isnan(out[i]), i / per_seq == 1) << what << ": element " << i;
    }
  }
  // 240 rows each, past live_len and inside the capacity: read, flag clear.
  const Buffer grown = upload(Device::kCuda, std::vector<int32_t>{240, 240, 240});
  in.live_lens = grown.as<int32_t>();
  ASSERT_TRUE(decoder.try_fused(in, sel).fused());
  EXPECT_NO_THROW(decoder.check_errors());
  const std::vector<float> out = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  for (float x : out) ASSERT_FALSE(std::isnan(x));
}

// The mask path reads live_lens too: a sequence whose length lies outside
// [0, live_len] is NaN (the mask path has no flag), the others are not.
TEST(DeviceLengthsCuda, MaskPathPoisonsASequenceWithALengthOutOfRange) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(65);
  const int32_t batch = 3, kv_heads = 2, group = 4, dim = 64;
  const int64_t cap = 300;
  const std::vector<uint8_t> k = random_values(DType::kBF16, size_t(batch) * kv_heads * cap * dim, rng);
  const std::vector<uint8_t> q = random_values(DType::kBF16, size_t(batch) * kv_heads * group * dim, rng);
  const Buffer dk = upload(Device::kCuda, k), dq = upload(Device::kCuda, q);
  Buffer o(Device::kCuda, size_t(batch) * kv_heads * group * dim * 2);
  MaskedDecodeParams m;
  m.batch = batch;
  m.num_kv_heads = kv_heads;
  m.group_size = group;
  m.live_len = cap;
  m.q = dq.data();
  m.k = RowView::dense(dk.data(), kv_heads, cap, dim);
  m.v = m.k;
  m.o = o.data();
  m.scale = 0.125f;
  Buffer ws(Device::kCuda, std::max<size_t>(256, masked_decode_workspace_bytes(m, cuda_multiprocessor_count())));
  for (const int32_t bad : {int32_t(cap) + 1, -1, kIntMin}) {
    const Buffer lens = upload(Device::kCuda, std::vector<int32_t>{int32_t(cap), 17, bad});
    m.live_lens = lens.as<int32_t>();
    fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
    run_masked_decode_cuda(m, ws.data());
    cuda_ok(cudaDeviceSynchronize(), "masked decode");
    const std::vector<float> out = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
    const size_t per_seq = size_t(kv_heads) * group * dim;
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(std::isnan(out[i]), i / per_seq == 2) << "live_lens[2] = " << bad << ": element " << i;
    }
  }
}

// The block indexer: a length past the bound its scores were sized for
// would read past its score row and write before its id row. That
// sequence's rows are -1 with count -1 (which the decode flags); the other
// sequences' rows are what they are with the length in range.
TEST(DeviceLengthsCuda, TheBlockIndexerMarksALengthOutOfRange) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(66);
  const int32_t batch = 3, heads = 2, dim = 64, block = 16, topk = 4, width = topk + 1;
  const int64_t cap = 400, max_kv_len = 320;
  std::vector<float> keys(size_t(batch) * (heads + 1) * cap * dim);
  std::vector<float> qi(size_t(batch) * heads * dim);
  std::uniform_int_distribution<int> small(-3, 3);
  for (float& x : keys) x = float(small(rng));
  for (float& x : qi) x = float(small(rng));
  std::vector<uint8_t> kb(keys.size() * 2), qb(qi.size() * 2);
  from_float(DType::kBF16, keys.data(), kb.data(), keys.size());
  from_float(DType::kBF16, qi.data(), qb.data(), qi.size());
  const Buffer dk = upload(Device::kCuda, kb), dq = upload(Device::kCuda, qb);
  Buffer ids(Device::kCuda, size_t(batch) * heads * width * 4), counts(Device::kCuda, size_t(batch) * heads * 4);
  Buffer ws(Device::kCuda, detail::block_indexer_workspace_bytes(batch, heads, max_kv_len, block));
  auto run = [&](const std::vector<int32_t>& lens) {
    const Buffer d_lens = upload(Device::kCuda, lens);
    detail::BlockIndexerArgs a;
    a.k_alloc = dk.data();
    a.index_q = dq.data();
    a.batch = batch;
    a.num_kv_heads = heads;
    a.head_dim = dim;
    a.capacity = cap;
    a.kv_lens = d_lens.as<int32_t>();
    a.max_kv_len = max_kv_len;
    a.block_size = block;
    a.topk = topk;
    a.local_blocks = 1;
    a.width = width;
    a.block_ids = ids.as<int32_t>();
    a.seq_lens = counts.as<int32_t>();
    a.workspace = ws.data();
    a.workspace_bytes = ws.bytes();
    fill_bytes(ids.data(), Device::kCuda, 0x55, ids.bytes());
    fill_bytes(counts.data(), Device::kCuda, 0x55, counts.bytes());
    detail::block_indexer_cuda(a, nullptr);
    cuda_ok(cudaDeviceSynchronize(), "block indexer");
    return std::make_pair(download<int32_t>(Device::kCuda, ids.data(), ids.bytes() / 4),
                          download<int32_t>(Device::kCuda, counts.data(), counts.bytes() / 4));
  };
  const auto good = run({300, 150, 200});
  for (const int32_t bad : {int32_t(max_kv_len) + 1, int32_t(cap), -1, kIntMin, kIntMax}) {
    const auto got = run({300, 150, bad});
    for (int32_t r = 0; r < batch * heads; ++r) {
      for (int32_t i = 0; i < width; ++i) {
        const size_t at = size_t(r * width + i);
        if (r / heads == 2)
          EXPECT_EQ(got.first[at], -1) << "kv_lens[2] = " << bad << ", request " << r;
        else
          EXPECT_EQ(got.first[at], good.first[at]) << "kv_lens[2] = " << bad << ", request " << r;
      }
      EXPECT_EQ(got.second[size_t(r)], r / heads == 2 ? -1 : good.second[size_t(r)]) << "kv_lens[2] = " << bad;
    }
  }
}

// The DSA indexer: the same for a kv_lens entry outside [0, max_kv_len]:
// its row is all -1 and its count -1; the other rows are unchanged.
TEST(DeviceLengthsCuda, TheDsaIndexerMarksALengthOutOfRange) {
  SKIP_WITHOUT_CUDA();
  if (cuda_device_sm() != 90) GTEST_SKIP() << "the DSA indexer's score kernel needs sm_90";
  std::mt19937_64 rng(67);
  DsaConfig c{1, 64, 64, 8, 64, 32, 0.0f, 64};
  const int32_t batch = 3;
  const int64_t cap = 600, max_kv_len = 500;
  std::vector<float> k(size_t(batch) * cap * (c.latent_dim + c.index_head_dim));
  std::vector<float> qi(size_t(batch) * c.index_heads * c.index_head_dim), w(size_t(batch) * c.index_heads);
  std::uniform_int_distribution<int> small(-3, 3);
  for (float& x : k) x = float(small(rng));
  for (float& x : qi) x = float(small(rng));
  for (float& x : w) x = float(small(rng) + 4);
  std::vector<uint8_t> kb(k.size() * 2), qb(qi.size() * 2);
  from_float(DType::kBF16, k.data(), kb.data(), k.size());
  from_float(DType::kBF16, qi.data(), qb.data(), qi.size());
  const Buffer dk = upload(Device::kCuda, kb), dq = upload(Device::kCuda, qb), dw = upload(Device::kCuda, w);
  Buffer ws(Device::kCuda, dsa_indexer_workspace_bytes(c, batch, max_kv_len));
  Buffer positions(Device::kCuda, size_t(batch) * c.index_topk * 4), counts(Device::kCuda, size_t(batch) * 4);
  auto run = [&](const std::vector<int32_t>& lens) {
    const Buffer d_lens = upload(Device::kCuda, lens);
    DsaIndexerArgs a;
    a.k_cache = dk.data();
    a.capacity = cap;
    a.kv_lens = d_lens.as<int32_t>();
    a.max_kv_len = max_kv_len;
    a.q_index = dq.data();
    a.weights = dw.as<float>();
    a.workspace = ws.data();
    a.workspace_bytes = ws.bytes();
    a.positions = positions.as<int32_t>();
    a.counts = counts.as<int32_t>();
    fill_bytes(positions.data(), Device::kCuda, 0x55, positions.bytes());
    fill_bytes(counts.data(), Device::kCuda, 0x55, counts.bytes());
    dsa_select_tokens_cuda(c, batch, a);
    cuda_ok(cudaDeviceSynchronize(), "dsa indexer");
    return std::make_pair(download<int32_t>(Device::kCuda, positions.data(), positions.bytes() / 4),
                          download<int32_t>(Device::kCuda, counts.data(), counts.bytes() / 4));
  };
  const auto good = run({500, 20, 300});
  for (const int32_t bad : {int32_t(max_kv_len) + 1, int32_t(cap) + 1, -1, kIntMin, kIntMax}) {
    const auto got = run({500, bad, 300});
    for (int32_t b = 0; b < batch; ++b) {
      EXPECT_EQ(got.second[size_t(b)], b == 1 ? -1 : good.second[size_t(b)]) << "kv_lens[1] = " << bad;
      for (int32_t i = 0; i < c.index_topk; ++i) {
        const size_t at = size_t(b * c.index_topk + i);
        EXPECT_EQ(got.first[at], b == 1 ? -1 : good.first[at]) << "kv_lens[1] = " << bad << ", row " << b;
      }
    }
  }
}

// The serving append: a device length with no room (a captured step
// replayed past the reserved capacity, or a stale value) writes nothing and
// leaves -1, which sync_live_len names; the other sequences append.
TEST(DeviceLengthsCuda, AnAppendWithoutRoomWritesNothingAndSaysSo) {
  SKIP_WITHOUT_CUDA();
  DenseKVCache cache(Device::kCuda, CacheMode::kBF16, 3, 1, 1, 8, 8, 16);
  cache.reserve(16);
  std::vector<uint16_t> row(3 * 8, float_to_bf16(1.0f));
  const Buffer k_new = upload(Device::kCuda, row), v_new = upload(Device::kCuda, row);
  cache.append_token(k_new.data(), v_new.data());  // every sequence at length 1
  // Sequence 1's device length says the cache is full; sequence 2's is stale.
  const std::vector<int32_t> lens = {1, 16, -3};
  copy_bytes(const_cast<int32_t*>(cache.device_live_lens()), Device::kCuda, lens.data(), Device::kCpu, 12);
  const RowView k = cache.k_rows().value();
  const std::vector<uint16_t> before = download<uint16_t>(Device::kCuda, k.data, size_t(3 * 16 * 8));
  cache.append_token(k_new.data(), v_new.data());
  cuda_ok(cudaDeviceSynchronize(), "append");
  const std::vector<int32_t> after = download<int32_t>(Device::kCuda, cache.device_live_lens(), 3);
  EXPECT_EQ(after, (std::vector<int32_t>{2, -1, -1}));
  const std::vector<uint16_t> rows = download<uint16_t>(Device::kCuda, k.data, size_t(3 * 16 * 8));
  for (size_t i = 16 * 8; i < rows.size(); ++i)
    ASSERT_EQ(rows[i], before[i]) << "sequence " << i / (16 * 8) << " was written";
  EXPECT_TRUE(throws_error_naming([&] { cache.sync_live_len(); }, "sequence 1's device length -1"));
}

// The page table's own structure arrays on the device: a first_page_offset
// outside its page, and an indptr that decreases (request 1's count
// negative). Request 1 comes out NaN and is named, with both kinds;
// request 2 (its ids unchanged) matches fp64. (Request 0's range grows
// with the edit, so its output is not judged; the CPU backend refuses both.)
TEST(DeviceLengthsCuda, OffsetsAndIndptrOutOfRangePoisonTheirRequest) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(68);
  ProblemSpec spec;
  spec.seq_lens = {100, 50, 70};
  spec.page_size = 4;
  spec.group_size = 16;
  spec.pool_pages = 1024;
  const PagedProblem pb = make_problem(spec, rng);
  const Reference ref = reference_attention(pb, pb.token_rows());
  for (const int edit : {0, 1, 2}) {
    PagedProblem bad = pb;
    if (edit == 0) bad.table.first_page_offset[1] = 4;
    if (edit == 1) bad.table.first_page_offset[1] = -1;
    if (edit == 2) bad.table.indptr[1] = bad.table.indptr[2] + 1;
    const DeviceProblem dp(bad);
    Buffer o(Device::kCuda, o_count(pb) * 2), lse(Device::kCuda, lse_count(pb) * 4);
    fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
    fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
    for (const int32_t chunk : {32, 0}) {
      const DecodePlan plan = make_decode_plan(pb.table.seq_lens, cuda_plan_shape(16, 128, chunk));
      Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
      upload_plan_cuda(plan, ws.data());
      run_decode_cuda(dp.params(bad, o.data(), lse.as<float>()), plan, ws.data());
      cuda_ok(cudaDeviceSynchronize(), "decode");
      const std::string what = "edit " + std::to_string(edit) + ", chunk " + std::to_string(chunk);
      const std::vector<float> got_o = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
      const std::vector<float> got_lse = download<float>(Device::kCuda, lse.data(), lse_count(pb));
      const size_t per = 16 * 128;
      size_t finite = 0;
      for (size_t i = per; i < 2 * per; ++i) finite += std::isnan(got_o[i]) ? 0 : 1;
      for (size_t i = 16; i < 32; ++i) finite += std::isnan(got_lse[i]) ? 0 : 1;
      EXPECT_EQ(finite, 0u) << what << ": request 1 must be NaN";
      const std::vector<float> o2(got_o.begin() + 2 * std::ptrdiff_t(per), got_o.end());
      const std::vector<double> want2(ref.o.begin() + 2 * std::ptrdiff_t(per), ref.o.end());
      EXPECT_LT(relative_l2(o2, want2), 1e-2) << what << ": request 2";
      expect_named(read_decode_errors(plan, ws.data()), 1, what);
    }
  }
}

}  // namespace
}  // namespace sparsepage::testing
