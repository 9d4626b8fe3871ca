// CUDA launchers of the fused paged decode (decode.h): plan upload, the
// partial + merge launch, and the error flag. run_decode_cuda allocates
// nothing, synchronizes nothing and reads nothing back, so it can be captured
// in a CUDA graph; everything that touches the host happens in
// upload_plan_cuda and read_decode_error_flag.
#include <algorithm>
#include <string>
#include <vector>

#include "core/decode_limits.h"
#include "cuda/attention/decode_fp8.h"
#include "cuda/attention/launch_partial.cuh"
#include "cuda/merge/decode_merge.cuh"
#include "cuda/primitives/common.cuh"
#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/detail/query_strides.h"

namespace sparsepage {

namespace {

unsigned char* at(void* workspace, size_t offset) { return static_cast<unsigned char*>(workspace) + offset; }

/// The flag's two words (DecodeErrors): no kinds, no request (0xFFFFFFFF,
/// which atomicMin lowers to the first request that reports).
void clear_error_flag(void* flag, cudaStream_t s) {
  SP_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(uint32_t), s));
  SP_CUDA_CHECK(cudaMemsetAsync(static_cast<uint32_t*>(flag) + 1, 0xFF, sizeof(uint32_t), s));
}

/// log2(page_size) when it is a power of two, else -1 (the kernel divides).
int32_t page_shift_of(int32_t page_size) {
  int32_t shift = 0;
  while ((int64_t{1} << shift) < page_size) ++shift;
  return (int64_t{1} << shift) == page_size ? shift : -1;
}

template <typename T>
void run_merge(const DecodeParams& params, const QoStrides& qo, const DecodePlan& plan, void* workspace,
               const detail::MergeFinish& finish, cudaStream_t stream) {
  cuda::MergeParams m;
  m.partial_o = reinterpret_cast<const float*>(at(workspace, plan.workspace.partial_o));
  m.partial_lse = reinterpret_cast<const float*>(at(workspace, plan.workspace.partial_lse));
  m.merge_indptr = reinterpret_cast<const int32_t*>(at(workspace, plan.workspace.merge_indptr));
  m.merge_requests = reinterpret_cast<const int32_t*>(at(workspace, plan.workspace.merge_requests));
  m.group_size = params.group_size * params.q_len;
  m.heads = params.group_size;
  m.q_len = params.q_len;
  m.o_tok = params.q_len > 1 ? qo.o.token_stride : 0;
  m.dv = params.v.dim;
  m.partial_dv = plan.head_dim_v;
  m.num_kv_heads = params.num_kv_heads;
  m.o_seq = qo.o.seq_stride;
  m.o_head = qo.o.head_stride;
  m.o = params.o;
  m.lse = params.lse;
  m.sink = finish.sink;
  m.empty_lse = finish.empty_lse;
  cuda::launch_merge<T>(m, plan.most_merged_partials(), static_cast<int32_t>(plan.merge_requests.size()), stream);
}

/// Whether the launch reads the engines' index forms (decode.h), which take
/// their own instantiation (EnginePagedSource).
bool uses_engine_inputs(const DecodeParams& params) {
  return params.index_layout == IndexLayout::kMatrix || params.padding == IndexPadding::kMinusOneSkips ||
         params.addressing == PageAddressing::kBlockTable || params.seq_lens_index == SeqLensIndex::kPerSequence;
}

template <class Source>
bool cluster_fits(DType dtype, int32_t size) {
  return dtype == DType::kBF16 ? cuda::cluster_fits<__nv_bfloat16, Source>(size)
                               : cuda::cluster_fits<__half, Source>(size);
}

/// cuda_merge_cluster_size for parameters already checked. The engines'
/// index forms take clusters exactly when the library's own tables do, so
/// a step over an engine's pool gives the same bits as over the layer's cache.
int32_t cluster_size_for(const DecodeParams& params, const DecodePlan& plan) {
  if (plan.uniform_chunks < 2 || params.kv_format != KvFormat::kNative) return 0;
  const int32_t extra = params.k_extra.data != nullptr ? params.k_extra.dim : 0;
  const cuda::TileShape shape = cuda::select_tile_shape(params.k.dim, params.v.dim, extra);
  if (shape != cuda::TileShape::kK128V128 ||
      cuda::multi_token_cta_kind(shape, params.k.dim, params.v.dim, extra, params.group_size, params.q_len) !=
          cuda::MultiTokenCtaKind::kRowTiles)
    return 0;
  const int64_t cluster = int64_t{plan.uniform_chunks} * cuda::ctas_per_item(shape, params.group_size * params.q_len);
  if (cluster > cuda::kClusterMergeCtas) return 0;
  const auto size = static_cast<int32_t>(cluster);
  const bool fits = uses_engine_inputs(params) ? cluster_fits<cuda::EnginePagedSource>(params.dtype, size)
                                               : cluster_fits<cuda::PagedSource>(params.dtype, size);
  return fits ? size : 0;
}

/// Which kernel run_decode_cuda launches, decided in one place: the launch
/// and cuda_decode_kernel_name both switch on it. Inside launch_partial the
/// multi-token choice is the same function's (multi_token_cta_kind) over the
/// same parameters.
enum class DecodeKernel { kClusterMerge, kFp8, kMla, kMultiToken, kRowTiles };
struct KernelChoice {
  DecodeKernel kind = DecodeKernel::kRowTiles;
  int32_t cluster = 0;  // kClusterMerge: CTAs per cluster
  cuda::MultiTokenCtaKind multi = cuda::MultiTokenCtaKind::kRowTiles;
};

KernelChoice choose_kernel(const DecodeParams& params, const DecodePlan& plan) {
  KernelChoice c;
  if ((c.cluster = cluster_size_for(params, plan)) > 0) {
    c.kind = DecodeKernel::kClusterMerge;
    return c;
  }
  const int32_t extra = params.k_extra.data != nullptr ? params.k_extra.dim : 0;
  const cuda::TileShape shape = cuda::select_tile_shape(params.k.dim, params.v.dim, extra);
  if (params.kv_format != KvFormat::kNative) {
    c.kind = DecodeKernel::kFp8;
    // e4m3-per-head rows of several query tokens take the 64-row wgmma CTA
    // where the bf16 rows would (the library's own tables only).
    if (params.kv_format == KvFormat::kE4m3PerHead && !uses_engine_inputs(params)) {
      const auto multi =
          cuda::multi_token_cta_kind(shape, params.k.dim, params.v.dim, extra, params.group_size, params.q_len);
      if (multi == cuda::MultiTokenCtaKind::kWgmma) c.multi = multi;
    }
    return c;
  }
  if (shape == cuda::TileShape::kMla) {
    c.kind = DecodeKernel::kMla;
    return c;
  }
  if (!uses_engine_inputs(params)) {  // the 64-row CTAs run the library's own tables only
    c.multi = cuda::multi_token_cta_kind(shape, params.k.dim, params.v.dim, extra, params.group_size, params.q_len);
    if (c.multi != cuda::MultiTokenCtaKind::kRowTiles) c.kind = DecodeKernel::kMultiToken;
  }
  return c;
}

}  // namespace

int32_t cuda_merge_cluster_size(const DecodeParams& params, const DecodePlan& plan) {
  check_decode_params(params, plan);
  return cluster_size_for(params, plan);
}

void cuda_check_kernel_switches() { (void)cuda::multi_token_cta_choice(); }

namespace {

const char* kernel_name(const KernelChoice& c, const DecodeParams& params) {
  switch (c.kind) {
    case DecodeKernel::kClusterMerge: return "16-row tiles, mma.sync, cluster merge";
    case DecodeKernel::kFp8:
      if (params.kv_format != KvFormat::kE4m3Mla) {
        return c.multi == cuda::MultiTokenCtaKind::kWgmma ? "64-row multi-token CTA, wgmma, FP8 e4m3 K/V"
                                                          : "16-row tiles, mma.sync, FP8 e4m3 K/V";
      }
      if (cuda::mla_fp8_runs_pairs(params.group_size, uses_engine_inputs(params)))
        return "MLA FP8 (656-byte rows), wgmma, warp-specialized, CTA pairs";
      return "MLA FP8 (656-byte rows), wgmma, warp-specialized";
    case DecodeKernel::kMla: return "MLA, wgmma, warp-specialized";
    case DecodeKernel::kMultiToken:
      return c.multi == cuda::MultiTokenCtaKind::kWgmma ? "64-row multi-token CTA, wgmma"
                                                        : "64-row multi-token CTA, mma.sync";
    case DecodeKernel::kRowTiles: break;
  }
  return "16-row tiles, mma.sync";
}

}  // namespace

const char* cuda_decode_kernel_name(const DecodeParams& params, const DecodePlan& plan) {
  return kernel_name(choose_kernel(params, plan), params);
}

bool cuda_supports_head_dims(int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra) {
  return cuda::select_tile_shape(head_dim_qk, head_dim_v, head_dim_extra) != cuda::TileShape::kNone;
}

CudaLaunchShape cuda_launch_shape(int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra, int32_t group_size,
                                  int32_t q_len) {
  const cuda::TileShape shape = cuda::select_tile_shape(head_dim_qk, head_dim_v, head_dim_extra);
  if (shape == cuda::TileShape::kNone) throw Error("cuda_launch_shape: no CUDA kernel for these head dims");
  if (group_size < 1) throw Error("cuda_launch_shape: group_size must be at least 1");
  if (q_len < 1) throw Error("cuda_launch_shape: q_len must be at least 1");
  CudaLaunchShape s;
  const cuda::MultiTokenCtaKind multi =
      cuda::multi_token_cta_kind(shape, head_dim_qk, head_dim_v, head_dim_extra, group_size, q_len);
  if (multi != cuda::MultiTokenCtaKind::kRowTiles) {
    s.ctas_per_item = cuda::multi_token_ctas_per_item(group_size, q_len);
    s.ctas_per_sm = cuda::multi_token_resident_ctas<cuda::PagedSource>(multi);
    return s;
  }
  group_size *= q_len;  // the 16-row CTA: query rows
  s.ctas_per_item = cuda::ctas_per_item(shape, group_size);
  if (shape == cuda::TileShape::kK128V128) {
    // Ask the cluster sizes here, before any capture, rather than in run.
    for (int32_t size = 2; size <= cuda::kClusterMergeCtas; ++size) {
      for (DType dtype : {DType::kBF16, DType::kF16}) {
        cluster_fits<cuda::PagedSource>(dtype, size);
        cluster_fits<cuda::EnginePagedSource>(dtype, size);
      }
    }
  }
  s.ctas_per_sm = cuda::resident_ctas_per_sm<cuda::PagedSource>(shape);
  return s;
}

void upload_plan_cuda(const DecodePlan& plan, void* workspace, void* stream) {
  if (workspace == nullptr) throw Error("upload_plan_cuda: workspace is null");
  auto s = static_cast<cudaStream_t>(stream);
  const WorkspaceLayout& ws = plan.workspace;
  if (!plan.work.empty())
    SP_CUDA_CHECK(cudaMemcpyAsync(at(workspace, ws.work_items), plan.work.data(), plan.work.size() * sizeof(WorkItem),
                                  cudaMemcpyHostToDevice, s));
  if (!plan.merge_indptr.empty())
    SP_CUDA_CHECK(cudaMemcpyAsync(at(workspace, ws.merge_indptr), plan.merge_indptr.data(),
                                  plan.merge_indptr.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  if (!plan.merge_requests.empty())
    SP_CUDA_CHECK(cudaMemcpyAsync(at(workspace, ws.merge_requests), plan.merge_requests.data(),
                                  plan.merge_requests.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
  clear_error_flag(at(workspace, ws.error_flag), s);
  // The copies read pageable host vectors the caller may free or change as
  // soon as we return; waiting here keeps them out of run and out of capture.
  SP_CUDA_CHECK(cudaStreamSynchronize(s));
}

const char* run_decode_cuda(const DecodeParams& params, const DecodePlan& plan, void* workspace, void* stream) {
  return detail::run_decode_cuda(params, plan, workspace, stream, kMaxQueryTokens);
}

const char* detail::run_decode_cuda(const DecodeParams& params, const DecodePlan& plan, void* workspace, void* stream,
                                    int32_t max_q_len, const MergeFinish& finish) {
  detail::check_decode_params(params, plan, max_q_len);
  cuda::check_stream_layout("run_decode_cuda", params.dtype, params.q, params.q_extra, params.k, params.v,
                            params.k_extra, params.o);
  const std::string qo_problem = cuda_layout_problem(params);
  if (!qo_problem.empty()) throw Error("run_decode_cuda: " + qo_problem);
  const KernelChoice choice = choose_kernel(params, plan);
  const char* name = kernel_name(choice, params);
  if (plan.work.empty()) return name;
  if (workspace == nullptr) throw Error("run_decode_cuda: workspace is null");
  auto s = static_cast<cudaStream_t>(stream);

  cuda::PagedSource::Params p;
  static_cast<cuda::PartialCommon&>(p) =
      cuda::stream_params(params.q, params.q_extra, params.k, params.v, params.k_extra, params.num_kv_heads,
                          params.group_size, params.scale);
  if (plan.uniform_chunks > 0) {
    // Each CTA computes its item from its index: no list to read first.
    p.work = nullptr;
    p.chunks_per_request = plan.uniform_chunks;
    p.chunk_tokens = plan.uniform_chunk_tokens;
    p.uniform_len = plan.seq_lens.empty() ? 0 : plan.seq_lens[0];
    p.balance_live = params.balance_live_counts;
  } else {
    p.work = reinterpret_cast<const WorkItem*>(at(workspace, plan.workspace.work_items));
    p.num_items = static_cast<int32_t>(plan.work.size());
  }
  p.o = params.o;
  p.lse = params.lse;
  p.partial_o = reinterpret_cast<float*>(at(workspace, plan.workspace.partial_o));
  p.partial_lse = reinterpret_cast<float*>(at(workspace, plan.workspace.partial_lse));
  p.partial_dv = plan.head_dim_v;
  p.error_flag = reinterpret_cast<uint32_t*>(at(workspace, plan.workspace.error_flag));
  const QoStrides qo = qo_strides(params);
  p.q_seq = qo.q.seq_stride;
  p.q_head = qo.q.head_stride;
  if (p.q_extra != nullptr) {
    p.qe_seq = qo.q_extra.seq_stride;
    p.qe_head = qo.q_extra.head_stride;
  }
  p.o_seq = qo.o.seq_stride;
  p.o_head = qo.o.head_stride;
  if (params.q_len > 1) {
    p.q_len = params.q_len;
    p.q_tok = qo.q.token_stride;
    p.qe_tok = p.q_extra != nullptr ? qo.q_extra.token_stride : 0;
    p.o_tok = qo.o.token_stride;
  }
  p.table.indptr = params.indptr;
  p.table.indices = params.indices;
  p.table.first_page_offset = params.first_page_offset;
  p.table.seq_lens = params.seq_lens;
  p.table.lens_per_sequence = params.seq_lens_index == SeqLensIndex::kPerSequence;
  p.table.page_size = params.page_size;
  p.table.page_shift = page_shift_of(params.page_size);
  p.table.num_pool_pages = params.num_pool_pages;
  p.table.addressing = params.addressing;
  p.table.skip_minus_one = params.padding == IndexPadding::kMinusOneSkips;
  p.table.matrix = params.index_layout == IndexLayout::kMatrix;
  p.table.index_width = params.index_width;
  p.table.index_seq_stride = params.index_seq_stride;
  p.table.index_head_stride = params.index_head_stride;
  p.table.window_lens = params.window_lens;
  p.table.window_len = params.window_len;
  p.table.max_window_len = window_lens_bound(params);
  if (params.addressing == PageAddressing::kBlockTable) {
    p.table.block_table = params.block_table;
    p.table.block_shift = page_shift_of(params.block_table.block_size);
  }

  const cuda::TileShape shape = cuda::select_tile_shape(p.dqk, p.dv, p.de);
  if (shape == cuda::TileShape::kMla && params.q_len > 1)
    throw Error("run_decode_cuda: q_len = " + std::to_string(params.q_len) +
                " at the MLA shape: its kernel takes one query token per request (make each token a request, "
                "as the DSA layer does)");
  // The engines' index forms take their own instantiation; the library's CSR
  // tables keep the lean row lookup.
  const bool engine_inputs = uses_engine_inputs(params);
  const auto items = static_cast<int32_t>(plan.work.size());
  if (choice.kind == DecodeKernel::kClusterMerge) {
    // Split requests merge inside their clusters: one launch, no partials
    // (and no sink: only the MLA shape, which never clusters, passes one).
    if (finish.sink != nullptr || finish.empty_lse != detail::MergeFinish{}.empty_lse)
      throw Error("run_decode_cuda: a merge finish (sink, empty lse) reached the cluster-merge kernel");
    const int32_t cluster = choice.cluster;
    const bool bf16 = params.dtype == DType::kBF16;
    if (engine_inputs) {
      if (bf16)
        cuda::launch_partial_cluster<__nv_bfloat16, cuda::EnginePagedSource>(p, items, cluster, s);
      else
        cuda::launch_partial_cluster<__half, cuda::EnginePagedSource>(p, items, cluster, s);
    } else {
      if (bf16)
        cuda::launch_partial_cluster<__nv_bfloat16, cuda::PagedSource>(p, items, cluster, s);
      else
        cuda::launch_partial_cluster<__half, cuda::PagedSource>(p, items, cluster, s);
    }
    return name;
  }
  if (choice.kind == DecodeKernel::kFp8) {
    cuda::launch_partial_fp8(p, params.kv_format, params.dtype, params.k_scale, params.v_scale, engine_inputs,
                             choice.multi == cuda::MultiTokenCtaKind::kWgmma, items, s);
  } else if (engine_inputs) {
    cuda::launch_partial<cuda::EnginePagedSource>(p, shape, params.dtype, items, s);
  } else {
    cuda::launch_partial<cuda::PagedSource>(p, shape, params.dtype, items, s);
  }
  if (plan.needs_merge()) {
    if (params.dtype == DType::kBF16)
      run_merge<__nv_bfloat16>(params, qo, plan, workspace, finish, s);
    else
      run_merge<__half>(params, qo, plan, workspace, finish, s);
  }
  return name;
}

DecodeErrors read_decode_errors(const DecodePlan& plan, void* workspace, void* stream) {
  if (workspace == nullptr) throw Error("read_decode_errors: workspace is null");
  auto s = static_cast<cudaStream_t>(stream);
  uint32_t words[2] = {0, 0};
  void* device_flag = at(workspace, plan.workspace.error_flag);
  SP_CUDA_CHECK(cudaMemcpyAsync(words, device_flag, sizeof(words), cudaMemcpyDeviceToHost, s));
  clear_error_flag(device_flag, s);
  SP_CUDA_CHECK(cudaStreamSynchronize(s));
  DecodeErrors e;
  e.kinds = words[0];
  // A request index is below 2^31; anything else (no report, or a workspace
  // whose plan was never uploaded) names none.
  e.first_request = e.kinds != 0 && words[1] <= static_cast<uint32_t>(INT32_MAX) ? static_cast<int32_t>(words[1]) : -1;
  return e;
}

uint32_t read_decode_error_flag(const DecodePlan& plan, void* workspace, void* stream) {
  if (workspace == nullptr) throw Error("read_decode_error_flag: workspace is null");
  return read_decode_errors(plan, workspace, stream).kinds;
}

}  // namespace sparsepage
