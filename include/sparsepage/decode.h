// The paged decode (SPEC section 6): one params struct, two backends.
#pragma once

#include <cstdint>
#include <string>

#include "sparsepage/memory.h"
#include "sparsepage/plan.h"
#include "sparsepage/types.h"

namespace sparsepage {

/// Where one stream's rows live (K, V or the second K stream). Request
/// r = b * num_kv_heads + h (sequence b, KV head h) finds row t of its stream at
///   data + b * seq_stride + h * head_stride + t * row_stride   (elements),
/// 64-bit throughout. A pool shared by every request has seq_stride =
/// head_stride = 0; an engine's paged cache [blocks, block_size, heads, dim]
/// has row_stride = heads * dim and head_stride = dim; a dense
/// [B, H, Cap, D] allocation has row_stride = D, head_stride = Cap * D and
/// seq_stride = H * Cap * D (Cap, never the live length). K, V and the
/// second stream each carry their own strides, so a K allocation with more
/// heads than V (an index key at head H) is addressed exactly at any batch.
///
/// It is the library's one description of where rows live: the kernels, the
/// mask path, the layers' caches and the Python bindings all speak it.
struct RowView {
  const void* data = nullptr;  // may be null only for an absent optional stream
  int64_t row_stride = 0;      // elements between consecutive rows (>= dim)
  int32_t dim = 0;             // elements used per row
  int64_t seq_stride = 0;      // elements between sequences (0: shared by all)
  int64_t head_stride = 0;     // elements between KV heads (0: shared by all)
  /// Rows each (sequence, head) holds: a dense cache's capacity, a pool's
  /// rows. Reading more is refused by name. 0: unknown, and the caller
  /// vouches that every row read lies inside its allocation.
  int64_t capacity = 0;

  /// The rows of a dense `[batch, heads, capacity, row_stride]` allocation,
  /// of which each row uses the first `dim` elements (row_stride 0: dim).
  static RowView dense(const void* data, int32_t heads, int64_t capacity, int32_t dim, int64_t row_stride = 0) {
    const int64_t stride = row_stride > 0 ? row_stride : dim;
    return {data, stride, dim, int64_t{heads} * capacity * stride, capacity * stride, capacity};
  }
  /// Element offset of row t of (sequence seq, KV head head).
  int64_t offset(int64_t seq, int64_t head, int64_t t) const {
    return seq * seq_stride + head * head_stride + t * row_stride;
  }
};

/// Why `rows` rows of each of `sequences` x `heads` (sequence, head) pairs
/// of `view` cannot be read as distinct rows, or "" when they can: a null
/// base, dim < 1, a row stride below dim, a negative stride or capacity,
/// more rows than a known capacity, strides under
/// which two different rows overlap (a head's rows running into the next
/// head's, say), or a span past 2^62 bytes. Zero sequence and head strides
/// mean shared rows and are fine. `name` prefixes the message. Host-only;
/// every entry point that takes a RowView runs it.
std::string row_view_problem(const RowView& view, const char* name, int64_t sequences, int64_t heads, int64_t rows,
                             size_t element_size);

/// What a page id names.
enum class PageAddressing : int32_t {
  /// Page ids are pages of the stream's pool: rows page * page_size + slot,
  /// each id checked against num_pool_pages.
  kPoolPages = 0,
  /// Page ids are pages of the request's own window (a dense cache): rows
  /// page * page_size + slot of the request's (sequence, head) rows, each
  /// position checked against its sequence's live length, so no selection
  /// can reach another request's rows or a row past the live window.
  kWindow = 1,
};

/// Everything a decode launch reads and writes. All pointers live in the
/// memory of the backend that runs it. Pass by value.
///
/// Plan for the step, not for the counts: `seq_lens` is read where the
/// kernel runs (device memory on CUDA) and each request's entry may be
/// anything from 0 up to what the plan was made for, so one plan (and one
/// captured CUDA graph) serves steps whose counts change on the device.
struct DecodeParams {
  DType dtype = DType::kBF16;        // q, pools and o share it

  // Page table (SPEC section 3).
  const int32_t* indptr = nullptr;            // [num_requests + 1]
  const int32_t* indices = nullptr;           // [indptr[num_requests]] page ids
  const int32_t* first_page_offset = nullptr; // [num_requests]; may be null (all zero)
  const int32_t* seq_lens = nullptr;          // [num_requests] visible tokens, <= the plan's counts
  int32_t num_requests = 0;
  int32_t num_kv_heads = 1;    // requests per sequence: r = b * num_kv_heads + h
  int32_t page_size = 1;
  PageAddressing addressing = PageAddressing::kPoolPages;
  int64_t num_pool_pages = 0;  // kPoolPages: ids must lie in [0, num_pool_pages)
  // kWindow: sequence b's live length is window_lens[b] when window_lens is
  // set (read where the kernel runs, so it may grow between graph replays),
  // else window_len for every sequence.
  const int32_t* window_lens = nullptr;  // [num_requests / num_kv_heads] or null
  // Elements in `indices`. The CPU backend checks indptr[0] == 0, that
  // indptr never decreases and that indptr[num_requests] <= num_indices
  // before it reads a single index (0 with a nonempty table is an error
  // there). The CUDA backend cannot read device indptr on the host and
  // ignores it.
  int64_t num_indices = 0;
  int64_t window_len = 0;

  int32_t group_size = 1;      // query heads per request
  const void* q = nullptr;     // [num_requests, group_size, k.dim], contiguous
  RowView k;                   // K rows, dim = head_dim_qk
  RowView v;                   // V rows, dim = head_dim_v; may alias k's first columns
  const void* q_extra = nullptr;  // [num_requests, group_size, k_extra.dim]; null without a second stream
  RowView k_extra;             // second K stream; data null when absent
  float scale = 1.0f;          // applied to q.k (and q_extra.k_extra)

  void* o = nullptr;           // [num_requests, group_size, v.dim]
  float* lse = nullptr;        // [num_requests, group_size]; may be null. Natural log (base e) of the
                               // sum of exp(scaled scores); -inf for an empty request
};

/// Throws sparsepage::Error naming the first field that is inconsistent with
/// itself or with `plan` (null pointers, dims, strides, counts). Host-side
/// checks only: it never reads the arrays.
void check_decode_params(const DecodeParams& params, const DecodePlan& plan);

/// CPU reference backend: runs the plan's work items (multi-threaded), then
/// the lse merge. Pointers are host pointers. `workspace` must hold
/// plan.workspace.total bytes (host). Every page id is bounds-checked: an id
/// outside the pool throws, nothing is read.
void run_decode_cpu(const DecodeParams& params, const DecodePlan& plan, void* workspace);

/// Why the CUDA kernels cannot read these streams as laid out, or "" when they
/// can: f16/bf16 elements, 16-byte aligned bases, row, head and sequence
/// strides in whole 16-byte pieces (rows are copied 16 bytes at a time), and a
/// V wider than 256 (the MLA latent) read as K's own columns. Host-only. The
/// CUDA entry points throw it and the dispatch policy declines with it, so a
/// layout the policy accepts always launches.
std::string cuda_layout_problem(DType dtype, const void* q, const void* q_extra, const RowView& k, const RowView& v,
                                const RowView& k_extra, const void* o);

/// Head dims the fused kernels are built for (CPU runs any). The MLA shape
/// (512, 512, 64) runs only with V aliasing K's first 512 columns (same
/// pointer and row stride); other layouts of it are refused at launch.
bool cuda_supports_head_dims(int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra);

/// Why a GPU of compute capability `sm` (major * 10 + minor: 80, 90, 100)
/// has no fused kernel for these head dims in this build, or "" when it has
/// one. The wgmma MLA kernel (512, 512, 64) needs sm_90a code and an sm_90
/// device ("no fused kernel for sm_80 at the MLA shape"); the mma.sync
/// kernels need sm_80 or newer and an architecture this build includes
/// (CMake option SPARSEPAGE_CUDA_ARCHS: a plain entry such as 80 also runs
/// on newer GPUs through its PTX, an `a` entry such as 90a only on its own).
/// Host-only and pure: the dispatch asks it about the current device (or
/// the one DispatchConfig::assume_sm names) and the launchers refuse by it.
/// `built` names the architectures to judge by (as cuda_built_architectures
/// gives them); null: this build's.
std::string cuda_arch_problem(int32_t sm, int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra,
                              const char* built = nullptr);
/// The architectures this build's kernels were compiled for, as CMake had
/// them ("90a", "80,90a,100"); empty without the CUDA backend.
const char* cuda_built_architectures();
/// Compute capability (major * 10 + minor) of the current CUDA device; 0
/// without one.
int32_t cuda_device_sm();

/// How the CUDA kernel for these dims spreads one work item: `ctas_per_item`
/// CTAs (query-head tiles: 16 heads each on the mma.sync tiles, 64 on the MLA
/// kernel), of which `ctas_per_sm` are resident per multiprocessor. The plan
/// (PlanShape) takes both, so one wave holds about the CTAs it aims for.
struct CudaLaunchShape {
  int32_t ctas_per_item = 1;
  int32_t ctas_per_sm = 2;
};
/// Throws when cuda_supports_head_dims is false for these dims.
CudaLaunchShape cuda_launch_shape(int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra, int32_t group_size);

/// CUDA backend, two steps.
/// `upload_plan` copies the plan's work list and merge lists into the device
/// workspace (asynchronously on `stream`); do it when the plan changes, before
/// any graph capture. `run_decode_cuda` then launches the partial kernel and,
/// when the plan needs it, the merge kernel: no allocation, no
/// synchronization, no host reads, so it can be captured in a CUDA graph.
/// Page ids outside the pool (or, in window mode, positions outside the
/// window) are never read, nor is a request whose indptr start or
/// first_page_offset is out of range: the request's output becomes NaN
/// and the workspace error flag is set (read it with `read_decode_error_flag`).
/// `stream` is a cudaStream_t (null: the default stream).
void upload_plan_cuda(const DecodePlan& plan, void* workspace, void* stream = nullptr);
void run_decode_cuda(const DecodeParams& params, const DecodePlan& plan, void* workspace,
                     void* stream = nullptr);
/// Reads and clears the error flag (synchronizes). Nonzero: some page id was outside the pool.
uint32_t read_decode_error_flag(const DecodePlan& plan, void* workspace, void* stream = nullptr);

/// Device properties the plan needs.
int32_t cuda_multiprocessor_count();

}  // namespace sparsepage
