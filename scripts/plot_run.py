#!/usr/bin/env python3
"""Plots one or more runs' metrics.jsonl into one PNG: loss (and val loss), tokens/s, and each
run's device time per step split by op category (stacked). Runs are labelled by the folder that
holds their metrics file, and overlaid for comparison.

usage: scripts/plot_run.py RUN/metrics.jsonl [OTHER/metrics.jsonl ...] [--out run.png]
"""
import argparse
import json
import os
import sys


def read_metrics(path):
    """The lines of a metrics file; a resumed run's repeated steps keep their last line."""
    by_step = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                m = json.loads(line)
            except json.JSONDecodeError:
                print(f"{path}:{n}: not a JSON line, skipped (a torn last line?)", file=sys.stderr)
                continue
            by_step[m["step"]] = m
    return [by_step[s] for s in sorted(by_step)]


def label_of(path):
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent or path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", nargs="+", help="metrics.jsonl files (one per run)")
    ap.add_argument("--out", default="run.png", help="the PNG to write (default run.png)")
    args = ap.parse_args()
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: plot_run.py needs matplotlib (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = []
    for path in args.metrics:
        if not os.path.isfile(path):
            sys.exit(f"error: {path}: no such file")
        rows = read_metrics(path)
        if not rows:
            sys.exit(f"error: {path}: no metrics lines")
        runs.append((label_of(path), rows))

    # A first row for loss and throughput (runs overlaid), then one row per run for its time split
    # by op category and by phase (stacked areas of several runs do not overlay legibly).
    fig, axes = plt.subplots(1 + len(runs), 2, figsize=(13, 4 + 3.2 * len(runs)), squeeze=False)
    ax_loss, ax_tok = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rows) in enumerate(runs):
        c = colors[i % len(colors)]
        steps = [r["step"] for r in rows]
        # null (a non-finite value) becomes a gap in the line.
        loss = [r["loss"] if r.get("loss") is not None else float("nan") for r in rows]
        ax_loss.plot(steps, loss, color=c, label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if val:
            ax_loss.plot(*zip(*val), color=c, linestyle="--", marker="o", markersize=3, label=f"{label} val")
        tok_s = [r["tokens"] / r["step_seconds"] if r.get("step_seconds") else float("nan") for r in rows]
        ax_tok.plot(steps, tok_s, color=c, label=label)
    ax_loss.set(title="loss", xlabel="step", ylabel="loss")
    ax_tok.set(title="throughput", xlabel="step", ylabel="tokens/s")
    for ax in (ax_loss, ax_tok):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    for i, (label, rows) in enumerate(runs):
        ax_split, ax_phase = axes[1 + i]
        steps = [r["step"] for r in rows]
        cats = list(rows[0].get("op_seconds", {}).keys())
        if cats:
            ax_split.stackplot(steps, *[[1e3 * r.get("op_seconds", {}).get(k, 0.0) for r in rows] for k in cats],
                               labels=cats)
        ax_split.plot(steps, [1e3 * r["step_seconds"] for r in rows], color="black", linewidth=1, label="step (wall)")
        ax_split.set(title=f"{label}: device time by op category", xlabel="step", ylabel="ms")
        phases = list(rows[0].get("phase_seconds", {}).keys())
        if phases:
            ax_phase.stackplot(steps, *[[1e3 * r.get("phase_seconds", {}).get(k, 0.0) for r in rows] for k in phases],
                               labels=phases)
        host = [(r["step"], 1e3 * r["host_optimizer"]["wait_seconds"]) for r in rows if "host_optimizer" in r]
        if host:
            ax_phase.plot(*zip(*host), color="black", linestyle=":", label="host optimizer wait")
        ax_phase.set(title=f"{label}: device time by phase", xlabel="step", ylabel="ms")
        for ax in (ax_split, ax_phase):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(runs)} run{'s' if len(runs) != 1 else ''})")


if __name__ == "__main__":
    main()
