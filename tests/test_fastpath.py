"""The small-message fast path (hetccl/fastpath.py) on real ranks: results, ordering, failures."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
from rankrun import HERE, ROOT, assert_victim_named, finish, run_ranks, spawn_ranks

FAST = {"HETCCL_SHM_FASTPATH_BYTES": "4096", "HETCCL_SHM_PIECE_BYTES": "4096", "HETCCL_TIMEOUT": "20"}


def copy_env(copy: str) -> dict[str, str]:
    """HETCCL_SHM_SINGLE_COPY=copy, and what the workers must find: the single copy where it is asked for and the
    kernel lets sibling processes attach (no Yama ptrace restriction), the pieces otherwise."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as f:
            attach = int(f.read()) == 0
    except FileNotFoundError:
        attach = sys.platform.startswith("linux")
    return {"HETCCL_SHM_SINGLE_COPY": copy, "TEST_SINGLE_COPY": "1" if copy == "1" and attach else "0"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("n", "piece", "copy"), [(2, "4096", "0"), (3, "4096", "0"), (2, "12K", "0"), (3, "12K", "0"),
                                                 (5, "12K", "0"), (2, "4096", "1"), (3, "12K", "1"), (5, "12K", "1")])
def test_every_dtype_op_and_collective_at_the_edge(n: int, piece: str, copy: str) -> None:
    """Above the limit an all_reduce takes the single copy (copy 1) or the pieces (copy 0). piece 12K: pieces
    larger than the limit (the slots grow to hold one); np 5: a smaller limit (the segment shrinks it past 4
    ranks) and parts that do not divide evenly."""
    env = {**FAST, "HETCCL_SHM_PIECE_BYTES": piece, **copy_env(copy)}
    proc = run_ranks(n, "fastpath_workers:every_dtype_and_op", env=env, timeout=280)
    assert proc.stdout.count("fast ok") == n, proc.stdout


@pytest.mark.timeout(120)
def test_many_in_flight_stay_ordered() -> None:
    proc = run_ranks(3, "fastpath_workers:many_in_flight", env=FAST)
    assert proc.stdout.count("in flight ok") == 3, proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["count", "dtype", "op", "collective", "pieces", "slow"])
def test_mismatch_raises_on_every_rank(kind: str) -> None:
    proc = run_ranks(3, "fastpath_workers:mismatch", env=FAST, kind=kind)
    assert proc.stdout.count("mismatch ok") == 3, proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,victim,count,copy", [(2, 1, 256, "1"), (3, 0, 256, "1"), (2, 0, 100_000, "0"),
                                                (2, 0, 100_000, "1")])
def test_dead_peer_raises_peer_lost(n: int, victim: int, count: int, copy: str) -> None:
    before = set(glob.glob("/dev/shm/hetccl-*"))
    procs = spawn_ranks(n, "fastpath_workers:die_waiting", env={**FAST, **copy_env(copy)}, victim=victim, count=count)
    assert_victim_named(finish(procs, 60), victim)
    assert set(glob.glob("/dev/shm/hetccl-*")) <= before


@pytest.mark.timeout(120)
def test_one_rank_without_the_single_copy_gives_every_rank_the_pieces() -> None:
    """Rank 1 cannot take the single copy (HETCCL_SHM_SINGLE_COPY=0 there stands for a kernel that refuses it the
    attach): set-up agrees on the pieces on every rank, and the results are right."""
    import json

    env = {**FAST, **copy_env("0"), "TEST_RANK_ENV": json.dumps({"HETCCL_SHM_SINGLE_COPY": ["1", "0", "1"]})}
    proc = run_ranks(3, "fastpath_workers:large_all_reduces", env=env)
    assert proc.stdout.count("large ok") == 3, proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,victim,op", [(2, 1, "all_reduce"), (3, 2, "all_reduce"), (2, 0, "reduce_scatter"),
                                         (3, 1, "all_gather")])
def test_dead_peer_in_the_single_copy(n: int, victim: int, op: str) -> None:
    """The victim exits hard from another thread while the ranks copy 32 MiB collectives between their buffers:
    the others raise PeerLostError naming it (the kernel's ESRCH, or the lost connection), never a result."""
    env = {**FAST, **copy_env("1"), "HETCCL_SHM_FASTPATH_BYTES": "1M"}
    procs = spawn_ranks(n, "fastpath_workers:die_in_copy", env=env, victim=victim, op=op)
    assert_victim_named(finish(procs, 90), victim)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count,copy", [(8, "1"), (100_000, "0"), (100_000, "1")])
def test_late_rank_times_out(count: int, copy: str) -> None:
    env = dict(FAST, HETCCL_TIMEOUT="3", HETCCL_HANG_REPORT="0", **copy_env(copy))
    proc = run_ranks(2, "fastpath_workers:late_rank_times_out", env=env, expect_rc=None, count=count)
    assert "timeout ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    if env["TEST_SINGLE_COPY"] == "1" and count > 1024:
        out = proc.stdout + proc.stderr[-3000:]
        assert "late rank timeout ok" in proc.stdout and "untouched ok" in proc.stdout, out


@pytest.mark.timeout(120)
def test_off_when_zero() -> None:
    proc = run_ranks(2, "fastpath_workers:fast_off", env={"HETCCL_SHM_FASTPATH_BYTES": "0"})
    assert proc.stdout.count("off ok") == 2, proc.stdout


@pytest.mark.timeout(120)
def test_not_over_tcp() -> None:
    proc = run_ranks(2, "fastpath_workers:fast_off", env={"HETCCL_TRANSPORTS": "tcp"})
    assert proc.stdout.count("off ok") == 2, proc.stdout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("copy", ["1", "0"])
def test_torch_backend_under_torchrun(copy: str) -> None:
    """The "hetccl" torch.distributed backend under torchrun: small CPU collectives take the fast path, larger
    all_reduces the single copy or the pieces."""
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "torch_fastpath.py")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               HETCCL_TIMEOUT="60", **copy_env(copy))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0 and proc.stdout.count("torch fast ok") == 2, proc.stdout + proc.stderr[-6000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "values"), [("HETCCL_SHM_FASTPATH_BYTES", ["0", "64K"]),
                                              ("HETCCL_CHUNK_BYTES", ["1M", "4M"]),
                                              ("HETCCL_CROSS_COMPRESS", ["none", "bf16"])])
def test_settings_that_must_agree_are_refused_when_they_differ(name: str, values: list[str]) -> None:
    """A rank with the fast path off and one with it on would wait for each other on different paths (a
    timeout, not an answer): every rank refuses at start-up instead, naming the setting."""
    import json

    run_ranks(2, "workers:settings_disagree", env={"TEST_RANK_ENV": json.dumps({name: values})}, name=name)
