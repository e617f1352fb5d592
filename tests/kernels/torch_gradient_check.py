#!/usr/bin/python3
"""Checks the kernels' forward and gradients against PyTorch autograd in float64.

The reference is torch's softmax(Q K^T / sqrt(d)) V with an explicit boolean mask and
repeat_interleave for GQA, differentiated by autograd: an implementation nobody here wrote.
Run with Debian's /usr/bin/python3 (python3-torch 1.13). Exits nonzero on any mismatch, and
when torch is missing: this check must never pass by skipping.

usage: torch_gradient_check.py PATH/TO/fcp_kernels_torch_helper
"""
import math
import os
import random
import subprocess
import sys
import tempfile

try:
    import numpy
    import torch
except ImportError as error:  # a missing torch is a failure, not a skip
    print(f"FAIL: {error}; install python3-torch and python3-numpy, run with /usr/bin/python3")
    sys.exit(1)

TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


def bf16_round(x):
    return x.to(torch.bfloat16).to(torch.float64)


def expand(segments):
    seq, pos = [], []
    for n, s, p in segments:
        seq += [s] * n
        pos += list(range(p, p + n))
    return torch.tensor(seq, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)


def torch_reference(q, k, v, do, mask):
    """q, do: [nq, hq, d]; k, v: [nk, hkv, d]; mask: [nq, nk] bool. Returns o, lse, grads."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    g = hq // hkv
    kx = k.repeat_interleave(g, dim=1)  # GQA: Q head h reads KV head h // g
    vx = v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kx) / math.sqrt(d)
    m = mask.unsqueeze(0).expand_as(s)
    empty = ~m.any(dim=-1, keepdim=True)  # rows that see nothing: O = 0, LSE = -inf
    s = s.masked_fill(~m, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1) * (~empty)
    o = torch.einsum("hqk,khd->qhd", p, vx)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty.squeeze(-1), float("-inf")).transpose(0, 1)
    (o * do).sum().backward()
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def magnitudes(q, k, v, do, mask):
    """The sizes of the terms each output sums, before they cancel: o and dv add P-weighted
    |v| and |dO|; dQ and dK add P (|dO|.|V| + |dO|.|O|) times |K| and |Q|, where dS = P (dP - D)
    and dP = dO.V, D = dO.O are themselves sums of d products (their terms' sizes, not theirs:
    a dot product that cancels to near zero still leaves eps times its terms; seed 725934902,
    one key, saw dq 2.3e-5 against |dP| + |D|). A gradient that is exactly zero by
    cancellation (one visible key: dP = D) has no relative error; float32 arithmetic leaves a
    residue of about eps times these sizes."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    g = hq // hkv
    kx, vx = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kx) / math.sqrt(d)
    m = mask.unsqueeze(0).expand_as(s)
    p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1).nan_to_num(0.0)
    o = torch.einsum("hqk,khd->qhd", p, vx)
    dp = torch.einsum("qhd,khd->hqk", do.abs(), vx.abs())  # |dO|.|V|, dP's terms
    rowdot = (do.abs() * o.abs()).sum(-1).transpose(0, 1).unsqueeze(-1)  # D's terms, [h, q, 1]
    ds = p * (dp + rowdot)
    dq = torch.einsum("hqk,khd->qhd", ds, kx.abs()) / math.sqrt(d)
    dkx = torch.einsum("hqk,qhd->khd", ds, q.abs()) / math.sqrt(d)
    dvx = torch.einsum("hqk,qhd->khd", p, do.abs())
    fold = lambda t: t.reshape(t.shape[0], hkv, g, d).sum(2)  # GQA: sum a KV head's Q heads
    return torch.einsum("hqk,khd->qhd", p, vx.abs()), None, dq, fold(dkx), fold(dvx)


def rel_l2(got, ref, size):
    """||got - ref|| / ||ref||; where ref is exactly zero, / ||size|| (see magnitudes)."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], ref[~finite]):
        return float("inf")
    num = (got[finite] - ref[finite]).norm().item()
    den = ref[finite].norm().item()
    if den == 0 and size is not None:
        den = size.norm().item()
    return num / den if den > 0 else num


def layouts(n, rng):
    """(name, kind, q segments, k segments) for a self-sized pair of n tokens."""
    c = n
    zigzag_q = [((n + 1) // 2, 7, 2 * c + 11), (n // 2, 7, 9 * c + 3)]
    zigzag_k = [((n + 1) // 2, 7, 2 * c + 11 - n // 3), (n // 2, 7, 5 * c)]
    varlen, at, sid = ([], []), 0, 0
    while at < n:
        length = min(n - at, 1 + rng.randrange(max(1, n // 3)))
        varlen[0].append((length, sid, 0))
        varlen[1].append((length, sid + 1000 if sid % 3 == 2 else sid, 0))
        at, sid = at + length, sid + 1
    return [("causal-zigzag", "causal", zigzag_q, zigzag_k),
            ("full", "full", [(n, 3, 100)], [(n, 3, 0)]),
            ("varlen", "causal", varlen[0], varlen[1])]


def run_case(helper, workdir, n, hq, hkv, d, layout, dtype, rng):
    name, kind, qseg, kseg = layout
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q = torch.randn(n, hq, d, generator=gen, dtype=torch.float64) * 2
    k, v = (torch.randn(n, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(n, hq, d, generator=gen, dtype=torch.float64)
    with open(os.path.join(workdir, "spec.txt"), "w") as f:
        f.write(f"{n} {n} {hq} {hkv} {d} {kind} {dtype}\n")
        for segs in (qseg, kseg):
            f.write(f"{len(segs)} " + " ".join(f"{a} {b} {c}" for a, b, c in segs) + "\n")
    for fname, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        t.to(torch.float32).numpy().tofile(os.path.join(workdir, fname + ".bin"))
    subprocess.run([helper, workdir], check=True)
    if dtype == "bf16":
        q, k, v, do = (bf16_round(t.to(torch.float32)) for t in (q, k, v, do))
    else:
        q, k, v, do = (t.to(torch.float32).to(torch.float64) for t in (q, k, v, do))
    qs, qp = expand(qseg)
    ks, kp = expand(kseg)
    mask = qs[:, None] == ks[None, :]
    if kind == "causal":
        mask &= kp[None, :] <= qp[:, None]
    ref = torch_reference(q, k, v, do, mask)
    sizes = magnitudes(q, k, v, do, mask)
    shapes = [(n, hq, d), (n, hq), (n, hq, d), (n, hkv, d), (n, hkv, d)]
    errors = {}
    for label, r, size, shape in zip(("o", "lse", "dq", "dk", "dv"), ref, sizes, shapes):
        got = torch.from_numpy(
            numpy.fromfile(os.path.join(workdir, label + ".bin"), dtype="float32")
        ).to(torch.float64).reshape(shape)
        errors[label] = rel_l2(got, r, size)
    worst = max(errors.values())
    ok = worst <= TOLERANCE[dtype]
    print(f"{'ok  ' if ok else 'FAIL'} n={n:4d} hq={hq} hkv={hkv} d={d} {name:13s} {dtype} "
          + " ".join(f"{key}={val:.2e}" for key, val in errors.items()))
    return ok


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    helper = sys.argv[1]
    seed = int(os.environ.get("FCP_TEST_SEED", random.randrange(2**32)))
    print(f"torch {torch.__version__}, seed {seed} (set FCP_TEST_SEED to replay)")
    rng = random.Random(seed)
    failures = 0
    with tempfile.TemporaryDirectory() as workdir:
        for n in (1, 77, 300):
            for hq, hkv in ((2, 2), (8, 2), (8, 1)):  # GQA ratios 1, 4, 8
                for layout in layouts(n, rng):
                    for dtype in ("fp32", "bf16"):
                        failures += not run_case(helper, workdir, n, hq, hkv, 32, layout, dtype, rng)
    print("PASS" if failures == 0 else f"FAIL: {failures} case(s) out of tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
