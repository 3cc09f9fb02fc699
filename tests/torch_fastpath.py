"""torchrun rank body for test_fastpath.py: small CPU collectives of the "hetccl" torch.distributed backend take the
fast path (hetccl/fastpath.py) and give the same results: every dtype and op, async work in flight, broadcast,
all_gather, reduce_scatter and barrier. Exit code 0 means every check passed."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

import hetccl.torch  # noqa: F401  (registers the "hetccl" backend)

ALL_GATHER_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def main() -> None:
    dist.init_process_group("hetccl")
    r, n = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    fast = pg.comm.async_comm._fast
    assert fast is not None, "the default group of local ranks should have a fast path"
    before = fast.k
    vals = range(1, n + 1)
    ops = {dist.ReduceOp.SUM: sum(vals), dist.ReduceOp.PRODUCT: math.prod(vals), dist.ReduceOp.MIN: 1,
           dist.ReduceOp.MAX: n}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
               torch.int64):
        for op, want in ops.items():
            t = torch.full((100,), r + 1, dtype=dt)
            dist.all_reduce(t, op=op)
            assert (t == want).all(), (dt, op, t[:4], want)
    works = [(i, torch.full((16,), float(i + r)), None) for i in range(40)]
    works = [(i, t, dist.all_reduce(t, async_op=True)) for i, t, _ in works]
    for i, t, w in works:
        w.wait()
        assert (t == sum(i + p for p in range(n))).all(), (i, t[:4])
    b = torch.arange(8, dtype=torch.float32) if r == n - 1 else torch.zeros(8)
    dist.broadcast(b, src=n - 1)
    assert (b == torch.arange(8, dtype=torch.float32)).all(), b
    out = torch.zeros(4 * n)
    ALL_GATHER_TENSOR(out, torch.full((4,), float(r)))
    assert (out == torch.arange(n).repeat_interleave(4).float()).all(), out
    rs = torch.zeros(4)
    REDUCE_SCATTER_TENSOR(rs, torch.arange(4 * n, dtype=torch.float32))
    assert (rs == n * torch.arange(4 * r, 4 * r + 4, dtype=torch.float32)).all(), rs
    dist.barrier()
    assert fast.k - before >= 8 * 4 + 40 + 4, (before, fast.k)
    # above the limit (HETCCL_SHM_FASTPATH_BYTES, 1 MiB) an all_reduce of 2 ranks runs there, by the single copy or
    # in pieces; a sum of distinct values per element and rank, and the average, checked exactly (each part is
    # reduced once, by the rank that owns it)
    count = (3 << 20) // 4 + 13
    at = fast.k
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        t = torch.arange(count, dtype=torch.float32) % 1024 + 2048 * r
        dist.all_reduce(t, op=op)
        want = n * (torch.arange(count, dtype=torch.float32) % 1024) + 2048 * sum(range(n))
        want = want / n if op == dist.ReduceOp.AVG else want
        assert torch.equal(t, want), (op, t[:4], want[:4])
    # the path agreed at set-up: the single copy where asked for and the kernel allows it (test_fastpath.copy_env)
    assert fast.single_copy == (fast.pieces and os.environ.get("TEST_SINGLE_COPY") == "1"), fast.single_copy
    if fast.pieces:
        # two all_reduces, two fast operations per piece (a reduce-scatter and an all-gather step; the single copy
        # takes the same numbers and uses the first two)
        assert fast.k - at == 2 * 2 * -(-count * 4 // fast.piece_bytes), (at, fast.k)
    print(f"rank {r} torch fast ok ({fast.k - before} fast operations)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HETCCL_TIMEOUT", "60")
    main()
    os._exit(0)
