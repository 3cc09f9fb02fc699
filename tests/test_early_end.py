"""Ranks that end early, and waits that speak (issue 15, items 3 and 4), on real rank processes.

* A rank that issues one collective fewer and closes: its peers raise CollectiveMismatchError at once (the
  closer's goodbye names where it stopped), not PeerLostError after the closing barrier.
* A rank that finds a mismatch and exits at once: its notice was on the wire before the error reached it, so
  every other rank reports the mismatch, naming both ranks, not a lost peer.
* Nothing listening at HETCCL_ADDR, or a rank that never comes: a line on stderr while waiting, then the
  same final timeout error as before.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
from rankrun import ROOT, finish, ranks_report, run_ranks, spawn_ranks

TRANSPORTS = {"shm": {"HETCCL_TRANSPORTS": "shm,tcp"}, "tcp": {"HETCCL_TRANSPORTS": "tcp"}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n, delay", [(2, 0.0), (3, 0.0), (2, 1.0)])
def test_rank_that_closes_early_is_a_mismatch_at_once(n: int, delay: float, transport: str) -> None:
    proc = run_ranks(n, "workers:close_one_early", env=dict(TRANSPORTS[transport], HETCCL_TIMEOUT="30"),
                     issued=5, delay=delay, timeout=50)
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
    # the survivors' closing barrier would wait min(10 s, HETCCL_TIMEOUT) for rank 1, unless they see it gone
    procs = spawn_ranks(3, "workers:mismatch_then_exit", env=dict(TRANSPORTS[transport], HETCCL_TIMEOUT="30"),
                        kind=kind)
    results = finish(procs, 45)
    report = ranks_report(results)
    assert results[1][0] == 5, report
    for r in (0, 2):
        rc, out, _err = results[r]
        assert rc == 0 and "mismatch-exit ok" in out, report
        # both ranks of the disagreement are named: rank 1 and one of the others
        assert "rank 1" in out and re.search(r"rank [02]\b", out.split("ok rank", 1)[1][3:]), report
        closed = float(re.search(r"closed in ([\d.]+) s", out).group(1))  # type: ignore[union-attr]
        assert closed < 5.0, report  # 1 s once the loss is seen, not the 10 s barrier
def _silent_rank(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    code = "import hetccl; hetccl.init_sync()"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(60)
def test_waiting_for_the_store_speaks_then_times_out() -> None:
    """Nothing listens at HETCCL_ADDR: rank 1 says it is waiting for rank 0's store, then times out as before."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HETCCL_RANK="1", HETCCL_WORLD_SIZE="2", HETCCL_ADDR=f"127.0.0.1:{port}",
               HETCCL_TIMEOUT="4", HETCCL_WAIT_NOTICE="1,1", HETCCL_SECRET="x")
    t0 = time.monotonic()
    proc = _silent_rank(env, 40)
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stderr
    err = proc.stderr
    waits = re.findall(rf"hetccl: rank 1 waiting for rank 0's store at 127\.0\.0\.1:{port} \((\d+) s of 4\)", err)
    assert len(waits) >= 2, err
    assert "CollectiveTimeout" in err and "no rendezvous store" in err, err
    assert err.index("waiting for rank 0's store") < err.index("CollectiveTimeout"), err
    assert took < 30, took


@pytest.mark.timeout(60)
def test_waiting_for_missing_ranks_speaks() -> None:
    """3 of a 4-rank job start: each says which rank is missing, then all time out as before."""
    procs = spawn_ranks(4, "workers:still_works", env={"HETCCL_TIMEOUT": "4", "HETCCL_WAIT_NOTICE": "1,1"},
                        after="init")
    procs[2].kill()  # rank 2 never joins
    results = finish(procs, 40)
    report = ranks_report(results)
    for r in (0, 1, 3):
        rc, _out, err = results[r]
        assert rc != 0, report
        assert re.search(r"hetccl: rank \d: 3 of 4 ranks joined; missing: 2 \(\d+ s of 4\)", err), report
        # rank 0 times out as before; the others may see its store go away with it first
        final = "CollectiveTimeout" if r == 0 else ("CollectiveTimeout" if "CollectiveTimeout" in err
                                                    else "lost the rendezvous store")
        assert final in err and err.index("ranks joined") < err.index(final), report
