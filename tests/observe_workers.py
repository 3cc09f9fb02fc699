"""Rank functions for tests/test_observe.py (tracing, metrics, logging), run through rankrun.run_ranks."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request

import numpy as np

import hetccl


async def trace_job(comm: hetccl.Communicator, out: str) -> None:
    """A mix of collectives (several chunks each with HETCCL_CHUNK_BYTES=4K), two of them concurrent;
    writes what it ran (op names by seq) to out.rankN.json for the test to compare with the trace."""
    n, r = comm.size, comm.rank
    ran: list[str] = []
    a = np.full(n * 4096, r + 1, np.float32)  # 16 KiB per block: 4 chunks of 4 KiB each
    await comm.all_reduce(a)
    assert a[0] == n * (n + 1) / 2
    ran.append("all_reduce")
    g = np.zeros(n * 2048, np.float32)
    await comm.all_gather(g, np.full(2048, r, np.float32))
    ran.append("all_gather")
    b = np.arange(8192, dtype=np.float32) if r == 0 else np.zeros(8192, np.float32)
    await comm.broadcast(b, root=0)
    assert b[5] == 5
    ran.append("broadcast")
    rs = np.zeros(2048, np.float32)
    await comm.reduce_scatter(rs, np.ones(n * 2048, np.float32))
    ran.append("reduce_scatter")
    c = np.ones(8192, np.float32)
    await comm.reduce(c, root=n - 1)
    ran.append("reduce")
    t = np.zeros(n * 64, np.int32)
    await comm.all_to_all(t, np.full(n * 64, r, np.int32))
    ran.append("all_to_all")
    x, y = np.ones(3000, np.float64), np.ones(5000, np.float64)
    await asyncio.gather(comm.all_reduce(x), comm.all_reduce(y))  # two collectives in flight at once
    ran += ["all_reduce", "all_reduce"]
    await comm.barrier()
    ran.append("barrier")
    with open(f"{out}.rank{r}.json", "w") as f:
        json.dump(ran, f)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


async def metrics_job(comm: hetccl.Communicator, out: str) -> None:
    """Known collectives, one mismatched collective (an error), then scrape our exporter and the peer's
    over HTTP while the job runs, and save the texts for the test."""
    n, r = comm.size, comm.rank
    for _ in range(3):
        await comm.all_reduce(np.ones(4096, np.float32))
    for _ in range(2):
        await comm.all_gather(np.zeros(n * 1024, np.float32), np.ones(1024, np.float32))
    try:  # rank 0 passes 8 elements, rank 1 16: both see the other's data and raise
        await comm.all_reduce(np.ones(8 * (r + 1), np.float32))
    except hetccl.CollectiveMismatchError:
        pass
    else:
        raise AssertionError("mismatched all_reduce did not raise")
    await comm.barrier()
    base = int(os.environ["HETCCL_METRICS_PORT"])
    texts = {}
    for peer in range(n):
        texts[peer] = await asyncio.to_thread(_scrape, base + peer)  # local rank = rank on one host
    await comm.barrier()  # nobody closes (stops its exporter) before everyone has scraped
    with open(f"{out}.rank{r}.json", "w") as f:
        json.dump(texts, f)
