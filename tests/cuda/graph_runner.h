// A layer step run the way a serving loop replays it: the first call runs
// eagerly (it plans and sizes everything), the second is captured in a CUDA
// graph, and that graph is replayed for it and every later call, on a stream
// of its own, while the caller changes lengths, tables and pools between
// replays. Shared by the continuous-batching and engine-pools GPU tests.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "cuda/cuda_test_util.h"
#include "sparsepage/layer.h"

namespace sparsepage::testing {

class GraphRunner {
 public:
  GraphRunner() { cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"); }
  ~GraphRunner() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    cudaStreamDestroy(stream_);
  }
  LayerStep operator()(const std::function<LayerStep(void*)>& step) {
    if (calls_++ == 0) {
      const LayerStep s = step(stream_);
      cuda_ok(cudaStreamSynchronize(stream_), "eager step");
      return s;
    }
    if (exec_ == nullptr) {
      cuda_ok(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), "begin capture");
      captured_ = step(stream_);
      cuda_ok(cudaStreamEndCapture(stream_, &graph_), "end capture");
      cuda_ok(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
    }
    cuda_ok(cudaGraphLaunch(exec_, stream_), "replay");
    cuda_ok(cudaStreamSynchronize(stream_), "replayed step");
    ++replays_;
    return captured_;
  }
  int64_t replays() const { return replays_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  LayerStep captured_;
  int64_t calls_ = 0, replays_ = 0;
};

}  // namespace sparsepage::testing
