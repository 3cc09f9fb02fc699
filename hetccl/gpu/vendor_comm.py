"""A vendor-CCL communicator (NCCL or RCCL) over the GPU ranks of one island.

Created lazily, collectively, by the island's ranks on their first device collective: the root's unique id
travels through the rendezvous store (msgpack), the communicator is initialised non-blocking and polled
from the event loop with a deadline. Every operation is enqueued on the caller's stream, then an event is
polled while ncclCommGetAsyncError is checked, so a dead peer or a timeout aborts the communicator and
raises instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..errors import CollectiveTimeout, PeerLostError, TransportError
from .runtime import torch_mod, wait_event

IN_PROGRESS = 7


class VendorComm:
    def __init__(self, lib: Any, comm: Any, rank: int, size: int, device: int):
        self.lib, self.comm, self.rank, self.size, self.device = lib, comm, rank, size, device
        self.broken: BaseException | None = None

    @classmethod
    async def create(cls, vendor: str, store: Any, key: str, rank: int, size: int, device: int,
                     timeout: float) -> VendorComm:
        from ..vendor.ccl import load_nccl, load_rccl

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
        return cls(lib, comm, rank, size, device)

    def poll(self) -> None:
        state = self.lib.comm_get_async_error(self.comm)
        if state not in (0, IN_PROGRESS):
            self.abort()
            raise PeerLostError(self.lib.describe(state, "asynchronous operation", self.comm))

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

    async def run(self, enqueue: Callable[[int], Any], stream: Any, deadline: float, what: str) -> None:
        """Enqueue one operation (enqueue(stream_handle)) and await its completion on the device."""
        if self.broken is not None:
            raise self.broken
        torch = torch_mod()
        if enqueue(stream.cuda_stream) == IN_PROGRESS:
            await self._settle(deadline, what)
        ev = torch.cuda.Event()
        ev.record(stream)
        try:
            await wait_event(ev, deadline, what, self.poll)
        except CollectiveTimeout as exc:
            self.abort()
            self.broken = exc
            raise

    def abort(self) -> None:
        if self.comm is not None:
            try:
                self.lib.comm_abort(self.comm)
            except TransportError:
                pass
            self.comm = None
            self.broken = self.broken or PeerLostError("the vendor communicator was aborted after an error")

    def destroy(self) -> None:
        if self.comm is not None:
            try:
                self.lib.comm_destroy(self.comm)
            except TransportError:
                pass
            self.comm = None
