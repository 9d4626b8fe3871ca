// Multi-token steps (q_len > 1) of the layers, on either backend; the CPU and
// CUDA suites call these with their device.
#pragma once

#include <cstdint>
#include <string>

#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
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
/// `kernel`, when given, receives the name of the kernel the step ran.
void check_block_sparse_multi_token(Device device, const BlockSparseConfig& config, int32_t batch, int64_t prompt,
                                    int32_t q_len, std::string* kernel = nullptr);

/// A multi-token step that runs token by token: below the sparse regime
/// (each token against fp64 causal attention over the whole window) or
/// under the kill switch (`kill`: the last token against fp64 over its own
/// selection, and no output left unwritten).
void check_block_sparse_multi_token_dense(Device device, const BlockSparseConfig& config, int32_t batch, int64_t prompt,
                                          int32_t q_len, bool kill);

/// A small DSA geometry on the MLA shape (16 query heads, latent 512 + rope
/// 64; 8 index heads of 64; top-64).
DsaConfig small_dsa_config();

/// One DSA multi-token step after a `prompt`-token prompt, on exactly
/// representable inputs: each (sequence, token) keeps the one-token rule's
/// top-k over its own causal window (fused), and each token's output
/// matches fp64 over its selection with the output NaN-poisoned first.
/// `kill`: under the kill switch the step runs token by token; every token
/// is checked against fp64 over the rule's selection for its window.
void check_dsa_multi_token(Device device, const DsaConfig& config, int32_t batch, int64_t prompt, int32_t q_len,
                           bool kill);

}  // namespace sparsepage::testing
