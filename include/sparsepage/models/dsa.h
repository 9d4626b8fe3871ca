// DSA decode (SPEC section 8.2, DeepSeek-V3.2-style MLA with a top-k token
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
// lower position). While kv_len <= index_topk every token is kept.
//
// Backends: the layer runs on the CPU backend. On CUDA it reports a clear
// error: the fused kernel for the 512 + 64 shape is built (and benchmarked
// with `sparse_paged_decode_bench --geometry dsa`), but the indexer has no
// CUDA pass yet.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/selection.h"
#include "sparsepage/sparse_decode.h"

namespace sparsepage {

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
};

/// One token's inputs, host memory for the CPU backend, in the layer's dtype
/// except the fp32 index weights.
struct DsaTokens {
  const void* q_latent = nullptr;    // [batch, num_qo_heads, latent_dim] (absorbed queries)
  const void* q_pe = nullptr;        // [batch, num_qo_heads, rope_dim]
  const void* q_index = nullptr;     // [batch, index_heads, index_head_dim]
  const float* index_weights = nullptr;  // [batch, index_heads]
  const void* k_cache_row = nullptr; // [batch, 1, 1, latent_dim + index_head_dim]: kv_latent then indexer key
  const void* k_pe = nullptr;        // [batch, 1, 1, rope_dim]
  void* o = nullptr;                 // [batch, num_qo_heads, latent_dim]
};

struct DsaStep {
  bool sparse = false;           // kv_len > index_topk: the indexer dropped tokens
  bool fused = false;
  SparseDecodeOutcome outcome;
};

class DsaAttention {
 public:
  DsaAttention(Device device, DType dtype, const DsaConfig& config, int32_t batch,
               DispatchConfig dispatch = process_dispatch_config());

  /// Prefill keeps the mask path: appends the token and attends to the whole window.
  void prefill_token(const DsaTokens& tokens);
  /// Decode: appends the token, runs the indexer, tries the fused path and
  /// falls back to the mask path over the same positions.
  DsaStep decode(const DsaTokens& tokens);

  /// Positions the last decode's page table attends, per sequence.
  std::vector<std::vector<int32_t>> last_selected_positions() const { return selection_.materialize(); }
  /// Columns the mask path keeps for the last decode (its mask's 0 entries).
  /// Throws before the first decode.
  std::vector<std::vector<int32_t>> last_mask_columns() const;

  const DenseKVCache& cache() const { return cache_; }

 private:
  SparseAttentionInputs inputs(const DsaTokens& tokens) const;
  Device device_;
  DType dtype_;
  DsaConfig config_;
  int32_t batch_;
  DenseKVCache cache_;
  SparseDecoder decoder_;
  SparseSelection selection_;
};

/// The indexer on the host: for each sequence, the top `topk` positions of
/// I(b, t) (rule above), in descending score order. `index_keys` is
/// [batch, kv_len, index_head_dim] fp32, `q_index` [batch, index_heads,
/// index_head_dim], `weights` [batch, index_heads].
std::vector<std::vector<int32_t>> dsa_select_tokens_cpu(const DsaConfig& config, int32_t batch, int64_t kv_len,
                                                        const float* q_index, const float* weights,
                                                        const std::vector<float>& index_keys);

}  // namespace sparsepage
