"""Device-buffer collectives: the vendor CCL inside one island, the hierarchical path across islands.

Islands: every rank carries a label (HETCCL_ISLAND, else "nvidia"/"amd" when such a GPU is present, else
"cpu"). Ranks with different labels never share a vendor CCL. Within one communicator:

- one GPU island: the collective runs in the vendor CCL (NCCL/RCCL) on the caller's current stream;
- several islands: all_reduce is hierarchical — a reduce to each island's leader inside the island (vendor
  CCL, or hetccl's host algorithms on a CPU island), an all_reduce among the leaders over hetccl's own
  point-to-point transports with device data staged through pinned host memory chunk by chunk (device-to-
  host copy of chunk k+1 overlapping the exchange of chunk k and the host-to-device copy of chunk k-1),
  then a broadcast inside each island. The other collectives stage whole buffers through host memory and run
  hetccl's flat algorithms.

Every rank of a communicator must pass the same kind of memory as the other ranks of its island (device
buffers on GPU islands, host buffers on CPU islands).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import native
from ..config import parse_size
from ..dtypes import Buf, ReduceOp, as_buf, parse_op
from ..errors import CollectiveTimeout, ConfigError
from .buffers import DeviceBuf, as_device_buf, is_device
from .runtime import (
    as_tensor,
    copy_streams,
    divide_inplace,
    lease,
    reduce_inplace,
    stream_handle,
    stream_of,
    torch_mod,
    use_device,
    wait_event,
)
from .vendor_comm import VendorComm, blocking

if TYPE_CHECKING:
    from ..communicator import Communicator

log = logging.getLogger("hetccl")
GPU_LABELS = {"nvidia": "nvidia", "amd": "amd"}
# one chunk of the cross-island pipeline (the host all_reduce of a chunk stays on recursive doubling)
STAGE_CHUNK = parse_size(os.environ.get("HETCCL_STAGE_BYTES", "4M"))
# at most this many bytes, where the GPU-signalled link is not used, the leaders' all_reduce goes through host
# memory in one piece (a copy each way and hetccl's host all_reduce cost less than a pipeline's per-chunk set-up)
SMALL_BYTES = parse_size(os.environ.get("HETCCL_CROSS_SMALL_BYTES", "256K"))
# small messages take the zero-copy link too when it is GPU-signalled (0: the host round trip below SMALL_BYTES)
PAIRLINK_SMALL = os.environ.get("HETCCL_PAIRLINK_SMALL", "1") != "0"


def vendor_of(label: str) -> str | None:
    """'nvidia', 'amd' or None (CPU) for an island label; custom labels take the vendor of their prefix
    ('nvidia-a' is an NVIDIA island named a)."""
    base = label.split("-", 1)[0].split(":", 1)[0].lower()
    return GPU_LABELS.get(base)


@dataclass
class Layout:
    labels: list[str]
    islands: list[list[int]]  # comm ranks of each island, islands ordered by their lowest rank
    mine: int  # index of my island
    island_comm: Any = None  # hetccl communicator of my island (None when it is the whole communicator)
    leaders: Any = None  # hetccl communicator of the island leaders (None off leaders / single island)
    vendor_comms: dict[int, VendorComm] = field(default_factory=dict)
    vendor_pending: dict[int, asyncio.Task] = field(default_factory=dict)  # vendor communicators being made
    pairlink: Any = None  # zero-copy cross-island link (two GPU leaders on one host)

    @property
    def single(self) -> bool:
        return len(self.islands) == 1

    @property
    def my_members(self) -> list[int]:
        return self.islands[self.mine]


async def build_layout(comm: Communicator) -> Layout:
    """Collective over `comm` (called when it is created): its islands and, with several, the island and
    leader sub-communicators that the hierarchical path uses."""
    recs = comm._fabric.records
    labels = [recs[g].get("island", "cpu") for g in comm._members]
    order: dict[str, list[int]] = {}
    for r, lab in enumerate(labels):
        order.setdefault(lab, []).append(r)
    islands = list(order.values())
    mine = next(i for i, m in enumerate(islands) if comm.rank in m)
    lay = Layout(labels, islands, mine)
    if len(islands) > 1 and all(len(m) == 1 for m in islands):
        lay.leaders = comm  # every island is one rank: everybody leads
    elif len(islands) > 1:  # collective: every rank builds the same layout at the same point
        lay.island_comm = await comm.split(mine, key=comm.rank, _layout=False)
        lay.leaders = await comm.split(0 if comm.rank == islands[mine][0] else None, key=mine, _layout=False)
    comm._gpu_layout = lay
    return lay


async def layout(comm: Communicator) -> Layout:
    return comm._gpu_layout if comm._gpu_layout is not None else await build_layout(comm)


async def _vendor(comm: Communicator, lay: Layout, buf: DeviceBuf) -> VendorComm:
    vc = lay.vendor_comms.get(buf.device)
    if vc is not None:
        return vc
    # Created once, by a task that every concurrent caller awaits: collectives issued back to back while it is
    # being made (torch async ops, asyncio.gather) resume in issue order, so every rank enqueues them into
    # NCCL in the same order (NCCL requires it), and only one communicator is made per key.
    task = lay.vendor_pending.get(buf.device)
    if task is None:
        label = lay.labels[comm.rank]
        vendor = vendor_of(label)
        if vendor is None:
            raise ConfigError(f"rank {comm.rank} is on CPU island {label!r} but passed device memory; pass host "
                              "memory, or set HETCCL_ISLAND to a GPU label (e.g. nvidia)")
        members = lay.my_members
        sub = lay.island_comm or comm
        fab = comm._fabric
        # the same key on every island member (their devices differ): the island's n-th vendor communicator
        key = f"{fab.job}/vendor/{sub.comm_id}/{len(lay.vendor_comms) + len(lay.vendor_pending)}"

        async def make() -> VendorComm:
            try:
                made = await VendorComm.create(vendor, fab.store, key, members.index(comm.rank), len(members),
                                               buf.device, comm._settings.timeout, fab.lost,
                                               [comm._members[m] for m in members])
                lay.vendor_comms[buf.device] = made
                return made
            finally:
                lay.vendor_pending.pop(buf.device, None)

        task = lay.vendor_pending[buf.device] = asyncio.ensure_future(make())
    return await asyncio.shield(task)


async def _island_vendor(lay: Layout, buf: DeviceBuf) -> VendorComm:
    """The vendor communicator of this rank's island, owned by the island sub-communicator, so that the
    hierarchical all_reduce and the island's own collectives share one (one rendezvous key, one NCCL comm)."""
    isl = lay.island_comm
    return await _vendor(isl, await layout(isl), buf)


def _deadline(comm: Communicator) -> float:
    return asyncio.get_running_loop().time() + comm._settings.timeout


VendorCall = Callable[[VendorComm, int], int]


def _vendor_op(comm: Communicator, name: str, args: list[Any], kwargs: dict[str, Any]
               ) -> tuple[DeviceBuf, VendorCall, str]:
    """Check one single-island collective's device buffers and say how to enqueue it: (the buffer whose stream
    and device it runs on, call(vendor comm, stream handle) -> rc, a description). Device collectives inside
    an island take no sequence number: the vendor CCL matches them by enqueue order, and the torch backend
    enqueues them from the caller's thread, where the communicator's counter must not be touched."""
    comm._check_open()

    def arg(i: int, key: str, default: Any) -> Any:
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else default)

    if name in ("all_reduce", "broadcast", "reduce"):
        buf = as_device_buf(args[0], "buf")
        ptr, count, dt = buf.ptr, buf.count, buf.dtype
        if name == "all_reduce":
            rop = parse_op(arg(1, "op", "sum"))
            return buf, lambda vc, s: vc.lib.all_reduce(ptr, ptr, count, dt, rop, vc.comm, s), \
                f"all_reduce of {buf.nbytes} bytes"
        root = comm._root(arg(1, "root", 0))
        if name == "broadcast":
            return buf, lambda vc, s: vc.lib.broadcast(ptr, ptr, count, dt, root, vc.comm, s), "broadcast"
        rop = parse_op(arg(2, "op", "sum"))
        # NCCL writes the result on root only; other ranks' buffers are left as they were
        return buf, lambda vc, s: vc.lib.reduce(ptr, ptr, count, dt, rop, root, vc.comm, s), "reduce"
    out, inp = as_device_buf(args[0], "out"), as_device_buf(args[1], "inp")
    if out.dtype != inp.dtype:
        raise ConfigError(f"{name}: out and inp dtypes differ ({out.dtype.name.lower()} vs "
                          f"{inp.dtype.name.lower()}); use the same dtype for both")
    if name == "all_gather":
        if out.count != comm.size * inp.count:
            raise ConfigError(f"all_gather: out has {out.count} elements, needs size*len(inp) = "
                              f"{comm.size * inp.count}")
        return out, lambda vc, s: vc.lib.all_gather(inp.ptr, out.ptr, inp.count, out.dtype, vc.comm, s), \
            "all_gather"
    rop = parse_op(arg(2, "op", "sum"))
    if inp.count != comm.size * out.count:
        raise ConfigError(f"reduce_scatter: inp has {inp.count} elements, needs size*len(out) = "
                          f"{comm.size * out.count}")
    return out, lambda vc, s: vc.lib.reduce_scatter(inp.ptr, out.ptr, out.count, out.dtype, rop, vc.comm, s), \
        "reduce_scatter"


async def vendor_collective(comm: Communicator, name: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """A collective on device buffers inside one GPU island: the vendor CCL on the caller's stream."""
    buf, call, what = _vendor_op(comm, name, args, kwargs)
    use_device(buf.device)
    lay = await layout(comm)
    vc = await _vendor(comm, lay, buf)
    await vc.run(lambda s: call(vc, s), stream_handle(buf), _deadline(comm), what)


def _one_gpu_island(comm: Communicator) -> Layout | None:
    """comm's layout when it is one GPU island whose collectives the calling thread may enqueue (not blocking
    mode), else None: what enqueue_now and lane() both require."""
    lay = comm._gpu_layout
    if lay is None or not lay.single or vendor_of(lay.labels[comm.rank]) is None or blocking():
        return None
    return lay


def enqueue_now(comm: Communicator, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """The same, enqueued from the calling thread (the torch backend's caller, not hetccl's loop thread) when
    it can be: a single GPU island whose vendor communicator for the buffer's device exists. Returns the event
    recorded after the operation, or False where the caller must go through the loop instead (first use of a
    device, several islands, blocking mode). Raises the communicator's error (a lost peer, a watchdog timeout)
    like the loop path."""
    lay = _one_gpu_island(comm)
    if lay is None or lay.vendor_pending or name not in VENDOR_OPS + ("all_reduce",) \
            or not all(is_device(a) for a in args):
        return False
    buf, call, what = _vendor_op(comm, name, args, kwargs)
    vc = lay.vendor_comms.get(buf.device)
    if vc is None:
        return False
    deadline = time.monotonic() + comm._settings.timeout  # the loop's clock: asyncio uses time.monotonic
    return vc.run_now(lambda s: call(vc, s), buf.stream, deadline, what)


class IslandLane:
    """The collectives of a single-GPU-island communicator on one device, enqueued from the calling thread with
    everything that is fixed per device found once: the torch backend's hot path (ProcessGroupNCCL's, at a
    small message's cost). It takes raw arguments (pointers, counts, hetccl dtypes and ops, stream handles):
    the caller has checked its tensors. Each call returns the event recorded after the operation."""

    __slots__ = ("comm", "vc", "device", "_timeout")

    def __init__(self, comm: Communicator, vc: VendorComm):
        self.comm, self.vc, self.device = comm, vc, vc.device
        self._timeout = comm._settings.timeout

    def all_reduce(self, ptr: int, count: int, dtype: Any, op: ReduceOp, stream: int) -> Any:
        if self.comm._closed or self.comm._aborted is not None:
            self.comm._check_open()  # raises the reason
        vc = self.vc
        return vc.run_now(lambda s: vc.lib.all_reduce(ptr, ptr, count, dtype, op, vc.comm, s), stream,
                          time.monotonic() + self._timeout, "all_reduce")


def lane(comm: Communicator, device: int) -> IslandLane | None:
    """comm's fast lane on `device`: where enqueue_now would enqueue (one GPU island, not blocking, the vendor
    communicator of the device made), else None."""
    lay = _one_gpu_island(comm)
    vc = lay.vendor_comms.get(device) if lay is not None else None
    return IslandLane(comm, vc) if vc is not None else None


def _vendor_comms(comm: Communicator) -> list[VendorComm]:
    """Every vendor communicator of comm and of its sub-communicators (island, leaders, splits)."""
    out: list[VendorComm] = []
    todo, seen = [comm], set()
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        lay = c._gpu_layout
        if lay is not None:
            out.extend(lay.vendor_comms.values())
            todo.extend(x for x in (lay.island_comm, lay.leaders) if x is not None)
        todo.extend(c._children)
    return out


async def synchronize(comm: Communicator) -> None:
    """Wait for every device operation enqueued through comm (and its sub-communicators) to complete."""
    deadline = _deadline(comm)
    for vc in _vendor_comms(comm):
        await vc.drain(deadline)


async def hierarchical_all_reduce(comm: Communicator, obj: Any, op: Any) -> None:
    """Several islands: reduce to each island's leader, all_reduce among leaders (device data staged through
    pinned host memory), broadcast inside each island. Host buffers (CPU islands) take the same steps with
    hetccl's host algorithms, so every rank runs the same sequence of collectives."""
    rop = parse_op(op)
    lay = await layout(comm)
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    members = lay.my_members
    if not is_device(obj):
        b = as_buf(obj, "buf")
        comm._fp(1, b.dtype, b.count, -1, rop)
        if len(members) > 1:
            await lay.island_comm.reduce(obj, root=0, op=inner)
        if lay.leaders is not None and lay.leaders.size > 1:
            # the same chunks as a GPU leader's staging, so every leader issues the same collectives
            isz = b.dtype.itemsize
            step = STAGE_CHUNK // isz
            for off in range(0, max(b.count, 1), step):
                part = b.data[off * isz:(off + step) * isz]
                await lay.leaders._all_reduce_flat(Buf(part, b.dtype, len(part) // isz, obj), op=inner)
        if len(members) > 1:
            await lay.island_comm.broadcast(obj, root=0)
        if rop == ReduceOp.AVG:
            native.divide(b.data, b.dtype, comm.size)
        return
    buf = as_device_buf(obj, "buf")
    check_device_label(comm, lay, buf)
    use_device(buf.device)
    comm._fp(1, buf.dtype, buf.count, -1, rop)
    stream = stream_of(buf)
    t = as_tensor(buf)
    if len(members) > 1:
        vc = await _island_vendor(lay, buf)
        await vc.run(lambda s: vc.lib.reduce(buf.ptr, buf.ptr, buf.count, buf.dtype, inner, 0, vc.comm, s),
                     stream, _deadline(comm), "island reduce")
    if lay.leaders is not None and lay.leaders.size > 1:
        small = buf.nbytes <= SMALL_BYTES
        link = await _pairlink(comm, lay, t) if not small or PAIRLINK_SMALL else None
        if link is not None and (not small or link.ops is not None):
            # GPU-signalled, the link beats the host round trip at every size (no CPU wake-up in the loop)
            await link.all_reduce(t, inner, stream, _deadline(comm))
        elif small:
            await small_all_reduce(lay.leaders, t, inner, stream, _deadline(comm))
        else:
            # every leader a GPU: gather the chunks and reduce on the devices; a CPU leader reduces on the host
            # anyway, and then every leader runs the host all_reduce (the same collectives on all of them)
            on_device = all(vendor_of(lay.labels[m[0]]) is not None for m in lay.islands)
            await staged_all_reduce(lay.leaders, t, inner, stream, _deadline(comm), on_device)
    if len(members) > 1:
        vc = await _island_vendor(lay, buf)
        await vc.run(lambda s: vc.lib.broadcast(buf.ptr, buf.ptr, buf.count, buf.dtype, 0, vc.comm, s),
                     stream, _deadline(comm), "island broadcast")
    if rop == ReduceOp.AVG:
        torch = torch_mod()
        with torch.cuda.stream(stream):
            divide_inplace(t, comm.size)
        ev = torch.cuda.Event()
        ev.record(stream)
        await wait_event(ev, _deadline(comm), "avg division")


def check_device_label(comm: Communicator, lay: Layout, buf: DeviceBuf) -> None:
    """A rank's island label must agree with the memory it passes: a label names an island, the device says
    which vendor it is (a CPU label with GPU memory would otherwise stage silently through host memory)."""
    label = lay.labels[comm.rank]
    vendor = vendor_of(label)
    device_vendor = "amd" if buf.vendor == "hip" else "nvidia"
    if vendor != device_vendor:
        raise ConfigError(f"rank {comm.rank} (global rank {comm._members[comm.rank]}) has island label "
                          f"{label!r} but passed {device_vendor} device memory (GPU {buf.device}); label GPU "
                          f"ranks {device_vendor}-<name> in HETCCL_ISLAND (e.g. {device_vendor}-0), or pass "
                          "host memory on a CPU island")


async def _pairlink(comm: Communicator, lay: Layout, t: Any) -> Any:
    """The zero-copy link when exactly two GPU islands' leaders share a host, else None (decided from the
    layout alone, so both leaders agree)."""
    from . import pairlink

    leaders = lay.leaders
    if leaders.size != 2 or not pairlink.enabled():
        return None
    g = leaders._members
    fab = comm._fabric
    if not fab.topology.same_host(g[0], g[1]):
        return None
    if any(vendor_of(fab.records[x].get("island", "cpu")) is None for x in g):
        return None
    if lay.pairlink is None:
        need = pairlink.segment_bytes(STAGE_CHUNK)
        room = np.array([1 if pairlink.shm_room(need) else 0], dtype=np.int32)
        await leaders._all_reduce_flat(room, op="min")  # both leaders take the same path
        if room[0]:
            lay.pairlink = await pairlink.PairLink.create(leaders, t.device, STAGE_CHUNK, comm._settings.timeout)
        else:
            log.warning("hetccl: /dev/shm cannot hold the zero-copy cross-island link (%d MiB); staging through "
                        "hetccl's transports instead (enlarge /dev/shm, or lower HETCCL_STAGE_BYTES)", need >> 20)
            lay.pairlink = False
    if lay.pairlink is False:
        return None
    return lay.pairlink


async def small_all_reduce(leaders: Communicator, t: Any, op: ReduceOp, stream: Any, deadline: float) -> None:
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
        await leaders._all_reduce_flat(host.view(t.dtype), op=op)
        with torch.cuda.stream(stream):
            raw.copy_(host, non_blocking=True)
            back = torch.cuda.Event()
            back.record(stream)
        await wait_event(back, deadline, "host-to-device copy")  # the pinned buffer is free for the next call


async def staged_all_reduce(leaders: Communicator, t: Any, op: ReduceOp, stream: Any, deadline: float,
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
        await leaders._all_reduce_flat(t.cpu(), op=op)
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
                    coll = asyncio.ensure_future(leaders.all_gather(blocks.view(t.dtype), host.view(t.dtype),
                                                                    _flat=True))
                else:  # hetccl host path: shm / tcp / verbs
                    coll = asyncio.ensure_future(leaders._all_reduce_flat(host.view(t.dtype), op=op))
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


async def staged(comm: Communicator, name: str, args: list[Any], kwargs: dict[str, Any], outputs: list[int]
                 ) -> None:
    """Run a host-path collective on host copies of device buffers and copy the outputs back, ordered on the
    caller's stream (copies between pageable host memory and the device complete before copy_ returns)."""
    torch = torch_mod()
    host_args: list[Any] = []
    for a in args:
        if a is not None and is_device(a):
            buf = as_device_buf(a)
            use_device(buf.device)
            with torch.cuda.stream(stream_of(buf)):
                host_args.append(as_tensor(buf).to("cpu").contiguous())
        else:
            host_args.append(a)
    if name in ("all_gather", "reduce_scatter", "broadcast", "reduce"):
        kwargs = dict(kwargs, _flat=True)  # the flat host algorithm, as on host-memory ranks: same collectives
    await getattr(comm, name)(*host_args, **kwargs)
    for i in outputs:
        if args[i] is not None and is_device(args[i]):
            buf = as_device_buf(args[i])
            with torch.cuda.stream(stream_of(buf)):
                as_tensor(buf).copy_(host_args[i].reshape(-1))


VENDOR_OPS = ("all_gather", "reduce_scatter", "broadcast", "reduce")


async def collective(comm: Communicator, name: str, args: list[Any], kwargs: dict[str, Any], outputs: list[int]
                     ) -> None:
    """Device buffers for any collective but all_reduce: the vendor CCL on one GPU island, else staging."""
    lay = await layout(comm)
    nbufs = 1 if name in ("broadcast", "reduce") else 2
    mixed = not all(is_device(a) for a in args[:nbufs])  # e.g. a host output for a device input
    if mixed or not lay.single or name not in VENDOR_OPS or vendor_of(lay.labels[comm.rank]) is None:
        await staged(comm, name, args, kwargs, outputs)
        return
    await vendor_collective(comm, name, args, kwargs)
