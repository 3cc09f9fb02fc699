"""Message matching: the core's, which every transport feeds (transport interface v2).

A transport moves frames; matching them to receives is the core's. The fabric creates one `Matcher` per peer
(`Fabric._new_matcher`, handed to transports as `TransportContext.new_matcher(peer)` when they build an
endpoint) and keeps it in `Fabric.matchers`: receives are posted into it (`post`), the transport asks it where
an arriving frame goes (`take` → a posted `RecvRequest`, None to keep it as early data, or `DROP`), lands early
frames in it (`alloc`/`land`), applies flow control with it (`has_room`/`wait_room`), and fails it when the peer
is lost (`fail_all`). Control-plane policy lives here too, not in the transports: the control tags (mismatch
notice, hang-report request, goodbye) are handed to the fabric (`on_notice`), poisoned and dead communicators
fail or drop their frames.

Messages are matched by (communicator id, sequence number, tag), never by arrival order, so several
collectives may be in flight. Data that arrives before its receive is posted waits in a bounded per-peer buffer.
Every frame carries the collective's fingerprint; a receive whose fingerprint differs from the frame's fails
with CollectiveMismatchError.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import CollectiveMismatchError
from .wire import Fingerprint

DROP = False  # Matcher.take: read the frame and discard it
# A frame with this tag is not data: a rank that found a collective mismatch tells the other ranks of the
# communicator (payload: msgpack {"rank": detector's comm rank, "text": its error}), so that ranks which never
# exchange data with the odd one out also raise instead of waiting for their deadline.
NOTICE_TAG = 0xFFFE << 48
# Also not data: "send your flight records" (payload: msgpack {"key": store key to write them under}), sent
# by a rank whose collective timed out, to build the hang report.
REPORT_TAG = 0xFFFD << 48
# Also not data: "I am closing after losing these ranks" (payload: msgpack {"lost": [job ranks]}), sent by a
# survivor before it closes its connections, so that other survivors name the rank that died, not the one
# that left after it.
GOODBYE_TAG = 0xFFFC << 48
CONTROL_TAGS = (NOTICE_TAG, REPORT_TAG, GOODBYE_TAG)
NOTICE_MAX_BYTES = 4096
HELD_NOTICES = 64  # control frames kept per peer while the fabric has not yet installed its handler


P2P_HIGH = 0xFFFF  # tag >> 48 of point-to-point frames (communicator.P2P_TAG)
_arrivals = itertools.count()  # process-wide order of early point-to-point frames (receive from any source)


class RecvRequest:
    __slots__ = ("fp", "dst", "reduce", "fut", "group")

    def __init__(self, fp: Fingerprint, dst: np.ndarray, reduce: Any, fut: asyncio.Future):
        self.fp, self.dst, self.reduce, self.fut = fp, dst, reduce, fut
        self.group: AnySource | None = None

    def deliver(self, data: Any) -> None:
        """Land `data` (bytes of the message) in dst: copy or reduce."""
        if self.reduce is None:
            from .native import copy

            copy(self.dst, data)
        else:
            self.reduce(self.dst, data)
        if not self.fut.done():
            self.fut.set_result(None)


class AnySource:
    """One receive posted to several peers at once (receive from any source): the first message taken wins,
    and in that same step the other peers' postings are removed from their matchers, without marking anything
    withdrawn, so those peers' messages stay for later receives (MPI's ANY_SOURCE: one message is consumed)."""

    __slots__ = ("posts", "winner")

    def __init__(self) -> None:
        self.posts: list[tuple[Matcher, tuple[int, int, int], RecvRequest]] = []
        self.winner: Matcher | None = None

    def add(self, matcher: Matcher, key: tuple[int, int, int], req: RecvRequest) -> None:
        req.group = self
        self.posts.append((matcher, key, req))

    def claim(self, matcher: Matcher) -> None:
        self.winner = matcher
        self.unpost(keep=matcher)

    def unpost(self, keep: Matcher | None = None) -> None:
        """Remove every posting still waiting (but the one in `keep`); their futures are cancelled."""
        for m, key, req in self.posts:
            if m is not keep and m.posted.get(key) is req:
                del m.posted[key]
            if m is not keep and not req.fut.done():
                req.fut.cancel()


def mismatch_error(me: int, peer: int, want: Fingerprint, got: Fingerprint) -> CollectiveMismatchError:
    return CollectiveMismatchError(
        f"collective mismatch between rank {me} and rank {peer}: rank {me} runs {want.describe()} "
        f"but rank {peer} sent data for {got.describe()}; every rank must issue the same collectives "
        "in the same order with the same dtype, count, root and reduce op")


class Matcher:
    """Posted receives and early ("unexpected") messages of one peer, keyed by (comm, seq, tag)."""

    def __init__(self, me: int, peer: int, cap_bytes: int):
        self.me, self.peer, self.cap = me, peer, cap_bytes
        self.posted: dict[tuple[int, int, int], RecvRequest] = {}
        self.early: dict[tuple[int, int, int], tuple[Fingerprint, Any]] = {}
        self.early_bytes = 0
        self.error: BaseException | None = None
        self._space = asyncio.Event()
        self._free: list[np.ndarray] = []  # recycled early-message buffers: no allocation per message
        self.withdrawn: deque[tuple[int, int]] = deque(maxlen=256)  # recently failed collectives
        # set by the fabric (the on_notice property): called with (peer, fingerprint, payload bytes, tag) for a
        # control frame; frames that arrive before that (a fast peer's notice while this rank is still in init)
        # are held, at most HELD_NOTICES, and handed over when it is set
        self._on_notice: Callable[[int, Fingerprint, bytes, int], None] | None = None
        self._held: list[tuple[Fingerprint, bytes, int]] = []
        # set by the fabric: called with (peer, fingerprint) when a frame is kept as early data
        self.on_stash: Callable[[int, Fingerprint], None] | None = None
        self.dead_comms: set[int] = set()  # communicators given up (shrink): their frames are dropped
        self.poisoned: dict[int, BaseException] = {}  # communicators made unusable by a mismatch (cancel_comm)
        self.taken: RecvRequest | None = None  # the last receive take() handed out (frames of a peer come in order)
        self.arrived: dict[tuple[int, int, int], int] = {}  # early point-to-point frames: global arrival order

    @property
    def on_notice(self) -> Callable[[int, Fingerprint, bytes, int], None] | None:
        return self._on_notice

    @on_notice.setter
    def on_notice(self, sink: Callable[[int, Fingerprint, bytes, int], None] | None) -> None:
        self._on_notice = sink
        held, self._held = self._held, []
        for fp, payload, tag in held if sink is not None else ():
            sink(self.peer, fp, payload, tag)

    @property
    def expecting(self) -> bool:
        """Whether a receive is posted (a polled transport keeps polling while one is)."""
        return bool(self.posted)

    def alloc(self, nbytes: int) -> np.ndarray:
        """A buffer for an early message (returned to the pool once delivered)."""
        for i, arr in enumerate(self._free):
            if nbytes <= len(arr) <= 4 * nbytes + 4096:
                return self._free.pop(i)[:nbytes]
        return np.empty(max(nbytes, 4096), np.uint8)[:nbytes]

    def release(self, view: np.ndarray) -> None:
        base = view.base if isinstance(view.base, np.ndarray) else view
        if len(self._free) < 16:
            self._free.append(base)

    def post(self, fp: Fingerprint, tag: int, dst: np.ndarray, reduce: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self.error is not None:
            fut.set_exception(self.error)
            return fut
        if self.poisoned and fp.comm in self.poisoned:
            fut.set_exception(self.poisoned[fp.comm])
            return fut
        key = (fp.comm, fp.seq, tag)
        early = self.early.pop(key, None)
        req = RecvRequest(fp, dst, reduce, fut)
        if early is None:
            for (comm, seq, _t), (got, _data) in self.early.items() if self.early else ():
                if comm == fp.comm and seq == fp.seq and got != fp:  # the peer runs another collective here
                    fut.set_exception(mismatch_error(self.me, self.peer, fp, got))
                    return fut
            self.posted[key] = req
            return fut
        got, data = early
        self.early_bytes -= len(data)
        self.arrived.pop(key, None)
        self._space.set()
        if got != fp:
            fut.set_exception(mismatch_error(self.me, self.peer, fp, got))
        elif len(data) != len(dst):
            fut.set_exception(CollectiveMismatchError(
                f"rank {self.peer} sent {len(data)} bytes for {fp.describe()} tag {tag}, rank {self.me} "
                f"expected {len(dst)}"))
        else:
            req.deliver(data)
        self.release(data)
        return fut

    def take(self, fp: Fingerprint, tag: int, nbytes: int) -> RecvRequest | None | bool:
        """The posted receive for an arriving frame; None when none is posted (keep it as early data);
        DROP when the frame must be read and thrown away: its receive disagrees (and has failed with
        CollectiveMismatchError), its collective was withdrawn, or the peer is already failed."""
        if tag in CONTROL_TAGS:
            return self._notice(fp, tag, nbytes)
        if fp.comm in self.dead_comms:
            return DROP
        key = (fp.comm, fp.seq, tag)
        req = self.posted.pop(key, None)
        if req is None:
            if (fp.comm, fp.seq) in self.withdrawn:
                return DROP
            # a failed peer's frames are kept while there is room: after a loss, survivors may heal their
            # connections (shrink) and the frames of the new communicator can arrive before this rank heals
            return DROP if self.error is not None and not self.has_room(nbytes) else None
        if req.fp != fp:
            req.fut.set_exception(mismatch_error(self.me, self.peer, req.fp, fp))
            self.cancel(fp.comm, fp.seq, req.fut.exception())
            return DROP
        if nbytes != len(req.dst):
            req.fut.set_exception(CollectiveMismatchError(
                f"rank {self.peer} sent {nbytes} bytes for {fp.describe()} tag {tag}, rank {self.me} "
                f"expected {len(req.dst)}"))
            req.fut.exception()
            self.cancel(fp.comm, fp.seq, req.fut.exception())
            return DROP
        self.taken = req  # being filled by the transport: no longer in posted, but fail_all must still reach it
        if req.group is not None:  # a receive from any source: this peer's message wins it
            req.group.claim(self)
        return req

    def _notice(self, fp: Fingerprint, tag: int, nbytes: int) -> RecvRequest | bool:
        """A receive for a control message (mismatch notice, report request): read it whole, then hand it to
        the fabric."""
        if nbytes > NOTICE_MAX_BYTES or self._on_notice is None and len(self._held) >= HELD_NOTICES:
            return DROP
        fut = asyncio.get_running_loop().create_future()
        req = RecvRequest(fp, np.empty(nbytes, np.uint8), None, fut)

        def delivered(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            if self._on_notice is None:
                self._held.append((fp, bytes(req.dst), tag))
            else:
                self._on_notice(self.peer, fp, bytes(req.dst), tag)

        fut.add_done_callback(delivered)
        return req

    def cancel_comm(self, comm: int, exc: BaseException) -> None:
        """Fail every receive posted for any collective of one communicator, and every one posted later: a
        mismatch notice can arrive after a collective checked its communicator and before it posted its
        receives, which would then wait for data the odd rank will never send."""
        self.poisoned.setdefault(comm, exc)
        for seq in {k[1] for k in self.posted if k[0] == comm}:
            self.cancel(comm, seq, exc)

    def land(self, fp: Fingerprint, tag: int, data: np.ndarray) -> None:
        """A message read whole into an early buffer (alloc): deliver it to a receive posted meanwhile, drop it,
        or keep it for a later post."""
        req = self.take(fp, tag, len(data))
        if req is DROP:
            self.release(data)
        elif req is not None:
            req.deliver(data)
            self.release(data)
        else:
            self.stash(fp, tag, data)

    def has_room(self, nbytes: int) -> bool:
        return self.early_bytes + nbytes <= self.cap or not self.early

    def stash(self, fp: Fingerprint, tag: int, data: Any) -> None:
        self.early[(fp.comm, fp.seq, tag)] = (fp, data)
        self.early_bytes += len(data)
        if tag >> 48 == P2P_HIGH:
            self.arrived[(fp.comm, fp.seq, tag)] = next(_arrivals)
        # a receive already posted for the same collective but with another fingerprint is a mismatch
        for (comm, seq, _t), req in list(self.posted.items()):
            if comm == fp.comm and seq == fp.seq and req.fp != fp:
                self.cancel(comm, seq, mismatch_error(self.me, self.peer, req.fp, fp))
                break
        if self.on_stash is not None:
            self.on_stash(self.peer, fp)

    async def wait_room(self, nbytes: int, timeout: float) -> None:
        """Until the early buffer has room for nbytes, or the matcher has failed (the frame is then dropped: a
        failed peer's reader must keep draining, or the peer's sender, its goodbye included, would stall)."""
        while not self.has_room(nbytes) and self.error is None:
            self._space.clear()
            await asyncio.wait_for(self._space.wait(), timeout)

    def cancel(self, comm: int, seq: int, exc: BaseException | None) -> None:
        """Withdraw a collective: fail its receives; frames that still arrive for it are dropped."""
        self.withdrawn.append((comm, seq))
        for key in [k for k in self.posted if k[0] == comm and k[1] == seq]:
            req = self.posted.pop(key)
            if not req.fut.done() and exc is not None:
                req.fut.set_exception(exc)
                req.fut.exception()  # the collective reports it; don't log it again
            elif not req.fut.done():
                req.fut.cancel()

    def heal(self, dead_comms: tuple[int, ...] | set[int] = ()) -> None:
        """After a loss, let this (intact) connection carry new communicators: clear the error the matcher was
        failed with, and drop any frame, kept or still arriving, of the communicators in `dead_comms`."""
        self.error = None
        self.dead_comms.update(dead_comms)
        for key in [k for k in self.early if k[0] in self.dead_comms]:
            self.early_bytes -= len(self.early.pop(key)[1])
            self.arrived.pop(key, None)
        self._space.set()

    def fail_all(self, exc: BaseException) -> None:
        """Fail every pending and later receive. The first error stays: when one rank's loss makes others close
        their connections, what pending work lost is that first rank, not the ranks that left because of it."""
        if self.error is None:
            self.error = exc
        exc = self.error
        posted, self.posted = self.posted, {}
        if self.taken is not None:  # a message half delivered when the peer died
            posted[None] = self.taken  # type: ignore[index]
            self.taken = None
        for req in posted.values():
            if not req.fut.done():
                req.fut.set_exception(exc)
                req.fut.exception()
        self._space.set()
