"""Zero-copy ring between three or more GPU island leaders on one host.

The pair link (pairlink.py) joins two leaders; this joins k >= 3 the same way, in a ring. Each leader owns an
inbox: a shared segment, registered with the GPU runtime in its own process and in its left neighbour's, that
holds SLOTS slots written by the left neighbour. all_reduce is a ring reduce-scatter then all-gather, cut into
chunks of one slot. A step of one chunk is three device operations and no CPU copy:

- the sender's copy stream waits for a free slot in its right neighbour's inbox (the consumed counter), copies
  the chunk from its device into the slot and publishes it (the produced counter);
- the receiver's copy stream waits for the produced counter, copies the slot to device scratch (reduce-scatter)
  or straight into its buffer (all-gather), and hands the slot back;
- reduce-scatter only: the caller's stream reduces the scratch into the buffer.

Counters are 32-bit words moved by stream memory operations (bindings/streamops.py), so the whole collective is
enqueued ahead and runs with no CPU in the loop; the host waits for the end with a deadline and watches for a
lost peer, whose wait it ends by overwriting the counters. The steps are enqueued step by step over a window of
chunks, so that a copy stream never waits on a chunk's previous step while later chunks could move.
Without stream memory operations there is no ring link, and the leaders take the staged path.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import native
from ..bindings.streamops import RawEvent
from ..dtypes import ReduceOp, as_buf, block_ranges
from ..errors import TransportError
from ..shmseg import Segment
from ..transports.base import DeviceLink
from .pairlink import SLOTS, PairLink, raise_if_lost, shm_room
from .runtime import reduce_inplace, torch_mod, wait_event

HEADER = 4096  # produced (uint32) at 0, consumed (uint32) at 128: each counter on its own cache line
PRODUCED, CONSUMED = 0, 128
log = logging.getLogger("hetccl")


def segment_bytes(slot_bytes: int) -> int:
    return HEADER + SLOTS * slot_bytes


class _Inbox:
    """One leader's inbox as this process sees it: the segment, its host and device addresses."""

    def __init__(self, seg: Segment, ops: Any):
        self.seg = seg
        self.host = int(native.ffi.cast("uintptr_t", seg.cbase))
        self.words = native.ffi.cast("uint32_t *", seg.cbase)
        self.dev = ops.device_pointer(self.host)

    def slot(self, seq: int, slot_bytes: int) -> int:
        return self.host + HEADER + (seq % SLOTS) * slot_bytes


class RingLink(DeviceLink):
    name = "ringlink"
    min_ranks = 3
    properties = PairLink.properties  # the same copies and segments, in a ring

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return PairLink.unavailable_reason()

    def __init__(self, inbox: _Inbox, outbox: _Inbox, rank: int, size: int, slot_bytes: int, device: Any,
                 ops: Any, lost: dict[int, Any], window: int):
        torch = torch_mod()
        self.inbox, self.outbox = inbox, outbox  # ours (the left neighbour writes it), the right neighbour's
        self.rank, self.size = rank, size
        self.slot_bytes, self.ops, self.lost = slot_bytes, ops, lost
        self.window = window
        self.sent = 0  # chunks sent to the right neighbour, and received from the left one, over the link's life
        self.received = 0
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)
        self.scratch = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(window)]
        self.scratch_used = [False] * window
        with torch.cuda.device(device):
            # start, sent (last device-to-inbox copy), end of each copy stream, done; got and reduced per chunk
            self.ev = [ops.event() for _ in range(5)]
            self.ev_got = [ops.event() for _ in range(window)]
            self.ev_red = [ops.event() for _ in range(window)]
        self.broken: BaseException | None = None

    @classmethod
    async def create(cls, leaders: Any, device: Any, slot_bytes: int, timeout: float) -> RingLink | None:
        """The ring, or None when some leader cannot take it (every leader gets the same answer)."""
        from ..bindings.streamops import load_streamops

        torch = torch_mod()
        fab = leaders.fabric
        me, k = leaders.rank, leaders.size
        size = segment_bytes(slot_bytes)
        try:
            ops = load_streamops("hip" if getattr(torch.version, "hip", None) else "cuda")
            why = "" if shm_room(size) else f"/dev/shm cannot hold its {size >> 20} MiB inbox"
        except TransportError as exc:
            ops, why = None, str(exc)
        able = np.array([0 if why else 1], dtype=np.int32)
        await leaders.flat_all_reduce(as_buf(able), ReduceOp.MIN)
        if not able[0]:
            log.info("hetccl: no zero-copy ring between the %d island leaders (%s); staging through hetccl's "
                     "transports", k, why or "another leader cannot take it")
            return None
        name = f"hetccl-{fab.job}-ring-{leaders.comm_id:x}-"
        key = f"{fab.job}/ring/{leaders.comm_id}"
        right = (me + 1) % k
        mine = Segment(name + str(me), size, create=True)
        await fab.store.set(f"{key}/created/{me}", 1)
        await fab.store.get(f"{key}/created/{right}", timeout=timeout)
        theirs = Segment(name + str(right), size, create=False)
        await fab.store.set(f"{key}/mapped/{right}", 1)
        await fab.store.get(f"{key}/mapped/{me}", timeout=timeout)
        Segment.unlink(name + str(me))  # both users have it mapped: nothing can leak from here on
        for seg in (mine, theirs):
            ptr = int(native.ffi.cast("uintptr_t", seg.cbase))
            err = torch.cuda.cudart().cudaHostRegister(ptr, size, 3)  # portable | mapped: the counters
            if int(err) != 0:
                raise TransportError(f"cudaHostRegister of a cross-island ring segment failed (error {int(err)}); "
                                     "set HETCCL_PAIRLINK=0 to stage through hetccl's host transports instead")
        link = cls(_Inbox(mine, ops), _Inbox(theirs, ops), me, k, slot_bytes, device, ops, fab.lost,
                   max(1, SLOTS // 2))
        # every leader is done with the store before any enqueues work that waits on the ring: a leader whose
        # streams wait for a peer may block in a CUDA call (the first launch of a kernel loads its module, which
        # waits for the context's queued work), and rank 0's blocked loop would leave the store unserved while a
        # peer still needs it to finish this setup (seen on one GPU shared by three islands: a hang)
        await leaders.flat_all_reduce(as_buf(np.zeros(1, dtype=np.int32)), ReduceOp.MAX)
        return link

    async def all_reduce(self, t: Any, op: ReduceOp, stream: Any, deadline: float) -> None:
        """t = OP over every leader's t, elementwise, ordered on `stream`; returns once complete. Each leader
        reduces the blocks in ring order, so a block's result is the same on every leader."""
        if self.broken is not None:
            raise self.broken
        torch = torch_mod()
        ops, k, r = self.ops, self.size, self.rank
        isz = t.element_size()
        step = self.slot_bytes // isz  # elements per chunk
        blocks = block_ranges(t.numel(), k)
        nch = max(1, -(-max(b - a for a, b in blocks) // step))
        ev_start, ev_sent, ev_d2h, ev_h2d, ev_done = self.ev
        d2h, h2d, cs = self.d2h.cuda_stream, self.h2d.cuda_stream, stream.cuda_stream
        base = t.data_ptr()
        ops.record(ev_start, cs)
        ops.wait_event(d2h, ev_start)  # our data as the caller's queued work leaves it
        ops.wait_event(h2d, ev_start)  # the all-gather writes into t
        out_produced, out_consumed = self.outbox.dev + PRODUCED, self.outbox.dev + CONSUMED
        in_produced, in_consumed = self.inbox.dev + PRODUCED, self.inbox.dev + CONSUMED

        def chunk(block: int, c: int) -> tuple[int, int]:
            lo, hi = blocks[block]
            a = min(lo + c * step, hi)
            return a, min(a + step, hi)

        with torch.cuda.stream(stream):  # the reductions run on the caller's stream
            for first in range(0, nch, self.window):
                wave = range(first, min(nch, first + self.window))
                for s in range(2 * (k - 1)):
                    scatter = s < k - 1
                    send_block = (r - s) % k if scatter else (r + 1 - (s - k + 1)) % k
                    recv_block = (send_block - 1) % k
                    for c in wave:
                        w = c - first
                        # send: the chunk as the previous step left it
                        if s > 0:
                            ops.wait_event(d2h, self.ev_red[w] if s <= k - 1 else self.ev_got[w])
                        if self.sent >= SLOTS:
                            ops.wait_geq(d2h, out_consumed, self.sent - SLOTS + 1)
                        a, b = chunk(send_block, c)
                        if b > a:
                            ops.copy(self.outbox.slot(self.sent, self.slot_bytes), base + a * isz, (b - a) * isz, d2h)
                        self.sent += 1
                        ops.write(d2h, out_produced, self.sent)
                        ops.record(ev_sent, d2h)
                        # receive
                        a, b = chunk(recv_block, c)
                        ops.wait_geq(h2d, in_produced, self.received + 1)
                        src = self.inbox.slot(self.received, self.slot_bytes)
                        if scatter:
                            if self.scratch_used[w]:
                                ops.wait_event(h2d, self.ev_red[w])  # the reduction that last read scratch[w]
                            if b > a:
                                ops.copy(self.scratch[w].data_ptr(), src, (b - a) * isz, h2d)
                        else:
                            ops.wait_event(h2d, ev_sent)  # this block's reduce-scatter send has left t
                            if b > a:
                                ops.copy(base + a * isz, src, (b - a) * isz, h2d)
                        self.received += 1
                        ops.write(h2d, in_consumed, self.received)
                        ops.record(self.ev_got[w], h2d)
                        if scatter:
                            ops.wait_event(cs, self.ev_got[w])
                            if b > a:
                                reduce_inplace(t[a:b], self.scratch[w][:(b - a) * isz].view(t.dtype), op)
                            ops.record(self.ev_red[w], cs)
                            self.scratch_used[w] = True
        ops.record(ev_d2h, d2h)
        ops.record(ev_h2d, h2d)
        ops.wait_event(cs, ev_d2h)  # work queued after the collective sees the result, and may change t
        ops.wait_event(cs, ev_h2d)
        ops.record(ev_done, cs)
        try:
            await wait_event(RawEvent(ops, ev_done), deadline, "cross-island ring all_reduce", self._check_peer)
        except BaseException as exc:
            self._release(exc)
            raise

    def _check_peer(self) -> None:
        raise_if_lost(self.lost, "cross-island ring")

    def _release(self, exc: BaseException) -> None:
        """The collective failed with work still queued: move every counter far ahead so that no copy stream
        waits forever on a peer that will not come, and refuse further use."""
        self.broken = self.broken or exc
        ahead = (max(self.sent, self.received) + (1 << 29)) & 0xFFFFFFFF
        for box in (self.inbox, self.outbox):
            box.words[PRODUCED // 4] = ahead
            box.words[CONSUMED // 4] = ahead
