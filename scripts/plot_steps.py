#!/usr/bin/env python3
"""Plots sparse_step_bench JSON: step time against context for each layer and
batch, with the graph-replayed step, the eager step, the mask-path step, the
attention phase of the step and the read-time floor.

    python3 scripts/plot_steps.py STEPS.json OUT_DIR [--title-suffix TEXT]

Writes one PNG per layer (step_<layer>.png) into OUT_DIR. Needs matplotlib
(scripts/install-python-deps.sh installs it from PyPI).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ARMS = [
    ("graph_us", "step, graph-replayed", "-", "o"),
    ("eager_us", "step, eager", "--", "s"),
    ("phase_attention_us", "attention phase of an eager step (events)", ":", "^"),
    ("mask_path_graph_us", "mask-path step, graph-replayed", "-.", "x"),
    ("floor_us", "read-time floor (bytes / measured peak)", "-", ""),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path")
    parser.add_argument("out_dir")
    parser.add_argument("--title-suffix", default="")
    args = parser.parse_args()
    with open(args.json_path) as f:
        data = json.load(f)
    rows = [r for r in data.get("rows", []) if "refused" not in r]
    if not rows:
        print("plot_steps: no timed rows in", args.json_path, file=sys.stderr)
        return 1
    os.makedirs(args.out_dir, exist_ok=True)
    for layer in sorted({r["layer"] for r in rows}):
        batches = sorted({r["batch"] for r in rows if r["layer"] == layer})
        fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            sel = sorted((r for r in rows if r["layer"] == layer and r["batch"] == batch), key=lambda r: r["context"])
            xs = [r["context"] / 1024 for r in sel]
            for key, label, style, marker in ARMS:
                ys = [r.get(key) for r in sel]
                if any(y is None for y in ys):
                    continue
                ax.plot(xs, ys, style, marker=marker, label=label)
            ax.set_title(f"{layer}, batch {batch}")
            ax.set_xlabel("context (K tokens)")
            ax.set_ylabel("microseconds per step")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{layer} decode step on {data.get('device', '?')} {args.title_suffix}".strip(), fontsize=10)
        fig.tight_layout()
        out = os.path.join(args.out_dir, f"step_{layer}.png")
        fig.savefig(out, dpi=120)
        print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
