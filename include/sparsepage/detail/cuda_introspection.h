// What the CUDA backend chooses, and how it was built: questions the library's
// own code, its tests and its benchmarks ask. NOT part of the stable API: these
// declarations follow the kernels and may change or vanish in any release.
// Users ask decode.h (cuda_layout_problem, cuda_arch_problem,
// cuda_supports_head_dims, cuda_launch_shape) instead.
#pragma once

#include <cstdint>

#include "sparsepage/decode.h"
#include "sparsepage/plan.h"

namespace sparsepage {

/// Whether this build's sm_90a code (the wgmma kernels: MLA, and the 64-row
/// multi-token CTA's Hopper form) runs on a GPU of compute capability `sm`:
/// sm 90 and a "90a" entry in `built` (null: this build's). Host-only, pure.
bool cuda_sm90a_code_runs(int32_t sm, const char* built = nullptr);
/// The architectures this build's kernels were compiled for, as CMake had
/// them ("90a", "80,90a,100"); empty without the CUDA backend.
const char* cuda_built_architectures();
/// Reads the kernel switch SPARSEPAGE_MULTI_TOKEN_CTA (read once per
/// process; `mma` runs the multi-token CTA's mma.sync form on sm_90a too, so
/// that the form other GPUs run is tested on Hopper) and throws
/// sparsepage::Error when it holds a value it does not take.
/// A CUDA SparseDecoder (and so every layer) asks when it is made, before
/// any step; without the CUDA backend there are no switches and it does
/// nothing.
void cuda_check_kernel_switches();
/// How `run_decode_cuda` merges this plan's split requests: the size of the
/// thread-block clusters whose CTAs merge one request through distributed
/// shared memory (one launch, no fp32 partials), or 0 when the merge kernel
/// runs (or nothing is split). Clusters take a uniform split (equal counts)
/// at head dims 128/128 with a native dtype, on a device that can place
/// them, of 2 CTAs per request (the size measured faster than the merge
/// kernel).
int32_t cuda_merge_cluster_size(const DecodeParams& params, const DecodePlan& plan);
/// The kernel `run_decode_cuda` launches for these parameters and this plan,
/// named for logs and benchmarks (a string literal, e.g. "64-row
/// multi-token CTA, wgmma"); the kernel switch SPARSEPAGE_MULTI_TOKEN_CTA is
/// taken into account.
const char* cuda_decode_kernel_name(const DecodeParams& params, const DecodePlan& plan);
/// How run_mla_sparse_cuda finishes a direct-form plan (mla_sparse.h): true
/// when the decode's own merge writes every row of `main` (every request has
/// a merge entry and no work item writes the output directly), so the merge
/// applies the sink and FlashMLA's +inf lse and no epilogue runs; false when
/// the epilogue kernel does that over every row.
bool merge_writes_every_row(const DecodePlan& main);

}  // namespace sparsepage
