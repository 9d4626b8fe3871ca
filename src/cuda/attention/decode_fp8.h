// The FP8 partial kernels' launch (decode_fp8.cu), called by run_decode_cuda
// for KvFormat::kE4m3PerHead and kE4m3Mla. A translation unit of its own,
// so the bf16/f16 kernels' instantiations in decode.cu are untouched.
#pragma once

#include <cuda_runtime.h>

#include "cuda/attention/gqa/decode_partial.cuh"
#include "sparsepage/decode.h"

namespace sparsepage {
namespace cuda {

/// Launches the partial kernel of `format` over the work items of `p` (K and
/// V strides in bytes). `engine_inputs`: the engines' index forms
/// (EnginePagedSource). `multi_token`: e4m3-per-head rows on the 64-row
/// wgmma CTA (multi_token_cta_kind said kWgmma; the library's own tables
/// only), else on the 16-row tiles. Throws for a format or dtype without a
/// kernel.
void launch_partial_fp8(const PartialParams<PagedTable>& p, KvFormat format, DType dtype, const float* k_scale,
                        const float* v_scale, bool engine_inputs, bool multi_token, int32_t num_items,
                        cudaStream_t stream);

/// Whether an FP8 MLA launch of `group_size` query heads per request runs
/// the CTA-pair kernel (mla_ws_fp8_pair.cuh): two head tiles and a device
/// that places the clusters.
bool mla_fp8_runs_pairs(int32_t group_size, bool engine_inputs);

}  // namespace cuda
}  // namespace sparsepage
