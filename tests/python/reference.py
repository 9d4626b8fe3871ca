"""Plain numpy fp64 reference implementations the tests compare against."""

import numpy as np


def attend(q, keys, values, scale, q_extra=None, k_extra=None, bias=None):
    """Softmax attention of G queries over n rows, in fp64.

    q [G, Dqk], keys [n, Dqk], values [n, Dv], optional q_extra [G, De] and k_extra [n, De]
    (a second K stream whose dot product adds to the score), optional additive bias [n].
    Returns (o [G, Dv], lse [G]) with lse the natural log of the summed exponentials of the
    scaled scores; no rows gives o = 0, lse = -inf.
    """
    q = np.asarray(q, np.float64)
    G, dv = q.shape[0], values.shape[-1]
    if keys.shape[0] == 0:
        return np.zeros((G, dv)), np.full(G, -np.inf)
    s = scale * (q @ np.asarray(keys, np.float64).T)
    if q_extra is not None:
        s = s + scale * (np.asarray(q_extra, np.float64) @ np.asarray(k_extra, np.float64).T)
    if bias is not None:
        s = s + bias[None, :]
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(axis=1, keepdims=True)
    o = (p / total) @ np.asarray(values, np.float64)
    return o, (m + np.log(total))[:, 0]


def paged_rows(indptr, indices, seq_lens, page_size, first_page_offset=None):
    """Pool rows each request reads, per the CSR page table (docs/DESIGN.md: the page table)."""
    out = []
    for r in range(len(seq_lens)):
        off = 0 if first_page_offset is None else int(first_page_offset[r])
        rows = []
        for i in range(int(seq_lens[r])):
            page = int(indices[indptr[r] + (off + i) // page_size])
            rows.append(page * page_size + (off + i) % page_size)
        out.append(np.array(rows, dtype=np.int64))
    return out


def merge(o_parts, lse_parts):
    """Merges S states o [S, N, D], lse [S, N] by lse, in fp64."""
    lse = np.asarray(lse_parts, np.float64)
    m = lse.max(axis=0)
    safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - safe[None])
    w = np.where(np.isfinite(lse), w, 0.0)
    total = w.sum(axis=0)
    o = np.einsum("sn,snd->nd", w, np.asarray(o_parts, np.float64)) / np.where(total > 0, total, 1.0)[:, None]
    out_lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return np.where(total[:, None] > 0, o, 0.0), out_lse


def tolerance(dtype):
    return {np.float32: 2e-5, np.float16: 4e-3}[np.dtype(dtype).type]
