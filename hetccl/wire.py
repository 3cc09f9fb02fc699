"""Wire formats: control-plane frames (length-prefixed msgpack) and the data-frame header.

Control frames: 4-byte big-endian length, then a msgpack map. Lengths above a bound are refused before
anything is allocated; msgpack is decoded with its own size limits and never into arbitrary objects.

Data frames: a fixed 48-byte header, then `nbytes` of payload. The header carries the fingerprint of the
collective it belongs to (communicator id, sequence number, op, dtype, count, root, reduce op) so that
mismatched collectives are detected from the data itself, with no extra round trip.
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


def unpack_data_header(raw: bytes | memoryview, max_payload: int) -> tuple[Fingerprint, int, int]:
    """-> (fingerprint, tag, nbytes); ProtocolError for anything malformed or over max_payload."""
    if len(raw) != DATA_HEADER.size:
        raise ProtocolError(f"data header of {len(raw)} bytes, expected {DATA_HEADER.size}")
    (magic, version, kind, op, dtype, redop, _flags, comm, seq, root, _r, tag, count,
     nbytes) = DATA_HEADER.unpack(raw)
    if magic != DATA_MAGIC or version != DATA_VERSION or kind != KIND_DATA:
        raise ProtocolError(f"bad data header (magic {magic:#x}, version {version}, kind {kind})")
    if nbytes > max_payload:
        raise ProtocolError(f"data frame of {nbytes} bytes exceeds the bound {max_payload}")
    if op not in CollOp.NAMES or (dtype > 7 and dtype != 255) or (redop > 4 and redop != 255):
        raise ProtocolError(f"data header with unknown op {op}, dtype {dtype} or reduce op {redop}")
    return Fingerprint(comm, seq, op, dtype, count, root, redop), tag, nbytes


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
