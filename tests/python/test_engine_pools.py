"""The DSA layer over engine-owned pools (KVStorage.ENGINE_POOLS) on the CPU backend, with numpy
arrays, as a vLLM- or SGLang-style backend drives it: the engine writes each token's MLA row and
index key into its own paged pools (write_index_keys for the keys), keeps the lengths, and passes
them every step; the layer keeps nothing per sequence. A ragged batch with a free slot must equal
the same layer over its own cache fed the same tokens, and misuse is refused by name."""

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import gates_off

BLOCK = 16


def config(storage):
    return sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=3, index_head_dim=16, index_topk=20,
                        capacity_step=64, kv_storage=storage)


def test_dsa_over_engine_pools_equals_its_own_cache(rng):
    B, L, R, ID, max_blocks = 3, 32, 8, 16, 6
    lens = np.array([0, 13, 70], np.int32)  # a free slot, one within the top-k, one past it
    num_blocks = B * max_blocks + 2
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = ids[: B * max_blocks].reshape(B, max_blocks).copy()
    kv_cache = np.full((num_blocks, BLOCK, L + R), np.nan, np.float16)  # NaN until the engine writes
    index_cache = np.full((num_blocks, BLOCK, ID), np.nan, np.float16)
    own = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.LAYER_CACHE), B, gates_off())
    own.reserve(96)
    for b in range(B):
        n = int(lens[b])
        latent = rng.standard_normal((n, L)).astype(np.float16)
        key = rng.standard_normal((n, ID)).astype(np.float16)
        pe = rng.standard_normal((n, R)).astype(np.float16)
        if n == 0:
            own.release(b)
            continue
        own.admit(b, np.concatenate([latent, key], 1)[None].copy(), pe[None].copy())
        slots = (table[b, np.arange(n) // BLOCK].astype(np.int64) * BLOCK + np.arange(n) % BLOCK)
        flat = kv_cache.reshape(-1, L + R)
        flat[slots, :L], flat[slots, L:] = latent, pe
        sp.write_index_keys(index_cache, key, slots)  # the engine's cache write
    eng = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config(sp.KVStorage.ENGINE_POOLS), B, gates_off())
    eng.reserve(96)
    # One step: the last token of each live sequence is "this step's", already in both caches.
    q = rng.standard_normal((B, 4, L)).astype(np.float16)
    q_pe = rng.standard_normal((B, 4, R)).astype(np.float16)
    q_index = rng.standard_normal((B, 3, ID)).astype(np.float16)
    w = rng.uniform(0.1, 1.0, (B, 3)).astype(np.float32)
    o_eng = np.full((B, 4, L), np.nan, np.float16)
    step = eng.decode_pools(q, q_pe, q_index, w, o_eng, kv_cache, table, lens, 96, index_cache)
    assert step.fused
    sel = eng.last_selected_positions()
    assert [len(s) for s in sel] == [0, 13, 20]
    assert np.all(o_eng[0] == 0), "a free slot writes zeros"
    assert not np.isnan(o_eng).any()
    # The same step through the layer's own cache: its last token re-attended (prefill_token appends one more,
    # so compare against a decode whose appended token is the pool's next row instead).
    nxt = rng.standard_normal((B, 1, 1, L + ID)).astype(np.float16)
    nxt_pe = rng.standard_normal((B, 1, 1, R)).astype(np.float16)
    o_own = np.full((B, 4, L), np.nan, np.float16)
    own.decode(q, q_pe, q_index, w, nxt, nxt_pe, o_own)
    for b in range(1, B):  # write the same token into the engine's pools, one longer
        pos = int(lens[b])
        slot = np.int64(table[b, pos // BLOCK]) * BLOCK + pos % BLOCK
        kv_cache.reshape(-1, L + R)[slot] = np.concatenate([nxt[b, 0, 0, :L], nxt_pe[b, 0, 0]])
        sp.write_index_keys(index_cache, nxt[b, 0, 0, L:][None].copy(), np.array([slot], np.int64))
    lens2 = np.where(lens > 0, lens + 1, 0).astype(np.int32)
    o_eng2 = np.full((B, 4, L), np.nan, np.float16)
    eng.decode_pools(q, q_pe, q_index, w, o_eng2, kv_cache, table, lens2, 96, index_cache)
    assert [sorted(s) for s in eng.last_selected_positions()][1:] == [sorted(s) for s in own.last_selected_positions()][1:]
    np.testing.assert_allclose(o_eng2[1:].astype(np.float32), o_own[1:].astype(np.float32), rtol=0, atol=2e-3)

    eng.check_errors()  # nothing flagged so far
    # A length past the declared bound: the indexer refuses the row, and the step is refused or flagged by name.
    over = np.array([0, 13, 97], np.int32)
    with pytest.raises(sp.Error):
        eng.decode_pools(q, q_pe, q_index, w, o_eng, kv_cache, table, over, 96, index_cache)
        eng.check_errors()
    # Misuse, named.
    with pytest.raises(sp.Error, match="keeps no sequences"):
        eng.admit(0, np.zeros((1, 1, ID), np.float16))
    with pytest.raises(sp.Error, match="index_cache"):
        eng.decode_pools(q, q_pe, q_index, w, o_eng, kv_cache, table, lens, 96, index_cache[:, :, :8].copy())
    with pytest.raises(sp.Error, match="seq_lens"):
        eng.decode_pools(q, q_pe, q_index, w, o_eng, kv_cache, table, lens[:2].copy(), 96, index_cache)


def test_fp8_index_keys_are_vllms_bytes(rng):
    """write_index_keys into a uint8 [blocks, block, 132] pool: per block the e4m3 values then the fp32
    scales, each scale a power of two >= amax / 448; the values dequantize to the keys within e4m3's
    rounding."""
    cache = np.zeros((3, BLOCK, 132), np.uint8)
    keys = rng.standard_normal((5, 128)).astype(np.float16) * np.float16(3)
    slots = np.array([0, 17, 18, 47, -1], np.int64)
    sp.write_index_keys(cache, keys, slots)
    flat = cache.reshape(3, -1)
    for i, s in enumerate(slots[:4]):
        blk, off = divmod(int(s), BLOCK)
        scale = flat[blk, BLOCK * 128 + 4 * off: BLOCK * 128 + 4 * off + 4].view(np.float32)[0]
        amax = np.abs(keys[i].astype(np.float32)).max()
        assert scale >= amax / 448 and np.log2(scale) == np.round(np.log2(scale))
        vals = flat[blk, 128 * off: 128 * off + 128]
        sign = np.where(vals & 0x80, -1.0, 1.0)
        exp, man = (vals >> 3) & 0xF, vals & 7
        mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
        np.testing.assert_allclose(sign * mag * scale, keys[i].astype(np.float64), rtol=0.07, atol=scale * 2 ** -9)
    assert not flat[:, 128 * 4: 128 * 5].any(), "slot -1 wrote nothing"


@pytest.mark.parametrize("fp8_keys", [False, True])
def test_block_sparse_over_engine_pools_equals_the_engine_paged_layer(rng, fp8_keys):
    """BlockSparseAttention.decode_pools: K/V rows and index keys in the engine's pools (the keys with a
    table of their own), the lengths passed each step. A ragged batch with a free slot, one sequence in
    its dense regime and one past it, against the engine-paged layer (which keeps the same index keys
    itself) over the same K/V pools: the same blocks and the same output bits."""
    B, H, D, max_blocks, key_block = 3, 2, 32, 12, 32
    if fp8_keys:
        D = 128  # vLLM's FP8 index keys hold 128 values

    def cfg(s):
        return sp.BlockSparseConfig(num_qo_heads=4, num_kv_heads=H, head_dim=D, block_size=16, topk_blocks=2,
                                    local_blocks=1, capacity_step=64, kv_storage=s)

    lens = np.array([0, 40, 150], np.int32)  # free, dense regime (<= 64), sparse
    num_blocks = B * max_blocks + 2
    table = rng.permutation(num_blocks).astype(np.int32)[: B * max_blocks].reshape(B, max_blocks).copy()
    key_blocks = B * 6 + 1
    key_table = rng.permutation(key_blocks).astype(np.int32)[: B * 6].reshape(B, 6).copy()
    k_cache = np.full((num_blocks, BLOCK, H, D), np.nan, np.float16)  # NaN until the engine writes
    v_cache = np.full((num_blocks, BLOCK, H, D), np.nan, np.float16)
    if fp8_keys:
        index_cache = np.full((key_blocks, key_block, 132), 0xFF, np.uint8)
    else:
        index_cache = np.full((key_blocks, key_block, D), np.nan, np.float16)
    paged = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, cfg(sp.KVStorage.ENGINE_PAGED), B, gates_off())
    paged.reserve(192)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            paged.release(b)
            continue
        pos = np.arange(n)
        slots = table[b, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
        k_cache.reshape(-1, H, D)[slots] = rng.standard_normal((n, H, D)).astype(np.float16)
        v_cache.reshape(-1, H, D)[slots] = rng.standard_normal((n, H, D)).astype(np.float16)
        key = rng.standard_normal((n, D)).astype(np.float16)
        key_slots = key_table[b, pos // key_block].astype(np.int64) * key_block + pos % key_block
        sp.write_index_keys(index_cache, key, key_slots)  # the engine's cache write
        if fp8_keys:  # the engine-paged layer keeps the keys as the pool dequantizes them (exact in f16)
            key = fp8_keys_of(index_cache, key_table[b, pos // key_block], pos % key_block)
        paged.admit(b, key[None].copy())
    pools = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, cfg(sp.KVStorage.ENGINE_POOLS), B)
    pools.reserve(192)
    q = rng.standard_normal((B, 4, D)).astype(np.float16)
    index_q = rng.standard_normal((B, H, D)).astype(np.float16)
    o_pools = np.full((B, 4, D), np.nan, np.float16)
    step = pools.decode_pools(q, index_q, o_pools, k_cache, v_cache, table, lens, 150, index_cache, key_table)
    assert step.fused and step.sparse
    pools.check_errors()
    # The engine-paged layer's step appends one more token: compare at the pools' next step instead.
    nxt_k = rng.standard_normal((B, H, D)).astype(np.float16)
    nxt_v = rng.standard_normal((B, H, D)).astype(np.float16)
    nxt_key = rng.standard_normal((B, D)).astype(np.float16)
    for b in range(1, B):
        pos = int(lens[b])
        slot = np.int64(table[b, pos // BLOCK]) * BLOCK + pos % BLOCK
        k_cache.reshape(-1, H, D)[slot], v_cache.reshape(-1, H, D)[slot] = nxt_k[b], nxt_v[b]
        key_slot = np.int64(key_table[b, pos // key_block]) * key_block + pos % key_block
        sp.write_index_keys(index_cache, nxt_key[b][None].copy(), np.array([key_slot], np.int64))
        if fp8_keys:
            nxt_key[b] = fp8_keys_of(index_cache, key_table[b, pos // key_block : pos // key_block + 1],
                                     np.array([pos % key_block]))[0]
    lens2 = np.where(lens > 0, lens + 1, 0).astype(np.int32)
    o_pools = np.full((B, 4, D), np.nan, np.float16)
    pools.decode_pools(q, index_q, o_pools, k_cache, v_cache, table, lens2, 151, index_cache, key_table)
    o_paged = np.full((B, 4, D), np.nan, np.float16)
    paged.decode_paged(q, index_q, nxt_key[:, None, None].copy(), o_paged, k_cache, v_cache, table)
    assert pools.last_blocks() == paged.last_blocks()
    assert len(pools.last_blocks()[2]) == 3 and pools.last_blocks()[0] == []  # top-2 + the final block; free slot
    assert np.all(o_pools[0] == 0), "a free slot writes zeros"
    assert not np.isnan(o_pools).any()
    np.testing.assert_array_equal(o_pools.view(np.uint16), o_paged.view(np.uint16))

    # A length past the declared bound: on the CPU (host lengths) the step names it before anything
    # runs, and nothing is flagged. A key block outside the pool: the indexer refuses the sequence
    # (the CPU decode then refuses the step) and check_errors() names why.
    with pytest.raises(sp.Error, match=r"kv.seq_lens\[2\] = 160 lies outside \[0, max_seq_len = 151\]"):
        pools.decode_pools(q, index_q, o_pools, k_cache, v_cache, table, np.array([0, 41, 160], np.int32), 151,
                           index_cache, key_table)
    pools.check_errors()  # nothing flagged
    bad_table = key_table.copy()
    bad_table[2, 0] = key_blocks + 3
    with pytest.raises(sp.Error):
        pools.decode_pools(q, index_q, o_pools, k_cache, v_cache, table, lens2, 151, index_cache, bad_table)
    with pytest.raises(sp.Error, match="outside the index-key pool"):
        pools.check_errors()
    with pytest.raises(sp.Error, match="keeps no sequences"):
        pools.release(0)
    with pytest.raises(sp.Error, match="seq_lens"):
        pools.decode_pools(q, index_q, o_pools, k_cache, v_cache, table, lens2[:2].copy(), 151, index_cache, key_table)


def e4m3_to_float(b):
    b = np.asarray(b, np.uint8).astype(np.int32)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    mag = np.where(exp == 0, np.ldexp(man / 8.0, -6), np.ldexp(1.0 + man / 8.0, exp - 7))
    return np.where((exp == 0xF) & (man == 7), np.nan, sign * mag).astype(np.float32)


def fp8_keys_of(index_cache, blocks, slots):
    """The keys at (block, slot) pairs of a vLLM FP8 index-key pool, dequantized (e4m3 x scale) as f16."""
    per_block = index_cache.reshape(index_cache.shape[0], -1)[blocks]  # a block's values, then its scales
    values = per_block[np.arange(len(slots))[:, None], np.asarray(slots)[:, None] * 128 + np.arange(128)]
    scales = per_block[:, index_cache.shape[1] * 128:].copy().view(np.float32)[np.arange(len(slots)), slots]
    return (e4m3_to_float(values) * scales[:, None]).astype(np.float16)


def test_an_empty_key_write_is_a_no_op_whatever_its_strides():
    """A free slot has no keys to write: a zero-row array is accepted whatever strides its producer
    gave it (nothing is read), and the cache is left as it was."""
    index_cache = np.full((2, BLOCK, 16), np.nan, np.float16)
    empty = np.zeros((0, 32), np.float16)[:, ::2]  # shape (0, 16), a stride of two elements
    sp.write_index_keys(index_cache, empty, np.zeros(0, np.int64))
    assert np.isnan(index_cache).all()
    with pytest.raises(sp.Error, match="keys must be contiguous"):  # a non-empty strided one is still refused
        sp.write_index_keys(index_cache, np.zeros((1, 32), np.float16)[:, ::2], np.zeros(1, np.int64))
