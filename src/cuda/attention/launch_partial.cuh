// Host side of the partial kernel: which instantiations exist, and the launch.
// Shared by the fused decode (decode.cu, PagedSource) and the mask path
// (mask_path.cu, DenseSource); each file instantiates only its own source.
//
// Instantiations: 4 mma.sync tile shapes and the MLA kernel, x 2 dtypes per
// source. The K tile width is the concatenation of the K stream and the
// optional second stream (the split is a run-time column offset), and a V
// narrower than the tile's DV runs on the wider tile (its unused accumulator
// columns are skipped, never stored):
//   DK  64 / DV  64 : 64
//   DK 128 / DV 128 : 128 (V 64 or 128), 64 + 64 extra (V 64)
//   DK 192 / DV 128 : 128 + 64 extra (V 64 or 128)
//   DK 256 / DV 256 : 256 (V 64, 128 or 256)
//   MLA (mla_ws_partial.cuh): 512 latent + 64 rope, V = the 512 latent
//                     columns of K, 64 query heads per CTA on warpgroup
//                     MMAs, warp-specialized
#pragma once

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/attention/gqa/decode_partial.cuh"
#include "cuda/attention/gqa/decode_partial_cluster.cuh"
#include "cuda/attention/gqa/decode_partial_multi.cuh"
#include "cuda/attention/gqa/decode_partial_multi_wgmma.cuh"
#include "cuda/attention/mla/mla_ws_partial.cuh"
#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"

namespace sparsepage {
namespace cuda {

enum class TileShape { kNone, kK64V64, kK128V128, kK192V128, kK256V256, kMla };

/// The instantiation that runs head dims (qk, v, extra), or kNone.
inline TileShape select_tile_shape(int32_t dqk, int32_t dv, int32_t de) {
  if (dqk == 512 && dv == 512 && de == 64) return TileShape::kMla;  // needs V aliasing K
  const bool dims_ok = (dqk == 64 || dqk == 128 || dqk == 256) && (dv == 64 || dv == 128 || dv == 256) && dv <= dqk &&
                       (de == 0 || de == 64);
  if (!dims_ok) return TileShape::kNone;
  switch (dqk + de) {
    case 64: return TileShape::kK64V64;
    case 128: return TileShape::kK128V128;
    case 192: return TileShape::kK192V128;
    case 256: return de == 0 ? TileShape::kK256V256 : TileShape::kNone;
    default: return TileShape::kNone;
  }
}

/// CTAs the kernel of `shape` launches per work item: query-head tiles (16
/// heads for the mma.sync tiles, 64 for the MLA kernel). The split planners
/// divide the machine by this, so a wave holds about the CTAs they aim for.
inline int32_t ctas_per_item(TileShape shape, int32_t group_size) {
  const int32_t heads = shape == TileShape::kMla ? MlaTile::kHeads : kQueryTile;
  return (group_size + heads - 1) / heads;
}

/// A kernel switch: the environment variable `name` holding one of the
/// `values` (names[i] selects values[i]); unset or empty selects values[0].
/// Any other value is refused by name: "<name> must be 'a', 'b' or 'c', not 'x'".
template <typename Choice, size_t N>
Choice kernel_switch(const char* name, const char* const (&names)[N], const Choice (&values)[N]) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return values[0];
  std::string accepted;
  for (size_t i = 0; i < N; ++i) {
    if (std::strcmp(v, names[i]) == 0) return values[i];
    accepted += std::string(i == 0 ? "'" : i + 1 == N ? " or '" : ", '") + names[i] + "'";
  }
  throw Error(std::string(name) + " must be " + accepted + ", not '" + v + "'");
}

/// Which CTA a multi-token step runs (DecodeParams::q_len > 1):
///   kRowTiles  the 16-row CTA, each of its tiles reading every gathered row;
///   kMma       the 64-row CTA on mma.sync (decode_partial_multi.cuh);
///   kWgmma     the 64-row CTA on warpgroup MMAs (decode_partial_multi_wgmma.cuh).
/// The 64-row CTAs take multi-token steps at head dim 128 over the library's
/// own page tables (PagedSource): the wgmma one where sm_90a code runs and
/// the dims are exactly 128 / 128 with no second stream, from 17 query rows
/// (two 16-row tiles or more); the mma.sync one elsewhere, from 33 rows.
/// On the H200 (block-sparse step, batch 32, 32K, 16 heads per KV head) the
/// wgmma CTA beat the 16-row tiles from 2 tokens (32 rows), where the
/// mma.sync CTA still lost to them; at 4 tokens both 64-row CTAs won
/// (docs/PERFORMANCE.md, "Tried and rejected").
enum class MultiTokenCtaKind { kRowTiles, kMma, kWgmma };

/// SPARSEPAGE_MULTI_TOKEN_CTA (read once per process): unset or `auto`
/// chooses as above; `mma` takes the mma.sync 64-row CTA where the wgmma one
/// would run, so that the form every GPU without sm_90a code runs is tested
/// on the H200 (the multi-token tests run once more under it, in a ctest
/// process of their own). Any other value is refused by name
/// (cuda_check_kernel_switches asks before a step changes anything).
enum class MultiTokenChoice { kAuto, kMma };
inline MultiTokenChoice multi_token_cta_choice() {
  static const MultiTokenChoice choice =
      kernel_switch("SPARSEPAGE_MULTI_TOKEN_CTA", {"auto", "mma"}, {MultiTokenChoice::kAuto, MultiTokenChoice::kMma});
  return choice;
}

inline MultiTokenCtaKind multi_token_cta_kind(TileShape shape, int32_t head_dim_qk, int32_t head_dim_v,
                                              int32_t head_dim_extra, int32_t group_size, int32_t q_len) {
  const int64_t rows = int64_t{group_size} * q_len;
  if (q_len < 2 || rows <= kQueryTile || shape != TileShape::kK128V128) return MultiTokenCtaKind::kRowTiles;
  if (multi_token_cta_choice() == MultiTokenChoice::kAuto && cuda_sm90a_code_runs(cuda_device_sm()) &&
      head_dim_qk == 128 && head_dim_v == 128 && head_dim_extra == 0)
    return MultiTokenCtaKind::kWgmma;
  return rows > 2 * kQueryTile ? MultiTokenCtaKind::kMma : MultiTokenCtaKind::kRowTiles;
}

/// CTAs per work item and resident CTAs per SM of the 64-row CTAs.
inline int32_t multi_token_ctas_per_item(int32_t group_size, int32_t q_len) {
  return static_cast<int32_t>((int64_t{group_size} * q_len + kMultiRows - 1) / kMultiRows);
}
/// (A template, so that only the translation unit that asks, decode.cu,
/// instantiates the kernels it names; as an inline function every file that
/// includes this header compiled two copies of them.)
template <class Source>
int32_t multi_token_resident_ctas(MultiTokenCtaKind kind) {
  if (kind == MultiTokenCtaKind::kWgmma) {
    using Cta = MultiTokenWgmmaCta<__nv_bfloat16, Source>;
    return resident_ctas_once(multi_token_wgmma_kernel<Cta>, kThreads, Cta::kSmemBytes);
  }
  using Cta = MultiTokenCta<__nv_bfloat16, 128, 128, Source>;
  return resident_ctas_once(multi_token_kernel<__nv_bfloat16, 128, 128, Source>, kThreads, Cta::kSmemBytes);
}

/// Split requests of the 16-row CTA at 128/128 merge inside a
/// thread-block cluster (decode_partial_cluster.cuh: the CTAs of one request
/// combine their states through distributed shared memory) when the request
/// takes at most kClusterMergeCtas CTAs, and by the merge kernel
/// (decode_merge.cuh, a second launch over fp32 partials in global memory)
/// otherwise. On the H200 (block-sparse geometry, random rows) clusters of
/// 2 beat the merge kernel and clusters of 8 and 16 lost to it
/// (docs/PERFORMANCE.md, "Tried and rejected"). A cluster's CTAs must be
/// placed in one GPC at once; that this is what costs the large clusters
/// their time is our reading, not a profile.
constexpr int32_t kClusterMergeCtas = 2;

/// Dynamic shared memory of the 128/128 cluster kernel's launches.
template <class Source>
constexpr size_t cluster_smem_bytes() {
  return TileConfig<128, 128, Source::kHasBias>::kSmemBytes;
}

/// Launch config of a cluster kernel: `ctas` CTAs of `threads` threads in
/// clusters of `cluster`, with programmatic dependent launch.
inline cudaLaunchConfig_t cluster_launch_config(unsigned ctas, unsigned threads, unsigned cluster, size_t smem_bytes,
                                                cudaStream_t stream, cudaLaunchAttribute (&attribute)[2]) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  attribute[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 2;
  return config;
}

/// Whether the current device can place clusters of `cluster` CTAs of
/// `kernel` (`threads` threads and `smem_bytes` of shared memory each): at
/// least one such cluster resident by the occupancy API, which counts
/// registers, shared memory and the GPCs' sizes. Asked once per (kernel,
/// device, cluster size); also opts the kernel in to its shared memory.
/// Portable sizes (2 to 8) only: the launches ask for 2.
template <typename Params>
bool clusters_fit(void (*kernel)(Params), unsigned threads, size_t smem_bytes, int32_t cluster) {
  if (cluster < 2 || cluster > 8 || cuda_device_sm() < 90) return false;
  configure_smem_once(kernel, smem_bytes);
  static std::mutex mutex;
  static std::vector<std::pair<std::tuple<void (*)(Params), int, int32_t>, bool>> known;
  int device = 0;
  SP_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, device, cluster);
  for (const auto& entry : known) {
    if (entry.first == key) return entry.second;
  }
  cudaLaunchAttribute attribute[2];
  cudaLaunchConfig_t config = cluster_launch_config(static_cast<unsigned>(cluster), threads,
                                                    static_cast<unsigned>(cluster), smem_bytes, nullptr, attribute);
  config.numAttrs = 1;  // the occupancy query takes the cluster dims alone
  int clusters = 0;
  const cudaError_t status = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
  if (status != cudaSuccess) (void)cudaGetLastError();  // a size the device refuses: the caller falls back
  known.emplace_back(key, status == cudaSuccess && clusters > 0);
  return known.back().second;
}

/// Whether the current device can place clusters of `cluster` CTAs of the
/// 128/128 cluster kernel for `Source`.
template <typename T, class Source>
bool cluster_fits(int32_t cluster) {
  return clusters_fit(partial_cluster_kernel<T, 128, 128, Source>, kThreads, cluster_smem_bytes<Source>(), cluster);
}

/// The cluster kernel over `num_items` items of `ctas_per_item` head tiles,
/// one cluster of `cluster` CTAs per request. Capturable.
template <typename T, class Source>
void launch_partial_cluster(const typename Source::Params& p, int32_t num_items, int32_t cluster, cudaStream_t stream) {
  auto kernel = partial_cluster_kernel<T, 128, 128, Source>;
  const int64_t ctas = int64_t{num_items} * ((int64_t{p.group_size} * p.q_len + kQueryTile - 1) / kQueryTile);
  if (ctas > INT32_MAX || ctas % cluster != 0)
    throw Error("decode: the cluster merge's grid does not divide into clusters");
  cudaLaunchAttribute attribute[2];
  const cudaLaunchConfig_t config =
      cluster_launch_config(static_cast<unsigned>(ctas), kThreads, static_cast<unsigned>(cluster),
                            cluster_smem_bytes<Source>(), stream, attribute);
  SP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

template <typename T, class Source>
int32_t resident_ctas_typed(TileShape shape) {
  switch (shape) {
    case TileShape::kK64V64:
      return resident_ctas_once(partial_kernel<T, 64, 64, Source>, kThreads,
                                TileConfig<64, 64, Source::kHasBias>::kSmemBytes);
    case TileShape::kK128V128:
      return resident_ctas_once(partial_kernel<T, 128, 128, Source>, kThreads,
                                TileConfig<128, 128, Source::kHasBias>::kSmemBytes);
    case TileShape::kK192V128:
      return resident_ctas_once(partial_kernel<T, 192, 128, Source>, kThreads,
                                TileConfig<192, 128, Source::kHasBias>::kSmemBytes);
    case TileShape::kK256V256:
      return resident_ctas_once(partial_kernel<T, 256, 256, Source>, kThreads,
                                TileConfig<256, 256, Source::kHasBias>::kSmemBytes);
    case TileShape::kMla:
      return resident_ctas_once(mla_partial_kernel<MlaWsCta<T, Source, MlaWsColumnTile>>, MlaWsColumnTile::kThreads,
                                MlaWsColumnTile::kSmemBytes);
    case TileShape::kNone: break;
  }
  return 1;
}

/// CTAs of `shape`'s kernel for `Source` resident per multiprocessor of the
/// current device, from the occupancy API (registers, shared memory and the
/// min-blocks hint). The split planners aim for this many CTAs per SM, so a
/// grid fills one wave. The bf16 and f16 kernels use the same resources.
template <class Source>
int32_t resident_ctas_per_sm(TileShape shape) {
  return resident_ctas_typed<__nv_bfloat16, Source>(shape);
}

/// The layout checks both CUDA entry points share: head dims with a built
/// kernel, then cuda_layout_problem (decode.h) — the same function the
/// dispatch policy declines with, so a layout it accepts always launches.
inline void check_stream_layout(const char* api, DType dtype, const void* q, const void* q_extra, const RowView& k,
                                const RowView& v, const RowView& extra, const void* o) {
  const int32_t extra_dim = extra.data ? extra.dim : 0;
  if (select_tile_shape(k.dim, v.dim, extra_dim) == TileShape::kNone)
    throw Error(std::string(api) + ": no CUDA kernel for head dims qk = " + std::to_string(k.dim) + ", v = " +
                std::to_string(v.dim) + ", extra = " + std::to_string(extra_dim) + " (see cuda_supports_head_dims)");
  const std::string problem = cuda_layout_problem(dtype, q, q_extra, k, v, extra, o);
  if (!problem.empty()) throw Error(std::string(api) + ": " + problem);
  const std::string arch = cuda_arch_problem(cuda_device_sm(), k.dim, v.dim, extra_dim);
  if (!arch.empty()) throw Error(std::string(api) + ": " + arch);
}

/// The stream fields of the partial kernel's params, the same for both row sources.
inline PartialCommon stream_params(const void* q, const void* q_extra, const RowView& k, const RowView& v,
                                   const RowView& extra, int32_t num_kv_heads, int32_t group_size, float scale) {
  PartialCommon p;
  const bool has_extra = extra.data != nullptr;
  p.q = q;
  p.q_extra = has_extra ? q_extra : nullptr;
  p.k = k.data;
  p.v = v.data;
  p.k_extra = extra.data;
  p.k_stride = k.row_stride;
  p.v_stride = v.row_stride;
  p.e_stride = has_extra ? extra.row_stride : 0;
  p.k_seq = k.seq_stride;
  p.v_seq = v.seq_stride;
  p.e_seq = has_extra ? extra.seq_stride : 0;
  p.k_head = k.head_stride;
  p.v_head = v.head_stride;
  p.e_head = has_extra ? extra.head_stride : 0;
  p.num_kv_heads = num_kv_heads;
  // V is read from the K tile when it is K's first columns at K's rows.
  p.v_aliases_k = v.data == k.data && v.row_stride == k.row_stride && v.seq_stride == k.seq_stride &&
                  v.head_stride == k.head_stride;
  p.dqk = k.dim;
  p.dv = v.dim;
  p.de = has_extra ? extra.dim : 0;
  p.group_size = group_size;
  // Packed [num_requests, group_size, dim] q, q_extra and o; a strided launch overrides these.
  const int64_t heads = int64_t{num_kv_heads} * group_size;
  p.q_seq = heads * p.dqk;
  p.q_head = p.dqk;
  p.qe_seq = heads * p.de;
  p.qe_head = p.de;
  p.o_seq = heads * p.dv;
  p.o_head = p.dv;
  p.scale_log2 = scale * kLog2e;
  return p;
}

template <typename T, int DK, int DV, class Source>
void launch_partial_shape(const typename Source::Params& p, int32_t num_items, cudaStream_t stream) {
  using Cfg = TileConfig<DK, DV, Source::kHasBias>;
  auto kernel = partial_kernel<T, DK, DV, Source>;
  configure_smem_once(kernel, Cfg::kSmemBytes);
  // Query-row tiles (16 rows: heads, or heads x tokens of a multi-token
  // step) vary fastest, so the CTAs of one item read its rows together.
  const int64_t ctas = int64_t{num_items} * ((int64_t{p.group_size} * p.q_len + kQueryTile - 1) / kQueryTile);
  if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
  const dim3 grid(static_cast<unsigned>(ctas));
  // With programmatic serialization the grid is scheduled while the previous
  // kernel drains; the kernel waits for it before its first global read.
  launch_with_pdl(kernel, grid, dim3(kThreads), Cfg::kSmemBytes, stream, p);
}

template <typename T, class Source>
void launch_mla(const typename Source::Params& p, int32_t num_items, cudaStream_t stream) {
  if (!p.v_aliases_k) throw Error("decode: the 512 + 64 (MLA) kernel needs V to be the first 512 columns of K");
  // Head tiles vary fastest, so the CTAs reading the same rows run together.
  const int64_t ctas = int64_t{num_items} * ctas_per_item(TileShape::kMla, p.group_size);
  if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
  using W = MlaWsColumnTile;
  auto kernel = mla_partial_kernel<MlaWsCta<T, Source, W>>;
  configure_smem_once(kernel, W::kSmemBytes);
  launch_with_pdl(kernel, dim3(static_cast<unsigned>(ctas)), dim3(W::kThreads), W::kSmemBytes, stream, p);
}

template <typename T, class Source>
void launch_multi_token(const typename Source::Params& p, MultiTokenCtaKind kind, int32_t num_items,
                        cudaStream_t stream) {
  const int64_t ctas = int64_t{num_items} * multi_token_ctas_per_item(p.group_size, p.q_len);
  if (ctas > INT32_MAX) throw Error("decode: too many work items for one launch");
  const dim3 grid(static_cast<unsigned>(ctas));
  if (kind == MultiTokenCtaKind::kWgmma) {
    using Cta = MultiTokenWgmmaCta<T, Source>;
    auto kernel = multi_token_wgmma_kernel<Cta>;
    configure_smem_once(kernel, Cta::kSmemBytes);
    launch_with_pdl(kernel, grid, dim3(kThreads), Cta::kSmemBytes, stream, p);
    return;
  }
  using Cta = MultiTokenCta<T, 128, 128, Source>;
  auto kernel = multi_token_kernel<T, 128, 128, Source>;
  configure_smem_once(kernel, Cta::kSmemBytes);
  launch_with_pdl(kernel, grid, dim3(kThreads), Cta::kSmemBytes, stream, p);
}

template <typename T, class Source>
void launch_partial_typed(const typename Source::Params& p, TileShape shape, int32_t num_items, cudaStream_t stream) {
  if constexpr (std::is_same_v<Source, PagedSource>) {
    const MultiTokenCtaKind kind = multi_token_cta_kind(shape, p.dqk, p.dv, p.de, p.group_size, p.q_len);
    if (kind != MultiTokenCtaKind::kRowTiles) return launch_multi_token<T, Source>(p, kind, num_items, stream);
  }
  switch (shape) {
    case TileShape::kK64V64: return launch_partial_shape<T, 64, 64, Source>(p, num_items, stream);
    case TileShape::kK128V128: return launch_partial_shape<T, 128, 128, Source>(p, num_items, stream);
    case TileShape::kK192V128: return launch_partial_shape<T, 192, 128, Source>(p, num_items, stream);
    case TileShape::kK256V256: return launch_partial_shape<T, 256, 256, Source>(p, num_items, stream);
    case TileShape::kMla: return launch_mla<T, Source>(p, num_items, stream);
    case TileShape::kNone: break;
  }
  throw Error("decode: no CUDA kernel for these head dims");
}

template <class Source>
void launch_partial(const typename Source::Params& p, TileShape shape, DType dtype, int32_t num_items,
                    cudaStream_t stream) {
  if (dtype == DType::kBF16) return launch_partial_typed<__nv_bfloat16, Source>(p, shape, num_items, stream);
  return launch_partial_typed<__half, Source>(p, shape, num_items, stream);
}

}  // namespace cuda
}  // namespace sparsepage
