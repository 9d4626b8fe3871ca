// libFuzzer target over the host-visible surface of sparsepage's CPU backend:
// page tables, plans, the paged decode, selections with the mask
// path and the fused path, the caches, the engines' inputs, per-sequence
// window lengths with multi-token steps, the FP8 KV formats (packed or
// strided o), step sequences of the three model layers with slots joining
// and leaving and chunked prefill between the steps, and the layers' engine
// forms with their prefill chunks (engine_forms_fuzz.cc), and the sparse
// prefill's own entry points (prefill_fuzz.cc). The last
// input byte picks the target (see LLVMFuzzerTestOneInput); the rest drives
// its structure, and a seed taken from the input fills values, so short
// inputs reach deep states. Shared helpers: fuzz_support.h.
//
// What every target asserts, besides "no crash, no sanitizer report":
// - a refusal is a sparsepage::Error (any other exception aborts), and a
//   refused call writes nothing: its output buffers are unchanged;
// - output buffers are guarded by canaries on both sides, checked after every
//   call, accepted or not;
// - an accepted decode matches the fp64 reference (tests/support/reference.h)
//   per request, lse included, and unselected rows (NaN-poisoned) never show.
//
// Build: cmake -DSPARSEPAGE_FUZZ=ON with clang (see docs/RELIABILITY.md).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "fuzz/fuzz_support.h"
#include "sparsepage/cache.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/query_strides.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/fp8.h"
#include "sparsepage/layer.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"
#include "sparsepage/page_table.h"
#include "sparsepage/plan.h"
#include "sparsepage/selection.h"
#include "sparsepage/sparse_decode.h"
#include "support/engine_problem.h"
#include "support/fp8_problem.h"
#include "support/multi_token.h"
#include "support/paged_block_pool.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

constexpr double kLseTolerance = 1e-3;

DType pick_dtype(FuzzedDataProvider& in) {
  const DType all[] = {DType::kF32, DType::kBF16, DType::kF16};
  return all[in.ConsumeIntegralInRange<int>(0, 2)];
}

std::string sci(double x) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g", x);
  return text;
}

// Per (request, head): NaN where and only where fp64 has NaN (a poisoned row
// the table names poisons exactly what it would in exact arithmetic), and a
// relative L2 within `o_tol` over the rest; lse within kLseTolerance.
void compare_allowing_nan(const testing::Reference& ref, const std::vector<float>& o, const std::vector<float>& lse,
                          int32_t dim_v, double o_tol, const char* what) {
  const size_t dv = static_cast<size_t>(dim_v);
  FUZZ_CHECK(o.size() == ref.o.size() && lse.size() == ref.lse.size(), std::string(what) + ": output sizes");
  for (size_t h = 0; h < lse.size(); ++h) {
    const std::string where = std::string(what) + " head " + std::to_string(h) + ": ";
    if (std::isnan(ref.lse[h])) {
      FUZZ_CHECK(std::isnan(lse[h]), where + "lse should be NaN");
    } else if (std::isinf(ref.lse[h])) {
      FUZZ_CHECK(std::isinf(lse[h]) && lse[h] < 0, where + "lse should be -inf");
    } else {
      FUZZ_CHECK(std::fabs(double{lse[h]} - ref.lse[h]) <= kLseTolerance,
                 where + "lse " + sci(lse[h]) + " vs fp64 " + sci(ref.lse[h]));
    }
    double diff = 0.0, norm = 0.0;
    for (size_t d = h * dv; d < (h + 1) * dv; ++d) {
      FUZZ_CHECK(std::isnan(o[d]) == std::isnan(ref.o[d]), where + "NaN where fp64 has none, or the reverse");
      if (std::isnan(ref.o[d])) continue;
      FUZZ_CHECK(std::isfinite(o[d]), where + "infinite output");
      diff += (o[d] - ref.o[d]) * (o[d] - ref.o[d]);
      norm += ref.o[d] * ref.o[d];
    }
    // Relative to the output, but never to less than a tenth of the size of
    // one V row (values are in [-1, 1]): an output that cancels to nearly 0
    // still carries the fp32 score error times |V|.
    FUZZ_CHECK(std::sqrt(diff) <= o_tol * std::max(std::sqrt(norm), 0.1 * std::sqrt(static_cast<double>(dim_v))),
               where + "o off by " + sci(std::sqrt(diff)) + " (norm " + sci(std::sqrt(norm)) + ")");
  }
}

// ---- page tables ---------------------------------------------------------
void fuzz_page_table(FuzzedDataProvider& in) {
  const int32_t page_size = in.ConsumeIntegralInRange<int32_t>(-2, 70000);
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, 12);
  std::vector<int32_t> lens, offsets;
  const bool with_offsets = in.ConsumeBool();
  for (size_t r = 0; r < n; ++r) {
    lens.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-3, 5000) : in.ConsumeIntegral<int32_t>());
    if (with_offsets) offsets.push_back(in.ConsumeIntegralInRange<int32_t>(-2, std::max(page_size, 1) + 1));
  }
  if (with_offsets && in.ConsumeBool() && !offsets.empty()) offsets.pop_back();
  PageTableStructure table;
  if (!accepted([&] { table = build_page_table_structure(lens, page_size, offsets); }, "build_page_table_structure")) {
    return;
  }
  FUZZ_CHECK(page_table_problem(table).empty(), "a built table fails its own validator");
  FUZZ_CHECK(table.num_pages() >= 0 && table.num_requests() == static_cast<int32_t>(n), "table sizes");
  // Tamper with one field: the validator must describe it or accept it, never crash.
  PageTableStructure bad = table;
  const int which = in.ConsumeIntegralInRange<int>(0, 6);
  const int32_t value = in.ConsumeIntegral<int32_t>();
  const size_t at = n == 0 ? 0 : in.ConsumeIntegralInRange<size_t>(0, n - 1);
  switch (which) {
    case 0:
      if (!bad.indptr.empty()) bad.indptr[std::min(at, bad.indptr.size() - 1)] = value;
      break;
    case 1:
      if (n) bad.last_page_len[at] = value;
      break;
    case 2:
      if (n) bad.first_page_offset[at] = value;
      break;
    case 3:
      if (n) bad.seq_lens[at] = value;
      break;
    case 4: bad.page_size = value; break;
    case 5:
      if (!bad.indptr.empty()) bad.indptr.pop_back();
      break;
    default: bad.last_page_len.push_back(value); break;
  }
  (void)page_table_problem(bad);
  // Indices against a pool.
  if (table.num_pages() <= 4096) {
    std::vector<int32_t> indices(static_cast<size_t>(table.num_pages()));
    for (int32_t& page : indices) page = in.ConsumeIntegralInRange<int32_t>(-1, 100);
    if (in.ConsumeBool() && !indices.empty()) indices.pop_back();
    const std::string problem = page_table_problem(table, &indices, 100);
    bool in_pool = static_cast<int64_t>(indices.size()) == table.num_pages();
    for (int32_t page : indices) in_pool = in_pool && page >= 0 && page < 100;
    FUZZ_CHECK(problem.empty() == in_pool, "page_table_problem disagrees about the indices");
  }
}

// ---- plans ---------------------------------------------------------------
void fuzz_plan(FuzzedDataProvider& in) {
  PlanShape shape;
  shape.group_size = in.ConsumeIntegralInRange<int32_t>(-1, 130);
  shape.head_dim_v = in.ConsumeIntegralInRange<int32_t>(-1, 600);
  shape.num_sms = in.ConsumeIntegralInRange<int32_t>(-1, 200);
  shape.items_per_sm = in.ConsumeIntegralInRange<int32_t>(-1, 16);
  shape.ctas_per_item = in.ConsumeIntegralInRange<int32_t>(-1, 8);
  shape.min_chunk_tokens =
      in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-1, 4096) : in.ConsumeIntegral<int32_t>();
  shape.chunk_granule = in.ConsumeIntegralInRange<int32_t>(-1, 256);
  shape.fixed_chunk_tokens = in.ConsumeBool() ? 0 : in.ConsumeIntegralInRange<int32_t>(-1, 4096);
  std::vector<int32_t> lens;
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, 64);
  for (size_t r = 0; r < n; ++r) {
    lens.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-1, 20000) : in.ConsumeIntegral<int32_t>());
  }
  DecodePlan plan;
  if (!accepted([&] { plan = make_decode_plan(lens, shape); }, "make_decode_plan")) return;
  FUZZ_CHECK(accepted([&] { check_decode_plan(plan); }, "check_decode_plan"), "a built plan fails check_decode_plan");
  FUZZ_CHECK(static_cast<int64_t>(plan.work.size()) <= kMaxWorkItems, "plan: more work items than the bound");
  FUZZ_CHECK(plan.chunk_tokens >= 1, "plan: chunk_tokens < 1");
  // Work items tile each request exactly, in order; partial slots are unique.
  std::vector<int64_t> covered(n, 0);
  std::vector<int32_t> items_of(n, 0);
  std::vector<bool> slot_used(static_cast<size_t>(std::max(plan.num_partials, 0)), false);
  for (const WorkItem& w : plan.work) {
    FUZZ_CHECK(w.request >= 0 && w.request < static_cast<int32_t>(n), "plan: request out of range");
    const size_t r = static_cast<size_t>(w.request);
    FUZZ_CHECK(w.token_begin == covered[r] && w.token_end >= w.token_begin && w.token_end <= lens[r],
               "plan: gap or overlap");
    FUZZ_CHECK(w.token_end - w.token_begin <= plan.chunk_tokens, "plan: chunk longer than chunk_tokens");
    covered[r] = w.token_end;
    ++items_of[r];
    if (w.partial >= 0) {
      FUZZ_CHECK(w.partial < plan.num_partials && !slot_used[static_cast<size_t>(w.partial)],
                 "plan: partial slot reused or out of range");
      slot_used[static_cast<size_t>(w.partial)] = true;
    }
  }
  for (size_t r = 0; r < n; ++r) FUZZ_CHECK(covered[r] == lens[r] && items_of[r] >= 1, "plan: request not covered");
  FUZZ_CHECK(plan.merge_indptr.size() == plan.merge_requests.size() + 1, "plan: merge lists");
  FUZZ_CHECK(plan.merge_indptr.back() == plan.num_partials, "plan: merge_indptr does not end at num_partials");
  const WorkspaceLayout& ws = plan.workspace;
  for (size_t offset :
       {ws.partial_o, ws.partial_lse, ws.work_items, ws.merge_indptr, ws.merge_requests, ws.error_flag}) {
    FUZZ_CHECK(offset % 256 == 0 && offset <= ws.total, "plan: workspace offset");
  }
}

// ---- the paged decode ------------------------------------------------------
// A random problem from the fuzzer's structure, then hostile edits; accepted
// runs must match fp64.
void fuzz_decode(FuzzedDataProvider& in) {
  testing::ProblemSpec spec;
  spec.dtype = pick_dtype(in);
  spec.page_size = in.ConsumeIntegralInRange<int32_t>(1, 9);
  spec.random_first_page_offset = in.ConsumeBool();
  spec.group_size = in.ConsumeIntegralInRange<int32_t>(1, 5);
  spec.dim_qk = in.ConsumeIntegralInRange<int32_t>(1, 24);
  spec.v_aliases_k = in.ConsumeBool();
  spec.dim_v =
      spec.v_aliases_k ? in.ConsumeIntegralInRange<int32_t>(1, spec.dim_qk) : in.ConsumeIntegralInRange<int32_t>(1, 24);
  spec.dim_extra = in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(1, 8) : 0;
  spec.k_row_padding = in.ConsumeIntegralInRange<int32_t>(0, 5);
  spec.v_row_padding = in.ConsumeIntegralInRange<int32_t>(0, 5);
  spec.extra_row_padding = in.ConsumeIntegralInRange<int32_t>(0, 5);
  spec.pool_pages = in.ConsumeIntegralInRange<int64_t>(1, 64);
  spec.allow_duplicates = true;
  spec.scale = static_cast<float>(in.ConsumeIntegralInRange<int>(1, 40)) / 16.0f;
  const size_t n = in.ConsumeIntegralInRange<size_t>(0, 6);
  for (size_t r = 0; r < n; ++r) spec.seq_lens.push_back(in.ConsumeIntegralInRange<int32_t>(0, 80));
  std::mt19937_64 rng(in.ConsumeIntegral<uint64_t>());
  testing::PagedProblem pb = testing::make_problem(spec, rng);

  PlanShape shape;
  shape.group_size = spec.group_size;
  shape.head_dim_v = spec.dim_v;
  shape.num_sms = in.ConsumeIntegralInRange<int32_t>(1, 8);
  shape.min_chunk_tokens = in.ConsumeIntegralInRange<int32_t>(0, 64);
  shape.chunk_granule = in.ConsumeIntegralInRange<int32_t>(1, 16);
  shape.fixed_chunk_tokens = in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(1, 40) : 0;
  DecodePlan plan = make_decode_plan(pb.table.seq_lens, shape);

  DecodeParams p = pb.host_params(nullptr, nullptr);
  // Hostile edits of the table and the arrays; each must be refused, or be
  // run exactly as stated. Edits never lie about the memory behind a pointer
  // (a larger row stride or page size than the pool has is the caller's
  // contract, not something a host check can see).
  std::vector<int32_t> indptr = pb.table.indptr;
  std::vector<int32_t> first = pb.table.first_page_offset;
  std::vector<int32_t> lens = pb.table.seq_lens;
  const int edit = in.ConsumeIntegralInRange<int>(0, 12);
  const int32_t value = in.ConsumeIntegralInRange<int32_t>(-3, 100);
  const size_t at = in.ConsumeIntegralInRange<size_t>(0, n);
  const int64_t pool_rows = pb.pool_rows();
  int64_t window_stride = 0;  // rows between requests' windows (edit 10)
  switch (edit) {
    case 1: indptr[at] = value; break;
    case 2:
      if (!pb.indices.empty()) pb.indices[at % pb.indices.size()] = value;
      break;
    case 3:
      if (n) first[at % n] = value;
      break;
    case 4:
      if (n) lens[at % n] = value;
      break;
    case 5: p.num_indices = value; break;
    case 6: p.page_size = std::min(value, spec.page_size); break;
    case 7: p.num_pool_pages = std::min<int64_t>(value, spec.pool_pages); break;
    case 8: p.k.row_stride = std::min<int64_t>(value, pb.k_row_stride); break;
    case 9: p.group_size = value; break;
    case 11:  // an edited plan: refused, or (if still consistent) run exactly
      if (!plan.work.empty()) {
        WorkItem& w = plan.work[at % plan.work.size()];
        switch (value % 4) {
          case 0: w.request = value; break;
          case 1: w.token_end = value; break;
          case 2: w.partial = value - 2; break;
          default: w.token_begin = value; break;
        }
      }
      if (value % 5 == 0 && !plan.merge_requests.empty()) plan.merge_requests[0] = value;
      if (value % 7 == 0) plan.workspace.total = static_cast<size_t>(value);
      break;
    case 10:  // window mode: request r's rows start window_stride rows into each stream
      window_stride =
          std::max<int64_t>(0, std::min<int64_t>(value, pool_rows / static_cast<int64_t>(std::max<size_t>(n, 1))));
      p.addressing = PageAddressing::kWindow;
      p.k.seq_stride = window_stride * p.k.row_stride;
      p.v.seq_stride = window_stride * p.v.row_stride;
      if (p.k_extra.data) p.k_extra.seq_stride = window_stride * p.k_extra.row_stride;
      // The window fits the caller's memory (a longer one would lie about it);
      // longer windows than the sequence stride are refused by the host check.
      p.window_len = in.ConsumeIntegralInRange<int64_t>(-2, window_stride);
      break;
    default: break;  // untouched: must be accepted
  }
  p.indptr = indptr.data();
  p.first_page_offset = first.data();
  p.seq_lens = lens.data();
  p.indices = pb.indices.data();
  if (edit != 5) p.num_indices = static_cast<int64_t>(pb.indices.size());
  const size_t heads = n * static_cast<size_t>(spec.group_size);
  const size_t esize = dtype_size(spec.dtype);
  Guarded o(heads * static_cast<size_t>(spec.dim_v) * esize), lse(heads * sizeof(float));
  Guarded workspace(plan.workspace.total, 0xFF);
  p.o = o.data();
  p.lse = static_cast<float*>(lse.data());
  const std::vector<uint8_t> o_before = o.payload(), lse_before = lse.payload();
  const bool ok = accepted([&] { run_decode_cpu(p, plan, workspace.data()); }, "run_decode_cpu");
  o.check_canaries("decode o");
  lse.check_canaries("decode lse");
  workspace.check_canaries("decode workspace");
  if (!ok) {
    FUZZ_CHECK(o.payload() == o_before && lse.payload() == lse_before, "a refused decode wrote its output");
    return;
  }
  // Accepted: resolve every visible token through the arrays exactly as
  // given, and compare with fp64 over those rows (NaN-poisoned rows the
  // table really names must come out NaN, the rest must match).
  std::vector<std::vector<int64_t>> rows(n);
  for (size_t r = 0; r < n; ++r) {
    const int64_t offset = first[r];
    for (int64_t t = 0; t < lens[r]; ++t) {
      const int64_t slot = offset + t;
      const int64_t page = p.indices[indptr[r] + slot / p.page_size];
      const int64_t row = window_stride * static_cast<int64_t>(r) + page * p.page_size + slot % p.page_size;
      FUZZ_CHECK(row >= 0 && row < pool_rows, "an accepted decode resolves a row outside the pool");
      if (p.addressing == PageAddressing::kWindow) {
        FUZZ_CHECK(page * p.page_size + slot % p.page_size < p.window_len, "window escaped");
      }
      rows[r].push_back(row);
    }
  }
  testing::PagedProblem seen = pb;
  seen.k_row_stride = p.k.row_stride;
  const auto ref = testing::reference_attention(seen, rows);
  std::vector<float> got_lse(heads);
  if (heads > 0) std::memcpy(got_lse.data(), lse.begin(), heads * sizeof(float));
  compare_allowing_nan(ref, testing::as_float(spec.dtype, o.payload()), got_lse, spec.dim_v, o_tolerance(spec.dtype),
                       "decode");
}

// ---- the engines' own inputs ----------------------------------------------
// A random problem in an engine's layout (DecodeParams' index matrix: DSA
// slot ids with -1 padding, indexer positions resolved through a block table,
// or the block table itself as pages; paged pools whose unread rows are NaN;
// packed or strided q / o), then at most one hostile edit. Untouched, it must
// be accepted and match fp64; each edit below must be refused with o and lse
// left as they were, except the free-form one, which may also run (it must
// then stay inside its buffers, which ASan and the canaries watch).
void fuzz_engine_inputs(FuzzedDataProvider& in) {
  testing::EngineSpec spec;
  spec.dtype = in.ConsumeBool() ? DType::kBF16 : DType::kF16;
  spec.mla = in.ConsumeIntegralInRange<int>(0, 3) == 0;  // 576-wide rows: fewer of them
  spec.num_seqs = in.ConsumeIntegralInRange<int32_t>(1, 4);
  spec.num_kv_heads = spec.mla ? 1 : in.ConsumeIntegralInRange<int32_t>(1, 2);
  spec.group_size = in.ConsumeIntegralInRange<int32_t>(1, 4);
  spec.head_dim = 8 * in.ConsumeIntegralInRange<int32_t>(1, 4);
  spec.block_size = in.ConsumeIntegralInRange<int32_t>(1, 8);
  spec.index = static_cast<testing::EngineIndex>(in.ConsumeIntegralInRange<int>(0, 2));
  spec.topk = in.ConsumeIntegralInRange<int32_t>(1, 12);
  spec.context = in.ConsumeIntegralInRange<int32_t>(1, 40);
  // Block tables hold distinct blocks per row: the pool must have enough.
  const int32_t need = (spec.context + spec.block_size - 1) / spec.block_size;
  spec.num_blocks = need + in.ConsumeIntegralInRange<int32_t>(1, 6);
  spec.per_head_indices = in.ConsumeBool();
  spec.pad_fraction = in.ConsumeBool() ? 0.3 : 0.0;
  spec.lengths = in.ConsumeBool();
  spec.strided_qo = in.ConsumeBool();
  testing::EngineProblem pb = testing::make_engine_problem(spec, in.ConsumeIntegral<uint64_t>());

  PlanShape shape;
  shape.group_size = spec.group_size;
  shape.head_dim_v = pb.dim_v;
  shape.num_sms = in.ConsumeIntegralInRange<int32_t>(1, 8);
  shape.min_chunk_tokens = in.ConsumeIntegralInRange<int32_t>(0, 32);
  shape.chunk_granule = in.ConsumeIntegralInRange<int32_t>(1, 8);
  const DecodePlan plan = pb.plan(shape);

  const size_t esize = dtype_size(spec.dtype);
  const size_t heads = static_cast<size_t>(pb.num_requests()) * static_cast<size_t>(spec.group_size);
  Guarded o(static_cast<size_t>(pb.o_elements) * esize), lse(heads * sizeof(float)), ws(plan.workspace.total, 0xFF);
  DecodeParams p = pb.params(pb.host_arrays(o.data(), static_cast<float*>(lse.data())));

  // A visible id: one that some request's first `len` ids hold and that is not padding.
  auto visible_id = [&]() -> int64_t {
    for (int32_t r = 0; r < pb.num_requests(); ++r) {
      const int32_t b = r / spec.num_kv_heads, h = r % spec.num_kv_heads;
      const int64_t row = int64_t{b} * p.index_seq_stride + int64_t{h} * p.index_head_stride;
      const int32_t len = spec.index == testing::EngineIndex::kBlockPages
                              ? (pb.lens[static_cast<size_t>(b)] + spec.block_size - 1) / spec.block_size
                          : pb.lens.empty() ? spec.topk
                                            : pb.lens[static_cast<size_t>(r)];
      for (int32_t i = 0; i < len; ++i) {
        if (pb.indices[static_cast<size_t>(row + i)] != -1) return row + i;
      }
    }
    return -1;
  };
  // What the edit leaves: the problem as made (exact), one that must be
  // refused, or (free form) anything but a crash or a write out of bounds.
  enum class Expect { kExact, kRefused, kAnything };
  Expect expect = Expect::kExact;
  const int64_t first_visible = visible_id();
  const int32_t hq = spec.num_kv_heads * spec.group_size;
  switch (in.ConsumeIntegralInRange<int>(0, 6)) {
    case 1:  // a visible id out of range: past the pool, the table's positions or the blocks; or -2
      if (first_visible < 0) break;
      pb.indices[static_cast<size_t>(first_visible)] =
          in.ConsumeBool()                                 ? -2
          : spec.index == testing::EngineIndex::kSlotIds   ? static_cast<int32_t>(pb.pool_slots())
          : spec.index == testing::EngineIndex::kPositions ? pb.max_blocks * spec.block_size
                                                           : spec.num_blocks;
      expect = Expect::kRefused;
      break;
    case 2:  // a length past what the plan was made for
      if (pb.lens.empty()) break;
      pb.lens[in.ConsumeIntegralInRange<size_t>(0, pb.lens.size() - 1)] =
          (spec.index == testing::EngineIndex::kBlockPages ? pb.max_blocks * spec.block_size : spec.topk) + 1;
      expect = Expect::kRefused;
      break;
    case 3:  // a matrix that runs past its elements
      p.num_indices = static_cast<int64_t>(pb.indices.size()) - in.ConsumeIntegralInRange<int64_t>(1, 3);
      expect = Expect::kRefused;
      break;
    case 4:  // a negative o stride, or o heads that overlap (when a sequence has several)
      p.qo_layout = QueryLayout::kStrided;
      p.q_strides = pb.q_strides;
      p.q_extra_strides = pb.q_extra_strides;
      if (in.ConsumeBool()) {
        p.o_strides = {pb.o_strides.seq_stride, -pb.o_strides.head_stride};
        expect = Expect::kRefused;
      } else if (hq > 1) {
        p.o_strides = {pb.o_strides.seq_stride, pb.dim_v - 1};
        expect = Expect::kRefused;
      }
      break;
    case 5:  // sequence 0's table row, or the block of its first visible position, out of range
      if (spec.index != testing::EngineIndex::kPositions || first_visible < 0 || first_visible >= pb.width) break;
      if (in.ConsumeBool()) {
        pb.row_of_sequence[0] = pb.table_rows;
      } else {
        const int32_t pos = pb.indices[static_cast<size_t>(first_visible)];
        pb.block_table[static_cast<size_t>(pb.row_of_sequence[0] * pb.max_blocks + pos / spec.block_size)] =
            spec.num_blocks;
      }
      expect = Expect::kRefused;
      break;
    case 6:  // free form: any id, any value
      pb.indices[in.ConsumeIntegralInRange<size_t>(0, pb.indices.size() - 1)] = in.ConsumeIntegral<int32_t>();
      expect = Expect::kAnything;
      break;
    default: break;  // untouched
  }
  const std::vector<uint8_t> o_before = o.payload(), lse_before = lse.payload();
  const bool ok = accepted([&] { run_decode_cpu(p, plan, ws.data()); }, "run_decode_cpu (engine inputs)");
  o.check_canaries("engine o");
  lse.check_canaries("engine lse");
  ws.check_canaries("engine workspace");
  FUZZ_CHECK(ok || expect != Expect::kExact, "an untouched engine-input problem was refused");
  FUZZ_CHECK(!ok || expect != Expect::kRefused, "an engine-input edit that must be refused ran");
  if (!ok) {
    FUZZ_CHECK(o.payload() == o_before && lse.payload() == lse_before, "a refused engine decode wrote its output");
    return;
  }
  if (expect != Expect::kExact) return;
  std::vector<float> got_lse(heads);
  if (heads > 0) std::memcpy(got_lse.data(), lse.begin(), heads * sizeof(float));
  const testing::EngineOutput got = testing::unpack_output(pb, o.payload(), got_lse);
  const std::string mismatch =
      testing::compare_engine(pb, testing::engine_reference(pb), got, o_tolerance(spec.dtype), kLseTolerance);
  FUZZ_CHECK(mismatch.empty(), "engine inputs: " + mismatch);
  FUZZ_CHECK(got.gaps_untouched, "engine inputs: a strided o's gaps were written");
}

// ---- selections, the mask path and the fused path ------------------------
void fuzz_selection_paths(FuzzedDataProvider& in) {
  const DType dtype = pick_dtype(in);
  const int32_t batch = in.ConsumeIntegralInRange<int32_t>(1, 3);
  const int32_t kv_heads = in.ConsumeIntegralInRange<int32_t>(1, 3);
  const int32_t group = in.ConsumeIntegralInRange<int32_t>(1, 4);
  const int32_t dim = in.ConsumeIntegralInRange<int32_t>(1, 16);
  const int32_t dim_v = in.ConsumeIntegralInRange<int32_t>(1, 16);
  const int64_t live = in.ConsumeIntegralInRange<int64_t>(0, 700);
  const int64_t cap = live + in.ConsumeIntegralInRange<int64_t>(0, 9);
  const int32_t pad_k = in.ConsumeIntegralInRange<int32_t>(0, 3), pad_v = in.ConsumeIntegralInRange<int32_t>(0, 3);
  const int32_t requests = batch * kv_heads;
  std::mt19937_64 rng(in.ConsumeIntegral<uint64_t>());

  // Selection: positions mostly inside the window, sometimes outside or repeated.
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(requests));
  bool in_window = true;
  for (auto& r : rows) {
    const size_t count = in.ConsumeIntegralInRange<size_t>(0, 40);
    for (size_t i = 0; i < count; ++i) {
      int32_t pos = live > 0 ? in.ConsumeIntegralInRange<int32_t>(0, static_cast<int32_t>(live - 1)) : 0;
      if (in.ConsumeIntegralInRange<int>(0, 15) == 0)
        pos = in.ConsumeIntegralInRange<int32_t>(-2, static_cast<int32_t>(cap) + 2);
      in_window = in_window && pos >= 0 && pos < live;
      r.push_back(pos);
    }
  }
  SparseSelection selection = make_selection(Device::kCpu, rows);
  const int tamper = in.ConsumeIntegralInRange<int>(0, 7);
  if (tamper == 1 && requests > 0) {
    // Other counts over the same indices: legal when non-negative and within
    // the indices, and then each request's rows are what the counts say.
    selection.counts[0] = in.ConsumeIntegralInRange<int32_t>(-3, 3);
    int64_t total = 0;
    bool valid = true;
    for (int32_t c : selection.counts) {
      valid = valid && c >= 0;
      total += c;
    }
    if (valid && total * 4 <= static_cast<int64_t>(selection.indices.bytes())) {
      const int32_t* flat = selection.indices.as<int32_t>();
      size_t at = 0;
      in_window = true;
      for (size_t r = 0; r < rows.size(); ++r) {
        rows[r].assign(flat + at, flat + at + selection.counts[r]);
        at += static_cast<size_t>(selection.counts[r]);
        for (int32_t pos : rows[r]) in_window = in_window && pos >= 0 && pos < live;
      }
    }
  }

  // Pools [requests, cap, stride] (K heads == V heads): every row outside the
  // in-window selection is NaN, so any read of one shows.
  testing::PagedProblem pb;  // used as the fp64 reference's description of the pools
  pb.spec.dtype = dtype;
  pb.spec.group_size = group;
  pb.spec.dim_qk = dim;
  pb.spec.dim_v = dim_v;
  pb.k_row_stride = dim + pad_k;
  pb.v_row_stride = dim_v + pad_v;
  pb.scale = static_cast<float>(in.ConsumeIntegralInRange<int>(1, 40)) / 16.0f;
  const size_t pool_rows = static_cast<size_t>(requests) * static_cast<size_t>(cap);
  pb.k_pool = testing::nan_values(dtype, pool_rows * static_cast<size_t>(pb.k_row_stride));
  pb.v_pool = testing::nan_values(dtype, pool_rows * static_cast<size_t>(pb.v_row_stride));
  const size_t esize = dtype_size(dtype);
  std::vector<std::vector<int64_t>> kept_set(static_cast<size_t>(requests)), kept_all(static_cast<size_t>(requests));
  for (int32_t r = 0; r < requests; ++r) {
    std::set<int32_t> seen;
    for (int32_t pos : rows[static_cast<size_t>(r)]) {
      if (pos < 0 || pos >= live) continue;
      const int64_t row = int64_t{r} * cap + pos;
      kept_all[static_cast<size_t>(r)].push_back(row);
      if (!seen.insert(pos).second) continue;
      kept_set[static_cast<size_t>(r)].push_back(row);
      const auto k = testing::random_values(dtype, static_cast<size_t>(dim), rng);
      const auto v = testing::random_values(dtype, static_cast<size_t>(dim_v), rng);
      std::copy(k.begin(), k.end(), pb.k_pool.begin() + static_cast<std::ptrdiff_t>(row * pb.k_row_stride * esize));
      std::copy(v.begin(), v.end(), pb.v_pool.begin() + static_cast<std::ptrdiff_t>(row * pb.v_row_stride * esize));
    }
  }
  pb.q = testing::random_values(dtype, static_cast<size_t>(requests) * group * dim, rng);
  pb.table.seq_lens.assign(static_cast<size_t>(requests), 0);  // sizes the reference's outputs

  // Per-sequence live lengths (SparseAttentionInputs::live_lens), sometimes:
  // mostly inside the window, sometimes past it (up to and past the
  // capacity) or negative. The mask path takes [0, live_len]; the fused path
  // reads positions below each sequence's own length, up to the capacity
  // (a row it then reads past live_len is NaN, and the reference says so).
  std::vector<int32_t> live_lens;
  if (in.ConsumeIntegralInRange<int>(0, 2) == 0) {
    for (int32_t b = 0; b < batch; ++b) {
      live_lens.push_back(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(0, static_cast<int32_t>(live))
                                           : in.ConsumeIntegralInRange<int32_t>(-2, static_cast<int32_t>(cap) + 2));
    }
  }
  bool mask_lens_ok = true, fused_ok = true;
  for (int32_t len : live_lens) {
    mask_lens_ok = mask_lens_ok && len >= 0 && len <= live;
    fused_ok = fused_ok && len >= 0 && len <= cap;
  }
  if (!live_lens.empty()) {
    for (int32_t r = 0; r < requests; ++r) {
      const int64_t window = live_lens[static_cast<size_t>(r / kv_heads)];
      std::set<int32_t> seen;
      kept_set[static_cast<size_t>(r)].clear();
      kept_all[static_cast<size_t>(r)].clear();
      for (int32_t pos : rows[static_cast<size_t>(r)]) {
        fused_ok = fused_ok && pos >= 0 && pos < window;
        if (pos >= 0 && pos < cap) kept_all[static_cast<size_t>(r)].push_back(int64_t{r} * cap + pos);
        if (pos >= 0 && pos < std::min<int64_t>(live, window) && seen.insert(pos).second) {
          kept_set[static_cast<size_t>(r)].push_back(int64_t{r} * cap + pos);
        }
      }
    }
  } else {
    fused_ok = in_window;
  }

  SparseAttentionInputs inputs;
  inputs.dtype = dtype;
  inputs.batch = batch;
  inputs.num_qo_heads = kv_heads * group;
  inputs.num_kv_heads = kv_heads;
  inputs.live_len = live;
  inputs.k = RowView::dense(pb.k_pool.data(), kv_heads, cap, dim, pb.k_row_stride);
  inputs.v = RowView::dense(pb.v_pool.data(), kv_heads, cap, dim_v, pb.v_row_stride);
  inputs.q = pb.q.data();
  inputs.scale = pb.scale;
  if (!live_lens.empty()) inputs.live_lens = live_lens.data();
  if (tamper == 2) inputs.live_len = cap + 1;
  if (tamper == 3) inputs.num_qo_heads = kv_heads > 1 ? kv_heads * group + 1 : 0;  // never a valid shape
  const size_t heads = static_cast<size_t>(requests) * group;
  auto run_path = [&](bool fused, const std::vector<std::vector<int64_t>>& expected) {
    Guarded o(heads * static_cast<size_t>(dim_v) * esize), lse(heads * sizeof(float));
    SparseAttentionInputs call = inputs;
    call.o = o.data();
    call.lse = static_cast<float*>(lse.data());
    const std::vector<uint8_t> o_before = o.payload();
    bool ran = false;
    const bool ok = accepted(
        [&] {
          if (fused) {
            DispatchConfig config;
            config.min_sparsity = 0;
            SparseDecoder decoder(Device::kCpu, config);
            ran = decoder.try_fused(call, selection).fused();
          } else {
            MaskPath mask(Device::kCpu);
            mask.prepare(call, selection);
            mask.run(call, selection);
            ran = true;
          }
        },
        fused ? "SparseDecoder::try_fused" : "MaskPath");
    o.check_canaries(fused ? "fused o" : "mask o");
    lse.check_canaries(fused ? "fused lse" : "mask lse");
    if (!ok || !ran) {
      FUZZ_CHECK(o.payload() == o_before, "a refused or declined call wrote its output");
      return ok;
    }
    FUZZ_CHECK(tamper != 1 || selection.counts.empty() || selection.counts[0] >= 0, "negative count accepted");
    FUZZ_CHECK(!fused || fused_ok, "the fused path accepted a position outside its sequence's window");
    FUZZ_CHECK(fused || mask_lens_ok, "the mask path accepted a live_lens entry outside [0, live_len]");
    const auto ref = testing::reference_attention(pb, expected);
    std::vector<float> got_lse(heads);
    if (heads > 0) std::memcpy(got_lse.data(), lse.begin(), heads * sizeof(float));
    compare_allowing_nan(ref, testing::as_float(dtype, o.payload()), got_lse, dim_v, o_tolerance(dtype),
                         fused ? "fused" : "mask path");
    return ok;
  };
  // A mask is a set (duplicates once, positions outside the window ignored);
  // the fused path counts each occurrence and refuses outside positions.
  run_path(false, kept_set);
  run_path(true, kept_all);
}

// ---- caches ----------------------------------------------------------------
void fuzz_caches(FuzzedDataProvider& in) {
  const int32_t batch = in.ConsumeIntegralInRange<int32_t>(1, 3);
  const int32_t k_heads = in.ConsumeIntegralInRange<int32_t>(1, 3), v_heads = in.ConsumeIntegralInRange<int32_t>(1, 3);
  const int32_t dk = in.ConsumeIntegralInRange<int32_t>(1, 8), dv = in.ConsumeIntegralInRange<int32_t>(1, 8);
  // Steps are small, or so large that the size checks must refuse them (a
  // step in between asks the allocator for terabytes, which is honest and
  // fails cleanly, but trips the fuzzer's malloc limit).
  const int64_t huge_steps[] = {int64_t{1} << 62, std::numeric_limits<int64_t>::max(), (int64_t{1} << 62) + 12345};
  const int64_t step =
      in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-1, 40) : huge_steps[in.ConsumeIntegralInRange<int>(0, 2)];
  // Token counts are what the buffers hold, or ones that must be refused.
  const int64_t hostile_tokens[] = {-1, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(),
                                    int64_t{1} << 40};
  DenseKVCache* cache = nullptr;
  std::vector<DenseKVCache> holder;
  if (!accepted([&] { holder.emplace_back(Device::kCpu, CacheMode::kBF16, batch, k_heads, v_heads, dk, dv, step); },
                "DenseKVCache")) {
    return;
  }
  cache = &holder.back();
  // Shadow model: per (b, h) the appended K rows in order (bf16 bits).
  std::vector<std::vector<uint16_t>> shadow(static_cast<size_t>(batch) * k_heads);
  std::vector<DenseKVCache> copies;
  std::vector<size_t> copy_len;
  for (int steps = in.ConsumeIntegralInRange<int>(0, 6); steps > 0; --steps) {
    const int64_t tokens = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 20)
                                            : hostile_tokens[in.ConsumeIntegralInRange<int>(0, 3)];
    const int64_t sane = std::clamp<int64_t>(tokens, 0, 20);
    std::vector<uint16_t> k(static_cast<size_t>(batch * k_heads * sane * dk)),
        v(static_cast<size_t>(batch * v_heads * sane * dv));
    for (size_t i = 0; i < k.size(); ++i)
      k[i] = float_to_bf16(static_cast<float>(in.ConsumeIntegralInRange<int>(-8, 8)));
    const int64_t live_before = cache->live_len();
    const bool ok = accepted([&] { cache->append(k.data(), v.data(), DType::kBF16, tokens); }, "append");
    if (!ok) {
      FUZZ_CHECK(cache->live_len() == live_before, "a refused append changed the live length");
      continue;
    }
    FUZZ_CHECK(tokens == sane, "an append of more tokens than were passed was accepted");
    for (size_t bh = 0; bh < shadow.size(); ++bh) {
      shadow[bh].insert(shadow[bh].end(), k.begin() + static_cast<std::ptrdiff_t>(bh * sane * dk),
                        k.begin() + static_cast<std::ptrdiff_t>((bh + 1) * sane * dk));
    }
    if (in.ConsumeBool()) {  // a copy must keep what it had, whatever the original does next
      copies.push_back(*cache);
      copy_len.push_back(shadow[0].size());
    }
  }
  const std::vector<float> window = testing::cache_window(*cache, true);
  const int64_t live = cache->live_len();
  for (size_t bh = 0; bh < shadow.size(); ++bh) {
    for (int64_t i = 0; i < live * dk; ++i) {
      FUZZ_CHECK(window[bh * static_cast<size_t>(live * dk) + static_cast<size_t>(i)] ==
                     bf16_to_float(shadow[bh][static_cast<size_t>(i)]),
                 "dense cache window differs from what was appended");
    }
  }
  for (size_t c = 0; c < copies.size(); ++c) {
    const std::vector<float> w = testing::cache_window(copies[c], true);
    const size_t len = copy_len[c];
    for (size_t i = 0; i < len; ++i) {
      FUZZ_CHECK(w[i] == bf16_to_float(shadow[0][i]), "a copied cache changed when the original appended");
    }
  }

  // A paged pool: appends and block-granular tables against a shadow.
  const int32_t blocks = in.ConsumeIntegralInRange<int32_t>(1, 8),
                block_size = in.ConsumeIntegralInRange<int32_t>(1, 8);
  PagedBlockPool pool(Device::kCpu, DType::kBF16, blocks, 1, block_size, 1, 1);
  const int32_t seq = pool.add_sequence();
  for (int steps = in.ConsumeIntegralInRange<int>(0, 4); steps > 0; --steps) {
    const int64_t tokens = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 30)
                                            : hostile_tokens[in.ConsumeIntegralInRange<int>(0, 3)];
    const std::vector<uint16_t> kv(static_cast<size_t>(std::clamp<int64_t>(tokens, 0, 30)));
    const int64_t before = pool.seq_len(seq);
    const size_t blocks_before = pool.block_table(seq).size();
    if (!accepted([&] { pool.append(seq, kv.data(), kv.data(), tokens); }, "PagedBlockPool::append")) {
      FUZZ_CHECK(pool.seq_len(seq) == before && pool.block_table(seq).size() == blocks_before,
                 "a refused append changed the sequence");
      continue;
    }
    FUZZ_CHECK(tokens >= 0 && tokens <= 30, "an append larger than the buffer was accepted");
  }
  std::vector<int32_t> picks;
  for (int i = in.ConsumeIntegralInRange<int>(0, 5); i > 0; --i)
    picks.push_back(in.ConsumeIntegralInRange<int32_t>(-1, blocks));
  std::pair<PageTableStructure, std::vector<int32_t>> table;
  if (accepted([&] { table = pool.block_page_table({seq}, {0}, {picks}); }, "block_page_table")) {
    FUZZ_CHECK(page_table_problem(table.first, &table.second, pool.num_pages()).empty(),
               "block_page_table made an invalid table");
  }
}

// ---- dispatch and the gather path -------------------------------------------
void fuzz_dispatch_gather(FuzzedDataProvider& in) {
  // The policy is a pure function of counts that may come from the environment.
  DispatchInput d;
  d.num_requests = in.ConsumeIntegral<int64_t>();
  d.selected_rows = in.ConsumeIntegral<int64_t>();
  d.live_len = in.ConsumeIntegral<int64_t>();
  d.raw_cache = in.ConsumeBool();
  d.head_dims_supported = in.ConsumeBool();
  d.device_available = in.ConsumeBool();
  d.layout_supported = in.ConsumeBool();
  DispatchConfig config;
  config.enabled = in.ConsumeBool();
  config.min_kv_tokens = in.ConsumeIntegral<int64_t>();
  config.min_kv_tokens_per_request = in.ConsumeIntegral<int64_t>();
  config.min_sparsity = in.ConsumeIntegral<int64_t>();
  const SparseDecodeOutcome outcome = decide_sparse_decode(d, config);
  FUZZ_CHECK(outcome.kind >= OutcomeKind::kFused && outcome.kind < OutcomeKind::kCount, "decide: kind");
  (void)outcome.describe();
  const std::string text = in.ConsumeRandomLengthString(24);
  (void)parse_count(text.c_str(), 7);
  (void)parse_enable_switch(text.c_str());

  // The gather path over a small pool: rows outside it come back NaN.
  const int32_t dim = in.ConsumeIntegralInRange<int32_t>(1, 6);
  const int64_t pool_rows = in.ConsumeIntegralInRange<int64_t>(0, 12);
  const int32_t requests = in.ConsumeIntegralInRange<int32_t>(-1, 3);
  const int64_t max_rows = in.ConsumeIntegralInRange<int64_t>(-1, 5);
  std::vector<int32_t> offsets(static_cast<size_t>(std::max(requests, 0)) + 1, 0), rows;
  for (size_t r = 1; r < offsets.size(); ++r) {
    offsets[r] = offsets[r - 1] + in.ConsumeIntegralInRange<int32_t>(-1, 6);
  }
  if (in.ConsumeBool()) offsets[0] = in.ConsumeIntegralInRange<int32_t>(-2, 2);
  const int32_t listed = std::max(0, std::max(offsets.back(), *std::max_element(offsets.begin(), offsets.end())));
  for (int32_t i = 0; i < listed; ++i) rows.push_back(in.ConsumeIntegralInRange<int32_t>(-1, 14));
  std::vector<float> pool(static_cast<size_t>(std::max<int64_t>(pool_rows, 1) * dim), 1.5f);
  Guarded out(static_cast<size_t>(std::max(requests, 0)) * static_cast<size_t>(std::max<int64_t>(max_rows, 0)) *
              static_cast<size_t>(dim) * sizeof(float));
  const std::vector<uint8_t> before = out.payload();
  const bool ok = accepted(
      [&] {
        gather_rows(Device::kCpu, rows.data(), offsets.data(), requests, max_rows, DType::kF32,
                    RowView{pool.data(), dim, dim}, pool_rows, out.data());
      },
      "gather_rows");
  out.check_canaries("gather_rows dst");
  FUZZ_CHECK(ok || out.payload() == before, "a refused gather_rows wrote its output");
  if (ok && requests > 0) {
    std::vector<float> got(out.bytes() / sizeof(float));
    if (!got.empty()) std::memcpy(got.data(), out.begin(), out.bytes());
    for (int32_t r = 0; r < requests; ++r) {
      for (int64_t i = 0; i < max_rows; ++i) {
        const float x = got[(static_cast<size_t>(r) * static_cast<size_t>(max_rows) + static_cast<size_t>(i)) * dim];
        const int64_t count = offsets[r + 1] - offsets[r];
        const bool inside = i < count && rows[static_cast<size_t>(offsets[r] + i)] >= 0 &&
                            rows[static_cast<size_t>(offsets[r] + i)] < pool_rows;
        FUZZ_CHECK(i >= count ? x == 0.0f : inside ? x == 1.5f : std::isnan(x), "gather_rows wrote a wrong row");
      }
    }
  }
}

// ---- per-sequence window lengths, multi-token steps, a strided o ---------
// A multi-token (or one-token) step over a dense window cache
// (support/multi_token.h): each sequence's live length is its window_lens
// entry, read where the kernel runs. Untouched, the step must match fp64;
// each edit of a length must be refused (past the capacity, negative, or
// below a selected position: the window check must read each sequence's
// own length) or, raised within the capacity, run with the new windows. o
// is packed or strided with gaps between heads, tokens and sequences, whose
// bytes are canaries that must never change, accepted or refused.
void fuzz_window_lengths(FuzzedDataProvider& in) {
  testing::MultiTokenSpec spec;
  spec.dtype = pick_dtype(in);
  spec.q_len = in.ConsumeIntegralInRange<int32_t>(1, 4);
  spec.num_kv_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
  spec.group_size = in.ConsumeIntegralInRange<int32_t>(1, 3);
  spec.page_size = in.ConsumeIntegralInRange<int32_t>(1, 5);
  spec.head_dim = in.ConsumeIntegralInRange<int32_t>(1, 16);
  spec.pages_per_request = in.ConsumeIntegralInRange<int32_t>(1, 6);
  const size_t batch = in.ConsumeIntegralInRange<size_t>(1, 3);
  for (size_t b = 0; b < batch; ++b) spec.live_lens.push_back(in.ConsumeIntegralInRange<int32_t>(spec.q_len, 60));
  const int32_t longest = *std::max_element(spec.live_lens.begin(), spec.live_lens.end());
  spec.capacity = longest + in.ConsumeIntegralInRange<int64_t>(0, 8);
  spec.seed = in.ConsumeIntegral<uint64_t>();
  testing::MultiTokenProblem pb = testing::make_multi_token_problem(spec);
  const int32_t hq = pb.num_qo_heads(), dim = spec.head_dim, q_len = spec.q_len;
  const size_t rows = batch * static_cast<size_t>(q_len) * static_cast<size_t>(hq);

  PlanShape shape;
  shape.group_size = spec.group_size * q_len;
  shape.head_dim_v = dim;
  shape.num_sms = in.ConsumeIntegralInRange<int32_t>(1, 6);
  shape.min_chunk_tokens = in.ConsumeIntegralInRange<int32_t>(0, 16);
  shape.chunk_granule = in.ConsumeIntegralInRange<int32_t>(1, 8);
  const DecodePlan plan = make_decode_plan(pb.seq_lens, shape);

  // o: packed, or with gaps of 0-3 elements after each head, token and sequence.
  const bool strided = in.ConsumeBool();
  QueryStrides os;
  os.head_stride = dim + (strided ? in.ConsumeIntegralInRange<int64_t>(0, 3) : 0);
  os.token_stride = hq * os.head_stride + (strided ? in.ConsumeIntegralInRange<int64_t>(0, 3) : 0);
  os.seq_stride = q_len * os.token_stride + (strided ? in.ConsumeIntegralInRange<int64_t>(0, 3) : 0);
  const size_t esize = dtype_size(spec.dtype);
  const size_t o_elements = batch * static_cast<size_t>(os.seq_stride);
  Guarded o(o_elements * esize, Guarded::kCanary), lse(rows * sizeof(float)), ws(plan.workspace.total, 0xFF);
  std::vector<int32_t> lens = pb.seq_lens, window = spec.live_lens;
  DecodeParams p = pb.params(pb.k.data(), pb.v.data(), pb.q.data(), pb.indptr.data(), pb.pages.data(), lens.data(),
                             window.data(), o.data(), static_cast<float*>(lse.data()));
  if (strided) {
    p.qo_layout = QueryLayout::kStrided;
    p.q_strides =
        qo_strides(pb.params(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr)).q;
    p.o_strides = os;
  }
  enum class Expect { kExact, kRefused };
  Expect expect = Expect::kExact;
  bool other_sequences_unchanged = false;  // one sequence's window moved: the others' o must not
  const size_t b = in.ConsumeIntegralInRange<size_t>(0, batch - 1);
  const int32_t live = spec.live_lens[b];
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 1: {  // past the capacity, or negative, or an int32 extreme
      const int32_t bad[] = {static_cast<int32_t>(pb.capacity) + in.ConsumeIntegralInRange<int32_t>(1, 3), -1,
                             std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
      window[b] = bad[in.ConsumeIntegralInRange<int>(0, 3)];
      expect = Expect::kRefused;
      break;
    }
    case 2:  // below position live - 1, which the final page always selects
      window[b] = live - in.ConsumeIntegralInRange<int32_t>(1, live);
      expect = Expect::kRefused;
      break;
    case 3:  // a window grown within the capacity: the new windows, exactly;
             // or any int32 at all, refused outside [live, capacity]
      window[b] = in.ConsumeBool() ? static_cast<int32_t>(in.ConsumeIntegralInRange<int64_t>(live, pb.capacity))
                                   : in.ConsumeIntegral<int32_t>();
      if (window[b] < live || window[b] > pb.capacity) {
        expect = Expect::kRefused;
      } else {
        pb.spec.live_lens[b] = window[b];
        other_sequences_unchanged = window[b] != live;
      }
      break;
    case 4: {  // a visible-token count outside [0, the plan's count]
      const size_t r = b * static_cast<size_t>(spec.num_kv_heads);
      lens[r] = in.ConsumeBool() ? -1 : pb.seq_lens[r] + in.ConsumeIntegralInRange<int32_t>(1, 3);
      expect = Expect::kRefused;
      break;
    }
    case 5:  // page ids that are not positions cannot take a causal limit
      if (q_len > 1) {
        p.addressing = PageAddressing::kPoolPages;
        p.num_pool_pages = 1;
        expect = Expect::kRefused;
      }
      break;
    default: break;
  }
  const std::vector<uint8_t> o_before = o.payload(), lse_before = lse.payload();
  const bool ok = accepted([&] { run_decode_cpu(p, plan, ws.data()); }, "run_decode_cpu (window lengths)");
  o.check_canaries("window-length o");
  lse.check_canaries("window-length lse");
  ws.check_canaries("window-length workspace");
  FUZZ_CHECK(ok == (expect == Expect::kExact), ok ? "a window-length edit that must be refused ran"
                                                  : "an untouched (or in-range) window-length problem was refused");
  if (!ok) {
    FUZZ_CHECK(o.payload() == o_before && lse.payload() == lse_before, "a refused decode wrote its output");
    return;
  }
  // Every byte of o outside its rows is still a canary; the rows match fp64.
  const std::vector<uint8_t> bytes = o.payload();
  std::vector<bool> in_row(o_elements, false);
  std::vector<uint8_t> packed(rows * static_cast<size_t>(dim) * esize);
  for (size_t i = 0; i < rows; ++i) {
    const size_t seq = i / (static_cast<size_t>(q_len) * hq), t = i / hq % q_len, h = i % hq;
    const size_t at = seq * static_cast<size_t>(os.seq_stride) + t * static_cast<size_t>(os.token_stride) +
                      h * static_cast<size_t>(os.head_stride);
    for (int32_t d = 0; d < dim; ++d) in_row[at + static_cast<size_t>(d)] = true;
    std::memcpy(packed.data() + i * static_cast<size_t>(dim) * esize, bytes.data() + at * esize,
                static_cast<size_t>(dim) * esize);
  }
  for (size_t e = 0; e < o_elements; ++e) {
    if (in_row[e]) continue;
    for (size_t k = 0; k < esize; ++k) FUZZ_CHECK(bytes[e * esize + k] == Guarded::kCanary, "a gap of o was written");
  }
  const testing::MultiTokenReference mt = testing::multi_token_reference(pb);
  testing::Reference ref;
  ref.o = mt.o;
  ref.lse = mt.lse;
  std::vector<float> got_lse(rows);
  std::memcpy(got_lse.data(), lse.begin(), rows * sizeof(float));
  compare_allowing_nan(ref, testing::as_float(spec.dtype, packed), got_lse, dim, o_tolerance(spec.dtype),
                       "window lengths");
  if (other_sequences_unchanged) {
    // The same step without the moved window: every other sequence's rows
    // (and the gaps) are bit-identical, so one sequence's length reaches
    // no other's output.
    std::vector<int32_t> original = spec.live_lens;
    Guarded o2(o_elements * esize, Guarded::kCanary), lse2(rows * sizeof(float)), ws2(plan.workspace.total, 0xFF);
    DecodeParams p2 = p;
    p2.window_lens = original.data();
    p2.o = o2.data();
    p2.lse = static_cast<float*>(lse2.data());
    FUZZ_CHECK(accepted([&] { run_decode_cpu(p2, plan, ws2.data()); }, "run_decode_cpu (window lengths, baseline)"),
               "the untouched window-length problem was refused");
    const std::vector<uint8_t> base = o2.payload();
    const size_t seq_bytes = static_cast<size_t>(os.seq_stride) * esize;
    for (size_t seq = 0; seq < batch; ++seq) {
      if (seq == b) continue;
      FUZZ_CHECK(std::equal(bytes.begin() + static_cast<std::ptrdiff_t>(seq * seq_bytes),
                            bytes.begin() + static_cast<std::ptrdiff_t>((seq + 1) * seq_bytes),
                            base.begin() + static_cast<std::ptrdiff_t>(seq * seq_bytes)),
                 "moving one sequence's window changed another sequence's output");
    }
  }
}

// ---- FP8 KV formats --------------------------------------------------------
// A paged problem stored as e4m3 with per-head scales (any dims and dtype) or
// as the DSA engines' 656-byte MLA rows (bf16, 512 + 64, wider pitches too),
// with at most one edit of the format's own fields that must be refused.
// Accepted: the fp64 attention over the exact dequantization, per head.
void fuzz_fp8(FuzzedDataProvider& in) {
  const bool mla = in.ConsumeBool();
  testing::ProblemSpec spec;
  spec.dtype = mla ? DType::kBF16 : pick_dtype(in);
  spec.page_size = in.ConsumeIntegralInRange<int32_t>(1, 4);
  spec.random_first_page_offset = in.ConsumeBool();
  spec.group_size = in.ConsumeIntegralInRange<int32_t>(1, mla ? 2 : 4);
  if (mla) {
    spec.dim_qk = spec.dim_v = 512;
    spec.dim_extra = 64;
    spec.v_aliases_k = true;
  } else {
    spec.dim_qk = in.ConsumeIntegralInRange<int32_t>(1, 24);
    spec.dim_v = in.ConsumeIntegralInRange<int32_t>(1, 24);
    spec.dim_extra = in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(1, 8) : 0;
    spec.k_row_padding = in.ConsumeIntegralInRange<int32_t>(0, 5);
    spec.v_row_padding = in.ConsumeIntegralInRange<int32_t>(0, 5);
  }
  spec.pool_pages = in.ConsumeIntegralInRange<int64_t>(1, mla ? 12 : 40);
  const size_t n = 2 * in.ConsumeIntegralInRange<size_t>(0, mla ? 1 : 3);  // even: two KV heads may share them
  for (size_t r = 0; r < n; ++r) spec.seq_lens.push_back(in.ConsumeIntegralInRange<int32_t>(0, mla ? 24 : 60));
  std::mt19937_64 rng(in.ConsumeIntegral<uint64_t>());
  const testing::PagedProblem pb = testing::make_problem(spec, rng);
  const int64_t pitches[] = {656, 672, 1024};
  const int32_t kv_heads = !mla && n > 0 && in.ConsumeBool() ? 2 : 1;
  testing::Fp8Problem f = mla ? testing::make_fp8_mla(pb, pitches[in.ConsumeIntegralInRange<int>(0, 2)])
                              : testing::make_fp8_per_head(pb, kv_heads);

  PlanShape shape;
  shape.group_size = spec.group_size;
  shape.head_dim_v = spec.dim_v;
  shape.num_sms = in.ConsumeIntegralInRange<int32_t>(1, 6);
  shape.min_chunk_tokens = in.ConsumeIntegralInRange<int32_t>(0, 32);
  shape.chunk_granule = in.ConsumeIntegralInRange<int32_t>(1, 8);
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, shape);
  const size_t heads = n * static_cast<size_t>(spec.group_size);
  const size_t esize = dtype_size(spec.dtype);
  Guarded o(heads * static_cast<size_t>(spec.dim_v) * esize), lse(heads * sizeof(float)),
      ws(plan.workspace.total, 0xFF);
  DecodeParams p = f.host_params(o.data(), static_cast<float*>(lse.data()));
  bool refuse = false;
  std::vector<int32_t> indices = pb.indices;
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 1:  // a scale missing, or scales given to the MLA rows
      if (mla)
        p.k_scale = f.k.empty() ? nullptr : reinterpret_cast<const float*>(f.k.data());
      else
        p.v_scale = nullptr;
      refuse = true;
      break;
    case 2:  // not a KvFormat
      p.kv_format = static_cast<KvFormat>(in.ConsumeIntegralInRange<int32_t>(3, 9));
      refuse = true;
      break;
    case 3:  // MLA rows too short for the scales, or V not K's view; a per-head K narrower than its row
      if (mla) {
        if (in.ConsumeBool())
          p.k.row_stride = p.v.row_stride = in.ConsumeIntegralInRange<int64_t>(512, 527);
        else
          p.v.seq_stride = 16;
        refuse = true;
      }
      break;
    case 4: {  // a page id outside the pool: refused when a visible token reads it
      if (indices.empty()) break;
      const size_t at = in.ConsumeIntegralInRange<size_t>(0, indices.size() - 1);
      indices[at] = in.ConsumeBool() ? -1 : static_cast<int32_t>(spec.pool_pages);
      p.indices = indices.data();
      for (size_t r = 0; r < n; ++r) {
        const int64_t len = pb.table.seq_lens[r], offset = pb.table.first_page_offset[r];
        const int64_t needed = len == 0 ? 0 : (offset + len + spec.page_size - 1) / spec.page_size;
        const auto first = static_cast<size_t>(pb.table.indptr[r]);
        refuse = refuse || (at >= first && at < first + static_cast<size_t>(needed));
      }
      break;
    }
    default: break;
  }
  // Sometimes a strided o (QueryLayout::kStrided, q as packed): gaps of 1-3
  // elements after every head and sequence hold canaries that must survive.
  const int32_t sequences = p.num_requests / std::max(p.num_kv_heads, 1);
  const int32_t heads_per_seq = p.num_kv_heads * p.group_size;
  const bool strided = in.ConsumeBool() && sequences > 0;
  QueryStrides os;
  os.head_stride = spec.dim_v + (strided ? in.ConsumeIntegralInRange<int64_t>(1, 3) : 0);
  os.seq_stride = heads_per_seq * os.head_stride + (strided ? in.ConsumeIntegralInRange<int64_t>(1, 3) : 0);
  const size_t o_elements = static_cast<size_t>(std::max(sequences, 0)) * static_cast<size_t>(os.seq_stride);
  Guarded so(strided ? o_elements * esize : 0, Guarded::kCanary);
  if (strided) {
    const QoStrides packed = qo_strides(p);
    p.qo_layout = QueryLayout::kStrided;
    p.q_strides = packed.q;
    p.q_extra_strides = packed.q_extra;
    p.o_strides = os;
    p.o = so.data();
  }
  Guarded& out = strided ? so : o;
  const std::vector<uint8_t> o_before = out.payload(), lse_before = lse.payload();
  const bool ok = accepted([&] { run_decode_cpu(p, plan, ws.data()); }, "run_decode_cpu (fp8)");
  out.check_canaries("fp8 o");
  lse.check_canaries("fp8 lse");
  ws.check_canaries("fp8 workspace");
  if (!ok) {
    FUZZ_CHECK(refuse, "an untouched FP8 problem was refused");
    FUZZ_CHECK(out.payload() == o_before && lse.payload() == lse_before, "a refused FP8 decode wrote its output");
    return;
  }
  FUZZ_CHECK(!refuse, "an FP8 edit that must be refused ran");
  std::vector<uint8_t> packed_o = out.payload();
  if (strided) {  // gather the rows; every other byte is still a canary
    const std::vector<uint8_t> bytes = so.payload();
    std::vector<bool> in_row(o_elements, false);
    packed_o.assign(heads * static_cast<size_t>(spec.dim_v) * esize, 0);
    for (size_t i = 0; i < heads; ++i) {
      const size_t at = i / static_cast<size_t>(heads_per_seq) * static_cast<size_t>(os.seq_stride) +
                        i % static_cast<size_t>(heads_per_seq) * static_cast<size_t>(os.head_stride);
      for (int32_t d = 0; d < spec.dim_v; ++d) in_row[at + static_cast<size_t>(d)] = true;
      std::memcpy(packed_o.data() + i * static_cast<size_t>(spec.dim_v) * esize, bytes.data() + at * esize,
                  static_cast<size_t>(spec.dim_v) * esize);
    }
    for (size_t e = 0; e < o_elements; ++e) {
      if (in_row[e]) continue;
      for (size_t k = 0; k < esize; ++k)
        FUZZ_CHECK(bytes[e * esize + k] == Guarded::kCanary, "a gap of an FP8 decode's o was written");
    }
  }
  std::vector<float> got_lse(heads);
  if (heads > 0) std::memcpy(got_lse.data(), lse.begin(), heads * sizeof(float));
  compare_allowing_nan(testing::reference_attention(f), testing::as_float(spec.dtype, packed_o), got_lse, spec.dim_v,
                       o_tolerance(spec.dtype), mla ? "fp8 mla" : "fp8 per head");
}

// ---- layer step sequences --------------------------------------------------
// One of the three layers (tests/support/continuous_batching.h drives them
// the same way, with fixed odds) through a random sequence of steps: admit
// and release of slots, lockstep appends, reserve, one-token, multi-token
// and prefill steps, mixed with calls that must be refused (a slot outside
// the batch, a negative or too large token count, a null token pointer, a
// q_len outside [1, kMaxQueryTokens], the engine-pool form on a layer with
// its own cache). The run keeps three views of the same requests:
// - the layer under test, which also gets the bad calls;
// - a twin fed only the accepted calls: every output must be bit-identical
//   to it, so a refused call left no trace (lengths, activity, selection,
//   plan, capacity-dependent buffers);
// - a lone batch-1 layer per request, fed that request's rows: each slot's
//   output must match it, so no slot's length reaches another's rows.
// A refused call must throw sparsepage::Error, start with the layer's name,
// name the problem, and leave kv_lens(), the slots' activity, kv_len() and
// the capacity as they were. Free slots must output zeros, and every step's
// o is guarded by canaries.
namespace layer_steps {

enum class Model { kBlockSparse = 0, kDsa = 1, kStatic = 2 };

struct Spec {
  Model model = Model::kBlockSparse;
  DType dtype = DType::kBF16;
  BlockSparseConfig bs;
  DsaConfig dsa;
  StaticBlockSparseConfig st;
  DispatchConfig dispatch;
  // Elements per (slot, token) of each input (weights: floats).
  size_t q = 0, q_extra = 0, index_q = 0, weights = 0, k = 0, v = 0, o = 0;
  int32_t pointers = 0;      // token pointers a null edit may drop
  bool multi_token = false;  // has decode(tokens, q_len)
  bool prefill = false;      // has prefill_token
};

std::unique_ptr<SparseLayer> make_layer(const Spec& s, int32_t batch) {
  switch (s.model) {
    case Model::kBlockSparse:
      return std::make_unique<BlockSparseAttention>(Device::kCpu, s.dtype, s.bs, batch, s.dispatch);
    case Model::kDsa: return std::make_unique<DsaAttention>(Device::kCpu, s.dtype, s.dsa, batch, s.dispatch);
    default: return std::make_unique<StaticBlockSparseAttention>(Device::kCpu, s.dtype, s.st, batch, s.dispatch);
  }
}

// Small shapes: a step costs microseconds, so a sequence of a dozen calls
// over five layers stays cheap in the corpus replay.
Spec make_spec(Model model, FuzzedDataProvider& in) {
  Spec s;
  s.model = model;
  s.dtype = in.ConsumeBool() ? DType::kBF16 : DType::kF16;
  // Always fused (no performance gates), or the kill switch (the mask path,
  // multi-token steps token by token): either way the batched and lone
  // layers decide alike, so their outputs compare.
  s.dispatch = DispatchConfig::defaults().without_performance_gates();
  s.dispatch.enabled = in.ConsumeBool();
  const int64_t step = in.ConsumeIntegralInRange<int64_t>(1, 16);
  switch (model) {
    case Model::kBlockSparse: {
      BlockSparseConfig& c = s.bs;
      c.num_kv_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.num_qo_heads = c.num_kv_heads * in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.head_dim = 8 * in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.block_size = in.ConsumeIntegralInRange<int32_t>(1, 4);
      c.topk_blocks = in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.local_blocks = in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.capacity_step = step;
      const size_t d = static_cast<size_t>(c.head_dim);
      s.q = s.o = static_cast<size_t>(c.num_qo_heads) * d;
      s.index_q = static_cast<size_t>(c.num_kv_heads) * d;
      s.k = static_cast<size_t>(c.num_kv_heads + 1) * d;
      s.v = static_cast<size_t>(c.num_kv_heads) * d;
      s.pointers = 5;
      s.multi_token = s.prefill = true;
      break;
    }
    case Model::kDsa: {
      DsaConfig& c = s.dsa;
      c.num_qo_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
      // Small dims, or the one MLA shape the fused prefill takes (512 + 64).
      c.latent_dim = 8 * in.ConsumeIntegralInRange<int32_t>(1, 3);
      c.rope_dim = 4 * in.ConsumeIntegralInRange<int32_t>(1, 2);
      if (c.latent_dim == 24) {
        c.latent_dim = 512;
        c.rope_dim = 64;
      }
      c.index_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.index_head_dim = 8 * in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.index_topk = in.ConsumeIntegralInRange<int32_t>(1, 6);
      c.capacity_step = step;
      s.q = s.o = static_cast<size_t>(c.num_qo_heads) * static_cast<size_t>(c.latent_dim);
      s.q_extra = static_cast<size_t>(c.num_qo_heads) * static_cast<size_t>(c.rope_dim);
      s.index_q = static_cast<size_t>(c.index_heads) * static_cast<size_t>(c.index_head_dim);
      s.weights = static_cast<size_t>(c.index_heads);
      s.k = static_cast<size_t>(c.latent_dim + c.index_head_dim);
      s.v = static_cast<size_t>(c.rope_dim);
      s.pointers = 7;
      s.multi_token = s.prefill = true;
      break;
    }
    default: {
      StaticBlockSparseConfig& c = s.st;
      c.num_kv_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.num_qo_heads = c.num_kv_heads * in.ConsumeIntegralInRange<int32_t>(1, 3);
      c.head_dim = 8;
      c.block_size = in.ConsumeIntegralInRange<int32_t>(1, 3);
      c.local_blocks = in.ConsumeIntegralInRange<int32_t>(1, 2);
      c.vert_stride = in.ConsumeIntegralInRange<int32_t>(1, 3);
      c.capacity_step = step;
      s.q = s.o = static_cast<size_t>(c.num_qo_heads) * 8;
      s.k = s.v = static_cast<size_t>(c.num_kv_heads) * 8;
      s.pointers = 4;
      break;
    }
  }
  return s;
}

// A configuration the constructor must refuse by name, before it allocates.
void check_bad_configuration(Spec s, FuzzedDataProvider& in) {
  int32_t batch = 2;
  std::string want;
  switch (in.ConsumeIntegralInRange<int>(0, 4)) {
    case 0:
      batch = in.ConsumeBool() ? 0 : -1;
      want = "batch";
      break;
    case 1:
      s.dtype = DType::kF32;
      want = "f16 or bf16";
      break;
    case 2:  // heads that do not divide, or none
      if (s.model == Model::kDsa) {
        s.dsa.num_qo_heads = 0;
        want = "heads";
      } else if (s.model == Model::kBlockSparse) {
        s.bs.num_kv_heads = 2;
        s.bs.num_qo_heads = 3;
        want = "head";
      } else {
        s.st.num_kv_heads = 2;
        s.st.num_qo_heads = 3;
        want = "head";
      }
      break;
    case 3:  // a zero dim or block
      if (s.model == Model::kDsa) {
        s.dsa.latent_dim = 0;
        want = "dims";
      } else if (s.model == Model::kBlockSparse) {
        s.bs.block_size = 0;
        want = "block_size";
      } else {
        s.st.vert_stride = 0;
        want = "vert_stride";
      }
      break;
    default:  // a capacity step below 1, or a non-finite scale
      if (s.model == Model::kDsa && in.ConsumeBool()) {
        s.dsa.scale = std::numeric_limits<float>::quiet_NaN();
        want = "scale";
      } else {
        s.bs.capacity_step = s.dsa.capacity_step = s.st.capacity_step = in.ConsumeBool() ? 0 : -5;
        want = "step";
      }
      break;
  }
  try {
    (void)make_layer(s, batch);
  } catch (const Error& e) {
    FUZZ_CHECK(std::string(e.what()).find(want) != std::string::npos,
               "a bad layer configuration was refused without naming " + want + ": " + e.what());
    return;
  } catch (const std::exception& e) {
    finding(std::string("a bad layer configuration threw a non-sparsepage exception: ") + e.what());
  }
  finding("a bad layer configuration (" + want + ") was accepted");
}

// One step's inputs for `batch` slots and q_len tokens, in the layers'
// layouts: q, q_extra, index_q, weights and o [batch, q_len, ...], k and v
// token-major [q_len, batch, ...]. Rows of free slots are NaN.
struct StepData {
  int32_t batch = 0, q_len = 1;
  std::vector<uint8_t> q, q_extra, index_q, k, v;
  std::vector<float> weights;
  StepData(const Spec& s, int32_t batch_, int32_t q_len_) : batch(batch_), q_len(q_len_) {
    const size_t n = static_cast<size_t>(batch) * static_cast<size_t>(q_len);
    q = testing::nan_values(s.dtype, n * s.q);
    q_extra = testing::nan_values(s.dtype, n * s.q_extra);
    index_q = testing::nan_values(s.dtype, n * s.index_q);
    k = testing::nan_values(s.dtype, n * s.k);
    v = testing::nan_values(s.dtype, n * s.v);
    weights.assign(n * s.weights, std::numeric_limits<float>::quiet_NaN());
  }
  // The q_len tokens of slot `slot`: token t from request `id`'s input number next + t.
  void fill(const Spec& s, int32_t slot, uint64_t seed, int64_t id, int64_t next) {
    for (int32_t t = 0; t < q_len; ++t) fill_token(s, slot, t, mix(seed, id, next + t));
  }
  void fill_token(const Spec& s, int32_t slot, int32_t t, uint64_t token_seed) {
    std::mt19937_64 rng(token_seed);
    const size_t esize = dtype_size(s.dtype);
    const size_t qrow = static_cast<size_t>(slot) * static_cast<size_t>(q_len) + static_cast<size_t>(t);
    const size_t krow = static_cast<size_t>(t) * static_cast<size_t>(batch) + static_cast<size_t>(slot);
    const auto put = [&](std::vector<uint8_t>& dst, size_t elems, size_t row) {
      const auto values = testing::random_values(s.dtype, elems, rng);
      std::copy(values.begin(), values.end(), dst.begin() + static_cast<std::ptrdiff_t>(row * elems * esize));
    };
    put(q, s.q, qrow);
    put(q_extra, s.q_extra, qrow);
    put(index_q, s.index_q, qrow);
    put(k, s.k, krow);
    put(v, s.v, krow);
    std::uniform_real_distribution<float> w(0.1f, 1.0f);
    for (size_t i = 0; i < s.weights; ++i) weights[qrow * s.weights + i] = w(rng);
  }
};

// The call forms of a step.
enum class Form { kDecode, kDecodeQLen, kPrefill, kEngineForm };

// The model's tokens over `d` and `o`, the token pointer `drop` (if >= 0,
// in the model's field order) null.
struct Tokens {
  BlockSparseTokens block;
  DsaTokens dsa;
  StaticBlockSparseTokens fixed;
};
Tokens tokens(const Spec& s, StepData& d, void* o, int drop) {
  std::vector<const void*> p;
  switch (s.model) {
    case Model::kBlockSparse: p = {d.q.data(), d.index_q.data(), d.k.data(), d.v.data(), o}; break;
    case Model::kDsa:
      p = {d.q.data(), d.q_extra.data(), d.index_q.data(), d.weights.data(), d.k.data(), d.v.data(), o};
      break;
    default: p = {d.q.data(), d.k.data(), d.v.data(), o}; break;
  }
  if (drop >= 0) p[static_cast<size_t>(drop)] = nullptr;
  void* out = const_cast<void*>(p.back());
  Tokens t;
  switch (s.model) {
    case Model::kBlockSparse: t.block = BlockSparseTokens{p[0], p[1], p[2], p[3], out}; break;
    case Model::kDsa:
      t.dsa.q_latent = p[0];
      t.dsa.q_pe = p[1];
      t.dsa.q_index = p[2];
      t.dsa.index_weights = static_cast<const float*>(p[3]);
      t.dsa.k_cache_row = p[4];
      t.dsa.k_pe = p[5];
      t.dsa.o = out;
      break;
    default: t.fixed = StaticBlockSparseTokens{p[0], p[1], p[2], out}; break;
  }
  return t;
}

// Runs one step form on `layer` with the token pointer `drop` (if >= 0) null.
LayerStep run_step(const Spec& s, SparseLayer& layer, StepData& d, void* o, Form form, int32_t q_len, int drop) {
  const Tokens t = tokens(s, d, o, drop);
  const EnginePagedKV no_pool;
  switch (s.model) {
    case Model::kBlockSparse: {
      auto& l = static_cast<BlockSparseAttention&>(layer);
      if (form == Form::kPrefill) return l.prefill_token(t.block), LayerStep{};
      if (form == Form::kEngineForm) return l.decode(t.block, no_pool);
      return form == Form::kDecodeQLen ? l.decode(t.block, q_len) : l.decode(t.block);
    }
    case Model::kDsa: {
      auto& l = static_cast<DsaAttention&>(layer);
      if (form == Form::kPrefill) return l.prefill_token(t.dsa), LayerStep{};
      if (form == Form::kEngineForm) return l.decode(t.dsa, no_pool);
      return form == Form::kDecodeQLen ? l.decode(t.dsa, q_len) : l.decode(t.dsa);
    }
    default: return static_cast<StaticBlockSparseAttention&>(layer).decode(t.fixed);
  }
}

// One chunk of n tokens through the model's chunked prefill over its own
// cache (prefill(tokens, n)), the token pointer `drop` (if >= 0) null; with
// `engine_form`, the engine-pool form, which a layer with its own cache refuses.
void run_chunk(const Spec& s, SparseLayer& layer, StepData& d, void* o, int32_t n, int drop, bool engine_form) {
  Tokens t = tokens(s, d, o, drop);
  const EnginePagedKV no_pool;
  switch (s.model) {
    case Model::kBlockSparse: {
      auto& l = static_cast<BlockSparseAttention&>(layer);
      return engine_form ? l.prefill(t.block, no_pool, n) : l.prefill(t.block, n);
    }
    case Model::kDsa: {
      auto& l = static_cast<DsaAttention&>(layer);
      return engine_form ? l.prefill(t.dsa, no_pool, n) : l.prefill(t.dsa, n);
    }
    default:
      // The static layer has no engine form: a null o stands in for a bad call.
      if (engine_form) t.fixed.o = nullptr;
      return static_cast<StaticBlockSparseAttention&>(layer).prefill(t.fixed, n);
  }
}

struct Request {
  int64_t id = 0;
  int64_t next = 0;  // inputs drawn so far (each decode token or appended chunk takes one number)
  std::unique_ptr<SparseLayer> lone;
};

// `rows` tokens a slot: each occupied slot's next inputs, a free slot's rows NaN.
StepData slot_data(const Spec& s, const std::vector<Request>& slots, int32_t rows, uint64_t seed) {
  StepData d(s, static_cast<int32_t>(slots.size()), rows);
  for (size_t b = 0; b < slots.size(); ++b)
    if (slots[b].lone) d.fill(s, static_cast<int32_t>(b), seed, slots[b].id, slots[b].next);
  return d;
}

struct LayerState {
  std::vector<int64_t> lens;
  std::vector<uint8_t> active;
  int64_t kv_len = 0, capacity = 0;
  explicit LayerState(const SparseLayer& l)
      : lens(l.kv_lens()), active(l.cache().active()), kv_len(l.kv_len()), capacity(l.cache().capacity()) {}
  bool operator==(const LayerState& o) const {
    return lens == o.lens && active == o.active && kv_len == o.kv_len && capacity == o.capacity;
  }
};

// A call that must be refused: Error, the layer's name first, `want` named,
// and nothing changed.
template <typename Call>
void expect_refused(SparseLayer& layer, Call&& call, const std::string& want, const char* what) {
  const LayerState before(layer);
  bool refused = false;
  try {
    call();
  } catch (const Error& e) {
    const std::string message = e.what();
    FUZZ_CHECK(message.rfind(layer.name(), 0) == 0,
               std::string(what) + ": the error does not start with the layer's name: " + message);
    FUZZ_CHECK(message.find(want) != std::string::npos,
               std::string(what) + ": the error does not name " + want + ": " + message);
    refused = true;
  } catch (const std::exception& e) {
    finding(std::string(what) + " threw a non-sparsepage exception: " + e.what());
  }
  FUZZ_CHECK(refused, std::string(what) + " was accepted");
  FUZZ_CHECK(LayerState(layer) == before,
             std::string(what) + ": a refused call changed the layer's lengths, slots or capacity");
}

void fuzz_layer_steps(FuzzedDataProvider& in, Model model) {
  const Spec spec = make_spec(model, in);
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) check_bad_configuration(spec, in);
  const int32_t batch = in.ConsumeIntegralInRange<int32_t>(1, 3);
  const uint64_t seed = in.ConsumeIntegral<uint64_t>();
  const std::unique_ptr<SparseLayer> layer = make_layer(spec, batch), twin = make_layer(spec, batch);
  std::vector<Request> slots(static_cast<size_t>(batch));
  int64_t next_id = 0;
  std::vector<std::vector<int32_t>> last_positions;  // the last decode step's, as read right after it
  // A new layer has every slot active at length 0: a lone layer each.
  for (Request& r : slots) {
    r.id = next_id++;
    r.lone = make_layer(spec, 1);
  }
  const size_t esize = dtype_size(spec.dtype);
  const auto same_state = [&](const char* what) {
    FUZZ_CHECK(LayerState(*layer) == LayerState(*twin), std::string(what) + ": the layer and its twin differ");
    for (int32_t b = 0; b < batch; ++b) {
      const Request& r = slots[static_cast<size_t>(b)];
      const bool active = layer->cache().active()[static_cast<size_t>(b)] != 0;
      FUZZ_CHECK(active == (r.lone != nullptr), std::string(what) + ": slot activity");
      if (r.lone) {
        FUZZ_CHECK(layer->kv_lens()[static_cast<size_t>(b)] == r.lone->kv_lens()[0],
                   std::string(what) + ": a slot's length differs from its lone run's");
      } else {
        FUZZ_CHECK(layer->kv_lens()[static_cast<size_t>(b)] == 0, std::string(what) + ": a free slot has a length");
      }
    }
  };
  for (int ops = in.ConsumeIntegralInRange<int>(1, 14); ops > 0 && in.remaining_bytes() > 0; --ops) {
    const int op = in.ConsumeIntegralInRange<int>(0, 15);
    switch (op) {
      case 0:
      case 1: {  // admit a new request (over a running one: refused, then released and admitted)
        const int32_t slot = in.ConsumeIntegralInRange<int32_t>(0, batch - 1);
        const int64_t n = in.ConsumeIntegralInRange<int64_t>(0, 12);
        Request& r = slots[static_cast<size_t>(slot)];
        r.id = next_id++;
        r.next = 0;
        std::mt19937_64 rng(mix(seed, r.id, -1));
        const DenseKVCache& c = layer->cache();
        const auto k = testing::random_values(spec.dtype, static_cast<size_t>(c.k_heads() * n * c.k_head_dim()), rng);
        const auto v = testing::random_values(spec.dtype, static_cast<size_t>(c.v_heads() * n * c.v_head_dim()), rng);
        if (c.active()[static_cast<size_t>(slot)] != 0 && c.live_lens()[static_cast<size_t>(slot)] > 0) {
          FUZZ_CHECK(!accepted([&] { layer->admit(slot, k.data(), v.data(), n); }, "admit over a running request"),
                     "admit over a running request was accepted");
          r.lone.reset();
          layer->release(slot);
          twin->release(slot);
        }
        layer->admit(slot, k.data(), v.data(), n);
        twin->admit(slot, k.data(), v.data(), n);
        r.lone = make_layer(spec, 1);
        r.lone->admit(0, k.data(), v.data(), n);
        same_state("admit");
        break;
      }
      case 2: {  // release
        const int32_t slot = in.ConsumeIntegralInRange<int32_t>(0, batch - 1);
        layer->release(slot);
        twin->release(slot);
        slots[static_cast<size_t>(slot)].lone.reset();
        same_state("release");
        break;
      }
      case 3: {  // reserve
        const int64_t n = in.ConsumeIntegralInRange<int64_t>(0, 40);
        layer->reserve(n);
        twin->reserve(n);
        for (Request& r : slots) {
          if (r.lone) r.lone->reserve(n);
        }
        FUZZ_CHECK(layer->cache().capacity() >= n, "reserve left less room than asked");
        break;
      }
      case 4: {  // a lockstep append to every active slot
        const int64_t n = in.ConsumeIntegralInRange<int64_t>(0, 6);
        const DenseKVCache& c = layer->cache();
        const size_t kn = static_cast<size_t>(c.k_heads() * n * c.k_head_dim());
        const size_t vn = static_cast<size_t>(c.v_heads() * n * c.v_head_dim());
        // At least one element each: the layer refuses null rows even for 0 tokens.
        std::vector<uint8_t> k = testing::nan_values(spec.dtype, std::max<size_t>(kn * static_cast<size_t>(batch), 1));
        std::vector<uint8_t> v = testing::nan_values(spec.dtype, std::max<size_t>(vn * static_cast<size_t>(batch), 1));
        for (int32_t b = 0; b < batch; ++b) {
          Request& r = slots[static_cast<size_t>(b)];
          if (!r.lone) continue;
          std::mt19937_64 rng(mix(seed, r.id, 1000000 + r.next++));
          auto kb = testing::random_values(spec.dtype, kn, rng), vb = testing::random_values(spec.dtype, vn, rng);
          std::copy(kb.begin(), kb.end(), k.begin() + static_cast<std::ptrdiff_t>(b * kn * esize));
          std::copy(vb.begin(), vb.end(), v.begin() + static_cast<std::ptrdiff_t>(b * vn * esize));
          kb.resize(std::max<size_t>(kb.size(), esize));
          vb.resize(std::max<size_t>(vb.size(), esize));
          r.lone->append_tokens(kb.data(), vb.data(), n);
        }
        layer->append_tokens(k.data(), v.data(), n);
        twin->append_tokens(k.data(), v.data(), n);
        same_state("append_tokens");
        break;
      }
      case 5:
      case 6:
      case 7:
      case 8: {  // a step: one token, q_len tokens, or a prefill token
        Form form = Form::kDecode;
        int32_t q_len = 1;
        if (op == 7 && spec.prefill) form = Form::kPrefill;
        if (op == 8 && spec.multi_token) {
          form = Form::kDecodeQLen;
          q_len = in.ConsumeIntegralInRange<int32_t>(1, 4);
        }
        StepData d = slot_data(spec, slots, q_len, seed);
        const size_t row = static_cast<size_t>(q_len) * spec.o * esize;  // one slot's o bytes
        Guarded o(static_cast<size_t>(batch) * row), o_twin(static_cast<size_t>(batch) * row);
        LayerStep got, want;
        FUZZ_CHECK(accepted([&] { got = run_step(spec, *layer, d, o.data(), form, q_len, -1); }, "layer step"),
                   "a valid layer step was refused");
        want = run_step(spec, *twin, d, o_twin.data(), form, q_len, -1);
        o.check_canaries("layer o");
        o_twin.check_canaries("twin o");
        FUZZ_CHECK(o.payload() == o_twin.payload(),
                   "a layer's output differs from its twin's (a refused call left a trace)");
        FUZZ_CHECK(got.fused == want.fused && got.sparse == want.sparse, "the layer and its twin ran different paths");
        const std::vector<uint8_t> bytes = o.payload();
        for (int32_t b = 0; b < batch; ++b) {
          Request& r = slots[static_cast<size_t>(b)];
          const auto mine = std::vector<uint8_t>(bytes.begin() + static_cast<std::ptrdiff_t>(b * row),
                                                 bytes.begin() + static_cast<std::ptrdiff_t>((b + 1) * row));
          if (!r.lone) {
            if (form == Form::kPrefill) continue;  // prefill writes what the mask path gives a free slot
            for (float x : testing::as_float(spec.dtype, mine))
              FUZZ_CHECK(x == 0.0f, "a free slot's output is not zero");
            continue;
          }
          StepData lone_d(spec, 1, q_len);
          lone_d.fill(spec, 0, seed, r.id, r.next);
          r.next += q_len;
          Guarded lone_o(row);
          run_step(spec, *r.lone, lone_d, lone_o.data(), form, q_len, -1);
          lone_o.check_canaries("lone o");
          const std::vector<float> g = testing::as_float(spec.dtype, mine);
          const std::vector<float> l = testing::as_float(spec.dtype, lone_o.payload());
          const std::vector<double> ref(l.begin(), l.end());
          for (float x : g) FUZZ_CHECK(!std::isnan(x), "NaN in an active slot's output");
          FUZZ_CHECK(testing::relative_l2(g, ref) < 1e-2, "slot " + std::to_string(b) +
                                                              "'s output differs from its lone run's by " +
                                                              sci(testing::relative_l2(g, ref)));
        }
        same_state("step");
        if (form == Form::kPrefill) break;
        // What the step attended, per slot, equals the lone run's; and it
        // stays readable, unchanged, until the next step (checked after every call).
        last_positions = layer->last_selected_positions();
        FUZZ_CHECK(last_positions == twin->last_selected_positions(), "the layer and its twin selected differently");
        FUZZ_CHECK(!last_positions.empty() && last_positions.size() % static_cast<size_t>(batch) == 0,
                   "last_selected_positions: not one row set per slot");
        const size_t per_slot = last_positions.size() / static_cast<size_t>(batch);
        for (int32_t b = 0; b < batch; ++b) {
          const Request& r = slots[static_cast<size_t>(b)];
          if (!r.lone) continue;
          const auto lone = r.lone->last_selected_positions();
          FUZZ_CHECK(lone.size() == per_slot, "last_selected_positions: rows per slot differ from the lone run's");
          for (size_t i = 0; i < per_slot; ++i) {
            auto sel = last_positions[static_cast<size_t>(b) * per_slot + i], lone_sel = lone[i];
            std::sort(sel.begin(), sel.end());
            std::sort(lone_sel.begin(), lone_sel.end());
            FUZZ_CHECK(sel == lone_sel, "slot " + std::to_string(b) + " selected other positions than its lone run");
          }
        }
        break;
      }
      case 9:
      case 10: {  // a prefill chunk: random n, aligned or not; a hostile one sometimes
        int32_t n = in.ConsumeIntegralInRange<int32_t>(1, 9);
        const int32_t bs = spec.model == Model::kBlockSparse ? spec.bs.block_size
                           : spec.model == Model::kStatic    ? spec.st.block_size
                                                             : 1;
        if (in.ConsumeBool()) n = bs * in.ConsumeIntegralInRange<int32_t>(1, 3);  // whole blocks
        int drop = -1;
        bool engine_form = false;
        const int hostile = in.ConsumeIntegralInRange<int>(0, 5);
        std::string want;  // what a hostile chunk's refusal names
        if (hostile == 1) {
          const int32_t bad[] = {0, -1, std::numeric_limits<int32_t>::min()};
          n = bad[in.ConsumeIntegralInRange<int>(0, 2)];
          want = "num_tokens";
        } else if (hostile == 2) {
          drop = in.ConsumeIntegralInRange<int>(0, spec.pointers - 1);
          want = "must be set";
        } else if (hostile == 3) {
          engine_form = true;
          want = spec.model == Model::kStatic ? "must be set" : "own cache";
        }
        // Which good chunks the fused prefill takes: an active slot, and for
        // the block layers every active slot's chunk starting on a block.
        bool any_active = false, aligned = true;
        for (int32_t b = 0; b < batch; ++b) {
          if (!layer->cache().active()[static_cast<size_t>(b)]) continue;
          any_active = true;
          aligned = aligned && layer->kv_lens()[static_cast<size_t>(b)] % bs == 0;
        }
        const bool good = want.empty();
        if (good && !any_active) want = "every slot is free";
        if (good && any_active && !aligned) want = "block_size";
        if (good && any_active && spec.model == Model::kDsa && (spec.dsa.latent_dim != 512 || spec.dsa.rope_dim != 64))
          want = "latent_dim 512";
        const int32_t rows = std::max<int32_t>(n, 1);
        StepData d = slot_data(spec, slots, rows, seed);
        const size_t row = static_cast<size_t>(rows) * spec.o * esize;  // one slot's o bytes
        Guarded o(static_cast<size_t>(batch) * row), o_twin(static_cast<size_t>(batch) * row);
        if (!want.empty()) {  // refused by name, nothing changed (the twin, which never sees it, checks the rest)
          expect_refused(
              *layer, [&] { run_chunk(spec, *layer, d, o.data(), n, drop, engine_form); }, want,
              "a prefill chunk the layer cannot take");
          o.check_canaries("refused chunk o");
          FUZZ_CHECK(o.payload() == std::vector<uint8_t>(o.bytes(), 0xFF), "a refused chunk wrote its output");
          same_state("a refused chunk");
          break;
        }
        const std::vector<int64_t> lens_before = layer->kv_lens();
        std::string why;
        try {
          run_chunk(spec, *layer, d, o.data(), n, -1, false);
        } catch (const Error& e) {
          why = e.what();
        } catch (const std::exception& e) {
          finding(std::string("a prefill chunk threw a non-sparsepage exception: ") + e.what());
        }
        FUZZ_CHECK(why.empty(), "a valid prefill chunk of " + std::to_string(n) + " tokens was refused: " + why);
        run_chunk(spec, *twin, d, o_twin.data(), n, -1, false);
        o.check_canaries("chunk o");
        o_twin.check_canaries("twin chunk o");
        FUZZ_CHECK(o.payload() == o_twin.payload(),
                   "a chunk's output differs from its twin's (a refused call left a trace)");
        const auto positions = layer->last_prefill_positions();
        FUZZ_CHECK(positions == twin->last_prefill_positions(), "the layer and its twin's chunks attended differently");
        FUZZ_CHECK(!positions.empty() && positions.size() % static_cast<size_t>(batch) == 0,
                   "last_prefill_positions: not one row set per slot");
        const size_t per_slot = positions.size() / static_cast<size_t>(batch);
        const std::vector<uint8_t> bytes = o.payload();
        for (int32_t b = 0; b < batch; ++b) {
          Request& r = slots[static_cast<size_t>(b)];
          const auto mine = testing::as_float(
              spec.dtype, std::vector<uint8_t>(bytes.begin() + static_cast<std::ptrdiff_t>(b * row),
                                               bytes.begin() + static_cast<std::ptrdiff_t>((b + 1) * row)));
          const int64_t len = layer->kv_lens()[static_cast<size_t>(b)];
          if (!r.lone) {
            for (float x : mine) FUZZ_CHECK(x == 0.0f, "a free slot's chunk output is not zero");
            FUZZ_CHECK(len == 0, "a chunk gave a free slot a length");
            for (size_t i = 0; i < per_slot; ++i)
              FUZZ_CHECK(positions[static_cast<size_t>(b) * per_slot + i].empty(), "a free slot attended positions");
            continue;
          }
          FUZZ_CHECK(len == lens_before[static_cast<size_t>(b)] + n, "a chunk did not advance a slot's length by n");
          for (float x : mine) FUZZ_CHECK(!std::isnan(x), "NaN in an active slot's chunk output");
          // Each row: positions in the token's causal window, sorted.
          for (size_t i = 0; i < per_slot; ++i) {
            const auto& row_pos = positions[static_cast<size_t>(b) * per_slot + i];
            const int64_t token = static_cast<int64_t>(i) / static_cast<int64_t>(per_slot / static_cast<size_t>(n));
            const int64_t own = len - n + token;
            FUZZ_CHECK(!row_pos.empty() && std::is_sorted(row_pos.begin(), row_pos.end()) && row_pos.front() >= 0 &&
                           row_pos.back() <= own,
                       "a chunk token attended positions outside its causal window");
          }
          // The slot alone, prefilling the same chunk: the same positions, the same answer.
          StepData lone_d(spec, 1, n);
          lone_d.fill(spec, 0, seed, r.id, r.next);
          r.next += n;
          Guarded lone_o(row);
          FUZZ_CHECK(accepted([&] { run_chunk(spec, *r.lone, lone_d, lone_o.data(), n, -1, false); }, "lone chunk"),
                     "a slot's lone chunk was refused");
          lone_o.check_canaries("lone chunk o");
          const auto lone_pos = r.lone->last_prefill_positions();
          FUZZ_CHECK(
              lone_pos.size() == per_slot && std::equal(lone_pos.begin(), lone_pos.end(),
                                                        positions.begin() + static_cast<std::ptrdiff_t>(b * per_slot)),
              "slot " + std::to_string(b) + "'s chunk attended other positions than its lone run");
          const std::vector<float> l = testing::as_float(spec.dtype, lone_o.payload());
          const std::vector<double> ref(l.begin(), l.end());
          FUZZ_CHECK(testing::relative_l2(mine, ref) < 1e-2, "slot " + std::to_string(b) +
                                                                 "'s chunk output differs from its lone run's by " +
                                                                 sci(testing::relative_l2(mine, ref)));
        }
        same_state("prefill chunk");
        break;
      }
      default: {  // a call that must be refused
        const int32_t bad_slots[] = {-1, batch, std::numeric_limits<int32_t>::min(),
                                     std::numeric_limits<int32_t>::max()};
        const int64_t bad_tokens[] = {-1, std::numeric_limits<int64_t>::min(), int64_t{1} << 31,
                                      std::numeric_limits<int64_t>::max()};
        const int32_t bad_q_lens[] = {0, -1, kMaxQueryTokens + 1, std::numeric_limits<int32_t>::min()};
        const int pick = in.ConsumeIntegralInRange<int>(0, 3);
        std::mt19937_64 rows_rng(seed);
        const std::vector<uint8_t> rows = testing::random_values(spec.dtype, 64, rows_rng);
        switch (in.ConsumeIntegralInRange<int>(0, 7)) {
          case 0:
            expect_refused(
                *layer, [&] { layer->admit(bad_slots[pick], rows.data(), rows.data(), 0); }, "slot",
                "admit into a slot outside the batch");
            break;
          case 1:
            expect_refused(
                *layer, [&] { layer->admit(0, rows.data(), rows.data(), bad_tokens[pick]); }, "tokens",
                "admit of a bad token count");
            break;
          case 2: {
            const bool no_k = in.ConsumeBool();
            expect_refused(
                *layer, [&] { layer->admit(0, no_k ? nullptr : rows.data(), no_k ? rows.data() : nullptr, 1); },
                "must be set", "admit without rows");
            break;
          }
          case 3:
            expect_refused(
                *layer, [&] { layer->release(bad_slots[pick]); }, "slot", "release of a slot outside the batch");
            break;
          case 4:
            expect_refused(
                *layer, [&] { layer->reserve(bad_tokens[pick]); }, "tokens", "reserve of a bad token count");
            break;
          case 5: {  // a lockstep append of a bad count, or without rows
            if (in.ConsumeBool()) {
              expect_refused(
                  *layer, [&] { layer->append_tokens(rows.data(), rows.data(), bad_tokens[pick]); }, "tokens",
                  "append_tokens of a bad token count");
            } else {
              expect_refused(
                  *layer, [&] { layer->append_tokens(nullptr, rows.data(), 1); }, "must be set",
                  "append_tokens without rows");
            }
            break;
          }
          case 6: {  // a step with a null token pointer, or a bad q_len, or the engine-pool form
            StepData d(spec, batch, 1);
            Guarded o(static_cast<size_t>(batch) * spec.o * esize);
            const int kind = in.ConsumeIntegralInRange<int>(0, 2);
            if (kind == 0) {
              const int drop = in.ConsumeIntegralInRange<int>(0, spec.pointers - 1);
              const Form form = spec.prefill && in.ConsumeBool() ? Form::kPrefill : Form::kDecode;
              expect_refused(
                  *layer, [&] { run_step(spec, *layer, d, o.data(), form, 1, drop); }, "must be set",
                  "a step with a null token pointer");
            } else if (kind == 1 && spec.multi_token) {
              expect_refused(
                  *layer, [&] { run_step(spec, *layer, d, o.data(), Form::kDecodeQLen, bad_q_lens[pick], -1); },
                  "q_len", "a step with q_len outside [1, kMaxQueryTokens]");
            } else if (spec.model != Model::kStatic) {
              expect_refused(
                  *layer, [&] { run_step(spec, *layer, d, o.data(), Form::kEngineForm, 1, -1); }, "kv_storage",
                  "the engine-pool form on a layer with its own cache");
            }
            o.check_canaries("refused step o");
            FUZZ_CHECK(o.payload() == std::vector<uint8_t>(o.bytes(), 0xFF), "a refused step wrote its output");
            break;
          }
          default: {  // the mask path's columns before any step
            if (!layer->last_selected_positions().empty()) break;
            expect_refused(
                *layer, [&] { (void)layer->last_mask_columns(); }, "no decode", "last_mask_columns before a step");
            break;
          }
        }
        same_state("a refused call");
        break;
      }
    }
    std::vector<std::vector<int32_t>> positions;
    FUZZ_CHECK(accepted([&] { positions = layer->last_selected_positions(); }, "last_selected_positions"),
               "last_selected_positions was refused");
    FUZZ_CHECK(positions == last_positions, "last_selected_positions changed between steps");
  }
}

}  // namespace layer_steps

}  // namespace
}  // namespace sparsepage

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  // The last input byte picks the target: below 243 as b % 9 (the first
  // nine targets, as the corpus was made for them), 243 .. 251 the layer
  // step sequences (one model per value mod 3), 252 .. 254 the layers'
  // engine forms (one form each), 255 the sparse prefill's entry points.
  const uint8_t target = in.ConsumeIntegral<uint8_t>();
  if (target == 255) {
    sparsepage::prefill_fuzz::fuzz(in);
    return 0;
  }
  if (target >= 252) {
    sparsepage::engine_forms::fuzz(in, (target - 252) % 3);
    return 0;
  }
  if (target >= 243) {
    sparsepage::layer_steps::fuzz_layer_steps(in, static_cast<sparsepage::layer_steps::Model>((target - 243) % 3));
    return 0;
  }
  switch (target % 9) {
    case 8: sparsepage::fuzz_fp8(in); break;
    case 7: sparsepage::fuzz_window_lengths(in); break;
    case 6: sparsepage::fuzz_engine_inputs(in); break;
    case 0: sparsepage::fuzz_page_table(in); break;
    case 1: sparsepage::fuzz_plan(in); break;
    case 2: sparsepage::fuzz_decode(in); break;
    case 3: sparsepage::fuzz_selection_paths(in); break;
    case 4: sparsepage::fuzz_caches(in); break;
    default: sparsepage::fuzz_dispatch_gather(in); break;
  }
  return 0;
}
