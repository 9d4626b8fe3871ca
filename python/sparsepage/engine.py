"""Entry points shaped like an inference engine's own inputs.

vLLM and SGLang keep paged KV caches in their own layouts and hand over
indices in their own conventions. These functions take those inputs as they
are and run the fused decode over them, reading the cache and the index
matrices in place (no compaction, no gathered copy, no host round trip):

* :func:`mla_decode_slots`: MLA decode over a ``[num_blocks, block_size, 576]``
  cache (latent 512 then rope 64 in one row) with the DSA index convention, a
  ``[num_tokens, topk]`` int32 matrix of global slot ids
  (``block_id * block_size + offset``) where ``-1`` means "no token here" and
  is skipped, with an optional per-token ``topk_length``.
* :func:`mla_decode_positions`: the same from the indexer's request-local
  token positions and the engine's block table; the kernel resolves each
  position to its slot (the launch engines otherwise spend on converting).
* :func:`paged_kv_decode`: decode over ``[num_blocks, block_size,
  num_kv_heads, head_dim]`` K and V caches, the block tables being the page
  ids (page size = block size), with GQA folding.

Each call makes its plan (and, on CUDA, its workspace) for the shapes' bound;
for a serving loop and CUDA graphs keep them across steps with
:class:`sparsepage.torch_ops.MlaSparseDecoder` and
:class:`sparsepage.torch_ops.PagedKVDecoder`, which these functions use on CUDA.

Arrays may be numpy arrays or torch tensors (CPU or CUDA); outputs come back
in the inputs' kind. lse outputs are fp32 natural logarithms.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from . import _core

__all__ = ["mla_decode_slots", "mla_decode_positions", "paged_kv_decode", "cpu_plan_shape"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _is_cuda(x: Any) -> bool:
    return _is_torch(x) and x.device.type == "cuda"


def _empty_like_shape(ref: Any, shape: Sequence[int], float32: bool = False) -> Any:
    if _is_torch(ref):
        import torch

        return torch.empty(tuple(shape), dtype=torch.float32 if float32 else ref.dtype, device=ref.device)
    return np.empty(tuple(shape), dtype=np.float32 if float32 else ref.dtype)


def cpu_plan_shape(group_size: int, head_dim_v: int) -> "_core.PlanShape":
    """The plan shape for the CPU backend: one work item per core and a few."""
    return _core.PlanShape(group_size=group_size, head_dim_v=head_dim_v, num_sms=max(1, os.cpu_count() or 1))


def mla_decode_slots(q_latent, q_pe, kv_cache, slot_ids, *, scale: float, topk_length=None, o=None, lse=None,
                     latent_dim: int = 512):
    """MLA decode over the engine's paged latent cache and its slot-id index matrix.

    Args:
        q_latent: ``[num_tokens, num_heads, latent_dim]`` absorbed queries (a strided view is fine).
        q_pe: ``[num_tokens, num_heads, rope_dim]`` rope queries.
        kv_cache: ``[num_blocks, block_size, latent_dim + rope_dim]``: latent, then rope, in one
            row (or any tensor whose leading dims collapse into rows of that width).
        slot_ids: int32 ``[num_tokens, topk]`` global slot ids ``block_id * block_size + offset``;
            ``-1`` means "no token here" and is skipped (never read). Any other id outside the
            cache raises on the CPU and gives that token NaN plus the error flag on CUDA.
        scale: softmax scale of ``q . k`` (latent and rope parts alike).
        topk_length: optional int32 ``[num_tokens]`` on the inputs' device: only the first
            ``topk_length[t]`` entries of row t are read.
        o: optional output ``[num_tokens, num_heads, latent_dim]`` (allocated when None).
        lse: optional fp32 ``[num_tokens, num_heads]`` output, natural log; a token with no slot
            gets ``o = 0``, ``lse = -inf``.

    Returns ``(o, lse)``.
    """
    return _mla_decode(q_latent, q_pe, kv_cache, slot_ids, scale=scale, topk_length=topk_length, o=o, lse=lse,
                       latent_dim=latent_dim)


def mla_decode_positions(q_latent, q_pe, kv_cache, positions, block_table, token_to_request=None, *, scale: float,
                         topk_length=None, o=None, lse=None, latent_dim: int = 512):
    """MLA decode from the indexer's request-local token positions and the engine's block table.

    ``positions`` is int32 ``[num_tokens, topk]`` positions in each token's request (``-1``:
    none, skipped), ``block_table`` int32 ``[num_requests, max_blocks]`` and ``token_to_request``
    an optional int32 ``[num_tokens]`` (None: token t reads row t). The kernel reads position p of
    token t from slot ``block_table[token_to_request[t], p // block_size] * block_size +
    p % block_size``; a position past the table's width or a block id outside the cache raises
    on the CPU and gives that token NaN plus the error flag on CUDA. Other arguments as
    :func:`mla_decode_slots`.
    """
    return _mla_decode(q_latent, q_pe, kv_cache, positions, scale=scale, topk_length=topk_length, o=o, lse=lse,
                       latent_dim=latent_dim, block_table=block_table, token_to_request=token_to_request)


def _mla_decode(q_latent, q_pe, kv_cache, ids, *, scale, topk_length, o, lse, latent_dim, block_table=None,
                token_to_request=None):
    """Both MLA entries: ``ids`` are slot ids, or (``block_table`` given) positions resolved through it."""
    block_size = 0 if block_table is None else kv_cache.shape[1]
    if _is_cuda(q_latent):
        from . import torch_ops

        dec = torch_ops.MlaSparseDecoder(q_latent.shape[0], ids.shape[-1], q_latent.shape[1],
                                         device=q_latent.device, latent_dim=latent_dim,
                                         rope_dim=kv_cache.shape[-1] - latent_dim)
        if block_table is None:
            return dec(q_latent, q_pe, kv_cache, ids, scale=scale, topk_length=topk_length, o=o, lse=lse)
        return dec.from_positions(q_latent, q_pe, kv_cache, ids, block_table, scale=scale,
                                  token_to_request=token_to_request, topk_length=topk_length, o=o, lse=lse)
    if o is None:
        o = _empty_like_shape(q_latent, (q_latent.shape[0], q_latent.shape[1], latent_dim))
    plan = _core.make_decode_plan([ids.shape[-1]] * q_latent.shape[0], cpu_plan_shape(q_latent.shape[1], latent_dim))
    latent = kv_cache[..., :latent_dim]
    _core._paged_decode(plan, q_latent, latent, latent, o, None, ids, topk_length, page_size=1, scale=scale,
                        lse=lse, q_extra=q_pe, k_extra=kv_cache[..., latent_dim:], skip_minus_one=True,
                        block_table=block_table, block_table_rows=token_to_request, block_size=block_size)
    return o, lse


def paged_kv_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float, o=None, lse=None):
    """Decode over ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V caches.

    Args:
        q: ``[batch, num_qo_heads, head_dim]`` (a slice of a packed QKV tensor is fine); query
            head i reads KV head ``i // (num_qo_heads // num_kv_heads)`` (GQA folding).
        k_cache, v_cache: the engine's paged pools (block sizes 16, 32, 64, ...).
        block_tables: int32 ``[batch, max_blocks]``: the page ids, read in place.
        seq_lens: int32 ``[batch]`` on the inputs' device: tokens each sequence attends.

    Returns ``(o [batch, num_qo_heads, head_dim_v], lse)``. Blocks past a sequence's length are
    never read.
    """
    batch, num_qo_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_kv_heads < 1 or block_size < 1:
        raise _core.Error(f"paged_kv_decode: k_cache {tuple(k_cache.shape)} must have at least one KV head and blocks "
                          "of at least one row [num_blocks, block_size, num_kv_heads, head_dim]")
    if num_qo_heads % num_kv_heads:
        raise _core.Error(f"paged_kv_decode: num_qo_heads = {num_qo_heads} is not a multiple of "
                          f"num_kv_heads = {num_kv_heads}")
    if _is_cuda(q):
        from . import torch_ops

        dec = torch_ops.PagedKVDecoder(batch, num_qo_heads, num_kv_heads, head_dim,
                                       max_blocks=block_tables.shape[1], block_size=block_size, device=q.device,
                                       head_dim_v=v_cache.shape[-1])
        return dec(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, o=o, lse=lse)
    if o is None:
        o = _empty_like_shape(q, (batch, num_qo_heads, v_cache.shape[-1]))
    counts = [block_tables.shape[1] * block_size] * (batch * num_kv_heads)
    plan = _core.make_decode_plan(counts, cpu_plan_shape(num_qo_heads // num_kv_heads, v_cache.shape[-1]))
    _core._paged_decode(plan, q, k_cache, v_cache, o, None, block_tables, seq_lens, page_size=block_size, scale=scale,
                       lse=lse, num_kv_heads=num_kv_heads, num_pool_pages=num_blocks)
    return o, lse
