"""Each layer's decode step through sparsepage next to the same step in plain PyTorch.

The sparsepage arm is the layer itself (``BlockSparseAttention.decode``,
``DsaAttention.decode``): it appends the token, runs the library's indexer and
attends the kept rows through the fused paged decode, over a cache filled
with a prompt (``append_tokens``). The PyTorch arm writes the token into its
own cache and runs the same step in plain torch: indexer scores, ``topk``,
``gather`` of the kept rows, ``scaled_dot_product_attention``. Both are timed
eager and as CUDA graph replays (CUDA events, mean of 20 calls after warm-up);
the first step's outputs are compared before timing.

* block-sparse: 64 query heads, 4 KV heads, head dim 128, blocks of 128,
  top-16 blocks by max-pooled index score (the final block always kept);
* DSA: 128 heads, latent 512 + rope 64, 64 index heads x 128, top-2048 tokens.

Usage: python3 python/benchmarks/layer_steps_vs_torch.py [--batches 1,8,32] [--contexts 32768,131072]
"""

import argparse

import torch
import torch.nn.functional as F
from cuda_timing import graphed, time_ms

import sparsepage as sp

BF = torch.bfloat16


def open_dispatch():
    c = sp.DispatchConfig.defaults()
    c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0
    return c


def block_sparse(B, L, dev):
    Hq, Hkv, D, BS, TOPK = 64, 4, 128, 128, 16
    G = Hq // Hkv
    g = torch.Generator(device=dev).manual_seed(0)
    cap = L + 256
    kc = torch.randn(B, Hkv + 1, cap, D, device=dev, dtype=BF, generator=g)  # keys, then the index key
    vc = torch.randn(B, Hkv, cap, D, device=dev, dtype=BF, generator=g)
    q = torch.randn(B, Hq, D, device=dev, dtype=BF, generator=g)
    iq = torch.randn(B, Hkv, D, device=dev, dtype=BF, generator=g)
    k_new = torch.randn(B, Hkv + 1, 1, D, device=dev, dtype=BF, generator=g)
    v_new = torch.randn(B, Hkv, 1, D, device=dev, dtype=BF, generator=g)
    cfg = sp.BlockSparseConfig(num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=BS, topk_blocks=TOPK)
    layer = sp.BlockSparseAttention(sp.Device.cuda, sp.DType.bf16, cfg, B, open_dispatch())
    layer.reserve(cap)
    layer.append_tokens(kc[:, :, :L].contiguous(), vc[:, :, :L].contiguous())
    o_sp = torch.empty(B, Hq, D, device=dev, dtype=BF)
    n = L + 1  # the step's token is position L
    scored, final = (n - 1) // BS, (n - 1) // BS  # full blocks before the final one; the final block's id
    offs = torch.arange(BS, device=dev)

    def torch_step():
        kc[:, :, L] = k_new[:, :, 0]
        vc[:, :, L] = v_new[:, :, 0]
        s = torch.einsum("bhd,btd->bht", iq, kc[:, Hkv, :scored * BS]).view(B, Hkv, scored, BS).amax(-1)
        blocks = torch.cat([s.topk(TOPK, dim=-1).indices, torch.full((B, Hkv, 1), final, device=dev)], dim=-1)
        tok = (blocks[..., None] * BS + offs).view(B, Hkv, -1)
        mask = torch.where(tok < n, 0.0, float("-inf")).to(BF)[:, :, None, :]
        idx = tok.clamp(max=n - 1)[..., None].expand(-1, -1, -1, D)
        kg = torch.gather(kc[:, :Hkv], 2, idx)
        vg = torch.gather(vc, 2, idx)
        return F.scaled_dot_product_attention(q.view(B, Hkv, G, D), kg, vg, attn_mask=mask).view(B, Hq, D)

    def sp_step():
        # torch's current stream at call time: the capture stream inside torch.cuda.graph
        layer.decode(q, iq, k_new, v_new, o_sp, stream=torch.cuda.current_stream().cuda_stream)
        return o_sp

    ref = torch_step().float()
    out = sp_step().float()
    diff = (out - ref).abs().max().item()
    return diff, torch_step, sp_step, layer


def dsa(B, L, dev):
    H, LAT, ROPE, IH, ID, TOPK = 128, 512, 64, 64, 128, 2048
    g = torch.Generator(device=dev).manual_seed(1)
    cap = L + 256
    rows = torch.randn(B, 1, cap, LAT + ID, device=dev, dtype=BF, generator=g)  # latent, then the index key
    pe = torch.randn(B, 1, cap, ROPE, device=dev, dtype=BF, generator=g)
    q_lat = torch.randn(B, H, LAT, device=dev, dtype=BF, generator=g)
    q_pe = torch.randn(B, H, ROPE, device=dev, dtype=BF, generator=g)
    q_idx = torch.randn(B, IH, ID, device=dev, dtype=BF, generator=g)
    w = torch.rand(B, IH, device=dev, generator=g)
    row_new = torch.randn(B, 1, 1, LAT + ID, device=dev, dtype=BF, generator=g)
    pe_new = torch.randn(B, 1, 1, ROPE, device=dev, dtype=BF, generator=g)
    cfg = sp.DsaConfig(num_qo_heads=H, index_heads=IH, index_head_dim=ID, index_topk=TOPK)
    layer = sp.DsaAttention(sp.Device.cuda, sp.DType.bf16, cfg, B, open_dispatch())
    layer.reserve(cap)
    layer.append_tokens(rows[:, :, :L].contiguous(), pe[:, :, :L].contiguous())
    o_sp = torch.empty(B, H, LAT, device=dev, dtype=BF)
    n = L + 1
    scale = (LAT + ROPE) ** -0.5
    q = torch.cat([q_lat, q_pe], dim=-1)

    def torch_step():
        rows[:, :, L] = row_new[:, :, 0]
        pe[:, :, L] = pe_new[:, :, 0]
        s = torch.einsum("bjd,btd->bjt", q_idx, rows[:, 0, :n, LAT:]).float().relu_()
        top = (w[:, :, None] * s).sum(1).topk(TOPK, dim=1).indices
        lat = torch.gather(rows[:, 0, :n, :LAT], 1, top[:, :, None].expand(-1, -1, LAT))
        sel = torch.cat([lat, torch.gather(pe[:, 0, :n], 1, top[:, :, None].expand(-1, -1, ROPE))], dim=-1)
        k = sel[:, None].expand(-1, H, -1, -1)
        v = sel[:, None, :, :LAT].expand(-1, H, -1, -1)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale)[:, :, 0]

    def sp_step():
        layer.decode(q_lat, q_pe, q_idx, w, row_new, pe_new, o_sp, stream=torch.cuda.current_stream().cuda_stream)
        return o_sp

    ref = torch_step().float()
    out = sp_step().float()
    diff = (out - ref).abs().max().item()
    return diff, torch_step, sp_step, layer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--layers", default="block_sparse,dsa")
    args = ap.parse_args()
    dev = "cuda"
    print(f"{'layer':>12} {'batch':>5} {'context':>8} | {'torch eager':>11} {'torch graph':>11} | "
          f"{'sp eager':>9} {'sp graph':>9} (ms per step) | max |diff| first step")
    for name in args.layers.split(","):
        for L in [int(x) for x in args.contexts.split(",")]:
            for B in [int(x) for x in args.batches.split(",")]:
                diff, torch_step, sp_step, layer = (block_sparse if name == "block_sparse" else dsa)(B, L, dev)
                te, se = time_ms(torch_step), time_ms(sp_step)
                tg, sg = time_ms(graphed(torch_step)), time_ms(graphed(sp_step))
                print(f"{name:>12} {B:>5} {L:>8} | {te:>11.3f} {tg:>11.3f} | {se:>9.3f} {sg:>9.3f} | {diff:.3g}",
                      flush=True)
                del layer
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
