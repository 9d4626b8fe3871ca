"""Chunked prefill from Python: prefill() of the block-sparse, static and DSA layers, on the CPU
backend with numpy arrays and with torch CPU tensors, and on the GPU with torch CUDA tensors.

Each chunk is compared, per (slot, token, head), with an fp64 reference over the positions the
layer reports it attended (last_prefill_positions), every row taken from the arrays the test
appended, and with a twin layer that decodes the same tokens; the output is NaN-poisoned first.
A chunk off the block grid is refused by name with the lengths unchanged."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend
from test_multi_token import BACKENDS, NumpyCpu, gates_off, relative_l2, torch_cuda


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


def f16(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


def block_config(backend):
    # The GPU prefill indexer scores 64- or 128-token blocks at head_dim 128; the CPU takes any.
    if backend.device == sp.Device.cpu:
        return dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=16, topk_blocks=2, local_blocks=1,
                    capacity_step=256)
    return dict(num_qo_heads=8, num_kv_heads=2, head_dim=128, block_size=64, topk_blocks=2, local_blocks=1,
                capacity_step=512)


@pytest.mark.parametrize("blocks_before", [0, 6])
def test_block_sparse_prefill_matches_fp64_over_its_sets(backend, rng, blocks_before):
    c = block_config(backend)
    B, Hq, H, D, bs = 2, c["num_qo_heads"], c["num_kv_heads"], c["head_dim"], c["block_size"]
    G, prompt, n = Hq // H, blocks_before * bs, 3 * bs + 5  # the last query block is partial
    layer = sp.BlockSparseAttention(backend.device, sp.DType.f16, sp.BlockSparseConfig(**c), B, gates_off())
    keys, vals = f16(rng, B, H + 1, prompt, D), f16(rng, B, H, prompt, D)
    if prompt:
        layer.append_tokens(backend.put(keys), backend.put(vals))
    q, iq = f16(rng, B, n, Hq, D), f16(rng, B, n, H, D)
    k, v = f16(rng, n, B, H + 1, 1, D), f16(rng, n, B, H, 1, D)
    o = backend.poisoned((B, n, Hq, D))
    layer.prefill(backend.put(q), backend.put(iq), backend.put(k), backend.put(v), o, stream=backend.stream())
    layer.check_errors(stream=backend.stream())
    assert layer.kv_lens == [prompt + n] * B
    out = backend.get(o)
    all_k = np.concatenate([keys[:, :H], k[:, :, :H, 0].transpose(1, 2, 0, 3)], axis=2)
    all_v = np.concatenate([vals, v[:, :, :, 0].transpose(1, 2, 0, 3)], axis=2)
    positions = layer.last_prefill_positions()
    assert len(positions) == B * n * Hq
    dense_len = 2 * c["topk_blocks"] * bs
    for b in range(B):
        for t in range(n):
            pos = prompt + t
            block_end = min((pos // bs + 1) * bs, prompt + n)
            for h in range(Hq):
                kept = np.array(positions[(b * n + t) * Hq + h])
                assert kept.max() == pos and (np.diff(kept) > 0).all()
                if block_end <= dense_len:  # the decode's dense regime: the whole window
                    assert len(kept) == pos + 1
                else:
                    assert len(kept) < pos + 1
                ref, _ = attend(q[b, t, h:h + 1], all_k[b, h // G, kept], all_v[b, h // G, kept], 1 / np.sqrt(D))
                got = out[b, t, h:h + 1]
                assert np.isfinite(got).all()
                assert relative_l2(got, ref) < 1e-2, (b, t, h)


def test_static_prefill_equals_decoding_the_tokens(backend, rng):
    D = 64 if backend.device == sp.Device.cpu else 128
    c = sp.StaticBlockSparseConfig()
    c.num_qo_heads, c.num_kv_heads, c.head_dim, c.block_size, c.local_blocks, c.vert_stride = 8, 2, D, 16, 2, 3
    c.capacity_step = 256
    B, Hq, H, n = 2, 8, 2, 40
    chunked, twin = (sp.StaticBlockSparseAttention(backend.device, sp.DType.f16, c, B, gates_off()) for _ in range(2))
    prompt = 64
    keys, vals = f16(rng, B, H, prompt, D), f16(rng, B, H, prompt, D)
    for layer in (chunked, twin):
        layer.append_tokens(backend.put(keys), backend.put(vals))
    q, k, v = f16(rng, B, n, Hq, D), f16(rng, n, B, H, 1, D), f16(rng, n, B, H, 1, D)
    o = backend.poisoned((B, n, Hq, D))
    chunked.prefill(backend.put(q), backend.put(k), backend.put(v), o, stream=backend.stream())
    out = backend.get(o)
    kept = chunked.last_prefill_positions()
    for t in range(n):
        ot = backend.poisoned((B, Hq, D))
        twin.decode(backend.put(q[:, t]), backend.put(k[t]), backend.put(v[t]), ot, stream=backend.stream())
        want = backend.get(ot)
        sets = twin.last_selected_positions()
        for b in range(B):
            assert np.isfinite(out[b, t]).all()
            assert relative_l2(out[b, t], np.asarray(want[b], np.float64)) < 1e-2, (b, t)
            for h in range(Hq):
                assert kept[(b * n + t) * Hq + h] == sorted(sets[b * Hq + h]), (b, t, h)
    assert chunked.kv_lens == twin.kv_lens == [prompt + n] * B


def test_dsa_prefill_equals_decoding_the_tokens(backend, rng):
    c = sp.DsaConfig(num_qo_heads=64, latent_dim=512, rope_dim=64, index_heads=4, index_head_dim=64, index_topk=32,
                     capacity_step=128)
    B, H, L, R, IH, ID, n, prompt = 2, 64, 512, 64, 4, 64, 12, 26  # the chunk crosses top-k
    chunked, twin = (sp.DsaAttention(backend.device, sp.DType.f16, c, B, gates_off()) for _ in range(2))
    rows, pe = f16(rng, B, 1, prompt, L + ID), f16(rng, B, 1, prompt, R)
    for layer in (chunked, twin):
        layer.append_tokens(backend.put(rows), backend.put(pe))
    ql, qpe = f16(rng, B, n, H, L), f16(rng, B, n, H, R)
    qi, w = f16(rng, B, n, IH, ID), rng.random((B, n, IH)).astype(np.float32)
    kr, kpe = f16(rng, n, B, 1, 1, L + ID), f16(rng, n, B, 1, 1, R)
    o = backend.poisoned((B, n, H, L))
    args = [backend.put(a) for a in (ql, qpe, qi, w, kr, kpe)]
    if backend.device == sp.Device.cuda:
        # The MLA prefill kernel reads bf16 on the GPU (the C++ GPU suite runs the bf16 layer).
        with pytest.raises(sp.Error, match="DsaAttention::prefill: the fused MLA prefill reads bf16 on CUDA"):
            chunked.prefill(*args, o, stream=backend.stream())
        assert chunked.kv_lens == [prompt] * B
        return
    chunked.prefill(*args, o, stream=backend.stream())
    out = backend.get(o)
    kept = chunked.last_prefill_positions()
    assert len(kept) == B * n
    for t in range(n):
        ot = backend.poisoned((B, H, L))
        token = [backend.put(a[:, t]) for a in (ql, qpe, qi, w)] + [backend.put(a[t]) for a in (kr, kpe)]
        twin.decode(*token, ot, stream=backend.stream())
        want = backend.get(ot)
        sets = twin.last_selected_positions()
        for b in range(B):
            assert kept[b * n + t] == sorted(sets[b]) and len(kept[b * n + t]) == min(32, prompt + t + 1)
            assert np.isfinite(out[b, t]).all()
            assert relative_l2(out[b, t], np.asarray(want[b], np.float64)) < 1e-2, (b, t)


def test_a_chunk_off_the_block_grid_is_refused_by_name(rng):
    c = block_config(NumpyCpu())
    B, Hq, H, D, bs = 2, c["num_qo_heads"], c["num_kv_heads"], c["head_dim"], c["block_size"]
    layer = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, sp.BlockSparseConfig(**c), B, gates_off())
    layer.append_tokens(f16(rng, B, H + 1, bs + 3, D), f16(rng, B, H, bs + 3, D))
    n = bs
    with pytest.raises(sp.Error, match=f"slot 0's chunk would start at position {bs + 3}, not a multiple of block"):
        layer.prefill(f16(rng, B, n, Hq, D), f16(rng, B, n, H, D), f16(rng, n, B, H + 1, 1, D),
                      f16(rng, n, B, H, 1, D), np.full((B, n, Hq, D), np.nan, np.float16))
    assert layer.kv_lens == [bs + 3] * B
    assert layer.last_prefill_positions() == []


def test_torch_prefill_chunks_replayed_from_a_graph_equal_eager_chunks():
    """A chunk of fixed shape captured once in a torch CUDA graph (block-sparse and the static
    pattern) and replayed for each later chunk with fresh inputs in the same tensors: every replay
    bit-equal to the same chunk run eagerly on a twin, the lengths advanced on the device."""
    cuda = torch_cuda()
    torch = cuda.torch
    gen = torch.Generator().manual_seed(31)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.float16).cuda()  # noqa: E731
    B, n, chunks = 2, 64, 5

    c = block_config(cuda)
    Hq, H, D = c["num_qo_heads"], c["num_kv_heads"], c["head_dim"]
    block = [sp.BlockSparseAttention(sp.Device.cuda, sp.DType.f16, sp.BlockSparseConfig(**c), B, gates_off())
             for _ in range(2)]
    block_args = [rnd(B, n, Hq, D), rnd(B, n, H, D), rnd(n, B, H + 1, 1, D), rnd(n, B, H, 1, D)]
    s = sp.StaticBlockSparseConfig()
    s.num_qo_heads, s.num_kv_heads, s.head_dim, s.block_size, s.local_blocks, s.vert_stride = 8, 2, 128, 16, 2, 3
    s.capacity_step = 512
    static = [sp.StaticBlockSparseAttention(sp.Device.cuda, sp.DType.f16, s, B, gates_off()) for _ in range(2)]
    static_args = [rnd(B, n, 8, 128), rnd(n, B, 2, 1, 128), rnd(n, B, 2, 1, 128)]

    for (graphed, eager), args, heads, dim in ((block, block_args, Hq, D), (static, static_args, 8, 128)):
        o_graph = torch.full((B, n, heads, dim), float("nan"), dtype=torch.float16, device="cuda")
        o_eager = o_graph.clone()
        for layer in (graphed, eager):
            layer.reserve(n * chunks)
        graphed.prefill(*args, o_graph, stream=cuda.stream())  # the first chunk sizes the buffers
        eager.prefill(*args, o_eager, stream=cuda.stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.prefill(*args, o_graph, stream=cuda.stream())
        for chunk in range(1, chunks):
            for a in args:
                a.copy_(torch.randn(a.shape, generator=gen).to(a.dtype))
            o_graph.fill_(float("nan"))
            o_eager.fill_(float("nan"))
            graph.replay()
            eager.prefill(*args, o_eager, stream=cuda.stream())
            torch.cuda.synchronize()
            graphed.sync_live_len()
            assert graphed.kv_lens == eager.kv_lens == [(chunk + 1) * n] * B, f"chunk {chunk}"
            assert torch.equal(o_graph, o_eager) and not o_graph.isnan().any(), f"chunk {chunk}"
        graphed.check_errors()
        eager.check_errors()
