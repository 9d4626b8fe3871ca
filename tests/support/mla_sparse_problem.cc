#include "support/mla_sparse_problem.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include "sparsepage/fp8.h"

namespace sparsepage::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A cache of `num_blocks` blocks whose slots are written with probability
// 3/4 (the rest, every block's padding and MODEL1's unused scale byte stay
// 0xFF), and its ids: per (b, t) `topk` ids of written slots (a share -1),
// those past the sequence's topk_length pointing at poisoned slots.
void build_cache(const MlaSparseSpec& spec, int32_t num_blocks, int32_t block_size, int32_t topk, bool with_length,
                 std::mt19937_64& rng, MlaSparseHostCache& c) {
  const bool v32 = spec.format == MlaCacheFormat::kV32;
  const int32_t dqk = mla_head_dim_qk(spec.format);
  const int64_t row_stride = v32 ? MlaFp8Row::kBytes + spec.row_pad : 0;
  const int64_t block_bytes = v32 ? block_size * row_stride : int64_t{block_size} * MlaModel1Block::kBytesPerToken;
  const int64_t block_stride = block_bytes + spec.block_pad;
  const int64_t slots = int64_t{num_blocks} * block_size;
  c.bytes.assign(static_cast<size_t>(num_blocks * block_stride), 0xFF);
  c.values.assign(static_cast<size_t>(slots * dqk), kNaN);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<int64_t> written, poisoned;
  for (int64_t s = 0; s < slots; ++s) {
    if (unit(rng) >= 0.75) {
      poisoned.push_back(s);
      continue;
    }
    written.push_back(s);
    const int64_t block = s / block_size, offset = s % block_size;
    uint8_t* base = c.bytes.data() + block * block_stride;
    double* value = c.values.data() + s * dqk;
    // Power-of-two scales that differ between a row's blocks, so a value
    // read with its neighbour block's scale is off by a factor of 2 or 4.
    const auto exponent = [&](int i) { return -(5 + static_cast<int>((s + i) % 3)); };
    if (v32) {
      uint8_t* row = base + offset * row_stride;
      float scales[4];
      for (int i = 0; i < 4; ++i) scales[i] = std::ldexp(1.0f, exponent(i));
      std::memcpy(row + MlaFp8Row::kScaleOffset, scales, sizeof(scales));
      for (int i = 0; i < MlaFp8Row::kLatent; ++i) {
        row[i] = float_to_e4m3(normal(rng) * 32.0f);
        value[i] = static_cast<double>(e4m3_to_float(row[i])) * scales[i / MlaFp8Row::kBlock];
      }
      auto* rope = reinterpret_cast<uint16_t*>(row + MlaFp8Row::kRopeOffset);
      for (int i = 0; i < MlaFp8Row::kRope; ++i) {
        rope[i] = float_to_bf16(normal(rng));
        value[MlaFp8Row::kLatent + i] = bf16_to_float(rope[i]);
      }
    } else {
      using M = MlaModel1Block;
      uint8_t* token = base + offset * M::kTokenBytes;
      uint8_t* scale_bytes = base + int64_t{block_size} * M::kTokenBytes + offset * M::kScaleBytes;
      for (int i = 0; i < M::kScales; ++i) scale_bytes[i] = static_cast<uint8_t>(127 + exponent(i));
      for (int i = 0; i < M::kNope; ++i) {
        token[i] = float_to_e4m3(normal(rng) * 32.0f);
        value[i] = std::ldexp(static_cast<double>(e4m3_to_float(token[i])), exponent(i / M::kTile));
      }
      uint16_t rope[M::kRope];
      for (int i = 0; i < M::kRope; ++i) {
        rope[i] = float_to_bf16(normal(rng));
        value[M::kNope + i] = bf16_to_float(rope[i]);
      }
      std::memcpy(token + M::kNope, rope, sizeof(rope));  // the rope sits at byte 448: 2-byte aligned only
    }
  }
  c.view = MlaSparseCache{};
  c.view.num_blocks = num_blocks;
  c.view.block_size = block_size;
  c.view.block_stride = block_stride;
  c.view.row_stride = row_stride;
  c.view.topk = topk;
  c.view.index_batch_stride = int64_t{spec.q_len} * topk;
  c.view.index_token_stride = topk;
  c.indices.assign(static_cast<size_t>(int64_t{spec.batch} * spec.q_len * topk), -1);
  c.topk_length.clear();
  std::uniform_int_distribution<size_t> pick_written(0, written.empty() ? 0 : written.size() - 1);
  std::uniform_int_distribution<size_t> pick_poisoned(0, poisoned.empty() ? 0 : poisoned.size() - 1);
  for (int32_t b = 0; b < spec.batch; ++b) {
    int32_t len = topk;
    if (with_length) {
      // The first sequence reads nothing, the last everything, the others a random share.
      len = b == 0 ? 0 : b + 1 == spec.batch ? topk : std::uniform_int_distribution<int32_t>(0, topk)(rng);
      c.topk_length.push_back(len);
    }
    for (int32_t t = 0; t < spec.q_len; ++t) {
      int32_t* ids = c.indices.data() + (int64_t{b} * spec.q_len + t) * topk;
      for (int32_t i = 0; i < topk; ++i) {
        if (i >= len) {
          ids[i] = poisoned.empty() ? -1 : static_cast<int32_t>(poisoned[pick_poisoned(rng)]);
        } else if (written.empty() || unit(rng) < spec.minus_one) {
          ids[i] = -1;
        } else {
          ids[i] = static_cast<int32_t>(written[pick_written(rng)]);
        }
      }
    }
  }
  c.view.data = c.bytes.data();
  c.view.indices = c.indices.data();
  c.view.topk_length = c.topk_length.empty() ? nullptr : c.topk_length.data();
}

// The visible, non -1 slots of query (b, t) in cache `c`.
std::vector<int64_t> visible_slots(const MlaSparseProblem& pb, const MlaSparseHostCache& c, int32_t b, int32_t t) {
  std::vector<int64_t> out;
  const int64_t len = c.topk_length.empty() ? c.view.topk : c.topk_length[static_cast<size_t>(b)];
  const int32_t* ids = c.indices.data() + (int64_t{b} * pb.spec.q_len + t) * c.view.topk;
  for (int64_t i = 0; i < len; ++i)
    if (ids[i] != -1) out.push_back(ids[i]);
  return out;
}

}  // namespace

MlaSparseParams MlaSparseProblem::host_params(void* o, float* lse) const {
  MlaSparseParams p;
  p.format = spec.format;
  p.dtype = DType::kBF16;
  p.batch = spec.batch;
  p.q_len = spec.q_len;
  p.num_heads = spec.num_heads;
  p.q = q.data();
  p.q_head_stride = head_dim_qk();
  p.q_token_stride = int64_t{spec.num_heads} * p.q_head_stride;
  p.q_batch_stride = int64_t{spec.q_len} * p.q_token_stride;
  p.cache = cache.view;
  if (spec.extra_topk > 0) p.extra = extra.view;
  p.attn_sink = sink.empty() ? nullptr : sink.data();
  p.scale = scale;
  p.o = o;
  p.lse = lse;
  return p;
}

void MlaSparseProblem::relink() {
  for (MlaSparseHostCache* c : {&cache, &extra}) {
    c->view.data = c->bytes.empty() ? nullptr : c->bytes.data();
    c->view.indices = c->indices.empty() ? nullptr : c->indices.data();
    c->view.topk_length = c->topk_length.empty() ? nullptr : c->topk_length.data();
  }
}

MlaSparseProblem make_mla_sparse_problem(const MlaSparseSpec& spec) {
  MlaSparseProblem pb;
  pb.spec = spec;
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int32_t dqk = mla_head_dim_qk(spec.format);
  pb.q.resize(static_cast<size_t>(int64_t{spec.batch} * spec.q_len * spec.num_heads * dqk));
  for (auto& x : pb.q) x = float_to_bf16(normal(rng));
  pb.scale = 1.0f / std::sqrt(static_cast<float>(dqk));
  build_cache(spec, spec.num_blocks, spec.block_size, spec.topk, spec.topk_length, rng, pb.cache);
  if (spec.extra_topk > 0)
    build_cache(spec, spec.extra_num_blocks, spec.extra_block_size, spec.extra_topk, spec.extra_topk_length, rng,
                pb.extra);
  if (spec.sink) {
    // Sinks around the scores' lse (a few units), and the three limits:
    // -inf (no effect), +inf and 1e4 (o = 0).
    std::uniform_real_distribution<float> around(-2.0f, 8.0f);
    for (int32_t h = 0; h < spec.num_heads; ++h) {
      const int kind = h % 7;
      pb.sink.push_back(kind == 1   ? -std::numeric_limits<float>::infinity()
                        : kind == 2 ? std::numeric_limits<float>::infinity()
                        : kind == 3 ? 1e4f
                                    : around(rng));
    }
  }
  return pb;
}

MlaSparseReference mla_sparse_reference(const MlaSparseProblem& pb) {
  const MlaSparseSpec& s = pb.spec;
  const int32_t dqk = pb.head_dim_qk(), dv = kMlaSparseHeadDimV;
  MlaSparseReference ref;
  const size_t queries = static_cast<size_t>(int64_t{s.batch} * s.q_len * s.num_heads);
  ref.o.assign(queries * dv, 0.0);
  ref.lse.assign(queries, kInf);
  for (int32_t b = 0; b < s.batch; ++b) {
    for (int32_t t = 0; t < s.q_len; ++t) {
      std::vector<const double*> rows;
      for (int64_t slot : visible_slots(pb, pb.cache, b, t)) rows.push_back(pb.cache.values.data() + slot * dqk);
      if (s.extra_topk > 0)
        for (int64_t slot : visible_slots(pb, pb.extra, b, t)) rows.push_back(pb.extra.values.data() + slot * dqk);
      for (int32_t h = 0; h < s.num_heads; ++h) {
        const size_t query = (static_cast<size_t>(b) * s.q_len + t) * s.num_heads + h;
        if (rows.empty()) continue;  // o = 0, lse = +inf
        const uint16_t* q = pb.q.data() + query * dqk;
        std::vector<double> scores;
        for (const double* k : rows) {
          double dot = 0.0;
          for (int32_t i = 0; i < dqk; ++i) dot += static_cast<double>(bf16_to_float(q[i])) * k[i];
          scores.push_back(dot * pb.scale);
        }
        const double max = *std::max_element(scores.begin(), scores.end());
        double sum = 0.0;
        double* o = ref.o.data() + query * dv;
        for (size_t j = 0; j < rows.size(); ++j) {
          const double w = std::exp(scores[j] - max);
          sum += w;
          for (int32_t i = 0; i < dv; ++i) o[i] += w * rows[j][i];
        }
        const double lse = max + std::log(sum);
        double factor = 1.0 / sum;
        if (!pb.sink.empty()) factor /= 1.0 + std::exp(static_cast<double>(pb.sink[static_cast<size_t>(h)]) - lse);
        for (int32_t i = 0; i < dv; ++i) o[i] *= factor;
        ref.lse[query] = lse;
      }
    }
  }
  return ref;
}

MlaSparseProblem merge_into_one_cache(const MlaSparseProblem& pb) {
  const MlaSparseSpec& s = pb.spec;
  if (s.extra_topk == 0 || s.block_size != s.extra_block_size ||
      pb.cache.view.block_stride != pb.extra.view.block_stride)
    throw Error("merge_into_one_cache: needs an extra cache of the main one's block size and stride");
  MlaSparseProblem one = pb;
  one.spec.topk = s.topk + s.extra_topk;
  one.spec.extra_topk = 0;
  one.spec.num_blocks = s.num_blocks + s.extra_num_blocks;
  one.spec.topk_length = one.spec.extra_topk_length = false;
  MlaSparseHostCache& c = one.cache;
  c.bytes.insert(c.bytes.end(), pb.extra.bytes.begin(), pb.extra.bytes.end());
  c.values.insert(c.values.end(), pb.extra.values.begin(), pb.extra.values.end());
  const int64_t main_slots = pb.cache.slots();
  c.indices.assign(static_cast<size_t>(int64_t{s.batch} * s.q_len * one.spec.topk), -1);
  for (int32_t b = 0; b < s.batch; ++b) {
    for (int32_t t = 0; t < s.q_len; ++t) {
      int32_t* row = c.indices.data() + (int64_t{b} * s.q_len + t) * one.spec.topk;
      for (const MlaSparseHostCache* part : {&pb.cache, &pb.extra}) {
        const bool extra = part == &pb.extra;
        const int32_t topk = part->view.topk;
        const int64_t len = part->topk_length.empty() ? topk : part->topk_length[static_cast<size_t>(b)];
        const int32_t* ids = part->indices.data() + (int64_t{b} * s.q_len + t) * topk;
        for (int32_t i = 0; i < topk; ++i) {
          const int32_t id = i < len ? ids[i] : -1;
          row[(extra ? s.topk : 0) + i] = id == -1 ? -1 : static_cast<int32_t>(id + (extra ? main_slots : 0));
        }
      }
    }
  }
  c.topk_length.clear();
  c.view.num_blocks = one.spec.num_blocks;
  c.view.topk = one.spec.topk;
  c.view.index_batch_stride = int64_t{s.q_len} * one.spec.topk;
  c.view.index_token_stride = one.spec.topk;
  one.extra = MlaSparseHostCache{};
  one.relink();
  return one;
}

PlanShape mla_sparse_cpu_machine(int32_t fixed_chunk_tokens) {
  PlanShape shape;
  shape.num_sms = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  shape.fixed_chunk_tokens = fixed_chunk_tokens;
  shape.chunk_granule = 16;  // the CPU loop has no token tile: small forced chunks stay small
  return shape;
}

std::string compare_mla_sparse(const MlaSparseProblem& pb, const MlaSparseReference& ref, const std::vector<float>& o,
                               const std::vector<float>& lse, double o_tol, double lse_tol) {
  const size_t dv = kMlaSparseHeadDimV;
  const size_t queries = ref.lse.size();
  if (o.size() != queries * dv || lse.size() != queries) return "output sizes differ from the reference's";
  const int32_t heads = pb.spec.num_heads, q_len = pb.spec.q_len;
  for (size_t query = 0; query < queries; ++query) {
    std::ostringstream where;
    where << "query (b " << query / heads / q_len << ", t " << query / heads % q_len << ", head " << query % heads
          << ")";
    const double want = ref.lse[query];
    if (std::isinf(want)) {
      if (!(std::isinf(lse[query]) && lse[query] > 0))
        return where.str() + ": lse " + std::to_string(lse[query]) + ", expected +inf";
      for (size_t i = 0; i < dv; ++i)
        if (o[query * dv + i] != 0.0f)
          return where.str() + ": attended nothing but o[" + std::to_string(i) +
                 "] = " + std::to_string(o[query * dv + i]);
      continue;
    }
    if (!(std::fabs(lse[query] - want) <= lse_tol * std::max(1.0, std::fabs(want))))
      return where.str() + ": lse " + std::to_string(lse[query]) + ", expected " + std::to_string(want);
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < dv; ++i) {
      const double got = o[query * dv + i], w = ref.o[query * dv + i];
      if (!std::isfinite(got)) return where.str() + ": o[" + std::to_string(i) + "] is not finite";
      diff += (got - w) * (got - w);
      norm += w * w;
    }
    if (norm == 0.0 ? diff != 0.0 : std::sqrt(diff / norm) > o_tol)
      return where.str() + ": o's relative L2 error " +
             std::to_string(norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm)) + " exceeds " +
             std::to_string(o_tol);
  }
  return {};
}

}  // namespace sparsepage::testing
