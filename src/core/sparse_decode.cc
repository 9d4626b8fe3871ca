#include "sparsepage/sparse_decode.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "core/cuda_hooks.h"
#include "core/require.h"
#include "cpu/parallel.h"
#include "sparsepage/cache.h"
#include "sparsepage/detail/cuda_introspection.h"

#define REQUIRE(ok, ...) SPARSEPAGE_REQUIRE(ok, "sparse decode: ", __VA_ARGS__)

namespace sparsepage {
namespace {

// The fields of a launch the inputs give directly: the operands and the KV
// format (with its scales). The layout and the KV format's checks depend on
// these alone.
DecodeParams stream_fields(const SparseAttentionInputs& in) {
  DecodeParams p;
  static_cast<AttentionOperands&>(p) = in;
  p.kv_format = in.kv_format;
  p.k_scale = in.k_scale;
  p.v_scale = in.v_scale;
  return p;
}

// Before anything divides by num_kv_heads.
void check_heads(const SparseAttentionInputs& in) {
  REQUIRE(in.num_kv_heads >= 1 && in.num_qo_heads >= 1 && in.num_qo_heads % in.num_kv_heads == 0,
          "num_qo_heads = " + std::to_string(in.num_qo_heads) +
              " must be a positive multiple of num_kv_heads = " + std::to_string(in.num_kv_heads));
}

void check_inputs(const SparseAttentionInputs& in) {
  REQUIRE(in.dtype == DType::kF32 || in.dtype == DType::kF16 || in.dtype == DType::kBF16,
          "dtype " + std::to_string(static_cast<int32_t>(in.dtype)) + " is not a DType");
  REQUIRE(in.batch >= 1, "batch = " + std::to_string(in.batch) + " must be at least 1");
  check_heads(in);
  const int64_t requests = int64_t{in.batch} * in.num_kv_heads;
  REQUIRE(requests <= std::numeric_limits<int32_t>::max(),
          "batch * num_kv_heads = " + std::to_string(requests) + " exceeds 2^31 - 1 requests");
  REQUIRE(in.live_len >= 0 && in.live_len <= INT32_MAX,
          "live_len = " + std::to_string(in.live_len) + " must lie in [0, 2^31 - 1]");
  // Rows each stream must hold distinct: the live window of a dense cache,
  // every row of an engine's pool.
  int64_t rows = in.live_len;
  if (in.block_table.data != nullptr) {
    const BlockTable& t = in.block_table;
    const std::string problem = block_table_problem(t, in.batch);
    REQUIRE(problem.empty(), problem);
    REQUIRE(int64_t{t.max_blocks} * t.block_size >= in.live_len,
            "block_table: " + std::to_string(t.max_blocks) + " blocks of " + std::to_string(t.block_size) +
                " rows cannot hold live_len = " + std::to_string(in.live_len) + " positions");
    rows = t.num_blocks * t.block_size;
  }
  const std::pair<const RowView*, const char*> streams[] = {{&in.k, "k"}, {&in.v, "v"}, {&in.k_extra, "k_extra"}};
  for (const auto& [stream, name] : streams) {
    if (stream == &in.k_extra && in.k_extra.data == nullptr) continue;
    // fp8 K and V count bytes (the second stream stays dtype).
    const size_t size = in.kv_format != KvFormat::kNative && stream != &in.k_extra ? 1 : dtype_size(in.dtype);
    const std::string problem = row_view_problem(*stream, name, in.batch, in.num_kv_heads, rows, size);
    REQUIRE(problem.empty(), problem);
  }
  REQUIRE(in.q != nullptr && in.o != nullptr, "q and o must not be null");
  REQUIRE(in.q_len >= 1 && in.q_len <= kMaxQueryTokens,
          "q_len = " + std::to_string(in.q_len) + " must lie in [1, " + std::to_string(kMaxQueryTokens) + "]");
  REQUIRE(int64_t{in.q_len} * in.num_qo_heads <= std::numeric_limits<int32_t>::max(),
          "q_len * num_qo_heads exceeds 2^31 - 1 query rows");
  REQUIRE((in.q_extra != nullptr) == (in.k_extra.data != nullptr), "q_extra and k_extra must both be set or neither");
  const std::string kv_format = kv_format_problem(stream_fields(in));
  REQUIRE(kv_format.empty(), kv_format);
}

void check_inputs(const SparseAttentionInputs& in, const SparseSelection& selection) {
  check_inputs(in);
  const int64_t requests = int64_t{in.batch} * in.num_kv_heads;
  REQUIRE(selection.num_requests() == requests,
          "the selection has " + std::to_string(selection.num_requests()) +
              " requests, expected batch * num_kv_heads = " + std::to_string(requests));
  REQUIRE(selection.total() == 0 || selection.indices.device() == in.device,
          std::string("the selection lives on ") + device_name(selection.indices.device()) + ", the inputs on " +
              device_name(in.device));
  REQUIRE(static_cast<int64_t>(selection.indices.bytes()) >= selection.total() * 4,
          "the selection's indices hold fewer entries than its counts sum to");
}

// What the CUDA kernels cannot read, or "": the launchers' own check
// (decode.h) over the fields of a launch that the layout depends on.
std::string cuda_layout_problem_of(const SparseAttentionInputs& in) { return cuda_layout_problem(stream_fields(in)); }

int32_t machine_width(Device device) {
  if (device == Device::kCuda) return cuda_multiprocessor_count();
  return cpu::hardware_threads();
}

// A decision as try_fused returns it: counted in the process's stats first.
SparseDecodeOutcome counted(const SparseDecodeOutcome& outcome) {
  record_outcome(outcome);
  return outcome;
}

}  // namespace

SparseDecoder::SparseDecoder(Device device, DispatchConfig config) : device_(device), config_(config) {
  // The kernel switches are read once per process: a bad value is refused
  // here, when a decoder (and so a layer) is made, not by a step that has
  // already appended.
  if (device_ == Device::kCuda) cuda_check_kernel_switches();
}

SparseDecodeOutcome SparseDecoder::decide_counts(const SparseAttentionInputs& in, int64_t requests,
                                                 int64_t selected) const {
  DispatchInput d;
  d.num_requests = requests;
  d.selected_rows = selected;
  d.live_len = in.live_len;
  d.raw_cache = in.raw_cache;
  d.device_available = device_ == Device::kCpu || cuda_available();
  d.head_dims_supported = device_ == Device::kCpu ||
                          cuda_supports_head_dims(in.k.dim, in.v.dim, in.k_extra.data != nullptr ? in.k_extra.dim : 0);
  if (device_ == Device::kCuda) d.layout_problem = cuda_layout_problem_of(in);
  d.layout_supported = d.layout_problem.empty();
  if (device_ == Device::kCuda && d.device_available && d.head_dims_supported) {
    d.arch_problem = cuda_arch_problem(config_.assume_sm > 0 ? config_.assume_sm : cuda_device_sm(), in.k.dim, in.v.dim,
                                       in.k_extra.data != nullptr ? in.k_extra.dim : 0);
  }
  return decide_sparse_decode(d, config_);
}

SparseDecodeOutcome SparseDecoder::decide(const SparseAttentionInputs& in, const SparseSelection& selection) const {
  check_inputs(in, selection);
  return decide_counts(in, int64_t{in.batch} * in.num_kv_heads, selection.total());
}

SparseDecodeOutcome SparseDecoder::decide(const SparseAttentionInputs& in, const PagedSelection& selection) const {
  check_inputs(in);
  const int64_t requests = int64_t{in.batch} * in.num_kv_heads;
  REQUIRE(selection.num_requests == requests,
          "the selection has " + std::to_string(selection.num_requests) +
              " requests, expected batch * num_kv_heads = " + std::to_string(requests));
  REQUIRE(selection.width >= 1 && selection.page_size >= 1,
          "a paged selection needs width >= 1 and page_size >= 1 (got " + std::to_string(selection.width) + ", " +
              std::to_string(selection.page_size) + ")");
  REQUIRE(int64_t{selection.width} * selection.page_size <= INT32_MAX,
          "width * page_size must stay below 2^31 tokens per request");
  REQUIRE(selection.pages != nullptr && selection.seq_lens != nullptr,
          "the selection's pages and seq_lens must be set");
  REQUIRE(selection.max_selected >= 0 && selection.max_selected <= int64_t{selection.width} * selection.page_size,
          "max_selected = " + std::to_string(selection.max_selected) + " must lie in [0, width * page_size = " +
              std::to_string(int64_t{selection.width} * selection.page_size) + "]");
  return decide_counts(in, requests, requests * selection.max_selected);
}

SparseDecodeOutcome SparseDecoder::require_fused(const SparseAttentionInputs& in, const PagedSelection& selection,
                                                 const std::string& who) const {
  // The caller's own views (an engine's pools) are judged here: their
  // refusal names the caller too, as the decline does.
  SparseDecodeOutcome d;
  try {
    d = decide(in, selection);
  } catch (const Error& e) {
    throw Error(who + ": " + e.what());
  }
  if (d.fused()) return d;
  throw Error(who + ": the fused path declined (" + outcome_kind_name(d.kind) + ": " + d.reason +
              ") and there is no mask path to fall back to; nothing was changed");
}

bool SparseDecoder::plan_stands(const SparseAttentionInputs& in, int32_t pages_per_request, int32_t page_size) const {
  return !workspace_.empty() && in.num_qo_heads / in.num_kv_heads * in.q_len == planned_group_ &&
         in.v.dim == planned_dim_v_ && pages_per_request == planned_width_ && page_size == planned_page_size_;
}

void SparseDecoder::prepare(const SparseAttentionInputs& in, const std::vector<int32_t>& counts,
                            int32_t pages_per_request, int32_t page_size, void* stream) {
  const int32_t group = in.num_qo_heads / in.num_kv_heads * in.q_len;  // query rows per request
  PlanShape shape;
  shape.group_size = group;
  shape.head_dim_v = in.v.dim;
  shape.num_sms = machine_width(device_);
  if (device_ == Device::kCuda) {
    // The 64-row multi-token CTAs read native rows through the library's own
    // tables; an FP8 pool or an engine's block table keeps every query row on
    // the 16-row tiles, so the plan is sized for those.
    const int32_t extra = in.k_extra.data != nullptr ? in.k_extra.dim : 0;
    const bool row_tiles_only = in.kv_format != KvFormat::kNative || in.block_table.data != nullptr;
    const CudaLaunchShape launch =
        row_tiles_only ? cuda_launch_shape(in.k.dim, in.v.dim, extra, group)
                       : cuda_launch_shape(in.k.dim, in.v.dim, extra, in.num_qo_heads / in.num_kv_heads, in.q_len);
    shape.ctas_per_item = launch.ctas_per_item;
    shape.items_per_sm = launch.ctas_per_sm;
  }
  if (items_per_sm_ > 0) shape.items_per_sm = items_per_sm_;
  if (min_chunk_tokens_ > 0) shape.min_chunk_tokens = min_chunk_tokens_;
  plan_ = make_decode_plan(counts, shape);
  // Structure: indptr [R + 1], first_page_offset [R] (zeros), seq_lens [R].
  // A fixed-width table has row r at pages r * width; its seq_lens come
  // with the selection (device data), so the uploaded ones go unused.
  PageTableStructure table = build_page_table_structure(counts, page_size);
  if (pages_per_request > 0) {
    for (size_t r = 0; r < table.indptr.size(); ++r) table.indptr[r] = static_cast<int32_t>(r) * pages_per_request;
  }
  std::vector<int32_t> packed = table.indptr;
  packed.insert(packed.end(), table.first_page_offset.begin(), table.first_page_offset.end());
  packed.insert(packed.end(), table.seq_lens.begin(), table.seq_lens.end());
  structure_ = upload(device_, packed);
  workspace_ = Buffer(device_, std::max<size_t>(plan_.workspace.total, 256));
  if (device_ == Device::kCuda) upload_plan_cuda(plan_, workspace_.data(), stream);
  planned_counts_ = counts;
  planned_group_ = group;
  planned_dim_v_ = in.v.dim;
  planned_width_ = pages_per_request;
  planned_page_size_ = page_size;
}

DecodeParams SparseDecoder::base_params(const SparseAttentionInputs& in) const {
  const int32_t requests = in.batch * in.num_kv_heads;
  const auto* structure = structure_.as<int32_t>();
  DecodeParams p = stream_fields(in);
  p.indptr = structure;
  p.first_page_offset = structure + requests + 1;
  p.seq_lens = structure + 2 * requests + 1;
  p.num_requests = requests;
  p.num_kv_heads = in.num_kv_heads;
  // Window mode: positions of the request's own rows, checked against its
  // sequence's live length, never another request's rows.
  p.addressing = PageAddressing::kWindow;
  p.window_lens = in.live_lens;
  p.window_len = in.live_len;
  if (in.block_table.data != nullptr) {
    // An engine's pool: positions (the same page ids) resolved through its table.
    p.addressing = PageAddressing::kBlockTable;
    p.block_table = in.block_table;
  }
  p.group_size = in.num_qo_heads / in.num_kv_heads;
  p.q_len = in.q_len;
  return p;
}

void SparseDecoder::require_device(const SparseAttentionInputs& in) const {
  REQUIRE(in.device == device_,
          std::string("inputs on ") + device_name(in.device) + ", decoder on " + device_name(device_));
}

SparseDecodeOutcome SparseDecoder::launch(const DecodeParams& params, SparseDecodeOutcome outcome, void* stream) {
  launched_kv_heads_ = params.num_kv_heads;
  if (device_ == Device::kCuda) {
    outcome.kernel = run_decode_cuda(params, plan_, workspace_.data(), stream);
  } else {
    run_decode_cpu(params, plan_, workspace_.data());
    outcome.kernel = "CPU loop";
  }
  outcome.chunks = static_cast<int64_t>(plan_.work.size());
  outcome.merge = plan_.needs_merge();
  return counted(outcome);
}

SparseDecodeOutcome SparseDecoder::try_fused(const SparseAttentionInputs& in, const SparseSelection& selection,
                                             void* stream) {
  require_device(in);
  const SparseDecodeOutcome outcome = decide(in, selection);
  if (!outcome.fused()) return counted(outcome);
  dump_selection_if_enabled(selection, "fused");
  if (!plan_stands(in, 0, 1) || selection.counts != planned_counts_) prepare(in, selection.counts, 0, 1, stream);
  DecodeParams p = base_params(in);
  p.indices = selection.indices.as<int32_t>();
  p.num_indices = static_cast<int64_t>(selection.indices.bytes() / sizeof(int32_t));
  p.page_size = 1;
  return launch(p, outcome, stream);
}

SparseDecodeOutcome SparseDecoder::try_fused(const SparseAttentionInputs& in, const PagedSelection& selection,
                                             void* stream) {
  require_device(in);
  const SparseDecodeOutcome outcome = decide(in, selection);
  if (!outcome.fused()) return counted(outcome);
  return run_fused(in, selection, outcome, stream);
}

SparseDecodeOutcome SparseDecoder::run_fused(const SparseAttentionInputs& in, const PagedSelection& selection,
                                             const SparseDecodeOutcome& outcome, void* stream) {
  require_device(in);
  REQUIRE(outcome.fused(), "run_fused was handed a declined decision (" + outcome.reason + "); use try_fused");
  // Planned once for the bound; compared in place, so a step allocates nothing.
  const int32_t bound = selection.width * selection.page_size;
  const bool same_bound =
      planned_counts_.size() == static_cast<size_t>(selection.num_requests) &&
      std::all_of(planned_counts_.begin(), planned_counts_.end(), [bound](int32_t c) { return c == bound; });
  if (!plan_stands(in, selection.width, selection.page_size) || !same_bound) {
    prepare(in, std::vector<int32_t>(static_cast<size_t>(selection.num_requests), bound), selection.width,
            selection.page_size, stream);
  }
  DecodeParams p = base_params(in);
  p.indices = selection.pages;
  p.num_indices = int64_t{selection.num_requests} * selection.width;
  p.seq_lens = selection.seq_lens;
  p.page_size = selection.page_size;
  // Share each request's live count among its chunks only when every
  // request sees at most 3/4 of the width: balancing shrinks the longest
  // chunk by that ratio, and below a quarter's gain the count's read ahead
  // of each chunk's first row costs more than it saves.
  p.balance_live_counts = 4 * selection.max_selected <= 3 * int64_t{bound};
  return launch(p, outcome, stream);
}

void SparseDecoder::set_plan_tuning(int32_t items_per_sm, int32_t min_chunk_tokens) {
  REQUIRE(items_per_sm >= 0 && min_chunk_tokens >= 0, "plan tuning values must not be negative");
  items_per_sm_ = items_per_sm;
  min_chunk_tokens_ = min_chunk_tokens;
  planned_counts_.clear();  // re-plan on the next call
}

void SparseDecoder::check_errors(void* stream) {
  if (device_ != Device::kCuda || workspace_.empty()) return;
  const DecodeErrors e = read_decode_errors(plan_, workspace_.data(), stream);
  if (e.kinds == 0) return;
  std::string where = "some request";
  if (e.first_request >= 0) {
    where = "request " + std::to_string(e.first_request);
    if (launched_kv_heads_ > 0) {
      where += " (sequence " + std::to_string(e.first_request / launched_kv_heads_) + ", KV head " +
               std::to_string(e.first_request % launched_kv_heads_) + ")";
    }
  }
  const std::string what = (e.kinds & kDecodeErrorLength) != 0
                               ? "carried a device-side length out of range (a live_lens entry outside [0, the "
                                 "capacity] or a seq_lens entry outside [0, the planned count])"
                               : "selected a position outside its live window";
  throw Error("sparse decode: " + where + " (the first of those that failed) " + what +
              "; those requests' outputs are NaN and nothing outside their windows was read");
}

MaskedDecodeParams masked_params(const SparseAttentionInputs& in) {
  check_heads(in);
  REQUIRE(in.q_len == 1, "the mask path takes one query token per sequence (q_len = " + std::to_string(in.q_len) +
                             "); a multi-token step runs on the fused path");
  REQUIRE(in.block_table.data == nullptr,
          "the mask path reads dense caches; an engine's paged pool (block_table set) has only the fused path");
  REQUIRE(in.kv_format == KvFormat::kNative, std::string("the mask path reads bf16/f16 K and V; kv_format ") +
                                                 kv_format_name(in.kv_format) + " has only the fused path");
  MaskedDecodeParams m;
  static_cast<AttentionOperands&>(m) = in;
  m.batch = in.batch;
  m.num_kv_heads = in.num_kv_heads;
  m.group_size = in.num_qo_heads / in.num_kv_heads;
  m.live_len = in.live_len;
  m.live_lens = in.live_lens;
  return m;
}

void build_selection_mask(Device device, const int32_t* positions, const int32_t* offsets, int32_t num_requests,
                          int64_t live_len, float* mask, void* stream) {
  REQUIRE(num_requests >= 0 && live_len >= 0, "build_selection_mask: num_requests = " + std::to_string(num_requests) +
                                                  " and live_len = " + std::to_string(live_len) +
                                                  " must not be negative");
  REQUIRE(live_len <= std::numeric_limits<int32_t>::max(),
          "build_selection_mask: live_len = " + std::to_string(live_len) + " exceeds 2^31 - 1 positions");
  if (num_requests == 0) return;
  REQUIRE(offsets != nullptr && (live_len == 0 || mask != nullptr),
          "build_selection_mask: offsets and mask must not be null");
  if (device == Device::kCuda) {
    detail::selection_mask_cuda(positions, offsets, num_requests, live_len, mask, stream);
    return;
  }
  // Host offsets can be checked before any position is read.
  REQUIRE(offsets[0] == 0, "build_selection_mask: offsets[0] = " + std::to_string(offsets[0]) + ", expected 0");
  for (int32_t r = 0; r < num_requests; ++r) {
    REQUIRE(offsets[r + 1] >= offsets[r], "build_selection_mask: offsets decrease at request " + std::to_string(r));
  }
  REQUIRE(offsets[num_requests] == 0 || positions != nullptr, "build_selection_mask: positions must not be null");
  std::fill(mask, mask + int64_t{num_requests} * live_len, -std::numeric_limits<float>::infinity());
  for (int32_t r = 0; r < num_requests; ++r) {
    for (int32_t i = offsets[r]; i < offsets[r + 1]; ++i) {
      if (positions[i] >= 0 && positions[i] < live_len) mask[int64_t{r} * live_len + positions[i]] = 0.0f;
    }
  }
}

std::vector<std::vector<int32_t>> mask_kept_columns(Device device, const float* mask, int32_t num_requests,
                                                    int64_t live_len) {
  REQUIRE(num_requests >= 0 && live_len >= 0 && live_len <= std::numeric_limits<int32_t>::max(),
          "mask_kept_columns: num_requests = " + std::to_string(num_requests) +
              " and live_len = " + std::to_string(live_len) + " must lie in [0, 2^31 - 1]");
  REQUIRE(mask != nullptr || int64_t{num_requests} * live_len == 0, "mask_kept_columns: mask is null");
  const std::vector<float> host = download<float>(device, mask, static_cast<size_t>(int64_t{num_requests} * live_len));
  std::vector<std::vector<int32_t>> columns(static_cast<size_t>(num_requests));
  for (int32_t r = 0; r < num_requests; ++r) {
    for (int64_t t = 0; t < live_len; ++t) {
      if (host[static_cast<size_t>(int64_t{r} * live_len + t)] == 0.0f)
        columns[static_cast<size_t>(r)].push_back(static_cast<int32_t>(t));
    }
  }
  return columns;
}

void MaskPath::prepare(const SparseAttentionInputs& in, const SparseSelection& selection) {
  check_inputs(in, selection);
  (void)masked_params(in);  // its refusals (paged pools, fp8 caches) before anything is allocated
  const int64_t requests = int64_t{in.batch} * in.num_kv_heads;
  mask_ = Buffer(device_, static_cast<size_t>(requests * std::max<int64_t>(in.live_len, 1)) * sizeof(float));
  offsets_ = upload(device_, selection.offsets());
  if (device_ == Device::kCuda) {
    workspace_ = Buffer(device_, masked_decode_workspace_bytes(masked_params(in), cuda_multiprocessor_count()));
  }
  prepared_counts_ = selection.counts;
  prepared_live_len_ = in.live_len;
  prepared_group_ = in.num_qo_heads / in.num_kv_heads;
  prepared_dim_qk_ = in.k.dim;
  prepared_dim_v_ = in.v.dim;
}

void MaskPath::run(const SparseAttentionInputs& in, const SparseSelection& selection, void* stream) {
  const int64_t requests = int64_t{in.batch} * in.num_kv_heads;  // int64: batch * heads may pass 2^31
  // Host-side facts only, so run stays capturable.
  REQUIRE(selection.counts == prepared_counts_ && in.live_len == prepared_live_len_ &&
              in.num_qo_heads / std::max(in.num_kv_heads, 1) == prepared_group_ && in.k.dim == prepared_dim_qk_ &&
              in.v.dim == prepared_dim_v_ && offsets_.bytes() == (static_cast<size_t>(requests) + 1) * 4,
          "MaskPath::run with counts or shapes other than prepare() saw; call prepare() again");
  check_inputs(in, selection);
  if (device_ == Device::kCpu) {
    // As the fused path refuses them: a position outside its window is an
    // error, not a row the mask quietly leaves out (the positions are host
    // memory here; on CUDA the mask builder skips them).
    const std::vector<int32_t> offsets = selection.offsets();
    const int32_t* positions = selection.indices.as<int32_t>();
    for (int64_t r = 0; r < requests; ++r) {
      for (int32_t i = offsets[static_cast<size_t>(r)]; i < offsets[static_cast<size_t>(r) + 1]; ++i) {
        REQUIRE(positions[i] >= 0 && positions[i] < in.live_len,
                "MaskPath::run: positions[" + std::to_string(i) + "] = " + std::to_string(positions[i]) +
                    " is outside request " + std::to_string(r) + "'s window of " + std::to_string(in.live_len) +
                    " tokens");
      }
    }
  }
  build_selection_mask(device_, selection.indices.as<int32_t>(), offsets_.as<int32_t>(), static_cast<int32_t>(requests),
                       in.live_len, mask_.as<float>(), stream);
  MaskedDecodeParams m = masked_params(in);
  m.mask = mask_.as<float>();
  if (device_ == Device::kCuda) {
    run_masked_decode_cuda(m, workspace_.data(), stream);
  } else {
    run_masked_decode_cpu(m);
  }
}

void StepMaskPath::size(Device device, const SparseAttentionInputs& shape, int64_t capacity) {
  device_ = device;
  capacity_ = capacity;
  const int64_t requests = int64_t{shape.batch} * shape.num_kv_heads;
  mask_ = Buffer(device, static_cast<size_t>(requests) * static_cast<size_t>(capacity) * sizeof(float));
  if (device == Device::kCuda) {
    MaskedDecodeParams m = masked_params(shape);
    m.live_len = capacity;
    workspace_ = Buffer(device, std::max<size_t>(256, masked_decode_workspace_bytes(m, cuda_multiprocessor_count())));
  }
}

void StepMaskPath::run(const SparseAttentionInputs& in, bool with_mask, void* stream) {
  MaskedDecodeParams m = masked_params(in);
  m.live_len = capacity_;  // the bound; each sequence sees its device-side length
  m.mask = with_mask ? mask() : nullptr;
  m.mask_pitch = capacity_;
  if (device_ == Device::kCuda) {
    run_masked_decode_cuda(m, workspace_.data(), stream);
  } else {
    run_masked_decode_cpu(m);
  }
}

}  // namespace sparsepage

#undef REQUIRE
