// The merge (SPEC section 6): combines a request's chunk partials by their
// lse into o (input dtype) and lse. Two ways to run it:
//   merge_kernel      a second kernel, launched right behind the partial
//                     kernel with programmatic dependent launch (its CTAs
//                     are resident and waiting when the last partial CTA
//                     retires); the MLA kernel and the mask path use it;
//   merge_in_place    called by the last CTA of a split request inside the
//                     mma.sync partial kernel (decode_partial_body.cuh), which
//                     finds out it is last from an arrival counter in the
//                     workspace; no second launch and no grid-wide wait.
// Both follow the same rules: a NaN partial lse (a rejected page) poisons the
// request, empty partials (lse -inf) weigh nothing, all empty: o = 0, lse = -inf.
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
  int32_t group_size = 1;
  int32_t dv = 0;
  int32_t partial_dv = 0;
  // o's strides (decode.h's QueryStrides): head g of request r at
  // (r / num_kv_heads) * o_seq + ((r % num_kv_heads) * group_size + g) * o_head.
  int32_t num_kv_heads = 1;
  int64_t o_seq = 0, o_head = 0;
  void* o = nullptr;
  float* lse = nullptr;                   // [num_requests, group_size] or null
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
  const int64_t out_row = int64_t{request} * p.group_size + head;
  const int32_t seq = request / p.num_kv_heads;
  T* dst = static_cast<T*>(p.o) + seq * p.o_seq +
           (int64_t{request - seq * p.num_kv_heads} * p.group_size + head) * p.o_head + col;
  *reinterpret_cast<uint2*>(dst) =
      make_uint2(ElemTraits<T>::pack2(o.x, o.y), ElemTraits<T>::pack2(o.z, o.w));
  if (col == 0 && p.lse != nullptr) p.lse[out_row] = lse;
}

/// Shared floats merge_in_place needs for `slots` partials of `group_size`
/// heads (the caller lends it freed stage memory and checks this on the host).
constexpr int64_t merge_in_place_floats(int64_t slots, int64_t group_size) { return (slots + 1) * group_size; }

/// One request's merge by a whole CTA of `threads` threads (tid = its
/// thread), over partial slots [begin, end) of `group_size` heads, with
/// merge_in_place_floats() floats of shared `scratch`. Partials written by
/// other CTAs of the running grid are read through L2 (ld.cg), never from a
/// stale L1 line; the caller has acquired the last arrival. Three phases, two
/// of them global round trips at most a few deep:
///   1. every thread loads its share of the [slots x heads] lse at once;
///   2. one warp per head reduces its column in shared memory (max, NaN,
///      sum) and turns it into weights exp(lse - max) / sum;
///   3. each thread owns up to kOuts float4 outputs and sweeps the slots with
///      all its loads independent of each other.
template <typename T, int kThreadsN>
__device__ void merge_in_place(const float* partial_o, const float* partial_lse, int32_t begin, int32_t end,
                               int32_t group_size, int32_t dv, int32_t partial_dv, int32_t request, void* o_out,
                               float* lse_out, float* scratch, int tid) {
  constexpr int kOuts = 4;
  const int slots = end - begin;
  float* weight = scratch;                            // [slots][group_size]: lse, then weights
  float* head_lse = scratch + slots * group_size;     // [group_size]
  const int n = slots * group_size;
  const float* lse_src = partial_lse + int64_t{begin} * group_size;  // the request's slots are consecutive
#pragma unroll 4
  for (int i = tid; i < n; i += kThreadsN) weight[i] = __ldcg(lse_src + i);
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  for (int h = warp; h < group_size; h += kThreadsN / 32) {
    float mx = neg_inf_f32();
    bool nan = false;
    for (int s = lane; s < slots; s += 32) {
      const float x = weight[s * group_size + h];
      nan |= isnan(x);
      mx = fmaxf(mx, x);
    }
    nan = __any_sync(0xffffffffu, nan);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.f;
    for (int s = lane; s < slots; s += 32) {
      // An empty partial (-inf) weighs 0; so does every partial of an
      // all-empty request (max -inf), which then writes o = 0, lse = -inf.
      const float w = mx == neg_inf_f32() ? 0.f : __expf(weight[s * group_size + h] - mx);
      weight[s * group_size + h] = w;
      sum += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    // A NaN partial (a rejected page, NaN inputs) poisons the request.
    const float inv = nan ? nan_f32() : sum > 0.f ? 1.f / sum : 0.f;
    for (int s = lane; s < slots; s += 32) weight[s * group_size + h] *= inv;
    if (lane == 0) head_lse[h] = nan ? nan_f32() : mx == neg_inf_f32() ? mx : mx + __logf(sum);
  }
  __syncthreads();
  const int d4 = dv / 4;
  const int total = group_size * d4;
  for (int first = 0; first < total; first += kOuts * kThreadsN) {
    float4 acc[kOuts];
    int head[kOuts], col[kOuts];
    bool live[kOuts];
#pragma unroll
    for (int j = 0; j < kOuts; ++j) {
      const int idx = first + j * kThreadsN + tid;
      live[j] = idx < total;
      head[j] = live[j] ? idx / d4 : 0;
      col[j] = live[j] ? (idx % d4) * 4 : 0;
      acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll 8
    for (int s = 0; s < slots; ++s) {
#pragma unroll
      for (int j = 0; j < kOuts; ++j) {
        if (!live[j]) continue;
        const int64_t row = int64_t{begin + s} * group_size + head[j];
        const float4 po = __ldcg(reinterpret_cast<const float4*>(partial_o + row * partial_dv + col[j]));
        const float w = weight[s * group_size + head[j]];
        acc[j].x += w * po.x, acc[j].y += w * po.y, acc[j].z += w * po.z, acc[j].w += w * po.w;
      }
    }
#pragma unroll
    for (int j = 0; j < kOuts; ++j) {
      if (!live[j]) continue;
      T* dst = static_cast<T*>(o_out) + (int64_t{request} * group_size + head[j]) * dv + col[j];
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(ElemTraits<T>::pack2(acc[j].x, acc[j].y), ElemTraits<T>::pack2(acc[j].z, acc[j].w));
    }
  }
  if (lse_out != nullptr) {
    for (int h = tid; h < group_size; h += kThreadsN) lse_out[int64_t{request} * group_size + h] = head_lse[h];
  }
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
