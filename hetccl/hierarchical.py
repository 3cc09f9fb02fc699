"""The hierarchical schedule: a collective across islands as an island step, a leaders step and an island
step, as UCC's cl/hier schedules are.

Islands: every rank carries a label (HETCCL_ISLAND, else the GPU vendor present, else "cpu"); ranks with
different labels never share a vendor CCL. A communicator of several islands gets a `Layout`: its islands,
the sub-group of this rank's island and the sub-group of the island leaders (each island's lowest rank).
Each collective then runs steps on those flat groups (group.py):

- inside an island: the vendor CCL on device memory, hetccl's host algorithms on host memory;
- among the leaders: flat across islands. Device data goes through host memory (gpu/staging.py), all_reduce
  pipelined by chunk, or over the zero-copy link when the GPU leaders share a host (gpu/pairlink.py for two,
  gpu/ringlink.py for three or more);
- local copies (scratch, reordering, AVG's division) on the caller's stream.

Every rank of the communicator runs the same steps whatever memory it holds, so GPU and CPU islands mix. The
schedule does not depend on the memory type or the transport: the flat groups below choose those.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from . import compress, native
from .dtypes import Buf, DType, ReduceOp, as_buf
from .errors import CollectiveTimeout, ConfigError, HetcclError
from .gpu import codec, dispatch, pairlink, ringlink, staging, streamorder
from .gpu.buffers import DeviceBuf, as_device_buf
from .gpu.dispatch import vendor_of
from .gpu.runtime import (
    as_tensor,
    divide_inplace,
    on_stream,
    reduce_inplace,
    reduce_into,
    stream_of,
    torch_mod,
    use_device,
    wait_event,
)
from .group import Group, Mem
from .transports import registry
from .wire import CollOp

log = logging.getLogger("hetccl")


@dataclass
class Layout:
    labels: list[str]
    islands: list[list[int]]  # group ranks of each island, islands ordered by their lowest rank
    mine: int  # index of my island
    island_comm: Group | None = None  # the group of my island (None when it is the whole group)
    leaders: Group | None = None  # the group of the island leaders (None off leaders / single island)
    link: Any = None  # zero-copy link of the GPU leaders on one host (pair, or ring of 3+); False: none
    pair_link: bool | None = None  # _pair_link_applies, once known (it reads settings and records only)
    scratch: dict = field(default_factory=dict)  # device scratch of ordered collectives, per stream (_Island)

    @property
    def single(self) -> bool:
        return len(self.islands) == 1

    @property
    def my_members(self) -> list[int]:
        return self.islands[self.mine]


async def build_layout(group: Group) -> Layout:
    """Collective over `group` (called when it is created): its islands and, with several, the island and
    leader sub-groups that the hierarchical collectives use."""
    recs = group.fabric.records
    labels = [recs[g].get("island", "cpu") for g in group.members]
    order: dict[str, list[int]] = {}
    for r, lab in enumerate(labels):
        order.setdefault(lab, []).append(r)
    islands = list(order.values())
    mine = next(i for i, m in enumerate(islands) if group.rank in m)
    lay = Layout(labels, islands, mine)
    if len(islands) > 1 and all(len(m) == 1 for m in islands):
        lay.leaders = group  # every island is one rank: everybody leads
    elif len(islands) > 1:  # collective: every rank builds the same layout at the same point
        lay.island_comm = await group.split_group(mine, key=group.rank)
        lay.leaders = await group.split_group(0 if group.rank == islands[mine][0] else None, key=mine)
    group.island_layout = lay
    return lay


async def layout(group: Group) -> Layout:
    return group.island_layout if group.island_layout is not None else await build_layout(group)


async def run(group: Group, name: str, *args: Any) -> None:
    """One collective across islands, in issue order (ordering.py says why): `name` is one of SCHEDULES."""
    async with group.issue_order.turn(name, asyncio.get_running_loop().time() + group.settings.timeout):
        await SCHEDULES[name](group, *args)


def _deadline(group: Group) -> float:
    return asyncio.get_running_loop().time() + group.settings.timeout


_ORDERED_INFLIGHT = 3  # chunks of an ordered all_reduce whose leaders' exchanges run at once (staging's slots)


_MOST_PIECES = 16  # past this many stage chunks, the leaders' chunks grow instead (_chunks)


@functools.lru_cache(maxsize=256)
def _chunks(count: int, isz: int) -> tuple[tuple[int, int], ...]:
    """The byte ranges of the leaders' chunked all_reduce (and of a block's pieces in the ordered all_gather and
    reduce_scatter): the same on every leader, whatever its memory. Stage chunks, at most _MOST_PIECES of them:
    each piece of an ordered collective costs its caller's thread four driver operations and its host side a
    collective, and 50 pieces of 4 MiB held the thread 2.1 ms in a 200 MiB all_reduce (H100 shared by two
    ranks, 2026-12-07)."""
    per = -(-count * isz // _MOST_PIECES)
    step = max(staging.STAGE_CHUNK, -(-per // 4096) * 4096) // isz
    return tuple((off * isz, min(off + step, count) * isz) for off in range(0, max(count, 1), step))


@functools.lru_cache(maxsize=256)
def _chunk_elems(count: int, isz: int) -> tuple[tuple[int, int], ...]:
    """_chunks as element ranges (what the device side slices)."""
    return tuple((lo // isz, hi // isz) for lo, hi in _chunks(count, isz))


def first_hop(group: Group, b: Mem) -> Any:
    """b's values as all_reduce's leaders' step between islands sends them (compress.round_trip for host memory,
    its device twin codec.round_trip, the same bits, for device memory), or None where it sends them as they
    are (no compression for this buffer, the zero-copy link between GPUs of one host, or islands of several
    ranks, whose leaders send their island's sum rather than this rank's values)."""
    lay = group.island_layout
    if lay is None or lay.leaders is None or any(len(m) > 1 for m in lay.islands):
        return None
    wire = compress.wire_for(group.settings, b.dtype, b.nbytes)
    if not wire:
        return None
    if isinstance(b, DeviceBuf):
        if _link_joins(group, lay):
            return None
        return codec.round_trip(as_tensor(b), wire, _chunk_elems(b.count, b.dtype.itemsize), lay.leaders.size)
    return compress.round_trip(b, wire, _chunks(b.count, b.dtype.itemsize), lay.leaders.size)


def _link_joins(group: Group, lay: Layout) -> bool:
    """Whether all_reduce between these leaders takes the zero-copy pair link (two GPU leaders of one host, a
    link found usable), which crosses no wire and is never compressed."""
    return lay.link is not False and _pair_link_applies(group, lay)


async def all_reduce(group: Group, b: Mem, rop: ReduceOp, stage: Any = None) -> None:
    """Reduce to each island's leader, all_reduce among leaders (device data staged through pinned host
    memory, or over the zero-copy link), broadcast inside each island. Host buffers (CPU islands) take the
    same steps with hetccl's host algorithms, so every rank runs the same sequence of collectives. `stage`
    (islands of one rank, b its pinned host buffer): each chunk waits for its copy from the device and lets
    its copy back go (streamorder.Stage)."""
    lay = await layout(group)
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    members = lay.my_members
    if isinstance(b, Buf):
        group.next_fingerprint(CollOp.ALL_REDUCE, b.dtype, b.count, -1, rop)
        if len(members) > 1:
            await lay.island_comm.flat_reduce(b, 0, inner)
        if lay.leaders is not None and lay.leaders.size > 1:
            await _leaders_all_reduce_host(group, lay, b, rop, stage)
        if len(members) > 1:
            await lay.island_comm.flat_broadcast(b, 0)
        if rop == ReduceOp.AVG and stage is None:
            native.divide(b.data, b.dtype, group.size)
        return
    use_device(b.device)
    group.next_fingerprint(CollOp.ALL_REDUCE, b.dtype, b.count, -1, rop)
    stream = stream_of(b)
    t = as_tensor(b)
    if len(members) > 1:
        await lay.island_comm.flat_reduce(b, 0, inner)
    if lay.leaders is not None and lay.leaders.size > 1:
        small = b.nbytes <= staging.SMALL_BYTES
        wire = compress.wire_for(group.settings, b.dtype, b.nbytes)
        link = await _zero_copy_link(group, lay, t) if not small or staging.PAIRLINK_SMALL else None
        if wire and isinstance(link, ringlink.RingLink):
            link = None  # compressed, three or more leaders stage as the ordered schedule does (its link is the pair's)
        if link is not None and (not small or link.ops is not None):
            # GPU-signalled, the link beats the host round trip at every size (no CPU wake-up in the loop); it
            # crosses no wire, so nothing is compressed on it
            await link.all_reduce(t, inner, stream, _deadline(group))
        elif wire and _gpu_leaders(lay):  # the ordered schedule's collectives (_plan_leaders_all_reduce_on_device)
            await staging.packed_all_reduce(lay.leaders, t, inner, stream, _deadline(group),
                                            codec.LeaderChunks(_chunk_elems(b.count, b.dtype.itemsize),
                                                               lay.leaders.size, wire))
        elif wire:  # a CPU leader among them: the host's compressed schedule on a host copy
            await staging.staged([b], [0], lambda hb: _leaders_all_reduce_host(group, lay, hb[0], inner))
        elif small:
            await staging.small_all_reduce(lay.leaders, t, inner, stream, _deadline(group))
        else:
            # every leader a GPU: reduce on the devices in a ring (2(k-1)/k of the buffer each; with two leaders
            # the same bytes as gathering each chunk, but its chains overlap the copies and the wire better); a
            # CPU leader reduces on the host anyway, and then every leader runs the host all_reduce (the same
            # collectives)
            on_device = _gpu_leaders(lay)
            if on_device and staging.DEVICE_RING:
                await lay.leaders.flat_device_ring_all_reduce(b, inner)
            else:
                await staging.staged_all_reduce(lay.leaders, t, inner, stream, _deadline(group), on_device)
    if len(members) > 1:
        await lay.island_comm.flat_broadcast(b, 0)
    if rop == ReduceOp.AVG:
        torch = torch_mod()
        with torch.cuda.stream(stream):
            divide_inplace(t, group.size)
        ev = torch.cuda.Event()
        ev.record(stream)
        await wait_event(ev, _deadline(group), "avg division")


async def _leaders_all_reduce_host(group: Group, lay: Layout, b: Buf, rop: ReduceOp, stage: Any = None) -> None:
    """The leaders' step of all_reduce on host memory, chunk by chunk: the same chunks as a GPU leader's staging,
    so every leader issues the same collectives. `stage`: b is a stream's pinned copy (streamorder.Stage), each
    chunk waits for its arrival and is let go once reduced (and divided, for AVG)."""
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    isz = b.dtype.itemsize
    wire = compress.wire_for(group.settings, b.dtype, b.nbytes)
    if wire:  # compressed whole (its pieces are its own): a stage's copies all land first, and go back after
        chunks = _chunks(b.count, isz)
        for i in range(len(chunks) if stage is not None else 0):
            await stage.arrived(i, _deadline(group), "cross-island all_reduce")
        await compress.all_reduce(lay.leaders, b, inner, wire, chunks)
        for i in range(len(chunks) if stage is not None else 0):
            if rop == ReduceOp.AVG:
                native.divide(b.data[chunks[i][0]:chunks[i][1]], b.dtype, group.size)
            stage.done(i)
    for i, (lo, hi) in enumerate([] if wire else _chunks(b.count, isz)):
        part = Buf(b.data[lo:hi], b.dtype, (hi - lo) // isz, b.obj)
        if stage is not None:
            await stage.arrived(i, _deadline(group), "cross-island all_reduce")
        await lay.leaders.flat_all_reduce(part, inner)
        if stage is not None:
            if rop == ReduceOp.AVG:
                native.divide(part.data, b.dtype, group.size)
            stage.done(i)


async def _zero_copy_link(group: Group, lay: Layout, t: Any) -> Any:
    """The zero-copy link when every island leader holds a GPU and all share one host: the pair link for two
    leaders, the ring for more; else None (decided from the layout alone, so every leader agrees)."""
    leaders = lay.leaders
    link_cls = registry.device_link(leaders.size) if leaders.size >= 2 else None  # from what the links declare
    if link_cls is None:
        return None
    g = leaders.members
    fab = group.fabric
    if not all(fab.topology.same_host(g[0], x) for x in g[1:]):
        return None
    if any(vendor_of(fab.records[x].get("island", "cpu")) is None for x in g):
        return None
    if lay.link is None and link_cls is ringlink.RingLink:
        ring = await ringlink.RingLink.create(leaders, t.device, staging.STAGE_CHUNK, group.settings.timeout)
        lay.link = ring if ring is not None else False
    elif lay.link is None:
        need = pairlink.segment_bytes(staging.STAGE_CHUNK)
        room = np.array([1 if pairlink.shm_room(need) else 0], dtype=np.int32)
        await leaders.flat_all_reduce(as_buf(room), ReduceOp.MIN)  # both leaders take the same path
        if room[0]:
            lay.link = await pairlink.PairLink.create(leaders, t.device, staging.STAGE_CHUNK,
                                                          group.settings.timeout)
        else:
            log.warning("hetccl: /dev/shm cannot hold the zero-copy cross-island link (%d MiB); staging through "
                        "hetccl's transports instead (enlarge /dev/shm, or lower HETCCL_STAGE_BYTES)", need >> 20)
            lay.link = False
    if lay.link is False:
        return None
    return lay.link


class _View:
    """A flat view of a checked buffer for the local steps: a torch tensor for device memory, the Buf (bytes +
    dtype) for host memory, with slicing and scratch of the same kind; `mem` hands pieces to the groups."""

    def __init__(self, m: Mem):
        if isinstance(m, DeviceBuf):
            self.dev = True
            use_device(m.device)
            self.flat = as_tensor(m)
            # local steps (scratch, copies, division) run on the caller's stream, ordered with its work and with
            # the sub-collectives (which take that stream too), and scratch is allocated for that stream
            self.stream = stream_of(m)
        else:
            self.dev = False
            self.flat = m
            self.stream = None

    def __len__(self) -> int:
        return int(self.flat.shape[0]) if self.dev else self.flat.count

    def mem(self, x: Any) -> Mem:
        return as_device_buf(x) if self.dev else x

    def local(self) -> Any:
        return torch_mod().cuda.stream(self.stream) if self.dev else contextlib.nullcontext()

    def empty(self, count: int) -> Any:
        if self.dev:
            with self.local():
                return torch_mod().empty(count, dtype=self.flat.dtype, device=self.flat.device)
        dt = self.flat.dtype  # zeroed (calloc'd pages: no dearer): padding must not sway an fp8 scale (compress.py)
        return Buf(np.zeros(count * dt.itemsize, np.uint8), dt, count)

    def copy(self, dst: Any, src: Any) -> None:
        with self.local():
            if isinstance(dst, Buf):
                dst.data[...] = src.data
            else:
                dst.copy_(src)

    def divide(self, x: Any, divisor: int) -> None:
        with self.local():
            if isinstance(x, Buf):
                native.divide(x.data, x.dtype, divisor)
            else:
                divide_inplace(x, divisor)


def _sl(x: Any, a: int, b: int) -> Any:
    if isinstance(x, Buf):
        isz = x.dtype.itemsize
        return Buf(x.data[a * isz: b * isz], x.dtype, b - a, x.obj)
    return x[a:b]


async def broadcast(group: Group, b: Mem, root: int) -> None:
    lay = await layout(group)
    v = _View(b)
    group.next_fingerprint(CollOp.BROADCAST, None, len(v), root)
    root_island = next(i for i, m in enumerate(lay.islands) if root in m)
    members, isl = lay.my_members, lay.island_comm
    mine = lay.mine == root_island
    root_leads = lay.islands[root_island][0] == root
    if isl is not None and mine and not root_leads:  # root's island first: its leader gets the data
        await isl.flat_broadcast(b, members.index(root))
    if lay.leaders is not None and group.rank == members[0]:
        await lay.leaders.flat_broadcast(b, root_island)
    if isl is not None and not (mine and not root_leads):
        await isl.flat_broadcast(b, 0)


async def reduce(group: Group, b: Mem, root: int, rop: ReduceOp) -> None:
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    lay = await layout(group)
    v = _View(b)
    group.next_fingerprint(CollOp.REDUCE, None, len(v), root, rop)
    root_island = next(i for i, m in enumerate(lay.islands) if root in m)
    members, isl = lay.my_members, lay.island_comm
    leader = group.rank == members[0]
    # leaders accumulate in a copy: only root's buffer may change
    acc = v.flat
    if leader:
        acc = v.empty(len(v))
        v.copy(acc, v.flat)
    if isl is not None:
        await isl.flat_reduce(v.mem(acc) if leader else b, 0, inner)
    if lay.leaders is not None and leader:
        await lay.leaders.flat_reduce(v.mem(acc), root_island, inner)
    if lay.mine == root_island:
        if root == members[0]:
            v.copy(v.flat, acc)
        elif isl is not None:  # the island leader hands the result to root; others receive into scratch
            tmp = acc if leader else (v.flat if group.rank == root else v.empty(len(v)))
            await isl.flat_broadcast(v.mem(tmp), 0)
        if group.rank == root and rop == ReduceOp.AVG:
            v.divide(v.flat, group.size)


def _padded_blocks(lay: Layout, width: int, k: int) -> list[tuple[int, int]]:
    """(rank r's block start, r's block start in island-major blocks padded to `width` ranks an island), in
    elements of blocks of k: the reordering of all_gather's and reduce_scatter's padded schedules."""
    return [(r * k, (i * width + j) * k) for i, island in enumerate(lay.islands) for j, r in enumerate(island)]


def _rank_ordered(lay: Layout) -> bool:
    """Islands of one size whose ranks follow each other: island-major order is rank order, so the leaders'
    blocks are the caller's buffer itself (no padding, no reordering copies)."""
    width = len(lay.islands[0])
    order = [r for m in lay.islands for r in m]
    return all(len(m) == width for m in lay.islands) and order == list(range(len(order)))


def _device_leaders(lay: Layout, v: _View) -> bool:
    """Every island leader holds device memory (a GPU island's): their step stays on the devices."""
    return v.dev and all(vendor_of(lay.labels[m[0]]) is not None for m in lay.islands)


async def _leaders_all_gather(group: Group, lay: Layout, v: _View, every: Any, mine: Any) -> None:
    """The leaders' all_gather of their islands' blocks (`mine`, possibly `every`'s own block) into `every`:
    over the zero-copy pair link, else the staged ring on the devices, else hetccl's host algorithms."""
    leaders = lay.leaders
    o, i = v.mem(every), v.mem(mine)
    wire = compress.wire_for(group.settings, o.dtype, o.nbytes)
    piece = staging.STAGE_CHUNK // (o.dtype.itemsize * leaders.size)  # a stage chunk crosses per piece
    if _device_leaders(lay, v):
        link = await _zero_copy_link(group, lay, every)
        if link is not None and link.ops is not None and getattr(link, "all_gather", None) is not None:
            blk = len(every) // leaders.size
            own = every[leaders.rank * blk:(leaders.rank + 1) * blk]
            if own.data_ptr() != mine.data_ptr():
                v.copy(own, mine)
            return await link.all_gather(every, v.stream, _deadline(group))
        if wire:  # the ordered schedule's collectives (_plan_packed_all_gather), packed on the device
            pieces, slot = _packed_pieces(lay, mine.numel(), every.element_size(), wire)
            return await staging.packed_all_gather(leaders, every, mine, v.stream, _deadline(group), pieces, slot,
                                                   wire)
        return await leaders.flat_device_ring_all_gather(o, i)
    await (compress.all_gather(leaders, o, i, wire, piece) if wire else leaders.flat_all_gather(o, i))


async def _leaders_reduce_scatter(group: Group, lay: Layout, v: _View, region: Any, acc: Any, op: ReduceOp) -> None:
    """The leaders' reduce_scatter of their islands' sums (`acc`, only read) into each island's `region`: each
    leader moves (k-1)/k of acc, not an all_reduce of it."""
    leaders = lay.leaders
    o, i = v.mem(region), v.mem(acc)
    wire = compress.wire_for(group.settings, i.dtype, i.nbytes)
    piece = staging.STAGE_CHUNK // (i.dtype.itemsize * leaders.size)
    if _device_leaders(lay, v):
        link = await _zero_copy_link(group, lay, acc)
        if link is not None and link.ops is not None and getattr(link, "reduce_scatter", None) is not None:
            return await link.reduce_scatter(region, acc, op, v.stream, _deadline(group))
        if wire:  # the ordered schedule's collectives (_plan_packed_reduce_scatter), packed on the device
            pieces, slot = _packed_pieces(lay, region.numel(), region.element_size(), wire)
            return await staging.packed_reduce_scatter(leaders, region, acc, op, v.stream, _deadline(group), pieces,
                                                       slot, wire)
        return await leaders.flat_device_ring_reduce_scatter(o, i, op)
    await (compress.reduce_scatter(leaders, o, i, op, wire, piece) if wire
           else leaders.flat_reduce_scatter(o, i, op))


async def all_gather(group: Group, out: Mem, inp: Mem) -> None:
    """Gather inside each island, all_gather among leaders, broadcast inside each island. Where island-major
    order is rank order, every step works in the caller's output; otherwise in blocks padded to the largest
    island, reordered at the end."""
    lay = await layout(group)
    vo, vi = _View(out), _View(inp)
    k = len(vi)
    group.next_fingerprint(CollOp.ALL_GATHER, None, k)
    members, isl = lay.my_members, lay.island_comm
    width = max(len(m) for m in lay.islands)
    if _rank_ordered(lay):
        every = vo.flat
        lo = members[0] * k
        mine = _sl(every, lo, lo + len(members) * k)
    else:
        mine = vi.empty(width * k)  # this island's blocks, padded to the largest island
        every = vi.empty(len(lay.islands) * width * k)
    if isl is not None:
        await isl.flat_all_gather(vi.mem(_sl(mine, 0, len(members) * k)), inp)
    else:
        vi.copy(_sl(mine, 0, k), vi.flat)
    if lay.leaders is not None and group.rank == members[0]:
        await _leaders_all_gather(group, lay, vi, every, mine)
    if isl is not None:
        await isl.flat_broadcast(vi.mem(every), 0)
    if every is not vo.flat:
        for r0, a in _padded_blocks(lay, width, k):  # back to group rank order
            vi.copy(_sl(vo.flat, r0, r0 + k), _sl(every, a, a + k))


async def reduce_scatter(group: Group, out: Mem, inp: Mem, rop: ReduceOp) -> None:
    """Reduce each island's input to its leader, reduce_scatter among leaders (each keeps its island's blocks),
    and hand each rank its block inside the island. Where island-major order is rank order the leaders work on
    the input as it is (read, never written); otherwise on a copy reordered into padded island blocks."""
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    lay = await layout(group)
    vo, vi = _View(out), _View(inp)
    k = len(vo)
    group.next_fingerprint(CollOp.REDUCE_SCATTER, None, k, -1, rop)
    members, isl = lay.my_members, lay.island_comm
    leader = group.rank == members[0]
    scratch = not _rank_ordered(lay)
    if scratch:
        width = max(len(m) for m in lay.islands)
        src = vi.empty(len(lay.islands) * width * k)
        for r0, a in _padded_blocks(lay, width, k):  # island-major, padded (the padding's sums are never read)
            vi.copy(_sl(src, a, a + k), _sl(vi.flat, r0, r0 + k))
    else:
        width, src = len(members), vi.flat
    blk = width * k
    acc = src
    if isl is not None:
        if leader and not scratch:  # the leader's buffer receives the island's sum: not the caller's input
            acc = vi.empty(len(src))
            vi.copy(acc, src)
        await isl.flat_reduce(vi.mem(acc), 0, inner)
    region = None
    if leader:
        region = vo.flat if blk == k else vi.empty(blk)
        if lay.leaders is not None:
            await _leaders_reduce_scatter(group, lay, vi, region, acc, inner)
        else:
            vi.copy(region, _sl(acc, 0, blk))
    if isl is not None:
        region = region if leader else vi.empty(blk)
        await isl.flat_broadcast(vi.mem(region), 0)
    if region is not vo.flat:
        j = members.index(group.rank)
        vi.copy(vo.flat, _sl(region, j * k, (j + 1) * k))
    if rop == ReduceOp.AVG:
        vi.divide(vo.flat, group.size)


SCHEDULES: dict[str, Callable[..., Awaitable[None]]] = {
    "all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
    "broadcast": broadcast, "reduce": reduce,
}


# ---- ordered on the caller's stream (gpu/streamorder.py) ---------------------------------------------------------
# The device side (the island steps in the vendor CCL, the leader's copies to and from pinned memory, the words) is
# enqueued here, on the caller's thread, and the host side is the leaders' step of the host schedule above on the
# pinned copy. That step is a CPU leader's, not that of a GPU leader through the loop (the link, the device ring):
# every GPU rank must take this path for the same calls, which the torch backend's agreement at init and the
# conditions below (the same on every rank, or an error) ensure.

# (the pinned copy's Stage, or None off leaders; the leaders' step, or None; the collective's fingerprint)
Planned = tuple[Any, Callable[[], Awaitable[None]] | None, tuple]


def ordered_setup(group: Group, device: int) -> Coroutine[Any, Any, Any] | None:
    """What must run on the loop, with nothing ordered in flight, before this rank's collectives of `device`
    memory can be ordered: the making of its island's vendor communicator (a collective of the island, at the
    same call on every member), or None."""
    lay = group.island_layout
    if lay is None or lay.single or len(lay.my_members) == 1 or lay.island_comm.vendor_comm(device) is not None:
        return None
    isl = lay.island_comm

    async def make() -> None:  # on the loop, which alone makes the group's vendor communicators
        await isl.island_vendors().get(device)
    return make()


class Ordered(NamedTuple):
    """A collective planned on the caller's stream (ordered_plan)."""

    host_side: Coroutine[Any, Any, None]  # for hetccl's loop
    device_side: Callable[[], None]  # enqueues the device side on the stream
    abandon: Callable[[], None]  # lets the stream go if host_side never runs
    # the device side holds a vendor CCL's enqueue, which may wait for the stream, which waits for the host side:
    # submit host_side first. Else enqueue the device side first, so that the loop thread, once woken, takes no
    # GIL from the caller's thread while it enqueues
    host_first: bool


def ordered_plan(group: Group, name: str, args: tuple[Any, ...]) -> Callable[[Any, Any], Ordered] | None:
    """Collective `name` (a SCHEDULES entry, checked arguments as they take them) ordered on a stream, in two
    steps: what the call decides at once, and its planning. None where this layout or device cannot (then the
    loop does it all: decided from the layout and the call alone, so on every rank alike); a ConfigError where
    this rank cannot order what the others will. Else `plan(stream, early)` gives its Ordered parts, from the
    caller's thread or later from another (Deferred); `early`, a stream that waits for the caller's but not for
    `stream`, may take the copies out of the caller's data (streamorder.Stage.to_host)."""
    lay = group.island_layout
    plan = _PLANS.get(name)
    if plan is None or lay is None or lay.single:
        return None
    bufs = [a for a in args if isinstance(a, DeviceBuf)]
    if not bufs or any(b.framework != "torch" or b.count == 0 for b in bufs):
        return None
    words = streamorder.words_for(bufs[0].device)
    if words is None:  # not a silent fallback: the other ranks would run the ordered schedule
        raise ConfigError(f"the stream order across islands needs GPU stream memory operations on every rank, and "
                          f"rank {group.rank} has none on its device "
                          f"({streamorder.unavailable_reason(bufs[0].device)}); set HETCCL_TORCH_STREAM_ORDER=0 on "
                          "every rank")
    small_host = name == "all_reduce" and not staging.PAIRLINK_SMALL and bufs[0].nbytes <= staging.SMALL_BYTES
    if name in _LINK_PLANS and lay.leaders is group and not small_host and _pair_link_applies(group, lay):
        link = lay.link
        if link is None:
            return None  # the loop makes the link in this collective (every rank alike: nothing else is in flight)
        if isinstance(link, pairlink.PairLink) and link.ops is not None:
            return lambda stream, early: _link_ordered(group, name, link, words, stream, args)

    def planned(stream: Any, early: Any) -> Ordered:
        island = _Island(group, lay, words, stream, early)
        stage, body, fingerprint = plan(group, lay, island, words, stream, *args)
        return Ordered(_host_side(group, name, stage, body, fingerprint), island.enqueue,
                       lambda: stage is not None and stage.finish(False), island.comm is not None)
    return planned


class Deferred:
    """An ordered collective planned and enqueued later by another thread (the torch backend's enqueuing
    thread), so that the caller's thread only decides and records where its stream stands. Its host side goes
    to the loop at the call, takes the communicator's turn there in issue order, and then waits, within the
    deadline, for the plan (`plan`, called once on the enqueuing thread, in call order)."""

    def __init__(self, group: Group, name: str, make: Callable[[Any, Any], Ordered],
                 explain: Callable[[], str] | None = None):
        self._group, self._name, self._make = group, name, make
        self._explain = explain  # where the planning thread stands, for the error of a plan past the deadline
        # the planned host side and its abandon (never the Ordered: its device side holds device tensors, whose
        # last reference must not go on the loop thread)
        self._planned: concurrent.futures.Future[tuple[Coroutine[Any, Any, None], Callable[[], None]]] = \
            concurrent.futures.Future()

    async def host_side(self) -> None:
        group = self._group
        deadline = _deadline(group)
        started = False
        try:
            async with group.issue_order.turn(self._name, deadline):
                try:
                    side, _ = await asyncio.wait_for(asyncio.wrap_future(self._planned),
                                                     max(0.0, deadline - asyncio.get_running_loop().time()))
                except TimeoutError:
                    raise CollectiveTimeout(f"cross-island {self._name}: its device side was not planned before "
                                            "the deadline (HETCCL_TIMEOUT): the enqueuing thread is stuck"
                                            + (f"; {self._explain()}" if self._explain else "")) from None
                started = True
                await side  # takes no second turn: this task holds the communicator's
        finally:
            if not started and not self._planned.cancel() and self._planned.exception() is None:
                side, abandon = self._planned.result()  # planned, never run: let the stream go
                side.close()
                abandon()

    def plan(self, stream: Any, early: Any) -> Ordered:
        """On the enqueuing thread: plan the collective and hand its host side to the waiting one. Raises where
        that host side has given up (its turn timed out, the loop closed): the device side must not be
        enqueued then."""
        make, self._make = self._make, None  # its arguments hold device tensors: not freed on the loop thread
        try:
            ordered = make(stream, early)  # type: ignore[misc]
        except BaseException as exc:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self._planned.set_exception(exc)
            raise
        try:
            self._planned.set_result((ordered.host_side, ordered.abandon))
        except concurrent.futures.InvalidStateError:  # cancelled: the host side gave up waiting
            ordered.host_side.close()
            ordered.abandon()
            raise HetcclError(f"cross-island {self._name}: its host side gave up before the device side was "
                              "planned") from None
        return ordered


def _pair_link_applies(group: Group, lay: Layout) -> bool:
    """Whether the loop's schedule would join these two GPU leaders by the pair link (_zero_copy_link's
    conditions, from the layout alone; kept in the layout: asking the link registry on every ordered collective
    cost its caller's thread tens of microseconds)."""
    if lay.pair_link is None:
        g = lay.leaders.members
        fab = group.fabric
        lay.pair_link = (len(g) == 2 and registry.device_link(2) is pairlink.PairLink
                         and fab.topology.same_host(g[0], g[1])
                         and all(vendor_of(fab.records[x].get("island", "cpu")) is not None for x in g))
    return lay.pair_link


def _link_ordered(group: Group, name: str, link: Any, words: Any, stream: Any, args: tuple[Any, ...]) -> Ordered:
    """Two GPU leaders of one host, one rank each, joined by the GPU-signalled pair link: its whole
    collective is enqueued here on the caller's stream, then a word; the host only waits for that word (the
    deadline, a lost peer). No staging through host memory and no host step between the streams."""
    if link.broken is not None:
        raise link.broken
    _, what, fingerprint = _LINK_PLANS[name](group, link, stream, *args)
    end = words.take(1)[0]
    words.signal(stream.cuda_stream, end)

    async def host_side() -> None:
        async with group.issue_order.turn(name, _deadline(group)):
            group.next_fingerprint(*fingerprint)
            try:
                await streamorder.until(words, end, _deadline(group), what, link.check_peer)
            except BaseException as exc:
                link.release(exc)
                raise

    return Ordered(host_side(), lambda: None, lambda: link.release(HetcclError(f"{what}: its host side never ran")),
                   False)


def _link_all_reduce(group: Group, link: Any, stream: Any, b: DeviceBuf, rop: ReduceOp) -> tuple[Any, str, tuple]:
    t = as_tensor(b)
    ev = link.enqueue_all_reduce(t, ReduceOp.SUM if rop == ReduceOp.AVG else rop, stream)
    if rop == ReduceOp.AVG:
        with on_stream(stream):
            divide_inplace(t, group.size)
    return ev, "cross-island all_reduce", (CollOp.ALL_REDUCE, b.dtype, b.count, -1, rop)


def _link_all_gather(group: Group, link: Any, stream: Any, out: DeviceBuf, inp: DeviceBuf) -> tuple[Any, str, tuple]:
    every, mine = as_tensor(out), as_tensor(inp)
    k = mine.numel()
    own = every[group.rank * k:(group.rank + 1) * k]
    if own.data_ptr() != mine.data_ptr():
        with on_stream(stream):
            own.copy_(mine)
    return link.enqueue_all_gather(every, stream), "cross-island all_gather", (CollOp.ALL_GATHER, None, k)


def _link_reduce_scatter(group: Group, link: Any, stream: Any, out: DeviceBuf, inp: DeviceBuf,
                         rop: ReduceOp) -> tuple[Any, str, tuple]:
    region, acc = as_tensor(out), as_tensor(inp)
    ev = link.enqueue_reduce_scatter(region, acc, ReduceOp.SUM if rop == ReduceOp.AVG else rop, stream)
    if rop == ReduceOp.AVG:
        with on_stream(stream):
            divide_inplace(region, group.size)
    return ev, "cross-island reduce_scatter", (CollOp.REDUCE_SCATTER, None, out.count, -1, rop)


_LINK_PLANS: dict[str, Callable[..., tuple[Any, str, tuple]]] = {
    "all_reduce": _link_all_reduce, "all_gather": _link_all_gather, "reduce_scatter": _link_reduce_scatter,
}


class _Island:
    """This rank's island step on the caller's stream: its vendor CCL's collectives enqueued from the caller's
    thread (none for an island of one rank), and scratch for that stream."""

    def __init__(self, group: Group, lay: Layout, words: streamorder.Words, stream: Any, early: Any = None):
        self.comm = lay.island_comm if len(lay.my_members) > 1 else None  # (a split of one rank does nothing)
        self.stream = stream
        # copies out of the caller's data may go on `early` (streamorder.Stage.to_host) where no island step
        # comes first (an island's vendor collectives stay on one stream, in issue order)
        self.early = early if self.comm is None else None
        self.leader = group.rank == lay.my_members[0]
        self.index = lay.my_members.index(group.rank)
        self.vc = None
        if self.comm is not None:
            self.vc = self.comm.vendor_comm(words.device)
            if self.vc is None:
                raise HetcclError("an ordered collective of an island of several ranks needs the island's vendor "
                                  "communicator (hierarchical.ordered_setup makes it first)")
        self._queue: list[Callable[[], None]] = []  # the device side, enqueued by enqueue() in this order
        self._lay = lay
        self.batch = words.ops.batch()  # the Stages' copies and words, in queue order

    def later(self, fn: Callable[[], None]) -> None:
        """Later: fn(), which may launch work on the stream (the batch's operations before it go first)."""
        self._queue.append(lambda: (self.batch.flush(), fn()))

    def launching(self, then: Callable[[int], None]) -> Callable[[int], None]:
        """A Stage's then(j) that launches work on the stream (the batch's operations go first)."""
        return lambda j: (self.batch.flush(), then(j))

    def stage(self, words: Any, nbytes: int) -> Any:
        """A pinned copy's Stage on this island's streams (its copies and words go into the batch)."""
        return streamorder.Stage(words, self.stream, nbytes, self._queue.append, self.batch, self.early)

    def run(self, name: str, t: Any, root: int = 0, op: ReduceOp = ReduceOp.SUM, inp: Any = None) -> None:
        """Later: the island's vendor collective `name` on the stream."""
        bufs = [as_device_buf(t)] + ([as_device_buf(inp)] if inp is not None else [])
        _, call, what = dispatch.vendor_call(name, bufs, root, op)
        vc, stream = self.vc, self.stream.cuda_stream

        def enqueue() -> None:
            deadline = time.monotonic() + self.comm.settings.timeout  # the vendor watchdog's clock
            vc.run_now(lambda s: call(vc, s), stream, deadline, f"island {what}")
        self.later(enqueue)

    def copy(self, dst: Any, src: Any) -> None:
        """Later: dst <- src on the stream."""
        self.later(lambda: dst.copy_(src))

    def enqueue(self) -> None:
        queue, self._queue = self._queue, []  # its closures hold device tensors, and the host side holds this
        # object: a tensor's last reference must not go on the loop thread (freeing a block used on another stream
        # records CUDA events there, gpu/streamorder.py says why the loop makes no CUDA call)
        with on_stream(self.stream):
            for fn in queue:
                fn()
            self.batch.flush()

    def empty_like(self, t: Any, count: int | None = None) -> Any:
        torch = torch_mod()
        with on_stream(self.stream):
            return torch.empty(t.numel() if count is None else count, dtype=t.dtype, device=t.device)

    def scratch(self, t: Any, count: int, role: str) -> Any:
        """`count` elements of t's dtype that only this stream uses, kept for the stream's next ordered
        collective (in stream order, so never two at once): allocating them took 50-90 us of the caller's
        thread per collective on an H100 shared by two ranks (2026-12-07). One buffer per role and dtype, grown
        to the largest asked for; it goes with the communicator."""
        key = (self.stream.cuda_stream, t.dtype, role)
        held = self._lay.scratch.get(key)
        if held is None or held.numel() < count:
            held = self._lay.scratch[key] = self.empty_like(t, count)
        return _part(held, 0, count)


def _host(stage: Any, b: DeviceBuf, at: int, count: int) -> Buf:
    isz = b.dtype.itemsize
    return Buf(stage.host[at:at + count * isz], b.dtype, count)


async def _host_side(group: Group, name: str, stage: Any, body: Callable[[], Awaitable[None]] | None,
                     fingerprint: tuple) -> None:
    """On the loop, in issue order with the communicator's other collectives across islands: every rank takes
    the collective's number, and a leader runs the leaders' step on its pinned copy."""
    ok = False
    try:
        async with group.issue_order.turn(name, _deadline(group)):
            group.next_fingerprint(*fingerprint)
            if body is not None:
                await body()
        ok = True
    finally:
        if stage is not None:
            stage.finish(ok)


def _plan_all_reduce(group: Group, lay: Layout, isl: _Island, words: Any, stream: Any, b: DeviceBuf,
                     rop: ReduceOp) -> Planned:
    """Reduce to the island's leader, the leaders' all_reduce (gathered and reduced on the devices between GPU
    leaders above HETCCL_CROSS_SMALL_BYTES or compressed, else the chunked host all_reduce, AVG divided there),
    broadcast."""
    t = as_tensor(b)
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    if isl.comm is not None:
        isl.run("reduce", t, 0, inner)
    stage = body = None
    # up to HETCCL_CROSS_SMALL_BYTES the host reduces, as the loop's schedule: one copy each way and no kernels
    # (on one GPU time-sliced by two ranks each burst of device work costs a context switch); compressed, the
    # devices pack and reduce at every size, as the loop's schedule (staging.packed_all_reduce)
    wire = compress.wire_for(group.settings, b.dtype, b.nbytes)
    if isl.leader and _gpu_leaders(lay) and (b.nbytes > staging.SMALL_BYTES or wire):
        stage, body = _plan_leaders_all_reduce_on_device(group, lay, isl, words, stream, t, b.dtype, rop, wire)
    elif isl.leader:
        stage = isl.stage(words, b.nbytes)
        pieces = streamorder.contiguous(0, _chunks(b.count, b.dtype.itemsize))
        stage.to_host(t, pieces, early=True)
        stage.from_host(t, pieces)
        stage.seal()
        host = _host(stage, b, 0, b.count)
        body = lambda: _leaders_all_reduce_host(group, lay, host, rop, stage)  # noqa: E731
    if isl.comm is not None:
        isl.run("broadcast", t, 0)
    return stage, body, (CollOp.ALL_REDUCE, b.dtype, b.count, -1, rop)


def _gpu_leaders(lay: Layout) -> bool:
    """Every island leader holds a GPU (from the layout alone: every leader decides alike)."""
    return all(vendor_of(lay.labels[m[0]]) is not None for m in lay.islands)


def _plan_leaders_all_reduce_on_device(group: Group, lay: Layout, isl: _Island, words: Any, stream: Any, t: Any,
                                       dtype: DType, rop: ReduceOp, wire: int
                                       ) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """The leaders' step of an ordered all_reduce where every leader holds a GPU, as the loop's staged
    all_reduce with its reduction on the device: per chunk, the leaders all_gather their copies through pinned
    host memory (chunk j of leader r at block r of the chunk's region), and the stream copies the other leaders'
    blocks back and reduces them with its own in leader order (_SpanReduction), so that every leader computes the
    same bits. The host does no arithmetic, and a few chunks' exchanges are in flight at once. With a wire
    (HETCCL_CROSS_COMPRESS) the stream packs each chunk before its copy and unpacks the k blocks before reducing
    them, a span of chunks at a time (gpu/codec.py): the wire carries the packed bytes."""
    k, me = lay.leaders.size, lay.leaders.rank
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    isz = t.element_size()
    flat = t.view(-1)
    elems = _chunk_elems(t.numel(), isz)
    packed = codec.LeaderChunks(elems, k, wire) if wire else None
    # what one leader sends of each chunk: its bytes, or its packed bytes; `sizes` and `starts` in bytes
    sizes = packed.sizes if packed else [(hi - lo) * isz for lo, hi in elems]
    starts = packed.starts if packed else [lo * isz for lo, _ in elems]
    src = t
    if packed is not None:
        src = isl.scratch(flat.view(torch_mod().uint8), packed.total, "packed")
        isl.later(lambda: packed.pack(src, flat))
    stage = isl.stage(words, k * sum(sizes))
    stage.to_host(src, [[(at, k * at + me * size, size)] for at, size in zip(starts, sizes, strict=True)],
                  early=packed is None)
    if packed is None:  # the other leaders' chunks land beside this one's own data, reduced a span at a time
        avg = (lambda d: divide_inplace(d, group.size)) if rop == ReduceOp.AVG else None
        spans = _SpanReduction(isl, flat, flat, elems, k, me, inner, avg)
        stage.from_host(spans.scratch, [[(spans.at(j, r), k * at + r * size, size) for r in range(k) if r != me]
                                        for j, (at, size) in enumerate(zip(starts, sizes, strict=True))],
                        then=spans.landed)
    else:  # a span of chunks lands, then is unpacked and reduced in one pass (as _SpanReduction, for the launches)
        span = _span(elems, isz)
        scratch = isl.scratch(flat.view(torch_mod().uint8), min(span, len(sizes)) * k * sizes[0], "landed")

        def reduce_chunks(j: int) -> None:  # on the stream, once chunk j's blocks are back
            j0 = _closed_span(j, len(sizes), span)
            if j0 is None:
                return
            isl.batch.flush()  # the copies back before the kernels that read them
            packed.reduce_span(j0, j + 1, flat, scratch, inner, reduce_inplace)
            if rop == ReduceOp.AVG:
                divide_inplace(flat[elems[j0][0]:elems[j][1]], group.size)

        stage.from_host(scratch, [[((j % span) * k * sizes[0], k * at, k * size)]
                                  for j, (at, size) in enumerate(zip(starts, sizes, strict=True))],
                        then=reduce_chunks)
    stage.seal()
    wire_dtype = DType.UINT8 if packed is not None else dtype

    def gather(j: int) -> Awaitable[None]:
        n = sizes[j] // wire_dtype.itemsize
        every = Buf(stage.host[k * starts[j]:k * (starts[j] + sizes[j])], wire_dtype, k * n)
        return lay.leaders.flat_all_gather(every, _sl(every, me * n, (me + 1) * n))

    return stage, lambda: _in_flight(group, stage, len(sizes), gather, "cross-island all_reduce")


_REDUCE_SPAN = 8  # stage chunks of an ordered collective reduced on the device by one kernel per leader


def _span(pieces: Sequence[tuple[int, int]], isz: int) -> int:
    """Pieces reduced together: _REDUCE_SPAN stage chunks' worth (pieces grow past a stage chunk in large
    collectives, _chunks), at least one."""
    lo, hi = pieces[0]
    return max(1, _REDUCE_SPAN * staging.STAGE_CHUNK // max((hi - lo) * isz, 1))


def _closed_span(i: int, count: int, span: int) -> int | None:
    """The first piece of the span (of `span` pieces) that piece i (of `count`) closes, or None where the span
    goes on."""
    return i - i % span if i % span == span - 1 or i == count - 1 else None


class _SpanReduction:
    """The device side of an ordered reduction between GPU leaders: the other leaders' slices of each piece are
    copied back into `scratch` (this leader's own slice stays where it is, in `own`), and once a span of
    pieces (_span) has landed, `dst` gets their reduction in leader order, with one kernel per leader over
    the whole span (so every leader computes the same bits). A kernel per piece cost each piece some 30 us of
    the caller's thread, which an ordered collective holds while it enqueues (H100, 2026-12-07); the scratch is
    (k - 1) spans, reused: the stream is in order."""

    def __init__(self, isl: _Island, dst: Any, own: Any, pieces: list[tuple[int, int]], k: int, me: int,
                 op: ReduceOp, then: Callable[[Any], None] | None = None, span: int | None = None):
        self.dst, self.own, self.pieces, self.k, self.me, self.op, self.then = dst, own, pieces, k, me, op, then
        self.isl, self.isz = isl, dst.element_size()
        self.span = span or _span(pieces, self.isz)
        self.width = pieces[min(self.span, len(pieces)) - 1][1] - pieces[0][0]  # elements of the longest span
        self.scratch = isl.scratch(dst, (k - 1) * self.width, "span")

    def _row(self, r: int) -> int:
        """Leader r's span in scratch (the others' only: this leader's own slices stay in `own`)."""
        return (r if r < self.me else r - 1) * self.width

    def at(self, i: int, r: int) -> int:
        """Byte offset in scratch of leader r's slice of piece i."""
        first = self.pieces[i - i % self.span][0]
        return (self._row(r) + self.pieces[i][0] - first) * self.isz

    def landed(self, i: int) -> None:
        """On the stream, once piece i's slices are back: the span's reduction after its last piece."""
        first = _closed_span(i, len(self.pieces), self.span)
        if first is None:
            return
        self.isl.batch.flush()  # the copies back before the kernels that read them
        lo, hi = self.pieces[first][0], self.pieces[i][1]
        n = hi - lo
        parts = [_part(self.own, lo, hi) if r == self.me else _part(self.scratch, self._row(r), self._row(r) + n)
                 for r in range(self.k)]
        # dst may be `own` itself (all_reduce): the leaders before this one sum in scratch first
        dst = _part(self.dst, lo, hi)
        head = parts[0]
        for p in parts[1:self.me]:
            reduce_inplace(head, p, self.op)
        reduce_into(dst, head, parts[max(self.me, 1)], self.op)
        for p in parts[max(self.me, 1) + 1:]:
            reduce_inplace(dst, p, self.op)
        if self.then is not None:
            self.then(dst)


def _part(t: Any, lo: int, hi: int) -> Any:
    """t[lo:hi], or t itself where that is all of it (a slice costs the caller's thread of an ordered collective
    2-19 us on an H100 shared by two ranks, 2026-12-07, and a collective of up to 8 stage chunks reduces whole
    tensors)."""
    return t if lo == 0 and hi == t.numel() else t[lo:hi]


async def _in_flight(group: Group, stage: Any, count: int, piece: Callable[[int], Awaitable[None]], what: str) -> None:
    """An ordered host step in `count` pieces: piece i's collective (piece(i)) starts once its copy has landed,
    a few run at once, each started in piece order (so every leader numbers them alike), and piece i is let go
    to the stream once its collective is done."""
    inflight: list[tuple[int, asyncio.Future]] = []
    try:
        for j in range(count):
            await stage.arrived(j, _deadline(group), what)
            if len(inflight) == _ORDERED_INFLIGHT:
                i, first = inflight.pop(0)
                await first
                stage.done(i)
            inflight.append((j, asyncio.ensure_future(piece(j))))
            await asyncio.sleep(0)  # piece j's collective takes its number before piece j + 1's
        for i, fut in inflight:
            await fut
            stage.done(i)
        inflight.clear()
    finally:
        for _, fut in inflight:
            fut.cancel()


def _plan_all_gather(group: Group, lay: Layout, isl: _Island, words: Any, stream: Any, out: DeviceBuf,
                     inp: DeviceBuf) -> Planned:
    """Gather into the island's blocks, the leaders' host all_gather of those, broadcast in the island: in the
    caller's output where island-major order is rank order, else in blocks padded to the largest island,
    reordered at the end (the loop's all_gather, step for step)."""
    t, k, isz = as_tensor(inp), inp.count, out.dtype.itemsize
    members = lay.my_members
    width = max(len(m) for m in lay.islands)
    if _rank_ordered(lay):
        every, lo = as_tensor(out), members[0] * k
    else:
        every, lo = isl.empty_like(t, len(lay.islands) * width * k), lay.mine * width * k
    mine = every[lo:lo + len(members) * k]
    if isl.comm is not None:
        isl.run("all_gather", mine, inp=t)
    elif mine.data_ptr() != t.data_ptr():
        isl.copy(mine, t)
    stage = body = None
    block = every.numel() // len(lay.islands)
    wire = compress.wire_for(group.settings, out.dtype, every.numel() * isz)
    # an island of one rank: its block is its input (copied into `mine` on the stream: read the input)
    src = mine if isl.comm is not None else t
    if isl.leader and wire and _gpu_leaders(lay):
        stage, body = _plan_packed_all_gather(group, lay, isl, words, stream, every,
                                              every[lay.mine * block:(lay.mine + 1) * block], wire)
    elif isl.leader and _gpu_leaders(lay) and every.numel() * isz > staging.SMALL_BYTES:
        stage, body = _plan_leaders_all_gather_in_pieces(group, lay, isl, words, every, out.dtype, block, src,
                                                         mine.numel())
    elif isl.leader:
        stage = isl.stage(words, every.numel() * isz)
        stage.to_host(src, streamorder.contiguous(lo * isz, [(0, mine.numel() * isz)]), early=True)
        stage.from_host(every, streamorder.contiguous(0, [(0, every.numel() * isz)]))
        stage.seal()
        whole = Buf(stage.host[:every.numel() * isz], out.dtype, every.numel())
        own = _sl(whole, lay.mine * block, (lay.mine + 1) * block)

        async def body() -> None:
            await stage.arrived(0, _deadline(group), "cross-island all_gather")
            await _leaders_all_gather(group, lay, _View(whole), whole, own)
            stage.done(0)
    if isl.comm is not None:
        isl.run("broadcast", every, 0)
    if every.data_ptr() != as_tensor(out).data_ptr():
        dst = as_tensor(out)
        for r0, a in _padded_blocks(lay, width, k):  # back to group rank order
            isl.copy(dst[r0:r0 + k], every[a:a + k])
    return stage, body, (CollOp.ALL_GATHER, None, k)


def _plan_reduce_scatter(group: Group, lay: Layout, isl: _Island, words: Any, stream: Any, out: DeviceBuf,
                         inp: DeviceBuf, rop: ReduceOp) -> Planned:
    """Reduce the input to the island's leader (into scratch: the input is only read), the leaders' host
    reduce_scatter into the island's region, broadcast of the region, each rank's block; where island-major
    order is not rank order, on a copy of the input reordered into padded island blocks (the loop's
    reduce_scatter, step for step)."""
    inner = ReduceOp.SUM if rop == ReduceOp.AVG else rop
    dst, acc = as_tensor(out), as_tensor(inp)
    k, isz = out.count, out.dtype.itemsize
    scratch = not _rank_ordered(lay)
    width = max(len(m) for m in lay.islands) if scratch else len(lay.my_members)
    blk = width * k
    if scratch:
        src, acc = acc, isl.empty_like(acc, len(lay.islands) * blk)
        for r0, a in _padded_blocks(lay, width, k):  # island-major, padded (the padding's sums are never read)
            isl.copy(acc[a:a + k], src[r0:r0 + k])
    elif isl.comm is not None and isl.leader:  # the leader's buffer receives the island's sum: not the input
        src, acc = acc, isl.empty_like(acc)
        isl.copy(acc, src)
    if isl.comm is not None:
        isl.run("reduce", acc, 0, inner)
    region = dst if blk == k else isl.empty_like(dst, blk)
    stage = body = None
    wire = compress.wire_for(group.settings, out.dtype, acc.numel() * isz)
    if isl.leader and wire and _gpu_leaders(lay):
        stage, body = _plan_packed_reduce_scatter(group, lay, isl, words, stream, region, acc, inner, wire)
    elif isl.leader and _gpu_leaders(lay) and acc.numel() * isz > staging.SMALL_BYTES:
        stage, body = _plan_leaders_reduce_scatter_in_pieces(group, lay, isl, words, region, acc, out.dtype, inner,
                                                             early=not scratch)
    elif isl.leader:
        nb = acc.numel() * isz
        stage = isl.stage(words, nb + blk * isz)
        stage.to_host(acc, streamorder.contiguous(0, [(0, nb)]), early=not scratch)
        stage.from_host(region, streamorder.contiguous(nb, [(0, blk * isz)]))
        stage.seal()
        whole = Buf(stage.host[:nb], out.dtype, acc.numel())
        mine = Buf(stage.host[nb:nb + blk * isz], out.dtype, blk)

        async def body() -> None:
            await stage.arrived(0, _deadline(group), "cross-island reduce_scatter")
            await _leaders_reduce_scatter(group, lay, _View(whole), mine, whole, inner)
            stage.done(0)
    if region is not dst:
        if isl.comm is not None:
            isl.run("broadcast", region, 0)
        isl.copy(dst, region[isl.index * k:(isl.index + 1) * k])
    if rop == ReduceOp.AVG:
        isl.later(lambda: divide_inplace(dst, group.size))
    return stage, body, (CollOp.REDUCE_SCATTER, None, k, -1, rop)


def _plan_leaders_all_gather_in_pieces(group: Group, lay: Layout, isl: _Island, words: Any, every: Any, dtype: DType,
                                       block: int, own: Any, real: int) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """The leaders' step of an ordered all_gather where every leader holds a GPU, in pieces as the all_reduce's
    (_plan_leaders_all_reduce_on_device): piece i of this leader's block `own` goes to the host as soon as it is
    copied, the leaders all_gather it (piece i of leader r at slot r of the piece's region), and the stream
    copies the other leaders' slots back into their blocks of `every` while the next pieces cross. In one piece,
    the copy out, the wire and the copy back ran one after the other (all_gather at 0.87x all_reduce's busbw at
    64 MiB, H100 2026-12-07). A piece is a stage chunk of a block: a stage chunk across all the leaders' blocks
    left too few bytes in flight for the wire. Of `own`, the first `real` elements are data: in blocks padded
    to the widest island, the rest of a block crosses as it is and is never read."""
    n, me, isz = lay.leaders.size, lay.leaders.rank, every.element_size()
    pieces = _chunk_elems(block, isz)
    stage = isl.stage(words, n * block * isz)
    stage.to_host(own, [[(lo * isz, n * lo * isz + me * (hi - lo) * isz, (min(hi, real) - lo) * isz)]
                        if lo < real else [] for lo, hi in pieces], early=True)
    stage.from_host(every, [[((r * block + lo) * isz, n * lo * isz + r * (hi - lo) * isz, (hi - lo) * isz)
                             for r in range(n) if r != me] for lo, hi in pieces])
    stage.seal()

    def gather(i: int) -> Awaitable[None]:
        lo, hi = pieces[i]
        every_piece = Buf(stage.host[n * lo * isz:n * hi * isz], dtype, n * (hi - lo))
        return lay.leaders.flat_all_gather(every_piece, _sl(every_piece, me * (hi - lo), (me + 1) * (hi - lo)))

    return stage, lambda: _in_flight(group, stage, len(pieces), gather, "cross-island all_gather")


def _plan_leaders_reduce_scatter_in_pieces(group: Group, lay: Layout, isl: _Island, words: Any, region: Any,
                                           acc: Any, dtype: DType, op: ReduceOp, early: bool
                                           ) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """The leaders' step of an ordered reduce_scatter where every leader holds a GPU, in pieces: per piece, the
    leaders swap the slices of their sums `acc` that the others keep (an all_to_all through pinned memory: each
    moves (k-1)/k of acc; with two leaders an all_gather of the one slice each sends, which moves the same bytes
    by the host's faster all_gather), and the stream reduces what arrives into `region` in leader order, on the
    device. The host does no arithmetic: in one piece with the host's reduction, reduce_scatter took as long as
    all_reduce (0.5x its busbw, H100 2026-12-07). Pieces of a stage chunk of a block, as all_gather's; a stage
    chunk across all the leaders' blocks left it at 0.45x all_reduce's busbw at 200 MiB."""
    n, me, isz = lay.leaders.size, lay.leaders.rank, region.element_size()
    blk = region.numel()
    pieces = _chunk_elems(blk, isz)
    whole = acc.view(-1)
    spans = _SpanReduction(isl, region.view(-1), whole[me * blk:(me + 1) * blk], pieces, n, me, op)
    # the host buffer, piece-major: piece i's slot r at n * lo + r * (hi - lo) elements; with two leaders one
    # region, where slot `me` is sent and the other slot received; else what this leader sends to each (slot
    # r for leader r), then at `back` what each sent it
    back = 0 if n == 2 else n * blk * isz
    stage = isl.stage(words, n * blk * isz + back)

    def slot(lo: int, hi: int, r: int) -> int:
        return n * lo * isz + r * (hi - lo) * isz

    stage.to_host(acc, [[((r * blk + lo) * isz, slot(lo, hi, me if n == 2 else r), (hi - lo) * isz)
                         for r in range(n) if r != me] for lo, hi in pieces], early=early)
    stage.from_host(spans.scratch, [[(spans.at(i, r), back + slot(lo, hi, r), (hi - lo) * isz)
                                     for r in range(n) if r != me] for i, (lo, hi) in enumerate(pieces)],
                    then=spans.landed)
    stage.seal()

    def swap(i: int) -> Awaitable[None]:
        lo, hi = pieces[i]
        m = n * (hi - lo)
        sent = Buf(stage.host[n * lo * isz:][:m * isz], dtype, m)
        if n == 2:
            return lay.leaders.flat_all_gather(sent, _sl(sent, me * (hi - lo), (me + 1) * (hi - lo)))
        return lay.leaders.flat_all_to_all(Buf(stage.host[back + n * lo * isz:][:m * isz], dtype, m), sent)

    return stage, lambda: _in_flight(group, stage, len(pieces), swap, "cross-island reduce_scatter")


def _packed_pieces(lay: Layout, count: int, isz: int, wire: int) -> tuple[list[tuple[int, int]], int]:
    """The pieces (element ranges of a leader's block of `count`) and the bytes per packed piece of the host's
    compressed all_gather and reduce_scatter (compress.all_gather / reduce_scatter), which a GPU leader's
    packing on its device must match collective for collective."""
    return compress.piece_slots(count, staging.STAGE_CHUNK // (isz * lay.leaders.size), wire)


def _plan_packed_all_gather(group: Group, lay: Layout, isl: _Island, words: Any, stream: Any, every: Any,
                            own: Any, wire: int) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """The leaders' step of an ordered all_gather between GPU leaders under HETCCL_CROSS_COMPRESS: the host's
    compressed schedule (compress.all_gather: per piece of this leader's block `own`, one all_gather of packed
    bytes) with the packing and unpacking on the stream (gpu/codec.py), every block unpacked, this leader's
    too, so that every leader holds the same bits."""
    n, kk = lay.leaders.size, own.numel()
    pieces, slot = _packed_pieces(lay, kk, every.element_size(), wire)
    m = len(pieces)
    u8 = torch_mod().uint8
    sent = isl.scratch(every.view(u8), m * slot, "packed")
    got = isl.scratch(every.view(u8), m * n * slot, "landed")
    isl.later(lambda: codec.pack_pieces(sent, own, pieces, slot, 1, 0, wire))

    def unpack(i: int) -> None:
        codec.unpack_piece(every, got, pieces, slot, n, kk, i, wire)

    stage = isl.stage(words, m * slot + m * n * slot)
    stage.to_host(sent, streamorder.contiguous(0, [(i * slot, (i + 1) * slot) for i in range(m)]))
    stage.from_host(got, [[(i * n * slot, m * slot + i * n * slot, n * slot)] for i in range(m)],
                    then=isl.launching(unpack))
    stage.seal()

    def gather(i: int) -> Awaitable[None]:
        return lay.leaders.flat_all_gather(Buf(stage.host[m * slot + i * n * slot:][:n * slot], DType.UINT8, n * slot),
                                           Buf(stage.host[i * slot:(i + 1) * slot], DType.UINT8, slot))

    return stage, lambda: _in_flight(group, stage, m, gather, "cross-island all_gather")


def _plan_packed_reduce_scatter(group: Group, lay: Layout, isl: _Island, words: Any, stream: Any, region: Any,
                                acc: Any, op: ReduceOp, wire: int) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """The leaders' step of an ordered reduce_scatter between GPU leaders under HETCCL_CROSS_COMPRESS: the
    host's compressed schedule (compress.reduce_scatter: per piece, an all_to_all of each leader's packed
    blocks) with the packing, and the reduction in leader order of what arrives, on the stream."""
    n, kk = lay.leaders.size, region.numel()
    pieces, slot = _packed_pieces(lay, kk, region.element_size(), wire)
    m = len(pieces)
    u8 = torch_mod().uint8
    sent = isl.scratch(region.view(u8), m * n * slot, "packed")
    got = isl.scratch(region.view(u8), m * n * slot, "landed")
    isl.later(lambda: codec.pack_pieces(sent, acc, pieces, slot, n, kk, wire))

    def reduce(i: int) -> None:
        codec.reduce_piece(region, got, pieces, slot, n, i, wire, lambda d, s: reduce_inplace(d, s, op))

    stage = isl.stage(words, 2 * m * n * slot)
    stage.to_host(sent, streamorder.contiguous(0, [(i * n * slot, (i + 1) * n * slot) for i in range(m)]))
    stage.from_host(got, [[(i * n * slot, (m + i) * n * slot, n * slot)] for i in range(m)],
                    then=isl.launching(reduce))
    stage.seal()

    def swap(i: int) -> Awaitable[None]:
        host = stage.host
        return lay.leaders.flat_all_to_all(Buf(host[(m + i) * n * slot:(m + i + 1) * n * slot], DType.UINT8, n * slot),
                                           Buf(host[i * n * slot:(i + 1) * n * slot], DType.UINT8, n * slot))

    return stage, lambda: _in_flight(group, stage, m, swap, "cross-island reduce_scatter")


def _plan_broadcast(group: Group, lay: Layout, isl: _Island, words: Any, stream: Any, b: DeviceBuf,
                    root: int) -> Planned:
    """Root's island first where root does not lead it, the leaders' host broadcast, then every other island
    (and root's, from its leader) from its leader."""
    t = as_tensor(b)
    root_island = next(i for i, m in enumerate(lay.islands) if root in m)
    mine = lay.mine == root_island
    root_leads = lay.islands[root_island][0] == root
    if isl.comm is not None and mine and not root_leads:
        isl.run("broadcast", t, lay.my_members.index(root))
    stage = body = None
    if isl.leader:
        stage = isl.stage(words, b.nbytes)
        whole = streamorder.contiguous(0, [(0, b.nbytes)])
        if mine:
            stage.to_host(t, whole, early=True)
        else:
            stage.from_host(t, whole)
        stage.seal()
        host = _host(stage, b, 0, b.count)

        async def body() -> None:
            if mine:
                await stage.arrived(0, _deadline(group), "cross-island broadcast")
            await lay.leaders.flat_broadcast(host, root_island)
            if not mine:
                stage.done(0)
    if isl.comm is not None and not (mine and not root_leads):
        isl.run("broadcast", t, 0)
    return stage, body, (CollOp.BROADCAST, None, b.count, root)


_PLANS: dict[str, Callable[..., Planned]] = {
    "all_reduce": _plan_all_reduce, "all_gather": _plan_all_gather, "reduce_scatter": _plan_reduce_scatter,
    "broadcast": _plan_broadcast,
}
