// Thread-block clusters (sm_90): the one cluster API of the kernels. The
// GQA kernel's merge inside a cluster (decode_partial_cluster.cuh) and the
// FP8 MLA CTA pairs (mla_ws_fp8_pair.cuh) use it, and nothing else (no
// cooperative_groups). What CUDA offers as device functions (the rank, the
// size, generic DSMEM pointers, the full barrier: the functions
// cooperative_groups' cluster_group wraps) is taken from there, so ptxas
// sees them as what they are; the rest is inline PTX (PTX ISA "mapa",
// "barrier.cluster", "cp.async.bulk"): 32-bit shared::cluster addresses for
// mbarriers and bulk copies, the relaxed aligned barrier, the bulk copies.
// Shared addresses are shared::cta (cuda::smem_u32) unless a function says
// otherwise. Before sm_90 there are no clusters: the device functions are
// not declared there, and the kernels that use this never run there.
#pragma once

#include <cstdint>

namespace sparsepage {
namespace cuda {
namespace cluster {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
/// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t rank() { return __clusterRelativeBlockRank(); }
/// The CTAs of this cluster.
__device__ __forceinline__ uint32_t num_ctas() { return __clusterSizeInBlocks(); }
/// A generic pointer to the object at `p` (in this CTA's shared memory) in
/// CTA `rank`'s shared memory (distributed shared memory).
template <typename T>
__device__ __forceinline__ T* map(T* p, uint32_t rank) {
  return static_cast<T*>(__cluster_map_shared_rank(p, rank));
}
/// Every thread of every CTA of the cluster meets: what each wrote before
/// (shared memory included) is visible to all after (arrive.release,
/// wait.acquire).
__device__ __forceinline__ void sync() {
  __cluster_barrier_arrive();
  __cluster_barrier_wait();
}
#else
__device__ __forceinline__ uint32_t rank() {
  __trap();
  return 0;
}
__device__ __forceinline__ uint32_t num_ctas() {
  __trap();
  return 0;
}
template <typename T>
__device__ __forceinline__ T* map(T*, uint32_t) {
  __trap();
  return nullptr;
}
__device__ __forceinline__ void sync() { __trap(); }
#endif

/// The shared::cluster address of `addr` (this CTA's shared memory) in CTA `rank`.
__device__ __forceinline__ uint32_t map(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
/// Every thread of every CTA of the cluster meets, as sync(), for converged
/// warps whose writes need no release: the arrival is relaxed (the
/// mbarriers' initialization is released by fence.mbarrier_init first).
__device__ __forceinline__ void sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/// Copies `bytes` (a multiple of 16) of this CTA's shared memory at `src` to
/// shared::cluster address `dst` (a peer CTA's) with the bulk-copy engine;
/// completes `bytes` transaction bytes on that CTA's mbarrier at `bar`.
__device__ __forceinline__ void copy_bulk(uint32_t dst, uint32_t src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/// Waits until this thread's bulk copies have read their sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

}  // namespace cluster
}  // namespace cuda
}  // namespace sparsepage
