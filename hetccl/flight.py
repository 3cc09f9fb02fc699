"""Flight recorder: each communicator's recent collectives, bounded, for mismatch and hang reports.

Every collective that runs through the scheduler is recorded when it starts and when it ends: its
fingerprint (operation, sequence number, dtype, count, root, reduce op), start and end times and state.
The recorder answers two questions cheaply: "has this rank already finished collective #seq?" (a frame that
arrives for a finished collective can never be consumed: the ranks disagree) and "what was this rank doing?"
(the hang report gathers every rank's recorder after a timeout). Size: HETCCL_FLIGHT_RECORDS (default 64).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from . import params
from .wire import Fingerprint

CAPACITY = params.get("HETCCL_FLIGHT_RECORDS")
RUNNING, DONE, FAILED = "running", "done", "failed"


class FlightRecorder:
    __slots__ = ("entries", "inflight")

    def __init__(self, capacity: int = CAPACITY):
        # entry: [fingerprint, start (monotonic), end or None, state]
        self.entries: deque[list[Any]] = deque(maxlen=max(capacity, 1))
        self.inflight: dict[int, list[Any]] = {}

    def begin(self, fp: Fingerprint) -> list[Any]:
        entry = [fp, time.monotonic(), None, RUNNING]
        self.entries.append(entry)
        self.inflight[fp.seq] = entry
        return entry

    def end(self, entry: list[Any], state: str) -> None:
        entry[2], entry[3] = time.monotonic(), state
        self.inflight.pop(entry[0].seq, None)

    def finished(self, seq: int) -> Fingerprint | None:
        """The fingerprint of collective #seq if this rank ran it to its end and still remembers it."""
        if seq in self.inflight:
            return None
        for entry in reversed(self.entries):
            if entry[0].seq == seq:
                return entry[0] if entry[3] != RUNNING else None
        return None

    def snapshot(self, now: float | None = None) -> list[dict[str, Any]]:
        """The records as msgpack-able dicts, oldest first; times in seconds before `now`."""
        now = time.monotonic() if now is None else now
        return [{"seq": fp.seq, "what": fp.describe(), "state": state, "started_s_ago": round(now - start, 3),
                 "took_s": None if end is None else round(end - start, 6)}
                for fp, start, end, state in self.entries]
