"""RDMA verbs transport (pyverbs): one reliable-connected queue pair per peer, SEND/RECV with credits.

Connection set-up. Every rank opens one RDMA device (HETCCL_IB_DEVICE, else the first device with an
active port), one protection domain, one completion queue with a completion channel, and a TCP listener.
Per peer, the higher rank dials; both sides run the job-secret HMAC handshake (purpose "verbs") and then
exchange their connection data as msgpack control frames over that authenticated socket: QP number, a random
24-bit PSN, GID (RoCE v2) or LID (InfiniBand), path MTU and the slot geometry. A QP is moved to RTR with the
peer's QPN, PSN and address, so it accepts packets from that one QP only. The socket stays open as the
liveness channel: EOF or an error on it is the peer's death (`ctx.on_peer_lost`), exactly like the TCP
transport's reader, so a rank that vanishes while nothing is in flight towards it is still noticed at once.

Data path. Each QP has S + K receive slots of B bytes in one registered region (S = HETCCL_IB_SLOTS data
slots, K = control slots, B = HETCCL_IB_SLOT_BYTES), all posted as receive work requests. A message is cut
into fragments of at most one slot; each fragment is one SEND whose first 8 bytes are a fragment header
(kind, and the sender's cumulative count of receive slots it has freed: the credit return, piggybacked on
every message). The first fragment also carries the 48-byte data header (fingerprint, tag, size), so
matching and mismatch detection are the core's (`hetccl.matching.Matcher`, from `ctx.new_matcher`).
- Credits: a sender may have at most S data fragments that the receiver has not yet freed; it waits for
  credits (with the deadline) beyond that. When no reverse traffic carries the credits, the receiver sends
  a credit-only message (into one of the K control slots, which are re-posted as soon as they arrive).
- Several fragments are in flight per peer (up to S) and several messages per endpoint.
- Send side: payloads of at least HETCCL_IB_REG_MIN bytes are sent straight from the user's memory, which
  is registered once and kept in a registration cache (keyed by the buffer's owning object, dropped when
  that object is garbage-collected); smaller payloads, and memory that cannot be registered, are copied into
  pre-registered bounce buffers. `send` returns when the NIC has completed every fragment.
- Receive side: fragments land in the receive slots and are copied, or reduced, straight into the posted
  receive's destination; data that arrives before its receive waits in the matcher's bounded early buffer
  (when that is full, slots are not freed and the credits stop the sender).
- Completions: one completion queue per transport, with a completion channel whose file descriptor is
  watched by the event loop (`loop.add_reader`); the handler acknowledges the events, re-arms the CQ and
  polls it empty. No spinning.
- Errors: a failed work completion (QP error, retry exceeded, flush), a broken liveness socket or a deadline
  fails the endpoint with PeerLostError / CollectiveTimeout and reports the peer lost, so every rank ends
  with a HetcclError.

GPU memory: `register_memory` registers device buffers through dma-buf (CUDA `cuMemGetHandleForAddressRange`
then `ibv_reg_dmabuf_mr`); where that is impossible it logs once and returns None, and device buffers go
through host staging (the GPU layer's staged path).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import secrets
import socket
import struct
import sys
import weakref
from collections import deque
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import params
from ..errors import (
    CollectiveTimeout,
    ConfigError,
    HetcclError,
    PeerLostError,
    ProtocolError,
    TransportError,
)
from ..matching import DROP
from ..netio import read_control, write_control
from ..wire import DATA_HEADER, Fingerprint, pack_data_header, unpack_data_header
from .base import Endpoint, Transport, TransportContext, TransportProperties
from .listener import PeerListener, dial

log = logging.getLogger("hetccl")

FRAG = struct.Struct("<BBHI")  # kind, 0, 0, credits (cumulative receive slots freed by the sender, mod 2**32)
FRAG_FIRST, FRAG_NEXT, FRAG_CREDIT = 1, 2, 3
HDR_FIRST = FRAG.size + DATA_HEADER.size
CTRL_SLOTS = 8
SEND_WR_BASE = 1 << 32
SYSTEM_SITE_DIRS = ("/usr/lib/python3/dist-packages", "/usr/lib64/python3/site-packages",
                    f"/usr/lib/python3.{sys.version_info.minor}/site-packages",
                    f"/usr/lib64/python3.{sys.version_info.minor}/site-packages")


# ---------------------------------------------------------------------------------------------- pyverbs

_PV: SimpleNamespace | None = None


def _load_system_pyverbs() -> bool:
    """Distribution packages (Debian's python3-pyverbs) install pyverbs into the system Python's
    dist-packages, which a virtual environment does not see. Load just that package from there when its
    extension modules were built for this interpreter (the rest of dist-packages stays invisible)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so
    for base in SYSTEM_SITE_DIRS:
        pkg = os.path.join(base, "pyverbs")
        init = os.path.join(pkg, "__init__.py")
        try:
            if not os.path.isfile(init) or not any(f.endswith(suffix) for f in os.listdir(pkg)):
                continue
        except OSError:
            continue
        spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[pkg])
        if spec is None or spec.loader is None:
            continue
        mod = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception:
            del sys.modules["pyverbs"]
            continue
        return True
    return False


def pyverbs() -> SimpleNamespace:
    """The pyverbs modules hetccl uses; ImportError with the reason when they cannot be imported."""
    global _PV
    if _PV is not None:
        return _PV
    # pyverbs.pyverbs_error calls logging.basicConfig(level=INFO) when imported: that would print every INFO
    # record of the application (and hetccl's init line on every rank) on stderr. Keep the root logger as it was.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        try:
            importlib.import_module("pyverbs.device")
        except ImportError as exc:
            sys.modules.pop("pyverbs", None)
            if not _load_system_pyverbs():
                raise ImportError(str(exc)) from None
        names = ("device", "enums", "cq", "pd", "mr", "qp", "wr", "addr", "pyverbs_error")
        mods = {n: importlib.import_module(f"pyverbs.{n}") for n in names}
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    _PV = SimpleNamespace(**mods)
    return _PV


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


# ------------------------------------------------------------------------------------------ GPU memory

CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def cuda_dmabuf_fd(ptr: int, nbytes: int) -> tuple[int, int, int]:
    """A dma-buf file descriptor for the device allocation range holding [ptr, ptr+nbytes):
    (fd, offset of ptr inside it, length). TransportError saying why when the driver cannot export it."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise TransportError(f"GPUDirect RDMA needs the CUDA driver (libcuda.so.1): {exc}") from None
    fn = getattr(cuda, "cuMemGetHandleForAddressRange", None)
    if fn is None:
        raise TransportError("GPUDirect RDMA: this CUDA driver has no cuMemGetHandleForAddressRange (dma-buf "
                             "export needs CUDA 11.7+ and the open kernel module)")
    page = 1 << 16  # dma-buf export works on whole GPU pages
    base = ptr & ~(page - 1)
    length = -(-(ptr + nbytes - base) // page) * page
    fd = ctypes.c_int(-1)
    rc = fn(ctypes.byref(fd), ctypes.c_uint64(base), ctypes.c_size_t(length),
            ctypes.c_int(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD), ctypes.c_ulonglong(0))
    if rc != 0 or fd.value < 0:
        raise TransportError(f"GPUDirect RDMA: cuMemGetHandleForAddressRange failed with CUresult {rc} (the "
                             "driver or the GPU does not support dma-buf export)")
    return fd.value, ptr - base, length


def device_range(buf: Any) -> tuple[int, int, str] | None:
    """(address, bytes, vendor) of device memory, None for host memory. Transports sit below hetccl's GPU layer,
    so device memory is told by its protocols alone: an object with ptr, nbytes and vendor (gpu.buffers.DeviceBuf),
    a torch GPU tensor, or __cuda_array_interface__ (CuPy, Numba). TransportError for unusable device memory."""
    if all(hasattr(buf, a) for a in ("ptr", "nbytes", "vendor")):
        return int(buf.ptr), int(buf.nbytes), str(buf.vendor)
    if type(buf).__module__.startswith("torch"):
        if buf.device.type == "cpu":
            return None
        if not buf.is_contiguous():
            raise TransportError("GPUDirect RDMA: the tensor is not contiguous")
        import torch

        return buf.data_ptr(), buf.numel() * buf.element_size(), "hip" if torch.version.hip else "cuda"
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is None:
        return None
    if cai.get("strides") is not None:
        raise TransportError("GPUDirect RDMA: strided device arrays are not registered")
    return int(cai["data"][0]), int(np.prod(cai.get("shape", ()))) * np.dtype(cai["typestr"]).itemsize, "cuda"


def register_device_buffer(pd: Any, buf: Any) -> Any:
    """Register GPU memory for RDMA through dma-buf (`ibv_reg_dmabuf_mr`). TransportError when impossible."""
    found = device_range(buf)
    if found is None:
        raise TransportError("GPUDirect RDMA: the buffer is not device memory")
    ptr, nbytes, vendor = found
    if vendor != "cuda":
        raise TransportError(f"GPUDirect RDMA: dma-buf export of {vendor} memory is not implemented")
    fd, offset, length = cuda_dmabuf_fd(ptr, nbytes)
    try:
        pv = pyverbs()
        access = pv.enums.IBV_ACCESS_LOCAL_WRITE | pv.enums.IBV_ACCESS_REMOTE_WRITE
        return pv.mr.DmaBufMR(pd, length, access, dmabuf=fd, offset=0), offset
    except Exception as exc:
        raise TransportError(f"GPUDirect RDMA: ibv_reg_dmabuf_mr failed: {exc}") from None
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------- endpoint

class _Pending:
    __slots__ = ("kind", "slot", "fut")

    def __init__(self, kind: str, slot: int, fut: asyncio.Future | None):
        self.kind, self.slot, self.fut = kind, slot, fut


class VerbsEndpoint(Endpoint):
    def __init__(self, transport: VerbsTransport, peer: int, sock: socket.socket):
        t, pv = transport, transport.pv
        self.transport, self.peer, self.sock, self.pv = t, peer, sock, pv
        self.loop = asyncio.get_running_loop()
        settings = t.ctx.settings
        self.matcher = t.ctx.new_matcher(peer)  # the core's: frames are delivered to it
        self.timeout = settings.timeout
        self.S, self.B, self.K = t.slots, t.slot_bytes, CTRL_SLOTS
        e = pv.enums
        cap = pv.qp.QPCap(max_send_wr=self.S + self.K + 4, max_recv_wr=self.S + self.K, max_send_sge=2,
                          max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=t.cq, rcq=t.cq, cap=cap)
        self.qp = pv.qp.QP(t.dev.pd, init)
        self.qpn = self.qp.qp_num
        init_attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=t.dev.port)
        init_attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE  # no remote access: SEND/RECV only
        self.qp.to_init(init_attr)  # receives can be posted from INIT on
        self.psn = secrets.randbits(24)
        nrx = self.S + self.K
        self.rx_mr = pv.mr.MR(t.dev.pd, nrx * self.B, e.IBV_ACCESS_LOCAL_WRITE)
        self.rx = _view(self.rx_mr.buf, nrx * self.B)
        ctrl_bytes = 64
        self.tx_mr = pv.mr.MR(t.dev.pd, self.S * self.B + self.K * ctrl_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self.tx = _view(self.tx_mr.buf, self.S * self.B + self.K * ctrl_bytes)
        self.tx_free = list(range(self.S))
        self.ctrl_free = list(range(self.K))
        self.ctrl_base = self.S * self.B
        self.pending: dict[int, _Pending] = {}
        self.next_wr = SEND_WR_BASE  # receive work requests use their slot number as id, sends count from here
        self.sent = 0  # data fragments sent
        self.peer_freed = 0  # of ours, freed by the peer (from its credit fields)
        self.freed = 0  # of the peer's, freed by us
        self.reported = 0  # self.freed as last told to the peer
        self.rxq: deque[tuple[int, int, int]] = deque()  # (slot, byte_len, kind) waiting to be delivered
        self.cur: list[Any] | None = None  # message being received: [fp, tag, nbytes, off, mode, target]
        self.blocked = False
        self._wake = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self.error: BaseException | None = None
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self.max_payload = 1 << 40
        for slot in range(nrx):
            self._post_recv_slot(slot)

    # ------------------------------------------------------------------------------ connection set-up

    def local_info(self) -> dict[str, Any]:
        d = self.transport.dev
        return {"qpn": self.qpn, "psn": self.psn, "gid": d.gid, "lid": d.lid, "mtu": d.mtu, "link": d.link,
                "slots": self.S, "slot_bytes": self.B}

    def connect_qp(self, info: dict[str, Any]) -> None:
        pv, d, e = self.pv, self.transport.dev, self.pv.enums
        try:
            qpn, psn, mtu = int(info["qpn"]), int(info["psn"]), int(info["mtu"])
            gid, lid, link = str(info["gid"]), int(info["lid"]), str(info["link"])
            slots, slot_bytes = int(info["slots"]), int(info["slot_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"verbs: rank {self.peer} sent malformed connection data: {exc!r}") from None
        if not (0 < qpn < 1 << 24 and 0 <= psn < 1 << 24 and 1 <= mtu <= 5):
            raise ProtocolError(f"verbs: rank {self.peer} sent impossible connection data {info!r}")
        if link != d.link:
            raise TransportError(f"verbs: rank {self.peer} is on a {link} port, rank {self.matcher.me} on "
                                 f"{d.link}; they cannot be connected")
        if (slots, slot_bytes) != (self.S, self.B):
            raise TransportError(f"verbs: slot geometry differs: rank {self.peer} has {slots} x {slot_bytes} B, "
                                 f"rank {self.matcher.me} {self.S} x {self.B} B; set HETCCL_IB_SLOTS and "
                                 "HETCCL_IB_SLOT_BYTES alike on every rank")
        self.remote_qpn = qpn
        if d.link == "eth":
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(gid), sgid_index=d.gid_index, hop_limit=64)
            ah = pv.addr.AHAttr(gr=gr, is_global=1, port_num=d.port)
        else:
            ah = pv.addr.AHAttr(dlid=lid, port_num=d.port, is_global=0)
        attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=d.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE
        attr.path_mtu = min(mtu, d.mtu)
        attr.dest_qp_num = qpn
        attr.rq_psn = psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2**14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7  # RNR: retry for ever (credits keep the receive queue fed; this is a backstop)
        attr.ah_attr = ah
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)

    def start(self) -> None:
        self._spawn(self._watch_socket())

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_socket(self) -> None:
        """The liveness channel: the peer never writes after set-up, so any read result means it is gone."""
        try:
            data = await self.loop.sock_recv(self.sock, 1)
            why = "closed its connection" if not data else "sent unexpected bytes on the liveness channel"
        except asyncio.CancelledError:
            return
        except OSError as exc:
            why = f"connection broke: {exc}"
        self._lost(PeerLostError(f"rank {self.matcher.me} lost rank {self.peer}: {why}", self.peer))

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

    # ---------------------------------------------------------------------------------------- failure

    def _wc_error(self, wc: Any) -> None:
        p = self.pending.pop(wc.wr_id, None)  # (an error completion's opcode is undefined; its wr_id is not)
        if self.error is not None or self._closed:
            if p is not None and p.fut is not None and not p.fut.done():
                p.fut.set_exception(self.error or PeerLostError("communicator closed", self.peer))
                p.fut.exception()
            return
        try:
            what = self.pv.cq.cqe_status_to_str(wc.status)
        except Exception:  # noqa: BLE001 - only for the message
            what = "error"
        err = PeerLostError(f"rank {self.matcher.me}: RDMA queue pair to rank {self.peer} failed: {what} "
                            f"(work completion status {wc.status}, vendor error {wc.vendor_err})", self.peer)
        if p is not None and p.fut is not None and not p.fut.done():
            p.fut.set_exception(err)
            p.fut.exception()
        self._lost(err)

    def _lost(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        if not isinstance(exc, HetcclError):
            exc = PeerLostError(str(exc), self.peer)
        self.error = exc
        self.fail(exc)
        if not self._closed:
            self.transport.ctx.on_peer_lost(self.peer, exc)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.matcher.fail_all(exc)  # a receive half delivered included (Matcher.taken)
        exc = self.matcher.error or exc  # the first error stays (Matcher.fail_all)
        for p in list(self.pending.values()):
            if p.fut is not None and not p.fut.done():
                p.fut.set_exception(exc)
                p.fut.exception()
        self._wake.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.fail(self.error or PeerLostError("communicator closed", self.peer))
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        self.transport.by_qpn.pop(self.qpn, None)
        with contextlib.suppress(Exception):
            self.qp.close()
        for mr in (self.rx_mr, self.tx_mr):
            with contextlib.suppress(Exception):
                mr.close()
        self.sock.close()


# ------------------------------------------------------------------------------------------ transport

_REASON_CACHE: dict[tuple[str, str], str | None] = {}


class VerbsTransport(Transport):
    name = "verbs"
    api_version = 2
    # nominal, not calibrated on hardware yet: a 100 Gb/s port (~10 GB/s after headers), one-sided writes with
    # a few-microsecond round trip; ring steps pay the same per-chunk task overhead as tcp's. It registers
    # memory itself (registration cache; device buffers through dma-buf where the provider allows).
    properties = TransportProperties(latency_us=8, ring_step_us=18, bandwidth_gb_s=10, registers_memory=True)
    priority = 50  # above tcp (10): preferred across hosts when an active RDMA device exists; below shm (100)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            key = (tuple(params.get("HETCCL_IB_DEVICE")), os.environ.get("HETCCL_LOCAL_RANK", ""))
        except ConfigError as exc:  # a bad HETCCL_IB_DEVICE is the reason
            return str(exc)
        if key not in _REASON_CACHE:
            _REASON_CACHE[key] = cls._why_not()
        return _REASON_CACHE[key]

    @classmethod
    def _why_not(cls) -> str | None:
        try:
            pyverbs()
        except ImportError as exc:
            return (f"pyverbs is not importable ({exc}); install rdma-core's Python binding for this Python "
                    "(Debian/Ubuntu: apt-get install python3-pyverbs)")
        except Exception as exc:  # noqa: BLE001 - a broken binding is a reason, not a crash
            return f"pyverbs failed to load: {exc!r}"
        try:
            names = device_names()
        except TransportError as exc:
            return str(exc).removeprefix("verbs: ")
        if not names:
            return NO_DEVICE
        wanted = params.get("HETCCL_IB_DEVICE")
        if wanted:
            name, port = wanted[_local_rank() % len(wanted)]
            if name not in names:
                return f"HETCCL_IB_DEVICE names {name!r}, which does not exist (devices: {', '.join(names)})"
            if not Device._active(name, port):
                return f"RDMA device {name} port {port} is not ACTIVE"
            return None
        if not any(Device._active(n, 1) for n in names):
            return f"no RDMA device has an active port 1 (devices: {', '.join(names)}); check `ibv_devinfo`"
        return None

    def __init__(self, ctx: TransportContext):
        super().__init__(ctx)
        self.pv: Any = None
        self.slots = params.get("HETCCL_IB_SLOTS")
        self.slot_bytes = params.get("HETCCL_IB_SLOT_BYTES")
        if self.slot_bytes < 4096 or self.slot_bytes & (self.slot_bytes - 1) or self.slot_bytes > 1 << 30:
            raise ConfigError(f"HETCCL_IB_SLOT_BYTES={self.slot_bytes} must be a power of two in 4K..1G")
        self.reg_min = params.get("HETCCL_IB_REG_MIN")
        self.dev: Device | None = None
        self.cq: Any = None
        self.channel: Any = None
        self.channel_fd = -1
        self.regcache: RegCache | None = None
        self.by_qpn: dict[int, VerbsEndpoint] = {}
        self._listener = PeerListener(ctx, "verbs", "verbs")
        self._endpoints: list[VerbsEndpoint] = []
        self._gpu_warned = False

    # ------------------------------------------------------------------------------------- listening

    async def listen(self) -> dict[str, Any]:
        s = self.ctx.settings
        try:
            self.pv = pyverbs()
        except ImportError as exc:
            raise TransportError(f"verbs: pyverbs is not importable: {exc}") from None
        devices = s.ib_devices
        name, port = devices[_local_rank(self.ctx) % len(devices)] if devices else (None, 1)
        try:
            self.dev = Device(name, port, s.ib_gid_index)
        except HetcclError:
            raise
        except Exception as exc:  # pyverbs errors opening the device: say which and why
            raise TransportError(f"verbs: opening RDMA device {name or '(first active)'} port {port} failed: "
                                 f"{exc}") from None
        self.regcache = RegCache(self.dev.pd)
        host = self.ctx.bind_host
        port = self._listener.start()
        log.debug("hetccl verbs: rank %d uses %s port %d (%s) gid[%d]=%s", self.ctx.rank, self.dev.name,
                  self.dev.port, self.dev.link, self.dev.gid_index, self.dev.gid)
        return {"host": host, "port": port, "link": self.dev.link, "dev": self.dev.name}

    @property
    def refused(self) -> int:
        return self._listener.refused

    def can_reach(self, peer: int, peer_record: dict[str, Any], same_host: bool) -> bool:
        return "port" in peer_record and self.dev is not None and peer_record.get("link") == self.dev.link

    # ------------------------------------------------------------------------------------ connecting

    def _open_cq(self, npeers: int) -> None:
        pv = self.pv
        assert self.dev is not None
        before = _event_fds()
        self.channel = pv.cq.CompChannel(self.dev.ctx)
        new = sorted(_event_fds() - before)
        if len(new) != 1:
            raise TransportError(f"verbs: cannot find the completion channel's file descriptor (new: {new})")
        self.channel_fd = new[0]
        os.set_blocking(self.channel_fd, False)
        depth = npeers * 2 * (self.slots + CTRL_SLOTS + 4) + 16
        self.cq = pv.cq.CQ(self.dev.ctx, depth, None, self.channel, 0)
        self.cq.req_notify()
        asyncio.get_running_loop().add_reader(self.channel_fd, self._on_channel)

    def _on_channel(self) -> None:
        """The completion channel is readable: acknowledge its events, re-arm the CQ, poll it empty."""
        pv, cq = self.pv, self.cq
        if cq is None:
            return
        n = 0
        while True:
            try:
                self.channel.get_cq_event(cq)
            except pv.pyverbs_error.PyverbsError:
                break  # EAGAIN: no more events
            n += 1
        if n:
            cq.ack_events(n)
        cq.req_notify()
        self.drain()

    def drain(self) -> None:
        touched: dict[int, VerbsEndpoint] = {}
        while True:
            k, wcs = self.cq.poll(64)
            for wc in wcs:
                ep = self.by_qpn.get(wc.qp_num)
                if ep is None:
                    continue
                try:
                    ep.on_wc(wc)
                except Exception as exc:  # noqa: BLE001 - never let one peer's failure escape into the loop
                    ep._lost(PeerLostError(f"rank {self.ctx.rank}: completion handling for rank {ep.peer} "
                                           f"failed: {exc!r}", ep.peer))
                touched[ep.peer] = ep
            if k < 64:
                break
        for ep in touched.values():
            ep.after_batch()

    async def _dial(self, peer: int, record: dict[str, Any]) -> socket.socket:
        return await dial(self.ctx, peer, record, "verbs", "verbs")

    async def connect(self, peers: dict[int, dict[str, Any]]) -> dict[int, Endpoint]:
        if not peers:
            return {}
        me, timeout = self.ctx.rank, self.ctx.settings.timeout
        self._open_cq(len(peers))
        loop = asyncio.get_running_loop()

        async def one(peer: int, record: dict[str, Any]) -> tuple[int, VerbsEndpoint]:
            if peer < me:
                sock = await self._dial(peer, record)
            else:
                try:
                    sock = await asyncio.wait_for(asyncio.shield(self._listener.incoming(peer)), timeout)
                except TimeoutError:
                    raise CollectiveTimeout(f"rank {me}: rank {peer} never connected (verbs) within "
                                            f"{timeout:.0f} s") from None
            ep = VerbsEndpoint(self, peer, sock)
            self._endpoints.append(ep)
            self.by_qpn[ep.qpn] = ep
            limit = 4096
            try:
                async with asyncio.timeout(timeout):
                    if peer < me:
                        await write_control(loop, sock, ep.local_info(), limit, peer)
                        theirs = await read_control(loop, sock, limit, peer)
                    else:
                        theirs = await read_control(loop, sock, limit, peer)
                        await write_control(loop, sock, ep.local_info(), limit, peer)
                    ep.connect_qp(theirs)
                    # both QPs are ready to receive before anyone sends
                    await write_control(loop, sock, {"ready": True}, limit, peer)
                    if (await read_control(loop, sock, limit, peer)).get("ready") is not True:
                        raise ProtocolError(f"verbs: rank {peer} did not confirm the connection")
            except TimeoutError:
                raise CollectiveTimeout(f"rank {me}: verbs connection set-up with rank {peer} timed out") from None
            except HetcclError:
                raise
            except Exception as exc:  # pyverbs errors: say which peer and what
                raise TransportError(f"rank {me}: verbs connection to rank {peer} failed: {exc}") from None
            ep.start()
            return peer, ep

        pairs = await asyncio.gather(*(one(p, r) for p, r in peers.items()))
        return dict(pairs)

    # --------------------------------------------------------------------------------------- memory

    def register_memory(self, buf: Any) -> Any:
        """Register a buffer for RDMA. Host memory: through the registration cache. Device memory: through
        dma-buf (GPUDirect RDMA); where impossible, say so once and return None (device data is staged)."""
        if self.dev is None:
            return None
        try:
            if device_range(buf) is None:
                assert self.regcache is not None
                return self.regcache.get(np.asarray(buf).reshape(-1).view(np.uint8))
            return register_device_buffer(self.dev.pd, buf)
        except TransportError as exc:
            if not self._gpu_warned:
                self._gpu_warned = True
                log.warning("hetccl verbs: %s; device buffers are staged through host memory", exc)
            return None

    # ---------------------------------------------------------------------------------------- close

    async def close(self) -> None:
        self._listener.close()
        for ep in self._endpoints:
            await ep.close()
        self._endpoints.clear()
        if self.channel_fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.channel_fd)
            self.channel_fd = -1
        if self.regcache is not None:
            self.regcache.close()
        for obj in (self.cq, self.channel):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        self.cq = self.channel = None
        if self.dev is not None:
            self.dev.close()
            self.dev = None


def _event_fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[infinibandevent]":
                out.add(int(name))
        except OSError:
            pass
    return out
