#!/usr/bin/python3
"""Trains a small byte-level GPT on real text with FCP's context-parallel attention.

The text is vim's help files (Debian's vim-runtime, /usr/share/vim/vim*/doc/*.txt: about 150
documents from under 1 KB to 1.6 MB). Documents are shuffled (by --seed), concatenated and cut
into batches of --batch-tokens bytes; every document (or the piece of it inside a batch) is one
sequence, masked causally on its own through cu_seqlens: no padding, no cross-document
attention. The model is a decoder-only transformer: RoPE, GQA, pre-norm blocks with a GELU MLP.

    --attention local   one process, no context parallelism: the reference
    --attention fcp     FCP over the ranks of the default process group
    --attention ring    ring attention (FCP's executor running the ring plan)
    --layout transparent | dispatched
                        transparent: each rank keeps an even contiguous slice of the batch (the
                        caller's layout) and attention reshuffles; dispatched: token ids,
                        targets and positions are dispatched once per step into FCP's layout and
                        the whole model runs there.
    --plan-ahead        each step's batch is planned during the step before
                        (fcp.torch.PendingBatch), as a data loader prefetches
    --ulysses N         FCP as its paper deploys it: Ulysses inside nodes of N consecutive
                        ranks (a head exchange), FCP across the nodes (fcp.torch.ulysses_groups;
                        transparent layout)

Context-parallel runs are launched the ecosystem's way, torch.distributed.run, through
examples/launch.sh (which gives Debian 12's torch 1.13 the flags it needs, and runs
/usr/bin/python3, the interpreter with torch):
    examples/launch.sh 2 examples/train_gpt.py --attention fcp
Every rank holds the same weights; the gradients of its tokens are summed over the ranks
(all_reduce) before each optimiser step, so every run computes the same training step.
Per step it prints the loss, tokens/s and the share of the step spent in attention.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.environ.get("FCP_PYTHON_PATH", os.path.join(os.path.dirname(__file__), "..", "build",
                                                                    "python")))
import fcp.torch as fcp_torch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attention", choices=["local", "fcp", "ring"], default="fcp")
    p.add_argument("--layout", choices=["transparent", "dispatched"], default="transparent")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=2048, help="FCP's block size in tokens")
    p.add_argument("--plan-ahead", action="store_true",
                   help="plan each step's batch during the step before (fcp.torch.PendingBatch)")
    p.add_argument("--ulysses", type=int, default=1,
                   help="Ulysses inside nodes of this many consecutive ranks, FCP across them (fcp attention, "
                        "transparent layout)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="threads per process for torch and FCP's kernels (0: cores / processes)")
    p.add_argument("--text", default=None, help="glob of the documents (default: vim's help files)")
    p.add_argument("--json", default=None, help="write the per-step log here")
    p.add_argument("--plot", default=None, help="write a PNG of the loss curve(s) here")
    p.add_argument("--compare", nargs="*", default=[], help="other runs' --json logs to draw beside this one")
    args = p.parse_args(argv)
    for name in ("steps", "layers", "dim", "heads", "kv_heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected at least 1")
    if args.batch_tokens < 2:
        p.error(f"--batch-tokens {args.batch_tokens}: expected at least 2 (inputs and their next-byte targets)")
    if args.dim % args.heads or args.heads % args.kv_heads or (args.dim // args.heads) % 2:
        p.error(f"--dim {args.dim}, --heads {args.heads}, --kv-heads {args.kv_heads}: expected dim a multiple "
                "of heads with an even head dim (RoPE rotates pairs) and heads a multiple of kv heads")
    return args


def load_documents(pattern, seed):
    if pattern is None:
        found = sorted(glob.glob("/usr/share/vim/vim*/doc/*.txt"))
    else:
        found = sorted(glob.glob(pattern))
    if not found:
        raise SystemExit(f"train_gpt: no documents match {pattern or '/usr/share/vim/vim*/doc/*.txt'} "
                         "(install vim-runtime: scripts/install_deps.sh does)")
    docs = [open(path, "rb").read() for path in found]
    docs = [d for d in docs if d]
    random.Random(seed).shuffle(docs)
    return docs


def batches(docs, batch_tokens):
    """Yields (bytes of the batch, cu_seqlens): the shuffled documents cut at batch boundaries."""
    stream, cu = bytearray(), [0]
    while True:
        for d in docs:
            start = 0
            while start < len(d):
                take = min(len(d) - start, batch_tokens - len(stream))
                stream += d[start:start + take]
                cu.append(len(stream))
                start += take
                if len(stream) == batch_tokens:
                    yield bytes(stream), cu
                    stream, cu = bytearray(), [0]


def rope(x, pos, base=10000.0):
    """Rotary position embedding of x [tokens, heads, head_dim] at positions pos [tokens]."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = pos.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, pos, attend):
        n = x.shape[0]
        h = self.ln1(x)
        q = rope(self.wq(h).view(n, self.heads, self.head_dim), pos)
        k, v = self.wkv(h).view(n, 2, self.kv_heads, self.head_dim).unbind(1)
        k = rope(k, pos)
        x = x + self.wo(attend(q, k.contiguous(), v.contiguous()).reshape(n, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(256, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads, args.kv_heads) for _ in range(args.layers))
        self.ln = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, 256, bias=False)

    def forward(self, ids, pos, attend):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, pos, attend)
        return self.head(self.ln(x))


def main(argv=None):
    args = parse_args(argv)
    distributed = args.attention != "local"
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    ranks = dist.get_world_size() if distributed else 1
    group, inside = None, None
    if args.ulysses != 1:
        if args.attention != "fcp" or args.layout != "transparent":
            sys.exit(f"--ulysses {args.ulysses}: expected --attention fcp with --layout transparent")
        group, inside = fcp_torch.ulysses_groups(args.ulysses)
    threads = args.threads or max(1, (os.cpu_count() or 1) // ranks)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    model = GPT(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    docs = load_documents(args.text, args.seed)
    data = batches(docs, args.batch_tokens)
    log = []

    def plan(text, cu, ahead):
        """This rank's even share of the batch, planned now (Batch) or on a thread (PendingBatch)."""
        begin, end = rank * len(text) // ranks, (rank + 1) * len(text) // ranks
        make = fcp_torch.PendingBatch if ahead else fcp_torch.Batch
        return make(cu, (begin, end), group, heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.dim // args.heads, layout=args.layout,
                    strategy="ring" if args.attention == "ring" else "fcp", block_size=args.block_size,
                    threads=threads, ulysses_group=inside)

    ahead = args.plan_ahead and args.steps > 0
    upcoming = next(data) if ahead else None
    pending = plan(*upcoming, True) if ahead else None
    for step in range(args.steps):
        text, cu = upcoming if ahead else next(data)
        t0 = time.perf_counter()
        if ahead:
            batch = pending.batch()  # planned during the step before (the first: before the loop)
            if step + 1 < args.steps:  # the next step's batch plans while this one runs
                upcoming = next(data)
                pending = plan(*upcoming, True)
        else:
            batch = plan(text, cu, False)
        ids_all = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        # Next-byte targets inside each sequence; the last byte of a sequence predicts nothing.
        targets_all = torch.full_like(ids_all, -100)
        targets_all[:-1] = ids_all[1:]
        targets_all[torch.tensor(cu[1:], dtype=torch.int64) - 1] = -100
        count = int((targets_all >= 0).sum())
        begin, end = rank * len(text) // ranks, (rank + 1) * len(text) // ranks
        ids, targets = ids_all[begin:end], targets_all[begin:end]
        pos = fcp_torch.user_positions(cu, begin, end)
        if args.layout == "dispatched":
            ids, targets, pos = batch.dispatch(ids), batch.dispatch(targets), batch.position

        def attend(q, k, v):
            return fcp_torch.attention(q, k, v, batch)

        logits = model(ids, pos, attend)
        loss_sum = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        (loss_sum / count).backward()
        if distributed:
            for p in model.parameters():
                dist.all_reduce(p.grad)
            total = torch.tensor([loss_sum.item()], dtype=torch.float64)
            dist.all_reduce(total)
            loss = total.item() / count
        else:
            loss = loss_sum.item() / count
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        attention_seconds = batch.attention_seconds
        if distributed:  # the slowest rank's step and attention time
            t = torch.tensor([seconds, attention_seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds, attention_seconds = t.tolist()
        entry = {"step": step, "loss": loss, "tokens_per_s": len(text) / seconds, "step_s": seconds,
                 "attention_share": attention_seconds / seconds, "sequences": len(cu) - 1}
        log.append(entry)
        if rank == 0:
            print(f"step {step:3d}  loss {loss:.6f}  {entry['tokens_per_s']:8.0f} tokens/s  "
                  f"attention {100 * entry['attention_share']:4.1f}% of {seconds:.2f} s  "
                  f"({entry['sequences']} sequences)", flush=True)
    if rank == 0:
        run = {"attention": args.attention, "layout": args.layout, "ranks": ranks, "ulysses": args.ulysses,
               "threads": threads,
               "args": vars(args), "log": log}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(run, f, indent=1)
        if args.plot:
            plot([run] + [json.load(open(path)) for path in args.compare], args.plot)
    if distributed:
        dist.destroy_process_group()


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        steps = [e["step"] for e in run["log"]]
        label = run["attention"] + ("" if run["attention"] == "local" else f" ({run['layout']}, {run['ranks']} ranks)")
        ax.plot(steps, [e["loss"] for e in run["log"]], marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("byte-level GPT on vim's help files")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
