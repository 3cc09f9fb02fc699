"""Ring all_reduce, reduce_scatter and all_gather of device memory over the host transports: reduce-scatter
steps, all-gather steps or both, each block staged through pinned host memory and reduced on the device.

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
queues next. reduce_scatter and all_gather are the ring's two halves alone: each leader moves (k-1)/k of the
buffer, at the all_reduce's rate per byte.
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
    await _ring(ctx, t, None, stream, chunk_bytes, deadline, reduce=True, gather=True)


async def reduce_scatter(ctx: CollCtx, out: Any, inp: Any, stream: Any, chunk_bytes: int, deadline: float) -> None:
    """out = block `rank` of the reduction of every rank's inp (n equal blocks of out's size); inp is only read
    (the partial sums travel through device scratch). Each rank moves (n-1)/n of inp."""
    await _ring(ctx, inp, out, stream, chunk_bytes, deadline, reduce=True, gather=False)


async def all_gather(ctx: CollCtx, t: Any, stream: Any, chunk_bytes: int, deadline: float) -> None:
    """In-place all_gather: t holds n equal blocks, block `rank` this rank's part on entry, every part after."""
    await _ring(ctx, t, None, stream, chunk_bytes, deadline, reduce=False, gather=True)


async def _ring(ctx: CollCtx, t: Any, out: Any, stream: Any, chunk_bytes: int, deadline: float, reduce: bool,
                gather: bool) -> None:
    """The ring's phases on t: reduce-scatter steps (reduce), then all-gather steps (gather). `own` is the block a
    rank holds complete after the first phase (or from the start, without it): block r + 1 for all_reduce, as in
    ring.py, block r for reduce_scatter and all_gather. With `out`, reduce_scatter leaves t untouched and writes
    block r's sum there."""
    n, r = ctx.size, ctx.rank
    count = int(t.numel())
    if count == 0:
        return
    if n == 1:
        if out is not None:
            with torch_mod().cuda.stream(stream):
                out.copy_(t)
        return
    torch = torch_mod()
    isz = t.element_size()
    blocks = block_ranges(count, n)
    nch = num_chunks(blocks[0][1] - blocks[0][0], isz, chunk_bytes)
    ranges = [chunk_ranges(a, b, nch) for a, b in blocks]
    width = max(b - a for rs in ranges for a, b in rs)  # elements of the largest chunk
    right, left = (r + 1) % n, (r - 1) % n
    own = (r + 1) % n if reduce and gather else r
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

            steps = n - 1 if reduce else 0
            inbox = [piece(slot, s, size(own - s - 2)) for s in range(steps)]
            gathered = [piece(slot, n - 1 + j, size(j)) for j in range(n)]
            rs = [ctx.recv(left, make_tag(RS, s, c), inbox[s].numpy()) if size(own - s - 2) else None
                  for s in range(steps)]
            ag = [ctx.recv(left, make_tag(AG, s, c), gathered[(own - s - 1) % n].numpy())
                  if gather and size(own - s - 1) else None for s in range(n - 1)]
            outbox = pinned[slot][(2 * n - 1) * width * isz:]
            dev = scratch[slot].view(t.dtype)
            for s in range(steps):
                a, b = rng(own - 1 - s)  # this step's block: ours at first, then the one reduced last step
                if b > a:
                    with torch.cuda.stream(side):
                        part = t[a:b] if out is None or s == 0 else dev[:b - a]
                        outbox[:(b - a) * isz].view(t.dtype).copy_(part, non_blocking=True)
                    await copied("device-to-host staging")
                    await ctx.send(right, make_tag(RS, s, c), outbox[:(b - a) * isz].numpy())
                a, b = rng(own - s - 2)
                if b > a:
                    await rs[s]
                    with torch.cuda.stream(side):
                        dev[:b - a].copy_(inbox[s].view(t.dtype), non_blocking=True)
                        if out is None:
                            reduce_inplace(t[a:b], dev[:b - a], op)
                        else:  # incoming OP ours: the same bits as ours OP incoming (commutative ops)
                            reduce_inplace(dev[:b - a], t[a:b], op)
                            if s == steps - 1:
                                lo = blocks[r][0]
                                out[a - lo:b - lo].copy_(dev[:b - a])
            if gather:
                a, b = rng(own)  # the block this rank now holds complete
                if b > a:
                    with torch.cuda.stream(side):
                        gathered[own].view(t.dtype).copy_(t[a:b], non_blocking=True)
                    await copied("device-to-host staging")
                for s in range(n - 1):
                    blk = (own - s) % n
                    if size(blk):
                        await ctx.send(right, make_tag(AG, s, c), gathered[blk].numpy())
                    if ag[s] is not None:
                        await ag[s]
                with torch.cuda.stream(side):
                    for s in range(n - 1):
                        a, b = rng(own - s - 1)
                        if b > a:
                            t[a:b].copy_(gathered[(own - s - 1) % n].view(t.dtype), non_blocking=True)
            await copied("host-to-device staging")  # the slot's pinned pieces and its scratch are free after this
            finished[c].set_result(None)

        await gather_fail_fast([chain(c) for c in range(nch)])
    stream.wait_stream(side)  # what the caller queues next sees the result
