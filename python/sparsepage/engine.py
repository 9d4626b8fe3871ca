"""Entry points shaped like an inference engine's own inputs.

vLLM and SGLang keep paged KV caches in their own layouts and hand over
indices in their own conventions. This module accepts those inputs and maps
them onto the library's page table without copying the cache:

* :func:`mla_decode_slots`: MLA decode over a ``[num_blocks, block_size, 576]``
  cache (latent 512 then rope 64 in one row) with the DSA index convention, a
  ``[num_tokens, topk]`` int32 matrix of global slot ids
  (``block_id * block_size + offset``) where ``-1`` means "no token here".
* :func:`mla_decode_positions`: the same with the indexer's request-local token
  positions and the engine's block table.
* :func:`paged_kv_decode`: decode over ``[num_blocks, block_size, num_kv_heads,
  head_dim]`` K and V caches addressed through block tables.

Each request of the page table is one (token, KV head) pair at
``page_size = 1``: the page ids are pool rows of the cache seen as a pool of
rows, so the cache is read in place. What the kernels cannot address yet
raises ``NotImplementedError`` naming what is missing (never a silent copy or
an approximate result): on CUDA the ``-1`` padding, per-token lengths on the
device and slot resolution inside the kernel wait for device-side live lengths
and per-stream strides in the library; block-granular addressing of the
4-D layout waits for per-head strides.

Arrays may be numpy arrays or torch tensors (CPU, or CUDA where stated);
outputs come back in the inputs' kind.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np

from . import _core

__all__ = ["mla_decode_slots", "mla_decode_positions", "paged_kv_decode", "cpu_plan_shape"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _is_cuda(x: Any) -> bool:
    return _is_torch(x) and x.device.type == "cuda"


def _host_int32(x: Any) -> np.ndarray:
    """A host int32 copy of an index array (numpy or torch CPU)."""
    if _is_torch(x):
        x = x.numpy()
    return np.ascontiguousarray(np.asarray(x, dtype=np.int32))


def _like(values: np.ndarray, ref: Any) -> Any:
    """`values` (host) in the kind and on the device of `ref`."""
    if _is_torch(ref):
        import torch

        return torch.from_numpy(values).to(ref.device)
    return values


def _empty_like_shape(ref: Any, shape: Sequence[int], float32: bool = False) -> Any:
    if _is_torch(ref):
        import torch

        return torch.empty(tuple(shape), dtype=torch.float32 if float32 else ref.dtype, device=ref.device)
    return np.empty(tuple(shape), dtype=np.float32 if float32 else ref.dtype)


def cpu_plan_shape(group_size: int, head_dim_v: int) -> "_core.PlanShape":
    """The plan shape for the CPU backend: one work item per core and a few."""
    return _core.PlanShape(group_size=group_size, head_dim_v=head_dim_v, num_sms=max(1, os.cpu_count() or 1))


def _compact_rows(slots: np.ndarray, topk_length: Optional[np.ndarray]):
    """Per row: the entries before topk_length[t] that are not -1, in order."""
    rows = []
    for t in range(slots.shape[0]):
        row = slots[t] if topk_length is None else slots[t, : int(topk_length[t])]
        rows.append(row[row >= 0] if (row < 0).any() else row)
    counts = np.array([len(r) for r in rows], dtype=np.int32)
    indices = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    return counts, indices


def _run_pages(q, k, v, o, counts: np.ndarray, indices: np.ndarray, scale: float, lse=None, q_extra=None,
               k_extra=None, page_size: int = 1):
    """Runs the paged decode over host-built page-table arrays (CPU backend)."""
    table = _core.build_page_table_structure(counts, page_size)
    plan = _core.make_decode_plan(counts, cpu_plan_shape(q.shape[1], o.shape[2]))
    _core.paged_decode(plan, q, k, v, o, _like(table.indptr, q), _like(indices, q), _like(table.seq_lens, q),
                       page_size=page_size, scale=scale, lse=lse, q_extra=q_extra, k_extra=k_extra)
    return o, lse


def mla_decode_slots(q_latent, q_pe, kv_cache, slot_ids, *, scale: float, topk_length=None, o=None, lse=None,
                     latent_dim: int = 512):
    """MLA decode over the engine's paged latent cache and its slot-id index matrix.

    Args:
        q_latent: ``[num_tokens, num_heads, latent_dim]`` absorbed queries (contiguous).
        q_pe: ``[num_tokens, num_heads, rope_dim]`` rope queries (contiguous).
        kv_cache: ``[num_blocks, block_size, latent_dim + rope_dim]``: latent, then rope, in one
            row (or any tensor whose leading dims collapse into rows of that width).
        slot_ids: int32 ``[num_tokens, topk]`` global slot ids ``block_id * block_size + offset``;
            ``-1`` means "no token here" and is skipped.
        scale: softmax scale of ``q . k`` (latent and rope parts alike).
        topk_length: optional int32 ``[num_tokens]``: only the first ``topk_length[t]`` entries of
            row t are read.
        o: optional output ``[num_tokens, num_heads, latent_dim]`` (allocated when None).
        lse: optional fp32 ``[num_tokens, num_heads]`` output, natural log; a token with no slot
            gets ``o = 0``, ``lse = -inf``.

    Returns ``(o, lse)``. CPU (numpy or torch CPU) today; CUDA raises NotImplementedError (the
    ``-1`` padding and per-token lengths must stay on the device, which needs device-side live
    lengths in the library's page table).
    """
    if _is_cuda(q_latent):
        raise NotImplementedError(
            "mla_decode_slots on CUDA: skipping -1 slots and per-token topk_length without reading them "
            "back needs device-side live lengths in the page table, which the library does not have yet; "
            "sparsepage.torch_ops.mla_decode_slots_full runs rows that hold topk valid slots each")
    width = kv_cache.shape[-1]
    rows = kv_cache.reshape(-1, width)
    counts, indices = _compact_rows(_host_int32(slot_ids),
                                    None if topk_length is None else _host_int32(topk_length))
    if o is None:
        o = _empty_like_shape(q_latent, (q_latent.shape[0], q_latent.shape[1], latent_dim))
    return _run_pages(q_latent, rows[:, :latent_dim], rows[:, :latent_dim], o, counts, indices, scale, lse=lse,
                      q_extra=q_pe, k_extra=rows[:, latent_dim:])


def mla_decode_positions(q_latent, q_pe, kv_cache, positions, block_table, token_to_request, *, scale: float,
                         topk_length=None, o=None, lse=None, latent_dim: int = 512):
    """MLA decode from the indexer's request-local token positions and the engine's block table.

    ``positions`` is int32 ``[num_tokens, topk]`` positions in each token's request (``-1``:
    none), ``block_table`` int32 ``[num_requests, max_blocks]`` and ``token_to_request`` int32
    ``[num_tokens]``. The slot of position p of token t is
    ``block_table[token_to_request[t], p // block_size] * block_size + p % block_size``.

    CPU: the slots are resolved on the host and :func:`mla_decode_slots` runs. CUDA raises
    NotImplementedError: resolving the slot inside the kernel (saving the engines' conversion
    launch) needs the block-table addressing mode the library does not have yet.
    """
    if _is_cuda(q_latent):
        raise NotImplementedError(
            "mla_decode_positions on CUDA: resolving request-local positions through the block table "
            "inside the kernel is not in the library yet")
    block_size = kv_cache.shape[1]
    pos = _host_int32(positions)
    table = _host_int32(block_table)
    req = _host_int32(token_to_request)
    safe = np.where(pos >= 0, pos, 0)
    blocks = table[req[:, None], safe // block_size]
    slots = np.where(pos >= 0, blocks * block_size + safe % block_size, -1).astype(np.int32)
    return mla_decode_slots(q_latent, q_pe, kv_cache, slots, scale=scale, topk_length=topk_length, o=o, lse=lse,
                            latent_dim=latent_dim)


def paged_kv_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float, o=None, lse=None):
    """Decode over ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V caches.

    Args:
        q: ``[batch, num_qo_heads, head_dim]`` (contiguous); query head i reads KV head
            ``i // (num_qo_heads // num_kv_heads)`` (GQA folding).
        k_cache, v_cache: the engine's paged pools (block sizes 16, 32, 64, ...).
        block_tables: int32 ``[batch, max_blocks]``.
        seq_lens: ``[batch]`` tokens of each sequence (host values).

    Each (sequence, KV head) is a request whose page ids are the rows
    ``(block * block_size + slot) * num_kv_heads + head`` of the cache seen as
    ``[num_blocks * block_size * num_kv_heads, head_dim]`` rows, at page_size 1: the cache
    is read in place. Returns ``(o, lse)``.

    CPU today. CUDA raises NotImplementedError: the expansion of block tables to rows runs on
    the host here, and block-granular pages of this layout need per-head strides in the kernel.
    """
    if _is_cuda(q):
        raise NotImplementedError(
            "paged_kv_decode on CUDA: block-granular pages of [num_blocks, block_size, num_kv_heads, head_dim] "
            "caches need per-head strides in the decode kernel, which the library does not have yet")
    batch, num_qo_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_qo_heads % num_kv_heads:
        raise _core.Error(f"paged_kv_decode: num_qo_heads = {num_qo_heads} is not a multiple of "
                          f"num_kv_heads = {num_kv_heads}")
    group = num_qo_heads // num_kv_heads
    lens = _host_int32(seq_lens)
    tables = _host_int32(block_tables)
    counts = np.repeat(lens, num_kv_heads).astype(np.int32)
    parts = []
    for b in range(batch):
        t = np.arange(int(lens[b]), dtype=np.int64)
        if len(t) and (t[-1] // block_size) >= tables.shape[1]:
            raise _core.Error(f"paged_kv_decode: seq_lens[{b}] = {int(lens[b])} needs more than the "
                              f"{tables.shape[1]} blocks of block_tables[{b}]")
        base = (tables[b, t // block_size].astype(np.int64) * block_size + t % block_size) * num_kv_heads
        for h in range(num_kv_heads):
            parts.append(base + h)
    indices = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
    q_folded = q.reshape(batch * num_kv_heads, group, head_dim)
    if o is None:
        o = _empty_like_shape(q, (batch, num_qo_heads, v_cache.shape[-1]))
    o_folded = o.reshape(batch * num_kv_heads, group, v_cache.shape[-1])
    lse_folded = None if lse is None else lse.reshape(batch * num_kv_heads, group)
    _run_pages(q_folded, k_cache.reshape(-1, k_cache.shape[-1]), v_cache.reshape(-1, v_cache.shape[-1]), o_folded,
               counts, indices, scale, lse=lse_folded)
    return o, lse
