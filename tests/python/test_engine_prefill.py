"""Chunked prefill over an engine's paged pool (KVStorage.ENGINE_PAGED, prefill_paged) on the CPU
backend, with numpy arrays: the engine's K/V pools [num_blocks, block_size, heads, dim] are read in
place through a shuffled block table, every row the engine has not written is NaN, and the chunk
must keep what the same layer over its own cache keeps for the same prompt and give the same
output; a chunk the layer refuses changes nothing."""

import functools

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import gates_off, quarter_grid

ENGINE_BLOCK = 16


def config(kv_storage):
    return sp.BlockSparseConfig(num_qo_heads=8, num_kv_heads=2, head_dim=16, block_size=8, topk_blocks=2,
                                local_blocks=1, capacity_step=32, kv_storage=kv_storage)


grid = functools.partial(quarter_grid, dtype=np.float16)  # f16 holds the values and their products exactly


@pytest.mark.parametrize("prompt,n", [(16, 24), (40, 16)])
def test_prefill_over_an_engine_pool_equals_its_own_cache(rng, prompt, n):
    B, Hq, H, D = 2, 8, 2, 16
    own = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.LAYER_CACHE), B, gates_off())
    eng = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.ENGINE_PAGED), B, gates_off())
    total = prompt + n
    keys = grid(rng, B, H + 1, total, D)  # attention keys, then the index key
    vals = grid(rng, B, H, total, D)
    own.append_tokens(keys[:, :, :prompt].copy(), vals[:, :, :prompt].copy())
    eng.append_tokens(keys[:, H:, :prompt].copy(), None)
    max_blocks = total // ENGINE_BLOCK + 2
    num_blocks = B * max_blocks + 3
    table = rng.permutation(num_blocks).astype(np.int32)[: B * max_blocks].reshape(B, max_blocks).copy()
    k_cache = np.full((num_blocks, ENGINE_BLOCK, H, D), np.nan, np.float16)
    v_cache = np.full_like(k_cache, np.nan)
    for b in range(B):  # the engine writes the prompt's and the chunk's rows
        for p in range(total):
            k_cache[table[b, p // ENGINE_BLOCK], p % ENGINE_BLOCK] = keys[b, :H, p]
            v_cache[table[b, p // ENGINE_BLOCK], p % ENGINE_BLOCK] = vals[b, :, p]
    q, iq = grid(rng, B, n, Hq, D), grid(rng, B, n, H, D)
    chunk_k = np.ascontiguousarray(keys[:, :, prompt:].transpose(2, 0, 1, 3)[:, :, :, None, :])  # [n, B, H + 1, 1, D]
    chunk_v = np.ascontiguousarray(vals[:, :, prompt:].transpose(2, 0, 1, 3)[:, :, :, None, :])
    index_k = np.ascontiguousarray(chunk_k[:, :, H:])  # [n, B, 1, 1, D]
    o_own, o_eng = np.full((B, n, Hq, D), np.nan, np.float16), np.full((B, n, Hq, D), np.nan, np.float16)
    own.prefill(q, iq, chunk_k, chunk_v, o_own)

    # A refused chunk (its table row too short for the chunk) changes nothing.
    with pytest.raises(sp.Error, match="past its block-table row"):
        eng.prefill_paged(q, iq, index_k, o_eng, k_cache, v_cache, table[:, : total // ENGINE_BLOCK - 1].copy())
    assert eng.kv_lens == [prompt] * B

    eng.prefill_paged(q, iq, index_k, o_eng, k_cache, v_cache, table)
    assert eng.kv_lens == own.kv_lens == [total] * B
    assert eng.last_prefill_positions() == own.last_prefill_positions()
    assert not np.isnan(o_eng).any()
    np.testing.assert_allclose(o_eng.astype(np.float32), o_own.astype(np.float32), rtol=1e-3, atol=1e-3)


def test_prefill_paged_on_a_layer_cache_layer_is_refused_by_name(rng):
    B, Hq, H, D, n = 1, 8, 2, 16, 8
    own = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.LAYER_CACHE), B, gates_off())
    pool = np.zeros((4, ENGINE_BLOCK, H, D), np.float16)
    with pytest.raises(sp.Error, match="keeps its own cache"):
        own.prefill_paged(grid(rng, B, n, Hq, D), grid(rng, B, n, H, D), grid(rng, n, B, 1, 1, D),
                          np.zeros((B, n, Hq, D), np.float16), pool, pool.copy(), np.arange(4, dtype=np.int32)[None])
    assert own.kv_lens == [0]


@pytest.mark.parametrize("prompts,n", [([16, None, 40], 16), ([0, 24], 24)])
def test_prefill_pools_equals_prefill_paged(rng, prompts, n):
    """KVStorage.ENGINE_POOLS: the engine also owns the index keys ([num_blocks, block_size, D] in the
    layer's dtype, through the K/V table) and passes each slot's length with the chunk (0: a free
    slot). The chunk keeps what an ENGINE_PAGED layer keeping the same keys keeps, with its answer;
    the layer keeps no lengths; a chunk off the block grid and the call on another kv_storage are
    refused by name before o is written."""
    Hq, H, D = 8, 2, 16
    B = len(prompts)
    total = [0 if p is None else p + n for p in prompts]
    keys = [grid(rng, t, H, D) for t in total]
    vals = [grid(rng, t, H, D) for t in total]
    index_keys = [grid(rng, t, D) for t in total]
    paged = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.ENGINE_PAGED), B, gates_off())
    pools = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.ENGINE_POOLS), B, gates_off())
    max_blocks = max(total) // ENGINE_BLOCK + 2
    num_blocks = B * max_blocks + 3
    table = rng.permutation(num_blocks).astype(np.int32)[: B * max_blocks].reshape(B, max_blocks).copy()
    k_cache = np.full((num_blocks, ENGINE_BLOCK, H, D), np.nan, np.float16)
    v_cache = np.full_like(k_cache, np.nan)
    index_cache = np.full((num_blocks, ENGINE_BLOCK, D), np.nan, np.float16)
    for b, t in enumerate(total):  # the engine writes the prompt's and the chunk's rows and index keys
        pos = np.arange(t)
        k_cache[table[b, pos // ENGINE_BLOCK], pos % ENGINE_BLOCK] = keys[b]
        v_cache[table[b, pos // ENGINE_BLOCK], pos % ENGINE_BLOCK] = vals[b]
        index_cache[table[b, pos // ENGINE_BLOCK], pos % ENGINE_BLOCK] = index_keys[b]
        if prompts[b] is None:
            paged.release(b)
        elif prompts[b] > 0:
            paged.admit(b, index_keys[b][: prompts[b]][None].copy())
    index_k = np.zeros((n, B, 1, 1, D), np.float16)
    for b, p in enumerate(prompts):
        if p is not None:
            index_k[:, b, 0, 0] = index_keys[b][p:]
    q, iq = grid(rng, B, n, Hq, D), grid(rng, B, n, H, D)
    o_paged, o_pools = np.full((B, n, Hq, D), np.nan, np.float16), np.full((B, n, Hq, D), np.nan, np.float16)
    paged.prefill_paged(q, iq, index_k, o_paged, k_cache, v_cache, table)
    lens = np.array(total, np.int32)
    bound = max(total) + 5

    off = np.where(lens > 0, lens + 1, 0).astype(np.int32)  # every chunk one position later: off the grid
    with pytest.raises(sp.Error, match="not a multiple of block_size"):
        pools.prefill_pools(q, iq, o_pools, k_cache, v_cache, table, off, bound, index_cache)
    with pytest.raises(sp.Error, match="prefill_pools: the layer was made with another kv_storage"):
        paged.prefill_pools(q, iq, o_pools, k_cache, v_cache, table, lens, bound, index_cache)
    assert np.isnan(o_pools).all(), "a refused chunk wrote o"

    pools.prefill_pools(q, iq, o_pools, k_cache, v_cache, table, lens, bound, index_cache)
    pools.check_errors()
    assert pools.kv_lens == [0] * B, "an engine-pools layer keeps no lengths"
    positions = pools.last_prefill_positions()
    assert positions == paged.last_prefill_positions()
    for b in range(B):
        if prompts[b] is None:
            assert np.all(o_pools[b] == 0) and all(r == [] for r in positions[b * n * Hq:(b + 1) * n * Hq])
    assert not np.isnan(o_pools).any()
    np.testing.assert_allclose(o_pools.astype(np.float32), o_paged.astype(np.float32), rtol=1e-3, atol=1e-3)

    # The engine's host copy of the lengths: the same answer bit for bit, decided without reading
    # seq_lens back; a copy that differs from seq_lens or has the wrong length is refused by name.
    o_host = np.full_like(o_pools, np.nan)
    pools.prefill_pools(q, iq, o_host, k_cache, v_cache, table, lens, bound, index_cache, host_seq_lens=lens.copy())
    assert np.array_equal(o_host, o_pools)
    first = next(b for b in range(B) if total[b] > 0)
    wrong = lens.copy()
    wrong[first] += ENGINE_BLOCK
    o_bad = np.full_like(o_pools, np.nan)
    with pytest.raises(sp.Error, match=rf"kv.host_seq_lens\[{first}\] = {wrong[first]} differs from kv.seq_lens"):
        pools.prefill_pools(q, iq, o_bad, k_cache, v_cache, table, lens, bound, index_cache, host_seq_lens=wrong)
    with pytest.raises(sp.Error, match=rf"prefill_pools: host_seq_lens holds {B - 1} lengths for {B} slots"):
        pools.prefill_pools(q, iq, o_bad, k_cache, v_cache, table, lens, bound, index_cache,
                            host_seq_lens=lens[:-1].copy())
    assert np.isnan(o_bad).all(), "a refused chunk wrote o"
