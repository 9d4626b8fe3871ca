// Chunked prefill of the layers (SparseLayer::prefill_chunk) on either
// backend; the CPU and CUDA suites call these with their device.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"

namespace sparsepage::testing {

/// A batch and the chunk it prefills.
struct LayerPrefillCase {
  /// Each slot's length before the chunk (its prompt admitted with random
  /// rows); a negative entry: a free (released) slot.
  std::vector<int64_t> prompt;
  int32_t num_tokens = 0;  // the chunk's tokens per active slot
  uint64_t seed = 1;
};

/// What the checks compare against.
struct PrefillOracles {
  /// Decode the chunk's tokens on a twin layer: one by one (DSA, static), or
  /// one multi-token step per query block (block-sparse: its selection is
  /// that step's; needs block_size <= kMaxQueryTokens): the attended sets
  /// must be equal and the outputs within `tol`.
  bool decode = true;
  /// Also prefill_token() token by token on a twin (DSA and block-sparse),
  /// when every chunk token's window is in the dense regime: outputs
  /// within `tol`, and every set the whole causal window.
  bool dense = true;
  /// Also the same chunk on the CPU backend (a CUDA run): sets equal, outputs within `tol`.
  bool cpu_twin = false;
  double tol = 5e-3;       // relative L2 per (slot, token) row against the twins
  double fp64_tol = 1e-2;  // relative L2 per (slot, token) row against fp64 over the attended sets
};

/// One chunk through DsaAttention::prefill, its output NaN-poisoned first,
/// on exactly representable inputs: against fp64 MLA attention over the
/// positions it reports (each within the token's causal window, at most
/// index_topk), against the oracles, and free slots' outputs zero; the
/// lengths grow by num_tokens for the active slots only.
void check_dsa_prefill(Device device, const DsaConfig& config, const LayerPrefillCase& c, const PrefillOracles& o);
void check_block_sparse_prefill(Device device, const BlockSparseConfig& config, const LayerPrefillCase& c,
                                const PrefillOracles& o);
void check_static_prefill(Device device, const StaticBlockSparseConfig& config, const LayerPrefillCase& c,
                          const PrefillOracles& o);

/// Runs `chunk(stream)` the way a serving loop does; a CUDA suite passes a
/// runner that captures the second call in a graph and replays it.
using ChunkRunner = std::function<void(const std::function<void(void*)>&)>;

/// `chunks` chunks of c.num_tokens tokens, each with fresh inputs written
/// into the same device buffers, through `run` after reserve(); each
/// chunk's output against the same chunk run eagerly on a twin (within
/// o.tol), and the lengths (read back with sync_live_len) against it.
void check_dsa_prefill_replay(Device device, const DsaConfig& config, const LayerPrefillCase& c, int32_t chunks,
                              const PrefillOracles& o, const ChunkRunner& run);
void check_block_sparse_prefill_replay(Device device, const BlockSparseConfig& config, const LayerPrefillCase& c,
                                       int32_t chunks, const PrefillOracles& o, const ChunkRunner& run);
void check_static_prefill_replay(Device device, const StaticBlockSparseConfig& config, const LayerPrefillCase& c,
                                 int32_t chunks, const PrefillOracles& o, const ChunkRunner& run);

/// Bad chunks refused by name before anything changes (the lengths and the
/// cache rows stay, and a later good chunk runs): num_tokens < 1, a null
/// input, a chunk start off the block grid, a batch of free slots, an
/// engine-paged layer, and a DSA shape the fused MLA prefill cannot take.
void check_prefill_refusals(Device device);

}  // namespace sparsepage::testing
