// Hopper warpgroup MMAs on e4m3 operands (sm_90a): D (fp32) (+)= A B^T with
// A (64 x 32) and B (N x 32) both K-major in shared memory, as FP8 wgmma
// requires (no transposed FP8 operands). The accumulator layout is the one
// of the 16-bit shapes (cuda/primitives/wgmma.cuh): d[4 j + e] is column
// 8 j + 2 (lane % 4) + e of row 16 warp + lane / 4, d[4 j + 2 + e] the same
// column of row + 8. Descriptors come from cuda::wgmma::desc_sw128; a k-step
// of 32 e4m3 values is 32 bytes, as a 16-bit k-step of 16 values is.
#pragma once

#include <cstdint>

namespace sparsepage {
namespace cuda {
namespace wgmma {

#define SP_E4M3_F8(j) \
  "+f"(d[j]), "+f"(d[j + 1]), "+f"(d[j + 2]), "+f"(d[j + 3]), "+f"(d[j + 4]), "+f"(d[j + 5]), "+f"(d[j + 6]), \
      "+f"(d[j + 7])

/// D[64 x 64] (+)= A[64 x 32] B[64 x 32]^T.
__device__ __forceinline__ void mma_m64n64k32_e4m3(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
               "}, %32, %33, p, 1, 1;\n}\n"
               : SP_E4M3_F8(0), SP_E4M3_F8(8), SP_E4M3_F8(16), SP_E4M3_F8(24)
               : "l"(a), "l"(b), "r"(accumulate));
}

/// D[64 x 128] (+)= A[64 x 32] B[128 x 32]^T.
__device__ __forceinline__ void mma_m64n128k32_e4m3(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
               "}, %64, %65, p, 1, 1;\n}\n"
               : SP_E4M3_F8(0), SP_E4M3_F8(8), SP_E4M3_F8(16), SP_E4M3_F8(24), SP_E4M3_F8(32), SP_E4M3_F8(40),
                 SP_E4M3_F8(48), SP_E4M3_F8(56)
               : "l"(a), "l"(b), "r"(accumulate));
}

#undef SP_E4M3_F8

}  // namespace wgmma
}  // namespace cuda
}  // namespace sparsepage
