"""TCP transport: `HETCCL_SOCKET_NSTREAMS` authenticated connections ("streams") per peer pair.

Headers are read, and small payloads moved, by asyncio tasks on the event loop (uvloop), one reader per
stream. Payloads from HETCCL_SOCKET_OFFLOAD_BYTES on are moved by a worker thread of their stream running the native
loop (netio.pump_send/pump_recv): it releases the GIL for the whole transfer, so streams copy in parallel on
several cores while the loop goes on with the others (one asyncio stream tops out near 3 GB/s on loopback).
Each stream has its own send thread and receive thread: a transfer in one never waits for a thread busy with
another, so two ranks cannot block each other.

Messages from SPLIT_MIN_BYTES on are cut into fragment frames (wire.fragment_span), one per stream; each
fragment is a whole frame on its stream, and the receiver lands it at its offset in the destination (or
reduces it there) as it arrives. Smaller messages, and control frames, go whole on stream 0 (latency; and a
goodbye is read before that stream's end of file).

Receives land straight in the destination buffer when the receive is posted; reductions go through one
reusable scratch buffer per stream; early messages wait in a bounded per-peer buffer, beyond which the
readers stop reading (TCP flow control pushes back).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import socket
from typing import Any

import numpy as np

from ..errors import CollectiveTimeout, HetcclError, PeerLostError, ProtocolError
from ..netio import IO_STOPPED, new_stop_flag, pump_error, pump_recv, pump_send, recv_header, recv_into_exact, send_all
from ..wire import (
    DATA_HEADER,
    Fingerprint,
    fragment_count,
    fragment_span,
    pack_data_header,
    pack_fragment_header,
    unpack_frame_header,
)
from .base import CONTROL_TAGS, DROP, Capability, Endpoint, Matcher, RecvRequest, Transport, TransportContext
from .listener import PeerListener, dial

log = logging.getLogger("hetccl")
LINGER_S = 2.0  # close: longest wait for the peer's FIN after ours
SPLIT_MIN_BYTES = 256 << 10  # messages from this size are cut across the streams...
FRAGMENT_MIN_BYTES = 128 << 10  # ...into pieces of at least this size
REDUCE_PIECE_BYTES = 256 << 10  # a reduced payload is received and reduced piece by piece (stays in cache)
CUT_FRAME_WAIT_S = 1.0  # a cancelled send: longest wait for its worker to stop before copying what is left


def _unsent(parts: list[Any], sent: int) -> bytes:
    """A copy of what is left of `parts` after their first `sent` bytes."""
    out = []
    for p in parts:
        mv = memoryview(p).cast("B")
        out.append(bytes(mv[sent:]) if sent < len(mv) else b"")
        sent = max(0, sent - len(mv))
    return b"".join(out)


def _recv_reduce(fd: int, scratch: np.ndarray, dst: np.ndarray, reduce: Any, idle_s: float, stop: Any
                 ) -> tuple[int, int]:
    """Worker thread: receive len(dst) bytes piece by piece into scratch, reducing each piece into dst as it
    lands (the native reduction releases the GIL too) -> pump_recv's (status, bytes received)."""
    n, piece, done = len(dst), len(scratch), 0
    while done < n:
        k = min(piece, n - done)
        status, got = pump_recv(fd, scratch[:k], idle_s, stop)
        if status:
            return status, done + got
        reduce(dst[done: done + k], scratch[:k])
        done += k
    return 0, n


class _Stream:
    """One connection of a peer pair, with its send lock, worker threads (made on first use) and stop flags."""

    def __init__(self, index: int, sock: socket.socket, peer: int):
        self.index, self.sock, self.fd, self.peer = index, sock, sock.fileno(), peer
        self.send_lock = asyncio.Lock()
        self.send_stop, self.recv_stop = new_stop_flag(), new_stop_flag()  # set: the native loop gives up
        self.scratch = np.empty(0, np.uint8)
        self.jobs: set[concurrent.futures.Future] = set()  # worker transfers not yet returned
        self.reader: asyncio.Task[None] | None = None
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}

    def submit(self, direction: str, fn: Any, *args: Any) -> concurrent.futures.Future:
        pool = self._pools.get(direction)
        if pool is None:
            pool = self._pools[direction] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"hetccl-tcp-{self.peer}.{self.index}-{direction}")
        job = pool.submit(fn, *args)
        self.jobs.add(job)
        job.add_done_callback(self.jobs.discard)
        return job

    def scratch_for(self, n: int) -> np.ndarray:
        if len(self.scratch) < n:
            self.scratch = np.empty(max(n, 1 << 16), np.uint8)
        return self.scratch[:n]

    def halt(self) -> None:
        """Stop the native loops and wake everything waiting on the socket; the descriptor stays open (a
        worker may still hold it) until release()."""
        self.send_stop[0] = self.recv_stop[0] = 1
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    async def release(self) -> None:
        """Once the workers have returned (they see the stop flags within milliseconds), close the socket."""
        self.send_stop[0] = self.recv_stop[0] = 1
        jobs = [asyncio.wrap_future(j) for j in list(self.jobs)]
        if jobs:
            await asyncio.wait(jobs, timeout=CUT_FRAME_WAIT_S)
        for pool in self._pools.values():
            pool.shutdown(wait=False)
        self.sock.close()


class _Assembly:
    """A fragmented message being received: where its pieces go and how many are still to come."""

    __slots__ = ("fp", "nbytes", "parts", "left", "req", "dst", "seen", "ready")

    def __init__(self, fp: Fingerprint, nbytes: int, parts: int):
        self.fp, self.nbytes, self.parts = fp, nbytes, parts
        self.left = fragment_count(nbytes, parts)
        self.req: RecvRequest | None = None  # the posted receive being filled
        self.dst: np.ndarray | None = None  # where pieces land (req.dst, or an early buffer); None: discard
        self.seen = 0  # bit i: piece i arrived
        self.ready = asyncio.Event()  # set once req/dst are decided (the first piece may wait for room)


class TcpEndpoint(Endpoint):
    def __init__(self, transport: TcpTransport, peer: int, socks: socket.socket | list[socket.socket]):
        """`socks`: the pair's connections in stream order (both ends agree on it), or the only one."""
        if isinstance(socks, socket.socket):
            socks = [socks]
        self.transport, self.peer = transport, peer
        self.loop = asyncio.get_running_loop()
        settings = transport.ctx.settings
        self.matcher = Matcher(transport.ctx.rank, peer, settings.unexpected_bytes)
        self.max_payload = 1 << 40  # one frame may carry a whole (huge) p2p or all_to_all buffer
        self.timeout = settings.timeout
        self.offload_min = settings.socket_offload_bytes  # payloads from this size go to the stream's threads
        self.streams = [_Stream(i, s, peer) for i, s in enumerate(socks)]
        self.sock = socks[0]
        self._rotor = itertools.count()  # which stream takes a message's first piece
        self._assembling: dict[tuple[int, int, int], _Assembly] = {}
        self._closed = False
        self._finishing: set[asyncio.Task[None]] = set()
        for st in self.streams:
            st.reader = self.loop.create_task(self._read_loop(st))

    @property
    def _reader(self) -> asyncio.Task[None] | None:
        return self.streams[0].reader

    # ------------------------------------------------------------------------------------------------ send
    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None:
        if self.matcher.error is not None:
            raise self.matcher.error
        n, nstreams = len(src), len(self.streams)
        parts = min(nstreams, n // FRAGMENT_MIN_BYTES) if n >= SPLIT_MIN_BYTES and tag not in CONTROL_TAGS else 1
        if parts <= 1:
            await self._send_frame(self.streams[0], pack_data_header(fp, tag, n), src)
            return
        first = next(self._rotor)
        sends = []
        for i in range(fragment_count(n, parts)):
            off, length = fragment_span(n, parts, i)
            sends.append(self._send_frame(self.streams[(first + i) % nstreams],
                                          pack_fragment_header(fp, tag, n, i, parts), src[off: off + length]))
        results = await asyncio.gather(*sends, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _send_frame(self, st: _Stream, hdr: bytes, payload: np.ndarray) -> None:
        await st.send_lock.acquire()
        parts = [hdr, payload] if len(payload) else [hdr]
        progress = [0]
        try:
            if len(payload) >= self.offload_min:
                job = st.submit("send", pump_send, st.fd, hdr, payload, self.timeout, st.send_stop)
                try:
                    status, progress[0] = await asyncio.wrap_future(job)
                except asyncio.CancelledError:
                    # stop the worker and wait for it (briefly, blocking the loop) so that what is left is
                    # copied before the caller may reuse its buffer
                    st.send_stop[0] = 1
                    try:
                        status, progress[0] = job.result(CUT_FRAME_WAIT_S)
                    except concurrent.futures.TimeoutError:
                        progress[0] = -1  # still running: the frame cannot be finished from here
                    else:
                        if status == IO_STOPPED and not self._closed and self.matcher.error is None:
                            st.send_stop[0] = 0
                    raise
                if status:
                    raise pump_error(status, self.peer, "sending to", self.timeout)
            else:
                await send_all(self.loop, st.sock, parts, self.peer, progress)
        except asyncio.CancelledError:
            # The collective ended (an error elsewhere, its deadline) mid-frame. A frame cut short would leave the
            # stream unframed and the connection unusable, and the goodbye that names the rank really lost could
            # not follow. Finish the frame in the background with the bytes it was meant to carry (copied now:
            # the caller may reuse its buffer), holding the lock until then.
            total = len(hdr) + len(payload)
            cut = progress[0] < 0 or 0 < progress[0] < total
            if cut and not st.send_stop[0]:
                task = self.loop.create_task(self._finish_frame(st, _unsent(parts, progress[0])))
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)
            else:
                st.send_lock.release()
                if cut and not self._closed and self.matcher.error is None:  # the worker did not stop in time
                    self._drop(PeerLostError(f"rank {self.matcher.me}: send to rank {self.peer} was "
                                             "interrupted; connection dropped", self.peer))
            raise
        except BaseException as exc:
            st.send_lock.release()
            self._drop(exc)
            first = self.matcher.error  # a loss seen before this one is the cause: report that
            if isinstance(first, PeerLostError) and isinstance(exc, PeerLostError) and first is not exc:
                raise first from exc
            raise
        st.send_lock.release()

    async def _finish_frame(self, st: _Stream, rest: bytes) -> None:
        try:
            async with asyncio.timeout(min(self.timeout, 10.0)):
                await send_all(self.loop, st.sock, [rest], self.peer)
        except BaseException as exc:  # noqa: BLE001 - the peer did not take it in time: give the connection up
            self._drop(exc)
        finally:
            st.send_lock.release()

    def _drop(self, exc: BaseException) -> None:
        """A frame could not be completed: the connection is unusable from here on, for every collective."""
        err = exc if isinstance(exc, PeerLostError) else PeerLostError(
            f"rank {self.matcher.me}: send to rank {self.peer} was interrupted; connection dropped", self.peer)
        for st in self.streams:
            st.halt()
        self.matcher.fail_all(err)
        self.transport.ctx.on_peer_lost(self.peer, err)

    # ------------------------------------------------------------------------------------------------ receive
    def post_recv(self, fp: Fingerprint, tag: int, dst: np.ndarray, reduce: Any = None) -> asyncio.Future:
        return self.matcher.post(fp, tag, dst, reduce)

    async def _recv_payload(self, st: _Stream, dst: np.ndarray | memoryview) -> None:
        if len(dst) < self.offload_min:
            await recv_into_exact(self.loop, st.sock, memoryview(dst), self.peer)
            return
        job = st.submit("recv", pump_recv, st.fd, dst, self.timeout, st.recv_stop)
        status, _ = await asyncio.wrap_future(job)
        if status:
            raise pump_error(status, self.peer, "receiving from", self.timeout)

    async def _recv_reduced(self, st: _Stream, dst: np.ndarray, reduce: Any) -> None:
        """dst = dst OP payload: on the worker thread for large payloads, else here."""
        if len(dst) < self.offload_min:  # piece by piece too: each piece is reduced while still in cache
            for off in range(0, len(dst), REDUCE_PIECE_BYTES):
                piece = dst[off: off + REDUCE_PIECE_BYTES]
                scratch = st.scratch_for(len(piece))
                await recv_into_exact(self.loop, st.sock, memoryview(scratch), self.peer)
                reduce(piece, scratch)
            return
        scratch = st.scratch_for(REDUCE_PIECE_BYTES)
        job = st.submit("recv", _recv_reduce, st.fd, scratch, dst, reduce, self.timeout, st.recv_stop)
        status, _ = await asyncio.wrap_future(job)
        if status:
            raise pump_error(status, self.peer, "receiving from", self.timeout)

    async def _discard(self, st: _Stream, nbytes: int) -> None:
        while nbytes > 0:
            k = min(nbytes, 1 << 20)
            await self._recv_payload(st, st.scratch_for(k))
            nbytes -= k

    async def _wait_room(self, nbytes: int, fp: Fingerprint) -> None:
        m = self.matcher
        try:
            await m.wait_room(nbytes, self.timeout)
        except TimeoutError:
            raise CollectiveTimeout(
                f"rank {m.me}: {nbytes} bytes from rank {self.peer} for {fp.describe()} waited "
                f"{self.timeout:.0f} s for a matching receive") from None

    async def _read_message(self, st: _Stream, fp: Fingerprint, tag: int, nbytes: int) -> None:
        """A whole message (one frame) on stream st."""
        m = self.matcher
        req = m.take(fp, tag, nbytes)
        if req is None and not m.has_room(nbytes):
            await self._wait_room(nbytes, fp)
            req = m.take(fp, tag, nbytes)
        if req is DROP:
            await self._discard(st, nbytes)
        elif req is None:
            data = m.alloc(nbytes)
            await self._recv_payload(st, data)
            m.land(fp, tag, data)  # its receive may have been posted while we were reading
        else:
            m.filling.add(req)
            if req.reduce is None:
                await self._recv_payload(st, req.dst)
            else:
                await self._recv_reduced(st, req.dst, req.reduce)
            if not req.fut.done():
                req.fut.set_result(None)
            m.filling.discard(req)

    async def _read_fragment(self, st: _Stream, fp: Fingerprint, tag: int, nbytes: int, part: int,
                             parts: int) -> None:
        """Piece `part` of a fragmented message: land it at its offset; the last piece completes the message."""
        m, key = self.matcher, (fp.comm, fp.seq, tag)
        asm = self._assembling.get(key)
        if asm is None:
            asm = self._assembling[key] = _Assembly(fp, nbytes, parts)
            req = m.take(fp, tag, nbytes)
            if req is None and not m.has_room(nbytes):
                await self._wait_room(nbytes, fp)
                req = m.take(fp, tag, nbytes)
            if req is None:
                asm.dst = m.alloc(nbytes)
            elif req is not DROP:
                asm.req, asm.dst = req, req.dst
                m.filling.add(req)
            asm.ready.set()
        elif asm.fp != fp or asm.nbytes != nbytes or asm.parts != parts or asm.seen >> part & 1:
            raise ProtocolError(f"rank {self.peer} sent fragment {part} of {parts} of a {nbytes}-byte message "
                                f"that does not fit the pieces already received")
        elif not asm.ready.is_set():  # the first piece waits for room in the early buffer
            try:
                await asyncio.wait_for(asm.ready.wait(), self.timeout)
            except TimeoutError:
                raise CollectiveTimeout(f"rank {m.me}: a {nbytes}-byte message from rank {self.peer} for "
                                        f"{fp.describe()} waited {self.timeout:.0f} s for room") from None
        asm.seen |= 1 << part
        off, length = fragment_span(nbytes, parts, part)
        req = asm.req
        if asm.dst is None or req is not None and req.fut.done():  # dropped, or the receive has failed
            await self._discard(st, length)
        elif req is not None and req.reduce is not None:
            await self._recv_reduced(st, req.dst[off: off + length], req.reduce)
        else:
            await self._recv_payload(st, asm.dst[off: off + length])
        asm.left -= 1
        if asm.left:
            return
        del self._assembling[key]
        if req is not None:
            m.filling.discard(req)
            if not req.fut.done():
                req.fut.set_result(None)
        elif asm.dst is not None:
            m.land(fp, tag, asm.dst)

    async def _read_loop(self, st: _Stream) -> None:
        hdr = bytearray(DATA_HEADER.size)
        hdr_mv = memoryview(hdr)
        loop, sock, peer, m = self.loop, st.sock, self.peer, self.matcher
        try:
            while True:
                if not await recv_header(loop, sock, hdr_mv, peer):
                    if st.index:  # stream 0 reports the end, after the goodbye it may carry
                        return
                    raise PeerLostError(f"rank {peer} closed the connection", peer)
                fp, tag, nbytes, part, parts = unpack_frame_header(hdr, self.max_payload)
                if parts == 1:
                    await self._read_message(st, fp, tag, nbytes)
                else:
                    await self._read_fragment(st, fp, tag, nbytes, part, parts)
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
            log.debug("hetccl tcp: rank %d -> %d reader %d ends: %s", m.me, peer, st.index, exc)
            # One loop turn later: a control frame read just before (a goodbye naming the rank really lost) is
            # handed to the fabric by a future callback, which must run first.
            loop.call_soon(self._reader_failed, exc)

    def _reader_failed(self, exc: BaseException) -> None:
        self.matcher.fail_all(exc)
        if not self._closed:
            self.transport.ctx.on_peer_lost(self.peer, exc)

    async def close(self) -> None:
        """Finish cut frames, send FIN on every stream, and read on until the peer's FIN (bounded) before
        closing: a socket closed with unread data sends RST, and RST makes the peer's kernel discard what it had
        not yet read, such as this rank's goodbye naming the rank really lost."""
        if self._closed:
            return
        self._closed = True
        if self._finishing:  # each bounded by its own deadline
            await asyncio.gather(*self._finishing, return_exceptions=True)
        for st in self.streams:
            with contextlib.suppress(OSError):
                st.sock.shutdown(socket.SHUT_WR)
        readers = [st.reader for st in self.streams if st.reader is not None]
        if any(not r.done() for r in readers):
            await asyncio.wait([asyncio.shield(r) for r in readers], timeout=min(self.timeout, LINGER_S))
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await asyncio.gather(*(st.release() for st in self.streams))


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
        return {"host": self.ctx.bind_host, "port": self._listener.start(),
                "nstreams": self.ctx.settings.socket_nstreams}

    @property
    def refused(self) -> int:
        return self._listener.refused

    def can_reach(self, peer: int, peer_record: dict[str, Any], same_host: bool) -> bool:
        return "port" in peer_record

    async def _dial(self, peer: int, record: dict[str, Any], stream: int = 0) -> socket.socket:
        return await dial(self.ctx, peer, record, "data", "tcp", stream)

    async def connect(self, peers: dict[int, dict[str, Any]]) -> dict[int, Endpoint]:
        me = self.ctx.rank

        async def accept(peer: int, stream: int) -> socket.socket:
            try:
                return await asyncio.wait_for(asyncio.shield(self._listener.incoming(peer, stream)),
                                              self.ctx.settings.timeout)
            except TimeoutError:
                raise CollectiveTimeout(f"rank {me}: rank {peer} never connected (TCP stream {stream}) within "
                                        f"{self.ctx.settings.timeout:.0f} s") from None

        async def one(peer: int, record: dict[str, Any]) -> tuple[int, TcpEndpoint]:
            # both ends take the smaller of their HETCCL_SOCKET_NSTREAMS, so they agree without a round trip
            nstreams = max(1, min(self.ctx.settings.socket_nstreams, int(record.get("nstreams", 1))))
            if peer < me:  # the higher rank dials
                opened = await asyncio.gather(*(self._dial(peer, record, i) for i in range(nstreams)),
                                              return_exceptions=True)
            else:
                opened = await asyncio.gather(*(accept(peer, i) for i in range(nstreams)), return_exceptions=True)
            socks = [s for s in opened if isinstance(s, socket.socket)]
            if len(socks) < nstreams:
                for s in socks:
                    s.close()
                raise next(e for e in opened if isinstance(e, BaseException))
            ep = TcpEndpoint(self, peer, socks)
            self._endpoints.append(ep)
            return peer, ep

        pairs = await asyncio.gather(*(one(p, r) for p, r in peers.items()))
        return dict(pairs)

    async def close(self) -> None:
        self._listener.close()
        await asyncio.gather(*(ep.close() for ep in self._endpoints))
        self._endpoints.clear()
