#include "sparsepage/models/block_sparse.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/cuda_hooks.h"

namespace sparsepage {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

int32_t blocks_per_request(const BlockSparseConfig& c, int64_t kv_len) {
  const int64_t num_blocks = (kv_len + c.block_size - 1) / c.block_size;
  return static_cast<int32_t>(std::min<int64_t>(c.topk_blocks, num_blocks - 1) + 1);
}

void block_mask_cpu(const int32_t* blocks, int32_t requests, int32_t per_request, int32_t block_size, int64_t kv_len,
                    float* mask) {
  std::fill(mask, mask + int64_t{requests} * kv_len, -kInf);
  for (int32_t r = 0; r < requests; ++r) {
    for (int32_t i = 0; i < per_request; ++i) {
      const int64_t first = int64_t{blocks[r * per_request + i]} * block_size;
      for (int64_t t = first; t < std::min<int64_t>(first + block_size, kv_len); ++t) mask[r * kv_len + t] = 0.0f;
    }
  }
}

}  // namespace

std::vector<int32_t> select_top_blocks_cpu(const BlockSparseConfig& c, int32_t batch, int64_t kv_len,
                                           const float* index_q, const std::vector<float>& index_k) {
  if (batch < 1 || kv_len < 1 || c.block_size < 1 || c.head_dim < 1 || c.num_kv_heads < 1 || index_q == nullptr ||
      static_cast<int64_t>(index_k.size()) != int64_t{batch} * kv_len * c.head_dim) {
    throw Error("select_top_blocks_cpu: need batch, kv_len, block_size, head_dim >= 1, index_q, and index_k of "
                "batch * kv_len * head_dim = " + std::to_string(int64_t{batch} * kv_len * c.head_dim) +
                " floats (got " + std::to_string(index_k.size()) + ")");
  }
  const int64_t num_blocks = (kv_len + c.block_size - 1) / c.block_size;
  const int32_t per_request = blocks_per_request(c, kv_len);
  const int64_t scored = num_blocks - 1;  // the final block is appended, not scored
  std::vector<int32_t> out;
  std::vector<float> score(static_cast<size_t>(scored));
  std::vector<int32_t> order(static_cast<size_t>(scored));
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t h = 0; h < c.num_kv_heads; ++h) {
      const float* q = index_q + (int64_t{b} * c.num_kv_heads + h) * c.head_dim;
      for (int64_t j = 0; j < scored; ++j) {
        float best = -kInf;
        for (int64_t t = j * c.block_size; t < (j + 1) * c.block_size; ++t) {
          const float* k = &index_k[static_cast<size_t>((int64_t{b} * kv_len + t) * c.head_dim)];
          float dot = 0.0f;
          for (int32_t d = 0; d < c.head_dim; ++d) dot += q[d] * k[d];
          best = std::max(best, dot);
        }
        // Local force-keep: the last local_blocks - 1 full blocks before the final one.
        score[static_cast<size_t>(j)] = j >= num_blocks - c.local_blocks ? kInf : best;
      }
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t x, int32_t y) { return score[static_cast<size_t>(x)] > score[static_cast<size_t>(y)]; });
      out.insert(out.end(), order.begin(), order.begin() + (per_request - 1));
      out.push_back(static_cast<int32_t>(num_blocks - 1));
    }
  }
  return out;
}

BlockSparseAttention::BlockSparseAttention(Device device, DType dtype, const BlockSparseConfig& config, int32_t batch,
                                           DispatchConfig dispatch)
    : device_(device),
      dtype_(dtype),
      config_(config),
      batch_(batch),
      cache_(device, dtype == DType::kF16 ? CacheMode::kF16 : CacheMode::kBF16, batch, config.num_kv_heads + 1,
             config.num_kv_heads, config.head_dim, config.head_dim, config.capacity_step),
      decoder_(device, dispatch) {
  if (dtype == DType::kF32) throw Error("BlockSparseAttention: the cache stores f16 or bf16");
  if (config.num_kv_heads < 1 || config.num_qo_heads % config.num_kv_heads != 0 || config.block_size < 1 ||
      config.topk_blocks < 1 || config.local_blocks < 1 || config.local_blocks - 1 > config.topk_blocks) {
    throw Error("BlockSparseAttention: need num_qo_heads a multiple of num_kv_heads, block_size, topk_blocks and "
                "local_blocks >= 1, and local_blocks - 1 <= topk_blocks (forced blocks must fit the top-k)");
  }
}

SparseAttentionInputs BlockSparseAttention::inputs(const BlockSparseTokens& tokens) const {
  const RawKVAllocations raw = *cache_.raw_kv_allocations();
  SparseAttentionInputs in;
  in.device = device_;
  in.dtype = dtype_;
  in.batch = batch_;
  in.num_qo_heads = config_.num_qo_heads;
  in.num_kv_heads = config_.num_kv_heads;
  in.live_len = raw.live_len;
  in.k = {raw.k, raw.k_shape.heads, raw.k_shape.capacity, config_.head_dim, config_.head_dim};
  in.v = {raw.v, raw.v_shape.heads, raw.v_shape.capacity, config_.head_dim, config_.head_dim};
  in.q = tokens.q;
  in.scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
  in.o = tokens.o;
  return in;
}

void BlockSparseAttention::prefill_token(const BlockSparseTokens& tokens, void* stream) {
  cache_.update_and_fetch(tokens.k, tokens.v, dtype_, 1);
  const SparseAttentionInputs in = inputs(tokens);
  const MaskedDecodeParams m = masked_params(in);  // no mask: the whole causal window
  if (device_ == Device::kCuda) {
    mask_workspace_ = Buffer(device_, masked_decode_workspace_bytes(m, cuda_multiprocessor_count()));
    run_masked_decode_cuda(m, mask_workspace_.data(), stream);
  } else {
    run_masked_decode_cpu(m);
  }
}

void BlockSparseAttention::select_blocks(const BlockSparseTokens& tokens, void* stream) {
  const int64_t kv_len = cache_.live_len();
  const int32_t requests = batch_ * config_.num_kv_heads;
  blocks_per_request_ = blocks_per_request(config_, kv_len);
  block_ids_ = Buffer(device_, static_cast<size_t>(requests) * blocks_per_request_ * sizeof(int32_t));
  const RawKVAllocations raw = *cache_.raw_kv_allocations();
  if (device_ == Device::kCuda) {
    // In the sparse regime every request keeps topk_blocks + the final block,
    // which is the indexer's row width. The live length goes to the device.
    const int32_t width = config_.topk_blocks + 1;
    if (blocks_per_request_ != width) throw Error("BlockSparseAttention: the CUDA indexer runs in the sparse regime only");
    const std::vector<int32_t> lens(static_cast<size_t>(batch_), static_cast<int32_t>(kv_len));
    if (kv_lens_.bytes() < lens.size() * sizeof(int32_t)) kv_lens_ = Buffer(device_, lens.size() * sizeof(int32_t));
    copy_bytes(kv_lens_.data(), device_, lens.data(), Device::kCpu, lens.size() * sizeof(int32_t));
    if (seq_lens_.bytes() < static_cast<size_t>(requests) * sizeof(int32_t)) {
      seq_lens_ = Buffer(device_, static_cast<size_t>(requests) * sizeof(int32_t));
    }
    const size_t ws = detail::block_indexer_workspace_bytes(batch_, config_.num_kv_heads, kv_len, config_.block_size);
    if (scores_.bytes() < ws) scores_ = Buffer(device_, ws);
    detail::BlockIndexerArgs args{};
    args.dtype = dtype_;
    args.k_alloc = raw.k;
    args.index_q = tokens.index_q;
    args.batch = batch_;
    args.num_kv_heads = config_.num_kv_heads;
    args.head_dim = config_.head_dim;
    args.capacity = raw.k_shape.capacity;
    args.kv_lens = kv_lens_.as<int32_t>();
    args.max_kv_len = kv_len;
    args.block_size = config_.block_size;
    args.topk = config_.topk_blocks;
    args.local_blocks = config_.local_blocks;
    args.width = width;
    args.block_ids = block_ids_.as<int32_t>();
    args.seq_lens = seq_lens_.as<int32_t>();
    args.workspace = scores_.data();
    args.workspace_bytes = scores_.bytes();
    detail::block_indexer_cuda(args, stream);
    return;
  }
  // Host: the index key is head num_kv_heads of the K allocation.
  const size_t d = static_cast<size_t>(config_.head_dim);
  std::vector<float> index_k(static_cast<size_t>(batch_) * static_cast<size_t>(kv_len) * d);
  for (int32_t b = 0; b < batch_; ++b) {
    const int64_t base = (int64_t{b} * raw.k_shape.heads + config_.num_kv_heads) * raw.k_shape.capacity;
    to_float(dtype_, static_cast<const char*>(raw.k) + static_cast<size_t>(base) * d * dtype_size(dtype_),
             &index_k[static_cast<size_t>(b) * static_cast<size_t>(kv_len) * d], static_cast<size_t>(kv_len) * d);
  }
  std::vector<float> q(static_cast<size_t>(requests) * d);
  to_float(dtype_, tokens.index_q, q.data(), q.size());
  const std::vector<int32_t> ids = select_top_blocks_cpu(config_, batch_, kv_len, q.data(), index_k);
  std::copy(ids.begin(), ids.end(), block_ids_.as<int32_t>());
}

void BlockSparseAttention::run_block_mask_path(const SparseAttentionInputs& in, void* stream) {
  const int32_t requests = batch_ * config_.num_kv_heads;
  mask_ = Buffer(device_, static_cast<size_t>(requests * in.live_len) * sizeof(float));
  MaskedDecodeParams m = masked_params(in);
  m.mask = mask_.as<float>();
  if (device_ == Device::kCuda) {
    detail::block_mask_cuda(block_ids_.as<int32_t>(), batch_, config_.num_kv_heads, blocks_per_request_,
                            config_.block_size, kv_lens_.as<int32_t>(), in.live_len, mask_.as<float>(), stream);
    mask_workspace_ = Buffer(device_, masked_decode_workspace_bytes(m, cuda_multiprocessor_count()));
    run_masked_decode_cuda(m, mask_workspace_.data(), stream);
  } else {
    block_mask_cpu(block_ids_.as<int32_t>(), requests, blocks_per_request_, config_.block_size, in.live_len,
                   mask_.as<float>());
    run_masked_decode_cpu(m);
  }
}

BlockSparseStep BlockSparseAttention::decode(const BlockSparseTokens& tokens, void* stream) {
  cache_.update_and_fetch(tokens.k, tokens.v, dtype_, 1);
  const SparseAttentionInputs in = inputs(tokens);
  BlockSparseStep step;
  step.sparse_regime = config_.sparse_regime(in.live_len);
  if (!step.sparse_regime) {
    const MaskedDecodeParams m = masked_params(in);
    if (device_ == Device::kCuda) {
      mask_workspace_ = Buffer(device_, masked_decode_workspace_bytes(m, cuda_multiprocessor_count()));
      run_masked_decode_cuda(m, mask_workspace_.data(), stream);
    } else {
      run_masked_decode_cpu(m);
    }
    return step;
  }
  select_blocks(tokens, stream);
  const int32_t requests = batch_ * config_.num_kv_heads;
  selection_ = selection_from_blocks(block_ids_, std::vector<int32_t>(static_cast<size_t>(requests), blocks_per_request_),
                                     config_.block_size, std::vector<int64_t>(static_cast<size_t>(requests), 0),
                                     std::vector<int64_t>(static_cast<size_t>(requests), in.live_len), stream);
  step.outcome = decoder_.try_fused(in, selection_, stream);
  step.fused = step.outcome.fused();
  if (!step.fused) run_block_mask_path(in, stream);
  return step;
}

std::vector<std::vector<int32_t>> BlockSparseAttention::last_blocks() const {
  if (blocks_per_request_ == 0) return {};
  const auto flat = download<int32_t>(device_, block_ids_.data(), block_ids_.bytes() / sizeof(int32_t));
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < flat.size(); i += static_cast<size_t>(blocks_per_request_)) {
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(i),
                     flat.begin() + static_cast<std::ptrdiff_t>(i + static_cast<size_t>(blocks_per_request_)));
  }
  return out;
}

std::vector<std::vector<int32_t>> BlockSparseAttention::last_selected_positions() const {
  return selection_.materialize();
}

std::vector<std::vector<int32_t>> BlockSparseAttention::last_mask_columns() {
  const int64_t kv_len = cache_.live_len();
  const int32_t requests = batch_ * config_.num_kv_heads;
  Buffer mask(device_, static_cast<size_t>(requests * kv_len) * sizeof(float));
  if (device_ == Device::kCuda) {
    detail::block_mask_cuda(block_ids_.as<int32_t>(), batch_, config_.num_kv_heads, blocks_per_request_,
                            config_.block_size, kv_lens_.as<int32_t>(), kv_len, mask.as<float>(), nullptr);
  } else {
    block_mask_cpu(block_ids_.as<int32_t>(), requests, blocks_per_request_, config_.block_size, kv_len,
                   mask.as<float>());
  }
  return mask_kept_columns(device_, mask.as<float>(), requests, kv_len);
}

}  // namespace sparsepage
