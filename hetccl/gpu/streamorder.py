"""Cross-island collectives ordered on the caller's stream, with every CUDA call made off hetccl's loop thread.

A collective between islands has host work (the wire, host reductions). The caller's thread must not wait for
it, yet the stream must see its result in order. So the whole device side is enqueued on the stream at once,
by the caller's thread or, in the torch backend with HETCCL_TORCH_ENQUEUE_THREAD=1 (experimental), by its
enqueuing thread (torch/enqueuer.py), and hetccl's loop thread does the host side touching only host memory:

    caller's stream:  D2H piece 0 -> pinned, write word a0 ... D2H piece k -> pinned, write word ak
                      wait until word b0 -> H2D piece 0 ... wait until word bk -> H2D piece k, write word c
    loop thread:      for each piece: wait for word a_i (a plain load), the host collective, store word b_i

(The "caller's stream" is the torch backend's collective stream, which waits for the caller's. Where the copies
to the host read the caller's data untouched by this collective, they may go on a second, early stream: then a
collective's copies out run while the one before it still waits for its host step, as with the loop's separate
copy streams, and its end word follows them.)

The words are 32-bit, in host memory mapped for the GPU (stream memory operations, bindings/streamops.py). A
Stage's copies and words go into its island's StreamBatch, enqueued by one native call per flush.
Why the loop thread makes no CUDA call at all: with lazy module loading (CUDA's default), the first launch of
a kernel takes the context's lock and waits for the GPU to drain; a held stream drains only when the loop
thread stores its word, and a loop thread that made any CUDA call then would wait for that lock. On one H200
(2026-12-04, benchmarks/implicit_sync_probe.py) the caller's first `torch.equal` sat in cuLaunchKernel while
the loop thread sat in cudaEventDestroy, and also cudaHostRegister and cudaFree waited behind a held stream.
NCCL's proxy thread is safe the same way: its kernels wait for a thread that makes no CUDA call.

A failed host side stores every b word, so the stream never waits forever (its result is not to be used; the
torch backend logs the error at once and raises it at the next call or wait()). Pinned buffers are pooled per
device and reused once the stream has passed word c and the host side has let go of them; they are allocated
and dropped on the thread that enqueues the device side only (the caller's, or the torch backend's enqueuing
thread), never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import native, params
from ..errors import CollectiveTimeout, TransportError
from .runtime import device_index, torch_mod

WORDS = 1 << 16  # words per device; a word is reused after WORDS others (a generation each time)
POOL_KEEP = 16  # pinned buffers kept per device
POLL_S = 20e-6  # the watcher's pause between looks at the words it waits for
YIELD_S = params.get("HETCCL_WORDS_YIELD_US") * 1e-6  # after a new wait, looks between sched_yield calls so long
CHECK_S = 0.05  # until()'s pause between looks for a lost peer


class Words:
    """A device's host-mapped words (make with `words_for`), and its pool of pinned buffers."""

    def __init__(self, device: int, ops: Any):
        torch = torch_mod()
        self.device, self.ops = device, ops
        self._mm = mmap.mmap(-1, WORDS * 4)
        self.host = np.frombuffer(self._mm, dtype=np.uint32)
        ptr = self.host.ctypes.data
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(ptr, WORDS * 4, 3)  # portable | mapped
            if int(err) != 0:
                raise TransportError(f"cudaHostRegister of the stream-order words failed (error {int(err)})")
            self._dev = ops.device_pointer(ptr)  # the device address of slot 0
        self._next = 0
        self._lock = threading.Lock()
        self._pool: list[_Pinned] = []

    def take(self, m: int) -> list[tuple[int, int]]:
        """m fresh (slot, generation) pairs: a word reaches a generation when it holds it or a later one."""
        with self._lock:
            k = self._next
            self._next += m
        return [((k + i) % WORDS, ((k + i) // WORDS + 1) & 0xFFFFFFFF) for i in range(m)]

    def reached(self, word: tuple[int, int]) -> bool:
        slot, gen = word
        return not (int(self.host[slot]) - gen) & 0x80000000

    def store(self, word: tuple[int, int]) -> None:
        self.host[word[0]] = word[1]

    def address(self, word: tuple[int, int]) -> int:
        """The device address of the word's slot (what stream memory operations take)."""
        return self._dev + 4 * word[0]

    def signal(self, stream: int, word: tuple[int, int]) -> None:
        """Enqueue on `stream`: store the word once the stream gets there."""
        self.ops.write(stream, self.address(word), word[1])

    def hold(self, stream: int, word: tuple[int, int]) -> None:
        """Enqueue on `stream`: go on only once the word is reached."""
        self.ops.wait_geq(stream, self.address(word), word[1])

    def pinned(self, nbytes: int) -> _Pinned:
        """A pinned buffer of at least nbytes that no stream nor host side still uses (the enqueuing thread)."""
        torch = torch_mod()
        with self._lock:
            free = [p for p in self._pool if p.nbytes >= nbytes and p.idle(self)]  # the size first: it is cheaper
            if free:
                p = min(free, key=lambda q: q.nbytes)
                p.released, p.end = False, None
                return p
            if len(self._pool) >= POOL_KEEP:  # make room: drop the smallest idle one
                idle = [q for q in self._pool if q.idle(self)]
                if idle:
                    self._pool.remove(min(idle, key=lambda q: q.nbytes))
        size = 1 << max(12, (nbytes - 1).bit_length())
        p = _Pinned(torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=True))
        p.released = False
        with self._lock:
            self._pool.append(p)
        return p


class _Pinned:
    __slots__ = ("tensor", "array", "ptr", "nbytes", "released", "end")

    def __init__(self, tensor: Any):
        self.tensor, self.array, self.ptr, self.nbytes = tensor, tensor.numpy(), tensor.data_ptr(), tensor.numel()
        self.released, self.end = True, None  # end: the word the stream stores after its last use

    def idle(self, words: Words) -> bool:
        return self.released and (self.end is None or words.reached(self.end))


_WORDS: dict[int, Words | None] = {}
_WHY: dict[int, str] = {}  # why a device has no words
_WORDS_LOCK = threading.Lock()


def unavailable_reason(device: Any) -> str:
    return _WHY.get(device_index(device), "")


def loading_problem() -> str:
    """Why ordered collectives could deadlock in this process ("" where they cannot): CUDA's lazy module loading.

    The host side of an ordered collective runs Python on hetccl's loop thread, so it needs the GIL. With lazy
    loading, the first launch of a kernel waits for the GPU to drain, and torch makes that launch holding the
    GIL: the drain waits for the held stream, the stream for the loop's word, the loop for the GIL. On one H200
    (2026-12-04) FSDP2 over the link path hung so in AdamW's first `_foreach_mul_` launch on both ranks (py-spy:
    the main threads in cuLaunchKernel holding the GIL, the loop threads waiting for it); with
    CUDA_MODULE_LOADING=EAGER the same run passed. NCCL has no such cycle: its proxy thread is C, without a GIL."""
    torch = torch_mod()
    if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return ""
    from ..bindings.streamops import load_driver

    try:
        lazy = load_driver("cuda").lazy_loading()
    except TransportError:
        return ""  # no driver: words_for() says so where it matters
    if not lazy:
        return ""
    return ("the stream order across islands (HETCCL_TORCH_STREAM_ORDER) needs CUDA_MODULE_LOADING=EAGER, and this "
            "process loads GPU modules lazily: the first launch of a kernel would wait for a stream that waits for "
            "hetccl's loop thread, which waits for the Python GIL that the launch holds. Set "
            "CUDA_MODULE_LOADING=EAGER in the environment of every rank before CUDA starts (hetccl sets it at "
            "`import hetccl.torch` when CUDA has not started and the variable is unset: import it before any "
            "CUDA call)")


def process_problem() -> str:
    """Why this process cannot order cross-island collectives on the caller's stream ("" where it can, and in a
    process without a GPU: it never orders, and its host schedule is the one that ordered ranks run)."""
    torch = torch_mod()
    if not torch.cuda.is_available():
        return ""
    why = loading_problem()
    if why:
        return why
    from ..bindings.streamops import load_streamops

    try:
        load_streamops("hip" if getattr(torch.version, "hip", None) else "cuda")
    except TransportError as exc:
        return f"the stream order across islands needs GPU stream memory operations, and this process has none ({exc})"
    return ""


def words_for(device: Any) -> Words | None:
    """The device's words, or None where stream memory operations cannot be used (`unavailable_reason`)."""
    index = device_index(device)
    words = _WORDS.get(index, False)
    if words is not False:
        return words  # type: ignore[return-value]
    with _WORDS_LOCK:
        if index in _WORDS:
            return _WORDS[index]
        from ..bindings.streamops import load_streamops

        torch = torch_mod()
        try:
            ops = load_streamops("hip" if getattr(torch.version, "hip", None) else "cuda")
            _WORDS[index] = Words(index, ops)
        except TransportError as exc:
            _WHY[index] = str(exc)
            _WORDS[index] = None
        return _WORDS[index]


class _Watcher:
    """One thread that looks at the words the loop waits for and completes their futures: a poll without a
    CUDA call, and without spinning the loop (its timers have millisecond steps). The poll itself is native
    and holds no GIL (hccl_words_wait): a Python poll took the GIL every POLL_S, and each time the caller's
    thread let it go (any C call) it waited for the watcher to give it back. For YIELD_S after each new wait
    it may look between sched_yield calls (a small collective's word comes within tens of microseconds, and
    a pause's sleep costs more than POLL_S), then pauses POLL_S between looks."""

    def __init__(self) -> None:
        self._waits: list[tuple[Words, tuple[int, int], asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._bump = np.zeros(1, dtype=np.uint32)  # changed with every new wait: the native poll looks again

    def wait(self, words: Words, word: tuple[int, int]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if words.reached(word):
            fut.set_result(None)
            return fut
        with self._cond:
            self._waits.append((words, word, loop, fut))
            self._bump[0] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hetccl-words", daemon=True)
                self._thread.start()
            self._cond.notify()
        return fut

    def _run(self) -> None:
        ffi, lib = native.ffi, native.lib
        bump = ffi.cast("uint32_t *", self._bump.ctypes.data)
        while True:
            with self._cond:
                self._waits = [w for w in self._waits if not w[3].done()]  # cancelled: until() gave up
                while not self._waits:
                    self._cond.wait()
                waits, seen = list(self._waits), int(self._bump[0])
            addrs = np.array([w[0].host.ctypes.data + 4 * w[1][0] for w in waits], dtype=np.uint64)
            gens = np.array([w[1][1] for w in waits], dtype=np.uint32)
            # back at the first word reached, a new wait, or CHECK_S (to drop cancelled waits)
            lib.hccl_words_wait(ffi.cast("uint64_t *", addrs.ctypes.data), ffi.cast("uint32_t *", gens.ctypes.data),
                                len(waits), bump, seen, int(YIELD_S * 1e9), int(POLL_S * 1e9), int(CHECK_S * 1e9))
            done = {id(w): w for w in waits if w[0].reached(w[1])}
            if done:
                with self._cond:
                    self._waits = [w for w in self._waits if id(w) not in done]
                for _, _, loop, fut in done.values():
                    if not fut.done():  # a cancelled wait: its loop may be closed by now
                        with contextlib.suppress(RuntimeError):  # closed meanwhile: nobody waits there
                            loop.call_soon_threadsafe(_settle, fut)


def _settle(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


_WATCHER = _Watcher()


async def until(words: Words, word: tuple[int, int], deadline: float, what: str,
                check: Callable[[], None] | None = None) -> None:
    """Wait on the loop until a stream has stored `word`; every CHECK_S calls check() (it raises where a peer
    was lost), and past the deadline raise CollectiveTimeout."""
    loop = asyncio.get_running_loop()
    fut = _WATCHER.wait(words, word)
    try:
        while not fut.done():
            left = deadline - loop.time()
            if left <= 0:
                raise CollectiveTimeout(f"{what} did not end before the deadline (HETCCL_TIMEOUT)")
            await asyncio.wait([fut], timeout=min(CHECK_S, left))
            if check is not None and not fut.done():
                check()
    finally:
        if not fut.done():
            fut.cancel()  # the watcher drops it


def wait_host(words: Words, word: tuple[int, int], deadline: float, what: str) -> None:
    """Wait on this thread until a stream has stored `word` (time.monotonic() `deadline`: CollectiveTimeout)."""
    while not words.reached(word):
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"{what} did not end before the deadline (HETCCL_TIMEOUT)")
        time.sleep(POLL_S)


Copy = tuple[int, int, int]  # (byte offset in the device tensor, byte offset in the pinned buffer, bytes)


def contiguous(at: int, ranges: list[tuple[int, int]]) -> list[list[Copy]]:
    """Pieces of one copy each: bytes [a, b) of the tensor <-> bytes [at + a, at + b) of the pinned buffer."""
    return [[(a, at + a, b - a)] for a, b in ranges]


class Stage:
    """One collective's device side, enqueued by the caller's thread on its stream, and the host side's view
    of it: `host` (a pinned uint8 array), `arrived(i)` (piece i of the copies to the host has landed) and
    `done(j)` (piece j may be copied back). A piece is a list of copies under one word. `to_host`, `from_host`
    and `seal` are called once each, in that order (either copy may have no pieces). Each takes its words at
    once and hands what it enqueues to `later`, so that the host side may start before the device side is
    enqueued."""

    def __init__(self, words: Words, stream: Any, nbytes: int, later: Callable[[Callable[[], None]], None],
                 batch: Any, early: Any = None):
        self.words, self.stream, self.batch = words, stream, batch
        self.early = early  # a stream for the copies to the host of data as the caller's stream left it (to_host)
        self._early_used = False
        self._buf = words.pinned(nbytes)
        self.host = self._buf.array[:nbytes]
        self._arrivals: list[tuple[int, int]] = []
        self._releases: list[tuple[int, int]] = []
        self._later = later

    def to_host(self, src: Any, pieces: list[list[Copy]], early: bool = False) -> None:
        """The copies of each piece from the contiguous device tensor src to the pinned buffer, then its word.
        early: src is the caller's data as its stream leaves it (nothing of this collective enqueued before
        writes it), so the copies may run on the early stream, beside the collective stream's earlier
        collectives still waiting for their host steps, instead of behind them."""
        words = self.words.take(len(pieces))
        self._arrivals += words
        on = self.early if early and self.early is not None else self.stream
        self._early_used |= on is not self.stream

        def enqueue() -> None:  # copies by address, into the batch: no torch dispatch nor Python call per piece
            batch, stream, host, dev, address = self.batch, on.cuda_stream, self._buf.ptr, src.data_ptr(), \
                self.words.address
            for piece, w in zip(pieces, words, strict=True):
                for d, h, nb in piece:
                    batch.copy(host + h, dev + d, nb, stream)
                batch.write(stream, address(w), w[1])
        self._later(enqueue)

    def from_host(self, dst: Any, pieces: list[list[Copy]], then: Callable[[int], None] | None = None) -> None:
        """For each piece j: wait for its word, then its copies from the pinned buffer into the contiguous device
        tensor dst, then `then(j)` (which may enqueue kernels on the stream: it runs under it, and flushes
        `batch`, which holds the piece's copies, before it launches anything)."""
        words = self.words.take(len(pieces))
        self._releases += words

        def enqueue() -> None:
            batch, stream, host, dev, address = self.batch, self.stream.cuda_stream, self._buf.ptr, dst.data_ptr(), \
                self.words.address
            for j, (piece, w) in enumerate(zip(pieces, words, strict=True)):
                batch.wait_geq(stream, address(w), w[1])
                for d, h, nb in piece:
                    batch.copy(dev + d, host + h, nb, stream)
                if then is not None:
                    then(j)
        self._later(enqueue)

    def seal(self) -> None:
        """The stream's last use of the pinned buffer: it is free once the stream passes here."""
        end = self.words.take(1)[0]
        self._buf.end = end
        early = self.early if self._early_used else None

        def enqueue() -> None:
            if early is not None:  # the end follows the early copies too, whatever the host side did
                self.batch.flush()
                self.stream.wait_stream(early)
            self.batch.write(self.stream.cuda_stream, self.words.address(end), end[1])
        self._later(enqueue)

    async def arrived(self, i: int, deadline: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(_WATCHER.wait(self.words, self._arrivals[i]), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise CollectiveTimeout(f"{what}: the caller's stream did not reach the collective before the deadline "
                                    "(HETCCL_TIMEOUT): the work queued ahead of it took longer") from None

    def done(self, j: int) -> None:
        self.words.store(self._releases[j])

    def finish(self, ok: bool) -> None:
        """The host side is over: on failure every copy back may go (the stream must not wait forever)."""
        if not ok:
            for w in self._releases:
                self.words.store(w)
        self._buf.released = True
