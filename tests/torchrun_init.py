"""`python -m torch.distributed.run ... tests/torchrun_init.py MODE`: hetccl's own API (no torch.distributed)
joins a torchrun job from torchrun's environment alone (issue 15, item 2). MODE: async (hetccl.init under
hetccl.run), sync (init_sync), twice (init, close, init again: a second meeting must not read the first's
address). Each rank checks an all_reduce and an all_gather of ranks, then prints one "ok" line."""

from __future__ import annotations

import os
import sys

import numpy as np

import hetccl


def check(rank: int, size: int, summed: np.ndarray, ranks: np.ndarray) -> None:
    assert rank == int(os.environ["RANK"]) and size == int(os.environ["WORLD_SIZE"]), (rank, size)
    assert (summed == size * (size + 1) // 2).all(), summed
    assert ranks.tolist() == list(range(size)), ranks


async def once(tag: str) -> None:
    comm = await hetccl.init()
    buf = np.full(1000, comm.rank + 1, np.int64)
    await comm.all_reduce(buf)
    ranks = np.zeros(comm.size, np.int64)
    await comm.all_gather(ranks, np.array([comm.rank], np.int64))
    check(comm.rank, comm.size, buf, ranks)
    os.write(1, f"torchrun init ok rank {comm.rank}/{comm.size} ({tag})\n".encode())
    await comm.close()


def sync() -> None:
    comm = hetccl.init_sync()
    buf = np.full(1000, comm.rank + 1, np.int64)
    comm.all_reduce(buf)
    ranks = np.zeros(comm.size, np.int64)
    comm.all_gather(ranks, np.array([comm.rank], np.int64))
    check(comm.rank, comm.size, buf, ranks)
    os.write(1, f"torchrun init ok rank {comm.rank}/{comm.size} (sync)\n".encode())
    comm.close()


async def twice() -> None:
    await once("first")
    await once("second")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "sync":
        sync()
    else:
        hetccl.run(once("async") if mode == "async" else twice())
