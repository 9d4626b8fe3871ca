"""An engine step that prefills one request's chunk while others decode, over the engine's own pools
(KVStorage.ENGINE_POOLS), from Python: prefill_pools with seq_lens nonzero only for the prefilling
slot, then decode_pools with them nonzero only for the decoding ones. Three slots over four steps:
slot 0 prefills two chunks then decodes, slot 1 decodes every step, slot 2 decodes then leaves.
Every participating slot's rows must equal, bit for bit, the same request alone in its call on a
twin layer (one max_seq_len for every call), and attend something; the rows of slots not in a call
are zero; the other slots' query rows are NaN in every call; the pools are unchanged. Both layers,
on the CPU backend with numpy arrays and with torch CPU tensors (f16; the latter skipped, saying so,
without torch), and on the GPU with torch CUDA tensors (bf16; skipped, saying so, without torch or
a GPU)."""

import numpy as np
import pytest

import sparsepage as sp
from layer_backends import NumpyF16, TorchBf16, TorchF16, gates_off, quarter_grid

BLOCK = 16  # the engine's block size, for both pools
STEPS, B = 4, 3


@pytest.fixture(params=["numpy-cpu", "torch-cpu", "torch-cuda"])
def backend(request):
    if request.param == "numpy-cpu":
        return NumpyF16()
    torch = pytest.importorskip("torch", reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
    if request.param == "torch-cpu":
        return TorchF16(torch)
    if not (torch.cuda.is_available() and sp.cuda_available()):
        pytest.skip("needs a GPU and sparsepage built with CUDA")
    return TorchBf16(torch)


class Schedule:
    def __init__(self, chunk, prompt1, prompt2):
        self.chunk, self.prompts = chunk, (prompt1, prompt2)

    def part(self, step, slot):
        if slot == 0:
            return "prefill" if step < 2 else "decode"
        return None if slot == 2 and step == STEPS - 1 else "decode"

    def length(self, step, slot):
        """The slot's length with this step's tokens."""
        if slot == 0:
            return self.chunk * (step + 1) if step < 2 else 2 * self.chunk + step - 1
        return self.prompts[slot - 1] + step + 1

    def longest(self, slot):
        return max(self.length(s, slot) for s in range(STEPS) if self.part(s, slot))


class Block:
    """BlockSparseAttention: K and V pools [num_blocks, BLOCK, Hkv, D], index keys [num_blocks, BLOCK, D]."""

    def __init__(self, gpu):
        d, self.bs = (128, 64) if gpu else (16, 8)  # the GPU prefill indexer: head_dim 128, 64-token blocks
        self.hq, self.h, self.d = 8, 2, d
        self.schedule = Schedule(2 * self.bs, 5 * self.bs + 3, self.bs + 5)
        self.fields = [(self.hq, d), (self.h, d)]
        self.o_shape, self.row_shape, self.pools, self.key_dim = (self.hq, d), (self.h, d), 2, d

    def layer(self, be):
        c = sp.BlockSparseConfig(num_qo_heads=self.hq, num_kv_heads=self.h, head_dim=self.d, block_size=self.bs,
                                 topk_blocks=2, local_blocks=1, capacity_step=256,
                                 kv_storage=sp.KVStorage.ENGINE_POOLS)
        return sp.BlockSparseAttention(be.device, be.dtype, c, B, gates_off())

    def call(self, layer, be, part, inputs, o, pools, table, lens, bound, keys):
        q, iq = inputs
        if part == "prefill":
            layer.prefill_pools(q, iq, o, pools[0], pools[1], table, lens, bound, keys)
        else:
            layer.decode_pools(q, iq, o, pools[0], pools[1], table, lens, bound, keys)


class Dsa:
    """DsaAttention: MLA rows [num_blocks, BLOCK, 512 + 64], index keys [num_blocks, BLOCK, index_head_dim]."""

    def __init__(self, gpu):
        # The GPU: 64 query heads per CTA, the indexer's production 64 index heads x 128.
        self.h, self.ih, self.key_dim, self.topk = (64, 64, 128, 64) if gpu else (4, 4, 64, 24)
        self.schedule = Schedule(48, 100, 30) if gpu else Schedule(16, 50, 10)
        self.fields = [(self.h, 512), (self.h, 64), (self.ih, self.key_dim), (self.ih,)]
        self.o_shape, self.row_shape, self.pools = (self.h, 512), (576,), 1

    def layer(self, be):
        c = sp.DsaConfig(num_qo_heads=self.h, latent_dim=512, rope_dim=64, index_heads=self.ih, index_head_dim=self.key_dim,
                         index_topk=self.topk, capacity_step=256, kv_storage=sp.KVStorage.ENGINE_POOLS)
        return sp.DsaAttention(be.device, be.dtype, c, B, gates_off())

    def call(self, layer, be, part, inputs, o, pools, table, lens, bound, keys):
        q, q_pe, iq, w = inputs
        if part == "prefill":
            layer.prefill_pools(q, q_pe, iq, w, o, pools[0], table, lens, bound, keys)
        else:
            layer.decode_pools(q, q_pe, iq, w, o, pools[0], table, lens, bound, keys)


@pytest.mark.parametrize("model", [Block, Dsa], ids=["block-sparse", "dsa"])
def test_a_prefill_chunk_beside_decodes_equals_each_request_alone(backend, model):
    m = model(backend.device == sp.Device.cuda)
    sched = m.schedule
    rng = np.random.default_rng(23)
    longest = [sched.longest(b) for b in range(B)]
    max_blocks = max(longest) // BLOCK + 2
    num_blocks = B * max_blocks + 3
    table = rng.permutation(num_blocks).astype(np.int32)[: B * max_blocks].reshape(B, max_blocks)
    # The engine has written every row the scenario reaches; every other row is NaN.
    pools = [np.full((num_blocks, BLOCK) + m.row_shape, np.nan, np.float32) for _ in range(m.pools)]
    keys = np.full((num_blocks, BLOCK, m.key_dim), np.nan, np.float32)
    for b, t in enumerate(longest):
        pos = np.arange(t)
        for p in pools:
            p[table[b, pos // BLOCK], pos % BLOCK] = quarter_grid(rng, t, *m.row_shape)
        keys[table[b, pos // BLOCK], pos % BLOCK] = quarter_grid(rng, t, m.key_dim)
    dev_pools, dev_keys, dev_table = [backend.half(p) for p in pools], backend.half(keys), backend.raw(table)
    bound = max(longest) + 7  # one bound for every call, mixed or lone: the same plans

    def tokens(part):
        return sched.chunk if part == "prefill" else 1

    inputs = {}
    for s in range(STEPS):
        for b in range(B):
            part = sched.part(s, b)
            if part:
                inputs[s, b] = [quarter_grid(rng, tokens(part), *f) for f in m.fields]

    def call(layer, s, part, in_call):
        """One call over the slots in in_call (the others' query rows NaN, lengths 0); its output."""
        t = tokens(part)
        args = []
        for i, f in enumerate(m.fields):
            x = np.full((B, t) + f, np.nan, np.float32)
            for b in in_call:
                x[b] = inputs[s, b][i]
            x = x[:, 0] if part == "decode" else x  # a decode step's tensors have no token axis
            args.append(backend.f32(x) if i == 3 else backend.half(x))
        lens = np.array([sched.length(s, b) if b in in_call else 0 for b in range(B)], np.int32)
        o = backend.nan_out((B, t) + m.o_shape if part == "prefill" else (B,) + m.o_shape)
        m.call(layer, backend, part, args, o, dev_pools, dev_table, backend.raw(lens), bound, dev_keys)
        layer.check_errors()
        out = backend.get(o)
        return out if part == "prefill" else out[:, None]

    mixed, lone = m.layer(backend), m.layer(backend)
    for s in range(STEPS):
        for part in ("prefill", "decode"):
            in_call = [b for b in range(B) if sched.part(s, b) == part]
            if not in_call:
                continue
            got = call(mixed, s, part, in_call)
            for b in range(B):
                if b not in in_call:
                    assert np.all(got[b] == 0), f"step {s} {part}: slot {b} is not in the call, its rows must be zero"
                    continue
                want = call(lone, s, part, [b])[b]
                assert not np.isnan(got[b]).any() and not np.isnan(want).any(), (s, part, b)
                assert np.any(got[b] != 0), (s, part, b)
                np.testing.assert_array_equal(got[b], want, err_msg=f"step {s} {part}: slot {b} differs from alone")
    assert backend.get(dev_keys).tobytes() == backend.get(backend.half(keys)).tobytes(), "a call wrote the keys"
    for p, dp in zip(pools, dev_pools):
        assert backend.get(dp).tobytes() == backend.get(backend.half(p)).tobytes(), "a call wrote the pools"
    assert mixed.kv_lens == [0] * B, "an engine-pools layer keeps no lengths"
