#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/log.h"

namespace sparsepage {
namespace {

TEST(Switches, KillSwitchParsing) {
  for (const char* off : {"0", "false", "off", "no", "OFF", " No ", "False"}) {
    EXPECT_FALSE(parse_enable_switch(off)) << off;
  }
  for (const char* on : {"1", "true", "on", "yes", "flase", "of", "", "2"}) {
    EXPECT_TRUE(parse_enable_switch(on)) << "a typo must keep the fused path: '" << on << "'";
  }
  EXPECT_TRUE(parse_enable_switch(nullptr));
}

TEST(Switches, CountsAndDebugSwitches) {
  EXPECT_EQ(parse_count("4", 2), 4);
  EXPECT_EQ(parse_count(" 0 ", 2), 0);
  EXPECT_EQ(parse_count("2.5", 2), 2) << "a non-integer value falls back to the default";
  EXPECT_EQ(parse_count("-3", 2), 2);
  EXPECT_EQ(parse_count("abc", 7), 7);
  EXPECT_EQ(parse_count(nullptr, 7), 7);
  EXPECT_EQ(parse_count("", 7), 7);
  for (const char* on : {"1", "true", "on", "yes", "YES"}) EXPECT_TRUE(parse_debug_switch(on)) << on;
  for (const char* off : {"0", "", "y", "enable"}) EXPECT_FALSE(parse_debug_switch(off)) << off;
  EXPECT_FALSE(parse_debug_switch(nullptr));
}

DispatchInput sparse_input() {
  DispatchInput in;
  in.num_requests = 4;
  in.selected_rows = 4 * 2048;
  in.live_len = 32768;
  in.chunks = 256;
  in.merge = true;
  return in;
}

TEST(Policy, DefaultsAreTheMeasuredOnes) {
  const DispatchConfig d = DispatchConfig::defaults();
  EXPECT_TRUE(d.enabled);
  EXPECT_EQ(d.min_sparsity, 2);
  EXPECT_EQ(d.min_kv_tokens, 0);
  EXPECT_EQ(d.min_kv_tokens_per_request, 0);
}

TEST(Policy, FusesWhenEverythingHolds) {
  const auto out = decide_sparse_decode(sparse_input(), DispatchConfig::defaults());
  ASSERT_TRUE(out.fused());
  EXPECT_EQ(out.describe(), "fused sparse launch (4 request(s) x 2048 selected rows, 256 chunks, merge on)");
  // A launch fills in the kernel it ran, and the line names it.
  SparseDecodeOutcome launched = out;
  launched.kernel = "16-row tiles, mma.sync";
  EXPECT_EQ(launched.describe(),
            "fused sparse launch (4 request(s) x 2048 selected rows, 256 chunks, merge on; 16-row tiles, mma.sync)");
}

TEST(Policy, EachDeclineNamesItsNumbers) {
  const DispatchConfig config = DispatchConfig::defaults();
  struct Case {
    OutcomeKind kind;
    void (*mutate)(DispatchInput&, DispatchConfig&);
    const char* words;
  };
  const Case cases[] = {
      {OutcomeKind::kKillSwitch, [](DispatchInput&, DispatchConfig& c) { c.enabled = false; },
       "SPARSEPAGE_SPARSE_DECODE"},
      {OutcomeKind::kNoDevice, [](DispatchInput& i, DispatchConfig&) { i.device_available = false; }, "no GPU"},
      {OutcomeKind::kNonRawCache, [](DispatchInput& i, DispatchConfig&) { i.raw_cache = false; }, "raw fp16/bf16"},
      {OutcomeKind::kUnsupportedHeadDim, [](DispatchInput& i, DispatchConfig&) { i.head_dims_supported = false; },
       "head dims"},
      {OutcomeKind::kUnsupportedArch,
       [](DispatchInput& i, DispatchConfig&) { i.arch_problem = "no fused kernel for sm_80 at the MLA shape"; },
       "no fused kernel for sm_80 at the MLA shape"},
      {OutcomeKind::kBelowSparsity, [](DispatchInput& i, DispatchConfig&) { i.live_len = 3000; },
       "live window of 3000 tokens is less than 2x the 2048 selected rows per request"},
      {OutcomeKind::kBelowFloor,
       [](DispatchInput& i, DispatchConfig& c) {
         i.selected_rows = 128;
         c.min_kv_tokens_per_request = 512;
       },
       "128 selected rows across 4 request(s) is below the 2048-row dispatch floor"},
      {OutcomeKind::kBelowFloor,
       [](DispatchInput& i, DispatchConfig& c) {
         i.num_requests = 1;
         i.selected_rows = 1000;
         c.min_kv_tokens = 1500;
       },
       "1000 selected rows across 1 request(s) is below the 1500-row dispatch floor"},
  };
  for (const Case& c : cases) {
    DispatchInput in = sparse_input();
    DispatchConfig cfg = config;
    c.mutate(in, cfg);
    const auto out = decide_sparse_decode(in, cfg);
    EXPECT_EQ(out.kind, c.kind) << c.words;
    EXPECT_NE(out.describe().find(c.words), std::string::npos) << out.describe();
    EXPECT_EQ(out.describe().rfind("fallback: ", 0), 0u) << out.describe();
  }
}

TEST(Policy, SparsityGateZeroDisablesIt) {
  DispatchInput in = sparse_input();
  in.live_len = 2048;  // dense selection
  DispatchConfig cfg = DispatchConfig::defaults();
  EXPECT_EQ(decide_sparse_decode(in, cfg).kind, OutcomeKind::kBelowSparsity);
  cfg.min_sparsity = 0;
  EXPECT_TRUE(decide_sparse_decode(in, cfg).fused());
}

// Fuzzer finding (UBSan): a negative per-request floor times the request
// count overflowed int64; a negative floor now means no floor.
TEST(Policy, NegativeFloorsMeanNoFloorWithoutOverflow) {
  DispatchInput in;
  in.num_requests = 3;
  in.selected_rows = 3000;
  in.live_len = 100000;
  DispatchConfig config = DispatchConfig::defaults();
  config.min_kv_tokens_per_request = -(int64_t{1} << 62);  // -3 * 2^62 wrapped to +2^62
  EXPECT_TRUE(decide_sparse_decode(in, config).fused()) << decide_sparse_decode(in, config).describe();
  config.min_kv_tokens_per_request = std::numeric_limits<int64_t>::min();
  in.num_requests = std::numeric_limits<int64_t>::max();
  EXPECT_NO_THROW(decide_sparse_decode(in, config));
}

TEST(Policy, MlaBatchOneIsASingleRequestLaunch) {
  DispatchInput in;
  in.num_requests = 1;  // Hkv == 1 at batch 1
  in.selected_rows = 2048;
  in.live_len = 65536;
  DispatchConfig cfg = DispatchConfig::defaults();
  cfg.min_kv_tokens = 4096;
  cfg.min_kv_tokens_per_request = 1;
  EXPECT_EQ(decide_sparse_decode(in, cfg).kind, OutcomeKind::kBelowFloor) << "the single-request floor applies";
  in.num_requests = 2;
  in.selected_rows = 4096;
  EXPECT_TRUE(decide_sparse_decode(in, cfg).fused()) << "batch 2 uses the per-request floor";
}

TEST(Reporting, OncePerKindWithStatsAndSink) {
  reset_dispatch_stats();
  std::vector<std::string> lines;
  set_log_sink([&](LogLevel, const std::string& m) { lines.push_back(m); });
  DispatchConfig cfg = DispatchConfig::defaults();
  cfg.min_kv_tokens_per_request = 64;
  DispatchInput warmup = sparse_input();
  warmup.selected_rows = 4;
  warmup.live_len = 1 << 20;
  const auto floor = decide_sparse_decode(warmup, cfg);
  const auto fused = decide_sparse_decode(sparse_input(), cfg);
  DispatchInput trimmed = sparse_input();
  trimmed.raw_cache = false;
  const auto non_raw = decide_sparse_decode(trimmed, cfg);
  EXPECT_TRUE(record_outcome(floor));
  EXPECT_FALSE(record_outcome(floor)) << "same kind announced once";
  EXPECT_TRUE(record_outcome(fused));
  EXPECT_FALSE(record_outcome(fused));
  EXPECT_TRUE(record_outcome(non_raw)) << "a warm-up decline must not hide a later decline of another kind";
  set_log_sink(nullptr);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0].rfind("sparse paged decode: fallback: ", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1], "sparse paged decode: " + fused.describe());
  const DispatchStats stats = dispatch_stats();
  EXPECT_EQ(stats.fused, 2);
  EXPECT_EQ(stats.fallbacks, 3);
  EXPECT_EQ(stats.by_kind[static_cast<int>(OutcomeKind::kBelowFloor)], 2);
  EXPECT_EQ(stats.fused_rows, 2 * 4 * 2048);
  reset_dispatch_stats();
  EXPECT_EQ(dispatch_stats().fused, 0);
}

}  // namespace
}  // namespace sparsepage

namespace sparsepage {
namespace {

// The one layout check the CUDA launchers throw and the policy declines
// with: it is host code, so it is tested here in any build.
TEST(CudaLayout, NamesTheFirstProblem) {
  alignas(16) static uint16_t buf[4096];
  const RowView k{buf, 128, 128, 0, 0};
  const RowView none{};
  EXPECT_EQ(cuda_layout_problem(DType::kBF16, buf, nullptr, k, k, none, buf), "");
  EXPECT_NE(cuda_layout_problem(DType::kF32, buf, nullptr, k, k, none, buf).find("dtype f32"), std::string::npos);
  EXPECT_NE(cuda_layout_problem(DType::kBF16, buf + 1, nullptr, k, k, none, buf).find("q must be 16-byte aligned"),
            std::string::npos);
  RowView padded = k;
  padded.head_stride = 1028;  // not whole 16-byte pieces
  EXPECT_NE(cuda_layout_problem(DType::kBF16, buf, nullptr, padded, k, none, buf).find("k.head_stride = 1028"),
            std::string::npos);
  const RowView wide_k{buf, 640, 512, 0, 0};
  const RowView wide_v{buf + 8, 640, 512, 0, 0};  // not K's own columns
  EXPECT_NE(cuda_layout_problem(DType::kBF16, buf, nullptr, wide_k, wide_v, none, buf).find("MLA latent"),
            std::string::npos);
  EXPECT_EQ(cuda_layout_problem(DType::kBF16, buf, nullptr, wide_k, wide_k, none, buf), "");
}

}  // namespace
}  // namespace sparsepage

namespace sparsepage {
namespace {

// Which GPUs a build runs on, judged from the architecture list CMake had
// (SPARSEPAGE_CUDA_ARCHS): pure host logic, so every case runs on the CPU.
TEST(Arch, TheMlaShapeNeedsSm90aCodeOnAnSm90) {
  EXPECT_EQ(cuda_arch_problem(90, 512, 512, 64, "90a"), "");
  EXPECT_EQ(cuda_arch_problem(80, 512, 512, 64, "80,90a"),
            "no fused kernel for sm_80 at the MLA shape (its wgmma kernel runs on sm_90 only)");
  EXPECT_NE(cuda_arch_problem(100, 512, 512, 64, "90a,100").find("sm_100 at the MLA shape"), std::string::npos);
  EXPECT_NE(cuda_arch_problem(90, 512, 512, 64, "80").find("no sm_90a code"), std::string::npos)
      << "PTX of sm_80 runs the mma.sync kernels on an sm_90, not the wgmma one";
}

TEST(Arch, TheMmaKernelsRunWhereTheBuildReaches) {
  EXPECT_EQ(cuda_arch_problem(90, 128, 128, 0, "90a"), "");
  EXPECT_EQ(cuda_arch_problem(80, 128, 128, 0, "90a"),
            "no fused kernel for sm_80 in this build (built for 90a; add it to SPARSEPAGE_CUDA_ARCHS)");
  EXPECT_EQ(cuda_arch_problem(86, 128, 128, 0, "80,90a"), "") << "sm_80 code runs on an sm_86";
  EXPECT_EQ(cuda_arch_problem(89, 128, 128, 0, "80-real"), "") << "same major version: the SASS runs";
  EXPECT_NE(cuda_arch_problem(90, 128, 128, 0, "80-real"), "") << "SASS of sm_80 does not run on sm_90";
  EXPECT_EQ(cuda_arch_problem(100, 128, 128, 0, "80,90a"), "") << "sm_80 PTX is compiled for an sm_100 at load";
  EXPECT_NE(cuda_arch_problem(100, 128, 128, 0, "90a"), "") << "sm_90a code runs on sm_90 only";
  EXPECT_EQ(cuda_arch_problem(100, 128, 128, 0, "90a,100"), "");
  EXPECT_NE(cuda_arch_problem(75, 128, 128, 0, "80").find("need sm_80 or newer"), std::string::npos);
  EXPECT_EQ(cuda_arch_problem(90, 128, 128, 0, ""), "this sparsepage build has no CUDA kernels");
}

TEST(Arch, TheBuildNamesItsArchitectures) {
  // Whatever the build, the answer for this build is the answer for its list.
  EXPECT_EQ(cuda_arch_problem(80, 512, 512, 64), cuda_arch_problem(80, 512, 512, 64, cuda_built_architectures()));
}

}  // namespace
}  // namespace sparsepage
