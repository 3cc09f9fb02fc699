"""A `torch.distributed` backend ("hetccl") built on hetccl's communicator.

Inside one GPU island, a collective on CUDA tensors is enqueued from the caller's thread on its current stream
(the vendor CCL, as ProcessGroupNCCL does) and returns a Work that is done as far as the host is concerned
(`_EnqueuedWork`). Every other op schedules a hetccl coroutine on the communicator's background event loop and
returns at once a Work wrapping a `torch.futures.Future`, completed from the loop thread when the collective
finishes (`_FutureWork`). Collectives are issued in program order (the loop starts coroutines FIFO, and the
caller's thread enqueues only while none of the group's operations is on the loop), so several may be in flight.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hetccl
from hetccl import lifecycle, params
from hetccl.dtypes import parse_dtype, parse_op
from hetccl.errors import ConfigError
from hetccl.gpu import streamorder
from hetccl.gpu.runtime import CALLER_STREAM, on_stream, record_event, stream_waits, torch_stream, use_device
from hetccl.gpu.vendor_comm import blocking
from hetccl.torch.enqueuer import Enqueuer

BACKEND_NAME = "hetccl"
log = logging.getLogger("hetccl")

_ADDR_KEY = "hetccl/addr"
_SECRET_KEY = "hetccl/secret"

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.AVG: "avg",
}


_OPS_BY_TYPE = {getattr(k, "op", k): v for k, v in _OPS.items() if getattr(k, "__hash__", None)}
# the island lane's ops (hetccl's ReduceOp), by c10d's op kind; PREMUL_SUM is not here (the general path scales)
_LANE_OPS = {kind: parse_op(name) for kind, name in _OPS_BY_TYPE.items()}
_ENQUEUER_JOIN_S = 2.0  # how long closing a group waits for its enqueuing thread to run out its queue
_EARLY_TRACKED = 64  # collectives in flight whose writes _early_stream checks; past that, no early copies
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a stream handle without a Stream object


class UnsupportedError(hetccl.HetcclError):
    """An option or argument shape the hetccl torch backend does not implement."""


def _reduce_op(opts: Any) -> tuple[str, float | None]:
    """(hetccl op name, premultiplier): PREMUL_SUM(f) (FSDP2's gradient divide factor) is a sum of inputs * f."""
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    kind = getattr(op, "op", op)
    name = _OPS_BY_TYPE.get(kind)
    if name is not None:
        return name, None
    for torch_op, name in _OPS.items():
        if kind == torch_op:
            return name, None
    if kind == dist.ReduceOp.PREMUL_SUM:
        try:
            factor = op.factor  # a float or a one-element tensor (torch >= 2.x exposes it to Python)
        except (AttributeError, RuntimeError) as e:
            raise UnsupportedError("hetccl backend: ReduceOp.PREMUL_SUM without a readable factor in this torch "
                                   "version is not supported") from e
        if isinstance(factor, torch.Tensor):
            if factor.numel() != 1:
                raise UnsupportedError("hetccl backend: PREMUL_SUM needs a scalar factor "
                                       f"(got a tensor of {factor.numel()} elements)")
            factor = factor.item()
        return "sum", float(factor)
    name = getattr(kind, "name", str(kind))
    raise UnsupportedError(f"hetccl backend: reduce op {name} is not supported "
                           "(use SUM, PRODUCT, MIN, MAX, AVG or PREMUL_SUM)")


def _premul(t: torch.Tensor, factor: float | None, inplace: bool) -> torch.Tensor:
    """t scaled by the PREMUL_SUM factor (in place when t is a buffer the op overwrites anyway)."""
    if factor is None:
        return t
    if not t.is_floating_point():
        raise UnsupportedError(f"hetccl backend: PREMUL_SUM needs a floating-point tensor (got {t.dtype})")
    with torch.no_grad():
        return t.mul_(factor) if inplace else t * factor


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _rendezvous_host() -> str:
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        host = "127.0.0.1"
    return "127.0.0.1" if host == "localhost" else host


def _bootstrap(store: Any, rank: int, size: int, timeout: datetime.timedelta | None) -> hetccl.SyncCommunicator:
    """Start a hetccl job for this process group, exchanging rendezvous address and secret through `store`."""
    if rank == 0:
        host = _rendezvous_host()
        store.set(_SECRET_KEY, secrets.token_hex(32))
        store.set(_ADDR_KEY, f"{host}:{_free_port(host)}")
    addr = store.get(_ADDR_KEY).decode()
    secret = store.get(_SECRET_KEY).decode()
    kwargs: dict[str, Any] = {"rank": rank, "world_size": size, "addr": addr, "secret": secret}
    if not params.is_set("HETCCL_TIMEOUT") and timeout is not None:  # the variable wins over the group's
        kwargs["timeout"] = float(timeout.total_seconds())
    return hetccl.init_sync(**kwargs)


# CUDA tensors go straight to hetccl's device path (NCCL inside an island, the cross-island link between
# islands); HETCCL_TORCH_CUDA=staged copies them through host memory instead
_CUDA_DIRECT = params.get("HETCCL_TORCH_CUDA") == "direct"
# a collective of CUDA tensors across islands is ordered on the caller's stream and returns at once
# (gpu/streamorder.py), as inside one island: None (auto) wherever every rank can, agreed at init; True: required
_STREAM_ORDER = params.get("HETCCL_TORCH_STREAM_ORDER")
# ... which deadlocks under CUDA's lazy module loading (gpu/streamorder.loading_problem); torch picks LAZY at its
# CUDA start only where the variable is unset, so choosing EAGER here, before that start, is the user's intent
if _STREAM_ORDER is not False and "CUDA_MODULE_LOADING" not in os.environ and not torch.cuda.is_initialized():
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
# CPU tensors whose numpy view the shared-memory fast path reduces (numpy has no bfloat16)
_HOST_NOW_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.int8,
                              torch.uint8})


class _Staged:
    """A contiguous stand-in for a tensor; `finish()` copies results back into the original. CUDA tensors stay
    on the device unless `host` (ops hetccl runs only on host memory: point-to-point)."""

    def __init__(self, t: torch.Tensor, writeback: bool = True, host: bool = False):
        if t.device.type != "cpu" and (host or not _CUDA_DIRECT):
            self.orig, self.buf, self.writeback = t, t.detach().to("cpu").contiguous(), writeback
        elif t.is_contiguous():
            self.orig, self.buf, self.writeback = t, t, False
        else:
            self.orig, self.buf, self.writeback = t, t.detach().contiguous(), writeback

    def finish(self) -> None:
        if self.writeback:
            with torch.no_grad():
                self.orig.copy_(self.buf)

    @property
    def after(self) -> Callable[[], None] | None:
        """finish, where it has anything to do (an ordered collective skips the stream context it runs in)."""
        return self.finish if self.writeback else None


def _write_apart(out: _Staged, src: torch.Tensor) -> None:
    """NCCL lets reduce_scatter's output be this rank's slice of its input (in place); hetccl's schedules read the
    input while they write the output, so such an output is written through a copy (`finish()` puts it back)."""
    a, b = out.buf.data_ptr(), src.data_ptr()
    if out.buf.device == src.device and a < b + src.numel() * src.element_size() \
            and b < a + out.buf.numel() * out.buf.element_size():
        out.buf, out.writeback = torch.empty_like(out.buf), True


def _single(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise UnsupportedError(f"hetccl backend: {what} takes exactly one tensor per rank (got {len(tensors)}); "
                               "multi-device-per-process lists are not supported")
    return tensors[0]


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated into one new contiguous tensor, on their device (every rank of an island passes
    the same kind of memory to hetccl)."""
    if not ts:
        return torch.empty(0, device="cpu")
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _padded_part(mine: torch.Tensor, parts: Sequence[torch.Tensor], rank: int, what: str
                 ) -> tuple[torch.Tensor, int]:
    """Lists of uneven parts (dist.all_gather / reduce_scatter with tensors of different sizes, one per rank):
    every part travels padded to the largest, so the collective underneath stays even. Returns this rank's part
    `mine`, flat and padded, and the padded size."""
    for t in parts:
        if t.dtype != mine.dtype:
            raise UnsupportedError(f"hetccl backend: {what} needs one dtype ({mine.dtype}; got {t.dtype})")
    if parts[rank].numel() != mine.numel():
        raise UnsupportedError(f"hetccl backend: {what}: this rank's tensor has {mine.numel()} elements, but its "
                               f"entry (rank {rank}) in the list has {parts[rank].numel()}")
    most = max(t.numel() for t in parts)
    flat = mine.detach().reshape(-1)
    if flat.numel() == most:
        return flat, most
    padded = torch.zeros(most, dtype=mine.dtype, device=mine.device)
    padded[:flat.numel()].copy_(flat)
    return padded, most


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in obj (nested lists and tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o)


def _on_device(index: int) -> Any:
    """torch.cuda.device(index), or nothing where it is current already (the usual case: a context costs the
    caller's thread of an ordered collective some 5-20 us)."""
    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


def _cuda_devices(obj: Any) -> list[int]:
    """CUDA device indices of the tensors in obj (nested lists): a Future holding them must be told."""
    if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.device.index is not None:
        return [obj.device.index]
    return sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in _tensors(obj) if t.device.type == "cuda"})


def _future(result: Any) -> torch.futures.Future:
    """A Future for `result`; one that will hold CUDA tensors is created with their devices (else torch refuses
    to complete it), so that waiting on it orders the waiter's stream after the copy back."""
    devices = _cuda_devices(result)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _same_shapes(ts: Sequence[torch.Tensor], ref: torch.Tensor, what: str) -> None:
    for t in ts:
        if t.numel() != ref.numel() or t.dtype != ref.dtype:
            raise UnsupportedError(f"hetccl backend: {what} needs every tensor to have the input's size and dtype "
                                   f"({ref.numel()} x {ref.dtype}; got {t.numel()} x {t.dtype})")


def _value(fut: torch.futures.Future) -> Any:
    return fut.value()  # raises the operation's error


class _FutureWork(dist.Work):
    """A Work backed by a torch Future that the hetccl loop completes. Not torch's _create_work_from_future:
    its wait() returns True even when the future holds an error, so a failed collective (a timeout, a lost
    peer) looked like a success to dist.barrier(), dist.all_reduce() and everything else that waits."""

    def __init__(self, fut: torch.futures.Future, source: list[int] | None = None):
        super().__init__()
        self._fut, self._source = fut, source
        self._chained: torch.futures.Future | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._fut.wait()  # raises the operation's error
        return True

    def get_future(self) -> torch.futures.Future:
        """The future for C++ consumers too (DDP's reducer and its built-in hooks): Future.set_exception keeps
        the exception as the future's value, which only Python unwraps; C++ read it as tensors and crashed
        (SIGSEGV in parseCppCommHookResult when a peer died mid-backward). A Python callback that raises marks
        the future it returns with a real error, which C++ raises."""
        if self._chained is None:
            self._chained = self._fut.then(_value)
        return self._chained

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001 (returned, as c10d's Work.exception() does)
            return e
        return None

    def result(self) -> Any:
        return self._fut.value()

    def synchronize(self) -> None:
        self._fut.wait()

    def source_rank(self) -> int:
        """The sender of a receive from any source (torch reads it after wait(): dist.recv's return value)."""
        if self._source is None:
            raise UnsupportedError("hetccl backend: source_rank() is only defined for a receive from any source")
        if not self._source:
            raise UnsupportedError("hetccl backend: the sender of a receive from any source is known once the "
                                   "receive has completed; call wait() first")
        return self._source[0]

    _source_rank = source_rank


class _DoneWork(dist.Work):
    """The Work of a collective already done on the caller's thread: nothing to wait for, and its Future made
    only when asked for (DDP's hooks ask; dist.all_reduce does not). A Future per call cost the small host
    collectives a good part of their time."""

    def __init__(self, result: Any):
        super().__init__()
        self._result = result
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            self._fut = torch.futures.Future()
            self._fut.set_result(self._result)
        return self._fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        pass


def _device_stream(table: dict[int, torch.cuda.Stream], device: int) -> torch.cuda.Stream:
    """table's stream for `device`, made on first use."""
    s = table.get(device)
    if s is None:
        s = table[device] = torch.cuda.Stream(device)
    return s


# per device, the stream a Future of a collective not yet enqueued completes on: it waits for the collective's
# end word (the collective stream cannot: the collective is enqueued on it later)
_ENDS: dict[int, torch.cuda.Stream] = {}


class _EnqueuedWork(dist.Work):
    """A collective enqueued on the caller's stream inside one GPU island: done as far as the host is concerned.
    As ProcessGroupNCCL's (without blocking wait), wait() makes the waiter's current stream wait for it and
    blocks nothing, and raises the communicator's error if one is known. The Future is made only when asked
    for (DDP's hooks ask; dist.all_reduce does not). Also the Work of a collective ordered on the caller's stream
    across islands (`vc` is then the backend: its `broken` is the first error of such a collective)."""

    def __init__(self, result: Any, device: int, stream: int, event: Any, vc: Any,
                 end: tuple[Any, tuple[int, int]] | None = None):
        super().__init__()
        self._result, self._device, self._stream, self._event, self._vc = result, device, stream, event, vc
        # or, where the enqueuing thread has yet to enqueue the collective (torch/enqueuer.py): its end word
        # (streamorder.Words, word), which the collective stream stores after it
        self._end = end
        self._fut: torch.futures.Future | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._vc.broken is not None:
            raise self._vc.broken
        current = _raw_stream(self._device)
        if current != self._stream:
            if self._end is not None:
                self._end[0].hold(current, self._end[1])
            else:
                stream_waits(current, self._device, self._event)
        return True

    def get_future(self) -> torch.futures.Future:
        if self._fut is None:
            fut = torch.futures.Future(devices=[self._device])
            # completion events are recorded on the current stream: make it the one the collective ran on (the
            # usual case: DDP's hooks ask for the future where they issued the collective), or, where the
            # collective is not enqueued yet, a stream that waits for its end word
            if self._end is not None:
                ends = _device_stream(_ENDS, self._device)
                with torch.cuda.device(self._device), torch.cuda.stream(ends):
                    self._end[0].hold(ends.cuda_stream, self._end[1])
                    fut.set_result(self._result)
            elif _raw_stream(self._device) == self._stream:
                fut.set_result(self._result)
            else:
                with torch.cuda.device(self._device), torch.cuda.stream(torch_stream(self._stream, self._device)):
                    fut.set_result(self._result)
            self._fut = fut
        return self._fut

    def is_completed(self) -> bool:
        return self._end[0].reached(self._end[1]) if self._end is not None else self._event.query()

    def is_success(self) -> bool:
        return self._vc.broken is None

    def exception(self) -> BaseException | None:
        return self._vc.broken

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        self.wait()


class _Kinds:
    """Collectives ordered on the caller's stream and collectives whose device work hetccl's loop thread does
    are never in flight together: a loop thread in a CUDA call while a stream waits for the loop deadlocks
    under lazy module loading (gpu/streamorder.py). A call of one kind first waits, on the caller's thread and
    within the deadline, until none of the other kind is left."""

    def __init__(self) -> None:
        self._n = {"ordered": 0, "loop": 0}
        self._cv = threading.Condition()

    def enter(self, kind: str, timeout: float) -> None:
        other = "loop" if kind == "ordered" else "ordered"
        with self._cv:
            if not self._cv.wait_for(lambda: self._n[other] == 0, timeout):
                raise hetccl.CollectiveTimeout(f"hetccl backend: a collective waited past the deadline "
                                               f"(HETCCL_TIMEOUT) for the {other} collectives before it to end")
            self._n[kind] += 1

    def leave(self, kind: str) -> None:
        with self._cv:
            self._n[kind] -= 1
            self._cv.notify_all()


def _agree_stream_order(comm: hetccl.SyncCommunicator) -> bool:
    """Whether this group orders its cross-island CUDA collectives on the caller's stream: every rank must, or
    none (the ordered schedule's sub-collectives differ from the loop's), so each says whether it can and all
    take the answer of the least able. A rank without a GPU can: it runs the host schedule either way."""
    if _STREAM_ORDER is False or comm.async_comm.island_count == 1:
        return False
    why = streamorder.process_problem()
    able = np.zeros(comm.size, dtype=np.uint8)
    comm.all_gather(able, np.array([0 if why else 1], dtype=np.uint8))
    unable = [r for r in range(comm.size) if not able[r]]
    if not unable:
        return True
    says = f"rank {comm.rank}: {why}" if why else f"rank(s) {', '.join(map(str, unable))} cannot"
    if _STREAM_ORDER:
        raise ConfigError(f"HETCCL_TORCH_STREAM_ORDER=1, and {says}; fix that, or set HETCCL_TORCH_STREAM_ORDER=auto "
                          "(the thread then waits for cross-island collectives) on every rank")
    if why:  # the rank that holds the others back says why; they log the decision quietly
        log.warning("hetccl: cross-island collectives of CUDA tensors hold the caller's thread until they end: %s",
                    says)
    else:
        log.info("hetccl: cross-island collectives of CUDA tensors are not stream-ordered: %s", says)
    return False


class HetcclBackend(dist.ProcessGroup):
    """c10d process group whose collectives run on a hetccl communicator.

    torch 2.13 exposes no Python constructor for c10d's `Backend`, so this subclasses `ProcessGroup` (whose
    pybind trampoline forwards every virtual op to Python), the documented route for Python process groups.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta | None = None,
                 group_name: str = ""):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._group_name = group_name
        self._group_desc = ""
        self._comm: hetccl.SyncCommunicator | None = _bootstrap(store, rank, size, timeout)
        self._acomm = self._comm.async_comm
        # operations handed to the loop thread and not yet finished (each counter written by one thread): while
        # any is, device collectives go through the loop too, so that every rank enqueues them in issue order
        self._submitted = 0
        self._finished = 0
        self._lanes: dict[int, Any] = {}  # device index -> group.IslandLane (single GPU island)
        self._streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream ordered collectives run on
        self._early: dict[int, torch.cuda.Stream] = {}  # device index -> the stream of their copies out (_early_stream)
        # in flight, oldest first: storage [lo, hi) written, and whether the collective's end on the collective
        # stream is reached
        self._writes: collections.deque[tuple[int, int, Callable[[], bool]]] = collections.deque()
        self._early_copies = params.get("HETCCL_TORCH_EARLY_COPIES")
        # the first error of a collective ordered on the caller's stream: raised by every later call and wait()
        self.broken: BaseException | None = None
        self._kinds = _Kinds()
        try:
            self._ordered = _agree_stream_order(self._comm)
        except BaseException:
            self._comm.close()
            raise
        # the planning and device side of ordered collectives, off the caller's thread (torch/enqueuer.py)
        self._enqueuer = Enqueuer(f"hetccl-enqueue-{group_name or 'default'}") \
            if self._ordered and params.get("HETCCL_TORCH_ENQUEUE_THREAD") else None
        lifecycle.track_backend(self)  # detached at interpreter exit; its communicator is closed there

    # ---- plumbing ------------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND_NAME

    # c10d keeps a group's name and description in the per-device C++ backends; a Python ProcessGroup has
    # none, so `pg.group_name` (which DeviceMesh, FSDP2 and functional collectives read) would raise "ProcessGroup
    # name not set". The trampoline forwards these four virtuals to Python, so they live here.
    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = str(name)

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = str(desc)

    @property
    def comm(self) -> hetccl.SyncCommunicator:
        return self._comm

    # `init_process_group(device_id=...)`, `new_group` and DeviceMesh ask the group for its per-device backend
    # (`pg._get_backend(device)`) and read what it supports. A Python process group has no C++ backends, so the
    # group answers for every device itself: no communicator splitting (each group makes its own hetccl
    # communicator), no coalescing manager, no custom allocation.
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def _get_backend(self, device: Any) -> HetcclBackend:
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def eager_connect_single_device(self, device: Any) -> None:
        """Connections are made at init already."""

    def _now(self, name: str, args: list[Any], kwargs: dict[str, Any], result: Any) -> Any | None:
        """Inside one GPU island, enqueue the vendor collective from this thread on its current stream and return
        a completed Work whose wait() only orders the waiter's stream after it, as ProcessGroupNCCL does: no hop
        to hetccl's loop thread, no blocking. None where the operation must take the loop (first use of a
        device, several islands, loop operations still in flight)."""
        if args[0].device.type != "cuda" or self._submitted != self._finished or not _CUDA_DIRECT \
                or _raw_stream is None:
            return None
        event = self._acomm.enqueue_now(name, args, kwargs)
        if not event:
            return None
        dev = args[0].get_device()
        if dev not in self._lanes:
            self._lanes[dev] = self._acomm.lane(dev)
        return _EnqueuedWork(result, dev, _raw_stream(dev), event, self._lanes[dev].vc)

    def _collective(self, name: str, args: list[Any], kwargs: dict[str, Any], result: Any,
                    after: Callable[[], None] | None = None, bufs: Sequence[torch.Tensor] = ()) -> Any:
        """_launch of the communicator's collective `name`(*args, **kwargs), which is ordered on the caller's
        stream instead where it can be (_launch_ordered)."""
        return self._launch(lambda: getattr(self._acomm, name)(*args, **kwargs), result, after, bufs,
                            (name, args, kwargs))

    def _launch(self, coro_fn: Callable[[], Coroutine[Any, Any, Any]], result: Any,
                after: Callable[[], None] | None = None, bufs: Sequence[torch.Tensor] = (),
                ordered: tuple[str, list[Any], dict[str, Any]] | None = None) -> Any:
        """Schedule coro_fn() on the hetccl loop; the Work's future completes with `result` once it is done.
        `bufs`, the tensors hetccl itself reads and writes: all on the GPU, a collective across islands
        (`ordered`: its name and arguments) is ordered on the caller's stream instead and the call returns at
        once (_launch_ordered)."""
        if self.broken is not None:
            raise self.broken
        devices = _cuda_devices(result)
        # the caller's stream on the tensors' device: device collectives are enqueued on it (not on the loop
        # thread's own current stream), and copies back and the future's completion events are recorded on it
        stream = torch.cuda.current_stream(devices[0]) if devices else None
        if stream is not None and ordered is not None and bufs and self._ordered and _CUDA_DIRECT \
                and self._comm is not None and all(b.is_cuda for b in bufs):
            work = self._launch_ordered(ordered, result, after, stream, bufs)
            if work is not None:
                return work
        fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()

        async def body() -> None:
            if stream is not None:
                use_device(stream.device_index)  # the loop thread serves this rank's device, not GPU 0
                CALLER_STREAM.set(stream)  # this task's context only
            await coro_fn()

        def complete(cf: Any) -> None:
            try:
                exc = cf.exception()
                if exc is None and after is not None:
                    after()
            except BaseException as e:  # noqa: BLE001 (cancellation or copy-back failure goes to the future)
                exc = e
            if exc is not None:
                fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            else:
                fut.set_result(result)

        kind = "loop" if stream is not None and self._ordered else None  # device work on the loop (_Kinds)

        def done(cf: Any) -> None:
            self._finished += 1
            try:
                if stream is None:
                    complete(cf)
                else:
                    with torch.cuda.stream(stream):
                        complete(cf)
            finally:
                if kind is not None:
                    self._kinds.leave(kind)

        comm = self._comm
        if comm is None:
            raise self._shut_down()
        if kind is not None:
            self._kinds.enter(kind, self._acomm.settings.timeout)
        self._submitted += 1
        try:
            comm.submit(body()).add_done_callback(done)
        except BaseException:
            self._finished += 1
            if kind is not None:
                self._kinds.leave(kind)
            raise
        return _FutureWork(fut)

    def _shut_down(self) -> hetccl.HetcclError:
        return hetccl.HetcclError(f"hetccl backend: process group {self._group_name or 'default'} was shut down "
                                  "(destroy_process_group or interpreter exit); create a new one")

    def _collective_stream(self, device: int) -> torch.cuda.Stream:
        """The stream this group's ordered collectives run on, as ProcessGroupNCCL's: it waits for the caller's
        stream, and the caller's stream waits for it only at wait() (which a blocking call makes at once). On the
        caller's own stream, the kernels queued after a collective (DDP's backward after a bucket) would wait for
        its host step and its peers instead of overlapping them. (On one GPU time-sliced by two ranks, where that
        overlap cannot show, DDP's step measured about the same either way: 247 / 234 ms against 261 / 238 ms,
        H100, 2026-12-06.)"""
        return _device_stream(self._streams, device)

    def _early_stream(self, device: int, reads: Sequence[torch.Tensor]) -> torch.cuda.Stream | None:
        """The stream for this collective's copies out of the caller's data (streamorder.Stage.to_host): it
        waits for the caller's stream but not for the collective stream, so that a collective's copies out run
        while the ones before it wait for their host steps (DDP's next bucket, FSDP2's next layer), as the loop's
        separate copy streams let them. None (the collective stream, in order) where it reads memory that a
        collective still in flight writes: the collective stream alone orders those, as ProcessGroupNCCL's."""
        if not self._early_copies:
            return None
        writes = self._writes
        while writes and writes[0][2]():  # their ends are on one stream: they complete in order
            writes.popleft()
        if len(writes) > _EARLY_TRACKED:
            return None
        for t in reads:
            lo = t.data_ptr()
            hi = lo + t.numel() * t.element_size()
            if any(lo < w_hi and w_lo < hi for w_lo, w_hi, _ in self._writes):
                return None
        return _device_stream(self._early, device)

    def _launch_ordered(self, ordered: tuple[str, list[Any], dict[str, Any]], result: Any,
                        after: Callable[[], None] | None, caller: Any, bufs: list[torch.Tensor]) -> Any | None:
        """The collective across islands ordered after the caller's stream (gpu/streamorder.py): this thread
        enqueues its device side and the copies back (`after`) on the group's collective stream, hetccl's loop
        runs its host side, and the call returns at once with a Work that is done as far as the host is
        concerned (as ProcessGroupNCCL's). An error of the host side lets the stream go and is raised by this
        group's next call or wait(). None where the loop must do it all."""
        name, args, kwargs = ordered
        stream = self._collective_stream(caller.device_index)
        timeout = self._acomm.settings.timeout
        setup = self._acomm.ordered_setup(stream.device_index)
        if setup is not None:  # once per device: made by the loop, which makes CUDA calls, so nothing ordered waits
            self._kinds.enter("loop", timeout)
            try:
                self._comm.submit(setup).result(timeout + 5.0)
            finally:
                self._kinds.leave("loop")
        self._kinds.enter("ordered", timeout)
        if self._enqueuer is not None:
            try:
                work = self._launch_later(ordered, result, after, caller, stream, bufs)
            except BaseException:
                self._kinds.leave("ordered")
                raise
            if work is None:
                self._kinds.leave("ordered")
            return work
        try:
            with _on_device(stream.device_index):
                # before planning (the plan may enqueue island steps at once); by driver calls where it can, some
                # 15 us each less than torch's Stream.wait_stream
                caller_done = record_event(caller.cuda_stream, stream.device_index)
                stream_waits(stream.cuda_stream, stream.device_index, caller_done)
                early = self._early_stream(stream.device_index, bufs)
                if early is not None:
                    stream_waits(early.cuda_stream, stream.device_index, caller_done)
                planned = self._acomm.enqueue_ordered(name, args, kwargs, stream, early)
        except BaseException:
            self._kinds.leave("ordered")
            raise
        if planned is None:
            self._kinds.leave("ordered")
            return None
        # made before the loop thread is woken: Work's constructor lets the GIL go, and the loop would take it
        work = _EnqueuedWork(result, stream.device_index, stream.cuda_stream, None, self)  # its end event below

        def give_up() -> None:  # the host side will never run: let the stream go
            self._kinds.leave("ordered")
            planned.host_side.close()
            planned.abandon()

        def submit() -> Any:
            self._submitted += 1
            try:
                cf = self._comm.submit(planned.host_side)
            except BaseException:
                self._finished += 1
                give_up()
                raise
            cf.add_done_callback(self._ordered_done)
            return cf

        cf = submit() if planned.host_first else None
        try:
            with _on_device(stream.device_index):
                planned.device_side()
        except BaseException as exc:
            self._break(exc)
            if cf is None:
                give_up()
            else:
                cf.cancel()
                planned.abandon()
            raise
        try:
            if after is not None:
                with torch.cuda.stream(stream):
                    after()
            end = work._event = record_event(stream.cuda_stream, stream.device_index)  # wait() on another stream
            # also waits for the copies back
            self._tensors_in_use(stream, [bufs, result], end.query)
        finally:
            if cf is None:  # the device side is enqueued: the peers and the stream need the host side
                submit()
        if blocking():  # HETCCL_GPU_BLOCKING=1 (on this rank alone, say): the same schedule, then wait for its end
            stream.synchronize()  # its end is the stream's last work
            if self.broken is not None:
                raise self.broken
        return work

    def _tensors_in_use(self, stream: torch.cuda.Stream, tensors: Any, ended: Callable[[], bool]) -> None:
        """An ordered collective on `stream` uses `tensors` (made on the caller's stream: not reused before
        this one is done) until `ended()`; _early_stream keeps their storage off the early copies till then."""
        for t in {id(t): t for t in _tensors(tensors)}.values():
            t.record_stream(stream)
            if self._early_copies:
                storage = t.untyped_storage()
                self._writes.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes(), ended))

    def _ordered_done(self, cf: Any) -> None:
        """An ordered collective's host side has ended (on the loop thread: no CUDA call here,
        gpu/streamorder.py says why); its error, if any, becomes the group's."""
        self._finished += 1
        self._kinds.leave("ordered")
        try:
            exc = cf.exception()
        except BaseException as e:  # noqa: BLE001 (cancelled)
            exc = e
        if exc is not None:
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        """Keep the first error of an ordered collective: every later call and wait() raises it. Said at once
        too: a stream already waiting for the collective goes on (it must not wait forever) and reads a result
        that is not one, before any call of this rank can raise."""
        if self.broken is None:
            self.broken = exc if isinstance(exc, Exception) else hetccl.HetcclError(repr(exc))
            log.error("hetccl: a collective ordered on the caller's stream failed; its result is not to be used, "
                      "and this process group's next call or wait() raises: %s", exc)

    def _launch_later(self, ordered: tuple[str, list[Any], dict[str, Any]], result: Any,
                      after: Callable[[], None] | None, caller: Any, stream: torch.cuda.Stream,
                      bufs: list[torch.Tensor]) -> Any | None:
        """_launch_ordered with its planning and device side on the enqueuing thread (torch/enqueuer.py): this
        thread checks the call, records where the caller's stream stands, submits the host side (it takes the
        communicator's turn in this call's order) and hands the rest over. The Work's end is a word that the
        collective stream stores after the collective: wait() makes the waiter's stream wait for it."""
        name, args, kwargs = ordered
        dev = stream.device_index
        deferred = self._acomm.defer_ordered(name, args, kwargs, self._enqueuer.where)
        if deferred is None:
            return None
        words = streamorder.words_for(dev)  # the plan above has it (or raised)
        end = words.take(1)[0]
        with _on_device(dev):
            caller_done = record_event(caller.cuda_stream, dev)
        work = _EnqueuedWork(result, dev, stream.cuda_stream, None, self, (words, end))

        def done(cf: Any) -> None:  # a failed host side lets the waiters' streams go, whatever the thread did
            self._ordered_done(cf)
            if cf.cancelled() or cf.exception() is not None:
                words.store(end)

        self._submitted += 1
        try:
            cf = self._comm.submit(deferred.host_side())
        except BaseException:
            self._finished += 1
            raise
        cf.add_done_callback(done)

        def job() -> None:
            self._enqueue_later(deferred, cf, caller_done, stream, bufs, result, after, words, end)
        try:
            self._enqueuer.put(job)
        except BaseException:
            cf.cancel()  # its host side gives up waiting for the plan
            words.store(end)
            raise
        if blocking():  # HETCCL_GPU_BLOCKING=1: the same schedule, then wait for its end
            streamorder.wait_host(words, end, time.monotonic() + self._acomm.settings.timeout, f"cross-island {name}")
            if self.broken is not None:
                raise self.broken
        return work

    def _enqueue_later(self, deferred: Any, cf: Any, caller_done: Any, stream: torch.cuda.Stream,
                       bufs: list[torch.Tensor], result: Any, after: Callable[[], None] | None, words: Any,
                       end: tuple[int, int]) -> None:
        """On the enqueuing thread, in call order: the collective stream (and the early one) wait for the
        caller's, then the plan, the device side, the copies back and the end word. On failure the collective's
        result is not to be used: `broken` says so at the next call or wait(), and the streams are let go."""
        dev = stream.device_index
        planned = None
        try:
            use_device(dev)
            stream_waits(stream.cuda_stream, dev, caller_done)
            early = self._early_stream(dev, bufs)
            if early is not None:
                stream_waits(early.cuda_stream, dev, caller_done)
            # this thread's own current stream is the legacy default one, which the caller's wait() may hold on
            # this very collective's end word: nothing of the plan may go there
            with on_stream(stream):
                planned = deferred.plan(stream, early)
                planned.device_side()
                if after is not None:
                    after()
            words.signal(stream.cuda_stream, end)  # wait() on another stream also waits for the copies back
            self._tensors_in_use(stream, [bufs, result], lambda: words.reached(end))
        except BaseException as exc:  # noqa: BLE001 (raised by this group's next call or wait())
            self._break(exc)
            cf.cancel()
            if planned is not None:
                planned.abandon()
            words.store(end)  # the caller's stream must not wait forever

    # ---- collectives ---------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        if len(tensors) == 1 and self._lanes and self._submitted == self._finished:
            work = self._lane_all_reduce(tensors, opts)
            if work is not None:
                return work
        op, factor = _reduce_op(opts)
        if len(tensors) == 1 and factor is None and tensors[0].device.type == "cpu":
            work = self._host_now(tensors[0], op)
            if work is not None:
                return work
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        if tensors[0].layout == torch.sparse_coo:
            return self._sparse_allreduce(tensors[0], op, factor)
        st = _Staged(tensors[0])
        _premul(st.buf, factor, inplace=True)
        if not st.writeback:
            work = self._now("all_reduce", [st.buf], {"op": op}, list(tensors))
            if work is not None:
                return work
        return self._collective("all_reduce", [st.buf, op], {}, list(tensors), st.after, [st.buf])

    def _lane_all_reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any | None:
        """The hot path of dist.all_reduce inside one GPU island: checks, one enqueue, no Future. None where
        the general path must decide (another op, a non-contiguous or sparse tensor, another current device)."""
        t = tensors[0]
        if not t.is_cuda:
            return None
        dev = t.get_device()
        lane = self._lanes.get(dev)
        op = hetccl.ReduceOp.SUM if opts is None else _LANE_OPS.get(getattr(opts.reduceOp, "op", opts.reduceOp))
        if lane is None or op is None or not t.is_contiguous() or t.is_sparse or _raw_stream is None \
                or torch.cuda.current_device() != dev:
            return None
        stream = _raw_stream(dev)
        event = lane.all_reduce(t.data_ptr(), t.numel(), parse_dtype(t.dtype), op, stream)
        return _EnqueuedWork(tensors, dev, stream, event, lane.vc)

    def _host_now(self, t: torch.Tensor, op: str) -> Any | None:
        """A small all_reduce of a CPU tensor on the caller's thread (SyncCommunicator.all_reduce's rule: the
        shared-memory fast path, nothing of this group in flight): no hop to the loop thread and back, which
        costs more than the operation. None where the loop path must run it."""
        if t.is_sparse or not t.is_contiguous() or t.dtype not in _HOST_NOW_DTYPES:
            return None
        comm = self._idle_comm()
        if comm is None:
            return None
        return self._host_done(self._acomm.fast_all_reduce(t.detach().numpy(), op, comm.loop), [t])

    def _host_call(self, name: str, args: list[Any], kwargs: dict[str, Any], result: Any) -> Any | None:
        """A small broadcast, all_gather, reduce_scatter or barrier of CPU tensors on the caller's thread
        (Communicator.fast_call), by _host_now's rule. None where the loop path must run it."""
        if any(t.device.type != "cpu" for t in args):
            return None
        comm = self._idle_comm()
        if comm is None:
            return None
        return self._host_done(self._acomm.fast_call(name, tuple(args), kwargs, comm.loop), result)

    def _idle_comm(self) -> hetccl.SyncCommunicator | None:
        """The communicator, where a collective may run on the caller's thread: open, not broken, and nothing
        of this group in flight."""
        comm = self._comm
        if comm is None or self.broken is not None or self._submitted != self._finished or not comm.idle():
            return None
        return comm

    def _host_done(self, done: Any, result: Any) -> Any | None:
        """The Work of a caller-thread collective: None (not taken), done, or ended by the loop (the peers were
        not all there within the spin)."""
        if done is False:
            return None
        if done is not True:
            return self._launch(lambda: done, result)
        return _DoneWork(result)

    def _sparse_allreduce(self, t: torch.Tensor, op: str, factor: float | None) -> Any:
        """Sparse COO all_reduce, SUM only (as Gloo): every rank's coalesced indices and values are gathered and
        summed; the result replaces t. The nnz exchange is a blocking call made here, in program order; the data
        then moves in one all_gather (indices and values packed per rank), so this op issues the same
        collectives in the same order on every rank even with other async ops in flight."""
        if op != "sum" or factor is not None:
            raise UnsupportedError(f"hetccl backend: sparse all_reduce supports SUM only (got {op.upper()})")
        if t.device.type != "cpu":
            raise UnsupportedError("hetccl backend: sparse all_reduce takes CPU tensors")
        comm = self._comm
        if comm is None:
            return self._launch(lambda: self._acomm.barrier(), [t])  # raises the shut-down error
        c = t.detach().coalesce()
        idx, val = c.indices().to(torch.int64), c.values().contiguous()
        n, nnz, sdim, dense = self._size, idx.shape[1], idx.shape[0], tuple(val.shape[1:])
        counts = torch.zeros(n, dtype=torch.int64)
        comm.all_gather(counts, torch.tensor([nnz], dtype=torch.int64))
        most = int(counts.max())
        pidx = torch.zeros(sdim, most, dtype=torch.int64)
        pidx[:, :nnz] = idx
        pval = torch.zeros((most, *dense), dtype=val.dtype)
        pval[:nnz] = val
        ib, vb = pidx.numel() * 8, pval.numel() * pval.element_size()
        per = ib + vb + (-vb) % 8  # every rank's block starts 8-byte aligned (int64 views)
        mine = torch.zeros(per, dtype=torch.uint8)
        mine[:ib] = pidx.reshape(-1).view(torch.uint8)
        mine[ib:ib + vb] = pval.reshape(-1).view(torch.uint8)
        every = torch.empty(n * per, dtype=torch.uint8)

        def after() -> None:
            idxs, vals = [], []
            for r in range(n):
                block, k = every[r * per:(r + 1) * per], int(counts[r])
                idxs.append(block[:ib].view(torch.int64).reshape(sdim, most)[:, :k])
                vals.append(block[ib:ib + vb].view(val.dtype).reshape(most, *dense)[:k])
            total = torch.sparse_coo_tensor(torch.cat(idxs, 1), torch.cat(vals), c.shape).coalesce()
            with torch.no_grad():
                t.copy_(total)

        return self._launch(lambda: self._acomm.all_gather(every, mine), [t], after)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op, factor = _reduce_op(opts)
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise UnsupportedError("hetccl backend: allreduce_coalesced needs one dtype "
                                   f"(got {sorted(map(str, dtypes))})")
        flat = _premul(_flat(tensors), factor, inplace=True)

        def after() -> None:
            off = 0
            with torch.no_grad():
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[off:off + n].view_as(t))
                    off += n

        return self._collective("all_reduce", [flat, op], {}, list(tensors), after, [flat])

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        outs = _single(output_tensors, "allgather")
        inp = _Staged(_single(input_tensors, "allgather"), writeback=False)
        if len(outs) != self._size:
            raise UnsupportedError(f"hetccl backend: allgather needs {self._size} output tensors (got {len(outs)})")
        src, most = _padded_part(inp.buf, outs, self._rank, "allgather")
        flat = torch.empty(self._size * most, dtype=src.dtype, device=src.device)

        def after() -> None:
            with torch.no_grad():
                for r, o in enumerate(outs):
                    o.copy_(flat[r * most:r * most + o.numel()].view_as(o))

        return self._collective("all_gather", [flat, src], {}, output_tensors, after, [flat, src])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        out, inp = _Staged(output), _Staged(input, writeback=False)
        if out.buf.numel() != self._size * inp.buf.numel():
            raise UnsupportedError(f"hetccl backend: all_gather_into_tensor output has {out.buf.numel()} elements, "
                                   f"needs world_size * input = {self._size * inp.buf.numel()}")
        if not out.writeback:
            args = [out.buf.reshape(-1), inp.buf.reshape(-1)]
            work = self._now("all_gather", args, {}, [output])
            if work is None:
                work = self._host_call("all_gather", args, {}, [output])
            if work is not None:
                return work
        return self._collective("all_gather", [out.buf.reshape(-1), inp.buf.reshape(-1)], {}, [output], out.after,
                                [out.buf, inp.buf])

    all_gather_single = _allgather_base  # torch 2.13's name (older torch calls _allgather_base)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._chain(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # torch 2.13's name

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        """dist.all_gather_coalesced: output_lists[r][i] receives rank r's inputs[i] (torch's documented layout),
        through one flat all_gather of every rank's inputs laid end to end."""
        if len(output_lists) != self._size:
            raise UnsupportedError(f"hetccl backend: all_gather_coalesced needs one output list per rank "
                                   f"(world_size={self._size}; got {len(output_lists)} lists)")
        if len({t.dtype for t in inputs}) > 1:
            raise UnsupportedError("hetccl backend: all_gather_coalesced needs one dtype for all inputs")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(inputs):
                raise UnsupportedError(f"hetccl backend: all_gather_coalesced output list {r} has {len(outs)} "
                                       f"tensors; it needs one per input ({len(inputs)})")
            for i, (o, inp) in enumerate(zip(outs, inputs, strict=True)):
                _same_shapes([o], inp, f"all_gather_coalesced (output [{r}][{i}])")
        flat_in = _flat(inputs)
        n = flat_in.numel()
        flat = torch.empty(self._size * n, dtype=flat_in.dtype, device=flat_in.device)

        def after() -> None:
            with torch.no_grad():
                for r, outs in enumerate(output_lists):
                    off = r * n
                    for o in outs:
                        k = o.numel()
                        o.copy_(flat[off:off + k].view_as(o))
                        off += k

        return self._collective("all_gather", [flat, flat_in], {}, output_lists, after, [flat, flat_in])

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        op, factor = _reduce_op(opts)
        out = _Staged(_single(output_tensors, "reduce_scatter"))
        ins = _single(input_tensors, "reduce_scatter")
        if len(ins) != self._size:
            raise UnsupportedError(f"hetccl backend: reduce_scatter needs {self._size} input tensors (got {len(ins)})")
        if any(t.numel() != ins[0].numel() for t in ins):  # uneven parts: each padded to the largest
            _, most = _padded_part(out.buf, ins, self._rank, "reduce_scatter")
            flat = torch.zeros(self._size * most, dtype=out.buf.dtype, device=out.buf.device)
            for r, t in enumerate(ins):
                flat[r * most:r * most + t.numel()].copy_(t.detach().reshape(-1))
            part = torch.empty(most, dtype=out.buf.dtype, device=out.buf.device)
            dst = out.orig

            def after() -> None:
                with torch.no_grad():
                    dst.copy_(part[:dst.numel()].view_as(dst))
        else:
            _same_shapes(ins, out.buf, "reduce_scatter")
            flat, part, after = _flat(ins), out.buf.reshape(-1), out.finish
        _premul(flat, factor, inplace=True)
        return self._collective("reduce_scatter", [part, flat, op], {}, output_tensors, after, [part, flat])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op, factor = _reduce_op(opts)
        out, inp = _Staged(output), _Staged(input, writeback=False)
        if inp.buf.numel() != self._size * out.buf.numel():
            raise UnsupportedError(f"hetccl backend: reduce_scatter_tensor input has {inp.buf.numel()} elements, "
                                   f"needs world_size * output = {self._size * out.buf.numel()}")
        src = _premul(inp.buf, factor, inplace=False).reshape(-1)
        _write_apart(out, src)
        if not out.writeback:
            args = [out.buf.reshape(-1), src]
            work = self._now("reduce_scatter", args, {"op": op}, [output])
            if work is None:
                work = self._host_call("reduce_scatter", args, {"op": op}, [output])
            if work is not None:
                return work
        return self._collective("reduce_scatter", [out.buf.reshape(-1), src, op], {}, [output], out.after,
                                [out.buf, src])

    reduce_scatter_single = _reduce_scatter_base  # torch 2.13's name (older torch calls _reduce_scatter_base)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._chain(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # torch 2.13's name

    def _chain(self, works: list[Any], result: Any) -> Any:
        fut = _future(result)
        futs = [w.get_future() for w in works]
        if not futs:
            fut.set_result(result)
            return _FutureWork(fut)

        def done(_: Any) -> None:
            for f in futs:
                try:
                    f.wait()
                except Exception as e:  # noqa: BLE001
                    fut.set_exception(e)
                    return
            fut.set_result(result)

        torch.futures.collect_all(futs).add_done_callback(done)
        return _FutureWork(fut)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        st = _Staged(_single(tensors, "broadcast"))
        root = int(opts.rootRank)
        if not st.writeback:
            work = self._now("broadcast", [st.buf], {"root": root}, list(tensors))
            if work is None:
                work = self._host_call("broadcast", [st.buf], {"root": root}, list(tensors))
            if work is not None:
                return work
        return self._collective("broadcast", [st.buf, root], {}, list(tensors), st.after, [st.buf])

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        op, factor = _reduce_op(opts)
        st = _Staged(_single(tensors, "reduce"))
        root = int(opts.rootRank)
        if factor is not None:  # the root's tensor receives the result; the others' stay as they were
            st.buf = _premul(st.buf.clone(), factor, inplace=True)
            st.writeback = self._rank == root
        return self._launch(lambda: self._acomm.reduce(st.buf, root, op), list(tensors), st.finish, [st.buf])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        uneven = bool(output_split_sizes or input_split_sizes)  # point-to-point exchanges: host memory
        out, inp = _Staged(output, host=uneven), _Staged(input, writeback=False, host=uneven)
        if out.buf.numel() != inp.buf.numel() or inp.buf.numel() % self._size:
            if not output_split_sizes and not input_split_sizes:
                raise UnsupportedError("hetccl backend: all_to_all_single without split sizes needs input and "
                                       f"output of equal size divisible by world_size={self._size}")
        if not output_split_sizes and not input_split_sizes:
            return self._launch(lambda: self._acomm.all_to_all(out.buf.reshape(-1), inp.buf.reshape(-1)),
                                [output], out.finish, [out.buf, inp.buf])
        return self._alltoallv(out, inp, list(output_split_sizes), list(input_split_sizes), [output])

    all_to_all_single = alltoall_base  # torch 2.13's name (older torch calls alltoall_base)

    def _alltoallv(self, out: _Staged, inp: _Staged, osplits: list[int], isplits: list[int], result: Any) -> Any:
        """Uneven all_to_all_single: rows along dim 0, exchanged with point-to-point sends and receives."""
        n = self._size
        irows, orows = inp.buf.shape[0] if inp.buf.dim() else 1, out.buf.shape[0] if out.buf.dim() else 1
        isplits = isplits or [irows // n] * n
        osplits = osplits or [orows // n] * n
        if len(isplits) != n or len(osplits) != n or sum(isplits) != irows or sum(osplits) != orows:
            raise UnsupportedError(f"hetccl backend: all_to_all_single split sizes {isplits} / {osplits} do not "
                                   f"match world_size={n} and the tensors' first dimensions ({irows} / {orows})")
        irow = inp.buf[0].numel() if inp.buf.dim() else 1
        orow = out.buf[0].numel() if out.buf.dim() else 1
        src, dst = inp.buf.reshape(-1), out.buf.reshape(-1)
        ioff = [sum(isplits[:p]) * irow for p in range(n)]
        ooff = [sum(osplits[:p]) * orow for p in range(n)]
        me = self._rank
        acomm = self._acomm

        async def run() -> None:
            import asyncio

            dst[ooff[me]:ooff[me] + osplits[me] * orow].copy_(src[ioff[me]:ioff[me] + isplits[me] * irow])
            jobs = []
            for p in range(n):
                if p == me:
                    continue
                if isplits[p]:
                    jobs.append(acomm.send(src[ioff[p]:ioff[p] + isplits[p] * irow], p))
                if osplits[p]:
                    jobs.append(acomm.recv(dst[ooff[p]:ooff[p] + osplits[p] * orow], p))
            await asyncio.gather(*jobs)

        return self._launch(run, result, out.finish)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        n = self._size
        if len(output_tensors) != n or len(input_tensors) != n:
            raise UnsupportedError(f"hetccl backend: all_to_all needs {n} input and output tensors")
        flat_in = _flat(input_tensors)
        dtype = flat_in.dtype
        if any(t.dtype != dtype for t in output_tensors):
            raise UnsupportedError("hetccl backend: all_to_all needs one dtype for all tensors")
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype, device="cpu")
        out_st = _Staged(flat_out, writeback=False)
        isz, osz = [t.numel() for t in input_tensors], [t.numel() for t in output_tensors]

        def after() -> None:
            off = 0
            with torch.no_grad():
                for t in output_tensors:
                    t.copy_(flat_out[off:off + t.numel()].view_as(t))
                    off += t.numel()

        if len(set(isz)) == 1 and isz == osz:
            return self._launch(lambda: self._acomm.all_to_all(flat_out, flat_in), output_tensors, after)
        work_result = output_tensors
        w = self._alltoallv(out_st, _Staged(flat_in, writeback=False, host=True), osz, isz, work_result)
        return self._chain_after(w, after, work_result)

    def _chain_after(self, work: Any, after: Callable[[], None], result: Any) -> Any:
        fut = _future(result)

        def done(f: Any) -> None:
            try:
                f.wait()
                after()
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)
                return
            fut.set_result(result)

        work.get_future().add_done_callback(done)
        return _FutureWork(fut)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> Any:
        root = int(opts.rootRank)
        inp = _Staged(_single(input_tensors, "gather"), writeback=False)
        n = inp.buf.numel()
        if self._rank == root:
            outs = _single(output_tensors, "gather")
            if len(outs) != self._size:
                raise UnsupportedError(f"hetccl backend: gather needs {self._size} output tensors on the root")
            _same_shapes(outs, inp.buf, "gather")
            flat = torch.empty(self._size * n, dtype=inp.buf.dtype, device="cpu")

            def after() -> None:
                with torch.no_grad():
                    for r, o in enumerate(outs):
                        o.copy_(flat[r * n:(r + 1) * n].view_as(o))

            return self._launch(lambda: self._acomm.gather(flat, inp.buf.reshape(-1), root), output_tensors, after)
        return self._launch(lambda: self._acomm.gather(None, inp.buf.reshape(-1), root), output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> Any:
        root = int(opts.rootRank)
        out = _Staged(_single(output_tensors, "scatter"))
        flat = None
        if self._rank == root:
            ins = _single(input_tensors, "scatter")
            if len(ins) != self._size:
                raise UnsupportedError(f"hetccl backend: scatter needs {self._size} input tensors on the root")
            _same_shapes(ins, out.buf, "scatter")
            flat = _flat(ins)
        return self._launch(lambda: self._acomm.scatter(out.buf.reshape(-1), flat, root), output_tensors,
                            out.finish)

    # ---- point to point and barrier ------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        st = _Staged(_single(tensors, "send"), writeback=False, host=True)
        return self._launch(lambda: self._acomm.send(st.buf, int(dst), int(tag)), list(tensors))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        st = _Staged(_single(tensors, "recv"), host=True)
        return self._launch(lambda: self._acomm.recv(st.buf, int(src), int(tag)), list(tensors), st.finish)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        """dist.recv/irecv without a source: the first message of this tag from any rank; the Work's
        _source_rank() is the sender (group rank)."""
        st = _Staged(_single(tensors, "recv"), host=True)
        source: list[int] = []

        async def run() -> None:
            source.append(await self._acomm.recv(st.buf, None, int(tag)))

        work = self._launch(run, list(tensors), st.finish)
        return _FutureWork(work.get_future(), source)

    def barrier(self, opts: Any = None) -> Any:
        work = self._host_call("barrier", [], {}, [])
        return work if work is not None else self._launch(lambda: self._acomm.barrier(), [])

    def _detach(self) -> hetccl.SyncCommunicator | None:
        """Take the communicator away (later calls fail; shutdown becomes a no-op) and return it; the enqueuing
        thread runs out its queue first (briefly: no CUDA call of it may outlive the interpreter)."""
        enqueuer = getattr(self, "_enqueuer", None)
        if enqueuer is not None:
            enqueuer.close(_ENQUEUER_JOIN_S)
        comm, self._comm = getattr(self, "_comm", None), None
        return comm

    def shutdown(self) -> None:
        """destroy_process_group: the collectives this group has handed to the loop end first (within the
        timeout), as ncclCommDestroy lets queued work finish; then the communicator closes. Closed under them, a
        CPU one's completion met a closed group (a SIGSEGV at 3 ranks, 2026-12-06), and an ordered one whose host
        side had not started would leave its peers waiting for it (likely the "closed after all_reduce #167"
        CollectiveMismatchError of the balancer's GPU memory test, H100, the same day)."""
        if getattr(self, "_comm", None) is not None and self.broken is None:
            deadline = time.monotonic() + self._acomm.settings.timeout
            while self._submitted != self._finished and time.monotonic() < deadline:
                time.sleep(0.0005)
            if self._submitted != self._finished:  # they fail on the closed group: say why they did
                log.warning("hetccl: destroy_process_group closes the group with %d of its collectives unfinished "
                            "after the timeout (%.0f s)", self._submitted - self._finished,
                            self._acomm.settings.timeout)
        comm = self._detach()  # the enqueuing thread's jobs ran before their host sides could end: it is idle
        if comm is not None:
            try:
                comm.close()
            except Exception:  # noqa: BLE001 (peers may already be gone at exit)
                pass


def _create(dist_opts: Any, backend_options: Any) -> HetcclBackend:
    return HetcclBackend(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                         str(getattr(dist_opts, "group_id", "") or ""))


def register() -> None:
    """Register "hetccl" with torch.distributed (idempotent)."""
    plugins = getattr(dist.Backend, "_plugins", {})
    if BACKEND_NAME.upper() in plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
