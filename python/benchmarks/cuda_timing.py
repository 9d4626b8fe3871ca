"""Timing helpers the benchmarks share: CUDA events around a loop, and a
function captured once in a CUDA graph (warmed up on a side stream first,
as torch requires) whose replay is what gets timed."""

import torch


def time_ms(fn, iters=20, warmup=3):
    """Mean milliseconds per call of `fn` over `iters` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graphed(fn):
    """`fn` captured in a CUDA graph; returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay
