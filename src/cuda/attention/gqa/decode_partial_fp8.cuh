// The mma.sync partial kernel over e4m3 K and V with one scale per KV head
// (KvFormat::kE4m3PerHead), head dim 128. It is the bf16/f16 kernel
// (decode_partial_body.cuh) with two changes (the raw rows and their
// conversion are Fp8KvRows, shared with the 64-row CTA):
//   * the gathered rows are copied raw (128 + 128 bytes per row, half the
//     bytes) into the first half of each warp's share of a stage; after the
//     tile lands each warp converts its own 16 rows in place to the T tile
//     the MMAs read (every e4m3 value is exact in bf16 and f16), so the
//     ldmatrix / mma code is the same lines;
//   * the head's scales are applied in fp32 where they cost nothing: K's to
//     the 16 x 64 scores of a tile, V's once to the accumulators.
// Warp w's raw rows sit at bytes [4096 w, 4096 w + 4096) of the stage, the
// same bytes its converted K rows (16 w .. 16 w + 15) occupy, and its V rows
// go to the V half: no warp writes bytes another warp has yet to read, so
// the conversion needs only warp barriers.
#pragma once

#include "cuda/attention/gqa/decode_partial.cuh"
#include "cuda/attention/gqa/fp8_kv_rows.cuh"

namespace sparsepage {
namespace cuda {

template <typename T, class Source>
struct PartialFp8Cta : PartialCta<T, 128, 128, Source> {
  using Base = PartialCta<T, 128, 128, Source>;
  using Rows = Fp8KvRows<T>;
  using Base::kS;
  static_assert(Rows::kRows * kWarps == kTileRows, "each warp gathers 16 rows");
  static_assert(Rows::kRawRowBytes * kTileRows <= kTileRows * 128 * 2, "raw rows fit the K half of a stage");

  Rows fp8;

  __device__ PartialFp8Cta(const Fp8Params<typename Source::Params>& params, unsigned char* smem)
      : Base(params, smem), fp8(params, this->request) {}

  __device__ unsigned char* raw_rows(int stage) const {
    return reinterpret_cast<unsigned char*>(this->k_tile(stage)) + this->warp * Rows::kRows * Rows::kRawRowBytes;
  }

  /// Starts the raw copies of this warp's 16 rows of tile `tile` (lane l < 16
  /// resolves row l).
  __device__ void issue_tile(int tile) {
    const int32_t tok0 = this->tok_begin + tile * kTileRows;
    const int row0 = this->warp * Rows::kRows;
    const unsigned char* k_row = fp8.k8;
    const unsigned char* v_row = fp8.v8;
    int fill = 0;
    bool masked = false;
    if (this->lane < Rows::kRows && row0 + this->lane < this->tile_tokens(tile)) {
      const int64_t r = this->src.row(this->id_slot(tile), tok0, tok0 + row0 + this->lane, this->p);
      this->bad |= r == kRejectedRow;
      masked = r == kMaskedRow;
      if (r >= 0) {
        fill = 16;
        k_row += r * this->p.k_stride;
        v_row += r * this->p.v_stride;
      }
    }
    if constexpr (Source::kMaySkip) {
      if (this->src.skip_minus_one) {
        const uint32_t bit = 1u << (tile % kS);
        this->skip_stages = __any_sync(0xffffffffu, masked) ? this->skip_stages | bit : this->skip_stages & ~bit;
      }
    }
    Rows::copy_raw(smem_u32(raw_rows(tile % kS)), k_row, v_row, fill, this->lane);
  }

  /// This warp's 16 rows of stage `stage`, raw e4m3 -> the T tile in place.
  __device__ void convert(int stage) {
    uint4 x[Rows::kPieces];
    Rows::load_raw(raw_rows(stage), this->lane, x);
    __syncwarp();  // every lane has read its raw bytes before any converted byte lands on them
    T* kt = this->k_tile(stage);
    Rows::store(x, this->warp * Rows::kRows, this->lane, kt, kt + kTileRows * 128,
                [](int row, int chunk) { return swizzle(row, chunk, 16); });
    __syncwarp();  // the warp's ldmatrix reads see the converted rows
  }

  /// The base pipeline (PartialCta::pipeline) with the conversion and the scales.
  __device__ void run() {
    this->template pipeline<false>(
        [&] {
#pragma unroll
          for (int kk = 0; kk < 128 / 16; ++kk)
            ldmatrix_x4(this->qf[kk],
                        smem_u32(this->q_tile + swizzle(this->lane & 15, 2 * kk + (this->lane >> 4), 16)));
        },
        [&](int t) { issue_tile(t); },
        [&](int t) {
          convert(t % kS);
          float s[2][4] = {};
          this->scores(t % kS, s);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= fp8.k_scale;
          }
          this->softmax_pv(t, s);
        });
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) this->acc[i][e] *= fp8.v_scale;
    }
    this->finish();
  }
};

template <typename T, class Source>
__global__ void __launch_bounds__(kThreads, TileConfig<128, 128, Source::kHasBias>::kMinBlocks)
    partial_fp8_kernel(const __grid_constant__ Fp8Params<typename Source::Params> params) {
  extern __shared__ __align__(128) unsigned char smem[];
  pdl_wait_primary();
  pdl_launch_dependents();
  PartialFp8Cta<T, Source> cta(params, smem);
  cta.run();
}

}  // namespace cuda
}  // namespace sparsepage
