// The engines' own inputs on the CPU backend, against fp64: the DSA slot-id
// matrix with -1 padding and per-token lengths, request-local positions
// resolved through a block table, a block table as the page ids of
// [num_blocks, block_size, num_kv_heads, head_dim] pools (block sizes 16, 32,
// 64) with GQA folding, and q / o as strided views. Every pool row no visible
// token reaches is NaN, and so are the gaps of a strided o. Then each bad
// input the new modes add, by the error it must raise.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "sparsepage/decode.h"
#include "support/engine_problem.h"
#include "support/expect_error.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::EngineIndex;
using testing::EngineProblem;
using testing::EngineSpec;
using testing::throws_error_naming;

struct Named {
  const char* name;
  EngineSpec spec;
};
std::ostream& operator<<(std::ostream& os, const Named& c) { return os << c.name; }

PlanShape cpu_shape(const EngineProblem& pb, int32_t fixed_chunk) {
  PlanShape shape;
  shape.group_size = pb.spec.group_size;
  shape.head_dim_v = pb.dim_v;
  shape.num_sms = 3;
  shape.min_chunk_tokens = 0;
  shape.chunk_granule = fixed_chunk > 0 ? 1 : 64;
  shape.fixed_chunk_tokens = fixed_chunk;
  return shape;
}

testing::EngineOutput run_cpu(const EngineProblem& pb, const DecodePlan& plan, DecodeParams* edit = nullptr) {
  std::vector<uint8_t> o = testing::nan_values(pb.spec.dtype, static_cast<size_t>(pb.o_elements));
  std::vector<float> lse(static_cast<size_t>(pb.num_requests()) * pb.spec.group_size,
                         std::numeric_limits<float>::quiet_NaN());
  Buffer ws(Device::kCpu, plan.workspace.total);
  fill_bytes(ws.data(), Device::kCpu, 0xFF, ws.bytes());
  DecodeParams p = pb.params(pb.host_arrays(o.data(), lse.data()));
  if (edit != nullptr) {
    edit->o = p.o;  // the caller's edits on top of the problem's params
    edit->lse = p.lse;
    p = *edit;
  }
  run_decode_cpu(p, plan, ws.data());
  return testing::unpack_output(pb, o, lse);
}

class EngineInputsCpu : public ::testing::TestWithParam<Named> {};

TEST_P(EngineInputsCpu, MatchesFp64WithAndWithoutSplits) {
  const EngineProblem pb = testing::make_engine_problem(GetParam().spec, 0xe491);
  const testing::EngineReference ref = testing::engine_reference(pb);
  const double tol = pb.spec.dtype == DType::kF32 ? 1e-5 : 1e-2;
  for (int32_t chunk : {0, 7}) {
    const testing::EngineOutput got = run_cpu(pb, pb.plan(cpu_shape(pb, chunk)));
    EXPECT_EQ(testing::compare_engine(pb, ref, got, tol, 1e-4), "") << "chunk " << chunk;
    EXPECT_TRUE(got.gaps_untouched) << "wrote outside o's rows (chunk " << chunk << ")";
  }
}

EngineSpec mla_slots(bool strided, DType dtype) {
  EngineSpec s;
  s.dtype = dtype;
  s.num_seqs = 4;
  s.group_size = 8;
  s.block_size = 64;
  s.num_blocks = 24;
  s.index = EngineIndex::kSlotIds;
  s.topk = 96;
  s.pad_fraction = 0.25;
  s.lengths = true;
  s.strided_qo = strided;
  return s;
}

EngineSpec mla_positions() {
  EngineSpec s = mla_slots(false, DType::kF32);
  s.index = EngineIndex::kPositions;
  s.block_size = 16;
  s.num_blocks = 64;
  s.context = 300;
  s.pad_fraction = 0.1;
  return s;
}

EngineSpec gqa_pages(int32_t block_size, bool strided) {
  EngineSpec s;
  s.dtype = DType::kF32;
  s.mla = false;
  s.num_seqs = 4;
  s.num_kv_heads = 2;
  s.group_size = 4;
  s.head_dim = 64;
  s.block_size = block_size;
  s.num_blocks = 40;
  s.index = EngineIndex::kBlockPages;
  s.context = 7 * block_size + 5;
  s.strided_qo = strided;
  return s;
}

EngineSpec gqa_slots_per_head() {
  EngineSpec s = gqa_pages(16, true);
  s.index = EngineIndex::kSlotIds;
  s.per_head_indices = true;
  s.topk = 50;
  s.pad_fraction = 0.2;
  s.lengths = true;
  return s;
}

INSTANTIATE_TEST_SUITE_P(Layouts, EngineInputsCpu,
                         ::testing::Values(Named{"mla_slot_ids_padded", mla_slots(false, DType::kF32)},
                                           Named{"mla_slot_ids_strided_q_bf16", mla_slots(true, DType::kBF16)},
                                           Named{"mla_positions_block_table", mla_positions()},
                                           Named{"gqa_block_pages_bs16_strided", gqa_pages(16, true)},
                                           Named{"gqa_block_pages_bs32", gqa_pages(32, false)},
                                           Named{"gqa_block_pages_bs64_strided", gqa_pages(64, true)},
                                           Named{"gqa_slot_ids_per_head_strided", gqa_slots_per_head()}),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

// Without seq_lens every request sees the plan's counts (full top-k rows).
TEST(EngineInputsCpu, NullSeqLensMeansThePlansCounts) {
  EngineSpec spec = mla_slots(false, DType::kF32);
  spec.lengths = false;
  const EngineProblem pb = testing::make_engine_problem(spec, 7);
  ASSERT_TRUE(pb.lens.empty());
  const testing::EngineOutput got = run_cpu(pb, pb.plan(cpu_shape(pb, 0)));
  EXPECT_EQ(testing::compare_engine(pb, testing::engine_reference(pb), got, 1e-5, 1e-4), "");
}

// ---- bad inputs ---------------------------------------------------------

struct BadInput : ::testing::Test {
  EngineProblem slots = testing::make_engine_problem(mla_slots(false, DType::kF32), 11);
  EngineProblem positions = testing::make_engine_problem(mla_positions(), 12);
  EngineProblem pages = testing::make_engine_problem(gqa_pages(16, true), 13);

  static DecodeParams params(const EngineProblem& pb) { return pb.params(pb.host_arrays(nullptr, nullptr)); }
  ::testing::AssertionResult fails(const EngineProblem& pb, DecodeParams p, const std::string& needle) {
    return throws_error_naming([&] { run_cpu(pb, pb.plan(cpu_shape(pb, 0)), &p); }, needle);
  }
};

TEST_F(BadInput, IdsOtherThanMinusOneKeepTheErrorSemantics) {
  std::vector<int32_t> ids = slots.indices;
  ids[5] = -2;
  DecodeParams p = params(slots);
  p.indices = ids.data();
  EXPECT_TRUE(fails(slots, p, "indices[5] = -2 is outside the pool [0, 1536)"));
  ids[5] = static_cast<int32_t>(slots.pool_slots());
  EXPECT_TRUE(fails(slots, p, "indices[5] = 1536 is outside the pool [0, 1536)"));
  // -1 is padding only when the params say so.
  ids[5] = -1;
  p.padding = IndexPadding::kNone;
  EXPECT_TRUE(fails(slots, p, "= -1 is outside the pool [0, 1536)"));
}

TEST_F(BadInput, MatrixPastNumIndices) {
  DecodeParams p = params(slots);
  p.num_indices -= 1;
  EXPECT_TRUE(fails(slots, p, "reaches past num_indices"));
  p = params(slots);
  p.index_width = -1;
  EXPECT_TRUE(fails(slots, p, "index_width = -1 is negative"));
}

TEST_F(BadInput, LengthsAboveThePlansCounts) {
  std::vector<int32_t> lens = slots.lens;
  lens[2] = slots.spec.topk + 1;
  DecodeParams p = params(slots);
  p.seq_lens = lens.data();
  EXPECT_TRUE(fails(slots, p, "seq_lens[2] = 97 must lie in [0, 96]"));
}

TEST_F(BadInput, BlockTableRowsPositionsAndBlocks) {
  std::vector<int32_t> rows = positions.row_of_sequence;
  DecodeParams p = params(positions);
  p.block_table.row_of_sequence = rows.data();
  rows[1] = positions.table_rows;
  EXPECT_TRUE(fails(positions, p, "block_table.row_of_sequence[1] = 6 is outside the table's 6 rows"));
  // A row no sequence was meant to read holds block ids outside the pool.
  rows = positions.row_of_sequence;
  for (int32_t t = 0; t < positions.table_rows; ++t) {
    if (std::find(rows.begin(), rows.end(), t) == rows.end()) rows[0] = t;
  }
  EXPECT_TRUE(fails(positions, p, "is outside the pool's 64 blocks"));
  // A position past the table's width.
  std::vector<int32_t> ids = positions.indices;
  ids[3] = positions.max_blocks * positions.spec.block_size;
  p = params(positions);
  p.indices = ids.data();
  EXPECT_TRUE(fails(positions, p, "indices[3] = 304 names positions of request 0 outside its block table row"));
  p = params(positions);
  p.block_table.data = nullptr;
  EXPECT_TRUE(fails(positions, p, "block_table.data is null"));
  p = params(positions);
  p.block_table.row_of_sequence = nullptr;
  p.block_table.num_rows = 2;
  EXPECT_TRUE(fails(positions, p, "block_table.num_rows = 2 is fewer than the 4 sequences"));
}

TEST_F(BadInput, PagesPastTheIndexWidth) {
  std::vector<int32_t> lens = pages.lens;
  DecodeParams p = params(pages);
  p.index_width = pages.width - 1;
  p.index_seq_stride = pages.width;
  EXPECT_TRUE(fails(pages, p, "request 0 needs 8 pages (first_page_offset 0, seq_len 117) but index_width is 7"));
}

TEST_F(BadInput, OverlappingOrNegativeQueryStrides) {
  DecodeParams p = params(pages);
  p.o_strides.head_stride = pages.dim_v - 8;
  EXPECT_TRUE(fails(pages, p, "make the output rows of 64 elements overlap"));
  p = params(pages);
  p.o_strides.seq_stride = 4 * pages.o_strides.head_stride;  // sequence b + 1 starts inside sequence b's heads
  EXPECT_TRUE(fails(pages, p, "overlap"));
  p = params(pages);
  p.q_strides.seq_stride = -8;
  EXPECT_TRUE(fails(pages, p, "q_strides.seq_stride and q_strides.head_stride must not be negative"));
}

// The CUDA layout check names strided q / o the kernels cannot address
// (tested here, since it is host code every build has).
TEST(EngineInputsLayout, CudaLayoutNamesStridesThatAreNotWhole16BytePieces) {
  EngineSpec spec = gqa_pages(16, true);
  spec.dtype = DType::kBF16;
  const EngineProblem pb = testing::make_engine_problem(spec, 3);
  alignas(16) static uint8_t out[16];
  DecodeParams p = pb.params(pb.host_arrays(out, nullptr));
  std::vector<uint8_t> q(pb.q_buf.size() + 64);
  std::vector<uint8_t> k(pb.k_pool.size() + 64), v(pb.v_pool.size() + 64);
  auto aligned = [](std::vector<uint8_t>& b) {
    return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(b.data()) + 15) & ~uintptr_t{15});
  };
  p.q = aligned(q);
  p.k.data = aligned(k);
  p.v.data = aligned(v);
  EXPECT_EQ(cuda_layout_problem(p), "");
  p.q_strides.head_stride = 68;
  EXPECT_EQ(cuda_layout_problem(p),
            "q_strides.head_stride = 68 must be a multiple of 8 elements on CUDA (q rows are read, and o rows "
            "written, in 16-byte pieces)");
  p.q_strides.head_stride = 64;
  p.o_strides.seq_stride = 4;
  EXPECT_NE(cuda_layout_problem(p).find("o_strides.seq_stride = 4 must be a multiple of 8"), std::string::npos);
  p.qo_layout = QueryLayout::kPacked;  // the strides are not read then
  EXPECT_EQ(cuda_layout_problem(p), "");
}

}  // namespace
}  // namespace sparsepage
