"""Small helpers for non-blocking sockets driven by the asyncio loop (zero-copy receive, framed control)."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from ._native import ffi, lib
from .errors import CollectiveTimeout, HetcclError, PeerLostError
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


async def recv_header(loop: asyncio.AbstractEventLoop, sock: socket.socket, mv: memoryview, peer: int = -1
                      ) -> bool:
    """recv_into_exact, but False when the peer closed before the first byte (a clean end between frames)."""
    try:
        k = sock.recv_into(mv)
    except BlockingIOError:
        try:
            k = await loop.sock_recv_into(sock, mv)
        except (ConnectionError, OSError) as exc:
            raise PeerLostError(f"connection to rank {peer} failed: {exc}", peer) from None
    except (ConnectionError, OSError) as exc:
        raise PeerLostError(f"connection to rank {peer} failed: {exc}", peer) from None
    if k == 0:
        return False
    if k < len(mv):
        await recv_into_exact(loop, sock, mv[k:], peer)
    return True


# Blocking transfers for worker threads: the native loop (native/hetccl_native.c, hccl_sock_send/recv) moves
# the whole payload with the GIL released. `stop` is an int[] cell (new_stop_flag) another thread may set.
def new_stop_flag() -> Any:
    return ffi.new("int[1]")


def pump_send(fd: int, head: bytes, body: Any, idle_s: float, stop: Any) -> tuple[int, int]:
    """Send head then body on fd -> (status, bytes sent): status 0, HCCL_IO_* or -errno."""
    done = ffi.new("size_t[1]")
    head_ptr, body_ptr = ffi.from_buffer("char[]", head), ffi.from_buffer("char[]", body)
    rc = lib.hccl_sock_send(fd, head_ptr, len(head_ptr), body_ptr, len(body_ptr), int(idle_s * 1e9), stop, done)
    return rc, done[0]


def pump_recv(fd: int, buf: Any, idle_s: float, stop: Any) -> tuple[int, int]:
    """Fill buf from fd -> (status, bytes received): status 0, HCCL_IO_* or -errno."""
    done = ffi.new("size_t[1]")
    buf_ptr = ffi.from_buffer("char[]", buf, True)
    rc = lib.hccl_sock_recv(fd, buf_ptr, len(buf_ptr), int(idle_s * 1e9), stop, done)
    return rc, done[0]


def pump_error(status: int, peer: int, what: str, idle_s: float) -> HetcclError:
    """The error a failed pump_send/pump_recv stands for."""
    if status == lib.HCCL_IO_EOF:
        return PeerLostError(f"rank {peer} closed the connection", peer)
    if status == lib.HCCL_IO_TIMEOUT:
        return CollectiveTimeout(f"{what} rank {peer}: no progress for {idle_s:.0f} s")
    if status == lib.HCCL_IO_STOPPED:
        return PeerLostError(f"connection to rank {peer} closed locally", peer)
    return PeerLostError(f"{what} rank {peer} failed: {os.strerror(-status) if status < 0 else status}", peer)


IO_STOPPED = lib.HCCL_IO_STOPPED


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
                        max_bytes: int, peer: int = -1) -> None:
    await send_all(loop, sock, [encode_control(obj, max_bytes)], peer)


_FORCED_BUF_OPTS = {socket.SO_SNDBUF: getattr(socket, "SO_SNDBUFFORCE", None),
                    socket.SO_RCVBUF: getattr(socket, "SO_RCVBUFFORCE", None)}


def tune_socket(sock: socket.socket, buf_bytes: int = 4 << 20) -> None:
    """Non-blocking, no Nagle, socket buffers of buf_bytes (HETCCL_SOCKET_BUF_BYTES). The kernel caps SO_SNDBUF
    and SO_RCVBUF at net.core.wmem_max/rmem_max; a process allowed to (CAP_NET_ADMIN) goes past the cap with
    the *FORCE options, as a deep buffer is what keeps a fast link busy."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt, forced in _FORCED_BUF_OPTS.items():
            for name in (forced, opt) if forced is not None else (opt,):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, name, buf_bytes)
                    break
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
