// Lengths a kernel reads where it runs (window_lens, live_lens, seq_lens)
// and the views they index, on the CPU backend: every one is judged against
// its bound before anything is read (docs/RELIABILITY.md, "what is checked
// where"), and an accepted length reads exactly its own rows. Also the
// smaller holes found next to them: a dense view of an empty cache, a
// key-only cache's append, null indices.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/decode.h"
#include "sparsepage/fp8.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/selection.h"
#include "sparsepage/sparse_decode.h"
#include "support/engine_problem.h"
#include "support/expect_error.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::throws_error_naming;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A dense fp32 cache [B = 2, H = 2, cap, 8] in window addressing: row t of
// (b, h) holds values that depend on (b, h, t), and every row at or past
// `valid[b]` is NaN, so a read past a sequence's length poisons its output.
struct WindowProblem {
  static constexpr int32_t kDim = 8, kBatch = 2, kHeads = 2;
  int64_t cap = 16;
  std::vector<int64_t> valid;  // rows holding values, per sequence
  std::vector<float> k, v, q, o;
  std::vector<float> lse;

  WindowProblem(int64_t capacity, std::vector<int64_t> rows_with_values)
      : cap(capacity), valid(std::move(rows_with_values)) {
    const size_t rows = size_t(kBatch) * kHeads * size_t(cap);
    k.assign(rows * kDim, kNaN);
    v.assign(rows * kDim, kNaN);
    for (int32_t b = 0; b < kBatch; ++b) {
      for (int32_t h = 0; h < kHeads; ++h) {
        for (int64_t t = 0; t < valid[size_t(b)]; ++t) {
          const size_t row = (size_t(b) * kHeads + h) * size_t(cap) + size_t(t);
          for (int32_t d = 0; d < kDim; ++d) {
            k[row * kDim + d] = std::sin(0.3f * float(t) + 0.7f * float(d) + float(b) - 0.5f * float(h));
            v[row * kDim + d] = std::cos(0.2f * float(t) - 0.4f * float(d) + 2.0f * float(b) + float(h));
          }
        }
      }
    }
    q.resize(size_t(kBatch) * kHeads * kDim);
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0.1f * float(i % 7) - 0.3f;
    o.assign(q.size(), kNaN);
    lse.assign(size_t(kBatch) * kHeads, kNaN);
  }

  // One page id (position) list per request r = b * kHeads + h, page size 1.
  DecodeParams params(const PageTableStructure& table, const std::vector<int32_t>& ids, int64_t window_len,
                      const int32_t* window_lens) {
    DecodeParams p;
    p.dtype = DType::kF32;
    p.indptr = table.indptr.data();
    p.indices = ids.data();
    p.num_indices = int64_t(ids.size());
    p.seq_lens = table.seq_lens.data();
    p.num_requests = kBatch * kHeads;
    p.num_kv_heads = kHeads;
    p.addressing = PageAddressing::kWindow;
    p.window_len = window_len;
    p.window_lens = window_lens;
    p.q = q.data();
    p.k = RowView::dense(k.data(), kHeads, cap, kDim);
    p.v = RowView::dense(v.data(), kHeads, cap, kDim);
    p.o = o.data();
    p.lse = lse.data();
    return p;
  }

  // fp64 attention of request r over its positions.
  std::vector<double> reference(int32_t r, const std::vector<int32_t>& positions, double* lse_out) const {
    const int32_t b = r / kHeads, h = r % kHeads;
    std::vector<double> scores;
    for (int32_t t : positions) {
      const size_t row = (size_t(b) * kHeads + h) * size_t(cap) + size_t(t);
      double dot = 0;
      for (int32_t d = 0; d < kDim; ++d) dot += double(q[size_t(r) * kDim + d]) * k[row * kDim + d];
      scores.push_back(dot);
    }
    const double m = *std::max_element(scores.begin(), scores.end());
    std::vector<double> out(kDim, 0.0);
    double sum = 0;
    for (size_t j = 0; j < positions.size(); ++j) {
      const double w = std::exp(scores[j] - m);
      sum += w;
      const size_t row = (size_t(b) * kHeads + h) * size_t(cap) + size_t(positions[j]);
      for (int32_t d = 0; d < kDim; ++d) out[size_t(d)] += w * v[row * kDim + d];
    }
    for (double& x : out) x /= sum;
    *lse_out = m + std::log(sum);
    return out;
  }
};

DecodePlan plan_for(const std::vector<int32_t>& counts, int32_t dim) {
  PlanShape shape;
  shape.group_size = 1;
  shape.head_dim_v = dim;
  shape.num_sms = 2;
  return make_decode_plan(counts, shape);
}

// The check a mutant once skipped: the window of each sequence is its own
// window_lens entry, not window_len. Sequence 1 is 6 tokens long inside a
// window_len of 10, so position 7 is outside it although below window_len
// (and its row holds NaN); sequence 0's position 7 is fine and matches fp64.
TEST(DeviceLengths, TheWindowCheckReadsEachSequencesOwnLength) {
  WindowProblem w(16, {10, 6});
  const std::vector<int32_t> window_lens = {10, 6};
  const std::vector<std::vector<int32_t>> selected = {{0, 7, 9}, {3}, {1, 5}, {0}};  // requests 0..3
  std::vector<int32_t> counts, ids;
  for (const auto& s : selected) {
    counts.push_back(int32_t(s.size()));
    ids.insert(ids.end(), s.begin(), s.end());
  }
  const PageTableStructure table = build_page_table_structure(counts, 1);
  const DecodePlan plan = plan_for(counts, WindowProblem::kDim);
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = w.params(table, ids, 10, window_lens.data());
  run_decode_cpu(p, plan, ws.data());
  for (int32_t r = 0; r < 4; ++r) {
    double lse = 0;
    const std::vector<double> want = w.reference(r, selected[size_t(r)], &lse);
    for (int32_t d = 0; d < WindowProblem::kDim; ++d) {
      EXPECT_NEAR(w.o[size_t(r) * WindowProblem::kDim + d], want[size_t(d)], 1e-5) << "request " << r;
    }
    EXPECT_NEAR(w.lse[size_t(r)], lse, 1e-5) << "request " << r;
  }
  // Request 2 is (sequence 1, head 0): position 7 lies past its 6 tokens.
  std::vector<int32_t> bad = ids;
  bad[4] = 7;
  const std::vector<float> before = w.o;
  p.indices = bad.data();
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "indices[4] = 7 names positions outside request 2's window of 6 tokens"));
  EXPECT_EQ(std::memcmp(before.data(), w.o.data(), before.size() * sizeof(float)), 0) << "a refused call wrote o";
  // Position 6 of sequence 1 is the first past it; 5 is the last inside.
  bad[4] = 6;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "request 2's window of 6 tokens"));
}

// The same rule through the entry point a layer calls, whose live_lens
// become the decode's window_lens: a selection of position 6 in a sequence
// of 6 tokens (live_len 10) is refused.
TEST(DeviceLengths, SparseDecoderChecksPositionsAgainstLiveLens) {
  WindowProblem w(16, {10, 6});
  const std::vector<int32_t> live_lens = {10, 6};
  SparseAttentionInputs in;
  in.dtype = DType::kF32;
  in.batch = 2;
  in.num_qo_heads = 2;
  in.num_kv_heads = 2;
  in.live_len = 10;
  in.live_lens = live_lens.data();
  in.k = RowView::dense(w.k.data(), 2, w.cap, WindowProblem::kDim);
  in.v = RowView::dense(w.v.data(), 2, w.cap, WindowProblem::kDim);
  in.q = w.q.data();
  in.o = w.o.data();
  DispatchConfig config;
  config.min_sparsity = 0;
  SparseDecoder decoder(Device::kCpu, config);
  EXPECT_TRUE(decoder.try_fused(in, make_selection(Device::kCpu, {{9}, {9}, {5}, {0, 5}})).fused());
  EXPECT_TRUE(std::isfinite(w.o[3 * WindowProblem::kDim]));
  EXPECT_TRUE(throws_error_naming(
      [&] {
        decoder.try_fused(in, make_selection(Device::kCpu, {{9}, {9}, {5}, {6}}));
      },
      "request 3's window of 6 tokens"));
}

// window_lens past the rows a (sequence, head) holds would read the next
// head's rows: refused by name, negative and INT32_MIN too. Under a known
// capacity the bound is the capacity (a context that grew on the device past
// window_len reads its own rows, 13 of them here); under an unknown one it
// is window_len.
TEST(DeviceLengths, WindowLensOutsideTheirBoundAreRefused) {
  WindowProblem w(16, {16, 13});
  const std::vector<int32_t> counts = {1, 1, 1, 1};
  const std::vector<int32_t> ids = {15, 2, 12, 0};
  const PageTableStructure table = build_page_table_structure(counts, 1);
  const DecodePlan plan = plan_for(counts, WindowProblem::kDim);
  Buffer ws(Device::kCpu, plan.workspace.total);
  std::vector<int32_t> lens = {16, 13};
  DecodeParams p = w.params(table, ids, 10, lens.data());
  run_decode_cpu(p, plan, ws.data());  // past window_len, inside the capacity: the grown context
  double lse = 0;
  const std::vector<double> want = w.reference(2, {12}, &lse);
  EXPECT_NEAR(w.o[2 * WindowProblem::kDim], want[0], 1e-5);
  for (int32_t bad : {17, -1, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()}) {
    lens[1] = bad;
    EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                    "window_lens[1] = " + std::to_string(bad) + " is outside [0, 16]"))
        << bad;
  }
  lens = {16, 13};
  p.k.capacity = RowView::kUnknownCapacity;
  p.v.capacity = RowView::kUnknownCapacity;
  p.window_len = 13;
  lens[0] = 14;
  EXPECT_TRUE(
      throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "window_lens[0] = 14 is outside [0, 13]"));
  EXPECT_EQ(window_lens_bound(p), 13);
  p.k.capacity = 16;  // the smallest declared capacity rules
  EXPECT_EQ(window_lens_bound(p), 16);
  p.v.capacity = 15;
  EXPECT_EQ(window_lens_bound(p), 15);
}

// Under block-table addressing window_lens is the causal limit's live length:
// bounded by the table's positions.
TEST(DeviceLengths, BlockTableWindowLensAreBoundedByTheTable) {
  testing::EngineSpec spec;
  spec.mla = false;
  spec.num_seqs = 2;
  spec.num_kv_heads = 1;
  spec.group_size = 2;
  spec.head_dim = 64;
  spec.block_size = 16;
  spec.num_blocks = 32;
  spec.index = testing::EngineIndex::kPositions;
  spec.topk = 20;
  spec.context = 100;
  const testing::EngineProblem pb = testing::make_engine_problem(spec, 5);
  std::vector<uint8_t> o = testing::nan_values(spec.dtype, size_t(pb.o_elements));
  std::vector<float> lse(size_t(pb.num_requests()) * spec.group_size);
  PlanShape shape;
  shape.group_size = spec.group_size;
  shape.head_dim_v = pb.dim_v;
  const DecodePlan plan = pb.plan(shape);
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = pb.params(pb.host_arrays(o.data(), lse.data()));
  ASSERT_EQ(p.addressing, PageAddressing::kBlockTable);
  const int64_t bound = int64_t{p.block_table.max_blocks} * p.block_table.block_size;
  EXPECT_EQ(window_lens_bound(p), bound);
  std::vector<int32_t> lens = {int32_t(bound), 50};
  p.window_lens = lens.data();
  EXPECT_NO_THROW(run_decode_cpu(p, plan, ws.data()));
  lens[0] = int32_t(bound) + 1;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                  "window_lens[0] = " + std::to_string(bound + 1) + " is outside [0, " +
                                      std::to_string(bound) + "], the block table's"));
  lens[0] = -5;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "window_lens[0] = -5"));
}

// seq_lens as far from the plan as an int32 goes: named, never wrapped.
TEST(DeviceLengths, SeqLensAtTheInt32ExtremesAreNamed) {
  WindowProblem w(16, {10, 10});
  const std::vector<int32_t> counts = {2, 1, 1, 1};
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4};
  const PageTableStructure table = build_page_table_structure(counts, 1);
  const DecodePlan plan = plan_for(counts, WindowProblem::kDim);
  Buffer ws(Device::kCpu, plan.workspace.total);
  DecodeParams p = w.params(table, ids, 10, nullptr);
  for (int32_t bad : {std::numeric_limits<int32_t>::min(), -1, 3, std::numeric_limits<int32_t>::max()}) {
    std::vector<int32_t> lens = {2, 1, 1, 1};
    lens[0] = bad;
    p.seq_lens = lens.data();
    EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); },
                                    "seq_lens[0] = " + std::to_string(bad) + " must lie in [0, 2]"))
        << bad;
  }
}

// The mask path's live_lens: within [0, live_len] or refused (they were
// clamped silently before).
TEST(DeviceLengths, MaskedDecodeLiveLensOutsideTheWindowAreRefused) {
  WindowProblem w(16, {16, 16});
  MaskedDecodeParams m;
  m.dtype = DType::kF32;
  m.batch = 2;
  m.num_kv_heads = 2;
  m.group_size = 1;
  m.live_len = 12;
  m.q = w.q.data();
  m.k = RowView::dense(w.k.data(), 2, w.cap, WindowProblem::kDim);
  m.v = RowView::dense(w.v.data(), 2, w.cap, WindowProblem::kDim);
  m.o = w.o.data();
  m.lse = w.lse.data();
  std::vector<int32_t> lens = {12, 4};
  m.live_lens = lens.data();
  run_masked_decode_cpu(m);
  std::vector<int32_t> first4 = {0, 1, 2, 3};
  double lse = 0;
  const std::vector<double> want = w.reference(3, first4, &lse);
  EXPECT_NEAR(w.lse[3], lse, 1e-5);
  EXPECT_NEAR(w.o[3 * WindowProblem::kDim + 5], want[5], 1e-5);
  for (int32_t bad : {13, -1, std::numeric_limits<int32_t>::min()}) {
    lens[1] = bad;
    EXPECT_TRUE(throws_error_naming([&] { run_masked_decode_cpu(m); },
                                    "live_lens[1] = " + std::to_string(bad) + " is outside [0, live_len = 12]"))
        << bad;
  }
}

// A dense view of an empty cache knows it holds no rows: a capacity of 0 is
// zero rows, not "unknown", so no read of it is accepted.
TEST(DeviceLengths, ADenseViewOfAnEmptyCacheHoldsNoRows) {
  std::vector<float> storage(64, kNaN), q(8, 1.0f), o(8, kNaN);
  const RowView empty = RowView::dense(storage.data(), 1, 0, 8);
  EXPECT_EQ(empty.capacity, 0);
  EXPECT_EQ(row_view_problem(empty, "k", 1, 1, 0, 4), "");
  EXPECT_EQ(row_view_problem(empty, "k", 1, 1, 4, 4), "k: 4 rows per head exceed k.capacity = 0");
  SparseAttentionInputs in;
  in.dtype = DType::kF32;
  in.batch = 1;
  in.num_qo_heads = 1;
  in.num_kv_heads = 1;
  in.live_len = 4;
  in.k = empty;
  in.v = empty;
  in.q = q.data();
  in.o = o.data();
  SparseDecoder decoder(Device::kCpu);
  EXPECT_TRUE(throws_error_naming([&] { decoder.decide(in, make_selection(Device::kCpu, {{0}})); },
                                  "4 rows per head exceed k.capacity = 0"));
  MaskPath mask(Device::kCpu);
  EXPECT_TRUE(
      throws_error_naming([&] { mask.prepare(in, make_selection(Device::kCpu, {{0}})); }, "exceed k.capacity = 0"));
  // The FP8 MLA views of an empty pool, read as a pool of pages.
  const MlaFp8Views views = mla_fp8_views(storage.data(), 0);
  EXPECT_EQ(views.k.capacity, 0);
  EXPECT_NE(row_view_problem(views.k, "k", 1, 1, 1, 1), "");
  EXPECT_TRUE(std::isnan(o[0])) << "nothing was written";
}

// A key-only cache (v_heads 0, what a layer keeps for its indexer) has no V
// allocation; its append forms no address from it (UBSan reported null
// pointer arithmetic) and the keys land where k_rows says.
TEST(DeviceLengths, AKeyOnlyCacheAppendsItsKeys) {
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, 2, 1, 0, 8, 8, 4);
  std::vector<uint16_t> keys(2 * 3 * 8);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = float_to_bf16(float(i));
  cache.append(keys.data(), nullptr, DType::kBF16, 3);
  cache.append(keys.data(), nullptr, DType::kBF16, 0);
  ASSERT_EQ(cache.live_len(), 3);
  EXPECT_FALSE(cache.v_rows().has_value());
  const RowView k = cache.k_rows().value();
  const auto* rows = static_cast<const uint16_t*>(k.data);
  EXPECT_EQ(bf16_to_float(rows[k.offset(1, 0, 2) + 5]), float((1 * 3 + 2) * 8 + 5));
}

// Null indices with a nonzero num_indices is named; an empty matrix with
// null indices forms no pointer.
TEST(DeviceLengths, NullIndicesAreNamedUnlessThereAreNone) {
  WindowProblem w(16, {10, 10});
  const std::vector<int32_t> counts = {0, 0, 0, 0};
  const PageTableStructure table = build_page_table_structure(counts, 1);
  const DecodePlan plan = plan_for(counts, WindowProblem::kDim);
  Buffer ws(Device::kCpu, std::max<size_t>(plan.workspace.total, 64));
  const std::vector<int32_t> none;
  DecodeParams p = w.params(table, none, 10, nullptr);
  p.indices = nullptr;
  p.num_indices = 5;
  EXPECT_TRUE(throws_error_naming([&] { run_decode_cpu(p, plan, ws.data()); }, "indices is null but num_indices = 5"));
  p.num_indices = 0;
  p.index_layout = IndexLayout::kMatrix;
  p.index_width = 0;
  p.index_seq_stride = 1000;  // never multiplied into a null pointer
  EXPECT_NO_THROW(run_decode_cpu(p, plan, ws.data()));
  EXPECT_TRUE(std::isinf(w.lse[3]) && w.lse[3] < 0);
}

}  // namespace
}  // namespace sparsepage
