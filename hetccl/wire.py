"""Wire formats: control-plane frames (length-prefixed msgpack) and the data-frame header.

Control frames: 4-byte big-endian length, then a msgpack map. Lengths above a bound are refused before
anything is allocated; msgpack is decoded with its own size limits and never into arbitrary objects.

Data frames: a fixed 48-byte header, then `nbytes` of payload. The header carries the fingerprint of the
collective it belongs to (communicator id, sequence number, op, dtype, count, root, reduce op) so that
mismatched collectives are detected from the data itself, with no extra round trip.

Fragment frames (kind 2, TCP with several connections per peer): one message of `nbytes` cut into `parts`
pieces (the flags byte), sent on different connections; the reserved field is the piece's index. Where a
piece starts and how long it is follows from (nbytes, parts, index) alone (`fragment_span`), so the
header stays 48 bytes and a receiver checks every piece against the message it belongs to.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgpack

from .errors import ProtocolError

CONTROL_LEN = struct.Struct(">I")
DEFAULT_MAX_CONTROL_BYTES = 1 << 20

DATA_MAGIC = 0x4843  # "HC"
DATA_VERSION = 1
# magic, version, kind, op, dtype, redop, flags, comm, seq, root, reserved, tag, count, nbytes
DATA_HEADER = struct.Struct("<HBBBBBBIIiIQQQ")
assert DATA_HEADER.size == 48
KIND_DATA = 1
KIND_FRAGMENT = 2
MAX_FRAGMENTS = 64  # pieces of one message at most (one per connection: config.MAX_SOCKET_NSTREAMS)
FRAGMENT_ALIGN = 4096  # pieces start on multiples of this (whole elements of every dtype; page-aligned)


class CollOp:
    """Collective op codes carried in data headers (also used in error messages)."""

    ALL_REDUCE = 1
    ALL_GATHER = 2
    REDUCE_SCATTER = 3
    BROADCAST = 4
    REDUCE = 5
    ALL_TO_ALL = 6
    GATHER = 7
    SCATTER = 8
    SEND_RECV = 9
    BARRIER = 10

    NAMES = {1: "all_reduce", 2: "all_gather", 3: "reduce_scatter", 4: "broadcast", 5: "reduce",
             6: "all_to_all", 7: "gather", 8: "scatter", 9: "send/recv", 10: "barrier"}


class Fingerprint(NamedTuple):
    """What every rank must agree on for one collective."""

    comm: int
    seq: int
    op: int
    dtype: int
    count: int
    root: int = -1
    redop: int = 255

    def describe(self) -> str:
        from .dtypes import DType, ReduceOp, dtype_name

        parts = [f"{CollOp.NAMES.get(self.op, self.op)} #{self.seq}"]
        if self.dtype != 255:
            parts.append(f"dtype={dtype_name(DType(self.dtype)) if 0 <= self.dtype <= 7 else self.dtype}")
        parts.append(f"count={self.count}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        if self.redop != 255:
            parts.append(f"op={ReduceOp(self.redop).name.lower() if 0 <= self.redop <= 4 else self.redop}")
        return " ".join(parts)


def pack_data_header(fp: Fingerprint, tag: int, nbytes: int, flags: int = 0) -> bytes:
    return DATA_HEADER.pack(DATA_MAGIC, DATA_VERSION, KIND_DATA, fp.op, fp.dtype, fp.redop, flags,
                            fp.comm, fp.seq, fp.root, 0, tag, fp.count, nbytes)


def pack_fragment_header(fp: Fingerprint, tag: int, nbytes: int, part: int, parts: int) -> bytes:
    """The header of piece `part` of `parts` of a message of `nbytes` (its payload: fragment_span)."""
    return DATA_HEADER.pack(DATA_MAGIC, DATA_VERSION, KIND_FRAGMENT, fp.op, fp.dtype, fp.redop, parts,
                            fp.comm, fp.seq, fp.root, part, tag, fp.count, nbytes)


def fragment_span(nbytes: int, parts: int, part: int) -> tuple[int, int]:
    """(offset, length) of piece `part` when `nbytes` are cut into `parts` pieces of equal, aligned size (the
    last one shorter); length 0 for an index past the last non-empty piece."""
    even = -(-nbytes // parts)  # ceiling division
    size = -(-even // FRAGMENT_ALIGN) * FRAGMENT_ALIGN
    offset = min(part * size, nbytes)
    return offset, min(size, nbytes - offset)


def fragment_count(nbytes: int, parts: int) -> int:
    """How many pieces of fragment_span(nbytes, parts, i) are non-empty (pieces are sent only for these)."""
    size = fragment_span(nbytes, parts, 0)[1]
    return -(-nbytes // size) if size else 0


def unpack_frame_header(raw: bytes | memoryview, max_payload: int,
                        kinds: tuple[int, ...] = (KIND_DATA, KIND_FRAGMENT)
                        ) -> tuple[Fingerprint, int, int, int, int]:
    """A data or fragment header -> (fingerprint, tag, message nbytes, piece index, pieces); a whole message
    is piece 0 of 1. ProtocolError for anything malformed, over max_payload, a kind not in `kinds`, or a piece
    outside its message."""
    if len(raw) != DATA_HEADER.size:
        raise ProtocolError(f"data header of {len(raw)} bytes, expected {DATA_HEADER.size}")
    (magic, version, kind, op, dtype, redop, flags, comm, seq, root, part, tag, count,
     nbytes) = DATA_HEADER.unpack(raw)
    if magic != DATA_MAGIC or version != DATA_VERSION or kind not in kinds:
        raise ProtocolError(f"bad data header (magic {magic:#x}, version {version}, kind {kind})")
    if nbytes > max_payload:
        raise ProtocolError(f"data frame of {nbytes} bytes exceeds the bound {max_payload}")
    if op not in CollOp.NAMES or (dtype > 7 and dtype != 255) or (redop > 4 and redop != 255):
        raise ProtocolError(f"data header with unknown op {op}, dtype {dtype} or reduce op {redop}")
    parts = 1
    if kind == KIND_FRAGMENT:
        parts = flags
        if not 2 <= parts <= MAX_FRAGMENTS or part >= fragment_count(nbytes, parts):
            raise ProtocolError(f"fragment {part} of {parts} of a {nbytes}-byte message is out of range")
    return Fingerprint(comm, seq, op, dtype, count, root, redop), tag, nbytes, part, parts


def unpack_data_header(raw: bytes | memoryview, max_payload: int) -> tuple[Fingerprint, int, int]:
    """A whole-message header -> (fingerprint, tag, nbytes); ProtocolError for anything malformed, over
    max_payload, or a fragment (only TCP sends those, and reads them with unpack_frame_header)."""
    fp, tag, nbytes, _part, _parts = unpack_frame_header(raw, max_payload, (KIND_DATA,))
    return fp, tag, nbytes


def encode_control(obj: dict[str, Any], max_bytes: int = DEFAULT_MAX_CONTROL_BYTES) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > max_bytes:
        raise ProtocolError(f"control frame of {len(body)} bytes exceeds the bound {max_bytes}")
    return CONTROL_LEN.pack(len(body)) + body


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("msgpack extension types are not accepted")


def decode_control_body(body: bytes, max_bytes: int = DEFAULT_MAX_CONTROL_BYTES) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True,
                              max_str_len=max_bytes, max_bin_len=max_bytes, max_array_len=1 << 16,
                              max_map_len=1 << 16, max_ext_len=0, ext_hook=_no_ext)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable control frame: {exc.__class__.__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("control frame is not a map")
    return obj


def control_length(prefix: bytes, max_bytes: int = DEFAULT_MAX_CONTROL_BYTES) -> int:
    (n,) = CONTROL_LEN.unpack(prefix)
    if n > max_bytes:
        raise ProtocolError(f"control frame announces {n} bytes, over the bound {max_bytes}")
    return n
