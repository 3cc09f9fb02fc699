"""Which CUDA calls wait behind a stream that is held by a stream memory wait (gpu/streamorder.py's gate)?

The stream order across islands holds the caller's stream on a host-mapped word that the collective's end
writes. If the thread that does the collective's host work makes a call that CUDA synchronizes implicitly with
that stream, the two wait for each other. This probe holds one stream (the legacy default stream, or a pool
stream) on a word, makes each call from another thread, and says whether it returned within `--patience`
seconds (then the word is written, so that nothing stays stuck):

    python3 benchmarks/implicit_sync_probe.py [--patience 3]

Prints one line per (held stream, call): `ok 0.12 ms` or `WAITS (returned 3.0 s after, once released)`.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import threading
import time
from collections.abc import Callable

import torch
from hetccl.gpu.runtime import record_event, stream_waits
from hetccl.gpu.streamorder import wait_host, words_for

BEFORE: list = []  # an event recorded on the held stream just before its hold (main sets it for each probe)


def probes(side: torch.cuda.Stream) -> dict[str, Callable[[], None]]:
    sizes = iter(range(1, 1000))
    words = words_for(0)

    def fresh_pinned() -> None:  # a size the caching host allocator has not seen: cudaHostAlloc
        torch.empty((64 << 20) + next(sizes) * 4096, dtype=torch.uint8, pin_memory=True)

    def fresh_device() -> None:  # a new segment of the caching allocator: cudaMalloc
        torch.empty((256 << 20) + next(sizes) * (2 << 20), dtype=torch.uint8, device="cuda")

    def register() -> None:
        mm = mmap.mmap(-1, 8 << 20)
        buf = (ctypes.c_char * len(mm)).from_buffer(mm)
        ptr = ctypes.addressof(buf)
        assert int(torch.cuda.cudart().cudaHostRegister(ptr, len(mm), 3)) == 0
        torch.cuda.cudart().cudaHostUnregister(ptr)
        del buf

    def kernel_on_side() -> None:
        with torch.cuda.stream(side):
            x = torch.ones(1 << 20, device="cuda")
            x.add_(1)
        side.synchronize()

    def copy_on_side() -> None:
        host = torch.empty(1 << 20, pin_memory=True)
        with torch.cuda.stream(side):
            dev = torch.ones(1 << 20, device="cuda")
            host.copy_(dev, non_blocking=True)
        side.synchronize()

    def kernel_current() -> None:  # this thread's current stream: the legacy default stream
        torch.ones(1 << 20, device="cuda").add_(1)
        torch.cuda.current_stream().synchronize()

    def new_stream() -> None:
        torch.cuda.Stream()

    def event_on_side() -> None:
        ev = torch.cuda.Event()
        ev.record(side)
        ev.synchronize()

    def empty_cache() -> None:
        torch.cuda.empty_cache()

    def copy_out_after_event() -> None:
        """What the torch backend's enqueuing thread does for an ordered collective's copy out: the side stream
        waits for an event of the held stream from before its hold, then a driver D2H into fresh pinned memory
        and a word; this thread waits on the host for the word."""
        host = torch.empty((4 << 20) + next(sizes) * 4096, dtype=torch.uint8, pin_memory=True)
        dev = torch.ones(1 << 20, device="cuda")
        stream_waits(side.cuda_stream, 0, BEFORE[-1])
        batch = words.ops.batch()
        word = words.take(1)[0]
        batch.copy(host.data_ptr(), dev.data_ptr(), 4 << 20, side.cuda_stream)
        batch.write(side.cuda_stream, words.address(word), word[1])
        batch.flush()
        wait_host(words, word, time.monotonic() + 30, "the copy out")

    def wait_stream_event() -> None:  # Stage.seal's torch calls: an event on one pool stream waited by another
        other = torch.cuda.Stream()
        other.wait_stream(side)
        other.synchronize()

    return {"pinned alloc (new size)": fresh_pinned, "device alloc (new segment)": fresh_device,
            "cudaHostRegister+Unregister": register, "kernel on a pool stream": kernel_on_side,
            "D2H copy on a pool stream": copy_on_side, "event on a pool stream": event_on_side,
            "new stream": new_stream, "kernel on the legacy stream": kernel_current,
            "empty_cache (cudaFree)": empty_cache, "copy out after an earlier event": copy_out_after_event,
            "Stream.wait_stream": wait_stream_event}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--patience", type=float, default=3.0)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")
    words = words_for(0)
    assert words is not None, "stream memory operations unavailable"
    side = torch.cuda.Stream()
    held_streams = {"legacy default stream": torch.cuda.default_stream(), "pool stream": torch.cuda.Stream()}
    for held_name, held in held_streams.items():
        for name, call in probes(side).items():
            torch.cuda.synchronize()
            BEFORE.append(record_event(held.cuda_stream, 0))
            word = words.take(1)[0]
            words.hold(held.cuda_stream, word)
            done = threading.Event()
            t0 = time.perf_counter()
            worker = threading.Thread(target=lambda c=call, d=done: (c(), d.set()), daemon=True)
            worker.start()
            returned = done.wait(args.patience)
            ms = (time.perf_counter() - t0) * 1000
            words.store(word)
            worker.join(30)
            after = (time.perf_counter() - t0)
            state = f"ok {ms:.2f} ms" if returned else f"WAITS (returned {after:.1f} s after, once released)"
            print(f"{held_name:>22} held | {name:<30} {state}", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
