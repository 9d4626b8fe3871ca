#include "sparsepage/models/static_block_sparse.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "core/cuda_hooks.h"
#include "core/decode_limits.h"
#include "models/kept_blocks.h"
#include "models/static_block_sparse_kernels.h"
#include "sparsepage/detail/cuda_introspection.h"

namespace sparsepage {
namespace detail {
namespace {
StaticPattern pattern_of(const StaticBlockSparseConfig& c) {
  return {c.block_size, c.local_blocks, c.vert_stride, c.head_sliding_step()};
}
}  // namespace

// The CPU twins of src/cuda/indexers/static_block_sparse.cu, line for line.
void static_pages_cpu(const StaticPagesArgs& a) {
  const int32_t group = a.num_qo_heads / a.num_kv_heads;
  for (int64_t r = 0; r < int64_t{a.batch} * a.num_qo_heads; ++r) {
    const int32_t b = static_cast<int32_t>(r / a.num_qo_heads), h = static_cast<int32_t>(r % a.num_qo_heads);
    const int64_t len = a.kv_lens[b];
    const StaticKeptBlocks kept = static_kept_blocks(a.pattern, h, len);
    for (int64_t slot = 0; slot < a.width; ++slot) {
      a.pages[r * a.width + slot] = slot < kept.count() ? static_cast<int32_t>(kept.at(slot)) : -1;
    }
    a.seq_lens[r] = static_cast<int32_t>(static_kept_tokens(a.pattern, h, len));
    if (h % group == 0) a.window_lens[int64_t{b} * a.num_kv_heads + h / group] = static_cast<int32_t>(len);
  }
}

void static_mask_cpu(const StaticMaskArgs& a) {
  for (int64_t r = 0; r < int64_t{a.batch} * a.num_qo_heads; ++r) {
    const int32_t b = static_cast<int32_t>(r / a.num_qo_heads), h = static_cast<int32_t>(r % a.num_qo_heads);
    const int64_t len = a.kv_lens[b];
    for (int64_t t = 0; t < a.pitch; ++t) {
      const bool kept =
          t < len && static_block_kept(a.pattern, h, (len - 1) / a.pattern.block_size, t / a.pattern.block_size);
      a.mask[r * a.pitch + t] = kept ? 0.0f : -std::numeric_limits<float>::infinity();
    }
  }
}
}  // namespace detail

int32_t StaticBlockSparseConfig::head_sliding_step() const {
  return std::max(1, num_qo_heads > 0 ? vert_stride / num_qo_heads : 1);
}

namespace {
// The rule divides by block_size and vert_stride: a config a layer would
// refuse is refused here too, by name, rather than dividing by zero.
detail::StaticPattern checked_pattern(const StaticBlockSparseConfig& c, const char* who) {
  if (c.num_qo_heads < 1 || c.block_size < 1 || c.local_blocks < 1 || c.vert_stride < 1) {
    throw Error(std::string("StaticBlockSparseConfig::") + who +
                ": num_qo_heads, block_size, local_blocks and vert_stride must be at least 1 (got " +
                std::to_string(c.num_qo_heads) + ", " + std::to_string(c.block_size) + ", " +
                std::to_string(c.local_blocks) + ", " + std::to_string(c.vert_stride) + ")");
  }
  return detail::pattern_of(c);
}

// The rule's pattern for query head `head`, refused by name outside
// [0, num_qo_heads): the arithmetic would answer for a head that is not there.
detail::StaticPattern checked_head(const StaticBlockSparseConfig& c, const char* who, int32_t head) {
  const detail::StaticPattern pattern = checked_pattern(c, who);
  if (head < 0 || head >= c.num_qo_heads) {
    throw Error(std::string("StaticBlockSparseConfig::") + who + ": head = " + std::to_string(head) +
                " lies outside [0, num_qo_heads = " + std::to_string(c.num_qo_heads) + ")");
  }
  return pattern;
}
}  // namespace

bool StaticBlockSparseConfig::keeps(int32_t head, int64_t query_block, int64_t key_block) const {
  const detail::StaticPattern pattern = checked_head(*this, "keeps", head);
  if (query_block < 0 || key_block < 0) {
    throw Error("StaticBlockSparseConfig::keeps: query_block = " + std::to_string(query_block) +
                " and key_block = " + std::to_string(key_block) + " must not be negative");
  }
  return detail::static_block_kept(pattern, head, query_block, key_block);
}

int64_t StaticBlockSparseConfig::kept_blocks(int32_t head, int64_t kv_len) const {
  return detail::static_kept_blocks(checked_head(*this, "kept_blocks", head), head, kv_len).count();
}

int64_t StaticBlockSparseConfig::kept_tokens(int32_t head, int64_t kv_len) const {
  return detail::static_kept_tokens(checked_head(*this, "kept_tokens", head), head, kv_len);
}

namespace {
// The layer's configuration, checked before anything is allocated.
const StaticBlockSparseConfig& checked_config(Device device, const StaticBlockSparseConfig& c, int32_t batch) {
  if (batch < 1) throw Error("StaticBlockSparseAttention: batch = " + std::to_string(batch) + " must be at least 1");
  if (c.num_kv_heads < 1 || c.num_qo_heads < 1 || c.num_qo_heads % c.num_kv_heads != 0 || c.head_dim < 1 ||
      c.block_size < 1 || c.local_blocks < 1 || c.vert_stride < 1 || c.capacity_step < 1) {
    throw Error("StaticBlockSparseAttention: need num_qo_heads a positive multiple of num_kv_heads, and head_dim, "
                "block_size, local_blocks, vert_stride and capacity_step >= 1 (got " +
                std::to_string(c.num_qo_heads) + " query heads over " + std::to_string(c.num_kv_heads) + ", head_dim " +
                std::to_string(c.head_dim) + ", block_size " + std::to_string(c.block_size) + ", local_blocks " +
                std::to_string(c.local_blocks) + ", vert_stride " + std::to_string(c.vert_stride) + ")");
  }
  // Both CUDA paths (fused and mask) run the same tile instantiations; a
  // build without CUDA says so at the first allocation instead.
  const bool cuda_built = cuda_built_architectures()[0] != '\0';
  if (device == Device::kCuda && cuda_built && !cuda_supports_head_dims(c.head_dim, c.head_dim, 0)) {
    throw Error("StaticBlockSparseAttention: no CUDA kernel for head_dim " + std::to_string(c.head_dim) +
                " (the kernels take 64, 128 or 256)");
  }
  if (int64_t{batch} * c.num_qo_heads > INT32_MAX) {
    throw Error("StaticBlockSparseAttention: batch * num_qo_heads = " +
                std::to_string(int64_t{batch} * c.num_qo_heads) + " requests exceed 2^31 - 1");
  }
  return c;
}

SparseLayer::CacheShape cache_shape(const StaticBlockSparseConfig& c) {
  return {c.num_kv_heads, c.num_kv_heads, c.head_dim, c.head_dim};
}
}  // namespace

StaticBlockSparseAttention::StaticBlockSparseAttention(Device device, DType dtype,
                                                       const StaticBlockSparseConfig& config, int32_t batch,
                                                       DispatchConfig dispatch)
    : LayerForms("StaticBlockSparseAttention", device, dtype, batch, KVStorage::kLayerCache,
                 cache_shape(checked_config(device, config, batch)), config.capacity_step, dispatch),
      config_(config),
      gqa_prefill_(device) {}

int64_t StaticBlockSparseAttention::max_kept_tokens(int64_t kv_len) const {
  int64_t most = 0;
  for (int32_t h = 0; h < config_.num_qo_heads; ++h) most = std::max(most, config_.kept_tokens(h, kv_len));
  return most;
}

StepTokens StaticBlockSparseAttention::to_step(const StaticBlockSparseTokens& t) const {
  StepTokens s;
  s.q = t.q;
  s.k = t.k;
  s.v = t.v;
  s.o = t.o;
  return s;
}

SparseLayer::TokenNames StaticBlockSparseAttention::token_names() const { return {"StaticBlockSparseTokens"}; }

SparseLayer::TokenBytes StaticBlockSparseAttention::token_bytes() const {
  const size_t row = static_cast<size_t>(config_.head_dim) * dtype_size(dtype());
  TokenBytes b;
  b.q = static_cast<size_t>(config_.num_qo_heads) * row;
  b.k = static_cast<size_t>(config_.num_kv_heads) * row;
  b.v = b.k;
  b.o = b.q;
  return b;
}

// The G = 1 view of the dense cache: "sequence" s = b * num_kv_heads + k is
// the rows of (sequence b, KV head k), read by its G query heads as G
// requests with head stride 0. So request s * G + g = b * num_qo_heads + h
// (h = k * G + g), q [B, Hq, D] and o are that order already, and window
// addressing checks each position against window_lens_[s].
SparseAttentionInputs StaticBlockSparseAttention::attention_inputs(const StepTokens& tokens, int32_t /*q_len*/) const {
  const int32_t group = config_.group_size();
  auto per_kv_head = [this](RowView rows) {
    if (rows.seq_stride != int64_t{config_.num_kv_heads} * rows.head_stride) {
      throw Error("StaticBlockSparseAttention: the cache's rows are not [batch, num_kv_heads, capacity, head_dim]");
    }
    rows.seq_stride = rows.head_stride;
    rows.head_stride = 0;
    return rows;
  };
  SparseAttentionInputs in;
  in.device = device();
  in.dtype = dtype();
  in.batch = batch() * config_.num_kv_heads;
  in.num_kv_heads = group;
  in.num_qo_heads = group;
  in.live_len = live_bound();
  in.live_lens = window_lens_.as<int32_t>();
  in.k = per_kv_head(cache().k_rows().value());
  in.v = per_kv_head(cache().v_rows().value());
  in.q = tokens.q;
  in.scale = 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
  in.o = tokens.o;
  return in;
}

void StaticBlockSparseAttention::size_selection(int64_t capacity, int32_t /*q_len*/) {
  // The kept count never shrinks as the window grows, so the count at the
  // capacity bounds every step until the cache grows again.
  int64_t width = 0;
  for (int32_t h = 0; h < config_.num_qo_heads; ++h) width = std::max(width, config_.kept_blocks(h, capacity));
  if (width * config_.block_size > INT32_MAX) {
    throw Error("StaticBlockSparseAttention: " + std::to_string(width) + " kept blocks of " +
                std::to_string(config_.block_size) + " tokens at capacity " + std::to_string(capacity) +
                " exceed 2^31 tokens per request");
  }
  // The last step's rows move into the wider matrix (then -1), so
  // last_blocks() and last_selected_positions() still describe that step
  // after the cache grows between steps (an admit, reserve or append).
  const int32_t old_width = width_;
  Buffer pages(device(), static_cast<size_t>(num_requests()) * static_cast<size_t>(width) * sizeof(int32_t));
  fill_bytes(pages.data(), device(), 0xFF, pages.bytes());
  if (have_selection() && old_width > 0 && width > 0) {
    const size_t kept = static_cast<size_t>(std::min<int64_t>(old_width, width)) * sizeof(int32_t);
    copy_2d(pages.data(), device(), static_cast<size_t>(width) * sizeof(int32_t), pages_.data(), device(),
            static_cast<size_t>(old_width) * sizeof(int32_t), kept, static_cast<size_t>(num_requests()));
  }
  width_ = static_cast<int32_t>(width);
  pages_ = std::move(pages);
  if (seq_lens_.empty()) {
    seq_lens_ = Buffer(device(), static_cast<size_t>(num_requests()) * sizeof(int32_t));
    window_lens_ = Buffer(device(), static_cast<size_t>(batch()) * config_.num_kv_heads * sizeof(int32_t));
    fill_bytes(seq_lens_.data(), device(), 0, seq_lens_.bytes());
    fill_bytes(window_lens_.data(), device(), 0, window_lens_.bytes());
  }
}

PagedSelection StaticBlockSparseAttention::selection(int32_t q_len) const {
  PagedSelection s;
  s.pages = pages_.as<int32_t>();
  s.seq_lens = seq_lens_.as<int32_t>();
  s.num_requests = num_requests();
  s.width = width_;
  s.page_size = config_.block_size;
  for (int64_t len : lens_after(q_len)) s.max_selected = std::max(s.max_selected, max_kept_tokens(len));
  s.max_selected = std::min<int64_t>(s.max_selected, int64_t{width_} * config_.block_size);
  return s;
}

void StaticBlockSparseAttention::select(const StepTokens& /*tokens*/, int32_t /*q_len*/, void* stream) {
  detail::StaticPagesArgs a;
  a.pattern = detail::pattern_of(config_);
  a.kv_lens = device_lens();
  a.batch = batch();
  a.num_qo_heads = config_.num_qo_heads;
  a.num_kv_heads = config_.num_kv_heads;
  a.width = width_;
  a.pages = pages_.as<int32_t>();
  a.seq_lens = seq_lens_.as<int32_t>();
  a.window_lens = window_lens_.as<int32_t>();
  if (device() == Device::kCuda) {
    detail::static_pages_cuda(a, stream);
  } else {
    detail::static_pages_cpu(a);
  }
}

std::string StaticBlockSparseAttention::prefill_refusal(int32_t num_tokens, const std::vector<int64_t>& lens) const {
  return detail::block_chunk_refusal(config_.block_size, cache().active(), lens, num_tokens, "decode()");
}

StaticPrefillParams StaticBlockSparseAttention::prefill_pattern(const PrefillChunk& chunk) const {
  StaticPrefillParams p;
  p.chunk = chunk;
  p.num_qo_heads = config_.num_qo_heads;
  p.num_kv_heads = config_.num_kv_heads;
  p.block_size = config_.block_size;
  p.local_blocks = config_.local_blocks;
  p.vert_stride = config_.vert_stride;
  return p;
}

void StaticBlockSparseAttention::run_prefill(const StepTokens& tokens, int32_t first_slot, const PrefillChunk& chunk,
                                             void* stream) {
  const int32_t n = chunk.num_tokens, bs = config_.block_size, hq = config_.num_qo_heads;
  const int32_t blocks = (n + bs - 1) / bs;
  StaticPrefillParams sp = prefill_pattern(chunk);
  // The kept count never shrinks as the query block moves on: the count at
  // the capacity (chunk.kv_len) bounds every list until the cache grows.
  const int32_t width = static_prefill_width(sp, chunk.kv_len);
  if (blocks > prefill_sized_blocks_ || width != prefill_width_) {
    const size_t lists = static_cast<size_t>(batch()) * static_cast<size_t>(blocks) * static_cast<size_t>(hq);
    size_prefill_lists(prefill_ids_, prefill_counts_, lists, width);
    prefill_sized_blocks_ = blocks;
    prefill_width_ = width;
  }
  const int64_t list0 = int64_t{first_slot} * blocks * hq;  // a slot's lists: [num_kv_heads, blocks, group_size]
  sp.width = width;
  sp.block_ids = prefill_ids_.as<int32_t>() + list0 * width;
  sp.counts = prefill_counts_.as<int32_t>() + list0;
  static_prefill_blocks(device(), sp, stream);

  const BlockPrefillSelection kept{BlockSelectionLayout::kPerQueryHead, sp.block_ids, sp.counts, width};
  detail::run_gqa_chunk(gqa_prefill_, dtype(), slot_rows(cache().k_rows().value(), first_slot),
                        slot_rows(cache().v_rows().value(), first_slot), BlockTable{}, chunk,
                        detail::gqa_geometry(config_), tokens, kept, stream);
}

std::vector<std::vector<int32_t>> StaticBlockSparseAttention::prefill_positions(const std::vector<int64_t>& lens,
                                                                                int32_t num_tokens) const {
  const BlockPrefillSelection kept{BlockSelectionLayout::kPerQueryHead, prefill_ids_.as<int32_t>(),
                                   prefill_counts_.as<int32_t>(), prefill_width_};
  return detail::gqa_chunk_positions(device(), kept, config_.num_qo_heads, detail::gqa_geometry(config_), lens,
                                     num_tokens);
}

void StaticBlockSparseAttention::check_engine_kv(const EnginePagedKV& /*kv*/) const {
  throw Error("StaticBlockSparseAttention: the layer keeps its own cache (no engine-paged form)");
}

// The additive mask of the pattern over the capacity, from the rule and the
// device-side lengths: what the mask path attends.
void StaticBlockSparseAttention::build_mask(float* mask, int64_t pitch, void* stream) {
  detail::StaticMaskArgs a;
  a.pattern = detail::pattern_of(config_);
  a.kv_lens = device_lens();
  a.batch = batch();
  a.num_qo_heads = config_.num_qo_heads;
  a.pitch = pitch;
  a.mask = mask;
  if (device() == Device::kCuda) {
    detail::static_mask_cuda(a, stream);
  } else {
    detail::static_mask_cpu(a);
  }
}

std::vector<std::vector<int32_t>> StaticBlockSparseAttention::last_blocks() const {
  if (!have_selection()) return {};
  return detail::download_kept_blocks(device(), pages_.data(), num_requests(), width_);
}

std::vector<std::vector<int32_t>> StaticBlockSparseAttention::selected_positions() const {
  return detail::kept_block_positions(device(), last_blocks(), seq_lens_.data(), config_.block_size);
}

}  // namespace sparsepage
