#!/usr/bin/python3
"""What fcp.torch saves by reading q, k, v of a fused projection in place (row strides) rather
than copying them: one rank, forward and backward, the views against their contiguous copies
(what fcp.torch made of them before), alternated. Prints medians and their ratio.

usage: PYTHONPATH=build/python bench/fused_views_bench.py [--tokens 8192] [--reps 11]
"""
import argparse
import statistics
import time

import torch

import fcp.torch as ft


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--sequence", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    n, heads, kv_heads, dim = args.tokens, 8, 2, 64
    cu = list(range(0, n, args.sequence)) + [n]
    x = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(0))
    batch = ft.Batch(cu, (0, n), None, heads=heads, kv_heads=kv_heads, head_dim=dim, threads=args.threads)

    def step(copy: bool) -> float:
        qkv = x.clone().requires_grad_()
        q = qkv[:, :heads * dim].view(n, heads, dim)
        k, v = qkv[:, heads * dim:].view(n, 2, kv_heads, dim).unbind(1)
        if copy:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        start = time.perf_counter()
        ft.attention(q, k, v, batch).sum().backward()
        return time.perf_counter() - start

    times = {False: [], True: []}
    for _ in range(args.reps):
        for copy in (False, True):
            times[copy].append(step(copy))
    views, copies = statistics.median(times[False]), statistics.median(times[True])
    print(f"tokens {n} in sequences of {args.sequence}, {heads}/{kv_heads} heads x {dim}, fp32: "
          f"views {views * 1e3:.1f} ms, copies {copies * 1e3:.1f} ms, copies/views {copies / views:.3f} "
          f"(medians of {args.reps})")


if __name__ == "__main__":
    main()
