#!/usr/bin/env python3
"""Fuzz a LIVE job's control plane: rank 0's rendezvous store port and its TCP data port.

The script starts a 2-rank job (HETCCL_TRANSPORTS=tcp) that loops on checked all_reduces, all_gathers and
store round trips, then opens --inputs connections to EACH of the two ports (a few dozen at a time), each
carrying one malformed input:

  random      random bytes (0-8 KiB), before or after reading the server's hello
  truncated   a length prefix announcing more than is then sent, connection closed
  oversized   length prefixes over the 4 KiB handshake bound (4097 .. 4 GiB), with or without a body
  types       well-framed msgpack with wrong types: fields of the wrong kind or size, non-map frames,
              non-string keys, extension types, deep nesting, containers announcing 2^32-1 elements
  replay      the client answer of a real handshake (captured from one this script ran with the secret)
              replayed against a fresh server nonce
  wrongmac    a well-formed answer whose HMAC uses a wrong or empty secret
  drop        connected and dropped: at once, after the hello, mid length prefix, with RST (SO_LINGER 0)
  silent      connected and silent until the server's handshake deadline (a few only)

and, on connections that passed the handshake with the real secret (the script knows it), --store-requests
malformed store requests (wrong types for cmd/key/value/timeout, unknown commands, random maps, garbage
frames), on keys outside the job's namespace. Every unauthenticated input must be refused (the listeners'
`refused` counters, reported by rank 0 at the end, are compared with the number sent), the job must keep
producing correct results throughout, no rank may die, and each rank's RSS must stay bounded (start, peak
and end reported; fails above --rss-limit MiB of growth).

    python benchmarks/fuzz_control.py --inputs 5000 --out benchmarks/results/fuzz.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgpack
from hetccl.auth import NONCE_BYTES, PROTOCOL, _mac
from hetccl.wire import decode_control_body, encode_control

from rankproc import Job, finish_report, rss_kib

HS_MAX = 4096
KINDS = ["random", "truncated", "oversized", "types", "replay", "wrongmac", "drop"]


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def read_frame(reader: asyncio.StreamReader, timeout: float = 5.0) -> dict | None:
    """One control frame from the server, or None on EOF/garbage/timeout."""
    try:
        n = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), timeout))[0]
        if n > HS_MAX:
            return None
        return decode_control_body(await asyncio.wait_for(reader.readexactly(n), timeout), HS_MAX)
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, OSError, Exception):
        return None


def wrong_types(rng: random.Random, nonce_s: bytes) -> bytes:
    """A well-framed body whose msgpack is valid (mostly) but whose types are wrong."""
    good = {"nonce": os.urandom(NONCE_BYTES), "meta_raw": msgpack.packb({"rank": 1}), "mac": os.urandom(32)}
    choice = rng.randrange(12)
    if choice == 0:  # a field of the wrong kind
        f = rng.choice(list(good))
        good[f] = rng.choice([1, -1, 2**63, "x" * 32, [1, 2], {"a": 1}, None, True, 1.5])
        return msgpack.packb(good)
    if choice == 1:  # a field of the wrong size
        f = rng.choice(["nonce", "mac"])
        good[f] = os.urandom(rng.choice([0, 1, 31, 33, 64, 4000]))
        return msgpack.packb(good)
    if choice == 2:  # not a map
        return msgpack.packb(rng.choice([[1, 2, 3], "hello", 42, None, b"\x00" * 10, 3.14]))
    if choice == 3:  # non-string keys
        return msgpack.packb({1: b"x", b"nonce": nonce_s, (1, 2): 3})
    if choice == 4:  # extension type
        return msgpack.packb({"nonce": msgpack.ExtType(42, b"\x80\x04\x95pickle-like"), "mac": b"m"})
    if choice == 5:  # deep nesting
        return b"\x81\xa1a" + b"\x91" * 1000 + b"\xc0"
    if choice == 6:  # array32 announcing 2^32-1 elements
        return b"\x81\xa5nonce\xdd\xff\xff\xff\xff"
    if choice == 7:  # map32 announcing 2^32-1 pairs
        return b"\xdf\xff\xff\xff\xff"
    if choice == 8:  # bin32 / str32 announcing 4 GiB
        return b"\x81\xa5nonce" + rng.choice([b"\xc6", b"\xdb"]) + b"\xff\xff\xff\xff" + b"x" * 16
    if choice == 9:  # the server's own hello echoed back
        return msgpack.packb({"proto": PROTOCOL, "purpose": "store", "nonce": nonce_s})
    if choice == 10:  # meta_raw that is garbage but a correct-length mac
        good["meta_raw"] = os.urandom(rng.randrange(1, 200))
        return msgpack.packb(good)
    return msgpack.packb({"ok": True, "mac": os.urandom(32)})  # a server reply sent by a "client"


class Fuzzer:
    def __init__(self, secret: bytes, seed: int, concurrency: int):
        self.secret = secret
        self.rng = random.Random(seed)
        self.sem = asyncio.Semaphore(concurrency)
        self.sent: Counter = Counter()  # (target, kind) -> inputs sent
        self.outcome: Counter = Counter()  # (target, outcome) -> count
        self.accepted: list[str] = []  # unauthenticated inputs that got {"ok": True}: must stay empty
        self.replay: dict[str, bytes] = {}  # purpose -> a captured client answer frame

    async def capture(self, host: str, port: int, purpose: str, meta: dict) -> bytes:
        """Run a real client handshake with the secret and keep the answer frame we sent."""
        reader, writer = await asyncio.open_connection(host, port)
        try:
            hello = await read_frame(reader)
            assert hello and hello["purpose"] == purpose, hello
            nonce_c = os.urandom(NONCE_BYTES)
            meta_raw = msgpack.packb(meta, use_bin_type=True)
            ans = encode_control({"nonce": nonce_c, "meta_raw": meta_raw,
                                  "mac": _mac(self.secret, b"client", purpose.encode(), hello["nonce"], nonce_c,
                                              meta_raw)}, HS_MAX)
            writer.write(ans)
            await writer.drain()
            reply = await read_frame(reader)
            assert reply and reply.get("ok") is True, f"the real handshake failed: {reply}"
            return ans
        finally:
            writer.close()

    async def one(self, target: str, host: str, port: int, purpose: str, kind: str) -> None:
        rng = self.rng
        async with self.sem:
            self.sent[(target, kind)] += 1
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            except (OSError, TimeoutError) as exc:
                self.outcome[(target, f"connect failed {type(exc).__name__}")] += 1
                return
            try:
                if await self._send(kind, rng, reader, writer, purpose):
                    self.outcome[(target, "dropped by the fuzzer")] += 1
                    return
                reply = await read_frame(reader, 12.0) if kind in ("replay", "wrongmac", "types") else None
                if reply is not None and reply.get("ok"):
                    self.accepted.append(f"{target} {kind}")
                try:  # the server closes on us, unless it waits for more bytes (until its handshake deadline)
                    await asyncio.wait_for(reader.read(), 2.0)
                    state = "closed by server"
                except TimeoutError:
                    state = "server waits for more bytes: closed by the fuzzer after 2 s"
                except (ConnectionError, OSError):
                    state = "reset by server (it closed with our bytes unread)"
                self.outcome[(target, state)] += 1
            except (ConnectionError, OSError):
                self.outcome[(target, "reset")] += 1
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

    async def _send(self, kind: str, rng: random.Random, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, purpose: str) -> bool:
        """Send one malformed input; True when the input is a connection the fuzzer itself dropped."""
        sock = writer.get_extra_info("socket")
        if kind == "drop":
            how = rng.randrange(4)
            if how == 1:
                await read_frame(reader)
            elif how == 2:
                await read_frame(reader)
                writer.write(b"\x00\x00")
                await writer.drain()
            elif how == 3:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort() if how == 3 else writer.close()
            return True
        if kind == "random":
            if rng.random() < 0.5:
                await read_frame(reader)
            writer.write(os.urandom(rng.randrange(0, 8192)))
        elif kind == "truncated":
            hello = await read_frame(reader)
            body = wrong_types(rng, (hello or {}).get("nonce", b""))
            writer.write(struct.pack(">I", len(body) + rng.randrange(1, 4000)) + body[: rng.randrange(len(body) + 1)])
        elif kind == "oversized":
            if rng.random() < 0.5:
                await read_frame(reader)
            n = rng.choice([HS_MAX + 1, 65536, 16 << 20, (16 << 20) + 1, 1 << 31, 0xFFFFFFFF])
            writer.write(struct.pack(">I", n) + os.urandom(rng.randrange(0, 2048)))
        elif kind == "types":
            hello = await read_frame(reader)
            writer.write(frame(wrong_types(rng, (hello or {}).get("nonce", b""))))
        elif kind == "replay":
            await read_frame(reader)
            writer.write(self.replay[purpose])
        elif kind == "wrongmac":
            hello = await read_frame(reader)
            nonce_s = (hello or {}).get("nonce", b"\x00" * NONCE_BYTES)
            nonce_c = os.urandom(NONCE_BYTES)
            meta_raw = msgpack.packb({"rank": 1, "job": "x"})
            bad = rng.choice([b"", b"wrong-secret", self.secret[:-1], self.secret + b"x"])
            writer.write(encode_control({"nonce": nonce_c, "meta_raw": meta_raw,
                                         "mac": _mac(bad, b"client", purpose.encode(), nonce_s, nonce_c,
                                                     meta_raw)}, HS_MAX))
        await writer.drain()
        return False

    async def silent(self, target: str, host: str, port: int, hold: float) -> None:
        async with self.sem:
            self.sent[(target, "silent")] += 1
            reader, writer = await asyncio.open_connection(host, port)
            try:
                await read_frame(reader)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reader.read(), hold)
                self.outcome[(target, "silent: closed by server at its handshake deadline" if reader.at_eof()
                              else "silent: still open")] += 1
            finally:
                writer.close()

    async def store_requests(self, host: str, port: int, n: int) -> Counter:
        """Malformed requests on authenticated store connections (keys outside the job's namespace)."""
        res: Counter = Counter()
        rng = self.rng
        reader = writer = None

        async def connect() -> None:
            nonlocal reader, writer
            reader, writer = await asyncio.open_connection(host, port)
            hello = await read_frame(reader)
            nonce_c = os.urandom(NONCE_BYTES)
            meta_raw = msgpack.packb({"rank": -1})
            writer.write(encode_control({"nonce": nonce_c, "meta_raw": meta_raw, "mac": _mac(
                self.secret, b"client", b"store", hello["nonce"], nonce_c, meta_raw)}, HS_MAX))
            await writer.drain()
            assert (await read_frame(reader) or {}).get("ok"), "authenticated store connection refused"

        await connect()
        junk = [None, 1, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 1000, b"\x00",
                [1, [2, [3]]], {"a": {"b": None}}, True]
        for i in range(n):
            c = rng.randrange(6)
            if c == 0:
                req = {"cmd": rng.choice(junk), "key": rng.choice(junk)}
            elif c == 1:
                req = {"cmd": rng.choice(["set", "get", "add", "check", "delete", "ping", "time", "nope"]),
                       "key": rng.choice([f"fuzz/{i}", *junk[:6]]), "value": rng.choice(junk)}
            elif c == 2:  # get with a strange timeout on a key that does not exist: bounded by its timeout
                req = {"cmd": "get", "key": f"fuzz/missing/{i}", "timeout": rng.choice(
                    [-5, 0, 1e-9, float("nan"), "soon", None, [1], 0.001])}
            elif c == 3:
                req = {"cmd": "add", "key": f"fuzz/ctr/{i % 7}", "value": rng.choice(
                    [1, -1, 2**62, "1", 1.5, None, -(2**62)])}
            elif c == 4:
                req = {str(rng.random()): rng.choice(junk) for _ in range(rng.randrange(6))}
            else:
                req = None  # a garbage frame: the server drops the connection; reconnect
            if req is None:
                writer.write(frame(os.urandom(rng.randrange(1, 64)) + b"\xc1"))
                await writer.drain()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reader.read(), 10)
                res["garbage frame -> dropped" if reader.at_eof() else "garbage frame -> still open"] += 1
                writer.close()
                await connect()
                continue
            try:
                body = msgpack.packb(req, use_bin_type=True)
            except (OverflowError, TypeError, ValueError):
                continue
            writer.write(frame(body))
            await writer.drain()
            reply = await read_frame(reader, 15)
            if reply is None:
                res["no reply (connection dropped)"] += 1
                writer.close()
                await connect()
            else:
                res["err reply" if "err" in reply else "reply"] += 1
        writer.close()
        return res


async def fuzz(args: argparse.Namespace, job: Job, ready: dict, secret: bytes, seed: int) -> dict:
    fz = Fuzzer(secret, seed, args.concurrency)
    store = ("127.0.0.1", job.store_port)
    data = ("127.0.0.1", ready[0]["tcp_port"])
    fz.replay["store"] = await fz.capture(*store, "store", {"rank": 1})
    # a real data handshake with the secret: it passes, then is refused (rank 1 is already connected)
    fz.replay["data"] = await fz.capture(*data, "data", {"rank": 1, "job": ready[0]["job"]})
    tasks = []
    plan = [(t, k) for t in ("store", "data") for k in KINDS for _ in range(args.inputs // len(KINDS))]
    fz.rng.shuffle(plan)
    t0 = time.monotonic()
    for target, kind in plan:
        host, port = store if target == "store" else data
        tasks.append(asyncio.ensure_future(fz.one(target, host, port, target, kind)))
    for target in ("store", "data"):
        for _ in range(args.silent):
            tasks.append(asyncio.ensure_future(fz.silent(target, *(store if target == "store" else data), 25)))
    store_res = await fz.store_requests(*store, args.store_requests)
    await asyncio.gather(*tasks)
    return {"fz": fz, "store_res": store_res, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=5000, help="malformed connections per port (store, data)")
    ap.add_argument("--store-requests", type=int, default=2000, help="malformed requests after the handshake")
    ap.add_argument("--silent", type=int, default=10, help="silent connections per port")
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--rss-limit", type=float, default=64.0, help="MiB of RSS growth allowed per rank")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    wd = Path(tempfile.mkdtemp(prefix="hetccl-fuzz-"))
    stopfile = wd / "stop"
    job = Job.spawn(2, "fault_ranks:busy_until_stopped", {"HETCCL_TRANSPORTS": "tcp", "HETCCL_TIMEOUT": "10"}, wd,
                    stopfile=str(stopfile))
    why: list[str] = []
    rss_start = rss_peak = rss_end = None
    out: dict = {}
    it_start = it_end = 0
    try:
        if not job.wait_event([0, 1], "ready", 90):
            raise SystemExit("ranks did not start: " + job.stderr_tail(0) + job.stderr_tail(1))
        ready = {r: job.event(r, "ready") for r in (0, 1)}
        time.sleep(1.0)  # warm-up: buffers and pools allocated
        rss_start = [rss_kib(p) for p in job.pids]
        rss_peak = list(rss_start)
        it_start = max((e["iterations"] for e in job.events(0) if e["kind"] == "progress"), default=0)

        async def run() -> dict:
            t = asyncio.ensure_future(fuzz(args, job, ready, job.secret.encode(), seed))
            while not t.done():
                for i, p in enumerate(job.pids):
                    v = rss_kib(p)
                    if v is not None:
                        rss_peak[i] = max(rss_peak[i], v)
                if any(p.poll() is not None for p in job.procs):
                    t.cancel()
                    break
                await asyncio.sleep(0.5)
            return await t

        try:
            out = asyncio.run(run())
        except asyncio.CancelledError:
            why.append("a rank died during the fuzz")
        rss_end = [rss_kib(p) for p in job.pids]
        it_end = max((e["iterations"] for e in job.events(0) if e["kind"] == "progress"), default=0)
        stopfile.touch()
        job.wait_exit([0, 1], 60)
    finally:
        job.kill_all()
    done = [job.event(r, "done") for r in (0, 1)]
    for r in (0, 1):
        if job.procs[r].returncode != 0 or done[r] is None:
            why.append(f"rank {r} exited {job.procs[r].returncode}: {job.stderr_tail(r, 1500)}")
        if job.event(r, "wrong"):
            why.append(f"rank {r} computed a wrong result")
    lines = [f"# control-plane fuzz ({time.strftime('%Y-%m-%d %H:%M')}, seed {seed}, {platform.node()}, "
             f"{os.cpu_count()} CPUs, python {platform.python_version()})", ""]
    if out:
        fz: Fuzzer = out["fz"]
        pre_auth = sum(fz.sent.values())
        refused = done[0]["refused"] if done[0] else {}
        n_refused = (refused.get("store") or 0) + (refused.get("tcp") or 0)
        # +1: the captured real data handshake passed the MAC and was then refused as a second rank 1
        expect_refused = pre_auth + 1
        if fz.accepted:
            why.append(f"{len(fz.accepted)} unauthenticated inputs were accepted: {fz.accepted[:5]}")
        if n_refused != expect_refused:
            why.append(f"listeners counted {n_refused} refusals for {expect_refused} hostile connections")
        open_left = sum(v for (t, o), v in fz.outcome.items() if o == "silent: still open")
        if open_left:
            why.append(f"{open_left} silent connections outlived the server's handshake deadline")
        growth = [(b - a) / 1024 for a, b in zip(rss_start, rss_end, strict=True)]
        if max(growth) > args.rss_limit:
            why.append(f"RSS grew by {max(growth):.1f} MiB")
        total = pre_auth + sum(out["store_res"].values())
        lines += [f"Live 2-rank job (HETCCL_TRANSPORTS=tcp) looping on checked all_reduce (1 MiB) + all_gather + "
                  f"store set/get while {total} malformed inputs arrived in {out['seconds']:.0f} s "
                  f"({args.concurrency} connections at a time).", "",
                  "| target | input kind | connections |", "|---|---|---|"]
        for (t, k), v in sorted(fz.sent.items()):
            lines.append(f"| {t} port | {k} | {v} |")
        lines += ["", "Outcome seen by the fuzzer, per target: " + ", ".join(
            f"{t} {o}: {v}" for (t, o), v in sorted(fz.outcome.items())),
            "", f"Authenticated store connection, {args.store_requests} malformed requests: "
            + ", ".join(f"{k}: {v}" for k, v in sorted(out["store_res"].items())),
            "", f"Refusals counted by rank 0's listeners: {refused} = {n_refused} "
            f"(expected {expect_refused}: every hostile connection, plus the real data handshake captured for "
            f"the replays, refused as a second rank 1). Unauthenticated inputs accepted: {len(fz.accepted)}.",
            "", f"Job iterations (all_reduce + all_gather, checked): {it_start} before, {it_end} at the end of "
            f"the fuzz, {done[0]['iterations'] if done[0] else '?'} at exit.",
            "", f"RSS per rank (KiB): start {rss_start}, peak {rss_peak}, end {rss_end} "
            f"(growth {', '.join(f'{g:+.1f}' for g in growth)} MiB; limit {args.rss_limit:g} MiB)."]
    return finish_report(lines, why, args.out, wd)


if __name__ == "__main__":
    sys.exit(main())
