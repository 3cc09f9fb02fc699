"""Rendezvous key-value store: the control plane's meeting point (like torch's TCPStore, but msgpack).

Rank 0 hosts it unless an address is given. Every connection passes the HMAC handshake first; a stranger
is refused and logged and the store goes on serving the job. Requests: set, get (waits until the key
exists, with a deadline), add (atomic counter), check, gather (the values of keys prefix/0 .. prefix/n-1 in
one answer, once a key says they are all there: the bootstrap's records, for rank 0 and any rank the records
tree did not reach), delete, and prune (every key under a prefix: a closed job's keys, Fabric.close). Values are
msgpack-able objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import socket
import time
from typing import Any

from .auth import client_handshake, server_handshake
from .errors import AuthenticationError, CollectiveTimeout, ConfigError, HetcclError, PeerLostError, ProtocolError
from .netio import accept_each, keep_task, read_control, tune_socket, write_control

log = logging.getLogger("hetccl")

MAX_STORE_FRAME = 16 << 20


class StoreServer:
    def __init__(self, host: str, port: int, secret: bytes, handshake_timeout: float = 10.0):
        self.host, self.port, self.secret = host, port, secret
        self.handshake_timeout = handshake_timeout
        self.data: dict[str, Any] = {}
        # the Event of each key a get or gather waits for now, and how many wait: an Event lives only while
        # someone waits (set and add wake it, they do not make one), so the dict never outgrows the waiters
        self.events: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}
        self.refused = 0
        self.served = 0  # requests answered: the bootstrap makes O(1) per rank (tests, benchmarks)
        # values sent in gather answers, and bytes in all answers: the bootstrap's records reach the ranks through
        # a tree (bootstrap.py), so the store sends about one job's worth of records, not one per rank (tests)
        self.gathered = 0
        self.bytes_served = 0
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise HetcclError(f"rendezvous store cannot listen on {self.host}:{self.port}: {exc}; "
                              "pick another port (hetccl run picks a free one)") from None
        sock.listen(socket.SOMAXCONN)  # a job's ranks connect at once (8,192 of them: issue 32)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        keep_task(self._tasks, accept_each(loop, sock, functools.partial(self._serve, loop), self._tasks))
        return self.port

    async def _serve(self, loop: asyncio.AbstractEventLoop, conn: socket.socket, peer: Any) -> None:
        try:
            try:
                await server_handshake(loop, conn, self.secret, "store", self.handshake_timeout)
            except (AuthenticationError, HetcclError, OSError) as exc:
                self.refused += 1
                log.warning("hetccl store: refused connection from %s: %s", peer, exc)
                return
            while True:
                req = await read_control(loop, conn, MAX_STORE_FRAME)
                self.served += 1
                try:
                    reply = await self._handle(req)
                except Exception as exc:  # noqa: BLE001 - one bad request must not drop the connection
                    reply = {"err": f"store request failed: {exc!r}"}
                if "values" in reply:
                    self.gathered += len(reply["values"])
                self.bytes_served += await write_control(loop, conn, reply, MAX_STORE_FRAME)
        except (PeerLostError, ProtocolError, OSError):
            return
        finally:
            conn.close()

    async def _wait_for(self, key: str, timeout: float) -> bool:
        """Until `key` exists (True), or the timeout (False)."""
        if key in self.data:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(timeout, 86400.0))
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            while key not in self.data:  # a delete may race with the set that woke us: look again
                ev = self.events.get(key)
                if ev is None:
                    ev = self.events[key] = asyncio.Event()
                ev.clear()
                try:
                    await asyncio.wait_for(ev.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return False
            return True
        finally:
            left = self._waiting[key] - 1
            if left:
                self._waiting[key] = left
            else:  # the last waiter of this key is gone: so is its Event
                del self._waiting[key]
                self.events.pop(key, None)

    async def _gather(self, prefix: str, count: Any, after: Any, timeout: float) -> dict[str, Any]:
        """The values of prefix/0 .. prefix/count-1 once key `after` exists (one wake-up per waiter, where
        waiting on each key would wake every waiter at every arrival); on the timeout, which are missing."""
        if not isinstance(count, int) or not 0 <= count <= 1 << 20 or not isinstance(after, str):
            return {"err": "gather takes a count (0 .. 2^20) and an `after` key"}
        keys = [f"{prefix}/{i}" for i in range(count)]
        if not await self._wait_for(after, timeout):
            return {"timeout": True, "missing": [i for i, k in enumerate(keys) if k not in self.data]}
        missing = [i for i, k in enumerate(keys) if k not in self.data]
        if missing:
            return {"err": f"gather: {after!r} is set but {len(missing)} of the {count} keys are missing"}
        return {"values": [self.data[k] for k in keys]}

    async def _arrive(self, key: str, count: Any, sets: Any, gather: Any, timeout: float) -> dict[str, Any]:
        """A barrier's arrival in one request: the keys of `sets` stored first, then 1 added at `key`, the
        count-th arrival setting `key/all`; the reply waits up to the timeout for `key/all` (0: answers at
        once), with the values of gather/0 .. gather/count-1 where `gather` is given (and which are missing,
        on the timeout)."""
        if not isinstance(count, int) or not 1 <= count <= 1 << 20:
            return {"err": "arrive takes a count (1 .. 2^20)"}
        if sets is not None and (not isinstance(sets, dict) or len(sets) > 8
                                 or not all(isinstance(k, str) for k in sets)):
            return {"err": "arrive's sets must map at most 8 string keys to values"}
        if gather is not None and not isinstance(gather, str):
            return {"err": "arrive's gather must be a key prefix"}
        n = self._sum(key, 1)
        if isinstance(n, str):
            return {"err": n}
        for k, v in (sets or {}).items():
            self.data[k] = v
            self._wake(k)
        self.data[key] = n
        self._wake(key)
        done = f"{key}/all"
        if n == count:
            self.data[done] = 1
            self._wake(done)
        if gather is not None:
            return await self._gather(gather, count, done, timeout)
        if not await self._wait_for(done, timeout):
            return {"timeout": True, "value": n}
        return {"value": n}

    def _sum(self, key: str, delta: int) -> int | str:
        """The integer at `key` (0 where absent) plus delta, or why it cannot be added (the reply's error)."""
        cur = self.data.get(key, 0)
        if not isinstance(cur, int):
            return f"key {key!r} does not hold an integer"
        if not -(1 << 63) <= cur + delta < 1 << 63:  # msgpack could not send it back: refuse, keep the key
            return f"add on {key!r} would leave the 64-bit range"
        return cur + delta

    def _wake(self, key: str) -> None:
        ev = self.events.get(key)
        if ev is not None:
            ev.set()

    def prune(self, prefix: str) -> int:
        """Drop every key equal to `prefix` or under `prefix/` (pruning `job` keeps `jobX`); returns how many
        went. A get or gather waiting on such a key keeps waiting, until a later set or its own deadline, as
        after a delete: its Event stays while it waits and goes with its last waiter (_wait_for), so no Event
        is left to drop here. Waking it would change nothing (the key is still missing: it would wait again),
        and nobody waits on the keys of a job whose ranks have all closed."""
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"store prune takes a non-empty prefix (got {prefix!r}): an empty one would drop "
                              "every job's keys")
        under = prefix + "/"
        doomed = [k for k in self.data if k == prefix or k.startswith(under)]
        for k in doomed:
            del self.data[k]
        return len(doomed)

    async def _handle(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd, key = req.get("cmd"), req.get("key")
        if not isinstance(key, str) and cmd not in ("ping", "time"):
            return {"err": "key must be a string"}
        if cmd == "set":
            self.data[key] = req.get("value")
            self._wake(key)
            return {"ok": True}
        if cmd in ("get", "gather"):
            timeout = req.get("timeout", 0) or 0
            if not isinstance(timeout, int | float):
                return {"err": "timeout must be a number"}
            if cmd == "gather":
                return await self._gather(key, req.get("count"), req.get("after"), float(timeout))
            if not await self._wait_for(key, float(timeout)):
                return {"timeout": True}
            return {"value": self.data[key]}
        if cmd == "arrive":
            timeout = req.get("timeout", 0) or 0
            if not isinstance(timeout, int | float):
                return {"err": "timeout must be a number"}
            return await self._arrive(key, req.get("count"), req.get("sets"), req.get("gather"), float(timeout))
        if cmd == "add":
            delta = req.get("value", 1)
            if not isinstance(delta, int):
                return {"err": "add takes an integer"}
            n = self._sum(key, delta)
            if isinstance(n, str):
                return {"err": n}
            self.data[key] = n
            self._wake(key)
            return {"value": n}
        if cmd == "check":
            return {"value": key in self.data}
        if cmd == "delete":
            self.data.pop(key, None)  # a waiting get keeps waiting (its Event stays while it waits)
            return {"ok": True}
        if cmd == "prune":
            if not key:
                return {"err": "prune takes a non-empty prefix (an empty one would drop every job's keys)"}
            return {"value": self.prune(key)}
        if cmd == "ping":
            return {"ok": True}
        if cmd == "time":  # the store host's monotonic clock: trace clock offsets (observe/trace.py)
            return {"value": time.perf_counter_ns()}
        return {"err": f"unknown store command {cmd!r}"}

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t


class StoreClient:
    """One authenticated connection to the store; requests are serialised on it. idle() closes it until the
    next request, which connects again: the store's host then holds no socket for each rank of the job."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float, rank: int = -1):
        self.host, self.port, self.secret, self.timeout, self.rank = host, port, secret, timeout, rank
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()
        self._idle = False  # the connection was closed by idle(): the next request connects again

    def idle(self) -> None:
        """Close the connection until the next request (none is in flight on it)."""
        if self._sock is not None and not self._lock.locked():
            self._sock.close()
            self._sock, self._idle = None, True

    async def connect(self, notes: Any = None, again: bool = False) -> None:
        """Connect and authenticate, retrying until the store answers or the timeout; `notes` (waits.WaitNotes)
        prints a line on stderr now and then while it does not. `again` (after idle()): a store that refuses
        the connection is gone, a PeerLostError at once (at the first connect, it may not listen yet)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout
        # a burst of ranks overflows the server's accept queue: a connection caught there may wait for SYN-ACK
        # retransmissions (seconds, doubling), so each attempt is short and the next one starts afresh; the
        # pauses are jittered so that thousands of ranks do not come back in step
        delay, attempt_s, last = 0.01, 2.0, None
        while True:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                left = max(0.05, deadline - time.monotonic())
                await asyncio.wait_for(loop.sock_connect(sock, (self.host, self.port)), min(attempt_s, left))
                tune_socket(sock)
                await client_handshake(loop, sock, self.secret, "store", {"rank": self.rank},
                                       min(attempt_s, left))
                self._sock = sock
                return
            except AuthenticationError:
                sock.close()
                raise
            except (OSError, TimeoutError, PeerLostError) as exc:
                sock.close()
                if again and isinstance(exc, ConnectionRefusedError):
                    raise PeerLostError(f"rank {self.rank}: the rendezvous store at {self.host}:{self.port} refuses "
                                        "connections; its host (rank 0, or the launcher) probably died", 0) from None
                last = exc
            if time.monotonic() + delay > deadline:
                raise CollectiveTimeout(
                    f"rank {self.rank}: no rendezvous store at {self.host}:{self.port} after "
                    f"{self.timeout:.0f} s ({last}); is rank 0 running with the same HETCCL_ADDR?")
            if notes is not None:
                notes.say(f"rank {self.rank} waiting for rank 0's store at {self.host}:{self.port}")
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay, attempt_s = min(delay * 2, 0.5), min(attempt_s * 2, 30.0)

    async def _request(self, req: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        if self._sock is None and not self._idle:
            raise HetcclError("store client is closed")
        loop = asyncio.get_running_loop()
        wait = (timeout if timeout is not None else self.timeout) + 10.0
        async with self._lock:
            if self._sock is None:
                await self.connect(again=True)
                self._idle = False
            assert self._sock is not None
            try:
                await write_control(loop, self._sock, req, MAX_STORE_FRAME, peer=0)
                reply = await asyncio.wait_for(read_control(loop, self._sock, MAX_STORE_FRAME, peer=0), wait)
            except TimeoutError:
                raise CollectiveTimeout(f"rendezvous store did not answer {req.get('cmd')} in {wait:.0f} s") \
                    from None
            except PeerLostError:
                raise PeerLostError("lost the rendezvous store (hosted by rank 0); rank 0 probably died",
                                    0) from None
        if "err" in reply:
            raise HetcclError(f"store: {reply['err']}")
        return reply

    async def set(self, key: str, value: Any) -> None:
        await self._request({"cmd": "set", "key": key, "value": value})

    async def get(self, key: str, timeout: float | None = None) -> Any:
        t = self.timeout if timeout is None else timeout
        reply = await self._request({"cmd": "get", "key": key, "timeout": t}, t)
        if reply.get("timeout"):
            raise CollectiveTimeout(f"rank {self.rank}: waited {t:.0f} s for store key {key!r}; "
                                    "a rank never arrived (crashed, or started with another world size?)")
        return reply["value"]

    async def wait(self, key: str, timeout: float | None = None) -> bool:
        """True once `key` exists, False when the timeout passes first (a get whose value is not needed)."""
        t = self.timeout if timeout is None else timeout
        return not (await self._request({"cmd": "get", "key": key, "timeout": t}, t)).get("timeout")

    async def gather(self, prefix: str, count: int, after: str, timeout: float | None = None
                     ) -> tuple[list[Any] | None, list[int]]:
        """(the values of prefix/0 .. prefix/count-1, []) once key `after` exists; (None, the indices still
        missing) when the timeout passes first."""
        t = self.timeout if timeout is None else timeout
        reply = await self._request({"cmd": "gather", "key": prefix, "count": count, "after": after, "timeout": t}, t)
        if reply.get("timeout"):
            return None, list(reply.get("missing", []))
        return reply["values"], []

    async def arrive_in(self, key: str, count: int, timeout: float, sets: dict[str, Any] | None = None) -> bool:
        """One request: the keys of `sets` stored, then 1 added at `key` (the count-th arrival sets `key/all`),
        then a wait of up to `timeout` s for `key/all`: whether every caller arrived by then."""
        req = {"cmd": "arrive", "key": key, "count": count, "timeout": timeout}
        if sets:
            req["sets"] = sets
        return not (await self._request(req, timeout)).get("timeout")

    async def arrive_gather(self, key: str, count: int, timeout: float, prefix: str,
                            sets: dict[str, Any] | None = None) -> tuple[list[Any] | None, list[int]]:
        """arrive_in, whose answer is gather's once every caller arrived: (the values of prefix/0 ..
        prefix/count-1, []), or (None, the indices still missing) when the timeout passes first."""
        req = {"cmd": "arrive", "key": key, "count": count, "timeout": timeout, "gather": prefix}
        if sets:
            req["sets"] = sets
        reply = await self._request(req, timeout)
        if reply.get("timeout"):
            return None, list(reply.get("missing", []))
        return reply["values"], []

    async def count_in(self, key: str, count: int) -> str:
        """Add 1 at `key` (one request); the count-th caller sets `key/all`. Returns that key, which the callers
        wait for."""
        await self.arrive_in(key, count, 0.0)
        return f"{key}/all"

    async def arrive(self, key: str, count: int, timeout: float | None = None) -> None:
        """A barrier of `count` callers in one request each, whatever `count` (CollectiveTimeout past the
        timeout)."""
        t = self.timeout if timeout is None else timeout
        if not await self.arrive_in(key, count, t):
            raise CollectiveTimeout(f"rank {self.rank}: waited {t:.0f} s for store key {key + '/all'!r}; "
                                    "a rank never arrived (crashed, or started with another world size?)")

    async def add(self, key: str, delta: int = 1) -> int:
        return int((await self._request({"cmd": "add", "key": key, "value": delta}))["value"])

    async def check(self, key: str) -> bool:
        return bool((await self._request({"cmd": "check", "key": key}))["value"])

    async def time(self) -> int:
        """The store host's monotonic clock, in ns (for NTP-style offset estimates)."""
        return int((await self._request({"cmd": "time"}))["value"])

    async def delete(self, key: str) -> None:
        await self._request({"cmd": "delete", "key": key})

    async def prune(self, prefix: str) -> int:
        """Drop every key equal to `prefix` or under `prefix/` (StoreServer.prune); returns how many went."""
        return int((await self._request({"cmd": "prune", "key": prefix}))["value"])

    def close(self) -> None:
        self._idle = False
        if self._sock is not None:
            self._sock.close()
            self._sock = None
