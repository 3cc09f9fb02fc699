"""Ring all_reduce of device memory over the host transports: reduce-scatter then all-gather, each block
staged through pinned host memory and reduced on the device.

It serves GPU leaders that no zero-copy link joins (other hosts, or the link turned off). Each leader moves
2(k-1)/k of the buffer, against k-1 when every chunk is all-gathered and reduced locally (gpu/staging.py,
HETCCL_STAGED_RING=0). Two leaders move the same bytes either way, and the ring is still faster over TCP (its
chains overlap copies and the wire: 64 MiB on one H200, 3.1 vs 1.8 GB/s; shm even,
benchmarks/results/gpu-cross-hosts-2026-12-01.md). GPU data is never reduced on the host CPU.

As in ring.py, the buffer is cut into k blocks and each block into chunks; chunk c of every block runs on its
own chain (reduce-scatter steps, then all-gather steps), and a few chains run at once, each on its own pinned
slot. A reduce-scatter step copies the block it sends to pinned memory (after the previous step's reduction,
in stream order), sends it, and reduces the block it receives on the device; an all-gather step forwards the
pinned block it received. Every receive of a chain is posted before its first send, so no message arrives
early. All device work runs on one side stream, ordered after the caller's stream and before what the caller
queues next.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..dtypes import block_ranges
from ..gpu.runtime import copy_streams, lease, reduce_inplace, torch_mod, wait_event
from ..scheduler import CollCtx, chunk_ranges, gather_fail_fast, make_tag, num_chunks

RS, AG = 5, 6  # tag phases, apart from ring.py's
WINDOW = 2  # chains in flight: one exchanging while the other's copies and reductions run


async def all_reduce(ctx: CollCtx, t: Any, stream: Any, chunk_bytes: int, deadline: float) -> None:
    """In-place all_reduce of the flat device tensor t (ctx.op, never AVG: the caller divides)."""
    n, r = ctx.size, ctx.rank
    count = int(t.numel())
    if n == 1 or count == 0:
        return
    torch = torch_mod()
    isz = t.element_size()
    blocks = block_ranges(count, n)
    nch = num_chunks(blocks[0][1] - blocks[0][0], isz, chunk_bytes)
    ranges = [chunk_ranges(a, b, nch) for a, b in blocks]
    width = max(b - a for rs in ranges for a, b in rs)  # elements of the largest chunk
    right, left = (r + 1) % n, (r - 1) % n
    op = ctx.op
    side = copy_streams(t.device)[1]
    side.wait_stream(stream)  # after the work already queued on the caller's stream
    window = min(WINDOW, nch)
    # per slot, 2n pinned pieces: n-1 reduce-scatter inboxes, n all-gather blocks (by block index), one outbox
    with lease("pinned", t.device, 2 * n * width * isz, window) as pinned, \
            lease("device", t.device, width * isz, window) as scratch:
        finished: list[asyncio.Future[None]] = [asyncio.get_running_loop().create_future() for _ in range(nch)]

        def piece(slot: int, i: int, elems: int) -> Any:  # bytes (numpy has no bfloat16): .view(t.dtype) on device
            return pinned[slot][i * width * isz:(i * width + elems) * isz]

        async def copied(what: str) -> None:
            ev = torch.cuda.Event()
            ev.record(side)
            await wait_event(ev, deadline, what)

        async def chain(c: int) -> None:
            if c >= window:
                await finished[c - window]  # its slot is free once that chain's copies are done
            slot = c % window

            def rng(block: int) -> tuple[int, int]:
                return ranges[block % n][c]

            def size(block: int) -> int:
                a, b = rng(block)
                return b - a

            inbox = [piece(slot, s, size(r - s - 1)) for s in range(n - 1)]
            gathered = [piece(slot, n - 1 + j, size(j)) for j in range(n)]
            rs = [ctx.recv(left, make_tag(RS, s, c), inbox[s].numpy()) if size(r - s - 1) else None
                  for s in range(n - 1)]
            ag = [ctx.recv(left, make_tag(AG, s, c), gathered[(r - s) % n].numpy())
                  if size(r - s) else None for s in range(n - 1)]
            out = pinned[slot][(2 * n - 1) * width * isz:]
            dev = scratch[slot].view(t.dtype)
            for s in range(n - 1):
                a, b = rng(r - s)  # this step's block: ours at first, then the one reduced last step
                if b > a:
                    with torch.cuda.stream(side):
                        out[:(b - a) * isz].view(t.dtype).copy_(t[a:b], non_blocking=True)
                    await copied("device-to-host staging")
                    await ctx.send(right, make_tag(RS, s, c), out[:(b - a) * isz].numpy())
                a, b = rng(r - s - 1)
                if b > a:
                    await rs[s]
                    with torch.cuda.stream(side):
                        dev[:b - a].copy_(inbox[s].view(t.dtype), non_blocking=True)
                        reduce_inplace(t[a:b], dev[:b - a], op)
            a, b = rng(r + 1)  # the block this rank now holds reduced
            if b > a:
                with torch.cuda.stream(side):
                    gathered[(r + 1) % n].view(t.dtype).copy_(t[a:b], non_blocking=True)
                await copied("device-to-host staging")
            for s in range(n - 1):
                blk = (r + 1 - s) % n
                if size(blk):
                    await ctx.send(right, make_tag(AG, s, c), gathered[blk].numpy())
                if ag[s] is not None:
                    await ag[s]
            with torch.cuda.stream(side):
                for s in range(n - 1):
                    a, b = rng(r - s)
                    if b > a:
                        t[a:b].copy_(gathered[(r - s) % n].view(t.dtype), non_blocking=True)
            await copied("host-to-device staging")  # the slot's pinned pieces are free after this
            finished[c].set_result(None)

        await gather_fail_fast([chain(c) for c in range(nch)])
    stream.wait_stream(side)  # what the caller queues next sees the result
