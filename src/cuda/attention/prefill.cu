// The sparse prefill's small kernels around the fused decode
// (core/prefill_kernels.h): each query token's or query block's window, the
// MLA epilogue (lse convention and attention sink), the lse and the FP8
// scales of per-query-head launches, and the DSA indexer's pass lengths. Each
// is one plain launch on the caller's stream, grid-stride over its outputs:
// no allocation, no synchronization, no host read, so a captured chunk
// replays them.
#include <algorithm>

#include "core/prefill_kernels.h"
#include "cuda/primitives/common.cuh"

namespace sparsepage::detail {
namespace {

constexpr int kThreads = 256;

int grid_for(int64_t total) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((total + kThreads - 1) / kThreads, 132 * 16)));
}

__device__ __forceinline__ int64_t length_of(const PrefillChunk& c, int64_t b) {
  return c.kv_lens != nullptr ? int64_t{c.kv_lens[b]} : c.kv_len;
}

__global__ void token_windows_kernel(const TokenWindowsArgs a) {
  const int64_t total = int64_t{a.chunk.batch} * a.chunk.num_tokens;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / a.chunk.num_tokens, t = i % a.chunk.num_tokens;
    const int64_t len = length_of(a.chunk, b);
    a.windows[i] = !a.causal                  ? static_cast<int32_t>(len)
                   : len < a.chunk.num_tokens ? 0
                                              : static_cast<int32_t>(len - a.chunk.num_tokens + t + 1);
  }
}

__global__ void block_windows_kernel(const BlockWindowsArgs a) {
  const int32_t blocks = (a.chunk.num_tokens + a.block_size - 1) / a.block_size;
  const int64_t total = int64_t{a.chunk.batch} * blocks;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / blocks, q = i % blocks;
    const int64_t start = length_of(a.chunk, b) - a.chunk.num_tokens;
    const bool bad = start < 0 || start % a.block_size != 0;
    if (bad && q == 0 && a.bad_chunk != nullptr) atomicOr(a.bad_chunk, 1u);
    a.windows[i] =
        bad ? 0 : static_cast<int32_t>(start + min(int64_t{(q + 1) * a.block_size}, int64_t{a.chunk.num_tokens}));
  }
}

// One warp per (sequence, token, head) row: the lse convention, and the
// sink's factor over the row's outputs (16-byte pieces, 8 values each).
template <typename T>
__global__ void mla_epilogue_kernel(const MlaEpilogueArgs a) {
  using Tr = cuda::ElemTraits<T>;
  // Launched behind the decode or the prefill's attention with PDL: once
  // the wait returns the previous grid is complete, and so is everything
  // before it, because every PDL-launched kernel of the library waits the
  // same way at entry, in every CTA, before it reads or writes.
  cuda::pdl_wait_primary();
  const int lane = threadIdx.x % 32;
  const int64_t rows = int64_t{a.batch} * a.num_tokens * a.num_heads;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int32_t h = static_cast<int32_t>(r % a.num_heads);
    const int64_t t = (r / a.num_heads) % a.num_tokens, b = r / (int64_t{a.num_heads} * a.num_tokens);
    const float lse = a.lse_in[r];
    const bool empty = lse == cuda::neg_inf_f32();
    if (a.sink != nullptr) {
      // exp(lse) / (exp(lse) + exp(sink)); nothing attended: 0 whatever the sink.
      const float factor = empty ? 0.0f : 1.0f / (1.0f + expf(a.sink[h] - lse));
      T* o = static_cast<T*>(a.out) + b * a.out_seq + t * a.out_token + int64_t{h} * a.out_head;
      for (int piece = lane; piece < a.dim / 8; piece += 32) {
        uint4 v = reinterpret_cast<const uint4*>(o)[piece];
        T* x = reinterpret_cast<T*>(&v);
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = Tr::from_float(Tr::to_float(x[e]) * factor);
        reinterpret_cast<uint4*>(o)[piece] = v;
      }
    }
    if (lane == 0 && a.lse_out != nullptr) a.lse_out[r] = empty ? __int_as_float(0x7f800000) : lse;
  }
}

__global__ void lse_gather_kernel(const LseGatherArgs a) {
  const int32_t heads = a.num_kv_heads * a.group_size;
  const int64_t total = int64_t{a.batch} * a.num_tokens * heads;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t h = i % heads, t = (i / heads) % a.num_tokens, b = i / (int64_t{heads} * a.num_tokens);
    const int64_t kv = h / a.group_size, g = h % a.group_size;
    a.lse[i] = a.staged[((b * a.num_kv_heads + kv) * a.num_tokens + t) * a.group_size + g];
  }
}

__global__ void scale_expand_kernel(const ScaleExpandArgs a) {
  const int64_t per_stream = int64_t{a.num_kv_heads} * a.group_size;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < 2 * per_stream;
       i += int64_t{gridDim.x} * blockDim.x) {
    const bool v = i >= per_stream;
    a.expanded[i] = (v ? a.v_scale : a.k_scale)[(v ? i - per_stream : i) / a.group_size];
  }
}

__global__ void pass_lens_kernel(const PassLensArgs a) {
  const int64_t total = int64_t{a.chunk.batch} * a.passes;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / a.passes, pass = i % a.passes;
    const int64_t len = length_of(a.chunk, b);
    a.lens[i] =
        static_cast<int32_t>(len - a.chunk.num_tokens + min(int64_t{a.chunk.num_tokens}, (pass + 1) * a.rows_per_pass));
  }
}

}  // namespace

void token_windows_cuda(const TokenWindowsArgs& a, void* stream) {
  const int64_t total = int64_t{a.chunk.batch} * a.chunk.num_tokens;
  token_windows_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

void block_windows_cuda(const BlockWindowsArgs& a, void* stream) {
  const int64_t total = int64_t{a.chunk.batch} * ((a.chunk.num_tokens + a.block_size - 1) / a.block_size);
  block_windows_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

void mla_epilogue_cuda(const MlaEpilogueArgs& a, void* stream) {
  if (a.dim % 8 != 0) throw Error("MlaSparsePrefill: the epilogue reads rows of whole 16-byte pieces");
  if (a.sink != nullptr &&
      ((a.out_seq | a.out_token | a.out_head) % 8 != 0 || reinterpret_cast<uintptr_t>(a.out) % 16 != 0)) {
    throw Error("MlaSparsePrefill: with an attention sink, out and its strides must be 16-byte aligned");
  }
  const int64_t rows = int64_t{a.batch} * a.num_tokens * a.num_heads;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + 7) / 8, 132 * 16)));
  auto s = static_cast<cudaStream_t>(stream);
  if (a.dtype == DType::kBF16) {
    cuda::launch_with_pdl(mla_epilogue_kernel<__nv_bfloat16>, dim3(blocks), dim3(kThreads), 0, s, a);
  } else {
    cuda::launch_with_pdl(mla_epilogue_kernel<__half>, dim3(blocks), dim3(kThreads), 0, s, a);
  }
  SP_CUDA_CHECK_LAUNCH();
}

void lse_gather_cuda(const LseGatherArgs& a, void* stream) {
  const int64_t total = int64_t{a.batch} * a.num_tokens * a.num_kv_heads * a.group_size;
  lse_gather_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

void scale_expand_cuda(const ScaleExpandArgs& a, void* stream) {
  const int64_t total = 2 * int64_t{a.num_kv_heads} * a.group_size;
  scale_expand_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

void pass_lens_cuda(const PassLensArgs& a, void* stream) {
  const int64_t total = int64_t{a.chunk.batch} * a.passes;
  pass_lens_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage::detail
