"""The flat engine: one group of ranks running a collective without any hierarchy.

A `Group` numbers its collectives (one fingerprint per collective, one op code each), runs hetccl's host
algorithms (ring, latency, direct) over its ranks' transport endpoints through the scheduler, numbers
point-to-point messages per peer and tag, and runs device collectives in the vendor CCL when the group is one
GPU island (elsewhere device data is staged through host memory). Its methods take buffers the facade
(communicator.py) has already checked: `Buf` for host memory, `DeviceBuf` for device memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from . import algorithms, fastpath, hangreport
from .algorithms import direct, latency, ring, staged_ring
from .bootstrap import Fabric
from .config import Settings
from .dtypes import Buf, DType, ReduceOp, as_buf
from .errors import CommAbortedError, ConfigError, HetcclError
from .flight import FlightRecorder
from .gpu import dispatch, staging
from .gpu.buffers import DeviceBuf
from .gpu.runtime import as_tensor, stream_handle, stream_of, torch_mod, use_device
from .gpu.vendor_comm import VendorComm, blocking
from .matching import AnySource
from .ordering import IssueOrder
from .scheduler import CollCtx, Watchdog, run_collective
from .transports.base import Endpoint
from .wire import CollOp, Fingerprint

P2P_TAG = 0xFFFF << 48
P2P_SPACE = 1 << 31  # p2p frames use comm id | P2P_SPACE: their sequence numbers never meet a collective's
NO_DTYPE, NO_OP = 255, 255  # fingerprint fields of a collective without element type or reduction

Mem = Buf | DeviceBuf  # host or device memory, checked by the facade


class ScratchPool:
    """Page-aligned scratch buffers reused across collectives (big allocations cost page faults)."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        for i, arr in enumerate(self._free):
            if len(arr) >= nbytes:
                return self._free.pop(i)
        raw = np.empty(max(nbytes, 4096) + 4096, np.uint8)
        off = (-raw.ctypes.data) % 4096
        return raw[off: off + max(nbytes, 4096)]

    def give(self, arr: np.ndarray) -> None:
        if len(self._free) < 8:
            self._free.append(arr)


def derived_id(parent: int, what: str) -> int:
    """A communicator id made from its parent's and a description every member computes alike."""
    digest = hashlib.blake2s(f"{parent}/{what}".encode(), digest_size=4).digest()
    child_id = int.from_bytes(digest, "little") & (P2P_SPACE - 1)  # 31 bits; 0 and 1 are reserved
    return child_id if child_id > 1 else child_id + 2


class IslandLane:
    """The collectives of a single-GPU-island group on one device, enqueued from the calling thread with
    everything that is fixed per device found once: the torch backend's hot path (ProcessGroupNCCL's, at a
    small message's cost). It takes raw arguments (pointers, counts, hetccl dtypes and ops, stream handles):
    the caller has checked its tensors. Each call returns the event recorded after the operation."""

    __slots__ = ("group", "vc", "device", "_timeout")

    def __init__(self, group: Group, vc: VendorComm):
        self.group, self.vc, self.device = group, vc, vc.device
        self._timeout = group._settings.timeout

    def all_reduce(self, ptr: int, count: int, dtype: Any, op: ReduceOp, stream: int) -> Any:
        if self.group._closed or self.group._aborted is not None:
            self.group._check_open()  # raises the reason
        vc = self.vc
        return vc.run_now(lambda s: vc.lib.all_reduce(ptr, ptr, count, dtype, op, vc.comm, s), stream,
                          time.monotonic() + self._timeout, "all_reduce")


class Group:
    """Ranks (`members`, job ranks in group rank order) that run flat collectives together."""

    def __init__(self, fabric: Fabric, comm_id: int, members: list[int]):
        self._fabric = fabric
        self._settings = fabric.settings
        self.comm_id = comm_id
        self._members = members
        self.rank = members.index(fabric.rank)
        self.size = len(members)
        self._global_to_comm = {g: i for i, g in enumerate(members)}
        self._endpoints = {i: fabric.endpoints[g] for i, g in enumerate(members) if g != fabric.rank}
        self._seq = 0
        # point to point: one ordered stream per (peer, tag), numbered on each side; each tag has its own wire
        # communicator id (_p2p_id), so frames of different tags never share a (comm, seq) key
        self._send_seq: dict[tuple[int, int], int] = defaultdict(int)
        self._recv_seq: dict[tuple[int, int], int] = defaultdict(int)
        self._p2p_ids: dict[int, int] = {0: comm_id | P2P_SPACE}
        # per tag: completes once every receive posted before has its (peer, seq); only receives from any
        # source keep it pending, and receives posted behind one wait (MPI: receives match in posting order)
        self._recv_gate: dict[int, asyncio.Future[None]] = {}
        self._splits = 0
        self._closed = False
        self._pool = ScratchPool()
        self._override = algorithms.parse_override(self._settings.algo)
        self._kind = fabric.transport_costs(members)  # the declared figures of its slowest transport
        self.chunk_bytes, self.chunk_max_bytes = fabric.ring_chunk(members)
        self._children: list[Group] = []
        self._parent: Group | None = None
        self._watchdog = Watchdog()
        self._labels = [fabric.records[g].get("island", "cpu") if fabric.records else "cpu" for g in members]
        self._islands = len(set(self._labels))
        # several CPU islands of one rank each: every collective across them is this group's own flat one
        # (Communicator._across), uncompressed
        self.cpu_islands_of_one = 1 < self._islands == self.size and \
            not any(dispatch.vendor_of(x) for x in self._labels)
        lim = fastpath.limit_for(self)
        self._fast = fastpath.FastPath(self, lim) if lim else None  # small host collectives (fastpath.py)
        self.island_layout: Any = None  # hierarchical.Layout, built when a group of several islands is made
        self.issue_order = IssueOrder()  # turns of the hierarchical collectives (ordering.py says why)
        self._vendors: dispatch.IslandVendors | None = None  # one GPU island: its vendor communicators
        self._algo_cache: dict[tuple[str, int], str] = {}
        self._flight = FlightRecorder()
        self._aborted: HetcclError | None = None  # set by abort() / shrink(): every later call raises it
        fabric.comms[comm_id] = self
        if fabric.answer_report is None:
            fabric.answer_report = hangreport.answer

    # ---- what the scheduler and the hang report read (scheduler.GroupView) -------------------------------
    @property
    def island_count(self) -> int:
        """How many islands this group spans (ranks of one label share a vendor CCL)."""
        return self._islands

    @property
    def fabric(self) -> Fabric:
        return self._fabric

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def scratch(self) -> ScratchPool:
        """Page-aligned scratch buffers, for schedules made of this group's collectives (compress.py)."""
        return self._pool

    @property
    def members(self) -> list[int]:
        return self._members

    @property
    def peers(self) -> dict[int, Endpoint]:
        """Group rank -> the endpoint that reaches it (every rank but this one)."""
        return self._endpoints

    @property
    def watchdog(self) -> Watchdog:
        return self._watchdog

    @property
    def flight(self) -> FlightRecorder:
        return self._flight

    @property
    def aborted(self) -> HetcclError | None:
        return self._aborted

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def next_seq(self) -> int:
        return self._seq

    def group_rank(self, job_rank: int) -> int:
        """This group's rank of a job rank (the job rank itself when it is no member)."""
        return self._global_to_comm.get(job_rank, job_rank)

    # ---- numbering -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise HetcclError("communicator is closed; create a new one with hetccl.init()")
        if self._aborted is not None:
            raise self._aborted

    def next_fingerprint(self, op: int, dtype: DType | None, count: int, root: int = -1,
                         redop: ReduceOp | None = None, fast: bool = False) -> Fingerprint:
        """Take this group's next sequence number for a collective of op code `op` (a wire.CollOp); `fast`:
        it runs on the fast path (others are announced there, so a peer waiting at that number sees them)."""
        self._check_open()
        seq = self._seq
        self._seq = (seq + 1) & 0xFFFFFFFF
        fp = Fingerprint(self.comm_id, seq, op, NO_DTYPE if dtype is None else int(dtype), count, root,
                         NO_OP if redop is None else int(redop))
        if not fast and self._fast is not None and self._fast.ready:
            self._fast.announce(fp)
        return fp

    def fast_takes(self, fp: Fingerprint) -> bool:
        """Whether collective fp ran on the fast path (what observability reports as its algorithm)."""
        return fastpath.takes(self, fp)

    async def _fast_finish(self, fp: Fingerprint, src: Any, nbytes: int, started: Any) -> int:
        """The rest of a fast operation that FastPath.now did not end, under the scheduler (deadline, failures);
        returns its number (the caller combines the slots)."""
        fast = self._fast
        return await run_collective(self, fp, lambda: fast.finish(fp, src, nbytes, started))  # type: ignore[union-attr]

    # ---- small host collectives on the shared-memory fast path: each started synchronously by the loop's flat
    # collective or by the caller's thread (fast_now, the blocking facade's shortcut). None: not for the fast
    # path (nothing taken); True: done; else a coroutine that ends it on `loop` (given when called from another
    # thread with nothing of this group in flight there), the peers not all there within the spin ------------
    def fast_now(self, name: str, args: tuple[Any, ...], loop: asyncio.AbstractEventLoop) -> Any:
        """flat_<name>(*args) from a thread other than `loop`'s: False where it does not take the fast path."""
        start = _FAST_STARTS.get(name)
        done = None if start is None else start(self, *args, loop=loop)
        return False if done is None else done

    def _fast_all_reduce(self, b: Buf, op: ReduceOp, loop: Any = None) -> Any:
        fast = self._fast
        if fast is None or b.nbytes > fast.limit:
            return None
        fp = self.next_fingerprint(CollOp.ALL_REDUCE, b.dtype, b.count, -1, op, True)
        return self._fast_reducing(fp, b.data, b.nbytes, b.data, 0, b.count, b.dtype, op, loop)

    def _fast_all_gather(self, o: Buf, i: Buf, loop: Any = None) -> Any:
        fast = self._fast
        nb = i.nbytes
        if fast is None or nb > fast.limit:
            return None
        fp = self.next_fingerprint(CollOp.ALL_GATHER, o.dtype, i.count, fast=True)

        def gathered(k: int) -> None:
            for r in range(self.size):
                fast.copy_from(k, r, o.data[r * nb:(r + 1) * nb], nb)
        k = fast.now(fp, i.data, nb, loop)
        if type(k) is tuple:
            return self._fast_rest(fp, i.data, nb, k, gathered)
        gathered(k)
        return True

    def _fast_reduce_scatter(self, o: Buf, i: Buf, op: ReduceOp, loop: Any = None) -> Any:
        fast = self._fast
        if fast is None or i.nbytes > fast.limit:
            return None
        fp = self.next_fingerprint(CollOp.REDUCE_SCATTER, o.dtype, o.count, -1, op, True)
        return self._fast_reducing(fp, i.data, i.nbytes, o.data, self.rank * o.nbytes, o.count, o.dtype, op, loop)

    def _fast_reducing(self, fp: Fingerprint, src: Any, nbytes: int, dst: Any, at: int, count: int, dtype: DType,
                       op: ReduceOp, loop: Any) -> Any:
        """Start fast operation fp (src posted), then reduce bytes at.. of every rank's slot into dst."""
        fast = self._fast
        k = fast.now(fp, src, nbytes, loop)  # type: ignore[union-attr]
        if type(k) is tuple:
            return self._fast_rest(fp, src, nbytes, k, lambda k: fast.reduce(k, dst, at, count, dtype, op))
        fast.reduce(k, dst, at, count, dtype, op)  # type: ignore[union-attr]
        return True

    def _fast_broadcast(self, b: Buf, root: int, loop: Any = None) -> Any:
        fast = self._fast
        if fast is None or b.nbytes > fast.limit:
            return None
        fp = self.next_fingerprint(CollOp.BROADCAST, b.dtype, b.count, root, fast=True)
        mine = self.rank == root
        nb = b.nbytes if mine else 0
        k = fast.now(fp, b.data, nb, loop)
        if type(k) is tuple:
            return self._fast_rest(fp, b.data, nb, k, None if mine else lambda k: fast.copy_from(k, root, b.data,
                                                                                                  b.nbytes))
        if not mine:
            fast.copy_from(k, root, b.data, b.nbytes)
        return True

    def _fast_barrier(self, loop: Any = None) -> Any:
        fast = self._fast
        if fast is None:
            return None
        fp = self.next_fingerprint(CollOp.BARRIER, None, 0, fast=True)
        k = fast.now(fp, None, 0, loop)
        return self._fast_rest(fp, None, 0, k, None) if type(k) is tuple else True

    async def _fast_rest(self, fp: Fingerprint, src: Any, nbytes: int, started: Any,
                         combine: Callable[[int], None] | None) -> None:
        k = await self._fast_finish(fp, src, nbytes, started)
        if combine is not None:
            combine(k)

    def _algo(self, op: str, nbytes: int) -> str:
        algo = self._algo_cache.get((op, nbytes))
        if algo is None:
            if len(self._algo_cache) > 4096:
                self._algo_cache.clear()
            algo = self._algo_cache[op, nbytes] = algorithms.choose(op, nbytes, self.size, self._kind,
                                                                    self._override)
        return algo

    # ---- flat collectives: host algorithms on host memory; device memory: the vendor CCL or staging -------
    async def flat_all_reduce(self, b: Mem, op: ReduceOp) -> None:
        if isinstance(b, DeviceBuf):
            if self._islands > 1:
                return await self._staged("all_reduce", [b], [0], op=op)
            return await self._vendor_run("all_reduce", [b], op=op)
        done = self._fast_all_reduce(b, op)
        if done is not None:
            if done is not True:
                await done
            return
        fast = self._fast
        if fast is not None and fast.pieces:
            fp = self.next_fingerprint(CollOp.ALL_REDUCE, b.dtype, b.count, -1, op, True)
            await run_collective(self, fp, lambda: fast.all_reduce_pieces(fp, b.data, b.count, b.dtype, op))
            return
        fp = self.next_fingerprint(CollOp.ALL_REDUCE, b.dtype, b.count, -1, op)
        ctx = CollCtx(self, fp, b.dtype, op)
        algo = ring.all_reduce if self._algo("all_reduce", b.nbytes) == algorithms.RING else latency.all_reduce
        await run_collective(self, fp, lambda: algo(ctx, b))

    async def flat_all_gather(self, o: Mem, i: Mem) -> None:
        if isinstance(o, DeviceBuf) or isinstance(i, DeviceBuf):
            return await self._on_device("all_gather", [o, i], [0])
        done = self._fast_all_gather(o, i)
        if done is not None:
            if done is not True:
                await done
            return
        fast = self._fast
        pieces = fast is not None and fast.pieces
        fp = self.next_fingerprint(CollOp.ALL_GATHER, o.dtype, i.count, fast=pieces)
        nb = i.nbytes
        if not np.shares_memory(o.data[self.rank * nb:(self.rank + 1) * nb], i.data) or \
                o.data[self.rank * nb:].ctypes.data != i.data.ctypes.data:
            o.data[self.rank * nb:(self.rank + 1) * nb] = i.data
        if pieces:
            await run_collective(self, fp, lambda: fast.all_gather_pieces(fp, i.data, o.data, i.count, o.dtype))
            return
        ctx = CollCtx(self, fp, o.dtype, None)
        algo = ring.all_gather if self._algo("all_gather", o.nbytes) == algorithms.RING else latency.all_gather
        await run_collective(self, fp, lambda: algo(ctx, o))

    async def flat_reduce_scatter(self, o: Mem, i: Mem, op: ReduceOp) -> None:
        if isinstance(o, DeviceBuf) or isinstance(i, DeviceBuf):
            return await self._on_device("reduce_scatter", [o, i], [0], op=op)
        done = self._fast_reduce_scatter(o, i, op)
        if done is not None:
            if done is not True:
                await done
            return
        fast = self._fast
        if fast is not None and fast.pieces:
            fp = self.next_fingerprint(CollOp.REDUCE_SCATTER, o.dtype, o.count, -1, op, True)
            await run_collective(self, fp, lambda: fast.reduce_scatter_pieces(fp, i.data, o.data, o.count, o.dtype,
                                                                              op))
            return
        fp = self.next_fingerprint(CollOp.REDUCE_SCATTER, o.dtype, o.count, -1, op)
        ctx = CollCtx(self, fp, o.dtype, op)
        scratch = self._pool.take(i.nbytes)
        try:
            if self._algo("reduce_scatter", i.nbytes) == algorithms.RING:
                s = scratch[: i.nbytes]
                await run_collective(self, fp, lambda: ring.reduce_scatter(ctx, o, i, s))
            else:
                await run_collective(self, fp, lambda: latency.reduce_scatter(ctx, o, i, scratch[: i.nbytes]))
        finally:
            self._pool.give(scratch)

    async def flat_broadcast(self, b: Mem, root: int) -> None:
        if isinstance(b, DeviceBuf):
            return await self._on_device("broadcast", [b], [0], root=root)
        done = self._fast_broadcast(b, root)
        if done is not None:
            if done is not True:
                await done
            return
        fp = self.next_fingerprint(CollOp.BROADCAST, b.dtype, b.count, root)
        ctx = CollCtx(self, fp, b.dtype, None)
        algo = ring.broadcast if self._algo("broadcast", b.nbytes) == algorithms.RING else latency.broadcast
        await run_collective(self, fp, lambda: algo(ctx, b, root))

    async def flat_reduce(self, b: Mem, root: int, op: ReduceOp) -> None:
        if isinstance(b, DeviceBuf):
            return await self._on_device("reduce", [b], [0], root=root, op=op)
        fp = self.next_fingerprint(CollOp.REDUCE, b.dtype, b.count, root, op)
        ctx = CollCtx(self, fp, b.dtype, op)
        scratch = self._pool.take(2 * b.nbytes)
        try:
            acc = None
            if self.rank != root:
                acc = scratch[: b.nbytes]
                acc[:] = b.data
            if self._algo("reduce", b.nbytes) == algorithms.RING:
                await run_collective(self, fp, lambda: ring.reduce(ctx, b, root, acc))
            else:
                tmp = scratch[b.nbytes: 2 * b.nbytes]
                await run_collective(self, fp, lambda: latency.reduce(ctx, b, root, acc, tmp))
        finally:
            self._pool.give(scratch)

    async def flat_all_to_all(self, o: Mem, i: Mem) -> None:
        if isinstance(o, DeviceBuf) or isinstance(i, DeviceBuf):
            return await self._on_device("all_to_all", [o, i], [0])
        fp = self.next_fingerprint(CollOp.ALL_TO_ALL, o.dtype, i.count)
        ctx = CollCtx(self, fp, o.dtype, None)
        await run_collective(self, fp, lambda: direct.all_to_all(ctx, o, i))

    async def flat_gather(self, o: Mem | None, i: Mem, root: int) -> None:
        if isinstance(o, DeviceBuf) or isinstance(i, DeviceBuf):
            return await self._on_device("gather", [o, i], [0], root=root)
        fp = self.next_fingerprint(CollOp.GATHER, i.dtype, i.count, root)
        ctx = CollCtx(self, fp, i.dtype, None)
        await run_collective(self, fp, lambda: direct.gather(ctx, o, i, root))

    async def flat_scatter(self, o: Mem, i: Mem | None, root: int) -> None:
        if isinstance(o, DeviceBuf) or isinstance(i, DeviceBuf):
            return await self._on_device("scatter", [o, i], [0], root=root)
        fp = self.next_fingerprint(CollOp.SCATTER, o.dtype, o.count, root)
        ctx = CollCtx(self, fp, o.dtype, None)
        await run_collective(self, fp, lambda: direct.scatter(ctx, o, i, root))

    async def flat_barrier(self) -> None:
        done = self._fast_barrier()
        if done is not None:
            if done is not True:
                await done
            return
        fp = self.next_fingerprint(CollOp.BARRIER, None, 0)
        ctx = CollCtx(self, fp, DType.UINT8, None)
        await run_collective(self, fp, lambda: latency.barrier(ctx))

    def close_fast(self, children: bool = False) -> None:
        """Let go of the fast path's segment and socket (and, with children, those of the sub-groups)."""
        if self._fast is not None:
            self._fast.close()
        if children:
            for c in self._children:
                c.close_fast(children=True)

    # ---- device memory -------------------------------------------------------------------------------
    def _gpu_island(self) -> bool:
        """One GPU island: its device collectives run in the vendor CCL."""
        return self._islands == 1 and dispatch.vendor_of(self._labels[self.rank]) is not None

    async def _on_device(self, name: str, bufs: list[Mem | None], outputs: list[int], root: int = -1,
                         op: ReduceOp = ReduceOp.SUM) -> None:
        """A collective with device buffers: the vendor CCL on one GPU island when every buffer is device memory
        and the CCL has the collective, else host copies through hetccl's host algorithms (as host-memory
        ranks run it: the same collectives on every rank)."""
        if self._gpu_island() and name in dispatch.VENDOR_OPS and all(isinstance(b, DeviceBuf) for b in bufs):
            return await self._vendor_run(name, bufs, root, op)  # type: ignore[arg-type]
        await self._staged(name, bufs, outputs, root, op)

    async def _staged(self, name: str, bufs: list[Mem | None], outputs: list[int], root: int = -1,
                      op: ReduceOp = ReduceOp.SUM) -> None:
        flat = getattr(self, f"flat_{name}")

        async def on_host(host: list[Buf | None]) -> None:
            extra = ([root] if root >= 0 else []) + ([op] if name in ("all_reduce", "reduce_scatter", "reduce")
                                                     else [])
            await flat(*host, *extra)

        await staging.staged(bufs, outputs, on_host)

    async def flat_device_ring_all_reduce(self, b: DeviceBuf, op: ReduceOp) -> None:
        """all_reduce of device memory over the host transports between ranks that all hold device memory and
        share no vendor CCL: the staged ring (algorithms/staged_ring.py), reduced on the devices."""
        use_device(b.device)
        fp = self.next_fingerprint(CollOp.ALL_REDUCE, b.dtype, b.count, -1, op)
        ctx = CollCtx(self, fp, b.dtype, op)
        deadline = self._deadline()
        await run_collective(self, fp, lambda: staged_ring.all_reduce(ctx, as_tensor(b), stream_of(b),
                                                                      staging.STAGE_CHUNK, deadline))

    async def flat_device_ring_all_gather(self, o: DeviceBuf, i: DeviceBuf) -> None:
        """all_gather of device memory between ranks that all hold it and share no vendor CCL: the staged ring's
        all-gather half, in place in o (i is copied into this rank's block first, unless it is that block)."""
        use_device(o.device)
        fp = self.next_fingerprint(CollOp.ALL_GATHER, o.dtype, i.count)
        ctx = CollCtx(self, fp, o.dtype, None)
        stream, t, k = stream_of(o), as_tensor(o), i.count
        mine = t[self.rank * k:(self.rank + 1) * k]
        if i.ptr != mine.data_ptr():
            with torch_mod().cuda.stream(stream):
                mine.copy_(as_tensor(i))
        deadline = self._deadline()
        await run_collective(self, fp, lambda: staged_ring.all_gather(ctx, t, stream, staging.STAGE_CHUNK, deadline))

    async def flat_device_ring_reduce_scatter(self, o: DeviceBuf, i: DeviceBuf, op: ReduceOp) -> None:
        """reduce_scatter of device memory between ranks that all hold it and share no vendor CCL: the staged
        ring's reduce-scatter half (i is only read; op never AVG: the caller divides)."""
        use_device(o.device)
        fp = self.next_fingerprint(CollOp.REDUCE_SCATTER, o.dtype, o.count, -1, op)
        ctx = CollCtx(self, fp, o.dtype, op)
        deadline = self._deadline()
        await run_collective(self, fp, lambda: staged_ring.reduce_scatter(ctx, as_tensor(o), as_tensor(i),
                                                                          stream_of(o), staging.STAGE_CHUNK,
                                                                          deadline))

    def island_vendors(self) -> dispatch.IslandVendors:
        """This group's vendor communicators (made on first use, one per device)."""
        if self._vendors is None:
            label = self._labels[self.rank]
            self._vendors = dispatch.IslandVendors(label, self.rank, self._members,
                                                   f"{self._fabric.job}/vendor/{self.comm_id}", self._fabric,
                                                   self._settings.timeout)
        return self._vendors

    def vendor_comm(self, device: int) -> VendorComm | None:
        """This group's vendor communicator on `device` if it is made (never makes one: any thread may ask)."""
        vendors = self._vendors
        return vendors.comms.get(device) if vendors is not None else None

    async def _vendor_run(self, name: str, bufs: list[DeviceBuf], root: int = -1, op: ReduceOp = ReduceOp.SUM
                          ) -> None:
        """A collective on device buffers inside one GPU island: the vendor CCL on the caller's stream."""
        self._check_open()
        buf, call, what = dispatch.vendor_call(name, bufs, root, op)
        use_device(buf.device)
        vc = await self.island_vendors().get(buf.device)
        await vc.run(lambda s: call(vc, s), stream_handle(buf), self._deadline(), what)

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._settings.timeout

    def _vendor_now(self) -> dispatch.IslandVendors | None:
        """The vendor communicators the calling thread may enqueue on: one GPU island, not blocking mode, none
        being made (what enqueue_now and lane() both require), else None."""
        vendors = self._vendors
        if vendors is None or vendors.pending or not self._gpu_island() or blocking():
            return None
        return vendors

    def enqueue_vendor_now(self, name: str, bufs: list[DeviceBuf], root: int, op: ReduceOp) -> Any:
        """A vendor collective of checked device buffers, enqueued from the calling thread (the torch backend's
        caller, not hetccl's loop thread) when it can be: one GPU island whose vendor communicator for the
        buffer's device exists. Returns the event recorded after the operation, or False where the caller must
        go through the loop instead. Raises the group's error (a lost peer, a watchdog timeout) like the loop
        path."""
        vendors = self._vendor_now()
        if vendors is None or name not in dispatch.VENDOR_OPS:
            return False
        self._check_open()
        buf, call, what = dispatch.vendor_call(name, bufs, root, op)
        vc = vendors.comms.get(buf.device)
        if vc is None:
            return False
        deadline = time.monotonic() + self._settings.timeout  # the loop's clock: asyncio uses time.monotonic
        return vc.run_now(lambda s: call(vc, s), buf.stream, deadline, what)

    def lane(self, device: int) -> IslandLane | None:
        """The fast lane on `device`: where enqueue_vendor_now would enqueue, else None."""
        vendors = self._vendor_now()
        vc = vendors.comms.get(device) if vendors is not None else None
        return IslandLane(self, vc) if vc is not None else None

    def vendor_comms(self) -> list[VendorComm]:
        """Every vendor communicator of this group and of its sub-groups (islands, leaders, splits)."""
        out: list[VendorComm] = []
        todo: list[Group] = [self]
        seen: set[int] = set()
        while todo:
            g = todo.pop()
            if id(g) in seen:
                continue
            seen.add(id(g))
            if g._vendors is not None:
                out.extend(g._vendors.comms.values())
            todo.extend(g._children)
        return out

    async def drain_devices(self) -> None:
        """Wait for every device operation enqueued through this group (and its sub-groups) to complete."""
        await dispatch.drain(self.vendor_comms(), self._deadline())

    # ---- sub-groups ----------------------------------------------------------------------------------
    async def split_group(self, color: int | None, key: int = 0) -> Group | None:
        """Collective: ranks with the same color form a new group of this group's type, ordered by (key, rank);
        color None -> this rank joins none and gets None."""
        self._check_open()
        mine = np.array([-1 if color is None else int(color), int(key)], dtype=np.int64)
        table = np.empty(2 * self.size, dtype=np.int64)
        await self.flat_all_gather(as_buf(table), as_buf(mine))  # plain exchange, whatever the islands
        self._splits += 1
        if color is None:
            return None
        members = sorted((int(table[2 * r + 1]), r) for r in range(self.size) if table[2 * r] == color)
        global_members = [self._members[r] for _, r in members]
        child = type(self)(self._fabric, derived_id(self.comm_id, f"{self._splits}/{color}"), global_members)
        self._children.append(child)
        child._parent = self
        return child

    # ---- point to point ------------------------------------------------------------------------------
    def _p2p_id(self, tag: int) -> int:
        """The wire communicator id of one tag's point-to-point streams (tag 0: comm_id | P2P_SPACE)."""
        pid = self._p2p_ids.get(tag)
        if pid is None:
            if not isinstance(tag, int | np.integer):
                raise ConfigError(f"tag={tag!r} must be an int")
            pid = self._p2p_ids[int(tag)] = derived_id(self.comm_id, f"p2p-tag/{int(tag)}") | P2P_SPACE
        return pid

    async def p2p_send(self, b: Buf, peer: int, tag: int) -> None:
        pid = self._p2p_id(tag)
        seq = self._send_seq[peer, tag]
        self._send_seq[peer, tag] = (seq + 1) & 0xFFFFFFFF
        fp = Fingerprint(pid, seq, CollOp.SEND_RECV, int(b.dtype), b.count, -1, NO_OP)
        ep = self._endpoints[peer]
        await run_collective(self, fp, lambda: ep.send(fp, P2P_TAG | self.rank, b.data), peers=(peer,))

    async def p2p_recv(self, b: Buf, peer: int | None, tag: int) -> int:
        pid = self._p2p_id(tag)
        prev = self._recv_gate.get(tag)
        if peer is not None and (prev is None or prev.done()):
            # the common path: nothing unresolved ahead, so the sequence number is taken before any await
            return await self._recv_from(b, peer, tag, pid)
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._recv_gate[tag] = gate
        try:
            if prev is not None and not prev.done():
                await asyncio.shield(prev)
            if peer is not None:
                receive = self._recv_from(b, peer, tag, pid)  # takes the sequence number now
                gate.set_result(None)
                return await receive
            return await self._recv_any(b, tag, pid, gate)
        finally:
            if not gate.done():  # failed or cancelled before this receive's peer was known
                if prev is None or prev.done():
                    gate.set_result(None)
                else:  # still behind an earlier one: later receives wait for it too
                    prev.add_done_callback(lambda _: gate.done() or gate.set_result(None))
            if self._recv_gate.get(tag) is gate and gate.done():
                del self._recv_gate[tag]

    def _recv_from(self, b: Buf, peer: int, tag: int, pid: int) -> Coroutine[Any, Any, int]:
        """Take the next sequence number of (peer, tag) now; the returned coroutine receives that message."""
        seq = self._recv_seq[peer, tag]
        self._recv_seq[peer, tag] = (seq + 1) & 0xFFFFFFFF
        fp = Fingerprint(pid, seq, CollOp.SEND_RECV, int(b.dtype), b.count, -1, NO_OP)
        ep = self._endpoints[peer]

        async def body() -> None:
            await ep.post_recv(fp, P2P_TAG | peer, b.data)

        async def receive() -> int:
            await run_collective(self, fp, body, peers=(peer,))
            return peer

        return receive()

    async def _recv_any(self, b: Buf, tag: int, pid: int, gate: asyncio.Future[None]) -> int:
        """Post one receive on every peer's next expected message of this tag; the first to arrive (or, among
        messages already here, the earliest arrived) wins and only that peer's counter moves on."""
        peers = sorted(self._endpoints)
        if not peers:
            raise ConfigError("recv from any source on a communicator of one rank: there is no other rank")

        def fp_of(p: int) -> Fingerprint:
            return Fingerprint(pid, self._recv_seq[p, tag], CollOp.SEND_RECV, int(b.dtype), b.count, -1, NO_OP)

        def resolved(p: int) -> None:
            self._recv_seq[p, tag] = (self._recv_seq[p, tag] + 1) & 0xFFFFFFFF
            gate.set_result(None)

        # a message already here: the earliest arrived
        matchers = {p: self._fabric.matchers[self._endpoints[p].peer] for p in peers}
        here = [(matchers[p].arrived.get((pid, self._recv_seq[p, tag], P2P_TAG | p)), p)
                for p in peers]
        here = [(stamp, p) for stamp, p in here if stamp is not None]
        if here:
            p = min(here)[1]
            fp = fp_of(p)
            resolved(p)
            ep = self._endpoints[p]
            await run_collective(self, fp, lambda: ep.post_recv(fp, P2P_TAG | p, b.data), peers=(p,))
            return p
        group = AnySource()
        waits: dict[asyncio.Future[Any], int] = {}
        for p in peers:  # all in one step: no frame can be taken between two of these posts
            ep = self._endpoints[p]
            fp = fp_of(p)
            key = (pid, fp.seq, P2P_TAG | p)
            awaitable = ep.post_recv(fp, P2P_TAG | p, b.data)
            req = matchers[p].posted.get(key)
            if req is None:  # completed at once: failed (a lost peer, a poisoned communicator) or delivered
                group.unpost()
                for w in waits:
                    w.cancel()
                await awaitable
                resolved(p)
                return p
            group.add(matchers[p], key, req)
            waits[asyncio.ensure_future(awaitable)] = p
        desc = fp_of(peers[0])  # names the receive in a timeout message; withdraws nothing (peers=())

        async def body() -> int:
            try:
                pending = set(waits)
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for w in done:
                        if w.cancelled():  # withdrawn because another peer's message won
                            continue
                        if w.exception() is not None:
                            raise w.exception()  # type: ignore[misc]
                        return waits[w]
                raise HetcclError("recv from any source: every posting was withdrawn")  # not reached
            finally:
                group.unpost(keep=group.winner)
                for w in waits:
                    w.cancel()

        def won() -> None:
            if group.winner is not None and not gate.done():
                resolved(next(p for p in peers if matchers[p] is group.winner))

        # the peer is known as soon as its frame is taken (before the data has landed): later receives go on
        for _m, _key, req in group.posts:
            req.fut.add_done_callback(lambda _f: won())
        task = asyncio.ensure_future(run_collective(self, desc, body, peers=()))
        try:
            return await task
        finally:
            won()

    # ---- failures ------------------------------------------------------------------------------------
    def abort(self) -> None:
        """End, on this rank, every collective of this communicator (and of its sub-communicators) in flight:
        they raise CommAbortedError at once, and so does every later call. Device work is ended by aborting
        the vendor communicators. Not collective; other ranks see this rank stop answering (use shrink() on
        the survivors, or a new job)."""
        if self._aborted is None:
            self._aborted = CommAbortedError(f"rank {self.rank}: communicator {self.comm_id:#x} was aborted")
        self._watchdog.abort_all()
        for ep in self._endpoints.values():
            m = self._fabric.matchers[ep.peer]
            m.cancel_comm(self.comm_id, self._aborted)
            for pid in self._p2p_ids.values():
                m.cancel_comm(pid, self._aborted)
        if self._vendors is not None:
            for vc in self._vendors.comms.values():
                vc.abort()
        for child in self._children:
            child.abort()


# the fast path's synchronous starts by collective name (Group.fast_now)
_FAST_STARTS: dict[str, Callable[..., Any]] = {
    "all_reduce": Group._fast_all_reduce, "all_gather": Group._fast_all_gather,
    "reduce_scatter": Group._fast_reduce_scatter, "broadcast": Group._fast_broadcast, "barrier": Group._fast_barrier,
}
