// Block-sparse attention (docs/DESIGN.md: the block-sparse layer, MiniMax-M3-style): an indexer
// keeps the top-k key blocks per KV head, and decode attends only those
// through the fused paged decode, falling back to the additive-mask path on
// any decline.
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
// appended unconditionally. So the selected count is a function of kv_len
// alone, and no selected block can name a row past the live window.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/selection.h"
#include "sparsepage/sparse_decode.h"

namespace sparsepage {

struct BlockSparseConfig {
  int32_t num_qo_heads = 64;
  int32_t num_kv_heads = 4;
  int32_t head_dim = 128;   // also the index head dim (the index key is a K head)
  int32_t block_size = 128;
  int32_t topk_blocks = 16;
  int32_t local_blocks = 1;  // >= 1: the final block is always kept
  int64_t capacity_step = 4096;
  /// Attend through token-granular pages (each kept block expanded to its
  /// positions, page_size 1) instead of block-granular pages (page_size =
  /// block_size, the default). Both attend the same rows; the expansion is an
  /// extra pass, kept for measuring the two (docs/PERFORMANCE.md).
  bool token_pages = false;
  /// Where the attention rows live. KVStorage::kEnginePaged: in an engine's
  /// paged pool that each step reads in place through its block table (see
  /// decode(tokens, kv)); the layer keeps only the index keys. The dense
  /// regime then attends every block through the fused path too.
  KVStorage kv_storage = KVStorage::kLayerCache;

  /// The sparse regime: enough context that top-k leaves something out.
  bool sparse_regime(int64_t kv_len) const { return kv_len > int64_t{2} * topk_blocks * block_size; }
  int32_t group_size() const { return num_qo_heads / num_kv_heads; }
};

/// One token's projected inputs, all on the layer's device, in its dtype.
struct BlockSparseTokens {
  const void* q = nullptr;        // [batch, num_qo_heads, head_dim]
  const void* index_q = nullptr;  // [batch, num_kv_heads, head_dim]
  const void* k = nullptr;        // [batch, num_kv_heads + 1, 1, head_dim]: attention keys, then the index key
  const void* v = nullptr;        // [batch, num_kv_heads, 1, head_dim]
  void* o = nullptr;              // [batch, num_qo_heads, head_dim]
  /// KVStorage::kEnginePaged only, instead of k and v (which stay null: the
  /// engine has written the token's K and V rows into its pool): the
  /// token's index key [batch, 1, 1, head_dim].
  const void* index_k = nullptr;
};

/// What a decode step did.
struct BlockSparseStep {
  bool sparse_regime = false;
  bool fused = false;               // the fused paged decode ran
  SparseDecodeOutcome outcome;      // the policy's outcome (sparse regime only)
};

/// The block-sparse layer. A decode step is: append the token (at the
/// device-side length), score the blocks and keep the top-k (the indexer),
/// then attend the kept blocks as block-granular pages (page_size =
/// block_size; the partial final block is cut by the device-side count).
/// After the first step at a given capacity a step allocates nothing,
/// synchronizes nothing and reads nothing back, on either backend, so it
/// can be captured in a CUDA graph and replayed while the context grows
/// (reserve() the longest context first; after replays, sync_live_len()).
class BlockSparseAttention {
 public:
  BlockSparseAttention(Device device, DType dtype, const BlockSparseConfig& config, int32_t batch,
                       DispatchConfig dispatch = process_dispatch_config());

  /// Prefill keeps the mask path: appends the token and attends causally to
  /// the whole window (dense).
  void prefill_token(const BlockSparseTokens& tokens, void* stream = nullptr);

  /// Decode: appends the token; in the sparse regime runs the indexer and
  /// tries the fused path, falling back to the block mask over the same set.
  /// Every input is checked before the cache changes: a bad call appends
  /// nothing.
  BlockSparseStep decode(const BlockSparseTokens& tokens, void* stream = nullptr);
  /// Decode over an engine's paged pool (KVStorage::kEnginePaged): appends
  /// the index key, runs the indexer, and attends the kept blocks of
  /// `kv` in place, position p of sequence b at its table row
  /// `kv.block_table[b, p / block_size] * block_size + p % block_size`. The
  /// engine must already have written this token's K and V rows at position
  /// kv_len() (the length before the call). In the dense regime every block
  /// is attended. There is no mask path here: a step the dispatch would
  /// decline is refused by name before anything changes. Capturable like
  /// decode().
  BlockSparseStep decode(const BlockSparseTokens& tokens, const EnginePagedKV& kv, void* stream = nullptr);

  /// A multi-token step (speculative verification, MTP): appends q_len
  /// tokens per sequence (1 .. kMaxQueryTokens; 1 is decode() above) and
  /// attends them, token t seeing the context up to its own position.
  /// Layout, as engines lay out [tokens, heads, dim] with a sequence's tokens
  /// consecutive: q and o [batch, q_len, num_qo_heads, head_dim], index_q
  /// [batch, q_len, num_kv_heads, head_dim]; k and v are q_len one-token
  /// slices, token-major, each what decode() takes: k [q_len, batch,
  /// num_kv_heads + 1, head_dim], v [q_len, batch, num_kv_heads, head_dim].
  ///
  /// In the sparse regime (after the step) one selection serves the q_len
  /// tokens: a block scores the max over the tokens' index queries, and the
  /// block of the first new token is force-kept besides the final one (the
  /// new tokens may straddle a block boundary), so the count still depends
  /// on the length alone. The fused kernel reads each selected row once per
  /// query-row tile, the tiles of a request side by side, and applies each
  /// token's causal limit by position. The mask path takes one token, so
  /// outside the sparse regime, or when the policy declines, the step runs
  /// as q_len one-token decode() calls (each token appended, then attended,
  /// with its own selection): exact causal attention, but copies through
  /// staging buffers that synchronize, so only the fused step can be captured
  /// (it allocates nothing after the first step at a capacity; step_graph_test and
  /// tests/python/test_multi_token.py replay it from a graph while the context grows).
  /// The returned step describes the fused step, or the last one-token step.
  BlockSparseStep decode(const BlockSparseTokens& tokens, int32_t q_len, void* stream = nullptr);

  /// Makes room for `tokens` live tokens, and sizes the step's buffers for
  /// them, so steps up to that length allocate nothing.
  void reserve(int64_t tokens);
  /// Appends `tokens` tokens per sequence to the cache without attending (a
  /// prompt whose prefill attention ran elsewhere): `k` is [batch,
  /// num_kv_heads + 1, tokens, head_dim] (the index key last), `v` [batch,
  /// num_kv_heads, tokens, head_dim], contiguous, on the layer's device.
  /// With KVStorage::kEnginePaged `k` is the index keys [batch, 1, tokens,
  /// head_dim] and `v` is null (the engine holds the attention rows).
  /// Synchronous; not a step.
  void append_tokens(const void* k, const void* v, int64_t tokens);
  /// Profiling: CUDA events (cudaEvent_t, or null) that each decode records
  /// on its stream after the append and after the indexer, so a benchmark
  /// can split a step's time. They are recorded inside captured steps too.
  void set_phase_events(void* after_append, void* after_indexer) {
    after_append_ = after_append;
    after_indexer_ = after_indexer;
  }
  /// After replaying captured steps: reads the device-side length back (synchronizes).
  void sync_live_len(void* stream = nullptr) { cache_.sync_live_len(stream); }

  /// Selected blocks of the last sparse decode, per request (host copy).
  std::vector<std::vector<int32_t>> last_blocks() const;
  /// Positions the page table of the last sparse decode attends, per request.
  std::vector<std::vector<int32_t>> last_selected_positions() const;
  /// Columns the mask path keeps for the last sparse decode (0 entries of
  /// its additive mask), per request — built from the blocks independently.
  std::vector<std::vector<int32_t>> last_mask_columns();

  const DenseKVCache& cache() const { return cache_; }
  int64_t kv_len() const { return cache_.live_len(); }
  /// Tokens each request attends at `kv_len` in the sparse regime.
  int64_t selected_tokens(int64_t kv_len) const;

 private:
  /// What every form of the step shares: shapes, lengths, queries, scale, output.
  SparseAttentionInputs query_inputs(const BlockSparseTokens& tokens) const;
  SparseAttentionInputs inputs(const BlockSparseTokens& tokens) const;
  SparseAttentionInputs engine_inputs(const BlockSparseTokens& tokens, const EnginePagedKV& kv, int64_t kv_len) const;
  void check_tokens(const BlockSparseTokens& tokens) const;
  bool engine_paged() const { return config_.kv_storage == KVStorage::kEnginePaged; }
  void size_step_buffers();
  /// The indexer over the live window, keeping `topk` blocks plus the final
  /// one in rows of `width` entries (q_len > 1: the max over the step's
  /// tokens' index queries, the first new token's block force-kept).
  void select_blocks(const BlockSparseTokens& tokens, int32_t topk, int32_t width, void* stream, int32_t q_len = 1);
  /// The kept blocks as the fused decode's page matrix (rows of `width`
  /// entries; token_pages: expanded to positions first).
  PagedSelection kept_selection(int32_t width, int64_t max_selected, void* stream);
  BlockSparseStep decode_fused_tokens(const BlockSparseTokens& tokens, int32_t q_len, void* stream);
  BlockSparseStep decode_token_by_token(const BlockSparseTokens& tokens, int32_t q_len, void* stream);
  void expand_token_pages(void* stream);
  void build_block_mask(void* stream);
  int32_t num_requests() const { return batch_ * config_.num_kv_heads; }
  int32_t width() const { return config_.topk_blocks + 1; }
  /// Entries per request the block buffer holds: an engine-paged layer's
  /// dense regime keeps every block (up to 2 * topk_blocks).
  int32_t max_width() const { return engine_paged() ? std::max(width(), 2 * config_.topk_blocks) : width(); }

  Device device_;
  DType dtype_;
  BlockSparseConfig config_;
  int32_t batch_;
  DenseKVCache cache_;
  SparseDecoder decoder_;
  // Step buffers, sized for the cache's capacity (size_step_buffers).
  int64_t sized_capacity_ = -1;
  Buffer block_ids_;         // int32 [requests, topk + 1]: kept blocks, the final block last, then -1
  Buffer seq_lens_;          // int32 [requests]: tokens those blocks cover now
  Buffer token_pages_;       // int32 [requests, width * block_size] (config.token_pages)
  Buffer indexer_workspace_; // CUDA indexer scratch
  StepMaskPath fallback_;     // the mask path over the capacity
  bool have_selection_ = false;
  int32_t selection_width_ = 0;  // entries per request row of the last selection
  void* after_append_ = nullptr;
  void* after_indexer_ = nullptr;
  // Multi-token steps run token by token: one token's q, index_q and o.
  Buffer stage_q_, stage_index_q_, stage_o_;
};

/// Indexer block scores and top-k on the host: for request r = b * H + h,
/// returns blocks_per_request block ids (top-k by the rule above, then the
/// final block). `index_q` is [B, H, D] and `index_k(b, t)` the index key
/// row; both fp32.
std::vector<int32_t> select_top_blocks_cpu(const BlockSparseConfig& config, int32_t batch, int64_t kv_len,
                                           const float* index_q, const std::vector<float>& index_keys_bt);

}  // namespace sparsepage
