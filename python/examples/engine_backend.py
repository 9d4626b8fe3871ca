"""A minimal vLLM/SGLang-style attention backend over sparsepage (docs/ENGINES.md).

An engine's attention backend has two halves: a metadata builder that runs once
per scheduler step on the host (it knows the batch, the block tables and the
sequence lengths), and a forward that runs per layer on the step's tensors
(inside a CUDA graph when the engine captures decode). This sketch shows both
for the two shapes sparsepage serves:

* ``DsaMlaBackend``: DeepSeek-V3.2-style MLA decode. The cache is the engine's
  ``[num_blocks, block_size, 576]`` latent+rope pool; the indexer hands over a
  ``[num_tokens, topk]`` matrix of global slot ids, ``-1`` padded.
* ``PagedGqaBackend``: a GQA decode over ``[num_blocks, block_size,
  num_kv_heads, head_dim]`` K and V pools and block tables.

Inputs are numpy arrays or torch tensors. numpy runs through
:mod:`sparsepage.engine`; torch tensors (CPU or CUDA) through the torch ops,
with the plan and workspace made once in the metadata builder
(:class:`sparsepage.torch_ops.MlaSparseDecoder`,
:class:`sparsepage.torch_ops.PagedKVDecoder`), so the forward launches the
fused kernel only and a decode step can be captured in a CUDA graph. The
``-1`` padding and per-token ``topk_length`` are read on the device.

tests/python/test_engine_backend.py runs this file's ``demo()`` on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

import sparsepage as sp


def write_kv(cache: Any, slot_mapping: Any, rows: Any) -> None:
    """The engine's cache write: row `slot_mapping[i]` of the pool gets `rows[i]`.

    A cache ``[num_blocks, block_size, ...]`` seen as ``[num_blocks * block_size, ...]`` rows:
    slot ``block_id * block_size + offset`` is that token's row (vLLM's slot_mapping).
    """
    flat = cache.reshape(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    flat[slot_mapping] = rows


@dataclass
class DsaMetadata:
    """Per-step metadata: built once on the host, read by every layer's forward."""
    slot_ids: Any                   # int32 [num_tokens, topk], -1 padded
    topk_length: Optional[Any]      # int32 [num_tokens] or None
    decoder: Any = None             # torch_ops.MlaSparseDecoder for torch tensors (plan + workspace, made once)


class DsaMlaBackend:
    """MLA decode over the top-k tokens an indexer picked."""

    def __init__(self, num_heads: int, scale: float, latent_dim: int = 512, rope_dim: int = 64):
        self.num_heads, self.scale = num_heads, scale
        self.latent_dim, self.rope_dim = latent_dim, rope_dim

    def build_metadata(self, slot_ids, topk_length=None) -> DsaMetadata:
        meta = DsaMetadata(slot_ids, topk_length)
        if type(slot_ids).__module__.startswith("torch"):
            from sparsepage import torch_ops

            # The plan depends on (num_tokens, topk) only: -1 entries and topk_length are read
            # on the device, so a captured decode graph reuses it while they change.
            meta.decoder = torch_ops.MlaSparseDecoder(slot_ids.shape[0], slot_ids.shape[1], self.num_heads,
                                                      device=slot_ids.device, latent_dim=self.latent_dim,
                                                      rope_dim=self.rope_dim)
        return meta

    def forward(self, q_latent, q_pe, kv_cache, meta: DsaMetadata, lse=None):
        """q_latent [T, H, 512], q_pe [T, H, 64], kv_cache [num_blocks, block_size, 576] -> o [T, H, 512]."""
        if meta.decoder is not None:
            o, _ = meta.decoder(q_latent, q_pe, kv_cache, meta.slot_ids, scale=self.scale,
                                topk_length=meta.topk_length, lse=lse)
            return o
        o, _ = sp.engine.mla_decode_slots(q_latent, q_pe, kv_cache, meta.slot_ids, scale=self.scale,
                                          topk_length=meta.topk_length, lse=lse, latent_dim=self.latent_dim)
        return o


class PagedGqaBackend:
    """Decode over the engine's paged K/V pools and block tables (GQA folded per KV head)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def build_metadata(self, block_tables, block_size: int):
        """torch: a PagedKVDecoder planned for (batch, max_blocks * block_size), made once."""
        if not type(block_tables).__module__.startswith("torch"):
            return None
        from sparsepage import torch_ops

        return torch_ops.PagedKVDecoder(block_tables.shape[0], self.num_heads, self.num_kv_heads, self.head_dim,
                                        max_blocks=block_tables.shape[1], block_size=block_size,
                                        device=block_tables.device)

    def forward(self, q, k_cache, v_cache, block_tables, seq_lens, lse=None, decoder=None):
        """q [B, Hq, D] (a slice of a packed QKV tensor is fine); caches [num_blocks, block_size, Hkv, D];
        block_tables int32 [B, max_blocks]; seq_lens int32 [B] on q's device."""
        if decoder is not None:
            return decoder(q, k_cache, v_cache, block_tables, seq_lens, scale=self.scale, lse=lse)[0]
        o, _ = sp.engine.paged_kv_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=self.scale, lse=lse)
        return o


def demo(seed: int = 0):
    """One decode step of each backend on the CPU; returns the inputs and outputs for checking."""
    rng = np.random.default_rng(seed)
    num_blocks, block_size, T, H, topk = 16, 64, 4, 8, 32
    kv_cache = np.zeros((num_blocks, block_size, 576), np.float32)
    # The engine writes this step's (and earlier steps') latent rows through its slot mapping.
    slot_mapping = rng.permutation(num_blocks * block_size)[:600]
    write_kv(kv_cache, slot_mapping, rng.standard_normal((600, 576)).astype(np.float32))
    # The indexer's output: slot ids among the written rows, -1 padded; one token has fewer.
    slot_ids = rng.choice(slot_mapping, size=(T, topk)).astype(np.int32)
    slot_ids[1, 20:] = -1
    q_latent = rng.standard_normal((T, H, 512)).astype(np.float32)
    q_pe = rng.standard_normal((T, H, 64)).astype(np.float32)
    mla = DsaMlaBackend(H, scale=576 ** -0.5)
    meta = mla.build_metadata(slot_ids)
    mla_out = mla.forward(q_latent, q_pe, kv_cache, meta)

    Hq, Hkv, D = 8, 2, 64
    k_cache = rng.standard_normal((num_blocks, 16, Hkv, D)).astype(np.float16)
    v_cache = rng.standard_normal((num_blocks, 16, Hkv, D)).astype(np.float16)
    block_tables = np.array([[3, 9, 1, 0], [12, 5, 0, 0]], np.int32)
    seq_lens = np.array([50, 20], np.int32)
    q = rng.standard_normal((2, Hq, D)).astype(np.float16)
    gqa_out = PagedGqaBackend(Hq, Hkv, D).forward(q, k_cache, v_cache, block_tables, seq_lens)
    return dict(kv_cache=kv_cache, slot_ids=slot_ids, q_latent=q_latent, q_pe=q_pe, mla_out=mla_out,
                k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, q=q, gqa_out=gqa_out)


if __name__ == "__main__":
    out = demo()
    print("mla:", out["mla_out"].shape, "gqa:", out["gqa_out"].shape)
