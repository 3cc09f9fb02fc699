"""A blocking facade over the async Communicator: an event loop (uvloop) runs in a daemon thread and each
call waits for its coroutine there. The PyTorch backend builds on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from . import lifecycle
from .errors import CollectiveTimeout

log = logging.getLogger("hetccl")

_SLACK_S = 30.0  # beyond the collective's own deadline, which raises first


async def _cancel_leftovers(grace: float) -> None:
    """Cancel the tasks still on the loop (a close that gave up leaves readers behind) and let them unwind,
    so the loop closes without pending tasks."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=grace)


class _LoopThread:
    def __init__(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hetccl-loop", daemon=True)
        self.thread.start()
        self._stopping = False

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.done():  # the call's own error (CollectiveTimeout is a TimeoutError), not our wait's
                raise
            fut.cancel()
            raise CollectiveTimeout(f"hetccl call did not return within {timeout:.0f} s") from None

    def request_stop(self) -> None:
        """Cancel what is left on the loop and ask it to stop (idempotent; stop() waits for the thread)."""
        if self._stopping:
            return
        self._stopping = True
        if not self.thread.is_alive() or self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop may have closed meanwhile
            cf = asyncio.run_coroutine_threadsafe(_cancel_leftovers(0.5), self.loop)
            cf.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self.loop.stop))

    def stop(self, join_s: float = 5.0) -> bool:
        """Stop the loop and join its thread (at most join_s s); True once the thread has ended."""
        self.request_stop()
        if self.thread is not threading.current_thread():
            self.thread.join(join_s)
        if self.thread.is_alive():
            log.warning("hetccl: the event-loop thread did not stop within %.1f s", join_s)
            return False
        if not self.loop.is_closed():
            self.loop.close()
        return True


class SyncCommunicator:
    """Same methods as Communicator, as blocking calls."""

    _METHODS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
                "scatter", "send", "recv", "barrier", "synchronize")

    def __init__(self, comm: Any, runner: _LoopThread, owner: bool):
        self._comm, self._runner, self._owner = comm, runner, owner
        self.rank, self.size = comm.rank, comm.size
        self._limit = comm._settings.timeout + _SLACK_S
        self._closed = False
        # calls and submissions of this communicator not yet done: while there are none, a small all_reduce may
        # run on the caller's thread (all_reduce), since nothing on the loop numbers this group's collectives
        self._pending = 0
        self._pending_lock = threading.Lock()
        if owner:  # closed at interpreter exit if the program does not (hetccl.lifecycle)
            lifecycle.track_sync(self)

    @classmethod
    def create(cls, init: Callable[..., Coroutine[Any, Any, Any]], **kwargs: Any) -> SyncCommunicator:
        runner = _LoopThread()
        timeout = kwargs.get("timeout") or 300.0
        try:
            comm = runner.call(init(**kwargs), timeout * 2 + _SLACK_S)
        except BaseException:
            runner.stop()
            raise
        return cls(comm, runner, True)

    @property
    def async_comm(self) -> Any:
        """The underlying async Communicator (its coroutines must run on `loop`)."""
        return self._comm

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._runner.loop

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Schedule a coroutine on the background loop; returns a concurrent.futures.Future."""
        self._count(1)
        try:
            cf = asyncio.run_coroutine_threadsafe(coro, self._runner.loop)
        except BaseException:
            self._count(-1)
            raise
        cf.add_done_callback(lambda _: self._count(-1))
        return cf

    def _count(self, d: int) -> None:
        with self._pending_lock:
            self._pending += d

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        self._count(1)
        try:
            return self._runner.call(coro, self._limit)
        finally:
            self._count(-1)

    def idle(self) -> bool:
        """Nothing of this communicator is in flight on the loop (submitted, called or started): a collective
        may then run on the caller's thread (all_reduce; the torch backend's all_reduce of a CPU tensor)."""
        return not self._pending and not self._comm.flight.inflight

    def all_reduce(self, buf: Any, op: Any = "sum") -> None:
        """Communicator.all_reduce, blocking. A small numpy array of a group on the shared-memory fast path,
        with nothing of this communicator in flight, is reduced on this thread (one C call): no hop to the loop
        thread and back, which costs more than the operation. Issue order, mismatches and deadlines are the fast
        path's own, as on the loop; if the peers are not all there within its spin, the loop finishes it."""
        comm = self._comm
        if type(buf) is np.ndarray and self.idle():
            done = comm.fast_all_reduce(buf, op, self._runner.loop)
            if done is True:
                return None
            if done is not False:
                return self._call(done)
        return self._call(comm.all_reduce(buf, op))

    def __getattr__(self, name: str) -> Any:
        if name not in self._METHODS:
            raise AttributeError(name)
        method = getattr(self._comm, name)
        comm, loop = self._comm, self._runner.loop

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.idle():  # a small host collective: on this thread (Communicator.fast_call), as all_reduce
                done = comm.fast_call(name, args, kwargs, loop)
                if done is True:
                    return None
                if done is not False:
                    return self._call(done)
            return self._call(method(*args, **kwargs))

        call.__name__ = name
        call.__doc__ = method.__doc__
        return call

    def split(self, color: int | None, key: int = 0) -> SyncCommunicator | None:
        sub = self._runner.call(self._comm.split(color, key), self._limit)
        return None if sub is None else SyncCommunicator(sub, self._runner, False)

    def shrink(self, timeout: float | None = None) -> SyncCommunicator:
        new = self._runner.call(self._comm.shrink(timeout), self._limit)
        return SyncCommunicator(new, self._runner, False)

    def abort(self) -> None:
        self._runner.loop.call_soon_threadsafe(self._comm.abort)

    def close(self, timeout: float | None = None) -> None:
        """Close (idempotent). `timeout` bounds the wait for peers in the closing barrier (default: min(10 s,
        HETCCL_TIMEOUT)); closing the communicator from init_sync() also stops the background loop."""
        if self._closed:
            return
        self._closed = True
        lifecycle.untrack_sync(self)
        try:
            self._runner.call(self._comm.close(timeout=timeout), 60.0 if timeout is None
                              else timeout + lifecycle.CLOSE_SLACK_S + 1.0)
        finally:
            if self._owner:
                self._runner.stop()

    def _begin_close(self, wait: float) -> concurrent.futures.Future[Any] | None:
        """Start a bounded, error-swallowing close on the loop without waiting (interpreter exit closes every
        open communicator at once); the caller stops the loop afterwards."""
        if self._closed:
            return None
        self._closed = True
        lifecycle.untrack_sync(self)
        if not self._runner.thread.is_alive():
            return None
        try:
            return asyncio.run_coroutine_threadsafe(lifecycle.bounded_close(self._comm, wait), self._runner.loop)
        except RuntimeError:  # the loop is already closed
            return None
