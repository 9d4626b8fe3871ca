// The CPU twin of the FlashMLA-shaped sparse decode (mla_sparse.h): the same
// plan, either form, each work item of either cache attending its chunk (the
// one attention loop, attention_cpu.h, over rows dequantized to fp32 as they
// are read), then per request the merge of its items and the finalize (the
// sink, FlashMLA's lse of an empty row), as the CUDA merge or epilogue does.
// Both formats, any block stride.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu/attention_cpu.h"
#include "cpu/parallel.h"
#include "sparsepage/fp8.h"
#include "sparsepage/mla_sparse.h"

namespace sparsepage {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// An e8m0 scale: 2^(bits - 127), all ones NaN.
float e8m0_to_float(uint8_t bits) {
  return bits == 0xFF ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, int{bits} - 127);
}

// Slot `slot` of cache `c`, dequantized to fp32: [512 latent | 64 rope]
// (kV32) or [448 | 64 rope] (kModel1). K is the whole row, V its first 512.
void dequantize_slot(MlaCacheFormat format, const MlaSparseCache& c, int64_t slot, float* dst) {
  const int64_t block = slot / c.block_size, offset = slot % c.block_size;
  const auto* block_base = static_cast<const uint8_t*>(c.data) + block * c.block_stride;
  if (format == MlaCacheFormat::kV32) {
    const uint8_t* row = block_base + offset * c.row_stride;
    float scales[4];
    std::memcpy(scales, row + MlaFp8Row::kScaleOffset, sizeof(scales));
    for (int i = 0; i < MlaFp8Row::kLatent; ++i) dst[i] = e4m3_to_float(row[i]) * scales[i / MlaFp8Row::kBlock];
    to_float(DType::kBF16, row + MlaFp8Row::kRopeOffset, dst + MlaFp8Row::kLatent, MlaFp8Row::kRope);
    return;
  }
  using M = MlaModel1Block;
  const uint8_t* token = block_base + offset * M::kTokenBytes;
  const uint8_t* scales = block_base + int64_t{c.block_size} * M::kTokenBytes + offset * M::kScaleBytes;
  for (int i = 0; i < M::kNope; ++i) dst[i] = e4m3_to_float(token[i]) * e8m0_to_float(scales[i / M::kTile]);
  to_float(DType::kBF16, token + M::kNope, dst + M::kNope, M::kRope);
}

const int32_t* ids_of(const MlaSparseCache& c, int64_t b, int64_t t) {
  return c.indices + b * c.index_batch_stride + t * c.index_token_stride;
}

int64_t visible(const MlaSparseCache& c, int64_t b) { return c.topk_length ? c.topk_length[b] : c.topk; }

// Every length and every id the run will read, before it reads any row:
// the first bad one is named. `prefix` is "" or "extra_", as FlashMLA names
// the arguments.
void check_ids(const MlaSparseParams& p, const MlaSparseCache& c, const std::string& prefix) {
  const int64_t slots = c.num_slots();
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = visible(c, b);
    if (len < 0 || len > c.topk)
      throw Error("mla_sparse: " + prefix + "topk_length[" + std::to_string(b) + "] = " + std::to_string(len) +
                  " must lie in [0, " + std::to_string(c.topk) + "] (the index rows' width)");
    for (int64_t t = 0; t < p.q_len; ++t) {
      const int32_t* ids = ids_of(c, b, t);
      for (int64_t i = 0; i < len; ++i) {
        if (ids[i] == -1) continue;
        if (ids[i] < 0 || ids[i] >= slots)
          throw Error("mla_sparse: " + prefix + "indices[" + std::to_string(b) + ", " + std::to_string(t) + ", " +
                      std::to_string(i) + "] = " + std::to_string(ids[i]) + " is outside the " +
                      (prefix.empty() ? "cache" : "extra cache") + "'s " + std::to_string(slots) + " slots (" +
                      std::to_string(c.num_blocks) + " blocks of " + std::to_string(c.block_size) +
                      "); -1 is the only id that means no token");
      }
    }
  }
}

struct ItemRef {
  const WorkItem* item;
  const MlaSparseCache* cache;
};

}  // namespace

void run_mla_sparse_cpu(const MlaSparseParams& p, const MlaSparsePlan& plan, void* workspace) {
  check_mla_sparse_plan(plan);
  const std::string problem = mla_sparse_problem(p, plan);
  if (!problem.empty()) throw Error("mla_sparse: " + problem);
  if (workspace == nullptr) throw Error("mla_sparse: workspace is null");
  const bool has_extra = p.extra.data != nullptr;
  check_ids(p, p.cache, "");
  if (has_extra) check_ids(p, p.extra, "extra_");

  const int32_t dqk = mla_head_dim_qk(p.format), dv = kMlaSparseHeadDimV, heads = p.num_heads;
  const size_t esize = dtype_size(p.dtype);
  // Each work item's state, then per request the merge of its items (the
  // extra cache's after the main cache's) and the finalize: the same sums
  // whichever form the plan has (mla_sparse.h).
  std::vector<ItemRef> items;
  items.reserve(plan.main.work.size() + plan.extra.work.size());
  for (const WorkItem& w : plan.main.work) items.push_back({&w, &p.cache});
  if (has_extra)
    for (const WorkItem& w : plan.extra.work) items.push_back({&w, &p.extra});
  std::vector<std::vector<size_t>> of_request(static_cast<size_t>(plan.num_requests()));
  for (size_t k = 0; k < items.size(); ++k) of_request[static_cast<size_t>(items[k].item->request)].push_back(k);
  std::vector<cpu::ChunkState> states(items.size());

  cpu::parallel_for(static_cast<int64_t>(items.size()), [&](int64_t k) {
    const WorkItem& w = *items[static_cast<size_t>(k)].item;
    const MlaSparseCache& c = *items[static_cast<size_t>(k)].cache;
    const int64_t b = w.request / p.q_len, t = w.request % p.q_len;
    std::vector<float> q(static_cast<size_t>(heads) * dqk);
    for (int32_t g = 0; g < heads; ++g) {
      const int64_t offset = b * p.q_batch_stride + t * p.q_token_stride + g * p.q_head_stride;
      to_float(p.dtype, static_cast<const char*>(p.q) + offset * static_cast<int64_t>(esize),
               q.data() + static_cast<size_t>(g) * dqk, static_cast<size_t>(dqk));
    }
    // The rows arrive dequantized as fp32 (K: all dqk values, V: the first 512).
    const cpu::ChunkQuery query{DType::kF32, heads, dqk, dv, 0, q.data(), nullptr, p.scale};
    const int32_t* ids = ids_of(c, b, t);
    std::vector<float> row(static_cast<size_t>(dqk));
    auto rows = [&](int64_t i) {
      // attend_chunk reads the row before it asks for the next one.
      if (ids[i] == -1)
        std::fill(row.begin(), row.end(), 0.0f);  // never read; -inf keeps it out
      else
        dequantize_slot(p.format, c, ids[i], row.data());
      return cpu::TokenRows{row.data(), row.data(), nullptr};
    };
    auto bias = [&](int64_t i) { return ids[i] == -1 ? kNegInf : 0.0f; };
    const int64_t end = std::max<int64_t>(w.token_begin, std::min<int64_t>(w.token_end, visible(c, b)));
    states[static_cast<size_t>(k)] = cpu::attend_chunk(query, w.token_begin, end, rows, bias);
  });

  cpu::parallel_for(plan.num_requests(), [&](int64_t r) {
    std::vector<const float*> o_parts, lse_parts;
    for (size_t k : of_request[static_cast<size_t>(r)]) {
      o_parts.push_back(states[k].o.data());
      lse_parts.push_back(states[k].lse.data());
    }
    std::vector<float> o(static_cast<size_t>(heads) * dv), lse(static_cast<size_t>(heads));
    cpu::merge_states(o_parts, lse_parts, heads, dv, o.data(), lse.data());
    cpu::finalize_states(o.data(), lse.data(), heads, dv, p.attn_sink, std::numeric_limits<float>::infinity());
    from_float(p.dtype, o.data(), static_cast<char*>(p.o) + static_cast<size_t>(r) * heads * dv * esize, o.size());
    if (p.lse != nullptr) std::copy(lse.begin(), lse.end(), p.lse + static_cast<size_t>(r) * heads);
  });
}

}  // namespace sparsepage
