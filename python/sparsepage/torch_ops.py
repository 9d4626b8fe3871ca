"""torch custom ops over sparsepage (``import sparsepage.torch_ops`` imports torch).

The ops are registered with :mod:`torch.library` under the ``sparsepage``
namespace, each with a fake (meta) implementation, so that

* ``torch.compile`` traces a model that calls them (they stay opaque nodes);
* ``torch.cuda.graphs`` captures them: a launch allocates nothing,
  synchronizes nothing and reads nothing back, once its plan is uploaded;
* they run on torch's current stream (``torch.cuda.current_stream()``);
* the caller passes the workspace (``DecodePlan.new_workspace()``), so a step
  allocates only what the caller lets it.

The split-KV plan is host data made from per-request counts. The ops take
it as data, as FlashInfer's take their ``plan_info``: :attr:`DecodePlan.plan_info`
is a CPU int64 tensor holding the plan's serialized form, from which the op
rebuilds it, so a traced or captured function holds no hidden registry state
and a plan can be rebuilt from its data alone (:meth:`DecodePlan.from_plan_info`).
A model keeps one plan per distinct set of counts (for fixed top-k counts, one
for the whole run) and uploads it into its workspace before capture.

lse tensors are fp32 natural logarithms of the summed exponentials of the
scaled scores; an empty request gives ``o = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

from . import _core

__all__ = ["DecodePlan", "paged_decode", "paged_decode_out", "merge_states", "merge_state", "MlaSparseDecoder",
           "PagedKVDecoder"]

# torch's current raw stream in one C call (the public torch.cuda.current_stream(device)
# builds Python objects and costs microseconds a call); the public call where it is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


class DecodePlan:
    """A split-KV plan for the given per-request visible counts (host values).

    Args:
        seq_lens: visible tokens per request (a list or a CPU tensor).
        group_size: query heads per request (after GQA folding).
        head_dim_qk, head_dim_v, head_dim_extra: the kernel's dims (extra: the second K
            stream, 64 for MLA rope keys; 0 without one).
        device: where the decode runs; a CUDA plan is shaped for that GPU's SM count
            and kernel tiles.
        fixed_chunk_tokens: 0 lets the plan choose; otherwise every chunk has this
            many tokens (how tests force a split).
    """

    def __init__(self, seq_lens: Sequence[int], *, group_size: int, head_dim_qk: int, head_dim_v: int,
                 head_dim_extra: int = 0, device="cpu", fixed_chunk_tokens: int = 0):
        self.device = torch.device(device)
        if isinstance(seq_lens, torch.Tensor):
            seq_lens = seq_lens.cpu().tolist()
        self.seq_lens = [int(x) for x in seq_lens]
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                launch = _core.cuda_launch_shape(head_dim_qk, head_dim_v, head_dim_extra, group_size)
                # As SparseDecoder plans: fill the SMs with the kernel's resident CTAs.
                shape = _core.PlanShape(group_size=group_size, head_dim_v=head_dim_v,
                                        num_sms=_core.cuda_multiprocessor_count(), items_per_sm=launch.ctas_per_sm,
                                        ctas_per_item=launch.ctas_per_item, fixed_chunk_tokens=fixed_chunk_tokens)
        else:
            shape = _core.PlanShape(group_size=group_size, head_dim_v=head_dim_v, num_sms=max(1, os.cpu_count() or 1),
                                    fixed_chunk_tokens=fixed_chunk_tokens)
        self._set(_core.make_decode_plan(self.seq_lens, shape))

    def _set(self, plan) -> None:
        self.plan = plan
        # The plan as data: what the custom ops take (a CPU int64 tensor; see from_plan_info).
        self.plan_info = torch.from_numpy(_core.serialize_decode_plan(plan))

    @classmethod
    def from_plan_info(cls, plan_info: torch.Tensor, device="cpu") -> "DecodePlan":
        """The plan rebuilt from its data (``plan.plan_info``); raises sparsepage.Error naming what
        is wrong with a corrupted, truncated or foreign blob. `device` is where the decode runs (the
        data does not record it)."""
        self = cls.__new__(cls)
        self.device = torch.device(device)
        self._set(_core.deserialize_decode_plan(plan_info.detach().cpu().contiguous()))
        self.seq_lens = [int(x) for x in self.plan.seq_lens]
        return self

    @property
    def workspace_bytes(self) -> int:
        return self.plan.workspace_bytes

    def new_workspace(self) -> torch.Tensor:
        """A uint8 workspace of the size this plan needs, on its device (uploaded on CUDA)."""
        ws = torch.empty(max(1, self.workspace_bytes), dtype=torch.uint8, device=self.device)
        self.upload(ws)
        return ws

    def upload(self, workspace: torch.Tensor) -> None:
        """Copies the work lists into `workspace` on the current stream (CUDA); before capture."""
        _core.upload_plan(self.plan, workspace, _stream(workspace))

    def structure(self, page_size: int, first_page_offsets: Optional[Sequence[int]] = None):
        """indptr and seq_lens int32 tensors of the page table for these counts, on the plan's device."""
        t = _core.build_page_table_structure(self.seq_lens, page_size, first_page_offsets)
        return (torch.from_numpy(t.indptr).to(self.device), torch.from_numpy(t.seq_lens).to(self.device))


_to_dlpack = torch.utils.dlpack.to_dlpack


def _capsule_decode(plan, q, k, v, o, indptr, indices, seq_lens, page_size, scale, first_page_offset, lse, q_extra,
                    k_extra, workspace, num_pool_pages, request_row_stride, window_len, num_kv_heads, skip_minus_one,
                    block_table, block_table_rows, block_size):
    """The launch over DLPack capsules, on q's current stream: the exchange entry's twin (same
    arguments, same order) for torch without the exchange table. The capsules come from
    ``to_dlpack``, one C call (``Tensor.__dlpack__`` is Python code costing several microseconds
    a tensor); nanobind takes them as they are."""
    dl = _to_dlpack
    _core._paged_decode_positional(
        plan, dl(q), dl(k), dl(v), dl(o), None if indptr is None else dl(indptr), dl(indices),
        None if seq_lens is None else dl(seq_lens), page_size, scale,
        None if first_page_offset is None else dl(first_page_offset), None if lse is None else dl(lse),
        None if q_extra is None else dl(q_extra), None if k_extra is None else dl(k_extra), dl(workspace),
        num_pool_pages, request_row_stride, window_len, num_kv_heads, skip_minus_one,
        None if block_table is None else dl(block_table), None if block_table_rows is None else dl(block_table_rows),
        block_size, False, _stream(q))


# torch >= 2.11 publishes DLPack's C exchange table on torch.Tensor: the binding then describes each
# tensor with one C call and launches on torch's current stream, with no capsule. `_decode` is the
# launch every path calls, all arguments positional (the eager path's per-call cost is mostly
# Python; see docs/PERFORMANCE.md).
_exchange = _core._has_exchange_api(torch.empty(0))
_decode = _core._paged_decode_exchange if _exchange else _capsule_decode


_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor


def _eager(*tensors) -> bool:
    """Whether a call can skip the custom-op dispatcher: not under torch.compile, and plain
    tensors (no fake or functional tensor subclasses, as tracers pass). The dispatcher adds tens
    of microseconds a call and is only needed for tracing; graph capture works either way."""
    return not _is_compiling() and all(t is None or type(t) is _Tensor for t in tensors)


@torch.library.custom_op("sparsepage::paged_decode_out", mutates_args=("o", "lse", "workspace"))
def _paged_decode_out(plan_info: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      indptr: Optional[torch.Tensor], indices: torch.Tensor, seq_lens: Optional[torch.Tensor],
                      first_page_offset: Optional[torch.Tensor], q_extra: Optional[torch.Tensor],
                      k_extra: Optional[torch.Tensor], workspace: torch.Tensor, o: torch.Tensor,
                      lse: Optional[torch.Tensor], page_size: int, scale: float, num_pool_pages: int,
                      request_row_stride: int, window_len: int, num_kv_heads: int, skip_minus_one: bool,
                      block_table: Optional[torch.Tensor], block_table_rows: Optional[torch.Tensor],
                      block_size: int) -> None:
    # The plan from its data (DecodePlan.plan_info): the op holds no state of its own.
    p = _core.deserialize_decode_plan(plan_info)
    _decode(p, q, k, v, o, indptr, indices, seq_lens, page_size, scale, first_page_offset, lse, q_extra, k_extra,
            workspace, num_pool_pages, request_row_stride, window_len, num_kv_heads, skip_minus_one, block_table,
            block_table_rows, block_size)


@_paged_decode_out.register_fake
def _(plan_info, q, k, v, indptr, indices, seq_lens, first_page_offset, q_extra, k_extra, workspace, o, lse, page_size,
      scale, num_pool_pages, request_row_stride, window_len, num_kv_heads, skip_minus_one, block_table,
      block_table_rows, block_size):
    return None


def paged_decode_out(plan: DecodePlan, q, k, v, indptr, indices, seq_lens, *, page_size: int, scale: float,
                     workspace: torch.Tensor, o: torch.Tensor, lse: Optional[torch.Tensor] = None,
                     first_page_offset=None, q_extra=None, k_extra=None, num_pool_pages: int = -1,
                     request_row_stride: int = 0, window_len: int = 0, num_kv_heads: int = 1,
                     skip_minus_one: bool = False, block_table=None, block_table_rows=None,
                     block_size: int = 0) -> None:
    """The paged decode into caller-owned `o` (and optional fp32 `lse`): the op to capture.

    * q ``[S, Hkv * G, Dqk]`` and o ``[S, Hkv * G, Dv]`` are views with unit stride in the last
      dim (a slice of a packed QKV tensor, a column slice of a wider output); request
      ``r = b * Hkv + h`` owns query heads ``h * G .. h * G + G - 1`` of sequence b (GQA folding;
      ``num_kv_heads=1`` gives ``[R, G, D]``).
    * k, v (and k_extra, the second K stream: MLA's rope keys with q_extra) are pools of rows:
      the last dim is the row (stride 1) and the leading dims collapse into one row index with a
      uniform stride (a column slice of wider rows works; V may alias K's first columns). With
      ``num_kv_heads > 1`` a pool is ``[..., num_kv_heads, dim]``, e.g. an engine's paged
      ``[num_blocks, block_size, num_kv_heads, head_dim]`` cache, and each head reads its own
      column.
    * Page ids: with `indptr`, a CSR table (indices ``[pages]``); with ``indptr=None``, an index
      matrix indices ``[S, width]`` (shared by the KV heads) or ``[S, Hkv, width]``, e.g. vLLM /
      SGLang's ``[num_tokens, topk]`` slot ids, or a block table ``[S, max_blocks]`` at
      ``page_size = block_size``. ``skip_minus_one``: ``-1`` ids are padding, skipped and never
      read (o = 0, lse = -inf for a request with nothing else); other bad ids raise on the CPU
      and give NaN plus the error flag on CUDA. ``block_table [rows, max_blocks]`` (with
      `block_size`): ids are positions of each sequence, resolved to pool row
      ``block_table[row, p // block_size] * block_size + p % block_size`` inside the kernel; row
      b for sequence b, or ``block_table_rows[b]``; `num_pool_pages` then counts blocks.
    * seq_lens ``[R]`` or ``[S]`` (per sequence): visible tokens now, at most the plan's counts;
      None: the plan's counts. first_page_offset ``[R]``. All int32 on the tensors' device.
    * `workspace` comes from ``plan.new_workspace()`` (the plan is already uploaded into it).
      `num_pool_pages` defaults to the pools' rows // page_size. ``request_row_stride > 0``
      selects window mode (page ids relative to each request's window of `window_len`
      positions).

    In eager mode the launch skips torch's custom-op dispatcher (the same launch, without its
    per-call cost); under ``torch.compile`` it is the registered op ``sparsepage::paged_decode_out``.
    """
    if _eager(q, o):  # the binding itself, one Python call (each frame costs a fraction of a microsecond)
        _decode(plan.plan, q, k, v, o, indptr, indices, seq_lens, page_size, float(scale), first_page_offset, lse,
                q_extra, k_extra, workspace, num_pool_pages, request_row_stride, window_len, num_kv_heads,
                skip_minus_one, block_table, block_table_rows, block_size)
        return
    torch.ops.sparsepage.paged_decode_out(plan.plan_info, q, k, v, indptr, indices, seq_lens, first_page_offset,
                                          q_extra, k_extra, workspace, o, lse, page_size, float(scale), num_pool_pages,
                                          request_row_stride, window_len, num_kv_heads, skip_minus_one, block_table,
                                          block_table_rows, block_size)


@torch.library.custom_op("sparsepage::paged_decode", mutates_args=("workspace",))
def _paged_decode(plan_info: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  indptr: Optional[torch.Tensor], indices: torch.Tensor, seq_lens: Optional[torch.Tensor],
                  first_page_offset: Optional[torch.Tensor], q_extra: Optional[torch.Tensor],
                  k_extra: Optional[torch.Tensor], workspace: torch.Tensor, page_size: int, scale: float,
                  num_pool_pages: int, request_row_stride: int, window_len: int, num_kv_heads: int,
                  skip_minus_one: bool, block_table: Optional[torch.Tensor], block_table_rows: Optional[torch.Tensor],
                  block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    o = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    _paged_decode_out(plan_info, q, k, v, indptr, indices, seq_lens, first_page_offset, q_extra, k_extra, workspace, o,
                      lse, page_size, scale, num_pool_pages, request_row_stride, window_len, num_kv_heads,
                      skip_minus_one, block_table, block_table_rows, block_size)
    return o, lse


@_paged_decode.register_fake
def _(plan_info, q, k, v, indptr, indices, seq_lens, first_page_offset, q_extra, k_extra, workspace, page_size, scale,
      num_pool_pages, request_row_stride, window_len, num_kv_heads, skip_minus_one, block_table, block_table_rows,
      block_size):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[-1])),
            q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32))


def paged_decode(plan: DecodePlan, q, k, v, indptr, indices, seq_lens, *, page_size: int, scale: float,
                 workspace: torch.Tensor, first_page_offset=None, q_extra=None, k_extra=None,
                 num_pool_pages: int = -1, request_row_stride: int = 0, window_len: int = 0,
                 num_kv_heads: int = 1, skip_minus_one: bool = False, block_table=None, block_table_rows=None,
                 block_size: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Functional paged decode: returns ``(o, lse)`` (new tensors; o ``[S, Hkv * G, Dv]``, lse fp32
    ``[S, Hkv * G]``, natural log). Arguments as :func:`paged_decode_out`."""
    if _eager(q):
        o = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
        _decode(plan.plan, q, k, v, o, indptr, indices, seq_lens, page_size, float(scale), first_page_offset, lse,
                q_extra, k_extra, workspace, num_pool_pages, request_row_stride, window_len, num_kv_heads,
                skip_minus_one, block_table, block_table_rows, block_size)
        return o, lse
    return torch.ops.sparsepage.paged_decode(plan.plan_info, q, k, v, indptr, indices, seq_lens, first_page_offset,
                                             q_extra, k_extra, workspace, page_size, float(scale), num_pool_pages,
                                             request_row_stride, window_len, num_kv_heads, skip_minus_one,
                                             block_table, block_table_rows, block_size)


def merge_states(o: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges S partial attention states by their lse (natural log), on any device.

    o ``[S, ..., D]`` and fp32 lse ``[S, ...]`` hold S states over the same rows (e.g. the
    shared-prefix and the suffix launches of cascade attention); returns ``(o [..., D] in o's
    dtype, lse [...] fp32)``. An empty state (lse = -inf) weighs nothing; all empty gives
    o = 0, lse = -inf; a NaN state poisons its row. Plain torch math: traceable and capturable.
    """
    lse = lse.float()
    m = lse.amax(dim=0)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - safe.unsqueeze(0))  # exp(-inf) = 0 for empty states
    total = w.sum(dim=0)
    merged = (w.unsqueeze(-1) * o.float()).sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
    has = (total > 0) | torch.isnan(total)
    merged = torch.where(has.unsqueeze(-1), merged, torch.zeros_like(merged))
    out_lse = torch.where(has, safe + torch.log(total), torch.full_like(total, float("-inf")))
    return merged.to(o.dtype), out_lse


def merge_state(o_a, lse_a, o_b, lse_b) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges two states (o [..., D], lse [...]); see :func:`merge_states`."""
    return merge_states(torch.stack([o_a, o_b]), torch.stack([lse_a.float(), lse_b.float()]))


class MlaSparseDecoder:
    """DSA / MLA decode over an engine's ``[num_blocks, block_size, latent + rope]`` cache (latent
    512 then rope 64 in one row), from the engines' own index conventions, on CPU or CUDA.

    * ``decoder(q_latent, q_pe, kv_cache, slot_ids, ...)``: vLLM / SGLang's ``[num_tokens, topk]``
      int32 global slot ids ``block_id * block_size + offset``; ``-1`` is "no token here" and is
      skipped (never read); an optional int32 ``topk_length [num_tokens]`` limits each row.
    * ``decoder.from_positions(q_latent, q_pe, kv_cache, positions, block_table, ...)``: the
      indexer's request-local positions ``[num_tokens, topk]`` (``-1`` skipped) and the engine's
      block table ``[num_requests, max_blocks]``; the kernel resolves each position to its slot
      (``token_to_request [num_tokens]`` picks a token's table row; default: row t).

    Each token is one request at page_size 1; the cache and the index matrix are read in place.
    The plan and workspace are made once for ``(num_tokens, topk)`` at construction (the counts'
    bound: ``topk_length`` may change on the device between graph replays), so a call launches
    the fused kernel only and can be captured in a CUDA graph. q and o may be strided views
    (e.g. q_latent and q_pe as column slices of one ``[num_tokens, heads, 576]`` tensor).
    ``lse`` (fp32 ``[num_tokens, num_heads]``, natural log) is written when given.
    """

    def __init__(self, num_tokens: int, topk: int, num_heads: int, *, device, latent_dim: int = 512,
                 rope_dim: int = 64):
        if min(num_tokens, topk, num_heads, latent_dim, rope_dim) < 1:
            raise _core.Error(f"MlaSparseDecoder: num_tokens = {num_tokens}, topk = {topk}, num_heads = {num_heads}, "
                              f"latent_dim = {latent_dim} and rope_dim = {rope_dim} must be at least 1")
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
        self.plan = DecodePlan([topk] * num_tokens, group_size=num_heads, head_dim_qk=latent_dim,
                               head_dim_v=latent_dim, head_dim_extra=rope_dim, device=device)
        self.workspace = self.plan.new_workspace()

    def _columns(self, kv_cache):
        """The latent and rope column views of `kv_cache`, made once per cache (slicing costs
        microseconds a call); remade when the tensor, its storage, shape or strides change."""
        key = (id(kv_cache), kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride())
        if key != getattr(self, "_columns_key", None):
            self._columns_views = (kv_cache[..., :self.latent_dim], kv_cache[..., self.latent_dim:])
            self._columns_key = key
        return self._columns_views

    def _run(self, q_latent, q_pe, kv_cache, indices, *, scale, topk_length, o, lse, block_table=None,
             block_table_rows=None, block_size=0):
        if o is None:
            o = q_latent.new_empty((q_latent.shape[0], q_latent.shape[1], self.latent_dim))
        latent, rope = self._columns(kv_cache)
        if _eager(q_latent, o):  # the binding directly (see paged_decode_out)
            _decode(self.plan.plan, q_latent, latent, latent, o, None, indices, topk_length, 1, float(scale), None,
                    lse, q_pe, rope, self.workspace, -1, 0, 0, 1, True, block_table, block_table_rows, block_size)
            return o, lse
        paged_decode_out(self.plan, q_latent, latent, latent, None, indices, topk_length, page_size=1, scale=scale,
                         workspace=self.workspace, o=o, lse=lse, q_extra=q_pe, k_extra=rope, skip_minus_one=True,
                         block_table=block_table, block_table_rows=block_table_rows, block_size=block_size)
        return o, lse

    def __call__(self, q_latent, q_pe, kv_cache, slot_ids, *, scale: float, topk_length=None, o=None, lse=None):
        return self._run(q_latent, q_pe, kv_cache, slot_ids, scale=scale, topk_length=topk_length, o=o, lse=lse)

    def from_positions(self, q_latent, q_pe, kv_cache, positions, block_table, *, scale: float,
                       token_to_request=None, topk_length=None, o=None, lse=None):
        return self._run(q_latent, q_pe, kv_cache, positions, scale=scale, topk_length=topk_length, o=o, lse=lse,
                         block_table=block_table, block_table_rows=token_to_request,
                         block_size=kv_cache.shape[1])


class PagedKVDecoder:
    """Decode over an engine's paged K/V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (block sizes 16, 32, 64, ...) through its block tables, with GQA folding, on CPU or CUDA.

    ``decoder(q, k_cache, v_cache, block_tables, seq_lens, ...)``: q ``[num_seqs, num_qo_heads,
    head_dim]`` (may be a slice of a packed QKV tensor); block_tables int32 ``[num_seqs,
    max_blocks]`` are the page ids (page size = block size), read in place; seq_lens int32
    ``[num_seqs]`` on the device (the tokens each sequence attends now). Query head i reads KV head
    ``i // (num_qo_heads // num_kv_heads)``. The plan is made once for ``max_blocks * block_size``
    tokens per sequence, so seq_lens may change on the device between graph replays.
    """

    def __init__(self, num_seqs: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, *, max_blocks: int,
                 block_size: int, device, head_dim_v: Optional[int] = None):
        if min(num_seqs, num_qo_heads, num_kv_heads, head_dim, max_blocks, block_size) < 1:
            raise _core.Error(f"PagedKVDecoder: num_seqs = {num_seqs}, num_qo_heads = {num_qo_heads}, num_kv_heads = "
                              f"{num_kv_heads}, head_dim = {head_dim}, max_blocks = {max_blocks} and block_size = "
                              f"{block_size} must be at least 1")
        if num_qo_heads % num_kv_heads:
            raise _core.Error(f"PagedKVDecoder: num_qo_heads = {num_qo_heads} is not a multiple of "
                              f"num_kv_heads = {num_kv_heads}")
        self.num_kv_heads, self.block_size = num_kv_heads, block_size
        self.head_dim_v = head_dim_v or head_dim
        self.plan = DecodePlan([max_blocks * block_size] * (num_seqs * num_kv_heads),
                               group_size=num_qo_heads // num_kv_heads, head_dim_qk=head_dim,
                               head_dim_v=self.head_dim_v, device=device)
        self.workspace = self.plan.new_workspace()

    def __call__(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale: float, o=None, lse=None):
        if o is None:
            o = q.new_empty((q.shape[0], q.shape[1], self.head_dim_v))
        if _eager(q, o):  # the binding directly (see paged_decode_out); -1: every block of the pools
            _decode(self.plan.plan, q, k_cache, v_cache, o, None, block_tables, seq_lens, self.block_size, float(scale),
                    None, lse, None, None, self.workspace, -1, 0, 0, self.num_kv_heads, False, None, None, 0)
            return o, lse
        paged_decode_out(self.plan, q, k_cache, v_cache, None, block_tables, seq_lens, page_size=self.block_size,
                         scale=scale, workspace=self.workspace, o=o, lse=lse, num_kv_heads=self.num_kv_heads,
                         num_pool_pages=k_cache.shape[0])
        return o, lse
