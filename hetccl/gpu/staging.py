"""Device data through host memory: what a collective of device buffers runs where no vendor CCL and no
zero-copy link joins the ranks.

- `small_all_reduce`: one copy to pinned host memory, the leaders' host all_reduce, one copy back;
- `staged_all_reduce`: the same pipelined by chunk (device-to-host copy of chunk k+1 overlapping the exchange
  of chunk k and the host-to-device copy of chunk k-1), the reduction on the host or, where every leader holds
  device memory, on the devices;
- `staged`: any collective on whole host copies of its device buffers.

The host collectives run on a group given by the caller (`Leaders`): this module knows nothing of
communicators or of the hierarchy above it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .. import params
from ..dtypes import Buf, DType, ReduceOp, as_buf
from ..errors import CollectiveTimeout
from . import codec
from .buffers import DeviceBuf
from .codec import LeaderChunks
from .runtime import as_tensor, copy_streams, lease, reduce_inplace, stream_of, torch_mod, use_device, wait_event

# one chunk of the cross-island pipeline (the host all_reduce of a chunk stays on recursive doubling)
STAGE_CHUNK = params.get("HETCCL_STAGE_BYTES")
# at most this many bytes, where the GPU-signalled link is not used, the leaders' all_reduce goes through host
# memory in one piece (a copy each way and hetccl's host all_reduce cost less than a pipeline's per-chunk set-up)
SMALL_BYTES = params.get("HETCCL_CROSS_SMALL_BYTES")
# small messages take the zero-copy link too when it is GPU-signalled (0: the host round trip below SMALL_BYTES)
PAIRLINK_SMALL = params.get("HETCCL_PAIRLINK_SMALL")
# three or more GPU leaders without the link all_reduce in a ring reduced on the devices (algorithms/staged_ring.py)
DEVICE_RING = params.get("HETCCL_STAGED_RING")


class Leaders(Protocol):
    """The host collectives of a group of ranks (group.Group): what staging and the link run between ranks."""

    rank: int
    size: int
    comm_id: int

    @property
    def fabric(self) -> Any: ...

    async def flat_all_reduce(self, buf: Buf, op: ReduceOp) -> None: ...

    async def flat_all_gather(self, out: Buf, inp: Buf) -> None: ...

    async def flat_all_to_all(self, out: Buf, inp: Buf) -> None: ...


async def small_all_reduce(leaders: Leaders, t: Any, op: ReduceOp, stream: Any, deadline: float) -> None:
    """all_reduce of a small device tensor among island leaders: one copy to pinned host memory, hetccl's host
    all_reduce, one copy back, all ordered on the caller's stream."""
    torch = torch_mod()
    raw = t.view(torch.uint8)
    n = raw.numel()
    with lease("pinned", t.device, max(SMALL_BYTES, n), 1) as pinned:
        host = pinned[0][:n]
        with torch.cuda.stream(stream):
            host.copy_(raw, non_blocking=True)
            out = torch.cuda.Event()
            out.record(stream)
        await wait_event(out, deadline, "device-to-host copy")
        await leaders.flat_all_reduce(as_buf(host.view(t.dtype)), op)
        with torch.cuda.stream(stream):
            raw.copy_(host, non_blocking=True)
            back = torch.cuda.Event()
            back.record(stream)
        await wait_event(back, deadline, "host-to-device copy")  # the pinned buffer is free for the next call


async def packed_all_reduce(leaders: Leaders, t: Any, op: ReduceOp, stream: Any, deadline: float,
                            chunks: LeaderChunks) -> None:
    """all_reduce of device tensor t among GPU leaders with a compressed wire, the same collectives as the
    ordered schedule's (one all_gather of packed bytes per chunk, in chunk order): the stream packs every chunk,
    the packed bytes go through pinned host memory, and the stream unpacks and reduces them in leader order."""
    torch = torch_mod()
    k, me = leaders.size, leaders.rank
    flat = t.view(-1)
    with lease("pinned", t.device, k * chunks.total, 1) as pinned, \
            lease("device", t.device, (k + 1) * chunks.total, 1) as scratch:
        host, mine, back = pinned[0], scratch[0][:chunks.total], scratch[0][chunks.total:]
        with torch.cuda.stream(stream):
            chunks.pack(mine, flat)
            for at, size in zip(chunks.starts, chunks.sizes, strict=True):
                host[k * at + me * size:k * at + (me + 1) * size].copy_(mine[at:at + size], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        await wait_event(copied, deadline, "device-to-host staging")
        arr = host.numpy()
        for at, size in zip(chunks.starts, chunks.sizes, strict=True):
            every = Buf(arr[k * at:k * (at + size)], DType.UINT8, k * size)
            await leaders.flat_all_gather(every, Buf(arr[k * at + me * size:k * at + (me + 1) * size], DType.UINT8,
                                                     size))
        with torch.cuda.stream(stream):
            back.copy_(host, non_blocking=True)
            chunks.reduce_span(0, len(chunks.sizes), flat, back, op, reduce_inplace)  # chunk j at k * starts[j]
            done = torch.cuda.Event()
            done.record(stream)
        await wait_event(done, deadline, "host-to-device staging")  # the leased buffers are free once copied


async def packed_all_gather(leaders: Leaders, every: Any, own: Any, stream: Any, deadline: float,
                            pieces: list[tuple[int, int]], slot: int, wire: int) -> None:
    """all_gather of device blocks `own` into `every` among GPU leaders with a compressed wire, the same
    collectives as the ordered schedule's (per piece, one all_gather of packed slots, in piece order): the
    stream packs every piece, the packed bytes cross through pinned memory, and the stream unpacks every
    leader's block, this leader's too."""
    n, m, kk = leaders.size, len(pieces), own.numel()
    await _packed_exchange(leaders, every.device, stream, deadline, m * slot, m * n * slot,
                           lambda sent: codec.pack_pieces(sent, own, pieces, slot, 1, 0, wire),
                           lambda i, sent, got: leaders.flat_all_gather(Buf(got[i * n * slot:(i + 1) * n * slot],
                                                                            DType.UINT8, n * slot),
                                                                        Buf(sent[i * slot:(i + 1) * slot],
                                                                            DType.UINT8, slot)),
                           m, lambda got: [codec.unpack_piece(every, got, pieces, slot, n, kk, i, wire)
                                           for i in range(m)])


async def packed_reduce_scatter(leaders: Leaders, region: Any, acc: Any, op: ReduceOp, stream: Any, deadline: float,
                                pieces: list[tuple[int, int]], slot: int, wire: int) -> None:
    """reduce_scatter of device tensor `acc` (a block of region's size per leader) into `region` among GPU
    leaders with a compressed wire, the same collectives as the ordered schedule's (per piece, one all_to_all
    of every leader's packed blocks): packed on the stream, crossed through pinned memory, reduced on the
    stream in leader order."""
    n, m, kk = leaders.size, len(pieces), region.numel()
    await _packed_exchange(leaders, region.device, stream, deadline, m * n * slot, m * n * slot,
                           lambda sent: codec.pack_pieces(sent, acc, pieces, slot, n, kk, wire),
                           lambda i, sent, got: leaders.flat_all_to_all(Buf(got[i * n * slot:(i + 1) * n * slot],
                                                                            DType.UINT8, n * slot),
                                                                        Buf(sent[i * n * slot:(i + 1) * n * slot],
                                                                            DType.UINT8, n * slot)),
                           m, lambda got: [codec.reduce_piece(region, got, pieces, slot, n, i, wire,
                                                              lambda d, s: reduce_inplace(d, s, op))
                                           for i in range(m)])


async def _packed_exchange(leaders: Leaders, device: Any, stream: Any, deadline: float, sent_bytes: int,
                           got_bytes: int, pack: Callable[[Any], None],
                           collective: Callable[[int, Any, Any], Awaitable[None]], count: int,
                           unpack: Callable[[Any], Any]) -> None:
    """Packed on the stream into device scratch, one copy to pinned memory, `count` host collectives in order
    (each from the pinned send bytes to the pinned receive bytes), one copy back, unpacked on the stream."""
    torch = torch_mod()
    with lease("pinned", device, sent_bytes + got_bytes, 1) as pinned, \
            lease("device", device, sent_bytes + got_bytes, 1) as scratch:
        host, dev = pinned[0], scratch[0]
        with torch.cuda.stream(stream):
            pack(dev[:sent_bytes])
            host[:sent_bytes].copy_(dev[:sent_bytes], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        await wait_event(copied, deadline, "device-to-host staging")
        arr = host.numpy()
        for i in range(count):
            await collective(i, arr[:sent_bytes], arr[sent_bytes:])
        with torch.cuda.stream(stream):
            dev[sent_bytes:].copy_(host[sent_bytes:], non_blocking=True)
            unpack(dev[sent_bytes:])
            done = torch.cuda.Event()
            done.record(stream)
        await wait_event(done, deadline, "host-to-device staging")  # the leased buffers are free once copied


async def staged_all_reduce(leaders: Leaders, t: Any, op: ReduceOp, stream: Any, deadline: float,
                            on_device: bool = False) -> None:
    """all_reduce of device tensor t among island leaders through pinned host memory, pipelined by chunk.

    on_device=False: each chunk goes through hetccl's host all_reduce (host reduction). on_device=True (every
    leader holds device memory): each chunk is all-gathered through host memory and the leaders' blocks are
    reduced on the device, in rank order, so that every leader computes bit-identical results. The chunks'
    host collectives start in chunk order on every leader, whichever device copy lands first."""
    torch = torch_mod()
    raw = t.view(torch.uint8)
    n = raw.numel()
    if n == 0:
        await leaders.flat_all_reduce(as_buf(torch.empty(0, dtype=t.dtype)), op)  # no device call: none is needed
        return
    isz = t.element_size()
    chunk = (STAGE_CHUNK // isz) * isz
    k = leaders.size
    slots = 3
    d2h, h2d = copy_streams(t.device)
    with contextlib.ExitStack() as held:
        pinned = held.enter_context(lease("pinned", t.device, chunk, slots))
        if on_device:
            gathered = held.enter_context(lease("pinned", t.device, k * chunk, slots))  # k blocks per slot
            scratch = held.enter_context(lease("device", t.device, k * chunk, slots))
        d2h.wait_stream(stream)  # ordered after the work already queued on the caller's stream
        free = [asyncio.Event() for _ in range(slots)]
        for ev in free:
            ev.set()
        tasks: list[asyncio.Future] = []
        started: asyncio.Future | None = None  # done once the previous chunk's host collective has begun

        async def exchange(off: int, size: int, slot: int, copied: Any, prev: asyncio.Future | None,
                           mine: asyncio.Future) -> None:
            try:
                await wait_event(copied, deadline, "device-to-host staging")
                if prev is not None:
                    await prev
                host = pinned[slot][:size]
                if on_device:
                    blocks = gathered[slot][:k * size]
                    coll = asyncio.ensure_future(leaders.flat_all_gather(as_buf(blocks.view(t.dtype)),
                                                                         as_buf(host.view(t.dtype))))
                else:  # hetccl host path: shm / tcp / verbs
                    coll = asyncio.ensure_future(leaders.flat_all_reduce(as_buf(host.view(t.dtype)), op))
                mine.set_result(None)  # coll takes its sequence number before the next chunk's task resumes
                await coll
                with torch.cuda.stream(h2d):
                    dst = raw[off: off + size]
                    if on_device:
                        dev = scratch[slot][:k * size]
                        dev.copy_(blocks, non_blocking=True)
                        dst.copy_(dev[:size], non_blocking=True)
                        for b in range(1, k):
                            reduce_inplace(dst.view(t.dtype), dev[b * size:(b + 1) * size].view(t.dtype), op)
                    else:
                        dst.copy_(host, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(h2d)
                await wait_event(done, deadline, "host-to-device staging")
            finally:
                if not mine.done():
                    mine.cancel()
                free[slot].set()  # also on failure: the loop below then sees the task's error at once

        loop = asyncio.get_running_loop()
        try:
            for i, off in enumerate(range(0, n, chunk)):
                size = min(chunk, n - off)
                slot = i % slots
                for task in tasks:  # a failed exchange frees no slot: surface its error instead of waiting
                    if task.done() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                try:
                    await asyncio.wait_for(free[slot].wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise CollectiveTimeout("cross-island staging: a pinned buffer was not released before the "
                                            "deadline") from None
                free[slot].clear()
                with torch.cuda.stream(d2h):
                    pinned[slot][:size].copy_(raw[off: off + size], non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(d2h)
                mine = loop.create_future()
                tasks.append(asyncio.ensure_future(exchange(off, size, slot, copied, started, mine)))
                started = mine
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    stream.wait_stream(h2d)  # work queued after the collective sees the result


async def staged(bufs: list[DeviceBuf | Buf | None], outputs: list[int],
                 on_host: Callable[[list[Buf | None]], Awaitable[None]]) -> None:
    """Run a host collective (on_host) on host copies of the device buffers among `bufs` and copy the outputs
    (indices into bufs) back, ordered on the caller's stream (copies between pageable host memory and the
    device complete before copy_ returns)."""
    torch = torch_mod()
    host: list[Any] = []
    for b in bufs:
        if isinstance(b, DeviceBuf):
            use_device(b.device)
            with torch.cuda.stream(stream_of(b)):
                host.append(as_tensor(b).to("cpu").contiguous())
        else:
            host.append(b)
    await on_host([as_buf(h) if h is not None and not isinstance(h, Buf) else h for h in host])
    for i in outputs:
        b = bufs[i]
        if isinstance(b, DeviceBuf):
            with torch.cuda.stream(stream_of(b)):
                as_tensor(b).copy_(host[i].reshape(-1))
