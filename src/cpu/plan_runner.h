// Runs a decode plan on the CPU for any way of finding a request's rows:
// work items in parallel (partials or direct output), then the lse merge.
// The paged decode and the dense paths differ only in `RowsOf` and `BiasOf`.
#pragma once

#include <algorithm>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/parallel.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/query_strides.h"
#include "sparsepage/plan.h"

namespace sparsepage::cpu {

/// Per-launch constants of a CPU decode. q, q_extra and o are addressed by
/// `strides` (decode.h's QueryStrides): head g of token t of request r at
/// (r / num_kv_heads) * seq_stride + t * token_stride +
/// ((r % num_kv_heads) * group_size + g) * head_stride. A request's query
/// rows are its q_len tokens x group_size heads, row i = t * group_size + g.
struct PlanOutputs {
  DType dtype;
  int32_t group_size;
  int32_t dim_qk, dim_v, dim_extra;  // dim_extra 0 without a second stream
  int32_t num_kv_heads;
  const void* q;        // dim_qk per head
  const void* q_extra;  // dim_extra per head, or null
  float scale;
  void* o;     // dim_v per head
  float* lse;  // [num_sequences, q_len, num_kv_heads, group_size] (packed) or null
  QoStrides strides;
  int32_t q_len = 1;  // query tokens per request
  int32_t rows() const { return group_size * q_len; }
  KvFormat kv_format = KvFormat::kNative;  // how K and V rows are stored
  const float* k_scale = nullptr;          // kE4m3PerHead: [num_kv_heads]
  const float* v_scale = nullptr;
};

/// The strides of packed [num_requests, group_size, dim] q, q_extra and o.
inline QoStrides packed_qo_strides(int32_t num_kv_heads, int32_t group_size, int32_t dim_qk, int32_t dim_extra,
                                   int32_t dim_v) {
  const int64_t heads = int64_t{num_kv_heads} * group_size;
  return {{heads * dim_qk, dim_qk}, {heads * dim_extra, dim_extra}, {heads * dim_v, dim_v}};
}

/// Element offset of query row i (token i / group_size, head i % group_size)
/// of request r in a view with strides `s`.
inline int64_t head_offset(const PlanOutputs& out, const QueryStrides& s, int32_t r, int32_t i) {
  const int32_t t = i / out.group_size, g = i % out.group_size;
  return int64_t{r / out.num_kv_heads} * s.seq_stride + (t > 0 ? int64_t{t} * s.token_stride : 0) +
         (int64_t{r % out.num_kv_heads} * out.group_size + g) * s.head_stride;
}

/// Where query row i of request r keeps its lse: [num_sequences, q_len,
/// num_kv_heads, group_size] (for q_len = 1, r * group_size + i).
inline int64_t lse_offset(const PlanOutputs& out, int32_t r, int32_t i) {
  const int32_t t = i / out.group_size, g = i % out.group_size;
  const int64_t seq = r / out.num_kv_heads;
  return ((seq * out.q_len + t) * out.num_kv_heads + r % out.num_kv_heads) * out.group_size + g;
}

/// Request r's `dim`-wide query rows of a q-shaped view, as fp32 [q_len * group_size, dim].
inline std::vector<float> load_heads(const PlanOutputs& out, const void* src, const QueryStrides& s, int32_t r,
                                     int32_t dim) {
  std::vector<float> rows(static_cast<size_t>(out.rows()) * dim);
  const size_t esize = dtype_size(out.dtype);
  for (int32_t g = 0; g < out.rows(); ++g) {
    to_float(out.dtype, static_cast<const char*>(src) + static_cast<size_t>(head_offset(out, s, r, g)) * esize,
             rows.data() + static_cast<size_t>(g) * dim, static_cast<size_t>(dim));
  }
  return rows;
}

/// `rows_of(r)` returns a callable token -> TokenRows for request r;
/// `bias_of(r)` a callable token -> additive mask term, or (token, query
/// row) -> term where rows differ (a multi-token step's causal limit);
/// `visible(r)` the
/// tokens request r sees now (work items past it are clipped: the plan may
/// have been made for more, as the CUDA backend allows).
template <typename RowsOf, typename BiasOf, typename Visible>
void run_plan(const DecodePlan& plan, const PlanOutputs& out, void* workspace, RowsOf&& rows_of, BiasOf&& bias_of,
              Visible&& visible) {
  const size_t esize = dtype_size(out.dtype);
  const size_t g_count = static_cast<size_t>(out.rows());
  const size_t dv = static_cast<size_t>(out.dim_v);
  const size_t de = static_cast<size_t>(out.dim_extra);
  auto* base = static_cast<char*>(workspace);
  auto* partial_o = reinterpret_cast<float*>(base + plan.workspace.partial_o);
  auto* partial_lse = reinterpret_cast<float*>(base + plan.workspace.partial_lse);
  auto write_output = [&](int32_t r, const float* o, const float* lse) {
    for (int32_t g = 0; g < out.rows(); ++g) {
      const auto offset = static_cast<size_t>(head_offset(out, out.strides.o, r, g));
      from_float(out.dtype, o + static_cast<size_t>(g) * dv, static_cast<char*>(out.o) + offset * esize, dv);
      if (out.lse) out.lse[lse_offset(out, r, g)] = lse[g];
    }
  };

  parallel_for(static_cast<int64_t>(plan.work.size()), [&](int64_t index) {
    const WorkItem& item = plan.work[static_cast<size_t>(index)];
    const std::vector<float> q = load_heads(out, out.q, out.strides.q, item.request, out.dim_qk);
    std::vector<float> q_extra;
    if (de > 0) q_extra = load_heads(out, out.q_extra, out.strides.q_extra, item.request, out.dim_extra);
    ChunkQuery query{
        out.dtype, out.rows(), out.dim_qk, out.dim_v, out.dim_extra, q.data(), de > 0 ? q_extra.data() : nullptr,
        out.scale};
    query.kv_format = out.kv_format;
    if (out.kv_format == KvFormat::kE4m3PerHead) {
      const int32_t head = item.request % out.num_kv_heads;
      query.k_scale = out.k_scale[head];
      query.v_scale = out.v_scale[head];
    }
    const int64_t end = std::min<int64_t>(item.token_end, visible(item.request));
    const ChunkState state = attend_chunk(query, item.token_begin, std::max<int64_t>(end, item.token_begin),
                                          rows_of(item.request), bias_of(item.request));
    if (item.partial < 0) {
      write_output(item.request, state.o.data(), state.lse.data());
    } else {
      const size_t slot = static_cast<size_t>(item.partial) * g_count;
      std::copy(state.o.begin(), state.o.end(), partial_o + slot * dv);
      std::copy(state.lse.begin(), state.lse.end(), partial_lse + slot);
    }
  });

  parallel_for(static_cast<int64_t>(plan.merge_requests.size()), [&](int64_t m) {
    std::vector<const float*> o_parts, lse_parts;
    for (int32_t s = plan.merge_indptr[static_cast<size_t>(m)]; s < plan.merge_indptr[static_cast<size_t>(m) + 1];
         ++s) {
      o_parts.push_back(partial_o + static_cast<size_t>(s) * g_count * dv);
      lse_parts.push_back(partial_lse + static_cast<size_t>(s) * g_count);
    }
    std::vector<float> o(g_count * dv), lse(g_count);
    merge_states(o_parts, lse_parts, out.rows(), out.dim_v, o.data(), lse.data());
    write_output(plan.merge_requests[static_cast<size_t>(m)], o.data(), lse.data());
  });
}

}  // namespace sparsepage::cpu
