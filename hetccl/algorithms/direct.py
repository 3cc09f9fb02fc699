"""Direct (linear) algorithms for personalised exchanges: all_to_all, gather, scatter.

Every byte crosses the network once, which is already optimal for these; receives are posted first and
sends are spread over peers (rank r starts with r+1) to avoid everyone hitting the same rank at once.
"""

from __future__ import annotations

from ..dtypes import Buf
from ..scheduler import CollCtx, await_all, make_tag

A2A, GATHER, SCATTER = 21, 22, 23


async def all_to_all(ctx: CollCtx, out: Buf, inp: Buf) -> None:
    n, r = ctx.size, ctx.rank
    k = inp.count // n
    nb = k * ctx.dtype.itemsize
    out.data[r * nb:(r + 1) * nb] = inp.data[r * nb:(r + 1) * nb]
    if n == 1 or nb == 0:
        return
    recvs = [ctx.recv(p, make_tag(A2A, 0, 0), out.data[p * nb:(p + 1) * nb]) for p in range(n) if p != r]
    sends = [ctx.send((r + i) % n, make_tag(A2A, 0, 0), inp.data[((r + i) % n) * nb:((r + i) % n + 1) * nb])
             for i in range(1, n)]
    await await_all(sends + recvs)


async def gather(ctx: CollCtx, out: Buf | None, inp: Buf, root: int) -> None:
    n, r = ctx.size, ctx.rank
    nb = inp.nbytes
    if r == root:
        assert out is not None
        out.data[r * nb:(r + 1) * nb] = inp.data
        if nb:
            await await_all([ctx.recv(p, make_tag(GATHER, 0, 0), out.data[p * nb:(p + 1) * nb])
                                    for p in range(n) if p != r])
    elif nb:
        await ctx.send(root, make_tag(GATHER, 0, 0), inp.data)


async def scatter(ctx: CollCtx, out: Buf, inp: Buf | None, root: int) -> None:
    n, r = ctx.size, ctx.rank
    nb = out.nbytes
    if r == root:
        assert inp is not None
        out.data[:] = inp.data[r * nb:(r + 1) * nb]
        if nb:
            await await_all([ctx.send((r + i) % n, make_tag(SCATTER, 0, 0),
                                             inp.data[((r + i) % n) * nb:((r + i) % n + 1) * nb])
                                    for i in range(1, n)])
    elif nb:
        await ctx.recv(root, make_tag(SCATTER, 0, 0), out.data)
