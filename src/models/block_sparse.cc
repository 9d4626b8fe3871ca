#include "sparsepage/models/block_sparse.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/cuda_hooks.h"
#include "cpu/dot.h"
#include "cpu/parallel.h"
#include "models/block_sparse_kernels.h"
#include "models/kept_blocks.h"

namespace sparsepage {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

int32_t blocks_per_request(const BlockSparseConfig& c, int64_t kv_len) {
  const int64_t num_blocks = (kv_len + c.block_size - 1) / c.block_size;
  return static_cast<int32_t>(std::min<int64_t>(c.topk_blocks, num_blocks - 1) + 1);
}

// The additive mask of a block list: 0 at the live positions of each listed
// block (entries of -1 are unused), -inf elsewhere; rows `pitch` apart.
void block_mask_cpu(const int32_t* blocks, int32_t requests, int32_t num_kv_heads, int32_t width,
                    int32_t block_size, const int32_t* kv_lens, int64_t pitch, float* mask) {
  std::fill(mask, mask + int64_t{requests} * pitch, -kInf);
  for (int32_t r = 0; r < requests; ++r) {
    const int64_t kv_len = kv_lens[r / num_kv_heads];
    for (int32_t i = 0; i < width; ++i) {
      const int32_t block = blocks[int64_t{r} * width + i];
      if (block < 0) continue;
      const int64_t first = int64_t{block} * block_size;
      for (int64_t t = first; t < std::min<int64_t>(first + block_size, kv_len); ++t) mask[r * pitch + t] = 0.0f;
    }
  }
}

}  // namespace

namespace {

// The indexer rule on the host: max-pooled block scores (parallel over
// sequences and blocks, each key row read once for all KV heads), then per
// request the top-k by a stable sort (ties to the lower block id) and the
// final block. `key_row(b, t, out)` writes position t's index key as floats.
// A multi-token step (q_len > 1, index_q [batch, q_len, heads, dim]) scores
// a block by the max over every token's query and force-keeps the block of
// the first new token as well (models/block_sparse.h).
template <class KeyRow>
std::vector<int32_t> top_blocks_cpu(const BlockSparseConfig& c, int32_t batch, int64_t kv_len, const float* index_q,
                                    KeyRow&& key_row, int32_t q_len = 1) {
  const int64_t num_blocks = (kv_len + c.block_size - 1) / c.block_size;
  const int32_t per_request = blocks_per_request(c, kv_len);
  const int64_t scored = num_blocks - 1;  // the final block is appended, not scored
  const int32_t heads = c.num_kv_heads;
  const size_t d = static_cast<size_t>(c.head_dim);
  const int64_t forced = std::min<int64_t>(num_blocks - c.local_blocks, std::max<int64_t>(kv_len - q_len, 0) / c.block_size);
  // score[(b * heads + h) * scored + j]
  std::vector<float> score(static_cast<size_t>(int64_t{batch} * heads * scored));
  cpu::parallel_for(int64_t{batch} * scored, [&](int64_t item) {
    const int32_t b = static_cast<int32_t>(item / scored);
    const int64_t j = item % scored;
    std::vector<float> key(d), best(static_cast<size_t>(heads), -kInf);
    for (int64_t t = j * c.block_size; t < (j + 1) * c.block_size; ++t) {
      key_row(b, t, key.data());
      for (int32_t token = 0; token < q_len; ++token) {
        for (int32_t h = 0; h < heads; ++h) {
          const float* q = index_q + ((int64_t{b} * q_len + token) * heads + h) * c.head_dim;
          best[static_cast<size_t>(h)] = std::max(best[static_cast<size_t>(h)], cpu::dot(q, key.data(), d));
        }
      }
    }
    for (int32_t h = 0; h < heads; ++h) {
      // Local force-keep: the last local_blocks - 1 full blocks before the
      // final one (and the first new token's block in a multi-token step).
      score[static_cast<size_t>((int64_t{b} * heads + h) * scored + j)] =
          j >= forced ? kInf : best[static_cast<size_t>(h)];
    }
  });
  std::vector<int32_t> out;
  std::vector<int32_t> order(static_cast<size_t>(scored));
  for (int64_t r = 0; r < int64_t{batch} * heads; ++r) {
    const float* s = &score[static_cast<size_t>(r * scored)];
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return s[x] > s[y]; });
    out.insert(out.end(), order.begin(), order.begin() + (per_request - 1));
    out.push_back(static_cast<int32_t>(num_blocks - 1));
  }
  return out;
}

}  // namespace

std::vector<int32_t> select_top_blocks_cpu(const BlockSparseConfig& c, int32_t batch, int64_t kv_len,
                                           const float* index_q, const std::vector<float>& index_k) {
  if (batch < 1 || kv_len < 1 || c.block_size < 1 || c.head_dim < 1 || c.num_kv_heads < 1 || c.topk_blocks < 0 ||
      c.local_blocks < 1 || index_q == nullptr ||
      static_cast<int64_t>(index_k.size()) != int64_t{batch} * kv_len * c.head_dim) {
    throw Error("select_top_blocks_cpu: need batch, kv_len, block_size, head_dim, num_kv_heads, local_blocks >= 1, "
                "topk_blocks >= 0, index_q, and index_k of batch * kv_len * head_dim = " +
                std::to_string(int64_t{batch} * kv_len * c.head_dim) + " floats (got " +
                std::to_string(index_k.size()) + ")");
  }
  const int64_t d = c.head_dim;
  return top_blocks_cpu(c, batch, kv_len, index_q, [&](int32_t b, int64_t t, float* out) {
    const float* k = &index_k[static_cast<size_t>((int64_t{b} * kv_len + t) * d)];
    std::copy(k, k + d, out);
  });
}

namespace {
// The layer's configuration, checked before anything is allocated.
const BlockSparseConfig& checked_config(DType dtype, const BlockSparseConfig& config, int32_t batch) {
  if (dtype == DType::kF32) throw Error("BlockSparseAttention: the cache stores f16 or bf16");
  if (batch < 1) throw Error("BlockSparseAttention: batch = " + std::to_string(batch) + " must be at least 1");
  if (config.num_kv_heads < 1 || config.num_qo_heads < 1 || config.num_qo_heads % config.num_kv_heads != 0 ||
      config.block_size < 1 || config.topk_blocks < 1 || config.local_blocks < 1 ||
      config.local_blocks - 1 > config.topk_blocks || config.head_dim < 1) {
    throw Error("BlockSparseAttention: need num_qo_heads a positive multiple of num_kv_heads, head_dim, block_size, "
                "topk_blocks and local_blocks >= 1, and local_blocks - 1 <= topk_blocks (forced blocks must fit "
                "the top-k)");
  }
  if (int64_t{config.topk_blocks + 1} * config.block_size > INT32_MAX / 2) {
    throw Error("BlockSparseAttention: (topk_blocks + 1) * block_size must stay below 2^30 tokens");
  }
  if (config.kv_storage != KVStorage::kLayerCache && config.kv_storage != KVStorage::kEnginePaged) {
    throw Error("BlockSparseAttention: kv_storage is not a KVStorage value");
  }
  if (config.kv_storage == KVStorage::kEnginePaged && config.token_pages) {
    throw Error("BlockSparseAttention: token_pages is a layer-cache measurement mode; an engine-paged layer attends "
                "block-granular pages");
  }
  return config;
}
}  // namespace

BlockSparseAttention::BlockSparseAttention(Device device, DType dtype, const BlockSparseConfig& config, int32_t batch,
                                           DispatchConfig dispatch)
    : device_(device),
      dtype_(dtype),
      config_(checked_config(dtype, config, batch)),
      batch_(batch),
      // Engine-paged: the engine's pool holds K and V, the layer only the index keys.
      cache_(device, dtype == DType::kF16 ? CacheMode::kF16 : CacheMode::kBF16, batch,
             config.kv_storage == KVStorage::kEnginePaged ? 1 : config.num_kv_heads + 1,
             config.kv_storage == KVStorage::kEnginePaged ? 0 : config.num_kv_heads, config.head_dim,
             config.head_dim, config.capacity_step),
      // No mask path behind an engine's pool: only what the fused path cannot do declines.
      decoder_(device, config.kv_storage == KVStorage::kEnginePaged ? dispatch.without_performance_gates() : dispatch) {}

int64_t BlockSparseAttention::selected_tokens(int64_t kv_len) const {
  const int64_t num_blocks = (kv_len + config_.block_size - 1) / config_.block_size;
  return int64_t{blocks_per_request(config_, kv_len) - 1} * config_.block_size +
         (kv_len - (num_blocks - 1) * config_.block_size);
}

void BlockSparseAttention::check_tokens(const BlockSparseTokens& t) const {
  if (engine_paged()) {
    if (t.q == nullptr || t.index_q == nullptr || t.index_k == nullptr || t.o == nullptr) {
      throw Error("BlockSparseAttention (engine-paged): q, index_q, index_k and o must be set");
    }
    if (t.k != nullptr || t.v != nullptr) {
      throw Error("BlockSparseAttention (engine-paged): k and v must be null (the engine writes the token's rows "
                  "into its pool; pass the index key as index_k)");
    }
    return;
  }
  if (t.q == nullptr || t.index_q == nullptr || t.k == nullptr || t.v == nullptr || t.o == nullptr) {
    throw Error("BlockSparseAttention: every BlockSparseTokens pointer (q, index_q, k, v, o) must be set");
  }
}

SparseAttentionInputs BlockSparseAttention::query_inputs(const BlockSparseTokens& tokens) const {
  SparseAttentionInputs in;
  in.device = device_;
  in.dtype = dtype_;
  in.batch = batch_;
  in.num_qo_heads = config_.num_qo_heads;
  in.num_kv_heads = config_.num_kv_heads;
  in.live_len = cache_.live_len();
  in.live_lens = cache_.device_live_lens();  // an engine-paged layer's index keys: the same positions
  in.q = tokens.q;
  in.scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
  in.o = tokens.o;
  return in;
}

SparseAttentionInputs BlockSparseAttention::inputs(const BlockSparseTokens& tokens) const {
  SparseAttentionInputs in = query_inputs(tokens);
  // K carries the index key at head num_kv_heads: its own sequence stride.
  in.k = cache_.k_rows().value();
  in.v = cache_.v_rows().value();
  return in;
}

void BlockSparseAttention::reserve(int64_t tokens) {
  cache_.reserve(tokens);
  size_step_buffers();
}

SparseAttentionInputs BlockSparseAttention::engine_inputs(const BlockSparseTokens& tokens, const EnginePagedKV& kv,
                                                          int64_t kv_len) const {
  if (kv.kv_format != KvFormat::kNative) {
    throw Error(std::string("BlockSparseAttention (engine-paged): kv.kv_format ") + kv_format_name(kv.kv_format) +
                " is not supported; the layer reads native K/V rows of its dtype");
  }
  SparseAttentionInputs in = query_inputs(tokens);
  in.live_len = kv_len;
  in.k = kv.k;
  in.v = kv.v;
  in.block_table = kv.block_table;
  return in;
}

void BlockSparseAttention::append_tokens(const void* k, const void* v, int64_t tokens) {
  if (engine_paged()) {
    if (k == nullptr || v != nullptr) {
      throw Error("BlockSparseAttention::append_tokens (engine-paged): k (the index keys) must be set and v null");
    }
    cache_.append(k, nullptr, dtype_, tokens);
    size_step_buffers();
    return;
  }
  if (k == nullptr || v == nullptr) throw Error("BlockSparseAttention::append_tokens: k and v must be set");
  cache_.append(k, v, dtype_, tokens);
  size_step_buffers();
}

void BlockSparseAttention::size_step_buffers() {
  const int64_t cap = cache_.capacity();
  if (cap == 0 || cap == sized_capacity_) return;  // nothing to size yet, or sized
  const int32_t requests = num_requests();
  if (block_ids_.empty()) {
    block_ids_ = Buffer(device_, static_cast<size_t>(requests) * max_width() * sizeof(int32_t));
    seq_lens_ = Buffer(device_, static_cast<size_t>(requests) * sizeof(int32_t));
    if (config_.token_pages) {
      token_pages_ = Buffer(device_, static_cast<size_t>(requests) * width() * config_.block_size * sizeof(int32_t));
    }
  }
  if (device_ == Device::kCuda) {
    indexer_workspace_ = Buffer(
        device_, std::max<size_t>(256, detail::block_indexer_workspace_bytes(batch_, config_.num_kv_heads, cap,
                                                                            config_.block_size)));
  }
  if (!engine_paged()) fallback_.size(device_, inputs(BlockSparseTokens{}), cap);
  sized_capacity_ = cap;
}

void BlockSparseAttention::prefill_token(const BlockSparseTokens& tokens, void* stream) {
  if (engine_paged()) {
    throw Error("BlockSparseAttention::prefill_token: an engine-paged layer has no mask path; the engine prefills "
                "and append_tokens() takes the prompt's index keys");
  }
  check_tokens(tokens);
  cache_.reserve(cache_.live_len() + 1);
  size_step_buffers();
  cache_.append_token(tokens.k, tokens.v, stream);
  fallback_.run(inputs(tokens), false, stream);
}

void BlockSparseAttention::select_blocks(const BlockSparseTokens& tokens, int32_t topk, int32_t width, void* stream,
                                         int32_t q_len) {
  const RowView k_rows = cache_.k_rows().value();
  // The index key: head num_kv_heads of the K allocation, or the engine-paged layer's key-only cache.
  const int32_t key_head = engine_paged() ? 0 : config_.num_kv_heads;
  BlockSparseConfig rule = config_;
  rule.topk_blocks = topk;
  selection_width_ = width;
  if (device_ == Device::kCuda) {
    detail::BlockIndexerArgs args;
    args.dtype = dtype_;
    if (engine_paged()) {
      args.index_keys = k_rows.data;
      args.key_seq_stride = k_rows.seq_stride;
    } else {
      args.k_alloc = k_rows.data;
    }
    args.index_q = tokens.index_q;
    args.q_len = q_len;
    args.batch = batch_;
    args.num_kv_heads = config_.num_kv_heads;
    args.head_dim = config_.head_dim;
    args.capacity = cache_.capacity();
    args.kv_lens = cache_.device_live_lens();
    args.max_kv_len = cache_.capacity();
    args.block_size = config_.block_size;
    args.topk = topk;
    args.local_blocks = config_.local_blocks;
    args.width = width;
    args.block_ids = block_ids_.as<int32_t>();
    args.seq_lens = seq_lens_.as<int32_t>();
    args.workspace = indexer_workspace_.data();
    args.workspace_bytes = indexer_workspace_.bytes();
    detail::block_indexer_cuda(args, stream);
    return;
  }
  // Host: the index keys read in place.
  const int64_t kv_len = cache_.live_len();
  const size_t d = static_cast<size_t>(config_.head_dim);
  const size_t esize = dtype_size(dtype_);
  std::vector<float> q(static_cast<size_t>(num_requests()) * static_cast<size_t>(q_len) * d);
  to_float(dtype_, tokens.index_q, q.data(), q.size());
  const std::vector<int32_t> ids = top_blocks_cpu(
      rule, batch_, kv_len, q.data(),
      [&](int32_t b, int64_t t, float* out) {
        const int64_t element = k_rows.offset(b, key_head, t);
        to_float(dtype_, static_cast<const char*>(k_rows.data) + static_cast<size_t>(element) * esize, out, d);
      },
      q_len);
  const int32_t per = blocks_per_request(rule, kv_len);
  const int64_t num_blocks = (kv_len + config_.block_size - 1) / config_.block_size;
  const int64_t covered = int64_t{per - 1} * config_.block_size + (kv_len - (num_blocks - 1) * config_.block_size);
  int32_t* out = block_ids_.as<int32_t>();
  for (int32_t r = 0; r < num_requests(); ++r) {
    for (int32_t i = 0; i < width; ++i) {
      out[int64_t{r} * width + i] = i < per ? ids[static_cast<size_t>(r) * per + i] : -1;
    }
    seq_lens_.as<int32_t>()[r] = static_cast<int32_t>(covered);
  }
}

BlockSparseStep BlockSparseAttention::decode(const BlockSparseTokens& tokens, void* stream) {
  if (engine_paged()) {
    throw Error("BlockSparseAttention::decode: an engine-paged layer reads the engine's pool; call "
                "decode(tokens, kv)");
  }
  check_tokens(tokens);
  cache_.reserve(cache_.live_len() + 1);  // allocates only when the capacity must grow
  size_step_buffers();
  cache_.append_token(tokens.k, tokens.v, stream);
  detail::cuda_record_event(after_append_, stream);
  const SparseAttentionInputs in = inputs(tokens);
  BlockSparseStep step;
  step.sparse_regime = config_.sparse_regime(in.live_len);
  if (!step.sparse_regime) {
    fallback_.run(in, false, stream);
    return step;
  }
  select_blocks(tokens, config_.topk_blocks, width(), stream);
  detail::cuda_record_event(after_indexer_, stream);
  have_selection_ = true;
  const PagedSelection selection = kept_selection(width(), selected_tokens(in.live_len), stream);
  step.outcome = decoder_.try_fused(in, selection, stream);
  step.fused = step.outcome.fused();
  if (!step.fused) {
    build_block_mask(stream);
    fallback_.run(in, true, stream);
  }
  return step;
}

BlockSparseStep BlockSparseAttention::decode(const BlockSparseTokens& tokens, int32_t q_len, void* stream) {
  if (q_len < 1 || q_len > kMaxQueryTokens) {
    throw Error("BlockSparseAttention::decode: q_len = " + std::to_string(q_len) + " must lie in [1, " +
                std::to_string(kMaxQueryTokens) + "]");
  }
  if (q_len == 1) return decode(tokens, stream);
  if (engine_paged()) {
    throw Error("BlockSparseAttention::decode: multi-token steps read the layer's own cache; an engine-paged layer "
                "takes one token per step (decode(tokens, kv))");
  }
  check_tokens(tokens);
  if (device_ == Device::kCuda && int64_t{q_len} * config_.num_kv_heads > 32) {
    throw Error("BlockSparseAttention::decode: q_len * num_kv_heads = " + std::to_string(q_len) + " * " +
                std::to_string(config_.num_kv_heads) + " exceeds the CUDA indexer's 32 (token, head) index queries");
  }
  cache_.reserve(cache_.live_len() + q_len);  // allocates only when the capacity must grow
  size_step_buffers();
  // Decided before the cache changes, at the length the step will have: a
  // declined step runs token by token instead.
  const int64_t live_after = cache_.live_len() + q_len;
  SparseAttentionInputs in = inputs(tokens);
  in.live_len = live_after;
  in.q_len = q_len;
  PagedSelection shape;
  shape.pages = block_ids_.as<int32_t>();
  shape.seq_lens = seq_lens_.as<int32_t>();
  shape.num_requests = num_requests();
  shape.width = config_.token_pages ? width() * config_.block_size : width();
  shape.page_size = config_.token_pages ? 1 : config_.block_size;
  shape.max_selected = selected_tokens(live_after);
  if (config_.sparse_regime(live_after) && decoder_.decide(in, shape).fused()) {
    return decode_fused_tokens(tokens, q_len, stream);
  }
  return decode_token_by_token(tokens, q_len, stream);
}

BlockSparseStep BlockSparseAttention::decode_fused_tokens(const BlockSparseTokens& tokens, int32_t q_len,
                                                          void* stream) {
  // tokens.k and tokens.v are [q_len, batch, heads, dim]: the q_len slices in one launch.
  cache_.append_step_tokens(tokens.k, tokens.v, q_len, stream);
  detail::cuda_record_event(after_append_, stream);
  SparseAttentionInputs in = inputs(tokens);
  in.q_len = q_len;
  BlockSparseStep step;
  step.sparse_regime = true;
  select_blocks(tokens, config_.topk_blocks, width(), stream, q_len);
  detail::cuda_record_event(after_indexer_, stream);
  have_selection_ = true;
  const PagedSelection selection = kept_selection(width(), selected_tokens(in.live_len), stream);
  step.outcome = decoder_.try_fused(in, selection, stream);
  step.fused = step.outcome.fused();
  if (!step.fused) {  // decided fused above on the same facts; a change here is a bug, never a wrong answer
    throw Error("BlockSparseAttention::decode: the multi-token step was declined after its tokens were appended: " +
                step.outcome.reason);
  }
  return step;
}

BlockSparseStep BlockSparseAttention::decode_token_by_token(const BlockSparseTokens& tokens, int32_t q_len,
                                                            void* stream) {
  const size_t esize = dtype_size(dtype_);
  const size_t d = static_cast<size_t>(config_.head_dim) * esize;  // bytes per head row
  const size_t hq = static_cast<size_t>(config_.num_qo_heads), hkv = static_cast<size_t>(config_.num_kv_heads);
  if (stage_q_.empty()) {
    stage_q_ = Buffer(device_, static_cast<size_t>(batch_) * hq * d);
    stage_index_q_ = Buffer(device_, static_cast<size_t>(batch_) * hkv * d);
    stage_o_ = Buffer(device_, static_cast<size_t>(batch_) * hq * d);
  }
  // The copies below are synchronous, on the default stream: order them after the caller's stream.
  if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
  BlockSparseStep step;
  for (int32_t t = 0; t < q_len; ++t) {
    // Token t's rows of each sequence: [batch, heads, dim] from [batch, q_len, heads, dim].
    copy_2d(stage_q_.data(), device_, hq * d, static_cast<const char*>(tokens.q) + t * hq * d, device_,
            q_len * hq * d, hq * d, static_cast<size_t>(batch_));
    copy_2d(stage_index_q_.data(), device_, hkv * d, static_cast<const char*>(tokens.index_q) + t * hkv * d,
            device_, q_len * hkv * d, hkv * d, static_cast<size_t>(batch_));
    BlockSparseTokens one;
    one.q = stage_q_.data();
    one.index_q = stage_index_q_.data();
    one.k = static_cast<const char*>(tokens.k) + t * static_cast<size_t>(batch_) * (hkv + 1) * d;
    one.v = static_cast<const char*>(tokens.v) + t * static_cast<size_t>(batch_) * hkv * d;
    one.o = stage_o_.data();
    step = decode(one, stream);
    if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
    copy_2d(static_cast<char*>(tokens.o) + t * hq * d, device_, q_len * hq * d, stage_o_.data(), device_, hq * d,
            hq * d, static_cast<size_t>(batch_));
  }
  return step;
}

PagedSelection BlockSparseAttention::kept_selection(int32_t width, int64_t max_selected, void* stream) {
  PagedSelection selection;
  selection.pages = block_ids_.as<int32_t>();
  selection.seq_lens = seq_lens_.as<int32_t>();
  selection.num_requests = num_requests();
  selection.width = width;
  selection.page_size = config_.block_size;
  if (config_.token_pages) {  // measurement mode: the blocks expanded to positions
    expand_token_pages(stream);
    selection.pages = token_pages_.as<int32_t>();
    selection.width = width * config_.block_size;
    selection.page_size = 1;
  }
  selection.max_selected = max_selected;
  return selection;
}

BlockSparseStep BlockSparseAttention::decode(const BlockSparseTokens& tokens, const EnginePagedKV& kv, void* stream) {
  if (!engine_paged()) {
    throw Error("BlockSparseAttention::decode(tokens, kv): the layer keeps its own cache; construct it with "
                "kv_storage = KVStorage::kEnginePaged to read an engine's pool");
  }
  check_tokens(tokens);
  const int64_t kv_len = cache_.live_len() + 1;  // with this step's token
  cache_.reserve(kv_len);                        // allocates only when the capacity must grow
  size_step_buffers();
  BlockSparseStep step;
  step.sparse_regime = config_.sparse_regime(kv_len);
  // The dense regime keeps every block: top-k over all of them.
  const int32_t topk = step.sparse_regime ? config_.topk_blocks : max_width() - 1;
  const int32_t width = topk + 1;
  // (token_pages is refused for these layers: the selection is the block matrix itself.)
  const PagedSelection selection =
      kept_selection(width, step.sparse_regime ? selected_tokens(kv_len) : kv_len, stream);
  // Decided before anything changes: there is no mask path to fall back to.
  const SparseAttentionInputs in = engine_inputs(tokens, kv, kv_len);
  const SparseDecodeOutcome decided = decoder_.require_fused(in, selection, "BlockSparseAttention (engine-paged)");
  cache_.append_token(tokens.index_k, nullptr, stream);
  detail::cuda_record_event(after_append_, stream);
  select_blocks(tokens, topk, width, stream);
  detail::cuda_record_event(after_indexer_, stream);
  have_selection_ = true;
  step.outcome = decoder_.run_fused(in, selection, decided, stream);
  step.fused = step.outcome.fused();
  return step;
}

// The additive mask of the kept blocks over the capacity, positions past
// each sequence's device-side length excluded: what the mask path attends.
void BlockSparseAttention::build_block_mask(void* stream) {
  if (device_ == Device::kCuda) {
    detail::block_mask_cuda(block_ids_.as<int32_t>(), batch_, config_.num_kv_heads, width(), config_.block_size,
                            cache_.device_live_lens(), fallback_.capacity(), fallback_.mask(), stream);
  } else {
    block_mask_cpu(block_ids_.as<int32_t>(), num_requests(), config_.num_kv_heads, width(), config_.block_size,
                   cache_.device_live_lens(), fallback_.capacity(), fallback_.mask());
  }
}

void BlockSparseAttention::expand_token_pages(void* stream) {
  if (device_ == Device::kCuda) {
    detail::expand_block_pages_cuda(block_ids_.as<int32_t>(), num_requests(), width(), config_.block_size,
                                    token_pages_.as<int32_t>(), stream);
    return;
  }
  const int32_t* ids = block_ids_.as<int32_t>();
  int32_t* out = token_pages_.as<int32_t>();
  const int64_t total = int64_t{width()} * config_.block_size;
  for (int64_t r = 0; r < num_requests(); ++r) {
    for (int64_t i = 0; i < total; ++i) {
      const int32_t block = ids[r * width() + i / config_.block_size];
      out[r * total + i] = block < 0 ? -1 : static_cast<int32_t>(block * config_.block_size + i % config_.block_size);
    }
  }
}

std::vector<std::vector<int32_t>> BlockSparseAttention::last_blocks() const {
  if (!have_selection_) return {};
  return detail::download_kept_blocks(device_, block_ids_.data(), num_requests(), selection_width_);
}

std::vector<std::vector<int32_t>> BlockSparseAttention::last_selected_positions() const {
  if (!have_selection_) return {};
  return detail::kept_block_positions(device_, last_blocks(), seq_lens_.data(), config_.block_size);
}

std::vector<std::vector<int32_t>> BlockSparseAttention::last_mask_columns() {
  if (!have_selection_) throw Error("BlockSparseAttention::last_mask_columns: no sparse decode has run yet");
  if (engine_paged()) throw Error("BlockSparseAttention::last_mask_columns: an engine-paged layer has no mask path");
  build_block_mask(nullptr);
  return mask_kept_columns(device_, fallback_.mask(), num_requests(), fallback_.capacity());
}

}  // namespace sparsepage
