#include "support/gqa_prefill_fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "sparsepage/types.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr uint8_t kE4m3Nan = 0x7F;

/// Quantizes `values` (one stream, [batch, heads, capacity, d]) per KV head:
/// the head's largest finite magnitude maps to 448 (rounded up to a power of
/// two with pow2), and the stored scale is that times factor(h).
void quantize(const std::vector<float>& values, int32_t batch, int32_t heads, int64_t capacity, int32_t d, bool pow2,
              float (*factor)(int32_t), std::vector<uint8_t>& bytes, std::vector<float>& scale,
              std::vector<float>& dequantized) {
  const int64_t per_head = capacity * d;
  bytes.assign(values.size(), kE4m3Nan);
  dequantized.assign(values.size(), std::numeric_limits<float>::quiet_NaN());
  scale.assign(static_cast<size_t>(heads), 1.0f);
  for (int32_t h = 0; h < heads; ++h) {
    float amax = 0.0f;
    for (int32_t b = 0; b < batch; ++b) {
      const size_t base = static_cast<size_t>((int64_t{b} * heads + h) * per_head);
      for (int64_t i = 0; i < per_head; ++i) {
        const float x = values[base + static_cast<size_t>(i)];
        if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
      }
    }
    float unit = amax > 0.0f ? amax / 448.0f : 1.0f;  // the value of e4m3 1.0
    if (pow2) unit = std::exp2(std::ceil(std::log2(unit)));
    scale[static_cast<size_t>(h)] = unit * factor(h);
    for (int32_t b = 0; b < batch; ++b) {
      const size_t base = static_cast<size_t>((int64_t{b} * heads + h) * per_head);
      for (int64_t i = 0; i < per_head; ++i) {
        const size_t at = base + static_cast<size_t>(i);
        const float x = values[at];
        if (std::isnan(x)) continue;  // stays e4m3 NaN
        bytes[at] = float_to_e4m3(x / unit);
        dequantized[at] = e4m3_to_float(bytes[at]) * scale[static_cast<size_t>(h)];  // as both backends compute it
      }
    }
  }
}

float k_factor(int32_t h) { return std::exp2(static_cast<float>(h % 4 - 1)); }  // 1/2, 1, 2, 4
float v_factor(int32_t h) { return std::exp2(static_cast<float>(2 - h % 4)); }  // 4, 2, 1, 1/2

}  // namespace

GqaFp8Problem make_gqa_fp8_problem(const GqaPrefillSpec& spec, bool pow2_scales) {
  GqaFp8Problem pb;
  pb.base = make_gqa_prefill_problem(spec);
  pb.pow2_scales = pow2_scales;
  const int32_t hkv = spec.num_kv_heads;
  quantize(as_float(spec.dtype, pb.base.k), spec.batch, hkv, pb.base.capacity, spec.head_dim, pow2_scales, k_factor,
           pb.k8, pb.k_scale, pb.k_values);
  quantize(as_float(spec.dtype, pb.base.v), spec.batch, hkv, pb.base.capacity, spec.head_dim, pow2_scales, v_factor,
           pb.v8, pb.v_scale, pb.v_values);
  pb.dequantized = pb.base;
  const size_t esize = dtype_size(spec.dtype);
  pb.dequantized.k.assign(pb.k_values.size() * esize, 0);
  pb.dequantized.v.assign(pb.v_values.size() * esize, 0);
  from_float(spec.dtype, pb.k_values.data(), pb.dequantized.k.data(), pb.k_values.size());
  from_float(spec.dtype, pb.v_values.data(), pb.dequantized.v.data(), pb.v_values.size());
  return pb;
}

GqaPrefillParams GqaFp8Problem::params(const void* q, const void* k, const void* v, const float* ks, const float* vs,
                                       const int32_t* ids, const int32_t* counts, const int32_t* kv_lens, void* o,
                                       float* lse) const {
  GqaPrefillParams p = base.params(q, k, v, ids, counts, kv_lens, o, lse);
  p.kv_format = KvFormat::kE4m3PerHead;  // the views count e4m3 bytes: dims and strides as before
  p.k_scale = ks;
  p.v_scale = vs;
  return p;
}

GqaPrefillParams GqaFp8Problem::host_params(void* o, float* lse) const {
  return params(base.q.data(), k8.data(), v8.data(), k_scale.data(), v_scale.data(), base.block_ids.data(),
                base.counts.data(), base.kv_lens.data(), o, lse);
}

GqaPrefillReference gqa_fp8_reference(const GqaFp8Problem& pb) {
  const GqaPrefillSpec& spec = pb.base.spec;
  const std::vector<std::vector<int32_t>> attended = gqa_prefill_attended(pb.base.host_params(nullptr, nullptr));
  const int32_t n = spec.num_tokens, hq = spec.num_qo_heads, g = hq / spec.num_kv_heads, d = spec.head_dim;
  const std::vector<float> q = as_float(spec.dtype, pb.base.q);
  GqaPrefillReference ref;
  ref.out.assign(static_cast<size_t>(spec.batch) * n * hq * d, 0.0);
  ref.lse.assign(static_cast<size_t>(spec.batch) * n * hq, -std::numeric_limits<double>::infinity());
  for (size_t r = 0; r < attended.size(); ++r) {
    const int64_t h = static_cast<int64_t>(r) % hq, b = static_cast<int64_t>(r) / (int64_t{hq} * n);
    const int64_t base = (b * spec.num_kv_heads + h / g) * pb.base.capacity;  // the KV head's rows
    std::vector<double> s;
    for (int32_t pos : attended[r]) {
      double dot = 0.0;
      for (int32_t i = 0; i < d; ++i)
        dot += double{q[r * d + static_cast<size_t>(i)]} * pb.k_values[static_cast<size_t>((base + pos) * d + i)];
      s.push_back(dot * pb.base.scale);
    }
    ref.lse[r] = softmax_weighted_sum(
        s, d,
        [&](size_t j, int64_t i) { return double{pb.v_values[static_cast<size_t>((base + attended[r][j]) * d + i)]}; },
        &ref.out[r * static_cast<size_t>(d)]);
  }
  return ref;
}

GqaFp8Pool make_gqa_fp8_pool(const GqaFp8Problem& pb, int32_t pool_block, uint64_t seed) {
  const GqaPrefillSpec& spec = pb.base.spec;
  const int32_t hkv = spec.num_kv_heads, d = spec.head_dim;
  GqaFp8Pool pool;
  pool.pool_block = pool_block;
  pool.max_blocks = static_cast<int32_t>((pb.base.kv_len + pool_block - 1) / pool_block);
  pool.num_blocks = int64_t{spec.batch} * pool.max_blocks + 3;  // three blocks nobody owns
  std::vector<int32_t> order(static_cast<size_t>(pool.num_blocks));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  const size_t pool_bytes = static_cast<size_t>(pool.num_blocks) * pool_block * hkv * d;
  pool.k.assign(pool_bytes, kE4m3Nan);
  pool.v.assign(pool_bytes, kE4m3Nan);
  pool.table.assign(static_cast<size_t>(spec.batch) * pool.max_blocks, -1);
  for (int32_t b = 0; b < spec.batch; ++b) {
    for (int32_t j = 0; j < pool.max_blocks; ++j) {
      const int32_t block = order[static_cast<size_t>(b) * pool.max_blocks + j];
      pool.table[static_cast<size_t>(b) * pool.max_blocks + j] = block;
      for (int32_t slot = 0; slot < pool_block; ++slot) {
        const int64_t pos = int64_t{j} * pool_block + slot;
        if (pos >= pb.base.capacity) continue;
        for (int32_t h = 0; h < hkv; ++h) {
          const size_t src = static_cast<size_t>(((int64_t{b} * hkv + h) * pb.base.capacity + pos) * d);
          const size_t dst = static_cast<size_t>(((int64_t{block} * pool_block + slot) * hkv + h) * d);
          std::copy_n(pb.k8.begin() + static_cast<std::ptrdiff_t>(src), d,
                      pool.k.begin() + static_cast<std::ptrdiff_t>(dst));
          std::copy_n(pb.v8.begin() + static_cast<std::ptrdiff_t>(src), d,
                      pool.v.begin() + static_cast<std::ptrdiff_t>(dst));
        }
      }
    }
  }
  return pool;
}

GqaPrefillParams GqaFp8Pool::paged(GqaPrefillParams p, const void* k_data, const void* v_data,
                                   const int32_t* table_data, int32_t batch) const {
  const int32_t hkv = p.num_kv_heads, d = p.k.dim;
  const int64_t rows = num_blocks * pool_block;
  p.k = {k_data, int64_t{hkv} * d, d, 0, d, rows};
  p.v = {v_data, int64_t{hkv} * d, d, 0, d, rows};
  p.block_table.data = table_data;
  p.block_table.row_stride = max_blocks;
  p.block_table.max_blocks = max_blocks;
  p.block_table.num_rows = batch;
  p.block_table.block_size = pool_block;
  p.block_table.num_blocks = num_blocks;
  return p;
}

}  // namespace sparsepage::testing
