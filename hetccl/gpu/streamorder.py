"""Collectives that run partly on the host, ordered on the caller's stream without holding the caller's thread.

A cross-island collective needs host work (staging, the wire, host reductions) that hetccl's loop thread does.
Instead of the caller's thread waiting for it, `StreamGate.enter` enqueues, from the caller's thread:

    caller's stream:  record `start`  ->  wait until word[s] >= generation  ->  (what the caller queues next)
    the gate's side stream:  wait for `start`  ->  the collective's device work, issued by the loop thread
                             ->  write word[s] = generation   (`Ticket.release_on_stream`)

and returns. The loop thread runs the collective on the side stream (its device work waits for the caller's
earlier work there, never on the caller's stream, which is blocked until the end), and at its end the side stream
itself releases the caller's stream: no host round trip. A collective that fails writes the word from the host
(`Ticket.release_now`), so the caller's stream never waits forever, and the caller learns of the error from the
backend (its next call or wait()). Every ticket has its own word (slot s, generation g): collectives issued on
different streams do not wait for each other. The words are 32-bit, in host memory mapped for the GPU, moved by
stream memory operations (bindings/streamops.py; ProcessGroupNCCL orders its work the same way with events,
which a host-side end cannot record in advance).
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Any

import numpy as np

from ..errors import TransportError
from .runtime import device_index, torch_mod

log = logging.getLogger("hetccl")

WORDS = 1 << 14  # tickets in flight per device before a word is reused (each has its own)


class Ticket:
    """One collective's place in the order: `side` is the stream its device work goes on."""

    __slots__ = ("gate", "slot", "gen", "side", "end", "released")

    def __init__(self, gate: StreamGate, slot: int, gen: int, side: Any, end: Any):
        self.gate, self.slot, self.gen, self.side, self.end = gate, slot, gen, side, end
        self.released = False

    def release_on_stream(self) -> None:
        """The caller's stream goes on once the side stream reaches this point (its device work is done)."""
        self.gate.ops.write(self.side.cuda_stream, self.gate.dev_word(self.slot), self.gen)
        self.released = True

    def release_now(self) -> None:
        """Let the caller's stream go on at once (the collective failed: its result is not to be used)."""
        if not self.released:
            self.released = True
            self.gate.words[self.slot] = self.gen


class StreamGate:
    """The words and the side stream of one device (make with `gate_for`)."""

    def __init__(self, device: int, ops: Any):
        torch = torch_mod()
        self.device, self.ops = device, ops
        self._mm = mmap.mmap(-1, WORDS * 4)
        self.words = np.frombuffer(self._mm, dtype=np.uint32)
        ptr = self.words.ctypes.data
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(ptr, WORDS * 4, 3)  # portable | mapped
            if int(err) != 0:
                raise TransportError(f"cudaHostRegister of the stream-order words failed (error {int(err)})")
            self._dev = ops.device_pointer(ptr)
            self.side = torch.cuda.Stream(device=device)
        self._next = 0
        self._lock = threading.Lock()

    def dev_word(self, slot: int) -> int:
        return self._dev + 4 * slot

    def enter(self, caller: Any) -> Ticket:
        """From the caller's thread: order a collective after `caller`'s queued work, and what `caller` queues
        next after the collective's end. Returns at once."""
        torch = torch_mod()
        with self._lock:
            k = self._next
            self._next += 1
        slot, gen = k % WORDS, (k // WORDS + 1) & 0xFFFFFFFF
        start = torch.cuda.Event()
        start.record(caller)
        self.side.wait_event(start)
        self.ops.wait_geq(caller.cuda_stream, self.dev_word(slot), gen)
        end = torch.cuda.Event()
        end.record(caller)
        return Ticket(self, slot, gen, self.side, end)


_GATES: dict[int, StreamGate | None] = {}
_GATES_LOCK = threading.Lock()


def gate_for(device: Any) -> StreamGate | None:
    """The device's gate, or None where stream memory operations cannot be used (then the caller waits for
    the host work itself, as before; the reason is logged once)."""
    index = device_index(device)
    gate = _GATES.get(index, False)
    if gate is not False:
        return gate  # type: ignore[return-value]
    with _GATES_LOCK:
        if index in _GATES:
            return _GATES[index]
        from ..bindings.streamops import load_streamops

        torch = torch_mod()
        try:
            ops = load_streamops("hip" if getattr(torch.version, "hip", None) else "cuda")
            _GATES[index] = StreamGate(index, ops)
        except TransportError as exc:
            log.info("hetccl: cross-island collectives hold the caller's thread until they end (%s)", exc)
            _GATES[index] = None
        return _GATES[index]
