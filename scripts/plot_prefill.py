#!/usr/bin/env python3
"""Plots sparse_prefill_bench JSON: time to prefill a prompt against its
length for each layer kind, one line per chunk size, beside its FLOP and
read floors and, when given, dense attention of the same prompt
(python/benchmarks/prefill_vs_dense.py JSON: torch SDPA in the same chunks
and in one call, FlashInfer when it ran).

    python3 scripts/plot_prefill.py PREFILL.json OUT_DIR [--dense DENSE.json] [--title-suffix TEXT]

Writes one PNG per kind (prefill_<kind>.png) into OUT_DIR. Needs matplotlib
(scripts/install-python-deps.sh installs it from PyPI).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(rows, key):
    """(prompt in K tokens, value) pairs sorted by prompt, rows without `key` left out."""
    pts = sorted((r["prompt"], r[key]) for r in rows if r.get(key) is not None)
    return [p / 1024 for p, _ in pts], [v for _, v in pts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path")
    parser.add_argument("out_dir")
    parser.add_argument("--dense", default="", help="prefill_vs_dense.py JSON of the same prompts")
    parser.add_argument("--title-suffix", default="")
    args = parser.parse_args()
    with open(args.json_path) as f:
        sparse = json.load(f)
    dense = []
    if args.dense:
        with open(args.dense) as f:
            dense = json.load(f)
    if not sparse:
        print("plot_prefill: no timed rows in", args.json_path, file=sys.stderr)
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    device = sparse[0].get("device", "?")
    for kind in sorted({r["kind"] for r in sparse}):
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        mine = [r for r in sparse if r["kind"] == kind]
        for chunk in sorted({r["chunk"] for r in mine}):
            rows = [dict(r, ms=r["total_us"] / 1e3) for r in mine if r["chunk"] == chunk]
            ax.plot(*series(rows, "ms"), "-", marker="o", label=f"sparsepage, chunks of {chunk}")
        smallest = min(r["chunk"] for r in mine)  # it has every prompt
        floors = [dict(r, flop=r["flop_floor_us"] / 1e3, read=r["read_floor_us"] / 1e3 or None)
                  for r in mine if r["chunk"] == smallest]
        ax.plot(*series(floors, "flop"), ":", color="gray", label="FLOP floor of the selection")
        ax.plot(*series(floors, "read"), "--", color="gray", label="read floor of the selection")
        for arm, style in (("sdpa", "-."), ("flashinfer", (0, (3, 1, 1, 1)))):
            # dsa-fp8's dense arm is dsa's: the same prompt, attended densely.
            theirs = [r for r in dense if r["kind"] == kind.split("-")[0] and r.get(arm + "_ms") is not None]
            for chunk in sorted({r["chunk"] for r in theirs if r["chunk"] != r["prompt"]}):
                rows = [dict(r, ms=r[arm + "_ms"]) for r in theirs if r["chunk"] == chunk]
                ax.plot(*series(rows, "ms"), linestyle=style, marker="x", label=f"dense ({arm}), chunks of {chunk}")
            whole = [dict(r, ms=r[arm + "_ms"]) for r in theirs if r["chunk"] == r["prompt"]]
            if whole:
                ax.plot(*series(whole, "ms"), linestyle=style, marker="s", label=f"dense ({arm}), one call")
        ax.set_title(f"{kind} prefill on {device} {args.title_suffix}".strip(), fontsize=10)
        ax.set_xlabel("prompt (K tokens)")
        ax.set_ylabel("ms to prefill the prompt (indexer + attention)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        out = os.path.join(args.out_dir, f"prefill_{kind}.png")
        fig.savefig(out, dpi=120)
        print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
