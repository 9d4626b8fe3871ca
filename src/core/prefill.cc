// Sparse prefill (prefill.h): the checks, the plans and the launches, over
// the fused decode's entry points (core/decode_limits.h) and the small
// kernels of core/prefill_kernels.h. Each chunk shape is planned once; a run
// then only launches, on either backend.
#include "sparsepage/prefill.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "core/cuda_hooks.h"
#include "core/decode_limits.h"
#include "core/prefill_kernels.h"
#include "core/require.h"
#include "cpu/parallel.h"
#include "models/dsa_kernels.h"
#include "sparsepage/models/dsa.h"

#define REQUIRE(ok, ...) SPARSEPAGE_REQUIRE(ok, "", __VA_ARGS__)

namespace sparsepage {
namespace {

using std::to_string;

int32_t machine_width(Device device) {
  if (device == Device::kCuda) return cuda_multiprocessor_count();
  return cpu::hardware_threads();
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/// `causal`: the chunk is each sequence's last num_tokens positions, so
/// every L_b holds them; otherwise (MlaPrefillParams::causal false) the
/// tokens have no positions and an L_b of 0 up is fine.
void check_chunk(const PrefillChunk& c, const std::string& who, bool causal = true) {
  REQUIRE(c.batch >= 1, who + "chunk.batch = " + to_string(c.batch) + " must be at least 1");
  REQUIRE(c.num_tokens >= 1, who + "chunk.num_tokens = " + to_string(c.num_tokens) + " must be at least 1");
  REQUIRE(c.kv_len >= (causal ? c.num_tokens : 0), who + "chunk.kv_len = " + to_string(c.kv_len) +
                                                       " must be at least num_tokens = " + to_string(c.num_tokens) +
                                                       " (the chunk is the last num_tokens positions)");
  REQUIRE(c.kv_len <= std::numeric_limits<int32_t>::max(),
          who + "chunk.kv_len = " + to_string(c.kv_len) + " does not fit int32 positions");
  REQUIRE(int64_t{c.batch} * c.num_tokens <= std::numeric_limits<int32_t>::max(),
          who + "batch * num_tokens = " + to_string(int64_t{c.batch} * c.num_tokens) + " exceeds 2^31 - 1");
}

/// The chunk's L_b on the host (CPU runs): kv_lens, or kv_len for all. Each
/// is checked against the chunk.
std::vector<int64_t> host_lengths(const PrefillChunk& c, const std::string& who, bool causal = true) {
  std::vector<int64_t> lens(static_cast<size_t>(c.batch), c.kv_len);
  if (c.kv_lens != nullptr) {
    const int64_t least = causal ? c.num_tokens : 0;
    for (int32_t b = 0; b < c.batch; ++b) {
      const int64_t len = c.kv_lens[b];
      REQUIRE(len >= least && len <= c.kv_len, who + "chunk.kv_lens[" + to_string(b) + "] = " + to_string(len) +
                                                   " must lie in [" + (causal ? "num_tokens = " : "") +
                                                   to_string(least) + ", kv_len = " + to_string(c.kv_len) + "]");
      lens[static_cast<size_t>(b)] = len;
    }
  }
  return lens;
}

/// Effective [seq, token, head] strides of a packed or strided q-shaped view.
QueryStrides view_strides(QueryLayout layout, const QueryStrides& given, int32_t num_tokens, int32_t heads,
                          int32_t dim) {
  if (layout == QueryLayout::kStrided) return given;
  QueryStrides s;
  s.head_stride = dim;
  s.token_stride = int64_t{heads} * dim;
  s.seq_stride = int64_t{num_tokens} * heads * dim;
  return s;
}

const char* offset_bytes(const void* base, int64_t elements, size_t element_size) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(element_size);
}

/// `view` for sequence b alone: its base moved to the sequence, outer strides 0.
RowView sequence_view(const RowView& view, int64_t b, size_t element_size) {
  RowView v = view;
  v.data = offset_bytes(view.data, b * view.seq_stride, element_size);
  v.seq_stride = 0;
  v.head_stride = 0;
  return v;
}

void check_dtype(DType dtype, Device device, const std::string& who) {
  REQUIRE(dtype == DType::kBF16 || dtype == DType::kF16 || (device == Device::kCpu && dtype == DType::kF32),
          who + "dtype must be bf16 or f16 (or f32 on the CPU), not " + dtype_name(dtype));
}

/// Query blocks must be key blocks: each sequence's chunk starts at a
/// multiple of block_size. Checked wherever the lengths are on the host (no
/// kv_lens, or a CPU run); a CUDA run reads kv_lens on the device and flags
/// a misaligned sequence there.
void check_block_starts(const PrefillChunk& c, int32_t block_size, Device device, const std::string& who) {
  if (c.kv_lens != nullptr && device == Device::kCuda) return;
  const std::vector<int64_t> lens = host_lengths(c, who);
  for (int32_t b = 0; b < c.batch; ++b) {
    const int64_t start = lens[static_cast<size_t>(b)] - c.num_tokens;
    REQUIRE(start % block_size == 0, who + "sequence " + to_string(b) + "'s chunk starts at position " +
                                         to_string(start) +
                                         ", not a multiple of block_size = " + to_string(block_size));
  }
}

/// A prefill over an engine's paged pool (`table` set): the table must
/// address the chunk's sequences by row (sequence b reads row b) and reach
/// every position the host knows of, and the row views are the pool's
/// (no per-sequence stride: the table places each position).
void check_prefill_table(const BlockTable& table, const PrefillChunk& c, std::initializer_list<const RowView*> views,
                         Device device, const std::string& who, bool causal = true) {
  if (table.data == nullptr) return;
  REQUIRE(table.row_of_sequence == nullptr,
          who + "block_table.row_of_sequence must be null: sequence b of a chunk reads table row b");
  const std::string problem = block_table_problem(table, c.batch);
  REQUIRE(problem.empty(), who + problem);
  for (const RowView* v : views) {
    REQUIRE(v->seq_stride == 0, who +
                                    "a view over a block-table pool has seq_stride 0 (the table places each "
                                    "position), not " +
                                    to_string(v->seq_stride));
  }
  if (c.kv_lens != nullptr && device == Device::kCuda) return;  // read on the device: past the table is flagged
  const int64_t reach = int64_t{table.max_blocks} * table.block_size;
  const std::vector<int64_t> lens = host_lengths(c, who, causal);
  for (int32_t b = 0; b < c.batch; ++b) {
    REQUIRE(lens[static_cast<size_t>(b)] <= reach,
            who + "sequence " + to_string(b) + " holds " + to_string(lens[static_cast<size_t>(b)]) +
                " positions, past its block-table row's " + to_string(table.max_blocks) + " blocks of " +
                to_string(table.block_size));
  }
}

/// Each launch sequence's table row over a paged chunk: `per_sequence`
/// entries of b for each sequence b (uploaded once per shape).
Buffer table_row_map(Device device, int32_t batch, int32_t per_sequence) {
  std::vector<int32_t> rows(static_cast<size_t>(batch) * static_cast<size_t>(per_sequence));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(i / static_cast<size_t>(per_sequence));
  return upload(device, rows);
}

/// Moves a decode's rows onto `table` (the engine's pool): positions resolve
/// through it, launch sequence s reading table row rows[s].
void address_by_table(DecodeParams& d, const BlockTable& table, const int32_t* rows) {
  d.addressing = PageAddressing::kBlockTable;
  d.block_table = table;
  d.block_table.row_of_sequence = rows;
}

/// One decode launch of a prefill: its params, plan and workspace.
struct Launch {
  DecodeParams params;
  const DecodePlan* plan;
  void* workspace;
};

/// A prefill's decode launches on the backend's device, in order; returns
/// the last kernel's name ("cpu" on the CPU). The CPU checks every launch
/// before the first one writes, so a refused prefill writes nothing; on
/// CUDA the kernels flag bad entries per request.
const char* run_launches(Device device, const std::vector<Launch>& launches, void* stream, int32_t max_q_len) {
  if (device == Device::kCpu) {
    for (const Launch& l : launches) detail::check_decode_cpu(l.params, *l.plan, l.workspace, max_q_len);
    for (const Launch& l : launches) detail::run_decode_cpu(l.params, *l.plan, l.workspace, max_q_len);
    return "cpu";
  }
  const char* name = "";
  for (const Launch& l : launches) name = detail::run_decode_cuda(l.params, *l.plan, l.workspace, stream, max_q_len);
  return name;
}

/// One small prefill kernel on the backend's device.
template <typename Args>
void launch(Device device, void (*cpu)(const Args&), void (*cuda)(const Args&, void*), const Args& args, void* stream) {
  if (device == Device::kCuda) {
    cuda(args, stream);
  } else {
    cpu(args);
  }
}

// ---- MLA --------------------------------------------------------------------

constexpr int32_t kLatent = 512, kRope = 64;

void check_mla(const MlaPrefillParams& p, Device device) {
  const std::string who = "MlaSparsePrefill: ";
  check_chunk(p.chunk, who, p.causal);
  check_dtype(p.dtype, device, who);
  REQUIRE(device != Device::kCuda || p.dtype == DType::kBF16,
          who + "the MLA kernel reads bf16 queries and rows on CUDA, not " + dtype_name(p.dtype));
  REQUIRE(p.kv_format == KvFormat::kNative || p.kv_format == KvFormat::kE4m3Mla,
          who + "kv_format must be native or e4m3 mla, not " + kv_format_name(p.kv_format));
  REQUIRE(p.num_heads >= 1, who + "num_heads = " + to_string(p.num_heads) + " must be at least 1");
  REQUIRE(p.topk >= 1, who + "topk = " + to_string(p.topk) + " must be at least 1");
  REQUIRE(p.q != nullptr && p.q_rope != nullptr && p.indices != nullptr && p.out != nullptr,
          who + "q, q_rope, indices and out must be set");
  REQUIRE(p.kv.data != nullptr && p.kv_rope.data != nullptr, who + "kv.data and kv_rope.data must be set");
  REQUIRE(p.kv.dim == kLatent && p.kv_rope.dim == kRope, who + "kv.dim = " + to_string(p.kv.dim) +
                                                             " and kv_rope.dim = " + to_string(p.kv_rope.dim) +
                                                             " must be 512 and 64 (the MLA latent and rope)");
  REQUIRE(p.qo_layout == QueryLayout::kPacked || p.qo_layout == QueryLayout::kStrided,
          who + "qo_layout is not a QueryLayout value");
  REQUIRE(p.index_token_stride == 0 || p.index_token_stride >= p.topk,
          who + "index_token_stride = " + to_string(p.index_token_stride) + " is below topk = " + to_string(p.topk));
  REQUIRE(p.index_token_stride >= 0 && p.index_seq_stride >= 0, who + "index strides must not be negative");
  REQUIRE(std::isfinite(p.scale), who + "scale is not finite");
  // Over a block table the capacity is the pool's rows, not positions.
  REQUIRE(p.block_table.data != nullptr || p.chunk.kv_len <= p.kv.capacity,
          who + "chunk.kv_len = " + to_string(p.chunk.kv_len) +
              " positions exceed kv.capacity = " + to_string(p.kv.capacity) + " rows");
  check_prefill_table(p.block_table, p.chunk, {&p.kv, &p.kv_rope}, device, who, p.causal);
  REQUIRE(device == Device::kCpu || p.max_logits == nullptr,
          who + "max_logits is computed by the CPU backend only: the fused MLA kernel's running maximum is lazy "
                "(within 2^8 of the true one), so pass max_logits = null on CUDA");
}

int64_t index_token_stride(const MlaPrefillParams& p) {
  return p.index_token_stride > 0 ? p.index_token_stride : p.topk;
}
int64_t index_seq_stride(const MlaPrefillParams& p) {
  return p.index_seq_stride > 0 ? p.index_seq_stride : int64_t{p.chunk.num_tokens} * index_token_stride(p);
}

/// The fused decode's params for sequence b's tokens: each token a request
/// (one "KV head", its own sequence of the window), its index row read in
/// place (kMatrix, -1 skipped), its window `windows[t]` = pos + 1.
DecodeParams mla_decode_params(const MlaPrefillParams& p, int32_t b, const int32_t* windows, float* lse,
                               const int32_t* table_rows) {
  const int32_t n = p.chunk.num_tokens;
  const size_t esize = dtype_size(p.dtype);
  const size_t kv_size = p.kv_format == KvFormat::kNative ? esize : 1;  // fp8 rows count bytes
  const QueryStrides qs = view_strides(p.qo_layout, p.q_strides, n, p.num_heads, kLatent);
  const QueryStrides rs = view_strides(p.qo_layout, p.q_rope_strides, n, p.num_heads, kRope);
  const QueryStrides os = view_strides(p.qo_layout, p.out_strides, n, p.num_heads, kLatent);
  DecodeParams d;
  d.dtype = p.dtype;
  d.kv_format = p.kv_format;
  d.index_layout = IndexLayout::kMatrix;
  d.indices = p.indices + int64_t{b} * index_seq_stride(p);
  d.index_width = p.topk;
  d.index_seq_stride = index_token_stride(p);
  d.index_head_stride = 0;
  d.num_indices = int64_t{n - 1} * index_token_stride(p) + p.topk;
  d.seq_lens = p.topk_length != nullptr ? p.topk_length + int64_t{b} * n : nullptr;
  d.num_requests = n;
  d.num_kv_heads = 1;
  d.page_size = 1;
  d.addressing = PageAddressing::kWindow;
  d.padding = IndexPadding::kMinusOneSkips;
  d.window_lens = windows + int64_t{b} * n;
  d.window_len = p.chunk.kv_len;
  d.group_size = p.num_heads;
  d.qo_layout = QueryLayout::kStrided;
  d.q = offset_bytes(p.q, b * qs.seq_stride, esize);
  d.q_strides = {qs.token_stride, qs.head_stride, 0};
  d.q_extra = offset_bytes(p.q_rope, b * rs.seq_stride, esize);
  d.q_extra_strides = {rs.token_stride, rs.head_stride, 0};
  d.o = const_cast<char*>(offset_bytes(p.out, b * os.seq_stride, esize));
  d.o_strides = {os.token_stride, os.head_stride, 0};
  d.k = sequence_view(p.kv, b, kv_size);
  d.v = d.k;  // V is the latent: the same rows, read once
  d.k_extra = sequence_view(p.kv_rope, b, esize);
  d.scale = p.scale;
  d.lse = lse != nullptr ? lse + int64_t{b} * n * p.num_heads : nullptr;
  if (p.block_table.data != nullptr) address_by_table(d, p.block_table, table_rows + int64_t{b} * n);
  return d;
}

PlanShape decode_plan_shape(Device device, int32_t dim_qk, int32_t dim_v, int32_t dim_extra, int32_t group,
                            int32_t q_len) {
  PlanShape shape;
  shape.group_size = group * q_len;
  shape.head_dim_v = dim_v;
  shape.num_sms = machine_width(device);
  if (device == Device::kCuda) {
    const CudaLaunchShape launch = cuda_launch_shape(dim_qk, dim_v, dim_extra, group, q_len);
    shape.ctas_per_item = launch.ctas_per_item;
    shape.items_per_sm = launch.ctas_per_sm;
  }
  return shape;
}

}  // namespace

// ---- MlaSparsePrefill -------------------------------------------------------

MlaSparsePrefill::Shape MlaSparsePrefill::shape_of(const MlaPrefillParams& p) {
  Shape s;
  s.batch = p.chunk.batch;
  s.num_tokens = p.chunk.num_tokens;
  s.num_heads = p.num_heads;
  s.topk = p.topk;
  s.kv_format = p.kv_format;
  s.need_lse_scratch = p.lse == nullptr && p.attn_sink != nullptr;
  s.paged = p.block_table.data != nullptr;
  return s;
}

void MlaSparsePrefill::prepare(const MlaPrefillParams& p, void* stream) {
  check_mla(p, device_);
  const Shape s = shape_of(p);
  // The plan: one sequence's tokens as requests of topk entries each (the
  // per-token topk_length is read where the kernel runs), 64 heads per CTA.
  const PlanShape shape = decode_plan_shape(device_, kLatent, kLatent, kRope, p.num_heads, 1);
  plan_ = make_decode_plan(std::vector<int32_t>(static_cast<size_t>(s.num_tokens), s.topk), shape);
  workspace_ = Buffer(device_, std::max<size_t>(plan_.workspace.total, 256));
  if (device_ == Device::kCuda) upload_plan_cuda(plan_, workspace_.data(), stream);
  const size_t tokens = static_cast<size_t>(s.batch) * static_cast<size_t>(s.num_tokens);
  const size_t lse_bytes = s.need_lse_scratch ? tokens * static_cast<size_t>(s.num_heads) * sizeof(float) : 0;
  scratch_ = Buffer(device_, round_up(tokens * sizeof(int32_t), 256) + lse_bytes);
  table_rows_ = s.paged ? table_row_map(device_, s.batch, s.num_tokens) : Buffer();  // each token a launch sequence
  shape_ = s;
  prepared_ = true;
}

void MlaSparsePrefill::run(const MlaPrefillParams& p, void* stream) {
  check_mla(p, device_);
  const Shape s = shape_of(p);
  if (!prepared_ || !(s == shape_)) prepare(p, stream);
  const int32_t n = s.num_tokens;
  const size_t tokens = static_cast<size_t>(s.batch) * static_cast<size_t>(n);
  auto* windows = scratch_.as<int32_t>();
  float* lse = p.lse != nullptr ? p.lse
               : s.need_lse_scratch
                   ? reinterpret_cast<float*>(scratch_.as<char>() + round_up(tokens * sizeof(int32_t), 256))
                   : nullptr;
  const detail::TokenWindowsArgs w{p.chunk, windows, p.causal};
  if (device_ == Device::kCpu) (void)host_lengths(p.chunk, "MlaSparsePrefill: ", p.causal);  // each L_b checked first
  launch(device_, detail::token_windows_cpu, detail::token_windows_cuda, w, stream);
  std::vector<Launch> launches;
  for (int32_t b = 0; b < s.batch; ++b)
    launches.push_back({mla_decode_params(p, b, windows, lse, table_rows_.as<int32_t>()), &plan_, workspace_.data()});
  kernel_name_ = run_launches(device_, launches, stream, kMaxQueryTokens);
  if (lse != nullptr) {
    const QueryStrides os = view_strides(p.qo_layout, p.out_strides, n, p.num_heads, kLatent);
    detail::MlaEpilogueArgs e;
    e.dtype = p.dtype;
    e.batch = s.batch;
    e.num_tokens = n;
    e.num_heads = p.num_heads;
    e.dim = kLatent;
    e.lse_in = lse;
    e.lse_out = p.lse;
    e.sink = p.attn_sink;
    e.out = p.out;
    e.out_seq = os.seq_stride;
    e.out_token = os.token_stride;
    e.out_head = os.head_stride;
    launch(device_, detail::mla_epilogue_cpu, detail::mla_epilogue_cuda, e, stream);
  }
  if (p.max_logits != nullptr) detail::mla_max_logits_cpu(p, windows);  // CPU only (check_mla)
}

void MlaSparsePrefill::check_errors(void* stream) {
  if (device_ != Device::kCuda || !prepared_) return;
  const uint32_t flag = read_decode_error_flag(plan_, workspace_.data(), stream);
  REQUIRE(flag == 0, "MlaSparsePrefill: an index entry named a position outside its token's window (a later "
                     "position, a negative id other than -1, or past the rows): those tokens' out and lse are NaN");
}

// ---- DsaPrefillIndexer ---------------------------------------------------------

namespace {

// An indexer's keys in an engine's paged pool (both prefill indexers): a
// valid pool of `dim`-wide keys in the queries' dtype (or FP8), whose table
// reaches the chunk's kv_len.
void check_paged_keys(const PagedIndexKeys& paged, int32_t dim, DType dtype, int64_t kv_len, const std::string& who) {
  const std::string problem = paged_index_keys_problem(paged, dim);
  REQUIRE(problem.empty(), who + "paged: " + problem);
  REQUIRE(paged.format == IndexKeyFormat::kE4m3 || paged.dtype == dtype,
          who + "paged holds " + dtype_name(paged.dtype) + " keys; the queries are " + dtype_name(dtype));
  REQUIRE(kv_len <= int64_t{paged.max_blocks} * paged.block_size,
          who + "chunk.kv_len = " + to_string(kv_len) + " positions are past the key table's " +
              to_string(paged.max_blocks) + " blocks of " + to_string(paged.block_size));
}

void check_dsa(const DsaPrefillIndexerParams& p, Device device) {
  const std::string who = "DsaPrefillIndexer: ";
  check_chunk(p.chunk, who);
  check_dtype(p.dtype, device, who);
  REQUIRE(p.index_heads >= 1 && p.index_head_dim >= 1 && p.topk >= 1,
          who + "index_heads, index_head_dim and topk must be at least 1");
  REQUIRE(p.q_index != nullptr && p.weights != nullptr && p.positions != nullptr && p.counts != nullptr,
          who + "q_index, weights, positions and counts must be set");
  if (p.key_layout == IndexKeyLayout::kPaged) {
    check_paged_keys(p.paged, p.index_head_dim, p.dtype, p.chunk.kv_len, who);
    return;
  }
  REQUIRE(p.key_layout == IndexKeyLayout::kDense, who + "key_layout is not an IndexKeyLayout value");
  REQUIRE(p.key_column >= 0, who + "key_column = " + to_string(p.key_column) + " is negative");
  REQUIRE(p.k_cache != nullptr, who + "k_cache must be set (dense keys)");
  REQUIRE(p.capacity >= p.chunk.kv_len, who + "capacity = " + to_string(p.capacity) +
                                            " rows per sequence is below "
                                            "chunk.kv_len = " +
                                            to_string(p.chunk.kv_len));
}

/// The decode indexer's key source for sequence b of the chunk: its rows of
/// the dense cache, or its row of the engine's key table.
void set_key_source(DsaIndexerArgs& a, const DsaPrefillIndexerParams& p, int32_t b) {
  a.key_layout = p.key_layout;
  if (p.key_layout == IndexKeyLayout::kPaged) {
    a.paged = p.paged;
    a.paged.block_table = p.paged.block_table + int64_t{b} * p.paged.block_table_stride;
    a.error = p.error;
    return;
  }
  const int64_t row = int64_t{p.key_column} + p.index_head_dim;
  a.k_cache = offset_bytes(p.k_cache, int64_t{b} * p.capacity * row, dtype_size(p.dtype));
  a.capacity = p.capacity;
}

DsaConfig dsa_rule(const DsaPrefillIndexerParams& p) {
  DsaConfig c;
  c.index_heads = p.index_heads;
  c.index_head_dim = p.index_head_dim;
  c.index_topk = p.topk;
  c.latent_dim = p.key_column;  // the decode indexer finds the key latent_dim columns into each row
  return c;
}

/// Tokens per pass: the most the budget holds, shaped so a pass's score grid
/// (four tokens per CTA, one CTA per SM) fills whole waves: a multiple of
/// four times the SM count, or four times a divisor of it (each group of
/// four then split over SMs / divisor CTAs).
int32_t choose_rows_per_pass(size_t budget, const DsaConfig& c, int64_t kv_len, int32_t num_tokens, int32_t sms) {
  const size_t per_row = std::max<size_t>(1, dsa_indexer_workspace_bytes(c, 4, kv_len) / 4);
  const int64_t fit = std::max<int64_t>(4, static_cast<int64_t>(budget / per_row));
  const int64_t wanted = std::min<int64_t>(fit, (int64_t{num_tokens} + 3) / 4 * 4);
  int64_t rows = 4;
  if (wanted >= 4 * int64_t{sms}) {
    rows = wanted / (4 * int64_t{sms}) * 4 * sms;
  } else {
    for (int64_t d = sms; d >= 1; --d) {
      if (sms % d == 0 && 4 * d <= wanted) {
        rows = 4 * d;
        break;
      }
    }
  }
  rows = std::min<int64_t>({rows, num_tokens, 65535});
  return static_cast<int32_t>(std::max<int64_t>(rows, 1));
}

}  // namespace

void DsaPrefillIndexer::prepare(const DsaPrefillIndexerParams& p, void* stream) {
  (void)stream;
  check_dsa(p, device_);
  batch_ = p.chunk.batch;
  num_tokens_ = p.chunk.num_tokens;
  kv_len_ = p.chunk.kv_len;
  heads_ = p.index_heads;
  dim_ = p.index_head_dim;
  topk_ = p.topk;
  if (device_ == Device::kCuda) {
    const DsaConfig c = dsa_rule(p);
    detail::check_dsa_indexer_cuda(c, 4);
    rows_per_pass_ = choose_rows_per_pass(budget_, c, kv_len_, num_tokens_, machine_width(device_));
    workspace_ = Buffer(device_, std::max<size_t>(256, dsa_indexer_workspace_bytes(c, rows_per_pass_, kv_len_)));
    const int32_t passes = (num_tokens_ + rows_per_pass_ - 1) / rows_per_pass_;
    lens_ = Buffer(device_, static_cast<size_t>(batch_) * static_cast<size_t>(passes) * sizeof(int32_t));
  } else {
    rows_per_pass_ = num_tokens_;
  }
  prepared_ = true;
}

void DsaPrefillIndexer::run(const DsaPrefillIndexerParams& p, void* stream) {
  check_dsa(p, device_);
  if (!prepared_ || batch_ != p.chunk.batch || num_tokens_ != p.chunk.num_tokens || kv_len_ != p.chunk.kv_len ||
      heads_ != p.index_heads || dim_ != p.index_head_dim || topk_ != p.topk) {
    prepare(p, stream);
  }
  const DsaConfig c = dsa_rule(p);
  const int32_t n = p.chunk.num_tokens;
  if (device_ == Device::kCpu) {
    detail::dsa_prefill_indexer_cpu(p, host_lengths(p.chunk, "DsaPrefillIndexer: "));
    return;
  }
  const int32_t passes = (n + rows_per_pass_ - 1) / rows_per_pass_;
  const detail::PassLensArgs pl{p.chunk, rows_per_pass_, passes, lens_.as<int32_t>()};
  detail::pass_lens_cuda(pl, stream);
  const size_t esize = dtype_size(p.dtype);
  for (int32_t b = 0; b < p.chunk.batch; ++b) {
    for (int32_t i = 0; i < passes; ++i) {
      const int32_t t0 = i * rows_per_pass_;
      const int32_t rows = std::min(rows_per_pass_, n - t0);
      const int64_t first = int64_t{b} * n + t0;  // the pass's first (sequence, token) row
      DsaIndexerArgs a;
      a.dtype = p.dtype;
      set_key_source(a, p, b);
      a.kv_lens = lens_.as<int32_t>() + int64_t{b} * passes + i;
      a.max_kv_len = p.chunk.kv_len - n + t0 + rows;  // the host bound of this pass's window end
      a.q_index = offset_bytes(p.q_index, first * p.index_heads * p.index_head_dim, esize);
      a.weights = p.weights + first * p.index_heads;
      a.workspace = workspace_.data();
      a.workspace_bytes = workspace_.bytes();
      a.positions = p.positions + first * p.topk;
      a.counts = p.counts + first;
      a.q_len = rows;
      detail::dsa_select_tokens_cuda(c, 1, a, 65535, stream);
    }
  }
}

// ---- GqaBlockPrefill --------------------------------------------------------

namespace {

int32_t query_blocks(int32_t num_tokens, int32_t block_size) { return (num_tokens + block_size - 1) / block_size; }

/// The decode's view of a prefill's streams and KV format, for its checks.
DecodeParams gqa_stream_fields(const GqaPrefillParams& p) {
  DecodeParams d;
  d.dtype = p.dtype;
  d.kv_format = p.kv_format;
  d.k_scale = p.k_scale;
  d.v_scale = p.v_scale;
  d.q = p.q;
  d.o = p.o;
  d.k = p.k;
  d.v = p.v;
  return d;
}

/// The KV format by the decode's own checks: a KvFormat value with its
/// scales (kv_format_problem), not the MLA rows' format, and on CUDA a
/// layout the FP8 kernel reads (cuda_layout_problem: head dim 128, 16-byte
/// pieces), refused before anything runs rather than at a later launch.
void check_gqa_kv_format(const GqaPrefillParams& p, Device device, const std::string& who) {
  REQUIRE(p.kv_format != KvFormat::kE4m3Mla,
          who + "kv_format e4m3 mla is the MLA rows' format (MlaSparsePrefill reads it); GqaBlockPrefill takes "
                "native or e4m3 per head");
  const DecodeParams fields = gqa_stream_fields(p);
  const std::string format = kv_format_problem(fields);
  REQUIRE(format.empty(), who + format);
  if (device == Device::kCuda && p.kv_format != KvFormat::kNative) {
    const std::string layout = cuda_layout_problem(fields);
    REQUIRE(layout.empty(), who + layout);
  }
}

void check_gqa(const GqaPrefillParams& p, Device device) {
  const std::string who = "GqaBlockPrefill: ";
  check_chunk(p.chunk, who);
  check_dtype(p.dtype, device, who);
  REQUIRE(p.num_kv_heads >= 1 && p.num_qo_heads >= 1 && p.num_qo_heads % p.num_kv_heads == 0,
          who + "num_qo_heads = " + to_string(p.num_qo_heads) +
              " must be a positive multiple of num_kv_heads = " + to_string(p.num_kv_heads));
  REQUIRE(p.block_size >= 1 && p.block_size <= detail::kMaxQueryBlockTokens,
          who + "block_size = " + to_string(p.block_size) + " must lie in [1, " +
              to_string(detail::kMaxQueryBlockTokens) + "] (a query block is one request of the fused decode)");
  REQUIRE(p.q != nullptr && p.o != nullptr && p.k.data != nullptr && p.v.data != nullptr,
          who + "q, o, k.data and v.data must be set");
  REQUIRE(p.selection.block_ids != nullptr && p.selection.counts != nullptr,
          who + "selection.block_ids and selection.counts must be set");
  REQUIRE(p.selection.width >= 1, who + "selection.width = " + to_string(p.selection.width) + " must be at least 1");
  REQUIRE(int64_t{p.selection.width} * p.block_size <= std::numeric_limits<int32_t>::max() / 2,
          who + "selection.width * block_size must stay below 2^30 positions");
  REQUIRE(p.selection.layout == BlockSelectionLayout::kPerKvHead ||
              p.selection.layout == BlockSelectionLayout::kPerQueryHead,
          who + "selection.layout is not a BlockSelectionLayout value");
  REQUIRE(std::isfinite(p.scale), who + "scale is not finite");
  check_gqa_kv_format(p, device, who);
  check_block_starts(p.chunk, p.block_size, device, who);
  check_prefill_table(p.block_table, p.chunk, {&p.k, &p.v}, device, who);
}

/// How many (sequence-local) lists one launch of part `full` covers, and
/// its query heads per request: per KV head, a list serves group_size heads;
/// per query head, one.
struct LaunchGeometry {
  int32_t lists_per_block;  // requests per query block in one launch
  int32_t group;            // query heads per request
  int32_t launches_per_sequence;
};

LaunchGeometry geometry(const GqaPrefillParams& p) {
  const int32_t g = p.num_qo_heads / p.num_kv_heads;
  if (p.selection.layout == BlockSelectionLayout::kPerKvHead) return {p.num_kv_heads, g, 1};
  return {g, 1, p.num_kv_heads};
}

/// Where GqaBlockPrefill's scratch keeps each thing (bytes): the query
/// blocks' windows, the alignment flag, the staged lse of per-query-head
/// lists, the expanded FP8 scales of per-query-head lists.
struct GqaScratch {
  size_t flag = 0, lse = 0, scales = 0, total = 0;
};

GqaScratch gqa_scratch(int32_t batch, int32_t num_tokens, int32_t block_size, int32_t num_qo_heads,
                       BlockSelectionLayout layout, bool lse, bool fp8) {
  const bool per_query_head = layout == BlockSelectionLayout::kPerQueryHead;
  GqaScratch s;
  s.flag = round_up(
      static_cast<size_t>(batch) * static_cast<size_t>(query_blocks(num_tokens, block_size)) * sizeof(int32_t), 256);
  s.lse = s.flag + 256;
  const size_t lse_bytes = lse && per_query_head ? static_cast<size_t>(batch) * static_cast<size_t>(num_tokens) *
                                                       static_cast<size_t>(num_qo_heads) * sizeof(float)
                                                 : 0;
  s.scales = s.lse + round_up(lse_bytes, 256);
  const size_t scale_bytes = fp8 && per_query_head ? 2 * static_cast<size_t>(num_qo_heads) * sizeof(float) : 0;
  s.total = s.scales + scale_bytes;
  return s;
}

}  // namespace

size_t GqaBlockPrefill::workspace_bytes() const {
  size_t total = scratch_.bytes();
  for (const Part& part : parts_) total += part.workspace.bytes() + part.indptr.bytes();
  return total;
}

GqaBlockPrefill::Shape GqaBlockPrefill::shape_of(const GqaPrefillParams& p) {
  Shape s;
  s.batch = p.chunk.batch;
  s.num_tokens = p.chunk.num_tokens;
  s.num_qo_heads = p.num_qo_heads;
  s.num_kv_heads = p.num_kv_heads;
  s.block_size = p.block_size;
  s.width = p.selection.width;
  s.dim_qk = p.k.dim;
  s.dim_v = p.v.dim;
  s.layout = p.selection.layout;
  s.kv_format = p.kv_format;
  s.lse = p.lse != nullptr;
  s.paged = p.block_table.data != nullptr;
  return s;
}

void GqaBlockPrefill::prepare(const GqaPrefillParams& p, void* stream) {
  check_gqa(p, device_);
  const Shape s = shape_of(p);
  const LaunchGeometry geo = geometry(p);
  const int32_t full = s.num_tokens / s.block_size, tail = s.num_tokens % s.block_size;
  parts_[0].query_blocks = full;
  parts_[0].tokens = s.block_size;
  parts_[1].query_blocks = tail > 0 ? 1 : 0;
  parts_[1].tokens = tail;
  for (Part& part : parts_) {
    part.plan = DecodePlan{};
    part.workspace = Buffer();
    part.indptr = Buffer();
    if (part.query_blocks == 0) continue;
    const int32_t requests = part.query_blocks * geo.lists_per_block;
    // Planned for the lists' bound; the counts the selection writes are read
    // where the kernel runs (an early query block keeps few blocks).
    // Over a block table every query row runs on the 16-row tiles (the
    // 64-row CTAs read the library's own tables only): plan for those.
    const bool row_tiles = s.paged;
    const PlanShape shape = row_tiles ? decode_plan_shape(device_, s.dim_qk, s.dim_v, 0, geo.group * part.tokens, 1)
                                      : decode_plan_shape(device_, s.dim_qk, s.dim_v, 0, geo.group, part.tokens);
    part.plan = make_decode_plan(std::vector<int32_t>(static_cast<size_t>(requests), s.width * s.block_size), shape);
    part.workspace = Buffer(device_, std::max<size_t>(part.plan.workspace.total, 256));
    if (device_ == Device::kCuda) upload_plan_cuda(part.plan, part.workspace.data(), stream);
    std::vector<int32_t> indptr(static_cast<size_t>(requests) + 1);
    for (size_t r = 0; r < indptr.size(); ++r) indptr[r] = static_cast<int32_t>(r) * s.width;
    part.indptr = upload(device_, indptr);
  }
  const GqaScratch layout = gqa_scratch(s.batch, s.num_tokens, s.block_size, s.num_qo_heads, s.layout, s.lse,
                                        s.kv_format != KvFormat::kNative);
  scratch_ = Buffer(device_, layout.total);
  fill_bytes(scratch_.data(), device_, 0, scratch_.bytes());  // the alignment flag starts clear
  // Each query block is a launch sequence (per KV head and per query head alike).
  table_rows_ = s.paged ? table_row_map(device_, s.batch, query_blocks(s.num_tokens, s.block_size)) : Buffer();
  shape_ = s;
  prepared_ = true;
}

void GqaBlockPrefill::run(const GqaPrefillParams& p, void* stream) {
  check_gqa(p, device_);
  const Shape s = shape_of(p);
  if (!prepared_ || !(s == shape_)) prepare(p, stream);
  const int32_t n = s.num_tokens, bs = s.block_size, nqb = query_blocks(n, bs);
  const int32_t hq = s.num_qo_heads, hkv = s.num_kv_heads, g = hq / hkv;
  const size_t esize = dtype_size(p.dtype);
  const bool fp8 = s.kv_format != KvFormat::kNative;
  const size_t kv_size = fp8 ? 1 : esize;  // FP8 rows count bytes
  const GqaScratch layout = gqa_scratch(s.batch, n, bs, hq, s.layout, s.lse, fp8);
  auto* windows = scratch_.as<int32_t>();
  auto* bad_chunk = reinterpret_cast<uint32_t*>(scratch_.as<char>() + layout.flag);
  float* staged_lse = reinterpret_cast<float*>(scratch_.as<char>() + layout.lse);
  float* scales = reinterpret_cast<float*>(scratch_.as<char>() + layout.scales);
  const detail::BlockWindowsArgs w{p.chunk, bs, windows, bad_chunk};
  launch(device_, detail::block_windows_cpu, detail::block_windows_cuda, w, stream);
  const bool per_kv = s.layout == BlockSelectionLayout::kPerKvHead;
  if (fp8 && !per_kv) {
    const detail::ScaleExpandArgs e{hkv, g, p.k_scale, p.v_scale, scales};
    launch(device_, detail::scale_expand_cpu, detail::scale_expand_cuda, e, stream);
  }
  const int64_t width = s.width;
  std::vector<Launch> launches;
  for (int32_t b = 0; b < s.batch; ++b) {
    for (int32_t kv = 0; kv < (per_kv ? 1 : hkv); ++kv) {
      for (int part_index = 0; part_index < 2; ++part_index) {
        Part& part = parts_[part_index];
        if (part.query_blocks == 0) continue;
        const int32_t qb0 = part_index == 0 ? 0 : n / bs;  // the part's first query block
        const int64_t t0 = int64_t{qb0} * bs;              // and first token
        DecodeParams d;
        d.dtype = p.dtype;
        d.kv_format = p.kv_format;
        d.index_layout = IndexLayout::kCsr;
        d.indptr = part.indptr.as<int32_t>();
        d.page_size = bs;
        d.addressing = PageAddressing::kWindow;
        d.window_len = p.chunk.kv_len;
        d.window_lens = windows + int64_t{b} * nqb + qb0;
        d.q_len = part.tokens;
        d.scale = p.scale;
        const int64_t q_tok = int64_t{hq} * p.k.dim, o_tok = int64_t{hq} * p.v.dim;
        const int64_t q_base = (int64_t{b} * n + t0) * q_tok, o_base = (int64_t{b} * n + t0) * o_tok;
        if (per_kv) {
          // Requests (query block, KV head): q [blocks, tokens, hq, d] packed is the chunk's [tokens, hq, d].
          const int64_t lists = int64_t{b} * nqb * hkv + int64_t{qb0} * hkv;
          d.indices = p.selection.block_ids + lists * width;
          d.seq_lens = p.selection.counts + lists;
          d.num_requests = part.query_blocks * hkv;
          d.num_indices = int64_t{d.num_requests} * width;
          d.num_kv_heads = hkv;
          d.group_size = g;
          d.q = offset_bytes(p.q, q_base, esize);
          d.o = const_cast<char*>(offset_bytes(p.o, o_base, esize));
          d.lse = p.lse != nullptr ? p.lse + (int64_t{b} * n + t0) * hq : nullptr;
          d.k = p.k;
          d.v = p.v;
          d.k.data = offset_bytes(p.k.data, int64_t{b} * p.k.seq_stride, kv_size);
          d.v.data = offset_bytes(p.v.data, int64_t{b} * p.v.seq_stride, kv_size);
          d.k.seq_stride = d.v.seq_stride = 0;  // every query block reads the sequence's rows
          d.k_scale = p.k_scale;                // request (query block, KV head h) reads scale h
          d.v_scale = p.v_scale;
        } else {
          // Requests (query block, query head of KV head kv), G = 1 over the KV head's rows.
          const int64_t lists = (int64_t{b} * hkv + kv) * nqb * g + int64_t{qb0} * g;
          d.indices = p.selection.block_ids + lists * width;
          d.seq_lens = p.selection.counts + lists;
          d.num_requests = part.query_blocks * g;
          d.num_indices = int64_t{d.num_requests} * width;
          d.num_kv_heads = g;
          d.group_size = 1;
          d.qo_layout = QueryLayout::kStrided;
          d.q = offset_bytes(p.q, q_base + int64_t{kv} * g * p.k.dim, esize);
          d.q_strides = {int64_t{bs} * q_tok, p.k.dim, q_tok};
          d.o = const_cast<char*>(offset_bytes(p.o, o_base + int64_t{kv} * g * p.v.dim, esize));
          d.o_strides = {int64_t{bs} * o_tok, p.v.dim, o_tok};
          // Staged [batch, hkv, tokens, g]: the launch's packed [blocks, tokens, g, 1].
          d.lse = p.lse != nullptr ? staged_lse + ((int64_t{b} * hkv + kv) * n + t0) * g : nullptr;
          d.k = sequence_view(p.k, b, kv_size);
          d.v = sequence_view(p.v, b, kv_size);
          d.k.data = offset_bytes(d.k.data, int64_t{kv} * p.k.head_stride, kv_size);
          d.v.data = offset_bytes(d.v.data, int64_t{kv} * p.v.head_stride, kv_size);
          if (fp8) {
            // Request (query block, query head j) reads scale j: KV head kv's, expanded g times.
            d.k_scale = scales + int64_t{kv} * g;
            d.v_scale = scales + (int64_t{hkv} + kv) * g;
          }
        }
        if (s.paged) address_by_table(d, p.block_table, table_rows_.as<int32_t>() + int64_t{b} * nqb + qb0);
        launches.push_back({d, &part.plan, part.workspace.data()});
      }
    }
  }
  kernel_name_ = run_launches(device_, launches, stream, detail::kMaxQueryBlockTokens);
  if (!per_kv && p.lse != nullptr) {
    const detail::LseGatherArgs l{s.batch, hkv, n, g, staged_lse, p.lse};
    launch(device_, detail::lse_gather_cpu, detail::lse_gather_cuda, l, stream);
  }
}

void GqaBlockPrefill::check_errors(void* stream) {
  if (device_ != Device::kCuda || !prepared_) return;
  uint32_t flags = 0;
  for (Part& part : parts_) {
    if (part.query_blocks > 0) flags |= read_decode_error_flag(part.plan, part.workspace.data(), stream);
  }
  const size_t flag = gqa_scratch(shape_.batch, shape_.num_tokens, shape_.block_size, shape_.num_qo_heads,
                                  shape_.layout, shape_.lse, shape_.kv_format != KvFormat::kNative)
                          .flag;
  const auto bad = download<uint32_t>(device_, scratch_.as<char>() + flag, 1);
  fill_bytes(scratch_.as<char>() + flag, device_, 0, sizeof(uint32_t));
  REQUIRE(bad[0] == 0, "GqaBlockPrefill: a chunk did not start at a multiple of block_size (or its kv_lens entry "
                       "was below num_tokens): its tokens' o and lse are NaN");
  REQUIRE(flags == 0, "GqaBlockPrefill: a selected block named positions at or past its query block's end: those "
                      "query blocks' o and lse are NaN");
}

// ---- BlockPrefillIndexer ------------------------------------------------------

namespace {

void check_block_indexer(const BlockPrefillIndexerParams& p, Device device) {
  const std::string who = "BlockPrefillIndexer: ";
  check_chunk(p.chunk, who);
  check_dtype(p.dtype, device, who);
  REQUIRE(p.num_kv_heads >= 1 && p.head_dim >= 1 && p.block_size >= 1,
          who + "num_kv_heads, head_dim and block_size must be at least 1");
  REQUIRE(p.local_blocks >= 1 && p.top_blocks >= p.local_blocks - 1,
          who +
              "need local_blocks >= 1 and top_blocks >= local_blocks - 1 (forced blocks must fit the top-k); got "
              "local_blocks = " +
              to_string(p.local_blocks) + ", top_blocks = " + to_string(p.top_blocks));
  REQUIRE(p.q_index != nullptr && p.block_ids != nullptr && p.counts != nullptr,
          who + "q_index, block_ids and counts must be set");
  if (p.key_layout == IndexKeyLayout::kPaged) {
    check_paged_keys(p.paged, p.head_dim, p.dtype, p.chunk.kv_len, who);
  } else {
    REQUIRE(p.key_layout == IndexKeyLayout::kDense, who + "key_layout is not an IndexKeyLayout value");
    REQUIRE(p.index_keys.data != nullptr, who + "index_keys.data must be set (dense keys)");
    REQUIRE(p.index_keys.dim == p.head_dim, who + "index_keys.dim = " + to_string(p.index_keys.dim) +
                                                " must equal head_dim = " + to_string(p.head_dim));
    // A known capacity, 0 included (an empty view), bounds the positions read.
    REQUIRE(p.chunk.kv_len <= p.index_keys.capacity,
            who + "chunk.kv_len = " + to_string(p.chunk.kv_len) +
                " exceeds index_keys.capacity = " + to_string(p.index_keys.capacity));
  }
  if (device == Device::kCuda) {
    REQUIRE(p.head_dim == 128, who + "head_dim = " + to_string(p.head_dim) +
                                   ": the CUDA block scores run at index dim 128 (the CPU backend takes any)");
    REQUIRE(p.block_size == 64 || p.block_size == 128,
            who + "block_size = " + to_string(p.block_size) +
                ": the CUDA block scores run 64- or 128-token blocks (the CPU backend takes any)");
  }
  check_block_starts(p.chunk, p.block_size, device, who);
}

int32_t key_blocks(int64_t kv_len, int32_t block_size) {
  return static_cast<int32_t>((kv_len + block_size - 1) / block_size);
}

}  // namespace

void BlockPrefillIndexer::prepare(const BlockPrefillIndexerParams& p, void* stream) {
  (void)stream;
  check_block_indexer(p, device_);
  batch_ = p.chunk.batch;
  num_tokens_ = p.chunk.num_tokens;
  heads_ = p.num_kv_heads;
  block_size_ = p.block_size;
  kv_len_ = p.chunk.kv_len;
  const size_t lists = static_cast<size_t>(batch_) * static_cast<size_t>(query_blocks(num_tokens_, block_size_)) *
                       static_cast<size_t>(heads_);
  scores_ = Buffer(device_, std::max<size_t>(256, lists * static_cast<size_t>(key_blocks(kv_len_, block_size_)) * 4));
  prepared_ = true;
}

void BlockPrefillIndexer::run(const BlockPrefillIndexerParams& p, void* stream) {
  check_block_indexer(p, device_);
  if (!prepared_ || batch_ != p.chunk.batch || num_tokens_ != p.chunk.num_tokens || heads_ != p.num_kv_heads ||
      block_size_ != p.block_size || kv_len_ != p.chunk.kv_len) {
    prepare(p, stream);
  }
  detail::BlockScoresArgs sa;
  sa.dtype = p.dtype;
  sa.chunk = p.chunk;
  sa.num_kv_heads = p.num_kv_heads;
  sa.head_dim = p.head_dim;
  sa.block_size = p.block_size;
  sa.local_blocks = p.local_blocks;
  sa.keys = p.index_keys;
  sa.q_index = p.q_index;
  sa.key_blocks = key_blocks(p.chunk.kv_len, p.block_size);
  sa.scores = scores_.as<float>();
  detail::BlockSelectArgs se;
  se.chunk = p.chunk;
  se.num_kv_heads = p.num_kv_heads;
  se.block_size = p.block_size;
  se.top_blocks = p.top_blocks;
  se.local_blocks = p.local_blocks;
  se.key_blocks = sa.key_blocks;
  se.scores = scores_.as<float>();
  se.block_ids = p.block_ids;
  se.counts = p.counts;
  if (p.key_layout == IndexKeyLayout::kPaged && device_ == Device::kCpu) {
    detail::block_scores_cpu(sa, &p.paged);
  } else if (p.key_layout == IndexKeyLayout::kPaged) {
    detail::PagedScoresArgs pa;
    static_cast<detail::BlockScoresArgs&>(pa) = sa;
    pa.paged = detail::paged_keys_view(p.paged, p.head_dim);
    pa.fp8 = p.paged.format == IndexKeyFormat::kE4m3;
    pa.error = p.error;
    se.refuse_nan = true;  // the lists that needed a refused key block select nothing
    detail::block_scores_paged_cuda(pa, stream);
  } else {
    launch(
        device_, +[](const detail::BlockScoresArgs& a) { detail::block_scores_cpu(a); }, detail::block_scores_cuda, sa,
        stream);
  }
  launch(device_, detail::block_select_cpu, detail::block_select_cuda, se, stream);
}

// ---- the static pattern -------------------------------------------------------

namespace {

detail::StaticBlocksArgs static_args(const StaticPrefillParams& p) {
  detail::StaticBlocksArgs a;
  a.chunk = p.chunk;
  a.num_qo_heads = p.num_qo_heads;
  a.num_kv_heads = p.num_kv_heads;
  a.block_size = p.block_size;
  a.local_blocks = p.local_blocks;
  a.vert_stride = p.vert_stride;
  a.head_sliding_step = std::max(1, p.vert_stride / std::max(1, p.num_qo_heads));
  a.width = p.width;
  a.block_ids = p.block_ids;
  a.counts = p.counts;
  return a;
}

void check_static(const StaticPrefillParams& p, bool need_outputs) {
  const std::string who = "static_prefill_blocks: ";
  check_chunk(p.chunk, who);
  REQUIRE(p.num_kv_heads >= 1 && p.num_qo_heads >= 1 && p.num_qo_heads % p.num_kv_heads == 0,
          who + "num_qo_heads = " + to_string(p.num_qo_heads) +
              " must be a positive multiple of num_kv_heads = " + to_string(p.num_kv_heads));
  REQUIRE(p.block_size >= 1 && p.local_blocks >= 1 && p.vert_stride >= 1,
          who + "block_size, local_blocks and vert_stride must be at least 1");
  if (need_outputs) {
    REQUIRE(p.width >= 1, who + "width = " + to_string(p.width) + " must be at least 1");
    REQUIRE(p.block_ids != nullptr && p.counts != nullptr, who + "block_ids and counts must be set");
  }
}

}  // namespace

int32_t static_prefill_width(const StaticPrefillParams& p, int64_t kv_len) {
  check_static(p, false);
  // The kept count never shrinks as the query block moves on (each residue
  // class gains a block per vert_stride blocks, the local run stays), so the
  // last block's count at kv_len bounds every block's, for every head.
  const int64_t blocks = (kv_len + p.block_size - 1) / p.block_size;
  const int64_t local = std::min<int64_t>(blocks, p.local_blocks);
  const int64_t below = blocks - local;  // blocks under the local run
  return static_cast<int32_t>(local + (below + p.vert_stride - 1) / p.vert_stride);
}

void static_prefill_blocks(Device device, const StaticPrefillParams& p, void* stream) {
  check_static(p, true);
  const detail::StaticBlocksArgs a = static_args(p);
  if (device == Device::kCpu) (void)host_lengths(p.chunk, "static_prefill_blocks: ");
  launch(device, detail::static_blocks_cpu, detail::static_blocks_cuda, a, stream);
}

// ---- attended sets (tests) ------------------------------------------------------

std::vector<std::vector<int32_t>> gqa_prefill_attended(const GqaPrefillParams& p) {
  check_chunk(p.chunk, "gqa_prefill_attended: ");
  const std::vector<int64_t> lens = host_lengths(p.chunk, "gqa_prefill_attended: ");
  const int32_t n = p.chunk.num_tokens, bs = p.block_size, nqb = query_blocks(n, bs);
  const int32_t hq = p.num_qo_heads, hkv = p.num_kv_heads, g = hq / hkv;
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(p.chunk.batch) * n * hq);
  for (int32_t b = 0; b < p.chunk.batch; ++b) {
    for (int32_t t = 0; t < n; ++t) {
      const int64_t pos = lens[static_cast<size_t>(b)] - n + t;
      const int32_t qb = t / bs;
      for (int32_t h = 0; h < hq; ++h) {
        const int32_t kv = h / g;
        const int64_t list = p.selection.layout == BlockSelectionLayout::kPerKvHead
                                 ? (int64_t{b} * nqb + qb) * hkv + kv
                                 : ((int64_t{b} * hkv + kv) * nqb + qb) * g + h % g;
        const int32_t* ids = p.selection.block_ids + list * p.selection.width;
        const int64_t count = p.selection.counts[list];
        auto& kept = out[static_cast<size_t>((int64_t{b} * n + t) * hq + h)];
        for (int64_t i = 0; i < count; ++i) {
          const int64_t position = int64_t{ids[i / bs]} * bs + i % bs;
          if (position <= pos) kept.push_back(static_cast<int32_t>(position));
        }
        std::sort(kept.begin(), kept.end());
        kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
      }
    }
  }
  return out;
}

}  // namespace sparsepage

#undef REQUIRE
