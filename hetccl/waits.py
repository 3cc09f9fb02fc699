"""Waits that speak: a rank waiting to join (for rank 0's store, for ranks that have not arrived) prints one line
on stderr after a while, then one now and then, so a job that waits for 300 s is not silent for 300 s.

The intervals are Settings.wait_notice (HETCCL_WAIT_NOTICE, default 10 s then every 30 s). The final error of
the wait (CollectiveTimeout) is unchanged.
"""

from __future__ import annotations

import math
import os
import time

from .config import Settings


class WaitNotes:
    """The lines of one wait, timed from its start."""

    def __init__(self, settings: Settings):
        self.first, self.every = settings.wait_notice
        self.timeout = settings.timeout
        self.t0 = time.monotonic()
        self.next = self.t0 + self.first

    def until_next(self) -> float:
        """Seconds until the next line is due (inf when the lines are off)."""
        return max(0.0, self.next - time.monotonic())

    def say(self, text: str) -> bool:
        """Print `text` with how long this wait has lasted, if a line is due; True if it printed."""
        now = time.monotonic()
        if now < self.next:
            return False
        line = f"hetccl: {text} ({now - self.t0:.0f} s of {self.timeout:.0f})\n"
        try:
            os.write(2, line.encode())  # one write: the lines of ranks that share stderr do not interleave
        except OSError:
            pass
        self.next = now + self.every if math.isfinite(self.every) else math.inf
        return True


def rank_list(ranks: list[int], limit: int = 16) -> str:
    """'2', '2, 5, 7', or the first `limit` and how many more."""
    head = ", ".join(str(r) for r in ranks[:limit])
    return head + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")
