// Continuous batching of the three layers, checked on either backend:
// requests join a ragged batch with prompts of random length and leave at
// random, slots are reused, and every step's output for every live request
// is compared with a lone run of that request (a batch-1 layer fed the same
// prompt and the same tokens), bad calls mixed in change nothing.
#pragma once

#include <cstdint>
#include <functional>

#include "sparsepage/layer.h"

namespace sparsepage::testing {

struct ContinuousBatchingRun {
  int32_t slots = 4;
  int32_t steps = 200;
  int32_t max_prompt = 300;  // prompts of 1 .. max_prompt tokens
  double join = 0.35;        // per step: chance a free slot admits a request
  double leave = 0.04;       // per step and request: chance it finishes
  double bad_call = 0.05;    // per step: chance a refused call is tried first (and must change nothing)
  uint64_t seed = 1;
  /// A duration instead of a step count (> 0): steps go on until this many
  /// seconds have passed (checked after each step). `steps` then caps each
  /// request's decode tokens (a request that reaches it leaves), so the
  /// capacity reserved up front holds for any duration.
  double seconds = 0.0;
  /// The dispatch's performance gates off, so every step of the batched
  /// layer fuses (what a captured step needs to keep one plan).
  bool always_fused = false;
  /// Runs the batched layer's step (given the stream to run it on); null:
  /// eagerly on the default stream. The CUDA suite passes one that captures
  /// a step in a CUDA graph and replays it for every later step, so
  /// requests join and leave between replays of one graph. It must leave
  /// the step complete when it returns.
  std::function<LayerStep(const std::function<LayerStep(void*)>& step)> runner;
};

/// What a run covered, for the caller's own assertions.
struct ContinuousBatchingStats {
  int64_t steps = 0;          // batched steps run
  double seconds = 0.0;       // wall time of the run
  int64_t compared_rows = 0;  // (step, live slot) outputs and selections compared with the lone run
  int64_t admitted = 0, released = 0;
  int64_t fused_steps = 0, sparse_steps = 0;
  int64_t refused_calls = 0;
  int64_t longest = 0;  // the longest sequence seen
};

ContinuousBatchingStats check_block_sparse_continuous_batching(Device device, const ContinuousBatchingRun& run);
ContinuousBatchingStats check_dsa_continuous_batching(Device device, const ContinuousBatchingRun& run);
ContinuousBatchingStats check_static_continuous_batching(Device device, const ContinuousBatchingRun& run);

}  // namespace sparsepage::testing
