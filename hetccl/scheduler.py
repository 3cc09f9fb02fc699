"""What every host collective runs on: `CollCtx` (tagged send/receive on communicator ranks, the reducer),
`run_collective` (sequence numbers in flight, the deadline watchdog, mismatch and loss handling, clean-up), and
the helpers the algorithms split their data with (blocks, chunks, tags, fail-fast gathers).

The algorithms (`algorithms/`) decide what moves and how it is cut: the ring, for one, runs every chunk's chain
of steps as its own task, so that the send of chunk k overlaps the reduction of chunk k-1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import native, params
from . import observe as _obs
from .dtypes import Buf, DType, ReduceOp, block_ranges
from .errors import CollectiveMismatchError, CollectiveTimeout, CommAbortedError, HetcclError
from .flight import DONE, FAILED, FlightRecorder
from .wire import Fingerprint

if TYPE_CHECKING:
    from .bootstrap import Fabric
    from .config import Settings
    from .transports.base import Endpoint


class GroupView(Protocol):
    """What the scheduler (and the hang report) need of a group of ranks; group.Group provides it."""

    comm_id: int
    rank: int  # this rank, in group ranks
    size: int
    chunk_bytes: int  # the ring pipeline chunk: the smallest, and the largest it grows to (Fabric.ring_chunk)
    chunk_max_bytes: int

    @property
    def fabric(self) -> Fabric: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def members(self) -> list[int]: ...  # group rank -> job rank

    @property
    def peers(self) -> dict[int, Endpoint]: ...  # group rank -> endpoint (every rank but this one)

    @property
    def watchdog(self) -> Watchdog: ...

    @property
    def flight(self) -> FlightRecorder: ...

    @property
    def aborted(self) -> HetcclError | None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def next_seq(self) -> int: ...  # the sequence number of the next collective

    def group_rank(self, job_rank: int) -> int: ...


def chunk_ranges(start: int, stop: int, nchunks: int) -> list[tuple[int, int]]:
    """Split [start, stop) into nchunks pieces (some may be empty)."""
    return [(start + a, start + b) for a, b in block_ranges(stop - start, nchunks)]


def num_chunks(max_elems: int, itemsize: int, chunk_bytes: int) -> int:
    return max(1, -(-max_elems * itemsize // chunk_bytes))


# A ring's chunk grows from chunk_bytes towards chunk_max_bytes only while a block keeps this many chunks: a
# ring step overlaps sending one chunk with receiving and reducing another, and on 2 cores a 4 MiB all_reduce in
# one chunk per block took 3.3 ms against 2.7 with two (benchmarks/results/tcp-chunk-2026-12-01.md)
PIPELINE_CHUNKS = 4


_REDUCERS: dict[tuple[DType, ReduceOp, bool], Callable[[np.ndarray, Any], None]] = {}


def _reducer(dtype: DType, op: ReduceOp, incoming_first: bool = False) -> Callable[[np.ndarray, Any], None]:
    fn = _REDUCERS.get((dtype, op, incoming_first))
    if fn is None:
        isz = dtype.itemsize
        if incoming_first:
            def fn(dst: np.ndarray, src: Any) -> None:
                native.reduce3(dst, src, dst, dtype, op, len(dst) // isz)
        else:
            def fn(dst: np.ndarray, src: Any) -> None:
                native.reduce_into(dst, src, dtype, op, len(dst) // isz)

        _REDUCERS[dtype, op, incoming_first] = fn
    return fn


def _reducer_from(first: np.ndarray, dst: np.ndarray, dtype: DType, op: ReduceOp
                  ) -> Callable[[np.ndarray, Any], None]:
    """part = first's matching bytes OP incoming, for any part of dst a transport lands (a frame's slice or all
    of it: its offset is its address's distance from dst's)."""
    isz, base = dtype.itemsize, dst.__array_interface__["data"][0]

    def fn(part: np.ndarray, src: Any) -> None:
        off = part.__array_interface__["data"][0] - base
        native.reduce3(part, first[off: off + len(part)], src, dtype, op, len(part) // isz)

    return fn


def make_tag(phase: int, step: int, chunk: int) -> int:
    return (phase << 48) | (step << 24) | chunk


class CollCtx:
    """What an algorithm sees: ranks of its communicator, a fingerprint, tagged send/recv, the reducer."""

    __slots__ = ("comm", "fp", "rank", "size", "eps", "dtype", "op", "reducer", "chunk_bytes", "chunk_max_bytes")

    def __init__(self, comm: GroupView, fp: Fingerprint, dtype: DType, op: ReduceOp | None):
        self.comm, self.fp = comm, fp
        self.rank, self.size = comm.rank, comm.size
        self.eps = comm.peers
        self.dtype, self.op = dtype, op
        self.chunk_bytes, self.chunk_max_bytes = comm.chunk_bytes, comm.chunk_max_bytes
        self.reducer = _reducer(dtype, op) if op is not None else None

    def num_chunks(self, elems: int) -> int:
        """How many pipeline chunks a ring cuts `elems` elements (one block) into; the same on every rank."""
        nbytes = elems * self.dtype.itemsize
        chunk = min(self.chunk_max_bytes, max(self.chunk_bytes, nbytes // PIPELINE_CHUNKS))
        return num_chunks(elems, self.dtype.itemsize, chunk)

    def send(self, peer: int, tag: int, data: np.ndarray) -> Coroutine[Any, Any, None]:
        if _obs.ON:
            return _obs.send(self, peer, tag, data)
        return self.eps[peer].send(self.fp, tag, data)

    def recv(self, peer: int, tag: int, dst: np.ndarray, reduce: bool = False, incoming_first: bool = False,
             first: np.ndarray | None = None) -> asyncio.Future:
        """Receive into dst; with reduce, dst = dst OP incoming (or incoming OP dst with incoming_first: the
        operand order matters only for bitwise agreement on ties, e.g. min(-0.0, +0.0)). With `first` (as long
        as dst), dst = first OP incoming: dst's old content is never read, so nothing is copied in beforehand."""
        fn = None
        if first is not None:
            fn = _reducer_from(first, dst, self.dtype, self.op)  # type: ignore[arg-type]
        elif reduce:
            fn = _reducer(self.dtype, self.op, incoming_first) if incoming_first else self.reducer  # type: ignore[arg-type]
        if _obs.ON:
            return _obs.recv(self, peer, tag, dst, fn)  # type: ignore[return-value]
        return self.eps[peer].post_recv(self.fp, tag, dst, fn)

    def finish_avg(self, buf: Buf | np.ndarray, divisor: int | None = None) -> None:
        if self.op == ReduceOp.AVG:
            data = buf.data if isinstance(buf, Buf) else buf
            native.divide(data, self.dtype, divisor or self.size)


async def await_all(aws: list[Awaitable[Any]]) -> None:
    """Await sends and already-posted receives one after the other, without a task each (tasks cost
    microseconds, which is most of a small collective). Safe because every receive is posted before the first
    send starts: a send that waits for room only waits for the peer's transport to drain into those receives."""
    for i, aw in enumerate(aws):
        try:
            await aw
        except BaseException:
            for rest in aws[i + 1:]:
                if asyncio.iscoroutine(rest):
                    rest.close()
            raise


async def gather_fail_fast(aws: list[Awaitable[Any]]) -> None:
    """Await all; on the first failure cancel the rest and raise it."""
    if not aws:
        return
    if len(aws) == 1:
        await aws[0]
        return
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # mark retrieved


ABORTED = "aborted"  # Watchdog record flag: the collective was ended by comm.abort(), not by its deadline


class Watchdog:
    """Deadlines for in-flight collectives without a timer per call: one periodic check cancels the task
    of any collective past its deadline (asyncio.timeout costs several microseconds per call)."""

    def __init__(self) -> None:
        self.inflight: dict[int, list[Any]] = {}  # id -> [deadline, task, fired]
        self._handle: asyncio.TimerHandle | None = None
        self._next = 0

    def enter(self, timeout: float) -> tuple[int, list[Any]]:
        loop = asyncio.get_running_loop()
        rec = [loop.time() + timeout, asyncio.current_task(), False]
        key = self._next
        self._next += 1
        self.inflight[key] = rec
        if self._handle is None:
            self._handle = loop.call_later(min(0.25, timeout / 8), self._tick, loop, min(0.25, timeout / 8))
        return key, rec

    def exit(self, key: int) -> None:
        self.inflight.pop(key, None)

    def abort_all(self) -> None:
        """End every collective in flight now (comm.abort())."""
        for rec in self.inflight.values():
            if not rec[2] and rec[1] is not None:
                rec[2] = ABORTED
                rec[1].cancel()

    def _tick(self, loop: asyncio.AbstractEventLoop, period: float) -> None:
        now = loop.time()
        for rec in self.inflight.values():
            if not rec[2] and now >= rec[0] and rec[1] is not None:
                rec[2] = True
                rec[1].cancel()
        self._handle = loop.call_later(period, self._tick, loop, period) if self.inflight else None


async def run_collective(comm: GroupView, fp: Fingerprint, body: Callable[[], Coroutine[Any, Any, Any]],
                         peers: Sequence[int] | None = None) -> Any:
    """Run one collective under the communicator's deadline; on failure, withdraw its receives from `peers`
    (communicator ranks; default every peer). Point-to-point numbers its messages per peer, so a failed receive
    from one peer must not withdraw the same sequence number from the others."""
    timeout = comm.settings.timeout
    if comm.aborted is not None:
        raise comm.aborted
    poisoned = comm.fabric.poisoned.get(fp.comm)
    if poisoned is not None:
        await comm.fabric.flush_notices()  # a notice of ours may still be queued: on the wire before we raise
        raise CollectiveMismatchError(f"{poisoned} (this communicator is unusable after it; create a new one)")
    if comm.fabric.departed:
        comm.fabric.check_departed(comm, fp)  # a member closed before this collective: it never comes
    key, rec = comm.watchdog.enter(timeout)
    if _obs.ON:
        body = _obs.collective(comm, fp, body, rec)
    flight = comm.flight.begin(fp)
    state = FAILED
    try:
        result = await body()
        if fp.comm == comm.comm_id:  # collectives; point-to-point messages have their own sequence space
            _check_leftovers(comm, fp)
        state = DONE
        return result
    except asyncio.CancelledError:
        if not rec[2]:
            _withdraw(comm, fp, peers, HetcclError("cancelled"))
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        if rec[2] == ABORTED:
            exc = comm.aborted or CommAbortedError(f"rank {comm.rank}: {fp.describe()} ended by comm.abort()")
            _withdraw(comm, fp, peers, exc)
            raise exc from None
        matchers = comm.fabric.matchers
        waiting = sorted({comm.group_rank(ep.peer)
                          for ep in comm.peers.values()
                          for k in matchers[ep.peer].posted if k[0] == fp.comm and k[1] == fp.seq})
        summary = ""
        if fp.comm == comm.comm_id and params.get("HETCCL_HANG_REPORT"):
            from . import hangreport

            try:  # what every rank was doing: logged, and written under HETCCL_DUMP_DIR
                rep = await hangreport.gather(comm, fp, timeout)
                summary = "; " + hangreport.summary(rep)
            except Exception as err:  # noqa: BLE001 (the report is best effort; the timeout is what counts)
                summary = f"; no hang report ({err!r})"
        exc = CollectiveTimeout(
            f"rank {comm.rank}: {fp.describe()} did not complete within {timeout:g} s (the timeout of this "
            "communicator: HETCCL_TIMEOUT, or the torch process group's)"
            + (f"; still waiting for data from rank(s) {waiting}" if waiting else "")
            + "; a peer is stuck, dead, or issued a different collective" + summary)
        _withdraw(comm, fp, peers, exc)
        raise exc from None
    except CollectiveMismatchError as exc:
        _withdraw(comm, fp, peers, exc)
        if comm.fabric.poisoned.get(fp.comm) is not exc:  # found here, not reported by another rank
            comm.fabric.report_mismatch(fp, exc, [g for g in comm.members if g != comm.fabric.rank])
        # the program may exit the moment it sees this error (uncaught): the other ranks must still learn of
        # the mismatch, not just of a lost peer, so the notices go on the wire first (bounded)
        await comm.fabric.flush_notices()
        raise
    except BaseException as exc:
        _withdraw(comm, fp, peers, exc if isinstance(exc, Exception) else HetcclError("interrupted"))
        raise
    finally:
        comm.watchdog.exit(key)
        comm.flight.end(flight, state)


def _check_leftovers(comm: GroupView, fp: Fingerprint) -> None:
    """Data kept for this collective that it never took: the sender ran a different collective here."""
    matchers = comm.fabric.matchers
    for peer, ep in comm.peers.items():
        early = matchers[ep.peer].early
        if early:
            for (c, s, _tag), (got, _data) in early.items():
                if c == fp.comm and s == fp.seq:
                    raise comm.fabric.mismatch_found(comm, fp, got, comm.members[peer])


def _withdraw(comm: GroupView, fp: Fingerprint, peers: Sequence[int] | None, exc: BaseException) -> None:
    for p, ep in comm.peers.items():
        if peers is None or p in peers:
            ep.cancel(fp.comm, fp.seq, exc)
