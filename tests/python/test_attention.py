"""fcp.torch on 2+ ranks against a float64 PyTorch reference of plain attention on the whole
batch: outputs and the gradients of q, k, v through the autograd function, in both layouts,
fp32 and bf16, GQA, causal and full masks, uneven splits (one rank may hold nothing, slices
start mid-sequence).

Run under a launcher, every rank running pytest in step (each test is collective):
    examples/launch.sh 2 -m pytest tests/python     (torch.distributed.run)
        -> the caller's gloo process group
    FCP_TEST_COMM=mpi mpirun -n 2 python3 -m pytest tests/python
        -> an mpi4py communicator
"""
import os
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import fcp
import fcp.torch as ft

USE_MPI = os.environ.get("FCP_TEST_COMM") == "mpi"


@pytest.fixture(scope="session")
def group():
    """(group argument for fcp.torch.Batch, rank, ranks)."""
    if USE_MPI:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        yield comm, comm.Get_rank(), comm.Get_size()
    else:
        dist.init_process_group("gloo")
        yield None, dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()


def reference(q, k, v, cu, causal, scale=None):
    """Plain attention per sequence in float64 (autograd-capable); scores scaled by `scale`
    (1/sqrt(head_dim) when None)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = []
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if causal:
            n = b - a
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


def rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def split(total, ranks, seed):
    """An uneven split of `total` tokens; with seed % 2 == 0, rank seed % ranks holds nothing."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, total + 1, (ranks - 1,), generator=g).tolist())
    starts = [0] + cuts + [total]
    if seed % 2 == 0:
        r = seed % ranks
        starts[r + 1] = starts[r]
        for i in range(r + 2, len(starts)):
            starts[i] = max(starts[i], starts[i - 1])
        starts[-1] = total
    return starts


CASES = [
    # (seed, dtype, layout, causal, heads, kv_heads, head_dim, strategy)
    (0, torch.float32, "transparent", True, 4, 2, 16, "fcp"),
    (1, torch.float32, "dispatched", True, 4, 1, 32, "fcp"),
    (2, torch.bfloat16, "transparent", True, 4, 2, 16, "fcp"),
    (3, torch.bfloat16, "dispatched", False, 2, 2, 64, "fcp"),
    (4, torch.float32, "transparent", False, 8, 2, 16, "ring"),
    (5, torch.float32, "dispatched", True, 4, 2, 16, "magi"),
]


def test_the_version_is_the_cmake_projects():
    """fcp.__version__ is the version CMakeLists.txt's project() names."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "CMakeLists.txt")).read()
    assert fcp.__version__ == re.search(r"project\(fcp VERSION ([0-9.]+)", text).group(1)


@pytest.mark.parametrize("seed,dtype,layout,causal,heads,kv_heads,dim,strategy", CASES)
def test_outputs_and_gradients_match_float64_reference(group, seed, dtype, layout, causal, heads, kv_heads, dim,
                                                       strategy):
    comm, rank, ranks = group
    g = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(1, 300, (6,), generator=g).tolist()
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1]
    starts = split(total, ranks, seed)
    begin, end = starts[rank], starts[rank + 1]
    whole = {name: torch.randn(total, h, dim, generator=g).to(dtype).double()
             for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("do", heads))}

    batch = ft.Batch(cu, (begin, end), comm, heads=heads, kv_heads=kv_heads, head_dim=dim, causal=causal,
                     dtype=dtype, layout=layout, strategy=strategy, block_size=128)
    expect_reference(batch, whole, cu, causal)


def expect_reference(batch, whole, cu, causal, scale=None):
    """Runs attention of this rank's rows of `whole` (float64 q, k, v, do of the whole batch)
    through `batch`, forward and backward, and compares o and the gradients with the float64
    reference; returns o."""
    dtype, begin, end = batch.dtype, batch.begin, batch.end
    mine = {name: t[begin:end].to(dtype).clone().requires_grad_(name != "do") for name, t in whole.items()}
    if batch.layout == "dispatched":
        q, k, v = (batch.dispatch(mine[n]) for n in ("q", "k", "v"))
        o = batch.undispatch(ft.attention(q, k, v, batch))
    else:
        o = ft.attention(mine["q"], mine["k"], mine["v"], batch)
    (o.float() * mine["do"].float()).sum().backward()

    ref_inputs = {n: whole[n].clone().requires_grad_(n != "do") for n in whole}
    ref = reference(ref_inputs["q"], ref_inputs["k"], ref_inputs["v"], cu, causal, scale)
    (ref * ref_inputs["do"]).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    if end > begin:
        assert rel(o, ref[begin:end]) <= tolerance
        for n in ("q", "k", "v"):
            assert rel(mine[n].grad, ref_inputs[n].grad[begin:end]) <= tolerance, n
    return o


def test_inputs_in_any_memory_layout_give_contiguous_correct_outputs(group):
    """q dense but permuted (a [heads, tokens, dim] tensor transposed), k a strided slice of a
    fused projection, v expanded from one head: o and the gradients as for contiguous copies, and
    o contiguous (o once took q's strides while FCP wrote it in [tokens, heads, dim] order)."""
    comm, rank, ranks = group
    g = torch.Generator().manual_seed(7)
    cu = [0, 150, 190, 400]
    total, heads, kv_heads, dim = cu[-1], 4, 2, 16
    begin, end = total * rank // ranks, total * (rank + 1) // ranks
    n = end - begin
    whole_q = torch.randn(heads, total, dim, generator=g, dtype=torch.float64)
    whole_kv = torch.randn(total, 2 * kv_heads, dim, generator=g, dtype=torch.float64)
    whole_v = torch.randn(total, 1, dim, generator=g, dtype=torch.float64)
    batch = ft.Batch(cu, (begin, end), comm, heads=heads, kv_heads=kv_heads, head_dim=dim, block_size=64)

    def inputs():
        q = whole_q[:, begin:end].float().clone().requires_grad_()
        kv = whole_kv[begin:end].float().clone().requires_grad_()
        v = whole_v[begin:end].float().clone().requires_grad_()
        return q, kv, v

    q, kv, v = inputs()
    odd = (q.transpose(0, 1), kv[:, 0::2], v.expand(n, kv_heads, dim))
    assert not odd[0].is_contiguous() and not odd[1].is_contiguous() and not odd[2].is_contiguous()
    o = ft.attention(*odd, batch)
    q2, kv2, v2 = inputs()
    o2 = ft.attention(q2.transpose(0, 1).contiguous(), kv2[:, 0::2].contiguous(),
                      v2.expand(n, kv_heads, dim).contiguous(), batch)
    assert o.is_contiguous() and o.shape == (n, heads, dim)
    ref = reference(whole_q.transpose(0, 1), whole_kv[:, 0::2], whole_v.expand(total, kv_heads, dim), cu, True)
    if n > 0:
        assert rel(o, ref[begin:end]) <= 1e-5
        assert torch.equal(o, o2)
    do = torch.randn(total, heads, dim, generator=g)[begin:end]
    (o * do).sum().backward()
    (o2 * do).sum().backward()
    for a, b in ((q, q2), (kv, kv2), (v, v2)):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "transparent"), (torch.bfloat16, "dispatched")])
def test_views_of_a_fused_projection_are_read_in_place(group, dtype, layout, monkeypatch):
    """q, k, v as qkv.unbind(1) of one [tokens, 3, heads, head_dim] projection (and, dispatched,
    a column slice of a wider tensor to dispatch): FCP reads them where they are, rows a stride
    apart, no copy made; o and the gradients are bit for bit those of contiguous copies, and
    match the float64 reference."""
    comm, rank, ranks = group
    cu = [0, 90, 95, 260, 300]
    starts = split(300, ranks, 4)
    begin, end = starts[rank], starts[rank + 1]
    g = torch.Generator().manual_seed(11)
    whole = torch.randn(300, 3, 2, 16, generator=g, dtype=torch.float64)
    whole_do = torch.randn(300, 2, 16, generator=g, dtype=torch.float64).to(dtype)
    do = whole_do[begin:end]
    batch = ft.Batch(cu, (begin, end), comm, heads=2, kv_heads=2, head_dim=16, dtype=dtype, layout=layout,
                     block_size=64)

    def run(fused: bool):
        qkv = whole[begin:end].to(dtype).clone().requires_grad_()
        if layout == "dispatched":  # dispatched as one [tokens, 3 * 2 * 16] tensor, then viewed
            wide = torch.cat([qkv.reshape(end - begin, 96), torch.zeros(end - begin, 5, dtype=dtype)], 1)
            x = wide[:, :96] if fused else wide[:, :96].contiguous()
            assert fused == (not x.is_contiguous()) or end - begin <= 1
            local = batch.dispatch(x).view(-1, 3, 2, 16)
        else:
            local = qkv
        q, k, v = local.unbind(1) if fused else (t.contiguous() for t in local.unbind(1))
        copies = []
        if fused and q.shape[0] > 1:
            assert not q.is_contiguous()
            real = torch.Tensor.contiguous
            monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **kw: copies.append(t) or real(t, *a, **kw))
        o = ft.attention(q, k, v, batch)
        monkeypatch.undo()
        assert not copies, "attention copied a view of the fused projection"
        o = batch.undispatch(o) if layout == "dispatched" else o
        (o.float() * do.float()).sum().backward()
        return o.detach(), qkv.grad

    o, grad = run(True)
    o2, grad2 = run(False)
    assert torch.equal(o, o2) and torch.equal(grad, grad2)
    ref_in = whole.clone().requires_grad_()
    ref = reference(*ref_in.unbind(1), cu, True)
    (ref * whole_do.double()).sum().backward()
    if end > begin:
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel(o, ref[begin:end]) <= tolerance
        assert rel(grad, ref_in.grad[begin:end]) <= tolerance


@pytest.mark.parametrize("scale,dtype,layout", [(1 / 32, torch.float32, "dispatched"),
                                                  (0.7, torch.bfloat16, "transparent")])
def test_a_models_own_softmax_scale(group, scale, dtype, layout):
    """softmax_scale (1/head_dim as muP has it, or larger than the default) in forward and
    backward, against the float64 reference with that scale."""
    comm, rank, ranks = group
    g = torch.Generator().manual_seed(11)
    cu = [0, 170, 200, 420]
    total, heads, kv_heads, dim = cu[-1], 4, 2, 32
    starts = split(total, ranks, 3)
    begin, end = starts[rank], starts[rank + 1]
    whole = {name: torch.randn(total, h, dim, generator=g).to(dtype).double()
             for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("do", heads))}
    batch = ft.Batch(cu, (begin, end), comm, heads=heads, kv_heads=kv_heads, head_dim=dim, dtype=dtype,
                     layout=layout, block_size=64, softmax_scale=scale)
    o = expect_reference(batch, whole, cu, True, scale)
    if end > begin:  # not the default scale's result: the scale reached the kernels
        assert rel(o, reference(whole["q"], whole["k"], whole["v"], cu, True)[begin:end]) > 0.1


def test_a_softmax_scale_that_is_not_a_positive_number_or_differs_between_ranks(group):
    """A bad softmax_scale on one rank fails every rank at once; different scales on different
    ranks are named; a good batch follows on the same group."""
    comm, rank, ranks = group
    cu = [0, 100, 300]
    starts = split(300, ranks, 9)
    mine = (starts[rank], starts[rank + 1])
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=64)
    last = ranks - 1
    # Past fp32's range (the kernels') too, rather than turned into inf, or into 0 (which would
    # mean the default).
    for bad in (0, -1.0, float("nan"), "0.1", True, float("inf"), 1e39, 1e-50, torch.tensor(float("inf"))):
        expected = (r"softmax_scale is .*: expected a number above 0 in fp32's range \(1\.17549e-38 to "
                    r"3\.40282e\+38, the kernels'\), or None for 1/sqrt\(head_dim\)" if rank == last
                    else r"rank %d: rank %d's arguments were refused there" % (rank, last))
        with pytest.raises(fcp.Error, match=expected):
            ft.Batch([0, 100, 300], mine, comm, **dict(options, softmax_scale=bad if rank == last else None))
    # A 0-d tensor is its value (fp32's 0.1 and 0.1 are one scale to the kernels).
    assert ft.Batch(cu, mine, comm, softmax_scale=torch.tensor(0.1) if rank == 0 else 0.1,
                    **options).num_user_tokens == mine[1] - mine[0]
    with pytest.raises(fcp.Error, match=r"the ranks passed different batches or settings \(softmax scale\)"):
        ft.Batch(cu, mine, comm, softmax_scale=0.1 * (rank + 1), **options)
    assert ft.Batch(cu, mine, comm, softmax_scale=0.1, **options).num_user_tokens == mine[1] - mine[0]


def test_dispatch_names_each_local_token_and_round_trips(group):
    comm, rank, ranks = group
    cu = [0, 70, 75, 205, 238]
    starts = split(238, ranks, 1)
    begin, end = starts[rank], starts[rank + 1]
    batch = ft.Batch(cu, (begin, end), comm, heads=2, kv_heads=1, head_dim=16, layout="dispatched", block_size=64)
    index = torch.arange(begin, end, dtype=torch.int64)
    local = batch.dispatch(index)
    assert local.shape[0] == batch.num_local_tokens
    assert torch.equal(local, torch.tensor(cu)[batch.sequence] + batch.position)
    assert torch.equal(batch.undispatch(local), index)
    assert torch.equal(ft.user_positions(cu, begin, end),
                       index - torch.tensor(cu)[torch.searchsorted(torch.tensor(cu), index, right=True) - 1])


def test_empty_sequences_in_cu_seqlens_as_flash_attention_pads_them(group):
    """cu_seqlens with empty sequences (a repeated offset, as FlashAttention's varlen padding to a
    fixed count has; they used to be refused): outputs and gradients match the reference in both
    layouts, and batch.sequence numbers sequences as cu_seqlens does."""
    comm, rank, ranks = group
    cu = [0, 0, 70, 70, 75, 205, 238, 238, 238]
    starts = split(238, ranks, 3)
    begin, end = starts[rank], starts[rank + 1]
    g = torch.Generator().manual_seed(5)
    whole = {name: torch.randn(238, h, 16, generator=g).double()
             for name, h in (("q", 2), ("k", 1), ("v", 1), ("do", 2))}
    for layout in ("transparent", "dispatched"):
        batch = ft.Batch(cu, (begin, end), comm, heads=2, kv_heads=1, head_dim=16, layout=layout, block_size=64)
        expect_reference(batch, whole, cu, True)
    cu_t = torch.tensor(cu)
    index = torch.arange(begin, end, dtype=torch.int64)
    local = batch.dispatch(index)
    assert torch.equal(local, cu_t[batch.sequence] + batch.position)
    assert bool((cu_t[batch.sequence + 1] > cu_t[batch.sequence]).all())
    assert torch.equal(ft.user_positions(cu, begin, end),
                       index - cu_t[torch.searchsorted(cu_t, index, right=True) - 1])


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_recomputes_attention_in_backward(group, reentrant):
    """Two layers under torch.utils.checkpoint, as long-context training runs them: each
    layer's forward (a fused qkv projection, q, k, v as non-contiguous views) runs again inside
    backward, on every rank in the same order; the input's gradient matches the float64
    reference of the whole batch."""
    from torch.utils.checkpoint import checkpoint
    comm, rank, ranks = group
    cu = [0, 70, 75, 205, 238]
    starts = split(238, ranks, 5)
    begin, end = starts[rank], starts[rank + 1]
    g = torch.Generator().manual_seed(9)
    w = [0.2 * torch.randn(32, 3 * 2 * 16, generator=g, dtype=torch.float64) for _ in range(2)]
    x = torch.randn(238, 32, generator=g, dtype=torch.float64)

    def layer(h, weight, attend):
        q, k, v = (h @ weight.to(h.dtype)).view(h.shape[0], 3, 2, 16).unbind(1)
        return h + attend(q, k, v).reshape(h.shape[0], 32)

    batch = ft.Batch(cu, (begin, end), comm, heads=2, kv_heads=2, head_dim=16, block_size=32)
    mine = x[begin:end].float().clone().requires_grad_()
    h = mine
    for weight in w:
        h = checkpoint(layer, h, weight, lambda q, k, v: ft.attention(q, k, v, batch), use_reentrant=reentrant)
    h.pow(2).sum().backward()
    whole = x.clone().requires_grad_()
    ref = whole
    for weight in w:
        ref = layer(ref, weight, lambda q, k, v: reference(q, k, v, cu, True))
    ref.pow(2).sum().backward()
    if end > begin:
        assert rel(h.detach(), ref[begin:end]) <= 1e-5
        assert rel(mine.grad, whole.grad[begin:end]) <= 1e-5


def test_bad_input_is_one_line_error(group):
    comm, rank, ranks = group
    cu = [0, 100, 160]
    starts = split(160, ranks, 1)
    batch = ft.Batch(cu, (starts[rank], starts[rank + 1]), comm, heads=2, kv_heads=1, head_dim=16, block_size=64)
    n = batch.num_call_tokens
    # Bad input is an fcp.InvalidArgument: an fcp.Error (a RuntimeError) and a ValueError too.
    assert issubclass(fcp.Error, RuntimeError) and issubclass(fcp.TransportError, fcp.Error)
    with pytest.raises(ValueError, match=r"q is \(%d, 2, 8\)" % n) as raised:
        ft.attention(torch.zeros(n, 2, 8), torch.zeros(n, 1, 16), torch.zeros(n, 1, 16), batch)
    assert type(raised.value) is fcp.InvalidArgument and isinstance(raised.value, fcp.Error)
    with pytest.raises(fcp.InvalidArgument, match="dtype"):  # fcp.torch's own check, through the agreement
        ft.Batch(cu, (starts[rank], starts[rank + 1]), comm, heads=2, kv_heads=1, head_dim=16,
                 dtype=torch.float16)
    for bad in ("gloo", 123):  # torch's own errors before (RuntimeError, "Group gloo is not registered")
        with pytest.raises(fcp.InvalidArgument, match=r"^group is %r: expected None \(the default process group\), "
                                                      r"a torch.distributed process group or an mpi4py communicator$" % bad):
            ft.Batch(cu, (starts[rank], starts[rank + 1]), bad, heads=2, kv_heads=1, head_dim=16)
    if not USE_MPI:  # a group without this rank ("transport rank -1 of -1" before)
        first = dist.new_group([0])
        if rank == 0:
            assert ft.Batch([0, 10], (0, 10), first, heads=2, kv_heads=1, head_dim=16).num_user_tokens == 10
        else:
            with pytest.raises(fcp.InvalidArgument, match=r"^this process \(global rank %d\) is not a member of the "
                                                          r"process group passed as group" % rank):
                ft.Batch([0, 10], (0, 10), first, heads=2, kv_heads=1, head_dim=16)
    # Something else than a Batch (AttributeError before), a pending one included.
    pending = ft.PendingBatch(cu, (starts[rank], starts[rank + 1]), comm, heads=2, kv_heads=1, head_dim=16,
                              block_size=64)
    for bad, text in ((pending, "a PendingBatch"), (None, "None")):
        with pytest.raises(fcp.InvalidArgument, match=r"^batch is %s: expected an fcp.torch.Batch" % text):
            ft.attention(torch.zeros(n, 2, 16), torch.zeros(n, 1, 16), torch.zeros(n, 1, 16), bad)
    assert pending.batch().num_user_tokens == batch.num_user_tokens
    with pytest.raises(fcp.InvalidArgument, match=r"cu_seqlens starts \[10\]"):  # fcp.torch's, here only
        ft.user_positions([10, 20], 0, 5)
    # Options out of range (every rank passes the same, so every rank refuses alike).
    for options, message in [({"threads": 1000}, "thread count 1000: expected 1 to 256"),
                             ({"block_size": 2 ** 40}, "block size 1099511627776: expected 16 to"),
                             ({"block_size": 15}, "block size 15: expected 16 to"),
                             ({"timeout_seconds": 0}, "timeout_seconds 0: expected"),
                             ({"timeout_seconds": float("nan")}, "timeout_seconds nan: expected")]:
        with pytest.raises(fcp.Error, match=message):
            ft.Batch(cu, (starts[rank], starts[rank + 1]), comm, heads=2, kv_heads=1, head_dim=16, **options)


def test_a_slow_link_keeps_whole_sequences_where_they_are(group):
    """comm_ratio reaches the planner. Every rank holds 256 tokens: rank 0 one sequence, the
    others four short ones, so rank 0 has 2.5x their causal work. Compute-first planning moves
    some of it away; with a link so slow that any byte outweighs the imbalance, every block
    stays with the rank that holds it and dispatch moves nothing."""
    comm, rank, ranks = group
    lengths = [256] + [64] * (4 * (ranks - 1))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    begin, end = 256 * rank, 256 * (rank + 1)
    index = torch.arange(begin, end, dtype=torch.int64)
    options = dict(heads=2, kv_heads=1, head_dim=16, layout="dispatched", block_size=64)
    balanced = ft.Batch(cu, (begin, end), comm, **options).dispatch(index)  # collective
    if rank == 0 and ranks > 1:
        assert not torch.equal(balanced, index)
    slow = ft.Batch(cu, (begin, end), comm, comm_ratio=1e5, **options)
    assert slow.num_local_tokens == end - begin
    assert torch.equal(slow.dispatch(index), index)
    with pytest.raises(fcp.Error, match="invalid communication ratio -1"):
        ft.Batch(cu, (begin, end), comm, comm_ratio=-1, **options)


def test_a_pending_batch_plans_while_the_step_before_runs(group):
    """PendingBatch plans the next batch while this one's attention and backward run over the
    same group; batch() is then the Batch that Batch(...) makes (same layout of rows, same
    outputs) and matches the reference. A pending batch gives one batch only."""
    comm, rank, ranks = group
    g = torch.Generator().manual_seed(7)
    batches = []
    for seed in (1, 2):
        lengths = torch.randint(1, 300, (5,), generator=g).tolist()
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        starts = split(cu[-1], ranks, seed)
        batches.append((cu, starts[rank], starts[rank + 1]))
    options = dict(heads=4, kv_heads=2, head_dim=16, layout="dispatched", block_size=64)

    def step(batch, cu, begin, end):
        whole = {n: torch.randn(cu[-1], h, 16, generator=torch.Generator().manual_seed(cu[-1])).double()
                 for n, h in (("q", 4), ("k", 2), ("v", 2))}
        mine = {n: t[begin:end].float().clone().requires_grad_() for n, t in whole.items()}
        q, k, v = (batch.dispatch(mine[n]) for n in ("q", "k", "v"))
        o = batch.undispatch(ft.attention(q, k, v, batch))
        o.sum().backward()
        ref_in = {n: t.clone().requires_grad_() for n, t in whole.items()}
        ref = reference(ref_in["q"], ref_in["k"], ref_in["v"], cu, True)
        ref.sum().backward()
        if end > begin:
            assert rel(o, ref[begin:end]) <= 1e-5
            for n in ("q", "k", "v"):
                assert rel(mine[n].grad, ref_in[n].grad[begin:end]) <= 1e-5, n
        return batch.dispatch(torch.arange(begin, end, dtype=torch.int64))

    (cu0, b0, e0), (cu1, b1, e1) = batches
    current = ft.Batch(cu0, (b0, e0), comm, **options)
    pending = ft.PendingBatch(cu1, (b1, e1), comm, **options)
    step(current, cu0, b0, e0)
    planned = pending.batch()
    assert not pending.ready
    direct = ft.Batch(cu1, (b1, e1), comm, **options)
    assert planned.num_local_tokens == direct.num_local_tokens
    assert torch.equal(planned.sequence, direct.sequence) and torch.equal(planned.position, direct.position)
    assert torch.equal(step(planned, cu1, b1, e1), direct.dispatch(torch.arange(b1, e1, dtype=torch.int64)))
    with pytest.raises(fcp.Error, match="already used"):
        pending.batch()


def test_dropping_an_unused_pending_batch_lets_other_threads_run(group):
    """A PendingBatch dropped unused waits for its planning to end (here a few hundred
    milliseconds: one sequence of 256K tokens in 256-token blocks, half a million block pairs;
    seconds for long-tailed batches at thousands of workers) with the GIL released: another
    Python thread runs meanwhile. Holding it, that thread could not run at all during the drop."""
    comm, rank, ranks = group
    total = 1 << 18
    starts = split(total, ranks, 1)
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    pending = ft.PendingBatch([0, total], (starts[rank], starts[rank + 1]), comm, heads=1, kv_heads=1,
                              head_dim=16, block_size=256)
    thread = threading.Thread(target=tick)
    thread.start()
    try:
        assert not pending.ready, "planned before the drop: the batch is too small to show anything"
        begin = time.monotonic()
        del pending
        end = time.monotonic()
    finally:
        stop.set()
        thread.join()
    during = sum(1 for t in ticks if begin < t < end)
    # Holding the GIL, at most a tick or two from a thread switch just before the drop began.
    assert during >= 10, f"the other thread ran {during} times in the {end - begin:.3f} s drop"


def test_one_ranks_planning_failure_stops_every_rank(group, monkeypatch):
    """Planning that fails on one rank only (FCP_PLAN_THREADS=3 in the last rank's environment,
    which only its planner reads) raises on every rank, in Batch and in PendingBatch.batch(): the
    last rank its own error, the others one naming it. The ranks stay in step: a batch after it
    plans and runs."""
    comm, rank, ranks = group
    cu = [0, 100, 160]
    starts = split(160, ranks, 3)
    mine = (starts[rank], starts[rank + 1])
    options = dict(heads=2, kv_heads=1, head_dim=16, block_size=64)
    last = ranks - 1
    expected = ("invalid FCP_PLAN_THREADS '3'" if rank == last else
                "rank %d: rank %d could not plan this batch \\(its error there, of kind 'invalid argument'" % (rank, last))
    for ahead in (False, True):
        if rank == last:
            monkeypatch.setenv("FCP_PLAN_THREADS", "3")
        with pytest.raises(fcp.Error, match=expected):
            if ahead:
                ft.PendingBatch(cu, mine, comm, **options).batch()
            else:
                ft.Batch(cu, mine, comm, **options)
        monkeypatch.delenv("FCP_PLAN_THREADS", raising=False)
    batch = ft.Batch(cu, mine, comm, **options)
    n = batch.num_call_tokens
    q = torch.randn(n, 2, 16, generator=torch.Generator().manual_seed(rank))
    assert ft.attention(q, q[:, :1].clone(), q[:, :1].clone(), batch).shape == (n, 2, 16)


def test_a_call_that_raised_on_one_rank_only_fails_the_next_batch_on_every_rank(group):
    """The last rank holds none of the caller's tokens, so the others' dispatch only sends to it
    and may return; the last rank's dispatch raises in its own checks. The next batch on that
    group raises on every rank (that dispatch's messages may still arrive there), rather than
    let the last rank's next dispatch take them. On a communicator of its own, which it leaves
    unusable. MPI only: there a small send completes before its receive is posted; gloo's sends
    wait for their receives, so the other ranks time out instead."""
    if not USE_MPI:
        pytest.skip("gloo's sends wait for their receives")
    comm, rank, ranks = group
    own = comm.Dup()
    cu = [0, 100, 160]
    starts = [0] + [160 * (r + 1) // (ranks - 1) for r in range(ranks - 1)] + [160]
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=32, layout="dispatched")
    batch = ft.Batch(cu, (starts[rank], starts[rank + 1]), own, timeout_seconds=5, **options)
    u = batch.num_user_tokens
    if rank == ranks - 1:
        assert u == 0
        with pytest.raises(fcp.Error, match=r"^dispatch input has shape \(1, 1\)"):
            batch.dispatch(torch.randn(1, 1))
    else:  # a float per token: messages of at most a block's 128 bytes, sent eagerly
        batch.dispatch(torch.randn(u, 1))
    for attempt in range(2):
        # A transport error: what a loop that makes a new communicator on failure catches.
        with pytest.raises(fcp.TransportError, match="a call of an earlier batch over this transport threw on some "
                                                     "ranks but not all, so messages of that call may still arrive"):
            ft.Batch(cu, (starts[rank], starts[rank + 1]), own, timeout_seconds=5, **options)
    own.Free()


def test_ranks_dispatching_rows_of_another_dtype_time_out_rather_than_mix(group):
    """Each rank dispatches rows of another kind, 16 bytes each (4 float32s, 2 float64s, 2 x 2
    float32s), so no transport could tell by sizes. The rows' dtype and shape key the call's
    tags, so every rank, each of which receives (ring's layout moves tokens to every rank),
    times out with a transport error. Before, the rows were taken as each rank's own (and through a process
    group, rows of another size were too, or gloo aborted the process: a review). On a group of
    its own, which the timeout leaves unusable."""
    comm, rank, ranks = group
    own = comm.Dup() if USE_MPI else dist.new_group(list(range(ranks)))
    cu = [0, 160]
    starts = [160 * r // ranks for r in range(ranks + 1)]
    batch = ft.Batch(cu, (starts[rank], starts[rank + 1]), own, heads=4, kv_heads=2, head_dim=16, block_size=32,
                     layout="dispatched", strategy="ring", timeout_seconds=3)
    u = batch.num_user_tokens
    x = [torch.randn(u, 4), torch.randn(u, 2, dtype=torch.float64), torch.randn(u, 2, 2)][rank % 3]
    with pytest.raises(fcp.TransportError, match="dispatch rows of another shape or dtype"):
        batch.dispatch(x)
    if USE_MPI:
        own.Free()


def test_an_error_before_the_call_reaches_fcp_fails_the_batch(group, monkeypatch):
    """An error in what a call makes before FCP's collective (here torch.empty raising
    MemoryError, on every rank) fails the batch as a check does: the error is raised as it was,
    the batch names it and refuses the next call, and (every rank having failed the same call
    before any message) the next batch on the group goes on."""
    comm, rank, ranks = group
    cu = [0, 100, 160]
    starts = split(160, ranks, 3)
    mine = (starts[rank], starts[rank + 1])
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=32, layout="dispatched")
    batch = ft.Batch(cu, mine, comm, **options)
    x = torch.randn(batch.num_user_tokens, 4, 16)
    real = torch.empty

    def no_room(*args, **kwargs):
        raise MemoryError("no room")
    monkeypatch.setattr(torch, "empty", no_room)
    with pytest.raises(MemoryError, match="no room"):
        batch.dispatch(x)
    monkeypatch.setattr(torch, "empty", real)
    assert batch.failure == "MemoryError before the call reached FCP: no room", batch.failure
    with pytest.raises(fcp.Error, match=f"^rank {rank}: this batch refuses dispatch"):
        batch.dispatch(x)
    again = ft.Batch(cu, mine, comm, **options)
    assert torch.equal(again.undispatch(again.dispatch(x)), x)


def test_a_batch_refuses_calls_after_one_raised(group):
    """A call that raises (here on every rank: the same mistake everywhere, so no rank is left
    inside it) makes the batch refuse every later call, naming the first error; a new batch on
    the same group works. The failure-free batch says None."""
    comm, rank, ranks = group
    cu = [0, 100, 160, 300]
    starts = split(300, ranks, 5)
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=64, layout="dispatched")
    batch = ft.Batch(cu, (starts[rank], starts[rank + 1]), comm, **options)
    assert batch.failure is None
    n, u = batch.num_call_tokens, batch.num_user_tokens
    good = [torch.randn(n, h, 16) for h in (4, 2, 2)]
    with pytest.raises(fcp.Error, match=r"^q is \(%d, 4, 16\)" % (n + 1)):
        ft.attention(torch.randn(n + 1, 4, 16), good[1], good[2], batch)
    assert batch.failure.startswith("q is (%d, 4, 16)" % (n + 1))
    refused = (r"^rank %d: this batch refuses %s: expected a new batch, since call #\d+ over this transport \(this "
               r"batch's\) threw on this rank in its checks \(if it did so on every rank, the transport goes on; .*\); "
               r"this batch's first error: q is \(%d, 4, 16\)")
    with pytest.raises(fcp.Error, match=refused % (rank, "forward", n + 1)):
        ft.attention(*good, batch)
    with pytest.raises(fcp.Error, match=refused % (rank, "dispatch", n + 1)):
        batch.dispatch(torch.zeros(u, 3))
    with pytest.raises(fcp.Error, match=refused % (rank, "undispatch", n + 1)):
        batch.undispatch(torch.zeros(n, 3))
    # A dispatch input of the wrong shape is a failure of its own.
    other = ft.Batch(cu, (starts[rank], starts[rank + 1]), comm, **options)
    with pytest.raises(fcp.Error, match=r"^dispatch input has shape \(%d, 3\)" % (u + 1)):
        other.dispatch(torch.zeros(u + 1, 3))
    assert other.failure.startswith("dispatch input")
    # Inputs that are not dense tensors are failures too (not a Python error that leaves the
    # batch usable, whose next call another rank could take for this one).
    import numpy as np
    for call, message in [(lambda b: ft.attention(good[0].numpy(), good[1], good[2], b),
                           r"^q is a ndarray of shape \(%d, 4, 16\): expected \(%d, 4, 16\) torch.float32, a dense "
                           r"torch.Tensor on the CPU" % (n, n)),
                          (lambda b: ft.attention(good[0], good[1].to_sparse(), good[2], b),
                           r"^k is a torch.sparse_coo tensor: expected \(%d, 2, 16\)" % n),
                          (lambda b: b.dispatch(np.zeros((u, 3))),
                           r"^dispatch input is a ndarray of shape \(%d, 3\): expected %d rows, a dense" % (u, u)),
                          (lambda b: b.undispatch([1, 2]), r"^undispatch input is \[1, 2\]: expected %d rows" % n)]:
        other = ft.Batch(cu, (starts[rank], starts[rank + 1]), comm, **options)
        with pytest.raises(fcp.Error, match=message):
            call(other)
        assert other.failure is not None
        with pytest.raises(fcp.Error, match="this batch refuses forward"):
            ft.attention(*good, other)
    fresh = ft.Batch(cu, (starts[rank], starts[rank + 1]), comm, **options)
    assert ft.attention(*good, fresh).shape == (n, 4, 16) and fresh.failure is None


def test_gradients_go_through_o_only_once(group):
    """lse comes back without a gradient path: a gradient reaching it raises rather than being
    dropped, and lse used detached is fine (the gradients are o's, against the reference). A
    second backward of one forward, and a backward of the backward, raise."""
    comm, rank, ranks = group
    cu = [0, 100, 160, 300]
    starts = split(300, ranks, 4)
    begin, end = starts[rank], starts[rank + 1]
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=64)
    whole = [torch.randn(300, h, 16, generator=torch.Generator().manual_seed(h)).double() for h in (4, 2, 2)]

    def mine():
        return [t[begin:end].float().clone().requires_grad_() for t in whole]

    batch = ft.Batch(cu, (begin, end), comm, **options)
    q, k, v = mine()
    o, lse = ft.attention(q, k, v, batch, return_lse=True)
    with pytest.raises(fcp.Error, match="a gradient reached the lse that attention returned"):
        (o.sum() + lse.sum()).backward()
    batch = ft.Batch(cu, (begin, end), comm, **options)
    q, k, v = mine()
    o, lse = ft.attention(q, k, v, batch, return_lse=True)
    (o.sum() + 0 * lse.detach().sum()).backward()
    ref_in = [t.clone().requires_grad_() for t in whole]
    reference(*ref_in, cu, True).sum().backward()
    if end > begin:
        for mine_t, ref_t in zip((q, k, v), ref_in):
            assert rel(mine_t.grad, ref_t.grad[begin:end]) <= 1e-5
    batch = ft.Batch(cu, (begin, end), comm, **options)
    q, k, v = mine()
    o = ft.attention(q, k, v, batch)
    o.sum().backward(retain_graph=True)
    with pytest.raises(fcp.Error, match="backward ran twice for one forward"):
        o.sum().backward()
    batch = ft.Batch(cu, (begin, end), comm, **options)
    q, k, v = mine()
    # (o ** 2).sum(): the gradient reaching backward requires grad itself, as in a double backward.
    (gq,) = torch.autograd.grad((ft.attention(q, k, v, batch) ** 2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.sum().backward()


def test_arguments_are_integers_and_positions_are_the_layouts(group):
    comm, rank, ranks = group
    cu = [0, 100, 160, 300]
    starts = split(300, ranks, 6)
    mine = (starts[rank], starts[rank + 1])
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=64)
    for bad, message in [(dict(cu_seqlens=[0, 100.7, 160, 300]), r"cu_seqlens\[1\] is 100.7: expected an integer"),
                         (dict(heads=4.9), "heads is 4.9: expected an integer"),
                         (dict(block_size="64"), "block_size is '64': expected an integer"),
                         (dict(heads=torch.tensor([4, 4])), r"heads is a Tensor of shape \(2,\): expected an integer"),
                         (dict(threads=2 ** 40), "thread count 1099511627776: expected 1 to 256"),
                         (dict(causal="no"), "causal is 'no': expected True or False")]:
        arguments = dict(options, cu_seqlens=cu)
        arguments.update(bad)
        with pytest.raises(fcp.Error, match=message):
            ft.Batch(arguments.pop("cu_seqlens"), mine, comm, **arguments)
    # Integer tensors and NumPy integers are integers.
    import numpy as np
    for as_given in (torch.tensor(cu, dtype=torch.int32), np.array(cu, dtype=np.int64), np.array(cu, dtype=np.uint32)):
        assert ft.Batch(as_given, mine, comm, **options).num_user_tokens == mine[1] - mine[0]
    with pytest.raises(fcp.Error, match=r"cu_seqlens\[0\] is tensor\(0.\): expected an integer"):  # a float tensor
        ft.Batch(torch.tensor([0, 100.5, 160, 300]), mine, comm, **options)
    # Not sequences, or values past int64: one line each, never a Python error (which would leave
    # the other ranks waiting in the batch's agreement).
    for given, range_, message in [(None, mine, "cu_seqlens is None: expected a sequence of integers"),
                                   (torch.tensor(5), mine, r"cu_seqlens is tensor\(5\): expected a sequence"),
                                   (np.array([[0, 100], [160, 300]]), mine,
                                    r"cu_seqlens is a ndarray of shape \(2, 2\): expected a sequence"),
                                   (np.array([0, 100, 2 ** 63], dtype=np.uint64), mine,
                                    r"cu_seqlens\[2\] is 9223372036854775808: expected -9223372036854775808 to"),
                                   (cu, None, r"local_range is None: expected \(begin, end\)"),
                                   (np.ma.masked_array(cu, mask=[0, 1, 0, 0]), mine,
                                    r"cu_seqlens\[1\] is masked: expected an integer"),
                                   ({0: 0, 1: 300}, mine, r"cu_seqlens is \{0: 0, 1: 300\}: expected a sequence"),
                                   (cu, {0: mine[0], 1: mine[1]}, r"local_range is \{0: .*\}: expected \(begin, end\)"),
                                   (cu, 7, r"local_range is 7: expected \(begin, end\)")]:
        with pytest.raises(fcp.Error, match=message):
            ft.Batch(given, range_, comm, **options)
    with pytest.raises(fcp.Error, match="timeout_seconds True: expected a number"):
        ft.Batch(cu, mine, comm, timeout_seconds=True, **options)
    with pytest.raises(fcp.Error, match=r"tokens \[250, 320\): expected 0 <= begin <= end <= 300"):
        ft.user_positions(cu, 250, 320)
    with pytest.raises(fcp.Error, match=r"tokens \[-3, 2\)"):
        ft.user_positions(cu, -3, 2)
    with pytest.raises(fcp.Error, match=r"cu_seqlens starts \[10\]: expected \[0, ...\]"):
        ft.user_positions([10, 20], 0, 5)
    with pytest.raises(fcp.Error, match=r"cu_seqlens\[2\] is 90: expected at least cu_seqlens\[1\] = 100"):
        ft.user_positions([0, 100, 90, 160], 0, 5)
    with pytest.raises(fcp.Error, match=r"cu_seqlens\[2\] is masked: expected an integer"):
        ft.user_positions(np.ma.masked_array(cu, mask=[0, 0, 1, 0]), 0, 5)
    assert ft.user_positions(np.ma.masked_array(cu), 95, 105).tolist() == [95, 96, 97, 98, 99, 0, 1, 2, 3, 4]
    assert ft.user_positions(cu, 95, 105).tolist() == [95, 96, 97, 98, 99, 0, 1, 2, 3, 4]
    transparent = ft.Batch(cu, mine, comm, **options)
    for name in ("position", "sequence"):
        with pytest.raises(fcp.Error, match=f"batch.{name} describes the rows of FCP's layout"):
            getattr(transparent, name)
    # Each read is the caller's own tensor: changing it in place (a RoPE offset) changes no later read.
    dispatched = ft.Batch(cu, mine, comm, layout="dispatched", **options)
    for name in ("position", "sequence"):
        first = getattr(dispatched, name)
        kept = first.clone()
        first += 1000
        assert torch.equal(getattr(dispatched, name), kept)


def test_a_groups_transport_takes_each_batchs_timeout(group):
    """A later batch's timeout_seconds reaches the group's transport (a torch.distributed group);
    an mpi4py communicator's transport keeps its own, and another is refused in one line."""
    comm, rank, ranks = group
    cu = [0, 100, 160, 300]
    starts = split(300, ranks, 7)
    mine = (starts[rank], starts[rank + 1])
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=64)
    if USE_MPI:
        ft.Batch(cu, mine, comm, **options)
        with pytest.raises(fcp.Error, match=r"timeout_seconds 123: expected 300.0, the timeout this communicator"):
            ft.Batch(cu, mine, comm, timeout_seconds=123, **options)
        # On one rank only: refused through the batch's agreement, so every rank raises.
        last = ranks - 1
        with pytest.raises(fcp.Error, match=r"timeout_seconds 123: expected 300.0" if rank == last else
                           r"rank %d: rank %d's arguments were refused there" % (rank, last)):
            ft.Batch(cu, mine, comm, **(dict(options, timeout_seconds=123) if rank == last else options))
        assert ft.Batch(cu, mine, comm, **options).num_user_tokens == mine[1] - mine[0]
        return
    ft.Batch(cu, mine, comm, timeout_seconds=123, **options)
    keep = ft._transports["default"][2]  # the default group's (other tests make groups of their own)
    assert keep.timeout.total_seconds() == 123
    ft.Batch(cu, mine, comm, timeout_seconds=45, **options)
    assert keep.timeout.total_seconds() == 45
    ft.Batch(cu, mine, comm, **options)
    assert keep.timeout.total_seconds() == 300


def test_one_ranks_bad_argument_fails_every_rank(group):
    """An argument fcp.torch refuses on one rank only (heads=4.9, dtype float16) raises on every
    rank, in Batch and PendingBatch, within seconds (not at the timeout): that rank its own
    error, the others one naming it. A good batch follows on the same group."""
    comm, rank, ranks = group
    cu = [0, 100, 160, 300]
    starts = split(300, ranks, 8)
    mine = (starts[rank], starts[rank + 1])
    options = dict(heads=4, kv_heads=2, head_dim=16, block_size=64)
    last = ranks - 1
    for bad, own in ((dict(heads=4.9), "heads is 4.9: expected an integer"),
                     (dict(dtype=torch.float16), "dtype torch.float16 is not supported")):
        for make in (ft.Batch, lambda *a, **k: ft.PendingBatch(*a, **k).batch()):
            arguments = dict(options, **bad) if rank == last else options
            expected = own if rank == last else (
                r"rank %d: rank %d's arguments were refused there \(its own error says why\)" % (rank, last))
            start = time.perf_counter()
            with pytest.raises(fcp.Error, match=expected):
                make(cu, mine, comm, **arguments)
            assert time.perf_counter() - start < 30
    # An argument that is not even the right kind (local_range None) goes the same way.
    start = time.perf_counter()
    with pytest.raises(fcp.Error, match=r"local_range is None: expected \(begin, end\)" if rank == last else
                       r"rank %d: rank %d's arguments were refused there" % (rank, last)):
        ft.Batch(cu, None if rank == last else mine, comm, **options)
    assert time.perf_counter() - start < 30
    assert ft.Batch(cu, mine, comm, **options).num_user_tokens == mine[1] - mine[0]


ULYSSES_CASES = [
    # (seed, dtype, causal, heads, kv_heads, head_dim, one node of every rank): key/value heads
    # split, and replicated
    (0, torch.float32, True, 4, 2, 16, False),
    (1, torch.float32, False, 4, 1, 16, False),
    (2, torch.bfloat16, True, 8, 2, 8, False),
    (3, torch.bfloat16, True, 2, 2, 5, False),  # bf16 o of odd rows x head_dim 5: the lse after it is unaligned
    (5, torch.float32, True, 4, 2, 16, True),  # 4 ranks: each key/value head on 2 members
]


@pytest.mark.skipif(USE_MPI, reason="ulysses_group is a torch.distributed process group")
@pytest.mark.parametrize("seed,dtype,causal,heads,kv_heads,dim,one_node", ULYSSES_CASES)
def test_ulysses_inside_nodes_and_fcp_across_them(group, seed, dtype, causal, heads, kv_heads, dim, one_node):
    """FCP as its paper deploys it on rail-optimised clusters (fcp simulate's fcp+ulysses): nodes
    of 2 ranks (or one node of every rank) exchange rows for heads, FCP runs across the nodes on
    each member's share. Every rank passes its own rows with every head (uneven, one of them
    empty for even seeds); outputs, lse and q, k, v gradients against the float64 reference of
    the whole batch."""
    comm, rank, ranks = group
    if one_node and heads % ranks:
        pytest.skip(f"{ranks} ranks do not split {heads} heads")
    degree = ranks if one_node else 2 if ranks % 2 == 0 else 1
    across, inside = ft.ulysses_groups(degree)
    g = torch.Generator().manual_seed(300 + seed)
    cu = [0]
    for n in torch.randint(1, 200, (7,), generator=g).tolist():
        cu.append(cu[-1] + n)
    starts = split(cu[-1], ranks, seed)
    whole = {name: torch.randn(cu[-1], h, dim, generator=g).to(dtype).double()
             for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads), ("do", heads))}
    batch = ft.Batch(cu, (starts[rank], starts[rank + 1]), across, heads=heads, kv_heads=kv_heads, head_dim=dim,
                     causal=causal, dtype=dtype, block_size=64, ulysses_group=inside)
    assert batch.num_call_tokens == batch.num_user_tokens == starts[rank + 1] - starts[rank]
    expect_reference(batch, whole, cu, causal)
    # lse: this rank's rows, every head, as the reference's log-sum-exp.
    begin, end = starts[rank], starts[rank + 1]
    mine = {n: whole[n][begin:end].to(dtype) for n in ("q", "k", "v")}
    o, lse = ft.attention(mine["q"], mine["k"], mine["v"], batch, return_lse=True)
    assert lse.shape == (end - begin, heads) and lse.dtype == torch.float32
    if end > begin:
        groups = heads // kv_heads
        k = whole["k"].repeat_interleave(groups, dim=1)
        expected = torch.empty(end - begin, heads, dtype=torch.float64)
        for t in range(begin, end):
            s = max(i for i in range(len(cu) - 1) if cu[i] <= t)
            last = t + 1 if causal else cu[s + 1]
            scores = torch.einsum("hd,thd->ht", whole["q"][t], k[cu[s]:last]) * dim ** -0.5
            expected[t - begin] = scores.logsumexp(-1)
        assert (lse.double() - expected).abs().max() <= (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.skipif(USE_MPI, reason="ulysses_group is a torch.distributed process group")
def test_ulysses_groups_ranges_and_heads_are_checked_on_every_rank(group):
    """Members whose ranges do not tile one run, heads the node cannot split, or a dispatched
    layout: every rank raises, the node's members with the reason and the others through FCP's
    agreement."""
    comm, rank, ranks = group
    if ranks % 2:
        pytest.skip("needs nodes of 2 ranks")
    across, inside = ft.ulysses_groups(2)
    cu = [0, 100, 300, 100 * ranks + 200]
    starts = split(cu[-1], ranks, 1)
    mine = (starts[rank], starts[rank + 1])
    options = dict(heads=4, kv_heads=2, head_dim=8, block_size=64, ulysses_group=inside)
    swapped = rank // 2 * 2 + (1 - rank % 2)  # node 0's members hold each other's ranges
    with pytest.raises(fcp.InvalidArgument if rank < 2 else fcp.Error,
                       match=r"local ranges are \[\(" if rank < 2 else "refused"):
        ft.Batch(cu, (starts[swapped], starts[swapped + 1]) if rank < 2 else mine, across, **options)
    with pytest.raises(fcp.InvalidArgument, match=r"ulysses_group of 2 ranks with 3 query and 3 key/value heads"):
        ft.Batch(cu, mine, across, **dict(options, heads=3, kv_heads=3))
    with pytest.raises(fcp.InvalidArgument, match="layout 'dispatched' with ulysses_group: expected 'transparent'"):
        ft.Batch(cu, mine, across, **dict(options, layout="dispatched"))
    # Members that differ in what FCP's agreement compares (there, only ranks of one index meet)
    # are refused inside the node: silently wrong heads before.
    with pytest.raises(fcp.InvalidArgument, match=r"ulysses_group's members passed different settings \(mask\)"):
        ft.Batch(cu, mine, across, **dict(options, causal=rank % 2 == 0))
    if ranks == 4:  # two nodes
        # A setting that differs inside a node (rank 3's block size) is refused there, and the
        # other node hears of it through FCP's agreement.
        with pytest.raises(fcp.Error, match=r"members passed different settings \(block size" if rank >= 2 else
                           "refused"):
            ft.Batch(cu, mine, across, **dict(options, block_size=128 if rank == 3 else 64))
        # What only one index's agreement refuses (rank 2's thread count, a rank's own setting)
        # fails that index; the node's confirmation fails the other index too, instead of its
        # first exchange.
        for make in (ft.Batch, lambda *a, **k: ft.PendingBatch(*a, **k).batch()):
            start = time.perf_counter()
            with pytest.raises(fcp.Error, match="thread count" if rank % 2 == 0 else
                               r"member 0 of ulysses_group could not make the batch"):
                make(cu, mine, across, **dict(options, threads=0 if rank == 2 else 1))
            assert time.perf_counter() - start < 30
        # Nodes of 1 and 3 ranks whose index groups pair only in part: {0, 1} holds index 0 of
        # both nodes, which differ in degree, while {2} and {3} pass (rank 0 holds no rows, so
        # each of them plans the whole stream). Ranks 0 and 1 are refused in the pairing check;
        # ranks 2 and 3 hear it in the node's confirmation (they waited there until the timeout
        # before: rank 1 skipped it).
        nodes = [dist.new_group([0]), dist.new_group([1, 2, 3])]
        indices = [dist.new_group([0, 1]), dist.new_group([2]), dist.new_group([3])]
        uneven = dict(options, heads=6, kv_heads=3, ulysses_group=nodes[0] if rank == 0 else nodes[1],
                      timeout_seconds=20)
        for make in (ft.Batch, lambda *a, **k: ft.PendingBatch(*a, **k).batch()):
            start = time.perf_counter()
            with pytest.raises(fcp.InvalidArgument, match=r"this rank's index \(0\) in every node of %d" % (1 if rank == 0 else 3)
                               if rank < 2 else r"member 0 of ulysses_group could not make the batch"):
                make(cu, ([0, 0, 200, 400, cu[-1]][rank], [0, 0, 200, 400, cu[-1]][rank + 1]),
                     indices[0] if rank < 2 else indices[rank - 1], **uneven)
            assert time.perf_counter() - start < 15
        # Index groups that do not pair with the nodes (rank 0 with rank 3's index) would read
        # another node's heads: refused on every rank.
        crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
        wrong = crossed[0] if rank in (0, 3) else crossed[1]
        with pytest.raises(fcp.InvalidArgument, match=r"expected a torch.distributed group of the ranks with "
                                                      r"this rank's index \(%d\) in every node of 2" % (rank % 2)):
            ft.Batch(cu, mine, wrong, **options)
    batch = ft.Batch(cu, mine, across, **options)
    n = mine[1] - mine[0]
    with pytest.raises(fcp.InvalidArgument, match="batch.dispatch with ulysses_group"):
        batch.dispatch(torch.zeros(n, 4, 8))
    with pytest.raises(fcp.InvalidArgument, match="batch.num_local_tokens with ulysses_group"):
        batch.num_local_tokens
    with pytest.raises(fcp.InvalidArgument, match=r"q is \(%d, 2, 8\).*expected \(%d, 4, 8\)" % (n, n)):
        ft.attention(torch.zeros(n, 2, 8), torch.zeros(n, 2, 8), torch.zeros(n, 2, 8), batch)
    # Every rank raised in its checks: the next call refuses at once, before any exchange.
    start = time.perf_counter()
    with pytest.raises(fcp.InvalidArgument, match="this batch refuses attention: a call on it raised on this rank"):
        ft.attention(torch.zeros(n, 4, 8), torch.zeros(n, 2, 8), torch.zeros(n, 2, 8), batch)
    assert time.perf_counter() - start < 5
    with pytest.raises(fcp.InvalidArgument,
                       match="Ulysses degree %d over %d ranks: expected a positive divisor of the ranks" % (ranks + 1, ranks)):
        ft.ulysses_groups(ranks + 1)
