"""Engine-native inputs on the CPU: MLA paged latent cache with -1 padded slot ids and
topk_length, request-local positions through a block table, and
[num_blocks, block_size, num_kv_heads, head_dim] caches through block tables."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend


def mla_case(rng, T=3, H=8, topk=16, num_blocks=12, block_size=16):
    kv = rng.standard_normal((num_blocks, block_size, 576)).astype(np.float32)
    q_lat = rng.standard_normal((T, H, 512)).astype(np.float32)
    q_pe = rng.standard_normal((T, H, 64)).astype(np.float32)
    slots = rng.integers(0, num_blocks * block_size, size=(T, topk)).astype(np.int32)
    return kv, q_lat, q_pe, slots


def mla_reference(kv, q_lat, q_pe, slot_rows, scale):
    rows = kv.reshape(-1, 576)
    o = np.zeros((q_lat.shape[0], q_lat.shape[1], 512))
    lse = np.zeros(q_lat.shape[:2])
    for t, s in enumerate(slot_rows):
        o[t], lse[t] = attend(q_lat[t], rows[s, :512], rows[s, :512], scale, q_pe[t], rows[s, 512:])
    return o, lse


def test_mla_slot_ids_skip_minus_one_and_honour_topk_length(rng):
    kv, q_lat, q_pe, slots = mla_case(rng)
    slots[0, 3] = -1
    slots[0, 10:] = -1
    slots[2, :] = -1  # a token with nothing selected
    topk_length = np.array([16, 9, 16], np.int32)
    scale = 1 / np.sqrt(576)
    lse = np.empty((3, 8), np.float32)
    o, _ = sp.engine.mla_decode_slots(q_lat, q_pe, kv, slots, scale=scale, topk_length=topk_length, lse=lse)
    kept = [slots[0][slots[0] >= 0], slots[1, :9], slots[2][:0]]
    ref_o, ref_lse = mla_reference(kv, q_lat, q_pe, kept, scale)
    np.testing.assert_allclose(o, ref_o, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(lse[:2], ref_lse[:2], rtol=1e-5)
    assert (o[2] == 0).all() and np.isneginf(lse[2]).all()


def test_mla_positions_resolve_through_the_block_table(rng):
    kv, q_lat, q_pe, _ = mla_case(rng, T=2)
    block_table = np.array([[5, 2, 9], [11, 0, 7]], np.int32)
    positions = rng.integers(0, 48, size=(2, 16)).astype(np.int32)
    positions[1, 12:] = -1
    o, _ = sp.engine.mla_decode_positions(q_lat, q_pe, kv, positions, block_table, np.array([0, 1], np.int32),
                                          scale=0.05)
    slot_rows = []
    for t in range(2):
        p = positions[t][positions[t] >= 0]
        slot_rows.append(block_table[t, p // 16] * 16 + p % 16)
    ref_o, _ = mla_reference(kv, q_lat, q_pe, slot_rows, 0.05)
    np.testing.assert_allclose(o, ref_o, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_engine_paged_kv_layout_with_gqa(rng, block_size):
    B, Hq, Hkv, D, num_blocks = 3, 8, 2, 32, 10
    k_cache = rng.standard_normal((num_blocks, block_size, Hkv, D)).astype(np.float16)
    v_cache = rng.standard_normal((num_blocks, block_size, Hkv, D)).astype(np.float16)
    seq_lens = np.array([block_size * 2 + 5, 0, 17], np.int32)
    block_tables = np.array([[7, 1, 4], [0, 0, 0], [9, 3, 3]], np.int32)
    q = rng.standard_normal((B, Hq, D)).astype(np.float16)
    lse = np.empty((B, Hq), np.float32)
    o, _ = sp.engine.paged_kv_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=D ** -0.5, lse=lse)
    G = Hq // Hkv
    for b in range(B):
        t = np.arange(seq_lens[b])
        blocks, slots = block_tables[b, t // block_size], t % block_size
        for h in range(Hkv):
            ref, ref_lse = attend(q[b, h * G:(h + 1) * G], k_cache[blocks, slots, h], v_cache[blocks, slots, h],
                                  D ** -0.5)
            np.testing.assert_allclose(o[b, h * G:(h + 1) * G].astype(np.float64), ref, atol=4e-3, rtol=4e-3)
            if seq_lens[b] == 0:
                assert np.isneginf(lse[b, h * G:(h + 1) * G]).all()
