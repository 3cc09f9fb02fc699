"""GPU locality from sysfs and first-touch placement (hetccl/gpu/numa.py): the parts that need no GPU."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest

from hetccl.gpu import numa


def test_cpulist_parsing():
    assert numa._cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa._cpulist("") == set()


def test_gpu_locality_from_a_sysfs_tree(tmp_path):
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    dev = tmp_path / "0000:1b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    (dev / "local_cpulist").write_text("16-19\n")
    assert numa.gpu_locality(props, str(tmp_path)) == (1, {16, 17, 18, 19})
    (dev / "numa_node").write_text("-1\n")  # a VM without NUMA: no node, the CPUs still
    assert numa.gpu_locality(props, str(tmp_path)) == (None, {16, 17, 18, 19})
    other = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x2B, pci_device_id=0)
    assert numa.gpu_locality(other, str(tmp_path)) == (None, set())
    assert numa.gpu_locality(object(), str(tmp_path)) == (None, set())  # a runtime without PCI ids


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_near_moves_the_thread_and_restores_it():
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs 2 usable CPUs to move the thread between")
    one = {min(before)}
    with numa.near(one) as moved:
        assert os.sched_getaffinity(0) == one
        buf = np.ones(1 << 16, dtype=np.uint8)
        numa.touch(buf)
    assert moved and not buf.any()
    assert os.sched_getaffinity(0) == before
    with numa.near(set()) as moved:  # nothing known: nothing changes
        assert not moved and os.sched_getaffinity(0) == before
    with numa.near({max(before) + 1000}) as moved:  # CPUs this process may not use: left alone
        assert not moved and os.sched_getaffinity(0) == before


def test_placement_setting(monkeypatch):
    from hetccl.errors import ConfigError
    from hetccl.gpu import pairlink

    monkeypatch.delenv("HETCCL_PAIRLINK_PLACE", raising=False)
    assert pairlink.placement() == "receiver"
    monkeypatch.setenv("HETCCL_PAIRLINK_PLACE", "sender")
    assert pairlink.placement() == "sender"
    monkeypatch.setenv("HETCCL_PAIRLINK_PLACE", "socket0")
    with pytest.raises(ConfigError, match="receiver, sender or none"):
        pairlink.placement()
