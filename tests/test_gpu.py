"""GPU collectives: one island (vendor CCL), two islands (hetccl's cross-island path), GPUs plus CPU ranks.

They need CUDA devices and the NCCL library; on CPU-only machines (CI) they skip with the reason."""

from __future__ import annotations

import os
import subprocess
import sys

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


# three and four islands (issue 16, item 4): each process its own island on GPU local_rank % device_count (one
# GPU will do: every island's NCCL communicator has one rank), GPU islands alone and mixed with CPU islands, on each
# cross path (the zero-copy link: a pair, or a ring of three or more leaders; "hosts": every rank its own
# HETCCL_HOST)
MANY_ISLANDS = ["nvidia-0,nvidia-1,nvidia-2", "nvidia-0,nvidia-1,nvidia-2,nvidia-3", "nvidia-0,nvidia-1,cpu-a",
                "nvidia-0,cpu-a,nvidia-1,cpu-b"]


@needs_1
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", ["shm", "tcp", "hosts"])
@pytest.mark.parametrize("islands", MANY_ISLANDS)
def test_many_islands_native(islands: str, path: str) -> None:
    """gpu_matrix on device memory (host memory on CPU islands): all_reduce with every op, reduce_scatter,
    all_gather, broadcast, reduce, all_to_all, stream order, CuPy / DLPack inputs, barrier; gather, scatter and
    send/recv are checked through the torch backend (tests/test_torch_gpu.py, test_many_islands_every_op)."""
    n = islands.count(",") + 1
    env = dict(GPU_ENV, TEST_ISLANDS=islands)
    if path == "tcp":
        env["HETCCL_TRANSPORTS"] = "tcp"
    elif path == "hosts":
        env["HETCCL_HOST"] = ",".join(f"h{i}" for i in range(n))
    run_ranks(n, "gpu_workers:gpu_matrix", env=env, timeout=880, counts=[0, 1, 7, 1000, 100_003, 3 << 20],
              dtypes=["float32", "bfloat16", "int64"])


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


DMABUF_PROBE = r"""
import os, stat, sys, torch
from hetccl.errors import TransportError
from hetccl.transports.verbs import cuda_dmabuf_fd, device_range, register_device_buffer
torch.cuda.set_device(0)
t = torch.empty(3 << 20, dtype=torch.float32, device="cuda:0")[1000:]  # not at the start of its allocation
ptr, nbytes, vendor = device_range(t)
assert (ptr, nbytes, vendor) == (t.data_ptr(), t.numel() * 4, "cuda")
try:
    fd, offset, length = cuda_dmabuf_fd(ptr, nbytes)
except TransportError as exc:
    if "CUresult 801" in str(exc):  # CUDA_ERROR_NOT_SUPPORTED: this driver or GPU exports no dma-buf
        print("UNSUPPORTED", exc); sys.exit(0)
    raise
assert fd >= 0 and 0 <= offset < 1 << 16 and length % (1 << 16) == 0 and offset + nbytes <= length
assert not stat.S_ISREG(os.fstat(fd).st_mode)  # a dma-buf, not a file
os.close(fd)
try:  # registering needs a protection domain of an RDMA device; without one it must say so, never crash
    register_device_buffer(None, t)
except TransportError as exc:
    print("REGISTER", exc)
except Exception as exc:
    print("REGISTER-OTHER", type(exc).__name__, exc)
print("EXPORTED", offset, length)
"""


@needs_1
@pytest.mark.timeout(60)
def test_cuda_memory_exports_as_dmabuf() -> None:
    """GPUDirect RDMA's first half on a real GPU: device memory is exported as a dma-buf (what the verbs
    transport hands ibv_reg_dmabuf_mr; no RDMA NIC here, so that second half runs nowhere in this suite)."""
    proc = subprocess.run([sys.executable, "-c", DMABUF_PROBE], capture_output=True, text=True, timeout=50,
                          env={**os.environ, **GPU_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "UNSUPPORTED" in proc.stdout:
        pytest.skip(f"the driver exports no dma-buf: {proc.stdout.strip()}")
    assert "EXPORTED" in proc.stdout and "REGISTER-OTHER" not in proc.stdout, proc.stdout
