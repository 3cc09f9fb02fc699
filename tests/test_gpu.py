"""GPU collectives: one island (vendor CCL), two islands (hetccl's cross-island path), GPUs plus CPU ranks.

They need CUDA devices and the NCCL library; on CPU-only machines (CI) they skip with the reason."""

from __future__ import annotations

import pytest
from gpu_marks import GPU_ENV, needs_1, needs_2
from rankrun import assert_victim_named, finish, ranks_report, run_ranks, spawn_ranks

COUNTS = [0, 1, 7, 1000, 1 << 20]


@needs_2
@pytest.mark.timeout(600)
def test_two_gpus_one_island() -> None:
    run_ranks(2, "gpu_workers:gpu_matrix", env=dict(GPU_ENV, TEST_ISLANDS="nvidia,nvidia"), timeout=580,
              counts=COUNTS)


@needs_1
@pytest.mark.timeout(600)
def test_two_gpus_two_islands() -> None:
    """Two islands of one GPU rank each (on one GPU when the machine has only one: islands never share a
    vendor communicator, so that is allowed): the cross-island path, zero-copy link included."""
    run_ranks(2, "gpu_workers:gpu_matrix", env=dict(GPU_ENV, TEST_ISLANDS="nvidia-a,nvidia-b"), timeout=580,
              counts=COUNTS + [3 << 20])
    run_ranks(2, "gpu_workers:gpu_matrix", env=dict(GPU_ENV, TEST_ISLANDS="nvidia-a,nvidia-b", HETCCL_PAIRLINK="0"),
              timeout=580, counts=[0, 1, 1000, 3 << 20], dtypes=["float32", "bfloat16"])
    # the zero-copy link signalled by the CPU (where the driver lacks stream memory operations)
    run_ranks(2, "gpu_workers:gpu_matrix", env=dict(GPU_ENV, TEST_ISLANDS="nvidia-a,nvidia-b",
                                                    HETCCL_STREAM_MEMOPS="0"),
              timeout=580, counts=[1, 1000, 9 << 20], dtypes=["float32", "float16"], ops=["sum", "max"])


@needs_2
@pytest.mark.timeout(600)
def test_two_gpus_and_two_cpu_ranks() -> None:
    run_ranks(4, "gpu_workers:gpu_matrix", env=dict(GPU_ENV, TEST_ISLANDS="nvidia,nvidia,cpu,cpu"), timeout=580,
              counts=[0, 1, 7, 1000, 100_003], dtypes=["float32", "bfloat16", "int64", "float16"])


@needs_2
@pytest.mark.timeout(120)
def test_gpu_dead_peer_one_island() -> None:
    procs = spawn_ranks(2, "gpu_workers:gpu_die_midway", env=dict(GPU_ENV, TEST_ISLANDS="nvidia,nvidia"), victim=1)
    assert_victim_named(finish(procs, 90), 1)


@needs_1
@pytest.mark.timeout(120)
def test_gpu_dead_peer_two_islands() -> None:
    procs = spawn_ranks(2, "gpu_workers:gpu_die_midway", env=dict(GPU_ENV, TEST_ISLANDS="nvidia-a,nvidia-b"),
                        victim=1)
    assert_victim_named(finish(procs, 90), 1)


@needs_2
@pytest.mark.timeout(120)
def test_gpu_stuck_peer_watchdog() -> None:
    procs = spawn_ranks(2, "gpu_workers:gpu_stuck_peer", env=dict(GPU_ENV, TEST_ISLANDS="nvidia,nvidia",
                                                                   HETCCL_TIMEOUT="5"))
    results = finish(procs, 90)
    report = ranks_report(results)
    assert all(rc == 0 for rc, _, _ in results), report
    assert "watchdog timeout" in results[0][1], report
