"""The compressed wire formats of HETCCL_CROSS_COMPRESS made on the device, byte for byte those of the host's
codec (native/hetccl_native.h): bf16 or fp16 rounded to nearest even (overflow to inf), or fp8 e4m3 with a
power-of-two float32 scale per group of 1024 values, every group's scale first, then the one-byte codes.

A GPU leader packs what it sends and unpacks what it gets on its stream, so the host only moves bytes: the
host's codec runs at a few GB/s a core, below what the wire between hosts carries once compressed."""

from __future__ import annotations

import math
from typing import Any

from .runtime import torch_mod

BF16, FP16, FP8 = 1, 2, 3  # HCCL_WIRE_*
FP8_GROUP = 1024  # HCCL_FP8_GROUP
FP8_MAX = 448.0


def wire_size(count: int, wire: int) -> int:
    """Bytes of `count` packed values (hccl_wire_size)."""
    if wire == FP8:
        return 4 * -(-count // FP8_GROUP) + count
    return 2 * count


def pack(dst: Any, src: Any, wire: int) -> None:
    """dst (uint8, wire_size bytes) <- src's values (a contiguous float tensor), on the current stream."""
    torch = torch_mod()
    if dst.storage_offset() % 4:  # the host's layout puts a piece at any byte; torch views need aligned offsets
        aligned = torch.empty_like(dst)
        pack(aligned, src, wire)
        dst.copy_(aligned)
        return
    # the host codec widens to float32 first, float64 too
    pack_rows(_one_row(dst), src.reshape(1, -1).float(), wire)


def _one_row(t: Any) -> Any:
    """A flat uint8 tensor as one row (its row stride a multiple of 4, which torch's dtype views ask of every
    stride, though one row never steps by it)."""
    return t.as_strided((1, t.numel()), (-(-t.numel() // 4) * 4, 1))


def pack_rows(dst: Any, x: Any, wire: int) -> None:
    """Each row of x (rows x n, float32) packed at the start of the same row of dst (uint8, each row at least
    wire_size(n) bytes and 4-byte aligned): pack's operations once for every row, where packing row by row is a
    dozen kernel launches a row on the caller's thread (fp8)."""
    torch = torch_mod()
    rows, n = x.shape
    if wire != FP8:
        dst[:, :2 * n].view(torch.bfloat16 if wire == BF16 else torch.float16).copy_(x)
        return
    groups = -(-n // FP8_GROUP)
    if groups * FP8_GROUP != n:  # the last group padded with zeros, which change no group's largest magnitude
        x = torch.nn.functional.pad(x, (0, groups * FP8_GROUP - n))
    x = x.reshape(rows, groups, FP8_GROUP)
    amax = x.abs().nan_to_num_(0.0, 0.0, 0.0).amax(2)  # the largest finite magnitude of each group
    # its scale 2^k, k the least with 448 * 2^k >= amax, found exactly: amax = m * 2^e (m in [0.5, 1)) and
    # 448 = 0.875 * 2^9, so k = e - 9, or e - 8 where m > 0.875; made as float32 bits (biased exponent k + 127,
    # k within [-126, 127]: normal numbers), some eight small kernels fewer than through torch.ldexp
    m, e = torch.frexp(amax)
    biased = torch.where(amax > 0, e.add_(118).add_(m > FP8_MAX / 512), 127).clamp_(1, 254)
    bits = biased << 23
    dst[:, :4 * groups].view(torch.int32).copy_(bits)
    # x * 2^-k is what the host codec rounds (the same float32 product), and torch's cast to e4m3fn rounds to
    # nearest even. An infinity becomes the NaN code with its sign, as in hccl_f2e4m3: torch's cast saturates it
    # to 448 (torch 2.13), which would hand a gradient's overflow on as a finite value (GradScaler would miss it).
    # A NaN stays one, though not its sign (CUDA's arithmetic does not keep it either).
    inverse = ((254 << 23) - bits).view(torch.float32)  # 2^-k
    scaled = (x * inverse[:, :, None]).nan_to_num_(nan=math.nan, posinf=math.nan, neginf=-math.nan)
    dst[:, 4 * groups:4 * groups + n].view(torch.float8_e4m3fn).copy_(scaled.reshape(rows, -1)[:, :n])


def unpack(src: Any, count: int, wire: int) -> Any:
    """The `count` values packed in src (uint8, wire_size bytes) as a new float32 tensor, on the current stream
    (the host codec decodes to float32 too; the caller casts to its dtype)."""
    if src.storage_offset() % 4:  # see pack
        src = src[:wire_size(count, wire)].clone()
    return unpack_rows(_one_row(src[:wire_size(count, wire)]), count, wire)[0]


def unpack_rows(src: Any, count: int, wire: int) -> Any:
    """The `count` values packed at the start of each row of src (pack_rows' layout) as a new float32 tensor of
    rows x count."""
    torch = torch_mod()
    rows = src.shape[0]
    if wire != FP8:
        return src[:, :2 * count].view(torch.bfloat16 if wire == BF16 else torch.float16).float()
    groups = -(-count // FP8_GROUP)
    vals = src[:, 4 * groups:4 * groups + count].view(torch.float8_e4m3fn).float()
    if groups * FP8_GROUP != count:
        vals = torch.nn.functional.pad(vals, (0, groups * FP8_GROUP - count))
    scale = src[:, :4 * groups].view(torch.float32)
    return (vals.view(rows, groups, FP8_GROUP) * scale[:, :, None]).view(rows, -1)[:, :count]


def pack_slot(dst: Any, src: Any, wire: int) -> None:
    """src packed at the start of dst (a slot of the host's compressed all_gather or reduce_scatter, which may
    be longer than src packed), the rest zeroed: a short last piece's unused bytes cross as zeros."""
    used = wire_size(src.numel(), wire)
    pack(dst[:used], src, wire)
    dst[used:].zero_()


def unpack_slot(src: Any, count: int, wire: int) -> Any:
    """The `count` values packed at the start of slot src (unpack)."""
    return unpack(src[:wire_size(count, wire)], count, wire)


def _segments(count: int, wire: int, blocks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first value, end, byte offset) of each packed segment of `count` values split in `blocks` (fp8's groups
    restart at each block, as the host codec packs block by block): one segment where that changes nothing."""
    whole = wire != FP8 or all(a % FP8_GROUP == 0 for a, _ in blocks)
    spans = [(0, count)] if whole else blocks
    out, at = [], 0
    for a, z in spans:
        out.append((a, z, at))
        at += -(-wire_size(z - a, wire) // 16) * 16  # 16-byte aligned: the scales are read as float32
    return out


def packed_size(count: int, wire: int, blocks: list[tuple[int, int]]) -> int:
    """Bytes pack_blocks writes for `count` values split in `blocks`."""
    a, z, at = _segments(count, wire, blocks)[-1]
    return at + -(-wire_size(z - a, wire) // 16) * 16


def pack_blocks(dst: Any, src: Any, wire: int, blocks: list[tuple[int, int]]) -> None:
    """dst (uint8, packed_size bytes) <- the flat tensor src, each block's values as the host codec packs them."""
    for a, z, at in _segments(src.numel(), wire, blocks):
        pack(dst[at:at + wire_size(z - a, wire)], src[a:z], wire)


def unpack_blocks(src: Any, count: int, wire: int, blocks: list[tuple[int, int]]) -> Any:
    """The `count` values pack_blocks packed into src, as a new float32 tensor."""
    parts = [unpack(src[at:at + wire_size(z - a, wire)], z - a, wire) for a, z, at in _segments(count, wire, blocks)]
    return parts[0] if len(parts) == 1 else torch_mod().cat(parts)


def round_trip(t: Any, wire: int, pieces: list[tuple[int, int]], k: int) -> Any:
    """t's values as the first hop of a compressed all_reduce among k leaders carries them (compress.round_trip's
    device twin): each piece (element ranges) packed in k blocks and unpacked, in t's dtype."""
    torch = torch_mod()
    flat = t.reshape(-1)
    out = torch.empty_like(flat)
    for lo, hi in pieces:
        blocks = leader_blocks(hi - lo, k)
        buf = torch.empty(packed_size(hi - lo, wire, blocks), dtype=torch.uint8, device=t.device)
        pack_blocks(buf, flat[lo:hi], wire, blocks)
        out[lo:hi].copy_(unpack_blocks(buf, hi - lo, wire, blocks))
    return out.view_as(t)


def leader_blocks(count: int, k: int) -> list[tuple[int, int]]:
    """The k blocks of a chunk of `count` values, here and in compress.py: a leader's values cross in these."""
    blk = -(-count // k)
    return [(min(j * blk, count), min((j + 1) * blk, count)) for j in range(k)]


class LeaderChunks:
    """The device side of a compressed all_reduce among k GPU leaders, chunk by chunk: each leader packs its
    chunk (in k blocks, as compress.round_trip reads them) and sends those bytes to every other leader (an
    all_gather through host memory), and each unpacks the k leaders' chunks and reduces them in leader order,
    so that every leader computes the same bits and the host does no arithmetic. `chunks`: element ranges."""

    def __init__(self, chunks: list[tuple[int, int]], k: int, wire: int):
        self.chunks, self.k, self.wire = chunks, k, wire
        self.blocks = [leader_blocks(hi - lo, k) for lo, hi in chunks]
        self.sizes = [packed_size(hi - lo, wire, b) for (lo, hi), b in zip(chunks, self.blocks, strict=True)]
        self.starts = [sum(self.sizes[:j]) for j in range(len(chunks))]  # in the packed buffer of one leader
        self.total = sum(self.sizes)

    def _rows(self, j0: int, j1: int) -> int:
        """How many of chunks j0 .. j1 - 1, from j0, pack as rows (pack_rows): chunks of the first one's length
        packed in one segment (fp8's groups not restarting inside)."""
        lo, hi = self.chunks[0]
        if len(_segments(hi - lo, self.wire, self.blocks[0])) != 1:
            return 0
        return sum(1 for j in range(j0, j1) if self.chunks[j][1] - self.chunks[j][0] == hi - lo)

    def pack(self, dst: Any, flat: Any) -> None:
        """dst (uint8, total bytes) <- every chunk of flat packed, on the current stream: the chunks of equal
        length as rows, in one pass."""
        rows = self._rows(0, len(self.chunks)) if dst.storage_offset() % 4 == 0 else 0
        if rows > 1:
            n, size = self.chunks[0][1] - self.chunks[0][0], self.sizes[0]
            pack_rows(dst[:rows * size].view(rows, size), flat[:rows * n].view(rows, n).float(), self.wire)
        else:
            rows = 0
        for (lo, hi), blocks, at, size in zip(self.chunks[rows:], self.blocks[rows:], self.starts[rows:],
                                              self.sizes[rows:], strict=True):
            pack_blocks(dst[at:at + size], flat[lo:hi], self.wire, blocks)

    def reduce(self, j: int, flat: Any, every: Any, op: Any, reduce_inplace: Any) -> None:
        """flat's chunk j <- the reduction (op, in flat's dtype, in leader order) of the k leaders' packed chunks
        (every: uint8, k * sizes[j] bytes, leader r's at r * sizes[j]), on the current stream."""
        (lo, hi), size, blocks = self.chunks[j], self.sizes[j], self.blocks[j]
        dst = flat[lo:hi]
        for r in range(self.k):
            got = unpack_blocks(every[r * size:(r + 1) * size], hi - lo, self.wire, blocks)
            if r == 0:
                dst.copy_(got)
            else:
                reduce_inplace(dst, got.to(dst.dtype), op)

    def reduce_span(self, j0: int, j1: int, flat: Any, scratch: Any, op: Any, reduce_inplace: Any) -> None:
        """reduce() of chunks j0 .. j1 - 1, whose k packed blocks lie in scratch (uint8) from (j - j0) * k *
        sizes[0] bytes: the chunks of equal length unpacked and reduced as rows, the same arithmetic in one pass
        (a few kernels, where chunk by chunk took a few per leader and chunk)."""
        rows = self._rows(j0, j1) if scratch.storage_offset() % 4 == 0 else 0
        step = self.k * self.sizes[0]
        if rows > 1:
            n, size = self.chunks[j0][1] - self.chunks[j0][0], self.sizes[0]
            got = unpack_rows(scratch[:rows * step].view(rows * self.k, size), n, self.wire).reshape(rows, self.k, n)
            lo = self.chunks[j0][0]
            dst = flat[lo:lo + rows * n].view(rows, n)
            dst.copy_(got[:, 0])
            for r in range(1, self.k):
                reduce_inplace(dst, got[:, r].to(dst.dtype), op)
        else:
            rows = 0
        for j in range(j0 + rows, j1):
            self.reduce(j, flat, scratch[(j - j0) * step:], op, reduce_inplace)


def _rows_fit(t: Any, slot: int) -> bool:
    """Whether slots of `slot` bytes from t's start can be viewed as rows for pack_rows / unpack_rows."""
    return slot % 4 == 0 and t.storage_offset() % 4 == 0


def pack_pieces(sent: Any, src: Any, pieces: list[tuple[int, int]], slot: int, n: int, block: int,
                wire: int) -> None:
    """The send side of the host's compressed all_gather (n = 1) and reduce_scatter (n blocks of `block`
    elements, one per leader) on the device: piece i of block j packed into slot i * n + j of `sent`; the
    pieces of full length as rows, one pass a block."""
    p = pieces[0][1] - pieces[0][0]
    full = sum(1 for a, b in pieces if b - a == p) if _rows_fit(sent, slot) and wire_size(p, wire) == slot else 0
    if full > 1:
        every = sent[:full * n * slot].view(full, n, slot)
        for j in range(n):
            pack_rows(every[:, j], src[j * block:j * block + full * p].view(full, p).float(), wire)
    else:
        full = 0
    for i, (a, b) in enumerate(pieces[full:], start=full):
        for j in range(n):
            at = (i * n + j) * slot
            pack_slot(sent[at:at + slot], src[j * block + a:j * block + b], wire)


def _unpacked_slots(got: Any, pieces: list[tuple[int, int]], slot: int, n: int, i: int, wire: int) -> Any:
    """The n slots of piece i (i * n .. i * n + n - 1 of `got`) unpacked as rows (n x its length, float32), or
    None where they cannot be viewed as rows."""
    a, b = pieces[i]
    rows = got[i * n * slot:(i + 1) * n * slot]
    if not _rows_fit(rows, slot):
        return None
    return unpack_rows(rows.view(n, slot), b - a, wire)


def unpack_piece(every: Any, got: Any, pieces: list[tuple[int, int]], slot: int, n: int, block: int, i: int,
                 wire: int) -> None:
    """Piece i of every leader's block (slots i * n + j of `got`) unpacked into `every` (n blocks of `block`
    elements): an all_gather's receive side, this leader's own block too, so that every leader holds the same
    bits."""
    a, b = pieces[i]
    vals = _unpacked_slots(got, pieces, slot, n, i, wire)
    if vals is not None:
        every[:n * block].view(n, block)[:, a:b].copy_(vals)
        return
    for j in range(n):
        at = (i * n + j) * slot
        every[j * block + a:j * block + b].copy_(unpack_slot(got[at:at + slot], b - a, wire))


def reduce_piece(region: Any, got: Any, pieces: list[tuple[int, int]], slot: int, n: int, i: int, wire: int,
                 reduce: Any) -> None:
    """Piece i of this leader's block, as each leader packed it (slots i * n + j of `got`), reduced into
    `region` in leader order (reduce(dst, src) in place): a reduce_scatter's receive side."""
    a, b = pieces[i]
    dst = region[a:b]
    rows = _unpacked_slots(got, pieces, slot, n, i, wire)
    for j in range(n):
        if rows is not None:
            vals = rows[j].to(dst.dtype)
        else:
            at = (i * n + j) * slot
            vals = unpack_slot(got[at:at + slot], b - a, wire).to(dst.dtype)
        if j == 0:
            dst.copy_(vals)
        else:
            reduce(dst, vals)
