// The split-KV plan (docs/DESIGN.md: the paged decode): host-only, from per-request visible
// counts, deterministic. The same plan is reused while counts are unchanged,
// which is what makes `run` capturable in a CUDA graph.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparsepage {

/// One unit of partial work: tokens [token_begin, token_end) of `request`.
/// Its partial lands in slot `partial` of the workspace, or straight in the
/// output when the request has a single chunk (partial == -1).
struct WorkItem {
  int32_t request;
  int32_t token_begin;
  int32_t token_end;
  int32_t partial;
};

/// What the plan needs to know about the problem and the machine.
struct PlanShape {
  int32_t group_size = 1;    // query heads per request
  int32_t head_dim_v = 128;  // output width; sizes the partials
  int32_t num_sms = 132;     // multiprocessors to fill (any value >= 1 on the CPU)
  /// Work items per multiprocessor the plan aims for. More items mean more
  /// bytes in flight at small batch, and more partials to merge.
  int32_t items_per_sm = 2;
  /// CTAs the kernel launches per work item (query-head tiles); the plan aims
  /// for num_sms * items_per_sm CTAs, so for that many / ctas_per_item items.
  int32_t ctas_per_item = 1;
  /// Smallest chunk, rounded up to `chunk_granule`. Chunks shorter than this
  /// pay more in merge and per-item setup than they win in parallelism
  /// (measured on the H200: at batch 1 of the block-sparse geometry, 128-token
  /// chunks beat 64 and 256; docs/PERFORMANCE.md).
  int32_t min_chunk_tokens = 128;
  /// Chunks are multiples of this many tokens (the kernel's token tile).
  int32_t chunk_granule = 64;
  /// 0 lets the plan choose; otherwise every chunk has exactly this many
  /// tokens (rounded to the granule): how tests force splits on and off.
  int32_t fixed_chunk_tokens = 0;
};

/// Workspace layout, all offsets in bytes from the workspace base, each
/// 256-byte aligned. Partial outputs are fp32 `[num_partials, group_size,
/// head_dim_v]` and partial lse fp32 `[num_partials, group_size]`.
struct WorkspaceLayout {
  size_t partial_o = 0;
  size_t partial_lse = 0;
  size_t work_items = 0;      // WorkItem[num_items] (device copy for the GPU backend)
  size_t merge_indptr = 0;    // int32 [num_merge_requests + 1] into partial slots
  size_t merge_requests = 0;  // int32 [num_merge_requests]
  size_t error_flag = 0;      // uint32 [2]: the kinds the kernels met, the first request (decode.h's DecodeErrors)
  size_t total = 0;
};

struct DecodePlan {
  int32_t num_requests = 0;
  int32_t group_size = 1;
  int32_t head_dim_v = 0;
  int32_t chunk_tokens = 0;             // most tokens in any chunk (a request's chunks are balanced)
  std::vector<WorkItem> work;           // ordered by request, then token_begin
  std::vector<int32_t> merge_requests;  // requests split into more than one chunk
  std::vector<int32_t> merge_indptr;    // [merge_requests.size() + 1]: partial slots per merged request
  int32_t num_partials = 0;
  /// > 0 when the split is uniform (every request planned for the same count,
  /// the usual case of a step planned for the selection's bound): request r
  /// owns items and partial slots r * uniform_chunks .. + uniform_chunks - 1,
  /// item c covering [c * uniform_chunk_tokens, min(len, (c + 1) *
  /// uniform_chunk_tokens)), and writes o directly when uniform_chunks == 1.
  /// The GPU backend then computes each item from its index and reads no list.
  int32_t uniform_chunks = 0;
  int32_t uniform_chunk_tokens = 0;
  bool needs_merge() const { return !merge_requests.empty(); }
  /// The most partial slots one merged request has (0 when none is merged).
  int32_t most_merged_partials() const {
    if (uniform_chunks > 1) return uniform_chunks;
    int32_t most = 0;
    for (size_t i = 0; i + 1 < merge_indptr.size(); ++i) most = std::max(most, merge_indptr[i + 1] - merge_indptr[i]);
    return most;
  }
  WorkspaceLayout workspace;
  /// Per-request counts the plan was made for. The CPU backend checks the
  /// table's seq_lens against them; the CUDA backend cannot read a device
  /// table on the host, so there the caller keeps plan and table in step.
  std::vector<int32_t> seq_lens;
};

/// Most work items a plan may hold (16 bytes each); a plan that would need
/// more is refused by name rather than allocated.
constexpr int64_t kMaxWorkItems = int64_t{1} << 24;

/// Makes the plan. Every request gets at least one work item (an empty request
/// still writes o = 0, lse = -inf). Throws sparsepage::Error on bad shape,
/// negative counts, or more than kMaxWorkItems work items.
DecodePlan make_decode_plan(const std::vector<int32_t>& seq_lens, const PlanShape& shape);

/// The chunking make_decode_plan gives a batch whose `requests` requests all
/// have `tokens` tokens: each request in `chunks_per_request` chunks of
/// `chunk_tokens` (the last one may be shorter). No work list: a kernel
/// derives work item i from its index alone, which is how the mask path
/// splits (its requests all span the live window). Same checks and same
/// choices as make_decode_plan: one split policy for both.
struct UniformSplit {
  int64_t chunk_tokens = 0;  // >= shape.chunk_granule, a multiple of it
  int64_t chunks_per_request = 1;
};
UniformSplit make_uniform_split(int64_t requests, int64_t tokens, const PlanShape& shape);

/// Throws sparsepage::Error naming the first inconsistency of a plan that
/// was built or edited by hand: work items outside their request, a request
/// not covered exactly once, partial slots out of range or shared, merge
/// lists that disagree with the work, a workspace layout that overlaps or
/// overruns `workspace.total`. The CPU backend runs it on every call (the
/// plan's fields are public, and the backend indexes with them).
void check_decode_plan(const DecodePlan& plan);

/// The plan as data: int64 words that hold every field, so a framework op
/// can take the plan as an argument (a CPU int64 tensor, as FlashInfer's ops
/// take their plan_info) and rebuild it, with no registry of live plans.
/// The words start with a magic number carrying the format's version and
/// their own count.
std::vector<int64_t> serialize_decode_plan(const DecodePlan& plan);

/// Rebuilds the plan serialize_decode_plan wrote. Throws sparsepage::Error
/// naming what is wrong with `words` (another format or version, a count
/// that disagrees with the words given, a truncated or padded blob, a field
/// outside its range, more partial slots than work items) before it
/// allocates, then runs check_decode_plan on the result, so an edited blob
/// is refused like an edited plan. Its workspace layout must also be the
/// one make_decode_plan gives for its counts: a blob asks for no more
/// workspace than its work needs.
DecodePlan deserialize_decode_plan(const int64_t* words, size_t count);

}  // namespace sparsepage
