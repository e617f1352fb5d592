#!/usr/bin/env python3
"""Draws a `fcp run --timeline` Chrome trace as a PNG: one row per (strategy, rank, lane).

Usage: runtime_timeline_plot.py TRACE.json OUT.png
Compute spans (kernel calls) are blue, messages orange, waits red; the pass spans named after
a strategy ("fcp", "ring") split the trace into one panel per strategy.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(trace_path, png_path):
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e["ph"] == "X"]
    runs = sorted([e for e in events if e["tid"] == 2 and e["name"] in ("fcp", "ring")],
                  key=lambda e: e["ts"])
    names = []
    for r in runs:
        if r["name"] not in names:
            names.append(r["name"])
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 2.2 * len(names) + 0.5), squeeze=False)
    colours = {0: "tab:blue", 1: "tab:orange"}
    for ax, name in zip(axes[:, 0], names):
        spans = [r for r in runs if r["name"] == name]
        begin = min(r["ts"] for r in spans)
        end = max(r["ts"] + r["dur"] for r in spans)
        ranks = sorted({r["pid"] for r in spans})
        labels = []
        for i, rank in enumerate(ranks):
            for lane, label in ((0, "compute"), (1, "messages")):
                y = len(labels)
                labels.append(f"rank {rank} {label}")
                bars = [(e["ts"] - begin, e["dur"]) for e in events
                        if e["pid"] == rank and e["tid"] == lane and begin <= e["ts"] <= end]
                ax.broken_barh([(s / 1e3, d / 1e3) for s, d in bars], (y - 0.4, 0.8),
                               facecolors=colours[lane], edgecolors="white", linewidth=0.3)
                if lane == 0:
                    waits = [(e["ts"] - begin, e["dur"]) for e in events
                             if e["pid"] == rank and e["tid"] == 2 and e["name"] == "wait"
                             and begin <= e["ts"] <= end]
                    ax.broken_barh([(s / 1e3, d / 1e3) for s, d in waits], (y - 0.4, 0.8),
                                   facecolors="tab:red")
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels)
        ax.set_title(f"{name}: one forward + backward, {(end - begin) / 1e6:.2f} s "
                     "(blue: kernels, orange: messages in flight, red: waiting)")
        ax.set_xlabel("ms")
        ax.set_xlim(0, (end - begin) / 1e3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
