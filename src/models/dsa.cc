#include "sparsepage/models/dsa.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/cuda_hooks.h"
#include "models/dsa_kernels.h"

namespace sparsepage {

std::vector<std::vector<int32_t>> dsa_select_tokens_cpu(const DsaConfig& c, int32_t batch, int64_t kv_len,
                                                        const float* q_index, const float* weights,
                                                        const std::vector<float>& index_keys) {
  if (batch < 1 || kv_len < 0 || q_index == nullptr || weights == nullptr || c.index_topk < 1 ||
      static_cast<int64_t>(index_keys.size()) != int64_t{batch} * kv_len * c.index_head_dim) {
    throw Error("dsa_select_tokens_cpu: need batch >= 1, kv_len >= 0, index_topk >= 1, q_index, weights, and "
                "index_keys of batch * kv_len * index_head_dim = " +
                std::to_string(int64_t{batch} * kv_len * c.index_head_dim) + " floats (got " +
                std::to_string(index_keys.size()) + ")");
  }
  const size_t d = static_cast<size_t>(c.index_head_dim);
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(batch));
  std::vector<float> score(static_cast<size_t>(kv_len));
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < kv_len; ++t) {
      const float* k = &index_keys[(static_cast<size_t>(b) * static_cast<size_t>(kv_len) + static_cast<size_t>(t)) * d];
      float total = 0.0f;
      for (int32_t j = 0; j < c.index_heads; ++j) {
        const float* q = q_index + (static_cast<size_t>(b) * c.index_heads + j) * d;
        float dot = 0.0f;
        for (size_t i = 0; i < d; ++i) dot += q[i] * k[i];
        total += weights[static_cast<size_t>(b) * c.index_heads + j] * std::max(dot, 0.0f);
      }
      // A NaN score (NaN inputs) ranks last rather than breaking the sort's ordering.
      score[static_cast<size_t>(t)] = std::isnan(total) ? -std::numeric_limits<float>::infinity() : total;
    }
    const int64_t keep = std::min<int64_t>(c.index_topk, kv_len);
    std::vector<int32_t> order(static_cast<size_t>(kv_len));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), [&](int32_t x, int32_t y) {
      const float sx = score[static_cast<size_t>(x)], sy = score[static_cast<size_t>(y)];
      return sx > sy || (sx == sy && x < y);
    });
    out[static_cast<size_t>(b)].assign(order.begin(), order.begin() + keep);
  }
  return out;
}

namespace detail {

void check_dsa_indexer_cuda(const DsaConfig& c, int32_t batch) {
  const std::string what = "DSA indexer (CUDA): ";
  if (batch < 1 || batch > kDsaMaxBatch) {
    throw Error(what + "batch = " + std::to_string(batch) + " must lie in [1, " + std::to_string(kDsaMaxBatch) + "]");
  }
  if (c.index_topk < 1 || c.index_heads < 1 || c.latent_dim < 0) {
    throw Error(what + "index_topk and index_heads must be at least 1 and latent_dim not negative");
  }
  if (c.index_head_dim < 16 || c.index_head_dim % 16 != 0 || c.index_head_dim > kDsaMaxIndexHeadDim) {
    throw Error(what + "index_head_dim = " + std::to_string(c.index_head_dim) + " must be a multiple of 16 in [16, " +
                std::to_string(kDsaMaxIndexHeadDim) + "] (the scores are m16n8k16 tensor-core products)");
  }
  if (c.latent_dim % 8 != 0) {
    throw Error(what + "latent_dim = " + std::to_string(c.latent_dim) +
                " must be a multiple of 8 (the index key starts at that column and is read 16 bytes at a time)");
  }
  if (int64_t{c.index_heads} * c.index_head_dim > kDsaMaxQueryElements) {
    throw Error(what + "index_heads * index_head_dim = " + std::to_string(int64_t{c.index_heads} * c.index_head_dim) +
                " exceeds " + std::to_string(kDsaMaxQueryElements) + " (one sequence's index queries are staged in "
                "shared memory)");
  }
}

}  // namespace detail

namespace {
// The layer's configuration, checked before anything is allocated (so a
// CUDA layer names a shape it cannot run even on a machine without a GPU),
// with the default scale filled in.
DsaConfig checked_config(Device device, DType dtype, const DsaConfig& config, int32_t batch) {
  if (dtype == DType::kF32) throw Error("DsaAttention: the cache stores f16 or bf16");
  if (batch < 1) throw Error("DsaAttention: batch = " + std::to_string(batch) + " must be at least 1");
  if (config.num_qo_heads < 1 || config.latent_dim < 1 || config.rope_dim < 1 || config.index_heads < 1 ||
      config.index_head_dim < 1 || config.index_topk < 1) {
    throw Error("DsaAttention: heads, dims and index_topk must be at least 1");
  }
  if (config.kv_storage != KVStorage::kLayerCache && config.kv_storage != KVStorage::kEnginePaged) {
    throw Error("DsaAttention: kv_storage is not a KVStorage value");
  }
  if (!std::isfinite(config.scale) || config.scale < 0.0f) {
    throw Error("DsaAttention: scale = " + std::to_string(config.scale) + " must be finite and >= 0 (0: the default)");
  }
  if (device == Device::kCuda) {
    // The mask path and the fused path share the MLA tile; without it neither could run.
    if (config.latent_dim != 512 || config.rope_dim != 64) {
      throw Error("DsaAttention on CUDA: no attention kernel for latent_dim " + std::to_string(config.latent_dim) +
                  " with rope_dim " + std::to_string(config.rope_dim) + " (the MLA kernel takes 512 and 64)");
    }
    detail::check_dsa_indexer_cuda(config, batch);
  }
  DsaConfig c = config;
  if (c.scale == 0.0f) c.scale = 1.0f / std::sqrt(static_cast<float>(c.latent_dim + c.rope_dim));
  return c;
}
}  // namespace

DsaAttention::DsaAttention(Device device, DType dtype, const DsaConfig& config, int32_t batch, DispatchConfig dispatch)
    : device_(device),
      dtype_(dtype),
      config_(checked_config(device, dtype, config, batch)),
      batch_(batch),
      // Engine-paged: the engine's pool holds the MLA rows, the layer only the indexer keys.
      cache_(device, dtype == DType::kF16 ? CacheMode::kF16 : CacheMode::kBF16, batch, 1,
             config.kv_storage == KVStorage::kEnginePaged ? 0 : 1,
             config.kv_storage == KVStorage::kEnginePaged ? config.index_head_dim
                                                         : config.latent_dim + config.index_head_dim,
             config.rope_dim, config.capacity_step),
      // No mask path behind an engine's pool: only what the fused path cannot do declines.
      decoder_(device, config.kv_storage == KVStorage::kEnginePaged ? dispatch.without_performance_gates() : dispatch),
      token_decoder_(device, dispatch) {}

// Every input is checked before the cache changes, so a bad call appends nothing.
void DsaAttention::check_tokens(const DsaTokens& t) const {
  if (engine_paged()) {
    if (t.q_latent == nullptr || t.q_pe == nullptr || t.q_index == nullptr || t.index_weights == nullptr ||
        t.index_k == nullptr || t.o == nullptr) {
      throw Error("DsaAttention (engine-paged): q_latent, q_pe, q_index, index_weights, index_k and o must be set");
    }
    if (t.k_cache_row != nullptr || t.k_pe != nullptr) {
      throw Error("DsaAttention (engine-paged): k_cache_row and k_pe must be null (the engine writes the token's "
                  "MLA row into its pool; pass the indexer key as index_k)");
    }
    return;
  }
  if (t.q_latent == nullptr || t.q_pe == nullptr || t.q_index == nullptr || t.index_weights == nullptr ||
      t.k_cache_row == nullptr || t.k_pe == nullptr || t.o == nullptr) {
    throw Error("DsaAttention: every DsaTokens pointer (q_latent, q_pe, q_index, index_weights, k_cache_row, k_pe, "
                "o) must be set");
  }
}

SparseAttentionInputs DsaAttention::query_inputs(const DsaTokens& tokens) const {
  SparseAttentionInputs in;
  in.device = device_;
  in.dtype = dtype_;
  in.batch = batch_;
  in.num_qo_heads = config_.num_qo_heads;
  in.num_kv_heads = 1;
  in.live_len = cache_.live_len();
  in.live_lens = cache_.device_live_lens();  // an engine-paged layer's indexer keys: the same positions
  in.q = tokens.q_latent;
  in.q_extra = tokens.q_pe;
  in.scale = config_.scale;
  in.o = tokens.o;
  return in;
}

SparseAttentionInputs DsaAttention::inputs(const DsaTokens& tokens) const {
  SparseAttentionInputs in = query_inputs(tokens);
  RowView latent = cache_.k_rows().value();  // kv_latent: the first latent_dim columns of the K rows
  latent.dim = config_.latent_dim;
  in.k = latent;
  in.v = latent;  // V = the same latent rows
  in.k_extra = cache_.v_rows().value();
  return in;
}

SparseAttentionInputs DsaAttention::engine_inputs(const DsaTokens& tokens, const EnginePagedKV& kv,
                                                  int64_t kv_len) const {
  if (kv.kv_format != KvFormat::kNative && kv.kv_format != KvFormat::kE4m3Mla) {
    throw Error(std::string("DsaAttention (engine-paged): kv.kv_format ") + kv_format_name(kv.kv_format) +
                " is not an MLA row format (native rows or e4m3 mla, the 656-byte FP8 rows)");
  }
  SparseAttentionInputs in = query_inputs(tokens);
  in.live_len = kv_len;
  in.k = kv.k;
  in.v = kv.v;
  in.k_extra = kv.k_extra;
  in.block_table = kv.block_table;
  in.kv_format = kv.kv_format;  // e4m3 mla: dequantized in the kernel (the decode checks the views and the dtype)
  return in;
}

void DsaAttention::reserve(int64_t tokens) {
  cache_.reserve(tokens);
  size_step_buffers();
}

void DsaAttention::append_tokens(const void* k_cache_rows, const void* k_pe, int64_t tokens) {
  if (engine_paged() && (k_cache_rows == nullptr || k_pe != nullptr)) {
    throw Error("DsaAttention::append_tokens (engine-paged): k_cache_rows (the indexer keys) must be set and k_pe null");
  }
  if (!engine_paged() && (k_cache_rows == nullptr || k_pe == nullptr)) {
    throw Error("DsaAttention::append_tokens: k_cache_rows and k_pe must be set");
  }
  cache_.append(k_cache_rows, k_pe, dtype_, tokens);
  size_step_buffers();
}

void DsaAttention::size_step_buffers() {
  const int64_t cap = cache_.capacity();
  if (cap == 0 || cap == sized_capacity_) return;  // nothing to size yet, or sized
  if (positions_.empty()) {
    positions_ = Buffer(device_, static_cast<size_t>(batch_) * config_.index_topk * sizeof(int32_t));
    counts_ = Buffer(device_, static_cast<size_t>(batch_) * sizeof(int32_t));
    std::vector<int32_t> offsets(static_cast<size_t>(batch_) + 1);
    for (size_t b = 0; b < offsets.size(); ++b) offsets[b] = static_cast<int32_t>(b) * config_.index_topk;
    row_offsets_ = upload(device_, offsets);
  }
  if (device_ == Device::kCuda) {
    index_workspace_ = Buffer(device_, std::max<size_t>(256, dsa_indexer_workspace_bytes(config_, batch_, cap)));
  }
  if (!engine_paged()) fallback_.size(device_, inputs(DsaTokens{}), cap);
  sized_capacity_ = cap;
}

void DsaAttention::prefill_token(const DsaTokens& tokens, void* stream) {
  if (engine_paged()) {
    throw Error("DsaAttention::prefill_token: an engine-paged layer has no mask path; the engine prefills and "
                "append_tokens() takes the prompt's indexer keys");
  }
  check_tokens(tokens);
  cache_.reserve(cache_.live_len() + 1);
  size_step_buffers();
  cache_.append_token(tokens.k_cache_row, tokens.k_pe, stream);
  fallback_.run(inputs(tokens), false, stream);
}

void DsaAttention::select_tokens_cpu(const DsaTokens& tokens) {
  const RowView k_rows = cache_.k_rows().value();
  const int64_t kv_len = cache_.live_len();
  std::vector<std::vector<int32_t>> positions;
  if (kv_len <= config_.index_topk) {
    positions.assign(static_cast<size_t>(batch_), std::vector<int32_t>(static_cast<size_t>(kv_len)));
    for (auto& p : positions) std::iota(p.begin(), p.end(), 0);
  } else {
    // The indexer key is the K buffer's columns latent_dim .. latent_dim + index_head_dim.
    const size_t d = static_cast<size_t>(config_.index_head_dim);
    const size_t esize = dtype_size(dtype_);
    std::vector<float> keys(static_cast<size_t>(batch_) * static_cast<size_t>(kv_len) * d);
    for (int32_t b = 0; b < batch_; ++b) {
      for (int64_t t = 0; t < kv_len; ++t) {
        const auto element = static_cast<size_t>(k_rows.offset(b, 0, t) + index_key_column());
        to_float(dtype_, static_cast<const char*>(k_rows.data) + element * esize,
                 &keys[(static_cast<size_t>(b) * static_cast<size_t>(kv_len) + static_cast<size_t>(t)) * d], d);
      }
    }
    std::vector<float> q(static_cast<size_t>(batch_) * config_.index_heads * d);
    to_float(dtype_, tokens.q_index, q.data(), q.size());
    positions = dsa_select_tokens_cpu(config_, batch_, kv_len, q.data(), tokens.index_weights, keys);
  }
  int32_t* out = positions_.as<int32_t>();
  for (int32_t b = 0; b < batch_; ++b) {
    const auto& kept = positions[static_cast<size_t>(b)];
    for (int32_t i = 0; i < config_.index_topk; ++i) {
      out[int64_t{b} * config_.index_topk + i] = i < static_cast<int32_t>(kept.size()) ? kept[static_cast<size_t>(i)] : -1;
    }
    counts_.as<int32_t>()[b] = static_cast<int32_t>(kept.size());
  }
}

PagedSelection DsaAttention::kept_selection(Buffer& positions, Buffer& counts, int32_t requests, int64_t live_len) {
  PagedSelection selection;
  selection.pages = positions.as<int32_t>();
  selection.seq_lens = counts.as<int32_t>();
  selection.num_requests = requests;
  selection.width = config_.index_topk;
  selection.page_size = 1;
  selection.max_selected = std::min<int64_t>(config_.index_topk, live_len);
  return selection;
}

DsaIndexerArgs DsaAttention::indexer_args(const DsaTokens& tokens, Buffer& workspace, Buffer& positions,
                                          Buffer& counts) {
  DsaIndexerArgs args;
  args.dtype = dtype_;
  args.k_cache = cache_.k_rows().value().data;
  args.capacity = cache_.capacity();
  args.kv_lens = cache_.device_live_lens();
  args.max_kv_len = cache_.capacity();
  args.q_index = tokens.q_index;
  args.weights = tokens.index_weights;
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.bytes();
  args.positions = positions.as<int32_t>();
  args.counts = counts.as<int32_t>();
  return args;
}

DsaConfig DsaAttention::indexer_rule() const {
  // The indexer finds its key latent_dim columns into each K row: none in a key-only cache.
  DsaConfig rule = config_;
  rule.latent_dim = index_key_column();
  return rule;
}

void DsaAttention::select_tokens_cuda(const DsaTokens& tokens, void* stream) {
  dsa_select_tokens_cuda(indexer_rule(), batch_, indexer_args(tokens, index_workspace_, positions_, counts_), stream);
}

DsaStep DsaAttention::decode(const DsaTokens& tokens, void* stream) {
  if (engine_paged()) {
    throw Error("DsaAttention::decode: an engine-paged layer reads the engine's pool; call decode(tokens, kv)");
  }
  check_tokens(tokens);
  last_q_len_ = 1;
  cache_.reserve(cache_.live_len() + 1);  // allocates only when the capacity must grow
  size_step_buffers();
  cache_.append_token(tokens.k_cache_row, tokens.k_pe, stream);
  detail::cuda_record_event(after_append_, stream);
  const SparseAttentionInputs in = inputs(tokens);
  DsaStep step;
  step.sparse = in.live_len > config_.index_topk;
  if (device_ == Device::kCuda) {
    select_tokens_cuda(tokens, stream);
  } else {
    select_tokens_cpu(tokens);
  }
  detail::cuda_record_event(after_indexer_, stream);
  have_selection_ = true;
  const PagedSelection selection = kept_selection(positions_, counts_, batch_, in.live_len);
  step.outcome = decoder_.try_fused(in, selection, stream);
  step.fused = step.outcome.fused();
  if (!step.fused) {
    // Entries of -1 past each count fall outside the window and are ignored.
    build_selection_mask(device_, positions_.as<int32_t>(), row_offsets_.as<int32_t>(), batch_, cache_.capacity(),
                         fallback_.mask(), stream);
    fallback_.run(in, true, stream);
  }
  return step;
}

DsaStep DsaAttention::decode(const DsaTokens& tokens, int32_t q_len, void* stream) {
  if (q_len < 1 || q_len > kMaxQueryTokens) {
    throw Error("DsaAttention::decode: q_len = " + std::to_string(q_len) + " must lie in [1, " +
                std::to_string(kMaxQueryTokens) + "]");
  }
  if (q_len == 1) {
    last_q_len_ = 1;
    return decode(tokens, stream);
  }
  if (engine_paged()) {
    throw Error("DsaAttention::decode: multi-token steps read the layer's own cache; an engine-paged layer takes one "
                "token per step (decode(tokens, kv))");
  }
  check_tokens(tokens);
  if (int64_t{batch_} * q_len > 65535) {
    throw Error("DsaAttention::decode: batch * q_len = " + std::to_string(int64_t{batch_} * q_len) +
                " (sequence, token) rows exceed 65535");
  }
  cache_.reserve(cache_.live_len() + q_len);  // allocates only when the capacity must grow
  size_step_buffers();
  size_token_buffers(q_len);
  // Decided before the cache changes, at the length the step will have.
  SparseAttentionInputs in = token_inputs(tokens, q_len);
  in.live_len = cache_.live_len() + q_len;
  PagedSelection shape;
  shape.pages = token_positions_.as<int32_t>();
  shape.seq_lens = token_counts_.as<int32_t>();
  shape.num_requests = batch_ * q_len;
  shape.width = config_.index_topk;
  shape.page_size = 1;
  shape.max_selected = std::min<int64_t>(config_.index_topk, in.live_len);
  if (token_decoder_.decide(in, shape).fused()) return decode_fused_tokens(tokens, q_len, stream);
  return decode_token_by_token(tokens, q_len, stream);
}

// The step's attention inputs with each (sequence, token) a request: the
// tokens fold as the sequence's "KV heads", whose rows are the sequence's
// own (head stride 0), so q [batch, q_len * heads, dim] is the packed
// [batch, q_len, heads, dim] and the window is still per sequence.
SparseAttentionInputs DsaAttention::token_inputs(const DsaTokens& tokens, int32_t q_len) const {
  SparseAttentionInputs in = inputs(tokens);
  in.num_qo_heads = config_.num_qo_heads * q_len;
  in.num_kv_heads = q_len;
  in.k.head_stride = 0;
  in.v.head_stride = 0;
  in.k_extra.head_stride = 0;
  return in;
}

void DsaAttention::size_token_buffers(int32_t q_len) {
  const int64_t cap = cache_.capacity();
  const int64_t rows = int64_t{batch_} * q_len;
  if (q_len > sized_q_len_) {
    token_positions_ = Buffer(device_, static_cast<size_t>(rows) * config_.index_topk * sizeof(int32_t));
    token_counts_ = Buffer(device_, static_cast<size_t>(rows) * sizeof(int32_t));
    sized_q_len_ = q_len;
    token_sized_capacity_ = -1;
  }
  if (device_ == Device::kCuda && cap != token_sized_capacity_) {
    token_index_workspace_ = Buffer(
        device_, std::max<size_t>(256, dsa_indexer_workspace_bytes(config_, batch_ * sized_q_len_, cap)));
  }
  token_sized_capacity_ = cap;
}

DsaStep DsaAttention::decode_fused_tokens(const DsaTokens& tokens, int32_t q_len, void* stream) {
  // k_cache_row and k_pe are [q_len, batch, 1, dim]: the q_len slices in one launch.
  cache_.append_step_tokens(tokens.k_cache_row, tokens.k_pe, q_len, stream);
  detail::cuda_record_event(after_append_, stream);
  const SparseAttentionInputs in = token_inputs(tokens, q_len);
  const int32_t rows = batch_ * q_len;
  DsaStep step;
  step.sparse = in.live_len - (q_len - 1) > config_.index_topk;  // the first token's window exceeds the top-k
  if (device_ == Device::kCuda) {
    DsaIndexerArgs args = indexer_args(tokens, token_index_workspace_, token_positions_, token_counts_);
    args.q_len = q_len;
    dsa_select_tokens_cuda(indexer_rule(), batch_, args, stream);
  } else {
    // Token t of every sequence: the one-token rule over its own window.
    const RowView k_rows = cache_.k_rows().value();
    const size_t d = static_cast<size_t>(config_.index_head_dim), esize_k = dtype_size(dtype_);
    const size_t heads = static_cast<size_t>(config_.index_heads);
    std::vector<float> q_all(static_cast<size_t>(rows) * heads * d);
    to_float(dtype_, tokens.q_index, q_all.data(), q_all.size());
    for (int32_t t = 0; t < q_len; ++t) {
      const int64_t window = in.live_len - (q_len - 1 - t);
      std::vector<std::vector<int32_t>> kept;
      if (window <= config_.index_topk) {
        kept.assign(static_cast<size_t>(batch_), std::vector<int32_t>(static_cast<size_t>(window)));
        for (auto& p : kept) std::iota(p.begin(), p.end(), 0);
      } else {
        std::vector<float> keys(static_cast<size_t>(batch_) * static_cast<size_t>(window) * d);
        std::vector<float> q(static_cast<size_t>(batch_) * heads * d), w(static_cast<size_t>(batch_) * heads);
        for (int32_t b = 0; b < batch_; ++b) {
          for (int64_t pos = 0; pos < window; ++pos) {
            const auto element = static_cast<size_t>(k_rows.offset(b, 0, pos) + config_.latent_dim);
            to_float(dtype_, static_cast<const char*>(k_rows.data) + element * esize_k,
                     &keys[(static_cast<size_t>(b) * static_cast<size_t>(window) + static_cast<size_t>(pos)) * d], d);
          }
          const size_t row = static_cast<size_t>(b) * q_len + static_cast<size_t>(t);
          std::copy(q_all.begin() + static_cast<std::ptrdiff_t>(row * heads * d),
                    q_all.begin() + static_cast<std::ptrdiff_t>((row + 1) * heads * d),
                    q.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(b) * heads * d));
          std::copy(tokens.index_weights + row * heads, tokens.index_weights + (row + 1) * heads,
                    w.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(b) * heads));
        }
        kept = dsa_select_tokens_cpu(config_, batch_, window, q.data(), w.data(), keys);
      }
      for (int32_t b = 0; b < batch_; ++b) {
        const int64_t row = int64_t{b} * q_len + t;
        const auto& k = kept[static_cast<size_t>(b)];
        int32_t* out = token_positions_.as<int32_t>() + row * config_.index_topk;
        for (int32_t i = 0; i < config_.index_topk; ++i) out[i] = i < static_cast<int32_t>(k.size()) ? k[static_cast<size_t>(i)] : -1;
        token_counts_.as<int32_t>()[row] = static_cast<int32_t>(k.size());
      }
    }
  }
  detail::cuda_record_event(after_indexer_, stream);
  have_selection_ = true;
  last_q_len_ = q_len;
  const PagedSelection selection = kept_selection(token_positions_, token_counts_, rows, in.live_len);
  step.outcome = token_decoder_.try_fused(in, selection, stream);
  step.fused = step.outcome.fused();
  if (!step.fused) {  // decided fused above on the same facts; a change here is a bug, never a wrong answer
    throw Error("DsaAttention::decode: the multi-token step was declined after its tokens were appended: " +
                step.outcome.reason);
  }
  return step;
}

DsaStep DsaAttention::decode_token_by_token(const DsaTokens& tokens, int32_t q_len, void* stream) {
  const size_t esize = dtype_size(dtype_);
  const size_t b_count = static_cast<size_t>(batch_), hq = static_cast<size_t>(config_.num_qo_heads);
  const size_t lat = static_cast<size_t>(config_.latent_dim) * esize, rope = static_cast<size_t>(config_.rope_dim) * esize;
  const size_t iq = static_cast<size_t>(config_.index_heads) * config_.index_head_dim * esize;
  const size_t iw = static_cast<size_t>(config_.index_heads) * sizeof(float);
  if (stage_q_.empty()) {
    stage_q_ = Buffer(device_, b_count * hq * lat);
    stage_q_pe_ = Buffer(device_, b_count * hq * rope);
    stage_q_index_ = Buffer(device_, b_count * iq);
    stage_weights_ = Buffer(device_, b_count * iw);
    stage_o_ = Buffer(device_, b_count * hq * lat);
  }
  // The copies below are synchronous, on the default stream: order them after the caller's stream.
  if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
  const size_t k_slice = b_count * (static_cast<size_t>(config_.latent_dim) + config_.index_head_dim) * esize;
  const size_t pe_slice = b_count * rope;
  const auto slice = [&](Buffer& dst, const void* src, size_t row_bytes, int32_t t) {
    copy_2d(dst.data(), device_, row_bytes, static_cast<const char*>(src) + t * row_bytes, device_, q_len * row_bytes,
            row_bytes, b_count);
  };
  DsaStep step;
  for (int32_t t = 0; t < q_len; ++t) {
    slice(stage_q_, tokens.q_latent, hq * lat, t);
    slice(stage_q_pe_, tokens.q_pe, hq * rope, t);
    slice(stage_q_index_, tokens.q_index, iq, t);
    slice(stage_weights_, tokens.index_weights, iw, t);
    DsaTokens one;
    one.q_latent = stage_q_.data();
    one.q_pe = stage_q_pe_.data();
    one.q_index = stage_q_index_.data();
    one.index_weights = stage_weights_.as<float>();
    one.k_cache_row = static_cast<const char*>(tokens.k_cache_row) + t * k_slice;
    one.k_pe = static_cast<const char*>(tokens.k_pe) + t * pe_slice;
    one.o = stage_o_.data();
    step = decode(one, stream);
    if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
    copy_2d(static_cast<char*>(tokens.o) + t * hq * lat, device_, q_len * hq * lat, stage_o_.data(), device_,
            hq * lat, hq * lat, b_count);
  }
  last_q_len_ = 1;
  return step;
}

DsaStep DsaAttention::decode(const DsaTokens& tokens, const EnginePagedKV& kv, void* stream) {
  if (!engine_paged()) {
    throw Error("DsaAttention::decode(tokens, kv): the layer keeps its own cache; construct it with kv_storage = "
                "KVStorage::kEnginePaged to read an engine's pool");
  }
  check_tokens(tokens);
  const int64_t kv_len = cache_.live_len() + 1;  // with this step's token
  cache_.reserve(kv_len);                        // allocates only when the capacity must grow
  size_step_buffers();
  const PagedSelection selection = kept_selection(positions_, counts_, batch_, kv_len);
  // Decided before anything changes: there is no mask path to fall back to.
  const SparseAttentionInputs in = engine_inputs(tokens, kv, kv_len);
  const SparseDecodeOutcome decided = decoder_.require_fused(in, selection, "DsaAttention (engine-paged)");
  cache_.append_token(tokens.index_k, nullptr, stream);
  detail::cuda_record_event(after_append_, stream);
  DsaStep step;
  step.sparse = kv_len > config_.index_topk;
  if (device_ == Device::kCuda) {
    select_tokens_cuda(tokens, stream);
  } else {
    select_tokens_cpu(tokens);
  }
  detail::cuda_record_event(after_indexer_, stream);
  have_selection_ = true;
  step.outcome = decoder_.run_fused(in, selection, decided, stream);
  step.fused = step.outcome.fused();
  return step;
}

std::vector<std::vector<int32_t>> DsaAttention::last_selected_positions() const {
  if (!have_selection_) return {};
  if (last_q_len_ > 1) {  // one row per (sequence, token)
    const int32_t rows = batch_ * last_q_len_;
    const auto flat = download<int32_t>(device_, token_positions_.data(), static_cast<size_t>(rows) * config_.index_topk);
    const auto counts = download<int32_t>(device_, token_counts_.data(), static_cast<size_t>(rows));
    std::vector<std::vector<int32_t>> out(static_cast<size_t>(rows));
    for (int32_t r = 0; r < rows; ++r) {
      const auto first = flat.begin() + int64_t{r} * config_.index_topk;
      out[static_cast<size_t>(r)].assign(first, first + counts[static_cast<size_t>(r)]);
    }
    return out;
  }
  const auto flat = download<int32_t>(device_, positions_.data(), static_cast<size_t>(batch_) * config_.index_topk);
  const auto counts = download<int32_t>(device_, counts_.data(), static_cast<size_t>(batch_));
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(batch_));
  for (int32_t b = 0; b < batch_; ++b) {
    const auto first = flat.begin() + int64_t{b} * config_.index_topk;
    out[static_cast<size_t>(b)].assign(first, first + counts[static_cast<size_t>(b)]);
  }
  return out;
}

std::vector<std::vector<int32_t>> DsaAttention::last_mask_columns() {
  if (!have_selection_) throw Error("DsaAttention::last_mask_columns: no decode has run yet");
  if (engine_paged()) throw Error("DsaAttention::last_mask_columns: an engine-paged layer has no mask path");
  const int64_t kv_len = cache_.live_len();
  // Built on the layer's device from the selection itself, as the mask path builds it.
  build_selection_mask(device_, positions_.as<int32_t>(), row_offsets_.as<int32_t>(), batch_, kv_len,
                       fallback_.mask());
  return mask_kept_columns(device_, fallback_.mask(), batch_, kv_len);
}

}  // namespace sparsepage
