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


@pytest.mark.parametrize("k,me,span", [(2, 0, 8), (2, 1, 8), (3, 1, 8), (4, 3, 8), (2, 0, 32), (2, 1, 32), (3, 2, 32)])
def test_span_reduction_lands_each_piece_and_reduces_in_leader_order(k, me, span):
    """The ordered reductions' device side (hierarchical._SpanReduction), run on CPU tensors: the other
    leaders' slices copied where `at` says, a span of pieces reduced after its last piece (not before), and
    the result the leader-order sum of every block bit for bit (what the host-side reference and every other
    leader compute). 19 pieces of 1,000 and a short last one: two full spans of 8 and a short one, or one span of
    the whole tensors."""
    torch = pytest.importorskip("torch")
    from hetccl import hierarchical
    from hetccl.dtypes import ReduceOp

    class NoBatch:  # the copies back are made by the test
        def flush(self):
            pass

    class CpuIsland:  # the plan's allocator for the stream, on the host
        batch = NoBatch()

        def scratch(self, t, count, role):
            return torch.full((count,), float("nan"), dtype=t.dtype)

    count = 19_300
    pieces = [(lo, min(lo + 1000, count)) for lo in range(0, count, 1000)]
    g = torch.Generator().manual_seed(k * 10 + me)
    blocks = [torch.randn(count, generator=g) * 1e3 for _ in range(k)]
    own = blocks[me].clone()
    spans = hierarchical._SpanReduction(CpuIsland(), own, own, pieces, k, me, ReduceOp.SUM, span=span)
    u8 = spans.scratch.view(torch.uint8)
    for i, (lo, hi) in enumerate(pieces):
        for r in range(k):
            if r != me:
                u8[spans.at(i, r):spans.at(i, r) + (hi - lo) * 4] = blocks[r][lo:hi].view(torch.uint8)
        before = own.clone()
        spans.landed(i)
        last_of_span = i % spans.span == spans.span - 1 or i == len(pieces) - 1
        assert torch.equal(own, before) != last_of_span, f"piece {i}: {'never' if last_of_span else 'too early'}"
    want = blocks[0] + blocks[1]
    for b in blocks[2:]:
        want = want + b
    assert torch.equal(own, want)


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_a_stream_batch_calls_the_driver_in_order_and_stops_at_the_first_refusal(vendor):
    """bindings.streamops.StreamBatch and native hccl_stream_batch, with C callbacks in the driver's place
    (their signatures as CUDA's and HIP's): every copy, word store and word wait reaches its function in
    order with its arguments, and the first one refused stops the batch with its index and code."""
    from hetccl import native
    from hetccl.bindings import streamops

    ffi, calls = native.ffi, []
    refuse = {"at": -1}

    def answer(*call):
        calls.append(call)
        return 7 if len(calls) - 1 == refuse["at"] else 0

    if vendor == "cuda":
        copy = ffi.callback("int(uint64_t, uint64_t, size_t, void *)",
                            lambda d, s, n, st: answer("copy", d, s, n, int(ffi.cast("uintptr_t", st))))
        write = ffi.callback("int(void *, uint64_t, uint32_t, unsigned int)",
                             lambda st, a, v, f: answer("write", int(ffi.cast("uintptr_t", st)), a, v, f))
        wait = ffi.callback("int(void *, uint64_t, uint32_t, unsigned int)",
                            lambda st, a, v, f: answer("wait", int(ffi.cast("uintptr_t", st)), a, v, f))
    else:
        def addr(p):
            return int(ffi.cast("uintptr_t", p))

        copy = ffi.callback("int(void *, void *, size_t, int, void *)",
                            lambda d, s, n, kind, st: answer("copy", addr(d), addr(s), n, addr(st), kind))
        write = ffi.callback("int(void *, void *, uint32_t, unsigned int)",
                             lambda st, a, v, f: answer("write", addr(st), addr(a), v, f))
        wait = ffi.callback("int(void *, void *, uint32_t, unsigned int, uint32_t)",
                            lambda st, a, v, f, mask: answer("wait", addr(st), addr(a), v, f, mask))

    ops = object.__new__(streamops.StreamOps)  # the driver's functions are the callbacks above
    ops.vendor, ops.ffi = vendor, ffi
    ops._batch_fns = tuple(int(ffi.cast("uintptr_t", f)) for f in (copy, write, wait))
    batch = ops.batch()
    batch.copy(0x1000, 0x2000, 4096, 11)
    batch.write(11, 0x3000, (1 << 32) + 5)  # a generation past 32 bits wraps as the word does
    batch.wait_geq(12, 0x3004, 9)
    batch.copy(0x2000, 0x1000, 1 << 33, 12)
    assert len(batch) == 4
    batch.flush()
    assert len(batch) == 0
    hip = vendor == "hip"
    assert calls == [("copy", 0x1000, 0x2000, 4096, 11) + ((4,) if hip else ()),
                     ("write", 11, 0x3000, 5, 0),
                     ("wait", 12, 0x3004, 9, 0) + ((0xFFFFFFFF,) if hip else ()),
                     ("copy", 0x2000, 0x1000, 1 << 33, 12) + ((4,) if hip else ())]
    batch.flush()  # nothing left: no call
    assert len(calls) == 4

    calls.clear()
    refuse["at"] = 1
    items = [streamops.BATCH_COPY, 1, 2, 3, 4, streamops.BATCH_WAIT, 1, 2, 3, 0, streamops.BATCH_WRITE, 1, 2, 3, 0]
    arr = np.array(items, dtype=np.uint64)
    rc = ffi.new("int *")
    failed = native.lib.hccl_stream_batch(ffi.cast("uint64_t *", arr.ctypes.data), 3, 1 if hip else 0,
                                          *ops._batch_fns, rc)
    assert (failed, rc[0], len(calls)) == (1, 7, 2)  # the third never went


def test_the_enqueuing_thread_runs_jobs_in_order_and_reports_an_escaped_error():
    """torch/enqueuer.py: jobs run one at a time, in the order put, on one thread that is not the caller's; an
    error a job lets escape is raised by the next put(); where() says where a running job stands; close() lets
    the queue run out, then stops the thread."""
    torch_enqueuer = pytest.importorskip("hetccl.torch.enqueuer")
    q = torch_enqueuer.Enqueuer("test-enqueue")
    ran: list[tuple[int, int]] = []
    for i in range(50):
        q.put(lambda i=i: (time.sleep(0.0002 * (i % 3)), ran.append((i, threading.get_ident()))))
    assert q.idle(10.0)
    assert [i for i, _ in ran] == list(range(50))
    assert len({t for _, t in ran}) == 1 and ran[0][1] != threading.get_ident()
    # where(), for the error of a plan that waited past the deadline: how long the job has run, and where
    release = threading.Event()

    def dawdles() -> None:
        release.wait(10.0)
    q.put(dawdles)
    time.sleep(0.1)
    said = q.where()
    assert said.startswith("the enqueuing thread has run its job for") and "in test_the_enqueuing_thread" in said \
        and "dawdles" in said, said
    release.set()
    assert q.idle(10.0) and q.where().startswith("the enqueuing thread is idle"), q.where()

    def fails() -> None:
        raise RuntimeError("job 51")
    q.put(fails)
    assert q.idle(10.0)
    with pytest.raises(Exception, match="enqueuing failed") as info:
        q.put(lambda: None)
    assert "job 51" in repr(info.value.__cause__)
    q.close(5.0)
    assert not q._thread.is_alive()


class _Group:
    """What hierarchical.Deferred reads of a communicator: its turns (the real IssueOrder) and timeout."""

    def __init__(self, timeout: float):
        from hetccl.ordering import IssueOrder

        self.issue_order = IssueOrder()
        self.settings = type("S", (), {"timeout": timeout})()


async def test_a_deferred_host_side_keeps_its_turn_and_runs_the_plan_made_on_another_thread():
    """hierarchical.Deferred: its host side takes the communicator's turn at once (a collective issued after
    it waits), runs the host side planned later on another thread, and a plan the host side has given up on
    (past the deadline) lets the stream go and raises on the planning thread; the timeout says where the
    planning thread stands."""
    from hetccl import hierarchical

    group = _Group(timeout=2.0)
    events: list[str] = []

    def make(name: str) -> hierarchical.Ordered:
        async def side() -> None:
            events.append(f"{name} host side")
        return hierarchical.Ordered(side(), lambda: None, lambda: events.append(f"{name} abandoned"), False)

    first = hierarchical.Deferred(group, "all_reduce", lambda stream, early: make("first"))
    task = asyncio.ensure_future(first.host_side())
    await asyncio.sleep(0.01)

    async def later() -> None:
        async with group.issue_order.turn("later", asyncio.get_running_loop().time() + 2.0):
            events.append("later")
    other = asyncio.ensure_future(later())
    await asyncio.sleep(0.05)
    assert events == []  # the later collective waits for the first's turn, which waits for its plan
    planner = threading.Thread(target=lambda: first.plan("stream", None))
    planner.start()
    await asyncio.wait_for(asyncio.gather(task, other), 5.0)
    planner.join()
    assert events == ["first host side", "later"]

    group.settings.timeout = 0.1
    events.clear()
    late = hierarchical.Deferred(group, "all_gather", lambda stream, early: make("late"),
                                 explain=lambda: "the planner stands here")
    with pytest.raises(CollectiveTimeout, match="not planned before the deadline.*; the planner stands here"):
        await late.host_side()
    with pytest.raises(Exception, match="gave up"):
        await asyncio.to_thread(late.plan, "stream", None)
    assert events == ["late abandoned"]
