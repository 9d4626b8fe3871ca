// A small synthetic transformer (fixed-seed random weights) whose attention
// layers are the library's block-sparse layer (or, with
// ToyAttention::kStaticBlockSparse, its static per-query-head layer). Its dense parts (embeddings,
// projections, MLP) run in fp32 on the host; attention runs on the layer's
// device. Used to check that the fused path and the mask path decode the
// same greedy tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"

namespace sparsepage::testing {

enum class ToyAttention { kBlockSparse, kStaticBlockSparse };

struct ToyModelConfig {
  int32_t vocab = 96;
  int32_t d_model = 64;
  int32_t layers = 2;
  ToyAttention kind = ToyAttention::kBlockSparse;
  BlockSparseConfig attention{8, 2, 64, 16, 4, 1, 64};  // 8 q heads over 2 KV heads, head dim 64, blocks of 16, top 4
  // kStaticBlockSparse: 8 q heads over 2 KV heads, head dim 64, blocks of 16, 2 local blocks, vertical stride 4.
  // Its prompt runs through decode too (the pattern holds at every position).
  StaticBlockSparseConfig static_attention{8, 2, 64, 16, 2, 4, 64};
  int32_t batch = 1;  // sequences decoded side by side through one layer call
  uint64_t seed = 1234;
  /// > 0: the prompt (all but its last token) goes through the layers'
  /// chunked prefill (prefill()) in chunks of this many tokens per
  /// sequence, its remainder token by token as with 0.
  int32_t prefill_chunk = 0;
};

class ToyModel {
 public:
  ToyModel(Device device, const ToyModelConfig& config, DispatchConfig dispatch);
  ~ToyModel();
  /// Feeds one prompt per sequence (`batch` of them, of one length; prefill
  /// keeps the mask path), then decodes `steps` tokens greedily for each.
  /// Returns the generated tokens per sequence.
  std::vector<std::vector<int32_t>> generate(const std::vector<std::vector<int32_t>>& prompts, int32_t steps);
  /// Per sequence and generated token: the gap between the two largest
  /// logits that chose it (logits are O(1)).
  const std::vector<std::vector<float>>& margins() const { return margins_; }
  /// Decode steps that ran the fused path / were in the sparse regime (for
  /// the static layer: kept fewer tokens than the window holds).
  int32_t fused_steps() const { return fused_steps_; }
  int32_t sparse_steps() const { return sparse_steps_; }

 private:
  struct Weights;
  std::vector<std::vector<float>> forward(const std::vector<int32_t>& tokens, bool prefill);
  /// One chunk of the prompt: tokens[b] are sequence b's next chunk tokens.
  void forward_chunk(const std::vector<std::vector<int32_t>>& tokens);
  Device device_;
  ToyModelConfig config_;
  std::unique_ptr<Weights> weights_;
  std::vector<std::unique_ptr<BlockSparseAttention>> layers_;
  std::vector<std::unique_ptr<StaticBlockSparseAttention>> static_layers_;
  std::vector<std::vector<float>> margins_;
  int32_t fused_steps_ = 0, sparse_steps_ = 0;
  int64_t position_ = 0;
};

/// The same kind of model over DSA (MLA + top-k token indexer) layers. The
/// default attention shape is small, for the CPU backend; on CUDA use
/// `cuda_shape()` (the MLA kernel takes latent 512 with rope 64).
struct DsaToyConfig {
  int32_t vocab = 96;
  int32_t d_model = 64;
  int32_t layers = 2;
  DsaConfig attention{8, 64, 16, 4, 32, 32, 0.0f, 64};  // 8 heads, latent 64 + rope 16, 4 index heads of 32, top 32
  uint64_t seed = 4321;
  /// > 0: the prompt (all but its last token) goes through prefill() in
  /// chunks of this many tokens, its remainder token by token (the layer's
  /// chunked prefill takes latent 512 + rope 64: cuda_shape()).
  int32_t prefill_chunk = 0;
  /// The same model at latent 512 + rope 64 (index heads of 64), which both backends run.
  static DsaToyConfig cuda_shape() {
    DsaToyConfig c;
    c.attention = {8, 512, 64, 4, 64, 32, 0.0f, 64};
    return c;
  }
};

class DsaToyModel {
 public:
  DsaToyModel(Device device, const DsaToyConfig& config, DispatchConfig dispatch);
  ~DsaToyModel();
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, int32_t steps);
  /// Per generated token: the gap between the two largest logits ([1][steps]).
  const std::vector<std::vector<float>>& margins() const { return margins_; }
  int32_t fused_steps() const { return fused_steps_; }
  int32_t sparse_steps() const { return sparse_steps_; }

 private:
  struct Weights;
  std::vector<float> forward(int32_t token, bool prefill);
  void forward_chunk(const std::vector<int32_t>& tokens);
  Device device_;
  DsaToyConfig config_;
  std::unique_ptr<Weights> weights_;
  std::vector<std::unique_ptr<DsaAttention>> layers_;
  std::vector<std::vector<float>> margins_;
  int32_t fused_steps_ = 0, sparse_steps_ = 0;
  int64_t position_ = 0;
};

}  // namespace sparsepage::testing
