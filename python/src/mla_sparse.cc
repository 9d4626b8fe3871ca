// Bindings of the FlashMLA-shaped sparse decode (sparsepage/mla_sparse.h):
// its plan, the plan's upload, the launch and the error flag. Tensors come
// as torch tensors (described through DLPack's C exchange table where torch
// publishes it), DLPack capsules or numpy arrays; FP8 caches as 8-bit
// tensors (uint8, int8 or float8_e4m3fn bytes). sparsepage.flash_mla_compat
// is the Python face of these.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>
#include <thread>

#include "dlpack_exchange.h"
#include "sparsepage/decode.h"
#include "sparsepage/mla_sparse.h"
#include "tensor.h"

namespace sparsepage::py {
namespace {

constexpr uint8_t kDLFloat8E4m3fn = 10;  // DLPack's code for float8_e4m3fn

Tensor describe_handle(nb::handle h, const std::string& op, const std::string& name) {
  if (const dlpack_abi::ExchangeApi* api = exchange_api_of(h)) return describe_exchange(api, h, op, name);
  In array;
  if (!nb::try_cast(h, array)) throw Error(op + ": " + name + " is not a tensor (no DLPack export)");
  return describe(array, op, name);
}

std::optional<Tensor> describe_optional(nb::handle h, const std::string& op, const std::string& name) {
  if (h.is_none()) return std::nullopt;
  return describe_handle(h, op, name);
}

void require_last_dim_unit(const Tensor& t) {
  if (t.shape.back() > 1 && t.strides.back() != 1) t.fail("must have unit stride in its last dim");
}

void require_vector(const Tensor& t, int64_t n, const char* layout) {
  t.require_ndim(1, layout);
  if (t.shape[0] != n) t.fail("must have shape (" + std::to_string(n) + ",) " + layout + ", got " + t.shape_str());
  if (n > 1 && t.strides[0] != 1) t.fail("must be contiguous");
}

// A paged FP8 cache [num_blocks, block_size, (1,) bytes] and its slot ids
// [batch, q_len, topk] as an MlaSparseCache (byte strides from the tensor).
MlaSparseCache cache_of(const Tensor& k, const Tensor& ids, const std::optional<Tensor>& lengths, MlaCacheFormat format,
                        int64_t batch, int64_t q_len) {
  const bool bytes =
      k.dtype.bits == 8 && k.dtype.lanes == 1 &&
      (k.dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) ||
       k.dtype.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) || k.dtype.code == kDLFloat8E4m3fn);
  if (!bytes)
    k.fail("has dtype " + k.dtype_str() + "; an FP8 cache is passed as its bytes (uint8, int8 or float8_e4m3fn)");
  if (k.ndim() != 3 && k.ndim() != 4)
    k.fail("must be [num_blocks, page_block_size, 1, bytes_per_token] (or without the head dim), got " + k.shape_str());
  if (k.ndim() == 4 && k.shape[2] != 1)
    k.fail("has " + std::to_string(k.shape[2]) + " KV heads; sparse MLA caches have one (MQA)");
  const int64_t row_bytes = mla_bytes_per_token(format);
  if (k.shape.back() != row_bytes)
    k.fail("has " + std::to_string(k.shape.back()) + " bytes per token, but a " + mla_cache_format_name(format) +
           " cache (d_qk " + std::to_string(mla_head_dim_qk(format)) + ") has " + std::to_string(row_bytes));
  require_last_dim_unit(k);
  MlaSparseCache c;
  c.data = k.data;
  c.num_blocks = k.shape[0];
  c.block_size = to_int32(k.shape[1], k.op, k.name + "'s page_block_size");
  c.block_stride = k.strides[0];
  // A block of one token has no second row to step to: its rows are its blocks.
  c.row_stride = c.block_size > 1 ? k.strides[1] : k.strides[0];
  if (format == MlaCacheFormat::kModel1 && c.block_size > 1 && k.strides[1] != row_bytes)
    k.fail("must keep each block's bytes together (stride(1) = " + std::to_string(row_bytes) + ", got " +
           std::to_string(k.strides[1]) + "): a MODEL1 block is laid out as a whole");
  if (c.block_stride < 0 || c.row_stride < 0) k.fail("has a negative stride");

  ids.require_int32();
  if (ids.ndim() != 3 || ids.shape[0] != batch || ids.shape[1] != q_len)
    ids.fail("must be [batch = " + std::to_string(batch) + ", seq_len_q = " + std::to_string(q_len) +
             ", topk] int32, got " + ids.shape_str());
  require_last_dim_unit(ids);
  c.indices = static_cast<const int32_t*>(ids.data);
  c.topk = to_int32(ids.shape[2], ids.op, ids.name + "'s topk");
  c.index_batch_stride = ids.strides[0];
  c.index_token_stride = ids.strides[1];
  if (lengths) {
    lengths->require_int32();
    require_vector(*lengths, batch, "[batch]");
    c.topk_length = static_cast<const int32_t*>(lengths->data);
  }
  return c;
}

uintptr_t stream_of(const Tensor& q, nb::handle q_handle, uintptr_t stream, bool use_current) {
  if (!use_current || q.device != Device::kCuda) return stream;
  const dlpack_abi::ExchangeApi* api = exchange_api_of(q_handle);
  if (api == nullptr || api->current_work_stream == nullptr) return stream;
  void* current = nullptr;
  if (api->current_work_stream(2, q.device_id, &current) != 0) nb::raise_python_error();
  return reinterpret_cast<uintptr_t>(current);
}

void mla_sparse_decode(const MlaSparsePlan& plan, nb::handle q_h, nb::handle k_h, nb::handle ids_h, nb::handle len_h,
                       nb::handle sink_h, nb::handle extra_k_h, nb::handle extra_ids_h, nb::handle extra_len_h,
                       nb::handle o_h, nb::handle lse_h, nb::handle ws_h, float scale, uintptr_t stream,
                       bool current_stream) {
  const std::string op = "flash_mla_with_kvcache";
  const Tensor q = describe_handle(q_h, op, "q"), k = describe_handle(k_h, op, "k_cache"),
               ids = describe_handle(ids_h, op, "indices"), o = describe_handle(o_h, op, "out"),
               ws = describe_handle(ws_h, op, "workspace");
  const auto lengths = describe_optional(len_h, op, "topk_length");
  const auto sink = describe_optional(sink_h, op, "attn_sink");
  const auto extra_k = describe_optional(extra_k_h, op, "extra_k_cache");
  const auto extra_ids = describe_optional(extra_ids_h, op, "extra_indices_in_kvcache");
  const auto extra_lengths = describe_optional(extra_len_h, op, "extra_topk_length");
  const auto lse = describe_optional(lse_h, op, "lse");
  const auto opt = [](const std::optional<Tensor>& t) { return t ? &*t : nullptr; };
  const Device device = common_device(
      op, {&q, &k, &ids, &o, &ws, opt(lengths), opt(sink), opt(extra_k), opt(extra_ids), opt(extra_lengths), opt(lse)});

  q.require_ndim(4, "[batch, seq_len_q, num_heads_q, head_dim]");
  require_last_dim_unit(q);
  MlaSparseParams p;
  const int64_t dqk = q.shape[3];
  if (dqk == 576) {
    p.format = MlaCacheFormat::kV32;
  } else if (dqk == 512) {
    p.format = MlaCacheFormat::kModel1;
  } else {
    q.fail("has head_dim " + std::to_string(dqk) + "; sparse decode takes 576 (V3.2 caches) or 512 (MODEL1)");
  }
  p.dtype = q.float_dtype();
  p.batch = to_int32(q.shape[0], op, "batch");
  p.q_len = to_int32(q.shape[1], op, "seq_len_q");
  p.num_heads = to_int32(q.shape[2], op, "num_heads_q");
  p.q = q.data;
  // Dims of extent 1 report any stride: give them the ones the folding expects.
  p.q_head_stride = p.num_heads > 1 ? q.strides[2] : p.q_len > 1 ? q.strides[1] : dqk;
  p.q_token_stride = p.q_len > 1 ? q.strides[1] : int64_t{p.num_heads} * p.q_head_stride;
  p.q_batch_stride = q.strides[0];
  p.cache = cache_of(k, ids, lengths, p.format, p.batch, p.q_len);
  if (extra_k || extra_ids || extra_lengths) {
    if (!extra_k || !extra_ids)
      throw Error(op + ": extra_k_cache and extra_indices_in_kvcache come together (extra_topk_length is optional)");
    p.extra = cache_of(*extra_k, *extra_ids, extra_lengths, p.format, p.batch, p.q_len);
  }
  if (sink) {
    sink->require_float32();
    require_vector(*sink, p.num_heads, "[num_heads_q]");
    p.attn_sink = static_cast<const float*>(sink->data);
  }
  if (o.float_dtype() != p.dtype) o.fail("has dtype " + o.dtype_str() + " but q has " + q.dtype_str());
  o.require_shape({q.shape[0], q.shape[1], q.shape[2], kMlaSparseHeadDimV}, "[batch, seq_len_q, num_heads_q, 512]");
  o.require_contiguous();
  p.o = o.data;
  if (lse) {
    lse->require_float32();
    lse->require_shape({q.shape[0], q.shape[1], q.shape[2]}, "[batch, seq_len_q, num_heads_q]");
    lse->require_contiguous();
    p.lse = static_cast<float*>(lse->data);
  }
  p.scale = scale;
  if (ws.dtype.bits != 8) ws.fail("must be a uint8 tensor");
  ws.require_contiguous();
  if (static_cast<size_t>(ws.numel()) < plan.workspace.total)
    ws.fail("holds " + std::to_string(ws.numel()) + " bytes; the plan needs " + std::to_string(plan.workspace.total));

  DeviceGuard guard(q);
  if (device == Device::kCpu) {
    nb::gil_scoped_release release;
    run_mla_sparse_cpu(p, plan, ws.data);
  } else {
    run_mla_sparse_cuda(p, plan, ws.data, stream_ptr(stream_of(q, q_h, stream, current_stream)));
  }
}

}  // namespace

void bind_mla_sparse(nb::module_& m) {
  nb::class_<MlaSparsePlan>(m, "MlaSparsePlan",
                            "The split-KV plan of the FlashMLA-shaped sparse decode: both caches' chunks and the one\n"
                            "merge behind them, for fixed shapes (batch, seq_len_q, heads, topk, extra_topk).")
      .def_prop_ro("workspace_bytes", [](const MlaSparsePlan& p) { return p.workspace.total; })
      .def_prop_ro("num_requests", &MlaSparsePlan::num_requests)
      .def_ro("num_partials", &MlaSparsePlan::num_partials)
      .def_ro("max_partials", &MlaSparsePlan::max_partials)
      .def_prop_ro("main_items", [](const MlaSparsePlan& p) { return p.main.work.size(); })
      .def_prop_ro("extra_items", [](const MlaSparsePlan& p) { return p.extra.work.size(); })
      .def("__repr__", [](const MlaSparsePlan& p) {
        return "<MlaSparsePlan batch=" + std::to_string(p.shape.batch) + " seq_len_q=" + std::to_string(p.shape.q_len) +
               " heads=" + std::to_string(p.shape.num_heads) + " topk=" + std::to_string(p.shape.topk) +
               " extra_topk=" + std::to_string(p.shape.extra_topk) + " items=" + std::to_string(p.main.work.size()) +
               "+" + std::to_string(p.extra.work.size()) + " partials=" + std::to_string(p.num_partials) + ">";
      });

  m.def(
      "make_mla_sparse_plan",
      [](int32_t batch, int32_t q_len, int32_t num_heads, int32_t topk, int32_t extra_topk, Device device,
         int32_t fixed_chunk_tokens) {
        PlanShape machine;
        if (device == Device::kCuda) {
          const CudaLaunchShape launch = cuda_launch_shape(512, 512, 64, num_heads);
          machine.num_sms = cuda_multiprocessor_count();
          machine.items_per_sm = launch.ctas_per_sm;
          machine.ctas_per_item = launch.ctas_per_item;
        } else {
          machine.num_sms = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
          machine.chunk_granule = 16;  // the CPU loop has no token tile
        }
        machine.fixed_chunk_tokens = fixed_chunk_tokens;
        return make_mla_sparse_plan({batch, q_len, num_heads, topk, extra_topk}, machine);
      },
      nb::arg("batch"), nb::arg("seq_len_q"), nb::arg("num_heads"), nb::arg("topk"), nb::arg("extra_topk") = 0,
      nb::arg("device") = Device::kCpu, nb::arg("fixed_chunk_tokens") = 0,
      "The plan for these shapes on `device` (CUDA: the current device's SMs and the MLA kernel's CTAs).\n"
      "extra_topk 0: no extra cache. fixed_chunk_tokens > 0 forces chunks of that many tokens (tests).");

  m.def(
      "upload_mla_sparse_plan",
      [](const MlaSparsePlan& plan, nb::handle workspace, uintptr_t stream) {
        const Tensor ws = describe_handle(workspace, "upload_mla_sparse_plan", "workspace");
        ws.require_contiguous();
        if (static_cast<size_t>(ws.numel()) * (ws.dtype.bits / 8) < plan.workspace.total)
          ws.fail("holds fewer than the plan's " + std::to_string(plan.workspace.total) + " bytes");
        check_mla_sparse_plan(plan);
        on_cuda_workspace(ws, [&] { upload_mla_sparse_plan_cuda(plan, ws.data, stream_ptr(stream)); });
      },
      nb::arg("plan"), nb::arg("workspace"), nb::arg("stream") = 0,
      "Copies the plan's lists into a CUDA workspace and synchronizes: once per plan, before capture.");

  m.def("mla_sparse_decode", &mla_sparse_decode, nb::arg("plan"), nb::arg("q"), nb::arg("k_cache"), nb::arg("indices"),
        nb::arg("topk_length").none(), nb::arg("attn_sink").none(), nb::arg("extra_k_cache").none(),
        nb::arg("extra_indices").none(), nb::arg("extra_topk_length").none(), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("workspace"), nb::arg("scale"), nb::arg("stream") = 0, nb::arg("current_stream") = true,
        "The launch behind sparsepage.flash_mla_compat.flash_mla_with_kvcache (its docstring has the\n"
        "semantics): writes out [b, s_q, h_q, 512] and lse [b, s_q, h_q] (or None). On CUDA it runs on\n"
        "torch's current stream when q publishes DLPack's exchange table (current_stream), else on\n"
        "`stream`; the plan must be uploaded into `workspace` first.");

  m.def(
      "read_mla_sparse_error_flag",
      [](const MlaSparsePlan& plan, nb::handle workspace, uintptr_t stream) {
        const Tensor ws = describe_handle(workspace, "read_mla_sparse_error_flag", "workspace");
        return on_cuda_workspace(ws, [&] { return read_mla_sparse_error_flag(plan, ws.data, stream_ptr(stream)); });
      },
      nb::arg("plan"), nb::arg("workspace"), nb::arg("stream") = 0,
      "Reads and clears the CUDA error flag (synchronizes). Nonzero: an id lay outside its cache and\n"
      "that query's output is NaN. Always 0 on the CPU, which raises instead.");
}

}  // namespace sparsepage::py
