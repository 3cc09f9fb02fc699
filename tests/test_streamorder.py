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
