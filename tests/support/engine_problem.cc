#include "support/engine_problem.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "support/reference.h"

namespace sparsepage::testing {
namespace {

constexpr int32_t kNeverRead = 0x7fffffff;  // table entries no visible token may reach

void write_values(std::vector<uint8_t>& buf, DType dtype, int64_t offset, int32_t count, std::mt19937_64& rng) {
  const auto values = random_values(dtype, static_cast<size_t>(count), rng);
  std::copy(values.begin(), values.end(),
            buf.begin() + static_cast<std::ptrdiff_t>(offset * int64_t(dtype_size(dtype))));
}

std::vector<float> read_values(const std::vector<uint8_t>& buf, DType dtype, int64_t offset, int32_t count) {
  const size_t esize = dtype_size(dtype);
  std::vector<float> out(static_cast<size_t>(count));
  to_float(dtype, buf.data() + static_cast<size_t>(offset) * esize, out.data(), out.size());
  return out;
}

int64_t head_at(const EngineProblem& pb, const QueryStrides& s, int32_t r, int32_t g) {
  const int32_t b = r / pb.spec.num_kv_heads, h = r % pb.spec.num_kv_heads;
  return int64_t{b} * s.seq_stride + (int64_t{h} * pb.spec.group_size + g) * s.head_stride;
}

}  // namespace

EngineProblem make_engine_problem(const EngineSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  EngineProblem pb;
  pb.spec = spec;
  const int32_t S = spec.num_seqs, Hkv = spec.num_kv_heads, G = spec.group_size, R = pb.num_requests();
  const int32_t Hq = Hkv * G;
  pb.dim_qk = spec.mla ? 512 : spec.head_dim;
  pb.dim_v = spec.mla ? 512 : spec.head_dim;
  pb.dim_extra = spec.mla ? 64 : 0;
  pb.scale = 1.0f / std::sqrt(static_cast<float>(pb.dim_qk + pb.dim_extra));
  const int32_t bs = spec.block_size;
  std::uniform_int_distribution<int32_t> any_block(0, spec.num_blocks - 1);
  std::bernoulli_distribution pad(spec.pad_fraction);
  pb.slots.assign(static_cast<size_t>(R), {});

  // A row of distinct random blocks.
  auto block_row = [&](int32_t n) {
    std::vector<int32_t> all(static_cast<size_t>(spec.num_blocks));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(static_cast<size_t>(n));
    return all;
  };

  if (spec.index == EngineIndex::kSlotIds) {
    pb.width = spec.topk;
    const int32_t rows = spec.per_head_indices ? R : S;
    std::uniform_int_distribution<int32_t> any_slot(0, static_cast<int32_t>(pb.pool_slots() - 1));
    for (int32_t i = 0; i < rows * spec.topk; ++i) pb.indices.push_back(pad(rng) ? -1 : any_slot(rng));
    // With padding, the last row is all padding: nothing to attend.
    if (spec.pad_fraction > 0) std::fill(pb.indices.end() - spec.topk, pb.indices.end(), -1);
  } else if (spec.index == EngineIndex::kPositions) {
    pb.width = spec.topk;
    pb.max_blocks = (spec.context + bs - 1) / bs;
    pb.table_rows = S + 2;  // more rows than sequences, visited through row_of_sequence
    for (int32_t t = 0; t < pb.table_rows; ++t) {
      const auto row = block_row(pb.max_blocks);
      pb.block_table.insert(pb.block_table.end(), row.begin(), row.end());
    }
    std::vector<int32_t> order(static_cast<size_t>(pb.table_rows));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    pb.row_of_sequence.assign(order.begin(), order.begin() + S);
    // Rows no sequence reads hold ids outside the pool: reading one would fail the test.
    for (int32_t t = 0; t < pb.table_rows; ++t) {
      if (std::find(pb.row_of_sequence.begin(), pb.row_of_sequence.end(), t) != pb.row_of_sequence.end()) continue;
      std::fill_n(pb.block_table.begin() + int64_t{t} * pb.max_blocks, pb.max_blocks, kNeverRead);
    }
    std::uniform_int_distribution<int32_t> any_pos(0, spec.context - 1);
    for (int32_t i = 0; i < S * spec.topk; ++i) pb.indices.push_back(pad(rng) ? -1 : any_pos(rng));
    if (spec.pad_fraction > 0) std::fill(pb.indices.end() - spec.topk, pb.indices.end(), -1);
  } else {
    pb.max_blocks = (spec.context + bs - 1) / bs;
    pb.width = pb.max_blocks;
    pb.page_size = bs;
    std::uniform_int_distribution<int32_t> any_len(0, spec.context);
    for (int32_t b = 0; b < S; ++b) {
      const int32_t len = b == 0 ? spec.context : b == 1 ? 0 : any_len(rng);
      pb.lens.push_back(len);
      auto row = block_row(pb.max_blocks);
      // Pages past the sequence's length are never read.
      for (int32_t i = (len + bs - 1) / bs; i < pb.max_blocks; ++i) row[static_cast<size_t>(i)] = kNeverRead;
      pb.indices.insert(pb.indices.end(), row.begin(), row.end());
    }
  }

  // Per-request counts (topk_length): some shorter, one zero.
  if (spec.lengths && spec.index != EngineIndex::kBlockPages) {
    std::uniform_int_distribution<int32_t> any_len(spec.topk / 2, spec.topk);
    for (int32_t r = 0; r < R; ++r) pb.lens.push_back(r == 1 % R ? 0 : any_len(rng));
    pb.lens[0] = spec.topk;
  }
  const int32_t bound = spec.index == EngineIndex::kBlockPages ? pb.max_blocks * bs : spec.topk;
  pb.plan_counts.assign(static_cast<size_t>(R), bound);

  // The slots each request attends (the fp64 reference's rows).
  for (int32_t r = 0; r < R; ++r) {
    const int32_t b = r / Hkv, h = r % Hkv;
    auto& out = pb.slots[static_cast<size_t>(r)];
    if (spec.index == EngineIndex::kBlockPages) {
      for (int32_t t = 0; t < pb.lens[static_cast<size_t>(b)]; ++t)
        out.push_back(int64_t{pb.indices[static_cast<size_t>(b * pb.width + t / bs)]} * bs + t % bs);
      continue;
    }
    const int64_t row = spec.index == EngineIndex::kSlotIds && spec.per_head_indices ? int64_t{b} * Hkv + h : b;
    const int32_t len = pb.lens.empty() ? spec.topk : pb.lens[static_cast<size_t>(r)];
    for (int32_t i = 0; i < len; ++i) {
      const int32_t id = pb.indices[static_cast<size_t>(row * pb.width + i)];
      if (id == -1) continue;
      if (spec.index == EngineIndex::kSlotIds) {
        out.push_back(id);
      } else {
        const int32_t table = pb.row_of_sequence[static_cast<size_t>(b)];
        out.push_back(int64_t{pb.block_table[static_cast<size_t>(table * pb.max_blocks + id / bs)]} * bs + id % bs);
      }
    }
  }

  // Pools [num_blocks, block_size, Hkv, row], NaN except the rows visible tokens reach.
  const int32_t k_width = spec.mla ? pb.dim_qk + pb.dim_extra : pb.dim_qk;
  pb.k_head_stride = k_width;
  pb.k_row_stride = int64_t{Hkv} * k_width;
  pb.k_pool = nan_values(spec.dtype, static_cast<size_t>(pb.pool_slots() * pb.k_row_stride));
  if (spec.mla) {
    pb.v_row_stride = pb.k_row_stride;
    pb.v_head_stride = pb.k_head_stride;
  } else {
    pb.v_head_stride = pb.dim_v;
    pb.v_row_stride = int64_t{Hkv} * pb.dim_v;
    pb.v_pool = nan_values(spec.dtype, static_cast<size_t>(pb.pool_slots() * pb.v_row_stride));
  }
  std::vector<bool> filled(static_cast<size_t>(pb.pool_slots() * Hkv), false);
  for (int32_t r = 0; r < R; ++r) {
    const int32_t h = r % Hkv;
    for (int64_t slot : pb.slots[static_cast<size_t>(r)]) {
      if (filled[static_cast<size_t>(slot * Hkv + h)]) continue;
      filled[static_cast<size_t>(slot * Hkv + h)] = true;
      write_values(pb.k_pool, spec.dtype, slot * pb.k_row_stride + h * pb.k_head_stride, k_width, rng);
      if (!spec.mla) write_values(pb.v_pool, spec.dtype, slot * pb.v_row_stride + h * pb.v_head_stride, pb.dim_v, rng);
    }
  }

  // q (and q_extra): packed, or slices of a wider buffer whose other columns are NaN.
  if (spec.strided_qo) {
    if (spec.mla) {  // q [S, Hq, 576]: latent then rope, one row per head
      pb.q_strides = {int64_t{Hq} * 576, 576};
      pb.q_extra_strides = pb.q_strides;
      pb.q_offset_extra = 512;
      pb.q_buf = nan_values(spec.dtype, static_cast<size_t>(S) * Hq * 576);
    } else {  // a packed QKV tensor [S, (Hq + 2 Hkv) * D]
      pb.q_strides = {int64_t{Hq + 2 * Hkv} * pb.dim_qk, pb.dim_qk};
      pb.q_buf = nan_values(spec.dtype, static_cast<size_t>(S) * (Hq + 2 * Hkv) * pb.dim_qk);
    }
    pb.o_strides = {int64_t{Hq} * (pb.dim_v + 16) + 8, pb.dim_v + 16};
    pb.o_elements = int64_t{S} * pb.o_strides.seq_stride;
  } else {
    pb.q_strides = {int64_t{Hq} * pb.dim_qk, pb.dim_qk};
    pb.q_extra_strides = {int64_t{Hq} * pb.dim_extra, pb.dim_extra};
    pb.q_offset_extra = int64_t{S} * Hq * pb.dim_qk;
    pb.q_buf = nan_values(spec.dtype, static_cast<size_t>(S) * Hq * (pb.dim_qk + pb.dim_extra));
    pb.o_strides = {int64_t{Hq} * pb.dim_v, pb.dim_v};
    pb.o_elements = int64_t{S} * Hq * pb.dim_v;
  }
  for (int32_t r = 0; r < R; ++r) {
    for (int32_t g = 0; g < G; ++g) {
      write_values(pb.q_buf, spec.dtype, head_at(pb, pb.q_strides, r, g), pb.dim_qk, rng);
      if (pb.dim_extra > 0)
        write_values(pb.q_buf, spec.dtype, pb.q_offset_extra + head_at(pb, pb.q_extra_strides, r, g), pb.dim_extra,
                     rng);
    }
  }
  return pb;
}

EngineArrays EngineProblem::host_arrays(void* o, float* lse) const {
  EngineArrays a;
  a.q = q_buf.data();
  if (dim_extra > 0) a.q_extra = q_buf.data() + q_offset_extra * int64_t(dtype_size(spec.dtype));
  a.k = k_pool.data();
  a.v = spec.mla ? k_pool.data() : v_pool.data();
  a.indices = indices.data();
  a.lens = lens.empty() ? nullptr : lens.data();
  a.block_table = block_table.empty() ? nullptr : block_table.data();
  a.row_of_sequence = row_of_sequence.empty() ? nullptr : row_of_sequence.data();
  a.o = o;
  a.lse = lse;
  return a;
}

DecodeParams EngineProblem::params(const EngineArrays& a) const {
  DecodeParams p;
  p.dtype = spec.dtype;
  p.num_requests = num_requests();
  p.num_kv_heads = spec.num_kv_heads;
  p.group_size = spec.group_size;
  p.index_layout = IndexLayout::kMatrix;
  p.indices = a.indices;
  p.num_indices = static_cast<int64_t>(indices.size());
  p.index_width = width;
  const bool per_head = spec.index == EngineIndex::kSlotIds && spec.per_head_indices;
  p.index_seq_stride = per_head ? int64_t{spec.num_kv_heads} * width : width;
  p.index_head_stride = per_head ? width : 0;
  p.seq_lens = a.lens;
  p.seq_lens_index = spec.index == EngineIndex::kBlockPages ? SeqLensIndex::kPerSequence : SeqLensIndex::kPerRequest;
  p.page_size = page_size;
  switch (spec.index) {
    case EngineIndex::kSlotIds:
      p.padding = IndexPadding::kMinusOneSkips;
      p.num_pool_pages = pool_slots();
      break;
    case EngineIndex::kPositions:
      p.padding = IndexPadding::kMinusOneSkips;
      p.addressing = PageAddressing::kBlockTable;
      p.block_table = {a.block_table,   max_blocks,      max_blocks,       table_rows,
                       spec.block_size, spec.num_blocks, a.row_of_sequence};
      break;
    case EngineIndex::kBlockPages: p.num_pool_pages = spec.num_blocks; break;
  }
  p.qo_layout = spec.strided_qo ? QueryLayout::kStrided : QueryLayout::kPacked;
  p.q = a.q;
  p.q_strides = q_strides;
  p.k = {a.k, k_row_stride, dim_qk, 0, k_head_stride};
  p.v = {a.v, v_row_stride, dim_v, 0, v_head_stride};
  if (dim_extra > 0) {
    p.q_extra = a.q_extra;
    p.q_extra_strides = q_extra_strides;
    p.k_extra = {static_cast<const char*>(a.k) + int64_t{dim_qk} * int64_t(dtype_size(spec.dtype)), k_row_stride,
                 dim_extra, 0, k_head_stride};
  }
  p.scale = scale;
  p.o = a.o;
  p.o_strides = o_strides;
  p.lse = a.lse;
  return p;
}

DecodePlan EngineProblem::plan(const PlanShape& shape) const { return make_decode_plan(plan_counts, shape); }

EngineReference engine_reference(const EngineProblem& pb) {
  const int32_t R = pb.num_requests(), G = pb.spec.group_size, Hkv = pb.spec.num_kv_heads;
  EngineReference ref;
  ref.o.assign(static_cast<size_t>(R) * G * pb.dim_v, 0.0);
  ref.lse.assign(static_cast<size_t>(R) * G, -std::numeric_limits<double>::infinity());
  const DType dt = pb.spec.dtype;
  const std::vector<uint8_t>& v_pool = pb.spec.mla ? pb.k_pool : pb.v_pool;
  for (int32_t r = 0; r < R; ++r) {
    const int32_t h = r % Hkv;
    const auto& slots = pb.slots[static_cast<size_t>(r)];
    if (slots.empty()) continue;
    // The request's rows, converted once for all its query heads.
    std::vector<std::vector<float>> keys, values;
    for (int64_t slot : slots) {
      keys.push_back(
          read_values(pb.k_pool, dt, slot * pb.k_row_stride + h * pb.k_head_stride, pb.dim_qk + pb.dim_extra));
      values.push_back(read_values(v_pool, dt, slot * pb.v_row_stride + h * pb.v_head_stride, pb.dim_v));
    }
    for (int32_t g = 0; g < G; ++g) {
      const auto q = read_values(pb.q_buf, dt, head_at(pb, pb.q_strides, r, g), pb.dim_qk);
      const auto qe =
          pb.dim_extra > 0
              ? read_values(pb.q_buf, dt, pb.q_offset_extra + head_at(pb, pb.q_extra_strides, r, g), pb.dim_extra)
              : std::vector<float>{};
      std::vector<double> scores;
      double mx = -std::numeric_limits<double>::infinity();
      for (const auto& k : keys) {
        double dot = 0.0;
        for (int32_t d = 0; d < pb.dim_qk; ++d) dot += double{q[d]} * k[d];
        for (int32_t d = 0; d < pb.dim_extra; ++d) dot += double{qe[d]} * k[pb.dim_qk + d];
        scores.push_back(dot * pb.scale);
        mx = std::max(mx, scores.back());
      }
      double total = 0.0;
      std::vector<double> acc(static_cast<size_t>(pb.dim_v), 0.0);
      for (size_t i = 0; i < slots.size(); ++i) {
        const double w = std::exp(scores[i] - mx);
        total += w;
        for (int32_t d = 0; d < pb.dim_v; ++d) acc[static_cast<size_t>(d)] += w * values[i][d];
      }
      const size_t row = static_cast<size_t>(r) * G + g;
      for (int32_t d = 0; d < pb.dim_v; ++d) ref.o[row * pb.dim_v + d] = acc[static_cast<size_t>(d)] / total;
      ref.lse[row] = mx + std::log(total);
    }
  }
  return ref;
}

EngineOutput unpack_output(const EngineProblem& pb, const std::vector<uint8_t>& o_buf, const std::vector<float>& lse) {
  const int32_t R = pb.num_requests(), G = pb.spec.group_size, dv = pb.dim_v;
  const std::vector<float> all = as_float(pb.spec.dtype, o_buf);
  EngineOutput out;
  out.lse = lse;
  out.o.assign(static_cast<size_t>(R) * G * dv, 0.0f);
  std::vector<bool> used(all.size(), false);
  for (int32_t r = 0; r < R; ++r) {
    for (int32_t g = 0; g < G; ++g) {
      const int64_t at = head_at(pb, pb.o_strides, r, g);
      for (int32_t d = 0; d < dv; ++d) {
        out.o[(static_cast<size_t>(r) * G + g) * dv + d] = all[static_cast<size_t>(at + d)];
        used[static_cast<size_t>(at + d)] = true;
      }
    }
  }
  for (size_t i = 0; i < all.size(); ++i) out.gaps_untouched = out.gaps_untouched && (used[i] || std::isnan(all[i]));
  return out;
}

std::string compare_engine(const EngineProblem& pb, const EngineReference& ref, const EngineOutput& got, double o_tol,
                           double lse_tol) {
  const size_t heads = static_cast<size_t>(pb.num_requests()) * pb.spec.group_size;
  const size_t dv = static_cast<size_t>(pb.dim_v);
  for (size_t i = 0; i < heads; ++i) {
    const std::string where =
        "request " + std::to_string(i / pb.spec.group_size) + " head " + std::to_string(i % pb.spec.group_size) + ": ";
    if (std::isinf(ref.lse[i])) {
      for (size_t d = 0; d < dv; ++d) {
        if (got.o[i * dv + d] != 0.0f) return where + "empty request has o = " + std::to_string(got.o[i * dv + d]);
      }
      if (!(std::isinf(got.lse[i]) && got.lse[i] < 0))
        return where + "lse " + std::to_string(got.lse[i]) + ", expected -inf";
      continue;
    }
    double err = 0.0, norm = 0.0;
    for (size_t d = 0; d < dv; ++d) {
      const double diff = double{got.o[i * dv + d]} - ref.o[i * dv + d];
      err += diff * diff;
      norm += ref.o[i * dv + d] * ref.o[i * dv + d];
    }
    const double rel = std::sqrt(err / std::max(norm, 1e-30));
    if (!(rel <= o_tol)) return where + "o relative L2 " + std::to_string(rel) + " > " + std::to_string(o_tol);
    const double lse_err = std::fabs(double{got.lse[i]} - ref.lse[i]);
    if (!(lse_err <= lse_tol))
      return where + "lse " + std::to_string(got.lse[i]) + " vs fp64 " + std::to_string(ref.lse[i]);
  }
  return "";
}

}  // namespace sparsepage::testing
