"""Latency algorithms for small messages: recursive doubling, binomial trees, direct exchanges.

They take log2(n) (or one) rounds instead of the ring's 2(n-1), at the price of moving more bytes.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import Buf
from ..scheduler import CollCtx, await_all, block_ranges, make_tag

RDBL, BCAST, REDUCE, AG, RS, BARRIER = 11, 12, 13, 14, 15, 16
_EMPTY = np.empty(0, np.uint8)


async def all_reduce(ctx: CollCtx, buf: Buf) -> None:
    """Recursive doubling; non-power-of-two sizes fold the extra ranks in first and out at the end.

    Each round sends this rank's partial result, then reduces the partner's straight into it (the receive
    is posted only once the send has completed, so the partner gets the value from before the round). Both
    partners combine the same two operands in the same order, so results stay bitwise identical."""
    n, r = ctx.size, ctx.rank
    if n > 1 and buf.count:
        data = buf.data
        p = 1 << (n.bit_length() - 1)
        rem = n - p
        # fold: among the first 2*rem ranks, even ones hand their data to the next odd one and wait
        if r < 2 * rem:
            if r % 2 == 0:
                await ctx.send(r + 1, make_tag(RDBL, 0, 0), data)
                await ctx.recv(r + 1, make_tag(RDBL, 99, 0), data)
                ctx.finish_avg(buf)
                return
            await ctx.recv(r - 1, make_tag(RDBL, 0, 0), data, reduce=True)
            vr = r // 2
        else:
            vr = r - rem
        mask, step = 1, 1
        while mask < p:
            vpeer = vr ^ mask
            peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
            await ctx.send(peer, make_tag(RDBL, step, 0), data)
            # both partners compute lower OP higher: bitwise equal even where the op breaks ties by position
            await ctx.recv(peer, make_tag(RDBL, step, 0), data, reduce=True, incoming_first=vpeer < vr)
            mask <<= 1
            step += 1
        if r < 2 * rem:
            await ctx.send(r - 1, make_tag(RDBL, 99, 0), data)
    ctx.finish_avg(buf)


def _binomial(n: int, rel: int) -> tuple[int | None, list[int]]:
    """Parent and children of relative rank `rel` in a binomial tree rooted at 0."""
    parent, children = None, []
    mask = 1
    while mask < n:
        if rel & mask:
            parent = rel - mask
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rel + mask < n:
            children.append(rel + mask)
        mask >>= 1
    return parent, children


async def broadcast(ctx: CollCtx, buf: Buf, root: int) -> None:
    n, r = ctx.size, ctx.rank
    if n == 1 or buf.count == 0:
        return
    rel = (r - root) % n
    parent, children = _binomial(n, rel)
    if parent is not None:
        await ctx.recv((parent + root) % n, make_tag(BCAST, 0, 0), buf.data)
    await await_all([ctx.send((c + root) % n, make_tag(BCAST, 0, 0), buf.data) for c in children])


async def reduce(ctx: CollCtx, buf: Buf, root: int, scratch: np.ndarray | None, tmp: np.ndarray) -> None:
    """Binomial tree towards root; non-roots accumulate in scratch (a copy of their data)."""
    n, r = ctx.size, ctx.rank
    if n > 1 and buf.count:
        rel = (r - root) % n
        parent, children = _binomial(n, rel)
        acc = buf.data if r == root else scratch
        assert acc is not None
        for c in reversed(children):  # smallest subtree first: it is ready first
            await ctx.recv((c + root) % n, make_tag(REDUCE, 0, 0), tmp)
            ctx.reducer(acc, tmp)
        if parent is not None:
            await ctx.send((parent + root) % n, make_tag(REDUCE, 0, 0), acc)
    if r == root:
        ctx.finish_avg(buf)


async def all_gather(ctx: CollCtx, out: Buf) -> None:
    """Direct: one round, every rank sends its block to every other rank. out holds our block already."""
    n, r = ctx.size, ctx.rank
    if n == 1 or out.count == 0:
        return
    isz = ctx.dtype.itemsize
    blocks = block_ranges(out.count, n)
    views = [out.data[a * isz: b * isz] for a, b in blocks]
    recvs = [ctx.recv(p, make_tag(AG, 0, 0), views[p]) for p in range(n) if p != r]
    await await_all([ctx.send((r + i) % n, make_tag(AG, 0, 0), views[r]) for i in range(1, n)]
                           + recvs)


async def reduce_scatter(ctx: CollCtx, out: Buf, inp: Buf, tmp: np.ndarray) -> None:
    """Direct: every rank sends block p of its input to rank p; rank p reduces in rank order."""
    n, r = ctx.size, ctx.rank
    isz = ctx.dtype.itemsize
    blocks = block_ranges(inp.count, n)
    a, b = blocks[r]
    nb = (b - a) * isz
    slots = [tmp[i * nb:(i + 1) * nb] for i in range(n)]
    recvs = {p: ctx.recv(p, make_tag(RS, 0, 0), slots[p]) for p in range(n) if p != r and nb}
    sends = []
    for i in range(1, n):
        p = (r + i) % n
        pa, pb = blocks[p]
        if pb > pa:
            sends.append(ctx.send(p, make_tag(RS, 0, 0), inp.data[pa * isz: pb * isz]))
    await await_all(sends + list(recvs.values()))
    if nb:
        slots[r][:] = inp.data[a * isz: b * isz]
        out.data[:] = slots[0]
        for p in range(1, n):
            ctx.reducer(out.data, slots[p])
    ctx.finish_avg(out)


async def barrier(ctx: CollCtx) -> None:
    """Dissemination barrier: ceil(log2 n) rounds of empty messages."""
    n, r = ctx.size, ctx.rank
    k, step = 1, 0
    while k < n:
        fut = ctx.recv((r - k) % n, make_tag(BARRIER, step, 0), _EMPTY)
        await ctx.send((r + k) % n, make_tag(BARRIER, step, 0), _EMPTY)
        await fut
        k <<= 1
        step += 1
