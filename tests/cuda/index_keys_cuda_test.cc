// Index-key sources on the GPU (sparsepage/index_keys.h) against their CPU
// twins: the write op and the query quantizer byte for byte; the indexer
// over dense rows and paged native and FP8 pools on exact problems (the
// same positions, ties included: support/index_keys_problem.h) and on real
// values (swaps only at the threshold), with ragged lengths, shuffled block
// tables, several block sizes and multi-token rows; queries quantized in the
// kernel against pre-quantized ones; poisoned unowned blocks; refused
// lengths and block ids; steps replayed from one captured graph while the
// lengths change; and a continuous batch's mixed lengths (released slots,
// windows that fit the top-k and scored ones) in one call. Skips without a
// GPU.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"
#include "support/index_keys_problem.h"

namespace sparsepage {
namespace {

using testing::IndexKeysProblem;
using testing::IndexKeysSpec;
using testing::IndexSelection;
using testing::make_index_keys_problem;

// One problem's inputs on the device, and the indexer over them.
struct DeviceProblem {
  const IndexKeysProblem& pb;
  Buffer storage, table, q, w, lens, workspace, positions, counts, error;

  explicit DeviceProblem(const IndexKeysProblem& problem)
      : pb(problem),
        storage(upload(Device::kCuda, problem.storage)),
        table(upload(Device::kCuda, problem.table.empty() ? std::vector<int32_t>{0} : problem.table)),
        q(upload(Device::kCuda, problem.q)),
        w(upload(Device::kCuda, problem.weights)),
        lens(upload(Device::kCuda, problem.spec.kv_lens)),
        workspace(Device::kCuda, dsa_indexer_workspace_bytes(problem.config, problem.rows(), problem.max_kv_len)),
        positions(Device::kCuda, size_t(problem.rows()) * size_t(problem.spec.topk) * 4),
        counts(Device::kCuda, size_t(problem.rows()) * 4),
        error(Device::kCuda, 4) {}

  DsaIndexerArgs args() {
    DsaIndexerArgs a = pb.args(storage.data(), table.as<int32_t>(), q.data(), w.as<float>(), lens.as<int32_t>(),
                               positions.as<int32_t>(), counts.as<int32_t>(), error.as<int32_t>());
    a.workspace = workspace.data();
    a.workspace_bytes = workspace.bytes();
    return a;
  }
  // Stale scratch and outputs must not matter.
  void poison() {
    fill_bytes(workspace.data(), Device::kCuda, 0x7F, workspace.bytes());
    fill_bytes(positions.data(), Device::kCuda, 0x55, positions.bytes());
    fill_bytes(counts.data(), Device::kCuda, 0x55, counts.bytes());
    fill_bytes(error.data(), Device::kCuda, 0, error.bytes());
  }
  IndexSelection read() const {
    IndexSelection s;
    s.positions = download<int32_t>(Device::kCuda, positions.data(), size_t(pb.rows()) * size_t(pb.spec.topk));
    s.counts = download<int32_t>(Device::kCuda, counts.data(), size_t(pb.rows()));
    s.error = download<int32_t>(Device::kCuda, error.data(), 1)[0];
    return s;
  }
  IndexSelection run(cudaStream_t stream = nullptr) {
    poison();
    dsa_select_tokens_cuda(pb.config, pb.sequences, args(), stream);
    testing::cuda_ok(cudaDeviceSynchronize(), "indexer");
    return read();
  }
};

IndexSelection run_gpu(const IndexKeysProblem& pb) { return DeviceProblem(pb).run(); }

// Waits for `stream` at most `seconds`. A kernel that never finishes cannot
// be stopped from the host, so this names the call and ends the process
// (the driver then tears the context down) instead of stalling the run.
void finish_or_abort(cudaStream_t stream, double seconds, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) testing::cuda_ok(e, what.c_str());
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds) {
      std::fprintf(stderr, "HANG: %s did not finish within %.0f s\n", what.c_str(), seconds);
      std::fflush(stderr);
      std::abort();
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::string describe(const IndexKeysSpec& s) {
  std::string lens;
  for (int32_t l : s.kv_lens) lens += std::to_string(l) + ",";
  return "layout " + std::to_string(int(s.layout)) + " format " + std::to_string(int(s.format)) + " q " +
         std::to_string(int(s.q_format)) + " heads " + std::to_string(s.heads) + " dim " + std::to_string(s.dim) +
         " topk " + std::to_string(s.topk) + " block " + std::to_string(s.block_size) + " q_len " +
         std::to_string(s.q_len) + " lens " + lens;
}

// ---- the write op and the query quantizer ---------------------------------------

TEST(IndexKeysWriteCuda, WritesTheCpuTwinsBytes) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(21);
  std::uniform_real_distribution<float> unit(-3.0f, 3.0f);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    for (const IndexKeyFormat format : {IndexKeyFormat::kE4m3, IndexKeyFormat::kNative}) {
      for (const IndexScaleFormat scale : {IndexScaleFormat::kUe8m0, IndexScaleFormat::kFp32}) {
        for (const int32_t block_size : {8, 64}) {
          PagedIndexKeys p;
          p.format = format;
          p.dtype = dtype;
          p.num_blocks = 6;
          p.block_size = block_size;
          const int64_t token = format == IndexKeyFormat::kE4m3 ? 132 : 256;
          p.block_stride_bytes = block_size * token + 32;
          const size_t bytes = size_t(p.num_blocks * p.block_stride_bytes);
          // 100 keys of varied magnitude (one all zero, one with a NaN, one with an
          // infinity), at distinct slots with -1 padding between.
          std::vector<float> keys(100 * 128);
          for (size_t i = 0; i < keys.size(); ++i)
            keys[i] = unit(rng) * float(1 + (i / 128) % 7) * 0.01f * float(i % 13);
          std::fill_n(keys.begin() + 5 * 128, 128, 0.0f);
          keys[9 * 128 + 4] = NAN;
          keys[11 * 128 + 100] = INFINITY;
          std::vector<int64_t> all(size_t(p.num_blocks * block_size));
          std::iota(all.begin(), all.end(), 0);
          std::shuffle(all.begin(), all.end(), rng);
          std::vector<int64_t> slots;
          for (int i = 0; i < 100; ++i) slots.push_back(i % 4 == 2 ? -1 : all[size_t(i) % all.size()]);
          if (block_size == 8) {  // fewer slots than keys: keep them distinct
            for (size_t i = 0; i < slots.size(); ++i)
              if (i >= all.size()) slots[i] = -1;
          }
          std::vector<uint8_t> src(keys.size() * 2);
          from_float(dtype, keys.data(), src.data(), keys.size());
          std::vector<uint8_t> cpu(bytes, 0xFF);
          p.pool = cpu.data();
          write_index_keys_cpu(p, 128, dtype, src.data(), 128, slots.data(), int64_t(slots.size()), scale);
          Buffer pool(Device::kCuda, bytes);
          fill_bytes(pool.data(), Device::kCuda, 0xFF, bytes);
          const Buffer dsrc = upload(Device::kCuda, src), dslots = upload(Device::kCuda, slots);
          Buffer error(Device::kCuda, 4);
          fill_bytes(error.data(), Device::kCuda, 0, 4);
          p.pool = pool.data();
          write_index_keys_cuda(p, 128, dtype, dsrc.data(), 128, dslots.as<int64_t>(), int64_t(slots.size()), scale,
                                error.as<int32_t>());
          testing::cuda_ok(cudaDeviceSynchronize(), "write");
          EXPECT_EQ(download<uint8_t>(Device::kCuda, pool.data(), bytes), cpu)
              << dtype_name(dtype) << " format " << int(format) << " scale " << int(scale) << " block " << block_size;
          EXPECT_EQ(download<int32_t>(Device::kCuda, error.data(), 1)[0], 0);
        }
      }
    }
  }
}

TEST(IndexKeysWriteCuda, SlotsPastThePoolAreSkippedAndFlagged) {
  SKIP_WITHOUT_CUDA();
  PagedIndexKeys p;
  p.num_blocks = 2;
  p.block_size = 16;
  const size_t bytes = 2 * 16 * 132;
  std::vector<float> keys(3 * 128, 1.0f);
  std::vector<uint8_t> src(keys.size() * 2);
  from_float(DType::kBF16, keys.data(), src.data(), keys.size());
  const std::vector<int64_t> slots = {3, 32, -7};  // the second and third are past the pool
  std::vector<uint8_t> cpu(bytes, 0xFF);
  p.pool = cpu.data();
  const std::vector<int64_t> valid = {3, -1, -1};
  write_index_keys_cpu(p, 128, DType::kBF16, src.data(), 128, valid.data(), 3);
  Buffer pool(Device::kCuda, bytes), error(Device::kCuda, 4);
  fill_bytes(pool.data(), Device::kCuda, 0xFF, bytes);
  fill_bytes(error.data(), Device::kCuda, 0, 4);
  const Buffer dsrc = upload(Device::kCuda, src), dslots = upload(Device::kCuda, slots);
  p.pool = pool.data();
  write_index_keys_cuda(p, 128, DType::kBF16, dsrc.data(), 128, dslots.as<int64_t>(), 3, IndexScaleFormat::kUe8m0,
                        error.as<int32_t>());
  testing::cuda_ok(cudaDeviceSynchronize(), "write");
  EXPECT_EQ(download<uint8_t>(Device::kCuda, pool.data(), bytes), cpu);
  EXPECT_EQ(download<int32_t>(Device::kCuda, error.data(), 1)[0], kIndexErrorSlot);
}

TEST(IndexQueriesCuda, QuantizesAsTheCpuTwin) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<float> unit(-5.0f, 5.0f);
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    const int64_t rows = 7;
    const int32_t heads = 64;
    std::vector<float> q(size_t(rows) * heads * 128);
    for (size_t i = 0; i < q.size(); ++i) q[i] = unit(rng) * float((i / 128) % 9) * 0.1f;  // some heads all zero
    std::vector<uint8_t> src(q.size() * 2);
    from_float(dtype, q.data(), src.data(), q.size());
    std::vector<float> w(size_t(rows) * heads);
    for (float& x : w) x = unit(rng);
    std::vector<uint8_t> q8(q.size());
    std::vector<float> w8(w.size());
    quantize_index_queries_cpu(dtype, src.data(), w.data(), rows, heads, q8.data(), w8.data());
    const Buffer dq = upload(Device::kCuda, src), dw = upload(Device::kCuda, w);
    Buffer dq8(Device::kCuda, q8.size()), dw8(Device::kCuda, w8.size() * 4);
    quantize_index_queries_cuda(dtype, dq.data(), dw.as<float>(), rows, heads, dq8.data(), dw8.as<float>());
    testing::cuda_ok(cudaDeviceSynchronize(), "quantize");
    EXPECT_EQ(download<uint8_t>(Device::kCuda, dq8.data(), q8.size()), q8) << dtype_name(dtype);
    EXPECT_EQ(download<float>(Device::kCuda, dw8.data(), w8.size()), w8) << dtype_name(dtype);
  }
}

// ---- the indexer ----------------------------------------------------------------------

IndexKeysSpec production(IndexKeyLayout layout, IndexKeyFormat format, std::vector<int32_t> lens) {
  IndexKeysSpec s;
  s.heads = 64;
  s.dim = 128;
  s.topk = 256;
  s.layout = layout;
  s.format = format;
  s.kv_lens = std::move(lens);
  return s;
}

TEST(IndexKeysCuda, MatchesTheTwinOnExactProblems) {
  SKIP_WITHOUT_CUDA();
  std::vector<IndexKeysSpec> specs;
  // Ragged lengths: empty, inside the top-k, one over, several tiles and
  // slices, a partial last block; on every source.
  const std::vector<int32_t> ragged = {0, 1, 256, 257, 4099, 700, 2500};
  for (const auto& [layout, format] :
       std::vector<std::pair<IndexKeyLayout, IndexKeyFormat>>{{IndexKeyLayout::kDense, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3}}) {
    specs.push_back(production(layout, format, ragged));
  }
  // FP8 over each block size the tile addressing distinguishes, with padded
  // block strides; f16 queries; pre-quantized queries.
  for (const int32_t block_size : {8, 16, 32, 128, 192}) {
    IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {1500, 3001, 300});
    s.block_size = block_size;
    s.block_pad_bytes = block_size == 16 ? 48 : 0;
    s.seed = uint64_t(block_size);
    specs.push_back(s);
  }
  {
    IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {2000, 999});
    s.dtype = DType::kF16;
    specs.push_back(s);
    s.q_format = IndexQueryFormat::kE4m3;
    specs.push_back(s);
  }
  // Multi-token rows: 2 (chains of two tokens), 3 and 5 (groups of four and
  // a remainder), on FP8 and native paged keys.
  for (const int32_t q_len : {2, 3, 5}) {
    for (const IndexKeyFormat format : {IndexKeyFormat::kE4m3, IndexKeyFormat::kNative}) {
      IndexKeysSpec s = production(IndexKeyLayout::kPaged, format, {1800, 258, 5});
      s.q_len = q_len;
      s.seed = 100 + uint64_t(q_len);
      specs.push_back(s);
    }
  }
  // Paged native keys at another geometry (one row per CTA) and block size.
  {
    IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kNative, {900, 3000});
    s.heads = 20;
    s.dim = 64;
    s.topk = 100;
    s.block_size = 32;
    specs.push_back(s);
  }
  // The production top-k over many tiles per CTA (stage reuse), batch 8.
  {
    IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3,
                                 {20000, 17000, 2049, 20000, 9000, 12345, 2048, 19999});
    s.topk = 2048;
    specs.push_back(s);
  }
  for (const IndexKeysSpec& s : specs) {
    const IndexKeysProblem pb = make_index_keys_problem(s);
    testing::expect_same_selection(pb, run_gpu(pb), testing::run_index_twin(pb), describe(s).c_str());
  }
}

TEST(IndexKeysCuda, RealValuedFp8KeysSwapOnlyAtTheThreshold) {
  SKIP_WITHOUT_CUDA();
  for (const int32_t q_len : {1, 2}) {
    IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {3000, 5000, 128});
    s.exact = false;
    s.q_len = q_len;
    s.seed = 31 + uint64_t(q_len);
    const IndexKeysProblem pb = make_index_keys_problem(s);
    // The tensor cores add e4m3 products with fewer bits than fp32 keeps
    // (about 14 retained), so scores may differ from the twin's fp64 ones by
    // parts in 10^4: swaps are allowed only that close to the threshold.
    testing::expect_same_selection(pb, run_gpu(pb), testing::run_index_twin(pb), describe(s).c_str(), 1e-3);
  }
}

TEST(IndexKeysCuda, QueriesQuantizedInTheKernelSelectAsPrequantizedOnes) {
  SKIP_WITHOUT_CUDA();
  IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {4000, 2600});
  s.exact = false;
  s.q_len = 2;
  const IndexKeysProblem native = make_index_keys_problem(s);
  s.q_format = IndexQueryFormat::kE4m3;
  const IndexKeysProblem quantized = make_index_keys_problem(s);  // the same keys; q and weights through the op
  const IndexSelection a = run_gpu(native), b = run_gpu(quantized);
  EXPECT_EQ(a.positions, b.positions);
  EXPECT_EQ(a.counts, b.counts);
}

TEST(IndexKeysCuda, BlocksNoSequenceOwnsChangeNothing) {
  SKIP_WITHOUT_CUDA();
  for (const IndexKeyFormat format : {IndexKeyFormat::kE4m3, IndexKeyFormat::kNative}) {
    IndexKeysSpec s = production(IndexKeyLayout::kPaged, format, {2000, 700, 333});
    s.spare_blocks = 8;
    s.block_size = 16;
    IndexKeysProblem pb = make_index_keys_problem(s);
    const IndexSelection clean = run_gpu(pb);
    testing::write_huge_unused_keys(pb);
    const IndexSelection poisoned = run_gpu(pb);
    EXPECT_EQ(poisoned.positions, clean.positions) << int(format);
    testing::expect_same_selection(pb, poisoned, testing::run_index_twin(pb), "poisoned");
  }
}

TEST(IndexKeysCuda, RefusedLengthsAndBlocksAreFlaggedAsTheTwinFlagsThem) {
  SKIP_WITHOUT_CUDA();
  for (const auto& [layout, format] :
       std::vector<std::pair<IndexKeyLayout, IndexKeyFormat>>{{IndexKeyLayout::kDense, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kNative},
                                                              {IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3}}) {
    IndexKeysSpec s = production(layout, format, {1000, 1000, 1000, 100});
    s.spare_blocks = 0;
    s.extra_table_entries = 0;
    IndexKeysProblem pb = make_index_keys_problem(s);
    pb.spec.kv_lens = {1000, 1001, -1, 100};  // past the bound, negative, fine
    if (layout == IndexKeyLayout::kPaged) {
      pb.table[0 * size_t(pb.max_blocks) + 3] = static_cast<int32_t>(pb.num_blocks);  // a scored row's block
      pb.table[3 * size_t(pb.max_blocks) + 1] = -9;  // a row inside the top-k: never read, not flagged
    }
    const IndexSelection want = testing::run_index_twin(pb);
    EXPECT_EQ(want.error, kIndexErrorLength | (layout == IndexKeyLayout::kPaged ? kIndexErrorBlock : 0));
    testing::expect_same_selection(pb, run_gpu(pb), want, describe(s).c_str());
    // Multi-token rows of a refused block: every scored row of the sequence refused.
    if (layout == IndexKeyLayout::kPaged) {
      pb.spec.q_len = 3;
      pb.weights.resize(size_t(pb.rows()) * size_t(s.heads), 0.5f);
      pb.q.resize(size_t(pb.rows()) * size_t(s.heads) * size_t(s.dim) * 2, 0);
      testing::expect_same_selection(pb, run_gpu(pb), testing::run_index_twin(pb), "multi-token refusals");
    }
  }
}

TEST(IndexKeysCuda, BadDescriptionsAreNamedBeforeAnyLaunch) {
  SKIP_WITHOUT_CUDA();
  IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {600, 300});
  const IndexKeysProblem pb = make_index_keys_problem(s);
  DeviceProblem dev(pb);
  const auto expect_named = [&](auto edit, const char* needle, const DsaConfig& config) {
    DsaIndexerArgs a = dev.args();
    edit(a);
    try {
      dsa_select_tokens_cuda(config, pb.sequences, a);
      ADD_FAILURE() << "no error naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_named([&](DsaIndexerArgs& a) { a.paged.pool = static_cast<unsigned char*>(dev.storage.data()) + 8; },
               "16-byte aligned", pb.config);
  expect_named([](DsaIndexerArgs& a) { a.paged.block_size = 48; }, "block_size = 48", pb.config);
  expect_named([](DsaIndexerArgs& a) { a.max_kv_len = int64_t{a.paged.max_blocks} * 64 + 1; },
               "exceeds what a block-table row holds", pb.config);
  expect_named([](DsaIndexerArgs& a) { a.paged.block_stride_bytes = 64 * 132 - 16; }, "block_stride_bytes", pb.config);
  DsaConfig narrow = pb.config;
  narrow.index_heads = 32;
  expect_named([](DsaIndexerArgs&) {}, "64 index heads x 128 only", narrow);
}

// A decode step as an engine runs it, captured once: write each sequence's
// new key at its slot, then select. Between replays the device lengths and
// slots change (different growth per sequence, across block boundaries), and
// every replay must give the twin's answer at the new lengths.
TEST(IndexKeysCuda, GraphReplaysFollowTheLengths) {
  SKIP_WITHOUT_CUDA();
  for (const IndexKeyFormat format : {IndexKeyFormat::kE4m3, IndexKeyFormat::kNative}) {
    IndexKeysSpec s = production(IndexKeyLayout::kPaged, IndexKeyFormat::kE4m3, {1000, 250, 3000});
    s.format = format;
    s.block_size = 16;
    s.max_kv_len = 3100;
    s.extra_table_entries = 0;
    IndexKeysProblem pb = make_index_keys_problem(s);
    // Blocks for the growth: make the table cover max_kv_len with fresh blocks.
    const PagedIndexKeys layout = pb.paged(nullptr, nullptr);
    const int64_t block_bytes = index_key_block_bytes(layout, s.dim);
    const int32_t need = int32_t((pb.max_kv_len + s.block_size - 1) / s.block_size);
    int64_t next_block = pb.num_blocks;
    for (int32_t b = 0; b < pb.sequences; ++b) {
      for (int32_t e = 0; e < need; ++e) {
        int32_t& entry = pb.table[size_t(b) * size_t(pb.max_blocks) + size_t(e)];
        if (int64_t{e} * s.block_size >= s.kv_lens[size_t(b)]) entry = static_cast<int32_t>(next_block++);
      }
    }
    pb.num_blocks = next_block;
    pb.storage.resize(size_t(pb.num_blocks * block_bytes), 0xFF);
    DeviceProblem dev(pb);
    Buffer new_keys(Device::kCuda, size_t(pb.sequences) * size_t(s.dim) * 2);
    Buffer new_slots(Device::kCuda, size_t(pb.sequences) * 8);
    testing::StreamGraph graph;
    cudaStream_t stream = graph.stream();
    DsaIndexerArgs a = dev.args();
    const auto step = [&](cudaStream_t st) {
      write_index_keys_cuda(a.paged, s.dim, s.dtype, new_keys.data(), s.dim, new_slots.as<int64_t>(), pb.sequences,
                            IndexScaleFormat::kUe8m0, a.error, st);
      dsa_select_tokens_cuda(pb.config, pb.sequences, a, st);
    };
    std::mt19937_64 rng(41);
    std::uniform_int_distribution<int> small(-4, 4);
    std::vector<int32_t> lens = s.kv_lens;
    const auto prepare = [&](const std::vector<int32_t>& growth) {
      // New keys at each sequence's next positions (host mirror through the CPU write op).
      std::vector<float> keys(size_t(pb.sequences) * size_t(s.dim));
      for (float& x : keys) x = float(small(rng));
      std::vector<int64_t> slots(size_t(pb.sequences));
      for (int32_t b = 0; b < pb.sequences; ++b) {
        const int64_t t = lens[size_t(b)];
        slots[size_t(b)] =
            growth[size_t(b)] == 0
                ? -1
                : int64_t{pb.table[size_t(b) * size_t(pb.max_blocks) + size_t(t / s.block_size)]} * s.block_size +
                      t % s.block_size;
        lens[size_t(b)] += growth[size_t(b)];
      }
      std::vector<uint8_t> bytes(keys.size() * 2);
      from_float(s.dtype, keys.data(), bytes.data(), keys.size());
      write_index_keys_cpu(pb.paged(pb.storage.data(), nullptr), s.dim, s.dtype, bytes.data(), s.dim, slots.data(),
                           pb.sequences);
      copy_bytes(new_keys.data(), Device::kCuda, bytes.data(), Device::kCpu, bytes.size());
      copy_bytes(new_slots.data(), Device::kCuda, slots.data(), Device::kCpu, slots.size() * 8);
      copy_bytes(dev.lens.data(), Device::kCuda, lens.data(), Device::kCpu, lens.size() * 4);
      pb.spec.kv_lens = lens;
      dev.poison();
    };
    prepare({1, 1, 1});
    step(stream);  // first use outside the capture
    testing::cuda_ok(cudaStreamSynchronize(stream), "eager");
    testing::expect_same_selection(pb, dev.read(), testing::run_index_twin(pb), "eager step");
    graph.capture(step);
    // Growth per replay: sequence 1 crosses the top-k (250 -> 257 .. ) and
    // block boundaries; sequence 2 stalls once (-1 slot) and sequence 0 grows.
    const std::vector<std::vector<int32_t>> growth = {{1, 1, 1}, {1, 1, 0}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1},
                                                      {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}};
    for (size_t r = 0; r < growth.size(); ++r) {
      prepare(growth[r]);
      graph.replay();
      testing::expect_same_selection(
          pb, dev.read(), testing::run_index_twin(pb),
          ("replay " + std::to_string(r) + " format " + std::to_string(int(format))).c_str());
      EXPECT_EQ(download<uint8_t>(Device::kCuda, dev.storage.data(), pb.storage.size()), pb.storage)
          << "the pool after replay " << r;
    }
  }
}

// A continuous batch's steps (support/index_keys_problem.h), one call each:
// released slots (0), windows that fit the top-k (not scored) and scored
// windows side by side, across key tiles and classify slices, first eagerly
// and then replayed from one graph captured at the first step. At the DSA
// layer's GPU index geometry (8 heads x 64, top-k 48, bound 448: its
// capacity) on dense rows and native pools (dsa_score_kernel), past a
// slice, and at the production geometry (64 x 128) on every source, one and
// three tokens per sequence (the group and FP8 kernels). Every call must
// finish (within 60 s, else the process ends naming it) and match the twin.
// Under the sanitizers (testing::quick_mode()) the sources past a slice reach
// 2112 tokens (its first edge, not the second at 4096) and the graph replays
// every step once, not twice.
TEST(IndexKeysCuda, MixedLengthsInOneCallMatchTheTwinEagerAndReplayed) {
  SKIP_WITHOUT_CUDA();
  const bool quick = testing::quick_mode();
  const int32_t past_slice = quick ? 2112 : 4200;  // past a classify slice of 2048
  struct Source {
    IndexKeyLayout layout;
    IndexKeyFormat format;
    int32_t heads, dim, block_size, bound, q_len;
    DType dtype;
  };
  const IndexKeyLayout kDense = IndexKeyLayout::kDense, kPaged = IndexKeyLayout::kPaged;
  const IndexKeyFormat kNative = IndexKeyFormat::kNative, kE4m3 = IndexKeyFormat::kE4m3;
  const std::vector<Source> sources = {
      {kDense, kNative, 8, 64, 16, 448, 1, DType::kBF16},
      {kPaged, kNative, 8, 64, 16, 448, 1, DType::kBF16},
      {kPaged, kNative, 8, 64, 64, 448, 1, DType::kF16},
      {kDense, kNative, 8, 64, 16, 448, 3, DType::kBF16},
      {kDense, kNative, 8, 64, 64, past_slice, 1, DType::kBF16},
      {kPaged, kNative, 8, 64, 64, past_slice, 1, DType::kBF16},
      {kDense, kNative, 64, 128, 16, 448, 1, DType::kBF16},
      {kPaged, kNative, 64, 128, 16, 448, 1, DType::kBF16},
      {kPaged, kE4m3, 64, 128, 16, 448, 1, DType::kBF16},
      {kPaged, kE4m3, 64, 128, 8, 448, 3, DType::kBF16},
      {kPaged, kNative, 64, 128, 64, past_slice, 3, DType::kBF16},
      {kPaged, kE4m3, 64, 128, 64, past_slice, 1, DType::kBF16},
  };
  for (const Source& src : sources) {
    const testing::MixedLengthSteps m = testing::mixed_length_steps(48, src.bound);
    IndexKeysSpec s = production(src.layout, src.format, m.built);
    s.heads = src.heads;
    s.dim = src.dim;
    s.topk = 48;
    s.block_size = src.block_size;
    s.max_kv_len = src.bound;
    s.q_len = src.q_len;
    s.dtype = src.dtype;
    s.seed = 500 + uint64_t(src.bound) + uint64_t(src.heads);
    IndexKeysProblem pb = make_index_keys_problem(s);
    DeviceProblem dev(pb);
    testing::StreamGraph graph;
    cudaStream_t stream = graph.stream();
    const auto set_step = [&](size_t i) {
      pb.spec.kv_lens = m.steps[i];
      copy_bytes(dev.lens.data(), Device::kCuda, m.steps[i].data(), Device::kCpu, m.steps[i].size() * 4);
      dev.poison();  // synchronizes the device: the lengths have landed
    };
    const auto label = [&](const char* how, size_t i) {
      std::string lens;
      for (int32_t l : m.steps[i]) lens += std::to_string(l) + " ";
      return std::string(how) + " step " + std::to_string(i) + " (lengths " + lens + ") of " + describe(s);
    };
    const DsaIndexerArgs a = dev.args();
    std::vector<IndexSelection> want;  // the twin's answer per step
    for (size_t i = 0; i < m.steps.size(); ++i) {
      set_step(i);
      want.push_back(testing::run_index_twin(pb));
      EXPECT_EQ(want.back().error, 0) << label("twin", i);
      dsa_select_tokens_cuda(pb.config, pb.sequences, a, stream);
      finish_or_abort(stream, 60, label("eager", i));
      testing::expect_same_selection(pb, dev.read(), want[i], label("eager", i).c_str());
    }
    set_step(0);
    graph.capture([&](cudaStream_t st) { dsa_select_tokens_cuda(pb.config, pb.sequences, a, st); });
    for (int round = 0; round < (quick ? 1 : 2); ++round) {
      for (size_t i = 0; i < m.steps.size(); ++i) {
        set_step(i);
        graph.launch();
        finish_or_abort(stream, 60, label("replayed", i));
        testing::expect_same_selection(pb, dev.read(), want[i], label("replayed", i).c_str());
      }
    }
  }
}

}  // namespace
}  // namespace sparsepage
