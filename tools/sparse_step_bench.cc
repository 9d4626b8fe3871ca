// sparse_step_bench: whole decode steps of the block-sparse, DSA and static
// block-sparse layers as a serving loop runs them — append, indexer (or the
// static pattern's page matrix), attention — one step after
// another with the context growing by one token per step, eager and
// replayed from a CUDA graph. Beside each step it shows the attention
// kernel alone over the same selection, the mask-path step over the same
// cache (the fallback a user would otherwise run), and the read-time floor
// (bytes the step must read / the device's measured read bandwidth).
//
// Guards: it names the path each step took; it refuses a comparison when
// the fused step did not fuse; and before timing it checks that the fused
// step and the mask-path step agree on a sampled step.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench_device.h"
#include "sparsepage/fp8.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"

using namespace sparsepage;
using json = nlohmann::json;

namespace {

// The exit status of a run that does not apply here (bench.sh reports it as skipped).
constexpr int kSkipped = 77;

struct Options {
  std::vector<std::string> layers = {"blocksparse", "dsa", "static"};
  std::vector<int32_t> batches;   // empty: the backend's default set
  std::vector<int64_t> contexts;  // empty: the backend's default set
  int32_t steps = 16;             // steps per timed run (the context grows by this much)
  int32_t reps = 5;               // timed runs; the median is reported
  bool cpu = false;
  int32_t q_len = 1;    // query tokens per sequence per step (multi-token steps)
  std::string pools;    // dsa, blocksparse: "fp8" or "bf16": the step over engine-owned pools (KVStorage::kEnginePools)
  bool ragged = false;  // also a ragged batch (lengths spread from 1K to the context) beside the
                        // uniform batch of the same total tokens
  std::string json_path;
};

/// One layer under test: how to fill it, step it and read its output.
struct Arm {
  std::function<void(int64_t tokens, uint64_t seed)> fill;                 // append random tokens (no attention)
  std::function<void(int32_t slot, int64_t tokens, uint64_t seed)> admit;  // one slot's random prompt
  std::function<std::pair<bool, std::string>(void* stream)> step;          // one decode: fused?, outcome
  std::function<std::vector<float>()> output;                              // the last step's output
  std::function<void(void*, void*)> phase_events;
  std::function<void(int64_t)> reserve;
};

std::vector<float> read_bf16(Device device, const Buffer& b) {
  const auto bytes = download<uint8_t>(device, b.data(), b.bytes());
  std::vector<float> out(bytes.size() / 2);
  to_float(DType::kBF16, bytes.data(), out.data(), out.size());
  return out;
}

/// ||a - b|| / ||b||; +inf when either holds a NaN or inf, or when b is all
/// zero (an output that was never written must not pass as agreement).
double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : INFINITY;
}

/// Random device buffers of the given byte sizes (bf16 unless f32 is set).
std::vector<Buffer> random_buffers(Device device, const std::vector<size_t>& bytes, const std::vector<bool>& f32,
                                   uint64_t seed) {
  std::vector<Buffer> out;
  for (size_t i = 0; i < bytes.size(); ++i) {
    out.emplace_back(device, bytes[i]);
    const DType t = f32[i] ? DType::kF32 : DType::kBF16;
    bench::fill_random(device, t, out.back().data(), static_cast<int64_t>(bytes[i] / dtype_size(t)), seed + i);
  }
  return out;
}

/// Admits a random prompt of `tokens` rows into `slot` of a layer, in its
/// cache layout (k [k_heads, tokens, k_dim], v likewise).
void admit_random(SparseLayer& layer, Device device, int32_t slot, int64_t tokens, uint64_t seed) {
  const DenseKVCache& c = layer.cache();
  const auto kn = static_cast<int64_t>(c.k_heads()) * tokens * c.k_head_dim();
  const auto vn = static_cast<int64_t>(c.v_heads()) * tokens * c.v_head_dim();
  Buffer k(device, static_cast<size_t>(kn) * 2), v(device, static_cast<size_t>(std::max<int64_t>(vn, 1)) * 2);
  bench::fill_random(device, DType::kBF16, k.data(), kn, seed);
  if (vn > 0) bench::fill_random(device, DType::kBF16, v.data(), vn, seed + 1);
  layer.admit(slot, k.data(), vn > 0 ? v.data() : nullptr, tokens);
}

/// Appends `tokens` random prompt tokens to every one of `batch` slots, 4096
/// at a time: K rows of `k_width` and V rows of `v_width` values per token.
void append_random(SparseLayer& layer, Device device, size_t batch, size_t k_width, size_t v_width, int64_t tokens,
                   uint64_t seed) {
  const int64_t chunk = 4096;
  Buffer k(device, batch * static_cast<size_t>(chunk) * k_width * 2);
  Buffer v(device, batch * static_cast<size_t>(chunk) * v_width * 2);
  for (int64_t at = 0; at < tokens; at += chunk) {
    const int64_t n = std::min(chunk, tokens - at);
    bench::fill_random(device, DType::kBF16, k.data(), static_cast<int64_t>(batch * n * k_width),
                       seed + static_cast<uint64_t>(2 * at));
    bench::fill_random(device, DType::kBF16, v.data(), static_cast<int64_t>(batch * n * v_width),
                       seed + static_cast<uint64_t>(2 * at + 1));
    layer.append_tokens(k.data(), v.data(), n);
  }
}

/// The hooks every arm has over its layer `s.layer` and output `s.o`, and
/// (`slots`: the arms whose layer keeps its sequences) reserve and admit.
template <class Setup>
void layer_hooks(Arm& arm, Setup& s, Device device, bool slots) {
  arm.output = [&s, device] { return read_bf16(device, s.o); };
  arm.phase_events = [&s](void* a, void* b2) { s.layer->set_phase_events(a, b2); };
  if (!slots) return;
  arm.reserve = [&s](int64_t n) { s.layer->reserve(n); };
  arm.admit = [&s, device](int32_t slot, int64_t n, uint64_t seed) { admit_random(*s.layer, device, slot, n, seed); };
}

// ---- block-sparse ---------------------------------------------------------

struct BlockSparseSetup {
  BlockSparseConfig config{64, 4, 128, 128, 16, 1, 4096};
  std::unique_ptr<BlockSparseAttention> layer;
  std::vector<Buffer> tokens;  // q, index_q, k, v
  Buffer o;
};

Arm block_sparse_arm(BlockSparseSetup& s, Device device, int32_t batch, DispatchConfig dispatch, int32_t q_len) {
  const auto& c = s.config;
  // A step's q_len tokens: [batch, q_len, heads, dim] queries, token-major K/V slices.
  const size_t b = static_cast<size_t>(batch) * q_len, d = static_cast<size_t>(c.head_dim);
  s.layer = std::make_unique<BlockSparseAttention>(device, DType::kBF16, c, batch, dispatch);
  s.tokens = random_buffers(device,
                            {b * c.num_qo_heads * d * 2, b * c.num_kv_heads * d * 2, b * (c.num_kv_heads + 1) * d * 2,
                             b * c.num_kv_heads * d * 2},
                            {false, false, false, false}, 77);
  s.o = Buffer(device, b * c.num_qo_heads * d * 2);
  Arm arm;
  arm.fill = [&s, device, b = static_cast<size_t>(batch), d](int64_t tokens, uint64_t seed) {
    append_random(*s.layer, device, b, (s.config.num_kv_heads + 1) * d, s.config.num_kv_heads * d, tokens, seed);
  };
  arm.step = [&s, q_len](void* stream) {
    const BlockSparseTokens t{s.tokens[0].data(), s.tokens[1].data(), s.tokens[2].data(), s.tokens[3].data(),
                              s.o.data()};
    const LayerStep r = s.layer->decode(t, q_len, stream);
    return std::make_pair(r.fused, r.sparse ? r.outcome.describe() : std::string("dense (below the sparse regime)"));
  };
  layer_hooks(arm, s, device, true);
  return arm;
}

/// Bytes a block-sparse step must read: every index key of the window and
/// the selected K and V rows of every request.
double block_sparse_bytes(const BlockSparseConfig& c, int32_t batch, int64_t context) {
  const double selected = double(c.topk_blocks) * c.block_size + 1;
  return double(batch) * double(context) * c.head_dim * 2 +
         double(batch) * c.num_kv_heads * selected * 2.0 * c.head_dim * 2;
}

// ---- DSA ------------------------------------------------------------------

struct DsaSetup {
  DsaConfig config{128, 512, 64, 64, 128, 2048, 0.0f, 4096};
  std::unique_ptr<DsaAttention> layer;
  std::vector<Buffer> tokens;  // q_latent, q_pe, q_index, weights, k_cache_row, k_pe
  Buffer o;
};

Arm dsa_arm(DsaSetup& s, Device device, int32_t batch, DispatchConfig dispatch, int32_t q_len) {
  const auto& c = s.config;
  const size_t b = static_cast<size_t>(batch) * q_len, h = static_cast<size_t>(c.num_qo_heads);
  s.layer = std::make_unique<DsaAttention>(device, DType::kBF16, c, batch, dispatch);
  const size_t row = static_cast<size_t>(c.latent_dim + c.index_head_dim);
  s.tokens = random_buffers(device,
                            {b * h * c.latent_dim * 2, b * h * c.rope_dim * 2, b * c.index_heads * c.index_head_dim * 2,
                             b * c.index_heads * 4, b * row * 2, b * c.rope_dim * 2},
                            {false, false, false, true, false, false}, 91);
  s.o = Buffer(device, b * h * c.latent_dim * 2);
  Arm arm;
  arm.fill = [&s, device, b = static_cast<size_t>(batch), row](int64_t tokens, uint64_t seed) {
    append_random(*s.layer, device, b, row, s.config.rope_dim, tokens, seed);
  };
  arm.step = [&s, q_len](void* stream) {
    const DsaTokens t{s.tokens[0].data(), s.tokens[1].data(), s.tokens[2].data(), s.tokens[3].as<float>(),
                      s.tokens[4].data(), s.tokens[5].data(), s.o.data()};
    const LayerStep r = s.layer->decode(t, q_len, stream);
    return std::make_pair(r.fused, r.outcome.describe());
  };
  layer_hooks(arm, s, device, true);
  return arm;
}

/// Bytes a DSA step must read: the index key of every position and the
/// selected rows (latent + rope).
double dsa_bytes(const DsaConfig& c, int32_t batch, int64_t context) {
  const double selected = std::min<double>(c.index_topk, double(context));
  return double(batch) * double(context) * c.index_head_dim * 2 +
         double(batch) * selected * (c.latent_dim + c.rope_dim) * 2;
}

// ---- DSA over engine-owned pools ---------------------------------------------

/// The engine's pools of one copy: MLA rows (656-byte FP8 or bf16 576-wide)
/// and index keys (vLLM's FP8 blocks or bf16) behind a shuffled block table.
struct DsaPools {
  Buffer mla, keys, table, lens;
  EnginePagedKV kv;
  std::vector<int32_t> host_table;
  int64_t row_bytes = 0;
};

struct DsaPoolsSetup {
  DsaConfig config{128, 512, 64, 64, 128, 2048, 0.0f, 4096};
  std::unique_ptr<DsaAttention> layer;
  std::vector<DsaPools> copies;  // rotated step by step, so a step reads cold rows
  std::vector<Buffer> tokens;    // q_latent, q_pe, q_index, weights
  Buffer o;
  size_t next = 0;
  bool fp8 = true;
  std::vector<int64_t> lens;
};

constexpr int32_t kPoolBlock = 64;

// The engine's block table (one for the rows and the index keys), its
// lengths and its key pool, as both pools setups pass them.
void set_engine_tables(EnginePagedKV& kv, const Buffer& table, const Buffer& lens, int32_t batch, int32_t max_blocks,
                       int64_t num_blocks, int64_t max_len, const PagedIndexKeys& keys) {
  kv.block_table.data = table.as<int32_t>();
  kv.block_table.num_rows = batch;
  kv.block_table.max_blocks = max_blocks;
  kv.block_table.row_stride = max_blocks;
  kv.block_table.block_size = kPoolBlock;
  kv.block_table.num_blocks = num_blocks;
  kv.seq_lens = lens.as<int32_t>();
  kv.max_seq_len = max_len;
  kv.index_keys = keys;
  kv.index_keys.block_table = table.as<int32_t>();
  kv.index_keys.block_table_stride = max_blocks;
  kv.index_keys.max_blocks = max_blocks;
}

// Pool copies rotated among replays: enough that one replay's distinct rows
// and keys (`bytes` a copy) exceed 150 MB, 2.5x the L2; at most 16.
int64_t pool_copies(int64_t bytes) {
  return std::clamp<int64_t>((int64_t{150} << 20) / std::max<int64_t>(bytes, 1) + 1, 1, 16);
}

// The engine's block table: each sequence's blocks drawn from a shuffled
// free list of a pool with 8 spare blocks (what an allocator hands out after
// churn), as both pools setups build it; rows of max_blocks entries.
struct ShuffledTable {
  std::vector<int32_t> host;
  int64_t max_len = 0, num_blocks = 0;
  int32_t max_blocks = 0;
};

ShuffledTable shuffled_block_table(const std::vector<int64_t>& lens, uint64_t seed) {
  ShuffledTable t;
  t.max_len = *std::max_element(lens.begin(), lens.end());
  t.max_blocks = static_cast<int32_t>((t.max_len + kPoolBlock - 1) / kPoolBlock);
  int64_t used = 0;
  for (int64_t len : lens) used += (len + kPoolBlock - 1) / kPoolBlock;
  t.num_blocks = used + 8;
  std::vector<int32_t> ids(static_cast<size_t>(t.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  t.host.assign(lens.size() * static_cast<size_t>(t.max_blocks), 0);
  size_t next = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int64_t j = 0; j < (lens[b] + kPoolBlock - 1) / kPoolBlock; ++j) {
      t.host[b * static_cast<size_t>(t.max_blocks) + static_cast<size_t>(j)] = ids[next++];
    }
  }
  return t;
}

/// An engine's index-key pool in `pool` (vLLM's FP8 blocks, or bf16 rows of
/// `dim`) of num_blocks blocks, every slot a random key written by the
/// engine's write op (slot = row), in chunks of whole blocks.
PagedIndexKeys random_index_keys(Device device, Buffer& pool, bool fp8, int64_t num_blocks, int32_t dim,
                                 uint64_t seed) {
  const int64_t rows = num_blocks * kPoolBlock;
  const int64_t key_bytes = fp8 ? IndexKeyFp8::kTokenBytes : int64_t{dim} * 2;
  pool = Buffer(device, static_cast<size_t>(rows * key_bytes));
  PagedIndexKeys keys;
  keys.format = fp8 ? IndexKeyFormat::kE4m3 : IndexKeyFormat::kNative;
  keys.pool = pool.data();
  keys.num_blocks = num_blocks;
  keys.block_size = kPoolBlock;
  keys.dtype = DType::kBF16;
  const int64_t chunk = int64_t{1} << 18;
  Buffer src(device, static_cast<size_t>(chunk) * dim * 2);
  std::vector<int64_t> slots(static_cast<size_t>(chunk));
  for (int64_t at = 0; at < rows; at += chunk) {
    const int64_t n = std::min(chunk, rows - at);
    bench::fill_random(device, DType::kBF16, src.data(), n * dim, seed + 7 + static_cast<uint64_t>(at));
    for (int64_t i = 0; i < n; ++i) slots[static_cast<size_t>(i)] = at + i;
    const Buffer d_slots = upload(device, slots);
    write_index_keys_cuda(keys, dim, DType::kBF16, src.data(), dim, d_slots.as<int64_t>(), n);
  }
  return keys;
}

void build_pools(DsaPoolsSetup& s, Device device, DsaPools& p, uint64_t seed) {
  const int32_t batch = static_cast<int32_t>(s.lens.size());
  const ShuffledTable table = shuffled_block_table(s.lens, seed);
  const int64_t max_len = table.max_len, num_blocks = table.num_blocks;
  const int32_t max_blocks = table.max_blocks;
  p.host_table = table.host;
  const int64_t rows = num_blocks * kPoolBlock;
  p.row_bytes = s.fp8 ? MlaFp8Row::kBytes : 576 * 2;
  p.mla = Buffer(device, static_cast<size_t>(rows * p.row_bytes));
  const PagedIndexKeys keys = random_index_keys(device, p.keys, s.fp8, num_blocks, 128, seed);
  // Random rows, quantized or copied in chunks of whole blocks.
  const int64_t chunk = int64_t{1} << 18;
  Buffer src(device, static_cast<size_t>(chunk) * 576 * 2);
  for (int64_t at = 0; at < rows; at += chunk) {
    const int64_t n = std::min(chunk, rows - at);
    bench::fill_random(device, DType::kBF16, src.data(), n * 576, seed + static_cast<uint64_t>(at));
    if (s.fp8) {
      quantize_mla_fp8_cuda(DType::kBF16, src.data(), n, 576, static_cast<char*>(p.mla.data()) + at * p.row_bytes,
                            p.row_bytes);
    } else {
      copy_bytes(static_cast<char*>(p.mla.data()) + at * p.row_bytes, device, src.data(), device,
                 static_cast<size_t>(n * p.row_bytes));
    }
  }
  p.table = upload(device, p.host_table);
  p.lens = upload(device, std::vector<int32_t>(s.lens.begin(), s.lens.end()));
  EnginePagedKV& kv = p.kv;
  if (s.fp8) {
    const MlaFp8Views v = mla_fp8_views(p.mla.data(), rows, p.row_bytes);
    kv.k = v.k;
    kv.v = v.v;
    kv.k_extra = v.k_extra;
    kv.kv_format = KvFormat::kE4m3Mla;
  } else {
    kv.k = RowView::dense(p.mla.data(), 1, rows, 512);
    kv.k.row_stride = 576;
    kv.k.seq_stride = 0;
    kv.v = kv.k;
    kv.k_extra = kv.k;
    kv.k_extra.data = static_cast<const char*>(p.mla.data()) + 512 * 2;
    kv.k_extra.dim = 64;
  }
  set_engine_tables(kv, p.table, p.lens, batch, max_blocks, num_blocks, max_len, keys);
}

Arm dsa_pools_arm(DsaPoolsSetup& s, Device device, const std::vector<int64_t>& lens, bool fp8) {
  auto& c = s.config;
  c.kv_storage = KVStorage::kEnginePools;
  s.fp8 = fp8;
  s.lens = lens;
  const size_t b = lens.size(), h = static_cast<size_t>(c.num_qo_heads);
  s.layer = std::make_unique<DsaAttention>(device, DType::kBF16, c, static_cast<int32_t>(b));
  s.tokens = random_buffers(device, {b * h * 512 * 2, b * h * 64 * 2, b * 64 * 128 * 2, b * 64 * 4},
                            {false, false, false, true}, 93);
  s.o = Buffer(device, b * h * 512 * 2);
  int64_t bytes = 0;  // one copy's rows and keys
  for (int64_t len : lens) bytes += len * ((fp8 ? 656 : 1152) + (fp8 ? 132 : 256));
  const int64_t copies = pool_copies(bytes);
  s.copies.resize(static_cast<size_t>(copies));
  for (size_t i = 0; i < s.copies.size(); ++i) build_pools(s, device, s.copies[i], 500 + 31 * i);
  s.layer->reserve(*std::max_element(lens.begin(), lens.end()));
  Arm arm;
  arm.step = [&s](void* stream) {
    DsaTokens t;
    t.q_latent = s.tokens[0].data();
    t.q_pe = s.tokens[1].data();
    t.q_index = s.tokens[2].data();
    t.index_weights = s.tokens[3].as<float>();
    t.o = s.o.data();
    const DsaPools& p = s.copies[s.next++ % s.copies.size()];
    const LayerStep r = s.layer->decode(t, p.kv, stream);
    return std::make_pair(r.fused, r.outcome.describe());
  };
  layer_hooks(arm, s, device, false);
  return arm;
}

/// The last pools step against fp64 attention over its own selected
/// positions, for the first and the last sequence and two heads each, the
/// rows read back one by one and dequantized: the relative L2 error (worst).
// The relative L2 error of one output row `o` (dim values) against the fp64
// softmax over `scores` (already scaled) of the kept rows' values
// value(j, i); INFINITY when an output is not finite or the reference is
// zero and the output is not.
template <typename Value>
double softmax_row_error(const std::vector<double>& scores, int32_t dim, Value&& value, const float* o) {
  double mx = -INFINITY, sum = 0, diff = 0, norm = 0;
  for (double x : scores) mx = std::max(mx, x);
  std::vector<double> ref(static_cast<size_t>(dim), 0.0);
  for (size_t j = 0; j < scores.size(); ++j) {
    const double w = std::exp(scores[j] - mx);
    sum += w;
    for (int32_t i = 0; i < dim; ++i) ref[static_cast<size_t>(i)] += w * value(j, i);
  }
  for (int32_t i = 0; i < dim; ++i) {
    const double r = scores.empty() ? 0.0 : ref[static_cast<size_t>(i)] / sum;
    const double g = o[i];
    if (!std::isfinite(g)) return INFINITY;
    diff += (g - r) * (g - r);
    norm += r * r;
  }
  return norm > 0 ? std::sqrt(diff / norm) : (diff > 0 ? INFINITY : 0.0);
}

double dsa_pools_check(DsaPoolsSetup& s, Device device) {
  const DsaPools& p = s.copies[(s.next + s.copies.size() - 1) % s.copies.size()];
  const auto selected = s.layer->last_selected_positions();
  const auto o = read_bf16(device, s.o);
  const auto q = download<uint16_t>(device, s.tokens[0].data(), s.tokens[0].bytes() / 2);
  const auto q_pe = download<uint16_t>(device, s.tokens[1].data(), s.tokens[1].bytes() / 2);
  const int32_t h_count = s.config.num_qo_heads, batch = static_cast<int32_t>(s.lens.size());
  const int32_t max_blocks = p.kv.block_table.max_blocks;
  const float scale = 1.0f / std::sqrt(576.0f);
  double worst = 0;
  for (int32_t b : {0, batch - 1}) {
    std::vector<std::vector<uint8_t>> rows;
    for (int32_t pos : selected[static_cast<size_t>(b)]) {
      const int64_t slot =
          int64_t{p.host_table[static_cast<size_t>(b) * max_blocks + pos / kPoolBlock]} * kPoolBlock + pos % kPoolBlock;
      rows.push_back(download<uint8_t>(device, static_cast<const char*>(p.mla.data()) + slot * p.row_bytes,
                                       static_cast<size_t>(p.row_bytes)));
    }
    const auto value = [&](const std::vector<uint8_t>& r, int col) -> double {
      if (!s.fp8) return bf16_to_float(reinterpret_cast<const uint16_t*>(r.data())[col]);
      if (col >= 512) return bf16_to_float(reinterpret_cast<const uint16_t*>(r.data() + 528)[col - 512]);
      float sc;
      std::memcpy(&sc, r.data() + 512 + 4 * (col / 128), 4);
      const uint8_t x = r[static_cast<size_t>(col)];
      const int e = (x >> 3) & 0xF, m = x & 7;
      const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
      return ((x >> 7) ? -mag : mag) * sc;
    };
    for (int32_t h : {0, h_count - 1}) {
      std::vector<double> sc;
      for (const auto& r : rows) {
        double dot = 0;
        for (int i = 0; i < 576; ++i) {
          const uint16_t qv = i < 512 ? q[static_cast<size_t>((b * h_count + h) * 512 + i)]
                                      : q_pe[static_cast<size_t>((b * h_count + h) * 64 + i - 512)];
          dot += double(bf16_to_float(qv)) * value(r, i);
        }
        sc.push_back(dot * scale);
      }
      const double err = softmax_row_error(
          sc, 512, [&](size_t j, int32_t i) { return value(rows[j], i); },
          &o[static_cast<size_t>((b * h_count + h) * 512)]);
      if (!std::isfinite(err)) return err;
      worst = std::max(worst, err);
    }
  }
  return worst;
}

// ---- block-sparse over engine-owned pools ------------------------------------

/// One copy of the engine's pools for the block-sparse step: K and V
/// [num_blocks, 64, 4, 128] bf16 and the index keys (vLLM's FP8 blocks or
/// bf16 rows) behind one shuffled block table.
struct BlockPools {
  Buffer k, v, keys, table, lens;
  EnginePagedKV kv;
  std::vector<int32_t> host_table;
};

struct BlockPoolsSetup {
  BlockSparseConfig config{64, 4, 128, 128, 16, 1, 4096};
  std::unique_ptr<BlockSparseAttention> layer;
  std::vector<BlockPools> copies;  // rotated step by step, so a step reads cold rows
  std::vector<Buffer> tokens;      // q, index_q
  Buffer o;
  size_t next = 0;
  bool fp8 = true;
  std::vector<int64_t> lens;
};

void build_block_pools(BlockPoolsSetup& s, Device device, BlockPools& p, uint64_t seed) {
  const auto& c = s.config;
  const int32_t batch = static_cast<int32_t>(s.lens.size());
  const ShuffledTable table = shuffled_block_table(s.lens, seed);
  const int64_t max_len = table.max_len, num_blocks = table.num_blocks;
  const int32_t max_blocks = table.max_blocks;
  p.host_table = table.host;
  const int64_t rows = num_blocks * kPoolBlock, row_elems = int64_t{c.num_kv_heads} * c.head_dim;
  p.k = Buffer(device, static_cast<size_t>(rows * row_elems * 2));
  p.v = Buffer(device, static_cast<size_t>(rows * row_elems * 2));
  bench::fill_random(device, DType::kBF16, p.k.data(), rows * row_elems, seed + 1);
  bench::fill_random(device, DType::kBF16, p.v.data(), rows * row_elems, seed + 2);
  const PagedIndexKeys keys = random_index_keys(device, p.keys, s.fp8, num_blocks, c.head_dim, seed);
  p.table = upload(device, p.host_table);
  p.lens = upload(device, std::vector<int32_t>(s.lens.begin(), s.lens.end()));
  EnginePagedKV& kv = p.kv;
  for (auto [view, data] : {std::pair<RowView*, const Buffer*>{&kv.k, &p.k}, {&kv.v, &p.v}}) {
    view->data = data->data();
    view->row_stride = row_elems;
    view->dim = c.head_dim;
    view->head_stride = c.head_dim;
    view->capacity = rows;
  }
  set_engine_tables(kv, p.table, p.lens, batch, max_blocks, num_blocks, max_len, keys);
}

Arm block_pools_arm(BlockPoolsSetup& s, Device device, const std::vector<int64_t>& lens, bool fp8) {
  auto& c = s.config;
  c.kv_storage = KVStorage::kEnginePools;
  s.fp8 = fp8;
  s.lens = lens;
  const size_t b = lens.size(), d = static_cast<size_t>(c.head_dim);
  s.layer = std::make_unique<BlockSparseAttention>(device, DType::kBF16, c, static_cast<int32_t>(b));
  s.tokens = random_buffers(device, {b * c.num_qo_heads * d * 2, b * c.num_kv_heads * d * 2}, {false, false}, 95);
  s.o = Buffer(device, b * c.num_qo_heads * d * 2);
  int64_t bytes = 0;  // one copy's rows and keys
  for (int64_t len : lens) bytes += len * ((fp8 ? 132 : 256) + 2 * c.num_kv_heads * c.head_dim * 2);
  const int64_t copies = pool_copies(bytes);
  s.copies.resize(static_cast<size_t>(copies));
  for (size_t i = 0; i < s.copies.size(); ++i) build_block_pools(s, device, s.copies[i], 700 + 31 * i);
  s.layer->reserve(*std::max_element(lens.begin(), lens.end()));
  Arm arm;
  arm.step = [&s](void* stream) {
    BlockSparseTokens t;
    t.q = s.tokens[0].data();
    t.index_q = s.tokens[1].data();
    t.o = s.o.data();
    const BlockPools& p = s.copies[s.next++ % s.copies.size()];
    const LayerStep r = s.layer->decode(t, p.kv, stream);
    return std::make_pair(r.fused, r.outcome.describe());
  };
  layer_hooks(arm, s, device, false);
  return arm;
}

/// The last block-sparse pools step against fp64 attention over its kept
/// blocks, for the first and the last sequence and the first and last query
/// head each, the K/V rows read back through the table: the worst relative L2.
double block_pools_check(BlockPoolsSetup& s, Device device) {
  const BlockPools& p = s.copies[(s.next + s.copies.size() - 1) % s.copies.size()];
  const auto& c = s.config;
  const auto blocks = s.layer->last_blocks();
  const auto o = read_bf16(device, s.o);
  const auto q = download<uint16_t>(device, s.tokens[0].data(), s.tokens[0].bytes() / 2);
  const int32_t batch = static_cast<int32_t>(s.lens.size()), d = c.head_dim, hk = c.num_kv_heads;
  const int32_t max_blocks = p.kv.block_table.max_blocks;
  double worst = 0;
  for (int32_t b : {0, batch - 1}) {
    const int64_t len = s.lens[static_cast<size_t>(b)];
    for (int32_t h : {0, c.num_qo_heads - 1}) {
      const int32_t kvh = h / c.group_size();
      std::vector<double> sc;
      std::vector<std::vector<uint16_t>> vs;
      for (int32_t blk : blocks[static_cast<size_t>(b * hk + kvh)]) {
        for (int64_t pos = int64_t{blk} * c.block_size; pos < std::min<int64_t>(len, int64_t{blk + 1} * c.block_size);
             ++pos) {
          const int64_t row =
              int64_t{p.host_table[static_cast<size_t>(b) * max_blocks + pos / kPoolBlock]} * kPoolBlock +
              pos % kPoolBlock;
          const size_t at = static_cast<size_t>((row * hk + kvh) * d) * 2;
          const auto k = download<uint16_t>(device, static_cast<const char*>(p.k.data()) + at, static_cast<size_t>(d));
          vs.push_back(download<uint16_t>(device, static_cast<const char*>(p.v.data()) + at, static_cast<size_t>(d)));
          double dot = 0;
          for (int32_t i = 0; i < d; ++i) {
            dot += double(bf16_to_float(q[static_cast<size_t>((b * c.num_qo_heads + h) * d + i)])) *
                   bf16_to_float(k[static_cast<size_t>(i)]);
          }
          sc.push_back(dot / std::sqrt(double(d)));
        }
      }
      const double err = softmax_row_error(
          sc, d, [&](size_t j, int32_t i) { return double(bf16_to_float(vs[j][static_cast<size_t>(i)])); },
          &o[static_cast<size_t>((b * c.num_qo_heads + h) * d)]);
      if (!std::isfinite(err)) return err;
      worst = std::max(worst, err);
    }
  }
  return worst;
}

// ---- static per-query-head block-sparse (Phi-3-small) -------------------------

struct StaticSetup {
  StaticBlockSparseConfig config;  // Phi-3-small: 32 query heads over 8, head dim 128, blocks of 64, 16 local, stride 8
  std::unique_ptr<StaticBlockSparseAttention> layer;
  std::vector<Buffer> tokens;  // q, k, v
  Buffer o;
};

Arm static_arm(StaticSetup& s, Device device, int32_t batch, DispatchConfig dispatch) {
  const auto& c = s.config;
  const size_t b = static_cast<size_t>(batch), d = static_cast<size_t>(c.head_dim);
  s.layer = std::make_unique<StaticBlockSparseAttention>(device, DType::kBF16, c, batch, dispatch);
  s.tokens =
      random_buffers(device, {b * c.num_qo_heads * d * 2, b * c.num_kv_heads * d * 2, b * c.num_kv_heads * d * 2},
                     {false, false, false}, 55);
  s.o = Buffer(device, b * c.num_qo_heads * d * 2);
  Arm arm;
  arm.fill = [&s, device, b, d](int64_t tokens, uint64_t seed) {
    append_random(*s.layer, device, b, s.config.num_kv_heads * d, s.config.num_kv_heads * d, tokens, seed);
  };
  arm.step = [&s](void* stream) {
    const LayerStep r =
        s.layer->decode({s.tokens[0].data(), s.tokens[1].data(), s.tokens[2].data(), s.o.data()}, stream);
    return std::make_pair(r.fused, r.outcome.describe());
  };
  layer_hooks(arm, s, device, true);
  return arm;
}

/// K and V bytes of a static step at `context`: what the fused step asks
/// for (each query head its own kept rows, G = 1 requests) and the union of
/// the kept rows over the query heads of each KV head (what a step must read
/// at least).
std::pair<double, double> static_bytes(const StaticBlockSparseConfig& c, int32_t batch, int64_t context) {
  const double row_bytes = 2.0 * c.head_dim * 2;  // K + V, bf16
  const int64_t query_block = (context - 1) / c.block_size;
  const int64_t tail = context - query_block * c.block_size;
  double requested = 0, united = 0;
  for (int32_t h = 0; h < c.num_qo_heads; ++h) requested += double(c.kept_tokens(h, context));
  for (int32_t kv = 0; kv < c.num_kv_heads; ++kv) {
    for (int64_t j = 0; j <= query_block; ++j) {
      bool any = false;
      for (int32_t g = 0; g < c.group_size(); ++g) any |= c.keeps(kv * c.group_size() + g, query_block, j);
      if (any) united += double(j == query_block ? tail : c.block_size);
    }
  }
  return {requested * batch * row_bytes, united * batch * row_bytes};
}

// ---- one configuration ------------------------------------------------------

struct Result {
  json row;
  std::string line;
};

/// The DSA step over engine-owned pools: checked against fp64 on sampled
/// (sequence, head) pairs, then timed eager and from a graph with its
/// phases, rotating pool copies so each step reads cold rows. There is no
/// mask path over an engine's pools, so none is timed.
Result measure_pools(const std::string& layer_name, DsaPoolsSetup& s, BlockPoolsSetup& bs, Device device,
                     const std::vector<int64_t>& lens, const Options& opt, double read_gbs, Result& res) {
  json& row = res.row;
  row["pools"] = opt.pools;
  const bool dsa = layer_name == "dsa", fp8 = opt.pools == "fp8";
  Arm arm = dsa ? dsa_pools_arm(s, device, lens, fp8) : block_pools_arm(bs, device, lens, fp8);
  const size_t copies = dsa ? s.copies.size() : bs.copies.size();
  const auto [did_fuse, outcome] = arm.step(nullptr);
  row["path"] = did_fuse ? "fused" : "fallback";
  row["outcome"] = outcome;
  row["pool_copies"] = copies;
  const double err = dsa ? dsa_pools_check(s, device) : block_pools_check(bs, device);
  row["check_rel_l2_vs_fp64"] = err;
  char head[256];
  std::snprintf(head, sizeof(head), "%-11s batch %3d context %7lld pools %s%s | ", layer_name.c_str(),
                static_cast<int>(lens.size()), static_cast<long long>(*std::max_element(lens.begin(), lens.end())),
                opt.pools.c_str(), row["ragged"].get<bool>() ? " ragged " : "");
  res.line = head;
  if (!did_fuse || !(err < 1e-2)) {
    res.line +=
        "REFUSED: " + std::string(!did_fuse ? "the step did not fuse (" + outcome + ")"
                                            : "the output disagrees with fp64 (rel L2 " + std::to_string(err) + ")");
    row["refused"] = res.line;
    return res;
  }
  double bytes = 0;  // the index key of every position and the selected rows
  for (int64_t len : lens) {
    if (dsa) {
      bytes +=
          double(len) * (fp8 ? 132 : 256) + double(std::min<int64_t>(len, s.config.index_topk)) * (fp8 ? 656 : 1152);
    } else {
      const auto& c = bs.config;
      const int64_t kept =
          c.sparse_regime(len) ? std::min<int64_t>(len, int64_t{c.topk_blocks + 1} * c.block_size) : len;
      bytes += double(len) * (fp8 ? 132 : 2.0 * c.head_dim) + double(kept) * c.num_kv_heads * c.head_dim * 4.0;
    }
  }
  auto run = [&](void* stream) { arm.step(stream); };
  const int32_t steps = std::max<int32_t>(opt.steps, static_cast<int32_t>(copies));
  const double eager = bench::median_us_eager(device, run, steps, opt.reps);
  bench::Events ev(device, 4);
  std::vector<double> indexer, attention;
  arm.phase_events(ev[1], ev[2]);
  for (int32_t i = 0; i < steps; ++i) {
    ev.record(0, nullptr);
    arm.step(nullptr);
    ev.record(3, nullptr);
    indexer.push_back(ev.elapsed_us(1, 2));
    attention.push_back(ev.elapsed_us(2, 3));
  }
  arm.phase_events(nullptr, nullptr);
  auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  const double graph = bench::median_us_per_launch(device, run, steps, opt.reps);
  const double floor_us = read_gbs > 0 ? bytes / (read_gbs * 1e3) : 0.0;
  row["graph_us"] = graph;
  row["eager_us"] = eager;
  row["phase_indexer_us"] = median(indexer);
  row["phase_attention_us"] = median(attention);
  row["floor_us"] = floor_us;
  row["bytes"] = bytes;
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "graph %8.1f us  eager %8.1f us | indexer %7.1f attention %7.1f | floor %6.1f us | %d cold copies | "
                "check %.1e vs fp64",
                graph, eager, median(indexer), median(attention), floor_us, static_cast<int>(copies), err);
  res.line += buf;
  return res;
}

/// Times one (layer, batch, context): the fused step eager and from a graph,
/// its phases, and the mask-path step from a graph.
Result measure(const std::string& layer_name, Device device, const std::vector<int64_t>& lens, const Options& opt,
               double read_gbs) {
  Result res;
  json& row = res.row;
  const auto batch = static_cast<int32_t>(lens.size());
  const int64_t context = *std::max_element(lens.begin(), lens.end());
  int64_t total = 0;
  for (int64_t len : lens) total += len;
  const bool ragged = std::any_of(lens.begin(), lens.end(), [&](int64_t len) { return len != lens[0]; });
  row["layer"] = layer_name;
  row["batch"] = batch;
  row["context"] = context;
  row["total_tokens"] = total;
  row["ragged"] = ragged;
  if (ragged) row["lens"] = lens;
  DispatchConfig mask_only = process_dispatch_config();
  mask_only.enabled = false;
  BlockSparseSetup bs_f, bs_m, bs_1;
  DsaSetup dsa_f, dsa_m, dsa_1;
  DsaPoolsSetup pools;
  BlockPoolsSetup block_pools;
  StaticSetup st_f, st_m;
  Arm fused, masked, one_token;  // one_token: the q_len = 1 fused step beside a multi-token one
  const int32_t q_len = opt.q_len;
  row["q_len"] = q_len;
  double bytes = 0;
  double requested_bytes = 0;  // static: K/V bytes the fused step asks for (bytes: their union)
  if ((layer_name == "dsa" || layer_name == "blocksparse") && !opt.pools.empty()) {
    return measure_pools(layer_name, pools, block_pools, device, lens, opt, read_gbs, res);
  }
  if (layer_name == "dsa") {
    fused = dsa_arm(dsa_f, device, batch, process_dispatch_config(), q_len);
    masked = dsa_arm(dsa_m, device, batch, mask_only, q_len);
    if (q_len > 1) one_token = dsa_arm(dsa_1, device, batch, process_dispatch_config(), 1);
    for (int64_t len : lens) bytes += dsa_bytes(dsa_f.config, 1, len);
  } else if (layer_name == "static") {
    fused = static_arm(st_f, device, batch, process_dispatch_config());
    masked = static_arm(st_m, device, batch, mask_only);
    for (int64_t len : lens) {
      const auto [req, uni] = static_bytes(st_f.config, 1, len);
      requested_bytes += req;
      bytes += uni;
    }
    row["requested_bytes"] = requested_bytes;
    row["union_bytes"] = bytes;
    row["requested_over_union"] = requested_bytes / bytes;
  } else {
    fused = block_sparse_arm(bs_f, device, batch, process_dispatch_config(), q_len);
    masked = block_sparse_arm(bs_m, device, batch, mask_only, q_len);
    if (q_len > 1) one_token = block_sparse_arm(bs_1, device, batch, process_dispatch_config(), 1);
    for (int64_t len : lens) bytes += block_sparse_bytes(bs_f.config, 1, len);
  }
  const bool gpu = device == Device::kCuda;
  // Tokens every timed run appends, with slack: reserve them up front so no
  // step grows the cache.
  const int64_t budget = (int64_t{opt.steps} * (3 * opt.reps + 8) + 16) * q_len;
  for (Arm* arm : {&fused, &masked, &one_token}) {
    if (!arm->fill) continue;
    arm->reserve(context + budget);
    if (!ragged) {
      arm->fill(context - q_len, 1234);
      continue;
    }
    for (int32_t b = 0; b < batch; ++b)
      arm->admit(b, lens[static_cast<size_t>(b)] - q_len, 1234 + 7 * static_cast<uint64_t>(b));
  }

  // The sampled step: the same tokens through both arms, then agreement.
  const auto [did_fuse, outcome] = fused.step(nullptr);
  const auto [mask_fused, mask_outcome] = masked.step(nullptr);
  row["path"] = did_fuse ? "fused" : "fallback";
  row["outcome"] = outcome;
  // A multi-token block-sparse step shares one selection among its tokens;
  // its mask-path arm runs token by token, each token with its own
  // selection, so the two attend different sets: agreement is asked of
  // the DSA layer only (one top-k per token in both arms).
  const bool comparable = q_len == 1 || layer_name == "dsa";
  const double agree = comparable ? relative_l2(fused.output(), masked.output()) : 0.0;
  row["agreement_rel_l2"] = comparable ? json(agree) : json("not comparable (shared vs per-token selection)");
  char head[256];
  std::snprintf(head, sizeof(head), "%-11s batch %3d context %7lld%s | ", layer_name.c_str(), batch,
                static_cast<long long>(context), ragged ? " ragged " : (opt.ragged ? " uniform" : ""));
  res.line = head;
  if (!did_fuse || mask_fused) {
    res.line += std::string("REFUSED: the fused step did not fuse (") + outcome + ")";
    row["refused"] = res.line;
    return res;
  }
  if (!(agree < 1e-2)) {
    res.line += "REFUSED: fused and mask-path steps disagree (relative L2 " + std::to_string(agree) + ")";
    row["refused"] = res.line;
    return res;
  }

  auto run_fused = [&](void* stream) { fused.step(stream); };
  auto run_masked = [&](void* stream) { masked.step(stream); };
  const double eager = bench::median_us_eager(device, run_fused, opt.steps, opt.reps);
  row["eager_us"] = eager;
  // Phases, from eager steps: append, indexer, attention.
  std::vector<double> append, indexer, attention;
  if (gpu) {
    bench::Events ev(device, 4);
    fused.phase_events(ev[1], ev[2]);
    for (int32_t s = 0; s < opt.steps; ++s) {
      ev.record(0, nullptr);
      fused.step(nullptr);
      ev.record(3, nullptr);
      append.push_back(ev.elapsed_us(0, 1));
      indexer.push_back(ev.elapsed_us(1, 2));
      attention.push_back(ev.elapsed_us(2, 3));
    }
    fused.phase_events(nullptr, nullptr);
    auto median = [](std::vector<double> v) {
      std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
      return v[v.size() / 2];
    };
    row["phase_append_us"] = median(append);
    row["phase_indexer_us"] = median(indexer);
    row["phase_attention_us"] = median(attention);
    row["phase_selection_plan_us"] = 0.0;  // the indexer writes the page table; the plan is made once
  }
  char buf[512];
  if (gpu) {
    const double graph = bench::median_us_per_launch(device, run_fused, opt.steps, opt.reps);
    if (q_len > 1) {
      // The token-by-token baseline synchronizes (not capturable): the
      // comparison is the one-token fused step, from a graph as well.
      one_token.step(nullptr);
      const double one = bench::median_us_per_launch(
          device, [&](void* st) { one_token.step(st); }, opt.steps, opt.reps);
      row["graph_us"] = graph;
      row["one_token_graph_us"] = one;
      row["ratio_to_one_token"] = graph / one;
      row["floor_us"] = read_gbs > 0 ? bytes / (read_gbs * 1e3) : 0.0;
      std::snprintf(buf, sizeof(buf),
                    "q_len %d: graph %8.1f us  eager %8.1f us | append %6.1f indexer %7.1f attention %7.1f | "
                    "q_len 1 step %8.1f us: %.2fx | agree %s",
                    q_len, graph, eager, row["phase_append_us"].get<double>(), row["phase_indexer_us"].get<double>(),
                    row["phase_attention_us"].get<double>(), one, graph / one,
                    comparable ? std::to_string(agree).c_str() : "n/a (shared selection)");
      res.line += buf;
      return res;
    }
    const double mask_graph = bench::median_us_per_launch(device, run_masked, opt.steps, opt.reps);
    const double floor_us = read_gbs > 0 ? bytes / (read_gbs * 1e3) : 0.0;
    row["graph_us"] = graph;
    row["mask_path_graph_us"] = mask_graph;
    row["floor_us"] = floor_us;
    row["bytes"] = bytes;
    std::snprintf(buf, sizeof(buf),
                  "graph %8.1f us  eager %8.1f us (%.2fx) | append %6.1f indexer %7.1f attention %7.1f | "
                  "mask-path step %9.1f us (%.1fx) | floor %6.1f us | agree %.1e",
                  graph, eager, eager / graph, row["phase_append_us"].get<double>(),
                  row["phase_indexer_us"].get<double>(), row["phase_attention_us"].get<double>(), mask_graph,
                  mask_graph / graph, floor_us, agree);
    if (requested_bytes > 0) {
      char more[160];
      std::snprintf(more, sizeof(more), " | K/V %.0f MB requested, %.2fx their union; %.0f GB/s of the union",
                    requested_bytes / 1e6, requested_bytes / bytes, bytes / (graph * 1e3));
      std::strncat(buf, more, sizeof(buf) - std::strlen(buf) - 1);
    }
  } else {
    const double mask_eager = bench::median_us_eager(device, run_masked, opt.steps, opt.reps);
    row["mask_path_eager_us"] = mask_eager;
    std::snprintf(buf, sizeof(buf), "eager %9.1f us | mask-path step %9.1f us (%.1fx) | agree %.1e (CPU: no graphs)",
                  eager, mask_eager, mask_eager / eager, agree);
  }
  res.line += buf;
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparse_step_bench: whole decode steps (append + indexer + attention) of the block-sparse, DSA and "
               "static block-sparse layers, the context growing one token per step, eager and replayed from a CUDA "
               "graph, beside the "
               "mask-path step and the read-time floor"};
  Options opt;
  app.add_option("--layers", opt.layers, "blocksparse, dsa and/or static (Phi-3-small's per-query-head pattern)")
      ->check(CLI::IsMember({"blocksparse", "dsa", "static"}));
  app.add_option("--batches", opt.batches, "batch sizes (default GPU: 1 8 32; CPU: 1)");
  app.add_option("--contexts", opt.contexts, "context lengths (default GPU: 32768 131072; CPU: 32768)");
  app.add_option("--steps", opt.steps, "steps per timed run (default GPU 16, CPU 4)")->check(CLI::Range(1, 1024));
  app.add_option("--reps", opt.reps, "timed runs, the median is reported (default GPU 5, CPU 3)")
      ->check(CLI::Range(1, 100));
  app.add_flag("--cpu", opt.cpu, "run on the CPU backend even when a GPU is present");
  app.add_option("--q-len", opt.q_len,
                 "query tokens per sequence per step (speculative verification, MTP): blocksparse and dsa; beside "
                 "each multi-token step the one-token step is timed too")
      ->check(CLI::Range(1, 16));
  app.add_option("--pools", opt.pools,
                 "dsa and blocksparse: the step over engine-owned pools (KVStorage::kEnginePools, lengths and index "
                 "keys from the engine): fp8 (dsa: 656-byte MLA rows and vLLM's FP8 index-key blocks; blocksparse: "
                 "bf16 K/V and FP8 index keys) or bf16; GPU only; --layers static is skipped")
      ->check(CLI::IsMember({"fp8", "bf16"}));
  app.add_flag("--ragged", opt.ragged,
               "beside each batch, a ragged batch (lengths spread from 1K to the context, requests admitted per slot) "
               "and the uniform batch of the same total tokens, and their ratio");
  app.add_option("--json", opt.json_path, "write every row as JSON here");
  CLI11_PARSE(app, argc, argv);

  const Device device = !opt.cpu && cuda_available() ? Device::kCuda : Device::kCpu;
  const bench::DeviceFacts facts = bench::device_facts(device);
  if (opt.batches.empty())
    opt.batches = device == Device::kCuda ? std::vector<int32_t>{1, 8, 32} : std::vector<int32_t>{1};
  if (device == Device::kCpu) {  // a CPU step takes milliseconds: fewer of them
    if (app.count("--steps") == 0) opt.steps = 4;
    if (app.count("--reps") == 0) opt.reps = 3;
  }
  if (opt.contexts.empty()) {
    opt.contexts = device == Device::kCuda ? std::vector<int64_t>{32768, 131072} : std::vector<int64_t>{32768};
  }
  if (opt.q_len > 1 && std::find(opt.layers.begin(), opt.layers.end(), "static") != opt.layers.end()) {
    if (app.count("--layers") > 0) {
      std::printf("--q-len %d: the static layer takes one token per step (pass --layers blocksparse dsa)\n", opt.q_len);
      return 2;
    }
    opt.layers = {"blocksparse", "dsa"};
  }
  if (!opt.pools.empty() && device != Device::kCuda) {
    std::printf("--pools %s: skipped: the engine-pools step is benchmarked on a GPU only (its pools are built "
                "there)\n",
                opt.pools.c_str());
    return kSkipped;
  }
  if (dump_selection_enabled()) {
    std::printf("refusing to time: SPARSEPAGE_DUMP_SELECTION synchronizes inside every step\n");
    return 2;
  }
  const double read_gbs = bench::measured_read_bandwidth_gbs(device, int64_t{4} << 30);
  if (device == Device::kCuda) {
    std::printf("sparse_step_bench on %s (%s backend); measured read bandwidth %.0f GB/s\n", facts.name.c_str(),
                device_name(device), read_gbs);
  } else {
    std::printf("sparse_step_bench on %s (%s backend); no read floor on the CPU backend\n", facts.name.c_str(),
                device_name(device));
  }
  std::printf("each step appends %d token(s) per sequence; times are medians of %d runs of %d steps\n", opt.q_len,
              opt.reps, opt.steps);
  json out;
  out["device"] = facts.name;
  out["backend"] = device_name(device);
  out["read_gbs"] = read_gbs;
  out["steps"] = opt.steps;
  out["reps"] = opt.reps;
  int refused = 0;
  for (const std::string& layer : opt.layers) {
    if (!opt.pools.empty() && layer == "static") {
      std::printf("static: no engine-pools form (--pools covers dsa and blocksparse); skipped\n");
      continue;
    }
    for (int64_t context : opt.contexts) {
      for (int32_t batch : opt.batches) {
        const auto run = [&](const std::vector<int64_t>& lens) {
          Result r = measure(layer, device, lens, opt, read_gbs);
          std::printf("%s\n", r.line.c_str());
          std::fflush(stdout);
          refused += r.row.contains("refused") ? 1 : 0;
          out["rows"].push_back(r.row);
          return r.row;
        };
        if (!opt.ragged || batch < 2) {
          run(std::vector<int64_t>(static_cast<size_t>(batch), context));
          continue;
        }
        // A ragged batch: lengths spread evenly from 1K to the context,
        // shuffled over the slots; then the uniform batch of the same total.
        std::vector<int64_t> lens(static_cast<size_t>(batch));
        const int64_t low = std::min<int64_t>(1024, context);
        for (int32_t b = 0; b < batch; ++b) lens[static_cast<size_t>(b)] = low + (context - low) * b / (batch - 1);
        std::reverse(lens.begin() + batch / 2, lens.end());  // interleave long and short slots
        int64_t total = 0;
        for (int64_t len : lens) total += len;
        const json r = run(lens);
        const json u = run(std::vector<int64_t>(static_cast<size_t>(batch), total / batch));
        if (r.contains("graph_us") && u.contains("graph_us")) {
          const double ratio = r["graph_us"].get<double>() / u["graph_us"].get<double>();
          std::printf("%-11s batch %3d: ragged (1K..%lld) / uniform (%lld each, same total) = %.3f\n", layer.c_str(),
                      batch, static_cast<long long>(context), static_cast<long long>(total / batch), ratio);
          out["ragged_ratios"].push_back({{"layer", layer}, {"batch", batch}, {"context", context}, {"ratio", ratio}});
        }
      }
    }
  }
  if (!opt.json_path.empty()) {
    std::ofstream(opt.json_path) << out.dump(2) << "\n";
    std::printf("wrote %s\n", opt.json_path.c_str());
  }
  return refused == 0 ? 0 : 1;
}
