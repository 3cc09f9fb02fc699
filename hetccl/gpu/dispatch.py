"""The vendor collective inside one GPU island: NCCL/RCCL communicators per device, and the calls that enqueue
a collective on them.

Islands: every rank carries a label (HETCCL_ISLAND, else "nvidia"/"amd" when such a GPU is present, else
"cpu"). Ranks with different labels never share a vendor CCL. The engine (group.py) runs a collective of
device buffers here when its group is one GPU island; across islands the hierarchical schedule
(hierarchical.py) calls the island groups and the leaders' group in turn. This module knows nothing of either:
it is handed the island's members, the store and the deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..config import island_vendor
from ..dtypes import ReduceOp
from ..errors import ConfigError
from .buffers import DeviceBuf
from .vendor_comm import VendorComm

GPU_LABELS = {"nvidia": "nvidia", "amd": "amd"}
# the collectives the vendor CCL runs (all_to_all, gather and scatter of device buffers are staged)
VENDOR_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")

VendorCall = Callable[[VendorComm, int], int]


def vendor_of(label: str) -> str | None:
    """'nvidia', 'amd' or None (CPU) for an island label; custom labels take the vendor of their prefix
    ('nvidia-a' is an NVIDIA island named a)."""
    return GPU_LABELS.get(island_vendor(label))


class IslandVendors:
    """The vendor communicators of one island group, one per device, each made on first use.

    A communicator is made once, by a task that every concurrent caller awaits: collectives issued back to back
    while it is being made (torch async ops, asyncio.gather) resume in issue order, so every rank enqueues them
    into NCCL in the same order (NCCL requires it), and only one communicator is made per key."""

    def __init__(self, label: str, rank: int, job_ranks: list[int], key: str, fabric: Any, timeout: float):
        self.label, self.rank, self.job_ranks = label, rank, job_ranks
        self._key = key  # the same on every island member: '{job}/vendor/{group id}'
        self._fabric, self._timeout = fabric, timeout
        self.comms: dict[int, VendorComm] = {}  # device -> vendor communicator
        self.pending: dict[int, asyncio.Task] = {}  # device -> the task making it

    async def get(self, device: int) -> VendorComm:
        vc = self.comms.get(device)
        if vc is not None:
            return vc
        task = self.pending.get(device)
        if task is None:
            vendor = vendor_of(self.label)
            if vendor is None:
                raise ConfigError(f"rank {self.rank} is on CPU island {self.label!r} but passed device memory; pass "
                                  "host memory, or set HETCCL_ISLAND to a GPU label (e.g. nvidia)")
            # the island's n-th vendor communicator (the members' devices differ, the key does not)
            key = f"{self._key}/{len(self.comms) + len(self.pending)}"
            fab = self._fabric

            async def make() -> VendorComm:
                try:
                    made = await VendorComm.create(vendor, fab.store, key, self.rank, len(self.job_ranks), device,
                                                   self._timeout, fab.lost, self.job_ranks)
                    self.comms[device] = made
                    return made
                finally:
                    self.pending.pop(device, None)

            task = self.pending[device] = asyncio.ensure_future(make())
        return await asyncio.shield(task)


def vendor_call(name: str, bufs: list[DeviceBuf], root: int, op: ReduceOp) -> tuple[DeviceBuf, VendorCall, str]:
    """How to enqueue one collective of checked device buffers: (the buffer whose stream and device it runs on,
    call(vendor comm, stream handle) -> rc, a description). Device collectives inside an island take no
    sequence number: the vendor CCL matches them by enqueue order."""
    if name in ("all_reduce", "broadcast", "reduce"):
        buf = bufs[0]
        ptr, count, dt = buf.ptr, buf.count, buf.dtype
        if name == "all_reduce":
            return buf, lambda vc, s: vc.lib.all_reduce(ptr, ptr, count, dt, op, vc.comm, s), \
                f"all_reduce of {buf.nbytes} bytes"
        if name == "broadcast":
            return buf, lambda vc, s: vc.lib.broadcast(ptr, ptr, count, dt, root, vc.comm, s), "broadcast"
        # NCCL writes the result on root only; other ranks' buffers are left as they were
        return buf, lambda vc, s: vc.lib.reduce(ptr, ptr, count, dt, op, root, vc.comm, s), "reduce"
    out, inp = bufs
    if name == "all_gather":
        return out, lambda vc, s: vc.lib.all_gather(inp.ptr, out.ptr, inp.count, out.dtype, vc.comm, s), \
            "all_gather"
    return out, lambda vc, s: vc.lib.reduce_scatter(inp.ptr, out.ptr, out.count, out.dtype, op, vc.comm, s), \
        "reduce_scatter"


def check_device_label(label: str, buf: DeviceBuf, rank: int, job_rank: int) -> None:
    """A rank's island label must agree with the memory it passes: a label names an island, the device says
    which vendor it is (a CPU label with GPU memory would otherwise stage silently through host memory)."""
    device_vendor = "amd" if buf.vendor == "hip" else "nvidia"
    if vendor_of(label) != device_vendor:
        raise ConfigError(f"rank {rank} (global rank {job_rank}) has island label {label!r} but passed "
                          f"{device_vendor} device memory (GPU {buf.device}); label GPU ranks {device_vendor}-<name> "
                          f"in HETCCL_ISLAND (e.g. {device_vendor}-0), or pass host memory on a CPU island")


async def drain(vendor_comms: list[VendorComm], deadline: float) -> None:
    """Wait for every operation enqueued on these vendor communicators to complete."""
    for vc in vendor_comms:
        await vc.drain(deadline)
