#include "sparsepage/models/dsa.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/cuda_hooks.h"

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

DsaAttention::DsaAttention(Device device, DType dtype, const DsaConfig& config, int32_t batch, DispatchConfig dispatch)
    : device_(device),
      dtype_(dtype),
      config_(config),
      batch_(batch),
      cache_(device, dtype == DType::kF16 ? CacheMode::kF16 : CacheMode::kBF16, batch, 1, 1,
             config.latent_dim + config.index_head_dim, config.rope_dim, config.capacity_step),
      decoder_(device, dispatch),
      mask_path_(device) {
  if (dtype == DType::kF32) throw Error("DsaAttention: the cache stores f16 or bf16");
  if (config.num_qo_heads < 1 || config.latent_dim < 1 || config.rope_dim < 1 || config.index_heads < 1 ||
      config.index_head_dim < 1 || config.index_topk < 1) {
    throw Error("DsaAttention: heads, dims and index_topk must be at least 1");
  }
  if (device == Device::kCuda) {
    detail::check_dsa_indexer_cuda(config, batch);
    // The mask path and the fused path share the MLA tile; without it neither could run.
    if (!cuda_supports_head_dims(config.latent_dim, config.latent_dim, config.rope_dim)) {
      throw Error("DsaAttention on CUDA: no attention kernel for latent_dim " + std::to_string(config.latent_dim) +
                  " with rope_dim " + std::to_string(config.rope_dim) + " (the MLA kernel takes 512 and 64)");
    }
  }
  if (config_.scale == 0.0f) config_.scale = 1.0f / std::sqrt(static_cast<float>(config.latent_dim + config.rope_dim));
}

namespace {
// Every input is checked before the cache changes, so a bad call appends nothing.
void check_tokens(const DsaTokens& t) {
  if (t.q_latent == nullptr || t.q_pe == nullptr || t.q_index == nullptr || t.index_weights == nullptr ||
      t.k_cache_row == nullptr || t.k_pe == nullptr || t.o == nullptr) {
    throw Error("DsaAttention: every DsaTokens pointer (q_latent, q_pe, q_index, index_weights, k_cache_row, k_pe, "
                "o) must be set");
  }
}
}  // namespace

SparseAttentionInputs DsaAttention::inputs(const DsaTokens& tokens) const {
  const RawKVAllocations raw = *cache_.raw_kv_allocations();
  const int64_t cap = raw.k_shape.capacity;
  const int64_t k_stride = config_.latent_dim + config_.index_head_dim;
  SparseAttentionInputs in;
  in.device = device_;
  in.dtype = dtype_;
  in.batch = batch_;
  in.num_qo_heads = config_.num_qo_heads;
  in.num_kv_heads = 1;
  in.live_len = raw.live_len;
  in.k = {raw.k, 1, cap, k_stride, config_.latent_dim};  // kv_latent: the K buffer's first columns
  in.v = {raw.k, 1, cap, k_stride, config_.latent_dim};  // V = the same latent rows
  in.k_extra = {raw.v, 1, cap, config_.rope_dim, config_.rope_dim};
  in.q = tokens.q_latent;
  in.q_extra = tokens.q_pe;
  in.scale = config_.scale;
  in.o = tokens.o;
  return in;
}

void DsaAttention::prefill_token(const DsaTokens& tokens, void* stream) {
  check_tokens(tokens);
  cache_.update_and_fetch(tokens.k_cache_row, tokens.k_pe, dtype_, 1);
  const MaskedDecodeParams m = masked_params(inputs(tokens));  // no mask: the whole causal window
  if (device_ == Device::kCuda) {
    const size_t bytes = masked_decode_workspace_bytes(m, cuda_multiprocessor_count());
    if (prefill_workspace_.bytes() < bytes) prefill_workspace_ = Buffer(device_, bytes);
    run_masked_decode_cuda(m, prefill_workspace_.data(), stream);
  } else {
    run_masked_decode_cpu(m);
  }
}

void DsaAttention::select_tokens_cpu(const DsaTokens& tokens) {
  const RawKVAllocations raw = *cache_.raw_kv_allocations();
  const int64_t kv_len = raw.live_len;
  std::vector<std::vector<int32_t>> positions;
  if (kv_len <= config_.index_topk) {
    positions.assign(static_cast<size_t>(batch_), std::vector<int32_t>(static_cast<size_t>(kv_len)));
    for (auto& p : positions) std::iota(p.begin(), p.end(), 0);
  } else {
    // The indexer key is the K buffer's columns latent_dim .. latent_dim + index_head_dim.
    const size_t d = static_cast<size_t>(config_.index_head_dim);
    const size_t stride = static_cast<size_t>(config_.latent_dim + config_.index_head_dim);
    std::vector<float> keys(static_cast<size_t>(batch_) * static_cast<size_t>(kv_len) * d);
    for (int32_t b = 0; b < batch_; ++b) {
      for (int64_t t = 0; t < kv_len; ++t) {
        const size_t row = static_cast<size_t>(int64_t{b} * raw.k_shape.capacity + t);
        to_float(dtype_, static_cast<const char*>(raw.k) + (row * stride + static_cast<size_t>(config_.latent_dim)) * 2,
                 &keys[(static_cast<size_t>(b) * static_cast<size_t>(kv_len) + static_cast<size_t>(t)) * d], d);
      }
    }
    std::vector<float> q(static_cast<size_t>(batch_) * config_.index_heads * d);
    to_float(dtype_, tokens.q_index, q.data(), q.size());
    positions = dsa_select_tokens_cpu(config_, batch_, kv_len, q.data(), tokens.index_weights, keys);
  }
  selection_ = make_selection(device_, positions);
}

void DsaAttention::select_tokens_cuda(const DsaTokens& tokens, void* stream) {
  const RawKVAllocations raw = *cache_.raw_kv_allocations();
  const int64_t kv_len = raw.live_len;
  if (kv_len <= config_.index_topk) {
    // The window fits the top-k: every position, packed per sequence.
    selection_ = make_selection(device_, std::vector<std::vector<int32_t>>(
                                             static_cast<size_t>(batch_), [&] {
                                               std::vector<int32_t> all(static_cast<size_t>(kv_len));
                                               std::iota(all.begin(), all.end(), 0);
                                               return all;
                                             }()));
    return;
  }
  // Sized for the whole allocation, so a decode step allocates only when the
  // cache grows. Every sequence keeps index_topk positions: the indexer's row
  // width, so its output is the selection's packed indices as they stand.
  const size_t ws = dsa_indexer_workspace_bytes(config_, batch_, raw.k_shape.capacity);
  if (index_workspace_.bytes() < ws) index_workspace_ = Buffer(device_, ws);
  const size_t lens_bytes = static_cast<size_t>(batch_) * sizeof(int32_t);
  if (kv_lens_.bytes() < lens_bytes) kv_lens_ = Buffer(device_, lens_bytes);
  if (counts_.bytes() < lens_bytes) counts_ = Buffer(device_, lens_bytes);
  const std::vector<int32_t> lens(static_cast<size_t>(batch_), static_cast<int32_t>(kv_len));
  copy_bytes(kv_lens_.data(), device_, lens.data(), Device::kCpu, lens_bytes);
  const size_t index_bytes = static_cast<size_t>(batch_) * static_cast<size_t>(config_.index_topk) * sizeof(int32_t);
  if (selection_.indices.bytes() != index_bytes) selection_.indices = Buffer(device_, index_bytes);
  selection_.counts.assign(static_cast<size_t>(batch_), config_.index_topk);
  DsaIndexerArgs args;
  args.dtype = dtype_;
  args.k_cache = raw.k;
  args.capacity = raw.k_shape.capacity;
  args.kv_lens = kv_lens_.as<int32_t>();
  args.max_kv_len = raw.k_shape.capacity;
  args.q_index = tokens.q_index;
  args.weights = tokens.index_weights;
  args.workspace = index_workspace_.data();
  args.workspace_bytes = index_workspace_.bytes();
  args.positions = selection_.indices.as<int32_t>();
  args.counts = counts_.as<int32_t>();
  dsa_select_tokens_cuda(config_, batch_, args, stream);
}

DsaStep DsaAttention::decode(const DsaTokens& tokens, void* stream) {
  check_tokens(tokens);
  cache_.update_and_fetch(tokens.k_cache_row, tokens.k_pe, dtype_, 1);
  const SparseAttentionInputs in = inputs(tokens);
  DsaStep step;
  step.sparse = in.live_len > config_.index_topk;
  if (device_ == Device::kCuda) {
    select_tokens_cuda(tokens, stream);
  } else {
    select_tokens_cpu(tokens);
  }
  step.outcome = decoder_.try_fused(in, selection_, stream);
  step.fused = step.outcome.fused();
  if (!step.fused) {
    mask_path_.prepare(in, selection_);
    mask_path_.run(in, selection_, stream);
  }
  return step;
}

std::vector<std::vector<int32_t>> DsaAttention::last_mask_columns() const {
  if (selection_.num_requests() != batch_) throw Error("DsaAttention::last_mask_columns: no decode has run yet");
  const int64_t kv_len = cache_.live_len();
  const size_t cells = static_cast<size_t>(batch_) * static_cast<size_t>(kv_len);
  // Built on the layer's device from the selection itself, as the mask path builds it.
  const Buffer offsets = upload(device_, selection_.offsets());
  Buffer mask(device_, cells * sizeof(float));
  build_selection_mask(device_, selection_.indices.as<int32_t>(), offsets.as<int32_t>(), batch_, kv_len,
                       mask.as<float>());
  return mask_kept_columns(device_, mask.as<float>(), batch_, kv_len);
}

}  // namespace sparsepage
