"""RDMA devices: listing them, and opening one port (context, protection domain, GID or LID)."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from ...errors import (
    TransportError,
)
from ..base import TransportContext
from .loader import pyverbs

log = logging.getLogger("hetccl")


NO_DEVICE = ("no RDMA device (/sys/class/infiniband is empty or missing); load an RDMA driver, e.g. "
             "`modprobe rdma_rxe` and `rdma link add rxe0 type rxe netdev eth0` for soft-RoCE")


def device_names() -> list[str]:
    """Names of the RDMA devices; [] when there are none (libibverbs then fails to list rather than say so)."""
    pv = pyverbs()
    try:
        return [d.name.decode() for d in pv.device.get_device_list()]
    except Exception as exc:  # noqa: BLE001 - pyverbs raises when the kernel has no verbs support at all
        try:
            present = os.listdir("/sys/class/infiniband")
        except OSError:
            present = []
        if not present:
            return []
        raise TransportError(f"verbs: cannot list RDMA devices ({', '.join(present)}): {exc}") from None


def _port_state_name(state: int) -> str:
    return {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}.get(state, str(state))


def _local_rank(ctx: TransportContext | None = None) -> int:
    for var in ("HETCCL_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        raw = os.environ.get(var, "")
        if raw.strip().lstrip("-").isdigit() and int(raw) >= 0:
            return int(raw)
    if ctx is not None and ctx.local_ranks and ctx.rank in ctx.local_ranks:
        return ctx.local_ranks.index(ctx.rank)
    return ctx.rank if ctx is not None else 0


def _is_zero_gid(text: str) -> bool:
    return all(c in "0:" for c in text)


def _gid_type(dev: str, port: int, index: int) -> str:
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}") as f:
            return f.read().strip()
    except OSError:
        return ""


class Device:
    """One opened RDMA device port: context, protection domain, address data."""

    def __init__(self, name: str | None, port: int, gid_index: int | None):
        pv = pyverbs()
        names = device_names()
        if not names:
            raise TransportError(f"verbs: {NO_DEVICE}")
        if name is None:
            name = next((n for n in names if self._active(n, port)), None)
            if name is None:
                raise TransportError(f"verbs: no RDMA device has an active port {port} (devices: {names})")
        elif name not in names:
            raise TransportError(f"verbs: HETCCL_IB_DEVICE names {name!r}, which does not exist "
                                 f"(devices: {names})")
        self.pv, self.name, self.port = pv, name, port
        self.ctx = pv.device.Context(name=name)
        attr = self.ctx.query_port(port)
        if attr.state != pv.enums.IBV_PORT_ACTIVE:
            self.ctx.close()
            raise TransportError(f"verbs: {name} port {port} is {_port_state_name(attr.state)}, not ACTIVE")
        self.mtu = int(attr.active_mtu)
        self.lid = int(attr.lid)
        self.link = "ib" if attr.link_layer == pv.enums.IBV_LINK_LAYER_INFINIBAND else "eth"
        self.gid_index, self.gid = self._pick_gid(attr, gid_index)
        self.pd = pv.pd.PD(self.ctx)

    @staticmethod
    def _active(name: str, port: int) -> bool:
        pv = pyverbs()
        try:
            ctx = pv.device.Context(name=name)
        except Exception:
            return False
        try:
            return ctx.query_port(port).state == pv.enums.IBV_PORT_ACTIVE
        except Exception:
            return False
        finally:
            ctx.close()

    def _pick_gid(self, attr: Any, wanted: int | None) -> tuple[int, str]:
        if wanted is not None:
            try:
                gid = str(self.ctx.query_gid(self.port, wanted))
            except Exception as exc:
                raise TransportError(f"verbs: HETCCL_IB_GID_INDEX={wanted}: {self.name} port {self.port} has no "
                                     f"such GID ({exc})") from None
            if _is_zero_gid(gid) and self.link == "eth":
                raise TransportError(f"verbs: HETCCL_IB_GID_INDEX={wanted}: GID {wanted} of {self.name} port "
                                     f"{self.port} is empty")
            return wanted, gid
        if self.link == "ib":
            return 0, str(self.ctx.query_gid(self.port, 0))
        # RoCE: prefer a RoCE v2 GID holding an IPv4 address (routable over UDP/IP), then any RoCE v2, then any
        best: tuple[int, int, str] | None = None
        for i in range(min(int(attr.gid_tbl_len), 32)):
            try:
                gid = str(self.ctx.query_gid(self.port, i))
            except Exception:
                continue
            if _is_zero_gid(gid):
                continue
            score = 2 * (_gid_type(self.name, self.port, i) == "RoCE v2") + gid.startswith(
                "0000:0000:0000:0000:0000:ffff:")
            if best is None or score > best[0]:
                best = (score, i, gid)
        if best is None:
            raise TransportError(f"verbs: {self.name} port {self.port} has no usable GID (RoCE needs an IP "
                                 "address on the network device)")
        return best[1], best[2]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ctx.close()  # closes the PD, CQs, QPs and MRs created on it
