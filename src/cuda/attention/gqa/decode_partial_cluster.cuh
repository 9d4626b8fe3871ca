// The partial kernel with the merge inside a thread-block cluster
// (launch_partial.cuh, kClusterMergeCtas): the CTAs that split one
// request form one cluster, each reduces its chunk exactly as the partial
// kernel does, and the partial states are combined through distributed
// shared memory instead of fp32 partials in global memory and a merge
// launch. Only at head dims 128/128 (both paged row sources: the library's
// tables and the engines' index forms), native dtypes, and uniform splits
// (every request has the same chunks, so one cluster size fits the grid) of
// at most kMaxClusterCtas CTAs per request; the launches take clusters of 2
// only (kClusterMergeCtas: the size that measured faster than the merge
// kernel).
//
// Cluster layout: the grid is items x head tiles (tile fastest) and item
// r * chunks + c is chunk c of request r, so request r owns CTAs
// [r * chunks * tiles, (r + 1) * chunks * tiles): exactly one cluster, in
// which rank = chunk * tiles + tile.
//
// After its pipeline each CTA
//   1. sums its four warps' accumulators into one unnormalized 16 x dv tile
//      (relative to its per-row base) and publishes it with the row bases,
//      row sums and its rejected-page flag in its own shared memory;
//   2. meets the cluster (barrier.cluster arrive.release / wait.acquire);
//   3. reads the bases and sums of the CTAs of its head tile (one per
//      chunk), weighs them as the merge kernel weighs partial lse, and
//      writes its 1 / chunks share of the tile's outputs, reading the
//      peers' tiles through DSMEM;
//   4. meets the cluster again, so no CTA leaves while a peer still reads
//      its shared memory.
// A rejected page in any chunk poisons the request (o and lse NaN) and sets
// the error flag; chunks that saw nothing weigh nothing; all empty: o = 0,
// lse = -inf: the merge kernel's rules.
#pragma once

#include "cuda/attention/gqa/decode_partial.cuh"
#include "cuda/primitives/cluster.cuh"

namespace sparsepage {
namespace cuda {

/// Most CTAs one request's cluster may hold: it sizes the kernel's per-chunk
/// arrays (sm_90's non-portable cluster size). The launches take 2
/// (kClusterMergeCtas); a smaller bound here would change the kernel's code
/// (its static shared memory and loops), which has not been measured.
constexpr int kMaxClusterCtas = 16;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <class Cta>
__device__ void finish_in_cluster(Cta& c) {
  using T = typename Cta::Elem;
  using Cfg = typename Cta::Cfg;
  __shared__ float row_base[kQueryTile], row_sum[kQueryTile];
  __shared__ float weight[kMaxClusterCtas][kQueryTile];  // chunk c's weight for row i (local)
  __shared__ float row_scale[kQueryTile];                // 1 / total weight, 0 (empty) or NaN (poisoned)
  __shared__ int cta_bad;
  const auto& p = c.p;
  const bool any_bad = c.reduce_warps(row_base, row_sum);
  float* red = reinterpret_cast<float*>(c.stages);  // [kWarps][16][kReducePitch]; warp 0's rows take the sum
  const int d4 = p.dv / 4;
  for (int idx = c.tid; idx < c.heads * d4; idx += kThreads) {
    const int row = idx / d4, col = (idx % d4) * 4;
    float4 o = *reinterpret_cast<const float4*>(red + row * Cfg::kReducePitch + col);
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      const float4 x = *reinterpret_cast<const float4*>(red + (w * kQueryTile + row) * Cfg::kReducePitch + col);
      o.x += x.x, o.y += x.y, o.z += x.z, o.w += x.w;
    }
    *reinterpret_cast<float4*>(red + row * Cfg::kReducePitch + col) = o;
  }
  if (c.tid == 0) cta_bad = any_bad ? 1 : 0;
  if (any_bad && c.tid == 0) report_rejected(p, c.request);

  cluster::sync();  // every CTA's tile, bases, sums and flag are published
  const int rank = static_cast<int>(cluster::rank());
  const int32_t rows = p.group_size * p.q_len;
  const int tiles = (rows + kQueryTile - 1) / kQueryTile;
  const int chunks = static_cast<int>(cluster::num_ctas()) / tiles;
  const int tile = rank % tiles, chunk = rank / tiles;
  if (c.tid < c.heads) {
    const int row = c.tid;
    float base[kMaxClusterCtas], sum[kMaxClusterCtas];
    bool nan = false;
    float top = neg_inf_f32();
#pragma unroll
    for (int k = 0; k < kMaxClusterCtas; ++k) {
      if (k >= chunks) break;
      const unsigned peer = static_cast<unsigned>(k * tiles + tile);
      base[k] = *cluster::map(row_base + row, peer);
      sum[k] = *cluster::map(row_sum + row, peer);
      nan |= *cluster::map(&cta_bad, peer) != 0 || isnan(sum[k]);
      if (sum[k] > 0.f) top = fmaxf(top, base[k]);
    }
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxClusterCtas; ++k) {
      if (k >= chunks) break;
      const float w = sum[k] > 0.f ? exp2f(base[k] - top) : 0.f;  // a chunk that saw nothing weighs 0
      weight[k][row] = w;
      total += w * sum[k];
    }
    row_scale[row] = nan ? nan_f32() : total > 0.f ? 1.f / total : 0.f;
    if (chunk == 0 && p.lse) {
      const float lse = nan ? nan_f32() : total > 0.f ? (top + log2f(total)) * kLn2 : neg_inf_f32();
      p.lse[lse_row(p, c.request, c.head0 + row)] = lse;
    }
  }
  __syncthreads();
  using Tr = ElemTraits<T>;
  T* o0 = static_cast<T*>(p.o) + head_offset(p, p.o_seq, p.o_head, c.request, c.head0);
  for (int idx = chunk * kThreads + c.tid; idx < c.heads * d4; idx += chunks * kThreads) {
    const int row = idx / d4, col = (idx % d4) * 4;
    const float* mine = red + row * Cfg::kReducePitch + col;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < kMaxClusterCtas; ++k) {
      if (k >= chunks) break;
      const float w = weight[k][row];
      const float4 x = *reinterpret_cast<const float4*>(cluster::map(mine, static_cast<unsigned>(k * tiles + tile)));
      o.x += w * x.x, o.y += w * x.y, o.z += w * x.z, o.w += w * x.w;
    }
    const float s = row_scale[row];
    o = isnan(s) ? make_float4(nan_f32(), nan_f32(), nan_f32(), nan_f32())
                 : make_float4(o.x * s, o.y * s, o.z * s, o.w * s);
    T* dst = p.q_len > 1 ? static_cast<T*>(p.o) +
                               query_row_offset(p, p.o_seq, p.o_tok, p.o_head, c.request, c.head0 + row) + col
                         : o0 + row * p.o_head + col;
    *reinterpret_cast<uint2*>(dst) = make_uint2(Tr::pack2(o.x, o.y), Tr::pack2(o.z, o.w));
  }
  cluster::sync();  // no CTA leaves while a peer may still read its shared memory
}
#endif

/// Grid: items x head tiles, launched with cluster dims (chunks x tiles).
template <typename T, int DK, int DV, class Source>
__global__ void __launch_bounds__(kThreads, TileConfig<DK, DV, Source::kHasBias>::kMinBlocks)
    partial_cluster_kernel(const __grid_constant__ typename Source::Params params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait_primary();
  pdl_launch_dependents();
  PartialCta<T, DK, DV, Source> cta(params, smem);
  cta.gather_and_reduce();
  finish_in_cluster(cta);
#else
  __trap();
#endif
}

}  // namespace cuda
}  // namespace sparsepage
