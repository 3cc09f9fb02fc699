"""The stream order's host side without a GPU: the watcher thread (gpu/streamorder.py) that completes the
loop's waits for words a stream stores in host memory. Here another thread stores them, as a stream would."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

from hetccl.errors import CollectiveTimeout
from hetccl.gpu import streamorder


class HostWords:
    """streamorder.Words' host half: the words a stream stores into and the loop reads (no GPU mapping)."""

    reached = streamorder.Words.reached
    store = streamorder.Words.store

    def __init__(self, n: int):
        self.host = np.zeros(n, dtype=np.uint32)


async def test_until_completes_each_wait_whatever_the_order():
    """64 waits in flight at once (new ones join while the watcher sleeps in its native poll), their words
    stored in a random order from another thread: every wait ends, none before its word."""
    words = HostWords(64)
    loop = asyncio.get_running_loop()
    wanted = [(i, 1 + i % 3) for i in range(64)]
    stored: set[int] = set()

    def stream() -> None:
        for i in random.Random(0).sample(range(64), 64):
            time.sleep(0.0005)
            stored.add(i)
            words.store(wanted[i])

    async def one(i: int) -> None:
        await streamorder.until(words, wanted[i], loop.time() + 20, f"word {i}")
        assert i in stored

    writer = threading.Thread(target=stream)
    waits = [asyncio.ensure_future(one(i)) for i in range(32)]
    writer.start()
    await asyncio.sleep(0.005)
    waits += [asyncio.ensure_future(one(i)) for i in range(32, 64)]
    await asyncio.wait_for(asyncio.gather(*waits), 30)
    writer.join()


async def test_until_times_out_and_the_watcher_goes_on():
    words = HostWords(4)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(CollectiveTimeout, match="never stored"):
        await streamorder.until(words, (0, 1), t0 + 0.2, "never stored")
    assert loop.time() - t0 < 5
    threading.Timer(0.02, lambda: words.store((1, 1))).start()
    await streamorder.until(words, (1, 1), loop.time() + 10, "stored later")


@pytest.mark.parametrize("k,me", [(2, 0), (2, 1), (3, 1), (4, 3)])
def test_span_reduction_lands_each_piece_and_reduces_in_leader_order(k, me):
    """The ordered reductions' device side (hierarchical._SpanReduction), run on CPU tensors: the other
    leaders' slices copied where `at` says, a span of pieces reduced after its last piece (not before), and
    the result the leader-order sum of every block bit for bit (what the host-side reference and every other
    leader compute). 19 pieces of 1,000 and a short last one: two full spans and a short one."""
    torch = pytest.importorskip("torch")
    from hetccl import hierarchical
    from hetccl.dtypes import ReduceOp

    class CpuIsland:  # the plan's allocator for the stream, on the host
        def empty_like(self, t, count=None):
            return torch.full((t.numel() if count is None else count,), float("nan"), dtype=t.dtype)

    count = 19_300
    pieces = [(lo, min(lo + 1000, count)) for lo in range(0, count, 1000)]
    g = torch.Generator().manual_seed(k * 10 + me)
    blocks = [torch.randn(count, generator=g) * 1e3 for _ in range(k)]
    own = blocks[me].clone()
    spans = hierarchical._SpanReduction(CpuIsland(), own, own, pieces, k, me, ReduceOp.SUM)
    u8 = spans.scratch.view(torch.uint8)
    for i, (lo, hi) in enumerate(pieces):
        for r in range(k):
            if r != me:
                u8[spans.at(i, r):spans.at(i, r) + (hi - lo) * 4] = blocks[r][lo:hi].view(torch.uint8)
        before = own.clone()
        spans.landed(i)
        last_of_span = i % hierarchical._REDUCE_SPAN == hierarchical._REDUCE_SPAN - 1 or i == len(pieces) - 1
        assert torch.equal(own, before) != last_of_span, f"piece {i}: {'never' if last_of_span else 'too early'}"
    want = blocks[0] + blocks[1]
    for b in blocks[2:]:
        want = want + b
    assert torch.equal(own, want)
