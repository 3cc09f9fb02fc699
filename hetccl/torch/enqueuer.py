"""The torch backend's enqueuing thread: the planning and device side of collectives ordered on the caller's
stream across islands, off the caller's thread.

A cross-island collective enqueues tens to hundreds of operations on its stream (copies, words, reduction
kernels): on an H100 shared by two ranks that held the caller's thread 0.6-2 ms per collective (2026-12-07),
while ProcessGroupNCCL's caller is back in 0.1 ms. So the caller's thread only checks the call, records where
its stream stands and submits the host side; this thread, one per process group, does the rest in call order
(the collective stream's order). It makes CUDA calls, as the caller's thread would, and never waits for
hetccl's loop thread (which makes none: gpu/streamorder.py).

Experimental, off by default (HETCCL_TORCH_ENQUEUE_THREAD): on one H100 (2026-12-07) it stalled in
tests/torch_workers.py's `async` case, cause not yet found (benchmarks/results/gpu-2026-12-07d.md).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from hetccl.errors import HetcclError
from hetccl.hangreport import chain, thread_frames

_IDLE_WAKE_S = 1.0  # an idle thread's wait, renewed (a wait without a deadline is none of hetccl's)


class Enqueuer:
    """Runs jobs one at a time in the order put, on its own thread (started at the first job). A job handles
    its own errors: one that escapes is kept and raised by the next put()."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._started = 0.0  # when the running job began (time.monotonic)
        self._closed = False
        self._escaped: BaseException | None = None

    def put(self, job: Callable[[], None]) -> None:
        with self._cv:
            if self._escaped is not None:
                raise HetcclError(f"{self._name}: an earlier collective's enqueuing failed") from self._escaped
            if self._closed:
                raise HetcclError(f"{self._name}: closed (the process group was shut down)")
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def idle(self, timeout: float) -> bool:
        """Wait until every job put so far has run (False past `timeout` s)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def where(self) -> str:
        """What the thread is doing, for an error that waited for it: idle, or how long its job has run and
        where its thread stands (innermost frames first)."""
        with self._cv:
            busy, started, queued, thread = self._busy, self._started, len(self._jobs), self._thread
        if not busy:
            return f"the enqueuing thread is idle ({queued} jobs queued)"
        at = chain(thread_frames(thread.ident if thread is not None else None))
        return (f"the enqueuing thread has run its job for {time.monotonic() - started:.1f} s ({queued} more "
                f"queued), at {at or '?'}")

    def close(self, timeout: float) -> None:
        """Run what is queued, then stop the thread (waiting at most `timeout` s for it)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                while not self._jobs and not self._closed:
                    self._cv.wait(_IDLE_WAKE_S)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy, self._started = True, time.monotonic()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 (a job's own handler failed: the caller hears of it)
                with self._cv:
                    self._escaped = exc
            del job  # its device tensors are freed here, on this thread, not with the next job's wait
            time.sleep(0)  # let the caller's thread take the GIL back between jobs
