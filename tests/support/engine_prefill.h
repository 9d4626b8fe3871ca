// Chunked prefill over an engine's paged pool (KVStorage::kEnginePaged,
// prefill(tokens, kv, num_tokens)) on either backend; the CPU and CUDA
// suites call these with their device.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"

namespace sparsepage::testing {

/// A batch and the chunk it prefills over the engine's pool.
struct EnginePrefillCase {
  /// Each slot's length before the chunk (its prompt admitted); a negative
  /// entry: a free (released) slot.
  std::vector<int64_t> prompt;
  int32_t num_tokens = 0;
  uint64_t seed = 1;
};

/// One chunk through the engine-paged layer over a pool of 16-row blocks
/// handed out in a shuffled order, every row the engine did not write NaN,
/// the output NaN-poisoned first, against: the layer over its own cache
/// prefilling the same chunk (the same positions per row, outputs within
/// 1e-3 relative L2), fp64 attention over the positions it reports (each
/// within the token's causal window; 1e-2), token-by-token engine-paged
/// decode of the same tokens on a twin (DSA: every token; block-sparse:
/// the tokens whose window is in the dense regime, where a one-token step
/// keeps what the chunk's query block keeps: the same positions, outputs
/// within 1e-2), zero outputs for free slots and the lengths the own-cache
/// layer reaches.
void check_engine_paged_block_prefill(Device device, const BlockSparseConfig& config, const EnginePrefillCase& c);
void check_engine_paged_dsa_prefill(Device device, const DsaConfig& config, const EnginePrefillCase& c);
/// The DSA chunk over the engines' 656-byte FP8 MLA rows (KvFormat::kE4m3Mla;
/// every unwritten byte 0xFF, NaN in each field): the own-cache layer's
/// positions (its outputs read other values: the bf16 rows), fp64 over the
/// documented dequantization of the rows at the positions it reports (the
/// exact one on the CPU, rounded to bf16 on CUDA as docs/RELIABILITY.md "FP8
/// MLA rounding" says; 1e-2 relative L2), and the token-by-token
/// engine-paged decode over the same pool (the same positions, outputs
/// within 1e-2).
void check_engine_paged_dsa_prefill_fp8(Device device, const DsaConfig& config, const EnginePrefillCase& c);

/// The DSA chunk over engine-owned pools (KVStorage::kEnginePools): the
/// engine's index keys (bf16 rows, or with fp8_keys vLLM's FP8 blocks) and
/// MLA rows (bf16, or with fp8_rows the 656-byte FP8 rows) through a
/// shuffled table, the lengths passed (a free slot: 0) under a looser
/// bound, against the engine-paged prefill of the same chunk over the same
/// rows, the layer keeping the keys: the same positions (the test's keys
/// quantize exactly), outputs within 1e-3, zero rows for free slots; and a
/// chunk with index_k, without lengths or with a length below the chunk
/// refused by name before o is written.
void check_engine_pools_dsa_prefill(Device device, const DsaConfig& config, const EnginePrefillCase& c, bool fp8_keys,
                                    bool fp8_rows);

/// The block-sparse chunk over engine-owned pools (the engine's K/V rows
/// and index keys, bf16 or with fp8_keys vLLM's FP8 blocks, its lengths;
/// every unwritten pool row NaN): against the engine-paged prefill of the
/// same chunk (the same positions, outputs within 1e-3, free slots zero)
/// and, on CUDA, the CPU twin over copies of the same pools (the same
/// positions, outputs within 1e-2); a chunk off the block grid refused by
/// name before o is written; a key block id outside the pool refused by
/// name on the CPU, and on CUDA flagged where it is read (check_errors()
/// names it) with the sparse-regime lists that needed it selecting nothing
/// (zero rows) and every other row unchanged.
void check_engine_pools_block_prefill(Device device, const BlockSparseConfig& config, const EnginePrefillCase& c,
                                      bool fp8_keys);

/// A prefill chunk sharing an engine step with other sequences' decode
/// tokens, over engine pools (KVStorage::kEnginePools): three slots, four
/// steps. Slot 0 prefills two chunks of `chunk` tokens then decodes, slot 1
/// decodes from a prompt of prompt1 tokens every step, slot 2 from prompt2
/// and leaves before the last step. Each step is the engine's two calls,
/// prefill_chunk with kv.seq_lens nonzero only for the prefilling slot and
/// the decode with them nonzero only for the decoding ones (the other
/// slots' query rows NaN). Every slot's rows must equal, bit for bit, the
/// same request run alone in its call on a twin layer (one bound for
/// every call); the rows of slots not in a call are zero; the engine's
/// pools are unchanged and the layer keeps no lengths. Index keys bf16,
/// or with fp8_keys vLLM's FP8 blocks; every unwritten pool row NaN.
void check_engine_pools_mixed_block_step(Device device, const BlockSparseConfig& config, int32_t chunk, int64_t prompt1,
                                         int64_t prompt2, bool fp8_keys);
void check_engine_pools_mixed_dsa_step(Device device, const DsaConfig& config, int32_t chunk, int64_t prompt1,
                                       int64_t prompt2, bool fp8_keys);

/// Bad engine-paged chunks refused by name, the layer unchanged (lengths,
/// then a good chunk gives the answer a fresh twin gives): a misaligned
/// chunk, num_tokens < 1, k / v passed or index_k missing, a table row
/// too short, a table with row_of_sequence, (CPU) a block id outside the
/// pool, the engine form on a layer-cache layer and the layer-cache form on
/// an engine-paged one, and an engine-pools block-sparse layer (tokens the
/// pools form refuses).
void check_engine_prefill_refusals(Device device);

}  // namespace sparsepage::testing
