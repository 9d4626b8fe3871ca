// The sparse prefill's CPU twins (core/prefill_kernels.h): the same rules as
// the CUDA kernels, written as plain loops over host arrays. With the fused
// decode's CPU backend they make the CPU prefill, the oracle the GPU tests
// compare with.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/prefill_kernels.h"
#include "cpu/dot.h"
#include "cpu/paged_keys.h"
#include "cpu/parallel.h"
#include "models/static_block_pattern.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/types.h"

namespace sparsepage::detail {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

int64_t length_of(const PrefillChunk& c, int32_t b) { return c.kv_lens ? c.kv_lens[b] : c.kv_len; }

/// Positions [0, count) of sequence b's keys in an engine's paged pool, as
/// floats (FP8: the e4m3 value times the key's scale, as the block decode
/// indexer's twin reads them). A block id outside the pool is refused by
/// name before any key is read.
void paged_keys_cpu(const PagedIndexKeys& k, size_t d, int32_t b, int64_t count, float* out) {
  const int32_t* table = k.block_table + int64_t{b} * k.block_table_stride;
  const int64_t blocks = (count + k.block_size - 1) / k.block_size;
  for (int64_t e = 0; e < blocks; ++e) {
    if (table[e] < 0 || table[e] >= k.num_blocks) {
      throw Error("BlockPrefillIndexer: sequence " + std::to_string(b) + "'s key-table entry " + std::to_string(e) +
                  " = " + std::to_string(table[e]) + " is outside the index-key pool [0, " +
                  std::to_string(k.num_blocks) + ")");
    }
  }
  const auto dim = static_cast<int32_t>(d);
  const int64_t token_bytes = index_key_token_bytes(k, dim), block_bytes = index_key_block_bytes(k, dim);
  for (int64_t t = 0; t < count; ++t)
    cpu::paged_key_row(k, block_bytes, token_bytes, d, table, t, out + t * int64_t(d));
}

/// (score descending, then id ascending), NaN ranking with -inf: the order
/// the GPU's composite keys give (cuda/primitives/radix_select.cuh).
bool ranks_before(float sx, int64_t x, float sy, int64_t y) {
  if (std::isnan(sx)) sx = -kInf;
  if (std::isnan(sy)) sy = -kInf;
  return sx > sy || (sx == sy && x < y);
}

}  // namespace

void token_windows_cpu(const TokenWindowsArgs& a) {
  for (int32_t b = 0; b < a.chunk.batch; ++b) {
    const int64_t len = length_of(a.chunk, b);
    for (int32_t t = 0; t < a.chunk.num_tokens; ++t) {
      a.windows[int64_t{b} * a.chunk.num_tokens + t] = !a.causal ? static_cast<int32_t>(len)
                                                       : len < a.chunk.num_tokens
                                                           ? 0
                                                           : static_cast<int32_t>(len - a.chunk.num_tokens + t + 1);
    }
  }
}

void block_windows_cpu(const BlockWindowsArgs& a) {
  const int32_t blocks = (a.chunk.num_tokens + a.block_size - 1) / a.block_size;
  for (int32_t b = 0; b < a.chunk.batch; ++b) {
    const int64_t len = length_of(a.chunk, b);
    const int64_t start = len - a.chunk.num_tokens;
    const bool bad = start < 0 || start % a.block_size != 0;
    if (bad && a.bad_chunk != nullptr) *a.bad_chunk = 1;
    for (int32_t i = 0; i < blocks; ++i) {
      a.windows[int64_t{b} * blocks + i] =
          bad ? 0 : static_cast<int32_t>(start + std::min<int64_t>(int64_t{i + 1} * a.block_size, a.chunk.num_tokens));
    }
  }
}

void mla_epilogue_cpu(const MlaEpilogueArgs& a) {
  const int64_t rows = int64_t{a.batch} * a.num_tokens * a.num_heads;
  const size_t esize = dtype_size(a.dtype);
  std::vector<float> row(static_cast<size_t>(a.dim));
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t h = static_cast<int32_t>(r % a.num_heads);
    const int64_t t = (r / a.num_heads) % a.num_tokens, b = r / (int64_t{a.num_heads} * a.num_tokens);
    const float lse = a.lse_in[r];
    if (a.sink != nullptr) {
      // exp(lse) / (exp(lse) + exp(sink)); nothing attended: 0 whatever the sink.
      const float factor = lse == -kInf ? 0.0f : 1.0f / (1.0f + std::exp(a.sink[h] - lse));
      char* o = static_cast<char*>(a.out) +
                (b * a.out_seq + t * a.out_token + int64_t{h} * a.out_head) * static_cast<int64_t>(esize);
      to_float(a.dtype, o, row.data(), row.size());
      for (float& x : row) x *= factor;
      from_float(a.dtype, row.data(), o, row.size());
    }
    if (a.lse_out != nullptr) a.lse_out[r] = lse == -kInf ? kInf : lse;
  }
}

void lse_gather_cpu(const LseGatherArgs& a) {
  for (int32_t b = 0; b < a.batch; ++b) {
    for (int32_t kv = 0; kv < a.num_kv_heads; ++kv) {
      for (int32_t t = 0; t < a.num_tokens; ++t) {
        for (int32_t g = 0; g < a.group_size; ++g) {
          a.lse[(int64_t{b} * a.num_tokens + t) * a.num_kv_heads * a.group_size + int64_t{kv} * a.group_size + g] =
              a.staged[((int64_t{b} * a.num_kv_heads + kv) * a.num_tokens + t) * a.group_size + g];
        }
      }
    }
  }
}

void scale_expand_cpu(const ScaleExpandArgs& a) {
  const int64_t per_stream = int64_t{a.num_kv_heads} * a.group_size;
  for (int64_t i = 0; i < per_stream; ++i) {
    a.expanded[i] = a.k_scale[i / a.group_size];
    a.expanded[per_stream + i] = a.v_scale[i / a.group_size];
  }
}

void mla_max_logits_cpu(const MlaPrefillParams& p, const int32_t* windows) {
  const int32_t n = p.chunk.num_tokens, heads = p.num_heads;
  const size_t esize = dtype_size(p.dtype);
  const bool fp8 = p.kv_format == KvFormat::kE4m3Mla;
  const size_t kv_size = fp8 ? 1 : esize;
  const int64_t token_stride = p.index_token_stride > 0 ? p.index_token_stride : p.topk;
  const int64_t seq_stride = p.index_seq_stride > 0 ? p.index_seq_stride : int64_t{n} * token_stride;
  const auto strides = [&](const QueryStrides& s, int32_t dim) {
    if (p.qo_layout == QueryLayout::kStrided) return s;
    return QueryStrides{int64_t{n} * heads * dim, dim, int64_t{heads} * dim};
  };
  const QueryStrides qs = strides(p.q_strides, 512), rs = strides(p.q_rope_strides, 64);
  const size_t latent = static_cast<size_t>(p.kv.dim), rope = static_cast<size_t>(p.kv_rope.dim);  // 512, 64
  cpu::parallel_for(int64_t{p.chunk.batch} * n, [&](int64_t row) {
    const int64_t b = row / n, t = row % n;
    const int32_t* ids = p.indices + b * seq_stride + t * token_stride;
    const int32_t count = p.topk_length ? std::min(p.topk, p.topk_length[row]) : p.topk;
    std::vector<float> q(latent), qr(rope), k(latent), kr(rope), best(static_cast<size_t>(heads), -kInf);
    for (int32_t i = 0; i < count; ++i) {
      const int32_t pos = ids[i];
      if (pos == -1) continue;
      if (pos < 0 || pos >= windows[row]) {  // the decode refused it before this runs
        throw Error("MlaSparsePrefill: index " + std::to_string(pos) + " is outside token " + std::to_string(row) +
                    "'s window");
      }
      // The pool row of the position: through the engine's table (row b;
      // the decode checked every entry it reaches), else the sequence's own.
      const BlockTable& table = p.block_table;
      const int64_t at = table.data == nullptr
                             ? pos
                             : int64_t{table.data[b * table.row_stride + pos / table.block_size]} * table.block_size +
                                   pos % table.block_size;
      const int64_t seq = table.data == nullptr ? b : 0;  // a pool's views have no sequence stride
      const auto* k_row = static_cast<const uint8_t*>(p.kv.data) +
                          (seq * p.kv.seq_stride + at * p.kv.row_stride) * static_cast<int64_t>(kv_size);
      if (fp8) {
        float scales[4];
        std::memcpy(scales, k_row + 512, sizeof(scales));
        for (int d = 0; d < 512; ++d) k[static_cast<size_t>(d)] = e4m3_to_float(k_row[d]) * scales[d / 128];
      } else {
        to_float(p.dtype, k_row, k.data(), 512);
      }
      to_float(p.dtype,
               static_cast<const char*>(p.kv_rope.data) +
                   (seq * p.kv_rope.seq_stride + at * p.kv_rope.row_stride) * static_cast<int64_t>(esize),
               kr.data(), 64);
      for (int32_t h = 0; h < heads; ++h) {
        to_float(p.dtype,
                 static_cast<const char*>(p.q) +
                     (b * qs.seq_stride + t * qs.token_stride + h * qs.head_stride) * static_cast<int64_t>(esize),
                 q.data(), 512);
        to_float(p.dtype,
                 static_cast<const char*>(p.q_rope) +
                     (b * rs.seq_stride + t * rs.token_stride + h * rs.head_stride) * static_cast<int64_t>(esize),
                 qr.data(), 64);
        const float s = (cpu::dot(q.data(), k.data(), latent) + cpu::dot(qr.data(), kr.data(), rope)) * p.scale;
        float& m = best[static_cast<size_t>(h)];
        m = std::isnan(s) || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN() : std::max(m, s);
      }
    }
    for (int32_t h = 0; h < heads; ++h) p.max_logits[row * heads + h] = best[static_cast<size_t>(h)];
  });
}

void dsa_prefill_indexer_cpu(const DsaPrefillIndexerParams& p, const std::vector<int64_t>& lens) {
  const int32_t n = p.chunk.num_tokens;
  const size_t d = static_cast<size_t>(p.index_head_dim), heads = static_cast<size_t>(p.index_heads);
  const size_t esize = dtype_size(p.dtype);
  DsaConfig rule;
  rule.index_heads = p.index_heads;
  rule.index_head_dim = p.index_head_dim;
  rule.index_topk = p.topk;
  if (p.key_layout == IndexKeyLayout::kPaged) {
    // The decode indexer's twin reads the engine's keys (native or FP8)
    // through the table, each token of the chunk against its own causal
    // window: passes of up to kMaxQueryTokens tokens of one sequence, as
    // the CUDA indexer's passes, each a multi-token row set whose window
    // ends at its last token.
    for (int32_t b = 0; b < p.chunk.batch; ++b) {
      for (int32_t t0 = 0; t0 < n; t0 += kMaxQueryTokens) {
        const int32_t rows = std::min(kMaxQueryTokens, n - t0);
        const auto end = static_cast<int32_t>(lens[static_cast<size_t>(b)] - n + t0 + rows);
        const int64_t first = int64_t{b} * n + t0;  // the pass's first (sequence, token) row
        DsaIndexerArgs a;
        a.dtype = p.dtype;
        a.key_layout = IndexKeyLayout::kPaged;
        a.paged = p.paged;
        a.paged.block_table = p.paged.block_table + int64_t{b} * p.paged.block_table_stride;
        a.kv_lens = &end;
        a.max_kv_len = p.chunk.kv_len;
        a.q_index = static_cast<const char*>(p.q_index) + first * static_cast<int64_t>(heads * d * esize);
        a.weights = p.weights + first * static_cast<int64_t>(heads);
        a.positions = p.positions + first * p.topk;
        a.counts = p.counts + first;
        a.q_len = rows;
        a.error = p.error;
        dsa_select_tokens_cpu(rule, 1, a);
      }
    }
    return;
  }
  const int64_t row_elems = int64_t{p.key_column} + p.index_head_dim;
  for (int32_t b = 0; b < p.chunk.batch; ++b) {
    const int64_t len = lens[static_cast<size_t>(b)];
    std::vector<float> keys(static_cast<size_t>(len) * d);  // the sequence's keys, once
    for (int64_t pos = 0; pos < len; ++pos) {
      to_float(p.dtype,
               static_cast<const char*>(p.k_cache) +
                   ((int64_t{b} * p.capacity + pos) * row_elems + p.key_column) * static_cast<int64_t>(esize),
               &keys[static_cast<size_t>(pos) * d], d);
    }
    cpu::parallel_for(n, [&](int64_t t) {
      const int64_t row = int64_t{b} * n + t;
      const int64_t window = len - n + t + 1;  // positions 0 .. pos
      std::vector<int32_t> kept;
      if (window <= p.topk) {
        kept.resize(static_cast<size_t>(window));
        std::iota(kept.begin(), kept.end(), 0);
      } else {
        std::vector<float> q(heads * d);
        to_float(p.dtype, static_cast<const char*>(p.q_index) + row * static_cast<int64_t>(heads * d * esize), q.data(),
                 q.size());
        const std::vector<float> prefix(keys.begin(), keys.begin() + window * static_cast<int64_t>(d));
        kept =
            dsa_select_tokens_cpu(rule, 1, window, q.data(), p.weights + row * static_cast<int64_t>(heads), prefix)[0];
        std::sort(kept.begin(), kept.end());
      }
      int32_t* out = p.positions + row * p.topk;
      for (int32_t i = 0; i < p.topk; ++i)
        out[i] = i < static_cast<int32_t>(kept.size()) ? kept[static_cast<size_t>(i)] : -1;
      p.counts[row] = static_cast<int32_t>(kept.size());
    });
  }
}

void block_scores_cpu(const BlockScoresArgs& a, const PagedIndexKeys* paged) {
  const int32_t n = a.chunk.num_tokens, bs = a.block_size, heads = a.num_kv_heads;
  const int32_t blocks = (n + bs - 1) / bs;
  const size_t d = static_cast<size_t>(a.head_dim), esize = dtype_size(a.dtype);
  for (int32_t b = 0; b < a.chunk.batch; ++b) {
    const int64_t len = length_of(a.chunk, b), start = len - n;
    std::vector<float> keys(static_cast<size_t>(len) * d);
    if (paged != nullptr) {
      // The keys the scores read: those of blocks below the query blocks' forced ones.
      const int64_t scored_end = std::max<int64_t>(0, (start / bs + blocks - a.local_blocks)) * bs;
      paged_keys_cpu(*paged, d, b, std::min(len, scored_end), keys.data());
    } else {
      for (int64_t pos = 0; pos < len; ++pos) {
        to_float(a.dtype,
                 static_cast<const char*>(a.keys.data) + a.keys.offset(b, 0, pos) * static_cast<int64_t>(esize),
                 &keys[static_cast<size_t>(pos) * d], d);
      }
    }
    std::vector<float> q(static_cast<size_t>(n) * heads * d);
    to_float(a.dtype, static_cast<const char*>(a.q_index) + int64_t{b} * n * heads * static_cast<int64_t>(d * esize),
             q.data(), q.size());
    cpu::parallel_for(int64_t{blocks} * heads, [&](int64_t item) {
      const int32_t i = static_cast<int32_t>(item / heads), h = static_cast<int32_t>(item % heads);
      const int64_t query_block = start / bs + i;
      const int64_t scored = query_block + 1 - a.local_blocks;  // blocks below the forced ones
      float* out = a.scores + ((int64_t{b} * blocks + i) * heads + h) * a.key_blocks;
      for (int64_t j = 0; j < scored; ++j) {
        float best = -kInf;  // NaN products are ignored, as fmaxf does
        for (int32_t t = i * bs; t < std::min(n, (i + 1) * bs); ++t) {
          const float* qt = &q[(static_cast<size_t>(t) * heads + static_cast<size_t>(h)) * d];
          for (int64_t pos = j * bs; pos < (j + 1) * bs; ++pos) {
            const float s = cpu::dot(qt, &keys[static_cast<size_t>(pos) * d], d);
            if (s > best) best = s;
          }
        }
        out[j] = best;
      }
    });
  }
}

void block_select_cpu(const BlockSelectArgs& a) {
  const int32_t n = a.chunk.num_tokens, bs = a.block_size, heads = a.num_kv_heads;
  const int32_t blocks = (n + bs - 1) / bs, width = a.top_blocks + 1;
  for (int32_t b = 0; b < a.chunk.batch; ++b) {
    const int64_t len = length_of(a.chunk, b), start = len - n;
    for (int32_t i = 0; i < blocks; ++i) {
      const int64_t query_block = start / bs + i;
      const int64_t end = start + std::min<int64_t>(int64_t{i + 1} * bs, n);  // the query block's window end
      for (int32_t h = 0; h < heads; ++h) {
        const int64_t list = (int64_t{b} * blocks + i) * heads + h;
        const float* s = a.scores + list * a.key_blocks;
        const auto score = [&](int64_t j) { return j >= query_block + 1 - a.local_blocks ? kInf : s[j]; };
        std::vector<int64_t> order(static_cast<size_t>(query_block));
        std::iota(order.begin(), order.end(), 0);
        const int64_t keep = std::min<int64_t>(a.top_blocks, query_block);
        std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                          [&](int64_t x, int64_t y) { return ranks_before(score(x), x, score(y), y); });
        std::sort(order.begin(), order.begin() + keep);
        int32_t* ids = a.block_ids + list * width;
        for (int32_t e = 0; e < width; ++e) {
          ids[e] = e < keep    ? static_cast<int32_t>(order[static_cast<size_t>(e)])
                   : e == keep ? static_cast<int32_t>(query_block)
                               : -1;
        }
        a.counts[list] = static_cast<int32_t>(keep * bs + (end - query_block * bs));
      }
    }
  }
}

void static_blocks_cpu(const StaticBlocksArgs& a) {
  const int32_t n = a.chunk.num_tokens, bs = a.block_size, blocks = (n + bs - 1) / bs;
  const int32_t g = a.num_qo_heads / a.num_kv_heads;
  const StaticPattern pattern{bs, a.local_blocks, a.vert_stride, a.head_sliding_step};
  for (int32_t b = 0; b < a.chunk.batch; ++b) {
    const int64_t start = length_of(a.chunk, b) - n;
    for (int32_t kv = 0; kv < a.num_kv_heads; ++kv) {
      for (int32_t i = 0; i < blocks; ++i) {
        const int64_t end = start + std::min<int64_t>(int64_t{i + 1} * bs, n);
        for (int32_t gg = 0; gg < g; ++gg) {
          const int32_t h = kv * g + gg;
          const int64_t list = ((int64_t{b} * a.num_kv_heads + kv) * blocks + i) * g + gg;
          const StaticKeptBlocks kept = static_kept_blocks(pattern, h, end);
          int32_t* ids = a.block_ids + list * a.width;
          for (int32_t e = 0; e < a.width; ++e) ids[e] = e < kept.count() ? static_cast<int32_t>(kept.at(e)) : -1;
          a.counts[list] = static_cast<int32_t>(static_kept_tokens(pattern, h, end));
        }
      }
    }
  }
}

}  // namespace sparsepage::detail
