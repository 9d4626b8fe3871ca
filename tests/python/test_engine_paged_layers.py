"""The layers over an engine's paged pool (KVStorage.ENGINE_PAGED) on the CPU backend, with numpy
arrays: the engine's [num_blocks, block_size, heads, dim] K/V pools (and the MLA [num_blocks,
block_size, 576] pool) are read in place through a shuffled block table, every row the engine has
not written is NaN, and each step must equal the same layer over its own cache fed the same tokens
(the same kept set, the same bits), or an fp64 reference where the layer attends the whole window.
Misuse is refused by name."""

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import gates_off
from reference import attend

ENGINE_BLOCK = 16


class Pool:
    """An engine's paged allocations: shuffled blocks, three spare, NaN until written."""

    def __init__(self, rng, batch, max_blocks, row_shape):
        self.num_blocks = batch * max_blocks + 3
        ids = rng.permutation(self.num_blocks).astype(np.int32)
        self.table = ids[: batch * max_blocks].reshape(batch, max_blocks).copy()
        self.shape = (self.num_blocks, ENGINE_BLOCK) + tuple(row_shape)

    def new(self):
        return np.full(self.shape, np.nan, np.float16)

    def write(self, pool, b, pos, row):
        pool[self.table[b, pos // ENGINE_BLOCK], pos % ENGINE_BLOCK] = row


def block_config(kv_storage):
    return sp.BlockSparseConfig(num_qo_heads=8, num_kv_heads=2, head_dim=16, block_size=8, topk_blocks=3,
                                local_blocks=1, capacity_step=32, kv_storage=kv_storage)


def test_block_sparse_over_an_engine_pool_equals_its_own_cache(rng):
    B, H, D, prompt = 2, 2, 16, 60
    own = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, block_config(sp.KVStorage.LAYER_CACHE), B, gates_off())
    eng = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, block_config(sp.KVStorage.ENGINE_PAGED), B, gates_off())
    pool = Pool(rng, B, 8, (H, D))
    k_cache, v_cache = pool.new(), pool.new()
    keys = rng.standard_normal((B, H + 1, prompt, D)).astype(np.float16)  # attention keys, then the index key
    vals = rng.standard_normal((B, H, prompt, D)).astype(np.float16)
    own.append_tokens(keys, vals)
    eng.append_tokens(keys[:, H:].copy(), None)
    for b in range(B):
        for t in range(prompt):
            pool.write(k_cache, b, t, keys[b, :H, t])
            pool.write(v_cache, b, t, vals[b, :, t])
    all_k, all_v = [keys[:, :H]], [vals]
    for step in range(6):
        pos = eng.kv_len
        q = rng.standard_normal((B, 8, D)).astype(np.float16)
        iq = rng.standard_normal((B, H, D)).astype(np.float16)
        k = rng.standard_normal((B, H + 1, 1, D)).astype(np.float16)
        v = rng.standard_normal((B, H, 1, D)).astype(np.float16)
        for b in range(B):  # the engine writes the token's rows before the step
            pool.write(k_cache, b, pos, k[b, :H, 0])
            pool.write(v_cache, b, pos, v[b, :, 0])
        o_own, o_eng = np.full((B, 8, D), np.nan, np.float16), np.full((B, 8, D), np.nan, np.float16)
        s_own = own.decode(q, iq, k, v, o_own)
        s_eng = eng.decode_paged(q, iq, k[:, H:].copy(), o_eng, k_cache, v_cache, pool.table)
        assert s_eng.fused and s_eng.sparse == s_own.sparse
        all_k.append(k[:, :H])
        all_v.append(v)
        if s_own.sparse:
            assert s_own.fused
            assert eng.last_blocks() == own.last_blocks()
            np.testing.assert_array_equal(o_eng, o_own)
        else:  # every block, through the fused path: against fp64 over the whole window
            kk, vv = np.concatenate(all_k, axis=2), np.concatenate(all_v, axis=2)
            for b in range(B):
                for h in range(H):
                    ref, _ = attend(q[b, h * 4:(h + 1) * 4], kk[b, h], vv[b, h], 1 / np.sqrt(D))
                    np.testing.assert_allclose(o_eng[b, h * 4:(h + 1) * 4].astype(np.float64), ref, atol=3e-3)
    assert eng.kv_len == own.kv_len == prompt + 6


def test_block_sparse_engine_pool_attends_every_block_in_the_dense_regime(rng):
    B, H, D, prompt = 1, 2, 16, 20  # 21 tokens <= 2 * topk * block: the dense regime
    eng = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, block_config(sp.KVStorage.ENGINE_PAGED), B)
    pool = Pool(rng, B, 4, (H, D))
    k_cache, v_cache = pool.new(), pool.new()
    keys = rng.standard_normal((B, H, prompt + 1, D)).astype(np.float16)
    vals = rng.standard_normal((B, H, prompt + 1, D)).astype(np.float16)
    eng.append_tokens(rng.standard_normal((B, 1, prompt, D)).astype(np.float16), None)
    for t in range(prompt + 1):
        pool.write(k_cache, 0, t, keys[0, :, t])
        pool.write(v_cache, 0, t, vals[0, :, t])
    q = rng.standard_normal((B, 8, D)).astype(np.float16)
    o = np.full((B, 8, D), np.nan, np.float16)
    step = eng.decode_paged(q, rng.standard_normal((B, H, D)).astype(np.float16),
                            rng.standard_normal((B, 1, 1, D)).astype(np.float16), o, k_cache, v_cache, pool.table)
    assert step.fused and not step.sparse
    for h in range(H):
        ref, _ = attend(q[0, h * 4:(h + 1) * 4], keys[0, h], vals[0, h], 1 / np.sqrt(D))
        np.testing.assert_allclose(o[0, h * 4:(h + 1) * 4].astype(np.float64), ref, atol=3e-3)


def dsa_config(kv_storage):
    return sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=2, index_head_dim=8, index_topk=12,
                        capacity_step=32, kv_storage=kv_storage)


def test_dsa_over_an_engine_mla_pool_equals_its_own_cache(rng):
    B, L, R, ID, prompt = 2, 32, 8, 8, 8  # steps cross index_topk = 12
    own = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, dsa_config(sp.KVStorage.LAYER_CACHE), B, gates_off())
    eng = sp.DsaAttention(sp.Device.cpu, sp.DType.f16, dsa_config(sp.KVStorage.ENGINE_PAGED), B)
    pool = Pool(rng, B, 4, (L + R,))
    kv_cache = pool.new()
    latent = rng.standard_normal((B, 1, prompt, L)).astype(np.float16)
    index_k = rng.standard_normal((B, 1, prompt, ID)).astype(np.float16)
    pe = rng.standard_normal((B, 1, prompt, R)).astype(np.float16)
    own.append_tokens(np.concatenate([latent, index_k], axis=-1), pe)
    eng.append_tokens(index_k, None)
    for b in range(B):
        for t in range(prompt):
            pool.write(kv_cache, b, t, np.concatenate([latent[b, 0, t], pe[b, 0, t]]))
    for step in range(10):
        pos = eng.kv_len
        row_latent = rng.standard_normal((B, 1, 1, L)).astype(np.float16)
        row_index = rng.standard_normal((B, 1, 1, ID)).astype(np.float16)
        row_pe = rng.standard_normal((B, 1, 1, R)).astype(np.float16)
        for b in range(B):
            pool.write(kv_cache, b, pos, np.concatenate([row_latent[b, 0, 0], row_pe[b, 0, 0]]))
        queries = (rng.standard_normal((B, 4, L)).astype(np.float16), rng.standard_normal((B, 4, R)).astype(np.float16),
                   rng.standard_normal((B, 2, ID)).astype(np.float16), rng.random((B, 2)).astype(np.float32))
        o_own, o_eng = np.full((B, 4, L), np.nan, np.float16), np.full((B, 4, L), np.nan, np.float16)
        s_own = own.decode(*queries, np.concatenate([row_latent, row_index], axis=-1), row_pe, o_own)
        s_eng = eng.decode_paged(*queries, row_index, o_eng, kv_cache, pool.table)
        assert s_own.fused and s_eng.fused and s_eng.sparse == (pos + 1 > 12)
        assert eng.last_selected_positions() == own.last_selected_positions()
        np.testing.assert_array_equal(o_eng, o_own)


def test_engine_paged_misuse_is_refused_by_name(rng):
    B, H, D = 1, 2, 16
    eng = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, block_config(sp.KVStorage.ENGINE_PAGED), B)
    own = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, block_config(sp.KVStorage.LAYER_CACHE), B)
    pool = Pool(rng, B, 8, (H, D))
    kc, vc = pool.new(), pool.new()
    eng.append_tokens(np.zeros((B, 1, 40, D), np.float16), None)
    q, iq, ik = np.zeros((B, 8, D), np.float16), np.zeros((B, H, D), np.float16), np.zeros((B, 1, 1, D), np.float16)
    o = np.zeros((B, 8, D), np.float16)
    with pytest.raises(sp.Error, match=r"kv_storage = KVStorage::kEnginePaged"):
        own.decode_paged(q, iq, ik, o, kc, vc, pool.table)
    with pytest.raises(sp.Error, match=r"decode\(tokens, kv\)"):
        eng.decode(q, iq, np.zeros((B, 3, 1, D), np.float16), np.zeros((B, 2, 1, D), np.float16), o)
    with pytest.raises(sp.Error, match=r"^BlockSparseAttention.decode_paged: k_cache has 3 heads; the layer has 2"):
        eng.decode_paged(q, iq, ik, o, np.zeros((pool.num_blocks, ENGINE_BLOCK, 3, D), np.float16), vc, pool.table)
    with pytest.raises(sp.Error, match=r"^BlockSparseAttention.decode_paged: block_table has 2 rows; the layer's batch is 1"):
        eng.decode_paged(q, iq, ik, o, kc, vc, np.zeros((2, 8), np.int32))
    with pytest.raises(sp.Error, match=r"block_table: 2 blocks of 16 rows cannot hold live_len = 41 positions"):
        eng.decode_paged(q, iq, ik, o, kc, vc, pool.table[:, :2].copy())
    with pytest.raises(sp.Error, match=r"each block's rows one after another"):
        eng.decode_paged(q, iq, ik, o, kc[::2], vc, pool.table)
    with pytest.raises(sp.Error, match=r"v must be None for an engine-paged layer"):
        eng.append_tokens(np.zeros((B, 1, 4, D), np.float16), np.zeros((B, 2, 4, D), np.float16))
    assert eng.kv_len == 40  # nothing refused was appended
    killed = sp.DispatchConfig.defaults()
    killed.enabled = False
    off = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, block_config(sp.KVStorage.ENGINE_PAGED), B, killed)
    off.append_tokens(np.zeros((B, 1, 40, D), np.float16), None)
    with pytest.raises(sp.Error, match=r"the fused path declined \(kill_switch"):
        off.decode_paged(q, iq, ik, o, kc, vc, pool.table)
    assert off.kv_len == 40
