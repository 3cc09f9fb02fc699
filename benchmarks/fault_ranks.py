"""Rank bodies of the reliability scripts (run inside rank processes started by rankproc.Job.spawn).

Each reports to the driver with rankproc.emit (one JSON line on stdout) and ends the process itself.
"""

from __future__ import annotations

import asyncio
import os

import hetccl
import numpy as np

from rankproc import emit


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
