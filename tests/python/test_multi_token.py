"""Multi-token steps from Python (speculative verification, MTP): decode_multi of the block-sparse
and DSA layers, on the CPU backend with numpy arrays and with torch CPU tensors, and on the GPU with
torch CUDA tensors.

Each fused step is compared, per (sequence, token, head), with an fp64 reference over the rows
the layer reports it kept, limited to the token's own causal window, with every row taken from
the arrays the test appended (so a misread token-major layout shows up). The output is NaN-
poisoned first. A step the dispatch declines runs as q_len one-token decodes and must equal a
twin layer stepped one token at a time, bit for bit."""

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import gates_off
from reference import attend


class NumpyCpu:
    device = sp.Device.cpu

    def put(self, a):
        return np.ascontiguousarray(a)

    def get(self, a):
        return np.asarray(a)

    def poisoned(self, shape):
        return np.full(shape, np.nan, np.float16)

    def stream(self):
        return 0


class TorchCpu:
    """torch CPU tensors on the CPU backend (the bindings take them through DLPack)."""
    device = sp.Device.cpu

    def __init__(self, torch):
        self.torch = torch

    def put(self, a):
        return self.torch.from_numpy(np.array(a))

    def get(self, a):
        return a.numpy()

    def poisoned(self, shape):
        return self.torch.full(shape, float("nan"), dtype=self.torch.float16)

    def stream(self):
        return 0


class TorchCuda:
    device = sp.Device.cuda

    def __init__(self, torch):
        self.torch = torch

    def put(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def get(self, a):
        self.torch.cuda.synchronize()
        return a.cpu().numpy()

    def poisoned(self, shape):
        return self.torch.full(shape, float("nan"), dtype=self.torch.float16, device="cuda")

    def stream(self):
        return self.torch.cuda.current_stream().cuda_stream


def torch_cpu():
    return TorchCpu(pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh "
                                                        "--torch installs it)"))


def torch_cuda():
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
    if not (torch.cuda.is_available() and sp.cuda_available()):
        pytest.skip("needs a GPU and sparsepage built with CUDA")
    return TorchCuda(torch)


BACKENDS = {"numpy-cpu": NumpyCpu, "torch-cpu": torch_cpu, "torch-cuda": torch_cuda}


@pytest.fixture(params=list(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


def f16(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


def relative_l2(got, ref):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)


BS = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, block_size=32, topk_blocks=4, local_blocks=1, capacity_step=256)


@pytest.mark.parametrize("q_len", [2, 4])
def test_block_sparse_decode_multi_matches_fp64_over_the_kept_rows(backend, rng, q_len):
    B, Hq, H, D, prompt = 2, BS["num_qo_heads"], BS["num_kv_heads"], BS["head_dim"], 301
    G = Hq // H
    layer = sp.BlockSparseAttention(backend.device, sp.DType.f16, sp.BlockSparseConfig(**BS), B, gates_off())
    keys, vals = f16(rng, B, H + 1, prompt, D), f16(rng, B, H, prompt, D)
    layer.append_tokens(backend.put(keys), backend.put(vals))
    q, iq = f16(rng, B, q_len, Hq, D), f16(rng, B, q_len, H, D)
    k, v = f16(rng, q_len, B, H + 1, 1, D), f16(rng, q_len, B, H, 1, D)
    o = backend.poisoned((B, q_len, Hq, D))
    step = layer.decode_multi(backend.put(q), backend.put(iq), backend.put(k), backend.put(v), o,
                              stream=backend.stream())
    assert step.sparse and step.fused, step.outcome.reason
    # The launch names its kernel: head dim 64 keeps every query row on the 16-row tiles.
    expected = "CPU loop" if backend.device == sp.Device.cpu else "16-row tiles, mma.sync"
    assert step.outcome.kernel == expected, step.outcome.describe()
    assert layer.kv_len == prompt + q_len
    out = backend.get(o)
    # The whole cache as the test wrote it: the prompt, then token t's slice k[t] at prompt + t.
    all_k = np.concatenate([keys[:, :H], k[:, :, :H, 0].transpose(1, 2, 0, 3)], axis=2)
    all_v = np.concatenate([vals, v[:, :, :, 0].transpose(1, 2, 0, 3)], axis=2)
    positions = layer.last_selected_positions()
    assert len(positions) == B * H
    for b in range(B):
        for h in range(H):
            kept = np.array(sorted(set(positions[b * H + h])))
            assert kept.max() < prompt + q_len
            # The step's own tokens are always kept (the first new token's block and the final one).
            assert set(range(prompt, prompt + q_len)) <= set(kept.tolist())
            assert len(kept) < prompt  # a real selection, not the whole window
            for t in range(q_len):
                rows = kept[kept <= prompt + t]  # token t sees the context up to its own position
                ref, _ = attend(q[b, t, h * G:(h + 1) * G], all_k[b, h, rows], all_v[b, h, rows], 1 / np.sqrt(D))
                got = out[b, t, h * G:(h + 1) * G]
                assert np.isfinite(got).all()
                assert relative_l2(got, ref) < 1e-2, (b, h, t)


def test_block_sparse_decode_multi_declined_equals_single_token_steps(backend, rng):
    B, Hq, H, D, prompt, q_len = 2, BS["num_qo_heads"], BS["num_kv_heads"], BS["head_dim"], 400, 3
    multi, single = (sp.BlockSparseAttention(backend.device, sp.DType.f16, sp.BlockSparseConfig(**BS), B,
                                             gates_off(enabled=False)) for _ in range(2))
    keys, vals = f16(rng, B, H + 1, prompt, D), f16(rng, B, H, prompt, D)
    for layer in (multi, single):
        layer.append_tokens(backend.put(keys), backend.put(vals))
    q, iq = f16(rng, B, q_len, Hq, D), f16(rng, B, q_len, H, D)
    k, v = f16(rng, q_len, B, H + 1, 1, D), f16(rng, q_len, B, H, 1, D)
    o = backend.poisoned((B, q_len, Hq, D))
    step = multi.decode_multi(backend.put(q), backend.put(iq), backend.put(k), backend.put(v), o,
                              stream=backend.stream())
    assert step.sparse and not step.fused and step.outcome.kind == sp.OutcomeKind.kill_switch
    singles = []
    for t in range(q_len):
        ot = backend.poisoned((B, Hq, D))
        single.decode(backend.put(q[:, t]), backend.put(iq[:, t]), backend.put(k[t]), backend.put(v[t]), ot,
                      stream=backend.stream())
        singles.append(backend.get(ot))
    assert multi.kv_len == single.kv_len == prompt + q_len
    np.testing.assert_array_equal(backend.get(o), np.stack(singles, axis=1))


DSA = dict(num_qo_heads=16, latent_dim=512, rope_dim=64, index_heads=8, index_head_dim=64, index_topk=64,
           capacity_step=256)


def dsa_index_scores(q_index, weights, index_keys):
    """The lightning indexer's score of every key, fp64: sum_j w_j * relu(q_j . k)."""
    dots = np.asarray(q_index, np.float64) @ np.asarray(index_keys, np.float64).T
    return (np.asarray(weights, np.float64)[:, None] * np.maximum(dots, 0)).sum(axis=0)


@pytest.mark.parametrize("q_len", [2, 4])
def test_dsa_decode_multi_keeps_each_tokens_top_k_and_matches_fp64(backend, rng, q_len):
    c = sp.DsaConfig(**DSA)
    B, H, L, R, IH, ID, topk, prompt = 2, c.num_qo_heads, c.latent_dim, c.rope_dim, c.index_heads, c.index_head_dim, \
        c.index_topk, 250
    layer = sp.DsaAttention(backend.device, sp.DType.f16, c, B, gates_off())
    rows, pe = f16(rng, B, 1, prompt, L + ID), f16(rng, B, 1, prompt, R)
    layer.append_tokens(backend.put(rows), backend.put(pe))
    ql, qpe = f16(rng, B, q_len, H, L), f16(rng, B, q_len, H, R)
    qi, w = f16(rng, B, q_len, IH, ID), rng.random((B, q_len, IH)).astype(np.float32)
    kr, kpe = f16(rng, q_len, B, 1, 1, L + ID), f16(rng, q_len, B, 1, 1, R)
    o = backend.poisoned((B, q_len, H, L))
    step = layer.decode_multi(*(backend.put(a) for a in (ql, qpe, qi, w, kr, kpe)), o, stream=backend.stream())
    assert step.sparse and step.fused, step.outcome.reason
    assert layer.kv_len == prompt + q_len
    out = backend.get(o)
    all_rows = np.concatenate([rows[:, 0], kr[:, :, 0, 0].transpose(1, 0, 2)], axis=1)  # [B, prompt + q_len, L + ID]
    all_pe = np.concatenate([pe[:, 0], kpe[:, :, 0, 0].transpose(1, 0, 2)], axis=1)
    positions = layer.last_selected_positions()
    assert len(positions) == B * q_len  # one row per (sequence, token)
    for b in range(B):
        for t in range(q_len):
            window = prompt + t + 1
            kept = np.array(positions[b * q_len + t])
            assert len(kept) == min(topk, window) and len(set(kept.tolist())) == len(kept)
            assert kept.max() < window
            # Each token's own top-k: any difference from the fp64 rule is a near-tie at the boundary.
            score = dsa_index_scores(qi[b, t], w[b, t], all_rows[b, :window, L:])
            kth = np.sort(score)[::-1][topk - 1]
            expected = set(np.argsort(-score, kind="stable")[:topk].tolist())
            for p in expected.symmetric_difference(kept.tolist()):
                assert abs(score[p] - kth) <= 1e-3 * max(abs(kth), 1.0), (b, t, p)
            ref, _ = attend(ql[b, t], all_rows[b, kept, :L], all_rows[b, kept, :L], 1 / np.sqrt(L + R),
                            q_extra=qpe[b, t], k_extra=all_pe[b, kept])
            got = out[b, t]
            assert np.isfinite(got).all()
            assert relative_l2(got, ref) < 1e-2, (b, t)


def test_decode_multi_arguments_are_checked(rng):
    B, Hq, H, D = 2, BS["num_qo_heads"], BS["num_kv_heads"], BS["head_dim"]
    layer = sp.BlockSparseAttention(sp.Device.cpu, sp.DType.f16, sp.BlockSparseConfig(**BS), B, gates_off())
    layer.append_tokens(f16(rng, B, H + 1, 64, D), f16(rng, B, H, 64, D))

    def call(q_len, q_shape=None, k_shape=None):
        q = f16(rng, *(q_shape or (B, q_len, Hq, D)))
        k = f16(rng, *(k_shape or (q_len, B, H + 1, 1, D)))
        return layer.decode_multi(q, f16(rng, B, q_len, H, D), k, f16(rng, q_len, B, H, 1, D),
                                  np.empty((B, q_len, Hq, D), np.float16))

    with pytest.raises(sp.Error, match=r"^BlockSparseAttention.decode_multi: q .*\[batch, q_len, num_qo_heads, head_dim\]"):
        call(2, q_shape=(B, Hq, D))
    # The engine's sequence-major layout for k is not what the step takes: refused by name.
    with pytest.raises(sp.Error, match=r"^BlockSparseAttention.decode_multi: k .*token-major"):
        call(3, k_shape=(B, 3, H + 1, 1, D))
    with pytest.raises(sp.Error, match=r"q_len = 17 must lie in \[1, 16\]"):
        call(17)
    assert layer.kv_len == 64  # nothing was appended by a refused step


def replay_against_eager(cuda, graphed, eager, args, o_graph, o_eager, kv_len, q_len, selection):
    """One eager step of each twin, then graphed's step captured once and replayed five times while
    the context grows, each replay bit-equal to eager's step on the same fresh inputs."""
    torch = cuda.torch
    gen = torch.Generator().manual_seed(kv_len)
    assert graphed.decode_multi(*args, o_graph, stream=cuda.stream()).fused  # the first step sizes the buffers
    assert eager.decode_multi(*args, o_eager, stream=cuda.stream()).fused
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.decode_multi(*args, o_graph, stream=cuda.stream())
    for step in range(1, 6):
        for a in args:  # the fp32 index weights stay positive
            fresh = torch.rand(a.shape, generator=gen) if a.dtype == torch.float32 else torch.randn(a.shape, generator=gen)
            a.copy_(fresh.to(a.dtype))
        o_graph.fill_(float("nan"))
        o_eager.fill_(float("nan"))
        graph.replay()
        assert eager.decode_multi(*args, o_eager, stream=cuda.stream()).fused
        torch.cuda.synchronize()
        graphed.sync_live_len()
        assert graphed.kv_len == eager.kv_len == kv_len + (step + 1) * q_len
        assert selection(graphed) == selection(eager), f"step {step}"
        assert torch.equal(o_graph, o_eager) and not o_graph.isnan().any(), f"step {step}"


def test_torch_decode_multi_replayed_from_a_graph_equals_eager_steps():
    """Both layers' multi-token steps captured once in a torch CUDA graph and replayed while the
    context grows, each replay bit-equal to an eager twin fed the same tokens."""
    cuda = torch_cuda()
    torch = cuda.torch
    gen = torch.Generator().manual_seed(12)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.float16).cuda()  # noqa: E731
    B = 2

    # Block-sparse, q_len 4.
    Hq, H, D, T, prompt = BS["num_qo_heads"], BS["num_kv_heads"], BS["head_dim"], 4, 300
    graphed, eager = (sp.BlockSparseAttention(sp.Device.cuda, sp.DType.f16, sp.BlockSparseConfig(**BS), B, gates_off())
                      for _ in range(2))
    keys, vals = rnd(B, H + 1, prompt, D), rnd(B, H, prompt, D)
    for layer in (graphed, eager):
        layer.append_tokens(keys, vals)
        layer.reserve(prompt + 8 * T)
    args = [rnd(B, T, Hq, D), rnd(B, T, H, D), rnd(T, B, H + 1, 1, D), rnd(T, B, H, 1, D)]
    replay_against_eager(cuda, graphed, eager, args, cuda.poisoned((B, T, Hq, D)), cuda.poisoned((B, T, Hq, D)),
                         prompt, T, lambda layer: layer.last_blocks())

    # DSA, q_len 2.
    c = sp.DsaConfig(**DSA)
    H, L, R, IH, ID, T, prompt = c.num_qo_heads, c.latent_dim, c.rope_dim, c.index_heads, c.index_head_dim, 2, 200
    graphed, eager = (sp.DsaAttention(sp.Device.cuda, sp.DType.f16, c, B, gates_off()) for _ in range(2))
    rows, pe = rnd(B, 1, prompt, L + ID), rnd(B, 1, prompt, R)
    for layer in (graphed, eager):
        layer.append_tokens(rows, pe)
        layer.reserve(prompt + 8 * T)
    args = [rnd(B, T, H, L), rnd(B, T, H, R), rnd(B, T, IH, ID), torch.rand(B, T, IH, generator=gen).cuda(),
            rnd(T, B, 1, 1, L + ID), rnd(T, B, 1, 1, R)]
    replay_against_eager(cuda, graphed, eager, args, cuda.poisoned((B, T, H, L)), cuda.poisoned((B, T, H, L)),
                         prompt, T, lambda layer: layer.last_selected_positions())
