// The few CUDA runtime services host code needs, behind plain C++
// signatures. src/cuda/memory.cu implements them; src/core/no_cuda.cc, used
// when the library is built without CUDA, makes each one report that.
#pragma once

#include <cstddef>
#include <cstdint>

#include "sparsepage/types.h"

namespace sparsepage::detail {

bool cuda_device_present();
void* cuda_malloc(size_t bytes);
void cuda_free(void* ptr) noexcept;
/// Synchronous copies; `dst_on_device` / `src_on_device` pick the direction.
void cuda_copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes);
void cuda_copy_2d(void* dst, bool dst_on_device, size_t dst_pitch, const void* src, bool src_on_device,
                  size_t src_pitch, size_t width, size_t height);
void cuda_fill(void* dst, int value, size_t bytes);
/// The same, queued on `stream` (a cudaStream_t; null: the default stream):
/// no host wait, so it can be captured in a CUDA graph.
void cuda_fill_async(void* dst, int value, size_t bytes, void* stream);
/// Waits for the work queued on `stream` (a cudaStream_t; null: the default stream).
void cuda_stream_sync(void* stream);
/// Whether `stream` is being captured into a CUDA graph (work queued on it
/// is recorded, not run).
bool cuda_stream_capturing(void* stream);
/// Records `event` (a cudaEvent_t) on `stream`; a no-op for a null event.
void cuda_record_event(void* event, void* stream);

/// DenseKVCache::append_token and append_step_tokens on the device
/// (src/cuda/cache/cache_append.cu): `tokens` tokens per sequence b written at rows
/// live_lens[b] .. live_lens[b] + tokens - 1 of each head, then live_lens[b]
/// += tokens. A free slot (active[b] == 0) and a sequence without room for
/// all of them are left unchanged.
struct AppendTokenArgs {
  void* k = nullptr;                // [batch, k_heads, capacity] rows of k_row_bytes
  void* v = nullptr;                // [batch, v_heads, capacity] rows of v_row_bytes
  const void* k_new = nullptr;      // [tokens, batch, k_heads] rows
  const void* v_new = nullptr;      // [tokens, batch, v_heads] rows
  int32_t* live_lens = nullptr;     // [batch]
  const int32_t* active = nullptr;  // [batch] 1 active, 0 free; null: every slot active
  int32_t batch = 0, k_heads = 0, v_heads = 0;
  int64_t k_row_bytes = 0, v_row_bytes = 0;  // multiples of 4
  int64_t capacity = 0;
  int32_t tokens = 1;  // rows per sequence, at live_lens[b] .. + tokens - 1
};
void append_token_cuda(const AppendTokenArgs& args, void* stream);

/// The merge of run_mla_sparse_cuda (mla_sparse.h; src/cuda/merge/mla_sparse_merge.cu):
/// request r's partial slots merge_indptr[r] .. merge_indptr[r + 1] of
/// `heads` rows each combine by lse into o and lse, row g's output divided
/// by sum + exp(sink[g] - max) when `sink` is set (decode_merge.cuh's
/// finalize). Request r = b * tokens + t writes o at b * o_seq + (t * heads
/// + g) * o_head. Device pointers; asynchronous on `stream`.
struct MergePartialsArgs {
  DType dtype = DType::kBF16;               // o
  const float* partial_o = nullptr;         // [num_partials, heads, dv]
  const float* partial_lse = nullptr;       // [num_partials, heads]
  const int32_t* merge_indptr = nullptr;    // [num_requests + 1]
  const int32_t* merge_requests = nullptr;  // [num_requests]
  int32_t num_requests = 0, max_partials = 0;
  int32_t heads = 0, tokens = 1, dv = 0;
  int64_t o_seq = 0, o_head = 0;
  void* o = nullptr;
  float* lse = nullptr;         // [num_requests, heads] or null
  const float* sink = nullptr;  // [heads] or null
  float empty_lse = 0.0f;       // the lse of a row that attended nothing
};
void merge_partials_cuda(const MergePartialsArgs& args, void* stream);

}  // namespace sparsepage::detail

#include <cstdint>

#include "sparsepage/decode.h"

namespace sparsepage::detail {

/// Device half of gather_rows (src/cuda/attention/mask_path.cu).
void gather_rows_cuda(const int32_t* rows, const int32_t* offsets, int32_t num_requests, int64_t max_rows, DType dtype,
                      const RowView& pool, int64_t num_pool_rows, void* dst, void* stream);

}  // namespace sparsepage::detail

namespace sparsepage::detail {
/// Device half of build_selection_mask (src/cuda/indexers/selection.cu).
void selection_mask_cuda(const int32_t* positions, const int32_t* offsets, int32_t num_requests, int64_t live_len,
                         float* mask, void* stream);
}  // namespace sparsepage::detail
