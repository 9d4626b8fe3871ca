"""Dense causal attention of the prompts sparse_prefill_bench prefills, for
the comparison with its times (tools/sparse_prefill_bench.cc).

For each layer kind's geometry it times, with CUDA events, the attention a
dense model would run to prefill the same prompt in the same chunks: each
chunk's queries against every key of the prompt up to the chunk's end,
causal (bottom-right aligned: the chunk is the last rows), summed over the
chunks; and the whole prompt in one call. Attention only: no projections,
no indexer.

  dsa          DeepSeek-V3.2's dense prefill form (MHA over decompressed
               heads: 128 heads, q/k dim 192, v dim 128 padded to 192 as
               vLLM pads it for FlashAttention);
  blocksparse  64 query heads over 4 KV heads, dim 128;
  static       32 query heads over 8 KV heads, dim 128.

Arms: torch scaled_dot_product_attention (its own backend choice), and
FlashInfer's single_prefill_with_kv_cache when flashinfer imports. An arm
that fails (memory, unsupported shape) is reported and skipped.

Without torch or a CUDA device it prints why and exits 0.

Usage: python3 python/benchmarks/prefill_vs_dense.py [--prompts 8192,32768,131072]
       [--chunks 2048,16384] [--kinds dsa,blocksparse,static] [--json out.json]
"""

import argparse
import functools
import json
import sys

GEOMETRY = {
    "dsa": dict(heads=128, kv_heads=128, dim_qk=192, dim_v=192),
    "blocksparse": dict(heads=64, kv_heads=4, dim_qk=128, dim_v=128),
    "static": dict(heads=32, kv_heads=8, dim_qk=128, dim_v=128),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="8192,32768,131072")
    ap.add_argument("--chunks", default="2048,16384")
    ap.add_argument("--kinds", default="dsa,blocksparse,static")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"prefill_vs_dense: skipped (no torch: {e})")
        return 0
    if not torch.cuda.is_available():
        print("prefill_vs_dense: skipped (no CUDA device)")
        return 0
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        causal_lower_right = None
    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    from cuda_timing import time_ms

    dev, dt = "cuda", torch.bfloat16
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"flashinfer {'absent' if flashinfer is None else flashinfer.__version__}")

    def sdpa_chunk(q, k, v, chunk, end):
        # q [1, H, chunk, d], k / v [1, Hkv, end, d]: the chunk is the last `chunk` rows of `end`.
        gqa = q.shape[1] != k.shape[1]
        if chunk == end:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if causal_lower_right is None:
            raise RuntimeError("torch has no causal_lower_right (needed for a chunk after the first)")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(chunk, end), enable_gqa=gqa)

    results = []
    for kind in args.kinds.split(","):
        g = GEOMETRY[kind]
        for prompt in [int(x) for x in args.prompts.split(",")]:
            gen = torch.Generator(device=dev).manual_seed(0)
            k = torch.randn(1, g["kv_heads"], prompt, g["dim_qk"], device=dev, dtype=dt, generator=gen)
            v = torch.randn(1, g["kv_heads"], prompt, g["dim_v"], device=dev, dtype=dt, generator=gen)
            for chunk in [int(x) for x in args.chunks.split(",")] + [prompt]:
                if chunk > prompt or prompt % chunk:
                    continue
                q = torch.randn(1, g["heads"], chunk, g["dim_qk"], device=dev, dtype=dt, generator=gen)
                row = dict(kind=kind, prompt=prompt, chunk=chunk)
                for arm in ("sdpa", "flashinfer"):
                    if arm == "flashinfer" and flashinfer is None:
                        continue
                    total = 0.0
                    try:
                        for end in range(chunk, prompt + 1, chunk):
                            ks, vs = k[:, :, :end], v[:, :, :end]
                            if arm == "sdpa":
                                fn = functools.partial(sdpa_chunk, q, ks, vs, chunk, end)
                            else:
                                qf = q[0].transpose(0, 1).contiguous()            # [chunk, H, d]
                                kf = ks[0].transpose(0, 1).contiguous()           # [end, Hkv, d]
                                vf = vs[0].transpose(0, 1).contiguous()
                                fn = lambda: flashinfer.single_prefill_with_kv_cache(qf, kf, vf, causal=True)  # noqa: E731
                            total += time_ms(fn, iters=args.reps, warmup=1)
                        row[arm + "_ms"] = total
                    except Exception as e:  # memory, shapes the arm does not take
                        row[arm + "_error"] = f"{type(e).__name__}: {e}"[:200]
                        torch.cuda.empty_cache()
                results.append(row)
                shown = "  ".join(f"{a}: {row[a + '_ms']:.2f} ms" if a + "_ms" in row else
                                  f"{a}: failed ({row[a + '_error']})" for a in ("sdpa", "flashinfer")
                                  if a + "_ms" in row or a + "_error" in row)
                print(f"{kind:<11} prompt {prompt:>7} chunk {chunk:>7} | {shown}")
                del q
            del k, v
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
