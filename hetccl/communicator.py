"""The public async Communicator: the facade. It checks every call's arguments once, then sends the
collective one of three ways: across islands to the hierarchical schedule (hierarchical.py), otherwise to the
flat engine (group.py), which runs the vendor CCL on a GPU island's device memory and hetccl's host algorithms
on host memory. One process fabric (connections) may serve several communicators (split)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from . import hierarchical
from .dtypes import Buf, ReduceOp, as_buf, parse_op
from .errors import CollectiveTimeout, CommAbortedError, ConfigError, HetcclError, PeerLostError
from .gpu.buffers import DeviceBuf, as_device_buf, is_device
from .gpu.dispatch import VENDOR_OPS, check_device_label
from .group import Group, Mem, derived_id


def _mem(obj: Any, name: str, writable: bool = True) -> Mem:
    """A user buffer as checked memory: DeviceBuf for device memory, Buf for host memory."""
    if type(obj) is not np.ndarray and is_device(obj):
        return as_device_buf(obj, name)
    return as_buf(obj, name, writable)


def _same_dtype(a: Mem, b: Mem) -> None:
    if a.dtype != b.dtype:
        raise ConfigError(f"out and inp dtypes differ ({a.dtype.name.lower()} vs {b.dtype.name.lower()}); "
                          "use the same dtype for both")


# the arguments of each hierarchical schedule that can be ordered on the caller's stream (hierarchical.SCHEDULES)
_ORDERED_ARGS: dict[str, Callable[[list[DeviceBuf], int, ReduceOp], tuple[Any, ...]]] = {
    "all_reduce": lambda b, root, op: (b[0], op), "broadcast": lambda b, root, op: (b[0], root),
    "all_gather": lambda b, root, op: (b[0], b[1]), "reduce_scatter": lambda b, root, op: (b[0], b[1], op),
}


class Communicator(Group):
    """A group of ranks that run collectives together. Create with `await hetccl.init()`."""

    _fabric_owner = False

    def __repr__(self) -> str:
        return f"<hetccl.Communicator rank {self.rank}/{self.size} id {self.comm_id:#x}>"

    @property
    def topology(self) -> Any:
        return self._fabric.topology

    # ---- argument checks (every path: islands, device, host) -----------------------------------------
    def _root(self, root: int) -> int:
        if not isinstance(root, int | np.integer) or not 0 <= root < self.size:
            raise ConfigError(f"root={root!r} is not a rank of this communicator (0..{self.size - 1})")
        return int(root)

    def _peer(self, peer: int) -> int:
        if not isinstance(peer, int | np.integer) or not 0 <= peer < self.size or peer == self.rank:
            raise ConfigError(f"peer={peer!r} must be another rank of this communicator (0..{self.size - 1}, "
                              f"not {self.rank})")
        return int(peer)

    def _gathered(self, name: str, part: Mem, whole: Mem) -> None:
        """whole holds size blocks of part's length (all_gather's out, reduce_scatter's inp, ...)."""
        _same_dtype(part, whole)
        if whole.count != self.size * part.count:
            what = "out" if name in ("all_gather", "gather") else "inp"
            of = "inp" if what == "out" else "out"
            raise ConfigError(f"{name}: {what} has {whole.count} elements, needs size*len({of}) = "
                              f"{self.size}*{part.count} = {self.size * part.count}")

    async def _across(self, name: str, *args: Any) -> None:
        """A collective across islands: the hierarchical schedule, once its buffers agree with the islands."""
        bufs = [a for a in args if isinstance(a, Buf | DeviceBuf)]
        if len({isinstance(b, DeviceBuf) for b in bufs}) > 1:
            raise ConfigError(f"out is {'device' if isinstance(bufs[0], DeviceBuf) else 'host'} memory but inp is "
                              f"{'device' if isinstance(bufs[1], DeviceBuf) else 'host'} memory; across islands "
                              "pass both of one kind")
        for b in bufs:
            if isinstance(b, DeviceBuf):
                check_device_label(self._labels[self.rank], b, self.rank, self._members[self.rank])
        if self.cpu_islands_of_one and self.settings.cross_compress == "none" and not isinstance(bufs[0], DeviceBuf):
            # CPU islands of one rank each, uncompressed: the schedule would be the leaders' step alone on this
            # very group, so it is the flat collective (and its fast path on one host: fastpath.limit_for)
            return await self._flat_in_turn(name, lambda: getattr(self, f"flat_{name}")(*args))
        await hierarchical.run(self, name, *args)

    def first_hop(self, buf: Any) -> Any:
        """What all_reduce makes of this rank's values of `buf` where they cross between islands under
        HETCCL_CROSS_COMPRESS: a new array of buf's dtype (host memory) or a new tensor (device memory), or None
        where they cross as they are (nothing is compressed for this buffer, the zero-copy link carries it, or
        this rank's island has several ranks). An error-feedback hook keeps buf minus it for the next step
        (hetccl.torch.hooks.error_feedback_hook)."""
        b = _mem(buf, "buf", writable=False)
        if self._islands == 1:
            return None
        got = hierarchical.first_hop(self, b)
        return got if got is None or not isinstance(b, Buf) else got.view(b.typed().dtype)  # host: bytes as b's dtype

    # ---- collectives ---------------------------------------------------------------------------------
    def fast_all_reduce(self, arr: np.ndarray, op: Any, loop: asyncio.AbstractEventLoop | None = None) -> Any:
        """A small all_reduce of numpy array `arr` on the shared-memory fast path, checks and all in one call.
        False: not for this path (nothing was taken). True: done. Otherwise an awaitable that ends it on
        `loop` (default: the running loop; given: called from another thread with nothing in flight). Across
        islands too where the group has a fast path (CPU islands of one rank each on one host: `_across`)."""
        fast = self._fast
        if fast is None:
            return False
        return fast.try_all_reduce(self, arr, op, loop)

    async def all_reduce(self, buf: Any, op: ReduceOp | str = ReduceOp.SUM) -> None:
        """In place: every rank ends with the reduction of all ranks' `buf`."""
        if type(buf) is np.ndarray:  # small host collectives: checks and all in one call
            done = self.fast_all_reduce(buf, op)
            if done is True:
                return
            if done is not False:
                return await done
        b, rop = _mem(buf, "buf"), parse_op(op)
        if self._islands > 1:
            return await self._across("all_reduce", b, rop)
        await self.flat_all_reduce(b, rop)

    async def all_gather(self, out: Any, inp: Any) -> None:
        """out (size * len(inp) elements) receives every rank's inp, rank-major."""
        o, i = self._all_gather_args(out, inp)
        if self._islands > 1:
            return await self._across("all_gather", o, i)
        await self.flat_all_gather(o, i)

    def _all_gather_args(self, out: Any, inp: Any) -> tuple[Mem, Mem]:
        o, i = _mem(out, "out"), _mem(inp, "inp", writable=False)
        self._gathered("all_gather", i, o)
        return o, i

    async def reduce_scatter(self, out: Any, inp: Any, op: ReduceOp | str = ReduceOp.SUM) -> None:
        """out (k elements) receives block `rank` of the reduction of every rank's inp (size * k)."""
        o, i, rop = self._reduce_scatter_args(out, inp, op)
        if self._islands > 1:
            return await self._across("reduce_scatter", o, i, rop)
        await self.flat_reduce_scatter(o, i, rop)

    def _reduce_scatter_args(self, out: Any, inp: Any, op: ReduceOp | str = ReduceOp.SUM) -> tuple[Mem, Mem, ReduceOp]:
        o, i, rop = _mem(out, "out"), _mem(inp, "inp", writable=False), parse_op(op)
        self._gathered("reduce_scatter", o, i)
        return o, i, rop

    async def broadcast(self, buf: Any, root: int = 0) -> None:
        """Every rank's buf becomes root's buf."""
        b, root = self._broadcast_args(buf, root)
        if self._islands > 1:
            return await self._across("broadcast", b, root)
        await self.flat_broadcast(b, root)

    def _broadcast_args(self, buf: Any, root: int = 0) -> tuple[Mem, int]:
        root = self._root(root)
        return _mem(buf, "buf", writable=(self.rank != root)), root

    def fast_call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  loop: asyncio.AbstractEventLoop) -> Any:
        """The blocking facade's shortcut for a small host broadcast, all_gather, reduce_scatter or barrier
        (arguments as the methods take them, checked as they check them) from a thread other than `loop`'s,
        with nothing of this communicator in flight: on the fast path, on that thread. False where it does not
        apply (nothing was taken), True once done, else a coroutine that ends it on `loop`."""
        parse = _FAST_CALLS.get(name)
        if parse is None or self._fast is None:
            return False
        parsed = parse(self, *args, **kwargs)
        if any(isinstance(a, DeviceBuf) for a in parsed):
            return False
        return self.fast_now(name, parsed, loop)

    async def reduce(self, buf: Any, root: int = 0, op: ReduceOp | str = ReduceOp.SUM) -> None:
        """root's buf becomes the reduction of every rank's buf; other ranks' buffers are left unchanged."""
        root = self._root(root)
        b, rop = _mem(buf, "buf", writable=(self.rank == root)), parse_op(op)
        if self._islands > 1:
            return await self._across("reduce", b, root, rop)
        await self.flat_reduce(b, root, rop)

    async def all_to_all(self, out: Any, inp: Any) -> None:
        """Block p of every rank's inp goes to rank p, landing in block `sender` of its out."""
        o, i = _mem(out, "out"), _mem(inp, "inp", writable=False)
        _same_dtype(o, i)
        if o.count != i.count or i.count % self.size:
            raise ConfigError(f"all_to_all: out and inp need the same length, a multiple of size={self.size} "
                              f"(got {o.count} and {i.count})")
        await self._flat_in_turn("all_to_all", lambda: self.flat_all_to_all(o, i))

    async def gather(self, out: Any, inp: Any, root: int = 0) -> None:
        """root's out (size * len(inp)) receives every rank's inp, rank-major; out may be None elsewhere."""
        root = self._root(root)
        i = _mem(inp, "inp", writable=False)
        o = None
        if self.rank == root:
            o = _mem(out, "out")
            self._gathered("gather", i, o)
        await self._flat_in_turn("gather", lambda: self.flat_gather(o, i, root))

    async def scatter(self, out: Any, inp: Any, root: int = 0) -> None:
        """Block p of root's inp (size * len(out)) lands in rank p's out; inp may be None off root."""
        root = self._root(root)
        o = _mem(out, "out")
        i = None
        if self.rank == root:
            i = _mem(inp, "inp", writable=False)
            self._gathered("scatter", o, i)
        await self._flat_in_turn("scatter", lambda: self.flat_scatter(o, i, root))

    async def barrier(self) -> None:
        """Returns once every rank has entered the barrier."""
        await self._flat_in_turn("barrier", self.flat_barrier)

    async def _flat_in_turn(self, name: str, step: Callable[[], Awaitable[None]]) -> None:
        """Across islands, a collective that runs flat takes its turn as the hierarchical ones do (ordering.py):
        else, issued behind a hierarchical collective that still waits (for its device copy, say), it could
        start first on one rank and second on another, and the two would meet the wrong peers."""
        if self._islands == 1 or self._fast is not None:  # _fast: every collective of this group runs flat
            return await step()
        async with self.issue_order.turn(name, asyncio.get_running_loop().time() + self.settings.timeout):
            await step()

    async def synchronize(self) -> None:
        """Wait until every device-memory collective this rank enqueued has completed on the GPU.

        Device collectives return once enqueued on the buffer's current stream (like torch.distributed's
        NCCL backend): later work on that stream sees the result without any wait. This is for a host that
        needs the result itself, or wants errors (a lost peer, a timeout) raised now. Host memory: no-op."""
        self._check_open()
        await self.drain_devices()

    def enqueue_now(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """A device collective (all_reduce, all_gather, reduce_scatter, broadcast, reduce; positional `args`
        and keyword `kwargs` as the methods take them) enqueued from the calling thread (the torch backend's
        caller, not hetccl's loop thread) when it can be: a single GPU island whose vendor communicator for the
        buffer's device exists. Returns the event recorded after the operation, or False where the caller must
        go through the loop instead (first use of a device, several islands, blocking mode). Raises the
        communicator's error (a lost peer, a watchdog timeout) like the loop path."""
        if self._vendor_now() is None or name not in VENDOR_OPS or not all(is_device(a) for a in args):
            return False

        self._check_open()
        bufs, root, op = self._device_call(name, args, kwargs)
        return self.enqueue_vendor_now(name, bufs, root, op)

    def _device_call(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[DeviceBuf], int, ReduceOp]:
        """The checked device buffers, root and reduce op of a call from another thread (enqueue_now,
        enqueue_ordered): positional `args` and keyword `kwargs` as the collective methods take them."""

        def arg(i: int, key: str, default: Any) -> Any:
            return kwargs[key] if key in kwargs else (args[i] if len(args) > i else default)

        root, op = -1, ReduceOp.SUM
        if name in ("all_reduce", "broadcast", "reduce"):
            bufs = [as_device_buf(args[0], "buf")]
            if name != "all_reduce":
                root = self._root(arg(1, "root", 0))
            if name != "broadcast":
                op = parse_op(arg(1 if name == "all_reduce" else 2, "op", "sum"))
        else:
            out, inp = as_device_buf(args[0], "out"), as_device_buf(args[1], "inp")
            bufs = [out, inp]
            if name == "all_gather":
                self._gathered(name, inp, out)
            else:
                self._gathered(name, out, inp)
                op = parse_op(arg(2, "op", "sum"))
        return bufs, root, op

    def enqueue_ordered(self, name: str, args: list[Any], kwargs: dict[str, Any], stream: Any,
                        early: Any = None) -> Any:
        """A device collective across islands (all_reduce, all_gather, reduce_scatter, broadcast; arguments as
        the methods take them) whose device side the calling thread enqueues on `stream` now (its copies out of
        the caller's data on `early`, where given: hierarchical.ordered_plan); returns its
        hierarchical.Ordered parts: the coroutine of its host side, to run on hetccl's loop (the stream waits for
        it: gpu/streamorder.py), and the device side to enqueue; or None where the loop must do it all (one
        island, host memory, layouts that hierarchical.ordered_plan leaves to the loop). Run
        `ordered_setup`'s coroutine first."""
        plan = self._ordered_plan(name, args, kwargs)
        return None if plan is None else plan(stream, early)

    def defer_ordered(self, name: str, args: list[Any], kwargs: dict[str, Any],
                      explain: Callable[[], str] | None = None) -> hierarchical.Deferred | None:
        """enqueue_ordered, with its arguments checked and the decision taken now, and its planning and device
        side left to another thread (hierarchical.Deferred): submit its host_side() to the loop at once, then
        call its plan(stream, early) from that thread. `explain()` says where that thread stands (for the
        error of a plan past the deadline)."""
        plan = self._ordered_plan(name, args, kwargs)
        return None if plan is None else hierarchical.Deferred(self, name, plan, explain)

    def _ordered_plan(self, name: str, args: list[Any], kwargs: dict[str, Any]
                      ) -> Callable[[Any, Any], hierarchical.Ordered] | None:
        if name not in _ORDERED_ARGS:
            return None
        tensors = args[:2] if name in ("all_gather", "reduce_scatter") else args[:1]
        if self._islands == 1 or self.island_layout is None or not all(is_device(a) for a in tensors):
            return None
        self._check_open()
        bufs, root, op = self._device_call(name, args, kwargs)
        for b in bufs:
            check_device_label(self._labels[self.rank], b, self.rank, self._members[self.rank])
        return hierarchical.ordered_plan(self, name, _ORDERED_ARGS[name](bufs, root, op))

    def ordered_setup(self, device: int) -> Any:
        """The coroutine to run on the loop, with no ordered collective in flight, before the first ordered
        collective of `device` memory (hierarchical.ordered_setup: the island's vendor communicator), or None."""
        return None if self._islands == 1 else hierarchical.ordered_setup(self, device)

    # ---- point to point ------------------------------------------------------------------------------
    async def send(self, buf: Any, peer: int, tag: int = 0) -> None:
        """Send buf to peer; matched in order with the peer's receives of the same tag from this rank (or from
        any source)."""
        self._check_open()
        peer = self._peer(peer)
        await self.p2p_send(as_buf(buf, "buf", writable=False), peer, tag)

    async def recv(self, buf: Any, peer: int | None = None, tag: int = 0) -> int:
        """Receive into buf (same dtype and count as the matching send) from `peer`, or with peer=None from any
        source: the first message of this tag to arrive from any rank (per sender, messages still match in
        order; a receive posted later never takes a message an earlier one could). Returns the sender's rank."""
        self._check_open()
        if peer is not None:
            peer = self._peer(peer)
        return await self.p2p_recv(as_buf(buf, "buf"), peer, tag)

    # ---- groups --------------------------------------------------------------------------------------
    async def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Collective: ranks with the same color form a new communicator, ordered by (key, rank).
        color None -> this rank joins none and gets None."""
        self._check_open()
        if color is not None and (not isinstance(color, int | np.integer) or color < 0):
            raise ConfigError(f"split color must be a non-negative int or None (got {color!r})")
        child = await self.split_group(color, key)
        if child is not None and child._islands > 1:  # collective among the child's members, right at its creation
            await hierarchical.build_layout(child)
        return child  # type: ignore[return-value]

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
            probe = Communicator(fab, derived_id(self.comm_id, f"shrink/{alive}"), alive)
            table = np.zeros(len(alive) * len(seen), np.uint8)
            task = asyncio.ensure_future(probe.flat_all_gather(as_buf(table), as_buf(seen)))
            known = len(fab.lost)
            while not task.done() and len(fab.lost) == known and loop.time() < deadline:
                await asyncio.wait([task], timeout=0.05)
            probe._closed = True
            probe.close_fast()  # its fast-path segment (a set-up cut short leaves it in /dev/shm otherwise)
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
        new = Communicator(fab, derived_id(self.comm_id, f"shrunk/{alive}"), alive)
        self._aborted = CommAbortedError(f"communicator {self.comm_id:#x} was shrunk; use the communicator "
                                         "that shrink() returned")
        return new

    async def close(self, timeout: float | None = None) -> None:
        """Close this communicator; closing the one from init() also closes the connections, after a closing
        barrier with the other ranks that waits at most `timeout` s (default: min(10 s, HETCCL_TIMEOUT))."""
        if self._closed:
            return
        with contextlib.suppress(HetcclError):  # device work still queued ends before the connections do
            await self.drain_devices()
        self._closed = True
        self.close_fast(children=self._fabric_owner)
        if self._parent is not None:  # a closed child is dropped: split+close in a loop must not grow
            with contextlib.suppress(ValueError):
                self._parent._children.remove(self)
        if self._fabric_owner:
            from . import lifecycle

            lifecycle.untrack_async(self)
            for c in self._children:
                c._closed = True
            await self._fabric.close(barrier_s=timeout)


# the facade's caller-thread collectives besides all_reduce (Communicator.fast_call): each method's own checks
_FAST_CALLS: dict[str, Callable[..., tuple[Any, ...]]] = {
    "all_gather": Communicator._all_gather_args, "reduce_scatter": Communicator._reduce_scatter_args,
    "broadcast": Communicator._broadcast_args, "barrier": lambda self: (),
}
