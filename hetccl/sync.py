"""A blocking facade over the async Communicator: an event loop (uvloop) runs in a daemon thread and each
call waits for its coroutine there. The PyTorch backend builds on it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from .errors import CollectiveTimeout

_SLACK_S = 30.0  # beyond the collective's own deadline, which raises first


class _LoopThread:
    def __init__(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hetccl-loop", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise CollectiveTimeout(f"hetccl call did not return within {timeout:.0f} s") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


class SyncCommunicator:
    """Same methods as Communicator, as blocking calls."""

    _METHODS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
                "scatter", "send", "recv", "barrier", "synchronize")

    def __init__(self, comm: Any, runner: _LoopThread, owner: bool):
        self._comm, self._runner, self._owner = comm, runner, owner
        self.rank, self.size = comm.rank, comm.size
        self._limit = comm._settings.timeout + _SLACK_S

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
        return asyncio.run_coroutine_threadsafe(coro, self._runner.loop)

    def __getattr__(self, name: str) -> Any:
        if name not in self._METHODS:
            raise AttributeError(name)
        method = getattr(self._comm, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._runner.call(method(*args, **kwargs), self._limit)

        call.__name__ = name
        call.__doc__ = method.__doc__
        return call

    def split(self, color: int | None, key: int = 0) -> SyncCommunicator | None:
        sub = self._runner.call(self._comm.split(color, key), self._limit)
        return None if sub is None else SyncCommunicator(sub, self._runner, False)

    def close(self) -> None:
        try:
            self._runner.call(self._comm.close(), 60.0)
        finally:
            if self._owner:
                self._runner.stop()
