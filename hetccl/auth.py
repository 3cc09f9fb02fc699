"""Mutual HMAC challenge-response run on every control and data connection of a job.

Both sides prove knowledge of the job secret (HETCCL_SECRET) over fresh nonces, so a stranger, a wrong
secret or a replayed transcript is refused. The listener logs the refusal and goes on serving the job.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
from typing import Any

from .errors import AuthenticationError, CollectiveTimeout, HetcclError
from .netio import read_control, write_control
from .wire import decode_control_body

log = logging.getLogger("hetccl")

PROTOCOL = "hetccl/1"
HANDSHAKE_MAX_BYTES = 4096
NONCE_BYTES = 32


def _mac(secret: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def _field(msg: dict[str, Any], name: str, kind: type, size: int | None = None) -> Any:
    value = msg.get(name)
    if not isinstance(value, kind) or (size is not None and len(value) != size):
        raise AuthenticationError(f"handshake field {name!r} missing or malformed")
    return value


async def server_handshake(loop: asyncio.AbstractEventLoop, sock: socket.socket, secret: bytes,
                           purpose: str, timeout: float) -> dict[str, Any]:
    """Run on an accepted connection. Returns the client's `meta` map; raises AuthenticationError."""

    async def run() -> dict[str, Any]:
        nonce_s = os.urandom(NONCE_BYTES)
        await write_control(loop, sock, {"proto": PROTOCOL, "purpose": purpose, "nonce": nonce_s},
                            HANDSHAKE_MAX_BYTES)
        msg = await read_control(loop, sock, HANDSHAKE_MAX_BYTES)
        nonce_c = _field(msg, "nonce", bytes, NONCE_BYTES)
        mac = _field(msg, "mac", bytes, 32)
        meta_raw = _field(msg, "meta_raw", bytes)
        expect = _mac(secret, b"client", purpose.encode(), nonce_s, nonce_c, meta_raw)
        if not hmac.compare_digest(mac, expect):
            await write_control(loop, sock, {"ok": False}, HANDSHAKE_MAX_BYTES)
            raise AuthenticationError(f"{purpose} connection presented a wrong job secret")
        await write_control(loop, sock, {"ok": True, "mac": _mac(secret, b"server", purpose.encode(),
                                                                  nonce_c, nonce_s)}, HANDSHAKE_MAX_BYTES)
        meta = decode_control_body(meta_raw, HANDSHAKE_MAX_BYTES)  # the MAC covered these exact bytes
        return meta

    try:
        return await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        raise AuthenticationError(f"{purpose} connection did not complete the handshake in {timeout:.0f} s") \
            from None
    except AuthenticationError:
        raise
    except HetcclError as exc:
        raise AuthenticationError(f"{purpose} handshake failed: {exc}") from None


async def client_handshake(loop: asyncio.AbstractEventLoop, sock: socket.socket, secret: bytes,
                           purpose: str, meta: dict[str, Any], timeout: float) -> None:
    import msgpack

    async def run() -> None:
        hello = await read_control(loop, sock, HANDSHAKE_MAX_BYTES)
        if hello.get("proto") != PROTOCOL or hello.get("purpose") != purpose:
            raise AuthenticationError(f"peer does not speak {PROTOCOL} {purpose} (got {hello.get('proto')!r})")
        nonce_s = _field(hello, "nonce", bytes, NONCE_BYTES)
        nonce_c = os.urandom(NONCE_BYTES)
        meta_raw = msgpack.packb(meta, use_bin_type=True)
        await write_control(loop, sock, {"nonce": nonce_c, "meta_raw": meta_raw,
                                         "mac": _mac(secret, b"client", purpose.encode(), nonce_s, nonce_c,
                                                     meta_raw)}, HANDSHAKE_MAX_BYTES)
        reply = await read_control(loop, sock, HANDSHAKE_MAX_BYTES)
        if not reply.get("ok"):
            raise AuthenticationError(
                f"the {purpose} server refused our job secret; every rank needs the same HETCCL_SECRET")
        mac = _field(reply, "mac", bytes, 32)
        if not hmac.compare_digest(mac, _mac(secret, b"server", purpose.encode(), nonce_c, nonce_s)):
            raise AuthenticationError(f"the {purpose} server does not know the job secret")

    try:
        await asyncio.wait_for(run(), timeout)
    except TimeoutError:  # a busy or unreachable server, not a wrong secret: the caller may try again
        raise CollectiveTimeout(f"{purpose} handshake timed out after {timeout:.0f} s") from None
