// Checks of the model layers that run unchanged on either backend; the CPU
// and CUDA suites call them with their device.
#pragma once

#include "sparsepage/memory.h"

namespace sparsepage::testing {

/// Block-sparse decode at four context lengths (one with a partial final
/// block): the positions the page table attends equal the columns the mask
/// path keeps, the count is a function of kv_len, and the fused output
/// matches the mask path's.
void check_block_sparse_set_equality(Device device);

/// The toy transformer decodes 64 greedy tokens identically with the fused
/// path and with the kill switch (mask path), in the sparse regime.
void check_block_sparse_greedy_equality(Device device);

}  // namespace sparsepage::testing
