"""Several TCP connections per peer pair (HETCCL_SOCKET_NSTREAMS): messages cut into fragments across them,
reassembled by offset (reduced in place where the receive reduces), on real sockets and real processes.

* endpoint pairs over socket pairs: odd sizes, reductions, early arrival, many messages in flight;
* whole jobs over TCP with 1, 3 and 4 streams: every collective on odd sizes, concurrent traffic;
* a peer dying with a fragmented message half delivered: the survivor raises PeerLostError naming it;
* the two ends agree on the smaller stream count; fragment headers are strict (the settings: test_config.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import numpy as np
import pytest
from rankrun import assert_victim_named, finish, run_ranks, spawn_ranks

from hetccl.config import Settings
from hetccl.dtypes import DType, ReduceOp
from hetccl.errors import ProtocolError
from hetccl.native import reduce_into
from hetccl.transports.base import TransportContext
from hetccl.transports.tcp import TcpEndpoint, TcpTransport
from hetccl.wire import (
    CollOp,
    Fingerprint,
    fragment_count,
    fragment_span,
    pack_fragment_header,
    unpack_data_header,
    unpack_frame_header,
)

pytestmark = pytest.mark.timeout(120)


def _transport(rank: int, lost: list, offload: int = 64 << 10) -> TcpTransport:
    settings = dataclasses.replace(Settings.from_env({"HETCCL_TIMEOUT": "20"}), unexpected_bytes=64 << 20,
                                   socket_offload_bytes=offload)
    ctx = TransportContext(rank=rank, size=2, job="t", host_id="h", settings=settings, store=None,  # type: ignore[arg-type]
                           bind_host="127.0.0.1", on_peer_lost=lambda p, e: lost.append((p, e)))
    return TcpTransport(ctx)


def _endpoints(nstreams: int, lost: list, offload: int = 64 << 10) -> tuple[TcpEndpoint, TcpEndpoint]:
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(nstreams)]
    for s in (s for p in pairs for s in p):
        s.setblocking(False)
    return (TcpEndpoint(_transport(0, lost, offload), 1, [p[0] for p in pairs]),
            TcpEndpoint(_transport(1, lost, offload), 0, [p[1] for p in pairs]))


def _fp(seq: int, count: int = 0) -> Fingerprint:
    return Fingerprint(0, seq, CollOp.ALL_REDUCE, int(DType.FLOAT32), count, -1, int(ReduceOp.SUM))


def _sum_f32(dst: np.ndarray, src: np.ndarray) -> None:
    reduce_into(dst, src, DType.FLOAT32, ReduceOp.SUM)


@pytest.mark.parametrize("offload", [64 << 10, 1 << 40], ids=["threads", "loop"])
@pytest.mark.parametrize("nstreams", [1, 2, 3, 4])
async def test_endpoint_streams_odd_sizes(nstreams: int, offload: int) -> None:
    """Copies and reductions of sizes that divide neither by the streams nor by the alignment, some posted
    before the data arrives and some after (the early buffer), all in flight together; payloads moved by the
    streams' threads or all on the event loop."""
    lost: list = []
    a, b = _endpoints(nstreams, lost, offload)
    counts = [1, 1023, 65_537, 262_147, 1_000_003, 3 * (1 << 20) + 5]
    rng = np.random.default_rng(nstreams)
    srcs = [rng.integers(-8, 8, c).astype(np.float32) for c in counts]
    copies = [np.zeros(c, np.float32) for c in counts]
    sums = [np.ones(c, np.float32) for c in counts]
    futs = []
    for i, c in enumerate(counts):
        if i % 2 == 0:  # posted before the send; the odd ones after it has landed
            futs.append(b.post_recv(_fp(i, c), 1, copies[i].view(np.uint8)))
            futs.append(b.post_recv(_fp(i, c), 2, sums[i].view(np.uint8), _sum_f32))
    await asyncio.gather(*(a.send(_fp(i, c), tag, srcs[i].view(np.uint8))
                           for i, c in enumerate(counts) for tag in (1, 2)))
    await asyncio.sleep(0.2)
    for i, c in enumerate(counts):
        if i % 2:
            futs.append(b.post_recv(_fp(i, c), 1, copies[i].view(np.uint8)))
            futs.append(b.post_recv(_fp(i, c), 2, sums[i].view(np.uint8), _sum_f32))
    await asyncio.wait_for(asyncio.gather(*futs), 20)
    for i in range(len(counts)):
        assert np.array_equal(copies[i], srcs[i]), i
        assert np.array_equal(sums[i], srcs[i] + 1), i
    assert lost == [] and not b._assembling and not b.matcher.filling and not b.matcher.early
    await asyncio.gather(a.close(), b.close())


async def test_endpoint_size_mismatch_fails_the_receive() -> None:
    """A fragmented message longer than the posted receive fails it (CollectiveMismatchError); the streams
    stay framed and the next message arrives."""
    from hetccl.errors import CollectiveMismatchError

    lost: list = []
    a, b = _endpoints(3, lost)
    short = np.zeros(1 << 18, np.uint8)
    f1 = b.post_recv(_fp(1), 1, short)
    await a.send(_fp(1), 1, np.ones(1 << 20, np.uint8))
    with pytest.raises(CollectiveMismatchError):
        await asyncio.wait_for(f1, 10)
    ok = np.zeros(1 << 20, np.uint8)
    f2 = b.post_recv(_fp(2), 1, ok)
    await a.send(_fp(2), 1, np.full(1 << 20, 7, np.uint8))
    await asyncio.wait_for(f2, 10)
    assert (ok == 7).all() and lost == []
    await asyncio.gather(a.close(), b.close())


@pytest.mark.parametrize(("n", "nstreams", "offload"), [(2, 1, "64K"), (3, 3, "64K"), (2, 4, "1G")])
def test_job_over_streams(n: int, nstreams: int, offload: str) -> None:
    run_ranks(n, "tcp_stream_workers:streams_mix", timeout=200,
              env={"HETCCL_TRANSPORTS": "tcp", "HETCCL_SOCKET_NSTREAMS": str(nstreams),
                   "HETCCL_SOCKET_OFFLOAD_BYTES": offload, "HETCCL_CHUNK_BYTES": "4M", "HETCCL_TIMEOUT": "60"})


async def test_ends_agree_on_the_smaller_stream_count() -> None:
    """Rank 0 asks for 4 streams and rank 1 for 2: both open 2 authenticated connections (listener and dialer
    of the transport, HMAC handshake on each), and a fragmented message crosses them."""
    lost: list = []

    def transport(rank: int, nstreams: int) -> TcpTransport:
        settings = Settings.from_env({"HETCCL_TIMEOUT": "20", "HETCCL_SECRET": "s3cret",
                                      "HETCCL_SOCKET_NSTREAMS": str(nstreams)})
        ctx = TransportContext(rank=rank, size=2, job="j", host_id="h", settings=settings,
                               store=None,  # type: ignore[arg-type]
                               bind_host="127.0.0.1", on_peer_lost=lambda p, e: lost.append((p, e)))
        return TcpTransport(ctx)

    t0, t1 = transport(0, 4), transport(1, 2)
    r0, r1 = await t0.listen(), await t1.listen()
    eps0, eps1 = await asyncio.wait_for(asyncio.gather(t0.connect({1: r1}), t1.connect({0: r0})), 20)
    a, b = eps0[1], eps1[0]
    assert len(a.streams) == len(b.streams) == 2
    got = np.zeros((1 << 20) + 1, np.uint8)
    fut = b.post_recv(_fp(1), 5, got)
    await a.send(_fp(1), 5, np.full(len(got), 3, np.uint8))
    await asyncio.wait_for(fut, 10)
    assert (got == 3).all() and lost == [] and t0.refused == t1.refused == 0
    await asyncio.gather(t0.close(), t1.close())


@pytest.mark.parametrize("nstreams", [2, 4])
def test_dead_peer_mid_fragmented_message(nstreams: int) -> None:
    """The sender dies with a 256 MiB message cut across the streams half delivered: the receiver raises
    PeerLostError naming it, long before the 60 s deadline."""
    procs = spawn_ranks(2, "workers:die_mid_message", victim=1,
                        env={"HETCCL_TRANSPORTS": "tcp", "HETCCL_SOCKET_NSTREAMS": str(nstreams),
                             "HETCCL_SOCKET_OFFLOAD_BYTES": "64K", "HETCCL_TIMEOUT": "60"})
    assert_victim_named(finish(procs, 40), 1)


def test_dead_peer_mid_collective_over_streams() -> None:
    """A rank exits hard inside large all_reduces over 3 streams: both survivors name it."""
    procs = spawn_ranks(3, "workers:die_midway", victim=2,
                        env={"HETCCL_TRANSPORTS": "tcp", "HETCCL_SOCKET_NSTREAMS": "3",
                             "HETCCL_SOCKET_OFFLOAD_BYTES": "64K", "HETCCL_TIMEOUT": "60"})
    assert_victim_named(finish(procs, 60), 2)


@pytest.mark.parametrize(("nbytes", "parts"), [(1, 2), (4097, 2), (1 << 20, 4), ((1 << 20) + 3, 3),
                                               (300_001, 64), (5 << 30, 7)])
def test_fragments_tile_the_message(nbytes: int, parts: int) -> None:
    count = fragment_count(nbytes, parts)
    spans = [fragment_span(nbytes, parts, i) for i in range(count)]
    assert 1 <= count <= parts and all(length > 0 for _, length in spans)
    assert [off for off, _ in spans] == [sum(length for _, length in spans[:i]) for i in range(count)]
    assert sum(length for _, length in spans) == nbytes and all(off % 4096 == 0 for off, _ in spans)
    fp = _fp(3, 11)
    for i in range(count):
        assert unpack_frame_header(pack_fragment_header(fp, 9, nbytes, i, parts), 1 << 40) == \
            (fp, 9, nbytes, i, parts)
    with pytest.raises(ProtocolError, match="out of range"):
        unpack_frame_header(pack_fragment_header(fp, 9, nbytes, count, parts), 1 << 40)
    with pytest.raises(ProtocolError, match="bad data header"):  # shm and verbs never take fragments
        unpack_data_header(pack_fragment_header(fp, 9, nbytes, 0, parts), 1 << 40)


@pytest.mark.parametrize("parts", [0, 1, 65, 255])
def test_fragment_count_out_of_bounds_rejected(parts: int) -> None:
    with pytest.raises(ProtocolError):
        unpack_frame_header(pack_fragment_header(_fp(1), 1, 1 << 20, 0, parts), 1 << 40)


def test_native_socket_loops_end_every_wait() -> None:
    """The worker threads' native loops: a whole transfer; a stall ends at the no-progress deadline; a stop
    flag set by another thread ends the wait; the peer's close is EOF with the exact bytes received; a send to a
    closed peer is an error, not SIGPIPE."""
    import threading
    import time

    from hetccl._native import lib

    from hetccl.netio import new_stop_flag, pump_recv, pump_send

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    stop = new_stop_flag()
    payload = np.arange(3 << 20, dtype=np.uint32).view(np.uint8)
    got = np.zeros_like(payload)
    sender = threading.Thread(target=lambda: pump_send(a.fileno(), b"head", payload, 10.0, stop))
    sender.start()
    head = np.zeros(4, np.uint8)
    assert pump_recv(b.fileno(), head, 10.0, stop) == (0, 4) and bytes(head) == b"head"
    assert pump_recv(b.fileno(), got, 10.0, stop) == (0, len(got))
    sender.join()
    assert np.array_equal(got, payload)

    t0 = time.monotonic()
    assert pump_recv(b.fileno(), got[:10], 0.3, stop) == (lib.HCCL_IO_TIMEOUT, 0)
    assert 0.25 < time.monotonic() - t0 < 3

    threading.Timer(0.2, lambda: stop.__setitem__(0, 1)).start()
    t0 = time.monotonic()
    assert pump_recv(b.fileno(), got[:10], 30.0, stop) == (lib.HCCL_IO_STOPPED, 0)
    assert time.monotonic() - t0 < 3
    stop[0] = 0

    a.send(b"xyz")
    a.close()
    assert pump_recv(b.fileno(), got[:10], 10.0, stop) == (lib.HCCL_IO_EOF, 3)
    status, _sent = pump_send(b.fileno(), b"", payload, 10.0, stop)
    assert status < 0  # -EPIPE or -ECONNRESET
    b.close()
