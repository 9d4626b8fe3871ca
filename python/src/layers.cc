// Bindings of the two layers (block-sparse, DSA) and their indexers. The
// layers own their dense caches; a step takes one token's projected inputs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "sparsepage/fp8.h"
#include "sparsepage/models/block_sparse.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/models/static_block_sparse.h"
#include "tensor.h"

namespace sparsepage::py {
namespace {

// A tensor argument on the layer's device.
void require_layer_device(const Tensor& t, Device device) {
  if (t.device != device) t.fail(std::string("lives on ") + device_name(t.device) + " but the layer on " + device_name(device));
}

// A data argument: on the layer's device, in the layer's dtype.
void require_layer_data(const Tensor& t, Device device, DType dtype) {
  require_layer_device(t, device);
  if (t.float_dtype() != dtype) t.fail(std::string("has dtype ") + dtype_name(t.float_dtype()) + " but the layer stores " + dtype_name(dtype));
}

// A step argument: on the layer's device, in `dtype`, contiguous, of `shape`.
const void* step_arg(const std::string& op, const In& a, const char* name, Device device, DType dtype,
                     std::initializer_list<int64_t> shape, const char* layout, Tensor* keep = nullptr) {
  Tensor t = describe(a, op, name);
  require_layer_data(t, device, dtype);
  t.require_shape(shape, layout);
  t.require_contiguous();
  if (keep) *keep = t;
  return t.data;
}

// The fp32 index weights of a step: on the layer's device, contiguous, of `shape`.
const float* weights_arg(const std::string& op, const In& a, Device device, std::initializer_list<int64_t> shape,
                         const char* layout) {
  Tensor w = describe(a, op, "index_weights");
  if (w.device != device) w.fail("lives on another device than the layer");
  w.require_float32();
  w.require_shape(shape, layout);
  w.require_contiguous();
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
  Tensor t = describe(a, op, name);
  if (t.device != Device::kCpu) t.fail("must be a host array");
  t.require_float32();
  t.require_shape(shape, layout);
  t.require_contiguous();
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
  if (heads > 0 && t.shape[2] != heads) t.fail("has " + std::to_string(t.shape[2]) + " heads; the layer has " + std::to_string(heads) + " " + layout);
  if (t.shape[last] != width) t.fail("rows are " + std::to_string(t.shape[last]) + " wide, expected " + std::to_string(width) + " " + layout);
  if (t.shape[last] > 1 && t.strides[last] != 1) t.fail("must have unit stride in its last dim");
  if (t.shape[0] > 1 && t.strides[0] != t.shape[1] * t.strides[1]) {
    t.fail("must hold each block's rows one after another (stride of dim 0 = block_size * stride of dim 1)");
  }
  RowView v;
  v.data = t.data;
  v.row_stride = t.strides[1];
  v.dim = dim;
  v.head_stride = heads > 1 ? t.strides[2] : 0;
  v.capacity = t.shape[0] * t.shape[1];
  *block_size = to_int32(t.shape[1], op, std::string(name) + "'s block size");
  return v;
}

// The engine's block table: int32 [batch, max_blocks] on the layer's device, unit stride in its last dim.
BlockTable engine_table(const std::string& op, const In& a, Device device, int32_t batch, int32_t block_size,
                        int64_t num_blocks) {
  Tensor t = describe(a, op, "block_table");
  require_layer_device(t, device);
  t.require_int32();
  t.require_ndim(2, "[batch, max_blocks]");
  if (t.shape[0] != batch) t.fail("has " + std::to_string(t.shape[0]) + " rows; the layer's batch is " + std::to_string(batch));
  if (t.shape[1] > 1 && t.strides[1] != 1) t.fail("must have unit stride in its last dim");
  BlockTable b;
  b.data = static_cast<const int32_t*>(t.data);
  b.num_rows = batch;
  b.max_blocks = to_int32(t.shape[1], op, "block_table's width");
  b.row_stride = t.shape[0] > 1 ? t.strides[0] : t.shape[1];
  b.block_size = block_size;
  b.num_blocks = num_blocks;
  return b;
}

struct PyBlockSparse {
  PyBlockSparse(Device on, DType type, const BlockSparseConfig& c, int32_t b, std::optional<DispatchConfig> dispatch)
      : device(on), dtype(type), config(c), batch(b),
        layer(on, type, c, b, dispatch ? *dispatch : process_dispatch_config()) {}
  Device device;
  DType dtype;
  BlockSparseConfig config;
  int32_t batch;
  BlockSparseAttention layer;

  BlockSparseTokens tokens(const std::string& op, const In& q, const In& index_q, const In& k, const In& v,
                           const Out& o) const {
    const int64_t B = batch, Hq = config.num_qo_heads, Hk = config.num_kv_heads, D = config.head_dim;
    BlockSparseTokens t;
    t.q = step_arg(op, q, "q", device, dtype, {B, Hq, D}, "[batch, num_qo_heads, head_dim]");
    t.index_q = step_arg(op, index_q, "index_q", device, dtype, {B, Hk, D}, "[batch, num_kv_heads, head_dim]");
    t.k = step_arg(op, k, "k", device, dtype, {B, Hk + 1, 1, D}, "[batch, num_kv_heads + 1, 1, head_dim] (keys, then the index key)");
    t.v = step_arg(op, v, "v", device, dtype, {B, Hk, 1, D}, "[batch, num_kv_heads, 1, head_dim]");
    t.o = const_cast<void*>(step_arg(op, In(o), "o", device, dtype, {B, Hq, D}, "[batch, num_qo_heads, head_dim]"));
    return t;
  }
  // A multi-token step's tensors: q_len from q [batch, q_len, num_qo_heads, head_dim].
  BlockSparseTokens multi_tokens(const std::string& op, const In& q, const In& index_q, const In& k, const In& v,
                                 const Out& o, int32_t* q_len) const {
    const int64_t B = batch, Hq = config.num_qo_heads, Hk = config.num_kv_heads, D = config.head_dim;
    const char* q_layout = "[batch, q_len, num_qo_heads, head_dim]";
    *q_len = step_q_len(op, q, "q", q_layout);
    const int64_t T = *q_len;
    BlockSparseTokens t;
    t.q = step_arg(op, q, "q", device, dtype, {B, T, Hq, D}, q_layout);
    t.index_q = step_arg(op, index_q, "index_q", device, dtype, {B, T, Hk, D}, "[batch, q_len, num_kv_heads, head_dim]");
    t.k = step_arg(op, k, "k", device, dtype, {T, B, Hk + 1, 1, D},
                   "[q_len, batch, num_kv_heads + 1, 1, head_dim] (token-major; keys, then the index key)");
    t.v = step_arg(op, v, "v", device, dtype, {T, B, Hk, 1, D}, "[q_len, batch, num_kv_heads, 1, head_dim] (token-major)");
    t.o = const_cast<void*>(step_arg(op, In(o), "o", device, dtype, {B, T, Hq, D}, "[batch, q_len, num_qo_heads, head_dim]"));
    return t;
  }
  // An engine-paged step: the index key instead of k and v.
  BlockSparseTokens engine_tokens(const std::string& op, const In& q, const In& index_q, const In& index_k,
                                  const Out& o) const {
    const int64_t B = batch, Hq = config.num_qo_heads, Hk = config.num_kv_heads, D = config.head_dim;
    BlockSparseTokens t;
    t.q = step_arg(op, q, "q", device, dtype, {B, Hq, D}, "[batch, num_qo_heads, head_dim]");
    t.index_q = step_arg(op, index_q, "index_q", device, dtype, {B, Hk, D}, "[batch, num_kv_heads, head_dim]");
    t.index_k = step_arg(op, index_k, "index_k", device, dtype, {B, 1, 1, D}, "[batch, 1, 1, head_dim]");
    t.o = const_cast<void*>(step_arg(op, In(o), "o", device, dtype, {B, Hq, D}, "[batch, num_qo_heads, head_dim]"));
    return t;
  }
  EnginePagedKV engine_kv(const std::string& op, const In& k_cache, const In& v_cache, const In& block_table) const {
    const int32_t Hk = config.num_kv_heads, D = config.head_dim;
    const char* layout = "[num_blocks, block_size, num_kv_heads, head_dim]";
    int32_t kb = 0, vb = 0;
    EnginePagedKV kv;
    kv.k = engine_pool(op, k_cache, "k_cache", device, dtype, Hk, D, D, layout, &kb);
    kv.v = engine_pool(op, v_cache, "v_cache", device, dtype, Hk, D, D, layout, &vb);
    if (kb != vb || kv.k.capacity != kv.v.capacity) {
      throw Error(op + ": k_cache and v_cache must have the same num_blocks and block_size");
    }
    kv.block_table = engine_table(op, block_table, device, batch, kb, kv.k.capacity / kb);
    return kv;
  }
};

struct PyStaticBlockSparse {
  PyStaticBlockSparse(Device on, DType type, const StaticBlockSparseConfig& c, int32_t b,
                      std::optional<DispatchConfig> dispatch)
      : device(on), dtype(type), config(c), batch(b),
        layer(on, type, c, b, dispatch ? *dispatch : process_dispatch_config()) {}
  Device device;
  DType dtype;
  StaticBlockSparseConfig config;
  int32_t batch;
  StaticBlockSparseAttention layer;

  StaticBlockSparseTokens tokens(const std::string& op, const In& q, const In& k, const In& v, const Out& o) const {
    const int64_t B = batch, Hq = config.num_qo_heads, Hk = config.num_kv_heads, D = config.head_dim;
    StaticBlockSparseTokens t;
    t.q = step_arg(op, q, "q", device, dtype, {B, Hq, D}, "[batch, num_qo_heads, head_dim]");
    t.k = step_arg(op, k, "k", device, dtype, {B, Hk, 1, D}, "[batch, num_kv_heads, 1, head_dim]");
    t.v = step_arg(op, v, "v", device, dtype, {B, Hk, 1, D}, "[batch, num_kv_heads, 1, head_dim]");
    t.o = const_cast<void*>(step_arg(op, In(o), "o", device, dtype, {B, Hq, D}, "[batch, num_qo_heads, head_dim]"));
    return t;
  }
};

struct PyDsa {
  PyDsa(Device on, DType type, const DsaConfig& c, int32_t b, std::optional<DispatchConfig> dispatch)
      : device(on), dtype(type), config(c), batch(b), layer(on, type, c, b, dispatch ? *dispatch : process_dispatch_config()) {}
  Device device;
  DType dtype;
  DsaConfig config;
  int32_t batch;
  DsaAttention layer;

  // The queries, index weights and output of a step (both forms).
  DsaTokens queries(const std::string& op, const In& q_latent, const In& q_pe, const In& q_index,
                    const In& index_weights, const Out& o) const {
    const int64_t B = batch, H = config.num_qo_heads, L = config.latent_dim, R = config.rope_dim,
                  IH = config.index_heads, ID = config.index_head_dim;
    DsaTokens t;
    t.q_latent = step_arg(op, q_latent, "q_latent", device, dtype, {B, H, L}, "[batch, num_qo_heads, latent_dim]");
    t.q_pe = step_arg(op, q_pe, "q_pe", device, dtype, {B, H, R}, "[batch, num_qo_heads, rope_dim]");
    t.q_index = step_arg(op, q_index, "q_index", device, dtype, {B, IH, ID}, "[batch, index_heads, index_head_dim]");
    t.index_weights = weights_arg(op, index_weights, device, {B, IH}, "[batch, index_heads]");
    t.o = const_cast<void*>(step_arg(op, In(o), "o", device, dtype, {B, H, L}, "[batch, num_qo_heads, latent_dim]"));
    return t;
  }
  DsaTokens tokens(const std::string& op, const In& q_latent, const In& q_pe, const In& q_index,
                   const In& index_weights, const In& k_cache_row, const In& k_pe, const Out& o) const {
    DsaTokens t = queries(op, q_latent, q_pe, q_index, index_weights, o);
    t.k_cache_row = step_arg(op, k_cache_row, "k_cache_row", device, dtype,
                             {batch, 1, 1, config.latent_dim + config.index_head_dim},
                             "[batch, 1, 1, latent_dim + index_head_dim]");
    t.k_pe = step_arg(op, k_pe, "k_pe", device, dtype, {batch, 1, 1, config.rope_dim}, "[batch, 1, 1, rope_dim]");
    return t;
  }
  // A multi-token step's tensors: q_len from q_latent [batch, q_len, num_qo_heads, latent_dim].
  DsaTokens multi_tokens(const std::string& op, const In& q_latent, const In& q_pe, const In& q_index,
                         const In& index_weights, const In& k_cache_row, const In& k_pe, const Out& o,
                         int32_t* q_len) const {
    const int64_t B = batch, H = config.num_qo_heads, L = config.latent_dim, R = config.rope_dim,
                  IH = config.index_heads, ID = config.index_head_dim;
    const char* q_layout = "[batch, q_len, num_qo_heads, latent_dim]";
    *q_len = step_q_len(op, q_latent, "q_latent", q_layout);
    const int64_t T = *q_len;
    DsaTokens t;
    t.q_latent = step_arg(op, q_latent, "q_latent", device, dtype, {B, T, H, L}, q_layout);
    t.q_pe = step_arg(op, q_pe, "q_pe", device, dtype, {B, T, H, R}, "[batch, q_len, num_qo_heads, rope_dim]");
    t.q_index = step_arg(op, q_index, "q_index", device, dtype, {B, T, IH, ID},
                         "[batch, q_len, index_heads, index_head_dim]");
    t.index_weights = weights_arg(op, index_weights, device, {B, T, IH}, "[batch, q_len, index_heads]");
    t.k_cache_row = step_arg(op, k_cache_row, "k_cache_row", device, dtype, {T, B, 1, 1, L + ID},
                             "[q_len, batch, 1, 1, latent_dim + index_head_dim] (token-major)");
    t.k_pe = step_arg(op, k_pe, "k_pe", device, dtype, {T, B, 1, 1, R}, "[q_len, batch, 1, 1, rope_dim] (token-major)");
    t.o = const_cast<void*>(step_arg(op, In(o), "o", device, dtype, {B, T, H, L}, "[batch, q_len, num_qo_heads, latent_dim]"));
    return t;
  }
  // An engine-paged step: the indexer key instead of the cache rows.
  DsaTokens engine_tokens(const std::string& op, const In& q_latent, const In& q_pe, const In& q_index,
                          const In& index_weights, const In& index_k, const Out& o) const {
    DsaTokens t = queries(op, q_latent, q_pe, q_index, index_weights, o);
    t.index_k = step_arg(op, index_k, "index_k", device, dtype, {batch, 1, 1, config.index_head_dim},
                         "[batch, 1, 1, index_head_dim]");
    return t;
  }
  EnginePagedKV engine_kv(const std::string& op, const In& kv_cache, const In& block_table) const {
    const int32_t L = config.latent_dim, R = config.rope_dim;
    const char* layout = "[num_blocks, block_size, latent_dim + rope_dim]";
    int32_t bs = 0;
    EnginePagedKV kv;
    if (Tensor t = describe(kv_cache, op, "kv_cache"); t.dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt)) {
      return fp8_kv(t, op, block_table);
    }
    kv.k = engine_pool(op, kv_cache, "kv_cache", device, dtype, 0, L + R, L, layout, &bs);
    kv.v = kv.k;        // V = the latent columns
    kv.k_extra = kv.k;  // the rope columns of the same rows
    kv.k_extra.data = static_cast<const char*>(kv.k.data) + int64_t{L} * static_cast<int64_t>(dtype_size(dtype));
    kv.k_extra.dim = R;
    kv.block_table = engine_table(op, block_table, device, batch, bs, kv.k.capacity / bs);
    return kv;
  }
  // The engines' FP8 MLA pool: uint8 [num_blocks, block_size, row_bytes], each
  // row the 656-byte format (fp8.h) and row_bytes >= 656 apart.
  EnginePagedKV fp8_kv(Tensor& t, const std::string& op, const In& block_table) const {
    const char* layout = "[num_blocks, block_size, row_bytes] uint8 (656-byte FP8 MLA rows)";
    require_layer_device(t, device);
    if (t.dtype.bits != 8 || t.dtype.lanes != 1) t.fail("has dtype " + t.dtype_str() + "; an FP8 pool is uint8");
    if (dtype != DType::kBF16) t.fail("holds FP8 MLA rows, whose rope is bf16: the layer must be bf16");
    if (config.latent_dim != MlaFp8Row::kLatent || config.rope_dim != MlaFp8Row::kRope)
      t.fail("holds FP8 MLA rows of 512 latent + 64 rope values; the layer has " + std::to_string(config.latent_dim) +
             " + " + std::to_string(config.rope_dim));
    t.require_ndim(3, layout);
    if (t.shape[2] < MlaFp8Row::kBytes)
      t.fail("rows are " + std::to_string(t.shape[2]) + " bytes, fewer than the format's 656; expected " + layout);
    if (t.strides[2] != 1) t.fail("must have unit stride in its last dim");
    if (t.shape[0] > 1 && t.strides[0] != t.shape[1] * t.strides[1])
      t.fail("must hold each block's rows one after another (stride of dim 0 = block_size * stride of dim 1)");
    const MlaFp8Views views = mla_fp8_views(t.data, t.shape[0] * t.shape[1], t.strides[1]);
    EnginePagedKV kv{views.k, views.v, views.k_extra, {}};
    kv.kv_format = KvFormat::kE4m3Mla;
    const int32_t bs = to_int32(t.shape[1], op, "kv_cache's block size");
    kv.block_table = engine_table(op, block_table, device, batch, bs, t.shape[0]);
    return kv;
  }
};

}  // namespace

void bind_layers(nb::module_& m) {
  nb::enum_<KVStorage>(m, "KVStorage", "Where a layer's attention rows live.")
      .value("LAYER_CACHE", KVStorage::kLayerCache, "The layer's own dense [B, H, Cap, D] cache (the default).")
      .value("ENGINE_PAGED", KVStorage::kEnginePaged,
             "An engine's paged pool, read in place through its block table (decode_paged); the engine\n"
             "writes each token's rows, the layer keeps only its indexer's keys. Fused path only.");

  nb::class_<BlockSparseConfig>(m, "BlockSparseConfig", "Geometry of the block-sparse (MiniMax-M3-style) layer.")
      .def(
          "__init__",
          [](BlockSparseConfig* c, int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
             int32_t topk_blocks, int32_t local_blocks, int64_t capacity_step, KVStorage kv_storage) {
            new (c) BlockSparseConfig{num_qo_heads, num_kv_heads, head_dim, block_size, topk_blocks, local_blocks,
                                      capacity_step};
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

  nb::class_<BlockSparseStep>(m, "BlockSparseStep", "What a block-sparse decode step did.")
      .def_ro("sparse_regime", &BlockSparseStep::sparse_regime)
      .def_ro("fused", &BlockSparseStep::fused)
      .def_ro("outcome", &BlockSparseStep::outcome);

  nb::class_<PyBlockSparse>(m, "BlockSparseAttention",
                            "The block-sparse attention layer: an indexer keeps the top-k key blocks per KV head\n"
                            "and decode attends them through the fused paged decode, falling back to the mask\n"
                            "path on any decline. The layer owns its dense [B, H, Cap, D] cache (f16 or bf16).\n"
                            "Step tensors: q [B, Hq, D], index_q [B, Hkv, D], k [B, Hkv + 1, 1, D] (keys, then the\n"
                            "index key), v [B, Hkv, 1, D], o [B, Hq, D]; contiguous, on the layer's device.")
      .def(nb::init<Device, DType, const BlockSparseConfig&, int32_t, std::optional<DispatchConfig>>(),
           nb::arg("device"), nb::arg("dtype"), nb::arg("config"), nb::arg("batch"), nb::arg("dispatch") = nb::none())
      .def(
          "prefill_token",
          [](PyBlockSparse& self, const In& q, const In& index_q, const In& k, const In& v, const Out& o,
             uintptr_t stream) {
            self.layer.prefill_token(self.tokens("BlockSparseAttention.prefill_token", q, index_q, k, v, o),
                                     stream_ptr(stream));
          },
          nb::arg("q"), nb::arg("index_q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("stream") = 0,
          "Appends the token and attends causally to the whole window (dense).")
      .def(
          "decode",
          [](PyBlockSparse& self, const In& q, const In& index_q, const In& k, const In& v, const Out& o,
             uintptr_t stream) {
            return self.layer.decode(self.tokens("BlockSparseAttention.decode", q, index_q, k, v, o), stream_ptr(stream));
          },
          nb::arg("q"), nb::arg("index_q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("stream") = 0,
          "Appends the token; in the sparse regime runs the indexer and tries the fused path, falling\n"
          "back to the block mask over the same set. Returns a BlockSparseStep.")
      .def(
          "decode_paged",
          [](PyBlockSparse& self, const In& q, const In& index_q, const In& index_k, const Out& o, const In& k_cache,
             const In& v_cache, const In& block_table, uintptr_t stream) {
            const std::string op = "BlockSparseAttention.decode_paged";
            return self.layer.decode(self.engine_tokens(op, q, index_q, index_k, o),
                                     self.engine_kv(op, k_cache, v_cache, block_table), stream_ptr(stream));
          },
          nb::arg("q"), nb::arg("index_q"), nb::arg("index_k"), nb::arg("o"), nb::arg("k_cache"), nb::arg("v_cache"),
          nb::arg("block_table"), nb::arg("stream") = 0,
          "Decode over an engine's paged pool (kv_storage = KVStorage.ENGINE_PAGED): appends the index key\n"
          "index_k [B, 1, 1, D], runs the indexer, and attends the kept blocks of k_cache / v_cache\n"
          "[num_blocks, block_size, Hkv, D] in place through block_table int32 [B, max_blocks] (row b:\n"
          "sequence b's blocks). The engine must already have written this token's K and V at position\n"
          "kv_len (the length before the call). In the dense regime every block is attended. No mask\n"
          "path: a step the dispatch would decline raises, and nothing is appended.")
      .def(
          "decode_multi",
          [](PyBlockSparse& self, const In& q, const In& index_q, const In& k, const In& v, const Out& o,
             uintptr_t stream) {
            int32_t q_len = 0;
            const BlockSparseTokens t = self.multi_tokens("BlockSparseAttention.decode_multi", q, index_q, k, v, o, &q_len);
            return self.layer.decode(t, q_len, stream_ptr(stream));
          },
          nb::arg("q"), nb::arg("index_q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("stream") = 0,
          "A multi-token step (speculative verification, MTP): appends q_len tokens per sequence and\n"
          "attends them, token t seeing the context up to its own position. q and o [B, q_len, Hq, D],\n"
          "index_q [B, q_len, Hkv, D] (a sequence's tokens consecutive, as engines lay them out); k\n"
          "[q_len, B, Hkv + 1, 1, D] and v [q_len, B, Hkv, 1, D], token-major (each slice what decode\n"
          "takes). q_len = q.shape[1], 1 .. 16 (on the GPU, q_len * Hkv <= 32). In the sparse regime\n"
          "one selection serves the step (a block scores the max over the tokens' index queries) and\n"
          "the fused kernel applies each token's causal limit; otherwise the step runs as q_len\n"
          "one-token decodes. Returns a BlockSparseStep.")
      .def("last_blocks", [](const PyBlockSparse& self) { return self.layer.last_blocks(); },
           "Selected blocks of the last sparse decode, per request (host copy).")
      .def("last_selected_positions", [](const PyBlockSparse& self) { return self.layer.last_selected_positions(); },
           "Positions the page table of the last sparse decode attends, per request.")
      .def("last_mask_columns", [](PyBlockSparse& self) { return self.layer.last_mask_columns(); },
           "Columns the mask path keeps for the last sparse decode, per request.")
      .def(
          "reserve", [](PyBlockSparse& self, int64_t tokens) { self.layer.reserve(tokens); }, nb::arg("tokens"),
          "Makes room for `tokens` live tokens and sizes the step's buffers, so steps up to that length\n"
          "allocate nothing (do it before capturing steps in a graph).")
      .def(
          "append_tokens",
          [](PyBlockSparse& self, const In& k, const std::optional<In>& v) {
            const std::string op = "BlockSparseAttention.append_tokens";
            const Tensor kt = describe(k, op, "k");
            if (self.config.kv_storage == KVStorage::kEnginePaged) {
              kt.require_ndim(4, "[batch, 1, tokens, head_dim] (the index keys)");
              const int64_t n = kt.shape[2];
              const void* kp = step_arg(op, k, "k", self.device, self.dtype, {self.batch, 1, n, self.config.head_dim},
                                        "[batch, 1, tokens, head_dim] (the index keys)");
              if (v) throw Error(op + ": v must be None for an engine-paged layer (the engine holds the values)");
              self.layer.append_tokens(kp, nullptr, n);
              return;
            }
            if (!v) throw Error(op + ": v must be given");
            kt.require_ndim(4, "[batch, num_kv_heads + 1, tokens, head_dim]");
            const int64_t B = self.batch, Hk = self.config.num_kv_heads, D = self.config.head_dim, n = kt.shape[2];
            const void* kp = step_arg(op, k, "k", self.device, self.dtype, {B, Hk + 1, n, D},
                                      "[batch, num_kv_heads + 1, tokens, head_dim] (keys, then the index key)");
            const void* vp = step_arg(op, *v, "v", self.device, self.dtype, {B, Hk, n, D},
                                      "[batch, num_kv_heads, tokens, head_dim]");
            self.layer.append_tokens(kp, vp, n);
          },
          nb::arg("k"), nb::arg("v").none(),
          "Appends a prompt's tokens to the cache without attending (its prefill ran elsewhere): k\n"
          "[batch, num_kv_heads + 1, tokens, head_dim] (the index key last), v [batch, num_kv_heads,\n"
          "tokens, head_dim]. Engine-paged layers: k is the index keys [batch, 1, tokens, head_dim] and\n"
          "v is None. Synchronous; not a step.")
      .def(
          "sync_live_len", [](PyBlockSparse& self, uintptr_t stream) { self.layer.sync_live_len(stream_ptr(stream)); },
          nb::arg("stream") = 0, "After replaying captured steps: reads the device-side length back (synchronizes).")
      .def_prop_ro("kv_len", [](const PyBlockSparse& self) { return self.layer.kv_len(); });

  nb::class_<StaticBlockSparseConfig>(m, "StaticBlockSparseConfig",
                                      "Geometry of the static per-query-head block pattern (Phi-3-small's by default):\n"
                                      "query head h in query block i keeps key block j <= i when i - j < local_blocks\n"
                                      "or (j + h * head_sliding_step + 1) % vert_stride == 0.")
      .def(
          "__init__",
          [](StaticBlockSparseConfig* c, int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim,
             int32_t block_size, int32_t local_blocks, int32_t vert_stride, int64_t capacity_step) {
            new (c) StaticBlockSparseConfig{num_qo_heads, num_kv_heads, head_dim, block_size,
                                            local_blocks, vert_stride, capacity_step};
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

  nb::class_<StaticBlockSparseStep>(m, "StaticBlockSparseStep", "What a static-pattern decode step did.")
      .def_ro("fused", &StaticBlockSparseStep::fused)
      .def_ro("outcome", &StaticBlockSparseStep::outcome);

  nb::class_<PyStaticBlockSparse>(
      m, "StaticBlockSparseAttention",
      "Static per-query-head block-sparse attention (Phi-3-small-style): each query head attends its\n"
      "pattern's key blocks through the fused paged decode (one request per query head), falling back\n"
      "to the mask path over the same set on any decline. The layer owns its dense [B, Hkv, Cap, D]\n"
      "cache (f16 or bf16). Step tensors: q [B, Hq, D], k and v [B, Hkv, 1, D], o [B, Hq, D];\n"
      "contiguous, on the layer's device.")
      .def(nb::init<Device, DType, const StaticBlockSparseConfig&, int32_t, std::optional<DispatchConfig>>(),
           nb::arg("device"), nb::arg("dtype"), nb::arg("config"), nb::arg("batch"), nb::arg("dispatch") = nb::none())
      .def(
          "decode",
          [](PyStaticBlockSparse& self, const In& q, const In& k, const In& v, const Out& o, uintptr_t stream) {
            return self.layer.decode(self.tokens("StaticBlockSparseAttention.decode", q, k, v, o), stream_ptr(stream));
          },
          nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("stream") = 0,
          "Appends the token and attends each query head's pattern. Returns a StaticBlockSparseStep.")
      .def("last_blocks", [](const PyStaticBlockSparse& self) { return self.layer.last_blocks(); },
           "Kept blocks of the last decode, per request r = b * num_qo_heads + h (host copy).")
      .def("last_selected_positions",
           [](const PyStaticBlockSparse& self) { return self.layer.last_selected_positions(); },
           "Positions the page table of the last decode attends, per request.")
      .def("last_mask_columns", [](PyStaticBlockSparse& self) { return self.layer.last_mask_columns(); },
           "Columns the mask path keeps for the last decode, per request (built from the rule).")
      .def(
          "reserve", [](PyStaticBlockSparse& self, int64_t tokens) { self.layer.reserve(tokens); }, nb::arg("tokens"),
          "Makes room for `tokens` live tokens and sizes the step's buffers (before capturing steps).")
      .def(
          "append_tokens",
          [](PyStaticBlockSparse& self, const In& k, const In& v) {
            const std::string op = "StaticBlockSparseAttention.append_tokens";
            const Tensor kt = describe(k, op, "k");
            kt.require_ndim(4, "[batch, num_kv_heads, tokens, head_dim]");
            const int64_t B = self.batch, Hk = self.config.num_kv_heads, D = self.config.head_dim, n = kt.shape[2];
            const void* kp = step_arg(op, k, "k", self.device, self.dtype, {B, Hk, n, D},
                                      "[batch, num_kv_heads, tokens, head_dim]");
            const void* vp = step_arg(op, v, "v", self.device, self.dtype, {B, Hk, n, D},
                                      "[batch, num_kv_heads, tokens, head_dim]");
            self.layer.append_tokens(kp, vp, n);
          },
          nb::arg("k"), nb::arg("v"),
          "Appends a prompt's tokens without attending: k and v [batch, num_kv_heads, tokens, head_dim].")
      .def(
          "sync_live_len",
          [](PyStaticBlockSparse& self, uintptr_t stream) { self.layer.sync_live_len(stream_ptr(stream)); },
          nb::arg("stream") = 0, "After replaying captured steps: reads the device-side length back (synchronizes).")
      .def_prop_ro("kv_len", [](const PyStaticBlockSparse& self) { return self.layer.kv_len(); });

  nb::class_<DsaConfig>(m, "DsaConfig", "Geometry of the DSA (DeepSeek-V3.2-style MLA + top-k indexer) layer.")
      .def(
          "__init__",
          [](DsaConfig* c, int32_t num_qo_heads, int32_t latent_dim, int32_t rope_dim, int32_t index_heads,
             int32_t index_head_dim, int32_t index_topk, float scale, int64_t capacity_step, KVStorage kv_storage) {
            new (c) DsaConfig{num_qo_heads, latent_dim, rope_dim, index_heads, index_head_dim, index_topk, scale,
                              capacity_step, kv_storage};
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

  nb::class_<DsaStep>(m, "DsaStep", "What a DSA decode step did.")
      .def_ro("sparse", &DsaStep::sparse)
      .def_ro("fused", &DsaStep::fused)
      .def_ro("outcome", &DsaStep::outcome);

  nb::class_<PyDsa>(m, "DsaAttention",
                    "The DSA layer: MLA attention over the top-k tokens of a lightning indexer, through the\n"
                    "fused paged decode's second K stream. Step tensors (contiguous, on the layer's device,\n"
                    "in its dtype except the fp32 index weights): q_latent [B, H, latent], q_pe [B, H, rope],\n"
                    "q_index [B, index_heads, index_head_dim], index_weights [B, index_heads],\n"
                    "k_cache_row [B, 1, 1, latent + index_head_dim], k_pe [B, 1, 1, rope], o [B, H, latent].")
      .def(nb::init<Device, DType, const DsaConfig&, int32_t, std::optional<DispatchConfig>>(), nb::arg("device"),
           nb::arg("dtype"), nb::arg("config"), nb::arg("batch"), nb::arg("dispatch") = nb::none())
      .def(
          "prefill_token",
          [](PyDsa& self, const In& q_latent, const In& q_pe, const In& q_index, const In& index_weights,
             const In& k_cache_row, const In& k_pe, const Out& o, uintptr_t stream) {
            self.layer.prefill_token(
                self.tokens("DsaAttention.prefill_token", q_latent, q_pe, q_index, index_weights, k_cache_row, k_pe, o),
                stream_ptr(stream));
          },
          nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"), nb::arg("index_weights"), nb::arg("k_cache_row"),
          nb::arg("k_pe"), nb::arg("o"), nb::arg("stream") = 0, "Appends the token and attends to the whole window.")
      .def(
          "decode",
          [](PyDsa& self, const In& q_latent, const In& q_pe, const In& q_index, const In& index_weights,
             const In& k_cache_row, const In& k_pe, const Out& o, uintptr_t stream) {
            return self.layer.decode(
                self.tokens("DsaAttention.decode", q_latent, q_pe, q_index, index_weights, k_cache_row, k_pe, o),
                stream_ptr(stream));
          },
          nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"), nb::arg("index_weights"), nb::arg("k_cache_row"),
          nb::arg("k_pe"), nb::arg("o"), nb::arg("stream") = 0,
          "Appends the token, runs the indexer, tries the fused path and falls back to the mask path.")
      .def(
          "decode_paged",
          [](PyDsa& self, const In& q_latent, const In& q_pe, const In& q_index, const In& index_weights,
             const In& index_k, const Out& o, const In& kv_cache, const In& block_table, uintptr_t stream) {
            const std::string op = "DsaAttention.decode_paged";
            return self.layer.decode(self.engine_tokens(op, q_latent, q_pe, q_index, index_weights, index_k, o),
                                     self.engine_kv(op, kv_cache, block_table), stream_ptr(stream));
          },
          nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"), nb::arg("index_weights"), nb::arg("index_k"),
          nb::arg("o"), nb::arg("kv_cache"), nb::arg("block_table"), nb::arg("stream") = 0,
          "Decode over an engine's paged MLA pool (kv_storage = KVStorage.ENGINE_PAGED): appends the\n"
          "indexer key index_k [B, 1, 1, index_head_dim], runs the indexer, and attends the kept\n"
          "positions of kv_cache [num_blocks, block_size, latent_dim + rope_dim] (latent then rope in one\n"
          "row) in place through block_table int32 [B, max_blocks]. A uint8 kv_cache [num_blocks,\n"
          "block_size, row_bytes >= 656] holds the engines' FP8 MLA rows (512 e4m3 latent values, 4 fp32\n"
          "scales, 64 bf16 rope values; quantize_mla_fp8 writes them) for a bf16 layer of 512 + 64,\n"
          "dequantized in the kernel. The engine must already have written this token's row at position\n"
          "kv_len. No mask path: a declined step raises, appending nothing.")
      .def(
          "decode_multi",
          [](PyDsa& self, const In& q_latent, const In& q_pe, const In& q_index, const In& index_weights,
             const In& k_cache_row, const In& k_pe, const Out& o, uintptr_t stream) {
            int32_t q_len = 0;
            const DsaTokens t = self.multi_tokens("DsaAttention.decode_multi", q_latent, q_pe, q_index, index_weights,
                                                  k_cache_row, k_pe, o, &q_len);
            return self.layer.decode(t, q_len, stream_ptr(stream));
          },
          nb::arg("q_latent"), nb::arg("q_pe"), nb::arg("q_index"), nb::arg("index_weights"), nb::arg("k_cache_row"),
          nb::arg("k_pe"), nb::arg("o"), nb::arg("stream") = 0,
          "A multi-token step (speculative verification, MTP) with one top-k per token, each token's\n"
          "indexer limited to the context up to its own position. q_latent, q_pe and o [B, q_len, H,\n"
          "dim], q_index [B, q_len, index_heads, index_head_dim], index_weights fp32 [B, q_len,\n"
          "index_heads]; k_cache_row [q_len, B, 1, 1, latent + index_head_dim] and k_pe [q_len, B, 1, 1,\n"
          "rope], token-major. q_len = q_latent.shape[1], 1 .. 16. last_selected_positions() then has\n"
          "one row per (sequence, token). Returns a DsaStep.")
      .def("last_selected_positions", [](const PyDsa& self) { return self.layer.last_selected_positions(); })
      .def("last_mask_columns", [](PyDsa& self) { return self.layer.last_mask_columns(); })
      .def(
          "reserve", [](PyDsa& self, int64_t tokens) { self.layer.reserve(tokens); }, nb::arg("tokens"),
          "Makes room for `tokens` live tokens and sizes the step's buffers, so steps up to that length\n"
          "allocate nothing (do it before capturing steps in a graph).")
      .def(
          "append_tokens",
          [](PyDsa& self, const In& k_cache_rows, const std::optional<In>& k_pe) {
            const std::string op = "DsaAttention.append_tokens";
            const Tensor kt = describe(k_cache_rows, op, "k_cache_rows");
            if (self.config.kv_storage == KVStorage::kEnginePaged) {
              kt.require_ndim(4, "[batch, 1, tokens, index_head_dim] (the indexer keys)");
              const int64_t n = kt.shape[2];
              const void* kp = step_arg(op, k_cache_rows, "k_cache_rows", self.device, self.dtype,
                                        {self.batch, 1, n, self.config.index_head_dim},
                                        "[batch, 1, tokens, index_head_dim] (the indexer keys)");
              if (k_pe) throw Error(op + ": k_pe must be None for an engine-paged layer (the engine holds the rows)");
              self.layer.append_tokens(kp, nullptr, n);
              return;
            }
            if (!k_pe) throw Error(op + ": k_pe must be given");
            kt.require_ndim(4, "[batch, 1, tokens, latent_dim + index_head_dim]");
            const int64_t B = self.batch, n = kt.shape[2];
            const void* kp = step_arg(op, k_cache_rows, "k_cache_rows", self.device, self.dtype,
                                      {B, 1, n, self.config.latent_dim + self.config.index_head_dim},
                                      "[batch, 1, tokens, latent_dim + index_head_dim]");
            const void* pe = step_arg(op, *k_pe, "k_pe", self.device, self.dtype, {B, 1, n, self.config.rope_dim},
                                      "[batch, 1, tokens, rope_dim]");
            self.layer.append_tokens(kp, pe, n);
          },
          nb::arg("k_cache_rows"), nb::arg("k_pe").none(),
          "Appends a prompt's tokens to the cache without attending: k_cache_rows [batch, 1, tokens,\n"
          "latent_dim + index_head_dim], k_pe [batch, 1, tokens, rope_dim]. Engine-paged layers:\n"
          "k_cache_rows is the indexer keys [batch, 1, tokens, index_head_dim] and k_pe is None.\n"
          "Synchronous; not a step.")
      .def(
          "sync_live_len", [](PyDsa& self, uintptr_t stream) { self.layer.sync_live_len(stream_ptr(stream)); },
          nb::arg("stream") = 0, "After replaying captured steps: reads the device-side length back (synchronizes).")
      .def_prop_ro("kv_len", [](const PyDsa& self) { return self.layer.kv_len(); });

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

  m.def(
      "dsa_select_tokens_cpu",
      [](const DsaConfig& config, int32_t batch, int64_t kv_len, const In& q_index, const In& weights,
         const In& index_keys) {
        const std::string op = "dsa_select_tokens_cpu";
        const std::vector<float> q = host_floats(op, q_index, "q_index", {batch, config.index_heads, config.index_head_dim},
                                                 "[batch, index_heads, index_head_dim]");
        const std::vector<float> w = host_floats(op, weights, "weights", {batch, config.index_heads}, "[batch, index_heads]");
        const std::vector<float> keys = host_floats(op, index_keys, "index_keys", {batch, kv_len, config.index_head_dim},
                                                    "[batch, kv_len, index_head_dim]");
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
        if (common_device(op, {&k, &l, &q, &w, &ws, &p, &c}) != Device::kCuda)
          throw Error(op + ": every tensor must be a CUDA tensor (use dsa_select_tokens_cpu on the host)");
        k.require_ndim(4, "[batch, 1, capacity, latent_dim + index_head_dim]");
        k.require_contiguous();
        q.require_ndim(3, "[batch, index_heads, index_head_dim]");
        q.require_contiguous();
        w.require_float32();
        w.require_contiguous();
        ws.require_contiguous();
        for (const Tensor* t : {&l, &p, &c}) {
          t->require_int32();
          t->require_contiguous();
        }
        DsaIndexerArgs a;
        a.dtype = k.float_dtype();
        if (q.float_dtype() != a.dtype) q.fail("must have k_cache's dtype");
        const int32_t batch = to_int32(q.shape[0], op, "q_index.shape[0]");
        if (k.shape[0] != batch) k.fail("has batch " + std::to_string(k.shape[0]) + " but q_index " + std::to_string(batch));
        l.require_shape({batch}, "[batch]");
        c.require_shape({batch}, "[batch]");
        p.require_shape({batch, config.index_topk}, "[batch, index_topk]");
        a.k_cache = k.data;
        a.capacity = k.shape[2];
        a.kv_lens = static_cast<const int32_t*>(l.data);
        a.max_kv_len = max_kv_len;
        a.q_index = q.data;
        a.weights = static_cast<const float*>(w.data);
        a.workspace = ws.data;
        a.workspace_bytes = static_cast<size_t>(ws.numel()) * (ws.dtype.bits / 8);
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
      "bytes, 16-byte aligned; positions int32 out [batch, index_topk], increasing, -1 past counts (int32 out [batch]).");
}

}  // namespace sparsepage::py
