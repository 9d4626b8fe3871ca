"""Tensor parallel decode of both sparsepage layers over GPUs: each rank runs its own heads.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 python/examples/tensor_parallel.py

Query heads are sharded the way engines shard attention:

* the block-sparse layer (GQA with a top-k block indexer per KV head): rank i
  owns KV heads [i * Hkv / world, (i + 1) * Hkv / world), their query groups and
  their cache (plus the shared index key head); the indexer's choice per KV
  head depends only on that head, so each rank selects what one GPU would;
* the DSA layer (MLA, one latent KV head, a top-k token indexer): every rank
  keeps the whole latent cache and runs the same indexer (replicated, as
  engines do), and attends with its H / world query heads.

Every rank builds the same inputs from one seed, runs its layers for enough
decode steps to be in the sparse regime (the fused path must run), and the
last step's outputs are all-gathered over heads (NCCL). Rank 0 then runs the
same steps on one GPU twice: per shard (the same layers, one after the other),
which the gathered result must equal bit for bit, and with all heads in one
layer, which it must equal within bf16 rounding (the split-KV plan depends on
the head count, so the fp32 merge order may differ). It prints one line per
layer and exits nonzero on any mismatch; tests/python/test_tensor_parallel.py
runs it on a machine with two GPUs.
"""

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import sparsepage as sp  # noqa: E402

B, STEPS = 2, 100
BS_HEADS, BS_KV_HEADS, BS_DIM = 32, 4, 128  # block-sparse: G = 8
DSA_HEADS = 128


def open_dispatch():
    """The fused path at these small sizes (the floors are for full-size models)."""
    c = sp.DispatchConfig.defaults()
    c.min_kv_tokens = c.min_kv_tokens_per_request = c.min_sparsity = 0
    return c


def block_sparse_inputs(g):
    bf = torch.bfloat16
    return [(torch.randn(B, BS_HEADS, BS_DIM, generator=g).to(bf), torch.randn(B, BS_KV_HEADS, BS_DIM, generator=g).to(bf),
             torch.randn(B, BS_KV_HEADS + 1, 1, BS_DIM, generator=g).to(bf),
             torch.randn(B, BS_KV_HEADS, 1, BS_DIM, generator=g).to(bf)) for _ in range(STEPS)]


def dsa_inputs(g):
    bf = torch.bfloat16
    return [(torch.randn(B, DSA_HEADS, 512, generator=g).to(bf), torch.randn(B, DSA_HEADS, 64, generator=g).to(bf),
             torch.randn(B, 4, 64, generator=g).to(bf), torch.rand(B, 4, generator=g),
             torch.randn(B, 1, 1, 576, generator=g).to(bf), torch.randn(B, 1, 1, 64, generator=g).to(bf))
            for _ in range(STEPS)]


def run_block_sparse(dev, kv_heads, inputs):
    """The block-sparse layer over KV heads `kv_heads` (and their query groups); the last step's o."""
    G = BS_HEADS // BS_KV_HEADS
    cfg = sp.BlockSparseConfig(num_qo_heads=len(kv_heads) * G, num_kv_heads=len(kv_heads), head_dim=BS_DIM,
                               block_size=16, topk_blocks=2, capacity_step=256)
    layer = sp.BlockSparseAttention(sp.Device.cuda, sp.DType.bf16, cfg, B, open_dispatch())
    q_heads = [h * G + i for h in kv_heads for i in range(G)]
    stream = torch.cuda.current_stream(dev).cuda_stream
    o = torch.empty(B, len(q_heads), BS_DIM, dtype=torch.bfloat16, device=dev)
    for q, index_q, k, v in inputs:
        k_local = torch.cat([k[:, kv_heads], k[:, BS_KV_HEADS:]], dim=1)  # own keys, then the shared index key
        step = layer.decode(q[:, q_heads].contiguous().to(dev), index_q[:, kv_heads].contiguous().to(dev),
                            k_local.contiguous().to(dev), v[:, kv_heads].contiguous().to(dev), o, stream=stream)
    assert step.sparse and step.fused, step.outcome.describe()
    return o


def run_dsa(dev, heads, inputs):
    """The DSA layer with query heads `heads` (whole cache, same indexer); the last step's o."""
    cfg = sp.DsaConfig(num_qo_heads=len(heads), index_heads=4, index_head_dim=64, index_topk=64, capacity_step=256)
    layer = sp.DsaAttention(sp.Device.cuda, sp.DType.bf16, cfg, B, open_dispatch())
    stream = torch.cuda.current_stream(dev).cuda_stream
    o = torch.empty(B, len(heads), 512, dtype=torch.bfloat16, device=dev)
    for q_latent, q_pe, q_index, weights, k_row, k_pe in inputs:
        step = layer.decode(q_latent[:, heads].contiguous().to(dev), q_pe[:, heads].contiguous().to(dev),
                            q_index.to(dev), weights.to(dev), k_row.to(dev), k_pe.to(dev), o, stream=stream)
    assert step.sparse and step.fused, step.outcome.describe()
    return o


def gather_heads(o_local, world):
    parts = [torch.empty_like(o_local) for _ in range(world)]
    dist.all_gather(parts, o_local)
    return torch.cat(parts, dim=1)


def compare(name, world, o_tp, o_shards, o_one):
    bitwise = torch.equal(o_tp, o_shards)
    diff = (o_tp.float() - o_one.float()).abs()
    scale = o_one.float().abs().max().item()
    equal = (o_tp == o_one).float().mean().item()
    print(f"{name}: {world} GPUs == per-shard run on one GPU bit for bit: {bitwise}; vs all heads on one GPU: "
          f"max |diff| {diff.max().item():.3g} (max |o| {scale:.3g}), {100 * equal:.1f}% of elements identical",
          flush=True)
    return bitwise and bool(torch.isfinite(o_tp).all()) and diff.max().item() <= 2e-2 * max(scale, 1.0)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    assert BS_KV_HEADS % world == 0 and DSA_HEADS % world == 0
    g = torch.Generator().manual_seed(0)  # the same inputs on every rank
    bs_in, dsa_in = block_sparse_inputs(g), dsa_inputs(g)

    kv_share, q_share = BS_KV_HEADS // world, DSA_HEADS // world
    shard_kv = lambda i: list(range(i * kv_share, (i + 1) * kv_share))  # noqa: E731
    shard_q = lambda i: list(range(i * q_share, (i + 1) * q_share))  # noqa: E731
    bs_tp = gather_heads(run_block_sparse(dev, shard_kv(rank), bs_in), world)
    dsa_tp = gather_heads(run_dsa(dev, shard_q(rank), dsa_in), world)

    ok = True
    if rank == 0:
        bs_shards = torch.cat([run_block_sparse(dev, shard_kv(i), bs_in) for i in range(world)], dim=1)
        bs_one = run_block_sparse(dev, list(range(BS_KV_HEADS)), bs_in)
        ok &= compare("block-sparse layer", world, bs_tp, bs_shards, bs_one)
        dsa_shards = torch.cat([run_dsa(dev, shard_q(i), dsa_in) for i in range(world)], dim=1)
        dsa_one = run_dsa(dev, list(range(DSA_HEADS)), dsa_in)
        ok &= compare("DSA layer", world, dsa_tp, dsa_shards, dsa_one)
    flag = torch.tensor([0 if ok else 1], device=dev)
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if rank == 0:
        print("tensor parallel: " + ("PASS" if flag.item() == 0 else "FAIL"), flush=True)
    sys.exit(int(flag.item() != 0))


if __name__ == "__main__":
    main()
