"""Observability: logging (HETCCL_DEBUG), tracing (HETCCL_TRACE) and metrics (HETCCL_METRICS_PORT).

The rest of hetccl calls in here through one-line hooks, each guarded by the module flag `ON`, so that with
all three off a collective pays one attribute load per hook and builds nothing:

- `bootstrap.Fabric.create` calls `setup(identity)` first (environment checks, the log handler),
  `_bootstrap` ends with `await on_init(fabric, bind)` (INFO summary line, clock offset, trace file,
  metrics server), and `Fabric.close` calls `on_close(fabric)` (the trace file is finished).
- `scheduler.run_collective` wraps the collective's body with `collective()` (one span, the DEBUG line,
  collective counters, latency histogram, error counter).
- `CollCtx.send`/`CollCtx.recv`, the one door through which algorithms reach `Endpoint.send`/`post_recv`,
  call `send()`/`recv()` (one span per transport operation, per-peer counters).
- `ring.py` wraps its per-chunk chains with `chunks()` (one span per chunk).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from .. import params

if TYPE_CHECKING:
    from ..bootstrap import Fabric
    from ..config import Identity
    from ..scheduler import CollCtx
    from ..wire import Fingerprint

log = logging.getLogger("hetccl")

ON = False  # any of tracing, metrics, DEBUG logging: the only thing the hot path looks at
TRACE: Any = None  # trace.Tracer while HETCCL_TRACE is on
METRICS: Any = None  # metrics.Metrics while HETCCL_METRICS_PORT is on
DEBUG = False  # one log line per collective

LANE: contextvars.ContextVar[int] = contextvars.ContextVar("hetccl_trace_lane", default=0)

_LEVELS = {"DEBUG": logging.DEBUG, "TRACE": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
           "WARNING": logging.WARNING, "ERROR": logging.ERROR}
_RANK = "?"


# ---- logging -----------------------------------------------------------------------------------------
class _Prefix(logging.Filter):
    """Adds `hetccl_prefix` = "hetccl host:pid:rank" (like NCCL's "host:pid:tid [rank]")."""

    host = socket.gethostname()

    def filter(self, record: logging.LogRecord) -> bool:
        record.hetccl_prefix = f"hetccl {self.host}:{os.getpid()}:{_RANK}"
        return True


def configure_logging(env: dict[str, str] | None = None) -> None:
    """HETCCL_DEBUG=WARN|INFO|DEBUG: set the "hetccl" logger's level and, when nothing else would print its
    records, a stderr handler with a `hetccl host:pid:rank` prefix. Never touches an application's own
    configuration: a "hetccl" logger with its own level or handlers is left alone, and where the root
    logger has handlers (the application set up logging) only the level is set and records flow there."""
    name = params.lookup("HETCCL_DEBUG", env)
    if not name:
        return
    level = _LEVELS[name]
    lg = logging.getLogger("hetccl")
    if getattr(lg, "_hetccl_configured", False) or lg.handlers or lg.level != logging.NOTSET:
        return
    lg._hetccl_configured = True  # type: ignore[attr-defined]
    lg.setLevel(level)
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(hetccl_prefix)s %(levelname)s %(message)s"))
        handler.addFilter(_Prefix())
        lg.addHandler(handler)


def setup(identity: Identity) -> None:
    """Before the bootstrap: check the observability environment (ConfigError before anything is sent)."""
    global _RANK
    _RANK = str(identity.rank)
    configure_logging()
    if params.get("HETCCL_METRICS_PORT") is not None:
        from .metrics import require_client

        require_client()
    params.get("HETCCL_TRACE")  # set but empty: ConfigError now, before anything is sent


def _refresh() -> None:
    global ON, DEBUG
    DEBUG = log.isEnabledFor(logging.DEBUG)
    ON = TRACE is not None or METRICS is not None or DEBUG


async def on_init(fab: Fabric, bind: str) -> None:
    """End of the bootstrap: INFO summary, then tracing and metrics if asked for."""
    global TRACE, METRICS
    if log.isEnabledFor(logging.INFO):
        log.info("%s", init_summary(fab))
    path = params.get("HETCCL_TRACE")
    if path and TRACE is None:
        from .trace import Tracer, clock_offset, test_skew_ns

        offset, err = await clock_offset(fab.store, skew_ns=test_skew_ns(fab.rank))
        TRACE = Tracer.open(path, fab, offset, err)
    port = params.get("HETCCL_METRICS_PORT")
    if port is not None and METRICS is None:
        from .metrics import Metrics

        METRICS = Metrics.start(fab, str(port), params.get("HETCCL_METRICS_ADDR") or bind)
    _refresh()


def on_close(fab: Fabric) -> None:
    """The fabric that opened the trace file / metrics server closes: finish the file, stop the server."""
    global TRACE, METRICS
    if TRACE is not None and TRACE.owner is fab:
        TRACE.close()
        TRACE = None
    if METRICS is not None and METRICS.owner is fab:
        METRICS.stop()
        METRICS = None
    _refresh()


def balance_shares(rank: int, shares: list[int], reason: str) -> None:
    """hetccl.torch.balance set new shares of the global batch: an instant in the trace, this rank's share and
    a count of changes by kind (the reason's first word) in the metrics."""
    if TRACE is not None:
        TRACE.instant("balance", "shares", {"shares": shares, "reason": reason})
    if METRICS is not None:
        METRICS.balance(shares[rank], reason.split(":")[0].split()[0])


# ---- what the cost model chooses -------------------------------------------------------------------------
def fmt_bytes(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n}B"


def chunk_span(chunks: tuple[int, int] | dict[str, int]) -> str:
    """'1M', or '1M-4M' where a ring's chunk grows with the block (Fabric.ring_chunk, or topo's world record)."""
    lo, hi = (chunks["chunk_bytes"], chunks["chunk_max_bytes"]) if isinstance(chunks, dict) else chunks
    return fmt_bytes(lo) if lo == hi else f"{fmt_bytes(lo)}-{fmt_bytes(hi)}"


def crossover_bytes(op: str, n: int, kind: Any) -> tuple[str, int | None, str | None]:
    """(choice for 1 byte, first size in bytes where `algorithms.choose` picks otherwise, that choice);
    (choice, None, None) when it never changes up to 1 TiB."""
    from .. import algorithms

    first = algorithms.choose(op, 1, n, kind, {})
    prev, size = 1, 2
    while size <= 1 << 40:
        if algorithms.choose(op, size, n, kind, {}) != first:
            lo, hi = prev, size  # choose(lo) == first != choose(hi): bisect the exact switch
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if algorithms.choose(op, mid, n, kind, {}) == first else (lo, mid)
            return first, hi, algorithms.choose(op, hi, n, kind, {})
        prev, size = size, size * 2
    return first, None, None


def crossover(op: str, n: int, kind: Any, override: dict[str, str]) -> str:
    """How the cost model picks for op on n ranks over `kind`, e.g. 'latency<1.9M<=ring'."""
    if op in override:
        return f"{override[op]} (HETCCL_ALGO)"
    if n <= 1:
        return "latency"
    first, at, other = crossover_bytes(op, n, kind)
    return f"{first} always" if at is None else f"{first}<{fmt_bytes(at)}<={other}"


def rank_ranges(ranks: list[int]) -> list[str]:
    """[0, 1, 2, 5, 7, 8] -> ['0-2', '5', '7-8']."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return out


def init_summary(fab: Fabric) -> str:
    """The INFO line of one rank: where it is, how it reaches each peer, what the cost model picks."""
    from .. import algorithms
    from ..config import island_label

    rank, size = fab.rank, fab.size
    rec = fab.records[rank] if fab.records else {}
    by: dict[str, list[int]] = {}
    for p, t in sorted(fab.peer_transport.items()):
        by.setdefault(t, []).append(p)
    peers = " ".join(f"{','.join(rank_ranges(ps))}:{t}" for t, ps in sorted(by.items())) or "none"
    kind = fab.transport_kind(list(range(size)))
    costs = fab.costs_of(kind)
    override = algorithms.parse_override(fab.settings.algo)
    algos = " ".join(f"{op}={crossover(op, size, costs, override)}" for op in algorithms.CHOOSABLE)
    return (f"init rank {rank}/{size} host {rec.get('hostname', socket.gethostname())} local "
            f"{fab.topology.local_rank(rank)}/{len(fab.topology.local_ranks(rank))} "
            f"island {rec.get('island', island_label())}; peers {peers}; "
            f"algorithms ({kind}, chunk {chunk_span(fab.ring_chunk(list(range(size))))}): {algos}")


# ---- hooks on the data path (only reached when ON) ----------------------------------------------------------
def coll_info(comm: Any, fp: Fingerprint) -> tuple[str, int, str, str]:
    """(op name, bytes, dtype name, algorithm) of a collective, from its fingerprint."""
    from .. import algorithms
    from ..dtypes import DType, dtype_name
    from ..wire import CollOp

    op = CollOp.NAMES.get(fp.op, str(fp.op))
    isz = DType(fp.dtype).itemsize if 0 <= fp.dtype <= 7 else 1
    dt = dtype_name(DType(fp.dtype)) if 0 <= fp.dtype <= 7 else "none"
    nbytes = fp.count * isz
    if fp.op in (CollOp.ALL_GATHER, CollOp.REDUCE_SCATTER, CollOp.GATHER, CollOp.SCATTER):
        nbytes *= comm.size
    fast = getattr(comm, "fast_takes", None)
    if fast is not None and fast(fp):
        algo = "fast"  # the shared-memory fast path (fastpath.py)
    elif op in algorithms.CHOOSABLE:
        algo = comm._algo(op, nbytes)  # cached: the same call the communicator made a moment ago
    elif fp.op == CollOp.SEND_RECV:
        algo = "p2p"
    elif fp.op == CollOp.BARRIER:
        algo = "latency"
    else:
        algo = "direct"
    return op, nbytes, dt, algo


def collective(comm: Any, fp: Fingerprint, body: Callable[[], Coroutine[Any, Any, Any]], rec: list[Any]
               ) -> Callable[[], Coroutine[Any, Any, Any]]:
    """Wrap run_collective's body: a span, the DEBUG line, counters; `rec[2]` says the watchdog fired."""

    async def observed() -> Any:
        tr = TRACE
        lane = token = None
        if tr is not None:
            lane = tr.lane()
            token = LANE.set(lane)
        t0 = time.perf_counter_ns()
        status = "ok"
        try:
            return await body()
        except asyncio.CancelledError:
            status = "CollectiveTimeout" if rec[2] else "Cancelled"
            raise
        except BaseException as exc:
            status = type(exc).__name__
            raise
        finally:
            t1 = time.perf_counter_ns()
            if token is not None:
                LANE.reset(token)
            _collective_done(comm, fp, t0, t1, status, tr, lane)

    return observed


def _collective_done(comm: Any, fp: Fingerprint, t0: int, t1: int, status: str, tr: Any, lane: int | None
                     ) -> None:
    op, nbytes, dt, algo = coll_info(comm, fp)
    if tr is not None and lane is not None:
        args = {"comm": fp.comm, "seq": fp.seq, "bytes": nbytes, "dtype": dt, "count": fp.count, "algo": algo,
                "size": comm.size, "status": status}
        if fp.root >= 0:
            args["root"] = fp.root
        tr.span("collective", op, t0, t1, lane, args)
        tr.release(lane)
    if METRICS is not None:
        METRICS.collective(op, algo, nbytes, (t1 - t0) / 1e9, status)
    if DEBUG:
        log.debug("rank %d: %s (%d B, %s) %s in %.1f us", comm.rank, fp.describe(), nbytes, algo,
                  status, (t1 - t0) / 1e3)


def chunks(ctx: CollCtx, coros: list[Coroutine[Any, Any, None]]) -> list[Coroutine[Any, Any, None]]:
    """One span per pipelined chunk chain (each on its own trace lane)."""
    tr = TRACE
    if tr is None:
        return coros
    return [_chunk(tr, ctx, c, len(coros), co) for c, co in enumerate(coros)]


async def _chunk(tr: Any, ctx: CollCtx, c: int, nch: int, coro: Awaitable[None]) -> None:
    lane = tr.lane()
    token = LANE.set(lane)
    t0 = time.perf_counter_ns()
    try:
        await coro
    finally:
        t1 = time.perf_counter_ns()
        LANE.reset(token)
        from ..wire import CollOp

        tr.span("chunk", f"chunk {c}", t0, t1, lane, {"comm": ctx.fp.comm, "seq": ctx.fp.seq, "chunk": c,
                                                      "nchunks": nch, "op": CollOp.NAMES.get(ctx.fp.op)})
        tr.release(lane)


def _peer_info(ctx: CollCtx, peer: int) -> tuple[int, str]:
    g = ctx.comm._members[peer]
    return g, ctx.comm._fabric.peer_transport.get(g, "?")


async def send(ctx: CollCtx, peer: int, tag: int, data: Any) -> None:
    t0 = time.perf_counter_ns()
    await ctx.eps[peer].send(ctx.fp, tag, data)
    _transport_done(ctx, "send", peer, tag, len(data), t0, time.perf_counter_ns(), None)


class _Recv:
    """A posted receive seen by the algorithm: records how long the algorithm waited for it."""

    __slots__ = ("inner", "ctx", "peer", "tag", "nbytes", "posted", "seen")

    def __init__(self, inner: Any, ctx: CollCtx, peer: int, tag: int, nbytes: int):
        self.inner, self.ctx, self.peer, self.tag, self.nbytes = inner, ctx, peer, tag, nbytes
        self.posted = time.perf_counter_ns()
        self.seen = False

    def done(self) -> bool:
        return self.inner.done()

    def __await__(self) -> Any:
        t0 = time.perf_counter_ns()
        blocked = not self.inner.done()
        result = yield from self.inner.__await__()
        if not self.seen:
            self.seen = True
            _transport_done(self.ctx, "recv", self.peer, self.tag, self.nbytes, t0, time.perf_counter_ns(),
                            {"posted_us_before": round((t0 - self.posted) / 1e3, 3), "blocked": blocked})
        return result


def recv(ctx: CollCtx, peer: int, tag: int, dst: Any, fn: Any) -> _Recv:
    return _Recv(ctx.eps[peer].post_recv(ctx.fp, tag, dst, fn), ctx, peer, tag, len(dst))


def _transport_done(ctx: CollCtx, what: str, peer: int, tag: int, nbytes: int, t0: int, t1: int,
                    extra: dict[str, Any] | None) -> None:
    from ..wire import CollOp

    g, transport = _peer_info(ctx, peer)
    op = CollOp.NAMES.get(ctx.fp.op, str(ctx.fp.op))
    tr = TRACE
    if tr is not None:
        args = {"peer": peer, "peer_rank": g, "transport": transport, "bytes": nbytes, "tag": hex(tag),
                "comm": ctx.fp.comm, "seq": ctx.fp.seq, "op": op}
        if extra:
            args.update(extra)
        tr.span("transport", what, t0, t1, LANE.get(), args)
    if METRICS is not None:
        METRICS.transport(op, transport, g, what, nbytes)
