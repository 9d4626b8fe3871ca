// The layer skeleton: the step every model shares (include/sparsepage/layer.h).
#include "sparsepage/layer.h"

#include <algorithm>
#include <functional>
#include <string>
#include <utility>

#include "core/cuda_hooks.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/memory.h"

namespace sparsepage {

namespace {
// The cache dtype, checked before the cache is made (so the error names the layer).
CacheMode cache_mode(const std::string& name, DType dtype) {
  if (dtype != DType::kF16 && dtype != DType::kBF16) throw Error(name + ": the cache stores f16 or bf16");
  return dtype == DType::kF16 ? CacheMode::kF16 : CacheMode::kBF16;
}

// Runs a cache call for the layer's entry point `who`: a refusal from the
// cache (a slot outside the batch, a bad token count) comes back under the
// layer's name, as every error of the layer does. The cache checks before
// it changes anything, so nothing needs undoing.
template <typename Call>
void as_layer(const std::string& name, const char* who, Call&& call) {
  try {
    call();
  } catch (const Error& e) {
    throw Error(name + "::" + who + ": " + e.what());
  }
}

// An engine-paged step on the CPU, where the engine's table is host memory:
// every entry the step's windows reach must name a pool block, judged
// before the step appends anything, so a refused step changes nothing. (On
// CUDA the table is device memory: the kernels judge the entries they read
// and flag that request.)
void check_table_on_host(const std::string& who, const BlockTable& t, const std::vector<int64_t>& lens,
                         const std::vector<uint8_t>& active) {
  for (size_t b = 0; b < lens.size(); ++b) {
    if (active[b] == 0 || lens[b] <= 0) continue;
    const int64_t row = t.row_of_sequence != nullptr ? int64_t{t.row_of_sequence[b]} : static_cast<int64_t>(b);
    if (row < 0 || row >= t.num_rows) {
      throw Error(who + ": block_table.row_of_sequence[" + std::to_string(b) + "] = " + std::to_string(row) +
                  " is outside the table's " + std::to_string(t.num_rows) + " rows");
    }
    const int64_t blocks = std::min<int64_t>((lens[b] + t.block_size - 1) / t.block_size, t.max_blocks);
    const int32_t* entries = t.data + row * t.row_stride;
    for (int64_t j = 0; j < blocks; ++j) {
      if (entries[j] < 0 || entries[j] >= t.num_blocks) {
        throw Error(who + ": block_table row " + std::to_string(row) + ", entry " + std::to_string(j) + " = " +
                    std::to_string(entries[j]) + " is outside the pool [0, " + std::to_string(t.num_blocks) +
                    ") (sequence " + std::to_string(b) + ", " + std::to_string(lens[b]) + " tokens with this step's)");
      }
    }
  }
}

// The pools are the caller's: a step or chunk over them forgets them when
// it returns, thrown or not.
struct ForgetPools {
  const EnginePagedKV*& kv;
  ~ForgetPools() { kv = nullptr; }
};
}  // namespace

SparseLayer::SparseLayer(std::string name, Device device, DType dtype, int32_t batch, KVStorage storage,
                         CacheShape shape, int64_t capacity_step, DispatchConfig dispatch)
    : name_(std::move(name)),
      device_(device),
      dtype_(dtype),
      batch_(batch),
      storage_(storage),
      cache_(device, cache_mode(name_, dtype), batch, shape.k_heads, shape.v_heads, shape.k_dim, shape.v_dim,
             capacity_step),
      // No mask path behind an engine's pool: only what the fused path cannot do declines.
      decoder_(device, storage != KVStorage::kLayerCache ? dispatch.without_performance_gates() : dispatch),
      multi_decoder_(device, dispatch) {
  if (storage != KVStorage::kLayerCache && storage != KVStorage::kEnginePaged && storage != KVStorage::kEnginePools) {
    throw Error(name_ + ": kv_storage is not a KVStorage value");
  }
}

SparseLayer::~SparseLayer() = default;

std::vector<int64_t> SparseLayer::lens_after(int32_t q_len) const {
  // The engine's lengths are on the device only: its bound stands for each.
  if (engine_pools()) return std::vector<int64_t>(static_cast<size_t>(batch_), engine_bound_);
  std::vector<int64_t> lens = cache_.live_lens();
  for (size_t b = 0; b < lens.size(); ++b) {
    if (cache_.active()[b]) lens[b] += q_len;
  }
  return lens;
}

void SparseLayer::size_step_buffers(int32_t q_len) {
  if (engine_pools()) return;  // sized by reserve() or the step's bound
  const int64_t cap = cache_.capacity();
  if (cap == 0 || (cap == sized_capacity_ && q_len <= sized_q_len_)) return;  // nothing to size yet, or sized
  size_selection(cap, std::max(q_len, sized_q_len_));
  if (!engine_paged() && cap != sized_capacity_) fallback_.size(device_, attention_inputs(StepTokens{}, 1), cap);
  sized_capacity_ = cap;
  sized_q_len_ = std::max(q_len, sized_q_len_);
}

void SparseLayer::reserve(int64_t tokens) {
  if (engine_pools()) {  // no cache: the step buffers alone, for lengths up to `tokens`
    if (tokens < 1) throw Error(name_ + "::reserve: tokens = " + std::to_string(tokens) + " must be at least 1");
    if (tokens > sized_capacity_) {
      size_selection(tokens, 1);
      sized_capacity_ = tokens;
      sized_q_len_ = 1;
    }
    return;
  }
  as_layer(name_, "reserve", [&] { cache_.reserve(tokens); });
  size_step_buffers(1);
}

void SparseLayer::refuse_on_engine_pools(const char* what) const {
  if (engine_pools()) {
    throw Error(name_ + "::" + what +
                ": an engine-pools layer keeps no sequences; the engine owns them and passes "
                "their lengths with each step");
  }
}

void SparseLayer::refuse_host_lens(const std::string& who, const EnginePagedKV& kv) const {
  if (kv.host_seq_lens != nullptr) {
    throw Error(who + ": kv.host_seq_lens is for KVStorage::kEnginePools layers; this layer keeps its lengths itself");
  }
}

void SparseLayer::append_tokens(const void* k, const void* v, int64_t tokens) {
  refuse_on_engine_pools("append_tokens");
  if (k == nullptr || (engine_paged() ? v != nullptr : v == nullptr)) {
    throw Error(name_ + (engine_paged() ? "::append_tokens (engine-paged): k (the index keys) must be set and v null"
                                        : "::append_tokens: k and v must be set"));
  }
  as_layer(name_, "append_tokens", [&] { cache_.append(k, v, dtype_, tokens); });
  size_step_buffers(1);
}

void SparseLayer::admit(int32_t slot, const void* k, const void* v, int64_t tokens, void* stream) {
  refuse_on_engine_pools("admit");
  if (tokens > 0 && (k == nullptr || (engine_paged() ? v != nullptr : v == nullptr))) {
    throw Error(name_ + (engine_paged() ? "::admit (engine-paged): k (the prompt's index keys) must be set and v null"
                                        : "::admit: k and v must be set"));
  }
  as_layer(name_, "admit", [&] { cache_.admit(slot, k, v, tokens, stream); });
  size_step_buffers(1);
}

void SparseLayer::release(int32_t slot, void* stream) {
  refuse_on_engine_pools("release");
  as_layer(name_, "release", [&] { cache_.release(slot, stream); });
}

LayerStep SparseLayer::finish(LayerStep step, SparseDecoder& decoder, const SparseAttentionInputs& in,
                              const PagedSelection& selection, void* stream) {
  step.outcome = decoder.try_fused(in, selection, stream);
  step.fused = step.outcome.fused();
  if (!step.fused) {
    build_mask(fallback_.mask(), fallback_.capacity(), stream);
    fallback_.run(in, true, stream);
  }
  return step;
}

void SparseLayer::select_step(const StepTokens& tokens, int32_t q_len, void* stream) {
  detail::cuda_record_event(after_append_, stream);
  select(tokens, q_len, stream);
  detail::cuda_record_event(after_select_, stream);
  have_selection_ = true;
  last_q_len_ = q_len;
}

void SparseLayer::check_tokens(const StepTokens& t, bool engine) const {
  const TokenNames n = token_names();
  struct Input {
    const void* given;
    const char* name;  // null: the model has no such input
  };
  const Input q{t.q, n.q}, q_extra{t.q_extra, n.q_extra}, index_q{t.index_q, n.index_q},
      weights{t.index_weights, n.index_weights}, k{t.k, n.k}, v{t.v, n.v}, index_k{t.index_k, "index_k"}, o{t.o, n.o};
  engine = engine && n.engine_forms;
  const bool pools = engine && engine_pools();
  std::vector<Input> set = {q, q_extra, index_q, weights, k, v, o}, unset;
  if (pools) {
    set = {q, q_extra, index_q, weights, o};
    unset = {k, v, index_k};
  } else if (engine) {
    set = {q, q_extra, index_q, weights, index_k, o};
    unset = {k, v};
  }
  // "a, b and c" (own cache: "(a, b, c)") of the model's inputs in `inputs`.
  auto names = [](const std::vector<Input>& inputs, const char* last_separator) {
    std::vector<const char*> named;
    for (const Input& i : inputs)
      if (i.name != nullptr) named.push_back(i.name);
    std::string out;
    for (size_t i = 0; i < named.size(); ++i)
      out += (i == 0 ? "" : i + 1 == named.size() ? last_separator : ", ") + std::string(named[i]);
    return out;
  };
  auto any = [](const std::vector<Input>& inputs, bool given) {
    return std::any_of(inputs.begin(), inputs.end(),
                       [&](const Input& i) { return i.name != nullptr && (i.given != nullptr) == given; });
  };
  const std::string who = name_ + (pools ? " (engine pools)" : engine ? " (engine-paged)" : "");
  if (any(set, false)) {
    throw Error(engine ? who + ": " + names(set, " and ") + " must be set"
                       : who + ": every " + n.tokens + " pointer (" + names(set, ", ") + ") must be set");
  }
  if (any(unset, true)) {
    throw Error(who + ": " + names(unset, " and ") + " must be null (the engine writes the token's rows " +
                (pools ? "and its index key into its pools)" : "into its pool; pass the index key as index_k)"));
  }
}

void SparseLayer::check_engine_inputs(const StepTokens& tokens, const EnginePagedKV& kv) const {
  check_tokens(tokens, true);
  check_engine_kv(kv);
  if (kv.block_table.num_rows < batch()) {
    throw Error(name_ + " (engine-paged): the block table has " + std::to_string(kv.block_table.num_rows) +
                " rows for " + std::to_string(batch()) + " slots");
  }
  if (!engine_pools()) {
    if (kv.index_keys.pool != nullptr || kv.seq_lens != nullptr) {
      throw Error(name_ + " (engine-paged): kv.index_keys and kv.seq_lens are for KVStorage::kEnginePools layers; "
                          "this layer keeps its index keys and lengths itself");
    }
    return;
  }
  // The engine's index keys, as wide as the keys the layer would keep (its
  // key-only cache's rows); what the indexer would refuse later, named here.
  const std::string who = name_ + " (engine pools): kv.index_keys";
  const std::string problem = paged_index_keys_problem(kv.index_keys, cache_.k_head_dim());
  if (!problem.empty()) throw Error(who + ": " + problem);
  if (kv.index_keys.format == IndexKeyFormat::kNative && kv.index_keys.dtype != dtype_) {
    throw Error(who + " holds " + dtype_name(kv.index_keys.dtype) + " keys; the layer's index queries are " +
                dtype_name(dtype_));
  }
  if (int64_t{kv.index_keys.max_blocks} * kv.index_keys.block_size < kv.max_seq_len) {
    throw Error(who + "' table holds " + std::to_string(kv.index_keys.max_blocks) + " blocks of " +
                std::to_string(kv.index_keys.block_size) +
                " positions, fewer than max_seq_len = " + std::to_string(kv.max_seq_len));
  }
}

bool SparseLayer::any_sparse(int32_t q_len) const {
  for (size_t b = 0; b < kv_lens().size(); ++b)
    if (cache_.active()[b] && sparse_at(kv_lens()[b] - (q_len - 1))) return true;
  return false;
}

LayerStep SparseLayer::step(const StepTokens& tokens, void* stream) {
  if (engine_paged()) {
    throw Error(name_ + "::decode: an engine-paged layer reads the engine's pool; pass the pool (decode(tokens, kv))");
  }
  check_tokens(tokens, false);
  cache_.reserve(cache_.live_len() + 1);  // allocates only when the capacity must grow
  size_step_buffers(1);
  cache_.append_token(tokens.k, tokens.v, stream);
  select_step(tokens, 1, stream);
  LayerStep step;
  step.sparse = any_sparse(1);
  return finish(step, decoder_, attention_inputs(tokens, 1), selection(1), stream);
}

void SparseLayer::prefill_step(const StepTokens& tokens, void* stream) {
  if (engine_paged()) {
    throw Error(name_ +
                "::prefill_token: an engine-paged layer has no mask path; the engine prefills and append_tokens() or "
                "admit() takes the prompt's index keys");
  }
  check_tokens(tokens, false);
  cache_.reserve(cache_.live_len() + 1);
  size_step_buffers(1);
  cache_.append_token(tokens.k, tokens.v, stream);
  fallback_.run(attention_inputs(tokens, 1), false, stream);
}

std::string SparseLayer::prefill_refusal(int32_t /*num_tokens*/, const std::vector<int64_t>& /*lens*/) const {
  return "the model has no fused prefill";
}

RowView SparseLayer::slot_rows(RowView rows, int32_t first_slot, int32_t head) const {
  const auto esize = static_cast<int64_t>(dtype_size(dtype_));
  rows.data = static_cast<const char*>(rows.data) + (first_slot * rows.seq_stride + head * rows.head_stride) * esize;
  return rows;
}

void SparseLayer::run_prefill(const StepTokens& /*tokens*/, int32_t /*first_slot*/, const PrefillChunk& /*chunk*/,
                              void* /*stream*/) {
  throw Error(name_ + "::prefill: the model has no fused prefill");
}

std::vector<std::vector<int32_t>> SparseLayer::prefill_positions(const std::vector<int64_t>& /*lens*/,
                                                                 int32_t /*num_tokens*/) const {
  return {};
}

std::vector<int64_t> SparseLayer::prefill_lens(const std::string& who, int32_t num_tokens) const {
  if (num_tokens < 1) throw Error(who + ": num_tokens = " + std::to_string(num_tokens) + " must be at least 1");
  // Decided before anything changes, on the host's lengths after the chunk.
  const std::vector<int64_t> lens = lens_after(num_tokens);
  bool any_active = false;
  for (size_t b = 0; b < lens.size(); ++b) any_active = any_active || cache_.active()[b] != 0;
  if (!any_active) throw Error(who + ": every slot is free (admit() a request first)");
  for (int64_t len : lens) {
    if (len > INT32_MAX) {
      throw Error(who + ": a slot would reach " + std::to_string(len) + " positions, past int32 positions");
    }
  }
  const std::string refused = prefill_refusal(num_tokens, lens);
  if (!refused.empty()) throw Error(who + ": " + refused);
  return lens;
}

void SparseLayer::prefill_chunk(const StepTokens& tokens, int32_t num_tokens, void* stream) {
  const std::string who = name_ + "::prefill";
  if (engine_paged()) {
    throw Error(who +
                ": an engine-paged layer's rows are the engine's: pass its pool (prefill(tokens, kv, num_tokens))");
  }
  check_tokens(tokens, false);
  const std::vector<int64_t> lens = prefill_lens(who, num_tokens);
  cache_.reserve(cache_.live_len() + num_tokens);  // allocates only when the capacity must grow
  size_step_buffers(1);
  cache_.append_step_tokens(tokens.k, tokens.v, num_tokens, stream);
  run_chunk(tokens, num_tokens, lens, cache_.active(), stream);
}

void SparseLayer::prefill_chunk(const StepTokens& tokens, const EnginePagedKV& kv, int32_t num_tokens, void* stream) {
  const std::string who = name_ + "::prefill(tokens, kv)";
  if (!engine_paged()) {
    throw Error(who + ": the layer keeps its own cache; prefill(tokens, num_tokens) reads it");
  }
  check_engine_inputs(tokens, kv);
  if (engine_pools()) {
    pools_prefill(tokens, kv, num_tokens, stream);
    return;
  }
  refuse_host_lens(who, kv);
  if (kv.block_table.row_of_sequence != nullptr) {
    throw Error(who + ": kv.block_table.row_of_sequence must be null: the prefill reads table row b for slot b");
  }
  const std::vector<int64_t> lens = prefill_lens(who, num_tokens);
  // Every entry the chunk's positions reach must name a pool block: judged
  // on the host where the table is host memory (CPU), before anything is
  // appended; on CUDA the kernels flag the requests that read a bad entry.
  const int64_t reach = int64_t{kv.block_table.max_blocks} * kv.block_table.block_size;
  for (size_t b = 0; b < lens.size(); ++b) {
    if (cache_.active()[b] != 0 && lens[b] > reach) {
      throw Error(who + ": slot " + std::to_string(b) + " would hold " + std::to_string(lens[b]) +
                  " positions, past its block-table row's " + std::to_string(kv.block_table.max_blocks) +
                  " blocks of " + std::to_string(kv.block_table.block_size));
    }
  }
  if (device_ == Device::kCpu) check_table_on_host(who, kv.block_table, lens, cache_.active());
  cache_.reserve(cache_.live_len() + num_tokens);  // allocates only when the capacity must grow
  size_step_buffers(1);
  engine_kv_ = &kv;
  const ForgetPools forget{engine_kv_};
  // tokens.index_k is [num_tokens, batch, 1, 1, dim]: the chunk's index keys, token-major.
  cache_.append_step_tokens(tokens.index_k, nullptr, num_tokens, stream);
  run_chunk(tokens, num_tokens, lens, cache_.active(), stream);
}

std::vector<int64_t> SparseLayer::pools_prefill_lens(const std::string& who, const EnginePagedKV& kv,
                                                     void* stream) const {
  const auto batch = static_cast<size_t>(batch_);
  if (kv.host_seq_lens != nullptr) {
    std::vector<int64_t> lens(kv.host_seq_lens, kv.host_seq_lens + batch);
    // On the CPU the kernels' lengths are host memory too and nothing is
    // replayed: a host copy that differs from them is the engine's mistake.
    for (size_t b = 0; b < batch && device_ == Device::kCpu; ++b) {
      if (kv.seq_lens[b] != kv.host_seq_lens[b]) {
        throw Error(who + ": kv.host_seq_lens[" + std::to_string(b) + "] = " + std::to_string(kv.host_seq_lens[b]) +
                    " differs from kv.seq_lens[" + std::to_string(b) + "] = " + std::to_string(kv.seq_lens[b]) +
                    " (the host copy must hold the lengths the kernels read)");
      }
    }
    return lens;
  }
  if (device_ == Device::kCuda) {
    if (detail::cuda_stream_capturing(stream)) {
      throw Error(who + ": the stream is being captured, and without kv.host_seq_lens the chunk reads kv.seq_lens back "
                        "(a stream sync); pass the engine's host copy of the lengths to capture a chunk");
    }
    detail::cuda_stream_sync(stream);
  }
  const std::vector<int32_t> seq = download<int32_t>(device_, kv.seq_lens, batch);
  return {seq.begin(), seq.end()};
}

void SparseLayer::pools_prefill(const StepTokens& tokens, const EnginePagedKV& kv, int32_t num_tokens, void* stream) {
  const std::string who = name_ + "::prefill(tokens, kv) (engine pools)";
  if (num_tokens < 1) throw Error(who + ": num_tokens = " + std::to_string(num_tokens) + " must be at least 1");
  if (kv.seq_lens == nullptr || kv.max_seq_len < 1 || kv.max_seq_len > INT32_MAX) {
    throw Error(who +
                ": kv.seq_lens (each slot's length with the chunk, on the device) and kv.max_seq_len (their host "
                "bound, 1 .. 2^31 - 1) must be given; got max_seq_len = " +
                std::to_string(kv.max_seq_len));
  }
  if (kv.block_table.row_of_sequence != nullptr) {
    throw Error(who + ": kv.block_table.row_of_sequence must be null: the prefill reads table row b for slot b");
  }
  // The chunk's shape (which slots hold it, whether the fused prefill takes
  // it, one launch or one per slot) is decided on the host: on the engine's
  // host copy of the lengths when it gives one (nothing read back, so the
  // chunk can be captured; a captured chunk keeps these decisions), else on
  // the device lengths read back once.
  const std::vector<int64_t> lens = pools_prefill_lens(who, kv, stream);
  const char* lens_name = kv.host_seq_lens != nullptr ? "kv.host_seq_lens" : "kv.seq_lens";
  std::vector<uint8_t> active(static_cast<size_t>(batch_), 0);
  const int64_t reach = int64_t{kv.block_table.max_blocks} * kv.block_table.block_size;
  for (int32_t b = 0; b < batch_; ++b) {
    const int64_t len = lens[size_t(b)];
    if (len == 0) continue;  // a free slot: its o rows are zeroed
    if (len < num_tokens || len > kv.max_seq_len) {
      throw Error(who + ": " + lens_name + "[" + std::to_string(b) + "] = " + std::to_string(len) +
                  " must be 0 (a free slot) or lie in [num_tokens = " + std::to_string(num_tokens) +
                  ", max_seq_len = " + std::to_string(kv.max_seq_len) + "] (the chunk is each slot's last " +
                  std::to_string(num_tokens) + " positions)");
    }
    if (len > reach) {
      throw Error(who + ": slot " + std::to_string(b) + " holds " + std::to_string(len) +
                  " positions, past its block-table row's " + std::to_string(kv.block_table.max_blocks) +
                  " blocks of " + std::to_string(kv.block_table.block_size));
    }
    active[size_t(b)] = 1;
  }
  if (std::find(active.begin(), active.end(), 1) == active.end()) {
    throw Error(who + ": every slot is free (" + lens_name + " is 0 everywhere)");
  }
  // The chunk's lengths and pools while it runs (prefill_refusal reads the
  // pools too: a model may judge the engine's tables on the host); the last
  // decode step's lengths stay for that step's readers (the chunk's are
  // kept on the host).
  struct Restore {  // thrown or not
    SparseLayer& layer;
    const int32_t* lens;
    int64_t bound;
    ~Restore() {
      layer.engine_lens_ = lens;
      layer.engine_bound_ = bound;
      layer.engine_kv_ = nullptr;
    }
  } restore{*this, engine_lens_, engine_bound_};
  engine_lens_ = kv.seq_lens;
  engine_bound_ = kv.max_seq_len;
  engine_kv_ = &kv;
  const std::string refused = prefill_refusal(num_tokens, lens);
  if (!refused.empty()) throw Error(who + ": " + refused);
  if (device_ == Device::kCpu) check_table_on_host(who, kv.block_table, lens, active);
  run_chunk(tokens, num_tokens, lens, active, stream);
}

void SparseLayer::size_prefill_lists(Buffer& ids, Buffer& counts, size_t lists, int32_t width) const {
  ids = Buffer(device_, lists * static_cast<size_t>(width) * sizeof(int32_t));
  counts = Buffer(device_, lists * sizeof(int32_t));
  // A free slot's lists are never written: they read as empty (count 0).
  fill_bytes(ids.data(), device_, 0xff, ids.bytes());
  fill_bytes(counts.data(), device_, 0, counts.bytes());
}

BlockTable SparseLayer::slot_table(int32_t first_slot) const {
  BlockTable t = engine_kv_->block_table;
  t.data += int64_t{first_slot} * t.row_stride;
  t.num_rows -= first_slot;
  return t;
}

void SparseLayer::run_chunk(const StepTokens& tokens, int32_t num_tokens, const std::vector<int64_t>& lens,
                            const std::vector<uint8_t>& active, void* stream) {
  detail::cuda_record_event(after_append_, stream);
  bool all_active = true;
  for (size_t b = 0; b < lens.size(); ++b) all_active = all_active && active[b] != 0;
  PrefillChunk chunk;
  chunk.num_tokens = num_tokens;
  // The bound of every slot's length: the capacity (a captured chunk
  // replays as they grow), or the engine's bound.
  chunk.kv_len = engine_pools() ? engine_bound_ : capacity();
  if (all_active) {
    chunk.batch = batch_;
    chunk.kv_lens = device_lens();
    run_prefill(tokens, 0, chunk, stream);
  } else {
    // The kernels take consecutive sequences each holding the chunk: with a
    // free slot in the batch, each active slot is a chunk of its own (one
    // chunk shape, so the kernels' plans are made once). The free slots' o
    // rows are zeroed on the stream, so this path is capturable too.
    const TokenBytes bytes = token_bytes();
    const auto n = static_cast<size_t>(num_tokens);
    for (int32_t b = 0; b < batch_; ++b) {
      const size_t first = static_cast<size_t>(b) * n;
      if (active[static_cast<size_t>(b)] == 0) {
        void* rows = static_cast<char*>(tokens.o) + first * bytes.o;
        if (device_ == Device::kCuda) {
          detail::cuda_fill_async(rows, 0, n * bytes.o, stream);
        } else {
          fill_bytes(rows, device_, 0, n * bytes.o);
        }
        continue;
      }
      const auto at = [&](const void* p, size_t row_bytes) -> const void* {
        return p == nullptr ? nullptr : static_cast<const char*>(p) + first * row_bytes;
      };
      StepTokens slot;
      slot.q = at(tokens.q, bytes.q);
      slot.q_extra = at(tokens.q_extra, bytes.q_extra);
      slot.index_q = at(tokens.index_q, bytes.index_q);
      slot.index_weights = static_cast<const float*>(at(tokens.index_weights, bytes.index_weights));
      slot.o = static_cast<char*>(tokens.o) + first * bytes.o;
      chunk.batch = 1;
      chunk.kv_lens = device_lens() + b;
      run_prefill(slot, b, chunk, stream);
    }
  }
  prefill_tokens_ = num_tokens;
  prefill_lens_ = lens;
  for (size_t b = 0; b < lens.size(); ++b) {
    if (active[b] == 0) prefill_lens_[b] = 0;
  }
}

std::vector<std::vector<int32_t>> SparseLayer::last_prefill_positions() const {
  if (prefill_tokens_ == 0) return {};
  return prefill_positions(prefill_lens_, prefill_tokens_);
}

LayerStep SparseLayer::step(const StepTokens& tokens, int32_t q_len, void* stream) {
  if (q_len < 1 || q_len > kMaxQueryTokens) {
    throw Error(name_ + "::decode: q_len = " + std::to_string(q_len) + " must lie in [1, " +
                std::to_string(kMaxQueryTokens) + "]");
  }
  const std::string refused = query_tokens_refusal(q_len);
  if (!refused.empty()) throw Error(name_ + "::decode: " + refused);
  if (q_len == 1) return step(tokens, stream);
  if (engine_paged()) {
    throw Error(name_ +
                "::decode: multi-token steps read the layer's own cache; an engine-paged layer takes one token per "
                "step (decode(tokens, kv))");
  }
  check_tokens(tokens, false);
  cache_.reserve(cache_.live_len() + q_len);  // allocates only when the capacity must grow
  size_step_buffers(q_len);
  // Decided before the cache changes, at the lengths the step will have: a
  // declined step runs token by token instead.
  if (q_len <= max_query_tokens()) {
    SparseAttentionInputs in = attention_inputs(tokens, q_len);
    for (int64_t len : lens_after(q_len)) in.live_len = std::max(in.live_len, len);
    if (multi_decoder_.decide(in, selection(q_len)).fused()) return fused_tokens(tokens, q_len, stream);
  }
  return token_by_token(tokens, q_len, stream);
}

LayerStep SparseLayer::fused_tokens(const StepTokens& tokens, int32_t q_len, void* stream) {
  // tokens.k and tokens.v are [q_len, batch, heads, dim]: the q_len slices in one launch.
  cache_.append_step_tokens(tokens.k, tokens.v, q_len, stream);
  select_step(tokens, q_len, stream);
  LayerStep step;
  step.sparse = any_sparse(q_len);
  step.outcome = multi_decoder_.try_fused(attention_inputs(tokens, q_len), selection(q_len), stream);
  step.fused = step.outcome.fused();
  if (!step.fused) {  // decided fused above on the same facts; a change here is a bug, never a wrong answer
    throw Error(name_ +
                "::decode: the multi-token step was declined after its tokens were appended: " + step.outcome.reason);
  }
  return step;
}

LayerStep SparseLayer::token_by_token(const StepTokens& tokens, int32_t q_len, void* stream) {
  const TokenBytes bytes = token_bytes();
  const size_t b_count = static_cast<size_t>(batch_);
  const auto stage = [&](Buffer& buffer, size_t row_bytes) {
    if (row_bytes > 0 && buffer.bytes() < b_count * row_bytes) buffer = Buffer(device_, b_count * row_bytes);
  };
  stage(stage_q_, bytes.q);
  stage(stage_q_extra_, bytes.q_extra);
  stage(stage_index_q_, bytes.index_q);
  stage(stage_weights_, bytes.index_weights);
  stage(stage_o_, bytes.o);
  // The copies below are synchronous, on the default stream: order them after the caller's stream.
  if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
  // Token t's rows of each sequence: [batch, row] out of [batch, q_len, row].
  const auto slice = [&](Buffer& dst, const void* src, size_t row_bytes, int32_t t) -> const void* {
    if (src == nullptr || row_bytes == 0) return nullptr;
    copy_2d(dst.data(), device_, row_bytes, static_cast<const char*>(src) + t * row_bytes, device_, q_len * row_bytes,
            row_bytes, b_count);
    return dst.data();
  };
  LayerStep step;
  for (int32_t t = 0; t < q_len; ++t) {
    StepTokens one;
    one.q = slice(stage_q_, tokens.q, bytes.q, t);
    one.q_extra = slice(stage_q_extra_, tokens.q_extra, bytes.q_extra, t);
    one.index_q = slice(stage_index_q_, tokens.index_q, bytes.index_q, t);
    one.index_weights = static_cast<const float*>(slice(stage_weights_, tokens.index_weights, bytes.index_weights, t));
    // k and v are token-major: slice t is [batch, heads, 1, dim] as a one-token step takes it.
    one.k = static_cast<const char*>(tokens.k) + t * b_count * bytes.k;
    one.v = bytes.v > 0 ? static_cast<const char*>(tokens.v) + t * b_count * bytes.v : nullptr;
    one.o = stage_o_.data();
    step = this->step(one, stream);
    if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
    copy_2d(static_cast<char*>(tokens.o) + t * bytes.o, device_, q_len * bytes.o, stage_o_.data(), device_, bytes.o,
            bytes.o, b_count);
  }
  return step;
}

SparseAttentionInputs SparseLayer::engine_inputs(const StepTokens& tokens, const EnginePagedKV& kv) const {
  SparseAttentionInputs in = attention_inputs(tokens, 1);
  in.k = kv.k;
  in.v = kv.v;
  in.k_extra = kv.k_extra;
  in.block_table = kv.block_table;
  in.kv_format = kv.kv_format;
  return in;
}

LayerStep SparseLayer::step(const StepTokens& tokens, const EnginePagedKV& kv, void* stream) {
  if (!engine_paged()) {
    throw Error(name_ + "::decode(tokens, kv): the layer keeps its own cache; construct it with kv_storage = "
                        "KVStorage::kEnginePaged to read an engine's pool");
  }
  check_engine_inputs(tokens, kv);
  if (engine_pools()) return pools_step(tokens, kv, stream);
  refuse_host_lens(name_ + " (engine-paged)", kv);
  cache_.reserve(cache_.live_len() + 1);  // allocates only when the capacity must grow
  size_step_buffers(1);
  // Decided before anything changes: there is no mask path to fall back to.
  SparseAttentionInputs in = engine_inputs(tokens, kv);
  for (int64_t len : lens_after(1)) in.live_len = std::max(in.live_len, len);
  const PagedSelection shape = selection(1);
  const SparseDecodeOutcome decided = decoder_.require_fused(in, shape, name_ + " (engine-paged)");
  if (device_ == Device::kCpu)
    check_table_on_host(name_ + " (engine-paged)", kv.block_table, lens_after(1), cache_.active());
  cache_.append_token(tokens.index_k, nullptr, stream);
  select_step(tokens, 1, stream);
  LayerStep step;
  step.sparse = any_sparse(1);
  step.outcome = decoder_.run_fused(in, selection(1), decided, stream);
  step.fused = step.outcome.fused();
  return step;
}

LayerStep SparseLayer::pools_step(const StepTokens& tokens, const EnginePagedKV& kv, void* stream) {
  if (kv.seq_lens == nullptr || kv.max_seq_len < 1 || kv.max_seq_len > INT32_MAX) {
    throw Error(name_ +
                " (engine pools): kv.seq_lens (the engine's lengths, on the device) and kv.max_seq_len (their "
                "host bound, 1 .. 2^31 - 1) must be given; got max_seq_len = " +
                std::to_string(kv.max_seq_len));
  }
  if (kv.max_seq_len > sized_capacity_) reserve(kv.max_seq_len);  // allocates: reserve() before capturing
  engine_lens_ = kv.seq_lens;
  engine_bound_ = kv.max_seq_len;
  engine_kv_ = &kv;
  const ForgetPools forget{engine_kv_};
  SparseAttentionInputs in = engine_inputs(tokens, kv);
  const PagedSelection shape = selection(1);
  const SparseDecodeOutcome decided = decoder_.require_fused(in, shape, name_ + " (engine pools)");
  if (device_ == Device::kCpu) {  // as the engine-paged step: judged before the selection is written
    // The lengths are host memory here: one outside [0, max_seq_len] is
    // named (on CUDA the indexer refuses that row and check_errors() names
    // it; on the CPU the decode would refuse the row's mark instead).
    std::vector<int64_t> lens(static_cast<size_t>(batch_));
    for (int32_t b = 0; b < batch_; ++b) {
      if (kv.seq_lens[b] < 0 || kv.seq_lens[b] > kv.max_seq_len) {
        throw Error(name_ + " (engine pools): kv.seq_lens[" + std::to_string(b) +
                    "] = " + std::to_string(kv.seq_lens[b]) +
                    " lies outside [0, max_seq_len = " + std::to_string(kv.max_seq_len) + "]");
      }
      lens[size_t(b)] = kv.seq_lens[b];
    }
    check_table_on_host(name_ + " (engine pools)", kv.block_table, lens, std::vector<uint8_t>(size_t(batch_), 1));
  }
  select_step(tokens, 1, stream);  // nothing appended: the engine wrote its rows
  LayerStep step;
  step.sparse = sparse_at(kv.max_seq_len);
  step.outcome = decoder_.run_fused(in, shape, decided, stream);
  step.fused = step.outcome.fused();
  return step;
}

void SparseLayer::check_errors(void* stream) {
  // Every flag is read (and so cleared) before the first report is thrown.
  std::string what;
  for (const auto& check : {std::function<void()>([&] { check_selection_errors(stream); }),
                            std::function<void()>([&] { check_prefill_errors(stream); }),
                            std::function<void()>([&] { decoder_.check_errors(stream); }),
                            std::function<void()>([&] { multi_decoder_.check_errors(stream); })}) {
    try {
      check();
    } catch (const Error& e) {
      what += what.empty() ? e.what() : std::string("; and ") + e.what();
    }
  }
  if (!what.empty()) throw Error(name_ + ": " + what);
}

std::vector<std::vector<int32_t>> SparseLayer::last_selected_positions() const {
  if (!have_selection_) return {};
  return selected_positions();
}

std::vector<std::vector<int32_t>> SparseLayer::last_mask_columns() {
  if (!have_selection_) throw Error(name_ + "::last_mask_columns: no decode has run yet");
  if (engine_paged()) throw Error(name_ + "::last_mask_columns: an engine-paged layer has no mask path");
  refuse_on_engine_pools("last_mask_columns");
  if (last_q_len_ != 1)
    throw Error(name_ + "::last_mask_columns: the mask path takes one-token steps; the last was multi-token");
  build_mask(fallback_.mask(), fallback_.capacity(), nullptr);
  const SparseAttentionInputs in = attention_inputs(StepTokens{}, 1);
  return mask_kept_columns(device_, fallback_.mask(), in.batch * in.num_kv_heads, fallback_.capacity());
}

int32_t* SparseLayer::index_error_word() {
  if (index_error_.empty()) {
    index_error_ = Buffer(device_, sizeof(int32_t));
    fill_bytes(index_error_.data(), device_, 0, sizeof(int32_t));
  }
  return index_error_.as<int32_t>();
}

void SparseLayer::raise_index_errors(void* stream, const std::string& refused, const char* length_what,
                                     const char* block_what) {
  if (index_error_.empty()) return;
  if (device_ == Device::kCuda) detail::cuda_stream_sync(stream);
  const int32_t bits = download<int32_t>(device_, index_error_.data(), 1)[0];
  if (bits == 0) return;
  fill_bytes(index_error_.data(), device_, 0, sizeof(int32_t));
  std::string what;
  if (bits & kIndexErrorLength) what += std::string(" ") + length_what + ";";
  if (bits & kIndexErrorBlock) what += std::string(" ") + block_what + ";";
  throw Error(refused + ":" + what);
}

}  // namespace sparsepage
