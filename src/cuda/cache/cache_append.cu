// The serving-step append of a dense cache (DenseKVCache::append_token and,
// for a multi-token step, append_step_tokens): each sequence's new K and V
// rows land at its device-side live length, which then grows by the number
// of tokens. The length is read and advanced on the device, so a captured
// step appends at the right rows on every replay.
#include <cstdint>
#include <string>

#include "core/cuda_hooks.h"
#include "cuda/primitives/common.cuh"

namespace sparsepage {
namespace {

constexpr int kAppendThreads = 256;
constexpr int kAppendBatch = 4;  // words per thread loaded before any is stored

// One CTA per sequence. The step's critical path runs through this kernel,
// so it costs two memory round trips: the length and a batch of source
// words are requested together (the sources do not depend on the length),
// then the words are stored at the length. Word is uint4 when every row is
// whole 16-byte pieces (and the pointers allow it), else 4-byte words.
// Only after the CTA-wide barrier does thread 0 publish the new length, so
// no thread reads a half-advanced value.
template <typename Word>
__global__ void __launch_bounds__(kAppendThreads)
    append_token_kernel(const __grid_constant__ detail::AppendTokenArgs a) {
  // Launched as a programmatic dependent: wait for the previous kernel (it
  // may have produced the new rows), then let the step's next kernel (the
  // indexer) be scheduled while this one drains; it waits for us in turn.
  cuda::pdl_wait_primary();
  cuda::pdl_launch_dependents();
  const int b = blockIdx.x;
  const int k_words = static_cast<int>(a.k_row_bytes / sizeof(Word));
  const int v_words = static_cast<int>(a.v_row_bytes / sizeof(Word));
  const int k_per_token = a.k_heads * k_words;
  const int per_token = k_per_token + a.v_heads * v_words;
  const int total = a.tokens * per_token;  // append_token_cuda bounds it
  const int64_t t = a.live_lens[b];
  const bool active = a.active == nullptr || a.active[b] != 0;
  // A free slot writes nothing and keeps its length. A full slot, or a
  // length no append could have left (a captured step replayed past the
  // capacity reserved before capture), writes nothing and its length
  // becomes -1, so the step's decode flags this sequence and
  // sync_live_len names it, rather than attending without the token. The
  // same for every thread.
  const bool room = active && t >= 0 && t + a.tokens <= a.capacity;
  // Word x of the step: token i, then K's heads, then V's; row h, word w.
  // Source rows are [tokens, batch, heads], destination rows [batch, heads,
  // capacity], token i at row t + i.
  for (int x0 = 0; x0 < total; x0 += kAppendThreads * kAppendBatch) {
    Word word[kAppendBatch];
    int64_t at[kAppendBatch];  // destination word, counted from row 0 rather than t
    bool to_k[kAppendBatch];
#pragma unroll
    for (int u = 0; u < kAppendBatch; ++u) {
      const int x = x0 + u * kAppendThreads + static_cast<int>(threadIdx.x);
      if (x >= total) break;
      const int i = x / per_token;
      int r = x - i * per_token;
      to_k[u] = r < k_per_token;
      if (!to_k[u]) r -= k_per_token;
      const int heads = to_k[u] ? a.k_heads : a.v_heads, words = to_k[u] ? k_words : v_words;
      const int h = r / words, w = r - h * words;
      const Word* src = static_cast<const Word*>(to_k[u] ? a.k_new : a.v_new);
      word[u] = src[((int64_t{i} * a.batch + b) * heads + h) * words + w];
      at[u] = ((int64_t{b} * heads + h) * a.capacity + i) * words + w;
    }
    if (!room) break;  // tested only now, so the loads above were in flight with the length's
#pragma unroll
    for (int u = 0; u < kAppendBatch; ++u) {
      if (x0 + u * kAppendThreads + static_cast<int>(threadIdx.x) >= total) break;
      if (to_k[u])
        static_cast<Word*>(a.k)[at[u] + t * k_words] = word[u];
      else
        static_cast<Word*>(a.v)[at[u] + t * v_words] = word[u];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && active) a.live_lens[b] = room ? static_cast<int32_t>(t + a.tokens) : -1;
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

namespace detail {
void append_token_cuda(const AppendTokenArgs& a, void* stream) {
  if (a.batch < 1 || a.tokens < 1 || a.k_row_bytes % 4 != 0 || a.v_row_bytes % 4 != 0)
    throw Error("append_token: batch and tokens must be at least 1 and rows whole 4-byte words");
  // The kernel counts a sequence's words in int, a batch of them past the last.
  const int64_t words =
      int64_t{a.tokens} * (int64_t{a.k_heads} * a.k_row_bytes + int64_t{a.v_heads} * a.v_row_bytes) / 4;
  if (words > INT32_MAX - kAppendThreads * kAppendBatch)
    throw Error("append_token: " + std::to_string(words) + " 4-byte words per sequence are too many");
  if (!aligned(a.k_new, 4) || !aligned(a.v_new, 4)) throw Error("append_token: k_new and v_new must be 4-byte aligned");
  const bool wide = a.k_row_bytes % 16 == 0 && a.v_row_bytes % 16 == 0 && aligned(a.k, 16) && aligned(a.v, 16) &&
                    aligned(a.k_new, 16) && aligned(a.v_new, 16);
  const dim3 grid(static_cast<unsigned>(a.batch));
  auto s = static_cast<cudaStream_t>(stream);
  if (wide)
    cuda::launch_with_pdl(append_token_kernel<uint4>, grid, dim3(kAppendThreads), 0, s, a);
  else
    cuda::launch_with_pdl(append_token_kernel<uint32_t>, grid, dim3(kAppendThreads), 0, s, a);
}
}  // namespace detail

}  // namespace sparsepage
