// Launchers of the FP8 partial kernels (decode_fp8.h). Instantiations: the
// e4m3-per-head mma.sync kernel at head dim 128 for bf16 and f16 q, and two
// MLA wgmma kernels for bf16 (the warp-specialized one and the classic),
// each for the library's CSR rows and the engines' index forms: 8 kernels.
#include "cuda/decode_fp8.h"

#include "cuda/decode_partial_fp8.cuh"
#include "cuda/launch_partial.cuh"
#include "cuda/mla_fp8_partial.cuh"
#include "cuda/mla_ws_fp8_partial.cuh"

namespace sparsepage {
namespace cuda {
namespace {

template <typename T, class Source>
void launch_gqa_fp8(const Fp8Params<PartialParams<PagedTable>>& p, int32_t num_items, cudaStream_t stream) {
  using Cfg = TileConfig<128, 128, Source::kHasBias>;
  auto kernel = partial_fp8_kernel<T, Source>;
  configure_smem_once(kernel, Cfg::kSmemBytes);
  // Query-row tiles vary fastest (PartialCta derives item and tile from blockIdx.x).
  const int64_t ctas = int64_t{num_items} * ((int64_t{p.group_size} * p.q_len + kQueryTile - 1) / kQueryTile);
  if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
  launch_with_pdl(kernel, dim3(static_cast<unsigned>(ctas)), dim3(kThreads), Cfg::kSmemBytes, stream, p);
}

/// The warp-specialized kernel (mla_ws_fp8_partial.cuh) by default, the
/// classic one under SPARSEPAGE_MLA_KERNEL=classic, as for bf16 rows.
template <class Source>
void launch_mla_fp8(const Fp8Params<PartialParams<PagedTable>>& p, int32_t num_items, cudaStream_t stream) {
  const int64_t ctas = int64_t{num_items} * ((p.group_size + MlaTile::kHeads - 1) / MlaTile::kHeads);
  if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
  const dim3 grid(static_cast<unsigned>(ctas));
  if (mla_kernel_choice() == MlaKernel::kWarpSpecialized) {
    auto kernel = mla_ws_fp8_partial_kernel<Source>;
    configure_smem_once(kernel, MlaWsFp8Tile::kSmemBytes);
    launch_with_pdl(kernel, grid, dim3(MlaWsFp8Tile::kThreads), MlaWsFp8Tile::kSmemBytes, stream, p);
  } else {
    auto kernel = mla_fp8_partial_kernel<Source>;
    configure_smem_once(kernel, MlaTile::kSmemBytes);
    launch_with_pdl(kernel, grid, dim3(MlaTile::kThreads), MlaTile::kSmemBytes, stream, p);
  }
}

}  // namespace

void launch_partial_fp8(const PartialParams<PagedTable>& params, KvFormat format, DType dtype, const float* k_scale,
                        const float* v_scale, bool engine_inputs, int32_t num_items, cudaStream_t stream) {
  Fp8Params<PartialParams<PagedTable>> p;
  static_cast<PartialParams<PagedTable>&>(p) = params;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.v_aliases_k = false;  // the fp8 kernels copy (GQA) or reuse (MLA) V on their own terms
  if (format == KvFormat::kE4m3Mla) {
    if (dtype != DType::kBF16) throw Error("decode: kv_format e4m3 mla runs with bf16 q, rope and o only");
    if (engine_inputs) return launch_mla_fp8<EnginePagedSource>(p, num_items, stream);
    return launch_mla_fp8<PagedSource>(p, num_items, stream);
  }
  if (format == KvFormat::kE4m3PerHead) {
    if (dtype == DType::kBF16) {
      if (engine_inputs) return launch_gqa_fp8<__nv_bfloat16, EnginePagedSource>(p, num_items, stream);
      return launch_gqa_fp8<__nv_bfloat16, PagedSource>(p, num_items, stream);
    }
    if (engine_inputs) return launch_gqa_fp8<__half, EnginePagedSource>(p, num_items, stream);
    return launch_gqa_fp8<__half, PagedSource>(p, num_items, stream);
  }
  throw Error(std::string("decode: no fp8 kernel for kv_format ") + kv_format_name(format));
}

}  // namespace cuda
}  // namespace sparsepage
