"""Every collective x dtype x op x count on real rank processes, over shared memory and over TCP."""

from __future__ import annotations

import pytest
from rankrun import run_ranks

# "tcp-lanes": two connections per peer pair and every payload from 4 KiB moved by the native pumps, the defaults
# from 8 usable cores (this 2-core CI machine would otherwise never run them)
TRANSPORTS = {"shm": {"HETCCL_TRANSPORTS": "shm,tcp"}, "tcp": {"HETCCL_TRANSPORTS": "tcp"},
              "tcp-lanes": {"HETCCL_TRANSPORTS": "tcp", "HETCCL_SOCKET_LANES": "2",
                            "HETCCL_SOCKET_PUMP_BYTES": "4096"}}
SMALL = [0, 1, 7, 33]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_matrix_small(n: int, transport: str) -> None:
    """Small counts (0, 1, odd, fewer elements than ranks) for every dtype and op, latency algorithms."""
    run_ranks(n, "workers:matrix", env=TRANSPORTS[transport], timeout=280, counts=SMALL)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", ["ring", "latency"])
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_matrix_forced_algorithm(n: int, transport: str, algo: str) -> None:
    """Both algorithm families on every collective, with chunking (small HETCCL_CHUNK_BYTES) engaged."""
    env = dict(TRANSPORTS[transport], HETCCL_ALGO=algo, HETCCL_CHUNK_BYTES="4096")
    run_ranks(n, "workers:matrix", env=env, timeout=280, counts=[1, 5, 4099],
              dtypes=["int32", "bfloat16", "float16", "float64"], ops=["sum", "max", "avg"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n", [2, 4])
def test_matrix_large(n: int, transport: str) -> None:
    """Large counts (several chunks, several shared-memory fragments) on the default algorithm choice."""
    run_ranks(n, "workers:matrix", env=TRANSPORTS[transport], timeout=280, counts=[1 << 20, 3_000_001],
              dtypes=["float32", "bfloat16", "int64"], ops=["sum", "min"])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("n", [2, 3])
def test_concurrent_p2p_split(n: int, transport: str) -> None:
    for target in ("workers:concurrent", "workers:p2p", "workers:split", "workers:in_place_variants",
                   "workers:errors"):
        run_ranks(n, target, env=TRANSPORTS[transport])


@pytest.mark.timeout(120)
def test_torch_tensors() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    run_ranks(3, "workers:torch_buffers")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("islands", ["one", "two"])
def test_sync_facade(islands: str) -> None:
    """The blocking facade; "two": each rank its own CPU island, so its small all_reduces take the leaders'
    fast path on the caller's thread (hierarchical.fast_all_reduce), mixed with ones the loop runs."""
    env = {"TEST_ISLANDS": "cpu-0,cpu-1"} if islands == "two" else None
    proc = run_ranks(2, "workers:sync_facade", env=env)
    assert proc.stdout.count("facade mismatch raised CollectiveMismatchError") == 2, proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("kind", ["dtype", "count", "op", "collective", "root", "order"])
def test_mismatched_all_reduce_raises_on_every_rank(kind: str, transport: str) -> None:
    proc = run_ranks(2, "workers:mismatch", env=dict(TRANSPORTS[transport], HETCCL_TIMEOUT="20"), kind=kind)
    assert proc.stdout.count("mismatch ok") == 2, proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["dtype", "count", "op", "collective", "root", "order"])
def test_mismatch_among_three_ranks_reaches_every_rank(kind: str) -> None:
    """Rank 1 alone disagrees: ranks 0 and 2, which agree with each other, raise too (never hang)."""
    proc = run_ranks(3, "workers:mismatch", env={"HETCCL_TIMEOUT": "20"}, kind=kind)
    assert proc.stdout.count("mismatch ok") == 3, proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algo", ["ring", "latency"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_signed_zero_ties_agree_bitwise(n: int, algo: str) -> None:
    run_ranks(n, "workers:signed_zero_ties", env={"HETCCL_ALGO": algo})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_p2p_beside_collective(transport: str) -> None:
    run_ranks(3, "workers:p2p_beside_collective", env=TRANSPORTS[transport])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("islands", ["cpu-a,cpu-b", "cpu-a,cpu-a,cpu-b", "cpu-a,cpu-b,cpu-a,cpu-b"])
def test_islands_on_cpu_take_the_hierarchical_path(islands: str) -> None:
    """Ranks labelled as different islands (HETCCL_ISLAND) all_reduce hierarchically — reduce inside each
    island, all_reduce among island leaders, broadcast inside — on host memory; results are unchanged."""
    n = islands.count(",") + 1
    run_ranks(n, "workers:matrix", env={"TEST_ISLANDS": islands}, timeout=280, counts=[0, 1, 7, 33, 5000],
              dtypes=["int32", "bfloat16", "float32", "float64"], ops=["sum", "min", "avg"])
