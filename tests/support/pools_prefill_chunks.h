// Consecutive prefill chunks over engine-owned pools (KVStorage::kEnginePools,
// prefill(tokens, kv, num_tokens)) for the block-sparse and DSA layers, with
// and without the engine's host copy of the lengths
// (EnginePagedKV::host_seq_lens). The CPU and CUDA suites check the two
// forms against each other; the CUDA suite captures the host-lengths form
// in a CUDA graph (tests/cuda/pools_prefill_graph_test.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "sparsepage/layer.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "support/engine_pool.h"

namespace sparsepage::testing {

struct PoolsChunksCase {
  /// Each slot's length before the first chunk; a negative entry: a slot
  /// that is in no call (length 0 in every chunk, its output rows zero).
  std::vector<int64_t> prompt;
  int32_t num_tokens = 0;
  int32_t chunks = 1;  // consecutive chunks of num_tokens per active slot
  uint64_t seed = 1;
};

/// The engine's side: its pools (K/V rows or MLA rows, and bf16 index keys,
/// written on the host for every position up to the last chunk's end, the
/// rest NaN, through a shuffled table), each chunk's queries (multiples of
/// 1/4) on the device and each chunk's lengths, on the host and the device.
class PoolsChunks {
 public:
  PoolsChunks(Device device, const BlockSparseConfig& config, const PoolsChunksCase& c);
  PoolsChunks(Device device, const DsaConfig& config, const PoolsChunksCase& c);

  Device device() const { return device_; }
  int32_t batch() const { return batch_; }
  int32_t num_tokens() const { return n_; }
  int32_t chunks() const { return chunks_; }
  int64_t max_seq_len() const { return bound_; }
  /// Chunk c's lengths with the chunk (0: a slot not in the call).
  const std::vector<int32_t>& lens(int32_t c) const { return lens_[static_cast<size_t>(c)]; }
  bool active(int32_t b) const { return lens_[0][static_cast<size_t>(b)] > 0; }
  /// The pools with chunk c's device lengths (kv.seq_lens) and no host copy.
  EnginePagedKV kv(int32_t c) const;
  /// Chunk c's query-side inputs, in the order the model's token struct
  /// takes them (block-sparse: q, index_q; DSA: q_latent, q_pe, q_index,
  /// index_weights), and their bytes.
  const std::vector<Buffer>& inputs(int32_t c) const { return inputs_[static_cast<size_t>(c)]; }
  /// Output bytes of one chunk ([batch, num_tokens, heads, dim] bf16).
  size_t o_bytes() const { return o_elems_ * 2; }
  size_t o_elems() const { return o_elems_; }

  /// A fresh engine-pools layer of the model (every path fused).
  std::unique_ptr<SparseLayer> make_layer() const;
  /// An engine-paged layer of the same model (a layer that keeps its lengths).
  std::unique_ptr<SparseLayer> make_paged_layer() const;
  /// One chunk on `layer` (from make_layer()) over `kv` with query inputs
  /// `in` (pointers in inputs()' order) into `o`.
  void run(SparseLayer& layer, const std::vector<const void*>& in, void* o, const EnginePagedKV& kv,
           void* stream = nullptr) const;
  /// The same through a layer from make_paged_layer(), index_k set (the
  /// form's refusals come before it reads anything).
  void run_paged(SparseLayer& layer, const std::vector<const void*>& in, void* o, const EnginePagedKV& kv) const;

 private:
  void build(std::mt19937_64& rng, int64_t kv_elems, int32_t num_pools, int32_t key_dim);

  Device device_;
  bool dsa_;
  BlockSparseConfig block_;
  DsaConfig mla_;
  int32_t batch_, n_, chunks_;
  int64_t bound_ = 0;
  size_t o_elems_ = 0;
  std::vector<int64_t> prompt_;
  std::vector<std::vector<int32_t>> lens_;
  std::vector<Buffer> lens_dev_;
  std::unique_ptr<EnginePool> pool_;
  std::unique_ptr<EngineKeys> keys_;
  EnginePagedKV kv_;
  std::vector<std::vector<Buffer>> inputs_;
  Buffer index_k_;  // for run_paged only: never read
};

/// Pointers of `buffers`, in order.
std::vector<const void*> pointers(const std::vector<Buffer>& buffers);

/// Every chunk on one layer twice, NaN-poisoned outputs: kv.seq_lens read
/// back (host_seq_lens null), then with the host copy given; the outputs
/// must be equal bit for bit and hold no NaN (the free slots' rows zero),
/// the reported positions equal. Then, with the host copy, refused by name
/// and o untouched: a host length past max_seq_len and one below the chunk
/// (on CUDA the device lengths stay good: a disagreement the host sees),
/// every host length 0, (block-sparse) a chunk off the block grid, (CPU) a
/// host copy that differs from kv.seq_lens, and an engine-paged layer
/// given host_seq_lens.
void check_pools_host_lens(const PoolsChunks& p);

}  // namespace sparsepage::testing
