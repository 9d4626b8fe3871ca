// Hopper warpgroup MMA (wgmma) wrappers: shared-memory matrix descriptors,
// the fence / commit / wait protocol, and the instruction shapes the MLA
// kernel and the multi-token CTA issue. Shared-memory operands are 128-byte
// swizzled tiles (see mla_partial.cuh for the layout). Inline asm cannot loop over
// operands, so the accumulator lists are written out by macro.
#pragma once

#include <cstdint>

#include "cuda/primitives/common.cuh"

namespace sparsepage {
namespace cuda {
namespace wgmma {

/// Descriptor of a shared-memory operand in the 128-byte swizzle layout:
/// start address, leading- and stride-dimension byte offsets (PTX ISA,
/// "matrix descriptor format"), swizzle mode 1 = 128 B in bits 62-63.
/// The address field is bits 0-13 (address / 16): adding (bytes / 16) to the
/// descriptor moves the start within the 256 KiB shared window.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t smem_addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return uint64_t{(smem_addr & 0x3FFFFu) >> 4} | (uint64_t{(lead_bytes & 0x3FFFFu) >> 4} << 16) |
         (uint64_t{(stride_bytes & 0x3FFFFu) >> 4} << 32) | (uint64_t{1} << 62);
}

/// Orders register writes before the wgmmas that read or accumulate them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/// Makes this thread's generic-proxy shared-memory writes (st.shared,
/// cp.async) visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/// Keeps the compiler from moving accumulator reads/writes across the
/// asynchronous MMA window.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// One shape's asm statement for element type T: SHAPE(TY) is the shape's
// PTX with TY its operands' type, and the rest its asm operands. PTX names
// the type in the instruction, so each type needs its own string literal.
#define SP_WGMMA_TYPED(T, SHAPE, ...) \
  do { \
    if constexpr (ElemTraits<T>::kBF16) { \
      asm volatile(SHAPE("bf16") : __VA_ARGS__); \
    } else { \
      asm volatile(SHAPE("f16") : __VA_ARGS__); \
    } \
  } while (0)

#define SP_WGMMA_N32_OUTS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define SP_WGMMA_N32(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15 " \
  "}, %16, %17, p, 1, 1, 0, 0;\n}\n"

/// D[64x32] (+)= A[64x16] B[16x32]^T: A and B K-major (rows of 16 contiguous k).
template <typename T>
__device__ __forceinline__ void mma_m64n32k16(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  SP_WGMMA_TYPED(T, SP_WGMMA_N32, SP_WGMMA_N32_OUTS : "l"(a), "l"(b), "r"(accumulate));
}

#define SP_WGMMA_N256_OUTS \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), \
      "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), \
      "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), \
      "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), \
      "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), \
      "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), \
      "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), \
      "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), \
      "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
// The 128 accumulator operands of an m64n256 shape, %0 to %127.
#define SP_WGMMA_N256_D \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 "

#define SP_WGMMA_N256(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" SP_WGMMA_N256_D "}, %128, %129, p, 1, 1, 0, 1;\n}\n"

/// D[64x256] (+)= A[64x16] B[16x256]: A K-major, B MN-major (rows of contiguous n).
template <typename T>
__device__ __forceinline__ void mma_m64n256k16(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
  SP_WGMMA_TYPED(T, SP_WGMMA_N256, SP_WGMMA_N256_OUTS : "l"(a), "l"(b), "r"(accumulate));
}

#define SP_WGMMA_N256_RS(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" SP_WGMMA_N256_D \
  "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"

/// D[64x256] (+)= A[64x16] B[16x256]: A from registers (each warp's 16 rows
/// in the mma.sync m16n8k16 A-fragment layout, which is also the layout of
/// an m64nN accumulator's two n8 tiles packed in pairs), B MN-major in
/// shared memory.
template <typename T>
__device__ __forceinline__ void mma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  SP_WGMMA_TYPED(T, SP_WGMMA_N256_RS, SP_WGMMA_N256_OUTS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/// How B's rows sit in shared memory for a shape that takes either:
/// MN-major (rows of contiguous n, as V) or K-major (rows of contiguous k,
/// as the queries of a score product S = K Q^T).
enum class BMajor { kMN = 1, kK = 0 };

#define SP_F32X8(j) \
  "+f"(d[j]), "+f"(d[j + 1]), "+f"(d[j + 2]), "+f"(d[j + 3]), "+f"(d[j + 4]), "+f"(d[j + 5]), "+f"(d[j + 6]), \
      "+f"(d[j + 7])
#define SP_WGMMA_N128SS_OUTS \
  SP_F32X8(0), SP_F32X8(8), SP_F32X8(16), SP_F32X8(24), SP_F32X8(32), SP_F32X8(40), SP_F32X8(48), SP_F32X8(56)
// The 64 accumulator operands of an m64n128 shape, %0 to %63.
#define SP_WGMMA_N128_D \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 "

#define SP_WGMMA_N128SS(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" SP_WGMMA_N128_D "}, %64, %65, p, 1, 1, 0, %67;\n}\n"

/// D[64x128] (+)= A[64x16] B[16x128]: A K-major, B MN-major unless told
/// K-major. `d` points at 64 accumulators: either half of m64n256k16's,
/// whose layout they share.
template <typename T, BMajor kB = BMajor::kMN>
__device__ __forceinline__ void mma_m64n128k16(float* d, uint64_t a, uint64_t b, int accumulate) {
  SP_WGMMA_TYPED(T, SP_WGMMA_N128SS, SP_WGMMA_N128SS_OUTS : "l"(a), "l"(b), "r"(accumulate), "n"(int(kB)));
}

// The multi-token CTA's shapes keep their accumulators as [n8 tile][4]
// arrays, the mma.sync fragment layout (which is also wgmma's per warp).
#define SP_F4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define SP_WGMMA_N64_OUTS SP_F4(0), SP_F4(1), SP_F4(2), SP_F4(3), SP_F4(4), SP_F4(5), SP_F4(6), SP_F4(7)
#define SP_WGMMA_N64(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 " \
  "}, %32, %33, p, 1, 1, 0, 0;\n}\n"

/// D[64x64] (+)= A[64x16] B[16x64]^T: A and B K-major, both in shared memory.
template <typename T>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
  SP_WGMMA_TYPED(T, SP_WGMMA_N64, SP_WGMMA_N64_OUTS : "l"(a), "l"(b), "r"(accumulate));
}

/// The same over the accumulators as one array of 32 (the same registers in
/// the same order: d[4 j + e] is d[j][e]), as the DSA indexer keeps them.
template <typename T>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  mma_m64n64k16<T>(reinterpret_cast<float(&)[8][4]>(d), a, b, accumulate);
}

#define SP_WGMMA_N128_RS(TY) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" SP_WGMMA_N128_D \
  "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"

/// D[64x128] (+)= A[64x16] B[16x128]: A from registers (each warp's 16 rows
/// in the mma.sync m16n8k16 A-fragment layout), B MN-major in shared memory.
/// `d` is 64 accumulators: an m64n128 tile's, or either half of
/// m64n256k16's (whose layout they share).
template <typename T>
__device__ __forceinline__ void mma_m64n128k16_rs(float* d, const uint32_t (&a)[4], uint64_t b, int accumulate) {
  SP_WGMMA_TYPED(T, SP_WGMMA_N128_RS, SP_WGMMA_N128SS_OUTS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/// The same over [n8 tile][4] accumulators (the same registers in the same
/// order: d[j][e] is element 4 j + e).
template <typename T>
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b,
                                                  int accumulate) {
  mma_m64n128k16_rs<T>(&d[0][0], a, b, accumulate);
}

/// pin() for [n8 tile][4] accumulators.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
  }
}

#undef SP_F4
#undef SP_WGMMA_N64_OUTS
#undef SP_WGMMA_N64
#undef SP_WGMMA_N128_RS
#undef SP_WGMMA_N32_OUTS
#undef SP_WGMMA_N32
#undef SP_WGMMA_N256_OUTS
#undef SP_WGMMA_N256
#undef SP_WGMMA_N256_RS
#undef SP_WGMMA_N256_D
#undef SP_F32X8
#undef SP_WGMMA_N128SS_OUTS
#undef SP_WGMMA_N128_D
#undef SP_WGMMA_N128SS

}  // namespace wgmma
}  // namespace cuda
}  // namespace sparsepage
