"""Device-side helpers on top of PyTorch's CUDA/HIP runtime: streams, events, pinned staging buffers and
element-wise reductions on the device. CuPy arrays and __cuda_array_interface__ buffers are viewed as torch
tensors without a copy (DLPack / the interface), so one code path serves them all."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from ..dtypes import DType, ReduceOp
from ..errors import CollectiveTimeout, ConfigError
from .buffers import DeviceBuf, current_stream_handle

_TORCH_DTYPES: dict[DType, Any] = {}


def torch_mod() -> Any:
    try:
        import torch
    except ImportError:
        raise ConfigError("device buffers need PyTorch for hetccl's staging and reductions "
                          "(pip install torch); CuPy-only set-ups are not supported yet") from None
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({DType.INT8: torch.int8, DType.UINT8: torch.uint8, DType.INT32: torch.int32,
                              DType.INT64: torch.int64, DType.FLOAT16: torch.float16,
                              DType.BFLOAT16: torch.bfloat16, DType.FLOAT32: torch.float32,
                              DType.FLOAT64: torch.float64})
    return torch


def as_tensor(buf: DeviceBuf) -> Any:
    """A flat torch tensor sharing the device buffer's memory."""
    torch = torch_mod()
    obj = buf.obj
    if buf.framework == "torch":
        flat = obj.reshape(-1)
    elif buf.framework == "cupy":
        flat = torch.from_dlpack(obj).reshape(-1)
    else:
        flat = torch.as_tensor(obj, device="cuda").reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:  # 0/1-element views may carry stride 0
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat


def torch_dtype(dt: DType) -> Any:
    torch_mod()
    return _TORCH_DTYPES[dt]


# The stream a collective is ordered on when the call comes from another thread (the torch backend submits
# to hetccl's loop thread, whose current stream is not the caller's): set per asyncio task
CALLER_STREAM: contextvars.ContextVar[Any] = contextvars.ContextVar("hetccl_caller_stream", default=None)


def stream_handle(buf: DeviceBuf) -> int:
    """stream_of(buf) as a raw handle, for calls that only enqueue (vendor collectives)."""
    if buf.framework == "torch":
        caller = CALLER_STREAM.get()
        if caller is not None and caller.device_index == buf.device:
            return caller.cuda_stream
        return buf.stream  # as_device_buf took the current stream a moment ago
    if buf.stream:
        return buf.stream
    return current_stream_handle(torch_mod().cuda.current_device())


_DRIVER: dict[str, Any] = {}


def _driver(vendor: str) -> Any:
    if vendor not in _DRIVER:
        from ..bindings.streamops import Unavailable, load_driver

        try:
            _DRIVER[vendor] = load_driver(vendor)
        except Unavailable:
            _DRIVER[vendor] = None
    return _DRIVER[vendor]


_EVENTS: dict[int, list[int]] = {}  # driver events of each device, free for reuse


def record_event(stream: Any, device: int) -> Any:
    """An event recorded on `stream` (a raw handle or a torch stream of `device`), with query(): a driver
    event (about 2 us to make and record) where the driver loads and `device` is current, else a torch
    Event (5-10 us)."""
    torch = torch_mod()
    ops = _driver("hip" if getattr(torch.version, "hip", None) else "cuda")
    handle = stream if isinstance(stream, int) else stream.cuda_stream
    if ops is not None and torch.cuda.current_device() == device:  # driver events belong to the current context
        from ..bindings.streamops import RawEvent

        pool = _EVENTS.setdefault(device, [])
        ev = RawEvent(ops, pool.pop() if pool else ops.event(), owned=True, pool=pool)
        ops.record(ev.handle, handle)
        return ev
    if isinstance(stream, int):
        stream = torch_stream(stream, device)
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


class on_stream:  # noqa: N801 (used as torch.cuda.stream is)
    """Inside, torch's current stream is `stream` (a torch Stream of the current device): what
    torch.cuda.stream() does without its device checks, which cost the caller's thread of an ordered collective
    15-25 us a context on an H100 shared by two ranks (2026-12-07)."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: Any):
        self.stream = stream

    def __enter__(self) -> None:
        cuda = torch_mod().cuda
        self.prev = cuda.current_stream(self.stream.device_index)
        cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch_mod().cuda.set_stream(self.prev)


def stream_waits(handle: int, device: int, event: Any) -> None:
    """The raw stream `handle` of `device` waits for `event` (record_event's: a driver event, or a torch Event)."""
    if hasattr(event, "ops"):
        event.ops.wait_event(handle, event.handle)
    else:
        torch_stream(handle, device).wait_event(event)


def torch_stream(handle: int, device: int) -> Any:
    """The torch Stream of a raw stream handle on `device`. Handle 0 is the legacy default stream, which torch
    calls the device's default stream: torch.cuda.ExternalStream(0) would hand back a fresh pool stream instead,
    and whatever is recorded or waited on it would not be ordered with the work on stream 0."""
    torch = torch_mod()
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


def stream_of(buf: DeviceBuf) -> Any:
    torch = torch_mod()
    if buf.framework == "torch":
        caller = CALLER_STREAM.get()
        if caller is not None and caller.device_index == buf.device:
            return caller
        return torch.cuda.current_stream(buf.device)
    if buf.stream:
        return torch_stream(buf.stream, buf.device if buf.device >= 0 else torch.cuda.current_device())
    return torch.cuda.current_stream()


def reduce_inplace(dst: Any, src: Any, op: ReduceOp) -> None:
    """dst = dst OP src on the device (current stream). fp16/bf16 kernels compute each element in fp32."""
    torch = torch_mod()
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        dst.add_(src)
    elif op == ReduceOp.PROD:
        dst.mul_(src)
    elif op == ReduceOp.MIN:
        torch.minimum(dst, src, out=dst)
    else:
        torch.maximum(dst, src, out=dst)


def reduce_into(dst: Any, a: Any, b: Any, op: ReduceOp) -> None:
    """dst = a OP b on the device (current stream): one kernel where a copy and reduce_inplace take two (each
    launch is the caller's time in an ordered collective); the same bits."""
    torch = torch_mod()
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        torch.add(a, b, out=dst)
    elif op == ReduceOp.PROD:
        torch.mul(a, b, out=dst)
    elif op == ReduceOp.MIN:
        torch.minimum(a, b, out=dst)
    else:
        torch.maximum(a, b, out=dst)


def divide_inplace(t: Any, divisor: int) -> None:
    if t.is_floating_point():
        t.div_(divisor)
    else:
        t.copy_(torch_mod().div(t, divisor, rounding_mode="trunc"))


async def wait_event(event: Any, deadline: float, what: str, poll: Any = None) -> None:
    """Await a CUDA event without blocking the loop or synchronising the device; `poll()` may raise (e.g. a
    vendor CCL's asynchronous error)."""
    loop = asyncio.get_running_loop()
    spins = 0
    while not event.query():
        spins += 1
        if poll is not None and spins % 16 == 0:
            poll()
        if spins % 256 == 0 and loop.time() > deadline:
            raise CollectiveTimeout(f"{what} did not complete on the device before the deadline (HETCCL_TIMEOUT)")
        # yield to the loop (other collectives, transports) but keep polling: a GPU collective finishes in
        # microseconds to milliseconds, and a timed sleep would add its whole granularity to each one
        await asyncio.sleep(0 if spins < 200_000 else 0.0005)


def device_index(device: Any) -> int:
    torch = torch_mod()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def use_device(device: Any) -> None:
    """Make `device` current on the calling thread. hetccl's loop thread serves every caller of a process, and a
    thread's current device defaults to 0: without this, rank 1's events, driver calls and allocations would
    land on GPU 0 whenever every GPU is visible (torchrun's default)."""
    torch = torch_mod()
    index = device_index(device)
    if index >= 0 and torch.cuda.current_device() != index:
        torch.cuda.set_device(index)


_STREAMS: dict[int, tuple[Any, Any]] = {}


def copy_streams(device: Any) -> tuple[Any, Any]:
    """The device's two copy streams (device-to-host, host-to-device), shared by every staged operation: a
    stream only orders work, and operations that share one still finish in issue order."""
    torch = torch_mod()
    index = device_index(device)
    pair = _STREAMS.get(index)
    if pair is None:
        pair = _STREAMS[index] = (torch.cuda.Stream(device=index), torch.cuda.Stream(device=index))
    return pair


_POOL: dict[tuple[str, int, int], list[list[Any]]] = {}
_POOL_LOCK = threading.Lock()
_POOL_KEEP = 4  # idle sets kept per (kind, device, slots)


@contextlib.contextmanager
def lease(kind: str, device: Any, nbytes: int, slots: int) -> Iterator[list[Any]]:
    """`slots` buffers of exactly `nbytes` for one operation: pinned host memory (kind "pinned") or device memory
    ("device"). Several operations in flight each hold their own (pinned allocation costs milliseconds, so
    released sets are kept for the next operation). A set whose operation failed is not reused: copies
    may still be queued on it, and torch's allocator frees it only once they are done."""
    torch = torch_mod()
    index = device_index(device)
    key = (kind, index, slots)
    with _POOL_LOCK:
        free = _POOL.setdefault(key, [])
        # by position: list.remove compares sets with ==, elementwise on tensors, which raises on unequal sizes
        at = next((i for i, b in enumerate(free) if b[0].numel() >= nbytes), None)
        bufs = free.pop(at) if at is not None else None
    if bufs is None:
        if kind == "pinned":
            bufs = [torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        else:
            bufs = [torch.empty(max(nbytes, 1), dtype=torch.uint8, device=index) for _ in range(slots)]
    # views of the size asked for: a pooled set may be larger, and a caller's .view(dtype) needs a whole number of
    # its elements (a set left by a float32 call of 100003 elements cannot be viewed as int64)
    yield [b[:nbytes] for b in bufs]  # an exception here skips the return to the pool
    with _POOL_LOCK:
        if len(free) < _POOL_KEEP:
            free.append(bufs)
