// CUDA mask path (mask_path.h) and the device half of gather_rows.
//
// The mask path is the baseline the fused sparse kernel is measured against,
// so it runs the very same partial + merge kernels (DenseSource instead of
// PagedSource): every live row is streamed through the same cp.async pipeline
// and tensor-core tile, plus the additive mask. Its split is uniform (every
// request has live_len tokens), so work item i is computed from blockIdx.x and
// nothing has to be uploaded: run allocates, syncs and reads back nothing.
#include <algorithm>
#include <string>

#include "core/cuda_hooks.h"
#include "cuda/attention/launch_partial.cuh"
#include "cuda/merge/decode_merge.cuh"
#include "cuda/primitives/common.cuh"
#include "sparsepage/mask_path.h"

namespace sparsepage {

namespace {

// The split comes from the plan's own chunking (make_uniform_split), with
// the mask path's knobs: at most two CTAs per SM and chunks of at least one
// 64-row tile (every request spans the whole window, so short chunks still
// fill the machine at small batch).
struct MaskedSplit {
  int64_t requests = 0;
  UniformSplit split;
  size_t partial_lse_offset = 0;
  size_t total_bytes = 0;
};

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

MaskedSplit masked_split(const MaskedDecodeParams& params, int32_t num_sms) {
  MaskedSplit s;
  s.requests = int64_t{params.batch} * params.num_kv_heads;
  const cuda::TileShape tile =
      cuda::select_tile_shape(params.k.dim, params.v.dim, params.k_extra.data ? params.k_extra.dim : 0);
  PlanShape shape;
  shape.group_size = params.group_size;
  shape.head_dim_v = params.v.dim;
  shape.num_sms = std::max(num_sms, 1);
  shape.items_per_sm = std::min(2, cuda::resident_ctas_per_sm<cuda::DenseSource>(tile));
  shape.ctas_per_item = cuda::ctas_per_item(tile, params.group_size);
  shape.min_chunk_tokens = cuda::kTileRows;
  shape.chunk_granule = cuda::kTileRows;
  s.split = make_uniform_split(s.requests, params.live_len, shape);
  if (s.split.chunks_per_request > 1) {
    const size_t partials = static_cast<size_t>(s.requests * s.split.chunks_per_request) * params.group_size;
    s.partial_lse_offset = align256(partials * params.v.dim * sizeof(float));
    s.total_bytes = s.partial_lse_offset + align256(partials * sizeof(float));
  }
  return s;
}

void check_masked_cuda_layout(const MaskedDecodeParams& params) {
  const char* api = "run_masked_decode_cuda";
  if (params.dtype == DType::kF32)
    throw Error(std::string(api) + ": f32 is not supported on CUDA (the tensor-core tile takes bf16/f16); "
                                   "run dequantized f32 caches through run_masked_decode_cpu or convert them to bf16");
  cuda::check_stream_layout(api, params.dtype, params.q, params.q_extra, params.k, params.v, params.k_extra, params.o);
  if (params.live_len > int64_t{INT32_MAX} - cuda::kTileRows)
    throw Error(std::string(api) + ": live_len = " + std::to_string(params.live_len) + " is too large");
}

}  // namespace

size_t masked_decode_workspace_bytes(const MaskedDecodeParams& params, int32_t num_sms) {
  if (num_sms <= 0) num_sms = cuda_multiprocessor_count();
  return masked_split(params, num_sms).total_bytes;
}

void run_masked_decode_cuda(const MaskedDecodeParams& params, void* workspace, void* stream) {
  check_masked_decode_params(params);
  check_masked_cuda_layout(params);
  // The current device's multiprocessors, asked per call: a process that
  // switches devices gets the right split.
  const MaskedSplit split = masked_split(params, cuda_multiprocessor_count());
  if (split.requests == 0) return;
  if (split.total_bytes > 0 && workspace == nullptr)
    throw Error("run_masked_decode_cuda: workspace is null (size it with masked_decode_workspace_bytes)");
  auto s = static_cast<cudaStream_t>(stream);
  auto* ws = static_cast<unsigned char*>(workspace);

  cuda::DenseSource::Params p;
  static_cast<cuda::PartialCommon&>(p) =
      cuda::stream_params(params.q, params.q_extra, params.k, params.v, params.k_extra, params.num_kv_heads,
                          params.group_size, params.scale);
  p.work = nullptr;
  p.chunks_per_request = static_cast<int32_t>(split.split.chunks_per_request);
  p.chunk_tokens = static_cast<int32_t>(split.split.chunk_tokens);
  p.uniform_len = static_cast<int32_t>(params.live_len);
  p.o = params.o;
  p.lse = params.lse;
  p.partial_o = split.total_bytes ? reinterpret_cast<float*>(ws) : nullptr;
  p.partial_lse = split.total_bytes ? reinterpret_cast<float*>(ws + split.partial_lse_offset) : nullptr;
  p.partial_dv = params.v.dim;
  p.table.mask = params.mask;
  p.table.mask_pitch = params.mask_pitch > 0 ? params.mask_pitch : params.live_len;
  p.table.live_lens = params.live_lens;

  const int64_t items = split.requests * split.split.chunks_per_request;
  if (items > INT32_MAX) throw Error("run_masked_decode_cuda: too many work items");
  cuda::launch_partial<cuda::DenseSource>(p, cuda::select_tile_shape(p.dqk, p.dv, p.de), params.dtype,
                                          static_cast<int32_t>(items), s);
  if (split.split.chunks_per_request > 1) {
    cuda::MergeParams m;
    m.partial_o = p.partial_o;
    m.partial_lse = p.partial_lse;
    m.chunks_per_request = p.chunks_per_request;
    m.group_size = params.group_size;
    m.dv = params.v.dim;
    m.partial_dv = params.v.dim;
    m.num_kv_heads = p.num_kv_heads;  // o is packed [batch, num_qo_heads, dv]
    m.o_seq = p.o_seq;
    m.o_head = p.o_head;
    m.o = params.o;
    m.lse = params.lse;
    const auto num_merge = static_cast<int32_t>(split.requests);
    if (params.dtype == DType::kBF16)
      cuda::launch_merge<__nv_bfloat16>(m, p.chunks_per_request, num_merge, s);
    else
      cuda::launch_merge<__half>(m, p.chunks_per_request, num_merge, s);
  }
}

// ---- gather_rows --------------------------------------------------------------

namespace {

struct GatherParams {
  const int32_t* rows = nullptr;     // selection rows
  const int32_t* offsets = nullptr;  // [num_requests + 1]
  const void* pool = nullptr;
  int64_t stride_words = 0;  // pool row stride in words
  int64_t row_words = 0;     // words per copied row
  int64_t num_pool_rows = 0;
  int64_t max_rows = 0;
  void* dst = nullptr;  // [num_requests, max_rows, row_words]
};

/// Word type W is 16 bytes when every row is 16-byte aligned, else one element.
/// All-ones bits are NaN in f32, f16 and bf16 alike.
template <typename W>
__global__ void gather_rows_kernel(const __grid_constant__ GatherParams p) {
  const int64_t r = blockIdx.y;
  const int64_t begin = p.offsets[r];
  const int64_t count = p.offsets[r + 1] - begin;
  const W* pool = static_cast<const W*>(p.pool);
  W* dst = static_cast<W*>(p.dst) + r * p.max_rows * p.row_words;
  const int64_t total = p.max_rows * p.row_words;
  for (int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx / p.row_words, w = idx % p.row_words;
    W value;
    memset(&value, 0, sizeof(W));
    if (i < count) {
      const int64_t row = p.rows[begin + i];
      if (row >= 0 && row < p.num_pool_rows)
        value = pool[row * p.stride_words + w];
      else
        memset(&value, 0xFF, sizeof(W));
    }
    dst[idx] = value;
  }
}

}  // namespace

}  // namespace sparsepage

namespace sparsepage::detail {

void gather_rows_cuda(const int32_t* rows, const int32_t* offsets, int32_t num_requests, int64_t max_rows, DType dtype,
                      const RowView& pool, int64_t num_pool_rows, void* dst, void* stream) {
  // gather_rows (src/cpu/mask_path_cpu.cc) checked the pool and the counts.
  if (num_requests == 0 || max_rows == 0) return;
  if (dst == nullptr || offsets == nullptr) throw Error("gather_rows: null dst or offsets");
  const size_t elem = dtype_size(dtype);
  if (num_requests > 65535) throw Error("gather_rows: more than 65535 requests on CUDA");
  const size_t row_bytes = static_cast<size_t>(pool.dim) * elem;
  const size_t stride_bytes = static_cast<size_t>(pool.row_stride) * elem;
  const bool vec16 = row_bytes % 16 == 0 && stride_bytes % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(pool.data) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const size_t word = vec16 ? 16 : elem;
  GatherParams p;
  p.rows = rows;
  p.offsets = offsets;
  p.pool = pool.data;
  p.stride_words = static_cast<int64_t>(stride_bytes / word);
  p.row_words = static_cast<int64_t>(row_bytes / word);
  p.num_pool_rows = num_pool_rows;
  p.max_rows = max_rows;
  p.dst = dst;
  const int64_t total = max_rows * p.row_words;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 1024)),
                  static_cast<unsigned>(num_requests));
  auto s = static_cast<cudaStream_t>(stream);
  if (vec16)
    gather_rows_kernel<uint4><<<grid, 256, 0, s>>>(p);
  else if (elem == 4)
    gather_rows_kernel<uint32_t><<<grid, 256, 0, s>>>(p);
  else
    gather_rows_kernel<uint16_t><<<grid, 256, 0, s>>>(p);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage::detail
