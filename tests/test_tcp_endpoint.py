"""The TCP endpoint's framing under failure, on a real kernel socket pair (no fabric, no fakes):

* a send cancelled mid-frame (its collective ended) still completes the frame, so the connection stays usable
  and a later frame (a goodbye naming the rank really lost) arrives intact;
* a reader whose matcher has failed keeps draining, even when its early-message buffer is full, so a peer's
  sender never stalls behind it;
* the first error of an endpoint stays: the loss that came first is what pending and later receives report;
* a communicator poisoned by a mismatch fails receives posted after the notice, not only those pending;
* a control frame that arrives before the fabric installs its handler is held, not dropped;
* payloads moved by the native pumps (HETCCL_SOCKET_PUMP_BYTES) keep all of the above: exact bytes both ways at
  once, a cut frame finished, EOF and a local stop reported with exact counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import numpy as np
import pytest

from hetccl.config import Settings
from hetccl.errors import CollectiveMismatchError, PeerLostError
from hetccl.matching import NOTICE_TAG, Matcher
from hetccl.netio import PUMP_EOF, PUMP_STOPPED, Pump
from hetccl.transports.base import TransportContext
from hetccl.transports.tcp import TcpEndpoint, TcpTransport
from hetccl.wire import CollOp, Fingerprint

pytestmark = pytest.mark.timeout(60)


def _transport(rank: int, lost: list[tuple[int, BaseException]]) -> TcpTransport:
    settings = dataclasses.replace(Settings.from_env({"HETCCL_TIMEOUT": "20"}), unexpected_bytes=1 << 20)
    ctx = TransportContext(rank=rank, size=2, job="t", host_id="h", settings=settings, store=None,  # type: ignore[arg-type]
                           bind_host="127.0.0.1", on_peer_lost=lambda p, e: lost.append((p, e)))
    return TcpTransport(ctx)


def _pair(sndbuf: int = 1 << 16) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
        s.setblocking(False)
    return a, b


def _fp(seq: int) -> Fingerprint:
    return Fingerprint(0, seq, CollOp.ALL_REDUCE, 0, 0)


def _lanes(n: int) -> tuple[list[socket.socket], list[socket.socket]]:
    pairs = [_pair() for _ in range(n)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


@pytest.mark.parametrize(("pump", "lanes"), [("0", 0), ("4K", 0), ("4K", 2)])
async def test_cancelled_send_finishes_its_frame(pump: str, lanes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETCCL_SOCKET_PUMP_BYTES", pump)
    lost: list[tuple[int, BaseException]] = []
    sa, sb = _pair()
    la, lb = _lanes(lanes)
    a = TcpEndpoint(_transport(0, lost), 1, sa, la, 4096)
    a._reader.cancel()  # rank 0 only sends here
    big = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)  # 4 MiB: far more than the socket buffers hold
    send = asyncio.ensure_future(a.send(_fp(1), 7, big))
    await asyncio.sleep(0.2)  # nobody reads yet: the frame is cut somewhere in the middle
    assert not send.done()
    send.cancel()
    with pytest.raises(asyncio.CancelledError):
        await send
    assert a._finishing is not None and not a._finishing.done()
    big_copy = big.copy()
    big[:] = 0  # the caller reuses its buffer at once: what is left of the frame must not change
    b = TcpEndpoint(_transport(1, lost), 0, sb, lb, 4096)  # rank 1 starts reading now
    got1 = np.empty_like(big)
    got2 = np.empty(16, np.uint8)
    f1 = b.post_recv(_fp(1), 7, got1)
    f2 = b.post_recv(_fp(2), 7, got2)
    await a.send(_fp(2), 7, np.arange(16, dtype=np.uint8))  # queued behind the rest of the cut frame
    await asyncio.wait_for(asyncio.gather(f1, f2), 10)
    assert np.array_equal(got1, big_copy)
    assert np.array_equal(got2, np.arange(16, dtype=np.uint8))
    assert lost == [] and a.matcher.error is None and b.matcher.error is None
    await asyncio.gather(a.close(), b.close())  # each waits for the other's FIN


@pytest.mark.parametrize("lanes", [0, 3])
async def test_pumped_payloads_both_ways(lanes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETCCL_SOCKET_PUMP_BYTES", "64K")
    lost: list[tuple[int, BaseException]] = []
    sa, sb = _pair()
    la, lb = _lanes(lanes)
    a = TcpEndpoint(_transport(0, lost), 1, sa, la, 64 << 10)
    b = TcpEndpoint(_transport(1, lost), 0, sb, lb, 64 << 10)
    rng = np.random.default_rng(0)
    big = [rng.integers(0, 255, 3 << 20, dtype=np.uint8) for _ in range(4)]
    small = np.arange(100, dtype=np.uint8)
    got = [np.zeros_like(x) for x in big]
    acc = np.ones(1 << 18, np.float32)  # a reduced receive: 1 MiB through the pump and the scratch
    fa = [b.post_recv(_fp(1), 1, got[0]), b.post_recv(_fp(1), 2, got[1])]
    fb = [a.post_recv(_fp(1), 1, got[2]), a.post_recv(_fp(1), 2, got[3])]
    got_small = np.zeros_like(small)
    fs = b.post_recv(_fp(1), 3, got_small)

    def add(dst: np.ndarray, src: np.ndarray) -> None:
        dst.view(np.float32)[:] += np.frombuffer(src, np.float32)

    fr = a.post_recv(_fp(1), 4, acc.view(np.uint8), add)
    await asyncio.wait_for(asyncio.gather(
        a.send(_fp(1), 1, big[0]), b.send(_fp(1), 1, big[2]), a.send(_fp(1), 2, big[1]),
        b.send(_fp(1), 2, big[3]), a.send(_fp(1), 3, small),
        b.send(_fp(1), 4, np.full(1 << 18, 2, np.float32).view(np.uint8)), *fa, *fb, fs, fr), 20)
    for x, y in zip(big, got, strict=True):
        assert np.array_equal(x, y)
    assert np.array_equal(got_small, small) and np.all(acc == 3)
    pumps = [p for ep in (a, b) for d in ep._pumps for p in d]
    assert len(pumps) == 4 * (lanes + 1) and all(p is not None for p in pumps) and lost == []
    await asyncio.gather(a.close(), b.close())
    assert all(p._p is None for p in pumps)  # type: ignore[union-attr]
    assert all(s.fileno() == -1 for s in [sa, sb, *la, *lb])


async def test_pump_reports_eof_and_stops() -> None:
    loop = asyncio.get_running_loop()
    pump = Pump.create(loop)
    if pump is None:
        pytest.skip("no native pump threads on this platform")
    sa, sb = _pair()
    sb.send(b"x" * 100)
    sb.close()
    buf = bytearray(1 << 20)
    assert await asyncio.wait_for(pump.run(sa.fileno(), False, None, buf), 5) == (PUMP_EOF, 100)
    assert bytes(buf[:100]) == b"x" * 100
    sa.close()
    sa, sb = _pair()
    job = asyncio.ensure_future(pump.run(sa.fileno(), False, None, buf))  # nothing comes: it waits in poll()
    await asyncio.sleep(0.1)
    job.cancel()
    with pytest.raises(asyncio.CancelledError) as info:
        await asyncio.wait_for(job, 5)
    assert getattr(info.value, "moved", None) == 0
    job = asyncio.ensure_future(pump.run(sa.fileno(), False, None, buf))
    await asyncio.sleep(0.1)
    pump.close()  # a connection dropped under a waiting job: the job ends, stopped
    assert await asyncio.wait_for(job, 5) == (PUMP_STOPPED, 0)
    assert await pump.run(sa.fileno(), False, None, buf) == (-9, 0)  # closed: no job runs any more
    sa.close()
    sb.close()


async def test_failed_reader_drains_a_full_early_buffer() -> None:
    lost: list[tuple[int, BaseException]] = []
    sa, sb = _pair()
    a = TcpEndpoint(_transport(0, lost), 1, sa)
    b = TcpEndpoint(_transport(1, lost), 0, sb)
    chunk = np.ones(1 << 19, np.uint8)  # 512 KiB; the early buffer holds 1 MiB
    for seq in range(1, 3):  # nobody posts these: they fill the early buffer
        await asyncio.wait_for(a.send(_fp(seq), 7, chunk), 5)
    tail = asyncio.ensure_future(a.send(_fp(3), 7, np.ones(4 << 20, np.uint8)))  # finds no room: reader waits
    await asyncio.sleep(0.3)
    assert not tail.done()  # stalled: rank 1 stopped reading
    b.fail(PeerLostError("rank 1 lost rank 5", 5))  # a third rank died: rank 1 gives up its collectives
    await asyncio.wait_for(tail, 5)  # rank 1's reader drops what it can no longer use, and reads on
    ok = np.arange(8, dtype=np.uint8)
    await a.send(_fp(4), 7, ok)
    await asyncio.sleep(0.1)
    assert b._reader.done() is False and lost == []
    await asyncio.gather(a.close(), b.close())  # each waits for the other's FIN


def test_first_error_stays() -> None:
    m = Matcher(0, 1, 1 << 20)

    async def body() -> None:
        first, later = PeerLostError("rank 0 lost rank 2", 2), PeerLostError("rank 1 closed", 1)
        pending = m.post(_fp(1), 7, np.empty(4, np.uint8), None)
        m.fail_all(first)
        m.fail_all(later)
        with pytest.raises(PeerLostError) as e1:
            await pending
        with pytest.raises(PeerLostError) as e2:
            await m.post(_fp(2), 7, np.empty(4, np.uint8), None)
        assert e1.value is first and e2.value is first

    asyncio.run(body())


def test_poisoned_comm_fails_later_posts() -> None:
    """A mismatch notice may land after a collective checked its communicator but before it posted a receive:
    that receive must fail at once too, not wait for data the odd rank will never send."""
    m = Matcher(0, 1, 1 << 20)

    async def body() -> None:
        exc = CollectiveMismatchError("rank 1 runs all_reduce #0 op=max, rank 0 op=sum")
        m.cancel_comm(0, exc)
        with pytest.raises(CollectiveMismatchError) as err:
            await asyncio.wait_for(m.post(_fp(3), 7, np.empty(4, np.uint8), None), 1)
        assert err.value is exc
        other = Fingerprint(5, 0, CollOp.ALL_REDUCE, 0, 0)  # other communicators are untouched
        assert not m.post(other, 7, np.empty(4, np.uint8), None).done()

    asyncio.run(body())


def test_notice_before_the_fabric_is_ready_is_held() -> None:
    """A fast peer's mismatch notice can arrive while this rank is still in init, before the fabric installs its
    handler: it is held and handed over then, not dropped (the rank would otherwise wait for its deadline)."""
    m = Matcher(2, 1, 1 << 20)
    got: list[tuple[int, bytes, int]] = []

    async def body() -> None:
        req = m.take(_fp(0), NOTICE_TAG, 5)
        assert req is not None and req is not False
        req.dst[:] = np.frombuffer(b"hello", np.uint8)
        req.fut.set_result(None)
        await asyncio.sleep(0)
        assert got == []
        m.on_notice = lambda peer, fp, payload, tag: got.append((peer, payload, tag))
        assert got == [(1, b"hello", NOTICE_TAG)]
        assert m.take(_fp(1), NOTICE_TAG, 1 << 20) is False  # over the bound: still refused

    asyncio.run(body())


def test_a_paced_pair_keeps_one_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under HETCCL_SOCKET_MAX_RATE a pair uses one connection by default: the rate is split over a pair's
    connections, and a payload below the split size (a compressed piece) would cross one of them at a third of
    the rate (16 usable cores: 3 lanes otherwise). HETCCL_SOCKET_LANES still wins."""
    from hetccl.transports import tcp

    monkeypatch.setattr(tcp, "usable_cpus", lambda: 16)
    want = {(None, None): 3, ("1250M", None): 1, ("1250M", "2"): 2}
    for (rate, lanes), n in want.items():  # conftest's monkeypatch makes hetccl read its parameters again
        for name, value in (("HETCCL_SOCKET_MAX_RATE", rate), ("HETCCL_SOCKET_LANES", lanes)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert tcp.lane_count() == n, (rate, lanes)
