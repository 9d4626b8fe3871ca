// Runs a decode plan on the CPU for any way of finding a request's rows:
// work items in parallel (partials or direct output), then the lse merge.
// The paged decode and the dense paths differ only in `RowsOf` and `BiasOf`.
#pragma once

#include <algorithm>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/parallel.h"
#include "sparsepage/plan.h"

namespace sparsepage::cpu {

/// Per-launch constants of a CPU decode.
struct PlanOutputs {
  DType dtype;
  int32_t group_size;
  int32_t dim_qk, dim_v, dim_extra;  // dim_extra 0 without a second stream
  const void* q;                     // [num_requests, group_size, dim_qk]
  const void* q_extra;               // [num_requests, group_size, dim_extra] or null
  float scale;
  void* o;                           // [num_requests, group_size, dim_v]
  float* lse;                        // [num_requests, group_size] or null
};

inline std::vector<float> load_as_float(DType dtype, const void* src, size_t offset_elems, size_t count) {
  std::vector<float> out(count);
  to_float(dtype, static_cast<const char*>(src) + offset_elems * dtype_size(dtype), out.data(), count);
  return out;
}

/// `rows_of(r)` returns a callable token -> TokenRows for request r;
/// `bias_of(r)` a callable token -> additive mask term; `visible(r)` the
/// tokens request r sees now (work items past it are clipped: the plan may
/// have been made for more, as the CUDA backend allows).
template <typename RowsOf, typename BiasOf, typename Visible>
void run_plan(const DecodePlan& plan, const PlanOutputs& out, void* workspace, RowsOf&& rows_of, BiasOf&& bias_of,
              Visible&& visible) {
  const size_t esize = dtype_size(out.dtype);
  const size_t g_count = static_cast<size_t>(out.group_size);
  const size_t dk = static_cast<size_t>(out.dim_qk), dv = static_cast<size_t>(out.dim_v);
  const size_t de = static_cast<size_t>(out.dim_extra);
  auto* base = static_cast<char*>(workspace);
  auto* partial_o = reinterpret_cast<float*>(base + plan.workspace.partial_o);
  auto* partial_lse = reinterpret_cast<float*>(base + plan.workspace.partial_lse);
  auto write_output = [&](int32_t r, const float* o, const float* lse) {
    const size_t row = static_cast<size_t>(r) * g_count;
    from_float(out.dtype, o, static_cast<char*>(out.o) + row * dv * esize, g_count * dv);
    if (out.lse) std::copy(lse, lse + g_count, out.lse + row);
  };

  parallel_for(static_cast<int64_t>(plan.work.size()), [&](int64_t index) {
    const WorkItem& item = plan.work[static_cast<size_t>(index)];
    const size_t row = static_cast<size_t>(item.request) * g_count;
    const std::vector<float> q = load_as_float(out.dtype, out.q, row * dk, g_count * dk);
    std::vector<float> q_extra;
    if (de > 0) q_extra = load_as_float(out.dtype, out.q_extra, row * de, g_count * de);
    const ChunkQuery query{out.dtype,  out.group_size, out.dim_qk, out.dim_v, out.dim_extra, q.data(),
                           de > 0 ? q_extra.data() : nullptr, out.scale};
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
    merge_states(o_parts, lse_parts, out.group_size, out.dim_v, o.data(), lse.data());
    write_output(plan.merge_requests[static_cast<size_t>(m)], o.data(), lse.data());
  });
}

}  // namespace sparsepage::cpu
