// The DSA step over engine-owned pools (KVStorage::kEnginePools): MLA rows
// (bf16 or the 656-byte FP8 rows) and index keys (bf16 or vLLM's FP8 blocks)
// in the engine's paged pools behind a shuffled block table, the lengths
// passed by the engine (ragged, one slot free), unused blocks poisoned. The
// selection is checked against the indexer's twin over the same pools and
// the output against fp64 attention over the dequantized rows.
#pragma once

#include "sparsepage/types.h"

namespace sparsepage::testing {
void check_dsa_engine_pools(Device device, bool fp8);
}  // namespace sparsepage::testing
