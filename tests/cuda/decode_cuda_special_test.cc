// The fused decode's contracts beyond plain numerics: page ids outside the
// pool, window mode, CUDA-graph capture and replay, and 64-bit addressing of
// pools beyond 2^31 elements.
#include <numeric>
#include <random>

#include "cuda/cuda_test_util.h"

namespace sparsepage::testing {
namespace {

ProblemSpec small_spec(int32_t page_size, std::vector<int32_t> seq_lens) {
  ProblemSpec spec;
  spec.dtype = DType::kBF16;
  spec.seq_lens = std::move(seq_lens);
  spec.page_size = page_size;
  spec.group_size = 16;
  spec.dim_qk = 128;
  spec.dim_v = 128;
  spec.pool_pages = page_size == 1 ? 8192 : 1024;
  return spec;
}

bool all_nan(const std::vector<float>& v, size_t begin, size_t count) {
  for (size_t i = begin; i < begin + count; ++i)
    if (!std::isnan(v[i])) return false;
  return true;
}

void expect_bad_index_poisons_request(int32_t page_size, int32_t bad_page, int32_t fixed_chunk) {
  std::mt19937_64 rng(0xbad0 + static_cast<uint64_t>(page_size));
  // 1300 rows: 21 chunks of 64, which the merge kernel takes four lanes per output.
  PagedProblem pb = make_problem(small_spec(page_size, {1300, 1300, 1300}), rng);
  // Request 1's rows before the bad page are still real; the reference skips it.
  std::vector<std::vector<int64_t>> rows = pb.token_rows();
  rows[1].clear();
  const Reference ref = reference_attention(pb, rows);
  pb.indices[static_cast<size_t>(pb.table.indptr[1] + 2)] = bad_page;

  const DecodeOutput got = run_gpu(pb, cuda_plan_shape(16, 128, fixed_chunk));
  const std::string what = "page " + std::to_string(bad_page) + ", chunk " + std::to_string(fixed_chunk);
  EXPECT_NE(got.error_flag, 0u) << what;
  const size_t per_request = 16 * 128;
  EXPECT_TRUE(all_nan(got.o, per_request, per_request)) << what;
  EXPECT_TRUE(all_nan(got.lse, 16, 16)) << what;
  for (int r : {0, 2}) {
    const std::vector<float> o(got.o.begin() + r * per_request, got.o.begin() + (r + 1) * per_request);
    const std::vector<double> want(ref.o.begin() + r * per_request, ref.o.begin() + (r + 1) * per_request);
    EXPECT_LT(relative_l2(o, want), 1e-2) << what << ", request " << r;
  }
}

TEST(DecodeCudaErrors, IndexOutsideThePoolGivesNaNForThatRequestOnly) {
  SKIP_WITHOUT_CUDA();
  for (int32_t page_size : {1, 16}) {
    const int32_t pages = page_size == 1 ? 8192 : 1024;
    for (int32_t bad : {pages, -3}) {
      for (int32_t chunk : {64, 1 << 20}) {
        expect_bad_index_poisons_request(page_size, bad, chunk);
      }
    }
  }
}

TEST(DecodeCudaErrors, FlagIsClearedByReading) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(7);
  PagedProblem pb = make_problem(small_spec(1, {100}), rng);
  pb.indices[5] = 1 << 30;
  const DeviceProblem dp(pb);
  Buffer o(Device::kCuda, o_count(pb) * 2);
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, cuda_plan_shape(16, 128));
  Buffer ws(Device::kCuda, plan.workspace.total);
  upload_plan_cuda(plan, ws.data());
  run_decode_cuda(dp.params(pb, o.data(), nullptr), plan, ws.data());
  EXPECT_NE(read_decode_error_flag(plan, ws.data()), 0u);
  EXPECT_EQ(read_decode_error_flag(plan, ws.data()), 0u);
}

TEST(DecodeCudaWindow, RelativePagesStayInsideTheirRequestsWindow) {
  SKIP_WITHOUT_CUDA();
  // Three requests, each owning 1024 rows of which the first 1000 are live.
  std::mt19937_64 rng(11);
  ProblemSpec spec = small_spec(1, {500, 500, 500});
  spec.pool_pages = 3 * 1024;
  PagedProblem pb = make_problem(spec, rng);
  const int64_t stride = 1024, window = 1000;
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(window - 1));
  for (int32_t& page : pb.indices) page = pick(rng);
  // Absolute rows for the reference; fill them (the pool was filled for other rows).
  std::vector<std::vector<int64_t>> rows(3);
  const size_t esize = 2;
  for (int32_t r = 0; r < 3; ++r) {
    for (int32_t i = pb.table.indptr[r]; i < pb.table.indptr[r + 1]; ++i) {
      const int64_t row = r * stride + pb.indices[static_cast<size_t>(i)];
      rows[static_cast<size_t>(r)].push_back(row);
      auto kv = random_values(DType::kBF16, 128, rng);
      std::copy(kv.begin(), kv.end(), pb.k_pool.begin() + row * pb.k_row_stride * esize);
      kv = random_values(DType::kBF16, 128, rng);
      std::copy(kv.begin(), kv.end(), pb.v_pool.begin() + row * pb.v_row_stride * esize);
    }
  }
  pb.indices[static_cast<size_t>(pb.table.indptr[2] + 7)] = static_cast<int32_t>(window);  // past the window
  rows[2].clear();
  const Reference ref = reference_attention(pb, rows);

  const DeviceProblem dp(pb);
  Buffer o(Device::kCuda, o_count(pb) * 2);
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, cuda_plan_shape(16, 128, 128));
  Buffer ws(Device::kCuda, plan.workspace.total);
  upload_plan_cuda(plan, ws.data());
  DecodeParams params = dp.params(pb, o.data(), nullptr);
  params.addressing = PageAddressing::kWindow;
  params.window_len = window;
  params.k.seq_stride = stride * params.k.row_stride;  // request r's window starts at row r * stride
  params.v.seq_stride = stride * params.v.row_stride;
  run_decode_cuda(params, plan, ws.data());
  EXPECT_NE(read_decode_error_flag(plan, ws.data()), 0u);
  const std::vector<float> got = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  const size_t per = 16 * 128;
  EXPECT_LT(relative_l2(std::vector<float>(got.begin(), got.begin() + 2 * per),
                        std::vector<double>(ref.o.begin(), ref.o.begin() + 2 * per)),
            1e-2);
  EXPECT_TRUE(all_nan(got, 2 * per, per));
}

TEST(DecodeCudaGraph, ReplayAfterChangingQueriesAndIndicesInPlace) {
  SKIP_WITHOUT_CUDA();
  ProblemSpec spec = small_spec(1, {2048, 2048, 1500, 0});
  std::mt19937_64 rng(21);
  const PagedProblem first = make_problem(spec, rng);
  const PagedProblem second = make_problem(spec, rng);  // same counts, new contents
  DeviceProblem dp(first);
  Buffer o(Device::kCuda, o_count(first) * 2);
  Buffer lse(Device::kCuda, lse_count(first) * 4);
  const DecodePlan plan = make_decode_plan(first.table.seq_lens, cuda_plan_shape(16, 128));
  ASSERT_TRUE(plan.needs_merge()) << "the graph should hold the merge too";
  Buffer ws(Device::kCuda, plan.workspace.total);

  StreamGraph graph;
  cudaStream_t stream = graph.stream();
  upload_plan_cuda(plan, ws.data(), stream);
  graph.capture(
      [&](cudaStream_t s) { run_decode_cuda(dp.params(first, o.data(), lse.as<float>()), plan, ws.data(), s); });

  auto replay_and_check = [&](const PagedProblem& pb) {
    fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
    fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
    graph.replay();
    DecodeOutput got;
    got.o = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
    got.lse = download<float>(Device::kCuda, lse.data(), lse_count(pb));
    expect_matches_reference(pb, got, reference_attention(pb, pb.token_rows()), "graph replay");
  };
  replay_and_check(first);
  // New queries, indices and pool contents in the same buffers.
  copy_bytes(dp.q.data(), Device::kCuda, second.q.data(), Device::kCpu, second.q.size());
  copy_bytes(dp.indices.data(), Device::kCuda, second.indices.data(), Device::kCpu, second.indices.size() * 4);
  copy_bytes(dp.k.data(), Device::kCuda, second.k_pool.data(), Device::kCpu, second.k_pool.size());
  copy_bytes(dp.v.data(), Device::kCuda, second.v_pool.data(), Device::kCpu, second.v_pool.size());
  replay_and_check(second);
  EXPECT_EQ(read_decode_error_flag(plan, ws.data(), stream), 0u);
}

// A captured graph of back-to-back split launches (each partial kernel and
// its merge scheduled while the previous drains, by programmatic dependent
// launch) is replayed many times and must equal the eager result bit for bit
// every time: uniform splits (items from the CTA index) and listed ones, one
// and two head tiles (group 24) per work item.
void expect_replays_equal_eager(int32_t group_size, std::vector<int32_t> seq_lens, int32_t fixed_chunk) {
  ProblemSpec spec = small_spec(1, std::move(seq_lens));
  spec.group_size = group_size;
  std::mt19937_64 rng(0x6e0 + static_cast<uint64_t>(group_size));
  const PagedProblem pb = make_problem(spec, rng);
  const std::string what = "group " + std::to_string(group_size) + ", chunk " + std::to_string(fixed_chunk);
  DeviceProblem dp(pb);
  const size_t o_bytes = o_count(pb) * 2, lse_bytes = lse_count(pb) * 4;
  Buffer o(Device::kCuda, o_bytes), lse(Device::kCuda, lse_bytes);
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, cuda_plan_shape(group_size, 128, fixed_chunk));
  ASSERT_TRUE(plan.needs_merge()) << what;
  Buffer ws(Device::kCuda, plan.workspace.total);
  fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());  // stale partials must not matter
  StreamGraph graph;
  cudaStream_t stream = graph.stream();
  upload_plan_cuda(plan, ws.data(), stream);
  const DecodeParams params = dp.params(pb, o.data(), lse.as<float>());

  auto read = [&] {
    std::vector<uint8_t> bytes = download<uint8_t>(Device::kCuda, o.data(), o_bytes);
    const std::vector<uint8_t> l = download<uint8_t>(Device::kCuda, lse.data(), lse_bytes);
    bytes.insert(bytes.end(), l.begin(), l.end());
    return bytes;
  };
  fill_bytes(o.data(), Device::kCuda, 0xFF, o_bytes);
  fill_bytes(lse.data(), Device::kCuda, 0xFF, lse_bytes);
  run_decode_cuda(params, plan, ws.data(), stream);
  cuda_ok(cudaStreamSynchronize(stream), "eager");
  const std::vector<uint8_t> eager = read();
  DecodeOutput got;
  got.o = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o_bytes));
  got.lse = download<float>(Device::kCuda, lse.data(), lse_count(pb));
  expect_matches_reference(pb, got, reference_attention(pb, pb.token_rows()), what + ": eager");

  // Under the sanitizers (testing::quick_mode()) 10 replays of 4 launches:
  // still three back-to-back overlaps per replay, a 16th of the launches.
  const int kLaunchesPerGraph = quick_mode() ? 4 : 16, kReplays = quick_mode() ? 10 : 40;
  graph.capture([&](cudaStream_t s) {
    for (int i = 0; i < kLaunchesPerGraph; ++i) run_decode_cuda(params, plan, ws.data(), s);
  });
  for (int replay = 0; replay < kReplays; ++replay) {
    // Poisoned before every other replay: each replay must write every output.
    if (replay % 2 == 0) {
      fill_bytes(o.data(), Device::kCuda, 0xFF, o_bytes);
      fill_bytes(lse.data(), Device::kCuda, 0xFF, lse_bytes);
    }
    graph.replay();
    ASSERT_TRUE(read() == eager) << what << ": replay " << replay << " differs from the eager launch";
  }
  EXPECT_EQ(read_decode_error_flag(plan, ws.data(), stream), 0u);
}

TEST(DecodeCudaGraph, ManyReplaysOfSplitLaunchesEqualTheEagerLaunch) {
  SKIP_WITHOUT_CUDA();
  expect_replays_equal_eager(16, {2048, 2048, 2048, 2048}, 0);  // uniform split: items from the CTA index
  expect_replays_equal_eager(24, {1000, 1000, 1000}, 64);       // uniform, two head tiles, short last chunks
  expect_replays_equal_eager(16, {2048, 2048, 1500, 0}, 0);     // the plan's own split, from the work list
  expect_replays_equal_eager(16, {2048, 2048, 1500, 0}, 64);    // 32 partials per long request
  expect_replays_equal_eager(24, {700, 129, 64, 1000}, 64);     // two head tiles; a single-chunk request
  std::vector<int32_t> many(96);
  for (size_t r = 0; r < many.size(); ++r) many[r] = 100 + static_cast<int32_t>(r * 37 % 900);
  expect_replays_equal_eager(16, many, 128);  // 96 split requests
}

// A uniform split planned for a bound its requests do not reach (a ragged
// batch planned for its selection's width): with balance_live_counts each
// request's chunks share the tokens it sees, without it the first chunks take
// them. Both must equal the fp64 reference over the tokens each request sees,
// flag nothing, and write every output (poisoned before the launch).
TEST(DecodeCudaBalance, ChunksShareTheLiveCountOfARequestBelowItsPlan) {
  SKIP_WITHOUT_CUDA();
  const std::vector<int32_t> live = {4096, 2176, 100, 0, 1000, 4095, 64, 3000};
  std::mt19937_64 rng(0xba1);
  const PagedProblem pb = make_problem(small_spec(1, live), rng);
  const Reference ref = reference_attention(pb, pb.token_rows());
  for (const int32_t fixed_chunk : {0, 512}) {
    const DecodePlan plan =
        make_decode_plan(std::vector<int32_t>(live.size(), 4096), cuda_plan_shape(16, 128, fixed_chunk));
    ASSERT_GT(plan.uniform_chunks, 1) << "the test needs a uniform split into chunks";
    for (const bool balance : {false, true}) {
      const std::string what = "chunk " + std::to_string(fixed_chunk) + (balance ? ", balanced" : ", as planned");
      DeviceProblem dp(pb);
      Buffer o(Device::kCuda, o_count(pb) * 2), lse(Device::kCuda, lse_count(pb) * 4);
      fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
      fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
      Buffer ws(Device::kCuda, plan.workspace.total);
      fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());
      upload_plan_cuda(plan, ws.data(), nullptr);
      DecodeParams params = dp.params(pb, o.data(), lse.as<float>());
      params.balance_live_counts = balance;
      run_decode_cuda(params, plan, ws.data(), nullptr);
      cuda_ok(cudaDeviceSynchronize(), "decode");
      DecodeOutput got;
      got.o = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
      got.lse = download<float>(Device::kCuda, lse.data(), lse_count(pb));
      expect_matches_reference(pb, got, ref, what);
      EXPECT_EQ(read_decode_error_flag(plan, ws.data(), nullptr), 0u) << what;
    }
  }
}

TEST(DecodeCudaAddressing, PoolBeyond2To31ElementsIsAddressedIn64Bits) {
  SKIP_WITHOUT_CUDA();
  // 17M rows x 128 bf16 = 2.18e9 elements per pool: row * 128 overflows int32.
  constexpr int64_t kRows = 17'000'000, kDim = 128, kRegion = 4096;
  size_t free_bytes = 0, total_bytes = 0;
  cuda_ok(cudaMemGetInfo(&free_bytes, &total_bytes), "meminfo");
  const size_t pool_bytes = static_cast<size_t>(kRows * kDim * 2);
  if (free_bytes < 2 * pool_bytes + (size_t{1} << 30)) GTEST_SKIP() << "needs ~9.7 GB of free device memory";
  Buffer k(Device::kCuda, pool_bytes), v(Device::kCuda, pool_bytes);
  fill_bytes(k.data(), Device::kCuda, 0xFF, k.bytes());  // unselected rows are NaN
  fill_bytes(v.data(), Device::kCuda, 0xFF, v.bytes());
  // Two initialized regions: the pool's top (past 2^31 elements) and its bottom.
  std::mt19937_64 rng(31);
  const int64_t region_start[2] = {kRows - kRegion, 0};
  std::vector<std::vector<uint8_t>> k_rows, v_rows;
  for (int64_t start : region_start) {
    k_rows.push_back(random_values(DType::kBF16, kRegion * kDim, rng));
    v_rows.push_back(random_values(DType::kBF16, kRegion * kDim, rng));
    copy_bytes(k.as<uint8_t>() + start * kDim * 2, Device::kCuda, k_rows.back().data(), Device::kCpu,
               k_rows.back().size());
    copy_bytes(v.as<uint8_t>() + start * kDim * 2, Device::kCuda, v_rows.back().data(), Device::kCpu,
               v_rows.back().size());
  }
  auto value = [&](const std::vector<std::vector<uint8_t>>& rows, int64_t row, int64_t d) {
    const int region = row >= region_start[0] ? 0 : 1;
    const size_t at = static_cast<size_t>(((row - region_start[region]) * kDim + d) * 2);
    return static_cast<double>(bf16_to_float(static_cast<uint16_t>(rows[region][at] | rows[region][at + 1] << 8)));
  };

  for (int32_t page_size : {1, 16}) {
    const std::vector<int32_t> seq_lens = {2048, 1000};
    const PageTableStructure table = build_page_table_structure(seq_lens, page_size);
    // Pages from both regions, shuffled, mostly the top one.
    std::vector<int32_t> indices;
    std::uniform_int_distribution<int64_t> pick(0, kRegion / page_size - 1);
    std::bernoulli_distribution top(0.8);
    for (int64_t i = 0; i < table.num_pages(); ++i) {
      const int64_t start = top(rng) ? region_start[0] : region_start[1];
      indices.push_back(static_cast<int32_t>(start / page_size + pick(rng)));
    }
    const auto q = random_values(DType::kBF16, seq_lens.size() * 16 * kDim, rng);
    Buffer d_indptr = upload(Device::kCuda, table.indptr), d_indices = upload(Device::kCuda, indices);
    Buffer d_fpo = upload(Device::kCuda, table.first_page_offset), d_lens = upload(Device::kCuda, table.seq_lens);
    Buffer d_q = upload(Device::kCuda, q), d_o(Device::kCuda, seq_lens.size() * 16 * kDim * 2);
    DecodeParams p;
    p.indptr = d_indptr.as<int32_t>();
    p.indices = d_indices.as<int32_t>();
    p.first_page_offset = d_fpo.as<int32_t>();
    p.seq_lens = d_lens.as<int32_t>();
    p.num_requests = 2;
    p.page_size = page_size;
    p.num_pool_pages = kRows / page_size;
    p.group_size = 16;
    p.q = d_q.data();
    p.k = {k.data(), kDim, kDim};
    p.v = {v.data(), kDim, kDim};
    p.scale = 1.0f / std::sqrt(128.0f);
    p.o = d_o.data();
    const DecodePlan plan = make_decode_plan(seq_lens, cuda_plan_shape(16, 128));
    Buffer ws(Device::kCuda, plan.workspace.total);
    upload_plan_cuda(plan, ws.data());
    run_decode_cuda(p, plan, ws.data());
    EXPECT_EQ(read_decode_error_flag(plan, ws.data()), 0u);
    const std::vector<float> got = as_float(DType::kBF16, download<uint8_t>(Device::kCuda, d_o.data(), d_o.bytes()));

    // fp64 reference over the same rows.
    const std::vector<float> qf = as_float(DType::kBF16, q);
    std::vector<double> want(got.size(), 0.0);
    for (int32_t r = 0; r < 2; ++r) {
      std::vector<int64_t> rows;
      for (int32_t t = 0; t < seq_lens[r]; ++t)
        rows.push_back(int64_t{indices[static_cast<size_t>(table.indptr[r] + t / page_size)]} * page_size +
                       t % page_size);
      for (int32_t g = 0; g < 16; ++g) {
        const size_t qrow = static_cast<size_t>(r * 16 + g);
        std::vector<double> s;
        for (int64_t row : rows) {
          double dot = 0;
          for (int64_t d = 0; d < kDim; ++d) dot += qf[qrow * kDim + d] * value(k_rows, row, d);
          s.push_back(dot * p.scale);
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (size_t j = 0; j < rows.size(); ++j) {
          const double w = std::exp(s[j] - mx);
          sum += w;
          for (int64_t d = 0; d < kDim; ++d) want[qrow * kDim + d] += w * value(v_rows, rows[j], d);
        }
        for (int64_t d = 0; d < kDim; ++d) want[qrow * kDim + d] /= sum;
      }
    }
    EXPECT_LT(relative_l2(got, want), 1e-2) << "page_size " << page_size;
  }
}

}  // namespace
}  // namespace sparsepage::testing
