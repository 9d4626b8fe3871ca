// KV caches and how they become pools of rows (docs/DESIGN.md: dense caches as pools).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/memory.h"
#include "sparsepage/page_table.h"
#include "sparsepage/types.h"

namespace sparsepage {

/// Storage mode of a dense cache: the element type its K and V rows are
/// stored (and appended) in.
enum class CacheMode : int32_t { kF16, kBF16 };
const char* cache_mode_name(CacheMode mode);

/// A dense cache `[B, H, Cap, D]` growing `Cap` in steps of `capacity_step`.
/// K and V may differ in heads (K may carry extra heads after the attention
/// heads) and in head_dim. `v_heads` = 0 makes a key-only cache (what a layer
/// keeps for its indexer when an engine's pool holds the attention rows):
/// V arguments are ignored and may be null, and `v_rows()` is empty.
///
/// Sequences are slots. Each slot has its own live length (on the host and
/// on the device) and is active or free: the serving-step appends write the
/// active slots only, so a batch can be ragged and requests can join
/// (`admit`) and leave (`release`) between steps while a captured step keeps
/// replaying. A new cache has every slot active at length 0 (a lockstep
/// batch). Rows past a slot's live length are unspecified.
class DenseKVCache {
 public:
  DenseKVCache(Device device, CacheMode mode, int32_t batch, int32_t k_heads, int32_t v_heads, int32_t k_head_dim,
               int32_t v_head_dim, int64_t capacity_step = 256);

  /// A copy owns a copy of the rows (device to device on CUDA): appending
  /// to one never changes the other.
  DenseKVCache(const DenseKVCache& other);
  DenseKVCache& operator=(const DenseKVCache& other);
  DenseKVCache(DenseKVCache&&) noexcept = default;
  DenseKVCache& operator=(DenseKVCache&&) noexcept = default;

  /// Appends `new_tokens` tokens to every active slot, each at its own
  /// length (live lengths stay below 2^31): `k_new` is `[B, k_heads,
  /// new_tokens, k_head_dim]` and `v_new` `[B, v_heads, new_tokens,
  /// v_head_dim]`, contiguous, in `input_dtype`, on the cache's device; the
  /// rows of free slots are skipped. input_dtype must be the storage dtype.
  /// Read the rows back through `k_rows()`/`v_rows()`. Synchronous.
  void append(const void* k_new, const void* v_new, DType input_dtype, int64_t new_tokens);

  /// Starts a request in slot `slot`: its prompt's `tokens` rows (`k_new`
  /// `[k_heads, tokens, k_head_dim]`, `v_new` `[v_heads, tokens,
  /// v_head_dim]`, contiguous, on the cache's device) become rows
  /// 0 .. tokens - 1, its length becomes `tokens` and the slot is active
  /// (tokens = 0 starts an empty request). Grows the capacity when it must.
  /// Waits for the work queued on `stream` first (a replayed step may still
  /// read the slot) and takes the other slots' lengths from the device (so
  /// replayed steps need no sync_live_len() first), then copies
  /// synchronously: not a step. A slot still holding a request (active,
  /// length > 0) is refused by name: release() it first.
  void admit(int32_t slot, const void* k_new, const void* v_new, int64_t tokens, void* stream = nullptr);
  /// Ends the request in slot `slot`: length 0, inactive. Later steps skip
  /// it until it is admitted again. Waits for `stream` first, like admit().
  void release(int32_t slot, void* stream = nullptr);

  /// Makes room for `tokens` live tokens per slot (allocates and copies only
  /// when it must grow). A step captured in a CUDA graph keeps the
  /// allocation it was captured with, so reserve the longest context before
  /// capturing.
  void reserve(int64_t tokens);

  /// The serving-step append: one token per active
  /// slot, `k_new` `[B, k_heads, 1, k_head_dim]` and `v_new` `[B, v_heads, 1,
  /// v_head_dim]` in the storage dtype on the cache's device (rows of free
  /// slots are not read), written at each slot's device-side live length
  /// (`device_live_lens()`), which then grows by one. On CUDA it is one
  /// kernel on `stream`: no allocation, no synchronization, no host read, so
  /// it can be captured in a CUDA graph and replayed while the lengths grow.
  /// Needs every active slot's length below capacity() (reserve first; it
  /// throws otherwise). The host lengths advance with it, except while
  /// `stream` is capturing: after replaying captured steps, call
  /// sync_live_len().
  void append_token(const void* k_new, const void* v_new, void* stream = nullptr);
  /// A multi-token step's append (speculative verification, MTP): `tokens`
  /// tokens per active slot in one launch. `k_new` is `[tokens, B, k_heads,
  /// 1, k_head_dim]` and `v_new` `[tokens, B, v_heads, 1, v_head_dim]`: token
  /// i's slice is what append_token takes, and it lands at row `length + i`
  /// of each slot, `length` its device-side live length, which then grows
  /// by `tokens`. Bit-equal to `tokens` append_token calls; the same rules
  /// (one kernel, capturable, lengths advance unless capturing), and it
  /// needs 1 <= tokens and each active length + tokens <= capacity().
  void append_step_tokens(const void* k_new, const void* v_new, int32_t tokens, void* stream = nullptr);
  /// Per-slot live lengths [batch] int32 on the cache's device: what
  /// kernels read to know how far each sequence has grown.
  const int32_t* device_live_lens() const;
  /// Reads the device-side lengths back into live_lens() (synchronizes);
  /// needed after replaying captured append_token steps.
  void sync_live_len(void* stream = nullptr);

  /// Where the rows live, as the kernels read them: `RowView::dense` over
  /// the `[batch, k_heads, capacity, k_head_dim]` (or V's) allocation, so
  /// row t of (sequence b, head h) is at `offset(b, h, t)`; the head stride
  /// is the capacity, never the live length. Nothing before the first
  /// allocation. The view stays valid until the cache grows.
  std::optional<RowView> k_rows() const;
  std::optional<RowView> v_rows() const;

  CacheMode mode() const { return mode_; }
  Device device() const { return device_; }
  /// The longest live length over the active slots (0 when none is active):
  /// the length of every sequence in a lockstep batch.
  int64_t live_len() const;
  /// Each slot's live length, as the host last knew it (see sync_live_len).
  const std::vector<int64_t>& live_lens() const { return lens_; }
  /// Each slot's activity (admit / release).
  const std::vector<uint8_t>& active() const { return active_; }
  int64_t capacity() const { return capacity_; }
  /// Element type of the rows: the storage dtype.
  DType dtype() const;
  int32_t batch() const { return batch_; }
  int32_t k_heads() const { return k_heads_; }
  int32_t v_heads() const { return v_heads_; }
  int32_t k_head_dim() const { return k_head_dim_; }
  int32_t v_head_dim() const { return v_head_dim_; }

 private:
  struct Storage;
  void grow_to(int64_t needed);
  void write_device_state();
  void read_device_lens();
  void check_slot(int32_t slot, const char* who) const;
  void append_rows(const void* k_new, const void* v_new, int32_t tokens, void* stream, const char* who);
  Device device_;
  CacheMode mode_;
  int32_t batch_, k_heads_, v_heads_, k_head_dim_, v_head_dim_;
  int64_t capacity_step_;
  int64_t capacity_ = 0;
  std::vector<int64_t> lens_;    // [batch] host copy of each slot's live length
  std::vector<uint8_t> active_;  // [batch] 1 active, 0 free
  std::shared_ptr<Storage> storage_;
};

}  // namespace sparsepage
