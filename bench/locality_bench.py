#!/usr/bin/env python3
"""Bytes moved per step, locality-first placement against the paper's (LPT), same batches.

For each built-in workload, worker count and seed, plans the batch with `--placement local`
and `--placement lpt` and prints the ratio of bytes moved per step (both passes, reshuffle and
KV, every worker), the busiest worker's bytes, and each plan's gap to the lower bound. Prints;
asserts nothing. Usage: bench/locality_bench.py [--fcp build/apps/fcp/fcp] [--workers 2,8,...]
"""
import argparse
import json
import statistics
import subprocess


def plan(fcp, workload, workers, seed, placement, extra):
    out = subprocess.run([fcp, "plan", "--workload", workload, "--workers", str(workers),
                          "--seed", str(seed), "--placement", placement, "--json"] + extra,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fcp", default="build/apps/fcp/fcp")
    ap.add_argument("--workers", default="2,8,64,256,1024")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--workloads", default="lognormal,lognormal-narrow,bimodal")
    ap.add_argument("--block-size", default="4K")
    ap.add_argument("--tokens-per-worker", default="32K")
    ap.add_argument("--locality-slack", default="0.01")
    a = ap.parse_args()
    extra = ["--block-size", a.block_size, "--tokens-per-worker", a.tokens_per_worker]
    localExtra = extra + ["--locality-slack", a.locality_slack]
    print(f"block {a.block_size}, {a.tokens_per_worker} tokens per worker, seeds 0..{a.seeds - 1}, "
          f"locality slack {a.locality_slack}; gaps to the paper's lower bound (worst seed)")
    print(f"{'workload':<17}{'workers':>8}{'median len':>11}{'step bytes':>12}{'worst':>8}"
          f"{'busiest':>9}{'gap local':>10}{'gap lpt':>9}{'fell back':>10}")
    for workload in a.workloads.split(","):
        for workers in [int(w) for w in a.workers.split(",")]:
            ratios, busiest, gaps, gapsLpt, medians, fallbacks = [], [], [], [], [], 0
            for seed in range(a.seeds):
                loc = plan(a.fcp, workload, workers, seed, "local", localExtra)
                lpt = plan(a.fcp, workload, workers, seed, "lpt", extra)
                ratios.append(loc["step_bytes"] / max(1, lpt["step_bytes"]))
                busiest.append(loc["max_worker_step_bytes"] / max(1, lpt["max_worker_step_bytes"]))
                # Both against the paper's lower bound (its blocks), the stricter reference.
                gaps.append(loc["max_worker_cost"] / lpt["lower_bound"] - 1)
                gapsLpt.append(lpt["lower_bound_gap"])
                medians.append(loc["median_sequence_length"])
                fallbacks += loc["placement"] != "local"
            print(f"{workload:<17}{workers:>8}{statistics.median(medians):>11.0f}"
                  f"{statistics.median(ratios):>11.3f}x{max(ratios):>7.3f}x"
                  f"{statistics.median(busiest):>8.3f}x{100 * max(gaps):>9.2f}%"
                  f"{100 * max(gapsLpt):>8.2f}%{fallbacks:>7}/{a.seeds}")


if __name__ == "__main__":
    main()
