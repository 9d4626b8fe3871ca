// The sparse decode entry point (docs/DESIGN.md: dense caches as pools, the paged decode, the dispatch policy): a
// selection over a dense cache becomes a page table, the policy decides, and the fused paged decode runs — or the
// decline comes back so the caller runs its mask path.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/memory.h"
#include "sparsepage/selection.h"

namespace sparsepage {

/// One decode step's attention inputs over a dense cache, on one device.
/// The operands are packed: q [batch, num_qo_heads, k.dim], o [batch,
/// num_qo_heads, v.dim], lse [batch, num_qo_heads] (AttentionOperands'
/// request rows, G = num_qo_heads / num_kv_heads).
struct SparseAttentionInputs : AttentionOperands {
  Device device = Device::kCpu;
  int32_t batch = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int64_t live_len = 0;  // live tokens (an upper bound when live_lens is set)
  /// Per-sequence live lengths [batch] on the inputs' device, each <=
  /// live_len, read where the kernels run: a step captured in a CUDA graph
  /// keeps checking positions against the window as it grows. Null:
  /// live_len for every sequence.
  const int32_t* live_lens = nullptr;
  bool raw_cache = true;  // false for quantized or pool-backed caches
  // A dense `[B, H, Cap, D]` cache's streams are `RowView::dense(data, H,
  // Cap, D)`; K may carry extra heads or columns.
  /// How K and V are stored (decode.h); the fp8 forms count K and V strides
  /// in bytes. k_scale / v_scale: kE4m3PerHead's [num_kv_heads] scales.
  KvFormat kv_format = KvFormat::kNative;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  /// Set (data non-null): the streams are an engine's paged pool, and
  /// position p of sequence b lives at pool row
  /// `block_table[b, p / block_size] * block_size + p % block_size` of its
  /// head (PageAddressing::kBlockTable); positions stay below live_lens.
  /// The fused path only: the mask path reads dense caches.
  BlockTable block_table;
  /// Query tokens per sequence (a multi-token step, decode.h's q_len): q and
  /// o are then [batch, q_len, num_qo_heads, dim], lse [batch, q_len,
  /// num_qo_heads], and token t sees the selected positions below its
  /// sequence's live length - (q_len - 1 - t). The fused path only: the mask
  /// path takes one token (MaskPath and StepMaskPath refuse q_len > 1).
  int32_t q_len = 1;
};

/// Where a layer's attention rows live.
enum class KVStorage : int32_t {
  /// The layer's own dense `[B, H, Cap, D]` cache, which each step appends
  /// to (the default).
  kLayerCache = 0,
  /// An engine's paged pool (`EnginePagedKV`), attended in place through its
  /// block table. The engine writes each token's attention rows before the
  /// step, as vLLM's and SGLang's cache writes do; the layer keeps only its
  /// indexer's keys. The fused path only: a step the dispatch would decline
  /// is refused by name before anything changes (the mask path reads dense
  /// caches).
  kEnginePaged = 1,
  /// Everything a step reads lives in the engine's pools: the attention rows
  /// and the indexer's keys (`EnginePagedKV::index_keys`), and the engine
  /// passes each slot's length every step (`EnginePagedKV::seq_lens`). The
  /// layer keeps no per-sequence state and writes nothing into the pools
  /// (the engine writes each token's row and key, e.g. with
  /// write_index_keys_cuda and quantize_mla_fp8_cuda). The fused path only.
  kEnginePools = 2,
};

/// An engine's paged KV pool, as a KVStorage::kEnginePaged layer reads it:
/// rows of `[num_blocks, block_size, heads, dim]` allocations (RowView with
/// row_stride = heads * dim, head_stride = dim, seq_stride = 0; for MLA one
/// `[num_blocks, block_size, 576]` allocation gives K = V = the latent
/// columns and k_extra = the rope columns), and the table whose row b lists
/// sequence b's blocks. Device memory on CUDA.
struct EnginePagedKV {
  RowView k;
  RowView v;
  RowView k_extra;  // the MLA rope columns; data null without a second K stream
  BlockTable block_table;
  /// The rows' format. kNative: rows of the layer's dtype. KvFormat::kE4m3Mla
  /// (the DSA layer, bf16): the engines' 656-byte FP8 MLA rows (fp8.h), with
  /// k, v and k_extra as mla_fp8_views gives them over the pool's
  /// num_blocks * block_size rows; the kernel dequantizes as it reads.
  KvFormat kv_format = KvFormat::kNative;
  /// KVStorage::kEnginePools only. Each slot's length this step, this step's
  /// token included: int32 [batch] on the device (0: an empty slot, whose
  /// output rows are zero). Read on the device, so a captured step follows
  /// them as they change.
  const int32_t* seq_lens = nullptr;
  /// Host bound on every seq_lens entry: sizes the step's grids and
  /// workspace (reserve() it before capturing).
  int64_t max_seq_len = 0;
  /// KVStorage::kEnginePools prefill chunks only (decode steps ignore it):
  /// the engine's host copy of seq_lens, int32 [batch] in host memory
  /// (vLLM's and SGLang's seq_lens_cpu), or null. Given, the chunk decides
  /// its active slots, refusals and path on it and reads nothing back, so
  /// it can be captured in a CUDA graph; null, seq_lens is read back once
  /// (a stream sync). The kernels read seq_lens either way.
  const int32_t* host_seq_lens = nullptr;
  /// The indexer's keys in the engine's paged pool (index_keys.h: native or
  /// vLLM's FP8 layout, with their own block table).
  PagedIndexKeys index_keys;
};

/// Runs sparse decodes on one device. It keeps the plan, the page-table
/// structure and the workspace between calls and re-plans only when the
/// per-request counts change, so a serving loop with fixed top-k counts
/// plans once.
class SparseDecoder {
 public:
  explicit SparseDecoder(Device device, DispatchConfig config = process_dispatch_config());

  /// `selection` holds positions in each request's live window [0, live_len)
  /// (one request per (sequence, KV head), on the inputs' device). Fused:
  /// the output is written and the outcome says so. Declined: nothing ran;
  /// the caller runs its mask path (see `run_mask_path`). The outcome is
  /// counted in the stats and announced once per kind. Positions outside
  /// the window are never read (CPU: an error; CUDA: NaN output and the
  /// error flag, see `check_errors`).
  SparseDecodeOutcome try_fused(const SparseAttentionInputs& in, const SparseSelection& selection,
                                void* stream = nullptr);

  /// The serving-step form: the plan is made once for the selection's
  /// bound (width * page_size tokens per request) and reused while the
  /// request count, width and shapes stay the same; the live counts are read
  /// on the device. After the first call at a given shape it allocates
  /// nothing, synchronizes nothing and reads nothing back, so a step that
  /// calls it can be captured in a CUDA graph and replayed while the
  /// context grows.
  SparseDecodeOutcome try_fused(const SparseAttentionInputs& in, const PagedSelection& selection,
                                void* stream = nullptr);

  /// The pure decision for these inputs, without running anything.
  SparseDecodeOutcome decide(const SparseAttentionInputs& in, const SparseSelection& selection) const;
  SparseDecodeOutcome decide(const SparseAttentionInputs& in, const PagedSelection& selection) const;

  /// For a caller with no mask path to fall back to (a layer over an
  /// engine's pool): throws Error naming `who` and the reason when decide()
  /// would not fuse these inputs or refuses them (its message after `who`),
  /// and returns the fused decision otherwise.
  /// Pure, like decide().
  SparseDecodeOutcome require_fused(const SparseAttentionInputs& in, const PagedSelection& selection,
                                    const std::string& who) const;

  /// The serving-step launch of try_fused() for a step already decided:
  /// `decided` is what decide() or require_fused() returned for these same
  /// inputs and selection (a fused outcome, else Error), so a caller that
  /// decides before changing its state does not decide twice.
  SparseDecodeOutcome run_fused(const SparseAttentionInputs& in, const PagedSelection& selection,
                                const SparseDecodeOutcome& decided, void* stream = nullptr);

  /// Synchronizes and throws when a CUDA launch since the last call met a
  /// position outside a window or a device-side length out of range; the
  /// message names the first such request (sequence and KV head).
  void check_errors(void* stream = nullptr);

  /// Overrides the plan's split knobs (PlanShape::items_per_sm and
  /// min_chunk_tokens; 0 keeps the default), for tuning sweeps.
  void set_plan_tuning(int32_t items_per_sm, int32_t min_chunk_tokens);

  const DecodePlan& plan() const { return plan_; }
  /// Device bytes held for the fused path (workspace + page-table structure).
  size_t transient_bytes() const { return workspace_.bytes() + structure_.bytes(); }
  const DispatchConfig& config() const { return config_; }

 private:
  /// Whether the current plan, structure and workspace serve these shapes
  /// and table width (the callers compare the counts themselves).
  bool plan_stands(const SparseAttentionInputs& in, int32_t pages_per_request, int32_t page_size) const;
  /// Plans for per-request `counts` and uploads the table structure
  /// (`indptr` of `pages_per_request` pages each when > 0, else from the counts).
  void prepare(const SparseAttentionInputs& in, const std::vector<int32_t>& counts, int32_t pages_per_request,
               int32_t page_size, void* stream);
  SparseDecodeOutcome decide_counts(const SparseAttentionInputs& in, int64_t requests, int64_t selected) const;
  void require_device(const SparseAttentionInputs& in) const;
  DecodeParams base_params(const SparseAttentionInputs& in) const;
  /// Runs the planned decode and completes and records the fused outcome.
  SparseDecodeOutcome launch(const DecodeParams& params, SparseDecodeOutcome outcome, void* stream);
  Device device_;
  DispatchConfig config_;
  DecodePlan plan_;
  std::vector<int32_t> planned_counts_;
  int32_t planned_group_ = 0, planned_dim_v_ = 0, planned_width_ = -1, planned_page_size_ = 0;  // group: query rows
  int32_t items_per_sm_ = 0, min_chunk_tokens_ = 0;                                             // 0: PlanShape defaults
  int32_t launched_kv_heads_ = 0;  // of the last launch: check_errors names (sequence, KV head)
  Buffer workspace_;
  Buffer structure_;  // int32 indptr [R+1], first_page_offset [R], seq_lens [R]
};

/// The mask path over the same set: an additive mask that keeps exactly the
/// selected positions, then dense attention over the whole live window. What
/// a caller runs when the fused path declines, and the benchmark's baseline.
/// Duplicated positions count once here (a mask is a set).
class MaskPath {
 public:
  explicit MaskPath(Device device) : device_(device) {}
  /// Allocates the mask and workspace and uploads the selection's offsets;
  /// call when the counts or shapes change. Not capturable.
  void prepare(const SparseAttentionInputs& in, const SparseSelection& selection);
  /// Builds the mask and runs the masked decode: capturable after prepare.
  /// Throws if the counts or shapes differ from what prepare() saw, and on
  /// the CPU, as the fused path does, for a position outside its request's
  /// window [0, live_len) (on CUDA the mask builder skips such a position).
  void run(const SparseAttentionInputs& in, const SparseSelection& selection, void* stream = nullptr);
  /// Device bytes held (mask, offsets, workspace).
  size_t transient_bytes() const { return mask_.bytes() + offsets_.bytes() + workspace_.bytes(); }

 private:
  Device device_;
  std::vector<int32_t> prepared_counts_;
  int64_t prepared_live_len_ = -1;
  int32_t prepared_group_ = 0, prepared_dim_qk_ = 0, prepared_dim_v_ = 0;
  Buffer mask_;     // fp32 [num_requests, live_len]
  Buffer offsets_;  // int32 [num_requests + 1]
  Buffer workspace_;
};

/// The mask path of a serving step over a growing dense cache: an additive
/// mask over the cache's capacity and the masked decode's workspace, sized
/// when the capacity grows, then run over the whole capacity with each
/// sequence at its device-side length (`live_lens`). So a step that falls
/// back allocates nothing and is capturable, like the fused step. Both
/// layers use it; a caller that builds its own mask can too.
class StepMaskPath {
 public:
  /// Sizes the mask [batch * num_kv_heads, capacity] and the workspace for
  /// steps shaped like `shape` (its dims, heads, batch and dtype; its data
  /// pointers only say which streams exist). Allocates: not in a step.
  void size(Device device, const SparseAttentionInputs& shape, int64_t capacity);
  /// The mask a caller fills before `run(..., true, ...)`; row pitch = capacity().
  float* mask() { return mask_.as<float>(); }
  int64_t capacity() const { return capacity_; }
  /// The masked decode over the capacity (`in.live_lens` gives each
  /// sequence's length; without them every sequence sees `capacity()`
  /// rows). Without the mask it attends each whole window. Capturable.
  void run(const SparseAttentionInputs& in, bool with_mask, void* stream = nullptr);

 private:
  Device device_ = Device::kCpu;
  int64_t capacity_ = 0;
  Buffer mask_;
  Buffer workspace_;  // masked-decode partials (CUDA)
};

/// Writes the additive mask [num_requests, live_len]: 0 at each selected
/// position, -inf elsewhere; positions outside [0, live_len) are ignored.
/// `offsets` ([num_requests + 1]) and `positions` live on `device`.
void build_selection_mask(Device device, const int32_t* positions, const int32_t* offsets, int32_t num_requests,
                          int64_t live_len, float* mask, void* stream = nullptr);

/// The positions an additive mask [num_requests, live_len] on `device` keeps
/// (its 0 entries), per request, in increasing order. Reads the mask back on
/// the default stream: a test and debugging aid, not a decode step.
std::vector<std::vector<int32_t>> mask_kept_columns(Device device, const float* mask, int32_t num_requests,
                                                    int64_t live_len);

/// MaskedDecodeParams for these inputs (mask null).
MaskedDecodeParams masked_params(const SparseAttentionInputs& in);

}  // namespace sparsepage
