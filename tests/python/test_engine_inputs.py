"""The engines' own inputs through the decode binding (sparsepage._core._paged_decode, what
torch_ops.paged_decode_out and the engine helpers launch) on the CPU (numpy), against fp64:
an index matrix instead of a CSR table (vLLM / SGLang's [num_tokens, topk] slot ids with -1
padding and topk_length), request-local positions resolved through a block table, a block table
as the page ids of [num_blocks, block_size, num_kv_heads, head_dim] pools with GQA folding, and
q / o as strided views. Unused pool rows are NaN. Then the new arguments' errors, exactly."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend


def cpu_plan(counts, group, dv):
    return sp.make_decode_plan(counts, sp.PlanShape(group_size=group, head_dim_v=dv, num_sms=3,
                                                    fixed_chunk_tokens=16, chunk_granule=1))


def nan_pool(rng, shape, used_rows, dtype=np.float32):
    """A pool of `shape` whose leading-dims rows in `used_rows` hold values, the rest NaN."""
    pool = np.full(shape, np.nan, dtype)
    flat = pool.reshape(-1, *shape[2:]) if len(shape) > 2 else pool
    for r in set(int(x) for x in used_rows):
        flat[r] = rng.standard_normal(shape[2:]).astype(dtype)
    return pool


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_block_table_pages_with_gqa_and_qkv_slice(rng, block_size):
    """Dense paged attention: block_tables [S, max_blocks] are the page ids (page_size = block
    size), per-sequence seq_lens, K/V pools [num_blocks, block_size, Hkv, D], q a slice of a
    packed QKV tensor, o a column slice of a wider buffer."""
    S, Hkv, G, D, num_blocks, max_blocks = 3, 2, 4, 16, 24, 5
    Hq = Hkv * G
    lens = np.array([max_blocks * block_size - 3, 0, block_size + 1], np.int32)
    tables = np.stack([rng.permutation(num_blocks)[:max_blocks] for _ in range(S)]).astype(np.int32)
    tables[1, :] = 2 ** 30  # blocks past a sequence's length are never read
    tables[2, 2:] = -7
    slots = [tables[b, np.arange(lens[b]) // block_size] * block_size + np.arange(lens[b]) % block_size
             for b in range(S)]
    used = np.concatenate(slots)
    k_cache = nan_pool(rng, (num_blocks, block_size, Hkv, D), used)
    v_cache = nan_pool(rng, (num_blocks, block_size, Hkv, D), used)
    qkv = rng.standard_normal((S, (Hq + 2 * Hkv) * D)).astype(np.float32)
    q = qkv[:, :Hq * D].reshape(S, Hq, D)
    wide = np.full((S, Hq, D + 8), np.nan, np.float32)
    o = wide[:, :, 4:4 + D]
    lse = np.full((S, Hq), np.nan, np.float32)
    plan = cpu_plan([max_blocks * block_size] * (S * Hkv), G, D)
    sp._core._paged_decode(plan, q, k_cache, v_cache, o, None, tables, lens, page_size=block_size, scale=0.2, lse=lse,
                    num_kv_heads=Hkv)
    flat_k, flat_v = k_cache.reshape(-1, Hkv, D), v_cache.reshape(-1, Hkv, D)
    for b in range(S):
        for h in range(Hkv):
            heads = slice(h * G, (h + 1) * G)
            ref, ref_lse = attend(q[b, heads], flat_k[slots[b], h], flat_v[slots[b], h], 0.2)
            np.testing.assert_allclose(o[b, heads], ref, rtol=3e-5, atol=3e-5)
            np.testing.assert_allclose(lse[b, heads], ref_lse, rtol=1e-5, atol=1e-5)
    assert (o[1] == 0).all() and np.isneginf(lse[1]).all()
    assert np.isnan(wide[:, :, :4]).all() and np.isnan(wide[:, :, 4 + D:]).all()


def mla_case(rng, T=4, H=8, topk=24, num_blocks=10, block_size=16):
    qbuf = rng.standard_normal((T, H, 576)).astype(np.float32)  # q_latent and q_pe: column slices of one tensor
    return qbuf, qbuf[..., :512], qbuf[..., 512:]


def test_slot_id_matrix_with_minus_one_and_topk_length(rng):
    T, H, topk, num_blocks, bs = 4, 8, 24, 10, 16
    _, q_lat, q_pe = mla_case(rng, T, H, topk)
    slots = rng.integers(0, num_blocks * bs, size=(T, topk)).astype(np.int32)
    slots[0, ::3] = -1
    slots[3] = -1  # nothing selected
    topk_length = np.array([topk, 10, 0, topk], np.int32)
    kept = [row[:n][row[:n] >= 0] for row, n in zip(slots, topk_length)]
    kv = nan_pool(rng, (num_blocks, bs, 576), np.concatenate(kept))
    o = np.full((T, H, 512), np.nan, np.float32)
    lse = np.full((T, H), np.nan, np.float32)
    plan = cpu_plan([topk] * T, H, 512)
    sp._core._paged_decode(plan, q_lat, kv[..., :512], kv[..., :512], o, None, slots, topk_length, page_size=1,
                    scale=576 ** -0.5, lse=lse, q_extra=q_pe, k_extra=kv[..., 512:], skip_minus_one=True)
    rows = kv.reshape(-1, 576)
    for t in range(T):
        if len(kept[t]) == 0:
            assert (o[t] == 0).all() and np.isneginf(lse[t]).all()
            continue
        ref, ref_lse = attend(q_lat[t], rows[kept[t], :512], rows[kept[t], :512], 576 ** -0.5, q_pe[t],
                              rows[kept[t], 512:])
        np.testing.assert_allclose(o[t], ref, rtol=3e-5, atol=3e-5)
        np.testing.assert_allclose(lse[t], ref_lse, rtol=1e-5)


def test_positions_through_a_block_table_with_token_rows(rng):
    T, H, topk, num_blocks, bs = 3, 4, 20, 12, 16
    _, q_lat, q_pe = mla_case(rng, T, H, topk)
    table = np.array([[5, 2, 9], [11, 0, 7], [1, 3, 4]], np.int32)
    token_to_request = np.array([2, 0, 0], np.int32)  # two tokens of request 0
    positions = rng.integers(0, 48, size=(T, topk)).astype(np.int32)
    positions[1, 15:] = -1
    kept = []
    for t in range(T):
        p = positions[t][positions[t] >= 0]
        kept.append(table[token_to_request[t], p // bs] * bs + p % bs)
    kv = nan_pool(rng, (num_blocks, bs, 576), np.concatenate(kept))
    o = np.full((T, H, 512), np.nan, np.float32)
    plan = cpu_plan([topk] * T, H, 512)
    sp._core._paged_decode(plan, q_lat, kv[..., :512], kv[..., :512], o, None, positions, None, page_size=1, scale=0.05,
                    q_extra=q_pe, k_extra=kv[..., 512:], skip_minus_one=True, block_table=table,
                    block_table_rows=token_to_request, block_size=bs)
    rows = kv.reshape(-1, 576)
    for t in range(T):
        ref, _ = attend(q_lat[t], rows[kept[t], :512], rows[kept[t], :512], 0.05, q_pe[t], rows[kept[t], 512:])
        np.testing.assert_allclose(o[t], ref, rtol=3e-5, atol=3e-5)


def engine_call(**overrides):
    """A valid MLA-slots call on small shapes; keyword overrides replace its arguments."""
    T, H, nb, bs = 2, 2, 4, 4
    args = dict(plan=cpu_plan([3, 3], H, 8), q=np.zeros((T, H, 8), np.float32),
                k=np.zeros((nb, bs, 8), np.float32), v=np.zeros((nb, bs, 8), np.float32),
                o=np.zeros((T, H, 8), np.float32), indptr=None,
                indices=np.array([[0, -1, 5], [15, 2, -1]], np.int32), seq_lens=None)
    kw = dict(page_size=1, scale=1.0, skip_minus_one=True)
    for key, value in overrides.items():
        (args if key in args else kw)[key] = value
    sp._core._paged_decode(*args.values(), **kw)


def test_engine_arguments_raise_with_the_exact_message():
    engine_call()  # the baseline is valid
    with pytest.raises(sp.Error, match=r"^decode: indices\[1\] = -2 is outside the pool \[0, 16\)$"):
        engine_call(indices=np.array([[0, -2, 5], [15, 2, -1]], np.int32))
    with pytest.raises(sp.Error, match=r"^decode: indices\[1\] = -1 is outside the pool \[0, 16\)$"):
        engine_call(skip_minus_one=False)
    with pytest.raises(sp.Error, match=r"^paged_decode: indices has 3 rows but q has 2 sequences$"):
        engine_call(indices=np.zeros((3, 3), np.int32))
    with pytest.raises(sp.Error, match=r"^paged_decode: indices must be an index matrix \[num_sequences, width\] "):
        engine_call(indices=np.zeros(6, np.int32))
    with pytest.raises(sp.Error, match=r"^decode: request 0 needs 3 pages \(first_page_offset 0, seq_len 3\) but "
                                       r"index_width is 2$"):
        engine_call(indices=np.zeros((2, 2), np.int32))
    with pytest.raises(sp.Error, match=r"^paged_decode: seq_lens must have shape \(2,\) \[num_requests\] or "):
        engine_call(seq_lens=np.zeros(3, np.int32))
    with pytest.raises(sp.Error, match=r"^decode: seq_lens\[1\] = 4 must lie in \[0, 3\], the count the plan was "
                                       r"made for$"):
        engine_call(seq_lens=np.array([3, 4], np.int32))
    with pytest.raises(sp.Error, match=r"^paged_decode: block_table_rows needs a block_table$"):
        engine_call(block_table_rows=np.zeros(2, np.int32))
    with pytest.raises(sp.Error, match=r"^paged_decode: block_table needs block_size >= 1 "):
        engine_call(block_table=np.zeros((2, 2), np.int32))
    table = np.array([[0, 1], [2, 9]], np.int32)
    with pytest.raises(sp.Error, match=r"^decode: block 9 \(block table entry 1 of request 1's row, reached through "
                                       r"indices\[4\] = 5\) is outside the pool's 4 blocks$"):
        engine_call(block_table=table, block_size=4, indices=np.array([[0, -1, 5], [1, 5, -1]], np.int32))
    with pytest.raises(sp.Error, match=r"^decode: indices\[2\] = 8 names positions of request 0 outside its block "
                                       r"table row of 2 blocks x 4 positions$"):
        engine_call(block_table=table, block_size=4, indices=np.array([[0, -1, 8], [1, 2, -1]], np.int32))
    with pytest.raises(sp.Error, match=r"^decode: block_table.row_of_sequence\[1\] = 2 is outside the table's 2 rows$"):
        engine_call(block_table=table, block_size=4, block_table_rows=np.array([0, 2], np.int32),
                    indices=np.array([[0, -1, 1], [1, 2, -1]], np.int32))
    # GQA: pools need the head dim, q's heads must divide.
    with pytest.raises(sp.Error, match=r"^paged_decode: q has 2 heads, not a multiple of num_kv_heads = 4$"):
        engine_call(num_kv_heads=4)
    with pytest.raises(sp.Error, match=r"^paged_decode: k must be \[\.\.\., num_kv_heads = 2, head_dim\] "):
        engine_call(num_kv_heads=2, plan=cpu_plan([3] * 4, 1, 8))
    # An output view whose heads overlap would have two writers per element.
    o = np.zeros((2, 2, 8), np.float32)
    overlapping = np.lib.stride_tricks.as_strided(o, shape=(2, 2, 8), strides=(64, 16, 4))
    with pytest.raises(sp.Error, match=r"^decode: o_strides \(seq_stride 16, head_stride 4\) make the output rows "
                                       r"of 8 elements overlap$"):
        engine_call(o=overlapping)
