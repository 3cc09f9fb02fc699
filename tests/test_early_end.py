"""Ranks that end early, and waits that speak (issue 15, items 3 and 4), on real rank processes.

* A rank that issues one collective fewer and closes: its peers raise CollectiveMismatchError at once (the
  closer's goodbye names where it stopped), not PeerLostError after the closing barrier.
* A rank that finds a mismatch and exits at once: its notice was on the wire before the error reached it, so
  every other rank reports the mismatch, naming both ranks, not a lost peer.
* Nothing listening at HETCCL_ADDR, or a rank that never comes: a line on stderr while waiting, then the
  same final timeout error as before.
"""

from __future__ import annotations

import re

import pytest
from rankrun import finish, ranks_report, run_ranks, spawn_ranks

TRANSPORTS = {"shm": {"HETCCL_TRANSPORTS": "shm,tcp"}, "tcp": {"HETCCL_TRANSPORTS": "tcp"}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n", [2, 3])
def test_rank_that_closes_early_is_a_mismatch_at_once(n: int, transport: str) -> None:
    proc = run_ranks(n, "workers:close_one_early", env=dict(TRANSPORTS[transport], HETCCL_TIMEOUT="30"),
                     issued=5, timeout=50)
    lines = [ln for ln in proc.stdout.splitlines() if "closed-early ok" in ln]
    assert len(lines) == n - 1, proc.stdout + proc.stderr[-3000:]
    for ln in lines:
        assert "rank 1 closed after all_reduce #3" in ln and "all_reduce #4" in ln, ln
        took = float(re.search(r"\(([\d.]+) s\)", ln).group(1))  # type: ignore[union-attr]
        assert took < 3.0, ln  # at once, not after the peer's 10 s closing barrier
    assert proc.elapsed < 20, proc.elapsed  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("kind", ["count", "dtype", "op", "root", "collective", "order"])
def test_mismatch_reaches_every_rank_when_the_odd_rank_exits_at_once(kind: str, transport: str) -> None:
    # HETCCL_TIMEOUT bounds the survivors' closing barrier, which waits for the rank that exited
    procs = spawn_ranks(3, "workers:mismatch_then_exit", env=dict(TRANSPORTS[transport], HETCCL_TIMEOUT="6"),
                        kind=kind)
    results = finish(procs, 45)
    report = ranks_report(results)
    assert results[1][0] == 5, report
    for r in (0, 2):
        rc, out, _err = results[r]
        assert rc == 0 and "mismatch-exit ok" in out, report
        # both ranks of the disagreement are named: rank 1 and one of the others
        assert "rank 1" in out and re.search(r"rank [02]\b", out.split("ok rank", 1)[1][3:]), report
