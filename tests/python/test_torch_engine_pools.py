"""The DSA step in DeepSeek-V3.2's FP8 form from torch, as a vLLM-style backend runs it: the engine
owns 656-byte FP8 MLA rows (quantize_mla_fp8) and vLLM's FP8 index-key blocks (write_index_keys) in
paged pools behind shuffled block tables, every byte it has not written 0xFF (NaN scales), and
passes each slot's length on the device (KVStorage.ENGINE_POOLS). One step is captured in a CUDA
graph on torch's current stream and replayed while the batch changes under it: lengths grow, a
request leaves (length 0), another joins in its slot. Each replay must equal an eager call on the
same inputs bit for bit, and the CPU backend's step over copies of the same pools: the same kept
positions and the outputs within bf16 rounding. The index queries and keys are small integers and
the head weights dyadic, so every indexer score is exact in either backend's order of summation and
the selections must be equal, ties included. (With random ones, one of this run's 24 selections
kept position 1300 where the CPU kept 547: a near-tie at the cut that the FP8 tensor cores and the
CPU twin round differently, which moved that slot's output by 1e-1 relative L2 since the two rows'
attention weights differ.) That case runs on the GPU machine (skipped without a GPU). Wherever torch
is installed, the same schedule also runs on the CPU backend with CPU tensors, eagerly, each step
against a fresh CPU layer's (the same kept positions, the same bits). Skips without torch."""

import pytest

import sparsepage as sp
from layer_backends import gates_off

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not (torch.cuda.is_available() and sp.cuda_available()),
                                                                reason="needs a GPU and sparsepage built with CUDA"))]

BLOCK = 64  # vLLM's block size for both pools
H, L, R, IH, ID, TOPK = 16, 512, 64, 64, 128, 256
MAX_LEN = 2048


def config():
    return sp.DsaConfig(num_qo_heads=H, latent_dim=L, rope_dim=R, index_heads=IH, index_head_dim=ID, index_topk=TOPK,
                        capacity_step=256, kv_storage=sp.KVStorage.ENGINE_POOLS)


class Engine:
    """The engine's side: pools, block tables, lengths, and its cache writes."""

    def __init__(self, batch, gen, device="cuda"):
        self.device = device
        max_blocks = MAX_LEN // BLOCK
        self.num_blocks = batch * max_blocks + 5
        ids = torch.randperm(self.num_blocks, generator=gen).to(torch.int32)
        self.table = ids[: batch * max_blocks].reshape(batch, max_blocks).to(device)
        self.kv = torch.full((self.num_blocks, BLOCK, 656), 0xFF, dtype=torch.uint8, device=device)
        self.keys = torch.full((self.num_blocks, BLOCK, ID + 4), 0xFF, dtype=torch.uint8, device=device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.gen = gen

    def stream(self):
        return torch.cuda.current_stream().cuda_stream if self.device == "cuda" else 0

    def slots(self, b, first, n):
        pos = torch.arange(first, first + n)
        return (self.table[b].cpu()[pos // BLOCK].to(torch.int64) * BLOCK + pos % BLOCK).to(self.device)

    def write(self, b, first, n):
        """n new tokens of sequence b at positions first..: MLA rows and index keys."""
        rows = torch.randn(n, L + R, generator=self.gen).to(torch.bfloat16).to(self.device)
        keys = torch.randint(-3, 4, (n, ID), generator=self.gen).to(torch.bfloat16).to(self.device)  # exact in e4m3
        slots = self.slots(b, first, n)
        staged = torch.empty(n, 656, dtype=torch.uint8, device=self.device)
        sp.quantize_mla_fp8(rows, staged, self.stream())
        self.kv.view(-1, 656)[slots] = staged
        sp.write_index_keys(self.keys, keys, slots)


def queries(batch, gen, device="cuda"):
    return (torch.randn(batch, H, L, generator=gen).to(torch.bfloat16).to(device),
            torch.randn(batch, H, R, generator=gen).to(torch.bfloat16).to(device),
            torch.randint(-3, 4, (batch, IH, ID), generator=gen).to(torch.bfloat16).to(device),
            torch.randint(1, 5, (batch, IH), generator=gen).float().to(device) / 4)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def cpu_step(eng, q, o_shape):
    """The same step on the CPU backend over host copies of the engine's pools."""
    layer = sp.DsaAttention(sp.Device.cpu, sp.DType.bf16, config(), o_shape[0], gates_off())
    layer.reserve(MAX_LEN)
    o = torch.full(o_shape, float("nan"), dtype=torch.bfloat16)
    host = [t.cpu() for t in q]
    layer.decode_pools(*host, o, eng.kv.cpu(), eng.table.cpu(), eng.lens.cpu(), MAX_LEN, eng.keys.cpu())
    return o, layer.last_selected_positions()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_pools_step_replayed_from_one_graph_follows_a_changing_batch(device):
    """On the CPU backend (CPU tensors, no graph) the one layer steps eagerly while the batch changes,
    and each step must equal, bit for bit, a fresh layer's step over the same pools."""
    cuda = device == "cuda"
    gen = torch.Generator().manual_seed(11)
    B = 4
    eng = Engine(B, gen, device)
    start = [0, 150, 700, 1300]  # a free slot, one inside the top-k, two past it
    for b, n in enumerate(start):
        if n:
            eng.write(b, 0, n)
    eng.lens.copy_(torch.tensor(start, dtype=torch.int32))
    layer = sp.DsaAttention(sp.Device.cuda if cuda else sp.Device.cpu, sp.DType.bf16, config(), B, gates_off())
    layer.reserve(MAX_LEN)
    q = queries(B, gen, device)
    o_graph = torch.full((B, H, L), float("nan"), dtype=torch.bfloat16, device=device)
    o_eager = torch.full_like(o_graph, float("nan"))

    def step(out):
        return layer.decode_pools(*q, out, eng.kv, eng.table, eng.lens, MAX_LEN, eng.keys)

    s = step(o_eager)  # eager first: plans and sizes everything the capture reuses
    assert s.fused, s.outcome.describe()
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(o_graph)

    def check(lens):
        o_graph.fill_(float("nan"))
        if cuda:
            graph.replay()
        else:
            assert step(o_graph).fused
        o_eager.fill_(float("nan"))
        step(o_eager)
        if cuda:
            torch.cuda.synchronize()
        layer.check_errors()
        assert not torch.isnan(o_graph).any(), "a replay left an output unwritten or read a poisoned row"
        assert torch.equal(o_graph, o_eager), "the replay differs from an eager step on the same inputs"
        for b, n in enumerate(lens):
            if n == 0:
                assert torch.all(o_graph[b] == 0), f"free slot {b} must write zeros"
        ref, ref_sel = cpu_step(eng, q, (B, H, L))
        sel = layer.last_selected_positions()
        if not cuda:
            assert torch.equal(o_graph, ref), "the layer's step differs from a fresh layer's on the same inputs"
        for b, n in enumerate(lens):
            assert sorted(sel[b]) == sorted(ref_sel[b]), f"slot {b} (length {n}): the kept positions differ"
            if n:
                err = rel_l2(o_graph[b].cpu(), ref[b])
                assert err < 2e-2, f"slot {b} (length {n}): relative L2 {err:.2e} against the CPU backend"

    check(start)
    lens = list(start)
    for step_no in range(6):
        # Every live request gains a token; at step 2 request 1 leaves and at step 3 a new one
        # joins its slot with a 400-token prompt; slot 0 joins at step 4.
        for b in range(B):
            if lens[b]:
                eng.write(b, lens[b], 1)
                lens[b] += 1
        if step_no == 2:
            lens[1] = 0
        if step_no == 3:
            eng.write(1, 0, 400)
            lens[1] = 400
        if step_no == 4:
            eng.write(0, 0, 90)
            lens[0] = 90
        eng.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for t, fresh in zip(q, queries(B, gen, device)):
            t.copy_(fresh)
        check(lens)
