#!/usr/bin/python3
"""How far communication balance can go for one plan's blocks, by a randomised search.

Reads a plan written by `fcp plan --plan-out FILE` and searches placements of its blocks by
simulated annealing: a move sends one block of a worker (half the time the busiest one) to a
random other worker, or swaps it with one of that worker's blocks. A move is allowed only when
both workers stay under the memory cap and under the compute cap, max(the plan's busiest
worker, LB x (1 + --slack)). It is kept when it lowers the sum of squared bytes (sent plus
received per worker, as `imbalance.comm`) above a target, or by the annealing's chance
(--greedy: never). The target is the plan's mean bytes per worker, fixed: a move that adds bytes
anywhere costs. With --moving-mean it is the mean after the move instead, which is what
(max - mean) / max rewards: there, bytes added where they do not reach the top lower the
imbalance. Prints the plan's imbalance, busiest worker's bytes and total bytes, and the same
for the placement with the least imbalance the search passed through and for where it ended.

A research tool, not part of the planner: it reports what a search with a compute slack
reaches, to weigh the planner's balancer (docs/planner.md, session 18). Deterministic for a
given --seed. Needs only the standard library.

Usage: scripts/comm_search.py PLAN.json [--slack 0.002] [--iterations 60000] [--seed 1]
"""
import argparse
import collections
import json
import math
import random
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a plan written by fcp plan --plan-out")
    parser.add_argument("--slack", type=float, default=0.002,
                        help="compute above LB a worker may reach (default 0.002)")
    parser.add_argument("--iterations", type=int, default=60000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--greedy", action="store_true", help="keep only moves that help")
    parser.add_argument("--moving-mean", action="store_true",
                        help="measure the excess over the mean after each move")
    args = parser.parse_args()
    if not args.slack >= 0:
        sys.exit(f"comm_search: --slack {args.slack}: expected a number >= 0")
    if args.iterations < 1:
        sys.exit(f"comm_search: --iterations {args.iterations}: expected at least 1")
    try:
        with open(args.plan) as f:
            plan = json.load(f)
        config = plan["config"]
        workers = config["workers"]
        owner = list(plan["owner"])
        tokens = [sum(end - begin for _, begin, end in block) for block in plan["blocks"]]
        pairs = plan["pairs"]
        lower_bound = plan["lower_bound"]
        busiest = max(load[1] for load in plan["loads"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        sys.exit(f"comm_search: {args.plan}: not a plan written by fcp plan --plan-out ({e})")

    bytes_per_token = config["heads_kv"] * config["head_dim"] * 2 * config["element_bytes"]
    limit = config["memory_limit_tokens"] or config["tokens_per_worker"]
    memory_cap = limit + math.floor(limit * config["memory_slack"])
    compute_cap = max(busiest, lower_bound * (1 + args.slack)) * (1 + 1e-12)

    n = len(owner)
    cost = [0.0] * n
    reads = [[] for _ in range(n)]  # KV blocks each Q block reads, itself left out
    for q, kv, _, pair_cost in pairs:
        cost[q] += pair_cost
        if q != kv:
            reads[q].append(kv)
    need = [collections.Counter() for _ in range(n)]  # need[k][w]: w's Q blocks reading k
    for q in range(n):
        for kv in reads[q]:
            need[kv][owner[q]] += 1
    moved = [0] * workers
    load = [0.0] * workers
    memory = [0] * workers
    blocks_of = [set() for _ in range(workers)]

    def count(k, sign):
        """Adds (sign 1) or removes (-1) block k's transfers from both ends' bytes."""
        size = sign * tokens[k] * bytes_per_token
        for w, c in need[k].items():
            if c > 0 and w != owner[k]:
                moved[owner[k]] += size
                moved[w] += size

    for k in range(n):
        count(k, 1)
        load[owner[k]] += cost[k]
        memory[owner[k]] += tokens[k]
        blocks_of[owner[k]].add(k)

    def move(b, to):
        source = owner[b]
        touched = {b, *reads[b]}
        for k in touched:
            count(k, -1)
        for kv in reads[b]:
            need[kv][source] -= 1
            need[kv][to] += 1
        owner[b] = to
        for k in touched:
            count(k, 1)
        load[source] -= cost[b]
        load[to] += cost[b]
        memory[source] -= tokens[b]
        memory[to] += tokens[b]
        blocks_of[source].remove(b)
        blocks_of[to].add(b)

    def imbalance():
        top = max(moved)
        return (top - sum(moved) / workers) / top if top > 0 else 0.0

    plan_mean = sum(moved) / workers

    def excess():
        mean = sum(moved) / workers if args.moving_mean else plan_mean
        return sum(max(0.0, m - mean) ** 2 for m in moved) / 1e18

    def summary():
        return (f"imbalance {imbalance():.4f}, busiest {max(moved):.4g} B, "
                f"total {sum(moved) / 2:.4g} B")

    rng = random.Random(args.seed)
    start = summary()
    best, best_summary = imbalance(), start
    current = excess()
    temperature = 0.0 if args.greedy else current * 0.01 + 1e-9
    kept = 0
    for _ in range(args.iterations):
        temperature *= 0.9997
        w = max(range(workers), key=moved.__getitem__) if rng.random() < 0.5 else \
            rng.randrange(workers)
        u = rng.randrange(workers)
        if u == w or not blocks_of[w]:
            continue
        b = rng.choice(sorted(blocks_of[w]))
        b2 = rng.choice(sorted(blocks_of[u])) if blocks_of[u] and rng.random() < 0.8 else None
        dcost = cost[b] - (cost[b2] if b2 is not None else 0.0)
        dmemory = tokens[b] - (tokens[b2] if b2 is not None else 0)
        if load[u] + dcost > compute_cap or load[w] - dcost > compute_cap or \
                memory[u] + dmemory > memory_cap or memory[w] - dmemory > memory_cap:
            continue
        move(b, u)
        if b2 is not None:
            move(b2, w)
        after = excess()
        if after <= current or (temperature > 0 and
                                rng.random() < math.exp(-(after - current) / temperature)):
            current = after
            kept += 1
            if imbalance() < best:
                best, best_summary = imbalance(), summary()
        else:
            if b2 is not None:
                move(b2, u)
            move(b, w)
    print(f"{args.plan}, slack {args.slack}, {kept} of {args.iterations} moves kept\n"
          f"  plan:  {start}\n  least: {best_summary}\n  end:   {summary()}")


if __name__ == "__main__":
    main()
