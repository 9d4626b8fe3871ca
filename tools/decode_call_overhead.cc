// Host time of one run_decode_cuda call from C++: the baseline the Python
// binding and the torch op are compared with (python/benchmarks/op_overhead.py
// times the same tiny decode: 1 request, 8 query heads, 64 tokens, head dim
// 128, bf16, page size 1). Prints microseconds per call over 2000 calls
// after 50 warm-ups (bounded below by the GPU's time per launch), then the
// host time alone: the best of five bursts of 200 calls enqueued without
// waiting. Needs a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/memory.h"
#include "sparsepage/page_table.h"

int main() {
  using namespace sparsepage;
  if (!cuda_available()) {
    std::printf("decode_call_overhead: no CUDA device\n");
    return 1;
  }
  const std::vector<int32_t> lens = {64};
  const PageTableStructure t = build_page_table_structure(lens, 1);
  PlanShape shape;
  shape.group_size = 8;
  shape.head_dim_v = 128;
  shape.num_sms = cuda_multiprocessor_count();
  const DecodePlan plan = make_decode_plan(lens, shape);
  std::vector<int32_t> ids(64);
  for (int32_t i = 0; i < 64; ++i) ids[static_cast<size_t>(i)] = i * 37 % 4096;
  Buffer indptr = upload(Device::kCuda, t.indptr), seq = upload(Device::kCuda, t.seq_lens),
         indices = upload(Device::kCuda, ids);
  Buffer k(Device::kCuda, size_t{4096} * 128 * 2), q(Device::kCuda, size_t{8} * 128 * 2), o(Device::kCuda, q.bytes());
  fill_bytes(k.data(), Device::kCuda, 0, k.bytes());
  fill_bytes(q.data(), Device::kCuda, 0, q.bytes());
  Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
  upload_plan_cuda(plan, ws.data());
  DecodeParams p;
  p.dtype = DType::kBF16;
  p.indptr = indptr.as<int32_t>();
  p.indices = indices.as<int32_t>();
  p.seq_lens = seq.as<int32_t>();
  p.num_requests = 1;
  p.num_indices = 64;
  p.num_pool_pages = 4096;
  p.group_size = 8;
  p.q = q.data();
  p.k = {k.data(), 128, 128};
  p.v = p.k;
  p.o = o.data();
  p.scale = 0.1f;
  for (int i = 0; i < 50; ++i) run_decode_cuda(p, plan, ws.data());
  cudaDeviceSynchronize();
  const int n = 2000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) run_decode_cuda(p, plan, ws.data());
  cudaDeviceSynchronize();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
  std::printf("C++ run_decode_cuda %8.2f us/call\n", us);
  // Host time alone: 200 calls enqueued without waiting (well inside the
  // launch queue), timed before the synchronization. The figure above is
  // bounded below by the GPU's time per launch; this one is not.
  const int burst = 200;
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    cudaDeviceSynchronize();
    const auto h0 = std::chrono::steady_clock::now();
    for (int i = 0; i < burst; ++i) run_decode_cuda(p, plan, ws.data());
    const double host =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count() / burst;
    best = std::min(best, host);
  }
  cudaDeviceSynchronize();
  std::printf("C++ run_decode_cuda host %8.2f us/call (enqueue only, best of 5 bursts of %d)\n", best, burst);
  return 0;
}
