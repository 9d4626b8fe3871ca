// Bindings of the layer skeleton (once: the batch, the cache, inspection)
// and of each model's config and step forms (block-sparse, DSA, static
// pattern), plus the host indexers. A step's tensors are checked against
// the layer's shapes before anything changes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <vector>

#include "sparsepage/fp8.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/layer.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"
#include "sparsepage/prefill.h"
#include "tensor.h"

namespace sparsepage::py {
namespace {

// A data argument: on the layer's device, in the layer's dtype.
void require_layer_data(const Tensor& t, Device device, DType dtype) {
  t.require_device(device, "the layer");
  if (t.float_dtype() != dtype)
    t.fail(std::string("has dtype ") + dtype_name(t.float_dtype()) + " but the layer stores " + dtype_name(dtype));
}

// A paged pool's blocks back to back: [num_blocks, block_size, ...] with
// each block's rows one after another (rows collapse over (block, slot)).
void require_whole_blocks(const Tensor& t) {
  if (t.shape[0] > 1 && t.strides[0] != t.shape[1] * t.strides[1])
    t.fail("must hold each block's rows one after another (stride of dim 0 = block_size * stride of dim 1)");
}

// The step arguments of one call `op` on layer `l`: each on the layer's
// device, in its dtype, contiguous, of `shape`; out() checks the output o.
struct StepArgs {
  StepArgs(const SparseLayer& l, std::string call) : op(std::move(call)), device(l.device()), dtype(l.dtype()) {}
  const void* in(const In& a, const char* name, std::initializer_list<int64_t> shape, const char* layout) const {
    Tensor t = describe(a, op, name);
    require_layer_data(t, device, dtype);
    t.require_shape(shape, layout);
    t.require_contiguous();
    return t.data;
  }
  void* out(const Out& o, std::initializer_list<int64_t> shape, const char* layout) const {
    return const_cast<void*>(in(In(o), "o", shape, layout));
  }
  std::string op;
  Device device;
  DType dtype;
};

// The fp32 index weights of a step: on the layer's device, contiguous, of `shape`.
const float* weights_arg(const std::string& op, const In& a, Device device, std::initializer_list<int64_t> shape,
                         const char* layout) {
  const Tensor w = describe(a, op, "index_weights");
  w.require_device(device, "the layer");
  w.require_float32_array(shape, layout);
  return static_cast<const float*>(w.data);
}

// A multi-token step's q_len: dim 1 of its query tensor `name` ([batch, q_len, heads, dim]).
int32_t step_q_len(const std::string& op, const In& q, const char* name, const char* layout) {
  const Tensor t = describe(q, op, name);
  t.require_ndim(4, layout);
  return to_int32(t.shape[1], op, std::string("q_len (") + name + ".shape[1])");
}

std::vector<float> host_floats(const std::string& op, const In& a, const char* name,
                               std::initializer_list<int64_t> shape, const char* layout) {
  const Tensor t = describe(a, op, name);
  if (t.device != Device::kCpu) t.fail("must be a host array");
  t.require_float32_array(shape, layout);
  const float* p = static_cast<const float*>(t.data);
  return std::vector<float>(p, p + t.numel());
}

using Rows = std::vector<std::vector<int32_t>>;

// An engine's paged pool `[num_blocks, block_size, heads, dim]` (heads = 0:
// `[num_blocks, block_size, width]`, an MLA pool) on the layer's device, in
// its dtype: rows are (block, slot) pairs collapsed, which needs whole
// blocks `block_size` rows apart, and the last dim of unit stride. Returns
// the first `dim` columns of each head's rows; `block_size` receives the
// pool's block size.
RowView engine_pool(const std::string& op, const In& a, const char* name, Device device, DType dtype, int64_t heads,
                    int64_t width, int32_t dim, const char* layout, int32_t* block_size) {
  Tensor t = describe(a, op, name);
  require_layer_data(t, device, dtype);
  t.require_ndim(heads > 0 ? 4 : 3, layout);
  const int last = t.ndim() - 1;
  if (heads > 0 && t.shape[2] != heads)
    t.fail("has " + std::to_string(t.shape[2]) + " heads; the layer has " + std::to_string(heads) + " " + layout);
  if (t.shape[last] != width)
    t.fail("rows are " + std::to_string(t.shape[last]) + " wide, expected " + std::to_string(width) + " " + layout);
  t.require_unit_stride_last();
  if (t.shape[1] < 1) t.fail("has blocks of " + std::to_string(t.shape[1]) + " rows; a block holds at least one");
  require_whole_blocks(t);
  RowView v;
  v.data = t.data;
  v.row_stride = t.strides[1];
  v.dim = dim;
  v.head_stride = heads > 1 ? t.strides[2] : 0;
  v.capacity = t.shape[0] * t.shape[1];
  *block_size = t.extent_int32(1, "block size");
  return v;
}

// A block table: int32 [batch, max_blocks] on the layer's device, unit stride in its last dim.
BlockTable table_arg(const std::string& op, const In& a, const char* name, Device device, int32_t batch) {
  const Tensor t = describe(a, op, name);
  t.require_device(device, "the layer");
  BlockTable b = block_table_of(t, "[batch, max_blocks]");
  if (t.shape[0] != batch)
    t.fail("has " + std::to_string(t.shape[0]) + " rows; the layer's batch is " + std::to_string(batch));
  return b;
}

// The engine's block table of its attention pool.
BlockTable engine_table(const std::string& op, const In& a, Device device, int32_t batch, int32_t block_size,
                        int64_t num_blocks) {
  BlockTable b = table_arg(op, a, "block_table", device, batch);
  b.block_size = block_size;
  b.num_blocks = num_blocks;
  return b;
}

// The stream a CUDA call runs on when the caller names none: torch's current
// stream when torch is loaded (as torch's own ops do), else the default stream.
void* torch_current_stream() {
  nb::dict modules = nb::borrow<nb::dict>(nb::module_::import_("sys").attr("modules"));
  if (!modules.contains("torch")) return nullptr;
  nb::object cuda = nb::module_::import_("torch").attr("cuda");
  return stream_ptr(nb::cast<uintptr_t>(cuda.attr("current_stream")().attr("cuda_stream")));
}

// The stream a step runs on: the caller's, or (None) torch_current_stream().
void* step_stream(const std::optional<uintptr_t>& stream, const SparseLayer& layer) {
  if (stream) return stream_ptr(*stream);
  return layer.device() == Device::kCuda ? torch_current_stream() : nullptr;
}

// A prompt's rows in the layer's cache layout: [rows, cache heads, tokens,
// dim] (rows = batch for append_tokens, absent for one slot's admit). `v`
// is None for a key-only cache (an engine-paged layer's index keys).
struct PromptRows {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t tokens = 0;
};
PromptRows prompt_rows(const SparseLayer& layer, const std::string& op, const In& k, const std::optional<In>& v,
                       bool one_slot) {
  const DenseKVCache& c = layer.cache();
  const Tensor kt = describe(k, op, "k");
  const int lead = one_slot ? 0 : 1;
  kt.require_ndim(3 + lead, one_slot ? "[cache K heads, tokens, dim]" : "[batch, cache K heads, tokens, dim]");
  const int64_t n = kt.shape[static_cast<size_t>(1 + lead)];
  PromptRows rows;
  rows.tokens = n;
  const std::string k_layout = std::string(one_slot ? "[" : "[batch, ") + std::to_string(c.k_heads()) + ", tokens, " +
                               std::to_string(c.k_head_dim()) + "] (the layer's cache K rows)";
  const StepArgs a(layer, op);
  rows.k = a.in(k, "k",
                one_slot ? std::initializer_list<int64_t>{c.k_heads(), n, c.k_head_dim()}
                         : std::initializer_list<int64_t>{layer.batch(), c.k_heads(), n, c.k_head_dim()},
                k_layout.c_str());
  if (c.v_heads() == 0) {
    if (v) throw Error(op + ": v must be None for an engine-paged layer (it keeps only its index keys)");
    return rows;
  }
  if (!v) throw Error(op + ": v must be given");
  const std::string v_layout = std::string(one_slot ? "[" : "[batch, ") + std::to_string(c.v_heads()) + ", tokens, " +
                               std::to_string(c.v_head_dim()) + "] (the layer's cache V rows)";
  rows.v = a.in(*v, "v",
                one_slot ? std::initializer_list<int64_t>{c.v_heads(), n, c.v_head_dim()}
                         : std::initializer_list<int64_t>{layer.batch(), c.v_heads(), n, c.v_head_dim()},
                v_layout.c_str());
  return rows;
}

// ---- block-sparse step tensors ----
// The queries and output of a step: one token (T = 0), or a chunk of T
// tokens (a `tokens` dim after batch: q_len, or a prefill's num_tokens).
BlockSparseTokens block_queries(const BlockSparseAttention& l, const StepArgs& a, const In& q, const In& index_q,
                                const Out& o, int64_t T, const std::string& tokens = "q_len") {
  const auto& c = l.config();
  const int64_t B = l.batch(), Hq = c.num_qo_heads, Hk = c.num_kv_heads, D = c.head_dim;
  BlockSparseTokens t;
  if (T == 0) {
    t.q = a.in(q, "q", {B, Hq, D}, "[batch, num_qo_heads, head_dim]");
    t.index_q = a.in(index_q, "index_q", {B, Hk, D}, "[batch, num_kv_heads, head_dim]");
    t.o = a.out(o, {B, Hq, D}, "[batch, num_qo_heads, head_dim]");
    return t;
  }
  const std::string q_layout = "[batch, " + tokens + ", num_qo_heads, head_dim]";
  t.q = a.in(q, "q", {B, T, Hq, D}, q_layout.c_str());
  t.index_q = a.in(index_q, "index_q", {B, T, Hk, D}, ("[batch, " + tokens + ", num_kv_heads, head_dim]").c_str());
  t.o = a.out(o, {B, T, Hq, D}, q_layout.c_str());
  return t;
}

BlockSparseTokens block_tokens(const BlockSparseAttention& l, const std::string& op, const In& q, const In& index_q,
                               const In& k, const In& v, const Out& o, int32_t* q_len) {
  const int64_t B = l.batch(), Hk = l.config().num_kv_heads, D = l.config().head_dim;
  const StepArgs a(l, op);
  if (q_len == nullptr) {
    BlockSparseTokens t = block_queries(l, a, q, index_q, o, 0);
    t.k = a.in(k, "k", {B, Hk + 1, 1, D}, "[batch, num_kv_heads + 1, 1, head_dim] (keys, then the index key)");
    t.v = a.in(v, "v", {B, Hk, 1, D}, "[batch, num_kv_heads, 1, head_dim]");
    return t;
  }
  *q_len = step_q_len(op, q, "q", "[batch, q_len, num_qo_heads, head_dim]");
  const int64_t T = *q_len;
  BlockSparseTokens t = block_queries(l, a, q, index_q, o, T);
  t.k = a.in(k, "k", {T, B, Hk + 1, 1, D},
             "[q_len, batch, num_kv_heads + 1, 1, head_dim] (token-major; keys, then the index key)");
  t.v = a.in(v, "v", {T, B, Hk, 1, D}, "[q_len, batch, num_kv_heads, 1, head_dim] (token-major)");
  return t;
}

EnginePagedKV block_engine_kv(const BlockSparseAttention& l, const std::string& op, const In& k_cache,
                              const In& v_cache, const In& block_table) {
  const int32_t Hk = l.config().num_kv_heads, D = l.config().head_dim;
  const char* layout = "[num_blocks, block_size, num_kv_heads, head_dim]";
  int32_t kb = 0, vb = 0;
  EnginePagedKV kv;
  kv.k = engine_pool(op, k_cache, "k_cache", l.device(), l.dtype(), Hk, D, D, layout, &kb);
  kv.v = engine_pool(op, v_cache, "v_cache", l.device(), l.dtype(), Hk, D, D, layout, &vb);
  if (kb != vb || kv.k.capacity != kv.v.capacity) {
    throw Error(op + ": k_cache and v_cache must have the same num_blocks and block_size");
  }
  kv.block_table = engine_table(op, block_table, l.device(), l.batch(), kb, kv.k.capacity / kb);
  return kv;
}

// ---- static-pattern step tensors ----
// One token's (n null), or a prefill chunk's of *n tokens: q and o [B, n,
// Hq, D], k and v [n, B, Hkv, 1, D] token-major.
StaticBlockSparseTokens static_tokens(const StaticBlockSparseAttention& l, const std::string& op, const In& q,
                                      const In& k, const In& v, const Out& o, int32_t* n) {
  const auto& c = l.config();
  const int64_t B = l.batch(), Hq = c.num_qo_heads, Hk = c.num_kv_heads, D = c.head_dim;
  const StepArgs a(l, op);
  StaticBlockSparseTokens t;
  if (n == nullptr) {
    t.q = a.in(q, "q", {B, Hq, D}, "[batch, num_qo_heads, head_dim]");
    t.k = a.in(k, "k", {B, Hk, 1, D}, "[batch, num_kv_heads, 1, head_dim]");
    t.v = a.in(v, "v", {B, Hk, 1, D}, "[batch, num_kv_heads, 1, head_dim]");
    t.o = a.out(o, {B, Hq, D}, "[batch, num_qo_heads, head_dim]");
    return t;
  }
  const char* q_layout = "[batch, num_tokens, num_qo_heads, head_dim]";
  *n = step_q_len(op, q, "q", q_layout);
  const int64_t T = *n;
  t.q = a.in(q, "q", {B, T, Hq, D}, q_layout);
  t.k = a.in(k, "k", {T, B, Hk, 1, D}, "[num_tokens, batch, num_kv_heads, 1, head_dim] (token-major)");
  t.v = a.in(v, "v", {T, B, Hk, 1, D}, "[num_tokens, batch, num_kv_heads, 1, head_dim] (token-major)");
  t.o = a.out(o, {B, T, Hq, D}, q_layout);
  return t;
}

// ---- DSA step tensors ----
// The queries, index weights and output of a step (q_len = 0: one token, no q_len dim).
DsaTokens dsa_queries(const DsaAttention& l, const StepArgs& a, const In& q_latent, const In& q_pe, const In& q_index,
                      const In& index_weights, const Out& o, int64_t T) {
  const auto& c = l.config();
  const int64_t B = l.batch(), H = c.num_qo_heads, L = c.latent_dim, R = c.rope_dim, IH = c.index_heads,
                ID = c.index_head_dim;
  DsaTokens t;
  if (T == 0) {
    t.q_latent = a.in(q_latent, "q_latent", {B, H, L}, "[batch, num_qo_heads, latent_dim]");
    t.q_pe = a.in(q_pe, "q_pe", {B, H, R}, "[batch, num_qo_heads, rope_dim]");
    t.q_index = a.in(q_index, "q_index", {B, IH, ID}, "[batch, index_heads, index_head_dim]");
    t.index_weights = weights_arg(a.op, index_weights, a.device, {B, IH}, "[batch, index_heads]");
    t.o = a.out(o, {B, H, L}, "[batch, num_qo_heads, latent_dim]");
    return t;
  }
  t.q_latent = a.in(q_latent, "q_latent", {B, T, H, L}, "[batch, q_len, num_qo_heads, latent_dim]");
  t.q_pe = a.in(q_pe, "q_pe", {B, T, H, R}, "[batch, q_len, num_qo_heads, rope_dim]");
  t.q_index = a.in(q_index, "q_index", {B, T, IH, ID}, "[batch, q_len, index_heads, index_head_dim]");
  t.index_weights = weights_arg(a.op, index_weights, a.device, {B, T, IH}, "[batch, q_len, index_heads]");
  t.o = a.out(o, {B, T, H, L}, "[batch, q_len, num_qo_heads, latent_dim]");
  return t;
}

DsaTokens dsa_tokens(const DsaAttention& l, const std::string& op, const In& q_latent, const In& q_pe,
                     const In& q_index, const In& index_weights, const In& k_cache_row, const In& k_pe, const Out& o,
                     int32_t* q_len) {
  const int64_t B = l.batch(), L = l.config().latent_dim, R = l.config().rope_dim, ID = l.config().index_head_dim;
  const StepArgs a(l, op);
  int64_t T = 0;
  if (q_len != nullptr) {
    *q_len = step_q_len(op, q_latent, "q_latent", "[batch, q_len, num_qo_heads, latent_dim]");
    T = *q_len;
  }
  DsaTokens t = dsa_queries(l, a, q_latent, q_pe, q_index, index_weights, o, T);
  if (T == 0) {
    t.k_cache_row = a.in(k_cache_row, "k_cache_row", {B, 1, 1, L + ID}, "[batch, 1, 1, latent_dim + index_head_dim]");
    t.k_pe = a.in(k_pe, "k_pe", {B, 1, 1, R}, "[batch, 1, 1, rope_dim]");
    return t;
  }
  t.k_cache_row = a.in(k_cache_row, "k_cache_row", {T, B, 1, 1, L + ID},
                       "[q_len, batch, 1, 1, latent_dim + index_head_dim] (token-major)");
  t.k_pe = a.in(k_pe, "k_pe", {T, B, 1, 1, R}, "[q_len, batch, 1, 1, rope_dim] (token-major)");
  return t;
}

// The engines' FP8 MLA pool: uint8 [num_blocks, block_size, row_bytes], each
// row the 656-byte format (fp8.h) and row_bytes >= 656 apart.
EnginePagedKV dsa_fp8_kv(const DsaAttention& l, Tensor& t, const std::string& op, const In& block_table) {
  const char* layout = "[num_blocks, block_size, row_bytes] uint8 (656-byte FP8 MLA rows)";
  t.require_device(l.device(), "the layer");
  if (t.dtype.bits != 8 || t.dtype.lanes != 1) t.fail("has dtype " + t.dtype_str() + "; an FP8 pool is uint8");
  if (l.dtype() != DType::kBF16) t.fail("holds FP8 MLA rows, whose rope is bf16: the layer must be bf16");
  if (l.config().latent_dim != MlaFp8Row::kLatent || l.config().rope_dim != MlaFp8Row::kRope)
    t.fail("holds FP8 MLA rows of 512 latent + 64 rope values; the layer has " + std::to_string(l.config().latent_dim) +
           " + " + std::to_string(l.config().rope_dim));
  t.require_ndim(3, layout);
  if (t.shape[2] < MlaFp8Row::kBytes)
    t.fail("rows are " + std::to_string(t.shape[2]) + " bytes, fewer than the format's 656; expected " + layout);
  t.require_unit_stride_last();
  require_whole_blocks(t);
  const MlaFp8Views views = mla_fp8_views(t.data, t.shape[0] * t.shape[1], t.strides[1]);
  EnginePagedKV kv;
  kv.k = views.k;
  kv.v = views.v;
  kv.k_extra = views.k_extra;
  kv.kv_format = KvFormat::kE4m3Mla;
  const int32_t bs = to_int32(t.shape[1], op, "kv_cache's block size");
  kv.block_table = engine_table(op, block_table, l.device(), l.batch(), bs, t.shape[0]);
  return kv;
}

EnginePagedKV dsa_engine_kv(const DsaAttention& l, const std::string& op, const In& kv_cache, const In& block_table) {
  const int32_t L = l.config().latent_dim, R = l.config().rope_dim;
  const char* layout = "[num_blocks, block_size, latent_dim + rope_dim]";
  if (Tensor t = describe(kv_cache, op, "kv_cache");
      t.dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt)) {
    return dsa_fp8_kv(l, t, op, block_table);
  }
  int32_t bs = 0;
  EnginePagedKV kv;
  kv.k = engine_pool(op, kv_cache, "kv_cache", l.device(), l.dtype(), 0, L + R, L, layout, &bs);
  kv.v = kv.k;        // V = the latent columns
  kv.k_extra = kv.k;  // the rope columns of the same rows
  kv.k_extra.data = static_cast<const char*>(kv.k.data) + int64_t{L} * static_cast<int64_t>(dtype_size(l.dtype()));
  kv.k_extra.dim = R;
  kv.block_table = engine_table(op, block_table, l.device(), l.batch(), bs, kv.k.capacity / bs);
  return kv;
}

// An engine's index-key pool: uint8 [num_blocks, block_size, 132] (vLLM's
// FP8 blocks; a block's bytes must be contiguous) or f16/bf16 [num_blocks,
// block_size, dim], with its block table.
PagedIndexKeys index_cache_pool(const std::string& op, const In& cache, Device device, int32_t dim) {
  Tensor t = describe(cache, op, "index_cache");
  t.require_device(device, "the layer");
  t.require_ndim(3, "[num_blocks, block_size, bytes or index_head_dim]");
  PagedIndexKeys k;
  k.pool = t.data;
  k.num_blocks = t.shape[0];
  k.block_size = to_int32(t.shape[1], op, "index_cache's block size");
  const bool fp8 = t.is_uint8();
  if (fp8) {
    if (t.shape[2] != IndexKeyFp8::kTokenBytes) {
      t.fail("holds " + std::to_string(t.shape[2]) + " bytes per token; vLLM's FP8 index keys take 132");
    }
    k.format = IndexKeyFormat::kE4m3;
    // vLLM's blocks are packed: a block's bytes in order (its values, then
    // its scales), one block after another. Judged whatever the block count
    // (a one-block view may still be transposed or reversed).
    const int64_t block_bytes = t.shape[1] * t.shape[2];
    if (t.stride_or(2, 1) != 1 || t.stride_or(1, t.shape[2]) != t.shape[2] ||
        t.stride_or(0, block_bytes) != block_bytes) {
      t.fail("must be packed: each block's bytes in order (its values, then its scales), blocks one after another");
    }
    k.block_stride_bytes = block_bytes;
  } else {
    k.format = IndexKeyFormat::kNative;
    k.dtype = t.float_dtype();
    if (t.shape[2] != dim)
      t.fail("rows are " + std::to_string(t.shape[2]) + " wide; the layer's index_head_dim is " + std::to_string(dim));
    t.require_unit_stride_last();
    // Rows of a block, and blocks, must not alias: a stride of 0 (an
    // expanded view) or below, or one shorter than what it steps over, is
    // refused (the core reads a block stride of 0 as "packed").
    const int64_t token = t.stride_or(1, dim), block = t.stride_or(0, t.shape[1] * token);
    if (token < dim || block < t.shape[1] * token)
      t.fail("has strides (" + std::to_string(t.strides[0]) + ", " + std::to_string(t.strides[1]) +
             ") that make its rows or blocks overlap; each row must start at least index_head_dim elements after "
             "the last, each block after the last block's rows");
    const int64_t e = static_cast<int64_t>(dtype_size(k.dtype));
    k.token_stride_bytes = token * e;
    k.block_stride_bytes = block * e;
  }
  return k;
}

PagedIndexKeys index_pool(const std::string& op, const In& cache, const In& table, Device device, int32_t batch,
                          int32_t dim) {
  PagedIndexKeys k = index_cache_pool(op, cache, device, dim);
  const BlockTable tb = table_arg(op, table, "index_block_table", device, batch);
  k.block_table = tb.data;
  k.block_table_stride = tb.row_stride;
  k.max_blocks = tb.max_blocks;
  return k;
}

// The engine-pools fields every model's *_pools call adds to its attention
// pool `kv`: the lengths (int32 [batch] on the layer's device, their host
// bound) and the index-key pool with its table (default: the attention pool's).
EnginePagedKV pools_kv(EnginePagedKV kv, const SparseLayer& layer, const std::string& op, const In& seq_lens,
                       int64_t max_seq_len, const In& index_cache, const std::optional<In>& index_block_table,
                       const In& block_table, int32_t index_dim) {
  if (layer.kv_storage() != KVStorage::kEnginePools)
    throw Error(op + ": the layer was made with another kv_storage; the *_pools calls need KVStorage.ENGINE_POOLS");
  const Tensor lens = describe(seq_lens, op, "seq_lens");
  lens.require_device(layer.device(), "the layer");
  lens.require_int32_array({layer.batch()}, "[batch]");
  kv.seq_lens = static_cast<const int32_t*>(lens.data);
  kv.max_seq_len = max_seq_len;
  kv.index_keys = index_pool(op, index_cache, index_block_table ? *index_block_table : block_table, layer.device(),
                             layer.batch(), index_dim);
  return kv;
}

// prefill_pools' host_seq_lens: the engine's host copy of seq_lens (a CPU
// int32 array or a list, [batch]) copied into `host`, so the chunk is
// decided without reading the device lengths back; None: null (read back).
const int32_t* host_seq_lens_arg(nb::handle values, const SparseLayer& layer, const std::string& op,
                                 std::vector<int32_t>& host) {
  if (values.is_none()) return nullptr;
  host = host_int32(values, op, "host_seq_lens");
  if (host.size() != static_cast<size_t>(layer.batch())) {
    throw Error(op + ": host_seq_lens holds " + std::to_string(host.size()) + " lengths for " +
                std::to_string(layer.batch()) + " slots");
  }
  return host.data();
}

// ---- the forms over the layer's own cache: one token (prefill_token,
// decode), q_len tokens (decode_multi) or a prefill chunk of n tokens ----

enum class StepForm { kPrefillToken, kDecode, kDecodeMulti, kPrefill };

constexpr const char* form_name(StepForm f) {
  return f == StepForm::kPrefillToken  ? "prefill_token"
         : f == StepForm::kDecode      ? "decode"
         : f == StepForm::kDecodeMulti ? "decode_multi"
                                       : "prefill";
}

// The tokens' count argument of a model's *_tokens check: null for one token.
template <StepForm kForm>
int32_t* token_count(int32_t* n) {
  return kForm == StepForm::kDecodeMulti || kForm == StepForm::kPrefill ? n : nullptr;
}

// Runs the form: the decodes return their LayerStep, the prefills nothing.
template <StepForm kForm, class Layer, class Tokens>
auto run_form(Layer& self, const Tokens& t, int32_t n, const std::optional<uintptr_t>& stream) {
  if constexpr (kForm == StepForm::kPrefillToken) {
    self.prefill_token(t, step_stream(stream, self));
  } else if constexpr (kForm == StepForm::kDecode) {
    return self.decode(t, step_stream(stream, self));
  } else if constexpr (kForm == StepForm::kDecodeMulti) {
    return self.decode(t, n, step_stream(stream, self));
  } else {
    self.prefill(t, n, step_stream(stream, self));
  }
}

template <StepForm kForm>
auto block_step(BlockSparseAttention& self, const In& q, const In& index_q, const In& k, const In& v, const Out& o,
                const std::optional<uintptr_t>& stream) {
  int32_t n = 0;
  const std::string op = std::string("BlockSparseAttention.") + form_name(kForm);
  const BlockSparseTokens t = block_tokens(self, op, q, index_q, k, v, o, token_count<kForm>(&n));
  return run_form<kForm>(self, t, n, stream);
}

template <StepForm kForm>
auto static_step(StaticBlockSparseAttention& self, const In& q, const In& k, const In& v, const Out& o,
                 const std::optional<uintptr_t>& stream) {
  int32_t n = 0;
  const std::string op = std::string("StaticBlockSparseAttention.") + form_name(kForm);
  const StaticBlockSparseTokens t = static_tokens(self, op, q, k, v, o, token_count<kForm>(&n));
  return run_form<kForm>(self, t, n, stream);
}

template <StepForm kForm>
auto dsa_step(DsaAttention& self, const In& q_latent, const In& q_pe, const In& q_index, const In& index_weights,
              const In& k_cache_row, const In& k_pe, const Out& o, const std::optional<uintptr_t>& stream) {
  int32_t n = 0;
  const std::string op = std::string("DsaAttention.") + form_name(kForm);
  const DsaTokens t =
      dsa_tokens(self, op, q_latent, q_pe, q_index, index_weights, k_cache_row, k_pe, o, token_count<kForm>(&n));
  return run_form<kForm>(self, t, n, stream);
}

// ---- the engine forms: *_paged (an engine's paged pool, the layer keeps
// the index keys) and *_pools (everything in the engine's pools), each as a
// one-token decode or (kChunk) a prefill chunk of n = q.shape[1] tokens ----

// The appended index keys of a *_paged step: one token's [batch, 1, 1, dim],
// or a chunk's n tokens' token-major.
const void* index_k_arg(const StepArgs& a, const In& index_k, int64_t batch, int64_t dim, const std::string& dim_name,
                        int64_t n) {
  if (n == 0) return a.in(index_k, "index_k", {batch, 1, 1, dim}, ("[batch, 1, 1, " + dim_name + "]").c_str());
  return a.in(index_k, "index_k", {n, batch, 1, 1, dim},
              ("[num_tokens, batch, 1, 1, " + dim_name + "] (token-major)").c_str());
}

// "<Layer>.decode_<form>" or "<Layer>.prefill_<form>".
template <bool kChunk>
std::string engine_op(const char* layer, const char* form) {
  return std::string(layer) + (kChunk ? ".prefill_" : ".decode_") + form;
}

// Runs the step: decode returns its LayerStep, a prefill chunk nothing.
template <bool kChunk, class Layer, class Tokens>
auto engine_step(Layer& self, const Tokens& t, const EnginePagedKV& kv, int32_t n,
                 const std::optional<uintptr_t>& stream) {
  if constexpr (kChunk) {
    self.prefill(t, kv, n, step_stream(stream, self));
  } else {
    return self.decode(t, kv, step_stream(stream, self));
  }
}

template <bool kChunk>
auto block_paged(BlockSparseAttention& self, const In& q, const In& index_q, const In& index_k, const Out& o,
                 const In& k_cache, const In& v_cache, const In& block_table, const std::optional<uintptr_t>& stream) {
  const std::string op = engine_op<kChunk>("BlockSparseAttention", "paged");
  const int32_t n = kChunk ? step_q_len(op, q, "q", "[batch, num_tokens, num_qo_heads, head_dim]") : 0;
  const StepArgs a(self, op);
  BlockSparseTokens t = block_queries(self, a, q, index_q, o, n, "num_tokens");
  t.index_k = index_k_arg(a, index_k, self.batch(), self.config().head_dim, "head_dim", n);
  return engine_step<kChunk>(self, t, block_engine_kv(self, op, k_cache, v_cache, block_table), n, stream);
}

template <bool kChunk>
auto block_pools_with(BlockSparseAttention& self, const In& q, const In& index_q, const Out& o, const In& k_cache,
                      const In& v_cache, const In& block_table, const In& seq_lens, int64_t max_seq_len,
                      const In& index_cache, const std::optional<In>& index_block_table,
                      const std::optional<uintptr_t>& stream, nb::handle host_seq_lens) {
  const std::string op = engine_op<kChunk>("BlockSparseAttention", "pools");
  const int32_t n = kChunk ? step_q_len(op, q, "q", "[batch, num_tokens, num_qo_heads, head_dim]") : 0;
  const BlockSparseTokens t = block_queries(self, StepArgs(self, op), q, index_q, o, n, "num_tokens");
  EnginePagedKV kv = pools_kv(block_engine_kv(self, op, k_cache, v_cache, block_table), self, op, seq_lens, max_seq_len,
                              index_cache, index_block_table, block_table, self.config().head_dim);
  std::vector<int32_t> host;
  kv.host_seq_lens = host_seq_lens_arg(host_seq_lens, self, op, host);
  return engine_step<kChunk>(self, t, kv, n, stream);
}

// decode_pools: no host copy (the step decides nothing on the lengths).
auto block_decode_pools(BlockSparseAttention& self, const In& q, const In& index_q, const Out& o, const In& k_cache,
                        const In& v_cache, const In& block_table, const In& seq_lens, int64_t max_seq_len,
                        const In& index_cache, const std::optional<In>& index_block_table,
                        const std::optional<uintptr_t>& stream) {
  return block_pools_with<false>(self, q, index_q, o, k_cache, v_cache, block_table, seq_lens, max_seq_len, index_cache,
                                 index_block_table, stream, nb::none());
}

template <bool kChunk>
auto dsa_paged(DsaAttention& self, const In& q_latent, const In& q_pe, const In& q_index, const In& index_weights,
               const In& index_k, const Out& o, const In& kv_cache, const In& block_table,
               const std::optional<uintptr_t>& stream) {
  const std::string op = engine_op<kChunk>("DsaAttention", "paged");
  const int32_t n = kChunk ? step_q_len(op, q_latent, "q_latent", "[batch, num_tokens, num_qo_heads, latent_dim]") : 0;
  const StepArgs a(self, op);
  DsaTokens t = dsa_queries(self, a, q_latent, q_pe, q_index, index_weights, o, n);
  t.index_k = index_k_arg(a, index_k, self.batch(), self.config().index_head_dim, "index_head_dim", n);
  return engine_step<kChunk>(self, t, dsa_engine_kv(self, op, kv_cache, block_table), n, stream);
}

template <bool kChunk>
auto dsa_pools_with(DsaAttention& self, const In& q_latent, const In& q_pe, const In& q_index, const In& index_weights,
                    const Out& o, const In& kv_cache, const In& block_table, const In& seq_lens, int64_t max_seq_len,
                    const In& index_cache, const std::optional<In>& index_block_table,
                    const std::optional<uintptr_t>& stream, nb::handle host_seq_lens) {
  const std::string op = engine_op<kChunk>("DsaAttention", "pools");
  const int32_t n = kChunk ? step_q_len(op, q_latent, "q_latent", "[batch, num_tokens, num_qo_heads, latent_dim]") : 0;
  const DsaTokens t = dsa_queries(self, StepArgs(self, op), q_latent, q_pe, q_index, index_weights, o, n);
  EnginePagedKV kv = pools_kv(dsa_engine_kv(self, op, kv_cache, block_table), self, op, seq_lens, max_seq_len,
                              index_cache, index_block_table, block_table, self.config().index_head_dim);
  std::vector<int32_t> host;
  kv.host_seq_lens = host_seq_lens_arg(host_seq_lens, self, op, host);
  return engine_step<kChunk>(self, t, kv, n, stream);
}

auto dsa_decode_pools(DsaAttention& self, const In& q_latent, const In& q_pe, const In& q_index,
                      const In& index_weights, const Out& o, const In& kv_cache, const In& block_table,
                      const In& seq_lens, int64_t max_seq_len, const In& index_cache,
                      const std::optional<In>& index_block_table, const std::optional<uintptr_t>& stream) {
  return dsa_pools_with<false>(self, q_latent, q_pe, q_index, index_weights, o, kv_cache, block_table, seq_lens,
                               max_seq_len, index_cache, index_block_table, stream, nb::none());
}

DispatchConfig dispatch_or_process(const std::optional<DispatchConfig>& d) {
  return d ? *d : process_dispatch_config();
}

// A model layer's class: its constructor (the process's dispatch unless one
// is given) and its config, as every model binds them.
template <class Layer, class Config>
nb::class_<Layer, SparseLayer> layer_class(nb::module_& m, const char* name, const char* doc) {
  nb::class_<Layer, SparseLayer> c(m, name, doc);
  c.def(
       "__init__",
       [](Layer* self, Device device, DType dtype, const Config& config, int32_t batch,
          const std::optional<DispatchConfig>& dispatch) {
         new (self) Layer(device, dtype, config, batch, dispatch_or_process(dispatch));
       },
       nb::arg("device"), nb::arg("dtype"), nb::arg("config"), nb::arg("batch"), nb::arg("dispatch") = nb::none())
      .def_prop_ro("config", &Layer::config);
  return c;
}

// A prefill object's run on q's device: the GIL released on the CPU, on
// `stream` (else torch's current stream) on CUDA.
template <class Prefill, class Params>
void run_prefill_op(Prefill& self, const Params& p, Device device, const Tensor& q,
                    const std::optional<uintptr_t>& stream) {
  DeviceGuard guard(q);
  if (device == Device::kCpu) {
    nb::gil_scoped_release release;
    self.run(p);
  } else {
    self.run(p, stream ? stream_ptr(*stream) : torch_current_stream());
  }
}

// DsaPrefillIndexer.run: a chunk's tokens (the last num_tokens of each
// sequence's positions) each keep their top-k over their own causal window,
// from dense keys (the layer's K allocation) or an engine's index-key pool.
void dsa_prefill_run(DsaPrefillIndexer& self, const In& q_index, const In& weights, const Out& positions,
                     const Out& counts, int64_t kv_len, const std::optional<In>& kv_lens,
                     const std::optional<In>& k_cache, int32_t key_column, const std::optional<In>& index_cache,
                     const std::optional<In>& index_block_table, const std::optional<uintptr_t>& stream) {
  const std::string op = "DsaPrefillIndexer.run";
  const Tensor q = describe(q_index, op, "q_index"), w = describe(weights, op, "weights"),
               pos = describe(positions, op, "positions"), cnt = describe(counts, op, "counts");
  const auto lens = describe(kv_lens, op, "kv_lens");
  const auto dense = describe(k_cache, op, "k_cache");
  const Device device = common_device(op, {q, w, pos, cnt, lens, dense});
  q.require_device(self.device(), "the indexer");
  q.require_ndim(4, "[batch, num_tokens, index_heads, index_head_dim]");
  q.require_contiguous();
  DsaPrefillIndexerParams p;
  p.dtype = q.float_dtype();
  const int32_t batch = q.extent_int32(0, "batch"), tokens = q.extent_int32(1, "num_tokens");
  p.index_heads = q.extent_int32(2, "index_heads");
  p.index_head_dim = q.extent_int32(3, "index_head_dim");
  w.require_float32_array({batch, tokens, p.index_heads}, "[batch, num_tokens, index_heads]");
  pos.require_int32();
  pos.require_ndim(3, "[batch, num_tokens, topk]");
  if (pos.shape[0] != batch || pos.shape[1] != tokens)
    pos.fail("must be [batch = " + std::to_string(batch) + ", num_tokens = " + std::to_string(tokens) +
             ", topk], got " + pos.shape_str());
  pos.require_contiguous();
  p.topk = pos.extent_int32(2, "topk");
  cnt.require_int32_array({batch, tokens}, "[batch, num_tokens]");
  p.chunk = {batch, tokens, kv_len, nullptr};
  if (lens) {
    lens->require_int32_array({batch}, "[batch]");
    p.chunk.kv_lens = static_cast<const int32_t*>(lens->data);
  }
  if (dense.has_value() == index_cache.has_value())
    throw Error(op + ": give the keys either dense (k_cache) or paged (index_cache with index_block_table)");
  if (dense) {
    if (index_block_table) throw Error(op + ": index_block_table goes with index_cache, not k_cache");
    dense->require_ndim(3, "[batch, capacity, key_column + index_head_dim]");
    dense->require_same_dtype(q);
    dense->require_contiguous();
    if (dense->shape[0] != batch || key_column < 0 || dense->shape[2] != int64_t{key_column} + p.index_head_dim)
      dense->fail("must be [batch = " + std::to_string(batch) + ", capacity, key_column + index_head_dim = " +
                  std::to_string(int64_t{key_column} + p.index_head_dim) + "], got " + dense->shape_str());
    p.key_layout = IndexKeyLayout::kDense;
    p.k_cache = dense->data;
    p.key_column = key_column;
    p.capacity = dense->shape[1];
  } else {
    if (!index_block_table) throw Error(op + ": index_cache needs its index_block_table");
    p.key_layout = IndexKeyLayout::kPaged;
    p.paged = index_pool(op, *index_cache, *index_block_table, device, batch, p.index_head_dim);
  }
  p.q_index = q.data;
  p.weights = static_cast<const float*>(w.data);
  p.positions = static_cast<int32_t*>(pos.data);
  p.counts = static_cast<int32_t*>(cnt.data);
  run_prefill_op(self, p, device, q, stream);
}

// GqaBlockPrefill.run: a chunk's query blocks attend their kept key blocks,
// each token up to its own position, over dense K/V or an engine's pool.
void gqa_prefill_run(GqaBlockPrefill& self, const In& q_in, const In& k_in, const In& v_in, const Out& o_in,
                     const In& ids_in, const In& counts_in, int32_t block_size, float scale, int64_t kv_len,
                     const std::optional<In>& kv_lens_in, const std::optional<In>& table_in,
                     const std::optional<Out>& lse_in, const std::optional<In>& k_scale_in,
                     const std::optional<In>& v_scale_in, const std::optional<uintptr_t>& stream) {
  const std::string op = "GqaBlockPrefill.run";
  const Tensor q = describe(q_in, op, "q"), k = describe(k_in, op, "k"), v = describe(v_in, op, "v"),
               o = describe(o_in, op, "o"), ids = describe(ids_in, op, "block_ids"),
               counts = describe(counts_in, op, "counts");
  const auto kv_lens = describe(kv_lens_in, op, "kv_lens");
  const auto table = describe(table_in, op, "block_table");
  const auto lse = describe(lse_in, op, "lse");
  const auto k_scale = describe(k_scale_in, op, "k_scale"), v_scale = describe(v_scale_in, op, "v_scale");
  const Device device = common_device(op, {q, k, v, o, ids, counts, kv_lens, table, lse, k_scale, v_scale});
  q.require_device(self.device(), "the prefill object");
  q.require_ndim(4, "[batch, num_tokens, num_qo_heads, head_dim]");
  q.require_contiguous();
  GqaPrefillParams p;
  p.dtype = q.float_dtype();
  // uint8 K and V: vLLM's fp8 KV cache (e4m3, one fp32 scale per KV head); views then count bytes.
  const bool fp8 = k.is_uint8();
  if (v.is_uint8() != fp8) throw Error(op + ": k and v must both be e4m3 bytes (uint8) or both q's dtype");
  if (fp8) {
    if (!k_scale || !v_scale) throw Error(op + ": e4m3 K/V (uint8) need k_scale and v_scale");
    p.kv_format = KvFormat::kE4m3PerHead;
  } else {
    if (k_scale || v_scale) throw Error(op + ": k_scale and v_scale go with e4m3 K/V (uint8); these rows are native");
    k.require_same_dtype(q);
    v.require_same_dtype(q);
  }
  const int32_t batch = q.extent_int32(0, "batch"), tokens = q.extent_int32(1, "num_tokens");
  p.num_qo_heads = q.extent_int32(2, "num_qo_heads");
  p.block_size = block_size;
  if (table) {  // an engine's pool [num_blocks, block_size, num_kv_heads, head_dim]
    for (const Tensor* t : {&k, &v}) {
      t->require_ndim(4, "[num_blocks, block_size, num_kv_heads, head_dim]");
      t->require_unit_stride_last();
      if (t->shape[1] < 1) t->fail("has blocks of " + std::to_string(t->shape[1]) + " rows");
      require_whole_blocks(*t);
    }
    if (k.shape[0] != v.shape[0] || k.shape[1] != v.shape[1] || k.shape[2] != v.shape[2])
      throw Error(op + ": k and v must have the same num_blocks, block_size and num_kv_heads");
    p.num_kv_heads = k.extent_int32(2, "num_kv_heads");
    const auto pool = [](const Tensor& t) {
      RowView r;
      r.data = t.data;
      r.row_stride = t.stride_or(1, t.shape[2] * t.shape[3]);
      r.head_stride = t.shape[2] > 1 ? t.strides[2] : 0;
      r.dim = t.extent_int32(3, "head_dim");
      r.capacity = t.shape[0] * t.shape[1];
      return r;
    };
    p.k = pool(k);
    p.v = pool(v);
    p.block_table = block_table_of(*table, "[batch, max_blocks]");
    p.block_table.block_size = k.extent_int32(1, "block size");
    p.block_table.num_blocks = k.shape[0];
  } else {  // dense [batch, num_kv_heads, capacity, head_dim]
    for (const Tensor* t : {&k, &v}) {
      t->require_ndim(4, "[batch, num_kv_heads, capacity, head_dim]");
      if (t->shape[0] != batch || t->shape[1] != k.shape[1])
        t->fail("must be [batch = " + std::to_string(batch) + ", num_kv_heads, capacity, head_dim], got " +
                t->shape_str());
    }
    p.k = dense_of(k, nullptr, fp8 ? 1 : 0);
    p.v = dense_of(v, nullptr, fp8 ? 1 : 0);
    p.num_kv_heads = k.extent_int32(1, "num_kv_heads");
  }
  if (fp8) {
    k_scale->require_float32_array({p.num_kv_heads}, "[num_kv_heads]");
    v_scale->require_float32_array({p.num_kv_heads}, "[num_kv_heads]");
    p.k_scale = static_cast<const float*>(k_scale->data);
    p.v_scale = static_cast<const float*>(v_scale->data);
  }
  o.require_same_dtype(q);
  o.require_shape({batch, tokens, p.num_qo_heads, p.v.dim}, "[batch, num_tokens, num_qo_heads, head_dim_v]");
  o.require_contiguous();
  // The selection (BlockSelectionLayout): per KV head [batch, num_query_blocks, num_kv_heads, width]
  // (4-D), or per query head [batch, num_kv_heads, num_query_blocks, group_size, width] (5-D); counts
  // without the width.
  ids.require_int32();
  ids.require_contiguous();
  if (ids.ndim() != 4 && ids.ndim() != 5)
    ids.fail("must be [batch, num_query_blocks, num_kv_heads, width] (a list per KV head) or [batch, "
             "num_kv_heads, num_query_blocks, group_size, width] (per query head), got " +
             ids.shape_str());
  p.selection.layout = ids.ndim() == 4 ? BlockSelectionLayout::kPerKvHead : BlockSelectionLayout::kPerQueryHead;
  const int64_t query_blocks = block_size > 0 ? (int64_t{tokens} + block_size - 1) / block_size : 0;
  const int64_t group = p.num_kv_heads > 0 ? p.num_qo_heads / p.num_kv_heads : 0;
  const std::vector<int64_t> want = ids.ndim() == 4 ? std::vector<int64_t>{batch, query_blocks, p.num_kv_heads}
                                                    : std::vector<int64_t>{batch, p.num_kv_heads, query_blocks, group};
  for (size_t i = 0; i < want.size(); ++i) {
    if (ids.shape[i] != want[i])
      ids.fail(std::string("must be ") +
               (ids.ndim() == 4 ? "[batch, num_query_blocks, num_kv_heads, width]"
                                : "[batch, num_kv_heads, num_query_blocks, group_size, width]") +
               " (num_query_blocks = ceil(num_tokens / block_size) = " + std::to_string(query_blocks) + "), got " +
               ids.shape_str());
  }
  p.selection.width = ids.extent_int32(ids.ndim() - 1, "width");
  counts.require_int32();
  counts.require_contiguous();
  if (counts.ndim() != ids.ndim() - 1 || !std::equal(want.begin(), want.end(), counts.shape.begin()))
    counts.fail("must be block_ids' shape without its width, got " + counts.shape_str());
  p.selection.block_ids = static_cast<const int32_t*>(ids.data);
  p.selection.counts = static_cast<const int32_t*>(counts.data);
  p.chunk = {batch, tokens, kv_len, nullptr};
  if (kv_lens) {
    kv_lens->require_int32_array({batch}, "[batch]");
    p.chunk.kv_lens = static_cast<const int32_t*>(kv_lens->data);
  }
  if (lse) {
    lse->require_float32_array({batch, tokens, p.num_qo_heads}, "[batch, num_tokens, num_qo_heads]");
    p.lse = static_cast<float*>(lse->data);
  }
  p.q = q.data;
  p.o = o.data;
  p.scale = scale;
  run_prefill_op(self, p, device, q, stream);
}

}  // namespace

void bind_layers(nb::module_& m) {
  nb::enum_<KVStorage>(m, "KVStorage", "Where a layer's attention rows live.")
      .value("LAYER_CACHE", KVStorage::kLayerCache, "The layer's own dense [B, H, Cap, D] cache (the default).")
      .value("ENGINE_PAGED", KVStorage::kEnginePaged,
             "An engine's paged pool, read in place through its block table (decode_paged); the engine\n"
             "writes each token's rows, the layer keeps only its indexer's keys. Fused path only.")
      .value("ENGINE_POOLS", KVStorage::kEnginePools,
             "Everything in the engine's pools: attention rows and index keys, the lengths passed each step\n"
             "(DsaAttention.decode_pools, BlockSparseAttention.decode_pools). The layer keeps nothing per\n"
             "sequence. Fused path only.");

  nb::class_<LayerStep>(m, "LayerStep", "What a layer step did.")
      .def_ro("sparse", &LayerStep::sparse, "Some sequence's selection left something out.")
      .def_ro("fused", &LayerStep::fused, "The fused paged decode ran (else the mask path).")
      .def_ro("outcome", &LayerStep::outcome);

  nb::class_<SparseLayer>(m, "SparseLayer",
                          "The layer skeleton every model shares: a batch of slots (continuous batching: each\n"
                          "slot has its own length; requests join with admit() and leave with release()), the\n"
                          "cache, and the last step's selection. Models add their decode forms.")
      .def_prop_ro("batch", &SparseLayer::batch)
      .def_prop_ro("kv_len", &SparseLayer::kv_len, "The longest active sequence (a lockstep batch's length).")
      .def_prop_ro("kv_lens", &SparseLayer::kv_lens, "Each slot's length as the host knows it.")
      .def(
          "reserve", [](SparseLayer& self, int64_t tokens) { self.reserve(tokens); }, nb::arg("tokens"),
          "Makes room for `tokens` live tokens per slot and sizes the step's buffers, so steps up to\n"
          "that length allocate nothing (do it before capturing steps in a graph).")
      .def(
          "append_tokens",
          [](SparseLayer& self, const In& k, const std::optional<In>& v) {
            const PromptRows rows = prompt_rows(self, self.name() + ".append_tokens", k, v, false);
            self.append_tokens(rows.k, rows.v, rows.tokens);
          },
          nb::arg("k"), nb::arg("v").none() = nb::none(),
          "Appends a prompt's tokens to every active slot without attending (its prefill ran\n"
          "elsewhere), in the cache's row layout: k [batch, cache K heads, tokens, dim], v likewise\n"
          "(block-sparse: keys then the index key / values; DSA: latent + index key / rope;\n"
          "engine-paged layers: k is the index keys and v None). Synchronous; not a step.")
      .def(
          "admit",
          [](SparseLayer& self, int32_t slot, const In& k, const std::optional<In>& v,
             const std::optional<uintptr_t>& stream) {
            const PromptRows rows = prompt_rows(self, self.name() + ".admit", k, v, true);
            self.admit(slot, rows.k, rows.v, rows.tokens, step_stream(stream, self));
          },
          nb::arg("slot"), nb::arg("k"), nb::arg("v").none() = nb::none(), nb::arg("stream").none() = nb::none(),
          "Starts a request in `slot` with its prompt's rows (k [cache K heads, tokens, dim], v likewise,\n"
          "or None for an engine-paged layer); later steps extend it. Waits for the stream first.")
      .def(
          "release",
          [](SparseLayer& self, int32_t slot, const std::optional<uintptr_t>& stream) {
            self.release(slot, step_stream(stream, self));
          },
          nb::arg("slot"), nb::arg("stream").none() = nb::none(),
          "Ends the request in `slot`: later steps skip it (its output rows are zero).")
      .def(
          "sync_live_len",
          [](SparseLayer& self, const std::optional<uintptr_t>& stream) {
            self.sync_live_len(step_stream(stream, self));
          },
          nb::arg("stream").none() = nb::none(),
          "After replaying captured steps: reads the device-side lengths back (synchronizes).")
      .def(
          "check_errors",
          [](SparseLayer& self, const std::optional<uintptr_t>& stream) {
            self.check_errors(step_stream(stream, self));
          },
          nb::arg("stream").none() = nb::none(),
          "Synchronizes and raises sparsepage.Error naming what the last steps' kernels flagged on the\n"
          "device (a position outside its window, a length out of range, an engine block outside its\n"
          "pool), clearing the flags. Steps never read back: call it when the serving loop chooses to.")
      .def("last_selected_positions", &SparseLayer::last_selected_positions,
           "Positions the last step's page table attends, per request (host copy).")
      .def("last_mask_columns", &SparseLayer::last_mask_columns,
           "Columns the mask path keeps for the last step, per request (built on the device).")
      .def("last_prefill_positions", &SparseLayer::last_prefill_positions,
           "Positions the last prefill chunk attended (host copy): one row per (slot, chunk token, query\n"
           "head) for the block-sparse and static layers, per (slot, chunk token) for DSA; each row the\n"
           "kept positions up to the token's own, sorted; rows of free slots empty.");

  nb::class_<BlockSparseConfig>(m, "BlockSparseConfig", "Geometry of the block-sparse (MiniMax-M3-style) layer.")
      .def(
          "__init__",
          [](BlockSparseConfig* c, int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
             int32_t topk_blocks, int32_t local_blocks, int64_t capacity_step, KVStorage kv_storage) {
            new (c) BlockSparseConfig{num_qo_heads, num_kv_heads, head_dim,     block_size,
                                      topk_blocks,  local_blocks, capacity_step};
            c->kv_storage = kv_storage;
          },
          nb::kw_only(), nb::arg("num_qo_heads") = 64, nb::arg("num_kv_heads") = 4, nb::arg("head_dim") = 128,
          nb::arg("block_size") = 128, nb::arg("topk_blocks") = 16, nb::arg("local_blocks") = 1,
          nb::arg("capacity_step") = 4096, nb::arg("kv_storage") = KVStorage::kLayerCache)
      .def_rw("kv_storage", &BlockSparseConfig::kv_storage)
      .def_rw("num_qo_heads", &BlockSparseConfig::num_qo_heads)
      .def_rw("num_kv_heads", &BlockSparseConfig::num_kv_heads)
      .def_rw("head_dim", &BlockSparseConfig::head_dim)
      .def_rw("block_size", &BlockSparseConfig::block_size)
      .def_rw("topk_blocks", &BlockSparseConfig::topk_blocks)
      .def_rw("local_blocks", &BlockSparseConfig::local_blocks)
      .def_rw("capacity_step", &BlockSparseConfig::capacity_step)
      .def("sparse_regime", &BlockSparseConfig::sparse_regime, nb::arg("kv_len"));

  layer_class<BlockSparseAttention, BlockSparseConfig>(
      m, "BlockSparseAttention",
      "The block-sparse attention layer: an indexer keeps the top-k key blocks per KV head and decode\n"
      "attends them through the fused paged decode, falling back to the mask path on any decline. The\n"
      "layer owns its dense [B, H, Cap, D] cache (f16 or bf16). Step tensors: q [B, Hq, D], index_q\n"
      "[B, Hkv, D], k [B, Hkv + 1, 1, D] (keys, then the index key), v [B, Hkv, 1, D], o [B, Hq, D];\n"
      "contiguous, on the layer's device.")
      .def("prefill_token", &block_step<StepForm::kPrefillToken>, nb::arg("q"), nb::arg("index_q"), nb::arg("k"),
           nb::arg("v"), nb::arg("o"), nb::arg("stream").none() = nb::none(),
           "Appends the token and attends causally to the whole window (dense).")
      .def("decode", &block_step<StepForm::kDecode>, nb::arg("q"), nb::arg("index_q"), nb::arg("k"), nb::arg("v"),
           nb::arg("o"), nb::arg("stream").none() = nb::none(),
           "Appends each active slot's token, runs the indexer (top-k blocks per KV head; every block for a\n"
           "sequence in its dense regime) and attends the kept blocks: fused, or the block mask over the\n"
           "same set on a decline. Returns a LayerStep.")
      .def("decode_paged", &block_paged<false>, nb::arg("q"), nb::arg("index_q"), nb::arg("index_k"), nb::arg("o"),
           nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("block_table"), nb::arg("stream").none() = nb::none(),
           "Decode over an engine's paged pool (kv_storage = KVStorage.ENGINE_PAGED): appends the index key\n"
           "index_k [B, 1, 1, D], runs the indexer, and attends the kept blocks of k_cache / v_cache\n"
           "[num_blocks, block_size, Hkv, D] in place through block_table int32 [B, max_blocks] (row b:\n"
           "slot b's blocks). The engine has written this token's K and V at position kv_lens[b] (the\n"
           "length before the call). No mask path: a step the dispatch would decline raises, and nothing\n"
           "is appended.")
      .def("decode_pools", &block_decode_pools, nb::arg("q"), nb::arg("index_q"), nb::arg("o"), nb::arg("k_cache"),
           nb::arg("v_cache"), nb::arg("block_table"), nb::arg("seq_lens"), nb::arg("max_seq_len"),
           nb::arg("index_cache"), nb::arg("index_block_table").none() = nb::none(),
           nb::arg("stream").none() = nb::none(),
           "The stateless block-sparse step over an engine's own pools (kv_storage = KVStorage.ENGINE_POOLS):\n"
           "the engine has written this step's K and V rows and index key; the layer keeps nothing per\n"
           "sequence. k_cache / v_cache [num_blocks, block_size, Hkv, D] as decode_paged takes them;\n"
           "seq_lens int32 [B] on the device, each slot's length with this step's token (0: an empty slot,\n"
           "zero output); max_seq_len a host bound on them (reserve() it before capturing); index_cache the\n"
           "engine's index keys: the layer's dtype [num_blocks, block_size, D], or uint8 [num_blocks,\n"
           "block_size, 132] in vLLM's FP8 layout at D = 128 (write_index_keys writes either);\n"
           "index_block_table int32 [B, max_blocks] (default: block_table). Graph-capturable. A refused\n"
           "sequence (a length past max_seq_len, a key block outside the pool) selects nothing and\n"
           "check_errors() names it. Returns a LayerStep.")
      .def("decode_multi", &block_step<StepForm::kDecodeMulti>, nb::arg("q"), nb::arg("index_q"), nb::arg("k"),
           nb::arg("v"), nb::arg("o"), nb::arg("stream").none() = nb::none(),
           "A multi-token step (speculative verification, MTP): appends q_len tokens per slot and attends\n"
           "them, token t seeing the context up to its own position. q and o [B, q_len, Hq, D], index_q\n"
           "[B, q_len, Hkv, D]; k [q_len, B, Hkv + 1, 1, D] and v [q_len, B, Hkv, 1, D], token-major.\n"
           "q_len = q.shape[1], 1 .. 16 (on the GPU, q_len * Hkv <= 32). One selection serves the step;\n"
           "when the policy declines, the step runs as q_len one-token decodes. Returns a LayerStep.")
      .def("prefill", &block_step<StepForm::kPrefill>, nb::arg("q"), nb::arg("index_q"), nb::arg("k"), nb::arg("v"),
           nb::arg("o"), nb::arg("stream").none() = nb::none(),
           "Chunked prefill: appends num_tokens = q.shape[1] tokens per active slot, then the block\n"
           "prefill indexer and the fused block prefill (each query block keeps what one multi-token\n"
           "decode step of its tokens would; every block while it ends in the dense regime). Tensors as\n"
           "decode_multi's, any num_tokens. Refuses, before anything changes, a chunk whose start is not\n"
           "a multiple of block_size (and on the GPU head_dim other than 128, block_size other than 64\n"
           "or 128). Graph-capturable for a fixed shape once run eagerly, with the slots all active.")
      .def("prefill_paged", &block_paged<true>, nb::arg("q"), nb::arg("index_q"), nb::arg("index_k"), nb::arg("o"),
           nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("block_table"), nb::arg("stream").none() = nb::none(),
           "Chunked prefill over an engine's paged pool (kv_storage = KVStorage.ENGINE_PAGED): the engine\n"
           "has written the chunk's K and V rows into k_cache / v_cache [num_blocks, block_size, Hkv, D]\n"
           "at each active slot's positions kv_lens[b] .. kv_lens[b] + num_tokens - 1; appends the\n"
           "chunk's index keys index_k [num_tokens, B, 1, 1, D] (token-major), runs the block prefill\n"
           "indexer and the fused block prefill reading the rows through block_table int32 [B,\n"
           "max_blocks]. q and o [B, num_tokens, Hq, D], index_q [B, num_tokens, Hkv, D]. The same\n"
           "selection and answer as prefill over the layer's own cache, with its refusals, and a table\n"
           "row too short for a slot refused before anything changes.")
      .def("prefill_pools", &block_pools_with<true>, nb::arg("q"), nb::arg("index_q"), nb::arg("o"), nb::arg("k_cache"),
           nb::arg("v_cache"), nb::arg("block_table"), nb::arg("seq_lens"), nb::arg("max_seq_len"),
           nb::arg("index_cache"), nb::arg("index_block_table").none() = nb::none(),
           nb::arg("stream").none() = nb::none(), nb::arg("host_seq_lens").none() = nb::none(),
           "Chunked prefill over an engine's own pools (kv_storage = KVStorage.ENGINE_POOLS): the engine\n"
           "has written the chunk's K and V rows and index keys; the layer appends nothing and keeps\n"
           "nothing. k_cache, v_cache, block_table, index_cache and index_block_table as decode_pools\n"
           "takes them; seq_lens int32 [B] each slot's length with the chunk (0: a slot not in this call,\n"
           "zero output), its chunk the last num_tokens = q.shape[1] positions, starting on a multiple of\n"
           "block_size; max_seq_len a host bound on them. q and o [B, num_tokens, Hq, D], index_q [B,\n"
           "num_tokens, Hkv, D]. The same selection and answer as prefill_paged over a layer that keeps\n"
           "the same keys. host_seq_lens: the engine's host copy of seq_lens (a CPU int32 array, as\n"
           "vLLM's seq_lens_cpu); given, the chunk is decided on it and reads nothing back (graph-capturable\n"
           "after one eager chunk of the same shape; a replay keeps the slots in the call); None: the\n"
           "lengths are read back once (on the GPU this synchronizes; not capturable).\n"
           "Refused by name before anything is written: a length other than 0 below num_tokens or above\n"
           "max_seq_len, or past the table's row, a chunk off the block grid, and every slot free. A key\n"
           "block id outside the pool that the block scores read: refused by name on the CPU; on the GPU\n"
           "the sparse-regime query blocks that needed it attend nothing (zero output) and\n"
           "check_errors() names it.")
      .def("last_blocks", &BlockSparseAttention::last_blocks, "Kept blocks of the last step, per request (host copy).");

  nb::class_<StaticBlockSparseConfig>(
      m, "StaticBlockSparseConfig",
      "Geometry of the static per-query-head block pattern (Phi-3-small's by default):\n"
      "query head h in query block i keeps key block j <= i when i - j < local_blocks\n"
      "or (j + h * head_sliding_step + 1) % vert_stride == 0.")
      .def(
          "__init__",
          [](StaticBlockSparseConfig* c, int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim,
             int32_t block_size, int32_t local_blocks, int32_t vert_stride, int64_t capacity_step) {
            new (c) StaticBlockSparseConfig{num_qo_heads, num_kv_heads, head_dim,     block_size,
                                            local_blocks, vert_stride,  capacity_step};
          },
          nb::arg("num_qo_heads") = 32, nb::arg("num_kv_heads") = 8, nb::arg("head_dim") = 128,
          nb::arg("block_size") = 64, nb::arg("local_blocks") = 16, nb::arg("vert_stride") = 8,
          nb::arg("capacity_step") = 4096)
      .def_rw("num_qo_heads", &StaticBlockSparseConfig::num_qo_heads)
      .def_rw("num_kv_heads", &StaticBlockSparseConfig::num_kv_heads)
      .def_rw("head_dim", &StaticBlockSparseConfig::head_dim)
      .def_rw("block_size", &StaticBlockSparseConfig::block_size)
      .def_rw("local_blocks", &StaticBlockSparseConfig::local_blocks)
      .def_rw("vert_stride", &StaticBlockSparseConfig::vert_stride)
      .def_rw("capacity_step", &StaticBlockSparseConfig::capacity_step)
      .def("keeps", &StaticBlockSparseConfig::keeps, nb::arg("head"), nb::arg("query_block"), nb::arg("key_block"),
           "The rule: whether query head `head` in query block `query_block` keeps key block `key_block`.")
      .def("kept_tokens", &StaticBlockSparseConfig::kept_tokens, nb::arg("head"), nb::arg("kv_len"),
           "Tokens query head `head` attends at decode with `kv_len` tokens in the cache.");

  layer_class<StaticBlockSparseAttention, StaticBlockSparseConfig>(
      m, "StaticBlockSparseAttention",
      "Static per-query-head block-sparse attention (Phi-3-small-style): each query head attends its\n"
      "pattern's key blocks through the fused paged decode (one request per query head), falling back\n"
      "to the mask path over the same set on any decline. The layer owns its dense [B, Hkv, Cap, D]\n"
      "cache (f16 or bf16). Step tensors: q [B, Hq, D], k and v [B, Hkv, 1, D], o [B, Hq, D];\n"
      "contiguous, on the layer's device.")
      .def("decode", &static_step<StepForm::kDecode>, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"),
           nb::arg("stream").none() = nb::none(),
           "Appends each active slot's token and attends each query head's pattern. Returns a LayerStep.")
      .def("prefill", &static_step<StepForm::kPrefill>, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"),
           nb::arg("stream").none() = nb::none(),
           "Chunked prefill: appends num_tokens = q.shape[1] tokens per active slot and attends each query\n"
           "head's pattern through the fused block prefill (the same sets and outputs as decoding the\n"
           "tokens one by one). q and o [B, num_tokens, Hq, D]; k and v [num_tokens, B, Hkv, 1, D],\n"
           "token-major. Refuses, before anything changes, a chunk whose start is not a multiple of\n"
           "block_size.")
      .def("last_blocks", &StaticBlockSparseAttention::last_blocks,
           "Kept blocks of the last decode, per request r = b * num_qo_heads + h (host copy).");

  nb::class_<DsaConfig>(m, "DsaConfig", "Geometry of the DSA (DeepSeek-V3.2-style MLA + top-k indexer) layer.")
      .def(
          "__init__",
          [](DsaConfig* c, int32_t num_qo_heads, int32_t latent_dim, int32_t rope_dim, int32_t index_heads,
             int32_t index_head_dim, int32_t index_topk, float scale, int64_t capacity_step, KVStorage kv_storage) {
            new (c) DsaConfig{num_qo_heads, latent_dim, rope_dim,      index_heads, index_head_dim,
                              index_topk,   scale,      capacity_step, kv_storage};
          },
          nb::kw_only(), nb::arg("num_qo_heads") = 128, nb::arg("latent_dim") = 512, nb::arg("rope_dim") = 64,
          nb::arg("index_heads") = 64, nb::arg("index_head_dim") = 128, nb::arg("index_topk") = 2048,
          nb::arg("scale") = 0.0f, nb::arg("capacity_step") = 4096, nb::arg("kv_storage") = KVStorage::kLayerCache)
      .def_rw("kv_storage", &DsaConfig::kv_storage)
      .def_rw("num_qo_heads", &DsaConfig::num_qo_heads)
      .def_rw("latent_dim", &DsaConfig::latent_dim)
      .def_rw("rope_dim", &DsaConfig::rope_dim)
      .def_rw("index_heads", &DsaConfig::index_heads)
      .def_rw("index_head_dim", &DsaConfig::index_head_dim)
      .def_rw("index_topk", &DsaConfig::index_topk)
      .def_rw("scale", &DsaConfig::scale)
      .def_rw("capacity_step", &DsaConfig::capacity_step);

  layer_class<DsaAttention, DsaConfig>(
      m, "DsaAttention",
      "The DSA layer: MLA attention over the top-k tokens of a lightning indexer, through the fused\n"
      "paged decode's second K stream. Step tensors (contiguous, on the layer's device, in its dtype\n"
      "except the fp32 index weights): q_latent [B, H, latent], q_pe [B, H, rope], q_index\n"
      "[B, index_heads, index_head_dim], index_weights [B, index_heads], k_cache_row\n"
      "[B, 1, 1, latent + index_head_dim], k_pe [B, 1, 1, rope], o [B, H, latent].")
      .def("prefill_token", &dsa_step<StepForm::kPrefillToken>, nb::arg("q_latent"), nb::arg("q_pe"),
           nb::arg("q_index"), nb::arg("index_weights"), nb::arg("k_cache_row"), nb::arg("k_pe"), nb::arg("o"),
           nb::arg("stream").none() = nb::none(), "Appends the token and attends to the whole window.")
      .def("decode", &dsa_step<StepForm::kDecode>, nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"),
           nb::arg("index_weights"), nb::arg("k_cache_row"), nb::arg("k_pe"), nb::arg("o"),
           nb::arg("stream").none() = nb::none(),
           "Appends each active slot's token, runs the indexer, tries the fused path and falls back to the\n"
           "mask path. Returns a LayerStep.")
      .def("decode_paged", &dsa_paged<false>, nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"),
           nb::arg("index_weights"), nb::arg("index_k"), nb::arg("o"), nb::arg("kv_cache"), nb::arg("block_table"),
           nb::arg("stream").none() = nb::none(),
           "Decode over an engine's paged MLA pool (kv_storage = KVStorage.ENGINE_PAGED): appends the\n"
           "indexer key index_k [B, 1, 1, index_head_dim], runs the indexer, and attends the kept\n"
           "positions of kv_cache [num_blocks, block_size, latent_dim + rope_dim] (latent then rope in one\n"
           "row) in place through block_table int32 [B, max_blocks]. A uint8 kv_cache [num_blocks,\n"
           "block_size, row_bytes >= 656] holds the engines' FP8 MLA rows (512 e4m3 latent values, 4 fp32\n"
           "scales, 64 bf16 rope values; quantize_mla_fp8 writes them) for a bf16 layer of 512 + 64,\n"
           "dequantized in the kernel. The engine has written this token's row at position kv_lens[b].\n"
           "No mask path: a declined step raises, appending nothing.")
      .def("decode_pools", &dsa_decode_pools, nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"),
           nb::arg("index_weights"), nb::arg("o"), nb::arg("kv_cache"), nb::arg("block_table"), nb::arg("seq_lens"),
           nb::arg("max_seq_len"), nb::arg("index_cache"), nb::arg("index_block_table").none() = nb::none(),
           nb::arg("stream").none() = nb::none(),
           "The stateless DSA step over an engine's own pools (kv_storage = KVStorage.ENGINE_POOLS): the\n"
           "engine has written this step's MLA rows and index keys; the layer keeps nothing per sequence.\n"
           "kv_cache as decode_paged takes it (bf16 rows or the 656-byte FP8 rows); seq_lens int32 [B] on\n"
           "the device, each slot's length with this step's token (0: an empty slot, zero output);\n"
           "max_seq_len a host bound on them (reserve() it before capturing); index_cache the engine's\n"
           "index keys: uint8 [num_blocks, block_size, 132] in vLLM's FP8 layout (per block the e4m3\n"
           "values, then the fp32 scales; write_index_keys writes it) or bf16 [num_blocks, block_size,\n"
           "index_head_dim]; index_block_table int32 [B, max_blocks] (default: block_table). Graph-capturable.\n"
           "Returns a LayerStep.")
      .def("decode_multi", &dsa_step<StepForm::kDecodeMulti>, nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"),
           nb::arg("index_weights"), nb::arg("k_cache_row"), nb::arg("k_pe"), nb::arg("o"),
           nb::arg("stream").none() = nb::none(),
           "A multi-token step (speculative verification, MTP) with one top-k per token, each token's\n"
           "indexer limited to the context up to its own position. q_latent, q_pe and o [B, q_len, H,\n"
           "dim], q_index [B, q_len, index_heads, index_head_dim], index_weights fp32 [B, q_len,\n"
           "index_heads]; k_cache_row [q_len, B, 1, 1, latent + index_head_dim] and k_pe [q_len, B, 1, 1,\n"
           "rope], token-major. q_len = q_latent.shape[1], 1 .. 16. last_selected_positions() then has\n"
           "one row per (sequence, token). Returns a LayerStep.")
      .def("prefill", &dsa_step<StepForm::kPrefill>, nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"),
           nb::arg("index_weights"), nb::arg("k_cache_row"), nb::arg("k_pe"), nb::arg("o"),
           nb::arg("stream").none() = nb::none(),
           "Chunked prefill: appends num_tokens = q_latent.shape[1] tokens per active slot, then the DSA\n"
           "prefill indexer (each token's top-k over its own causal window) and the fused MLA prefill:\n"
           "the same sets and outputs as decoding the tokens one by one. Tensors as decode_multi's, any\n"
           "num_tokens. Refuses, before anything changes, latent/rope other than 512/64 and, on the\n"
           "GPU, f16. Graph-capturable for a fixed shape once run eagerly, with the slots all active.")
      .def("prefill_paged", &dsa_paged<true>, nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"),
           nb::arg("index_weights"), nb::arg("index_k"), nb::arg("o"), nb::arg("kv_cache"), nb::arg("block_table"),
           nb::arg("stream").none() = nb::none(),
           "Chunked prefill over an engine's paged MLA pool (kv_storage = KVStorage.ENGINE_PAGED): the\n"
           "engine has written the chunk's rows into kv_cache (as decode_paged takes it: bf16 rows\n"
           "[num_blocks, block_size, latent_dim + rope_dim] or the 656-byte FP8 rows) at each active\n"
           "slot's positions kv_lens[b] .. kv_lens[b] + num_tokens - 1; appends the chunk's indexer keys\n"
           "index_k [num_tokens, B, 1, 1, index_head_dim] (token-major), runs the DSA prefill indexer and\n"
           "the fused MLA prefill reading the rows through block_table int32 [B, max_blocks]. Queries,\n"
           "index_weights and o as prefill's, num_tokens = q_latent.shape[1]. The same selection and\n"
           "answer as prefill over the layer's own cache, with its refusals, and a table row too short\n"
           "for a slot refused before anything changes.")
      .def("prefill_pools", &dsa_pools_with<true>, nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"),
           nb::arg("index_weights"), nb::arg("o"), nb::arg("kv_cache"), nb::arg("block_table"), nb::arg("seq_lens"),
           nb::arg("max_seq_len"), nb::arg("index_cache"), nb::arg("index_block_table").none() = nb::none(),
           nb::arg("stream").none() = nb::none(), nb::arg("host_seq_lens").none() = nb::none(),
           "Chunked prefill over an engine's own pools (kv_storage = KVStorage.ENGINE_POOLS): the engine\n"
           "has written the chunk's MLA rows and index keys; the layer appends nothing and keeps nothing.\n"
           "kv_cache, block_table, index_cache and index_block_table as decode_pools takes them; seq_lens\n"
           "int32 [B] each slot's length with the chunk (0: a free slot, zero output), its chunk the last\n"
           "num_tokens = q_latent.shape[1] positions; max_seq_len a host bound on them. Queries,\n"
           "index_weights and o as prefill's. The same selection and answer as prefill_paged over a layer\n"
           "that keeps the same keys. host_seq_lens: the engine's host copy of seq_lens (a CPU int32\n"
           "array, as vLLM's seq_lens_cpu); given, the chunk is decided on it and reads nothing back\n"
           "(graph-capturable after one eager chunk of the same shape; a replay keeps the slots in the\n"
           "call); None: the lengths are read back once (on the GPU this synchronizes; not capturable).\n"
           "Refused by name before anything is written: a length other than 0 below\n"
           "num_tokens or above max_seq_len, or past the table's row, and every slot free. A key block id\n"
           "outside the pool selects nothing for the tokens that needed it and check_errors() names it.");

  m.def(
      "select_top_blocks_cpu",
      [](const BlockSparseConfig& config, int32_t batch, int64_t kv_len, const In& index_q, const In& index_keys) {
        const std::string op = "select_top_blocks_cpu";
        const std::vector<float> q = host_floats(op, index_q, "index_q", {batch, config.num_kv_heads, config.head_dim},
                                                 "[batch, num_kv_heads, head_dim]");
        const std::vector<float> keys =
            host_floats(op, index_keys, "index_keys", {batch, kv_len, config.head_dim}, "[batch, kv_len, head_dim]");
        std::vector<int32_t> ids = select_top_blocks_cpu(config, batch, kv_len, q.data(), keys);
        const size_t requests = static_cast<size_t>(batch) * static_cast<size_t>(config.num_kv_heads);
        const size_t per = requests ? ids.size() / requests : 0;
        return numpy_int32(std::move(ids), {requests, per});
      },
      nb::arg("config"), nb::arg("batch"), nb::arg("kv_len"), nb::arg("index_q"), nb::arg("index_keys"),
      "The block-sparse indexer on the host: int32 [batch * num_kv_heads, blocks_per_request] block ids\n"
      "(top-k by max-pooled index scores, then the final block). index_q fp32 [B, Hkv, D], index_keys\n"
      "fp32 [B, kv_len, D].");

  nb::class_<DsaPrefillIndexer>(
      m, "DsaPrefillIndexer",
      "The DSA lightning indexer over a prefill chunk (sparsepage/prefill.h), what an engine runs before\n"
      "the sparse MLA prefill: each of a sequence's num_tokens query tokens, the last num_tokens of its\n"
      "L_b positions, keeps its top-k positions over its own causal window (every position while the\n"
      "window holds topk or fewer). Keeps its workspace for the last chunk shape (re-planned when it\n"
      "changes); a run of a prepared shape allocates and reads back nothing (capturable on CUDA).")
      .def(nb::init<Device, size_t>(), nb::arg("device"), nb::arg("workspace_budget") = size_t{512} << 20)
      .def_prop_ro("rows_per_pass", &DsaPrefillIndexer::rows_per_pass, "Tokens per CUDA pass (0 before a run).")
      .def("run", &dsa_prefill_run, nb::arg("q_index"), nb::arg("weights"), nb::arg("positions"), nb::arg("counts"),
           nb::kw_only(), nb::arg("kv_len"), nb::arg("kv_lens").none() = nb::none(),
           nb::arg("k_cache").none() = nb::none(), nb::arg("key_column") = 0,
           nb::arg("index_cache").none() = nb::none(), nb::arg("index_block_table").none() = nb::none(),
           nb::arg("stream").none() = nb::none(),
           "q_index [batch, num_tokens, index_heads, index_head_dim] (bf16 / f16; fp32 on the CPU too),\n"
           "weights fp32 [batch, num_tokens, index_heads]; writes positions int32 [batch, num_tokens, topk]\n"
           "(each token's kept positions increasing, then -1) and counts int32 [batch, num_tokens]\n"
           "(min(topk, its window)). kv_len: the host bound of every L_b; kv_lens: int32 [batch] L_b on\n"
           "the device (None: kv_len for all), each at least num_tokens. The keys: dense k_cache [batch,\n"
           "capacity, key_column + index_head_dim] (the key in the last index_head_dim columns), or an\n"
           "engine's index_cache [num_blocks, block_size, index_head_dim] in q's dtype or uint8 [num_blocks,\n"
           "block_size, 132] (vLLM's FP8 blocks) with index_block_table int32 [batch, max_blocks]. CUDA\n"
           "runs on `stream`, else torch's current stream.");

  nb::class_<GqaBlockPrefill>(
      m, "GqaBlockPrefill",
      "The GQA block prefill (sparsepage/prefill.h), block-sparse attention over a prefill chunk as\n"
      "FlashInfer's BSR attention runs it: each query block of block_size tokens attends its kept key\n"
      "blocks, each token up to its own position, reading a gathered row once per query block. Keeps\n"
      "its plans for the last chunk shape (re-planned when it changes).")
      .def(nb::init<Device>(), nb::arg("device"))
      .def_prop_ro("kernel_name", [](const GqaBlockPrefill& p) { return std::string(p.kernel_name()); })
      .def(
          "check_errors", [](GqaBlockPrefill& p, uintptr_t stream) { p.check_errors(stream_ptr(stream)); },
          nb::arg("stream") = 0,
          "CUDA: synchronizes and raises naming what the last run flagged (a listed block at or past its\n"
          "query block's end, a chunk start off the block grid). The CPU raises in the run instead.")
      .def("run", &gqa_prefill_run, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("block_ids"),
           nb::arg("counts"), nb::kw_only(), nb::arg("block_size"), nb::arg("scale"), nb::arg("kv_len"),
           nb::arg("kv_lens").none() = nb::none(), nb::arg("block_table").none() = nb::none(),
           nb::arg("lse").none() = nb::none(), nb::arg("k_scale").none() = nb::none(),
           nb::arg("v_scale").none() = nb::none(), nb::arg("stream").none() = nb::none(),
           "q [batch, num_tokens, num_qo_heads, head_dim], o likewise (head_dim of v), bf16 / f16 (fp32 on\n"
           "the CPU too); the chunk is the last num_tokens of each sequence's L_b positions (kv_len: the\n"
           "host bound; kv_lens: int32 [batch] on the device, or None for kv_len), starting on a multiple\n"
           "of block_size. K and V dense [batch, num_kv_heads, capacity, head_dim], or an engine's pool\n"
           "[num_blocks, block_size, num_kv_heads, head_dim] with block_table int32 [batch, max_blocks].\n"
           "block_ids int32 [batch, num_query_blocks, num_kv_heads, width] (one list per KV head) or\n"
           "[batch, num_kv_heads, num_query_blocks, group_size, width] (one per query head): absolute key\n"
           "block ids, full blocks once, the query block's own block last; counts (their shape without\n"
           "width) the positions each list covers. lse fp32 [batch, num_tokens, num_qo_heads] if given.\n"
           "K and V as uint8 are vLLM's fp8 KV cache (e4m3, K of KV head h read as k * k_scale[h], V as\n"
           "v * v_scale[h]; k_scale and v_scale fp32 [num_kv_heads]; CUDA at head_dim 128).");

  m.def(
      "dsa_select_tokens_cpu",
      [](const DsaConfig& config, int32_t batch, int64_t kv_len, const In& q_index, const In& weights,
         const In& index_keys) {
        const std::string op = "dsa_select_tokens_cpu";
        const std::vector<float> q =
            host_floats(op, q_index, "q_index", {batch, config.index_heads, config.index_head_dim},
                        "[batch, index_heads, index_head_dim]");
        const std::vector<float> w =
            host_floats(op, weights, "weights", {batch, config.index_heads}, "[batch, index_heads]");
        const std::vector<float> keys = host_floats(
            op, index_keys, "index_keys", {batch, kv_len, config.index_head_dim}, "[batch, kv_len, index_head_dim]");
        Rows rows = dsa_select_tokens_cpu(config, batch, kv_len, q.data(), w.data(), keys);
        std::vector<int32_t> flat;
        for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
        const size_t per = rows.empty() ? 0 : rows[0].size();
        return numpy_int32(std::move(flat), {rows.size(), per});
      },
      nb::arg("config"), nb::arg("batch"), nb::arg("kv_len"), nb::arg("q_index"), nb::arg("weights"),
      nb::arg("index_keys"),
      "The DSA lightning indexer on the host: int32 [batch, min(index_topk, kv_len)] positions in\n"
      "descending score order. q_index fp32 [B, index_heads, index_head_dim], weights fp32\n"
      "[B, index_heads], index_keys fp32 [B, kv_len, index_head_dim].");

  m.def(
      "write_index_keys",
      [](const Out& index_cache, const In& keys, const In& slots, const std::optional<uintptr_t>& stream) {
        const std::string op = "write_index_keys";
        const Tensor k = describe(keys, op, "keys"), sl = describe(slots, op, "slots");
        k.require_ndim(2, "[num_tokens, index_head_dim]");
        k.require_contiguous();
        const int32_t dim = to_int32(k.shape[1], op, "keys.shape[1]");
        const Tensor c = describe(index_cache, op, "index_cache");
        const PagedIndexKeys pool = index_cache_pool(op, In(index_cache), c.device, dim);  // slots, no table
        if (sl.dtype.code != static_cast<uint8_t>(nb::dlpack::dtype_code::Int) || sl.dtype.bits != 64) {
          sl.fail("must be int64 slot ids (block * block_size + offset; -1 skips)");
        }
        sl.require_shape({k.shape[0]}, "[num_tokens]");
        sl.require_contiguous();
        if (common_device(op, {c, k, sl}) == Device::kCuda) {
          DeviceGuard guard(c);
          void* st = stream ? stream_ptr(*stream) : torch_current_stream();
          write_index_keys_cuda(pool, dim, k.float_dtype(), k.data, k.shape[1], static_cast<const int64_t*>(sl.data),
                                k.shape[0], IndexScaleFormat::kUe8m0, nullptr, st);
        } else {
          write_index_keys_cpu(pool, dim, k.float_dtype(), k.data, k.shape[1], static_cast<const int64_t*>(sl.data),
                               k.shape[0]);
        }
      },
      nb::arg("index_cache"), nb::arg("keys"), nb::arg("slots"), nb::arg("stream").none() = nb::none(),
      "Writes index keys into an engine's index-key pool at slot ids, as vLLM's cache write does:\n"
      "keys [num_tokens, index_head_dim] (f16/bf16) go to slots int64 [num_tokens] (block * block_size\n"
      "+ offset; -1 skips) of index_cache: uint8 [num_blocks, block_size, 132] (vLLM's FP8 layout,\n"
      "each key quantized with a power-of-two scale) or [num_blocks, block_size, index_head_dim] in\n"
      "the keys' dtype (copied). CPU or CUDA (capturable; a slot past the pool is skipped there and\n"
      "refused by name on the CPU).");

  m.def("dsa_indexer_workspace_bytes", &dsa_indexer_workspace_bytes, nb::arg("config"), nb::arg("batch"),
        nb::arg("max_kv_len"), "Workspace bytes dsa_select_tokens_cuda needs for windows up to max_kv_len.");
  m.def(
      "dsa_select_tokens_cuda",
      [](const DsaConfig& config, const In& k_cache, const In& kv_lens, int64_t max_kv_len, const In& q_index,
         const In& weights, const Out& workspace, const Out& positions, const Out& counts, uintptr_t stream) {
        const std::string op = "dsa_select_tokens_cuda";
        const Tensor k = describe(k_cache, op, "k_cache"), l = describe(kv_lens, op, "kv_lens"),
                     q = describe(q_index, op, "q_index"), w = describe(weights, op, "weights"),
                     ws = describe(workspace, op, "workspace"), p = describe(positions, op, "positions"),
                     c = describe(counts, op, "counts");
        if (common_device(op, {k, l, q, w, ws, p, c}) != Device::kCuda)
          throw Error(op + ": every tensor must be a CUDA tensor (use dsa_select_tokens_cpu on the host)");
        k.require_ndim(4, "[batch, 1, capacity, latent_dim + index_head_dim]");
        k.require_contiguous();
        q.require_ndim(3, "[batch, index_heads, index_head_dim]");
        q.require_contiguous();
        w.require_float32();
        w.require_contiguous();
        ws.require_contiguous();
        DsaIndexerArgs a;
        a.dtype = k.float_dtype();
        q.require_same_dtype(k);
        const int32_t batch = to_int32(q.shape[0], op, "q_index.shape[0]");
        if (k.shape[0] != batch)
          k.fail("has batch " + std::to_string(k.shape[0]) + " but q_index " + std::to_string(batch));
        l.require_int32_array({batch}, "[batch]");
        c.require_int32_array({batch}, "[batch]");
        p.require_int32_array({batch, config.index_topk}, "[batch, index_topk]");
        a.k_cache = k.data;
        a.capacity = k.shape[2];
        a.kv_lens = static_cast<const int32_t*>(l.data);
        a.max_kv_len = max_kv_len;
        a.q_index = q.data;
        a.weights = static_cast<const float*>(w.data);
        a.workspace = ws.data;
        a.workspace_bytes = ws.nbytes();
        a.positions = static_cast<int32_t*>(p.data);
        a.counts = static_cast<int32_t*>(c.data);
        DeviceGuard guard(k);
        dsa_select_tokens_cuda(config, batch, a, stream_ptr(stream));
      },
      nb::arg("config"), nb::arg("k_cache"), nb::arg("kv_lens"), nb::arg("max_kv_len"), nb::arg("q_index"),
      nb::arg("weights"), nb::arg("workspace"), nb::arg("positions"), nb::arg("counts"), nb::arg("stream") = 0,
      "The DSA indexer on the GPU (graph-capturable): k_cache is the layer's K allocation\n"
      "[batch, 1, capacity, latent_dim + index_head_dim]; kv_lens int32 [batch] live lengths read on\n"
      "the device (<= max_kv_len); workspace of dsa_indexer_workspace_bytes(config, batch, max_kv_len)\n"
      "bytes, 16-byte aligned; positions int32 out [batch, index_topk], increasing, -1 past counts (int32 out "
      "[batch]).");
}

}  // namespace sparsepage::py
