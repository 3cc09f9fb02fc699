"""Shared-memory transport for ranks on one host.

Layout: every rank creates one segment in /dev/shm holding its *inbound* rings, one per local peer. A ring
is single-producer single-consumer: `head` (written by the sender) and `tail` (written by the receiver) on
their own cache lines, then S slots; a slot is a header page (the 48-byte data header plus fragment
offset/length/payload offset) and a payload area. A message longer than a slot is cut into fragments that
follow each other in the ring (a per-ring send queue keeps messages whole).

- Receives reduce or copy straight out of the slot into the destination (no intermediate copy); the
  payload sits at the same offset modulo 4096 as the sender's source, which keeps copies off the slow
  4K-aliasing path when both sides use similarly aligned buffers.
- Waiting: a receiver first spins briefly in C on the ring counters (less, and with sched_yield, when
  there are more local ranks than cores), then raises its `waiting` flag and sleeps in the event loop on a
  Unix-socket doorbell; a producer or consumer that moves a counter rings the other side's doorbell only
  when that flag is up (Dekker-style, with seq_cst fences), so a busy pipeline pays no syscalls.
- The doorbell sockets are authenticated (HMAC, like every data connection: listener.py's accept and dial,
  on an abstract Unix socket) and double as liveness: a
  peer that dies closes them and every pending receive from it fails with PeerLostError.
- Set-up meets no store: a segment appears under its name only whole (made under a private name, then
  renamed), the peers poll for it, and say on the doorbell that they mapped it. It is unlinked then, so
  nothing is left in /dev/shm after a crash; close() unlinks again in case a peer never arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections import deque
from typing import Any

import numpy as np

from .. import native, params
from ..config import usable_cpus
from ..errors import CollectiveTimeout, PeerLostError, ProtocolError
from ..matching import CONTROL_TAGS, DROP
from ..shmseg import Segment
from ..wire import DATA_HEADER, Fingerprint, pack_data_header, unpack_data_header
from .base import Endpoint, Transport, TransportContext, TransportProperties
from .listener import PeerListener, dial

log = logging.getLogger("hetccl")
ffi, lib = native.ffi, native.lib

PAGE = 4096
SEG_HEADER = PAGE  # waiting flag at offset 0
RING_HEADER = PAGE  # head at 0, tail at 128
FRAG = struct.Struct("<QII")  # fragment offset, fragment length, payload offset in the slot
HDR_LEN = DATA_HEADER.size
SLOT_HDR = HDR_LEN + FRAG.size
MAPPED = b"M"  # a doorbell's first byte: its sender mapped every segment it needs (wake-ups are 1 and 2)


def _slot_bytes() -> int:
    return params.get("HETCCL_SHM_SLOT_BYTES")


def _num_slots() -> int:
    return params.get("HETCCL_SHM_SLOTS")


class _Ring:
    """One SPSC ring as seen by one side."""

    __slots__ = ("base", "head", "tail", "slots", "slot_bytes", "stride", "mem", "peer", "cur", "offsets")

    def __init__(self, mem: np.ndarray, cbase: Any, offset: int, slots: int, slot_bytes: int, peer: int):
        self.mem = mem
        self.base = offset
        self.head = ffi.cast("uint64_t *", cbase + offset)
        self.tail = ffi.cast("uint64_t *", cbase + offset + 128)
        self.slots, self.slot_bytes = slots, slot_bytes
        self.stride = PAGE + slot_bytes + PAGE
        self.peer = peer
        self.cur: list[Any] | None = None  # message being received: [req-or-None, early, fp, tag, total]
        self.offsets = [self.slot(i) for i in range(slots)]  # (header, payload area) per slot

    @staticmethod
    def size(slots: int, slot_bytes: int) -> int:
        return RING_HEADER + slots * (PAGE + slot_bytes + PAGE)

    def slot(self, index: int) -> tuple[int, int]:
        """(header offset, payload area offset) of slot index (mod slots)."""
        s = self.base + RING_HEADER + (index % self.slots) * self.stride
        return s, s + PAGE


class _ShmRecv:
    """Awaitable receive: spins briefly in C before sleeping on the future (small-message latency)."""

    __slots__ = ("fut", "tr", "peer")

    def __init__(self, fut: asyncio.Future, tr: ShmTransport, peer: int):
        self.fut, self.tr, self.peer = fut, tr, peer

    def __await__(self) -> Any:
        if not self.fut.done():
            self.tr.spin_until(self.fut, self.peer)
        if not self.fut.done():
            self.tr.kick()
        return (yield from self.fut.__await__())

    def done(self) -> bool:
        return self.fut.done()


class ShmEndpoint(Endpoint):
    def __init__(self, tr: ShmTransport, peer: int, out_ring: _Ring, peer_waiting: Any, bell: socket.socket):
        self.tr, self.peer, self.out = tr, peer, out_ring
        self.peer_waiting = peer_waiting
        self.bell = bell
        self.matcher = tr.ctx.new_matcher(peer)  # the core's: frames are delivered to it
        self.sendq: deque[list[Any]] = deque()  # [hdr bytes, src, offset, future]
        self.out_cbase = tr.peer_cbase[peer]
        self.out_mm = tr.peer_segs[peer].mm

    # -- sending ---------------------------------------------------------------------------------------
    def ring_bell(self) -> None:
        if lib.hccl_fetch_add(self.peer_waiting, 0):
            with contextlib.suppress(BlockingIOError, OSError):
                self.bell.send(b"\x01")

    def _push(self, item: list[Any]) -> bool:
        """Copy as many fragments of item as fit; True when the message is fully in the ring."""
        hdr, src, off = item[0], item[1], item[2]
        ring, cbase, mm = self.out, self.out_cbase, self.out_mm
        n = len(src)
        csrc = ffi.from_buffer("char[]", src) if n else ffi.NULL
        src_addr = int(ffi.cast("uintptr_t", csrc))
        pushed = False
        head_p, tail_p, slots, offsets, slot_bytes = ring.head, ring.tail, ring.slots, ring.offsets, ring.slot_bytes
        while True:
            head = lib.hccl_load_acquire(head_p)
            if head - lib.hccl_load_acquire(tail_p) >= slots:
                break
            hoff, poff = offsets[head % slots]
            flen = min(slot_bytes, n - off)
            pay = (src_addr + off) % PAGE
            mm[hoff: hoff + HDR_LEN] = hdr
            FRAG.pack_into(mm, hoff + HDR_LEN, off, flen, pay)
            if flen:
                lib.hccl_copy(cbase + poff + pay, csrc + off, flen)
            lib.hccl_store_release(head_p, head + 1)
            pushed = True
            off += flen
            if off >= n:
                item[2] = off
                self.ring_bell()
                return True
        item[2] = off
        if pushed:
            self.ring_bell()
        return False

    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None:
        if self.matcher.error is not None:
            raise self.matcher.error
        item = [pack_data_header(fp, tag, len(src)), src, 0, None]
        if not self.sendq and self._push(item):
            if tag in CONTROL_TAGS:
                self._wake_peer()
            return
        item[3] = asyncio.get_running_loop().create_future()
        self.sendq.append(item)
        self.tr.kick()
        await item[3]
        if tag in CONTROL_TAGS:
            self._wake_peer()

    def _wake_peer(self) -> None:
        """Ring the doorbell whatever the peer's waiting flag: a control message (mismatch notice, report
        request) must be read by a peer that is not receiving anything."""
        with contextlib.suppress(BlockingIOError, OSError):
            self.bell.send(b"\x02")

    def pump_sends(self) -> bool:
        progressed = False
        while self.sendq:
            item = self.sendq[0]
            before = item[2]
            done = self._push(item)
            progressed |= item[2] != before or done
            if not done:
                break
            self.sendq.popleft()
            if not item[3].done():
                item[3].set_result(None)
        return progressed

    # -- receiving -------------------------------------------------------------------------------------
    def post_recv(self, fp: Fingerprint, tag: int, dst: np.ndarray, reduce: Any = None) -> Any:
        fut = self.matcher.post(fp, tag, dst, reduce)
        if fut.done():
            return fut
        self.tr.progress_in(self.peer)
        return _ShmRecv(fut, self.tr, self.peer)

    def fail(self, exc: BaseException) -> None:
        self.matcher.fail_all(exc)  # a message half delivered included (Matcher.taken)
        exc = self.matcher.error or exc  # the first error stays (Matcher.fail_all)
        while self.sendq:
            item = self.sendq.popleft()
            if item[3] is not None and not item[3].done():
                item[3].set_exception(exc)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.tr.loop.remove_reader(self.bell.fileno())
        self.bell.close()


class ShmTransport(Transport):
    name = "shm"
    api_version = 2
    # calibrated with `hetccl bench` on a 2-core host (README): recursive doubling reduces straight out of the
    # shared slot (cheap rounds); a ring step pays per-chunk task overhead
    properties = TransportProperties(latency_us=5, ring_step_us=85, bandwidth_gb_s=8, same_host_only=True)
    priority = 100

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
            return "/dev/shm is missing or not writable"
        if not hasattr(socket, "AF_UNIX"):
            return "no Unix sockets on this platform"
        return None

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self.loop = asyncio.get_event_loop()
        self.slots, self.slot_bytes = _num_slots(), _slot_bytes()
        self.seg: Segment | None = None
        self.seg_name = ""
        self.in_rings: dict[int, _Ring] = {}
        self.eps: dict[int, ShmEndpoint] = {}
        self.peer_segs: dict[int, Segment] = {}
        self.peer_mem: dict[int, np.ndarray] = {}
        self.peer_cbase: dict[int, Any] = {}
        # the doorbells: authenticated Unix-socket connections, accepted and dialled as every transport does
        self._listener = PeerListener(ctx, "shm", "shm", unix_name=f"hetccl-{ctx.job}-{ctx.rank}")
        self._wake = asyncio.Event()
        self._poller: asyncio.Task | None = None
        self._ncpu = usable_cpus()
        self.spin_ns, self.yield_ns = 50_000, 0

    # -- set-up ----------------------------------------------------------------------------------------
    async def listen(self) -> dict[str, Any]:
        self.loop = asyncio.get_running_loop()
        self._listener.start()
        return {"uds": self._listener.unix_name, "slots": self.slots, "slot_bytes": self.slot_bytes}

    @property
    def refused(self) -> int:
        return self._listener.refused

    def can_reach(self, peer: int, peer_record: dict[str, Any], same_host: bool) -> bool:
        return same_host and peer_record.get("slots") == self.slots and \
            peer_record.get("slot_bytes") == self.slot_bytes

    async def _doorbell(self, peer: int, record: dict[str, Any]) -> socket.socket:
        """The authenticated doorbell connection to `peer` (listener.py: the higher rank dials)."""
        if peer < self.ctx.rank:
            return await dial(self.ctx, peer, record, "shm", "shared-memory doorbell", unix=True)
        try:
            return await asyncio.wait_for(asyncio.shield(self._listener.incoming(peer)), self.ctx.settings.timeout)
        except TimeoutError:
            raise CollectiveTimeout(f"rank {self.ctx.rank}: rank {peer} never rang the shared-memory doorbell") \
                from None

    async def _mapped(self, peer: int, bell: socket.socket) -> None:
        """Tell `peer` on the doorbell that this rank mapped every segment it needs (its first byte there), and
        wait for the same from it: then its segment may be unlinked. A wake-up can only follow that byte."""
        loop = self.loop
        try:
            await loop.sock_sendall(bell, MAPPED)
            got = await asyncio.wait_for(loop.sock_recv(bell, 1), self.ctx.settings.timeout)
        except TimeoutError:
            raise CollectiveTimeout(f"rank {self.ctx.rank}: rank {peer} never said it mapped the shared-memory "
                                    "segments") from None
        except OSError as exc:
            raise PeerLostError(f"rank {self.ctx.rank}: rank {peer} left while mapping the shared-memory segments "
                                f"({exc})", peer) from None
        if not got:
            raise PeerLostError(f"rank {self.ctx.rank}: rank {peer} left while mapping the shared-memory segments",
                                peer)
        if got != MAPPED:  # a peer of another hetccl version, or not hetccl's doorbell at all
            raise ProtocolError(f"rank {self.ctx.rank}: rank {peer} sent {got!r} on the shared-memory doorbell, "
                                f"where {MAPPED!r} (mapped) comes first; do all ranks run the same hetccl version?")

    async def connect(self, peers: dict[int, dict[str, Any]]) -> dict[int, Endpoint]:
        ctx = self.ctx
        local = sorted(ctx.local_ranks)
        oversubscribed = len(ctx.machine_ranks or local) > self._ncpu  # every rank on the machine spins here
        self.spin_ns, self.yield_ns = (2_000, 100_000) if oversubscribed else (50_000, 0)
        if not peers:
            return {}
        order = sorted(peers)
        ring_size = _Ring.size(self.slots, self.slot_bytes)
        size = SEG_HEADER + len(order) * ring_size
        self.seg_name = f"hetccl-{ctx.job}-{ctx.rank}"
        self.seg = Segment(self.seg_name, size, create=True, publish=False)
        for i, p in enumerate(order):
            self.in_rings[p] = _Ring(self.seg.mem, self.seg.cbase, SEG_HEADER + i * ring_size, self.slots,
                                     self.slot_bytes, p)
        # no store barrier (issue 32: a request per rank each): a segment appears under its name whole, and the
        # peers poll for it; they say they mapped it on the doorbell, after which it is unlinked
        self.seg.publish()
        for p in order:
            # my outbound ring to p lives in p's segment, at my index among p's peers
            their_peers = sorted(set(local) - {p})
            seg = await Segment.opened(f"hetccl-{ctx.job}-{p}", SEG_HEADER + len(their_peers) * ring_size,
                                       ctx.settings.timeout, f"rank {ctx.rank}: rank {p}'s shared-memory segment")
            self.peer_segs[p], self.peer_mem[p], self.peer_cbase[p] = seg, seg.mem, seg.cbase
        bells = await asyncio.gather(*(self._doorbell(p, peers[p]) for p in order))
        await asyncio.gather(*(self._mapped(p, bell) for p, bell in zip(order, bells, strict=True)))
        Segment.unlink(self.seg_name)  # everyone has it mapped: nothing can leak from here on
        for p, bell in zip(order, bells, strict=True):
            their_peers = sorted(set(local) - {p})
            seg = self.peer_segs[p]
            out = _Ring(seg.mem, seg.cbase, SEG_HEADER + their_peers.index(ctx.rank) * ring_size, self.slots,
                        self.slot_bytes, p)
            ep = ShmEndpoint(self, p, out, seg.waiting, bell)
            self.eps[p] = ep
            self.loop.add_reader(bell.fileno(), self._on_bell, p)
        return dict(self.eps)

    # -- progress --------------------------------------------------------------------------------------
    def _on_bell(self, peer: int) -> None:
        ep = self.eps.get(peer)
        if ep is None:
            return
        try:
            data = ep.bell.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(ep.bell.fileno())
            self.progress_in(peer)  # whatever it sent before dying is still valid
            exc = PeerLostError(f"rank {self.ctx.rank} lost rank {peer} (shared-memory peer exited)", peer)
            ep.fail(exc)
            self.ctx.on_peer_lost(peer, exc)
        elif b"\x02" in data:
            self.progress_in(peer)  # a control message for a rank that may be receiving nothing
        self._wake.set()

    def progress_in(self, peer: int) -> bool:
        """Consume frames of the ring from `peer`; True when anything moved."""
        ring = self.in_rings[peer]
        head_p, tail_p = ring.head, ring.tail
        tail = lib.hccl_load_acquire(tail_p)
        if lib.hccl_load_acquire(head_p) == tail:
            return False
        ep = self.eps.get(peer)
        if ep is None:
            return False
        m, mm, mem, cbase = ep.matcher, self.seg.mm, ring.mem, self.seg.cbase  # type: ignore[union-attr]
        slots, offsets = ring.slots, ring.offsets
        moved = False
        while True:
            hoff, poff = offsets[tail % slots]
            cur = ring.cur
            foff, flen, pay = FRAG.unpack_from(mm, hoff + HDR_LEN)
            if cur is None:
                fp, tag, total = unpack_data_header(mm[hoff: hoff + HDR_LEN], 1 << 62)
                req = m.take(fp, tag, total)
                early = None
                if req is DROP:
                    req = None  # read through and discard
                elif req is None:
                    if not m.has_room(total):
                        break  # leave it in the ring: the sender waits (flow control)
                    early = m.alloc(total)
                cur = ring.cur = [req, early, fp, tag, total]
            req, early = cur[0], cur[1]
            if flen:
                src = poff + pay
                if req is not None:
                    dst = req.dst
                    if foff or flen != len(dst):
                        dst = dst[foff: foff + flen]
                    if req.reduce is None:
                        lib.hccl_copy(ffi.from_buffer("char[]", dst, True), cbase + src, flen)
                    else:
                        req.reduce(dst, mem[src: src + flen])
                elif early is not None:
                    lib.hccl_copy(ffi.from_buffer("char[]", early, True) + foff, cbase + src, flen)
            tail += 1
            lib.hccl_store_release(tail_p, tail)
            moved = True
            if foff + flen >= cur[4]:
                ring.cur = None
                if req is not None:
                    if not req.fut.done():
                        req.fut.set_result(None)
                elif early is not None:
                    m.land(cur[2], cur[3], early)
            if lib.hccl_load_acquire(head_p) == tail:
                break
        if moved:
            ep.ring_bell()  # the sender may be waiting for space
        return moved

    def progress(self) -> bool:
        moved = False
        for p in self.in_rings:
            moved |= self.progress_in(p)
        for ep in self.eps.values():
            if ep.sendq:
                moved |= ep.pump_sends()
        return moved

    def _has_work(self) -> bool:
        return any(ep.sendq or ep.matcher.expecting for ep in self.eps.values()) or \
            any(r.cur is not None for r in self.in_rings.values())

    def spin_until(self, fut: asyncio.Future, peer: int) -> None:
        """Poll the ring from `peer`, spinning in C on its head between polls, until fut is done or the spin
        budget is spent (other rings and queued sends are served by the poller)."""
        ring = self.in_rings[peer]
        head_p, tail_p = ring.head, ring.tail
        deadline = lib.hccl_now_ns() + self.spin_ns + self.yield_ns
        while not fut.done():
            if self.progress_in(peer):
                continue
            if self._sending and self.progress():
                continue
            now = lib.hccl_now_ns()
            if now >= deadline:
                return
            spin = min(self.spin_ns, deadline - now)
            lib.hccl_wait_ne(head_p, lib.hccl_load_acquire(tail_p), spin, deadline - now - spin)

    @property
    def _sending(self) -> bool:
        return any(ep.sendq for ep in self.eps.values())

    def kick(self) -> None:
        """Make sure the poller runs while there is pending work."""
        if self._poller is None or self._poller.done():
            self._poller = self.loop.create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        """Progress pending work without spinning (the awaiting receive spins, see spin_until): poll while
        things move, else raise the waiting flag and sleep until a doorbell rings."""
        waiting = self.seg.waiting if self.seg is not None else None
        while self._has_work():
            if self.progress():
                await asyncio.sleep(0)
                continue
            self._wake.clear()
            if waiting is not None:
                lib.hccl_store_release(waiting, 1)
                lib.hccl_fetch_add(waiting, 0)  # full fence before the re-check (pairs with ring_bell)
                if self.progress():
                    lib.hccl_store_release(waiting, 0)
                    continue
            with contextlib.suppress(TimeoutError):
                # the doorbell wakes us; the timeout is only a safety net against a lost wake-up
                await asyncio.wait_for(self._wake.wait(), 0.05)
            if waiting is not None:
                lib.hccl_store_release(waiting, 0)

    async def close(self) -> None:
        self._listener.close()
        if self._poller is not None:
            self._poller.cancel()
        for ep in self.eps.values():
            ep.fail(PeerLostError("communicator closed", ep.peer))
            await ep.close()
        self.eps.clear()
        if self.seg_name:
            Segment.unlink(self.seg_name)
