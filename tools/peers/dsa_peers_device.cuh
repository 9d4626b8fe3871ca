// Random inputs for our two DSA peer drivers, made on the device: included
// by each driver's own part only (one translation unit per binary), after
// peers_common.cuh (splitmix64).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace dsa_peers {

/// A uniform value in [-1, 1) from (seed, i).
__device__ inline float hash_uniform(uint64_t seed, uint64_t i) {
  const uint64_t h = peers::splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
  return float(h >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__device__ inline uint8_t to_e4m3(float x) {
  __nv_fp8_e4m3 v(x);  // saturating round-to-nearest
  return *reinterpret_cast<uint8_t*>(&v);
}

/// One warp quantizes index key `key` of 128 values uniform in [-3, 3) as
/// vLLM's indexer cache holds keys: e4m3 values and a power-of-two (ue8m0)
/// scale 2^ceil(log2(amax / 448)), as its indexer_k_quant_and_cache with
/// scale_fmt "ue8m0". Lane l gets values 4 l .. 4 l + 3 in `bytes`; every
/// lane gets the scale.
__device__ inline float warp_fp8_key(uint64_t seed, uint64_t key, uint8_t (&bytes)[4]) {
  const int lane = threadIdx.x % 32;
  float v[4], amax = 0.f;
  for (int i = 0; i < 4; ++i) {
    v[i] = hash_uniform(seed, key * 128 + lane * 4 + i) * 3.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = exp2f(ceilf(log2f(fmaxf(amax, 1e-10f) / 448.f)));
  for (int i = 0; i < 4; ++i) bytes[i] = to_e4m3(v[i] / scale);
  return scale;
}

/// e4m3 values spread over amp x [-1, 1) (index queries).
__global__ void fill_e4m3_kernel(uint8_t* p, size_t n, uint64_t seed, float amp) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = to_e4m3(hash_uniform(seed, i) * amp);
}

__global__ void fill_f32_kernel(float* p, size_t n, uint64_t seed, float amp) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = hash_uniform(seed, i) * amp;
}

}  // namespace dsa_peers
