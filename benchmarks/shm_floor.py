"""The memory floor of hetccl's shared-memory all_reduce in pieces (fastpath.py), in one process.

What one rank of an np 2 all_reduce in pieces does to memory, without the other rank: for each piece, copy it
from the buffer into its own slot (hccl_copy), then reduce its slot and the peer's slot into the buffer
(hccl_reduce3), through two double-buffered slots per rank, all hot in this core's caches. The real
collective adds what one process cannot show: the peer's slot comes from another core's cache, and the
ranks wait for each other. The gap between this and `hetccl bench` is that cost.

    python benchmarks/shm_floor.py [--sizes 16M,64M] [--piece 512K] [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from hetccl import native
from hetccl.dtypes import DType, ReduceOp
from hetccl.params import parse_size


def floor_ms(nbytes: int, piece: int, iters: int) -> float:
    ffi, lib = native.ffi, native.lib
    buf = np.ones(nbytes // 4, np.float32)
    slots = np.ones(4 * piece // 4, np.float32)  # this rank's two slots, then the peer's two
    pb, ps = ffi.from_buffer("char[]", buf), ffi.from_buffer("char[]", slots)

    def one() -> None:
        for i in range(nbytes // piece):
            own, peer = ps + (i & 1) * piece, ps + (2 + (i & 1)) * piece
            lib.hccl_copy(own, pb + i * piece, piece)
            lib.hccl_reduce3(pb + i * piece, own, peer, piece // 4, DType.FLOAT32, ReduceOp.SUM)

    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return sorted(times)[iters // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--piece", default="512K")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    piece = parse_size(a.piece)
    for s in a.sizes.split(","):
        n = parse_size(s)
        print(f"{s:>6}: {floor_ms(n, piece, a.iters):8.2f} ms (median of {a.iters}), piece {a.piece}", flush=True)


if __name__ == "__main__":
    main()
