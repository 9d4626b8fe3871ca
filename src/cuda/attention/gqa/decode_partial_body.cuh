// Device body of the partial kernel; included by decode_partial.cuh.
//
// Pipeline (S = kStages, one cp.async group per iteration):
//   prologue   Q tile and the page ids of tiles 0 .. 2S-3, waited at once;
//              then rows of tiles 0 .. S-2, one group each.
//   iteration t: wait for tile t; issue rows of tile t+S-1 (its ids arrived
//              S-1 groups earlier) and ids of tile t+2S-2; compute tile t.
// So ids run S-1 tiles ahead of rows, rows S-1 tiles ahead of the math, and
// one __syncthreads per tile guards both rings.
#pragma once

namespace sparsepage {
namespace cuda {

template <typename T, int DK, int DV, class Source, class Config = TileConfig<DK, DV, Source::kHasBias>>
struct PartialCta {
  using Cfg = Config;  // the multi-token CTA (decode_partial_multi.cuh) brings its own stages
  using Tr = ElemTraits<T>;
  using Elem = T;
  static constexpr int kKChunks = DK / 8;  // 16-byte chunks per K tile row
  static constexpr int kVChunks = DV / 8;
  static constexpr int kS = Cfg::kStages;

  using Params = typename Source::Params;
  const Params& p;
  Source src;
  T* stages;     // kS x [64 x DK K rows, 64 x DV V rows], swizzled
  T* q_tile;     // [16 x DK], swizzled, rows >= heads zero
  int32_t* ids;  // kIdSlots x kIdSlotInts
  const T* k_base;
  const T* v_base;
  const T* e_base;
  int tid, warp, lane;
  int32_t request, tok_begin, len, partial, head0, heads;
  int tile_rows;             // query rows per CTA: kQueryTile, or kMultiRows for the multi-token CTA
  bool bad = false;          // this thread met a page id outside the pool
  uint32_t skip_stages = 0;  // bit s: the tile in stage s holds padding (-1) rows of this warp's 16

  // Per-warp online-softmax state for query rows lane/4 and lane/4 + 8.
  float m[2], l[2];
  float acc[DV / 8][4];
  uint32_t qf[Cfg::kQInRegs ? DK / 16 : 1][4];

  __device__ explicit PartialCta(const Params& params, unsigned char* smem, int rows_per_cta = kQueryTile)
      : p(params), tile_rows(rows_per_cta) {
    stages = reinterpret_cast<T*>(smem);
    q_tile = stages + kS * Cfg::kStageElems;
    ids = reinterpret_cast<int32_t*>(q_tile + tile_rows * DK);
    tid = threadIdx.x;
    warp = tid / 32;
    lane = tid % 32;
    // Query-row tiles of one item are adjacent in the grid (tile fastest),
    // so the CTAs that read the same rows run together and share them in L2.
    const int32_t rows = p.group_size * p.q_len;
    const int32_t tiles = (rows + tile_rows - 1) / tile_rows;
    const int32_t item = static_cast<int32_t>(blockIdx.x) / tiles;
    const ItemShare<T> share = open_item<T>(p, item, src);
    request = share.request;
    tok_begin = share.tok_begin;
    len = share.len;
    partial = share.partial;
    head0 = (static_cast<int32_t>(blockIdx.x) - item * tiles) * tile_rows;
    heads = min(tile_rows, rows - head0);
    k_base = share.k_base;
    v_base = share.v_base;
    e_base = share.e_base;
  }

  __device__ T* k_tile(int stage) const { return stages + stage * Cfg::kStageElems; }
  __device__ T* v_tile(int stage) const { return p.v_aliases_k ? k_tile(stage) : k_tile(stage) + kTileRows * DK; }
  __device__ int v_pitch() const { return p.v_aliases_k ? kKChunks : kVChunks; }
  __device__ int32_t* id_slot(int tile) const { return ids + (tile % Cfg::kIdSlots) * kIdSlotInts; }
  __device__ int32_t tile_tokens(int tile) const { return min(kTileRows, len - tile * kTileRows); }

  /// Q (and q_extra as its trailing columns) for this CTA's heads.
  __device__ void load_q() {
    const int dq_chunks = p.dqk / 8;
    // This CTA's first head in q and q_extra (one division per CTA, not per chunk).
    const T* q0 = static_cast<const T*>(p.q) + head_offset(p, p.q_seq, p.q_head, request, head0);
    const T* e0 =
        p.q_extra ? static_cast<const T*>(p.q_extra) + head_offset(p, p.qe_seq, p.qe_head, request, head0) : nullptr;
    for (int idx = tid; idx < tile_rows * kKChunks; idx += kThreads) {
      const int row = idx / kKChunks, c = idx % kKChunks;
      T* dst = q_tile + Cfg::tile_offset(row, c, kKChunks);
      if (row >= heads) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        continue;
      }
      const T* g = c < dq_chunks ? q0 + row * p.q_head + c * 8 : e0 + row * p.qe_head + (c - dq_chunks) * 8;
      if (p.q_len > 1) {  // rows of several tokens: each row finds its own token
        g = c < dq_chunks
                ? static_cast<const T*>(p.q) + query_row_offset(p, p.q_seq, p.q_tok, p.q_head, request, head0 + row) +
                      c * 8
                : static_cast<const T*>(p.q_extra) +
                      query_row_offset(p, p.qe_seq, p.qe_tok, p.qe_head, request, head0 + row) + (c - dq_chunks) * 8;
      }
      cp_async_16(smem_u32(dst), g, true);
    }
  }

  __device__ void prefetch_ids(int tile) {
    src.prefetch(id_slot(tile), tok_begin + tile * kTileRows, tile_tokens(tile), tid);
  }

  /// Starts the copies of tile `tile`'s K (+ extra) and V rows. Warp w
  /// copies its own 16 rows (the ones it computes on): lane l < 16 resolves
  /// row l once (page-table lookup, 64-bit row address), and the warp then
  /// sweeps the rows' 16-byte chunks with the row pointers passed by
  /// shuffle, so consecutive lanes read consecutive chunks of one row
  /// (coalesced) and the per-chunk work is a shuffle and a copy. Returns the
  /// row lane l < 16 resolved (kRejectedRow for the other lanes and for tail
  /// rows), which the multi-token CTA compares with the causal limits.
  __device__ int64_t issue_tile(int tile) {
    constexpr int kRows = kTileRows / kWarps;
    static_assert(kRows <= 32 && (kRows * kKChunks) % 32 == 0 && (kRows * kVChunks) % 32 == 0, "warp sweep");
    const int32_t tok0 = tok_begin + tile * kTileRows;
    const int row0 = warp * kRows;
    // Rejected and tail rows copy 0 bytes (zero-fill) from a valid address.
    const T* k_row = k_base;
    const T* e_row = e_base;
    const T* v_row = v_base;
    int fill = 0;
    bool masked = false;
    int64_t resolved = kRejectedRow;
    if (lane < kRows && row0 + lane < tile_tokens(tile)) {
      const int64_t r = src.row(id_slot(tile), tok0, tok0 + row0 + lane, p);
      resolved = r;
      bad |= r == kRejectedRow;  // a masked row (kMaskedRow) is just not read
      masked = r == kMaskedRow;
      if (r >= 0) {
        fill = 16;
        k_row += r * p.k_stride;
        v_row += r * p.v_stride;
        if (e_base != nullptr) e_row += r * p.e_stride;
      }
    }
    if constexpr (Source::kMaySkip) {
      // Whether this warp's rows of the tile hold padding, so that softmax_pv
      // looks the ids up only for such tiles (a uniform bit per stage; never
      // set without the padding mode, which then costs nothing).
      if (src.skip_minus_one) {
        const uint32_t bit = 1u << (tile % kS);
        skip_stages = __any_sync(0xffffffffu, masked) ? skip_stages | bit : skip_stages & ~bit;
      }
    }
    T* kt = k_tile(tile % kS);
    const int dq_chunks = p.dqk / 8;
    // A gathered row is read by one head tile per launch (by several only
    // past 16 query rows per KV head, whose CTAs run side by side): evict it
    // first (on the H200 at 16 query rows: faster at batch 32-64, level at
    // batch 1; the 2026-12-01 GQA kernel notebook).
    const uint64_t policy = l2_evict_first_policy();
    // Shuffles stay out of divergent code (which would make them collective
    // calls): the second-stream case is its own uniform loop.
    if (e_base == nullptr) {
#pragma unroll
      for (int i = 0; i < kRows * kKChunks / 32; ++i) {
        const int idx = i * 32 + lane;
        const int lr = idx / kKChunks, c = idx % kKChunks;
        const int n = __shfl_sync(0xffffffffu, fill, lr);
        cp_async_16_n_policy(smem_u32(kt + Cfg::tile_offset(row0 + lr, c, kKChunks)), shfl_ptr(k_row, lr) + c * 8, n,
                             policy);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kRows * kKChunks / 32; ++i) {
        const int idx = i * 32 + lane;
        const int lr = idx / kKChunks, c = idx % kKChunks;
        const int n = __shfl_sync(0xffffffffu, fill, lr);
        const T* gk = shfl_ptr(k_row, lr) + c * 8;
        const T* ge = shfl_ptr(e_row, lr) + (c - dq_chunks) * 8;
        cp_async_16_n_policy(smem_u32(kt + Cfg::tile_offset(row0 + lr, c, kKChunks)), c < dq_chunks ? gk : ge, n,
                             policy);
      }
    }
    if (p.v_aliases_k) return resolved;
    T* vt = kt + kTileRows * DK;
    const int dv_chunks = p.dv / 8;
#pragma unroll
    for (int i = 0; i < kRows * kVChunks / 32; ++i) {
      const int idx = i * 32 + lane;
      const int lr = idx / kVChunks, c = idx % kVChunks;
      const int n = __shfl_sync(0xffffffffu, fill, lr);
      const T* g = shfl_ptr(v_row, lr) + c * 8;
      if (c < dv_chunks) cp_async_16_n_policy(smem_u32(vt + Cfg::tile_offset(row0 + lr, c, kVChunks)), g, n, policy);
    }
    return resolved;
  }

  __device__ static const T* shfl_ptr(const T* ptr, int src_lane) {
    return reinterpret_cast<const T*>(__shfl_sync(0xffffffffu, reinterpret_cast<long long>(ptr), src_lane));
  }

  __device__ void q_fragment(int kk, uint32_t (&a)[4]) const {
    if constexpr (Cfg::kQInRegs) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = qf[kk][i];
    } else {
      ldmatrix_x4(a, smem_u32(q_tile + swizzle(lane & 15, 2 * kk + (lane >> 4), kKChunks)));
    }
  }

  /// S = Q K^T for this warp's 16 rows of the tile: s[j] covers rows 8j..8j+7.
  __device__ void scores(int stage, float (&s)[2][4]) const {
    const T* kt = k_tile(stage);
    const int key = warp * 16 + (lane & 7) + ((lane >> 4) << 3);
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      uint32_t a[4], b[4];
      q_fragment(kk, a);
      ldmatrix_x4(b, smem_u32(kt + swizzle(key, 2 * kk + ((lane >> 3) & 1), kKChunks)));
      mma_16816<T>(s[0], a, b[0], b[1]);
      mma_16816<T>(s[1], a, b[2], b[3]);
    }
  }

  /// A multi-token step: query row i (token i / group_size) sees positions
  /// below live_len - (q_len - 1 - token); later positions leave its
  /// softmax. The row is loaded once for every token; only the scores differ.
  __device__ void causal_limit(const int32_t* slot, int32_t tok0, int32_t n, float (&s)[2][4]) const {
    int64_t limit[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int32_t row = head0 + (lane >> 2) + 8 * i;
      limit[i] = src.live_len() - (p.q_len - 1 - row / p.group_size);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = warp * 16 + 8 * j + 2 * (lane & 3) + c;
        if (key >= n) continue;  // already -inf
        const int64_t pos = src.position(slot, tok0, tok0 + key);
        if (pos >= limit[0]) s[j][c] = neg_inf_f32();
        if (pos >= limit[1]) s[j][c + 2] = neg_inf_f32();
      }
    }
  }

  /// Online softmax over this warp's 16 rows, then acc += P V.
  __device__ void softmax_pv(int tile, float (&s)[2][4]) {
    const int32_t n = tile_tokens(tile);
    const int32_t* slot = id_slot(tile);
    const int32_t tok0 = tok_begin + tile * kTileRows;
    float tile_max[2] = {neg_inf_f32(), neg_inf_f32()};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = warp * 16 + 8 * j + 2 * (lane & 3) + (e & 1);
        float x = s[j][e] * p.scale_log2;
        if constexpr (Source::kHasBias) {
          // A masked-out position is excluded whatever its score (an inf or
          // NaN score plus -inf would otherwise poison the row).
          const float b = src.bias(slot, key);
          x = b == neg_inf_f32() ? b : x + b * kLog2e;
        }
        if (key >= n) x = neg_inf_f32();
        s[j][e] = x;
      }
    }
    if constexpr (!Source::kHasBias) {
      if (p.q_len > 1) causal_limit(slot, tok0, n, s);
    }
    if constexpr (Source::kMaySkip) {
      if ((skip_stages >> (tile % kS)) & 1u) {  // padding ids: their rows were not read and weigh nothing
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = warp * 16 + 8 * j + 2 * (lane & 3) + (e & 1);
            if (key < n && src.skipped(slot, tok0, tok0 + key)) s[j][e] = neg_inf_f32();
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[j][e]);
    }
    // Lazy rescaling (online_softmax_rebase): after the first tiles the max
    // rarely moves by more than 2^8, so most tiles skip the DV/2 multiplies
    // of the rescale.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
    }
    float alpha[2], base[2];
    const bool rescale = online_softmax_rebase(tile_max, m, l, alpha, base);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2_ftz(s[j][e] - base[e >> 1]);
        l[e >> 1] += s[j][e];
      }
    }
    // The two n8 score tiles are exactly the A fragment of a k16 MMA.
    const uint32_t a[4] = {Tr::pack2(s[0][0], s[0][1]), Tr::pack2(s[0][2], s[0][3]), Tr::pack2(s[1][0], s[1][1]),
                           Tr::pack2(s[1][2], s[1][3])};
    if (rescale) {
#pragma unroll
      for (int nt = 0; nt < DV / 8; ++nt) {
        acc[nt][0] *= alpha[0], acc[nt][1] *= alpha[0], acc[nt][2] *= alpha[1], acc[nt][3] *= alpha[1];
      }
    }
    // P.V over the tile's full DV columns, branch-free so the MMAs issue back
    // to back. With a V narrower than DV the extra columns of the V tile were
    // zeroed once (zero_v_tail) and their accumulators are never stored.
    const T* vt = v_tile(tile % kS);
    const int pitch = v_pitch();
    pv_k16(a, vt, warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), pitch);
  }

  /// acc += P V over one k16 step: `a` the P fragment of this warp's 16
  /// query rows against 16 gathered rows, whose V rows in the tile vt
  /// (row pitch `pitch` chunks) this lane's ldmatrix address starts at vrow.
  __device__ __forceinline__ void pv_k16(const uint32_t (&a)[4], const T* vt, int vrow, int pitch) {
#pragma unroll
    for (int nn = 0; nn < DV / 16; ++nn) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, smem_u32(vt + swizzle(vrow, 2 * nn + (lane >> 4), pitch)));
      mma_16816<T>(acc[2 * nn], a, b[0], b[1]);
      mma_16816<T>(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }

  /// A separate V narrower than the tile leaves columns dv .. DV of every V
  /// stage unwritten by the copies; zero them once so P.V reads zeros there.
  __device__ void zero_v_tail() {
    if (p.v_aliases_k || p.dv == DV) return;
    const int first = p.dv / 8;
    for (int idx = tid; idx < kS * kTileRows * kVChunks; idx += kThreads) {
      const int stage = idx / (kTileRows * kVChunks), rest = idx % (kTileRows * kVChunks);
      const int row = rest / kVChunks, c = rest % kVChunks;
      if (c < first) continue;
      T* vt = k_tile(stage) + kTileRows * DK;
      *reinterpret_cast<uint4*>(vt + swizzle(row, c, kVChunks)) = make_uint4(0, 0, 0, 0);
    }
  }

  __device__ void run() {
    gather_and_reduce();
    finish();
  }

  /// The pipeline over this CTA's tokens: leaves each warp's softmax state
  /// (m, l, acc) and every copy complete, so the stages are free. This is
  /// pipeline() below written out: through the call ptxas schedules these
  /// kernels differently (compared in SASS), and that code was never timed.
  __device__ void gather_and_reduce() {
    m[0] = m[1] = neg_inf_f32();
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < DV / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    const int num_tiles = (len + kTileRows - 1) / kTileRows;
    zero_v_tail();  // ordered before the first use by the prologue's barrier
    load_q();
    for (int t = 0; t < 2 * kS - 2 && t < num_tiles; ++t) prefetch_ids(t);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (Cfg::kQInRegs) {
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk)
        ldmatrix_x4(qf[kk], smem_u32(q_tile + swizzle(lane & 15, 2 * kk + (lane >> 4), kKChunks)));
    }
#pragma unroll
    for (int t = 0; t < kS - 1; ++t) {
      if (t < num_tiles) issue_tile(t);
      cp_async_commit();
    }
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<kS - 2>();
      __syncthreads();  // tile t landed; stage (t-1) % kS and its id slot are free
      if (t + kS - 1 < num_tiles) issue_tile(t + kS - 1);
      if (t + 2 * kS - 2 < num_tiles) prefetch_ids(t + 2 * kS - 2);
      cp_async_commit();
      float s[2][4] = {};
      scores(t % kS, s);
      softmax_pv(t, s);
    }
    cp_async_wait<0>();
  }

  /// The pipeline of the CTAs built on this one (the FP8 and 64-row CTAs):
  /// the softmax state cleared, Q and the first ids, `q_landed()`
  /// once Q is in shared memory, then per tile `tile_math(t)` on the tile in
  /// stage t % kS, with `issue(t)` starting tile t's row copies (each CTA
  /// copies its own way). With kAsyncProxy the landed copies are fenced for
  /// the tensor cores' async-proxy reads (wgmma) before the barrier that
  /// publishes them.
  template <bool kAsyncProxy, class QLanded, class Issue, class TileMath>
  __device__ __forceinline__ void pipeline(QLanded&& q_landed, Issue&& issue, TileMath&& tile_math) {
    m[0] = m[1] = neg_inf_f32();
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < DV / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    const int num_tiles = (len + kTileRows - 1) / kTileRows;
    load_q();
    for (int t = 0; t < 2 * kS - 2 && t < num_tiles; ++t) prefetch_ids(t);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    q_landed();
#pragma unroll
    for (int t = 0; t < kS - 1; ++t) {
      if (t < num_tiles) issue(t);
      cp_async_commit();
    }
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<kS - 2>();
      if constexpr (kAsyncProxy) wgmma::fence_proxy_async();
      __syncthreads();  // tile t landed; stage (t-1) % kS and its id slot are free
      if (t + kS - 1 < num_tiles) issue(t + kS - 1);
      if (t + 2 * kS - 2 < num_tiles) prefetch_ids(t + 2 * kS - 2);
      cp_async_commit();
      tile_math(t);
    }
    cp_async_wait<0>();
  }

  /// Merges the four warps' states and writes o/lse or the partial slot.
  __device__ void finish() {
    __shared__ float row_base[kQueryTile], row_sum[kQueryTile];
    const bool any_bad = reduce_warps(row_base, row_sum);
    write_output(reinterpret_cast<const float*>(stages), row_base, row_sum, any_bad);
  }

  /// The four warps' states as one: per query row, the base (largest score,
  /// log2 domain; 0 for a row that saw nothing) and the sum of exp2(score -
  /// base) in row_base / row_sum, and each warp's accumulators scaled to that
  /// base in the reduction area over the stages ([kWarps][16][kReducePitch]
  /// floats; their sum over the warps is the row's unnormalized output).
  /// Returns whether any thread met a rejected page; ends with a barrier.
  __device__ bool reduce_warps(float* row_base, float* row_sum) {
    __shared__ float warp_m[kWarps][kQueryTile], warp_l[kWarps][kQueryTile];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    if ((lane & 3) == 0) {
      warp_m[warp][lane >> 2] = m[0], warp_m[warp][(lane >> 2) + 8] = m[1];
      warp_l[warp][lane >> 2] = l[0], warp_l[warp][(lane >> 2) + 8] = l[1];
    }
    const bool any_bad = __syncthreads_or(bad);     // also: stages are free for the reduction
    float* red = reinterpret_cast<float*>(stages);  // [kWarps][16][kReducePitch]
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = (lane >> 2) + 8 * i;
      float mx = warp_m[0][row];
      for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, warp_m[w][row]);
      const float f = exp2f(m[i] - (mx == neg_inf_f32() ? 0.f : mx));  // 0 for a warp that saw nothing
      float* dst = red + (warp * kQueryTile + row) * Cfg::kReducePitch + 2 * (lane & 3);
#pragma unroll
      for (int nt = 0; nt < DV / 8; ++nt) {
        if (nt * 8 >= p.dv) break;
        *reinterpret_cast<float2*>(dst + nt * 8) = make_float2(acc[nt][2 * i] * f, acc[nt][2 * i + 1] * f);
      }
    }
    if (tid < kQueryTile) {
      float mx = warp_m[0][tid];
      for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, warp_m[w][tid]);
      const float b = mx == neg_inf_f32() ? 0.f : mx;
      float sum = 0.f;
      for (int w = 0; w < kWarps; ++w) sum += warp_l[w][tid] * exp2f(warp_m[w][tid] - b);
      row_base[tid] = b;
      row_sum[tid] = sum;
    }
    __syncthreads();
    return any_bad;
  }

  __device__ void write_output(const float* red, const float* row_base, const float* row_sum, bool any_bad) {
    const int d4 = p.dv / 4;
    T* o0 = static_cast<T*>(p.o) + head_offset(p, p.o_seq, p.o_head, request, head0);  // this CTA's first head
    for (int idx = tid; idx < heads * d4; idx += kThreads) {
      const int row = idx / d4, col = (idx % d4) * 4;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(red + (w * kQueryTile + row) * Cfg::kReducePitch + col);
        o.x += x.x, o.y += x.y, o.z += x.z, o.w += x.w;
      }
      // Nothing seen (empty chunk or fully masked): o = 0. A rejected page: NaN.
      // A NaN sum means NaN inputs (query or rows): the row is poisoned, never
      // mistaken for an empty one.
      const float inv = row_sum[row] > 0.f ? 1.f / row_sum[row] : 0.f;
      o = any_bad || isnan(row_sum[row]) ? make_float4(nan_f32(), nan_f32(), nan_f32(), nan_f32())
                                         : make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
      const int64_t head = int64_t{head0} + row;
      if (partial < 0) {
        T* dst = p.q_len > 1 ? static_cast<T*>(p.o) +
                                   query_row_offset(p, p.o_seq, p.o_tok, p.o_head, request, head0 + row) + col
                             : o0 + row * p.o_head + col;
        *reinterpret_cast<uint2*>(dst) = make_uint2(Tr::pack2(o.x, o.y), Tr::pack2(o.z, o.w));
      } else {
        *reinterpret_cast<float4*>(p.partial_o + (int64_t{partial} * p.group_size * p.q_len + head) * p.partial_dv +
                                   col) = o;
      }
    }
    if (tid < heads) {
      const float s = row_sum[tid];
      const float lse = any_bad || isnan(s) ? nan_f32() : s > 0.f ? (row_base[tid] + log2f(s)) * kLn2 : neg_inf_f32();
      const int64_t head = int64_t{head0} + tid;
      if (partial < 0) {
        if (p.lse) p.lse[lse_row(p, request, head0 + tid)] = lse;
      } else {
        p.partial_lse[int64_t{partial} * p.group_size * p.q_len + head] = lse;
      }
    }
    if (any_bad && tid == 0) report_rejected(p, request);
  }
};

template <typename T, int DK, int DV, class Source>
__global__ void __launch_bounds__(kThreads, TileConfig<DK, DV, Source::kHasBias>::kMinBlocks)
    partial_kernel(const __grid_constant__ typename Source::Params params) {
  extern __shared__ __align__(128) unsigned char smem[];
  // Inputs may come from the previous kernel in the stream: wait for it
  // before the first global read. Then the next kernel (the merge kernel, or
  // whatever follows a merge in place) may be scheduled; it waits for this
  // grid in turn.
  pdl_wait_primary();
  pdl_launch_dependents();
  PartialCta<T, DK, DV, Source> cta(params, smem);
  cta.run();
}

}  // namespace cuda
}  // namespace sparsepage
