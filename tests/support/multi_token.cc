#include "support/multi_token.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "sparsepage/cache.h"
#include "sparsepage/memory.h"
#include "sparsepage/page_table.h"
#include "sparsepage/plan.h"
#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

PlanShape plan_shape(Device device, int32_t rows, int32_t head_dim_v, int32_t fixed_chunk_tokens) {
  PlanShape shape;
  shape.group_size = rows;
  shape.head_dim_v = head_dim_v;
  shape.num_sms = device == Device::kCuda ? cuda_multiprocessor_count() : 4;
  shape.min_chunk_tokens = 64;
  shape.fixed_chunk_tokens = fixed_chunk_tokens;
  if (device == Device::kCuda) shape.ctas_per_item = (rows + 15) / 16;
  return shape;
}

// Runs one planned decode on `device` and returns o (as float) and lse.
MultiTokenResult run_planned(const DecodeParams& params, const std::vector<int32_t>& counts, Device device,
                             int32_t fixed_chunk_tokens, Buffer& o, Buffer& lse, size_t o_elems, size_t lse_elems) {
  const DecodePlan plan =
      make_decode_plan(counts, plan_shape(device, params.group_size * params.q_len, params.v.dim, fixed_chunk_tokens));
  Buffer workspace(device, std::max<size_t>(plan.workspace.total, 256));
  MultiTokenResult result;
  if (device == Device::kCuda) {
    upload_plan_cuda(plan, workspace.data());
    result.kernel = run_decode_cuda(params, plan, workspace.data());
    if (read_decode_error_flag(plan, workspace.data()) != 0) throw Error("multi-token test: the error flag is set");
  } else {
    run_decode_cpu(params, plan, workspace.data());
  }
  const auto o_bytes = download<uint8_t>(device, o.data(), o_elems * dtype_size(params.dtype));
  result.o = as_float(params.dtype, o_bytes);
  result.lse = download<float>(device, lse.data(), lse_elems);
  return result;
}

}  // namespace

std::vector<int64_t> MultiTokenProblem::positions(int32_t r) const {
  std::vector<int64_t> out;
  const int32_t p = spec.page_size;
  for (int32_t t = 0; t < seq_lens[static_cast<size_t>(r)]; ++t) {
    out.push_back(int64_t{pages[static_cast<size_t>(indptr[static_cast<size_t>(r)] + t / p)]} * p + t % p);
  }
  return out;
}

DecodeParams MultiTokenProblem::params(const void* k_data, const void* v_data, const void* q_data,
                                       const int32_t* indptr_data, const int32_t* pages_data,
                                       const int32_t* seq_lens_data, const int32_t* live_lens_data, void* o,
                                       float* lse) const {
  DecodeParams p;
  p.dtype = spec.dtype;
  p.indptr = indptr_data;
  p.indices = pages_data;
  p.num_indices = static_cast<int64_t>(pages.size());
  p.seq_lens = seq_lens_data;
  p.num_requests = num_requests();
  p.num_kv_heads = spec.num_kv_heads;
  p.page_size = spec.page_size;
  p.addressing = PageAddressing::kWindow;
  p.window_lens = live_lens_data;
  p.window_len = *std::max_element(spec.live_lens.begin(), spec.live_lens.end());
  p.group_size = spec.group_size;
  p.q_len = spec.q_len;
  p.q = q_data;
  p.k = RowView::dense(k_data, spec.num_kv_heads, capacity, spec.head_dim);
  p.v = RowView::dense(v_data, spec.num_kv_heads, capacity, spec.head_dim);
  p.scale = 1.0f / std::sqrt(static_cast<float>(spec.head_dim));
  p.o = o;
  p.lse = lse;
  return p;
}

MultiTokenProblem make_multi_token_problem(const MultiTokenSpec& spec) {
  MultiTokenProblem pb;
  pb.spec = spec;
  pb.batch = static_cast<int32_t>(spec.live_lens.size());
  const int32_t max_len = *std::max_element(spec.live_lens.begin(), spec.live_lens.end());
  pb.capacity = spec.capacity > 0 ? spec.capacity : max_len + 8;
  std::mt19937_64 rng(spec.seed);
  const int32_t ps = spec.page_size, width = spec.pages_per_request;
  const size_t d = static_cast<size_t>(spec.head_dim);
  const size_t rows = static_cast<size_t>(pb.batch) * spec.num_kv_heads * static_cast<size_t>(pb.capacity);
  pb.k = nan_values(spec.dtype, rows * d);
  pb.v = nan_values(spec.dtype, rows * d);
  pb.q = random_values(spec.dtype,
                       static_cast<size_t>(pb.batch) * spec.q_len * static_cast<size_t>(pb.num_qo_heads()) * d, rng);
  const size_t esize = dtype_size(spec.dtype);
  for (int32_t r = 0; r < pb.num_requests(); ++r) {
    const int32_t live = spec.live_lens[static_cast<size_t>(r / spec.num_kv_heads)];
    const int32_t final_page = (live - 1) / ps;
    // The final page, the page of the first new token (the causal limit
    // cuts it for the earlier tokens) and random others, distinct.
    std::vector<int32_t> chosen = {final_page};
    const int32_t first_new = (live - spec.q_len) / ps;
    if (first_new != final_page && width > 1) chosen.insert(chosen.begin(), first_new);
    std::vector<int32_t> others;
    for (int32_t page = 0; page < final_page; ++page) {
      if (page != first_new) others.push_back(page);
    }
    std::shuffle(others.begin(), others.end(), rng);
    for (int32_t page : others) {
      if (static_cast<int32_t>(chosen.size()) >= width) break;
      chosen.insert(chosen.begin(), page);
    }
    std::shuffle(chosen.begin(), chosen.end() - 1, rng);  // any order; the partial final page last
    pb.indptr.push_back(static_cast<int32_t>(pb.pages.size()));
    for (int32_t i = 0; i < width; ++i) {
      pb.pages.push_back(i < static_cast<int32_t>(chosen.size()) ? chosen[static_cast<size_t>(i)] : 0);
    }
    pb.seq_lens.push_back(static_cast<int32_t>(chosen.size() - 1) * ps + (live - final_page * ps));
  }
  pb.indptr.push_back(static_cast<int32_t>(pb.pages.size()));
  // Only the selected positions of each window get values.
  for (int32_t r = 0; r < pb.num_requests(); ++r) {
    for (int64_t pos : pb.positions(r)) {
      const size_t row = static_cast<size_t>(r) * static_cast<size_t>(pb.capacity) + static_cast<size_t>(pos);
      const auto kv = random_values(spec.dtype, 2 * d, rng);
      std::copy(kv.begin(), kv.begin() + static_cast<std::ptrdiff_t>(d * esize),
                pb.k.begin() + static_cast<std::ptrdiff_t>(row * d * esize));
      std::copy(kv.begin() + static_cast<std::ptrdiff_t>(d * esize), kv.end(),
                pb.v.begin() + static_cast<std::ptrdiff_t>(row * d * esize));
    }
  }
  return pb;
}

MultiTokenReference multi_token_reference(const MultiTokenProblem& pb) {
  const auto& s = pb.spec;
  const std::vector<float> q = as_float(s.dtype, pb.q), k = as_float(s.dtype, pb.k), v = as_float(s.dtype, pb.v);
  const size_t d = static_cast<size_t>(s.head_dim), hq = static_cast<size_t>(pb.num_qo_heads());
  MultiTokenReference ref;
  ref.o.assign(static_cast<size_t>(pb.batch) * s.q_len * hq * d, 0.0);
  ref.lse.assign(static_cast<size_t>(pb.batch) * s.q_len * hq, -std::numeric_limits<double>::infinity());
  const double scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  for (int32_t r = 0; r < pb.num_requests(); ++r) {
    const int32_t b = r / s.num_kv_heads, h = r % s.num_kv_heads;
    const int64_t live = s.live_lens[static_cast<size_t>(b)];
    const std::vector<int64_t> positions = pb.positions(r);
    for (int32_t t = 0; t < s.q_len; ++t) {
      const int64_t limit = live - (s.q_len - 1 - t);
      for (int32_t g = 0; g < s.group_size; ++g) {
        const size_t qrow = (static_cast<size_t>(b) * s.q_len + t) * hq + static_cast<size_t>(h) * s.group_size + g;
        std::vector<double> scores;
        std::vector<size_t> rows;
        for (int64_t pos : positions) {
          if (pos >= limit) continue;
          const size_t row = static_cast<size_t>(r) * static_cast<size_t>(pb.capacity) + static_cast<size_t>(pos);
          double dot = 0.0;
          for (size_t i = 0; i < d; ++i) dot += double{q[qrow * d + i]} * k[row * d + i];
          scores.push_back(dot * scale);
          rows.push_back(row);
        }
        ref.lse[qrow] = softmax_weighted_sum(
            scores, static_cast<int64_t>(d), [&](size_t j, int64_t i) { return double{v[rows[j] * d + i]}; },
            &ref.o[qrow * d]);
      }
    }
  }
  return ref;
}

MultiTokenResult run_multi_token(const MultiTokenProblem& pb, Device device, int32_t fixed_chunk_tokens) {
  const auto& s = pb.spec;
  Buffer k = upload(device, pb.k), v = upload(device, pb.v), q = upload(device, pb.q);
  Buffer indptr = upload(device, pb.indptr), pages = upload(device, pb.pages), lens = upload(device, pb.seq_lens);
  Buffer live = upload(device, s.live_lens);
  const size_t rows = static_cast<size_t>(pb.batch) * s.q_len * static_cast<size_t>(pb.num_qo_heads());
  const size_t o_elems = rows * static_cast<size_t>(s.head_dim);
  Buffer o = upload(device, nan_values(s.dtype, o_elems));
  Buffer lse = upload(device, std::vector<float>(rows, kNaN));
  const DecodeParams p = pb.params(k.data(), v.data(), q.data(), indptr.as<int32_t>(), pages.as<int32_t>(),
                                   lens.as<int32_t>(), live.as<int32_t>(), o.data(), lse.as<float>());
  return run_planned(p, pb.seq_lens, device, fixed_chunk_tokens, o, lse, o_elems, rows);
}

MultiTokenResult run_as_single_tokens(const MultiTokenProblem& pb, Device device) {
  const auto& s = pb.spec;
  const int32_t hq = pb.num_qo_heads(), d = s.head_dim;
  Buffer k = upload(device, pb.k), v = upload(device, pb.v), q = upload(device, pb.q);
  const size_t rows = static_cast<size_t>(pb.batch) * s.q_len * static_cast<size_t>(hq);
  const size_t o_elems = rows * static_cast<size_t>(d);
  Buffer o = upload(device, nan_values(s.dtype, o_elems));
  MultiTokenResult all;
  all.lse.assign(rows, kNaN);
  const size_t esize = dtype_size(s.dtype);
  for (int32_t t = 0; t < s.q_len; ++t) {
    std::vector<int32_t> live(s.live_lens.size()), counts, positions, indptr = {0};
    for (size_t b = 0; b < live.size(); ++b) live[b] = s.live_lens[b] - (s.q_len - 1 - t);
    for (int32_t r = 0; r < pb.num_requests(); ++r) {
      int32_t count = 0;
      for (int64_t pos : pb.positions(r)) {
        if (pos >= live[static_cast<size_t>(r / s.num_kv_heads)]) continue;
        positions.push_back(static_cast<int32_t>(pos));
        ++count;
      }
      counts.push_back(count);
      indptr.push_back(indptr.back() + count);
    }
    if (positions.empty()) positions.push_back(0);
    Buffer ids = upload(device, positions), ptr = upload(device, indptr), lens = upload(device, counts);
    Buffer live_d = upload(device, live);
    Buffer lse = upload(device, std::vector<float>(static_cast<size_t>(pb.num_requests()) * s.group_size, kNaN));
    // Token t's rows of q and o: [batch, hq, d] views with the sequence stride of all q_len tokens.
    const size_t token_offset = static_cast<size_t>(t) * hq * d * esize;
    DecodeParams p = pb.params(k.data(), v.data(), static_cast<const char*>(q.data()) + token_offset, ptr.as<int32_t>(),
                               ids.as<int32_t>(), lens.as<int32_t>(), live_d.as<int32_t>(),
                               static_cast<char*>(o.data()) + token_offset, lse.as<float>());
    p.q_len = 1;
    p.page_size = 1;
    p.num_indices = static_cast<int64_t>(positions.size());
    p.qo_layout = QueryLayout::kStrided;
    p.q_strides = {int64_t{s.q_len} * hq * d, d};
    p.o_strides = p.q_strides;
    const DecodePlan plan = make_decode_plan(counts, plan_shape(device, s.group_size, d, 0));
    Buffer workspace(device, std::max<size_t>(plan.workspace.total, 256));
    if (device == Device::kCuda) {
      upload_plan_cuda(plan, workspace.data());
      run_decode_cuda(p, plan, workspace.data());
      if (read_decode_error_flag(plan, workspace.data()) != 0) throw Error("single-token step: the error flag is set");
    } else {
      run_decode_cpu(p, plan, workspace.data());
    }
    const auto token_lse = download<float>(device, lse.data(), static_cast<size_t>(pb.num_requests()) * s.group_size);
    for (int32_t b = 0; b < pb.batch; ++b) {
      for (int32_t h = 0; h < hq; ++h) {
        all.lse[(static_cast<size_t>(b) * s.q_len + t) * hq + h] = token_lse[static_cast<size_t>(b) * hq + h];
      }
    }
  }
  all.o = as_float(s.dtype, download<uint8_t>(device, o.data(), o_elems * esize));
  return all;
}

std::string compare_multi_token(const MultiTokenProblem& pb, const std::vector<float>& o, const std::vector<float>& lse,
                                const std::vector<double>& ref_o, const std::vector<double>& ref_lse, double o_tol,
                                double lse_tol) {
  const auto& s = pb.spec;
  const size_t hq = static_cast<size_t>(pb.num_qo_heads()), d = static_cast<size_t>(s.head_dim);
  const size_t rows = static_cast<size_t>(pb.batch) * s.q_len * hq;
  if (o.size() != rows * d || lse.size() != rows || ref_o.size() != o.size() || ref_lse.size() != rows)
    return "output sizes differ";
  for (size_t i = 0; i < rows; ++i) {
    const std::string where = "sequence " + std::to_string(i / hq / s.q_len) + " token " +
                              std::to_string(i / hq % s.q_len) + " head " + std::to_string(i % hq) + ": ";
    const std::vector<float> got(o.begin() + static_cast<std::ptrdiff_t>(i * d),
                                 o.begin() + static_cast<std::ptrdiff_t>((i + 1) * d));
    const std::vector<double> want(ref_o.begin() + static_cast<std::ptrdiff_t>(i * d),
                                   ref_o.begin() + static_cast<std::ptrdiff_t>((i + 1) * d));
    const double err = relative_l2(got, want);
    if (!(err <= o_tol)) return where + "o relative L2 " + std::to_string(err) + " > " + std::to_string(o_tol);
    if (std::isinf(ref_lse[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0)) return where + "lse " + std::to_string(lse[i]) + ", expected -inf";
      continue;
    }
    const double lse_err = std::fabs(double{lse[i]} - ref_lse[i]);
    if (!(lse_err <= lse_tol)) return where + "lse " + std::to_string(lse[i]) + " vs " + std::to_string(ref_lse[i]);
  }
  return "";
}

std::string step_append_mismatch(Device device, int32_t k_dim, int32_t v_dim) {
  constexpr int32_t kBatch = 3, kKHeads = 3, kVHeads = 2, kPrompt = 5;
  const std::vector<int32_t> steps = {3, 1, 4};
  std::mt19937_64 rng(77);
  DenseKVCache stepped(device, CacheMode::kBF16, kBatch, kKHeads, kVHeads, k_dim, v_dim, 16);
  DenseKVCache single(device, CacheMode::kBF16, kBatch, kKHeads, kVHeads, k_dim, v_dim, 16);
  const auto k_prompt = random_values(DType::kBF16, size_t{kBatch} * kKHeads * kPrompt * k_dim, rng);
  const auto v_prompt = random_values(DType::kBF16, size_t{kBatch} * kVHeads * kPrompt * v_dim, rng);
  const Buffer kp = upload(device, k_prompt), vp = upload(device, v_prompt);
  int64_t total = kPrompt;
  for (int32_t n : steps) total += n;
  for (DenseKVCache* c : {&stepped, &single}) {
    c->append(kp.data(), vp.data(), DType::kBF16, kPrompt);
    c->reserve(total);
  }
  const size_t k_row = static_cast<size_t>(k_dim) * 2, v_row = static_cast<size_t>(v_dim) * 2;  // bytes
  const size_t k_slice = size_t{kBatch} * kKHeads * k_row, v_slice = size_t{kBatch} * kVHeads * v_row;
  std::vector<std::vector<uint8_t>> k_steps, v_steps;
  for (int32_t n : steps) {
    // [n, batch, heads, 1, dim]: token i's slice is what append_token takes.
    k_steps.push_back(random_values(DType::kBF16, size_t(n) * kBatch * kKHeads * k_dim, rng));
    v_steps.push_back(random_values(DType::kBF16, size_t(n) * kBatch * kVHeads * v_dim, rng));
    const Buffer kd = upload(device, k_steps.back()), vd = upload(device, v_steps.back());
    stepped.append_step_tokens(kd.data(), vd.data(), n, nullptr);
    for (int32_t i = 0; i < n; ++i) {
      single.append_token(static_cast<const char*>(kd.data()) + size_t(i) * k_slice,
                          static_cast<const char*>(vd.data()) + size_t(i) * v_slice, nullptr);
    }
  }
  if (stepped.live_len() != total || single.live_len() != total) {
    return "live_len " + std::to_string(stepped.live_len()) + " (stepped) / " + std::to_string(single.live_len()) +
           " (single), expected " + std::to_string(total);
  }
  const auto lens = download<int32_t>(device, stepped.device_live_lens(), kBatch);
  for (int32_t len : lens) {
    if (len != total) return "device live length " + std::to_string(len) + ", expected " + std::to_string(total);
  }
  for (bool key : {true, false}) {
    const std::vector<float> a = cache_window(stepped, key), one = cache_window(single, key);
    if (a.size() != one.size() || std::memcmp(a.data(), one.data(), a.size() * sizeof(float)) != 0) {
      return std::string(key ? "K" : "V") + " window differs from the single-token appends";
    }
    // Every step's token i of (sequence b, head h) at row (its step's start) + i.
    const int32_t heads = key ? kKHeads : kVHeads, dim = key ? k_dim : v_dim;
    int64_t start = kPrompt;
    for (size_t u = 0; u < steps.size(); ++u) {
      const std::vector<float> src = as_float(DType::kBF16, key ? k_steps[u] : v_steps[u]);
      for (int32_t i = 0; i < steps[u]; ++i) {
        for (int32_t b = 0; b < kBatch; ++b) {
          for (int32_t h = 0; h < heads; ++h) {
            for (int32_t d = 0; d < dim; ++d) {
              const float want = src[((size_t(i) * kBatch + b) * heads + h) * dim + d];
              const float got = a[((size_t(b) * heads + h) * size_t(total) + size_t(start + i)) * dim + d];
              if (std::memcmp(&want, &got, sizeof(float)) != 0) {
                return std::string(key ? "K" : "V") + " row of step " + std::to_string(u) + " token " +
                       std::to_string(i) + " sequence " + std::to_string(b) + " head " + std::to_string(h) +
                       " is not the token's input";
              }
            }
          }
        }
      }
      start += steps[u];
    }
  }
  return "";
}

}  // namespace sparsepage::testing
