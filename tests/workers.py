"""Functions that run inside rank processes (see rankrun.py). Each checks its own results and raises on
any difference, naming the case."""

from __future__ import annotations

import asyncio
import os
import time

import ml_dtypes
import numpy as np

import hetccl

DTYPES = ["int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
OPS = ["sum", "prod", "min", "max", "avg"]


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make(rank: int, count: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Deterministic per-rank data with small values: sums/products stay exact in every dtype."""
    rng = np.random.default_rng(1000 * rank + 7 * count + salt + DTYPES.index(dtype))
    lo = 0 if dtype == "uint8" else -3
    vals = rng.integers(lo, 4, size=count)
    vals[vals == 0] = 1
    return vals.astype(np_dtype(dtype))


def expected_reduce(n: int, count: int, dtype: str, op: str, salt: int = 0) -> np.ndarray:
    arrs = [make(r, count, dtype, salt).astype(np.float64) for r in range(n)]
    if op in ("sum", "avg"):
        res = np.sum(arrs, axis=0)
    elif op == "prod":
        res = np.prod(arrs, axis=0)
    elif op == "min":
        res = np.min(arrs, axis=0)
    else:
        res = np.max(arrs, axis=0)
    if op == "avg":
        res = np.trunc(res / n) if not dtype.startswith(("float", "bfloat")) else res / n
    if dtype in ("int8", "uint8", "int32", "int64"):
        return res.astype(np.int64).astype(np_dtype(dtype))  # wraparound like C
    return res.astype(np_dtype(dtype))


async def still_works(comm: hetccl.Communicator, after: str) -> None:
    """The job goes on: a barrier and a checked all_reduce on every rank."""
    await comm.barrier()
    buf = np.ones(1000, np.float32)
    await comm.all_reduce(buf)
    check(buf, np.full(1000, comm.size, np.float32), f"all_reduce {after}")


def check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.dtype.kind == "f" or got.dtype == np_dtype("bfloat16"):
        g, w = got.astype(np.float64), want.astype(np.float64)
        tol = 1e-2 if got.dtype.itemsize == 2 else 1e-6
        ok = np.allclose(g, w, rtol=tol, atol=tol)
    else:
        ok = np.array_equal(got, want)
    if not ok:
        bad = np.nonzero(got.astype(np.float64) != want.astype(np.float64))[0][:5]
        raise AssertionError(f"{what}: wrong at {bad.tolist()}: got {got[bad].tolist()} want {want[bad].tolist()}")


async def matrix(comm: hetccl.Communicator, counts: list[int], dtypes: list[str] | None = None,
                 ops: list[str] | None = None) -> None:
    """Every collective x dtype x op x count, checked against numpy."""
    n, r = comm.size, comm.rank
    for dtype in dtypes or DTYPES:
        dt = np_dtype(dtype)
        for count in counts:
            for op in ops or OPS:
                what = f"rank {r}/{n} all_reduce {dtype} {op} count={count}"
                buf = make(r, count, dtype)
                await comm.all_reduce(buf, op=op)
                check(buf, expected_reduce(n, count, dtype, op), what)
                root = count % n
                buf = make(r, count, dtype)
                orig = buf.copy()
                await comm.reduce(buf, root=root, op=op)
                check(buf, expected_reduce(n, count, dtype, op) if r == root else orig,
                      f"rank {r}/{n} reduce root={root} {dtype} {op} count={count}")
                # reduce_scatter: input n*count
                inp = make(r, n * count, dtype, salt=1)
                out = np.zeros(count, dt)
                await comm.reduce_scatter(out, inp, op=op)
                want = expected_reduce(n, n * count, dtype, op, salt=1)[r * count:(r + 1) * count]
                check(out, want, f"rank {r}/{n} reduce_scatter {dtype} {op} count={count}")
            # data movement collectives, once per dtype and count
            inp = make(r, count, dtype)
            out = np.zeros(n * count, dt)
            await comm.all_gather(out, inp)
            check(out, np.concatenate([make(p, count, dtype) for p in range(n)]),
                  f"rank {r}/{n} all_gather {dtype} count={count}")
            root = (count + 1) % n
            buf = make(r, count, dtype, salt=2)
            await comm.broadcast(buf, root=root)
            check(buf, make(root, count, dtype, salt=2), f"rank {r}/{n} broadcast root={root} {dtype} count={count}")
            inp = make(r, n * count, dtype, salt=3)
            out = np.zeros(n * count, dt)
            await comm.all_to_all(out, inp)
            want = np.concatenate([make(p, n * count, dtype, salt=3)[r * count:(r + 1) * count] for p in range(n)])
            check(out, want, f"rank {r}/{n} all_to_all {dtype} count={count}")
            root = count % n
            inp = make(r, count, dtype, salt=4)
            out = np.zeros(n * count, dt) if r == root else None
            await comm.gather(out, inp, root=root)
            if r == root:
                check(out, np.concatenate([make(p, count, dtype, salt=4) for p in range(n)]),
                      f"rank {r}/{n} gather {dtype} count={count}")
            src = make(root, n * count, dtype, salt=5) if r == root else None
            out = np.zeros(count, dt)
            await comm.scatter(out, src, root=root)
            check(out, make(root, n * count, dtype, salt=5)[r * count:(r + 1) * count],
                  f"rank {r}/{n} scatter {dtype} count={count}")
    await comm.barrier()


def check_hosts(fab: object, hosts: list[str]) -> None:
    """The job ran with HETCCL_HOST giving job rank p the host name hosts[p] (all on this machine): ranks with one
    name are one host and share memory (unless HETCCL_TRANSPORTS leaves shm out), ranks with different names
    reach each other by TCP only (verbs where an RDMA device is up); the cost model sees "tcp" across."""
    r, n = fab.rank, fab.size  # type: ignore[attr-defined]
    assert [rec.get("host_name") for rec in fab.records] == hosts, (fab.records, hosts)  # type: ignore[attr-defined]
    topo = fab.topology  # type: ignore[attr-defined]
    local = [p for p in range(n) if hosts[p] == hosts[r]]
    assert topo.num_hosts == len(set(hosts)) and topo.local_ranks(r) == local, (topo.hosts, hosts)
    shm = "shm" in (fab.settings.transports or ["shm"])  # type: ignore[attr-defined]
    across = "verbs" if "verbs" in [t.name for t in fab.transports] else "tcp"  # type: ignore[attr-defined]
    want = {p: "shm" if shm and p in local else across for p in range(n) if p != r}
    assert fab.peer_transport == want, f"rank {r}: peer_transport {fab.peer_transport} != {want}"  # type: ignore
    remote = [p for p in range(n) if p not in local]
    assert not remote or fab.transport_kind(remote) == "tcp"  # type: ignore[attr-defined]
    # still one machine: its CPUs (shm's spinning) and ports (metrics) are counted over every rank
    assert topo.machine_ranks(r) == list(range(n)) and topo.machine_rank(r) == r, topo
    for t in fab.transports:  # type: ignore[attr-defined]
        assert t.ctx.machine_ranks == list(range(n)), (t.name, t.ctx.machine_ranks)


async def every_op(comm: hetccl.Communicator, hosts: list[str] | None = None, **matrix_args: object) -> None:
    """Every collective (matrix), then send/recv (p2p) and collectives in flight at once (concurrent); first,
    with `hosts`, the fabric HETCCL_HOST made."""
    if hosts:
        check_hosts(comm._fabric, hosts)
    await matrix(comm, **matrix_args)  # type: ignore[arg-type]
    await p2p(comm)
    await concurrent(comm, k=8)


async def connects_on_first_use(comm: hetccl.Communicator) -> None:
    """HETCCL_CONNECT=lazy, every peer over TCP: no data connection after init; a ring all_reduce connects each
    rank to its two ring neighbours and to no one else; then every collective, p2p and collectives in flight
    connect what they need and give right results."""
    fab = comm._fabric
    tcp = next(t for t in fab.transports if t.name == "tcp")
    r, n = comm.rank, comm.size

    def connected() -> set[int]:
        return {p for p, ep in tcp._lazy.items() if ep.connected}

    assert sorted(tcp._lazy) == [p for p in range(n) if p != r], sorted(tcp._lazy)
    before = connected()
    x = np.ones(1 << 20, np.float32)  # 4 MiB: the ring
    await comm.all_reduce(x)
    check(x, np.full(1 << 20, n, np.float32), "lazy ring all_reduce")
    ring = {(r - 1) % n, (r + 1) % n}
    assert connected() - before <= ring and ring <= connected(), (r, before, connected())
    await every_op(comm, counts=[0, 1, 4099], dtypes=["float32", "int64"], ops=["sum", "max"])


async def connects_at_init(comm: hetccl.Communicator) -> None:
    """HETCCL_CONNECT=auto in a job smaller than HETCCL_CONNECT_LAZY_FROM: every TCP peer connected at init."""
    tcp = next(t for t in comm._fabric.transports if t.name == "tcp")
    assert not tcp._lazy, sorted(tcp._lazy)
    assert sorted(comm._fabric.endpoints) == [p for p in range(comm.size) if p != comm.rank]
    x = np.ones(1 << 20, np.float32)
    await comm.all_reduce(x)
    check(x, np.full(1 << 20, comm.size, np.float32), "eager ring all_reduce")


async def paced(comm: hetccl.Communicator, rate: int) -> None:
    """HETCCL_SOCKET_MAX_RATE=rate over TCP: every connection to a peer is paced at its even part (the kernel's
    own reading of the option), and a 4 MiB ring all_reduce, which sends 4 MiB to the peer, takes at least half
    of what that rate allows (a loaded machine only makes it slower); its result is exact."""
    import socket

    for peer, ep in comm._fabric.endpoints.items():
        got = [s.getsockopt(socket.SOL_SOCKET, getattr(socket, "SO_MAX_PACING_RATE", 47)) for s in ep.socks]
        assert got == [rate // len(ep.socks)] * len(ep.socks), (peer, got)
    x = np.ones(1 << 20, np.float32)
    t0 = time.perf_counter()
    await comm.all_reduce(x)
    took = time.perf_counter() - t0
    check(x, np.full(1 << 20, comm.size, np.float32), "paced all_reduce")
    assert took >= 0.5 * (4 << 20) / rate, took


async def in_place_variants(comm: hetccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    # all_gather in place: inp is this rank's slice of out
    out = np.zeros(n * 5, np.float32)
    out[r * 5:(r + 1) * 5] = r + 1
    await comm.all_gather(out, out[r * 5:(r + 1) * 5])
    check(out, np.repeat(np.arange(1, n + 1, dtype=np.float32), 5), "in-place all_gather")


async def p2p(comm: hetccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    # ring exchange plus several messages in flight per pair, matched in order
    right, left = (r + 1) % n, (r - 1) % n
    for count in (0, 1, 1000, 300_000):
        out = np.arange(count, dtype=np.int64) + r
        got = np.zeros(count, np.int64)
        await asyncio.gather(comm.send(out, right), comm.recv(got, left))
        check(got, np.arange(count, dtype=np.int64) + left, f"p2p count={count}")
    if r == 0:
        await asyncio.gather(*(comm.send(np.full(10, i, np.int32), 1) for i in range(5)))
    elif r == 1:
        bufs = [np.zeros(10, np.int32) for _ in range(5)]
        await asyncio.gather(*(comm.recv(b, 0) for b in bufs))
        for i, b in enumerate(bufs):
            check(b, np.full(10, i, np.int32), f"p2p ordered message {i}")


async def concurrent(comm: hetccl.Communicator, k: int = 16) -> None:
    """Many collectives in flight at once, of different kinds and sizes, all correct."""
    n, r = comm.size, comm.rank
    bufs = [np.full(1 + 37 * i * i, r + i, np.float32) for i in range(k)]
    outs = [np.zeros(n * 100, np.int32) for _ in range(k)]
    tasks = []
    for i in range(k):
        tasks.append(comm.all_reduce(bufs[i]))
        tasks.append(comm.all_gather(outs[i], np.full(100, r * 1000 + i, np.int32)))
    await asyncio.gather(*tasks)
    for i in range(k):
        check(bufs[i], np.full(len(bufs[i]), sum(p + i for p in range(n)), np.float32), f"concurrent ar {i}")
        check(outs[i], np.repeat(np.arange(n) * 1000 + i, 100).astype(np.int32), f"concurrent ag {i}")


async def split(comm: hetccl.Communicator) -> None:
    n, r = comm.size, comm.rank
    sub = await comm.split(r % 2, key=-r)  # reverse order inside each color
    members = [p for p in range(n) if p % 2 == r % 2]
    assert sub is not None and sub.size == len(members), (sub, members)
    assert sub.rank == sorted(members, reverse=True).index(r), (sub.rank, r)
    buf = np.array([r], np.int64)
    await sub.all_reduce(buf)
    assert buf[0] == sum(members), (buf, members)
    none = await comm.split(None if r == 0 else 1)
    assert (none is None) == (r == 0)
    if none is not None:
        b = np.ones(3, np.float32)
        await none.all_reduce(b)
        check(b, np.full(3, n - 1, np.float32), "split without rank 0")
    await comm.synchronize()  # host memory only: nothing on a device to wait for
    await comm.barrier()


async def torch_buffers(comm: hetccl.Communicator) -> None:
    import torch

    n, r = comm.size, comm.rank
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        t = torch.full((3, 5), r + 1, dtype=dt)
        await comm.all_reduce(t)
        assert torch.equal(t, torch.full((3, 5), n * (n + 1) // 2, dtype=dt)), (dt, t)
    out = torch.zeros(n, 4)
    await comm.all_gather(out, torch.full((4,), float(r)))
    assert torch.equal(out, torch.arange(n, dtype=torch.float32)[:, None].expand(n, 4)), out


async def errors(comm: hetccl.Communicator) -> None:
    """Bad input gives ConfigError before anything is sent; the communicator still works after."""
    bad = [
        lambda: comm.all_reduce(np.ones((4, 4), np.float32)[:, 0]),  # non-contiguous
        lambda: comm.all_reduce(np.ones(4, np.complex64)),
        lambda: comm.all_reduce(np.ones(4, np.float32), op="xor"),
        lambda: comm.broadcast(np.ones(4, np.float32), root=comm.size),
        lambda: comm.all_gather(np.ones(3, np.float32), np.ones(2, np.float32)),
    ]
    ro = np.ones(4, np.float32)
    ro.flags.writeable = False
    bad.append(lambda: comm.all_reduce(ro))
    for make_call in bad:
        try:
            await make_call()
        except hetccl.ConfigError:
            continue
        raise AssertionError("bad input was accepted")
    buf = np.ones(4, np.float32)
    await comm.all_reduce(buf)
    check(buf, np.full(4, comm.size, np.float32), "all_reduce after errors")


async def sync_facade(**_: object) -> None:
    comm = hetccl.init_sync()
    n = comm.size
    buf = np.ones(10, np.float64)
    comm.all_reduce(buf, op="sum")
    check(buf, np.full(10, n, np.float64), "sync all_reduce")
    # small all_reduces (on the caller's thread where nothing is in flight) mixed with ones the loop runs (large,
    # async through submit) and other collectives: results in order
    pending = None
    for i in range(120):
        b = np.full(256, float(comm.rank + i), np.float32)
        op = "max" if i % 3 == 2 else "avg" if i % 5 == 4 else "sum"
        comm.all_reduce(b, op=op)
        total = float(sum(r + i for r in range(n)))
        want = {"max": float(n - 1 + i), "sum": total, "avg": total / n}[op]
        check(b, np.full(256, want, np.float32), f"small all_reduce {i}")
        if i % 40 == 0:
            big = np.ones(1 << 20, np.float32)
            pending = comm.submit(comm.async_comm.all_reduce(big))  # in flight while the next small one goes
        elif i % 40 == 1:
            pending.result(60)
            check(big[::4096], np.full(256, n, np.float32), "large all_reduce")
            comm.barrier()
    # the other small collectives on the caller's thread too, with one in flight on the loop now and then
    for i in range(30):
        x = np.full(8, float(comm.rank + i), np.float32)
        comm.broadcast(x, root=i % n)
        check(x, np.full(8, float(i % n + i), np.float32), f"small broadcast {i}")
        out = np.empty(8 * n, np.float32)
        comm.all_gather(out, np.full(8, float(comm.rank + i), np.float32))
        check(out, np.repeat(np.arange(n, dtype=np.float32) + i, 8), f"small all_gather {i}")
        part = np.empty(8, np.float32)
        comm.reduce_scatter(part, np.arange(8 * n, dtype=np.float32) + comm.rank)
        want = n * (np.arange(8, dtype=np.float32) + 8 * comm.rank) + sum(range(n))
        check(part, want.astype(np.float32), f"small reduce_scatter {i}")
        if i % 10 == 0:
            pending = comm.submit(comm.async_comm.broadcast(big, 0))
        comm.barrier()
        if i % 10 == 0:
            pending.result(60)
    sub = comm.split(0)
    assert sub is not None and sub.size == comm.size
    sub.barrier()
    # a mismatch through the facade still raises on every rank
    try:
        comm.all_reduce(np.ones(4, np.float32 if comm.rank == 0 else np.float64))
    except hetccl.HetcclError as exc:
        print(f"rank {comm.rank}: facade mismatch raised {type(exc).__name__}", flush=True)
    else:
        raise AssertionError("a dtype mismatch through the facade was not raised")
    comm.close()


sync_facade.no_init = True  # type: ignore[attr-defined]


async def die_midway(comm: hetccl.Communicator, victim: int) -> None:
    """The victim exits hard in the middle of a large all_reduce; survivors must raise PeerLostError
    naming it, quickly."""
    buf = np.ones(8 << 20, np.float32)
    t0 = time.monotonic()
    try:
        await comm.all_reduce(buf)
        if comm.rank == victim:
            os._exit(17)
        t0 = time.monotonic()
        for _ in range(50):  # peers still inside the first all_reduce may fail there: that's fine too
            await comm.all_reduce(buf)
    except hetccl.PeerLostError as exc:
        took = time.monotonic() - t0
        assert took < 10, f"took {took:.1f} s"
        print(f"rank {comm.rank}: PeerLostError rank={exc.rank}: {exc}", flush=True)
        await asyncio.sleep(3)  # stay alive so the other survivors also see the victim, not us, go first
        os._exit(0 if exc.rank in (victim, -1) else 3)
    except hetccl.HetcclError as exc:
        print(f"rank {comm.rank}: other error {exc!r}", flush=True)
        os._exit(4)
    os._exit(5)


async def die_mid_message(comm: hetccl.Communicator, victim: int) -> None:
    """The victim dies with a large point-to-point message to the other rank half delivered: the receiver,
    whose receive has already taken the first fragments, must raise PeerLostError naming it (well before the
    60 s deadline), not wait for the rest."""
    import threading

    other = 1 - victim
    big = np.ones(64 << 20, np.float32)  # 256 MiB: tens of ms to move, far longer than the victim lives
    await comm.barrier()
    if comm.rank == victim:
        await asyncio.sleep(0.05)  # the receive is posted by now
        threading.Timer(0.003, os._exit, (17,)).start()  # fires even while the loop is inside a long copy
        await comm.send(big, other)
        await asyncio.sleep(10)
        os._exit(6)  # the timer never fired
    t0 = time.monotonic()
    try:
        await comm.recv(big, victim)
    except hetccl.PeerLostError as exc:
        took = time.monotonic() - t0
        assert took < 10, f"took {took:.1f} s"
        print(f"rank {comm.rank}: PeerLostError rank={exc.rank}: {exc}", flush=True)
        os._exit(0 if exc.rank == victim else 3)
    print(f"rank {comm.rank}: the whole message arrived", flush=True)
    os._exit(5)


async def missing_rank(**_: object) -> None:
    """World size 2 but rank 1 never starts: rank 0's init must fail with CollectiveTimeout."""
    t0 = time.monotonic()
    try:
        await hetccl.init(rank=0, world_size=2, addr=os.environ["TEST_ADDR"], timeout=2.0)
    except hetccl.CollectiveTimeout as exc:
        print("timeout ok:", exc, f"{time.monotonic() - t0:.1f}s")
        return
    raise AssertionError("init returned without the second rank")


missing_rank.no_init = True  # type: ignore[attr-defined]


async def stuck_peer(comm: hetccl.Communicator) -> None:
    """Rank 1 never calls the collective: rank 0 times out (HETCCL_TIMEOUT) with a clear error."""
    if comm.rank == 0:
        try:
            await comm.all_reduce(np.ones(100, np.float32))
        except hetccl.CollectiveTimeout as exc:
            assert "rank" in str(exc) and "all_reduce" in str(exc), exc
            print("timeout ok:", exc)
            return
        raise AssertionError("all_reduce completed without rank 1")
    await asyncio.sleep(float(os.environ["HETCCL_TIMEOUT"]) + 1)


async def stranger(comm: hetccl.Communicator) -> None:
    """A connection without the job secret to rank 0's store and data port is refused; the job goes on."""
    import socket

    from hetccl.auth import client_handshake
    from hetccl.errors import AuthenticationError, PeerLostError

    fabric = comm._fabric
    if comm.rank == 1:
        loop = asyncio.get_running_loop()
        targets = [tuple(fabric.identity.addr)]
        rec = fabric.records[0]["transports"].get("tcp")
        if rec:
            targets.append((rec["host"], rec["port"]))
        for host, port in targets:
            for secret in (b"wrong-secret", b""):
                s = socket.socket()
                s.setblocking(False)
                await loop.sock_connect(s, (host, port))
                try:
                    await client_handshake(loop, s, secret, "store" if port == targets[0][1] else "data",
                                           {"rank": 0, "job": fabric.job}, 5.0)
                except (AuthenticationError, PeerLostError):
                    pass
                else:
                    raise AssertionError(f"stranger with secret {secret!r} was accepted at {host}:{port}")
                finally:
                    s.close()
            # garbage and silence
            s = socket.create_connection((host, port))
            s.sendall(b"\xff" * 64)
            s.close()
    await still_works(comm, "after strangers")
    if comm.rank == 0:
        refused = fabric.server.refused + sum(getattr(t, "refused", 0) for t in fabric.transports)
        assert refused >= 3, refused
        print("refused", refused)


async def _disagree(comm: hetccl.Communicator, kind: str, odd: bool, buf32: np.ndarray) -> None:
    """One collective on which the odd rank disagrees with the others by `kind` (count: its buf32 is longer;
    dtype, op, collective, root, order)."""
    if kind == "dtype" and odd:
        await comm.all_reduce(np.ones(1000, np.int32))
    elif kind == "op" and odd:
        await comm.all_reduce(buf32, op="max")
    elif kind == "collective":
        await (comm.broadcast(buf32, root=0) if odd else comm.all_reduce(buf32))
    elif kind == "root":
        await comm.broadcast(buf32, root=1 if odd else 0)
    elif kind == "order":  # the odd rank issues the same two collectives in the other order
        out = np.zeros(1000 * comm.size, np.float32)
        if odd:
            await comm.all_gather(out, buf32)
            await comm.all_reduce(buf32)
        else:
            await comm.all_reduce(buf32)
            await comm.all_gather(out, buf32)
    else:
        await comm.all_reduce(buf32)


async def mismatch(comm: hetccl.Communicator, kind: str) -> None:
    """Rank 1 disagrees with the others on a collective: every rank raises CollectiveMismatchError naming
    the ranks and both sides' descriptions, quickly (a fingerprint in the data, no extra round trip)."""
    r = comm.rank
    odd = r == 1
    buf32 = np.ones(1000 if (kind != "count" or not odd) else 1001, np.float32)
    t0 = time.monotonic()
    try:
        await _disagree(comm, kind, odd, buf32)
        # a rank whose part of the odd collective completed (a broadcast root only sends) learns of the
        # mismatch from another rank's notice: its next collective raises
        await comm.barrier()
    except hetccl.CollectiveMismatchError as exc:
        text = str(exc)
        took = time.monotonic() - t0
        assert "rank" in text and took < 10, (text, took)
        os.write(1, f"mismatch ok rank {r} ({took:.2f} s): {text}\n".encode())  # one write: shared stdout
        return
    raise AssertionError(f"rank {r}: mismatched collectives ({kind}) completed")


async def signed_zero_ties(comm: hetccl.Communicator) -> None:
    """min/max of -0.0 and +0.0 must give bitwise the same answer on every rank, on every algorithm."""
    r = comm.rank
    for op in ("min", "max"):
        buf = np.array([-0.0 if r % 2 else 0.0] * 8, np.float32)
        await comm.all_reduce(buf, op=op)
        bits = buf.view(np.int32).copy()
        table = np.zeros(comm.size * 8, np.int32)
        await comm.all_gather(table, bits)
        assert (table.reshape(comm.size, 8) == bits).all(), (op, table)  # every rank has the same bits


async def p2p_beside_collective(comm: hetccl.Communicator) -> None:
    """A send and a broadcast in flight together, issued in different orders on the two ranks: p2p and
    collectives are matched separately and both complete."""
    r = comm.rank
    b = np.full(4, 5.0 if r == 0 else 0.0, np.float32)
    if r == 0:
        await asyncio.gather(comm.send(np.arange(3, dtype=np.int64), 1), comm.broadcast(b, root=0))
    elif r == 1:
        got = np.zeros(3, np.int64)
        await asyncio.gather(comm.broadcast(b, root=0), comm.recv(got, 0))
        check(got, np.arange(3, dtype=np.int64), "p2p beside broadcast")
    else:
        await comm.broadcast(b, root=0)
    check(b, np.full(4, 5.0, np.float32), "broadcast beside p2p")


async def shrink_after_loss(comm: hetccl.Communicator, victim: int) -> None:
    """The victim dies; the survivors see PeerLostError, shrink, and the new communicator works (ranks
    renumbered in the old order) while the old one refuses further use."""
    buf = np.ones(1 << 20, np.float32)
    try:
        await comm.all_reduce(buf)  # the victim may leave before its last frames were read: a loss here too
        if comm.rank == victim:
            os._exit(17)
        for _ in range(100):
            await comm.all_reduce(buf)
        raise AssertionError("no PeerLostError")
    except hetccl.PeerLostError:
        pass
    new = await comm.shrink()
    assert new.size == comm.size - 1, (new.size, comm.size)
    assert new.rank == comm.rank - (1 if comm.rank > victim else 0), (new.rank, comm.rank)
    x = np.full(1000, float(new.rank + 1), np.float32)
    await new.all_reduce(x)
    check(x, np.full(1000, new.size * (new.size + 1) / 2, np.float32), "all_reduce after shrink")
    big = np.full(3 << 20, float(new.rank), np.float32)
    await new.broadcast(big, root=new.size - 1)
    check(big, np.full(3 << 20, float(new.size - 1), np.float32), "broadcast after shrink")
    out = np.zeros(4 * new.size, np.int64)
    await new.all_gather(out, np.full(4, comm.rank, np.int64))
    survivors = [r for r in range(comm.size) if r != victim]
    check(out, np.repeat(np.array(survivors, np.int64), 4), "all_gather after shrink")
    try:
        await comm.barrier()
        raise AssertionError("the shrunk communicator still works")
    except hetccl.CommAbortedError:
        pass
    os.write(1, f"shrink ok: rank {comm.rank} -> {new.rank}/{new.size}\n".encode())
    # a survivor that exits while another still finishes the last collective would fail it: close (the
    # closing barrier is bounded when ranks are lost, even with rank 0's store gone)
    await new.barrier()
    await comm.close()
    os._exit(0)


async def abort_in_flight(comm: hetccl.Communicator) -> None:
    """Rank 1 never joins; rank 0 aborts its pending all_reduce, which ends at once with CommAbortedError, and
    later calls raise it too."""
    if comm.rank == 1:
        await asyncio.sleep(4)
        os._exit(0)
    task = asyncio.ensure_future(comm.all_reduce(np.ones(1 << 16, np.float32)))
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    comm.abort()
    try:
        await task
        raise AssertionError("aborted all_reduce completed")
    except hetccl.CommAbortedError:
        took = time.monotonic() - t0
        assert took < 1.0, took
    try:
        await comm.barrier()
        raise AssertionError("barrier after abort completed")
    except hetccl.CommAbortedError:
        pass
    os.write(1, f"abort ok after {took * 1000:.1f} ms\n".encode())
    os._exit(0)


async def hang_report(comm: hetccl.Communicator, blocked: bool) -> None:
    """Rank 2 stops after the first all_reduce (its event loop alive, or blocked): ranks 0 and 1 time out in the
    second one, and the hang report they gather names rank 2 as behind (or as not answering), in the error
    and in HETCCL_DUMP_DIR."""
    import json
    from pathlib import Path

    await comm.all_reduce(np.ones(10, np.float32))
    dump = Path(os.environ["HETCCL_DUMP_DIR"])
    # every rank leaves once both reporters have their report (one leaving earlier would fail the other's
    # gathering), or after a bound beyond both reporters' timeout and report gathering
    deadline = time.monotonic() + float(os.environ["HETCCL_TIMEOUT"]) + 12

    def both_done() -> bool:
        return len(list(dump.glob("reported-*"))) == 2 or time.monotonic() > deadline

    if comm.rank == 2:
        while not both_done():
            if blocked:
                time.sleep(0.05)
            else:
                await asyncio.sleep(0.05)
        os._exit(0)
    try:
        await comm.all_reduce(np.ones(10, np.float32))
        raise AssertionError("completed without rank 2")
    except hetccl.CollectiveTimeout as exc:
        text = str(exc)
    want = "no answer from [2]" if blocked else "ranks behind [2]"
    assert want in text, text
    files = list(dump.glob(f"hang-*-rank{comm._fabric.rank}-*.json"))
    assert len(files) == 1, files
    rep = json.loads(files[0].read_text())
    r2 = rep["ranks"][2]
    assert (("host" not in r2) if blocked else r2["behind"]), rep
    if not blocked:  # where rank 2 stands: its main task, awaiting in this function (in the error too)
        assert r2["where"].endswith("in hang_report") and r2["where"] in text, (r2, text)
    # the other reporter is still inside #1, or (under load) timed out a moment earlier and says so
    assert rep["ranks"][1 - comm.rank]["state"].startswith(("inside #1", "gave up on #1 (failed after")), rep
    os.write(1, f"hang report ok rank {comm.rank}: {r2['state']}\n".encode())
    (dump / f"reported-{comm.rank}").touch()
    while not both_done():
        await asyncio.sleep(0.05)
    os._exit(0)


async def bound_to_interface(comm: hetccl.Communicator) -> None:
    """HETCCL_SOCKET_IFNAME=lo: the data listener is bound to lo's address, not to every interface."""
    tcp = next(t for t in comm._fabric.transports if t.name == "tcp")
    addr = tcp._listener._sock.getsockname()[0]
    assert addr == "127.0.0.1", addr
    x = np.ones(10, np.float32)
    await comm.all_reduce(x)
    check(x, np.full(10, comm.size, np.float32), "all_reduce over the chosen interface")
    os.write(1, f"bound ok {addr}\n".encode())


async def close_one_early(comm: hetccl.Communicator, issued: int, delay: float = 0.0) -> None:
    """Rank 1 issues one all_reduce fewer than the others and closes: the others must raise
    CollectiveMismatchError at once, naming rank 1 and where each side stopped, not PeerLostError after the
    closing barrier's 10 s. With `delay` the others start their last all_reduce only after rank 1's goodbye has
    arrived (it must raise as it starts); without, usually while it waits."""
    buf = np.ones(1000, np.float32)
    for _ in range(issued - 1):
        await comm.all_reduce(buf)
    if comm.rank == 1:
        return  # rankrun's main closes the communicator
    await asyncio.sleep(delay)
    t0 = time.monotonic()
    try:
        await comm.all_reduce(buf)
    except hetccl.CollectiveMismatchError as exc:
        took = time.monotonic() - t0
        os.write(1, f"closed-early ok rank {comm.rank} ({took:.2f} s): {exc}\n".encode())
        return
    raise AssertionError(f"rank {comm.rank}: all_reduce #{issued - 1} completed without rank 1")


async def mismatch_then_exit(comm: hetccl.Communicator, kind: str) -> None:
    """Like `mismatch`, on 3+ ranks, but rank 1 (the odd one) leaves the process the moment its
    CollectiveMismatchError reaches it (os._exit: no close, no goodbye, no atexit): the notice must already be on
    the wire, so the others still report the mismatch (naming both ranks), not a lost peer."""
    r = comm.rank
    odd = r == 1
    buf32 = np.ones(2000 if kind == "count" and odd else 1000, np.float32)
    t0 = time.monotonic()
    try:
        await _disagree(comm, kind, odd, buf32)
        await comm.barrier()
    except hetccl.CollectiveMismatchError as exc:
        took = time.monotonic() - t0
        os.write(1, f"mismatch-exit ok rank {r} ({took:.2f} s): {exc}\n".encode())
        if odd:
            os._exit(5)
        t1 = time.monotonic()
        await comm.close()  # its closing barrier must stop waiting once rank 1's connections are gone
        os.write(1, f"closed in {time.monotonic() - t1:.2f} s\n".encode())
        return
    except hetccl.HetcclError as exc:
        os.write(1, f"mismatch-exit WRONG rank {r}: {type(exc).__name__}: {exc}\n".encode())
        raise
    raise AssertionError(f"rank {r}: mismatched collectives ({kind}) completed")


async def settings_disagree(name: str) -> None:
    """Ranks started with different values of a setting every rank must share: init fails on each, naming it."""
    try:
        comm = await hetccl.init()
    except hetccl.ConfigError as exc:
        assert name in str(exc) and "differs between ranks" in str(exc), exc
        return
    await comm.close()
    raise AssertionError(f"ranks with different {name} were not refused")


settings_disagree.no_init = True  # type: ignore[attr-defined]


# ---- HETCCL_CROSS_COMPRESS (hetccl/compress.py) ------------------------------------------------------------
WIRE_UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp8": 2.0 ** -4}  # unit roundoff of each wire format
WIRE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}
ACC_UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def _lossy(rank: int, count: int, dtype: str, salt: int) -> np.ndarray:
    """Per-rank floats of every magnitude in [2^-8, 4] (positive in [0.5, 2] for products), exact in dtype."""
    rng = np.random.default_rng([rank, count, DTYPES.index(dtype), salt])
    if dtype == "int32":
        return rng.integers(-3, 4, size=count).astype(np.int32)
    mag = rng.uniform(0.5, 2, count) if salt == 1 else 2.0 ** rng.uniform(-8, 2, count)
    return (mag * rng.choice([-1.0, 1.0], count)).astype(np_dtype(dtype))


def _within(got: np.ndarray, ins: list[np.ndarray], op: str, dtype: str, wire: str | None, what: str) -> None:
    """got against the fp64 reduction of ins, within what one rounding to the wire per input and per result,
    and two roundings per input of the accumulation in dtype, allow (an fp8 subnormal's absolute error, at most
    2^-10 of a group's largest magnitude / 224, besides). wire None: no rounding to a wire."""
    n = len(ins)
    u = WIRE_UNIT[wire] if wire else 0.0
    x = np.array([a.astype(np.float64) for a in ins])
    ref = {"sum": x.sum(0), "avg": x.sum(0) / n, "prod": x.prod(0), "min": x.min(0), "max": x.max(0)}[op]
    acc = ACC_UNIT[dtype]
    if op == "prod":
        tol = np.abs(ref) * ((1 + u) ** (2 * n) * (1 + acc) ** (2 * n) - 1) * 1.1
    else:
        tol = ((2 * u + 2 * n * acc) * np.abs(x).sum(0) + (1e-5 * np.abs(x).max() if wire == "fp8" else 0.0)) * 1.1
        tol = tol / n if op == "avg" else tol
    bad = np.nonzero(~(np.abs(got.astype(np.float64) - ref) <= tol))[0]
    if len(bad):
        i = bad[:4]
        raise AssertionError(f"{what}: {len(bad)} elements off, at {i.tolist()}: got "
                             f"{got[i].astype(np.float64).tolist()} want {ref[i].tolist()} within {tol[i].tolist()}")


async def compressed(comm: hetccl.Communicator, counts: list[int]) -> None:
    """Every wire format in turn (comm.settings is every group's of this job: each rank switches at the same
    point; HETCCL_CROSS_COMPRESS_MIN=0): all_reduce with each op, reduce_scatter and all_gather of every float
    dtype against an fp64 reference within the wire's bound, and int32 exact. That the bytes were cast is
    checked too: 1 + 2^-12 is in none of the formats, and comes back as 1."""
    n, r = comm.size, comm.rank
    odd = 1 + 2.0 ** -12
    for wire in ("bf16", "fp16", "fp8"):
        comm.settings.cross_compress = wire
        for dtype in ("float32", "float64", "bfloat16", "float16", "int32"):
            lossy = dtype != "int32" and WIRE_BYTES[wire] < np_dtype(dtype).itemsize
            lossy_wire = wire if lossy else None
            for count in counts:
                tag = f"{wire} {dtype} count={count}"
                for op in (["sum", "max"] if dtype == "int32" else ["sum", "avg", "prod", "min", "max"]):
                    salt = 1 if op == "prod" else 0
                    ins = [_lossy(q, count, dtype, salt) for q in range(n)]
                    buf = ins[r].copy()
                    await comm.all_reduce(buf, op)
                    if dtype == "int32":
                        check(buf, expected_like(ins, op), f"all_reduce {op} {tag}")
                    else:
                        _within(buf, ins, op, dtype, lossy_wire, f"all_reduce {op} {tag}")
                ins = [_lossy(q, n * count, dtype, 2) for q in range(n)]
                out = np.zeros(count, ins[r].dtype)
                await comm.reduce_scatter(out, ins[r], "sum")
                blocks = [a[r * count:(r + 1) * count] for a in ins]
                if dtype == "int32":
                    check(out, expected_like(blocks, "sum"), f"reduce_scatter {tag}")
                else:
                    _within(out, blocks, "sum", dtype, lossy_wire, f"reduce_scatter {tag}")
                mine = _lossy(r, count, dtype, 3)
                every = np.zeros(n * count, mine.dtype)
                await comm.all_gather(every, mine)
                for q in range(n):
                    got = every[q * count:(q + 1) * count]
                    if dtype == "int32":
                        check(got, _lossy(q, count, dtype, 3), f"all_gather {tag} block {q}")
                    else:
                        _within(got, [_lossy(q, count, dtype, 3)], "sum", dtype, lossy_wire, f"all_gather {tag} {q}")
            if lossy and dtype in ("float32", "float64"):
                buf = np.full(counts[-1], odd, np_dtype(dtype))
                await comm.all_reduce(buf)
                assert np.all(buf == n), f"all_reduce {wire} {dtype}: the bytes were not cast ({buf[:3]})"
                every = np.zeros(n * counts[-1], np_dtype(dtype))
                await comm.all_gather(every, np.full(counts[-1], odd, np_dtype(dtype)))
                assert np.all(every == 1), f"all_gather {wire} {dtype}: the bytes were not cast ({every[:3]})"


def expected_like(ins: list[np.ndarray], op: str) -> np.ndarray:
    x = np.array([a.astype(np.int64) for a in ins])
    return (x.sum(0) if op == "sum" else x.max(0)).astype(ins[0].dtype)


async def store_requests(comm: hetccl.Communicator, per_rank: int, gathered_per_rank: int | None = None) -> None:
    """After init, rank 0's store has answered at most per_rank requests per rank (the bootstrap is O(1) round
    trips a rank: one record gather, not one get per peer) and, when gathered_per_rank is given, sent at most that
    many gathered values (records) per rank (the records go down a tree of ranks: about one per rank in all, not
    one per rank and peer)."""
    await comm.barrier()
    if comm.rank == 0:
        server = comm._fabric.server
        served, gathered = server.served, server.gathered
        print(f"store requests: {served} for {comm.size} ranks; {gathered} records gathered, "
              f"{server.bytes_served} bytes served", flush=True)
        assert served <= per_rank * comm.size, f"the store served {served} requests for {comm.size} ranks"
        if gathered_per_rank is not None:
            assert gathered <= gathered_per_rank * comm.size, \
                f"the store sent {gathered} records to {comm.size} ranks"


async def records_tree_fallback(comm: hetccl.Communicator, deaf: int) -> None:
    """Rank `deaf` refuses the records tree (HETCCL_TEST_RECORDS_TREE_DEAF): it read the records from the store and
    every other rank but 0 from the tree (the deaf rank's children from rank 0, which pushed to them instead); the
    store sent the records twice (rank 0's gather and the deaf rank's), and the job works."""
    fab = comm._fabric
    expect = "store" if comm.rank in (0, deaf) else "tree"
    assert fab.records_source == expect, f"rank {comm.rank} read the records from the {fab.records_source}"
    assert [rec["pid"] for rec in fab.records].count(os.getpid()) == 1
    buf = np.full(4, comm.rank, np.float32)
    await comm.all_reduce(buf)
    check(buf, np.full(4, sum(range(comm.size)), np.float32), "all_reduce after the fallback")
    if comm.rank == 0:
        gathered = fab.server.gathered
        print(f"records gathered: {gathered} for {comm.size} ranks", flush=True)
        assert gathered == 2 * comm.size, f"the store sent {gathered} records to {comm.size} ranks"


async def keys_pruned_on_close(comm: hetccl.Communicator, splits: int, close_under_s: float) -> None:
    """Create and close `splits` splits, close the world: every rank closes within `close_under_s` (a wait on a
    pruned key would take the closing barrier's whole bound, 10 s), and the store host, where this rank hosts it,
    keeps none of the job's keys. Prints each rank's close time and store size."""
    fab = comm._fabric
    server = fab.server
    for i in range(splits):
        sub = await comm.split(comm.rank % 2, key=i)
        assert sub is not None
        buf = np.ones(4, np.float32)
        await sub.all_reduce(buf)
        check(buf, np.full(4, sub.size, np.float32), f"split {i}")
        if sub.rank == 0:  # what a GPU island's split leaves in the store (its vendor id, gpu/dispatch.py)
            await fab.store.set(f"{fab.job}/vendor/{sub.comm_id}/0", b"vendor unique id")
        await sub.close()
    await comm.barrier()
    held = len(server.data) if server is not None else -1
    t0 = time.monotonic()
    await comm.close()
    took = time.monotonic() - t0
    print(f"rank {comm.rank} closed in {took:.3f} s", flush=True)
    assert took < close_under_s, f"rank {comm.rank}: close took {took:.2f} s"
    if server is not None:
        left = sorted(k for k in server.data if k == fab.job or k.startswith(f"{fab.job}/"))
        assert not left, f"the store host kept {len(left)} keys of the closed job: {left[:8]}"
        assert not server.events, f"the store host kept Events: {sorted(server.events)[:8]}"
        print(f"store keys before close {held}, after {len(server.data)}", flush=True)
