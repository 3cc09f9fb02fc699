"""The records tree: how every rank's bootstrap record reaches every rank without the store sending N records to
each of N ranks (issue 32 item 2: at 8,192 ranks that was about 32 GB out of one process).

Rank 0 alone gathers the N records from the store (one answer), then pushes them down a tree of ranks with
RECORDS_TREE_FANOUT children each, heap-numbered (rank r's children are r*K+1 .. r*K+K): a rank that receives the
records forwards the same bytes to its children, then uses them. Each push is one short-lived TCP connection from a
parent to a child's `RecordsInbox`, which listens on the rank's bind address (the transports' address; port 0) and
publishes that address in the rank's record. The connection passes the HMAC handshake of every hetccl connection
(auth.py, purpose "records") and carries one frame: a 4-byte length, checked against a bound made from the world
size before anything is read, then a msgpack map {"records": [...]} decoded with the control plane's limits.

Nothing here may hang or be less reliable than the store: a rank that has not received the records within
RECORDS_TREE_HOP_S per hop above it (`records_wait`) of the last rank's arrival reads them from the store
(bootstrap.py), and a parent that cannot reach a child pushes to that child's children instead (their new parent),
so one lost rank costs the store one extra gather, not one per rank below it. Like NCCL's bootstrap, connections
are made when needed and dropped after; unlike its ring (N steps of one record), the tree takes log_K(N) steps of
all of them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable
from typing import Any

from .auth import client_handshake, server_handshake
from .errors import AuthenticationError, HetcclError, ProtocolError
from .netio import accept_each, keep_task, recv_exact, send_all, tune_socket
from .store import MAX_STORE_FRAME
from .wire import CONTROL_LEN, control_length, decode_control_body, encode_control

log = logging.getLogger("hetccl")

PURPOSE = "records"  # the handshake's purpose: a store or data connection's transcript is not valid here
# children per rank: depth log_4(N) (7 at 8,192 ranks), and a parent sends the records 4 times (a constant)
RECORDS_TREE_FANOUT = 4
# one rank's record, encoded, at most: about 600 bytes measured with tcp and shm (2026-12-06); room for plugins.
# A frame of N records is refused above N times this (and above the store's own frame bound, which the gather of
# the same records had to pass at rank 0)
RECORD_MAX_BYTES = 16 << 10
# A hop's budget: a rank waits for the records from the tree this long per hop above it, once every rank has joined
# (it learns that from the store), before it reads them from the store instead; a parent's push has two (its
# children's, and their children's where a child cannot be reached). A hop is a handshake and K sends of N records:
# well under a second at 8,192 ranks (5 MB of records, 7 hops) on a 10 Gb/s network; 5 s leaves room for loaded
# hosts. Per hop, not per tree: 256 ranks on this 2-core machine (2026-12-06) had the records 3 hops down within 5 s,
# and all 171 ranks 4 hops down read the store (5.6 requests a rank). A dead parent costs its children nothing (their
# grandparent pushes to them after PUSH_CONNECT_S); a parent that dies after taking the records costs them at most
# their wait.
RECORDS_TREE_HOP_S = 5.0
# A parent's bound on connecting to a child: past it, the child's children are pushed to (a dead host's SYN may go
# unanswered for minutes); the handshake then has the rest of the push's bound. A hop's budget: 256 ranks on this
# 2-core machine (2026-12-06) had connects of 0.6-4.9 s (median 3.1) 4 hops down, and with 2 s for the connection
# and the handshake every push there timed out and 171 ranks read the store; with 5 s, none in three 256-rank runs
# of four (76 in the other).
PUSH_CONNECT_S = 5.0
INBOX_BACKLOG = 64  # only ancestors dial an inbox (a parent, or a grandparent whose child was unreachable)


def tree_children(rank: int, size: int, fanout: int = RECORDS_TREE_FANOUT) -> range:
    """The ranks below `rank` in the records tree."""
    return range(min(rank * fanout + 1, size), min(rank * fanout + fanout + 1, size))


def records_wait(rank: int, fanout: int = RECORDS_TREE_FANOUT) -> float:
    """How long `rank` waits for the records from the tree once every rank joined: a hop's budget per hop above it."""
    hops = 0
    while rank > 0:
        rank = (rank - 1) // fanout
        hops += 1
    return RECORDS_TREE_HOP_S * hops


def is_ancestor(rank: int, of: int, fanout: int = RECORDS_TREE_FANOUT) -> bool:
    """Whether `rank` is above `of` in the records tree (its parent, its parent's parent, ...)."""
    while of > 0:
        of = (of - 1) // fanout
        if of == rank:
            return True
    return False


def frame_bound(size: int) -> int:
    """The largest records frame (its body) of a job of `size` ranks."""
    return min(MAX_STORE_FRAME, 4096 + size * RECORD_MAX_BYTES)


def records_frame(records: list[Any], size: int) -> bytes:
    """The frame that carries `records` down the tree (length prefix and body); ProtocolError above the bound."""
    return encode_control({"records": records}, frame_bound(size))


def decode_records(body: bytes, size: int) -> list[dict[str, Any]]:
    """The records of a frame's body: a list of `size` maps, else ProtocolError."""
    records = decode_control_body(body, frame_bound(size)).get("records")
    if not isinstance(records, list) or len(records) != size or not all(isinstance(r, dict) for r in records):
        raise ProtocolError(f"a records frame must hold {size} records")
    return records


class RecordsInbox:
    """A rank's listener for the records tree: accepts authenticated pushes from the rank's ancestors of this job
    and keeps the first valid one (the records and the frame's bytes, to forward as they are)."""

    def __init__(self, rank: int, size: int, job: str, secret: bytes, bind_host: str, handshake_timeout: float,
                 deaf: bool = False):
        self.rank, self.size, self.job, self.secret = rank, size, job, secret
        self.bind_host, self.handshake_timeout = bind_host, handshake_timeout
        self.deaf = deaf  # tests: bound, never listening (every dial is refused), as an unreachable rank
        self.refused = 0
        self.frame = b""  # the frame of the records received (length prefix and body)
        self._received: asyncio.Future[list[dict[str, Any]]] | None = None
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> tuple[str, int]:
        """Bind to the rank's bind address, port 0, and accept; returns the address to publish."""
        loop = asyncio.get_running_loop()
        self._received = loop.create_future()
        sock = socket.socket(socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((self.bind_host, 0))
            if not self.deaf:
                sock.listen(INBOX_BACKLOG)
        except OSError as exc:
            sock.close()
            raise HetcclError(f"rank {self.rank}: the records inbox cannot listen on {self.bind_host}: {exc}; "
                              "check HETCCL_BIND_ADDR / HETCCL_SOCKET_IFNAME") from None
        sock.setblocking(False)
        self._sock = sock
        if not self.deaf:
            keep_task(self._tasks, accept_each(loop, sock, functools.partial(self._receive, loop), self._tasks))
        return self.bind_host, sock.getsockname()[1]

    async def _receive(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, addr: Any) -> None:
        try:
            meta = await server_handshake(loop, conn, self.secret, PURPOSE, self.handshake_timeout)
            sender = meta.get("rank")
            if meta.get("job") != self.job or not isinstance(sender, int) or not is_ancestor(sender, self.rank):
                raise AuthenticationError(f"a records push claims job {meta.get('job')!r} rank {sender!r}, which "
                                          f"is not above rank {self.rank} in this job's records tree")
            async with asyncio.timeout(self.handshake_timeout):
                prefix = await recv_exact(loop, conn, CONTROL_LEN.size, sender)
                body = await recv_exact(loop, conn, control_length(prefix, frame_bound(self.size)), sender)
            records = decode_records(body, self.size)
        except (HetcclError, OSError, TimeoutError) as exc:
            self.refused += 1
            log.warning("hetccl: rank %d refused a records push from %s: %s", self.rank, addr, exc)
            return
        finally:
            conn.close()
        fut = self._received
        if fut is not None and not fut.done():
            self.frame = prefix + body
            fut.set_result(records)

    async def wait(self, timeout: float) -> list[dict[str, Any]] | None:
        """The records pushed to this rank, waiting at most `timeout` s for them; None if none came."""
        if self._received is None:
            return None
        if self._received.done():
            return self._received.result()
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(self._received), max(0.0, timeout))
        return None

    async def close(self) -> None:
        """Stop listening; end every connection and task of the inbox."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


async def push_records(rank: int, size: int, job: str, secret: bytes, frame: bytes,
                       inbox_of: Callable[[int], Any], timeout: float) -> list[int]:
    """Send `frame` (records_frame) to this rank's children in the records tree, all at once; a child that
    cannot be reached (no inbox, refused, timed out) is logged at debug and its children get the frame instead.
    Everything within `timeout` s; returns the ranks that took it. `inbox_of(r)` is rank r's published inbox
    address ([host, port]) or None."""
    loop = asyncio.get_running_loop()
    delivered: list[int] = []

    async def deliver(child: int) -> None:
        t0 = loop.time()
        where = inbox_of(child)
        try:
            if where is None:
                raise HetcclError("it has no records inbox")
            host, port = str(where[0]), int(where[1])
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                async with asyncio.timeout(PUSH_CONNECT_S):
                    await loop.sock_connect(sock, (host, port))
                tune_socket(sock)
                await client_handshake(loop, sock, secret, PURPOSE, {"rank": rank, "job": job}, timeout)
                await send_all(loop, sock, [frame], child)
            finally:
                sock.close()  # the child sent its last bytes in the handshake: the close sends the frame's end
        except (HetcclError, OSError, TimeoutError, ValueError, TypeError, IndexError) as exc:
            log.debug("hetccl: rank %d cannot push the records to rank %d (%r after %.1f s); pushing to its "
                      "children", rank, child, exc, loop.time() - t0)
            await asyncio.gather(*(deliver(c) for c in tree_children(child, size)))
            return
        delivered.append(child)

    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(deliver(c) for c in tree_children(rank, size)))
    except TimeoutError:  # the ones not reached by now read the records from the store
        log.debug("hetccl: rank %d stopped pushing the records after %.1f s", rank, timeout)
    return delivered
