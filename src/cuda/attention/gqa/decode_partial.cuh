// The split-KV partial kernel (docs/DESIGN.md: the paged decode): one work item per CTA, one
// request's 16-row query tile, tokens [token_begin, token_end) gathered row by
// row into shared memory and reduced with tensor-core MMAs and an online
// softmax. Where a token's row comes from is a policy:
//   PagedSource - the page table (the fused sparse path, decode.cu);
//   DenseSource - a dense [B, H, Cap, D] allocation plus an additive mask
//                 (the mask-path baseline, mask_path.cu).
// Both share every other line, so the benchmark compares like with like.
//
// Tile: 64 gathered rows per pipeline stage, 4 warps, each warp owning 16 of
// the rows (one m16n8k16 k-step of P.V) with its own softmax state; the warps
// merge once at the end. Query heads are padded to 16 rows with zeros.
// For group sizes below 4 the same MMA path runs on the padded tile: the
// kernel is bound by gathered bytes (16 FLOP/byte even at G = 16, far below
// mma.sync throughput), so the padding costs no time and keeps one code path.
#pragma once

#include "cuda/attention/padded_keys.h"
#include "cuda/merge/decode_merge.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/wgmma.cuh"
#include "sparsepage/decode.h"
#include "sparsepage/plan.h"

namespace sparsepage {
namespace cuda {

constexpr int kTileRows = 64;  // gathered rows per stage (16 per warp)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kQueryTile = 16;   // query heads per CTA: one MMA M tile
constexpr int kIdSlotInts = 64;  // page ids of one tile: 64 tokens span at most 64 pages

// What a source's row() returns instead of a row: a rejected token (a page
// id outside the pool or a position outside the window: the request's
// output becomes NaN and the error flag is set), or a masked-out token (not
// read at all: its shared-memory row is zero-filled, so whatever the cache
// holds there, NaN included, contributes nothing).
constexpr int64_t kRejectedRow = -1;
constexpr int64_t kMaskedRow = -2;

/// Raises the workspace error flag (decode.h's DecodeErrors): word 0 ORs the
/// kinds, word 1 keeps the lowest request that met one (0xFFFFFFFF: none).
/// `flag` may be null (no flag: the output's NaN is the only sign).
__device__ inline void report_decode_error(uint32_t* flag, int32_t request, uint32_t kinds) {
  if (flag == nullptr) return;
  atomicOr(flag, kinds);
  atomicMin(flag + 1, static_cast<uint32_t>(request));
}

/// Page-table row source parameters (decode.h's DecodeParams, device side).
struct PagedTable {
  const int32_t* indptr = nullptr;             // kCsr: [num_requests + 1]
  const int32_t* indices = nullptr;            // kCsr: [indptr[num_requests]]; kMatrix: the matrix
  const int32_t* first_page_offset = nullptr;  // [num_requests] or null (all zero)
  const int32_t* seq_lens = nullptr;           // visible tokens (clip the plan's items); may be null
  bool lens_per_sequence = false;              // seq_lens[b] instead of seq_lens[r]
  int32_t page_size = 1;
  int32_t page_shift = 0;      // log2(page_size), or -1 when not a power of two
  int64_t num_pool_pages = 0;  // pool mode: ids in [0, num_pool_pages)
  PageAddressing addressing = PageAddressing::kPoolPages;
  // -1 ids are padding: their tokens are skipped (IndexPadding::kMinusOneSkips).
  bool skip_minus_one = false;
  // kMatrix (decode.h): request (b, h) reads index_width ids at
  // indices + b * index_seq_stride + h * index_head_stride.
  bool matrix = false;
  int32_t index_width = 0;
  int64_t index_seq_stride = 0, index_head_stride = 0;
  // Window mode (decode.h): ids are pages of the request's own rows and
  // every position is checked against its sequence's live length.
  const int32_t* window_lens = nullptr;  // [num_sequences] or null: window_len for all
  int64_t window_len = 0;
  // The most any window_lens entry may say (the host's bound, decode.h:
  // window_lens): the rows each (sequence, head) holds in window mode, the
  // table's positions in block-table mode. Past it (or negative) the
  // request's length is out of range: flagged, its output NaN, nothing read.
  int64_t max_window_len = 0;
  // Block-table mode (decode.h): ids are pages of the sequence's positions.
  BlockTable block_table;
  int32_t block_shift = 0;  // log2(block_size), or -1
};

/// Dense-allocation row source parameters: token t of a request is row t of
/// its (sequence, head) rows; an optional additive mask.
struct DenseTable {
  const float* mask = nullptr;         // [num_requests, mask_pitch] additive, or null
  int64_t mask_pitch = 0;              // floats between requests' mask rows
  const int32_t* live_lens = nullptr;  // [num_sequences] live tokens, or null: the uniform split's length
};

/// What the partial kernel reads whatever its row source. Pointers are device
/// pointers. Request r is (sequence r / num_kv_heads, head r % num_kv_heads);
/// each stream's rows for it start at base + seq * seq_stride + head * head_stride.
struct PartialCommon {
  const void* q = nullptr;                           // [num_requests, group_size, dqk]
  const void* q_extra = nullptr;                     // [num_requests, group_size, de] or null
  const void* k = nullptr;                           // K pool base
  const void* v = nullptr;                           // V pool base (may equal k)
  const void* k_extra = nullptr;                     // second K stream base or null
  int64_t k_stride = 0, v_stride = 0, e_stride = 0;  // elements between rows
  int64_t k_seq = 0, v_seq = 0, e_seq = 0;           // elements between sequences
  int64_t k_head = 0, v_head = 0, e_head = 0;        // elements between KV heads
  int32_t num_kv_heads = 1;
  int32_t dqk = 0, dv = 0, de = 0;  // dqk + de == the instantiation's DK; dv <= DV
  int32_t group_size = 1;
  // q, q_extra and o (decode.h's QueryStrides, elements): query head g of
  // request r at (r / num_kv_heads) * *_seq + ((r % num_kv_heads) * group_size + g) * *_head.
  int64_t q_seq = 0, q_head = 0, qe_seq = 0, qe_head = 0, o_seq = 0, o_head = 0;
  bool v_aliases_k = false;  // V is K's first dv columns at K's rows: load rows once
  float scale_log2 = 0.f;    // scale * log2(e)
  // Multi-token steps (decode.h's q_len): a request's query rows are q_len
  // tokens x group_size heads, row i = token i / group_size, head i %
  // group_size; token t adds t * *_tok to its q, q_extra and o addresses and
  // sees positions below the sequence's live length - (q_len - 1 - t).
  int32_t q_len = 1;
  int64_t q_tok = 0, qe_tok = 0, o_tok = 0;

  // Work: either the plan's list or a uniform split computed from blockIdx.x.
  const WorkItem* work = nullptr;  // [num_items] or null
  int32_t num_items = 0;           // the list's items: the last of a request knows its planned count
  int32_t chunks_per_request = 1;  // uniform split: item i -> request i / chunks_per_request
  int32_t chunk_tokens = 0;
  int32_t uniform_len = 0;    // tokens per request in the uniform split (an upper bound with live_lens)
  bool balance_live = false;  // uniform split: chunks share the request's visible tokens (open_item)

  void* o = nullptr;             // [num_requests, group_size, dv], input dtype
  float* lse = nullptr;          // [num_requests, group_size] or null
  float* partial_o = nullptr;    // [num_partials, group_size, partial_dv]
  float* partial_lse = nullptr;  // [num_partials, group_size]
  int32_t partial_dv = 0;
  uint32_t* error_flag = nullptr;  // uint32 [2] (report_decode_error); may be null
};

/// The partial kernel's params for one row source: the common fields and
/// that source's table (PagedTable or DenseTable), one struct per kernel.
template <class Table>
struct PartialParams : PartialCommon {
  Table table;
};

/// Element offset of query head `head` of `request` in a q-shaped view.
__device__ inline int64_t head_offset(const PartialCommon& p, int64_t seq_stride, int64_t head_stride, int32_t request,
                                      int32_t head) {
  const int32_t seq = request / p.num_kv_heads;
  return seq * seq_stride + (int64_t{request - seq * p.num_kv_heads} * p.group_size + head) * head_stride;
}

/// Element offset of query row `row` (token row / group_size, head row %
/// group_size) of `request` in a q-shaped view with a token stride.
__device__ inline int64_t query_row_offset(const PartialCommon& p, int64_t seq_stride, int64_t token_stride,
                                           int64_t head_stride, int32_t request, int32_t row) {
  const int32_t token = row / p.group_size;
  return head_offset(p, seq_stride, head_stride, request, row - token * p.group_size) + token * token_stride;
}

/// Where query row `row` of `request` keeps its lse: [num_sequences, q_len,
/// num_kv_heads, group_size] (request * group_size + row when q_len = 1).
__device__ inline int64_t lse_row(const PartialCommon& p, int32_t request, int32_t row) {
  const int32_t seq = request / p.num_kv_heads, token = row / p.group_size;
  return ((int64_t{seq} * p.q_len + token) * p.num_kv_heads + (request - seq * p.num_kv_heads)) * p.group_size +
         (row - token * p.group_size);
}

/// Work item `item`: the request, its tokens [token_begin, token_end) and
/// its partial slot (-1: write the output), from the plan's list or from the
/// uniform split.
__device__ inline WorkItem resolve_work_item(const PartialCommon& p, int32_t item) {
  if (p.work != nullptr) return p.work[item];
  WorkItem w;
  w.request = item / p.chunks_per_request;
  w.token_begin = item % p.chunks_per_request * p.chunk_tokens;
  w.token_end = w.token_begin + max(0, min(p.chunk_tokens, p.uniform_len - w.token_begin));
  w.partial = p.chunks_per_request > 1 ? item : -1;
  return w;
}

/// One CTA's share of the work: its request, where that request's rows
/// start in each stream, and its tokens clipped to what the request sees
/// now (the plan may have been made for more: an empty share still writes
/// its o = 0, lse = -inf partial, which the merge ignores).
template <typename T>
struct ItemShare {
  int32_t request, tok_begin, len, partial;
  const T* k_base;
  const T* v_base;
  const T* e_base;  // null without a second stream
};

/// The count the plan was made for item `index`'s request when this item
/// knows it (the uniform split's length; a list's last item of the
/// request), else -1.
__device__ inline int64_t planned_count(const PartialCommon& p, int32_t index, const WorkItem& w) {
  if (p.work == nullptr) return p.uniform_len;
  const bool last = index + 1 >= p.num_items || p.work[index + 1].request != w.request;
  return last ? w.token_end : -1;
}

/// Every kernel opens its work item here, so the device-side lengths are
/// judged in one place (docs/RELIABILITY.md, "what is checked where"). The
/// arithmetic is 64-bit: no int32 length can wrap the share's token count.
/// A length out of its range poisons the request: the source rejects every
/// token and the share keeps at least one, so the kernel's own path for a
/// rejected token writes NaN (o and lse) and raises the flag (report_rejected,
/// which names the kind), and nothing is read. (Raising the flag here
/// instead cost the FP8 MLA CTA pairs' producers a register spill.)
template <typename T, class Source>
__device__ inline ItemShare<T> open_item(const typename Source::Params& p, int32_t index, Source& src) {
  const WorkItem w = resolve_work_item(p, index);
  ItemShare<T> s;
  s.request = w.request;
  s.partial = w.partial;
  s.tok_begin = w.token_begin;
  const int64_t seq = w.request / p.num_kv_heads, head = w.request % p.num_kv_heads;
  const bool lengths_ok = src.init(p, w.request, seq, head, planned_count(p, index, w));
  const int64_t visible = src.visible_tokens();
  int64_t begin = w.token_begin;
  if (p.balance_live && lengths_ok && p.work == nullptr && p.chunks_per_request > 1) {
    // The uniform split was planned for the bound; a request that sees
    // fewer rows (a ragged batch, a selection narrower than its table)
    // shares them evenly among its chunks, so its first chunks do not carry
    // them alone. Equal to the planned chunks when the request sees the
    // bound. (visible <= uniform_len < 2^31 here: 32-bit arithmetic.)
    const int32_t seen = static_cast<int32_t>(visible);
    const int32_t per = (seen + p.chunks_per_request - 1) / p.chunks_per_request;
    const int32_t chunk = (per + kTileRows - 1) / kTileRows * kTileRows;
    s.tok_begin = min(index % p.chunks_per_request * chunk, seen);
    s.len = min(chunk, seen - s.tok_begin);
  } else {
    s.len = static_cast<int32_t>(max(int64_t{0}, min(int64_t{w.token_end}, visible) - begin));
  }
  if (!lengths_ok) s.len = max(s.len, 1);
  s.k_base = static_cast<const T*>(p.k) + seq * p.k_seq + head * p.k_head;
  s.v_base = static_cast<const T*>(p.v) + seq * p.v_seq + head * p.v_head;
  s.e_base = p.k_extra ? static_cast<const T*>(p.k_extra) + seq * p.e_seq + head * p.e_head : nullptr;
  return s;
}

template <int DK, int DV, bool kDenseRows>
struct TileConfig {
  // Three stages keep two tiles of gathered rows in flight per CTA; the
  // 192+128 shape drops to two so that two CTAs still fit on an SM, and the
  // 256+256 shape runs one CTA per SM with three. Dense rows (the mask path)
  // at 128+128 stream better from three CTAs of two stages per SM (so it
  // measured on the H200 at batch 8-32), while gathered
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
  /// Where the copies put 16-byte chunk `chunk` of tile row `row` (elements
  /// from the tile's start; rows of `chunks` chunks): the ldmatrix layout.
  /// The wgmma multi-token CTA brings its own (decode_partial_multi_wgmma.cuh).
  __device__ static int tile_offset(int row, int chunk, int chunks) { return swizzle(row, chunk, chunks); }
};

/// Rows from the page table. `kEngineInputs` adds the engines' own index
/// forms (decode.h): an index matrix, -1 padding that is skipped, block-table
/// addressing and per-sequence lengths. They are a separate instantiation so
/// that the CSR table over a pool or a window, the library's own step, keeps
/// a row lookup with none of their branches or registers.
template <bool kEngineInputs>
struct PagedSourceT {
  using Params = PartialParams<PagedTable>;
  static constexpr bool kHasBias = false;
  static constexpr bool kMaySkip = kEngineInputs;  // -1 padding (IndexPadding::kMinusOneSkips)
  const int32_t* pages;                            // this request's page ids
  const int32_t* table_row;                        // block-table mode: this sequence's row (null: reject every token)
  int32_t num_pages, first_offset, page_size, page_shift, seq_len;
  int64_t num_pool_pages;
  PageAddressing addressing;
  bool skip_minus_one;
  int64_t window_len;  // window mode: the sequence's live length

  /// Reads the request's lengths and offsets; false when one is out of
  /// range (every token is then rejected). `planned`: the request's planned
  /// count, or -1 when this item does not know it.
  __device__ bool init(const Params& p, int32_t request, int64_t seq, int64_t head, int64_t planned) {
    const PagedTable& t = p.table;
    first_offset = t.first_page_offset ? t.first_page_offset[request] : 0;
    page_size = t.page_size;
    bool matrix = false;
    if constexpr (kEngineInputs) matrix = t.matrix;
    // The structure arrays are device data too: a negative start, a
    // decreasing indptr or an offset outside [0, page_size) rejects every
    // token of the request instead of reading before `indices`.
    bool ok = first_offset >= 0 && first_offset < page_size;
    if (matrix) {
      pages = t.indices + seq * t.index_seq_stride + head * t.index_head_stride;
      num_pages = t.index_width;
    } else {
      const int64_t begin = t.indptr[request], end = t.indptr[request + 1];
      ok = ok && begin >= 0 && end >= begin;
      pages = t.indices + (ok ? begin : 0);
      num_pages = static_cast<int32_t>(end - begin);
    }
    bool per_sequence = false;
    if constexpr (kEngineInputs) per_sequence = t.lens_per_sequence;
    seq_len = t.seq_lens ? t.seq_lens[per_sequence ? seq : request] : INT32_MAX;
    // Visible tokens in [0, the plan's count] (a negative one would make the
    // item's share wrap; a larger one would be silently cut by the plan).
    ok = ok && seq_len >= 0 && (t.seq_lens == nullptr || planned < 0 || seq_len <= planned);
    page_shift = t.page_shift;
    num_pool_pages = t.num_pool_pages;
    addressing = t.addressing;
    skip_minus_one = kEngineInputs && t.skip_minus_one;
    window_len = t.window_len;
    // The live length: only window and block-table ids are positions. Past
    // the host's bound a window would reach the next head's rows.
    if (t.window_lens != nullptr && addressing != PageAddressing::kPoolPages) {
      window_len = t.window_lens[seq];
      ok = ok && window_len >= 0 && window_len <= t.max_window_len;
    }
    if (!ok) {  // every token's page index (from offset 0) is then past the table: rejected
      num_pages = 0;
      first_offset = 0;
    }
    table_row = nullptr;
    if constexpr (kEngineInputs) {
      if (addressing == PageAddressing::kBlockTable) {
        const BlockTable& bt = t.block_table;
        const int32_t row = bt.row_of_sequence ? bt.row_of_sequence[seq] : static_cast<int32_t>(seq);
        if (row >= 0 && row < bt.num_rows) table_row = bt.data + row * bt.row_stride;
      }
    }
    return ok;
  }
  /// The request's visible tokens now (a plan made for more is clipped).
  __device__ int32_t visible_tokens() const { return seq_len; }
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
  /// Row of `token` in its stream (64-bit); kRejectedRow when its page id is
  /// outside the pool (or its position outside the request's window or
  /// block-table row, or its block outside the pool); kMaskedRow for a
  /// padding (-1) id that is skipped.
  __device__ int64_t row(const int32_t* slot, int32_t tok0, int32_t token, const Params& p) const {
    const int32_t page_idx = page_of(token);
    if (page_idx >= num_pages) return kRejectedRow;  // a table shorter than the visible count
    const int32_t page = slot[page_idx - page_of(tok0)];
    if constexpr (kEngineInputs) {
      if (page == -1 && skip_minus_one) return kMaskedRow;
    }
    const int64_t pos = int64_t{page} * page_size + (first_offset + token - page_idx * page_size);
    if (addressing == PageAddressing::kWindow) return page < 0 || pos >= window_len ? kRejectedRow : pos;
    if constexpr (kEngineInputs) {
      if (addressing == PageAddressing::kBlockTable) {
        // The engine's conversion launch, done here: position -> block -> pool row.
        const BlockTable& bt = p.table.block_table;
        if (page < 0 || table_row == nullptr || pos >= int64_t{bt.max_blocks} * bt.block_size) return kRejectedRow;
        const int32_t shift = p.table.block_shift;
        const int64_t entry = shift >= 0 ? pos >> shift : pos / bt.block_size;
        const int32_t block = __ldg(table_row + entry);
        if (block < 0 || block >= bt.num_blocks) return kRejectedRow;
        return int64_t{block} * bt.block_size + (pos - entry * bt.block_size);
      }
    }
    return page < 0 || page >= num_pool_pages ? kRejectedRow : pos;
  }
  /// The position (in its sequence) of `token` of the tile at tok0, its
  /// page ids in `slot`: what a multi-token step's causal limit compares.
  /// Window and block-table ids are positions. Only for tokens the tile holds.
  __device__ int64_t position(const int32_t* slot, int32_t tok0, int32_t token) const {
    const int32_t page_idx = page_of(token);
    const int32_t page = slot[page_idx - page_of(tok0)];
    return int64_t{page} * page_size + (first_offset + token - page_idx * page_size);
  }
  /// The sequence's live length, against which the causal limit is taken.
  __device__ int64_t live_len() const { return window_len; }
  /// Whether `token` of the tile at tok0 (its ids in `slot`) is padding and
  /// stays out of the softmax. Only for tokens the tile holds.
  __device__ bool skipped(const int32_t* slot, int32_t tok0, int32_t token) const {
    return kEngineInputs && skip_minus_one && slot[page_of(token) - page_of(tok0)] == -1;
  }
  /// skipped() for the 2 kGroups keys first_key + 8 g + e (g < kGroups,
  /// e < 2) of the tile at tok0 that holds `n` tokens, as bit 2 g + e
  /// (padded_key_pairs): the tile's page arithmetic done once, with the
  /// division only where page_size is not a power of two. (The MLA softmax
  /// asks for its eight keys in one call; per key, each call carried both
  /// paths of page_of.)
  template <int kGroups>
  __device__ uint32_t skipped_pairs(const int32_t* slot, int32_t tok0, int32_t first_key, int32_t n) const {
    if (!(kEngineInputs && skip_minus_one)) return 0;
    return padded_key_pairs<kGroups>(slot, first_offset + tok0, first_key, n, page_shift, page_size);
  }
  __device__ float bias(const int32_t*, int) const { return 0.f; }
};
/// Whether request r's device-side lengths and offsets (what PagedSourceT::init
/// judges) are out of range: read again, on the cold path of a request
/// that met a rejected token, so the flag can say which kind it met. The
/// planned count comes from the uniform split or the request's last item.
__device__ inline bool lengths_out_of_range(const PartialParams<PagedTable>& p, int32_t request) {
  const PagedTable& t = p.table;
  const int64_t seq = request / p.num_kv_heads;
  const int32_t offset = t.first_page_offset ? t.first_page_offset[request] : 0;
  if (offset < 0 || offset >= t.page_size) return true;
  if (!t.matrix && (t.indptr[request] < 0 || t.indptr[request + 1] < t.indptr[request])) return true;
  if (t.seq_lens != nullptr) {
    const int32_t len = t.seq_lens[t.lens_per_sequence ? seq : request];
    int64_t planned = p.uniform_len;
    if (p.work != nullptr) {  // the request's last item: the first item of a later request, less one
      int32_t lo = 0, hi = p.num_items;
      while (lo < hi) {
        const int32_t mid = (lo + hi) / 2;
        if (p.work[mid].request <= request)
          lo = mid + 1;
        else
          hi = mid;
      }
      planned = lo > 0 && p.work[lo - 1].request == request ? p.work[lo - 1].token_end : INT64_MAX;
    }
    if (len < 0 || len > planned) return true;
  }
  if (t.window_lens != nullptr && t.addressing != PageAddressing::kPoolPages) {
    const int32_t live = t.window_lens[seq];
    if (live < 0 || live > t.max_window_len) return true;
  }
  return false;
}
__device__ inline bool lengths_out_of_range(const PartialParams<DenseTable>& p, int32_t request) {
  const int32_t live = p.table.live_lens ? p.table.live_lens[request / p.num_kv_heads] : p.uniform_len;
  return live < 0 || live > p.uniform_len;
}

/// What every kernel's finish raises for a request that met a rejected
/// token (its output is NaN): the kinds and the request (report_decode_error).
template <class Params>
__device__ inline void report_rejected(const Params& p, int32_t request) {
  if (p.error_flag == nullptr) return;
  report_decode_error(p.error_flag, request,
                      kDecodeErrorRejected | (lengths_out_of_range(p, request) ? kDecodeErrorLength : 0u));
}

/// The library's own tables: CSR over a pool or a window.
using PagedSource = PagedSourceT<false>;
/// The engines' index forms as well (decode.h: IndexLayout, IndexPadding, kBlockTable, SeqLensIndex).
using EnginePagedSource = PagedSourceT<true>;

/// Rows from a dense allocation; the slot carries the tile's mask values.
struct DenseSource {
  using Params = PartialParams<DenseTable>;
  static constexpr bool kHasBias = true;
  static constexpr bool kMaySkip = false;  // masked rows leave the softmax through bias()
  const float* mask;                       // this request's mask row, or null
  int32_t live;                            // the sequence's live tokens
  bool rejected;                           // a live length outside [0, live_len]: every token rejected

  /// False when the sequence's live length lies outside [0, live_len] (the
  /// uniform split's length): the request is poisoned, nothing is read.
  __device__ bool init(const Params& p, int32_t request, int64_t seq, int64_t, int64_t) {
    const DenseTable& t = p.table;
    mask = t.mask ? t.mask + request * t.mask_pitch : nullptr;
    live = t.live_lens ? t.live_lens[seq] : p.uniform_len;
    rejected = live < 0 || live > p.uniform_len;
    if (rejected) mask = nullptr;  // nor is the mask read
    return !rejected;
  }
  __device__ int32_t visible_tokens() const { return live; }
  __device__ void prefetch(int32_t* slot, int32_t tok0, int32_t n, int tid) const {
    if (mask && tid < n) cp_async_4(smem_u32(slot + tid), mask + tok0 + tid);
  }
  /// The mask values of the tile being issued are already in its slot
  /// (they arrive S - 1 tiles ahead of the rows), so masked rows are skipped.
  __device__ int64_t row(const int32_t* slot, int32_t tok0, int32_t token, const Params&) const {
    if (rejected) return kRejectedRow;
    return mask && __int_as_float(slot[token - tok0]) == neg_inf_f32() ? kMaskedRow : token;
  }
  /// Masked tokens leave the softmax through bias() instead.
  __device__ bool skipped(const int32_t*, int32_t, int32_t) const { return false; }
  __device__ float bias(const int32_t* slot, int key) const { return mask ? __int_as_float(slot[key]) : 0.f; }
};

}  // namespace cuda
}  // namespace sparsepage

#include "cuda/attention/gqa/decode_partial_body.cuh"
