"""Zero-copy cross-island link between two island leaders on one host.

Each leader's chunks go device -> shared memory -> the other leader's device with no CPU copy: one shared
segment, registered with the GPU runtime (cudaHostRegister) in both processes, holds a ring of slots per
direction; the sender copies a chunk from its device straight into a slot (D2H on a copy stream), publishes
it with a release store, and the receiver copies the slot into device scratch (H2D) and reduces it into its
buffer on the device. Slots are recycled through consumed counters. The CPU only moves counters.

Used by the hierarchical all_reduce when exactly two islands' leaders share a host and both hold device
buffers (the layout of two GPU vendors' islands on one machine); other layouts take the generic staged path.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from .. import native
from ..dtypes import ReduceOp
from ..errors import CollectiveTimeout, TransportError
from ..transports.shm import _Segment
from .runtime import reduce_inplace, torch_mod, wait_event

SLOTS = 8
HEADER = 4096  # counters: produced[d] at 0 + 256*d, consumed[d] at 128 + 256*d (own cache lines)


class PairLink:
    def __init__(self, seg: _Segment, me: int, slot_bytes: int, device: Any):
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
        self.scratch = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]

    def slot(self, direction: int, seq: int) -> Any:
        off = HEADER + (direction * SLOTS + seq % SLOTS) * self.slot_bytes
        return self.host[off: off + self.slot_bytes]

    @classmethod
    async def create(cls, leaders: Any, device: Any, slot_bytes: int, timeout: float) -> PairLink:
        torch = torch_mod()
        fab = leaders._fabric
        me = leaders.rank
        name = f"hetccl-{fab.job}-pair-{leaders.comm_id:x}"
        size = HEADER + 2 * SLOTS * slot_bytes
        key = f"{fab.job}/pair/{leaders.comm_id}"
        if me == 0:
            seg = _Segment(name, size, create=True)
            await fab.store.set(f"{key}/created", 1)
            await fab.store.get(f"{key}/mapped", timeout=timeout)
            _Segment.unlink(name)  # both have it mapped: nothing can leak from here on
        else:
            await fab.store.get(f"{key}/created", timeout=timeout)
            seg = _Segment(name, size, create=False)
            await fab.store.set(f"{key}/mapped", 1)
        ptr = int(native.ffi.cast("uintptr_t", seg.cbase))
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 1)  # 1 = portable: pinned for every context
        if int(err) != 0:
            raise TransportError(f"cudaHostRegister of the cross-island segment failed (error {int(err)}); "
                                 "set HETCCL_PAIRLINK=0 to stage through hetccl's host transports instead")
        return cls(seg, me, slot_bytes, device)

    async def _wait_counter(self, ptr: Any, target: int, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        spins = 0
        while self.lib.hccl_load_acquire(ptr) < target:
            spins += 1
            if spins % 256 == 0 and loop.time() > deadline:
                raise CollectiveTimeout(f"cross-island link: {what} did not arrive before the deadline")
            await asyncio.sleep(0)

    async def all_reduce(self, t: Any, op: ReduceOp, stream: Any, deadline: float) -> None:
        torch = torch_mod()
        raw = t.view(torch.uint8)
        n = raw.numel()
        isz = t.element_size()
        step = (self.slot_bytes // isz) * isz
        chunks = [(off, min(step, n - off)) for off in range(0, n, step)]
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

        async def release() -> None:
            """Hand each slot back as soon as its copy to the device is done (not its reduction)."""
            for _ in chunks:
                seq, ev = await copied.get()
                await wait_event(ev, deadline, "shared-memory-to-device copy")
                self.lib.hccl_store_release(self.consumed[in_d], seq + 1)

        tasks = [asyncio.ensure_future(produce()), asyncio.ensure_future(consume()),
                 asyncio.ensure_future(release())]
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


def enabled() -> bool:
    return os.environ.get("HETCCL_PAIRLINK", "1") != "0"
