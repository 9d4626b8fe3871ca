"""The engines' own inputs through the torch ops, on CPU and CUDA tensors, against plain torch
fp64 references: MlaSparseDecoder over a [num_blocks, block_size, 576] cache with [num_tokens,
topk] slot ids (-1 skipped, topk_length) and with positions plus a block table; PagedKVDecoder
over [num_blocks, block_size, num_kv_heads, head_dim] caches (block sizes 16, 32, 64, GQA); q
as a slice of a packed QKV tensor and o as a column slice; the merge op over two launches'
states; graph capture with lengths that change on the device; torch.compile; the CUDA error
semantics of a bad id; bad inputs with the exact error. Unused pool rows are NaN. The CPU cases
run wherever torch is installed (CI's torch part), the CUDA ones on the GPU machine."""

import math

import pytest

import sparsepage as sp

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
ops = pytest.importorskip("sparsepage.torch_ops")

has_gpu = torch.cuda.is_available() and sp.cuda_available()
cuda_only = pytest.mark.skipif(not has_gpu, reason="needs a GPU and sparsepage built with CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


def dtype_for(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def tol(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 3e-5


def ref_attention(q, k, v, scale, q_extra=None, k_extra=None):
    """Plain torch fp64: q [G, D] over rows k [n, D], v [n, Dv] -> (o [G, Dv], lse [G])."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    if k.shape[0] == 0:
        return torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64), torch.full((q.shape[0],), -math.inf,
                                                                                     dtype=torch.float64)
    s = scale * q @ k.T
    if q_extra is not None:
        s = s + scale * q_extra.double().cpu() @ k_extra.double().cpu().T
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def assert_close(got, want, dtype):
    torch.testing.assert_close(got.double().cpu(), want, atol=tol(dtype), rtol=tol(dtype))


def nan_cache(shape, used_rows, dtype, device, g):
    """A cache of `shape` whose rows (leading two dims flattened) in used_rows hold values, the rest NaN."""
    cache = torch.full(shape, float("nan"), dtype=torch.float32)
    flat = cache.view(shape[0] * shape[1], *shape[2:])
    rows = torch.unique(torch.as_tensor(used_rows, dtype=torch.long))
    flat[rows] = torch.randn(len(rows), *shape[2:], generator=g)
    return cache.to(dtype).to(device)


def mla_inputs(device, T, H, g):
    dtype = dtype_for(device)
    qbuf = torch.randn(T, H, 576, generator=g).to(dtype).to(device)  # q_latent, q_pe: column slices of one tensor
    return dtype, qbuf[..., :512], qbuf[..., 512:]


@pytest.mark.parametrize("device", DEVICES)
def test_mla_slot_ids_minus_one_topk_length_strided_q(device):
    g = torch.Generator().manual_seed(21)
    T, H, topk, nb, bs = 4, 64, 96, 40, 64
    dtype, q_lat, q_pe = mla_inputs(device, T, H, g)
    slots = torch.randint(0, nb * bs, (T, topk), generator=g, dtype=torch.int32)
    slots[0, ::4] = -1
    slots[3] = -1  # nothing selected
    topk_length = torch.tensor([topk, 50, 0, topk], dtype=torch.int32)
    kept = [row[:n][row[:n] >= 0].long() for row, n in zip(slots, topk_length.tolist())]
    kv = nan_cache((nb, bs, 576), torch.cat(kept), dtype, device, g)
    dec = ops.MlaSparseDecoder(T, topk, H, device=device)
    lse = torch.full((T, H), float("nan"), device=device)
    o, _ = dec(q_lat, q_pe, kv, slots.to(device), scale=576 ** -0.5, topk_length=topk_length.to(device), lse=lse)
    rows = kv.reshape(-1, 576)
    for t in range(T):
        ref, ref_lse = ref_attention(q_lat[t], rows[kept[t], :512], rows[kept[t], :512], 576 ** -0.5, q_pe[t],
                                     rows[kept[t], 512:])
        assert_close(o[t], ref, dtype)
        torch.testing.assert_close(lse[t].double().cpu(), ref_lse, atol=1e-3, rtol=1e-3)
    assert (o[2] == 0).all() and (o[3] == 0).all() and torch.isneginf(lse[3]).all()
    # The engine entry point agrees.
    o2, _ = sp.engine.mla_decode_slots(q_lat, q_pe, kv, slots.to(device), scale=576 ** -0.5,
                                       topk_length=topk_length.to(device))
    torch.testing.assert_close(o2, o)


@pytest.mark.parametrize("device", DEVICES)
def test_mla_positions_resolved_through_the_block_table(device):
    g = torch.Generator().manual_seed(22)
    T, H, topk, nb, bs = 3, 16, 80, 60, 16
    dtype, q_lat, q_pe = mla_inputs(device, T, H, g)
    table = torch.stack([torch.randperm(nb, generator=g)[:12] for _ in range(2)]).int()
    token_to_request = torch.tensor([1, 0, 1], dtype=torch.int32)  # two tokens of request 1 (MTP)
    positions = torch.randint(0, 12 * bs, (T, topk), generator=g, dtype=torch.int32)
    positions[2, 40:] = -1
    kept = []
    for t in range(T):
        p = positions[t][positions[t] >= 0].long()
        kept.append(table[token_to_request[t]].long()[p // bs] * bs + p % bs)
    kv = nan_cache((nb, bs, 576), torch.cat(kept), dtype, device, g)
    dec = ops.MlaSparseDecoder(T, topk, H, device=device)
    o, _ = dec.from_positions(q_lat, q_pe, kv, positions.to(device), table.to(device), scale=0.04,
                              token_to_request=token_to_request.to(device))
    rows = kv.reshape(-1, 576)
    for t in range(T):
        ref, _ = ref_attention(q_lat[t], rows[kept[t], :512], rows[kept[t], :512], 0.04, q_pe[t], rows[kept[t], 512:])
        assert_close(o[t], ref, dtype)
    o2, _ = sp.engine.mla_decode_positions(q_lat, q_pe, kv, positions.to(device), table.to(device),
                                           token_to_request.to(device), scale=0.04)
    torch.testing.assert_close(o2, o)


def paged_kv_case(device, block_size, g, *, S=4, Hkv=2, G=8, D=128, nb=80, max_blocks=9):
    dtype = dtype_for(device)
    Hq = Hkv * G
    lens = torch.tensor([max_blocks * block_size - 5, 0, block_size + 3, 2 * block_size][:S], dtype=torch.int32)
    tables = torch.stack([torch.randperm(nb, generator=g)[:max_blocks] for _ in range(S)]).int()
    for b in range(S):  # blocks past a sequence's length are never read
        tables[b, (int(lens[b]) + block_size - 1) // block_size:] = 2 ** 30
    slots = [tables[b, :].long()[torch.arange(int(lens[b])) // block_size] * block_size +
             torch.arange(int(lens[b])) % block_size for b in range(S)]
    k_cache = nan_cache((nb, block_size, Hkv, D), torch.cat(slots), dtype, device, g)
    v_cache = nan_cache((nb, block_size, Hkv, D), torch.cat(slots), dtype, device, g)
    qkv = torch.randn(S, (Hq + 2 * Hkv) * D, generator=g).to(dtype).to(device)
    q = qkv[:, :Hq * D].view(S, Hq, D)  # a slice of a packed QKV tensor
    return dict(dtype=dtype, q=q, k=k_cache, v=v_cache, tables=tables.to(device), lens=lens.to(device),
                slots=slots, S=S, Hkv=Hkv, G=G, D=D, max_blocks=max_blocks, block_size=block_size)


def check_paged_kv(c, o, lse, scale):
    fk, fv = c["k"].reshape(-1, c["Hkv"], c["D"]), c["v"].reshape(-1, c["Hkv"], c["D"])
    G = c["G"]
    for b in range(c["S"]):
        for h in range(c["Hkv"]):
            ref, ref_lse = ref_attention(c["q"][b, h * G:(h + 1) * G], fk[c["slots"][b], h], fv[c["slots"][b], h], scale)
            assert_close(o[b, h * G:(h + 1) * G], ref, c["dtype"])
            if lse is not None:
                torch.testing.assert_close(lse[b, h * G:(h + 1) * G].double().cpu(), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_paged_kv_caches_gqa_qkv_slice_and_o_slice(device, block_size):
    g = torch.Generator().manual_seed(23 + block_size)
    c = paged_kv_case(device, block_size, g)
    Hq, D = c["Hkv"] * c["G"], c["D"]
    dec = ops.PagedKVDecoder(c["S"], Hq, c["Hkv"], D, max_blocks=c["max_blocks"], block_size=block_size,
                             device=device)
    wide = torch.full((c["S"], Hq, D + 16), float("nan"), dtype=c["dtype"], device=device)
    o = wide[:, :, 8:8 + D]  # a column slice: the gaps must stay untouched
    lse = torch.empty(c["S"], Hq, device=device)
    dec(c["q"], c["k"], c["v"], c["tables"], c["lens"], scale=D ** -0.5, o=o, lse=lse)
    check_paged_kv(c, o, lse, D ** -0.5)
    assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()
    assert torch.isnan(wide[:, :, :8]).all() and torch.isnan(wide[:, :, 8 + D:]).all()
    o2, _ = sp.engine.paged_kv_decode(c["q"], c["k"], c["v"], c["tables"], c["lens"], scale=D ** -0.5)
    torch.testing.assert_close(o2, o)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_op_combines_two_launches_into_one(device):
    """Cascade attention: a shared prefix launch and a suffix launch, each with lse, merged by
    the public merge op, equal one launch over both."""
    g = torch.Generator().manual_seed(24)
    T, H, topk, nb, bs = 3, 16, 64, 30, 64
    dtype, q_lat, q_pe = mla_inputs(device, T, H, g)
    slots = torch.randint(0, nb * bs, (T, 2 * topk), generator=g, dtype=torch.int32)
    kv = torch.randn(nb, bs, 576, generator=g).to(dtype).to(device)
    whole = ops.MlaSparseDecoder(T, 2 * topk, H, device=device)
    half = ops.MlaSparseDecoder(T, topk, H, device=device)
    lse_all, lse_a, lse_b = (torch.empty(T, H, device=device) for _ in range(3))
    o_all, _ = whole(q_lat, q_pe, kv, slots.to(device), scale=0.05, lse=lse_all)
    o_a, _ = half(q_lat, q_pe, kv, slots[:, :topk].contiguous().to(device), scale=0.05, lse=lse_a)
    o_b, _ = half(q_lat, q_pe, kv, slots[:, topk:].contiguous().to(device), scale=0.05, lse=lse_b)
    merged, merged_lse = ops.merge_states(torch.stack([o_a, o_b]), torch.stack([lse_a, lse_b]))
    torch.testing.assert_close(merged.float(), o_all.float(), atol=tol(dtype), rtol=tol(dtype))
    torch.testing.assert_close(merged_lse, lse_all, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_replays_follow_lengths_that_change_on_the_device(device):
    """One decoder, its plan made once, run while the lengths change in place in their device tensor:
    on CUDA one captured graph replayed, on the CPU the same call repeated (no re-plan either way)."""
    g = torch.Generator().manual_seed(25)
    c = paged_kv_case(device, 32, g)
    Hq, D = c["Hkv"] * c["G"], c["D"]
    dec = ops.PagedKVDecoder(c["S"], Hq, c["Hkv"], D, max_blocks=c["max_blocks"], block_size=32, device=device)
    o = torch.empty(c["S"], Hq, D, dtype=c["dtype"], device=device)
    lse = torch.empty(c["S"], Hq, device=device)
    lens = c["lens"].clone()
    run = lambda: dec(c["q"], c["k"], c["v"], c["tables"], lens, scale=0.1, o=o, lse=lse)  # noqa: E731
    replay = run
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        replay = graph.replay
    else:
        run()  # as the CUDA warm-up: the lengths then change under a decoder that has run
    for step in range(3):  # the sequences grow (or shrink) on the device; no re-plan, no re-capture
        new = torch.clamp(c["lens"] - 7 * step, min=0)
        lens.copy_(new)
        o.fill_(float("nan"))
        replay()
        if device == "cuda":
            torch.cuda.synchronize()
        bs = c["block_size"]
        c2 = dict(c, slots=[c["tables"][b].long().cpu()[torch.arange(int(new[b])) // bs] * bs +
                            torch.arange(int(new[b])) % bs for b in range(c["S"])])
        check_paged_kv(c2, o, lse, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_traces_the_engine_decoders(device):
    g = torch.Generator().manual_seed(26)
    c = paged_kv_case(device, 16, g)
    Hq, D = c["Hkv"] * c["G"], c["D"]
    dec = ops.PagedKVDecoder(c["S"], Hq, c["Hkv"], D, max_blocks=c["max_blocks"], block_size=16, device=device)

    def step(q):
        o, _ = dec(q * 2, c["k"], c["v"], c["tables"], c["lens"], scale=0.05)
        return o + 1

    eager = step(c["q"])
    torch.testing.assert_close(torch.compile(step, fullgraph=True, backend="aot_eager")(c["q"]), eager)
    if device == "cuda":
        torch.testing.assert_close(torch.compile(step, fullgraph=True)(c["q"]), eager)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_slot_id_poisons_its_token_on_cuda_and_is_refused_on_the_cpu(device):
    """On CUDA the kernel poisons the bad id's token and sets the flag; the CPU refuses the call by
    name, before writing o."""
    g = torch.Generator().manual_seed(27)
    T, H, topk, nb, bs = 3, 64, 64, 20, 64
    _, q_lat, q_pe = mla_inputs(device, T, H, g)
    kv = torch.randn(nb, bs, 576, generator=g).bfloat16()
    slots = torch.randint(0, nb * bs, (T, topk), generator=g, dtype=torch.int32)
    slots[1, 5] = -2  # -1 is padding, -2 is not
    if device == "cuda":
        kv = kv.cuda()
        dec = ops.MlaSparseDecoder(T, topk, H, device="cuda")
        o, _ = dec(q_lat, q_pe, kv, slots.cuda(), scale=0.05)
        assert sp.read_decode_error_flag(dec.plan.plan, dec.workspace) != 0
        assert torch.isnan(o[1]).all() and not torch.isnan(o[0]).any() and not torch.isnan(o[2]).any()
    o_cpu = torch.full((T, H, 512), float("nan"))
    with pytest.raises(sp.Error, match=r"^decode: indices\[69\] = -2 is outside the pool \[0, 1280\)$"):
        ops.MlaSparseDecoder(T, topk, H, device="cpu")(q_lat.cpu().float(), q_pe.cpu().float(), kv.cpu().float(),
                                                       slots, scale=0.05, o=o_cpu)
    assert o_cpu.isnan().all(), "a refused call wrote o"


def test_bad_engine_inputs_raise_the_exact_error():
    g = torch.Generator().manual_seed(28)
    c = paged_kv_case("cpu", 16, g, S=2)
    dec = ops.PagedKVDecoder(2, 16, 2, 128, max_blocks=9, block_size=16, device="cpu")
    with pytest.raises(sp.Error, match=r"^paged_decode: k must be \[\.\.\., num_kv_heads = 2, head_dim\] "):
        dec(c["q"], c["k"].reshape(-1, 128), c["v"], c["tables"], c["lens"], scale=1.0)
    with pytest.raises(sp.Error, match=r"^paged_decode: seq_lens has dtype int64; expected int32$"):
        dec(c["q"], c["k"], c["v"], c["tables"], c["lens"].long(), scale=1.0)
    with pytest.raises(sp.Error, match=r"^paged_decode: indices has 3 rows but q has 2 sequences$"):
        dec(c["q"], c["k"], c["v"], torch.zeros(3, 9, dtype=torch.int32), c["lens"], scale=1.0)
    with pytest.raises(sp.Error, match=r"^decode: seq_lens\[0\] = 145 must lie in \[0, 144\]"):
        dec(c["q"], c["k"], c["v"], c["tables"], torch.tensor([145, 0], dtype=torch.int32), scale=1.0)
    with pytest.raises(sp.Error, match=r"^PagedKVDecoder: num_qo_heads = 6 is not a multiple of num_kv_heads = 4$"):
        ops.PagedKVDecoder(2, 6, 4, 128, max_blocks=9, block_size=16, device="cpu")
