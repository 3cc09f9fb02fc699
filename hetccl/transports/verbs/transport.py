"""The verbs transport: availability, listening, connecting the queue pairs, the shared completion queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import numpy as np

from ... import params
from ...errors import (
    CollectiveTimeout,
    ConfigError,
    HetcclError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from ...netio import read_control, write_control
from ..base import Endpoint, Transport, TransportContext, TransportProperties
from ..listener import PeerListener, dial
from .device import NO_DEVICE, Device, _local_rank, device_names
from .dmabuf import device_range, register_device_buffer
from .endpoint import VerbsEndpoint
from .frames import CTRL_SLOTS
from .loader import pyverbs
from .memory import RegCache

log = logging.getLogger("hetccl")


_REASON_CACHE: dict[tuple[str, str], str | None] = {}


class VerbsTransport(Transport):
    name = "verbs"
    api_version = 2
    # nominal, not calibrated on hardware yet: a 100 Gb/s port (~10 GB/s after headers), one-sided writes with
    # a few-microsecond round trip; ring steps pay the same per-chunk task overhead as tcp's. It registers
    # memory itself (registration cache; device buffers through dma-buf where the provider allows).
    properties = TransportProperties(latency_us=8, ring_step_us=18, bandwidth_gb_s=10, registers_memory=True)
    priority = 50  # above tcp (10): preferred across hosts when an active RDMA device exists; below shm (100)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            key = (tuple(params.get("HETCCL_IB_DEVICE")), os.environ.get("HETCCL_LOCAL_RANK", ""))
        except ConfigError as exc:  # a bad HETCCL_IB_DEVICE is the reason
            return str(exc)
        if key not in _REASON_CACHE:
            _REASON_CACHE[key] = cls._why_not()
        return _REASON_CACHE[key]

    @classmethod
    def _why_not(cls) -> str | None:
        try:
            pyverbs()
        except ImportError as exc:
            return (f"pyverbs is not importable ({exc}); install rdma-core's Python binding for this Python "
                    "(Debian/Ubuntu: apt-get install python3-pyverbs)")
        except Exception as exc:  # noqa: BLE001 - a broken binding is a reason, not a crash
            return f"pyverbs failed to load: {exc!r}"
        try:
            names = device_names()
        except TransportError as exc:
            return str(exc).removeprefix("verbs: ")
        if not names:
            return NO_DEVICE
        wanted = params.get("HETCCL_IB_DEVICE")
        if wanted:
            name, port = wanted[_local_rank() % len(wanted)]
            if name not in names:
                return f"HETCCL_IB_DEVICE names {name!r}, which does not exist (devices: {', '.join(names)})"
            if not Device._active(name, port):
                return f"RDMA device {name} port {port} is not ACTIVE"
            return None
        if not any(Device._active(n, 1) for n in names):
            return f"no RDMA device has an active port 1 (devices: {', '.join(names)}); check `ibv_devinfo`"
        return None

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self.pv: Any = None
        self.slots = params.get("HETCCL_IB_SLOTS")
        self.slot_bytes = params.get("HETCCL_IB_SLOT_BYTES")
        if self.slot_bytes < 4096 or self.slot_bytes & (self.slot_bytes - 1) or self.slot_bytes > 1 << 30:
            raise ConfigError(f"HETCCL_IB_SLOT_BYTES={self.slot_bytes} must be a power of two in 4K..1G")
        self.reg_min = params.get("HETCCL_IB_REG_MIN")
        self.dev: Device | None = None
        self.cq: Any = None
        self.channel: Any = None
        self.channel_fd = -1
        self.regcache: RegCache | None = None
        self.by_qpn: dict[int, VerbsEndpoint] = {}
        self._listener = PeerListener(ctx, "verbs", "verbs")
        self._endpoints: list[VerbsEndpoint] = []
        self._gpu_warned = False

    # ------------------------------------------------------------------------------------- listening

    async def listen(self) -> dict[str, Any]:
        s = self.ctx.settings
        try:
            self.pv = pyverbs()
        except ImportError as exc:
            raise TransportError(f"verbs: pyverbs is not importable: {exc}") from None
        devices = s.ib_devices
        name, port = devices[_local_rank(self.ctx) % len(devices)] if devices else (None, 1)
        try:
            self.dev = Device(name, port, s.ib_gid_index)
        except HetcclError:
            raise
        except Exception as exc:  # pyverbs errors opening the device: say which and why
            raise TransportError(f"verbs: opening RDMA device {name or '(first active)'} port {port} failed: "
                                 f"{exc}") from None
        self.regcache = RegCache(self.dev.pd)
        host = self.ctx.bind_host
        port = self._listener.start()
        log.debug("hetccl verbs: rank %d uses %s port %d (%s) gid[%d]=%s", self.ctx.rank, self.dev.name,
                  self.dev.port, self.dev.link, self.dev.gid_index, self.dev.gid)
        return {"host": host, "port": port, "link": self.dev.link, "dev": self.dev.name}

    @property
    def refused(self) -> int:
        return self._listener.refused

    def can_reach(self, peer: int, peer_record: dict[str, Any], same_host: bool) -> bool:
        return "port" in peer_record and self.dev is not None and peer_record.get("link") == self.dev.link

    # ------------------------------------------------------------------------------------ connecting

    def _open_cq(self, npeers: int) -> None:
        pv = self.pv
        assert self.dev is not None
        before = _event_fds()
        self.channel = pv.cq.CompChannel(self.dev.ctx)
        new = sorted(_event_fds() - before)
        if len(new) != 1:
            raise TransportError(f"verbs: cannot find the completion channel's file descriptor (new: {new})")
        self.channel_fd = new[0]
        os.set_blocking(self.channel_fd, False)
        depth = npeers * 2 * (self.slots + CTRL_SLOTS + 4) + 16
        self.cq = pv.cq.CQ(self.dev.ctx, depth, None, self.channel, 0)
        self.cq.req_notify()
        asyncio.get_running_loop().add_reader(self.channel_fd, self._on_channel)

    def _on_channel(self) -> None:
        """The completion channel is readable: acknowledge its events, re-arm the CQ, poll it empty."""
        pv, cq = self.pv, self.cq
        if cq is None:
            return
        n = 0
        while True:
            try:
                self.channel.get_cq_event(cq)
            except pv.pyverbs_error.PyverbsError:
                break  # EAGAIN: no more events
            n += 1
        if n:
            cq.ack_events(n)
        cq.req_notify()
        self.drain()

    def drain(self) -> None:
        touched: dict[int, VerbsEndpoint] = {}
        while True:
            k, wcs = self.cq.poll(64)
            for wc in wcs:
                ep = self.by_qpn.get(wc.qp_num)
                if ep is None:
                    continue
                try:
                    ep.on_wc(wc)
                except Exception as exc:  # noqa: BLE001 - never let one peer's failure escape into the loop
                    ep._lost(PeerLostError(f"rank {self.ctx.rank}: completion handling for rank {ep.peer} "
                                           f"failed: {exc!r}", ep.peer))
                touched[ep.peer] = ep
            if k < 64:
                break
        for ep in touched.values():
            ep.after_batch()

    async def _dial(self, peer: int, record: dict[str, Any]) -> socket.socket:
        return await dial(self.ctx, peer, record, "verbs", "verbs")

    async def connect(self, peers: dict[int, dict[str, Any]]) -> dict[int, Endpoint]:
        if not peers:
            return {}
        me, timeout = self.ctx.rank, self.ctx.settings.timeout
        self._open_cq(len(peers))
        loop = asyncio.get_running_loop()

        async def one(peer: int, record: dict[str, Any]) -> tuple[int, VerbsEndpoint]:
            if peer < me:
                sock = await self._dial(peer, record)
            else:
                try:
                    sock = await asyncio.wait_for(asyncio.shield(self._listener.incoming(peer)), timeout)
                except TimeoutError:
                    raise CollectiveTimeout(f"rank {me}: rank {peer} never connected (verbs) within "
                                            f"{timeout:.0f} s") from None
            ep = VerbsEndpoint(self, peer, sock)
            self._endpoints.append(ep)
            self.by_qpn[ep.qpn] = ep
            limit = 4096
            try:
                async with asyncio.timeout(timeout):
                    if peer < me:
                        await write_control(loop, sock, ep.local_info(), limit, peer)
                        theirs = await read_control(loop, sock, limit, peer)
                    else:
                        theirs = await read_control(loop, sock, limit, peer)
                        await write_control(loop, sock, ep.local_info(), limit, peer)
                    ep.connect_qp(theirs)
                    # both QPs are ready to receive before anyone sends
                    await write_control(loop, sock, {"ready": True}, limit, peer)
                    if (await read_control(loop, sock, limit, peer)).get("ready") is not True:
                        raise ProtocolError(f"verbs: rank {peer} did not confirm the connection")
            except TimeoutError:
                raise CollectiveTimeout(f"rank {me}: verbs connection set-up with rank {peer} timed out") from None
            except HetcclError:
                raise
            except Exception as exc:  # pyverbs errors: say which peer and what
                raise TransportError(f"rank {me}: verbs connection to rank {peer} failed: {exc}") from None
            ep.start()
            return peer, ep

        pairs = await asyncio.gather(*(one(p, r) for p, r in peers.items()))
        return dict(pairs)

    # --------------------------------------------------------------------------------------- memory

    def register_memory(self, buf: Any) -> Any:
        """Register a buffer for RDMA. Host memory: through the registration cache. Device memory: through
        dma-buf (GPUDirect RDMA); where impossible, say so once and return None (device data is staged)."""
        if self.dev is None:
            return None
        try:
            if device_range(buf) is None:
                assert self.regcache is not None
                return self.regcache.get(np.asarray(buf).reshape(-1).view(np.uint8))
            return register_device_buffer(self.dev.pd, buf)
        except TransportError as exc:
            if not self._gpu_warned:
                self._gpu_warned = True
                log.warning("hetccl verbs: %s; device buffers are staged through host memory", exc)
            return None

    # ---------------------------------------------------------------------------------------- close

    async def close(self) -> None:
        self._listener.close()
        for ep in self._endpoints:
            await ep.close()
        self._endpoints.clear()
        if self.channel_fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.channel_fd)
            self.channel_fd = -1
        if self.regcache is not None:
            self.regcache.close()
        for obj in (self.cq, self.channel):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        self.cq = self.channel = None
        if self.dev is not None:
            self.dev.close()
            self.dev = None


def _event_fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[infinibandevent]":
                out.add(int(name))
        except OSError:
            pass
    return out
