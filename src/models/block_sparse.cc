#include "sparsepage/models/block_sparse.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

#include "core/cuda_hooks.h"
#include "core/decode_limits.h"
#include "cpu/dot.h"
#include "cpu/paged_keys.h"
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
void block_mask_cpu(const int32_t* blocks, int32_t requests, int32_t num_kv_heads, int32_t width, int32_t block_size,
                    const int32_t* kv_lens, int64_t pitch, float* mask) {
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
  const int64_t forced =
      std::min<int64_t>(num_blocks - c.local_blocks, std::max<int64_t>(kv_len - q_len, 0) / c.block_size);
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
    const float* s = score.data() + r * scored;  // no element taken of an empty vector (one block: none scored)
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
const BlockSparseConfig& checked_config(const BlockSparseConfig& config, int32_t batch) {
  if (batch < 1) throw Error("BlockSparseAttention: batch = " + std::to_string(batch) + " must be at least 1");
  if (config.num_kv_heads < 1 || config.num_qo_heads < 1 || config.num_qo_heads % config.num_kv_heads != 0 ||
      config.block_size < 1 || config.topk_blocks < 1 || config.local_blocks < 1 ||
      config.local_blocks - 1 > config.topk_blocks || config.head_dim < 1) {
    throw Error("BlockSparseAttention: need num_qo_heads a positive multiple of num_kv_heads, head_dim, block_size, "
                "topk_blocks and local_blocks >= 1, and local_blocks - 1 <= topk_blocks (forced blocks must fit "
                "the top-k)");
  }
  if (int64_t{2} * config.topk_blocks * config.block_size > INT32_MAX / 2) {
    throw Error("BlockSparseAttention: 2 * topk_blocks * block_size must stay below 2^30 tokens");
  }
  return config;
}

SparseLayer::CacheShape cache_shape(const BlockSparseConfig& c) {
  // Engine-paged: the engine's pool holds K and V, the layer only the index
  // keys (engine pools: not even those; the cache stays empty).
  if (c.kv_storage != KVStorage::kLayerCache) return {1, 0, c.head_dim, c.head_dim};
  return {c.num_kv_heads + 1, c.num_kv_heads, c.head_dim, c.head_dim};
}
}  // namespace

BlockSparseAttention::BlockSparseAttention(Device device, DType dtype, const BlockSparseConfig& config, int32_t batch,
                                           DispatchConfig dispatch)
    : EngineLayerForms("BlockSparseAttention", device, dtype, batch, config.kv_storage,
                       cache_shape(checked_config(config, batch)), config.capacity_step, dispatch),
      config_(config),
      prefill_indexer_(device),
      gqa_prefill_(device) {}

int64_t BlockSparseAttention::selected_tokens(int64_t kv_len) const {
  if (kv_len <= 0) return 0;
  if (!config_.sparse_regime(kv_len)) return kv_len;
  const int64_t num_blocks = (kv_len + config_.block_size - 1) / config_.block_size;
  return int64_t{blocks_per_request(config_, kv_len) - 1} * config_.block_size +
         (kv_len - (num_blocks - 1) * config_.block_size);
}

StepTokens BlockSparseAttention::to_step(const BlockSparseTokens& t) const {
  StepTokens s;
  s.q = t.q;
  s.index_q = t.index_q;
  s.k = t.k;
  s.v = t.v;
  s.index_k = t.index_k;
  s.o = t.o;
  return s;
}

SparseLayer::TokenNames BlockSparseAttention::token_names() const {
  TokenNames n{"BlockSparseTokens"};
  n.index_q = "index_q";
  n.engine_forms = true;
  return n;
}

SparseLayer::TokenBytes BlockSparseAttention::token_bytes() const {
  const size_t row = static_cast<size_t>(config_.head_dim) * dtype_size(dtype());
  const auto hq = static_cast<size_t>(config_.num_qo_heads), hkv = static_cast<size_t>(config_.num_kv_heads);
  TokenBytes b;
  b.q = hq * row;
  b.index_q = hkv * row;
  b.k = (hkv + 1) * row;
  b.v = hkv * row;
  b.o = hq * row;
  return b;
}

SparseAttentionInputs BlockSparseAttention::attention_inputs(const StepTokens& tokens, int32_t q_len) const {
  SparseAttentionInputs in;
  in.device = device();
  in.dtype = dtype();
  in.batch = batch();
  in.num_qo_heads = config_.num_qo_heads;
  in.num_kv_heads = config_.num_kv_heads;
  in.live_len = live_bound();
  in.live_lens = device_lens();  // an engine-paged layer's index keys: the same positions
  in.q = tokens.q;
  in.scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
  in.o = tokens.o;
  in.q_len = q_len;
  if (!engine_paged()) {  // K carries the index key at head num_kv_heads: its own sequence stride
    in.k = cache().k_rows().value();
    in.v = cache().v_rows().value();
  }
  return in;
}

void BlockSparseAttention::size_selection(int64_t capacity, int32_t /*q_len*/) {
  const size_t requests = static_cast<size_t>(num_requests());
  if (block_ids_.empty()) {
    block_ids_ = Buffer(device(), requests * static_cast<size_t>(width()) * sizeof(int32_t));
    seq_lens_ = Buffer(device(), requests * sizeof(int32_t));
    fill_bytes(seq_lens_.data(), device(), 0, seq_lens_.bytes());
    index_error_word();
  }
  if (device() == Device::kCuda) {
    indexer_workspace_ =
        Buffer(device(), std::max<size_t>(256, detail::block_indexer_workspace_bytes(batch(), config_.num_kv_heads,
                                                                                     capacity, config_.block_size)));
  }
}

PagedSelection BlockSparseAttention::selection(int32_t q_len) const {
  PagedSelection s;
  s.pages = block_ids_.as<int32_t>();
  s.seq_lens = seq_lens_.as<int32_t>();
  s.num_requests = num_requests();
  s.width = width();
  s.page_size = config_.block_size;
  for (int64_t len : lens_after(q_len)) s.max_selected = std::max(s.max_selected, selected_tokens(len));
  s.max_selected = std::min<int64_t>(s.max_selected, int64_t{width()} * config_.block_size);
  return s;
}

void BlockSparseAttention::select(const StepTokens& tokens, int32_t q_len, void* stream) {
  // An engine-pools layer's cache is empty: its keys are the engine's.
  const RowView k_rows = engine_pools() ? RowView{} : cache().k_rows().value();
  const int64_t dense_len = int64_t{2} * config_.topk_blocks * config_.block_size;
  if (device() == Device::kCuda) {
    detail::BlockIndexerArgs args;
    args.dtype = dtype();
    if (engine_pools()) {
      args.paged = engine_kv()->index_keys;
      args.error = index_error_word();
    } else if (engine_paged()) {
      args.index_keys = k_rows.data;
      args.key_seq_stride = k_rows.seq_stride;
    } else {
      args.k_alloc = k_rows.data;
    }
    args.index_q = tokens.index_q;
    args.q_len = q_len;
    args.batch = batch();
    args.num_kv_heads = config_.num_kv_heads;
    args.head_dim = config_.head_dim;
    args.capacity = capacity();
    args.kv_lens = device_lens();
    // The engine's bound sizes the grids (a longer length is refused); the
    // layer's own lengths never pass its capacity.
    args.max_kv_len = engine_pools() ? live_bound() : capacity();
    args.block_size = config_.block_size;
    args.topk = config_.topk_blocks;
    args.local_blocks = config_.local_blocks;
    args.width = width();
    args.dense_len = dense_len;
    args.block_ids = block_ids_.as<int32_t>();
    args.seq_lens = seq_lens_.as<int32_t>();
    args.workspace = indexer_workspace_.data();
    args.workspace_bytes = indexer_workspace_.bytes();
    detail::block_indexer_cuda(args, stream);
    return;
  }
  if (engine_pools()) {
    select_pools_cpu(tokens);
    return;
  }
  // Host: the same rule per sequence, at the length the device array holds;
  // the index keys read in place (head num_kv_heads, or the key-only cache).
  const int32_t key_head = engine_paged() ? 0 : config_.num_kv_heads;
  const size_t d = static_cast<size_t>(config_.head_dim), esize = dtype_size(dtype());
  const size_t q_per_seq = static_cast<size_t>(q_len) * static_cast<size_t>(config_.num_kv_heads) * d;
  std::vector<float> q(static_cast<size_t>(batch()) * q_per_seq);
  to_float(dtype(), tokens.index_q, q.data(), q.size());
  std::fill(block_ids_.as<int32_t>(), block_ids_.as<int32_t>() + int64_t{num_requests()} * width(), -1);
  for (int32_t b = 0; b < batch(); ++b) {
    const int64_t len = device_lens()[b];
    std::vector<int32_t> kept;
    if (len > dense_len) {
      const auto key_row = [&](int32_t /*one*/, int64_t t, float* out) {
        to_float(dtype(),
                 static_cast<const char*>(k_rows.data) + static_cast<size_t>(k_rows.offset(b, key_head, t)) * esize,
                 out, d);
      };
      kept = top_blocks_cpu(config_, 1, len, q.data() + static_cast<size_t>(b) * q_per_seq, key_row, q_len);
    }
    write_lists_cpu(b, len, kept);
  }
}

void BlockSparseAttention::write_lists_cpu(int32_t b, int64_t len, const std::vector<int32_t>& kept) {
  const int32_t per = kept.empty() ? static_cast<int32_t>((len + config_.block_size - 1) / config_.block_size)
                                   : blocks_per_request(config_, len);
  for (int32_t h = 0; h < config_.num_kv_heads; ++h) {
    const int64_t r = int64_t{b} * config_.num_kv_heads + h;
    for (int32_t i = 0; i < per; ++i)
      block_ids_.as<int32_t>()[r * width() + i] = kept.empty() ? i : kept[static_cast<size_t>(h * per + i)];
    seq_lens_.as<int32_t>()[r] = static_cast<int32_t>(selected_tokens(len));
  }
}

// The host twin of the CUDA indexer over an engine's paged keys: the same
// rule (top_blocks_cpu) per sequence at the engine's length, the keys read
// through their block table (FP8 keys dequantized as e4m3 x scale), and the
// same refusals: a length past max_seq_len or past the key table's row, or
// a scored block whose keys lie in a block outside the pool, selects
// nothing (ids -1, count -1) and sets its IndexKeyError bit.
void BlockSparseAttention::select_pools_cpu(const StepTokens& tokens) {
  const PagedIndexKeys& keys = engine_kv()->index_keys;
  const size_t d = static_cast<size_t>(config_.head_dim);
  const int32_t heads = config_.num_kv_heads;
  const int64_t dense_len = int64_t{2} * config_.topk_blocks * config_.block_size;
  const int64_t token_bytes = index_key_token_bytes(keys, config_.head_dim);
  const int64_t block_bytes = index_key_block_bytes(keys, config_.head_dim);
  std::vector<float> q(static_cast<size_t>(batch()) * heads * d);
  to_float(dtype(), tokens.index_q, q.data(), q.size());
  int32_t* covered = seq_lens_.as<int32_t>();
  int32_t& error = *index_error_word();
  std::fill(block_ids_.as<int32_t>(), block_ids_.as<int32_t>() + int64_t{num_requests()} * width(), -1);
  for (int32_t b = 0; b < batch(); ++b) {
    const int64_t len = device_lens()[b];
    const int32_t* table = keys.block_table + int64_t{b} * keys.block_table_stride;
    const auto refuse = [&](int32_t bit) {
      error |= bit;
      for (int32_t h = 0; h < heads; ++h) covered[int64_t{b} * heads + h] = -1;
    };
    if (len < 0 || len > live_bound() || len > int64_t{keys.max_blocks} * keys.block_size) {
      refuse(kIndexErrorLength);
      continue;
    }
    std::vector<int32_t> kept;
    if (len > dense_len) {
      const int64_t num_blocks = (len + config_.block_size - 1) / config_.block_size;
      // The keys the rule reads: blocks below the forced ones (as the CUDA score kernel).
      const int64_t scored_end =
          std::min<int64_t>(num_blocks - 1, num_blocks - config_.local_blocks) * config_.block_size;
      bool in_pool = true;
      for (int64_t e = 0; e * keys.block_size < scored_end; ++e)
        in_pool = in_pool && table[e] >= 0 && table[e] < keys.num_blocks;
      if (!in_pool) {
        refuse(kIndexErrorBlock);
        continue;
      }
      const auto key_row = [&](int32_t /*one*/, int64_t t, float* out) {
        cpu::paged_key_row(keys, block_bytes, token_bytes, d, table, t, out);
      };
      kept = top_blocks_cpu(config_, 1, len, q.data() + static_cast<size_t>(b) * heads * d, key_row);
    }
    write_lists_cpu(b, len, kept);
  }
}

void BlockSparseAttention::check_engine_kv(const EnginePagedKV& kv) const {
  if (kv.kv_format != KvFormat::kNative) {
    throw Error(std::string("BlockSparseAttention (engine-paged): kv.kv_format ") + kv_format_name(kv.kv_format) +
                " is not supported; the layer reads native K/V rows of its dtype");
  }
  if (kv.k.dim != config_.head_dim || kv.v.dim != config_.head_dim) {
    throw Error("BlockSparseAttention (engine-paged): the pool's rows are " + std::to_string(kv.k.dim) + " (K) and " +
                std::to_string(kv.v.dim) + " (V) wide; the layer's head_dim is " + std::to_string(config_.head_dim));
  }
  if (kv.k_extra.data != nullptr) {
    throw Error("BlockSparseAttention (engine-paged): kv.k_extra must be empty (the layer has one K stream)");
  }
}

void BlockSparseAttention::check_selection_errors(void* stream) {
  raise_index_errors(stream, "BlockSparseAttention: the indexer refused sequences (they selected nothing)",
                     "a length past max_seq_len, negative or past its index-key table row",
                     "a key block id outside the index-key pool");
}

std::string BlockSparseAttention::query_tokens_refusal(int32_t q_len) const {
  if (device() == Device::kCuda && q_len > 1 && int64_t{q_len} * config_.num_kv_heads > 32) {
    return "q_len * num_kv_heads = " + std::to_string(q_len) + " * " + std::to_string(config_.num_kv_heads) +
           " exceeds the CUDA indexer's 32 (token, head) index queries";
  }
  return {};
}

namespace detail {
void block_prefill_regime_cpu(const BlockPrefillRegimeArgs& a) {
  const int32_t nqb = (a.num_tokens + a.block_size - 1) / a.block_size;
  const int64_t lists = int64_t{a.batch} * nqb * a.num_kv_heads;
  for (int64_t l = 0; l < lists; ++l) block_prefill_regime_list(a, nqb, l);
}
}  // namespace detail

// The CPU block scores read each slot's index keys through the engine's
// key table, the blocks below its query blocks' forced ones
// (block_scores_cpu); an entry there outside the key pool is refused here,
// before the chunk writes o (the scores would refuse it mid-chunk, after
// the rows of the slots before it).
std::string BlockSparseAttention::pools_key_table_refusal(const PagedIndexKeys& keys, int32_t num_tokens,
                                                          const std::vector<int64_t>& lens) const {
  const int32_t bs = config_.block_size, blocks = (num_tokens + bs - 1) / bs;
  for (size_t b = 0; b < lens.size(); ++b) {
    if (lens[b] == 0) continue;  // a free slot: not read
    const int64_t start = lens[b] - num_tokens;
    const int64_t scored_end = std::max<int64_t>(0, start / bs + blocks - config_.local_blocks) * bs;
    const int64_t read = std::min(lens[b], scored_end);
    const int32_t* row = keys.block_table + static_cast<int64_t>(b) * keys.block_table_stride;
    for (int64_t e = 0; e < (read + keys.block_size - 1) / keys.block_size; ++e) {
      if (row[e] < 0 || row[e] >= keys.num_blocks) {
        return "slot " + std::to_string(b) + "'s index-key table entry " + std::to_string(e) + " = " +
               std::to_string(row[e]) + " is outside the index-key pool [0, " + std::to_string(keys.num_blocks) +
               ") (the block scores read it)";
      }
    }
  }
  return {};
}

std::string BlockSparseAttention::prefill_refusal(int32_t num_tokens, const std::vector<int64_t>& lens) const {
  const int32_t bs = config_.block_size;
  if (device() == Device::kCuda && (config_.head_dim != 128 || (bs != 64 && bs != 128))) {
    return "the CUDA prefill indexer scores 64- or 128-token blocks at head_dim 128, not " + std::to_string(bs) +
           "-token blocks at head_dim " + std::to_string(config_.head_dim);
  }
  if (engine_pools()) {  // the engine's lengths: a free slot has length 0
    std::vector<uint8_t> active(lens.size());
    for (size_t b = 0; b < lens.size(); ++b) active[b] = lens[b] > 0 ? 1 : 0;
    std::string refused = detail::block_chunk_refusal(bs, active, lens, num_tokens, "decode()");
    if (refused.empty() && device() == Device::kCpu && engine_kv() != nullptr) {
      refused = pools_key_table_refusal(engine_kv()->index_keys, num_tokens, lens);
    }
    return refused;
  }
  return detail::block_chunk_refusal(bs, cache().active(), lens, num_tokens, "prefill_token() or decode()");
}

void BlockSparseAttention::run_prefill(const StepTokens& tokens, int32_t first_slot, const PrefillChunk& chunk,
                                       void* stream) {
  const int32_t n = chunk.num_tokens, bs = config_.block_size, heads = config_.num_kv_heads;
  const int32_t blocks = (n + bs - 1) / bs, indexer_width = config_.topk_blocks + 1;
  if (blocks > prefill_sized_blocks_) {
    const size_t lists = static_cast<size_t>(batch()) * static_cast<size_t>(blocks) * static_cast<size_t>(heads);
    prefill_indexer_ids_ = Buffer(device(), lists * static_cast<size_t>(indexer_width) * sizeof(int32_t));
    prefill_indexer_counts_ = Buffer(device(), lists * sizeof(int32_t));
    size_prefill_lists(prefill_ids_, prefill_counts_, lists, width());
    prefill_sized_blocks_ = blocks;
  }
  // Lists of slot b start at b * blocks * heads (the buffers' rows per slot follow the chunk's query blocks).
  const int64_t list0 = int64_t{first_slot} * blocks * heads;
  BlockPrefillIndexerParams ip;
  ip.dtype = dtype();
  ip.chunk = chunk;
  ip.num_kv_heads = heads;
  ip.head_dim = config_.head_dim;
  ip.block_size = bs;
  ip.top_blocks = config_.topk_blocks;
  ip.local_blocks = config_.local_blocks;
  // The index key rides at head num_kv_heads of the layer's K rows; an
  // engine-paged layer keeps the keys alone (head 0).
  if (engine_pools()) {  // the engine's paged keys, from the chunk's first slot's table row on
    ip.key_layout = IndexKeyLayout::kPaged;
    ip.paged = engine_kv()->index_keys;
    ip.paged.block_table += int64_t{first_slot} * ip.paged.block_table_stride;
    ip.error = index_error_word();  // CUDA: a key block outside the pool, flagged where it is read
  } else {
    ip.index_keys = slot_rows(cache().k_rows().value(), first_slot, engine_paged() ? 0 : heads);
  }
  ip.q_index = tokens.index_q;
  ip.block_ids = prefill_indexer_ids_.as<int32_t>() + list0 * indexer_width;
  ip.counts = prefill_indexer_counts_.as<int32_t>() + list0;
  prefill_indexer_.run(ip, stream);

  // The decode's dense regime: a query block ending within it keeps every block.
  detail::BlockPrefillRegimeArgs ra;
  ra.kv_lens = chunk.kv_lens;
  ra.batch = chunk.batch;
  ra.num_tokens = n;
  ra.num_kv_heads = heads;
  ra.block_size = bs;
  ra.dense_len = int64_t{2} * config_.topk_blocks * bs;
  ra.indexer_ids = ip.block_ids;
  ra.indexer_counts = ip.counts;
  ra.indexer_width = indexer_width;
  ra.block_ids = prefill_ids_.as<int32_t>() + list0 * width();
  ra.counts = prefill_counts_.as<int32_t>() + list0;
  ra.width = width();
  if (device() == Device::kCuda) {
    detail::block_prefill_regime_cuda(ra, stream);
  } else {
    detail::block_prefill_regime_cpu(ra);
  }

  const BlockPrefillSelection kept{BlockSelectionLayout::kPerKvHead, ra.block_ids, ra.counts, width()};
  if (engine_kv() != nullptr) {  // engine-paged: K and V in the engine's pool, through its block table
    detail::run_gqa_chunk(gqa_prefill_, dtype(), engine_kv()->k, engine_kv()->v, slot_table(first_slot), chunk,
                          detail::gqa_geometry(config_), tokens, kept, stream);
  } else {
    detail::run_gqa_chunk(gqa_prefill_, dtype(), slot_rows(cache().k_rows().value(), first_slot),
                          slot_rows(cache().v_rows().value(), first_slot), BlockTable{}, chunk,
                          detail::gqa_geometry(config_), tokens, kept, stream);
  }
}

std::vector<std::vector<int32_t>> BlockSparseAttention::prefill_positions(const std::vector<int64_t>& lens,
                                                                          int32_t num_tokens) const {
  const BlockPrefillSelection kept{BlockSelectionLayout::kPerKvHead, prefill_ids_.as<int32_t>(),
                                   prefill_counts_.as<int32_t>(), width()};
  return detail::gqa_chunk_positions(device(), kept, config_.num_kv_heads, detail::gqa_geometry(config_), lens,
                                     num_tokens);
}

// The additive mask of the kept blocks over the capacity, positions past
// each sequence's device-side length excluded: what the mask path attends.
void BlockSparseAttention::build_mask(float* mask, int64_t pitch, void* stream) {
  if (device() == Device::kCuda) {
    detail::block_mask_cuda(block_ids_.as<int32_t>(), batch(), config_.num_kv_heads, width(), config_.block_size,
                            device_lens(), pitch, mask, stream);
  } else {
    block_mask_cpu(block_ids_.as<int32_t>(), num_requests(), config_.num_kv_heads, width(), config_.block_size,
                   device_lens(), pitch, mask);
  }
}

std::vector<std::vector<int32_t>> BlockSparseAttention::last_blocks() const {
  if (!have_selection()) return {};
  return detail::download_kept_blocks(device(), block_ids_.data(), num_requests(), width());
}

std::vector<std::vector<int32_t>> BlockSparseAttention::selected_positions() const {
  return detail::kept_block_positions(device(), last_blocks(), seq_lens_.data(), config_.block_size);
}

}  // namespace sparsepage
