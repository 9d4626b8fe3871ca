"""Eager per-call overhead of the paged decode from Python, on a GPU (or, with --device cpu or
without one, on CPU tensors through the CPU backend, where the graph arm is left out).

Times a tiny decode (launch-bound, so host time dominates) several ways: the
binding called directly with torch tensors (nanobind calls each tensor's
``__dlpack__``), with DLPack capsules (``torch.utils.dlpack.to_dlpack``) and
through DLPack's C exchange table (torch >= 2.11),
``torch_ops.paged_decode_out`` (eager: the binding over capsules, no
dispatcher), the engine-facing ``PagedKVDecoder`` (eager), the registered op through torch's dispatcher (what
``torch.compile`` calls), and a CUDA graph replay; prints microseconds per
call (median of five interleaved rounds). tools/decode_call_overhead times the
same call from C++.
Usage: python3 python/benchmarks/op_overhead.py [--device cuda|cpu] [--rows N]
"""

import argparse
import time

import torch

import sparsepage as sp
from sparsepage import torch_ops as ops


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, dev, n=2000):
    for _ in range(50):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / n * 1e6


def host_us(fn, dev, n=200, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    sync(dev)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() and sp.cuda_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64, help="rows the one request attends (at most 64)")
    args = parser.parse_args()
    dev, rows = args.device, args.rows
    if not 1 <= rows <= 64:
        parser.error("--rows must lie in [1, 64] (the engine arm's table holds 64 rows)")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    print(f"op_overhead on {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (CPU backend)'}, torch "
          f"{torch.__version__}; one request of {rows} rows, 8 query heads, dim 128")
    lens = [rows]
    t = sp.build_page_table_structure(lens, 1)
    plan = ops.DecodePlan(lens, group_size=8, head_dim_qk=128, head_dim_v=128, device=dev)
    ws = plan.new_workspace()
    k = torch.randn(4096, 128, device=dev, dtype=dtype)
    q = torch.randn(1, 8, 128, device=dev, dtype=dtype)
    o = torch.empty_like(q)
    indptr = torch.from_numpy(t.indptr).to(dev)
    seq = torch.from_numpy(t.seq_lens).to(dev)
    idx = torch.randint(0, 4096, (rows,), dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream if dev == "cuda" else 0

    def direct():
        sp._core._paged_decode(plan.plan, q, k, k, o, indptr, idx, seq, page_size=1, scale=0.1, workspace=ws,
                               upload_plan=False, stream=stream)

    dl = torch.utils.dlpack.to_dlpack

    def capsules():
        sp._core._paged_decode(plan.plan, dl(q), dl(k), dl(k), dl(o), dl(indptr), dl(idx), dl(seq), page_size=1,
                               scale=0.1, workspace=dl(ws), upload_plan=False, stream=stream)

    def exchange():  # the binding over the tensors themselves, through DLPack's C exchange table
        sp._core._paged_decode_exchange(plan.plan, q, k, k, o, indptr, idx, seq, 1, 0.1, None, None, None, None, ws, -1, 0, 0,
                                  1, False, None, None, 0)

    def op():
        ops.paged_decode_out(plan, q, k, k, indptr, idx, seq, page_size=1, scale=0.1, workspace=ws, o=o)

    def dispatcher():
        torch.ops.sparsepage.paged_decode_out(plan.plan_info, q, k, k, indptr, idx, seq, None, None, None, ws, o, None,
                                              1, 0.1, -1, 0, 0, 1, False, None, None, 0)

    # The engine-facing op over a paged [num_blocks, 16, 1, 128] cache and its block table (the same
    # rows, 8 query heads): what a vLLM-style backend calls each step.
    engine = ops.PagedKVDecoder(1, 8, 1, 128, max_blocks=4, block_size=16, device=dev)
    k_cache = torch.randn(8, 16, 1, 128, device=dev, dtype=dtype)
    tables = torch.arange(4, dtype=torch.int32, device=dev).reshape(1, 4)
    engine_lens = torch.tensor([rows], dtype=torch.int32, device=dev)

    def engine_op():
        engine(q, k_cache, k_cache, tables, engine_lens, scale=0.1, o=o)

    arms = [("binding, torch tensors", direct), ("binding, DLPack capsules", capsules)]
    if ops._exchange:
        arms.append(("binding, exchange table", exchange))
    arms += [(f"torch_ops (eager) [{'exchange table' if ops._exchange else 'DLPack capsules'}]", op),
             ("PagedKVDecoder (eager)", engine_op), ("torch.ops dispatcher", dispatcher)]
    if dev == "cuda":
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            op()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            op()
        arms.append(("graph replay", graph.replay))
    # Five rounds, the arms interleaved in each, so drift on the machine hits every arm alike; the
    # median round per arm is printed.
    times = {name: [] for name, _ in arms}
    for _ in range(5):
        for name, fn in arms:
            times[name].append(per_call_us(fn, dev))
    for name, _ in arms:
        runs = sorted(times[name])
        print(f"{name:46s} {runs[2]:8.2f} us/call  (min {runs[0]:.2f}, max {runs[-1]:.2f})")
    # Host time alone: bursts of 200 calls enqueued without waiting (well inside the launch
    # queue), timed before the synchronization; best of five. The figures above are bounded
    # below by the GPU's time per launch, these are not.
    if dev != "cuda":
        return  # on the CPU the call is the work: there is no separate host time
    print("host time per call (enqueue only, best of 5 bursts of 200):")
    for name, fn in arms:
        if name.startswith("binding, torch tensors") or name == "graph replay":
            continue
        print(f"  {name:44s} {host_us(fn, dev):8.2f} us/call")


if __name__ == "__main__":
    main()
