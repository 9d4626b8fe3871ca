"""The layers (block-sparse, DSA, static pattern) and both indexers on the CPU backend."""

import numpy as np
import pytest

import sparsepage as sp


def fused_and_mask(dispatch_on):
    c = sp.DispatchConfig.defaults()
    c.enabled = dispatch_on
    c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0
    return c


def test_select_top_blocks_cpu_follows_the_rule(rng):
    config = sp.BlockSparseConfig(num_qo_heads=4, num_kv_heads=2, head_dim=8, block_size=4, topk_blocks=2,
                                  local_blocks=1)
    B, L = 2, 30
    q = rng.standard_normal((B, 2, 8)).astype(np.float32)
    keys = rng.standard_normal((B, L, 8)).astype(np.float32)
    ids = sp.select_top_blocks_cpu(config, B, L, q, keys)
    nblocks = -(-L // 4)
    assert ids.shape == (B * 2, 3)
    for r in range(B * 2):
        b, h = divmod(r, 2)
        scores = [max(q[b, h] @ keys[b, t] for t in range(j * 4, (j + 1) * 4)) for j in range(nblocks - 1)]
        expected = list(np.argsort(-np.array(scores), kind="stable")[:2]) + [nblocks - 1]
        assert list(ids[r]) == expected


def test_dsa_select_tokens_cpu_keeps_the_top_scores(rng):
    config = sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=3, index_head_dim=8, index_topk=10)
    B, L = 2, 40
    q = rng.standard_normal((B, 3, 8)).astype(np.float32)
    w = rng.standard_normal((B, 3)).astype(np.float32)
    keys = rng.standard_normal((B, L, 8)).astype(np.float32)
    pos = sp.dsa_select_tokens_cpu(config, B, L, q, w, keys)
    assert pos.shape == (B, 10)
    for b in range(B):
        score = (w[b][:, None] * np.maximum(q[b] @ keys[b].T, 0)).sum(axis=0)
        assert list(pos[b]) == list(np.argsort(-score, kind="stable")[:10])
    short = sp.dsa_select_tokens_cpu(config, B, 6, q, w, keys[:, :6].copy())
    assert sorted(short[0]) == list(range(6))


def test_block_sparse_layer_fused_equals_mask_path_and_sets_match(rng):
    config = sp.BlockSparseConfig(num_qo_heads=4, num_kv_heads=2, head_dim=16, block_size=8, topk_blocks=2,
                                  local_blocks=1, capacity_step=32)
    B = 3  # K carries the index key in an extra head: per-stream strides fuse at any batch
    layers = [sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, config, B, fused_and_mask(on)) for on in (True, False)]
    outs = []
    for step in range(45):
        q = rng.standard_normal((B, 4, 16)).astype(np.float16)
        iq = rng.standard_normal((B, 2, 16)).astype(np.float16)
        k = rng.standard_normal((B, 3, 1, 16)).astype(np.float16)
        v = rng.standard_normal((B, 2, 1, 16)).astype(np.float16)
        os_ = [np.full((B, 4, 16), np.nan, np.float16) for _ in layers]
        steps = [layer.decode(q, iq, k, v, o) for layer, o in zip(layers, os_)]
        outs.append(os_)
    kv_len = layers[0].kv_len
    assert kv_len == 45 and config.sparse_regime(kv_len)
    assert steps[0].sparse and steps[0].fused and not steps[1].fused
    assert steps[1].outcome.kind == sp.OutcomeKind.kill_switch
    np.testing.assert_allclose(outs[-1][0].astype(np.float32), outs[-1][1].astype(np.float32), atol=2e-3, rtol=2e-3)
    positions = layers[0].last_selected_positions()
    columns = layers[0].last_mask_columns()
    assert len(positions) == B * 2
    assert [sorted(set(p)) for p in positions] == [sorted(c) for c in columns]
    assert len(layers[0].last_blocks()) == B * 2


def test_dsa_layer_fused_equals_mask_path(rng):
    config = sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=2, index_head_dim=8, index_topk=12,
                          capacity_step=32)
    B = 2
    layers = [sp.DsaAttention(sp.Device.cpu, sp.DType.f16, config, B, fused_and_mask(on)) for on in (True, False)]
    for step in range(30):
        args = (rng.standard_normal((B, 4, 32)).astype(np.float16), rng.standard_normal((B, 4, 8)).astype(np.float16),
                rng.standard_normal((B, 2, 8)).astype(np.float16), rng.random((B, 2)).astype(np.float32),
                rng.standard_normal((B, 1, 1, 40)).astype(np.float16), rng.standard_normal((B, 1, 1, 8)).astype(np.float16))
        os_ = [np.full((B, 4, 32), np.nan, np.float16) for _ in layers]
        steps = [layer.decode(*args, o) for layer, o in zip(layers, os_)]
    assert layers[0].kv_len == 30 and steps[0].sparse and steps[0].fused and not steps[1].fused
    np.testing.assert_allclose(os_[0].astype(np.float32), os_[1].astype(np.float32), atol=2e-3, rtol=2e-3)
    assert [sorted(p) for p in layers[0].last_selected_positions()] == [sorted(c) for c in layers[0].last_mask_columns()]
    assert all(len(p) == 12 for p in layers[0].last_selected_positions())


def test_layer_step_arguments_are_checked(rng):
    config = sp.BlockSparseConfig(num_qo_heads=4, num_kv_heads=2, head_dim=16, block_size=8, topk_blocks=2)
    layer = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, config, 1)
    f = lambda *s: np.zeros(s, np.float16)  # noqa: E731
    with pytest.raises(sp.Error, match=r"^BlockSparseAttention.decode: k must have shape \(1, 3, 1, 16\) "):
        layer.decode(f(1, 4, 16), f(1, 2, 16), f(1, 2, 1, 16), f(1, 2, 1, 16), f(1, 4, 16))
    with pytest.raises(sp.Error, match=r"^BlockSparseAttention.decode: q has dtype f32 but the layer stores f16$"):
        layer.decode(np.zeros((1, 4, 16), np.float32), f(1, 2, 16), f(1, 3, 1, 16), f(1, 2, 1, 16), f(1, 4, 16))
    with pytest.raises(sp.Error, match=r"^BlockSparseAttention: the cache stores f16 or bf16$"):
        sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f32, config, 1)


def test_append_tokens_equals_stepping_the_prompt(rng):
    """A prompt appended in one call (its prefill ran elsewhere) leaves the layers where decoding
    it token by token does: the next step's output is the same, and so is kv_len."""
    bs = sp.BlockSparseConfig(num_qo_heads=4, num_kv_heads=2, head_dim=16, block_size=8, topk_blocks=2,
                              local_blocks=1, capacity_step=32)
    B, L = 2, 40
    k = rng.standard_normal((B, 3, L, 16)).astype(np.float16)
    v = rng.standard_normal((B, 2, L, 16)).astype(np.float16)
    appended, stepped = (sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, bs, B, fused_and_mask(True))
                         for _ in range(2))
    appended.reserve(64)
    appended.append_tokens(k, v)
    for t in range(L):
        stepped.decode(np.zeros((B, 4, 16), np.float16), np.zeros((B, 2, 16), np.float16),
                       np.ascontiguousarray(k[:, :, t:t + 1]), np.ascontiguousarray(v[:, :, t:t + 1]),
                       np.empty((B, 4, 16), np.float16))
    assert appended.kv_len == stepped.kv_len == L
    args = [rng.standard_normal(s).astype(np.float16) for s in ((B, 4, 16), (B, 2, 16), (B, 3, 1, 16), (B, 2, 1, 16))]
    outs = [np.full((B, 4, 16), np.nan, np.float16) for _ in range(2)]
    for layer, o in zip((appended, stepped), outs):
        layer.decode(*args, o)
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(sp.Error, match=r"^BlockSparseAttention.append_tokens: v must have shape \(2, 2, 40, 16\) "):
        appended.append_tokens(k, v[:, :, :39].copy())

    dsa = sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=3, index_head_dim=8, index_topk=10,
                       capacity_step=32)
    rows = rng.standard_normal((B, 1, L, 40)).astype(np.float16)
    pe = rng.standard_normal((B, 1, L, 8)).astype(np.float16)
    a, s = (sp.DsaAttention(sp.Device.cpu, sp.DType.f16, dsa, B, fused_and_mask(True)) for _ in range(2))
    a.append_tokens(rows, pe)
    for t in range(L):
        s.decode(np.zeros((B, 4, 32), np.float16), np.zeros((B, 4, 8), np.float16), np.zeros((B, 3, 8), np.float16),
                 np.zeros((B, 3), np.float32), np.ascontiguousarray(rows[:, :, t:t + 1]),
                 np.ascontiguousarray(pe[:, :, t:t + 1]), np.empty((B, 4, 32), np.float16))
    assert a.kv_len == s.kv_len == L
    args = [rng.standard_normal(sh).astype(np.float16) for sh in ((B, 4, 32), (B, 4, 8), (B, 3, 8))]
    args += [rng.random((B, 3)).astype(np.float32), rng.standard_normal((B, 1, 1, 40)).astype(np.float16),
             rng.standard_normal((B, 1, 1, 8)).astype(np.float16)]
    outs = [np.full((B, 4, 32), np.nan, np.float16) for _ in range(2)]
    for layer, o in zip((a, s), outs):
        layer.decode(*args, o)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_static_layer_attends_each_heads_pattern(rng):
    # 4 query heads over 2 KV heads, blocks of 4, 2 local blocks, vertical stride 4:
    # the two query heads of a KV head keep different vertical blocks.
    config = sp.StaticBlockSparseConfig(num_qo_heads=4, num_kv_heads=2, head_dim=16, block_size=4, local_blocks=2,
                                        vert_stride=4, capacity_step=32)
    B, steps = 2, 43  # 43 tokens: a partial final block
    layers = [sp.StaticBlockSparseAttention(sp.Device.cpu, sp.DType.f16, config, B, fused_and_mask(on))
              for on in (True, False)]
    ks, vs = [], []
    for step in range(steps):
        q = rng.standard_normal((B, 4, 16)).astype(np.float16)
        k = rng.standard_normal((B, 2, 1, 16)).astype(np.float16)
        v = rng.standard_normal((B, 2, 1, 16)).astype(np.float16)
        ks.append(k)
        vs.append(v)
        outs = [np.full((B, 4, 16), np.nan, np.float16) for _ in layers]
        results = [layer.decode(q, k, v, o) for layer, o in zip(layers, outs)]
    assert layers[0].kv_len == steps
    assert results[0].fused and not results[1].fused
    assert results[1].outcome.kind == sp.OutcomeKind.kill_switch
    # Each query head attends exactly the blocks the rule keeps, and the mask path the same set.
    positions = layers[0].last_selected_positions()
    columns = layers[0].last_mask_columns()
    assert len(positions) == B * 4
    last_block = (steps - 1) // 4
    for r in range(B * 4):
        h = r % 4
        want = [t for t in range(steps) if config.keeps(h, last_block, t // 4)]
        assert sorted(positions[r]) == want, r
        assert sorted(columns[r]) == want, r
        assert len(want) == config.kept_tokens(h, steps)
    assert positions[0] != positions[1], "the query heads of one KV head keep different blocks"
    # Both paths against fp64 over the pattern's rows.
    K = np.concatenate(ks, axis=2)[:, :, :, :].astype(np.float64)  # [B, Hkv, T, D]
    V = np.concatenate(vs, axis=2).astype(np.float64)
    for b in range(B):
        for h in range(4):
            rows = positions[b * 4 + h]
            s = K[b, h // 2, rows] @ q[b, h].astype(np.float64) / np.sqrt(16)
            p = np.exp(s - s.max())
            ref = (p / p.sum()) @ V[b, h // 2, rows]
            for o in outs:
                np.testing.assert_allclose(o[b, h].astype(np.float64), ref, atol=3e-3, rtol=3e-3)


def test_static_layer_arguments_are_checked(rng):
    config = sp.StaticBlockSparseConfig(num_qo_heads=4, num_kv_heads=2, head_dim=16, block_size=4, local_blocks=2,
                                        vert_stride=4, capacity_step=32)
    layer = sp.StaticBlockSparseAttention(sp.Device.cpu, sp.DType.f16, config, 2)
    q = np.zeros((2, 4, 16), np.float16)
    k = np.zeros((2, 3, 1, 16), np.float16)  # one KV head too many
    v = np.zeros((2, 2, 1, 16), np.float16)
    o = np.zeros((2, 4, 16), np.float16)
    with pytest.raises(sp.Error, match=r"^StaticBlockSparseAttention.decode: k .*\[batch, num_kv_heads, 1, head_dim\]"):
        layer.decode(q, k, v, o)
    assert layer.kv_len == 0, "a refused step appends nothing"
