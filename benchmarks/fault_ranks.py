"""Rank bodies of the reliability scripts (run inside rank processes started by rankproc.Job.spawn).

Each reports to the driver with rankproc.emit (one JSON line on stdout) and ends the process itself.
"""

from __future__ import annotations

import asyncio
import os

import hetccl
import numpy as np

from rankproc import emit, fd_count, rss_kib


def _ports(comm: hetccl.Communicator) -> dict[str, object]:
    fab = comm._fabric
    rec = fab.records[comm.rank]["transports"]
    return {"job": fab.job, "pid": os.getpid(), "tcp_port": rec.get("tcp", {}).get("port"),
            "peer_transport": {str(k): v for k, v in fab.peer_transport.items()}}


async def _close_and_exit(comm: hetccl.Communicator, code: int) -> None:
    try:
        await asyncio.wait_for(comm.close(), 20)
        emit("closed")
    except BaseException as exc:  # noqa: BLE001 - report, then exit anyway
        emit("close_failed", error=repr(exc))
    os._exit(code)


async def loop_until_error(comm: hetccl.Communicator, count: int = 4 << 20, stuck_rank: int = -1,
                           stuck_after: int = 0, max_s: float = 120.0) -> None:
    """Large all_reduces (checked) until one raises a HetcclError: report it, close, exit 0.
    `stuck_rank` stops calling collectives after `stuck_after` iterations but stays alive."""
    n, r = comm.size, comm.rank
    buf = np.ones(count, np.float32)
    i = 0
    t0 = asyncio.get_running_loop().time()
    try:
        while asyncio.get_running_loop().time() - t0 < max_s:
            if r == stuck_rank and i == stuck_after:
                emit("stuck", iteration=i)
                await asyncio.sleep(3600)
            buf.fill(1.0)
            await comm.all_reduce(buf)
            if buf[0] != n or buf[-1] != n or buf[count // 2] != n:
                emit("wrong", iteration=i, got=float(buf[0]))
                os._exit(9)
            i += 1
            if i == 1:
                emit("ready", **_ports(comm))
    except hetccl.HetcclError as exc:
        emit("error", cls=type(exc).__name__, exc_rank=getattr(exc, "rank", None), iteration=i,
             msg=str(exc)[:300])
        await _close_and_exit(comm, 0)
    emit("no_error", iteration=i)
    os._exit(5)


SOAK_COUNTS = [0, 1, 7, 1000, 4099, 65_537, 300_000]


async def soak(comm: hetccl.Communicator, duration_s: float, seed: int = 0) -> None:
    """Mixed, checked collectives until rank 0 says stop (after duration_s): every collective x dtype x op
    at a size drawn per round (tests/workers.py:matrix), split sub-communicators created, used and closed,
    point-to-point, many collectives in flight at once. The same seed on every rank: the same rounds."""
    import random
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import workers

    rng = random.Random(seed)
    r, n = comm.rank, comm.size
    flag = np.zeros(1, np.int32)
    t0 = asyncio.get_running_loop().time()
    rounds = 0
    emit("ready", **_ports(comm))
    while True:
        flag[0] = int(asyncio.get_running_loop().time() - t0 < duration_s) if r == 0 else 0
        await comm.broadcast(flag, root=0)
        if not flag[0]:
            break
        dtype = workers.DTYPES[rounds % len(workers.DTYPES)]
        await workers.matrix(comm, [rng.choice(SOAK_COUNTS)], [dtype])
        sub = await comm.split(rng.randrange(2) if n > 2 else 0, key=-r)
        buf = np.full(1 + rng.randrange(100_000), r + 1, np.float64)
        await sub.all_reduce(buf)
        await sub.close()
        await workers.p2p(comm)
        await workers.concurrent(comm, k=4)
        rounds += 1
        # RSS and open fds between rounds, when the round's buffers are freed and its sub-communicator closed:
        # what a leak raises, without the transient peaks that the driver's samples from outside catch at random
        # moments (a round opens files and sockets while it runs)
        emit("round", rounds=rounds, rss=rss_kib(os.getpid()), fds=fd_count(os.getpid()))
    emit("done", rounds=rounds)
    await _close_and_exit(comm, 0)


async def busy_until_stopped(comm: hetccl.Communicator, stopfile: str, count: int = 1 << 18) -> None:
    """Checked all_reduces and all_gathers plus store round trips until `stopfile` exists (rank 0 decides,
    a broadcast tells the others), while something else attacks the job's ports. Reports iterations and,
    on rank 0, the listeners' `refused` counters."""
    n, r = comm.size, comm.rank
    fab = comm._fabric
    flag = np.zeros(1, np.int32)
    buf = np.empty(count, np.float32)
    out = np.empty(n * 1000, np.int64)
    i = 0
    emit("ready", **_ports(comm))
    while True:
        flag[0] = int(not os.path.exists(stopfile)) if r == 0 else 0
        await comm.broadcast(flag, root=0)
        if not flag[0]:
            break
        buf.fill(r + 1 + i % 3)
        await comm.all_reduce(buf)
        want = sum(p + 1 + i % 3 for p in range(n))
        await comm.all_gather(out, np.full(1000, r * 7 + i, np.int64))
        if buf[0] != want or buf[-1] != want or any(out[p * 1000] != p * 7 + i for p in range(n)):
            emit("wrong", iteration=i)
            os._exit(9)
        if i % 10 == 0:  # the store still serves the job
            await fab.store.set(f"{fab.job}/busy/{r}", i)
            assert await fab.store.get(f"{fab.job}/busy/{r}", 5.0) == i
        i += 1
        if i % 50 == 0:
            emit("progress", iterations=i)
    refused = {"store": fab.server.refused if fab.server else None,
               **{t.name: getattr(t, "refused", None) for t in fab.transports}}
    emit("done", iterations=i, refused=refused)
    await _close_and_exit(comm, 0)
