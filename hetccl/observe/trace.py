"""HETCCL_TRACE: per-rank Chrome trace / Perfetto JSON ("traceEvents"), on one timeline across ranks.

File name: `%r` or `{rank}` in HETCCL_TRACE is replaced by the rank; otherwise the rank goes before a
`.json` suffix (trace.json -> trace.rank0.json) or is appended (.rank0). Open the files together in
https://ui.perfetto.dev or chrome://tracing: each rank is one process, named "rank N".

Events are complete events (ph "X", ts/dur in microseconds). A collective's span and the spans of its
transport operations sit on a "lane" (tid) that no other concurrent span uses, so spans on one lane nest;
pipelined chunks each take their own lane, and their sends/receives sit on the chunk's lane.

Clocks: every timestamp is this host's monotonic clock plus an offset to the rendezvous store's clock
(rank 0's, unless the store is external), measured once at init NTP-style over the store connection: 8
round trips of the store command `time`; the sample with the smallest round trip gives
offset = t_store - (t_send + t_recv) / 2, with an error of at most half that round trip (stored in
otherData.clock_error_us; on one host the offset is ~0 since the clock is shared).

Memory stays bounded: events are written out every 4096 events, and after HETCCL_TRACE_MAX_EVENTS
(default 1,000,000) further events are counted but dropped (a final "trace truncated" event says how many).
"""

from __future__ import annotations

import atexit
import heapq
import json
import os
import socket
import time
from typing import Any

from .. import params
from ..errors import ConfigError, HetcclError

FLUSH_EVERY = 4096
DEFAULT_MAX_EVENTS = 1_000_000


def trace_path(template: str, rank: int) -> str:
    if "%r" in template or "{rank}" in template:
        return template.replace("%r", str(rank)).replace("{rank}", str(rank))
    if template.endswith(".json"):
        return f"{template[:-5]}.rank{rank}.json"
    return f"{template}.rank{rank}"


def test_skew_ns(rank: int) -> int:
    """HETCCL_TEST_CLOCK_SKEW_US="0,5000000,...": a per-rank shift of this rank's clock, for tests that
    emulate hosts whose clocks disagree (the correction must remove it). Not for production use."""
    parts = params.get("HETCCL_TEST_CLOCK_SKEW_US")
    return int(float(parts[rank]) * 1000) if rank < len(parts) else 0


async def clock_offset(store: Any, samples: int = 8, skew_ns: int = 0) -> tuple[int, int | None]:
    """(offset_ns, error_ns) to add to a local clock reading (perf_counter_ns() + skew_ns) to get the
    store's clock; (0, None) if the store cannot tell."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        t0 = time.perf_counter_ns() + skew_ns
        try:
            ts = await store.time()
        except HetcclError:  # a store without the `time` command (an older external one)
            return 0, None
        t1 = time.perf_counter_ns() + skew_ns
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, ts - (t0 + t1) // 2)
    assert best is not None
    return best[1], best[0] // 2


class Tracer:
    def __init__(self, path: str, rank: int, offset_ns: int, err_ns: int | None, max_events: int, owner: Any,
                 meta: dict[str, Any]):
        self.path, self.rank, self.offset, self.owner = path, rank, offset_ns, owner
        self.max_events = max_events
        self.count = self.dropped = 0
        self.buf: list[dict[str, Any]] = []
        self._free: list[int] = []
        self._lanes = 0
        self._first = True
        try:
            self.f: Any = open(path, "w")
        except OSError as exc:
            raise ConfigError(f"HETCCL_TRACE: cannot write {path!r}: {exc}") from None
        other = dict(meta, rank=rank, clock_offset_us=(offset_ns - meta.get("test_clock_skew_us", 0) * 1000) / 1e3,
                     clock_error_us=None if err_ns is None else err_ns / 1e3,
                     clock="host monotonic + offset to the rendezvous store's clock (NTP-style at init)")
        self.f.write('{"displayTimeUnit": "ns", "otherData": ' + json.dumps(other) + ',\n"traceEvents": [\n')
        self._meta("process_name", {"name": f"rank {rank} ({meta.get('hostname', '?')}, "
                                            f"{meta.get('island', '?')})"})
        self._meta("process_sort_index", {"sort_index": rank})
        atexit.register(self.close)

    @classmethod
    def open(cls, template: str, fab: Any, offset_ns: int, err_ns: int | None) -> Tracer:
        max_events = params.get("HETCCL_TRACE_MAX_EVENTS")
        rec = fab.records[fab.rank] if fab.records else {}
        meta = {"hostname": rec.get("hostname", socket.gethostname()), "island": rec.get("island", "?"),
                "pid": os.getpid(), "world_size": fab.size, "job": fab.job,
                "peers": {str(p): t for p, t in sorted(fab.peer_transport.items())}}
        # the local clock is perf_counter_ns() (+ a test skew): fold the skew into the offset
        skew = test_skew_ns(fab.rank)
        if skew:
            meta["test_clock_skew_us"] = skew / 1e3
        return cls(trace_path(template, fab.rank), fab.rank, offset_ns + skew, err_ns, max(0, max_events), fab,
                   meta)

    # ---- lanes: a tid per concurrent span, reused lowest-first ------------------------------------------
    def lane(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._lanes += 1
        self._meta("thread_name", {"name": f"lane {self._lanes - 1}"}, tid=self._lanes - 1)
        return self._lanes - 1

    def release(self, lane: int) -> None:
        heapq.heappush(self._free, lane)

    # ---- events ------------------------------------------------------------------------------------------
    def us(self, t_ns: int) -> float:
        """A perf_counter_ns reading on the shared (store) timeline, in microseconds."""
        return (t_ns + self.offset) / 1e3

    def span(self, cat: str, name: str, t0: int, t1: int, lane: int, args: dict[str, Any]) -> None:
        self.emit({"ph": "X", "cat": cat, "name": name, "ts": self.us(t0), "dur": (t1 - t0) / 1e3,
                   "pid": self.rank, "tid": lane, "args": args})

    def instant(self, cat: str, name: str, args: dict[str, Any]) -> None:
        self.emit({"ph": "i", "s": "p", "cat": cat, "name": name, "ts": self.us(time.perf_counter_ns()),
                   "pid": self.rank, "tid": 0, "args": args})

    def _meta(self, name: str, args: dict[str, Any], tid: int = 0) -> None:
        self.buf.append({"ph": "M", "name": name, "pid": self.rank, "tid": tid, "args": args})

    def emit(self, ev: dict[str, Any]) -> None:
        if self.f is None:
            return
        if self.count >= self.max_events:
            self.dropped += 1
            return
        self.count += 1
        self.buf.append(ev)
        if len(self.buf) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.f is None or not self.buf:
            return
        text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in self.buf)
        self.f.write(text if self._first else ",\n" + text)
        self._first = False
        self.buf.clear()

    def close(self) -> None:
        if self.f is None:
            return
        if self.dropped:
            self.buf.append({"ph": "i", "s": "p", "name": "trace truncated", "pid": self.rank, "tid": 0,
                             "ts": self.us(time.perf_counter_ns()),
                             "args": {"dropped_events": self.dropped, "max_events": self.max_events}})
        self.flush()
        self.f.write("\n]}\n")
        self.f.close()
        self.f = None
        atexit.unregister(self.close)
