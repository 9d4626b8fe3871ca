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
#include "cuda/attention/gqa/fp8_kv_rows.cuh"

namespace sparsepage {
namespace cuda {

template <typename T, class Source>
struct MultiTokenWgmmaFp8Cta : MultiTokenWgmmaCta<T, Source> {
  using Base = MultiTokenWgmmaCta<T, Source>;
  using Cfg = MultiWgmmaTileConfig;
  using Rows = Fp8KvRows<T>;
  using Base::kS;
  static_assert(Rows::kRows * kWarps == kTileRows, "each warp gathers 16 rows");
  static_assert(Rows::kRawRowBytes * kTileRows <= static_cast<int>(Cfg::kSlabBytes) * 2, "raw rows fit the K tile");

  using KernelParams = Fp8Params<typename Source::Params>;  // what multi_token_wgmma_kernel takes

  Rows fp8;

  __device__ MultiTokenWgmmaFp8Cta(const KernelParams& params, unsigned char* smem)
      : Base(params, smem), fp8(params, this->request) {}

  __device__ unsigned char* raw_rows(int stage) const {
    return reinterpret_cast<unsigned char*>(this->k_tile(stage)) + this->warp * Rows::kRows * Rows::kRawRowBytes;
  }

  /// The raw copies of this warp's 16 rows of tile `tile` (lane l < 16
  /// resolves row l), and the tile's late byte, as the bf16 CTA sets it.
  __device__ void issue_tile(int tile) {
    const int32_t tok0 = this->tok_begin + tile * kTileRows;
    const int row0 = this->warp * Rows::kRows;
    const unsigned char* k_row = fp8.k8;
    const unsigned char* v_row = fp8.v8;
    int fill = 0;
    int64_t resolved = kRejectedRow;  // lanes past the warp's rows are never late
    if (this->lane < Rows::kRows && row0 + this->lane < this->tile_tokens(tile)) {
      const int64_t r = this->src.row(this->id_slot(tile), tok0, tok0 + row0 + this->lane, this->p);
      resolved = r;
      this->bad |= r == kRejectedRow;  // a masked row (kMaskedRow) is just not read
      if (r >= 0) {
        fill = 16;
        k_row += r * this->p.k_stride;
        v_row += r * this->p.v_stride;
      }
    }
    Rows::copy_raw(smem_u32(raw_rows(tile % kS)), k_row, v_row, fill, this->lane);
    const bool late = __any_sync(0xffffffffu, resolved >= this->src.live_len() - (this->p.q_len - 1));
    if (this->lane == 0) this->late_bytes()[(tile % kS) * kWarps + this->warp] = late;
  }

  /// Stage `stage`'s raw e4m3 rows -> its K and V slab tiles in T.
  __device__ void convert(int stage) {
    uint4 x[Rows::kPieces];
    Rows::load_raw(raw_rows(stage), this->lane, x);
    __syncthreads();  // every warp holds its raw bytes before any converted byte lands on them
    Rows::store(x, this->warp * Rows::kRows, this->lane, this->k_tile(stage), this->v_tile(stage),
                [](int row, int chunk) { return Cfg::tile_offset(row, chunk, 16); });
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
                                      for (int e = 0; e < 4; ++e) s[j][e] *= fp8.k_scale;
                                    }
                                    this->softmax(t, s);
                                    this->pv(t, s);
                                  });
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) this->acc[i][e] *= fp8.v_scale;
    }
    this->finish();
  }
};

}  // namespace cuda
}  // namespace sparsepage
