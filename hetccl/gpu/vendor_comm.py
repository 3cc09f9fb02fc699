"""A vendor-CCL communicator (NCCL or RCCL) over the GPU ranks of one island.

Created lazily, collectively, by the island's ranks on their first device collective: the root's unique id
travels through the rendezvous store (msgpack), the communicator is initialised in a worker thread with a
deadline.

Completion semantics are those of torch.distributed's NCCL backend: an operation is enqueued on the
caller's stream and the call returns; work queued later on that stream sees the result. A watchdog thread
per communicator follows every enqueued operation (its CUDA event, its deadline) and polls
ncclCommGetAsyncError, so a dead peer or a timeout aborts the communicator — which also releases a host
thread blocked on the stream — and the next call raises the error. `HETCCL_GPU_BLOCKING=1` (like
TORCH_NCCL_BLOCKING_WAIT) makes every call wait for completion on the device instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .. import params
from ..errors import CollectiveTimeout, PeerLostError, TransportError
from .runtime import record_event, torch_mod, wait_event

IN_PROGRESS = 7
# the watchdog's polling period while operations are in flight: long, because every CUDA/NCCL call it makes
# hands the GIL back and forth with the launching thread (polling each event every 0.2 ms doubled the cost of
# a small all_reduce on the device), and short next to any deadline
WATCH_PERIOD_S = params.get("HETCCL_WATCHDOG_PERIOD_MS") / 1000
MAX_IN_FLIGHT = 256  # enqueued, unfinished operations per communicator before a call waits
log = logging.getLogger("hetccl")


def blocking() -> bool:
    return params.get("HETCCL_GPU_BLOCKING")


class VendorComm:
    def __init__(self, lib: Any, comm: Any, rank: int, size: int, device: int,
                 lost: dict[int, BaseException] | None = None, members: list[int] | None = None):
        self.lib, self.comm, self.rank, self.size, self.device = lib, comm, rank, size, device
        self.broken: BaseException | None = None
        # the fabric's lost peers and the island's job ranks: a dead island member aborts the communicator
        self.lost: dict[int, BaseException] = lost if lost is not None else {}
        self.members = members or []
        self._cv = threading.Condition()
        self._pending: deque[tuple[Any, float, str, int]] = deque()  # (event, monotonic deadline, what, stream)
        self._per_stream: dict[int, int] = {}  # stream handle -> operations of _pending on it
        self._watchdog: threading.Thread | None = None
        self._stop = False

    @classmethod
    async def create(cls, vendor: str, store: Any, key: str, rank: int, size: int, device: int,
                     timeout: float, lost: dict[int, BaseException] | None = None,
                     members: list[int] | None = None) -> VendorComm:
        from ..bindings.ccl import load_nccl, load_rccl

        lib = load_nccl() if vendor == "nvidia" else load_rccl()
        torch = torch_mod()
        torch.cuda.set_device(device)  # the vendor CCL binds to the calling thread's current device
        if rank == 0:
            uid = lib.get_unique_id()
            await store.set(key, uid)
        else:
            uid = await store.get(key, timeout=timeout)
        def init() -> Any:
            torch.cuda.set_device(device)
            return lib.comm_init_rank(size, uid, rank)

        # a blocking communicator (its collectives enqueue synchronously, the fastest launch path), initialised
        # in a worker thread so that the event loop keeps running and the wait has a deadline
        try:
            comm = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, init), timeout)
        except TimeoutError:
            raise CollectiveTimeout(f"{lib.name} communicator init (rank {rank} of {size}) did not finish in "
                                    f"{timeout:.0f} s; a peer of the island is missing or stuck") from None
        return cls(lib, comm, rank, size, device, lost, members)

    def _dead_member(self) -> PeerLostError | None:
        for r in self.members:
            if r in self.lost:
                return PeerLostError(f"{self.lib.name} island member rank {r} was lost ({self.lost[r]})", r)
        return None

    def poll(self) -> None:
        comm = self.comm
        state = self.lib.comm_get_async_error(comm) if comm is not None else 0
        err = self._dead_member()
        if state not in (0, IN_PROGRESS):
            err = PeerLostError(self.lib.describe(state, "asynchronous operation", comm))
        if err is not None:
            self.broken = self.broken or err
            self.abort()
            raise err

    async def _settle(self, deadline: float, what: str) -> None:
        """Non-blocking communicators: wait until the last call is no longer in progress."""
        loop = asyncio.get_running_loop()
        spins = 0
        while True:
            state = self.lib.comm_get_async_error(self.comm)
            if state == 0:
                return
            if state != IN_PROGRESS:
                self.abort()
                raise TransportError(self.lib.describe(state, what, self.comm))
            if loop.time() > deadline:
                self.abort()
                raise CollectiveTimeout(f"{what} did not finish before the deadline; a peer is missing or stuck")
            spins += 1
            await asyncio.sleep(0 if spins < 20_000 else 0.0005)

    async def run(self, enqueue: Callable[[int], Any], stream: Any, deadline: float, what: str,
                  wait: bool = False) -> None:
        """Enqueue one operation (enqueue(stream_handle)) on `stream` (a torch stream or a raw handle).
        Returns once enqueued (the watchdog follows it), or once complete on the device with wait=True or
        HETCCL_GPU_BLOCKING=1."""
        if self.broken is not None:
            raise self.broken
        if len(self._pending) >= MAX_IN_FLIGHT and self._prune() is not None:  # never block in a full queue
            await self._wait_pending(MAX_IN_FLIGHT // 2, deadline, what)
        if self.comm is None:
            raise self.broken or PeerLostError("the vendor communicator was aborted after an error")
        handle = stream if isinstance(stream, int) else stream.cuda_stream
        rc = enqueue(handle)
        if rc == IN_PROGRESS:
            await self._settle(deadline, what)
        ev = record_event(stream, self.device)
        if not (wait or blocking()):
            self._track(ev, deadline, what, handle)
            return
        try:
            await wait_event(ev, deadline, what, self.poll)
        except CollectiveTimeout as exc:
            self.abort()
            self.broken = exc
            raise

    def run_now(self, enqueue: Callable[[int], Any], stream: int, deadline: float, what: str) -> Any:
        """`run` from any thread, without the event loop: enqueue on `stream` (a raw handle) and return the event
        recorded after it (its completion), the watchdog following the operation. With MAX_IN_FLIGHT operations
        unfinished, it first waits (bounded) for half of them."""
        if self.broken is not None:
            raise self.broken
        if self.lost:  # a member already known lost: never enqueue what cannot finish
            self.poll()
        if len(self._pending) >= MAX_IN_FLIGHT:  # the device is behind: hold the caller, as NCCL's own queue does
            while self._prune() is not None and len(self._pending) > MAX_IN_FLIGHT // 2:
                if self.broken is not None:
                    raise self.broken
                if time.monotonic() > deadline + 1.0:  # the watchdog acts at the deadline; this is the backstop
                    raise CollectiveTimeout(f"{what}: earlier operations did not complete before the deadline")
                time.sleep(20e-6)
        if self.comm is None:
            raise self.broken or PeerLostError("the vendor communicator was aborted after an error")
        rc = enqueue(stream)
        if rc == IN_PROGRESS:  # a non-blocking communicator: settle here, bounded like the loop's wait
            while (state := self.lib.comm_get_async_error(self.comm)) == IN_PROGRESS:
                if time.monotonic() > deadline:
                    self.abort()
                    raise CollectiveTimeout(f"{what} did not finish before the deadline; a peer is missing or stuck")
            if state != 0:
                self.abort()
                raise TransportError(self.lib.describe(state, what, self.comm))
        ev = record_event(stream, self.device)
        self._track(ev, deadline, what, stream)
        return ev

    # ---- watchdog ------------------------------------------------------------------------------------
    def _track(self, ev: Any, deadline: float, what: str, stream: int) -> None:
        # asyncio's loop.time() is time.monotonic(): the watchdog compares deadlines with the same clock
        with self._cv:
            self._pending.append((ev, deadline, what, stream))
            self._per_stream[stream] = self._per_stream.get(stream, 0) + 1
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name=f"hetccl-{self.lib.name}-watchdog",
                                                  daemon=True)
                self._watchdog.start()
            if len(self._pending) == 1:
                self._cv.notify()

    def _prune(self) -> tuple[Any, float, str, int] | None:
        """Forget completed operations; the oldest unfinished one, or None. When every tracked operation
        is on one stream (the common case), the newest event answers for all of them: one query."""
        with self._cv:
            while self._pending:
                last = self._pending[-1]
                if self._per_stream.get(last[3]) == len(self._pending) and last[0].query():
                    self._pending.clear()
                    self._per_stream.clear()
                    return None
                head = self._pending[0]
                if not head[0].query():
                    return head
                self._pending.popleft()
                left = self._per_stream[head[3]] - 1
                if left:
                    self._per_stream[head[3]] = left
                else:
                    del self._per_stream[head[3]]
            return None

    def _watch(self) -> None:
        torch = torch_mod()
        torch.cuda.set_device(self.device)
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if not self._pending:
                    return
            head = self._prune()
            if head is None:
                continue
            comm = self.comm
            state = self.lib.comm_get_async_error(comm) if comm is not None else 0
            err: BaseException | None = self._dead_member()
            if state not in (0, IN_PROGRESS):
                err = PeerLostError(self.lib.describe(state, head[2], comm))
            elif time.monotonic() > head[1]:
                err = CollectiveTimeout(f"{head[2]} did not complete on the device before the deadline "
                                        "(HETCCL_TIMEOUT); a peer of the island is missing or stuck")
            if err is not None:
                log.error("hetccl: %s communicator aborted: %s", self.lib.name, err)
                self.broken = self.broken or err
                self.abort()  # NCCL's kernels exit, so a thread blocked on the stream is released too
                with self._cv:
                    self._pending.clear()
                    self._per_stream.clear()
                continue
            time.sleep(WATCH_PERIOD_S)

    async def _wait_pending(self, most: int, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        spins = 0
        while len(self._pending) > most and self.broken is None:
            if self._prune() is None:
                break
            if loop.time() > deadline + 1.0:  # the watchdog acts at the deadline; this is the backstop
                raise CollectiveTimeout(f"{what}: earlier operations did not complete before the deadline")
            spins += 1
            await asyncio.sleep(0 if spins < 2000 else 0.0005)
        if self.broken is not None:
            raise self.broken

    async def drain(self, deadline: float) -> None:
        """Wait until every enqueued operation has completed; raises the watchdog's error if one failed."""
        await self._wait_pending(0, deadline, "synchronize")

    def stop_watchdog(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def abort(self) -> None:
        comm, self.comm = self.comm, None  # a call racing with the watchdog sees None and raises `broken`
        if comm is not None:
            try:
                self.lib.comm_abort(comm)
            except TransportError:
                pass
            self.broken = self.broken or PeerLostError("the vendor communicator was aborted after an error")

    def destroy(self) -> None:
        if self.comm is not None:
            try:
                self.lib.comm_destroy(self.comm)
            except TransportError:
                pass
            self.comm = None
