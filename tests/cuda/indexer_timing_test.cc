// Timing of the two CUDA indexers, replayed from CUDA graphs (median of
// several replays, CUDA events, after a warm-up). Runs only when
// SPARSEPAGE_INDEXER_TIMING is set, so the regular suite stays fast:
//   SPARSEPAGE_INDEXER_TIMING=1 sparsepage_cuda_tests --gtest_filter='IndexerTiming.*'
// "warm" replays one cache N times (its index keys may sit in the 60 MB L2);
// "cold" rotates among enough distinct caches that the keys read in one
// replay exceed twice the L2, as a model's layers would.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_hooks.h"
#include "cuda/cuda_test_util.h"
#include "models/block_sparse_kernels.h"
#include "models/dsa_kernels.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"

namespace sparsepage {
namespace {

constexpr size_t kL2Bytes = size_t{60} << 20;

bool timing_enabled() { return std::getenv("SPARSEPAGE_INDEXER_TIMING") != nullptr; }

// SPARSEPAGE_INDEXER_TIMING_SHAPES="1x32768,32x131072,32x32768x4" restricts
// the shapes timed (e.g. under a profiler): batch x context, with x q_len for
// a multi-token step; unset, every shape runs.
bool shape_selected(int32_t batch, int64_t ctx, int32_t q_len = 1) {
  const char* env = std::getenv("SPARSEPAGE_INDEXER_TIMING_SHAPES");
  if (env == nullptr) return true;
  const std::string list = std::string(",") + env + ",";
  std::string key = std::to_string(batch) + "x" + std::to_string(ctx);
  if (q_len > 1) key += "x" + std::to_string(q_len);
  return list.find("," + key + ",") != std::string::npos;
}

// Fills `bytes` of device memory with random bf16 values in [-1, 1] by
// repeating one random 16 MB pattern.
void fill_random_bf16(void* dst, size_t bytes, uint64_t seed) {
  static Buffer pattern;
  constexpr size_t kPattern = size_t{16} << 20;
  if (pattern.bytes() == 0) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::vector<float> f(kPattern / 2);
    for (float& x : f) x = unit(rng);
    std::vector<uint8_t> b(kPattern);
    from_float(DType::kBF16, f.data(), b.data(), f.size());
    pattern = upload(Device::kCuda, b);
  }
  for (size_t off = 0; off < bytes; off += kPattern) {
    testing::cuda_ok(cudaMemcpy(static_cast<char*>(dst) + off, pattern.data(), std::min(kPattern, bytes - off),
                                cudaMemcpyDeviceToDevice),
                     "fill");
  }
}

// Median microseconds per launch of `launch(i)` for i in [0, n), captured
// once into a graph of n launches and replayed `reps` times.
template <typename Launch>
double median_us_per_launch(int n, Launch launch, int reps = 7) {
  testing::StreamGraph graph;
  cudaStream_t stream = graph.stream();
  const auto all = [&](cudaStream_t s) {
    for (int i = 0; i < n; ++i) launch(i, s);
  };
  all(stream);  // warm-up, outside the capture
  graph.capture(all);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  graph.launch();  // warm replay
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(start, stream);
    graph.launch();
    cudaEventRecord(stop, stream);
    testing::cuda_ok(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    us.push_back(1000.0 * ms / n);
  }
  std::sort(us.begin(), us.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return us[us.size() / 2];
}

// Device-to-device copy bandwidth (read + write bytes per second) as the
// run's reference for the read limit.
double copy_gbps() {
  const size_t bytes = size_t{1} << 30;
  Buffer a(Device::kCuda, bytes), b(Device::kCuda, bytes);
  const double us = median_us_per_launch(4, [&](int, cudaStream_t s) {
    testing::cuda_ok(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, s), "copy");
  });
  return 2.0 * double(bytes) / us / 1e3;
}

TEST(IndexerTiming, BlockIndexer) {
  SKIP_WITHOUT_CUDA();
  if (!timing_enabled()) GTEST_SKIP() << "set SPARSEPAGE_INDEXER_TIMING to time the indexers";
  std::printf("device copy bandwidth (read + write): %.0f GB/s\n", copy_gbps());
  const int32_t heads = 4, dim = 128, block = 128, topk = 16;
  for (const auto& [batch, ctx] :
       std::vector<std::pair<int32_t, int64_t>>{{1, 32768}, {8, 32768}, {32, 32768}, {1, 131072}, {32, 131072}}) {
    if (!shape_selected(batch, ctx)) continue;
    const size_t index_bytes = size_t(batch) * size_t(ctx) * dim * 2;
    const int copies = int(std::clamp<size_t>(2 * kL2Bytes / index_bytes + 1, 1, 16));
    const size_t alloc_bytes = size_t(batch) * (heads + 1) * size_t(ctx) * dim * 2;
    std::vector<Buffer> k;
    for (int c = 0; c < copies; ++c) {
      k.emplace_back(Device::kCuda, alloc_bytes);
      fill_random_bf16(k.back().data(), alloc_bytes, 7);
    }
    Buffer q(Device::kCuda, size_t(batch) * heads * dim * 2);
    fill_random_bf16(q.data(), q.bytes(), 8);
    const Buffer lens = upload(Device::kCuda, std::vector<int32_t>(size_t(batch), int32_t(ctx)));
    Buffer ids(Device::kCuda, size_t(batch) * heads * (topk + 1) * 4), seq(Device::kCuda, size_t(batch) * heads * 4);
    Buffer ws(Device::kCuda, detail::block_indexer_workspace_bytes(batch, heads, ctx, block));
    detail::BlockIndexerArgs a{};
    a.dtype = DType::kBF16;
    a.index_q = q.data();
    a.batch = batch;
    a.num_kv_heads = heads;
    a.head_dim = dim;
    a.capacity = ctx;
    a.kv_lens = lens.as<int32_t>();
    a.max_kv_len = ctx;
    a.block_size = block;
    a.topk = topk;
    a.local_blocks = 1;
    a.width = topk + 1;
    a.block_ids = ids.as<int32_t>();
    a.seq_lens = seq.as<int32_t>();
    a.workspace = ws.data();
    a.workspace_bytes = ws.bytes();
    const auto run = [&](int i, cudaStream_t s) {
      detail::BlockIndexerArgs x = a;
      x.k_alloc = k[size_t(i % copies)].data();
      detail::block_indexer_cuda(x, s);
    };
    const double warm = median_us_per_launch(16, [&](int, cudaStream_t s) { run(0, s); });
    const double cold = median_us_per_launch(std::max(16, copies), run);
    std::printf(
        "TIMING block-indexer batch %d context %lld: warm %.1f us, cold %.1f us (%d caches), index keys %.1f MB "
        "-> %.0f GB/s cold\n",
        batch, static_cast<long long>(ctx), warm, cold, copies, double(index_bytes) / 1e6,
        double(index_bytes) / cold / 1e3);
    const auto got = download<int32_t>(Device::kCuda, seq.data(), 1);
    EXPECT_EQ(got[0], topk * block + block) << "selected tokens of request 0";
  }
}

// A DSA indexer call's buffers for `batch` sequences of q_len tokens at
// context ctx (every length ctx): random bf16 index queries, uniform [0, 1)
// weights, the outputs and the workspace; `args` points at them, the keys
// left to the caller.
struct DsaIndexerRun {
  int32_t rows;  // (sequence, token) rows
  Buffer q, w, lens, pos, counts, ws;
  DsaIndexerArgs args;

  DsaIndexerRun(const DsaConfig& c, int32_t batch, int64_t ctx, int32_t q_len)
      : rows(batch * q_len),
        q(Device::kCuda, size_t(rows) * c.index_heads * c.index_head_dim * 2),
        lens(upload(Device::kCuda, std::vector<int32_t>(size_t(batch), int32_t(ctx)))),
        pos(Device::kCuda, size_t(rows) * c.index_topk * 4),
        counts(Device::kCuda, size_t(rows) * 4),
        ws(Device::kCuda, dsa_indexer_workspace_bytes(c, rows, ctx)) {
    fill_random_bf16(q.data(), q.bytes(), 10);
    std::vector<float> wv(size_t(rows) * c.index_heads);
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (float& x : wv) x = unit(rng);
    w = upload(Device::kCuda, wv);
    args.kv_lens = lens.as<int32_t>();
    args.max_kv_len = ctx;
    args.q_index = q.data();
    args.weights = w.as<float>();
    args.workspace = ws.data();
    args.workspace_bytes = ws.bytes();
    args.positions = pos.as<int32_t>();
    args.counts = counts.as<int32_t>();
    args.q_len = q_len;
  }
};

TEST(IndexerTiming, DsaIndexer) {
  SKIP_WITHOUT_CUDA();
  if (!timing_enabled()) GTEST_SKIP() << "set SPARSEPAGE_INDEXER_TIMING to time the indexers";
  DsaConfig c;  // 64 index heads x 128, top-2048, latent 512
  // (sequences, context, q_len): one-token steps, and multi-token steps
  // (speculative verification, MTP) whose q_len rows per sequence each keep
  // their own top-k over their own causal window.
  struct Shape {
    int32_t batch;
    int64_t ctx;
    int32_t q_len;
  };
  for (const auto& [batch, ctx, q_len] : std::vector<Shape>{
           {1, 32768, 1}, {8, 32768, 1}, {32, 32768, 1}, {1, 131072, 1}, {32, 32768, 2}, {32, 32768, 4}}) {
    if (!shape_selected(batch, ctx, q_len)) continue;
    const size_t row = size_t(c.latent_dim + c.index_head_dim) * 2;
    const size_t index_bytes = size_t(batch) * size_t(ctx) * c.index_head_dim * 2;
    const int copies = int(std::clamp<size_t>(2 * kL2Bytes / index_bytes + 1, 1, 16));
    std::vector<Buffer> k;
    for (int i = 0; i < copies; ++i) {
      k.emplace_back(Device::kCuda, size_t(batch) * size_t(ctx) * row);
      fill_random_bf16(k.back().data(), k.back().bytes(), 9);
    }
    DsaIndexerRun r(c, batch, ctx, q_len);
    const int32_t rows = r.rows;
    DsaIndexerArgs& a = r.args;
    a.capacity = ctx;
    const auto run = [&](int i, cudaStream_t s) {
      DsaIndexerArgs x = a;
      x.k_cache = k[size_t(i % copies)].data();
      dsa_select_tokens_cuda(c, batch, x, s);
    };
    const double warm = median_us_per_launch(16, [&](int, cudaStream_t s) { run(0, s); });
    const double cold = median_us_per_launch(std::max(16, copies), run);
    std::printf("TIMING dsa-indexer batch %d context %lld q_len %d: warm %.1f us, cold %.1f us (%d caches), index keys "
                "%.1f MB -> %.0f GB/s cold\n",
                batch, static_cast<long long>(ctx), q_len, warm, cold, copies, double(index_bytes) / 1e6,
                double(index_bytes) / cold / 1e3);
    const auto n = download<int32_t>(Device::kCuda, r.counts.data(), size_t(rows));
    const auto kept = download<int32_t>(Device::kCuda, r.pos.data(), size_t(rows) * c.index_topk);
    for (int32_t b = 0; b < rows; ++b) {
      EXPECT_EQ(n[size_t(b)], c.index_topk);
      // Each row's positions: increasing, inside its window.
      const int32_t* got = &kept[size_t(b) * c.index_topk];
      EXPECT_TRUE(got[0] >= 0 && got[c.index_topk - 1] < ctx - (q_len - 1 - b % q_len)) << "row " << b;
      for (int32_t i = 1; i < c.index_topk; ++i) {
        if (got[i - 1] >= got[i]) {
          ADD_FAILURE() << "row " << b << ": positions not increasing at entry " << i;
          break;
        }
      }
    }
  }
}

// The indexer over an engine's paged pool: vLLM's FP8 blocks (132 bytes
// per position) and bf16 blocks (256), block size 64, each sequence's blocks
// drawn from a shuffled pool, against the bytes of keys read. The FP8
// pool's keys are real quantized keys (a 65536-key pattern written by the
// write op, repeated), so the scores and the top-k work as in a model.
//   SPARSEPAGE_INDEXER_TIMING=1 sparsepage_cuda_tests --gtest_filter='IndexerTiming.DsaIndexerPaged'
TEST(IndexerTiming, DsaIndexerPaged) {
  SKIP_WITHOUT_CUDA();
  if (!timing_enabled()) GTEST_SKIP() << "set SPARSEPAGE_INDEXER_TIMING to time the indexers";
  const double copy = copy_gbps();
  std::printf("device copy bandwidth (read + write): %.0f GB/s\n", copy);
  DsaConfig c;  // 64 index heads x 128, top-2048
  constexpr int32_t kBlock = 64;
  constexpr int64_t kPatternKeys = 65536;
  struct Shape {
    int32_t batch;
    int64_t ctx;
    int32_t q_len;
  };
  for (const IndexKeyFormat format : {IndexKeyFormat::kE4m3, IndexKeyFormat::kNative}) {
    const int64_t token_bytes = format == IndexKeyFormat::kE4m3 ? IndexKeyFp8::kTokenBytes : 2 * c.index_head_dim;
    // One pattern of valid blocks, written once and repeated over every pool.
    Buffer pattern(Device::kCuda, size_t(kPatternKeys * token_bytes));
    {
      Buffer src(Device::kCuda, size_t(kPatternKeys) * c.index_head_dim * 2);
      fill_random_bf16(src.data(), src.bytes(), 12);
      std::vector<int64_t> slots(static_cast<size_t>(kPatternKeys));
      std::iota(slots.begin(), slots.end(), 0);
      const Buffer dslots = upload(Device::kCuda, slots);
      PagedIndexKeys p;
      p.format = format;
      p.pool = pattern.data();
      p.num_blocks = kPatternKeys / kBlock;
      p.block_size = kBlock;
      write_index_keys_cuda(p, c.index_head_dim, DType::kBF16, src.data(), c.index_head_dim, dslots.as<int64_t>(),
                            kPatternKeys);
      testing::cuda_ok(cudaDeviceSynchronize(), "pattern");
    }
    for (const auto& [batch, ctx, q_len] : std::vector<Shape>{{1, 32768, 1},
                                                              {8, 32768, 1},
                                                              {32, 32768, 1},
                                                              {1, 131072, 1},
                                                              {8, 131072, 1},
                                                              {32, 131072, 1},
                                                              {32, 32768, 2}}) {
      if (!shape_selected(batch, ctx, q_len)) continue;
      DsaIndexerRun r(c, batch, ctx, q_len);
      const int32_t rows = r.rows;
      const int64_t blocks_per_seq = ctx / kBlock;
      const int64_t num_blocks = int64_t{batch} * blocks_per_seq;
      const size_t pool_bytes = size_t(num_blocks * kBlock * token_bytes);
      const size_t key_bytes = size_t(batch) * size_t(ctx) * size_t(token_bytes);
      const int copies = int(std::clamp<size_t>(2 * kL2Bytes / key_bytes + 1, 1, 16));
      std::vector<Buffer> pools;
      for (int i = 0; i < copies; ++i) {
        pools.emplace_back(Device::kCuda, pool_bytes);
        for (size_t off = 0; off < pool_bytes; off += pattern.bytes()) {
          testing::cuda_ok(cudaMemcpy(static_cast<char*>(pools.back().data()) + off, pattern.data(),
                                      std::min(pattern.bytes(), pool_bytes - off), cudaMemcpyDeviceToDevice),
                           "pool");
        }
      }
      std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), std::mt19937_64(13));
      const Buffer table = upload(Device::kCuda, ids);  // [batch, blocks_per_seq]
      Buffer err(Device::kCuda, 4);
      fill_bytes(err.data(), Device::kCuda, 0, 4);
      DsaIndexerArgs& a = r.args;
      a.error = err.as<int32_t>();
      a.key_layout = IndexKeyLayout::kPaged;
      a.paged.format = format;
      a.paged.num_blocks = num_blocks;
      a.paged.block_size = kBlock;
      a.paged.block_table = table.as<int32_t>();
      a.paged.block_table_stride = blocks_per_seq;
      a.paged.max_blocks = static_cast<int32_t>(blocks_per_seq);
      const auto run = [&](int i, cudaStream_t s) {
        DsaIndexerArgs x = a;
        x.paged.pool = pools[size_t(i % copies)].data();
        dsa_select_tokens_cuda(c, batch, x, s);
      };
      const double warm = median_us_per_launch(16, [&](int, cudaStream_t s) { run(0, s); });
      const double cold = median_us_per_launch(std::max(16, copies), run);
      std::printf("TIMING dsa-indexer paged %s batch %d context %lld q_len %d: warm %.1f us, cold %.1f us (%d pools), "
                  "keys %.1f MB -> %.0f GB/s cold (%.0f%% of the copy bandwidth's read half)\n",
                  format == IndexKeyFormat::kE4m3 ? "fp8" : "bf16", batch, static_cast<long long>(ctx), q_len, warm,
                  cold, copies, double(key_bytes) / 1e6, double(key_bytes) / cold / 1e3,
                  100.0 * double(key_bytes) / cold / 1e3 / (copy / 2));
      EXPECT_EQ(download<int32_t>(Device::kCuda, err.data(), 1)[0], 0);
      const auto n = download<int32_t>(Device::kCuda, r.counts.data(), size_t(rows));
      for (int32_t b = 0; b < rows; ++b) EXPECT_EQ(n[size_t(b)], c.index_topk) << "row " << b;
    }
  }
}

}  // namespace
}  // namespace sparsepage
