// Multi-token decode problems (DecodeParams::q_len > 1), shared by the CPU
// and CUDA suites: a dense window cache with a selection of window pages per
// (sequence, KV head), q_len query tokens per sequence, an fp64 reference
// that applies each token's causal limit, and the same step run as q_len
// single-token steps.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/types.h"

namespace sparsepage::testing {

struct MultiTokenSpec {
  DType dtype = DType::kBF16;
  std::vector<int32_t> live_lens;  // per sequence, each >= q_len: the window including the new tokens
  int32_t num_kv_heads = 2;
  int32_t group_size = 4;
  int32_t q_len = 4;
  int32_t page_size = 16;
  int32_t head_dim = 128;
  int32_t pages_per_request = 6;  // selected pages (at most the window's)
  int64_t capacity = 0;           // rows per (sequence, head); 0: the longest window + 8
  uint64_t seed = 1;
};

/// A host problem. Cache rows that no selected position names are NaN, so
/// a read of an unselected or out-of-window row shows in the output; the
/// selected positions past a token's causal limit hold real values, so only
/// the causal limit keeps them out of that token's softmax.
struct MultiTokenProblem {
  MultiTokenSpec spec;
  int32_t batch = 0;
  int64_t capacity = 0;
  std::vector<uint8_t> k, v;      // [batch, num_kv_heads, capacity, head_dim]
  std::vector<uint8_t> q;         // [batch, q_len, num_qo_heads, head_dim]
  std::vector<int32_t> pages;     // [requests, pages_per_request] window page ids, the final page last
  std::vector<int32_t> seq_lens;  // [requests] tokens the pages cover (the final page cut at the window)
  std::vector<int32_t> indptr;    // [requests + 1] CSR over `pages`

  int32_t num_requests() const { return batch * spec.num_kv_heads; }
  int32_t num_qo_heads() const { return spec.num_kv_heads * spec.group_size; }
  /// Positions request r attends (in page order), before any causal limit.
  std::vector<int64_t> positions(int32_t r) const;
  /// Params over the given pointers (host or device copies of the arrays
  /// above; the caller plans for group_size * q_len rows).
  DecodeParams params(const void* k_data, const void* v_data, const void* q_data, const int32_t* indptr_data,
                      const int32_t* pages_data, const int32_t* seq_lens_data, const int32_t* live_lens_data, void* o,
                      float* lse) const;
};

MultiTokenProblem make_multi_token_problem(const MultiTokenSpec& spec);

/// fp64 reference: o [batch, q_len, num_qo_heads, head_dim] and lse
/// [batch, q_len, num_qo_heads]; token t of sequence b attends the selected
/// positions below live_lens[b] - (q_len - 1 - t).
struct MultiTokenReference {
  std::vector<double> o, lse;
};
MultiTokenReference multi_token_reference(const MultiTokenProblem& pb);

/// The step on `device`: one multi-token decode (fixed_chunk_tokens > 0
/// forces the split). Returns o as float and lse; both start NaN, so an
/// element the decode does not write fails the comparison.
struct MultiTokenResult {
  std::vector<float> o, lse;
  std::string kernel;  // CUDA: the kernel run_decode_cuda launched; empty on the CPU
};
MultiTokenResult run_multi_token(const MultiTokenProblem& pb, Device device, int32_t fixed_chunk_tokens = 0);
/// The same step as q_len single-token steps: token t is a q_len = 1 decode
/// whose window is live_lens[b] - (q_len - 1 - t) and whose selection is the
/// selected positions inside that window (page_size 1).
MultiTokenResult run_as_single_tokens(const MultiTokenProblem& pb, Device device);

/// Per-row relative L2 of o (at most o_tol) and |lse - ref| (at most
/// lse_tol); the first mismatch, described, or "".
std::string compare_multi_token(const MultiTokenProblem& pb, const std::vector<float>& o, const std::vector<float>& lse,
                                const std::vector<double>& ref_o, const std::vector<double>& ref_lse, double o_tol,
                                double lse_tol);

/// A multi-token step's cache append against the same tokens appended one
/// at a time: two bf16 caches on `device` (3 sequences, K 3 heads x k_dim,
/// V 2 heads x v_dim, a 5-token prompt) take steps of 3, 1 and 4 tokens,
/// one through DenseKVCache::append_step_tokens, the other through
/// append_token per token. Empty when both hold bit-equal windows, equal
/// host and device lengths, and the rows of every step's tokens where they
/// belong; otherwise what differed.
std::string step_append_mismatch(Device device, int32_t k_dim = 24, int32_t v_dim = 8);

}  // namespace sparsepage::testing
