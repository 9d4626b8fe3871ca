// The mma.sync partial kernel over e4m3 K and V with one scale per KV head
// (KvFormat::kE4m3PerHead), head dim 128. It is the bf16/f16 kernel
// (decode_partial_body.cuh) with two changes:
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
#include "cuda/primitives/fp8_convert.cuh"

namespace sparsepage {
namespace cuda {

template <typename T, class Source>
struct PartialFp8Cta : PartialCta<T, 128, 128, Source> {
  using Base = PartialCta<T, 128, 128, Source>;
  using Base::kS;
  static constexpr int kRows = kTileRows / kWarps;  // 16 rows per warp
  static constexpr int kRawRowBytes = 256;          // 128 K + 128 V bytes
  static_assert(kRows * kRawRowBytes * kWarps <= kTileRows * 128 * 2, "raw rows fit the K half of a stage");

  const unsigned char* k8;  // this request's K and V rows (bytes)
  const unsigned char* v8;
  float k_scale, v_scale;

  __device__ PartialFp8Cta(const Fp8Params<typename Source::Params>& params, unsigned char* smem) : Base(params, smem) {
    const int64_t seq = this->request / params.num_kv_heads, head = this->request % params.num_kv_heads;
    k8 = static_cast<const unsigned char*>(params.k) + seq * params.k_seq + head * params.k_head;
    v8 = static_cast<const unsigned char*>(params.v) + seq * params.v_seq + head * params.v_head;
    k_scale = params.k_scale[head];
    v_scale = params.v_scale[head];
  }

  __device__ unsigned char* raw_rows(int stage) const {
    return reinterpret_cast<unsigned char*>(this->k_tile(stage)) + this->warp * kRows * kRawRowBytes;
  }

  /// Starts the raw copies of this warp's 16 rows of tile `tile`: lane l < 16
  /// resolves row l, then the warp sweeps the rows' 16 pieces (8 of K, 8 of
  /// V), consecutive lanes on consecutive pieces.
  __device__ void issue_tile(int tile) {
    const int32_t tok0 = this->tok_begin + tile * kTileRows;
    const int row0 = this->warp * kRows;
    const int lane = this->lane;
    const unsigned char* k_row = k8;
    const unsigned char* v_row = v8;
    int fill = 0;
    bool masked = false;
    if (lane < kRows && row0 + lane < this->tile_tokens(tile)) {
      const int64_t r = this->src.row(this->id_slot(tile), tok0, tok0 + row0 + lane, this->p);
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
    const uint32_t dst = smem_u32(raw_rows(tile % kS));
#pragma unroll
    for (int i = 0; i < kRows * 16 / 32; ++i) {
      const int idx = i * 32 + lane;
      const int lr = idx / 16, c = idx % 16;
      const int n = __shfl_sync(0xffffffffu, fill, lr);
      const auto* gk =
          reinterpret_cast<const unsigned char*>(__shfl_sync(0xffffffffu, reinterpret_cast<long long>(k_row), lr));
      const auto* gv =
          reinterpret_cast<const unsigned char*>(__shfl_sync(0xffffffffu, reinterpret_cast<long long>(v_row), lr));
      cp_async_16_n(dst + lr * kRawRowBytes + c * 16, c < 8 ? gk + c * 16 : gv + (c - 8) * 16, n);
    }
  }

  /// This warp's 16 rows of stage `stage`, raw e4m3 -> the T tile in place.
  __device__ void convert(int stage) {
    const int lane = this->lane;
    const unsigned char* raw = raw_rows(stage);
    uint4 x[kRows * 16 / 32];
#pragma unroll
    for (int i = 0; i < kRows * 16 / 32; ++i) x[i] = *reinterpret_cast<const uint4*>(raw + (i * 32 + lane) * 16);
    __syncwarp();  // every lane has read its raw bytes before any converted byte lands on them
    T* kt = this->k_tile(stage);
    T* vt = kt + kTileRows * 128;
#pragma unroll
    for (int i = 0; i < kRows * 16 / 32; ++i) {
      const int idx = i * 32 + lane;
      const int row = this->warp * kRows + idx / 16, c = idx % 16;
      const uint2 a = e4m3x4_to<T>(x[i].x), b = e4m3x4_to<T>(x[i].y);
      const uint2 d = e4m3x4_to<T>(x[i].z), e = e4m3x4_to<T>(x[i].w);
      T* tile = c < 8 ? kt : vt;
      const int chunk = 2 * (c % 8);
      *reinterpret_cast<uint4*>(tile + swizzle(row, chunk, 16)) = make_uint4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<uint4*>(tile + swizzle(row, chunk + 1, 16)) = make_uint4(d.x, d.y, e.x, e.y);
    }
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
            for (int e = 0; e < 4; ++e) s[j][e] *= k_scale;
          }
          this->softmax_pv(t, s);
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
