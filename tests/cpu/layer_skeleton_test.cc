// A fourth model in one file of hooks: a sliding-window layer (each query
// attends the last `window` positions of its sequence) built on the layer
// skeleton, with nothing but its selection, its mask and its shapes. The
// skeleton gives it the fused path, the mask-path fallback, continuous
// batching and the inspection readers, and the test checks them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "sparsepage/layer.h"
#include "support/layer_checks.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

struct WindowTokens {
  const void* q = nullptr;  // [batch, num_qo_heads, head_dim]
  const void* k = nullptr;  // [batch, num_kv_heads, 1, head_dim]
  const void* v = nullptr;  // [batch, num_kv_heads, 1, head_dim]
  void* o = nullptr;        // [batch, num_qo_heads, head_dim]
};

// ---- the model: hooks only ----
class WindowAttention : public LayerForms<WindowTokens> {
 public:
  static constexpr int32_t kQoHeads = 4, kKvHeads = 2, kDim = 16;
  WindowAttention(int32_t batch, int32_t window, DispatchConfig dispatch)
      : LayerForms("WindowAttention", Device::kCpu, DType::kBF16, batch, KVStorage::kLayerCache,
                   {kKvHeads, kKvHeads, kDim, kDim}, 64, dispatch),
        window_(window) {}

 private:
  StepTokens to_step(const WindowTokens& t) const override {
    return {t.q, nullptr, nullptr, nullptr, t.k, t.v, nullptr, t.o};
  }
  int32_t requests() const { return batch() * kKvHeads; }
  TokenNames token_names() const override { return {"WindowTokens"}; }
  TokenBytes token_bytes() const override {
    TokenBytes b;
    b.q = b.o = size_t{kQoHeads} * kDim * 2;
    b.k = b.v = size_t{kKvHeads} * kDim * 2;
    return b;
  }
  SparseAttentionInputs attention_inputs(const StepTokens& t, int32_t q_len) const override {
    SparseAttentionInputs in;
    in.device = device();
    in.dtype = dtype();
    in.batch = batch();
    in.num_qo_heads = kQoHeads;
    in.num_kv_heads = kKvHeads;
    in.live_len = kv_len();
    in.live_lens = device_lens();
    in.k = cache().k_rows().value();
    in.v = cache().v_rows().value();
    in.q = t.q;
    in.o = t.o;
    in.scale = 1.0f / std::sqrt(float(kDim));
    in.q_len = q_len;
    return in;
  }
  void size_selection(int64_t, int32_t) override {
    if (pages_.empty()) {
      pages_ = Buffer(device(), size_t(requests()) * window_ * 4);
      counts_ = Buffer(device(), size_t(requests()) * 4);
    }
  }
  PagedSelection selection(int32_t q_len) const override {
    PagedSelection s{pages_.as<int32_t>(), counts_.as<int32_t>(), requests(), window_, 1, 0};
    for (int64_t len : lens_after(q_len))
      s.max_selected = std::max<int64_t>(s.max_selected, std::min<int64_t>(len, window_));
    return s;
  }
  void select(const StepTokens&, int32_t, void*) override {
    for (int32_t r = 0; r < requests(); ++r) {
      const int64_t len = device_lens()[r / kKvHeads], first = std::max<int64_t>(0, len - window_);
      for (int32_t i = 0; i < window_; ++i)
        pages_.as<int32_t>()[r * window_ + i] = first + i < len ? int32_t(first + i) : -1;
      counts_.as<int32_t>()[r] = int32_t(len - first);
    }
  }
  bool sparse_at(int64_t len) const override { return len > window_; }
  void build_mask(float* mask, int64_t pitch, void*) override {
    for (int32_t r = 0; r < requests(); ++r) {
      const int64_t len = device_lens()[r / kKvHeads];
      for (int64_t t = 0; t < pitch; ++t) mask[r * pitch + t] = t < len && t >= len - window_ ? 0.0f : -INFINITY;
    }
  }
  std::vector<std::vector<int32_t>> selected_positions() const override {
    std::vector<std::vector<int32_t>> out(static_cast<size_t>(requests()));
    for (int32_t r = 0; r < requests(); ++r) {
      out[size_t(r)].assign(pages_.as<int32_t>() + r * window_,
                            pages_.as<int32_t>() + r * window_ + counts_.as<int32_t>()[r]);
    }
    return out;
  }
  void check_engine_kv(const EnginePagedKV&) const override { throw Error("WindowAttention: no engine-paged form"); }

  int32_t window_;
  Buffer pages_, counts_;
};

// fp64 attention of request (b, h) over positions [first, len) of the cache.
std::vector<double> window_reference(const WindowAttention& layer, const std::vector<uint8_t>& q, int32_t b,
                                     int32_t head, int64_t first, int64_t len) {
  const RowView k = layer.cache().k_rows().value(), v = layer.cache().v_rows().value();
  const auto* kd = static_cast<const uint16_t*>(k.data);
  const auto* vd = static_cast<const uint16_t*>(v.data);
  const auto qf = testing::as_float(DType::kBF16, q);
  const int32_t d = WindowAttention::kDim, kv = head / (WindowAttention::kQoHeads / WindowAttention::kKvHeads);
  std::vector<double> s;
  double m = -INFINITY;
  for (int64_t t = first; t < len; ++t) {
    double dot = 0;
    for (int32_t i = 0; i < d; ++i)
      dot += double(qf[size_t((b * WindowAttention::kQoHeads + head) * d + i)]) *
             bf16_to_float(kd[k.offset(b, kv, t) + i]);
    s.push_back(dot / std::sqrt(double(d)));
    m = std::max(m, s.back());
  }
  std::vector<double> out(size_t(d), 0.0);
  double sum = 0;
  for (size_t j = 0; j < s.size(); ++j) {
    const double p = std::exp(s[j] - m);
    sum += p;
    for (int32_t i = 0; i < d; ++i) out[size_t(i)] += p * bf16_to_float(vd[v.offset(b, kv, first + int64_t(j)) + i]);
  }
  for (double& x : out) x /= sum;
  return out;
}

TEST(LayerSkeleton, AFourthModelIsOneFileOfHooks) {
  const int32_t batch = 3, window = 24;
  WindowAttention fused(batch, window, testing::always_fuse()), masked(batch, window, testing::kill_switch());
  std::mt19937_64 rng(5);
  // Ragged from the start: each slot admitted with its own prompt.
  for (WindowAttention* l : {&fused, &masked}) l->reserve(128);
  for (int32_t b = 0; b < batch; ++b) {
    std::mt19937_64 prompt_rng(100 + b);
    const int64_t n = 10 + 17 * b;
    const auto k = testing::random_values(DType::kBF16, size_t(2 * n * 16), prompt_rng);
    const auto v = testing::random_values(DType::kBF16, size_t(2 * n * 16), prompt_rng);
    fused.admit(b, k.data(), v.data(), n);
    masked.admit(b, k.data(), v.data(), n);
  }
  int fused_steps = 0;
  for (int step = 0; step < 40; ++step) {
    if (step == 20) {  // slot 1 leaves; later steps skip it
      fused.release(1);
      masked.release(1);
    }
    const auto q = testing::random_values(DType::kBF16, size_t(batch * 4 * 16), rng);
    const auto k = testing::random_values(DType::kBF16, size_t(batch * 2 * 16), rng);
    const auto v = testing::random_values(DType::kBF16, size_t(batch * 2 * 16), rng);
    std::vector<uint8_t> o1(q.size(), 0xFF), o2(q.size(), 0xFF);
    const LayerStep a = fused.decode({q.data(), k.data(), v.data(), o1.data()});
    const LayerStep b2 = masked.decode({q.data(), k.data(), v.data(), o2.data()});
    EXPECT_FALSE(b2.fused) << "the kill switch pins the mask path";
    fused_steps += a.fused ? 1 : 0;
    EXPECT_EQ(fused.last_selected_positions(), fused.last_mask_columns()) << "step " << step;
    const auto f1 = testing::as_float(DType::kBF16, o1), f2 = testing::as_float(DType::kBF16, o2);
    for (int32_t s = 0; s < batch; ++s) {
      const int64_t len = fused.kv_lens()[size_t(s)];
      for (int32_t h = 0; h < 4; ++h) {
        const std::vector<float> got1(f1.begin() + (s * 4 + h) * 16, f1.begin() + (s * 4 + h + 1) * 16);
        const std::vector<float> got2(f2.begin() + (s * 4 + h) * 16, f2.begin() + (s * 4 + h + 1) * 16);
        if (len == 0) {  // the released slot: zeros, NaN inputs or not
          for (float x : got1) ASSERT_EQ(x, 0.0f);
          continue;
        }
        const auto ref = window_reference(fused, q, s, h, std::max<int64_t>(0, len - window), len);
        EXPECT_LT(testing::relative_l2(got1, ref), 1e-2) << "fused, step " << step << " slot " << s;
        EXPECT_LT(testing::relative_l2(got2, ref), 1e-2) << "mask path, step " << step << " slot " << s;
      }
    }
  }
  EXPECT_GE(fused_steps, 30) << "most steps must run the fused path";
  EXPECT_EQ(fused.kv_lens(), (std::vector<int64_t>{50, 0, 84}));
}

}  // namespace
}  // namespace sparsepage
