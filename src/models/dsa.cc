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
                " exceeds " + std::to_string(kDsaMaxQueryElements) +
                " (one sequence's index queries are staged in "
                "shared memory)");
  }
}

}  // namespace detail

namespace {
// The layer's configuration, checked before anything is allocated (so a
// CUDA layer names a shape it cannot run even on a machine without a GPU),
// with the default scale filled in.
DsaConfig checked_config(Device device, const DsaConfig& config, int32_t batch) {
  if (batch < 1) throw Error("DsaAttention: batch = " + std::to_string(batch) + " must be at least 1");
  if (config.num_qo_heads < 1 || config.latent_dim < 1 || config.rope_dim < 1 || config.index_heads < 1 ||
      config.index_head_dim < 1 || config.index_topk < 1) {
    throw Error("DsaAttention: heads, dims and index_topk must be at least 1");
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

SparseLayer::CacheShape cache_shape(const DsaConfig& c) {
  // Engine-paged: the engine's pool holds the MLA rows, the layer only the indexer keys.
  if (c.kv_storage != KVStorage::kLayerCache) return {1, 0, c.index_head_dim, c.rope_dim};
  return {1, 1, c.latent_dim + c.index_head_dim, c.rope_dim};
}
}  // namespace

DsaAttention::DsaAttention(Device device, DType dtype, const DsaConfig& config, int32_t batch, DispatchConfig dispatch)
    : EngineLayerForms("DsaAttention", device, dtype, batch, config.kv_storage,
                       cache_shape(checked_config(device, config, batch)), config.capacity_step, dispatch),
      config_(checked_config(device, config, batch)),
      prefill_indexer_(device),
      mla_prefill_(device) {}

StepTokens DsaAttention::to_step(const DsaTokens& t) const {
  StepTokens s;
  s.q = t.q_latent;
  s.q_extra = t.q_pe;
  s.index_q = t.q_index;
  s.index_weights = t.index_weights;
  s.k = t.k_cache_row;
  s.v = t.k_pe;
  s.index_k = t.index_k;
  s.o = t.o;
  return s;
}

SparseLayer::TokenNames DsaAttention::token_names() const {
  TokenNames n{"DsaTokens"};
  n.q = "q_latent";
  n.q_extra = "q_pe";
  n.index_q = "q_index";
  n.index_weights = "index_weights";
  n.k = "k_cache_row";
  n.v = "k_pe";
  n.engine_forms = true;
  return n;
}

SparseLayer::TokenBytes DsaAttention::token_bytes() const {
  const size_t e = dtype_size(dtype()), h = static_cast<size_t>(config_.num_qo_heads);
  TokenBytes b;
  b.q = h * static_cast<size_t>(config_.latent_dim) * e;
  b.q_extra = h * static_cast<size_t>(config_.rope_dim) * e;
  b.index_q = static_cast<size_t>(config_.index_heads) * static_cast<size_t>(config_.index_head_dim) * e;
  b.index_weights = static_cast<size_t>(config_.index_heads) * sizeof(float);
  b.k = static_cast<size_t>(config_.latent_dim + config_.index_head_dim) * e;
  b.v = static_cast<size_t>(config_.rope_dim) * e;
  b.o = b.q;
  return b;
}

// One token: one request per sequence. A multi-token step: each (sequence,
// token) a request, the tokens folded as the sequence's "KV heads" whose
// rows are the sequence's own (head stride 0), so q [batch, q_len * heads,
// dim] is the packed [batch, q_len, heads, dim] and the window is still per
// sequence.
SparseAttentionInputs DsaAttention::attention_inputs(const StepTokens& tokens, int32_t q_len) const {
  SparseAttentionInputs in;
  in.device = device();
  in.dtype = dtype();
  in.batch = batch();
  in.num_qo_heads = config_.num_qo_heads * q_len;
  in.num_kv_heads = q_len;
  in.live_len = live_bound();
  in.live_lens = device_lens();  // an engine-paged layer's indexer keys: the same positions
  in.q = tokens.q;
  in.q_extra = tokens.q_extra;
  in.scale = config_.scale;
  in.o = tokens.o;
  if (!engine_paged()) {
    RowView latent = cache().k_rows().value();  // kv_latent: the first latent_dim columns of the K rows
    latent.dim = config_.latent_dim;
    in.k = latent;
    in.v = latent;  // V = the same latent rows
    in.k_extra = cache().v_rows().value();
    if (q_len > 1) {
      in.k.head_stride = 0;
      in.v.head_stride = 0;
      in.k_extra.head_stride = 0;
    }
  }
  return in;
}

void DsaAttention::size_selection(int64_t capacity, int32_t q_len) {
  const size_t b = static_cast<size_t>(batch()), k = static_cast<size_t>(config_.index_topk);
  if (positions_.empty()) {
    index_error_word();
    positions_ = Buffer(device(), b * k * sizeof(int32_t));
    counts_ = Buffer(device(), b * sizeof(int32_t));
    fill_bytes(counts_.data(), device(), 0, counts_.bytes());
    std::vector<int32_t> offsets(b + 1);
    for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = static_cast<int32_t>(i * k);
    row_offsets_ = upload(device(), offsets);
  }
  if (q_len > 1 && q_len > sized_q_len_) {
    const size_t rows = b * static_cast<size_t>(q_len);
    token_positions_ = Buffer(device(), rows * k * sizeof(int32_t));
    token_counts_ = Buffer(device(), rows * sizeof(int32_t));
    sized_q_len_ = q_len;
  }
  if (device() == Device::kCuda) {
    workspace_ = Buffer(device(), std::max<size_t>(256, dsa_indexer_workspace_bytes(config_, batch(), capacity)));
    if (sized_q_len_ > 1) {
      token_workspace_ = Buffer(
          device(), std::max<size_t>(256, dsa_indexer_workspace_bytes(config_, batch() * sized_q_len_, capacity)));
    }
  }
}

PagedSelection DsaAttention::selection(int32_t q_len) const {
  PagedSelection s;
  s.pages = (q_len > 1 ? token_positions_ : positions_).as<int32_t>();
  s.seq_lens = (q_len > 1 ? token_counts_ : counts_).as<int32_t>();
  s.num_requests = batch() * q_len;
  s.width = config_.index_topk;
  s.page_size = 1;
  for (int64_t len : lens_after(q_len)) s.max_selected = std::max(s.max_selected, len);
  s.max_selected = std::min<int64_t>(s.max_selected, config_.index_topk);
  return s;
}

void DsaAttention::select(const StepTokens& tokens, int32_t q_len, void* stream) {
  Buffer& positions = q_len > 1 ? token_positions_ : positions_;
  Buffer& counts = q_len > 1 ? token_counts_ : counts_;
  if (!engine_pools() && device() != Device::kCuda) {
    select_cpu(tokens, q_len, positions.as<int32_t>(), counts.as<int32_t>());
    return;
  }
  Buffer& workspace = q_len > 1 ? token_workspace_ : workspace_;
  DsaIndexerArgs args;
  args.dtype = dtype();
  args.kv_lens = device_lens();
  args.q_index = tokens.index_q;
  args.weights = tokens.index_weights;
  args.workspace = workspace.data();
  args.workspace_bytes = workspace.bytes();
  args.positions = positions.as<int32_t>();
  args.counts = counts.as<int32_t>();
  args.q_len = q_len;
  if (engine_pools()) {  // the engine's paged keys, its lengths (one-token steps only)
    args.key_layout = IndexKeyLayout::kPaged;
    args.paged = engine_kv()->index_keys;
    args.max_kv_len = live_bound();
    args.error = index_error_word();
    if (device() == Device::kCuda) {
      dsa_select_tokens_cuda(config_, batch(), args, stream);
    } else {
      dsa_select_tokens_cpu(config_, batch(), args);
    }
    return;
  }
  args.k_cache = cache().k_rows().value().data;
  args.capacity = capacity();
  args.max_kv_len = capacity();
  // The indexer finds its key index_key_column() columns into each K row.
  DsaConfig rule = config_;
  rule.latent_dim = index_key_column();
  dsa_select_tokens_cuda(rule, batch(), args, stream);
}

// The indexer on the host: per sequence at the length the device array
// holds, each (sequence, token) row over its own causal window.
void DsaAttention::select_cpu(const StepTokens& tokens, int32_t q_len, int32_t* positions, int32_t* counts) const {
  const RowView k_rows = cache().k_rows().value();
  const size_t d = static_cast<size_t>(config_.index_head_dim), esize = dtype_size(dtype());
  const size_t heads = static_cast<size_t>(config_.index_heads);
  std::vector<float> q_all(static_cast<size_t>(batch()) * static_cast<size_t>(q_len) * heads * d);
  to_float(dtype(), tokens.index_q, q_all.data(), q_all.size());
  const int32_t topk = config_.index_topk;
  for (int32_t b = 0; b < batch(); ++b) {
    const int64_t len = device_lens()[b];
    std::vector<float> keys;  // the sequence's keys, read once for its tokens
    for (int32_t t = 0; t < q_len; ++t) {
      const int64_t row = int64_t{b} * q_len + t;
      const int64_t window = std::max<int64_t>(len - (q_len - 1 - t), 0);
      std::vector<int32_t> kept;
      if (window <= topk) {
        kept.resize(static_cast<size_t>(window));
        std::iota(kept.begin(), kept.end(), 0);
      } else {
        if (keys.empty()) {
          keys.resize(static_cast<size_t>(len) * d);
          for (int64_t pos = 0; pos < len; ++pos) {
            const auto element = static_cast<size_t>(k_rows.offset(b, 0, pos) + index_key_column());
            to_float(dtype(), static_cast<const char*>(k_rows.data) + element * esize,
                     &keys[static_cast<size_t>(pos) * d], d);
          }
        }
        const std::vector<float> window_keys(keys.begin(),
                                             keys.begin() + static_cast<std::ptrdiff_t>(window * int64_t(d)));
        kept = dsa_select_tokens_cpu(config_, 1, window, q_all.data() + static_cast<size_t>(row) * heads * d,
                                     tokens.index_weights + static_cast<size_t>(row) * heads, window_keys)[0];
      }
      int32_t* out = positions + row * topk;
      for (int32_t i = 0; i < topk; ++i)
        out[i] = i < static_cast<int32_t>(kept.size()) ? kept[static_cast<size_t>(i)] : -1;
      counts[row] = static_cast<int32_t>(kept.size());
    }
  }
}

std::string DsaAttention::query_tokens_refusal(int32_t q_len) const {
  if (int64_t{batch()} * q_len > 65535) {
    return "batch * q_len = " + std::to_string(int64_t{batch()} * q_len) + " (sequence, token) rows exceed 65535";
  }
  return {};
}

std::string DsaAttention::prefill_refusal(int32_t /*num_tokens*/, const std::vector<int64_t>& /*lens*/) const {
  if (config_.latent_dim != 512 || config_.rope_dim != 64) {
    return "the fused MLA prefill takes latent_dim 512 with rope_dim 64, not " + std::to_string(config_.latent_dim) +
           " with " + std::to_string(config_.rope_dim) + " (prefill_token() serves other shapes)";
  }
  if (device() == Device::kCuda && dtype() != DType::kBF16) {
    return std::string("the fused MLA prefill reads bf16 on CUDA, not ") + dtype_name(dtype()) +
           " (prefill_token() serves it)";
  }
  if (device() == Device::kCuda && config_.num_qo_heads % 64 != 0) {
    return "the fused MLA prefill runs 64 query heads per CTA on CUDA: num_qo_heads = " +
           std::to_string(config_.num_qo_heads) + " is not a multiple of 64 (prefill_token() serves it)";
  }
  // The prefill indexer reads the index key at column latent_dim of rows
  // latent_dim + index_head_dim long, capacity rows per sequence: the
  // layer's own cache (one K head of that width, dense; an engine-paged
  // layer's: the keys alone, column 0).
  return {};
}

void DsaAttention::run_prefill(const StepTokens& tokens, int32_t first_slot, const PrefillChunk& chunk, void* stream) {
  const int32_t n = chunk.num_tokens, topk = config_.index_topk;
  if (n > prefill_sized_tokens_) {
    const size_t rows = static_cast<size_t>(batch()) * static_cast<size_t>(n);
    size_prefill_lists(prefill_positions_, prefill_counts_, rows, topk);
    prefill_sized_tokens_ = n;
  }
  // Rows of (slot, token) are n apart per slot: the slot's first row.
  const int64_t row0 = int64_t{first_slot} * n;
  DsaPrefillIndexerParams ip;
  ip.dtype = dtype();
  ip.chunk = chunk;
  ip.index_heads = config_.index_heads;
  ip.index_head_dim = config_.index_head_dim;
  ip.topk = topk;
  RowView k_rows;
  if (engine_pools()) {  // the engine's paged keys, from the chunk's first slot's table row on
    ip.key_layout = IndexKeyLayout::kPaged;
    ip.paged = engine_kv()->index_keys;
    ip.paged.block_table += int64_t{first_slot} * ip.paged.block_table_stride;
    ip.error = index_error_word();
  } else {
    k_rows = slot_rows(cache().k_rows().value(), first_slot);
    ip.k_cache = k_rows.data;
    ip.key_column = engine_paged() ? 0 : config_.latent_dim;  // an engine-paged layer keeps the keys alone
    ip.capacity = capacity();
  }
  ip.q_index = tokens.index_q;
  ip.weights = tokens.index_weights;
  ip.positions = prefill_positions_.as<int32_t>() + row0 * topk;
  ip.counts = prefill_counts_.as<int32_t>() + row0;
  prefill_indexer_.run(ip, stream);

  MlaPrefillParams mp;
  mp.dtype = dtype();
  mp.chunk = chunk;
  mp.num_heads = config_.num_qo_heads;
  mp.topk = topk;
  mp.q = tokens.q;
  mp.q_rope = tokens.q_extra;
  if (engine_kv() != nullptr) {  // engine-paged: the MLA rows in the engine's pool, through its block table
    mp.kv = engine_kv()->k;
    mp.kv_rope = engine_kv()->k_extra;
    mp.kv_format = engine_kv()->kv_format;
    mp.block_table = slot_table(first_slot);
  } else {
    mp.kv = k_rows;  // kv_latent: the first latent_dim columns of the K rows (K and V)
    mp.kv.dim = config_.latent_dim;
    mp.kv_rope = slot_rows(cache().v_rows().value(), first_slot);
  }
  mp.indices = ip.positions;
  // Over engine pools a row the indexer refuses (a key block outside the
  // pool) keeps count -1, the decode indexer's mark, and positions all -1:
  // read without counts, the -1-padded rows select nothing for it (zero
  // output, as the decode step's refused rows) on both backends.
  mp.topk_length = engine_pools() ? nullptr : ip.counts;
  mp.scale = config_.scale;
  mp.out = tokens.o;
  mla_prefill_.run(mp, stream);
}

std::vector<std::vector<int32_t>> DsaAttention::prefill_positions(const std::vector<int64_t>& lens,
                                                                  int32_t num_tokens) const {
  const int32_t topk = config_.index_topk;
  const size_t rows = static_cast<size_t>(batch()) * static_cast<size_t>(num_tokens);
  const auto flat = download<int32_t>(device(), prefill_positions_.data(), rows * static_cast<size_t>(topk));
  const auto counts = download<int32_t>(device(), prefill_counts_.data(), rows);
  std::vector<std::vector<int32_t>> out(rows);
  for (int32_t b = 0; b < batch(); ++b) {
    if (lens[static_cast<size_t>(b)] == 0) continue;  // a free slot
    for (int32_t t = 0; t < num_tokens; ++t) {
      const size_t r = static_cast<size_t>(b) * static_cast<size_t>(num_tokens) + static_cast<size_t>(t);
      const int64_t pos = lens[static_cast<size_t>(b)] - num_tokens + t;
      auto& kept = out[r];
      for (int32_t i = 0; i < std::min(counts[r], topk); ++i) {
        const int32_t p = flat[r * static_cast<size_t>(topk) + static_cast<size_t>(i)];
        if (p >= 0 && p <= pos) kept.push_back(p);
      }
      std::sort(kept.begin(), kept.end());
    }
  }
  return out;
}

void DsaAttention::check_engine_kv(const EnginePagedKV& kv) const {
  if (kv.kv_format != KvFormat::kNative && kv.kv_format != KvFormat::kE4m3Mla) {
    throw Error(std::string("DsaAttention (engine-paged): kv.kv_format ") + kv_format_name(kv.kv_format) +
                " is not an MLA row format (native rows or e4m3 mla, the 656-byte FP8 rows)");
  }
  if (kv.k.dim != config_.latent_dim || kv.v.dim != config_.latent_dim || kv.k_extra.data == nullptr ||
      kv.k_extra.dim != config_.rope_dim) {
    throw Error("DsaAttention (engine-paged): the pool's views are " + std::to_string(kv.k.dim) + " (K), " +
                std::to_string(kv.v.dim) + " (V) and " + std::to_string(kv.k_extra.data ? kv.k_extra.dim : 0) +
                " (rope) wide; the layer needs latent_dim " + std::to_string(config_.latent_dim) + " and rope_dim " +
                std::to_string(config_.rope_dim));
  }
}

void DsaAttention::check_selection_errors(void* stream) {
  raise_index_errors(stream, "DsaAttention: the indexer refused rows (they selected nothing, their outputs are zero)",
                     "a length past max_seq_len, negative or past its block-table row",
                     "a block id outside the index-key pool");
}

// The mask of the one-token selection: entries of -1 past each count fall
// outside the window and are ignored.
void DsaAttention::build_mask(float* mask, int64_t pitch, void* stream) {
  build_selection_mask(device(), positions_.as<int32_t>(), row_offsets_.as<int32_t>(), batch(), pitch, mask, stream);
}

std::vector<std::vector<int32_t>> DsaAttention::selected_positions() const {
  const int32_t rows = batch() * last_q_len();
  const Buffer& positions = last_q_len() > 1 ? token_positions_ : positions_;
  const Buffer& counts = last_q_len() > 1 ? token_counts_ : counts_;
  const auto flat = download<int32_t>(device(), positions.data(), static_cast<size_t>(rows) * config_.index_topk);
  const auto n = download<int32_t>(device(), counts.data(), static_cast<size_t>(rows));
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(rows));
  for (int32_t r = 0; r < rows; ++r) {
    const auto first = flat.begin() + int64_t{r} * config_.index_topk;
    // A refused row's count is -1: it attends nothing.
    out[static_cast<size_t>(r)].assign(first, first + std::max(n[static_cast<size_t>(r)], 0));
  }
  return out;
}

}  // namespace sparsepage
