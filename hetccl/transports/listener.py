"""The authenticated listener, and the dialer, that every transport shares (TCP data, verbs set-up, the
shared-memory doorbells): the one accept/dial of hetccl's data connections.

It binds to the chosen address (TCP: the context's bind address; or an abstract Unix socket name), accepts,
runs the server side of the HMAC handshake (`auth.py`) with a deadline, checks that the connection belongs to
this job and claims a valid rank not already connected, and hands the socket to whoever awaits
`incoming(rank)`. Anything else is refused, counted in `refused` and logged;
the job goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable
from typing import Any

from ..auth import client_handshake, server_handshake
from ..errors import AuthenticationError, CollectiveTimeout, HetcclError, PeerLostError
from ..netio import accept_each, tune_socket
from .base import TransportContext

log = logging.getLogger("hetccl")


class PeerListener:
    def __init__(self, ctx: TransportContext, purpose: str, label: str, unix_name: str | None = None):
        self.ctx, self.purpose, self.label = ctx, purpose, label  # purpose: the handshake's; label: for logs
        self.unix_name = unix_name  # listen on this abstract Unix socket name instead of TCP
        self.refused = 0
        self.lanes = 1  # connections accepted per peer (TCP lanes: meta "lane" 0..lanes-1; verbs: 1)
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task | None = None
        self._incoming: dict[tuple[int, int], asyncio.Future] = {}
        self._handshakes: set[asyncio.Task] = set()
        # told of every authenticated connection as it arrives (peer, lane): connections made on first use
        self.arrived: Callable[[int, int], None] | None = None

    def start(self) -> int:
        """Bind to the transport context's address (or the abstract Unix name), start accepting; returns the
        port (0 for a Unix socket)."""
        if self.unix_name is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind("\0" + self.unix_name)
        else:
            host = self.ctx.bind_host
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
        sock.listen(socket.SOMAXCONN)  # every peer may connect at once
        sock.setblocking(False)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._accept_task = loop.create_task(
            accept_each(loop, sock, functools.partial(self._accept_one, loop), self._handshakes))
        return 0 if self.unix_name is not None else sock.getsockname()[1]

    def incoming(self, peer: int, lane: int = 0) -> asyncio.Future:
        """The future of peer's authenticated connection (a socket); lane > 0: one of its extra TCP lanes."""
        fut = self._incoming.get((peer, lane))
        if fut is None:
            fut = self._incoming[peer, lane] = asyncio.get_running_loop().create_future()
        return fut

    def peers(self) -> set[int]:
        """The peers whose connection was accepted or is awaited."""
        return {peer for peer, _ in self._incoming}

    async def _accept_one(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, addr: Any) -> None:
        ctx = self.ctx
        try:
            meta = await server_handshake(loop, conn, ctx.secret, self.purpose, min(30.0, ctx.settings.timeout))
            peer = meta.get("rank")
            if meta.get("job") != ctx.job or not isinstance(peer, int) or not 0 <= peer < ctx.size:
                raise AuthenticationError(f"connection claims job {meta.get('job')!r} rank {peer!r}")
            lane = meta.get("lane", 0)
            if not isinstance(lane, int) or not 0 <= lane < self.lanes:
                raise AuthenticationError(f"connection from rank {peer} claims lane {lane!r}")
            fut = self.incoming(peer, lane)
            if fut.done():
                raise AuthenticationError(f"second connection claiming rank {peer}"
                                          + (f" lane {lane}" if lane else ""))
            fut.set_result(conn)
            if self.arrived is not None:
                self.arrived(peer, lane)
        except (AuthenticationError, HetcclError, OSError) as exc:
            self.refused += 1
            log.warning("hetccl %s: rank %d refused a connection from %s: %s", self.label, ctx.rank, addr, exc)
            conn.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for task in [self._accept_task, *self._handshakes]:
            if task is not None:
                task.cancel()


async def dial(ctx: TransportContext, peer: int, record: dict[str, Any], purpose: str, label: str,
               *, unix: bool = False, lane: int = 0) -> socket.socket:
    """Connect to peer's PeerListener at record["host"]:record["port"] (unix: at the abstract Unix socket
    record["uds"]) and run the client side of the handshake (lane > 0: one of the pair's extra TCP lanes);
    CollectiveTimeout or PeerLostError naming the peer when that fails."""
    loop = asyncio.get_running_loop()
    if unix:
        address: Any = "\0" + record["uds"]
        where = f"@{record['uds']}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        host, port = record["host"], record["port"]
        address, where = (host, port), f"{host}:{port}"
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, address), ctx.settings.timeout)
        tune_socket(sock)
        meta: dict[str, Any] = {"rank": ctx.rank, "job": ctx.job}
        if lane:
            meta["lane"] = lane
        await client_handshake(loop, sock, ctx.secret, purpose, meta, min(30.0, ctx.settings.timeout))
    except TimeoutError:
        sock.close()
        raise CollectiveTimeout(f"rank {ctx.rank}: connecting to rank {peer} at {where} ({label}) timed out") \
            from None
    except (OSError, PeerLostError) as exc:
        sock.close()
        raise PeerLostError(f"rank {ctx.rank}: cannot connect to rank {peer} at {where} ({label}): {exc}",
                            peer) from None
    return sock
