// The layer skeleton (docs/DESIGN.md: serving steps). Every sparse-attention
// layer runs the same step: append this step's rows at each sequence's
// device-side length, select (an indexer, or a fixed pattern), decide, then
// attend the selection through the fused paged decode, or the mask path
// over the same set when the policy declines. SparseLayer owns that step,
// the cache (or reads an engine's pools), the decoders, the mask-path
// fallback, the continuous batch and the phase events; a model supplies a
// few hooks (its selection, its attention inputs, its mask). A new model is
// one file of hooks (tests/cpu/layer_skeleton_test.cc adds a toy one).
//
// The batch is a set of slots (continuous batching): each slot has its own
// length on the device, requests join with admit() and leave with
// release(), and every per-sequence rule (the window, the sparse regime,
// the kept count) is applied on the device. So one captured step replays
// correctly while the lengths change and requests come and go, up to the
// capacity reserved before the capture.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/prefill.h"
#include "sparsepage/sparse_decode.h"

namespace sparsepage {

/// One step's per-token inputs, by role; each model's token struct says
/// which it uses and converts to this. All on the layer's device.
struct StepTokens {
  const void* q = nullptr;               // [batch, q_len, num_qo_heads, dim]
  const void* q_extra = nullptr;         // [batch, q_len, num_qo_heads, extra_dim] (MLA rope queries) or null
  const void* index_q = nullptr;         // the indexer's queries, [batch, q_len, ...] or null
  const float* index_weights = nullptr;  // the indexer's weights, [batch, q_len, ...] or null
  const void* k = nullptr;               // this step's cache K rows, [q_len, batch, k_heads, 1, k_dim]
  const void* v = nullptr;               // this step's cache V rows, [q_len, batch, v_heads, 1, v_dim] or null
  const void* index_k = nullptr;         // engine-paged layers: this step's index keys [batch, 1, 1, dim]
  void* o = nullptr;                     // [batch, q_len, num_qo_heads, v_dim]
};

/// What a step did.
struct LayerStep {
  /// Some sequence's selection left something out (by the host's lengths;
  /// inside a captured step the lengths at capture time).
  bool sparse = false;
  bool fused = false;           // the fused paged decode ran (else the mask path)
  SparseDecodeOutcome outcome;  // the policy's outcome
};

/// The skeleton. Public: the batch, the cache and inspection of the last
/// step; a model derives from LayerForms (below) over its token struct,
/// which gives it the typed decode() and prefill() forms.
class SparseLayer {
 public:
  /// The rows the layer keeps per slot: its own cache's heads and dims.
  struct CacheShape {
    int32_t k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0;
  };
  /// The bytes one (sequence, token) takes in each StepTokens field, for
  /// the token-by-token form of a multi-token step (0: the field is unused).
  struct TokenBytes {
    size_t q = 0, q_extra = 0, index_q = 0, index_weights = 0, k = 0, v = 0, o = 0;
  };
  virtual ~SparseLayer();
  SparseLayer(const SparseLayer&) = delete;
  SparseLayer& operator=(const SparseLayer&) = delete;

  /// The model's name, which every error of the layer starts with.
  const std::string& name() const { return name_; }
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }
  /// Slots of the batch.
  int32_t batch() const { return batch_; }
  KVStorage kv_storage() const { return storage_; }

  /// Makes room for `tokens` live tokens per slot and sizes the step's
  /// buffers for them, so steps up to that length allocate nothing (do it
  /// before capturing a step).
  void reserve(int64_t tokens);
  /// Appends `tokens` tokens to every active slot without attending (a
  /// lockstep prompt whose prefill attention ran elsewhere), in the cache's
  /// row layout: k [batch, cache K heads, tokens, dim], v likewise (null for
  /// an engine-paged layer, whose k is the index keys [batch, 1, tokens,
  /// dim]). Contiguous, on the layer's device. Synchronous; not a step.
  void append_tokens(const void* k, const void* v, int64_t tokens);
  /// Starts a request in slot `slot` with its prompt's rows (k [cache K
  /// heads, tokens, dim], v likewise; the same forms as append_tokens for
  /// one sequence), whose prefill ran elsewhere. The slot's length becomes
  /// `tokens` and later steps extend it. Waits for `stream` first; not a
  /// step (engines admit between steps). A slot still holding a request is
  /// refused by name (release() it first).
  void admit(int32_t slot, const void* k, const void* v, int64_t tokens, void* stream = nullptr);
  /// Ends the request in slot `slot`: later steps skip it (its output rows
  /// are zero) until admit() reuses it.
  void release(int32_t slot, void* stream = nullptr);
  /// After replaying captured steps: reads the device-side lengths back
  /// (synchronizes).
  void sync_live_len(void* stream = nullptr) {
    if (!engine_pools()) cache_.sync_live_len(stream);
  }
  /// The longest active sequence (a lockstep batch's length).
  int64_t kv_len() const { return cache_.live_len(); }
  /// Each slot's length as the host knows it.
  const std::vector<int64_t>& kv_lens() const { return cache_.live_lens(); }
  const DenseKVCache& cache() const { return cache_; }

  /// Profiling: CUDA events (cudaEvent_t, or null) each step records on its
  /// stream after the append and after the selection, so a benchmark can
  /// split a step's time. Recorded inside captured steps too.
  void set_phase_events(void* after_append, void* after_select) {
    after_append_ = after_append;
    after_select_ = after_select;
  }

  /// Positions the last step's page table attends, per request (a host
  /// copy for tests and debugging; reads after the default stream).
  std::vector<std::vector<int32_t>> last_selected_positions() const;
  /// Synchronizes and throws Error naming what the last steps' kernels
  /// flagged on the device (a position outside its window, a length out of
  /// range, an engine block id outside its pool), clearing the flags. Steps
  /// never read back, so a serving loop calls this when it chooses to.
  void check_errors(void* stream = nullptr);
  /// Positions the last prefill chunk attended (a host copy for tests and
  /// debugging; reads after the default stream): one row per (slot, chunk
  /// token, query head) for the GQA layers, per (slot, chunk token) for
  /// DSA, rows of free slots empty. Each row holds the kept positions up to
  /// the token's own, sorted. Empty before the first chunk.
  std::vector<std::vector<int32_t>> last_prefill_positions() const;
  /// Columns the mask path keeps for the last step (its mask's 0 entries),
  /// built on the layer's device from the same selection. Throws before
  /// the first step and for engine-paged layers (no mask path there).
  std::vector<std::vector<int32_t>> last_mask_columns();

 protected:
  SparseLayer(std::string name, Device device, DType dtype, int32_t batch, KVStorage storage, CacheShape cache_shape,
              int64_t capacity_step, DispatchConfig dispatch);

  /// The one-token step over the layer's own cache.
  LayerStep step(const StepTokens& tokens, void* stream);
  /// A multi-token step (1 <= q_len <= max_query_tokens()): fused when the
  /// policy agrees, else q_len one-token steps through staging copies
  /// (exact, but synchronizing: only the fused form can be captured).
  LayerStep step(const StepTokens& tokens, int32_t q_len, void* stream);
  /// Prefill through the mask path, one token per active slot: appends it
  /// and attends the whole causal window (dense). The oracle of prefill.
  void prefill_step(const StepTokens& tokens, void* stream);
  /// Chunked prefill through the model's fused sparse prefill: appends
  /// `num_tokens` tokens to every active slot (each chunk is the last
  /// num_tokens positions of its sequence; slots may differ in length), runs
  /// the model's prefill indexer over the chunk, then its fused prefill
  /// kernel, writing o for every chunk token. A chunk the fused prefill
  /// cannot take is refused by name before anything changes (no fallback:
  /// the model's prefill_token() or decode() serve those). Inputs as the
  /// multi-token step's: q, q_extra, index_q, index_weights and o [batch,
  /// num_tokens, ...], k and v token-major [num_tokens, batch, heads, 1,
  /// dim]. Rows of free slots are not read; their o rows are zeroed.
  void prefill_chunk(const StepTokens& tokens, int32_t num_tokens, void* stream);
  /// Chunked prefill over an engine's paged pool (KVStorage::kEnginePaged):
  /// the engine has written the chunk's K/V rows into `kv` at each active
  /// slot's positions kv_lens()[b] .. + num_tokens - 1; appends the chunk's
  /// index keys (tokens.index_k, token-major [num_tokens, batch, 1, 1, dim];
  /// k and v null), runs the model's prefill indexer over them, then its
  /// fused prefill reading the rows through kv.block_table (row b for slot
  /// b; row_of_sequence null). Refused by name before anything changes as
  /// prefill_chunk is, and besides: a table row too short for a slot's
  /// length, on the CPU a block id outside the pool (on CUDA the kernels
  /// flag it and check_errors() names it).
  /// An engine-pools layer appends nothing: the engine has written the
  /// chunk's rows and index keys (kv.index_keys) and passes each slot's
  /// length with the chunk in kv.seq_lens (0: a free slot, whose o rows are
  /// zeroed; else at least num_tokens); tokens.index_k stays null. The
  /// prefill indexers read the keys through kv.index_keys' table (native or
  /// FP8). The chunk's shape (its active slots, its refusals, one launch or
  /// one per active slot) is decided on the host: on kv.host_seq_lens, the
  /// engine's host copy of the lengths, when given (nothing read back;
  /// capturable), else on kv.seq_lens read back once (a stream sync,
  /// refused by name while the stream is captured). A length outside
  /// [num_tokens, max_seq_len] is refused by name (on the CPU, so is a host
  /// copy that differs from kv.seq_lens). Capture: with kv.host_seq_lens, a
  /// chunk can be captured in a CUDA graph after one eager chunk of the same
  /// shape (num_tokens, max_seq_len, the same slots in the call) and
  /// replayed for the next chunks. A replay keeps the slot set, refusals and
  /// path decided at capture, and its kernels follow kv.seq_lens on the
  /// device, so the engine keeps fixed the slots in the call (nonzero) and
  /// out of it (0), num_tokens, max_seq_len and every buffer kv and tokens
  /// point at, and keeps each replayed length in [num_tokens, max_seq_len]
  /// within its table rows (block-sparse: the chunk starting on a multiple
  /// of block_size). The layer keeps the plans of one chunk shape: an
  /// uncaptured chunk of another shape (another num_tokens or max_seq_len,
  /// or every slot in the call where the capture had one out, or the
  /// reverse) re-plans and frees what the captured chunk reads, so capture
  /// it again before the next replay.
  void prefill_chunk(const StepTokens& tokens, const EnginePagedKV& kv, int32_t num_tokens, void* stream);
  /// The one-token step over an engine's paged pool (engine-paged layers):
  /// no mask path, so a step the policy would decline is refused by name
  /// before anything changes. An engine-pools layer appends nothing and
  /// reads the lengths and index keys `kv` carries.
  LayerStep step(const StepTokens& tokens, const EnginePagedKV& kv, void* stream);

  // ---- the model's hooks ----
  /// The model's names for the StepTokens pointers it takes (null: an input
  /// it has none of), for the skeleton's refusals of a step's tokens.
  struct TokenNames {
    const char* tokens;  // the model's token struct, e.g. "BlockSparseTokens"
    const char* q = "q";
    const char* q_extra = nullptr;
    const char* index_q = nullptr;
    const char* index_weights = nullptr;
    const char* k = "k";
    const char* v = "v";
    const char* o = "o";
    /// Engine forms (EngineLayerForms): over an engine's pool k and v are
    /// null and index_k is set (engine-paged) or null too (engine pools).
    bool engine_forms = false;
  };
  virtual TokenNames token_names() const = 0;
  virtual TokenBytes token_bytes() const = 0;
  /// The most query tokens a fused step takes (1: no multi-token steps).
  virtual int32_t max_query_tokens() const { return 1; }
  /// Why a step of q_len tokens per slot is refused whatever its path (a
  /// kernel's limit on this model's shape); empty when it is not.
  virtual std::string query_tokens_refusal(int32_t /*q_len*/) const { return {}; }
  /// The attention inputs over the layer's own rows for a step of q_len
  /// tokens (shapes, queries, scale, output; lengths read on the device).
  virtual SparseAttentionInputs attention_inputs(const StepTokens& tokens, int32_t q_len) const = 0;
  /// Sizes the selection buffers for `capacity` tokens per slot (allocates).
  virtual void size_selection(int64_t capacity, int32_t q_len) = 0;
  /// The selection a step of q_len tokens will write, with its host bound
  /// for the current lengths (pure: decides before anything changes).
  virtual PagedSelection selection(int32_t q_len) const = 0;
  /// Writes this step's selection on the device (after the append: the
  /// lengths include this step's tokens).
  virtual void select(const StepTokens& tokens, int32_t q_len, void* stream) = 0;
  /// Whether a sequence of `kv_len` tokens is in its sparse regime.
  virtual bool sparse_at(int64_t kv_len) const = 0;
  /// The additive mask of the last one-token selection over `pitch`
  /// positions per request (what the mask path attends).
  virtual void build_mask(float* mask, int64_t pitch, void* stream) = 0;
  /// The positions the last selection attends, per request (host copy).
  virtual std::vector<std::vector<int32_t>> selected_positions() const = 0;
  /// The engine pool views this model reads (throws Error naming a view
  /// whose dims or format do not fit).
  virtual void check_engine_kv(const EnginePagedKV& kv) const = 0;
  /// What the model's own kernels flagged (its selection's error word), as
  /// check_errors() reports it; the default has none.
  virtual void check_selection_errors(void* /*stream*/) {}
  /// Why the fused prefill cannot take a chunk of num_tokens tokens per
  /// active slot, the slots' lengths after it being `lens` (free slots
  /// included, unchanged); empty when it can. Pure: decides before anything
  /// changes. The default: the model has no fused prefill.
  virtual std::string prefill_refusal(int32_t num_tokens, const std::vector<int64_t>& lens) const;
  /// Runs the model's prefill indexer then its fused prefill kernel for the
  /// slots [first_slot, first_slot + chunk.batch) after the chunk was
  /// appended (chunk.kv_lens: those slots' device lengths; chunk.kv_len: the
  /// capacity, their bound). `tokens` is already moved to first_slot. Sizes
  /// its buffers for the chunk shape when they are too small (allocates).
  virtual void run_prefill(const StepTokens& tokens, int32_t first_slot, const PrefillChunk& chunk, void* stream);
  /// The positions the last chunk attended, rows as last_prefill_positions()
  /// says, for the slots whose lengths after the chunk are `lens` (0: free).
  virtual std::vector<std::vector<int32_t>> prefill_positions(const std::vector<int64_t>& lens,
                                                              int32_t num_tokens) const;
  /// What the prefill kernels flagged on the device (check_errors() reports it).
  virtual void check_prefill_errors(void* /*stream*/) {}
  /// Sizes a chunk's position lists, `lists` of `width` int32 entries and
  /// their counts, and clears them (entries -1, counts 0) for run_prefill.
  void size_prefill_lists(Buffer& ids, Buffer& counts, size_t lists, int32_t width) const;
  /// `rows` (a view of the layer's cache) from slot `first_slot` and head
  /// `head` on: what run_prefill hands its kernels for a chunk of slots.
  RowView slot_rows(RowView rows, int32_t first_slot, int32_t head = 0) const;
  /// The engine's block table of the chunk under way (engine_kv() set) from
  /// slot `first_slot` on: what run_prefill hands its kernels over a pool.
  BlockTable slot_table(int32_t first_slot) const;
  /// The indexer's IndexKeyError word (int32 on the layer's device, zeroed
  /// when first asked for), for models whose indexer refuses rows of
  /// engine pools; raise_index_errors() reads and clears it.
  int32_t* index_error_word();
  /// Reads and clears the word (after the stream's work); when a bit is set,
  /// throws Error("<refused>:" then what each bit means: `length_what` for
  /// kIndexErrorLength, `block_what` for kIndexErrorBlock).
  void raise_index_errors(void* stream, const std::string& refused, const char* length_what, const char* block_what);

  /// The lengths the kernels read: [batch] on the device, including this
  /// step's tokens once it appended them (an engine-pools step: the
  /// engine's own).
  const int32_t* device_lens() const { return engine_pools() ? engine_lens_ : cache_.device_live_lens(); }
  /// Attention rows in an engine's pool (either engine form): no mask path.
  bool engine_paged() const { return storage_ != KVStorage::kLayerCache; }
  /// Everything in the engine's pools, lengths passed each step.
  bool engine_pools() const { return storage_ == KVStorage::kEnginePools; }
  /// The engine's pools of the step or prefill chunk under way (engine forms only, else null).
  const EnginePagedKV* engine_kv() const { return engine_kv_; }
  /// The largest per-slot length the step buffers serve.
  int64_t capacity() const { return engine_pools() ? sized_capacity_ : cache_.capacity(); }
  /// A host bound on every slot's length in this step: the longest active
  /// slot, or the engine's bound.
  int64_t live_bound() const { return engine_pools() ? engine_bound_ : cache_.live_len(); }
  /// The host's lengths after a step of q_len tokens (active slots grow).
  std::vector<int64_t> lens_after(int32_t q_len) const;
  bool have_selection() const { return have_selection_; }
  int32_t last_q_len() const { return last_q_len_; }

 private:
  void size_step_buffers(int32_t q_len);
  void select_step(const StepTokens& tokens, int32_t q_len, void* stream);  // after the append, between the events
  bool any_sparse(int32_t q_len) const;  // an active slot's first step token is in its sparse regime
  /// Throws Error naming what is missing or wrong in `tokens` by the model's
  /// token_names() (before anything changes). `engine`: over an engine's pool.
  void check_tokens(const StepTokens& tokens, bool engine) const;
  /// An engine form's tokens and pool views: the model's (check_engine_kv),
  /// then the block table's rows and the index keys every model reads alike.
  void check_engine_inputs(const StepTokens& tokens, const EnginePagedKV& kv) const;
  LayerStep fused_tokens(const StepTokens& tokens, int32_t q_len, void* stream);
  LayerStep token_by_token(const StepTokens& tokens, int32_t q_len, void* stream);
  LayerStep finish(LayerStep step, SparseDecoder& decoder, const SparseAttentionInputs& in,
                   const PagedSelection& selection, void* stream);
  LayerStep pools_step(const StepTokens& tokens, const EnginePagedKV& kv, void* stream);
  /// A one-token step's attention inputs over the engine's rows and table.
  SparseAttentionInputs engine_inputs(const StepTokens& tokens, const EnginePagedKV& kv) const;
  /// The host's lengths after a prefill chunk of num_tokens, or Error naming
  /// why the chunk is refused (before anything changes).
  std::vector<int64_t> prefill_lens(const std::string& who, int32_t num_tokens) const;
  /// A prefill chunk after its rows were appended: the model's run_prefill
  /// over every active slot (`lens`: the host's lengths after it; `active`:
  /// which slots hold the chunk).
  void run_chunk(const StepTokens& tokens, int32_t num_tokens, const std::vector<int64_t>& lens,
                 const std::vector<uint8_t>& active, void* stream);
  /// prefill_chunk over engine pools: the engine's lengths and keys, nothing appended.
  void pools_prefill(const StepTokens& tokens, const EnginePagedKV& kv, int32_t num_tokens, void* stream);
  /// The lengths a pools chunk is decided on: kv.host_seq_lens (on the CPU
  /// checked against kv.seq_lens), else kv.seq_lens read back (a stream
  /// sync, refused by name while the stream is being captured).
  std::vector<int64_t> pools_prefill_lens(const std::string& who, const EnginePagedKV& kv, void* stream) const;
  void refuse_on_engine_pools(const char* what) const;
  /// Throws Error (`who`) when an engine-paged layer is given kv.host_seq_lens (a pools field).
  void refuse_host_lens(const std::string& who, const EnginePagedKV& kv) const;

  std::string name_;
  Device device_;
  DType dtype_;
  int32_t batch_;
  KVStorage storage_;
  DenseKVCache cache_;
  SparseDecoder decoder_;        // one-token steps
  SparseDecoder multi_decoder_;  // multi-token steps keep their own plan
  StepMaskPath fallback_;        // the mask path over the capacity
  int64_t sized_capacity_ = -1;
  int32_t sized_q_len_ = 0;
  bool have_selection_ = false;
  int32_t last_q_len_ = 1;
  // The last prefill chunk: its tokens per slot and the slots' lengths after it (0: free).
  int32_t prefill_tokens_ = 0;
  std::vector<int64_t> prefill_lens_;
  void* after_append_ = nullptr;
  void* after_select_ = nullptr;
  // An engine-pools step's lengths and pools (valid during the step; the
  // lengths stay for the readers of the last step).
  const int32_t* engine_lens_ = nullptr;
  int64_t engine_bound_ = 0;
  const EnginePagedKV* engine_kv_ = nullptr;
  // The token-by-token form of a multi-token step: one token's inputs.
  Buffer stage_q_, stage_q_extra_, stage_index_q_, stage_weights_, stage_o_;
  Buffer index_error_;  // index_error_word()
};

/// The forms every model offers over its token struct `Tokens`; the model
/// supplies to_step() (its fields by role) and the skeleton's hooks. What a
/// step or chunk keeps is the model's rule (its class comment).
template <class Tokens>
class LayerForms : public SparseLayer {
 public:
  /// One token per active slot: appends it, runs the model's selection and
  /// attends what it kept (fused, or the mask path over the same set on a
  /// decline). Every input is checked before the cache changes.
  LayerStep decode(const Tokens& tokens, void* stream = nullptr) { return step(to_step(tokens), stream); }
  /// A multi-token step (speculative verification, MTP) of q_len tokens
  /// per slot, the inputs with a q_len dim after batch (k and v
  /// token-major): fused where the model has a multi-token selection and the
  /// policy agrees, else q_len one-token steps (exact, not capturable).
  LayerStep decode(const Tokens& tokens, int32_t q_len, void* stream = nullptr) {
    return step(to_step(tokens), q_len, stream);
  }
  /// Prefill through the mask path, the oracle: appends the token of every
  /// active slot and attends its whole causal window (dense).
  void prefill_token(const Tokens& tokens, void* stream = nullptr) { prefill_step(to_step(tokens), stream); }
  /// Chunked prefill (SparseLayer::prefill_chunk): num_tokens tokens per
  /// active slot, the inputs as a multi-token step's; the model's prefill
  /// indexer, then its fused prefill. Refused by name, before anything
  /// changes, where the model's prefill cannot take the chunk.
  void prefill(const Tokens& tokens, int32_t num_tokens, void* stream = nullptr) {
    prefill_chunk(to_step(tokens), num_tokens, stream);
  }

 protected:
  using SparseLayer::SparseLayer;
  /// The model's token struct by role (no copies: pointers only).
  virtual StepTokens to_step(const Tokens& tokens) const = 0;
};

/// The forms of models that also read an engine's pools (KVStorage
/// kEnginePaged or kEnginePools; EnginePagedKV says what each reads).
template <class Tokens>
class EngineLayerForms : public LayerForms<Tokens> {
 public:
  using LayerForms<Tokens>::decode;
  using LayerForms<Tokens>::prefill;
  /// One token per active slot over the engine's pools
  /// (SparseLayer::step(tokens, kv)): kEnginePaged appends the token's index
  /// key, runs the selection and attends the kept rows of `kv` in place,
  /// position p of slot b at row `kv.block_table[b, p / block_size] *
  /// block_size + p % block_size` (the engine has written the token's rows
  /// at position kv_lens()[b], the length before the call). kEnginePools is
  /// stateless: nothing is appended, the selection reads the engine's keys
  /// (kv.index_keys) and lengths (kv.seq_lens on the device, this token
  /// included, 0 a slot not in this call, whose output is zero;
  /// kv.max_seq_len their host bound). A length past its bound or its table
  /// row, or a block outside its pool, refuses that sequence and
  /// check_errors() names it. Capturable once reserve(max_seq_len) has run.
  LayerStep decode(const Tokens& tokens, const EnginePagedKV& kv, void* stream = nullptr) {
    return this->step(this->to_step(tokens), kv, stream);
  }
  /// Chunked prefill over the engine's pools (SparseLayer::prefill_chunk(
  /// tokens, kv, num_tokens)): the same selection and answer as
  /// prefill(tokens, num_tokens) over the layer's own cache, with the same
  /// refusals. kEnginePaged: tokens.index_k holds the chunk's index keys
  /// (token-major) and the engine has written its rows at each active
  /// slot's positions kv_lens()[b] onwards. kEnginePools: the engine's keys
  /// and lengths with the chunk (kv.seq_lens, 0 a slot not in this call),
  /// nothing appended; decided on kv.host_seq_lens when the engine gives its
  /// host copy (capturable after one eager chunk of the same shape, the
  /// slot set and path fixed at capture), else on kv.seq_lens read back
  /// once (not capturable).
  void prefill(const Tokens& tokens, const EnginePagedKV& kv, int32_t num_tokens, void* stream = nullptr) {
    this->prefill_chunk(this->to_step(tokens), kv, num_tokens, stream);
  }

 protected:
  using LayerForms<Tokens>::LayerForms;
};

}  // namespace sparsepage
