"""TCP transport: one authenticated connection per peer, asyncio (uvloop) non-blocking sockets.

Receives land straight in the destination buffer (`recv_into` on a memoryview of it) when the receive is
posted; reductions go through one reusable scratch buffer per connection; early messages wait in a
bounded per-peer buffer, beyond which the reader stops reading (TCP flow control pushes back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import numpy as np

from .. import params
from ..errors import CollectiveTimeout, HetcclError, PeerLostError
from ..netio import Pump, pump_error, recv_into_exact, send_all
from ..wire import DATA_HEADER, Fingerprint, pack_data_header, unpack_data_header
from .base import DROP, Capability, Endpoint, Matcher, Transport, TransportContext
from .listener import PeerListener, dial

log = logging.getLogger("hetccl")
LINGER_S = 2.0  # close: longest wait for the peer's FIN after ours


def pump_bytes() -> int:
    """HETCCL_SOCKET_PUMP_BYTES, or its default for this machine's usable cores (0: never)."""
    value = params.get("HETCCL_SOCKET_PUMP_BYTES")
    if value is not None:
        return value
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 << 20 if ncpu >= 4 else 0


def _unsent(parts: list[Any], sent: int) -> bytes:
    """A copy of what is left of `parts` after their first `sent` bytes."""
    out = []
    for p in parts:
        mv = memoryview(p).cast("B")
        out.append(bytes(mv[sent:]) if sent < len(mv) else b"")
        sent = max(0, sent - len(mv))
    return b"".join(out)


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
        self._finishing: asyncio.Task[None] | None = None
        self._pump_min = pump_bytes() or 1 << 62
        self._pumps: list[Pump | None] = [None, None]  # send, receive: made at their first large payload
        self._reader = self.loop.create_task(self._read_loop())

    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None:
        if self.matcher.error is not None:
            raise self.matcher.error
        hdr = pack_data_header(fp, tag, len(src))
        parts = [hdr, src] if len(src) else [hdr]
        progress = [0]
        await self._send_lock.acquire()
        try:
            if len(src) >= self._pump_min and (pump := self._pump(0)) is not None:
                await self._pump_send(pump, hdr, src, progress)
            else:
                await send_all(self.loop, self.sock, parts, self.peer, progress)
        except asyncio.CancelledError:
            # The collective ended (an error elsewhere, its deadline) mid-frame. A frame cut short would leave the
            # stream unframed and the connection unusable, and the goodbye that names the rank really lost could
            # not follow. Finish the frame in the background with the bytes it was meant to carry (copied now:
            # the caller may reuse its buffer), holding the lock until then.
            rest = _unsent(parts, progress[0]) if progress[0] else b""
            if rest:
                self._finishing = self.loop.create_task(self._finish_frame(rest))
            else:
                self._send_lock.release()
            raise
        except BaseException as exc:
            self._send_lock.release()
            self._drop(exc)
            first = self.matcher.error  # a loss seen before this one is the cause: report that
            if isinstance(first, PeerLostError) and isinstance(exc, PeerLostError) and first is not exc:
                raise first from exc
            raise
        self._send_lock.release()

    def _pump(self, i: int) -> Pump | None:
        pump = self._pumps[i]
        if pump is None and not self._closed:
            pump = self._pumps[i] = Pump.create(self.loop)
            if pump is None:
                self._pump_min = 1 << 62  # no native threads here: the loop path from now on
        return pump

    async def _pump_send(self, pump: Pump, hdr: bytes, src: np.ndarray, progress: list[int]) -> None:
        try:
            rc, moved = await pump.run(self.sock.fileno(), True, hdr, src)
        except asyncio.CancelledError as exc:
            progress[0] = getattr(exc, "moved", 0)
            raise
        progress[0] = moved
        if rc:
            raise pump_error(rc, self.peer, True)

    async def _recv(self, mv: memoryview) -> None:
        """Fill mv from the socket: by the receive pump when large, else on the loop."""
        if len(mv) >= self._pump_min and (pump := self._pump(1)) is not None:
            rc, _ = await pump.run(self.sock.fileno(), False, None, mv)
            if rc:
                raise pump_error(rc, self.peer, False)
        else:
            await recv_into_exact(self.loop, self.sock, mv, self.peer)

    def _close_pumps(self) -> None:
        for pump in self._pumps:
            if pump is not None:
                pump.close()

    async def _finish_frame(self, rest: bytes) -> None:
        try:
            async with asyncio.timeout(min(self.timeout, 10.0)):
                await send_all(self.loop, self.sock, [rest], self.peer)
        except BaseException as exc:  # noqa: BLE001 - the peer did not take it in time: give the connection up
            self._drop(exc)
        finally:
            self._send_lock.release()

    def _drop(self, exc: BaseException) -> None:
        """A frame could not be completed: the connection is unusable from here on, for every collective."""
        err = exc if isinstance(exc, PeerLostError) else PeerLostError(
            f"rank {self.matcher.me}: send to rank {self.peer} was interrupted; connection dropped", self.peer)
        self._close_pumps()  # no native thread may touch the socket once it is closed
        self.sock.close()
        self.matcher.fail_all(err)
        self.transport.ctx.on_peer_lost(self.peer, err)

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
                    await self._recv(memoryview(req.dst))
                    if not req.fut.done():
                        req.fut.set_result(None)
                elif req is not None:
                    scratch = self._scratch_for(nbytes)
                    await self._recv(memoryview(scratch))
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
                            await self._recv(memoryview(scratch))
                            req.deliver(scratch)
                            continue
                    data = m.alloc(nbytes)
                    await self._recv(memoryview(data))
                    m.land(fp, tag, data)  # its receive may have been posted while we were reading
        except asyncio.CancelledError:
            m.fail_all(PeerLostError(f"connection to rank {peer} closed locally", peer))
            raise
        except Exception as exc:  # noqa: BLE001 - a dying reader must fail its receives, whatever killed it
            if not isinstance(exc, HetcclError):
                log.error("hetccl tcp: rank %d reader for rank %d failed: %r", m.me, peer, exc, exc_info=True)
                exc = PeerLostError(f"rank {m.me}: connection to rank {peer} broke: {exc!r}", peer)
            if self._closed:
                m.fail_all(PeerLostError("communicator closed", peer))
                return
            if isinstance(exc, PeerLostError):
                exc = PeerLostError(f"rank {m.me} lost rank {peer}: {exc}", peer)
            log.debug("hetccl tcp: rank %d -> %d reader ends: %s", m.me, peer, exc)
            # One loop turn later: a control frame read just before (a goodbye naming the rank really lost) is
            # handed to the fabric by a future callback, which must run first.
            loop.call_soon(self._reader_failed, exc)

    def _reader_failed(self, exc: BaseException) -> None:
        self.matcher.fail_all(exc)
        if not self._closed:
            self.transport.ctx.on_peer_lost(self.peer, exc)

    async def close(self) -> None:
        """Finish a cut frame, send FIN, and read on until the peer's FIN (bounded) before closing: a socket
        closed with unread data sends RST, and RST makes the peer's kernel discard what it had not yet read, such
        as this rank's goodbye naming the rank really lost."""
        if self._closed:
            return
        self._closed = True
        if self._finishing is not None:  # bounded by its own deadline
            with contextlib.suppress(BaseException):
                await self._finishing
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
        if not self._reader.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._reader), min(self.timeout, LINGER_S))
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader
        self._close_pumps()
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
        await asyncio.gather(*(ep.close() for ep in self._endpoints))
        self._endpoints.clear()
