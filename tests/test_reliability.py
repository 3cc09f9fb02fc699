"""Failures end in clear exceptions, never hangs: dead peers, missing and stuck ranks, strangers."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import time

import pytest
from rankrun import ROOT, assert_victim_named, finish, ranks_report, run_ranks, spawn_ranks

TRANSPORTS = {"shm": "shm,tcp", "tcp": "tcp"}


def _shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/hetccl-*"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n,victim", [(2, 1), (3, 0), (4, 2)])
def test_dead_peer_raises_peer_lost(n: int, victim: int, transport: str) -> None:
    """A rank exits hard between large all_reduces: every survivor raises PeerLostError naming it within
    10 s (checked inside the worker), and no shared-memory segment is left behind."""
    before = _shm_segments()
    procs = spawn_ranks(n, "workers:die_midway", env={"HETCCL_TRANSPORTS": TRANSPORTS[transport]}, victim=victim)
    assert_victim_named(finish(procs, 60), victim)
    assert _shm_segments() <= before, _shm_segments() - before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_dead_peer_mid_message(transport: str) -> None:
    """The sender dies after the first fragments of a 256 MiB message: the receive already under way fails at
    once with PeerLostError naming it (the deadline is 60 s, so only the loss can end it in time)."""
    procs = spawn_ranks(2, "workers:die_mid_message", victim=1,
                        env={"HETCCL_TRANSPORTS": TRANSPORTS[transport], "HETCCL_TIMEOUT": "60"})
    assert_victim_named(finish(procs, 40), 1)


@pytest.mark.timeout(60)
def test_missing_rank_times_out() -> None:
    """World size 2 but only rank 0 starts: init raises CollectiveTimeout after HETCCL_TIMEOUT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys, asyncio; sys.path.insert(0, 'tests'); import hetccl, workers;"
        "hetccl.run(workers.missing_rank())"
    )
    env = dict(os.environ, TEST_ADDR=f"127.0.0.1:{port}", HETCCL_SECRET="s")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "timeout ok" in out.stdout
    assert time.monotonic() - t0 < 30


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_stuck_peer_times_out(transport: str) -> None:
    """Rank 1 is alive but never joins the collective: rank 0 raises CollectiveTimeout naming the op."""
    proc = run_ranks(2, "workers:stuck_peer", env={"HETCCL_TIMEOUT": "3",
                                                    "HETCCL_TRANSPORTS": TRANSPORTS[transport]})
    assert "timeout ok" in proc.stdout
    assert "all_reduce" in proc.stdout


@pytest.mark.timeout(90)
def test_strangers_are_refused_and_job_goes_on() -> None:
    """Wrong-secret and no-secret connections to the store and to a data port are refused and logged."""
    proc = run_ranks(2, "workers:stranger", env={"HETCCL_TRANSPORTS": "tcp"})
    assert "refused" in proc.stdout
    assert "refused" in proc.stderr  # the warning log line


@pytest.mark.timeout(60)
def test_mismatched_secret_between_ranks_fails_clearly() -> None:
    """Two ranks with different secrets: the second cannot join and says why, the first times out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import hetccl, sys; r = int(sys.argv[1])\n"
            "async def main():\n"
            "    try:\n"
            "        c = await hetccl.init(rank=r, world_size=2, addr=sys.argv[2], timeout=4)\n"
            "    except hetccl.HetcclError as e:\n"
            "        print(type(e).__name__, e); return\n"
            "    print('joined')\n"
            "hetccl.run(main())\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), f"127.0.0.1:{port}"], cwd=ROOT,
                              env=dict(os.environ, HETCCL_SECRET=f"secret-{r}"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=40) for p in procs]
    assert "AuthenticationError" in outs[1][0], outs[1]
    assert "joined" not in outs[0][0] + outs[1][0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n,victim", [(3, 2), (3, 0), (4, 1)])
def test_shrink_after_a_loss(n: int, victim: int, transport: str) -> None:
    """Survivors shrink to a working communicator, even when rank 0 (the rendezvous store's host) died."""
    procs = spawn_ranks(n, "workers:shrink_after_loss", env={"HETCCL_TRANSPORTS": TRANSPORTS[transport]},
                        victim=victim)
    results = finish(procs, 90)
    report = ranks_report(results)
    for rank, (rc, out, _err) in enumerate(results):
        if rank == victim:
            assert rc == 17, report
        else:
            assert rc == 0 and "shrink ok" in out, report


@pytest.mark.timeout(60)
def test_abort_ends_collectives_in_flight() -> None:
    procs = spawn_ranks(2, "workers:abort_in_flight", env={"HETCCL_TIMEOUT": "30"})
    results = finish(procs, 40)
    report = ranks_report(results)
    assert all(rc == 0 for rc, _, _ in results), report
    assert "abort ok" in results[0][1], report


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("blocked", [False, True])
def test_hang_report_names_the_rank_behind(tmp_path, blocked: bool) -> None:
    """A timeout gathers every rank's flight records: the rank that never started the collective is named
    (behind, or silent when its event loop is blocked), in the error, the log and HETCCL_DUMP_DIR's JSON."""
    procs = spawn_ranks(3, "workers:hang_report", env={"HETCCL_TIMEOUT": "10", "HETCCL_DUMP_DIR": str(tmp_path)},
                        blocked=blocked)
    results = finish(procs, 60)
    report = ranks_report(results)
    assert all(rc == 0 for rc, _, _ in results), report
    assert sum("hang report ok" in out for _, out, _ in results) == 2, report
    assert "hetccl hang report" in results[0][2], report  # logged on stderr without any logging set up


@pytest.mark.timeout(60)
def test_listeners_bind_to_the_chosen_interface() -> None:
    proc = run_ranks(2, "workers:bound_to_interface", env={"HETCCL_SOCKET_IFNAME": "lo", "HETCCL_TRANSPORTS": "tcp"})
    assert proc.stdout.count("bound ok 127.0.0.1") == 2, proc.stdout
