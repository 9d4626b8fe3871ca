// The engines' own inputs on the GPU (the partial, MLA and merge kernels),
// against fp64 and the CPU backend: the DSA slot-id matrix with -1 padding
// and per-token lengths, positions resolved through a block table inside
// the kernel, a block table as the page ids of [num_blocks, block_size,
// num_kv_heads, head_dim] pools (block sizes 16, 32, 64) with GQA folding,
// and q / o as strided views (a slice of a packed QKV tensor, o a column
// slice whose gaps must stay untouched). Pools and gaps are NaN wherever a
// correct kernel must not read or write. Then the error semantics of bad
// ids (NaN for that request, the error flag) and a captured graph replayed
// with changed lengths.
#include <cuda_runtime.h>

#include <functional>
#include <utility>

#include "cuda/cuda_test_util.h"
#include "support/engine_problem.h"

namespace sparsepage::testing {
namespace {

/// A problem's arrays on the GPU, with poisoned outputs.
struct DeviceEngine {
  Buffer q, k, v, indices, lens, table, rows, o, lse;
  explicit DeviceEngine(const EngineProblem& pb) {
    q = upload(Device::kCuda, pb.q_buf);
    k = upload(Device::kCuda, pb.k_pool);
    if (!pb.spec.mla) v = upload(Device::kCuda, pb.v_pool);
    indices = upload(Device::kCuda, pb.indices);
    if (!pb.lens.empty()) lens = upload(Device::kCuda, pb.lens);
    if (!pb.block_table.empty()) table = upload(Device::kCuda, pb.block_table);
    if (!pb.row_of_sequence.empty()) rows = upload(Device::kCuda, pb.row_of_sequence);
    o = Buffer(Device::kCuda, static_cast<size_t>(pb.o_elements) * dtype_size(pb.spec.dtype));
    lse = Buffer(Device::kCuda, static_cast<size_t>(pb.num_requests()) * pb.spec.group_size * sizeof(float));
    poison();
  }
  void poison() {
    fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
    fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  }
  DecodeParams params(const EngineProblem& pb) {
    EngineArrays a;
    a.q = q.data();
    if (pb.dim_extra > 0) a.q_extra = static_cast<const char*>(q.data()) + pb.q_offset_extra * 2;
    a.k = k.data();
    a.v = pb.spec.mla ? k.data() : v.data();
    a.indices = indices.as<int32_t>();
    a.lens = lens.empty() ? nullptr : lens.as<int32_t>();
    a.block_table = table.empty() ? nullptr : table.as<int32_t>();
    a.row_of_sequence = rows.empty() ? nullptr : rows.as<int32_t>();
    a.o = o.data();
    a.lse = lse.as<float>();
    return pb.params(a);
  }
  EngineOutput read(const EngineProblem& pb) const {
    return unpack_output(pb, download<uint8_t>(Device::kCuda, o.data(), o.bytes()),
                         download<float>(Device::kCuda, lse.data(), lse.bytes() / sizeof(float)));
  }
};

struct GpuRun {
  EngineOutput out;
  uint32_t error_flag = 0;
};

/// Runs on the GPU; `edit` may change the params (over the device arrays) first.
GpuRun run_gpu(const EngineProblem& pb, const PlanShape& shape,
               const std::function<void(DecodeParams&)>& edit = nullptr) {
  DeviceEngine d(pb);
  const DecodePlan plan = pb.plan(shape);
  Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
  fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());
  upload_plan_cuda(plan, ws.data());
  DecodeParams p = d.params(pb);
  if (edit) edit(p);
  run_decode_cuda(p, plan, ws.data());
  cuda_ok(cudaDeviceSynchronize(), "engine decode");
  GpuRun r;
  r.out = d.read(pb);
  r.error_flag = read_decode_error_flag(plan, ws.data());
  return r;
}

EngineOutput run_cpu_backend(const EngineProblem& pb, const PlanShape& shape) {
  std::vector<uint8_t> o = nan_values(pb.spec.dtype, static_cast<size_t>(pb.o_elements));
  std::vector<float> lse(static_cast<size_t>(pb.num_requests()) * pb.spec.group_size);
  const DecodePlan plan = pb.plan(shape);
  Buffer ws(Device::kCpu, plan.workspace.total);
  run_decode_cpu(pb.params(pb.host_arrays(o.data(), lse.data())), plan, ws.data());
  return unpack_output(pb, o, lse);
}

struct Named {
  const char* name;
  EngineSpec spec;
};
std::ostream& operator<<(std::ostream& os, const Named& c) { return os << c.name; }

class EngineInputsCuda : public ::testing::TestWithParam<Named> {};

TEST_P(EngineInputsCuda, MatchesFp64AndTheCpuBackendWithAndWithoutSplits) {
  SKIP_WITHOUT_CUDA();
  EngineSpec spec = GetParam().spec;
  if (quick_mode()) spec.num_seqs = 3;  // under the sanitizers: 3 sequences, not 5, in each layout
  const EngineProblem pb = make_engine_problem(spec, 0x6e91);
  const EngineReference ref = engine_reference(pb);
  const int32_t G = pb.spec.group_size, dv = pb.dim_v;
  GpuRun planned;  // chunk 0: the plan's own split, compared with the CPU backend below
  for (int32_t chunk : {64, 1 << 20, 0}) {
    GpuRun got = run_gpu(pb, cuda_plan_shape(G, dv, chunk));
    EXPECT_EQ(compare_engine(pb, ref, got.out, 1e-2, 2e-2), "") << "chunk " << chunk;
    EXPECT_TRUE(got.out.gaps_untouched) << "wrote outside o's rows (chunk " << chunk << ")";
    EXPECT_EQ(got.error_flag, 0u) << "chunk " << chunk;
    if (chunk == 0) planned = std::move(got);
  }
  const EngineOutput cpu = run_cpu_backend(pb, cuda_plan_shape(G, dv));
  std::vector<double> cpu_o(cpu.o.begin(), cpu.o.end());
  EXPECT_LT(relative_l2(planned.out.o, cpu_o), 1e-2) << "GPU vs CPU backend";
}

EngineSpec mla_slots(bool strided) {
  EngineSpec s;
  s.num_seqs = 5;
  s.group_size = 128;  // two 64-head tiles of the MLA kernel
  s.block_size = 64;
  s.num_blocks = 96;
  s.index = EngineIndex::kSlotIds;
  s.topk = 300;
  s.pad_fraction = 0.2;
  s.lengths = true;
  s.strided_qo = strided;
  return s;
}

EngineSpec mla_positions(int32_t group_size) {
  EngineSpec s = mla_slots(false);
  s.group_size = group_size;
  s.index = EngineIndex::kPositions;
  s.block_size = 16;
  s.num_blocks = 160;
  s.context = 1000;
  s.pad_fraction = 0.1;
  return s;
}

EngineSpec gqa_pages(int32_t block_size, int32_t head_dim, bool strided) {
  EngineSpec s;
  s.mla = false;
  s.num_seqs = 5;
  s.num_kv_heads = 4;
  s.group_size = 4;
  s.head_dim = head_dim;
  s.block_size = block_size;
  s.num_blocks = 200;
  s.index = EngineIndex::kBlockPages;
  s.context = 20 * block_size + 3;
  s.strided_qo = strided;
  return s;
}

EngineSpec gqa_slots_per_head() {
  EngineSpec s = gqa_pages(16, 128, true);
  s.group_size = 8;
  s.index = EngineIndex::kSlotIds;
  s.per_head_indices = true;
  s.topk = 200;
  s.pad_fraction = 0.3;
  s.lengths = true;
  return s;
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineInputsCuda,
                         ::testing::Values(Named{"mla_slot_ids_padded", mla_slots(false)},
                                           Named{"mla_slot_ids_strided_q", mla_slots(true)},
                                           Named{"mla_positions_block_table_g16", mla_positions(16)},
                                           Named{"mla_positions_block_table_g128_strided",
                                                 [] {
                                                   EngineSpec s = mla_positions(128);
                                                   s.strided_qo = true;
                                                   return s;
                                                 }()},
                                           Named{"gqa_block_pages_bs16_d128_strided", gqa_pages(16, 128, true)},
                                           Named{"gqa_block_pages_bs32_d64", gqa_pages(32, 64, false)},
                                           Named{"gqa_block_pages_bs64_d128_strided", gqa_pages(64, 128, true)},
                                           Named{"gqa_slot_ids_per_head_strided", gqa_slots_per_head()}),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

/// Request `bad` is NaN (o and lse), every other request matches fp64, and
/// the error flag is set.
void expect_only_request_poisoned(const EngineProblem& pb, const GpuRun& got, int32_t bad) {
  EXPECT_NE(got.error_flag, 0u);
  const EngineReference ref = engine_reference(pb);
  const size_t G = static_cast<size_t>(pb.spec.group_size), dv = static_cast<size_t>(pb.dim_v);
  for (size_t i = 0; i < got.out.lse.size(); ++i) {
    const bool poisoned = i / G == static_cast<size_t>(bad);
    EXPECT_EQ(std::isnan(got.out.lse[i]), poisoned) << "lse of request " << i / G << " head " << i % G;
    for (size_t d = 0; d < dv; d += 17) {
      if (poisoned) {
        ASSERT_TRUE(std::isnan(got.out.o[i * dv + d])) << "request " << bad << " was not poisoned";
      } else {
        ASSERT_NEAR(got.out.o[i * dv + d], ref.o[i * dv + d], 3e-2 + 3e-2 * std::fabs(ref.o[i * dv + d]))
            << "request " << i / G;
      }
    }
  }
}

TEST(EngineInputsCudaErrors, BadIdsPoisonTheirRequestAndSetTheFlag) {
  SKIP_WITHOUT_CUDA();
  EngineSpec spec = mla_slots(false);
  spec.lengths = false;
  spec.pad_fraction = 0;
  const EngineProblem pb = make_engine_problem(spec, 21);
  const PlanShape shape = cuda_plan_shape(spec.group_size, 512, 64);
  // Under the skip mode -1 is padding but -2 is not; an id one past the pool is out of range.
  for (int32_t bad_id : {-2, static_cast<int32_t>(pb.pool_slots())}) {
    EngineProblem edited = pb;
    edited.indices[static_cast<size_t>(2 * edited.width + 7)] = bad_id;
    SCOPED_TRACE("bad id " + std::to_string(bad_id));
    expect_only_request_poisoned(edited, run_gpu(edited, shape), 2);
  }
  // Without the skip mode, -1 is an error like any other.
  EngineProblem minus_one = pb;
  minus_one.indices[static_cast<size_t>(3 * minus_one.width + 9)] = -1;
  SCOPED_TRACE("-1 without IndexPadding::kMinusOneSkips");
  expect_only_request_poisoned(minus_one,
                               run_gpu(minus_one, shape, [](DecodeParams& p) { p.padding = IndexPadding::kNone; }), 3);
}

TEST(EngineInputsCudaErrors, BadBlockTableEntriesPoisonTheirRequest) {
  SKIP_WITHOUT_CUDA();
  EngineSpec spec = mla_positions(16);
  spec.lengths = false;
  spec.pad_fraction = 0;
  const EngineProblem pb = make_engine_problem(spec, 22);
  const PlanShape shape = cuda_plan_shape(16, 512, 64);
  {  // a block id outside the pool in sequence 1's row
    EngineProblem edited = pb;
    const int32_t row = edited.row_of_sequence[1];
    const int32_t pos = edited.indices[static_cast<size_t>(1 * edited.width + 4)];
    edited.block_table[static_cast<size_t>(row * edited.max_blocks + pos / edited.spec.block_size)] = -5;
    SCOPED_TRACE("block id -5");
    expect_only_request_poisoned(edited, run_gpu(edited, shape), 1);
  }
  {  // a position past the table's width in sequence 3
    EngineProblem edited = pb;
    edited.indices[static_cast<size_t>(3 * edited.width + 11)] = edited.max_blocks * edited.spec.block_size;
    SCOPED_TRACE("position past the table");
    expect_only_request_poisoned(edited, run_gpu(edited, shape), 3);
  }
  {  // sequence 0 names a table row that does not exist
    EngineProblem edited = pb;
    edited.row_of_sequence[0] = edited.table_rows;
    SCOPED_TRACE("row_of_sequence out of range");
    expect_only_request_poisoned(edited, run_gpu(edited, shape), 0);
  }
}

// One plan for the bound and one captured graph; the lengths and ids change
// on the device between replays (per-token topk_length and -1 padding move),
// and each replay matches fp64 for the new values.
TEST(EngineInputsCudaGraph, ReplaysWithChangedLengthsAndPadding) {
  SKIP_WITHOUT_CUDA();
  EngineSpec spec = mla_slots(true);
  spec.group_size = 64;
  const EngineProblem first = make_engine_problem(spec, 31);
  const PlanShape shape = cuda_plan_shape(spec.group_size, 512);
  DeviceEngine d(first);
  const DecodePlan plan = first.plan(shape);
  Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  upload_plan_cuda(plan, ws.data(), stream);
  const DecodeParams p = d.params(first);
  cudaGraph_t graph;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  run_decode_cuda(p, plan, ws.data(), stream);
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  // Same shapes, new lengths, ids and padding: only the device arrays change.
  EngineProblem next = make_engine_problem(spec, 32);
  next.q_buf = first.q_buf;
  next.k_pool = first.k_pool;
  for (auto& slots : next.slots) slots.clear();
  for (int32_t r = 0; r < next.num_requests(); ++r) {  // recompute from `first`'s pool: keep ids whose rows hold values
    for (int32_t i = 0; i < next.lens[static_cast<size_t>(r)]; ++i) {
      int32_t& id = next.indices[static_cast<size_t>(r * next.width + i)];
      const auto& filled = first.slots[static_cast<size_t>(r % first.num_requests())];
      if (id != -1) id = filled.empty() ? -1 : static_cast<int32_t>(filled[static_cast<size_t>(i) % filled.size()]);
      if (id != -1) next.slots[static_cast<size_t>(r)].push_back(id);
    }
  }
  for (const EngineProblem* step : std::initializer_list<const EngineProblem*>{&first, &next}) {
    cuda_ok(cudaMemcpy(d.indices.data(), step->indices.data(), step->indices.size() * 4, cudaMemcpyHostToDevice),
            "ids");
    cuda_ok(cudaMemcpy(d.lens.data(), step->lens.data(), step->lens.size() * 4, cudaMemcpyHostToDevice), "lens");
    d.poison();
    cuda_ok(cudaGraphLaunch(exec, stream), "replay");
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    EXPECT_EQ(compare_engine(*step, engine_reference(*step), d.read(*step), 1e-2, 2e-2), "")
        << (step == &first ? "first replay" : "replay with new lengths and ids");
  }
  EXPECT_EQ(read_decode_error_flag(plan, ws.data(), stream), 0u);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace sparsepage::testing
