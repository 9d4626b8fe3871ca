// Helpers shared by the CUDA tests: skipping without a device, uploading a
// random paged problem, and running it on the GPU and on the CPU backend.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/memory.h"
#include "sparsepage/plan.h"
#include "support/reference.h"

#define SKIP_WITHOUT_CUDA() \
  do { \
    if (!::sparsepage::cuda_available()) GTEST_SKIP() << "no CUDA device: sparsepage::cuda_available() is false"; \
  } while (0)

namespace sparsepage::testing {

/// SPARSEPAGE_TEST_QUICK=1: tests that are slow only because of their size
/// run a smaller one (same code paths: every kernel, split and merge they
/// cover stays covered). scripts/gpu_check.sh sets it under
/// compute-sanitizer, whose tools slow kernels by 10-100x.
inline bool quick_mode() {
  static const bool quick = [] {
    const char* v = std::getenv("SPARSEPAGE_TEST_QUICK");
    return v != nullptr && std::string(v) == "1";
  }();
  return quick;
}

/// `steps` decode steps, or under quick_mode() 8: the greedy tests still
/// compare every layer's fused and mask paths, over fewer tokens.
inline int32_t quick_steps(int32_t steps) { return quick_mode() ? std::min(steps, 8) : steps; }

/// `lens` as they are, or under quick_mode() each capped at `cap` tokens
/// (0, 1 and the other short edge cases stay; equal counts stay equal).
inline std::vector<int32_t> quick_lens(std::vector<int32_t> lens, int32_t cap = 512) {
  if (quick_mode()) {
    for (int32_t& len : lens) len = std::min(len, cap);
  }
  return lens;
}

inline void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(err));
}

/// A stream of its own and a CUDA graph captured on it (global mode: an
/// allocation or a synchronize inside fails the capture), destroyed with it.
class StreamGraph {
 public:
  StreamGraph() { cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"); }
  ~StreamGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    cudaStreamDestroy(stream_);
  }
  StreamGraph(const StreamGraph&) = delete;
  StreamGraph& operator=(const StreamGraph&) = delete;
  cudaStream_t stream() const { return stream_; }
  /// Captures what `enqueue(stream())` enqueues as the graph.
  template <class Enqueue>
  void capture(Enqueue&& enqueue, cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal) {
    cuda_ok(cudaStreamBeginCapture(stream_, mode), "begin capture");
    enqueue(stream_);
    cuda_ok(cudaStreamEndCapture(stream_, &graph_), "end capture: the work did something a graph cannot hold");
    cuda_ok(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
  }
  /// Launches the graph on the stream.
  void launch() { cuda_ok(cudaGraphLaunch(exec_, stream_), "replay"); }
  /// Launches the graph and waits for it.
  void replay() {
    launch();
    cuda_ok(cudaStreamSynchronize(stream_), "replay");
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

/// The plan shape the CUDA backend is tuned for (see docs in decode_partial.cuh).
inline PlanShape cuda_plan_shape(int32_t group_size, int32_t head_dim_v, int32_t fixed_chunk_tokens = 0) {
  PlanShape shape;
  shape.group_size = group_size;
  shape.head_dim_v = head_dim_v;
  shape.num_sms = cuda_multiprocessor_count();
  shape.items_per_sm = 2;
  shape.min_chunk_tokens = 64;
  shape.chunk_granule = 64;
  shape.fixed_chunk_tokens = fixed_chunk_tokens;
  return shape;
}

/// A PagedProblem's arrays in device memory.
struct DeviceProblem {
  Buffer indptr, indices, first_page_offset, seq_lens, q, q_extra, k, v, e;

  explicit DeviceProblem(const PagedProblem& pb) {
    indptr = upload(Device::kCuda, pb.table.indptr);
    indices = upload(Device::kCuda, pb.indices);
    first_page_offset = upload(Device::kCuda, pb.table.first_page_offset);
    seq_lens = upload(Device::kCuda, pb.table.seq_lens);
    q = upload(Device::kCuda, pb.q);
    q_extra = upload(Device::kCuda, pb.q_extra);
    k = upload(Device::kCuda, pb.k_pool);
    v = upload(Device::kCuda, pb.v_pool);
    e = upload(Device::kCuda, pb.e_pool);
  }

  DecodeParams params(const PagedProblem& pb, void* o, float* lse) const {
    DecodeParams p = pb.host_params(o, lse);
    p.indptr = indptr.as<int32_t>();
    p.indices = indices.as<int32_t>();
    p.first_page_offset = first_page_offset.as<int32_t>();
    p.seq_lens = seq_lens.as<int32_t>();
    p.q = q.data();
    p.k.data = k.data();
    p.v.data = pb.spec.v_aliases_k ? k.data() : v.data();
    if (pb.spec.dim_extra > 0) {
      p.q_extra = q_extra.data();
      p.k_extra.data = e.data();
    }
    return p;
  }
};

struct DecodeOutput {
  std::vector<float> o;    // [R, G, dim_v]
  std::vector<float> lse;  // [R, G]
  uint32_t error_flag = 0;
};

inline size_t o_count(const PagedProblem& pb) {
  return static_cast<size_t>(pb.num_requests()) * pb.spec.group_size * pb.spec.dim_v;
}
inline size_t lse_count(const PagedProblem& pb) { return static_cast<size_t>(pb.num_requests()) * pb.spec.group_size; }

/// Runs the fused decode on the GPU with outputs and workspace poisoned
/// (0xFF = NaN), so anything left unwritten fails the comparison.
inline DecodeOutput run_gpu(const PagedProblem& pb, const PlanShape& shape) {
  const DeviceProblem dp(pb);
  const size_t esize = dtype_size(pb.spec.dtype);
  Buffer o(Device::kCuda, o_count(pb) * esize);
  Buffer lse(Device::kCuda, lse_count(pb) * sizeof(float));
  fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
  fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, shape);
  Buffer ws(Device::kCuda, std::max<size_t>(plan.workspace.total, 256));
  fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());
  upload_plan_cuda(plan, ws.data());
  run_decode_cuda(dp.params(pb, o.data(), lse.as<float>()), plan, ws.data());
  cuda_ok(cudaDeviceSynchronize(), "decode");
  DecodeOutput out;
  out.o = as_float(pb.spec.dtype, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  out.lse = download<float>(Device::kCuda, lse.data(), lse_count(pb));
  out.error_flag = read_decode_error_flag(plan, ws.data());
  return out;
}

inline DecodeOutput run_cpu(const PagedProblem& pb, const PlanShape& shape) {
  std::vector<uint8_t> o(o_count(pb) * dtype_size(pb.spec.dtype));
  std::vector<float> lse(lse_count(pb));
  const DecodePlan plan = make_decode_plan(pb.table.seq_lens, shape);
  Buffer ws(Device::kCpu, plan.workspace.total);
  run_decode_cpu(pb.host_params(o.data(), lse.data()), plan, ws.data());
  DecodeOutput out;
  out.o = as_float(pb.spec.dtype, o);
  out.lse = lse;
  return out;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

/// o within 1e-2 relative L2 of the fp64 reference (no NaN), lse close, and
/// requests with nothing to attend exactly o = 0, lse = -inf.
inline void expect_matches_reference(const PagedProblem& pb, const DecodeOutput& got, const Reference& ref,
                                     const std::string& what) {
  EXPECT_LT(relative_l2(got.o, ref.o), 1e-2) << what;
  const int32_t dv = pb.spec.dim_v;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_TRUE(std::isinf(got.lse[i]) && got.lse[i] < 0) << what << ": lse[" << i << "] = " << got.lse[i];
      for (int32_t d = 0; d < dv; ++d) ASSERT_EQ(got.o[i * dv + d], 0.0f) << what << ": empty row " << i;
    } else {
      EXPECT_NEAR(got.lse[i], ref.lse[i], 1e-2 * std::max(1.0, std::fabs(ref.lse[i]))) << what << ": lse[" << i << "]";
    }
  }
}

}  // namespace sparsepage::testing
