"""HETCCL_CROSS_COMPRESS (issue 33): the wire formats against ml_dtypes' conversions, and compressed
collectives between CPU islands, on real rank processes, against an fp64 reference within each format's bound.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from rankrun import run_ranks

from hetccl import native
from hetccl.dtypes import DType, ReduceOp

BF16, FP16, FP8 = 1, 2, 3
GROUP = 1024  # e4m3 values per scale (HCCL_FP8_GROUP)


def _round_trip(x: np.ndarray, dtype: DType, wire: int) -> np.ndarray:
    packed = np.zeros(native.wire_size(len(x), wire), np.uint8)
    native.pack(packed, x, len(x), dtype, wire)
    back = np.zeros_like(x)
    native.unpack(back, packed, len(x), dtype, wire)
    return back


def _e4m3_values() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return vals[np.isfinite(vals)]


def test_bf16_and_fp16_round_to_nearest_even_as_ml_dtypes() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(70_000) * 2.0 ** rng.integers(-30, 30, 70_000)).astype(np.float32)
    x[:6] = [np.inf, -np.inf, 1e38, 70_000.0, 2.0 ** -20, 0.0]
    np.testing.assert_array_equal(_round_trip(x, DType.FLOAT32, BF16), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    with np.errstate(over="ignore"):  # numpy's cast to inf
        want = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(_round_trip(x, DType.FLOAT32, FP16), want)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -20, 2.0 ** 40])
def test_fp8_is_e4m3_with_a_power_of_two_scale(scale: float) -> None:
    """Values exact in e4m3 after scaling come back exact; others round to the nearest scaled e4m3 value;
    the scale is per group of 1024 and makes no NaN or inf; inf and NaN in the data arrive as NaN."""
    grid = _e4m3_values()
    exact = np.resize(grid, 3 * GROUP).astype(np.float32) * np.float32(scale)
    exact[::GROUP] = 448 * scale  # every group's largest magnitude: its scale is `scale` itself
    np.testing.assert_array_equal(_round_trip(exact, DType.FLOAT32, FP8), exact)
    rng = np.random.default_rng(1)
    x = (rng.uniform(-448, 448, 4 * GROUP) * scale).astype(np.float32)
    x[::GROUP] = 448 * scale
    want = (x / np.float32(scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(scale)
    np.testing.assert_array_equal(_round_trip(x, DType.FLOAT32, FP8), want)
    special = np.array([np.inf, -np.inf, np.nan, 1.0, 0.0, -2.0], np.float32)
    got = _round_trip(special, DType.FLOAT32, FP8)
    assert np.isnan(got[:3]).all() and np.array_equal(got[3:], special[3:]), got
    tiny = np.full(GROUP + 5, 3e-45, np.float32)  # subnormal float32: the scale stays a normal float
    assert np.isfinite(_round_trip(tiny, DType.FLOAT32, FP8)).all()


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16, DType.FLOAT64])
def test_unpack_reduces_in_the_callers_dtype(dtype: DType) -> None:
    np_dt = {DType.FLOAT16: np.float16, DType.BFLOAT16: ml_dtypes.bfloat16, DType.FLOAT64: np.float64}[dtype]
    x = np.linspace(-3, 3, 5000).astype(np_dt)
    acc = np.full(5000, 0.5, np_dt)
    packed = np.zeros(native.wire_size(5000, FP8), np.uint8)
    native.pack(packed, x, 5000, dtype, FP8)
    native.unpack(acc, packed, 5000, dtype, FP8, ReduceOp.SUM)
    back = np.zeros(5000, np_dt)
    native.unpack(back, packed, 5000, dtype, FP8)
    np.testing.assert_array_equal(acc, (back.astype(np.float32) + np.float32(0.5)).astype(np_dt))
    assert np.abs(back.astype(np.float64) - x.astype(np.float64)).max() <= 3 * 2.0 ** -4


# 2, 3 and 4 CPU islands, one path each: two hosts over TCP, three islands over shared memory, and islands of
# 2+1+1 ranks (an island step inside) between hosts; chunks of 64 KiB so that an op spans several
LAYOUTS = {
    "2 hosts": ("cpu-a,cpu-b", {"HETCCL_HOST": "a,b"}),
    "3 shm": ("cpu-a,cpu-b,cpu-c", {}),
    "2+1+1 hosts": ("cpu-a,cpu-a,cpu-b,cpu-c", {"HETCCL_HOST": "a,b,b,b", "HETCCL_TRANSPORTS": "tcp"}),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compressed_collectives_within_bound(layout: str) -> None:
    islands, env = LAYOUTS[layout]
    env = {**env, "TEST_ISLANDS": islands, "HETCCL_CROSS_COMPRESS": "bf16", "HETCCL_CROSS_COMPRESS_MIN": "0",
           "HETCCL_STAGE_BYTES": "64K"}
    run_ranks(islands.count(",") + 1, "workers:compressed", env=env, timeout=140, counts=[1, 7, 1500, 70_000])


@pytest.mark.timeout(150)
def test_error_feedback_keeps_ddp_on_the_uncompressed_loss() -> None:
    """torchrun, two CPU islands as two hosts, DDP with fp8 between them (tests/torch_workers.py error_feedback)."""
    pytest.importorskip("torch")
    from test_torch_backend import run_torchrun

    env = {"TEST_ISLANDS": "cpu-0,cpu-1", "HETCCL_HOST": "h0,h1", "HETCCL_CROSS_COMPRESS": "fp8",
           "HETCCL_CROSS_COMPRESS_MIN": "0"}
    proc = run_torchrun(2, "error_feedback", env=env, timeout=140)
    print(proc.stdout)


@pytest.mark.parametrize("wire", [BF16, FP16, FP8])
def test_the_device_codec_packs_the_host_codecs_bytes(wire: int) -> None:
    """gpu/codec.py (the GPU leaders' packing, run here on CPU tensors: the same torch operations) against
    native.pack byte for byte, groups and their scales included, at aligned and odd byte offsets, and its round
    trip against compress.round_trip in blocks of 2 and 3 leaders. An infinity packs as the host packs it (in
    fp8 the NaN code with its sign: torch's own cast saturates it to 448, so an overflow would cross as a finite
    value); a NaN stays a NaN, whatever its bits."""
    torch = pytest.importorskip("torch")
    from hetccl import compress
    from hetccl.dtypes import Buf
    from hetccl.gpu import codec

    rng = np.random.default_rng(wire)
    for n in (1, 7, GROUP, 1500, 70_000):
        x = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
        x[:min(n, 5)] = [0.0, 3e-45, -1e-40, 448.0, -0.0][:min(n, 5)]
        if n > GROUP:
            x[[6, GROUP + 1, n - 1]] = [np.inf, -np.inf, np.nan]
        want = np.zeros(native.wire_size(n, wire), np.uint8)
        native.pack(want, x, n, DType.FLOAT32, wire)
        back = np.zeros(n, np.float32)
        native.unpack(back, want, n, DType.FLOAT32, wire)
        for skip in (0, 3):  # the host's layout may put a piece at an odd byte (the device views need alignment)
            got = torch.zeros(skip + codec.wire_size(n, wire), dtype=torch.uint8)
            codec.pack(got[skip:], torch.from_numpy(x), wire)
            mine = got[skip:].numpy().copy()
            if n > GROUP:  # the NaN's bytes, the last value's: any NaN (torch's bf16 NaN is 0xffff, the host's 0x7fc0)
                nan_at = slice(-1 if wire == FP8 else -2, None)
                assert np.isnan(codec.unpack(torch.from_numpy(mine), n, wire)[-1].item())
                mine[nan_at] = want[nan_at]
            np.testing.assert_array_equal(mine, want, f"n={n}, at byte {skip}")
            packed = torch.from_numpy(np.concatenate([np.zeros(skip, np.uint8), want]))
            np.testing.assert_array_equal(codec.unpack(packed[skip:], n, wire).numpy(), back)
        for k in (2, 3):
            pieces = [(0, n // 2), (n // 2, n)]
            host = compress.round_trip(Buf(x.view(np.uint8), DType.FLOAT32, n), wire,
                                       [(a * 4, z * 4) for a, z in pieces], k).view(np.float32)
            np.testing.assert_array_equal(codec.round_trip(torch.from_numpy(x), wire, pieces, k).numpy(), host)


@pytest.mark.parametrize("wire", [BF16, FP8])
def test_device_pieces_cross_as_the_host_schedule_packs_them(wire: int) -> None:
    """The GPU leaders' all_gather and reduce_scatter pieces (codec.pack_pieces, unpack_piece, reduce_piece: the
    ordered and the loop schedule's, run here on CPU tensors) against the host's codec slot for slot: 3 leaders,
    a block of 2,500 in pieces of 1,000 (a short last piece), the exchanges done by hand (all_gather: slot i*n+j
    is leader j's piece i; all_to_all: leader r gets slot i*n+r of each leader j)."""
    torch = pytest.importorskip("torch")
    from hetccl import compress
    from hetccl.gpu import codec

    n, kk = 3, 2500
    pieces, slot = compress.piece_slots(kk, 1000, wire)
    m = len(pieces)
    rng = np.random.default_rng(wire)
    # leader j's input, its magnitude changing every 300 values: the pieces' fp8 scales are not the whole block's
    blocks = [(rng.standard_normal(n * kk) * np.repeat(2.0 ** rng.integers(-20, 20, n * kk // 300 + 1), 300)[:n * kk]
               ).astype(np.float32) for _ in range(n)]

    def host_packed(x: np.ndarray) -> np.ndarray:
        out = np.zeros(native.wire_size(len(x), wire), np.uint8)
        native.pack(out, np.ascontiguousarray(x), len(x), DType.FLOAT32, wire)
        return out

    def host_back(x: np.ndarray) -> np.ndarray:  # a block as its pieces cross
        return np.concatenate([_round_trip(np.ascontiguousarray(x[a:b]), DType.FLOAT32, wire) for a, b in pieces])

    # all_gather of each leader's first block
    sent = [torch.full((m * slot,), 7, dtype=torch.uint8) for _ in range(n)]
    for j in range(n):
        codec.pack_pieces(sent[j], torch.from_numpy(blocks[j][:kk]), pieces, slot, 1, 0, wire)
        for i, (a, b) in enumerate(pieces):
            got = sent[j][i * slot:(i + 1) * slot].numpy()
            want = host_packed(blocks[j][a:b])
            np.testing.assert_array_equal(got[:len(want)], want)
            assert not got[len(want):].any(), "a short piece's unused bytes cross as zeros"
    gathered = torch.cat([sent[j][i * slot:(i + 1) * slot] for i in range(m) for j in range(n)])
    every = torch.empty(n * kk)
    for i in range(m):
        codec.unpack_piece(every, gathered, pieces, slot, n, kk, i, wire)
    np.testing.assert_array_equal(every.numpy(), np.concatenate([host_back(blocks[j][:kk]) for j in range(n)]))

    # reduce_scatter: leader r keeps the sum of every leader's block r, reduced in leader order
    sent = [torch.empty(m * n * slot, dtype=torch.uint8) for _ in range(n)]
    for j in range(n):
        codec.pack_pieces(sent[j], torch.from_numpy(blocks[j]), pieces, slot, n, kk, wire)
    for r in range(n):
        got = torch.cat([sent[j][(i * n + r) * slot:(i * n + r + 1) * slot] for i in range(m) for j in range(n)])
        region = torch.empty(kk)
        for i in range(m):
            codec.reduce_piece(region, got, pieces, slot, n, i, wire, torch.Tensor.add_)
        want = host_back(blocks[0][r * kk:(r + 1) * kk])
        for j in range(1, n):
            want = want + host_back(blocks[j][r * kk:(r + 1) * kk])
        np.testing.assert_array_equal(region.numpy(), want)


@pytest.mark.parametrize("wire", [BF16, FP8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_leader_chunks_pack_and_reduce_as_rows_give_the_chunk_by_chunk_bytes(wire: int, dtype: str) -> None:
    """A compressed all_reduce's device side (codec.LeaderChunks, run here on CPU tensors) packs its chunks of
    equal length as rows in one pass, and unpacks and reduces a span of them in one pass: the same bytes, and the
    same bits in leader order, as chunk by chunk (pack_blocks, reduce), a short last chunk included; 3 leaders,
    values whose magnitude changes every 300 so that fp8's group scales differ."""
    torch = pytest.importorskip("torch")
    from hetccl.gpu import codec

    k, step, count = 3, 3 * 4096, 5 * 3 * 4096 + 2000
    chunks = [(lo, min(lo + step, count)) for lo in range(0, count, step)]
    lc = codec.LeaderChunks(chunks, k, wire)
    rng = np.random.default_rng(wire)
    tdt = getattr(torch, dtype)
    leaders = [torch.from_numpy((rng.standard_normal(count) * np.repeat(2.0 ** rng.integers(-20, 20, count // 300 + 1),
                                                                          300)[:count]).astype(np.float32)).to(tdt)
               for _ in range(k)]
    packed = []
    for x in leaders:
        rows = torch.full((lc.total,), 7, dtype=torch.uint8)
        lc.pack(rows, x)
        one_by_one = torch.full((lc.total,), 7, dtype=torch.uint8)
        for (lo, hi), blocks, at, size in zip(lc.chunks, lc.blocks, lc.starts, lc.sizes, strict=True):
            codec.pack_blocks(one_by_one[at:at + size], x[lo:hi], wire, blocks)
        assert torch.equal(rows, one_by_one)
        packed.append(rows)

    def add(d, s, op):  # runtime.reduce_inplace's SUM
        d.add_(s)

    want = torch.empty(count, dtype=tdt)
    for j, (at, size) in enumerate(zip(lc.starts, lc.sizes, strict=True)):  # chunk by chunk, leader order
        lc.reduce(j, want, torch.cat([p[at:at + size] for p in packed]), None, add)
    got = torch.full((count,), float("nan"), dtype=tdt)
    span = 4  # spans of 4 and 2 chunks, the last one short
    for j0 in range(0, len(chunks), span):
        j1 = min(j0 + span, len(chunks))
        scratch = torch.zeros(span * k * lc.sizes[0], dtype=torch.uint8)
        for j in range(j0, j1):
            at, size = lc.starts[j], lc.sizes[j]
            scratch[(j - j0) * k * lc.sizes[0]:][:k * size] = torch.cat([p[at:at + size] for p in packed])
        lc.reduce_span(j0, j1, got, scratch, None, add)
    assert torch.equal(got, want)
