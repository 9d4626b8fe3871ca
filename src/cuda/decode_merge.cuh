// The merge (SPEC section 6): combines a request's chunk partials by their
// lse into o (input dtype) and lse, in a second kernel launched right behind
// the partial kernel with programmatic dependent launch (its CTAs are
// resident and waiting when the last partial CTA retires). A NaN partial lse
// (a rejected page) poisons the request, empty partials (lse -inf) weigh
// nothing, all empty: o = 0, lse = -inf. (Merging inside the partial kernel,
// by the last CTA of each request, was built and measured slower at every
// shape: docs/PERFORMANCE.md. Requests split in two at head dims 128/128
// merge inside a thread-block cluster instead: decode_partial_cluster.cuh.)
#pragma once

#include "cuda/common.cuh"

namespace sparsepage {
namespace cuda {

constexpr int kMergeThreads = 64;  // one float4 of one head per thread

struct MergeParams {
  const float* partial_o = nullptr;       // [num_partials, group_size, partial_dv]
  const float* partial_lse = nullptr;     // [num_partials, group_size]
  const int32_t* merge_indptr = nullptr;  // [num_merge + 1] slots, or null: uniform
  const int32_t* merge_requests = nullptr;  // [num_merge] requests, or null: uniform
  int32_t chunks_per_request = 1;         // uniform: merge i owns slots [i * c, (i + 1) * c)
  int32_t group_size = 1;                 // query rows per request: heads x q_len tokens
  int32_t heads = 0;                      // query heads per request (decode.h's group_size); 0: group_size
  int32_t q_len = 1;                      // query tokens per request; row i = token i / heads
  int64_t o_tok = 0;                      // o's elements between a sequence's tokens (q_len > 1)
  int32_t dv = 0;
  int32_t partial_dv = 0;
  // o's strides (decode.h's QueryStrides): head g of request r at
  // (r / num_kv_heads) * o_seq + ((r % num_kv_heads) * group_size + g) * o_head.
  int32_t num_kv_heads = 1;
  int64_t o_seq = 0, o_head = 0;
  void* o = nullptr;
  float* lse = nullptr;                   // [num_sequences, q_len, num_kv_heads, heads] or null
};

/// Grid: (merged requests, ceil(group_size * dv / 4 / kMergeThreads)).
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const __grid_constant__ MergeParams p) {
  pdl_wait_primary();  // partials are complete and visible past this point
  const int i = blockIdx.x;
  int32_t begin, end, request;
  if (p.merge_indptr != nullptr) {
    begin = p.merge_indptr[i];
    end = p.merge_indptr[i + 1];
    request = p.merge_requests[i];
  } else {
    begin = i * p.chunks_per_request;
    end = begin + p.chunks_per_request;
    request = i;
  }
  const int d4 = p.dv / 4;
  const int idx = blockIdx.y * kMergeThreads + threadIdx.x;
  if (idx >= p.group_size * d4) return;
  const int head = idx / d4, col = (idx % d4) * 4;

  // Largest lse; a NaN partial (rejected page) poisons the request, since
  // fmaxf alone would silently drop it.
  // Both passes are unrolled so that their loads (independent of each other)
  // are in flight together: at batch 1 a request has tens of partials and a
  // serial chain of L2 round trips would dominate the merge.
  float mx = neg_inf_f32();
  bool nan = false;
#pragma unroll 8
  for (int s = begin; s < end; ++s) {
    const float x = p.partial_lse[int64_t{s} * p.group_size + head];
    nan |= isnan(x);
    mx = fmaxf(mx, x);
  }
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  if (mx != neg_inf_f32()) {  // otherwise every partial is empty: o = 0, lse = -inf
#pragma unroll 8
    for (int s = begin; s < end; ++s) {
      const float x = p.partial_lse[int64_t{s} * p.group_size + head];
      const float w = __expf(x - mx);  // an empty partial (-inf) weighs 0
      const float4 po = *reinterpret_cast<const float4*>(
          p.partial_o + (int64_t{s} * p.group_size + head) * p.partial_dv + col);
      sum += w;
      o.x += w * po.x, o.y += w * po.y, o.z += w * po.z, o.w += w * po.w;
    }
    const float inv = 1.f / sum;
    o = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
  }
  float lse = mx == neg_inf_f32() ? mx : mx + __logf(sum);
  if (nan) {
    o = make_float4(nan_f32(), nan_f32(), nan_f32(), nan_f32());
    lse = nan_f32();
  }
  const int32_t seq = request / p.num_kv_heads, kv_head = request - seq * p.num_kv_heads;
  const int32_t heads = p.heads > 0 ? p.heads : p.group_size;
  const int32_t token = p.q_len == 1 ? 0 : head / heads, g = head - token * heads;  // one token: row = head
  const int64_t out_row = ((int64_t{seq} * p.q_len + token) * p.num_kv_heads + kv_head) * heads + g;
  T* dst = static_cast<T*>(p.o) + seq * p.o_seq + int64_t{token} * p.o_tok +
           (int64_t{kv_head} * heads + g) * p.o_head + col;
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(ElemTraits<T>::pack2(o.x, o.y), ElemTraits<T>::pack2(o.z, o.w));
  if (col == 0 && p.lse != nullptr) p.lse[out_row] = lse;
}

/// Launches the merge behind the preceding kernel on `stream` with
/// programmatic stream serialization (capturable in a CUDA graph).
template <typename T>
void launch_merge(const MergeParams& params, int32_t num_merge, cudaStream_t stream) {
  if (num_merge == 0) return;
  const int outputs = params.group_size * (params.dv / 4);
  const dim3 grid(static_cast<unsigned>(num_merge), static_cast<unsigned>((outputs + kMergeThreads - 1) / kMergeThreads));
  launch_with_pdl(merge_kernel<T>, grid, dim3(kMergeThreads), 0, stream, params);
}

}  // namespace cuda
}  // namespace sparsepage
