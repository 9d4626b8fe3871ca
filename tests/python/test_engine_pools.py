"""The DSA layer over engine-owned pools (KVStorage.ENGINE_POOLS) on the CPU backend, with numpy
arrays, as a vLLM- or SGLang-style backend drives it: the engine writes each token's MLA row and
index key into its own paged pools (write_index_keys for the keys), keeps the lengths, and passes
them every step; the layer keeps nothing per sequence. A ragged batch with a free slot must equal
the same layer over its own cache fed the same tokens, and misuse is refused by name."""

import numpy as np
import pytest

import sparsepage as sp

BLOCK = 16


def config(storage):
    return sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=3, index_head_dim=16, index_topk=20,
                        capacity_step=64, kv_storage=storage)


def gates_off():
    c = sp.DispatchConfig.defaults()
    c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0
    return c


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
