// Static per-query-head block-sparse attention (docs/DESIGN.md: the static pattern layer,
// Phi-3-small-style): a fixed pattern of key blocks, different for each query
// head, no indexer. Decode attends exactly the pattern's blocks through the
// fused paged decode and falls back to the additive-mask path on any decline.
//
// The rule. With the query in block i (at decode, the window's last block),
// key block j <= i is kept for query head h when
//     i - j < local_blocks   or   (j + h * head_sliding_step + 1) % vert_stride == 0,
// head_sliding_step = max(1, vert_stride / num_qo_heads) (integer division).
// So the query heads that share a KV head keep different vertical blocks and
// one page list per KV head cannot express the pattern.
//
// How it runs. Each query head is its own request (G = 1): request
// r = b * num_qo_heads + h attends its kept blocks as block-granular pages
// (page_size = block_size) of its KV head's rows, the partial final block
// last and cut by the request's token count. The dense cache [B, Hkv, Cap, D]
// is viewed as B * Hkv row ranges ("sequences" of the view), each read by its
// G query heads (head stride 0), so the page ids stay positions of the
// request's own window and every position is checked against that window's
// live length (window addressing, decode.h). A small kernel (and its CPU
// twin) writes the page matrix and the counts from the device-side lengths
// each step; the mask path runs on the same G = 1 requests, one mask row per
// query head, built from the same rule.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/layer.h"

namespace sparsepage {

/// Phi-3-small's published geometry is the default.
struct StaticBlockSparseConfig {
  int32_t num_qo_heads = 32;
  int32_t num_kv_heads = 8;
  int32_t head_dim = 128;
  int32_t block_size = 64;
  int32_t local_blocks = 16;  // >= 1: the query's own block is always kept
  int32_t vert_stride = 8;    // >= 1
  int64_t capacity_step = 4096;

  int32_t group_size() const { return num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0; }  // 0: invalid
  int32_t head_sliding_step() const;
  /// The rule: whether query head `head` in query block `query_block` keeps key block `key_block`
  /// (a head outside [0, num_qo_heads) or a negative block is refused by name, here and below).
  bool keeps(int32_t head, int64_t query_block, int64_t key_block) const;
  /// Key blocks / tokens query head `head` attends at decode with `kv_len` tokens in the cache.
  int64_t kept_blocks(int32_t head, int64_t kv_len) const;
  int64_t kept_tokens(int32_t head, int64_t kv_len) const;
};

/// One token's projected inputs, all on the layer's device, in its dtype.
struct StaticBlockSparseTokens {
  const void* q = nullptr;  // [batch, num_qo_heads, head_dim]
  const void* k = nullptr;  // [batch, num_kv_heads, 1, head_dim]
  const void* v = nullptr;  // [batch, num_kv_heads, 1, head_dim]
  void* o = nullptr;        // [batch, num_qo_heads, head_dim]
};

/// The layer: the skeleton (sparsepage/layer.h) whose selection is the
/// pattern itself — a small kernel (and its CPU twin) writes each query
/// head's kept blocks and token count from the device-side lengths. Every
/// context length runs the pattern: while the window is within the local
/// run it keeps everything, and the dispatch's sparsity gate sends such
/// steps to the mask path.
///
/// Its prefill(tokens, num_tokens) (LayerForms): each query block of the
/// chunk keeps, per query head, the pattern's blocks (static_prefill_blocks)
/// and the fused GQA block prefill attends them, each token up to its own
/// position: the same sets and outputs as decoding the tokens one by one.
/// Refused by name: a chunk whose start (some slot's length before it) is
/// not a multiple of block_size (query blocks must be key blocks), and
/// block_size above 256. A multi-token decode runs token by token (no fused
/// form).
class StaticBlockSparseAttention : public LayerForms<StaticBlockSparseTokens> {
 public:
  StaticBlockSparseAttention(Device device, DType dtype, const StaticBlockSparseConfig& config, int32_t batch,
                             DispatchConfig dispatch = process_dispatch_config());

  const StaticBlockSparseConfig& config() const { return config_; }
  /// Kept blocks of the last decode, per request r = b * num_qo_heads + h (host copy).
  std::vector<std::vector<int32_t>> last_blocks() const;
  /// The most tokens any query head attends at `kv_len`.
  int64_t max_kept_tokens(int64_t kv_len) const;
  /// Kept blocks per request the step's page matrix holds (its width): the
  /// most any query head keeps at the sized capacity.
  int32_t width() const { return width_; }

 private:
  StepTokens to_step(const StaticBlockSparseTokens& t) const override;
  TokenNames token_names() const override;
  TokenBytes token_bytes() const override;
  SparseAttentionInputs attention_inputs(const StepTokens& tokens, int32_t q_len) const override;
  void size_selection(int64_t capacity, int32_t q_len) override;
  PagedSelection selection(int32_t q_len) const override;
  void select(const StepTokens& tokens, int32_t q_len, void* stream) override;
  bool sparse_at(int64_t kv_len) const override { return max_kept_tokens(kv_len) < kv_len; }
  void build_mask(float* mask, int64_t pitch, void* stream) override;
  std::vector<std::vector<int32_t>> selected_positions() const override;
  void check_engine_kv(const EnginePagedKV& kv) const override;
  std::string prefill_refusal(int32_t num_tokens, const std::vector<int64_t>& lens) const override;
  void run_prefill(const StepTokens& tokens, int32_t first_slot, const PrefillChunk& chunk, void* stream) override;
  std::vector<std::vector<int32_t>> prefill_positions(const std::vector<int64_t>& lens,
                                                      int32_t num_tokens) const override;
  void check_prefill_errors(void* stream) override { gqa_prefill_.check_errors(stream); }
  StaticPrefillParams prefill_pattern(const PrefillChunk& chunk) const;
  int32_t num_requests() const { return batch() * config_.num_qo_heads; }

  StaticBlockSparseConfig config_;
  int32_t width_ = 0;
  Buffer pages_;        // int32 [requests, width]: kept blocks increasing (the final block last), then -1
  Buffer seq_lens_;     // int32 [requests]: tokens those blocks cover now
  Buffer window_lens_;  // int32 [batch * num_kv_heads]: each (sequence, KV head) range's live length
  // Chunked prefill: per-query-head lists [batch, num_kv_heads, query
  // blocks, group_size, prefill_width_] and their counts.
  GqaBlockPrefill gqa_prefill_;
  Buffer prefill_ids_, prefill_counts_;
  int32_t prefill_width_ = 0;
  int32_t prefill_sized_blocks_ = 0;  // query blocks per slot the buffers hold
};

}  // namespace sparsepage
