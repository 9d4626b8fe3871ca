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
// host round trip (the count, min(index_topk, kv_len), is written on the
// device per sequence); the attention kernels take latent_dim 512 with
// rope_dim 64, and the constructor refuses other shapes by name.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/index_keys.h"
#include "sparsepage/layer.h"

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
  /// Where the attention rows live; an engine's pool is the paged MLA pool
  /// `[num_blocks, block_size, latent_dim + rope_dim]`.
  KVStorage kv_storage = KVStorage::kLayerCache;
};

/// One step's inputs, in the layer's dtype except the fp32 index weights.
/// Every pointer lives on the layer's device: host memory for the CPU
/// backend, device memory for CUDA (16-byte aligned there, as the attention
/// kernels read q, q_pe and o in 16-byte pieces). Multi-token forms:
/// LayerForms.
struct DsaTokens {
  const void* q_latent = nullptr;        // [batch, num_qo_heads, latent_dim] (absorbed queries)
  const void* q_pe = nullptr;            // [batch, num_qo_heads, rope_dim]
  const void* q_index = nullptr;         // [batch, index_heads, index_head_dim]
  const float* index_weights = nullptr;  // [batch, index_heads]
  const void* k_cache_row = nullptr;     // [batch, 1, 1, latent_dim + index_head_dim]: kv_latent then indexer key
  const void* k_pe = nullptr;            // [batch, 1, 1, rope_dim]
  void* o = nullptr;                     // [batch, num_qo_heads, latent_dim]
  /// KVStorage::kEnginePaged only (k_cache_row and k_pe null): the indexer
  /// key [batch, 1, 1, index_head_dim].
  const void* index_k = nullptr;
};

/// The DSA layer: the skeleton (sparsepage/layer.h) with the lightning
/// indexer as its selection (top-k positions and their count per sequence,
/// both device data) and the MLA attention over them through the fused
/// paged decode's second K stream. Its forms (LayerForms, EngineLayerForms):
///  * decode(tokens, q_len): one top-k per token, each token's indexer
///    limited to the context up to its own position. Each token becomes a
///    request of the fused decode (tokens fold as the "KV heads" of their
///    sequence, sharing its rows), so the MLA kernel runs unchanged;
///    last_selected_positions() then has one row per (sequence, token).
///    batch * q_len <= 65535.
///  * prefill(tokens, num_tokens): the prefill indexer keeps each token's
///    top index_topk positions over its own causal window (every position
///    while the window fits, so short sequences attend densely), then the
///    fused MLA prefill attends them: the same sets and outputs as decoding
///    the tokens one by one. Refused by name: latent_dim / rope_dim other
///    than 512 / 64, and on CUDA f16 (the MLA prefill reads bf16) or
///    num_qo_heads not a multiple of 64 (64 heads per CTA).
///  * over an engine's MLA pool: K = V = the latent columns and k_extra the
///    rope columns; with kv.kv_format = KvFormat::kE4m3Mla the pool holds
///    the engines' 656-byte FP8 rows (fp8.h; a bf16 layer), dequantized in
///    the kernel. kEnginePools reads the engine's index keys, native or FP8.
class DsaAttention : public EngineLayerForms<DsaTokens> {
 public:
  DsaAttention(Device device, DType dtype, const DsaConfig& config, int32_t batch,
               DispatchConfig dispatch = process_dispatch_config());

  const DsaConfig& config() const { return config_; }

 private:
  StepTokens to_step(const DsaTokens& t) const override;
  std::string query_tokens_refusal(int32_t q_len) const override;
  TokenNames token_names() const override;
  TokenBytes token_bytes() const override;
  int32_t max_query_tokens() const override { return kMaxQueryTokens; }
  SparseAttentionInputs attention_inputs(const StepTokens& tokens, int32_t q_len) const override;
  void size_selection(int64_t capacity, int32_t q_len) override;
  PagedSelection selection(int32_t q_len) const override;
  void select(const StepTokens& tokens, int32_t q_len, void* stream) override;
  bool sparse_at(int64_t kv_len) const override { return kv_len > config_.index_topk; }
  void build_mask(float* mask, int64_t pitch, void* stream) override;
  std::vector<std::vector<int32_t>> selected_positions() const override;
  void check_engine_kv(const EnginePagedKV& kv) const override;
  void check_selection_errors(void* stream) override;
  /// Columns of the layer's K rows where the indexer key starts.
  int32_t index_key_column() const { return engine_paged() ? 0 : config_.latent_dim; }
  void select_cpu(const StepTokens& tokens, int32_t q_len, int32_t* positions, int32_t* counts) const;
  std::string prefill_refusal(int32_t num_tokens, const std::vector<int64_t>& lens) const override;
  void run_prefill(const StepTokens& tokens, int32_t first_slot, const PrefillChunk& chunk, void* stream) override;
  std::vector<std::vector<int32_t>> prefill_positions(const std::vector<int64_t>& lens,
                                                      int32_t num_tokens) const override;
  void check_prefill_errors(void* stream) override { mla_prefill_.check_errors(stream); }

  DsaConfig config_;
  // One-token steps: [batch, index_topk] positions, [batch] counts;
  // multi-token steps: one row per (sequence, token), sized for q_len.
  Buffer positions_, counts_, row_offsets_, workspace_;
  Buffer token_positions_, token_counts_, token_workspace_;
  int32_t sized_q_len_ = 0;
  // Chunked prefill: [batch, tokens, index_topk] positions and [batch, tokens] counts.
  DsaPrefillIndexer prefill_indexer_;
  MlaSparsePrefill mla_prefill_;
  Buffer prefill_positions_, prefill_counts_;
  int32_t prefill_sized_tokens_ = 0;
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
  DType dtype = DType::kBF16;        // of k_cache and q_index: f16 or bf16
  const void* k_cache = nullptr;     // the layer's K buffer: [batch * capacity, latent_dim + index_head_dim], row
                                     // b * capacity + t, index key at columns latent_dim ..; 16-byte aligned
  int64_t capacity = 0;              // rows per sequence in k_cache
  const int32_t* kv_lens = nullptr;  // DEVICE [batch]: live positions per sequence, 0 <= kv_lens[b] <= max_kv_len
  int64_t max_kv_len = 0;            // HOST bound, 1 <= max_kv_len <= capacity: sizes the grids and the workspace
  const void* q_index = nullptr;     // [batch, index_heads, index_head_dim]; 16-byte aligned
  const float* weights = nullptr;    // [batch, index_heads]
  void* workspace = nullptr;         // caller-owned scratch, >= dsa_indexer_workspace_bytes(config, batch, max_kv_len)
                                     // bytes, 16-byte aligned
  size_t workspace_bytes = 0;
  int32_t* positions = nullptr;  // out [batch, index_topk]: the kept positions of sequence b in increasing order,
                                 // then -1 up to index_topk
  int32_t* counts = nullptr;     // out [batch]: min(index_topk, kv_lens[b]), written on the device
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
void dsa_select_tokens_cuda(const DsaConfig& config, int32_t batch, const DsaIndexerArgs& args, void* stream = nullptr);

}  // namespace sparsepage
