"""The fused decode over engines' own inputs, graph-replayed, on a GPU.

MLA (128 heads, latent 512 + rope 64, top-2048 per token, cache [num_blocks,
64, 576]) through the ways an engine can hand its indices over, so their cost
can be compared on one machine:

* ``csr``: a CSR page table over the slot ids (what the library took before
  the index matrix);
* ``matrix``: the [num_tokens, topk] slot-id matrix read in place;
* ``matrix -1``: the same with -1 padding skipped (MlaSparseDecoder), no -1
  present, then with 10% of the ids -1;
* ``positions``: request-local positions resolved through the block table in
  the kernel (MlaSparseDecoder.from_positions);
* ``strided q``: q_latent and q_pe as column slices of one [T, H, 576] tensor.

Then GQA decode over [num_blocks, block_size, 4, 128] K/V caches through the
block tables (PagedKVDecoder, 32 query heads), block sizes 16 and 64, with the
bandwidth the K/V reads reach.

Milliseconds per call: CUDA events over 50 graph replays after warm-up.
Usage: python3 python/benchmarks/engine_decode.py [--batches 1,8,32] [--context 32768]
"""

import argparse

import torch
from cuda_timing import graphed, time_ms

from sparsepage import torch_ops as ops

H, LAT, ROPE, TOPK, BS = 128, 512, 64, 2048, 64


def replay_ms(fn, iters=50):
    """Mean milliseconds per replay of `fn` captured in a CUDA graph."""
    return time_ms(graphed(fn), iters=iters, warmup=5)


def mla(B, L, dev):
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    blocks = L // BS
    kv = torch.randn(B * blocks, BS, LAT + ROPE, device=dev, dtype=dt, generator=g)
    table = torch.randperm(B * blocks, device=dev, generator=g).int().view(B, blocks)  # each sequence's blocks
    positions = torch.stack([torch.randperm(L, device=dev, generator=g)[:TOPK] for _ in range(B)]).int()
    slots = (table.gather(1, (positions // BS).long()) * BS + positions % BS).int()
    qbuf = torch.randn(B, H, LAT + ROPE, device=dev, dtype=dt, generator=g)
    q_lat, q_pe = qbuf[..., :LAT].contiguous(), qbuf[..., LAT:].contiguous()
    o = torch.empty(B, H, LAT, device=dev, dtype=dt)
    scale = (LAT + ROPE) ** -0.5
    dec = ops.MlaSparseDecoder(B, TOPK, H, device=dev)
    indptr, seq_lens = dec.plan.structure(1)
    latent = kv[..., :LAT]
    flat_slots = slots.reshape(-1)
    padded = slots.clone()
    padded[torch.rand(B, TOPK, device=dev, generator=g) < 0.1] = -1

    def csr():
        ops.paged_decode_out(dec.plan, q_lat, latent, latent, indptr, flat_slots, seq_lens, page_size=1, scale=scale,
                             workspace=dec.workspace, o=o, q_extra=q_pe, k_extra=kv[..., LAT:])

    def matrix():
        ops.paged_decode_out(dec.plan, q_lat, latent, latent, None, slots, None, page_size=1, scale=scale,
                             workspace=dec.workspace, o=o, q_extra=q_pe, k_extra=kv[..., LAT:])

    arms = [("csr", csr), ("matrix", matrix),
            ("matrix -1", lambda: dec(q_lat, q_pe, kv, slots, scale=scale, o=o)),
            ("matrix -1 (10% -1)", lambda: dec(q_lat, q_pe, kv, padded, scale=scale, o=o)),
            ("positions", lambda: dec.from_positions(q_lat, q_pe, kv, positions, table, scale=scale, o=o)),
            ("strided q", lambda: dec(qbuf[..., :LAT], qbuf[..., LAT:], kv, slots, scale=scale, o=o))]
    ref = None
    for name, fn in arms:
        ms = replay_ms(fn)
        if name in ("csr", "matrix -1", "positions", "strided q"):
            fn()
            out = o.float().clone()
            ref = out if ref is None else ref
            diff = (out - ref).abs().max().item()
        else:
            diff = float("nan")
        rows_gb = B * TOPK * (LAT + ROPE) * 2 / 1e9
        print(f"mla  batch {B:>3} {name:<20} {ms * 1e3:8.1f} us  ({rows_gb / (ms / 1e3):6.0f} GB/s of rows; "
              f"max |o - csr| {diff:.3g})", flush=True)


def gqa(B, L, block_size, dev):
    dt = torch.bfloat16
    Hq, Hkv, D = 32, 4, 128
    g = torch.Generator(device=dev).manual_seed(1)
    blocks = L // block_size
    k = torch.randn(B * blocks, block_size, Hkv, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(B * blocks, block_size, Hkv, D, device=dev, dtype=dt, generator=g)
    tables = torch.randperm(B * blocks, device=dev, generator=g).int().view(B, blocks)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=dt, generator=g)
    o = torch.empty(B, Hq, D, device=dev, dtype=dt)
    dec = ops.PagedKVDecoder(B, Hq, Hkv, D, max_blocks=blocks, block_size=block_size, device=dev)
    ms = replay_ms(lambda: dec(q, k, v, tables, lens, scale=D ** -0.5, o=o))
    gb = B * L * Hkv * D * 2 * 2 / 1e9
    print(f"gqa  batch {B:>3} block {block_size:>2} {ms * 1e3:8.1f} us  ({gb / (ms / 1e3):6.0f} GB/s of K/V)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args()
    dev = "cuda"
    batches = [int(x) for x in args.batches.split(",")]
    for B in batches:
        mla(B, args.context, dev)
    for B in batches:
        for bs in (16, 64):
            gqa(B, args.context, bs, dev)


if __name__ == "__main__":
    main()
