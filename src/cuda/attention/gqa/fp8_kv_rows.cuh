// What the two e4m3 GQA CTAs share (KvFormat::kE4m3PerHead, head dim 128):
// the 16-row tiles (decode_partial_fp8.cuh) and the 64-row wgmma CTA
// (decode_partial_multi_wgmma_fp8.cuh). Each warp copies its 16 gathered
// rows raw, 128 K + 128 V bytes per row, into 4 KiB of shared memory, and
// converts them later into the T tiles the MMAs read (every e4m3 value is
// exact in bf16 and f16). The CTAs differ in where the converted rows go
// and how the conversion is fenced; those stay with them.
#pragma once

#include "cuda/primitives/common.cuh"
#include "cuda/primitives/fp8_convert.cuh"

namespace sparsepage {
namespace cuda {

template <typename T>
struct Fp8KvRows {
  static constexpr int kRows = 16;                 // gathered rows per warp and tile
  static constexpr int kRawRowBytes = 256;         // 128 K + 128 V bytes
  static constexpr int kPieces = kRows * 16 / 32;  // 16-byte pieces per lane and tile

  const unsigned char* k8;  // the request's K and V rows (bytes)
  const unsigned char* v8;
  float k_scale, v_scale;  // the request's KV head's

  template <class Params>
  __device__ Fp8KvRows(const Params& params, int32_t request) {
    const int64_t seq = request / params.num_kv_heads, head = request % params.num_kv_heads;
    k8 = static_cast<const unsigned char*>(params.k) + seq * params.k_seq + head * params.k_head;
    v8 = static_cast<const unsigned char*>(params.v) + seq * params.v_seq + head * params.v_head;
    k_scale = params.k_scale[head];
    v_scale = params.v_scale[head];
  }

  /// Starts the raw copies of the warp's 16 rows to `dst`: lane l < 16
  /// passes row l's K and V bytes and `fill` (16, or 0 for a row not read,
  /// zero-filled), then the warp sweeps the rows' 16 pieces (8 of K, 8 of
  /// V), consecutive lanes on consecutive pieces.
  __device__ static void copy_raw(uint32_t dst, const unsigned char* k_row, const unsigned char* v_row, int fill,
                                  int lane) {
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
  }

  /// The lane's raw pieces of the warp's rows at `raw`, into registers.
  __device__ static void load_raw(const unsigned char* raw, int lane, uint4 (&x)[kPieces]) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) x[i] = *reinterpret_cast<const uint4*>(raw + (i * 32 + lane) * 16);
  }

  /// The lane's pieces of rows first_row .. first_row + 15, converted into
  /// the K tile `kt` and the V tile `vt`; `offset(row, chunk)` places a
  /// 16-byte chunk of T (a raw piece is two of them).
  template <class Offset>
  __device__ static void store(const uint4 (&x)[kPieces], int first_row, int lane, T* kt, T* vt, Offset offset) {
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int idx = i * 32 + lane;
      const int row = first_row + idx / 16, c = idx % 16;
      const uint2 a = e4m3x4_to<T>(x[i].x), b = e4m3x4_to<T>(x[i].y);
      const uint2 d = e4m3x4_to<T>(x[i].z), e = e4m3x4_to<T>(x[i].w);
      T* tile = c < 8 ? kt : vt;
      const int chunk = 2 * (c % 8);
      *reinterpret_cast<uint4*>(tile + offset(row, chunk)) = make_uint4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<uint4*>(tile + offset(row, chunk + 1)) = make_uint4(d.x, d.y, e.x, e.y);
    }
  }
};

}  // namespace cuda
}  // namespace sparsepage
