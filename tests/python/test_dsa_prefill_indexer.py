"""The DSA prefill indexer from Python (sparsepage.DsaPrefillIndexer) on the CPU backend with numpy
arrays: a chunk of query tokens per sequence, the last num_tokens of each sequence's positions, every
token keeping its top-k over its own causal window. Each token's kept set must be the one-token
indexer's (dsa_select_tokens_cpu) over that token's window, from dense keys and from an engine's paged
pool behind a shuffled table (native keys, and vLLM's FP8 blocks written by write_index_keys); outputs
are poisoned first so an unwritten entry shows. Values are quarter-grid (exact scores: ties break by
the rule alone). Bad calls are refused by name."""

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import quarter_grid

IH, TOPK, BLOCK = 3, 8, 8


def config(dim):
    return sp.DsaConfig(num_qo_heads=4, latent_dim=32, rope_dim=8, index_heads=IH, index_head_dim=dim, index_topk=TOPK,
                        capacity_step=64)


def problem(rng, lens, tokens, dim=16):
    batch, cap = len(lens), max(lens)
    keys = quarter_grid(rng, batch, cap, dim)
    q = quarter_grid(rng, batch, tokens, IH, dim)
    w = (rng.integers(1, 5, size=(batch, tokens, IH)) / 4).astype(np.float32)
    return keys, q, w


def expected(keys, q, w, lens, tokens):
    """Per (sequence, token): the one-token indexer over its window, as a sorted list."""
    out = []
    for b, length in enumerate(lens):
        for t in range(tokens):
            window = length - tokens + t + 1
            kept = sp.dsa_select_tokens_cpu(config(q.shape[-1]), 1, window, q[b, t][None], w[b, t][None], keys[b, :window][None])
            out.append(sorted(int(x) for x in kept[0]))
    return out


def check(positions, counts, want, lens, tokens):
    for i, kept in enumerate(want):
        b, t = divmod(i, tokens)
        n = counts[b, t]
        assert n == min(TOPK, lens[b] - tokens + t + 1), (b, t, n)
        assert list(positions[b, t, :n]) == kept, (b, t)
        assert (positions[b, t, n:] == -1).all(), (b, t)


@pytest.mark.parametrize("layout", ["dense", "paged", "paged-fp8"])
def test_each_token_keeps_what_the_one_token_indexer_keeps(rng, layout):
    lens, tokens = [21, 13], 5  # the sequences hold 21 and 13 positions with the chunk
    dim = 128 if layout == "paged-fp8" else 16  # vLLM's FP8 index keys hold 128 values
    keys, q, w = problem(rng, lens, tokens, dim)
    batch = len(lens)
    positions = np.full((batch, tokens, TOPK), -7, np.int32)
    counts = np.full((batch, tokens), -7, np.int32)
    kv_lens = np.array(lens, np.int32)
    indexer = sp.DsaPrefillIndexer(sp.Device.cpu)
    if layout == "dense":
        indexer.run(q.astype(np.float16), w, positions, counts, kv_len=max(lens), kv_lens=kv_lens,
                    k_cache=keys.astype(np.float16))
    else:
        max_blocks = -(-max(lens) // BLOCK)
        num_blocks = batch * max_blocks + 3
        table = rng.permutation(num_blocks)[: batch * max_blocks].astype(np.int32).reshape(batch, max_blocks)
        fp8 = layout == "paged-fp8"
        pool = np.zeros((num_blocks, BLOCK, 132), np.uint8) if fp8 else np.full((num_blocks, BLOCK, dim), np.nan, np.float16)
        for b, length in enumerate(lens):
            slots = table[b, np.arange(length) // BLOCK].astype(np.int64) * BLOCK + np.arange(length) % BLOCK
            sp.write_index_keys(pool, keys[b, :length].astype(np.float16), slots)
        indexer.run(q.astype(np.float16), w, positions, counts, kv_len=max(lens), kv_lens=kv_lens, index_cache=pool,
                    index_block_table=table)
    check(positions, counts, expected(keys, q, w, lens, tokens), lens, tokens)


def test_without_device_lengths_every_sequence_holds_kv_len(rng):
    lens, tokens = [16, 16], 3
    keys, q, w = problem(rng, lens, tokens)
    positions = np.full((2, tokens, TOPK), -7, np.int32)
    counts = np.full((2, tokens), -7, np.int32)
    sp.DsaPrefillIndexer(sp.Device.cpu).run(q, w, positions, counts, kv_len=16, k_cache=keys)  # fp32 on the CPU
    check(positions, counts, expected(keys, q, w, lens, tokens), lens, tokens)


def test_bad_calls_are_refused_by_name(rng):
    keys, q, w = problem(rng, [12], 4)
    positions, counts = np.zeros((1, 4, TOPK), np.int32), np.zeros((1, 4), np.int32)
    run = sp.DsaPrefillIndexer(sp.Device.cpu).run
    with pytest.raises(sp.Error, match="either dense \\(k_cache\\) or paged"):
        run(q, w, positions, counts, kv_len=12)
    with pytest.raises(sp.Error, match="index_cache needs its index_block_table"):
        run(q, w, positions, counts, kv_len=12, index_cache=np.zeros((3, BLOCK, 16), np.float32))
    with pytest.raises(sp.Error, match=r"weights must have shape"):
        run(q, w[:, :2], positions, counts, kv_len=12, k_cache=keys)
    with pytest.raises(sp.Error, match=r"k_cache must be \[batch = 1, capacity, key_column \+ index_head_dim = 20\]"):
        run(q, w, positions, counts, kv_len=12, k_cache=keys, key_column=4)
    with pytest.raises(sp.Error, match="capacity = 12 rows per sequence is below chunk.kv_len = 40"):
        run(q, w, positions, counts, kv_len=40, k_cache=keys)
    with pytest.raises(sp.Error, match="num_tokens"):  # a sequence shorter than the chunk
        run(q, w, positions, counts, kv_len=12, kv_lens=np.array([3], np.int32), k_cache=keys)


def test_on_cuda_tensors_it_keeps_what_the_cpu_keeps(rng):
    """The CUDA indexer over an engine's FP8 pool (the production geometry: 64 index heads of 128) on
    torch's current stream, against the CPU run of the same arrays."""
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
    if not (torch.cuda.is_available() and sp.cuda_available()):
        pytest.skip("needs a GPU and sparsepage built with CUDA")
    heads, dim, topk, block, lens, tokens = 64, 128, 64, 64, [700, 300], 96
    batch, max_blocks = len(lens), -(-max(lens) // block)
    keys = quarter_grid(rng, batch, max(lens), dim)
    q = quarter_grid(rng, batch, tokens, heads, dim)
    w = (rng.integers(1, 5, size=(batch, tokens, heads)) / 4).astype(np.float32)
    num_blocks = batch * max_blocks + 3
    table = rng.permutation(num_blocks)[: batch * max_blocks].astype(np.int32).reshape(batch, max_blocks)
    pool = np.zeros((num_blocks, block, 132), np.uint8)
    for b, length in enumerate(lens):
        slots = table[b, np.arange(length) // block].astype(np.int64) * block + np.arange(length) % block
        sp.write_index_keys(pool, keys[b, :length].astype(np.float16), slots)
    outputs = []
    for device in ("cpu", "cuda"):
        positions = torch.full((batch, tokens, topk), -7, dtype=torch.int32, device=device)
        counts = torch.full((batch, tokens), -7, dtype=torch.int32, device=device)
        sp.DsaPrefillIndexer(sp.Device.cuda if device == "cuda" else sp.Device.cpu).run(
            torch.from_numpy(q).to(device, torch.bfloat16), torch.from_numpy(w).to(device), positions, counts,
            kv_len=max(lens), kv_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            index_cache=torch.from_numpy(pool).to(device), index_block_table=torch.from_numpy(table).to(device))
        torch.cuda.synchronize()
        outputs.append((positions.cpu().numpy(), counts.cpu().numpy()))
    (p_cpu, c_cpu), (p_gpu, c_gpu) = outputs
    np.testing.assert_array_equal(c_gpu, c_cpu)
    np.testing.assert_array_equal(p_gpu, p_cpu)
    assert (c_cpu == np.minimum(topk, np.array(lens)[:, None] - tokens + np.arange(tokens) + 1)).all()
