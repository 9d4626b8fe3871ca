// A second, independent guard for each invariant of docs/RELIABILITY.md
// that a single test (or none) caught when its check was removed (the
// mutation runs recorded there, "Tests that guard each invariant"): each
// test here reaches the check through other inputs or another entry point
// than the first one, and asserts the refusal by name or the exact result.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/attention_cpu.h"
#include "sparsepage/cache.h"
#include "sparsepage/decode.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/page_table.h"
#include "sparsepage/plan.h"
#include "sparsepage/sparse_decode.h"
#include "support/expect_error.h"
#include "support/paged_block_pool.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::throws_error_naming;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// fp32 inputs over `batch` requests of one head: K (and V) dense rows of 4
// values, 8 a request, `live_len` of them live.
SparseAttentionInputs f32_inputs(int32_t batch, int64_t live_len, const float* k, const float* q, float* o) {
  SparseAttentionInputs in;
  in.dtype = DType::kF32;
  in.batch = batch;
  in.num_qo_heads = 1;
  in.num_kv_heads = 1;
  in.live_len = live_len;
  in.k = RowView::dense(k, 1, 8, 4);
  in.v = in.k;
  in.q = q;
  in.o = o;
  return in;
}

// A shared fp32 pool of `rows` rows of width 4 (row t holds t / 8 + d / 16),
// one query head per request, CSR page ids into it.
struct PoolDecode {
  static constexpr int32_t kDim = 4;
  std::vector<float> pool, q, o, lse;
  std::vector<int32_t> indptr, indices, lens, offsets;
  int32_t page_size = 1;
  int64_t pool_pages = 0;

  PoolDecode(int64_t rows, std::vector<int32_t> counts, int32_t page) : page_size(page) {
    pool.resize(size_t(rows) * kDim);
    for (size_t i = 0; i < pool.size(); ++i) pool[i] = float(i / kDim) / 8.0f + float(i % kDim) / 16.0f;
    pool_pages = rows / page;
    const PageTableStructure t = build_page_table_structure(counts, page);
    indptr = t.indptr;
    lens = t.seq_lens;
    offsets = t.first_page_offset;
    for (int32_t i = 0; i < indptr.back(); ++i) indices.push_back(i % int32_t(pool_pages));
    q.assign(counts.size() * kDim, 0.25f);
    o.assign(counts.size() * kDim, kNaN);
    lse.assign(counts.size(), kNaN);
  }
  DecodeParams params() {
    DecodeParams p;
    p.dtype = DType::kF32;
    p.indptr = indptr.data();
    p.indices = indices.data();
    p.num_indices = int64_t(indices.size());
    p.seq_lens = lens.data();
    p.first_page_offset = offsets.data();
    p.num_requests = int32_t(lens.size());
    p.page_size = page_size;
    p.num_pool_pages = pool_pages;
    p.q = q.data();
    p.k = {pool.data(), kDim, kDim};
    p.v = {pool.data(), kDim, kDim};
    p.o = o.data();
    p.lse = lse.data();
    return p;
  }
  DecodePlan plan(int32_t fixed_chunk = 0) const {
    PlanShape shape;
    shape.group_size = 1;
    shape.head_dim_v = kDim;
    shape.num_sms = 2;
    shape.min_chunk_tokens = 0;
    shape.chunk_granule = 1;
    shape.fixed_chunk_tokens = fixed_chunk;
    return make_decode_plan(lens, shape);
  }
};

// A decreasing indptr in a page-size-4 table of three requests: named
// before any index is read, and nothing is written.
TEST(SecondGuards, ADecreasingIndptrIsNamedWithPagesOfFour) {
  PoolDecode d(64, {5, 6, 3}, 4);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  std::vector<int32_t> bad = d.indptr;  // {0, 2, 4, 5}
  bad[2] = 1;
  p.indptr = bad.data();
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "indptr decreases at request 1: indptr[1] = 2 > indptr[2] = 1"));
  EXPECT_TRUE(std::isnan(d.o[0]) && std::isnan(d.lse[2]));
}

// -2 is no padding: through a CSR table over a pool, under the skip mode,
// where -1 beside it is skipped.
TEST(SecondGuards, MinusTwoIsAnErrorWhereMinusOneIsPadding) {
  PoolDecode d(32, {3}, 1);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  p.padding = IndexPadding::kMinusOneSkips;
  d.indices = {-1, 7, 9};
  p.indices = d.indices.data();
  run_decode_cpu(p, plan, ws.data());
  const double w7 = std::exp(0.25 * 4 * (7 / 8.0) + 0.25 * (0 + 1 + 2 + 3) / 16.0);
  const double w9 = std::exp(0.25 * 4 * (9 / 8.0) + 0.25 * (0 + 1 + 2 + 3) / 16.0);
  EXPECT_NEAR(d.o[0], (w7 * (7 / 8.0) + w9 * (9 / 8.0)) / (w7 + w9), 1e-5) << "the -1 token must weigh nothing";
  d.indices = {-2, 7, 9};
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "indices[0] = -2 is outside the pool"));
}

// Two work items writing one partial slot: refused by the plan's own check
// and by the backend that runs it.
TEST(SecondGuards, APlanWhoseItemsShareAPartialSlotIsRefused) {
  PoolDecode d(64, {40, 10}, 1);
  DecodePlan plan = d.plan(8);  // request 0 in five chunks
  ASSERT_GE(plan.work.size(), 3u);
  ASSERT_GE(plan.work[1].partial, 0);
  plan.work[2].partial = plan.work[1].partial;
  EXPECT_TRUE(throws_error_naming([&] { check_decode_plan(plan); }, "out of range or already used"));
  Buffer ws(Device::kCpu, plan.workspace.total);
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(d.params(), plan, ws.data()); }, "already used"));
}

// A negative per-request floor is no floor, whatever the request count:
// floors and counts whose product would wrap to a large positive floor
// (-2^61 x 7 = 2^61 mod 2^64, -2^62 x 7 = 2^62) among them.
TEST(SecondGuards, ANegativeFloorNeverDeclines) {
  DispatchInput in;
  in.selected_rows = 10;
  in.live_len = 1000;
  DispatchConfig config;
  config.min_sparsity = 0;
  for (const int64_t floor :
       {int64_t{-1}, -(int64_t{1} << 61), -(int64_t{1} << 62), std::numeric_limits<int64_t>::min()}) {
    config.min_kv_tokens_per_request = floor;
    for (const int64_t requests : {int64_t{2}, int64_t{7}, int64_t{1} << 40}) {
      in.num_requests = requests;
      const SparseDecodeOutcome d = decide_sparse_decode(in, config);
      EXPECT_TRUE(d.fused()) << "floor " << floor << ", " << requests << " requests: " << d.describe();
    }
  }
}

// Negative counts are refused by every reader of a selection, here the mask
// path and the selection's own offsets, before anything is read.
TEST(SecondGuards, NegativeSelectionCountsAreRefusedByTheMaskPath) {
  SparseSelection sel = make_selection(Device::kCpu, {{0, 1}, {2}});
  sel.counts = {3, -1};
  EXPECT_TRUE(throws_error_naming([&] { sel.offsets(); }, "counts[1] = -1 is negative"));
  std::vector<float> k(64, 0.5f), q(8, 1.0f), o(8, kNaN);
  SparseAttentionInputs in = f32_inputs(2, 4, k.data(), q.data(), o.data());
  MaskPath mask(Device::kCpu);
  EXPECT_TRUE(throws_error_naming([&] { mask.prepare(in, sel); }, "counts[1] = -1 is negative"));
  EXPECT_TRUE(std::isnan(o[0]));
}

// A paged pool refuses an append past its free blocks, one token over,
// and leaves the sequence as it was.
TEST(SecondGuards, APagedPoolAppendOneTokenPastItsRoomIsRefused) {
  PagedBlockPool pool(Device::kCpu, DType::kBF16, 3, 1, 4, 1, 1);
  const int32_t a = pool.add_sequence(), b = pool.add_sequence();
  const std::vector<uint16_t> kv(16);
  pool.append(a, kv.data(), kv.data(), 5);  // two blocks
  EXPECT_TRUE(throws_error_naming([&] { pool.append(b, kv.data(), kv.data(), 5); }, "do not fit"));
  EXPECT_EQ(pool.seq_len(b), 0);
  EXPECT_TRUE(pool.block_table(b).empty());
  pool.append(b, kv.data(), kv.data(), 4);  // exactly the last block
  EXPECT_EQ(pool.seq_len(b), 4);
}

// An index matrix whose last sequence's row runs one id past num_indices,
// through the head stride rather than the width.
TEST(SecondGuards, AMatrixReachingPastNumIndicesByItsHeadStride) {
  PoolDecode d(64, {2, 2, 2, 2}, 1);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  d.indices = {0, 1, 2, 3, 4, 5, 6, 7};
  p.indices = d.indices.data();
  p.index_layout = IndexLayout::kMatrix;
  p.num_kv_heads = 2;
  p.index_width = 2;
  p.index_seq_stride = 4;
  p.index_head_stride = 2;
  p.num_indices = 8;
  p.q = d.q.data();
  run_decode_cpu(p, plan, ws.data());
  p.index_head_stride = 3;  // sequence 1, head 1: ids 7 and 8
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "reaches past num_indices = 8"));
}

// The merge's sums are fp64: 4096 one-token partials each weighing 2^-25
// of the first would all be lost in an fp32 sum (1 + 2^-25 == 1 in fp32).
// The lse of the whole is log(1 + 4096 * 2^-25) = 1.22e-4, exactly.
TEST(SecondGuards, TheMergeKeepsTheMassOfManySmallPartials) {
  const int32_t tokens = 4097;
  PoolDecode d(tokens, {tokens}, 1);
  for (int32_t t = 0; t < tokens; ++t) {
    for (int32_t c = 0; c < PoolDecode::kDim; ++c) {
      // Scores (q = 0.25 everywhere): 0 for token 0, -25 ln 2 for the others;
      // V's column 0 is 0 for token 0 and 1 for the others.
      d.pool[size_t(t) * 4 + c] = t == 0 ? 0.0f : float(-25.0 * std::log(2.0));
    }
    d.indices[size_t(t)] = t;
  }
  std::vector<float> v(size_t(tokens) * 4, 0.0f);
  for (int32_t t = 1; t < tokens; ++t) v[size_t(t) * 4] = 1.0f;
  const DecodePlan plan = d.plan(1);  // one token per partial
  ASSERT_EQ(plan.work.size(), size_t(tokens));
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  p.v = {v.data(), 4, 4};
  run_decode_cpu(p, plan, ws.data());
  const double s = double(0.25f * 4 * float(-25.0 * std::log(2.0)));  // the fp32 score of tokens 1..4096
  const double small = 4096 * std::exp(s);
  EXPECT_NEAR(d.lse[0], std::log1p(small), 1e-7);
  EXPECT_NEAR(d.o[0], small / (1 + small), 1e-7);
}

// The same, on the merge alone: partial states whose weights an fp32 sum
// would drop. (cpu::merge_states, the CPU backend's merge.)
TEST(SecondGuards, MergeStatesSumsWeightsInFp64) {
  const int32_t parts = 3000;
  std::vector<std::vector<float>> o(size_t(parts), std::vector<float>(2)), lse(size_t(parts), std::vector<float>(1));
  std::vector<const float*> o_ptr, lse_ptr;
  for (int32_t i = 0; i < parts; ++i) {
    lse[size_t(i)][0] = i == 0 ? 5.0f : 5.0f - 26.0f * float(std::log(2.0));
    o[size_t(i)] = {i == 0 ? 1.0f : -1.0f, 2.0f};
    o_ptr.push_back(o[size_t(i)].data());
    lse_ptr.push_back(lse[size_t(i)].data());
  }
  float out[2], out_lse;
  cpu::merge_states(o_ptr, lse_ptr, 1, 2, out, &out_lse);
  const double w = std::exp(double(lse[1][0]) - 5.0), small = (parts - 1) * w;
  EXPECT_NEAR(out_lse, 5.0 + std::log1p(small), 2e-6);
  EXPECT_NEAR(out[0], (1.0 - small) / (1.0 + small), 1e-7);
  EXPECT_FLOAT_EQ(out[1], 2.0f);
}

// first_page_offset outside [0, page_size) is named before anything is
// read: one past the page, and negative.
TEST(SecondGuards, AFirstPageOffsetOutsideItsPageIsNamed) {
  PoolDecode d(64, {5, 6}, 4);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  d.indices = {1, 2, 3, 4, 5, 6};  // enough pages for either offset
  d.indptr = {0, 3, 6};
  p.indices = d.indices.data();
  p.num_indices = 6;
  for (const int32_t bad : {4, -1}) {
    d.offsets = {0, bad};
    EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                    "first_page_offset[1] = " + std::to_string(bad) + " is outside [0, page_size = 4)"))
        << bad;
  }
  EXPECT_TRUE(std::isnan(d.o[0]));
}

// A block id past the table's num_blocks, in a pool that holds more rows
// than it declares (so reading it would not even fault): named, not read.
TEST(SecondGuards, ABlockIdPastTheDeclaredBlocksIsNamed) {
  PoolDecode d(64, {6}, 1);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  const std::vector<int32_t> table = {0, 1, 5, 2};  // block 5 lies past the 4 declared
  d.indices = {0, 1, 2, 3, 4, 5};                   // positions 4 and 5: block entry 2
  p.indices = d.indices.data();
  p.addressing = PageAddressing::kBlockTable;
  p.block_table.data = table.data();
  p.block_table.row_stride = 4;
  p.block_table.max_blocks = 4;
  p.block_table.num_rows = 1;
  p.block_table.block_size = 2;
  p.block_table.num_blocks = 4;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "block 5 (block table entry 2 of request 0's row"));
  p.block_table.num_blocks = 6;
  EXPECT_NO_THROW(run_decode_cpu(p, plan, ws.data()));
}

// The work-item bound counts before it builds: 2^24 + 1 one-token chunks
// over three requests, refused without a list of that size.
TEST(SecondGuards, PlansPastTheWorkItemBoundAreRefusedBeforeBuilding) {
  PlanShape shape;
  shape.group_size = 1;
  shape.head_dim_v = 8;
  shape.chunk_granule = 1;
  shape.fixed_chunk_tokens = 1;
  const std::vector<int32_t> lens = {1 << 23, 1 << 23, 1};
  EXPECT_TRUE(throws_error_naming([&] { make_decode_plan(lens, shape); },
                                  "16777217 work items (chunks of 1 tokens) exceed the limit of 16777216"));
}

// gather_rows refuses a request of more rows than max_rows (it used to copy
// the first max_rows silently), before any row is written: the first
// request, and a later one behind a good one.
TEST(SecondGuards, GatherRowsRefusesMoreRowsThanMaxRows) {
  std::vector<float> pool(8 * 2, 1.0f);
  const std::vector<int32_t> rows = {0, 1, 2, 3, 4, 5};
  std::vector<float> dst(3 * 2 * 2, kNaN);
  const std::vector<int32_t> first_too_long = {0, 3, 4};
  EXPECT_TRUE(throws_error_naming(
      [&] {
        gather_rows(Device::kCpu, rows.data(), first_too_long.data(), 2, 2, DType::kF32, {pool.data(), 2, 2}, 8,
                    dst.data());
      },
      "request 0 has 3 rows, outside [0, max_rows = 2]"));
  const std::vector<int32_t> second_too_long = {0, 1, 4, 6};
  std::vector<uint16_t> pool16(8 * 2, float_to_bf16(1.0f)), dst16(3 * 2 * 2, 0xFFFF);
  EXPECT_TRUE(throws_error_naming(
      [&] {
        gather_rows(Device::kCpu, rows.data(), second_too_long.data(), 3, 2, DType::kBF16, {pool16.data(), 2, 2}, 8,
                    dst16.data());
      },
      "request 1 has 3 rows, outside [0, max_rows = 2]"));
  for (uint16_t x : dst16) EXPECT_EQ(x, 0xFFFF) << "a refused gather wrote a row";
  for (float x : dst) EXPECT_TRUE(std::isnan(x)) << "a refused gather wrote a row";
}

// A row outside the pool is written as NaN, never read: bf16 rows, the
// pool's last row and the one past it.
TEST(SecondGuards, GatherRowsWritesNaNForRowsOutsideThePool) {
  std::vector<uint16_t> pool(4 * 2);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = float_to_bf16(float(i));
  const std::vector<int32_t> rows = {3, 4, -7}, offsets = {0, 3};
  std::vector<uint16_t> dst(3 * 2, 0);
  gather_rows(Device::kCpu, rows.data(), offsets.data(), 1, 3, DType::kBF16, {pool.data(), 2, 2}, 4, dst.data());
  EXPECT_EQ(bf16_to_float(dst[0]), 6.0f);
  EXPECT_EQ(bf16_to_float(dst[1]), 7.0f);
  for (size_t i = 2; i < 6; ++i) EXPECT_TRUE(std::isnan(bf16_to_float(dst[i]))) << i;
}

// A cache assigned from another owns its rows: appends to the source after
// the assignment do not show in it.
TEST(SecondGuards, AnAssignedCacheOwnsItsRows) {
  DenseKVCache a(Device::kCpu, CacheMode::kBF16, 1, 1, 1, 2, 2, 2);
  DenseKVCache b(Device::kCpu, CacheMode::kBF16, 1, 1, 1, 2, 2, 2);
  std::vector<uint16_t> one = {float_to_bf16(1.0f), float_to_bf16(2.0f)},
                        two = {float_to_bf16(3.0f), float_to_bf16(4.0f)};
  b.append(one.data(), one.data(), DType::kBF16, 1);
  a = b;
  b.append(two.data(), two.data(), DType::kBF16, 1);
  const std::vector<float> mine = testing::cache_window(a, true);
  ASSERT_EQ(a.live_len(), 1);
  EXPECT_EQ(mine, (std::vector<float>{1.0f, 2.0f}));
  const auto* rows = static_cast<const uint16_t*>(a.k_rows().value().data);
  EXPECT_NE(rows, static_cast<const uint16_t*>(b.k_rows().value().data)) << "the two caches share storage";
}

// The page-table builder refuses an offset of a whole page, and a negative
// one, naming the request.
TEST(SecondGuards, TheBuilderRefusesOffsetsOutsideThePage) {
  EXPECT_TRUE(throws_error_naming(
      [&] {
        build_page_table_structure({3, 5}, 8, {0, 8});
      },
      "first_page_offsets[1] = 8 is outside [0, page_size = 8)"));
  EXPECT_TRUE(throws_error_naming(
      [&] {
        build_page_table_structure({3, 5, 2}, 8, {0, 1, -1});
      },
      "first_page_offsets[2] = -1 is outside [0, page_size = 8)"));
}

// check_page_table (the throwing form) names a last_page_len on an empty request.
TEST(SecondGuards, CheckPageTableNamesALastPageLenOnAnEmptyRequest) {
  PageTableStructure t = build_page_table_structure({4, 0, 2}, 4);
  t.last_page_len[1] = 4;
  EXPECT_TRUE(
      throws_error_naming([&] { check_page_table(t); }, "last_page_len[1] = 4 on an empty request, expected 0"));
}

// build_selection_mask names host offsets that decrease, leaving the mask.
TEST(SecondGuards, TheSelectionMaskNamesDecreasingOffsets) {
  const std::vector<int32_t> positions = {0, 1, 2, 3}, offsets = {0, 3, 1, 4};
  std::vector<float> mask(3 * 5, 7.0f);
  EXPECT_TRUE(throws_error_naming(
      [&] { build_selection_mask(Device::kCpu, positions.data(), offsets.data(), 3, 5, mask.data()); },
      "offsets decrease at request 1"));
  for (float x : mask) EXPECT_EQ(x, 7.0f);
}

// A sequence's block-table row out of range (negative here), named before
// anything is read.
TEST(SecondGuards, ARowOfSequenceOutsideTheTableIsNamed) {
  PoolDecode d(64, {4}, 1);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  const std::vector<int32_t> table = {0, 1, 2, 3}, rows = {-1};
  d.indices = {0, 1, 2, 3};
  p.addressing = PageAddressing::kBlockTable;
  p.block_table = {table.data(), 4, 4, 1, 2, 4, rows.data()};
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "block_table.row_of_sequence[0] = -1 is outside the table's 1 rows"));
}

// Negative strides of a strided q (or o) are named.
TEST(SecondGuards, NegativeQueryStridesAreNamed) {
  PoolDecode d(64, {2, 2}, 1);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  p.qo_layout = QueryLayout::kStrided;
  p.q_strides = {4, -4};
  p.o_strides = {4, 4};
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "q_strides.seq_stride and q_strides.head_stride must not be negative"));
  p.q_strides = {4, 4};
  p.o_strides = {-4, 4};
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "o_strides.seq_stride and o_strides.head_stride must not be negative"));
}

// A merge list naming another request's slots: refused by the plan check
// and by the backend.
TEST(SecondGuards, AMergeListNamingAnotherRequestsSlotsIsRefused) {
  PoolDecode d(64, {20, 20}, 1);
  DecodePlan plan = d.plan(8);
  ASSERT_EQ(plan.merge_requests.size(), 2u);
  std::swap(plan.merge_requests[0], plan.merge_requests[1]);
  EXPECT_TRUE(throws_error_naming([&] { check_decode_plan(plan); }, "but belongs to another"));
  Buffer ws(Device::kCpu, plan.workspace.total);
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(d.params(), plan, ws.data()); }, "belongs to another"));
}

// batch * num_kv_heads past 2^31 is refused by the fused path's decision,
// in int64 (it wrapped in int32 once).
TEST(SecondGuards, TheFusedPathRefusesMoreThanInt32Requests) {
  std::vector<float> x(16, 0.0f);
  SparseAttentionInputs in;
  in.dtype = DType::kF32;
  in.batch = 1 << 16;
  in.num_qo_heads = 1 << 16;
  in.num_kv_heads = 1 << 16;
  in.live_len = 1;
  in.k = RowView::dense(x.data(), 1 << 16, 1, 1);
  in.v = in.k;
  in.q = x.data();
  in.o = x.data();
  SparseDecoder decoder(Device::kCpu);
  EXPECT_TRUE(throws_error_naming([&] { decoder.decide(in, SparseSelection{}); }, "exceeds 2^31 - 1 requests"));
}

// A scale that is not finite is named by the decode's own check: NaN
// directly, infinity through the fused path.
TEST(SecondGuards, ANonFiniteScaleIsNamed) {
  PoolDecode d(64, {3}, 1);
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  p.scale = kNaN;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "scale is not finite"));
  std::vector<float> k(32, 0.5f), q(4, 1.0f), o(4, kNaN);
  SparseAttentionInputs in = f32_inputs(1, 8, k.data(), q.data(), o.data());
  in.scale = std::numeric_limits<float>::infinity();
  DispatchConfig config;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCpu, config);
  EXPECT_TRUE(throws_error_naming(
      [&] {
        decoder.try_fused(in, make_selection(Device::kCpu, {{1, 2}}));
      },
      "scale is not finite"));
  EXPECT_TRUE(std::isnan(o[0]));
}

// A kv_format outside the enum is named by the fused path before it plans.
TEST(SecondGuards, AKvFormatOutsideTheEnumIsNamedByTheFusedPath) {
  std::vector<float> k(32, 0.5f), q(4, 1.0f), o(4, kNaN);
  SparseAttentionInputs in = f32_inputs(1, 8, k.data(), q.data(), o.data());
  in.kv_format = static_cast<KvFormat>(7);
  SparseDecoder decoder(Device::kCpu);
  EXPECT_TRUE(throws_error_naming([&] { decoder.decide(in, make_selection(Device::kCpu, {{1}})); },
                                  "kv_format 7 is not a KvFormat"));
}

// Scores that are all NaN (every selected K row NaN, the query finite)
// poison the request; they must not read as an empty one (o = 0, lse = -inf).
TEST(SecondGuards, AllNaNScoresPoisonTheRequest) {
  PoolDecode d(64, {3, 2}, 1);
  d.indices = {10, 11, 12, 20, 21};
  for (int32_t row : {10, 11, 12}) {
    for (int32_t c = 0; c < PoolDecode::kDim; ++c) d.pool[size_t(row) * 4 + c] = kNaN;
  }
  const DecodePlan plan = d.plan();
  Buffer ws(Device::kCpu, plan.workspace.total);
  run_decode_cpu(d.params(), plan, ws.data());
  EXPECT_TRUE(std::isnan(d.lse[0]));
  EXPECT_TRUE(std::isnan(d.o[0]));
  EXPECT_TRUE(std::isfinite(d.lse[1]));
  EXPECT_TRUE(std::isfinite(d.o[4]));
}

// The merge keeps a poisoned partial poisoned beside an empty one (whose
// lse is -inf): the result is NaN, never the empty request's o = 0.
TEST(SecondGuards, MergeStatesKeepsAPoisonedPartialBesideAnEmptyOne) {
  const float nan_o[2] = {kNaN, kNaN}, zero_o[2] = {0.0f, 0.0f};
  const float nan_lse = kNaN, empty_lse = -std::numeric_limits<float>::infinity();
  float out[2], out_lse;
  cpu::merge_states({nan_o, zero_o}, {&nan_lse, &empty_lse}, 1, 2, out, &out_lse);
  EXPECT_TRUE(std::isnan(out_lse));
  EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out[1]));
  cpu::merge_states({zero_o, nan_o}, {&empty_lse, &nan_lse}, 1, 2, out, &out_lse);
  EXPECT_TRUE(std::isnan(out_lse));
}

// first_page_offset past the page in window addressing (page size 3): named
// before any position is checked against the window.
TEST(SecondGuards, AFirstPageOffsetPastThePageInWindowMode) {
  std::vector<float> k(2 * 16 * 4, 0.5f), q(2 * 4, 1.0f), o(2 * 4, kNaN);
  const std::vector<int32_t> lens = {4, 2}, indptr = {0, 2, 4}, pages = {0, 1, 0, 1};
  std::vector<int32_t> offsets = {0, 3};
  PlanShape shape;
  shape.group_size = 1;
  shape.head_dim_v = 4;
  const DecodePlan plan = make_decode_plan(lens, shape);
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p;
  p.dtype = DType::kF32;
  p.indptr = indptr.data();
  p.indices = pages.data();
  p.num_indices = 4;
  p.seq_lens = lens.data();
  p.first_page_offset = offsets.data();
  p.num_requests = 2;
  p.page_size = 3;
  p.addressing = PageAddressing::kWindow;
  p.window_len = 16;
  p.q = q.data();
  p.k = RowView::dense(k.data(), 1, 16, 4);
  p.v = p.k;
  p.o = o.data();
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "first_page_offset[1] = 3 is outside [0, page_size = 3)"));
  offsets[1] = 2;  // in range: slots 2 and 3 of pages 0 and 1
  EXPECT_NO_THROW(run_decode_cpu(p, plan, ws.data()));
}

// max_rows = 0 holds no row: a request of one row is refused, not dropped.
TEST(SecondGuards, GatherRowsWithNoRoomRefusesAnyRow) {
  std::vector<float> pool(4 * 3, 2.0f);
  const std::vector<int32_t> rows = {1}, offsets = {0, 0, 1};
  float dst = kNaN;
  EXPECT_TRUE(throws_error_naming(
      [&] {
        gather_rows(Device::kCpu, rows.data(), offsets.data(), 2, 0, DType::kF32, {pool.data(), 3, 3}, 4, &dst);
      },
      "request 1 has 1 rows, outside [0, max_rows = 0]"));
  const std::vector<int32_t> none = {0, 0, 0};
  EXPECT_NO_THROW(gather_rows(Device::kCpu, rows.data(), none.data(), 2, 0, DType::kF32, {pool.data(), 3, 3}, 4, &dst));
  EXPECT_TRUE(std::isnan(dst));
}

// An infinite scale (of either sign) is named too, on a split plan.
TEST(SecondGuards, AnInfiniteScaleIsNamedOnASplitPlan) {
  PoolDecode d(64, {30, 5}, 1);
  const DecodePlan plan = d.plan(8);
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = d.params();
  for (const float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    p.scale = bad;
    EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "scale is not finite"));
  }
  EXPECT_TRUE(std::isnan(d.lse[0]) && std::isnan(d.lse[1]));
}

}  // namespace
}  // namespace sparsepage
