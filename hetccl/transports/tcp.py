"""TCP transport: one authenticated connection per peer, asyncio (uvloop) non-blocking sockets.

Receives land straight in the destination buffer (`recv_into` on a memoryview of it) when the receive is
posted; reductions go through one reusable scratch buffer per connection; early messages wait in a
bounded per-peer buffer, beyond which the reader stops reading (TCP flow control pushes back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import numpy as np

from ..errors import CollectiveTimeout, HetcclError, PeerLostError
from ..netio import recv_into_exact, send_all
from ..wire import DATA_HEADER, Fingerprint, pack_data_header, unpack_data_header
from .base import DROP, Capability, Endpoint, Matcher, Transport, TransportContext
from .listener import PeerListener, dial

log = logging.getLogger("hetccl")


class TcpEndpoint(Endpoint):
    def __init__(self, transport: TcpTransport, peer: int, sock: socket.socket):
        self.transport, self.peer, self.sock = transport, peer, sock
        self.loop = asyncio.get_running_loop()
        settings = transport.ctx.settings
        self.matcher = Matcher(transport.ctx.rank, peer, settings.unexpected_bytes)
        self.max_payload = 1 << 40  # one frame may carry a whole (huge) p2p or all_to_all buffer
        self.timeout = settings.timeout
        self._send_lock = asyncio.Lock()
        self._scratch = np.empty(0, np.uint8)
        self._closed = False
        self._reader = self.loop.create_task(self._read_loop())

    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None:
        if self.matcher.error is not None:
            raise self.matcher.error
        hdr = pack_data_header(fp, tag, len(src))
        async with self._send_lock:
            try:
                await send_all(self.loop, self.sock, [hdr, src] if len(src) else [hdr], self.peer)
            except BaseException as exc:
                # a frame cut short (cancelled, failed) leaves the byte stream unframed: the connection is
                # unusable from here on, for every collective
                err = exc if isinstance(exc, PeerLostError) else PeerLostError(
                    f"rank {self.matcher.me}: send to rank {self.peer} was interrupted; connection dropped", self.peer)
                self.sock.close()
                self.matcher.fail_all(err)
                self.transport.ctx.on_peer_lost(self.peer, err)
                raise

    def post_recv(self, fp: Fingerprint, tag: int, dst: np.ndarray, reduce: Any = None) -> asyncio.Future:
        return self.matcher.post(fp, tag, dst, reduce)

    async def _discard(self, nbytes: int) -> None:
        while nbytes > 0:
            k = min(nbytes, 1 << 20)
            await recv_into_exact(self.loop, self.sock, memoryview(self._scratch_for(k)), self.peer)
            nbytes -= k

    def _scratch_for(self, n: int) -> np.ndarray:
        if len(self._scratch) < n:
            self._scratch = np.empty(max(n, 1 << 16), np.uint8)
        return self._scratch[:n]

    async def _read_loop(self) -> None:
        hdr = bytearray(DATA_HEADER.size)
        hdr_mv = memoryview(hdr)
        loop, sock, peer, m = self.loop, self.sock, self.peer, self.matcher
        try:
            while True:
                await recv_into_exact(loop, sock, hdr_mv, peer)
                fp, tag, nbytes = unpack_data_header(hdr, self.max_payload)
                req = m.take(fp, tag, nbytes)
                if req is DROP:
                    await self._discard(nbytes)
                elif req is not None and req.reduce is None:
                    await recv_into_exact(loop, sock, memoryview(req.dst), peer)
                    if not req.fut.done():
                        req.fut.set_result(None)
                elif req is not None:
                    scratch = self._scratch_for(nbytes)
                    await recv_into_exact(loop, sock, memoryview(scratch), peer)
                    req.reduce(req.dst, scratch)
                    if not req.fut.done():
                        req.fut.set_result(None)
                else:
                    if not m.has_room(nbytes):
                        try:
                            await m.wait_room(nbytes, self.timeout)
                        except TimeoutError:
                            raise CollectiveTimeout(
                                f"rank {m.me}: {nbytes} bytes from rank {peer} for {fp.describe()} waited "
                                f"{self.timeout:.0f} s for a matching receive") from None
                        req = m.take(fp, tag, nbytes)
                        if req is DROP:
                            await self._discard(nbytes)
                            continue
                        if req is not None:
                            scratch = self._scratch_for(nbytes)
                            await recv_into_exact(loop, sock, memoryview(scratch), peer)
                            req.deliver(scratch)
                            continue
                    data = m.alloc(nbytes)
                    await recv_into_exact(loop, sock, memoryview(data), peer)
                    m.land(fp, tag, data)  # its receive may have been posted while we were reading
        except asyncio.CancelledError:
            m.fail_all(PeerLostError(f"connection to rank {peer} closed locally", peer))
            raise
        except Exception as exc:  # noqa: BLE001 - a dying reader must fail its receives, whatever killed it
            if not isinstance(exc, HetcclError):
                log.error("hetccl tcp: rank %d reader for rank %d failed: %r", m.me, peer, exc, exc_info=True)
                exc = PeerLostError(f"rank {m.me}: connection to rank {peer} broke: {exc!r}", peer)
            if not self._closed:
                if isinstance(exc, PeerLostError):
                    exc = PeerLostError(f"rank {m.me} lost rank {peer}: {exc}", peer)
                log.debug("hetccl tcp: rank %d -> %d reader ends: %s", m.me, peer, exc)
            m.fail_all(exc if not self._closed else PeerLostError("communicator closed", peer))
            if not self._closed:
                self.transport.ctx.on_peer_lost(peer, exc)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader
        self.sock.close()


class TcpTransport(Transport):
    name = "tcp"
    api_version = 1
    capabilities = Capability.NONE
    priority = 10

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self._listener = PeerListener(ctx, "data", "tcp")
        self._endpoints: list[TcpEndpoint] = []

    async def listen(self) -> dict[str, Any]:
        return {"host": self.ctx.bind_host, "port": self._listener.start()}

    @property
    def refused(self) -> int:
        return self._listener.refused

    def can_reach(self, peer: int, peer_record: dict[str, Any], same_host: bool) -> bool:
        return "port" in peer_record

    async def _dial(self, peer: int, record: dict[str, Any]) -> socket.socket:
        return await dial(self.ctx, peer, record, "data", "tcp")

    async def connect(self, peers: dict[int, dict[str, Any]]) -> dict[int, Endpoint]:
        me = self.ctx.rank

        async def one(peer: int, record: dict[str, Any]) -> tuple[int, TcpEndpoint]:
            if peer < me:  # the higher rank dials
                sock = await self._dial(peer, record)
            else:
                try:
                    sock = await asyncio.wait_for(asyncio.shield(self._listener.incoming(peer)),
                                                  self.ctx.settings.timeout)
                except TimeoutError:
                    raise CollectiveTimeout(f"rank {me}: rank {peer} never connected (TCP) within "
                                            f"{self.ctx.settings.timeout:.0f} s") from None
            ep = TcpEndpoint(self, peer, sock)
            self._endpoints.append(ep)
            return peer, ep

        pairs = await asyncio.gather(*(one(p, r) for p, r in peers.items()))
        return dict(pairs)

    async def close(self) -> None:
        self._listener.close()
        for ep in self._endpoints:
            await ep.close()
        self._endpoints.clear()
