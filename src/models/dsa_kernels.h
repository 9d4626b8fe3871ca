// The DSA layer's device kernels (src/cuda/indexers/dsa_indexer.cu), behind plain
// C++ signatures; src/models/dsa_no_cuda.cc stands in for them when the
// library is built without CUDA.
#pragma once

#include <cstdint>

namespace sparsepage {
struct DsaConfig;
struct DsaIndexerArgs;
}  // namespace sparsepage

namespace sparsepage::detail {
/// Limits of the CUDA DSA indexer (src/cuda/indexers/dsa_indexer.cu): index keys are
/// warpgroup-MMA operands in k-steps of 16 columns, one sequence's index
/// queries are staged in shared memory, and sequences are a grid dimension.
inline constexpr int kDsaMaxIndexHeadDim = 256;
inline constexpr int kDsaMaxQueryElements = 16384;
inline constexpr int kDsaMaxBatch = 65535;

/// Throws Error naming the first limit of the CUDA DSA indexer that `config`
/// at `batch` breaks. Host code (src/models/dsa.cc), so it is the same check
/// with or without a CUDA build.
void check_dsa_indexer_cuda(const DsaConfig& config, int32_t batch);

/// dsa_select_tokens_cuda (models/dsa.h) with args.q_len allowed up to
/// max_q_len: a prefill (prefill.h) scores hundreds of a sequence's tokens
/// per pass, each row with its own causal window, as a multi-token step
/// scores its few.
void dsa_select_tokens_cuda(const DsaConfig& config, int32_t sequences, const DsaIndexerArgs& args, int32_t max_q_len,
                            void* stream);
}  // namespace sparsepage::detail
