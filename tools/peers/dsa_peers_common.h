// Host helpers shared by our two DSA peer drivers (vllm_dsa_step_bench.cu,
// vllm_dsa_prefill_bench.cu): an exit-on-error check, the TMA descriptors
// DeepGEMM's kernels take (built as DeepGEMM's host code builds them), a
// launch configuration with programmatic dependent launch (DeepGEMM launches
// that way), and the drivers' small device-memory helpers. Host code only;
// included by every part of a driver (DeepGEMM's, vLLM's and the driver's
// own), so it needs nothing but the CUDA toolkit.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define DSA_CK(...) \
  do { \
    cudaError_t e_ = (__VA_ARGS__); \
    if (e_ != cudaSuccess) { \
      fprintf(stderr, "CUDA error '%s' at %s:%d: %s\n", #__VA_ARGS__, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(2); \
    } \
  } while (0)

namespace dsa_peers {

/// cuTensorMapEncodeTiled through the runtime's driver entry point: no -lcuda at link time.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    DSA_CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !p) {
      fprintf(stderr, "cuTensorMapEncodeTiled not available from the driver\n");
      exit(2);
    }
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

/// A tiled TMA descriptor of rank 2 or 3 in DeepGEMM's convention: with a
/// swizzle (32, 64 or 128 bytes; 0: none) the inner box is the swizzle width;
/// strides are given in elements (rank - 1 of them) and encoded in bytes; L2
/// promotion 256 B, no out-of-bounds fill.
inline CUtensorMap tma_desc(CUtensorMapDataType dt, int elem, const void* ptr, int rank, const uint64_t* dims,
                            const uint64_t* strides_elems, uint32_t* box, int swizzle) {
  if (swizzle) box[0] = uint32_t(swizzle / elem);
  cuuint64_t gdims[3], gstrides[2];
  cuuint32_t boxd[3], estr[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) gdims[i] = dims[i], boxd[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) gstrides[i] = strides_elems[i] * uint64_t(elem);
  const CUtensorMapSwizzle sw = swizzle == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                : CU_TENSOR_MAP_SWIZZLE_NONE;
  CUtensorMap m;
  const CUresult r = encode_tiled()(&m, dt, cuuint32_t(rank), const_cast<void*>(ptr), gdims, gstrides, boxd, estr,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", int(r));
    exit(2);
  }
  return m;
}

/// A launch with programmatic stream serialization (PDL) on; `attr` must
/// outlive the launch call.
inline cudaLaunchConfig_t pdl_launch_config(dim3 grid, dim3 block, int smem, cudaStream_t s,
                                            cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t c = {};
  c.gridDim = grid;
  c.blockDim = block;
  c.dynamicSmemBytes = size_t(smem);
  c.stream = s;
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = attr;
  c.numAttrs = 1;
  return c;
}

inline float e4m3_to_float(uint8_t b) {
  __nv_fp8_e4m3 v;
  memcpy(&v, &b, 1);
  return float(v);
}

template <typename T>
T* dalloc(size_t n) {
  T* p = nullptr;
  DSA_CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  DSA_CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

/// The error of sampled values against their references: relative L2 over
/// all of them, the largest absolute error and the largest reference
/// magnitude. A value that is not finite counts as an error of 1e30, so a
/// NaN can never pass a bound on rel_l2().
struct ErrorSum {
  double num = 0, den = 0, max_abs = 0, max_ref = 0;
  void add(double got, double ref) {
    double e = got - ref;
    if (!std::isfinite(e)) e = 1e30;
    num += e * e;
    den += ref * ref;
    max_abs = std::max(max_abs, std::fabs(e));
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  double rel_l2() const { return std::sqrt(num / std::max(den, 1e-30)); }
};

/// Fills a check's error fields (peers_common.cuh's CheckResult) from `err`
/// and passes it only when no output was non-finite, rel_l2 < bound, and
/// the references were not all near zero (max_ref > min_ref, so an all-zero
/// reference cannot make any output pass).
template <class Check>
void judge(Check& r, const ErrorSum& err, double bound, double min_ref, const char* what) {
  r.rel_l2 = err.rel_l2();
  r.max_abs = err.max_abs;
  r.max_ref = err.max_ref;
  r.ok = r.nonfinite == 0 && r.rel_l2 < bound && err.max_ref > min_ref;
  if (!r.ok) r.why = std::string(what) + ": nonfinite=" + std::to_string(r.nonfinite) + " rel_l2=" + std::to_string(r.rel_l2);
}

/// Blocks of 256 threads for a grid-stride loop over `threads` items.
inline unsigned grid_for(size_t threads) { return unsigned(std::min<size_t>((threads + 255) / 256, 1u << 30)); }

}  // namespace dsa_peers
