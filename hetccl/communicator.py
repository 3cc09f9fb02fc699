"""The public async Communicator: validates arguments, numbers collectives, picks an algorithm and runs
it through the scheduler. One process fabric (connections) may serve several communicators (split)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any

import numpy as np

from . import algorithms, hangreport
from .algorithms import direct, latency, ring
from .bootstrap import Fabric
from .dtypes import Buf, DType, ReduceOp, as_buf, parse_op
from .errors import CollectiveTimeout, CommAbortedError, ConfigError, HetcclError, PeerLostError
from .flight import FlightRecorder
from .gpu.buffers import is_device
from .ordering import IssueOrder
from .scheduler import CollCtx, Watchdog, run_collective
from .wire import CollOp, Fingerprint

P2P_TAG = 0xFFFF << 48
P2P_SPACE = 1 << 31  # p2p frames use comm id | P2P_SPACE: their sequence numbers never meet a collective's
_NO_DTYPE, _NO_OP = 255, 255


def _any_device(*objs: Any) -> bool:
    return any(o is not None and type(o) is not np.ndarray and is_device(o) for o in objs)


async def _gpu(comm: Communicator, name: str, args: list[Any], kwargs: dict[str, Any], outputs: list[int]) -> None:
    from .gpu import dispatch

    await dispatch.collective(comm, name, args, kwargs, outputs)


async def _hier(comm: Communicator, name: str, *args: Any, **kwargs: Any) -> None:
    """A collective across islands: a schedule of sub-collectives, run in issue order (ordering.py says why)."""
    from .gpu import dispatch, hierarchical

    fn = dispatch.hierarchical_all_reduce if name == "all_reduce" else getattr(hierarchical, name)
    async with comm._order.turn(name, asyncio.get_running_loop().time() + comm._settings.timeout):
        await fn(comm, *args, **kwargs)


class _ScratchPool:
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


def _derived_id(parent: int, what: str) -> int:
    """A communicator id made from its parent's and a description every member computes alike."""
    digest = hashlib.blake2s(f"{parent}/{what}".encode(), digest_size=4).digest()
    child_id = int.from_bytes(digest, "little") & (P2P_SPACE - 1)  # 31 bits; 0 and 1 are reserved
    return child_id if child_id > 1 else child_id + 2


class Communicator:
    """A group of ranks that run collectives together. Create with `await hetccl.init()`."""

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
        self._pool = _ScratchPool()
        self._override = algorithms.parse_override(self._settings.algo)
        self._kind = fabric.transport_kind(members)
        self._children: list[Communicator] = []
        self._watchdog = Watchdog()
        self._gpu_layout: Any = None  # island layout (gpu.dispatch.Layout)
        self._islands = len({fabric.records[g].get("island", "cpu") for g in members}) if fabric.records else 1
        self._algo_cache: dict[tuple[str, int], str] = {}
        self._flight = FlightRecorder()
        self._order = IssueOrder()  # turns of the hierarchical collectives
        self._aborted: HetcclError | None = None  # set by abort() / shrink(): every later call raises it
        fabric.comms[comm_id] = self
        if fabric.answer_report is None:
            fabric.answer_report = hangreport.answer

    # ---- helpers -------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"<hetccl.Communicator rank {self.rank}/{self.size} id {self.comm_id:#x}>"

    @property
    def topology(self) -> Any:
        return self._fabric.topology

    def _check_open(self) -> None:
        if self._closed:
            raise HetcclError("communicator is closed; create a new one with hetccl.init()")
        if self._aborted is not None:
            raise self._aborted

    def _fp(self, op: int, dtype: DType | None, count: int, root: int = -1,
            redop: ReduceOp | None = None) -> Fingerprint:
        self._check_open()
        seq = self._seq
        self._seq = (seq + 1) & 0xFFFFFFFF
        return Fingerprint(self.comm_id, seq, op, _NO_DTYPE if dtype is None else int(dtype), count, root,
                           _NO_OP if redop is None else int(redop))

    def _root(self, root: int) -> int:
        if not isinstance(root, int | np.integer) or not 0 <= root < self.size:
            raise ConfigError(f"root={root!r} is not a rank of this communicator (0..{self.size - 1})")
        return int(root)

    def _algo(self, op: str, nbytes: int) -> str:
        algo = self._algo_cache.get((op, nbytes))
        if algo is None:
            if len(self._algo_cache) > 4096:
                self._algo_cache.clear()
            algo = self._algo_cache[op, nbytes] = algorithms.choose(op, nbytes, self.size, self._kind,
                                                                    self._override)
        return algo

    # ---- collectives ---------------------------------------------------------------------------------
    async def all_reduce(self, buf: Any, op: ReduceOp | str = ReduceOp.SUM) -> None:
        """In place: every rank ends with the reduction of all ranks' `buf`."""
        if self._islands > 1:
            return await _hier(self, "all_reduce", buf, op)
        if _any_device(buf):
            from .gpu import dispatch

            return await dispatch.vendor_collective(self, "all_reduce", [buf], {"op": op})
        await self._all_reduce_flat(buf, op)

    async def _all_reduce_flat(self, buf: Any, op: ReduceOp | str = ReduceOp.SUM) -> None:
        """all_reduce of host memory with hetccl's own algorithms, whatever the islands."""
        b, rop = as_buf(buf, "buf"), parse_op(op)
        fp = self._fp(CollOp.ALL_REDUCE, b.dtype, b.count, -1, rop)
        ctx = CollCtx(self, fp, b.dtype, rop)
        algo = ring.all_reduce if self._algo("all_reduce", b.nbytes) == algorithms.RING else latency.all_reduce
        await run_collective(self, fp, lambda: algo(ctx, b))

    async def all_gather(self, out: Any, inp: Any, _flat: bool = False) -> None:
        """out (size * len(inp) elements) receives every rank's inp, rank-major."""
        if self._islands > 1 and not _flat:
            return await _hier(self, "all_gather", out, inp)
        if _any_device(out, inp):
            return await _gpu(self, "all_gather", [out, inp], {}, [0])
        o, i = as_buf(out, "out"), as_buf(inp, "inp", writable=False)
        self._same_dtype(o, i)
        if o.count != self.size * i.count:
            raise ConfigError(f"all_gather: out has {o.count} elements, needs size*len(inp) = "
                              f"{self.size}*{i.count} = {self.size * i.count}")
        fp = self._fp(CollOp.ALL_GATHER, o.dtype, i.count)
        nb = i.nbytes
        if not np.shares_memory(o.data[self.rank * nb:(self.rank + 1) * nb], i.data) or \
                o.data[self.rank * nb:].ctypes.data != i.data.ctypes.data:
            o.data[self.rank * nb:(self.rank + 1) * nb] = i.data
        ctx = CollCtx(self, fp, o.dtype, None)
        algo = ring.all_gather if self._algo("all_gather", o.nbytes) == algorithms.RING else latency.all_gather
        await run_collective(self, fp, lambda: algo(ctx, o))

    async def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp | str = ReduceOp.SUM, _flat: bool = False
                             ) -> None:
        """out (k elements) receives block `rank` of the reduction of every rank's inp (size * k)."""
        if self._islands > 1 and not _flat:
            return await _hier(self, "reduce_scatter", out, inp, op=op)
        if _any_device(out, inp):
            return await _gpu(self, "reduce_scatter", [out, inp], {"op": op}, [0])
        o, i, rop = as_buf(out, "out"), as_buf(inp, "inp", writable=False), parse_op(op)
        self._same_dtype(o, i)
        if i.count != self.size * o.count:
            raise ConfigError(f"reduce_scatter: inp has {i.count} elements, needs size*len(out) = "
                              f"{self.size}*{o.count} = {self.size * o.count}")
        fp = self._fp(CollOp.REDUCE_SCATTER, o.dtype, o.count, -1, rop)
        ctx = CollCtx(self, fp, o.dtype, rop)
        scratch = self._pool.take(i.nbytes)
        try:
            if self._algo("reduce_scatter", i.nbytes) == algorithms.RING:
                s = scratch[: i.nbytes]
                s[:] = i.data
                await run_collective(self, fp, lambda: ring.reduce_scatter(ctx, o, i, s))
            else:
                await run_collective(self, fp, lambda: latency.reduce_scatter(ctx, o, i, scratch[: i.nbytes]))
        finally:
            self._pool.give(scratch)

    async def broadcast(self, buf: Any, root: int = 0, _flat: bool = False) -> None:
        """Every rank's buf becomes root's buf."""
        if self._islands > 1 and not _flat:
            return await _hier(self, "broadcast", buf, root=self._root(root))
        if _any_device(buf):
            return await _gpu(self, "broadcast", [buf], {"root": root}, [0])
        root = self._root(root)
        b = as_buf(buf, "buf", writable=(self.rank != root))
        fp = self._fp(CollOp.BROADCAST, b.dtype, b.count, root)
        ctx = CollCtx(self, fp, b.dtype, None)
        algo = ring.broadcast if self._algo("broadcast", b.nbytes) == algorithms.RING else latency.broadcast
        await run_collective(self, fp, lambda: algo(ctx, b, root))

    async def reduce(self, buf: Any, root: int = 0, op: ReduceOp | str = ReduceOp.SUM, _flat: bool = False
                     ) -> None:
        """root's buf becomes the reduction of every rank's buf; other ranks' buffers are left unchanged."""
        if self._islands > 1 and not _flat:
            return await _hier(self, "reduce", buf, root=self._root(root), op=op)
        if _any_device(buf):
            return await _gpu(self, "reduce", [buf], {"root": root, "op": op}, [0])
        root = self._root(root)
        b, rop = as_buf(buf, "buf", writable=(self.rank == root)), parse_op(op)
        fp = self._fp(CollOp.REDUCE, b.dtype, b.count, root, rop)
        ctx = CollCtx(self, fp, b.dtype, rop)
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

    async def all_to_all(self, out: Any, inp: Any) -> None:
        """Block p of every rank's inp goes to rank p, landing in block `sender` of its out."""
        if _any_device(out, inp):
            return await _gpu(self, "all_to_all", [out, inp], {}, [0])
        o, i = as_buf(out, "out"), as_buf(inp, "inp", writable=False)
        self._same_dtype(o, i)
        if o.count != i.count or i.count % self.size:
            raise ConfigError(f"all_to_all: out and inp need the same length, a multiple of size={self.size} "
                              f"(got {o.count} and {i.count})")
        fp = self._fp(CollOp.ALL_TO_ALL, o.dtype, i.count)
        ctx = CollCtx(self, fp, o.dtype, None)
        await run_collective(self, fp, lambda: direct.all_to_all(ctx, o, i))

    async def gather(self, out: Any, inp: Any, root: int = 0) -> None:
        """root's out (size * len(inp)) receives every rank's inp, rank-major; out may be None elsewhere."""
        if _any_device(out, inp):
            return await _gpu(self, "gather", [out, inp], {"root": root}, [0])
        root = self._root(root)
        i = as_buf(inp, "inp", writable=False)
        o = None
        if self.rank == root:
            o = as_buf(out, "out")
            self._same_dtype(o, i)
            if o.count != self.size * i.count:
                raise ConfigError(f"gather: out has {o.count} elements, needs size*len(inp) = "
                                  f"{self.size * i.count}")
        fp = self._fp(CollOp.GATHER, i.dtype, i.count, root)
        ctx = CollCtx(self, fp, i.dtype, None)
        await run_collective(self, fp, lambda: direct.gather(ctx, o, i, root))

    async def scatter(self, out: Any, inp: Any, root: int = 0) -> None:
        """Block p of root's inp (size * len(out)) lands in rank p's out; inp may be None off root."""
        if _any_device(out, inp):
            return await _gpu(self, "scatter", [out, inp], {"root": root}, [0])
        root = self._root(root)
        o = as_buf(out, "out")
        i = None
        if self.rank == root:
            i = as_buf(inp, "inp", writable=False)
            self._same_dtype(o, i)
            if i.count != self.size * o.count:
                raise ConfigError(f"scatter: inp has {i.count} elements, needs size*len(out) = "
                                  f"{self.size * o.count}")
        fp = self._fp(CollOp.SCATTER, o.dtype, o.count, root)
        ctx = CollCtx(self, fp, o.dtype, None)
        await run_collective(self, fp, lambda: direct.scatter(ctx, o, i, root))

    async def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""
        fp = self._fp(CollOp.BARRIER, None, 0)
        ctx = CollCtx(self, fp, DType.UINT8, None)
        await run_collective(self, fp, lambda: latency.barrier(ctx))

    async def synchronize(self) -> None:
        """Wait until every device-memory collective this rank enqueued has completed on the GPU.

        Device collectives return once enqueued on the buffer's current stream (like torch.distributed's
        NCCL backend): later work on that stream sees the result without any wait. This is for a host that
        needs the result itself, or wants errors (a lost peer, a timeout) raised now. Host memory: no-op."""
        self._check_open()
        if self._gpu_layout is not None or self._children:
            from .gpu import dispatch

            await dispatch.synchronize(self)

    # ---- point to point ------------------------------------------------------------------------------
    def _peer(self, peer: int) -> int:
        if not isinstance(peer, int | np.integer) or not 0 <= peer < self.size or peer == self.rank:
            raise ConfigError(f"peer={peer!r} must be another rank of this communicator (0..{self.size - 1}, "
                              f"not {self.rank})")
        return int(peer)

    def _p2p_id(self, tag: int) -> int:
        """The wire communicator id of one tag's point-to-point streams (tag 0: comm_id | P2P_SPACE)."""
        pid = self._p2p_ids.get(tag)
        if pid is None:
            if not isinstance(tag, int | np.integer):
                raise ConfigError(f"tag={tag!r} must be an int")
            pid = self._p2p_ids[int(tag)] = _derived_id(self.comm_id, f"p2p-tag/{int(tag)}") | P2P_SPACE
        return pid

    async def send(self, buf: Any, peer: int, tag: int = 0) -> None:
        """Send buf to peer; matched in order with the peer's receives of the same tag from this rank (or from
        any source)."""
        self._check_open()
        peer = self._peer(peer)
        b = as_buf(buf, "buf", writable=False)
        pid = self._p2p_id(tag)
        seq = self._send_seq[peer, tag]
        self._send_seq[peer, tag] = (seq + 1) & 0xFFFFFFFF
        fp = Fingerprint(pid, seq, CollOp.SEND_RECV, int(b.dtype), b.count, -1, _NO_OP)
        ep = self._endpoints[peer]
        await run_collective(self, fp, lambda: ep.send(fp, P2P_TAG | self.rank, b.data), peers=(peer,))

    async def recv(self, buf: Any, peer: int | None = None, tag: int = 0) -> int:
        """Receive into buf (same dtype and count as the matching send) from `peer`, or with peer=None from any
        source: the first message of this tag to arrive from any rank (per sender, messages still match in
        order; a receive posted later never takes a message an earlier one could). Returns the sender's rank."""
        self._check_open()
        if peer is not None:
            peer = self._peer(peer)
        b = as_buf(buf, "buf")
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
        fp = Fingerprint(pid, seq, CollOp.SEND_RECV, int(b.dtype), b.count, -1, _NO_OP)
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
        from .transports.base import AnySource

        peers = sorted(self._endpoints)
        if not peers:
            raise ConfigError("recv from any source on a communicator of one rank: there is no other rank")

        def fp_of(p: int) -> Fingerprint:
            return Fingerprint(pid, self._recv_seq[p, tag], CollOp.SEND_RECV, int(b.dtype), b.count, -1, _NO_OP)

        def resolved(p: int) -> None:
            self._recv_seq[p, tag] = (self._recv_seq[p, tag] + 1) & 0xFFFFFFFF
            gate.set_result(None)

        # a message already here: the earliest arrived
        here = [(self._endpoints[p].matcher.arrived.get((pid, self._recv_seq[p, tag], P2P_TAG | p)), p)
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
            req = ep.matcher.posted.get(key)
            if req is None:  # completed at once: failed (a lost peer, a poisoned communicator) or delivered
                group.unpost()
                for w in waits:
                    w.cancel()
                await awaitable
                resolved(p)
                return p
            group.add(ep.matcher, key, req)
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
                resolved(next(p for p in peers if self._endpoints[p].matcher is group.winner))

        # the peer is known as soon as its frame is taken (before the data has landed): later receives go on
        for _m, _key, req in group.posts:
            req.fut.add_done_callback(lambda _f: won())
        task = asyncio.ensure_future(run_collective(self, desc, body, peers=()))
        try:
            return await task
        finally:
            won()

    # ---- groups --------------------------------------------------------------------------------------
    async def split(self, color: int | None, key: int = 0, _layout: bool = True) -> Communicator | None:
        """Collective: ranks with the same color form a new communicator, ordered by (key, rank).
        color None -> this rank joins none and gets None."""
        self._check_open()
        if color is not None and (not isinstance(color, int | np.integer) or color < 0):
            raise ConfigError(f"split color must be a non-negative int or None (got {color!r})")
        mine = np.array([-1 if color is None else int(color), int(key)], dtype=np.int64)
        table = np.empty(2 * self.size, dtype=np.int64)
        await self.all_gather(table, mine, _flat=True)  # plain exchange, whatever the islands
        self._splits += 1
        if color is None:
            return None
        members = sorted((int(table[2 * r + 1]), r) for r in range(self.size) if table[2 * r] == color)
        global_members = [self._members[r] for _, r in members]
        child = Communicator(self._fabric, _derived_id(self.comm_id, f"{self._splits}/{color}"), global_members)
        self._children.append(child)
        child._parent = self
        if _layout and child._islands > 1:  # collective among the child's members, right at its creation
            from .gpu import dispatch

            await dispatch.build_layout(child)
        return child

    def vendor_comms(self) -> list[Any]:
        """Every vendor communicator of this communicator and its sub-communicators (none without device work)."""
        if self._gpu_layout is None and not self._children:
            return []
        from .gpu import dispatch

        return dispatch._vendor_comms(self)

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
            ep.matcher.cancel_comm(self.comm_id, self._aborted)
            for pid in self._p2p_ids.values():
                ep.matcher.cancel_comm(pid, self._aborted)
        if self._gpu_layout is not None:
            from .gpu import dispatch

            for vc in dispatch._vendor_comms(self):
                vc.abort()
        for child in self._children:
            child.abort()

    async def shrink(self, timeout: float | None = None) -> Communicator:
        """Collective among the ranks still alive: a new communicator without the lost ones.

        Call it on every survivor after a PeerLostError. The survivors agree on who is lost over their own
        connections (the rendezvous store may have died with rank 0): each proposes the ranks it saw die,
        they exchange proposals and retry with the union until all agree. The new communicator keeps the
        survivors in their old order, renumbered from 0 (old rank 3 of 4 becomes rank 2 if rank 1 died). This
        communicator becomes unusable (CommAbortedError). Raises CollectiveTimeout if the survivors cannot
        agree within `timeout` (default HETCCL_TIMEOUT)."""
        if self._closed:
            raise HetcclError("communicator is closed; shrink it before closing")
        fab = self._fabric
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self._settings.timeout)
        self.abort()  # nothing of the old communicator runs on
        while True:
            alive = [g for g in self._members if g not in fab.lost]
            fab.heal([g for g in alive if g != fab.rank], dead_comms=(self.comm_id, *self._p2p_ids.values()))
            seen = np.array([1 if g in fab.lost else 0 for g in self._members], np.uint8)
            # survivors with the same view run the same probe; a new loss seen meanwhile restarts it
            probe = Communicator(fab, _derived_id(self.comm_id, f"shrink/{alive}"), alive)
            table = np.zeros(len(alive) * len(seen), np.uint8)
            task = asyncio.ensure_future(probe.all_gather(table, seen, _flat=True))
            known = len(fab.lost)
            while not task.done() and len(fab.lost) == known and loop.time() < deadline:
                await asyncio.wait([task], timeout=0.05)
            probe._closed = True
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            elif task.exception() is None:
                views = table.reshape(len(alive), len(seen))
                if (views == seen).all():
                    break
                for i in np.flatnonzero(views.max(axis=0)):  # another survivor saw this rank die
                    g = self._members[int(i)]
                    if g not in fab.lost:
                        fab._peer_lost(g, PeerLostError(f"rank {g} was reported lost by another survivor", g))
            if loop.time() > deadline:
                raise CollectiveTimeout(f"shrink: the survivors of communicator {self.comm_id:#x} did not agree "
                                        "on who is lost before the deadline")
            await asyncio.sleep(0.01)
        new = Communicator(fab, _derived_id(self.comm_id, f"shrunk/{alive}"), alive)
        self._aborted = CommAbortedError(f"communicator {self.comm_id:#x} was shrunk; use the communicator "
                                         "that shrink() returned")
        return new

    def _same_dtype(self, a: Buf, b: Buf) -> None:
        if a.dtype != b.dtype:
            raise ConfigError(f"out and inp dtypes differ ({a.dtype.name.lower()} vs {b.dtype.name.lower()}); "
                              "use the same dtype for both")

    async def close(self, timeout: float | None = None) -> None:
        """Close this communicator; closing the one from init() also closes the connections, after a closing
        barrier with the other ranks that waits at most `timeout` s (default: min(10 s, HETCCL_TIMEOUT))."""
        if self._closed:
            return
        if self._gpu_layout is not None or self._children:
            from .gpu import dispatch

            with contextlib.suppress(HetcclError):  # device work still queued ends before the connections do
                await dispatch.synchronize(self)
        self._closed = True
        if self._parent is not None:  # a closed child is dropped: split+close in a loop must not grow
            with contextlib.suppress(ValueError):
                self._parent._children.remove(self)
        if self._fabric_owner:
            from . import lifecycle

            lifecycle.untrack_async(self)
            for c in self._children:
                c._closed = True
            await self._fabric.close(barrier_s=timeout)

    _fabric_owner = False
    _parent: Communicator | None = None
