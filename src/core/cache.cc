#include "sparsepage/cache.h"

#include "core/cuda_hooks.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

namespace sparsepage {
namespace {

// Largest byte count any allocation here may have: pointer differences must
// stay representable (and no machine has more).
constexpr uint64_t kMaxBytes = uint64_t{1} << 62;

// a * b for sizes, or an Error saying what did not fit.
uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& what) {
  if (a != 0 && b > kMaxBytes / a) throw Error(what + " overflows (more than 2^62 bytes)");
  return a * b;
}

DType storage_dtype(CacheMode mode) { return mode == CacheMode::kF16 ? DType::kF16 : DType::kBF16; }

// Bytes one row occupies in storage.
size_t stored_row_bytes(CacheMode mode, int32_t dim) {
  return static_cast<size_t>(dim) * dtype_size(storage_dtype(mode));
}

}  // namespace

const char* cache_mode_name(CacheMode mode) {
  switch (mode) {
    case CacheMode::kF16: return "f16";
    case CacheMode::kBF16: return "bf16";
  }
  return "unknown";
}

// K and V storage of one cache.
struct DenseKVCache::Storage {
  Buffer k, v;
  Buffer live_lens;  // int32 [B] on the cache's device
  Buffer active;     // int32 [B] on the cache's device: 1 active, 0 free
};

DenseKVCache::DenseKVCache(Device device, CacheMode mode, int32_t batch, int32_t k_heads, int32_t v_heads,
                           int32_t k_head_dim, int32_t v_head_dim, int64_t capacity_step)
    : device_(device),
      mode_(mode),
      batch_(batch),
      k_heads_(k_heads),
      v_heads_(v_heads),
      k_head_dim_(k_head_dim),
      v_head_dim_(v_head_dim),
      capacity_step_(capacity_step),
      storage_(std::make_shared<Storage>()) {
  if (batch < 1 || k_heads < 1 || v_heads < 0 || k_head_dim < 1 || v_head_dim < 1 || capacity_step < 1) {
    throw Error("DenseKVCache: batch, K heads, head dims and capacity_step must be at least 1 and V heads at least 0 "
                "(got batch " +
                std::to_string(batch) + ", heads " + std::to_string(k_heads) + "/" + std::to_string(v_heads) +
                ", dims " + std::to_string(k_head_dim) + "/" + std::to_string(v_head_dim) + ", step " +
                std::to_string(capacity_step) + ")");
  }
  if (mode != CacheMode::kF16 && mode != CacheMode::kBF16) {
    throw Error("DenseKVCache: mode " + std::to_string(static_cast<int32_t>(mode)) + " is not a CacheMode");
  }
  lens_.assign(static_cast<size_t>(batch), 0);
  active_.assign(static_cast<size_t>(batch), 1);
  storage_->live_lens = Buffer(device, static_cast<size_t>(batch) * sizeof(int32_t));
  storage_->active = Buffer(device, static_cast<size_t>(batch) * sizeof(int32_t));
  write_device_state();
}

int64_t DenseKVCache::live_len() const {
  int64_t longest = 0;
  for (size_t b = 0; b < lens_.size(); ++b) {
    if (active_[b]) longest = std::max(longest, lens_[b]);
  }
  return longest;
}

// The host's lengths and activity, uploaded (synchronous).
void DenseKVCache::write_device_state() {
  std::vector<int32_t> lens(lens_.begin(), lens_.end()), active(active_.begin(), active_.end());
  copy_bytes(storage_->live_lens.data(), device_, lens.data(), Device::kCpu, lens.size() * sizeof(int32_t));
  copy_bytes(storage_->active.data(), device_, active.data(), Device::kCpu, active.size() * sizeof(int32_t));
}

// The device's lengths into the host's copy, as they are (no check: a
// slot an append flagged keeps its -1, which the next step flags again).
void DenseKVCache::read_device_lens() {
  const auto lens = download<int32_t>(device_, storage_->live_lens.data(), static_cast<size_t>(batch_));
  lens_.assign(lens.begin(), lens.end());
}

void DenseKVCache::check_slot(int32_t slot, const char* who) const {
  if (slot < 0 || slot >= batch_) {
    throw Error(std::string(who) + ": slot = " + std::to_string(slot) +
                " is outside [0, batch = " + std::to_string(batch_) + ")");
  }
}

void DenseKVCache::admit(int32_t slot, const void* k_new, const void* v_new, int64_t tokens, void* stream) {
  check_slot(slot, "DenseKVCache::admit");
  if (tokens < 0 || tokens > INT32_MAX) {
    throw Error("DenseKVCache::admit: tokens = " + std::to_string(tokens) + " must lie in [0, 2^31 - 1]");
  }
  if (tokens > 0 && (k_new == nullptr || (v_new == nullptr && v_heads_ > 0))) {
    throw Error("DenseKVCache::admit: k_new and v_new must not be null");
  }
  if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
  read_device_lens();  // replayed steps advanced the slots on the device only
  // A slot still holding a request is released first: admitting over it
  // would drop that request's rows without a word.
  if (active_[static_cast<size_t>(slot)] != 0 && lens_[static_cast<size_t>(slot)] > 0) {
    throw Error("DenseKVCache::admit: slot " + std::to_string(slot) + " holds a running request of " +
                std::to_string(lens_[static_cast<size_t>(slot)]) + " tokens; release it first");
  }
  grow_to(tokens);  // may throw: nothing has changed yet
  const auto write = [&](const void* src, Buffer& dst, int32_t heads, int32_t dim) {
    if (tokens == 0 || heads == 0) return;
    const size_t row_bytes = stored_row_bytes(mode_, dim);
    copy_2d(static_cast<char*>(dst.data()) + static_cast<size_t>(int64_t{slot} * heads * capacity_) * row_bytes,
            device_, static_cast<size_t>(capacity_) * row_bytes, src, device_, static_cast<size_t>(tokens) * row_bytes,
            static_cast<size_t>(tokens) * row_bytes, static_cast<size_t>(heads));
  };
  write(k_new, storage_->k, k_heads_, k_head_dim_);
  write(v_new, storage_->v, v_heads_, v_head_dim_);
  lens_[static_cast<size_t>(slot)] = tokens;
  active_[static_cast<size_t>(slot)] = 1;
  write_device_state();
}

void DenseKVCache::release(int32_t slot, void* stream) {
  check_slot(slot, "DenseKVCache::release");
  if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
  read_device_lens();  // replayed steps advanced the other slots on the device only
  lens_[static_cast<size_t>(slot)] = 0;
  active_[static_cast<size_t>(slot)] = 0;
  write_device_state();
}

void DenseKVCache::reserve(int64_t tokens) {
  if (tokens < 0 || tokens > INT32_MAX) {
    throw Error("DenseKVCache::reserve: tokens = " + std::to_string(tokens) + " must lie in [0, 2^31 - 1]");
  }
  grow_to(tokens);
}

const int32_t* DenseKVCache::device_live_lens() const { return storage_->live_lens.as<int32_t>(); }

void DenseKVCache::append_token(const void* k_new, const void* v_new, void* stream) {
  append_rows(k_new, v_new, 1, stream, "DenseKVCache::append_token");
}

void DenseKVCache::append_step_tokens(const void* k_new, const void* v_new, int32_t tokens, void* stream) {
  append_rows(k_new, v_new, tokens, stream, "DenseKVCache::append_step_tokens");
}

void DenseKVCache::append_rows(const void* k_new, const void* v_new, int32_t tokens, void* stream, const char* who) {
  if (tokens < 1) throw Error(std::string(who) + ": tokens = " + std::to_string(tokens) + " must be at least 1");
  if (k_new == nullptr || (v_new == nullptr && v_heads_ > 0)) {
    throw Error(std::string(who) + ": k_new and v_new must not be null");
  }
  if (live_len() + tokens > capacity_) {
    throw Error(std::string(who) + ": live_len = " + std::to_string(live_len()) + " plus " + std::to_string(tokens) +
                (tokens == 1 ? " token" : " tokens") + " exceeds capacity " + std::to_string(capacity_) +
                "; reserve() before the step");
  }
  const size_t esize = dtype_size(storage_dtype(mode_));
  detail::AppendTokenArgs a;
  a.k = storage_->k.data();
  a.v = storage_->v.data();
  a.k_new = k_new;
  a.v_new = v_new;
  a.live_lens = storage_->live_lens.as<int32_t>();
  a.active = storage_->active.as<int32_t>();
  a.batch = batch_;
  a.k_heads = k_heads_;
  a.v_heads = v_heads_;
  a.k_row_bytes = static_cast<int64_t>(k_head_dim_ * esize);
  a.v_row_bytes = static_cast<int64_t>(v_head_dim_ * esize);
  a.capacity = capacity_;
  a.tokens = tokens;
  const auto advance_host = [&] {
    for (size_t b = 0; b < lens_.size(); ++b) {
      if (active_[b]) lens_[b] += tokens;
    }
  };
  if (device_ == Device::kCuda) {
    detail::append_token_cuda(a, stream);
    if (!detail::cuda_stream_capturing(stream)) advance_host();
    return;
  }
  // Host: the same rule, one sequence at a time.
  for (int32_t b = 0; b < batch_; ++b) {
    const int64_t t = a.live_lens[b];
    if (a.active[b] && (t < 0 || t + tokens > capacity_)) {
      throw Error(std::string(who) + ": sequence length outside the capacity");
    }
  }
  for (int32_t b = 0; b < batch_; ++b) {
    if (!a.active[b]) continue;
    const int64_t t = a.live_lens[b];
    auto put = [&](void* dst, const void* src, int32_t heads, int64_t row_bytes) {
      for (int32_t i = 0; i < tokens; ++i) {
        for (int32_t h = 0; h < heads; ++h) {
          std::memcpy(static_cast<char*>(dst) + ((int64_t{b} * heads + h) * capacity_ + t + i) * row_bytes,
                      static_cast<const char*>(src) + ((int64_t{i} * batch_ + b) * heads + h) * row_bytes,
                      static_cast<size_t>(row_bytes));
        }
      }
    };
    put(a.k, k_new, k_heads_, a.k_row_bytes);
    put(a.v, v_new, v_heads_, a.v_row_bytes);
    a.live_lens[b] = static_cast<int32_t>(t + tokens);
  }
  advance_host();
}

void DenseKVCache::sync_live_len(void* stream) {
  if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
  const std::vector<int32_t> lens = download<int32_t>(device_, storage_->live_lens.data(), static_cast<size_t>(batch_));
  for (size_t b = 0; b < lens.size(); ++b) {
    if (lens[b] < 0 || lens[b] > capacity_) {
      throw Error("DenseKVCache::sync_live_len: sequence " + std::to_string(b) + "'s device length " +
                  std::to_string(lens[b]) + " lies outside [0, capacity = " + std::to_string(capacity_) + "]" +
                  (lens[b] == -1 ? " (an append found no room: a captured step replayed past the capacity reserved "
                                   "before capture; nothing was written)"
                                 : ""));
    }
  }
  lens_.assign(lens.begin(), lens.end());
}

void DenseKVCache::grow_to(int64_t needed) {
  if (needed <= capacity_) return;
  // Round up without wrapping: a capacity_step near 2^60 used to wrap the
  // capacity and then the byte size, and writes went far past the allocation.
  const int64_t steps = needed / capacity_step_ + (needed % capacity_step_ != 0 ? 1 : 0);
  if (steps > std::numeric_limits<int64_t>::max() / capacity_step_) {
    throw Error("DenseKVCache: growing to " + std::to_string(needed) +
                " tokens in steps of capacity_step = " + std::to_string(capacity_step_) + " overflows the capacity");
  }
  const int64_t new_capacity = steps * capacity_step_;
  // Every byte count below, checked before anything is allocated or copied.
  const auto bytes_of = [&](int32_t heads, size_t row_bytes) {
    return static_cast<size_t>(checked_mul(
        checked_mul(checked_mul(static_cast<uint64_t>(batch_), static_cast<uint64_t>(heads), "DenseKVCache size"),
                    static_cast<uint64_t>(new_capacity),
                    "DenseKVCache: capacity " + std::to_string(new_capacity) +
                        " (capacity_step = " + std::to_string(capacity_step_) + ")"),
        row_bytes, "DenseKVCache: capacity " + std::to_string(new_capacity) + " times the row size"));
  };
  bytes_of(k_heads_, stored_row_bytes(mode_, k_head_dim_));
  bytes_of(v_heads_, stored_row_bytes(mode_, v_head_dim_));
  auto grown = std::make_shared<Storage>();
  // Rows no token has reached yet are zeros, never uninitialized memory: a
  // later growth copies them, and host copies of the window read them.
  auto regrow = [&](Buffer& old, Buffer& fresh, int32_t heads, size_t row_bytes) {
    fresh = Buffer(device_, bytes_of(heads, row_bytes));
    fill_bytes(fresh.data(), device_, 0, fresh.bytes());
    copy_2d(fresh.data(), device_, static_cast<size_t>(new_capacity) * row_bytes, old.data(), device_,
            static_cast<size_t>(capacity_) * row_bytes, static_cast<size_t>(live_len()) * row_bytes,
            static_cast<size_t>(batch_) * heads);
  };
  regrow(storage_->k, grown->k, k_heads_, stored_row_bytes(mode_, k_head_dim_));
  regrow(storage_->v, grown->v, v_heads_, stored_row_bytes(mode_, v_head_dim_));
  grown->live_lens = std::move(storage_->live_lens);
  grown->active = std::move(storage_->active);
  storage_ = std::move(grown);  // views made earlier keep the old storage alive
  capacity_ = new_capacity;
}

void DenseKVCache::append(const void* k_new, const void* v_new, DType input_dtype, int64_t new_tokens) {
  if (new_tokens < 0) throw Error("DenseKVCache::append: new_tokens = " + std::to_string(new_tokens) + " < 0");
  if (new_tokens > 0 && (k_new == nullptr || (v_new == nullptr && v_heads_ > 0))) {
    throw Error("DenseKVCache::append: k_new and v_new must not be null");
  }
  if (input_dtype != storage_dtype(mode_)) {
    throw Error(std::string("DenseKVCache::append: input dtype ") + dtype_name(input_dtype) + " does not match the " +
                cache_mode_name(mode_) + " cache");
  }
  if (new_tokens > std::numeric_limits<int32_t>::max() - live_len()) {
    throw Error("DenseKVCache::append: new_tokens = " + std::to_string(new_tokens) +
                " would take the live length past 2^31 - 1 tokens");
  }
  grow_to(live_len() + new_tokens);
  // Whether one strided copy covers every slot: all active at one length.
  bool uniform = true;
  for (size_t b = 0; b < lens_.size(); ++b) uniform = uniform && active_[b] && lens_[b] == lens_[0];
  auto write = [&](const void* src, Buffer& dst, int32_t heads, int32_t dim) {
    if (new_tokens == 0 || heads == 0) return;  // also: no pointer arithmetic on an absent V
    const size_t row_bytes = stored_row_bytes(mode_, dim);
    const size_t src_bytes = static_cast<size_t>(new_tokens) * row_bytes;  // one (slot, head)'s new rows
    if (uniform) {
      copy_2d(static_cast<char*>(dst.data()) + static_cast<size_t>(lens_[0]) * row_bytes, device_,
              static_cast<size_t>(capacity_) * row_bytes, src, device_, src_bytes, src_bytes,
              static_cast<size_t>(batch_) * heads);
      return;
    }
    for (int32_t b = 0; b < batch_; ++b) {
      if (!active_[static_cast<size_t>(b)]) continue;
      const int64_t at = lens_[static_cast<size_t>(b)];
      copy_2d(static_cast<char*>(dst.data()) + static_cast<size_t>(int64_t{b} * heads * capacity_ + at) * row_bytes,
              device_, static_cast<size_t>(capacity_) * row_bytes,
              static_cast<const char*>(src) + static_cast<size_t>(b) * heads * src_bytes, device_, src_bytes, src_bytes,
              static_cast<size_t>(heads));
    }
  };
  write(k_new, storage_->k, k_heads_, k_head_dim_);
  write(v_new, storage_->v, v_heads_, v_head_dim_);
  for (size_t b = 0; b < lens_.size(); ++b) {
    if (active_[b]) lens_[b] += new_tokens;
  }
  write_device_state();
}

DType DenseKVCache::dtype() const { return storage_dtype(mode_); }

std::optional<RowView> DenseKVCache::k_rows() const {
  if (capacity_ == 0) return std::nullopt;
  return RowView::dense(storage_->k.data(), k_heads_, capacity_, k_head_dim_);
}

std::optional<RowView> DenseKVCache::v_rows() const {
  if (capacity_ == 0 || v_heads_ == 0) return std::nullopt;
  return RowView::dense(storage_->v.data(), v_heads_, capacity_, v_head_dim_);
}

DenseKVCache::DenseKVCache(const DenseKVCache& other)
    : device_(other.device_),
      mode_(other.mode_),
      batch_(other.batch_),
      k_heads_(other.k_heads_),
      v_heads_(other.v_heads_),
      k_head_dim_(other.k_head_dim_),
      v_head_dim_(other.v_head_dim_),
      capacity_step_(other.capacity_step_),
      capacity_(other.capacity_),
      lens_(other.lens_),
      active_(other.active_),
      storage_(std::make_shared<Storage>()) {
  // A copy owns its rows: appending to one never shows in the other.
  if (!other.storage_) return;  // a moved-from cache: nothing to copy
  auto clone = [&](const Buffer& from, Buffer& to) {
    to = Buffer(from.device(), from.bytes());
    if (from.bytes() > 0) copy_bytes(to.data(), to.device(), from.data(), from.device(), from.bytes());
  };
  clone(other.storage_->k, storage_->k);
  clone(other.storage_->v, storage_->v);
  clone(other.storage_->live_lens, storage_->live_lens);
  clone(other.storage_->active, storage_->active);
}

DenseKVCache& DenseKVCache::operator=(const DenseKVCache& other) {
  if (this != &other) *this = DenseKVCache(other);
  return *this;
}

}  // namespace sparsepage
