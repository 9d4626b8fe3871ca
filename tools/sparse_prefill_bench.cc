// sparse_prefill_bench: the time to prefill a prompt in chunks with the
// sparse prefill (sparsepage/prefill.h), per layer kind:
//   dsa          the DSA indexer over the chunk, then MLA attention over
//                each token's top-k (DeepSeek-V3.2 geometry), bf16 keys;
//   dsa-fp8      the same with the indexer reading vLLM's FP8 index keys
//                (the serving form) from a paged pool in shuffled block
//                order, the attention over bf16 rows as FlashMLA's sparse
//                prefill takes them;
//   blocksparse  the block indexer (max-pooled block scores, top-k blocks per
//                query block), then GQA over the kept blocks (64 heads over
//                4 KV heads, blocks of 128);
//   blocksparse-fp8  the same over e4m3 K and V with per-KV-head scales
//                (vLLM's fp8 KV cache);
//   static       the static per-head pattern (Phi-3-small), then GQA.
// Each chunk shape is captured once in a CUDA graph and replayed for every
// chunk of the prompt (the chunk's position moves on the device), and the
// prompt's time is the sum over its chunks. Beside it: the read floor (the
// bytes of the chunk's queries, outputs, index keys and every cache row of
// its context once, over the measured read bandwidth) and the FLOP floor
// (the chunk's FLOPs over --peak-tflops, 790 by default: the H200's dense
// bf16 peak, roughly). Before timing, each configuration's last chunk is
// checked: sampled tokens' selections against the rule (structure, and the
// indexer's kept set against the CPU rule), and their outputs against fp64
// over what they attended. At the last chunk the selection and the
// attention are also timed alone (each its own graph), to show where a
// chunk's time goes. Dense attention of the same prompt is timed by
// python/benchmarks/prefill_vs_dense.py (torch SDPA, FlashInfer).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#if SPARSEPAGE_BENCH_CUDA
#include <cuda_runtime.h>
#endif

#include "bench_device.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"
#include "sparsepage/prefill.h"

using namespace sparsepage;
using json = nlohmann::json;

namespace {

struct Options {
  std::vector<std::string> kinds = {"dsa", "dsa-fp8", "blocksparse", "blocksparse-fp8", "static"};
  std::vector<int64_t> prompts = {8192, 32768, 131072};
  std::vector<int32_t> chunks = {2048, 16384};
  int32_t reps = 3;
  int32_t topk = 2048;             // DSA
  int64_t index_budget_mb = 2048;  // the DSA indexer's scratch: tokens per pass
  double peak_tflops = 790.0;
  bool cpu = false;
  std::string json_path;
};

// ---- timing: one graph per chunk shape, replayed per chunk ----------------------

/// Captures `run(stream)` once and replays it; on the CPU it just calls it.
class ChunkTimer {
 public:
  ChunkTimer(Device device, const std::function<void(void*)>& run) : device_(device), run_(run) {
#if SPARSEPAGE_BENCH_CUDA
    if (device_ != Device::kCuda) return;
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    run_(stream_);  // warm-up outside the graph (first launches, lazy attributes)
    check(cudaStreamSynchronize(stream_), "warm-up");
    check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), "begin capture");
    run_(stream_);
    check(cudaStreamEndCapture(stream_, &graph_), "end capture (the chunk did something a graph cannot hold)");
    check(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
    check(cudaEventCreate(&start_), "event");
    check(cudaEventCreate(&stop_), "event");
#endif
  }
  ~ChunkTimer() {
#if SPARSEPAGE_BENCH_CUDA
    if (device_ != Device::kCuda) return;
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
    cudaStreamDestroy(stream_);
#endif
  }
  ChunkTimer(const ChunkTimer&) = delete;
  ChunkTimer& operator=(const ChunkTimer&) = delete;

  /// One replay (or call), for checks: synchronizes.
  void replay() {
#if SPARSEPAGE_BENCH_CUDA
    if (device_ == Device::kCuda) {
      check(cudaGraphLaunch(exec_, stream_), "replay");
      check(cudaStreamSynchronize(stream_), "replay");
      return;
    }
#endif
    run_(nullptr);
  }
  /// Median microseconds of `reps` timed replays after one untimed one.
  double median_us(int32_t reps) {
    std::vector<double> times;
    replay();
    for (int32_t r = 0; r < reps; ++r) {
#if SPARSEPAGE_BENCH_CUDA
      if (device_ == Device::kCuda) {
        check(cudaEventRecord(start_, stream_), "event");
        check(cudaGraphLaunch(exec_, stream_), "replay");
        check(cudaEventRecord(stop_, stream_), "event");
        check(cudaEventSynchronize(stop_), "event");
        float ms = 0;
        check(cudaEventElapsedTime(&ms, start_, stop_), "event");
        times.push_back(1e3 * ms);
        continue;
      }
#endif
      const auto t0 = std::chrono::steady_clock::now();
      run_(nullptr);
      times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

 private:
#if SPARSEPAGE_BENCH_CUDA
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw Error(std::string("sparse_prefill_bench: ") + what + ": " + cudaGetErrorString(e));
  }
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
#endif
  Device device_;
  std::function<void(void*)> run_;
};

// ---- host helpers -------------------------------------------------------------

std::vector<float> read_floats(Device device, DType dtype, const void* base, int64_t first, int64_t count) {
  const size_t es = dtype_size(dtype);
  const auto bytes = download<uint8_t>(device, static_cast<const char*>(base) + first * static_cast<int64_t>(es),
                                       static_cast<size_t>(count) * es);
  std::vector<float> out(static_cast<size_t>(count));
  to_float(dtype, bytes.data(), out.data(), out.size());
  return out;
}

Buffer random_buffer(Device device, DType dtype, int64_t count, uint64_t seed) {
  Buffer b(device, static_cast<size_t>(count) * dtype_size(dtype));
  bench::fill_random(device, dtype, b.data(), count, seed);
  return b;
}

/// fp64 softmax attention of one query over explicit key/value rows; the
/// relative L2 distance of `got` from it (inf for NaN).
double attention_error(const std::vector<float>& q, const std::vector<std::vector<float>>& keys,
                       const std::vector<std::vector<float>>& values, double scale, const std::vector<float>& got) {
  std::vector<double> s(keys.size());
  double max = -INFINITY;
  for (size_t j = 0; j < keys.size(); ++j) {
    double dot = 0;
    for (size_t i = 0; i < q.size(); ++i) dot += double{q[i]} * keys[j][i];
    s[j] = dot * scale;
    max = std::max(max, s[j]);
  }
  std::vector<double> out(got.size(), 0.0);
  double sum = 0;
  for (size_t j = 0; j < keys.size(); ++j) {
    const double w = std::exp(s[j] - max);
    sum += w;
    for (size_t i = 0; i < out.size(); ++i) out[i] += w * values[j][i];
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    out[i] /= sum;
    diff += (got[i] - out[i]) * (got[i] - out[i]);
    norm += out[i] * out[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : INFINITY;
}

/// One layer kind at one (prompt, chunk): how to run a chunk, move it, check it and count it.
struct Config {
  /// The chunk's parts in order (the selection, then the attention); a
  /// chunk runs them all, and each is also timed alone.
  std::vector<std::pair<std::string, std::function<void(void*)>>> phases;
  void run(void* stream) const {
    for (const auto& phase : phases) phase.second(stream);
  }
  std::function<void(int64_t kv_len)> place;         // the chunk ends at kv_len (written on the device)
  std::function<std::string(int64_t kv_len)> check;  // after a run at kv_len: "" or what is wrong
  std::function<double(int64_t kv_len)> flops;
  std::function<double(int64_t kv_len)> bytes;
  std::function<std::string()> kernel;
};

std::vector<int32_t> sample_tokens(int32_t n) { return {0, n / 2, n - 1}; }

std::string format_ms(double us) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f ms", us / 1e3);
  return text;
}

// ---- DSA: the indexer, then MLA over each token's top-k ---------------------------

struct DsaSetup {
  static constexpr int32_t kHeads = 128, kLatent = 512, kRope = 64, kIndexHeads = 64, kIndexDim = 128;
  Device device = Device::kCpu;
  int64_t prompt = 0;
  int32_t chunk = 0, topk = 0;
  size_t index_budget = 0;
  bool fp8_keys = false;  // dsa-fp8: the index keys also live quantized in a paged FP8 pool, which the indexer reads
  Buffer k_cache, rope, q, q_rope, q_index, weights, positions, counts, out, kv_lens;
  Buffer key_pool, key_table, index_error;
  std::vector<int32_t> host_table;
  std::unique_ptr<DsaPrefillIndexer> indexer;
  std::unique_ptr<MlaSparsePrefill> attention;
  DsaPrefillIndexerParams ip;
  MlaPrefillParams mp;
};

/// dsa-fp8: the chunk's context keys (the k_cache's index columns) written
/// by the engine's write op into vLLM's FP8 indexer cache, 64-token blocks
/// in shuffled order, and the indexer pointed at it.
void fp8_index_keys(DsaSetup& s) {
  constexpr int32_t kBlock = 64;
  const Device dev = s.device;
  const int32_t blocks = static_cast<int32_t>((s.prompt + kBlock - 1) / kBlock);
  s.host_table.resize(static_cast<size_t>(blocks));
  std::iota(s.host_table.begin(), s.host_table.end(), 0);
  std::shuffle(s.host_table.begin(), s.host_table.end(), std::mt19937(31));
  s.key_table = upload(dev, s.host_table);
  s.key_pool = Buffer(dev, static_cast<size_t>(blocks) * kBlock * IndexKeyFp8::kTokenBytes);
  s.index_error = Buffer(dev, 4);
  fill_bytes(s.index_error.data(), dev, 0, 4);
  PagedIndexKeys& keys = s.ip.paged;
  keys.format = IndexKeyFormat::kE4m3;
  keys.pool = s.key_pool.data();
  keys.num_blocks = blocks;
  keys.block_size = kBlock;
  keys.block_table = s.key_table.as<int32_t>();
  keys.block_table_stride = blocks;
  keys.max_blocks = blocks;
  std::vector<int64_t> slots(static_cast<size_t>(s.prompt));
  for (int64_t p = 0; p < s.prompt; ++p)
    slots[static_cast<size_t>(p)] = int64_t{s.host_table[static_cast<size_t>(p / kBlock)]} * kBlock + p % kBlock;
  const Buffer d_slots = upload(dev, slots);
  const void* src = static_cast<const char*>(s.k_cache.data()) + int64_t{s.kLatent} * 2;
  const int64_t row = s.kLatent + s.kIndexDim;
  if (dev == Device::kCuda) {
    write_index_keys_cuda(keys, s.kIndexDim, DType::kBF16, src, row, d_slots.as<int64_t>(), s.prompt);
  } else {
    write_index_keys_cpu(keys, s.kIndexDim, DType::kBF16, src, row, d_slots.as<int64_t>(), s.prompt);
  }
  s.ip.key_layout = IndexKeyLayout::kPaged;
  s.ip.error = s.index_error.as<int32_t>();
}

/// dsa-fp8's rule for token t (at position pos): the CPU twin over host
/// copies of the FP8 pool, its table and the token's queries.
std::vector<int32_t> fp8_rule(const DsaSetup& s, const DsaConfig& rule, int32_t t, int64_t pos) {
  const PagedIndexKeys& dev_keys = s.ip.paged;
  const auto pool = download<uint8_t>(s.device, dev_keys.pool, s.key_pool.bytes());
  const size_t q_bytes = static_cast<size_t>(s.kIndexHeads) * s.kIndexDim * 2;
  const auto q = download<uint8_t>(s.device, static_cast<const char*>(s.q_index.data()) + t * q_bytes, q_bytes);
  const auto w = download<float>(s.device, s.weights.as<float>() + int64_t{t} * s.kIndexHeads, s.kIndexHeads);
  const int32_t len = static_cast<int32_t>(pos + 1);
  std::vector<int32_t> positions(static_cast<size_t>(s.topk)), count(1);
  DsaIndexerArgs a;
  a.dtype = DType::kBF16;
  a.kv_lens = &len;
  a.max_kv_len = len;
  a.q_index = q.data();
  a.weights = w.data();
  a.positions = positions.data();
  a.counts = count.data();
  a.key_layout = IndexKeyLayout::kPaged;
  a.paged = dev_keys;
  a.paged.pool = const_cast<uint8_t*>(pool.data());
  a.paged.block_table = s.host_table.data();
  dsa_select_tokens_cpu(rule, 1, a);
  positions.resize(static_cast<size_t>(std::max(0, count[0])));
  return positions;
}

Config dsa_config(DsaSetup& s) {
  const Device dev = s.device;
  const int64_t tokens = s.chunk, key_row = s.kLatent + s.kIndexDim;
  s.k_cache = random_buffer(dev, DType::kBF16, s.prompt * key_row, 11);  // latent, then the index key
  s.rope = random_buffer(dev, DType::kBF16, s.prompt * s.kRope, 12);
  s.q = random_buffer(dev, DType::kBF16, tokens * s.kHeads * s.kLatent, 13);
  s.q_rope = random_buffer(dev, DType::kBF16, tokens * s.kHeads * s.kRope, 14);
  s.q_index = random_buffer(dev, DType::kBF16, tokens * s.kIndexHeads * s.kIndexDim, 15);
  s.weights = random_buffer(dev, DType::kF32, tokens * s.kIndexHeads, 16);
  s.positions = Buffer(dev, static_cast<size_t>(tokens) * s.topk * 4);
  s.counts = Buffer(dev, static_cast<size_t>(tokens) * 4);
  s.out = Buffer(dev, static_cast<size_t>(tokens) * s.kHeads * s.kLatent * 2);
  s.kv_lens = Buffer(dev, 4);
  s.indexer = std::make_unique<DsaPrefillIndexer>(dev, s.index_budget);
  s.attention = std::make_unique<MlaSparsePrefill>(dev);
  DsaPrefillIndexerParams& ip = s.ip;
  ip.chunk = {1, s.chunk, s.prompt, s.kv_lens.as<int32_t>()};
  ip.index_heads = s.kIndexHeads;
  ip.index_head_dim = s.kIndexDim;
  ip.topk = s.topk;
  ip.k_cache = s.k_cache.data();
  ip.key_column = s.kLatent;
  ip.capacity = s.prompt;
  ip.q_index = s.q_index.data();
  ip.weights = s.weights.as<float>();
  ip.positions = s.positions.as<int32_t>();
  ip.counts = s.counts.as<int32_t>();
  if (s.fp8_keys) fp8_index_keys(s);
  MlaPrefillParams& mp = s.mp;
  mp.chunk = ip.chunk;
  mp.num_heads = s.kHeads;
  mp.topk = s.topk;
  mp.q = s.q.data();
  mp.q_rope = s.q_rope.data();
  mp.kv = {s.k_cache.data(), key_row, s.kLatent, 0, 0, s.prompt};
  mp.kv_rope = {s.rope.data(), s.kRope, s.kRope, 0, 0, s.prompt};
  mp.indices = s.positions.as<int32_t>();
  mp.topk_length = s.counts.as<int32_t>();  // a token sees min(topk, pos + 1): shorter rows early in the prompt
  mp.scale = 1.0f / std::sqrt(192.0f);
  mp.out = s.out.data();
  Config c;
  c.place = [&s](int64_t kv_len) {
    const int32_t len = static_cast<int32_t>(kv_len);
    copy_bytes(s.kv_lens.data(), s.device, &len, Device::kCpu, 4);
  };
  // Prepare outside any capture, at the largest context (the plans do not depend on it).
  c.place(s.prompt);
  s.indexer->prepare(s.ip);
  s.attention->prepare(s.mp);
  c.kernel = [&s] { return std::string(s.attention->kernel_name()); };
  c.phases = {{"indexer", [&s](void* stream) { s.indexer->run(s.ip, stream); }},
              {"attention", [&s](void* stream) { s.attention->run(s.mp, stream); }}};
  c.check = [&s](int64_t kv_len) -> std::string {
    s.attention->check_errors();
    if (s.fp8_keys && download<int32_t>(s.device, s.index_error.data(), 1)[0] != 0)
      return "the indexer flagged a length or block of the FP8 key pool";
    const int32_t n = s.chunk;
    for (int32_t t : sample_tokens(n)) {
      const int64_t pos = kv_len - n + t;
      const auto pos_row =
          download<int32_t>(s.device, s.positions.as<int32_t>() + int64_t{t} * s.topk, static_cast<size_t>(s.topk));
      const int32_t count = download<int32_t>(s.device, s.counts.as<int32_t>() + t, 1)[0];
      if (count != std::min<int64_t>(s.topk, pos + 1))
        return "token " + std::to_string(t) + ": count " + std::to_string(count);
      for (int32_t i = 0; i < count; ++i) {
        if (pos_row[static_cast<size_t>(i)] < 0 || pos_row[static_cast<size_t>(i)] > pos ||
            (i > 0 && pos_row[static_cast<size_t>(i)] <= pos_row[static_cast<size_t>(i - 1)])) {
          return "token " + std::to_string(t) + ": kept positions not increasing inside its window";
        }
      }
      // The indexer's set against the CPU rule over the same keys (fp32 sums in
      // another order: scores within rounding of the k-th may swap).
      // (One token, and contexts up to 32K: the rule costs the host 64 x 128
      // multiply-adds per position.)
      if (pos + 1 > s.topk && t == n / 2 && pos < 32768) {
        DsaConfig rule;
        rule.index_heads = s.kIndexHeads;
        rule.index_head_dim = s.kIndexDim;
        rule.index_topk = s.topk;
        const int64_t row = s.kLatent + s.kIndexDim;
        const auto rows = read_floats(s.device, DType::kBF16, s.k_cache.data(), 0, (pos + 1) * row);  // one download
        std::vector<float> keys(static_cast<size_t>(pos + 1) * s.kIndexDim);
        for (int64_t p = 0; p <= pos; ++p) {
          std::copy(rows.begin() + p * row + s.kLatent, rows.begin() + (p + 1) * row, keys.begin() + p * s.kIndexDim);
        }
        const auto q = read_floats(s.device, DType::kBF16, s.q_index.data(), int64_t{t} * s.kIndexHeads * s.kIndexDim,
                                   s.kIndexHeads * s.kIndexDim);
        const auto w = download<float>(s.device, s.weights.as<float>() + int64_t{t} * s.kIndexHeads, s.kIndexHeads);
        const auto want = s.fp8_keys ? fp8_rule(s, rule, t, pos)
                                     : dsa_select_tokens_cpu(rule, 1, pos + 1, q.data(), w.data(), keys)[0];
        const std::set<int32_t> got(pos_row.begin(), pos_row.begin() + count);
        int64_t common = 0;
        for (int32_t p : want) common += got.count(p);
        if (common < static_cast<int64_t>(0.99 * static_cast<double>(want.size()))) {
          return "token " + std::to_string(t) + ": indexer keeps " + std::to_string(common) + " of the rule's " +
                 std::to_string(want.size());
        }
      }
      // Attention: fp64 over the kept rows, for a few heads.
      std::vector<std::vector<float>> keys, values;
      for (int32_t i = 0; i < count; ++i) {
        const int64_t p = pos_row[static_cast<size_t>(i)];
        auto latent = read_floats(s.device, DType::kBF16, s.k_cache.data(), p * (s.kLatent + s.kIndexDim), s.kLatent);
        const auto rope = read_floats(s.device, DType::kBF16, s.rope.data(), p * s.kRope, s.kRope);
        values.push_back(latent);
        latent.insert(latent.end(), rope.begin(), rope.end());
        keys.push_back(latent);
      }
      for (int32_t h : {0, s.kHeads / 2, s.kHeads - 1}) {
        const int64_t r = int64_t{t} * s.kHeads + h;
        auto q = read_floats(s.device, DType::kBF16, s.q.data(), r * s.kLatent, s.kLatent);
        const auto qr = read_floats(s.device, DType::kBF16, s.q_rope.data(), r * s.kRope, s.kRope);
        q.insert(q.end(), qr.begin(), qr.end());
        const auto got = read_floats(s.device, DType::kBF16, s.out.data(), r * s.kLatent, s.kLatent);
        const double err = attention_error(q, keys, values, s.mp.scale, got);
        if (!(err < 1e-2))
          return "token " + std::to_string(t) + " head " + std::to_string(h) + ": relative L2 " + std::to_string(err);
      }
    }
    return "";
  };
  c.flops = [&s](int64_t kv_len) {
    double f = 0;
    for (int64_t t = 0; t < s.chunk; ++t) {
      const double window = static_cast<double>(kv_len - s.chunk + t + 1);
      f += 2.0 * s.kIndexHeads * s.kIndexDim * window;                                             // index scores
      f += 2.0 * s.kHeads * std::min<double>(s.topk, window) * (s.kLatent + s.kRope + s.kLatent);  // S and P V
    }
    return f;
  };
  c.bytes = [&s](int64_t kv_len) {
    const double n = s.chunk;
    return 2.0 * n * s.kHeads * (s.kLatent + s.kRope)                                 // queries
           + 2.0 * n * s.kIndexHeads * s.kIndexDim + 4.0 * n * s.kIndexHeads          // index queries, weights
           + 2.0 * static_cast<double>(kv_len) * (s.kLatent + s.kIndexDim + s.kRope)  // every context row once
           + 2.0 * n * s.kHeads * s.kLatent;                                          // outputs
  };
  return c;
}

// ---- GQA over blocks: block-sparse (indexer) and static (pattern) -----------------------

// blocksparse-fp8's per-KV-head scales (powers of two, as vLLM's are often).
constexpr float kKScale = 0.5f, kVScale = 0.25f;

/// `count` random e4m3 bytes of magnitude 1/8 .. 15/8 (exponents 4-7, no
/// NaN), either sign.
Buffer random_e4m3(Device device, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes(static_cast<size_t>(count));
  for (uint8_t& b : bytes) {
    const uint64_t r = rng();
    b = static_cast<uint8_t>((r & 0x80) | ((4 + ((r >> 8) & 3)) << 3) | ((r >> 16) & 7));
  }
  return upload(device, bytes);
}

/// e4m3 bytes [first, first + count) of `base` dequantized by `scale`.
std::vector<float> read_e4m3(Device device, const void* base, int64_t first, int64_t count, float scale) {
  const auto bytes = download<uint8_t>(device, static_cast<const char*>(base) + first, static_cast<size_t>(count));
  std::vector<float> out(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) out[i] = e4m3_to_float(bytes[i]) * scale;
  return out;
}

struct GqaSetup {
  Device device = Device::kCpu;
  bool indexed = false;  // blocksparse: the block indexer; static: the pattern
  bool fp8 = false;      // K and V as e4m3 with per-KV-head scales
  int64_t prompt = 0;
  int32_t chunk = 0;
  int32_t hq = 0, hkv = 0, dim = 0, bs = 0;
  int32_t top_blocks = 16, local_blocks = 1;   // blocksparse
  int32_t static_local = 16, vert_stride = 8;  // static
  int32_t width = 0;
  Buffer k, v, index_keys, q, q_index, ids, counts, out, kv_lens, k_scale, v_scale;
  std::unique_ptr<BlockPrefillIndexer> indexer;
  std::unique_ptr<GqaBlockPrefill> attention;
  BlockPrefillIndexerParams ip;
  StaticPrefillParams sp;
  GqaPrefillParams gp;
};

Config gqa_config(GqaSetup& s) {
  const Device dev = s.device;
  const int64_t tokens = s.chunk, d = s.dim;
  const int32_t nqb = (s.chunk + s.bs - 1) / s.bs, g = s.hq / s.hkv;
  if (s.fp8) {
    s.k = random_e4m3(dev, int64_t{s.hkv} * s.prompt * d, 21);
    s.v = random_e4m3(dev, int64_t{s.hkv} * s.prompt * d, 22);
    s.k_scale = upload(dev, std::vector<float>(static_cast<size_t>(s.hkv), kKScale));
    s.v_scale = upload(dev, std::vector<float>(static_cast<size_t>(s.hkv), kVScale));
  } else {
    s.k = random_buffer(dev, DType::kBF16, int64_t{s.hkv} * s.prompt * d, 21);
    s.v = random_buffer(dev, DType::kBF16, int64_t{s.hkv} * s.prompt * d, 22);
  }
  s.q = random_buffer(dev, DType::kBF16, tokens * s.hq * d, 23);
  s.out = Buffer(dev, static_cast<size_t>(tokens) * s.hq * d * 2);
  s.kv_lens = Buffer(dev, 4);
  s.attention = std::make_unique<GqaBlockPrefill>(dev);
  const PrefillChunk chunk{1, s.chunk, s.prompt, s.kv_lens.as<int32_t>()};
  size_t lists;
  if (s.indexed) {
    s.width = s.top_blocks + 1;
    lists = static_cast<size_t>(nqb) * s.hkv;
    s.index_keys = random_buffer(dev, DType::kBF16, s.prompt * d, 24);
    s.q_index = random_buffer(dev, DType::kBF16, tokens * s.hkv * d, 25);
    s.ids = Buffer(dev, lists * s.width * 4);
    s.counts = Buffer(dev, lists * 4);
    s.indexer = std::make_unique<BlockPrefillIndexer>(dev);
    BlockPrefillIndexerParams& ip = s.ip;
    ip.chunk = chunk;
    ip.num_kv_heads = s.hkv;
    ip.head_dim = s.dim;
    ip.block_size = s.bs;
    ip.top_blocks = s.top_blocks;
    ip.local_blocks = s.local_blocks;
    ip.index_keys = {s.index_keys.data(), d, s.dim, 0, 0, s.prompt};
    ip.q_index = s.q_index.data();
    ip.block_ids = s.ids.as<int32_t>();
    ip.counts = s.counts.as<int32_t>();
  } else {
    StaticPrefillParams& sp = s.sp;
    sp.chunk = chunk;
    sp.num_qo_heads = s.hq;
    sp.num_kv_heads = s.hkv;
    sp.block_size = s.bs;
    sp.local_blocks = s.static_local;
    sp.vert_stride = s.vert_stride;
    s.width = static_prefill_width(sp, s.prompt);
    sp.width = s.width;
    lists = static_cast<size_t>(nqb) * s.hq;
    s.ids = Buffer(dev, lists * s.width * 4);
    s.counts = Buffer(dev, lists * 4);
    sp.block_ids = s.ids.as<int32_t>();
    sp.counts = s.counts.as<int32_t>();
  }
  GqaPrefillParams& gp = s.gp;
  gp.chunk = chunk;
  gp.num_qo_heads = s.hq;
  gp.num_kv_heads = s.hkv;
  gp.block_size = s.bs;
  gp.q = s.q.data();
  gp.k = RowView::dense(s.k.data(), s.hkv, s.prompt, s.dim);  // e4m3: elements are bytes
  gp.v = RowView::dense(s.v.data(), s.hkv, s.prompt, s.dim);
  if (s.fp8) {
    gp.kv_format = KvFormat::kE4m3PerHead;
    gp.k_scale = s.k_scale.as<float>();
    gp.v_scale = s.v_scale.as<float>();
  }
  gp.scale = 1.0f / std::sqrt(static_cast<float>(s.dim));
  gp.o = s.out.data();
  gp.selection = {s.indexed ? BlockSelectionLayout::kPerKvHead : BlockSelectionLayout::kPerQueryHead,
                  s.ids.as<int32_t>(), s.counts.as<int32_t>(), s.width};
  Config c;
  c.place = [&s](int64_t kv_len) {
    const int32_t len = static_cast<int32_t>(kv_len);
    copy_bytes(s.kv_lens.data(), s.device, &len, Device::kCpu, 4);
  };
  c.place(s.prompt);
  if (s.indexed) s.indexer->prepare(s.ip);
  s.attention->prepare(s.gp);
  c.kernel = [&s] { return std::string(s.attention->kernel_name()); };
  c.phases = {{s.indexed ? "indexer" : "pattern",
               [&s](void* stream) {
                 if (s.indexed) {
                   s.indexer->run(s.ip, stream);
                 } else {
                   static_prefill_blocks(s.device, s.sp, stream);
                 }
               }},
              {"attention", [&s](void* stream) { s.attention->run(s.gp, stream); }}};
  // The list of (query block i, query head h) and the positions token t of it attends.
  const auto list_index = [&s, nqb, g](int32_t t, int32_t h) {
    const int32_t i = t / s.bs, kv = h / g;
    return s.indexed ? int64_t{i} * s.hkv + kv : (int64_t{kv} * nqb + i) * g + h % g;
  };
  const auto list_of = [&s, list_index](int32_t t, int32_t h) {
    return download<int32_t>(s.device, s.ids.as<int32_t>() + list_index(t, h) * s.width, static_cast<size_t>(s.width));
  };
  const auto count_of = [&s, list_index](int32_t t, int32_t h) {
    return download<int32_t>(s.device, s.counts.as<int32_t>() + list_index(t, h), 1)[0];
  };
  c.check = [&s, list_of, count_of, g](int64_t kv_len) -> std::string {
    s.attention->check_errors();
    const int32_t n = s.chunk;
    const int64_t start = kv_len - n;
    StaticBlockSparseConfig rule;
    rule.num_qo_heads = s.hq;
    rule.num_kv_heads = s.hkv;
    rule.block_size = s.bs;
    rule.local_blocks = s.static_local;
    rule.vert_stride = s.vert_stride;
    for (int32_t t : sample_tokens(n)) {
      const int64_t pos = start + t, own = pos / s.bs;
      for (int32_t h : {0, s.hq - 1}) {
        const auto ids = list_of(t, h);
        const int32_t count = count_of(t, h);
        const int32_t kept = (count + s.bs - 1) / s.bs;
        if (kept < 1 || kept > s.width || ids[static_cast<size_t>(kept - 1)] != own) {
          return "token " + std::to_string(t) + " head " + std::to_string(h) +
                 ": the list does not end with the query's block";
        }
        std::vector<int32_t> blocks(ids.begin(), ids.begin() + kept);
        if (!s.indexed) {
          std::vector<int32_t> want;
          for (int64_t j = 0; j <= own; ++j) {
            if (rule.keeps(h, own, j)) want.push_back(static_cast<int32_t>(j));
          }
          if (blocks != want)
            return "token " + std::to_string(t) + " head " + std::to_string(h) +
                   ": the pattern's blocks differ from the rule";
        } else if (own <= 128 && t == n / 2 && h == 0) {  // one list, up to 16K positions: host time
          // The indexer's blocks against the rule over the same keys (max-pooled fp32 products).
          const int32_t i = t / s.bs, kv = h / g;
          const int32_t first = i * s.bs, last = std::min(n, first + s.bs);
          const auto q = read_floats(s.device, DType::kBF16, s.q_index.data(), (int64_t{first} * s.hkv) * s.dim,
                                     int64_t{last - first} * s.hkv * s.dim);
          const auto keys = read_floats(s.device, DType::kBF16, s.index_keys.data(), 0, own * s.bs * s.dim);
          std::vector<std::pair<double, int32_t>> scored;
          for (int64_t j = 0; j < own; ++j) {
            double best = -INFINITY;
            for (int32_t tt = 0; tt < last - first; ++tt) {
              for (int64_t p = j * s.bs; p < (j + 1) * s.bs; ++p) {
                double dot = 0;
                for (int32_t e = 0; e < s.dim; ++e)
                  dot += double{q[(static_cast<size_t>(tt) * s.hkv + kv) * s.dim + e]} *
                         keys[static_cast<size_t>(p * s.dim + e)];
                best = std::max(best, dot);
              }
            }
            scored.emplace_back(j >= own + 1 - s.local_blocks ? -INFINITY : -best, static_cast<int32_t>(j));
          }
          std::sort(scored.begin(), scored.end());
          std::set<int32_t> want;
          for (int64_t e = 0; e < std::min<int64_t>(s.top_blocks, own); ++e)
            want.insert(scored[static_cast<size_t>(e)].second);
          int64_t common = 0;
          for (int32_t j = 0; j + 1 < kept; ++j) common += want.count(blocks[static_cast<size_t>(j)]);
          if (common + 1 < static_cast<int64_t>(want.size())) {
            return "token " + std::to_string(t) + " head " + std::to_string(h) + ": the indexer keeps " +
                   std::to_string(common) + " of the rule's " + std::to_string(want.size()) + " blocks";
          }
        }
        // fp64 over the positions of its blocks up to its own (the KV head's rows read back once).
        const int64_t base = int64_t{h / g} * s.prompt;
        const auto k_rows = s.fp8 ? read_e4m3(s.device, s.k.data(), base * s.dim, (pos + 1) * s.dim, kKScale)
                                  : read_floats(s.device, DType::kBF16, s.k.data(), base * s.dim, (pos + 1) * s.dim);
        const auto v_rows = s.fp8 ? read_e4m3(s.device, s.v.data(), base * s.dim, (pos + 1) * s.dim, kVScale)
                                  : read_floats(s.device, DType::kBF16, s.v.data(), base * s.dim, (pos + 1) * s.dim);
        std::vector<std::vector<float>> keys, values;
        for (int32_t j : blocks) {
          for (int64_t p = int64_t{j} * s.bs; p < std::min<int64_t>((int64_t{j} + 1) * s.bs, pos + 1); ++p) {
            keys.emplace_back(k_rows.begin() + p * s.dim, k_rows.begin() + (p + 1) * s.dim);
            values.emplace_back(v_rows.begin() + p * s.dim, v_rows.begin() + (p + 1) * s.dim);
          }
        }
        const int64_t r = int64_t{t} * s.hq + h;
        const auto q = read_floats(s.device, DType::kBF16, s.q.data(), r * s.dim, s.dim);
        const auto got = read_floats(s.device, DType::kBF16, s.out.data(), r * s.dim, s.dim);
        const double err = attention_error(q, keys, values, s.gp.scale, got);
        if (!(err < 1e-2))
          return "token " + std::to_string(t) + " head " + std::to_string(h) + ": relative L2 " + std::to_string(err);
      }
    }
    return "";
  };
  c.flops = [&s, nqb](int64_t kv_len) {
    // Attention over the positions each token's list gives it, from the selection of this chunk.
    const int64_t start = kv_len - s.chunk;
    double f = 0;
    for (int32_t i = 0; i < nqb; ++i) {
      const int64_t own = start / s.bs + i;
      const int32_t first = i * s.bs, last = std::min(s.chunk, first + s.bs);
      for (int32_t h = 0; h < s.hq; ++h) {
        int64_t full;  // whole blocks before the own one
        if (s.indexed) {
          full = std::min<int64_t>(s.top_blocks, own);
        } else {
          StaticBlockSparseConfig rule;
          rule.num_qo_heads = s.hq;
          rule.num_kv_heads = s.hkv;
          rule.block_size = s.bs;
          rule.local_blocks = s.static_local;
          rule.vert_stride = s.vert_stride;
          full = rule.kept_blocks(h, (own + 1) * s.bs) - 1;
        }
        for (int32_t t = first; t < last; ++t) f += 4.0 * s.dim * static_cast<double>(full * s.bs + (t - first) + 1);
      }
      if (s.indexed)
        f += 2.0 * s.dim * s.hkv * static_cast<double>(std::max<int64_t>(0, own + 1 - s.local_blocks)) * s.bs *
             (last - first);
    }
    return f;
  };
  c.bytes = [&s](int64_t kv_len) {
    const double n = s.chunk;
    double b = 2.0 * n * s.hq * s.dim * 2                                                     // queries, outputs
               + 2.0 * static_cast<double>(kv_len) * s.hkv * s.dim * (s.fp8 ? 1 : 2);         // every K and V row once
    if (s.indexed) b += 2.0 * static_cast<double>(kv_len) * s.dim + 2.0 * n * s.hkv * s.dim;  // index keys, queries
    return b;
  };
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"sparse_prefill_bench: time to prefill a prompt in chunks with sparse prefill"};
  app.add_option("--kinds", opt.kinds, "dsa, dsa-fp8, blocksparse, blocksparse-fp8, static");
  app.add_option("--prompts", opt.prompts, "prompt lengths (tokens)");
  app.add_option("--chunks", opt.chunks, "chunk sizes (tokens)");
  app.add_option("--reps", opt.reps, "timed replays per chunk (median)");
  app.add_option("--topk", opt.topk, "DSA index_topk");
  app.add_option("--index-budget-mb", opt.index_budget_mb, "DSA indexer scratch (MiB): sets its tokens per pass");
  app.add_option("--peak-tflops", opt.peak_tflops, "dense bf16 peak for the FLOP floor");
  app.add_flag("--cpu", opt.cpu, "run on the CPU backend (small shapes only)");
  app.add_option("--json", opt.json_path, "write the results as JSON here");
  CLI11_PARSE(app, argc, argv);
  const Device device = opt.cpu || !cuda_available() ? Device::kCpu : Device::kCuda;
  if (device == Device::kCpu && !opt.cpu) std::printf("no CUDA device: running on the CPU backend\n");
  if (device == Device::kCpu) {  // the CPU backend prefills a 128K prompt in hours: small shapes unless asked
    if (app.count("--prompts") == 0) opt.prompts = {1024};
    if (app.count("--chunks") == 0) opt.chunks = {512};
    if (app.count("--topk") == 0) opt.topk = 128;
    if (app.count("--reps") == 0) opt.reps = 1;
    std::printf("CPU backend: prompts of %lld tokens in chunks of %d, top-%d, %d rep(s) (--prompts, --chunks, --topk, "
                "--reps to change)\n",
                static_cast<long long>(opt.prompts.front()), opt.chunks.front(), opt.topk, opt.reps);
  }
  const bench::DeviceFacts facts = bench::device_facts(device);
  const double read_gbs = device == Device::kCuda ? bench::measured_read_bandwidth_gbs(device, int64_t{2} << 30) : 0.0;
  if (device == Device::kCuda) {
    std::printf("device: %s; measured read bandwidth %.0f GB/s; FLOP floor at %.0f TFLOP/s\n", facts.name.c_str(),
                read_gbs, opt.peak_tflops);
  } else {  // a GPU's floors say nothing of a CPU's time
    std::printf("device: %s; no read or FLOP floors on the CPU backend\n", facts.name.c_str());
  }
  json results = json::array();
  int failures = 0;
  for (const std::string& kind : opt.kinds) {
    const bool is_dsa = kind == "dsa" || kind == "dsa-fp8";
    if (!is_dsa && kind != "blocksparse" && kind != "blocksparse-fp8" && kind != "static") {
      std::fprintf(stderr, "unknown kind '%s' (dsa, dsa-fp8, blocksparse, blocksparse-fp8, static)\n", kind.c_str());
      return 2;
    }
    for (int64_t prompt : opt.prompts) {
      for (int32_t chunk : opt.chunks) {
        if (chunk > prompt || prompt % chunk != 0) continue;
        DsaSetup dsa;
        GqaSetup gqa;
        Config config;
        if (is_dsa) {
          dsa.device = device;
          dsa.fp8_keys = kind == "dsa-fp8";
          dsa.prompt = prompt;
          dsa.chunk = chunk;
          dsa.topk = opt.topk;
          dsa.index_budget = static_cast<size_t>(opt.index_budget_mb) << 20;
          config = dsa_config(dsa);
        } else {
          gqa.device = device;
          gqa.indexed = kind == "blocksparse" || kind == "blocksparse-fp8";
          gqa.fp8 = kind == "blocksparse-fp8";
          gqa.prompt = prompt;
          gqa.chunk = chunk;
          if (gqa.indexed) {  // MiniMax-style block sparse: 64 heads over 4, dim 128, blocks of 128, top 16
            gqa.hq = 64, gqa.hkv = 4, gqa.dim = 128, gqa.bs = 128;
          } else {  // Phi-3-small: 32 heads over 8, dim 128, blocks of 64, 16 local, stride 8
            gqa.hq = 32, gqa.hkv = 8, gqa.dim = 128, gqa.bs = 64;
          }
          config = gqa_config(gqa);
        }
        ChunkTimer timer(device, [&config](void* stream) { config.run(stream); });
        // Correctness first, at the last chunk (the longest context).
        config.place(prompt);
        timer.replay();
        const std::string problem = config.check(prompt);
        const std::string passes =
            is_dsa ? ", indexer " + std::to_string(dsa.indexer->rows_per_pass()) + " tokens per pass" : "";
        std::printf("%-15s prompt %7lld chunk %6d | %s%s | check: %s\n", kind.c_str(), static_cast<long long>(prompt),
                    chunk, config.kernel().c_str(), passes.c_str(), problem.empty() ? "ok" : problem.c_str());
        if (!problem.empty()) {
          ++failures;
          continue;  // never time a configuration that is wrong
        }
        double total_us = 0, flops = 0, bytes = 0;
        json chunks = json::array();
        for (int64_t end = chunk; end <= prompt; end += chunk) {
          config.place(end);
          const double us = timer.median_us(opt.reps);
          const double f = config.flops(end), b = config.bytes(end);
          total_us += us;
          flops += f;
          bytes += b;
          chunks.push_back({{"kv_len", end}, {"us", us}, {"flops", f}, {"bytes", b}});
        }
        // The parts of the last chunk (the longest context), each replayed alone.
        config.place(prompt);
        json phases = json::object();
        std::string phase_line;
        for (const auto& [name, run] : config.phases) {
          ChunkTimer part(device, run);
          const double us = part.median_us(opt.reps);
          phases[name] = us;
          phase_line += " " + name + " " + format_ms(us);
        }
        const double flop_floor_us = flops / (opt.peak_tflops * 1e6);
        const double read_floor_us = read_gbs > 0 ? bytes / (read_gbs * 1e3) : 0.0;
        if (device == Device::kCuda) {
          std::printf(
              "%-15s prompt %7lld chunk %6d | %10.1f ms | %6.1f TFLOP/s | floors: FLOP %8.1f ms, read %8.1f ms\n",
              kind.c_str(), static_cast<long long>(prompt), chunk, total_us / 1e3, flops / (total_us * 1e6),
              flop_floor_us / 1e3, read_floor_us / 1e3);
        } else {
          std::printf("%-15s prompt %7lld chunk %6d | %10.1f ms | %.3g GFLOP/s\n", kind.c_str(),
                      static_cast<long long>(prompt), chunk, total_us / 1e3, flops / (total_us * 1e3));
        }
        std::printf("%-15s prompt %7lld chunk %6d | last chunk alone:%s\n", kind.c_str(),
                    static_cast<long long>(prompt), chunk, phase_line.c_str());
        results.push_back({{"kind", kind},
                           {"prompt", prompt},
                           {"chunk", chunk},
                           {"device", facts.name},
                           {"kernel", config.kernel()},
                           {"index_rows_per_pass", is_dsa ? dsa.indexer->rows_per_pass() : 0},
                           {"total_us", total_us},
                           {"flops", flops},
                           {"bytes", bytes},
                           {"flop_floor_us", flop_floor_us},
                           {"read_floor_us", read_floor_us},
                           {"read_gbs", read_gbs},
                           {"last_chunk_phases_us", phases},
                           {"chunks", chunks}});
      }
    }
  }
  if (!opt.json_path.empty()) {
    std::ofstream(opt.json_path) << results.dump(2) << "\n";
    std::printf("wrote %s\n", opt.json_path.c_str());
  }
  if (failures > 0) {
    std::printf("REFUSED: %d configuration(s) failed their check and were not timed\n", failures);
    return 1;
  }
  return 0;
}
