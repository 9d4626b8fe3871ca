"""The library's CPU merge of partial attention states (o, lse), natural log, through its
binding (sparsepage._core._merge_states: the oracle test_torch_ops checks torch_ops.merge_states
against)."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend, merge


def test_merging_chunk_states_gives_the_whole_attention(rng):
    # Prefix-shared (cascade) attention: each launch attends part of the rows.
    G, D, n = 4, 16, 90
    q = rng.standard_normal((G, D))
    k = rng.standard_normal((n, D))
    v = rng.standard_normal((n, D))
    cuts = [0, 30, 31, 90]
    parts = [attend(q, k[a:b], v[a:b], 0.3) for a, b in zip(cuts[:-1], cuts[1:])]
    o_parts = np.stack([p[0] for p in parts]).astype(np.float32)
    lse_parts = np.stack([p[1] for p in parts]).astype(np.float32)
    o = np.empty((G, D), np.float32)
    lse = np.empty(G, np.float32)
    sp._core._merge_states(o_parts, lse_parts, o, lse)
    ref_o, ref_lse = attend(q, k, v, 0.3)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-5)
    m_o, m_lse = merge(o_parts, lse_parts)
    np.testing.assert_allclose(o, m_o, rtol=1e-5, atol=1e-5)


def test_empty_states_weigh_nothing(rng):
    o_parts = rng.standard_normal((3, 2, 5, 8)).astype(np.float32)  # [S, batch, heads, D]
    lse_parts = rng.standard_normal((3, 2, 5)).astype(np.float32)
    lse_parts[1] = -np.inf  # one launch saw nothing
    lse_parts[:, 1, 2] = -np.inf  # one row saw nothing at all
    o = np.empty((2, 5, 8), np.float16)  # any float output dtype
    lse = np.empty((2, 5), np.float32)
    sp._core._merge_states(o_parts, lse_parts, o, lse)
    ref_o, ref_lse = merge(o_parts.reshape(3, 10, 8), lse_parts.reshape(3, 10))
    np.testing.assert_allclose(o.reshape(10, 8), ref_o, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse.reshape(10), ref_lse, rtol=1e-6)
    assert (o[1, 2] == 0).all() and np.isneginf(lse[1, 2])


def test_merge_shapes_are_checked():
    with pytest.raises(sp.Error, match=r"^merge_states: lse must be o's shape without its last dim, got \(2, 4\)$"):
        sp._core._merge_states(np.zeros((2, 3, 8), np.float32), np.zeros((2, 4), np.float32), np.zeros((3, 8), np.float32))
    with pytest.raises(sp.Error, match=r"^merge_states: lse has dtype float16; expected float32$"):
        sp._core._merge_states(np.zeros((2, 3, 8), np.float32), np.zeros((2, 3), np.float16), np.zeros((3, 8), np.float32))
