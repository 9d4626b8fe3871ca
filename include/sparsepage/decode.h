// The paged decode (docs/DESIGN.md: the paged decode): one params struct, two backends.
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
  /// rows (0: none; a view of an empty cache). Reading more is refused by
  /// name. kUnknownCapacity (the default): unknown, and the caller vouches
  /// that every row read lies inside its allocation.
  static constexpr int64_t kUnknownCapacity = INT64_MAX;
  int64_t capacity = kUnknownCapacity;

  /// The rows of a dense `[batch, heads, capacity, row_stride]` allocation,
  /// of which each row uses the first `dim` elements (row_stride 0: dim).
  /// Its capacity is known, 0 included: no row of an empty cache is read.
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
/// more rows than a known capacity (0 included), strides under
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
  /// Page ids are pages of the sequence's own token positions, resolved to
  /// pool rows through the engine's block table inside the kernel (what
  /// vLLM and SGLang run a separate conversion launch for): position
  /// p = page * page_size + slot lives at pool row
  ///   block_table[row, p / block_size] * block_size + p % block_size.
  /// Positions are checked against the table's width and block ids against
  /// its num_blocks.
  kBlockTable = 2,
};

/// How a request finds its page ids in `indices`.
enum class IndexLayout : int32_t {
  /// The CSR page table (docs/DESIGN.md: the page table): request r's ids are
  /// indices[indptr[r] .. indptr[r + 1]).
  kCsr = 0,
  /// A uniform-width matrix, as engines hand indices over (the DSA
  /// [num_tokens, topk] slot ids, an indexer's [num_tokens, topk] positions,
  /// a [num_seqs, max_blocks] block table used as page ids): request
  /// r = (sequence b, KV head h) reads `index_width` ids starting at
  /// indices + b * index_seq_stride + h * index_head_stride. indptr is not
  /// read and may be null.
  kMatrix = 1,
};

/// What a negative page id means.
enum class IndexPadding : int32_t {
  /// Every id names a page; -1 is out of range like any other bad id.
  kNone = 0,
  /// -1 means "no token here" (the engines' padding): the tokens of such a
  /// page are skipped, never read, and contribute nothing (a request whose
  /// ids are all -1 writes o = 0, lse = -inf). Any other id outside the
  /// pool, -2 included, keeps the error semantics.
  kMinusOneSkips = 1,
};

/// Which entry of `seq_lens` a request reads.
enum class SeqLensIndex : int32_t {
  kPerRequest = 0,   // seq_lens[r], r = b * num_kv_heads + h
  kPerSequence = 1,  // seq_lens[b]: one length for all KV heads of a sequence (an engine's seq_lens)
};

/// The engine's block table (PageAddressing::kBlockTable). Device data on CUDA.
struct BlockTable {
  const int32_t* data = nullptr;  // [num_rows, row_stride] pool block ids
  int64_t row_stride = 0;         // entries between rows (>= max_blocks)
  int32_t max_blocks = 0;         // entries of a row that positions may reach
  int32_t num_rows = 0;           // rows of the table
  int32_t block_size = 0;         // pool rows per block
  int64_t num_blocks = 0;         // block ids must lie in [0, num_blocks)
  // The table row of each sequence (an engine's token -> request map, e.g.
  // several query tokens of one request), or null: sequence b reads row b.
  const int32_t* row_of_sequence = nullptr;  // [num_requests / num_kv_heads] or null
};

/// Why `t` cannot address `sequences` sequences' positions, or "" when it
/// can: a block size below 1, negative counts, a row stride below the
/// width, more than 2^62 rows, or too few rows (without row_of_sequence).
/// Host-only; never reads the table. The decode's checks and the entry
/// point's both run it.
std::string block_table_problem(const BlockTable& t, int64_t sequences);

/// How the K and V rows are stored. q, q_extra, o and the second K stream are
/// always `dtype`. The fp8 forms address K and V in bytes: their RowView
/// strides and dims count e4m3 elements (one byte each).
enum class KvFormat : int32_t {
  /// K and V are `dtype` elements.
  kNative = 0,
  /// K and V are e4m3 with one fp32 scale per KV head: K of head h is
  /// k * k_scale[h], V is v * v_scale[h] (vLLM's fp8 KV cache).
  kE4m3PerHead = 1,
  /// The DSA / MLA engines' 656-byte rows (sparsepage/fp8.h): 512 e4m3 latent
  /// values, at byte 512 four fp32 scales (one per 128 values), at byte 528
  /// 64 rope values in `dtype` (bf16). K is the latent (k.dim = 512, k.row_stride
  /// >= 528 bytes), V is the same bytes (v = k), and k_extra is the rope, a
  /// `dtype` view of the same rows (mla_fp8_views builds all three).
  kE4m3Mla = 2,
};
/// "native", "e4m3 per head" or "e4m3 mla".
const char* kv_format_name(KvFormat format);

/// Where q, q_extra or o keeps query head g of request r (sequence
/// b = r / num_kv_heads, KV head h = r % num_kv_heads):
///   data + b * seq_stride + (h * group_size + g) * head_stride   (elements),
/// i.e. a [num_sequences, num_kv_heads * group_size, dim] view whose last
/// dim has unit stride: a slice of a packed QKV tensor, or an output that is
/// a column slice of a wider buffer.
///
/// With q_len > 1 (multi-token steps) query token t of the sequence adds
/// t * token_stride: [num_sequences, q_len, num_kv_heads * group_size, dim],
/// a sequence's tokens consecutive, as engines lay out [num_tokens, heads, dim].
struct QueryStrides {
  int64_t seq_stride = 0;
  int64_t head_stride = 0;
  int64_t token_stride = 0;  // elements between a sequence's query tokens (read only when q_len > 1)
};

/// How q, q_extra and o are laid out.
enum class QueryLayout : int32_t {
  /// Contiguous [num_requests, group_size, dim] (q_strides and friends
  /// unused); with q_len > 1, contiguous [num_sequences, q_len,
  /// num_kv_heads * group_size, dim].
  kPacked = 0,
  /// The views q_strides, q_extra_strides and o_strides describe.
  kStrided = 1,
};

/// The operands of one attention call: the queries, the rows they attend
/// and the outputs. The fused decode (DecodeParams), the mask path
/// (MaskedDecodeParams) and the entry point (SparseAttentionInputs) each
/// extend it, so one converts to another by copying this part once.
/// Request r = b * num_kv_heads + h owns query heads h * G .. (h + 1) * G - 1
/// of sequence b (G = group_size), so [num_requests, group_size, dim] is
/// [batch, num_qo_heads, dim]; packed unless DecodeParams::qo_layout says
/// otherwise.
struct AttentionOperands {
  DType dtype = DType::kBF16;     // q, the rows and o share it (K and V: see kv_format where there is one)
  const void* q = nullptr;        // [num_requests, group_size, k.dim]
  RowView k;                      // K rows, dim = head_dim_qk; row t of request r at k.offset(b, h, t)
  RowView v;                      // V rows, dim = head_dim_v; may alias k's first columns
  const void* q_extra = nullptr;  // [num_requests, group_size, k_extra.dim]; null without a second stream
  RowView k_extra;                // second K stream (MLA rope keys); data null when absent
  float scale = 1.0f;             // applied to q.k (and q_extra.k_extra)
  void* o = nullptr;              // [num_requests, group_size, v.dim]
  float* lse = nullptr;           // [num_requests, group_size], packed; may be null. Natural log (base e)
                                  // of the sum of exp(scaled scores); -inf for an empty request.
};

/// Everything a decode launch reads and writes. All pointers live in the
/// memory of the backend that runs it. Pass by value.
///
/// Plan for the step, not for the counts: `seq_lens` is read where the
/// kernel runs (device memory on CUDA) and each request's entry may be
/// anything from 0 up to what the plan was made for, so one plan (and one
/// captured CUDA graph) serves steps whose counts change on the device.
struct DecodeParams : AttentionOperands {
  KvFormat kv_format = KvFormat::kNative;
  // kE4m3PerHead: the per-KV-head scales of K and V (device memory on CUDA);
  // null otherwise.
  const float* k_scale = nullptr;  // [num_kv_heads]
  const float* v_scale = nullptr;  // [num_kv_heads]

  // Page table (docs/DESIGN.md: the page table).
  IndexLayout index_layout = IndexLayout::kCsr;
  const int32_t* indptr = nullptr;             // kCsr: [num_requests + 1]; kMatrix: unused
  const int32_t* indices = nullptr;            // page ids (kCsr: [indptr[num_requests]])
  const int32_t* first_page_offset = nullptr;  // [num_requests]; may be null (all zero)
  // Visible tokens, in [0, the plan's count]; may be null: every request
  // sees the count the plan was made for (e.g. full top-k rows). The CPU
  // backend refuses an entry outside by name; on CUDA it poisons the
  // requests that read it (NaN, kDecodeErrorLength).
  const int32_t* seq_lens = nullptr;  // [num_requests] or [num_sequences] (seq_lens_index)
  SeqLensIndex seq_lens_index = SeqLensIndex::kPerRequest;
  int32_t num_requests = 0;
  int32_t num_kv_heads = 1;  // requests per sequence: r = b * num_kv_heads + h
  int32_t page_size = 1;
  PageAddressing addressing = PageAddressing::kPoolPages;
  IndexPadding padding = IndexPadding::kNone;
  int64_t num_pool_pages = 0;  // kPoolPages: ids must lie in [0, num_pool_pages)
  // kWindow: sequence b's live length is window_lens[b] when window_lens is
  // set (read where the kernel runs, so it may grow between graph replays),
  // else window_len for every sequence. Each entry must lie in [0, B]: under
  // kWindow B is the rows each (sequence, head) holds — the smallest
  // capacity K, V and k_extra declare, else window_len; under kBlockTable
  // (where it is the causal limit's live length) B is the table's
  // max_blocks * block_size positions. The CPU backend refuses an entry
  // outside by name; the CUDA kernels poison that sequence's requests (NaN,
  // kDecodeErrorLength). kPoolPages does not read it.
  const int32_t* window_lens = nullptr;  // [num_requests / num_kv_heads] or null
  // Elements in `indices`. kCsr: the CPU backend checks indptr[0] == 0, that
  // indptr never decreases and that indptr[num_requests] <= num_indices
  // before it reads a single index (0 with a nonempty table is an error
  // there); the CUDA backend cannot read device indptr on the host and
  // ignores it. kMatrix: both backends check on the host that the matrix
  // (every sequence's and head's index_width ids) lies inside num_indices.
  int64_t num_indices = 0;
  int64_t window_len = 0;
  // kMatrix: ids per request and the strides (elements) between sequences'
  // and KV heads' rows of the matrix (0: shared).
  int32_t index_width = 0;
  int64_t index_seq_stride = 0;
  int64_t index_head_stride = 0;
  BlockTable block_table;  // kBlockTable only

  int32_t group_size = 1;  // query heads per request
  // Query tokens per request (multi-token steps: speculative verification,
  // MTP). A request's query rows are q_len tokens x group_size heads, and the
  // plan is made for group_size * q_len rows (PlanShape::group_size). Token t
  // (0-based) of sequence b sees only positions p < L_b - (q_len - 1 - t),
  // L_b its live length (window_lens[b], else window_len): causal among the
  // new tokens, which occupy positions L_b - q_len .. L_b - 1. Positions are
  // what page ids name under kWindow and kBlockTable addressing (position =
  // page * page_size + slot); kPoolPages ids are not positions, so q_len > 1
  // is refused there by name. 1 .. kMaxQueryTokens; the MLA shape (512, 512,
  // 64) takes q_len = 1 on CUDA (make each token a request, as DSA does),
  // and KvFormat::kE4m3Mla rows on both backends; kE4m3PerHead rows run
  // multi-token steps on the 16-row tiles (never the 64-row CTA).
  // lse is then [num_sequences, q_len, num_kv_heads, group_size].
  int32_t q_len = 1;
  QueryLayout qo_layout = QueryLayout::kPacked;
  QueryStrides q_strides;        // kStrided only
  QueryStrides q_extra_strides;  // kStrided only
  QueryStrides o_strides;        // kStrided only; heads and sequences must not overlap

  // CUDA scheduling, no effect on the result: set when the requests may see
  // fewer tokens than the plan was made for (seq_lens below the plan's
  // counts, as in a ragged batch planned for its selection's width). A
  // request split into chunks then shares the tokens it sees evenly among
  // them, instead of its first chunks taking them all; each chunk waits for
  // its request's count before it starts, which costs a little at batch 1,
  // so it is off by default. The CPU backend ignores it.
  bool balance_live_counts = false;
};

/// Most query tokens one request may carry (DecodeParams::q_len): speculative
/// verification and MTP run 2 to 8.
constexpr int32_t kMaxQueryTokens = 16;

/// Throws sparsepage::Error naming the first field that is inconsistent with
/// itself or with `plan` (null pointers, dims, strides, counts). Host-side
/// checks only: it never reads the arrays.
void check_decode_params(const DecodeParams& params, const DecodePlan& plan);

/// The most a window_lens entry may say (DecodeParams::window_lens): under
/// kWindow the smallest capacity K, V and k_extra declare (window_len when
/// none does), under kBlockTable the table's max_blocks * block_size, under
/// kPoolPages 0 (not read). Host-only; both backends judge by it.
int64_t window_lens_bound(const DecodeParams& params);

/// CPU reference backend: runs the plan's work items (multi-threaded), then
/// the lse merge. Pointers are host pointers. `workspace` must hold
/// plan.workspace.total bytes (host). Every page id (and, with a block
/// table, every position, table row and block id) is bounds-checked before
/// anything is read: a bad one throws naming it. A -1 under
/// IndexPadding::kMinusOneSkips is skipped, not read.
void run_decode_cpu(const DecodeParams& params, const DecodePlan& plan, void* workspace);

/// Why the CUDA kernels cannot read these streams as laid out, or "" when they
/// can (native K and V; the launch overload below judges the fp8 formats): f16/bf16 elements, 16-byte aligned bases,
/// row, head and sequence strides in whole 16-byte pieces (rows are copied 16 bytes at a time), and a V wider than 256
/// (the MLA latent) read as K's own columns. Host-only. The CUDA entry points throw it and the dispatch policy declines
/// with it, so a layout the policy accepts always launches.
std::string cuda_layout_problem(DType dtype, const void* q, const void* q_extra, const RowView& k, const RowView& v,
                                const RowView& k_extra, const void* o);
/// The same for a whole launch: the streams above, and strided q, q_extra and
/// o views (QueryLayout::kStrided) whose sequence and head strides are whole
/// 16-byte pieces (q rows are copied, and o rows written, 16 bytes at a time).
/// FP8 caches have kernels for two shapes only: kE4m3PerHead at head dim 128
/// (K and V 128, no second stream), kE4m3Mla at the MLA shape with bf16 q,
/// rope and o; byte strides in whole 16-byte pieces.
std::string cuda_layout_problem(const DecodeParams& params);
/// What the KV format's own fields get wrong, or "" (both backends): a
/// kv_format outside KvFormat, per-head scales missing for kE4m3PerHead or
/// set for another format, and for kE4m3Mla a dtype other than bf16, dims
/// other than 512 / 512 + a 64-wide rope, V not K's view, or rows shorter
/// than the 528 bytes of latent and scales. Checked by every launch, and by
/// SparseDecoder before a step changes anything.
std::string kv_format_problem(const DecodeParams& params);

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
/// `built` names the architectures to judge by, as CMake's list has them
/// ("80,90a"); null: this build's.
std::string cuda_arch_problem(int32_t sm, int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra,
                              const char* built = nullptr);
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
/// The shape for `q_len` query tokens per request of `group_size` heads
/// (DecodeParams::q_len; 1: a plain decode step). At head dim 128 the 64-row
/// multi-token CTA runs from 17 query rows where sm_90a code runs (its wgmma
/// form) and from 33 rows elsewhere (mma.sync); other steps run the 16-row
/// tiles, which see group_size * q_len query rows. Throws when
/// cuda_supports_head_dims is false for these dims.
CudaLaunchShape cuda_launch_shape(int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra, int32_t group_size,
                                  int32_t q_len = 1);

/// CUDA backend, two steps.
/// `upload_plan` copies the plan's work list and merge lists into the device
/// workspace (asynchronously on `stream`); do it when the plan changes, before
/// any graph capture. `run_decode_cuda` then launches the partial kernel and,
/// when the plan needs it, the merge kernel: no allocation, no
/// synchronization, no host reads, so it can be captured in a CUDA graph.
/// Page ids outside the pool (or, in window mode, positions outside the
/// window; with a block table, positions past its width, block ids outside
/// the pool or a table row out of range) are never read, nor is a request
/// whose indptr start or first_page_offset is out of range: the request's
/// output becomes NaN and the workspace error flag is set (read it with
/// `read_decode_error_flag`). A -1 under IndexPadding::kMinusOneSkips is no
/// error: its tokens are skipped.
/// `stream` is a cudaStream_t (null: the default stream).
void upload_plan_cuda(const DecodePlan& plan, void* workspace, void* stream = nullptr);
/// It returns the name of the kernel it launched, for logs and benchmarks (a
/// string literal, e.g. "64-row multi-token CTA, wgmma"), decided once for
/// the launch.
const char* run_decode_cuda(const DecodeParams& params, const DecodePlan& plan, void* workspace,
                            void* stream = nullptr);
/// Reads and clears the error flag (synchronizes). Nonzero: some request's
/// output is NaN because it named something that must not be read
/// (kDecodeErrorRejected) — a page id outside the pool, a position outside
/// its window — or carried a device-side length out of range
/// (kDecodeErrorLength, with kDecodeErrorRejected). `read_decode_errors`
/// says which request as well.
uint32_t read_decode_error_flag(const DecodePlan& plan, void* workspace, void* stream = nullptr);

/// The kinds a CUDA decode's error flag ORs (DecodeErrors::kinds).
/// A request met something it must not read: its o and lse are NaN, and
/// nothing outside its own rows was read.
constexpr uint32_t kDecodeErrorRejected = 1;
/// A device-side length, offset or table structure of a request lay outside
/// its range (docs/RELIABILITY.md, per field): a negative or over-plan
/// seq_lens entry, a window_lens entry outside [0, the window's bound], a
/// first_page_offset outside [0, page_size), a negative or decreasing
/// indptr. The request is poisoned (kDecodeErrorRejected too).
constexpr uint32_t kDecodeErrorLength = 2;
/// What the kernels met since the flag was last read: the kinds (0: none)
/// and the lowest-numbered request that met one (-1: none). With per-sequence
/// lengths (SeqLensIndex::kPerSequence, window_lens) a bad entry poisons
/// every request of its sequence, and the first of them is named.
struct DecodeErrors {
  uint32_t kinds = 0;
  int32_t first_request = -1;
};
/// Reads and clears the flag, as read_decode_error_flag (synchronizes).
DecodeErrors read_decode_errors(const DecodePlan& plan, void* workspace, void* stream = nullptr);

/// Device properties the plan needs.
int32_t cuda_multiprocessor_count();

}  // namespace sparsepage
