// Test support for the engines' own inputs (DecodeParams' index matrix,
// -1 padding, block-table addressing and strided q / o): a random problem in
// an engine's layout — a paged pool [num_blocks, block_size, num_kv_heads,
// row] (or the MLA pool [num_blocks, block_size, 576]) — with every pool row
// that no visible token resolves to poisoned with NaN, its fp64 reference,
// and the checks both backends' tests share.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/plan.h"

namespace sparsepage::testing {

/// How the engine hands its indices over.
enum class EngineIndex {
  /// vLLM / SGLang DSA: [num_seqs, topk] (or [num_seqs, num_kv_heads, topk])
  /// global slot ids block_id * block_size + offset, page size 1.
  kSlotIds,
  /// The indexer's request-local positions [num_seqs, topk] plus the
  /// engine's block table, resolved inside the kernel.
  kPositions,
  /// Dense paged attention: the block table [num_seqs, max_blocks] itself
  /// is the index matrix (page size = block size), lengths per sequence.
  kBlockPages,
};

struct EngineSpec {
  DType dtype = DType::kBF16;
  int32_t num_seqs = 3;
  int32_t num_kv_heads = 1;
  int32_t group_size = 16;
  bool mla = true;         // K rows of 512 + 64 with V = the latent (num_kv_heads 1)
  int32_t head_dim = 128;  // not MLA: K and V width
  int32_t block_size = 64;
  int32_t num_blocks = 64;
  EngineIndex index = EngineIndex::kSlotIds;
  int32_t topk = 128;             // kSlotIds / kPositions: ids per request
  int32_t context = 500;          // kPositions / kBlockPages: longest sequence
  bool per_head_indices = false;  // kSlotIds: one row per (sequence, KV head)
  double pad_fraction = 0.0;      // share of ids that are -1 (kSlotIds / kPositions)
  bool lengths = false;           // kSlotIds / kPositions: topk_length-style per-request counts
  bool strided_qo = false;        // q (and q_extra) slices of a packed buffer, o a column slice
};

/// Pointers to a problem's arrays (host, or device copies).
struct EngineArrays {
  const void* q = nullptr;
  const void* q_extra = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* indices = nullptr;
  const int32_t* lens = nullptr;
  const int32_t* block_table = nullptr;
  const int32_t* row_of_sequence = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
};

struct EngineProblem {
  EngineSpec spec;
  int32_t dim_qk = 0, dim_v = 0, dim_extra = 0;
  int32_t page_size = 1;
  int32_t width = 0;                     // ids per request row
  std::vector<int32_t> plan_counts;      // per request: the bound the plan is made for
  std::vector<int32_t> indices;          // the index matrix
  std::vector<int32_t> lens;             // per request (kSlotIds / kPositions) or sequence (kBlockPages); may be empty
  std::vector<int32_t> block_table;      // kPositions: [table_rows, max_blocks]
  std::vector<int32_t> row_of_sequence;  // kPositions
  int32_t table_rows = 0, max_blocks = 0;
  std::vector<uint8_t> q_buf, k_pool, v_pool;  // q_buf holds q (and q_extra) at the strides below
  int64_t q_offset_extra = 0;                  // elements from q_buf's start to q_extra
  QueryStrides q_strides, q_extra_strides, o_strides;
  int64_t o_elements = 0;  // elements of the o buffer (strided: with gaps)
  int64_t k_row_stride = 0, k_head_stride = 0, v_row_stride = 0, v_head_stride = 0;
  float scale = 1.0f;
  /// Per request: the pool slots it attends, in order (padding dropped).
  std::vector<std::vector<int64_t>> slots;

  int32_t num_requests() const { return spec.num_seqs * spec.num_kv_heads; }
  int64_t pool_slots() const { return int64_t{spec.num_blocks} * spec.block_size; }
  DecodeParams params(const EngineArrays& a) const;
  EngineArrays host_arrays(void* o, float* lse) const;
  DecodePlan plan(const PlanShape& shape) const;
};

EngineProblem make_engine_problem(const EngineSpec& spec, uint64_t seed);

/// fp64 outputs: o [R, G, dim_v] (packed), lse [R, G] (-inf when empty).
struct EngineReference {
  std::vector<double> o, lse;
};
EngineReference engine_reference(const EngineProblem& pb);

/// The packed [R, G, dim_v] outputs read from an o buffer laid out at
/// pb.o_strides (as fp32), plus whether every element outside the output
/// rows (the gaps of a strided o) is still NaN.
struct EngineOutput {
  std::vector<float> o, lse;
  bool gaps_untouched = true;
};
EngineOutput unpack_output(const EngineProblem& pb, const std::vector<uint8_t>& o_buf, const std::vector<float>& lse);

/// Per (request, head): o within `o_tol` relative L2 of fp64 (NaN fails),
/// lse within `lse_tol`, an empty request exactly o = 0 and lse = -inf.
/// Returns the first mismatch, or "".
std::string compare_engine(const EngineProblem& pb, const EngineReference& ref, const EngineOutput& got, double o_tol,
                           double lse_tol);

}  // namespace sparsepage::testing
