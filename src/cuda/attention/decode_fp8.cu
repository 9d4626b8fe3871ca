// Launchers of the FP8 partial kernels (decode_fp8.h). Instantiations: the
// e4m3-per-head mma.sync kernel at head dim 128 for bf16 and f16 q, and two
// MLA wgmma kernels for bf16 (the warp-specialized one and its CTA-pair form
// for two head tiles), each for the library's CSR rows and the engines'
// index forms; the e4m3-per-head 64-row wgmma CTA for bf16 and f16 q over
// the library's CSR rows: 10 kernels.
#include "cuda/attention/decode_fp8.h"

#include "cuda/attention/gqa/decode_partial_fp8.cuh"
#include "cuda/attention/gqa/decode_partial_multi_wgmma_fp8.cuh"
#include "cuda/attention/launch_partial.cuh"
#include "cuda/attention/mla/mla_ws_fp8_pair.cuh"
#include "cuda/attention/mla/mla_ws_fp8_partial.cuh"

namespace sparsepage {
namespace cuda {
namespace {

template <typename T, class Source>
void launch_gqa_fp8(const Fp8Params<PartialParams<PagedTable>>& p, bool multi_token, int32_t num_items,
                    cudaStream_t stream) {
  if constexpr (std::is_same_v<Source, PagedSource>) {
    if (multi_token) {  // 64 query rows per CTA, each gathered row read once for them
      using Cta = MultiTokenWgmmaFp8Cta<T, Source>;
      auto kernel = multi_token_wgmma_kernel<Cta>;
      configure_smem_once(kernel, Cta::kSmemBytes);
      const int64_t ctas = int64_t{num_items} * multi_token_ctas_per_item(p.group_size, p.q_len);
      if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
      launch_with_pdl(kernel, dim3(static_cast<unsigned>(ctas)), dim3(kThreads), Cta::kSmemBytes, stream, p);
      return;
    }
  } else if (multi_token) {
    throw Error("decode: the FP8 64-row CTA reads the library's own tables only");
  }
  using Cfg = TileConfig<128, 128, Source::kHasBias>;
  auto kernel = partial_fp8_kernel<T, Source>;
  configure_smem_once(kernel, Cfg::kSmemBytes);
  // Query-row tiles vary fastest (PartialCta derives item and tile from blockIdx.x).
  const int64_t ctas = int64_t{num_items} * ((int64_t{p.group_size} * p.q_len + kQueryTile - 1) / kQueryTile);
  if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
  launch_with_pdl(kernel, dim3(static_cast<unsigned>(ctas)), dim3(kThreads), Cfg::kSmemBytes, stream, p);
}

/// Every item of two head tiles runs as a CTA pair when the device places
/// the clusters. Since the FP8 CTAs take P from registers, the pairs win or
/// tie at every batch from 1 to 128 on the H200, the 128-token chunks of
/// small batches included (docs/PERFORMANCE.md, "Tried and rejected").
template <class Source>
bool pairs_run(int32_t group_size) {
  if ((group_size + MlaTile::kHeads - 1) / MlaTile::kHeads != MlaWsFp8PairTile::kClusterCtas) return false;
  return clusters_fit(mla_partial_kernel<MlaWsFp8PairCta<Source>>, MlaWsFp8PairTile::kThreads,
                      MlaWsFp8PairTile::kSmemBytes, MlaWsFp8PairTile::kClusterCtas);
}

/// The warp-specialized kernel: as CTA pairs when an item has two head tiles
/// and the device places the clusters (mla_ws_fp8_pair.cuh), otherwise one
/// CTA per head tile (mla_ws_fp8_partial.cuh).
template <class Source>
void launch_mla_fp8(const Fp8Params<PartialParams<PagedTable>>& p, int32_t num_items, cudaStream_t stream) {
  const int64_t ctas = int64_t{num_items} * ((p.group_size + MlaTile::kHeads - 1) / MlaTile::kHeads);
  if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
  const dim3 grid(static_cast<unsigned>(ctas));
  if (pairs_run<Source>(p.group_size)) {
    // Head tiles vary fastest (MlaWsCta), so a cluster of two is one item's pair.
    auto kernel = mla_partial_kernel<MlaWsFp8PairCta<Source>>;
    cudaLaunchAttribute attribute[2];
    const cudaLaunchConfig_t config =
        cluster_launch_config(grid.x, MlaWsFp8PairTile::kThreads, MlaWsFp8PairTile::kClusterCtas,
                              MlaWsFp8PairTile::kSmemBytes, stream, attribute);
    SP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  } else {
    auto kernel = mla_partial_kernel<MlaWsFp8Cta<Source>>;
    configure_smem_once(kernel, MlaWsFp8Tile::kSmemBytes);
    launch_with_pdl(kernel, grid, dim3(MlaWsFp8Tile::kThreads), MlaWsFp8Tile::kSmemBytes, stream, p);
  }
}

}  // namespace

bool mla_fp8_runs_pairs(int32_t group_size, bool engine_inputs) {
  return engine_inputs ? pairs_run<EnginePagedSource>(group_size) : pairs_run<PagedSource>(group_size);
}

void launch_partial_fp8(const PartialParams<PagedTable>& params, KvFormat format, DType dtype, const float* k_scale,
                        const float* v_scale, bool engine_inputs, bool multi_token, int32_t num_items,
                        cudaStream_t stream) {
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
      if (engine_inputs) return launch_gqa_fp8<__nv_bfloat16, EnginePagedSource>(p, multi_token, num_items, stream);
      return launch_gqa_fp8<__nv_bfloat16, PagedSource>(p, multi_token, num_items, stream);
    }
    if (engine_inputs) return launch_gqa_fp8<__half, EnginePagedSource>(p, multi_token, num_items, stream);
    return launch_gqa_fp8<__half, PagedSource>(p, multi_token, num_items, stream);
  }
  throw Error(std::string("decode: no fp8 kernel for kv_format ") + kv_format_name(format));
}

}  // namespace cuda
}  // namespace sparsepage
