// Built instead of the sparse prefill's CUDA kernels (src/cuda/attention/prefill.cu,
// src/cuda/indexers/block_prefill_indexer.cu) and the decode's bounded entry
// point when the library has no CUDA backend: each reports that clearly.
#include <string>

#include "core/decode_limits.h"
#include "core/prefill_kernels.h"

namespace sparsepage::detail {
namespace {
[[noreturn]] void no_cuda(const char* what) { throw Error(std::string(what) + ": sparsepage was built without CUDA"); }
}  // namespace

const char* run_decode_cuda(const DecodeParams&, const DecodePlan&, void*, void*, int32_t, const MergeFinish&) {
  no_cuda("run_decode_cuda");
}
void token_windows_cuda(const TokenWindowsArgs&, void*) { no_cuda("sparse prefill (Device::kCuda)"); }
void block_windows_cuda(const BlockWindowsArgs&, void*) { no_cuda("sparse prefill (Device::kCuda)"); }
void mla_epilogue_cuda(const MlaEpilogueArgs&, void*) { no_cuda("sparse prefill (Device::kCuda)"); }
void lse_gather_cuda(const LseGatherArgs&, void*) { no_cuda("sparse prefill (Device::kCuda)"); }
void scale_expand_cuda(const ScaleExpandArgs&, void*) { no_cuda("sparse prefill (Device::kCuda)"); }
void pass_lens_cuda(const PassLensArgs&, void*) { no_cuda("sparse prefill (Device::kCuda)"); }
void block_scores_cuda(const BlockScoresArgs&, void*) { no_cuda("BlockPrefillIndexer (Device::kCuda)"); }
void block_scores_paged_cuda(const PagedScoresArgs&, void*) { no_cuda("BlockPrefillIndexer (Device::kCuda)"); }
void block_select_cuda(const BlockSelectArgs&, void*) { no_cuda("BlockPrefillIndexer (Device::kCuda)"); }
void static_blocks_cuda(const StaticBlocksArgs&, void*) { no_cuda("static_prefill_blocks (Device::kCuda)"); }

}  // namespace sparsepage::detail
