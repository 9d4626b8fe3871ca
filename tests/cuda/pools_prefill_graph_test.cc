// Prefill chunks over engine-owned pools captured in a CUDA graph: given
// the engine's host copy of the lengths (EnginePagedKV::host_seq_lens), the
// block-sparse and DSA chunks decide on the host and read nothing back.
// One chunk runs eagerly (it plans and sizes everything), the next is
// captured with global capture mode (an allocation, synchronization or host
// read inside it fails the capture), and the graph is replayed for it and
// the later chunks while the engine moves kv.seq_lens on the device and
// refills the query buffers. Before each replay the output is poisoned with
// NaN; it must equal, bit for bit, a twin layer's uncaptured chunk that
// reads the lengths back. The form without the host copy is refused by
// name while the stream is captured. The host-lengths form is also checked
// against the read-back form as on the CPU. Every test skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "support/expect_error.h"
#include "support/pools_prefill_chunks.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

using testing::cuda_ok;
using testing::PoolsChunks;

class Stream {
 public:
  Stream() { cuda_ok(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "stream"); }
  ~Stream() { cudaStreamDestroy(s_); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

void check_captured_chunks(const PoolsChunks& p) {
  ASSERT_GE(p.chunks(), 2) << "one eager chunk, then captured ones";
  const int32_t batch = p.batch(), n = p.num_tokens();
  Stream stream;
  const std::unique_ptr<SparseLayer> graphed = p.make_layer(), eager = p.make_layer();
  // The graphed chunk's buffers, refilled in place (as an engine's are).
  std::vector<Buffer> in;
  for (const Buffer& b : p.inputs(0)) in.emplace_back(Device::kCuda, b.bytes());
  Buffer o(Device::kCuda, p.o_bytes());
  Buffer lens_dev(Device::kCuda, static_cast<size_t>(batch) * sizeof(int32_t));
  std::vector<int32_t> host(static_cast<size_t>(batch));
  EnginePagedKV kv = p.kv(0);
  kv.seq_lens = lens_dev.as<int32_t>();
  kv.host_seq_lens = host.data();

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  for (int32_t c = 0; c < p.chunks(); ++c) {
    SCOPED_TRACE("chunk " + std::to_string(c));
    host = p.lens(c);  // the engine's host copy, read only when the chunk is decided (eager, capture)
    cuda_ok(cudaMemcpyAsync(lens_dev.data(), host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                            stream.get()),
            "lengths");
    for (size_t i = 0; i < in.size(); ++i) {
      cuda_ok(
          cudaMemcpyAsync(in[i].data(), p.inputs(c)[i].data(), in[i].bytes(), cudaMemcpyDeviceToDevice, stream.get()),
          "inputs");
    }
    cuda_ok(cudaMemsetAsync(o.data(), 0xFF, o.bytes(), stream.get()), "poison o");  // bf16 NaN
    if (c == 0) {
      p.run(*graphed, testing::pointers(in), o.data(), kv, stream.get());
    } else {
      if (exec == nullptr) {
        cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), "begin capture");
        p.run(*graphed, testing::pointers(in), o.data(), kv, stream.get());
        cuda_ok(cudaStreamEndCapture(stream.get(), &graph), "end capture: the chunk did something a graph cannot hold");
        cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
      }
      cuda_ok(cudaGraphLaunch(exec, stream.get()), "replay");
    }
    cuda_ok(cudaStreamSynchronize(stream.get()), "chunk");
    graphed->check_errors(stream.get());

    Buffer want = testing::poisoned(Device::kCuda, p.o_elems());
    p.run(*eager, testing::pointers(p.inputs(c)), want.data(), p.kv(c));  // uncaptured, the lengths read back
    eager->check_errors();
    const auto got = download<uint8_t>(Device::kCuda, o.data(), p.o_bytes());
    EXPECT_EQ(got, download<uint8_t>(Device::kCuda, want.data(), p.o_bytes()))
        << (c == 0 ? "the eager chunk" : "the replayed chunk") << " differs from the uncaptured one";
    const std::vector<float> values = testing::read_bf16(Device::kCuda, o, p.o_elems());
    const size_t row = p.o_elems() / static_cast<size_t>(batch);
    for (int32_t b = 0; b < batch; ++b) {
      const auto first = values.begin() + static_cast<int64_t>(static_cast<size_t>(b) * row);
      const std::vector<float> rows(first, first + static_cast<int64_t>(row));
      if (!p.active(b)) {
        EXPECT_TRUE(std::all_of(rows.begin(), rows.end(), [](float x) { return x == 0.0f; })) << "free slot " << b;
      } else {
        EXPECT_TRUE(std::none_of(rows.begin(), rows.end(), [](float x) { return std::isnan(x); }))
            << "slot " << b << " holds NaN (" << n << " tokens)";
      }
    }
  }
  ASSERT_NE(exec, nullptr) << "nothing was captured";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  // Without the host copy the chunk must read the lengths back: refused by
  // name inside a capture, which then ends empty.
  cuda_ok(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), "begin capture");
  EXPECT_TRUE(
      testing::throws_error_naming([&] { p.run(*graphed, testing::pointers(in), o.data(), p.kv(0), stream.get()); },
                                   "without kv.host_seq_lens the chunk reads kv.seq_lens back"));
  cuda_ok(cudaStreamEndCapture(stream.get(), &graph), "end the refused capture");
  size_t nodes = 1;
  cuda_ok(cudaGraphGetNodes(graph, nullptr, &nodes), "nodes");
  EXPECT_EQ(nodes, size_t{0}) << "the refused chunk queued work";
  cudaGraphDestroy(graph);
}

// The CUDA prefill indexer scores 64- or 128-token blocks at head_dim 128;
// top-2: the dense regime ends at 256 tokens.
BlockSparseConfig block_config() { return {8, 2, 128, 64, 2, 1, 256}; }

// 64 query and index heads of 128 (the MLA prefill runs 64 heads per CTA), top-64.
DsaConfig dsa_config() { return {64, 512, 64, 64, 128, 64, 0.0f, 256}; }

TEST(PoolsPrefillGraph, BlockSparseReplaysBitForBit) {
  SKIP_WITHOUT_CUDA();
  // A slot out of the calls (one launch per slot, its rows zeroed on the
  // stream), then every slot in them (one launch); into the sparse regime.
  check_captured_chunks(PoolsChunks(Device::kCuda, block_config(), {{128, -1, 256}, 128, 3, 1}));
  check_captured_chunks(PoolsChunks(Device::kCuda, block_config(), {{192, 64}, 64, 3, 2}));
}

TEST(PoolsPrefillGraph, DsaReplaysBitForBit) {
  SKIP_WITHOUT_CUDA();
  check_captured_chunks(PoolsChunks(Device::kCuda, dsa_config(), {{40, -1, 100}, 24, 3, 3}));
  check_captured_chunks(PoolsChunks(Device::kCuda, dsa_config(), {{10, 70}, 32, 3, 4}));
}

TEST(PoolsPrefillHostLensCuda, BlockSparseEqualsTheReadBackFormAndRefusesBadCopies) {
  SKIP_WITHOUT_CUDA();
  testing::check_pools_host_lens(PoolsChunks(Device::kCuda, block_config(), {{128, -1, 256}, 128, 2, 5}));
}

TEST(PoolsPrefillHostLensCuda, DsaEqualsTheReadBackFormAndRefusesBadCopies) {
  SKIP_WITHOUT_CUDA();
  testing::check_pools_host_lens(PoolsChunks(Device::kCuda, dsa_config(), {{40, -1, 100}, 24, 2, 6}));
}

}  // namespace
}  // namespace sparsepage
