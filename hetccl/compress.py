"""The island leaders' step with a compressed wire (HETCCL_CROSS_COMPRESS): only the bytes that cross between
island leaders are cast, to bf16, fp16 or fp8 (e4m3 with a power-of-two scale per 1024 values:
native/hetccl_native.h), and every leader reduces what arrives in the caller's dtype. Inside islands nothing
changes. Each op is a schedule of flat byte collectives on the leaders' group, as UCC composes its own:

- all_reduce: each leader packs its buffer's n blocks and sends block j to leader j (all_to_all); leader j
  reduces the n packed blocks (its own too) into its block, packs that, and the leaders all_gather the packed
  results, which each unpacks, its own included, so that every rank ends with the same bits. Each leader
  sends 2(n-1)/n of the packed bytes, what a ring sends of the unpacked ones;
- reduce_scatter: the all_to_all and the reduction, into the caller's output;
- all_gather: the all_gather of the packed blocks, unpacked by every leader (its own block too).

Integers are never compressed, nor a dtype no wider than the wire format, nor an op below
HETCCL_CROSS_COMPRESS_MIN bytes (a loss or a metric stays exact); both settings are agreed by every rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from . import native
from .dtypes import Buf, DType, ReduceOp
from .gpu.codec import leader_blocks

WIRES: dict[str, tuple[int, int]] = {"bf16": (1, 2), "fp16": (2, 2), "fp8": (3, 1)}  # -> (HCCL_WIRE_*, bytes)


def wire_for(settings: Any, dtype: DType | None, nbytes: int) -> int:
    """The wire format (HCCL_WIRE_*) of a leaders' step of nbytes of dtype (the whole collective's size, the
    same on every leader), or 0 where it stays uncompressed."""
    name = settings.cross_compress
    if name == "none" or dtype is None or not dtype.is_float or nbytes < settings.cross_compress_min:
        return 0
    code, size = WIRES[name]
    return code if size < dtype.itemsize else 0


def round_trip(b: Buf, wire: int, pieces: list[tuple[int, int]], n: int) -> Any:
    """b's bytes as all_reduce's first hop between n leaders carries them (a new uint8 array): each piece's n
    blocks packed and unpacked, as all_reduce below packs them. What an error-feedback hook keeps the rest of
    (hetccl.torch.hooks)."""
    out = np.empty_like(b.data)
    isz = b.dtype.itemsize
    for lo, hi in pieces:
        part, back = Buf(b.data[lo:hi], b.dtype, (hi - lo) // isz), Buf(out[lo:hi], b.dtype, (hi - lo) // isz)
        for a, z in leader_blocks(part.count, n):
            packed = np.empty(native.wire_size(z - a, wire), np.uint8)
            native.pack(packed, part.elems(a, z), z - a, b.dtype, wire)
            native.unpack(back.elems(a, z), packed, z - a, b.dtype, wire)
    return out


def _packed(group: Any, nbytes: int) -> tuple[Any, Buf]:
    scratch = group.scratch.take(nbytes)
    return scratch, Buf(scratch[:nbytes], DType.UINT8, nbytes)


async def _settle(leaders: Any, flying: list[asyncio.Future], sets: list[tuple[Any, Any]]) -> None:
    """Cancel and await the pieces' collectives still in flight, then give their scratch back (no transfer
    lands in scratch given back)."""
    left = [f for f in flying if not f.done()]
    for f in left:
        f.cancel()
    if left:
        await asyncio.gather(*left, return_exceptions=True)
    for (sent_s, _), (got_s, _) in sets:
        leaders.scratch.give(sent_s)
        leaders.scratch.give(got_s)


async def all_reduce(leaders: Any, b: Buf, op: ReduceOp, wire: int, pieces: list[tuple[int, int]]) -> None:
    """b's byte ranges `pieces` one after the other, pipelined: piece i is packed while piece i-1's results
    cross, and piece i-1's are unpacked while piece i crosses (the kernel sends what the sockets hold while
    this thread packs). The collectives are issued in one fixed order (all_to_all i, all_gather i, all_to_all
    i+1, ...) on every leader. The codec on hetccl's loop thread, not a worker thread: with a pool thread the
    64 MiB all_reduce over a 10 Gbit/s veth took 133 ms instead of 88 (2 cores, 2026-12-04)."""
    n, r, isz = leaders.size, leaders.rank, b.dtype.itemsize
    parts = [Buf(b.data[lo:hi], b.dtype, (hi - lo) // isz) for lo, hi in pieces]
    slot = native.wire_size(-(-max(p.count for p in parts) // n), wire)
    sets = [(_packed(leaders, n * slot), _packed(leaders, n * slot)) for _ in range(min(2, len(parts)))]

    def pack_blocks(p: Buf, sent: Buf) -> None:
        for j, (lo, hi) in enumerate(leader_blocks(p.count, n)):
            native.pack(sent.data[j * slot:], p.elems(lo, hi), hi - lo, p.dtype, wire)

    def reduce_mine(p: Buf, got: Buf, sent: Buf) -> None:
        # in rank order (the same sum whoever owns the block), packed, and my block set to what that carries
        lo, hi = leader_blocks(p.count, n)[r]
        native.unpack_reduce_pack(p.elems(lo, hi), [got.data[j * slot:(j + 1) * slot] for j in range(n)], hi - lo,
                                  p.dtype, wire, op, sent.data[r * slot:(r + 1) * slot])

    def unpack_all(p: Buf, got: Buf) -> None:
        for j, (lo, hi) in enumerate(leader_blocks(p.count, n)):
            if j != r:  # mine holds its packed bits already (reduce_mine)
                native.unpack(p.elems(lo, hi), got.data[j * slot:], hi - lo, p.dtype, wire)

    flying: list[asyncio.Future] = []
    gathered: tuple[asyncio.Future, Buf, Buf] | None = None  # the previous piece's all_gather
    try:
        for i, p in enumerate(parts):
            (_, sent), (_, got) = sets[i % 2]
            pack_blocks(p, sent)
            a2a = asyncio.ensure_future(leaders.flat_all_to_all(got, sent))
            flying.append(a2a)
            if gathered is not None:
                await gathered[0]
                unpack_all(gathered[1], gathered[2])
            await a2a
            reduce_mine(p, got, sent)
            ag = asyncio.ensure_future(leaders.flat_all_gather(got, Buf(sent.data[r * slot:(r + 1) * slot],
                                                                        DType.UINT8, slot)))
            flying.append(ag)
            gathered = (ag, p, got)
        if gathered is not None:
            await gathered[0]
            unpack_all(gathered[1], gathered[2])
    finally:
        await _settle(leaders, flying, sets)


def piece_slots(k: int, piece: int, wire: int) -> tuple[list[tuple[int, int]], int]:
    """The pieces of `piece` elements of a leader's block of k (element ranges) that all_gather and
    reduce_scatter below cross one collective each, and the bytes of a packed piece: what a GPU leader's
    packing on its device matches collective for collective (hierarchical._packed_pieces)."""
    piece = max(1, piece)
    ranges = [(a, min(a + piece, k)) for a in range(0, max(k, 1), piece)]
    return ranges, native.wire_size(ranges[0][1] - ranges[0][0], wire)


async def _pipelined(leaders: Any, count: int, sent_bytes: int, got_bytes: int,
                     pack: Callable[[int, Buf], None], collective: Callable[[int, Buf, Buf], Awaitable[None]],
                     unpack: Callable[[int, Buf], None]) -> None:
    """count pieces, each packed, crossed by one collective and unpacked, in two sets of scratch: piece i is
    packed while piece i-1 crosses, then piece i-1 unpacked while piece i crosses; the collectives are issued
    in piece order on every leader."""
    sets = [(_packed(leaders, sent_bytes), _packed(leaders, got_bytes)) for _ in range(min(2, count))]
    flying: list[asyncio.Future] = []
    try:
        for i in range(count):
            (_, sent), (_, got) = sets[i % 2]
            pack(i, sent)
            flying.append(asyncio.ensure_future(collective(i, sent, got)))
            if i:
                await flying[i - 1]
                unpack(i - 1, sets[(i - 1) % 2][1][1])
        if flying:
            await flying[-1]
            unpack(count - 1, sets[(count - 1) % 2][1][1])
    finally:
        await _settle(leaders, flying, sets)


async def reduce_scatter(leaders: Any, out: Buf, inp: Buf, op: ReduceOp, wire: int, piece: int) -> None:
    """Pieces of `piece` elements of each leader's block, pipelined (_pipelined)."""
    n, k = leaders.size, out.count
    ranges, slot = piece_slots(k, piece, wire)

    def pack(i: int, sent: Buf) -> None:
        a, b = ranges[i]
        for j in range(n):
            native.pack(sent.data[j * slot:], inp.elems(j * k + a, j * k + b), b - a, inp.dtype, wire)

    def unpack(i: int, got: Buf) -> None:
        a, b = ranges[i]
        for j in range(n):
            native.unpack(out.elems(a, b), got.data[j * slot:], b - a, out.dtype, wire, None if j == 0 else op)

    await _pipelined(leaders, len(ranges), n * slot, n * slot, pack,
                     lambda i, sent, got: leaders.flat_all_to_all(got, sent), unpack)


async def all_gather(leaders: Any, out: Buf, inp: Buf, wire: int, piece: int) -> None:
    """Pieces of `piece` elements of each leader's block, pipelined (_pipelined); inp may be out's own block."""
    n, k = leaders.size, inp.count
    ranges, slot = piece_slots(k, piece, wire)

    def pack(i: int, sent: Buf) -> None:
        a, b = ranges[i]
        native.pack(sent.data, inp.elems(a, b), b - a, inp.dtype, wire)

    def unpack(i: int, got: Buf) -> None:
        a, b = ranges[i]
        for j in range(n):
            native.unpack(out.elems(j * k + a, j * k + b), got.data[j * slot:], b - a, out.dtype, wire)

    await _pipelined(leaders, len(ranges), slot, n * slot, pack,
                     lambda i, sent, got: leaders.flat_all_gather(got, sent), unpack)
