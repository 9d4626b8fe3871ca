// The dispatch policy (docs/DESIGN.md: the dispatch policy): whether a sparse decode runs the fused
// paged kernel or declines so that the caller runs its mask or gather path.
// `decide_sparse_decode` is a pure function of its inputs; the heuristics and
// their reasons live in src/core/dispatch.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace sparsepage {

enum class OutcomeKind : int32_t {
  kFused = 0,
  kKillSwitch,          // SPARSEPAGE_SPARSE_DECODE pins the dense path
  kBelowFloor,          // too few selected rows to beat the alternative kernel
  kBelowSparsity,       // live window not enough times the selected count
  kNonRawCache,         // quantized or pool-backed cache
  kUnsupportedHeadDim,  // no fused kernel for these head dims
  kNoDevice,            // the fused path needs a GPU the process does not have
  kUnsupportedLayout,   // dtype, alignment or row strides the fused kernel cannot read
  kUnsupportedArch,     // no kernel for this GPU architecture in this build (cuda_arch_problem)
  kCount
};
const char* outcome_kind_name(OutcomeKind kind);

/// What a fused attempt did: fused (with its shape) or a fallback whose
/// reason names the numbers that produced it.
struct SparseDecodeOutcome {
  OutcomeKind kind = OutcomeKind::kFused;
  int64_t requests = 0;       // folded requests
  int64_t selected_rows = 0;  // rows per request (max) for fused; total for reasons
  int64_t chunks = 0;         // work items of the plan
  bool merge = false;
  const char* kernel = "";  // fused: the kernel that ran (as run_decode_cuda names it, or "CPU loop")
  std::string reason;       // fallbacks only
  bool fused() const { return kind == OutcomeKind::kFused; }
  /// The one-line description, e.g.
  /// "fused sparse launch (4 request(s) x 2048 selected rows, 256 chunks, merge on;
  /// 16-row tiles, mma.sync)".
  std::string describe() const;
};

/// The policy's knobs. Defaults are the measured ones (docs/PERFORMANCE.md).
struct DispatchConfig {
  bool enabled = true;                    // SPARSEPAGE_SPARSE_DECODE
  int64_t min_kv_tokens = 0;              // SPARSEPAGE_MIN_KV_TOKENS (single-request launches)
  int64_t min_kv_tokens_per_request = 0;  // SPARSEPAGE_MIN_KV_TOKENS_PER_REQUEST (batched launches)
  int64_t min_sparsity = 2;               // SPARSEPAGE_MIN_SPARSITY; 0 disables the gate
  /// 0: decide for the current GPU. Otherwise decide as if it were
  /// sm_<assume_sm> (80, 90, 100): what another card would get, and how the
  /// tests see a non-Hopper decline on a Hopper machine.
  int32_t assume_sm = 0;

  /// This configuration with the performance gates (min_kv_tokens,
  /// min_kv_tokens_per_request, min_sparsity) off: what a caller with no
  /// mask path to prefer uses (a layer over an engine's paged pool). The
  /// kill switch and assume_sm stay.
  DispatchConfig without_performance_gates() const {
    DispatchConfig c = *this;
    c.min_kv_tokens = 0;
    c.min_kv_tokens_per_request = 0;
    c.min_sparsity = 0;
    return c;
  }

  static DispatchConfig defaults();
  /// Defaults overridden by the environment (see the parse_* functions).
  static DispatchConfig from_environment();
};

/// The process-wide configuration: read from the environment once, on first use.
const DispatchConfig& process_dispatch_config();

/// Kill switch: "0", "false", "off", "no" (any case, surrounding spaces
/// ignored) disable the fused path; anything else, a typo included, keeps it.
bool parse_enable_switch(const char* value);
/// A non-negative integer, or `fallback` for anything else (null, empty,
/// "2.5", "abc", negative).
int64_t parse_count(const char* value, int64_t fallback);
/// "1", "true", "on", "yes" (any case) turn a debug switch on.
bool parse_debug_switch(const char* value);

/// The facts a decision is made from.
struct DispatchInput {
  int64_t num_requests = 0;   // folded: batch * num_kv_heads
  int64_t selected_rows = 0;  // total selected rows across requests
  int64_t live_len = 0;       // tokens in the cache (per request)
  bool raw_cache = true;      // raw fp16/bf16 rows
  bool head_dims_supported = true;
  bool device_available = true;
  bool layout_supported = true;  // dtype, KV format, alignment, row strides
  std::string layout_problem;    // why not (cuda_layout_problem), named in the decline; may be empty
  std::string arch_problem;      // cuda_arch_problem for the device; empty: a kernel exists
  int64_t chunks = 0;            // filled into the outcome when fused
  bool merge = false;
};

SparseDecodeOutcome decide_sparse_decode(const DispatchInput& input, const DispatchConfig& config);

/// Running totals for harnesses.
struct DispatchStats {
  int64_t fused = 0;
  int64_t fallbacks = 0;
  int64_t by_kind[static_cast<int>(OutcomeKind::kCount)] = {};
  int64_t fused_rows = 0;  // selected rows sent through the fused kernel
};
DispatchStats dispatch_stats();
void reset_dispatch_stats();  // also re-arms once-per-kind announcements

/// Counts the outcome in the stats and announces the first occurrence of
/// each kind ("sparse paged decode: <describe()>") on stderr and the log sink.
/// Returns true when this call announced.
bool record_outcome(const SparseDecodeOutcome& outcome);

}  // namespace sparsepage
