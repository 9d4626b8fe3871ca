// Test support shared by the CPU and CUDA suites: random problems with
// poisoned (NaN) rows everywhere a correct kernel must not read, and an fp64
// reference that attends explicit row lists.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/cache.h"
#include "sparsepage/decode.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/memory.h"
#include "sparsepage/page_table.h"

namespace sparsepage::testing {

/// Element bytes in `dtype` for `count` random values uniform in [-amp, amp].
std::vector<uint8_t> random_values(DType dtype, size_t count, std::mt19937_64& rng, float amp = 1.0f);
/// `count` NaN elements in `dtype`.
std::vector<uint8_t> nan_values(DType dtype, size_t count);
/// Host bytes of `dtype` as float.
std::vector<float> as_float(DType dtype, const std::vector<uint8_t>& bytes);
/// A cache's live window `[B, H, live_len(), D]` of K (key) or V rows as
/// fp32 on the host; a slot's rows past its own length (a free slot's all)
/// are zero, and a key-only cache's V window is empty.
std::vector<float> cache_window(const DenseKVCache& cache, bool key);

/// `count` multiples of 1/4 in [-1, 1]: bf16 and fp32 hold them, and their
/// products and sums exactly, so the indexers score the same on every
/// backend and a tie breaks by the rule alone.
std::vector<float> quarter_grid(std::mt19937_64& rng, size_t count);
/// Host fp32 values as `dtype` on `device` (none: a 16-byte buffer never read).
Buffer to_device(Device device, DType dtype, const std::vector<float>& x);
/// A bf16 output of `count` values, NaN until written.
Buffer poisoned(Device device, size_t count);
/// The first `count` bf16 values of `o` as float.
std::vector<float> read_bf16(Device device, const Buffer& o, size_t count);

/// What a random paged problem looks like.
struct ProblemSpec {
  DType dtype = DType::kBF16;
  std::vector<int32_t> seq_lens;
  int32_t page_size = 1;
  bool random_first_page_offset = false;  // offsets in [0, page_size)
  int32_t group_size = 4;
  int32_t dim_qk = 128;
  int32_t dim_v = 128;
  int32_t dim_extra = 0;          // second K stream when > 0
  bool v_aliases_k = false;       // V = the first dim_v columns of K's rows
  int32_t k_row_padding = 0;      // K rows carry this many extra elements
  int32_t v_row_padding = 0;      // V rows too (a separate V only), so K and V strides differ
  int32_t extra_row_padding = 0;  // and second-stream rows
  int64_t pool_pages = 4096;
  bool allow_duplicates = true;  // pages drawn with replacement
  float scale = 0.0f;            // 0: 1/sqrt(dim_qk + dim_extra)
};

/// A problem in host memory; every pool row that no visible token resolves
/// to is NaN, so a read of a wrong row shows up in the output.
struct PagedProblem {
  ProblemSpec spec;
  PageTableStructure table;
  std::vector<int32_t> indices;
  std::vector<uint8_t> q, q_extra;  // [R, G, dim_qk], [R, G, dim_extra]
  std::vector<uint8_t> k_pool, v_pool, e_pool;
  int64_t k_row_stride = 0, v_row_stride = 0, e_row_stride = 0;
  float scale = 1.0f;

  int32_t num_requests() const { return table.num_requests(); }
  int64_t pool_rows() const { return spec.pool_pages * spec.page_size; }
  /// Pool rows each request attends, in order (duplicates included).
  std::vector<std::vector<int64_t>> token_rows() const;
  /// Params over host pointers (pass output buffers). v.data aliases k.data
  /// when the spec says so.
  DecodeParams host_params(void* o, float* lse) const;
};

PagedProblem make_problem(const ProblemSpec& spec, std::mt19937_64& rng);

/// The fp64 softmax step every reference here shares: out[0, dv) gets the
/// softmax(scores)-weighted sum of the rows' values, `value(j, i)` being
/// value i of scored row j. Returns the lse (natural log); no rows: -inf,
/// and out is left as it is.
template <class Value>
double softmax_weighted_sum(const std::vector<double>& scores, int64_t dv, Value&& value, double* out) {
  if (scores.empty()) return -std::numeric_limits<double>::infinity();
  const double max = *std::max_element(scores.begin(), scores.end());
  double sum = 0.0;
  for (size_t j = 0; j < scores.size(); ++j) {
    const double w = std::exp(scores[j] - max);
    sum += w;
    for (int64_t i = 0; i < dv; ++i) out[i] += w * value(j, i);
  }
  for (int64_t i = 0; i < dv; ++i) out[i] /= sum;
  return max + std::log(sum);
}

/// fp64 attention of each request over explicit rows.
struct Reference {
  std::vector<double> o;    // [R, G, dim_v]
  std::vector<double> lse;  // [R, G]; -inf for empty requests
};
Reference reference_attention(const PagedProblem& problem, const std::vector<std::vector<int64_t>>& rows);

/// ||got - ref|| / ||ref||; +inf when got holds a NaN or inf (NaN never passes).
double relative_l2(const std::vector<float>& got, const std::vector<double>& ref);

/// Compares each request on its own (a concatenated L2 dilutes one bad
/// request): per (request, head) relative L2 of o at most `o_tol`, and
/// |lse - ref| at most `lse_tol` (natural log; -inf for an empty request must
/// be -inf). Returns the first mismatch, described, or an empty string.
std::string compare_per_request(const PagedProblem& problem, const Reference& ref, const std::vector<float>& o,
                                const std::vector<float>& lse, double o_tol, double lse_tol);

/// Mask-path parameters for one request of one KV head: `group_size` query
/// rows of width `dim` over `live_len` dense K and V rows of the same width
/// (row stride `dim`). No mask, scale 0, no outputs: the caller sets those.
MaskedDecodeParams one_request_masked_params(DType dtype, int32_t group_size, int64_t live_len, int32_t dim,
                                             const void* q, const void* k, const void* v);

}  // namespace sparsepage::testing
