// The DSA indexer's CPU twin over every key source (sparsepage/index_keys.h):
// the rule of dsa_select_tokens_cuda with host pointers. Scores follow each
// source's documented dequantization in fp64 and are rounded to fp32 once;
// the top-k keeps (score, lower position) first with NaN last, and the
// kept positions are written in increasing order, padded with -1.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/index_keys_checks.h"
#include "core/index_keys_rule.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"

namespace sparsepage {
namespace {

constexpr int32_t kFp8Dim = IndexKeyFp8::kDim;

// Every e4m3 byte's value (exact in fp64).
const std::array<double, 256>& e4m3_table() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = e4m3_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

double relu_keep_nan(double x) { return std::isnan(x) ? x : std::max(x, 0.0); }

// One call's inputs, checked, with the readers of keys and queries.
class Twin {
 public:
  Twin(const DsaConfig& c, int32_t sequences, const DsaIndexerArgs& a, const char* who, bool writes) : c_(c), a_(a) {
    const std::string what = std::string(who) + ": ";
    if (sequences < 1) throw Error(what + "sequences = " + std::to_string(sequences) + " must be at least 1");
    if (a.q_len < 1 || a.q_len > kMaxQueryTokens)
      throw Error(what + "q_len = " + std::to_string(a.q_len) + " must lie in [1, " + std::to_string(kMaxQueryTokens) +
                  "]");
    if (c.index_topk < 1 || c.index_heads < 1 || c.index_head_dim < 1 || c.latent_dim < 0)
      throw Error(what + "index_topk, index_heads and index_head_dim must be at least 1 and latent_dim not negative");
    if (a.dtype != DType::kBF16 && a.dtype != DType::kF16)
      throw Error(what + "dtype must be f16 or bf16, got " + dtype_name(a.dtype));
    if (a.q_index == nullptr || a.weights == nullptr || a.kv_lens == nullptr)
      throw Error(what + "q_index, weights and kv_lens must be set");
    if (writes && (a.positions == nullptr || a.counts == nullptr))
      throw Error(what + "positions and counts must be set");
    if (a.max_kv_len < 1 || a.max_kv_len > std::numeric_limits<int32_t>::max())
      throw Error(what + "max_kv_len = " + std::to_string(a.max_kv_len) + " must lie in [1, 2^31)");
    const std::string source = detail::index_source_problem(c, a);
    if (!source.empty()) throw Error(what + source);
    if (a.key_layout == IndexKeyLayout::kDense) {
      if (a.k_cache == nullptr) throw Error(what + "k_cache must be set for dense keys");
      if (a.capacity < a.max_kv_len)
        throw Error(what + "need max_kv_len <= capacity (max_kv_len " + std::to_string(a.max_kv_len) + ", capacity " +
                    std::to_string(a.capacity) + ")");
    }
    fp8_ = a.key_layout == IndexKeyLayout::kPaged && a.paged.format == IndexKeyFormat::kE4m3;
    if (fp8_ && c.index_head_dim != kFp8Dim)
      throw Error(what + "FP8 keys hold 128 values, index_head_dim is " + std::to_string(c.index_head_dim));
    rows_ = sequences * a.q_len;
    if (a.key_layout == IndexKeyLayout::kPaged) {
      block_bytes_ = index_key_block_bytes(a.paged, c.index_head_dim);
      token_bytes_ = index_key_token_bytes(a.paged, c.index_head_dim);
    }
  }

  int32_t rows() const { return rows_; }

  // Row r's live positions, or -1 when its sequence's length is refused.
  int64_t row_len(int32_t r) const {
    const int32_t seq = r / a_.q_len, tok = r % a_.q_len;
    const int64_t len = a_.kv_lens[seq];
    if (len < 0 || len > a_.max_kv_len) return -1;
    if (a_.key_layout == IndexKeyLayout::kPaged && len > int64_t{a_.paged.max_blocks} * a_.paged.block_size) return -1;
    return std::max<int64_t>(0, len - (a_.q_len - 1 - tok));
  }

  // Whether every block holding positions [0, len) of row r's sequence is in the pool.
  bool blocks_ok(int32_t r, int64_t len) const {
    if (a_.key_layout != IndexKeyLayout::kPaged) return true;
    const int64_t blocks = (len + a_.paged.block_size - 1) / a_.paged.block_size;
    for (int64_t e = 0; e < blocks; ++e) {
      const int64_t id = table(r / a_.q_len, e);
      if (id < 0 || id >= a_.paged.num_blocks) return false;
    }
    return true;
  }

  // I(r, t) for t < len (row r's blocks checked first).
  std::vector<float> scores(int32_t r, int64_t len) const {
    const int32_t heads = c_.index_heads, dim = c_.index_head_dim;
    // The row's queries as exact doubles, and their weights (w' for FP8 keys).
    std::vector<double> q(static_cast<size_t>(heads) * static_cast<size_t>(dim)), w(static_cast<size_t>(heads));
    for (int32_t j = 0; j < heads; ++j) w[size_t(j)] = a_.weights[int64_t{r} * heads + j];
    if (fp8_ && a_.q_format == IndexQueryFormat::kE4m3) {
      const auto* bytes = static_cast<const uint8_t*>(a_.q_index) + int64_t{r} * heads * kFp8Dim;
      for (size_t i = 0; i < q.size(); ++i) q[i] = e4m3_table()[bytes[i]];
    } else if (fp8_) {
      std::vector<uint8_t> q8(q.size());
      std::vector<float> folded(static_cast<size_t>(heads));
      quantize_index_queries_cpu(a_.dtype, static_cast<const uint16_t*>(a_.q_index) + int64_t{r} * heads * kFp8Dim,
                                 a_.weights + int64_t{r} * heads, 1, heads, q8.data(), folded.data());
      for (size_t i = 0; i < q.size(); ++i) q[i] = e4m3_table()[q8[i]];
      for (int32_t j = 0; j < heads; ++j) w[size_t(j)] = folded[size_t(j)];
    } else {
      std::vector<float> f(q.size());
      to_float(a_.dtype, static_cast<const uint16_t*>(a_.q_index) + int64_t{r} * heads * dim, f.data(), f.size());
      for (size_t i = 0; i < q.size(); ++i) q[i] = f[i];
    }
    const int32_t seq = r / a_.q_len;
    std::vector<float> out(static_cast<size_t>(len));
    std::vector<double> k(static_cast<size_t>(dim));
    std::vector<float> kf(static_cast<size_t>(dim));
    for (int64_t t = 0; t < len; ++t) {
      double key_scale = 1.0;
      if (fp8_) {
        const unsigned char* block = pool() + table(seq, t / a_.paged.block_size) * block_bytes_;
        const auto slot = static_cast<int32_t>(t % a_.paged.block_size);
        const unsigned char* v = block + IndexKeyFp8::value_offset(a_.paged.block_size, slot);
        for (int32_t d = 0; d < dim; ++d) k[size_t(d)] = e4m3_table()[v[d]];
        float s;
        std::memcpy(&s, block + IndexKeyFp8::scale_offset(a_.paged.block_size, slot), 4);
        key_scale = s;
      } else {
        to_float(a_.dtype, native_key(seq, t), kf.data(), kf.size());
        for (int32_t d = 0; d < dim; ++d) k[size_t(d)] = kf[size_t(d)];
      }
      double total = 0.0;
      for (int32_t j = 0; j < heads; ++j) {
        const double* qj = &q[size_t(j) * size_t(dim)];
        double dot = 0.0;
        for (int32_t d = 0; d < dim; ++d) dot += qj[d] * k[size_t(d)];
        total += w[size_t(j)] * relu_keep_nan(dot);
      }
      out[size_t(t)] = static_cast<float>(total * key_scale);
    }
    return out;
  }

 private:
  int64_t table(int32_t seq, int64_t entry) const {
    return a_.paged.block_table[int64_t{seq} * a_.paged.block_table_stride + entry];
  }
  const unsigned char* pool() const { return static_cast<const unsigned char*>(a_.paged.pool); }
  const void* native_key(int32_t seq, int64_t t) const {
    if (a_.key_layout == IndexKeyLayout::kDense) {
      const int64_t row = int64_t{seq} * a_.capacity + t;
      return static_cast<const uint16_t*>(a_.k_cache) + row * (int64_t{c_.latent_dim} + c_.index_head_dim) +
             c_.latent_dim;
    }
    const int64_t block = table(seq, t / a_.paged.block_size);
    return pool() + block * block_bytes_ + (t % a_.paged.block_size) * token_bytes_;
  }

  const DsaConfig& c_;
  const DsaIndexerArgs& a_;
  bool fp8_ = false;
  int32_t rows_ = 0;
  int64_t block_bytes_ = 0, token_bytes_ = 0;
};

// The top min(topk, n) of `score` (NaN as -inf; ties to the lower position)
// in increasing position order.
std::vector<int32_t> top_positions(const std::vector<float>& score, int64_t topk) {
  const auto rank = [](float s) { return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s; };
  std::vector<int32_t> order(score.size());
  std::iota(order.begin(), order.end(), 0);
  const auto keep = static_cast<size_t>(std::min<int64_t>(topk, static_cast<int64_t>(score.size())));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                    [&](int32_t x, int32_t y) {
                      const float sx = rank(score[size_t(x)]), sy = rank(score[size_t(y)]);
                      return sx > sy || (sx == sy && x < y);
                    });
  order.resize(keep);
  std::sort(order.begin(), order.end());
  return order;
}

}  // namespace

void dsa_select_tokens_cpu(const DsaConfig& c, int32_t sequences, const DsaIndexerArgs& a) {
  const Twin twin(c, sequences, a, "dsa_select_tokens_cpu", true);
  const int64_t topk = c.index_topk;
  for (int32_t r = 0; r < twin.rows(); ++r) {
    int32_t* out = a.positions + int64_t{r} * topk;
    std::fill(out, out + topk, -1);
    a.counts[r] = -1;  // refused rows keep it (see the CUDA compact kernel)
    const int64_t len = twin.row_len(r);
    if (len < 0) {
      if (a.error != nullptr) *a.error |= kIndexErrorLength;
      continue;
    }
    if (len <= topk) {  // the window fits: every position, no key read
      std::iota(out, out + len, 0);
      a.counts[r] = static_cast<int32_t>(len);
      continue;
    }
    if (!twin.blocks_ok(r, len)) {
      if (a.error != nullptr) *a.error |= kIndexErrorBlock;
      continue;
    }
    const std::vector<int32_t> kept = top_positions(twin.scores(r, len), topk);
    std::copy(kept.begin(), kept.end(), out);
    a.counts[r] = static_cast<int32_t>(kept.size());
  }
}

std::vector<std::vector<float>> dsa_index_scores_cpu(const DsaConfig& c, int32_t sequences, const DsaIndexerArgs& a) {
  const Twin twin(c, sequences, a, "dsa_index_scores_cpu", false);
  std::vector<std::vector<float>> out(static_cast<size_t>(twin.rows()));
  for (int32_t r = 0; r < twin.rows(); ++r) {
    const int64_t len = twin.row_len(r);
    if (len >= 0 && twin.blocks_ok(r, len)) out[size_t(r)] = twin.scores(r, len);
  }
  return out;
}

}  // namespace sparsepage
