"""Transport conformance (hetccl.testing.transport_conformance): the built-ins pass every check, and so does a
plugin written only from docs/transports.md, packaged OUTSIDE the repository, installed with pip into a
temporary target and found through the `hetccl.transports` entry point, as a user's job would find it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hetccl.testing import transport_conformance as conf
from hetccl.transports.shm import ShmTransport
from hetccl.transports.tcp import TcpTransport

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("cls", [TcpTransport, ShmTransport], ids=["tcp", "shm"])
def test_builtins_pass_every_check(cls: type) -> None:
    results = conf.check_all(cls)
    assert all(why is None for why in results.values()), results
    assert set(results) == set(conf.CHECKS)


# A pure-Python transport over authenticated TCP sockets, written from docs/transports.md alone.
PLUGIN = '''
"""sockplug: a minimal hetccl transport plugin (interface v2), written from docs/transports.md."""

import asyncio

import numpy as np

from hetccl.errors import PeerLostError
from hetccl.matching import DROP
from hetccl.transports.base import Endpoint, Transport, TransportProperties
from hetccl.transports.listener import PeerListener, dial
from hetccl.wire import DATA_HEADER, pack_data_header, unpack_data_header


class SockEndpoint(Endpoint):
    def __init__(self, transport, peer, sock):
        self.transport, self.peer, self.sock = transport, peer, sock
        self.matcher = transport.ctx.new_matcher(peer)
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self.closed = False
        self.reader = self.loop.create_task(self.read_loop())

    async def send(self, fp, tag, src):
        if self.matcher.error is not None:
            raise self.matcher.error
        frame = pack_data_header(fp, tag, len(src)) + src.tobytes()
        async with self.lock:
            try:
                await self.loop.sock_sendall(self.sock, frame)
            except OSError as exc:
                err = PeerLostError(f"sockplug: send to rank {self.peer} failed: {exc}", self.peer)
                self.lost(err)
                raise err from None

    def post_recv(self, fp, tag, dst, reduce=None):
        return self.matcher.post(fp, tag, dst, reduce)

    async def read_exact(self, n):
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = await self.loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise PeerLostError(f"sockplug: rank {self.peer} closed the connection", self.peer)
            got += k
        return np.frombuffer(buf, np.uint8)

    async def read_loop(self):
        m = self.matcher
        try:
            while True:
                fp, tag, n = unpack_data_header(bytes(await self.read_exact(DATA_HEADER.size)), 1 << 40)
                payload = await self.read_exact(n)
                req = m.take(fp, tag, n)
                if req is DROP:
                    continue
                if req is not None:
                    req.deliver(payload)
                    continue
                await m.wait_room(n, self.transport.ctx.settings.timeout)
                data = m.alloc(n)
                data[:] = payload
                m.land(fp, tag, data)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self.closed:
                self.lost(exc if isinstance(exc, PeerLostError) else PeerLostError(str(exc), self.peer))

    def lost(self, err):
        self.matcher.fail_all(err)
        if not self.closed:
            self.transport.ctx.on_peer_lost(self.peer, err)

    async def close(self):
        if self.closed:
            return
        self.closed = True
        self.reader.cancel()
        self.sock.close()


class SockTransport(Transport):
    name = "sockplug"
    api_version = 2
    priority = 5
    properties = TransportProperties(latency_us=40, ring_step_us=40, bandwidth_gb_s=1)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.listener = PeerListener(ctx, "sockplug", "sockplug")
        self.endpoints = []

    async def listen(self):
        return {"host": self.ctx.bind_host, "port": self.listener.start()}

    def can_reach(self, peer, record, same_host):
        return "port" in record

    async def connect(self, peers):
        async def one(peer, record):
            if peer < self.ctx.rank:
                sock = await dial(self.ctx, peer, record, "sockplug", "sockplug")
            else:
                sock = await asyncio.wait_for(self.listener.incoming(peer), self.ctx.settings.timeout)
            ep = SockEndpoint(self, peer, sock)
            self.endpoints.append(ep)
            return peer, ep

        return dict(await asyncio.gather(*(one(p, r) for p, r in peers.items())))

    async def close(self):
        self.listener.close()
        for ep in self.endpoints:
            await ep.close()
        self.endpoints.clear()
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "sockplug"
version = "0.1"

[project.entry-points."hetccl.transports"]
sockplug = "sockplug:SockTransport"

[tool.setuptools]
py-modules = ["sockplug"]
'''


def test_external_plugin_written_from_the_docs_passes(tmp_path: Path) -> None:
    src, target = tmp_path / "sockplug-src", tmp_path / "site"
    src.mkdir()
    assert not str(src).startswith(str(ROOT))  # outside the repository
    (src / "sockplug.py").write_text(textwrap.dedent(PLUGIN))
    (src / "pyproject.toml").write_text(PYPROJECT)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(target), str(src)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert list(target.glob("sockplug-0.1.dist-info/entry_points.txt"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    code = ("from hetccl.transports import registry; print(registry.discover()['sockplug']); "
            "print(registry.available()['sockplug'])")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                           cwd=tmp_path)
    assert found.stdout.split() == ["sockplug:SockTransport", "None"], found.stdout + found.stderr
    run = subprocess.run([sys.executable, "-m", "hetccl.testing.transport_conformance", "sockplug"],
                         capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"sockplug: {len(conf.CHECKS)}/{len(conf.CHECKS)} checks passed" in run.stdout, run.stdout


def test_conformance_reports_a_broken_transport() -> None:
    """The checks are not vacuous: a transport that builds its own matchers (v1 style) fails the core's."""
    from hetccl.matching import Matcher

    class OwnMatchers(TcpTransport):
        name = "ownmatchers"

    import hetccl.transports.tcp as tcp

    class OwnEndpoint(tcp.TcpEndpoint):
        def __init__(self, transport, peer, sock, *lanes):  # type: ignore[no-untyped-def]
            super().__init__(transport, peer, sock, *lanes)
            self.matcher = Matcher(transport.ctx.rank, peer, 1 << 20)

    orig = tcp.TcpEndpoint
    tcp.TcpEndpoint = OwnEndpoint  # type: ignore[misc]
    try:
        with pytest.raises(AssertionError, match="ctx.new_matcher"):
            asyncio.run(conf.CHECKS["connects_with_core_matchers"](OwnMatchers))
    finally:
        tcp.TcpEndpoint = orig  # type: ignore[misc]
