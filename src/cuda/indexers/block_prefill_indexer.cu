// The block-sparse prefill's selection on the GPU (core/prefill_kernels.h):
//   1. block_scores_kernel: per (sequence, query block, KV head) and a range
//      of key blocks, the max-pooled score max_{t, p} q_index[t] . k_index[p]
//      of each key block below the forced ones: a [block_size x block_size]
//      product on mma.sync (Q fragments in registers, the key blocks
//      double-buffered by cp.async: the layer's rows, or an engine's paged
//      keys through its table, FP8 ones widened to T in shared memory),
//      reduced to its maximum;
//   2. block_select_kernel: per list, the top blocks by a radix select over
//      (score, block id) composites (ties to the lower id, NaN last), the
//      forced blocks scoring +inf, written in increasing order with the
//      query's own block last, and the count;
//   3. static_blocks_kernel: the static per-query-head pattern's lists.
// One plain launch each on the caller's stream; nothing allocated, nothing
// read back.
#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <string>
#include <type_traits>

#include "core/prefill_kernels.h"
#include "cuda/indexers/paged_keys.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/radix_select.cuh"
#include "models/static_block_pattern.h"

namespace sparsepage::detail {
namespace {

// ---- 1. block scores ----------------------------------------------------------

constexpr int kScoreWarps = 4;
constexpr int kScoreThreads = kScoreWarps * 32;
constexpr int kDim = 128;          // index head dim the kernel is built for
constexpr int kChunks = kDim / 8;  // 16-byte pieces per row
constexpr int kKSteps = kDim / 16;
constexpr int kKeyBlocksPerCta = 8;  // key blocks one CTA scores against its Q tile

__device__ __forceinline__ int64_t length_of(const PrefillChunk& c, int64_t b) {
  return c.kv_lens != nullptr ? int64_t{c.kv_lens[b]} : c.kv_len;
}

/// Shared memory: the query block's Q tile, then two key-block stages, each
/// kBlock rows of kDim elements in the ldmatrix swizzle; FP8 keys land first
/// in two raw stages (kDim e4m3 bytes a row), their scales after them.
template <int kBlock, bool kFp8 = false>
struct ScoreSmem {
  static constexpr size_t kTileBytes = size_t{kBlock} * kDim * 2;
  static constexpr size_t kRawBytes = kFp8 ? size_t{kBlock} * kDim : 0;
  static constexpr size_t kScaleBytes = kFp8 ? size_t{kBlock} * 4 : 0;
  static constexpr size_t kRawOffset = 3 * kTileBytes;
  static constexpr size_t kScaleOffset = kRawOffset + 2 * kRawBytes;
  static constexpr size_t kBytes = kScaleOffset + 2 * kScaleBytes;
};

/// Copies `rows` rows (of a tile of kBlock) into the swizzled tile at `dst`;
/// rows at or past `valid` are zero-filled without a read.
template <typename T, int kBlock>
__device__ void load_tile(T* dst, const T* first_row, int64_t row_stride, int valid) {
  for (int i = threadIdx.x; i < kBlock * kChunks; i += kScoreThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const bool live = row < valid;
    const T* src = first_row + (live ? row * row_stride + chunk * 8 : 0);
    cuda::cp_async_16(cuda::smem_u32(dst + cuda::swizzle(row, chunk, kChunks)), src, live);
  }
}

/// Key block j of a sequence of an engine's paged keys (its table row
/// `row`) into a stage: native rows by cp.async straight into the swizzled
/// tile; FP8 rows' values by cp.async into the stage's raw buffer, their
/// scales held in registers until store_scales, so the loads stay in
/// flight under the products of the block before. A row in a block
/// outside the pool is never read (zero-filled) and sets `refused`.
template <typename T, int kBlock, KeySource Src>
struct PagedFetch {
  static constexpr bool kFp8 = Src == KeySource::kPagedFp8;
  static constexpr int kPieces = kFp8 ? kDim / 16 : kChunks;  // 16-byte pieces per key row
  static constexpr int kPerThread = kBlock * kPieces / kScoreThreads;
  static_assert(kBlock * kPieces % kScoreThreads == 0, "whole rounds of pieces");
  float scale[kFp8 ? kPerThread : 1];
  bool refused = false;

  __device__ __forceinline__ void issue(T* tile, unsigned char* raw, const PagedKeys& k, const int32_t* row,
                                        int64_t j) {
    refused = false;
#pragma unroll
    for (int it = 0; it < kPerThread; ++it) {
      const int i = static_cast<int>(threadIdx.x) + it * kScoreThreads, r = i / kPieces, piece = i % kPieces;
      const KeyRow key = paged_key_row<Src>(k, row, j * kBlock + r, refused);
      const bool live = key.ptr != nullptr;
      const unsigned char* src = live ? key.ptr + piece * 16 : k.pool;  // not read when refused
      if constexpr (kFp8) {
        cuda::cp_async_16(cuda::smem_u32(raw + r * kDim + piece * 16), src, live);
        scale[it] = key.scale;
      } else {
        cuda::cp_async_16(cuda::smem_u32(tile + cuda::swizzle(r, piece, kChunks)), src, live);
      }
    }
  }
  /// FP8: the scales of the rows whose first piece this thread fetched.
  __device__ __forceinline__ void store_scales(float* scales) const {
    if constexpr (kFp8) {
#pragma unroll
      for (int it = 0; it < kPerThread; ++it) {
        const int i = static_cast<int>(threadIdx.x) + it * kScoreThreads;
        if (i % kPieces == 0) scales[i / kPieces] = scale[it];
      }
    }
  }
};

/// FP8 keys: a landed block's e4m3 values (`raw`, kDim bytes a row) widened
/// to T (exact) into the swizzled tile; the scales apply to the products.
template <typename T, int kBlock>
__device__ __forceinline__ void widen_block(T* tile, const unsigned char* raw) {
  for (int i = threadIdx.x; i < kBlock * kChunks; i += kScoreThreads) {
    const int r = i / kChunks, chunk = i % kChunks;
    const uint2 v = *reinterpret_cast<const uint2*>(raw + r * kDim + chunk * 8);
    const uint2 lo = cuda::e4m3x4_to<T>(v.x), hi = cuda::e4m3x4_to<T>(v.y);
    *reinterpret_cast<uint4*>(tile + cuda::swizzle(r, chunk, kChunks)) = make_uint4(lo.x, lo.y, hi.x, hi.y);
  }
}

/// The scores' parameter: the dense kernels' own, or with the paged keys.
template <KeySource Src>
using ScoresArgs = std::conditional_t<Src == KeySource::kRows, BlockScoresArgs, PagedScoresArgs>;

/// Grid: (key-block ranges, lists); list = (b * query_blocks + i) * heads + h.
/// Warp w owns query rows [w * kBlock / 4, (w + 1) * kBlock / 4) of the block
/// (kMTiles m16 tiles) against every key of each key block. Src: the
/// layer's rows (a.keys) or an engine's paged keys (a.paged).
template <typename T, int kBlock, KeySource Src>
__global__ void __launch_bounds__(kScoreThreads) block_scores_kernel(const ScoresArgs<Src> a) {
  constexpr bool kPaged = Src != KeySource::kRows, kFp8 = Src == KeySource::kPagedFp8;
  using Smem = ScoreSmem<kBlock, kFp8>;
  constexpr int kMTiles = kBlock / 4 / 16;
  static_assert(kMTiles >= 1 && kBlock % 64 == 0, "16-row tiles per warp");
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_tile = reinterpret_cast<T*>(smem);
  T* stages = reinterpret_cast<T*>(smem + Smem::kTileBytes);
  __shared__ float warp_max[kScoreWarps];

  const int32_t query_blocks = (a.chunk.num_tokens + kBlock - 1) / kBlock;
  const int64_t list = blockIdx.y;
  const int32_t h = static_cast<int32_t>(list % a.num_kv_heads);
  const int64_t i = (list / a.num_kv_heads) % query_blocks, b = list / (int64_t{a.num_kv_heads} * query_blocks);
  const int64_t start = length_of(a.chunk, b) - a.chunk.num_tokens;
  if (start < 0 || start % kBlock != 0) return;                    // refused where the attention runs (block windows)
  if constexpr (kPaged) {
    // Past the bound the score rows and the key table were checked for:
    // not scored (the select refuses the list).
    if (length_of(a.chunk, b) > a.chunk.kv_len) {
      if (threadIdx.x == 0 && a.error != nullptr) atomicOr(a.error, kIndexErrorLength);
      return;
    }
  }
  const int64_t scored = start / kBlock + i + 1 - a.local_blocks;  // key blocks below the forced ones
  const int64_t j0 = int64_t{blockIdx.x} * kKeyBlocksPerCta;
  const int64_t j1 = min(scored, j0 + kKeyBlocksPerCta);
  if (j0 >= j1) return;
  const int valid = static_cast<int>(min(int64_t{kBlock}, a.chunk.num_tokens - i * kBlock));  // query rows of the block

  const T* q = static_cast<const T*>(a.q_index) + ((b * a.chunk.num_tokens + i * kBlock) * a.num_kv_heads + h) * kDim;
  const T* keys = static_cast<const T*>(a.keys.data) + b * a.keys.seq_stride;
  load_tile<T, kBlock>(q_tile, q, int64_t{a.num_kv_heads} * kDim, valid);
  cuda::cp_async_commit();
  // Paged keys: the sequence's table row, this thread's fetch in flight,
  // and whether the block in each stage had a row outside the pool.
  [[maybe_unused]] const int32_t* table_row = nullptr;
  [[maybe_unused]] unsigned char* raw = smem + Smem::kRawOffset;
  [[maybe_unused]] float* key_scales = reinterpret_cast<float*>(smem + Smem::kScaleOffset);
  [[maybe_unused]] PagedFetch<T, kBlock, Src> fetch;
  [[maybe_unused]] bool stage_refused = false;
  if constexpr (kPaged) {
    table_row = a.paged.table + b * a.paged.table_stride;
    fetch.issue(stages, raw, a.paged, table_row, j0);
    fetch.store_scales(key_scales);
    stage_refused = fetch.refused;
  } else {
    load_tile<T, kBlock>(stages, keys + j0 * kBlock * a.keys.row_stride, a.keys.row_stride, kBlock);
  }
  cuda::cp_async_commit();
  cuda::cp_async_wait<1>();
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t qf[kMTiles][kKSteps][4];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const int row = warp * (kBlock / 4) + m * 16 + (lane & 15);
      cuda::ldmatrix_x4(qf[m][kk], cuda::smem_u32(q_tile + cuda::swizzle(row, 2 * kk + (lane >> 4), kChunks)));
    }
  }
  // Which of this thread's accumulator rows are tokens of the block.
  bool live[kMTiles][2];
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
    live[m][0] = warp * (kBlock / 4) + m * 16 + lane / 4 < valid;
    live[m][1] = warp * (kBlock / 4) + m * 16 + lane / 4 + 8 < valid;
  }

  float* out = a.scores + list * a.key_blocks;
  for (int64_t j = j0; j < j1; ++j) {
    const int stage = static_cast<int>((j - j0) & 1);
    if constexpr (kPaged) {
      if (j + 1 < j1)
        fetch.issue(stages + (1 - stage) * kBlock * kDim, raw + (1 - stage) * Smem::kRawBytes, a.paged, table_row,
                    j + 1);
    } else if (j + 1 < j1) {
      load_tile<T, kBlock>(stages + (1 - stage) * kBlock * kDim, keys + (j + 1) * kBlock * a.keys.row_stride,
                           a.keys.row_stride, kBlock);
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait<1>();
    [[maybe_unused]] bool refused = false;  // a row of key block j lay outside the pool (paged)
    if constexpr (kPaged) {
      refused = __syncthreads_or(stage_refused ? 1 : 0) != 0;  // key block j landed for every thread
      if constexpr (kFp8) {
        widen_block<T, kBlock>(stages + stage * kBlock * kDim, raw + stage * Smem::kRawBytes);
        __syncthreads();
      }
    } else {
      __syncthreads();  // key block j landed for every thread
    }
    const T* kt = stages + stage * kBlock * kDim;
    float best = cuda::neg_inf_f32();
#pragma unroll 1
    for (int kg = 0; kg < kBlock / 16; ++kg) {  // 16 keys at a time: two n8 tiles
      float s[kMTiles][2][4] = {};
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        const int key = kg * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t bf[4];
        cuda::ldmatrix_x4(bf, cuda::smem_u32(kt + cuda::swizzle(key, 2 * kk + ((lane >> 3) & 1), kChunks)));
#pragma unroll
        for (int m = 0; m < kMTiles; ++m) {
          cuda::mma_16816<T>(s[m][0], qf[m][kk], bf[0], bf[1]);
          cuda::mma_16816<T>(s[m][1], qf[m][kk], bf[2], bf[3]);
        }
      }
      if constexpr (kFp8) {  // each key's scale: accumulator columns 2c, 2c + 1 of both n8 tiles
        const float* ks = key_scales + stage * kBlock + kg * 16 + 2 * (lane % 4);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float k0 = ks[nt * 8], k1 = ks[nt * 8 + 1];
#pragma unroll
          for (int m = 0; m < kMTiles; ++m) {
            s[m][nt][0] *= k0;
            s[m][nt][1] *= k1;
            s[m][nt][2] *= k0;
            s[m][nt][3] *= k1;
          }
        }
      }
#pragma unroll
      for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if (live[m][0]) best = fmaxf(best, fmaxf(s[m][nt][0], s[m][nt][1]));  // NaN products are ignored
          if (live[m][1]) best = fmaxf(best, fmaxf(s[m][nt][2], s[m][nt][3]));
        }
      }
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, off));
    if (lane == 0) warp_max[warp] = best;
    __syncthreads();  // every warp is done with this stage and wrote its max
    if (threadIdx.x == 0) {
      float m = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
      if constexpr (kPaged) {
        // A key row outside the pool: the block scores NaN, which no real
        // score is (fmaxf drops NaN products), and the select refuses the list.
        if (refused) {
          m = __int_as_float(0x7fffffff);
          if (a.error != nullptr) atomicOr(a.error, kIndexErrorBlock);
        }
      }
      out[j] = m;
    }
    if constexpr (kPaged) {
      if (j + 1 < j1) {
        fetch.store_scales(key_scales + (1 - stage) * kBlock);  // stage 1 - stage was last read before the barrier
        stage_refused = fetch.refused;
      }
    }
  }
  cuda::cp_async_wait<0>();
}

// ---- 2. the top blocks ---------------------------------------------------------

constexpr int kSelectThreads = 256;

/// kRefuse (paged keys): a list of a sequence past chunk.kv_len, or whose
/// scored blocks include a NaN score (a key block the scores refused),
/// selects nothing.
template <bool kRefuse>
__global__ void __launch_bounds__(kSelectThreads) block_select_kernel(const BlockSelectArgs a) {
  using Select = cuda::RadixSelect<kSelectThreads>;
  using Scan = cub::BlockScan<int32_t, kSelectThreads>;
  __shared__ typename Select::Storage select;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int32_t offset;
  const int32_t query_blocks = (a.chunk.num_tokens + a.block_size - 1) / a.block_size;
  const int64_t list = blockIdx.x;
  const int64_t i = (list / a.num_kv_heads) % query_blocks, b = list / (int64_t{a.num_kv_heads} * query_blocks);
  const int64_t start = length_of(a.chunk, b) - a.chunk.num_tokens;
  const int32_t width = a.top_blocks + 1;
  int32_t* ids = a.block_ids + list * width;
  if (start < 0 || start % a.block_size != 0) {  // refused where the attention runs (block windows)
    for (int e = threadIdx.x; e < width; e += kSelectThreads) ids[e] = -1;
    if (threadIdx.x == 0) a.counts[list] = 0;
    return;
  }
  const int64_t query_block = start / a.block_size + i;
  const int64_t end = start + min(int64_t{a.block_size} * (i + 1), int64_t{a.chunk.num_tokens});
  const int64_t keep = min(int64_t{a.top_blocks}, query_block);
  const int32_t n = static_cast<int32_t>(query_block);  // candidates: blocks 0 .. query_block - 1
  const int bits = cuda::position_bits(a.key_blocks);
  const uint64_t low = (uint64_t{1} << bits) - 1;
  const float* scores = a.scores + list * a.key_blocks;
  if constexpr (kRefuse) {
    const bool too_long = length_of(a.chunk, b) > a.chunk.kv_len;  // its scores were not written
    int bad = too_long ? 1 : 0;
    const int64_t scored = min(query_block, query_block + 1 - a.local_blocks);
    for (int64_t j = threadIdx.x; !too_long && j < scored; j += kSelectThreads) bad |= isnan(scores[j]) ? 1 : 0;
    if (__syncthreads_or(bad) != 0) {
      for (int e = threadIdx.x; e < width; e += kSelectThreads) ids[e] = -1;
      if (threadIdx.x == 0) a.counts[list] = 0;
      return;
    }
  }
  const auto composite = [&](int32_t j) {
    const float s = j >= query_block + 1 - a.local_blocks ? __int_as_float(0x7f800000) : scores[j];
    return (static_cast<uint64_t>(cuda::score_key(s)) << bits) | (low - static_cast<uint64_t>(j));
  };
  const cuda::RadixCut cut = Select::run(composite, n, static_cast<int32_t>(keep), 32 + bits, select);
  if (threadIdx.x == 0) offset = 0;
  __syncthreads();
  for (int32_t first = 0; first < n; first += kSelectThreads) {
    const int32_t j = first + static_cast<int32_t>(threadIdx.x);
    const int32_t kept = j < n && cut.keeps(composite(j)) ? 1 : 0;
    int32_t slot, total;
    Scan(scan).ExclusiveSum(kept, slot, total);
    if (kept && offset + slot < keep) ids[offset + slot] = j;
    __syncthreads();  // every thread read offset and is past the scan storage
    if (threadIdx.x == 0) offset += total;
    __syncthreads();
  }
  for (int64_t e = keep + threadIdx.x; e < width; e += kSelectThreads) {
    ids[e] = e == keep ? static_cast<int32_t>(query_block) : -1;
  }
  if (threadIdx.x == 0) a.counts[list] = static_cast<int32_t>(keep * a.block_size + (end - query_block * a.block_size));
}

// ---- 3. the static pattern ---------------------------------------------------

__global__ void static_blocks_kernel(const StaticBlocksArgs a) {
  const int32_t blocks = (a.chunk.num_tokens + a.block_size - 1) / a.block_size;
  const int32_t g = a.num_qo_heads / a.num_kv_heads;
  const StaticPattern pattern{a.block_size, a.local_blocks, a.vert_stride, a.head_sliding_step};
  const int64_t lists = int64_t{a.chunk.batch} * a.num_kv_heads * blocks * g;
  const int64_t total = lists * a.width;
  for (int64_t x = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; x < total; x += int64_t{gridDim.x} * blockDim.x) {
    const int64_t list = x / a.width, e = x % a.width;
    const int64_t gg = list % g, i = (list / g) % blocks, kv = (list / (int64_t{g} * blocks)) % a.num_kv_heads;
    const int64_t b = list / (int64_t{g} * blocks * a.num_kv_heads);
    const int64_t start = length_of(a.chunk, b) - a.chunk.num_tokens;
    const int64_t end = start + min(int64_t{i + 1} * a.block_size, int64_t{a.chunk.num_tokens});
    const int32_t h = static_cast<int32_t>(kv * g + gg);
    const StaticKeptBlocks kept = static_kept_blocks(pattern, h, end);
    a.block_ids[x] = e < kept.count() ? static_cast<int32_t>(kept.at(e)) : -1;
    if (e == 0) a.counts[list] = static_cast<int32_t>(static_kept_tokens(pattern, h, end));
  }
}

template <typename T, int kBlock, KeySource Src>
void launch_scores(const ScoresArgs<Src>& a, cudaStream_t stream) {
  auto kernel = block_scores_kernel<T, kBlock, Src>;
  constexpr size_t smem = ScoreSmem<kBlock, Src == KeySource::kPagedFp8>::kBytes;
  cuda::configure_smem_once(kernel, smem);
  const int64_t lists = int64_t{a.chunk.batch} * ((a.chunk.num_tokens + kBlock - 1) / kBlock) * a.num_kv_heads;
  const int64_t ranges = std::max<int64_t>(1, (a.key_blocks + kKeyBlocksPerCta - 1) / kKeyBlocksPerCta);
  if (lists > 65535) throw Error("BlockPrefillIndexer: more than 65535 (sequence, query block, KV head) lists");
  kernel<<<dim3(static_cast<unsigned>(ranges), static_cast<unsigned>(lists)), kScoreThreads, smem, stream>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

template <KeySource Src>
void launch_scores(const ScoresArgs<Src>& a, cudaStream_t stream) {
  const bool bf16 = a.dtype == DType::kBF16;
  if (a.block_size == 64) {
    if (bf16)
      launch_scores<__nv_bfloat16, 64, Src>(a, stream);
    else
      launch_scores<__half, 64, Src>(a, stream);
  } else if (a.block_size == 128) {
    if (bf16)
      launch_scores<__nv_bfloat16, 128, Src>(a, stream);
    else
      launch_scores<__half, 128, Src>(a, stream);
  } else {
    throw Error("BlockPrefillIndexer: the CUDA block scores run 64- or 128-token blocks");
  }
}

}  // namespace

void block_scores_cuda(const BlockScoresArgs& a, void* stream) {
  if (a.head_dim != kDim) throw Error("BlockPrefillIndexer: the CUDA block scores run at head_dim 128");
  if (a.keys.row_stride % 8 != 0 || a.keys.seq_stride % 8 != 0 || reinterpret_cast<uintptr_t>(a.keys.data) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.q_index) % 16 != 0) {
    throw Error("BlockPrefillIndexer: index_keys (base and strides) and q_index must be 16-byte aligned on CUDA");
  }
  launch_scores<KeySource::kRows>(a, static_cast<cudaStream_t>(stream));
}

void block_scores_paged_cuda(const PagedScoresArgs& a, void* stream) {
  // The pool's alignment and strides were checked by paged_index_keys_problem.
  if (a.head_dim != kDim) throw Error("BlockPrefillIndexer: the CUDA block scores run at head_dim 128");
  if (a.paged.pool == nullptr || reinterpret_cast<uintptr_t>(a.q_index) % 16 != 0) {
    throw Error("BlockPrefillIndexer: paged keys need their pool, and q_index 16-byte aligned on CUDA");
  }
  auto s = static_cast<cudaStream_t>(stream);
  if (a.fp8) {
    launch_scores<KeySource::kPagedFp8>(a, s);
  } else {
    launch_scores<KeySource::kPaged>(a, s);
  }
}

void block_select_cuda(const BlockSelectArgs& a, void* stream) {
  const int64_t lists =
      int64_t{a.chunk.batch} * ((a.chunk.num_tokens + a.block_size - 1) / a.block_size) * a.num_kv_heads;
  if (lists == 0) return;
  auto kernel = a.refuse_nan ? block_select_kernel<true> : block_select_kernel<false>;
  kernel<<<static_cast<unsigned>(lists), kSelectThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

void static_blocks_cuda(const StaticBlocksArgs& a, void* stream) {
  const int64_t total =
      int64_t{a.chunk.batch} * a.num_qo_heads * ((a.chunk.num_tokens + a.block_size - 1) / a.block_size) * a.width;
  if (total == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 132 * 16));
  static_blocks_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(a);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace sparsepage::detail
