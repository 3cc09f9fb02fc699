"""Small helpers for non-blocking sockets driven by the asyncio loop (zero-copy receive, framed control)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

from .errors import PeerLostError
from .wire import CONTROL_LEN, control_length, decode_control_body, encode_control


async def recv_into_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, mv: memoryview,
                          peer: int = -1) -> None:
    """Fill `mv` from `sock` (no intermediate copy). EOF -> PeerLostError."""
    got, n = 0, len(mv)
    while got < n:
        try:
            try:
                k = sock.recv_into(mv[got:])
            except BlockingIOError:
                k = await loop.sock_recv_into(sock, mv[got:])
        except (ConnectionError, OSError) as exc:
            raise PeerLostError(f"connection to rank {peer} failed: {exc}", peer) from None
        if k == 0:
            raise PeerLostError(f"rank {peer} closed the connection", peer)
        got += k


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, peer: int = -1) -> bytes:
    buf = bytearray(n)
    await recv_into_exact(loop, sock, memoryview(buf), peer)
    return bytes(buf)


async def send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: list[Any],
                   peer: int = -1, progress: list[int] | None = None) -> None:
    """Send every part in order, one sendmsg per socket wake-up. `progress[0]`, when given, counts the bytes of
    `parts` handed to the kernel so far, exact even when the caller is cancelled mid-way (TcpEndpoint uses it to
    finish a frame that a cancellation cut short)."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    done, i = 0, 0
    try:
        while done < total:
            try:
                sent = sock.sendmsg(views[i:])
            except BlockingIOError:
                await _writable(loop, sock)
                continue
            done += sent
            if progress is not None:
                progress[0] = done
            while i < len(views) and sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            if sent:
                views[i] = views[i][sent:]
    except (ConnectionError, OSError) as exc:
        raise PeerLostError(f"sending to rank {peer} failed: {exc}", peer) from None


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_writer(fd)


async def read_control(loop: asyncio.AbstractEventLoop, sock: socket.socket, max_bytes: int,
                       peer: int = -1) -> dict[str, Any]:
    n = control_length(await recv_exact(loop, sock, CONTROL_LEN.size, peer), max_bytes)
    return decode_control_body(await recv_exact(loop, sock, n, peer), max_bytes)


async def write_control(loop: asyncio.AbstractEventLoop, sock: socket.socket, obj: dict[str, Any],
                        max_bytes: int, peer: int = -1) -> int:
    """Send obj as one control frame; returns the frame's bytes (the store counts what it serves)."""
    frame = encode_control(obj, max_bytes)
    await send_all(loop, sock, [frame], peer)
    return len(frame)


async def accept_each(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                      handle: Callable[[socket.socket, Any], Coroutine[Any, Any, None]],
                      tasks: set[asyncio.Task]) -> None:
    """Accept connections on the listening `sock` until it is closed (or this is cancelled): each one tuned and
    handed to handle(conn, addr) in a task kept in `tasks` while it runs, for the owner to cancel."""
    while True:
        try:
            conn, addr = await loop.sock_accept(sock)
        except (OSError, asyncio.CancelledError):
            return
        tune_socket(conn)
        keep_task(tasks, handle(conn, addr))


def keep_task(tasks: set[asyncio.Task], coro: Coroutine[Any, Any, None]) -> asyncio.Task:
    """Run coro in a task kept in `tasks` while it runs (for its owner to cancel and await at close)."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


def tune_socket(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            except OSError:
                pass


def route_source_addr(dest_host: str, dest_port: int) -> str:
    """The local address the kernel would use to reach dest (no packet is sent)."""
    family = socket.AF_INET6 if ":" in dest_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((dest_host, dest_port or 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"


def interface_addr(name: str) -> str:
    """The IPv4 address of network interface `name` (Linux: SIOCGIFADDR); ConfigError if it has none."""
    import fcntl
    import struct

    from .errors import ConfigError

    known = [n for _, n in socket.if_nameindex()]
    if name not in known:
        raise ConfigError(f"HETCCL_SOCKET_IFNAME={name!r}: no such network interface (this host has "
                          f"{', '.join(known)})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError as exc:
            raise ConfigError(f"HETCCL_SOCKET_IFNAME={name!r}: the interface has no IPv4 address ({exc}); "
                              "give an address with HETCCL_BIND_ADDR instead") from None
    return socket.inet_ntoa(packed[20:24])


# ---- payload pumps (issue 16 item 2) --------------------------------------------------------------------------
# A large payload's bytes are moved by a native thread (native/hetccl_native.c, hccl_pump_*) instead of the event
# loop: the loop submits the job and hears of its end through an eventfd, so that a ring step's send and receive
# copy on two cores at once while the loop thread runs Python. The native thread never takes the GIL (a Python
# worker thread would wait up to a GIL switch interval to report back).

PUMP_BUSY, PUMP_EOF, PUMP_STOPPED = 1, 2, 3


class Pump:
    """One native thread, one payload at a time over one socket (a send or a receive). Pump.create() gives None
    where native threads are not available."""

    __slots__ = ("_lib", "_ffi", "_p", "_fd", "_loop", "_fut", "_cb", "_keep", "_done")

    def __init__(self, loop: asyncio.AbstractEventLoop, lib: Any, ffi: Any, p: Any):
        self._lib, self._ffi, self._p, self._loop = lib, ffi, p, loop
        self._fd = lib.hccl_pump_notify_fd(p)
        self._fut: asyncio.Future | None = None
        self._cb: Any = None
        self._keep: tuple[Any, ...] = ()
        self._done = ffi.new("size_t *")
        loop.add_reader(self._fd, self._ended)

    @classmethod
    def create(cls, loop: asyncio.AbstractEventLoop) -> Pump | None:
        from .native import ffi, lib

        p = lib.hccl_pump_new()
        return None if p == ffi.NULL else cls(loop, lib, ffi, p)

    def _ended(self) -> None:
        rc = self._lib.hccl_pump_reap(self._p, self._done)
        if rc == PUMP_BUSY:
            return
        fut, cb, self._fut, self._cb, self._keep = self._fut, self._cb, None, None, ()
        if fut is not None and not fut.done():
            fut.set_result((rc, self._done[0]))
        if cb is not None:
            cb(rc, self._done[0])

    def submit(self, fd: int, send: bool, head: Any, body: Any, on_end: Any) -> bool:
        """Start moving head (sends only) and body; on_end(result, bytes moved) runs on the loop when the job
        ends (stopped and closed included). False (and no call) when the pump is closed."""
        ffi = self._ffi
        h = ffi.from_buffer("char[]", head) if head is not None else ffi.NULL
        b = ffi.from_buffer("char[]", body, not send)
        if self._p is None or self._lib.hccl_pump_submit(self._p, fd, 0 if send else 1, h,
                                                         len(h) if head is not None else 0, b, len(b)):
            return False
        self._cb, self._keep = on_end, (h, b, head, body)
        return True

    def stop(self) -> None:
        if self._p is not None:
            self._lib.hccl_pump_stop(self._p)

    async def run(self, fd: int, send: bool, head: Any, body: Any) -> tuple[int, int]:
        """Move head (sends only) and body; (result, bytes moved). Cancelled, it stops the job and waits for the
        native thread to let go of the buffers (promptly: the stop wakes its poll) before CancelledError goes on,
        with `.moved` on the error."""
        if not self.submit(fd, send, head, body, None):
            return -9, 0  # EBADF: the pump is closed (the connection was dropped)
        fut = self._fut = self._loop.create_future()  # the job ends on a later loop turn (_ended), never before
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError as exc:
            self.stop()
            while not fut.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(fut)
            exc.moved = fut.result()[1]  # type: ignore[attr-defined]
            raise

    def close(self) -> None:
        """Stop the job in flight (its waiter gets PUMP_STOPPED), join the thread, free it. No job runs after."""
        if self._p is None:
            return
        self._loop.remove_reader(self._fd)
        self._lib.hccl_pump_quit(self._p)
        self._ended()
        self._lib.hccl_pump_free(self._p)
        self._p = None


def pump_error(rc: int, peer: int, sending: bool) -> PeerLostError:
    if rc == PUMP_EOF:
        return PeerLostError(f"rank {peer} closed the connection", peer)
    if rc == PUMP_STOPPED:
        return PeerLostError(f"connection to rank {peer} closed locally", peer)
    what = "sending to" if sending else "connection to"
    return PeerLostError(f"{what} rank {peer} failed: {os.strerror(-rc)}", peer)
