"""The DSA layer's chunked prefill over an engine's pools from Python, on the CPU backend with numpy
arrays: DsaAttention.prefill_paged (KVStorage.ENGINE_PAGED: the engine's MLA rows read in place
through a shuffled block table, the layer keeping the index keys) against prefill over the layer's
own cache for the same prompt, and DsaAttention.prefill_pools (KVStorage.ENGINE_POOLS: the engine
also owns the index keys, in the layer's dtype, behind a table of their own, and passes the
lengths) against prefill_paged. Every pool row the engine has not written is NaN, and so is every
output before the call. Ragged batches with a free slot; refused chunks change nothing."""

import functools

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import gates_off, quarter_grid

BLOCK = 16  # the engine's MLA block size
KEY_BLOCK = 32  # its index-key block size (a table of their own)
H, L, R, IH, ID, TOPK = 4, 512, 64, 4, 64, 24  # the fused MLA prefill takes latent / rope 512 / 64 only


def config(kv_storage):
    return sp.DsaConfig(num_qo_heads=H, latent_dim=L, rope_dim=R, index_heads=IH, index_head_dim=ID, index_topk=TOPK,
                        capacity_step=64, kv_storage=kv_storage)


grid = functools.partial(quarter_grid, dtype=np.float16)  # f16 holds the values and their products exactly


class Prompt:
    """Each slot's rows (latent, rope, index key) for its prompt and the chunk of n tokens after it;
    prompts[b] None is a free slot."""

    def __init__(self, rng, prompts, n):
        self.prompts, self.n, self.B = prompts, n, len(prompts)
        self.total = [0 if p is None else p + n for p in prompts]
        self.latent = [grid(rng, t, L) for t in self.total]
        self.pe = [grid(rng, t, R) for t in self.total]
        self.key = [grid(rng, t, ID) for t in self.total]
        self.q, self.q_pe = grid(rng, self.B, n, H, L), grid(rng, self.B, n, H, R)
        self.q_index = grid(rng, self.B, n, IH, ID)
        self.w = (rng.integers(1, 5, size=(self.B, n, IH)) / 4).astype(np.float32)
        self.active = [p is not None for p in prompts]

    def queries(self):
        return self.q, self.q_pe, self.q_index, self.w

    def chunk(self, rows):
        """[n, B, 1, 1, dim] token-major: each active slot's chunk rows of `rows` (zeros for a free slot)."""
        out = np.zeros((self.n, self.B, 1, 1, rows[0].shape[1]), np.float16)
        for b, p in enumerate(self.prompts):
            if p is not None:
                out[:, b, 0, 0] = rows[b][p:]
        return out

    def admit(self, layer, b, own_cache):
        p = self.prompts[b]
        if p is None:
            layer.release(b)
        elif own_cache:  # K = latent then index key, V = rope
            layer.admit(b, np.concatenate([self.latent[b][:p], self.key[b][:p]], 1)[None].copy(),
                        self.pe[b][:p][None].copy())
        else:  # an engine-paged layer keeps only the index keys
            layer.admit(b, self.key[b][:p][None].copy())

    def mla_pool(self, rng, max_blocks):
        """The engine's MLA pool [num_blocks, BLOCK, L + R] (latent then rope, NaN where unwritten) behind a
        shuffled block table; every position of the prompt and the chunk written."""
        num_blocks = self.B * max_blocks + 3
        table = rng.permutation(num_blocks).astype(np.int32)[: self.B * max_blocks].reshape(self.B, max_blocks).copy()
        pool = np.full((num_blocks, BLOCK, L + R), np.nan, np.float16)
        for b, t in enumerate(self.total):
            pos = np.arange(t)
            pool[table[b, pos // BLOCK], pos % BLOCK] = np.concatenate([self.latent[b], self.pe[b]], 1)
        return pool, table


def nan_o(B, n):
    return np.full((B, n, H, L), np.nan, np.float16)


def check_outputs(prompt, got, want, positions, want_positions):
    assert positions == want_positions
    for b in range(prompt.B):
        for t in range(prompt.n):
            kept = positions[b * prompt.n + t]
            if not prompt.active[b]:
                assert kept == [] and np.all(got[b, t] == 0), f"free slot {b} attends nothing, writes zeros"
                continue
            assert len(kept) == min(TOPK, prompt.prompts[b] + t + 1), (b, t)
            assert not np.isnan(got[b, t]).any(), (b, t)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("prompts,n", [([16, 16], 24), ([40, None, 9], 16)])
def test_prefill_paged_equals_prefill_over_its_own_cache(rng, prompts, n):
    """The chunk crosses the top-k (24): the first case's windows grow from 17 to 40, the second's
    include a slot past it, a free slot and one within it."""
    p = Prompt(rng, prompts, n)
    own = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.LAYER_CACHE), p.B, gates_off())
    eng = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.ENGINE_PAGED), p.B, gates_off())
    for b in range(p.B):
        p.admit(own, b, own_cache=True)
        p.admit(eng, b, own_cache=False)
    kv_cache, table = p.mla_pool(rng, max(p.total) // BLOCK + 2)
    rows = [np.concatenate([lat, key], 1) for lat, key in zip(p.latent, p.key)]
    o_own, o_eng = nan_o(p.B, n), nan_o(p.B, n)
    own.prefill(*p.queries(), p.chunk(rows), p.chunk(p.pe), o_own)
    index_k = p.chunk(p.key)
    before = eng.kv_lens

    # Refused by name before anything changes: a table row too short for the chunk, and the pools
    # form on an engine-paged layer (which takes the chunk's index keys and keeps its lengths).
    short = table[:, : (max(p.total) - 1) // BLOCK].copy()
    with pytest.raises(sp.Error, match="DsaAttention::prefill.*past its block-table row"):
        eng.prefill_paged(*p.queries(), index_k, o_eng, kv_cache, short)
    lens = np.array(p.total, np.int32)
    with pytest.raises(sp.Error, match=r"prefill_pools: the layer was made with another kv_storage; .*ENGINE_POOLS"):
        eng.prefill_pools(*p.queries(), o_eng, kv_cache, table, lens, max(p.total), np.zeros((8, 16, ID), np.float16))
    assert eng.kv_lens == before
    assert np.isnan(o_eng).all(), "a refused chunk wrote o"

    eng.prefill_paged(*p.queries(), index_k, o_eng, kv_cache, table)
    eng.check_errors()
    assert eng.kv_lens == own.kv_lens == p.total
    check_outputs(p, o_eng, o_own, eng.last_prefill_positions(), own.last_prefill_positions())


def test_prefill_paged_on_a_layer_cache_layer_is_refused_by_name(rng):
    p = Prompt(rng, [8], 8)
    own = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.LAYER_CACHE), 1, gates_off())
    p.admit(own, 0, own_cache=True)
    kv_cache, table = p.mla_pool(rng, 2)
    o = nan_o(1, 8)
    with pytest.raises(sp.Error, match="the layer keeps its own cache"):
        own.prefill_paged(*p.queries(), p.chunk(p.key), o, kv_cache, table)
    with pytest.raises(sp.Error, match="index_k"):  # the argument checks name the tensor
        own.prefill_paged(*p.queries(), p.chunk(p.key)[:, :, :, :, :8].copy(), o, kv_cache, table)
    assert own.kv_lens == [8] and np.isnan(o).all()


@pytest.mark.parametrize("prompts,n", [([16, 16], 24), ([40, None, 9], 16)])
def test_prefill_pools_over_native_index_keys_equals_prefill_paged(rng, prompts, n):
    """The engine's index keys in the layer's dtype [num_blocks, KEY_BLOCK, ID], written with
    write_index_keys through a table of their own; the lengths passed with the chunk. The pools form
    keeps what the engine-paged layer (which keeps the same keys itself) keeps, with its answer,
    and keeps no lengths."""
    p = Prompt(rng, prompts, n)
    paged = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.ENGINE_PAGED), p.B, gates_off())
    pools = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.ENGINE_POOLS), p.B, gates_off())
    for b in range(p.B):
        p.admit(paged, b, own_cache=False)
    kv_cache, table = p.mla_pool(rng, max(p.total) // BLOCK + 2)
    key_rows = max(p.total) // KEY_BLOCK + 1
    key_blocks = p.B * key_rows + 2
    key_table = rng.permutation(key_blocks).astype(np.int32)[: p.B * key_rows].reshape(p.B, key_rows).copy()
    index_cache = np.full((key_blocks, KEY_BLOCK, ID), np.nan, np.float16)
    for b, t in enumerate(p.total):
        pos = np.arange(t)
        sp.write_index_keys(index_cache, p.key[b], key_table[b, pos // KEY_BLOCK].astype(np.int64) * KEY_BLOCK
                            + pos % KEY_BLOCK)  # the engine's cache write
    lens = np.array(p.total, np.int32)  # with the chunk; 0 for a free slot
    bound = max(p.total) + 3
    o_paged, o_pools = nan_o(p.B, n), nan_o(p.B, n)
    paged.prefill_paged(*p.queries(), p.chunk(p.key), o_paged, kv_cache, table)

    # Refused by name before anything is written: a length below the chunk (the layer), lengths of
    # the wrong shape (the argument checks), and index keys given to the engine-paged form.
    short = lens.copy()
    short[0] = n - 1
    with pytest.raises(sp.Error, match=rf"kv.seq_lens\[0\] = {n - 1} must be 0 \(a free slot\) or lie in"):
        pools.prefill_pools(*p.queries(), o_pools, kv_cache, table, short, bound, index_cache, key_table)
    with pytest.raises(sp.Error, match="DsaAttention.prefill_pools: seq_lens"):
        pools.prefill_pools(*p.queries(), o_pools, kv_cache, table, lens[:-1].copy(), bound, index_cache, key_table)
    with pytest.raises(sp.Error, match="index_k must be null"):
        pools.prefill_paged(*p.queries(), p.chunk(p.key), o_pools, kv_cache, table)
    assert np.isnan(o_pools).all(), "a refused chunk wrote o"

    pools.prefill_pools(*p.queries(), o_pools, kv_cache, table, lens, bound, index_cache, key_table)
    pools.check_errors()
    assert pools.kv_lens == [0] * p.B, "an engine-pools layer keeps no lengths"
    check_outputs(p, o_pools, o_paged, pools.last_prefill_positions(), paged.last_prefill_positions())

    # The engine's host copy of the lengths (a list here): the same answer bit for bit; a copy past
    # max_seq_len is refused by name (the device lengths are the same host memory on the CPU).
    o_host = nan_o(p.B, n)
    pools.prefill_pools(*p.queries(), o_host, kv_cache, table, lens, bound, index_cache, key_table,
                        host_seq_lens=[int(x) for x in lens])
    assert np.array_equal(o_host, o_pools, equal_nan=False)
    far = lens.copy()
    far[0] = bound + 1
    with pytest.raises(sp.Error, match=rf"kv.host_seq_lens\[0\] = {bound + 1} must be 0 \(a free slot\) or lie in"):
        pools.prefill_pools(*p.queries(), nan_o(p.B, n), kv_cache, table, far, bound, index_cache, key_table,
                            host_seq_lens=far)
