// The FlashMLA-shaped sparse decode (mla_sparse.h): its plan, its checks,
// and the CUDA run. With an extra cache it is the fused decode's FP8 MLA
// partial kernel once per cache (run_decode_cuda over a sub-plan whose items
// all write partial slots) and one merge with the sink
// (src/cuda/merge/mla_sparse_merge.cu); without one, the fused decode on its
// own plan, finished (lse convention, sink) by its merge when that covers
// every request, else by the MLA prefill's epilogue.
// The CPU twin is src/cpu/mla_sparse_cpu.cc.
#include "sparsepage/mla_sparse.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/cuda_hooks.h"
#include "core/decode_limits.h"
#include "core/prefill_kernels.h"
#include "core/require.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/fp8.h"
#include "sparsepage/memory.h"

namespace sparsepage {
namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// The most chunks the decode plan splits one request into (1 when it splits none).
int32_t most_chunks(const DecodePlan& plan) { return std::max(plan.work.empty() ? 0 : 1, plan.most_merged_partials()); }

const char* cache_name(const MlaSparseParams& p, const MlaSparseCache& c) { return &c == &p.extra ? "extra" : "cache"; }

// Why cache `c` (named `name`) cannot be read with `topk` ids per query, or "".
std::string cache_problem(const MlaSparseParams& p, const MlaSparseCache& c, const std::string& name, int32_t topk) {
  if (c.data == nullptr) return name + ".data is null";
  if (c.num_blocks < 1) return name + ".num_blocks = " + std::to_string(c.num_blocks) + " must be at least 1";
  if (c.block_size < 1) return name + ".block_size = " + std::to_string(c.block_size) + " must be at least 1";
  int64_t min_block_stride = 0;
  if (p.format == MlaCacheFormat::kV32) {
    if (c.row_stride < MlaFp8Row::kBytes)
      return name + ".row_stride = " + std::to_string(c.row_stride) + " bytes is smaller than the 656-byte V3.2 row";
    min_block_stride = int64_t{c.block_size} * c.row_stride;
  } else {
    min_block_stride = int64_t{c.block_size} * MlaModel1Block::kBytesPerToken;
  }
  if (c.block_stride < min_block_stride)
    return name + ".block_stride = " + std::to_string(c.block_stride) + " bytes is smaller than the " +
           std::to_string(min_block_stride) + " bytes a block of " + std::to_string(c.block_size) + " " +
           mla_cache_format_name(p.format) + " tokens takes: blocks would overlap";
  if (static_cast<long double>(c.num_blocks) * static_cast<long double>(c.block_stride) >= 4.6e18L)
    return name + ": " + std::to_string(c.num_blocks) + " blocks of " + std::to_string(c.block_stride) +
           " bytes span more than 2^62 bytes";
  if (c.indices == nullptr) return name + ".indices is null";
  if (c.topk != topk)
    return name + ".topk = " + std::to_string(c.topk) + " but the plan was made for " + std::to_string(topk);
  if (c.index_batch_stride < 0 || c.index_token_stride < 0)
    return name + ".index_batch_stride and index_token_stride must not be negative";
  return {};
}

// Cache `c`'s launch of the fused FP8 MLA decode (kV32): request r = b *
// q_len + t is KV head t of sequence b, reading its row of the index matrix
// as page ids of page size 1 (slot ids) into the cache's rows, -1 skipped,
// topk_length per sequence; q's latent and rope are column views of q.
DecodeParams cache_decode_params(const MlaSparseParams& p, const MlaSparseCache& c) {
  DecodeParams d;
  d.dtype = p.dtype;
  d.kv_format = KvFormat::kE4m3Mla;
  const MlaFp8Views views = mla_fp8_views(c.data, c.num_slots(), c.row_stride);
  d.k = views.k;
  d.v = views.v;
  d.k_extra = views.k_extra;
  d.index_layout = IndexLayout::kMatrix;
  d.indices = c.indices;
  d.index_width = c.topk;
  d.index_seq_stride = c.index_batch_stride;
  d.index_head_stride = c.index_token_stride;
  d.num_indices = int64_t{p.batch - 1} * c.index_batch_stride + int64_t{p.q_len - 1} * c.index_token_stride + c.topk;
  d.seq_lens = c.topk_length;
  d.seq_lens_index = SeqLensIndex::kPerSequence;
  d.num_requests = p.batch * p.q_len;
  d.num_kv_heads = p.q_len;
  d.page_size = 1;
  d.addressing = PageAddressing::kPoolPages;
  d.padding = IndexPadding::kMinusOneSkips;
  d.num_pool_pages = c.num_slots();
  d.group_size = p.num_heads;
  d.qo_layout = QueryLayout::kStrided;
  d.q = p.q;
  d.q_strides = {p.q_batch_stride, p.q_head_stride, 0};
  d.q_extra = static_cast<const char*>(p.q) + MlaFp8Row::kLatent * dtype_size(p.dtype);
  d.q_extra_strides = d.q_strides;
  d.o = p.o;
  const int64_t heads = int64_t{p.q_len} * p.num_heads;
  d.o_strides = {heads * kMlaSparseHeadDimV, kMlaSparseHeadDimV, 0};
  d.lse = p.lse;
  d.scale = p.scale;
  return d;
}

void require_ok(const std::string& problem) {
  if (!problem.empty()) throw Error("mla_sparse: " + problem);
}

}  // namespace

const char* mla_cache_format_name(MlaCacheFormat format) {
  switch (format) {
    case MlaCacheFormat::kV32: return "v32";
    case MlaCacheFormat::kModel1: return "model1";
  }
  return "unknown";
}

int32_t mla_head_dim_qk(MlaCacheFormat format) {
  return format == MlaCacheFormat::kModel1 ? MlaModel1Block::kNope + MlaModel1Block::kRope
                                           : MlaFp8Row::kLatent + MlaFp8Row::kRope;
}

int32_t mla_bytes_per_token(MlaCacheFormat format) {
  return format == MlaCacheFormat::kModel1 ? MlaModel1Block::kBytesPerToken : MlaFp8Row::kBytes;
}

MlaSparsePlan make_mla_sparse_plan(const MlaSparseShape& shape, const PlanShape& machine) {
  const auto fail = [](const std::string& message) { throw Error("mla_sparse plan: " + message); };
  if (shape.batch < 1 || shape.q_len < 1 || shape.num_heads < 1)
    fail("batch, q_len and num_heads must be at least 1 (got " + std::to_string(shape.batch) + ", " +
         std::to_string(shape.q_len) + ", " + std::to_string(shape.num_heads) + ")");
  if (shape.topk < 1) fail("topk = " + std::to_string(shape.topk) + " must be at least 1");
  if (shape.extra_topk < 0)
    fail("extra_topk = " + std::to_string(shape.extra_topk) + " is negative (0: no extra cache)");
  const int64_t requests = int64_t{shape.batch} * shape.q_len;
  if (requests > std::numeric_limits<int32_t>::max()) fail("batch * q_len does not fit in int32");
  PlanShape ps = machine;
  ps.group_size = shape.num_heads;
  ps.head_dim_v = kMlaSparseHeadDimV;

  MlaSparsePlan plan;
  plan.shape = shape;
  plan.main = make_decode_plan(std::vector<int32_t>(static_cast<size_t>(requests), shape.topk), ps);
  if (plan.direct()) {
    // The decode's own plan, its workspace, then the lse scratch.
    plan.extra.group_size = shape.num_heads;
    plan.extra.head_dim_v = kMlaSparseHeadDimV;
    plan.num_partials = plan.main.num_partials;
    plan.max_partials = most_chunks(plan.main);
    plan.workspace = plan.main.workspace;
    const long double scratch = static_cast<long double>(requests) * shape.num_heads * sizeof(float);
    if (scratch >= static_cast<long double>(int64_t{1} << 56)) fail("the workspace would exceed 2^56 bytes");
    plan.lse_scratch = static_cast<size_t>(round_up(static_cast<int64_t>(plan.workspace.total), 256));
    plan.workspace.total = plan.lse_scratch + static_cast<size_t>(round_up(static_cast<int64_t>(scratch), 256));
    return plan;
  }
  plan.extra = make_decode_plan(std::vector<int32_t>(static_cast<size_t>(requests), shape.extra_topk), ps);
  // Slots: request r's main chunks, then its extra chunks, contiguous, so
  // one merge range per request covers both caches.
  plan.merge_indptr.assign(1, 0);
  size_t i = 0, j = 0;
  int64_t slot = 0;
  for (int32_t r = 0; r < requests; ++r) {
    for (; i < plan.main.work.size() && plan.main.work[i].request == r; ++i)
      plan.main.work[i].partial = static_cast<int32_t>(slot++);
    for (; j < plan.extra.work.size() && plan.extra.work[j].request == r; ++j)
      plan.extra.work[j].partial = static_cast<int32_t>(slot++);
    if (slot > std::numeric_limits<int32_t>::max()) fail("more than 2^31 - 1 partial slots");
    plan.merge_indptr.push_back(static_cast<int32_t>(slot));
    plan.merge_requests.push_back(r);
    plan.max_partials =
        std::max(plan.max_partials, plan.merge_indptr[static_cast<size_t>(r) + 1] - plan.merge_indptr[r]);
  }
  plan.num_partials = static_cast<int32_t>(slot);
  for (DecodePlan* sub : {&plan.main, &plan.extra}) {
    sub->merge_requests.clear();  // the merge is the plan's own: run_decode_cuda launches the partials alone
    sub->merge_indptr.clear();
    sub->uniform_chunks = 0;  // every item reads its slot from the list
    sub->uniform_chunk_tokens = 0;
    sub->num_partials = plan.num_partials;
  }

  // Workspace: fp32 partials, both work lists, the merge lists, the flag.
  constexpr int64_t kAlign = 256;
  WorkspaceLayout& ws = plan.workspace;
  auto take = [&](long double bytes) {
    if (bytes >= static_cast<long double>(int64_t{1} << 56)) fail("the workspace would exceed 2^56 bytes");
    const size_t offset = ws.total;
    ws.total = static_cast<size_t>(round_up(static_cast<int64_t>(offset) + static_cast<int64_t>(bytes), kAlign));
    return offset;
  };
  const long double rows = static_cast<long double>(plan.num_partials) * shape.num_heads;
  ws.partial_o = take(rows * kMlaSparseHeadDimV * sizeof(float));
  ws.partial_lse = take(rows * sizeof(float));
  const size_t main_work = take(static_cast<long double>(plan.main.work.size()) * sizeof(WorkItem));
  const size_t extra_work = take(static_cast<long double>(plan.extra.work.size()) * sizeof(WorkItem));
  ws.work_items = main_work;
  ws.merge_indptr = take(static_cast<long double>(plan.merge_indptr.size()) * sizeof(int32_t));
  ws.merge_requests = take(static_cast<long double>(plan.merge_requests.size()) * sizeof(int32_t));
  ws.error_flag = take(2 * sizeof(uint32_t));  // DecodeErrors: kinds, first request
  plan.main.workspace = ws;
  plan.extra.workspace = ws;
  plan.extra.workspace.work_items = extra_work;
  return plan;
}

namespace {

// Why the direct form's lse scratch is not a 256-byte aligned region of
// num_requests * num_heads floats after main's workspace and inside the
// plan's, or "" (the plan check and the run that uses it both ask).
std::string lse_scratch_problem(const MlaSparsePlan& plan) {
  const size_t at = plan.lse_scratch, total = plan.workspace.total, after = plan.main.workspace.total;
  const size_t bytes =
      static_cast<size_t>(plan.num_requests()) * static_cast<size_t>(plan.shape.num_heads) * sizeof(float);
  if (at % 256 != 0) return "lse_scratch = " + std::to_string(at) + " is not a multiple of 256 bytes";
  if (at < after || at > total || bytes > total - at)
    return "lse_scratch = " + std::to_string(at) + " overlaps main's workspace (" + std::to_string(after) +
           " bytes) or runs past workspace.total = " + std::to_string(total);
  return {};
}

// check_mla_sparse_plan's direct form: main is a decode plan of its own for
// every request's topk ids, extra and the plan's merge lists are empty, and
// the workspace is main's with the lse scratch after it.
void check_direct_plan(const MlaSparsePlan& plan, int64_t requests) {
  const auto fail = [](const std::string& message) { throw Error("mla_sparse plan: " + message); };
  const MlaSparseShape& s = plan.shape;
  const DecodePlan& m = plan.main;
  try {
    check_decode_plan(m);
  } catch (const Error& e) {
    fail(std::string("main: ") + e.what());
  }
  if (m.num_requests != requests || m.seq_lens.size() != static_cast<size_t>(requests))
    fail("main has " + std::to_string(m.num_requests) + " requests, expected " + std::to_string(requests));
  for (size_t r = 0; r < m.seq_lens.size(); ++r)
    if (m.seq_lens[r] != s.topk) fail("main.seq_lens[" + std::to_string(r) + "] is not " + std::to_string(s.topk));
  if (m.group_size != s.num_heads || m.head_dim_v != kMlaSparseHeadDimV)
    fail("main is made for group_size " + std::to_string(m.group_size) + " and head_dim_v " +
         std::to_string(m.head_dim_v) + ", not " + std::to_string(s.num_heads) + " and 512");
  if (!plan.extra.work.empty() || plan.extra.num_requests != 0)
    fail("extra has items but the shape has no extra cache (extra_topk = 0)");
  if (!plan.merge_indptr.empty() || !plan.merge_requests.empty())
    fail("without an extra cache the merge lists are main's own; the plan's must be empty");
  if (plan.num_partials != m.num_partials || plan.max_partials != most_chunks(m))
    fail("num_partials = " + std::to_string(plan.num_partials) +
         " and max_partials = " + std::to_string(plan.max_partials) + " disagree with main's " +
         std::to_string(m.num_partials) + " and " + std::to_string(most_chunks(m)));
  const WorkspaceLayout &ws = plan.workspace, &mw = m.workspace;
  if (ws.partial_o != mw.partial_o || ws.partial_lse != mw.partial_lse || ws.work_items != mw.work_items ||
      ws.merge_indptr != mw.merge_indptr || ws.merge_requests != mw.merge_requests || ws.error_flag != mw.error_flag)
    fail("the workspace's regions disagree with main's");
  const std::string scratch = lse_scratch_problem(plan);
  if (!scratch.empty()) fail(scratch);
}

}  // namespace

void check_mla_sparse_plan(const MlaSparsePlan& plan) {
  const auto fail = [](const std::string& message) { throw Error("mla_sparse plan: " + message); };
  const MlaSparseShape& s = plan.shape;
  if (s.batch < 1 || s.q_len < 1 || s.num_heads < 1 || s.topk < 1 || s.extra_topk < 0)
    fail("the shape's batch, q_len, num_heads, topk must be at least 1 and extra_topk not negative");
  const int64_t requests = int64_t{s.batch} * s.q_len;
  if (requests > std::numeric_limits<int32_t>::max()) fail("batch * q_len does not fit in int32");
  if (plan.direct()) {
    check_direct_plan(plan, requests);
    return;
  }
  if (plan.lse_scratch != 0)
    fail("lse_scratch = " + std::to_string(plan.lse_scratch) + " with an extra cache (0: none)");
  if (plan.merge_indptr.size() != static_cast<size_t>(requests) + 1 ||
      plan.merge_requests.size() != static_cast<size_t>(requests))
    fail("merge_indptr must have num_requests + 1 entries and merge_requests num_requests");
  if (plan.merge_indptr.front() != 0 || plan.merge_indptr.back() != plan.num_partials)
    fail("merge_indptr must run from 0 to num_partials = " + std::to_string(plan.num_partials));
  int32_t most = 0;
  for (int64_t r = 0; r < requests; ++r) {
    if (plan.merge_requests[static_cast<size_t>(r)] != r)
      fail("merge_requests[" + std::to_string(r) + "] is not " + std::to_string(r));
    const int32_t count = plan.merge_indptr[static_cast<size_t>(r) + 1] - plan.merge_indptr[static_cast<size_t>(r)];
    if (count < 1) fail("request " + std::to_string(r) + " has no partial slot");
    most = std::max(most, count);
  }
  if (plan.max_partials != most)
    fail("max_partials = " + std::to_string(plan.max_partials) + " but a request has " + std::to_string(most));
  std::vector<uint8_t> used(static_cast<size_t>(plan.num_partials), 0);
  const auto check_sub = [&](const DecodePlan& sub, int32_t count, const char* name) {
    const std::string n(name);
    const int64_t expected_requests = count > 0 ? requests : 0;
    if (sub.num_requests != expected_requests || sub.seq_lens.size() != static_cast<size_t>(expected_requests))
      fail(n + " has " + std::to_string(sub.num_requests) + " requests, expected " + std::to_string(expected_requests));
    if (sub.group_size != s.num_heads || sub.head_dim_v != kMlaSparseHeadDimV)
      fail(n + " is made for group_size " + std::to_string(sub.group_size) + " and head_dim_v " +
           std::to_string(sub.head_dim_v) + ", not " + std::to_string(s.num_heads) + " and 512");
    if (!sub.merge_requests.empty() || !sub.merge_indptr.empty() || sub.uniform_chunks != 0 ||
        sub.num_partials != plan.num_partials)
      fail(n + " must have no merge lists of its own, no uniform split and the plan's num_partials");
    size_t i = 0;
    for (int64_t r = 0; r < expected_requests; ++r) {
      if (sub.seq_lens[static_cast<size_t>(r)] != count)
        fail(n + ".seq_lens[" + std::to_string(r) + "] is not " + std::to_string(count));
      int64_t covered = 0;
      const size_t first = i;
      for (; i < sub.work.size() && sub.work[i].request == r; ++i) {
        const WorkItem& w = sub.work[i];
        if (w.token_begin != covered || w.token_end < w.token_begin || w.token_end > count)
          fail(n + ".work[" + std::to_string(i) + "] covers [" + std::to_string(w.token_begin) + ", " +
               std::to_string(w.token_end) + ") of request " + std::to_string(r));
        covered = w.token_end;
        if (w.partial < plan.merge_indptr[static_cast<size_t>(r)] ||
            w.partial >= plan.merge_indptr[static_cast<size_t>(r) + 1] || used[static_cast<size_t>(w.partial)] != 0)
          fail(n + ".work[" + std::to_string(i) + "] has slot " + std::to_string(w.partial) + ", outside request " +
               std::to_string(r) + "'s merge range or already used");
        used[static_cast<size_t>(w.partial)] = 1;
      }
      if (i == first || covered != count) fail(n + " does not cover request " + std::to_string(r) + " exactly");
    }
    if (i != sub.work.size()) fail(n + ".work[" + std::to_string(i) + "] is out of order or out of range");
  };
  check_sub(plan.main, s.topk, "main");
  check_sub(plan.extra, s.extra_topk, "extra");
  if (std::find(used.begin(), used.end(), 0) != used.end()) fail("a partial slot belongs to no work item");
  // Workspace regions in order, none past the next or the total; the sub-plans share them.
  const WorkspaceLayout& ws = plan.workspace;
  const size_t rows = static_cast<size_t>(plan.num_partials) * static_cast<size_t>(s.num_heads);
  const size_t regions[][2] = {{ws.partial_o, rows * kMlaSparseHeadDimV * sizeof(float)},
                               {ws.partial_lse, rows * sizeof(float)},
                               {plan.main.workspace.work_items, plan.main.work.size() * sizeof(WorkItem)},
                               {plan.extra.workspace.work_items, plan.extra.work.size() * sizeof(WorkItem)},
                               {ws.merge_indptr, plan.merge_indptr.size() * sizeof(int32_t)},
                               {ws.merge_requests, plan.merge_requests.size() * sizeof(int32_t)},
                               {ws.error_flag, 2 * sizeof(uint32_t)}};
  size_t previous_end = 0;
  for (const auto& region : regions) {
    if (region[0] < previous_end || region[0] > ws.total || region[1] > ws.total - region[0])
      fail("the workspace layout overlaps or runs past workspace.total = " + std::to_string(ws.total));
    previous_end = region[0] + region[1];
  }
  for (const DecodePlan* sub : {&plan.main, &plan.extra}) {
    const WorkspaceLayout& w = sub->workspace;
    if (w.partial_o != ws.partial_o || w.partial_lse != ws.partial_lse || w.error_flag != ws.error_flag ||
        w.total != ws.total)
      fail("a sub-plan's workspace disagrees with the plan's (partials, error flag, total)");
  }
}

std::string mla_sparse_problem(const MlaSparseParams& p, const MlaSparsePlan& plan) {
  if (p.format != MlaCacheFormat::kV32 && p.format != MlaCacheFormat::kModel1)
    return "format " + std::to_string(static_cast<int32_t>(p.format)) + " is not an MlaCacheFormat";
  if (p.dtype != DType::kF32 && p.dtype != DType::kF16 && p.dtype != DType::kBF16)
    return "dtype " + std::to_string(static_cast<int32_t>(p.dtype)) + " is not a DType";
  const MlaSparseShape& s = plan.shape;
  if (p.batch != s.batch || p.q_len != s.q_len || p.num_heads != s.num_heads)
    return "batch, q_len, num_heads = " + std::to_string(p.batch) + ", " + std::to_string(p.q_len) + ", " +
           std::to_string(p.num_heads) + " but the plan was made for " + std::to_string(s.batch) + ", " +
           std::to_string(s.q_len) + ", " + std::to_string(s.num_heads);
  if (p.q == nullptr) return "q is null";
  if (p.o == nullptr) return "o is null";
  // q is only read, so views whose rows overlap are harmless; the tokens'
  // stride is fixed by how they are folded.
  if (p.q_batch_stride < 0 || p.q_token_stride < 0 || p.q_head_stride < 0) return "q's strides must not be negative";
  if (p.q_len > 1 && p.q_token_stride != int64_t{p.num_heads} * p.q_head_stride)
    return "q_token_stride = " + std::to_string(p.q_token_stride) +
           " must be num_heads * q_head_stride = " + std::to_string(int64_t{p.num_heads} * p.q_head_stride) +
           " (each query token of a sequence is decoded "
           "as one request, the tokens heads apart; make q contiguous over its tokens and heads)";
  if (!std::isfinite(p.scale)) return "scale is not finite";
  std::string problem = cache_problem(p, p.cache, "cache", s.topk);
  if (!problem.empty()) return problem;
  const bool has_extra = p.extra.data != nullptr;
  if (has_extra != (s.extra_topk > 0))
    return has_extra ? std::string("an extra cache is given but the plan was made without one (extra_topk = 0)")
                     : "the plan was made for an extra cache of topk " + std::to_string(s.extra_topk) +
                           " but extra.data is null";
  if (!has_extra && (p.extra.indices != nullptr || p.extra.topk_length != nullptr))
    return "extra.indices or extra.topk_length is set without an extra cache (extra.data is null)";
  if (has_extra) return cache_problem(p, p.extra, "extra", s.extra_topk);
  return {};
}

std::string cuda_mla_sparse_problem(const MlaSparseParams& p) {
  if (p.format == MlaCacheFormat::kModel1)
    return "MODEL1 caches (d_qk 512, 584 bytes a token) have no CUDA kernel in sparsepage yet; the CPU backend "
           "runs them";
  if (p.dtype != DType::kBF16) return std::string("q and o must be bf16 on CUDA, not ") + dtype_name(p.dtype);
  for (const MlaSparseCache* c : {&p.cache, &p.extra}) {
    if (c->data == nullptr) continue;
    const std::string name = cache_name(p, *c);
    if (c->block_stride != int64_t{c->block_size} * c->row_stride)
      return name + ".block_stride = " + std::to_string(c->block_stride) +
             " bytes: the CUDA kernel reads a cache "
             "whose blocks follow each other without gaps (block_size * row_stride = " +
             std::to_string(int64_t{c->block_size} * c->row_stride) + ")";
    if (c->row_stride % 16 != 0)
      return name + ".row_stride = " + std::to_string(c->row_stride) +
             " must be a multiple of 16 bytes on CUDA (rows are copied in 16-byte pieces)";
    if (reinterpret_cast<uintptr_t>(c->data) % 16 != 0) return name + ".data must be 16-byte aligned on CUDA";
    std::string problem = cuda_layout_problem(cache_decode_params(p, *c));
    if (!problem.empty()) return problem;
  }
  return cuda_arch_problem(cuda_device_sm(), MlaFp8Row::kLatent, MlaFp8Row::kLatent, MlaFp8Row::kRope);
}

bool merge_writes_every_row(const DecodePlan& plan) {
  if (plan.merge_requests.size() != static_cast<size_t>(plan.num_requests)) return false;
  if (plan.uniform_chunks > 0) return plan.uniform_chunks > 1;  // uniform: one chunk writes o directly
  return std::all_of(plan.work.begin(), plan.work.end(), [](const WorkItem& w) { return w.partial >= 0; });
}

void upload_mla_sparse_plan_cuda(const MlaSparsePlan& plan, void* workspace, void* stream) {
  check_mla_sparse_plan(plan);
  if (workspace == nullptr) throw Error("mla_sparse: workspace is null");
  // Each sub-plan copies its work list and clears the error flag; the merge
  // lists are the plan's own.
  upload_plan_cuda(plan.main, workspace, stream);
  if (plan.direct()) return;  // main's own merge lists went with it
  if (!plan.extra.work.empty()) upload_plan_cuda(plan.extra, workspace, stream);
  auto* base = static_cast<unsigned char*>(workspace);
  copy_bytes(base + plan.workspace.merge_indptr, Device::kCuda, plan.merge_indptr.data(), Device::kCpu,
             plan.merge_indptr.size() * sizeof(int32_t));
  copy_bytes(base + plan.workspace.merge_requests, Device::kCuda, plan.merge_requests.data(), Device::kCpu,
             plan.merge_requests.size() * sizeof(int32_t));
}

void run_mla_sparse_cuda(const MlaSparseParams& p, const MlaSparsePlan& plan, void* workspace, void* stream) {
  require_ok(mla_sparse_problem(p, plan));
  require_ok(cuda_mla_sparse_problem(p));
  if (workspace == nullptr) throw Error("mla_sparse: workspace is null");
  auto* base = static_cast<unsigned char*>(workspace);
  if (plan.direct()) {
    DecodeParams d = cache_decode_params(p, p.cache);
    if (merge_writes_every_row(plan.main)) {
      // Every request is split (small batches), so the decode's own merge
      // writes every row: it takes the sink and FlashMLA's +inf lse, and no
      // epilogue runs.
      detail::MergeFinish finish;
      finish.sink = p.attn_sink;
      finish.empty_lse = std::numeric_limits<float>::infinity();
      detail::run_decode_cuda(d, plan.main, workspace, stream, kMaxQueryTokens, finish);
      return;
    }
    // Otherwise the decode writes o and its lse (-inf where nothing was
    // attended), and the epilogue turns that lse into FlashMLA's +inf and
    // applies the sink to every row.
    if (p.lse == nullptr && p.attn_sink != nullptr) require_ok(lse_scratch_problem(plan));
    float* lse = p.lse != nullptr         ? p.lse
                 : p.attn_sink != nullptr ? reinterpret_cast<float*>(base + plan.lse_scratch)
                                          : nullptr;
    d.lse = lse;
    run_decode_cuda(d, plan.main, workspace, stream);
    if (lse == nullptr) return;
    detail::MlaEpilogueArgs e;
    e.dtype = p.dtype;
    e.batch = p.batch;
    e.num_tokens = p.q_len;
    e.num_heads = p.num_heads;
    e.dim = kMlaSparseHeadDimV;
    e.lse_in = lse;
    e.lse_out = p.lse;
    e.sink = p.attn_sink;
    e.out = p.o;
    e.out_head = kMlaSparseHeadDimV;
    e.out_token = int64_t{p.num_heads} * kMlaSparseHeadDimV;
    e.out_seq = int64_t{p.q_len} * e.out_token;
    detail::mla_epilogue_cuda(e, stream);
    return;
  }
  run_decode_cuda(cache_decode_params(p, p.cache), plan.main, workspace, stream);
  if (p.extra.data != nullptr) run_decode_cuda(cache_decode_params(p, p.extra), plan.extra, workspace, stream);
  detail::MergePartialsArgs m;
  m.dtype = p.dtype;
  m.partial_o = reinterpret_cast<const float*>(base + plan.workspace.partial_o);
  m.partial_lse = reinterpret_cast<const float*>(base + plan.workspace.partial_lse);
  m.merge_indptr = reinterpret_cast<const int32_t*>(base + plan.workspace.merge_indptr);
  m.merge_requests = reinterpret_cast<const int32_t*>(base + plan.workspace.merge_requests);
  m.num_requests = plan.num_requests();
  m.max_partials = plan.max_partials;
  m.heads = p.num_heads;
  m.tokens = p.q_len;
  m.dv = kMlaSparseHeadDimV;
  m.o_seq = int64_t{p.q_len} * p.num_heads * kMlaSparseHeadDimV;
  m.o_head = kMlaSparseHeadDimV;
  m.o = p.o;
  m.lse = p.lse;
  m.sink = p.attn_sink;
  m.empty_lse = std::numeric_limits<float>::infinity();
  detail::merge_partials_cuda(m, stream);
}

uint32_t read_mla_sparse_error_flag(const MlaSparsePlan& plan, void* workspace, void* stream) {
  return read_decode_error_flag(plan.main, workspace, stream);
}

}  // namespace sparsepage
