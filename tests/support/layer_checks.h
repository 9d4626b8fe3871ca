// Checks of the model layers that run unchanged on either backend; the CPU
// and CUDA suites call them with their device.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sparsepage/memory.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"

namespace sparsepage::testing {

/// The default policy with the context floors at 0: the fused path is taken
/// whenever the sparsity gate allows.
DispatchConfig always_fuse();
/// always_fuse() with the kill switch off: every decode takes the mask path.
DispatchConfig kill_switch();

/// Block-sparse decode at each (batch, context), each in the sparse regime
/// (contexts with a partial and with a full final block): the positions the
/// page table attends equal the columns the mask path keeps, the count is a
/// function of kv_len, and the fused output matches the mask path's. The
/// defaults are the full sizes; the CUDA suite's quick mode passes smaller.
void check_block_sparse_set_equality(Device device,
                                     const BlockSparseConfig& config = BlockSparseConfig{8, 2, 64, 16, 4, 2, 64},
                                     const std::vector<std::pair<int32_t, int64_t>>& batch_contexts = {
                                         {1, 150}, {1, 160}, {1, 257}, {3, 300}, {8, 201}});

/// The toy transformer decodes `steps` greedy tokens identically with the
/// fused path and with the kill switch (mask path), in the sparse regime,
/// for `batch` sequences side by side.
void check_block_sparse_greedy_equality(Device device, int32_t batch, int32_t steps = 64);

/// Static per-query-head block-sparse decode (tests/support/static_layer_checks.cc)
/// at each (batch, context): per query head, the positions the page table
/// attends equal the columns the mask path keeps and the rule's blocks
/// (scanned block by block), the count is config.kept_tokens, heads sharing
/// a KV head keep different blocks once the pattern has vertical blocks, the
/// step fuses exactly when the sparsity gate allows, and a fused output
/// matches the mask path's.
void check_static_set_equality(Device device, const StaticBlockSparseConfig& config,
                               const std::vector<std::pair<int32_t, int64_t>>& batch_contexts);

/// One static block-sparse decode at `context` against an fp64 reference per
/// query head over exactly its kept positions, on the fused path and on the
/// mask path, with every prompt row that no query head of its KV head keeps
/// set to NaN and the outputs NaN-poisoned before the step.
void check_static_against_reference(Device device, const StaticBlockSparseConfig& config, int32_t batch,
                                    int64_t context);

/// The toy transformer over static block-sparse layers decodes `steps`
/// greedy tokens identically with the fused path and with the kill switch.
void check_static_greedy_equality(Device device, int32_t batch, int32_t steps = 64);

/// Greedy tokens of two arms that attend the same positions with bf16
/// rounding in another order (`got`, `ref`: per sequence). They must agree
/// up to the first step, if any, where the reference arm's top two logits
/// nearly tie (`ref_margins`, ToyModel::margins()); a sequence is not
/// compared past that step, and at least half of all tokens must be compared.
void expect_same_greedy_tokens(const std::vector<std::vector<int32_t>>& got,
                               const std::vector<std::vector<int32_t>>& ref,
                               const std::vector<std::vector<float>>& ref_margins, const std::string& what);

/// fp64 attention of DSA sequence b over `positions`, read from `layer`'s
/// host (bf16) cache: scores scale * (q . latent + q_pe . k_pe) with the
/// default scale 1 / sqrt(latent + rope), output the softmax-weighted latent
/// rows, [num_qo_heads, latent_dim]. `q` and `q_pe` are the step's bf16
/// queries, [batch, heads, latent] and [batch, heads, rope].
std::vector<double> dsa_reference(const DsaAttention& layer, const DsaConfig& c, const std::vector<uint8_t>& q,
                                  const std::vector<uint8_t>& q_pe, int32_t b, const std::vector<int32_t>& positions);

}  // namespace sparsepage::testing
