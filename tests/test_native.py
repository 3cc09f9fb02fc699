"""Tests of the native kernels (native/hetccl_native.c, built by cffi as hetccl._native).

Every dtype x op is compared with numpy:
  * integers: sum/prod wrap around (two's complement, as numpy does); min/max exact;
  * float32/float64: exact IEEE results (bitwise, apart from NaN payloads);
  * float16/bfloat16: numpy computes in float32 and casts back once (round-to-nearest-even); the
    native code must give the same bits, except that any NaN only has to be a quiet NaN;
  * min/max on floats propagate NaN (numpy.minimum/maximum semantics); when the operands compare
    equal (-0.0 vs +0.0) the result is the second operand, b.

Two builds are tested: the normal one (on x86_64: target_clones + the AVX2/F16C float16/bfloat16
kernels where the CPU has them) and a portable one compiled here with both switched off, which is what
a CPU without AVX2 (or another architecture) runs.
"""

from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import mmap
import os
import sys
import threading
import time
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE_DIR = os.path.join(ROOT, "native")

BF16 = np.dtype(ml_dtypes.bfloat16)
# code -> numpy dtype, in the native library's numbering
DTYPES = {
    0: np.dtype(np.int8),
    1: np.dtype(np.uint8),
    2: np.dtype(np.int32),
    3: np.dtype(np.int64),
    4: np.dtype(np.float16),
    5: BF16,
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
}
NAMES = {0: "int8", 1: "uint8", 2: "int32", 3: "int64", 4: "float16", 5: "bfloat16", 6: "float32",
         7: "float64"}
SUM, PROD, MIN, MAX = 0, 1, 2, 3
OPS = {SUM: np.add, PROD: np.multiply, MIN: np.minimum, MAX: np.maximum}
OP_NAMES = {SUM: "sum", PROD: "prod", MIN: "min", MAX: "max"}
HALF = (4, 5)
FLOATS = (4, 5, 6, 7)
UINT_OF = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
COUNTS = [0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 65, 127, 255, 1000, 4099]
OFFSETS = [0, 1, 3, 6]


# ---------------------------------------------------------------------------------------------------
# loading the extension
# ---------------------------------------------------------------------------------------------------

def _load_so(path: str, name: str):
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _builder_module():
    path = os.path.join(NATIVE_DIR, "build.py")
    spec = importlib.util.spec_from_file_location("_hetccl_native_build", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(tmpdir: str, defines: tuple[str, ...] = ()) -> str:
    return _builder_module().make_ffibuilder(defines=defines).compile(tmpdir=tmpdir)


def _sources_mtime() -> float:
    return max(os.path.getmtime(os.path.join(NATIVE_DIR, f)) for f in ("hetccl_native.c", "hetccl_native.h"))


@pytest.fixture(scope="session")
def built_native(tmp_path_factory):
    """The normal build: hetccl._native as imported, or the .so in the source tree; compiled afresh
    into a temporary folder when neither exists or it is older than native/*.[ch]."""
    candidates = []
    try:
        mod = importlib.import_module("hetccl._native")
        candidates.append((mod.__file__, mod))
    except Exception:  # package missing, half-written __init__, or not built yet
        pass
    for path in sorted(glob.glob(os.path.join(ROOT, "hetccl", "_native*.so"))):
        candidates.append((path, None))
    for path, mod in candidates:
        if os.path.getmtime(path) >= _sources_mtime():
            return mod if mod is not None else _load_so(path, "hetccl._native")
    if candidates:
        warnings.warn("hetccl/_native*.so is older than native/*.[ch]; testing a fresh build instead "
                      "(run `python native/build.py`)", stacklevel=1)
    path = _compile(str(tmp_path_factory.mktemp("native_build")))
    return _load_so(path, "hetccl._native")


@pytest.fixture(scope="session")
def portable_native(tmp_path_factory):
    """The same sources with target_clones and the explicit SIMD kernels off."""
    path = _compile(str(tmp_path_factory.mktemp("native_portable")),
                    ("HCCL_NO_TARGET_CLONES", "HCCL_NO_EXPLICIT_SIMD"))
    # any package name works: the init function is named after the last component
    return _load_so(path, "hetccl_portable_build._native")


@pytest.fixture(scope="session", params=["build", "portable"])
def native(request):
    return request.getfixturevalue("built_native" if request.param == "build" else "portable_native")


@pytest.fixture(scope="session")
def nat(built_native):
    """Tests that do not depend on the kernel variant use only the normal build."""
    return built_native


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------

def ptr(ffi, arr: np.ndarray):
    return ffi.from_buffer(arr.reshape(-1).view(np.uint8), require_writable=True)


def buffer(n: int, dt: np.dtype, offset: int = 0) -> np.ndarray:
    """An array of n elements starting `offset` bytes into a fresh allocation (unaligned if offset)."""
    raw = np.zeros(n * dt.itemsize + offset + 16, np.uint8)
    return raw[offset:offset + n * dt.itemsize].view(dt)


def placed(values: np.ndarray, offset: int) -> np.ndarray:
    out = buffer(len(values), values.dtype, offset)
    out[...] = values
    return out


def as_bits(arr: np.ndarray) -> np.ndarray:
    return arr.view(UINT_OF[arr.dtype.itemsize])


def special_values(code: int) -> np.ndarray:
    dt = DTYPES[code]
    if code in FLOATS:
        if code == 4:
            fin = np.finfo(np.float16)
        elif code == 5:
            fin = ml_dtypes.finfo(ml_dtypes.bfloat16)
        else:
            fin = np.finfo(dt)
        vals = [0.0, -0.0, 1.0, -1.0, 0.5, 3.0, np.inf, -np.inf, np.nan, -np.nan,
                float(fin.max), -float(fin.max), float(fin.tiny), -float(fin.tiny),
                float(fin.smallest_subnormal), -float(fin.smallest_subnormal),
                float(fin.eps), 1.0 + float(fin.eps)]
        return np.array(vals, dtype=np.float64).astype(dt)
    info = np.iinfo(dt)
    return np.array([0, 1, -1 if info.min < 0 else 2, info.min, info.max, info.max - 1, info.min + 1,
                     2, 3, 16, 100], dtype=np.int64).astype(dt)


def random_values(code: int, n: int, rng: np.random.Generator) -> np.ndarray:
    dt = DTYPES[code]
    if code in HALF:
        # half random bit patterns (NaNs, infs, subnormals, everything), half ordinary numbers
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(dt)
        normal = (rng.standard_normal(n) * np.exp2(rng.integers(-12, 12, n))).astype(np.float32).astype(dt)
        out = np.where(rng.random(n) < 0.5, bits, normal).astype(dt)
    elif code in FLOATS:
        out = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(dt)
    else:
        info = np.iinfo(dt)
        out = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
        small = rng.integers(-20 if info.min < 0 else 0, 20, n).astype(dt)
        out = np.where(rng.random(n) < 0.3, small, out).astype(dt)
    sv = special_values(code)
    if n:
        k = min(n // 4 + 1, len(sv))
        idx = rng.choice(n, size=k, replace=False)
        out[idx] = rng.choice(sv, size=k)
    return out


def reference(code: int, op: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        if code in HALF:
            r = OPS[op](a.astype(np.float32), b.astype(np.float32))
            return r.astype(DTYPES[code])
        return OPS[op](a, b)


def assert_result(code: int, op: int, got: np.ndarray, exp: np.ndarray, what: str = "") -> None:
    assert got.dtype == exp.dtype and got.shape == exp.shape
    if code not in FLOATS:
        np.testing.assert_array_equal(got, exp, err_msg=what)
        return
    g32, e32 = got.astype(np.float64), exp.astype(np.float64)
    gnan, enan = np.isnan(g32), np.isnan(e32)
    np.testing.assert_array_equal(gnan, enan, err_msg=f"NaN positions differ {what}")
    if code in HALF:
        # a NaN result must be a quiet NaN (top mantissa bit set)
        quiet = 0x0200 if code == 4 else 0x0040
        assert np.all(as_bits(got)[gnan] & quiet), f"signalling NaN in result {what}"
    ok = ~gnan
    if op in (MIN, MAX):
        # same value (+0.0 == -0.0: which zero is checked separately)
        np.testing.assert_array_equal(g32[ok], e32[ok], err_msg=what)
    else:
        np.testing.assert_array_equal(as_bits(got)[ok], as_bits(exp)[ok], err_msg=what)


ALL_CASES = [(c, o) for c in DTYPES for o in OPS]
CASE_IDS = [f"{NAMES[c]}-{OP_NAMES[o]}" for c, o in ALL_CASES]


# ---------------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "op"), ALL_CASES, ids=CASE_IDS)
def test_reduce_matches_numpy(native, code, op):
    ffi, lib = native.ffi, native.lib
    dt = DTYPES[code]
    rng = np.random.default_rng(1000 * code + op)
    for n in COUNTS:
        for off_d, off_s in [(0, 0), (1, 3), (3, 0), (0, 6), (6, 1)]:
            a = random_values(code, n, rng)
            b = random_values(code, n, rng)
            exp = reference(code, op, a, b)
            what = f"{NAMES[code]} {OP_NAMES[op]} n={n} offsets={off_d},{off_s}"

            # hccl_reduce: dst = dst OP src
            dst, src = placed(a, off_d), placed(b, off_s)
            assert lib.hccl_reduce(ptr(ffi, dst), ptr(ffi, src), n, code, op) == 0
            assert_result(code, op, dst, exp, "reduce " + what)
            np.testing.assert_array_equal(as_bits(src), as_bits(b))  # src untouched

            # hccl_reduce3: separate output
            out = buffer(n, dt, (off_d + 5) % 8)
            pa, pb = placed(a, off_s), placed(b, off_d)
            assert lib.hccl_reduce3(ptr(ffi, out), ptr(ffi, pa), ptr(ffi, pb), n, code, op) == 0
            assert_result(code, op, out, exp, "reduce3 " + what)
            np.testing.assert_array_equal(as_bits(pa), as_bits(a))
            np.testing.assert_array_equal(as_bits(pb), as_bits(b))

            # hccl_reduce3_dup: two outputs, then in place with a second output
            out2 = buffer(n, dt, (off_s + 2) % 8)
            out.fill(0)
            assert lib.hccl_reduce3_dup(ptr(ffi, out), ptr(ffi, out2), ptr(ffi, pa), ptr(ffi, pb), n, code,
                                        op) == 0
            assert_result(code, op, out, exp, "reduce3_dup(dst) " + what)
            np.testing.assert_array_equal(as_bits(out2), as_bits(out))
            out2.fill(0)
            assert lib.hccl_reduce3_dup(ptr(ffi, pa), ptr(ffi, out2), ptr(ffi, pa), ptr(ffi, pb), n, code,
                                        op) == 0
            assert_result(code, op, pa, exp, "reduce3_dup in place " + what)
            np.testing.assert_array_equal(as_bits(out2), as_bits(pa))


@pytest.mark.parametrize(("code", "op"), ALL_CASES, ids=CASE_IDS)
def test_aliasing(native, code, op):
    """dst may equal a and/or b; dst2 may be NULL or equal to dst."""
    ffi, lib = native.ffi, native.lib
    rng = np.random.default_rng(7 + 10 * code + op)
    for n in (1, 13, 16, 100, 1001):
        a = random_values(code, n, rng)
        b = random_values(code, n, rng)
        # dst == b (not a): the alias-safe kernel
        x, y = a.copy(), b.copy()
        assert lib.hccl_reduce3(ptr(ffi, y), ptr(ffi, x), ptr(ffi, y), n, code, op) == 0
        assert_result(code, op, y, reference(code, op, a, b), "dst == b")
        # a == b, separate dst
        x, out = a.copy(), np.zeros_like(a)
        assert lib.hccl_reduce3(ptr(ffi, out), ptr(ffi, x), ptr(ffi, x), n, code, op) == 0
        assert_result(code, op, out, reference(code, op, a, a), "a == b")
        # dst == a == b, through hccl_reduce(x, x) and reduce3_dup with a second output
        x = a.copy()
        assert lib.hccl_reduce(ptr(ffi, x), ptr(ffi, x), n, code, op) == 0
        assert_result(code, op, x, reference(code, op, a, a), "reduce(x, x)")
        x, out2 = a.copy(), np.zeros_like(a)
        assert lib.hccl_reduce3_dup(ptr(ffi, x), ptr(ffi, out2), ptr(ffi, x), ptr(ffi, x), n, code, op) == 0
        assert_result(code, op, x, reference(code, op, a, a), "dup(x, out2, x, x)")
        np.testing.assert_array_equal(as_bits(out2), as_bits(x))
        # dst2 NULL, and dst2 == dst
        x = a.copy()
        assert lib.hccl_reduce3_dup(ptr(ffi, x), ffi.NULL, ptr(ffi, x), ptr(ffi, b), n, code, op) == 0
        assert_result(code, op, x, reference(code, op, a, b), "dst2 NULL")
        x = a.copy()
        assert lib.hccl_reduce3_dup(ptr(ffi, x), ptr(ffi, x), ptr(ffi, x), ptr(ffi, b), n, code, op) == 0
        assert_result(code, op, x, reference(code, op, a, b), "dst2 == dst")
        # dst2 == b: the second output overwrites an input
        y, out = b.copy(), np.zeros_like(a)
        assert lib.hccl_reduce3_dup(ptr(ffi, out), ptr(ffi, y), ptr(ffi, a.copy()), ptr(ffi, y), n, code,
                                    op) == 0
        assert_result(code, op, out, reference(code, op, a, b), "dst2 == b")
        np.testing.assert_array_equal(as_bits(y), as_bits(out))


def test_count_zero_and_bad_codes(native):
    ffi, lib = native.ffi, native.lib
    null = ffi.NULL
    for code in DTYPES:
        for op in OPS:
            assert lib.hccl_reduce(null, null, 0, code, op) == 0
            assert lib.hccl_reduce3(null, null, null, 0, code, op) == 0
            assert lib.hccl_reduce3_dup(null, null, null, null, 0, code, op) == 0
        assert lib.hccl_div(null, 0, code, 3) == 0
    x = np.ones(4, np.float32)
    for code, op in [(-1, 0), (8, 0), (100, 0), (0, -1), (0, 4), (6, 99)]:
        assert lib.hccl_reduce(ptr(ffi, x), ptr(ffi, x), 4, code, op) == -1
        assert lib.hccl_reduce3(ptr(ffi, x), ptr(ffi, x), ptr(ffi, x), 4, code, op) == -1
        assert lib.hccl_reduce3_dup(ptr(ffi, x), null, ptr(ffi, x), ptr(ffi, x), 4, code, op) == -1
    assert lib.hccl_div(ptr(ffi, x), 4, 8, 2) == -1
    assert lib.hccl_div(ptr(ffi, x), 4, -1, 2) == -1
    np.testing.assert_array_equal(x, np.ones(4, np.float32))
    assert [lib.hccl_dtype_size(c) for c in range(-1, 9)] == [0, 1, 1, 4, 8, 2, 2, 4, 8, 0]
    assert (lib.HCCL_INT8, lib.HCCL_BFLOAT16, lib.HCCL_FLOAT64, lib.HCCL_MAX) == (0, 5, 7, 3)


def test_integer_wraparound(native):
    ffi, lib = native.ffi, native.lib
    cases = [
        (0, SUM, [127, -128, -1, 100], [1, -1, -128, 100], [-128, 127, 127, -56]),
        (0, PROD, [127, -128, 16, -1], [2, -1, 16, -128], [-2, -128, 0, -128]),
        (1, SUM, [255, 200, 0], [1, 100, 0], [0, 44, 0]),
        (1, PROD, [255, 16, 15], [255, 16, 17], [1, 0, 255]),
        (2, SUM, [2**31 - 1, -2**31], [1, -1], [-2**31, 2**31 - 1]),
        (2, PROD, [2**31 - 1, -2**31, 65536], [2, -1, 65536], [-2, -2**31, 0]),
        (3, SUM, [2**63 - 1, -2**63], [1, -1], [-2**63, 2**63 - 1]),
        (3, PROD, [2**63 - 1, -2**63, 2**32], [2, -1, 2**32], [-2, -2**63, 0]),
        (0, MIN, [-128, 127, 5], [127, -128, 5], [-128, -128, 5]),
        (1, MAX, [0, 255, 7], [255, 0, 9], [255, 255, 9]),
    ]
    for code, op, a, b, want in cases:
        dt = DTYPES[code]
        x, y = np.array(a).astype(dt), np.array(b).astype(dt)
        exp = reference(code, op, x, y)
        np.testing.assert_array_equal(exp, np.array(want).astype(dt))  # numpy wraps the same way
        assert lib.hccl_reduce(ptr(ffi, x), ptr(ffi, y), len(a), code, op) == 0
        np.testing.assert_array_equal(x, exp, err_msg=f"{NAMES[code]} {OP_NAMES[op]}")


@pytest.mark.parametrize("code", FLOATS, ids=[NAMES[c] for c in FLOATS])
def test_min_max_nan_and_signed_zero(native, code):
    """NaN-propagating min/max (numpy semantics); equal operands give b (so -0.0/+0.0 -> b)."""
    ffi, lib = native.ffi, native.lib
    dt = DTYPES[code]
    nan, inf = np.nan, np.inf
    a = np.array([nan, 1.0, nan, -inf, nan, 0.0, -0.0, 2.0, -0.0, 0.0], np.float64).astype(dt)
    b = np.array([1.0, nan, nan, nan, -inf, -0.0, 0.0, 2.0, -0.0, 0.0], np.float64).astype(dt)
    for op in (MIN, MAX):
        x = a.copy()
        assert lib.hccl_reduce(ptr(ffi, x), ptr(ffi, b), len(a), code, op) == 0
        got = x.astype(np.float64)
        assert np.isnan(got[:5]).all(), (OP_NAMES[op], got)
        assert_result(code, op, x, reference(code, op, a, b))
        # which zero: b's
        np.testing.assert_array_equal(np.signbit(got[5:]), np.signbit(b.astype(np.float64)[5:]))
    # NaN in sum/prod too, and inf - inf, inf * 0
    x = np.array([nan, 1.0, inf, inf], np.float64).astype(dt)
    y = np.array([1.0, nan, -inf, 0.0], np.float64).astype(dt)
    for op, nans in ((SUM, [True, True, True, False]), (PROD, [True, True, False, True])):
        z = x.copy()
        assert lib.hccl_reduce(ptr(ffi, z), ptr(ffi, y), 4, code, op) == 0
        np.testing.assert_array_equal(np.isnan(z.astype(np.float64)), nans)
        assert_result(code, op, z, reference(code, op, x, y))


@pytest.mark.parametrize("code", HALF, ids=[NAMES[c] for c in HALF])
def test_half_exhaustive(native, code):
    """Every 16-bit pattern as an operand, against numpy's float32 computation rounded once."""
    ffi, lib = native.ffi, native.lib
    dt = DTYPES[code]
    rng = np.random.default_rng(code)
    allbits = np.arange(1 << 16, dtype=np.uint16).view(dt)
    ones = np.ones(1 << 16, np.float32).astype(dt)
    zeros = np.zeros(1 << 16, dt)
    seconds = [zeros, ones, allbits[rng.permutation(1 << 16)], allbits[rng.permutation(1 << 16)],
               allbits[::-1].copy()]
    for op in OPS:
        for b in seconds:
            x = allbits.copy()
            assert lib.hccl_reduce(ptr(ffi, x), ptr(ffi, b), len(x), code, op) == 0
            assert_result(code, op, x, reference(code, op, allbits, b), f"{NAMES[code]} {OP_NAMES[op]}")
    # x + 0 and x * 1 give x back for every non-NaN pattern (exact widening, exact narrowing)
    for op, b in ((SUM, zeros), (PROD, ones)):
        x = allbits.copy()
        lib.hccl_reduce(ptr(ffi, x), ptr(ffi, b), len(x), code, op)
        keep = ~np.isnan(allbits.astype(np.float32)) & (as_bits(allbits) != 0x8000)
        np.testing.assert_array_equal(as_bits(x)[keep], as_bits(allbits)[keep])


# (a, b, op, expected a OP b rounded to the type); every operand is exactly representable
HALF_EDGES = {
    4: [
        (1.0, 2.0**-11, SUM, 1.0),                          # tie, to even (down)
        (1.0 + 2.0**-10, 2.0**-11, SUM, 1.0 + 2.0**-9),     # tie, to even (up)
        (1.0, 2.0**-12, SUM, 1.0),                          # below half an ulp
        (65504.0, 15.0, SUM, 65504.0),                      # largest finite stays
        (65504.0, 16.0, SUM, np.inf),                       # tie at 65520 rounds to even: inf
        (-65504.0, -32.0, SUM, -np.inf),
        (2.0**-12, 2.0**-13, PROD, 0.0),                    # 2^-25: tie between 0 and 2^-24 -> 0
        (3 * 2.0**-12, 2.0**-13, PROD, 2.0**-23),           # 1.5 * 2^-24 -> 2 * 2^-24
        (2.0**-14, 1.0 - 2.0**-11, PROD, 2.0**-14),         # rounds up out of the subnormals
        (-(2.0**-12), 2.0**-14, PROD, -0.0),                # underflow keeps the sign
        (2.0**-24, 2.0**-24, SUM, 2.0**-23),
    ],
    5: [
        (1.0, 2.0**-8, SUM, 1.0),
        (1.0 + 2.0**-7, 2.0**-8, SUM, 1.0 + 2.0**-6),
        (1.0, 2.0**-9, SUM, 1.0),
        (2.0**127 * (2 - 2.0**-7), 2.0**119, SUM, np.inf),  # max + half an ulp: tie, to even: inf
        (2.0**127 * (2 - 2.0**-7), 2.0**118, SUM, 2.0**127 * (2 - 2.0**-7)),
        (2.0**-70, 2.0**-64, PROD, 0.0),                    # 2^-134: tie between 0 and 2^-133 -> 0
        (3 * 2.0**-70, 2.0**-65, PROD, 2.0**-133),          # 0.75 * 2^-133 -> 2^-133
        (2.0**-126, 1.0 - 2.0**-8, PROD, 2.0**-126),        # rounds up out of the subnormals
        (2.0**-133, 2.0**-133, SUM, 2.0**-132),
    ],
}


@pytest.mark.parametrize("code", HALF, ids=[NAMES[c] for c in HALF])
def test_half_rounding_edges(native, code):
    """Ties to even, rounding in and out of the subnormal range, overflow to inf."""
    ffi, lib = native.ffi, native.lib
    dt = DTYPES[code]
    for a, b, op, want in HALF_EDGES[code]:
        x, y = np.array([a], np.float64).astype(dt), np.array([b], np.float64).astype(dt)
        assert x.astype(np.float64)[0] == a and y.astype(np.float64)[0] == b, (a, b)
        exp = reference(code, op, x, y)
        assert exp.astype(np.float64)[0] == want, (a, b, op, exp)  # the reference agrees
        assert lib.hccl_reduce(ptr(ffi, x), ptr(ffi, y), 1, code, op) == 0
        assert_result(code, op, x, exp, f"{a} {OP_NAMES[op]} {b}")
        assert np.signbit(x.astype(np.float64)[0]) == np.signbit(want)


@settings(max_examples=300, deadline=None)
@given(code=st.sampled_from(sorted(DTYPES)), op=st.sampled_from(sorted(OPS)),
       raw_a=st.binary(max_size=300), raw_b=st.binary(max_size=300), off=st.sampled_from(OFFSETS),
       mode=st.sampled_from(["reduce", "reduce3", "dup"]))
def test_reduce_random_bits(built_native, code, op, raw_a, raw_b, off, mode):
    ffi, lib = built_native.ffi, built_native.lib
    dt = DTYPES[code]
    n = min(len(raw_a), len(raw_b)) // dt.itemsize
    a = np.frombuffer(raw_a[:n * dt.itemsize], dtype=dt).copy()
    b = np.frombuffer(raw_b[:n * dt.itemsize], dtype=dt).copy()
    exp = reference(code, op, a, b)
    x, y = placed(a, off), placed(b, (off * 3) % 8)
    if mode == "reduce":
        assert lib.hccl_reduce(ptr(ffi, x), ptr(ffi, y), n, code, op) == 0
        assert_result(code, op, x, exp)
    else:
        out, out2 = buffer(n, dt, (off + 1) % 8), buffer(n, dt, 0)
        if mode == "reduce3":
            assert lib.hccl_reduce3(ptr(ffi, out), ptr(ffi, x), ptr(ffi, y), n, code, op) == 0
        else:
            assert lib.hccl_reduce3_dup(ptr(ffi, out), ptr(ffi, out2), ptr(ffi, x), ptr(ffi, y), n, code,
                                        op) == 0
            np.testing.assert_array_equal(as_bits(out2), as_bits(out))
        assert_result(code, op, out, exp)


def _same_bits_or_both_nan(code: int, got: np.ndarray, exp: np.ndarray, what: str) -> None:
    if code in FLOATS:
        # which NaN comes out of NaN OP NaN is unspecified (IEEE; compilers swap commutative operands)
        gnan, enan = np.isnan(got.astype(np.float64)), np.isnan(exp.astype(np.float64))
        np.testing.assert_array_equal(gnan, enan, err_msg=what)
        got, exp = got[~gnan], exp[~enan]
    np.testing.assert_array_equal(as_bits(got), as_bits(exp), err_msg=what)


def test_builds_agree_bitwise(built_native, portable_native):
    """The AVX2/F16C, target_clones and portable kernels give identical bits (up to NaN payloads)."""
    rng = np.random.default_rng(99)
    for code, op in ALL_CASES:
        a = random_values(code, 4099, rng)
        b = random_values(code, 4099, rng)
        results = []
        for mod in (built_native, portable_native):
            x = a.copy()
            assert mod.lib.hccl_reduce(ptr(mod.ffi, x), ptr(mod.ffi, b), len(x), code, op) == 0
            results.append(x)
        _same_bits_or_both_nan(code, results[0], results[1], f"{NAMES[code]} {OP_NAMES[op]}")
        if code in FLOATS:
            results = []
            for mod in (built_native, portable_native):
                x = a.copy()
                assert mod.lib.hccl_div(ptr(mod.ffi, x), len(x), code, 3) == 0
                results.append(x)
            _same_bits_or_both_nan(code, results[0], results[1], f"div {NAMES[code]}")


# ---------------------------------------------------------------------------------------------------
# division (avg)
# ---------------------------------------------------------------------------------------------------

def _trunc_div_ref(values: np.ndarray, d: int) -> np.ndarray:
    bits = values.dtype.itemsize * 8
    out = []
    for v in values.tolist():
        q = abs(v) // abs(d)
        if (v < 0) != (d < 0):
            q = -q
        out.append(q % (1 << bits))  # wrap to the width (two's complement), as the C code does
    return np.array(out, dtype=np.uint64).astype(UINT_OF[values.dtype.itemsize]).view(values.dtype)


@pytest.mark.parametrize("code", sorted(DTYPES), ids=[NAMES[c] for c in sorted(DTYPES)])
def test_div(native, code):
    ffi, lib = native.ffi, native.lib
    dt = DTYPES[code]
    rng = np.random.default_rng(50 + code)
    divisors = [1, 2, 3, 7, 8, 1000, -1, -3, 2**31 - 1, 2**40 + 7, -(2**62), 2**63 - 1, -(2**63)]
    for d in divisors:
        for n, off in [(0, 0), (1, 1), (17, 3), (100, 0), (1031, 5)]:
            vals = random_values(code, n, rng)
            x = placed(vals, off)
            assert lib.hccl_div(ptr(ffi, x), n, code, d) == 0
            if code in FLOATS:
                with np.errstate(all="ignore"):
                    if code in HALF:
                        exp = (vals.astype(np.float32) / np.float32(d)).astype(dt)
                    else:
                        exp = vals / dt.type(d)
                assert_result(code, SUM, x, exp, f"div {NAMES[code]} by {d} n={n}")
            else:
                np.testing.assert_array_equal(x, _trunc_div_ref(vals, d), err_msg=f"div by {d}")
    # divisor 0 is refused and nothing is written
    x = random_values(code, 10, rng)
    before = x.copy()
    assert lib.hccl_div(ptr(ffi, x), 10, code, 0) == -1
    np.testing.assert_array_equal(as_bits(x), as_bits(before))


def test_div_integer_edges(native):
    ffi, lib = native.ffi, native.lib
    x = np.array([-128, 127, -7, 7, 0], np.int8)
    lib.hccl_div(ptr(ffi, x), 5, 0, -1)
    np.testing.assert_array_equal(x, np.array([-128, -127, 7, -7, 0], np.int8))  # -(-128) wraps
    x = np.array([-2**31, 2**31 - 1, -7, 7], np.int32)
    lib.hccl_div(ptr(ffi, x), 4, 2, 2)
    np.testing.assert_array_equal(x, np.array([-2**30, 2**30 - 1, -3, 3], np.int32))  # toward zero
    x = np.array([-2**63, 2**63 - 1, -7], np.int64)
    lib.hccl_div(ptr(ffi, x), 3, 3, -1)
    np.testing.assert_array_equal(x, np.array([-2**63, -(2**63 - 1), 7], np.int64))
    x = np.array([250, 7], np.uint8)
    lib.hccl_div(ptr(ffi, x), 2, 1, 3)
    np.testing.assert_array_equal(x, np.array([83, 2], np.uint8))


# ---------------------------------------------------------------------------------------------------
# copy, clock, info
# ---------------------------------------------------------------------------------------------------

def test_copy(nat):
    ffi, lib = nat.ffi, nat.lib
    rng = np.random.default_rng(3)
    lib.hccl_copy(ffi.NULL, ffi.NULL, 0)
    for n in (1, 3, 64, 1000, 1 << 20):
        for off in (0, 1, 7):
            src = placed(rng.integers(0, 256, n, dtype=np.uint8), off)
            dst = buffer(n, np.dtype(np.uint8), (off + 3) % 8)
            lib.hccl_copy(ptr(ffi, dst), ptr(ffi, src), n)
            np.testing.assert_array_equal(dst, src)


def test_clock_and_info(native):
    ffi, lib = native.ffi, native.lib
    t0 = lib.hccl_now_ns()
    ref = time.monotonic_ns()
    t1 = lib.hccl_now_ns()
    assert t0 <= t1
    assert abs(ref - t0) < 10**9  # both CLOCK_MONOTONIC on Linux
    info = ffi.string(lib.hccl_build_info()).decode()
    assert info.startswith("hetccl_native")
    if "portable" in native.__name__:
        assert "target_clones=off" in info and "fp16/bf16: portable" in info


# ---------------------------------------------------------------------------------------------------
# shared-memory synchronisation
# ---------------------------------------------------------------------------------------------------

def _counter(ffi, arr: np.ndarray, i: int = 0):
    return ffi.cast("uint64_t *", ptr(ffi, arr)) + i


def test_atomics(nat):
    ffi, lib = nat.ffi, nat.lib
    arr = np.zeros(4, np.uint64)
    c = _counter(ffi, arr, 1)
    assert lib.hccl_load_acquire(c) == 0
    lib.hccl_store_release(c, 41)
    assert arr[1] == 41 and lib.hccl_load_acquire(c) == 41
    assert lib.hccl_fetch_add(c, 1) == 41
    assert lib.hccl_load_acquire(c) == 42
    lib.hccl_store_release(c, 2**64 - 1)
    assert lib.hccl_fetch_add(c, 2) == 2**64 - 1  # wraps
    assert arr[1] == 1 and arr[0] == 0 and arr[2] == 0


def test_fetch_add_threads(nat):
    ffi, lib = nat.ffi, nat.lib
    arr = np.zeros(1, np.uint64)
    c = _counter(ffi, arr)
    per, nthreads = 20000, 4

    def work():
        for _ in range(per):
            lib.hccl_fetch_add(c, 1)

    threads = [threading.Thread(target=work) for _ in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lib.hccl_load_acquire(c) == per * nthreads


def test_wait_immediate_and_timeout(nat):
    ffi, lib = nat.ffi, nat.lib
    arr = np.zeros(1, np.uint64)
    c = _counter(ffi, arr)
    lib.hccl_store_release(c, 5)
    assert lib.hccl_wait_ge(c, 5, 0, 0) == 1
    assert lib.hccl_wait_ge(c, 4, 0, 0) == 1
    assert lib.hccl_wait_ge(c, 6, 0, 0) == 0
    assert lib.hccl_wait_ne(c, 4, 0, 0) == 1
    assert lib.hccl_wait_ne(c, 5, 0, 0) == 0
    lib.hccl_store_release(c, 2**63)  # unsigned comparison
    assert lib.hccl_wait_ge(c, 1, 0, 0) == 1
    assert lib.hccl_wait_ge(c, 2**63 + 1, 0, 0) == 0
    for spin, yld in ((20_000_000, 0), (0, 20_000_000), (10_000_000, 10_000_000)):
        t0 = time.monotonic_ns()
        assert lib.hccl_wait_ge(c, 2**64 - 1, spin, yld) == 0
        assert lib.hccl_wait_ne(c, 2**63, spin, yld) == 0
        elapsed = time.monotonic_ns() - t0
        assert elapsed >= 2 * (spin + yld)
        assert elapsed < 2 * (spin + yld) + 2 * 10**9  # generous: it never sleeps


def test_wait_released_by_thread(nat):
    ffi, lib = nat.ffi, nat.lib
    arr = np.zeros(2, np.uint64)
    c, data = _counter(ffi, arr, 0), _counter(ffi, arr, 1)

    def writer():
        time.sleep(0.02)
        data[0] = 1234
        lib.hccl_store_release(c, 3)

    t = threading.Thread(target=writer)
    t.start()
    # cffi releases the GIL during the call, so the writer runs meanwhile
    assert lib.hccl_wait_ge(c, 3, 1_000_000, 5 * 10**9) == 1
    assert data[0] == 1234
    t.join()
    t = threading.Thread(target=lambda: (time.sleep(0.02), lib.hccl_fetch_add(c, 1)))
    t.start()
    assert lib.hccl_wait_ne(c, 3, 50_000_000, 5 * 10**9) == 1
    assert lib.hccl_load_acquire(c) == 4
    t.join()


def test_wait_any_change(nat):
    ffi, lib = nat.ffi, nat.lib
    arr = np.zeros(8, np.uint64)
    arr[:] = [10, 20, 30, 40, 0, 0, 0, 0]
    addrs = ffi.new("uint64_t *[]", [_counter(ffi, arr, i) for i in range(4)])
    vals = ffi.new("uint64_t[]", [10, 20, 30, 40])
    assert lib.hccl_wait_any_change(addrs, vals, 4, 0, 0) == -1
    assert lib.hccl_wait_any_change(addrs, vals, 0, 10**9, 10**9) == -1  # nothing to wait for
    t0 = time.monotonic_ns()
    assert lib.hccl_wait_any_change(addrs, vals, 4, 5_000_000, 5_000_000) == -1
    assert time.monotonic_ns() - t0 >= 10_000_000
    arr[2] = 31
    assert lib.hccl_wait_any_change(addrs, vals, 4, 0, 0) == 2
    assert lib.hccl_wait_any_change(addrs, vals, 2, 0, 0) == -1  # only the first two watched
    arr[1] = 0
    assert lib.hccl_wait_any_change(addrs, vals, 4, 0, 0) == 1  # the lowest changed index
    arr[1], arr[2] = 20, 30

    def bump():
        time.sleep(0.02)
        lib.hccl_fetch_add(_counter(ffi, arr, 3), 1)

    t = threading.Thread(target=bump)
    t.start()
    assert lib.hccl_wait_any_change(addrs, vals, 4, 1_000_000, 5 * 10**9) == 3
    t.join()


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs fork and MAP_SHARED")
def test_wait_across_processes(nat):
    """Counters in a MAP_SHARED mapping, incremented by a forked child."""
    ffi, lib = nat.ffi, nat.lib
    shm = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    arr = np.frombuffer(shm, dtype=np.uint64)
    c, ack = _counter(ffi, arr, 0), _counter(ffi, arr, 8)
    rounds = 200
    pid = os.fork()
    if pid == 0:  # child: ping-pong with the parent, then exit without running pytest's cleanup
        ok = True
        try:
            for i in range(rounds):
                ok &= lib.hccl_wait_ge(c, 2 * i + 1, 1_000_000, 10 * 10**9) == 1
                lib.hccl_fetch_add(c, 1)
            lib.hccl_store_release(ack, 1 if ok else 2)
        finally:
            os._exit(0)
    try:
        for i in range(rounds):
            lib.hccl_fetch_add(c, 1)
            assert lib.hccl_wait_ge(c, 2 * i + 2, 1_000_000, 10 * 10**9) == 1
        assert lib.hccl_wait_ne(ack, 0, 1_000_000, 10 * 10**9) == 1
        assert lib.hccl_load_acquire(ack) == 1
        assert lib.hccl_load_acquire(c) == 2 * rounds
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    del arr, c, ack


def test_words_wait(nat):
    """The stream-order watcher's poll: the first word at its generation (serial comparison, across the 32-bit
    wrap), a bump (new waits), the timeout, and a word stored by another thread while it sleeps."""
    ffi, lib = nat.ffi, nat.lib
    words = np.zeros(4, np.uint32)
    bump = np.zeros(1, np.uint32)
    addrs = np.array([words.ctypes.data + 4 * i for i in range(4)], np.uint64)

    def wait(gens: list[int], seen: int = 0, timeout_ns: int = 20_000_000) -> int:
        g = np.array(gens, np.uint32)
        return lib.hccl_words_wait(ffi.cast("uint64_t *", addrs.ctypes.data), ffi.cast("uint32_t *", g.ctypes.data),
                                   len(g), ffi.cast("uint32_t *", bump.ctypes.data), seen, 50_000, 10_000, timeout_ns)

    assert wait([1, 1, 1, 1]) == lib.HCCL_WORDS_TIMEOUT
    words[2] = 1
    assert wait([1, 1, 1, 1]) == 2
    words[0], words[1] = 0xFFFFFFFF, 2  # a generation just past the wrap is later than 0xFFFFFFFF
    assert wait([2, 0xFFFFFFFF, 5, 5]) == 1
    assert wait([5, 5, 5, 5], seen=1) == lib.HCCL_WORDS_BUMPED
    words[:] = 0
    threading.Timer(0.05, lambda: words.__setitem__(3, 7)).start()
    t0 = time.monotonic()
    assert wait([1, 1, 1, 7], timeout_ns=5 * 10**9) == 3
    assert time.monotonic() - t0 < 2.0


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/timerslack_ns"), reason="Linux's per-thread timer slack")
def test_words_wait_sleeps_without_timer_slack(nat):
    """The watcher's 20 us pauses must not take the kernel's default 50 us of slack on top (a 20 us sleep took
    94 us on a 2-core VM): its thread's slack is set to 1 ns at its first wait, and only that thread's."""
    import ctypes

    ffi, lib = nat.ffi, nat.lib
    word, bump = np.zeros(1, np.uint32), np.zeros(1, np.uint32)
    addr, gen = np.array([word.ctypes.data], np.uint64), np.array([1], np.uint32)
    libc = ctypes.CDLL(None, use_errno=True)

    def slack() -> int:
        with open(f"/proc/{threading.get_native_id()}/timerslack_ns") as f:  # this thread's own, by its id
            return int(f.read())

    seen: list[int] = []

    def watcher() -> None:
        assert libc.prctl(29, ctypes.c_ulong(50_000), 0, 0, 0) == 0  # PR_SET_TIMERSLACK: the default, whatever
        seen.append(slack())  # this thread inherited from the one that made it
        lib.hccl_words_wait(ffi.cast("uint64_t *", addr.ctypes.data), ffi.cast("uint32_t *", gen.ctypes.data), 1,
                            ffi.cast("uint32_t *", bump.ctypes.data), 0, 0, 20_000, 1_000_000)
        seen.append(slack())

    mine = slack()
    t = threading.Thread(target=watcher)
    t.start()
    t.join(10)
    assert seen == [50_000, 1]
    assert slack() == mine  # the caller's thread keeps its own
