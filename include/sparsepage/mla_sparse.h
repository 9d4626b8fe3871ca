// Sparse MLA decode over paged FP8 caches in the shape FlashMLA's sparse
// decode takes (docs/DESIGN.md: FlashMLA-shaped sparse decode): queries
// [batch, q_len, heads, d_qk], a cache of FP8 rows addressed by slot ids
// (block * block_size + offset, -1 for none), an optional second cache with
// its own ids, an optional attention sink per head. The fused MLA decode
// runs it: with an extra cache each cache's tokens are split-KV partials and
// one merge combines both caches' partials by lse and applies the sink;
// without one the decode runs on its own plan, and its merge or an epilogue
// applies the sink (MlaSparsePlan). CPU backend: every format; CUDA: the 656-byte rows
// (kV32).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsepage/plan.h"
#include "sparsepage/types.h"

namespace sparsepage {

/// How a sparse MLA cache stores its tokens.
enum class MlaCacheFormat : int32_t {
  /// DeepSeek-V3.2's 656-byte rows (fp8.h, MlaFp8Row): 512 e4m3 latent
  /// values, 4 fp32 scales (one per 128 values), 64 bf16 rope values. A
  /// block's rows follow each other `row_stride` bytes apart. q is 576 wide
  /// (latent, then rope); V is the 512 dequantized latent values.
  kV32 = 0,
  /// MODEL1 (MlaModel1Block): per block, the tokens' 448 e4m3 values and 64
  /// bf16 rope values (576 bytes a token), then each token's 7 power-of-two
  /// scales (e8m0, one per 64 values) and one unused byte. q is 512 wide
  /// (448, then rope); V is the whole 512-wide dequantized row, rope included.
  kModel1 = 1,
};
/// "v32" or "model1".
const char* mla_cache_format_name(MlaCacheFormat format);

/// MODEL1's block layout (MlaCacheFormat::kModel1). Token j of a block
/// starting at byte B keeps its 448 e4m3 values at B + 576 j, its 64 bf16
/// rope values at B + 576 j + 448, and its scales at B + 576 block_size + 8 j:
/// byte i < 7 is the scale of values [64 i, 64 i + 64), 2^(byte - 127)
/// (e8m0: 0xFF is NaN); byte 7 is unused.
struct MlaModel1Block {
  static constexpr int32_t kNope = 448;
  static constexpr int32_t kRope = 64;
  static constexpr int32_t kTile = 64;                                  // values per scale
  static constexpr int32_t kScales = kNope / kTile;                     // 7
  static constexpr int32_t kTokenBytes = kNope + 2 * kRope;             // 576
  static constexpr int32_t kScaleBytes = 8;                             // 7 scales and one unused byte
  static constexpr int32_t kBytesPerToken = kTokenBytes + kScaleBytes;  // 584
};

/// The value width of both formats (V), and each format's query width.
constexpr int32_t kMlaSparseHeadDimV = 512;
int32_t mla_head_dim_qk(MlaCacheFormat format);  // 576 (kV32), 512 (kModel1)
/// Bytes a token takes: 656 (kV32), 584 (kModel1, scales included).
int32_t mla_bytes_per_token(MlaCacheFormat format);

/// One paged cache and the tokens each query reads from it.
struct MlaSparseCache {
  const void* data = nullptr;  // block 0's first byte; null: no such cache (the extra one)
  int64_t num_blocks = 0;
  int32_t block_size = 0;    // tokens per block (FlashMLA's page_block_size)
  int64_t block_stride = 0;  // bytes between blocks: >= block_size * row_stride (kV32), >= block_size * 584 (kModel1)
  int64_t row_stride = 0;    // kV32: bytes between a block's rows (>= 656); kModel1: unused (the layout fixes it)
  // Slot ids block * block_size + offset: query token t of sequence b reads
  // indices[b * index_batch_stride + t * index_token_stride + i] for
  // i < topk_length[b] (or topk). -1 means "no token": never read, adds
  // nothing. Any other id outside [0, num_blocks * block_size) is an error.
  const int32_t* indices = nullptr;  // [batch, q_len, topk]
  int32_t topk = 0;
  int64_t index_batch_stride = 0, index_token_stride = 0;  // elements
  const int32_t* topk_length = nullptr;                    // [batch], each in [0, topk]; null: every id is read

  int64_t num_slots() const { return num_blocks * block_size; }
};

/// One decode launch. Pointers are in the memory of the backend that runs it.
struct MlaSparseParams {
  MlaCacheFormat format = MlaCacheFormat::kV32;  // both caches'
  DType dtype = DType::kBF16;                    // q and o (CUDA: bf16)
  int32_t batch = 0, q_len = 1, num_heads = 0;
  // [batch, q_len, num_heads, mla_head_dim_qk(format)], unit stride in the
  // last dim; a sequence's tokens must be heads apart: q_token_stride =
  // num_heads * q_head_stride (each token is one request of the decode,
  // folded as a KV head of its sequence).
  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_token_stride = 0, q_head_stride = 0;  // elements
  MlaSparseCache cache;
  MlaSparseCache extra;              // extra.data null: none. Attended together with `cache`.
  const float* attn_sink = nullptr;  // [num_heads] natural-log logits; null: none
  float scale = 0.0f;                // applied to q . k
  void* o = nullptr;                 // [batch, q_len, num_heads, 512], packed, dtype
  // [batch, q_len, num_heads] packed fp32, or null: the natural log of the
  // summed exponentials of both caches' scaled scores, without the sink; +inf
  // for a query that attended nothing (whose o is 0), as FlashMLA writes it.
  float* lse = nullptr;
};

/// What a plan is made for: the shapes, never the ids or lengths (those are
/// read where the decode runs, so one plan serves every step of a shape).
struct MlaSparseShape {
  int32_t batch = 0, q_len = 1, num_heads = 0;
  int32_t topk = 0;
  int32_t extra_topk = 0;  // 0: no extra cache
};

/// The split-KV plan of both caches. Requests are r = b * q_len + t. Two
/// forms, chosen by the shape:
/// * With an extra cache (extra_topk > 0), every work item of either sub-
///   plan writes an fp32 partial slot; request r's slots, merge_indptr[r] ..
///   merge_indptr[r + 1], hold its main chunks and then its extra chunks, so
///   the merge (which also applies the sink) runs for every request. The
///   sub-plans share one workspace (`workspace`); their own merge lists are
///   empty, so run_decode_cuda launches their partial kernels alone.
/// * Without one (extra_topk == 0), `main` is the decode's own plan: a
///   request it does not split writes o and lse directly, a split one merges
///   its own partials (main's merge lists); the plan's merge lists are
///   empty and `extra` has no items. FlashMLA's lse of +inf for rows that
///   attended nothing, and the sink, come from main's merge when it splits
///   every request, else from a last pass over the rows. `workspace` is
///   main's, with `lse_scratch` (one float per request and head, for that
///   pass's sink without an lse) after it.
struct MlaSparsePlan {
  MlaSparseShape shape;
  DecodePlan main;                      // items over `cache`
  DecodePlan extra;                     // items over `extra` (no requests without one)
  std::vector<int32_t> merge_indptr;    // [num_requests + 1]; empty in the direct form
  std::vector<int32_t> merge_requests;  // [num_requests]: 0 .. num_requests - 1; empty in the direct form
  int32_t num_partials = 0;
  int32_t max_partials = 0;   // most slots of one request
  WorkspaceLayout workspace;  // partials, both work lists, the merge lists, the error flag
  size_t lse_scratch = 0;     // direct form: float [num_requests * num_heads] at this offset

  /// Whether this is the direct form (no extra cache).
  bool direct() const { return shape.extra_topk == 0; }
  int32_t num_requests() const { return shape.batch * shape.q_len; }
};

/// Makes the plan: each cache's requests chunked as make_decode_plan chunks
/// them for `machine` (its num_sms, items_per_sm, ctas_per_item, chunk
/// sizes; group_size and head_dim_v are set here). Throws sparsepage::Error
/// naming a bad shape.
MlaSparsePlan make_mla_sparse_plan(const MlaSparseShape& shape, const PlanShape& machine);

/// Throws sparsepage::Error naming the first inconsistency of a plan built
/// or edited by hand (its fields are public): items not covering a request
/// exactly, slots outside the request's merge range or used twice, merge
/// lists that disagree, a workspace that overlaps or overruns.
void check_mla_sparse_plan(const MlaSparsePlan& plan);

/// Why these params cannot run with this plan on either backend, or "":
/// shapes against the plan, null pointers, strides, a cache's geometry.
/// Host-only: never reads the arrays.
std::string mla_sparse_problem(const MlaSparseParams& params, const MlaSparsePlan& plan);
/// What the CUDA backend cannot run besides: MODEL1 caches (no CUDA kernel
/// for their layout yet), q other than bf16, kV32 blocks that are not
/// contiguous (block_stride != block_size * row_stride), bases and strides
/// off the 16-byte grid, a GPU without the MLA kernel. Host-only.
std::string cuda_mla_sparse_problem(const MlaSparseParams& params);

/// CPU backend: every format, fp32 scores and fp64 softmax sums. Checks
/// every id it will read (and every topk_length) before anything runs and
/// throws naming the first bad one. `workspace`: plan.workspace.total bytes
/// (checked for null, not used: the twin keeps each item's state on the heap).
void run_mla_sparse_cpu(const MlaSparseParams& params, const MlaSparsePlan& plan, void* workspace);

/// CUDA backend. Upload copies the plan's lists into the workspace
/// (synchronizes; do it once per plan, before any graph capture). Run then
/// launches on `stream` each cache's partial kernel and the merge, or
/// (without an extra cache) the decode on its own plan and, unless its merge
/// finished every row, the epilogue: no
/// allocation, synchronization or host read, so it can be captured. An id
/// outside its cache is never read: it makes that query's output NaN and
/// sets the error flag (read_mla_sparse_error_flag), as a topk_length past
/// topk does (the CPU backend throws for both, naming them).
void upload_mla_sparse_plan_cuda(const MlaSparsePlan& plan, void* workspace, void* stream = nullptr);
void run_mla_sparse_cuda(const MlaSparseParams& params, const MlaSparsePlan& plan, void* workspace,
                         void* stream = nullptr);
/// Reads and clears the error flag (synchronizes). Nonzero: some id lay outside its cache.
uint32_t read_mla_sparse_error_flag(const MlaSparsePlan& plan, void* workspace, void* stream = nullptr);

}  // namespace sparsepage
