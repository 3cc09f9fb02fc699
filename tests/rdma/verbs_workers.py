"""Functions that run inside rank processes in the soft-RoCE guest (see tests/rdma/test_verbs.py)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
from workers import check, still_works

import hetccl


async def transport_is_verbs(comm: hetccl.Communicator) -> None:
    """Every peer is reached over verbs (not a silent fallback to another transport)."""
    fab = comm._fabric
    kinds = {p: fab.peer_transport[p] for p in fab.peer_transport}
    assert set(kinds.values()) == {"verbs"}, kinds
    t = next(t for t in fab.transports if t.name == "verbs")
    print(f"rank {comm.rank}: verbs on {t.dev.name} gid[{t.dev.gid_index}]={t.dev.gid}", flush=True)
    # memory registration: host memory through the cache (same owner -> same registration) ...
    arr = np.ones(1 << 16, np.float32)
    reg = t.register_memory(arr)
    assert reg is not None and reg.mr.lkey and t.register_memory(arr[100:200]) is reg
    # ... and device memory through dma-buf, which the guest cannot do: None (staging), said once in the log
    assert t.register_memory(_FakeCudaArray()) is None and t._gpu_warned


class _FakeCudaArray:
    def __init__(self) -> None:
        self.__cuda_array_interface__ = {"shape": (1024,), "typestr": "<f4", "data": (1 << 40, False),
                                         "version": 3}


async def big(comm: hetccl.Communicator, count: int = 1 << 20) -> None:
    """Large buffers: many fragments per message, credits running out and coming back, registered user
    memory (zero-copy sends) and bounce buffers, reductions out of the receive slots."""
    await transport_is_verbs(comm)
    n, r = comm.size, comm.rank
    buf = np.arange(count, dtype=np.float32) % 251 + r
    await comm.all_reduce(buf)
    check(buf, (np.arange(count, dtype=np.float32) % 251) * n + n * (n - 1) / 2, f"rank {r} big all_reduce")
    out = np.zeros(n * count, np.int32)
    await comm.all_gather(out, np.full(count, r, np.int32))
    check(out, np.repeat(np.arange(n, dtype=np.int32), count), f"rank {r} big all_gather")
    b = np.full(count, r, np.float64)
    await comm.broadcast(b, root=n - 1)
    check(b, np.full(count, n - 1, np.float64), f"rank {r} big broadcast")
    # one message far larger than the receive ring, with receives posted late (early-buffer path)
    if n >= 2 and r < 2:
        peer = 1 - r
        src = np.arange(3 * count + 5, dtype=np.int64) * (r + 1)
        dst = np.zeros_like(src)
        if r == 0:
            await comm.send(src, peer)
            await asyncio.sleep(0.5)
            await comm.recv(dst, peer)
        else:
            await asyncio.sleep(0.5)
            await comm.recv(dst, peer)
            await comm.send(src, peer)
        check(dst, np.arange(3 * count + 5, dtype=np.int64) * (peer + 1), f"rank {r} big send/recv")
    await comm.barrier()


async def die_midway(comm: hetccl.Communicator, victim: int, count: int = 1 << 18) -> None:
    """The victim exits hard after the first all_reduce; survivors must raise PeerLostError naming it."""
    buf = np.ones(count, np.float32)
    t0 = time.monotonic()
    try:
        await comm.all_reduce(buf)
        if comm.rank == victim:
            os._exit(17)
        t0 = time.monotonic()
        for _ in range(200):
            await comm.all_reduce(buf)
    except hetccl.PeerLostError as exc:
        took = time.monotonic() - t0
        print(f"rank {comm.rank}: PeerLostError rank={exc.rank} after {took:.1f} s: {exc}", flush=True)
        await asyncio.sleep(3)
        os._exit(0 if exc.rank in (victim, -1) and took < 30 else 3)
    except hetccl.HetcclError as exc:
        print(f"rank {comm.rank}: other error {exc!r}", flush=True)
        os._exit(4)
    os._exit(5)


async def bandwidth(comm: hetccl.Communicator, sizes: list[int], iters: int = 5) -> None:
    """Point-to-point bandwidth rank 0 -> rank 1 (ping-pong halves), printed as one JSON line by rank 0."""
    results = []
    for size in sizes:
        buf = np.ones(size, np.uint8)
        await comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            if comm.rank == 0:
                await comm.send(buf, 1)
                await comm.recv(buf[:1], 1)
            elif comm.rank == 1:
                await comm.recv(buf, 0)
                await comm.send(buf[:1], 0)
        dt = time.perf_counter() - t0
        results.append({"bytes": size, "MBps": round(size * iters / dt / 1e6, 2)})
    if comm.rank == 0:
        print("BW " + json.dumps(results), flush=True)


async def strangers(comm: hetccl.Communicator) -> None:
    """The connection data of a QP is only handed over after the job-secret handshake: connections to rank
    0's verbs listener with a wrong or empty secret, or claiming a rank that is already connected, are
    refused, and the job goes on over the accepted QPs."""
    import socket

    from hetccl.auth import client_handshake
    from hetccl.errors import AuthenticationError, PeerLostError
    from hetccl.netio import read_control

    fab = comm._fabric
    t = next(t for t in fab.transports if t.name == "verbs")
    if comm.rank == 1:
        loop = asyncio.get_running_loop()
        rec = fab.records[0]["transports"]["verbs"]
        for secret in (b"wrong-secret", b"", fab.settings.secret):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, (rec["host"], rec["port"]))
            try:
                await client_handshake(loop, s, secret, "verbs", {"rank": 1, "job": fab.job}, 10.0)
                # right secret, but rank 1 is connected already: the listener must drop us, never send QP data
                got = await asyncio.wait_for(read_control(loop, s, 4096, 0), 10.0)
                raise AssertionError(f"a second connection claiming rank 1 got {got!r}")
            except (AuthenticationError, PeerLostError):
                pass
            finally:
                s.close()
    await still_works(comm, "after strangers")
    if comm.rank == 0:
        assert t.refused == 3, t.refused
        print("refused", t.refused, flush=True)


async def early_buffer_full(comm: hetccl.Communicator, count: int = 1 << 18) -> None:
    """Rank 0 sends three 2 MiB messages before rank 1 posts any receive, with rank 1's early buffer cut to
    1 MiB: the first is kept as early data, the second finds no room and holds its receive slots (rank 0 runs
    out of credits and waits), and everything flows once rank 1 posts its receives."""
    for ep in comm._fabric.endpoints.values():
        ep.matcher.cap = 1 << 20
    msgs = [np.arange(count, dtype=np.int64) * (i + 1) for i in range(3)]
    if comm.rank == 0:
        await asyncio.gather(*(comm.send(m, 1) for m in msgs))
    elif comm.rank == 1:
        await asyncio.sleep(2.0)
        ep = comm._fabric.endpoints[0]
        assert ep.blocked and ep.matcher.early, "the second message should be held up"
        outs = [np.zeros(count, np.int64) for _ in range(3)]
        await asyncio.gather(*(comm.recv(o, 0) for o in outs))
        for i, (o, m) in enumerate(zip(outs, msgs, strict=True)):
            check(o, m, f"message {i} after the early buffer filled up")
        print("early buffer ok", flush=True)
    await comm.barrier()
