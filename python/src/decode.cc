// Bindings of the decode entry points: the paged decode with its plan, the
// merge of partial states, the mask path, and the sparse decode entry point
// (SparseDecoder) with its outcome. Each function turns DLPack tensors into
// the library's plain structs and calls the library; nothing is computed here
// except the merge op (the library has no public merge entry point yet, so
// it reuses the CPU backend's merge on the host).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <memory>

#include "core/cuda_hooks.h"
#include "dlpack_exchange.h"
#include "sparsepage/sparse_decode.h"
#include "tensor.h"

#ifdef SPARSEPAGE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace sparsepage::py {
namespace {

using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

// The dense-cache entry points (SparseDecoder, the mask path) take packed q
// and o: SparseAttentionInputs has no q / o strides.
void require_dense_qo(const Tensor& t) {
  if (!t.contiguous())
    throw NotImplemented(t.op + ": " + t.name + " is a strided view (shape " + t.shape_str() +
                         "); SparseDecoder and the mask path read q and o as contiguous [batch, num_qo_heads, "
                         "head_dim]. paged_decode (and the torch ops) take strided q and o.");
}

// A query-shaped view [num_sequences, num_kv_heads * group_size, dim] (q,
// q_extra, o): unit stride in dim, any sequence and head strides. A dim of
// extent 1 gets its packed stride (torch reports any stride there).
QueryStrides query_strides_of(const Tensor& t, const char* layout) {
  t.require_ndim(3, layout);
  t.require_unit_stride_last("the head's values");
  QueryStrides s;
  s.head_stride = t.stride_or(1, t.shape[2]);
  s.seq_stride = t.stride_or(0, t.shape[1] * s.head_stride);
  if (s.seq_stride < 0 || s.head_stride < 0) t.fail("has a negative stride");
  return s;
}

// A pool for num_kv_heads > 1: [..., num_kv_heads, dim] (an engine's paged
// [num_blocks, block_size, num_kv_heads, head_dim] cache), rows are the
// leading dims collapsed, heads the second-to-last dim.
RowView pool_of_heads(const Tensor& t, int32_t num_kv_heads, int64_t* num_rows) {
  if (num_kv_heads == 1) return pool_of(t, num_rows);
  if (t.ndim() < 3 || t.shape[t.ndim() - 2] != num_kv_heads)
    t.fail("must be [..., num_kv_heads = " + std::to_string(num_kv_heads) +
           ", head_dim] (e.g. [num_blocks, block_size, num_kv_heads, head_dim]), got shape " + t.shape_str());
  // The pool of rows without the head dim, then the head dim's stride.
  Tensor rows = t;
  rows.shape.erase(rows.shape.end() - 2);
  rows.strides.erase(rows.strides.end() - 2);
  RowView pool = pool_of(rows, num_rows);
  pool.head_stride = t.strides[t.ndim() - 2];
  if (pool.head_stride < pool.dim) t.fail("has overlapping heads: stride " + std::to_string(pool.head_stride));
  return pool;
}

// A caller-provided workspace checked against what is needed, or null.
void* workspace_of(const std::optional<Tensor>& ws, size_t needed) {
  if (!ws) return nullptr;
  ws->require_workspace(needed);
  return ws->data;
}

// Host scratch for the CPU backend when the caller passed no workspace.
struct HostScratch {
  std::unique_ptr<float[]> data;
  void* get(size_t bytes) {
    data.reset(new float[bytes / sizeof(float) + 64]);
    return data.get();
  }
};

void sync_stream(Device device, void* stream) {
#ifdef SPARSEPAGE_WITH_CUDA
  if (device == Device::kCuda) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
#else
  (void)device;
  (void)stream;
#endif
}

// Every tensor argument of paged_decode, described.
struct DecodeTensors {
  Tensor q, k, v, o, indices;
  std::optional<Tensor> indptr, seq_lens, fpo, lse, q_extra, k_extra, ws, table, table_rows;
};

// The decode over described tensors: both entries (DLPack capsules or
// ndarrays, and the exchange table) end here.
void run_paged_decode(const DecodePlan& plan, const std::string& op, const DecodeTensors& in, int32_t page_size,
                      float scale, int64_t num_pool_pages, int64_t request_row_stride, int64_t window_len,
                      int32_t num_kv_heads, bool skip_minus_one, int32_t block_size, bool upload_plan,
                      uintptr_t stream) {
  const Tensor &q = in.q, &k = in.k, &v = in.v, &o = in.o, &indices = in.indices;
  const auto &indptr = in.indptr, &seq_lens = in.seq_lens, &fpo = in.fpo, &lse = in.lse, &q_extra = in.q_extra,
             &k_extra = in.k_extra, &ws = in.ws, &table = in.table, &table_rows = in.table_rows;
  const Device device =
      common_device(op, {q, k, v, o, indices, indptr, seq_lens, fpo, lse, q_extra, k_extra, ws, table, table_rows});

  if (num_kv_heads < 1) throw Error(op + ": num_kv_heads = " + std::to_string(num_kv_heads) + " must be at least 1");
  const char* q_layout = "[num_sequences, num_kv_heads * group_size, head_dim_qk]";
  const DType dtype = q.float_dtype();
  for (const Tensor* t : {&k, &v, &o}) t->require_same_dtype(q);

  DecodeParams p;
  p.dtype = dtype;
  p.qo_layout = QueryLayout::kStrided;
  p.q_strides = query_strides_of(q, q_layout);
  p.o_strides = query_strides_of(o, "[num_sequences, num_kv_heads * group_size, head_dim_v]");
  const int64_t sequences = q.shape[0];
  if (q.shape[1] % num_kv_heads != 0)
    q.fail("has " + std::to_string(q.shape[1]) +
           " heads, not a multiple of num_kv_heads = " + std::to_string(num_kv_heads));
  p.num_kv_heads = num_kv_heads;
  p.num_requests = to_int32(sequences * num_kv_heads, op, "num_requests");
  p.group_size = to_int32(q.shape[1] / num_kv_heads, op, "group_size");
  int64_t k_rows = 0, v_rows = 0, e_rows = -1;
  p.k = pool_of_heads(k, num_kv_heads, &k_rows);
  p.v = pool_of_heads(v, num_kv_heads, &v_rows);
  if (q.shape[2] != p.k.dim)
    q.fail("has head_dim " + std::to_string(q.shape[2]) + " but k's rows are " + std::to_string(p.k.dim) + " wide");
  o.require_shape({q.shape[0], q.shape[1], p.v.dim}, "[num_sequences, num_qo_heads, v's row width]");

  // Page ids: a CSR table (indptr given) or an index matrix (indptr None).
  indices.require_int32();
  if (indptr) {
    indptr->require_int32_array({p.num_requests + 1}, "[num_requests + 1]");
    indices.require_int32_vector("[num_pages]");
    p.indptr = static_cast<const int32_t*>(indptr->data);
    p.num_indices = indices.shape[0];
  } else {
    p.index_layout = IndexLayout::kMatrix;
    if (indices.ndim() != 2 && indices.ndim() != 3)
      indices.fail("must be an index matrix [num_sequences, width] or [num_sequences, num_kv_heads, width] "
                   "when indptr is None, got shape " +
                   indices.shape_str());
    const int last = indices.ndim() - 1;
    indices.require_unit_stride_last();
    if (indices.shape[0] != sequences)
      indices.fail("has " + std::to_string(indices.shape[0]) + " rows but q has " + std::to_string(sequences) +
                   " sequences");
    if (indices.ndim() == 3 && indices.shape[1] != num_kv_heads)
      indices.fail("must be [num_sequences, num_kv_heads = " + std::to_string(num_kv_heads) + ", width], got " +
                   indices.shape_str());
    p.index_width = to_int32(indices.shape[last], op, "indices' width");
    p.index_seq_stride = indices.stride_or(0, 0);
    p.index_head_stride = indices.ndim() == 3 ? indices.stride_or(1, 0) : 0;
    // The span the matrix covers, in elements.
    p.num_indices = (sequences - 1) * p.index_seq_stride + (num_kv_heads - 1) * p.index_head_stride + p.index_width;
  }
  p.indices = static_cast<const int32_t*>(indices.data);
  if (skip_minus_one) p.padding = IndexPadding::kMinusOneSkips;
  if (seq_lens) {
    seq_lens->require_int32_vector("[num_requests] or [num_sequences]");
    if (seq_lens->shape[0] == p.num_requests) {
      p.seq_lens_index = SeqLensIndex::kPerRequest;
    } else if (seq_lens->shape[0] == sequences) {
      p.seq_lens_index = SeqLensIndex::kPerSequence;
    } else {
      seq_lens->fail("must have shape (" + std::to_string(p.num_requests) + ",) [num_requests] or (" +
                     std::to_string(sequences) + ",) [num_sequences], got " + seq_lens->shape_str());
    }
    p.seq_lens = static_cast<const int32_t*>(seq_lens->data);
  }
  if (fpo) {
    fpo->require_int32_array({p.num_requests}, "[num_requests]");
    p.first_page_offset = static_cast<const int32_t*>(fpo->data);
  }
  if (q_extra || k_extra) {
    if (!q_extra || !k_extra) throw Error(op + ": q_extra and k_extra must both be given or both be None");
    q_extra->require_same_dtype(q);
    k_extra->require_same_dtype(q);
    p.k_extra = pool_of_heads(*k_extra, num_kv_heads, &e_rows);
    q_extra->require_shape({q.shape[0], q.shape[1], p.k_extra.dim},
                           "[num_sequences, num_qo_heads, k_extra's row width]");
    p.q_extra_strides = query_strides_of(*q_extra, "[num_sequences, num_qo_heads, head_dim_extra]");
    p.q_extra = q_extra->data;
  }
  if (lse) {
    lse->require_float32();
    lse->require_contiguous();
    if (lse->numel() != int64_t{p.num_requests} * p.group_size || lse->ndim() != 2 ||
        !(lse->shape[0] == sequences || lse->shape[0] == p.num_requests))
      lse->fail("must have shape (" + std::to_string(sequences) + ", " + std::to_string(q.shape[1]) +
                ") [num_sequences, num_qo_heads] (or [num_requests, group_size]), got " + lse->shape_str());
    p.lse = static_cast<float*>(lse->data);
  }
  p.q = q.data;
  p.o = o.data;
  p.scale = scale;
  p.page_size = page_size;
  int64_t rows = std::min(k_rows, v_rows);
  if (e_rows >= 0) rows = std::min(rows, e_rows);
  if (request_row_stride < 0) throw Error(op + ": request_row_stride must not be negative");
  if (request_row_stride > 0) {
    // Window mode: request r's window is the pool's rows r * request_row_stride ..
    if (num_kv_heads != 1 || table)
      throw Error(op + ": window mode (request_row_stride > 0) takes num_kv_heads = 1 and no block_table");
    p.addressing = PageAddressing::kWindow;
    // Compared by division: num_requests * request_row_stride may not fit int64.
    if (p.num_requests > 0 && request_row_stride > rows / p.num_requests)
      throw Error(op + ": window mode needs num_requests * request_row_stride = " + std::to_string(p.num_requests) +
                  " * " + std::to_string(request_row_stride) + " rows but the pools hold " + std::to_string(rows));
    // Each request's window stays within its own request_row_stride rows
    // (the core refuses a window_len past this capacity, even for one request).
    for (RowView* view : {&p.k, &p.v, &p.k_extra}) {
      view->seq_stride = request_row_stride * view->row_stride;
      view->capacity = request_row_stride;
    }
  }
  p.window_len = window_len;
  if (table) {
    // Block-table mode: ids are positions of each sequence, resolved through the table.
    p.block_table = block_table_of(*table, "[num_rows, max_blocks]");
    if (block_size < 1) throw Error(op + ": block_table needs block_size >= 1 (pool rows per block)");
    p.addressing = PageAddressing::kBlockTable;
    p.block_table.block_size = block_size;
    const int64_t blocks = rows / block_size;
    if (num_pool_pages > blocks)
      throw Error(op + ": num_pool_pages = " + std::to_string(num_pool_pages) + " blocks of " +
                  std::to_string(block_size) + " rows exceed the pools' " + std::to_string(rows) + " rows");
    p.block_table.num_blocks = num_pool_pages >= 0 ? num_pool_pages : blocks;
    if (table_rows) {
      table_rows->require_int32_array({sequences}, "[num_sequences]");
      p.block_table.row_of_sequence = static_cast<const int32_t*>(table_rows->data);
    }
  } else if (table_rows) {
    throw Error(op + ": block_table_rows needs a block_table");
  }
  if (!table && request_row_stride == 0) {
    if (num_pool_pages < 0) {
      p.num_pool_pages = page_size >= 1 ? rows / page_size : 0;
    } else {
      if (page_size >= 1 && num_pool_pages * page_size > rows)
        throw Error(op + ": num_pool_pages = " + std::to_string(num_pool_pages) + " pages of " +
                    std::to_string(page_size) + " rows exceed the pools' " + std::to_string(rows) + " rows");
      p.num_pool_pages = num_pool_pages;
    }
  }
  check_decode_params(p, plan);

  DeviceGuard guard(q);
  if (device == Device::kCpu) {
    if (p.index_layout == IndexLayout::kCsr) {
      // The CPU backend reads indptr[num_requests] page ids: make sure they exist.
      const int64_t pages = p.num_requests > 0 ? p.indptr[p.num_requests] : 0;
      if (pages > indices.shape[0])
        indices.fail("holds " + std::to_string(indices.shape[0]) +
                     " page ids but indptr[num_requests] = " + std::to_string(pages));
    }
    HostScratch scratch;
    void* workspace = workspace_of(ws, plan.workspace.total);
    if (!workspace) workspace = scratch.get(plan.workspace.total);
    nb::gil_scoped_release release;
    run_decode_cpu(p, plan, workspace);
  } else {
    void* workspace = workspace_of(ws, plan.workspace.total);
    if (!workspace)
      throw Error(op + ": the CUDA backend needs a workspace of " + std::to_string(plan.workspace.total) +
                  " bytes (plan.workspace_bytes) on the decode's device; the step allocates nothing");
    if (upload_plan) upload_plan_cuda(plan, workspace, stream_ptr(stream));
    run_decode_cuda(p, plan, workspace, stream_ptr(stream));
  }
}

void paged_decode(const DecodePlan& plan, const In& q, const In& k, const In& v, const Out& o, const OptIn& indptr,
                  const In& indices, const OptIn& seq_lens, int32_t page_size, float scale,
                  const OptIn& first_page_offset, const OptOut& lse, const OptIn& q_extra, const OptIn& k_extra,
                  const OptOut& workspace, int64_t num_pool_pages, int64_t request_row_stride, int64_t window_len,
                  int32_t num_kv_heads, bool skip_minus_one, const OptIn& block_table, const OptIn& block_table_rows,
                  int32_t block_size, bool upload_plan, uintptr_t stream) {
  const std::string op = "paged_decode";
  const DecodeTensors in{describe(q, op, "q"),
                         describe(k, op, "k"),
                         describe(v, op, "v"),
                         describe(o, op, "o"),
                         describe(indices, op, "indices"),
                         describe(indptr, op, "indptr"),
                         describe(seq_lens, op, "seq_lens"),
                         describe(first_page_offset, op, "first_page_offset"),
                         describe(lse, op, "lse"),
                         describe(q_extra, op, "q_extra"),
                         describe(k_extra, op, "k_extra"),
                         describe(workspace, op, "workspace"),
                         describe(block_table, op, "block_table"),
                         describe(block_table_rows, op, "block_table_rows")};
  run_paged_decode(plan, op, in, page_size, scale, num_pool_pages, request_row_stride, window_len, num_kv_heads,
                   skip_minus_one, block_size, upload_plan, stream);
}

// The torch ops' eager entry: tensors described through DLPack's C exchange
// table (exchange_api is true), on the producer's current stream; no capsule, no
// keyword matching. Without the table it is the capsule path's twin.
void paged_decode_exchange(const DecodePlan& plan, nb::handle q, nb::handle k, nb::handle v, nb::handle o,
                           nb::handle indptr, nb::handle indices, nb::handle seq_lens, int32_t page_size, float scale,
                           nb::handle first_page_offset, nb::handle lse, nb::handle q_extra, nb::handle k_extra,
                           nb::handle workspace, int64_t num_pool_pages, int64_t request_row_stride, int64_t window_len,
                           int32_t num_kv_heads, bool skip_minus_one, nb::handle block_table,
                           nb::handle block_table_rows, int32_t block_size) {
  const std::string op = "paged_decode";
  const dlpack_abi::ExchangeApi* api = exchange_api_of(q);
  if (api == nullptr) {
    throw Error(op + ": q's type publishes no DLPack exchange table (__dlpack_c_exchange_api__); pass DLPack "
                     "capsules to paged_decode instead");
  }
  const auto one = [&](nb::handle h, const char* name) { return describe_handle(h, op, name, api); };
  const auto maybe = [&](nb::handle h, const char* name) { return describe_optional_handle(h, op, name, api); };
  const DecodeTensors in{one(q, "q"),
                         one(k, "k"),
                         one(v, "v"),
                         one(o, "o"),
                         one(indices, "indices"),
                         maybe(indptr, "indptr"),
                         maybe(seq_lens, "seq_lens"),
                         maybe(first_page_offset, "first_page_offset"),
                         maybe(lse, "lse"),
                         maybe(q_extra, "q_extra"),
                         maybe(k_extra, "k_extra"),
                         maybe(workspace, "workspace"),
                         maybe(block_table, "block_table"),
                         maybe(block_table_rows, "block_table_rows")};
  void* stream = current_work_stream(api, in.q, nullptr);
  run_paged_decode(plan, op, in, page_size, scale, num_pool_pages, request_row_stride, window_len, num_kv_heads,
                   skip_minus_one, block_size, false, reinterpret_cast<uintptr_t>(stream));
}

// ---- dense caches: the mask path and the sparse decode entry point --------

struct Inputs {
  SparseAttentionInputs in;
  Tensor q;  // for the device guard
};

// [batch, num_qo_heads, dim] q and o over [B, H, Cap, D] allocations.
Inputs make_inputs(const std::string& op, const In& q_in, const In& k_in, const In& v_in, const Out& o_in,
                   int32_t num_kv_heads, int64_t live_len, float scale, const OptOut& lse_in, const OptIn& q_extra_in,
                   const OptIn& k_extra_in, bool raw_cache) {
  const Tensor q = describe(q_in, op, "q"), k = describe(k_in, op, "k"), v = describe(v_in, op, "v"),
               o = describe(o_in, op, "o");
  const auto lse = describe(lse_in, op, "lse");
  const auto q_extra = describe(q_extra_in, op, "q_extra");
  const auto k_extra = describe(k_extra_in, op, "k_extra");
  Inputs r{{}, q};
  SparseAttentionInputs& in = r.in;
  in.device = common_device(op, {q, k, v, o, lse, q_extra, k_extra});
  q.require_ndim(3, "[batch, num_qo_heads, head_dim_qk]");
  o.require_ndim(3, "[batch, num_qo_heads, head_dim_v]");
  require_dense_qo(q);
  require_dense_qo(o);
  in.dtype = q.float_dtype();
  for (const Tensor* t : {&k, &v, &o}) t->require_same_dtype(q);
  int32_t kb = 0, vb = 0;
  in.k = dense_of(k, &kb);
  in.v = dense_of(v, &vb);
  in.batch = to_int32(q.shape[0], op, "q.shape[0]");
  in.num_qo_heads = to_int32(q.shape[1], op, "q.shape[1]");
  in.num_kv_heads = num_kv_heads;
  if (kb != in.batch) k.fail("has batch " + std::to_string(kb) + " but q has " + std::to_string(in.batch));
  if (vb != in.batch) v.fail("has batch " + std::to_string(vb) + " but q has " + std::to_string(in.batch));
  // RowView carries the positions (its capacity, which the core checks
  // live_len against) but not a tensor's head count: check that here (after
  // the core has named a bad head ratio, which it does first).
  const bool heads_ok = num_kv_heads >= 1 && in.num_qo_heads % num_kv_heads == 0;
  for (const Tensor* t : {&k, &v}) {
    if (heads_ok && t->shape[1] < num_kv_heads)
      t->fail("has " + std::to_string(t->shape[1]) +
              " heads, fewer than num_kv_heads = " + std::to_string(num_kv_heads));
  }
  if (q.shape[2] != in.k.dim)
    q.fail("has head_dim " + std::to_string(q.shape[2]) + " but k's rows are " + std::to_string(in.k.dim) + " wide");
  o.require_shape({q.shape[0], q.shape[1], in.v.dim}, "[batch, num_qo_heads, v's head_dim]");
  if (q_extra || k_extra) {
    if (!q_extra || !k_extra) throw Error(op + ": q_extra and k_extra must both be given or both be None");
    require_dense_qo(*q_extra);
    q_extra->require_same_dtype(q);
    k_extra->require_same_dtype(q);
    int32_t eb = 0;
    in.k_extra = dense_of(*k_extra, &eb);
    if (eb != in.batch) k_extra->fail("has batch " + std::to_string(eb) + " but q has " + std::to_string(in.batch));
    if (heads_ok && k_extra->shape[1] < num_kv_heads)
      k_extra->fail("has " + std::to_string(k_extra->shape[1]) +
                    " heads, fewer than num_kv_heads = " + std::to_string(num_kv_heads));
    q_extra->require_shape({q.shape[0], q.shape[1], in.k_extra.dim}, "[batch, num_qo_heads, k_extra's head_dim]");
    in.q_extra = q_extra->data;
  }
  if (lse) {
    lse->require_float32_array({q.shape[0], q.shape[1]}, "[batch, num_qo_heads]");
    in.lse = static_cast<float*>(lse->data);
  }
  in.live_len = live_len;
  in.raw_cache = raw_cache;
  in.q = q.data;
  in.o = o.data;
  in.scale = scale;
  return r;
}

// A selection from a positions tensor on the inputs' device and host counts.
// The C++ SparseSelection owns its indices, so they are copied into `buffer`
// (reused while the size holds); on CUDA the copy follows `stream`'s work.
SparseSelection make_selection_from(const std::string& op, Device device, const In& positions_in, nb::handle counts_in,
                                    Buffer& buffer, void* stream) {
  const Tensor positions = describe(positions_in, op, "positions");
  positions.require_int32_vector("[total selected] (requests concatenated)");
  positions.require_device(device, "the inputs");
  SparseSelection selection;
  selection.counts = host_int32(counts_in, op, "counts");
  int64_t total = 0;
  for (size_t i = 0; i < selection.counts.size(); ++i) {
    if (selection.counts[i] < 0) throw Error(op + ": counts[" + std::to_string(i) + "] is negative");
    total += selection.counts[i];
  }
  if (total != positions.shape[0])
    positions.fail("holds " + std::to_string(positions.shape[0]) + " positions but counts sum to " +
                   std::to_string(total));
  const size_t bytes = static_cast<size_t>(total) * sizeof(int32_t);
  if (buffer.bytes() < bytes || buffer.device() != device) buffer = Buffer(device, std::max<size_t>(bytes, 4));
  sync_stream(device, stream);
  if (bytes) copy_bytes(buffer.data(), device, positions.data, device, bytes);
  // Hand the selection a view-sized buffer of its own: Buffer is move-only, so
  // move it in and back out after the call (see with_selection).
  selection.indices = std::move(buffer);
  return selection;
}

/// Runs `fn(selection)` over a selection built in `buffer`, handing the buffer back after.
template <typename Fn>
auto with_selection(const std::string& op, Device device, const In& positions, nb::handle counts, Buffer& buffer,
                    void* stream, Fn&& fn) {
  SparseSelection selection = make_selection_from(op, device, positions, counts, buffer, stream);
  struct Restore {
    SparseSelection& s;
    Buffer& b;
    ~Restore() { b = std::move(s.indices); }
  } restore{selection, buffer};
  return fn(selection);
}

/// Python's SparseDecoder: the C++ decoder plus the selection's buffer.
struct PySparseDecoder {
  PySparseDecoder(Device on, std::optional<DispatchConfig> config)
      : device(on), decoder(on, config ? *config : process_dispatch_config()) {}
  Device device;
  SparseDecoder decoder;
  Buffer selection_buffer;
};

struct PyMaskPath {
  explicit PyMaskPath(Device on) : device(on), path(on) {}
  Device device;
  MaskPath path;
  Buffer selection_buffer;
};

// A SparseDecoder or MaskPath method over a dense cache and a selection
// (its arguments SP_DENSE_ARGS): the inputs described (and, with `runs_on`
// naming the object, checked to live on its device), the selection built,
// then run(self, inputs, selection, stream) with q's device current.
template <class Self, class Run>
auto dense_method(const char* op, const char* runs_on, Run run) {
  return [op, runs_on, run](Self& self, const In& q, const In& k, const In& v, const Out& o, const In& positions,
                            nb::handle counts, int32_t num_kv_heads, int64_t live_len, float scale, const OptOut& lse,
                            const OptIn& q_extra, const OptIn& k_extra, bool raw_cache, uintptr_t stream) {
    Inputs r = make_inputs(op, q, k, v, o, num_kv_heads, live_len, scale, lse, q_extra, k_extra, raw_cache);
    if (runs_on != nullptr) r.q.require_device(self.device, runs_on);
    DeviceGuard guard(r.q);
    return with_selection(op, r.in.device, positions, counts, self.selection_buffer, stream_ptr(stream),
                          [&](const SparseSelection& s) { return run(self, r.in, s, stream_ptr(stream)); });
  };
}

#define SP_DENSE_ARGS \
  nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("positions"), nb::arg("counts"), nb::kw_only(), \
      nb::arg("num_kv_heads"), nb::arg("live_len"), nb::arg("scale"), \
      nb::arg("lse") = nb::none(), nb::arg("q_extra") = nb::none(), nb::arg("k_extra") = nb::none(), \
      nb::arg("raw_cache") = true, nb::arg("stream") = 0

const std::string kDenseDoc =
    "q: [batch, num_qo_heads, head_dim_qk] (contiguous); k, v (and k_extra): the cache's whole\n"
    "[batch, heads, capacity, head_dim] allocations (K may carry extra heads after the attention\n"
    "heads; V may be a column slice of K); o: [batch, num_qo_heads, head_dim_v]; lse: optional fp32\n"
    "[batch, num_qo_heads], natural log. positions: int32 window positions per request\n"
    "r = b * num_kv_heads + h, concatenated, on the inputs' device; counts: host list of per-request\n"
    "counts. stream: a cudaStream_t as an int (0: the default stream).";

const std::string kTryFusedDoc =
    "Tries the fused path; returns the SparseDecodeOutcome (counted in the stats).\n" + kDenseDoc;
const std::string kMaskRunDoc = "Prepares (when counts or shapes change) and runs the mask path.\n" + kDenseDoc;

// Binds an eager entry of the torch ops: paged_decode's arguments up to
// block_size, every one positional, then `tail` (more arguments, the doc).
template <class F, class... Tail>
void def_positional(nb::module_& m, const char* name, F f, Tail... tail) {
  m.def(name, f, nb::arg("plan"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::arg("indptr").none(),
        nb::arg("indices"), nb::arg("seq_lens").none(), nb::arg("page_size"), nb::arg("scale"),
        nb::arg("first_page_offset").none(), nb::arg("lse").none(), nb::arg("q_extra").none(),
        nb::arg("k_extra").none(), nb::arg("workspace").none(), nb::arg("num_pool_pages"),
        nb::arg("request_row_stride"), nb::arg("window_len"), nb::arg("num_kv_heads"), nb::arg("skip_minus_one"),
        nb::arg("block_table").none(), nb::arg("block_table_rows").none(), nb::arg("block_size"), tail...);
}

}  // namespace

void bind_decode(nb::module_& m) {
  // The torch ops' eager entries, every argument positional (keyword
  // matching costs microseconds a call there): over DLPack capsules, and over
  // tensors whose type publishes DLPack's C exchange table (torch >= 2.11).
  def_positional(m, "_paged_decode_positional", &paged_decode, nb::arg("upload_plan"), nb::arg("stream"),
                 "Internal: paged_decode with positional arguments.");
  def_positional(m, "_paged_decode_exchange", &paged_decode_exchange,
                 "Internal: paged_decode over tensors described through their type's DLPack exchange table, on its\n"
                 "current stream.");
  m.def(
      "_has_exchange_api", [](nb::handle t) { return exchange_api_of(t) != nullptr; }, nb::arg("tensor"),
      "Internal: whether the tensor's type publishes DLPack's C exchange table (major version 1).");
  // The keyword form of the same launch, over numpy arrays or DLPack tensors: what the engine
  // helpers (sparsepage.engine) and the numpy tests call. The public decode is
  // sparsepage.torch_ops.paged_decode / paged_decode_out, whose docstring documents the arguments.
  m.def("_paged_decode", &paged_decode, nb::arg("plan"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"),
        nb::arg("indptr").none(), nb::arg("indices"), nb::arg("seq_lens").none(), nb::kw_only(), nb::arg("page_size"),
        nb::arg("scale"), nb::arg("first_page_offset") = nb::none(), nb::arg("lse") = nb::none(),
        nb::arg("q_extra") = nb::none(), nb::arg("k_extra") = nb::none(), nb::arg("workspace") = nb::none(),
        nb::arg("num_pool_pages") = -1, nb::arg("request_row_stride") = 0, nb::arg("window_len") = 0,
        nb::arg("num_kv_heads") = 1, nb::arg("skip_minus_one") = false, nb::arg("block_table") = nb::none(),
        nb::arg("block_table_rows") = nb::none(), nb::arg("block_size") = 0, nb::arg("upload_plan") = true,
        nb::arg("stream") = 0,
        "Internal: the paged decode into o (and lse), on the arrays' device, with keyword arguments as\n"
        "sparsepage.torch_ops.paged_decode_out takes them. On the CPU workspace may be None (a temporary\n"
        "is used); on CUDA the plan is uploaded into the workspace first unless upload_plan=False.");

  m.def(
      "upload_plan",
      [](const DecodePlan& plan, const Out& workspace, uintptr_t stream) {
        const Tensor ws = describe(workspace, "upload_plan", "workspace");
        workspace_of(ws, plan.workspace.total);
        on_cuda_workspace(ws, [&] { upload_plan_cuda(plan, ws.data, stream_ptr(stream)); });
      },
      nb::arg("plan"), nb::arg("workspace"), nb::arg("stream") = 0,
      "Copies the plan's work and merge lists into a CUDA workspace (asynchronously on `stream`).\n"
      "Do it when the plan changes, before capturing a graph (torch_ops.DecodePlan.upload does).\n"
      "A no-op for a CPU workspace.");

  m.def(
      "read_decode_error_flag",
      [](const DecodePlan& plan, const Out& workspace, uintptr_t stream) {
        const Tensor ws = describe(workspace, "read_decode_error_flag", "workspace");
        return on_cuda_workspace(ws, [&] { return read_decode_error_flag(plan, ws.data, stream_ptr(stream)); });
      },
      nb::arg("plan"), nb::arg("workspace"), nb::arg("stream") = 0,
      "Reads and clears the CUDA error flag (synchronizes). Nonzero: some page id was outside the pool\n"
      "and that request's output is NaN. Always 0 on the CPU, whose backend raises instead.");

  m.def(
      "masked_decode",
      [](const In& q, const In& k, const In& v, const Out& o, int32_t num_kv_heads, int64_t live_len, float scale,
         const OptIn& mask_in, const OptOut& lse, const OptIn& q_extra, const OptIn& k_extra, const OptOut& ws_in,
         uintptr_t stream) {
        const std::string op = "masked_decode";
        Inputs r = make_inputs(op, q, k, v, o, num_kv_heads, live_len, scale, lse, q_extra, k_extra, true);
        MaskedDecodeParams p = masked_params(r.in);
        const auto mask = describe(mask_in, op, "mask");
        if (mask) {
          mask->require_device(r.in.device, "q");
          mask->require_float32_array({int64_t{r.in.batch} * num_kv_heads, live_len},
                                      "[batch * num_kv_heads, live_len]");
          p.mask = static_cast<const float*>(mask->data);
        }
        check_masked_decode_params(p);
        DeviceGuard guard(r.q);
        if (r.in.device == Device::kCpu) {
          nb::gil_scoped_release release;
          run_masked_decode_cpu(p);
          return size_t{0};
        }
        const size_t needed = masked_decode_workspace_bytes(p, cuda_multiprocessor_count());
        const auto ws = describe(ws_in, op, "workspace");
        if (!ws) return needed;  // a size query
        run_masked_decode_cuda(p, workspace_of(ws, needed), stream_ptr(stream));
        return size_t{0};
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("o"), nb::kw_only(), nb::arg("num_kv_heads"),
      nb::arg("live_len"), nb::arg("scale"), nb::arg("mask") = nb::none(), nb::arg("lse") = nb::none(),
      nb::arg("q_extra") = nb::none(), nb::arg("k_extra") = nb::none(), nb::arg("workspace") = nb::none(),
      nb::arg("stream") = 0,
      "The mask path: dense decode over the live window t < live_len of every request\n"
      "r = b * num_kv_heads + h, with an optional additive fp32 mask [batch * num_kv_heads, live_len]\n"
      "(0 keeps, -inf drops). Shapes as for SparseDecoder.try_fused. On CUDA, a call without\n"
      "`workspace` runs nothing and returns the workspace bytes it needs; with it, it runs and\n"
      "returns 0 (graph-capturable). On the CPU it runs and returns 0.");

  m.def(
      "build_selection_mask",
      [](const In& positions_in, const In& offsets_in, int64_t live_len, const Out& mask_in, uintptr_t stream) {
        const std::string op = "build_selection_mask";
        const Tensor positions = describe(positions_in, op, "positions"), offsets = describe(offsets_in, op, "offsets"),
                     mask = describe(mask_in, op, "mask");
        const Device device = common_device(op, {positions, offsets, mask});
        positions.require_int32_vector("[total selected]");
        offsets.require_int32_vector("[num_requests + 1]");
        const int64_t requests = offsets.shape[0] - 1;
        if (requests < 0) offsets.fail("must hold num_requests + 1 entries");
        mask.require_float32_array({requests, live_len}, "[num_requests, live_len]");
        DeviceGuard guard(mask);
        // The positions the offsets reach must exist: the last offset is
        // read on the host (on CUDA after the stream's work: this call
        // synchronizes), so a count past the array is refused, not read.
        int32_t last = 0;
        if (device == Device::kCuda) detail::cuda_stream_sync(stream_ptr(stream));
        copy_bytes(&last, Device::kCpu, static_cast<const int32_t*>(offsets.data) + requests, device, sizeof(last));
        if (last > positions.shape[0])
          offsets.fail("ends at " + std::to_string(last) + " but positions holds " +
                       std::to_string(positions.shape[0]) + " entries");
        build_selection_mask(device, static_cast<const int32_t*>(positions.data),
                             static_cast<const int32_t*>(offsets.data), to_int32(requests, op, "num_requests"),
                             live_len, static_cast<float*>(mask.data), stream_ptr(stream));
      },
      nb::arg("positions"), nb::arg("offsets"), nb::arg("live_len"), nb::arg("mask"), nb::arg("stream") = 0,
      "Writes the additive mask [num_requests, live_len]: 0 at each selected position, -inf elsewhere.");

  nb::class_<PySparseDecoder>(m, "SparseDecoder",
                              "The sparse decode entry point: a selection over a dense cache becomes a page table,\n"
                              "the dispatch policy decides, and the fused paged decode runs, or the decline comes\n"
                              "back (nothing ran) so the caller runs its mask path. Keeps the plan and workspace\n"
                              "between calls and re-plans only when the counts change.\n\n"
                              "The selection's positions are copied into a library buffer (the C++ selection owns\n"
                              "its indices); on CUDA that copy waits for `stream`, so try_fused is not\n"
                              "graph-capturable: use paged_decode with a plan for captured steps.")
      .def(nb::init<Device, std::optional<DispatchConfig>>(), nb::arg("device"), nb::arg("config") = nb::none())
      .def("try_fused",
           dense_method<PySparseDecoder>(
               "SparseDecoder.try_fused", "the decoder",
               [](PySparseDecoder& self, const SparseAttentionInputs& in, const SparseSelection& s, void* stream) {
                 return self.decoder.try_fused(in, s, stream);
               }),
           SP_DENSE_ARGS, kTryFusedDoc.c_str())
      .def("decide",
           dense_method<PySparseDecoder>(
               "SparseDecoder.decide", nullptr,
               [](PySparseDecoder& self, const SparseAttentionInputs& in, const SparseSelection& s, void* /*stream*/) {
                 return self.decoder.decide(in, s);
               }),
           SP_DENSE_ARGS, "The pure decision for these inputs, without running anything (not counted).")
      .def(
          "check_errors",
          [](PySparseDecoder& self, uintptr_t stream) { self.decoder.check_errors(stream_ptr(stream)); },
          nb::arg("stream") = 0, "Synchronizes; raises when the last CUDA launch met a position outside a window.")
      .def(
          "set_plan_tuning",
          [](PySparseDecoder& self, int32_t items_per_sm, int32_t min_chunk_tokens) {
            self.decoder.set_plan_tuning(items_per_sm, min_chunk_tokens);
          },
          nb::arg("items_per_sm"), nb::arg("min_chunk_tokens"))
      .def_prop_ro("plan", [](const PySparseDecoder& self) { return self.decoder.plan(); })
      .def_prop_ro("transient_bytes", [](const PySparseDecoder& self) { return self.decoder.transient_bytes(); })
      .def_prop_ro("config", [](const PySparseDecoder& self) { return self.decoder.config(); });

  nb::class_<PyMaskPath>(m, "MaskPath",
                         "The mask path over a selection: an additive mask keeping exactly the selected positions,\n"
                         "then dense attention over the live window (duplicates count once).")
      .def(nb::init<Device>(), nb::arg("device"))
      .def("run",
           dense_method<PyMaskPath>(
               "MaskPath.run", "the path",
               [](PyMaskPath& self, const SparseAttentionInputs& in, const SparseSelection& s, void* stream) {
                 self.path.prepare(in, s);
                 self.path.run(in, s, stream);
               }),
           SP_DENSE_ARGS, kMaskRunDoc.c_str())
      .def_prop_ro("transient_bytes", [](const PyMaskPath& self) { return self.path.transient_bytes(); });
}

}  // namespace sparsepage::py
