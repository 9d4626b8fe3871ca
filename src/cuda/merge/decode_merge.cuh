// The merge (docs/DESIGN.md: the paged decode): combines a request's chunk partials by their
// lse into o (input dtype) and lse, in a second kernel launched right behind
// the partial kernel with programmatic dependent launch (its CTAs are
// resident and waiting when the last partial CTA retires). A NaN partial lse
// (a rejected page) poisons the request, empty partials (lse -inf) weigh
// nothing, all empty: o = 0, lse = -inf. (Merging inside the partial kernel,
// by the last CTA of each request, was built and measured slower at every
// shape: docs/PERFORMANCE.md. Requests split in two at head dims 128/128
// merge inside a thread-block cluster instead: decode_partial_cluster.cuh.)
#pragma once

#include <limits>

#include "cuda/primitives/common.cuh"

namespace sparsepage {
namespace cuda {

constexpr int kMergeThreads = 64;
constexpr int kMergeBatch = 8;  // partials whose loads a thread issues together (2 or 4 for requests of fewer)
constexpr int kMergeMaxLanes = 8;

/// Lanes that share one output of a merge whose requests have at most
/// `max_partials` partials: one batch of kMergeBatch partials per lane, a
/// power of two up to kMergeMaxLanes, so each lane's loads are one L2 round
/// trip per pass. Measured on the H200 at 8 and 16 partials
/// (docs/PERFORMANCE.md): one lane for 8, two for 16 (batch 1 to 4); four
/// and eight lanes were slower at both. Longer requests follow the rule
/// unmeasured.
inline int32_t merge_lanes(int32_t max_partials) {
  int32_t lanes = 1;
  while (lanes < kMergeMaxLanes && lanes * kMergeBatch < max_partials) lanes *= 2;
  return lanes;
}

struct MergeParams {
  const float* partial_o = nullptr;         // [num_partials, group_size, partial_dv]
  const float* partial_lse = nullptr;       // [num_partials, group_size]
  const int32_t* merge_indptr = nullptr;    // [num_merge + 1] slots, or null: uniform
  const int32_t* merge_requests = nullptr;  // [num_merge] requests, or null: uniform
  int32_t chunks_per_request = 1;           // uniform: merge i owns slots [i * c, (i + 1) * c)
  int32_t lanes = 1;       // lanes per output, each taking every lanes-th partial (launch_merge sets it)
  int32_t group_size = 1;  // query rows per request: heads x q_len tokens
  int32_t heads = 0;       // query heads per request (decode.h's group_size); 0: group_size
  int32_t q_len = 1;       // query tokens per request; row i = token i / heads
  int64_t o_tok = 0;       // o's elements between a sequence's tokens (q_len > 1)
  int32_t dv = 0;
  int32_t partial_dv = 0;
  // o's strides (decode.h's QueryStrides): head g of request r at
  // (r / num_kv_heads) * o_seq + ((r % num_kv_heads) * group_size + g) * o_head.
  int32_t num_kv_heads = 1;
  int64_t o_seq = 0, o_head = 0;
  void* o = nullptr;
  float* lse = nullptr;  // [num_sequences, q_len, num_kv_heads, heads] or null
  // The finalize of the FlashMLA-shaped decode (mla_sparse.h). An attention
  // sink is one more logit in each row's softmax denominator that adds no
  // value: row g's output is divided by sum + exp(sink[g] - max) instead of
  // sum, i.e. scaled by exp(lse) / (exp(lse) + exp(sink[g])), while the lse
  // written stays the sink-free one. -inf changes nothing; +inf gives o = 0.
  const float* sink = nullptr;  // [heads], indexed by the head within a request; null: none
  float empty_lse =
      -std::numeric_limits<float>::infinity();  // the lse of a row that attended nothing (FlashMLA's: +inf)
};

/// CTAs of the merge kernel per SM that leave ptxas the registers for a
/// batch's loads: at the 32 of full occupancy it issues each load just before
/// its use, one L2 round trip per partial instead of one per batch (the
/// 2-partial batch fits in 32). Smaller batches keep more CTAs resident for
/// requests of few partials.
constexpr int merge_min_ctas(int batch) { return batch >= 8 ? 16 : batch >= 4 ? 24 : 32; }

/// Grid: (merged requests, ceil(group_size * dv / 4 * lanes / kMergeThreads)).
/// Each output (one float4 of one head) is merged by p.lanes neighbouring
/// lanes, each over every lanes-th partial, kBatch partials' loads at a time,
/// their states combined by shuffles.
template <typename T, int kBatch>
__global__ void __launch_bounds__(kMergeThreads, merge_min_ctas(kBatch))
    merge_kernel(const __grid_constant__ MergeParams p) {
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
  const int t = blockIdx.y * kMergeThreads + threadIdx.x;
  const int idx = t / p.lanes, lane_in_output = t % p.lanes;
  const bool valid = idx < p.group_size * d4;  // invalid lanes merge nothing but take part in the shuffles
  const int head = valid ? idx / d4 : 0, col = valid ? (idx % d4) * 4 : 0;
  if (!valid) end = begin;

  // Two passes (the largest lse, then the weighted sum), each loading a
  // batch of partials before using any, so that a batch is one L2 round
  // trip. A lane takes every lanes-th partial; the lanes meet by shuffles
  // after each pass. A NaN partial (rejected page) poisons the request,
  // since fmaxf alone would silently drop it.
  const int step = p.lanes;
  float mx = neg_inf_f32();
  bool nan = false;
  for (int s0 = begin + lane_in_output; s0 < end; s0 += kBatch * step) {
    float x[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {  // past the end: the last partial again, ignored (no branch)
      const int s = min(s0 + k * step, end - 1);
      const float v = p.partial_lse[int64_t{s} * p.group_size + head];
      x[k] = s0 + k * step < end ? v : neg_inf_f32();
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      nan |= isnan(x[k]);
      mx = fmaxf(mx, x[k]);
    }
  }
  for (int offset = 1; offset < p.lanes; offset <<= 1) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
    nan |= __shfl_xor_sync(0xffffffffu, static_cast<int>(nan), offset) != 0;
  }
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  float sum = 0.f;
  if (mx != neg_inf_f32()) {  // otherwise every partial is empty: o = 0, lse = -inf
    for (int s0 = begin + lane_in_output; s0 < end; s0 += kBatch * step) {
      float x[kBatch];
      float4 po[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int s = min(s0 + k * step, end - 1);
        const float v = p.partial_lse[int64_t{s} * p.group_size + head];
        // Past the end the last partial is read again with weight 0 (no
        // branch). A partial o holding Inf would turn NaN there (0 * Inf);
        // the partial kernel writes finite o, or NaN with a NaN lse, which
        // poisons the request anyway.
        x[k] = s0 + k * step < end ? v : neg_inf_f32();
        po[k] = *reinterpret_cast<const float4*>(p.partial_o + (int64_t{s} * p.group_size + head) * p.partial_dv + col);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const float w = __expf(x[k] - mx);  // an empty partial (-inf) weighs 0
        sum += w;
        o.x += w * po[k].x, o.y += w * po[k].y, o.z += w * po[k].z, o.w += w * po[k].w;
      }
    }
  }
  for (int offset = 1; offset < p.lanes; offset <<= 1) {
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    o.x += __shfl_xor_sync(0xffffffffu, o.x, offset), o.y += __shfl_xor_sync(0xffffffffu, o.y, offset);
    o.z += __shfl_xor_sync(0xffffffffu, o.z, offset), o.w += __shfl_xor_sync(0xffffffffu, o.w, offset);
  }
  if (!valid || lane_in_output != 0) return;
  const int32_t seq = request / p.num_kv_heads, kv_head = request - seq * p.num_kv_heads;
  const int32_t heads = p.heads > 0 ? p.heads : p.group_size;
  const int32_t token = p.q_len == 1 ? 0 : head / heads, g = head - token * heads;  // one token: row = head
  float lse = p.empty_lse;
  if (mx != neg_inf_f32()) {
    // expf, not __expf: once per output, and exp(sink - max) may be large.
    // Past fp32's range it is +inf and the row's output 0, its true limit.
    const float denom = p.sink != nullptr ? sum + expf(p.sink[g] - mx) : sum;
    const float inv = 1.f / denom;
    o = make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
    lse = mx + __logf(sum);
  }
  if (nan) {
    o = make_float4(nan_f32(), nan_f32(), nan_f32(), nan_f32());
    lse = nan_f32();
  }
  const int64_t out_row = ((int64_t{seq} * p.q_len + token) * p.num_kv_heads + kv_head) * heads + g;
  T* dst =
      static_cast<T*>(p.o) + seq * p.o_seq + int64_t{token} * p.o_tok + (int64_t{kv_head} * heads + g) * p.o_head + col;
  *reinterpret_cast<uint2*>(dst) = make_uint2(ElemTraits<T>::pack2(o.x, o.y), ElemTraits<T>::pack2(o.z, o.w));
  if (col == 0 && p.lse != nullptr) p.lse[out_row] = lse;
}

/// Launches the merge of requests of at most `max_partials` partials (which
/// picks the lanes per output and the batch) behind the preceding kernel on
/// `stream` with programmatic stream serialization (capturable in a CUDA graph).
template <typename T>
void launch_merge(const MergeParams& params, int32_t max_partials, int32_t num_merge, cudaStream_t stream) {
  if (num_merge == 0) return;
  MergeParams p = params;
  p.lanes = merge_lanes(max_partials);
  const int64_t threads = int64_t{p.group_size} * (p.dv / 4) * p.lanes;
  const int64_t blocks_y = (threads + kMergeThreads - 1) / kMergeThreads;
  if (blocks_y > 65535)
    throw Error("merge: " + std::to_string(p.group_size) + " query rows of width " + std::to_string(p.dv) +
                " need more than 65535 merge CTAs per request");
  const dim3 grid(static_cast<unsigned>(num_merge), static_cast<unsigned>(blocks_y));
  auto kernel = max_partials <= 2   ? merge_kernel<T, 2>
                : max_partials <= 4 ? merge_kernel<T, 4>
                                    : merge_kernel<T, kMergeBatch>;
  launch_with_pdl(kernel, grid, dim3(kMergeThreads), 0, stream, p);
}

}  // namespace cuda
}  // namespace sparsepage
