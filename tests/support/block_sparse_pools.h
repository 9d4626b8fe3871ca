// The block-sparse step over engine-owned pools (KVStorage::kEnginePools),
// checked on either backend: an engine simulated on the host owns K and V
// pools and an index-key pool (bf16 rows or vLLM's FP8 blocks) with tables
// of their own, hands out blocks from a shuffled free list (released
// requests' blocks are re-poisoned with NaN and reused), writes each token's
// rows and key, and passes the lengths. A ragged four-slot batch (an empty
// slot, sequences in the dense and the sparse regime, requests leaving and
// slots reused) runs beside a twin over the same K/V pools that keeps its
// own index keys (KVStorage::kEnginePaged, fed the same keys, dequantized for
// FP8): every step keeps the same blocks, free slots write zeros, and the
// outputs are bit-identical when both plan for the same bound (eager), within
// 1e-2 relative L2 otherwise (a captured step keeps its capture's bound).
#pragma once

#include <cstdint>
#include <functional>

#include "sparsepage/layer.h"

namespace sparsepage::testing {

struct BlockPoolsRun {
  bool fp8_keys = false;
  /// Runs the pools step (given the stream to run it on); null: eagerly on
  /// the default stream with max_seq_len = the longest live length. Set,
  /// max_seq_len stays the engine's fixed bound (what a captured step
  /// needs); the CUDA suite passes one that captures a step and replays it.
  std::function<LayerStep(const std::function<LayerStep(void*)>& step)> runner;
};

struct BlockPoolsStats {
  int64_t compared_rows = 0;  // (step, live slot) outputs compared
  int64_t sparse_rows = 0;    // of those, in the sparse regime
  int64_t free_rows = 0;      // (step, free slot) outputs checked to be zero
  int64_t reused_blocks = 0;  // blocks handed out again after a release
  int64_t bitwise_rows = 0;   // outputs compared bit for bit
};

BlockPoolsStats check_block_sparse_engine_pools(Device device, const BlockPoolsRun& run);
/// What every backend's run must have covered: sparse and dense sequences,
/// free slots, reused blocks; `bitwise`: every output equal to its twin bit
/// for bit (the bf16-keys form).
void expect_block_pools_coverage(const BlockPoolsStats& s, bool bitwise);

/// Refusals: a length past max_seq_len, a negative one, and a key block id
/// outside the pool each refuse their sequence (check_errors() names them,
/// the pools are unchanged; on CUDA the other sequences' outputs stand);
/// bad arguments (no lengths, index_k set, a key pool of another dtype, a
/// key table narrower than max_seq_len, admit/release) throw by name
/// before anything runs.
void check_block_sparse_engine_pools_refusals(Device device, bool fp8_keys);

}  // namespace sparsepage::testing
