// The sparse prefill's small kernels (prefill.h) behind plain C++
// signatures: the CUDA ones in src/cuda/attention/prefill.cu and
// src/cuda/indexers/block_prefill_indexer.cu, their CPU twins in
// src/cpu/prefill_cpu.cc. src/core/prefill_no_cuda.cc stands in for the CUDA
// ones when the library is built without CUDA. Every pointer lives on the
// backend's device; each CUDA function is one launch on `stream` (a
// cudaStream_t), allocating, synchronizing and reading back nothing.
#pragma once

#include <cstdint>
#include <vector>

#include "core/paged_keys.h"
#include "sparsepage/decode.h"
#include "sparsepage/prefill.h"

namespace sparsepage::detail {

/// The exact max_logits of an MLA prefill on the host (prefill.h), once the
/// run has checked every entry: `windows` are the tokens' windows
/// (token_windows_cpu).
void mla_max_logits_cpu(const MlaPrefillParams& params, const int32_t* windows);

/// The DSA prefill indexer on the host, over each sequence's L_b (`lens`):
/// each token the decode rule over its own window (dsa_select_tokens_cpu),
/// its kept positions written in increasing order.
void dsa_prefill_indexer_cpu(const DsaPrefillIndexerParams& params, const std::vector<int64_t>& lens);

/// Each query token's window: windows[b * num_tokens + t] = L_b - num_tokens
/// + t + 1 (L_b of the chunk); 0 when L_b < num_tokens (every entry of such
/// a token is then refused).
struct TokenWindowsArgs {
  PrefillChunk chunk;
  int32_t* windows = nullptr;  // out [batch * num_tokens]: pos(b, t) + 1, or L_b when not causal
  bool causal = true;
};
void token_windows_cpu(const TokenWindowsArgs& args);
void token_windows_cuda(const TokenWindowsArgs& args, void* stream);

/// Each query block's window: windows[b * num_query_blocks + i] = start_b +
/// min((i + 1) * block_size, num_tokens), start_b = L_b - num_tokens; 0 for
/// every block of a sequence whose start is not a multiple of block_size or
/// whose L_b < num_tokens, which also sets *bad_chunk (may be null).
struct BlockWindowsArgs {
  PrefillChunk chunk;
  int32_t block_size = 0;
  int32_t* windows = nullptr;  // out [batch * num_query_blocks]
  uint32_t* bad_chunk = nullptr;
};
void block_windows_cpu(const BlockWindowsArgs& args);
void block_windows_cuda(const BlockWindowsArgs& args, void* stream);

/// The MLA prefill's last touch, per (sequence, token, head) row: lse of
/// -inf (nothing attended) becomes +inf (FlashMLA's convention), and with a
/// sink the row's 512 outputs are scaled by 1 / (1 + exp(sink[h] - lse))
/// (0 for a row with nothing attended). lse_in and lse_out may be the same
/// array. Rows are [batch, num_tokens, num_heads]; out is addressed by its
/// strides (elements).
struct MlaEpilogueArgs {
  DType dtype = DType::kBF16;
  int32_t batch = 0, num_tokens = 0, num_heads = 0, dim = 512;
  const float* lse_in = nullptr;  // [rows]: the decode's lse (natural log, -inf for empty)
  float* lse_out = nullptr;       // [rows] or null
  const float* sink = nullptr;    // [num_heads] or null
  void* out = nullptr;
  int64_t out_seq = 0, out_token = 0, out_head = 0;
};
void mla_epilogue_cpu(const MlaEpilogueArgs& args);
void mla_epilogue_cuda(const MlaEpilogueArgs& args, void* stream);

/// lse of per-query-head GQA launches, staged [batch, num_kv_heads,
/// num_tokens, group_size], into [batch, num_tokens, num_kv_heads *
/// group_size].
struct LseGatherArgs {
  int32_t batch = 0, num_kv_heads = 0, num_tokens = 0, group_size = 0;
  const float* staged = nullptr;
  float* lse = nullptr;
};
void lse_gather_cpu(const LseGatherArgs& args);
void lse_gather_cuda(const LseGatherArgs& args, void* stream);

/// The per-KV-head FP8 scales (KvFormat::kE4m3PerHead) for per-query-head
/// GQA launches, whose requests are the query heads of one KV head (the
/// decode indexes a scale by the request's "KV head", there its query head
/// within the group): expanded[kv * group_size + g] = k_scale[kv], and
/// V's after K's. Written on the device every run, so the scales may
/// change between replays of a captured chunk.
struct ScaleExpandArgs {
  int32_t num_kv_heads = 0, group_size = 0;
  const float* k_scale = nullptr;  // [num_kv_heads]
  const float* v_scale = nullptr;  // [num_kv_heads]
  float* expanded = nullptr;       // out [2, num_kv_heads, group_size]
};
void scale_expand_cpu(const ScaleExpandArgs& args);
void scale_expand_cuda(const ScaleExpandArgs& args, void* stream);

/// The DSA prefill indexer's passes: lens[b * passes + i] = L_b - num_tokens
/// + min(num_tokens, (i + 1) * rows_per_pass), the window end of pass i's
/// last token (what the decode indexer reads as the sequence length of a
/// multi-token step of that pass's rows).
struct PassLensArgs {
  PrefillChunk chunk;
  int32_t rows_per_pass = 0, passes = 0;
  int32_t* lens = nullptr;  // out [batch * passes]
};
void pass_lens_cuda(const PassLensArgs& args, void* stream);

/// Max-pooled block scores of the block prefill indexer (prefill.h):
/// scores[((b * num_query_blocks + i) * num_kv_heads + h) * key_blocks + j]
/// for key block j < I + 1 - local_blocks (I = start_b / block_size + i);
/// other entries are not written. NaN products are ignored by the max.
struct BlockScoresArgs {
  DType dtype = DType::kBF16;
  PrefillChunk chunk;
  int32_t num_kv_heads = 0, head_dim = 0, block_size = 0, local_blocks = 1;
  RowView keys;                   // position p of sequence b at keys.offset(b, 0, p)
  const void* q_index = nullptr;  // [batch, num_tokens, num_kv_heads, head_dim]
  int32_t key_blocks = 0;         // scores' row length: ceil(kv_len / block_size)
  float* scores = nullptr;
};
/// The CUDA scores over an engine's paged keys instead of `keys` (row b of
/// paged.table for sequence b): native rows of `dtype`, or with fp8 vLLM's
/// FP8 blocks (e4m3 x the key's scale). A key block with a row in a block
/// outside the pool is not read: it scores NaN and sets kIndexErrorBlock in
/// *error; a sequence longer than chunk.kv_len is not scored and sets
/// kIndexErrorLength (BlockSelectArgs::refuse_nan then refuses those
/// lists). Its own type, so the dense kernels' parameter stays as it was.
struct PagedScoresArgs : BlockScoresArgs {
  PagedKeys paged{};
  bool fp8 = false;
  int32_t* error = nullptr;  // device, may be null: IndexKeyError bits (or'ed)
};
/// `paged` non-null (the CPU twin of the paged keys): the keys are read
/// from an engine's paged pool (prefill.h, BlockPrefillIndexerParams::paged),
/// args.keys unused; a block id outside the pool is refused by name.
void block_scores_cpu(const BlockScoresArgs& args, const PagedIndexKeys* paged = nullptr);
void block_scores_cuda(const BlockScoresArgs& args, void* stream);
void block_scores_paged_cuda(const PagedScoresArgs& args, void* stream);

/// The top blocks of each (sequence, query block, KV head) from the scores
/// above: a kPerKvHead selection (prefill.h) of width top_blocks + 1.
struct BlockSelectArgs {
  PrefillChunk chunk;
  int32_t num_kv_heads = 0, block_size = 0, top_blocks = 0, local_blocks = 1;
  int32_t key_blocks = 0;
  const float* scores = nullptr;
  int32_t* block_ids = nullptr;  // out [batch, num_query_blocks, num_kv_heads, top_blocks + 1]
  int32_t* counts = nullptr;     // out [batch, num_query_blocks, num_kv_heads]
  /// CUDA over paged keys: a list whose scored blocks include a NaN score (a
  /// key block the scores refused), or whose sequence is longer than
  /// chunk.kv_len, selects nothing (ids -1, count 0: zero output).
  bool refuse_nan = false;
};
void block_select_cpu(const BlockSelectArgs& args);
void block_select_cuda(const BlockSelectArgs& args, void* stream);

/// static_prefill_blocks (prefill.h) on each backend.
struct StaticBlocksArgs {
  PrefillChunk chunk;
  int32_t num_qo_heads = 0, num_kv_heads = 0;
  int32_t block_size = 0, local_blocks = 0, vert_stride = 0, head_sliding_step = 1;
  int32_t width = 0;
  int32_t* block_ids = nullptr;
  int32_t* counts = nullptr;
};
void static_blocks_cpu(const StaticBlocksArgs& args);
void static_blocks_cuda(const StaticBlocksArgs& args, void* stream);

}  // namespace sparsepage::detail
