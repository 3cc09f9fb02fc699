"""Interpreter exit: close what the program left open before the runtime tears down.

A process that joins a job and exits without close() or destroy_process_group() (a normal return, sys.exit, an
uncaught exception) used to leave the sync facade's uvloop thread running during interpreter finalisation: a
peer closing its connections woke the loop, uvloop called back into Python while the main thread tore the
runtime down, and the rank died of SIGSEGV or hung. One `atexit` step, registered at the first init, now:

1. detaches the torch process groups still alive (their shutdown, so torch's later calls are no-ops);
2. closes every communicator still open, all at once (a closing barrier per job: closed one after the other,
   two ranks closing the same groups in different orders would wait for each other), each barrier bounded by
   EXIT_WAIT_S (peers that exit together meet in milliseconds; a peer already gone costs this once);
3. stops the vendor-CCL watchdog threads and stops and joins the loop threads.

`atexit` runs after the non-daemon threads are joined (a thread still using hetccl finishes first) and before
the interpreter stops daemon threads, so no hetccl thread runs Python during finalisation. Handlers registered
after the first init (the program's own) run before this one and may still use their communicators.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .communicator import Communicator
    from .sync import SyncCommunicator

log = logging.getLogger("hetccl")

EXIT_WAIT_S = 2.0  # closing barrier at exit
CLOSE_SLACK_S = 3.0  # beyond the barrier: transports close (TCP lingers up to 2 s for the peer's FIN)
JOIN_S = 3.0  # a loop thread or vendor watchdog that has not ended by then is left (and reported)

_lock = threading.Lock()
_registered = False
_syncs: dict[int, SyncCommunicator] = {}  # SyncCommunicator owners not yet closed (insertion ordered)
_asyncs: dict[int, tuple[Communicator, asyncio.AbstractEventLoop]] = {}  # init() communicators not yet closed
_backends: weakref.WeakSet[Any] = weakref.WeakSet()  # torch process groups: objects with _detach()


def _forget() -> None:
    """In a forked child: the communicators, their connections and loop threads are the parent's; closing them
    from here would shut the parent's sockets down, so the child leaves them alone."""
    _syncs.clear()
    _asyncs.clear()
    _backends.clear()


# Why this process is leaving, when an exception ends it: the goodbye carries it, so that peers waiting for this
# rank report a rank that failed (PeerLostError naming the error) rather than one that issued fewer collectives.
leaving_reason: str | None = None


def note_leaving(exc: BaseException) -> None:
    """Record the exception that ends this process (the first one wins), for the goodbye."""
    global leaving_reason
    if leaving_reason is None and not isinstance(exc, SystemExit | KeyboardInterrupt | GeneratorExit):
        leaving_reason = f"{type(exc).__name__}: {exc}"[:200]


def _excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
    note_leaving(exc)
    _previous_excepthook(kind, exc, tb)


_previous_excepthook = sys.excepthook


def _register() -> None:
    global _registered, _previous_excepthook
    with _lock:
        if not _registered:
            atexit.register(close_all)
            os.register_at_fork(after_in_child=_forget)
            # an uncaught exception reaches sys.excepthook before atexit closes what is open
            _previous_excepthook, sys.excepthook = sys.excepthook, _excepthook
            _registered = True


def track_async(comm: Communicator, loop: asyncio.AbstractEventLoop) -> None:
    _register()
    _asyncs[id(comm)] = (comm, loop)


def untrack_async(comm: Communicator) -> None:
    _asyncs.pop(id(comm), None)


def track_sync(sc: SyncCommunicator) -> None:
    _register()
    _syncs[id(sc)] = sc


def untrack_sync(sc: SyncCommunicator) -> None:
    _syncs.pop(id(sc), None)


def track_backend(pg: Any) -> None:
    _register()
    _backends.add(pg)


async def bounded_close(comm: Communicator, wait: float) -> None:
    """comm.close() with its closing barrier bounded by `wait` s and the whole bounded too; errors are dropped
    (at exit, peers may be gone: nothing is left to report them to)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(comm.close(timeout=wait), wait + CLOSE_SLACK_S)


async def close_loop(loop: asyncio.AbstractEventLoop, wait: float = EXIT_WAIT_S) -> None:
    """Close, concurrently, the communicators from init() still open on `loop` (hetccl.run's end)."""
    comms = [c for c, lp in list(_asyncs.values()) if lp is loop and not c._closed]
    if comms:
        await asyncio.gather(*(bounded_close(c, wait) for c in comms))


def _vendor_comms(comm: Any) -> list[Any]:
    with contextlib.suppress(Exception):
        return comm.vendor_comms()
    return []


def close_all(wait: float = EXIT_WAIT_S) -> None:
    """Close everything hetccl left open in this process, bounded to about wait + CLOSE_SLACK_S + JOIN_S s.
    Runs at interpreter exit; safe to call earlier (later calls find nothing)."""
    for pg in list(_backends):
        with contextlib.suppress(Exception):
            pg._detach()
    _backends.clear()
    syncs = list(_syncs.values())
    _syncs.clear()
    asyncs = [(c, lp) for c, lp in _asyncs.values() if not c._closed and not lp.is_closed()]
    _asyncs.clear()
    vendor = [vc for sc in syncs for vc in _vendor_comms(sc.async_comm)]
    vendor += [vc for c, _ in asyncs for vc in _vendor_comms(c)]

    # every close starts before any is waited for: see the module docstring
    pending = [f for f in (sc._begin_close(wait) for sc in syncs) if f is not None]
    in_syncs = {id(sc.async_comm) for sc in syncs}
    idle: dict[int, tuple[asyncio.AbstractEventLoop, list[Communicator]]] = {}
    for comm, loop in asyncs:
        if id(comm) in in_syncs:
            continue
        if loop.is_running():  # a loop the program runs in a thread of its own
            pending.append(asyncio.run_coroutine_threadsafe(bounded_close(comm, wait), loop))
        else:
            idle.setdefault(id(loop), (loop, []))[1].append(comm)
    for loop, comms in idle.values():  # not running: drive it from here
        with contextlib.suppress(Exception):
            loop.run_until_complete(asyncio.gather(*(bounded_close(c, wait) for c in comms)))
    deadline = time.monotonic() + wait + CLOSE_SLACK_S + 1.0
    for fut in pending:
        with contextlib.suppress(Exception):
            fut.result(max(0.0, deadline - time.monotonic()))

    for vc in vendor:
        with contextlib.suppress(Exception):
            vc.stop_watchdog()
    for sc in syncs:
        sc._runner.request_stop()
    deadline = time.monotonic() + JOIN_S
    for sc in syncs:
        sc._runner.stop(max(0.0, deadline - time.monotonic()))
    for vc in vendor:
        t = getattr(vc, "_watchdog", None)
        if t is not None and t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("hetccl: at exit, the %s watchdog thread did not stop within %.0f s", t.name, JOIN_S)
