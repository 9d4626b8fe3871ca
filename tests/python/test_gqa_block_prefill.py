"""The GQA block prefill from Python (sparsepage.GqaBlockPrefill) on the CPU backend with numpy
arrays: each query block of a chunk attends its kept key blocks, each token up to its own position.
Every (token, query head) output and lse is checked against fp64 attention over the positions its
list keeps, with every K/V row no list keeps NaN-poisoned and the outputs poisoned first: dense K/V
and an engine's pool behind a shuffled table, one list per KV head or per query head. Bad calls are
refused by name."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend

HQ, HKV, D, BS = 4, 2, 16, 8
G = HQ // HKV


def selection(rng, lens, tokens, per_query_head):
    """Kept blocks per list: some earlier full blocks, then the query block's own block last."""
    nqb = -(-tokens // BS)  # per KV head [B, nqb, HKV, width]; per query head [B, HKV, nqb, G, width]
    lists = (len(lens), HKV, nqb, G) if per_query_head else (len(lens), nqb, HKV)
    width = 4
    ids = np.full(lists + (width,), -1, np.int32)
    counts = np.zeros(lists, np.int32)
    for index in np.ndindex(*lists):
        b, i = index[0], index[2] if per_query_head else index[1]
        own = (lens[b] - tokens) // BS + i  # the query block's own key block
        earlier = rng.permutation(own)[: rng.integers(0, min(own, width - 1) + 1)]
        kept = [int(x) for x in earlier] + [own]
        ids[index][: len(kept)] = kept
        counts[index] = (len(kept) - 1) * BS + min(BS, lens[b] - own * BS)
    return ids, counts


def reference(q, keys, vals, ids, counts, lens, tokens, scale):
    """fp64 out [B, T, HQ, D] and lse [B, T, HQ]; also the rows any list keeps, per (b, kv head)."""
    batch = len(lens)
    out, lse = np.zeros((batch, tokens, HQ, D)), np.zeros((batch, tokens, HQ))
    kept_rows = set()
    for b in range(batch):
        for t in range(tokens):
            pos, i = lens[b] - tokens + t, t // BS
            for h in range(HQ):
                kv = h // G
                index = (b, kv, i, h % G) if ids.ndim == 5 else (b, i, kv)
                rows = [j * BS + r for j in ids[index][: -(-counts[index] // BS)] for r in range(BS)]
                rows = [p for p in rows if p <= pos and p < lens[b]]
                kept_rows.update((b, kv, p) for p in rows)
                o, lse_row = attend(q[b, t, h][None].astype(np.float64), keys[b, kv, rows].astype(np.float64),
                              vals[b, kv, rows].astype(np.float64), scale)
                out[b, t, h], lse[b, t, h] = o[0], lse_row[0]
    return out, lse, kept_rows


@pytest.mark.parametrize("per_query_head", [False, True], ids=["per-kv-head", "per-query-head"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "pool"])
def test_each_token_attends_its_kept_blocks_up_to_its_position(rng, paged, per_query_head):
    lens, tokens, scale = [45, 29], 13, 0.3  # chunks start at 32 and 16: on the block grid
    batch, cap = len(lens), 48
    keys = rng.standard_normal((batch, HKV, cap, D)).astype(np.float16)
    vals = rng.standard_normal((batch, HKV, cap, D)).astype(np.float16)
    q = rng.standard_normal((batch, tokens, HQ, D)).astype(np.float16)
    ids, counts = selection(rng, lens, tokens, per_query_head)
    want_o, want_lse, kept = reference(q, keys.astype(np.float32), vals.astype(np.float32), ids, counts, lens, tokens,
                                       scale)
    for b, kv, p in np.ndindex(batch, HKV, cap):  # every row no list keeps is NaN
        if (b, kv, p) not in kept:
            keys[b, kv, p] = vals[b, kv, p] = np.nan
    o = np.full((batch, tokens, HQ, D), np.nan, np.float16)
    lse = np.full((batch, tokens, HQ), np.nan, np.float32)
    prefill = sp.GqaBlockPrefill(sp.Device.cpu)
    kw = dict(block_size=BS, scale=scale, kv_len=max(lens), kv_lens=np.array(lens, np.int32), lse=lse)
    if paged:
        max_blocks = cap // BS
        num_blocks = batch * max_blocks + 2
        table = rng.permutation(num_blocks)[: batch * max_blocks].astype(np.int32).reshape(batch, max_blocks)
        k_pool = np.full((num_blocks, BS, HKV, D), np.nan, np.float16)
        v_pool = np.full_like(k_pool, np.nan)
        for b in range(batch):
            for p in range(cap):
                k_pool[table[b, p // BS], p % BS] = keys[b, :, p]
                v_pool[table[b, p // BS], p % BS] = vals[b, :, p]
        prefill.run(q, k_pool, v_pool, o, ids, counts, block_table=table, **kw)
    else:
        prefill.run(q, keys, vals, o, ids, counts, **kw)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(o.astype(np.float64), want_o, atol=2e-3, rtol=1e-2)
    np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-4)


def test_bad_calls_are_refused_by_name(rng):
    lens, tokens = [24], 8
    keys = rng.standard_normal((1, HKV, 24, D)).astype(np.float16)
    q = rng.standard_normal((1, tokens, HQ, D)).astype(np.float16)
    o = np.zeros_like(q)
    ids, counts = selection(rng, lens, tokens, False)
    run = sp.GqaBlockPrefill(sp.Device.cpu).run
    kw = dict(block_size=BS, scale=0.3, kv_len=24)
    bytes_ = np.zeros((1, HKV, 24, D), np.uint8)
    with pytest.raises(sp.Error, match="e4m3 K/V \\(uint8\\) need k_scale and v_scale"):
        run(q, bytes_, bytes_, o, ids, counts, **kw)
    with pytest.raises(sp.Error, match="k and v must both be e4m3 bytes"):
        run(q, bytes_, keys, o, ids, counts, **kw)
    with pytest.raises(sp.Error, match="k_scale and v_scale go with e4m3 K/V"):
        run(q, keys, keys, o, ids, counts, k_scale=np.ones(HKV, np.float32), v_scale=np.ones(HKV, np.float32), **kw)
    with pytest.raises(sp.Error, match=r"block_ids must be \[batch, num_query_blocks, num_kv_heads, width\]"):
        run(q, keys, keys, o, ids[:, :, :1], counts[:, :, :1], **kw)
    with pytest.raises(sp.Error, match="counts must be block_ids' shape without its width"):
        run(q, keys, keys, o, ids, counts[..., None], **kw)
    with pytest.raises(sp.Error, match=r"o must have shape"):
        run(q, keys, keys, o[:, :4], ids, counts, **kw)
    with pytest.raises(sp.Error, match="block"):  # a chunk start off the block grid (L_b - num_tokens = 17)
        run(q, keys, keys, o, ids, counts, block_size=BS, scale=0.3, kv_len=25)


def e4m3_to_float(b):
    b = np.asarray(b, np.uint8).astype(np.int32)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    mag = np.where(exp == 0, np.ldexp(man / 8.0, -6), np.ldexp(1.0 + man / 8.0, exp - 7))
    return np.where((exp == 0xF) & (man == 7), np.nan, sign * mag)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "pool"])
def test_e4m3_rows_give_the_native_call_bits_over_the_dequantized_values(rng, paged):
    """vLLM's fp8 KV cache: e4m3 K and V with one power-of-two scale per KV head. Dequantized into f16
    (exact), the native call over those values must give the same bits."""
    lens, tokens, scale = [45, 29], 13, 0.3
    batch, cap = len(lens), 48
    codes = lambda: rng.choice(np.setdiff1d(np.arange(256), [0x7F, 0xFF]), (batch, HKV, cap, D)).astype(np.uint8)  # noqa: E731
    k8, v8 = codes(), codes()
    k_scale = (2.0 ** rng.integers(-6, -2, HKV)).astype(np.float32)
    v_scale = (2.0 ** rng.integers(-6, -2, HKV)).astype(np.float32)
    keys = (e4m3_to_float(k8) * k_scale[None, :, None, None]).astype(np.float16)
    vals = (e4m3_to_float(v8) * v_scale[None, :, None, None]).astype(np.float16)
    q = rng.standard_normal((batch, tokens, HQ, D)).astype(np.float16)
    ids, counts = selection(rng, lens, tokens, False)
    kw = dict(block_size=BS, scale=scale, kv_len=max(lens), kv_lens=np.array(lens, np.int32))
    outs = []
    for fp8 in (False, True):
        k, v = (k8, v8) if fp8 else (keys, vals)
        extra = dict(k_scale=k_scale, v_scale=v_scale) if fp8 else {}
        o = np.full((batch, tokens, HQ, D), np.nan, np.float16)
        lse = np.full((batch, tokens, HQ), np.nan, np.float32)
        if paged:
            max_blocks = cap // BS
            table = np.arange(batch * max_blocks, dtype=np.int32)[::-1].reshape(batch, max_blocks).copy()
            k_pool = np.zeros((batch * max_blocks, BS, HKV, D), k.dtype)
            v_pool = np.zeros_like(k_pool)
            for b in range(batch):
                for p in range(cap):
                    k_pool[table[b, p // BS], p % BS] = k[b, :, p]
                    v_pool[table[b, p // BS], p % BS] = v[b, :, p]
            sp.GqaBlockPrefill(sp.Device.cpu).run(q, k_pool, v_pool, o, ids, counts, block_table=table, lse=lse,
                                                  **kw, **extra)
        else:
            sp.GqaBlockPrefill(sp.Device.cpu).run(q, k, v, o, ids, counts, lse=lse, **kw, **extra)
        outs.append((o, lse))
    (o_native, lse_native), (o_fp8, lse_fp8) = outs
    assert np.isfinite(o_fp8).all()
    np.testing.assert_array_equal(o_fp8.view(np.uint16), o_native.view(np.uint16))
    np.testing.assert_array_equal(lse_fp8, lse_native)
    swapped = dict(k_scale=v_scale, v_scale=k_scale)  # scales swapped: a different answer
    if not np.array_equal(k_scale, v_scale):
        o = np.full_like(o_fp8, np.nan)
        sp.GqaBlockPrefill(sp.Device.cpu).run(q, k8, v8, o, ids, counts, **kw, **swapped)
        assert not np.array_equal(o.view(np.uint16), o_fp8.view(np.uint16))
