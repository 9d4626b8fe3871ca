"""The DSA decode step through sparsepage next to the same step in plain PyTorch.

Both arms share the indexer in torch (lightning-indexer scores, then topk over
the live window); they differ in the attention: plain PyTorch gathers the
selected latent+rope rows and calls scaled_dot_product_attention, sparsepage
reads the rows in place through the fused paged decode (page ids = the topk
rows of the cache seen as rows). Timed eager and as CUDA graph replays, with
CUDA events, at the MLA geometry (128 heads, latent 512, rope 64, top-2048).

Usage: python3 python/benchmarks/dsa_vs_torch.py [--batches 1,8,32] [--contexts 32768,131072]
"""

import argparse

import torch
import torch.nn.functional as F
from cuda_timing import graphed, time_ms

from sparsepage import torch_ops as ops

H, LAT, ROPE, TOPK, IH, ID = 128, 512, 64, 2048, 64, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="32768,131072")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    scale = (LAT + ROPE) ** -0.5
    print(f"{'batch':>5} {'context':>8} | {'torch eager':>11} {'torch graph':>11} | {'sp eager':>9} {'sp graph':>9} "
          f"| {'attn torch':>10} {'attn sp':>8} (ms; attn: graph-replayed attention half only) | max |diff|")
    for L in [int(x) for x in args.contexts.split(",")]:
        for B in [int(x) for x in args.batches.split(",")]:
            g = torch.Generator(device=dev).manual_seed(0)
            kv = torch.randn(B, L, LAT + ROPE, device=dev, dtype=dt, generator=g)
            idx_k = torch.randn(B, L, ID, device=dev, dtype=dt, generator=g)
            q_idx = torch.randn(B, IH, ID, device=dev, dtype=dt, generator=g)
            w = torch.rand(B, IH, device=dev, generator=g)
            q = torch.randn(B, H, LAT + ROPE, device=dev, dtype=dt, generator=g)
            q_lat, q_pe = q[..., :LAT].contiguous(), q[..., LAT:].contiguous()
            base = (torch.arange(B, device=dev, dtype=torch.int64) * L)[:, None]
            dec = ops.MlaSparseDecoder(B, TOPK, H, device=dev)
            o_sp = torch.empty(B, H, LAT, device=dev, dtype=dt)
            sel = {}

            def indexer():
                s = torch.einsum("bjd,btd->bjt", q_idx, idx_k).float().relu_()
                scores = (w[:, :, None] * s).sum(1)
                sel["top"] = scores.topk(TOPK, dim=1).indices

            def torch_attn():
                rows = torch.gather(kv, 1, sel["top"][:, :, None].expand(-1, -1, LAT + ROPE))
                k = rows[:, None].expand(-1, H, -1, -1)
                v = rows[:, None, :, :LAT].expand(-1, H, -1, -1)
                return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)[:, :, 0]

            def sp_attn():
                slots = (sel["top"] + base).to(torch.int32)
                dec(q_lat, q_pe, kv, slots, scale=scale, o=o_sp)
                return o_sp

            def torch_step():
                indexer()
                return torch_attn()

            def sp_step():
                indexer()
                return sp_attn()

            ref = torch_step().float()
            diff = (sp_step().float() - ref).abs().max().item()
            te, se = time_ms(torch_step), time_ms(sp_step)
            tg, sg = time_ms(graphed(torch_step)), time_ms(graphed(sp_step))
            indexer()
            ta, sa = time_ms(graphed(torch_attn)), time_ms(graphed(sp_attn))
            print(f"{B:>5} {L:>8} | {te:>11.3f} {tg:>11.3f} | {se:>9.3f} {sg:>9.3f} | {ta:>10.3f} {sa:>8.3f} | {diff:.3g}",
                  flush=True)
            del kv, idx_k, dec


if __name__ == "__main__":
    main()
