// The block-sparse indexer on the GPU (rule in include/sparsepage/models/
// block_sparse.h). Two launches on the caller's stream, sized from the host
// bound max_kv_len; the live length of each sequence is read on the device,
// so one captured graph serves a growing context:
//   1. block_score_kernel: one CTA per (scored block, sequence) reads the
//      block's index-key rows once (16-byte loads; from an engine's paged
//      pool through its block table, bf16 rows or FP8 blocks) and max-pools
//      q_idx . k_idx for every KV head's index query at once on tensor cores
//      (fp32 accumulation), writing fp32 scores to the workspace;
//   2. block_topk_kernel: one CTA per request ranks its scores by a radix
//      select over (score, block id) composites (ties to the lower block id)
//      and writes the kept ids, the final block and the covered token count.
// Nothing here allocates, synchronizes or reads back.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "core/cuda_hooks.h"
#include "core/require.h"
#include "cuda/indexers/paged_keys.cuh"
#include "cuda/primitives/common.cuh"
#include "cuda/primitives/radix_select.cuh"
#include "models/block_sparse_kernels.h"

#define REQUIRE(ok, ...) SPARSEPAGE_REQUIRE(ok, "block_indexer_cuda: ", __VA_ARGS__)

namespace sparsepage {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / 32;
// Scores are tensor-core products (mma.sync m16n8k16, fp32 accumulation):
// 16 tokens x 8 heads (the KV heads' index queries, zero-padded) per warp
// step over the head dim in 32-dim segments. A warp's step is read with
// 16-byte loads (4 lanes x 16 bytes per 64-byte row segment, 8 rows per
// instruction) straight into the A fragments, so no shared memory is touched:
// the k order inside a segment is permuted, identically for the keys and the
// queries, which a dot product does not notice (see load_fragment_order).
constexpr int kStepTokens = 16;
constexpr int kMaxSegments = 4;
constexpr int kMaxHeadDim = 32 * kMaxSegments;
constexpr int kMaxKvHeads = 8;
// A multi-token step scores every (token, KV head) index query: columns
// t * heads + h of the B operand, in up to kMaxTokenTiles n8 tiles.
constexpr int kMaxTokenTiles = 4;
constexpr int kMaxColumns = 8 * kMaxTokenTiles;
constexpr int kTopkThreads = 256;
// Requests with up to this many scored blocks (2M tokens at 128) rank from
// shared memory; longer ones re-read their scores from global memory.
constexpr int kSmemItems = 4096;

using detail::KeyRow;
using detail::KeySource;
using detail::PagedKeys;

struct ScoreParams {
  const void* keys;        // kRows: sequence b's index key rows at keys + b * key_seq_stride, dim apart
  int64_t key_seq_stride;  // elements
  PagedKeys paged;         // kPaged*
  const void* index_q;     // [batch, q_len, heads, dim]
  const int32_t* kv_lens;  // [batch], device
  int32_t heads, dim, block_size, local_blocks;
  int32_t q_len;       // query tokens per sequence: a block scores the max over all of them
  int32_t max_scored;  // score row pitch: blocks scored at max_kv_len
  int64_t dense_len;   // sequences of at most this many tokens keep every block: nothing to score
  float* scores;       // [batch * heads, max_scored]: NaN for every head of a block whose keys were refused
  int64_t max_kv_len;  // a kv_lens entry outside [0, max_kv_len] is not scored
};

struct TopkParams {
  const float* scores;     // [batch * heads, max_scored]
  const int32_t* kv_lens;  // [batch], device
  int32_t heads, block_size, topk, width, max_scored;
  int64_t dense_len;      // sequences of at most this many tokens keep every block
  int32_t* block_ids;     // [batch * heads, width]
  int32_t* seq_lens;      // [batch * heads]
  int64_t max_kv_len;     // a kv_lens entry outside [0, max_kv_len]: no blocks, seq_lens -1
  int64_t max_table_len;  // paged keys: longer sequences are refused too (else INT64_MAX)
  int32_t* error;         // may be null: IndexKeyError bits of refused sequences
};

// Fragment order. Lane (g, c) = (lane / 4, lane % 4) reads physical dims
// 32 s + 8 c .. + 7 of its rows as one uint4 {x, y, z, w}. For k-tile 2 s it
// passes x as a0/b0 (logical k 2c, 2c + 1) and y as a2/b1 (k 2c + 8, 2c + 9);
// for k-tile 2 s + 1, z and w. Over the four lanes of a group every physical
// dim of the segment meets its own query element exactly once.
template <typename T>
__device__ __forceinline__ void mma_segment(float (&acc)[4], const uint4& row_g, const uint4& row_g8, const uint4& q) {
  const uint32_t a0[4] = {row_g.x, row_g8.x, row_g.y, row_g8.y};
  const uint32_t a1[4] = {row_g.z, row_g8.z, row_g.w, row_g8.w};
  cuda::mma_16816<T>(acc, a0, q.x, q.y);
  cuda::mma_16816<T>(acc, a1, q.z, q.w);
}

// Block blockIdx.x of sequence blockIdx.y: max over its tokens of q_h . k_t
// for every head h (and, in a multi-token step, every query token: NT n8
// tiles of (token, head) columns). fmaxf drops a NaN dot as the CPU rule's
// std::max does. NT = 1 is the one-token step.
template <typename T, int NT, KeySource Src>
__global__ void __launch_bounds__(kScoreThreads, 3) block_score_kernel(const __grid_constant__ ScoreParams p) {
  static_assert(NT == 1 || Src == KeySource::kRows, "paged keys serve one-token steps");
  __shared__ float best_s[kScoreWarps][8 * NT];
  // NT > 1: every (token, head) query staged once per CTA (copied while the
  // keys load), rows padded by 16 bytes so the 8 rows g of a fragment load
  // fall in different banks.
  constexpr int kQPitch = kMaxHeadDim / 8 + 1;  // uint4 per staged query row
  __shared__ uint4 q_s[NT > 1 ? kMaxColumns * kQPitch : 1];
  // Launched as a programmatic dependent of the step's append: wait for its
  // rows and length, then let the top-k grid be scheduled.
  cuda::pdl_wait_primary();
  cuda::pdl_launch_dependents();
  const int b = blockIdx.y, j = blockIdx.x;
  const int64_t len = p.kv_lens[b];
  if (len < 0 || len > p.max_kv_len) return;                     // out of range: the top-k kernel poisons the sequence
  if (Src != KeySource::kRows && len > p.paged.max_len) return;  // past its table row: likewise
  const int64_t num_blocks = (len + p.block_size - 1) / p.block_size;
  // Past the scored blocks of this sequence, or a sequence that keeps them all.
  if (j >= num_blocks - 1 || len <= p.dense_len) return;
  float* out = p.scores + int64_t{b} * p.heads * p.max_scored + j;
  // Local force-keep, and in a multi-token step the block of the first new
  // token too (the new tokens may straddle a block boundary): no need to
  // read the keys. For q_len = 1 the second bound is the final block.
  int64_t forced = num_blocks - p.local_blocks;
  if constexpr (NT > 1) forced = min(forced, max(len - p.q_len, int64_t{0}) / p.block_size);
  if (j >= forced) {
    for (int h = threadIdx.x; h < p.heads; h += kScoreThreads)
      out[int64_t{h} * p.max_scored] = __int_as_float(0x7f800000);
    return;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int segments = p.dim / 32;
  const int rows = static_cast<int>(min(int64_t{p.block_size}, len - int64_t{j} * p.block_size));
  // Row `row` of the block: the layer's rows, or the engine's through its
  // table (a block id outside the pool is never read: it refuses the block).
  bool refused = false;
  const auto key_row = [&](int row) -> KeyRow {
    if (row >= rows) return {nullptr, 0.0f};
    if constexpr (Src == KeySource::kRows) {
      const T* keys = static_cast<const T*>(p.keys) + int64_t{b} * p.key_seq_stride + int64_t{j} * p.block_size * p.dim;
      return {reinterpret_cast<const unsigned char*>(keys + int64_t{row} * p.dim), 1.0f};
    } else {
      return detail::paged_key_row<Src>(p.paged, p.paged.table + int64_t{b} * p.paged.table_stride,
                                        int64_t{j} * p.block_size + row, refused);
    }
  };
  // Segment s of a row as T fragments: the layer's rows as they are, the
  // engine's through the paged-key loader (FP8: 8 e4m3 values widened to T,
  // exact, their scale applied to the products).
  const auto load = [&](const KeyRow& r, int s) -> uint4 {
    if constexpr (Src == KeySource::kRows) {
      if (r.ptr == nullptr) return make_uint4(0, 0, 0, 0);
      return __ldg(reinterpret_cast<const uint4*>(r.ptr + (s * 32 + c * 8) * int(sizeof(T))));
    } else {
      return detail::key_piece<T, Src>(r, s * 32 + c * 8);
    }
  };
  int t0 = warp * kStepTokens;
  KeyRow rg = key_row(t0 + g), rg8 = key_row(t0 + g + 8);
  uint4 kg[kMaxSegments], kg8[kMaxSegments];
#pragma unroll
  for (int s = 0; s < kMaxSegments; ++s) {
    kg[s] = s < segments ? load(rg, s) : make_uint4(0, 0, 0, 0);
    kg8[s] = s < segments ? load(rg8, s) : make_uint4(0, 0, 0, 0);
  }
  // Query of column (token, head) = (col / heads, col % heads) as B column
  // g of its n8 tile; columns past the last are zero and never read out.
  const int columns = p.heads * p.q_len;
  const T* qb = static_cast<const T*>(p.index_q) + int64_t{b} * columns * p.dim;
  uint4 q[kMaxSegments];
  const auto load_q = [&](int col) {
#pragma unroll
    for (int s = 0; s < kMaxSegments; ++s) {
      if constexpr (NT == 1) {
        q[s] = s < segments && col < columns
                   ? *reinterpret_cast<const uint4*>(qb + int64_t{col} * p.dim + s * 32 + c * 8)
                   : make_uint4(0, 0, 0, 0);
      } else {
        q[s] = s < segments && col < columns ? q_s[col * kQPitch + s * 4 + c] : make_uint4(0, 0, 0, 0);
      }
    }
  };
  if constexpr (NT == 1) {
    load_q(g);  // one tile: the queries stay in registers
  } else {
    const int pieces = p.dim / 8;
    for (int i = threadIdx.x; i < columns * pieces; i += kScoreThreads) {
      q_s[(i / pieces) * kQPitch + i % pieces] = *reinterpret_cast<const uint4*>(qb + int64_t{i} * 8);
    }
    __syncthreads();
  }
  float best[NT][2];  // columns 8 nt + 2c, 8 nt + 2c + 1
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) best[nt][0] = best[nt][1] = cuda::neg_inf_f32();
  // Warp-uniform loop over this warp's 16-token steps (one for 128-token blocks).
  for (; t0 < rows; t0 += kScoreWarps * kStepTokens) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt * 8 >= columns) break;
      // Several tiles: each tile's queries are read from shared memory
      // rather than held, which would cost 16 registers per tile.
      if constexpr (NT > 1) load_q(nt * 8 + g);
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < kMaxSegments; ++s) {
        if (s < segments) mma_segment<T>(acc, kg[s], kg8[s], q[s]);
      }
      if constexpr (Src == KeySource::kPagedFp8) {  // each key's scale: rows g and g + 8
        acc[0] *= rg.scale;
        acc[1] *= rg.scale;
        acc[2] *= rg8.scale;
        acc[3] *= rg8.scale;
      }
      if (t0 + g < rows) {
        best[nt][0] = fmaxf(best[nt][0], acc[0]);
        best[nt][1] = fmaxf(best[nt][1], acc[1]);
      }
      if (t0 + g + 8 < rows) {
        best[nt][0] = fmaxf(best[nt][0], acc[2]);
        best[nt][1] = fmaxf(best[nt][1], acc[3]);
      }
    }
    const int next = t0 + kScoreWarps * kStepTokens;
    if (next < rows) {
      rg = key_row(next + g);
      rg8 = key_row(next + g + 8);
#pragma unroll
      for (int s = 0; s < kMaxSegments; ++s) {
        if (s < segments) {
          kg[s] = load(rg, s);
          kg8[s] = load(rg8, s);
        }
      }
    }
  }
  // Max over the eight token rows g: lanes 0 .. 3 then hold columns 2c, 2c + 1.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      for (int off = 4; off < 32; off *= 2)
        best[nt][e] = fmaxf(best[nt][e], __shfl_xor_sync(0xffffffffu, best[nt][e], off));
      const int col = 8 * nt + 2 * c + e;
      if (g == 0 && col < columns) best_s[warp][col] = best[nt][e];
    }
  }
  // A key row in a block outside the pool: the block scores NaN for every
  // head, which no real score is (fmaxf drops NaN dots), and the top-k
  // kernel refuses the sequence.
  if (__syncthreads_or(refused ? 1 : 0) != 0) {
    if (threadIdx.x < p.heads) out[int64_t{threadIdx.x} * p.max_scored] = __int_as_float(0x7fffffff);
    return;
  }
  if (threadIdx.x < p.heads) {  // max over the warps (and the query tokens)
    float m = best_s[0][threadIdx.x];
    if constexpr (NT == 1) {
      for (int w = 1; w < kScoreWarps; ++w) m = fmaxf(m, best_s[w][threadIdx.x]);
    } else {
      for (int w = 0; w < kScoreWarps; ++w) {
        for (int col = threadIdx.x; col < columns; col += p.heads) m = fmaxf(m, best_s[w][col]);
      }
    }
    out[int64_t{threadIdx.x} * p.max_scored] = m;
  }
}

// Composite of block `id` with score `s`: larger ranks first (radix_select.cuh).
__device__ __forceinline__ uint64_t block_composite(float s, int32_t id, int id_bits) {
  return (static_cast<uint64_t>(cuda::score_key(s)) << id_bits) | ((uint64_t{1} << id_bits) - 1 - id);
}

__global__ void __launch_bounds__(kTopkThreads) block_topk_kernel(const __grid_constant__ TopkParams p) {
  using Select = cuda::RadixSelect<kTopkThreads>;
  using Scan = cub::BlockScan<int32_t, kTopkThreads>;
  __shared__ uint64_t items[kSmemItems];
  __shared__ typename Select::Storage select_storage;
  __shared__ typename Scan::TempStorage scan_storage;
  const int r = blockIdx.x, b = r / p.heads;
  const int64_t len = p.kv_lens[b];  // written before the score kernel started: safe before the wait
  cuda::pdl_launch_dependents();     // a PDL-launched consumer (the attention) may start its prologue
  cuda::pdl_wait_primary();          // the score kernel's writes are complete and visible
  int32_t* out = p.block_ids + int64_t{r} * p.width;
  // A refused request selects nothing, and the count -1 makes the decode
  // poison it and flag it (kDecodeErrorLength); the mask path sees the same
  // length. `bit` also goes to the indexer's error word.
  const auto refuse = [&](int32_t bit) {
    for (int32_t i = threadIdx.x; i < p.width; i += kTopkThreads) out[i] = -1;
    if (threadIdx.x == 0) {
      p.seq_lens[r] = -1;
      if (p.error != nullptr) atomicOr(p.error, bit);
    }
  };
  if (len < 0 || len > p.max_kv_len || len > p.max_table_len) {
    // A length outside the bound the scores were sized for would read past
    // this request's score row and write before its id row.
    refuse(kIndexErrorLength);
    return;
  }
  // A free slot or an empty sequence (len <= 0) keeps nothing.
  const int32_t num_blocks = len > 0 ? static_cast<int32_t>((len + p.block_size - 1) / p.block_size) : 0;
  const int32_t scored = max(num_blocks - 1, 0);
  // A sequence in its dense regime keeps every block (it fits the width).
  const int32_t keep = len <= p.dense_len ? scored : min(p.topk, scored);
  if (num_blocks == 0 || keep == scored) {  // every scored block, in order: no ranking needed
    for (int32_t i = threadIdx.x; i < p.width; i += kTopkThreads) out[i] = i < num_blocks ? i : -1;
    if (threadIdx.x == 0) p.seq_lens[r] = static_cast<int32_t>(max(len, int64_t{0}));
    return;
  }
  const float* s = p.scores + int64_t{r} * p.max_scored;
  const int id_bits = cuda::position_bits(p.max_scored);

  cuda::RadixCut cut;
  const bool in_smem = scored <= kSmemItems;
  // A NaN score marks a block whose keys lay outside the engine's pool.
  int nan_seen = 0;
  if (in_smem) {
    for (int32_t i = threadIdx.x; i < scored; i += kTopkThreads) {
      const float v = s[i];
      nan_seen |= isnan(v) ? 1 : 0;
      items[i] = block_composite(v, i, id_bits);
    }
  } else {
    for (int32_t i = threadIdx.x; i < scored; i += kTopkThreads) nan_seen |= isnan(s[i]) ? 1 : 0;
  }
  if (__syncthreads_or(nan_seen) != 0) {  // also the barrier after the items
    refuse(kIndexErrorBlock);
    return;
  }
  if (in_smem) {
    cut = Select::run([&](int32_t i) { return items[i]; }, scored, keep, 32 + id_bits, select_storage);
  } else {
    cut = Select::run([&](int32_t i) { return block_composite(s[i], i, id_bits); }, scored, keep, 32 + id_bits,
                      select_storage);
  }
  // The kept ids in increasing order: one block scan per round of kTopkThreads ids.
  int32_t base = 0;
  for (int32_t i0 = 0; i0 < scored; i0 += kTopkThreads) {
    const int32_t i = i0 + threadIdx.x;
    int32_t kept = 0;
    if (i < scored) kept = cut.keeps(in_smem ? items[i] : block_composite(s[i], i, id_bits)) ? 1 : 0;
    int32_t slot, total;
    Scan(scan_storage).ExclusiveSum(kept, slot, total);
    if (kept != 0) out[base + slot] = i;
    base += total;
    __syncthreads();  // scan_storage is reused next round
  }
  if (threadIdx.x == 0) {
    out[keep] = num_blocks - 1;
    p.seq_lens[r] = keep * p.block_size + static_cast<int32_t>(len - int64_t{num_blocks - 1} * p.block_size);
  }
  for (int32_t i = keep + 1 + threadIdx.x; i < p.width; i += kTopkThreads) out[i] = -1;
}

__global__ void block_mask_kernel(const int32_t* block_ids, int32_t heads, int32_t width, int32_t block_size,
                                  const int32_t* kv_lens, int64_t pitch, int64_t total, float* mask) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / pitch, t = i % pitch;
    const int32_t block = static_cast<int32_t>(t / block_size);
    bool kept = false;
    if (t < kv_lens[r / heads]) {
      for (int32_t k = 0; k < width; ++k) kept |= block_ids[r * width + k] == block;
    }
    mask[i] = kept ? 0.0f : cuda::neg_inf_f32();
  }
}

int grid_for(int64_t total) { return static_cast<int>(std::min<int64_t>((total + 255) / 256, 132 * 16)); }

int32_t max_scored_blocks(int64_t max_kv_len, int32_t block_size) {
  return static_cast<int32_t>(std::max<int64_t>((max_kv_len + block_size - 1) / block_size - 1, 1));
}

}  // namespace

namespace detail {

size_t block_indexer_workspace_bytes(int32_t batch, int32_t num_kv_heads, int64_t max_kv_len, int32_t block_size) {
  if (batch < 1 || num_kv_heads < 1 || max_kv_len < 1 || block_size < 1) {
    throw Error("block_indexer_workspace_bytes: batch, num_kv_heads, max_kv_len and block_size must be >= 1");
  }
  return sizeof(float) * static_cast<size_t>(batch) * static_cast<size_t>(num_kv_heads) *
         static_cast<size_t>(max_scored_blocks(max_kv_len, block_size));
}

void block_indexer_cuda(const BlockIndexerArgs& a, void* stream) {
  REQUIRE(a.dtype == DType::kBF16 || a.dtype == DType::kF16,
          std::string("dtype must be f16 or bf16, got ") + dtype_name(a.dtype));
  const bool paged = a.paged.pool != nullptr;
  REQUIRE((a.k_alloc != nullptr || a.index_keys != nullptr || paged) && a.index_q != nullptr && a.kv_lens != nullptr &&
              a.block_ids != nullptr && a.seq_lens != nullptr && a.workspace != nullptr,
          "k_alloc (or index_keys, or paged), index_q, kv_lens, block_ids, seq_lens and workspace must be set");
  REQUIRE(a.batch >= 1 && a.batch <= 65535, "batch = " + std::to_string(a.batch) + " must lie in [1, 65535]");
  REQUIRE(a.num_kv_heads >= 1 && a.num_kv_heads <= kMaxKvHeads,
          "num_kv_heads = " + std::to_string(a.num_kv_heads) + " must lie in [1, " + std::to_string(kMaxKvHeads) + "]");
  REQUIRE(a.head_dim >= 32 && a.head_dim % 32 == 0 && a.head_dim <= kMaxHeadDim,
          "head_dim = " + std::to_string(a.head_dim) + " must be a multiple of 32 in [32, " +
              std::to_string(kMaxHeadDim) + "] (tensor-core k-tiles read in 32-dim segments)");
  ScoreParams sp{};
  KeySource source = KeySource::kRows;
  int64_t max_table_len = INT64_MAX;
  if (paged) {
    const std::string problem = paged_index_keys_problem(a.paged, a.head_dim);
    REQUIRE(problem.empty(), "paged: " + problem);
    REQUIRE(a.paged.format == IndexKeyFormat::kE4m3 || a.paged.dtype == a.dtype,
            std::string("paged: native keys are ") + dtype_name(a.paged.dtype) + ", the index queries " +
                dtype_name(a.dtype));
    REQUIRE(a.q_len == 1, "paged keys serve one-token steps; q_len = " + std::to_string(a.q_len));
    source = a.paged.format == IndexKeyFormat::kE4m3 ? KeySource::kPagedFp8 : KeySource::kPaged;
    max_table_len = int64_t{a.paged.max_blocks} * a.paged.block_size;
    sp.paged = detail::paged_keys_view(a.paged, a.head_dim);
  } else {
    // The index keys: their own key-only cache, or head num_kv_heads of the K allocation.
    const bool own_keys = a.index_keys != nullptr;
    sp.keys = own_keys ? a.index_keys
                       : static_cast<const char*>(a.k_alloc) + int64_t{a.num_kv_heads} * a.capacity * a.head_dim *
                                                                   static_cast<int64_t>(dtype_size(a.dtype));
    sp.key_seq_stride = own_keys ? a.key_seq_stride : int64_t{a.num_kv_heads + 1} * a.capacity * a.head_dim;
    REQUIRE(reinterpret_cast<uintptr_t>(sp.keys) % 16 == 0,
            "the index keys (k_alloc or index_keys) must be 16-byte aligned");
    REQUIRE(sp.key_seq_stride >= a.capacity * a.head_dim && sp.key_seq_stride % 8 == 0,
            "key_seq_stride = " + std::to_string(sp.key_seq_stride) + " must hold capacity * head_dim = " +
                std::to_string(a.capacity * a.head_dim) + " elements and be a multiple of 8 (16-byte rows)");
  }
  REQUIRE(a.block_size >= 1, "block_size = " + std::to_string(a.block_size) + " must be >= 1");
  REQUIRE(a.topk >= 1, "topk = " + std::to_string(a.topk) + " must be >= 1");
  REQUIRE(a.local_blocks >= 1 && a.local_blocks - 1 <= a.topk,
          "local_blocks = " + std::to_string(a.local_blocks) + " must lie in [1, topk + 1]");
  REQUIRE(a.width >= a.topk + 1, "width = " + std::to_string(a.width) + " must be >= topk + 1");
  REQUIRE(a.max_kv_len >= 1 && a.max_kv_len <= a.capacity,
          "max_kv_len = " + std::to_string(a.max_kv_len) + " must lie in [1, capacity = " + std::to_string(a.capacity) +
              "]");
  REQUIRE(a.max_kv_len / a.block_size < (int64_t{1} << 30),
          "max_kv_len / block_size = " + std::to_string(a.max_kv_len / a.block_size) + " blocks is too many");
  const size_t need = block_indexer_workspace_bytes(a.batch, a.num_kv_heads, a.max_kv_len, a.block_size);
  REQUIRE(a.workspace_bytes >= need, "workspace_bytes = " + std::to_string(a.workspace_bytes) + " is below the " +
                                         std::to_string(need) + " block_indexer_workspace_bytes asks for");
  auto s = static_cast<cudaStream_t>(stream);
  REQUIRE(a.q_len >= 1 && int64_t{a.q_len} * a.num_kv_heads <= kMaxColumns,
          "q_len = " + std::to_string(a.q_len) + " must be >= 1 with q_len * num_kv_heads <= " +
              std::to_string(kMaxColumns) + " (the (token, head) index queries of a multi-token step)");
  REQUIRE(a.dense_len <= 0 || (a.dense_len + a.block_size - 1) / a.block_size <= a.width,
          "dense_len = " + std::to_string(a.dense_len) + " keeps up to " +
              std::to_string((a.dense_len + a.block_size - 1) / a.block_size) +
              " blocks, more than width = " + std::to_string(a.width));
  sp.index_q = a.index_q;
  sp.kv_lens = a.kv_lens;
  sp.heads = a.num_kv_heads;
  sp.dim = a.head_dim;
  sp.block_size = a.block_size;
  sp.local_blocks = a.local_blocks;
  sp.q_len = a.q_len;
  sp.max_scored = max_scored_blocks(a.max_kv_len, a.block_size);
  sp.dense_len = a.dense_len;
  sp.scores = static_cast<float*>(a.workspace);
  sp.max_kv_len = a.max_kv_len;
  const dim3 grid(static_cast<unsigned>(sp.max_scored), static_cast<unsigned>(a.batch));
  const dim3 threads(kScoreThreads);
  const bool bf16 = a.dtype == DType::kBF16;
  if (source == KeySource::kPagedFp8) {
    if (bf16)
      cuda::launch_with_pdl(block_score_kernel<__nv_bfloat16, 1, KeySource::kPagedFp8>, grid, threads, 0, s, sp);
    else
      cuda::launch_with_pdl(block_score_kernel<__half, 1, KeySource::kPagedFp8>, grid, threads, 0, s, sp);
  } else if (source == KeySource::kPaged) {
    if (bf16)
      cuda::launch_with_pdl(block_score_kernel<__nv_bfloat16, 1, KeySource::kPaged>, grid, threads, 0, s, sp);
    else
      cuda::launch_with_pdl(block_score_kernel<__half, 1, KeySource::kPaged>, grid, threads, 0, s, sp);
  } else if (a.q_len == 1) {
    if (bf16)
      cuda::launch_with_pdl(block_score_kernel<__nv_bfloat16, 1, KeySource::kRows>, grid, threads, 0, s, sp);
    else
      cuda::launch_with_pdl(block_score_kernel<__half, 1, KeySource::kRows>, grid, threads, 0, s, sp);
  } else {
    if (bf16)
      cuda::launch_with_pdl(block_score_kernel<__nv_bfloat16, kMaxTokenTiles, KeySource::kRows>, grid, threads, 0, s,
                            sp);
    else
      cuda::launch_with_pdl(block_score_kernel<__half, kMaxTokenTiles, KeySource::kRows>, grid, threads, 0, s, sp);
  }
  const TopkParams tp{static_cast<const float*>(a.workspace),
                      a.kv_lens,
                      a.num_kv_heads,
                      a.block_size,
                      a.topk,
                      a.width,
                      sp.max_scored,
                      a.dense_len,
                      a.block_ids,
                      a.seq_lens,
                      a.max_kv_len,
                      max_table_len,
                      a.error};
  // Programmatic dependent launch: the top-k grid is scheduled while the
  // score grid drains, and waits for its writes inside the kernel.
  cuda::launch_with_pdl(block_topk_kernel, dim3(static_cast<unsigned>(a.batch * a.num_kv_heads)), dim3(kTopkThreads), 0,
                        s, tp);
}

void block_mask_cuda(const int32_t* block_ids, int32_t batch, int32_t num_kv_heads, int32_t width, int32_t block_size,
                     const int32_t* kv_lens, int64_t max_kv_len, float* mask, void* stream) {
  const int64_t total = int64_t{batch} * num_kv_heads * max_kv_len;
  if (total == 0) return;
  block_mask_kernel<<<grid_for(total), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      block_ids, num_kv_heads, width, block_size, kv_lens, max_kv_len, total, mask);
  SP_CUDA_CHECK_LAUNCH();
}

}  // namespace detail
}  // namespace sparsepage

#undef REQUIRE
