#include "support/continuous_batching.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"
#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr DType kDt = DType::kBF16;

// One step's inputs for every slot, in device buffers that stay put (so a
// captured step reads them on every replay); the host copies are refilled.
struct StepBuffers {
  size_t q = 0, q_extra = 0, index_q = 0, weights = 0, k = 0, v = 0, o = 0;  // elements per slot
  std::vector<uint8_t> h_q, h_q_extra, h_index_q, h_k, h_v;                  // bf16 bytes
  std::vector<float> h_weights;
  Buffer d_q, d_q_extra, d_index_q, d_weights, d_k, d_v, d_o;

  void allocate(Device device, int32_t slots) {
    const auto bytes = [&](size_t n) { return static_cast<size_t>(slots) * n * 2; };
    h_q.assign(bytes(q), 0xFF);
    h_q_extra.assign(bytes(q_extra), 0xFF);
    h_index_q.assign(bytes(index_q), 0xFF);
    h_k.assign(bytes(k), 0xFF);
    h_v.assign(bytes(v), 0xFF);
    h_weights.assign(static_cast<size_t>(slots) * weights, std::nanf(""));
    const auto make = [&](Buffer& b, size_t n) { b = Buffer(device, std::max<size_t>(n, 16)); };
    make(d_q, h_q.size());
    make(d_q_extra, h_q_extra.size());
    make(d_index_q, h_index_q.size());
    make(d_weights, h_weights.size() * sizeof(float));
    make(d_k, h_k.size());
    make(d_v, h_v.size());
    make(d_o, bytes(o));
  }
  void upload_all(Device device) {
    const auto put = [&](Buffer& b, const void* src, size_t n) {
      if (n > 0) copy_bytes(b.data(), device, src, Device::kCpu, n);
    };
    put(d_q, h_q.data(), h_q.size());
    put(d_q_extra, h_q_extra.data(), h_q_extra.size());
    put(d_index_q, h_index_q.data(), h_index_q.size());
    put(d_weights, h_weights.data(), h_weights.size() * sizeof(float));
    put(d_k, h_k.data(), h_k.size());
    put(d_v, h_v.data(), h_v.size());
    fill_bytes(d_o.data(), device, 0xFF, d_o.bytes());  // NaN: an unwritten row shows up
  }
};

// How one model is driven: its layer, its per-slot input sizes, its token
// struct over a StepBuffers, and its cache's prompt layout.
template <class Layer, class Tokens>
struct Model {
  std::function<std::unique_ptr<Layer>(Device, int32_t, DispatchConfig)> make;
  size_t q = 0, q_extra = 0, index_q = 0, weights = 0, k = 0, v = 0, o = 0;
  std::function<Tokens(StepBuffers&)> tokens;
  int32_t requests_per_slot = 1;  // rows of last_selected_positions() per slot
};

// Deterministic inputs of request `id`: its prompt, and its token j's inputs.
struct Request {
  int64_t id = 0;
  int64_t tokens = 0;  // tokens stepped so far
};

uint64_t mix(uint64_t seed, int64_t a, int64_t b) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(a) * 0xBF58476D1CE4E5B9ull ^
               static_cast<uint64_t>(b + 7) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Writes request `id`'s inputs for its token `j` into slot `slot` of `bufs`.
template <class M>
void fill_slot(const M& m, StepBuffers& bufs, int32_t slot, uint64_t seed, int64_t id, int64_t j) {
  std::mt19937_64 rng(mix(seed, id, j));
  const auto put = [&](std::vector<uint8_t>& dst, size_t n) {
    if (n == 0) return;
    const auto v = random_values(kDt, n, rng);
    std::copy(v.begin(), v.end(), dst.begin() + static_cast<std::ptrdiff_t>(slot * n * 2));
  };
  put(bufs.h_q, m.q);
  put(bufs.h_q_extra, m.q_extra);
  put(bufs.h_index_q, m.index_q);
  put(bufs.h_k, m.k);
  put(bufs.h_v, m.v);
  std::uniform_real_distribution<float> w(0.1f, 1.0f);
  for (size_t i = 0; i < m.weights; ++i) bufs.h_weights[slot * m.weights + i] = w(rng);
}

template <class M>
void poison_slot(const M& m, StepBuffers& bufs, int32_t slot) {
  const auto nan = [&](std::vector<uint8_t>& dst, size_t n) {
    std::fill(dst.begin() + static_cast<std::ptrdiff_t>(slot * n * 2),
              dst.begin() + static_cast<std::ptrdiff_t>((slot + 1) * n * 2), uint8_t{0xFF});
  };
  nan(bufs.h_q, m.q);
  nan(bufs.h_q_extra, m.q_extra);
  nan(bufs.h_index_q, m.index_q);
  nan(bufs.h_k, m.k);
  nan(bufs.h_v, m.v);
  for (size_t i = 0; i < m.weights; ++i) bufs.h_weights[slot * m.weights + i] = std::nanf("");
}

// Request `id`'s prompt of `n` tokens in the cache's layout for one slot:
// k [k_heads, n, k_dim], v [v_heads, n, v_dim].
std::pair<std::vector<uint8_t>, std::vector<uint8_t>> prompt_rows(const DenseKVCache& c, uint64_t seed, int64_t id,
                                                                  int64_t n) {
  std::mt19937_64 rng(mix(seed, id, -1));
  return {random_values(kDt, static_cast<size_t>(c.k_heads()) * n * c.k_head_dim(), rng),
          random_values(kDt, static_cast<size_t>(c.v_heads()) * n * c.v_head_dim(), rng)};
}

// Runs the ragged batch (gtest assertions inside, so it returns void and
// reports through `stats`).
template <class Layer, class Tokens>
void drive(Device device, const Model<Layer, Tokens>& m, const ContinuousBatchingRun& run, const std::string& name,
           ContinuousBatchingStats& stats) {
  std::mt19937_64 rng(run.seed);
  const DispatchConfig dispatch = run.always_fused ? always_fuse().without_performance_gates() : always_fuse();
  std::unique_ptr<Layer> batched = m.make(device, run.slots, dispatch);
  batched->reserve(run.max_prompt + run.steps + 1);
  for (int32_t s = 0; s < run.slots; ++s) batched->release(s);  // every slot starts free
  StepBuffers bufs, lone_bufs;
  for (StepBuffers* b : {&bufs, &lone_bufs}) {
    b->q = m.q, b->q_extra = m.q_extra, b->index_q = m.index_q, b->weights = m.weights;
    b->k = m.k, b->v = m.v, b->o = m.o;
  }
  bufs.allocate(device, run.slots);
  lone_bufs.allocate(device, 1);
  const Tokens batched_tokens = m.tokens(bufs);
  const Tokens lone_tokens = m.tokens(lone_bufs);
  std::vector<std::unique_ptr<Request>> slot(static_cast<size_t>(run.slots));
  std::map<int64_t, std::unique_ptr<Layer>> lone;  // by request id
  int64_t next_id = 0;

  // Where a slow or stuck run is: SPARSEPAGE_TEST_PROGRESS set prints every
  // 25th step; "calls" prints a line before every layer call, with the
  // slots' lengths, so the last line names the call that never returned.
  const char* progress_env = std::getenv("SPARSEPAGE_TEST_PROGRESS");
  const bool progress = progress_env != nullptr;
  const bool each_call = progress && std::string(progress_env) == "calls";
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  const bool timed = run.seconds > 0.0;
  for (int32_t step = 0; timed ? elapsed() < run.seconds : step < run.steps; ++step) {
    stats.steps = step + 1;
    if (progress && step % 25 == 0) std::fprintf(stderr, "%s: step %d\n", name.c_str(), step);
    // A refused call first, now and then: it must change nothing.
    if (std::bernoulli_distribution(run.bad_call)(rng)) {
      const std::vector<int64_t> before = batched->kv_lens();
      Tokens bad = batched_tokens;
      bad.o = nullptr;
      EXPECT_THROW(batched->decode(bad), Error) << name << ": a step without o";
      EXPECT_THROW(batched->admit(run.slots, nullptr, nullptr, 0), Error) << name << ": a slot past the batch";
      EXPECT_THROW(batched->admit(0, nullptr, nullptr, 3), Error) << name << ": a prompt without rows";
      EXPECT_EQ(batched->kv_lens(), before) << name << ": a refused call changed the lengths";
      stats.refused_calls += 3;
    }
    // Requests leave, then join.
    for (int32_t s = 0; s < run.slots; ++s) {
      // A timed run's requests leave at `steps` tokens too: the capacity reserved above holds.
      if (slot[s] && (std::bernoulli_distribution(run.leave)(rng) || (timed && slot[s]->tokens >= run.steps))) {
        lone.erase(slot[s]->id);
        slot[s].reset();
        batched->release(s);
        ++stats.released;
      }
    }
    for (int32_t s = 0; s < run.slots; ++s) {
      if (slot[s] || !std::bernoulli_distribution(run.join)(rng)) continue;
      auto r = std::make_unique<Request>();
      r->id = next_id++;
      const int64_t n = std::uniform_int_distribution<int64_t>(1, run.max_prompt)(rng);
      const auto [k, v] = prompt_rows(batched->cache(), run.seed, r->id, n);
      const Buffer dk = upload(device, k), dv = upload(device, v);
      batched->admit(s, dk.data(), v.empty() ? nullptr : dv.data(), n);
      auto l = m.make(device, 1, dispatch);
      l->reserve(run.max_prompt + run.steps + 1);
      l->admit(0, dk.data(), v.empty() ? nullptr : dv.data(), n);
      lone[r->id] = std::move(l);
      slot[s] = std::move(r);
      ++stats.admitted;
    }
    // This step's inputs: live slots from their requests, free slots NaN.
    for (int32_t s = 0; s < run.slots; ++s) {
      if (slot[s]) {
        fill_slot(m, bufs, s, run.seed, slot[s]->id, slot[s]->tokens);
      } else {
        poison_slot(m, bufs, s);
      }
    }
    bufs.upload_all(device);
    if (each_call) {
      std::string lens;
      for (int32_t s = 0; s < run.slots; ++s) {
        lens += slot[s] ? std::to_string(batched->kv_lens()[s]) + " " : std::string("free ");
      }
      std::fprintf(stderr, "%s: step %d: the batched step at lengths %s(before its token)\n", name.c_str(), step,
                   lens.c_str());
      std::fflush(stderr);
    }
    const auto one_step = [&](void* stream) { return batched->decode(batched_tokens, stream); };
    const LayerStep result = run.runner ? run.runner(one_step) : one_step(nullptr);
    batched->sync_live_len();  // after a replay the host's lengths are stale
    stats.fused_steps += result.fused ? 1 : 0;
    stats.sparse_steps += result.sparse ? 1 : 0;
    const auto o = download<uint16_t>(device, bufs.d_o.data(), static_cast<size_t>(run.slots) * m.o);
    const auto selected = batched->last_selected_positions();
    for (int32_t s = 0; s < run.slots; ++s) {
      const auto row = [&](const std::vector<uint16_t>& all, int32_t at) {
        return std::vector<uint16_t>(all.begin() + static_cast<std::ptrdiff_t>(at * m.o),
                                     all.begin() + static_cast<std::ptrdiff_t>((at + 1) * m.o));
      };
      if (!slot[s]) {  // a free slot: nothing attended, zeros written
        for (uint16_t x : row(o, s)) ASSERT_EQ(x & 0x7FFF, 0) << name << ": free slot " << s << " at step " << step;
        continue;
      }
      Request& r = *slot[s];
      Layer& l = *lone.at(r.id);
      fill_slot(m, lone_bufs, 0, run.seed, r.id, r.tokens);
      lone_bufs.upload_all(device);
      if (each_call) {
        std::fprintf(stderr, "%s: step %d: the lone run of request %lld (slot %d) at length %lld\n", name.c_str(), step,
                     static_cast<long long>(r.id), s, static_cast<long long>(l.kv_lens()[0]));
        std::fflush(stderr);
      }
      l.decode(lone_tokens);
      const auto lone_o = download<uint16_t>(device, lone_bufs.d_o.data(), m.o);
      const auto lone_sel = l.last_selected_positions();
      for (int32_t i = 0; i < m.requests_per_slot; ++i) {
        auto got = selected.at(static_cast<size_t>(s * m.requests_per_slot + i));
        auto want = lone_sel.at(static_cast<size_t>(i));
        std::sort(got.begin(), got.end());
        std::sort(want.begin(), want.end());
        ASSERT_EQ(got, want) << name << ": request " << r.id << " (slot " << s << ", row " << i << ") at step " << step
                             << ", length " << batched->kv_lens()[s];
      }
      std::vector<float> got(m.o), want(m.o);
      const std::vector<uint16_t> mine = row(o, s);  // once: the loop below is per element
      for (size_t i = 0; i < m.o; ++i) {
        got[i] = bf16_to_float(mine[i]);
        want[i] = bf16_to_float(lone_o[i]);
        ASSERT_FALSE(std::isnan(got[i])) << name << ": NaN in slot " << s << " at step " << step;
      }
      std::vector<double> ref(want.begin(), want.end());
      ASSERT_LT(relative_l2(got, ref), 1e-2)
          << name << ": request " << r.id << " differs from its lone run at step " << step;
      ++r.tokens;
      ++stats.compared_rows;
      stats.longest = std::max(stats.longest, batched->kv_lens()[s]);
    }
  }
  stats.seconds = elapsed();
}

}  // namespace

ContinuousBatchingStats check_block_sparse_continuous_batching(Device device, const ContinuousBatchingRun& run) {
  // 64 query heads over 4 KV heads on CUDA (its tile), a small geometry on the host.
  const bool cuda = device == Device::kCuda;
  BlockSparseConfig c{cuda ? 64 : 8, cuda ? 4 : 2, cuda ? 128 : 32, 16, 4, 2, 64};
  Model<BlockSparseAttention, BlockSparseTokens> m;
  m.make = [c](Device d, int32_t b, DispatchConfig dc) {
    return std::make_unique<BlockSparseAttention>(d, kDt, c, b, dc);
  };
  const size_t d = static_cast<size_t>(c.head_dim);
  m.q = m.o = static_cast<size_t>(c.num_qo_heads) * d;
  m.index_q = static_cast<size_t>(c.num_kv_heads) * d;
  m.k = static_cast<size_t>(c.num_kv_heads + 1) * d;
  m.v = static_cast<size_t>(c.num_kv_heads) * d;
  m.requests_per_slot = c.num_kv_heads;
  m.tokens = [](StepBuffers& b) {
    return BlockSparseTokens{b.d_q.data(), b.d_index_q.data(), b.d_k.data(), b.d_v.data(), b.d_o.data()};
  };
  ContinuousBatchingStats stats;
  drive(device, m, run, "block-sparse", stats);
  return stats;
}

ContinuousBatchingStats check_dsa_continuous_batching(Device device, const ContinuousBatchingRun& run) {
  const bool cuda = device == Device::kCuda;
  DsaConfig c;
  c.num_qo_heads = cuda ? 128 : 4;
  c.latent_dim = cuda ? 512 : 32;
  c.rope_dim = cuda ? 64 : 8;
  c.index_heads = cuda ? 8 : 3;
  c.index_head_dim = cuda ? 64 : 16;
  c.index_topk = 48;
  c.capacity_step = 64;
  Model<DsaAttention, DsaTokens> m;
  m.make = [c](Device d, int32_t b, DispatchConfig dc) { return std::make_unique<DsaAttention>(d, kDt, c, b, dc); };
  m.q = m.o = static_cast<size_t>(c.num_qo_heads) * c.latent_dim;
  m.q_extra = static_cast<size_t>(c.num_qo_heads) * c.rope_dim;
  m.index_q = static_cast<size_t>(c.index_heads) * c.index_head_dim;
  m.weights = static_cast<size_t>(c.index_heads);
  m.k = static_cast<size_t>(c.latent_dim + c.index_head_dim);
  m.v = static_cast<size_t>(c.rope_dim);
  m.tokens = [](StepBuffers& b) {
    DsaTokens t;
    t.q_latent = b.d_q.data();
    t.q_pe = b.d_q_extra.data();
    t.q_index = b.d_index_q.data();
    t.index_weights = b.d_weights.as<float>();
    t.k_cache_row = b.d_k.data();
    t.k_pe = b.d_v.data();
    t.o = b.d_o.data();
    return t;
  };
  ContinuousBatchingStats stats;
  drive(device, m, run, "DSA", stats);
  return stats;
}

ContinuousBatchingStats check_static_continuous_batching(Device device, const ContinuousBatchingRun& run) {
  const bool cuda = device == Device::kCuda;
  StaticBlockSparseConfig c{cuda ? 32 : 8, cuda ? 8 : 2, cuda ? 128 : 32, 16, 3, 4, 64};
  Model<StaticBlockSparseAttention, StaticBlockSparseTokens> m;
  m.make = [c](Device d, int32_t b, DispatchConfig dc) {
    return std::make_unique<StaticBlockSparseAttention>(d, kDt, c, b, dc);
  };
  const size_t d = static_cast<size_t>(c.head_dim);
  m.q = m.o = static_cast<size_t>(c.num_qo_heads) * d;
  m.k = m.v = static_cast<size_t>(c.num_kv_heads) * d;
  m.requests_per_slot = c.num_qo_heads;
  m.tokens = [](StepBuffers& b) {
    return StaticBlockSparseTokens{b.d_q.data(), b.d_k.data(), b.d_v.data(), b.d_o.data()};
  };
  ContinuousBatchingStats stats;
  drive(device, m, run, "static", stats);
  return stats;
}

}  // namespace sparsepage::testing
