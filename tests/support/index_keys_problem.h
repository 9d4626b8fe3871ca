// Indexer problems over every index-key source (sparsepage/index_keys.h) for
// the CPU and CUDA tests: ragged per-sequence lengths, an engine pool whose
// blocks are handed out shuffled, spare blocks and unwritten slots poisoned
// with NaN (0xFF bytes: a NaN e4m3 value, a NaN fp32 scale, a NaN bf16),
// table entries past each sequence's blocks holding ids outside the pool,
// and keys written by the library's write op.
//
// `exact` problems use small integers for keys and queries and multiples of
// 1/2 for the weights: the FP8 quantization of such a key or query is exact
// (every integer in [-4, 4] times the ue8m0 scale's inverse is an e4m3
// value), so every score is exact in fp32 in any summation order, on tensor
// cores too, and two indexers must agree on every position, ties included.
// Each scored row of an exact problem has a tie block across its threshold
// and a NaN in its best key.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"

namespace sparsepage::testing {

struct IndexKeysSpec {
  int32_t heads = 64, dim = 128, topk = 64;
  int32_t q_len = 1;
  DType dtype = DType::kBF16;
  IndexKeyLayout layout = IndexKeyLayout::kPaged;
  IndexKeyFormat format = IndexKeyFormat::kE4m3;
  IndexQueryFormat q_format = IndexQueryFormat::kNative;
  int32_t block_size = 64;
  std::vector<int32_t> kv_lens;     // per sequence
  int64_t max_kv_len = 0;           // 0: the longest length
  int32_t spare_blocks = 3;         // pool blocks no sequence owns
  int32_t extra_table_entries = 2;  // entries past each sequence's blocks (ids outside the pool)
  int64_t block_pad_bytes = 0;      // padding after each block (a multiple of 16)
  bool exact = true;
  uint64_t seed = 1;
};

struct IndexKeysProblem {
  IndexKeysSpec spec;
  DsaConfig config;
  int32_t sequences = 0;
  int64_t max_kv_len = 0;
  int64_t capacity = 0;          // dense: rows per sequence
  int64_t longest = 0;           // the longest length
  std::vector<float> keys;       // [sequences, longest, dim]: the logical keys (exact in dtype)
  std::vector<uint8_t> storage;  // the pool (paged) or the K rows (dense)
  std::vector<int32_t> table;    // [sequences, max_blocks]
  int32_t max_blocks = 0;
  int64_t num_blocks = 0;
  std::vector<int32_t> owned;  // pool blocks some sequence owns, ascending
  std::vector<uint8_t> q;      // q_index bytes: dtype, or e4m3 for q_format kE4m3
  std::vector<float> weights;  // [rows, heads] (scales folded in for kE4m3)

  int32_t rows() const { return sequences * spec.q_len; }
  const float* key(int32_t seq, int64_t t) const {
    return &keys[(size_t(seq) * size_t(longest) + size_t(t)) * size_t(spec.dim)];
  }
  /// Row r's window (kv_lens[r / q_len] less the later tokens).
  int64_t window(int32_t r) const;
  /// The paged description with its pool and table pointers (of any device).
  PagedIndexKeys paged(void* pool, const int32_t* table_ptr) const;
  /// Indexer arguments over the given pointers (of any device); workspace unset.
  DsaIndexerArgs args(void* storage_ptr, const int32_t* table_ptr, const void* q_ptr, const float* w_ptr,
                      const int32_t* lens_ptr, int32_t* positions, int32_t* counts, int32_t* error) const;
};

IndexKeysProblem make_index_keys_problem(const IndexKeysSpec& spec);

/// The lengths of a continuous batch's steps, for one call each: released
/// slots (0), windows that fit the top-k (1 .. topk, not scored) and scored
/// ones side by side, on both sides of the top-k, of multiples of 64 (a key
/// tile) and, when `bound` reaches past them, of 2048 and 4096 (classify
/// slices), the bound itself, and steps where all but one or every slot is
/// empty.
/// Every step has 8 sequences, each at most `bound`; `built` is each
/// sequence's longest length over the steps (what a problem is made with,
/// so every step's windows hold written keys).
struct MixedLengthSteps {
  std::vector<int32_t> built;
  std::vector<std::vector<int32_t>> steps;
};
MixedLengthSteps mixed_length_steps(int32_t topk, int32_t bound);

/// An indexer's outputs, read back.
struct IndexSelection {
  std::vector<int32_t> positions;  // [rows, topk]
  std::vector<int32_t> counts;     // [rows]
  int32_t error = 0;
};

/// Writes keys far larger than any live one (3e4 in every value) into every
/// pool slot no live position uses (unowned blocks, and slots past each
/// length): read, they would win every top-k. Returns how many slots.
int64_t write_huge_unused_keys(IndexKeysProblem& pb);

/// The CPU twin on the problem (host pointers), outputs poisoned first.
IndexSelection run_index_twin(const IndexKeysProblem& pb);
/// The twin's scores.
std::vector<std::vector<float>> index_twin_scores(const IndexKeysProblem& pb);

/// I(r, t) in fp64 from the logical keys and the (exactly representable)
/// queries and weights, NaN kept: the rule every exact source must meet.
std::vector<double> exact_scores(const IndexKeysProblem& pb, int32_t r);

/// Checks `got` against the twin `want` row by row: counts equal, positions
/// increasing inside the window and padded with -1, and the same set, except
/// that with `tolerance` > 0 a position may be swapped for one whose twin
/// score is within tolerance x (1 + |threshold|) of the row's threshold.
void expect_same_selection(const IndexKeysProblem& pb, const IndexSelection& got, const IndexSelection& want,
                           const char* what, double tolerance = 0.0);

}  // namespace sparsepage::testing
