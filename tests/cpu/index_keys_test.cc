// Index-key sources on the CPU (sparsepage/index_keys.h): the FP8 format's
// byte layout and quantization against vLLM's rule written out here on its
// own, the query quantizer, and the indexer's CPU twin over dense rows and
// paged native and FP8 pools: its scores against fp64 references, its top-k
// against a brute-force ranking (ties, NaN, ragged lengths, multi-token
// rows), poisoned blocks no sequence owns, and refusals (bad lengths and
// block ids flagged, bad descriptions named).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"
#include "support/expect_error.h"
#include "support/index_keys_problem.h"

namespace sparsepage {
namespace {

using testing::IndexKeysProblem;
using testing::IndexKeysSpec;
using testing::IndexSelection;
using testing::make_index_keys_problem;
using testing::throws_error_naming;

// ---- the write op -----------------------------------------------------------

// vLLM's key scale, written as vLLM writes it (float arithmetic, log2f / exp2f).
float vllm_key_scale(float amax, IndexScaleFormat format) {
  float scale = std::fmax(amax, 1e-4f) / 448.0f;
  if (format == IndexScaleFormat::kUe8m0) scale = std::exp2(std::ceil(std::log2(scale)));
  return scale;
}

// The pool the write op must leave: `pool` with key i's bytes at slot
// slots[i], laid out by the format's description in the header, not by the
// library's offsets.
std::vector<uint8_t> expected_fp8_pool(std::vector<uint8_t> pool, int32_t block_size, int64_t block_bytes,
                                       const std::vector<float>& keys, const std::vector<int64_t>& slots,
                                       IndexScaleFormat format) {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0) continue;
    const float* k = &keys[i * 128];
    float amax = 0;
    for (int d = 0; d < 128; ++d) amax = std::fmax(amax, std::fabs(k[d]));
    const float scale = vllm_key_scale(amax, format);
    uint8_t* block = pool.data() + (slots[i] / block_size) * block_bytes;
    const int64_t s = slots[i] % block_size;
    for (int d = 0; d < 128; ++d) block[s * 128 + d] = float_to_e4m3(k[d] / scale);
    std::memcpy(block + int64_t{block_size} * 128 + 4 * s, &scale, 4);
  }
  return pool;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& x) {
  std::vector<uint8_t> out(x.size() * 2);
  from_float(DType::kBF16, x.data(), out.data(), x.size());
  return out;
}

PagedIndexKeys fp8_pool(uint8_t* data, int64_t num_blocks, int32_t block_size, int64_t block_stride_bytes = 0) {
  PagedIndexKeys p;
  p.format = IndexKeyFormat::kE4m3;
  p.pool = data;
  p.num_blocks = num_blocks;
  p.block_size = block_size;
  p.block_stride_bytes = block_stride_bytes;
  return p;
}

TEST(IndexKeysWrite, Fp8BlocksHoldValuesThenScalesInSlotOrder) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> unit(-2.0f, 2.0f);
  for (const int32_t block_size : {8, 16, 64, 128}) {
    for (const int64_t pad : {int64_t{0}, int64_t{48}}) {
      for (const IndexScaleFormat format : {IndexScaleFormat::kUe8m0, IndexScaleFormat::kFp32}) {
        const int64_t num_blocks = 5;
        const int64_t block_bytes = int64_t{block_size} * 132 + pad;
        std::vector<uint8_t> pool(static_cast<size_t>(num_blocks * block_bytes), 0xFF);
        // 40 keys at distinct random slots, one in three skipped (-1).
        std::vector<int64_t> all(static_cast<size_t>(num_blocks * block_size));
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<int64_t> slots;
        std::vector<float> keys;
        for (int i = 0; i < 40; ++i) {
          slots.push_back(i % 3 == 1 ? -1 : all[size_t(i)]);
          for (int d = 0; d < 128; ++d) keys.push_back(bf16_to_float(float_to_bf16(unit(rng) * float(i % 5))));
        }
        const std::vector<uint8_t> want = expected_fp8_pool(pool, block_size, block_bytes, keys, slots, format);
        const std::vector<uint8_t> src = bf16_bytes(keys);
        write_index_keys_cpu(fp8_pool(pool.data(), num_blocks, block_size, pad ? block_bytes : 0), 128, DType::kBF16,
                             src.data(), 128, slots.data(), int64_t(slots.size()), format);
        EXPECT_EQ(pool, want) << "block_size " << block_size << " pad " << pad;
      }
    }
  }
}

TEST(IndexKeysWrite, OneKeyByteByByte) {
  // Key [4, -4, 1, 0, ...]: amax 4, ue8m0 scale 2^ceil(log2(4 / 448)) = 2^-6,
  // values 256, -256, 64, 0 as e4m3.
  std::vector<float> key(128, 0.0f);
  key[0] = 4, key[1] = -4, key[2] = 1;
  const std::vector<uint8_t> src = bf16_bytes(key);
  std::vector<uint8_t> pool(static_cast<size_t>(2 * 16 * 132), 0xFF);
  const int64_t slot = 16 + 5;  // block 1, slot 5
  write_index_keys_cpu(fp8_pool(pool.data(), 2, 16), 128, DType::kBF16, src.data(), 128, &slot, 1);
  const uint8_t* block = pool.data() + 16 * 132;
  EXPECT_EQ(block[5 * 128 + 0], 0x78);  // 256 = 2^8: exponent 15, mantissa 0
  EXPECT_EQ(block[5 * 128 + 1], 0xF8);
  EXPECT_EQ(block[5 * 128 + 2], 0x68);  // 64 = 2^6
  EXPECT_EQ(block[5 * 128 + 3], 0x00);
  uint32_t scale_bits;
  std::memcpy(&scale_bits, block + 16 * 128 + 5 * 4, 4);
  EXPECT_EQ(scale_bits, 0x3C800000u);  // 2^-6
  // Nothing else of the pool changed.
  std::vector<uint8_t> want(pool.size(), 0xFF);
  std::fill_n(want.begin() + 16 * 132 + 5 * 128, 128, 0x00);
  want[16 * 132 + 5 * 128 + 0] = 0x78;
  want[16 * 132 + 5 * 128 + 1] = 0xF8;
  want[16 * 132 + 5 * 128 + 2] = 0x68;
  std::memcpy(want.data() + 16 * 132 + 16 * 128 + 5 * 4, &scale_bits, 4);
  EXPECT_EQ(pool, want);
}

TEST(IndexKeysWrite, Ue8m0ScaleIsVllmsExpressionForEveryHalfMagnitude) {
  // Every positive finite bf16 and f16 value as a key's largest magnitude.
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> magnitudes;
    for (uint32_t bits = 1; bits < 0x8000u; ++bits) {
      const float x = dtype == DType::kBF16 ? bf16_to_float(uint16_t(bits)) : f16_to_float(uint16_t(bits));
      if (std::isfinite(x)) magnitudes.push_back(uint16_t(bits));
    }
    const auto n = int64_t(magnitudes.size());
    std::vector<uint16_t> keys(static_cast<size_t>(n) * 128, 0);
    std::vector<int64_t> slots(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      keys[size_t(i) * 128 + size_t(i % 128)] = magnitudes[size_t(i)];
      slots[size_t(i)] = i;
    }
    const int64_t blocks = (n + 63) / 64;
    std::vector<uint8_t> pool(static_cast<size_t>(blocks * 64 * 132), 0xFF);
    write_index_keys_cpu(fp8_pool(pool.data(), blocks, 64), 128, dtype, keys.data(), 128, slots.data(), n);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t m = magnitudes[size_t(i)];
      const float amax = dtype == DType::kBF16 ? bf16_to_float(m) : f16_to_float(m);
      float got;
      std::memcpy(&got, pool.data() + (i / 64) * 64 * 132 + 64 * 128 + (i % 64) * 4, 4);
      const float want = vllm_key_scale(amax, IndexScaleFormat::kUe8m0);
      if (got != want && ++mismatches < 5)
        ADD_FAILURE() << dtype_name(dtype) << " amax " << amax << ": scale " << got << " vs " << want;
    }
    EXPECT_EQ(mismatches, 0) << dtype_name(dtype);
  }
}

TEST(IndexKeysWrite, NanValuesStayNanAndInfinitySaturatesTheScale) {
  std::vector<float> keys(2 * 128, 1.0f);
  keys[7] = NAN;                                           // key 0: scale from the other values (amax 1)
  keys[128 + 3] = std::numeric_limits<float>::infinity();  // key 1: scale inf
  const std::vector<uint8_t> src = bf16_bytes(keys);
  std::vector<uint8_t> pool(static_cast<size_t>(8 * 132), 0xAA);
  const std::vector<int64_t> slots = {0, 1};
  write_index_keys_cpu(fp8_pool(pool.data(), 1, 8), 128, DType::kBF16, src.data(), 128, slots.data(), 2);
  float s0, s1;
  std::memcpy(&s0, pool.data() + 8 * 128, 4);
  std::memcpy(&s1, pool.data() + 8 * 128 + 4, 4);
  EXPECT_EQ(s0, std::ldexp(1.0f, -8));  // 2^ceil(log2(1 / 448))
  EXPECT_EQ(pool[7], 0x7F);             // NaN
  EXPECT_EQ(pool[0], 0x78);             // 1 / 2^-8 = 256
  EXPECT_TRUE(std::isinf(s1));
  EXPECT_EQ(pool[128 + 3], 0x7F);  // inf / inf
  EXPECT_EQ(pool[128 + 0], 0x00);  // 1 / inf
}

TEST(IndexKeysWrite, NativePoolsGetTheKeyBytes) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> keys(3 * 64);
  for (float& x : keys) x = unit(rng);
  std::vector<uint8_t> src(keys.size() * 2);
  from_float(DType::kF16, keys.data(), src.data(), keys.size());
  PagedIndexKeys p;
  p.format = IndexKeyFormat::kNative;
  p.dtype = DType::kF16;
  p.num_blocks = 3;
  p.block_size = 16;
  p.token_stride_bytes = 144;  // 128 bytes of key + 16 of padding
  p.block_stride_bytes = 16 * 144 + 32;
  std::vector<uint8_t> pool(static_cast<size_t>(3 * p.block_stride_bytes), 0xFF);
  p.pool = pool.data();
  const std::vector<int64_t> slots = {17, -1, 47};
  write_index_keys_cpu(p, 64, DType::kF16, src.data(), 64, slots.data(), 3);
  std::vector<uint8_t> want(static_cast<size_t>(3 * p.block_stride_bytes), 0xFF);
  std::memcpy(want.data() + 1 * p.block_stride_bytes + 1 * 144, src.data(), 128);
  std::memcpy(want.data() + 2 * p.block_stride_bytes + 15 * 144, src.data() + 2 * 128, 128);
  EXPECT_EQ(pool, want);
}

TEST(IndexKeysWrite, BadInputIsNamedAndWritesNothing) {
  std::vector<uint8_t> pool(static_cast<size_t>(2 * 64 * 132 + 16), 0xFF);
  const std::vector<uint8_t> before = pool;
  const std::vector<uint8_t> src(static_cast<size_t>(4 * 128 * 2), 0);
  std::vector<int64_t> slots = {0, 5, -1, 128};
  const auto write = [&](PagedIndexKeys p, int32_t dim = 128, DType dtype = DType::kBF16) {
    write_index_keys_cpu(p, dim, dtype, src.data(), 128, slots.data(), int64_t(slots.size()));
  };
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data(), 2, 64)); }, "slots[3] = 128 is past the pool"));
  EXPECT_EQ(pool, before) << "a refused call wrote";
  slots = {-2};
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data(), 2, 64)); }, "slots[0] = -2"));
  slots = {0};
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data() + 8, 2, 64)); }, "16-byte aligned"));
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data(), 2, 12)); }, "block_size = 12"));
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data(), 2, 96)); }, "block_size = 96"));
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data(), 2, 64, 64 * 132 - 16)); }, "block_stride_bytes"));
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data(), 2, 64), 64); }, "128 values per key"));
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(pool.data(), 0, 64)); }, "num_blocks = 0"));
  EXPECT_TRUE(throws_error_naming([&] { write(fp8_pool(nullptr, 2, 64)); }, "pool is null"));
  PagedIndexKeys native = fp8_pool(pool.data(), 2, 64);
  native.format = IndexKeyFormat::kNative;
  native.dtype = DType::kF16;
  EXPECT_TRUE(throws_error_naming([&] { write(native); }, "native pool holds f16"));
  EXPECT_EQ(pool, before);
}

// ---- the query quantizer ------------------------------------------------------

TEST(IndexQueries, PowerOfTwoScalesFoldIntoTheWeights) {
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> unit(-3.0f, 3.0f);
  const int64_t rows = 3;
  const int32_t heads = 5;
  std::vector<float> q(static_cast<size_t>(rows) * heads * 128);
  for (float& x : q) x = bf16_to_float(float_to_bf16(unit(rng)));
  std::fill_n(q.begin() + 128, 128, 0.0f);  // head 1 of row 0: all zero
  std::vector<float> w(static_cast<size_t>(rows) * heads);
  for (float& x : w) x = unit(rng);
  const std::vector<uint8_t> src = bf16_bytes(q);
  std::vector<uint8_t> q8(q.size());
  std::vector<float> w_out(w.size());
  quantize_index_queries_cpu(DType::kBF16, src.data(), w.data(), rows, heads, q8.data(), w_out.data());
  for (int64_t r = 0; r < rows * heads; ++r) {
    float amax = 0;
    for (int d = 0; d < 128; ++d) amax = std::fmax(amax, std::fabs(q[size_t(r) * 128 + d]));
    const float s = std::exp2(std::ceil(std::log2(std::fmax(amax, 1e-10f) / 448.0f)));  // vLLM's expression
    EXPECT_EQ(w_out[size_t(r)], w[size_t(r)] * s) << "head row " << r;
    for (int d = 0; d < 128; ++d)
      ASSERT_EQ(q8[size_t(r) * 128 + d], float_to_e4m3(q[size_t(r) * 128 + d] / s)) << r << " " << d;
  }
  EXPECT_EQ(w_out[1], w[1] * std::ldexp(1.0f, -42));  // the zero head: 2^ceil(log2(1e-10 / 448))
  // In place (weights_out aliasing weights) gives the same.
  std::vector<float> inplace = w;
  quantize_index_queries_cpu(DType::kBF16, src.data(), inplace.data(), rows, heads, q8.data(), inplace.data());
  EXPECT_EQ(inplace, w_out);
  EXPECT_TRUE(throws_error_naming(
      [&] { quantize_index_queries_cpu(DType::kF32, src.data(), w.data(), rows, heads, q8.data(), w_out.data()); },
      "queries must be f16 or bf16"));
}

// ---- the CPU twin: scores ------------------------------------------------------

IndexKeysSpec spec_of(IndexKeyLayout layout, IndexKeyFormat format, std::vector<int32_t> lens, bool exact = true) {
  IndexKeysSpec s;
  s.heads = 8;
  s.topk = 48;
  s.layout = layout;
  s.format = format;
  s.block_size = 16;
  s.kv_lens = std::move(lens);
  s.exact = exact;
  return s;
}

TEST(IndexKeysTwin, Fp8ScoresAreTheDequantizedPoolsInFp64) {
  // Real-valued keys and queries: the reference reads the pool's bytes
  // through the table itself and dequantizes them as the header documents.
  for (const int32_t block_size : {8, 64, 128}) {
    IndexKeysSpec s = spec_of(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {300, 0, 77, 129}, false);
    s.block_size = block_size;
    s.block_pad_bytes = 32;
    const IndexKeysProblem pb = make_index_keys_problem(s);
    const auto scores = testing::index_twin_scores(pb);
    std::vector<uint8_t> q8(pb.q.size() / 2);
    std::vector<float> w(pb.weights.size());
    quantize_index_queries_cpu(pb.spec.dtype, pb.q.data(), pb.weights.data(), pb.rows(), s.heads, q8.data(), w.data());
    const int64_t block_bytes = int64_t{block_size} * 132 + 32;
    for (int32_t r = 0; r < pb.rows(); ++r) {
      ASSERT_EQ(int64_t(scores[size_t(r)].size()), pb.window(r)) << r;
      for (int64_t t = 0; t < pb.window(r); ++t) {
        const int64_t block = pb.table[size_t(r) * size_t(pb.max_blocks) + size_t(t / block_size)];
        const uint8_t* b = pb.storage.data() + block * block_bytes;
        float scale;
        std::memcpy(&scale, b + int64_t{block_size} * 128 + 4 * (t % block_size), 4);
        double want = 0;
        for (int32_t j = 0; j < s.heads; ++j) {
          double dot = 0;
          for (int d = 0; d < 128; ++d)
            dot += double(e4m3_to_float(q8[(size_t(r) * s.heads + j) * 128 + d])) *
                   (double(e4m3_to_float(b[(t % block_size) * 128 + d])) * scale);
          want += double(w[size_t(r) * s.heads + j]) * std::max(dot, 0.0);
        }
        ASSERT_NEAR(scores[size_t(r)][size_t(t)], want, 1e-6 * (1.0 + std::fabs(want))) << "row " << r << " t " << t;
      }
    }
  }
}

TEST(IndexKeysTwin, ExactProblemsScoreAsTheRuleOnEverySource) {
  // Keys and queries in [-4, 4]: FP8 quantization is exact, so each source
  // gives the fp64 rule's scores exactly (NaN where the NaN key sits).
  for (const auto& [layout, format] :
       std::vector<std::pair<IndexKeyLayout, IndexKeyFormat>>{{IndexKeyLayout::kDense, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3}}) {
    for (const IndexQueryFormat qf : {IndexQueryFormat::kNative, IndexQueryFormat::kE4m3}) {
      if (qf == IndexQueryFormat::kE4m3 && format != IndexKeyFormat::kE4m3) continue;
      IndexKeysSpec s = spec_of(layout, format, {200, 63, 1});
      s.q_format = qf;
      s.q_len = 2;
      const IndexKeysProblem pb = make_index_keys_problem(s);
      const auto scores = testing::index_twin_scores(pb);
      for (int32_t r = 0; r < pb.rows(); ++r) {
        const std::vector<double> want = testing::exact_scores(pb, r);
        ASSERT_EQ(scores[size_t(r)].size(), want.size());
        for (size_t t = 0; t < want.size(); ++t) {
          if (std::isnan(want[t])) {
            EXPECT_TRUE(std::isnan(scores[size_t(r)][t])) << "row " << r << " t " << t;
          } else {
            ASSERT_EQ(double(scores[size_t(r)][t]), want[t]) << "layout " << int(layout) << " format " << int(format)
                                                             << " q " << int(qf) << " row " << r << " t " << t;
          }
        }
      }
    }
  }
}

// ---- the CPU twin: the top-k -----------------------------------------------------

// The rule by brute force: the top min(topk, len) by (score, lower position), NaN last.
std::vector<int32_t> brute_force(const std::vector<double>& s, int32_t topk) {
  std::vector<int32_t> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  const auto key = [&](int32_t i) { return std::isnan(s[size_t(i)]) ? -INFINITY : s[size_t(i)]; };
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return key(x) > key(y); });
  order.resize(std::min<size_t>(order.size(), size_t(topk)));
  std::sort(order.begin(), order.end());
  return order;
}

void expect_brute_force(const IndexKeysProblem& pb, const IndexSelection& got, const char* what) {
  EXPECT_EQ(got.error, 0) << what;
  for (int32_t r = 0; r < pb.rows(); ++r) {
    const std::vector<int32_t> want = brute_force(testing::exact_scores(pb, r), pb.spec.topk);
    ASSERT_EQ(got.counts[size_t(r)], int32_t(want.size())) << what << " row " << r;
    const int32_t* g = &got.positions[size_t(r) * size_t(pb.spec.topk)];
    EXPECT_EQ(std::vector<int32_t>(g, g + want.size()), want) << what << " row " << r;
    for (int32_t i = int32_t(want.size()); i < pb.spec.topk; ++i) ASSERT_EQ(g[i], -1) << what << " row " << r;
  }
}

TEST(IndexKeysTwin, KeepsTheTopKWithTiesToTheLowerPositionAndNanLast) {
  // Ragged lengths: empty, one, exactly the top-k, one over, and longer,
  // with multi-token rows whose windows differ.
  const std::vector<int32_t> lens = {0, 1, 48, 49, 50, 1000, 333};
  for (const int32_t q_len : {1, 3}) {
    for (const auto& [layout, format] :
         std::vector<std::pair<IndexKeyLayout, IndexKeyFormat>>{{IndexKeyLayout::kDense, IndexKeyFormat::kNative},
                                                                {IndexKeyLayout::kPaged, IndexKeyFormat::kNative},
                                                                {IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3}}) {
      IndexKeysSpec s = spec_of(layout, format, lens);
      s.q_len = q_len;
      s.seed = uint64_t(q_len) * 10 + uint64_t(format);
      const IndexKeysProblem pb = make_index_keys_problem(s);
      expect_brute_force(pb, testing::run_index_twin(pb), "twin");
    }
  }
}

// A continuous batch's steps, one call each (support/index_keys_problem.h):
// released slots, windows that fit the top-k and scored windows side by
// side, across key tiles and classify slices, at the DSA layer's GPU index
// geometry (8 heads x 64, top-k 48, a bound of 448 = its capacity) and past
// a slice; on every source, with multi-token rows.
TEST(IndexKeysTwin, MixedLengthsInOneCallSelectAsTheRule) {
  for (const int32_t bound : {448, 4200}) {
    const testing::MixedLengthSteps m = testing::mixed_length_steps(48, bound);
    for (const int32_t q_len : {1, 3}) {
      if (bound > 448 && q_len > 1) continue;  // the slices once: the brute force is slow
      for (const auto& [layout, format] :
           std::vector<std::pair<IndexKeyLayout, IndexKeyFormat>>{{IndexKeyLayout::kDense, IndexKeyFormat::kNative},
                                                                  {IndexKeyLayout::kPaged, IndexKeyFormat::kNative},
                                                                  {IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3}}) {
        IndexKeysSpec s = spec_of(layout, format, m.built);
        s.dim = format == IndexKeyFormat::kE4m3 ? 128 : 64;
        s.block_size = bound > 448 ? 64 : 16;
        s.max_kv_len = bound;
        s.q_len = q_len;
        s.seed = uint64_t(bound) + uint64_t(q_len);
        IndexKeysProblem pb = make_index_keys_problem(s);
        for (size_t i = 0; i < m.steps.size(); ++i) {
          pb.spec.kv_lens = m.steps[i];
          const std::string what = "bound " + std::to_string(bound) + " q_len " + std::to_string(q_len) + " layout " +
                                   std::to_string(int(layout)) + " format " + std::to_string(int(format)) + " step " +
                                   std::to_string(i);
          expect_brute_force(pb, testing::run_index_twin(pb), what.c_str());
        }
      }
    }
  }
}

TEST(IndexKeysTwin, TheSameKeysSelectTheSameOnEverySource) {
  std::vector<IndexSelection> got;
  for (const auto& [layout, format] :
       std::vector<std::pair<IndexKeyLayout, IndexKeyFormat>>{{IndexKeyLayout::kDense, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3}}) {
    IndexKeysSpec s = spec_of(layout, format, {500, 90, 17});
    s.seed = 77;  // the same keys and queries for every source
    got.push_back(testing::run_index_twin(make_index_keys_problem(s)));
  }
  EXPECT_EQ(got[0].positions, got[1].positions);
  EXPECT_EQ(got[0].positions, got[2].positions);
  EXPECT_EQ(got[0].counts, got[2].counts);
}

TEST(IndexKeysTwin, BlocksNoSequenceOwnsAndSlotsPastTheLengthChangeNothing) {
  for (const IndexKeyFormat format : {IndexKeyFormat::kNative, IndexKeyFormat::kE4m3}) {
    IndexKeysSpec s = spec_of(IndexKeyLayout::kPaged, format, {400, 130, 70});
    s.spare_blocks = 6;
    IndexKeysProblem pb = make_index_keys_problem(s);
    const IndexSelection clean = testing::run_index_twin(pb);
    ASSERT_GT(testing::write_huge_unused_keys(pb), int64_t{6} * s.block_size);
    const IndexSelection poisoned = testing::run_index_twin(pb);
    EXPECT_EQ(poisoned.positions, clean.positions) << int(format);
    EXPECT_EQ(poisoned.counts, clean.counts);
  }
}

TEST(IndexKeysTwin, LengthsPastTheBoundAreFlaggedNotRead) {
  for (const auto& [layout, format] : std::vector<std::pair<IndexKeyLayout, IndexKeyFormat>>{
           {IndexKeyLayout::kDense, IndexKeyFormat::kNative}, {IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3}}) {
    IndexKeysSpec s = spec_of(layout, format, {300, 100, 300});
    s.spare_blocks = 0;
    s.extra_table_entries = 0;
    IndexKeysProblem pb = make_index_keys_problem(s);
    const IndexSelection clean = testing::run_index_twin(pb);
    // Sequence 1 claims more than the bound (and more than its blocks), sequence 2 a negative length.
    pb.spec.kv_lens = {300, 301, -5};
    const IndexSelection got = testing::run_index_twin(pb);
    EXPECT_EQ(got.error, kIndexErrorLength);
    for (int32_t r : {1, 2}) {
      EXPECT_EQ(got.counts[size_t(r)], -1) << r << ": a refused row's count is -1, which the decode flags";
      for (int32_t i = 0; i < s.topk; ++i) ASSERT_EQ(got.positions[size_t(r) * size_t(s.topk) + size_t(i)], -1);
    }
    EXPECT_EQ(got.counts[0], clean.counts[0]);
    EXPECT_TRUE(std::equal(got.positions.begin(), got.positions.begin() + s.topk, clean.positions.begin()));
  }
}

TEST(IndexKeysTwin, BlockIdsOutsideThePoolAreFlaggedWhereRead) {
  IndexKeysSpec s = spec_of(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {300, 40, 300});
  IndexKeysProblem pb = make_index_keys_problem(s);
  const IndexSelection clean = testing::run_index_twin(pb);
  // A scored row's needed block id past the pool, and a short row's (its
  // window fits the top-k, so no key is read and nothing is flagged).
  pb.table[0 * size_t(pb.max_blocks) + 5] = static_cast<int32_t>(pb.num_blocks);
  pb.table[1 * size_t(pb.max_blocks) + 1] = -3;
  const IndexSelection got = testing::run_index_twin(pb);
  EXPECT_EQ(got.error, kIndexErrorBlock);
  EXPECT_EQ(got.counts[0], -1);
  EXPECT_EQ(got.counts[1], 40);
  EXPECT_EQ(got.counts[2], clean.counts[2]);
  for (int32_t i = 0; i < 40; ++i) EXPECT_EQ(got.positions[size_t(s.topk) + size_t(i)], i);
}

TEST(IndexKeysTwin, BadDescriptionsAreNamed) {
  IndexKeysSpec s = spec_of(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {100, 50});
  const IndexKeysProblem pb = make_index_keys_problem(s);
  std::vector<uint8_t> storage = pb.storage;
  storage.resize(storage.size() + 16);
  std::vector<int32_t> positions(static_cast<size_t>(pb.rows() * s.topk)), counts(size_t(pb.rows()));
  int32_t error = 0;
  const auto run = [&](auto edit) {
    DsaIndexerArgs a = pb.args(storage.data(), pb.table.data(), pb.q.data(), pb.weights.data(), pb.spec.kv_lens.data(),
                               positions.data(), counts.data(), &error);
    edit(a);
    dsa_select_tokens_cpu(pb.config, pb.sequences, a);
  };
  EXPECT_TRUE(throws_error_naming([&] { run([&](DsaIndexerArgs& a) { a.paged.pool = storage.data() + 4; }); },
                                  "16-byte aligned"));
  EXPECT_TRUE(throws_error_naming([&] { run([](DsaIndexerArgs& a) { a.paged.block_size = 24; }); }, "block_size = 24"));
  EXPECT_TRUE(
      throws_error_naming([&] { run([](DsaIndexerArgs& a) { a.max_kv_len = int64_t{a.paged.max_blocks} * 16 + 1; }); },
                          "exceeds what a block-table row holds"));
  EXPECT_TRUE(throws_error_naming([&] { run([](DsaIndexerArgs& a) { a.paged.block_table = nullptr; }); },
                                  "block_table is null"));
  EXPECT_TRUE(throws_error_naming([&] { run([](DsaIndexerArgs& a) { a.paged.block_table_stride = 1; }); },
                                  "block_table_stride = 1"));
  EXPECT_TRUE(throws_error_naming(
      [&] {
        run([](DsaIndexerArgs& a) {
          a.paged.format = IndexKeyFormat::kNative;
          a.q_format = IndexQueryFormat::kE4m3;
        });
      },
      "q_format kE4m3 needs FP8 keys"));
  EXPECT_TRUE(throws_error_naming(
      [&] {
        run([](DsaIndexerArgs& a) {
          a.paged.format = IndexKeyFormat::kNative;
          a.paged.dtype = DType::kF16;
        });
      },
      "native paged keys are f16"));
  DsaConfig wide = pb.config;
  wide.index_head_dim = 64;
  EXPECT_TRUE(throws_error_naming(
      [&] {
        DsaIndexerArgs a = pb.args(storage.data(), pb.table.data(), pb.q.data(), pb.weights.data(),
                                   pb.spec.kv_lens.data(), positions.data(), counts.data(), &error);
        dsa_select_tokens_cpu(wide, pb.sequences, a);
      },
      "128 values per key"));
}

}  // namespace
}  // namespace sparsepage
