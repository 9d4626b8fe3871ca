"""The sparse decode entry point (outcome, stats, kill switch) and the mask path on the CPU."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend


def dense_case(rng, B=2, Hq=8, Hkv=2, cap=96, L=80, D=16, selected=12, dtype=np.float16, extra_k_heads=0):
    k = rng.standard_normal((B, Hkv + extra_k_heads, cap, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, cap, D)).astype(dtype)
    q = rng.standard_normal((B, Hq, D)).astype(dtype)
    picks = [np.sort(rng.choice(L, size=selected, replace=False)).astype(np.int32) for _ in range(B * Hkv)]
    return q, k, v, picks


def reference(q, k, v, picks, Hkv, scale):
    B, Hq, D = q.shape
    G = Hq // Hkv
    o = np.zeros((B, Hq, v.shape[-1]))
    for r, p in enumerate(picks):
        b, h = divmod(r, Hkv)
        o[b, h * G:(h + 1) * G], _ = attend(q[b, h * G:(h + 1) * G], k[b, h, p], v[b, h, p], scale)
    return o


def open_config():
    c = sp.DispatchConfig.defaults()
    c.min_kv_tokens = 0
    c.min_kv_tokens_per_request = 0
    c.min_sparsity = 0
    return c


def test_fused_outcome_output_and_stats(rng):
    q, k, v, picks = dense_case(rng)
    o = np.full((2, 8, 16), np.nan, np.float16)
    lse = np.empty((2, 8), np.float32)
    dec = sp.SparseDecoder(sp.Device.cpu, open_config())
    args = dict(num_kv_heads=2, live_len=80, scale=0.25)
    decision = dec.decide(q, k, v, o, np.concatenate(picks), [len(p) for p in picks], **args)
    assert decision.fused and decision.kind == sp.OutcomeKind.fused
    sp.reset_dispatch_stats()
    out = dec.try_fused(q, k, v, o, np.concatenate(picks), [len(p) for p in picks], lse=lse, **args)
    assert out.fused and out.requests == 4
    assert out.describe().startswith("fused sparse launch (4 request(s) x 12 selected rows")
    assert out.kernel == "CPU loop" and out.describe().endswith("; CPU loop)")
    stats = sp.dispatch_stats()
    assert stats.fused == 1 and stats.fallbacks == 0 and stats.by_kind["fused"] == 1
    np.testing.assert_allclose(o.astype(np.float64), reference(q, k, v, picks, 2, 0.25), atol=4e-3, rtol=4e-3)
    assert dec.plan.num_requests == 4 and dec.transient_bytes > 0


def test_kill_switch_declines_and_mask_path_agrees(rng):
    q, k, v, picks = dense_case(rng)
    config = open_config()
    config.enabled = False
    dec = sp.SparseDecoder(sp.Device.cpu, config)
    o = np.full((2, 8, 16), np.nan, np.float16)
    out = dec.try_fused(q, k, v, o, np.concatenate(picks), [len(p) for p in picks], num_kv_heads=2, live_len=80,
                        scale=0.25)
    assert not out.fused and out.kind == sp.OutcomeKind.kill_switch and out.reason
    assert np.isnan(o).all()  # nothing ran: the caller runs its mask path
    sp.MaskPath(sp.Device.cpu).run(q, k, v, o, np.concatenate(picks), [len(p) for p in picks], num_kv_heads=2,
                                   live_len=80, scale=0.25)
    np.testing.assert_allclose(o.astype(np.float64), reference(q, k, v, picks, 2, 0.25), atol=4e-3, rtol=4e-3)


def test_sparsity_gate_declines_with_its_numbers(rng):
    q, k, v, picks = dense_case(rng, selected=60)
    c = open_config()
    c.min_sparsity = 2
    out = sp.SparseDecoder(sp.Device.cpu, c).decide(q, k, v, np.empty((2, 8, 16), np.float16), np.concatenate(picks),
                                                    [60] * 4, num_kv_heads=2, live_len=80, scale=0.25)
    assert out.kind == sp.OutcomeKind.below_sparsity
    assert "80" in out.reason and "60" in out.reason


def test_extra_k_heads_fuse_at_batch_one_and_decline_by_name_above(rng):
    # A block-sparse cache's index key rides at head num_kv_heads of K (K one head wider than V):
    # K and V carry their own per-sequence strides, so every batch fuses.
    for batch in (1, 2, 3):
        q, k, v, picks = dense_case(rng, B=batch, extra_k_heads=1)
        o = np.full((batch, 8, 16), np.nan, np.float16)
        out = sp.SparseDecoder(sp.Device.cpu, open_config()).try_fused(
            q, k, v, o, np.concatenate(picks), [12] * (2 * batch), num_kv_heads=2, live_len=80, scale=0.25)
        assert out.fused, out.describe()
        np.testing.assert_allclose(o.astype(np.float64), reference(q, k, v, picks, 2, 0.25), atol=4e-3, rtol=4e-3)


def test_masked_decode_with_an_explicit_mask(rng):
    q, k, v, picks = dense_case(rng, dtype=np.float32)
    mask = np.full((4, 80), -np.inf, np.float32)
    for r, p in enumerate(picks):
        mask[r, p] = 0
    o = np.empty((2, 8, 16), np.float32)
    assert sp.masked_decode(q, k, v, o, num_kv_heads=2, live_len=80, scale=0.25, mask=mask) == 0
    np.testing.assert_allclose(o, reference(q, k, v, picks, 2, 0.25), atol=2e-5, rtol=2e-5)
    built = np.empty((4, 80), np.float32)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in picks])]).astype(np.int32)
    sp.build_selection_mask(np.concatenate(picks), offsets, 80, built)
    np.testing.assert_array_equal(built, mask)


def test_entry_point_errors_name_the_argument(rng):
    q, k, v, picks = dense_case(rng)
    dec = sp.SparseDecoder(sp.Device.cpu, open_config())
    o = np.empty((2, 8, 16), np.float16)
    with pytest.raises(sp.Error, match=r"^SparseDecoder.try_fused: positions holds 48 positions but counts sum to 47$"):
        dec.try_fused(q, k, v, o, np.concatenate(picks), [12, 12, 12, 11], num_kv_heads=2, live_len=80, scale=0.25)
    with pytest.raises(sp.Error, match=r"^sparse decode: num_qo_heads = 8 must be a positive multiple of num_kv_heads = 3$"):
        dec.try_fused(q, k, v, o, np.concatenate(picks)[:36], [12, 12, 12], num_kv_heads=3, live_len=80, scale=0.25)
    for heads in (0, 3):  # a head count of 0 once reached a division by zero (a crash, not an error)
        with pytest.raises(sp.Error, match=rf"num_qo_heads = 8 must be a positive multiple of num_kv_heads = {heads}$"):
            sp.masked_decode(q, k, v, o, num_kv_heads=heads, live_len=80, scale=0.25)
    # A live window longer than the cache tensors hold: the core refuses it by the rows' capacity.
    for fn in (lambda: dec.try_fused(q, k, v, o, np.concatenate(picks), [12] * 4, num_kv_heads=2, live_len=97,
                                     scale=0.25),
               lambda: sp.masked_decode(q, k, v, o, num_kv_heads=2, live_len=97, scale=0.25)):
        with pytest.raises(sp.Error, match=r": k: 97 rows per head exceed k.capacity = 96$"):
            fn()
    with pytest.raises(sp.Error, match=r"^SparseDecoder.try_fused: v has 1 heads, fewer than num_kv_heads = 2$"):
        dec.try_fused(q, k, v[:, :1], o, np.concatenate(picks), [12] * 4, num_kv_heads=2, live_len=80, scale=0.25)
    with pytest.raises(sp.Error, match=r"^decode: indices\[0\] = 85 names positions outside request 0's window of 80 tokens$"):
        bad = np.concatenate(picks)
        bad[0] = 85
        dec.try_fused(q, k, v, o, bad, [12] * 4, num_kv_heads=2, live_len=80, scale=0.25)
