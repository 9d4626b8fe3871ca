#include "support/prefill_problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <string>

#include "sparsepage/fp8.h"
#include "sparsepage/plan.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr int32_t kLatent = 512, kRope = 64, kRow = 576;
constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<float> row_floats(DType dtype, const uint8_t* src, size_t count) {
  std::vector<float> out(count);
  to_float(dtype, src, out.data(), count);
  return out;
}

}  // namespace

std::vector<uint8_t> integer_values(DType dtype, size_t count, std::mt19937_64& rng, int amp) {
  std::uniform_int_distribution<int> pick(-amp, amp);
  std::vector<float> values(count);
  for (float& v : values) v = static_cast<float>(pick(rng));
  std::vector<uint8_t> bytes(count * dtype_size(dtype));
  from_float(dtype, values.data(), bytes.data(), count);
  return bytes;
}

// ---- MLA -------------------------------------------------------------------

MlaPrefillProblem make_mla_prefill_problem(const MlaPrefillSpec& spec) {
  MlaPrefillProblem pb;
  pb.spec = spec;
  std::mt19937_64 rng(spec.seed);
  const int32_t n = spec.num_tokens, batch = spec.batch, topk = spec.topk;
  for (int32_t b = 0; b < batch; ++b) pb.kv_lens.push_back(spec.starts.at(static_cast<size_t>(b)) + n);
  pb.kv_len = *std::max_element(pb.kv_lens.begin(), pb.kv_lens.end());
  pb.capacity = spec.capacity > 0 ? spec.capacity : pb.kv_len + 8;
  const size_t rows = static_cast<size_t>(batch) * static_cast<size_t>(pb.capacity);
  pb.q = spec.integer_values
             ? integer_values(DType::kBF16, static_cast<size_t>(batch) * n * spec.num_heads * kRow, rng, 2)
             : random_values(DType::kBF16, static_cast<size_t>(batch) * n * spec.num_heads * kRow, rng);
  pb.kv = spec.integer_values ? integer_values(DType::kBF16, rows * kRow, rng, 2)
                              : random_values(DType::kBF16, rows * kRow, rng);
  pb.indices.assign(static_cast<size_t>(batch) * n * topk, -1);
  std::vector<char> attended(rows, 0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const int64_t pos = pb.kv_lens[static_cast<size_t>(b)] - n + t;
      const bool empty = b == 0 && t < spec.empty_tokens;
      int32_t* row = &pb.indices[(static_cast<size_t>(b) * n + t) * topk];
      std::vector<int32_t> pool(static_cast<size_t>(pos + 1));
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
      std::uniform_int_distribution<int64_t> any(0, pos);
      for (int32_t i = 0; i < topk; ++i) {
        if (empty || unit(rng) < spec.pad_fraction) continue;
        int32_t p;
        if (spec.duplicates) {
          p = static_cast<int32_t>(any(rng));
        } else if (static_cast<size_t>(i) < pool.size()) {
          p = pool[static_cast<size_t>(i)];
        } else {
          continue;  // fewer positions than entries: padding
        }
        row[i] = p;
      }
      const int32_t count = spec.topk_length ? std::uniform_int_distribution<int32_t>(0, topk)(rng) : topk;
      if (spec.topk_length) pb.topk_length.push_back(count);
      for (int32_t i = 0; i < count; ++i) {
        if (row[i] >= 0) attended[static_cast<size_t>(b) * pb.capacity + row[i]] = 1;
      }
    }
  }
  // Rows no token reads are NaN: reading one shows.
  const std::vector<uint8_t> nan_row = nan_values(DType::kBF16, kRow);
  for (size_t r = 0; r < rows; ++r) {
    if (!attended[r]) std::memcpy(&pb.kv[r * kRow * 2], nan_row.data(), nan_row.size());
  }
  if (spec.fp8) {
    pb.kv_fp8.assign(rows * MlaFp8Row::kBytes, 0);
    quantize_mla_fp8_cpu(DType::kBF16, pb.kv.data(), static_cast<int64_t>(rows), kRow, pb.kv_fp8.data());
  }
  if (spec.sink) {
    std::uniform_real_distribution<float> s(-2.0f, 2.0f);
    for (int32_t h = 0; h < spec.num_heads; ++h) pb.sink.push_back(s(rng));
    pb.sink[0] = -std::numeric_limits<float>::infinity();                         // changes nothing
    if (spec.num_heads > 1) pb.sink[1] = std::numeric_limits<float>::infinity();  // zeroes out
  }
  pb.scale = spec.integer_values ? 1.0f / 64.0f : 1.0f / std::sqrt(static_cast<float>(kRow));
  return pb;
}

MlaPrefillParams MlaPrefillProblem::params(const void* q_data, const void* kv_data, const int32_t* index_data,
                                           const int32_t* topk_length_data, const int32_t* kv_lens_data,
                                           const float* sink_data, void* out, float* lse, float* max_logits) const {
  MlaPrefillParams p;
  p.dtype = DType::kBF16;
  p.chunk.batch = spec.batch;
  p.chunk.num_tokens = spec.num_tokens;
  p.chunk.kv_len = kv_len;
  p.chunk.kv_lens = kv_lens_data;
  p.num_heads = spec.num_heads;
  p.topk = spec.topk;
  p.q = q_data;
  p.q_rope = static_cast<const uint16_t*>(q_data) + kLatent;
  p.qo_layout = QueryLayout::kStrided;
  const int64_t heads = spec.num_heads;
  p.q_strides = {int64_t{spec.num_tokens} * heads * kRow, kRow, heads * kRow};
  p.q_rope_strides = p.q_strides;
  p.out_strides = {int64_t{spec.num_tokens} * heads * kLatent, kLatent, heads * kLatent};
  if (spec.fp8) {
    p.kv_format = KvFormat::kE4m3Mla;
    const MlaFp8Views views = mla_fp8_views(kv_data, capacity);
    p.kv = views.k;
    p.kv.seq_stride = capacity * MlaFp8Row::kBytes;
    p.kv_rope = views.k_extra;
    p.kv_rope.seq_stride = capacity * (MlaFp8Row::kBytes / 2);
  } else {
    p.kv = {kv_data, kRow, kLatent, capacity * kRow, 0, capacity};
    p.kv_rope = {static_cast<const uint16_t*>(kv_data) + kLatent, kRow, kRope, capacity * kRow, 0, capacity};
  }
  p.indices = index_data;
  p.topk_length = topk_length_data;
  p.scale = scale;
  p.attn_sink = sink_data;
  p.out = out;
  p.lse = lse;
  p.max_logits = max_logits;
  return p;
}

MlaPrefillParams MlaPrefillProblem::host_params(void* out, float* lse, float* max_logits) const {
  return params(q.data(), spec.fp8 ? static_cast<const void*>(kv_fp8.data()) : kv.data(), indices.data(),
                spec.topk_length ? topk_length.data() : nullptr, kv_lens.data(), spec.sink ? sink.data() : nullptr, out,
                lse, max_logits);
}

MlaPrefillPool make_mla_prefill_pool(const MlaPrefillProblem& pb, int32_t block_size, int32_t max_blocks,
                                     const std::vector<int32_t>& block_ids) {
  MlaPrefillPool pool;
  pool.block_size = block_size;
  pool.max_blocks = max_blocks;
  pool.num_blocks = static_cast<int64_t>(block_ids.size());
  const size_t row_bytes = pb.spec.fp8 ? MlaFp8Row::kBytes : kRow * 2;
  const std::vector<uint8_t>& dense = pb.spec.fp8 ? pb.kv_fp8 : pb.kv;
  pool.rows.assign(static_cast<size_t>(pool.num_blocks * block_size) * row_bytes, 0xFF);
  pool.table.assign(static_cast<size_t>(pb.spec.batch) * max_blocks, static_cast<int32_t>(pool.num_blocks) + 5);
  size_t next = 0;
  for (int32_t b = 0; b < pb.spec.batch; ++b) {
    const int64_t len = pb.kv_lens[static_cast<size_t>(b)];
    int32_t* row = pool.table.data() + static_cast<size_t>(b) * max_blocks;
    for (int64_t j = 0; j * block_size < len; ++j) row[j] = block_ids.at(next++);
    for (int64_t pos = 0; pos < len; ++pos) {
      const int64_t at = int64_t{row[pos / block_size]} * block_size + pos % block_size;
      std::memcpy(pool.rows.data() + static_cast<size_t>(at) * row_bytes,
                  dense.data() + static_cast<size_t>(b * pb.capacity + pos) * row_bytes, row_bytes);
    }
  }
  return pool;
}

MlaPrefillParams MlaPrefillPool::paged(MlaPrefillParams p) const {
  const int64_t pool_rows = num_blocks * block_size;
  if (p.kv_format == KvFormat::kE4m3Mla) {
    const MlaFp8Views views = mla_fp8_views(rows.data(), pool_rows);
    p.kv = views.k;
    p.kv_rope = views.k_extra;
  } else {
    p.kv = {rows.data(), kRow, kLatent, 0, 0, pool_rows};
    p.kv_rope = {rows.data() + kLatent * 2, kRow, kRope, 0, 0, pool_rows};
  }
  p.block_table = {table.data(), max_blocks, max_blocks, p.chunk.batch, block_size, num_blocks};
  return p;
}

namespace {

/// Row `pos` of sequence b as the kernels see it: 512 latent then 64 rope values.
std::vector<double> mla_row(const MlaPrefillProblem& pb, int32_t b, int64_t pos) {
  const size_t r = static_cast<size_t>(b) * static_cast<size_t>(pb.capacity) + static_cast<size_t>(pos);
  std::vector<double> row(kRow);
  if (pb.spec.fp8) {
    const uint8_t* bytes = &pb.kv_fp8[r * MlaFp8Row::kBytes];
    float scales[4];
    std::memcpy(scales, bytes + 512, sizeof(scales));
    for (int i = 0; i < kLatent; ++i) row[static_cast<size_t>(i)] = double{e4m3_to_float(bytes[i])} * scales[i / 128];
    const std::vector<float> rope = row_floats(DType::kBF16, bytes + MlaFp8Row::kRopeOffset, kRope);
    for (int i = 0; i < kRope; ++i) row[static_cast<size_t>(kLatent + i)] = rope[static_cast<size_t>(i)];
  } else {
    const std::vector<float> f = row_floats(DType::kBF16, &pb.kv[r * kRow * 2], kRow);
    for (int i = 0; i < kRow; ++i) row[static_cast<size_t>(i)] = f[static_cast<size_t>(i)];
  }
  return row;
}

/// The valid entries of token t of sequence b (its topk_length applied, -1 dropped).
std::vector<int32_t> mla_entries(const MlaPrefillProblem& pb, int32_t b, int32_t t) {
  const size_t row = static_cast<size_t>(b) * pb.spec.num_tokens + static_cast<size_t>(t);
  const int32_t count = pb.spec.topk_length ? pb.topk_length[row] : pb.spec.topk;
  std::vector<int32_t> out;
  for (int32_t i = 0; i < count; ++i) {
    const int32_t p = pb.indices[row * pb.spec.topk + static_cast<size_t>(i)];
    if (p >= 0) out.push_back(p);
  }
  return out;
}

}  // namespace

MlaPrefillReference mla_prefill_reference(const MlaPrefillProblem& pb) {
  const int32_t n = pb.spec.num_tokens, heads = pb.spec.num_heads;
  MlaPrefillReference ref;
  const size_t rows = static_cast<size_t>(pb.spec.batch) * n * heads;
  ref.out.assign(rows * kLatent, 0.0);
  ref.lse.assign(rows, kInf);
  ref.max_logits.assign(rows, -kInf);
  const std::vector<float> q = as_float(DType::kBF16, pb.q);
  for (int32_t b = 0; b < pb.spec.batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const std::vector<int32_t> entries = mla_entries(pb, b, t);
      std::vector<std::vector<double>> kv;
      for (int32_t p : entries) kv.push_back(mla_row(pb, b, p));
      for (int32_t h = 0; h < heads; ++h) {
        const size_t r = (static_cast<size_t>(b) * n + static_cast<size_t>(t)) * heads + static_cast<size_t>(h);
        if (entries.empty()) continue;  // out 0, lse +inf, max -inf
        std::vector<double> s(entries.size());
        for (size_t j = 0; j < entries.size(); ++j) {
          double dot = 0.0;
          for (int i = 0; i < kRow; ++i)
            dot += double{q[r * kRow + static_cast<size_t>(i)]} * kv[j][static_cast<size_t>(i)];
          s[j] = dot * pb.scale;
        }
        double* out = &ref.out[r * kLatent];
        const double lse = softmax_weighted_sum(
            s, kLatent, [&](size_t j, int64_t i) { return kv[j][static_cast<size_t>(i)]; }, out);
        ref.lse[r] = lse;
        ref.max_logits[r] = *std::max_element(s.begin(), s.end());
        if (pb.spec.sink) {
          const double factor = 1.0 / (1.0 + std::exp(double{pb.sink[static_cast<size_t>(h)]} - lse));
          for (int i = 0; i < kLatent; ++i) out[i] *= factor;
        }
      }
    }
  }
  return ref;
}

std::string compare_mla_prefill(const MlaPrefillProblem& pb, const MlaPrefillReference& ref,
                                const std::vector<float>& out, const std::vector<float>& lse,
                                const std::vector<float>* max_logits, double out_tol, double lse_tol, double max_tol) {
  const size_t rows = ref.lse.size();
  if (out.size() != rows * kLatent || lse.size() != rows) return "output sizes differ";
  const int32_t heads = pb.spec.num_heads;
  for (size_t r = 0; r < rows; ++r) {
    const std::string where = "token " + std::to_string(r / static_cast<size_t>(heads)) + " head " +
                              std::to_string(r % static_cast<size_t>(heads)) + ": ";
    const std::vector<float> got(out.begin() + static_cast<std::ptrdiff_t>(r * kLatent),
                                 out.begin() + static_cast<std::ptrdiff_t>((r + 1) * kLatent));
    const std::vector<double> want(ref.out.begin() + static_cast<std::ptrdiff_t>(r * kLatent),
                                   ref.out.begin() + static_cast<std::ptrdiff_t>((r + 1) * kLatent));
    const bool zero = std::all_of(want.begin(), want.end(), [](double x) { return x == 0.0; });
    if (zero) {
      if (!std::all_of(got.begin(), got.end(), [](float x) { return x == 0.0f; })) return where + "out should be 0";
    } else {
      const double err = relative_l2(got, want);
      if (!(err <= out_tol)) return where + "out relative L2 " + std::to_string(err) + " > " + std::to_string(out_tol);
    }
    if (std::isinf(ref.lse[r])) {
      if (!(std::isinf(lse[r]) && lse[r] > 0)) return where + "lse " + std::to_string(lse[r]) + ", expected +inf";
    } else if (!(std::fabs(double{lse[r]} - ref.lse[r]) <= lse_tol)) {
      return where + "lse " + std::to_string(lse[r]) + " vs fp64 " + std::to_string(ref.lse[r]);
    }
    if (max_logits != nullptr) {
      const float m = (*max_logits)[r];
      if (std::isinf(ref.max_logits[r])) {
        if (!(std::isinf(m) && m < 0)) return where + "max_logits " + std::to_string(m) + ", expected -inf";
      } else if (!(std::fabs(double{m} - ref.max_logits[r]) <= max_tol)) {
        return where + "max_logits " + std::to_string(m) + " vs fp64 " + std::to_string(ref.max_logits[r]);
      }
    }
  }
  return "";
}

void mla_token_by_token_cpu(const MlaPrefillProblem& pb, std::vector<float>& out, std::vector<float>& lse) {
  const int32_t n = pb.spec.num_tokens, heads = pb.spec.num_heads;
  out.assign(static_cast<size_t>(pb.spec.batch) * n * heads * kLatent, 0.0f);
  lse.assign(static_cast<size_t>(pb.spec.batch) * n * heads, 0.0f);
  const MlaPrefillParams full = pb.host_params(nullptr, nullptr, nullptr);
  std::vector<uint16_t> o(static_cast<size_t>(heads) * kLatent);
  std::vector<float> l(static_cast<size_t>(heads));
  for (int32_t b = 0; b < pb.spec.batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const std::vector<int32_t> entries = mla_entries(pb, b, t);
      const int64_t row = int64_t{b} * n + t;
      // One request: one query token, its entries as a window table of page size 1.
      const std::vector<int32_t> indptr = {0, static_cast<int32_t>(entries.size())};
      const std::vector<int32_t> lens = {static_cast<int32_t>(entries.size())};
      PlanShape shape;
      shape.group_size = heads;
      shape.head_dim_v = kLatent;
      shape.num_sms = 1;
      const DecodePlan plan = make_decode_plan(lens, shape);
      std::vector<char> ws(plan.workspace.total + 256);
      DecodeParams d;
      d.dtype = DType::kBF16;
      d.kv_format = full.kv_format;
      d.indptr = indptr.data();
      d.indices = entries.empty() ? indptr.data() : entries.data();
      d.num_indices = static_cast<int64_t>(std::max<size_t>(entries.size(), 1));
      d.seq_lens = lens.data();
      d.num_requests = 1;
      d.addressing = PageAddressing::kWindow;
      d.window_len = pb.kv_lens[static_cast<size_t>(b)] - n + t + 1;
      d.group_size = heads;
      d.q = static_cast<const uint16_t*>(full.q) + row * heads * kRow;
      d.q_extra = static_cast<const uint16_t*>(full.q_rope) + row * heads * kRow;
      d.qo_layout = QueryLayout::kStrided;
      d.q_strides = {0, kRow, 0};
      d.q_extra_strides = d.q_strides;
      d.o_strides = {0, kLatent, 0};
      const size_t kv_size = pb.spec.fp8 ? 1 : 2;
      d.k = full.kv;
      d.k.data = static_cast<const char*>(full.kv.data) + b * full.kv.seq_stride * static_cast<int64_t>(kv_size);
      d.k.seq_stride = 0;
      d.v = d.k;
      d.k_extra = full.kv_rope;
      d.k_extra.data = static_cast<const char*>(full.kv_rope.data) + b * full.kv_rope.seq_stride * 2;
      d.k_extra.seq_stride = 0;
      d.scale = pb.scale;
      d.o = o.data();
      d.lse = l.data();
      run_decode_cpu(d, plan, ws.data());
      const std::vector<float> of = row_floats(DType::kBF16, reinterpret_cast<const uint8_t*>(o.data()), o.size());
      std::copy(of.begin(), of.end(), out.begin() + row * heads * kLatent);
      std::copy(l.begin(), l.end(), lse.begin() + row * heads);
    }
  }
}

std::vector<std::vector<int32_t>> mla_prefill_attended(const MlaPrefillParams& p) {
  const int32_t n = p.chunk.num_tokens;
  const int64_t token_stride = p.index_token_stride > 0 ? p.index_token_stride : p.topk;
  const int64_t seq_stride = p.index_seq_stride > 0 ? p.index_seq_stride : int64_t{n} * token_stride;
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(p.chunk.batch) * static_cast<size_t>(n));
  for (int32_t b = 0; b < p.chunk.batch; ++b) {
    const int64_t len = p.chunk.kv_lens != nullptr ? p.chunk.kv_lens[b] : p.chunk.kv_len;
    for (int32_t t = 0; t < n; ++t) {
      const int32_t* row = p.indices + int64_t{b} * seq_stride + int64_t{t} * token_stride;
      const int32_t count = p.topk_length != nullptr ? std::min(p.topk, p.topk_length[int64_t{b} * n + t]) : p.topk;
      const int64_t pos = len - n + t;
      auto& kept = out[static_cast<size_t>(int64_t{b} * n + t)];
      for (int32_t i = 0; i < count; ++i) {
        if (row[i] >= 0 && row[i] <= pos) kept.push_back(row[i]);
      }
      std::sort(kept.begin(), kept.end());
      kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
    }
  }
  return out;
}

// ---- GQA ---------------------------------------------------------------------

GqaPrefillProblem make_gqa_prefill_problem(const GqaPrefillSpec& spec) {
  GqaPrefillProblem pb;
  pb.spec = spec;
  std::mt19937_64 rng(spec.seed);
  const int32_t n = spec.num_tokens, bs = spec.block_size, d = spec.head_dim;
  const int32_t hq = spec.num_qo_heads, hkv = spec.num_kv_heads, g = hq / hkv;
  for (int32_t b = 0; b < spec.batch; ++b) pb.kv_lens.push_back(spec.starts.at(static_cast<size_t>(b)) + n);
  pb.kv_len = *std::max_element(pb.kv_lens.begin(), pb.kv_lens.end());
  pb.capacity = pb.kv_len + 8;
  const size_t cache = static_cast<size_t>(spec.batch) * hkv * static_cast<size_t>(pb.capacity) * d;
  pb.q = random_values(spec.dtype, static_cast<size_t>(spec.batch) * n * hq * d, rng);
  pb.k = random_values(spec.dtype, cache, rng);
  pb.v = random_values(spec.dtype, cache, rng);
  const int32_t nqb = pb.query_blocks();
  const bool per_kv = spec.layout == BlockSelectionLayout::kPerKvHead;
  const int64_t lists = int64_t{spec.batch} * nqb * (per_kv ? hkv : hq);
  pb.block_ids.assign(static_cast<size_t>(lists) * spec.width, -1);
  pb.counts.assign(static_cast<size_t>(lists), 0);
  std::vector<char> attended(cache / static_cast<size_t>(d), 0);  // per (b, kv head, position)
  for (int32_t b = 0; b < spec.batch; ++b) {
    const int64_t start = pb.kv_lens[static_cast<size_t>(b)] - n;
    for (int32_t kv = 0; kv < hkv; ++kv) {
      for (int32_t i = 0; i < nqb; ++i) {
        const int64_t own = start / bs + i;
        const int64_t end = start + std::min<int64_t>(int64_t{i + 1} * bs, n);
        for (int32_t gg = 0; gg < (per_kv ? 1 : g); ++gg) {
          const int64_t list =
              per_kv ? (int64_t{b} * nqb + i) * hkv + kv : ((int64_t{b} * hkv + kv) * nqb + i) * g + gg;
          std::vector<int32_t> earlier(static_cast<size_t>(own));
          std::iota(earlier.begin(), earlier.end(), 0);
          std::shuffle(earlier.begin(), earlier.end(), rng);
          earlier.resize(std::min<size_t>(earlier.size(), static_cast<size_t>(spec.width - 1)));
          std::sort(earlier.begin(), earlier.end());
          earlier.push_back(static_cast<int32_t>(own));
          int32_t* ids = &pb.block_ids[static_cast<size_t>(list) * spec.width];
          std::copy(earlier.begin(), earlier.end(), ids);
          pb.counts[static_cast<size_t>(list)] =
              static_cast<int32_t>((static_cast<int64_t>(earlier.size()) - 1) * bs + (end - own * bs));
          for (size_t e = 0; e < earlier.size(); ++e) {
            const int64_t last = e + 1 == earlier.size() ? end : int64_t{earlier[e] + 1} * bs;
            for (int64_t p = int64_t{earlier[e]} * bs; p < last; ++p) {
              attended[(static_cast<size_t>(b) * hkv + kv) * static_cast<size_t>(pb.capacity) +
                       static_cast<size_t>(p)] = 1;
            }
          }
        }
      }
    }
  }
  const std::vector<uint8_t> nan_row = nan_values(spec.dtype, static_cast<size_t>(d));
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(spec.dtype);
  for (size_t r = 0; r < attended.size(); ++r) {
    if (attended[r]) continue;
    std::memcpy(&pb.k[r * row_bytes], nan_row.data(), row_bytes);
    std::memcpy(&pb.v[r * row_bytes], nan_row.data(), row_bytes);
  }
  pb.scale = 1.0f / std::sqrt(static_cast<float>(d));
  return pb;
}

GqaPrefillParams GqaPrefillProblem::params(const void* q_data, const void* k_data, const void* v_data,
                                           const int32_t* ids, const int32_t* count_data, const int32_t* kv_lens_data,
                                           void* o, float* lse) const {
  GqaPrefillParams p;
  p.dtype = spec.dtype;
  p.chunk.batch = spec.batch;
  p.chunk.num_tokens = spec.num_tokens;
  p.chunk.kv_len = kv_len;
  p.chunk.kv_lens = kv_lens_data;
  p.num_qo_heads = spec.num_qo_heads;
  p.num_kv_heads = spec.num_kv_heads;
  p.block_size = spec.block_size;
  p.q = q_data;
  p.k = RowView::dense(k_data, spec.num_kv_heads, capacity, spec.head_dim);
  p.v = RowView::dense(v_data, spec.num_kv_heads, capacity, spec.head_dim);
  p.scale = scale;
  p.o = o;
  p.lse = lse;
  p.selection.layout = spec.layout;
  p.selection.block_ids = ids;
  p.selection.counts = count_data;
  p.selection.width = spec.width;
  return p;
}

GqaPrefillParams GqaPrefillProblem::host_params(void* o, float* lse) const {
  return params(q.data(), k.data(), v.data(), block_ids.data(), counts.data(), kv_lens.data(), o, lse);
}

GqaPrefillReference gqa_prefill_reference(const GqaPrefillProblem& pb) {
  const GqaPrefillParams p = pb.host_params(nullptr, nullptr);
  const std::vector<std::vector<int32_t>> attended = gqa_prefill_attended(p);
  const int32_t n = pb.spec.num_tokens, hq = pb.spec.num_qo_heads, g = hq / pb.spec.num_kv_heads, d = pb.spec.head_dim;
  const std::vector<float> q = as_float(pb.spec.dtype, pb.q), k = as_float(pb.spec.dtype, pb.k),
                           v = as_float(pb.spec.dtype, pb.v);
  GqaPrefillReference ref;
  ref.out.assign(static_cast<size_t>(pb.spec.batch) * n * hq * d, 0.0);
  ref.lse.assign(static_cast<size_t>(pb.spec.batch) * n * hq, -kInf);
  for (size_t r = 0; r < attended.size(); ++r) {
    const int64_t h = static_cast<int64_t>(r) % hq, b = static_cast<int64_t>(r) / (int64_t{hq} * n);
    const int64_t base = (b * pb.spec.num_kv_heads + h / g) * pb.capacity;  // the KV head's rows
    std::vector<double> s;
    for (int32_t pos : attended[r]) {
      double dot = 0.0;
      for (int32_t i = 0; i < d; ++i)
        dot += double{q[r * d + static_cast<size_t>(i)]} * k[static_cast<size_t>((base + pos) * d + i)];
      s.push_back(dot * pb.scale);
    }
    ref.lse[r] = softmax_weighted_sum(
        s, d, [&](size_t j, int64_t i) { return double{v[static_cast<size_t>((base + attended[r][j]) * d + i)]}; },
        &ref.out[r * static_cast<size_t>(d)]);
  }
  return ref;
}

std::string compare_gqa_prefill(const GqaPrefillProblem& pb, const GqaPrefillReference& ref,
                                const std::vector<float>& out, const std::vector<float>& lse, double out_tol,
                                double lse_tol) {
  const size_t rows = ref.lse.size(), d = static_cast<size_t>(pb.spec.head_dim);
  if (out.size() != rows * d || lse.size() != rows) return "output sizes differ";
  for (size_t r = 0; r < rows; ++r) {
    const std::string where =
        "row " + std::to_string(r) + " (token " + std::to_string(r / static_cast<size_t>(pb.spec.num_qo_heads)) + "): ";
    const std::vector<float> got(out.begin() + static_cast<std::ptrdiff_t>(r * d),
                                 out.begin() + static_cast<std::ptrdiff_t>((r + 1) * d));
    const std::vector<double> want(ref.out.begin() + static_cast<std::ptrdiff_t>(r * d),
                                   ref.out.begin() + static_cast<std::ptrdiff_t>((r + 1) * d));
    const double err = relative_l2(got, want);
    if (!(err <= out_tol)) return where + "out relative L2 " + std::to_string(err) + " > " + std::to_string(out_tol);
    if (!(std::fabs(double{lse[r]} - ref.lse[r]) <= lse_tol)) {
      return where + "lse " + std::to_string(lse[r]) + " vs fp64 " + std::to_string(ref.lse[r]);
    }
  }
  return "";
}

void gqa_token_by_token_cpu(const GqaPrefillProblem& pb, std::vector<float>& out, std::vector<float>& lse) {
  const int32_t n = pb.spec.num_tokens, bs = pb.spec.block_size, d = pb.spec.head_dim;
  const int32_t hq = pb.spec.num_qo_heads, hkv = pb.spec.num_kv_heads, g = hq / hkv, nqb = pb.query_blocks();
  const bool per_kv = pb.spec.layout == BlockSelectionLayout::kPerKvHead;
  const size_t esize = dtype_size(pb.spec.dtype);
  out.assign(static_cast<size_t>(pb.spec.batch) * n * hq * d, 0.0f);
  lse.assign(static_cast<size_t>(pb.spec.batch) * n * hq, 0.0f);
  std::vector<uint8_t> o(static_cast<size_t>(hq) * d * esize);
  std::vector<float> l(static_cast<size_t>(hq));
  for (int32_t b = 0; b < pb.spec.batch; ++b) {
    const int64_t start = pb.kv_lens[static_cast<size_t>(b)] - n;
    for (int32_t t = 0; t < n; ++t) {
      const int32_t i = t / bs;
      const int64_t pos = start + t;
      // One token: requests (KV head) of g query heads, or (query head) of one.
      const int32_t requests = per_kv ? hkv : hq;
      std::vector<int32_t> indptr = {0}, lens, pages;
      for (int32_t r = 0; r < requests; ++r) {
        const int32_t kv = per_kv ? r : r / g;
        const int64_t list =
            per_kv ? (int64_t{b} * nqb + i) * hkv + kv : ((int64_t{b} * hkv + kv) * nqb + i) * g + r % g;
        const int32_t* ids = &pb.block_ids[static_cast<size_t>(list) * pb.spec.width];
        const int32_t count = pb.counts[static_cast<size_t>(list)];
        const int32_t kept = (count + bs - 1) / bs;
        // The own block is last: the token sees it up to its own position.
        const int32_t seen = static_cast<int32_t>((kept - 1) * int64_t{bs} + (pos + 1 - int64_t{ids[kept - 1]} * bs));
        pages.insert(pages.end(), ids, ids + kept);
        indptr.push_back(static_cast<int32_t>(pages.size()));
        lens.push_back(seen);
      }
      PlanShape shape;
      shape.group_size = per_kv ? g : 1;
      shape.head_dim_v = d;
      shape.num_sms = 1;
      const DecodePlan plan = make_decode_plan(lens, shape);
      std::vector<char> ws(plan.workspace.total + 256);
      DecodeParams dp;
      dp.dtype = pb.spec.dtype;
      dp.indptr = indptr.data();
      dp.indices = pages.data();
      dp.num_indices = static_cast<int64_t>(pages.size());
      dp.seq_lens = lens.data();
      dp.num_requests = requests;
      dp.num_kv_heads = requests;  // one "sequence": the token
      dp.page_size = bs;
      dp.addressing = PageAddressing::kWindow;
      dp.window_len = pos + 1;
      dp.group_size = per_kv ? g : 1;
      dp.q = pb.q.data() + (static_cast<size_t>(b) * n + static_cast<size_t>(t)) * hq * d * esize;
      const char* k0 =
          reinterpret_cast<const char*>(pb.k.data()) + static_cast<size_t>(b) * hkv * pb.capacity * d * esize;
      const char* v0 =
          reinterpret_cast<const char*>(pb.v.data()) + static_cast<size_t>(b) * hkv * pb.capacity * d * esize;
      const int64_t head_stride = per_kv ? pb.capacity * d : 0;
      dp.k = {k0, d, d, 0, head_stride, pb.capacity};
      dp.v = {v0, d, d, 0, head_stride, pb.capacity};
      dp.scale = pb.scale;
      dp.o = o.data();
      dp.lse = l.data();
      if (per_kv) {
        run_decode_cpu(dp, plan, ws.data());
      } else {
        // Per query head: each KV head's g requests over its rows, one launch per KV head.
        for (int32_t kv = 0; kv < hkv; ++kv) {
          DecodeParams one = dp;
          const std::vector<int32_t> sub_indptr(indptr.begin() + kv * g, indptr.begin() + (kv + 1) * g + 1);
          std::vector<int32_t> shifted(sub_indptr);
          for (int32_t& x : shifted) x -= sub_indptr[0];
          const std::vector<int32_t> sub_lens(lens.begin() + kv * g, lens.begin() + (kv + 1) * g);
          PlanShape one_shape = shape;
          const DecodePlan one_plan = make_decode_plan(sub_lens, one_shape);
          std::vector<char> one_ws(one_plan.workspace.total + 256);
          one.indptr = shifted.data();
          one.indices = pages.data() + sub_indptr[0];
          one.num_indices = static_cast<int64_t>(pages.size()) - sub_indptr[0];
          one.seq_lens = sub_lens.data();
          one.num_requests = g;
          one.num_kv_heads = g;
          one.q = static_cast<const uint8_t*>(dp.q) + static_cast<size_t>(kv) * g * d * esize;
          one.k.data = k0 + static_cast<size_t>(kv) * pb.capacity * d * esize;
          one.v.data = v0 + static_cast<size_t>(kv) * pb.capacity * d * esize;
          one.o = o.data() + static_cast<size_t>(kv) * g * d * esize;
          one.lse = l.data() + static_cast<size_t>(kv) * g;
          run_decode_cpu(one, one_plan, one_ws.data());
        }
      }
      const std::vector<float> of = row_floats(pb.spec.dtype, o.data(), static_cast<size_t>(hq) * d);
      const size_t row = static_cast<size_t>(b) * n + static_cast<size_t>(t);
      std::copy(of.begin(), of.end(), out.begin() + static_cast<std::ptrdiff_t>(row * hq * d));
      std::copy(l.begin(), l.end(), lse.begin() + static_cast<std::ptrdiff_t>(row * hq));
    }
  }
}

}  // namespace sparsepage::testing
