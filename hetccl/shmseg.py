"""A named shared-memory segment under /dev/shm, mapped into this process: what the shm transport's rings and
the GPU cross-island link are laid out in."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import time
from collections.abc import Callable

import numpy as np

from .errors import CollectiveTimeout, TransportError
from .native import ffi


class Segment:
    """Created (create=True, zeroed unless touch=False) or opened at its expected size; `mem` is a byte view,
    `cbase` its C address, and the first 8 bytes are the owner's waiting flag. publish=False creates it under
    a private name until publish(), so that a peer opening it by name (opened()) finds it whole."""

    def __init__(self, name: str, size: int, create: bool, touch: bool = True, publish: bool = True):
        self.name, self.size = name, size
        path = "/dev/shm/" + name
        self.part = path + ".part" if create and not publish else ""  # where it is until publish()
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.part or path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                try:  # take the pages now: a full /dev/shm is this error, not a SIGBUS on first touch
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.unlink(self.part or path)
                    raise TransportError(f"/dev/shm cannot hold shared segment {name} ({size >> 10} KiB): "
                                         f"{exc.strerror}; enlarge /dev/shm (docker: --shm-size) or lower the "
                                         "HETCCL_SHM_* sizes") from None
            elif os.fstat(fd).st_size != size:
                raise TransportError(f"shared segment {path} has size {os.fstat(fd).st_size}, expected {size}; "
                                     "do all local ranks use the same HETCCL_SHM_* settings?")
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.mem = np.frombuffer(self.mm, dtype=np.uint8)
        self.cbase = ffi.cast("char *", ffi.from_buffer("char[]", self.mem, True))
        if create and touch:
            self.mem[:] = 0  # fault the pages in now, not on the hot path (touch=False: the caller places them)
        self.waiting = ffi.cast("uint64_t *", self.cbase)

    def publish(self) -> None:
        """Give the segment its name, by an atomic rename once it is sized, zeroed and laid out: a peer polling
        for the name (opened()) never maps it half made, so making and opening need no barrier between them."""
        if self.part:
            os.rename(self.part, "/dev/shm/" + self.name)
            self.part = ""

    @classmethod
    async def opened(cls, name: str, size: int, timeout: float, what: str,
                     check: Callable[[], None] | None = None) -> Segment:
        """Segment `name` opened once its maker has published it, polled (1 ms, doubling to 50 ms) for up to
        `timeout` seconds; CollectiveTimeout saying `what` it is after that. check() runs before each look (it
        raises what ended the wait early: a lost peer)."""
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            if check is not None:
                check()
            try:
                return cls(name, size, create=False)
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(f"{what} (/dev/shm/{name}) did not appear within {timeout:.0f} s") \
                        from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.05)

    def close(self) -> None:
        """Unmap now: the mapping holds a file descriptor until then (CPython's mmap keeps a duplicate), which a
        process that makes and drops communicators in a loop would otherwise pile up until the collector runs.
        No view of the segment may be used afterwards; one still held elsewhere leaves the unmapping to it."""
        self.waiting = self.cbase = self.mem = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self.mm.close()

    @staticmethod
    def unlink(name: str) -> None:
        """Drop the name, and an unpublished segment's private one."""
        for path in ("/dev/shm/" + name, "/dev/shm/" + name + ".part"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
