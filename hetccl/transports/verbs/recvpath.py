"""The verbs receive path: completions, fragments copied or reduced into receives, credit returns."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import numpy as np

from ...errors import (
    CollectiveTimeout,
    HetcclError,
    PeerLostError,
    ProtocolError,
)
from ...matching import DROP
from ...wire import DATA_HEADER, Fingerprint, unpack_data_header
from .frames import FRAG, FRAG_CREDIT, FRAG_FIRST, FRAG_NEXT, _Pending

log = logging.getLogger("hetccl")


class RecvPath:
    """Mixed into VerbsEndpoint (endpoint.py), whose attributes it uses."""

    # --------------------------------------------------------------------------------------- receive

    def post_recv(self, fp: Fingerprint, tag: int, dst: np.ndarray, reduce: Any = None) -> asyncio.Future:
        fut = self.matcher.post(fp, tag, dst, reduce)
        if self.blocked and self.cur is None:
            self._pump()  # the message waiting for early-buffer room may be this one
            self._maybe_credit()  # slots it freed: the sender may be waiting for exactly these credits
        return fut

    def on_wc(self, wc: Any) -> None:
        e = self.pv.enums
        if wc.status != e.IBV_WC_SUCCESS:
            self._wc_error(wc)
            return
        if wc.opcode & e.IBV_WC_RECV:
            slot, blen = wc.wr_id, wc.byte_len
            if not 0 <= slot < self.S + self.K or blen < FRAG.size:
                self._lost(ProtocolError(f"verbs: rank {self.peer} sent a runt fragment ({blen} bytes)"))
                return
            kind, _, _, credits = FRAG.unpack_from(self.rx, slot * self.B)
            self._credit(credits)
            if kind == FRAG_CREDIT:
                self._post_recv_slot(slot)
            elif kind in (FRAG_FIRST, FRAG_NEXT):
                self.rxq.append((slot, blen, kind))
            else:
                self._lost(ProtocolError(f"verbs: rank {self.peer} sent fragment kind {kind}"))
            return
        p = self.pending.pop(wc.wr_id, None)
        if p is None:
            return
        if p.kind == "d":
            self.tx_free.append(p.slot)
            self._wake.set()
        else:
            self.ctrl_free.append(p.slot)
        if p.fut is not None and not p.fut.done():
            p.fut.set_result(None)

    def after_batch(self) -> None:
        if self.rxq and not self.blocked:
            self._pump()
        self._maybe_credit()

    def _credit(self, value: int) -> None:
        grew = (value - self.peer_freed) & 0xFFFFFFFF
        if grew:
            self.peer_freed += grew
            self._wake.set()

    def _maybe_credit(self) -> None:
        unreported = self.freed - self.reported
        if unreported <= 0 or self.error is not None or self._closed:
            return
        if unreported < max(1, self.S // 4) and self.rxq:
            return
        if not self.ctrl_free:
            return  # retried after the next completion
        idx = self.ctrl_free.pop()
        off = self.ctrl_base + idx * 64
        FRAG.pack_into(self.tx, off, FRAG_CREDIT, 0, 0, self.freed & 0xFFFFFFFF)
        self.reported = self.freed
        with contextlib.suppress(HetcclError):
            self._post_send([self.pv.wr.SGE(self.tx_mr.buf + off, FRAG.size, self.tx_mr.lkey)],
                            _Pending("c", idx, None))

    def _pump(self) -> None:
        """Deliver queued fragments in arrival order; stop when an unmatched message finds no room."""
        m, B = self.matcher, self.B
        try:
            while self.rxq and self.error is None:
                slot, blen, kind = self.rxq[0]
                base = slot * B
                pos = base + FRAG.size
                if self.cur is None:
                    if kind != FRAG_FIRST:
                        raise ProtocolError(f"verbs: rank {self.peer} sent a continuation without a message")
                    fp, tag, nbytes = unpack_data_header(bytes(self.rx[pos: pos + DATA_HEADER.size]),
                                                         self.max_payload)
                    pos += DATA_HEADER.size
                    req = m.take(fp, tag, nbytes)
                    if req is None:
                        if not m.has_room(nbytes):
                            if not self.blocked:
                                self.blocked = True
                                self._spawn(self._wait_room(fp, nbytes))
                            return
                        self.cur = [fp, tag, nbytes, 0, "early", m.alloc(nbytes)]
                    elif req is DROP:
                        self.cur = [fp, tag, nbytes, 0, "drop", None]
                    else:
                        self.cur = [fp, tag, nbytes, 0, "direct", req]
                    self.blocked = False
                elif kind != FRAG_NEXT:
                    raise ProtocolError(f"verbs: rank {self.peer} started a message inside another")
                fp, tag, nbytes, off, mode, target = self.cur
                n = base + blen - pos
                if off + n > nbytes:
                    raise ProtocolError(f"verbs: rank {self.peer} sent {off + n} bytes for a {nbytes}-byte message")
                if n:
                    data = self.rx[pos: pos + n]
                    if mode == "direct" and not target.fut.done():
                        dst = target.dst[off: off + n]
                        if target.reduce is None:
                            dst[:] = data
                        else:
                            target.reduce(dst, data)
                    elif mode == "early":
                        target[off: off + n] = data
                off += n
                self.cur[3] = off
                self.rxq.popleft()
                self._post_recv_slot(slot)
                self.freed += 1
                if off == nbytes:
                    self.cur = None
                    if mode == "direct":
                        if not target.fut.done():
                            target.fut.set_result(None)
                    elif mode == "early":
                        m.land(fp, tag, target)  # its receive may have been posted while the fragments came in
        except HetcclError as exc:
            self._lost(exc)
        except Exception as exc:  # noqa: BLE001 - a broken delivery must fail the peer, not the event loop
            log.error("hetccl verbs: rank %d delivery from rank %d failed: %r", self.matcher.me, self.peer, exc,
                      exc_info=True)
            self._lost(PeerLostError(f"rank {self.matcher.me}: receiving from rank {self.peer} failed: {exc!r}",
                                     self.peer))

    async def _wait_room(self, fp: Fingerprint, nbytes: int) -> None:
        """Until the early buffer has room for the held-up message, or a post_recv took it (then `blocked`
        is already False); a message nobody makes room for within HETCCL_TIMEOUT fails the peer."""
        m = self.matcher
        deadline = self.loop.time() + self.timeout
        try:
            while self.blocked and not m.has_room(nbytes):
                remaining = deadline - self.loop.time()
                if remaining <= 0:
                    self._lost(CollectiveTimeout(
                        f"rank {m.me}: {nbytes} bytes from rank {self.peer} for {fp.describe()} waited "
                        f"{self.timeout:.0f} s for a matching receive"))
                    return
                with contextlib.suppress(TimeoutError):
                    await m.wait_room(nbytes, min(remaining, 0.5))
        except asyncio.CancelledError:
            return
        if self.blocked:
            self.blocked = False
            self._pump()
        self._maybe_credit()
