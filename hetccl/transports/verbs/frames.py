"""The verbs wire format: the 8-byte fragment header every SEND carries, and the slot and work-request
numbering (the package docstring explains the protocol)."""

from __future__ import annotations

import asyncio
import struct

from ...wire import DATA_HEADER

FRAG = struct.Struct("<BBHI")  # kind, 0, 0, credits (cumulative receive slots freed by the sender, mod 2**32)
FRAG_FIRST, FRAG_NEXT, FRAG_CREDIT = 1, 2, 3
HDR_FIRST = FRAG.size + DATA_HEADER.size
CTRL_SLOTS = 8
SEND_WR_BASE = 1 << 32


class _Pending:
    """A posted work request: its kind ("d" data, "c" credit), slot, and the send waiting for it."""

    __slots__ = ("kind", "slot", "fut")

    def __init__(self, kind: str, slot: int, fut: asyncio.Future | None):
        self.kind, self.slot, self.fut = kind, slot, fut
