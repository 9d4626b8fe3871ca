"""Continuous batching from torch: requests join a layer's batch (admit) and leave it (release)
between steps, each slot with its own length, for the three layers over their own caches. A
schedule admits prompts of different lengths (one within the block-sparse dense regime beside
sparse ones), releases a slot, reuses it and a free one, and decodes in between. At every step
each live slot must keep the positions its request keeps when it runs alone in a batch-1 layer
of the same backend, and its output must match that lone run (relative L2 below 1e-2; outputs
NaN-poisoned first); a free slot writes zeros and keeps nothing. On CUDA one step is captured in a
torch graph and replayed for every later step while the batch changes under it (torch's
current stream). Runs on CPU tensors (f16) wherever torch is installed, on CUDA tensors (bf16)
on the GPU machine."""

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import gates_off, quarter_grid

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
has_gpu = torch.cuda.is_available() and sp.cuda_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not has_gpu, reason="needs a GPU and sparsepage "
                                                                                     "built with CUDA"))]
B = 3
# (event, slot, prompt length): the batch changes under the steps.
SCHEDULE = [("admit", 0, 300), ("admit", 1, 40), ("release", 2, 0), ("step",), ("step",),
            ("release", 0, 0), ("admit", 2, 200), ("step",), ("admit", 0, 120), ("step",), ("step",)]
CAPACITY = 320


class BlockSparse:
    """8 / 2 heads, dim 128, blocks of 64, top-2: a slot is sparse past 256 tokens."""
    @property
    def cfg(self):  # made on use: no binding object outlives the test module
        return sp.BlockSparseConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128, block_size=64, topk_blocks=2,
                                    local_blocks=1, capacity_step=64)

    def layer(self, device, dtype, batch):
        return sp.BlockSparseAttention(device, dtype, self.cfg, batch, gates_off())

    def prompt(self, rng, n):  # k [K heads + index key, n, D], v [K heads, n, D]
        c = self.cfg
        return quarter_grid(rng, c.num_kv_heads + 1, n, c.head_dim), quarter_grid(rng, c.num_kv_heads, n, c.head_dim)

    def step_inputs(self, rng, batch):
        c = self.cfg
        Hq, H, D = c.num_qo_heads, c.num_kv_heads, c.head_dim
        return [quarter_grid(rng, batch, Hq, D), quarter_grid(rng, batch, H, D), quarter_grid(rng, batch, H + 1, 1, D),
                quarter_grid(rng, batch, H, 1, D)]

    def out_shape(self, batch):
        return (batch, self.cfg.num_qo_heads, self.cfg.head_dim)

    def decode(self, layer, ins, o, stream):
        return layer.decode(*ins, o, stream)


class Dsa:
    """16 heads, latent 512 + rope 64, 4 index heads of 128, top-64."""
    @property
    def cfg(self):
        return sp.DsaConfig(num_qo_heads=16, latent_dim=512, rope_dim=64, index_heads=4, index_head_dim=128,
                            index_topk=64, capacity_step=64)

    fp32_inputs = (3,)  # the index weights

    def layer(self, device, dtype, batch):
        return sp.DsaAttention(device, dtype, self.cfg, batch, gates_off())

    def prompt(self, rng, n):  # k [1, n, latent + index key], v [1, n, rope]
        c = self.cfg
        return quarter_grid(rng, 1, n, c.latent_dim + c.index_head_dim), quarter_grid(rng, 1, n, c.rope_dim)

    def step_inputs(self, rng, batch):
        c = self.cfg
        H, L, R, IH, ID = c.num_qo_heads, c.latent_dim, c.rope_dim, c.index_heads, c.index_head_dim
        return [quarter_grid(rng, batch, H, L), quarter_grid(rng, batch, H, R), quarter_grid(rng, batch, IH, ID),
                rng.integers(1, 5, size=(batch, IH)) / 4,  # dyadic fp32 weights: exact scores
                quarter_grid(rng, batch, 1, 1, L + ID), quarter_grid(rng, batch, 1, 1, R)]

    def out_shape(self, batch):
        return (batch, self.cfg.num_qo_heads, self.cfg.latent_dim)

    def decode(self, layer, ins, o, stream):
        return layer.decode(*ins[:4], ins[4], ins[5], o, stream)


class Static:
    """8 / 2 heads, dim 128, blocks of 64, 2 local blocks, vertical stride 2."""
    @property
    def cfg(self):
        return sp.StaticBlockSparseConfig(num_qo_heads=8, num_kv_heads=2, head_dim=128, block_size=64, local_blocks=2,
                                          vert_stride=2, capacity_step=64)

    def layer(self, device, dtype, batch):
        return sp.StaticBlockSparseAttention(device, dtype, self.cfg, batch, gates_off())

    def prompt(self, rng, n):  # k and v [K heads, n, D]
        c = self.cfg
        return quarter_grid(rng, c.num_kv_heads, n, c.head_dim), quarter_grid(rng, c.num_kv_heads, n, c.head_dim)

    def step_inputs(self, rng, batch):
        c = self.cfg
        return [quarter_grid(rng, batch, c.num_qo_heads, c.head_dim),
                quarter_grid(rng, batch, c.num_kv_heads, 1, c.head_dim),
                quarter_grid(rng, batch, c.num_kv_heads, 1, c.head_dim)]

    def out_shape(self, batch):
        return (batch, self.cfg.num_qo_heads, self.cfg.head_dim)

    def decode(self, layer, ins, o, stream):
        return layer.decode(*ins, o, stream)


class Tensors:
    """Where the test's tensors live: CPU tensors in f16, or CUDA tensors in bf16."""

    def __init__(self, device):
        self.cuda = device == "cuda"
        self.device = sp.Device.cuda if self.cuda else sp.Device.cpu
        self.dtype = sp.DType.bf16 if self.cuda else sp.DType.f16
        self.torch_dtype = torch.bfloat16 if self.cuda else torch.float16

    def put(self, a, fp32=False):
        t = torch.from_numpy(np.ascontiguousarray(a, np.float32))
        return t.to("cuda" if self.cuda else "cpu", torch.float32 if fp32 else self.torch_dtype)

    def poisoned(self, shape):
        return torch.full(shape, float("nan"), dtype=self.torch_dtype, device="cuda" if self.cuda else "cpu")

    def get(self, t):
        if self.cuda:
            torch.cuda.synchronize()
        return t.float().cpu().numpy().copy()

    def stream(self):
        return torch.cuda.current_stream().cuda_stream if self.cuda else None


def relative_l2(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", [BlockSparse(), Dsa(), Static()], ids=["block_sparse", "dsa", "static"])
def test_slots_join_and_leave_and_each_matches_its_lone_run(device, model):
    rng = np.random.default_rng(17)
    ts = Tensors(device)
    batched = model.layer(ts.device, ts.dtype, B)
    batched.reserve(CAPACITY)
    probe = model.step_inputs(rng, B)  # the step's tensors, refilled in place before each step
    fp32 = getattr(model, "fp32_inputs", ())
    ins = [ts.put(a, i in fp32) for i, a in enumerate(probe)]
    o = ts.poisoned(model.out_shape(B))
    lone = {}  # slot -> its request's batch-1 layer
    graph, steps, admitted, released = None, 0, 0, 0
    for event in SCHEDULE:
        if event[0] == "admit":
            _, slot, n = event
            k, v = model.prompt(rng, n)
            batched.admit(slot, ts.put(k), ts.put(v), ts.stream())
            alone = model.layer(ts.device, ts.dtype, 1)
            alone.reserve(CAPACITY)
            alone.admit(0, ts.put(k), ts.put(v), ts.stream())
            lone[slot] = alone
            admitted += 1
            continue
        if event[0] == "release":
            batched.release(event[1], ts.stream())
            lone.pop(event[1], None)
            released += 1
            continue
        new = model.step_inputs(rng, B)
        for i, (t, a) in enumerate(zip(ins, new)):
            t.copy_(ts.put(a, i in fp32))
        o.fill_(float("nan"))
        if not ts.cuda or steps == 0:  # eager (the first CUDA step sizes what the graph reads)
            assert model.decode(batched, ins, o, ts.stream()).fused
        elif graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model.decode(batched, ins, o, ts.stream())
            graph.replay()
        else:
            graph.replay()
        if graph is not None:
            batched.sync_live_len(ts.stream())  # after a replay the host's lengths are stale
        got = ts.get(o)
        sel = batched.last_selected_positions()
        rows = len(sel) // B
        steps += 1
        for slot in range(B):
            mine = sel[slot * rows:(slot + 1) * rows]
            if slot not in lone:
                assert np.all(got[slot] == 0), f"step {steps}: free slot {slot} wrote {got[slot]}"
                assert all(len(s) == 0 for s in mine), f"step {steps}: free slot {slot} kept positions"
                continue
            alone = lone[slot]
            o1 = ts.poisoned(model.out_shape(1))
            assert model.decode(alone, [t[slot:slot + 1] for t in ins], o1, ts.stream()).fused
            want = ts.get(o1)[0]
            assert alone.kv_len == batched.kv_lens[slot], f"step {steps}: slot {slot}'s length"
            assert [sorted(s) for s in mine] == [sorted(s) for s in alone.last_selected_positions()], \
                f"step {steps}: slot {slot} kept other positions than its lone run"
            assert np.isfinite(got[slot]).all(), f"step {steps}: slot {slot} has NaN"
            assert relative_l2(got[slot], want) < 1e-2, f"step {steps}: slot {slot} differs from its lone run"
    assert steps == 5 and admitted == 4 and released == 2
    assert sorted(lone) == [0, 1, 2]
    assert batched.kv_lens == [120 + 2, 40 + 5, 200 + 3]
