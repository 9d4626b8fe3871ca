// Concurrent use of the CPU backend: several threads each running their own
// decoders over shared read-only inputs, while the backend itself runs its
// work items on a thread pool (src/cpu/parallel.h). Results must equal the
// single-threaded ones bit for bit, and the process-wide stats and
// once-per-kind announcements must count every call exactly once.
// .ci/run runs these under ThreadSanitizer.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sparsepage/dispatch.h"
#include "sparsepage/log.h"
#include "sparsepage/sparse_decode.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

constexpr int kThreads = 4;
constexpr int kCallsPerThread = 6;

struct SharedInputs {
  int32_t batch = 2, kv_heads = 2, group = 3, dim = 16;
  int64_t live = 700, cap = 768;
  std::vector<uint8_t> k, v, q;
  SparseSelection selection;
  explicit SharedInputs(std::mt19937_64& rng) {
    k = testing::random_values(DType::kBF16, size_t(batch) * kv_heads * cap * dim, rng);
    v = testing::random_values(DType::kBF16, size_t(batch) * kv_heads * cap * dim, rng);
    q = testing::random_values(DType::kBF16, size_t(batch) * kv_heads * group * dim, rng);
    std::vector<std::vector<int32_t>> rows(size_t(batch) * kv_heads);
    std::uniform_int_distribution<int32_t> pos(0, static_cast<int32_t>(live - 1));
    for (auto& r : rows) {
      for (int i = 0; i < 150; ++i) r.push_back(pos(rng));
    }
    selection = make_selection(Device::kCpu, rows);
  }
  SparseAttentionInputs inputs(void* o, float* lse) const {
    SparseAttentionInputs in;
    in.dtype = DType::kBF16;
    in.batch = batch;
    in.num_qo_heads = kv_heads * group;
    in.num_kv_heads = kv_heads;
    in.live_len = live;
    in.k = RowView::dense(k.data(), kv_heads, cap, dim);
    in.v = RowView::dense(v.data(), kv_heads, cap, dim);
    in.q = q.data();
    in.scale = 0.25f;
    in.o = o;
    in.lse = lse;
    return in;
  }
  size_t out_elems() const { return size_t(batch) * kv_heads * group * dim; }
  size_t heads() const { return size_t(batch) * kv_heads * group; }
};

DispatchConfig fused_config() {
  DispatchConfig config;
  config.min_sparsity = 0;
  return config;
}

TEST(ConcurrentUse, IndependentDecodersAndMaskPathsOnSharedInputs) {
  std::mt19937_64 rng(77);
  const SharedInputs shared(rng);
  // Single-threaded answers first.
  std::vector<uint16_t> fused_ref(shared.out_elems()), mask_ref(shared.out_elems());
  std::vector<float> fused_lse_ref(shared.heads()), mask_lse_ref(shared.heads());
  {
    SparseDecoder decoder(Device::kCpu, fused_config());
    ASSERT_TRUE(decoder.try_fused(shared.inputs(fused_ref.data(), fused_lse_ref.data()), shared.selection).fused());
    MaskPath mask(Device::kCpu);
    const auto in = shared.inputs(mask_ref.data(), mask_lse_ref.data());
    mask.prepare(in, shared.selection);
    mask.run(in, shared.selection);
  }
  reset_dispatch_stats();
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&shared, &mismatches, &fused_ref, &mask_ref, &fused_lse_ref, &mask_lse_ref] {
      SparseDecoder decoder(Device::kCpu, fused_config());
      MaskPath mask(Device::kCpu);
      std::vector<uint16_t> o(shared.out_elems());
      std::vector<float> lse(shared.heads());
      for (int call = 0; call < kCallsPerThread; ++call) {
        const auto in = shared.inputs(o.data(), lse.data());
        decoder.try_fused(in, shared.selection);
        if (o != fused_ref || std::memcmp(lse.data(), fused_lse_ref.data(), lse.size() * 4) != 0) ++mismatches;
        if (call == 0) mask.prepare(in, shared.selection);
        mask.run(in, shared.selection);
        if (o != mask_ref || std::memcmp(lse.data(), mask_lse_ref.data(), lse.size() * 4) != 0) ++mismatches;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
  const DispatchStats stats = dispatch_stats();
  EXPECT_EQ(stats.fused, kThreads * kCallsPerThread);
  EXPECT_EQ(stats.fused_rows, int64_t{kThreads} * kCallsPerThread * shared.selection.total());
}

// Outcomes recorded from many threads: every one counted, each kind
// announced exactly once. (The sink is called unlocked, as log.h allows a
// sink to log in turn, so a sink guards its own state.)
TEST(ConcurrentUse, OutcomesAndLogSinkFromManyThreads) {
  reset_dispatch_stats();
  std::mutex lines_mutex;
  std::vector<std::string> lines;
  set_log_sink([&lines, &lines_mutex](LogLevel, const std::string& message) {
    std::lock_guard<std::mutex> lock(lines_mutex);
    lines.push_back(message);
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        SparseDecodeOutcome outcome;
        outcome.kind = (i + t) % 2 == 0 ? OutcomeKind::kFused : OutcomeKind::kBelowFloor;
        outcome.requests = 1;
        outcome.selected_rows = 1;
        outcome.reason = "test";
        record_outcome(outcome);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  set_log_sink(nullptr);
  const DispatchStats stats = dispatch_stats();
  EXPECT_EQ(stats.fused + stats.fallbacks, kThreads * 200);
  EXPECT_EQ(stats.fused, kThreads * 100);
  EXPECT_EQ(lines.size(), 2u) << "one announcement per kind";
}

}  // namespace
}  // namespace sparsepage
