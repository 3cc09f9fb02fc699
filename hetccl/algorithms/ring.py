"""Ring algorithms (bandwidth-optimal): every rank sends and receives (n-1)/n of the data per phase.

Each block is cut into chunks and every chunk runs through all the steps on its own task, so chunks at
different steps overlap (a pipelined ring). All receives are posted before the first send: reduce-scatter
receives reduce straight into the block they belong to (each block is reduced exactly once per rank, and
only after it was sent), all-gather receives land in place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from .. import observe as _obs
from ..dtypes import Buf
from ..scheduler import CollCtx, block_ranges, chunk_ranges, gather_fail_fast, make_tag

RS, AG, BC, RD = 1, 2, 3, 4


def _layout(ctx: CollCtx, count: int) -> tuple[list[tuple[int, int]], int]:
    blocks = block_ranges(count, ctx.size)
    nch = ctx.num_chunks(blocks[0][1] - blocks[0][0])
    return blocks, nch


async def ring_reduce_scatter_allgather(ctx: CollCtx, data: np.ndarray | None, count: int, do_rs: bool,
                                        do_ag: bool, owned_shift: int = 1,
                                        home: Callable[[int], tuple[np.ndarray, int]] | None = None,
                                        first: np.ndarray | None = None) -> None:
    """In-place ring over `data` (count elements): reduce-scatter and/or all-gather phases.

    After the reduce-scatter phase rank r owns the reduced block (r + owned_shift) % n; the all-gather phase
    starts from that ownership. all_reduce uses shift 1 (the classic ring); reduce_scatter/all_gather use 0.
    `home(block)`, where given, says where a block lives instead of `data`: (array, its first element).
    `first`, where given, is the input laid out as the blocks are: a received block is reduced with its part
    of `first` into its home (home = first OP incoming), whose old content is never read.
    """
    n, r = ctx.size, ctx.rank
    if n == 1 or count == 0:
        return
    isz = ctx.dtype.itemsize
    blocks, nch = _layout(ctx, count)
    right, left = (r + 1) % n, (r - 1) % n
    base = owned_shift - 1  # block index offset so that the last RS step lands on the owned block

    def view(block: int, chunk: int) -> np.ndarray:
        a, b = chunk_ranges(*blocks[block % n], nch)[chunk]
        arr, lo = home(block % n) if home is not None else (data, 0)
        return arr[(a - lo) * isz: (b - lo) * isz]

    def first_of(block: int, chunk: int) -> np.ndarray | None:
        if first is None:
            return None
        a, b = chunk_ranges(*blocks[block % n], nch)[chunk]
        return first[a * isz: b * isz]

    # post every receive up front
    rs_recv = {}
    ag_recv = {}
    for c in range(nch):
        if do_rs:
            for s in range(n - 1):
                dst = view(r + base - s - 1, c)
                rs_recv[s, c] = ctx.recv(left, make_tag(RS, s, c), dst, reduce=True,
                                         first=first_of(r + base - s - 1, c)) if len(dst) else None
        if do_ag:
            for s in range(n - 1):
                dst = view(r + base + 1 - s - 1, c)
                ag_recv[s, c] = ctx.recv(left, make_tag(AG, s, c), dst) if len(dst) else None

    async def chunk_chain(c: int) -> None:
        if do_rs:
            for s in range(n - 1):
                if s > 0 and rs_recv[s - 1, c] is not None:
                    await rs_recv[s - 1, c]
                src = view(r + base - s, c)
                if len(src):
                    await ctx.send(right, make_tag(RS, s, c), src)
            if rs_recv[n - 2, c] is not None:
                await rs_recv[n - 2, c]
        if do_ag:
            for s in range(n - 1):
                if s > 0 and ag_recv[s - 1, c] is not None:
                    await ag_recv[s - 1, c]
                src = view(r + base + 1 - s, c)
                if len(src):
                    await ctx.send(right, make_tag(AG, s, c), src)
            if ag_recv[n - 2, c] is not None:
                await ag_recv[n - 2, c]

    chains = [chunk_chain(c) for c in range(nch)]
    await gather_fail_fast(_obs.chunks(ctx, chains) if _obs.ON else chains)


async def all_reduce(ctx: CollCtx, buf: Buf) -> None:
    await ring_reduce_scatter_allgather(ctx, buf.data, buf.count, True, True, owned_shift=1)
    ctx.finish_avg(buf)


async def reduce_scatter(ctx: CollCtx, out: Buf, inp: Buf, scratch: np.ndarray) -> None:
    """Rank r ends with block r reduced, in out; inp is only read and nothing is copied. Block r - 1 is sent from
    inp as it is (no rank sends it on reduced); every block a rank receives is reduced with its part of inp
    straight into its home: block r into out, the blocks it forwards (n - 2) into scratch."""
    n, r = ctx.size, ctx.rank
    if n == 1:
        out.data[:] = inp.data
        return
    first = block_ranges(inp.count, n)[r][0]

    def home(block: int) -> tuple[np.ndarray, int]:
        if block == r:
            return out.data, first
        return (inp.data, 0) if block == (r - 1) % n else (scratch, 0)

    await ring_reduce_scatter_allgather(ctx, None, inp.count, True, False, owned_shift=0, home=home,
                                        first=inp.data)
    ctx.finish_avg(out)


async def all_gather(ctx: CollCtx, out: Buf) -> None:
    """out already holds this rank's block at position rank."""
    await ring_reduce_scatter_allgather(ctx, out.data, out.count, False, True, owned_shift=0)


async def broadcast(ctx: CollCtx, buf: Buf, root: int) -> None:
    """Pipelined chain root -> root+1 -> ... -> root-1, chunk by chunk."""
    n, r = ctx.size, ctx.rank
    if n == 1 or buf.count == 0:
        return
    isz = ctx.dtype.itemsize
    nch = ctx.num_chunks(buf.count)
    pos = (r - root) % n
    nxt, prv = (r + 1) % n, (r - 1) % n
    views = [buf.data[a * isz: b * isz] for a, b in chunk_ranges(0, buf.count, nch)]
    recvs = [ctx.recv(prv, make_tag(BC, 0, c), v) if pos and len(v) else None for c, v in enumerate(views)]

    async def chain(c: int) -> None:
        if recvs[c] is not None:
            await recvs[c]
        if pos < n - 1 and len(views[c]):
            await ctx.send(nxt, make_tag(BC, 0, c), views[c])

    chains = [chain(c) for c in range(nch)]
    await gather_fail_fast(_obs.chunks(ctx, chains) if _obs.ON else chains)


async def reduce(ctx: CollCtx, buf: Buf, root: int, scratch: np.ndarray | None) -> None:
    """Pipelined chain root+1 -> ... -> root: each rank adds its part and forwards; only root is written.
    Non-root ranks accumulate in `scratch` (a copy of their buffer)."""
    n, r = ctx.size, ctx.rank
    if n == 1 or buf.count == 0:
        ctx.finish_avg(buf) if r == root else None
        return
    isz = ctx.dtype.itemsize
    nch = ctx.num_chunks(buf.count)
    pos = (r - root - 1) % n  # root is last (pos n-1)
    nxt, prv = (r + 1) % n, (r - 1) % n
    acc = buf.data if r == root else scratch
    assert acc is not None
    views = [acc[a * isz: b * isz] for a, b in chunk_ranges(0, buf.count, nch)]
    recvs = [ctx.recv(prv, make_tag(RD, 0, c), v, reduce=True) if pos and len(v) else None
             for c, v in enumerate(views)]

    async def chain(c: int) -> None:
        if recvs[c] is not None:
            await recvs[c]
        if pos < n - 1 and len(views[c]):
            await ctx.send(nxt, make_tag(RD, 0, c), views[c])

    chains = [chain(c) for c in range(nch)]
    await gather_fail_fast(_obs.chunks(ctx, chains) if _obs.ON else chains)
    if r == root:
        ctx.finish_avg(buf)


__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "asyncio"]
