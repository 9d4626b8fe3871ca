// Shared-memory mbarriers (PTX ISA, "mbarrier"): the producer / consumer
// hand-overs of the warp-specialized kernels (the MLA kernels, the DSA
// indexer's score kernels). `bar` is a shared::cta address (cuda::smem_u32)
// unless a function says otherwise.
#pragma once

#include <cstdint>

namespace sparsepage {
namespace cuda {

/// Every thread of `threads` (whole warps) meets at named barrier `id`
/// (bar.sync; id 0 is __syncthreads' and sm_90 has 16). `Id` is the
/// kernel's enum naming its barriers.
template <typename Id>
__device__ __forceinline__ void named_barrier(Id id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<int>(id)), "r"(threads) : "memory");
}

namespace mbar {
__device__ __forceinline__ void init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/// Makes the barriers' initialization visible to the async proxy (TMA,
/// bulk copies) and, in a cluster, to the peer CTAs.
__device__ __forceinline__ void init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/// Arrives on `bar` when all of this thread's earlier cp.async copies have
/// landed; counts as one of the expected arrivals.
__device__ __forceinline__ void arrive_on_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/// Waits until the phase with parity `parity` has completed.
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  asm volatile("{\n.reg .pred done;\n"
               "WAIT_%=:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
               "r"(parity)
               : "memory");
}
/// Arrives, and expects `bytes` more transaction bytes in the current phase.
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/// Arrives on the barrier at shared::cluster address `bar` (a peer CTA's).
/// The default semantics (release, CTA scope), as CUTLASS's cluster
/// pipelines release a peer's stage: .release.cluster adds a GPU-wide
/// memory barrier to every arrival.
__device__ __forceinline__ void arrive_remote(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
}  // namespace mbar

}  // namespace cuda
}  // namespace sparsepage
