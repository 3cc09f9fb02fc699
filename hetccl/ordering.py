"""Issue order for operations made of several sub-collectives (the hierarchical ones across islands).

A hierarchical collective runs steps on other communicators (the island's, the leaders') and waits between
them for device copies and for its peers. Two such collectives in flight at once (DDP's buckets, `async_op=True`,
`asyncio.gather`) would start their later steps in whatever order their waits end, which differs from rank to
rank: the sub-communicators would then see different orders on different ranks (a mismatch, or two vendor
collectives enqueued in different orders: a hang). So they take turns per communicator, in the order they were
issued, as collectives on one NCCL communicator run one after another on its stream. The turn is taken when the
coroutine starts, before its first await, which is issue order (asyncio starts tasks first in, first out).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator

from .errors import CollectiveTimeout

# the IssueOrder turns this task holds: a hierarchical collective that calls another one on the same
# communicator (reduce_scatter's leaders step when every island is one rank) runs inside its own turn
_HELD: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("hetccl_turns_held", default=frozenset())


class IssueOrder:
    """First come, first served turns for one communicator's composite operations."""

    def __init__(self) -> None:
        self._issued = 0  # next ticket to hand out
        self._serving = 0  # ticket whose turn it is
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._abandoned: set[int] = set()

    @contextlib.asynccontextmanager
    async def turn(self, what: str, deadline: float) -> AsyncIterator[None]:
        """Hold this communicator's turn for the body; waits (at most until `deadline`) for every operation
        issued before it to finish."""
        held = _HELD.get()
        if id(self) in held:
            yield
            return
        ticket = self._issued  # taken before any await: the order of issue
        self._issued += 1
        token = _HELD.set(held | {id(self)})
        entered = False
        try:
            if ticket != self._serving:
                loop = asyncio.get_running_loop()
                fut = self._waiting[ticket] = loop.create_future()
                try:
                    await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise CollectiveTimeout(f"{what} waited for the collectives issued before it on this "
                                            "communicator past the deadline (HETCCL_TIMEOUT)") from None
                finally:
                    self._waiting.pop(ticket, None)
            entered = True
            yield
        finally:
            _HELD.reset(token)
            self._finish(ticket, entered)

    def _finish(self, ticket: int, entered: bool) -> None:
        if not entered and ticket != self._serving:  # cancelled or timed out while waiting: skip it later
            self._abandoned.add(ticket)
            return
        self._serving = ticket + 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        fut = self._waiting.get(self._serving)
        if fut is not None and not fut.done():
            fut.set_result(None)
