#include "sparsepage/plan.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>

#include "sparsepage/types.h"

namespace sparsepage {
namespace {

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

void require_positive(int64_t value, const char* name) {
  if (value < 1) {
    throw Error(std::string("plan: ") + name + " = " + std::to_string(value) + " must be at least 1");
  }
}

// The chunk length: long enough that each work item amortizes its setup and
// its share of the merge, short enough that the grid covers every
// multiprocessor `items_per_sm` times over.
// When the even share is within kWholeRequestShare of the longest request,
// the requests alone nearly fill that grid, and splitting them would only
// make a second wave of half-length items and a merge: each request then
// stays one item. On the H200 a batch that fills 97% of the slots ran
// faster as one chunk per request, one that fills 48% slower (the 2026-12-01
// peers notebook), so the rule stays near full.
// Never 0 (min_chunk_tokens = 0 over an empty batch would divide by it) and
// never longer than the longest request needs, so it fits int32.
constexpr double kWholeRequestShare = 0.9;

int64_t choose_chunk_tokens(int64_t total_tokens, int64_t longest, const PlanShape& shape) {
  if (shape.fixed_chunk_tokens > 0) return round_up(shape.fixed_chunk_tokens, shape.chunk_granule);
  const int64_t target_items = std::max<int64_t>(1, int64_t{shape.num_sms} * shape.items_per_sm / shape.ctas_per_item);
  const int64_t even_share = (total_tokens + target_items - 1) / target_items;
  const bool whole = static_cast<double>(even_share) >= kWholeRequestShare * static_cast<double>(longest);
  const int64_t chunk = whole ? longest : std::min(std::max<int64_t>(even_share, shape.min_chunk_tokens), longest);
  const int64_t largest = std::numeric_limits<int32_t>::max() / shape.chunk_granule * shape.chunk_granule;
  return std::min(std::max<int64_t>(round_up(chunk, shape.chunk_granule), shape.chunk_granule), largest);
}

// How many chunks a request of `len` tokens gets, and their balanced length
// (still granule multiples), so a length just over a multiple of the chunk
// does not leave a tiny tail item.
struct RequestChunks {
  int64_t count;
  int64_t tokens;
};
RequestChunks request_chunks(int64_t len, int64_t chunk, const PlanShape& shape) {
  const int64_t count = std::max<int64_t>(1, (len + chunk - 1) / chunk);
  const int64_t tokens =
      shape.fixed_chunk_tokens > 0 ? chunk : round_up((len + count - 1) / count, shape.chunk_granule);
  return {count, tokens};
}

void check_shape(const PlanShape& shape) {
  require_positive(shape.group_size, "group_size");
  require_positive(shape.head_dim_v, "head_dim_v");
  require_positive(shape.num_sms, "num_sms");
  require_positive(shape.items_per_sm, "items_per_sm");
  require_positive(shape.ctas_per_item, "ctas_per_item");
  require_positive(shape.chunk_granule, "chunk_granule");
  if (shape.min_chunk_tokens < 0 || shape.fixed_chunk_tokens < 0 || shape.min_chunk_tokens > (1 << 30) ||
      shape.fixed_chunk_tokens > (1 << 30) || shape.chunk_granule > (1 << 20)) {
    throw Error("plan: min_chunk_tokens and fixed_chunk_tokens must lie in [0, 2^30] and chunk_granule in [1, 2^20]");
  }
}

// a * b, or an Error naming `what` when it does not fit a size_t.
size_t checked_bytes(size_t a, size_t b, const char* what) {
  if (a != 0 && b > std::numeric_limits<size_t>::max() / a) {
    throw Error(std::string("plan: the workspace's ") + what + " do not fit in memory");
  }
  return a * b;
}

// The workspace a plan's counts need: fp32 partials, then the device copies
// of the lists, then the error flag, each region 256-byte aligned. A plan
// from make_decode_plan has exactly this layout; a blob must too.
WorkspaceLayout workspace_layout(const DecodePlan& plan) {
  constexpr size_t kAlign = 256;
  WorkspaceLayout ws;
  auto take = [&](size_t bytes) {
    const size_t offset = ws.total;
    ws.total = static_cast<size_t>(round_up(static_cast<int64_t>(offset + bytes), kAlign));
    return offset;
  };
  const size_t rows =
      checked_bytes(static_cast<size_t>(plan.num_partials), static_cast<size_t>(plan.group_size), "partial rows");
  const size_t partial_o_bytes = checked_bytes(
      checked_bytes(rows, static_cast<size_t>(plan.head_dim_v), "partial outputs"), sizeof(float), "partial outputs");
  if (partial_o_bytes > (size_t{1} << 56)) {
    throw Error("plan: the partial outputs need " + std::to_string(partial_o_bytes) +
                " bytes of workspace; group_size * head_dim_v is too large for this many chunks");
  }
  ws.partial_o = take(partial_o_bytes);
  ws.partial_lse = take(rows * sizeof(float));
  ws.work_items = take(plan.work.size() * sizeof(WorkItem));
  ws.merge_indptr = take(plan.merge_indptr.size() * sizeof(int32_t));
  ws.merge_requests = take(plan.merge_requests.size() * sizeof(int32_t));
  ws.error_flag = take(2 * sizeof(uint32_t));  // DecodeErrors: kinds, first request
  return ws;
}

}  // namespace

UniformSplit make_uniform_split(int64_t requests, int64_t tokens, const PlanShape& shape) {
  check_shape(shape);
  if (requests < 0 || tokens < 0 || tokens > std::numeric_limits<int32_t>::max()) {
    throw Error("plan: a uniform split needs requests >= 0 and tokens in [0, 2^31 - 1] (got " +
                std::to_string(requests) + ", " + std::to_string(tokens) + ")");
  }
  const auto total = static_cast<int64_t>(std::min<long double>(static_cast<long double>(requests) * tokens, 9e18L));
  const RequestChunks chunks = request_chunks(tokens, choose_chunk_tokens(total, tokens, shape), shape);
  return {std::max<int64_t>(chunks.tokens, shape.chunk_granule), chunks.count};
}

DecodePlan make_decode_plan(const std::vector<int32_t>& seq_lens, const PlanShape& shape) {
  check_shape(shape);
  if (seq_lens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw Error("plan: " + std::to_string(seq_lens.size()) + " requests, more than 2^31 - 1");
  }
  int64_t total_tokens = 0, longest = 0;
  for (size_t r = 0; r < seq_lens.size(); ++r) {
    if (seq_lens[r] < 0) {
      throw Error("plan: seq_lens[" + std::to_string(r) + "] = " + std::to_string(seq_lens[r]) + " is negative");
    }
    total_tokens += seq_lens[r];
    longest = std::max<int64_t>(longest, seq_lens[r]);
  }

  DecodePlan plan;
  plan.num_requests = static_cast<int32_t>(seq_lens.size());
  plan.group_size = shape.group_size;
  plan.head_dim_v = shape.head_dim_v;
  plan.seq_lens = seq_lens;
  const int64_t chunk = choose_chunk_tokens(total_tokens, longest, shape);
  plan.chunk_tokens = static_cast<int32_t>(chunk);
  // Count the work before building it: a tiny fixed chunk over a long request
  // would otherwise allocate gigabytes of work items before failing.
  int64_t items = 0;
  for (int32_t len : seq_lens) items += std::max<int64_t>(1, (int64_t{len} + chunk - 1) / chunk);
  if (items > kMaxWorkItems) {
    throw Error("plan: " + std::to_string(items) + " work items (chunks of " + std::to_string(chunk) +
                " tokens) exceed the limit of " + std::to_string(kMaxWorkItems) +
                "; use a larger fixed_chunk_tokens or min_chunk_tokens");
  }
  plan.work.reserve(static_cast<size_t>(items));

  int32_t next_partial = 0;
  plan.merge_indptr.push_back(0);
  for (int32_t r = 0; r < plan.num_requests; ++r) {
    const int64_t len = seq_lens[r];
    const auto [chunks, balanced] = request_chunks(len, chunk, shape);
    if (chunks == 1) {
      // A single chunk writes the output directly; an empty request still
      // gets its item so that o = 0 and lse = -inf are written.
      plan.work.push_back({r, 0, static_cast<int32_t>(len), -1});
      continue;
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = c * balanced;
      const int64_t end = std::min(len, begin + balanced);
      plan.work.push_back({r, static_cast<int32_t>(begin), static_cast<int32_t>(end), next_partial++});
    }
    plan.merge_requests.push_back(r);
    plan.merge_indptr.push_back(next_partial);
  }
  plan.num_partials = next_partial;
  // Uniform when every request has the same count (so the same chunks): the
  // items above are then exactly r * chunks + c with partial slots in order.
  if (!seq_lens.empty() &&
      std::all_of(seq_lens.begin(), seq_lens.end(), [&](int32_t len) { return len == seq_lens[0]; })) {
    plan.uniform_chunks = static_cast<int32_t>(plan.work.size() / seq_lens.size());
    plan.uniform_chunk_tokens = plan.work[0].token_end;  // the first chunk is a whole one
  }

  plan.workspace = workspace_layout(plan);
  return plan;
}

void check_decode_plan(const DecodePlan& plan) {
  const auto fail = [](const std::string& message) { throw Error("plan: " + message); };
  const int64_t requests = plan.num_requests;
  if (requests < 0 || static_cast<size_t>(requests) != plan.seq_lens.size()) {
    fail("num_requests = " + std::to_string(requests) + " but seq_lens has " + std::to_string(plan.seq_lens.size()) +
         " entries");
  }
  if (plan.group_size < 1 || plan.head_dim_v < 1 || plan.num_partials < 0) {
    fail("group_size, head_dim_v must be at least 1 and num_partials not negative");
  }
  // Work items: ordered by request, each request tiled exactly from 0 to its
  // length; a request with one item writes directly (partial -1), one with
  // several writes distinct partial slots.
  std::vector<int32_t> partial_owner(static_cast<size_t>(plan.num_partials), -1);
  std::vector<int64_t> partials_of(static_cast<size_t>(requests), 0);
  size_t i = 0;
  for (int32_t r = 0; r < requests; ++r) {
    const int64_t len = plan.seq_lens[static_cast<size_t>(r)];
    if (len < 0) fail("seq_lens[" + std::to_string(r) + "] is negative");
    int64_t covered = 0;
    const size_t first = i;
    for (; i < plan.work.size() && plan.work[i].request == r; ++i) {
      const WorkItem& w = plan.work[i];
      if (w.token_begin != covered || w.token_end < w.token_begin || w.token_end > len) {
        fail("work[" + std::to_string(i) + "] covers [" + std::to_string(w.token_begin) + ", " +
             std::to_string(w.token_end) + ") of request " + std::to_string(r) + " (" + std::to_string(len) +
             " tokens, " + std::to_string(covered) + " covered so far)");
      }
      covered = w.token_end;
      if (w.partial >= plan.num_partials || w.partial < -1 ||
          (w.partial >= 0 && partial_owner[static_cast<size_t>(w.partial)] != -1)) {
        fail("work[" + std::to_string(i) + "] has partial slot " + std::to_string(w.partial) + " (of " +
             std::to_string(plan.num_partials) + "), out of range or already used");
      }
      if (w.partial >= 0) {
        partial_owner[static_cast<size_t>(w.partial)] = r;
        ++partials_of[static_cast<size_t>(r)];
      }
    }
    const size_t items = i - first;
    if (items == 0 || covered != len) {
      fail("request " + std::to_string(r) + " is not covered by its work items (" + std::to_string(covered) + " of " +
           std::to_string(len) + " tokens)");
    }
    const bool direct = plan.work[first].partial < 0;
    if (direct != (items == 1)) fail("request " + std::to_string(r) + " mixes direct output and partial slots");
  }
  if (i != plan.work.size())
    fail("work[" + std::to_string(i) + "] names request " + std::to_string(plan.work[i].request) +
         " out of order or out of range");
  // A uniform split must be exactly what its two numbers describe.
  if (plan.uniform_chunks < 0 || plan.uniform_chunk_tokens < 0)
    fail("uniform_chunks and uniform_chunk_tokens must not be negative");
  if (plan.uniform_chunks > 0) {
    const int64_t chunks = plan.uniform_chunks, chunk = plan.uniform_chunk_tokens;
    if (static_cast<int64_t>(plan.work.size()) != requests * chunks)
      fail("uniform_chunks disagrees with the work list's size");
    for (size_t w = 0; w < plan.work.size(); ++w) {
      const WorkItem& item = plan.work[w];
      const int64_t r = static_cast<int64_t>(w) / chunks, c = static_cast<int64_t>(w) % chunks;
      const int64_t len = plan.seq_lens[static_cast<size_t>(r)];
      const int64_t begin = c * chunk;
      if (item.request != r || item.token_begin != begin || item.token_end != std::min(len, begin + chunk) ||
          item.partial != (chunks > 1 ? static_cast<int64_t>(w) : -1) || (c + 1 == chunks && begin + chunk < len)) {
        fail("work[" + std::to_string(w) + "] is not the uniform split's item (uniform_chunks = " +
             std::to_string(chunks) + ", uniform_chunk_tokens = " + std::to_string(chunk) + ")");
      }
    }
  }
  // Merge lists: one entry per split request, its slots exactly its partials.
  const bool no_merge_lists = plan.merge_indptr.empty() && plan.merge_requests.empty() && plan.num_partials == 0;
  if (!no_merge_lists && (plan.merge_indptr.size() != plan.merge_requests.size() + 1 ||
                          plan.merge_indptr.front() != 0 || plan.merge_indptr.back() != plan.num_partials)) {
    fail("merge_indptr must have merge_requests + 1 entries from 0 to num_partials");
  }
  std::vector<uint8_t> merged(static_cast<size_t>(requests), 0);
  for (size_t m = 0; m < plan.merge_requests.size(); ++m) {
    const int32_t r = plan.merge_requests[m];
    if (r < 0 || r >= requests || merged[static_cast<size_t>(r)] != 0) {
      fail("merge_requests[" + std::to_string(m) + "] = " + std::to_string(r) +
           " is out of range or names a request already merged");
    }
    merged[static_cast<size_t>(r)] = 1;
    if (plan.merge_indptr[m + 1] < plan.merge_indptr[m]) fail("merge_indptr decreases at " + std::to_string(m));
    // Slots past num_partials are never looked up (a later entry may decrease back to it).
    if (plan.merge_indptr[m] < 0 || plan.merge_indptr[m + 1] > plan.num_partials)
      fail("merge_indptr[" + std::to_string(m + 1) + "] = " + std::to_string(plan.merge_indptr[m + 1]) +
           " lies outside [0, num_partials = " + std::to_string(plan.num_partials) + "]");
    for (int32_t slot = plan.merge_indptr[m]; slot < plan.merge_indptr[m + 1]; ++slot) {
      if (partial_owner[static_cast<size_t>(slot)] != r) {
        fail("merge slot " + std::to_string(slot) + " is listed for request " + std::to_string(r) +
             " but belongs to another");
      }
    }
    // A request without partial slots writes its output directly; a merge
    // entry for it would overwrite that output with an empty merge.
    if (partials_of[static_cast<size_t>(r)] == 0) {
      fail("merge entry " + std::to_string(m) + " names request " + std::to_string(r) +
           ", which has no partial slots (its items write the output directly)");
    }
    if (plan.merge_indptr[m + 1] - plan.merge_indptr[m] != partials_of[static_cast<size_t>(r)]) {
      fail("merge entry " + std::to_string(m) + " lists " +
           std::to_string(plan.merge_indptr[m + 1] - plan.merge_indptr[m]) + " slots for request " + std::to_string(r) +
           ", which has " + std::to_string(partials_of[static_cast<size_t>(r)]) + " partials");
    }
  }
  // Workspace: each region in order, none past the next or past the total.
  const WorkspaceLayout& ws = plan.workspace;
  const size_t rows = static_cast<size_t>(plan.num_partials) * static_cast<size_t>(plan.group_size);
  const size_t ends[][2] = {
      {ws.partial_o, checked_bytes(checked_bytes(rows, static_cast<size_t>(plan.head_dim_v), "partial outputs"),
                                   sizeof(float), "partial outputs")},
      {ws.partial_lse, rows * sizeof(float)},
      {ws.work_items, plan.work.size() * sizeof(WorkItem)},
      {ws.merge_indptr, plan.merge_indptr.size() * sizeof(int32_t)},
      {ws.merge_requests, plan.merge_requests.size() * sizeof(int32_t)},
      {ws.error_flag, 2 * sizeof(uint32_t)}};
  size_t previous_end = 0;
  for (const auto& region : ends) {
    if (region[0] < previous_end || region[0] > ws.total || region[1] > ws.total - region[0]) {
      fail("the workspace layout overlaps or runs past workspace.total = " + std::to_string(ws.total));
    }
    previous_end = region[0] + region[1];
  }
}

namespace {

// The serialized form: a header of kPlanHeaderWords words, then the work
// items (four words each), merge_requests, merge_indptr and seq_lens.
constexpr int64_t kPlanMagic = 0x5350504C414E0001;  // "SPPLAN", format version 1
constexpr size_t kPlanHeaderWords = 20;

// The header's scalar fields in word order (words 2 .. 15, after the magic
// and the word count), named as deserialize_decode_plan's errors name them.
template <class Owner, class Value>
struct Field {
  Value Owner::*member;
  const char* name;
};
constexpr Field<DecodePlan, int32_t> kPlanFields[] = {{&DecodePlan::num_requests, "num_requests"},
                                                      {&DecodePlan::group_size, "group_size"},
                                                      {&DecodePlan::head_dim_v, "head_dim_v"},
                                                      {&DecodePlan::chunk_tokens, "chunk_tokens"},
                                                      {&DecodePlan::num_partials, "num_partials"},
                                                      {&DecodePlan::uniform_chunks, "uniform_chunks"},
                                                      {&DecodePlan::uniform_chunk_tokens, "uniform_chunk_tokens"}};
constexpr Field<WorkspaceLayout, size_t> kWorkspaceFields[] = {
    {&WorkspaceLayout::partial_o, "workspace.partial_o"},
    {&WorkspaceLayout::partial_lse, "workspace.partial_lse"},
    {&WorkspaceLayout::work_items, "workspace.work_items"},
    {&WorkspaceLayout::merge_indptr, "workspace.merge_indptr"},
    {&WorkspaceLayout::merge_requests, "workspace.merge_requests"},
    {&WorkspaceLayout::error_flag, "workspace.error_flag"},
    {&WorkspaceLayout::total, "workspace.total"}};
static_assert(2 + std::size(kPlanFields) + std::size(kWorkspaceFields) + 4 == kPlanHeaderWords,
              "the header: magic, word count, the fields, the four list lengths");

}  // namespace

std::vector<int64_t> serialize_decode_plan(const DecodePlan& plan) {
  std::vector<int64_t> out;
  out.reserve(kPlanHeaderWords + 4 * plan.work.size() + plan.merge_requests.size() + plan.merge_indptr.size() +
              plan.seq_lens.size());
  out.insert(out.end(), {kPlanMagic, 0});  // the word count, filled in below
  for (const auto& f : kPlanFields) out.push_back(plan.*f.member);
  for (const auto& f : kWorkspaceFields) out.push_back(static_cast<int64_t>(plan.workspace.*f.member));
  for (const size_t n : {plan.work.size(), plan.merge_requests.size(), plan.merge_indptr.size(), plan.seq_lens.size()})
    out.push_back(static_cast<int64_t>(n));
  for (const WorkItem& w : plan.work) out.insert(out.end(), {w.request, w.token_begin, w.token_end, w.partial});
  for (const auto* list : {&plan.merge_requests, &plan.merge_indptr, &plan.seq_lens})
    out.insert(out.end(), list->begin(), list->end());
  out[1] = static_cast<int64_t>(out.size());
  return out;
}

DecodePlan deserialize_decode_plan(const int64_t* words, size_t count) {
  const auto fail = [](const std::string& message) { throw Error("deserialize_decode_plan: " + message); };
  if (words == nullptr && count > 0) fail("words is null");
  if (count < kPlanHeaderWords)
    fail("the blob has " + std::to_string(count) + " words, fewer than the " + std::to_string(kPlanHeaderWords) +
         "-word header (truncated, or not a plan)");
  if (words[0] != kPlanMagic) fail("word 0 is not the plan format's magic number (another format or version)");
  if (words[1] != static_cast<int64_t>(count))
    fail("the blob says it holds " + std::to_string(words[1]) + " words but " + std::to_string(count) +
         " were given (truncated or padded)");
  const auto int32_field = [&](size_t i, const char* name) {
    if (words[i] < std::numeric_limits<int32_t>::min() || words[i] > std::numeric_limits<int32_t>::max())
      fail(std::string(name) + " = " + std::to_string(words[i]) + " does not fit in int32");
    return static_cast<int32_t>(words[i]);
  };
  const auto size_field = [&](size_t i, const char* name) {
    if (words[i] < 0) fail(std::string(name) + " = " + std::to_string(words[i]) + " is negative");
    return static_cast<size_t>(words[i]);
  };
  DecodePlan plan;
  size_t at = 2;
  for (const auto& f : kPlanFields) plan.*f.member = int32_field(at++, f.name);
  if (plan.chunk_tokens < 0) fail("chunk_tokens = " + std::to_string(plan.chunk_tokens) + " is negative");
  for (const auto& f : kWorkspaceFields) plan.workspace.*f.member = size_field(at++, f.name);
  // The lists' lengths, each checked against the words left before any is allocated.
  const size_t left = count - kPlanHeaderWords;
  const size_t n_work = size_field(16, "the work item count"), n_merge = size_field(17, "the merge_requests count"),
               n_indptr = size_field(18, "the merge_indptr count"), n_lens = size_field(19, "the seq_lens count");
  if (n_work > left / 4 || n_merge > left || n_indptr > left || n_lens > left ||
      4 * n_work + n_merge + n_indptr + n_lens != left) {
    fail("the lists' lengths (" + std::to_string(n_work) + " work items, " + std::to_string(n_merge) + " + " +
         std::to_string(n_indptr) + " merge entries, " + std::to_string(n_lens) + " seq_lens) do not fill the " +
         std::to_string(left) + " words after the header");
  }
  at = kPlanHeaderWords;
  const auto list = [&](size_t n, const char* name) {
    std::vector<int32_t> values(n);
    for (size_t i = 0; i < n; ++i, ++at) values[i] = int32_field(at, name);
    return values;
  };
  const std::vector<int32_t> work = list(4 * n_work, "a work item field");
  plan.work.resize(n_work);
  for (size_t i = 0; i < n_work; ++i) plan.work[i] = {work[4 * i], work[4 * i + 1], work[4 * i + 2], work[4 * i + 3]};
  plan.merge_requests = list(n_merge, "a merge_requests entry");
  plan.merge_indptr = list(n_indptr, "a merge_indptr entry");
  plan.seq_lens = list(n_lens, "a seq_lens entry");
  // Each partial slot belongs to one work item: more slots than items would
  // only size a workspace nothing writes (and the check's slot table).
  if (static_cast<size_t>(plan.num_partials) > n_work)
    fail("num_partials = " + std::to_string(plan.num_partials) + " exceeds the " + std::to_string(n_work) +
         " work items (each slot belongs to one)");
  WorkspaceLayout need;
  try {
    check_decode_plan(plan);
    need = workspace_layout(plan);
  } catch (const Error& e) {
    fail(e.what());
  }
  // The layout is a function of the counts: a blob cannot ask for more.
  for (const auto& f : kWorkspaceFields) {
    if (plan.workspace.*f.member != need.*f.member)
      fail("the workspace layout (workspace.total = " + std::to_string(plan.workspace.total) +
           ") is not the one the plan's partials and lists need (" + std::to_string(need.total) + " bytes)");
  }
  return plan;
}

}  // namespace sparsepage
