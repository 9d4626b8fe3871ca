// The split-KV partial kernel (SPEC section 6): one work item per CTA, one
// request's 16-row query tile, tokens [token_begin, token_end) gathered row by
// row into shared memory and reduced with tensor-core MMAs and an online
// softmax. Where a token's row comes from is a policy:
//   PagedSource - the page table (the fused sparse path, decode.cu);
//   DenseSource - a dense [B, H, Cap, D] allocation plus an additive mask
//                 (the mask-path baseline, dense_paths.cu).
// Both share every other line, so the benchmark compares like with like.
//
// Tile: 64 gathered rows per pipeline stage, 4 warps, each warp owning 16 of
// the rows (one m16n8k16 k-step of P.V) with its own softmax state; the warps
// merge once at the end. Query heads are padded to 16 rows with zeros.
// For group sizes below 4 the same MMA path runs on the padded tile: the
// kernel is bound by gathered bytes (16 FLOP/byte even at G = 16, far below
// mma.sync throughput), so the padding costs no time and keeps one code path.
#pragma once

#include "cuda/common.cuh"
#include "sparsepage/plan.h"

namespace sparsepage {
namespace cuda {

constexpr int kTileRows = 64;    // gathered rows per stage (16 per warp)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kQueryTile = 16;   // query heads per CTA: one MMA M tile
constexpr int kIdSlotInts = 64;  // page ids of one tile: 64 tokens span at most 64 pages

/// Page-table row source parameters.
struct PagedTable {
  const int32_t* indptr = nullptr;             // [num_requests + 1]
  const int32_t* indices = nullptr;            // [indptr[num_requests]]
  const int32_t* first_page_offset = nullptr;  // [num_requests] or null (all zero)
  int32_t page_size = 1;
  int32_t page_shift = 0;                      // log2(page_size), or -1 when not a power of two
  int64_t num_pool_pages = 0;
  // Window mode (decode.h): > 0 makes page ids relative to row
  // request * request_row_stride, each position checked against window_len.
  int64_t request_row_stride = 0;
  int64_t window_len = 0;
};

/// Dense-allocation row source parameters: row(b, h, t) = (b * heads + h) * capacity + t per stream.
struct DenseTable {
  int32_t num_kv_heads = 1;
  int32_t k_heads = 0, v_heads = 0, e_heads = 0;
  int64_t k_capacity = 0, v_capacity = 0, e_capacity = 0;
  const float* mask = nullptr;  // [num_requests, live_len] additive, or null
  int64_t live_len = 0;
};

/// Everything the partial kernel reads. Pointers are device pointers.
struct PartialParams {
  const void* q = nullptr;        // [num_requests, group_size, dqk]
  const void* q_extra = nullptr;  // [num_requests, group_size, de] or null
  const void* k = nullptr;        // K pool base
  const void* v = nullptr;        // V pool base (may equal k)
  const void* k_extra = nullptr;  // second K stream base or null
  int64_t k_stride = 0, v_stride = 0, e_stride = 0;  // elements between rows
  int32_t dqk = 0, dv = 0, de = 0;  // dqk + de == the instantiation's DK; dv <= DV
  int32_t group_size = 1;
  bool v_aliases_k = false;       // V is K's first dv columns at K's rows: load rows once
  float scale_log2 = 0.f;         // scale * log2(e)

  // Work: either the plan's list or a uniform split computed from blockIdx.x.
  const WorkItem* work = nullptr;  // [gridDim.x] or null
  int32_t chunks_per_request = 1;  // uniform split: item i -> request i / chunks_per_request
  int32_t chunk_tokens = 0;
  int32_t uniform_len = 0;         // tokens per request in the uniform split

  void* o = nullptr;               // [num_requests, group_size, dv], input dtype
  float* lse = nullptr;            // [num_requests, group_size] or null
  float* partial_o = nullptr;      // [num_partials, group_size, partial_dv]
  float* partial_lse = nullptr;    // [num_partials, group_size]
  int32_t partial_dv = 0;
  uint32_t* error_flag = nullptr;  // set when a page id lies outside the pool; may be null

  PagedTable paged;
  DenseTable dense;
};

/// Work item `item`: the request, its tokens [token_begin, token_end) and
/// its partial slot (-1: write the output), from the plan's list or from the
/// uniform split.
__device__ inline WorkItem resolve_work_item(const PartialParams& p, int32_t item) {
  if (p.work != nullptr) return p.work[item];
  WorkItem w;
  w.request = item / p.chunks_per_request;
  w.token_begin = item % p.chunks_per_request * p.chunk_tokens;
  w.token_end = w.token_begin + max(0, min(p.chunk_tokens, p.uniform_len - w.token_begin));
  w.partial = p.chunks_per_request > 1 ? item : -1;
  return w;
}

template <int DK, int DV, bool kDenseRows>
struct TileConfig {
  // Three stages keep two tiles of gathered rows in flight per CTA; the
  // 192+128 shape drops to two so that two CTAs still fit on an SM, and the
  // 256+256 shape runs one CTA per SM with three. Dense rows (the mask path)
  // at 128+128 stream better from three CTAs of two stages per SM (measured
  // on the H200: 4.3-4.5 TB/s against 3.3-3.9 at batch 8-32), while gathered
  // rows do better with three stages: each source gets its best shape, so
  // the benchmark's baseline is as fast as this kernel can make it.
  static constexpr bool kDense128 = kDenseRows && DK + DV == 256;
  static constexpr int kStages = kDense128 ? 2 : (DK + DV <= 256 || DK + DV > 320) ? 3 : 2;
  static constexpr int kMinBlocks = kDense128 ? 3 : (DK + DV <= 320) ? 2 : 1;
  // Page ids are fetched kStages - 1 tiles ahead of the rows they name.
  static constexpr int kIdSlots = 2 * kStages - 1;
  static constexpr int kStageElems = kTileRows * (DK + DV);
  static constexpr int kReducePitch = DV + 4;  // floats; staggers rows across banks
  static constexpr size_t kStageBytes = size_t{kStages} * kStageElems * 2;
  static constexpr size_t kQBytes = size_t{kQueryTile} * DK * 2;
  static constexpr size_t kIdBytes = size_t{kIdSlots} * kIdSlotInts * 4;
  static constexpr size_t kSmemBytes = kStageBytes + kQBytes + kIdBytes;
  static_assert(size_t{kWarps} * kQueryTile * kReducePitch * 4 <= kStageBytes, "reduction reuses stages");
  // Q fragments stay in registers up to DK = 128; wider tiles re-read them
  // with ldmatrix to leave registers for the DV/2 fp32 accumulators.
  static constexpr bool kQInRegs = DK <= 128;
};

/// Rows from the page table.
struct PagedSource {
  static constexpr bool kHasBias = false;
  static constexpr int64_t k_row0 = 0, v_row0 = 0, e_row0 = 0;  // page rows are absolute
  const int32_t* pages;  // this request's page ids
  int32_t num_pages, first_offset, page_size, page_shift;
  int64_t num_pool_pages;
  int64_t window_row0;     // window mode: the request's first row; else -1
  int64_t window_len;

  __device__ void init(const PartialParams& p, int32_t request) {
    const int32_t begin = p.paged.indptr[request];
    pages = p.paged.indices + max(begin, 0);
    num_pages = p.paged.indptr[request + 1] - begin;
    first_offset = p.paged.first_page_offset ? p.paged.first_page_offset[request] : 0;
    page_size = p.paged.page_size;
    // The structure arrays are device data too: a negative start or an offset
    // outside [0, page_size) rejects every token of the request (NaN and the
    // error flag) instead of reading before `indices`.
    if (begin < 0 || first_offset < 0 || first_offset >= page_size) num_pages = 0;
    page_shift = p.paged.page_shift;
    num_pool_pages = p.paged.num_pool_pages;
    window_row0 = p.paged.request_row_stride > 0 ? request * p.paged.request_row_stride : -1;
    window_len = p.paged.window_len;
  }
  __device__ int32_t page_of(int32_t token) const {
    const int32_t pos = first_offset + token;
    return page_shift >= 0 ? pos >> page_shift : pos / page_size;
  }
  /// Starts the copy of the page ids covering tokens [tok0, tok0 + n).
  __device__ void prefetch(int32_t* slot, int32_t tok0, int32_t n, int tid) const {
    const int32_t p0 = page_of(tok0);
    const int32_t count = min(page_of(tok0 + n - 1), num_pages - 1) - p0 + 1;
    if (tid < count) cp_async_4(smem_u32(slot + tid), pages + p0 + tid);
  }
  /// Pool row of `token` (64-bit), or -1 when its page id is outside the
  /// pool (or its position outside the request's window).
  __device__ int64_t row(const int32_t* slot, int32_t tok0, int32_t token) const {
    const int32_t page_idx = page_of(token);
    if (page_idx >= num_pages) return -1;  // a table shorter than the plan's counts
    const int32_t page = slot[page_idx - page_of(tok0)];
    const int64_t r = int64_t{page} * page_size + (first_offset + token - page_idx * page_size);
    if (window_row0 >= 0) return page < 0 || r >= window_len ? -1 : window_row0 + r;
    return page < 0 || page >= num_pool_pages ? -1 : r;
  }
  __device__ float bias(const int32_t*, int) const { return 0.f; }
};

/// Rows from a dense allocation; the slot carries the tile's mask values.
struct DenseSource {
  static constexpr bool kHasBias = true;
  const float* mask;  // this request's mask row, or null
  int64_t k_row0, v_row0, e_row0;

  __device__ void init(const PartialParams& p, int32_t request) {
    const DenseTable& d = p.dense;
    const int64_t b = request / d.num_kv_heads, h = request % d.num_kv_heads;
    k_row0 = (b * d.k_heads + h) * d.k_capacity;
    v_row0 = (b * d.v_heads + h) * d.v_capacity;
    e_row0 = (b * d.e_heads + h) * d.e_capacity;
    mask = d.mask ? d.mask + request * d.live_len : nullptr;
  }
  __device__ void prefetch(int32_t* slot, int32_t tok0, int32_t n, int tid) const {
    if (mask && tid < n) cp_async_4(smem_u32(slot + tid), mask + tok0 + tid);
  }
  __device__ int64_t row(const int32_t*, int32_t, int32_t token) const { return token; }
  __device__ float bias(const int32_t* slot, int key) const { return mask ? __int_as_float(slot[key]) : 0.f; }
};

}  // namespace cuda
}  // namespace sparsepage

#include "cuda/decode_partial_body.cuh"
