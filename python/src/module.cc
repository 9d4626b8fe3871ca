// sparsepage._core: the Python bindings' entry point. Vocabulary (dtypes,
// devices, errors), the page table, the plan and the dispatch policy live
// here; decode.cc binds the decode entry points and layers.cc the models.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "sparsepage/dispatch.h"
#include "sparsepage/fp8.h"
#include "sparsepage/memory.h"
#include "sparsepage/page_table.h"
#include "sparsepage/plan.h"
#include "tensor.h"

namespace sparsepage::py {

void bind_decode(nb::module_& m);
void bind_layers(nb::module_& m);
void bind_mla_sparse(nb::module_& m);

namespace {

std::string repr_counts(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  if (v.size() > 8) s += ", ...";
  return s + "]";
}

void bind_vocabulary(nb::module_& m) {
  nb::exception<Error>(m, "Error", PyExc_ValueError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const NotImplemented& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });

  nb::enum_<DType>(m, "DType", "Element type of a tensor or pool.")
      .value("f32", DType::kF32)
      .value("f16", DType::kF16)
      .value("bf16", DType::kBF16);
  nb::enum_<Device>(m, "Device", "Where a buffer lives and which backend runs over it.")
      .value("cpu", Device::kCpu)
      .value("cuda", Device::kCuda);

  m.def("cuda_available", &cuda_available, "True when this build has the CUDA backend and a GPU is visible.");
  m.def(
      "built_with_cuda",
      []() {
#ifdef SPARSEPAGE_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "True when this extension was built with the CUDA backend.");
  m.def("cuda_multiprocessor_count", &cuda_multiprocessor_count,
        "Multiprocessors of the current CUDA device (what a plan fills).");
  m.def("cuda_supports_head_dims", &cuda_supports_head_dims, nb::arg("head_dim_qk"), nb::arg("head_dim_v"),
        nb::arg("head_dim_extra") = 0, "Whether the fused CUDA kernels are built for these head dims.");
  nb::class_<CudaLaunchShape>(m, "CudaLaunchShape", "How the CUDA kernel for some dims spreads one work item.")
      .def_ro("ctas_per_item", &CudaLaunchShape::ctas_per_item)
      .def_ro("ctas_per_sm", &CudaLaunchShape::ctas_per_sm);
  m.def("cuda_launch_shape", &cuda_launch_shape, nb::arg("head_dim_qk"), nb::arg("head_dim_v"),
        nb::arg("head_dim_extra"), nb::arg("group_size"), nb::arg("q_len") = 1,
        "CTAs per work item and per SM of the CUDA kernel for these dims (feeds PlanShape).");
}

void bind_page_table(nb::module_& m) {
  nb::class_<PageTableStructure>(m, "PageTableStructure",
                                 "Everything of the CSR page table but `indices`, derived on the host from counts.\n"
                                 "Visible token i of request r lives at pool page\n"
                                 "indices[indptr[r] + (first_page_offset[r] + i) // page_size].")
      .def(
          "__init__",
          [](PageTableStructure* t, int32_t page_size, nb::handle indptr, nb::handle last_page_len,
             nb::handle first_page_offset, nb::handle seq_lens) {
            const std::string op = "PageTableStructure";
            new (t) PageTableStructure{
                page_size, host_int32(indptr, op, "indptr"), host_int32(last_page_len, op, "last_page_len"),
                host_int32(first_page_offset, op, "first_page_offset"), host_int32(seq_lens, op, "seq_lens")};
          },
          nb::kw_only(), nb::arg("page_size"), nb::arg("indptr"), nb::arg("last_page_len"),
          nb::arg("first_page_offset"), nb::arg("seq_lens"),
          "A structure from explicit arrays (host values), e.g. to validate one built elsewhere.")
      .def_ro("page_size", &PageTableStructure::page_size)
      .def_prop_ro(
          "indptr", [](const PageTableStructure& t) { return numpy_int32(t.indptr, {t.indptr.size()}); },
          "int32 [num_requests + 1]")
      .def_prop_ro(
          "last_page_len",
          [](const PageTableStructure& t) { return numpy_int32(t.last_page_len, {t.last_page_len.size()}); },
          "int32 [num_requests]; 0 for an empty request")
      .def_prop_ro(
          "first_page_offset",
          [](const PageTableStructure& t) { return numpy_int32(t.first_page_offset, {t.first_page_offset.size()}); },
          "int32 [num_requests], each in [0, page_size)")
      .def_prop_ro(
          "seq_lens", [](const PageTableStructure& t) { return numpy_int32(t.seq_lens, {t.seq_lens.size()}); },
          "int32 [num_requests]: visible tokens")
      .def_prop_ro("num_requests", &PageTableStructure::num_requests)
      .def_prop_ro("num_pages", &PageTableStructure::num_pages, "Length `indices` must have.")
      .def_prop_ro("total_tokens", &PageTableStructure::total_tokens)
      .def("__repr__", [](const PageTableStructure& t) {
        return "PageTableStructure(page_size=" + std::to_string(t.page_size) + ", seq_lens=" + repr_counts(t.seq_lens) +
               ", num_pages=" + std::to_string(t.num_pages()) + ")";
      });

  m.def(
      "quantize_mla_fp8",
      [](const In& src, const Out& dst, uintptr_t stream) {
        const std::string op = "quantize_mla_fp8";
        const Tensor s = describe(src, op, "src"), d = describe(dst, op, "dst");
        const Device device = common_device(op, {s, d});
        if (s.float_dtype() != DType::kBF16) s.fail("has dtype " + s.dtype_str() + "; the format's source is bfloat16");
        s.require_ndim(2, "[rows, 576] (512 latent then 64 rope values)");
        if (s.shape[1] != MlaFp8Row::kLatent + MlaFp8Row::kRope)
          s.fail("rows are " + std::to_string(s.shape[1]) + " values wide, not 576");
        s.require_unit_stride_last();
        if (!d.is_uint8()) d.fail("has dtype " + d.dtype_str() + "; FP8 rows are uint8");
        d.require_ndim(2, "[rows, row_bytes >= 656]");
        if (d.shape[0] != s.shape[0])
          d.fail("has " + std::to_string(d.shape[0]) + " rows; src has " + std::to_string(s.shape[0]));
        if (d.shape[1] < MlaFp8Row::kBytes)
          d.fail("rows are " + std::to_string(d.shape[1]) + " bytes, fewer than the format's 656");
        d.require_unit_stride_last();
        const int64_t src_stride = s.stride_or(0, s.shape[1]);
        const int64_t dst_stride = d.stride_or(0, d.shape[1]);
        if (device == Device::kCuda) {
          DeviceGuard guard(d);
          quantize_mla_fp8_cuda(DType::kBF16, s.data, s.shape[0], src_stride, d.data, dst_stride, stream_ptr(stream));
        } else {
          quantize_mla_fp8_cpu(DType::kBF16, s.data, s.shape[0], src_stride, d.data, dst_stride);
        }
      },
      nb::arg("src"), nb::arg("dst"), nb::arg("stream") = 0,
      "Writes the engines' FP8 MLA rows (512 e4m3 latent values, 4 fp32 scales of 128 values each,\n"
      "64 bf16 rope values: 656 bytes) of bfloat16 src [rows, 576] (latent then rope) into uint8\n"
      "dst [rows, row_bytes >= 656, a multiple of 16], on the tensors' device (asynchronous\n"
      "on `stream` there). Per 128 latent values scale = amax / 448; a NaN makes its block's scale NaN.\n"
      "The CPU and CUDA quantizers give the same bytes.");

  m.def(
      "build_page_table_structure",
      [](nb::handle seq_lens, int32_t page_size, nb::handle first_page_offsets) {
        const std::string op = "build_page_table_structure";
        std::vector<int32_t> lens = host_int32(seq_lens, op, "seq_lens");
        std::vector<int32_t> offsets;
        if (!first_page_offsets.is_none()) offsets = host_int32(first_page_offsets, op, "first_page_offsets");
        return build_page_table_structure(lens, page_size, offsets);
      },
      nb::arg("seq_lens"), nb::arg("page_size"), nb::arg("first_page_offsets") = nb::none(),
      "Derives the page-table structure from per-request visible counts (host values).\n"
      "Raises sparsepage.Error naming the argument on bad input.");

  auto indices_of = [](nb::handle indices, const std::string& op) -> std::optional<std::vector<int32_t>> {
    if (indices.is_none()) return std::nullopt;
    In a;
    if (!nb::try_cast(indices, a)) throw Error(op + ": indices must be a CPU int32 array");
    Tensor t = describe(a, op, "indices");
    if (t.device != Device::kCpu) t.fail("must be a host array (the validator reads it)");
    t.require_int32();
    t.require_ndim(1, "[num_pages]");
    std::vector<int32_t> v(static_cast<size_t>(t.shape[0]));
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = *(static_cast<const int32_t*>(t.data) + static_cast<int64_t>(i) * t.strides[0]);
    return v;
  };
  m.def(
      "check_page_table",
      [indices_of](const PageTableStructure& table, nb::handle indices, int64_t num_pool_pages) {
        auto v = indices_of(indices, "check_page_table");
        check_page_table(table, v ? &*v : nullptr, num_pool_pages);
      },
      nb::arg("table"), nb::arg("indices") = nb::none(), nb::arg("num_pool_pages") = 0,
      "Raises sparsepage.Error with the validator's message when `table` is invalid.");
}

void bind_plan(nb::module_& m) {
  nb::class_<PlanShape>(m, "PlanShape", "What the split-KV plan needs to know about the problem and the machine.")
      .def(
          "__init__",
          [](PlanShape* s, int32_t group_size, int32_t head_dim_v, int32_t num_sms, int32_t items_per_sm,
             int32_t ctas_per_item, int32_t min_chunk_tokens, int32_t chunk_granule, int32_t fixed_chunk_tokens) {
            new (s) PlanShape{group_size,    head_dim_v,       num_sms,       items_per_sm,
                              ctas_per_item, min_chunk_tokens, chunk_granule, fixed_chunk_tokens};
          },
          nb::kw_only(), nb::arg("group_size") = 1, nb::arg("head_dim_v") = 128, nb::arg("num_sms") = 132,
          nb::arg("items_per_sm") = 2, nb::arg("ctas_per_item") = 1, nb::arg("min_chunk_tokens") = 128,
          nb::arg("chunk_granule") = 64, nb::arg("fixed_chunk_tokens") = 0)
      .def_rw("group_size", &PlanShape::group_size)
      .def_rw("head_dim_v", &PlanShape::head_dim_v)
      .def_rw("num_sms", &PlanShape::num_sms)
      .def_rw("items_per_sm", &PlanShape::items_per_sm)
      .def_rw("ctas_per_item", &PlanShape::ctas_per_item)
      .def_rw("min_chunk_tokens", &PlanShape::min_chunk_tokens)
      .def_rw("chunk_granule", &PlanShape::chunk_granule)
      .def_rw("fixed_chunk_tokens", &PlanShape::fixed_chunk_tokens);

  nb::class_<DecodePlan>(m, "DecodePlan",
                         "A host-only split-KV plan. Reuse it while the per-request counts are unchanged.")
      .def_ro("num_requests", &DecodePlan::num_requests)
      .def_ro("group_size", &DecodePlan::group_size)
      .def_ro("head_dim_v", &DecodePlan::head_dim_v)
      .def_ro("chunk_tokens", &DecodePlan::chunk_tokens)
      .def_ro("num_partials", &DecodePlan::num_partials)
      .def_prop_ro("needs_merge", &DecodePlan::needs_merge)
      .def_prop_ro("num_work_items", [](const DecodePlan& p) { return p.work.size(); })
      .def_prop_ro(
          "workspace_bytes", [](const DecodePlan& p) { return p.workspace.total; },
          "Bytes of workspace `paged_decode` needs (uint8 tensor on the decode's device).")
      .def_prop_ro(
          "work",
          [](const DecodePlan& p) {
            std::vector<int32_t> flat;
            for (const WorkItem& w : p.work)
              flat.insert(flat.end(), {w.request, w.token_begin, w.token_end, w.partial});
            return numpy_int32(std::move(flat), {p.work.size(), 4});
          },
          "int32 [num_work_items, 4]: request, token_begin, token_end, partial slot (-1: direct)")
      .def_prop_ro("seq_lens", [](const DecodePlan& p) { return numpy_int32(p.seq_lens, {p.seq_lens.size()}); })
      .def("__repr__", [](const DecodePlan& p) {
        return "DecodePlan(num_requests=" + std::to_string(p.num_requests) +
               ", group_size=" + std::to_string(p.group_size) + ", work_items=" + std::to_string(p.work.size()) +
               ", merge=" + (p.needs_merge() ? "on" : "off") +
               ", workspace_bytes=" + std::to_string(p.workspace.total) + ")";
      });

  m.def(
      "make_decode_plan",
      [](nb::handle seq_lens, const PlanShape& shape) {
        return make_decode_plan(host_int32(seq_lens, "make_decode_plan", "seq_lens"), shape);
      },
      nb::arg("seq_lens"), nb::arg("shape"),
      "Plans the split-KV decode from per-request visible counts (host values). Reads no device memory.");

  m.def(
      "serialize_decode_plan",
      [](const DecodePlan& plan) {
        auto* heap = new std::vector<int64_t>(serialize_decode_plan(plan));
        nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
        const size_t shape[1] = {heap->size()};
        return nb::ndarray<nb::numpy, int64_t>(heap->data(), 1, shape, owner).cast();
      },
      nb::arg("plan"),
      "The plan as data: a numpy int64 array holding every field (deserialize_decode_plan rebuilds it).\n"
      "What the torch ops take as their plan argument (a CPU int64 tensor), so no registry holds plans.");
  m.def(
      "deserialize_decode_plan",
      [](const In& words) {
        const Tensor t = describe(words, "deserialize_decode_plan", "words");
        if (t.device != Device::kCpu) t.fail("must be host values (a CPU array), not a CUDA tensor");
        t.require_ndim(1, "of int64 words");
        if (t.dtype != nb::dtype<int64_t>()) t.fail("has dtype " + t.dtype_str() + "; expected int64");
        t.require_contiguous();
        return deserialize_decode_plan(static_cast<const int64_t*>(t.data), static_cast<size_t>(t.shape[0]));
      },
      nb::arg("words"),
      "Rebuilds a plan from serialize_decode_plan's words (a 1-D int64 CPU array: numpy or a torch tensor).\n"
      "Raises sparsepage.Error naming what is wrong with a corrupted, truncated or foreign blob.");
}

void bind_dispatch(nb::module_& m) {
  nb::enum_<OutcomeKind>(m, "OutcomeKind", "What a fused attempt did.")
      .value("fused", OutcomeKind::kFused)
      .value("kill_switch", OutcomeKind::kKillSwitch)
      .value("below_floor", OutcomeKind::kBelowFloor)
      .value("below_sparsity", OutcomeKind::kBelowSparsity)
      .value("non_raw_cache", OutcomeKind::kNonRawCache)
      .value("unsupported_head_dim", OutcomeKind::kUnsupportedHeadDim)
      .value("no_device", OutcomeKind::kNoDevice)
      .value("unsupported_layout", OutcomeKind::kUnsupportedLayout)
      .value("unsupported_arch", OutcomeKind::kUnsupportedArch);

  nb::class_<SparseDecodeOutcome>(m, "SparseDecodeOutcome",
                                  "Fused (with its shape) or a fallback whose reason names its numbers.")
      .def(nb::init<>())
      .def_ro("kind", &SparseDecodeOutcome::kind)
      .def_ro("requests", &SparseDecodeOutcome::requests)
      .def_ro("selected_rows", &SparseDecodeOutcome::selected_rows)
      .def_ro("chunks", &SparseDecodeOutcome::chunks)
      .def_ro("merge", &SparseDecodeOutcome::merge)
      .def_ro("reason", &SparseDecodeOutcome::reason)
      .def_prop_ro(
          "kernel", [](const SparseDecodeOutcome& o) { return std::string(o.kernel); },
          "The kernel a fused launch ran (e.g. '64-row multi-token CTA, wgmma', 'CPU loop'); '' otherwise.")
      .def_prop_ro("fused", &SparseDecodeOutcome::fused)
      .def("describe", &SparseDecodeOutcome::describe)
      .def("__repr__", [](const SparseDecodeOutcome& o) { return "<SparseDecodeOutcome " + o.describe() + ">"; });

  nb::class_<DispatchConfig>(m, "DispatchConfig", "The policy's knobs (defaults are the measured ones).")
      .def(nb::init<>())
      .def_rw("enabled", &DispatchConfig::enabled)
      .def_rw("min_kv_tokens", &DispatchConfig::min_kv_tokens)
      .def_rw("min_kv_tokens_per_request", &DispatchConfig::min_kv_tokens_per_request)
      .def_rw("min_sparsity", &DispatchConfig::min_sparsity)
      .def_rw("assume_sm", &DispatchConfig::assume_sm)
      .def_static("defaults", &DispatchConfig::defaults)
      .def_static("from_environment", &DispatchConfig::from_environment);
  m.def("process_dispatch_config", &process_dispatch_config, nb::rv_policy::copy,
        "The process-wide configuration, read from the environment once.");

  nb::class_<DispatchStats>(m, "DispatchStats", "Running totals of outcomes.")
      .def_ro("fused", &DispatchStats::fused)
      .def_ro("fallbacks", &DispatchStats::fallbacks)
      .def_ro("fused_rows", &DispatchStats::fused_rows)
      .def_prop_ro(
          "by_kind",
          [](const DispatchStats& s) {
            nb::dict d;
            for (int k = 0; k < static_cast<int>(OutcomeKind::kCount); ++k)
              d[outcome_kind_name(static_cast<OutcomeKind>(k))] = s.by_kind[k];
            return d;
          },
          "Counts per outcome kind name.");
  m.def("dispatch_stats", &dispatch_stats, "Running totals of the outcomes recorded in this process.");
  m.def("reset_dispatch_stats", &reset_dispatch_stats,
        "Zeroes the totals and re-arms the once-per-kind announcements.");
}

}  // namespace
}  // namespace sparsepage::py

NB_MODULE(_core, m) {
  using namespace sparsepage::py;
  m.doc() = "sparsepage's C++ library, bound with nanobind (thin layer over DLPack tensors).";
  bind_vocabulary(m);
  bind_page_table(m);
  bind_plan(m);
  bind_dispatch(m);
  bind_decode(m);
  bind_layers(m);
  bind_mla_sparse(m);
}
