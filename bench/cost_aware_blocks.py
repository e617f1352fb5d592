#!/usr/bin/env python3
"""Cost-aware blocks (issue 15), before and after: `fcp plan --json` with and without
--no-cost-aware-blocks on the same batches. Prints, per workload, workers and placement, the
busiest worker's gap to the plan's own lower bound (worst over seeds), its gap to the lower
bound of the plan made without cost-aware blocks (the "original LB"), the ratio of the busiest
workers' costs (after / before, worst and median over seeds) and the median plan time.
Asserts nothing.

Usage: cost_aware_blocks.py FCP [--workers 64,256,1024] [--seeds 3] [--tokens-per-worker 32K]
                             [--block-size 4K] [--trace FILE:WORKERS ...]
"""
import argparse
import json
import statistics
import subprocess


def plan(fcp, args):
    out = subprocess.run([fcp, "plan", "--json", *args], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fcp")
    ap.add_argument("--workers", default="64,256,1024")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workloads", default="lognormal,lognormal-narrow,bimodal")
    ap.add_argument("--placements", default="local,lpt")
    ap.add_argument("--tokens-per-worker", default="32K")
    ap.add_argument("--block-size", default="4K")
    ap.add_argument("--trace", action="append", default=[],
                    help="FILE:WORKERS, planned once per placement")
    a = ap.parse_args()
    cases = []
    for workload in a.workloads.split(","):
        for n in a.workers.split(","):
            cases.append((f"{workload}", n, [["--workload", workload, "--workers", n,
                                              "--tokens-per-worker", a.tokens_per_worker,
                                              "--seed", str(s)] for s in range(a.seeds)]))
    for t in a.trace:
        path, n = t.rsplit(":", 1)
        cases.append((path.rsplit("/", 1)[-1], n, [["--trace", path, "--workers", n]]))
    for _, _, runs in cases:
        for run in runs:
            run += ["--block-size", a.block_size]
    print(f"{'batch':<24} {'N':>5} {'place':>5} {'gap before':>10} {'gap after':>9} "
          f"{'vs orig LB':>10} {'max after/before min/med/max':>29} {'cut seqs':>8} {'ms before':>9} "
          f"{'ms after':>8}")
    for name, n, runs in cases:
        for placement in a.placements.split(","):
            gb, ga, go, ratios, cuts, mb, ma = [], [], [], [], [], [], []
            for run in runs:
                before = plan(a.fcp, run + ["--placement", placement, "--no-cost-aware-blocks"])
                after = plan(a.fcp, run + ["--placement", placement])
                gb.append(before["lower_bound_gap"])
                ga.append(after["lower_bound_gap"])
                go.append(after["max_worker_cost"] / before["lower_bound"] - 1)
                ratios.append(after["max_worker_cost"] / before["max_worker_cost"])
                cuts.append(after["sharding"]["cost_cut_sequences"])
                mb.append(before["plan_ms"])
                ma.append(after["plan_ms"])
            print(f"{name:<24} {n:>5} {placement:>5} {100 * max(gb):9.2f}% {100 * max(ga):8.2f}% "
                  f"{100 * max(go):9.2f}% {min(ratios):.3f}/{statistics.median(ratios):.3f}/{max(ratios):.3f} "
                  f"{max(cuts):8d} {statistics.median(mb):9.1f} {statistics.median(ma):8.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
