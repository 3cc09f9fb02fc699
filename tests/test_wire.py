"""Wire formats: the 48-byte data header and the length-prefixed msgpack control frames.

Everything here runs the real encoders/decoders; the fuzz cases check that hostile bytes only ever end in
a ProtocolError (or a plain dict), never in another exception type and never in arbitrary objects.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import tracemalloc
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetccl
from hetccl.dtypes import DType, ReduceOp, dtype_name
from hetccl.errors import HetcclError, ProtocolError
from hetccl.netio import read_control, write_control
from hetccl.wire import (
    CONTROL_LEN,
    DATA_HEADER,
    DATA_MAGIC,
    DATA_VERSION,
    DEFAULT_MAX_CONTROL_BYTES,
    KIND_DATA,
    CollOp,
    Fingerprint,
    control_length,
    decode_control_body,
    encode_control,
    pack_data_header,
    unpack_data_header,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

U8 = st.integers(0, 0xFF)
U32 = st.integers(0, 0xFFFF_FFFF)
I32 = st.integers(-(1 << 31), (1 << 31) - 1)
U64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)

fingerprints = st.builds(Fingerprint, comm=U32, seq=U32, op=st.sampled_from(sorted(CollOp.NAMES)),
                         dtype=st.sampled_from([*range(8), 255]), count=U64, root=I32,
                         redop=st.sampled_from([*range(5), 255]))


# --------------------------------------------------------------------------------------------- data header


def test_header_is_48_bytes() -> None:
    assert DATA_HEADER.size == 48
    raw = pack_data_header(Fingerprint(1, 2, CollOp.ALL_REDUCE, DType.FLOAT32, 10, -1, ReduceOp.SUM), 7, 40)
    assert isinstance(raw, bytes) and len(raw) == 48


@FUZZ
@given(fp=fingerprints, tag=U64, nbytes=U64, flags=U8, slack=U64)
def test_header_round_trip(fp: Fingerprint, tag: int, nbytes: int, flags: int, slack: int) -> None:
    raw = pack_data_header(fp, tag, nbytes, flags)
    assert len(raw) == DATA_HEADER.size
    bound = min(nbytes + slack, 0xFFFF_FFFF_FFFF_FFFF)
    got_fp, got_tag, got_n = unpack_data_header(raw, bound)
    assert got_fp == fp
    assert isinstance(got_fp, Fingerprint)
    assert (got_tag, got_n) == (tag, nbytes)
    # a memoryview decodes the same as bytes (the TCP reader hands a bytearray)
    assert unpack_data_header(memoryview(bytearray(raw)), bound) == (fp, tag, nbytes)


def test_header_nbytes_exactly_at_bound_is_accepted() -> None:
    fp = Fingerprint(3, 4, CollOp.BROADCAST, DType.INT8, 100, 0)
    assert unpack_data_header(pack_data_header(fp, 0, 100), 100)[2] == 100
    assert unpack_data_header(pack_data_header(fp, 0, 0), 0)[2] == 0


@FUZZ
@given(fp=fingerprints, bound=st.integers(0, (1 << 64) - 2), extra=st.integers(1, 1 << 40))
def test_header_nbytes_over_bound_rejected(fp: Fingerprint, bound: int, extra: int) -> None:
    nbytes = min(bound + extra, (1 << 64) - 1)
    with pytest.raises(ProtocolError, match="exceeds the bound"):
        unpack_data_header(pack_data_header(fp, 1, nbytes), bound)


@pytest.mark.parametrize("size", [0, 1, 4, 47, 49, 64, 96])
def test_header_wrong_size_rejected(size: int) -> None:
    raw = (pack_data_header(Fingerprint(1, 1, 1, 6, 1), 0, 4) * 3)[:size]
    with pytest.raises(ProtocolError, match=f"{size} bytes"):
        unpack_data_header(raw, 1 << 20)


def _with_fields(magic: int = DATA_MAGIC, version: int = DATA_VERSION, kind: int = KIND_DATA) -> bytes:
    return DATA_HEADER.pack(magic, version, kind, 1, 6, 0, 0, 1, 1, -1, 0, 0, 1, 4)


def test_header_good_fields_decode() -> None:
    fp, tag, n = unpack_data_header(_with_fields(), 16)
    assert fp == Fingerprint(1, 1, 1, 6, 1, -1, 0) and tag == 0 and n == 4


@FUZZ
@given(magic=st.integers(0, 0xFFFF).filter(lambda m: m != DATA_MAGIC))
def test_header_bad_magic_rejected(magic: int) -> None:
    with pytest.raises(ProtocolError, match="bad data header"):
        unpack_data_header(_with_fields(magic=magic), 1 << 20)


@FUZZ
@given(version=U8.filter(lambda v: v != DATA_VERSION))
def test_header_bad_version_rejected(version: int) -> None:
    with pytest.raises(ProtocolError, match="bad data header"):
        unpack_data_header(_with_fields(version=version), 1 << 20)


@FUZZ
@given(kind=U8.filter(lambda k: k != KIND_DATA))
def test_header_bad_kind_rejected(kind: int) -> None:
    with pytest.raises(ProtocolError, match="bad data header"):
        unpack_data_header(_with_fields(kind=kind), 1 << 20)


@FUZZ
@given(raw=st.binary(min_size=48, max_size=48), bound=U64)
def test_header_random_bytes_never_crash(raw: bytes, bound: int) -> None:
    try:
        fp, tag, n = unpack_data_header(raw, bound)
    except ProtocolError:
        return
    assert raw[:2] == struct.pack("<H", DATA_MAGIC)
    assert n <= bound and isinstance(fp, Fingerprint)


def test_header_is_little_endian_and_field_order() -> None:
    fp = Fingerprint(comm=0x01020304, seq=0x05060708, op=9, dtype=7, count=0x1122, root=-2, redop=3)
    raw = pack_data_header(fp, tag=0xAABB, nbytes=0x3344, flags=0x55)
    assert raw[:2] == b"\x43\x48"  # "HC" little-endian 0x4843
    assert raw[2] == DATA_VERSION and raw[3] == KIND_DATA
    assert raw[4:8] == bytes([9, 7, 3, 0x55])  # op, dtype, redop, flags
    assert raw[8:12] == (0x01020304).to_bytes(4, "little")
    assert raw[16:20] == (-2).to_bytes(4, "little", signed=True)


# --------------------------------------------------------------------------------------------- fingerprints


@pytest.mark.parametrize("op", sorted(CollOp.NAMES))
@pytest.mark.parametrize("dtype", list(DType))
def test_fingerprint_describe_readable(op: int, dtype: DType) -> None:
    text = Fingerprint(comm=1, seq=17, op=op, dtype=dtype, count=1024, root=2, redop=ReduceOp.MAX).describe()
    assert text.startswith(f"{CollOp.NAMES[op]} #17")
    assert f"dtype={dtype_name(dtype)}" in text
    assert "count=1024" in text and "root=2" in text and "op=max" in text


def test_fingerprint_describe_omits_defaults() -> None:
    text = Fingerprint(comm=1, seq=3, op=CollOp.BARRIER, dtype=255, count=0).describe()
    assert text == "barrier #3 count=0"
    text = Fingerprint(1, 5, CollOp.ALL_REDUCE, DType.BFLOAT16, 8, -1, ReduceOp.AVG).describe()
    assert text == "all_reduce #5 dtype=bfloat16 count=8 op=avg"
    # an unknown op code is shown as its number rather than failing
    assert Fingerprint(1, 1, 200, 255, 1).describe().startswith("200 #1")


@pytest.mark.parametrize("op,dtype,redop", [(1, 200, 9), (0, 6, 0), (99, 6, 0), (1, 8, 255), (1, 6, 5)])
def test_unknown_codes_are_refused_by_the_header_decoder(op: int, dtype: int, redop: int) -> None:
    raw = DATA_HEADER.pack(DATA_MAGIC, DATA_VERSION, KIND_DATA, op, dtype, redop, 0, 1, 1, -1, 0, 0, 1, 4)
    with pytest.raises(ProtocolError, match="unknown"):
        unpack_data_header(raw, 16)
    # and describing such a fingerprint (error paths) never raises
    assert isinstance(Fingerprint(1, 1, op, dtype, 1, -1, redop).describe(), str)


# --------------------------------------------------------------------------------------------- control frames

keys = st.text(max_size=12)
leaves = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
          | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(keys, inner, max_size=5),
                      max_leaves=25)
control_maps = st.dictionaries(keys, values, max_size=8)


@FUZZ
@given(obj=control_maps)
def test_control_round_trip(obj: dict) -> None:
    frame = encode_control(obj)
    (n,) = CONTROL_LEN.unpack(frame[:4])
    assert n == len(frame) - 4
    assert control_length(frame[:4]) == n
    assert decode_control_body(frame[4:]) == obj


def test_control_round_trip_binary_and_nested() -> None:
    obj = {"nonce": b"\x00" * 32, "meta": {"rank": 3, "hosts": ["a", "b"]}, "f": 1.5, "none": None}
    assert decode_control_body(encode_control(obj)[4:]) == obj
    assert isinstance(decode_control_body(encode_control(obj)[4:])["nonce"], bytes)


def test_encode_control_refuses_over_bound() -> None:
    obj = {"blob": b"x" * 5000}
    assert len(encode_control(obj, max_bytes=6000)) > 5000
    with pytest.raises(ProtocolError, match="exceeds the bound"):
        encode_control(obj, max_bytes=4096)


@FUZZ
@given(n=U32, bound=st.integers(0, 1 << 31))
def test_control_length_bound(n: int, bound: int) -> None:
    prefix = CONTROL_LEN.pack(n)
    if n <= bound:
        assert control_length(prefix, bound) == n
    else:
        with pytest.raises(ProtocolError, match="over the bound"):
            control_length(prefix, bound)


def test_control_length_default_bound() -> None:
    assert control_length(CONTROL_LEN.pack(DEFAULT_MAX_CONTROL_BYTES)) == DEFAULT_MAX_CONTROL_BYTES
    with pytest.raises(ProtocolError):
        control_length(CONTROL_LEN.pack(DEFAULT_MAX_CONTROL_BYTES + 1))
    with pytest.raises(ProtocolError):
        control_length(b"\xff\xff\xff\xff")


async def test_read_control_refuses_huge_length_before_allocating() -> None:
    """Only the 4-byte prefix is sent: a reader that allocated or waited for the body would hang or
    allocate 4 GiB; the real one must fail at once with ProtocolError, allocating next to nothing."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        b.sendall(b"\xff\xff\xff\xff")
        tracemalloc.start()
        try:
            with pytest.raises(ProtocolError, match="over the bound"):
                await asyncio.wait_for(read_control(loop, a, 1 << 20), 5)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20
    finally:
        a.close()
        b.close()


async def test_read_write_control_over_socketpair() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        msgs = [{"i": i, "blob": bytes(range(256)) * i} for i in range(20)]
        for m in msgs:
            await write_control(loop, a, m, 1 << 20)
        for m in msgs:
            assert await read_control(loop, b, 1 << 20) == m
        # a frame over the reader's bound is refused on the length alone
        await write_control(loop, a, {"blob": b"y" * 3000}, 1 << 20)
        with pytest.raises(ProtocolError):
            await read_control(loop, b, 1024)
    finally:
        a.close()
        b.close()


def _assert_dict_or_protocol_error(body: bytes, max_bytes: int = DEFAULT_MAX_CONTROL_BYTES) -> dict | None:
    try:
        out = decode_control_body(body, max_bytes)
    except ProtocolError:
        return None
    # any other exception type propagates and fails the test
    assert isinstance(out, dict)
    assert all(isinstance(k, str | bytes) for k in out)
    return out


@FUZZ
@given(body=st.binary(max_size=512))
def test_decode_random_bytes(body: bytes) -> None:
    _assert_dict_or_protocol_error(body)


@FUZZ
@given(body=st.binary(max_size=64), max_bytes=st.integers(0, 64))
def test_decode_random_bytes_small_bound(body: bytes, max_bytes: int) -> None:
    _assert_dict_or_protocol_error(body, max_bytes)


# msgpack type bytes that announce lengths/containers: makes random streams reach deeper decoder paths
_MARKERS = [0x80, 0x81, 0x8F, 0x90, 0x91, 0x9F, 0xA0, 0xA5, 0xBF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC5, 0xC6,
            0xC7, 0xC8, 0xC9, 0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD5, 0xD6,
            0xD7, 0xD8, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF, 0x7F, 0x00]
tokens = st.one_of(st.sampled_from(_MARKERS).map(lambda b: bytes([b])), st.binary(min_size=1, max_size=6))


@FUZZ
@given(parts=st.lists(tokens, max_size=40), lead=st.sampled_from([b"", b"\x81", b"\x82", b"\xde\x00\x02"]))
def test_decode_msgpack_shaped_garbage(parts: list[bytes], lead: bytes) -> None:
    _assert_dict_or_protocol_error(lead + b"".join(parts))


@FUZZ
@given(obj=control_maps, data=st.data())
def test_decode_truncated_and_mutated_frames(obj: dict, data: st.DataObject) -> None:
    body = encode_control(obj)[4:]
    cut = data.draw(st.integers(0, len(body)))
    out = _assert_dict_or_protocol_error(body[:cut])
    if cut < len(body):
        # a strict prefix of a single msgpack object never decodes as a complete map
        assert out is None
    else:
        assert out == obj
    if body:
        pos = data.draw(st.integers(0, len(body) - 1))
        byte = data.draw(U8)
        _assert_dict_or_protocol_error(body[:pos] + bytes([byte]) + body[pos + 1:])


@pytest.mark.parametrize("payload", [None, 0, -1, 1 << 63, 1.5, True, "text", b"bytes", [], [1, 2],
                                     [{"a": 1}], ""])
def test_decode_non_map_payload_rejected(payload: object) -> None:
    body = msgpack.packb(payload, use_bin_type=True)
    with pytest.raises(ProtocolError, match="not a map"):
        decode_control_body(body)


def test_decode_empty_and_trailing_data_rejected() -> None:
    with pytest.raises(ProtocolError):
        decode_control_body(b"")
    good = msgpack.packb({"a": 1})
    with pytest.raises(ProtocolError):
        decode_control_body(good + good)


@pytest.mark.parametrize("key", [1, -5, 1.5, None, True])
def test_decode_non_string_map_keys_rejected(key: object) -> None:
    with pytest.raises(ProtocolError):
        decode_control_body(msgpack.packb({key: 1}, use_bin_type=True, strict_types=False))


def test_decode_unhashable_map_key_rejected() -> None:
    body = b"\x81" + b"\x91\x01" + b"\x01"  # {[1]: 1}
    with pytest.raises(ProtocolError):
        decode_control_body(body)
    body = b"\x81" + b"\x81\xa1a\x01" + b"\x01"  # {{"a": 1}: 1}
    with pytest.raises(ProtocolError):
        decode_control_body(body)


@pytest.mark.parametrize("depth", [100, 2000, 100_000])
def test_decode_deeply_nested_arrays(depth: int) -> None:
    body = b"\x81\xa1a" + b"\x91" * depth + b"\xc0"  # {"a": [[[...[nil]...]]]}
    _assert_dict_or_protocol_error(body)
    if depth >= 2000:
        with pytest.raises(ProtocolError):
            decode_control_body(body)


@pytest.mark.parametrize("depth", [100, 2000, 100_000])
def test_decode_deeply_nested_maps(depth: int) -> None:
    body = b"\x81\xa1a" * depth + b"\xc0"  # {"a": {"a": ... nil}}
    out = _assert_dict_or_protocol_error(body)
    if depth >= 2000:
        assert out is None


@pytest.mark.parametrize("body", [
    b"\x81\xa1a\xdd\xff\xff\xff\xff",  # array32 announcing 4G elements, none present
    b"\x81\xa1a\xdf\xff\xff\xff\xff",  # map32 announcing 4G pairs
    b"\x81\xa1a\xdb\xff\xff\xff\xff",  # str32 announcing 4 GiB
    b"\x81\xa1a\xc6\xff\xff\xff\xff",  # bin32 announcing 4 GiB
    b"\x81\xa1a\xc9\xff\xff\xff\xff\x01",  # ext32 announcing 4 GiB
    b"\xdf\xff\xff\xff\xff",  # top-level map32 announcing 4G pairs
    b"\x81\xa1a\xdc\x00\x10",  # array16 of 16 elements, none present
])
def test_decode_oversized_announcements_rejected(body: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            decode_control_body(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_decode_array_and_map_length_limits() -> None:
    n = (1 << 16) + 1
    big_array = b"\x81\xa1a\xdd" + n.to_bytes(4, "big") + b"\xc0" * n
    with pytest.raises(ProtocolError):
        decode_control_body(big_array)
    ok_array = b"\x81\xa1a\xdd" + (1 << 16).to_bytes(4, "big") + b"\xc0" * (1 << 16)
    assert len(decode_control_body(ok_array)["a"]) == 1 << 16
    big_map = b"\xdf" + n.to_bytes(4, "big") + b"".join(
        b"\xa5" + f"{i:05d}".encode() + b"\xc0" for i in range(n))
    with pytest.raises(ProtocolError):
        decode_control_body(big_map, max_bytes=1 << 24)


def test_decode_string_and_bin_over_bound_rejected() -> None:
    body = msgpack.packb({"s": "x" * 200}, use_bin_type=True)
    assert decode_control_body(body, 200) == {"s": "x" * 200}
    with pytest.raises(ProtocolError):
        decode_control_body(body, 199)
    body = msgpack.packb({"b": b"x" * 200}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode_control_body(body, 199)


def test_decode_invalid_utf8_rejected() -> None:
    with pytest.raises(ProtocolError):
        decode_control_body(b"\x81\xa1a\xa2\xff\xfe")
    with pytest.raises(ProtocolError):
        decode_control_body(b"\x81\xa2\xc3\x28\x01")  # invalid utf-8 in a key


@pytest.mark.parametrize("ext", [
    b"\xd4\x01x",  # fixext1, type 1
    b"\xd8\x05" + b"\x00" * 16,  # fixext16, type 5
    b"\xd6\xff" + b"\x00" * 4,  # timestamp32 (type -1)
    b"\xd7\xff" + b"\x00" * 8,  # timestamp64
    b"\xc7\x0c\xff" + b"\x00" * 12,  # timestamp96
    b"\xc7\x05\xff" + b"\x00" * 5,  # timestamp with an invalid length
    b"\xc7\x17\x2a" + b"\x80\x04\x95" + b"pickle-looking bytes",  # ext8, type 42
    b"\xc8\x01\x2c\x7f" + b"y" * 300,  # ext16, type 127
    b"\xc9\x00\x00\x00\x03\x80abc",  # ext32, type -128
])
def test_decode_ext_types_rejected(ext: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_control_body(b"\x81\xa1v" + ext)  # {"v": ext}
    with pytest.raises(ProtocolError):
        decode_control_body(b"\x81\xa1v\x92\x01\x81\xa1w" + ext)  # {"v": [1, {"w": ext}]}


def test_decode_zero_length_ext_rejected() -> None:
    body = b"\x81\xa1a\xc7\x00\x05"  # {"a": ext8(type 5, b"")}
    with pytest.raises(ProtocolError):
        decode_control_body(body)


@FUZZ
@given(code=st.integers(-128, 127), payload=st.binary(min_size=1, max_size=300))
def test_decode_any_ext_with_payload_rejected(code: int, payload: bytes) -> None:
    ext = bytes([0xC7, len(payload)]) if len(payload) < 256 else b"\xc8" + len(payload).to_bytes(2, "big")
    body = b"\x81\xa1v" + ext + code.to_bytes(1, "big", signed=True) + payload
    with pytest.raises(ProtocolError):
        decode_control_body(body)


def test_protocol_error_is_hetccl_error_and_exported() -> None:
    assert issubclass(ProtocolError, HetcclError)
    assert hetccl.ProtocolError is ProtocolError


def test_no_module_uses_pickle() -> None:
    """Control frames are msgpack only; nothing in the package may (un)pickle peer data."""
    root = Path(hetccl.__file__).resolve().parent
    sources = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".pyi", ".pyx", ".c", ".h"))
    assert any(p.name == "wire.py" for p in sources)
    offenders = [str(p.relative_to(root)) for p in sources
                 if re.search(r"pickle|marshal\.loads|shelve", p.read_text(encoding="utf-8", errors="replace"))]
    assert offenders == []
