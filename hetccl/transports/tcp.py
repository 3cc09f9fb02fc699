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
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import params
from ..config import usable_cpus
from ..dtypes import block_ranges
from ..errors import CollectiveTimeout, ConfigError, HetcclError, PeerLostError
from ..matching import DROP, Matcher
from ..netio import PUMP_STOPPED, Pump, pump_error, recv_into_exact, send_all
from ..wire import DATA_HEADER, Fingerprint, pack_data_header, unpack_data_header
from .base import Endpoint, Transport, TransportContext, TransportProperties
from .listener import PeerListener, dial

log = logging.getLogger("hetccl")
LINGER_S = 2.0  # close: longest wait for the peer's FIN after ours
OUT_GRACE_S = 1.0  # lazy: how long the end of a send-only connection waits for the peer's own connection to end


def pump_bytes() -> int:
    """HETCCL_SOCKET_PUMP_BYTES, or its default for this machine's usable cores (0: never)."""
    value = params.get("HETCCL_SOCKET_PUMP_BYTES")
    return value if value is not None else (1 << 20 if usable_cpus() >= 8 else 0)


def connects_lazily(size: int) -> bool:
    """Whether a job of `size` ranks dials its TCP peers on first use (HETCCL_CONNECT; `auto`: from
    HETCCL_CONNECT_LAZY_FROM ranks), the same on every rank (both settings are agreed)."""
    mode = params.get("HETCCL_CONNECT")
    return mode == "lazy" or (mode == "auto" and size >= params.get("HETCCL_CONNECT_LAZY_FROM"))


def lane_count() -> int:
    """HETCCL_SOCKET_LANES, or its default for this machine's usable cores (the transport keeps 1 without pumps),
    and 1 under HETCCL_SOCKET_MAX_RATE: the rate is split over a pair's connections, and a payload below the
    split size crosses one of them only, at a part of the rate."""
    value = params.get("HETCCL_SOCKET_LANES")
    if value is not None:
        return value
    return 1 if params.get("HETCCL_SOCKET_MAX_RATE") else (3 if usable_cpus() >= 8 else 1)


_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's number; Python names it from 3.12 on


def _pace(socks: Sequence[socket.socket]) -> None:
    """HETCCL_SOCKET_MAX_RATE over a peer pair's connections: each sends at most its even part. The kernel paces
    TCP itself where the qdisc does not (Linux 4.13 and later), loopback included."""
    rate = params.get("HETCCL_SOCKET_MAX_RATE")
    if not rate:
        return
    each = max(1, rate // len(socks))
    value = each if each < 1 << 31 else struct.pack("=Q", each)  # above 32 bits the kernel (4.20+) reads a u64
    for s in socks:
        try:
            s.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, value)
        except OSError as e:
            raise ConfigError(f"HETCCL_SOCKET_MAX_RATE: this kernel refused to pace a TCP connection ({e}); unset "
                              "it") from e


def _unsent(parts: list[Any], sent: int) -> bytes:
    """A copy of what is left of `parts` after their first `sent` bytes."""
    out = []
    for p in parts:
        mv = memoryview(p).cast("B")
        out.append(bytes(mv[sent:]) if sent < len(mv) else b"")
        sent = max(0, sent - len(mv))
    return b"".join(out)


class TcpEndpoint(Endpoint):
    def __init__(self, transport: TcpTransport, peer: int, sock: socket.socket, lanes: Sequence[socket.socket] = (),
                 split_bytes: int = 0, matcher: Matcher | None = None,
                 lost: Callable[[BaseException], None] | None = None):
        """lanes: the pair's extra connections; a payload of at least split_bytes (agreed by both ranks) is cut
        in len(lanes) + 1 contiguous parts, part 0 after the header on sock, part i alone on lanes[i - 1].
        matcher: the peer's, where another endpoint shares it (LazyTcpEndpoint's two directions); lost: what
        to do instead of failing the matcher and reporting the peer lost when the reader ends."""
        self.transport, self.peer, self.sock = transport, peer, sock
        self.socks = [sock, *lanes]
        _pace(self.socks)
        self._split_min = split_bytes if lanes and split_bytes else 1 << 62
        self.loop = asyncio.get_running_loop()
        settings = transport.ctx.settings
        # the core's: frames are delivered to it
        self.matcher = transport.ctx.new_matcher(peer) if matcher is None else matcher
        self.max_payload = 1 << 40  # one frame may carry a whole (huge) p2p or all_to_all buffer
        self.timeout = settings.timeout
        self._send_lock = asyncio.Lock()
        self._scratch = np.empty(0, np.uint8)
        self._closed = False
        self._finishing: asyncio.Task[None] | None = None
        self._pump_min = pump_bytes() or 1 << 62
        # [send, receive][connection]: made at their first large payload
        self._pumps: list[list[Pump | None]] = [[None] * len(self.socks), [None] * len(self.socks)]
        self._lost = lost
        self._reader = self.loop.create_task(self._read_loop())

    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None:
        if self.matcher.error is not None:
            raise self.matcher.error
        hdr = pack_data_header(fp, tag, len(src))
        parts = [hdr, src] if len(src) else [hdr]
        progress = [0]
        await self._send_lock.acquire()
        split = len(src) >= self._split_min
        lane_parts = self._lane_parts(hdr, src) if split else [parts]
        lane_progress = [progress] + [[0] for _ in lane_parts[1:]]
        try:
            if split:
                if not await self._lanes_pumped(True, [hdr] + [None] * (len(lane_parts) - 1),
                                                [p[-1] for p in lane_parts], lane_progress):
                    await self._lanes(self._lane_send, lane_parts, lane_progress)
            elif len(src) >= self._pump_min:
                await self._lane_send(0, parts, progress)
            else:
                await send_all(self.loop, self.sock, parts, self.peer, progress)
        except asyncio.CancelledError:
            # The collective ended (an error elsewhere, its deadline) mid-frame. A frame cut short would leave the
            # stream unframed and the connection unusable, and the goodbye that names the rank really lost could
            # not follow. Finish the frame in the background with the bytes it was meant to carry (copied now:
            # the caller may reuse its buffer), holding the lock until then. Split over lanes, every lane's part
            # is finished once any has begun.
            rests = [(s, _unsent(p, pr[0])) for s, p, pr in zip(self.socks, lane_parts, lane_progress, strict=False)]
            if any(pr[0] for pr in lane_progress) and any(r for _, r in rests):
                self._finishing = self.loop.create_task(self._finish_frame([(s, r) for s, r in rests if r]))
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

    def _pump(self, d: int, lane: int = 0) -> Pump | None:
        pump = self._pumps[d][lane]
        if pump is None and not self._closed:
            pump = self._pumps[d][lane] = Pump.create(self.loop)
            if pump is None:
                self._pump_min = 1 << 62  # no native threads here: the loop path from now on
        return pump

    def _lane_parts(self, hdr: bytes, src: np.ndarray) -> list[list[Any]]:
        cuts = block_ranges(len(src), len(self.socks))
        return [[hdr, src[a:b]] if i == 0 else [src[a:b]] for i, (a, b) in enumerate(cuts)]

    async def _lanes_pumped(self, send: bool, heads: list[Any], bodies: list[Any],
                            progress: list[list[int]] | None) -> bool:
        """Move every lane's part at once by the lanes' pumps, one future for the frame (no task per lane);
        False (nothing started) when a lane has no pump. Any end but success stops every lane and waits for all
        of them to let go of the buffers before the error (a cancellation first) goes on."""
        pumps = [self._pump(0 if send else 1, i) for i in range(len(self.socks))]
        if None in pumps:
            return False
        loop = self.loop
        left, res = [len(pumps)], [(0, 0)] * len(pumps)
        waiter = [loop.create_future()]

        def ended(i: int) -> Any:
            def cb(rc: int, moved: int) -> None:
                res[i] = (rc, moved)
                left[0] -= 1
                if rc and rc != PUMP_STOPPED:  # a broken lane: stop the others, the frame cannot finish
                    for p in pumps:
                        p.stop()
                if not left[0] and not waiter[0].done():
                    waiter[0].set_result(None)
            return cb

        for i, pump in enumerate(pumps):
            if not pump.submit(self.socks[i].fileno(), send, heads[i], bodies[i], ended(i)):  # type: ignore[union-attr]
                ended(i)(-9, 0)  # EBADF: closed (the connection was dropped)
        try:
            await waiter[0]
        except asyncio.CancelledError:
            for p in pumps:
                p.stop()  # type: ignore[union-attr]
            while left[0]:
                waiter[0] = loop.create_future()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter[0]
            raise
        finally:
            if progress is not None:
                for pr, (_, moved) in zip(progress, res, strict=True):
                    pr[0] = moved
        bad = [rc for rc, _ in res if rc]
        if bad:
            raise pump_error(next((rc for rc in bad if rc != PUMP_STOPPED), bad[0]), self.peer, send)
        return True

    async def _lanes(self, one: Any, jobs: list[Any], extra: list[Any]) -> None:
        """Run one(lane, job, extra) on every connection at once; on any end but success, every lane has let go
        of its buffers before the error (a cancellation first) goes on."""
        tasks = [self.loop.create_task(one(i, j, x)) for i, (j, x) in enumerate(zip(jobs, extra, strict=True))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            while not all(t.done() for t in tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(tasks)
            raise

    async def _lane_send(self, lane: int, parts: list[Any], progress: list[int]) -> None:
        pump = self._pump(0, lane)
        if pump is None:
            await send_all(self.loop, self.socks[lane], parts, self.peer, progress)
            return
        try:
            rc, moved = await pump.run(self.socks[lane].fileno(), True, parts[0] if lane == 0 else None, parts[-1])
        except asyncio.CancelledError as exc:
            progress[0] = getattr(exc, "moved", 0)
            raise
        progress[0] = moved
        if rc:
            raise pump_error(rc, self.peer, True)

    async def _lane_recv(self, lane: int, mv: memoryview, _: Any) -> None:
        pump = self._pump(1, lane)
        if pump is None:
            await recv_into_exact(self.loop, self.socks[lane], mv, self.peer)
            return
        rc, _moved = await pump.run(self.socks[lane].fileno(), False, None, mv)
        if rc:
            raise pump_error(rc, self.peer, False)

    async def _recv(self, mv: memoryview) -> None:
        """Fill mv from the socket: by the receive pump when large (split over the lanes when larger), else on the
        loop."""
        if len(mv) >= self._split_min:
            cuts = block_ranges(len(mv), len(self.socks))
            views = [mv[a:b] for a, b in cuts]
            if not await self._lanes_pumped(False, [None] * len(cuts), views, None):
                await self._lanes(self._lane_recv, views, [None] * len(cuts))
        elif len(mv) >= self._pump_min:
            await self._lane_recv(0, mv, None)
        else:
            await recv_into_exact(self.loop, self.sock, mv, self.peer)

    def _close_pumps(self) -> None:
        for pumps in self._pumps:
            for pump in pumps:
                if pump is not None:
                    pump.close()

    def _close_socks(self) -> None:
        for s in self.socks:
            s.close()

    async def _finish_frame(self, rests: list[tuple[socket.socket, bytes]]) -> None:
        try:
            async with asyncio.timeout(min(self.timeout, 10.0)):
                await asyncio.gather(*(send_all(self.loop, s, [r], self.peer) for s, r in rests))
        except BaseException as exc:  # noqa: BLE001 - the peer did not take it in time: give the connection up
            self._drop(exc)
        finally:
            self._send_lock.release()

    def _drop(self, exc: BaseException) -> None:
        """A frame could not be completed: the connection is unusable from here on, for every collective."""
        err = exc if isinstance(exc, PeerLostError) else PeerLostError(
            f"rank {self.matcher.me}: send to rank {self.peer} was interrupted; connection dropped", self.peer)
        self._close_pumps()  # no native thread may touch the socket once it is closed
        self._close_socks()
        self.matcher.fail_all(err)
        self.transport.ctx.on_peer_lost(self.peer, err)

    def post_recv(self, fp: Fingerprint, tag: int, dst: np.ndarray, reduce: Any = None) -> asyncio.Future:
        return self.matcher.post(fp, tag, dst, reduce)

    async def _discard(self, nbytes: int) -> None:
        if nbytes >= self._split_min:  # its parts are spread over the lanes
            await self._recv(memoryview(np.empty(nbytes, np.uint8)))
            return
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
        if self._lost is not None and not self._closed:
            self._lost(exc)
            return
        self.matcher.fail_all(exc)
        if not self._closed:
            self.transport.ctx.on_peer_lost(self.peer, exc)

    @property
    def reading(self) -> bool:
        return not self._reader.done()

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
        self._close_socks()


class LazyTcpEndpoint(Endpoint):
    """HETCCL_CONNECT=lazy: the connections to one peer, made on first use, one per direction. This rank dials
    its own (`out`, which it sends on) the first time it sends to the peer or waits for it: a dead peer then
    shows at once, as with connections made at init. The peer's own dial arrives through the listener
    (`inbound`, whose reader delivers the peer's frames). Both share the peer's matcher, and each direction
    keeps its frames in order on its one connection."""

    def __init__(self, transport: TcpTransport, peer: int, record: dict[str, Any]):
        self.transport, self.peer, self.record = transport, peer, record
        self.matcher = transport.ctx.new_matcher(peer)
        self.nlanes, self.split = transport.pair_shape(record)
        self.out: TcpEndpoint | None = None
        self.inbound: TcpEndpoint | None = None
        self._dialing: asyncio.Task[TcpEndpoint] | None = None
        self._closed = False

    @property
    def connected(self) -> bool:
        return self.out is not None or self.inbound is not None

    def _dial(self) -> asyncio.Task[TcpEndpoint]:
        if self._dialing is None:
            self._dialing = asyncio.get_running_loop().create_task(self._dial_out())
            self._dialing.add_done_callback(self._dialed)
        return self._dialing

    async def _dial_out(self) -> TcpEndpoint:
        t = self.transport
        got = await asyncio.gather(*(t._dial(self.peer, self.record, lane) for lane in range(self.nlanes)),
                                   return_exceptions=True)
        errors = [g for g in got if isinstance(g, BaseException)]
        if errors or self._closed:
            for g in got:
                if isinstance(g, socket.socket):
                    g.close()
            raise errors[0] if errors else PeerLostError("communicator closed", self.peer)
        self.out = TcpEndpoint(t, self.peer, got[0], got[1:], self.split, self.matcher, self._out_ended)
        t._endpoints.append(self.out)
        return self.out

    def _dialed(self, task: asyncio.Task) -> None:
        """A failed dial is the peer's loss (or its deadline), for every receive from it too."""
        if task.cancelled() or task.exception() is None or self._closed:
            return
        exc = task.exception()
        self.matcher.fail_all(exc)
        if isinstance(exc, PeerLostError):
            self.transport.ctx.on_peer_lost(self.peer, exc)

    def _out_ended(self, exc: BaseException) -> None:
        """The connection this rank sends on ended. The peer sends on the other one: a peer that leaves after a
        loss sends its goodbye there, naming the rank that died, and only that connection keeps the goodbye
        ahead of its end. So while it still reads, it reports; after OUT_GRACE_S this one does."""
        def report() -> None:
            if self._closed or self.matcher.error is not None:
                return
            self.matcher.fail_all(exc)
            self.transport.ctx.on_peer_lost(self.peer, exc)

        log.debug("hetccl tcp: rank %d: the connection it sends to rank %d on ended (%s); inbound %s", self.matcher.me,
                  self.peer, exc, "reading" if self.inbound is not None and self.inbound.reading else self.inbound)
        if self.inbound is not None and self.inbound.reading:
            asyncio.get_running_loop().call_later(OUT_GRACE_S, report)
        else:
            report()

    def attach(self, socks: list[socket.socket]) -> None:
        """The peer's own connection(s), accepted by the listener."""
        if self._closed:
            for sk in socks:
                sk.close()
            return
        self.inbound = TcpEndpoint(self.transport, self.peer, socks[0], socks[1:], self.split, self.matcher)
        log.debug("hetccl tcp: rank %d: rank %d connected (lazy)", self.matcher.me, self.peer)
        self.transport._endpoints.append(self.inbound)

    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None:
        if self.matcher.error is not None:
            raise self.matcher.error
        out = self.out or await asyncio.shield(self._dial())
        await out.send(fp, tag, src)

    def post_recv(self, fp: Fingerprint, tag: int, dst: np.ndarray, reduce: Any = None) -> asyncio.Future:
        if self.out is None and not self._closed:
            self._dial()  # the peer's liveness, and its sends may start
        return self.matcher.post(fp, tag, dst, reduce)

    async def close(self) -> None:
        self._closed = True
        if self._dialing is not None and not self._dialing.done():
            self._dialing.cancel()
            with contextlib.suppress(BaseException):
                await self._dialing
        # the transport closes `out` and `inbound` with its other endpoints


class TcpTransport(Transport):
    name = "tcp"
    api_version = 2
    # calibrated with `hetccl bench` on a 2-core host (README): its ring steps pay per-chunk task overhead.
    # ring chunks up to 4 MiB: each frame costs ~70 us of framing, matching and pump hand-offs, which at 1 MiB
    # held a 64 MiB all_reduce at 2.9 GB/s on 16 cores against 3.5 (benchmarks/results/tcp-chunk-2026-12-01.md)
    properties = TransportProperties(latency_us=20, ring_step_us=18, bandwidth_gb_s=2, ring_chunk_bytes=4 << 20)
    priority = 10

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self._listener = PeerListener(ctx, "data", "tcp")
        self._lanes, self._split = lane_count(), pump_bytes()
        if not self._split:
            self._lanes = 1
        self._listener.lanes = self._lanes
        self._endpoints: list[TcpEndpoint] = []
        self._lazy: dict[int, LazyTcpEndpoint] = {}  # HETCCL_CONNECT=lazy: every peer's, connected on first use

    async def listen(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"host": self.ctx.bind_host, "port": self._listener.start()}
        if self._lanes > 1:
            rec["lanes"], rec["split"] = self._lanes, self._split
        return rec

    @property
    def refused(self) -> int:
        return self._listener.refused

    def can_reach(self, peer: int, peer_record: dict[str, Any], same_host: bool) -> bool:
        return "port" in peer_record

    def pair_shape(self, record: dict[str, Any]) -> tuple[int, int]:
        """(connections, split size) of the pair with the peer of `record`: the fewer lanes, the larger split."""
        return min(self._lanes, int(record.get("lanes", 1))), max(self._split, int(record.get("split", 0)))

    async def _dial(self, peer: int, record: dict[str, Any], lane: int = 0) -> socket.socket:
        return await dial(self.ctx, peer, record, "data", "tcp", lane=lane)

    async def connect(self, peers: dict[int, dict[str, Any]]) -> dict[int, Endpoint]:
        me = self.ctx.rank
        if connects_lazily(self.ctx.size):
            self._lazy = {p: LazyTcpEndpoint(self, p, r) for p, r in peers.items()}
            self._listener.arrived = self._arrived
            for p in self._listener.peers():  # dialled before this rank got here
                self._arrived(p, 0)
            return dict(self._lazy)

        async def conn(peer: int, record: dict[str, Any], lane: int) -> socket.socket:
            if peer < me:  # the higher rank dials
                return await self._dial(peer, record, lane)
            try:
                return await asyncio.wait_for(asyncio.shield(self._listener.incoming(peer, lane)),
                                              self.ctx.settings.timeout)
            except TimeoutError:
                raise CollectiveTimeout(f"rank {me}: rank {peer} never connected (TCP) within "
                                        f"{self.ctx.settings.timeout:.0f} s") from None

        async def one(peer: int, record: dict[str, Any]) -> tuple[int, TcpEndpoint]:
            nlanes, split = self.pair_shape(record)
            socks = list(await asyncio.gather(*(conn(peer, record, lane) for lane in range(nlanes))))
            ep = TcpEndpoint(self, peer, socks[0], socks[1:], split)
            self._endpoints.append(ep)
            return peer, ep

        pairs = await asyncio.gather(*(one(p, r) for p, r in peers.items()))
        return dict(pairs)

    def _arrived(self, peer: int, lane: int) -> None:
        """Lazy: a connection from `peer` was accepted; once all its lanes are, they are its inbound endpoint."""
        ep = self._lazy.get(peer)
        if ep is None or ep.inbound is not None:
            return
        futs = [self._listener.incoming(peer, i) for i in range(ep.nlanes)]
        if all(f.done() and not f.cancelled() for f in futs):
            ep.attach([f.result() for f in futs])

    async def close(self) -> None:
        self._listener.close()
        await asyncio.gather(*(ep.close() for ep in self._lazy.values()))
        await asyncio.gather(*(ep.close() for ep in self._endpoints))
        self._endpoints.clear()
