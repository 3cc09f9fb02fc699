"""More than two islands (issue 16, item 4): three and four CPU islands, equal and unequal, contiguous and
interleaved, on each cross path — shared memory, TCP (HETCCL_TRANSPORTS=tcp) and other hosts (HETCCL_HOST) —
through the native API and through the torch backend under torchrun. Every collective is checked on every rank
(all_reduce with each op, reduce, reduce_scatter, all_gather, broadcast, all_to_all, gather, scatter, barrier,
send/recv; the torch run adds AVG, PREMUL_SUM, the coalesced forms and batch_isend_irecv).

The GPU variants (every process its own nvidia-<i> island, on one GPU or more) are in tests/test_torch_gpu.py.
"""

from __future__ import annotations

import pytest
from rankrun import run_ranks

# island labels by rank, and for the "hosts" path the HETCCL_HOST name of each rank: hosts cut across islands
# (an island on two hosts, island leaders some on one host and some on another) as well as along them
LAYOUTS = {
    "3": ("cpu-a,cpu-b,cpu-c", "a,b,c"),
    "4": ("cpu-a,cpu-b,cpu-c,cpu-d", "a,a,b,b"),
    "2+1+1": ("cpu-a,cpu-a,cpu-b,cpu-c", "a,b,b,b"),
    "interleaved": ("cpu-b,cpu-a,cpu-c,cpu-a", "a,b,a,b"),
}
PATHS = ("shm", "tcp", "hosts")


def layout_env(layout: str, path: str) -> tuple[int, dict[str, str], list[str] | None]:
    """(ranks, environment, HETCCL_HOST name of each rank or None) of one layout on one path."""
    islands, hosts = LAYOUTS[layout]
    env = {"TEST_ISLANDS": islands}
    if path == "tcp":
        env["HETCCL_TRANSPORTS"] = "tcp"
    if path != "hosts":
        return islands.count(",") + 1, env, None
    env["HETCCL_HOST"] = hosts
    return islands.count(",") + 1, env, hosts.split(",")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_islands_every_collective(layout: str, path: str) -> None:
    """The native API on host memory: every collective x op on counts 0, 1, 2, odd and chunked (4 KiB chunks;
    the counts make every rank a root), then send/recv and many collectives in flight; with "hosts", each rank
    first checks shm inside a host and TCP across."""
    n, env, hosts = layout_env(layout, path)
    env["HETCCL_CHUNK_BYTES"] = "4096"
    run_ranks(n, "workers:every_op", env=env, timeout=140, hosts=hosts, counts=[0, 1, 2, 7, 4099],
              dtypes=["int32", "bfloat16", "float32"], ops=["sum", "prod", "min", "max", "avg"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout,path", [(lay, p) for lay in ("3", "4", "2+1+1") for p in PATHS]
                         + [("interleaved", "hosts")])
def test_islands_torch_backend_under_torchrun(layout: str, path: str) -> None:
    """torchrun --standalone, CPU tensors: every op of the torch backend (tests/torch_workers.py ops); the
    interleaved layout, which the native test covers on every path, on the "hosts" path alone (about 10 s a
    run)."""
    pytest.importorskip("torch")
    from test_torch_backend import run_torchrun

    n, env, hosts = layout_env(layout, path)
    if hosts:
        env["TEST_CHECK_HOSTS"] = ",".join(hosts)
    run_torchrun(n, "ops", "float32", env=env, timeout=140)
