// mla_sparse_bench: the FlashMLA-shaped sparse decode (mla_sparse.h) at
// FlashMLA's FP8 sparse-decode shapes, timed the way scripts/peers.sh times
// FlashMLA: 656-byte V3.2 rows, random distinct slot ids per query (top-k of
// the context), a pool per sequence when batch > 1 (every selected byte
// distinct), graph replays rotating among enough selections that their rows
// exceed 2x the L2. Two arms over the same cache and ids: `compat` (with an
// extra cache both partial launches and the merge; without one the fused
// decode on its own plan and the epilogue that gives FlashMLA's lse and
// the sink) and `decode` (the fused FP8 decode on its own plan alone: what
// the interface adds to it). Both are checked against each other and for
// NaN before they are timed.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_device.h"
#include "sparsepage/decode.h"
#include "sparsepage/fp8.h"
#include "sparsepage/memory.h"
#include "sparsepage/mla_sparse.h"

using namespace sparsepage;
using json = nlohmann::json;

namespace {

struct Options {
  std::vector<int32_t> batches = {1, 64, 128};
  int32_t q_len = 1, heads = 128, topk = 2048, extra_topk = 0;
  int64_t context = 131072;  // slots each sequence's ids are drawn from
  int32_t block_size = 64;
  bool sink = false;
  int32_t reps = 15, rotate = 0;
  std::string json_path;
};

// `batch * q_len` rows of `topk` distinct slots of sequence b's own range
// [b * context, (b + 1) * context) (all sequences share range 0 at batch 1).
std::vector<int32_t> random_ids(const Options& o, int32_t batch, int32_t topk, int64_t context, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(int64_t{batch} * o.q_len * topk));
  std::vector<int32_t> all(static_cast<size_t>(context));
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t t = 0; t < o.q_len; ++t) {
      std::iota(all.begin(), all.end(), static_cast<int32_t>(b * context));
      for (int32_t i = 0; i < topk; ++i) {
        std::uniform_int_distribution<int64_t> pick(i, context - 1);
        std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(pick(rng))]);
        ids.push_back(all[static_cast<size_t>(i)]);
      }
    }
  }
  return ids;
}

// `rows` 656-byte rows quantized from random bf16 values, in slices so the
// bf16 staging stays small.
void fill_rows(uint8_t* pool, int64_t rows, uint64_t seed) {
  constexpr int64_t kSlice = int64_t{1} << 20;
  Buffer staging(Device::kCuda, static_cast<size_t>(std::min(rows, kSlice)) * 576 * 2);
  for (int64_t r = 0; r < rows; r += kSlice) {
    const int64_t n = std::min(kSlice, rows - r);
    bench::fill_random(Device::kCuda, DType::kBF16, staging.data(), n * 576, seed + static_cast<uint64_t>(r));
    quantize_mla_fp8_cuda(DType::kBF16, staging.data(), n, 576, pool + r * MlaFp8Row::kBytes);
  }
}

double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    diff += double(a[i] - b[i]) * (a[i] - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

std::vector<float> as_floats(const Buffer& o) {
  const auto bytes = download<uint8_t>(Device::kCuda, o.data(), o.bytes());
  std::vector<float> out(o.bytes() / 2);
  to_float(DType::kBF16, bytes.data(), out.data(), out.size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"The FlashMLA-shaped sparse decode over V3.2 FP8 rows, beside the plain fused FP8 decode"};
  app.add_option("--batch", opt.batches, "batches; comma separated")->delimiter(',');
  app.add_option("--q-len", opt.q_len, "query tokens per sequence (FlashMLA's s_q)")->check(CLI::Range(1, 16));
  app.add_option("--heads", opt.heads, "query heads (h_q)")->check(CLI::Range(1, 1024));
  app.add_option("--topk", opt.topk, "ids per query")->check(CLI::Range(1, 1 << 20));
  app.add_option("--extra-topk", opt.extra_topk, "ids per query in an extra cache (0: none)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--context", opt.context, "slots each sequence draws its ids from")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--block-size", opt.block_size, "page_block_size")->check(CLI::Range(1, 4096));
  app.add_flag("--sink", opt.sink, "pass an attention sink per head (compat arm)");
  app.add_option("--reps", opt.reps, "timed graph replays (median reported)")->check(CLI::Range(3, 1000));
  app.add_option("--rotate", opt.rotate, "distinct selections cycled per replay (0: enough to exceed 2x L2)");
  app.add_option("--json", opt.json_path, "also write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  if (!cuda_available()) {
    std::fprintf(stderr, "mla_sparse_bench: needs a GPU (sparsepage::cuda_available() is false)\n");
    return 2;
  }
  if (opt.topk > opt.context || opt.extra_topk > opt.context) {
    std::fprintf(stderr, "--topk and --extra-topk must not exceed --context (ids are distinct)\n");
    return 2;
  }
  const bench::DeviceFacts facts = bench::device_facts(Device::kCuda);
  std::printf("device: %s (%d SMs, %.0f MB L2); V3.2 656-byte rows, %d heads, s_q %d, top-%d of %lld%s%s\n",
              facts.name.c_str(), facts.multiprocessors, static_cast<double>(facts.l2_bytes) / 1e6, opt.heads,
              opt.q_len, opt.topk, static_cast<long long>(opt.context),
              opt.extra_topk ? (", extra top-" + std::to_string(opt.extra_topk)).c_str() : "",
              opt.sink ? ", sink" : "");
  json results = json::array();
  int exit_code = 0;
  for (const int32_t batch : opt.batches) {
    const int64_t seqs = batch > 1 ? batch : 1;  // a pool per sequence when batch > 1
    const int64_t slots = (seqs * opt.context + opt.block_size - 1) / opt.block_size * opt.block_size;
    Buffer pool(Device::kCuda, static_cast<size_t>(slots) * MlaFp8Row::kBytes);
    fill_rows(pool.as<uint8_t>(), slots, 7);
    Buffer extra_pool;
    if (opt.extra_topk > 0) {
      extra_pool = Buffer(Device::kCuda, static_cast<size_t>(slots) * MlaFp8Row::kBytes);
      fill_rows(extra_pool.as<uint8_t>(), slots, 11);
    }
    const int64_t queries = int64_t{batch} * opt.q_len * opt.heads;
    Buffer q(Device::kCuda, static_cast<size_t>(queries) * 576 * 2);
    bench::fill_random(Device::kCuda, DType::kBF16, q.data(), queries * 576, 3);
    std::vector<float> sink_host(static_cast<size_t>(opt.heads));
    for (int32_t h = 0; h < opt.heads; ++h) sink_host[static_cast<size_t>(h)] = 0.5f * static_cast<float>(h % 9);
    const Buffer sink = upload(Device::kCuda, sink_host);
    // Enough selections that one replay's rows exceed twice the L2.
    const double selection_bytes = double(batch) * opt.q_len * (opt.topk + opt.extra_topk) * MlaFp8Row::kBytes;
    const int32_t rotate =
        opt.rotate > 0 ? opt.rotate
                       : static_cast<int32_t>(std::clamp(
                             std::ceil(2.0 * static_cast<double>(facts.l2_bytes) / selection_bytes), 1.0, 200.0));
    std::vector<Buffer> ids, extra_ids;
    for (int32_t i = 0; i < rotate; ++i) {
      ids.push_back(upload(Device::kCuda, random_ids(opt, batch, opt.topk, opt.context, 100 + i)));
      if (opt.extra_topk > 0)
        extra_ids.push_back(upload(Device::kCuda, random_ids(opt, batch, opt.extra_topk, opt.context, 900 + i)));
    }

    // The compat arm: its plan, workspace and params.
    const CudaLaunchShape launch = cuda_launch_shape(512, 512, 64, opt.heads);
    PlanShape machine;
    machine.num_sms = cuda_multiprocessor_count();
    machine.items_per_sm = launch.ctas_per_sm;
    machine.ctas_per_item = launch.ctas_per_item;
    const MlaSparsePlan plan = make_mla_sparse_plan({batch, opt.q_len, opt.heads, opt.topk, opt.extra_topk}, machine);
    Buffer ws(Device::kCuda, plan.workspace.total);
    upload_mla_sparse_plan_cuda(plan, ws.data());
    Buffer o(Device::kCuda, static_cast<size_t>(queries) * 512 * 2),
        lse(Device::kCuda, static_cast<size_t>(queries) * 4);
    MlaSparseParams p;
    p.batch = batch;
    p.q_len = opt.q_len;
    p.num_heads = opt.heads;
    p.q = q.data();
    p.q_head_stride = 576;
    p.q_token_stride = int64_t{opt.heads} * 576;
    p.q_batch_stride = int64_t{opt.q_len} * p.q_token_stride;
    const auto cache_of = [&](const Buffer& data, int32_t topk) {
      MlaSparseCache c;
      c.data = data.data();
      c.num_blocks = slots / opt.block_size;
      c.block_size = opt.block_size;
      c.row_stride = MlaFp8Row::kBytes;
      c.block_stride = int64_t{opt.block_size} * MlaFp8Row::kBytes;
      c.topk = topk;
      c.index_batch_stride = int64_t{opt.q_len} * topk;
      c.index_token_stride = topk;
      return c;
    };
    p.cache = cache_of(pool, opt.topk);
    p.cache.indices = ids[0].as<int32_t>();
    if (opt.extra_topk > 0) {
      p.extra = cache_of(extra_pool, opt.extra_topk);
      p.extra.indices = extra_ids[0].as<int32_t>();
    }
    p.scale = 1.0f / 24.0f;
    p.o = o.data();
    p.lse = lse.as<float>();

    // The decode arm (main cache only): the library's fused FP8 decode on its own plan.
    const MlaFp8Views views = mla_fp8_views(pool.data(), slots);
    DecodeParams d;
    d.kv_format = KvFormat::kE4m3Mla;
    d.k = views.k;
    d.v = views.v;
    d.k_extra = views.k_extra;
    d.index_layout = IndexLayout::kMatrix;
    d.indices = ids[0].as<int32_t>();
    d.index_width = opt.topk;
    d.index_seq_stride = int64_t{opt.q_len} * opt.topk;
    d.index_head_stride = opt.topk;
    d.num_indices = int64_t{batch} * opt.q_len * opt.topk;
    d.num_requests = batch * opt.q_len;
    d.num_kv_heads = opt.q_len;
    d.padding = IndexPadding::kMinusOneSkips;
    d.num_pool_pages = slots;
    d.group_size = opt.heads;
    d.qo_layout = QueryLayout::kStrided;
    d.q = q.data();
    d.q_strides = {p.q_batch_stride, 576, 0};
    d.q_extra = q.as<uint16_t>() + 512;
    d.q_extra_strides = d.q_strides;
    Buffer o2(Device::kCuda, o.bytes());
    d.o = o2.data();
    d.o_strides = {int64_t{opt.q_len} * opt.heads * 512, 512, 0};
    d.scale = p.scale;
    PlanShape dshape = machine;
    dshape.group_size = opt.heads;
    dshape.head_dim_v = 512;
    const DecodePlan dplan =
        make_decode_plan(std::vector<int32_t>(static_cast<size_t>(batch * opt.q_len), opt.topk), dshape);
    Buffer dws(Device::kCuda, std::max<size_t>(dplan.workspace.total, 256));
    upload_plan_cuda(dplan, dws.data());

    // Correctness first: the arms agree (without the sink and the extra cache), no id is flagged.
    MlaSparseParams check = p;
    check.extra = MlaSparseCache{};
    const MlaSparsePlan check_plan = make_mla_sparse_plan({batch, opt.q_len, opt.heads, opt.topk, 0}, machine);
    Buffer check_ws(Device::kCuda, check_plan.workspace.total);
    upload_mla_sparse_plan_cuda(check_plan, check_ws.data());
    run_mla_sparse_cuda(check, check_plan, check_ws.data());
    const char* kernel = run_decode_cuda(d, dplan, dws.data());
    const double agreement = relative_l2(as_floats(o), as_floats(o2));
    const uint32_t flags =
        read_mla_sparse_error_flag(check_plan, check_ws.data()) | read_decode_error_flag(dplan, dws.data());
    const bool ok = agreement < 1e-2 && flags == 0;
    std::printf("batch %d: %d selection(s) rotated; compat: %zu + %zu items, %d partials; decode: %zu items, %d "
                "partials (%s); agreement %.2e, flags %u (%s)\n",
                batch, rotate, plan.main.work.size(), plan.extra.work.size(), plan.num_partials, dplan.work.size(),
                dplan.num_partials, kernel, agreement, flags, ok ? "ok" : "DISAGREE: timing refused");
    if (!ok) {
      exit_code = 1;
      continue;
    }
    if (opt.sink) p.attn_sink = sink.as<float>();
    size_t next = 0;
    const double compat_us = bench::median_us_per_launch(
        Device::kCuda,
        [&](void* stream) {
          const size_t i = next++ % ids.size();
          p.cache.indices = ids[i].as<int32_t>();
          if (opt.extra_topk > 0) p.extra.indices = extra_ids[i].as<int32_t>();
          run_mla_sparse_cuda(p, plan, ws.data(), stream);
        },
        rotate, opt.reps);
    next = 0;
    d.lse = lse.as<float>();  // both arms write lse, as FlashMLA does
    const double decode_us = bench::median_us_per_launch(
        Device::kCuda,
        [&](void* stream) {
          d.indices = ids[next++ % ids.size()].as<int32_t>();
          run_decode_cuda(d, dplan, dws.data(), stream);
        },
        rotate, opt.reps);
    // The peers' convention: 2 x (576 + 512) flops per head and attended token.
    const double flops = 2.0 * 1088.0 * opt.heads * double(batch) * opt.q_len * (opt.topk + opt.extra_topk);
    const double main_flops = 2.0 * 1088.0 * opt.heads * double(batch) * opt.q_len * opt.topk;
    std::printf("batch %d: compat %.2f us (%.1f TFLOP/s) | decode, main cache only %.2f us (%.1f TFLOP/s)\n", batch,
                compat_us, flops / (compat_us * 1e6), decode_us, main_flops / (decode_us * 1e6));
    results.push_back({{"batch", batch},
                       {"q_len", opt.q_len},
                       {"heads", opt.heads},
                       {"topk", opt.topk},
                       {"extra_topk", opt.extra_topk},
                       {"context", opt.context},
                       {"sink", opt.sink},
                       {"rotate", rotate},
                       {"device", facts.name},
                       {"agreement_rel_l2", agreement},
                       {"compat_cold_us", compat_us},
                       {"decode_cold_us", decode_us},
                       {"compat_tflops", flops / (compat_us * 1e6)},
                       {"decode_tflops", main_flops / (decode_us * 1e6)}});
  }
  std::printf("times: median of %d CUDA-graph replays, per launch (each replay rotates among the selections, so\n"
              "their rows exceed 2x the L2: cold); compat = FlashMLA's interface (with an extra cache: both\n"
              "caches' partial kernels + the merge; without: the decode on its own plan + the lse/sink epilogue),\n"
              "decode = the fused FP8 decode on its own plan over the main cache alone\n",
              opt.reps);
  if (!opt.json_path.empty()) std::ofstream(opt.json_path) << results.dump(2) << "\n";
  return exit_code;
}
