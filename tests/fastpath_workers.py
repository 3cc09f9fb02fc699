"""Rank functions for test_fastpath.py (see rankrun.py): the small-message fast path (hetccl/fastpath.py)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np
from workers import DTYPES, OPS, check, expected_reduce, make, np_dtype

import hetccl

LIMIT = 4096  # the tests run with HETCCL_SHM_FASTPATH_BYTES=4096 and HETCCL_SHM_PIECE_BYTES=4096


def _fast_ops(comm: hetccl.Communicator) -> int:
    assert comm._fast is not None, "this group should have a fast path"
    return comm._fast.k


def _pieces(comm: hetccl.Communicator, nbytes: int, count: int, piece: int) -> int:
    """Fast operations of a reduce_scatter or all_gather of an input of `nbytes` whose pieces cut `count` (a block,
    an input) into at most `piece`: one up to the limit, else one per piece, an even number; none past
    fastpath.PIECED_MAX_RANKS (the transports)."""
    if nbytes <= comm._fast.limit:
        return 1
    pieces = -(-count // max(1, piece))
    return pieces + (pieces & 1) if comm._fast.pieces else 0  # numbers taken in pairs (FastPath._in_pieces)


def _check_path(comm: hetccl.Communicator) -> None:
    """The large all_reduce's path that the set-up agreed on is the one the test asked for (TEST_SINGLE_COPY)."""
    fast = comm._fast
    want = os.environ.get("TEST_SINGLE_COPY") == "1"
    assert fast is not None and fast.ready and fast.single_copy == (want and fast.pieces), (fast.single_copy, want)


async def every_dtype_and_op(comm: hetccl.Communicator) -> None:
    """Every dtype and op of all_reduce and reduce_scatter, all_gather, broadcast from every root and barrier,
    at the limit (fast) and just above it (all_reduce, reduce_scatter and all_gather: the fast path in pieces, or
    the single copy; the others: the transports): same results either way."""
    n, r = comm.size, comm.rank
    for dtype in DTYPES:
        isz = np_dtype(dtype).itemsize
        limit, piece = comm._fast.limit // isz, comm._fast.piece_bytes // isz
        for count in sorted({1, 7, limit, limit + 1, piece, piece + 1, 3 * piece + 5}):
            for op in OPS:
                before = _fast_ops(comm)
                buf = make(r, count, dtype, salt=3)
                await comm.all_reduce(buf, op=op)
                check(buf, expected_reduce(n, count, dtype, op, salt=3), f"all_reduce {dtype} {op} x{count}")
                # one fast operation, or two per piece (reduce-scatter, all-gather; the single copy takes the same
                # numbers and uses the first two); past fastpath.PIECED_MAX_RANKS, above the limit: the transports
                steps = 1 if count <= limit else 2 * -(-count // piece) if comm._fast.pieces else 0
                assert _fast_ops(comm) - before == steps, (dtype, op, count, before, _fast_ops(comm))
            # reduce_scatter: one fast operation for a whole input of at most the limit, else one per piece of every
            # block (a slot holds the piece of each), an even number (the single copy uses the first two)
            k = max(1, count // n)
            for op in ("sum", "max", "avg"):
                before = _fast_ops(comm)
                inp = np.concatenate([make(r, k, dtype, salt=10 + p) for p in range(n)])
                out = np.zeros(k, np_dtype(dtype))
                await comm.reduce_scatter(out, inp, op=op)
                check(out, expected_reduce(n, k, dtype, op, salt=10 + r), f"reduce_scatter {dtype} {op} x{k}")
                assert _fast_ops(comm) - before == _pieces(comm, inp.nbytes, k, piece // n), ("reduce_scatter", k)
            before = _fast_ops(comm)
            mine = make(r, count, dtype, salt=5)
            out = np.zeros(n * count, np_dtype(dtype))
            await comm.all_gather(out, mine)
            for p in range(n):
                check(out[p * count:(p + 1) * count], make(p, count, dtype, salt=5), f"all_gather {dtype} x{count}")
            assert _fast_ops(comm) - before == _pieces(comm, mine.nbytes, count, piece), ("all_gather", dtype, count)
            for root in range(n):
                b = make(r, count, dtype, salt=7) if r == root else np.zeros(count, np_dtype(dtype))
                await comm.broadcast(b, root=root)
                check(b, make(root, count, dtype, salt=7), f"broadcast {dtype} x{count} root {root}")
            await comm.barrier()
    _check_path(comm)
    # in-place all_gather (inp is this rank's block of out) and the sub-groups of a split
    out = np.zeros(n * 8, np.float32)
    out[r * 8:(r + 1) * 8] = r + 1
    await comm.all_gather(out, out[r * 8:(r + 1) * 8])
    check(out, np.repeat(np.arange(1, n + 1, dtype=np.float32), 8), "in-place all_gather")
    sub = await comm.split(r % 2)
    buf = np.ones(16, np.float32)
    await sub.all_reduce(buf)
    check(buf, np.full(16, sub.size, np.float32), "all_reduce of a split")
    if sub.size > 1:
        assert sub._fast is not None and sub._fast.k > 0
    await sub.close()
    os.write(1, f"rank {r} fast ok ({_fast_ops(comm)} fast operations)\n".encode())


async def many_in_flight(comm: hetccl.Communicator) -> None:
    """Many fast and slow collectives issued at once (asyncio.gather): each completes with its own result,
    in order with the others."""
    n, r = comm.size, comm.rank
    for rnd in range(5):
        # small (fast), 4096 floats (16 KiB: the fast path in pieces, or the transports past PIECED_MAX_RANKS) and a
        # broadcast above the limit (the transports), all at once
        bufs = [np.full(16 if i % 3 else 4096, r + i + rnd, np.float32) for i in range(60)]
        big = np.full(3000, rnd if r == 0 else -1, np.float32)
        await asyncio.gather(*(comm.all_reduce(b) for b in bufs[:30]), comm.broadcast(big, root=0),
                             *(comm.all_reduce(b) for b in bufs[30:]), comm.barrier())
        for i, b in enumerate(bufs):
            want = sum(p + i + rnd for p in range(n))
            check(b, np.full(len(b), want, np.float32), f"in flight #{i} round {rnd}")
        check(big, np.full(3000, rnd, np.float32), f"broadcast in flight round {rnd}")
    os.write(1, f"rank {r} in flight ok\n".encode())


async def mismatch(comm: hetccl.Communicator, kind: str) -> None:
    """Rank 1 disagrees on a fast collective (or takes the transports where the others take the fast path):
    every rank raises CollectiveMismatchError, quickly."""
    r = comm.rank
    odd = r == 1
    await comm.all_reduce(np.ones(4, np.float32))  # the fast path is set up
    t0 = time.monotonic()
    try:
        if kind == "count":
            await comm.all_reduce(np.ones(9 if odd else 8, np.float32))
        elif kind == "dtype":
            await comm.all_reduce(np.ones(8, np.float64 if odd else np.float32))
        elif kind == "op":
            await comm.all_reduce(np.ones(8, np.float32), op="max" if odd else "sum")
        elif kind == "collective":
            if odd:
                await comm.broadcast(np.ones(8, np.float32), root=0)
            else:
                await comm.all_reduce(np.ones(8, np.float32))
        elif kind == "pieces":  # rank 1 above the limit: the fast path in pieces, the others in one operation
            await comm.all_reduce(np.ones(LIMIT if odd else 8, np.float32))
        elif kind == "slow":  # rank 1 above the limit: the transports, the others the fast path
            await comm.broadcast(np.ones(LIMIT if odd else 8, np.float32), root=0)
        await comm.barrier()
    except hetccl.CollectiveMismatchError as exc:
        took = time.monotonic() - t0
        assert took < 10, (str(exc), took)
        os.write(1, f"mismatch ok rank {r} ({took:.2f} s): {exc}\n".encode())
        return
    raise AssertionError(f"rank {r}: mismatched collectives ({kind}) completed")


async def die_waiting(comm: hetccl.Communicator, victim: int, count: int = 256) -> None:
    """The victim exits hard while the others wait for it in a fast all_reduce (of `count` floats: in pieces
    above LIMIT // 4): PeerLostError naming it."""
    buf = np.ones(count, np.float32)
    for _ in range(20):
        await comm.all_reduce(buf)
    if comm.rank == victim:
        await asyncio.sleep(0.3)  # the others are asleep in the fast path's wait by now
        os._exit(17)
    await _expect_lost(comm, victim, lambda: comm.all_reduce(buf))


async def _expect_lost(comm: hetccl.Communicator, victim: int, run: Any) -> None:
    """Await run(): exit 0 on a PeerLostError naming the victim within 10 s, and a close within 5 s after it;
    non-zero on anything else."""
    t0 = time.monotonic()
    try:
        await run()
    except hetccl.PeerLostError as exc:
        took = time.monotonic() - t0
        assert took < 10, f"took {took:.1f} s"
        print(f"rank {comm.rank}: PeerLostError rank={exc.rank} after {took:.2f} s: {exc}", flush=True)
        t1 = time.monotonic()
        await comm.close()  # the loss is known: no closing barrier that waits for the dead rank
        closing = time.monotonic() - t1
        assert closing < 5, f"close took {closing:.1f} s"
        await asyncio.sleep(1)
        os._exit(0 if exc.rank in (victim, -1) else 3)
    except hetccl.HetcclError as exc:
        print(f"rank {comm.rank}: other error {exc!r}", flush=True)
        os._exit(4)
    os._exit(5)


async def large_all_reduces(comm: hetccl.Communicator) -> None:
    """All_reduces above the limit (one piece and a half, and 3 pieces + 5), sum and avg, on the path that the set-up
    agreed on (TEST_SINGLE_COPY)."""
    n, r = comm.size, comm.rank
    for count in (LIMIT // 4 * 3 // 2, 3 * LIMIT // 4 + 5):
        for op in ("sum", "avg"):
            buf = make(r, count, "float32", salt=4)
            await comm.all_reduce(buf, op=op)
            check(buf, expected_reduce(n, count, "float32", op, salt=4), f"all_reduce {op} x{count}")
    _check_path(comm)
    os.write(1, f"rank {r} large ok (single copy: {comm._fast.single_copy})\n".encode())


async def die_in_copy(comm: hetccl.Communicator, victim: int, op: str = "all_reduce") -> None:
    """The victim exits hard, from a timer thread, while every rank runs 32 MiB collectives `op` (all_reduce,
    reduce_scatter or all_gather: the single copy): the others raise PeerLostError naming it."""
    import threading

    n = comm.size
    part = np.ones((8 << 20) // n, np.float32)
    buf = np.ones(part.size * n, np.float32)
    run = {"all_reduce": lambda: comm.all_reduce(buf), "reduce_scatter": lambda: comm.reduce_scatter(part, buf),
           "all_gather": lambda: comm.all_gather(buf, part)}[op]
    await run()
    _check_path(comm)
    if comm.rank == victim:  # the main thread is in C then, nearly always (the copy releases the GIL)
        threading.Timer(0.2, os._exit, (17,)).start()

    async def many() -> None:
        for _ in range(1000):
            await run()

    await _expect_lost(comm, victim, many)


async def late_rank_times_out(comm: hetccl.Communicator, count: int = 8) -> None:
    """Rank 1 arrives after the timeout: rank 0's fast all_reduce (of `count` floats) raises CollectiveTimeout
    naming it. Where rank 0 left a single copy, rank 1's all_reduce then stops before writing into rank 0's
    buffer (rank 0 stays alive and checks it) and raises its own CollectiveTimeout."""
    buf = np.ones(count, np.float32)
    await comm.all_reduce(buf)
    single = comm._fast.single_copy and count * 4 > comm._fast.limit
    if comm.rank == 1:
        await asyncio.sleep(6)
        if single:
            t0 = time.monotonic()
            try:
                await comm.all_reduce(buf)
            except hetccl.CollectiveTimeout as exc:
                took = time.monotonic() - t0
                assert 2.5 < took < 9, (took, str(exc))
                os.write(1, f"late rank timeout ok ({took:.2f} s): {exc}\n".encode())
                return
            raise AssertionError("rank 1's all_reduce completed after rank 0 left it")
        os.write(1, b"late rank done\n")
        return
    before = buf.copy()
    t0 = time.monotonic()
    try:
        await comm.all_reduce(buf)
    except hetccl.CollectiveTimeout as exc:
        took = time.monotonic() - t0
        assert 2.5 < took < 9 and "all_reduce" in str(exc), (took, str(exc))
        os.write(1, f"timeout ok ({took:.2f} s): {exc}\n".encode())
        if single:  # alive past rank 1's attempt, which must not write here
            await asyncio.sleep(8)
            check(buf, before, "rank 0's buffer after it left the single copy")
            os.write(1, b"untouched ok\n")
        return
    raise AssertionError("the all_reduce completed without rank 1")


async def fast_off(comm: hetccl.Communicator) -> None:
    """HETCCL_SHM_FASTPATH_BYTES=0, or no shared memory between the ranks: no fast path, same results."""
    assert comm._fast is None
    buf = np.ones(8, np.float32)
    await comm.all_reduce(buf)
    check(buf, np.full(8, comm.size, np.float32), "all_reduce without the fast path")
    os.write(1, f"rank {comm.rank} off ok\n".encode())
