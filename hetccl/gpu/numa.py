"""Where a GPU sits in the host: its NUMA node and the CPUs next to it (from sysfs), and first-touch placement of
shared host memory near a GPU.

Pages of a /dev/shm segment land on the NUMA node of the CPU that first writes them. A host-staged link whose
slots all sit on one socket makes the other GPU's copies cross the socket interconnect both ways; placing each
ring on the node of the GPU that reads it (its copies to the device are PCIe reads, which suffer the remote
round trip most; the sender's writes are posted) is what NCCL does for its host buffers too."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

SYSFS_PCI = "/sys/bus/pci/devices"


def _cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_locality(props: Any, sysfs: str = SYSFS_PCI) -> tuple[int | None, set[int]]:
    """(NUMA node or None, CPUs next to the GPU or empty) for a torch device-properties object; empty where the
    runtime does not tell the PCI address or sysfs does not know it (VMs without NUMA, containers)."""
    try:
        path = f"{sysfs}/{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return None, set()
    node: int | None = None
    cpus: set[int] = set()
    with contextlib.suppress(OSError, ValueError):
        with open(f"{path}/numa_node") as f:
            n = int(f.read())
        node = n if n >= 0 else None
    with contextlib.suppress(OSError, ValueError):
        with open(f"{path}/local_cpulist") as f:
            cpus = _cpulist(f.read())
    return node, cpus


@contextlib.contextmanager
def near(cpus: set[int]) -> Iterator[bool]:
    """Run the block on `cpus` (those of them this process may use), so that pages it first touches land on
    their node; yields whether the affinity was changed. The thread's affinity is restored afterwards."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield False
        return
    before = os.sched_getaffinity(0)
    use = cpus & before
    if not use or use == before:
        yield False
        return
    os.sched_setaffinity(0, use)
    try:
        yield True
    finally:
        os.sched_setaffinity(0, before)


def touch(mem: Any) -> None:
    """Fault every page of a writable byte view in (writing zeros: the segment is fresh)."""
    mem[:] = 0
