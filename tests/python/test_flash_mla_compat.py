"""sparsepage.flash_mla_compat against FlashMLA's documented semantics, with caches packed here
byte by byte from the documented layouts and an fp64 reference written from the documented
definitions (never FlashMLA's code): both cache formats, -1 ids, topk_length shorter than the
rows, several query tokens, the extra cache (equal to one cache holding both sets), the
attention sink (no effect at -inf, out = 0 at +inf, the exact factor otherwise), queries that
attend nothing (out 0, lse +inf), lse's [b, h_q, s_q] layout, and bad arguments named.
Every pool byte no attended id reaches is 0xFF (NaN in every field).

The numpy tests run everywhere (without torch); the torch tests skip without torch, the
CUDA tests without a GPU."""


import numpy as np
import pytest

import sparsepage as sp
from sparsepage.flash_mla_compat import FlashMLASchedMeta, flash_mla_with_kvcache, get_mla_metadata

V32, MODEL1 = 576, 512  # d_qk of each format


# ---- the formats, packed from their documented layouts ------------------------------------------

def e4m3_value(code):
    """e4m3fn code -> float (4 exponent bits of bias 7, 3 mantissa bits; 0x7F / 0xFF NaN)."""
    code = np.asarray(code, dtype=np.int64)
    sign = np.where(code & 0x80, -1.0, 1.0)
    e, m = (code >> 3) & 0xF, code & 0x7
    value = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where((code & 0x7F) == 0x7F, np.nan, sign * value)


def bf16_bits(x):
    """float32 -> bf16 bits by truncation (the value tests use is the one these bits hold)."""
    return (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def random_codes(rng, shape):
    """e4m3 codes of moderate magnitude (exponent field 3..11, any sign and mantissa)."""
    return ((rng.integers(0, 2, shape) << 7) | (rng.integers(3, 12, shape) << 3) | rng.integers(0, 8, shape)).astype(np.uint8)


class Cache:
    """A paged FP8 cache: its bytes (a [num_blocks, block_size, 1, bytes_per_token] view), the
    dequantized key of every slot (NaN where unwritten) and which slots are written."""

    def __init__(self, rng, d_qk, num_blocks, block_size, block_pad=0, written_share=0.75):
        self.d_qk, self.num_blocks, self.block_size = d_qk, num_blocks, block_size
        slots = num_blocks * block_size
        self.keys = np.full((slots, d_qk), np.nan)
        self.written = np.flatnonzero(rng.random(slots) < written_share)
        self.poisoned = np.setdiff1d(np.arange(slots), self.written)
        if d_qk == V32:
            self.bytes_per_token = 656
            block_bytes = block_size * 656 + block_pad
            raw = np.full((num_blocks, block_bytes), 0xFF, dtype=np.uint8)
            for s in self.written:
                blk, off = divmod(int(s), block_size)
                row = raw[blk, off * 656:(off + 1) * 656]
                codes = random_codes(rng, 512)
                scales = np.ldexp(1.0, -(5 + (s + np.arange(4)) % 3)).astype(np.float32)
                rope = bf16_bits(rng.standard_normal(64))
                row[:512], row[512:528], row[528:] = codes, scales.view(np.uint8), rope.view(np.uint8)
                self.keys[s, :512] = e4m3_value(codes) * np.repeat(scales.astype(np.float64), 128)
                self.keys[s, 512:] = bf16_value(rope)
        else:
            self.bytes_per_token = 584
            block_bytes = block_size * 584 + block_pad
            raw = np.full((num_blocks, block_bytes), 0xFF, dtype=np.uint8)
            for s in self.written:
                blk, off = divmod(int(s), block_size)
                codes = random_codes(rng, 448)
                exponents = -(5 + (s + np.arange(7)) % 3)
                rope = bf16_bits(rng.standard_normal(64))
                raw[blk, off * 576:off * 576 + 448] = codes
                raw[blk, off * 576 + 448:(off + 1) * 576] = rope.view(np.uint8)
                scale_at = block_size * 576 + off * 8
                raw[blk, scale_at:scale_at + 7] = (127 + exponents).astype(np.uint8)  # byte 8 stays 0xFF: unused
                self.keys[s, :448] = e4m3_value(codes) * np.repeat(np.ldexp(1.0, exponents), 64)
                self.keys[s, 448:] = bf16_value(rope)
        self.raw = raw
        # FlashMLA's view: [num_blocks, block_size, 1, bytes_per_token] over the block's first bytes.
        self.view = np.lib.stride_tricks.as_strided(
            raw, shape=(num_blocks, block_size, 1, self.bytes_per_token),
            strides=(block_bytes, self.bytes_per_token, self.bytes_per_token, 1))

    def ids(self, rng, b, s_q, topk, lengths=None, minus_one=0.1):
        """[b, s_q, topk] int32 ids of written slots (a share -1); past lengths[b] they point at
        poisoned slots, which must never be read."""
        ids = self.written[rng.integers(0, len(self.written), (b, s_q, topk))].astype(np.int32)
        ids[rng.random((b, s_q, topk)) < minus_one] = -1
        if lengths is not None and len(self.poisoned):
            for i, n in enumerate(lengths):
                ids[i, :, n:] = self.poisoned[rng.integers(0, len(self.poisoned), (s_q, topk - n))]
        return ids


class Pool:
    """A cache tensor alone (what call() passes), for views made here."""

    def __init__(self, view):
        self.view = view


def reference(q, parts, scale, sink=None):
    """fp64 from the documented definition. parts: (cache, ids, lengths) of each cache."""
    b, s_q, h_q, _ = q.shape
    out = np.zeros((b, s_q, h_q, 512))
    lse = np.full((b, s_q, h_q), np.inf)
    for i in range(b):
        for t in range(s_q):
            keys = []
            for cache, ids, lengths in parts:
                n = ids.shape[-1] if lengths is None else lengths[i]
                keys += [cache.keys[x] for x in ids[i, t, :n] if x != -1]
            if not keys:
                continue
            k = np.stack(keys)
            s = scale * q[i, t].astype(np.float64) @ k.T  # [h_q, n]
            m = s.max(axis=1, keepdims=True)
            w = np.exp(s - m)
            total = w.sum(axis=1)
            lse[i, t] = m[:, 0] + np.log(total)
            o = (w @ k[:, :512]) / total[:, None]
            if sink is not None:
                with np.errstate(over="ignore"):  # exp(huge sink) is +inf: o's factor is 0, its limit
                    o = o / (1.0 + np.exp(sink.astype(np.float64) - lse[i, t]))[:, None]
            out[i, t] = o
    return out, lse


def check(out, lse, ref_out, ref_lse, o_tol, lse_tol=1e-4):
    """Row by row: empty rows exactly 0 / +inf, others within o_tol relative L2; lse given as
    FlashMLA returns it, [b, h_q, s_q]."""
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64).transpose(0, 2, 1)  # back to [b, s_q, h_q]
    assert np.all(np.isfinite(out)), "NaN or inf in out"
    empty = np.isinf(ref_lse)
    assert np.all(np.isposinf(lse[empty])) and np.all(out[empty] == 0.0)
    assert np.all(np.isfinite(lse[~empty]))
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=lse_tol, atol=lse_tol)
    diff = np.linalg.norm(out - ref_out, axis=-1)
    norm = np.linalg.norm(ref_out, axis=-1)
    zero = norm == 0
    assert np.all(diff[zero] == 0.0), "rows the sink drives to 0 must be 0"
    assert np.max(diff[~zero] / norm[~zero]) < o_tol


def problem(rng, d_qk=V32, b=2, s_q=2, h_q=8, topk=40, num_blocks=6, block_size=16, extra=None, lengths=True,
            sink=False, block_pad=0):
    """q (float32 holding bf16 values), the caches and their ids; extra = (topk, num_blocks, block_size)."""
    q = bf16_value(bf16_bits(rng.standard_normal((b, s_q, h_q, d_qk)))).astype(np.float32)
    main = Cache(rng, d_qk, num_blocks, block_size, block_pad)
    n = None
    if lengths:
        n = np.concatenate([[0], rng.integers(0, topk + 1, b - 2), [topk]])[:b].astype(np.int32) if b > 1 else \
            np.array([topk], np.int32)
    parts = [(main, main.ids(rng, b, s_q, topk, n), n)]
    if extra is not None:
        e_topk, e_blocks, e_bs = extra
        cache = Cache(rng, d_qk, e_blocks, e_bs, block_pad)
        e_n = rng.integers(0, e_topk + 1, b).astype(np.int32) if lengths else None
        parts.append((cache, cache.ids(rng, b, s_q, e_topk, e_n), e_n))
    sinks = None
    if sink:
        sinks = rng.uniform(-2.0, 8.0, h_q).astype(np.float32)
        sinks[1::7], sinks[2::7], sinks[3::7] = -np.inf, np.inf, 1e4
    return q, parts, sinks


def new_ids(rng, cache, ids):
    """(cache, fresh ids of ids' shape, fresh lengths) for another step over the same cache."""
    b, s_q, topk = ids.shape
    n = rng.integers(0, topk + 1, b).astype(np.int32)
    return cache, cache.ids(rng, b, s_q, topk, n), n


def call(meta, q, parts, sinks=None, scale=None, **overrides):
    main = parts[0]
    kw = dict(softmax_scale=scale, is_fp8_kvcache=True, indices=main[1], topk_length=main[2], attn_sink=sinks)
    if len(parts) > 1:
        kw.update(extra_k_cache=parts[1][0].view, extra_indices_in_kvcache=parts[1][1], extra_topk_length=parts[1][2])
    kw.update(overrides)
    return flash_mla_with_kvcache(q, main[0].view, None, None, 512, meta, **kw)


# ---- numpy, the CPU backend (CI) ----------------------------------------------------------------

@pytest.mark.parametrize("d_qk", [V32, MODEL1])
def test_matches_the_reference(rng, d_qk):
    pad = 0 if d_qk == V32 else (576 - 16 * 584 % 576) % 576  # FlashMLA pads MODEL1 blocks to 576 bytes
    q, parts, sinks = problem(rng, d_qk=d_qk, b=4, extra=(24, 5, 3), sink=True, block_pad=pad)
    meta, none = get_mla_metadata()
    assert none is None
    out, lse = call(meta, q, parts, sinks)
    assert out.shape == (4, 2, 8, 512) and out.dtype == np.float32
    assert lse.shape == (4, 8, 2) and lse.dtype == np.float32
    ref_out, ref_lse = reference(q, parts, d_qk ** -0.5, sinks)
    check(out, lse, ref_out, ref_lse, 1e-5)
    assert np.isfinite(ref_lse).sum() > ref_lse.size // 2
    # The same metadata serves a second step whose queries, ids and lengths changed.
    q2 = problem(rng, d_qk=d_qk, b=4)[0]
    parts2 = [new_ids(rng, cache, ids) for cache, ids, _ in parts]
    out2, lse2 = call(meta, q2, parts2, sinks)
    check(out2, lse2, *reference(q2, parts2, d_qk ** -0.5, sinks), 1e-5)


def test_the_extra_cache_is_one_cache_holding_both_sets(rng):
    q, parts, _ = problem(rng, b=3, topk=32, num_blocks=5, block_size=16, extra=(20, 4, 16))
    out, lse = call(get_mla_metadata()[0], q, parts, scale=0.05)
    (a, a_ids, a_n), (e, e_ids, e_n) = parts
    # One pool: the extra blocks after the main ones, each row's ids [main | extra shifted], -1 past the lengths.
    both = Pool(np.concatenate([a.view, e.view]))
    cut = lambda ids, n: np.where(np.arange(ids.shape[-1]) < np.asarray(n)[:, None, None], ids, -1)  # noqa: E731
    shifted = np.where(e_ids >= 0, e_ids + a.keys.shape[0], -1)
    ids = np.concatenate([cut(a_ids, a_n), cut(shifted, e_n)], axis=-1).astype(np.int32)
    out1, lse1 = call(get_mla_metadata()[0], q, [(both, ids, None)], scale=0.05)
    np.testing.assert_allclose(out, out1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, lse1, rtol=1e-6)
    out_main, _ = call(get_mla_metadata()[0], q, parts[:1], scale=0.05)
    assert np.abs(out - out_main).max() > 1e-3  # without the extra rows it differs: the test can fail


def test_the_sink_scales_out_by_its_share(rng):
    q, parts, _ = problem(rng, b=2, s_q=1, h_q=4, lengths=False)
    none_out, none_lse = call(get_mla_metadata()[0], q, parts)
    out, lse = call(get_mla_metadata()[0], q, parts, np.full(4, -np.inf, np.float32))
    assert np.array_equal(out, none_out) and np.array_equal(lse, none_lse)  # -inf: bit for bit nothing
    for huge in (np.inf, 1e4):
        out, lse = call(get_mla_metadata()[0], q, parts, np.full(4, huge, np.float32))
        assert np.all(out == 0.0) and np.array_equal(lse, none_lse)  # lse never includes the sink
    # sink = lse of sequence 0: its out halves.
    out, _ = call(get_mla_metadata()[0], q, parts, none_lse[0, :, 0].copy())
    np.testing.assert_allclose(out[0], none_out[0] / 2, rtol=1e-5, atol=1e-7)


def test_queries_that_attend_nothing(rng):
    q, parts, sinks = problem(rng, b=2, s_q=2, h_q=4, extra=(8, 2, 16), lengths=False, sink=True)
    parts[0][1][0] = -1  # sequence 0: no id in either cache
    parts[1][1][0] = -1
    out, lse = call(get_mla_metadata()[0], q, parts, sinks)
    assert np.all(out[0] == 0.0) and np.all(np.isposinf(lse[0]))
    assert np.all(np.isfinite(lse[1]))
    check(out, lse, *reference(q, parts, V32 ** -0.5, sinks), 1e-5)
    zero = np.zeros(2, np.int32)
    out, lse = call(get_mla_metadata()[0], q, parts, topk_length=zero, extra_topk_length=zero)
    assert np.all(out == 0.0) and np.all(np.isposinf(lse))


def test_bad_arguments_are_named(rng):
    q, parts, sinks = problem(rng, b=2, s_q=1, h_q=4, topk=16, num_blocks=2, block_size=16, extra=(8, 2, 16),
                              sink=True)
    meta = get_mla_metadata()[0]
    call(meta, q, parts, sinks)  # the baseline runs
    bad_ids = parts[0][1].copy()
    bad_ids[1, 0, 3] = 32  # the pool has 32 slots
    with pytest.raises(sp.Error, match=r"indices\[1, 0, 3\] = 32 is outside the cache's 32 slots"):
        call(meta, q, [(parts[0][0], bad_ids, np.array([16, 16], np.int32)), parts[1]], sinks)
    bad_extra = parts[1][1].copy()
    bad_extra[0, 0, 2] = -5
    with pytest.raises(sp.Error, match=r"extra_indices\[0, 0, 2\] = -5"):
        call(meta, q, [parts[0], (parts[1][0], bad_extra, None)], sinks)
    with pytest.raises(sp.Error, match=r"topk_length\[1\] = 17 must lie in \[0, 16\]"):
        call(meta, q, parts, sinks, topk_length=np.array([3, 17], np.int32))
    as_f16 = Pool(np.ascontiguousarray(parts[0][0].view).view(np.float16))
    with pytest.raises(sp.Error, match="k_cache has dtype float16"):
        call(meta, q, [(as_f16,) + parts[0][1:], parts[1]], sinks)
    with pytest.raises(sp.Error, match="has 655 bytes per token, but a v32 cache .* has 656"):
        call(meta, q, parts, sinks, extra_k_cache=parts[1][0].view[..., :655])
    with pytest.raises(sp.Error, match="head_dim_v = 256"):
        flash_mla_with_kvcache(q, parts[0][0].view, None, None, 256, meta, is_fp8_kvcache=True, indices=parts[0][1])
    with pytest.raises(sp.Error, match="causal must be False"):
        call(meta, q, parts, sinks, causal=True)
    with pytest.raises(sp.Error, match="is_fp8_kvcache must be True"):
        call(meta, q, parts, sinks, is_fp8_kvcache=False)
    with pytest.raises(sp.Error, match="num_splits must be None"):
        call(meta, q, parts, sinks, num_splits=4)
    with pytest.raises(NotImplementedError, match="sparse FP8 decode only"):
        flash_mla_with_kvcache(q, parts[0][0].view, np.zeros((2, 4), np.int32), np.ones(2, np.int32), 512, meta,
                               is_fp8_kvcache=True)
    with pytest.raises(sp.Error, match="attn_sink has dtype float64; expected float32"):
        call(meta, q, parts, sinks.astype(np.float64))
    with pytest.raises(sp.Error, match=r"attn_sink must have shape \(4,\)"):
        call(meta, q, parts, np.zeros(5, np.float32))
    with pytest.raises(sp.Error, match="extra_indices_in_kvcache and extra_topk_length need an extra_k_cache"):
        call(meta, q, parts[:1], sinks, extra_indices_in_kvcache=parts[1][1])
    with pytest.raises(sp.Error, match="indices has dtype int64; expected int32"):
        call(meta, q, parts, sinks, indices=parts[0][1].astype(np.int64))
    # The metadata keeps its shapes, as FlashMLA's does.
    with pytest.raises(sp.Error, match="h_q = 8 but tile_scheduler_metadata was made for 4"):
        q8, parts8, _ = problem(rng, b=2, s_q=1, h_q=8, topk=16, num_blocks=2, block_size=16, extra=(8, 2, 16))
        call(meta, q8, parts8)
    with pytest.raises(sp.Error, match="topk = 8 but tile_scheduler_metadata was made for 16"):
        call(meta, q, parts, sinks, indices=parts[0][1][..., :8].copy(), topk_length=None)
    with pytest.raises(sp.Error, match="tile_scheduler_metadata must come from"):
        call(object(), q, parts, sinks)


def test_metadata_accepts_the_older_interfaces_arguments():
    meta, none = get_mla_metadata(np.ones(2, np.int32), 128, 1, 128, True, 2048)
    assert isinstance(meta, FlashMLASchedMeta) and none is None and not meta.have_initialized
    meta.check_errors()  # nothing ran yet: nothing to report


# ---- torch: CPU tensors everywhere torch is installed, CUDA where a GPU is ----------------------

try:
    import torch
except ImportError:  # without torch the numpy tests above still run
    torch = None
needs_torch = pytest.mark.skipif(torch is None,
                                 reason="torch is not installed (scripts/install-python-deps.sh --torch installs it)")
has_gpu = torch is not None and torch.cuda.is_available() and sp.cuda_available()
cuda_only = pytest.mark.skipif(not has_gpu, reason="needs torch, a GPU and sparsepage built with CUDA")


def to_torch(parts, device, float8=False):
    out = []
    for cache, ids, n in parts:
        view = torch.from_numpy(np.ascontiguousarray(cache.raw)).to(device)
        view = view.as_strided((cache.num_blocks, cache.block_size, 1, cache.bytes_per_token),
                               (cache.raw.shape[1], cache.bytes_per_token, cache.bytes_per_token, 1))
        if float8:
            view = view.view(torch.float8_e4m3fn)
        out.append((Pool(view), torch.from_numpy(ids).to(device), None if n is None else torch.from_numpy(n).to(device)))
    return out


@needs_torch
def test_torch_cpu_bf16_and_float8_pools(rng):
    q, parts, sinks = problem(rng, b=3, extra=(16, 3, 8), sink=True)
    tq = torch.from_numpy(q).bfloat16()
    out, lse = call(get_mla_metadata()[0], tq, to_torch(parts, "cpu", float8=True), torch.from_numpy(sinks))
    assert out.dtype == torch.bfloat16 and lse.shape == (3, 8, 2) and lse.stride() == (16, 1, 8)
    check(out.float().numpy(), lse.numpy(), *reference(q, parts, V32 ** -0.5, sinks), 1e-2)


@cuda_only
@pytest.mark.parametrize("h_q,s_q,topk", [(128, 1, 2048), (64, 2, 512), (16, 3, 96)])
def test_cuda_matches_the_reference_and_the_cpu(rng, h_q, s_q, topk):
    q, parts, sinks = problem(rng, b=3, s_q=s_q, h_q=h_q, topk=topk, num_blocks=max(8, topk // 32), block_size=64,
                              extra=(128, 4, 64), sink=True)
    tq = torch.from_numpy(q).bfloat16()
    out, lse = call(get_mla_metadata()[0], tq.cuda(), to_torch(parts, "cuda"), torch.from_numpy(sinks).cuda())
    torch.cuda.synchronize()
    ref = reference(tq.double().numpy(), parts, V32 ** -0.5, sinks)
    check(out.float().cpu().numpy(), lse.cpu().numpy(), *ref, 1e-2, lse_tol=1e-3)
    cpu_out, cpu_lse = call(get_mla_metadata()[0], tq, to_torch(parts, "cpu"), torch.from_numpy(sinks))
    np.testing.assert_allclose(out.float().cpu().numpy(), cpu_out.float().numpy(), rtol=0.05, atol=2e-2)
    finite = torch.isfinite(cpu_lse)
    assert torch.equal(torch.isposinf(lse.cpu()), torch.isposinf(cpu_lse))
    torch.testing.assert_close(lse.cpu()[finite], cpu_lse[finite], rtol=1e-3, atol=1e-3)


@cuda_only
def test_cuda_out_of_range_ids_are_flagged_and_poison_only_their_query(rng):
    q, parts, _ = problem(rng, b=2, s_q=1, h_q=64, topk=64, num_blocks=4, block_size=64, lengths=False)
    ids = parts[0][1].copy()
    ids[1, 0, 7] = 4 * 64  # one past the pool
    meta = get_mla_metadata()[0]
    out, lse = call(meta, torch.from_numpy(q).bfloat16().cuda(), to_torch([(parts[0][0], ids, None)], "cuda"))
    with pytest.raises(sp.Error, match="outside its cache"):
        meta.check_errors()
    meta.check_errors()  # the flag was cleared
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()


@cuda_only
def test_cuda_graph_replays_follow_the_ids_and_lengths(rng):
    q, parts, sinks = problem(rng, b=4, s_q=2, h_q=128, topk=256, num_blocks=16, block_size=64, extra=(64, 4, 64),
                              sink=True)
    dev = to_torch(parts, "cuda")
    tq = torch.from_numpy(q).bfloat16().cuda()
    tsink = torch.from_numpy(sinks).cuda()
    meta = get_mla_metadata()[0]
    call(meta, tq, dev, tsink)  # plans and uploads: before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = call(meta, tq, dev, tsink)
    for step in range(3):
        host = [new_ids(rng, cache, ids) for cache, ids, _ in parts]
        for (_, ids, n), (_, fresh, fresh_n) in zip(dev, host):  # the step's ids and lengths, in place
            ids.copy_(torch.from_numpy(fresh))
            n.copy_(torch.from_numpy(fresh_n))
        graph.replay()
        eager_out, eager_lse = call(meta, tq, dev, tsink)
        torch.cuda.synchronize()
        assert torch.equal(g_out, eager_out) and torch.equal(g_lse, eager_lse), f"step {step}"
        check(g_out.float().cpu().numpy(), g_lse.cpu().numpy(),
              *reference(tq.double().cpu().numpy(), host, V32 ** -0.5, sinks), 1e-2, lse_tol=1e-3)


@cuda_only
def test_cuda_refuses_what_it_cannot_run_by_name(rng):
    q, parts, _ = problem(rng, d_qk=MODEL1, b=2, s_q=1, h_q=64, topk=32, num_blocks=4, block_size=16, lengths=False)
    with pytest.raises(sp.Error, match="MODEL1 caches .* have no CUDA kernel"):
        call(get_mla_metadata()[0], torch.from_numpy(q).bfloat16().cuda(), to_torch(parts, "cuda"))
    q, parts, _ = problem(rng, b=2, s_q=1, h_q=64, topk=32, num_blocks=4, block_size=16, lengths=False, block_pad=656)
    with pytest.raises(sp.Error, match="block_stride = 11152 bytes: the CUDA kernel reads a cache whose blocks"):
        call(get_mla_metadata()[0], torch.from_numpy(q).bfloat16().cuda(), to_torch(parts, "cuda"))
    with pytest.raises(sp.Error, match="q and o must be bf16 on CUDA"):
        call(get_mla_metadata()[0], torch.from_numpy(q).cuda(), to_torch(parts, "cuda"))
    meta = get_mla_metadata()[0]
    q, parts, _ = problem(rng, b=2, s_q=1, h_q=64, topk=32, num_blocks=4, block_size=16, lengths=False)
    call(meta, torch.from_numpy(q).bfloat16().cuda(), to_torch(parts, "cuda"))
    with pytest.raises(sp.Error, match="device = 'cpu' but tile_scheduler_metadata was made for 'cuda:0'"):
        call(meta, torch.from_numpy(q).bfloat16(), to_torch(parts, "cpu"))
