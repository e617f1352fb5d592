#!/usr/bin/python3
"""Times Debian torch 1.13's attention on the problems of bench/kernel_bench.

Torch 1.13 has no fused CPU attention, so "its attention" is the textbook composition:
softmax(Q K^T / sqrt(d) + mask) V with repeat_interleave for GQA, forward and autograd
backward. GFLOP/s use the same useful-FLOP convention as the kernels (DESIGN.md): 4 * visible
pairs * heads_q * head_dim forward, 2.5 times that backward. Prints one JSON object per line.

usage: torch_attention_bench.py --tokens 1024 2048 --threads 1 2 [--dtypes fp32 bf16]
       [--masks causal full] [--heads-q 8] [--heads-kv 1] [--head-dim 128] [--reps 1]
"""
import argparse
import json
import math
import time

import torch


def attention(q, k, v, mask):
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
    s = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def best_time(fn, reps):
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--masks", nargs="+", default=["causal", "full"])
    ap.add_argument("--heads-q", type=int, default=8)
    ap.add_argument("--heads-kv", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in args.dtypes:
            for mask_kind in args.masks:
                for n in args.tokens:
                    gen = torch.Generator().manual_seed(0)
                    make = lambda h: torch.randn(h, n, args.head_dim, generator=gen).to(dtypes[dtype])
                    q, k, v = make(args.heads_q), make(args.heads_kv), make(args.heads_kv)
                    do = make(args.heads_q)
                    mask = None
                    visible = n * n
                    if mask_kind == "causal":
                        mask = torch.ones(n, n, dtype=torch.bool).tril()
                        visible = n * (n + 1) // 2
                    flops = 4.0 * visible * args.heads_q * args.head_dim
                    fwd = best_time(lambda: attention(q, k, v, mask), args.reps)

                    def fwd_bwd():
                        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                        o = attention(qq, kk, vv, mask)
                        start = time.perf_counter()
                        o.backward(do)
                        return time.perf_counter() - start

                    bwd = min(fwd_bwd() for _ in range(args.reps))
                    print(json.dumps({"dtype": dtype, "mask": mask_kind, "tokens": n,
                                      "threads": threads, "forward_gflops": flops / fwd * 1e-9,
                                      "backward_gflops": 2.5 * flops / bwd * 1e-9}), flush=True)


if __name__ == "__main__":
    main()
