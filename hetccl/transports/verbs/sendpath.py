"""The verbs send path: work requests, credits, fragments sent from registered or bounce memory."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from ...errors import (
    CollectiveTimeout,
    PeerLostError,
)
from ...wire import Fingerprint, pack_data_header
from .frames import FRAG, FRAG_FIRST, FRAG_NEXT, HDR_FIRST, _Pending
from .memory import _address_of

log = logging.getLogger("hetccl")


class SendPath:
    """Mixed into VerbsEndpoint (endpoint.py), whose attributes it uses."""

    # ------------------------------------------------------------------------------------ work requests

    def _post_recv_slot(self, slot: int) -> None:
        pv = self.pv
        sge = pv.wr.SGE(self.rx_mr.buf + slot * self.B, self.B, self.rx_mr.lkey)
        self.qp.post_recv(pv.wr.RecvWR(wr_id=slot, num_sge=1, sg=[sge]))

    def _post_send(self, sges: list[Any], pending: _Pending) -> None:
        pv = self.pv
        wr_id = self.next_wr
        self.next_wr += 1
        wr = pv.wr.SendWR(wr_id=wr_id, opcode=pv.enums.IBV_WR_SEND, num_sge=len(sges), sg=sges,
                          send_flags=pv.enums.IBV_SEND_SIGNALED)
        self.pending[wr_id] = pending
        try:
            self.qp.post_send(wr)
        except Exception as exc:
            del self.pending[wr_id]
            err = PeerLostError(f"rank {self.matcher.me}: posting a send to rank {self.peer} failed: {exc}",
                                self.peer)
            self._lost(err)
            raise err from None

    # ------------------------------------------------------------------------------------------ send

    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None:
        if self.error is not None:
            raise self.error
        nbytes = len(src)
        hdr = pack_data_header(fp, tag, nbytes)
        t = self.transport
        reg = t.regcache.get(src) if nbytes >= t.reg_min else None
        futs: list[asyncio.Future] = []
        deadline = self.loop.time() + self.timeout
        if reg is not None:
            reg.busy += 1
        try:
            posted_any = False
            async with self._send_lock:  # the fragments of one message stay contiguous on the QP
                try:
                    off, first = 0, True
                    src_addr = _address_of(src) if nbytes else 0
                    while first or off < nbytes:
                        hlen = HDR_FIRST if first else FRAG.size
                        n = min(self.B - hlen, nbytes - off)
                        slot = await self._acquire(deadline, fp)
                        base = slot * self.B
                        FRAG.pack_into(self.tx, base, FRAG_FIRST if first else FRAG_NEXT, 0, 0,
                                       self.freed & 0xFFFFFFFF)
                        if first:
                            self.tx[base + FRAG.size: base + HDR_FIRST] = np.frombuffer(hdr, np.uint8)
                        sge = self.pv.wr.SGE
                        if reg is not None:
                            sges = [sge(self.tx_mr.buf + base, hlen, self.tx_mr.lkey),
                                    sge(src_addr + off, n, reg.mr.lkey)]
                        else:
                            if n:
                                self.tx[base + hlen: base + hlen + n] = src[off: off + n]
                            sges = [sge(self.tx_mr.buf + base, hlen + n, self.tx_mr.lkey)]
                        fut = self.loop.create_future()
                        self._post_send(sges, _Pending("d", slot, fut))
                        posted_any = True
                        self.reported = self.freed
                        futs.append(fut)
                        off += n
                        first = False
                except BaseException as exc:
                    if posted_any:  # half a message on the wire: the byte stream is broken for good
                        err = exc if isinstance(exc, PeerLostError) else PeerLostError(
                            f"rank {self.matcher.me}: a send to rank {self.peer} was interrupted mid-message; "
                            "connection dropped", self.peer)
                        self._lost(err)
                    raise
            remaining = max(0.0, deadline - self.loop.time())
            try:
                await asyncio.wait_for(asyncio.gather(*futs), remaining)
            except TimeoutError:
                raise CollectiveTimeout(f"rank {self.matcher.me}: sends to rank {self.peer} for {fp.describe()} "
                                        f"did not complete within {self.timeout:.0f} s") from None
        finally:
            if reg is not None:
                reg.busy -= 1

    async def _acquire(self, deadline: float, fp: Fingerprint) -> int:
        while True:
            if self.error is not None:
                raise self.error
            if self.sent - self.peer_freed < self.S and self.tx_free:
                self.sent += 1
                return self.tx_free.pop()
            self._wake.clear()
            remaining = deadline - self.loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._wake.wait(), remaining)
            except TimeoutError:
                raise CollectiveTimeout(f"rank {self.matcher.me}: rank {self.peer} returned no send credit for "
                                        f"{fp.describe()} within {self.timeout:.0f} s") from None
