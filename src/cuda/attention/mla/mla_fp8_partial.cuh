// The classic MLA partial kernel over the engines' 656-byte FP8 rows
// (KvFormat::kE4m3Mla, sparsepage/fp8.h); the warp-specialized one
// (mla_ws_fp8_partial.cuh) runs by default, this one under
// SPARSEPAGE_MLA_KERNEL=classic. It is the bf16 wgmma kernel
// (mla_partial.cuh) with the gather replaced: the tensor cores still read
// bf16 tiles in shared memory, and each tile is dequantized on its way
// there, inside the kernel.
//
// Per tile of 64 rows, thread t owns row (t % 8) + 8 (t / 32) and latent
// quarter q = (t / 8) % 4, i.e. latent values [128 q, 128 q + 128), exactly
// one scale block:
//   load   8 x 16-byte loads of its quarter's e4m3 bytes and one fp32 scale
//          into registers, issued right after the tile's S = Q K^T so they
//          fly while S, the softmax and P V of the previous tile run; the
//          rope (already bf16) goes by cp.async straight into its slab.
//   store  after P V, 16 pieces of 8 values: e4m3 -> fp32, times the scale,
//          one rounding to bf16, into the 128-byte-swizzled stage. The eight
//          lanes of a store phase hold eight different rows, so the
//          swizzle puts their pieces on eight different bank groups.
// The stage written is the one P V of the tile before last read, which the
// loop's barrier has already released; the bf16 kernel's two stages and
// its shared-memory map are unchanged.
//
// Measured on the H200 (docs/PERFORMANCE.md, "FP8 caches"): this order is
// the faster of the two tried. Storing tile t+1 while the tensor cores run
// S of tile t (registers two tiles ahead, ids three) measured 242 TFLOP/s at
// batch 128 against 260 for this one: the stores and the wgmma operand reads
// share the shared-memory pipe, so the overlap cost more than it hid.
#pragma once

#include "cuda/primitives/fp8_convert.cuh"
#include "cuda/attention/mla/mla_partial.cuh"
#include "sparsepage/fp8.h"

namespace sparsepage {
namespace cuda {

template <class Source>
struct MlaFp8Cta : MlaCta<__nv_bfloat16, Source> {
  using Base = MlaCta<__nv_bfloat16, Source>;
  using KernelParams = Fp8Params<typename Source::Params>;  // what mla_partial_kernel takes
  using L = MlaTile;

  const unsigned char* k8;  // this request's rows (bytes)
  int my_row, quarter;
  uint4 raw[8];             // this thread's 128 e4m3 bytes of the next tile
  float block_scale;

  __device__ MlaFp8Cta(const Fp8Params<typename Source::Params>& params, unsigned char* smem) : Base(params, smem) {
    const int64_t seq = this->request / params.num_kv_heads, head = this->request % params.num_kv_heads;
    k8 = static_cast<const unsigned char*>(params.k) + seq * params.k_seq + head * params.k_head;
    my_row = (this->tid % 8) + 8 * (this->tid / 32);
    quarter = (this->tid / 8) % 4;
  }

  /// Registers (latent) and cp.async (rope) for tile `tile`; tail, rejected
  /// and padding rows become zeros.
  __device__ void load_tile(int tile) {
    const int32_t tok0 = this->tok_begin + tile * L::kTokens;
    const __nv_bfloat16* e_row = this->e_base;
    const unsigned char* k_row = nullptr;
    bool masked = false;
    if (my_row < this->tile_tokens(tile)) {
      const int64_t r = this->src.row(this->id_slot(tile), tok0, tok0 + my_row, this->p);
      this->bad |= r == kRejectedRow;
      masked = r == kMaskedRow;
      if (r >= 0) {
        k_row = k8 + r * this->p.k_stride;
        e_row += r * this->p.e_stride;
      }
    }
    if constexpr (Source::kMaySkip) {
      // Warp w holds rows 8 w .. 8 w + 7, as in the bf16 kernel's gather, so
      // its skip flag means the same to softmax_pv.
      if (this->src.skip_minus_one) {
        const bool any = __any_sync(0xffffffffu, masked);
        if (this->lane == 0) this->gen[L::kSkipFlags + (tile & 1) * 8 + this->tid / 32] = any ? 1 : 0;
      }
    }
    if (k_row != nullptr) {
      const auto* g = reinterpret_cast<const uint4*>(k_row + 128 * quarter);
#pragma unroll
      for (int i = 0; i < 8; ++i) raw[i] = __ldg(g + i);
      block_scale = __ldg(reinterpret_cast<const float*>(k_row + MlaFp8Row::kScaleOffset) + quarter);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) raw[i] = make_uint4(0, 0, 0, 0);
      block_scale = 0.f;
    }
    // Rope: pieces 2 q and 2 q + 1 of the row's 8, into slab 8 (columns 512..575).
    const uint32_t dst = this->stage(tile) + my_row * 128;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int piece = L::kLatent / 8 + 2 * quarter + j;
      cp_async_16_n(dst + (piece >> 3) * L::kSlabBytes + (((piece & 7) ^ (my_row & 7)) << 4), e_row + (2 * quarter + j) * 8,
                    k_row != nullptr ? 16 : 0);
    }
  }

  /// The registers of `load_tile(tile)`, dequantized into the stage.
  __device__ void store_tile(int tile) {
    const uint32_t dst = this->stage(tile) + my_row * 128;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int piece = 16 * quarter + 2 * i + h;
        const uint4 v = e4m3x8_to_bf16_scaled(h == 0 ? raw[i].x : raw[i].z, h == 0 ? raw[i].y : raw[i].w, block_scale);
        const uint32_t addr = dst + (piece >> 3) * L::kSlabBytes + (((piece & 7) ^ (my_row & 7)) << 4);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
      }
    }
  }

  __device__ void run() {
    this->m[0] = this->m[1] = neg_inf_f32();
    this->l[0] = this->l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) this->acc[i] = 0.f;
    const int num_tiles = (this->len + L::kTokens - 1) / L::kTokens;
    this->load_q();
    for (int t = 0; t < 2 && t < num_tiles; ++t) this->prefetch_ids(t);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (num_tiles > 0) load_tile(0);
    cp_async_commit();
    if (num_tiles > 0) store_tile(0);
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<0>();
      wgmma::fence_proxy_async();  // this thread's st.shared of the tile, before the tensor cores read it
      __syncthreads();             // tile t is complete; the other stage is free
      float s[16];
      this->start_scores(this->stage(t), s);
      if (t + 1 < num_tiles) load_tile(t + 1);
      if (t + 2 < num_tiles) this->prefetch_ids(t + 2);
      cp_async_commit();
      wgmma::wait<0>();
      wgmma::pin(s);
      this->softmax_pv(t, s);
      if (t + 1 < num_tiles) store_tile(t + 1);
    }
    cp_async_wait<0>();
    this->finish();
  }
};

}  // namespace cuda
}  // namespace sparsepage
