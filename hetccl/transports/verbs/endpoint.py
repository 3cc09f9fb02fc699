"""One peer's reliable-connected queue pair: set-up, credits, send and receive paths, failure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections import deque
from typing import TYPE_CHECKING, Any

from ...errors import (
    HetcclError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from ..base import Endpoint
from .frames import CTRL_SLOTS, SEND_WR_BASE
from .memory import _view

if TYPE_CHECKING:
    from .transport import VerbsTransport
from .frames import _Pending
from .recvpath import RecvPath
from .sendpath import SendPath

log = logging.getLogger("hetccl")


class VerbsEndpoint(SendPath, RecvPath, Endpoint):
    """One peer's queue pair: set-up and failure here; the send path (sendpath.py) and the receive path
    (recvpath.py) are mixed in."""

    def __init__(self, transport: VerbsTransport, peer: int, sock: socket.socket):
        t, pv = transport, transport.pv
        self.transport, self.peer, self.sock, self.pv = t, peer, sock, pv
        self.loop = asyncio.get_running_loop()
        settings = t.ctx.settings
        self.matcher = t.ctx.new_matcher(peer)  # the core's: frames are delivered to it
        self.timeout = settings.timeout
        self.S, self.B, self.K = t.slots, t.slot_bytes, CTRL_SLOTS
        e = pv.enums
        cap = pv.qp.QPCap(max_send_wr=self.S + self.K + 4, max_recv_wr=self.S + self.K, max_send_sge=2,
                          max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=t.cq, rcq=t.cq, cap=cap)
        self.qp = pv.qp.QP(t.dev.pd, init)
        self.qpn = self.qp.qp_num
        init_attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=t.dev.port)
        init_attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE  # no remote access: SEND/RECV only
        self.qp.to_init(init_attr)  # receives can be posted from INIT on
        self.psn = secrets.randbits(24)
        nrx = self.S + self.K
        self.rx_mr = pv.mr.MR(t.dev.pd, nrx * self.B, e.IBV_ACCESS_LOCAL_WRITE)
        self.rx = _view(self.rx_mr.buf, nrx * self.B)
        ctrl_bytes = 64
        self.tx_mr = pv.mr.MR(t.dev.pd, self.S * self.B + self.K * ctrl_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self.tx = _view(self.tx_mr.buf, self.S * self.B + self.K * ctrl_bytes)
        self.tx_free = list(range(self.S))
        self.ctrl_free = list(range(self.K))
        self.ctrl_base = self.S * self.B
        self.pending: dict[int, _Pending] = {}
        self.next_wr = SEND_WR_BASE  # receive work requests use their slot number as id, sends count from here
        self.sent = 0  # data fragments sent
        self.peer_freed = 0  # of ours, freed by the peer (from its credit fields)
        self.freed = 0  # of the peer's, freed by us
        self.reported = 0  # self.freed as last told to the peer
        self.rxq: deque[tuple[int, int, int]] = deque()  # (slot, byte_len, kind) waiting to be delivered
        self.cur: list[Any] | None = None  # message being received: [fp, tag, nbytes, off, mode, target]
        self.blocked = False
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self.error: BaseException | None = None
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self.max_payload = 1 << 40
        for slot in range(nrx):
            self._post_recv_slot(slot)

    # ------------------------------------------------------------------------------ connection set-up

    def local_info(self) -> dict[str, Any]:
        d = self.transport.dev
        return {"qpn": self.qpn, "psn": self.psn, "gid": d.gid, "lid": d.lid, "mtu": d.mtu, "link": d.link,
                "slots": self.S, "slot_bytes": self.B}

    def connect_qp(self, info: dict[str, Any]) -> None:
        pv, d, e = self.pv, self.transport.dev, self.pv.enums
        try:
            qpn, psn, mtu = int(info["qpn"]), int(info["psn"]), int(info["mtu"])
            gid, lid, link = str(info["gid"]), int(info["lid"]), str(info["link"])
            slots, slot_bytes = int(info["slots"]), int(info["slot_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"verbs: rank {self.peer} sent malformed connection data: {exc!r}") from None
        if not (0 < qpn < 1 << 24 and 0 <= psn < 1 << 24 and 1 <= mtu <= 5):
            raise ProtocolError(f"verbs: rank {self.peer} sent impossible connection data {info!r}")
        if link != d.link:
            raise TransportError(f"verbs: rank {self.peer} is on a {link} port, rank {self.matcher.me} on "
                                 f"{d.link}; they cannot be connected")
        if (slots, slot_bytes) != (self.S, self.B):
            raise TransportError(f"verbs: slot geometry differs: rank {self.peer} has {slots} x {slot_bytes} B, "
                                 f"rank {self.matcher.me} {self.S} x {self.B} B; set HETCCL_IB_SLOTS and "
                                 "HETCCL_IB_SLOT_BYTES alike on every rank")
        self.remote_qpn = qpn
        if d.link == "eth":
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(gid), sgid_index=d.gid_index, hop_limit=64)
            ah = pv.addr.AHAttr(gr=gr, is_global=1, port_num=d.port)
        else:
            ah = pv.addr.AHAttr(dlid=lid, port_num=d.port, is_global=0)
        attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=d.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
        attr.path_mtu = min(mtu, d.mtu)
        attr.dest_qp_num = qpn
        attr.rq_psn = psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2**14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7  # RNR: retry for ever (credits keep the receive queue fed; this is a backstop)
        attr.ah_attr = ah
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)

    def start(self) -> None:
        self._spawn(self._watch_socket())

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_socket(self) -> None:
        """The liveness channel: the peer never writes after set-up, so any read result means it is gone."""
        try:
            data = await self.loop.sock_recv(self.sock, 1)
            why = "closed its connection" if not data else "sent unexpected bytes on the liveness channel"
        except asyncio.CancelledError:
            return
        except OSError as exc:
            why = f"connection broke: {exc}"
        self._lost(PeerLostError(f"rank {self.matcher.me} lost rank {self.peer}: {why}", self.peer))

    # ---------------------------------------------------------------------------------------- failure

    def _wc_error(self, wc: Any) -> None:
        p = self.pending.pop(wc.wr_id, None)  # (an error completion's opcode is undefined; its wr_id is not)
        if self.error is not None or self._closed:
            if p is not None and p.fut is not None and not p.fut.done():
                p.fut.set_exception(self.error or PeerLostError("communicator closed", self.peer))
                p.fut.exception()
            return
        try:
            what = self.pv.cq.cqe_status_to_str(wc.status)
        except Exception:  # noqa: BLE001 - only for the message
            what = "error"
        err = PeerLostError(f"rank {self.matcher.me}: RDMA queue pair to rank {self.peer} failed: {what} "
                            f"(work completion status {wc.status}, vendor error {wc.vendor_err})", self.peer)
        if p is not None and p.fut is not None and not p.fut.done():
            p.fut.set_exception(err)
            p.fut.exception()
        self._lost(err)

    def _lost(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        if not isinstance(exc, HetcclError):
            exc = PeerLostError(str(exc), self.peer)
        self.error = exc
        self.fail(exc)
        if not self._closed:
            self.transport.ctx.on_peer_lost(self.peer, exc)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.matcher.fail_all(exc)  # a receive half delivered included (Matcher.taken)
        exc = self.matcher.error or exc  # the first error stays (Matcher.fail_all)
        for p in list(self.pending.values()):
            if p.fut is not None and not p.fut.done():
                p.fut.set_exception(exc)
                p.fut.exception()
        self._wake.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fail(self.error or PeerLostError("communicator closed", self.peer))
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        self.transport.by_qpn.pop(self.qpn, None)
        with contextlib.suppress(Exception):
            self.qp.close()
        for mr in (self.rx_mr, self.tx_mr):
            with contextlib.suppress(Exception):
                mr.close()
        self.sock.close()
