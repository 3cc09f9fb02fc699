"""The verbs transport on a host without RDMA: clear reasons, configuration, the forced-transport error,
and the GPUDirect registration path failing clearly. (The transport itself is tested for real on soft-RoCE
devices in the guest: tests/rdma/, started by test_rdma_guest.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rankrun import ROOT, run_ranks

from hetccl.config import Settings, env_int, parse_ib_devices, parse_ib_gid_index
from hetccl.errors import ConfigError, TransportError
from hetccl.transports import registry
from hetccl.transports.shm import ShmTransport
from hetccl.transports.tcp import TcpTransport
from hetccl.transports.verbs import VerbsTransport, register_device_buffer


def _has_rdma_device() -> bool:
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def test_registered_as_builtin_and_entry_point() -> None:
    assert registry.discover()["verbs"] == "hetccl.transports.verbs:VerbsTransport"
    assert registry.load("verbs") is VerbsTransport
    assert VerbsTransport.api_version == 2


def test_priority_between_shm_and_tcp() -> None:
    """shm inside a host, verbs across hosts when usable, TCP otherwise."""
    assert ShmTransport.priority > VerbsTransport.priority > TcpTransport.priority


def test_selected_prefers_verbs_over_tcp_when_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VerbsTransport, "unavailable_reason", classmethod(lambda cls: None))
    names = [c.name for c in registry.selected(None)]
    assert names.index("verbs") < names.index("tcp")
    assert [c.name for c in registry.selected(["tcp", "verbs"])] == ["verbs", "tcp"]


@pytest.mark.skipif(_has_rdma_device(), reason="this host has an RDMA device")
def test_unavailable_reason_without_rdma() -> None:
    reason = VerbsTransport.unavailable_reason()
    assert reason is not None
    assert "pyverbs is not importable" in reason or "no RDMA device" in reason, reason
    assert "python3-pyverbs" in reason or "rdma_rxe" in reason, reason


@pytest.mark.skipif(_has_rdma_device(), reason="this host has an RDMA device")
def test_info_says_why_verbs_is_unavailable() -> None:
    out = subprocess.run([sys.executable, "-m", "hetccl", "info"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("verbs"))
    assert "unavailable:" in line and ("pyverbs" in line or "RDMA device" in line), line


@pytest.mark.skipif(_has_rdma_device(), reason="this host has an RDMA device")
def test_forcing_verbs_without_a_device_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="HETCCL_TRANSPORTS asks for 'verbs', which is unavailable"):
        registry.selected(["verbs"])


@pytest.mark.timeout(90)
@pytest.mark.skipif(_has_rdma_device(), reason="this host has an RDMA device")
def test_forcing_verbs_without_a_device_fails_every_rank_clearly() -> None:
    proc = run_ranks(2, "workers:p2p", env={"HETCCL_TRANSPORTS": "verbs"}, expect_rc=None, timeout=80)
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and "asks for 'verbs', which is unavailable" in proc.stderr, \
        proc.stderr[-3000:]


def test_ib_device_parsing() -> None:
    assert parse_ib_devices("") == []
    assert parse_ib_devices("mlx5_0") == [("mlx5_0", 1)]
    assert parse_ib_devices(" rxe0 , rxe1:2 ") == [("rxe0", 1), ("rxe1", 2)]
    for bad in ("mlx5_0:x", "mlx5_0:0", ":1", "a b", "dev/x"):
        with pytest.raises(ConfigError, match="HETCCL_IB_DEVICE"):
            parse_ib_devices(bad)


def test_gid_index_parsing() -> None:
    assert parse_ib_gid_index(None) is None
    assert parse_ib_gid_index(" ") is None
    assert parse_ib_gid_index("3") == 3
    for bad in ("x", "-1", "70000"):
        with pytest.raises(ConfigError, match="HETCCL_IB_GID_INDEX"):
            parse_ib_gid_index(bad)


def test_settings_read_the_ib_variables() -> None:
    s = Settings.from_env({"HETCCL_IB_DEVICE": "rxe0,rxe1", "HETCCL_IB_GID_INDEX": "1",
                           "HETCCL_TRANSPORTS": "Verbs, tcp"})
    assert s.ib_devices == [("rxe0", 1), ("rxe1", 1)]
    assert s.ib_gid_index == 1
    assert s.transports == ["verbs", "tcp"]
    with pytest.raises(ConfigError, match="HETCCL_IB_GID_INDEX"):
        Settings.from_env({"HETCCL_IB_GID_INDEX": "one"})


def test_env_int_bounds() -> None:
    assert env_int("X", 16, 2, 64, {}) == 16
    assert env_int("X", 16, 2, 64, {"X": "32"}) == 32
    for bad in ("1", "65", "abc"):
        with pytest.raises(ConfigError, match="X="):
            env_int("X", 16, 2, 64, {"X": bad})


class _FakeCudaArray:
    """Something that claims to be CUDA memory (the __cuda_array_interface__ protocol), on a CPU host."""

    def __init__(self) -> None:
        self.__cuda_array_interface__ = {"shape": (1024,), "typestr": "<f4", "data": (1 << 40, False),
                                         "version": 3}


def test_gpudirect_registration_fails_clearly_without_driver_support() -> None:
    """GPU buffers register through dma-buf (CUDA's cuMemGetHandleForAddressRange, then ibv_reg_dmabuf_mr).
    Without a CUDA driver (or without dma-buf export) that fails with a TransportError saying why; the
    transport then logs once and stages device data through host memory."""
    with pytest.raises(TransportError, match="GPUDirect RDMA"):
        register_device_buffer(None, _FakeCudaArray())


def test_reason_when_pyverbs_is_not_importable() -> None:
    code = ("import sys; sys.modules['pyverbs'] = None\n"
            "import hetccl.transports.verbs as v; v.SYSTEM_SITE_DIRS = ()\n"
            "print(v.VerbsTransport.unavailable_reason())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pyverbs is not importable" in out.stdout and "apt-get install python3-pyverbs" in out.stdout, out.stdout


def _system_pyverbs_matches() -> bool:
    import importlib.machinery

    pkg = "/usr/lib/python3/dist-packages/pyverbs"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return os.path.isdir(pkg) and any(f.endswith(suffix) for f in os.listdir(pkg))


@pytest.mark.skipif(not _system_pyverbs_matches(), reason="no system pyverbs built for this Python version")
def test_system_pyverbs_is_loaded_into_a_virtualenv() -> None:
    """Debian's python3-pyverbs lives in the system dist-packages, which a venv does not see: hetccl loads that
    one package from there (and nothing else from dist-packages)."""
    code = ("import sys, hetccl.transports.verbs as v; pv = v.pyverbs(); print(pv.device.__file__); "
            "print('/usr/lib/python3/dist-packages' in sys.path)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0].startswith("/usr/lib/python3/dist-packages/pyverbs/") or "site-packages" in lines[0], lines
