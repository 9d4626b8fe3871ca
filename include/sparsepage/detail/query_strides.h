// The strides the backends address q, q_extra and o with, whatever the
// QueryLayout. NOT part of the stable API: a helper the CPU and CUDA backends
// (and the tests that build their inputs) share; it may change in any release.
#pragma once

#include "sparsepage/decode.h"

namespace sparsepage {

/// The strides q, q_extra and o are addressed with: the packed
/// [num_sequences, q_len, num_kv_heads * group_size, dim] ones for
/// QueryLayout::kPacked, the params' own for kStrided.
struct QoStrides {
  QueryStrides q, q_extra, o;
};
QoStrides qo_strides(const DecodeParams& params);

}  // namespace sparsepage
