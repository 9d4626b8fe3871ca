// The paged decode's entry points with the query-token bound as an argument.
// A decode step takes 1 .. kMaxQueryTokens query tokens per request
// (decode.h); a block-sparse prefill (prefill.h) runs a whole query block of
// block_size tokens as one request of the same kernels, so it calls these
// with kMaxQueryBlockTokens. Everything else about the call is the public
// function's.
#pragma once

#include <cstdint>
#include <limits>

#include "sparsepage/decode.h"

namespace sparsepage::detail {

/// Most query tokens one request of a prefill query block may carry: the
/// largest block size a prefill takes.
constexpr int32_t kMaxQueryBlockTokens = 256;

/// check_decode_params with q_len allowed up to max_q_len.
void check_decode_params(const DecodeParams& params, const DecodePlan& plan, int32_t max_q_len);
/// run_decode_cpu with q_len allowed up to max_q_len.
void run_decode_cpu(const DecodeParams& params, const DecodePlan& plan, void* workspace, int32_t max_q_len);
/// Every check run_decode_cpu makes before it writes anything (it throws
/// what that would throw), for callers that must refuse a set of decodes
/// before any of them writes.
void check_decode_cpu(const DecodeParams& params, const DecodePlan& plan, void* workspace, int32_t max_q_len);
/// How the merge finishes the rows of split requests. The FlashMLA-shaped
/// decode (mla_sparse.h) passes its attention sink (one more logit per head
/// in each row's softmax denominator, adding no value) and FlashMLA's lse for
/// a row that attended nothing (+inf); the defaults are the decode's own.
/// Rows of unsplit requests are written by the partial kernel, which knows
/// neither.
struct MergeFinish {
  const float* sink = nullptr;  // [query heads of a request] or null, indexed by the head within its request
  float empty_lse = -std::numeric_limits<float>::infinity();
};

/// run_decode_cuda with q_len allowed up to max_q_len, its split requests
/// finished as `finish` says.
const char* run_decode_cuda(const DecodeParams& params, const DecodePlan& plan, void* workspace, void* stream,
                            int32_t max_q_len, const MergeFinish& finish = {});

}  // namespace sparsepage::detail
