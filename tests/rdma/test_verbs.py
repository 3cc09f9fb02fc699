"""The verbs transport on real (soft-RoCE) RDMA devices. Runs INSIDE the test-bed guest: the host suite
starts it through tests/rdma-testbed/run-in-guest (tests/test_rdma_guest.py) with two devices joined by a veth
pair (`--net veth`, ranks alternate devices), and also with one rxe device (`--net dummy`) when
HETCCL_RDMA_GUEST_NETS=dummy,veth.

Every rank process is real (launched by `hetccl run`), HETCCL_TRANSPORTS=verbs forces the transport, and
each worker checks its own results against numpy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rankrun import assert_victim_named, finish, run_ranks, spawn_ranks

HERE = Path(__file__).resolve().parent


def verbs_env(**extra: str) -> dict[str, str]:
    env = {
        "HETCCL_TRANSPORTS": "verbs",
        "HETCCL_TIMEOUT": "120",  # emulated CPU (TCG): generous deadlines
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
    }
    if os.environ.get("RDMA_TESTBED_DEV2"):  # --net veth: ranks alternate between the two devices
        env["HETCCL_IB_DEVICE"] = f"{os.environ['RDMA_TESTBED_DEV']},{os.environ['RDMA_TESTBED_DEV2']}"
    env.update(extra)
    return env


# The guest runs under emulation (TCG in CI: 4-5x this machine's time), so each case here pays for itself: 4 ranks
# where pairs on one device matter (collectives, a dead peer), 2 ranks elsewhere (each pair across the two devices).
@pytest.mark.timeout(600)
def test_every_collective() -> None:
    """all_reduce (every op), reduce, reduce_scatter, all_gather, broadcast, all_to_all, gather, scatter,
    barrier at 4 ranks (pairs on one device and across), an integer and a float dtype and counts (0, 1, odd,
    several fragments), checked against numpy."""
    run_ranks(4, "workers:matrix", env=verbs_env(), timeout=560, counts=[0, 1, 7, 40_000],
              dtypes=["int32", "bfloat16"])


@pytest.mark.timeout(300)
def test_point_to_point() -> None:
    """send/recv around a ring (0 B .. 2.4 MB) and several messages in flight per pair, matched in order."""
    run_ranks(2, "workers:p2p", env=verbs_env(), timeout=280)


@pytest.mark.timeout(300)
def test_large_messages_and_flow_control() -> None:
    """Messages much larger than the receive ring (credits run out and return), zero-copy sends from
    registered user memory, a receive posted late (early buffer), and a check that verbs carries it all."""
    proc = run_ranks(2, "verbs_workers:big", env=verbs_env(), timeout=280)
    assert proc.stdout.count("verbs on rxe") == 2, proc.stdout
    if os.environ.get("RDMA_TESTBED_DEV2"):
        assert "verbs on rxe1" in proc.stdout and "verbs on rxe0" in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_many_collectives_in_flight() -> None:
    run_ranks(2, "workers:concurrent", env=verbs_env(), timeout=280)


@pytest.mark.timeout(300)
def test_dead_peer_raises_peer_lost() -> None:
    """kill -9 equivalent (os._exit) of rank 2 of 4 between all_reduces: every survivor raises PeerLostError
    naming it, no hang."""
    procs = spawn_ranks(4, "verbs_workers:die_midway", env=verbs_env(), victim=2)
    assert_victim_named(finish(procs, 240), 2)


@pytest.mark.timeout(300)
def test_strangers_are_refused() -> None:
    proc = run_ranks(2, "verbs_workers:strangers", env=verbs_env(), timeout=280)
    assert "refused 3" in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_bad_gid_index_fails_clearly_when_forced_and_falls_back_otherwise() -> None:
    """GID index 30 is empty on rxe: forced verbs fails every rank with a TransportError naming the GID;
    without HETCCL_TRANSPORTS the ranks skip verbs (a warning) and run over the other transports."""
    proc = run_ranks(2, "workers:p2p", env=verbs_env(HETCCL_IB_GID_INDEX="30"), timeout=280, expect_rc=None)
    assert proc.returncode != 0
    assert "TransportError" in proc.stderr and "HETCCL_IB_GID_INDEX=30" in proc.stderr, proc.stderr[-3000:]
    env = verbs_env(HETCCL_IB_GID_INDEX="30")
    del env["HETCCL_TRANSPORTS"]
    proc = run_ranks(2, "workers:p2p", env=env, timeout=280)
    assert "skips transport verbs" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_full_early_buffer_holds_the_sender_back() -> None:
    proc = run_ranks(2, "verbs_workers:early_buffer_full", env=verbs_env(), timeout=280)
    assert "early buffer ok" in proc.stdout, proc.stdout
