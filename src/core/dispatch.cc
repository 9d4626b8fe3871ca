// The dispatch policy. Every threshold here is a crossover measured with
// tools/sparse_paged_decode_bench on the target GPU; docs/PERFORMANCE.md
// records the sweep and the command. Reasons carry the numbers that produced
// them so that a log line alone explains a decline.
#include "sparsepage/dispatch.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <sstream>

#include "sparsepage/log.h"
#include "sparsepage/types.h"

namespace sparsepage {
namespace {

std::string trimmed_lower(const char* value) {
  std::string s(value);
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::mutex& stats_mutex() {
  static std::mutex mutex;
  return mutex;
}
DispatchStats& stats_slot() {
  static DispatchStats stats;
  return stats;
}
// One flag per outcome kind: a warm-up decline must not hide a later,
// permanent one of another kind.
std::array<bool, static_cast<size_t>(OutcomeKind::kCount)>& announced() {
  static std::array<bool, static_cast<size_t>(OutcomeKind::kCount)> flags{};
  return flags;
}

SparseDecodeOutcome decline(OutcomeKind kind, const DispatchInput& in, std::string reason) {
  SparseDecodeOutcome out;
  out.kind = kind;
  out.requests = in.num_requests;
  out.selected_rows = in.selected_rows;
  out.reason = std::move(reason);
  return out;
}

}  // namespace

const char* outcome_kind_name(OutcomeKind kind) {
  switch (kind) {
    case OutcomeKind::kFused: return "fused";
    case OutcomeKind::kKillSwitch: return "kill_switch";
    case OutcomeKind::kBelowFloor: return "below_floor";
    case OutcomeKind::kBelowSparsity: return "below_sparsity";
    case OutcomeKind::kNonRawCache: return "non_raw_cache";
    case OutcomeKind::kUnsupportedHeadDim: return "unsupported_head_dim";
    case OutcomeKind::kNoDevice: return "no_device";
    case OutcomeKind::kUnsupportedLayout: return "unsupported_layout";
    case OutcomeKind::kUnsupportedArch: return "unsupported_arch";
    case OutcomeKind::kCount: break;
  }
  return "unknown";
}

std::string SparseDecodeOutcome::describe() const {
  std::ostringstream line;
  if (fused()) {
    line << "fused sparse launch (" << requests << " request(s) x " << (requests > 0 ? selected_rows / requests : 0)
         << " selected rows, " << chunks << " chunks, merge " << (merge ? "on" : "off");
    if (kernel != nullptr && *kernel != '\0') line << "; " << kernel;
    line << ")";
  } else {
    line << "fallback: " << reason;
  }
  return line.str();
}

// Measured on an H200 with `scripts/gpu_check.sh` (stage "dispatch") and
// tools/sparse_paged_decode_bench --min-sparsity 0 at the block-sparse
// geometry: batch 1, 4, 16 and 64, sparsity 1.5x to 64x, selections of 256 to
// 2176 rows per request, contexts 512 to 139264. The fused path won at every
// point (narrowest: 1.15x at 1.5x sparsity and batch 4; up to 59x at 64x),
// so no selected-row floor is needed for this geometry. The sparsity gate
// sits at 2, the smallest integer whose whole range was measured as a win
// (1.0-1.5x won too, but was measured only at short contexts).
// For the DSA/MLA shape (one KV head, so batch 1 is a single-request launch)
// the fused path also won everywhere measured: batch 1, 2, 4 and 8, 2048
// selected tokens out of 3072 to 131072 (docs/PERFORMANCE.md), so the
// single-request floor is 0 as well. docs/PERFORMANCE.md has the tables.
DispatchConfig DispatchConfig::defaults() {
  DispatchConfig config;
  config.enabled = true;
  config.min_kv_tokens = 0;
  config.min_kv_tokens_per_request = 0;
  config.min_sparsity = 2;
  return config;
}

bool parse_enable_switch(const char* value) {
  if (value == nullptr) return true;
  const std::string s = trimmed_lower(value);
  return !(s == "0" || s == "false" || s == "off" || s == "no");
}

bool parse_debug_switch(const char* value) {
  if (value == nullptr) return false;
  const std::string s = trimmed_lower(value);
  return s == "1" || s == "true" || s == "on" || s == "yes";
}

int64_t parse_count(const char* value, int64_t fallback) {
  if (value == nullptr) return fallback;
  const std::string s = trimmed_lower(value);
  if (s.empty() || s.size() > 18) return fallback;
  if (!std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) return fallback;
  return std::stoll(s);
}

DispatchConfig DispatchConfig::from_environment() {
  DispatchConfig config = defaults();
  config.enabled = parse_enable_switch(std::getenv("SPARSEPAGE_SPARSE_DECODE"));
  config.min_kv_tokens = parse_count(std::getenv("SPARSEPAGE_MIN_KV_TOKENS"), config.min_kv_tokens);
  config.min_kv_tokens_per_request =
      parse_count(std::getenv("SPARSEPAGE_MIN_KV_TOKENS_PER_REQUEST"), config.min_kv_tokens_per_request);
  config.min_sparsity = parse_count(std::getenv("SPARSEPAGE_MIN_SPARSITY"), config.min_sparsity);
  return config;
}

const DispatchConfig& process_dispatch_config() {
  static const DispatchConfig config = DispatchConfig::from_environment();
  return config;
}

SparseDecodeOutcome decide_sparse_decode(const DispatchInput& in, const DispatchConfig& config) {
  std::ostringstream why;
  if (!config.enabled) {
    return decline(OutcomeKind::kKillSwitch, in, "SPARSEPAGE_SPARSE_DECODE pins the dense path");
  }
  if (!in.device_available) {
    return decline(OutcomeKind::kNoDevice, in, "no GPU for the fused kernel");
  }
  if (!in.raw_cache) {
    return decline(OutcomeKind::kNonRawCache, in,
                   "the cache does not expose raw fp16/bf16 K/V rows (quantized or pool-backed)");
  }
  if (!in.head_dims_supported) {
    return decline(OutcomeKind::kUnsupportedHeadDim, in, "no fused kernel is built for these head dims");
  }
  if (!in.arch_problem.empty()) return decline(OutcomeKind::kUnsupportedArch, in, in.arch_problem);
  if (!in.layout_supported) {
    // The launchers' own reason when the caller has it (an fp8 cache at a
    // shape without an fp8 kernel, say), else the general requirement.
    return decline(
        OutcomeKind::kUnsupportedLayout, in,
        !in.layout_problem.empty()
            ? "the fused kernel cannot read this layout: " + in.layout_problem
            : "the fused kernel needs f16/bf16 rows, 16-byte aligned bases and row strides in 16-byte pieces");
  }
  const int64_t requests = std::max<int64_t>(in.num_requests, 1);
  const int64_t per_request = in.selected_rows / requests;
  // Compared by division: config values come from the environment and a
  // product could overflow.
  if (config.min_sparsity > 0 && per_request > 0 && in.live_len / config.min_sparsity < per_request) {
    why << "live window of " << in.live_len << " tokens is less than " << config.min_sparsity << "x the " << per_request
        << " selected rows per request (minimum sparsity " << config.min_sparsity << ")";
    return decline(OutcomeKind::kBelowSparsity, in, why.str());
  }
  // The batched floor is per request, times the folded request count
  // (saturating: a huge floor from the environment must not overflow).
  // A negative floor (DispatchConfig is a plain struct) means no floor; it
  // must not reach the product, where it overflowed (found by the fuzzer).
  const int64_t max = std::numeric_limits<int64_t>::max();
  const int64_t per_request_floor = std::max<int64_t>(config.min_kv_tokens_per_request, 0);
  const int64_t floor = in.num_requests <= 1                 ? config.min_kv_tokens
                        : per_request_floor > max / requests ? max
                                                             : per_request_floor * requests;
  if (in.selected_rows < floor) {
    why << in.selected_rows << " selected rows across " << in.num_requests << " request(s) is below the " << floor
        << "-row dispatch floor";
    return decline(OutcomeKind::kBelowFloor, in, why.str());
  }
  SparseDecodeOutcome out;
  out.kind = OutcomeKind::kFused;
  out.requests = in.num_requests;
  out.selected_rows = in.selected_rows;
  out.chunks = in.chunks;
  out.merge = in.merge;
  return out;
}

DispatchStats dispatch_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex());
  return stats_slot();
}

void reset_dispatch_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex());
  stats_slot() = DispatchStats{};
  announced().fill(false);
}

bool record_outcome(const SparseDecodeOutcome& outcome) {
  // The kind indexes the per-kind counters: a value outside the enum would
  // write outside them.
  if (static_cast<int32_t>(outcome.kind) < 0 || outcome.kind >= OutcomeKind::kCount) {
    throw Error("record_outcome: outcome kind " + std::to_string(static_cast<int32_t>(outcome.kind)) +
                " is not an OutcomeKind");
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(stats_mutex());
    DispatchStats& stats = stats_slot();
    const auto kind = static_cast<size_t>(outcome.kind);
    ++stats.by_kind[kind];
    if (outcome.fused()) {
      ++stats.fused;
      stats.fused_rows += outcome.selected_rows;
    } else {
      ++stats.fallbacks;
    }
    first = !announced()[kind];
    announced()[kind] = true;
  }
  if (first) log_message(LogLevel::kInfo, "sparse paged decode: " + outcome.describe());
  return first;
}

}  // namespace sparsepage
