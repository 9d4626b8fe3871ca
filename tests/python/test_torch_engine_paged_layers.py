"""The layers over an engine's paged pool (KVStorage.ENGINE_PAGED) with torch CUDA tensors: bf16
pools [num_blocks, 16, heads, dim] (block-sparse) and [num_blocks, 16, 576] (DSA) with shuffled
block tables and NaN in every row the engine has not written. Each step, eager and replayed from
a captured CUDA graph while the context grows, equals the same layer over its own cache (same
kept set, same bits). The DSA layer also reads the engines' FP8 MLA pool (uint8 656-byte rows
written by quantize_mla_fp8, NaN bytes elsewhere) and matches its own cache of the dequantized
values. Runs on the GPU machine; skips without torch or a GPU."""


import pytest

import sparsepage as sp
from layer_backends import gates_off

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and sp.cuda_available()),
                                reason="needs a GPU and sparsepage built with CUDA")

BLOCK = 16
# The FP8 MLA kernel at 16 query heads: one head tile, so the one-CTA kernel (no CTA pair).
FP8_MLA_KERNEL = "MLA FP8 (656-byte rows), wgmma, warp-specialized"


def pool_and_table(batch, max_blocks, row_shape, gen):
    num_blocks = batch * max_blocks + 3
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = ids[: batch * max_blocks].reshape(batch, max_blocks).cuda()
    return torch.full((num_blocks, BLOCK) + tuple(row_shape), float("nan"), dtype=torch.bfloat16, device="cuda"), table


def write(pool, table, pos, rows):
    """rows [batch, ...]: sequence b's row at position pos."""
    for b in range(rows.shape[0]):
        pool[table[b, pos // BLOCK].item(), pos % BLOCK] = rows[b]


def stream():
    return torch.cuda.current_stream().cuda_stream


def test_block_sparse_engine_pool_eager_and_graph_replays_equal_its_own_cache():
    gen = torch.Generator().manual_seed(5)
    B, Hq, H, D, prompt = 2, 16, 2, 128, 900
    cfg = dict(num_qo_heads=Hq, num_kv_heads=H, head_dim=D, block_size=64, topk_blocks=4, local_blocks=2,
               capacity_step=256)
    own = sp.BlockSparseAttention(sp.Device.cuda, sp.DType.bf16, sp.BlockSparseConfig(**cfg), B, gates_off())
    eng = sp.BlockSparseAttention(sp.Device.cuda, sp.DType.bf16,
                                  sp.BlockSparseConfig(**cfg, kv_storage=sp.KVStorage.ENGINE_PAGED), B)
    k_cache, table = pool_and_table(B, 64, (H, D), gen)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys = torch.randn(B, H + 1, prompt, D, generator=gen).to(torch.bfloat16).cuda()
    vals = torch.randn(B, H, prompt, D, generator=gen).to(torch.bfloat16).cuda()
    own.append_tokens(keys, vals)
    eng.append_tokens(keys[:, H:].contiguous(), None)
    for t in range(prompt):
        write(k_cache, table, t, keys[:, :H, t])
        write(v_cache, table, t, vals[:, :, t])
    own.reserve(prompt + 8)
    eng.reserve(prompt + 8)
    q, iq = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda"), torch.empty(B, H, D, dtype=torch.bfloat16, device="cuda")
    k, v = torch.empty(B, H + 1, 1, D, dtype=torch.bfloat16, device="cuda"), torch.empty(B, H, 1, D, dtype=torch.bfloat16, device="cuda")
    ik = torch.empty(B, 1, 1, D, dtype=torch.bfloat16, device="cuda")
    o_own, o_eng = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda"), torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")

    def fill(pos):
        q.copy_(torch.randn(B, Hq, D, generator=gen).to(torch.bfloat16))
        iq.copy_(torch.randn(B, H, D, generator=gen).to(torch.bfloat16))
        k.copy_(torch.randn(B, H + 1, 1, D, generator=gen).to(torch.bfloat16))
        v.copy_(torch.randn(B, H, 1, D, generator=gen).to(torch.bfloat16))
        ik.copy_(k[:, H:])
        write(k_cache, table, pos, k[:, :H, 0])
        write(v_cache, table, pos, v[:, :, 0])
        o_own.fill_(float("nan"))
        o_eng.fill_(float("nan"))

    fill(eng.kv_len)  # one eager step
    assert own.decode(q, iq, k, v, o_own, stream()).fused
    assert eng.decode_paged(q, iq, ik, o_eng, k_cache, v_cache, table, stream()).fused
    torch.cuda.synchronize()
    assert eng.last_blocks() == own.last_blocks()
    assert torch.equal(o_eng, o_own) and not o_eng.isnan().any()

    graph = torch.cuda.CUDAGraph()  # then the engine-paged step captured once, replayed as the context grows
    with torch.cuda.graph(graph):
        eng.decode_paged(q, iq, ik, o_eng, k_cache, v_cache, table, stream())
    for pos in range(prompt + 1, prompt + 6):
        fill(pos)
        graph.replay()
        own.decode(q, iq, k, v, o_own, stream())
        torch.cuda.synchronize()
        eng.sync_live_len()
        assert eng.kv_len == own.kv_len == pos + 1
        assert eng.last_blocks() == own.last_blocks(), f"position {pos}"
        assert torch.equal(o_eng, o_own) and not o_eng.isnan().any(), f"position {pos}"


# The DSA tests' geometry: batch, heads, latent, rope, index heads, index dim, prompt.
DSA_SHAPE = (2, 16, 512, 64, 4, 128, 150)


def dsa_twins():
    """The DSA layer over its own cache (dispatch gates off) and over an engine pool, one geometry."""
    B, H, L, R, IH, ID, _ = DSA_SHAPE
    cfg = dict(num_qo_heads=H, latent_dim=L, rope_dim=R, index_heads=IH, index_head_dim=ID, index_topk=64,
               capacity_step=128)
    own = sp.DsaAttention(sp.Device.cuda, sp.DType.bf16, sp.DsaConfig(**cfg), B, gates_off())
    eng = sp.DsaAttention(sp.Device.cuda, sp.DType.bf16, sp.DsaConfig(**cfg, kv_storage=sp.KVStorage.ENGINE_PAGED), B)
    return own, eng


def dsa_step_queries(rnd, gen):
    """A step's queries (q_latent, q_pe, q_index, index_weights) and two NaN-poisoned outputs."""
    B, H, L, R, IH, ID, _ = DSA_SHAPE
    queries = (rnd(B, H, L), rnd(B, H, R), rnd(B, IH, ID), torch.rand(B, IH, generator=gen).cuda())
    o_own = torch.full((B, H, L), float("nan"), dtype=torch.bfloat16, device="cuda")
    return queries, o_own, torch.full_like(o_own, float("nan"))


def test_dsa_engine_mla_pool_equals_its_own_cache():
    gen = torch.Generator().manual_seed(6)
    B, H, L, R, IH, ID, prompt = DSA_SHAPE
    own, eng = dsa_twins()
    kv_cache, table = pool_and_table(B, 16, (L + R,), gen)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).cuda()  # noqa: E731
    latent, index_k, pe = rnd(B, 1, prompt, L), rnd(B, 1, prompt, ID), rnd(B, 1, prompt, R)
    own.append_tokens(torch.cat([latent, index_k], dim=-1).contiguous(), pe)
    eng.append_tokens(index_k, None)
    for t in range(prompt):
        write(kv_cache, table, t, torch.cat([latent[:, 0, t], pe[:, 0, t]], dim=-1))
    for step in range(3):
        pos = eng.kv_len
        row_latent, row_index, row_pe = rnd(B, 1, 1, L), rnd(B, 1, 1, ID), rnd(B, 1, 1, R)
        write(kv_cache, table, pos, torch.cat([row_latent[:, 0, 0], row_pe[:, 0, 0]], dim=-1))
        queries, o_own, o_eng = dsa_step_queries(rnd, gen)
        assert own.decode(*queries, torch.cat([row_latent, row_index], dim=-1).contiguous(), row_pe, o_own, stream()).fused
        assert eng.decode_paged(*queries, row_index, o_eng, kv_cache, table, stream()).fused
        torch.cuda.synchronize()
        assert eng.last_selected_positions() == own.last_selected_positions(), f"step {step}"
        assert torch.equal(o_eng, o_own) and not o_eng.isnan().any(), f"step {step}"


def dequantized(rows_u8):
    """The latent values of FP8 MLA rows [..., 656] as the kernels must see them: e4m3 times the
    block's fp32 scale, then rounded to bf16 (what a bf16 cache of them holds)."""
    latent = rows_u8[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows_u8[..., 512:528].contiguous().view(torch.float32)
    return (latent.unflatten(-1, (4, 128)) * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


def test_quantize_mla_fp8_gives_the_same_bytes_on_both_backends():
    gen = torch.Generator().manual_seed(8)
    src = (torch.randn(37, 576, generator=gen) * torch.logspace(-3, 3, 576)).to(torch.bfloat16)
    src[5, 200] = float("nan")  # a NaN makes its block's scale NaN
    dst_cpu, dst_gpu = torch.zeros(37, 672, dtype=torch.uint8), torch.zeros(37, 672, dtype=torch.uint8, device="cuda")
    sp.quantize_mla_fp8(src, dst_cpu)
    sp.quantize_mla_fp8(src.cuda(), dst_gpu, stream())
    torch.cuda.synchronize()
    assert torch.equal(dst_cpu, dst_gpu.cpu())
    assert torch.equal(dst_cpu[:, 528:656].view(torch.bfloat16), src[:, 512:])  # the rope, unquantized
    assert torch.isnan(dst_cpu[5, 512:528].view(torch.float32)[1]) and not torch.isnan(dst_cpu[4, 512:528].view(torch.float32)).any()
    assert torch.equal(dst_cpu[:, 656:], torch.zeros(37, 16, dtype=torch.uint8))  # bytes past 656 untouched
    ok = torch.ones(37, dtype=torch.bool)
    ok[5] = False
    err = (dequantized(dst_cpu[ok]).float() - src[ok, :512].float()).norm() / src[ok, :512].float().norm()
    assert err < 5e-2, err  # e4m3 keeps 3 mantissa bits
    with pytest.raises(sp.Error, match=r"^quantize_mla_fp8: dst rows are 600 bytes, fewer than the format's 656"):
        sp.quantize_mla_fp8(src, torch.zeros(37, 600, dtype=torch.uint8))
    with pytest.raises(sp.Error, match=r"^quantize_mla_fp8: src has dtype float16; the format's source is bfloat16"):
        sp.quantize_mla_fp8(src.half(), dst_cpu)


def test_dsa_over_an_engine_fp8_mla_pool_matches_its_own_cache_of_the_dequantized_rows():
    gen = torch.Generator().manual_seed(9)
    B, H, L, R, IH, ID, prompt = DSA_SHAPE
    own, eng = dsa_twins()
    num_blocks = B * 16 + 3
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[: B * 16].reshape(B, 16).cuda()
    kv_cache = torch.full((num_blocks, BLOCK, 656), 0x7F, dtype=torch.uint8, device="cuda")  # e4m3 NaN, NaN scales
    rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).cuda()  # noqa: E731

    def place(latent, pe, first):
        """FP8 rows of [B, n, L] latent and [B, n, R] rope at positions first.., and their dequantized latent."""
        n = latent.shape[1]
        rows = torch.empty(B * n, 656, dtype=torch.uint8, device="cuda")
        sp.quantize_mla_fp8(torch.cat([latent, pe], dim=-1).reshape(B * n, L + R).contiguous(), rows, stream())
        rows = rows.reshape(B, n, 656)
        for t in range(n):
            write(kv_cache, table, first + t, rows[:, t])
        return dequantized(rows)

    latent, index_k, pe = rnd(B, 1, prompt, L), rnd(B, 1, prompt, ID), rnd(B, 1, prompt, R)
    deq = place(latent[:, 0], pe[:, 0], 0).unsqueeze(1)
    own.append_tokens(torch.cat([deq, index_k], dim=-1).contiguous(), pe)
    eng.append_tokens(index_k, None)
    for step in range(3):
        pos = eng.kv_len
        row_latent, row_index, row_pe = rnd(B, 1, 1, L), rnd(B, 1, 1, ID), rnd(B, 1, 1, R)
        row_deq = place(row_latent[:, 0], row_pe[:, 0], pos).unsqueeze(1)
        queries, o_own, o_eng = dsa_step_queries(rnd, gen)
        assert own.decode(*queries, torch.cat([row_deq, row_index], dim=-1).contiguous(), row_pe, o_own, stream()).fused
        s = eng.decode_paged(*queries, row_index, o_eng, kv_cache, table, stream())
        assert s.fused and s.outcome.kernel == FP8_MLA_KERNEL, s.outcome.describe()
        torch.cuda.synchronize()
        assert eng.last_selected_positions() == own.last_selected_positions(), f"step {step}"
        assert not o_eng.isnan().any(), f"step {step}"
        err = ((o_eng.float() - o_own.float()).norm() / o_own.float().norm()).item()
        assert err < 5e-3, f"step {step}: relative L2 {err}"
    with pytest.raises(sp.Error, match=r"^DsaAttention.decode_paged: kv_cache rows are 600 bytes, fewer than the format's 656"):
        eng.decode_paged(*queries, row_index, o_eng, kv_cache[:, :, :600], table, stream())
    assert eng.kv_len == prompt + 3  # the refused step appended nothing
