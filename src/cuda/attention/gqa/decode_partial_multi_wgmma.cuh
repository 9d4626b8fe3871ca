// The multi-token CTA on warpgroup MMAs (sm_90a): the 64-row CTA of
// decode_partial_multi.cuh, whose four warps are exactly one warpgroup, with
// both products on wgmma instead of mma.sync.
//
//   S   = Q K^T   m64n64k16 x 8, Q and the K tile from shared memory;
//   P V           m64n128k16 x 4, P from registers (the S accumulators,
//                 packed to 16 bits, are already the A fragments), V from
//                 shared memory (MN-major: gathered rows are V's k dimension).
//
// What wgmma changes: the mma.sync CTA has each of its four warps read the
// whole K and V tile from shared memory with ldmatrix (four reads of every
// row, plus the fragments' registers: 234 per thread); here the warpgroup's
// operands are read by the tensor cores once, and the loop body is eight plus
// four instructions. Everything else is the mma.sync CTA's: the gather, the
// page-id prefetch, the causal limit, the online softmax and the stores.
//
// Layout: every 64-row tile (Q, each stage's K and V) is two slabs of 64
// columns; a slab is 64 rows of 128 bytes with the 16-byte chunks of row r
// XOR-swizzled by r & 7, the 128-byte swizzle the descriptors name. Tiles
// start 1024-byte aligned (the kernel aligns its shared memory).
#pragma once

#include "cuda/attention/gqa/decode_partial_multi.cuh"
#include "cuda/primitives/wgmma.cuh"

namespace sparsepage {
namespace cuda {

/// The 64-row tiles in the slab layout above, with the mma.sync CTA's two
/// stages (two CTAs per SM; one CTA per SM with three to six stages measured
/// slower, docs/PERFORMANCE.md).
struct MultiWgmmaTileConfig : MultiTileConfig<128, 128> {
  static constexpr int kSlabElems = kTileRows * 64;
  static constexpr uint32_t kSlabBytes = kSlabElems * 2;
  __device__ static int tile_offset(int row, int chunk, int) {
    return (chunk >> 3) * kSlabElems + swizzle(row, chunk & 7, 8);
  }
};

template <typename T, class Source>
struct MultiTokenWgmmaCta : MultiTokenCta<T, 128, 128, Source, MultiWgmmaTileConfig> {
  using Base = MultiTokenCta<T, 128, 128, Source, MultiWgmmaTileConfig>;
  using Cfg = MultiWgmmaTileConfig;
  using Tr = typename Base::Tr;
  using Params = typename Source::Params;
  using KernelParams = Params;  // what multi_token_wgmma_kernel takes
  using Base::acc;
  using Base::kS;
  static_assert(kTileRows == 64 && kMultiRows == 64, "one m64 warpgroup tile of query rows and of gathered rows");
  static constexpr size_t kSmemBytes = Base::kSmemBytes + 1024;  // room to align the tiles to 1024 bytes

  __device__ static unsigned char* aligned(unsigned char* smem) {
    return smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u);
  }

  __device__ MultiTokenWgmmaCta(const Params& params, unsigned char* smem) : Base(params, aligned(smem)) {}

  /// S = Q K^T for the CTA's 64 query rows against the tile's 64 rows; each
  /// warp's s[j] holds its 16 rows x gathered rows 8j .. 8j + 7.
  __device__ void scores(int stage, float (&s)[8][4]) const {
    const uint64_t qd = wgmma::desc_sw128(smem_u32(this->q_tile), 16, 1024);
    const uint64_t kd = wgmma::desc_sw128(smem_u32(this->k_tile(stage)), 16, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < 128 / 16; ++kk) {  // slab kk / 4, 32 bytes per k16 step inside it
      const uint64_t off = ((kk >> 2) * Cfg::kSlabBytes + (kk & 3) * 32) >> 4;
      wgmma::mma_m64n64k16<T>(s, qd + off, kd + off, kk > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(s);
  }

  /// acc += P V: P (the softmax's s) from registers, 16 gathered rows per step.
  __device__ void pv(int tile, const float (&s)[8][4]) {
    const uint64_t vd = wgmma::desc_sw128(smem_u32(this->v_tile(tile % kS)), Cfg::kSlabBytes, 1024);
    uint32_t a[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      a[ks][0] = Tr::pack2(s[2 * ks][0], s[2 * ks][1]);
      a[ks][1] = Tr::pack2(s[2 * ks][2], s[2 * ks][3]);
      a[ks][2] = Tr::pack2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
      a[ks][3] = Tr::pack2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
    wgmma::fence();  // the rescaled accumulators and the packed P before the MMAs read them
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) wgmma::mma_m64n128k16_rs<T>(acc, a[ks], vd + static_cast<uint64_t>(ks * 128), 1);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(acc);
  }

  /// The mma.sync CTA's pipeline, with the copies fenced for the async proxy
  /// and no Q fragments: Q stays in shared memory, where wgmma reads it. No
  /// zero_v_tail: this CTA runs only at dv = 128 (multi_token_cta_kind).
  __device__ void run() {
    this->template pipeline<true>([] {}, [&](int t) { this->issue_tile(t); },
                                  [&](int t) {
                                    float s[8][4];
                                    scores(t % kS, s);
                                    this->softmax(t, s);
                                    pv(t, s);
                                  });
    this->finish();
  }
};

/// The entry of both 64-row wgmma CTAs: Cta is MultiTokenWgmmaCta (bf16 /
/// f16 rows) or MultiTokenWgmmaFp8Cta (decode_partial_multi_wgmma_fp8.cuh);
/// Cta::KernelParams is what its launch passes.
template <class Cta>
__global__ void __launch_bounds__(kThreads, 2)
    multi_token_wgmma_kernel(const __grid_constant__ typename Cta::KernelParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait_primary();
  pdl_launch_dependents();
  Cta cta(params, smem);
  cta.run();
#else
  __trap();  // dispatch runs this kernel only where sm_90a code runs (multi_token_cta_kind)
#endif
}

}  // namespace cuda
}  // namespace sparsepage
