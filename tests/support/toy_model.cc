#include "support/toy_model.h"

#include "support/reference.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <tuple>

namespace sparsepage::testing {

struct ToyModel::Weights {
  std::vector<float> embed;    // [vocab, d]
  std::vector<float> unembed;  // [vocab, d]
  struct Layer {
    std::vector<float> wq, wk, wv, wiq, wo, w1, w2;
  };
  std::vector<Layer> layers;
};

namespace {

std::vector<float> random_matrix(std::mt19937_64& rng, size_t rows, size_t cols) {
  std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(rows)));
  std::vector<float> m(rows * cols);
  for (float& x : m) x = dist(rng);
  return m;
}

// y = x W for x [n_in] and W [n_in, n_out].
std::vector<float> matvec(const std::vector<float>& x, const std::vector<float>& w, size_t n_out) {
  std::vector<float> y(n_out, 0.0f);
  for (size_t i = 0; i < x.size(); ++i) {
    const float xi = x[i];
    const float* row = &w[i * n_out];
    for (size_t j = 0; j < n_out; ++j) y[j] += xi * row[j];
  }
  return y;
}

std::vector<float> rms_norm(const std::vector<float>& x) {
  double ss = 0;
  for (float v : x) ss += double{v} * v;
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(x.size())) + 1e-6f);
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv;
  return y;
}

// The token's embedding plus sinusoidal positions (which keep greedy decoding
// from settling on a fixed point).
std::vector<float> embed_with_position(const std::vector<float>& embed, int32_t token, size_t d, int64_t position) {
  std::vector<float> x(embed.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(token) * d),
                       embed.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(token) + 1) * d));
  const float pos = static_cast<float>(position);
  for (size_t i = 0; i < d; ++i) {
    x[i] += std::sin(pos / std::pow(100.0f, static_cast<float>(i) / static_cast<float>(d)) + static_cast<float>(i));
  }
  return x;
}

// x += attn Wo, then x += W2 relu(W1 rms(x)).
void add_block(std::vector<float>& x, const std::vector<float>& attn, const std::vector<float>& wo,
               const std::vector<float>& w1, const std::vector<float>& w2) {
  const size_t d = x.size();
  const std::vector<float> proj = matvec(attn, wo, d);
  for (size_t i = 0; i < d; ++i) x[i] += proj[i];
  std::vector<float> mid = matvec(rms_norm(x), w1, 2 * d);
  for (float& m : mid) m = std::max(m, 0.0f);
  const std::vector<float> out = matvec(mid, w2, d);
  for (size_t i = 0; i < d; ++i) x[i] += out[i];
}

// logits = rms(x) . unembed[t]. The unembedding is its own random matrix:
// tied embeddings would make every token predict itself.
std::vector<float> logits_of(const std::vector<float>& x, const std::vector<float>& embed, size_t vocab) {
  const std::vector<float> hidden = rms_norm(x);
  const size_t d = x.size();
  std::vector<float> logits(vocab);
  for (size_t t = 0; t < vocab; ++t) {
    float dot = 0;
    for (size_t i = 0; i < d; ++i) dot += hidden[i] * embed[t * d + i];
    logits[t] = dot;
  }
  return logits;
}

// Token embeddings at unit scale and a separate random unembedding.
void init_embeddings(std::mt19937_64& rng, int32_t vocab, int32_t d_model, std::vector<float>& embed,
                     std::vector<float>& unembed) {
  const size_t v = static_cast<size_t>(vocab), d = static_cast<size_t>(d_model);
  embed = random_matrix(rng, v, d);
  for (float& x : embed) x *= std::sqrt(static_cast<float>(vocab));
  unembed = random_matrix(rng, d, v);
}

// A layer's bf16 output buffer, NaN until the layer writes it: an unwritten
// output cannot pass as attention.
Buffer poisoned_output(Device device, size_t count) {
  Buffer o(device, count * 2);
  fill_bytes(o.data(), device, 0xFF, o.bytes());
  return o;
}

std::vector<float> read_output(Device device, const Buffer& o) {
  std::vector<float> x(o.bytes() / 2);
  const auto bytes = download<uint8_t>(device, o.data(), o.bytes());
  to_float(DType::kBF16, bytes.data(), x.data(), x.size());
  return x;
}

// add_block on each row r of xs, with row r of the layer's output o.
template <typename LayerWeights>
void add_blocks(std::vector<std::vector<float>>& xs, Device device, const Buffer& o, const LayerWeights& w) {
  const std::vector<float> attn = read_output(device, o);
  const size_t width = attn.size() / xs.size();
  for (size_t r = 0; r < xs.size(); ++r) {
    const auto row = attn.begin() + static_cast<std::ptrdiff_t>(r * width);
    add_block(xs[r], std::vector<float>(row, row + static_cast<std::ptrdiff_t>(width)), w.wo, w.w1, w.w2);
  }
}

// A ToyModel token's widths: d the model's, hd a head's, qo the queries',
// kv the K (or V) heads'.
struct Widths {
  size_t d, hd, qo, kv;
};
Widths widths_of(const ToyModelConfig& c) {
  const bool is_static = c.kind == ToyAttention::kStaticBlockSparse;
  const auto& a = c.attention;
  const auto& sa = c.static_attention;
  const size_t hd = static_cast<size_t>(is_static ? sa.head_dim : a.head_dim);
  return {static_cast<size_t>(c.d_model), hd, static_cast<size_t>(is_static ? sa.num_qo_heads : a.num_qo_heads) * hd,
          static_cast<size_t>(is_static ? sa.num_kv_heads : a.num_kv_heads) * hd};
}

}  // namespace

ToyModel::ToyModel(Device device, const ToyModelConfig& config, DispatchConfig dispatch)
    : device_(device), config_(config), weights_(std::make_unique<Weights>()) {
  std::mt19937_64 rng(config.seed);
  const bool is_static = config.kind == ToyAttention::kStaticBlockSparse;
  const auto& a = config.attention;
  const auto& sa = config.static_attention;
  const size_t qo_heads = static_cast<size_t>(is_static ? sa.num_qo_heads : a.num_qo_heads);
  const size_t kv_heads = static_cast<size_t>(is_static ? sa.num_kv_heads : a.num_kv_heads);
  const size_t d = static_cast<size_t>(config.d_model), hd = static_cast<size_t>(is_static ? sa.head_dim : a.head_dim);
  init_embeddings(rng, config.vocab, config.d_model, weights_->embed, weights_->unembed);
  for (int32_t l = 0; l < config.layers; ++l) {
    Weights::Layer layer;
    layer.wq = random_matrix(rng, d, qo_heads * hd);
    // The block-sparse layer's K carries the index key as one more head.
    layer.wk = random_matrix(rng, d, (kv_heads + (is_static ? 0 : 1)) * hd);
    layer.wv = random_matrix(rng, d, kv_heads * hd);
    if (!is_static) layer.wiq = random_matrix(rng, d, kv_heads * hd);
    layer.wo = random_matrix(rng, qo_heads * hd, d);
    layer.w1 = random_matrix(rng, d, 2 * d);
    layer.w2 = random_matrix(rng, 2 * d, d);
    weights_->layers.push_back(std::move(layer));
    if (is_static) {
      static_layers_.push_back(
          std::make_unique<StaticBlockSparseAttention>(device, DType::kBF16, sa, config.batch, dispatch));
    } else {
      layers_.push_back(std::make_unique<BlockSparseAttention>(device, DType::kBF16, a, config.batch, dispatch));
    }
  }
}

ToyModel::~ToyModel() = default;

std::vector<std::vector<float>> ToyModel::forward(const std::vector<int32_t>& tokens, bool prefill) {
  const bool is_static = config_.kind == ToyAttention::kStaticBlockSparse;
  const auto [d, hd, qo, kv] = widths_of(config_);
  std::vector<std::vector<float>> xs;
  for (int32_t token : tokens) xs.push_back(embed_with_position(weights_->embed, token, d, position_));
  ++position_;
  for (int32_t l = 0; l < config_.layers; ++l) {
    const auto& w = weights_->layers[static_cast<size_t>(l)];
    // Each sequence's projections, concatenated in batch order.
    std::vector<float> q, k, v, iq;
    for (const auto& x : xs) {
      const std::vector<float> h = rms_norm(x);
      for (auto [out, weight, n] :
           {std::make_tuple(&q, &w.wq, qo), std::make_tuple(&k, &w.wk, kv + (is_static ? 0 : hd)),
            std::make_tuple(&v, &w.wv, kv), std::make_tuple(&iq, &w.wiq, is_static ? 0 : kv)}) {
        if (n == 0) continue;
        const std::vector<float> y = matvec(h, *weight, n);
        out->insert(out->end(), y.begin(), y.end());
      }
    }
    const Buffer qd = to_device(device_, DType::kBF16, q), kd = to_device(device_, DType::kBF16, k);
    const Buffer vd = to_device(device_, DType::kBF16, v);
    Buffer o = poisoned_output(device_, xs.size() * qo);
    if (is_static) {
      // The prompt runs through decode too: the pattern holds at every position.
      auto& layer = *static_layers_[static_cast<size_t>(l)];
      const LayerStep step = layer.decode({qd.data(), kd.data(), vd.data(), o.data()});
      if (!prefill) {
        sparse_steps_ += layer.max_kept_tokens(layer.kv_len()) < layer.kv_len() ? 1 : 0;
        fused_steps_ += step.fused ? 1 : 0;
      }
    } else {
      const Buffer iqd = to_device(device_, DType::kBF16, iq);
      BlockSparseTokens step_tokens{qd.data(), iqd.data(), kd.data(), vd.data(), o.data()};
      if (prefill) {
        layers_[static_cast<size_t>(l)]->prefill_token(step_tokens);
      } else {
        const LayerStep step = layers_[static_cast<size_t>(l)]->decode(step_tokens);
        sparse_steps_ += step.sparse ? 1 : 0;
        fused_steps_ += step.fused ? 1 : 0;
      }
    }
    add_blocks(xs, device_, o, w);
  }
  std::vector<std::vector<float>> logits;
  for (const auto& x : xs) logits.push_back(logits_of(x, weights_->unembed, static_cast<size_t>(config_.vocab)));
  return logits;
}

// Greedy decoding shared by both toy models, one prompt per sequence (of one
// length): prefill all but the last prompt token, then feed back each
// sequence's arg-max.
template <typename Forward>
std::vector<std::vector<int32_t>> greedy(const std::vector<std::vector<int32_t>>& prompts, int32_t steps,
                                         Forward&& forward, std::vector<std::vector<float>>* margins = nullptr) {
  if (prompts.empty()) throw Error("greedy: no prompts");
  std::vector<int32_t> tokens(prompts.size());
  for (size_t i = 0; i + 1 < prompts[0].size(); ++i) {
    for (size_t b = 0; b < prompts.size(); ++b) tokens[b] = prompts[b].at(i);
    forward(tokens, /*prefill=*/true);
  }
  std::vector<std::vector<int32_t>> out(prompts.size());
  for (size_t b = 0; b < prompts.size(); ++b) tokens[b] = prompts[b].back();
  for (int32_t s = 0; s < steps; ++s) {
    const std::vector<std::vector<float>> logits = forward(tokens, /*prefill=*/false);
    for (size_t b = 0; b < prompts.size(); ++b) {
      tokens[b] = static_cast<int32_t>(std::max_element(logits[b].begin(), logits[b].end()) - logits[b].begin());
      out[b].push_back(tokens[b]);
      if (margins != nullptr) {
        std::vector<float> top(logits[b]);
        std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
        (*margins)[b].push_back(top[0] - top[1]);
      }
    }
  }
  return out;
}

// The toy's layers are position-wise but for attention, so a chunk runs
// each (sequence, token) row through the dense parts and the chunk's rows
// through one prefill() call per layer.
void ToyModel::forward_chunk(const std::vector<std::vector<int32_t>>& tokens) {
  const bool is_static = config_.kind == ToyAttention::kStaticBlockSparse;
  const auto [d, hd, qo, kv] = widths_of(config_);
  const size_t batch = tokens.size(), n = tokens[0].size();
  std::vector<std::vector<float>> xs;  // row b * n + t
  for (size_t b = 0; b < batch; ++b) {
    for (size_t t = 0; t < n; ++t) {
      xs.push_back(embed_with_position(weights_->embed, tokens[b][t], d, position_ + static_cast<int64_t>(t)));
    }
  }
  position_ += static_cast<int64_t>(n);
  const size_t k_width = kv + (is_static ? 0 : hd);
  for (int32_t l = 0; l < config_.layers; ++l) {
    const auto& w = weights_->layers[static_cast<size_t>(l)];
    // q and index_q [batch, n, ...]; k and v token-major [n, batch, ...].
    std::vector<float> q(batch * n * qo), iq(batch * n * kv), k(batch * n * k_width), v(batch * n * kv);
    for (size_t b = 0; b < batch; ++b) {
      for (size_t t = 0; t < n; ++t) {
        const std::vector<float> h = rms_norm(xs[b * n + t]);
        const size_t row = b * n + t, token_major = t * batch + b;
        const std::vector<float> qr = matvec(h, w.wq, qo), kr = matvec(h, w.wk, k_width), vr = matvec(h, w.wv, kv);
        std::copy(qr.begin(), qr.end(), q.begin() + static_cast<std::ptrdiff_t>(row * qo));
        std::copy(kr.begin(), kr.end(), k.begin() + static_cast<std::ptrdiff_t>(token_major * k_width));
        std::copy(vr.begin(), vr.end(), v.begin() + static_cast<std::ptrdiff_t>(token_major * kv));
        if (!is_static) {
          const std::vector<float> ir = matvec(h, w.wiq, kv);
          std::copy(ir.begin(), ir.end(), iq.begin() + static_cast<std::ptrdiff_t>(row * kv));
        }
      }
    }
    const Buffer qd = to_device(device_, DType::kBF16, q), kd = to_device(device_, DType::kBF16, k);
    const Buffer vd = to_device(device_, DType::kBF16, v);
    Buffer o = poisoned_output(device_, batch * n * qo);
    const auto chunk = static_cast<int32_t>(n);
    if (is_static) {
      static_layers_[static_cast<size_t>(l)]->prefill({qd.data(), kd.data(), vd.data(), o.data()}, chunk);
    } else {
      const Buffer iqd = to_device(device_, DType::kBF16, iq);
      layers_[static_cast<size_t>(l)]->prefill({qd.data(), iqd.data(), kd.data(), vd.data(), o.data()}, chunk);
    }
    add_blocks(xs, device_, o, w);
  }
}

std::vector<std::vector<int32_t>> ToyModel::generate(const std::vector<std::vector<int32_t>>& prompts, int32_t steps) {
  if (static_cast<int32_t>(prompts.size()) != config_.batch) throw Error("ToyModel::generate: one prompt per sequence");
  margins_.assign(prompts.size(), {});
  std::vector<std::vector<int32_t>> rest = prompts;
  if (config_.prefill_chunk > 0) {
    const auto chunk = static_cast<size_t>(config_.prefill_chunk);
    while (rest[0].size() > chunk) {  // keeps the last prompt token for the first decode
      std::vector<std::vector<int32_t>> tokens;
      for (auto& p : rest) {
        tokens.emplace_back(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(chunk));
        p.erase(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(chunk));
      }
      forward_chunk(tokens);
    }
  }
  return greedy(
      rest, steps, [this](const std::vector<int32_t>& t, bool prefill) { return forward(t, prefill); }, &margins_);
}

struct DsaToyModel::Weights {
  std::vector<float> embed;    // [vocab, d]
  std::vector<float> unembed;  // [vocab, d]
  struct Layer {
    std::vector<float> w_kv, w_kr, w_ik, w_q, w_qr, w_qi, w_w, wo, w1, w2;
  };
  std::vector<Layer> layers;
};

DsaToyModel::DsaToyModel(Device device, const DsaToyConfig& config, DispatchConfig dispatch)
    : device_(device), config_(config), weights_(std::make_unique<Weights>()) {
  std::mt19937_64 rng(config.seed);
  const auto& a = config.attention;
  const size_t d = static_cast<size_t>(config.d_model), h = static_cast<size_t>(a.num_qo_heads);
  init_embeddings(rng, config.vocab, config.d_model, weights_->embed, weights_->unembed);
  for (int32_t l = 0; l < config.layers; ++l) {
    Weights::Layer w;
    w.w_kv = random_matrix(rng, d, static_cast<size_t>(a.latent_dim));
    w.w_kr = random_matrix(rng, d, static_cast<size_t>(a.rope_dim));
    w.w_ik = random_matrix(rng, d, static_cast<size_t>(a.index_head_dim));
    w.w_q = random_matrix(rng, d, h * static_cast<size_t>(a.latent_dim));
    w.w_qr = random_matrix(rng, d, h * static_cast<size_t>(a.rope_dim));
    w.w_qi = random_matrix(rng, d, static_cast<size_t>(a.index_heads) * static_cast<size_t>(a.index_head_dim));
    w.w_w = random_matrix(rng, d, static_cast<size_t>(a.index_heads));
    w.wo = random_matrix(rng, h * static_cast<size_t>(a.latent_dim), d);
    w.w1 = random_matrix(rng, d, 2 * d);
    w.w2 = random_matrix(rng, 2 * d, d);
    weights_->layers.push_back(std::move(w));
    layers_.push_back(std::make_unique<DsaAttention>(device, DType::kBF16, a, 1, dispatch));
  }
}

DsaToyModel::~DsaToyModel() = default;

std::vector<float> DsaToyModel::forward(int32_t token, bool prefill) {
  const auto& a = config_.attention;
  const size_t d = static_cast<size_t>(config_.d_model), h = static_cast<size_t>(a.num_qo_heads);
  std::vector<float> x = embed_with_position(weights_->embed, token, d, position_++);
  for (int32_t l = 0; l < config_.layers; ++l) {
    const auto& w = weights_->layers[static_cast<size_t>(l)];
    const std::vector<float> hn = rms_norm(x);
    std::vector<float> k_row = matvec(hn, w.w_kv, static_cast<size_t>(a.latent_dim));
    const std::vector<float> index_key = matvec(hn, w.w_ik, static_cast<size_t>(a.index_head_dim));
    k_row.insert(k_row.end(), index_key.begin(), index_key.end());
    const Buffer k = to_device(device_, DType::kBF16, k_row);
    const Buffer k_pe = to_device(device_, DType::kBF16, matvec(hn, w.w_kr, static_cast<size_t>(a.rope_dim)));
    const Buffer q = to_device(device_, DType::kBF16, matvec(hn, w.w_q, h * static_cast<size_t>(a.latent_dim)));
    const Buffer q_pe = to_device(device_, DType::kBF16, matvec(hn, w.w_qr, h * static_cast<size_t>(a.rope_dim)));
    const Buffer q_index =
        to_device(device_, DType::kBF16,
                  matvec(hn, w.w_qi, static_cast<size_t>(a.index_heads) * static_cast<size_t>(a.index_head_dim)));
    const Buffer weights = upload(device_, matvec(hn, w.w_w, static_cast<size_t>(a.index_heads)));
    Buffer o = poisoned_output(device_, h * static_cast<size_t>(a.latent_dim));
    const DsaTokens tokens{q.data(), q_pe.data(), q_index.data(), weights.as<float>(), k.data(), k_pe.data(), o.data()};
    if (prefill) {
      layers_[static_cast<size_t>(l)]->prefill_token(tokens);
    } else {
      const LayerStep step = layers_[static_cast<size_t>(l)]->decode(tokens);
      sparse_steps_ += step.sparse ? 1 : 0;
      fused_steps_ += step.fused ? 1 : 0;
    }
    add_block(x, read_output(device_, o), w.wo, w.w1, w.w2);
  }
  return logits_of(x, weights_->unembed, static_cast<size_t>(config_.vocab));
}

// A chunk of the prompt: each token's projections as forward() makes them,
// [1, n, ...] (the cache rows token-major, the same order at batch 1), and
// one prefill() per layer.
void DsaToyModel::forward_chunk(const std::vector<int32_t>& tokens) {
  const auto& a = config_.attention;
  const size_t d = static_cast<size_t>(config_.d_model), h = static_cast<size_t>(a.num_qo_heads);
  const size_t n = tokens.size(), L = static_cast<size_t>(a.latent_dim), R = static_cast<size_t>(a.rope_dim);
  const size_t IH = static_cast<size_t>(a.index_heads), ID = static_cast<size_t>(a.index_head_dim);
  std::vector<std::vector<float>> xs;
  for (int32_t token : tokens) xs.push_back(embed_with_position(weights_->embed, token, d, position_++));
  for (int32_t l = 0; l < config_.layers; ++l) {
    const auto& w = weights_->layers[static_cast<size_t>(l)];
    std::vector<float> k_rows, k_pe, q, q_pe, q_index, weights;
    for (const auto& x : xs) {
      const std::vector<float> hn = rms_norm(x);
      for (auto [out, weight, width] :
           {std::make_tuple(&k_rows, &w.w_kv, L), std::make_tuple(&k_rows, &w.w_ik, ID),
            std::make_tuple(&k_pe, &w.w_kr, R), std::make_tuple(&q, &w.w_q, h * L),
            std::make_tuple(&q_pe, &w.w_qr, h * R), std::make_tuple(&q_index, &w.w_qi, IH * ID),
            std::make_tuple(&weights, &w.w_w, IH)}) {
        const std::vector<float> y = matvec(hn, *weight, width);
        out->insert(out->end(), y.begin(), y.end());
      }
    }
    const Buffer kd = to_device(device_, DType::kBF16, k_rows), ped = to_device(device_, DType::kBF16, k_pe);
    const Buffer qd = to_device(device_, DType::kBF16, q), qped = to_device(device_, DType::kBF16, q_pe);
    const Buffer qid = to_device(device_, DType::kBF16, q_index);
    const Buffer wd = upload(device_, weights);
    Buffer o = poisoned_output(device_, n * h * L);
    layers_[static_cast<size_t>(l)]->prefill(
        {qd.data(), qped.data(), qid.data(), wd.as<float>(), kd.data(), ped.data(), o.data()}, static_cast<int32_t>(n));
    add_blocks(xs, device_, o, w);
  }
}

std::vector<int32_t> DsaToyModel::generate(const std::vector<int32_t>& prompt, int32_t steps) {
  margins_.assign(1, {});
  std::vector<int32_t> rest = prompt;
  const auto chunk = static_cast<size_t>(std::max(config_.prefill_chunk, 0));
  while (chunk > 0 && rest.size() > chunk) {  // keeps the last prompt token for the first decode
    forward_chunk(std::vector<int32_t>(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(chunk)));
    rest.erase(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(chunk));
  }
  return greedy(
             {rest}, steps,
             [this](const std::vector<int32_t>& t, bool prefill) {
               return std::vector<std::vector<float>>{forward(t[0], prefill)};
             },
             &margins_)
      .front();
}
}  // namespace sparsepage::testing
