"""FlashMLA's sparse decode and sparse prefill interfaces, run by sparsepage's kernels.

The sparse prefill is :func:`flash_mla_sparse_fwd` (its docstring says where it differs);
the rest of this text is about the decode.

A FlashMLA user switches with one import::

    # from flash_mla import get_mla_metadata, flash_mla_with_kvcache
    from sparsepage.flash_mla_compat import get_mla_metadata, flash_mla_with_kvcache

    sched_meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, k_cache, None, None, 512, sched_meta, softmax_scale=scale,
                                      is_fp8_kvcache=True, indices=indices, attn_sink=sink,
                                      extra_k_cache=extra, extra_indices_in_kvcache=extra_indices,
                                      topk_length=lengths, extra_topk_length=extra_lengths)

Only the sparse FP8 decode is provided (``indices`` given); a dense call raises
``NotImplementedError``. Arguments keep FlashMLA's names, shapes and meaning:

``q`` ``[b, s_q, h_q, d_qk]``
    The absorbed queries of ``b`` sequences, ``s_q`` query tokens each (``s_q > 1``
    for multi-token prediction: every token has its own row of ``indices``; there is no
    causal mask among them, the ids decide what each token sees). ``d_qk`` picks the cache
    format: 576 for DeepSeek-V3.2's rows, 512 for MODEL1's. bf16 on CUDA; the CPU backend
    (torch CPU tensors or numpy arrays) also takes float16 and float32, and returns ``out``
    in q's dtype.

``k_cache`` ``[num_blocks, page_block_size, 1, bytes_per_token]`` (the head dim may be left out)
    The FP8 pool, as its bytes: a uint8, int8 or float8_e4m3fn tensor.

    * V3.2 (``d_qk`` 576), 656 bytes a token: bytes 0-511 are 512 e4m3 values, bytes
      512-527 four fp32 scales (scale ``i`` multiplies values ``128 i .. 128 i + 127``),
      bytes 528-655 64 bf16 rope values. A token's key is ``[e4m3 x scale (512) | rope
      (64)]`` (576 wide); its value is the first 512 of those. A block's tokens are
      ``stride(1)`` bytes apart (at least 656).
    * MODEL1 (``d_qk`` 512): the 584 bytes of a token are not one row. In a block starting
      at byte ``B``, token ``j`` keeps 448 e4m3 values at ``B + 576 j`` followed by its 64
      bf16 rope values, and its scales at ``B + 576 * page_block_size + 8 j``: byte ``i <
      7`` scales values ``64 i .. 64 i + 63`` by ``2 ** (byte - 127)`` (e8m0; 255 is NaN),
      byte 7 is unused. Key and value are both the 512-wide ``[e4m3 x scale (448) | rope
      (64)]``. ``stride(0)`` may pad blocks (FlashMLA's quantizer rounds them up to a
      multiple of 576 bytes).

``block_table``, ``cache_seqlens``
    Not used by the sparse decode (the ids address the pool directly); accepted and ignored.

``head_dim_v``
    Must be 512.

``tile_scheduler_metadata``
    The :class:`FlashMLASchedMeta` that :func:`get_mla_metadata` returns. It carries the
    plan as data: the first call with it makes sparsepage's split-KV plan for the shapes
    (``b, s_q, h_q, topk, extra_topk`` and the device), allocates the workspace and, on
    CUDA, uploads the plan (this synchronizes: make the first call before capturing a CUDA
    graph). Later calls must keep those shapes, the block sizes, ``causal`` and
    ``is_fp8_kvcache`` (checked, as FlashMLA checks them); the values in ``indices``,
    ``topk_length`` and ``extra_topk_length`` may change from call to call and between
    graph replays, since they are read where the kernels run. A call then allocates only
    ``out`` and ``lse`` (through torch, so a captured graph works) and reads nothing back.
    Calls sharing one object share its workspace: use one object per stream that runs
    concurrently.

``num_splits``
    Must be None.

``softmax_scale``
    Multiplies every ``q . k``; default ``d_qk ** -0.5``.

``causal``, ``is_fp8_kvcache``
    Must be False and True: the sparse decode reads FP8 caches, and its ids decide visibility.

``indices`` ``[b, s_q, topk]`` int32
    Slot ids ``block * page_block_size + offset``. Entry ``i`` of row ``(b, t)`` is attended
    when ``i < topk_length[b]`` (every entry without ``topk_length``) and it is not ``-1``.
    ``-1`` means no token: its slot is never read and adds nothing. Any other id outside
    ``[0, num_blocks * page_block_size)`` is an error (FlashMLA leaves it undefined): the
    CPU backend raises, naming it; on CUDA that query's ``out`` and ``lse`` become NaN and a
    flag is set, which :meth:`FlashMLASchedMeta.check_errors` reports. An id listed twice
    counts twice. Ids past ``topk_length`` are never read, whatever they hold.

``topk_length`` ``[b]`` int32 or None
    Per sequence (all of its ``s_q`` tokens), how many leading ids are read; each in
    ``[0, topk]`` (the CPU raises otherwise; CUDA reads a larger value as ``topk``).

``attn_sink`` ``[h_q]`` float32 or None
    Per query head, one more logit in the softmax that carries no value:
    ``out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink))``, i.e. the sink-free output
    times ``exp(lse) / (exp(lse) + exp(sink))``. ``-inf`` changes nothing, ``+inf`` gives
    ``out = 0``. The returned ``lse`` does not include it.

``extra_k_cache``, ``extra_indices_in_kvcache`` ``[b, s_q, extra_topk]``, ``extra_topk_length`` ``[b]``
    A second pool in the same format (its own block count and block size) with its own ids
    and lengths, under the same rules. Its tokens join the same softmax as the first
    cache's: the result is that of one pool holding both sets of tokens.

Returns ``(out, lse)``
    ``out`` ``[b, s_q, h_q, 512]`` in q's dtype. ``lse`` ``[b, h_q, s_q]`` float32, a
    transposed view of ``[b, s_q, h_q]`` storage as FlashMLA returns it: the natural log of
    ``sum_j exp(s_j)`` over the scaled scores of both caches' attended tokens, without the
    sink; ``+inf`` for a query that attends nothing, whose ``out`` is 0.

How it runs: sparsepage's fused FP8 MLA decode (each (sequence, token) one request of
``h_q`` heads, the ids read in place as slot ids, ``-1`` skipped). With an extra cache
each cache's tokens are split-KV partials and one merge combines every partial of a query
by lse and applies the sink; without one the decode runs on its own plan (a query it does
not split writes its output directly) and a last pass gives empty queries their ``+inf``
and applies the sink (``sparsepage/mla_sparse.h``).

Where it differs from FlashMLA:

* MODEL1 caches run on the CPU backend only; on CUDA they raise, naming MODEL1.
* On CUDA a V3.2 cache's blocks must follow each other without gaps
  (``stride(0) == page_block_size * stride(1)``, ``stride(1)`` a multiple of 16); the CPU
  backend takes any block stride.
* Any ``h_q`` and any ``topk`` run (FlashMLA: 64 or 128 heads), and V3.2 caches take
  ``topk_length`` and an extra cache too (FlashMLA on Hopper takes them with MODEL1 only).
* An out-of-range id is flagged or raised instead of undefined.
* A V3.2 value is dequantized as e4m3 times its fp32 scale, rounded once to bf16 on CUDA
  (kept in fp32 on the CPU); FlashMLA rounds the scale to bf16 first. The two agree
  exactly for power-of-two scales, which FlashMLA's own quantizer writes, and within bf16
  rounding otherwise.
* The function is plain Python around one binding call, not a torch custom op:
  ``torch.compile`` breaks its graph around it; CUDA graph capture works.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional, Tuple

import numpy as np

from . import _core

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]

_HEAD_DIM_V = 512


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _fail(message: str):
    raise _core.Error(f"flash_mla_with_kvcache: {message}")


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The scheduling metadata of :func:`flash_mla_with_kvcache`: the shapes of its first
    call, sparsepage's plan for them and the workspace, made on that call.

    ``tile_scheduler_metadata`` and ``num_splits`` exist for code that reads FlashMLA's
    fields; they stay None (sparsepage's plan is ``plan``).
    """

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]
        d_qk: int = 0
        device: str = "cpu"

    have_initialized: bool = False
    config: Optional[Config] = None
    plan: Any = None
    workspace: Any = None
    tile_scheduler_metadata: Any = None
    num_splits: Any = None

    def check_errors(self) -> None:
        """Raises :class:`sparsepage.Error` when a CUDA call since the last check met an id
        outside its cache (those queries' outputs are NaN), and clears the flag. Synchronizes;
        the CPU backend raises at the call instead, so this never raises there."""
        if self.plan is None:
            return
        stream = _torch_stream(self.workspace) if _is_torch(self.workspace) else 0
        if _core.read_mla_sparse_error_flag(self.plan, self.workspace, stream):
            raise _core.Error("flash_mla_with_kvcache: an id in indices or extra_indices_in_kvcache lay outside its "
                              "cache; the outputs of the queries that held it are NaN")


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """An empty :class:`FlashMLASchedMeta` (filled by the first :func:`flash_mla_with_kvcache`
    call that gets it) and None, as FlashMLA returns them. The arguments of FlashMLA's older
    interface are accepted and ignored."""
    del args, kwargs
    return FlashMLASchedMeta(), None


def _torch_stream(t) -> int:
    import torch

    if not t.is_cuda:
        return 0
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


def _as_bytes(cache, name: str):
    """The FP8 pool as an 8-bit integer tensor over the same memory (no copy)."""
    if cache is None:
        return None
    if _is_torch(cache):
        import torch

        if cache.dtype in (torch.uint8, torch.int8):
            return cache
        if cache.element_size() == 1:  # float8_e4m3fn and friends: DLPack may not name them
            return cache.view(torch.uint8)
        _fail(f"{name} has dtype {cache.dtype}; an FP8 cache is passed as its bytes (uint8, int8 or float8_e4m3fn)")
    if cache.dtype.itemsize != 1:
        _fail(f"{name} has dtype {cache.dtype}; an FP8 cache is passed as its bytes (uint8 or int8)")
    return cache


def _foldable(q) -> bool:
    """Whether q's tokens are heads apart (each token is decoded as one request), with a unit
    stride in the last dim."""
    strides = q.stride() if _is_torch(q) else tuple(s // q.itemsize for s in q.strides)
    b, s_q, h_q, d = q.shape
    return (d <= 1 or strides[3] == 1) and (s_q <= 1 or strides[1] == h_q * strides[2])


def _config(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache, extra_indices):
    device = str(q.device) if _is_torch(q) else "cpu"
    return FlashMLASchedMeta.Config(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2] if k_cache.ndim == 4 else 1,
        causal, is_fp8_kvcache, indices.shape[-1] if indices is not None else None,
        extra_k_cache.shape[1] if extra_k_cache is not None else None,
        extra_indices.shape[-1] if extra_indices is not None else None, q.shape[-1], device)


def _initialize(meta: FlashMLASchedMeta, config, q) -> None:
    torch_q = _is_torch(q)
    on_cuda = torch_q and q.is_cuda
    if on_cuda:
        import torch

        if torch.cuda.is_current_stream_capturing():
            _fail("the first call with a new tile_scheduler_metadata plans and uploads (it synchronizes), so it "
                  "cannot run under CUDA graph capture: make one call before capturing")
        with torch.cuda.device(q.device):
            plan = _core.make_mla_sparse_plan(config.b, config.s_q, config.h_q, config.topk, config.extra_topk or 0,
                                              _core.Device.cuda)
            workspace = torch.empty(max(1, plan.workspace_bytes), dtype=torch.uint8, device=q.device)
            _core.upload_mla_sparse_plan(plan, workspace, _torch_stream(workspace))
    else:
        plan = _core.make_mla_sparse_plan(config.b, config.s_q, config.h_q, config.topk, config.extra_topk or 0,
                                          _core.Device.cpu)
        if torch_q:
            import torch

            workspace = torch.empty(max(1, plan.workspace_bytes), dtype=torch.uint8)
        else:
            workspace = np.empty(max(1, plan.workspace_bytes), dtype=np.uint8)
    meta.plan, meta.workspace, meta.config, meta.have_initialized = plan, workspace, config, True


_CONFIG_FIELDS = ("b", "s_q", "h_q", "page_block_size", "h_k", "causal", "is_fp8_kvcache", "topk",
                  "extra_page_block_size", "extra_topk", "d_qk", "device")


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int,
                           tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices=None, attn_sink=None, extra_k_cache=None,
                           extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
    """FlashMLA's ``flash_mla_with_kvcache`` for its sparse FP8 decode; the module docstring
    states every argument's meaning. Returns ``(out [b, s_q, h_q, 512], lse [b, h_q, s_q])``."""
    del block_table, cache_seqlens  # the sparse decode addresses the pool through its ids
    meta = tile_scheduler_metadata
    if not isinstance(meta, FlashMLASchedMeta):
        _fail("tile_scheduler_metadata must come from sparsepage.flash_mla_compat.get_mla_metadata(), got "
              f"{type(meta).__name__}")
    if num_splits is not None:
        _fail("num_splits must be None")
    if indices is None:
        raise NotImplementedError("sparsepage.flash_mla_compat provides FlashMLA's sparse FP8 decode only (indices "
                                  "given); the dense decode (block_table, cache_seqlens) is not implemented")
    if causal:
        _fail("causal must be False when indices are given (the sparse decode's ids decide what each token sees)")
    if not is_fp8_kvcache:
        _fail("is_fp8_kvcache must be True: the sparse decode reads FP8 caches")
    if head_dim_v != _HEAD_DIM_V:
        _fail(f"head_dim_v = {head_dim_v}; the sparse decode's values are 512 wide")
    if q.ndim != 4:
        _fail(f"q must be [batch, seq_len_q, num_heads_q, head_dim], got shape {tuple(q.shape)}")
    if extra_k_cache is None and (extra_indices_in_kvcache is not None or extra_topk_length is not None):
        _fail("extra_indices_in_kvcache and extra_topk_length need an extra_k_cache")
    if extra_k_cache is not None and extra_indices_in_kvcache is None:
        _fail("extra_k_cache needs extra_indices_in_kvcache")
    if k_cache.ndim not in (3, 4):
        _fail(f"k_cache must be [num_blocks, page_block_size, 1, bytes_per_token], got shape {tuple(k_cache.shape)}")

    config = _config(q, k_cache, causal, is_fp8_kvcache, indices, extra_k_cache, extra_indices_in_kvcache)
    if not meta.have_initialized:
        _initialize(meta, config, q)
    elif config != meta.config:
        for field in _CONFIG_FIELDS:
            if getattr(config, field) != getattr(meta.config, field):
                _fail(f"{field} = {getattr(config, field)!r} but tile_scheduler_metadata was made for "
                      f"{getattr(meta.config, field)!r}; use one metadata object per set of shapes")

    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    b, s_q, h_q, _ = q.shape
    if _is_torch(q):
        import torch

        if not _foldable(q):
            q = q.contiguous()
        out = torch.empty((b, s_q, h_q, _HEAD_DIM_V), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, s_q, h_q), dtype=torch.float32, device=q.device)
        stream = _torch_stream(q)
    else:
        if not _foldable(q):
            q = np.ascontiguousarray(q)
        out = np.empty((b, s_q, h_q, _HEAD_DIM_V), dtype=q.dtype)
        lse = np.empty((b, s_q, h_q), dtype=np.float32)
        stream = 0
    _core.mla_sparse_decode(meta.plan, q, _as_bytes(k_cache, "k_cache"), indices, topk_length, attn_sink,
                            _as_bytes(extra_k_cache, "extra_k_cache"), extra_indices_in_kvcache, extra_topk_length,
                            out, lse, meta.workspace, scale, stream, True)
    return out, (lse.transpose(1, 2) if _is_torch(lse) else np.swapaxes(lse, 1, 2))


# One MlaSparsePrefill per (device, stream) on CUDA, or per thread on the CPU (held by the
# thread, so it goes when the thread does): its plan and workspace for the last shape, never
# shared by calls that may run at once.
_PREFILLS: dict = {}
_CPU_PREFILL = threading.local()


def _prefill_for(key):
    if key is None:
        prefill = getattr(_CPU_PREFILL, "prefill", None)
        if prefill is None:
            prefill = _CPU_PREFILL.prefill = _core.MlaSparsePrefill(_core.Device.cpu)
        return prefill
    prefill = _PREFILLS.get(key)
    if prefill is None:
        prefill = _PREFILLS[key] = _core.MlaSparsePrefill(_core.Device.cuda)
    return prefill


def flash_mla_sparse_fwd(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None):
    """FlashMLA's sparse prefill (``flash_mla_sparse_fwd``), run by sparsepage's MLA kernel.

    ``q`` ``[s_q, h_q, 576]``, ``kv`` ``[s_kv, 1, 576]`` (bf16 on CUDA; the CPU backend also
    takes float16 and float32, q and kv alike), ``indices`` ``[s_q, 1, topk]`` int32: token ``t``
    attends the rows ``indices[t, 0, :topk_length[t]]`` (all ``topk`` without ``topk_length``
    ``[s_q]``); an id that is negative or ``>= s_kv`` is skipped, as in FlashMLA, and an id
    listed twice counts twice. There is no causal limit: the ids decide. ``sm_scale``
    multiplies every ``q . k``; ``d_v`` must be 512 (V is a row's first 512 values).
    ``attn_sink`` ``[h_q]`` float32 scales each head's output by ``exp(lse) / (exp(lse) +
    exp(sink))`` (``-inf``: no effect; ``+inf``: out 0) and leaves lse and max_logits alone.

    Returns ``(out, max_logits, lse)``: ``out`` ``[s_q, h_q, 512]`` in q's dtype; ``lse``
    ``[s_q, h_q]`` float32, the natural log of ``sum_j exp(s_j)`` over the scaled scores
    (``+inf`` for a token that attends nothing, whose out is 0); ``max_logits`` ``[s_q, h_q]``
    float32, ``max_j s_j`` (``-inf`` then).

    Where it differs from FlashMLA:

    * On CUDA ``max_logits`` is None: the fused kernel keeps a lazy running maximum (within
      2^8 of the true one), and an exact one needs a pass of its own. The CPU backend
      returns it.
    * Any ``topk`` runs, and any ``h_q`` on the CPU (CUDA: multiples of 64, as the MLA
      kernel's head tiles; FlashMLA: 64 or 128); ``topk_length`` entries are clamped to
      ``[0, topk]``.
    * The ids are checked and copied once per call (ids out of range become -1), and the
      object that plans is kept per device and stream (on the CPU, per thread) and
      re-plans when a shape changes, which
      allocates and, on CUDA, synchronizes: the call is not captured in a CUDA graph. To
      capture, hold a :class:`sparsepage.MlaSparsePrefill` and call
      ``sparsepage._core.mla_sparse_prefill`` with ids already in range.
    * It is plain Python around one binding call, not a torch custom op.
    """
    if d_v != _HEAD_DIM_V:
        raise _core.Error(f"flash_mla_sparse_fwd: d_v = {d_v}; the MLA rows' values are 512 wide")
    if q.ndim != 3 or kv.ndim != 3 or indices.ndim != 3:
        raise _core.Error("flash_mla_sparse_fwd: q must be [s_q, h_q, 576], kv [s_kv, 1, 576] and indices "
                          f"[s_q, 1, topk]; got {tuple(q.shape)}, {tuple(kv.shape)} and {tuple(indices.shape)}")
    s_q, h_q, s_kv, topk = q.shape[0], q.shape[1], kv.shape[0], indices.shape[-1]
    if _is_torch(q):
        import torch

        if indices.dtype != torch.int32:
            raise _core.Error(f"flash_mla_sparse_fwd: indices has dtype {indices.dtype}, not int32")
        ids = torch.where((indices >= 0) & (indices < s_kv), indices, torch.full_like(indices, -1))
        lengths = None if topk_length is None else topk_length.clamp(0, topk).to(torch.int32)
        out = torch.empty((s_q, h_q, _HEAD_DIM_V), dtype=q.dtype, device=q.device)
        lse = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
        on_cuda = q.is_cuda
        max_logits = None if on_cuda else torch.empty((s_q, h_q), dtype=torch.float32)
        # One object per (device, stream): calls on different streams must not share a workspace.
        key = (q.get_device(), _torch_stream(q)) if on_cuda else None
    else:
        indices = np.asarray(indices)
        if indices.dtype != np.int32:
            raise _core.Error(f"flash_mla_sparse_fwd: indices has dtype {indices.dtype}, not int32")
        ids = np.where((indices >= 0) & (indices < s_kv), indices, -1).astype(np.int32)
        lengths = None if topk_length is None else np.clip(np.asarray(topk_length), 0, topk).astype(np.int32)
        out = np.empty((s_q, h_q, _HEAD_DIM_V), dtype=q.dtype)
        lse = np.empty((s_q, h_q), dtype=np.float32)
        max_logits = np.empty((s_q, h_q), dtype=np.float32)
        key = None
    _core.mla_sparse_prefill(_prefill_for(key), q, kv, ids, float(sm_scale), attn_sink, lengths, out, lse, max_logits)
    return out, max_logits, lse
