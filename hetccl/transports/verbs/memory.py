"""Memory registration of host buffers: the registration cache (keyed by the owning object)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import weakref
from collections import deque
from typing import Any

import numpy as np

from .loader import pyverbs

log = logging.getLogger("hetccl")


def _address_of(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _view(addr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), np.uint8)


# ------------------------------------------------------------------------------------- registration cache

class _Reg:
    __slots__ = ("mr", "start", "end", "busy", "key")

    def __init__(self, mr: Any, start: int, end: int, key: int):
        self.mr, self.start, self.end, self.busy, self.key = mr, start, end, 0, key


class RegCache:
    """Memory registrations of user buffers, keyed by the object that owns the memory.

    An entry lives as long as its owner: a weakref finalizer deregisters it when the owner is collected, so
    memory freed and reused at the same address never meets a stale registration. Owners that cannot be
    weakly referenced (bytes, bytearray...) are not cached: their data goes through bounce buffers."""

    PAGE = 4096

    def __init__(self, pd: Any, max_entries: int = 64):
        self.pd, self.max_entries = pd, max_entries
        self.entries: dict[int, list[_Reg]] = {}
        self.order: deque[_Reg] = deque()
        self.failed_once = False
        self.closed = False

    @staticmethod
    def owner(arr: np.ndarray) -> Any:
        obj: Any = arr
        while isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        return obj

    def get(self, arr: np.ndarray) -> _Reg | None:
        if self.closed:
            return None
        owner = self.owner(arr)
        key = id(owner)
        addr = _address_of(arr)
        end = addr + len(arr)
        for reg in self.entries.get(key, ()):
            if reg.start <= addr and end <= reg.end:
                return reg
        try:
            weakref.ref(owner)
        except TypeError:
            return None
        start, stop = addr & ~(self.PAGE - 1), -(-end // self.PAGE) * self.PAGE
        if isinstance(owner, np.ndarray) and owner.flags.c_contiguous:  # the whole owner: one registration
            base = _address_of(owner)
            start, stop = min(start, base & ~(self.PAGE - 1)), max(stop, -(-(base + owner.nbytes) // self.PAGE)
                                                                    * self.PAGE)
        pv = pyverbs()
        try:
            mr = pv.mr.MR(self.pd, stop - start, 0, address=start)  # local read only: no remote access
        except Exception as exc:
            if not self.failed_once:
                self.failed_once = True
                log.warning("hetccl verbs: registering %d bytes of user memory failed (%s); such buffers are "
                            "copied through registered bounce buffers", stop - start, exc)
            return None
        reg = _Reg(mr, start, stop, key)
        if key not in self.entries:
            weakref.finalize(owner, self._drop_owner, key)
        self.entries.setdefault(key, []).append(reg)
        self.order.append(reg)
        self._evict()
        return reg

    def _evict(self) -> None:
        for _ in range(len(self.order)):
            if len(self.order) <= self.max_entries:
                return
            reg = self.order.popleft()
            if reg.busy:
                self.order.append(reg)
                continue
            self._close(reg)

    def _close(self, reg: _Reg) -> None:
        lst = self.entries.get(reg.key, [])
        if reg in lst:
            lst.remove(reg)
        if not lst:
            self.entries.pop(reg.key, None)
        with contextlib.suppress(Exception):
            reg.mr.close()

    def _drop_owner(self, key: int) -> None:
        for reg in self.entries.pop(key, []):
            with contextlib.suppress(ValueError):
                self.order.remove(reg)
            with contextlib.suppress(Exception):
                reg.mr.close()

    def close(self) -> None:
        self.closed = True
        for lst in list(self.entries.values()):
            for reg in lst:
                with contextlib.suppress(Exception):
                    reg.mr.close()
        self.entries.clear()
        self.order.clear()
