"""Bootstrap: rendezvous, topology exchange and transport wiring of one process ("the fabric").

1. Rank 0 hosts the rendezvous store (unless HETCCL_STORE_EXTERNAL=1 says it runs elsewhere); everyone
   connects with the job secret.
2. Every rank starts its transports' listeners and publishes one record: host identity, pid, hostname
   and each transport's address. Every rank reads all records: the topology (which ranks share a host). Rank 0
   gathers them from the store and pushes them down a tree of ranks (recordtree.py), so that the store sends
   about N records, not N to each rank; a rank the tree does not reach in time reads the store.
3. For each peer the highest-priority transport both sides have and that reaches it is chosen (shared
   memory inside a host, TCP across hosts), and the transports connect.

A host is identified by hostname, boot id and network namespace, so two network namespaces on one
machine count as two hosts (that is how the multi-host tests build "hosts"), and by the HETCCL_HOST name a
rank acts as: ranks on one machine with different names are different hosts (no shared memory, no zero-copy
link between them), ranks with the same name share memory as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import observe, params
from .algorithms import COSTS, LinkCosts
from .config import DEFAULT_CHUNK_BYTES, Identity, Settings, island_label
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeout,
    ConfigError,
    HetcclError,
    PeerLostError,
    TransportError,
)
from .matching import Matcher
from .netio import route_source_addr
from .recordtree import RECORDS_TREE_HOP_S, RecordsInbox, push_records, records_frame, records_wait
from .store import StoreClient, StoreServer
from .transports import registry
from .transports.base import Endpoint, Transport, TransportContext, TransportProperties
from .transports.tcp import connects_lazily
from .waits import WaitNotes, rank_list

log = logging.getLogger("hetccl")

GOODBYE_COMMS = 200  # communicators listed in a goodbye: [id, next seq, op] each, well under NOTICE_MAX_BYTES


def host_identity(name: str | None = None) -> str:
    """This process's host: the machine (hostname, boot id, network namespace), and the HETCCL_HOST name it acts
    as when one is set (ranks on one machine with different names are different hosts)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = "?"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    machine = f"{socket.gethostname()}/{boot[:8]}/{netns}"
    return f"{machine}/{name}" if name else machine


def check_agreement(records: list[dict[str, Any]]) -> None:
    """Refuse, on every rank alike, settings that must be the same everywhere (params `agree`) but differ: ranks
    that chunk or route a collective differently would wait for messages that never come."""
    base = records[0].get("agree") or {}
    for r, rec in enumerate(records[1:], 1):
        theirs = rec.get("agree") or {}
        for name, value in base.items():
            if name in theirs and theirs[name] != value:
                raise ConfigError(f"{name} differs between ranks: rank 0 has {value}, rank {r} has {theirs[name]}; "
                                  "every rank must use the same value (set it alike in every rank's environment, "
                                  "or in the Settings passed to hetccl.init)")


@dataclass
class Topology:
    hosts: list[str]  # host id of every rank
    # machine of every rank (its host id without the HETCCL_HOST name): what ranks acting as different hosts
    # still share, CPUs and network ports; empty: one host per machine
    machines: list[str] = field(default_factory=list)

    def same_host(self, a: int, b: int) -> bool:
        return self.hosts[a] == self.hosts[b]

    def machine_ranks(self, rank: int) -> list[int]:
        """Every rank on this rank's machine, whatever host it acts as."""
        if not self.machines:
            return self.local_ranks(rank)
        return [r for r, m in enumerate(self.machines) if m == self.machines[rank]]

    def machine_rank(self, rank: int) -> int:
        """This rank's index among the ranks on its machine (the local rank when HETCCL_HOST is unset)."""
        return self.machine_ranks(rank).index(rank)

    def local_ranks(self, rank: int) -> list[int]:
        return [r for r, h in enumerate(self.hosts) if h == self.hosts[rank]]

    def local_rank(self, rank: int) -> int:
        return self.local_ranks(rank).index(rank)

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))


# file descriptors a rank holds per peer, measured on 2026-12-04 (4 and 8 ranks, `hetccl run`): about 3 for a peer
# on this host (its shm channel and a fast-path segment), 2 for one on another host (TCP); FD_SPARE covers the
# first collectives' segments and sub-communicators (a limit that fits the plan is never refused)
FDS_PER_LOCAL_PEER, FDS_PER_REMOTE_PEER, FD_SPARE = 3, 2, 16


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (connections grow with the job)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as exc:  # not POSIX, or a hard limit the kernel refuses as soft
        log.debug("hetccl: the open-file limit stays as it is (%s)", exc)


def fd_state(store_server: bool) -> list[int]:
    """What this rank's record says of its open files: [limit (-1: none), open now, whether it serves the store]."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = -1 if soft == resource.RLIM_INFINITY else int(soft)
    except ImportError:
        limit = -1
    try:
        now = len(os.listdir("/proc/self/fd"))
    except OSError:
        now = 0
    return [limit, now, int(store_server)]


def check_fd_room(records: list[dict[str, Any]], topology: Topology) -> None:
    """Before connecting, on every rank alike (from every rank's record): a ConfigError that names the rank, its
    limit and the number it needs where a rank's open-file limit, already raised to its hard limit, cannot hold
    a connection to every peer."""
    size = len(records)
    lazy = connects_lazily(size)
    for r, rec in enumerate(records):
        limit, now, serves = rec.get("fds", (-1, 0, 0))
        if limit < 0:
            continue
        local = len(topology.local_ranks(r)) - 1
        remote = 0 if lazy else size - 1 - local  # lazy: connections to the peers used, not known here
        need = now + FDS_PER_LOCAL_PEER * local + FDS_PER_REMOTE_PEER * remote + FD_SPARE
        need += size if serves else 0  # the store keeps one connection per rank
        if need > limit:
            raise ConfigError(f"rank {r} needs about {need} open files to connect to its {size - 1} peers ({local} "
                              f"on its host, {size - 1 - local} on others; {now} open), and its limit is {limit} "
                              f"even after hetccl raised it to the hard limit: raise the hard limit where rank {r} "
                              f"runs (`ulimit -n {need}` as root, LimitNOFILE= for systemd, `--ulimit "
                              f"nofile={need}` for docker)")


class Fabric:
    """The connections of one process: store, transports and one endpoint per peer."""

    def __init__(self, identity: Identity, settings: Settings):
        self.rank, self.size = identity.rank, identity.world_size
        self.identity, self.settings = identity, settings
        self.server: StoreServer | None = None
        self.store: StoreClient | None = None
        self.transports: list[Transport] = []
        self.endpoints: dict[int, Endpoint] = {}
        # the core's matcher of each peer (matching.py): created here, handed to the transport that builds the
        # peer's endpoint (TransportContext.new_matcher); every receive of that peer is matched in it
        self.matchers: dict[int, Matcher] = {}
        self.peer_transport: dict[int, str] = {}
        self.records: list[dict[str, Any]] = []
        self.host_name = settings.host  # HETCCL_HOST
        self.topology = Topology([host_identity(self.host_name)])
        self.job = ""
        # no rank of this job hosts the store (HETCCL_STORE_EXTERNAL): it outlives the job, so the last rank to
        # close drops the job's keys there (a store a rank hosts goes with that rank, which drops them itself)
        self.store_external = False
        self.closed = False
        self.lost: dict[int, BaseException] = {}
        # communicator id -> the mismatch that made it unusable (its ranks no longer agree on the sequence)
        self.poisoned: dict[int, CollectiveMismatchError | PeerLostError] = {}
        self._notices: set[asyncio.Task] = set()
        # answers a peer's hang report request (hangreport.answer, set by the first communicator: the records
        # it reports are the communicators'; the fabric below them knows nothing of them)
        self.answer_report: Callable[[Fabric, int, bytes], None] | None = None
        # communicator id -> {job rank that closed: (its next sequence number, op code of its last collective, the
        # error it failed on or None)}
        self.departed: dict[int, dict[int, tuple[int, int, str | None]]] = {}
        self.comms: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # id -> Communicator
        # the records tree (recordtree.py), during the bootstrap only: this rank's inbox (ranks other than 0), and
        # its push of the records to the ranks below it
        self._inbox: RecordsInbox | None = None
        self._push: asyncio.Task | None = None
        self.records_source = ""  # where this rank read the records: "store" or "tree" (diagnostics, tests)

    @classmethod
    async def create(cls, identity: Identity, settings: Settings) -> Fabric:
        observe.setup(identity)
        island_label()  # a bad HETCCL_ISLAND is a ConfigError before anything is sent
        fab = cls(identity, settings)
        if fab.host_name is not None:  # the vendor CCL inside an island tells these hosts apart too
            os.environ.setdefault("NCCL_HOSTID", fab.topology.hosts[0])
        try:
            await fab._bootstrap()
        except BaseException:
            await fab.close(graceful=False)
            raise
        return fab

    async def _bootstrap(self) -> None:
        s, rank, size = self.settings, self.rank, self.size
        raise_fd_limit()
        host, port = self.identity.addr or ("127.0.0.1", 0)
        external = params.get("HETCCL_STORE_EXTERNAL")
        if self.identity.meet == "torchrun" and not external:  # MASTER_PORT is torchrun's own store
            from . import torchrun

            host, port = await torchrun.meet(self)
        elif rank == 0 and not external:
            self.server = StoreServer(host, port, s.secret)
            port = await self.server.start()
        if not s.secret:
            log.warning("hetccl: HETCCL_SECRET is not set; connections are authenticated with an empty key. "
                        "Set the same HETCCL_SECRET on every rank (hetccl run does it for you).")
        if size == 1 and self.server is None and self.identity.addr is None:
            raise ConfigError("no rendezvous address")
        self.store = StoreClient(host, port, s.secret, s.timeout, rank)
        await self.store.connect(WaitNotes(s))
        # a fresh job id per rendezvous: keys and data connections of another job never mix with ours
        if rank == 0:
            self.job = secrets.token_hex(8)
            await self.store.set("job", self.job)
        else:
            self.job = await self.store.get("job")
        bind = s.bind_addr or route_source_addr(host, port)
        ctx = TransportContext(rank, size, self.job, self.topology.hosts[0], s, self.store, bind,
                               on_peer_lost=self._peer_lost, matcher_factory=self._new_matcher)
        records: dict[str, Any] = {}
        for cls_ in registry.selected(s.transports):
            t = cls_(ctx)
            try:
                records[t.name] = await t.listen()
            except TransportError as exc:
                with contextlib.suppress(Exception):
                    await t.close()
                if s.transports:  # asked for by name: its failure is the job's
                    raise
                log.warning("hetccl: rank %d skips transport %s: %s", rank, t.name, exc)
                continue
            self.transports.append(t)
        if not self.transports:
            raise ConfigError("no usable transport; see `hetccl info`")
        inbox = None
        if rank != 0:  # rank 0 reads the records from the store: the root of the records tree
            inbox = self._inbox = RecordsInbox(rank, size, self.job, s.secret, bind, min(10.0, s.timeout),
                                               deaf=params.get("HETCCL_TEST_RECORDS_TREE_DEAF"))
            inbox_addr = inbox.start()
        mine = {"host": ctx.host_id, "hostname": socket.gethostname(), "host_name": self.host_name,
                "machine": host_identity(), "pid": os.getpid(), "transports": records, "island": island_label(),
                "agree": params.agreed(s), "fds": fd_state(self.server is not None)}
        if inbox is not None:
            mine["records_inbox"] = list(inbox_addr)
        self.records = await self._read_records(mine)
        try:
            await self._use_records(ctx, bind)
        except Exception:
            await self._end_push()  # the ranks below still get the records: they raise the same ConfigError
            raise
        await self._end_push()

    async def _use_records(self, ctx: TransportContext, bind: str) -> None:
        """With every rank's record: check them alike on every rank, make the topology and connect."""
        assert self.store is not None
        s, rank, size = self.settings, self.rank, self.size
        self.store_external = not any(rec.get("fds", (-1, 0, 0))[2] for rec in self.records)  # nobody serves it
        topology = Topology([rec["host"] for rec in self.records],
                            [rec.get("machine", rec["host"]) for rec in self.records])
        try:
            check_agreement(self.records)
            check_fd_room(self.records, topology)
        except ConfigError:
            # every rank raises it (the same records, the same checks): each first waits (bounded) until every
            # rank has the records, so that the store outlives their reads and no rank exits (and a launcher stops
            # the rest) before the others see it too: down the records tree, ranks get them at different times
            with contextlib.suppress(HetcclError, OSError, TimeoutError):
                await self.store.arrive(f"{self.job}/records-read", size, min(10.0, s.timeout))
            raise
        self.topology = topology
        ctx.local_ranks = self.topology.local_ranks(rank)
        ctx.machine_ranks = self.topology.machine_ranks(rank)
        # choose a transport per peer: highest priority that both sides have and that reaches the peer
        plan: dict[str, dict[int, dict[str, Any]]] = {t.name: {} for t in self.transports}
        for peer in range(size):
            if peer == rank:
                continue
            theirs = self.records[peer]["transports"]
            same = self.topology.same_host(rank, peer)
            for t in self.transports:
                if t.properties.same_host_only and not same:
                    continue
                if t.name in theirs and t.can_reach(peer, theirs[t.name], same):
                    plan[t.name][peer] = theirs[t.name]
                    self.peer_transport[peer] = t.name
                    break
            else:
                raise ConfigError(f"rank {rank} has no transport to reach rank {peer} "
                                  f"(ours: {[t.name for t in self.transports]}, theirs: {sorted(theirs)}); "
                                  "check HETCCL_TRANSPORTS on both")
        results = await asyncio.gather(*(t.connect(plan[t.name]) for t in self.transports))
        for eps in results:
            self.endpoints.update(eps)
        for peer in self.endpoints:
            if getattr(self.endpoints[peer], "matcher", None) is not self.matchers.get(peer):
                raise ConfigError(f"transport {self.peer_transport.get(peer)!r} built its endpoint to rank {peer} "
                                  "without the core's matcher: an endpoint must take ctx.new_matcher(peer)")
        for m in self.matchers.values():
            m.on_notice = self._notice  # control frames held until now are handed over here
            m.on_stash = self._stashed
        await observe.on_init(self, bind)

    def _new_matcher(self, peer: int) -> Matcher:
        """TransportContext.new_matcher: the matcher of `peer`, one per peer."""
        m = self.matchers.get(peer)
        if m is None:
            m = self.matchers[peer] = Matcher(self.rank, peer, self.settings.unexpected_bytes)
        return m

    async def _read_records(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's record, waiting at most the timeout for all of them, in one request per rank whatever the
        size, and about N records sent by the store in all: each rank stores `mine` and counts itself in the
        ranks that joined (the last sets `joined/all`) in one arrival; rank 0's answer is every record once all
        joined, which it pushes down the records tree (recordtree.py), the other ranks' that all joined, then
        for the records from the tree, forward them below and use them. A rank that has not received them
        `records_wait` after `joined/all` (a hop's budget per hop above it) gathers them from the store, as rank 0
        did. While ranks are missing, say which now and then (waits.WaitNotes), asking again between the lines."""
        assert self.store is not None
        notes = WaitNotes(self.settings)
        deadline = time.monotonic() + self.settings.timeout
        # one request stores this rank's record, counts it in and waits (for rank 0: gathers) until every rank has
        first = max(0.0, min(deadline - time.monotonic(), notes.until_next()))
        count, joined, mine_key = f"{self.job}/joined", f"{self.job}/joined/all", f"{self.job}/rank/{self.rank}"
        inbox = self._inbox
        try:
            if inbox is None:
                recs, missing = await self.store.arrive_gather(count, self.size, first, f"{self.job}/rank",
                                                               {mine_key: mine})
                if recs is None:
                    self._missing(missing, deadline, notes)
                    recs = await self._store_records(joined, deadline, notes)
                self._push_stored(recs)
            else:
                waited = not await self.store.arrive_in(count, self.size, first, {mine_key: mine})
                recs = await self._wait_all_joined(joined, deadline, notes, waited) if waited else None
                if recs is not None:  # the store gave them as the last rank joined: the ranks below wait for them
                    self._push_stored(recs)
                else:
                    wait = 0.0 if inbox.deaf else records_wait(self.rank)
                    recs = await inbox.wait(min(wait, deadline - time.monotonic()))
                    if recs is not None:
                        self._start_push(inbox.frame, recs)  # forward first: the ranks below wait for it
                        self.records_source = "tree"
                    else:  # stop listening first: a parent that comes late is refused, and pushes below this rank
                        await inbox.close()
                        log.info("hetccl: rank %d: no records from the records tree %.1f s after every rank "
                                 "joined; reading them from the store", self.rank, wait)
                        recs = await self._store_records(joined, deadline, notes)
        finally:  # this rank has the records, or has failed: nobody needs its inbox any more
            if inbox is not None:
                self._inbox = None
                await inbox.close()
        self.records_source = self.records_source or "store"
        recs[self.rank] = mine
        return recs

    async def _store_records(self, joined: str, deadline: float, notes: WaitNotes) -> list[dict[str, Any]]:
        """Every rank's record from the store: one gather, once key `joined` (every rank joined) exists; until
        `deadline`, saying which ranks are missing now and then (waits.WaitNotes), asking again between lines."""
        assert self.store is not None
        while True:
            left = deadline - time.monotonic()
            recs, missing = await self.store.gather(f"{self.job}/rank", self.size, joined,
                                                    timeout=max(0.0, min(left, notes.until_next())))
            if recs is not None:
                return recs
            self._missing(missing, deadline, notes)

    async def _wait_all_joined(self, joined: str, deadline: float, notes: WaitNotes,
                               waited: bool = False) -> list[dict[str, Any]] | None:
        """Until key `joined` exists (every rank joined), within `deadline`, saying which ranks are missing now
        and then as _store_records does (a gather that answers at once: the missing ranks, or every record when
        the last rank joined just then: those are returned; else None). `waited`: a first wait just ended."""
        assert self.store is not None
        while True:
            left = deadline - time.monotonic()
            if not waited and await self.store.wait(joined, max(0.0, min(left, notes.until_next()))):
                return None
            waited = False
            recs, missing = await self.store.gather(f"{self.job}/rank", self.size, joined, timeout=0)
            if recs is not None:
                return recs
            self._missing(missing, deadline, notes)

    def _missing(self, missing: list[int], deadline: float, notes: WaitNotes) -> None:
        """Ranks `missing` have not joined yet: CollectiveTimeout past `deadline`, else a line when one is due."""
        if time.monotonic() >= deadline:
            raise CollectiveTimeout(f"rank {self.rank}: waited {self.settings.timeout:.0f} s for every rank's "
                                    f"record; {rank_list(missing)} never arrived (crashed, or started with "
                                    "another world size?)")
        if missing:
            notes.say(f"rank {self.rank}: {self.size - len(missing)} of {self.size} ranks joined; "
                      f"missing: {rank_list(missing)}")

    def _push_stored(self, records: list[dict[str, Any]]) -> None:
        """_start_push of records read from the store."""
        if self.size == 1:
            return
        try:
            frame = records_frame(records, self.size)
        except HetcclError as exc:  # larger than a records frame may be: the ranks below read the store
            log.warning("hetccl: rank %d: the records do not fit the records tree (%s); the ranks below this one "
                        "read them from the store", self.rank, exc)
            return
        self._start_push(frame, records)

    def _start_push(self, frame: bytes, records: list[dict[str, Any]]) -> None:
        """Push the records (their frame) to the ranks below this one in the records tree, in a task that
        _end_push awaits: within two hops' budgets (RECORDS_TREE_HOP_S: its children, then their children where a
        child cannot be reached), after which those ranks read the store instead."""
        def inbox_of(r: int) -> Any:
            return records[r].get("records_inbox")

        self._push = asyncio.ensure_future(push_records(self.rank, self.size, self.job, self.settings.secret, frame,
                                                        inbox_of, 2 * RECORDS_TREE_HOP_S))

    async def _end_push(self, cancel: bool = False) -> None:
        """Wait for this rank's push of the records (bounded: push_records' own deadline), or cancel it."""
        task, self._push = self._push, None
        if task is None:
            return
        if cancel:
            task.cancel()
        try:
            await asyncio.wait({task})
        finally:
            task.cancel()  # no-op once done; else this wait itself was cancelled
        if not task.cancelled() and task.exception() is not None:  # push_records keeps its own errors: a bug
            log.warning("hetccl: rank %d: pushing the records failed: %r", self.rank, task.exception())

    async def _goodbye(self) -> None:
        """Closing: tell the peers still connected where this rank stopped on each communicator (so a peer still
        waiting in a later collective raises CollectiveMismatchError at once instead of losing this rank after
        the closing barrier), and, after a loss, which ranks died first (so survivors that had not yet noticed
        the death name the dead rank, not this one). Bounded, best effort."""
        import msgpack

        from .matching import GOODBYE_TAG
        from .wire import CollOp, Fingerprint

        # connected ones only: with connections made on first use, a peer this rank never met waits for nothing
        alive = [p for p, ep in self.endpoints.items() if p not in self.lost and getattr(ep, "connected", True)]
        if not alive:
            return
        if self.lost:
            self.heal(alive)  # the loss failed every endpoint; these connections still work for one last frame
        comms = []
        for cid, comm in list(self.comms.items())[:GOODBYE_COMMS]:
            last = next((e[0].op for e in reversed(comm._flight.entries) if e[0].comm == cid), -1)
            comms.append([cid, comm._seq, last])
        from . import lifecycle

        msg: dict[str, Any] = {"lost": sorted(self.lost), "comms": comms}
        if lifecycle.leaving_reason:  # this process is ending on an error, not closing after its last collective
            msg["error"] = lifecycle.leaving_reason
        fp = Fingerprint(0, 0, CollOp.BARRIER, 255, 0)  # any valid header: control frames are not matched
        self.tell(alive, fp, GOODBYE_TAG, msgpack.packb(msg))
        await self.flush_notices(0.5)

    async def flush_notices(self, timeout: float = 2.0) -> None:
        """Wait (bounded) until the control messages handed to tell() are on the wire: a rank about to raise a
        mismatch, or to close, may exit right after, and a notice still queued in this process would die with
        it (its peers would then see a lost peer instead of the mismatch)."""
        pending = list(self._notices)
        if pending:
            with contextlib.suppress(Exception):
                await asyncio.wait(pending, timeout=min(timeout, self.settings.timeout))

    def report_lost(self, peer: int, exc: PeerLostError) -> None:
        """Another layer saw `peer` die before its transports did (the fast path's kernel copy: ESRCH): the same
        as a transport's report, so that closing does not wait for it."""
        self._peer_lost(peer, exc)

    def _peer_lost(self, peer: int, exc: BaseException) -> None:
        if peer in self.lost:
            return
        self.lost[peer] = exc
        if self.closed:  # closing: nothing left to fail, but the closing barrier must stop waiting for it
            return
        log.error("hetccl: rank %d lost rank %d: %s", self.rank, peer, exc)
        err = exc if isinstance(exc, PeerLostError) else PeerLostError(str(exc), peer)
        for ep in self.endpoints.values():
            ep.fail(err)

    def heal(self, peers: list[int], dead_comms: tuple[int, ...] = ()) -> None:
        """After a loss, let the survivors' connections carry new communicators again: clear the error their
        matchers were failed with (the connections themselves are intact), and drop any frame, kept or still
        arriving, of the communicators in `dead_comms`."""
        for p in peers:
            m = self.matchers.get(p)
            if m is None or p in self.lost:
                continue
            m.heal(dead_comms)

    # ---- collective mismatches ---------------------------------------------------------------------------
    def poison(self, comm: int, exc: CollectiveMismatchError | PeerLostError) -> None:
        """Make communicator `comm` unusable: fail its pending receives, and every later collective on it."""
        self.poisoned.setdefault(comm, exc)
        for m in self.matchers.values():
            m.cancel_comm(comm, exc)

    def report_mismatch(self, fp: Any, exc: CollectiveMismatchError, peers: list[int]) -> None:
        """This rank found a mismatch in collective fp: tell the communicator's other ranks (job ranks
        `peers`), without waiting, so that ranks that exchange no data with the odd one out raise too."""
        import msgpack

        from .matching import NOTICE_TAG

        self.poison(fp.comm, exc)
        self.tell(peers, fp, NOTICE_TAG, msgpack.packb({"rank": self.rank, "text": str(exc)[:3000]}))

    def tell(self, peers: list[int], fp: Any, tag: int, payload: bytes) -> None:
        """Send a small control message (a tag of matching.CONTROL_TAGS) to job ranks `peers`, without
        waiting; failures are ignored (a lost peer cannot be told anything)."""
        data = np.frombuffer(payload, np.uint8)

        async def send(ep: Any) -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(5.0, self.settings.timeout)):
                    await ep.send(fp, tag, data)

        for p in peers:
            ep = self.endpoints.get(p)
            if ep is not None and p not in self.lost:
                task = asyncio.ensure_future(send(ep))
                self._notices.add(task)
                task.add_done_callback(self._notices.discard)

    def _stashed(self, peer: int, got: Any) -> None:
        """A frame was kept for later: if this rank already finished that collective, nothing will ever take
        it — the two ranks ran different collectives at that point (e.g. both thought they were root)."""
        comm = self.comms.get(got.comm)
        if comm is None or got.comm in self.poisoned:
            return
        mine = comm._flight.finished(got.seq)
        if mine is not None:
            self.mismatch_found(comm, mine, got, peer)

    def mismatch_found(self, comm: Any, mine: Any, got: Any, peer: int) -> CollectiveMismatchError:
        from .matching import mismatch_error

        exc = mismatch_error(comm.rank, comm._global_to_comm.get(peer, peer), mine, got)
        self.report_mismatch(mine, exc, [g for g in comm._members if g != self.rank])
        return exc

    def _departed(self, peer: int, cid: int, nxt: int, op: int, error: str | None = None) -> None:
        """Job rank `peer` closed after issuing `nxt` collectives on communicator `cid` (ending on `error`, when
        it failed): a collective of ours past that waits for a rank that will never run it. Poison the
        communicator if one is in flight now; otherwise remember, so the first such collective raises when it
        starts (check_departed)."""
        if self.closed:
            return
        self.departed.setdefault(cid, {})[peer] = (nxt, op, error)
        comm = self.comms.get(cid)
        if comm is None or cid in self.poisoned or peer not in comm._global_to_comm:
            return
        waiting = [e[0] for e in comm._flight.inflight.values()
                   if e[0].comm == cid and (e[0].seq - nxt) & 0xFFFFFFFF < 1 << 31]
        if waiting:
            first = min(waiting, key=lambda f: (f.seq - nxt) & 0xFFFFFFFF)
            self.poison(cid, self._departed_error(comm, peer, nxt, op, first, error))

    def check_departed(self, comm: Any, fp: Any) -> None:
        """Raise (and poison the communicator) if a member already closed before collective `fp`."""
        gone = self.departed.get(fp.comm)
        if not gone or fp.comm != comm.comm_id:
            return
        for peer, (nxt, op, error) in gone.items():
            if (fp.seq - nxt) & 0xFFFFFFFF < 1 << 31:
                exc = self._departed_error(comm, peer, nxt, op, fp, error)
                self.poison(fp.comm, exc)
                raise exc

    def _departed_error(self, comm: Any, peer: int, nxt: int, op: int, fp: Any, error: str | None = None
                        ) -> CollectiveMismatchError | PeerLostError:
        from .wire import CollOp

        who = comm._global_to_comm.get(peer, peer)
        who = f"rank {who}" + (f" (job rank {peer})" if who != peer else "")
        if nxt == 0:
            stopped = "closed before its first collective"
        else:
            stopped = f"closed after {CollOp.NAMES.get(op, 'collective') if op >= 0 else 'collective'} #{nxt - 1}"
        if error is not None:  # it failed: its error is the cause, not a different number of collectives
            return PeerLostError(f"{who} failed ({error}) and left while this rank (rank {comm.rank}) waits in "
                                 f"{fp.describe()}; see rank {peer}'s error", peer)
        return CollectiveMismatchError(
            f"{who} {stopped} while this rank (rank {comm.rank}) waits in {fp.describe()}: the ranks issued "
            "different numbers of collectives; every rank must issue the same collectives before close()")

    def _notice(self, peer: int, fp: Any, payload: bytes, tag: int) -> None:
        import msgpack

        from .matching import GOODBYE_TAG, REPORT_TAG

        if tag == REPORT_TAG:
            if self.answer_report is not None:
                self.answer_report(self, peer, payload)
            return
        if tag == GOODBYE_TAG:  # peer leaves: where it stopped, and the ranks whose death made it leave
            try:
                msg = msgpack.unpackb(payload, max_array_len=65536, max_map_len=3, max_str_len=256, max_bin_len=0)
                lost = [int(r) for r in msg["lost"]]
                comms = [(int(c), int(n), int(o)) for c, n, o in msg.get("comms", ())]
                error = str(msg["error"])[:200] if msg.get("error") else None
            except Exception:  # noqa: BLE001 (malformed: ignored)
                return
            for r in lost:
                if 0 <= r < self.size and r != self.rank and r not in self.lost:
                    self._peer_lost(r, PeerLostError(f"rank {self.rank} lost rank {r} (reported by rank {peer}, "
                                                     "which is closing because of it)", r))
            for cid, nxt, op in comms:
                comm = self.comms.get(cid)
                if lost and comm is not None and any(r in comm._global_to_comm for r in lost):
                    # that communicator broke with the loss: its collectives fail naming the dead rank, and the
                    # peer's count of collectives there says nothing (it stopped where the loss found it)
                    continue
                self._departed(peer, cid, nxt & 0xFFFFFFFF, op, error)
            return

        try:
            msg = msgpack.unpackb(payload, max_str_len=4096, max_bin_len=0, max_array_len=0, max_map_len=4)
            text, who = str(msg["text"]), int(msg["rank"])
        except Exception:  # noqa: BLE001 (a malformed notice is ignored, like any malformed frame)
            log.warning("hetccl: rank %d ignored a malformed mismatch notice from rank %d", self.rank, peer)
            return
        if fp.comm in self.poisoned:
            return
        self.poison(fp.comm, CollectiveMismatchError(
            f"job rank {self.rank}: collective mismatch reported by job rank {who} in {fp.describe()}: {text}"))

    def transport_kind(self, peers: list[int]) -> str:
        """The name of the slowest transport (declared properties: lowest bandwidth, then highest latency) that
        reaches a peer in the list: the one that sets the cost model's figures (transport_costs)."""
        kinds = {self.peer_transport.get(p, "tcp") for p in peers if p != self.rank}
        worst = self.slowest_transport(kinds)
        if worst is None:
            return "shm" if kinds <= {"shm"} else "tcp"  # no peer (a single rank), or no fabric transport
        return worst

    def slowest_transport(self, names: set[str]) -> str | None:
        """Of these transport names, the slowest this fabric has (declared properties: lowest bandwidth, then
        highest latency; ties to the first name, so every rank picks alike); None when it has none of them."""
        props = {t.name: t.properties for t in self.transports}
        worst = None
        for k in sorted(n for n in names if n in props):
            if worst is None or props[k].slower_than(props[worst]):
                worst = k
        return worst

    def declared(self, kind: str) -> TransportProperties | None:
        """What transport `kind` of this fabric declares; None when the fabric does not have it."""
        return next((t.properties for t in self.transports if t.name == kind), None)

    def costs_of(self, kind: str) -> LinkCosts:
        """The cost model's constants of transport `kind`: what it declares (`TransportProperties`), or a
        built-in's reference figures when this fabric does not have it."""
        props = self.declared(kind)
        return LinkCosts.declared(props) if props is not None else COSTS.get(kind, COSTS["tcp"])

    def ring_chunk(self, peers: list[int]) -> tuple[int, int]:
        """The ring pipeline chunk of a communicator over these peers, smallest and largest (a large block grows
        its chunk: scheduler.CollCtx.num_chunks): HETCCL_CHUNK_BYTES alone when set; else DEFAULT_CHUNK_BYTES up
        to what its slowest transport declares (`TransportProperties.ring_chunk_bytes`). Every rank of the
        communicator finds the same slowest transport, as for the cost model, so they cut alike."""
        if self.settings.chunk_bytes is not None:
            return self.settings.chunk_bytes, self.settings.chunk_bytes
        props = self.declared(self.transport_kind(peers))
        return DEFAULT_CHUNK_BYTES, max(DEFAULT_CHUNK_BYTES, props.ring_chunk_bytes if props is not None else 0)

    def transport_costs(self, peers: list[int]) -> LinkCosts:
        """The cost model's constants for a communicator over these peers: its slowest transport's."""
        return self.costs_of(self.transport_kind(peers))

    async def close(self, graceful: bool = True, barrier_s: float | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        await self._end_push(cancel=True)  # a bootstrap that failed: nothing of the records tree outlives it
        if self._inbox is not None:
            await self._inbox.close()
            self._inbox = None
        if self.size > 1 and self.endpoints:
            await self._goodbye()
        wait = min(10.0, self.settings.timeout, barrier_s if barrier_s is not None else 10.0)
        if graceful and self.store is not None and self.size > 1:
            # nobody tears down connections while a peer may still be reading from them (a TCP close with
            # unread data sends RST, which can destroy the peer's last frames): a bounded closing barrier
            await self._closing_barrier(wait)
        elif graceful and self.store is not None and self.store_external:  # one rank: nobody else to wait for
            with contextlib.suppress(HetcclError, OSError, TimeoutError):
                async with asyncio.timeout(wait):
                    await self.store.prune(self.job)
        observe.on_close(self)
        for t in self.transports:
            with contextlib.suppress(Exception):
                await t.close()
        if self.store is not None:
            self.store.close()
        if self.server is not None:
            # the store stops here, the job's keys first (every rank has closed, or the barrier's bound passed):
            # no other rank prunes a store a rank hosts, so the host's wait never polls a pruned count
            if self.job:
                self.server.prune(self.job)
            await self.server.close()

    async def _closing_barrier(self, wait: float) -> None:
        """Every rank's arrival at the closing count, then (rank 0) every rank's at the closed count, within
        `wait` s; 1 s once a peer is known lost, also when the loss is seen during the barrier (a peer that died
        as this rank began to close never arrives: its survivors must not wait out the whole timeout). On an
        external store the rank whose arrival completes the closed count drops the job's keys; a store a rank
        hosts is pruned by that rank after its wait (Fabric.close), so the host never polls a pruned count."""
        assert self.store is not None
        store = self.store

        async def keys() -> None:  # counters: O(1) requests per rank
            await store.arrive(f"{self.job}/closing", self.size, timeout=wait)
            closed = await store.add(f"{self.job}/closed", 1)
            if self.server is not None:
                await self._wait_all_closed(wait)
            elif closed == self.size and self.store_external:  # every rank is past its last store request
                await store.prune(self.job)

        loop = asyncio.get_running_loop()
        body = asyncio.ensure_future(keys())
        deadline, bounded = loop.time() + wait, False
        try:
            while not body.done():
                if self.lost and not bounded:
                    deadline, bounded = min(deadline, loop.time() + 1.0), True
                left = deadline - loop.time()
                if left <= 0:
                    break
                await asyncio.wait({body}, timeout=min(0.05, left))
        finally:  # past the bound, or this close itself cancelled: no store request may outlive it
            body.cancel()
        with contextlib.suppress(HetcclError, OSError, TimeoutError, asyncio.CancelledError):
            await body

    async def _wait_all_closed(self, timeout: float) -> None:
        assert self.server is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key = f"{self.job}/closed"
        while self.server.data.get(key, 0) < self.size and loop.time() < deadline:
            await asyncio.sleep(0.002)
