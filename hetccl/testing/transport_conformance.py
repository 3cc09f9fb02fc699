"""Transport conformance: the checks every transport of interface v2 must pass, built-ins and plugins alike.

Run them against an installed plugin, through the registry exactly as a job finds it:

    python -m hetccl.testing.transport_conformance NAME      # NAME: its entry point in `hetccl.transports`

or from pytest (`check_all`, or one check of `CHECKS` per test; tests/test_transport_conformance.py does both).
Each check builds a small world in one process and one event loop: an in-process rendezvous store, one
`TransportContext` per rank (all on one host, over 127.0.0.1), each rank's transport listening and connecting
as the fabric does (bootstrap.py), and the core's side played here: the matchers (`ctx.new_matcher`), the
lost-peer reports (`ctx.on_peer_lost`) and the control-frame handler. docs/transports.md lists what they check.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..config import Settings
from ..errors import CollectiveMismatchError, HetcclError, PeerLostError
from ..matching import NOTICE_TAG, Matcher
from ..store import StoreClient, StoreServer
from ..transports import registry
from ..transports.base import TRANSPORT_API_VERSION, Endpoint, Transport, TransportContext, TransportProperties
from ..wire import CollOp, Fingerprint

SECRET = b"conformance"
DEADLINE = 20.0  # seconds any one step may take


class World:
    """`size` ranks of one transport class, connected to each other (every pair that can_reach says so)."""

    def __init__(self, cls: type[Transport], size: int = 2, settings: Settings | None = None):
        self.cls, self.size = cls, size
        self.settings = settings or dataclasses.replace(
            Settings.from_env({"HETCCL_TIMEOUT": str(int(DEADLINE)), "HETCCL_SECRET": SECRET.decode()}),
            unexpected_bytes=1 << 20)
        self.server: StoreServer | None = None
        self.stores: list[StoreClient] = []
        self.ctxs: list[TransportContext] = []
        self.transports: list[Transport] = []
        self.endpoints: list[dict[int, Endpoint]] = []
        self.matchers: list[dict[int, Matcher]] = []
        self.lost: list[list[tuple[int, BaseException]]] = []
        self.notices: list[list[tuple[int, bytes, int]]] = []

    async def __aenter__(self) -> World:
        self.server = StoreServer("127.0.0.1", 0, SECRET)
        port = await self.server.start()
        job = f"conf{id(self) & 0xFFFFFF:x}"
        for r in range(self.size):
            store = StoreClient("127.0.0.1", port, SECRET, DEADLINE, r)
            await store.connect()
            self.stores.append(store)
            matchers: dict[int, Matcher] = {}
            lost: list[tuple[int, BaseException]] = []

            def factory(peer: int, r: int = r, matchers: dict[int, Matcher] = matchers) -> Matcher:
                m = matchers[peer] = Matcher(r, peer, self.settings.unexpected_bytes)
                return m

            ctx = TransportContext(r, self.size, job, "conformance-host", self.settings, store, "127.0.0.1",
                                   local_ranks=list(range(self.size)), machine_ranks=list(range(self.size)),
                                   on_peer_lost=lambda p, e, lost=lost: lost.append((p, e)),
                                   matcher_factory=factory)
            self.ctxs.append(ctx)
            self.matchers.append(matchers)
            self.lost.append(lost)
            self.notices.append([])
            self.transports.append(self.cls(ctx))
        records = await asyncio.wait_for(asyncio.gather(*(t.listen() for t in self.transports)), DEADLINE)
        plans = [{p: records[p] for p in range(self.size) if p != r and t.can_reach(p, records[p], True)}
                 for r, t in enumerate(self.transports)]
        self.endpoints = list(await asyncio.wait_for(
            asyncio.gather(*(t.connect(plan) for t, plan in zip(self.transports, plans, strict=True))), DEADLINE))
        for r in range(self.size):
            for m in self.matchers[r].values():
                m.on_notice = lambda peer, fp, payload, tag, r=r: self.notices[r].append((peer, payload, tag))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        for t in self.transports:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t.close(), DEADLINE)
        for s in self.stores:
            s.close()
        if self.server is not None:
            await self.server.close()
            self.server = None


def fp(seq: int, comm: int = 0x51, count: int = 0) -> Fingerprint:
    return Fingerprint(comm, seq, CollOp.ALL_REDUCE, 0, count)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


async def _recv(w: World, r: int, peer: int, f: Fingerprint, tag: int, dst: np.ndarray, reduce: Any = None) -> Any:
    return w.endpoints[r][peer].post_recv(f, tag, dst, reduce)


# ------------------------------------------------------------------------------------------------ checks

async def check_declares(cls: type[Transport]) -> None:
    """api_version is this interface's; properties are a TransportProperties; name and priority are set."""
    _check(cls.api_version == TRANSPORT_API_VERSION, f"api_version is {cls.api_version}, not {TRANSPORT_API_VERSION}")
    _check(isinstance(getattr(cls, "properties", None), TransportProperties), "properties is not a TransportProperties")
    _check(isinstance(cls.name, str) and bool(cls.name), "name is not set")
    _check(isinstance(cls.priority, int), "priority is not an int")
    _check(cls.unavailable_reason() is None, f"unavailable here: {cls.unavailable_reason()}")


async def check_connects_with_core_matchers(cls: type[Transport]) -> None:
    """Every peer gets an endpoint, and each endpoint holds the matcher the core gave it (ctx.new_matcher)."""
    async with World(cls, 3) as w:
        for r in range(3):
            _check(sorted(w.endpoints[r]) == [p for p in range(3) if p != r],
                   f"rank {r} has endpoints to {sorted(w.endpoints[r])}")
            for p, ep in w.endpoints[r].items():
                _check(ep.peer == p, f"rank {r}: endpoint for {p} says peer {ep.peer}")
                _check(ep.matcher is w.matchers[r].get(p), f"rank {r}: endpoint to {p} does not hold "
                       "the matcher from ctx.new_matcher(peer)")


async def check_send_recv_sizes(cls: type[Transport]) -> None:
    """Messages of 0 B to 3 MiB land whole, both ways, receives posted first."""
    async with World(cls) as w:
        for i, n in enumerate((0, 1, 7, 4097, 65536 + 3, 3 << 20)):
            for a, b in ((0, 1), (1, 0)):
                src = (np.arange(n) * 7 + i + a).astype(np.uint8)
                dst = np.zeros(n, np.uint8)
                fut = await _recv(w, b, a, fp(i + 1), 5, dst)
                await asyncio.wait_for(w.endpoints[a][b].send(fp(i + 1), 5, src), DEADLINE)
                await asyncio.wait_for(fut, DEADLINE)
                _check(np.array_equal(dst, src), f"{n} B from rank {a} to rank {b} differ")


async def check_early_message(cls: type[Transport]) -> None:
    """A message sent before its receive is posted waits in the core's early buffer, then lands."""
    async with World(cls) as w:
        src = np.arange(10000, dtype=np.uint8)
        await asyncio.wait_for(w.endpoints[0][1].send(fp(1), 9, src), DEADLINE)
        m = w.matchers[1][0]
        for _ in range(int(DEADLINE * 100)):
            if m.early:
                break
            await asyncio.sleep(0.01)
            if hasattr(w.transports[1], "progress"):  # a polled transport may need a nudge (shm)
                w.transports[1].progress()
        dst = np.zeros_like(src)
        await asyncio.wait_for(await _recv(w, 1, 0, fp(1), 9, dst), DEADLINE)
        _check(np.array_equal(dst, src), "an early message landed wrong")


async def check_matching_by_key_not_order(cls: type[Transport]) -> None:
    """Receives are matched by (comm, seq, tag), whatever order they are posted and sent in."""
    async with World(cls) as w:
        keys = [(fp(3), 1), (fp(1), 2), (fp(2), 1), (fp(1), 1)]
        dsts = [np.zeros(100, np.uint8) for _ in keys]
        futs = [await _recv(w, 1, 0, f, t, d) for (f, t), d in zip(keys, dsts, strict=True)]
        for i in (3, 0, 2, 1):
            f, t = keys[i]
            await asyncio.wait_for(w.endpoints[0][1].send(f, t, np.full(100, i + 1, np.uint8)), DEADLINE)
        await asyncio.wait_for(asyncio.gather(*futs), DEADLINE)
        for i, d in enumerate(dsts):
            _check(bool((d == i + 1).all()), f"receive {i} got another message's data")


async def check_reduce_on_receive(cls: type[Transport]) -> None:
    """post_recv with reduce: dst = dst OP incoming, also for a message of several fragments."""
    def add(dst: np.ndarray, incoming: Any) -> None:
        d = dst.view(np.float32)
        d += np.frombuffer(incoming, np.float32, len(d))

    async with World(cls) as w:
        for n in (16, 1 << 20):
            mine = np.ones(n, np.float32)
            theirs = np.arange(n, dtype=np.float32)
            fut = await _recv(w, 1, 0, fp(n), 3, mine.view(np.uint8), add)
            await asyncio.wait_for(w.endpoints[0][1].send(fp(n), 3, theirs.view(np.uint8)), DEADLINE)
            await asyncio.wait_for(fut, DEADLINE)
            _check(np.array_equal(mine, theirs + 1), f"reduce of {n} floats is wrong")


async def check_mismatch_fails_the_receive(cls: type[Transport]) -> None:
    """A frame whose fingerprint differs from its receive's fails that receive with CollectiveMismatchError."""
    async with World(cls) as w:
        fut = await _recv(w, 1, 0, fp(1, count=4), 0, np.zeros(4, np.uint8))
        await asyncio.wait_for(w.endpoints[0][1].send(fp(1, count=5), 0, np.zeros(4, np.uint8)), DEADLINE)
        try:
            await asyncio.wait_for(fut, DEADLINE)
        except CollectiveMismatchError:
            return
        raise AssertionError("a mismatched frame completed the receive")


async def check_cancel_and_fail(cls: type[Transport]) -> None:
    """cancel(comm, seq, exc) fails that collective's receives; fail(exc) fails pending and later ones."""
    async with World(cls) as w:
        ep = w.endpoints[1][0]
        fut = await _recv(w, 1, 0, fp(1), 0, np.zeros(8, np.uint8))
        other = await _recv(w, 1, 0, fp(2), 0, np.zeros(8, np.uint8))
        ep.cancel(fp(1).comm, 1, HetcclError("cancelled"))
        await _expect(fut, HetcclError, "cancel")
        ep.fail(PeerLostError("gone", 0))
        await _expect(other, PeerLostError, "fail (pending receive)")
        await _expect(await _recv(w, 1, 0, fp(3), 0, np.zeros(8, np.uint8)), PeerLostError, "fail (later receive)")


async def _expect(aw: Awaitable[Any], exc_type: type[BaseException], what: str) -> None:
    try:
        await asyncio.wait_for(aw, DEADLINE)
    except exc_type:
        return
    raise AssertionError(f"{what}: the receive did not fail with {exc_type.__name__}")


async def check_control_frames_reach_the_core(cls: type[Transport]) -> None:
    """A control frame (a mismatch notice) sent while the peer receives nothing reaches the core's handler."""
    async with World(cls) as w:
        await asyncio.wait_for(w.endpoints[0][1].send(fp(1), NOTICE_TAG, np.frombuffer(b"hello", np.uint8)),
                               DEADLINE)
        for _ in range(int(DEADLINE * 100)):
            if w.notices[1]:
                break
            await asyncio.sleep(0.01)
        _check(w.notices[1] == [(0, b"hello", NOTICE_TAG)], f"the core's handler got {w.notices[1]}")


async def check_peer_loss(cls: type[Transport]) -> None:
    """When a peer's transport closes, the other side reports it (ctx.on_peer_lost) and its pending receive
    fails with PeerLostError; close() is idempotent."""
    async with World(cls) as w:
        fut = await _recv(w, 1, 0, fp(1), 0, np.zeros(8, np.uint8))
        await asyncio.wait_for(w.transports[0].close(), DEADLINE)
        await asyncio.wait_for(w.transports[0].close(), DEADLINE)
        await _expect(fut, PeerLostError, "peer loss")
        _check(any(p == 0 for p, _e in w.lost[1]), f"rank 1 reported no loss of rank 0: {w.lost[1]}")


CHECKS: dict[str, Callable[[type[Transport]], Awaitable[None]]] = {
    f.__name__.removeprefix("check_"): f for f in (
        check_declares, check_connects_with_core_matchers, check_send_recv_sizes, check_early_message,
        check_matching_by_key_not_order, check_reduce_on_receive, check_mismatch_fails_the_receive,
        check_cancel_and_fail, check_control_frames_reach_the_core, check_peer_loss)
}


def check_all(cls: type[Transport]) -> dict[str, str | None]:
    """Run every check (each in its own event loop); name -> None when it passed, else why it failed."""
    out: dict[str, str | None] = {}
    for name, check in CHECKS.items():
        try:
            asyncio.run(asyncio.wait_for(check(cls), 6 * DEADLINE))
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - a conformance report lists every failure
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hetccl.testing.transport_conformance TRANSPORT_NAME", file=sys.stderr)
        return 2
    cls = registry.load(args[0])
    results = check_all(cls)
    for name, why in results.items():
        print(f"{'ok  ' if why is None else 'FAIL'} {name}" + ("" if why is None else f": {why}"))
    failed = sum(why is not None for why in results.values())
    print(f"{args[0]}: {len(results) - failed}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
