// Host-side checks shared by both backends: everything that can be checked
// without reading the arrays. Each message names the field and the bound.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "core/decode_limits.h"
#include "core/require.h"
#include "sparsepage/decode.h"
#include "sparsepage/detail/cuda_introspection.h"
#include "sparsepage/detail/query_strides.h"

#define REQUIRE(ok, ...) SPARSEPAGE_REQUIRE(ok, "decode: ", __VA_ARGS__)

namespace sparsepage {
namespace {

// The output rows of o (num_sequences x q_len tokens x num_kv_heads *
// group_size heads of dim elements) must not overlap, or two CTAs would write
// the same elements. Sufficient: taken from the smaller stride up, each
// dimension steps over the whole extent of the ones inside it.
void check_output_strides(const QueryStrides& s, int64_t sequences, int64_t tokens, int64_t heads, int32_t dim) {
  std::pair<int64_t, int64_t> dims[] = {
      {s.seq_stride, sequences}, {s.token_stride, tokens}, {s.head_stride, heads}};  // (stride, count)
  std::sort(std::begin(dims), std::end(dims));
  long double extent = dim;  // elements the inner dimensions cover
  for (const auto& [stride, count] : dims) {
    if (count <= 1) continue;
    REQUIRE(static_cast<long double>(stride) >= extent,
            "o_strides (seq_stride " + std::to_string(s.seq_stride) +
                (tokens > 1 ? ", token_stride " + std::to_string(s.token_stride) : std::string()) + ", head_stride " +
                std::to_string(s.head_stride) + ") make the output rows of " + std::to_string(dim) +
                " elements overlap");
    extent += static_cast<long double>(stride) * static_cast<long double>(count - 1);
  }
}

// The fp8 formats' own fields, before any stream is judged. Messages are
// built only for a failed check (this runs on every launch).
void check_kv_format(const DecodeParams& p) {
  const std::string problem = kv_format_problem(p);
  REQUIRE(problem.empty(), problem);
}

}  // namespace

std::string row_view_problem(const RowView& view, const char* name, int64_t sequences, int64_t heads, int64_t rows,
                             size_t element_size) {
  const std::string n(name);
  if (view.data == nullptr) return n + ".data is null";
  if (view.dim < 1) return n + ".dim = " + std::to_string(view.dim) + " must be at least 1";
  if (view.row_stride < view.dim)
    return n + ".row_stride = " + std::to_string(view.row_stride) + " is smaller than " + n +
           ".dim = " + std::to_string(view.dim);
  if (view.seq_stride < 0 || view.head_stride < 0 || view.capacity < 0)
    return n + ".seq_stride, " + n + ".head_stride and " + n + ".capacity must not be negative";
  if (rows > view.capacity)
    return n + ": " + std::to_string(rows) + " rows per head exceed " + n +
           ".capacity = " + std::to_string(view.capacity);
  if (rows <= 0 || sequences <= 0 || heads <= 0) return {};
  // Distinct rows must not overlap: taking the levels (row, head, sequence)
  // from the smallest stride up, each stride must clear everything the
  // smaller levels span. Levels of one entry or stride 0 (shared) are skipped.
  struct Level {
    int64_t stride, extent;
    const char* field;
    const char* what;
  };
  Level levels[] = {{view.row_stride, rows, ".row_stride", "positions"},
                    {view.head_stride, heads, ".head_stride", "heads"},
                    {view.seq_stride, sequences, ".seq_stride", "sequences"}};
  std::sort(std::begin(levels), std::end(levels), [](const Level& a, const Level& b) { return a.stride < b.stride; });
  long double span = view.dim;  // elements the levels so far cover
  for (const Level& level : levels) {
    if (level.extent <= 1 || level.stride == 0) continue;
    if (static_cast<long double>(level.stride) < span)
      return n + level.field + " = " + std::to_string(level.stride) + " is smaller than the " +
             std::to_string(static_cast<int64_t>(std::min(span, 9.2e18L))) + " elements the smaller strides span (" +
             std::to_string(rows) + " rows per head): rows of different " + level.what + " would overlap";
    span += static_cast<long double>(level.extent - 1) * static_cast<long double>(level.stride);
  }
  if (span * static_cast<long double>(element_size) >= 4.6e18L)
    return n + ": " + std::to_string(rows) + " rows of row_stride " + std::to_string(view.row_stride) +
           " (with its sequence and head strides) span more than 2^62 bytes";
  return {};
}

const char* cuda_built_architectures() { return SPARSEPAGE_CUDA_ARCH_LIST; }

namespace {

// What a build's architecture list offers a GPU of compute capability `sm`:
// whether any entry runs there, and whether the list has sm_90a code.
// "90a" (arch-specific) runs on sm_90 only; "80" carries PTX too, so it runs
// on anything from sm_80 up; "80-real" (SASS only) on the same major version
// from sm_80 up.
struct BuiltFor {
  bool runs = false, has_sm90a = false;
};
BuiltFor built_for(int32_t sm, std::string_view built) {
  BuiltFor b;
  size_t begin = 0;
  while (begin <= built.size()) {
    const size_t end = std::min(built.find(',', begin), built.size());
    const std::string_view entry = built.substr(begin, end - begin);
    begin = end + 1;
    size_t digits = 0;
    int arch = 0;
    while (digits < entry.size() && entry[digits] >= '0' && entry[digits] <= '9' && arch < 100000)
      arch = arch * 10 + (entry[digits++] - '0');
    if (digits == 0) continue;
    const bool specific = digits < entry.size() && (entry[digits] == 'a' || entry[digits] == 'f');
    const bool sass_only = entry.find("-real") != std::string_view::npos;
    if (specific) {
      b.runs = b.runs || sm == arch;
      b.has_sm90a = b.has_sm90a || (arch == 90 && entry[digits] == 'a');
    } else if (sass_only) {
      b.runs = b.runs || (sm / 10 == arch / 10 && sm >= arch);
    } else {
      b.runs = b.runs || sm >= arch;
    }
  }
  return b;
}

std::string_view built_list_or_this(const char* built_list) {
  return built_list != nullptr ? built_list : cuda_built_architectures();
}

}  // namespace

bool cuda_sm90a_code_runs(int32_t sm, const char* built_list) {
  return sm == 90 && built_for(sm, built_list_or_this(built_list)).has_sm90a;
}

std::string cuda_arch_problem(int32_t sm, int32_t head_dim_qk, int32_t head_dim_v, int32_t head_dim_extra,
                              const char* built_list) {
  // The launchers ask on every launch: the answer "" is reached without
  // building a string; the messages are built only for a problem.
  const std::string_view built = built_list_or_this(built_list);
  const auto device = [sm] { return "sm_" + std::to_string(sm); };
  if (built.empty()) return "this sparsepage build has no CUDA kernels";
  if (sm < 80) return "no fused kernel for " + device() + ": the kernels need sm_80 or newer (cp.async and mma.sync)";
  const auto [runs, has_sm90a] = built_for(sm, built);
  if (head_dim_qk == 512 && head_dim_v == 512 && head_dim_extra == 64) {
    if (sm != 90) return "no fused kernel for " + device() + " at the MLA shape (its wgmma kernel runs on sm_90 only)";
    if (!has_sm90a)
      return "no fused kernel for sm_90 at the MLA shape: this build has no sm_90a code (built for " +
             std::string(built) + "; add 90a to SPARSEPAGE_CUDA_ARCHS)";
    return {};
  }
  if (!runs)
    return "no fused kernel for " + device() + " in this build (built for " + std::string(built) +
           "; add it to SPARSEPAGE_CUDA_ARCHS)";
  return {};
}

std::string block_table_problem(const BlockTable& t, int64_t sequences) {
  if (t.block_size < 1) return "block_table.block_size = " + std::to_string(t.block_size) + " must be at least 1";
  if (t.max_blocks < 0) return "block_table.max_blocks = " + std::to_string(t.max_blocks) + " is negative";
  if (t.row_stride < t.max_blocks)
    return "block_table.row_stride = " + std::to_string(t.row_stride) +
           " is smaller than block_table.max_blocks = " + std::to_string(t.max_blocks);
  if (t.num_blocks < 0) return "block_table.num_blocks = " + std::to_string(t.num_blocks) + " is negative";
  if (t.num_blocks > (int64_t{1} << 62) / t.block_size) return "block_table.num_blocks * block_size overflows";
  if (t.num_rows < 1) return "block_table.num_rows = " + std::to_string(t.num_rows) + " must be at least 1";
  if (t.row_of_sequence == nullptr && t.num_rows < sequences)
    return "block_table.num_rows = " + std::to_string(t.num_rows) + " is fewer than the " + std::to_string(sequences) +
           " sequences (and row_of_sequence is null)";
  return {};
}

QoStrides qo_strides(const DecodeParams& p) {
  if (p.qo_layout == QueryLayout::kStrided) return {p.q_strides, p.q_extra_strides, p.o_strides};
  // [num_sequences, q_len, num_kv_heads * group_size, dim]
  const int64_t heads = int64_t{p.num_kv_heads} * p.group_size;
  const int64_t tokens = std::max(p.q_len, 1);
  const int32_t de = p.k_extra.data ? p.k_extra.dim : 0;
  return {{tokens * heads * p.k.dim, p.k.dim, heads * p.k.dim},
          {tokens * heads * de, de, heads * de},
          {tokens * heads * p.v.dim, p.v.dim, heads * p.v.dim}};
}

std::string cuda_layout_problem(DType dtype, const void* q, const void* q_extra, const RowView& k, const RowView& v,
                                const RowView& k_extra, const void* o) {
  if (dtype != DType::kBF16 && dtype != DType::kF16)
    return std::string("dtype ") + dtype_name(dtype) +
           " is not supported on CUDA (the tensor-core kernels take bf16 and f16)";
  const std::pair<const void*, const char*> bases[] = {
      {q, "q"}, {q_extra, "q_extra"}, {k.data, "k.data"}, {v.data, "v.data"}, {k_extra.data, "k_extra.data"}, {o, "o"}};
  for (const auto& [ptr, name] : bases) {
    if (ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      return std::string(name) + " must be 16-byte aligned on CUDA";
  }
  const std::pair<const RowView*, const char*> streams[] = {{&k, "k"}, {&v, "v"}, {&k_extra, "k_extra"}};
  for (const auto& [s, name] : streams) {
    if (s->data == nullptr) continue;
    const std::pair<int64_t, const char*> strides[] = {
        {s->row_stride, ".row_stride"}, {s->seq_stride, ".seq_stride"}, {s->head_stride, ".head_stride"}};
    for (const auto& [stride, field] : strides) {
      if (stride % 8 != 0)
        return std::string(name) + field + " = " + std::to_string(stride) +
               " must be a multiple of 8 elements on CUDA (rows are copied in 16-byte pieces)";
    }
  }
  if (v.dim > 256 && (v.data != k.data || v.row_stride != k.row_stride || v.seq_stride != k.seq_stride ||
                      v.head_stride != k.head_stride))
    return "a V wider than 256 (the MLA latent) must be the first columns of K's rows on CUDA";
  return {};
}

namespace {

// The fp8 formats on CUDA: the two shapes with kernels, and byte strides in
// whole 16-byte pieces (rows are copied 16 bytes at a time).
std::string cuda_fp8_problem(const DecodeParams& p) {
  const std::string name = std::string("kv_format ") + kv_format_name(p.kv_format);
  const int32_t de = p.k_extra.data ? p.k_extra.dim : 0;
  if (p.kv_format == KvFormat::kE4m3PerHead && !(p.k.dim == 128 && p.v.dim == 128 && de == 0))
    return name +
           " runs on CUDA at head dim 128 only (K and V 128, no second stream), not qk = " + std::to_string(p.k.dim) +
           ", v = " + std::to_string(p.v.dim) + ", extra = " + std::to_string(de);
  if (p.kv_format == KvFormat::kE4m3Mla && !(p.dtype == DType::kBF16 && p.k.dim == 512 && p.v.dim == 512 && de == 64))
    return name + " runs on CUDA at the MLA shape (512 + 64, bf16) only";
  const std::pair<const RowView*, const char*> streams[] = {{&p.k, "k"}, {&p.v, "v"}};
  for (const auto& [s, n] : streams) {
    const std::pair<int64_t, const char*> strides[] = {
        {s->row_stride, ".row_stride"}, {s->seq_stride, ".seq_stride"}, {s->head_stride, ".head_stride"}};
    for (const auto& [stride, field] : strides) {
      if (stride % 16 != 0)
        return std::string(n) + field + " = " + std::to_string(stride) + " must be a multiple of 16 bytes for " + name +
               " on CUDA (rows are copied in 16-byte pieces)";
    }
  }
  return {};
}

}  // namespace

std::string cuda_layout_problem(const DecodeParams& p) {
  std::string problem = cuda_layout_problem(p.dtype, p.q, p.q_extra, p.k, p.v, p.k_extra, p.o);
  if (problem.empty() && p.kv_format != KvFormat::kNative) problem = cuda_fp8_problem(p);
  if (!problem.empty() || p.qo_layout != QueryLayout::kStrided) return problem;
  const std::pair<const QueryStrides*, const char*> views[] = {
      {&p.q_strides, "q_strides"}, {&p.q_extra_strides, "q_extra_strides"}, {&p.o_strides, "o_strides"}};
  for (const auto& [s, name] : views) {
    if (s == &p.q_extra_strides && p.q_extra == nullptr) continue;
    // token_stride is read only by multi-token steps.
    const std::pair<int64_t, const char*> strides[] = {{s->seq_stride, ".seq_stride"},
                                                       {s->head_stride, ".head_stride"},
                                                       {p.q_len > 1 ? s->token_stride : 0, ".token_stride"}};
    for (const auto& [stride, field] : strides) {
      if (stride % 8 != 0)
        return std::string(name) + field + " = " + std::to_string(stride) +
               " must be a multiple of 8 elements on CUDA (q rows are read, and o rows written, in 16-byte pieces)";
    }
  }
  return {};
}

const char* kv_format_name(KvFormat format) {
  switch (format) {
    case KvFormat::kNative: return "native";
    case KvFormat::kE4m3PerHead: return "e4m3 per head";
    case KvFormat::kE4m3Mla: return "e4m3 mla";
  }
  return "unknown";
}

std::string kv_format_problem(const DecodeParams& p) {
  const KvFormat f = p.kv_format;
  if (f != KvFormat::kNative && f != KvFormat::kE4m3PerHead && f != KvFormat::kE4m3Mla)
    return "kv_format " + std::to_string(static_cast<int32_t>(f)) + " is not a KvFormat";
  const std::string name = std::string("kv_format ") + kv_format_name(f);
  if (f == KvFormat::kE4m3PerHead) {
    if (p.k_scale == nullptr || p.v_scale == nullptr)
      return name + " needs k_scale and v_scale (one fp32 per KV head); k_scale or v_scale is null";
  } else if (p.k_scale != nullptr || p.v_scale != nullptr) {
    return "k_scale / v_scale are set but " + name + " has no per-head scales";
  }
  if (f != KvFormat::kE4m3Mla) return {};
  if (p.dtype != DType::kBF16) return name + " stores its rope as bf16: dtype must be bf16, not " + dtype_name(p.dtype);
  if (p.k.dim != 512 || p.v.dim != 512)
    return name + " has 512 latent values per row: k.dim = " + std::to_string(p.k.dim) +
           ", v.dim = " + std::to_string(p.v.dim);
  if (p.v.data != p.k.data || p.v.row_stride != p.k.row_stride || p.v.seq_stride != p.k.seq_stride ||
      p.v.head_stride != p.k.head_stride)
    return name + ": V is the latent of K's rows, so v must be the same view as k";
  if (p.k_extra.data == nullptr || p.k_extra.dim != 64)
    return name + " needs the rope as k_extra (64 values; mla_fp8_views builds it)";
  if (p.k.row_stride < 528)
    return name + ": k.row_stride = " + std::to_string(p.k.row_stride) +
           " bytes cannot hold 512 latent bytes and 4 fp32 scales (528 bytes)";
  return {};
}

int64_t window_lens_bound(const DecodeParams& p) {
  if (p.addressing == PageAddressing::kBlockTable)
    return int64_t{p.block_table.max_blocks} * std::max(p.block_table.block_size, 0);
  if (p.addressing != PageAddressing::kWindow) return 0;
  int64_t capacity = RowView::kUnknownCapacity;
  for (const RowView* s : {&p.k, &p.v, &p.k_extra}) {
    if (s->data != nullptr) capacity = std::min(capacity, s->capacity);
  }
  return capacity == RowView::kUnknownCapacity ? p.window_len : capacity;
}

void check_decode_params(const DecodeParams& p, const DecodePlan& plan) {
  detail::check_decode_params(p, plan, kMaxQueryTokens);
}

void detail::check_decode_params(const DecodeParams& p, const DecodePlan& plan, int32_t max_q_len) {
  REQUIRE(p.dtype == DType::kF32 || p.dtype == DType::kF16 || p.dtype == DType::kBF16,
          "dtype " + std::to_string(static_cast<int32_t>(p.dtype)) + " is not a DType");
  check_kv_format(p);
  REQUIRE(p.num_requests >= 0, "num_requests = " + std::to_string(p.num_requests) + " is negative");
  REQUIRE(p.num_requests == plan.num_requests, "num_requests = " + std::to_string(p.num_requests) +
                                                   " but the plan was made for " + std::to_string(plan.num_requests));
  REQUIRE(p.group_size >= 1, "group_size = " + std::to_string(p.group_size) + " must be at least 1");
  REQUIRE(p.q_len >= 1 && p.q_len <= max_q_len,
          "q_len = " + std::to_string(p.q_len) + " must lie in [1, " + std::to_string(max_q_len) + "]");
  REQUIRE(int64_t{p.group_size} * p.q_len == plan.group_size,
          p.q_len == 1 ? "group_size = " + std::to_string(p.group_size) + " but the plan was made for " +
                             std::to_string(plan.group_size)
                       : "group_size * q_len = " + std::to_string(p.group_size) + " * " + std::to_string(p.q_len) +
                             " query rows per request but the "
                             "plan was made for " +
                             std::to_string(plan.group_size));
  REQUIRE(p.page_size >= 1, "page_size = " + std::to_string(p.page_size) + " must be at least 1");
  REQUIRE(p.num_indices >= 0, "num_indices = " + std::to_string(p.num_indices) + " is negative");
  REQUIRE(p.indices != nullptr || p.num_indices == 0,
          "indices is null but num_indices = " + std::to_string(p.num_indices));
  REQUIRE(p.num_pool_pages >= 0, "num_pool_pages = " + std::to_string(p.num_pool_pages) + " is negative");
  REQUIRE(std::isfinite(p.scale), "scale is not finite");
  REQUIRE(p.num_kv_heads >= 1, "num_kv_heads = " + std::to_string(p.num_kv_heads) + " must be at least 1");
  REQUIRE(p.num_requests % p.num_kv_heads == 0,
          "num_requests = " + std::to_string(p.num_requests) +
              " is not a multiple of num_kv_heads = " + std::to_string(p.num_kv_heads));
  const bool window = p.addressing == PageAddressing::kWindow;
  const bool block_table = p.addressing == PageAddressing::kBlockTable;
  REQUIRE(window || block_table || p.addressing == PageAddressing::kPoolPages,
          "addressing is not a PageAddressing value");
  REQUIRE(p.index_layout == IndexLayout::kCsr || p.index_layout == IndexLayout::kMatrix,
          "index_layout is not an IndexLayout value");
  REQUIRE(p.padding == IndexPadding::kNone || p.padding == IndexPadding::kMinusOneSkips,
          "padding is not an IndexPadding value");
  REQUIRE(p.seq_lens_index == SeqLensIndex::kPerRequest || p.seq_lens_index == SeqLensIndex::kPerSequence,
          "seq_lens_index is not a SeqLensIndex value");
  REQUIRE(p.qo_layout == QueryLayout::kPacked || p.qo_layout == QueryLayout::kStrided,
          "qo_layout is not a QueryLayout value");
  REQUIRE(!window || p.window_len >= 0, "window_len = " + std::to_string(p.window_len) + " is negative");
  // The causal limit among a step's tokens is a position limit: it needs
  // page ids that are positions, and each sequence's live length.
  REQUIRE(p.q_len == 1 || window || block_table,
          "q_len = " + std::to_string(p.q_len) +
              " needs positions: kPoolPages page ids are not positions, so a "
              "multi-token step's causal limit cannot be applied (use kWindow or kBlockTable addressing)");
  // kE4m3PerHead runs on the 16-row tile, whose causal limit per query row
  // is the bf16/f16 tile's own code; the MLA rows' kernels take one token.
  REQUIRE(p.q_len == 1 || p.kv_format != KvFormat::kE4m3Mla,
          "q_len = " + std::to_string(p.q_len) + " with kv_format " + kv_format_name(p.kv_format) +
              ": the MLA rows take one query token per request (make each token a request, as the DSA layer does)");
  REQUIRE(p.q_len == 1 || !block_table || p.window_lens != nullptr || p.window_len > 0,
          "q_len = " + std::to_string(p.q_len) +
              " with block-table addressing needs each sequence's live length "
              "(window_lens, or window_len > 0) for the causal limit");
  if (p.num_requests == 0) return;
  const bool matrix = p.index_layout == IndexLayout::kMatrix;
  const int64_t sequences = p.num_requests / p.num_kv_heads;
  REQUIRE(matrix || p.indptr != nullptr, "indptr is null");
  if (matrix) {
    REQUIRE(p.index_width >= 0, "index_width = " + std::to_string(p.index_width) + " is negative");
    REQUIRE(p.index_seq_stride >= 0 && p.index_head_stride >= 0,
            "index_seq_stride and index_head_stride must not be negative");
    if (p.index_width > 0) {
      // The last id any request can read, in 64-bit (and long double against overflow).
      const long double last = static_cast<long double>(sequences - 1) * p.index_seq_stride +
                               static_cast<long double>(p.num_kv_heads - 1) * p.index_head_stride + p.index_width;
      REQUIRE(last <= static_cast<long double>(p.num_indices),
              "the index matrix (" + std::to_string(sequences) + " sequence(s) x " + std::to_string(p.num_kv_heads) +
                  " head(s) of index_width " + std::to_string(p.index_width) + ", index_seq_stride " +
                  std::to_string(p.index_seq_stride) + ", index_head_stride " + std::to_string(p.index_head_stride) +
                  ") reaches past num_indices = " + std::to_string(p.num_indices));
    }
  }
  int64_t planned_tokens = 0;
  for (int32_t len : plan.seq_lens) planned_tokens += len;
  if (planned_tokens > 0) {
    REQUIRE(p.indices != nullptr, "indices is null but the plan has " + std::to_string(planned_tokens) + " tokens");
    REQUIRE(window || block_table || p.num_pool_pages >= 1,
            "num_pool_pages = " + std::to_string(p.num_pool_pages) +
                ": a pool-page table needs the pool's page count (or window or block-table addressing)");
  }
  if (block_table) {
    REQUIRE(p.block_table.data != nullptr, "block_table.data is null (block-table addressing)");
    const std::string problem = block_table_problem(p.block_table, sequences);
    REQUIRE(problem.empty(), problem);
  }
  REQUIRE(p.q != nullptr, "q is null");
  REQUIRE(p.o != nullptr, "o is null");
  REQUIRE(p.v.dim == plan.head_dim_v,
          "v.dim = " + std::to_string(p.v.dim) + " but the plan was made for " + std::to_string(plan.head_dim_v));
  const bool has_extra = p.k_extra.data != nullptr;
  REQUIRE(has_extra == (p.q_extra != nullptr), "q_extra and k_extra.data must both be set or both be null");
  if (p.qo_layout == QueryLayout::kStrided) {
    const std::pair<const QueryStrides*, const char*> views[] = {
        {&p.q_strides, "q_strides"}, {&p.q_extra_strides, "q_extra_strides"}, {&p.o_strides, "o_strides"}};
    for (const auto& [s, name] : views) {
      REQUIRE(s->seq_stride >= 0 && s->head_stride >= 0,
              std::string(name) + ".seq_stride and " + name + ".head_stride must not be negative");
      REQUIRE(s->token_stride >= 0, std::string(name) + ".token_stride must not be negative");
    }
    check_output_strides(p.o_strides, sequences, p.q_len, int64_t{p.num_kv_heads} * p.group_size, p.v.dim);
  }
  // Rows the page ids (or windows, or block ids) can reach: each request's
  // window, or the pool's rows, which must stay distinct under the address
  // arithmetic.
  // Window mode with per-sequence lengths reaches up to their bound (a
  // declared capacity may exceed window_len: the context grows on the device).
  const int64_t window_rows = p.window_lens != nullptr ? std::max(p.window_len, window_lens_bound(p)) : p.window_len;
  const long double reach = window ? static_cast<long double>(window_rows)
                            : block_table
                                ? static_cast<long double>(p.block_table.num_blocks) * p.block_table.block_size
                                : static_cast<long double>(p.num_pool_pages) * p.page_size;
  const int64_t rows = static_cast<int64_t>(std::min<long double>(reach, 9.2e18L));
  const size_t esize = dtype_size(p.dtype);
  const bool fp8 = p.kv_format != KvFormat::kNative;
  RowView k = p.k;
  // The MLA rows' scales follow the latent: the row uses 528 bytes.
  if (p.kv_format == KvFormat::kE4m3Mla) k.dim = 528;
  const std::pair<const RowView*, const char*> streams[] = {{&k, "k"}, {&p.v, "v"}, {&p.k_extra, "k_extra"}};
  for (const auto& [stream, name] : streams) {
    if (stream == &p.k_extra && !has_extra) continue;
    const size_t size = fp8 && stream != &p.k_extra ? 1 : esize;  // fp8 K and V: one byte per element
    const std::string problem = row_view_problem(*stream, name, sequences, p.num_kv_heads, rows, size);
    REQUIRE(problem.empty(), problem);
  }
}

}  // namespace sparsepage

#undef REQUIRE
