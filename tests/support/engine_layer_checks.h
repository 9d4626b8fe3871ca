// Checks of the layers over an engine's paged pool (KVStorage::kEnginePaged)
// that run unchanged on either backend; the CPU and CUDA suites call them
// with their device.
#pragma once

#include <cstdint>

#include "sparsepage/memory.h"

namespace sparsepage::testing {

/// The sizes of the checks below. The defaults are the full sizes (the CPU
/// suite's); the CUDA suite's quick mode passes smaller ones that reach the
/// same regimes.
struct EnginePagedSizes {
  // Block-sparse layer (blocks of 64 tokens, sparse past 2 * topk * 64):
  int32_t block_topk = 4;
  int64_t block_dense_prompt = 300;   // two steps stay in the dense regime
  int32_t block_dense_table = 24;     // the block table's width, in engine blocks of 16
  int64_t block_sparse_prompt = 900;  // twice the selection, for the layer-cache twin's sparsity gate
  int32_t block_sparse_table = 64;
  int64_t block_misuse_prompt = 600;  // wider than 8 engine blocks
  // DSA layer: a prompt below index_topk and one above it.
  int32_t dsa_topk = 64;
  int64_t dsa_short_prompt = 40;
  int64_t dsa_long_prompt = 150;
  int64_t dsa_misuse_prompt = 100;
};

/// A block-sparse layer over an engine pool `[num_blocks, 16, heads, dim]`
/// with a shuffled block table, free blocks NaN-poisoned, against the same
/// layer over its own dense cache fed the same tokens: in the sparse regime
/// every step keeps the same blocks and writes bit-identical outputs; in
/// the dense regime (every block attended through the fused path) the
/// output matches an fp64 reference over the whole window.
void check_engine_paged_block_sparse(Device device, const EnginePagedSizes& sizes = {});

/// The DSA layer over an engine MLA pool `[num_blocks, 16, 576]` (latent then
/// rope in one row) against the layer over its own cache: the same
/// positions and bit-identical outputs, below and above index_topk.
void check_engine_paged_dsa(Device device, const EnginePagedSizes& sizes = {});

/// The same over the engines' FP8 pool (KvFormat::kE4m3Mla, 656-byte rows
/// with NaN-poisoned free blocks), against the layer over its own cache
/// holding the dequantized values: the same positions, no NaN, and outputs
/// within 5e-3 relative L2; formats other than the MLA rows and rows too
/// short for the format are refused by name, appending nothing.
void check_engine_paged_dsa_fp8(Device device, const EnginePagedSizes& sizes = {});

/// Misuse is refused by name and appends nothing: the layer-cache entry on
/// an engine-paged layer and the reverse, token rows passed to an
/// engine-paged step, a block table too narrow for the window, and a step
/// the dispatch declines (no mask path to fall back to).
void check_engine_paged_errors(Device device, const EnginePagedSizes& sizes = {});

}  // namespace sparsepage::testing
