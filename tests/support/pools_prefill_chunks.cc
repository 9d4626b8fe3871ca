#include "support/pools_prefill_chunks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "support/expect_error.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr DType kDt = DType::kBF16;

DispatchConfig fused() { return always_fuse().without_performance_gates(); }

}  // namespace

std::vector<const void*> pointers(const std::vector<Buffer>& buffers) {
  std::vector<const void*> out;
  for (const Buffer& b : buffers) out.push_back(b.data());
  return out;
}

PoolsChunks::PoolsChunks(Device device, const BlockSparseConfig& config, const PoolsChunksCase& c)
    : device_(device),
      dsa_(false),
      block_(config),
      batch_(static_cast<int32_t>(c.prompt.size())),
      n_(c.num_tokens),
      chunks_(c.chunks),
      prompt_(c.prompt) {
  std::mt19937_64 rng(c.seed);
  const int32_t hq = config.num_qo_heads, hkv = config.num_kv_heads, d = config.head_dim;
  build(rng, int64_t{hkv} * d, 2, d);
  o_elems_ = static_cast<size_t>(int64_t{batch_} * n_ * hq * d);
  for (int32_t k = 0; k < chunks_; ++k) {
    std::vector<Buffer> in;
    in.push_back(to_device(device, kDt, quarter_grid(rng, static_cast<size_t>(int64_t{batch_} * n_ * hq * d))));
    in.push_back(to_device(device, kDt, quarter_grid(rng, static_cast<size_t>(int64_t{batch_} * n_ * hkv * d))));
    inputs_.push_back(std::move(in));
  }
  index_k_ = to_device(device, kDt, std::vector<float>(static_cast<size_t>(int64_t{n_} * batch_ * d), 0.0f));
}

PoolsChunks::PoolsChunks(Device device, const DsaConfig& config, const PoolsChunksCase& c)
    : device_(device),
      dsa_(true),
      mla_(config),
      batch_(static_cast<int32_t>(c.prompt.size())),
      n_(c.num_tokens),
      chunks_(c.chunks),
      prompt_(c.prompt) {
  std::mt19937_64 rng(c.seed);
  const int32_t h = config.num_qo_heads, dl = config.latent_dim, dr = config.rope_dim;
  const int32_t ih = config.index_heads, id = config.index_head_dim;
  build(rng, int64_t{dl} + dr, 1, id);
  o_elems_ = static_cast<size_t>(int64_t{batch_} * n_ * h * dl);
  const auto rows = static_cast<size_t>(int64_t{batch_} * n_);
  for (int32_t k = 0; k < chunks_; ++k) {
    std::vector<Buffer> in;
    in.push_back(to_device(device, kDt, quarter_grid(rng, rows * static_cast<size_t>(h * dl))));
    in.push_back(to_device(device, kDt, quarter_grid(rng, rows * static_cast<size_t>(h * dr))));
    in.push_back(to_device(device, kDt, quarter_grid(rng, rows * static_cast<size_t>(ih * id))));
    in.push_back(to_device(device, DType::kF32, quarter_grid(rng, rows * static_cast<size_t>(ih))));
    inputs_.push_back(std::move(in));
  }
  index_k_ = to_device(device, kDt, std::vector<float>(static_cast<size_t>(int64_t{n_} * batch_ * id), 0.0f));
}

void PoolsChunks::build(std::mt19937_64& rng, int64_t kv_elems, int32_t num_pools, int32_t key_dim) {
  // Chunk k's lengths: prompt + (k + 1) * n for the slots in the calls.
  for (int32_t k = 0; k < chunks_; ++k) {
    std::vector<int32_t> l;
    for (int64_t p : prompt_) l.push_back(p < 0 ? 0 : static_cast<int32_t>(p + int64_t{k + 1} * n_));
    lens_.push_back(l);
    lens_dev_.push_back(upload(device_, l));
  }
  const std::vector<int32_t>& last = lens_.back();
  const int64_t longest = *std::max_element(last.begin(), last.end());
  bound_ = longest + 5;  // a looser bound than any length
  pool_ = std::make_unique<EnginePool>(device_, batch_, static_cast<int32_t>(longest / kEngineBlock + 2), kv_elems,
                                       num_pools, rng);
  keys_ = std::make_unique<EngineKeys>(*pool_, false, key_dim);
  for (int32_t b = 0; b < batch_; ++b) {
    const int64_t len = last[static_cast<size_t>(b)];
    const std::vector<float> rows = quarter_grid(rng, static_cast<size_t>(len * kv_elems * num_pools));
    const std::vector<float> keys = quarter_grid(rng, static_cast<size_t>(len * key_dim));
    for (int64_t p = 0; p < len; ++p) {
      for (int32_t i = 0; i < num_pools; ++i) pool_->write(i, b, p, rows.data() + (p * num_pools + i) * kv_elems);
      keys_->write(b, p, keys.data() + p * key_dim);
    }
  }
  const EnginePagedKV rows =
      dsa_ ? pool_->mla_kv(mla_.latent_dim, mla_.rope_dim, false) : pool_->kv(block_.head_dim, block_.num_kv_heads);
  kv_ = keys_->pools_kv(rows, lens_[0], bound_);
}

EnginePagedKV PoolsChunks::kv(int32_t c) const {
  EnginePagedKV kv = kv_;
  kv.seq_lens = lens_dev_[static_cast<size_t>(c)].as<int32_t>();
  kv.host_seq_lens = nullptr;
  return kv;
}

std::unique_ptr<SparseLayer> PoolsChunks::make_layer() const {
  if (dsa_) {
    DsaConfig cfg = mla_;
    cfg.kv_storage = KVStorage::kEnginePools;
    return std::make_unique<DsaAttention>(device_, kDt, cfg, batch_, fused());
  }
  BlockSparseConfig cfg = block_;
  cfg.kv_storage = KVStorage::kEnginePools;
  return std::make_unique<BlockSparseAttention>(device_, kDt, cfg, batch_, fused());
}

std::unique_ptr<SparseLayer> PoolsChunks::make_paged_layer() const {
  if (dsa_) {
    DsaConfig cfg = mla_;
    cfg.kv_storage = KVStorage::kEnginePaged;
    return std::make_unique<DsaAttention>(device_, kDt, cfg, batch_, fused());
  }
  BlockSparseConfig cfg = block_;
  cfg.kv_storage = KVStorage::kEnginePaged;
  return std::make_unique<BlockSparseAttention>(device_, kDt, cfg, batch_, fused());
}

void PoolsChunks::run(SparseLayer& layer, const std::vector<const void*>& in, void* o, const EnginePagedKV& kv,
                      void* stream) const {
  if (dsa_) {
    DsaTokens t;
    t.q_latent = in[0];
    t.q_pe = in[1];
    t.q_index = in[2];
    t.index_weights = static_cast<const float*>(in[3]);
    t.o = o;
    dynamic_cast<DsaAttention&>(layer).prefill(t, kv, n_, stream);
    return;
  }
  BlockSparseTokens t;
  t.q = in[0];
  t.index_q = in[1];
  t.o = o;
  dynamic_cast<BlockSparseAttention&>(layer).prefill(t, kv, n_, stream);
}

void PoolsChunks::run_paged(SparseLayer& layer, const std::vector<const void*>& in, void* o,
                            const EnginePagedKV& kv) const {
  if (dsa_) {
    DsaTokens t;
    t.q_latent = in[0];
    t.q_pe = in[1];
    t.q_index = in[2];
    t.index_weights = static_cast<const float*>(in[3]);
    t.index_k = index_k_.data();
    t.o = o;
    dynamic_cast<DsaAttention&>(layer).prefill(t, kv, n_);
    return;
  }
  BlockSparseTokens t;
  t.q = in[0];
  t.index_q = in[1];
  t.index_k = index_k_.data();
  t.o = o;
  dynamic_cast<BlockSparseAttention&>(layer).prefill(t, kv, n_);
}

namespace {

bool all_nan(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float v) { return std::isnan(v); });
}

}  // namespace

void check_pools_host_lens(const PoolsChunks& p) {
  const Device device = p.device();
  const int32_t batch = p.batch(), n = p.num_tokens();
  const size_t row = p.o_elems() / static_cast<size_t>(int64_t{batch} * n);  // one token's output values
  const std::unique_ptr<SparseLayer> layer = p.make_layer();
  for (int32_t c = 0; c < p.chunks(); ++c) {
    SCOPED_TRACE("chunk " + std::to_string(c));
    const std::vector<const void*> in = pointers(p.inputs(c));
    Buffer read_o = poisoned(device, p.o_elems()), host_o = poisoned(device, p.o_elems());
    p.run(*layer, in, read_o.data(), p.kv(c));  // the lengths read back
    layer->check_errors();
    const auto read_positions = layer->last_prefill_positions();
    EnginePagedKV kv = p.kv(c);
    const std::vector<int32_t> host = p.lens(c);
    kv.host_seq_lens = host.data();
    p.run(*layer, in, host_o.data(), kv);
    layer->check_errors();
    EXPECT_EQ(layer->last_prefill_positions(), read_positions) << "the host-lengths form kept other positions";
    const auto got = download<uint8_t>(device, host_o.data(), p.o_bytes());
    EXPECT_EQ(got, download<uint8_t>(device, read_o.data(), p.o_bytes()))
        << "the host-lengths form is not bit-identical to the read-back form";
    const std::vector<float> o = read_bf16(device, host_o, p.o_elems());
    for (int32_t b = 0; b < batch; ++b) {
      const auto first = o.begin() + static_cast<int64_t>(static_cast<size_t>(b) * n * row);
      const std::vector<float> rows(first, first + static_cast<int64_t>(static_cast<size_t>(n) * row));
      if (!p.active(b)) {
        EXPECT_TRUE(std::all_of(rows.begin(), rows.end(), [](float x) { return x == 0.0f; })) << "free slot " << b;
      } else {
        EXPECT_TRUE(std::none_of(rows.begin(), rows.end(), [](float x) { return std::isnan(x); })) << "slot " << b;
      }
    }
  }

  // Refusals on the host copy, by name, o untouched. On the CPU the device
  // lengths are host memory: the bad copy is written there too (a copy
  // that differs is refused by a check of its own, below); on CUDA they
  // stay good, a disagreement only the host copy shows.
  int32_t first = 0;
  while (!p.active(first)) ++first;
  const std::vector<const void*> in = pointers(p.inputs(0));
  Buffer o = poisoned(device, p.o_elems());
  const auto refused = [&](std::vector<int32_t> host, const std::string& needle) {
    EnginePagedKV kv = p.kv(0);
    const Buffer dev = upload(device, host);
    if (device == Device::kCpu) kv.seq_lens = dev.as<int32_t>();
    kv.host_seq_lens = host.data();
    EXPECT_TRUE(throws_error_naming([&] { p.run(*layer, in, o.data(), kv); }, needle)) << needle;
  };
  const std::string who = layer->name() + "::prefill(tokens, kv) (engine pools): ";
  const std::string slot = "kv.host_seq_lens[" + std::to_string(first) + "] = ";
  std::vector<int32_t> bad = p.lens(0);
  bad[static_cast<size_t>(first)] = static_cast<int32_t>(p.max_seq_len() + 1);
  refused(bad, who + slot + std::to_string(p.max_seq_len() + 1) + " must be 0 (a free slot) or lie in [num_tokens");
  bad[static_cast<size_t>(first)] = n - 1;
  refused(bad, who + slot + std::to_string(n - 1) + " must be 0");
  refused(std::vector<int32_t>(static_cast<size_t>(batch), 0),
          who + "every slot is free (kv.host_seq_lens is 0 everywhere)");
  if (dynamic_cast<BlockSparseAttention*>(layer.get()) != nullptr) {
    bad = p.lens(0);
    bad[static_cast<size_t>(first)] += 1;
    refused(bad, "not a multiple of block_size");
  }
  if (device == Device::kCpu) {
    EnginePagedKV kv = p.kv(0);
    std::vector<int32_t> host = p.lens(0);
    host[static_cast<size_t>(first)] -= 1;
    kv.host_seq_lens = host.data();
    EXPECT_TRUE(throws_error_naming([&] { p.run(*layer, in, o.data(), kv); },
                                    who + slot + std::to_string(host[static_cast<size_t>(first)]) +
                                        " differs from kv.seq_lens[" + std::to_string(first) +
                                        "] = " + std::to_string(p.lens(0)[static_cast<size_t>(first)])));
  }
  EXPECT_TRUE(all_nan(read_bf16(device, o, p.o_elems()))) << "a refused chunk wrote o";

  // An engine-paged layer keeps its lengths: the host copy is refused.
  const std::unique_ptr<SparseLayer> paged = p.make_paged_layer();
  EnginePagedKV paged_kv = p.kv(0);
  paged_kv.index_keys = PagedIndexKeys{};
  paged_kv.seq_lens = nullptr;
  paged_kv.max_seq_len = 0;
  const std::vector<int32_t> host = p.lens(0);
  paged_kv.host_seq_lens = host.data();
  EXPECT_TRUE(throws_error_naming([&] { p.run_paged(*paged, in, o.data(), paged_kv); },
                                  "kv.host_seq_lens is for KVStorage::kEnginePools layers"));
}

}  // namespace sparsepage::testing
