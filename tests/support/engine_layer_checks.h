// Checks of the layers over an engine's paged pool (KVStorage::kEnginePaged)
// that run unchanged on either backend; the CPU and CUDA suites call them
// with their device.
#pragma once

#include "sparsepage/memory.h"

namespace sparsepage::testing {

/// A block-sparse layer over an engine pool `[num_blocks, 16, heads, dim]`
/// with a shuffled block table, free blocks NaN-poisoned, against the same
/// layer over its own dense cache fed the same tokens: in the sparse regime
/// every step keeps the same blocks and writes bit-identical outputs; in
/// the dense regime (every block attended through the fused path) the
/// output matches an fp64 reference over the whole window.
void check_engine_paged_block_sparse(Device device);

/// The DSA layer over an engine MLA pool `[num_blocks, 16, 576]` (latent then
/// rope in one row) against the layer over its own cache: the same
/// positions and bit-identical outputs, below and above index_topk.
void check_engine_paged_dsa(Device device);

/// The same over the engines' FP8 pool (KvFormat::kE4m3Mla, 656-byte rows
/// with NaN-poisoned free blocks), against the layer over its own cache
/// holding the dequantized values: the same positions, no NaN, and outputs
/// within 5e-3 relative L2; formats other than the MLA rows and rows too
/// short for the format are refused by name, appending nothing.
void check_engine_paged_dsa_fp8(Device device);

/// Misuse is refused by name and appends nothing: the layer-cache entry on
/// an engine-paged layer and the reverse, token rows passed to an
/// engine-paged step, a block table too narrow for the window, and a step
/// the dispatch declines (no mask path to fall back to).
void check_engine_paged_errors(Device device);

}  // namespace sparsepage::testing
