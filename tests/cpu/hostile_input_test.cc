// Hostile input to the public host functions: negative, overflowing or inconsistent sizes and null pointers
// come back as sparsepage::Error naming the argument, never as a crash, an
// out-of-bounds read, a std::length_error or a silent success.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/page_table.h"
#include "sparsepage/plan.h"
#include "sparsepage/selection.h"
#include "sparsepage/sparse_decode.h"
#include "support/expect_error.h"
#include "support/paged_block_pool.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::throws_error_naming;
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

// A selection whose counts were tampered with after construction.
SparseSelection with_counts(std::vector<int32_t> counts) {
  SparseSelection s = make_selection(Device::kCpu, {{0, 1, 2, 3}, {4, 5}});
  s.counts = std::move(counts);
  return s;
}

// Single-request f32 inputs over a 16-row dense window.
struct SmallInputs {
  std::vector<float> k = std::vector<float>(16 * 4, 0.5f), v = k, q = std::vector<float>(4, 1.0f);
  std::vector<float> o = std::vector<float>(4, 0.0f);
  SparseAttentionInputs in;
  explicit SmallInputs(int32_t batch = 1) {
    k.resize(size_t(batch) * 16 * 4, 0.5f);
    v = k;
    q.resize(size_t(batch) * 4, 1.0f);
    o.resize(size_t(batch) * 4);
    in.dtype = DType::kF32;
    in.batch = batch;
    in.num_qo_heads = 1;
    in.num_kv_heads = 1;
    in.live_len = 16;
    in.k = RowView::dense(k.data(), 1, 16, 4);
    in.v = RowView::dense(v.data(), 1, 16, 4);
    in.q = q.data();
    in.o = o.data();
  }
};

MaskedDecodeParams testing_one_request(std::vector<float>& buf, DType dtype) {
  MaskedDecodeParams m;
  m.dtype = dtype;
  m.batch = 1;
  m.num_kv_heads = 1;
  m.live_len = 1;
  m.q = m.o = buf.data();
  m.k = m.v = RowView::dense(buf.data(), 1, 1, 4);
  return m;
}

// Defect 2: negative counts are refused wherever they are read.
TEST(HostileSelection, NegativeCountsAreRefusedBeforeAnyRead) {
  const SparseSelection bad = with_counts({8, -2});  // sums to 6 = the indices held
  EXPECT_TRUE(throws_error_naming([&] { bad.total(); }, "counts[1] = -2 is negative"));
  EXPECT_TRUE(throws_error_naming([&] { bad.offsets(); }, "counts[1] = -2 is negative"));
  EXPECT_TRUE(throws_error_naming([&] { bad.materialize(); }, "counts[1] = -2 is negative"));
  SmallInputs s(2);
  MaskPath mask(Device::kCpu);
  EXPECT_TRUE(throws_error_naming([&] { mask.prepare(s.in, bad); }, "counts[1] = -2"));
  // prepare() on good counts, then run() with negative ones: still refused.
  const SparseSelection good = make_selection(Device::kCpu, {{0, 1}, {2}});
  mask.prepare(s.in, good);
  SparseSelection tampered = make_selection(Device::kCpu, {{0, 1}, {2}});
  tampered.counts = {4, -1};
  EXPECT_THROW(mask.run(s.in, tampered), Error);
  DispatchConfig config;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCpu, config);
  EXPECT_TRUE(throws_error_naming([&] { decoder.try_fused(s.in, bad); }, "counts[1] = -2"));
  EXPECT_TRUE(throws_error_naming([&] { decoder.decide(s.in, bad); }, "counts[1] = -2"));
}

// Defect 3: plans never divide by zero and never build unbounded work lists.
TEST(HostilePlan, ZeroMinChunkAndHugeWorkListsAreHandled) {
  PlanShape shape;
  shape.min_chunk_tokens = 0;  // documented as valid
  const DecodePlan empty = make_decode_plan({0, 0}, shape);
  EXPECT_EQ(empty.work.size(), 2u);
  EXPECT_GE(empty.chunk_tokens, 1);
  const DecodePlan some = make_decode_plan({0, 5, 300}, shape);
  EXPECT_EQ(some.work.back().token_end, 300);
  PlanShape tiny;
  tiny.fixed_chunk_tokens = 1;
  tiny.chunk_granule = 1;
  EXPECT_TRUE(throws_error_naming([&] { make_decode_plan({kInt32Max}, tiny); }, "work items"));
  tiny.chunk_granule = 64;  // 2^31 / 64 = 2^25 items: still too many
  EXPECT_TRUE(throws_error_naming([&] { make_decode_plan({kInt32Max}, tiny); }, "exceed the limit"));
  PlanShape wide;  // one work item per SM over a huge total: the chunk must still fit int32
  wide.num_sms = 1;
  wide.items_per_sm = 1;
  const DecodePlan big = make_decode_plan({kInt32Max, kInt32Max, kInt32Max}, wide);
  EXPECT_GT(big.chunk_tokens, 0);
  for (const WorkItem& w : big.work) EXPECT_LE(w.token_begin, w.token_end);
  PlanShape huge_group;
  huge_group.group_size = kInt32Max;
  huge_group.head_dim_v = kInt32Max;
  huge_group.fixed_chunk_tokens = 64;
  EXPECT_TRUE(throws_error_naming([&] { make_decode_plan({1 << 20}, huge_group); }, "workspace"));
  EXPECT_TRUE(throws_error_naming([&] { make_decode_plan({-3}, shape); }, "seq_lens[0] = -3"));
}

// Defect 4: sizes that overflow are refused before anything is allocated or written.
TEST(HostileSizes, BufferRefusesSizesThatWrap) {
  EXPECT_TRUE(throws_error_naming([] { Buffer b(Device::kCpu, SIZE_MAX - 10); }, "bytes ="));
  EXPECT_TRUE(throws_error_naming([] { Buffer b(Device::kCpu, SIZE_MAX); }, "bytes ="));
  Buffer ok(Device::kCpu, 100);
  EXPECT_EQ(ok.bytes(), 100u);
}

TEST(HostileSizes, DenseCacheCapacityStepNearTwoToTheSixty) {
  for (int64_t step : {int64_t{1} << 60, std::numeric_limits<int64_t>::max(), (int64_t{1} << 62) + 3}) {
    DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 2, 2, 2, 8, 8, step);
    const std::vector<uint16_t> k(2 * 2 * 8), v = k;
    EXPECT_THROW(cache.append(k.data(), v.data(), DType::kBF16, 1), Error) << step;
    EXPECT_EQ(cache.live_len(), 0) << "a refused append leaves the cache as it was";
    EXPECT_EQ(cache.capacity(), 0);
  }
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 1, 1, 1, 8, 8, 16);
  const std::vector<uint16_t> row(8);
  EXPECT_TRUE(throws_error_naming(
      [&] { cache.append(row.data(), row.data(), DType::kBF16, std::numeric_limits<int64_t>::max()); }, "new_tokens"));
}

TEST(HostileSizes, PagedPoolAppendAndBlockTable) {
  PagedBlockPool pool(Device::kCpu, DType::kBF16, 4, 1, 4, 2, 2);
  const int32_t seq = pool.add_sequence();
  const std::vector<uint16_t> kv(2 * 6);
  pool.append(seq, kv.data(), kv.data(), 6);
  EXPECT_TRUE(throws_error_naming([&] { pool.append(seq, kv.data(), kv.data(), std::numeric_limits<int64_t>::max()); },
                                  "do not fit"));
  EXPECT_EQ(pool.seq_len(seq), 6);
  EXPECT_EQ(pool.block_table(seq).size(), 2u);
  EXPECT_TRUE(throws_error_naming([&] { pool.append(seq, nullptr, kv.data(), 1); }, "non-null"));
  EXPECT_TRUE(throws_error_naming([&] { pool.append(7, kv.data(), kv.data(), 1); }, "sequence 7 does not exist"));
}

// A request may list a block many times; its token total must not wrap int32.
TEST(HostileSizes, BlockPageTableRefusesMoreThanInt32Tokens) {
  const int32_t block = 1 << 20;
  PagedBlockPool pool(Device::kCpu, DType::kBF16, 1, 1, block, 1, 1);
  const int32_t seq = pool.add_sequence();
  const std::vector<uint16_t> kv(static_cast<size_t>(block));
  pool.append(seq, kv.data(), kv.data(), block);
  const std::vector<int32_t> fine(2047, 0), wraps(2048, 0);
  EXPECT_EQ(pool.block_page_table({seq}, {0}, {fine}).first.seq_lens[0], 2047 * block);
  EXPECT_TRUE(throws_error_naming([&] { pool.block_page_table({seq}, {0}, {wraps}); }, "more than 2^31 - 1"));
}

TEST(HostileSizes, BatchTimesKvHeadsIsInt64OnTheMaskPath) {
  std::vector<float> buf(64);
  MaskedDecodeParams p;
  p.dtype = DType::kF32;
  p.batch = 1 << 16;
  p.num_kv_heads = 1 << 16;  // 2^32 requests: wrapped to 0 in int32 and "succeeded"
  p.live_len = 1;
  p.q = p.o = buf.data();
  p.k = p.v = RowView::dense(buf.data(), 1 << 16, 1, 1);
  EXPECT_TRUE(throws_error_naming([&] { run_masked_decode_cpu(p); }, "batch * num_kv_heads = 4294967296"));
  SmallInputs s;
  s.in.batch = 1 << 16;
  s.in.num_kv_heads = 1 << 16;
  s.in.num_qo_heads = 1 << 16;
  EXPECT_TRUE(throws_error_naming([&] { MaskPath(Device::kCpu).prepare(s.in, make_selection(Device::kCpu, {})); },
                                  "exceeds 2^31 - 1 requests"));
}

// Defect 5: a copied cache owns its rows.
TEST(HostileCache, CopiesDoNotShareStorage) {
  DenseKVCache a(Device::kCpu, CacheMode::kBF16, 1, 1, 1, 2, 2, 8);
  const std::vector<uint16_t> x = {float_to_bf16(1), float_to_bf16(1)};
  const std::vector<uint16_t> y = {float_to_bf16(2), float_to_bf16(2)};
  const std::vector<uint16_t> z = {float_to_bf16(3), float_to_bf16(3)};
  a.append(x.data(), x.data(), DType::kBF16, 1);
  DenseKVCache b = a;
  a.append(y.data(), y.data(), DType::kBF16, 1);
  b.append(z.data(), z.data(), DType::kBF16, 1);
  EXPECT_EQ(testing::cache_window(a, true), (std::vector<float>{1, 1, 2, 2}));
  EXPECT_EQ(testing::cache_window(b, true), (std::vector<float>{1, 1, 3, 3}));
  DenseKVCache c(Device::kCpu, CacheMode::kF16, 1, 1, 1, 2, 2, 8);
  const std::vector<uint16_t> fx = {float_to_f16(1), float_to_f16(-1)};
  c.append(fx.data(), fx.data(), DType::kF16, 1);
  c = a;  // copy assignment, too (over a cache of another mode)
  a.append(y.data(), y.data(), DType::kBF16, 1);
  EXPECT_EQ(c.live_len(), 2);
  EXPECT_EQ(testing::cache_window(c, false), (std::vector<float>{1, 1, 2, 2}));
}

// Defect 7: the public helpers validate their arguments.
TEST(HostileHelpers, BuildSelectionMaskAndKeptColumns) {
  std::vector<float> mask(8);
  const std::vector<int32_t> positions = {1, 2}, offsets = {0, 2};
  EXPECT_TRUE(throws_error_naming(
      [&] { build_selection_mask(Device::kCpu, positions.data(), offsets.data(), -1, 8, mask.data()); },
      "num_requests = -1"));
  EXPECT_TRUE(throws_error_naming(
      [&] { build_selection_mask(Device::kCpu, positions.data(), offsets.data(), 1, -8, mask.data()); },
      "live_len = -8"));
  EXPECT_TRUE(throws_error_naming(
      [&] { build_selection_mask(Device::kCpu, positions.data(), nullptr, 1, 8, mask.data()); }, "null"));
  EXPECT_TRUE(throws_error_naming(
      [&] { build_selection_mask(Device::kCpu, nullptr, offsets.data(), 1, 8, mask.data()); }, "positions"));
  const std::vector<int32_t> backwards = {0, 2, 1};
  std::vector<float> mask2(16);
  EXPECT_TRUE(throws_error_naming(
      [&] { build_selection_mask(Device::kCpu, positions.data(), backwards.data(), 2, 8, mask2.data()); },
      "offsets decrease at request 1"));
  const std::vector<int32_t> negative = {-2, 2};
  EXPECT_TRUE(throws_error_naming(
      [&] { build_selection_mask(Device::kCpu, positions.data(), negative.data(), 1, 8, mask.data()); },
      "offsets[0] = -2"));
  build_selection_mask(Device::kCpu, positions.data(), offsets.data(), 1, 8, mask.data());
  EXPECT_EQ(mask_kept_columns(Device::kCpu, mask.data(), 1, 8), (std::vector<std::vector<int32_t>>{{1, 2}}));
  EXPECT_TRUE(throws_error_naming([&] { mask_kept_columns(Device::kCpu, mask.data(), -1, 8); }, "num_requests = -1"));
  EXPECT_TRUE(throws_error_naming([&] { mask_kept_columns(Device::kCpu, mask.data(), 1, -1); }, "live_len = -1"));
  EXPECT_TRUE(throws_error_naming([&] { mask_kept_columns(Device::kCpu, nullptr, 1, 8); }, "mask is null"));
}

TEST(HostileHelpers, GatherRowsRefusesNegativeOffsetsAndNullPointers) {
  std::vector<uint16_t> pool(4 * 8), out(3 * 8);
  const std::vector<int32_t> rows = {0, 1, 2};
  const RowView view{pool.data(), 8, 8};
  const std::vector<int32_t> negative = {-5, 1};
  EXPECT_TRUE(throws_error_naming(
      [&] { gather_rows(Device::kCpu, rows.data(), negative.data(), 1, 3, DType::kBF16, view, 4, out.data()); },
      "offsets[0] = -5"));
  const std::vector<int32_t> dips = {0, 2, -1};
  std::vector<uint16_t> untouched(out.size(), 0x1234);
  EXPECT_TRUE(throws_error_naming(
      [&] { gather_rows(Device::kCpu, rows.data(), dips.data(), 2, 3, DType::kBF16, view, 4, untouched.data()); },
      "request 1 has -3 rows"));
  EXPECT_EQ(untouched, std::vector<uint16_t>(out.size(), 0x1234)) << "a refused gather writes nothing";
  const std::vector<int32_t> offsets = {0, 3};
  EXPECT_TRUE(throws_error_naming(
      [&] { gather_rows(Device::kCpu, nullptr, offsets.data(), 1, 3, DType::kBF16, view, 4, out.data()); }, "null"));
  EXPECT_TRUE(throws_error_naming(
      [&] { gather_rows(Device::kCpu, rows.data(), nullptr, 1, 3, DType::kBF16, view, 4, out.data()); },
      "offsets is null"));
  EXPECT_TRUE(throws_error_naming(
      [&] { gather_rows(Device::kCpu, rows.data(), offsets.data(), 1, 3, DType::kBF16, view, 4, nullptr); }, "null"));
}

TEST(HostileHelpers, ValidatePageTableRefusesLastPageLenOnAnEmptyRequest) {
  PageTableStructure t = build_page_table_structure({3, 0}, 2);
  EXPECT_EQ(page_table_problem(t), "");
  t.last_page_len[1] = 1;
  const std::string problem = page_table_problem(t);
  ASSERT_FALSE(problem.empty());
  EXPECT_NE(problem.find("last_page_len[1] = 1 on an empty request"), std::string::npos) << problem;
}

// Beyond the list: more public functions fed null pointers and bad sizes.
TEST(HostileHelpers, MemoryCopiesRefuseNullPointers) {
  std::vector<char> a(8);
  EXPECT_TRUE(throws_error_naming([&] { copy_bytes(nullptr, Device::kCpu, a.data(), Device::kCpu, 8); }, "null"));
  EXPECT_TRUE(throws_error_naming([&] { copy_2d(a.data(), Device::kCpu, 8, nullptr, Device::kCpu, 8, 4, 1); }, "null"));
  EXPECT_TRUE(throws_error_naming([&] { fill_bytes(nullptr, Device::kCpu, 0, 8); }, "null"));
  copy_bytes(nullptr, Device::kCpu, nullptr, Device::kCpu, 0);  // nothing to copy: fine
}

// Fuzzer finding (UBSan): converting zero elements through null pointers
// (an empty std::vector's data()) called memcpy(nullptr, nullptr, 0).
TEST(HostileHelpers, ZeroElementConversionsAcceptNullPointers) {
  to_float(DType::kF32, nullptr, nullptr, 0);
  from_float(DType::kF32, nullptr, nullptr, 0);
  from_float(DType::kBF16, nullptr, nullptr, 0);
  SUCCEED();
}

TEST(HostileHelpers, SparseDecoderRefusesNullAndInconsistentInputs) {
  DispatchConfig config;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCpu, config);
  const SparseSelection sel = make_selection(Device::kCpu, {{0, 3}});
  SmallInputs s;
  s.in.q = nullptr;
  EXPECT_TRUE(throws_error_naming([&] { decoder.try_fused(s.in, sel); }, "q and o must not be null"));
  SmallInputs t;
  t.in.live_len = 17;  // beyond the capacity
  EXPECT_TRUE(throws_error_naming([&] { decoder.try_fused(t.in, sel); }, "17 rows per head exceed k.capacity = 16"));
  SmallInputs u;
  u.in.num_qo_heads = 0;
  EXPECT_TRUE(throws_error_naming([&] { decoder.try_fused(u.in, sel); }, "num_qo_heads = 0"));
  SmallInputs w;
  SparseSelection short_indices = make_selection(Device::kCpu, {{0, 3}});
  short_indices.counts = {5};
  EXPECT_TRUE(throws_error_naming([&] { decoder.try_fused(w.in, short_indices); }, "fewer entries"));
}

TEST(HostileHelpers, RunFusedRefusesADeclinedDecision) {
  // run_fused launches a step its caller already decided; a declined
  // decision handed to it is refused by name, before any input is read.
  SparseDecoder decoder(Device::kCpu, DispatchConfig{});
  SmallInputs s;
  SparseDecodeOutcome declined;
  declined.kind = OutcomeKind::kKillSwitch;
  declined.reason = "SPARSEPAGE_SPARSE_DECODE=0";
  EXPECT_TRUE(throws_error_naming([&] { decoder.run_fused(s.in, PagedSelection{}, declined); },
                                  "run_fused was handed a declined decision (SPARSEPAGE_SPARSE_DECODE=0)"));
}

TEST(HostileHelpers, PageTableBuildersNameTheirArguments) {
  EXPECT_TRUE(throws_error_naming([] { build_page_table_structure({1}, 0); }, "page_size = 0"));
  EXPECT_TRUE(throws_error_naming([] { build_page_table_structure({-1}, 4); }, "seq_lens[0] = -1"));
  EXPECT_TRUE(throws_error_naming([] { build_page_table_structure({1, 2}, 4, {0}); }, "first_page_offsets has 1"));
  EXPECT_TRUE(throws_error_naming([] { build_page_table_structure({kInt32Max, kInt32Max}, 1); }, "2^31 - 1 pages"));
  PageTableStructure t = build_page_table_structure({3}, 2);
  t.indptr = {0};
  EXPECT_TRUE(throws_error_naming([&] { check_page_table(t); }, "indptr has 1 entries"));
  const std::vector<int32_t> pages = {0, 9};
  const PageTableStructure u = build_page_table_structure({3}, 2);
  EXPECT_TRUE(throws_error_naming([&] { check_page_table(u, &pages, 4); }, "indices[1] = 9"));
}

// Beyond the list: an outcome kind outside the enum indexed the per-kind
// counters out of bounds.
TEST(HostileHelpers, RecordOutcomeRefusesKindsOutsideTheEnum) {
  SparseDecodeOutcome outcome;
  outcome.kind = OutcomeKind::kCount;
  EXPECT_TRUE(throws_error_naming([&] { record_outcome(outcome); }, "is not an OutcomeKind"));
  outcome.kind = static_cast<OutcomeKind>(-1);
  EXPECT_TRUE(throws_error_naming([&] { record_outcome(outcome); }, "outcome kind -1"));
}

// Beyond the list: sizes whose byte span wraps 64-bit address arithmetic.
TEST(HostileSizes, PoolSpansPastTwoToTheSixtyTwoBytesAreRefused) {
  std::vector<float> buf(64);
  const std::vector<int32_t> lens = {1}, indptr = {0, 1}, indices = {0};
  PlanShape shape;
  shape.group_size = 1;
  shape.head_dim_v = 4;
  const DecodePlan plan = make_decode_plan(lens, shape);
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p;
  p.dtype = DType::kF32;
  p.indptr = indptr.data();
  p.indices = indices.data();
  p.num_indices = 1;
  p.seq_lens = lens.data();
  p.num_requests = 1;
  p.num_pool_pages = int64_t{1} << 40;
  p.q = p.o = buf.data();
  p.k = {buf.data(), int64_t{1} << 30, 4};
  p.v = {buf.data(), 4, 4};
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "k: 1099511627776 rows"));
  p.k.row_stride = 4;
  p.addressing = PageAddressing::kWindow;  // a window of 2^60 rows of 16 bytes
  p.window_len = int64_t{1} << 60;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "span more than 2^62 bytes"));

  MaskedDecodeParams m;
  m.dtype = DType::kF32;
  m.batch = 1;
  m.num_kv_heads = 1;
  m.live_len = 2;  // two rows 2^61 elements apart: 2^63 bytes
  m.q = m.o = buf.data();
  m.k = {buf.data(), int64_t{1} << 61, 4};
  m.v = RowView::dense(buf.data(), 1, 1, 4);
  EXPECT_TRUE(throws_error_naming([&] { run_masked_decode_cpu(m); }, "k: 2 rows of row_stride 2305843009213693952"));

  std::vector<uint16_t> pool(8), out(8);
  const std::vector<int32_t> offsets = {0, 1}, rows = {0};
  EXPECT_TRUE(throws_error_naming(
      [&] {
        gather_rows(Device::kCpu, rows.data(), offsets.data(), 1, int64_t{1} << 61, DType::kBF16,
                    RowView{pool.data(), 8, 8}, 1, out.data());
      },
      "gather_rows: num_requests * max_rows"));
}

// Beyond the list: an enum value outside its type (a bad cast or a
// corrupted struct) was converted as nothing, leaving outputs uninitialized.
TEST(HostileHelpers, EnumValuesOutsideTheirTypeAreRefused) {
  const auto bad = static_cast<DType>(7);
  std::vector<float> x(4, 1.0f), y(4, 2.0f);
  EXPECT_TRUE(throws_error_naming([&] { to_float(bad, x.data(), y.data(), 4); }, "dtype 7 is not a DType"));
  EXPECT_TRUE(throws_error_naming([&] { from_float(bad, x.data(), y.data(), 4); }, "dtype 7 is not a DType"));
  EXPECT_TRUE(throws_error_naming([] { DenseKVCache c(Device::kCpu, static_cast<CacheMode>(9), 1, 1, 1, 4, 4); },
                                  "mode 9 is not a CacheMode"));
  EXPECT_TRUE(throws_error_naming([&] { PagedBlockPool pool(Device::kCpu, bad, 1, 1, 4, 4, 4); }, "not a DType"));
  MaskedDecodeParams m = testing_one_request(x, bad);
  EXPECT_TRUE(throws_error_naming([&] { run_masked_decode_cpu(m); }, "dtype 7 is not a DType"));
  SmallInputs s;
  s.in.dtype = bad;
  DispatchConfig config;
  config.min_sparsity = 0;
  EXPECT_TRUE(throws_error_naming(
      [&] { SparseDecoder(Device::kCpu, config).try_fused(s.in, make_selection(Device::kCpu, {{0}})); },
      "dtype 7 is not a DType"));
}

// Beyond the list: DecodePlan's fields are public and the CPU backend
// indexes with them; an edited plan is refused, not followed out of bounds.
TEST(HostilePlan, EditedPlansAreRefusedByTheBackend) {
  std::mt19937_64 rng(1303);
  testing::ProblemSpec spec;
  spec.dtype = DType::kF32;
  spec.seq_lens = {300, 5, 0};
  spec.group_size = 2;
  spec.dim_qk = spec.dim_v = 8;
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  PlanShape shape;
  shape.group_size = 2;
  shape.head_dim_v = 8;
  shape.fixed_chunk_tokens = 64;
  const DecodePlan good = make_decode_plan(pb.table.seq_lens, shape);
  ASSERT_TRUE(good.needs_merge());
  check_decode_plan(good);
  std::vector<float> o(size_t(3 * 2 * 8));
  Buffer ws(Device::kCpu, good.workspace.total);
  run_decode_cpu(pb.host_params(o.data(), nullptr), good, ws.data());
  const auto refused = [&](DecodePlan plan, const std::string& needle) {
    return throws_error_naming([&] { run_decode_cpu(pb.host_params(o.data(), nullptr), plan, ws.data()); }, needle);
  };
  DecodePlan p = good;
  p.work[1].token_end = 400;
  EXPECT_TRUE(refused(p, "work[1] covers [64, 400) of request 0"));
  p = good;
  p.work.back().request = 7;
  EXPECT_TRUE(refused(p, "request 2 is not covered"));
  p = good;
  p.work[2].partial = p.work[1].partial;
  EXPECT_TRUE(refused(p, "already used"));
  p = good;
  p.work[0].partial = 1000;
  EXPECT_TRUE(refused(p, "partial slot 1000"));
  p = good;
  p.merge_requests[0] = 1;
  EXPECT_TRUE(refused(p, "belongs to another"));
  p = good;
  p.workspace.total = 256;
  EXPECT_TRUE(refused(p, "workspace.total = 256"));
  p = good;
  p.work.pop_back();
  EXPECT_TRUE(refused(p, "request 2 is not covered"));
}

}  // namespace
}  // namespace sparsepage
