// DSA decode (docs/DESIGN.md: the DSA layer, DeepSeek-V3.2-style MLA with a top-k token
// indexer): the cache stores concat(kv_latent, indexer_key) as its K buffer
// and k_pe as its V buffer; the indexer keeps `index_topk` tokens, and the
// attention over them runs through the fused paged decode's second K stream:
//   score(t) = scale * (q_latent . kv_latent[t] + q_pe . k_pe[t])
//   o        = sum_t softmax(score)_t * kv_latent[t]
// with K = the K buffer at row stride latent_dim + index_head_dim (first
// latent_dim columns), the extra stream = the k_pe buffer, and V = the first
// latent_dim columns of K. Both buffers have one head, so they share a row
// mapping at any batch.
//
// Indexer rule (the lightning indexer): with index queries q_idx[b, j]
// (j < index_heads) and weights w[b, j],
//   I(b, t) = sum_j w[b, j] * ReLU(q_idx[b, j] . k_idx[b, t])
// over the live window; the top `index_topk` positions are kept (ties to the
// lower position; a NaN score ranks last). While kv_len <= index_topk every
// token is kept.
//
// Backends: CPU and CUDA. On CUDA the indexer runs on the device
// (dsa_select_tokens_cuda) and its positions become the selection without a
// host round trip (the count, min(index_topk, kv_len) per sequence, is a host
// fact); the attention kernels take latent_dim 512 with rope_dim 64, and the
// constructor refuses other shapes by name.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/selection.h"
#include "sparsepage/sparse_decode.h"

namespace sparsepage {

struct DsaIndexerArgs;

struct DsaConfig {
  int32_t num_qo_heads = 128;
  int32_t latent_dim = 512;
  int32_t rope_dim = 64;
  int32_t index_heads = 64;
  int32_t index_head_dim = 128;
  int32_t index_topk = 2048;
  // Softmax scale of q . k. Pass the model's own: DeepSeek-V3.2 uses
  // 1 / sqrt(qk_nope_dim + qk_rope_dim) = 1 / sqrt(192), times its YaRN
  // factor, even for absorbed queries. 0 picks 1 / sqrt(latent_dim +
  // rope_dim), the scale for unit-variance latent dot products (the tests').
  float scale = 0.0f;
  int64_t capacity_step = 4096;
  /// Where the attention rows live. KVStorage::kEnginePaged: in an engine's
  /// paged MLA pool (`[num_blocks, block_size, latent_dim + rope_dim]`, read
  /// in place through its block table; see decode(tokens, kv)); the layer
  /// keeps only the indexer's keys.
  KVStorage kv_storage = KVStorage::kLayerCache;
};

/// One token's inputs, in the layer's dtype except the fp32 index weights.
/// Every pointer lives on the layer's device: host memory for the CPU
/// backend, device memory for CUDA (16-byte aligned there, as the attention
/// kernels read q, q_pe and o in 16-byte pieces).
struct DsaTokens {
  const void* q_latent = nullptr;    // [batch, num_qo_heads, latent_dim] (absorbed queries)
  const void* q_pe = nullptr;        // [batch, num_qo_heads, rope_dim]
  const void* q_index = nullptr;     // [batch, index_heads, index_head_dim]
  const float* index_weights = nullptr;  // [batch, index_heads]
  const void* k_cache_row = nullptr; // [batch, 1, 1, latent_dim + index_head_dim]: kv_latent then indexer key
  const void* k_pe = nullptr;        // [batch, 1, 1, rope_dim]
  void* o = nullptr;                 // [batch, num_qo_heads, latent_dim]
  /// KVStorage::kEnginePaged only, instead of k_cache_row and k_pe (which
  /// stay null: the engine has written the token's MLA row into its pool):
  /// the token's indexer key [batch, 1, 1, index_head_dim].
  const void* index_k = nullptr;
};

struct DsaStep {
  bool sparse = false;           // kv_len > index_topk: the indexer dropped tokens
  bool fused = false;
  SparseDecodeOutcome outcome;
};

/// The DSA layer. A decode step is: append the token (at the device-side
/// length), run the indexer (top-k positions and their count per sequence,
/// both device data), then attend them through the fused paged decode. After
/// the first step at a given capacity a step allocates nothing, synchronizes
/// nothing and reads nothing back, so it can be captured in a CUDA graph and
/// replayed while the context grows (reserve() the longest context first;
/// after replays, sync_live_len()).
class DsaAttention {
 public:
  DsaAttention(Device device, DType dtype, const DsaConfig& config, int32_t batch,
               DispatchConfig dispatch = process_dispatch_config());

  /// Prefill keeps the mask path: appends the token and attends to the whole
  /// window. On CUDA the attention runs on `stream` (a cudaStream_t; null:
  /// the default stream).
  void prefill_token(const DsaTokens& tokens, void* stream = nullptr);
  /// Decode: appends the token, runs the indexer, tries the fused path and
  /// falls back to the mask path over the same positions. Every input is
  /// checked before the cache changes: a bad call appends nothing.
  DsaStep decode(const DsaTokens& tokens, void* stream = nullptr);
  /// Decode over an engine's paged MLA pool (KVStorage::kEnginePaged):
  /// appends the indexer key, runs the indexer, and attends the kept
  /// positions of `kv` in place (K = V = the latent columns, k_extra = the
  /// rope columns), position p of sequence b at its table row
  /// `kv.block_table[b, p / block_size] * block_size + p % block_size`. The
  /// engine must already have written this token's row at position kv_len()
  /// (the length before the call). With kv.kv_format = KvFormat::kE4m3Mla
  /// the pool holds the engines' 656-byte FP8 rows (fp8.h; a bf16 layer),
  /// dequantized in the kernel. No mask path: a step the dispatch would
  /// decline is refused by name before anything changes. Capturable like
  /// decode().
  DsaStep decode(const DsaTokens& tokens, const EnginePagedKV& kv, void* stream = nullptr);

  /// A multi-token step (speculative verification, MTP): appends q_len
  /// tokens per sequence (1 .. kMaxQueryTokens; 1 is decode() above) and
  /// attends them with one top-k per token, each token's indexer limited to
  /// the context up to its own position. Layout, as engines lay out
  /// [tokens, heads, dim] with a sequence's tokens consecutive: q_latent,
  /// q_pe and o [batch, q_len, num_qo_heads, dim], q_index [batch, q_len,
  /// index_heads, index_head_dim], index_weights [batch, q_len,
  /// index_heads]; k_cache_row and k_pe are q_len one-token slices,
  /// token-major, each what decode() takes ([q_len, batch, 1, 1, dim]).
  /// Each token becomes a request of the fused decode (tokens fold as the
  /// "KV heads" of their sequence, sharing its rows), so the MLA kernel
  /// runs unchanged and requests of one sequence, adjacent in the grid, read
  /// the rows their selections share from L2. A decline (the mask path takes
  /// one token) runs the step as q_len one-token decode() calls through
  /// staging copies that synchronize; only the fused step can be captured
  /// (it allocates nothing after the first step at a capacity; step_graph_test and
  /// tests/python/test_multi_token.py replay it from a graph while the context grows).
  /// The selection of a fused step is read with last_selected_positions(),
  /// one row per (sequence, token).
  DsaStep decode(const DsaTokens& tokens, int32_t q_len, void* stream = nullptr);

  /// Makes room for `tokens` live tokens and sizes the step's buffers for them.
  void reserve(int64_t tokens);
  /// Appends `tokens` tokens per sequence to the cache without attending (a
  /// prompt whose prefill attention ran elsewhere): `k_cache_rows` is
  /// [batch, 1, tokens, latent_dim + index_head_dim], `k_pe` [batch, 1,
  /// tokens, rope_dim], contiguous, on the layer's device. With
  /// KVStorage::kEnginePaged `k_cache_rows` is the indexer keys [batch, 1,
  /// tokens, index_head_dim] and `k_pe` is null. Synchronous.
  void append_tokens(const void* k_cache_rows, const void* k_pe, int64_t tokens);
  /// Profiling: CUDA events (cudaEvent_t, or null) each decode records on
  /// its stream after the append and after the indexer.
  void set_phase_events(void* after_append, void* after_indexer) {
    after_append_ = after_append;
    after_indexer_ = after_indexer;
  }
  /// After replaying captured steps: reads the device-side length back (synchronizes).
  void sync_live_len(void* stream = nullptr) { cache_.sync_live_len(stream); }

  /// Positions the last decode's page table attends, per sequence: in
  /// descending indexer score on the CPU backend, in increasing position on
  /// CUDA. A host copy for tests and debugging; on CUDA it reads after the
  /// default stream, so synchronize a non-blocking decode stream first.
  std::vector<std::vector<int32_t>> last_selected_positions() const;
  /// Columns the mask path keeps for the last decode (its mask's 0 entries),
  /// built on the layer's device from the same selection; a host copy, as
  /// above. Throws before the first decode.
  std::vector<std::vector<int32_t>> last_mask_columns();

  const DenseKVCache& cache() const { return cache_; }
  int64_t kv_len() const { return cache_.live_len(); }

 private:
  /// What every form of the step shares: shapes, lengths, queries, scale, output.
  SparseAttentionInputs query_inputs(const DsaTokens& tokens) const;
  SparseAttentionInputs inputs(const DsaTokens& tokens) const;
  SparseAttentionInputs engine_inputs(const DsaTokens& tokens, const EnginePagedKV& kv, int64_t kv_len) const;
  bool engine_paged() const { return config_.kv_storage == KVStorage::kEnginePaged; }
  void check_tokens(const DsaTokens& tokens) const;
  /// Columns of the layer's K rows where the indexer key starts.
  int32_t index_key_column() const { return engine_paged() ? 0 : config_.latent_dim; }
  void size_step_buffers();
  void select_tokens_cpu(const DsaTokens& tokens);
  void select_tokens_cuda(const DsaTokens& tokens, void* stream);
  /// The CUDA indexer's arguments over the layer's keys, writing into `positions` and `counts`.
  DsaIndexerArgs indexer_args(const DsaTokens& tokens, Buffer& workspace, Buffer& positions, Buffer& counts);
  /// The kept positions of `requests` rows as the fused decode's page matrix.
  PagedSelection kept_selection(Buffer& positions, Buffer& counts, int32_t requests, int64_t live_len);
  /// The indexer's rule: the config, with the key's column in the layer's K rows.
  DsaConfig indexer_rule() const;
  DsaStep decode_fused_tokens(const DsaTokens& tokens, int32_t q_len, void* stream);
  DsaStep decode_token_by_token(const DsaTokens& tokens, int32_t q_len, void* stream);
  SparseAttentionInputs token_inputs(const DsaTokens& tokens, int32_t q_len) const;
  void size_token_buffers(int32_t q_len);
  Device device_;
  DType dtype_;
  DsaConfig config_;
  int32_t batch_;
  DenseKVCache cache_;
  SparseDecoder decoder_;
  // Step buffers, sized for the cache's capacity (size_step_buffers).
  int64_t sized_capacity_ = -1;
  Buffer positions_;          // int32 [batch, index_topk]: kept positions, then -1
  Buffer counts_;             // int32 [batch]: kept positions per sequence
  Buffer row_offsets_;        // int32 [batch + 1]: b * index_topk (the mask builder's CSR view of positions_)
  Buffer index_workspace_;    // the CUDA indexer's scratch
  StepMaskPath fallback_;     // the mask path over the capacity
  bool have_selection_ = false;
  void* after_append_ = nullptr;
  void* after_indexer_ = nullptr;
  // Multi-token steps: one row per (sequence, token), sized for the capacity
  // and q_len (size_token_buffers); their own decoder keeps their plan.
  SparseDecoder token_decoder_;
  int32_t sized_q_len_ = 0;
  int64_t token_sized_capacity_ = -1;
  Buffer token_positions_, token_counts_, token_index_workspace_;
  int32_t last_q_len_ = 1;  // rows of the last selection per sequence
  Buffer stage_q_, stage_q_pe_, stage_q_index_, stage_weights_, stage_o_;
};

/// The indexer on the host: for each sequence, the top `topk` positions of
/// I(b, t) (rule above), in descending score order. `index_keys` is
/// [batch, kv_len, index_head_dim] fp32, `q_index` [batch, index_heads,
/// index_head_dim], `weights` [batch, index_heads].
std::vector<std::vector<int32_t>> dsa_select_tokens_cpu(const DsaConfig& config, int32_t batch, int64_t kv_len,
                                                        const float* q_index, const float* weights,
                                                        const std::vector<float>& index_keys);

/// Where the CUDA indexer reads and writes; every pointer is device memory.
/// The live length of each sequence is read on the device; the grids and the
/// workspace come from the host bound max_kv_len, so a graph captured once
/// replays correctly while the lengths grow up to that bound.
struct DsaIndexerArgs {
  DType dtype = DType::kBF16;      // of k_cache and q_index: f16 or bf16
  const void* k_cache = nullptr;   // the layer's K buffer: [batch * capacity, latent_dim + index_head_dim], row
                                   // b * capacity + t, index key at columns latent_dim ..; 16-byte aligned
  int64_t capacity = 0;            // rows per sequence in k_cache
  const int32_t* kv_lens = nullptr;  // DEVICE [batch]: live positions per sequence, 0 <= kv_lens[b] <= max_kv_len
  int64_t max_kv_len = 0;          // HOST bound, 1 <= max_kv_len <= capacity: sizes the grids and the workspace
  const void* q_index = nullptr;   // [batch, index_heads, index_head_dim]; 16-byte aligned
  const float* weights = nullptr;  // [batch, index_heads]
  void* workspace = nullptr;       // caller-owned scratch, >= dsa_indexer_workspace_bytes(config, batch, max_kv_len)
                                   // bytes, 16-byte aligned
  size_t workspace_bytes = 0;
  int32_t* positions = nullptr;    // out [batch, index_topk]: the kept positions of sequence b in increasing order,
                                   // then -1 up to index_topk
  int32_t* counts = nullptr;       // out [batch]: min(index_topk, kv_lens[b]), written on the device
  /// Multi-token steps: each sequence has q_len query tokens, each with its
  /// own top-k over its own causal window. q_index is then [batch, q_len,
  /// index_heads, index_head_dim], weights [batch, q_len, index_heads],
  /// positions [batch * q_len, index_topk] and counts [batch * q_len]; row
  /// b * q_len + t keeps positions below kv_lens[b] - (q_len - 1 - t), and
  /// the workspace is sized for batch * q_len rows.
  int32_t q_len = 1;
  /// Where the keys are (index_keys.h). kDense reads k_cache and capacity
  /// above; kPaged reads `paged` (native or FP8 keys through the engine's
  /// block table; k_cache and capacity are unused, and max_kv_len must fit
  /// paged.max_blocks x paged.block_size).
  IndexKeyLayout key_layout = IndexKeyLayout::kDense;
  PagedIndexKeys paged;
  /// The form of q_index: kNative (dtype above) or kE4m3 (e4m3 with the
  /// query scales folded into `weights`, quantize_index_queries_*; FP8 keys
  /// only). FP8 keys with kNative queries: the kernel quantizes them itself.
  IndexQueryFormat q_format = IndexQueryFormat::kNative;
  /// DEVICE int32, may be null: IndexKeyError bits or'ed in for a refused row
  /// (a length outside [0, max_kv_len] or past its block-table row, a needed
  /// block id outside the pool), which selects nothing: count 0, positions -1.
  int32_t* error = nullptr;
};

/// Bytes of workspace dsa_select_tokens_cuda needs for `batch` sequences of
/// up to max_kv_len positions (about 12 bytes per position plus 16 KB per
/// sequence).
size_t dsa_indexer_workspace_bytes(const DsaConfig& config, int32_t batch, int64_t max_kv_len);

/// The indexer on the GPU, on `stream` (a cudaStream_t; null: the default
/// stream): for each sequence the same set as dsa_select_tokens_cpu (scores
/// accumulated in fp32 on tensor cores, NaN last, ties at the threshold to the
/// lower positions), written in increasing position order. Only the order of
/// the fp32 sums differs from the CPU loop, so scores closer than its rounding
/// may swap at the threshold. A sequence whose window fits the top-k gets
/// 0 .. kv_len - 1 without scoring. Allocates nothing, synchronizes nothing
/// and reads nothing back (graph-capturable).
/// Limits (Error naming the one broken): f16/bf16; index_head_dim a multiple
/// of 16 up to 256 and latent_dim a multiple of 8; index_heads *
/// index_head_dim <= 16384 (one sequence's index queries are staged in shared
/// memory); batch <= 65535; max_kv_len < 2^31.
void dsa_select_tokens_cuda(const DsaConfig& config, int32_t batch, const DsaIndexerArgs& args,
                            void* stream = nullptr);

}  // namespace sparsepage
