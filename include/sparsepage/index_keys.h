// The DSA lightning indexer's keys as a described source (docs/DESIGN.md,
// "Index keys"): the layer's dense rows, or an engine's paged pool of native
// (f16/bf16) or FP8 keys read through its block table; the FP8 format's write
// op and query quantizer; and the CPU twin of the indexer over every source.
// DsaIndexerArgs (models/dsa.h) carries a source to dsa_select_tokens_cuda.
//
// The FP8 format is vLLM's indexer K cache for DeepSeek-V3.2, as read at
// vllm-project/vllm 37cb21c1695d11baba8e369b071d2f44c1561c8f
// (csrc/libtorch_stable/cache_kernels.cu: indexer_k_quant_and_cache_kernel,
// cp_gather_indexer_k_quant_cache_kernel), 002d6073aa034d4f5545d45021b0e56d1f3c3593
// (vllm/model_executor/models/deepseek_v2.py: Indexer, scale_fmt "ue8m0",
// quant_block_size 128) and 006475fe481a855ea61dd7aafc3722458fcbbeea
// (vllm/model_executor/layers/sparse_attn_indexer.py), and as DeepGEMM's
// fp8_paged_mqa_logits reads it at deepseek-ai/DeepGEMM
// 54e22612409371d6364144b69086735beb54e98b (csrc/apis/attention.hpp,
// deep_gemm/include/deep_gemm/impls/sm90_fp8_paged_mqa_logits.cuh):
//
//   a block of block_size tokens, at pool + block * block_stride_bytes:
//     bytes [0, 128 block_size)                 token s's 128 e4m3 values at 128 s
//     bytes [128 block_size, 132 block_size)    token s's fp32 scale at 128 block_size + 4 s
//
// (132 bytes per token; the engine allocates [num_blocks, block_size, 132]
// uint8, so block_stride_bytes is 132 block_size unless the pool is padded).
// A key value dequantizes as e4m3_to_float(byte) * scale.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsepage/types.h"

namespace sparsepage {

struct DsaConfig;
struct DsaIndexerArgs;

/// Where the indexer reads its keys (DsaIndexerArgs::key_layout).
enum class IndexKeyLayout : int32_t {
  /// The layer's own rows: DsaIndexerArgs::k_cache, [batch * capacity,
  /// latent_dim + index_head_dim], the key at column latent_dim.
  kDense = 0,
  /// An engine's paged pool (DsaIndexerArgs::paged), in its format.
  kPaged = 1,
};

/// How a paged pool stores a key.
enum class IndexKeyFormat : int32_t {
  /// f16 / bf16 values, [num_blocks, block_size, index_head_dim] (strides below).
  kNative = 0,
  /// vLLM's FP8 blocks (header comment): e4m3 values then one fp32 scale per token.
  kE4m3 = 1,
};

/// The FP8 format's constants and byte offsets inside one block.
struct IndexKeyFp8 {
  static constexpr int32_t kDim = 128;         // values per key: one quantization block
  static constexpr int32_t kTokenBytes = 132;  // 128 e4m3 values + one fp32 scale
  static constexpr int64_t value_offset(int32_t /*block_size*/, int32_t slot) { return int64_t{slot} * kDim; }
  static constexpr int64_t scale_offset(int32_t block_size, int32_t slot) {
    return int64_t{block_size} * kDim + 4 * int64_t{slot};
  }
};

/// How the write op rounds a key's scale (vLLM's scale_fmt). Both start from
/// s = max(amax, 1e-4) / 448 in fp32, amax the largest |value| of the key
/// (NaN values ignored, as fmaxf does).
enum class IndexScaleFormat : int32_t {
  /// The smallest power of two >= s: DeepSeek-V3.2's "ue8m0", what vLLM
  /// writes for the model. vLLM computes exp2f(ceilf(log2f(s))); for every
  /// f16 / bf16 key that is exactly this (s is a power of two or at least
  /// 1e-4 of a binade away from one, far beyond log2f's error), which the
  /// CPU test checks over every f16 and bf16 magnitude.
  kUe8m0 = 0,
  /// s itself (vLLM's scale_fmt other than "ue8m0").
  kFp32 = 1,
};

/// An engine's paged index keys. Position p of sequence b is slot p %
/// block_size of block block_table[b * block_table_stride + p / block_size].
/// Every pointer is on the device the call runs on.
struct PagedIndexKeys {
  IndexKeyFormat format = IndexKeyFormat::kE4m3;
  void* pool = nullptr;            // the blocks; 16-byte aligned
  int64_t num_blocks = 0;          // blocks in the pool: ids outside [0, num_blocks) are never read
  int32_t block_size = 0;          // tokens per block: a multiple of 8 that divides 64 or is a multiple of 64
  int64_t block_stride_bytes = 0;  // bytes between blocks, a multiple of 16; 0: packed (block_size x bytes per token)
  /// kNative only: the keys' element type and the bytes between a block's
  /// tokens (a multiple of 16, at least index_head_dim x 2; 0: packed).
  DType dtype = DType::kBF16;
  int64_t token_stride_bytes = 0;
  const int32_t* block_table = nullptr;  // [batch, block_table_stride] block ids (int32, as engines keep them)
  int64_t block_table_stride = 0;        // entries between sequences' rows (>= max_blocks)
  int32_t max_blocks = 0;                // entries of a row that may be read: sequences hold at most
                                         // max_blocks x block_size positions
};

/// The form of the index queries (DsaIndexerArgs::q_format).
enum class IndexQueryFormat : int32_t {
  /// q_index in DsaIndexerArgs::dtype (f16 / bf16). Against FP8 keys the
  /// indexer quantizes them itself, by quantize_index_queries' rule.
  kNative = 0,
  /// What quantize_index_queries_* writes: e4m3 [rows, index_heads, 128],
  /// each (row, head)'s scale folded into the weights. FP8 keys only.
  kE4m3 = 1,
};

/// Bits of the indexer's and the write op's device error word. A refused
/// row of the indexer selects nothing (positions -1, count -1, which the decode flags and poisons for that request
/// alone); a refused token of the write op is not written.
enum IndexKeyError : int32_t {
  /// A sequence's length is negative, over max_kv_len, or longer than its
  /// block-table row holds (max_blocks x block_size).
  kIndexErrorLength = 1,
  /// A block-table entry the indexer needed (a block holding a live
  /// position of a scored row) lies outside [0, num_blocks).
  kIndexErrorBlock = 2,
  /// A write op's slot lies past the pool (slot >= num_blocks x block_size,
  /// or below -1).
  kIndexErrorSlot = 4,
};

/// Bytes of one token in `keys`' format (132 for FP8; index_head_dim x 2, or
/// token_stride_bytes when set, for native keys).
int64_t index_key_token_bytes(const PagedIndexKeys& keys, int32_t index_head_dim);
/// keys.block_stride_bytes, or the packed stride when it is 0.
int64_t index_key_block_bytes(const PagedIndexKeys& keys, int32_t index_head_dim);

/// Why `keys` cannot be read as index keys of index_head_dim values, or ""
/// (null pointers, misalignment, a block size or stride the format cannot
/// have, a table narrower than max_blocks).
std::string paged_index_keys_problem(const PagedIndexKeys& keys, int32_t index_head_dim);

/// The write op, as vLLM's cache write (indexer_k_quant_and_cache for the
/// FP8 format): key i of `keys` ([num_tokens, index_head_dim] in key_dtype,
/// key_stride elements apart) goes to slot slots[i] = block * block_size +
/// offset of `pool`; a slot of -1 is skipped. FP8: per key, scale =
/// `scale_format`'s rounding of max(amax, 1e-4) / 448 and value i =
/// e4m3(key[i] / scale) (an IEEE fp32 division; round to nearest even,
/// saturated to +-448, NaN stays NaN), the values and the scale at the
/// format's offsets. Native: the key copied (key_dtype must be the pool's).
/// CPU and CUDA write the same bytes.
/// CPU: host pointers; a slot past the pool throws Error naming it (nothing
/// is written then).
void write_index_keys_cpu(const PagedIndexKeys& pool, int32_t index_head_dim, DType key_dtype, const void* keys,
                          int64_t key_stride, const int64_t* slots, int64_t num_tokens,
                          IndexScaleFormat scale_format = IndexScaleFormat::kUe8m0);
/// CUDA: device pointers (keys 8-byte aligned, key_stride a multiple of 4),
/// asynchronous on `stream`, capturable. The slots are read on the device, so
/// a slot past the pool is skipped and kIndexErrorSlot or'ed into `error`
/// (device int32, may be null).
void write_index_keys_cuda(const PagedIndexKeys& pool, int32_t index_head_dim, DType key_dtype, const void* keys,
                           int64_t key_stride, const int64_t* slots, int64_t num_tokens,
                           IndexScaleFormat scale_format = IndexScaleFormat::kUe8m0, int32_t* error = nullptr,
                           void* stream = nullptr);

/// The FP8 query form, as vLLM quantizes DeepSeek-V3.2's index queries (its
/// fused rope-quant kernel and per_token_group_quant_fp8 with ue8m0): per
/// (row, head), s = the smallest power of two >= max(amax, 1e-10) / 448,
/// q_fp8 = e4m3(q / s) and weights_out = weights x s (exact: s is a power of
/// two). q: [rows, heads, 128] in `dtype` (f16 / bf16); weights, weights_out:
/// fp32 [rows, heads] (the model's weights, with whatever factors it folds in
/// first: vLLM passes weights x 128^-0.5 x heads^-0.5); q_fp8: [rows, heads,
/// 128] bytes. weights_out may alias weights.
void quantize_index_queries_cpu(DType dtype, const void* q, const float* weights, int64_t rows, int32_t heads,
                                void* q_fp8, float* weights_out);
/// CUDA: device pointers (q 8-byte and q_fp8 4-byte aligned), asynchronous on
/// `stream`, capturable.
void quantize_index_queries_cuda(DType dtype, const void* q, const float* weights, int64_t rows, int32_t heads,
                                 void* q_fp8, float* weights_out, void* stream = nullptr);

/// The indexer's CPU twin: the same arguments as dsa_select_tokens_cuda with
/// host pointers (workspace unused, may be null), the same outputs
/// (positions in increasing order padded with -1, counts, error bits) and
/// the same rule. Scores follow the source's documented dequantization,
/// evaluated in fp64 and rounded to fp32 once:
///   native keys:  I(r, t) = sum_j w[r, j] ReLU(q[r, j] . k[t])
///   FP8 keys:     I(r, t) = scale[t] sum_j w'[r, j] ReLU(q8[r, j] . k8[t])
/// with q8, k8 the e4m3 values, scale[t] the key's scale and w' the weights
/// with each query scale folded in (IndexQueryFormat::kE4m3 as given; with
/// kNative queries quantized by quantize_index_queries' rule). The top
/// min(index_topk, length) positions are kept, ties to the lower position,
/// NaN last. A row whose length or needed blocks are refused selects nothing
/// and sets its IndexKeyError bit (block ids are checked for rows that are
/// scored, where keys are read). Throws Error, with the launcher's words, for
/// what dsa_select_tokens_cuda refuses on the host, except the GPU's own
/// limits (the workspace, alignment of the dense rows and queries, the FP8
/// kernel's 64 heads, shared memory).
void dsa_select_tokens_cpu(const DsaConfig& config, int32_t sequences, const DsaIndexerArgs& args);

/// The twin's scores: row r (= sequence x q_len + token) gets I(r, t) for
/// each position t of its window, NaN kept as NaN. Empty rows for refused
/// sequences. For tests.
std::vector<std::vector<float>> dsa_index_scores_cpu(const DsaConfig& config, int32_t sequences,
                                                     const DsaIndexerArgs& args);

}  // namespace sparsepage
