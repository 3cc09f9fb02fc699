"""Zero-copy cross-island link between two island leaders on one host.

Each leader's chunks go device -> shared memory -> the other leader's device with no CPU copy: one shared
segment, registered with the GPU runtime (cudaHostRegister) in both processes, holds a ring of slots per
direction; the sender copies a chunk from its device straight into a slot (D2H on a copy stream), publishes
it with a release store, and the receiver copies the slot into device scratch (H2D) and reduces it into its
buffer on the device. Slots are recycled through consumed counters. The CPU only moves counters.

Two ways to move the counters, agreed by both leaders when the link is made:

- GPU-signalled (default where the driver has stream memory operations, `bindings/streamops.py`): the copy
  streams write and wait for 32-bit counters in the shared segment themselves, so the whole collective is
  enqueued ahead and runs with no CPU in the loop; the host only waits for the end (with a deadline, and
  watching for a lost peer, in which case it releases the streams by overwriting the counters).
- CPU-signalled (fallback, `HETCCL_STREAM_MEMOPS=0`): asyncio tasks poll CUDA events and move 64-bit counters
  with release/acquire stores.

Used by the hierarchical all_reduce when exactly two islands' leaders share a host and both hold device
buffers (the layout of two GPU vendors' islands on one machine); other layouts take the generic staged path.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import native, params
from ..bindings.streamops import RawEvent
from ..dtypes import ReduceOp, as_buf
from ..errors import CollectiveTimeout, PeerLostError, TransportError
from ..shmseg import Segment
from ..transports.base import DeviceLink, TransportProperties
from . import numa
from .runtime import reduce_inplace, torch_mod, wait_event

if TYPE_CHECKING:
    from .staging import Leaders

# slots per direction: 16 x 4 MiB measured best on 2 H200 (8 starves the copy engines past 32 MiB; smaller
# chunks pay the counters' round trip more often)
SLOTS = params.get("HETCCL_PAIRLINK_SLOTS")
# counters, each on its own cache line: CPU-signalled produced[d] at 0 + 256*d, consumed[d] at 128 + 256*d
# (uint64); GPU-signalled produced[d] at 2048 + 256*d, consumed[d] at 2048 + 128 + 256*d (uint32)
HEADER = 4096
# at most this many bytes (and one slot), the GPU-signalled link takes its direct path (reads the peer's slot
# through the host mapping, one stream, no events): lower latency; larger messages pipeline by chunk
DIRECT_BYTES = params.get("HETCCL_PAIRLINK_DIRECT_BYTES")
GPU_COUNTERS = 2048
SCRATCH = 2
log = logging.getLogger("hetccl")


class PairLink(DeviceLink):
    name = "pairlink"
    min_ranks = max_ranks = 2
    # nominal (not measured here): chunks cross host memory by one D2H and one H2D copy per direction, bounded by
    # the PCIe link; rounds pay a stream round trip
    properties = TransportProperties(latency_us=15, ring_step_us=20, bandwidth_gb_s=20, same_host_only=True,
                                     device_memory=True)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if enabled() else "HETCCL_PAIRLINK=0: GPU island leaders stage through hetccl's transports"

    def __init__(self, seg: Segment, me: int, slot_bytes: int, device: Any, ops: Any = None,
                 lost: Any = None):
        torch = torch_mod()
        self.seg, self.me, self.peer = seg, me, 1 - me
        self.slot_bytes = slot_bytes
        lib, ffi = native.lib, native.ffi
        self.lib = lib
        self.produced = [ffi.cast("uint64_t *", seg.cbase + 256 * d) for d in (0, 1)]
        self.consumed = [ffi.cast("uint64_t *", seg.cbase + 256 * d + 128) for d in (0, 1)]
        self.host = torch.frombuffer(seg.mm, dtype=torch.uint8)
        self.sent = 0
        self.received = 0
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)
        # two scratch buffers: the copy of chunk c+1 overlaps the reduction of chunk c; reuse of a scratch buffer
        # two chunks later is ordered by the copy stream itself
        self.scratch = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(SCRATCH)]
        self.ops = ops  # stream memory operations (GPU-signalled mode) or None
        self.lost = lost if lost is not None else {}  # the fabric's lost peers: a dead leader ends the wait
        self.broken: BaseException | None = None
        self.scratch_ptr = [b.data_ptr() for b in self.scratch]
        self.scratch_used = [False] * SCRATCH  # whether a reduction read scratch[k] (event ev[3 + k])
        self.base_ptr = int(ffi.cast("uintptr_t", seg.cbase))
        self.ev: list[int] | None = None  # GPU-signalled mode's driver events, made on first use
        self.device = device
        self.tail: int | None = None  # the stream of the last collective enqueued (_after_previous)
        self.mapped: Any = None
        if ops is not None:
            base = seg.cbase + GPU_COUNTERS
            self.counters32 = ffi.cast("uint32_t *", base)  # word index: 64*d (produced), 64*d + 32 (consumed)
            dev = ops.device_pointer(int(ffi.cast("uintptr_t", base)))
            self.dev_produced = [dev + 256 * d for d in (0, 1)]
            self.dev_consumed = [dev + 256 * d + 128 for d in (0, 1)]
            # the whole segment as a device tensor (the GPU reads host memory through its mapping): the direct
            # path reduces straight from the peer's slot, with no copy to scratch
            try:
                self.mapped = torch.as_tensor(_Mapped(ops.device_pointer(self.base_ptr), seg.size), device=device)
            except (RuntimeError, TypeError, TransportError) as exc:  # a runtime that will not wrap host memory
                log.info("hetccl: cross-island link without its direct path (%s)", exc)

    def slot_offset(self, direction: int, seq: int) -> int:
        return HEADER + (direction * SLOTS + seq % SLOTS) * self.slot_bytes

    def slot_ptr(self, direction: int, seq: int) -> int:
        return self.base_ptr + self.slot_offset(direction, seq)

    def slot(self, direction: int, seq: int) -> Any:
        off = self.slot_offset(direction, seq)
        return self.host[off: off + self.slot_bytes]

    def events(self) -> list[int]:
        """The GPU-signalled paths' driver events (start, sent, got, done per scratch, the last collective's
        end), made on first use in the link device's context."""
        if self.ev is None:
            with torch_mod().cuda.device(self.device):
                self.ev = [self.ops.event() for _ in range(3 + SCRATCH + 1)]  # and the tail (_ended)
        return self.ev

    @classmethod
    async def create(cls, leaders: Leaders, device: Any, slot_bytes: int, timeout: float) -> PairLink:
        torch = torch_mod()
        fab = leaders.fabric
        me = leaders.rank
        name = f"hetccl-{fab.job}-pair-{leaders.comm_id:x}"
        size = segment_bytes(slot_bytes)
        key = f"{fab.job}/pair/{leaders.comm_id}"
        place = placement()
        if me == 0:
            seg = Segment(name, size, create=True, touch=place == "none")
            await fab.store.set(f"{key}/created", 1)
            await fab.store.get(f"{key}/mapped", timeout=timeout)
            Segment.unlink(name)  # both have it mapped: nothing can leak from here on
        else:
            await fab.store.get(f"{key}/created", timeout=timeout)
            seg = Segment(name, size, create=False)
            await fab.store.set(f"{key}/mapped", 1)
        if place != "none":
            # each leader faults in one ring from a CPU next to its GPU (numa.py says why); both must be done
            # before either registers the segment, which would fault the rest in wherever it runs
            ring = me if place == "sender" else 1 - me
            node, cpus = numa.gpu_locality(torch.cuda.get_device_properties(device))
            lo = HEADER + ring * SLOTS * slot_bytes
            with numa.near(cpus) as moved:
                numa.touch(seg.mem[lo: lo + SLOTS * slot_bytes])
            log.debug("hetccl: cross-island ring %d placed near GPU %s (NUMA node %s, affinity %s)", ring,
                      device, node, "set" if moved else "unchanged")
            await fab.store.set(f"{key}/placed/{me}", 1)
            await fab.store.get(f"{key}/placed/{1 - me}", timeout=timeout)
        ptr = int(native.ffi.cast("uintptr_t", seg.cbase))
        # 1 | 2 = portable (pinned for every context) and mapped (the GPUs address it: the counters)
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 3)
        if int(err) != 0:
            raise TransportError(f"cudaHostRegister of the cross-island segment failed (error {int(err)}); "
                                 "set HETCCL_PAIRLINK=0 to stage through hetccl's host transports instead")
        ops, why = _stream_ops(torch, seg)
        both = np.array([1 if ops is not None else 0], dtype=np.int32)
        await leaders.flat_all_reduce(as_buf(both), ReduceOp.MIN)  # both leaders must signal the same way
        if ops is not None and not both[0]:
            ops, why = None, "the other leader cannot use stream memory operations"
        if ops is None:
            log.info("hetccl: cross-island link signalled by the CPU (%s)", why)
        link = cls(seg, me, slot_bytes, device, ops, fab.lost)
        direct = np.array([1 if link.mapped is not None else 0], dtype=np.int32)
        await leaders.flat_all_reduce(as_buf(direct), ReduceOp.MIN)  # both take the direct path, or neither
        if not direct[0]:
            link.mapped = None
        return link

    async def _wait_counter(self, ptr: Any, target: int, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        spins = 0
        while self.lib.hccl_load_acquire(ptr) < target:
            spins += 1
            if spins % 256 == 0 and loop.time() > deadline:
                raise CollectiveTimeout(f"cross-island link: {what} did not arrive before the deadline")
            await asyncio.sleep(0)

    async def all_reduce(self, t: Any, op: ReduceOp, stream: Any, deadline: float) -> None:
        """t = mine OP the other leader's, elementwise, ordered on `stream`; returns once complete."""
        if self.broken is not None:
            raise self.broken
        if self.ops is None:
            await self._all_reduce_cpu(t, op, stream, deadline)
            return
        await self._finish(self.enqueue_all_reduce(t, op, stream), deadline, "cross-island all_reduce")

    # ---- GPU-signalled: everything enqueued by the calling thread, then the host waits for the end ----------
    # `enqueue_*` make CUDA calls only on the calling thread and return the driver event of the end (recorded
    # on the caller's stream). The loop awaits it (`_finish`); a collective ordered on the caller's stream
    # (hierarchical.ordered_plan) instead has the stream store a word and waits for that, with no CUDA call
    # off the caller's thread and no host step at all between the two leaders' streams (NCCL's shape).

    def enqueue_all_reduce(self, t: Any, op: ReduceOp, stream: Any) -> int:
        if self.mapped is not None and 0 < t.numel() * t.element_size() <= min(DIRECT_BYTES, self.slot_bytes):
            return self._all_reduce_direct(t, op, stream)
        return self._exchange(t, t, op, stream)

    def enqueue_all_gather(self, t: Any, stream: Any) -> int:
        """t holds two equal halves, half `me` this leader's part: the other leader's lands in the other half."""
        half = t.numel() // 2
        mine, theirs = t[self.me * half:(self.me + 1) * half], t[self.peer * half:(self.peer + 1) * half]
        return self._exchange(mine, theirs, None, stream)

    def enqueue_reduce_scatter(self, out: Any, inp: Any, op: ReduceOp, stream: Any) -> int:
        """out = half `me` of inp OP the other leader's half `me` (inp holds two halves of out's size; only read).
        Each leader sends the half the other keeps: half of the buffer crosses, not an all_reduce's whole."""
        half = out.numel()
        with torch_mod().cuda.stream(stream):
            out.copy_(inp[self.me * half:(self.me + 1) * half])
        return self._exchange(inp[self.peer * half:(self.peer + 1) * half], out, op, stream)

    def _after_previous(self, stream: int) -> None:
        """Collectives on this link run in issue order whatever their streams (as NCCL's on its own stream):
        its counters and slots are a sequence, which two collectives in flight on two streams would break."""
        ev = self.events()[-1]
        if self.tail is not None and self.tail != stream:
            self.ops.wait_event(stream, ev)

    def _ended(self, stream: int) -> None:
        self.ops.record(self.events()[-1], stream)
        self.tail = stream

    async def _finish(self, last: int, deadline: float, what: str) -> None:
        try:
            await wait_event(RawEvent(self.ops, last), deadline, what, self.check_peer)
        except BaseException as exc:
            self.release(exc)
            raise

    def _chunks(self, t: Any) -> list[tuple[int, int]]:
        # whole slots: cutting a 4 MiB message into four 1 MiB chunks (to overlap its copies and reduction)
        # measured slower on 2 H200, 8.8 vs 12.5 GB/s; each chunk's hops cost more than the overlap gains
        n, isz = t.numel() * t.element_size(), t.element_size()
        step = (self.slot_bytes // isz) * isz
        return [(off, min(step, n - off)) for off in range(0, n, step)]

    def _all_reduce_direct(self, t: Any, op: ReduceOp, stream: Any) -> int:
        """One slot, one stream, no events: copy ours into our slot, publish, wait for the peer's, and reduce
        reading the peer's slot through the GPU's mapping of host memory; then hand the slot back. Small
        messages pay each cross-stream hop of the pipelined path in latency; this has none."""
        torch = torch_mod()
        ops, me, peer = self.ops, self.me, self.peer
        n, cs = t.numel() * t.element_size(), stream.cuda_stream
        s_out, s_in = self.sent, self.received
        self._after_previous(cs)
        if s_out >= SLOTS:
            ops.wait_geq(cs, self.dev_consumed[me], s_out - SLOTS + 1)
        ops.copy(self.slot_ptr(me, s_out), t.data_ptr(), n, cs)
        ops.write(cs, self.dev_produced[me], s_out + 1)
        ops.wait_geq(cs, self.dev_produced[peer], s_in + 1)
        off = self.slot_offset(peer, s_in)
        with torch.cuda.stream(stream):
            reduce_inplace(t, self.mapped[off: off + n].view(t.dtype), op)
        ops.write(cs, self.dev_consumed[peer], s_in + 1)
        done = self.events()[0]
        ops.record(done, cs)
        self._ended(cs)
        self.sent += 1
        self.received += 1
        return done

    async def all_gather(self, t: Any, stream: Any, deadline: float) -> None:
        """enqueue_all_gather, then wait for its end. GPU-signalled links only (the caller stages otherwise)."""
        if self.broken is not None:
            raise self.broken
        await self._finish(self.enqueue_all_gather(t, stream), deadline, "cross-island all_gather")

    async def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp, stream: Any, deadline: float) -> None:
        """enqueue_reduce_scatter, then wait for its end. GPU-signalled links only."""
        if self.broken is not None:
            raise self.broken
        await self._finish(self.enqueue_reduce_scatter(out, inp, op, stream), deadline,
                           "cross-island reduce_scatter")

    def _exchange(self, send: Any, recv: Any, op: ReduceOp | None, stream: Any) -> int:
        """Everything enqueued at once: per chunk of `send`, the sender's copy stream waits for a free slot (the
        peer's consumed counter), copies, and publishes (produced counter); the receiver's copy stream waits for
        the peer's produced counter and copies the slot, into `recv` itself (op None) or into scratch, then frees
        the slot; with op, the caller's stream reduces the chunk into `recv` once its own copy out (send may be
        recv) and the peer's copy in are done. Both leaders send as many bytes as they receive. Copies, counters
        and events are raw driver calls: the enqueue must stay well ahead of the copy engines."""
        torch = torch_mod()
        chunks = self._chunks(send)
        ops, me, peer = self.ops, self.me, self.peer
        ev_start, ev_sent, ev_got, *ev_done = self.events()[:3 + SCRATCH]
        d2h, h2d, cs = self.d2h.cuda_stream, self.h2d.cuda_stream, stream.cuda_stream
        self._after_previous(cs)
        if not chunks:
            self._ended(cs)
            ops.record(ev_start, cs)
            return ev_start
        ops.record(ev_start, cs)
        ops.wait_event(d2h, ev_start)  # our data as the caller's queued work leaves it
        if op is None:
            ops.wait_event(h2d, ev_start)  # nor is recv written before the caller's earlier work is done with it
        src, dst, isz = send.data_ptr(), recv.data_ptr(), recv.element_size()
        base_out, base_in = self.sent, self.received
        produced_me, consumed_me = self.dev_produced[me], self.dev_consumed[me]
        produced_peer, consumed_peer = self.dev_produced[peer], self.dev_consumed[peer]
        with torch.cuda.stream(stream):  # the reductions run on the caller's stream
            for c, (off, size) in enumerate(chunks):
                s_out, s_in = base_out + c, base_in + c
                if s_out >= SLOTS:
                    ops.wait_geq(d2h, consumed_me, s_out - SLOTS + 1)
                ops.copy(self.slot_ptr(me, s_out), src + off, size, d2h)
                ops.write(d2h, produced_me, s_out + 1)
                ops.record(ev_sent, d2h)
                if op is None:
                    ops.wait_geq(h2d, produced_peer, s_in + 1)
                    ops.copy(dst + off, self.slot_ptr(peer, s_in), size, h2d)
                    ops.write(h2d, consumed_peer, s_in + 1)
                    continue
                k = c % SCRATCH
                if self.scratch_used[k]:
                    ops.wait_event(h2d, ev_done[k])  # the reduction that last read scratch[k]
                ops.wait_geq(h2d, produced_peer, s_in + 1)
                ops.copy(self.scratch_ptr[k], self.slot_ptr(peer, s_in), size, h2d)
                ops.write(h2d, consumed_peer, s_in + 1)
                ops.record(ev_got, h2d)
                ops.wait_event(cs, ev_sent)  # our chunk left before the reduction overwrites it
                ops.wait_event(cs, ev_got)
                reduce_inplace(recv[off // isz: (off + size) // isz], self.scratch[k][:size].view(recv.dtype), op)
                ops.record(ev_done[k], cs)
                self.scratch_used[k] = True
        if op is None:  # the caller's stream: after our last chunk left and the peer's last landed
            ops.record(ev_got, h2d)
            ops.wait_event(cs, ev_sent)
            ops.wait_event(cs, ev_got)
            last = ev_done[0]
            ops.record(last, cs)
            self.scratch_used[0] = True
        else:
            last = ev_done[(len(chunks) - 1) % SCRATCH]
        self._ended(cs)
        self.sent += len(chunks)
        self.received += len(chunks)
        return last

    def check_peer(self) -> None:
        raise_if_lost(self.lost, "cross-island link")

    def release(self, exc: BaseException) -> None:
        """The collective failed with work still queued: overwrite every counter far ahead so that no copy
        stream waits forever on a peer that will not come, and refuse further use."""
        self.broken = self.broken or exc
        ahead = (max(self.sent, self.received) + (1 << 29)) & 0xFFFFFFFF
        for d in (0, 1):
            self.counters32[64 * d] = ahead
            self.counters32[64 * d + 32] = ahead

    async def _all_reduce_cpu(self, t: Any, op: ReduceOp, stream: Any, deadline: float) -> None:
        torch = torch_mod()
        raw = t.view(torch.uint8)
        chunks = self._chunks(t)
        if not chunks:
            return
        self.d2h.wait_stream(stream)  # after the work already queued on the caller's stream
        self.h2d.wait_stream(stream)
        out_d, in_d = self.me, self.peer
        d2h_done: list[asyncio.Future] = [asyncio.get_running_loop().create_future() for _ in chunks]
        base_out, base_in = self.sent, self.received

        async def produce() -> None:
            for c, (off, size) in enumerate(chunks):
                seq = base_out + c
                await self._wait_counter(self.consumed[out_d], seq - SLOTS + 1, deadline, "a free slot")
                with torch.cuda.stream(self.d2h):
                    self.slot(out_d, seq)[:size].copy_(raw[off: off + size], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.d2h)
                d2h_done[c].set_result(ev)
                await wait_event(ev, deadline, "device-to-shared-memory copy")
                self.lib.hccl_store_release(self.produced[out_d], seq + 1)

        copied: asyncio.Queue = asyncio.Queue()

        async def consume() -> None:
            for c, (off, size) in enumerate(chunks):
                seq = base_in + c
                await self._wait_counter(self.produced[in_d], seq + 1, deadline, "the peer island's chunk")
                sent_ev = await d2h_done[c]
                scratch = self.scratch[c % 2]
                with torch.cuda.stream(self.h2d):
                    self.h2d.wait_event(sent_ev)  # our own chunk left for the peer before we overwrite it
                    scratch[:size].copy_(self.slot(in_d, seq)[:size], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.h2d)
                    # both leaders compute mine OP theirs: the ops are commutative (a min/max tie between -0.0
                    # and +0.0 may keep either sign, as in NCCL)
                    reduce_inplace(raw[off: off + size].view(t.dtype), scratch[:size].view(t.dtype), op)
                copied.put_nowait((seq, ev))

        async def hand_back() -> None:
            """Hand each slot back as soon as its copy to the device is done (not its reduction)."""
            for _ in chunks:
                seq, ev = await copied.get()
                await wait_event(ev, deadline, "shared-memory-to-device copy")
                self.lib.hccl_store_release(self.consumed[in_d], seq + 1)

        tasks = [asyncio.ensure_future(produce()), asyncio.ensure_future(consume()),
                 asyncio.ensure_future(hand_back())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        self.sent += len(chunks)
        self.received += len(chunks)
        stream.wait_stream(self.h2d)  # work queued after the collective sees the result
        done = torch.cuda.Event()
        done.record(self.h2d)
        await wait_event(done, deadline, "cross-island reduction")  # like every collective: awaited = complete


class _Mapped:
    """A device pointer as __cuda_array_interface__ (bytes), for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _stream_ops(torch: Any, seg: Segment) -> tuple[Any, str]:
    """The stream memory operations, checked on the segment's counters, or (None, why not)."""
    from ..bindings.streamops import load_streamops

    try:
        ops = load_streamops("hip" if getattr(torch.version, "hip", None) else "cuda")
        ops.device_pointer(int(native.ffi.cast("uintptr_t", seg.cbase + GPU_COUNTERS)))
    except TransportError as exc:
        return None, str(exc)
    return ops, ""


def raise_if_lost(lost: dict[int, BaseException], what: str) -> None:
    """A link's wait ends once the fabric has lost a rank: its peer may be the one that will never come."""
    if lost:
        rank, exc = next(iter(lost.items()))
        raise PeerLostError(f"{what}: rank {rank} was lost ({exc})", rank)


def segment_bytes(slot_bytes: int) -> int:
    return HEADER + 2 * SLOTS * slot_bytes


def shm_room(nbytes: int) -> bool:
    """Whether /dev/shm can hold the segment (containers often give it 64 MiB: touching pages past its
    size would kill the process with SIGBUS, so check first)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= nbytes


def placement() -> str:
    """Which node each direction's ring lives on: near the GPU that reads it (default), near the one that
    writes it, or wherever the creating leader runs ("none", the placement before this setting existed)."""
    return params.get("HETCCL_PAIRLINK_PLACE")


def enabled() -> bool:
    return params.get("HETCCL_PAIRLINK")
