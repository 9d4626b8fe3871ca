// The 64-row wgmma CTA (decode_partial_multi_wgmma.cuh) over e4m3 K and V
// with one scale per request (KvFormat::kE4m3PerHead), head dim 128: what a
// chunked prefill or a multi-token step over an FP8 cache runs. Three changes
// to the bf16 CTA, the same three the 16-row e4m3 CTA makes to its own
// (decode_partial_fp8.cuh):
//   * the gathered rows are copied raw (128 + 128 bytes per row) into the K
//     half of their stage, warp w's 16 rows at bytes [4096 w, 4096 w + 4096);
//   * once the tile has landed, the CTA converts it to the two slab tiles the
//     MMAs read (every e4m3 value is exact in bf16 and f16). A warp's
//     converted rows cover other warps' raw bytes here (a K row's two
//     halves sit in two slabs), so every warp reads its raw bytes into
//     registers before the barrier and writes after it; the writes are then
//     fenced for the tensor cores' async-proxy reads and published by a
//     second barrier;
//   * K's scale multiplies the 64 x 64 scores of a tile, V's the
//     accumulators once at the end, both in fp32.
#pragma once

#include "cuda/attention/gqa/decode_partial_multi_wgmma.cuh"
#include "cuda/primitives/fp8_convert.cuh"

namespace sparsepage {
namespace cuda {

template <typename T, class Source>
struct MultiTokenWgmmaFp8Cta : MultiTokenWgmmaCta<T, Source> {
  using Base = MultiTokenWgmmaCta<T, Source>;
  using Cfg = MultiWgmmaTileConfig;
  using Base::kS;
  static constexpr int kRows = kTileRows / kWarps;  // 16 rows per warp
  static constexpr int kRawRowBytes = 256;          // 128 K + 128 V bytes
  static constexpr int kPieces = kRows * 16 / 32;   // 16-byte pieces per lane and tile
  static_assert(kRows * kRawRowBytes * kWarps <= static_cast<int>(Cfg::kSlabBytes) * 2, "raw rows fit the K tile");

  const unsigned char* k8;  // this request's K and V rows (bytes)
  const unsigned char* v8;
  float k_scale, v_scale;

  __device__ MultiTokenWgmmaFp8Cta(const Fp8Params<typename Source::Params>& params, unsigned char* smem)
      : Base(params, smem) {
    const int64_t seq = this->request / params.num_kv_heads, head = this->request % params.num_kv_heads;
    k8 = static_cast<const unsigned char*>(params.k) + seq * params.k_seq + head * params.k_head;
    v8 = static_cast<const unsigned char*>(params.v) + seq * params.v_seq + head * params.v_head;
    k_scale = params.k_scale[head];
    v_scale = params.v_scale[head];
  }

  __device__ unsigned char* raw_rows(int stage) const {
    return reinterpret_cast<unsigned char*>(this->k_tile(stage)) + this->warp * kRows * kRawRowBytes;
  }

  /// The raw copies of this warp's 16 rows of tile `tile` (lane l < 16
  /// resolves row l, then the warp sweeps the rows' 8 K and 8 V pieces), and
  /// the tile's late byte, as the bf16 CTA sets it.
  __device__ void issue_tile(int tile) {
    const int32_t tok0 = this->tok_begin + tile * kTileRows;
    const int row0 = this->warp * kRows;
    const int lane = this->lane;
    const unsigned char* k_row = k8;
    const unsigned char* v_row = v8;
    int fill = 0;
    int64_t resolved = kRejectedRow;
    if (lane < kRows && row0 + lane < this->tile_tokens(tile)) {
      const int64_t r = this->src.row(this->id_slot(tile), tok0, tok0 + row0 + lane, this->p);
      resolved = r;
      this->bad |= r == kRejectedRow;  // a masked row (kMaskedRow) is just not read
      if (r >= 0) {
        fill = 16;
        k_row += r * this->p.k_stride;
        v_row += r * this->p.v_stride;
      }
    }
    const uint32_t dst = smem_u32(raw_rows(tile % kS));
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int idx = i * 32 + lane;
      const int lr = idx / 16, c = idx % 16;
      const int n = __shfl_sync(0xffffffffu, fill, lr);
      const auto* gk =
          reinterpret_cast<const unsigned char*>(__shfl_sync(0xffffffffu, reinterpret_cast<long long>(k_row), lr));
      const auto* gv =
          reinterpret_cast<const unsigned char*>(__shfl_sync(0xffffffffu, reinterpret_cast<long long>(v_row), lr));
      cp_async_16_n(dst + lr * kRawRowBytes + c * 16, c < 8 ? gk + c * 16 : gv + (c - 8) * 16, n);
    }
    const bool late = __any_sync(0xffffffffu, resolved >= this->src.live_len() - (this->p.q_len - 1));
    if (lane == 0) this->late_bytes()[(tile % kS) * kWarps + this->warp] = late;
  }

  /// Stage `stage`'s raw e4m3 rows -> its K and V slab tiles in T.
  __device__ void convert(int stage) {
    const int lane = this->lane;
    const unsigned char* raw = raw_rows(stage);
    uint4 x[kPieces];
#pragma unroll
    for (int i = 0; i < kPieces; ++i) x[i] = *reinterpret_cast<const uint4*>(raw + (i * 32 + lane) * 16);
    __syncthreads();  // every warp holds its raw bytes before any converted byte lands on them
    T* kt = this->k_tile(stage);
    T* vt = this->v_tile(stage);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int idx = i * 32 + lane;
      const int row = this->warp * kRows + idx / 16, c = idx % 16;
      const uint2 a = e4m3x4_to<T>(x[i].x), b = e4m3x4_to<T>(x[i].y);
      const uint2 d = e4m3x4_to<T>(x[i].z), e = e4m3x4_to<T>(x[i].w);
      T* tile = c < 8 ? kt : vt;
      const int chunk = 2 * (c % 8);  // 16 raw bytes are two 16-byte chunks of T
      *reinterpret_cast<uint4*>(tile + Cfg::tile_offset(row, chunk, 16)) = make_uint4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<uint4*>(tile + Cfg::tile_offset(row, chunk + 1, 16)) = make_uint4(d.x, d.y, e.x, e.y);
    }
    wgmma::fence_proxy_async();  // the converted tiles, for the MMAs' async-proxy reads
    __syncthreads();
  }

  __device__ void run() {
    this->template pipeline<true>([] {}, [&](int t) { issue_tile(t); },
                                  [&](int t) {
                                    convert(t % kS);
                                    float s[8][4];
                                    this->scores(t % kS, s);
#pragma unroll
                                    for (int j = 0; j < 8; ++j) {
#pragma unroll
                                      for (int e = 0; e < 4; ++e) s[j][e] *= k_scale;
                                    }
                                    this->softmax(t, s);
                                    this->pv(t, s);
                                  });
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) this->acc[i][e] *= v_scale;
    }
    this->finish();
  }
};

template <typename T, class Source>
__global__ void __launch_bounds__(kThreads, 2)
    multi_token_wgmma_fp8_kernel(const __grid_constant__ Fp8Params<typename Source::Params> params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait_primary();
  pdl_launch_dependents();
  MultiTokenWgmmaFp8Cta<T, Source> cta(params, smem);
  cta.run();
#else
  __trap();  // dispatch runs this kernel only where sm_90a code runs (multi_token_cta_kind)
#endif
}

}  // namespace cuda
}  // namespace sparsepage
