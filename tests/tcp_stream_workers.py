"""Rank functions for tests/test_tcp_streams.py: collectives and point-to-point traffic whose messages are cut
across several TCP connections per peer pair, checked against numpy."""

from __future__ import annotations

import asyncio

import numpy as np
from workers import check, expected_reduce, make

import hetccl

# element counts whose byte sizes divide neither by the number of streams nor by the fragment alignment
ODD_COUNTS = (1, 1023, 65_537, 300_001, 1_048_579)


async def streams_mix(comm: hetccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    for dtype, op in (("float32", "sum"), ("int32", "max"), ("float64", "prod"), ("bfloat16", "sum")):
        for count in ODD_COUNTS:
            buf = make(r, count, dtype)
            await comm.all_reduce(buf, op=op)
            check(buf, expected_reduce(n, count, dtype, op), f"all_reduce {dtype} {op} count={count}")
    for count in ODD_COUNTS[2:]:
        out = np.zeros(n * count, np.float32)
        await comm.all_gather(out, make(r, count, "float32"))
        check(out, np.concatenate([make(p, count, "float32") for p in range(n)]), f"all_gather count={count}")

    # many messages in flight at once: all_reduces of different sizes and a ring of point-to-point messages
    bufs = [make(r, 200_003 + 4099 * i, "float32", salt=i) for i in range(8)]
    right, left = (r + 1) % n, (r - 1) % n
    outs = [np.arange(400_001 + i, dtype=np.int32) * (r + 1) for i in range(4)]
    gots = [np.zeros(400_001 + i, np.int32) for i in range(4)]
    await asyncio.gather(*(comm.all_reduce(b) for b in bufs), *(comm.send(o, right) for o in outs),
                         *(comm.recv(g, left) for g in gots))
    for i, b in enumerate(bufs):
        check(b, expected_reduce(n, len(b), "float32", "sum", salt=i), f"concurrent all_reduce {i}")
    for i, g in enumerate(gots):
        check(g, np.arange(400_001 + i, dtype=np.int32) * (left + 1), f"concurrent p2p {i}")

    # a large message that arrives before its receive is posted (reassembled in the early buffer)
    big = 5 * (1 << 20) + 3
    if r == 0:
        await comm.send(np.arange(big, dtype=np.uint64).astype(np.uint8), 1)
    elif r == 1:
        await asyncio.sleep(0.5)
        got = np.zeros(big, np.uint8)
        await comm.recv(got, 0)
        check(got, np.arange(big, dtype=np.uint64).astype(np.uint8), "early large p2p")
    await comm.barrier()
