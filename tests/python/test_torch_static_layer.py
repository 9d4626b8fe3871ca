"""The static per-query-head pattern layer (Phi-3-small's geometry: 32 query heads over 8 KV heads,
head dim 128, blocks of 64, 16 local blocks, vertical stride 8) with torch tensors. Each query
head attends exactly its pattern's tokens (checked against the rule), the output matches fp64
over those tokens and the mask path over the same set (CPU tensors on the CPU backend wherever
torch is installed, CUDA tensors on the GPU machine), and a step captured in a torch CUDA graph
and replayed while the context grows equals an eager twin bit for bit (the GPU machine only).
Skips without torch."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
cuda_only = pytest.mark.skipif(not (torch.cuda.is_available() and sp.cuda_available()),
                               reason="needs a GPU and sparsepage built with CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]

PHI3 = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, block_size=64, local_blocks=16, vert_stride=8,
            capacity_step=1024)


def dispatch(enabled=True):
    c = sp.DispatchConfig.defaults()
    c.enabled = enabled
    c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0
    return c


def stream(device="cuda"):
    return torch.cuda.current_stream().cuda_stream if device == "cuda" else 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prompt", [2047, 2048 + 63])  # the new token ends a block, and lands mid-block
def test_static_layer_attends_each_heads_pattern(device, prompt):
    """bf16 CUDA tensors, or f16 CPU tensors on the CPU backend."""
    gen = torch.Generator().manual_seed(prompt)
    c = sp.StaticBlockSparseConfig(**PHI3)
    B, Hq, H, D = 2, c.num_qo_heads, c.num_kv_heads, c.head_dim
    dtype, sdtype = (torch.bfloat16, sp.DType.bf16) if device == "cuda" else (torch.float16, sp.DType.f16)
    sdevice = sp.Device.cuda if device == "cuda" else sp.Device.cpu
    rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(device)  # noqa: E731
    fused, masked = (sp.StaticBlockSparseAttention(sdevice, sdtype, c, B, dispatch(on)) for on in (True, False))
    keys, vals = rnd(B, H, prompt, D), rnd(B, H, prompt, D)
    for layer in (fused, masked):
        layer.append_tokens(keys, vals)
    q, k, v = rnd(B, Hq, D), rnd(B, H, 1, D), rnd(B, H, 1, D)
    outs = [torch.full((B, Hq, D), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    steps = [layer.decode(q, k, v, o, stream(device)) for layer, o in zip((fused, masked), outs)]
    if device == "cuda":
        torch.cuda.synchronize()
    assert steps[0].fused and not steps[1].fused, steps[0].outcome.reason
    kv_len = prompt + 1
    assert fused.kv_len == masked.kv_len == kv_len
    positions, columns = fused.last_selected_positions(), masked.last_mask_columns()
    assert len(positions) == B * Hq
    last_block = (kv_len - 1) // c.block_size
    K = torch.cat([keys, k], dim=2).double().cpu().numpy()
    V = torch.cat([vals, v], dim=2).double().cpu().numpy()
    got = [o.float().cpu().numpy() for o in outs]
    qn = q.double().cpu().numpy()
    for r in range(B * Hq):
        b, h = divmod(r, Hq)
        want = [t for t in range(kv_len) if c.keeps(h, last_block, t // c.block_size)]
        assert sorted(positions[r]) == want, r
        assert sorted(columns[r]) == want, r
        ref, _ = attend(qn[b, h][None], K[b, h // (Hq // H), want], V[b, h // (Hq // H), want], 1 / np.sqrt(D))
        for o in got:
            assert np.isfinite(o[b, h]).all()
            assert np.linalg.norm(o[b, h] - ref[0]) / np.linalg.norm(ref[0]) < 1e-2, r
    assert positions[0] != positions[1], "the query heads of one KV head keep different blocks"


@cuda_only
def test_static_layer_step_replayed_from_a_graph_equals_eager_steps():
    gen = torch.Generator().manual_seed(3)
    c = sp.StaticBlockSparseConfig(**PHI3)
    B, Hq, H, D, prompt = 2, c.num_qo_heads, c.num_kv_heads, c.head_dim, 2040
    rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).cuda()  # noqa: E731
    graphed, eager = (sp.StaticBlockSparseAttention(sp.Device.cuda, sp.DType.bf16, c, B, dispatch()) for _ in range(2))
    keys, vals = rnd(B, H, prompt, D), rnd(B, H, prompt, D)
    for layer in (graphed, eager):
        layer.append_tokens(keys, vals)
        layer.reserve(prompt + 32)
    q, k, v = rnd(B, Hq, D), rnd(B, H, 1, D), rnd(B, H, 1, D)
    o_graph, o_eager = (torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    assert graphed.decode(q, k, v, o_graph, stream()).fused
    assert eager.decode(q, k, v, o_eager, stream()).fused
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.decode(q, k, v, o_graph, stream())
    for step in range(1, 16):  # crosses the block boundary at 2048
        for a in (q, k, v):
            a.copy_(torch.randn(a.shape, generator=gen).to(torch.bfloat16))
        o_graph.fill_(float("nan"))
        o_eager.fill_(float("nan"))
        graph.replay()
        assert eager.decode(q, k, v, o_eager, stream()).fused
        torch.cuda.synchronize()
        graphed.sync_live_len()
        assert graphed.kv_len == eager.kv_len == prompt + step + 1
        assert graphed.last_selected_positions() == eager.last_selected_positions(), f"step {step}"
        assert torch.equal(o_graph, o_eager) and not o_graph.isnan().any(), f"step {step}"
