// Sparse prefill (docs/DESIGN.md: sparse prefill): a chunk of a prompt's
// query tokens attends, token by token or block by block, only what its
// indexer kept, through the fused paged decode's kernels. Three forms:
//
//   * MLA over per-token selections (DeepSeek sparse attention, FlashMLA's
//     flash_mla_sparse_fwd): MlaSparsePrefill, fed by DsaPrefillIndexer;
//   * GQA over key blocks per query block (block-sparse prefill):
//     GqaBlockPrefill, fed by BlockPrefillIndexer (max-pooled block scores)
//     or by static_prefill_blocks (a fixed per-query-head pattern).
//
// Positions. A chunk is the last `num_tokens` positions of each sequence
// after they were appended: with sequence b holding L_b positions (the
// device array kv_lens[b], else the host kv_len), its query token t sits at
//   pos(b, t) = L_b - num_tokens + t
// and sees positions p <= pos(b, t) only: causality is a position limit,
// held whatever the selection names. KV rows are positions: row p of
// sequence b is position p (RowView::offset(b, h, p)).
//
// Every class plans apart from running: prepare() makes the plans and
// allocates the workspace for a shape (not capturable), run() allocates,
// synchronizes and reads back nothing after that, so a chunk shape can be
// captured in a CUDA graph and replayed for every chunk of that shape while
// L_b moves on the device. run() prepares by itself when the shape changed.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/memory.h"

namespace sparsepage {

/// Where a chunk's query tokens sit (see the header comment).
struct PrefillChunk {
  int32_t batch = 1;       // sequences, each with num_tokens query tokens
  int32_t num_tokens = 0;  // query tokens per sequence
  /// Positions per sequence with the chunk: L_b. An upper bound of every
  /// kv_lens[b] when kv_lens is set (it sizes grids and checks rows).
  int64_t kv_len = 0;
  /// Per-sequence L_b [batch], in the memory of the run's device, read where
  /// the kernels run (a captured chunk replays for a later chunk of the same
  /// shape); null: kv_len for every sequence. Each must be >= num_tokens.
  const int32_t* kv_lens = nullptr;
};

// ---- MLA over per-token selections ----------------------------------------

/// One MLA sparse prefill: flash_mla_sparse_fwd's semantics over positions.
/// For query head h of token t of sequence b, with I the valid entries of
/// indices[b, t, 0 .. n), n = topk_length[b, t] (topk without it):
///   s_j        = scale * (q[b,t,h] . latent[b, j] + q_rope[b,t,h] . rope[b, j])   for j in I
///   lse        = ln(sum_j exp(s_j))                       (natural log)
///   max_logits = max_j s_j
///   out        = sum_j exp(s_j - lse) * latent[b, j]      (512 values: V is the latent)
/// and with an attention sink, out is multiplied by
/// exp(lse) / (exp(lse) + exp(attn_sink[h])) = 1 / (1 + exp(attn_sink[h] - lse)),
/// leaving lse and max_logits as they are (a sink of -inf changes nothing,
/// +inf zeroes out). A token with no valid entry gets out = 0, lse = +inf
/// and max_logits = -inf, whatever the sink (FlashMLA's convention: +inf
/// makes the row weigh nothing when lse is used to merge).
///
/// An entry of -1 is padding: skipped, never read. Any other entry outside
/// [0, pos(b, t)] (a later position, a negative id; with causal false,
/// outside [0, L_b)) is an error: the CPU
/// backend throws naming it; on CUDA that token's out and lse become NaN and
/// MlaSparsePrefill::check_errors() reports it. (FlashMLA also skips ids >=
/// s_kv; here they are errors, so a causality bug cannot pass silently.)
/// Duplicate entries count twice, as in FlashMLA.
struct MlaPrefillParams {
  DType dtype = DType::kBF16;  // q, q_rope, the rope rows and out (bf16 on CUDA)
  /// kNative: latent rows of `dtype`. KvFormat::kE4m3Mla: the engines'
  /// 656-byte FP8 rows (fp8.h; kv and kv_rope as mla_fp8_views gives them).
  KvFormat kv_format = KvFormat::kNative;
  PrefillChunk chunk;
  int32_t num_heads = 128;  // query heads h_q (CUDA: 64 or 128, or any multiple of 64)
  int32_t topk = 0;         // entries per token row of `indices`
  /// q [batch, num_tokens, num_heads, 512] and q_rope [.., 64], packed; or
  /// with QueryLayout::kStrided the views q_strides / q_rope_strides /
  /// out_strides name (seq_stride between sequences, token_stride between
  /// tokens, head_stride between heads; elements, unit last stride). The
  /// FlashMLA layout q [s_q, h_q, 576] is q = base, q_rope = base + 512, both
  /// with head_stride 576 and token_stride h_q * 576.
  const void* q = nullptr;
  const void* q_rope = nullptr;
  QueryLayout qo_layout = QueryLayout::kPacked;
  QueryStrides q_strides, q_rope_strides, out_strides;
  /// Row p of sequence b: kv.offset(b, 0, p) (dim 512; K and V) and
  /// kv_rope.offset(b, 0, p) (dim 64). FlashMLA's kv [s_kv, 1, 576] is kv =
  /// {base, 576, 512}, kv_rope = {base + 512, 576, 64}. Give capacity (rows
  /// per sequence) where known: rows past it are refused.
  RowView kv;
  RowView kv_rope;
  /// [batch, num_tokens, topk] positions (-1: none): token t of sequence b
  /// reads indices + b * index_seq_stride + t * index_token_stride. 0
  /// strides mean packed (topk, num_tokens * topk).
  const int32_t* indices = nullptr;
  int64_t index_token_stride = 0;
  int64_t index_seq_stride = 0;
  const int32_t* topk_length = nullptr;  // [batch, num_tokens] entries to read per token (<= topk), or null
  /// An engine's paged pool instead of per-sequence rows (block_table.data
  /// set): kv and kv_rope are views of the pool's num_blocks * block_size
  /// rows (seq_stride 0), and position p of sequence b is pool row
  /// block_table[b, p / block_size] * block_size + p % block_size (row b:
  /// row_of_sequence must be null). Ids outside [0, num_blocks) are errors
  /// as entries outside a window are (CPU: thrown; CUDA: NaN and the flag).
  BlockTable block_table;
  float scale = 0.0f;  // softmax scale (sm_scale); must be finite
  /// true: the chunk is each sequence's last num_tokens positions and token
  /// t sees positions up to pos(b, t) (above). false: flash_mla_sparse_fwd's
  /// visibility, where query tokens have no positions: every token may read
  /// any position below its sequence's L_b (the entries alone decide), and
  /// L_b may be below num_tokens.
  bool causal = true;
  const float* attn_sink = nullptr;  // [num_heads] fp32, or null
  void* out = nullptr;               // [batch, num_tokens, num_heads, 512] (packed, or out_strides)
  float* lse = nullptr;              // [batch, num_tokens, num_heads] or null
  /// [batch, num_tokens, num_heads] or null. The CPU backend computes it; on
  /// CUDA it is refused by name (the fused kernel's running maximum is lazy,
  /// within 2^8 of the true one, and an exact one needs a pass of its own).
  float* max_logits = nullptr;
};

/// Runs MLA sparse prefills on one device: each query token becomes a
/// request of the fused decode (page size 1, its index row read in place,
/// its own causal window), so the MLA kernel runs unchanged, 64 heads per
/// CTA, the CTAs of one token's head tiles side by side.
class MlaSparsePrefill {
 public:
  explicit MlaSparsePrefill(Device device) : device_(device) {}
  /// Plans for the params' shapes and allocates the workspace; uploads the
  /// plan (synchronizes). Not capturable.
  void prepare(const MlaPrefillParams& params, void* stream = nullptr);
  /// Checks `params`, then runs on `stream` (a cudaStream_t; null: the
  /// default stream). Capturable once prepared for these shapes.
  void run(const MlaPrefillParams& params, void* stream = nullptr);
  /// CUDA: synchronizes, reads and clears the error flag, and throws when the
  /// last run met an entry outside its token's window. CPU: nothing (errors
  /// were thrown by run()).
  void check_errors(void* stream = nullptr);
  /// The kernel the last CUDA run launched (as run_decode_cuda names it), or "cpu".
  const char* kernel_name() const { return kernel_name_; }
  size_t workspace_bytes() const { return workspace_.bytes() + scratch_.bytes(); }
  Device device() const { return device_; }

 private:
  struct Shape {
    int32_t batch = 0, num_tokens = 0, num_heads = 0, topk = 0;
    KvFormat kv_format = KvFormat::kNative;
    bool need_lse_scratch = false;
    bool paged = false;  // rows through a block table
    bool operator==(const Shape& o) const {
      return batch == o.batch && num_tokens == o.num_tokens && num_heads == o.num_heads && topk == o.topk &&
             kv_format == o.kv_format && need_lse_scratch == o.need_lse_scratch && paged == o.paged;
    }
  };
  static Shape shape_of(const MlaPrefillParams& params);
  Device device_;
  Shape shape_;
  bool prepared_ = false;
  DecodePlan plan_;    // one sequence's tokens as requests
  Buffer workspace_;   // the plan's workspace (CUDA)
  Buffer scratch_;     // int32 windows [batch * num_tokens], then fp32 lse [batch * num_tokens * num_heads]
  Buffer table_rows_;  // paged: int32 [batch * num_tokens], each token's table row (its sequence)
  const char* kernel_name_ = "";
};

// ---- the DSA prefill indexer ------------------------------------------------

/// The lightning indexer's rule (models/dsa.h) over a chunk: token t of
/// sequence b scores every position p <= pos(b, t) by
///   I(p) = sum_j weights[b,t,j] * ReLU(q_index[b,t,j] . k_index[b, p])
/// and keeps the top `topk` (ties to the lower position, a NaN score last);
/// while pos(b, t) + 1 <= topk it keeps every position.
struct DsaPrefillIndexerParams {
  DType dtype = DType::kBF16;  // keys and queries: bf16 or f16 (fp32 on the CPU too)
  PrefillChunk chunk;
  int32_t index_heads = 64;
  int32_t index_head_dim = 128;
  int32_t topk = 2048;
  /// Where the keys are: kDense reads k_cache below; kPaged reads `paged`
  /// (an engine's pool of native or FP8 keys through its block table, row b
  /// of the table for sequence b; index_keys.h), as the decode indexer does.
  IndexKeyLayout key_layout = IndexKeyLayout::kDense;
  /// kDense: position p of sequence b at row b * capacity + p of k_cache,
  /// columns key_column .. key_column + index_head_dim, rows key_column +
  /// index_head_dim elements long (the DSA layer's K buffer: the latent,
  /// then the key; a key-only cache: key_column 0). 16-byte aligned.
  const void* k_cache = nullptr;
  int32_t key_column = 0;
  int64_t capacity = 0;  // rows per sequence (>= kv_len)
  /// kPaged: the engine's keys (chunk.kv_len must fit max_blocks x block_size;
  /// FP8 keys at 64 index heads x 128 on CUDA).
  PagedIndexKeys paged;
  /// kPaged, may be null: the int32 IndexKeyError word (device memory on
  /// CUDA), or'ed into for a sequence whose length or needed blocks are
  /// refused (its tokens then select nothing: positions -1 and count -1,
  /// the decode indexer's mark).
  int32_t* error = nullptr;
  const void* q_index = nullptr;   // [batch, num_tokens, index_heads, index_head_dim]
  const float* weights = nullptr;  // [batch, num_tokens, index_heads]
  int32_t* positions = nullptr;    // out [batch, num_tokens, topk]: kept positions increasing, then -1
  int32_t* counts = nullptr;       // out [batch, num_tokens]: min(topk, pos(b, t) + 1)
};

/// The DSA indexer over a chunk. CUDA: the decode indexer's kernels (scores
/// on warpgroup MMAs; dense or paged bf16/f16 keys, or paged FP8 keys), each
/// pass scoring a tile-row of `rows_per_pass` tokens of one sequence against
/// its causal windows, so the fp32 scores of a tile-row (rows x context, 12 bytes a
/// position with the select's candidates) are the only thing materialised,
/// never [num_tokens, context]. Why materialise a tile-row at all: the
/// top-k reads every score twice (histogram, then the cut), and a score
/// costs 2 * index_heads * index_head_dim = 16 KFLOP to recompute against
/// 8-12 bytes to store and reload. CPU: the same rule per token.
class DsaPrefillIndexer {
 public:
  /// `workspace_budget`: bytes the CUDA passes' scratch may take (it sets
  /// rows_per_pass; at least 4 rows are always taken).
  explicit DsaPrefillIndexer(Device device, size_t workspace_budget = size_t{512} << 20)
      : device_(device), budget_(workspace_budget) {}
  void prepare(const DsaPrefillIndexerParams& params, void* stream = nullptr);
  void run(const DsaPrefillIndexerParams& params, void* stream = nullptr);
  Device device() const { return device_; }
  /// Tokens per CUDA pass (0 before prepare).
  int32_t rows_per_pass() const { return rows_per_pass_; }
  size_t workspace_bytes() const { return workspace_.bytes() + lens_.bytes(); }

 private:
  Device device_;
  size_t budget_;
  int32_t batch_ = 0, num_tokens_ = 0, rows_per_pass_ = 0, heads_ = 0, dim_ = 0, topk_ = 0;
  int64_t kv_len_ = 0;
  bool prepared_ = false;
  Buffer workspace_;  // the decode indexer's workspace for rows_per_pass rows
  Buffer lens_;       // int32 [batch, passes]: each pass's window end (CUDA)
};

// ---- GQA over key blocks ----------------------------------------------------

/// How a block selection is laid out. Query block i of a chunk holds chunk
/// tokens [i * block_size, (i + 1) * block_size) (the last may be shorter);
/// num_query_blocks = ceil(num_tokens / block_size).
enum class BlockSelectionLayout : int32_t {
  /// One list per (query block, KV head), shared by the KV head's query
  /// heads (block-sparse prefill): block_ids [batch, num_query_blocks,
  /// num_kv_heads, width], counts [batch, num_query_blocks, num_kv_heads].
  kPerKvHead = 0,
  /// One list per (query block, query head) (a static per-head pattern):
  /// block_ids [batch, num_kv_heads, num_query_blocks, group_size, width],
  /// counts [batch, num_kv_heads, num_query_blocks, group_size], query head
  /// h = kv_head * group_size + g.
  kPerQueryHead = 1,
};

/// Kept key blocks of each query block. A list holds absolute key block ids
/// (block j = positions [j * block_size, (j + 1) * block_size)), each full
/// block once, and the query block's own block, if kept, last: it may be
/// partial (the sequence ends inside it), which the count cuts. counts = the
/// positions the list covers, (kept - 1) * block_size + the last block's
/// live positions. Entries past the count are never read (-1 by convention).
struct BlockPrefillSelection {
  BlockSelectionLayout layout = BlockSelectionLayout::kPerKvHead;
  const int32_t* block_ids = nullptr;
  const int32_t* counts = nullptr;
  int32_t width = 0;  // entries per list
};

/// One GQA prefill over key blocks. The chunk's start (L_b - num_tokens)
/// must be a multiple of block_size, so query blocks are key blocks. Token
/// t of query block i sees the positions of its list below pos(b, t) + 1
/// (the causal limit inside the diagonal block, by position); a position at
/// or past the query block's end (min((i + 1) * block_size, L_b) from the
/// chunk's start) is an error (CPU: thrown; CUDA: NaN rows and the error
/// flag). A row with nothing to see gets o = 0, lse = -inf.
struct GqaPrefillParams {
  DType dtype = DType::kBF16;  // q and o, and K and V when kv_format is kNative: bf16 or f16
  /// How K and V are stored, as DecodeParams::kv_format: kNative (`dtype`
  /// rows) or KvFormat::kE4m3PerHead (vLLM's fp8 KV cache: e4m3 K and V,
  /// K of KV head h is k * k_scale[h], V is v * v_scale[h]; k and v then
  /// count bytes in their strides and dims). kE4m3Mla is the MLA rows'
  /// format and is refused here. CUDA runs FP8 at head dim 128 only.
  KvFormat kv_format = KvFormat::kNative;
  const float* k_scale = nullptr;  // kE4m3PerHead: [num_kv_heads] fp32 (the run's device); null otherwise
  const float* v_scale = nullptr;  // kE4m3PerHead: [num_kv_heads]
  PrefillChunk chunk;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t block_size = 0;   // 1 .. 256
  const void* q = nullptr;  // [batch, num_tokens, num_qo_heads, k.dim], packed
  RowView k;                // row p of (sequence b, KV head h) at k.offset(b, h, p)
  RowView v;
  /// An engine's paged pool instead (block_table.data set): k and v are
  /// views of the pool's rows (seq_stride 0), position p of sequence b at
  /// row block_table[b, p / block_size] * block_size + p % block_size of
  /// them (table row b: row_of_sequence must be null); as MlaPrefillParams.
  BlockTable block_table;
  float scale = 0.0f;
  void* o = nullptr;     // [batch, num_tokens, num_qo_heads, v.dim], packed
  float* lse = nullptr;  // [batch, num_tokens, num_qo_heads] (natural log) or null
  BlockPrefillSelection selection;
};

/// Runs GQA block prefills: each (query block, KV head) list is one request
/// of the fused decode whose query rows are the block's tokens x the KV
/// head's query heads, so a gathered row is read once per 64 query rows
/// (the 64-row multi-token CTA at head dim 128) and each token's causal
/// limit is applied by position. Per-query-head lists run one request per
/// (query block, query head) over its KV head's rows. Over a block table
/// (an engine's pool) the rows are read through the engine-input kernels,
/// which keep every query row on the 16-row tiles (CUDA): the same answer,
/// each gathered row read once per 16 query rows. FP8 rows (kE4m3PerHead)
/// run on the 64-row CTA's e4m3 form where sm_90a code runs (dense), else
/// on the decode's 16-row e4m3 tiles (paged, or other GPUs).
class GqaBlockPrefill {
 public:
  explicit GqaBlockPrefill(Device device) : device_(device) {}
  Device device() const { return device_; }
  void prepare(const GqaPrefillParams& params, void* stream = nullptr);
  void run(const GqaPrefillParams& params, void* stream = nullptr);
  /// As MlaSparsePrefill::check_errors, and a chunk whose start is not a
  /// multiple of block_size (read on the device) is reported too.
  void check_errors(void* stream = nullptr);
  const char* kernel_name() const { return kernel_name_; }
  size_t workspace_bytes() const;

 private:
  struct Part {                            // the full query blocks, or the partial last one
    int32_t query_blocks = 0, tokens = 0;  // query blocks and tokens per block
    DecodePlan plan;
    Buffer workspace;
    Buffer indptr;  // CSR over the launch's lists
  };
  struct Shape {
    int32_t batch = 0, num_tokens = 0, num_qo_heads = 0, num_kv_heads = 0, block_size = 0, width = 0;
    int32_t dim_qk = 0, dim_v = 0;
    BlockSelectionLayout layout = BlockSelectionLayout::kPerKvHead;
    KvFormat kv_format = KvFormat::kNative;
    bool lse = false;
    bool paged = false;  // rows through a block table
    bool operator==(const Shape& o) const {
      return batch == o.batch && num_tokens == o.num_tokens && num_qo_heads == o.num_qo_heads &&
             num_kv_heads == o.num_kv_heads && block_size == o.block_size && width == o.width && dim_qk == o.dim_qk &&
             dim_v == o.dim_v && layout == o.layout && kv_format == o.kv_format && lse == o.lse && paged == o.paged;
    }
  };
  static Shape shape_of(const GqaPrefillParams& params);
  Device device_;
  Shape shape_;
  bool prepared_ = false;
  Part parts_[2];
  /// int32 windows [batch, num_query_blocks], the alignment flag, fp32 lse
  /// staging, then (FP8 per-query-head lists) the fp32 scales expanded to
  /// [2, num_kv_heads, group_size]: K's, then V's.
  Buffer scratch_;
  Buffer table_rows_;  // paged: int32 [batch, num_query_blocks], each query block's table row (its sequence)
  const char* kernel_name_ = "";
};

/// The block-sparse indexer's rule (models/block_sparse.h) per query block:
/// for query block i and KV head h, key block j < i scores
///   max over tokens t of block i, positions p of block j of q_index[b,t,h] . k_index[b, p]
/// (max-pooled, as a multi-token decode step pools its tokens); blocks
/// j >= i + 1 - local_blocks are force-kept, the top_blocks best of the
/// others kept (ties to the lower id, NaN last), and block i itself appended
/// last. So a list keeps min(top_blocks, i) + 1 blocks, increasing, then
/// the own block: what a decode step of the block's last token keeps, with
/// the block's tokens pooled.
struct BlockPrefillIndexerParams {
  DType dtype = DType::kBF16;  // keys and queries: bf16 or f16
  PrefillChunk chunk;
  int32_t num_kv_heads = 0;  // index queries per token (one per KV head)
  int32_t head_dim = 0;      // index dim: a multiple of 16, <= 256 (CUDA)
  int32_t block_size = 0;    // 16 .. 256, a multiple of 16 on CUDA
  int32_t top_blocks = 0;    // >= local_blocks - 1
  int32_t local_blocks = 1;  // >= 1
  /// The index keys: position p of sequence b at index_keys.offset(b, 0, p)
  /// (the block-sparse layer's K allocation at head num_kv_heads, or a
  /// key-only cache).
  RowView index_keys;
  /// kPaged: the keys are an engine's paged pool instead (`paged`, native
  /// or FP8 at head_dim 128; row b of its table for sequence b), read as the
  /// block decode indexer reads them (FP8: e4m3 x the key's scale);
  /// index_keys is unused. A block id outside the pool that a scored key
  /// block needs is never read: the CPU refuses it by name; on CUDA the
  /// lists that needed it select nothing (count 0: zero output) and `error`
  /// gets kIndexErrorBlock (a sequence past chunk.kv_len likewise,
  /// kIndexErrorLength).
  IndexKeyLayout key_layout = IndexKeyLayout::kDense;
  PagedIndexKeys paged;
  int32_t* error = nullptr;       // kPaged on CUDA, may be null: the IndexKeyError word (device), or'ed into
  const void* q_index = nullptr;  // [batch, num_tokens, num_kv_heads, head_dim], packed
  /// Out: a kPerKvHead selection of width top_blocks + 1.
  int32_t* block_ids = nullptr;  // [batch, num_query_blocks, num_kv_heads, top_blocks + 1]
  int32_t* counts = nullptr;     // [batch, num_query_blocks, num_kv_heads]
};

class BlockPrefillIndexer {
 public:
  explicit BlockPrefillIndexer(Device device) : device_(device) {}
  void prepare(const BlockPrefillIndexerParams& params, void* stream = nullptr);
  void run(const BlockPrefillIndexerParams& params, void* stream = nullptr);
  size_t workspace_bytes() const { return scores_.bytes(); }

 private:
  Device device_;
  int32_t batch_ = 0, num_tokens_ = 0, heads_ = 0, block_size_ = 0;
  int64_t kv_len_ = 0;
  bool prepared_ = false;
  Buffer scores_;  // fp32 [batch, num_query_blocks, num_kv_heads, key blocks]
};

/// The static per-query-head pattern (models/static_block_sparse.h) for a
/// chunk: query block i of query head h keeps key block j <= i when
///   i - j < local_blocks  or  (j + h * head_sliding_step + 1) % vert_stride == 0,
/// head_sliding_step = max(1, vert_stride / num_qo_heads). Writes a
/// kPerQueryHead selection: the kept blocks increasing (block i last), the
/// count cut at L_b, -1 up to `width`. A list longer than `width` keeps
/// `width` ids and its full count, which the attention then refuses (NaN
/// and the error flag) rather than reading a wrong row.
struct StaticPrefillParams {
  PrefillChunk chunk;
  int32_t num_qo_heads = 0, num_kv_heads = 0;
  int32_t block_size = 64, local_blocks = 16, vert_stride = 8;
  int32_t width = 0;             // entries per list (static_prefill_width)
  int32_t* block_ids = nullptr;  // out [batch, num_kv_heads, num_query_blocks, group_size, width]
  int32_t* counts = nullptr;     // out [batch, num_kv_heads, num_query_blocks, group_size]
};
/// Most blocks any query head keeps for a query block ending at kv_len.
int32_t static_prefill_width(const StaticPrefillParams& params, int64_t kv_len);
/// Writes the selection on `device` (one small kernel on CUDA; capturable).
void static_prefill_blocks(Device device, const StaticPrefillParams& params, void* stream = nullptr);

// ---- for tests and debugging --------------------------------------------------

/// The positions each query row of a GQA block prefill attends, per
/// (sequence, token, query head) (row (b * num_tokens + t) * num_qo_heads +
/// h), sorted and without duplicates: the positions of its list's blocks
/// below pos(b, t) + 1. Host arrays.
std::vector<std::vector<int32_t>> gqa_prefill_attended(const GqaPrefillParams& params);

}  // namespace sparsepage
