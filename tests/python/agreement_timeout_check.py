"""A call that raised on one rank: the other's wait for its messages ends at timeout_seconds and
names the message it waited for. A batch's agreement is bounded by timeout_seconds, not by the process group's timeout: on 2
gloo ranks, rank 1 never makes the batch (it stays alive, so nothing but the timeout can end
rank 0's wait); rank 0 raises fcp.Error naming the timeout at its 3 s, well before the group's
120 s, and the group's transport then refuses every batch (its all-reduce is still posted: a
late rank would meet it), naming what to do, also under the group's other name
(dist.group.WORLD). Run with Debian's /usr/bin/python3 and
PYTHONPATH at the build's python directory; exits nonzero on any failure."""
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fcp
import fcp.torch as ft


def run(rank, port, done):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    code = 0
    # First, on a group of its own: rank 1 passes q of the wrong shape, so its call raises at once
    # and rank 0 waits for rank 1's messages until its timeout, then names the message it waited
    # for (gloo's own error names no peer) and the batch's timeout.
    group = dist.new_group([0, 1])
    # A first batch with another timeout: the wait must name the batch's own, not this one.
    ft.Batch([0, 100], (50 * rank, 50 * rank + 50), group, heads=2, kv_heads=1, head_dim=16, timeout_seconds=20)
    batch = ft.Batch([0, 100], (50 * rank, 50 * rank + 50), group, heads=2, kv_heads=1, head_dim=16,
                     block_size=16, timeout_seconds=3)
    rows = 51 if rank == 1 else 50
    try:
        ft.attention(torch.zeros(rows, 2, 16), torch.zeros(50, 1, 16), torch.zeros(50, 1, 16), batch)
        print(f"rank {rank}: attention returned", flush=True)
        code = 1
    except fcp.Error as e:
        print(f"rank {rank}: attention raised: {e}", flush=True)
        if rank == 1 and ("q is (51, 2, 16)" not in str(e) or type(e) is not fcp.InvalidArgument):
            code = 1
        if rank == 0 and not ("bytes from rank 1, tag" in str(e) and "(timeout_seconds = 3)" in str(e)
                              and "did that rank raise in this call, stop," in str(e)
                              and type(e) is fcp.TransportError):
            code = 1
    if rank == 0:
        start = time.monotonic()
        try:
            ft.Batch([0, 100], (0, 50), heads=2, kv_heads=1, head_dim=16, timeout_seconds=3)
            print("rank 0: the batch was made without rank 1", flush=True)
            code = 1
        except fcp.Error as e:
            waited = time.monotonic() - start
            print(f"rank 0: raised after {waited:.1f} s: {e}", flush=True)
            # The group's timeout is 120 s; the message names the agreement and its timeout.
            if waited >= 60 or type(e) is not fcp.TransportError \
                    or "agreement did not hear from every rank" not in str(e) \
                    or "timeout_seconds = 3" not in str(e) or "timed out" not in str(e).lower():
                code = 1
        # Then the same group, also by its other name: the same (abandoned) transport each time.
        for name, group in (("a second batch on the same group", None), ("a batch on dist.group.WORLD",
                                                                         dist.group.WORLD)):
            try:
                ft.Batch([0, 100], (0, 50), group, heads=2, kv_heads=1, head_dim=16, timeout_seconds=3)
                print(f"rank 0: {name} was made", flush=True)
                code = 1
            except fcp.Error as e:
                print(f"rank 0: {name}: {e}", flush=True)
                if "expected a new process group" not in str(e) or type(e) is not fcp.TransportError:
                    code = 1
        done.set()
    else:
        done.wait(100)  # alive, never making the batch, until rank 0 is through
    os._exit(code)  # rank 0's all-reduce is still posted: no orderly shutdown of the group


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    try:
        mp.spawn(run, args=(free, mp.get_context("spawn").Event()), nprocs=2)
    except Exception as e:  # noqa: BLE001 -- a rank that exited nonzero or raised
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
    print("agreement timeout: ok")
