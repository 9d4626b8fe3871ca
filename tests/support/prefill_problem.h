// Random sparse-prefill problems (sparsepage/prefill.h) shared by the CPU and
// CUDA suites, with every cache row that no query token attends poisoned
// (NaN), fp64 references per token, and the token-by-token oracle (the
// paged decode run once per query token over the same selection).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/prefill.h"

namespace sparsepage::testing {

// ---- MLA -------------------------------------------------------------------

struct MlaPrefillSpec {
  int32_t batch = 1;
  int32_t num_tokens = 16;
  int32_t num_heads = 64;
  int32_t topk = 32;
  std::vector<int32_t> starts = {40};  // per sequence: positions before the chunk (L_b = start + num_tokens)
  double pad_fraction = 0.2;           // entries that are -1
  bool duplicates = false;             // entries drawn with replacement
  bool topk_length = false;            // a per-token count of entries to read
  bool sink = false;                   // an attention sink per head
  int32_t empty_tokens = 0;            // the first tokens of sequence 0 get only -1 entries
  bool fp8 = false;                    // the rows as the 656-byte FP8 format
  bool integer_values = false;         // small integers (exact in fp32 in any order)
  int64_t capacity = 0;                // rows per sequence; 0: the longest L_b + 8
  uint64_t seed = 1;
};

/// FlashMLA's layout: q [batch, num_tokens, num_heads, 576] (latent then
/// rope), kv [batch, capacity, 576] bf16 rows (kv_fp8: [batch, capacity,
/// 656] bytes). Positions no token selects hold NaN.
struct MlaPrefillProblem {
  MlaPrefillSpec spec;
  int64_t kv_len = 0;  // the longest L_b
  int64_t capacity = 0;
  std::vector<int32_t> kv_lens;
  std::vector<uint8_t> q, kv, kv_fp8;
  std::vector<int32_t> indices, topk_length;
  std::vector<float> sink;
  float scale = 0.0f;

  /// Params over the given copies of the arrays (host or device).
  MlaPrefillParams params(const void* q_data, const void* kv_data, const int32_t* index_data,
                          const int32_t* topk_length_data, const int32_t* kv_lens_data, const float* sink_data,
                          void* out, float* lse, float* max_logits) const;
  /// Over the host arrays.
  MlaPrefillParams host_params(void* out, float* lse, float* max_logits) const;
};

MlaPrefillProblem make_mla_prefill_problem(const MlaPrefillSpec& spec);

struct MlaPrefillReference {
  std::vector<double> out;         // [batch, num_tokens, num_heads, 512]
  std::vector<double> lse;         // +inf for a token with nothing to attend
  std::vector<double> max_logits;  // -inf then
};
/// fp64 over the rows as stored (the FP8 rows dequantized), FlashMLA's
/// conventions (prefill.h).
MlaPrefillReference mla_prefill_reference(const MlaPrefillProblem& pb);

/// Per (token, head): relative L2 of out <= out_tol (exact zeros for an empty
/// token), |lse - ref| <= lse_tol (+inf must be +inf), and max_logits (when
/// given) within max_tol. "" or the first mismatch.
std::string compare_mla_prefill(const MlaPrefillProblem& pb, const MlaPrefillReference& ref,
                                const std::vector<float>& out, const std::vector<float>& lse,
                                const std::vector<float>* max_logits, double out_tol, double lse_tol, double max_tol);

/// The token-by-token oracle on the CPU: for each query token, the paged
/// decode (run_decode_cpu, one query token) over exactly its valid entries
/// with its window pos + 1; the outputs laid out as the prefill's, lse in the
/// decode's convention (-inf for nothing attended).
void mla_token_by_token_cpu(const MlaPrefillProblem& pb, std::vector<float>& out, std::vector<float>& lse);
/// The positions each query row of an MLA prefill attends, per (sequence,
/// token) of the chunk (row b * num_tokens + t), sorted and without
/// duplicates: the valid entries of its index rows. Host arrays; kv_lens
/// host or null.
std::vector<std::vector<int32_t>> mla_prefill_attended(const MlaPrefillParams& p);

/// The problem's rows in an engine's paged pool (MlaPrefillParams::
/// block_table): blocks of `block_size` rows handed to the sequences in the
/// order of `block_ids` (a permutation of the pool's blocks, each sequence
/// taking the blocks its rows need in turn), `max_blocks` table entries a
/// sequence. Every pool row no position holds is 0xFF bytes (NaN in every
/// field) and every table entry past a sequence's rows an id outside the
/// pool.
struct MlaPrefillPool {
  int32_t block_size = 0, max_blocks = 0;
  int64_t num_blocks = 0;
  std::vector<uint8_t> rows;   // [num_blocks * block_size] rows in the problem's format
  std::vector<int32_t> table;  // [batch, max_blocks]
  /// `p` with kv, kv_rope and block_table moved onto this pool (host memory;
  /// the table as it is when called).
  MlaPrefillParams paged(MlaPrefillParams p) const;
};
MlaPrefillPool make_mla_prefill_pool(const MlaPrefillProblem& pb, int32_t block_size, int32_t max_blocks,
                                     const std::vector<int32_t>& block_ids);

// ---- GQA over blocks -------------------------------------------------------

struct GqaPrefillSpec {
  DType dtype = DType::kBF16;
  int32_t batch = 1;
  int32_t num_tokens = 40;
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t head_dim = 64;
  int32_t block_size = 16;
  std::vector<int32_t> starts = {32};  // multiples of block_size
  BlockSelectionLayout layout = BlockSelectionLayout::kPerKvHead;
  int32_t width = 4;  // entries per list (the own block included)
  uint64_t seed = 1;
};

/// q [batch, num_tokens, num_qo_heads, d], K and V dense [batch,
/// num_kv_heads, capacity, d], random block lists (the own block last);
/// positions no list covers hold NaN.
struct GqaPrefillProblem {
  GqaPrefillSpec spec;
  int64_t kv_len = 0, capacity = 0;
  std::vector<int32_t> kv_lens;
  std::vector<uint8_t> q, k, v;
  std::vector<int32_t> block_ids, counts;
  float scale = 0.0f;

  int32_t query_blocks() const { return (spec.num_tokens + spec.block_size - 1) / spec.block_size; }
  GqaPrefillParams params(const void* q_data, const void* k_data, const void* v_data, const int32_t* ids,
                          const int32_t* count_data, const int32_t* kv_lens_data, void* o, float* lse) const;
  GqaPrefillParams host_params(void* o, float* lse) const;
};

GqaPrefillProblem make_gqa_prefill_problem(const GqaPrefillSpec& spec);

struct GqaPrefillReference {
  std::vector<double> out;  // [batch, num_tokens, num_qo_heads, d]
  std::vector<double> lse;  // -inf for nothing attended
};
GqaPrefillReference gqa_prefill_reference(const GqaPrefillProblem& pb);
std::string compare_gqa_prefill(const GqaPrefillProblem& pb, const GqaPrefillReference& ref,
                                const std::vector<float>& out, const std::vector<float>& lse, double out_tol,
                                double lse_tol);

/// The token-by-token oracle: per query token and list, the paged decode
/// with one query token over the list's blocks, the count cut at the
/// token's own position + 1 (window addressing, window pos + 1).
void gqa_token_by_token_cpu(const GqaPrefillProblem& pb, std::vector<float>& out, std::vector<float>& lse);

// ---- index inputs ------------------------------------------------------------

/// `count` small integers in [-amp, amp] as `dtype` (exact in fp32 sums).
std::vector<uint8_t> integer_values(DType dtype, size_t count, std::mt19937_64& rng, int amp);

}  // namespace sparsepage::testing
