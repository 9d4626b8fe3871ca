"""The layers over an engine's paged pool (KVStorage.ENGINE_PAGED) with torch tensors: pools
[num_blocks, 16, heads, dim] (block-sparse) and [num_blocks, 16, 576] (DSA) with shuffled block
tables and NaN in every row the engine has not written. Each step, eager and (on CUDA) replayed
from a captured CUDA graph while the context grows, equals the same layer over its own cache (same
kept set, same bits). The DSA layer also reads the engines' FP8 MLA pool (uint8 656-byte rows
written by quantize_mla_fp8, NaN bytes elsewhere) and matches its own cache of the dequantized
values. CPU tensors on the CPU backend wherever torch is installed (f16, bf16 for the FP8 pool),
bf16 CUDA tensors on the GPU machine; skips without torch."""


import pytest

import sparsepage as sp
from layer_backends import gates_off

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
cuda_only = pytest.mark.skipif(not (torch.cuda.is_available() and sp.cuda_available()),
                               reason="needs a GPU and sparsepage built with CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]

BLOCK = 16
# The FP8 MLA kernel at 16 query heads: one head tile, so the one-CTA kernel (no CTA pair).
FP8_MLA_KERNEL = "MLA FP8 (656-byte rows), wgmma, warp-specialized"


class On:
    """Where a test's tensors live: CUDA tensors in bf16, or CPU tensors on the CPU backend (f16 unless
    the test asks for bf16)."""

    def __init__(self, device, cpu_dtype=torch.float16):
        self.device, self.cuda = device, device == "cuda"
        self.sp_device = sp.Device.cuda if self.cuda else sp.Device.cpu
        self.dtype = torch.bfloat16 if self.cuda else cpu_dtype
        self.sp_dtype = sp.DType.bf16 if self.dtype == torch.bfloat16 else sp.DType.f16

    def stream(self):
        return torch.cuda.current_stream().cuda_stream if self.cuda else 0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def pool_and_table(batch, max_blocks, row_shape, gen, on):
    num_blocks = batch * max_blocks + 3
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = ids[: batch * max_blocks].reshape(batch, max_blocks).to(on.device)
    return torch.full((num_blocks, BLOCK) + tuple(row_shape), float("nan"), dtype=on.dtype, device=on.device), table


def write(pool, table, pos, rows):
    """rows [batch, ...]: sequence b's row at position pos."""
    for b in range(rows.shape[0]):
        pool[table[b, pos // BLOCK].item(), pos % BLOCK] = rows[b]


def stream():
    return torch.cuda.current_stream().cuda_stream


@pytest.mark.parametrize("device", DEVICES)
def test_block_sparse_engine_pool_eager_and_graph_replays_equal_its_own_cache(device):
    """On the CPU backend (f16 CPU tensors) every step is eager: the engine-paged layer stepped as the
    context grows equals its own-cache twin bit for bit."""
    on = On(device)
    gen = torch.Generator().manual_seed(5)
    B, Hq, H, D, prompt = 2, 16, 2, 128, 900
    cfg = dict(num_qo_heads=Hq, num_kv_heads=H, head_dim=D, block_size=64, topk_blocks=4, local_blocks=2,
               capacity_step=256)
    own = sp.BlockSparseAttention(on.sp_device, on.sp_dtype, sp.BlockSparseConfig(**cfg), B, gates_off())
    eng = sp.BlockSparseAttention(on.sp_device, on.sp_dtype,
                                  sp.BlockSparseConfig(**cfg, kv_storage=sp.KVStorage.ENGINE_PAGED), B)
    k_cache, table = pool_and_table(B, 64, (H, D), gen, on)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys = torch.randn(B, H + 1, prompt, D, generator=gen).to(on.dtype).to(device)
    vals = torch.randn(B, H, prompt, D, generator=gen).to(on.dtype).to(device)
    own.append_tokens(keys, vals)
    eng.append_tokens(keys[:, H:].contiguous(), None)
    for t in range(prompt):
        write(k_cache, table, t, keys[:, :H, t])
        write(v_cache, table, t, vals[:, :, t])
    own.reserve(prompt + 8)
    eng.reserve(prompt + 8)
    q, iq = torch.empty(B, Hq, D, dtype=on.dtype, device=device), torch.empty(B, H, D, dtype=on.dtype, device=device)
    k, v = torch.empty(B, H + 1, 1, D, dtype=on.dtype, device=device), torch.empty(B, H, 1, D, dtype=on.dtype, device=device)
    ik = torch.empty(B, 1, 1, D, dtype=on.dtype, device=device)
    o_own, o_eng = torch.empty(B, Hq, D, dtype=on.dtype, device=device), torch.empty(B, Hq, D, dtype=on.dtype, device=device)

    def fill(pos):
        q.copy_(torch.randn(B, Hq, D, generator=gen).to(on.dtype))
        iq.copy_(torch.randn(B, H, D, generator=gen).to(on.dtype))
        k.copy_(torch.randn(B, H + 1, 1, D, generator=gen).to(on.dtype))
        v.copy_(torch.randn(B, H, 1, D, generator=gen).to(on.dtype))
        ik.copy_(k[:, H:])
        write(k_cache, table, pos, k[:, :H, 0])
        write(v_cache, table, pos, v[:, :, 0])
        o_own.fill_(float("nan"))
        o_eng.fill_(float("nan"))

    fill(eng.kv_len)  # one eager step
    assert own.decode(q, iq, k, v, o_own, on.stream()).fused
    assert eng.decode_paged(q, iq, ik, o_eng, k_cache, v_cache, table, on.stream()).fused
    on.sync()
    assert eng.last_blocks() == own.last_blocks()
    assert torch.equal(o_eng, o_own) and not o_eng.isnan().any()

    if on.cuda:
        graph = torch.cuda.CUDAGraph()  # then the engine-paged step captured once, replayed as the context grows
        with torch.cuda.graph(graph):
            eng.decode_paged(q, iq, ik, o_eng, k_cache, v_cache, table, stream())
    for pos in range(prompt + 1, prompt + 6):
        fill(pos)
        if on.cuda:
            graph.replay()
        else:
            assert eng.decode_paged(q, iq, ik, o_eng, k_cache, v_cache, table, on.stream()).fused
        own.decode(q, iq, k, v, o_own, on.stream())
        on.sync()
        if on.cuda:
            eng.sync_live_len()
        assert eng.kv_len == own.kv_len == pos + 1
        assert eng.last_blocks() == own.last_blocks(), f"position {pos}"
        assert torch.equal(o_eng, o_own) and not o_eng.isnan().any(), f"position {pos}"


# The DSA tests' geometry: batch, heads, latent, rope, index heads, index dim, prompt.
DSA_SHAPE = (2, 16, 512, 64, 4, 128, 150)


def dsa_twins(on):
    """The DSA layer over its own cache (dispatch gates off) and over an engine pool, one geometry."""
    B, H, L, R, IH, ID, _ = DSA_SHAPE
    cfg = dict(num_qo_heads=H, latent_dim=L, rope_dim=R, index_heads=IH, index_head_dim=ID, index_topk=64,
               capacity_step=128)
    own = sp.DsaAttention(on.sp_device, on.sp_dtype, sp.DsaConfig(**cfg), B, gates_off())
    eng = sp.DsaAttention(on.sp_device, on.sp_dtype, sp.DsaConfig(**cfg, kv_storage=sp.KVStorage.ENGINE_PAGED), B)
    return own, eng


def dsa_step_queries(rnd, gen, on):
    """A step's queries (q_latent, q_pe, q_index, index_weights) and two NaN-poisoned outputs."""
    B, H, L, R, IH, ID, _ = DSA_SHAPE
    queries = (rnd(B, H, L), rnd(B, H, R), rnd(B, IH, ID), torch.rand(B, IH, generator=gen).to(on.device))
    o_own = torch.full((B, H, L), float("nan"), dtype=on.dtype, device=on.device)
    return queries, o_own, torch.full_like(o_own, float("nan"))


@pytest.mark.parametrize("device", DEVICES)
def test_dsa_engine_mla_pool_equals_its_own_cache(device):
    on = On(device)
    gen = torch.Generator().manual_seed(6)
    B, H, L, R, IH, ID, prompt = DSA_SHAPE
    own, eng = dsa_twins(on)
    kv_cache, table = pool_and_table(B, 16, (L + R,), gen, on)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(on.dtype).to(device)  # noqa: E731
    latent, index_k, pe = rnd(B, 1, prompt, L), rnd(B, 1, prompt, ID), rnd(B, 1, prompt, R)
    own.append_tokens(torch.cat([latent, index_k], dim=-1).contiguous(), pe)
    eng.append_tokens(index_k, None)
    for t in range(prompt):
        write(kv_cache, table, t, torch.cat([latent[:, 0, t], pe[:, 0, t]], dim=-1))
    for step in range(3):
        pos = eng.kv_len
        row_latent, row_index, row_pe = rnd(B, 1, 1, L), rnd(B, 1, 1, ID), rnd(B, 1, 1, R)
        write(kv_cache, table, pos, torch.cat([row_latent[:, 0, 0], row_pe[:, 0, 0]], dim=-1))
        queries, o_own, o_eng = dsa_step_queries(rnd, gen, on)
        assert own.decode(*queries, torch.cat([row_latent, row_index], dim=-1).contiguous(), row_pe, o_own,
                          on.stream()).fused
        assert eng.decode_paged(*queries, row_index, o_eng, kv_cache, table, on.stream()).fused
        on.sync()
        assert eng.last_selected_positions() == own.last_selected_positions(), f"step {step}"
        assert torch.equal(o_eng, o_own) and not o_eng.isnan().any(), f"step {step}"


def dequantized(rows_u8):
    """The latent values of FP8 MLA rows [..., 656] as the kernels must see them: e4m3 times the
    block's fp32 scale, then rounded to bf16 (what a bf16 cache of them holds)."""
    latent = rows_u8[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows_u8[..., 512:528].contiguous().view(torch.float32)
    return (latent.unflatten(-1, (4, 128)) * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_mla_fp8_gives_the_same_bytes_on_both_backends(device):
    """The CPU's bytes checked against the format (on the GPU machine the GPU's bytes equal them)."""
    gen = torch.Generator().manual_seed(8)
    src = (torch.randn(37, 576, generator=gen) * torch.logspace(-3, 3, 576)).to(torch.bfloat16)
    src[5, 200] = float("nan")  # a NaN makes its block's scale NaN
    dst_cpu = torch.zeros(37, 672, dtype=torch.uint8)
    sp.quantize_mla_fp8(src, dst_cpu)
    if device == "cuda":
        dst_gpu = torch.zeros(37, 672, dtype=torch.uint8, device="cuda")
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


@pytest.mark.parametrize("device", DEVICES)
def test_dsa_over_an_engine_fp8_mla_pool_matches_its_own_cache_of_the_dequantized_rows(device):
    """bf16 on both backends: the FP8 rows are quantized from bf16 and the twin's cache holds their
    bf16 dequantization. The CUDA launch must name the FP8 MLA kernel."""
    on = On(device, cpu_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    B, H, L, R, IH, ID, prompt = DSA_SHAPE
    own, eng = dsa_twins(on)
    num_blocks = B * 16 + 3
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[: B * 16].reshape(B, 16).to(device)
    kv_cache = torch.full((num_blocks, BLOCK, 656), 0x7F, dtype=torch.uint8, device=device)  # e4m3 NaN, NaN scales
    rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16).to(device)  # noqa: E731

    def place(latent, pe, first):
        """FP8 rows of [B, n, L] latent and [B, n, R] rope at positions first.., and their dequantized latent."""
        n = latent.shape[1]
        rows = torch.empty(B * n, 656, dtype=torch.uint8, device=device)
        sp.quantize_mla_fp8(torch.cat([latent, pe], dim=-1).reshape(B * n, L + R).contiguous(), rows, on.stream())
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
        queries, o_own, o_eng = dsa_step_queries(rnd, gen, on)
        assert own.decode(*queries, torch.cat([row_deq, row_index], dim=-1).contiguous(), row_pe, o_own,
                          on.stream()).fused
        s = eng.decode_paged(*queries, row_index, o_eng, kv_cache, table, on.stream())
        assert s.fused, s.outcome.describe()
        if on.cuda:
            assert s.outcome.kernel == FP8_MLA_KERNEL, s.outcome.describe()
        on.sync()
        assert eng.last_selected_positions() == own.last_selected_positions(), f"step {step}"
        assert not o_eng.isnan().any(), f"step {step}"
        err = ((o_eng.float() - o_own.float()).norm() / o_own.float().norm()).item()
        assert err < 5e-3, f"step {step}: relative L2 {err}"
    with pytest.raises(sp.Error, match=r"^DsaAttention.decode_paged: kv_cache rows are 600 bytes, fewer than the format's 656"):
        eng.decode_paged(*queries, row_index, o_eng, kv_cache[:, :, :600], table, on.stream())
    assert eng.kv_len == prompt + 3  # the refused step appended nothing
