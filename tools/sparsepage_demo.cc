// A one-step tour of the library on the CPU backend: a dense bf16 cache at
// the block-sparse geometry, a top-k block selection turned into a page
// table, the dispatch decision, the fused paged decode and the mask path
// over the same set, and how far apart they are.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "sparsepage/cache.h"
#include "sparsepage/decode.h"
#include "sparsepage/dense_paths.h"
#include "sparsepage/dispatch.h"
#include "sparsepage/selection.h"

using namespace sparsepage;

namespace {

std::vector<uint16_t> random_bf16(size_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> out(count);
  for (auto& x : out) x = float_to_bf16(dist(rng));
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparsepage demo: one sparse decode step on the CPU backend"};
  int64_t context = 32768;
  int32_t batch = 1, topk_blocks = 16;
  app.add_option("--context", context, "live tokens in the cache")->check(CLI::Range(int64_t{256}, int64_t{1} << 20));
  app.add_option("--batch", batch, "sequences")->check(CLI::Range(1, 64));
  app.add_option("--topk-blocks", topk_blocks, "blocks of 128 tokens kept per KV head (plus the final block)")
      ->check(CLI::Range(1, 1024));
  CLI11_PARSE(app, argc, argv);

  constexpr int32_t kQoHeads = 64, kKvHeads = 4, kDim = 128, kBlock = 128;
  const HeadFolding fold = HeadFolding::make(batch, kQoHeads, kKvHeads);
  std::mt19937_64 rng(2026);

  // The cache: [B, 4, Cap, 128] bf16, capacity grown in steps past the live length.
  DenseKVCache cache(Device::kCpu, CacheMode::kBF16, batch, kKvHeads, kKvHeads, kDim, kDim, 4096);
  {
    const auto k = random_bf16(size_t(batch) * kKvHeads * size_t(context) * kDim, rng);
    const auto v = random_bf16(k.size(), rng);
    cache.update_and_fetch(k.data(), v.data(), DType::kBF16, context);
  }
  const RawKVAllocations raw = *cache.raw_kv_allocations();
  const auto layout = ContiguousCacheLayout::of(raw.k_shape);

  // Selection: top-k random full blocks per (sequence, KV head) plus the final block.
  const int64_t num_blocks = (context + kBlock - 1) / kBlock;
  const int32_t scored = static_cast<int32_t>(std::min<int64_t>(topk_blocks, num_blocks - 1));
  std::vector<int32_t> block_ids, block_counts;
  std::vector<int64_t> row_base, live;
  for (int32_t r = 0; r < fold.num_requests(); ++r) {
    std::vector<int32_t> blocks(static_cast<size_t>(num_blocks - 1));
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    blocks.resize(static_cast<size_t>(scored));
    blocks.push_back(static_cast<int32_t>(num_blocks - 1));
    block_ids.insert(block_ids.end(), blocks.begin(), blocks.end());
    block_counts.push_back(static_cast<int32_t>(blocks.size()));
    row_base.push_back(layout.row(r / kKvHeads, r % kKvHeads, 0));
    live.push_back(context);
  }
  const SparseSelection selection =
      selection_from_blocks(upload(Device::kCpu, block_ids), block_counts, kBlock, row_base, live);
  const PageTableStructure table = build_page_table_structure(selection.counts, 1);

  // Policy and plan.
  PlanShape shape;
  shape.group_size = fold.group_size();
  shape.head_dim_v = kDim;
  shape.num_sms = 2;
  const DecodePlan plan = make_decode_plan(table.seq_lens, shape);
  DispatchInput in;
  in.num_requests = fold.num_requests();
  in.selected_rows = selection.total();
  in.live_len = context;
  in.chunks = static_cast<int64_t>(plan.work.size());
  in.merge = plan.needs_merge();
  const SparseDecodeOutcome outcome = decide_sparse_decode(in, process_dispatch_config());
  record_outcome(outcome);

  const auto q = random_bf16(size_t(fold.num_requests()) * fold.group_size() * kDim, rng);
  const float scale = 1.0f / std::sqrt(float(kDim));
  const size_t out_elems = size_t(fold.num_requests()) * fold.group_size() * kDim;

  // Fused paged decode over the selection (CPU backend).
  std::vector<uint16_t> o_fused(out_elems, float_to_bf16(NAN));
  DecodeParams p;
  p.indptr = table.indptr.data();
  p.indices = selection.indices.as<int32_t>();
  p.first_page_offset = table.first_page_offset.data();
  p.seq_lens = table.seq_lens.data();
  p.num_requests = fold.num_requests();
  p.num_pool_pages = layout.num_rows();
  p.group_size = fold.group_size();
  p.q = q.data();
  p.k = {raw.k, layout.row_stride(), kDim};
  p.v = {raw.v, layout.row_stride(), kDim};
  p.scale = scale;
  p.o = o_fused.data();
  Buffer workspace(Device::kCpu, plan.workspace.total);
  auto start = std::chrono::steady_clock::now();
  run_decode_cpu(p, plan, workspace.data());
  const double fused_s = seconds_since(start);

  // Mask path over the same set: 0 on selected columns, -inf elsewhere.
  std::vector<float> mask(size_t(fold.num_requests()) * size_t(context), -INFINITY);
  const auto rows = selection.materialize();
  for (int32_t r = 0; r < fold.num_requests(); ++r) {
    for (int32_t row : rows[size_t(r)]) mask[size_t(r) * size_t(context) + size_t(row - row_base[size_t(r)])] = 0.0f;
  }
  std::vector<uint16_t> o_mask(out_elems, float_to_bf16(NAN));
  MaskedDecodeParams m;
  m.batch = batch;
  m.num_kv_heads = kKvHeads;
  m.group_size = fold.group_size();
  m.live_len = context;
  m.q = q.data();
  m.k = {raw.k, kKvHeads, raw.k_shape.capacity, kDim, kDim};
  m.v = {raw.v, kKvHeads, raw.v_shape.capacity, kDim, kDim};
  m.mask = mask.data();
  m.scale = scale;
  m.o = o_mask.data();
  start = std::chrono::steady_clock::now();
  run_masked_decode_cpu(m);
  const double mask_s = seconds_since(start);

  double diff = 0, norm = 0;
  for (size_t i = 0; i < out_elems; ++i) {
    const double a = bf16_to_float(o_fused[i]), b = bf16_to_float(o_mask[i]);
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  const double rel = std::sqrt(diff / norm);
  std::printf("backend: cpu (the CUDA path is exercised by tools/sparse_paged_decode_bench and tests/cuda)\n");
  std::printf("geometry: batch %d, 64 query heads over 4 KV heads, head dim 128, bf16, context %lld\n", batch,
              static_cast<long long>(context));
  std::printf("selection: %lld rows (%d blocks of 128 + final block per KV head), sparsity %.1fx\n",
              static_cast<long long>(selection.total()), scored, double(context) * fold.num_requests() / double(selection.total()));
  std::printf("policy: %s\n", outcome.describe().c_str());
  std::printf("fused paged decode (cpu): %.2f ms\nmask path (cpu):          %.2f ms\n", fused_s * 1e3, mask_s * 1e3);
  std::printf("agreement: relative L2 %.2e (%s, bound 1e-2)\n", rel, rel < 1e-2 && std::isfinite(rel) ? "ok" : "FAIL");
  return rel < 1e-2 && std::isfinite(rel) ? 0 : 1;
}
