// Small device helpers shared by the CUDA kernels: the error check, element
// conversions, and thin wrappers over the PTX the kernels are built from
// (cp.async, ldmatrix, mma.sync m16n8k16). Nothing here knows about decode.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/types.h"

namespace sparsepage {
namespace cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(std::string("CUDA error: ") + cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ") in " + call +
              " at " + file + ":" + std::to_string(line));
}

}  // namespace cuda
}  // namespace sparsepage

/// Checks a CUDA runtime call and throws sparsepage::Error naming it.
#define SP_CUDA_CHECK(call) \
  do { \
    cudaError_t sp_err_ = (call); \
    if (sp_err_ != cudaSuccess) ::sparsepage::cuda::throw_cuda_error(sp_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// After a launch: configuration errors surface here, not at the next sync.
#define SP_CUDA_CHECK_LAUNCH() SP_CUDA_CHECK(cudaGetLastError())

namespace sparsepage {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- element types --------------------------------------------------------

template <typename T>
struct ElemTraits;
template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr bool kBF16 = true;
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  /// Two floats as one packed register (low half = a), the mma operand format.
  __device__ static uint32_t pack2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct ElemTraits<__half> {
  static constexpr bool kBF16 = false;
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static uint32_t pack2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

/// 2^x for softmax weights: one MUFU.EX2 (ex2.approx.ftz). exp2f is the same
/// approximation plus a range test and two predicated multiplies, kept only
/// so that results below 2^-126 come out as denormals. A weight that small
/// is lost anyway next to its row's sum, which is at least 1 (a row's base
/// never exceeds its max). -inf gives 0 and NaN stays NaN.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fffffff); }
__device__ __forceinline__ float neg_inf_f32() { return __int_as_float(0xff800000); }

/// The online softmax's lazy rescale for a thread's two rows, in base 2:
/// `m` and `l` are the rows' running max and sum, `tile_max` this tile's row
/// maxima (reduced over the lanes of each row, and in the MLA CTAs over both
/// warpgroups). The accumulators stay relative to the base m until a row's
/// tile max exceeds it by more than 2^8 (a factor harmless in fp32 and for
/// the bf16/f16 P operand), so after the first tiles most tiles skip the
/// accumulators' rescale; the decision is warp-uniform. Returns whether the
/// accumulators are to be multiplied by `alpha`; `base` is what each row's
/// scores are exponentiated against, 0 for a row that has seen only -inf, so
/// exp2(-inf - 0) = 0 and no (-inf) - (-inf) is ever formed.
__device__ __forceinline__ bool online_softmax_rebase(const float (&tile_max)[2], float (&m)[2], float (&l)[2],
                                                      float (&alpha)[2], float (&base)[2]) {
  constexpr float kRescaleLog2 = 8.f;
  const bool rescale = __any_sync(0xffffffffu, tile_max[0] > m[0] + kRescaleLog2 || tile_max[1] > m[1] + kRescaleLog2);
  alpha[0] = alpha[1] = 1.f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (rescale) {
      const float m_new = fmaxf(m[i], tile_max[i]);
      alpha[i] = exp2f(m[i] - (m_new == neg_inf_f32() ? 0.f : m_new));
      m[i] = m_new;
      l[i] *= alpha[i];
    }
    base[i] = m[i] == neg_inf_f32() ? 0.f : m[i];
  }
  return rescale;
}

// ---- shared memory and async copies ----------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// 16-byte global->shared copy that bypasses L1. With `fill` false nothing is
/// read and the destination is zeroed (src-size 0), so tails and rejected rows
/// still leave finite zeros in shared memory.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0) : "memory");
}
/// As cp_async_16 with the source size given: 16 copies, 0 zero-fills.
__device__ __forceinline__ void cp_async_16_n(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/// An L2 policy under which the lines a copy brings in are the first to be
/// evicted: for rows a launch reads once, which then do not push out what is
/// read again (page ids, partial outputs, the next launch's inputs).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
/// As cp_async_16_n under the L2 cache policy `policy`.
__device__ __forceinline__ void cp_async_16_n_policy(uint32_t dst, const void* src, int src_bytes, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- tensor-core fragments --------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// D += A(16x16, row) * B(16x8, col), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (ElemTraits<T>::kBF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// Element offset of 16-byte chunk `chunk` of `row` in a tile whose rows hold
/// `chunks_per_row` chunks (a multiple of 8). XOR-ing the chunk with the row's
/// low three bits puts the eight rows an ldmatrix phase reads on eight
/// different 16-byte bank groups, so neither ldmatrix nor cp.async conflicts.
__device__ __forceinline__ int swizzle(int row, int chunk, int chunks_per_row) {
  return (row * chunks_per_row + (chunk ^ (row & 7))) * 8;
}

// ---- programmatic dependent launch ---------------------------------------

/// Lets the next kernel in the stream (launched with programmatic stream
/// serialization) start its prologue while this grid finishes.
/// (sm_90 and newer; before that every launch waits for the previous one
/// and both calls are no-ops.)
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
/// Waits until the preceding grid has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait_primary() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/// Launches `kernel(params)` with programmatic stream serialization: the grid
/// may be scheduled while the previous kernel in the stream drains, and must
/// call pdl_wait_primary() before reading what that kernel wrote. Capturable.
template <typename Params>
void launch_with_pdl(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                     const Params& params) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = cuda_device_sm() >= 90 ? 1 : 0;  // programmatic launch exists from sm_90
  SP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

/// Opts `kernel` in to `smem_bytes` of dynamic shared memory (and the
/// largest shared-memory carveout) on the current device. The attributes are
/// per function and per device, so this runs once per (kernel, device):
/// setting them on every launch would put a driver call inside graph capture.
template <typename Params>
void configure_smem_once(void (*kernel)(Params), size_t smem_bytes) {
  static std::mutex mutex;
  static std::vector<std::pair<void (*)(Params), int>> configured;
  int device = 0;
  SP_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  if (std::find(configured.begin(), configured.end(), key) != configured.end()) return;
  SP_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  SP_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  configured.push_back(key);
}

/// CTAs of `kernel` (with `threads` threads and `smem_bytes` of dynamic
/// shared memory) resident per multiprocessor of the current device, from
/// the occupancy API, so that registers, shared memory and the kernel's
/// min-blocks hint all count. At least 1. Asked once per (kernel, device).
template <typename Params>
int32_t resident_ctas_once(void (*kernel)(Params), int threads, size_t smem_bytes) {
  configure_smem_once(kernel, smem_bytes);
  static std::mutex mutex;
  static std::vector<std::pair<std::pair<void (*)(Params), int>, int32_t>> known;
  int device = 0;
  SP_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  for (const auto& entry : known) {
    if (entry.first == key) return entry.second;
  }
  int blocks = 0;
  SP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes));
  known.emplace_back(key, std::max(blocks, 1));
  return known.back().second;
}

}  // namespace cuda
}  // namespace sparsepage
