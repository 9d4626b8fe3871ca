#include "support/engine_pools.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/fp8.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"
#include "support/expect_error.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

double e4m3_value(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  if (exp == 0xF && man == 7) return NAN;
  const double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
  return sign ? -mag : mag;
}

}  // namespace

void check_dsa_engine_pools(Device device, bool fp8) {
  DsaConfig c;
  c.num_qo_heads = device == Device::kCuda ? 128 : 8;
  c.latent_dim = 512;
  c.rope_dim = 64;
  c.index_heads = 64;
  c.index_head_dim = 128;
  c.index_topk = 64;
  c.kv_storage = KVStorage::kEnginePools;
  const float scale = 1.0f / std::sqrt(576.0f);
  c.scale = scale;
  const int32_t batch = 4, block = 64;
  const std::vector<int64_t> lens = {0, 50, 400, 130};  // free, within the top-k, long, just past it
  const int64_t max_len = 400;
  const int32_t max_blocks = 8, num_blocks = 40;
  std::mt19937_64 rng(fp8 ? 71 : 72);
  // A shuffled block table: sequence b's blocks scattered over the pool; unused blocks stay poisoned.
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> table(size_t(batch) * max_blocks, -1);
  for (int32_t b = 0, next = 0; b < batch; ++b) {
    for (int32_t j = 0; j < (lens[b] + block - 1) / block; ++j) table[size_t(b * max_blocks + j)] = ids[size_t(next++)];
  }
  const auto slot_of = [&](int32_t b, int64_t p) {
    return int64_t{table[size_t(b * max_blocks + p / block)]} * block + p % block;
  };

  // The engine's pools, on the host first: MLA rows (bf16 576-wide or 656-byte FP8) and index keys.
  const int64_t rows = int64_t{num_blocks} * block;
  const int64_t row_bytes = fp8 ? MlaFp8Row::kBytes : 576 * 2;
  std::vector<uint8_t> mla(size_t(rows * row_bytes), 0xFF);
  const int64_t key_bytes = fp8 ? IndexKeyFp8::kTokenBytes : 128 * 2;
  std::vector<uint8_t> keys(size_t(rows * key_bytes), 0xFF);
  PagedIndexKeys host_keys;
  host_keys.format = fp8 ? IndexKeyFormat::kE4m3 : IndexKeyFormat::kNative;
  host_keys.pool = keys.data();
  host_keys.num_blocks = num_blocks;
  host_keys.block_size = block;
  host_keys.dtype = DType::kBF16;
  host_keys.block_table = table.data();
  host_keys.block_table_stride = max_blocks;
  host_keys.max_blocks = max_blocks;
  for (int32_t b = 0; b < batch; ++b) {
    for (int64_t p = 0; p < lens[b]; ++p) {
      const int64_t slot = slot_of(b, p);
      const auto row = random_values(DType::kBF16, 576, rng);
      if (fp8) {
        quantize_mla_fp8_cpu(DType::kBF16, row.data(), 1, 576, mla.data() + slot * row_bytes, row_bytes);
      } else {
        std::memcpy(mla.data() + slot * row_bytes, row.data(), size_t(row_bytes));
      }
      const auto key = random_values(DType::kBF16, 128, rng);
      write_index_keys_cpu(host_keys, 128, DType::kBF16, key.data(), 128, &slot, 1);
    }
  }
  // Queries and weights.
  const auto q = random_values(DType::kBF16, size_t(batch) * c.num_qo_heads * 512, rng);
  const auto q_pe = random_values(DType::kBF16, size_t(batch) * c.num_qo_heads * 64, rng);
  const auto q_index = random_values(DType::kBF16, size_t(batch) * 64 * 128, rng);
  std::vector<float> weights(size_t(batch) * 64);
  std::uniform_real_distribution<float> w(0.05f, 1.0f);
  for (float& x : weights) x = w(rng);
  const std::vector<int32_t> lens32(lens.begin(), lens.end());

  // On the layer's device.
  const Buffer d_mla = upload(device, mla), d_keys = upload(device, keys), d_table = upload(device, table),
               d_lens = upload(device, lens32), d_q = upload(device, q), d_qpe = upload(device, q_pe),
               d_qi = upload(device, q_index), d_w = upload(device, weights);
  Buffer d_o(device, size_t(batch) * c.num_qo_heads * 512 * 2);
  fill_bytes(d_o.data(), device, 0xFF, d_o.bytes());

  DsaAttention layer(device, DType::kBF16, c, batch);
  layer.reserve(max_len);
  EnginePagedKV kv;
  if (fp8) {
    const MlaFp8Views v = mla_fp8_views(d_mla.data(), rows, row_bytes);
    kv.k = v.k;
    kv.v = v.v;
    kv.k_extra = v.k_extra;
    kv.kv_format = KvFormat::kE4m3Mla;
  } else {
    kv.k = RowView::dense(d_mla.data(), 1, rows, 512);
    kv.k.row_stride = 576;
    kv.k.capacity = rows;
    kv.k.seq_stride = 0;
    kv.v = kv.k;
    kv.k_extra = kv.k;
    kv.k_extra.data = static_cast<const char*>(d_mla.data()) + 512 * 2;
    kv.k_extra.dim = 64;
  }
  kv.block_table.data = d_table.as<int32_t>();
  kv.block_table.num_rows = batch;
  kv.block_table.max_blocks = max_blocks;
  kv.block_table.row_stride = max_blocks;
  kv.block_table.block_size = block;
  kv.block_table.num_blocks = num_blocks;
  kv.seq_lens = d_lens.as<int32_t>();
  kv.max_seq_len = max_len;
  kv.index_keys = host_keys;
  kv.index_keys.pool = const_cast<void*>(d_keys.data());
  kv.index_keys.block_table = d_table.as<int32_t>();
  DsaTokens t;
  t.q_latent = d_q.data();
  t.q_pe = d_qpe.data();
  t.q_index = d_qi.data();
  t.index_weights = d_w.as<float>();
  t.o = d_o.data();

  // Refused calls change nothing and name the problem.
  EnginePagedKV no_lens = kv;
  no_lens.seq_lens = nullptr;
  EXPECT_THROW(layer.decode(t, no_lens), Error);
  DsaTokens with_key = t;
  with_key.index_k = d_qi.data();
  EXPECT_THROW(layer.decode(with_key, kv), Error);
  EXPECT_THROW(layer.admit(0, nullptr, nullptr, 0), Error) << "the engine owns the sequences";

  const LayerStep s = layer.decode(t, kv);
  ASSERT_TRUE(s.fused);
  EXPECT_TRUE(s.sparse);
  EXPECT_NO_THROW(layer.check_errors()) << "a good step flags nothing";

  // The selection: the indexer's twin over the same host pools.
  std::vector<int32_t> want_pos(static_cast<size_t>(batch) * c.index_topk), want_cnt(static_cast<size_t>(batch));
  DsaIndexerArgs a;
  a.dtype = DType::kBF16;
  a.key_layout = IndexKeyLayout::kPaged;
  a.paged = host_keys;
  a.kv_lens = lens32.data();
  a.max_kv_len = max_len;
  a.q_index = q_index.data();
  a.weights = weights.data();
  a.positions = want_pos.data();
  a.counts = want_cnt.data();
  dsa_select_tokens_cpu(c, batch, a);
  const auto got = layer.last_selected_positions();
  ASSERT_EQ(int(got.size()), batch);
  for (int32_t b = 0; b < batch; ++b) {
    std::vector<int32_t> want(want_pos.begin() + b * c.index_topk,
                              want_pos.begin() + b * c.index_topk + want_cnt[size_t(b)]);
    std::vector<int32_t> have = got[size_t(b)];
    std::sort(want.begin(), want.end());
    std::sort(have.begin(), have.end());
    EXPECT_EQ(int64_t(have.size()), std::min<int64_t>(lens[size_t(b)], c.index_topk)) << "sequence " << b;
    if (device == Device::kCpu) {
      EXPECT_EQ(have, want) << "sequence " << b;
    } else {  // tensor-core sums: only near-ties at the threshold may swap
      std::vector<int32_t> both;
      std::set_intersection(have.begin(), have.end(), want.begin(), want.end(), std::back_inserter(both));
      EXPECT_GE(double(both.size()), 0.95 * double(want.size())) << "sequence " << b;
    }
  }

  // The output: fp64 attention over the selected positions of the dequantized rows.
  const auto o = download<uint16_t>(device, d_o.data(), size_t(batch) * c.num_qo_heads * 512);
  const auto qf = as_float(DType::kBF16, q), qpf = as_float(DType::kBF16, q_pe);
  const auto row_value = [&](int64_t slot, int32_t col) -> double {  // col < 512: latent, else rope
    const uint8_t* r = mla.data() + slot * row_bytes;
    if (!fp8) return bf16_to_float(reinterpret_cast<const uint16_t*>(r)[col]);
    if (col >= 512) return bf16_to_float(reinterpret_cast<const uint16_t*>(r + 528)[col - 512]);
    float sc;
    std::memcpy(&sc, r + 512 + 4 * (col / 128), 4);
    return e4m3_value(r[col]) * sc;
  };
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t h = 0; h < c.num_qo_heads; ++h) {
      std::vector<float> out(512);
      for (int i = 0; i < 512; ++i) out[size_t(i)] = bf16_to_float(o[size_t((b * c.num_qo_heads + h) * 512 + i)]);
      if (lens[size_t(b)] == 0) {
        for (float x : out) ASSERT_EQ(x, 0.0f) << "a free slot writes zeros";
        continue;
      }
      std::vector<double> sc, ref(512, 0.0);
      double m = -INFINITY;
      for (int32_t p : got[size_t(b)]) {
        double dot = 0;
        for (int i = 0; i < 576; ++i) {
          const double qv = i < 512 ? qf[size_t((b * c.num_qo_heads + h) * 512 + i)]
                                    : qpf[size_t((b * c.num_qo_heads + h) * 64 + i - 512)];
          dot += qv * row_value(slot_of(b, p), i);
        }
        sc.push_back(dot * scale);
        m = std::max(m, sc.back());
      }
      double sum = 0;
      for (size_t j = 0; j < sc.size(); ++j) {
        const double pj = std::exp(sc[j] - m);
        sum += pj;
        for (int i = 0; i < 512; ++i) ref[size_t(i)] += pj * row_value(slot_of(b, got[size_t(b)][j]), i);
      }
      for (double& x : ref) x /= sum;
      ASSERT_LT(relative_l2(out, ref), 1e-2) << "sequence " << b << " head " << h;
    }
  }

  // A length past the bound the engine declared: that row selects nothing,
  // and check_errors() names it instead of the zeros passing silently.
  std::vector<int32_t> bad = lens32;
  bad[2] = static_cast<int32_t>(max_len + 7);
  const Buffer d_bad = upload(device, bad);
  EnginePagedKV over = kv;
  over.seq_lens = d_bad.as<int32_t>();
  // On the CPU (host lengths) the step names it before anything runs; on
  // CUDA the indexer refuses the row (count -1), the decode poisons that
  // request, and check_errors() names the flag.
  if (device == Device::kCpu) {
    EXPECT_TRUE(throws_error_naming([&] { layer.decode(t, over); }, "kv.seq_lens[2] = " + std::to_string(max_len + 7) +
                                                                        " lies outside [0, max_seq_len"));
  } else {
    layer.decode(t, over);
    try {
      layer.check_errors();
      ADD_FAILURE() << "a length past max_seq_len was not reported";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_seq_len"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(layer.check_errors()) << "reading the flags clears them";
}

}  // namespace sparsepage::testing
