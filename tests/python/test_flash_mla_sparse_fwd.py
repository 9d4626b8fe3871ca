"""sparsepage.flash_mla_compat.flash_mla_sparse_fwd against FlashMLA's documented semantics of
its sparse prefill, with an fp64 reference written from that definition (never FlashMLA's code):
ids that are -1, negative or past s_kv skipped, ids listed twice counted twice, topk_length (and
a length past topk, clamped), no causal limit (a token may read any row, s_q above s_kv too), the
attention sink, tokens that attend nothing (out 0, lse +inf, max_logits -inf), and bad arguments
named. Every kv row no token attends is NaN.

The numpy tests run everywhere (without torch); the torch tests skip without torch, the CUDA
test without a GPU."""

import numpy as np
import pytest

import sparsepage as sp
from sparsepage.flash_mla_compat import flash_mla_sparse_fwd


def problem(rng, s_q=5, h_q=3, s_kv=20, topk=6, lengths=False, sink=False):
    q = rng.standard_normal((s_q, h_q, 576)).astype(np.float32)
    kv = rng.standard_normal((s_kv, 1, 576)).astype(np.float32)
    ids = rng.integers(0, s_kv, (s_q, 1, topk)).astype(np.int32)
    ids[0, 0, 0] = -1  # padding
    ids[1, 0, 1] = -3  # negative: skipped
    ids[2, 0, 2] = s_kv + 4  # past the rows: skipped
    ids[3, 0, topk - 1] = ids[3, 0, topk - 2]  # listed twice: counted twice
    ids[-1, 0, :] = -1  # a token that attends nothing
    topk_length = None
    if lengths:
        topk_length = rng.integers(0, topk + 1, s_q).astype(np.int32)
        topk_length[0] = topk + 3  # past topk: all of the row
    attended = np.zeros(s_kv, dtype=bool)
    for t in range(s_q):
        n = topk if topk_length is None else min(topk, int(topk_length[t]))
        row = ids[t, 0, :n]
        attended[row[(row >= 0) & (row < s_kv)]] = True
    kv[~attended] = np.nan  # never read
    attn_sink = None
    if sink:
        attn_sink = np.array([-np.inf, np.inf, 0.5][:h_q] + [0.25] * max(0, h_q - 3), dtype=np.float32)
    return q, kv, ids, topk_length, attn_sink


def reference(q, kv, ids, scale, topk_length=None, attn_sink=None):
    s_q, h_q, _ = q.shape
    s_kv, topk = kv.shape[0], ids.shape[-1]
    out = np.zeros((s_q, h_q, 512))
    lse = np.full((s_q, h_q), np.inf)
    max_logits = np.full((s_q, h_q), -np.inf)
    for t in range(s_q):
        n = topk if topk_length is None else min(topk, int(topk_length[t]))
        row = ids[t, 0, :n]
        row = row[(row >= 0) & (row < s_kv)]
        if len(row) == 0:
            continue
        k = kv[row, 0].astype(np.float64)  # [n, 576]
        s = scale * q[t].astype(np.float64) @ k.T  # [h_q, n]
        m = s.max(axis=1)
        w = np.exp(s - m[:, None])
        total = w.sum(axis=1)
        lse[t] = m + np.log(total)
        max_logits[t] = m
        o = (w @ k[:, :512]) / total[:, None]
        if attn_sink is not None:
            with np.errstate(over="ignore"):
                o = o / (1.0 + np.exp(attn_sink.astype(np.float64) - lse[t]))[:, None]
        out[t] = o
    return out, max_logits, lse


def check(got, want, o_tol):
    out, max_logits, lse = (np.asarray(x, dtype=np.float64) if x is not None else None for x in got)
    ref_out, ref_max, ref_lse = want
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    for t in range(out.shape[0]):
        for h in range(out.shape[1]):
            if np.isinf(ref_lse[t, h]):
                assert np.all(out[t, h] == 0) and lse[t, h] == np.inf
                if max_logits is not None:
                    assert max_logits[t, h] == -np.inf
                continue
            norm = np.linalg.norm(ref_out[t, h])
            err = np.linalg.norm(out[t, h] - ref_out[t, h]) / norm if norm > 0 else np.linalg.norm(out[t, h])
            assert err < o_tol, (t, h, err)
            assert abs(lse[t, h] - ref_lse[t, h]) < 1e-4, (t, h)
            if max_logits is not None:
                assert abs(max_logits[t, h] - ref_max[t, h]) < 1e-4, (t, h)


@pytest.mark.parametrize("lengths,sink", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_the_reference(rng, lengths, sink):
    q, kv, ids, topk_length, attn_sink = problem(rng, lengths=lengths, sink=sink)
    scale = 576 ** -0.5
    got = flash_mla_sparse_fwd(q, kv, ids, scale, attn_sink=attn_sink, topk_length=topk_length)
    assert got[0].shape == (5, 3, 512) and got[0].dtype == np.float32
    assert got[1].shape == got[2].shape == (5, 3)
    check(got, reference(q, kv, ids, scale, topk_length, attn_sink), 1e-5)


def test_no_causal_limit_and_more_tokens_than_rows(rng):
    # Eight query tokens over four rows: every token may read every row, the last included.
    q, kv, ids, _, _ = problem(rng, s_q=8, h_q=2, s_kv=4, topk=4)
    ids[:, 0, 0] = 3
    kv = np.nan_to_num(kv, nan=0.5)  # every row is attended here
    got = flash_mla_sparse_fwd(q, kv, ids, 0.1)
    check(got, reference(q, kv, ids, 0.1), 1e-5)


def test_an_id_out_of_range_is_skipped_not_read(rng):
    q, kv, ids, _, _ = problem(rng)
    clean = ids.copy()
    clean[(clean < 0) | (clean >= kv.shape[0])] = -1
    a = flash_mla_sparse_fwd(q, kv, ids, 0.05)
    b = flash_mla_sparse_fwd(q, kv, clean, 0.05)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_threads_get_their_own_prefill_and_leave_none_behind(rng):
    import threading

    from sparsepage import flash_mla_compat

    q, kv, ids, _, _ = problem(rng)
    want = flash_mla_sparse_fwd(q, kv, ids, 0.05)
    mine = flash_mla_compat._CPU_PREFILL.prefill
    held_before = len(flash_mla_compat._PREFILLS)
    results, objects = [None] * 3, [None] * 3
    all_running = threading.Barrier(3)

    def work(i):
        results[i] = flash_mla_sparse_fwd(q, kv, ids, 0.05)
        objects[i] = id(flash_mla_compat._CPU_PREFILL.prefill)
        all_running.wait()  # the three threads' objects are alive at once: distinct ids mean distinct objects

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        for x, y in zip(got, want):
            assert np.array_equal(x, y)
    assert len(set(objects) | {id(mine)}) == 4  # one object per thread
    assert flash_mla_compat._CPU_PREFILL.prefill is mine  # this thread keeps its own
    assert len(flash_mla_compat._PREFILLS) == held_before  # the CPU's objects are held by their threads


def test_bad_arguments_are_named(rng):
    q, kv, ids, _, _ = problem(rng)
    with pytest.raises(sp.Error, match="d_v"):
        flash_mla_sparse_fwd(q, kv, ids, 0.1, d_v=256)
    with pytest.raises(sp.Error, match="int32"):
        flash_mla_sparse_fwd(q, kv, ids.astype(np.int64), 0.1)
    with pytest.raises(sp.Error, match="KV heads"):
        flash_mla_sparse_fwd(q, np.concatenate([kv, kv], axis=1), ids, 0.1)
    with pytest.raises(sp.Error, match="576"):
        flash_mla_sparse_fwd(q[:, :, :512].copy(), kv, ids, 0.1)
    with pytest.raises(sp.Error, match="attn_sink"):
        flash_mla_sparse_fwd(q, kv, ids, 0.1, attn_sink=np.zeros(7, dtype=np.float32))
    with pytest.raises(sp.Error, match="dtype"):
        flash_mla_sparse_fwd(q, kv.astype(np.float16), ids, 0.1)


def test_torch_cpu_bf16(rng):
    torch = pytest.importorskip("torch")
    q, kv, ids, topk_length, attn_sink = problem(rng, lengths=True, sink=True)
    scale = 576 ** -0.5
    tq, tkv = torch.from_numpy(q).bfloat16(), torch.from_numpy(kv).bfloat16()
    got = flash_mla_sparse_fwd(tq, tkv, torch.from_numpy(ids), scale, attn_sink=torch.from_numpy(attn_sink),
                               topk_length=torch.from_numpy(topk_length))
    assert got[0].dtype == torch.bfloat16
    want = reference(tq.float().numpy(), tkv.float().numpy(), ids, scale, topk_length, attn_sink)
    check(tuple(x.float().numpy() for x in got), want, 1e-2)


@pytest.mark.skipif(not sp.cuda_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h_q", [64, 128])
def test_cuda_matches_the_reference(rng, h_q):
    torch = pytest.importorskip("torch")
    q, kv, ids, topk_length, attn_sink = problem(rng, s_q=6, h_q=h_q, s_kv=300, topk=64, lengths=True, sink=True)
    scale = 576 ** -0.5
    tq, tkv = torch.from_numpy(q).bfloat16().cuda(), torch.from_numpy(kv).bfloat16().cuda()
    out, max_logits, lse = flash_mla_sparse_fwd(tq, tkv, torch.from_numpy(ids).cuda(), scale,
                                                attn_sink=torch.from_numpy(attn_sink).cuda(),
                                                topk_length=torch.from_numpy(topk_length).cuda())
    assert max_logits is None  # the CPU backend computes it; CUDA does not (see the docstring)
    want = reference(tq.float().cpu().numpy(), tkv.float().cpu().numpy(), ids, scale, topk_length, attn_sink)
    check((out.float().cpu().numpy(), None, lse.cpu().numpy()), want, 1e-2)
