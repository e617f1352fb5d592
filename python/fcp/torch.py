"""FCP attention for PyTorch.

Once per step, ``Batch(cu_seqlens, (begin, end), group, heads=..., kv_heads=..., head_dim=...)``
plans the batch on every rank of ``group`` (a ``torch.distributed`` process group, ``None`` for
the default group — or one process without context parallelism when torch.distributed is not
initialised —, or an mpi4py communicator) from the whole batch's ``cu_seqlens`` and this
rank's token range ``[begin, end)`` of the packed stream (any split: uneven, mid-sequence,
empty). cu_seqlens may hold empty sequences (a repeated offset, as FlashAttention's varlen
padding has); ``batch.sequence`` numbers sequences as cu_seqlens does. Then, per layer,
``attention(q, k, v, batch)`` returns ``o`` with gradients for q, k and v. Tensors are
``[tokens, heads, head_dim]`` on the CPU, float32 or bfloat16.

Two layouts. ``layout="transparent"``: q, k, v, o have this rank's rows of the caller's layout
(``end - begin`` of them); each call moves tokens to FCP's layout and back. ``layout=
"dispatched"``: the caller moves its per-token tensors once with ``batch.dispatch(x)`` (and back
with ``batch.undispatch(x)``, both differentiable), uses ``batch.position`` and
``batch.sequence`` for RoPE and the loss, and attention calls move no tokens.

``comm_ratio`` tells FCP's planner how slow the link is: the cost units (forward FLOPs at
the kernel's peak) that one byte sent or received is worth, about peak FLOP/s / link bytes/s /
3.5 (GPU-X: 5920 FLOP per byte, about 1700). With it, where the paper's placement is bound by
its bytes, the planner keeps whichever placement has the least estimated step time, and may
leave short sequences where they are; 0 (the default) balances compute first. Every rank must
pass the same value.

Ulysses inside a node, FCP across nodes (the FCP paper's deployment on rail-optimised clusters;
``fcp simulate --strategy fcp+ulysses``): ``group, inside = ulysses_groups(degree)``, then
``Batch(..., group=group, ulysses_group=inside)`` with this rank's own ``local_range`` (the
members' ranges, in member order, tile one run of the stream) and the model's ``heads`` and
``kv_heads``. ``attention`` then takes this rank's rows with every head, exchanges them for the
node's rows of one member's share of the heads (one all-to-all; key/value heads replicated
where the members outnumber them), runs FCP across the nodes on that share, and exchanges
back. Transparent layout only.

Planning ahead. ``PendingBatch(...)`` takes Batch's arguments and plans on a thread of its own
while the caller goes on with the current step; ``pending.batch()`` then waits for the plan and
returns the Batch. Planning a large batch and checking its plan take long (at 4096 ranks, half
a second to two seconds): planned one step ahead, a training step need not wait for them.
Make the PendingBatch on the training thread, at the same point on every rank: it is collective.

Every call is collective over the group: every rank calls it, in the same order. Planning fails
on every rank or on none: where one rank's planning raises (its own environment, memory), the
others raise ``fcp.Error`` naming it at the same point, so a loop may skip the batch and go on.

Errors: every one is an ``fcp.Error`` (a ``RuntimeError``) with a one-line message; bad input is
an ``fcp.InvalidArgument`` (a ``ValueError`` too), failed or timed-out communication an
``fcp.TransportError``.
"""
from __future__ import annotations

import ctypes
import datetime
import math
import numbers
import operator
import time
import weakref
import zlib
from collections.abc import Mapping
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _fcp

__all__ = ["Batch", "PendingBatch", "attention", "ulysses_groups", "user_positions"]

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_FP32_TINY, _FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
# Integer tensor types whose every value is an int64 (torch.uint64, from torch 2.3, is checked
# per value; uint16 and uint32 exist from 2.3 too).
_FITS_INT64 = tuple(getattr(torch, name) for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
                    if hasattr(torch, name))


def _describe(x) -> str:
    """A value for a one-line message: its repr when short and on one line, else its type (and
    shape)."""
    shape = getattr(x, "shape", None)
    if shape is not None and len(shape) > 0:
        return f"a {type(x).__name__} of shape {tuple(shape)}"
    text = repr(x)
    return text if len(text) <= 60 and "\n" not in text else f"a {type(x).__name__}"


def _integers(name: str, xs) -> list:
    """xs (a sequence, an integer tensor or NumPy array) as a list of ints, else fcp.Error naming
    the first value that is not one. A tensor or array of an integer dtype converts at once."""
    if isinstance(xs, torch.Tensor) and xs.dim() == 1 and xs.dtype in _FITS_INT64:
        return xs.tolist()
    kind = getattr(getattr(xs, "dtype", None), "kind", None)  # a NumPy array's: 'i', 'u', 'f', ...
    # A masked array's masked values are no integers: it takes the per-value path below.
    if getattr(xs, "ndim", 0) == 1 and not hasattr(xs, "mask") and (kind == "i" or (kind == "u" and (
            xs.dtype.itemsize < 8 or xs.size == 0 or int(xs.max()) < 2 ** 63))):
        return [int(x) for x in xs.tolist()]
    try:
        if getattr(xs, "ndim", 1) != 1 or isinstance(xs, (str, bytes, Mapping)):
            raise TypeError
        items = list(xs)  # a 0-d tensor or array raises TypeError here
    except TypeError:
        raise _fcp.InvalidArgument(f"{name} is {_describe(xs)}: expected a sequence of integers") from None
    return [_integer(f"{name}[{i}]", x) for i, x in enumerate(items)]


def _integer(name: str, x) -> int:
    """x as an int when it is one (a Python, NumPy or 0-d integer tensor value) that fits in 64
    bits, else fcp.Error."""
    is_bool = isinstance(x, bool) or type(x).__name__ == "bool_" or (
        isinstance(x, torch.Tensor) and x.dtype == torch.bool)
    try:
        value = None if is_bool else operator.index(x)
    except TypeError:
        value = None
    if value is None:
        raise _fcp.InvalidArgument(f"{name} is {_describe(x)}: expected an integer")
    if not -2 ** 63 <= value < 2 ** 63:
        raise _fcp.InvalidArgument(f"{name} is {value}: expected {-2 ** 63} to {2 ** 63 - 1}")
    return value


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over memory FCP owns (no copy; FCP keeps it alive until the request ends)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def _not_a_member():
    return _fcp.InvalidArgument(f"this process (global rank {dist.get_rank()}) is not a member of the process group "
                                f"passed as group: expected a group this rank belongs to")


class _GroupTransport:
    """FCP's transport over a torch.distributed process group (gloo: FCP takes CPU tensors only).
    Messages it withdrew do not stop its all-reduces (gloo's point-to-point slots and its
    collectives' never meet), which a batch's agreement relies on; on NCCL they would."""

    _OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

    def __init__(self, group, timeout_seconds: float):
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_seconds)
        rank = dist.get_rank(group)
        if rank < 0:  # torch's answer for a rank outside the group, whose size is then -1 too
            raise _not_a_member()
        size = dist.get_world_size(group)
        if group is None or group == dist.group.WORLD:
            self.peers = list(range(size))
        else:
            get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
            self.peers = [get(group, r) for r in range(size)]
        self._rank, self._size = rank, size

    def make_impl(self):
        """The C++ transport over this object's methods. It holds them (and so this object); this
        object does not hold it, so dropping the transport frees both."""
        return _fcp.callback_transport(self._rank, self._size, self._isend, self._irecv, self._test, self._wait,
                                       self._allreduce, self.timeout.total_seconds())

    def _isend(self, peer, tag, address, nbytes):
        return dist.isend(_bytes_at(address, nbytes), dst=self.peers[peer], group=self.group, tag=tag)

    def _irecv(self, peer, tag, address, nbytes):
        return dist.irecv(_bytes_at(address, nbytes), src=self.peers[peer], group=self.group, tag=tag)

    @staticmethod
    def _test(work) -> bool:
        return work.is_completed()

    def _wait(self, work, timeout_seconds):
        # The batch's timeout, which a later batch may have changed (not the one the C++ transport
        # was made with); the transport adds which message it was.
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise _fcp.TransportError(f"{e} (timeout_seconds = {self.timeout.total_seconds():g})") from None

    def _allreduce(self, values, op, timeout_seconds=0.0):
        # Bounded by the batch's timeout like the messages, not by the process group's own; or by
        # FCP's, when longer (the agreement after a failed call waits for ranks still inside it).
        timeout = max(self.timeout, datetime.timedelta(seconds=timeout_seconds))
        t = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(t, op=self._OPS[op], group=self.group, async_op=True)
        try:
            work.wait(timeout)
        except RuntimeError as e:  # gloo says only "Operation timed out!"
            seconds = timeout.total_seconds()
            raise _fcp.TransportError(f"the batch's agreement did not hear from every rank of the process group "
                                      f"(timeout_seconds = {seconds:g}): {e} (did a rank fail before the batch, "
                                      f"or not make it? or did an earlier call time out: gloo then closes the "
                                      f"group's connections, and only a new process group goes on)") from None
        return t.tolist()


_transports = {}


def _transport(group, timeout_seconds: float):
    """(transport, error): one FCP transport per group or communicator, made on first use (an MPI
    one duplicates the communicator, which is collective and not free), and what this rank must
    refuse through the batch's agreement ("" when nothing). A group's transport takes each new
    batch's timeout; an mpi4py communicator's keeps the one it was made with, and another is that
    error. One that gave up on its messages after an error (torch.distributed cannot
    cancel them) refuses further use until the caller makes a new process group: with the
    default group (group None), a new default group gets a new transport and the old one is
    dropped."""
    if group is not None and group is getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None):
        # What dist.new_group returns on a rank it leaves out.
        raise _not_a_member()
    if group is not None and not hasattr(group, "py2f") and not isinstance(group, dist.ProcessGroup):
        raise _fcp.InvalidArgument(f"group is {_describe(group)}: expected None (the default process group), a "
                                   f"torch.distributed process group or an mpi4py communicator")
    if hasattr(group, "py2f"):  # an mpi4py communicator
        cached = _transports.get(id(group))
        if cached is not None and cached[0] is group:
            if cached[3] != timeout_seconds:
                # Refused through the batch's agreement, on every rank alike, over the transport
                # the communicator has.
                return cached[1], (f"timeout_seconds {timeout_seconds!r}: expected {cached[3]!r}, the timeout this "
                                   f"communicator's FCP transport was made with (for another timeout, pass a "
                                   f"duplicate of the communicator: comm.Dup())")
            return cached[1], ""
        impl = _fcp.mpi_transport(group.py2f(), timeout_seconds)
        _transports[id(group)] = (group, impl, None, timeout_seconds)
        return impl, ""
    if group is not None and dist.is_initialized() and group is dist.distributed_c10d._get_default_group():
        # The default group by another name (dist.group.WORLD): one transport for both, else a
        # fresh one on the same group could take the messages an abandoned one left posted.
        group = None
    if group is None:
        if not dist.is_initialized():
            return _single_process_transport(), ""  # not cached: a process group may be initialised later
        # Held weakly: destroy_process_group must be able to free the group (a default group kept
        # alive here until the interpreter's exit was freed there, and the process could abort).
        key, slot = weakref.ref(dist.distributed_c10d._get_default_group()), "default"
    else:
        key, slot = group, id(group)
    cached = _transports.get(slot)
    if cached is not None and (cached[0]() is key() if slot == "default" else cached[0] is key):
        cached[2].timeout = datetime.timedelta(seconds=timeout_seconds)
        _fcp.set_callback_timeout(cached[1], timeout_seconds)  # what FCP's own waits take
        return cached[1], ""
    keep = _GroupTransport(group, timeout_seconds)
    impl = keep.make_impl()
    _transports[slot] = (key, impl, keep, timeout_seconds)
    return impl, ""


def _single_process_transport():
    """A transport of one rank: no messages, and an allreduce that returns its input."""
    def never(*unused):
        raise _fcp.Error("a one-rank transport sends no messages")
    return _fcp.callback_transport(0, 1, never, never, never, never, lambda values, *unused: values, 60.0)


def user_positions(cu_seqlens: Sequence[int], begin: int, end: int) -> torch.Tensor:
    """Each token's position inside its sequence, for tokens [begin, end) of the packed stream."""
    cu_list = _integers("cu_seqlens", cu_seqlens)
    if not cu_list or cu_list[0] != 0:
        raise _fcp.InvalidArgument(f"cu_seqlens starts {cu_list[:1]}: expected [0, ...]")
    for i in range(1, len(cu_list)):
        if cu_list[i] < cu_list[i - 1]:
            raise _fcp.InvalidArgument(f"cu_seqlens[{i}] is {cu_list[i]}: expected at least cu_seqlens[{i - 1}] = "
                                       f"{cu_list[i - 1]} (offsets never decrease)")
    begin, end = _integer("begin", begin), _integer("end", end)
    total = cu_list[-1]
    if not 0 <= begin <= end <= total:
        raise _fcp.InvalidArgument(f"tokens [{begin}, {end}): expected 0 <= begin <= end <= {total}, the batch's tokens")
    cu = torch.as_tensor(cu_list, dtype=torch.int64)
    tokens = torch.arange(begin, end, dtype=torch.int64)
    seq = torch.searchsorted(cu, tokens, right=True) - 1
    return tokens - cu[seq]


def _message(e: BaseException) -> str:
    """An error's one line for the other ranks: an error the checks did not foresee (not an
    fcp.Error) is named by its type."""
    return str(e) if isinstance(e, _fcp.Error) else f"{type(e).__name__}: {e}"


def _head_lists(heads: int, degree: int):
    """Which of `heads` heads each of `degree` members computes: a contiguous share each, or,
    where the members outnumber the heads, head m * heads // degree (replicated on degree //
    heads members), so that a member's key/value head is the one its query heads read (GQA)."""
    if heads % degree == 0:
        share = heads // degree
        return [list(range(m * share, (m + 1) * share)) for m in range(degree)]
    return [[m * heads // degree] for m in range(degree)]


# How many settings a batch's agreement hashes (what a Ulysses node's members compare).
_SETTINGS = len(_fcp.setting_hashes(_fcp.batch_options([0, 1], 0, 0, 1, 1, 1, True, "fp32", False, "fcp", 2048, 1,
                                                       0.0, 0.0)))


class _Ulysses:
    """Ulysses inside a group of ranks (a node): the members' token ranges tile one run of the
    stream; each member holds its own rows with every head, and attention runs on the group's
    rows with a share of the heads (fcp simulate's fcp+ulysses, the paper's deployment)."""

    def __init__(self, group, degree, member, rows, heads, kv_heads, timeout_seconds):
        self.group, self.degree, self.member, self.rows = group, degree, member, rows
        self.offsets = [sum(rows[:m]) for m in range(degree + 1)]
        self.q_lists, self.kv_lists = _head_lists(heads, degree), _head_lists(kv_heads, degree)
        self.timeout = datetime.timedelta(seconds=timeout_seconds)

    @staticmethod
    def gathered(group, values, what, timeout_seconds):
        """Every member's `values` (int64), all_gather over `group`, bounded by the timeout."""
        mine = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        work = dist.all_gather(parts, mine, group=group, async_op=True)
        timeout = datetime.timedelta(seconds=timeout_seconds)
        try:
            work.wait(timeout)
        except RuntimeError as e:
            raise _fcp.TransportError(f"{what} did not arrive from every rank of the group (timeout_seconds = "
                                      f"{timeout.total_seconds():g}): {e}") from None
        return [p.tolist() for p in parts]

    @staticmethod
    def agree(group, settings, args, timeout_seconds, across):
        """(the _Ulysses, args for the plan over the groups): the node's ranges gathered and checked,
        this rank's range widened to the node's and the heads to one member's share."""
        if not isinstance(group, dist.ProcessGroup):
            raise _fcp.InvalidArgument(f"ulysses_group is {_describe(group)}: expected a torch.distributed process "
                                       f"group of the ranks that exchange heads (one node's; ulysses_groups() makes them)")
        if dist.get_rank(group) < 0:
            raise _not_a_member()
        degree, member = dist.get_world_size(group), dist.get_rank(group)
        # Every setting FCP's agreement compares, hashed: that agreement runs over each index's
        # ranks only (over this rank alone when the node is the whole job), so the node's members
        # compare them among themselves.
        hashes = _fcp.setting_hashes(_fcp.batch_options(*args, local_error="")) if args else []
        parts = _Ulysses.gathered(group, [1, args[1], args[2]] + hashes if args else [0, 0, 0] + [0] * _SETTINGS,
                                  "ulysses_group's ranges", timeout_seconds)
        # The members have met: from here on, whatever this rank raises, it joins the node's
        # confirmation after the batch (a check below that fails on some members only, the
        # pairing across nodes, must not leave the others waiting there).
        settings.node = (group, member, timeout_seconds)
        # The ranks of `group` must be one member index of every node, each of the same degree:
        # else every member of a node would read another node's heads (wrong results, no error).
        if across is not None and not hasattr(across, "py2f") and isinstance(across, dist.ProcessGroup):
            seen = _Ulysses.gathered(across, [member, degree], "the member indices across the nodes",
                                     timeout_seconds)
        else:
            seen = None
        if args is None:
            raise _fcp.InvalidArgument("this rank's arguments were refused")  # the caller keeps its own message
        refused = [m for m, p in enumerate(parts) if p[0] == 0]
        if refused:
            raise _fcp.InvalidArgument(f"member {refused[0]} of ulysses_group: its arguments were refused there (its "
                                       f"own error says why)")
        if seen is None or any(x != [member, degree] for x in seen):
            raise _fcp.InvalidArgument(f"group holds members {sorted({x[0] for x in seen}) if seen else '?'} of "
                                       f"nodes of {sorted({x[1] for x in seen}) if seen else '?'} ranks: expected a "
                                       f"torch.distributed group of the ranks with this rank's index ({member}) in "
                                       f"every node of {degree} (ulysses_groups() makes it)")
        for i in range(_SETTINGS):
            if any(p[3 + i] != hashes[i] for p in parts):
                raise _fcp.InvalidArgument(f"ulysses_group's members passed different settings "
                                           f"({_fcp.setting_name(i)}): expected the same on every member")
        ranges = [(int(p[1]), int(p[2])) for p in parts]
        if any(ranges[m][1] != ranges[m + 1][0] for m in range(degree - 1)):
            raise _fcp.InvalidArgument(f"ulysses_group's local ranges are {ranges}: expected each member's to end where "
                                       f"the next member's begins (the group holds one run of the stream)")
        heads, kv_heads = args[3], args[4]
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise _fcp.InvalidArgument(f"heads {heads} and kv_heads {kv_heads}: expected positive counts, the "
                                       f"key/value heads dividing the query heads")
        if heads % degree or (kv_heads % degree and degree % kv_heads):
            raise _fcp.InvalidArgument(f"ulysses_group of {degree} ranks with {heads} query and {kv_heads} key/value "
                                       f"heads: expected a divisor of the query heads that divides the key/value "
                                       f"heads or is a multiple of them")
        if settings.layout != "transparent":
            raise _fcp.InvalidArgument(f"layout {settings.layout!r} with ulysses_group: expected 'transparent' (each "
                                       f"member keeps its own rows; a dispatched layout is the group's)")
        ulysses = _Ulysses(group, degree, member, [e - b for b, e in ranges], heads, kv_heads, timeout_seconds)
        planned = list(args)
        planned[1], planned[2] = ranges[0][0], ranges[-1][1]
        planned[3], planned[4] = heads // degree, max(1, kv_heads // degree)
        return ulysses, tuple(planned)

    def exchange(self, batch, sends, receive_bytes):
        """All-to-all over the node: sends[j] (tensors) to member j; returns the uint8 bytes received
        from each member (receive_bytes[m] of them). Refused once the batch failed on this rank; a
        failure fails the batch (fcp.TransportError: gloo then needs a new process group)."""
        if batch.failure is not None:
            batch._impl.fail(f"this batch refuses attention: a call on it raised on this rank before (expected a new "
                             f"batch, and a new process group after a timeout): {batch.failure}")
        start = time.perf_counter()

        def buffers():
            flat = [torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in parts]) if parts
                    else torch.empty(0, dtype=torch.uint8) for parts in sends]
            return flat, torch.cat(flat), torch.empty(sum(receive_bytes), dtype=torch.uint8)
        flat, send, recv = _prepared(batch, buffers)
        try:
            work = dist.all_to_all_single(recv, send, output_split_sizes=list(receive_bytes),
                                          input_split_sizes=[f.numel() for f in flat], group=self.group, async_op=True)
            work.wait(self.timeout)
        except RuntimeError as e:
            message = (f"the heads' exchange inside ulysses_group failed (timeout_seconds = "
                       f"{self.timeout.total_seconds():g}): {e}")
            try:
                batch._impl.fail(message)
            except _fcp.InvalidArgument:
                raise _fcp.TransportError(message) from None
        batch.attention_seconds += time.perf_counter() - start
        return list(recv.split(list(receive_bytes)))


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Bytes received, viewed as `dtype` in `shape` (copied first where they do not start on the
    element's alignment, as an fp32 lse after bf16 rows of an odd size may not)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if b.storage_offset() % size:
        b = b.clone()
    return b.view(dtype).view(shape)


def _unpacked(b: torch.Tensor, dtype: torch.dtype, rows: int, heads, dim: int):
    """Tensors [rows, h, dim] for each h of `heads`, one after another in the bytes b."""
    size = torch.empty(0, dtype=dtype).element_size()
    out, at = [], 0
    for h in heads:
        nbytes = rows * h * dim * size
        out.append(_from_bytes(b[at:at + nbytes], dtype, (rows, h, dim)))
        at += nbytes
    return out


def ulysses_groups(degree: int):
    """(group, ulysses_group) for this rank, for FCP across nodes with Ulysses inside each, as the
    FCP paper deploys it on rail-optimised clusters: ``ulysses_group`` is the ``degree``
    consecutive ranks of this rank's node (ranks n * degree to (n + 1) * degree - 1), which exchange
    heads; ``group`` is the ranks with this rank's index in every node (ranks j, j + degree, ...),
    over which FCP balances the nodes' tokens. Pass both to Batch. Collective over the default
    group: every rank calls it, once, in the same order as its other dist.new_group calls."""
    degree = _integer("degree", degree)
    if not dist.is_initialized():
        raise _fcp.InvalidArgument("ulysses_groups needs torch.distributed initialised: expected "
                                   "dist.init_process_group first")
    ranks = dist.get_world_size()
    if degree < 1 or ranks % degree:
        raise _fcp.InvalidArgument(f"Ulysses degree {degree} over {ranks} ranks: expected a positive divisor of the "
                                   f"ranks")
    rank = dist.get_rank()
    inside = [dist.new_group(list(range(n * degree, (n + 1) * degree))) for n in range(ranks // degree)]
    across = [dist.new_group(list(range(j, ranks, degree))) for j in range(degree)]
    return across[rank % degree], inside[rank // degree]


class _HeadsIn(torch.autograd.Function):
    """q, k, v of this member's rows, every head, in; the group's rows of this member's share of
    the heads out (one all-to-all). Backward: the gradients' rows go home, summed over the members
    that shared a replicated key/value head."""

    @staticmethod
    def forward(ctx, q, k, v, batch):
        ul, dim, dtype = batch._ulysses, batch.head_dim, batch.dtype
        n = ul.rows[ul.member]
        for name, t, heads in (("q", q, batch.heads), ("k", k, batch.kv_heads), ("v", v, batch.kv_heads)):
            _dense_or_fail(batch, name, t, f"({n}, {heads}, {dim}) {dtype}")
            if t.shape != (n, heads, dim) or t.dtype != dtype or t.device.type != "cpu":
                batch._impl.fail(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, expected ({n}, {heads}, {dim}) "
                                 f"{dtype} on the CPU (this rank's rows, every head: ulysses_group)")
        sq, skv = len(ul.q_lists[0]), len(ul.kv_lists[0])
        row = (sq + 2 * skv) * dim * q.element_size()
        sends = [[q[:, ul.q_lists[j]], k[:, ul.kv_lists[j]], v[:, ul.kv_lists[j]]] for j in range(ul.degree)]
        got = ul.exchange(batch, sends, [r * row for r in ul.rows])
        # Each member's bytes: its rows' q share, then k's, then v's.
        parts = [_unpacked(b, dtype, r, (sq, skv, skv), dim) for b, r in zip(got, ul.rows)]
        ctx.batch = batch
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk, dv):
        batch = ctx.batch
        ul, dim, dtype = batch._ulysses, batch.head_dim, batch.dtype
        sq, skv = len(ul.q_lists[0]), len(ul.kv_lists[0])
        total = ul.offsets[-1]
        grads = [torch.zeros((total, h, dim), dtype=dtype) if g is None else g.to(dtype)
                 for g, h in ((dq, sq), (dk, skv), (dv, skv))]
        n = ul.rows[ul.member]
        row = (sq + 2 * skv) * dim * torch.empty(0, dtype=dtype).element_size()
        sends = [[g[ul.offsets[m]:ul.offsets[m + 1]] for g in grads] for m in range(ul.degree)]
        got = ul.exchange(batch, sends, [n * row] * ul.degree)
        out = [torch.zeros((n, h, dim), dtype=torch.float32) for h in (batch.heads, batch.kv_heads, batch.kv_heads)]
        for j, b in enumerate(got):
            dqj, dkj, dvj = _unpacked(b, dtype, n, (sq, skv, skv), dim)
            out[0][:, ul.q_lists[j]] += dqj.float()
            out[1][:, ul.kv_lists[j]] += dkj.float()  # summed over the members that shared the head
            out[2][:, ul.kv_lists[j]] += dvj.float()
        return out[0].to(dtype), out[1].to(dtype), out[2].to(dtype), None


class _HeadsOut(torch.autograd.Function):
    """o (and lse) of the group's rows, this member's share of the heads, in; this member's rows,
    every head, out (one all-to-all). Backward: dO's share of the heads for the group's rows."""

    @staticmethod
    def forward(ctx, o, lse, batch):
        ul, dim, dtype = batch._ulysses, batch.head_dim, batch.dtype
        sq, n = len(ul.q_lists[0]), ul.rows[ul.member]
        sends = [[o[ul.offsets[m]:ul.offsets[m + 1]], lse[ul.offsets[m]:ul.offsets[m + 1]]] for m in range(ul.degree)]
        o_bytes, lse_bytes = n * sq * dim * o.element_size(), n * sq * 4
        got = ul.exchange(batch, sends, [o_bytes + lse_bytes] * ul.degree)
        out = torch.empty((n, batch.heads, dim), dtype=dtype)
        out_lse = torch.empty((n, batch.heads), dtype=torch.float32)
        for j, b in enumerate(got):
            out[:, ul.q_lists[j]] = _from_bytes(b[:o_bytes], dtype, (n, sq, dim))
            out_lse[:, ul.q_lists[j]] = _from_bytes(b[o_bytes:], torch.float32, (n, sq))
        ctx.batch = batch
        ctx.set_materialize_grads(False)
        return out, out_lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        batch = ctx.batch
        ul, dim, dtype = batch._ulysses, batch.head_dim, batch.dtype
        if dlse is not None:
            batch._impl.fail("a gradient reached the lse that attention returned: FCP's backward takes gradients "
                             "through o only: expected lse used without gradients (lse.detach())")
        n, sq = ul.rows[ul.member], len(ul.q_lists[0])
        do = torch.zeros((n, batch.heads, dim), dtype=dtype) if do is None else do.to(dtype)
        row = sq * dim * do.element_size()
        got = ul.exchange(batch, [[do[:, ul.q_lists[j]]] for j in range(ul.degree)], [r * row for r in ul.rows])
        return torch.cat([_from_bytes(b, dtype, (r, sq, dim)) for b, r in zip(got, ul.rows)]), None, None


def _confirmed(settings, make):
    """make() (a collective across the nodes), then, with ulysses_group, whether every member of
    the node succeeded: FCP's agreement runs over each index's ranks only, so a batch one index
    refuses (a setting that differs there) must fail its node's other members too, not leave
    them to time out in the first exchange."""
    try:
        made, error = make(), None
    except BaseException as e:  # noqa: BLE001 -- whatever it is, the node must hear of it first
        made, error = None, e
    if settings.node is not None:
        group, member, timeout_seconds = settings.node
        failed = _Ulysses.gathered(group, [0 if error is None else 1], "whether every member made the batch",
                                   timeout_seconds)
        others = [m for m, f in enumerate(failed) if f[0] and m != member]
        if error is None and others:
            raise _fcp.InvalidArgument(f"member {others[0]} of ulysses_group could not make the batch (its own error "
                                       f"says why): expected every member's batch")
    if error is not None:
        raise error
    return made


class _Settings:
    """A batch's arguments, checked, and the options FCP plans it from. A check that fails here
    fails on this rank only, while the others go on into the batch's agreement: so its message
    goes into the options (local_error), and the agreement makes every rank raise together,
    this one with its own message. Only a timeout FCP cannot make a transport with raises here."""

    def __init__(self, cu_seqlens, local_range, group, heads, kv_heads, head_dim, causal, dtype, layout,
                 strategy, block_size, threads, comm_ratio, softmax_scale, timeout_seconds, ulysses_group=None):
        if not (isinstance(timeout_seconds, (int, float)) and not isinstance(timeout_seconds, bool)
                and 0 < timeout_seconds <= 86400):
            raise _fcp.InvalidArgument(f"timeout_seconds {timeout_seconds!r}: expected a number of seconds above 0 and at most 86400")
        self.transport, transport_error = _transport(group, timeout_seconds)
        self.ulysses = None
        self.node = None  # (group, member, timeout_seconds) once ulysses_group's members have met
        args, message = None, ""
        try:
            if transport_error:
                raise _fcp.InvalidArgument(transport_error)
            args = self._check(cu_seqlens, local_range, heads, kv_heads, head_dim, causal, dtype, layout, strategy,
                               block_size, threads, comm_ratio, softmax_scale)
        except Exception as e:  # noqa: BLE001 -- whatever it is, the other ranks must hear of it
            message = _message(e)
        if ulysses_group is not None:
            # Collective over the node's group whatever this rank's checks said, so that its
            # members stay in step; a member's error reaches every rank through the agreement.
            try:
                self.ulysses, args = _Ulysses.agree(ulysses_group, self, args, timeout_seconds, group)
            except Exception as e:  # noqa: BLE001
                message = message or _message(e)
        self.plan_heads, self.plan_kv_heads = (args[3], args[4]) if args else (0, 0)
        if not message:
            self.options = _fcp.batch_options(*args, local_error="")
        else:
            # Anything valid: the agreement fails on every rank before it is read.
            self.options = _fcp.batch_options([0, 1], 0, 0, 1, 1, 1, True, "fp32", False, "fcp", 2048, 1, 0.0, 0.0,
                                              local_error=message)

    def _check(self, cu_seqlens, local_range, heads, kv_heads, head_dim, causal, dtype, layout, strategy,
               block_size, threads, comm_ratio, softmax_scale):
        """The arguments checked, as batch_options takes them; sets this object's fields."""
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
            raise _fcp.InvalidArgument(f"dtype {_describe(dtype)} is not supported: expected torch.float32 or torch.bfloat16")
        if layout not in ("transparent", "dispatched"):
            raise _fcp.InvalidArgument(f"layout {_describe(layout)} is not supported: expected transparent or dispatched")
        if type(causal).__name__ == "bool_":  # a NumPy bool
            causal = bool(causal)
        if not isinstance(causal, bool):
            raise _fcp.InvalidArgument(f"causal is {_describe(causal)}: expected True or False")
        if not isinstance(strategy, str):
            raise _fcp.InvalidArgument(f"strategy is {_describe(strategy)}: expected a name such as 'fcp' or 'ring'")
        self.cu_seqlens = _integers("cu_seqlens", cu_seqlens)
        try:  # a pair indexed 0 and 1 (a tuple, a list, a tensor or array of two), not a mapping
            pair = (local_range[0], local_range[1]) \
                if len(local_range) == 2 and not isinstance(local_range, Mapping) else None
        except (TypeError, KeyError, IndexError):
            pair = None
        if pair is None:
            raise _fcp.InvalidArgument(f"local_range is {_describe(local_range)}: expected (begin, end)")
        self.begin, self.end = _integer("local_range[0]", pair[0]), _integer("local_range[1]", pair[1])
        self.heads, self.kv_heads, self.head_dim = (_integer("heads", heads), _integer("kv_heads", kv_heads),
                                                    _integer("head_dim", head_dim))
        block_size, threads = _integer("block_size", block_size), _integer("threads", threads)
        # FCP checks the thread count on every rank alike; here only that it fits in a C int.
        if not -2 ** 31 <= threads < 2 ** 31:
            raise _fcp.InvalidArgument(f"thread count {threads}: expected 1 to {_fcp.max_kernel_threads}")
        try:
            comm_ratio = float(comm_ratio)
        except (TypeError, ValueError, OverflowError):
            raise _fcp.InvalidArgument(f"comm_ratio is {_describe(comm_ratio)}: expected a number") from None
        # FCP checks the value again on every rank alike.
        if isinstance(softmax_scale, torch.Tensor) and softmax_scale.dim() == 0 \
                and softmax_scale.dtype.is_floating_point:
            softmax_scale = softmax_scale.item()  # a 0-d tensor, as a model may keep its scale
        if softmax_scale is None:
            softmax_scale = 0.0  # FCP's 1/sqrt(head_dim)
        elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real) \
                or not _FP32_TINY <= softmax_scale <= _FP32_MAX:
            raise _fcp.InvalidArgument(f"softmax_scale is {_describe(softmax_scale)}: expected a number above 0 in "
                                       f"fp32's range ({_FP32_TINY:g} to {_FP32_MAX:g}, the kernels'), or None "
                                       f"for 1/sqrt(head_dim)")
        self.dtype = dtype
        self.layout = layout
        return (self.cu_seqlens, self.begin, self.end, self.heads, self.kv_heads, self.head_dim, causal,
                _DTYPES[dtype], layout == "dispatched", strategy, block_size, threads, comm_ratio,
                float(softmax_scale))


class Batch:
    """One training step's batch, planned on every rank (collective). See the module docstring.

    ``threads`` is how many threads FCP's kernels use on this rank (default 1: set it to the cores
    each rank may use). ``softmax_scale`` scales q·k before the softmax in every attention call of
    the batch, forward and backward (None: 1/sqrt(head_dim)); the same on every rank.
    ``timeout_seconds`` bounds every wait for another rank, the batch's agreement included (an MPI
    transport then takes up to 1 s more to withdraw the call's other messages); it applies to a
    process group's transport from this batch on. An
    agreement that times out leaves its all-reduce posted on the group (a late rank would meet
    it), so the group's transport then refuses every batch: continue on a new process group. An
    mpi4py communicator's transport keeps the timeout it was made with: a batch with another
    fails on every rank (pass ``comm.Dup()`` for another timeout).

    dispatch, undispatch and attention (forward and backward) are collectives. One that raises on
    this rank only (a tensor of the wrong shape here) leaves the other ranks inside it, waiting for
    this rank until their timeout: so that no later call of this rank's is taken for that one, the
    batch then refuses every call with an error naming the first (``failure``). The other ranks'
    messages for that call may still arrive on the group, where a new batch's would match them:
    continue on a new process group (or communicator) with a new batch. A rank whose call
    returned (its sends completed before their receives were posted, as MPI's small ones do)
    learns of it at the next batch's agreement, where every rank raises, naming it; until then
    this rank's other batches on the group refuse their calls. Where every rank raised the same
    error in the same call's checks (the same mistake everywhere), no message was sent, and the
    next batch on the same group goes on. On gloo, a message that times out closes the group's
    connections between those ranks (gloo's own doing): the next batch's agreement, and the
    caller's own collectives on that group, then fail with gloo's error rather than that verdict,
    and only a new process group goes on.
    """

    def __init__(self, cu_seqlens: Sequence[int], local_range: Tuple[int, int], group=None, *, heads: int,
                 kv_heads: int, head_dim: int, causal: bool = True, dtype: torch.dtype = torch.float32,
                 layout: str = "transparent", strategy: str = "fcp", block_size: int = 2048, threads: int = 1,
                 comm_ratio: float = 0.0, softmax_scale: Optional[float] = None, timeout_seconds: float = 300.0,
                 ulysses_group=None):
        settings = _Settings(cu_seqlens, local_range, group, heads, kv_heads, head_dim, causal, dtype, layout,
                             strategy, block_size, threads, comm_ratio, softmax_scale, timeout_seconds, ulysses_group)
        self._attach(settings, _confirmed(settings, lambda: _fcp.AttentionBatch(settings.transport, settings.options)))

    def _attach(self, settings: _Settings, impl) -> None:
        self.cu_seqlens = settings.cu_seqlens
        self.begin, self.end = settings.begin, settings.end
        self.heads, self.kv_heads, self.head_dim = settings.heads, settings.kv_heads, settings.head_dim
        self.dtype = settings.dtype
        self.layout = settings.layout
        self._transport = settings.transport
        self._ulysses = settings.ulysses
        self._plan_heads, self._plan_kv_heads = settings.plan_heads, settings.plan_kv_heads
        self._impl = impl
        self._sequence = None
        self._position = None
        #: Seconds this rank spent inside attention (forward and backward) with this batch.
        self.attention_seconds = 0.0

    @property
    def num_user_tokens(self) -> int:
        """Rows of this rank in the caller's layout (end - begin)."""
        return self._ulysses.rows[self._ulysses.member] if self._ulysses else self._impl.num_user_tokens

    @property
    def num_local_tokens(self) -> int:
        """Rows of this rank in FCP's layout."""
        self._no_ulysses("num_local_tokens")
        return self._impl.num_local_tokens

    def _no_ulysses(self, name: str) -> None:
        if self._ulysses is not None:
            raise _fcp.InvalidArgument(f"batch.{name} with ulysses_group: expected attention() on this rank's own rows "
                                       f"(FCP's layout there is the node's, which no member holds)")

    @property
    def num_call_tokens(self) -> int:
        """Rows of the q, k, v that attention() takes: by layout, one of the two above."""
        return self._ulysses.rows[self._ulysses.member] if self._ulysses else self._impl.num_call_tokens

    def _fcp_layout_rows(self, name: str) -> None:
        if self.layout != "dispatched":
            raise _fcp.InvalidArgument(f"batch.{name} describes the rows of FCP's layout, which a transparent batch keeps inside "
                             f"attention(): expected a batch with layout='dispatched' (a transparent batch's rows are "
                             f"the caller's own: user_positions(cu_seqlens, begin, end))")

    @property
    def sequence(self) -> torch.Tensor:
        """For each row of FCP's layout, the index of its sequence in the batch (dispatched layout
        only). A new tensor each time: the caller may change it in place."""
        self._fcp_layout_rows("sequence")
        if self._sequence is None:
            self._sequence = torch.tensor(self._impl.local_sequence(), dtype=torch.int64)
        return self._sequence.clone()

    @property
    def position(self) -> torch.Tensor:
        """For each row of FCP's layout, its position inside its sequence, for RoPE (dispatched
        layout only). A new tensor each time: the caller may change it in place."""
        self._fcp_layout_rows("position")
        if self._position is None:
            self._position = torch.tensor(self._impl.local_position(), dtype=torch.int64)
        return self._position.clone()

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of the caller's layout (num_user_tokens x ...) moved into FCP's layout."""
        self._no_ulysses("dispatch")
        return _Dispatch.apply(x, self, True)

    def undispatch(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of FCP's layout (num_local_tokens x ...) moved back to the caller's layout."""
        self._no_ulysses("undispatch")
        return _Dispatch.apply(x, self, False)

    def stats(self) -> dict:
        """The last forward's and backward's time, FLOPs and bytes on this rank."""
        return self._impl.stats()

    @property
    def failure(self) -> Optional[str]:
        """None while no call on this batch has raised on this rank; else that call's error."""
        return self._impl.failure


class PendingBatch:
    """The next step's batch, planned on a thread of its own while this step runs.

    ``PendingBatch(...)`` takes Batch's arguments; it is collective (every rank checks the batch
    with the others, as Batch does) and returns once planning has started. Planning talks to no
    other rank, so the current step's attention and the caller's own collectives may run
    meanwhile. ``batch()`` (collective) waits for the plan and returns the Batch, the same one
    ``Batch(...)`` would have made; call it once, on every rank at the same point. Use a pending
    batch from one thread; dropping one unused waits for its planning to end, with the GIL
    released (the caller's other threads run meanwhile).
    """

    def __init__(self, cu_seqlens: Sequence[int], local_range: Tuple[int, int], group=None, *, heads: int,
                 kv_heads: int, head_dim: int, causal: bool = True, dtype: torch.dtype = torch.float32,
                 layout: str = "transparent", strategy: str = "fcp", block_size: int = 2048, threads: int = 1,
                 comm_ratio: float = 0.0, softmax_scale: Optional[float] = None, timeout_seconds: float = 300.0,
                 ulysses_group=None):
        self._settings = _Settings(cu_seqlens, local_range, group, heads, kv_heads, head_dim, causal, dtype,
                                   layout, strategy, block_size, threads, comm_ratio, softmax_scale,
                                   timeout_seconds, ulysses_group)
        self._impl = _confirmed(self._settings,
                                lambda: _fcp.PendingBatch(self._settings.transport, self._settings.options))

    @property
    def ready(self) -> bool:
        """Whether the plan is made: batch() would not wait (False once batch() was called)."""
        return self._impl.ready

    def batch(self) -> Batch:
        """The planned Batch (collective): waits for the plan and checks every rank has the same."""
        batch = Batch.__new__(Batch)
        batch._attach(self._settings, _confirmed(self._settings, lambda: _fcp.AttentionBatch(self._impl)))
        return batch


def _dense_or_fail(batch: Batch, name: str, x, expected: str) -> None:
    """fail()s the batch (which raises) unless x is a dense (strided) torch.Tensor."""
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
        what = f"a {x.layout} tensor" if isinstance(x, torch.Tensor) else _describe(x)
        batch._impl.fail(f"{name} is {what}: expected {expected}, a dense torch.Tensor on the CPU")


def _rows(x: torch.Tensor):
    """(x, its row stride in elements) when each of x's rows (dims 1 on) is dense and the rows do
    not overlap, as q, k and v viewed out of a fused projection are: FCP reads such an input where
    it is. Otherwise (x.contiguous(), 0): a copy only where the rows are not dense."""
    row = math.prod(x.shape[1:])
    if x.dim() >= 1 and x.shape[0] > 1 and row > 0 and x.stride(0) >= row and x[0].is_contiguous():
        return x, x.stride(0)
    return x.contiguous(), 0


def _prepared(batch: Batch, make):
    """make() (what a call needs before FCP's collective: inputs with dense rows, outputs), where an
    error (out of memory, an interrupt) fails the batch as a check would (fail()): the other
    ranks may be inside the call, and the next batch's agreement must hear of it."""
    try:
        return make()
    except BaseException as e:
        try:
            try:
                text = f"{type(e).__name__} before the call reached FCP: {e}"
            except BaseException:  # noqa: BLE001 -- the message must not stop the record
                text = "an error before the call reached FCP"
            batch._impl.fail(text)
        except _fcp.Error:
            pass  # raised by fail(): the error to raise is e
        raise


def _move(batch: Batch, x: torch.Tensor, into_fcp: bool) -> torch.Tensor:
    rows_in, rows_out = ((batch.num_user_tokens, batch.num_local_tokens) if into_fcp
                         else (batch.num_local_tokens, batch.num_user_tokens))
    name = f"{'dispatch' if into_fcp else 'undispatch'} input"
    _dense_or_fail(batch, name, x, f"{rows_in} rows")
    if x.device.type != "cpu" or x.dim() < 1 or x.shape[0] != rows_in:
        # fail() also makes the batch refuse later calls: the other ranks may be inside this one.
        batch._impl.fail(f"{'dispatch' if into_fcp else 'undispatch'} input has shape {tuple(x.shape)} on "
                         f"{x.device}: expected {rows_in} rows on the CPU")
    (x, stride), out = _prepared(batch, lambda: (_rows(x), torch.empty((rows_out,) + tuple(x.shape[1:]), dtype=x.dtype)))
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    if row_bytes == 0:  # nothing to move (every rank sees the same row shape)
        return out
    # The row's dtype and shape key the call's tags with its size: ranks that pass rows of
    # another kind time out (TransportError) rather than take one another's bytes as their own,
    # unless the two keys share a tag window (docs/api.md gives the odds). crc32, not hash(): str
    # hashes differ between processes.
    kind = zlib.crc32(f"{x.dtype} {tuple(x.shape[1:])}".encode())
    if into_fcp:
        batch._impl.dispatch(x.data_ptr(), out.data_ptr(), row_bytes, user_stride=stride * x.element_size(),
                             row_kind=kind)
    else:
        batch._impl.undispatch(x.data_ptr(), out.data_ptr(), row_bytes, local_stride=stride * x.element_size(),
                               row_kind=kind)
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, batch, into_fcp):
        ctx.batch, ctx.into_fcp = batch, into_fcp
        return _move(batch, x, into_fcp)

    @staticmethod
    def backward(ctx, grad):
        return _move(ctx.batch, grad, not ctx.into_fcp), None, None


class _Attention(torch.autograd.Function):
    """o = attention(q, k, v) over the batch; keeps only FCP's per-layer state for backward."""

    @staticmethod
    def forward(ctx, q, k, v, batch):
        n, hq, hkv = batch._impl.num_call_tokens, batch._plan_heads, batch._plan_kv_heads
        for name, t, heads in (("q", q, hq), ("k", k, hkv), ("v", v, hkv)):
            _dense_or_fail(batch, name, t, f"({n}, {heads}, {batch.head_dim}) {batch.dtype}")
            if t.shape != (n, heads, batch.head_dim) or t.dtype != batch.dtype or t.device.type != "cpu":
                batch._impl.fail(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                                 f"({n}, {heads}, {batch.head_dim}) {batch.dtype} on the CPU ({batch.layout} layout)")
        # q, k, v viewed out of a fused projection are read in place, their rows a stride apart.
        (q, qs), (k, ks), (v, vs), o, lse, layer = _prepared(batch, lambda: (
            _rows(q), _rows(k), _rows(v),
            torch.empty((n, hq, batch.head_dim), dtype=batch.dtype),
            torch.empty((n, hq), dtype=torch.float32), _fcp.AttentionLayer()))
        start = time.perf_counter()
        layer.forward(batch._impl, _DTYPES[batch.dtype], n, hq, hkv, batch.head_dim,
                      q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                      q_stride=qs, k_stride=ks, v_stride=vs)
        ctx.layer, ctx.batch = layer, batch
        batch.attention_seconds += time.perf_counter() - start
        ctx.set_materialize_grads(False)  # an unused lse gives None, not zeros, in backward
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        batch = ctx.batch
        if ctx.layer is None:
            batch._impl.fail("attention's backward ran twice for one forward (retain_graph): FCP frees a layer's "
                             "saved state in its backward: expected one backward per forward")
        # Whether lse is in the graph, not whether its gradient is zero: a rank with no rows must
        # decide as the others do (backward is collective).
        if dlse is not None:
            batch._impl.fail("a gradient reached the lse that attention returned: FCP's backward takes gradients "
                             "through o only: expected lse used without gradients (lse.detach())")
        start = time.perf_counter()
        n, hq, hkv = batch._impl.num_call_tokens, batch._plan_heads, batch._plan_kv_heads

        def buffers():
            d = torch.zeros((n, hq, batch.head_dim), dtype=batch.dtype) if do is None \
                else do.to(batch.dtype)
            dk = torch.empty((n, hkv, batch.head_dim), dtype=batch.dtype)
            return _rows(d), torch.empty((n, hq, batch.head_dim), dtype=batch.dtype), dk, torch.empty_like(dk)
        (do, ds), dq, dk, dv = _prepared(batch, buffers)
        ctx.layer.backward(batch._impl, _DTYPES[batch.dtype], n, hq, hkv, batch.head_dim,
                           do.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dO_stride=ds)
        ctx.layer = None  # FCP's saved state is freed once the gradients are out
        batch.attention_seconds += time.perf_counter() - start
        return dq, dk, dv, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
              return_lse: bool = False):
    """Attention of every sequence of ``batch`` (causal or full, GQA when k, v have fewer heads),
    scaled by the batch's ``softmax_scale`` (1/sqrt(head_dim) by default). Returns o (and the fp32
    log-sum-exp [tokens, heads], natural log, with ``return_lse``). Differentiable in q, k, v, once
    (no double backward, one backward per forward), through o: a gradient that reaches lse raises
    fcp.Error rather than be dropped.
    lse is in the graph for that reason: use ``lse.detach()`` to log or keep it (``.numpy()``).
    q, k, v need only dense rows: views of a fused projection (``qkv.unbind(1)`` of a
    [tokens, 3, heads, head_dim] tensor) are read in place, not copied.
    A call that raises on this rank (a tensor of the wrong shape) may leave the other ranks inside
    it until their timeout; the batch then refuses every later call (see Batch)."""
    if not isinstance(batch, Batch):
        # Checked before any collective (there is no batch to fail): AttributeError before.
        pending = isinstance(batch, PendingBatch)
        raise _fcp.InvalidArgument(f"batch is {'a PendingBatch' if pending else _describe(batch)}: expected an "
                                   f"fcp.torch.Batch{' (the one its batch() returns)' if pending else ''}")
    if batch._ulysses is not None:
        q, k, v = _HeadsIn.apply(q, k, v, batch)
        o, lse = _HeadsOut.apply(*_Attention.apply(q, k, v, batch), batch)
    else:
        o, lse = _Attention.apply(q, k, v, batch)
    return (o, lse) if return_lse else o
