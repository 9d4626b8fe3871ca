// sparse_paged_decode_bench (docs/DESIGN.md: the benchmark): one decoder layer's attention
// at a model's head geometry, the additive-mask arm against the fused sparse
// arm over the same selection. It says which backend and path ran, refuses a
// timing comparison when the sparse arm did not fuse or the arms disagree,
// and reports bandwidth against the device's read bandwidth measured in the
// same run.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>

#include "bench_device.h"
#include "sparsepage/fp8.h"
#include "sparsepage/sparse_decode.h"

using namespace sparsepage;
using json = nlohmann::json;

namespace {

struct Geometry {
  std::string name;
  int32_t num_qo_heads, num_kv_heads, dim_qk, dim_v, dim_extra;
  int64_t k_row_stride;  // K rows may carry more (DSA: the indexer key)
  bool v_aliases_k;
};

Geometry geometry_named(const std::string& name) {
  if (name == "dsa") return {"dsa", 128, 1, 512, 512, 64, 640, true};
  return {"blocksparse", 64, 4, 128, 128, 0, 128, false};
}

struct Options {
  std::string geometry = "blocksparse";
  std::vector<int64_t> contexts = {8192, 16384, 32768};
  int32_t batch = 1;
  int32_t reps = 15;
  int32_t steps = 20;
  int64_t min_sparsity = -1;  // -1: the policy's value
  std::string selection = "blocks";
  int32_t rows = 2048;  // random mode: rows per request
  int32_t topk_blocks = 16, block_size = 128;
  int32_t rotate = 0;                       // 0: enough selections to defeat the L2
  int32_t items_per_sm = 0, min_chunk = 0;  // plan tuning (0: defaults)
  bool cpu = false;
  bool fused_only = false;        // check against the mask arm once, time only the fused arm
  std::string kv_dtype = "bf16";  // fp8: the fused arm reads an FP8 cache (dsa: the 656-byte MLA rows;
                                  // blocksparse: e4m3 K and V with per-head scales)
  std::string json_path;
};

struct Streams {
  Buffer k, v, k_extra, q;
  Buffer k8, v8, scales;  // --kv-dtype fp8: the fused arm's cache
  int64_t capacity = 0;
};

double relative_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    diff += double(a[i] - b[i]) * (a[i] - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

/// The largest relative L2 over requests (each request's [group, dv] block
/// on its own, so an error in one request is not diluted by the others).
double worst_request_l2(const std::vector<float>& a, const std::vector<float>& b, int64_t requests) {
  const size_t per = a.size() / static_cast<size_t>(std::max<int64_t>(requests, 1));
  double worst = 0;
  for (int64_t r = 0; r < requests; ++r) {
    const auto at = static_cast<std::ptrdiff_t>(static_cast<size_t>(r) * per);
    worst = std::max(
        worst, relative_l2(std::vector<float>(a.begin() + at, a.begin() + at + static_cast<std::ptrdiff_t>(per)),
                           std::vector<float>(b.begin() + at, b.begin() + at + static_cast<std::ptrdiff_t>(per))));
  }
  return worst;
}

/// The largest |a - b| of two lse arrays (natural log); inf on a non-finite entry.
double worst_lse_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  }
  return worst;
}

std::vector<float> read_output(Device device, const Buffer& o) {
  const auto bytes = download<uint8_t>(device, o.data(), o.bytes());
  std::vector<float> out(o.bytes() / 2);
  to_float(DType::kBF16, bytes.data(), out.data(), out.size());
  return out;
}

// Window positions per request: top-k random full blocks + the final block
// (the block-sparse model's shape), or distinct random rows.
SparseSelection make_positions(Device device, const Options& opt, int32_t requests, int64_t context, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(requests));
  for (auto& r : rows) {
    if (opt.selection == "random") {
      std::vector<int32_t> all(static_cast<size_t>(context));
      std::iota(all.begin(), all.end(), 0);
      for (int32_t i = 0; i < opt.rows; ++i) {
        std::uniform_int_distribution<int64_t> pick(i, context - 1);
        std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(pick(rng))]);
      }
      r.assign(all.begin(), all.begin() + opt.rows);
      continue;
    }
    const int64_t blocks = (context + opt.block_size - 1) / opt.block_size;
    std::vector<int32_t> ids(static_cast<size_t>(blocks - 1));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(static_cast<size_t>(std::min<int64_t>(opt.topk_blocks, blocks - 1)));
    ids.push_back(static_cast<int32_t>(blocks - 1));
    for (int32_t b : ids) {
      for (int64_t t = int64_t{b} * opt.block_size; t < std::min<int64_t>((b + 1) * int64_t{opt.block_size}, context);
           ++t) {
        r.push_back(static_cast<int32_t>(t));
      }
    }
  }
  return make_selection(device, rows);
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  CLI::App app{"sparse_paged_decode_bench: mask arm vs fused sparse arm over the same selection"};
  app.add_option("--geometry", opt.geometry, "blocksparse (64/4/128) or dsa (128 heads, 512+64, V = K)")
      ->check(CLI::IsMember({"blocksparse", "dsa"}));
  app.add_option("--contexts", opt.contexts, "live tokens per (sequence, KV head); comma separated")->delimiter(',');
  app.add_option("--batch", opt.batch, "sequences")->check(CLI::Range(1, 1024));
  app.add_option("--reps", opt.reps, "timed graph replays (median reported)")->check(CLI::Range(3, 1000));
  app.add_option("--steps", opt.steps, "launches per replay")->check(CLI::Range(1, 1000));
  app.add_option("--min-sparsity", opt.min_sparsity, "override the policy's sparsity gate (0 disables it)");
  app.add_option("--selection", opt.selection, "blocks (top-k blocks + final block) or random (rows per request)")
      ->check(CLI::IsMember({"blocks", "random"}));
  app.add_option("--rows", opt.rows, "random selection: rows per request")->check(CLI::Range(1, 1 << 24));
  app.add_option("--topk-blocks", opt.topk_blocks, "blocks selection: blocks kept besides the final one");
  app.add_option("--rotate", opt.rotate, "distinct selections cycled per replay (0: enough to exceed 2x L2)");
  app.add_option("--items-per-sm", opt.items_per_sm, "plan tuning: work items per multiprocessor (0: default)");
  app.add_option("--min-chunk", opt.min_chunk, "plan tuning: smallest chunk in tokens (0: default)");
  app.add_flag("--cpu", opt.cpu, "use the CPU backend even when a GPU is present");
  app.add_flag("--fused-only", opt.fused_only,
               "run the mask arm once for the agreement check but time only the fused arm (peer comparisons)");
  app.add_option("--kv-dtype", opt.kv_dtype,
                 "bf16, or fp8: the fused arm reads an FP8 cache (dsa: the 656-byte MLA rows; blocksparse: e4m3 K "
                 "and V, one scale per KV head) holding exactly the bf16 values the mask arm reads")
      ->check(CLI::IsMember({"bf16", "fp8"}));
  app.add_option("--json", opt.json_path, "also write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  for (int64_t context : opt.contexts) {
    const int64_t needed = opt.selection == "random" ? opt.rows : int64_t{opt.block_size} + 1;
    if (context < needed || context > (int64_t{1} << 30)) {
      std::fprintf(stderr, "--contexts: %lld must lie in [%lld, 2^30] for this selection\n",
                   static_cast<long long>(context), static_cast<long long>(needed));
      return 2;
    }
  }
  if (opt.topk_blocks < 1) {
    std::fprintf(stderr, "--topk-blocks must be at least 1\n");
    return 2;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress on stderr and results on stdout interleave in order

  if (dump_selection_enabled()) {
    std::fprintf(stderr, "refusing to time: SPARSEPAGE_DUMP_SELECTION synchronizes every step\n");
    return 2;
  }
  const Device device = !opt.cpu && cuda_available() ? Device::kCuda : Device::kCpu;
  const Geometry geo = geometry_named(opt.geometry);
  const bench::DeviceFacts facts = bench::device_facts(device);
  const double peak_gbs = bench::measured_read_bandwidth_gbs(device, int64_t{4} << 30);
  DispatchConfig config = process_dispatch_config();
  if (opt.min_sparsity >= 0) config.min_sparsity = opt.min_sparsity;
  const int32_t requests = opt.batch * geo.num_kv_heads;
  const int32_t group = geo.num_qo_heads / geo.num_kv_heads;
  if (device == Device::kCuda && !cuda_supports_head_dims(geo.dim_qk, geo.dim_v, geo.dim_extra)) {
    // Both arms share the CUDA kernel family; neither can run this shape.
    std::printf("backend cuda: no CUDA kernel is built for the %s geometry (qk %d + %d, v %d); neither arm can run\n"
                "on the GPU. Run it on the CPU backend with --cpu.\n",
                geo.name.c_str(), geo.dim_qk, geo.dim_extra, geo.dim_v);
    return 2;
  }
  if (device == Device::kCpu) {
    opt.reps = std::min(opt.reps, 5);
    opt.steps = std::min(opt.steps, 2);
  }

  std::printf("sparse_paged_decode_bench: backend %s on %s", device_name(device), facts.name.c_str());
  if (device == Device::kCuda) {
    std::printf(" (%d SMs, L2 %.0f MB), measured read bandwidth %.0f GB/s", facts.multiprocessors,
                double(facts.l2_bytes) / 1e6, peak_gbs);
  } else {
    std::printf(" (no GPU%s: CPU reference backend)", cuda_available() ? " used: --cpu" : " present");
  }
  const bool fp8 = opt.kv_dtype == "fp8";
  std::printf("\ngeometry %s: %d query heads / %d KV heads, qk dim %d%s, v dim %d%s, bf16, batch %d\n",
              geo.name.c_str(), geo.num_qo_heads, geo.num_kv_heads, geo.dim_qk,
              geo.dim_extra ? (" + " + std::to_string(geo.dim_extra) + " (second K stream)").c_str() : "", geo.dim_v,
              geo.v_aliases_k ? " (V = first columns of K)" : "", opt.batch);
  if (fp8) {
    std::printf("kv cache: fp8 for the fused arm (%s), holding exactly the bf16 values the mask arm reads\n",
                geo.v_aliases_k ? "656-byte MLA rows: 512 e4m3 + 4 fp32 scales + 64 bf16 rope"
                                : "e4m3 K and V, per-KV-head scales");
  }
  if (opt.selection == "random") {
    std::printf("selection: %d distinct random rows per request\n", opt.rows);
  } else {
    std::printf("selection: %d random blocks of %d + the final block per request (indexer not timed)\n",
                opt.topk_blocks, opt.block_size);
  }
  std::printf("policy: kill switch %s, min sparsity %lld, floors %lld / %lld per request\n",
              config.enabled ? "off (fused allowed)" : "ON (mask path pinned)",
              static_cast<long long>(config.min_sparsity), static_cast<long long>(config.min_kv_tokens),
              static_cast<long long>(config.min_kv_tokens_per_request));

  json results = json::array();
  struct Row {
    int64_t context;
    std::string outcome;
    double agreement = NAN, mask_us = NAN, fused_hot_us = NAN, fused_cold_us = NAN;
    double mask_gbs = NAN, fused_gbs = NAN, mask_mb = 0, fused_mb = 0;
    int64_t selected = 0;
    int32_t rotate = 1;
  };
  std::vector<Row> rows;
  int exit_code = 0;
  const size_t esize = 2;
  for (int64_t context : opt.contexts) {
    std::fprintf(stderr, "[context %lld] preparing caches and selections...\n", static_cast<long long>(context));
    Row row;
    row.context = context;
    Streams s;
    s.capacity = (context + 4095) / 4096 * 4096;
    const int64_t cache_rows = int64_t{opt.batch} * geo.num_kv_heads * s.capacity;
    s.k = Buffer(device, static_cast<size_t>(cache_rows * geo.k_row_stride) * esize);
    // fp8: values the FP8 cache holds exactly, so both arms attend the same numbers.
    if (fp8)
      bench::fill_e4m3_exact(device, s.k.data(), cache_rows * geo.k_row_stride, 1);
    else
      bench::fill_random(device, DType::kBF16, s.k.data(), cache_rows * geo.k_row_stride, 1);
    if (!geo.v_aliases_k) {
      s.v = Buffer(device, static_cast<size_t>(cache_rows * geo.dim_v) * esize);
      if (fp8)
        bench::fill_e4m3_exact(device, s.v.data(), cache_rows * geo.dim_v, 2);
      else
        bench::fill_random(device, DType::kBF16, s.v.data(), cache_rows * geo.dim_v, 2);
    }
    if (geo.dim_extra && !fp8) {
      s.k_extra = Buffer(device, static_cast<size_t>(cache_rows * geo.dim_extra) * esize);
      bench::fill_random(device, DType::kBF16, s.k_extra.data(), cache_rows * geo.dim_extra, 3);
    }
    const int64_t q_elems = int64_t{requests} * group * (geo.dim_qk + geo.dim_extra);
    s.q = Buffer(device, static_cast<size_t>(q_elems) * esize);
    bench::fill_random(device, DType::kBF16, s.q.data(), q_elems, 4);
    Buffer o_fused(device, static_cast<size_t>(requests) * group * geo.dim_v * esize);
    Buffer o_mask(device, o_fused.bytes());
    fill_bytes(o_fused.data(), device, 0xFF, o_fused.bytes());  // NaN: unwritten output fails the check
    fill_bytes(o_mask.data(), device, 0xFF, o_mask.bytes());
    Buffer lse_fused(device, static_cast<size_t>(requests) * group * sizeof(float));
    Buffer lse_mask(device, lse_fused.bytes());
    fill_bytes(lse_fused.data(), device, 0xFF, lse_fused.bytes());
    fill_bytes(lse_mask.data(), device, 0xFF, lse_mask.bytes());

    SparseAttentionInputs in;
    in.device = device;
    in.batch = opt.batch;
    in.num_qo_heads = geo.num_qo_heads;
    in.num_kv_heads = geo.num_kv_heads;
    in.live_len = context;
    in.k = RowView::dense(s.k.data(), geo.num_kv_heads, s.capacity, geo.dim_qk, geo.k_row_stride);
    in.v = geo.v_aliases_k ? RowView::dense(s.k.data(), geo.num_kv_heads, s.capacity, geo.dim_v, geo.k_row_stride)
                           : RowView::dense(s.v.data(), geo.num_kv_heads, s.capacity, geo.dim_v);
    if (geo.dim_extra) {
      // fp8 (the MLA rows): the rope rides in K's columns 512..575, where the
      // quantizer reads it beside the latent.
      in.k_extra = fp8 ? RowView::dense(static_cast<const char*>(s.k.data()) + geo.dim_qk * esize, geo.num_kv_heads,
                                        s.capacity, geo.dim_extra, geo.k_row_stride)
                       : RowView::dense(s.k_extra.data(), geo.num_kv_heads, s.capacity, geo.dim_extra);
      in.q_extra = static_cast<const char*>(s.q.data()) + int64_t{requests} * group * geo.dim_qk * esize;
    }
    in.q = s.q.data();
    in.scale = 1.0f / std::sqrt(float(geo.dim_qk + geo.dim_extra));
    // The fused arm's inputs: the same, or the FP8 copy of the cache.
    SparseAttentionInputs in8 = in;
    if (fp8 && geo.v_aliases_k) {
      const int64_t row_bytes = 656;
      s.k8 = Buffer(device, static_cast<size_t>(cache_rows * row_bytes));
      if (device == Device::kCuda) {
        quantize_mla_fp8_cuda(DType::kBF16, s.k.data(), cache_rows, geo.k_row_stride, s.k8.data(), row_bytes);
      } else {
        quantize_mla_fp8_cpu(DType::kBF16, s.k.data(), cache_rows, geo.k_row_stride, s.k8.data(), row_bytes);
      }
      in8.kv_format = KvFormat::kE4m3Mla;
      in8.k = RowView::dense(s.k8.data(), geo.num_kv_heads, s.capacity, geo.dim_qk, row_bytes);
      in8.v = in8.k;
      in8.k_extra = RowView::dense(static_cast<const char*>(s.k8.data()) + 528, geo.num_kv_heads, s.capacity,
                                   geo.dim_extra, row_bytes / 2);
    } else if (fp8) {
      s.k8 = Buffer(device, static_cast<size_t>(cache_rows * geo.dim_qk));
      s.v8 = Buffer(device, static_cast<size_t>(cache_rows * geo.dim_v));
      bench::to_e4m3_times_256(device, s.k.data(), s.k8.data(), cache_rows * geo.dim_qk);
      bench::to_e4m3_times_256(device, s.v.data(), s.v8.data(), cache_rows * geo.dim_v);
      s.scales = upload(device, std::vector<float>(static_cast<size_t>(geo.num_kv_heads), 1.0f / 256.0f));
      in8.kv_format = KvFormat::kE4m3PerHead;
      in8.k = RowView::dense(s.k8.data(), geo.num_kv_heads, s.capacity, geo.dim_qk);
      in8.v = RowView::dense(s.v8.data(), geo.num_kv_heads, s.capacity, geo.dim_v);
      in8.k_scale = s.scales.as<float>();
      in8.v_scale = s.scales.as<float>();
    }

    const SparseSelection first = make_positions(device, opt, requests, context, 100);
    row.selected = first.total() / requests;
    const int64_t row_bytes = int64_t(esize) * (geo.dim_qk + geo.dim_extra + (geo.v_aliases_k ? 0 : geo.dim_v));
    // The fused arm's rows: 656 bytes (MLA rows) or 256 (e4m3 K + V of 128) in fp8.
    const int64_t fused_row_bytes = !fp8 ? row_bytes : geo.v_aliases_k ? 656 : geo.dim_qk + geo.dim_v;
    const int64_t fused_bytes = first.total() * fused_row_bytes;
    const int64_t mask_bytes = int64_t{requests} * context * (row_bytes + 4);  // K/V rows + the fp32 mask
    row.rotate = opt.rotate > 0
                     ? opt.rotate
                     : static_cast<int32_t>(std::clamp<int64_t>(
                           (2 * std::max<int64_t>(facts.l2_bytes, 1)) / std::max<int64_t>(fused_bytes, 1) + 1, 1, 64));
    if (device == Device::kCpu) row.rotate = 1;
    std::vector<SparseSelection> selections;
    selections.push_back(make_positions(device, opt, requests, context, 100));
    for (int32_t i = 1; i < row.rotate; ++i)
      selections.push_back(make_positions(device, opt, requests, context, 100 + i));

    // Correctness first: both arms once, compared.
    SparseDecoder decoder(device, config);
    decoder.set_plan_tuning(opt.items_per_sm, opt.min_chunk);
    MaskPath mask(device);
    const DispatchStats before = dispatch_stats();
    in8.o = o_fused.data();
    in8.lse = lse_fused.as<float>();
    const SparseDecodeOutcome outcome = decoder.try_fused(in8, selections[0]);
    const DispatchStats after = dispatch_stats();
    in.o = o_mask.data();
    in.lse = lse_mask.as<float>();
    mask.prepare(in, selections[0]);
    mask.run(in, selections[0]);
    in.lse = nullptr;  // the timed launches write o only
    row.outcome = outcome.describe();
    std::printf("[context %lld] sparse arm: %s (stats delta: fused %+lld, fallbacks %+lld)\n",
                static_cast<long long>(context), row.outcome.c_str(),
                static_cast<long long>(after.fused - before.fused),
                static_cast<long long>(after.fallbacks - before.fallbacks));
    if (outcome.fused()) {
      decoder.check_errors();
      // Per request (an error in one request is not diluted by the rest),
      // and the lse too (a missing term there would not show in o alone).
      row.agreement = worst_request_l2(read_output(device, o_fused), read_output(device, o_mask), requests);
      const double lse_diff = worst_lse_diff(download<float>(device, lse_fused.data(), lse_fused.bytes() / 4),
                                             download<float>(device, lse_mask.data(), lse_mask.bytes() / 4));
      const bool agree = row.agreement < 1e-2 && lse_diff < 1e-2;
      std::printf("[context %lld] agreement fused vs mask: relative L2 %.2e (worst request), lse %.2e (%s)\n",
                  static_cast<long long>(context), row.agreement, lse_diff, agree ? "ok" : "DISAGREE: timing refused");
      if (!agree) exit_code = 1;
    }
    // The mask arm is timed unless --fused-only: it is what runs when the sparse arm declines.
    if (!opt.fused_only || !outcome.fused()) {
      row.mask_us = bench::median_us_per_launch(
          device, [&](void* stream) { mask.run(in, selections[0], stream); }, opt.steps, opt.reps);
    }
    row.mask_mb = double(mask.transient_bytes()) / 1e6;
    row.mask_gbs = double(mask_bytes) / (row.mask_us * 1e3);
    if (outcome.fused() && row.agreement < 1e-2) {
      in8.lse = nullptr;  // the timed launches write o only
      row.fused_hot_us = bench::median_us_per_launch(
          device, [&](void* stream) { decoder.try_fused(in8, selections[0], stream); }, opt.steps, opt.reps);
      size_t next = 0;
      row.fused_cold_us = bench::median_us_per_launch(
          device, [&](void* stream) { decoder.try_fused(in8, selections[next++ % selections.size()], stream); },
          std::max<int32_t>(opt.steps, row.rotate), opt.reps);
      row.fused_gbs = double(fused_bytes) / (row.fused_cold_us * 1e3);
      row.fused_mb = double(decoder.transient_bytes()) / 1e6;
    } else {
      std::printf("[context %lld] no fused timing: the sparse arm %s\n", static_cast<long long>(context),
                  outcome.fused() ? "disagreed with the mask arm" : "fell back to the mask path");
    }
    rows.push_back(row);
    results.push_back({{"context", context},
                       {"batch", opt.batch},
                       {"geometry", geo.name},
                       {"backend", device_name(device)},
                       {"kv_dtype", opt.kv_dtype},
                       {"device", facts.name},
                       {"selected_per_request", row.selected},
                       {"sparse_outcome", row.outcome},
                       {"fused", outcome.fused()},
                       {"agreement_rel_l2", std::isfinite(row.agreement) ? json(row.agreement) : json(nullptr)},
                       {"mask_us", row.mask_us},
                       {"mask_gbs", row.mask_gbs},
                       {"fused_hot_us", std::isfinite(row.fused_hot_us) ? json(row.fused_hot_us) : json(nullptr)},
                       {"fused_cold_us", std::isfinite(row.fused_cold_us) ? json(row.fused_cold_us) : json(nullptr)},
                       {"fused_cold_gbs", std::isfinite(row.fused_gbs) ? json(row.fused_gbs) : json(nullptr)},
                       {"rotate", row.rotate},
                       {"peak_read_gbs", peak_gbs},
                       {"mask_transient_mb", row.mask_mb},
                       {"fused_transient_mb", row.fused_mb}});
  }

  std::printf("\n%-8s %-6s %-8s %-9s | %-10s %-8s | %-10s %-10s %-8s %-6s | %-8s | %-9s %-9s\n", "context", "batch",
              "sel/req", "sparsity", "mask_us", "mask_GB/s", "fused_hot", "fused_cold", "GB/s", "%peak", "speedup",
              "mask_MB", "fused_MB");
  for (const Row& r : rows) {
    const bool timed = std::isfinite(r.fused_cold_us);
    std::printf("%-8lld %-6d %-8lld %-9.1f | %-10.2f %-8.1f | ", static_cast<long long>(r.context), opt.batch,
                static_cast<long long>(r.selected), double(r.context) / double(std::max<int64_t>(r.selected, 1)),
                r.mask_us, r.mask_gbs);
    if (timed) {
      char peak[16] = "-";
      if (peak_gbs > 0) std::snprintf(peak, sizeof(peak), "%.1f", 100.0 * r.fused_gbs / peak_gbs);
      std::printf("%-10.2f %-10.2f %-8.1f %-6s | %-8.2f | %-9.1f %-9.1f\n", r.fused_hot_us, r.fused_cold_us,
                  r.fused_gbs, peak, r.mask_us / r.fused_cold_us, r.mask_mb, r.fused_mb);
    } else {
      std::printf("%-10s %-10s %-8s %-6s | %-8s | %-9.1f %-9s  (%s)\n", "-", "-", "-", "-", "refused", r.mask_mb, "-",
                  r.outcome.c_str());
    }
  }
  if (geo.name == "dsa") {
    // TFLOP/s counts 2 x (576 + 512) flops per head and selected token (the peers' convention).
    for (const Row& r : rows) {
      if (!std::isfinite(r.fused_cold_us)) continue;
      const double flops =
          2.0 * (geo.dim_qk + geo.dim_extra + geo.dim_v) * geo.num_qo_heads * double(r.selected) * opt.batch;
      std::printf("context %lld: fused %.1f TFLOP/s (cold), %.1f (hot); mask %.1f\n", static_cast<long long>(r.context),
                  flops / (r.fused_cold_us * 1e6), flops / (r.fused_hot_us * 1e6), flops / (r.mask_us * 1e6));
    }
  }
  if (device == Device::kCuda) {
    std::printf("times: median of %d CUDA-graph replays of %d launches each (per launch, merge included); fused_cold\n"
                "rotates among enough selections that their rows exceed 2x the L2; speedup = mask / fused_cold;\n"
                "GB/s counts the K/V bytes each arm must read (mask: whole window + fp32 mask)\n",
                opt.reps, opt.steps);
  } else {
    std::printf("times: CPU backend, median of %d runs of %d steps (steady clock); no bandwidth peak on the CPU;\n"
                "speedup = mask / fused\n",
                opt.reps, opt.steps);
  }
  if (!opt.json_path.empty()) std::ofstream(opt.json_path) << results.dump(2) << "\n";
  return exit_code;
}
