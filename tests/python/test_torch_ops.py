"""torch tensors through the bindings and the torch custom ops: CPU tensors when torch is
installed (CI's torch part), CUDA tensors when a GPU and a CUDA build of sparsepage are present
(the GPU machine, torch 2.11)."""

import numpy as np
import pytest

import sparsepage as sp
from reference import attend, merge

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
ops = pytest.importorskip("sparsepage.torch_ops")

has_gpu = torch.cuda.is_available() and sp.cuda_available()
cuda_only = pytest.mark.skipif(not has_gpu, reason="needs a GPU and sparsepage built with CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


def dtype_for(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def tol(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 2e-5


def np64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def paged_case(device, *, R=6, G=8, D=128, page_size=16, pool_pages=64, lens=None, seed=0, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    dtype = dtype_for(device)
    lens = lens if lens is not None else [0, 5, 300, 77, 16, 513][:R]
    R = len(lens)
    t = sp.build_page_table_structure(lens, page_size)
    indices = torch.randint(0, pool_pages, (t.num_pages,), generator=g, dtype=torch.int32)
    kbuf = torch.randn(pool_pages * page_size, 2 * D + row_pad, generator=g).to(dtype)
    q = torch.randn(R, G, D, generator=g).to(dtype)
    to = dict(device=device)
    case = dict(q=q.to(**to), kbuf=kbuf.to(**to), indptr=torch.from_numpy(t.indptr).to(**to),
                indices=indices.to(**to), seq_lens=torch.from_numpy(t.seq_lens).to(**to), lens=lens,
                page_size=page_size, host_indptr=t.indptr, host_indices=indices.numpy(), D=D)
    case["k"] = case["kbuf"][:, :D]  # column slices of wider rows: strided pools
    case["v"] = case["kbuf"][:, D:2 * D]
    return case


def check_against_reference(case, o, lse, scale):
    q, k, v = np64(case["q"]), np64(case["k"]), np64(case["v"])
    ps = case["page_size"]
    for r, n in enumerate(case["lens"]):
        rows = [int(case["host_indices"][case["host_indptr"][r] + i // ps]) * ps + i % ps for i in range(n)]
        ref_o, ref_lse = attend(q[r], k[rows], v[rows], scale)
        np.testing.assert_allclose(np64(o[r]), ref_o, atol=tol(o.dtype), rtol=tol(o.dtype))
        if lse is not None:
            np.testing.assert_allclose(np64(lse[r]), ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [0, 64])
def test_paged_decode_op_matches_reference(device, split):
    c = paged_case(device)
    plan = ops.DecodePlan(c["lens"], group_size=8, head_dim_qk=128, head_dim_v=128, device=device,
                          fixed_chunk_tokens=split)
    ws = plan.new_workspace()
    scale = 128 ** -0.5
    o, lse = ops.paged_decode(plan, c["q"], c["k"], c["v"], c["indptr"], c["indices"], c["seq_lens"],
                              page_size=c["page_size"], scale=scale, workspace=ws)
    assert o.shape == (6, 8, 128) and o.dtype == c["q"].dtype and lse.dtype == torch.float32
    check_against_reference(c, o, lse, scale)
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all()  # the empty request
    o2 = torch.full_like(o, float("nan"))
    ops.paged_decode_out(plan, c["q"], c["k"], c["v"], c["indptr"], c["indices"], c["seq_lens"],
                         page_size=c["page_size"], scale=scale, workspace=ws, o=o2)
    torch.testing.assert_close(o2, o)
    if device == "cuda":
        assert sp.read_decode_error_flag(plan.plan, ws) == 0


def test_bad_input_errors_pass_through_the_op():
    c = paged_case("cpu", R=2, lens=[3, 4])
    plan = ops.DecodePlan(c["lens"], group_size=8, head_dim_qk=128, head_dim_v=128)
    with pytest.raises(sp.Error, match=r"^paged_decode: indices has dtype int64; expected int32$"):
        ops.paged_decode(plan, c["q"], c["k"], c["v"], c["indptr"], c["indices"].long(), c["seq_lens"],
                         page_size=16, scale=1.0, workspace=plan.new_workspace())


@pytest.mark.parametrize("device", DEVICES)
def test_the_op_takes_its_plan_as_data(device):
    """No registry: the op runs from plan_info (a CPU int64 tensor) alone, after the DecodePlan
    that made it is gone, and a plan rebuilt from that data is the same plan."""
    assert not hasattr(ops, "_PLANS")
    c = paged_case(device)
    plan = ops.DecodePlan(c["lens"], group_size=8, head_dim_qk=128, head_dim_v=128, device=device,
                          fixed_chunk_tokens=64)
    ws = plan.new_workspace()
    info = plan.plan_info
    assert info.dtype == torch.int64 and info.device.type == "cpu" and info.dim() == 1
    rebuilt = ops.DecodePlan.from_plan_info(info, device=device)
    assert rebuilt.seq_lens == plan.seq_lens and rebuilt.workspace_bytes == plan.workspace_bytes
    torch.testing.assert_close(rebuilt.plan_info, info, rtol=0, atol=0)
    assert (torch.from_numpy(rebuilt.plan.work) == torch.from_numpy(plan.plan.work)).all()
    del plan, rebuilt
    o, lse = torch.ops.sparsepage.paged_decode(info, c["q"], c["k"], c["v"], c["indptr"], c["indices"],
                                               c["seq_lens"], None, None, None, ws, c["page_size"], 128 ** -0.5, -1,
                                               0, 0, 1, False, None, None, 0)
    check_against_reference(c, o, lse, 128 ** -0.5)
    with pytest.raises(sp.Error, match=r"^deserialize_decode_plan: .*truncated or padded"):
        ops.DecodePlan.from_plan_info(info[:-1])


@pytest.mark.parametrize("device", DEVICES)
def test_merge_states_op(device):
    g = torch.Generator().manual_seed(3)
    o = torch.randn(3, 4, 5, 64, generator=g)
    lse = torch.randn(3, 4, 5, generator=g)
    lse[1] = float("-inf")
    lse[:, 2, 3] = float("-inf")
    merged, merged_lse = ops.merge_states(o.to(device), lse.to(device))
    ref_o, ref_lse = merge(o.numpy().reshape(3, 20, 64), lse.numpy().reshape(3, 20))  # fp64
    np.testing.assert_allclose(merged.cpu().numpy().reshape(20, 64), ref_o, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(merged_lse.cpu().numpy().reshape(20), ref_lse, rtol=1e-6)
    assert (merged[2, 3] == 0).all() and merged_lse[2, 3] == float("-inf"), "a row no state saw"
    a, la = ops.merge_state(o[0].to(device), lse[0].to(device), o[2].to(device), lse[2].to(device))
    b, lb = ops.merge_states(o[[0, 2]].to(device), lse[[0, 2]].to(device))
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_traces_the_op(device):
    c = paged_case(device, R=3, lens=[40, 0, 100])
    plan = ops.DecodePlan(c["lens"], group_size=8, head_dim_qk=128, head_dim_v=128, device=device)
    ws = plan.new_workspace()

    def step(q):
        o, lse = ops.paged_decode(plan, q * 2, c["k"], c["v"], c["indptr"], c["indices"], c["seq_lens"],
                                  page_size=16, scale=0.05, workspace=ws)
        return o + 1, lse

    eager = step(c["q"])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(c["q"])
    torch.testing.assert_close(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1])
    if device == "cuda":
        inductor = torch.compile(step, fullgraph=True)(c["q"])
        torch.testing.assert_close(inductor[0], eager[0])


@cuda_only
def test_cuda_graph_capture_and_replay():
    c = paged_case("cuda")
    plan = ops.DecodePlan(c["lens"], group_size=8, head_dim_qk=128, head_dim_v=128, device="cuda")
    ws = plan.new_workspace()
    o = torch.empty(6, 8, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(6, 8, dtype=torch.float32, device="cuda")
    q = c["q"].clone()
    run = lambda: ops.paged_decode_out(plan, q, c["k"], c["v"], c["indptr"], c["indices"], c["seq_lens"],  # noqa: E731
                                       page_size=16, scale=0.1, workspace=ws, o=o, lse=lse)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up off the default stream, as torch recommends before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(torch.randn_like(q))
    o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    c["q"] = q
    check_against_reference(c, o, lse, 0.1)


@cuda_only
def test_runs_on_the_current_stream():
    c = paged_case("cuda")
    plan = ops.DecodePlan(c["lens"], group_size=8, head_dim_qk=128, head_dim_v=128, device="cuda")
    ws = plan.new_workspace()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q = c["q"] * 1  # produced on the side stream
        o, lse = ops.paged_decode(plan, q, c["k"], c["v"], c["indptr"], c["indices"], c["seq_lens"], page_size=16,
                                  scale=0.1, workspace=ws)
    side.synchronize()
    check_against_reference(c, o, lse, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_mla_sparse_decoder_on_engine_cache(device):
    g = torch.Generator().manual_seed(5)
    dtype = dtype_for(device)
    T, H, topk, nb, bs = 3, 16, 64, 40, 64
    kv = torch.randn(nb, bs, 576, generator=g).to(dtype).to(device)
    q_lat = torch.randn(T, H, 512, generator=g).to(dtype).to(device)
    q_pe = torch.randn(T, H, 64, generator=g).to(dtype).to(device)
    slots = torch.randint(0, nb * bs, (T, topk), generator=g, dtype=torch.int32).to(device)
    dec = ops.MlaSparseDecoder(T, topk, H, device=device)
    lse = torch.empty(T, H, device=device)
    o, _ = dec(q_lat, q_pe, kv, slots, scale=576 ** -0.5, lse=lse)
    rows = np64(kv.reshape(-1, 576))
    for t in range(T):
        s = slots[t].cpu().numpy()
        ref, ref_lse = attend(np64(q_lat[t]), rows[s, :512], rows[s, :512], 576 ** -0.5, np64(q_pe[t]), rows[s, 512:])
        np.testing.assert_allclose(np64(o[t]), ref, atol=tol(dtype), rtol=tol(dtype))
        np.testing.assert_allclose(np64(lse[t]), ref_lse, atol=1e-3, rtol=1e-3)
    o2, _ = sp.engine.mla_decode_slots(q_lat, q_pe, kv, slots, scale=576 ** -0.5)  # the engine entry point agrees
    torch.testing.assert_close(o2, o)


def open_dispatch(enabled=True):
    c = sp.DispatchConfig.defaults()
    c.enabled = enabled
    c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0
    return c


def sp_device(device):
    return sp.Device.cuda if device == "cuda" else sp.Device.cpu


def current_stream(device):
    return torch.cuda.current_stream().cuda_stream if device == "cuda" else 0


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_decoder_on_torch_tensors(device):
    """SparseDecoder's fused path against fp64 over each request's picks, and the mask path over the
    same picks against it: bf16 CUDA tensors, or fp32 CPU tensors (the CPU backend's fp32 path)."""
    g = torch.Generator().manual_seed(7)
    dtype = dtype_for(device)
    B, Hq, Hkv, cap, L, D = 2, 16, 2, 512, 400, 128
    k = torch.randn(B, Hkv, cap, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, cap, D, generator=g).to(dtype).to(device)
    q = torch.randn(B, Hq, D, generator=g).to(dtype).to(device)
    picks = [torch.randperm(L, generator=g)[:100].sort().values.int() for _ in range(B * Hkv)]
    positions = torch.cat(picks).to(device)
    o = torch.full((B, Hq, D), float("nan"), dtype=dtype, device=device)
    dec = sp.SparseDecoder(sp_device(device), open_dispatch())
    stream = current_stream(device)
    out = dec.try_fused(q, k, v, o, positions, [100] * 4, num_kv_heads=Hkv, live_len=L, scale=D ** -0.5,
                        stream=stream)
    assert out.fused, out.describe()
    dec.check_errors(stream)
    G = Hq // Hkv
    for r, p in enumerate(picks):
        b, h = divmod(r, Hkv)
        ref, _ = attend(np64(q[b, h * G:(h + 1) * G]), np64(k[b, h, p.long()]), np64(v[b, h, p.long()]), D ** -0.5)
        np.testing.assert_allclose(np64(o[b, h * G:(h + 1) * G]), ref, atol=tol(dtype), rtol=tol(dtype))
    o_mask = torch.empty_like(o)
    sp.MaskPath(sp_device(device)).run(q, k, v, o_mask, positions, [100] * 4, num_kv_heads=Hkv, live_len=L,
                                       scale=D ** -0.5, stream=stream)
    torch.testing.assert_close(o_mask, o, atol=tol(dtype), rtol=tol(dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_layers_fused_equal_the_mask_path(device):
    """Each layer with the dispatch open (fused) and shut (mask path), stepped on the same inputs past
    its dense regime: the outputs agree within the cache dtype's rounding (bf16 CUDA tensors; f16 CPU
    tensors, the layers' caches being f16 or bf16)."""
    g = torch.Generator().manual_seed(11)
    stream = current_stream(device)
    dtype, sdtype = (torch.bfloat16, sp.DType.bf16) if device == "cuda" else (torch.float16, sp.DType.f16)
    close = dict(atol=2e-2, rtol=2e-2) if device == "cuda" else dict(atol=4e-3, rtol=4e-3)
    bs_cfg = sp.BlockSparseConfig(num_qo_heads=16, num_kv_heads=2, head_dim=128, block_size=16, topk_blocks=2,
                                  capacity_step=256)
    layers = [sp.BlockSparseAttention(sp_device(device), sdtype, bs_cfg, 1, open_dispatch(on)) for on in (True, False)]
    for _ in range(80):
        args = [torch.randn(*s, generator=g).to(dtype).to(device) for s in ((1, 16, 128), (1, 2, 128), (1, 3, 1, 128),
                                                                             (1, 2, 1, 128))]
        outs = [torch.empty(1, 16, 128, dtype=dtype, device=device) for _ in layers]
        steps = [layer.decode(*args, o, stream=stream) for layer, o in zip(layers, outs)]
    assert steps[0].sparse and steps[0].fused and not steps[1].fused
    torch.testing.assert_close(outs[0], outs[1], **close)

    dsa_cfg = sp.DsaConfig(num_qo_heads=16, index_heads=4, index_head_dim=64, index_topk=64, capacity_step=256)
    layers = [sp.DsaAttention(sp_device(device), sdtype, dsa_cfg, 2, open_dispatch(on)) for on in (True, False)]
    for _ in range(90):
        args = [torch.randn(*s, generator=g).to(dtype).to(device) for s in ((2, 16, 512), (2, 16, 64), (2, 4, 64))]
        args.append(torch.rand(2, 4, generator=g).to(device))
        args += [torch.randn(*s, generator=g).to(dtype).to(device) for s in ((2, 1, 1, 576), (2, 1, 1, 64))]
        outs = [torch.empty(2, 16, 512, dtype=dtype, device=device) for _ in layers]
        steps = [layer.decode(*args, o, stream=stream) for layer, o in zip(layers, outs)]
    assert steps[0].sparse and steps[0].fused and not steps[1].fused, steps[0].outcome.describe()
    torch.testing.assert_close(outs[0], outs[1], **close)


@cuda_only
def test_dsa_indexer_cuda_matches_cpu():
    g = torch.Generator().manual_seed(13)
    cfg = sp.DsaConfig(num_qo_heads=16, index_heads=4, index_head_dim=64, index_topk=64)
    B, cap, L = 2, 512, 300
    k_cache = torch.randn(B, 1, cap, 512 + 64, generator=g).bfloat16().cuda()
    q_index = torch.randn(B, 4, 64, generator=g).bfloat16().cuda()
    weights = torch.rand(B, 4, generator=g).cuda()
    kv_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    workspace = torch.empty(sp.dsa_indexer_workspace_bytes(cfg, B, cap), dtype=torch.uint8, device="cuda")
    positions = torch.empty(B, 64, dtype=torch.int32, device="cuda")
    counts = torch.empty(B, dtype=torch.int32, device="cuda")
    sp.dsa_select_tokens_cuda(cfg, k_cache, kv_lens, cap, q_index, weights, workspace, positions, counts,
                              stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    keys = k_cache[:, 0, :L, 512:].float().cpu().contiguous().numpy()
    cpu = sp.dsa_select_tokens_cpu(cfg, B, L, q_index.float().cpu().numpy(), weights.cpu().numpy(), keys)
    assert counts.tolist() == [64] * B
    for b in range(B):
        assert sorted(positions[b].tolist()) == sorted(cpu[b].tolist())
