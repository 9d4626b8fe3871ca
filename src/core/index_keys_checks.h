// Host checks of the index-key sources that the CPU twin and the CUDA
// launchers share (src/core/index_keys.cc), so both refuse the same inputs
// with the same words.
#pragma once

#include <cstdint>
#include <string>

#include "sparsepage/index_keys.h"

namespace sparsepage::detail {

/// Why the write op cannot write `num_tokens` keys into `pool`, or "".
std::string write_index_keys_problem(const PagedIndexKeys& pool, int32_t index_head_dim, DType key_dtype,
                                     const void* keys, int64_t key_stride, const int64_t* slots, int64_t num_tokens);

/// Why the query quantizer cannot run on these arguments, or "".
std::string quantize_index_queries_problem(DType dtype, const void* q, const float* weights, int64_t rows,
                                           int32_t heads, const void* q_fp8, const float* weights_out);

/// Why args' key source and query form cannot be read at `config`, or "":
/// the paged pool (paged_index_keys_problem), the format against dtype and
/// index_head_dim, the query form against the keys, and max_kv_len against
/// the table's width. Dense sources: only the query form.
std::string index_source_problem(const DsaConfig& config, const DsaIndexerArgs& args);

}  // namespace sparsepage::detail
