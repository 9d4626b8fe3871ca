// Block-sparse attention (docs/DESIGN.md: the block-sparse layer,
// MiniMax-M3-style): an indexer keeps the top-k key blocks per KV head, and
// decode attends only those through the fused paged decode, falling back to
// the additive-mask path on any decline.
//
// Indexer scoring rule. The index key (one head, head_dim wide) rides at head
// num_kv_heads of the K allocation. Each KV head h has an index query
// q_idx[b, h]. Block j of sequence b scores
//     score(b, h, j) = max over live tokens t of block j of  q_idx[b, h] . k_idx[b, t]
// Max-pooling keeps a block that holds one strongly matching token, which a
// mean would dilute among its 127 neighbours. The top-k is taken over every
// block but the final one (ties go to the lower block id); the last
// `local_blocks - 1` full blocks before the final one are force-kept (they
// score +inf), and the final block — the query's own, possibly partial — is
// appended unconditionally. So the selected count is a function of the
// sequence's length alone, and no selected block can name a row past its
// live window. A sequence in its dense regime (kv_len <= 2 * topk_blocks *
// block_size) keeps every block: the rule is applied per sequence, on the
// device, so a ragged batch mixes both.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/layer.h"

namespace sparsepage {

struct BlockSparseConfig {
  int32_t num_qo_heads = 64;
  int32_t num_kv_heads = 4;
  int32_t head_dim = 128;  // also the index head dim (the index key is a K head)
  int32_t block_size = 128;
  int32_t topk_blocks = 16;
  int32_t local_blocks = 1;  // >= 1: the final block is always kept
  int64_t capacity_step = 4096;
  /// Where the attention rows live. kEnginePools' index keys are rows of
  /// the layer's dtype, or vLLM's FP8 blocks at head_dim 128.
  KVStorage kv_storage = KVStorage::kLayerCache;

  /// The sparse regime: enough context that top-k leaves something out.
  bool sparse_regime(int64_t kv_len) const { return kv_len > int64_t{2} * topk_blocks * block_size; }
  int32_t group_size() const { return num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0; }  // 0: invalid
};

/// One token's projected inputs, all on the layer's device, in its dtype
/// (multi-token forms: LayerForms).
struct BlockSparseTokens {
  const void* q = nullptr;        // [batch, num_qo_heads, head_dim]
  const void* index_q = nullptr;  // [batch, num_kv_heads, head_dim]
  const void* k = nullptr;        // [batch, num_kv_heads + 1, 1, head_dim]: attention keys, then the index key
  const void* v = nullptr;        // [batch, num_kv_heads, 1, head_dim]
  void* o = nullptr;              // [batch, num_qo_heads, head_dim]
  /// KVStorage::kEnginePaged only (k and v null): the index key [batch, 1, 1, head_dim].
  const void* index_k = nullptr;
};

/// The block-sparse layer: the skeleton (sparsepage/layer.h) with the block
/// indexer as its selection, attending the kept blocks as block-granular
/// pages (page_size = block_size; the partial final block cut by the
/// device-side count). Its forms (LayerForms, EngineLayerForms):
///  * decode(tokens, q_len): one selection serves the q_len tokens (a block
///    scores the max over the tokens' index queries, and the block of the
///    first new token is force-kept besides the final one); the fused
///    kernel applies each token's causal limit by position. On CUDA
///    q_len * num_kv_heads <= 32.
///  * prefill(tokens, num_tokens): each query block of the chunk
///    (block_size tokens, the last possibly fewer) keeps for each KV head
///    what one multi-token step of its tokens would: every block while it
///    ends within the dense regime, else the prefill indexer's top
///    topk_blocks by the scores max-pooled over the block's tokens, the
///    forced local blocks and its own block last; the fused GQA block
///    prefill attends them, each token up to its own position. Refused by
///    name: a chunk whose start (some slot's length before it) is not a
///    multiple of block_size (query blocks must be key blocks: the prompt's
///    tail goes by decode() or prefill_token()), block_size above 256, and
///    on CUDA head_dim other than 128 or block_size other than 64 or 128
///    (the prefill indexer's block scores).
///  * over an engine's pools (EngineLayerForms): a key block id outside the
///    key pool that a prefill's block scores read is refused by name on the
///    CPU; on CUDA the lists that needed it select nothing and
///    check_errors() names it.
class BlockSparseAttention : public EngineLayerForms<BlockSparseTokens> {
 public:
  BlockSparseAttention(Device device, DType dtype, const BlockSparseConfig& config, int32_t batch,
                       DispatchConfig dispatch = process_dispatch_config());

  const BlockSparseConfig& config() const { return config_; }
  /// Tokens a sequence of `kv_len` tokens attends (the per-sequence rule).
  int64_t selected_tokens(int64_t kv_len) const;
  /// Kept blocks of the last step, per request r = b * num_kv_heads + h (host copy).
  std::vector<std::vector<int32_t>> last_blocks() const;

 private:
  StepTokens to_step(const BlockSparseTokens& t) const override;
  std::string query_tokens_refusal(int32_t q_len) const override;
  TokenNames token_names() const override;
  TokenBytes token_bytes() const override;
  int32_t max_query_tokens() const override { return kMaxQueryTokens; }
  SparseAttentionInputs attention_inputs(const StepTokens& tokens, int32_t q_len) const override;
  void size_selection(int64_t capacity, int32_t q_len) override;
  PagedSelection selection(int32_t q_len) const override;
  void select(const StepTokens& tokens, int32_t q_len, void* stream) override;
  bool sparse_at(int64_t kv_len) const override { return config_.sparse_regime(kv_len); }
  void build_mask(float* mask, int64_t pitch, void* stream) override;
  std::vector<std::vector<int32_t>> selected_positions() const override;
  void check_engine_kv(const EnginePagedKV& kv) const override;
  void check_selection_errors(void* stream) override;
  /// The indexer on the host over the engine's paged keys and lengths.
  void select_pools_cpu(const StepTokens& tokens);
  /// Sequence b's host lists at length len: `kept`, the indexer's
  /// blocks_per_request per KV head, or every block when empty (dense regime).
  void write_lists_cpu(int32_t b, int64_t len, const std::vector<int32_t>& kept);
  std::string prefill_refusal(int32_t num_tokens, const std::vector<int64_t>& lens) const override;
  /// A chunk over engine pools on the CPU: why an index-key table entry the
  /// block scores read is outside the key pool (empty: none).
  std::string pools_key_table_refusal(const PagedIndexKeys& keys, int32_t num_tokens,
                                      const std::vector<int64_t>& lens) const;
  void run_prefill(const StepTokens& tokens, int32_t first_slot, const PrefillChunk& chunk, void* stream) override;
  std::vector<std::vector<int32_t>> prefill_positions(const std::vector<int64_t>& lens,
                                                      int32_t num_tokens) const override;
  void check_prefill_errors(void* stream) override { gqa_prefill_.check_errors(stream); }
  int32_t num_requests() const { return batch() * config_.num_kv_heads; }
  /// Entries per request row: room for a dense-regime sequence's blocks.
  int32_t width() const { return 2 * config_.topk_blocks; }

  BlockSparseConfig config_;
  Buffer block_ids_;          // int32 [requests, width]: kept blocks (increasing), the final block last, then -1
  Buffer seq_lens_;           // int32 [requests]: tokens those blocks cover now
  Buffer indexer_workspace_;  // CUDA indexer scratch
  // Chunked prefill: lists [batch, query blocks, num_kv_heads], the
  // indexer's (width topk_blocks + 1) and the attended ones (width()).
  BlockPrefillIndexer prefill_indexer_;
  GqaBlockPrefill gqa_prefill_;
  Buffer prefill_indexer_ids_, prefill_indexer_counts_, prefill_ids_, prefill_counts_;
  int32_t prefill_sized_blocks_ = 0;  // query blocks per slot the buffers hold
};

/// Indexer block scores and top-k on the host, for `batch` sequences of one
/// length: for request r = b * H + h, blocks_per_request block ids (top-k by
/// the rule above, then the final block). `index_q` is [B, H, D] and
/// `index_keys` [B, kv_len, D]; both fp32.
std::vector<int32_t> select_top_blocks_cpu(const BlockSparseConfig& config, int32_t batch, int64_t kv_len,
                                           const float* index_q, const std::vector<float>& index_keys);

}  // namespace sparsepage
