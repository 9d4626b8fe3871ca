// Bindings of the FlashMLA-shaped sparse decode (sparsepage/mla_sparse.h):
// its plan, the plan's upload, the launch and the error flag; and of the
// sparse prefill in flash_mla_sparse_fwd's form (sparsepage/prefill.h). Tensors come
// as torch tensors (described through DLPack's C exchange table where torch
// publishes it), DLPack capsules or numpy arrays; FP8 caches as 8-bit
// tensors (uint8, int8 or float8_e4m3fn bytes). sparsepage.flash_mla_compat
// is the Python face of these.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "cpu/parallel.h"
#include "dlpack_exchange.h"
#include "sparsepage/decode.h"
#include "sparsepage/mla_sparse.h"
#include "sparsepage/prefill.h"
#include "tensor.h"

namespace sparsepage::py {
namespace {

constexpr uint8_t kDLFloat8E4m3fn = 10;  // DLPack's code for float8_e4m3fn

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
  k.require_unit_stride_last();
  MlaSparseCache c;
  c.data = k.data;
  c.num_blocks = k.shape[0];
  c.block_size = k.extent_int32(1, "page_block_size");
  c.block_stride = k.strides[0];
  // A block of one token has no second row to step to: its rows are its blocks.
  c.row_stride = k.stride_or(1, k.strides[0]);
  if (format == MlaCacheFormat::kModel1 && c.block_size > 1 && k.strides[1] != row_bytes)
    k.fail("must keep each block's bytes together (stride(1) = " + std::to_string(row_bytes) + ", got " +
           std::to_string(k.strides[1]) + "): a MODEL1 block is laid out as a whole");
  if (c.block_stride < 0 || c.row_stride < 0) k.fail("has a negative stride");

  ids.require_int32();
  if (ids.ndim() != 3 || ids.shape[0] != batch || ids.shape[1] != q_len)
    ids.fail("must be [batch = " + std::to_string(batch) + ", seq_len_q = " + std::to_string(q_len) +
             ", topk] int32, got " + ids.shape_str());
  ids.require_unit_stride_last();
  c.indices = static_cast<const int32_t*>(ids.data);
  c.topk = ids.extent_int32(2, "topk");
  c.index_batch_stride = ids.strides[0];
  c.index_token_stride = ids.strides[1];
  if (lengths) {
    lengths->require_int32_array({batch}, "[batch]");
    c.topk_length = static_cast<const int32_t*>(lengths->data);
  }
  return c;
}

// The launch's stream: q's type's current stream (use_current), else `stream`.
void* stream_of(const Tensor& q, nb::handle q_handle, uintptr_t stream, bool use_current) {
  if (!use_current) return stream_ptr(stream);
  return current_work_stream(exchange_api_of(q_handle), q, stream_ptr(stream));
}

void mla_sparse_decode(const MlaSparsePlan& plan, nb::handle q_h, nb::handle k_h, nb::handle ids_h, nb::handle len_h,
                       nb::handle sink_h, nb::handle extra_k_h, nb::handle extra_ids_h, nb::handle extra_len_h,
                       nb::handle o_h, nb::handle lse_h, nb::handle ws_h, float scale, uintptr_t stream,
                       bool current_stream) {
  const std::string op = "flash_mla_with_kvcache";
  const Tensor q = describe_handle(q_h, op, "q"), k = describe_handle(k_h, op, "k_cache"),
               ids = describe_handle(ids_h, op, "indices"), o = describe_handle(o_h, op, "out"),
               ws = describe_handle(ws_h, op, "workspace");
  const auto lengths = describe_optional_handle(len_h, op, "topk_length");
  const auto sink = describe_optional_handle(sink_h, op, "attn_sink");
  const auto extra_k = describe_optional_handle(extra_k_h, op, "extra_k_cache");
  const auto extra_ids = describe_optional_handle(extra_ids_h, op, "extra_indices_in_kvcache");
  const auto extra_lengths = describe_optional_handle(extra_len_h, op, "extra_topk_length");
  const auto lse = describe_optional_handle(lse_h, op, "lse");
  const Device device = common_device(op, {q, k, ids, o, ws, lengths, sink, extra_k, extra_ids, extra_lengths, lse});

  q.require_ndim(4, "[batch, seq_len_q, num_heads_q, head_dim]");
  q.require_unit_stride_last();
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
  p.q_head_stride = q.stride_or(2, q.stride_or(1, dqk));
  p.q_token_stride = q.stride_or(1, int64_t{p.num_heads} * p.q_head_stride);
  p.q_batch_stride = q.strides[0];
  p.cache = cache_of(k, ids, lengths, p.format, p.batch, p.q_len);
  if (extra_k || extra_ids || extra_lengths) {
    if (!extra_k || !extra_ids)
      throw Error(op + ": extra_k_cache and extra_indices_in_kvcache come together (extra_topk_length is optional)");
    p.extra = cache_of(*extra_k, *extra_ids, extra_lengths, p.format, p.batch, p.q_len);
  }
  if (sink) {
    sink->require_float32_array({p.num_heads}, "[num_heads_q]");
    p.attn_sink = static_cast<const float*>(sink->data);
  }
  o.require_same_dtype(q);
  o.require_shape({q.shape[0], q.shape[1], q.shape[2], kMlaSparseHeadDimV}, "[batch, seq_len_q, num_heads_q, 512]");
  o.require_contiguous();
  p.o = o.data;
  if (lse) {
    lse->require_float32_array({q.shape[0], q.shape[1], q.shape[2]}, "[batch, seq_len_q, num_heads_q]");
    p.lse = static_cast<float*>(lse->data);
  }
  p.scale = scale;
  if (ws.dtype.bits != 8) ws.fail("must be a uint8 tensor");
  ws.require_workspace(plan.workspace.total);

  DeviceGuard guard(q);
  if (device == Device::kCpu) {
    nb::gil_scoped_release release;
    run_mla_sparse_cpu(p, plan, ws.data);
  } else {
    run_mla_sparse_cuda(p, plan, ws.data, stream_of(q, q_h, stream, current_stream));
  }
}

/// flash_mla_sparse_fwd's call over MlaSparsePrefill: one sequence of s_q
/// query tokens over s_kv rows, no causal limit (the ids decide).
void mla_sparse_prefill(MlaSparsePrefill& prefill, nb::handle q_h, nb::handle kv_h, nb::handle ids_h, float scale,
                        nb::handle sink_h, nb::handle len_h, nb::handle out_h, nb::handle lse_h, nb::handle max_h,
                        uintptr_t stream, bool current_stream) {
  const std::string op = "flash_mla_sparse_fwd";
  const Tensor q = describe_handle(q_h, op, "q"), kv = describe_handle(kv_h, op, "kv"),
               ids = describe_handle(ids_h, op, "indices"), out = describe_handle(out_h, op, "out"),
               lse = describe_handle(lse_h, op, "lse");
  const auto sink = describe_optional_handle(sink_h, op, "attn_sink");
  const auto lengths = describe_optional_handle(len_h, op, "topk_length");
  const auto max_logits = describe_optional_handle(max_h, op, "max_logits");
  const Device device = common_device(op, {q, kv, ids, out, lse, sink, lengths, max_logits});

  q.require_ndim(3, "[s_q, h_q, 576]");
  if (q.shape[2] != 576) q.fail("has d_qk " + std::to_string(q.shape[2]) + "; the sparse prefill takes 576 (512 + 64)");
  q.require_unit_stride_last();
  kv.require_ndim(3, "[s_kv, h_kv, 576]");
  if (kv.shape[1] != 1) kv.fail("has " + std::to_string(kv.shape[1]) + " KV heads; sparse MLA has one (h_kv = 1)");
  if (kv.shape[2] != 576) kv.fail("has d_qk " + std::to_string(kv.shape[2]) + "; q has 576");
  kv.require_same_dtype(q);
  kv.require_unit_stride_last();
  const int64_t s_q = q.shape[0], h_q = q.shape[1], s_kv = kv.shape[0];
  ids.require_int32();
  ids.require_ndim(3, "[s_q, h_kv, topk]");
  if (ids.shape[0] != s_q || ids.shape[1] != 1)
    ids.fail("must be [s_q = " + std::to_string(s_q) + ", h_kv = 1, topk] int32, got " + ids.shape_str());
  ids.require_unit_stride_last();

  MlaPrefillParams p;
  p.dtype = q.float_dtype();
  p.causal = false;
  p.chunk = {1, to_int32(s_q, op, "s_q"), s_kv, nullptr};
  p.num_heads = to_int32(h_q, op, "h_q");
  p.topk = to_int32(ids.shape[2], op, "topk");
  p.q = q.data;
  p.q_rope = static_cast<const char*>(q.data) + 512 * dtype_size(p.dtype);
  p.qo_layout = QueryLayout::kStrided;
  // Dims of extent 1 report any stride: give them the packed ones.
  const int64_t head_stride = q.stride_or(1, 576);
  const int64_t token_stride = q.stride_or(0, h_q * head_stride);
  p.q_strides = p.q_rope_strides = {s_q * token_stride, head_stride, token_stride};  // {seq, head, token}
  const int64_t row = kv.stride_or(0, 576);
  p.kv = {kv.data, row, 512, 0, 0, s_kv};
  p.kv_rope = {static_cast<const char*>(kv.data) + 512 * dtype_size(p.dtype), row, 64, 0, 0, s_kv};
  p.indices = static_cast<const int32_t*>(ids.data);
  p.index_token_stride = ids.stride_or(0, p.topk);
  if (lengths) {
    lengths->require_int32_array({s_q}, "[s_q]");
    p.topk_length = static_cast<const int32_t*>(lengths->data);
  }
  if (sink) {
    sink->require_float32_array({h_q}, "[h_q]");
    p.attn_sink = static_cast<const float*>(sink->data);
  }
  p.scale = scale;
  out.require_same_dtype(q);
  out.require_shape({s_q, h_q, 512}, "[s_q, h_q, 512]");
  out.require_contiguous();
  p.out_strides = {s_q * h_q * 512, 512, h_q * 512};
  p.out = out.data;
  lse.require_float32_array({s_q, h_q}, "[s_q, h_q]");
  p.lse = static_cast<float*>(lse.data);
  if (max_logits) {
    max_logits->require_float32_array({s_q, h_q}, "[s_q, h_q]");
    p.max_logits = static_cast<float*>(max_logits->data);
  }
  q.require_device(prefill.device(), "the prefill object");
  DeviceGuard guard(q);
  if (device == Device::kCpu) {
    nb::gil_scoped_release release;
    prefill.run(p);
  } else {
    prefill.run(p, stream_of(q, q_h, stream, current_stream));
  }
}

}  // namespace

void bind_mla_sparse(nb::module_& m) {
  nb::class_<MlaSparsePrefill>(m, "MlaSparsePrefill",
                               "The sparse MLA prefill on one device (sparsepage/prefill.h): keeps its plan and\n"
                               "workspace for the last shape (s_q, h_q, topk), re-planning when it changes.")
      .def(nb::init<Device>(), nb::arg("device"))
      .def_prop_ro("kernel_name", [](const MlaSparsePrefill& p) { return std::string(p.kernel_name()); })
      .def(
          "check_errors", [](MlaSparsePrefill& p, uintptr_t stream) { p.check_errors(stream_ptr(stream)); },
          nb::arg("stream") = 0,
          "CUDA: synchronizes and raises when the last run met an id outside [0, s_kv) other than -1\n"
          "(its query's out and lse are NaN). The CPU raises in the run instead.");
  m.def("mla_sparse_prefill", &mla_sparse_prefill, nb::arg("prefill"), nb::arg("q"), nb::arg("kv"), nb::arg("indices"),
        nb::arg("scale"), nb::arg("attn_sink").none(), nb::arg("topk_length").none(), nb::arg("out"), nb::arg("lse"),
        nb::arg("max_logits").none(), nb::arg("stream") = 0, nb::arg("current_stream") = true,
        "The launch behind sparsepage.flash_mla_compat.flash_mla_sparse_fwd (its docstring has the\n"
        "semantics): writes out [s_q, h_q, 512], lse [s_q, h_q] and, on the CPU, max_logits.");

  nb::class_<MlaSparsePlan>(m, "MlaSparsePlan",
                            "The split-KV plan of the FlashMLA-shaped sparse decode for fixed shapes (batch,\n"
                            "seq_len_q, heads, topk, extra_topk): with an extra cache both caches' chunks and one\n"
                            "merge behind them; without one the decode's own plan (see `direct`).")
      .def_prop_ro("workspace_bytes", [](const MlaSparsePlan& p) { return p.workspace.total; })
      .def_prop_ro("num_requests", &MlaSparsePlan::num_requests)
      .def_ro("num_partials", &MlaSparsePlan::num_partials)
      .def_ro("max_partials", &MlaSparsePlan::max_partials)
      .def_prop_ro("direct", &MlaSparsePlan::direct,
                   "True without an extra cache: the decode's own plan (unsplit queries write out directly)")
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
          machine.num_sms = cpu::hardware_threads();
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
        ws.require_workspace(plan.workspace.total);
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
