// Multi-token steps (q_len > 1) of the layers, on either backend; the CPU and
// CUDA suites call these with their device.
#pragma once

#include <cstdint>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/types.h"

namespace sparsepage::testing {

/// A small block-sparse geometry (8 query heads over 2 KV heads, head dim
/// 64, blocks of 32, top-4) whose sparse regime starts at 256 tokens.
BlockSparseConfig small_block_sparse_config();

/// One fused multi-token step after a `prompt`-token prompt: the step fuses;
/// every request keeps topk + 1 blocks, equal as a set to the rule (the max
/// over the tokens' index queries, computed here in fp64 on exactly
/// representable inputs), including the blocks of every new token; and
/// each token's output matches an fp64 reference over the kept positions
/// cut at that token's causal limit, with the output NaN-poisoned first.
void check_block_sparse_multi_token(Device device, const BlockSparseConfig& config, int32_t batch, int64_t prompt,
                                    int32_t q_len);

/// A multi-token step that runs token by token: below the sparse regime
/// (each token against fp64 causal attention over the whole window) or
/// under the kill switch (`kill`: the last token against fp64 over its own
/// selection, and no output left unwritten).
void check_block_sparse_multi_token_dense(Device device, const BlockSparseConfig& config, int32_t batch,
                                          int64_t prompt, int32_t q_len, bool kill);

}  // namespace sparsepage::testing
