"""The paged decode binding (sparsepage._core._paged_decode, what torch_ops and the engine helpers
launch) over numpy arrays against the fp64 reference."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend, paged_rows, tolerance


def run_case(rng, dtype, *, num_requests=5, group=4, dqk=32, dv=32, page_size=4, pool_pages=40, row_pad=0,
             v_aliases_k=False, lens=None, fixed_chunk=0, offsets=False, with_lse=True, extra_dim=0):
    lens = np.asarray(lens if lens is not None else rng.integers(0, 90, size=num_requests), np.int32)
    num_requests = len(lens)
    fpo = rng.integers(0, page_size, size=num_requests).astype(np.int32) if offsets else None
    t = sp.build_page_table_structure(lens, page_size, fpo)
    indices = rng.integers(0, pool_pages, size=t.num_pages).astype(np.int32)  # duplicates and any order
    rows = pool_pages * page_size
    width = max(dqk, dv) + row_pad
    kbuf = rng.standard_normal((rows, width)).astype(dtype)
    k = kbuf[:, :dqk]
    v = kbuf[:, :dv] if v_aliases_k else rng.standard_normal((rows, dv + row_pad)).astype(dtype)[:, :dv]
    q = rng.standard_normal((num_requests, group, dqk)).astype(dtype)
    q_extra = k_extra = None
    if extra_dim:
        q_extra = rng.standard_normal((num_requests, group, extra_dim)).astype(dtype)
        k_extra = rng.standard_normal((rows, extra_dim)).astype(dtype)
    o = np.full((num_requests, group, dv), np.nan, dtype)
    lse = np.full((num_requests, group), np.nan, np.float32) if with_lse else None
    plan = sp.make_decode_plan(lens, sp.PlanShape(group_size=group, head_dim_v=dv, num_sms=3,
                                                  fixed_chunk_tokens=fixed_chunk))
    scale = 1.0 / np.sqrt(dqk + extra_dim)
    sp._core._paged_decode(plan, q, k, v, o, t.indptr, indices, t.seq_lens, page_size=page_size, scale=scale,
                    first_page_offset=fpo, lse=lse, q_extra=q_extra, k_extra=k_extra)
    tol = tolerance(dtype)
    for r, rows_r in enumerate(paged_rows(t.indptr, indices, lens, page_size, fpo)):
        ref_o, ref_lse = attend(q[r], k[rows_r], v[rows_r], scale,
                                None if q_extra is None else q_extra[r], None if k_extra is None else k_extra[rows_r])
        np.testing.assert_allclose(o[r].astype(np.float64), ref_o, rtol=tol, atol=tol)
        if with_lse:
            np.testing.assert_allclose(lse[r], ref_lse, rtol=1e-5, atol=tol)
    return plan, o, lse


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_paged_pool_with_gqa_groups(rng, dtype):
    run_case(rng, dtype, group=4)


def test_first_page_offsets_and_a_split_plan_agree(rng):
    plan, o, lse = run_case(rng, np.float32, lens=[200, 3, 131, 0], fixed_chunk=64, offsets=True)
    assert plan.needs_merge


def test_strided_pools_and_v_aliasing_k(rng):
    # K rows are a column slice of wider rows; V is K's first columns (as in MLA).
    run_case(rng, np.float32, dqk=48, dv=32, row_pad=16, v_aliases_k=True)


def test_second_k_stream_mla_shape(rng):
    # The MLA shape: latent 512 (V = K's columns), rope 64 as the second stream, one KV head.
    run_case(rng, np.float32, num_requests=2, group=8, dqk=512, dv=512, extra_dim=64, page_size=1,
             pool_pages=300, v_aliases_k=True, lens=[150, 61])


def test_empty_requests_write_zero_and_minus_inf(rng):
    _, o, lse = run_case(rng, np.float32, lens=[0, 7, 0])
    assert (o[0] == 0).all() and (o[2] == 0).all()
    assert np.isneginf(lse[0]).all() and np.isneginf(lse[2]).all()


def test_dense_cache_window_mode(rng):
    # A [B, H, Cap, D] allocation with slack (Cap > L): page ids are window positions.
    B, H, cap, L, D, G = 2, 3, 64, 50, 16, 2
    kc = rng.standard_normal((B, H, cap, D)).astype(np.float32)
    vc = rng.standard_normal((B, H, cap, D)).astype(np.float32)
    kc[:, :, L:] = np.nan  # slack past the live window is never read
    vc[:, :, L:] = np.nan
    picks = [np.sort(rng.choice(L, size=20, replace=False)).astype(np.int32) for _ in range(B * H)]
    counts = [len(p) for p in picks]
    t = sp.build_page_table_structure(counts, 1)
    q = rng.standard_normal((B * H, G, D)).astype(np.float32)
    o = np.empty((B * H, G, D), np.float32)
    plan = sp.make_decode_plan(counts, sp.PlanShape(group_size=G, head_dim_v=D, num_sms=2))
    sp._core._paged_decode(plan, q, kc, vc, o, t.indptr, np.concatenate(picks), t.seq_lens, page_size=1, scale=0.25,
                    request_row_stride=cap, window_len=L)
    for r in range(B * H):
        b, h = divmod(r, H)
        ref, _ = attend(q[r], kc[b, h, picks[r]], vc[b, h, picks[r]], 0.25)
        np.testing.assert_allclose(o[r], ref, rtol=2e-5, atol=2e-5)


def test_strided_q_and_o(rng):
    # q is a slice of a packed QKV tensor [R, G * 3 * 8] seen as [R, G, 3 * 8]; o a column slice
    # of a wider buffer whose other columns must stay untouched.
    lens = [9, 0, 30]
    t = sp.build_page_table_structure(lens, 1)
    plan = sp.make_decode_plan(lens, sp.PlanShape(group_size=2, head_dim_v=8, num_sms=2))
    packed = rng.standard_normal((3, 2, 3 * 8)).astype(np.float32)
    q = packed[:, :, :8]
    k = rng.standard_normal((40, 8)).astype(np.float32)
    v = rng.standard_normal((40, 8)).astype(np.float32)
    indices = rng.integers(0, 40, size=t.num_pages).astype(np.int32)
    wide = np.full((3, 2, 12), np.nan, np.float32)
    sp._core._paged_decode(plan, q, k, v, wide[:, :, 2:10], t.indptr, indices, t.seq_lens, page_size=1, scale=0.3)
    for r, rows in enumerate(paged_rows(t.indptr, indices, lens, 1)):
        ref, _ = attend(q[r], k[rows], v[rows], 0.3)
        np.testing.assert_allclose(wide[r, :, 2:10], ref, rtol=2e-5, atol=2e-5)
    assert np.isnan(wide[:, :, :2]).all() and np.isnan(wide[:, :, 10:]).all()


def bad_call(**overrides):
    t = sp.build_page_table_structure([4, 2], 2)
    args = dict(plan=sp.make_decode_plan([4, 2], sp.PlanShape(group_size=2, head_dim_v=8, num_sms=1)),
                q=np.zeros((2, 2, 8), np.float32), k=np.zeros((10, 8), np.float32), v=np.zeros((10, 8), np.float32),
                o=np.zeros((2, 2, 8), np.float32), indptr=t.indptr, indices=np.array([0, 1, 2], np.int32),
                seq_lens=t.seq_lens)
    kw = dict(page_size=2, scale=1.0)
    for key, value in overrides.items():
        (args if key in args else kw)[key] = value
    sp._core._paged_decode(*args.values(), **kw)


def test_bad_inputs_raise_with_the_exact_message():
    bad_call()  # the baseline is valid
    with pytest.raises(sp.Error, match=r"^decode: indices\[2\] = 5 is outside the pool \[0, 5\)$"):
        bad_call(indices=np.array([0, 1, 5], np.int32))
    with pytest.raises(sp.Error, match=r"^paged_decode: k has dtype f16 but q has f32$"):
        bad_call(k=np.zeros((10, 8), np.float16))
    with pytest.raises(sp.Error, match=r"^paged_decode: indices has dtype int64; expected int32$"):
        bad_call(indices=np.array([0, 1, 2], np.int64))
    with pytest.raises(sp.Error, match=r"^paged_decode: o must have shape \(2, 2, 8\) "):
        bad_call(o=np.zeros((2, 2, 4), np.float32))
    # A plan serves any count up to the one it was made for (a step's bound), never more.
    with pytest.raises(sp.Error, match=r"^decode: seq_lens\[1\] = 3 must lie in \[0, 2\], the count the plan was made for$"):
        t = sp.build_page_table_structure([4, 3], 2)
        bad_call(seq_lens=t.seq_lens)
    with pytest.raises(sp.Error, match=r"^paged_decode: indices holds 2 page ids but indptr\[num_requests\] = 3$"):
        bad_call(indices=np.array([0, 1], np.int32))
    with pytest.raises(sp.Error, match=r"^paged_decode: q has head_dim 4 but k's rows are 8 wide$"):
        bad_call(q=np.zeros((2, 2, 4), np.float32))


def test_a_plan_as_data_round_trips_and_runs(rng):
    """The plan's serialized form (what the torch ops take): rebuilt, it is the same plan and
    drives the same decode; a corrupted or truncated blob is refused by name."""
    lens = [0, 5, 300, 77, 16, 513]
    plan = sp.make_decode_plan(lens, sp.PlanShape(group_size=2, head_dim_v=8, num_sms=3, fixed_chunk_tokens=64))
    words = sp.serialize_decode_plan(plan)
    assert words.dtype == np.int64 and words.ndim == 1
    back = sp.deserialize_decode_plan(words)
    assert back.needs_merge and back.num_partials == plan.num_partials
    np.testing.assert_array_equal(back.work, plan.work)
    np.testing.assert_array_equal(back.seq_lens, plan.seq_lens)
    np.testing.assert_array_equal(sp.serialize_decode_plan(back), words)
    t = sp.build_page_table_structure(lens, 16)
    indices = rng.integers(0, 40, t.num_pages).astype(np.int32)
    k = rng.standard_normal((40 * 16, 8)).astype(np.float32)
    q = rng.standard_normal((6, 2, 8)).astype(np.float32)
    outs = []
    for p in (plan, back):
        o = np.full((6, 2, 8), np.nan, np.float32)
        sp._core._paged_decode(p, q, k, k, o, t.indptr, indices, t.seq_lens, page_size=16, scale=0.3)
        outs.append(o)
    np.testing.assert_array_equal(outs[0], outs[1])

    with pytest.raises(sp.Error, match=r"^deserialize_decode_plan: .*truncated or padded"):
        sp.deserialize_decode_plan(words[:-1])
    bad = words.copy()
    bad[0] += 1
    with pytest.raises(sp.Error, match=r"magic number"):
        sp.deserialize_decode_plan(bad)
    bad = words.copy()
    bad[21] += 3  # work[0].token_begin: the plan's own check names it
    with pytest.raises(sp.Error, match=r"^deserialize_decode_plan: plan: work\["):
        sp.deserialize_decode_plan(bad)
    with pytest.raises(sp.Error, match=r"words has dtype int32; expected int64"):
        sp.deserialize_decode_plan(words.astype(np.int32))
