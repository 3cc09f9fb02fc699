"""The small-message fast path: host collectives of a group whose ranks all share this host's memory, in C.

A small collective on the transports costs tens of microseconds on its own: tagged frames through the
shared-memory rings, matching, futures, a doorbell system call to wake a sleeping peer, and the Python
around all of it. Here each rank of the group owns one small segment (two slots of HETCCL_SHM_FASTPATH_BYTES
each, `hccl_fast_*` in native/hetccl_native.c) that every other rank maps. Fast operation number k (counted
per group, the same on every rank) writes its fingerprint and data into slot k & 1 and publishes k + 1;
the peers spin briefly in C until every rank published k with the same fingerprint, then combine the slots
(the reduction in rank order, so every rank gets the same bits). Fast operations of a rank run one after
the other (later ones wait for the earlier), so two slots suffice: nobody overwrites a slot a peer may
still read. When every peer is already there, an operation never yields to the event loop.

A larger all_reduce of a group of at most PIECED_MAX_RANKS ranks runs here too, in pieces of
HETCCL_SHM_PIECE_BYTES, all in C (`hccl_fast_all_reduce_pieces`, up to PIECES_PER_CALL pieces per call from
Python). Each piece is two fast operations: a reduce-scatter (each rank copies into its slot the parts of the
piece that the others own) and an all-gather (each rank reduces its own part, from its buffer and the peers'
slots, into its buffer and its next slot, and then copies the peers' reduced parts from theirs). Every byte
then crosses between cores once each way and is reduced once, by one rank, so every rank gets the same bits.
At 64 MiB on 16 cores (benchmarks/results/shm-rs-pieces-2026-12-02.md) that is 1.15x and 1.2x the earlier
pieces (each rank reduced the whole piece) at np 2 and 3, and 1.8x the ring over the transports (which pays
Python per chunk) at np 4 and 8. A larger reduce_scatter and all_gather of such a group run here the same way,
one fast operation per piece (hccl_fast_reduce_scatter_pieces, hccl_fast_all_gather_pieces): a reduce_scatter's
slot holds the piece of each peer's block, which its owner reduces; an all_gather's, the piece of its input.

Where the kernel lets every rank copy to and from every other's process (cross-memory attach:
process_vm_readv/writev, the single copy of Open MPI's vader; tried towards each peer at set-up and agreed,
HETCCL_SHM_SINGLE_COPY), such an all_reduce is a single copy instead (all_reduce_single_copy): every rank posts
its buffer's address as one fast operation, reduces its part straight from the peers' buffers, COPY_CHUNK at a
time, writes the result into theirs (hccl_fast_all_reduce_cma), and a second fast operation says that every
rank is done with the others' buffers. No slot is written, and there are two synchronisations instead of two per
piece: at np 2, 64 MiB took 11.9-12.9 ms against the pieces' 15.5-17.2 on 2 cores, and 4 MiB 0.45 against
0.95 ms (benchmarks/results/shm-single-copy-2026-12-02.md). Since the peers write into this rank's memory, a rank that
leaves before the second operation (an error, the deadline) raises its abandoned word, which every peer reads
before each chunk, and waits until none is inside a chunk; the peers stop copying and raise what made it leave
(a lost peer, a mismatch), or the deadline's CollectiveTimeout: the cause, as every rank does.
reduce_scatter and all_gather have a single copy too, read only: each rank reads its block of the peers' inputs
(reduced through a chunk) or their whole inputs (_gather_single_copy); nothing is written into another process.

Guarantees, as on the transports:
- waits: after the short spin the waiter raises its waiting flag and sleeps in the event loop; a publisher
  that sees the flag sends one datagram to the sleeper's socket (spoofing one only costs a wake-up). The
  sleeper wakes at least every 20 ms to look for a lost peer or a poisoned communicator; the collective's
  deadline is the scheduler's watchdog (run_collective), so a timeout is a CollectiveTimeout naming the op.
- a lost peer (its transports' liveness: fabric.lost) ends the wait with its PeerLostError;
- a mismatch: the header of every slot carries the fingerprint (sequence number, op, dtype, count, root,
  reduce op); a collective that takes another path at a sequence number announces it in the segment, so a
  rank waiting there sees it too; the rank that sees it raises CollectiveMismatchError through the
  scheduler, which tells the others (every rank raises);
- the segments are unlinked as soon as every rank has mapped them (nothing left in /dev/shm after a crash),
  and at close.
Eligibility (decided the same way on every rank from the group and the call): a flat group of one island
whose ranks all reach each other through the shm transport, host buffers, each rank's part at most
HETCCL_SHM_FASTPATH_BYTES (0: off) or an all_reduce of at most PIECED_MAX_RANKS ranks, and no HETCCL_ALGO
(which names the host algorithm to run). With tracing, metrics or DEBUG logging on, every fast operation runs
under the scheduler, whose wrapper reports it (its algorithm reads "fast").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

from . import native, params
from . import observe as _obs
from .dtypes import _FAST as _NP_DTYPES
from .dtypes import DType, ReduceOp, parse_op
from .errors import HetcclError, PeerLostError
from .matching import mismatch_error
from .shmseg import Segment
from .wire import CollOp, Fingerprint

ffi, lib = native.ffi, native.lib
log = logging.getLogger("hetccl")
_from_buffer = ffi.from_buffer
_CHARS = "char[]"
DATA_OFF = 4096  # the data of a slot, after its header page
SAFETY_S = 0.02  # a sleeping waiter looks at lost peers and poisoned communicators at least this often
_OPS = {"sum": ReduceOp.SUM, "prod": ReduceOp.PROD, "min": ReduceOp.MIN, "max": ReduceOp.MAX, "avg": ReduceOp.AVG}
_ALL_REDUCE = int(CollOp.ALL_REDUCE)  # 1, as hccl_fast_all_reduce writes it
_FAST_OPS = (CollOp.ALL_REDUCE, CollOp.BROADCAST, CollOp.ALL_GATHER, CollOp.REDUCE_SCATTER, CollOp.BARRIER)
NOT_STARTED, POSTED = 0, 1  # how far FastPath.now got with an operation it did not end
PIECES_PER_CALL = 32  # the event loop runs between calls (doorbells, other collectives, lost peers)
# measured up to np 8 on 16 cores (shm-rs-pieces-2026-12-02.md): the pieces beat the ring at every np from 4 MiB
# (np 8, 64 MiB: 3.29 against 1.83 GB/s); past 8 the ring, unmeasured
PIECED_MAX_RANKS = 8
# the single-copy all_reduce (all_reduce_single_copy): header words of a segment after 0-4 (hccl_fast_word)
ABANDONED, BUSY, PID, BASE, COOKIE, PROBE = 5, 6, 7, 8, 9, 10
PROBE_NO, PROBE_YES = 1, 2
START, DONE = 0xFFFFFFFFFFFFFFFD, 0xFFFFFFFFFFFFFFFC  # w3 of its two fast operations (the pieces': -1, -2)
# bytes read from each peer, reduced and written back per step: 128-256 KiB took 9.5-10 ms for 64 MiB at np 2
# on 2 cores against 10.6 for 64 KiB and 14.5 for 1 MiB (the chunk, own and peers', stays in L2)
COPY_CHUNK = 256 << 10
COPY_CHUNKS_PER_CALL = 64  # 16 MiB of a part per call from Python: the event loop runs between calls
ABANDON_WAIT_NS = 2_000_000_000  # a peer in the middle of a chunk is out within microseconds; a stopped one is not


def limit_for(group: Any) -> int:
    """The fast path's byte limit for this group, or 0 when it cannot take the fast path."""
    limit = params.get("HETCCL_SHM_FASTPATH_BYTES")
    fab = group.fabric
    # HETCCL_ALGO names the host algorithm to run: the fast path, which is none of them, stays out of its way
    if not limit or group.size < 2 or not fab.topology.hosts or group._override:
        return 0
    # several islands: only CPU islands of one rank each, whose collectives are then all this group's own flat
    # ones (Communicator._across); elsewhere their steps run on other groups, or on devices
    if group._islands != 1 and not group.cpu_islands_of_one:
        return 0
    # ... and uncompressed: a compressed collective is the leaders' schedule (compress.py), which the fast path,
    # taken or not by each rank as it is idle or busy, must never meet
    if group._islands != 1 and group.settings.cross_compress != "none":
        return 0
    me = fab.rank
    # every rank reads all n parts, where a ring moves about two: past 4 ranks the ring's per-step cost is the
    # smaller one sooner (measured at np 2 and 4 on 2 cores: a 1 MiB limit beat 64 KiB at 256 KiB-1 MiB)
    limit = min(limit, 2 * limit // max(1, group.size - 2))
    if any(g != me and (fab.peer_transport.get(g) != "shm" or not fab.topology.same_host(me, g))
           for g in group.members):
        return 0
    return limit


def takes(group: Any, fp: Fingerprint) -> bool:
    """Whether collective fp of `group` ran on its fast path (the rule group.py applies: each rank's part, the
    input, at most the limit, and any all_reduce of at most PIECED_MAX_RANKS ranks): what observability reports
    as its algorithm."""
    fast = getattr(group, "_fast", None)
    if fast is None or fp.op not in _FAST_OPS:
        return False
    if fp.op in (CollOp.ALL_REDUCE, CollOp.ALL_GATHER, CollOp.REDUCE_SCATTER) and fast.pieces:
        return True  # above the limit: in pieces (FastPath.all_reduce_pieces, ...)
    isz = DType(fp.dtype).itemsize if 0 <= fp.dtype <= 7 else 1
    part = fp.count * isz * (group.size if fp.op == CollOp.REDUCE_SCATTER else 1)
    return part <= fast.limit


def _words(fp: Fingerprint) -> tuple[int, int, int, int]:
    return (fp.seq, fp.op | (fp.dtype << 8) | (fp.redop << 16), fp.count, fp.root & 0xFFFFFFFFFFFFFFFF)


def _fingerprint(comm: int, w: Any) -> Fingerprint:
    root = int(w[3])
    return Fingerprint(comm, int(w[0]), int(w[1]) & 0xFF, (int(w[1]) >> 8) & 0xFF, int(w[2]),
                       root - (1 << 64) if root >= 1 << 63 else root, (int(w[1]) >> 16) & 0xFF)


class FastPath:
    """One group's fast path on this rank (made by the group when limit_for allows it)."""

    def __init__(self, group: Any, limit: int):
        self.group = group
        self.fabric = group.fabric
        self.limit = limit
        self.n, self.me = group.size, group.rank
        self.pieces = self.n <= PIECED_MAX_RANKS  # an all_reduce above the limit runs here (all_reduce_pieces)
        self.piece_bytes = params.get("HETCCL_SHM_PIECE_BYTES")
        self.slot_bytes = max(limit, self.piece_bytes) if self.pieces else limit  # a slot holds a whole piece
        self.comm_id = group.comm_id
        self.k = 0  # the next fast operation's number
        self.tail: asyncio.Future[None] | None = None  # completion of the last operation that went async
        self.ready = False
        self.closed = False
        # spin 2 us, then poll between sched_yield calls for 100 us before sleeping: on a machine whose cores
        # are shared (with other jobs, or more ranks than cores) a rank that spins on takes the core its peer
        # needs, and a sleeper pays a scheduler wake-up. Measured on 2 shared cores (4 KiB all_reduce, np 2,
        # benchmarks/results/host-latency-2026-12-01.md): 30 us spin + 20 us yield gave 115-130 us under load,
        # this 29-45 us, and the same 7-9 us on a quiet machine.
        self.spin_ns, self.yield_ns = 2_000, 100_000
        fab = self.fabric
        self.segs_c = ffi.new("char *[]", self.n)
        self.segs: list[Segment | None] = [None] * self.n
        self.own_name = f"hetccl-{fab.job}-fast-{self.comm_id:x}-{fab.rank}"
        self.own: Segment | None = None
        self.sock: socket.socket | None = None
        self.addrs = [f"\0hetccl-{fab.job}-fastbell-{self.comm_id:x}-{g}" for g in group.members]
        self._wake: asyncio.Future[None] | None = None
        self._mask = ffi.new("uint64_t[1]")  # which peers sleep, from hccl_fast_all_reduce
        self._unlinked = False
        # the single copy: the pids and agreement at set-up (self.single_copy), and the chunk it reduces in (made then)
        self.single_copy = False
        self._probed = False
        self._pids = ffi.new("int64_t[]", self.n)
        self._chunk: Any = ffi.NULL

    # ---- set-up (the first fast operation, on every rank) --------------------------------------------
    def _create(self) -> None:
        size = lib.hccl_fast_seg_size(self.slot_bytes)
        Segment.unlink(self.own_name)  # a leftover of an earlier process with this job id: ours to replace
        seg = Segment(self.own_name, size, create=True, publish=False)
        self.own = seg
        self.segs[self.me] = seg
        self.segs_c[self.me] = seg.cbase
        lib.hccl_store_release(lib.hccl_fast_word(seg.cbase, 3), DATA_OFF + ((self.slot_bytes + 4095) & ~4095))
        # what a peer needs to try the single copy towards this process: its pid, and a cookie at a known address
        lib.hccl_store_release(lib.hccl_fast_word(seg.cbase, PID), os.getpid())
        lib.hccl_store_release(lib.hccl_fast_word(seg.cbase, BASE), int(ffi.cast("uintptr_t", seg.cbase)))
        lib.hccl_store_release(lib.hccl_fast_word(seg.cbase, COOKIE), secrets.randbits(64) | 1)
        seg.publish()  # under its name only now, laid out: a peer that opens it reads every word above
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(self.addrs[self.me])
        self.sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._on_bell)

    async def _setup(self) -> None:
        """Idempotent: a set-up cut short (a timeout) goes on where it stopped at the next fast operation."""
        if self.own is None:
            self._create()
        size = lib.hccl_fast_seg_size(self.slot_bytes)
        prefix = self.own_name.rsplit("-", 1)[0]
        members = self.group.members
        for r in range(self.n):
            if r == self.me or self.segs[r] is not None:
                continue
            # no deadline of its own: the scheduler's watchdog is this operation's (a CollectiveTimeout naming it)
            seg = await Segment.opened(f"{prefix}-{members[r]}", size, math.inf,
                                       f"rank {members[r]}'s fast-path segment", check=self._check_peers)
            self.segs[r] = seg
            self.segs_c[r] = seg.cbase
            lib.hccl_fetch_add(lib.hccl_fast_word(seg.cbase, 0), 1)
        mapped = lib.hccl_fast_word(self.own.cbase, 0)  # type: ignore[union-attr]
        while lib.hccl_load_acquire(mapped) < self.n - 1:
            self._check_peers()
            await asyncio.sleep(0.001)
        if not self._unlinked:
            Segment.unlink(self.own_name)  # every rank has it mapped: nothing can leak from here on
            self._unlinked = True
        if self.pieces:
            await self._agree_single_copy()
        self.ready = True

    async def _agree_single_copy(self) -> None:
        """Try cross-memory attach towards every peer, publish the answer, and take the single copy when every
        rank could reach every other (the same answer on every rank)."""
        segs = self.segs_c
        for r in range(self.n):
            self._pids[r] = lib.hccl_load_acquire(lib.hccl_fast_word(segs[r], PID))
        if not self._probed:
            refused = [] if params.get("HETCCL_SHM_SINGLE_COPY") else None
            for r in range(self.n):
                if refused is None or r == self.me:
                    continue
                base = lib.hccl_load_acquire(lib.hccl_fast_word(segs[r], BASE))
                if not lib.hccl_cma_probe(self._pids[r], base + 64 * COOKIE,
                                          lib.hccl_load_acquire(lib.hccl_fast_word(segs[r], COOKIE))):
                    refused.append(self.group.members[r])
            if refused:
                log.info("rank %d: the kernel refused cross-memory attach to rank(s) %s (Yama ptrace_scope, seccomp, "
                         "another user or pid namespace): large all_reduces of this group run in pieces",
                         self.fabric.rank, refused)
            ok = refused is not None and not refused
            lib.hccl_store_release(lib.hccl_fast_word(segs[self.me], PROBE), PROBE_YES if ok else PROBE_NO)
            self._probed = True
        answers = [lib.hccl_fast_word(segs[r], PROBE) for r in range(self.n)]
        while not all(lib.hccl_load_acquire(a) for a in answers):
            self._check_peers()
            await asyncio.sleep(0.001)
        self.single_copy = all(lib.hccl_load_acquire(a) == PROBE_YES for a in answers)
        if self.single_copy and self._chunk == ffi.NULL:
            self._chunk = ffi.new("char[]", COPY_CHUNK)

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.own is not None and not self._unlinked:
            Segment.unlink(self.own_name)
            self._unlinked = True
        self.ready = False
        self.closed = True
        for r, seg in enumerate(self.segs):  # each mapping holds a file descriptor: let go of them now
            if seg is not None:
                self.segs_c[r] = ffi.NULL
                seg.close()
        self.segs = [None] * self.n
        self.own = None

    # ---- waking ---------------------------------------------------------------------------------------
    def _on_bell(self) -> None:
        sock = self.sock
        if sock is None:
            return
        with contextlib.suppress(OSError):
            while sock.recv(64):
                pass
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    def _ring(self, mask: int) -> None:
        sock = self.sock
        for r in range(self.n):
            if mask >> min(r, 63) & 1 and r != self.me:
                with contextlib.suppress(OSError):
                    sock.sendto(b"\x01", self.addrs[r])  # type: ignore[union-attr]

    def _check_peers(self) -> None:
        """Raise what ended the group: a lost member, a poisoned communicator."""
        fab = self.fabric
        if fab.lost:
            for g in self.group.members:
                exc = fab.lost.get(g)
                if exc is not None:
                    raise exc
        poisoned = fab.poisoned.get(self.comm_id)
        if poisoned is not None:
            raise poisoned
        if self.closed:
            raise HetcclError("communicator is closed; create a new one with hetccl.init()")

    def _mismatch(self, fp: Fingerprint, k: int, r: int) -> BaseException:
        seg = self.segs_c[r]
        if lib.hccl_load_acquire(lib.hccl_fast_word(seg, 2)) >= k + 1:
            w = ffi.cast("uint64_t *", lib.hccl_fast_slot(seg, k))
        else:
            w = lib.hccl_fast_announce_entry(seg, fp.seq)
        return mismatch_error(self.me, r, fp, _fingerprint(fp.comm, [w[0], w[1], w[2], w[3]]))

    # ---- one operation ----------------------------------------------------------------------------------
    def _post(self, fp: Fingerprint, k: int, src: Any, nbytes: int, w3: int | None = None) -> None:
        """Publish operation k with fp's words (w3: the single copy's START or DONE in place of the root)."""
        w = _words(fp)
        mask = lib.hccl_fast_post(self.segs_c, self.n, self.me, k, w[0], w[1], w[2], w[3] if w3 is None else w3,
                                  _from_buffer(_CHARS, src) if nbytes else ffi.NULL, nbytes)
        if mask:
            self._ring(mask)

    def now(self, fp: Fingerprint, src: Any, nbytes: int, loop: asyncio.AbstractEventLoop | None = None) -> Any:
        """Start operation fp synchronously (called right after the group numbered it). Returns its number k
        when every rank published it with the same fingerprint within the spin: combine, and that is all.
        Otherwise a tuple (POSTED or NOT_STARTED, k, prev, mine) for `finish`, which the caller runs under the
        scheduler. `loop` given: called from another thread, with nothing of the group in flight on `loop`."""
        k = self.k
        self.k = k + 1
        prev = self.tail
        fab = self.fabric
        # observed (trace, metrics, DEBUG): through the scheduler like every collective, whose wrapper reports it
        if self.ready and (prev is None or prev.done()) and not fab.poisoned and not fab.departed and not _obs.ON:
            segs = self.segs_c
            mask = lib.hccl_fast_post(segs, self.n, self.me, k, fp.seq, fp.op | (fp.dtype << 8) | (fp.redop << 16),
                                      fp.count, fp.root & 0xFFFFFFFFFFFFFFFF,
                                      _from_buffer(_CHARS, src) if nbytes else ffi.NULL, nbytes)
            if mask:
                self._ring(mask)
            if lib.hccl_fast_wait(segs, self.n, self.me, k, self.spin_ns, self.yield_ns) == -1:
                return k
            state = POSTED
        else:
            state = NOT_STARTED
        mine = self.tail = (loop or asyncio.get_running_loop()).create_future()
        return state, k, prev, mine

    async def all_reduce_pieces(self, fp: Fingerprint, data: np.ndarray, count: int, dtype: DType,
                                op: ReduceOp) -> None:
        """An all_reduce above the limit, in place: two fast operations per piece of piece_bytes, in C (every
        rank cuts the same pieces and parts from the same count), or the single copy where every rank agreed to
        it at set-up."""
        piece = max(1, self.piece_bytes // dtype.itemsize)
        buf = _from_buffer(_CHARS, data, True)

        def step(k0: int, state: Any) -> int:
            return lib.hccl_fast_all_reduce_pieces(self.segs_c, self.n, self.me, k0, fp.seq, count, buf, dtype, op,
                                                   piece, PIECES_PER_CALL, self.spin_ns, self.yield_ns, self._mask,
                                                   state)

        def single_copy(k0: int) -> Any:  # uses k0 and k0 + 1 of the numbers taken
            return self._all_reduce_single_copy(fp, buf, count, dtype, op, k0) if self.single_copy else None

        await self._in_pieces(fp, 2 * -(-count // piece), step, single_copy)  # a reduce-scatter, an all-gather

    async def reduce_scatter_pieces(self, fp: Fingerprint, inp: np.ndarray, out: np.ndarray, count: int,
                                    dtype: DType, op: ReduceOp) -> None:
        """A reduce_scatter above the limit (count: each rank's block): one fast operation per piece of every
        block, a slot holding the piece of each of the n blocks; or the single copy (_gather_single_copy)."""
        piece = max(1, self.piece_bytes // (dtype.itemsize * self.n))
        src, dst = _from_buffer(_CHARS, inp, False), _from_buffer(_CHARS, out, True)

        def step(k0: int, state: Any) -> int:
            return lib.hccl_fast_reduce_scatter_pieces(self.segs_c, self.n, self.me, k0, fp.seq, count, src, dst,
                                                       dtype, op, piece, PIECES_PER_CALL, self.spin_ns,
                                                       self.yield_ns, self._mask, state)

        def single_copy(k0: int) -> Any:
            return self._gather_single_copy(fp, k0, src, dst, count, dtype, op, True) if self.single_copy else None

        await self._in_pieces(fp, -(-count // piece), step, single_copy)

    async def all_gather_pieces(self, fp: Fingerprint, inp: np.ndarray, out: np.ndarray, count: int,
                                dtype: DType) -> None:
        """An all_gather above the limit (count: each rank's input; its own block of out is the caller's): one
        fast operation per piece of piece_bytes of every rank's input; or the single copy (_gather_single_copy)."""
        piece = max(1, self.piece_bytes // dtype.itemsize)
        src, dst = _from_buffer(_CHARS, inp, False), _from_buffer(_CHARS, out, True)

        def step(k0: int, state: Any) -> int:
            return lib.hccl_fast_all_gather_pieces(self.segs_c, self.n, self.me, k0, fp.seq, count, src, dst, dtype,
                                                   piece, PIECES_PER_CALL, self.spin_ns, self.yield_ns, self._mask,
                                                   state)

        def single_copy(k0: int) -> Any:
            return self._gather_single_copy(fp, k0, src, dst, count, dtype, ReduceOp.SUM, False) \
                if self.single_copy else None

        await self._in_pieces(fp, -(-count // piece), step, single_copy)

    async def _in_pieces(self, fp: Fingerprint, ops: int, step: Callable[[int, Any], int],
                         instead: Callable[[int], Any] | None = None) -> None:
        """Fast operations self.k .. self.k + ops - 1, run by step(k0, state) (an hccl_fast_*_pieces call, a few
        pieces at a time, the event loop running between calls); `instead(k0)`, once set up, may give a coroutine
        that runs them otherwise, using the first two. Under the scheduler (deadline, failures), after the fast
        operations before.
        The numbers taken are even: a rank may post operation k + 2 into the slot of k only once every peer has
        read it, which its wait for k + 1 tells; so a run that leaves numbers unused (the single copy) must leave
        the next operation the parity of its first, and an odd run of pieces ends with an empty operation."""
        k0 = self.k
        self.k = k0 + ops + (ops & 1)
        prev = self.tail
        mine = self.tail = asyncio.get_running_loop().create_future()
        try:
            await self._start_after(prev)
            other = instead(k0) if instead is not None else None
            if other is not None:
                return await other
            state = ffi.new("uint64_t[1]")
            while True:
                r = step(k0, state)
                if r == -1:
                    break
                k = k0 + (state[0] >> 1)
                if r == -5:
                    self._check_peers()
                    await asyncio.sleep(0)
                elif r == -3:
                    self._ring(self._mask[0])
                elif r == -2:
                    await self._wait(fp, k)
                elif r >= 0:
                    raise self._mismatch(fp, k, r)
                else:
                    raise HetcclError(f"native {fp.describe()} refused its dtype or reduce op")
            if ops & 1:
                self._post(fp, k0 + ops, None, 0, DONE)
                await self._wait(fp, k0 + ops)
        finally:
            if not mine.done():
                mine.set_result(None)

    async def _all_reduce_single_copy(self, fp: Fingerprint, buf: Any, count: int, dtype: DType, op: ReduceOp,
                                      k: int) -> None:
        """Fast operation k: every rank posts its buffer's address; then each reduces its part straight from the
        peers' buffers and writes it into theirs (hccl_fast_all_reduce_cma); operation k + 1: every rank is done
        with the others' buffers, so none is read or written after the return. A rank that leaves in between
        (an error, the deadline) raises its abandoned word and waits until no peer writes into its buffer."""
        segs, n, me = self.segs_c, self.n, self.me
        self._post(fp, k, np.array([int(ffi.cast("uintptr_t", buf))], np.uint64), 8, START)
        try:
            await self._wait(fp, k)
            addrs = self._posted_addresses(k)
            state, bad, err = ffi.new("uint64_t[1]"), ffi.new("int[1]"), ffi.new("int[1]")
            while True:
                r = lib.hccl_fast_all_reduce_cma(segs, n, me, k, self._pids, addrs, count, buf, dtype, op,
                                                 self._chunk, COPY_CHUNK, COPY_CHUNKS_PER_CALL, state, bad, err)
                if r == -1:
                    break
                if r == -5:
                    self._check_peers()
                    await asyncio.sleep(0)
                    continue
                if r == -6:
                    self._check_peers()
                    await self._wait_for_cause(fp, self.group.members[bad[0]])  # never returns: it raises the cause
                raise self._copy_failed(fp, r, bad[0], err[0])
            self._post(fp, k + 1, None, 0, DONE)
            await self._wait(fp, k + 1)
        except BaseException:
            # the peers may still write our buffer: none does once this returns, unless one is stuck in a chunk
            if not self.closed:  # closed: close() unmapped the segments, there is no word to raise
                q = lib.hccl_fast_abandon(segs, n, me, k, self._pids, ABANDON_WAIT_NS)
                if q >= 0:
                    log.warning("rank %d: rank %d was still inside a chunk of %s %.0f s after this rank left it: "
                                "it may yet write into this rank's buffer", self.fabric.rank, self.group.members[q],
                                fp.describe(), ABANDON_WAIT_NS / 1e9)
            raise

    async def _gather_single_copy(self, fp: Fingerprint, k: int, src: Any, dst: Any, count: int, dtype: DType,
                                  op: ReduceOp, reduce: bool) -> None:
        """Fast operation k: every rank posts its input's address; then each reads what it needs straight from
        the peers' inputs (hccl_fast_gather_cma: its block of each, reduced, or each whole input); operation
        k + 1: every rank is done reading, so no input is read after the return. Nothing is written into
        another process: a rank that leaves early only leaves the others to fail at k + 1."""
        n, me = self.n, self.me
        self._post(fp, k, np.array([int(ffi.cast("uintptr_t", src))], np.uint64), 8, START)
        await self._wait(fp, k)
        addrs = self._posted_addresses(k)
        state, bad, err = ffi.new("uint64_t[1]"), ffi.new("int[1]"), ffi.new("int[1]")
        while True:
            r = lib.hccl_fast_gather_cma(n, me, self._pids, addrs, count, src, dst, dtype, op, int(reduce),
                                         self._chunk, COPY_CHUNK, COPY_CHUNKS_PER_CALL, state, bad, err)
            if r == -1:
                break
            if r != -5:
                raise self._copy_failed(fp, r, bad[0], err[0])
            self._check_peers()
            await asyncio.sleep(0)
        self._post(fp, k + 1, None, 0, DONE)
        await self._wait(fp, k + 1)

    def _posted_addresses(self, k: int) -> Any:
        """The buffer address every rank posted as fast operation k (a single copy's first)."""
        addrs = ffi.new("uint64_t[]", self.n)
        for q in range(self.n):
            addrs[q] = ffi.cast("uint64_t *", lib.hccl_fast_slot(self.segs_c[q], k) + DATA_OFF)[0]
        return addrs

    def _copy_failed(self, fp: Fingerprint, r: int, bad: int, err: int) -> Exception:
        """The error of a single copy's native call that returned r (-7: copying with rank `bad` (group rank)
        failed with errno err): a lost peer (the kernel's ESRCH) is named as such."""
        self._check_peers()
        q = self.group.members[bad]
        if r == -7 and err == errno.ESRCH:
            lost = PeerLostError(f"rank {self.fabric.rank}: rank {q}'s process ended during {fp.describe()} "
                                 "(its buffer went with it)", q)
            self.fabric.report_lost(q, lost)
            return lost
        if r == -7:
            return HetcclError(f"rank {self.fabric.rank}: {fp.describe()}: the kernel refused to copy to or from "
                               f"rank {q} ({os.strerror(err)}); set HETCCL_SHM_SINGLE_COPY=0 to go through the "
                               "shared segment instead")
        return HetcclError(f"native {fp.describe()} refused its dtype or reduce op")

    async def _wait_for_cause(self, fp: Fingerprint, q: int) -> None:
        """Rank q left the single copy (nothing more is written into its buffer): what made it leave ends this
        rank's wait too, and is what it raises, as every rank does (a lost peer, a mismatch; else the deadline's
        CollectiveTimeout), rather than the mere fact that q left."""
        log.warning("rank %d: rank %d left %s before it ended; this rank waits for the cause (a lost peer, a "
                    "mismatch) or the deadline", self.fabric.rank, q, fp.describe())
        while True:
            self._check_peers()
            await asyncio.sleep(SAFETY_S)

    def try_all_reduce(self, group: Any, arr: Any, op: Any, loop: asyncio.AbstractEventLoop | None = None) -> Any:
        """The facade's shortcut for an all_reduce of a plain numpy array (the torch backend's and most
        callers'): every check and the whole operation in one call, without the Buf and the fingerprint the
        general route builds. False: not for this path (nothing was taken; go the general route). True: done.
        Otherwise an awaitable that ends it on `loop` (the peers were not all there within the spin). `loop`
        given: called from another thread while nothing of `group` is in flight on that loop (sync.py)."""
        dt = _NP_DTYPES.get(arr.dtype)
        nbytes = arr.nbytes
        if dt is None or nbytes > self.limit or not nbytes:
            return False
        flags = arr.flags
        if not flags.c_contiguous or not flags.writeable:
            return False
        rop = _OPS.get(op) if type(op) is str else op
        if type(rop) is not ReduceOp:
            rop = parse_op(op)
        prev = self.tail
        fab = self.fabric
        if not self.ready or (prev is not None and not prev.done()) or fab.poisoned or fab.departed \
                or group._closed or group._aborted is not None or _obs.ON:
            return False
        seq = group._seq
        group._seq = (seq + 1) & 0xFFFFFFFF
        k = self.k
        self.k = k + 1
        count = arr.size
        r = lib.hccl_fast_all_reduce(self.segs_c, self.n, self.me, k, seq, count, _from_buffer(_CHARS, arr, True),
                                     dt, rop, self.spin_ns, self.yield_ns, self._mask)
        if r == -1:
            return True
        if r == -4:
            raise HetcclError(f"native reduce refused dtype {dt!r} op {rop!r}")
        if r == -3:  # posted; some peers sleep: wake them, then wait as any operation that went async does
            self._ring(self._mask[0])
        fp = Fingerprint(self.comm_id, seq, _ALL_REDUCE, int(dt), count, -1, int(rop))
        mine = self.tail = (loop or asyncio.get_running_loop()).create_future()
        return self._all_reduce_rest(group, fp, arr, (POSTED, k, prev, mine))

    async def _all_reduce_rest(self, group: Any, fp: Fingerprint, arr: Any, started: Any) -> None:
        data = arr.reshape(-1).view(np.uint8)
        k = await group._fast_finish(fp, data, fp.count * arr.itemsize, started)
        self.reduce(k, data, 0, fp.count, DType(fp.dtype), ReduceOp(fp.redop))

    async def finish(self, fp: Fingerprint, src: Any, nbytes: int, started: tuple[int, int, Any, Any]) -> int:
        """The rest of an operation `now` did not end: wait for the fast operations before it, set up (the
        first one), post, wait for every rank. Returns the operation's number."""
        state, k, prev, mine = started
        try:
            if state == NOT_STARTED:
                await self._start_after(prev)
                self._post(fp, k, src, nbytes)
            await self._wait(fp, k)
        finally:
            if mine is not None and not mine.done():
                mine.set_result(None)
        return k

    async def _start_after(self, prev: asyncio.Future[None] | None) -> None:
        """Before an operation that `now` did not start: the fast operations before it end, nothing ended the
        group, and the segments are set up (the first operation)."""
        if prev is not None and not prev.done():
            await asyncio.shield(prev)
        self._check_peers()
        if not self.ready:
            await self._setup()

    async def _wait(self, fp: Fingerprint, k: int) -> None:
        segs, n, me = self.segs_c, self.n, self.me
        loop = asyncio.get_running_loop()
        waiting = lib.hccl_fast_word(segs[me], 1)
        r = lib.hccl_fast_wait(segs, n, me, k, self.spin_ns, self.yield_ns)
        while r != -1:
            if r >= 0:
                raise self._mismatch(fp, k, r)
            self._check_peers()
            await asyncio.sleep(0)  # let the loop run (other collectives, doorbells) before sleeping
            r = lib.hccl_fast_wait(segs, n, me, k, 0, 0)
            if r != -2:
                continue
            lib.hccl_store_release(waiting, 1)
            lib.hccl_fetch_add(waiting, 0)  # full fence before the re-check (pairs with hccl_fast_post)
            r = lib.hccl_fast_wait(segs, n, me, k, 0, 0)
            if r == -2:
                fut = self._wake = loop.create_future()
                handle = loop.call_later(SAFETY_S, lambda f=fut: f.done() or f.set_result(None))
                try:
                    await fut
                finally:
                    handle.cancel()
                    self._wake = None
                    lib.hccl_store_release(waiting, 0)
                r = lib.hccl_fast_wait(segs, n, me, k, self.spin_ns, 0)
            else:
                lib.hccl_store_release(waiting, 0)

    # ---- combining (every rank published operation k) ----------------------------------------------------
    def reduce(self, k: int, dst: np.ndarray, offset: int, count: int, dtype: DType, op: ReduceOp) -> None:
        if count and lib.hccl_fast_reduce(_from_buffer(_CHARS, dst, True), self.segs_c, self.n, k, offset, count,
                                          dtype, 0 if op == ReduceOp.AVG else op):
            raise HetcclError(f"native reduce refused dtype {dtype!r} op {op!r}")
        if op == ReduceOp.AVG:
            native.divide(dst, dtype, self.n)

    def copy_from(self, k: int, r: int, dst: np.ndarray, nbytes: int) -> None:
        if nbytes:
            lib.hccl_copy(_from_buffer(_CHARS, dst, True), lib.hccl_fast_slot(self.segs_c[r], k) + DATA_OFF, nbytes)

    def announce(self, fp: Fingerprint) -> None:
        """This rank runs collective fp off the fast path: a peer waiting at that number must see it."""
        lib.hccl_fast_announce(self.segs_c[self.me], *_words(fp))
