// The serving-step append of a dense cache (DenseKVCache::append_token and,
// for a multi-token step, append_step_tokens): each sequence's new K and V
// rows land at its device-side live length, which then grows by the number
// of tokens. The length is read and advanced on the device, so a captured
// step appends at the right rows on every replay.
#include "core/cuda_hooks.h"
#include "cuda/common.cuh"

namespace sparsepage {
namespace {

constexpr int kAppendThreads = 256;

// One CTA per sequence: every thread reads the old length, the rows of all
// the step's tokens are copied in 4-byte words, and only after the CTA-wide
// barrier does thread 0 publish the new length, so no thread reads a
// half-advanced value.
__global__ void __launch_bounds__(kAppendThreads) append_token_kernel(const __grid_constant__ detail::AppendTokenArgs a) {
  // Launched as a programmatic dependent: wait for the previous kernel (it
  // may have produced the new rows), then let the step's next kernel (the
  // indexer) be scheduled while this one drains; it waits for us in turn.
  cuda::pdl_wait_primary();
  cuda::pdl_launch_dependents();
  const int64_t b = blockIdx.x;
  const int64_t t = a.live_lens[b];
  // Full: nothing is written past the allocation (the host checked; this guards a stale length).
  if (t < 0 || t + a.tokens > a.capacity) return;
  // Token i's rows of sequence b: [tokens, batch, heads] source rows.
  const auto put = [&](void* base, const void* src, int32_t heads, int64_t row_bytes) {
    const int64_t words = row_bytes / 4, per_token = heads * words;
    for (int64_t x = threadIdx.x; x < a.tokens * per_token; x += blockDim.x) {
      const int64_t i = x / per_token, r = x % per_token, h = r / words, w = r % words;
      const uint32_t v = static_cast<const uint32_t*>(src)[((i * a.batch + b) * heads + h) * words + w];
      static_cast<uint32_t*>(base)[((b * heads + h) * a.capacity + t + i) * words + w] = v;
    }
  };
  put(a.k, a.k_new, a.k_heads, a.k_row_bytes);
  put(a.v, a.v_new, a.v_heads, a.v_row_bytes);
  __syncthreads();
  if (threadIdx.x == 0) a.live_lens[b] = static_cast<int32_t>(t + a.tokens);
}

}  // namespace

namespace detail {
void append_token_cuda(const AppendTokenArgs& a, void* stream) {
  if (a.batch < 1 || a.tokens < 1 || a.k_row_bytes % 4 != 0 || a.v_row_bytes % 4 != 0)
    throw Error("append_token: batch and tokens must be at least 1 and rows whole 4-byte words");
  cuda::launch_with_pdl(append_token_kernel, dim3(static_cast<unsigned>(a.batch)), dim3(kAppendThreads), 0,
                        static_cast<cudaStream_t>(stream), a);
}
}  // namespace detail

}  // namespace sparsepage
