"""The vendor-library bindings (hetccl.bindings): NCCL/RCCL (ccl), the library search (search) and the driver's
stream memory operations (streamops).

On CPU-only CI, without a GPU call:
  * the cffi declarations parse; ncclConfig_t / ncclUniqueId layouts and the enum values are NCCL's;
  * hetccl's DType / ReduceOp map onto ncclDataType_t / ncclRedOp_t, all of them;
  * library resolution: the env variables (missing file, a real library without the symbols: the C math
    library), the nvidia wheel layout in site-packages, the "nothing found" message listing every place;
  * unique ids survive the byte round trip; ncclConfig_t is made like NCCL_CONFIG_INITIALIZER;
  * with a C compiler: a stub NCCL library built here checks what the wrappers pass and return;
  * with a real NCCL (HETCCL_NCCL_LIB or the nvidia-nccl wheel installed): ncclGetVersion and
    ncclGetErrorString for real, and the declarations against the nccl.h shipped next to it;
  * the stream memory operations' declarations parse, and loading them where they cannot run is an Unavailable.
On a GPU with a real NCCL only (skipped elsewhere): one-rank non-blocking and two-rank NCCL collectives.
"""

from __future__ import annotations

import ctypes.util
import importlib
import os
import shutil
import subprocess
import sys
import textwrap

import cffi
import pytest

from hetccl.bindings import ccl
from hetccl.bindings.ccl import (
    CclDataType,
    CclRedOp,
    CclResult,
    bytes_to_unique_id,
    ccl_dtype,
    ccl_op,
    decode_version,
    make_config,
    unique_id_to_bytes,
    version_code,
)
from hetccl.bindings.search import file_of_symbol
from hetccl.dtypes import DType, ReduceOp
from hetccl.errors import ConfigError, HetcclError, TransportError

ENV_VARS = ("HETCCL_NCCL_LIB", "HETCCL_RCCL_LIB")


def _libm() -> str:
    name = ctypes.util.find_library("m")
    path = file_of_symbol(name, "cos") if name else None
    if not path:
        pytest.skip("cannot locate the C math library to stand in for a library without NCCL symbols")
    return path


@pytest.fixture
def clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# ---------------------------------------------------------------------------------------------------------
# declarations


def test_cdefs_parse():
    cffi.FFI().cdef(ccl.CDEF)
    ffi = ccl.get_ffi()
    assert ffi.sizeof("ncclUniqueId") == ccl.UNIQUE_ID_BYTES == 128
    for fn in ("ncclResult_t(*)(int *)", "ncclResult_t(*)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *)"):
        ffi.typeof(fn)
    assert ffi.sizeof("cudaStream_t") == ffi.sizeof("void *")


def test_config_layout_is_nccl_2_28():
    # offsets as in NCCL 2.28's nccl.h (x86_64 / aarch64 LP64)
    ffi = ccl.get_ffi()
    expected = {"size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20, "minCTAs": 24,
                "maxCTAs": 28, "netName": 32, "splitShare": 40, "trafficClass": 44, "commName": 48,
                "collnetEnable": 56, "CTAPolicy": 60, "shrinkShare": 64, "nvlsCTAs": 68, "nChannelsPerNetPeer": 72,
                "nvlinkCentricSched": 76}
    assert {f: ffi.offsetof("ncclConfig_t", f) for f in expected} == expected
    assert ffi.sizeof("ncclConfig_t") == 80


def test_enum_values_are_nccls():
    ffi = ccl.get_ffi()
    documented_types = {"ncclInt8": 0, "ncclUint8": 1, "ncclInt32": 2, "ncclUint32": 3, "ncclInt64": 4,
                        "ncclUint64": 5, "ncclFloat16": 6, "ncclFloat32": 7, "ncclFloat64": 8, "ncclBfloat16": 9}
    documented_ops = {"ncclSum": 0, "ncclProd": 1, "ncclMax": 2, "ncclMin": 3, "ncclAvg": 4}
    documented_results = {"ncclSuccess": 0, "ncclUnhandledCudaError": 1, "ncclSystemError": 2,
                          "ncclInternalError": 3, "ncclInvalidArgument": 4, "ncclInvalidUsage": 5,
                          "ncclRemoteError": 6, "ncclInProgress": 7, "ncclTimeout": 8}
    assert ffi.typeof("ncclDataType_t").relements == documented_types
    assert ffi.typeof("ncclRedOp_t").relements == documented_ops
    assert ffi.typeof("ncclResult_t").relements == documented_results
    assert ffi.sizeof("ncclDataType_t") == ffi.sizeof("ncclRedOp_t") == ffi.sizeof("ncclResult_t") == 4
    # the Python enums say the same
    assert {"nccl" + m.name.title(): m.value for m in CclDataType} == documented_types
    assert {m.name: m.value for m in CclRedOp} == {k[4:].upper(): v for k, v in documented_ops.items()}
    assert [m.value for m in CclResult] == list(documented_results.values())


def test_dtype_and_op_mapping_covers_hetccl():
    ffi = ccl.get_ffi()
    names = ffi.typeof("ncclDataType_t").relements
    for dt in DType:
        assert names["nccl" + dt.name.title()] == ccl_dtype(dt)
    expected_ops = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.AVG: 4}
    assert {op: int(ccl_op(op)) for op in ReduceOp} == expected_ops
    # the CCL enums pass through; raw numbers that could mean either are refused
    assert ccl_dtype(CclDataType.UINT32) is CclDataType.UINT32
    assert ccl_op(CclRedOp.MAX) is CclRedOp.MAX
    with pytest.raises(ConfigError):
        ccl_dtype(99)
    with pytest.raises(ConfigError):
        ccl_op(42)


def test_version_codes():
    assert version_code(2, 8, 4) == 2804
    assert version_code(2, 18, 0) == 21800
    assert version_code(2, 28, 9) == 22809
    for v in ((2, 8, 4), (2, 18, 3), (2, 28, 9), (3, 0, 1)):
        assert decode_version(version_code(*v)) == v


# ---------------------------------------------------------------------------------------------------------
# unique ids and configs


def test_unique_id_round_trip():
    data = bytes(range(7, 135))
    uid = bytes_to_unique_id(data)
    assert ccl.get_ffi().typeof(uid).cname == "ncclUniqueId *"
    assert unique_id_to_bytes(uid) == data
    assert unique_id_to_bytes(uid[0]) == data  # the struct itself, as passed by value
    assert unique_id_to_bytes(bytes_to_unique_id(bytearray(data))) == data
    with pytest.raises(ConfigError, match="128 bytes"):
        bytes_to_unique_id(data[:100])
    import msgpack  # the control plane carries it as a bin field

    assert unique_id_to_bytes(bytes_to_unique_id(msgpack.unpackb(msgpack.packb({"id": data}))["id"])) == data


def test_config_like_nccl_config_initializer():
    ffi = ccl.get_ffi()
    cfg = make_config("nccl", 22809, blocking=0, netName="Socket", commName="hetccl", nvlsCTAs=None)
    p = cfg.ptr
    assert p.magic == 0xCAFEBEEF and p.version == 22809 and p.size == ffi.sizeof("ncclConfig_t")
    assert p.blocking == 0
    assert ffi.string(p.netName) == b"Socket" and ffi.string(p.commName) == b"hetccl"
    for field in ("cgaClusterSize", "minCTAs", "maxCTAs", "splitShare", "trafficClass", "collnetEnable", "CTAPolicy",
                  "shrinkShare", "nvlsCTAs", "nChannelsPerNetPeer", "nvlinkCentricSched"):
        assert getattr(p, field) == ccl.CONFIG_UNDEF_INT == -(2**31)
    # an older library reads a shorter struct: size stops before the first field it does not know
    old = make_config("nccl", 21805, splitShare=1).ptr
    assert old.size == ffi.offsetof("ncclConfig_t", "commName") and old.version == 21805
    assert make_config("nccl", 22700).ptr.size == ffi.offsetof("ncclConfig_t", "nChannelsPerNetPeer")
    assert make_config("rccl", 22203, blocking=0).ptr.size == ffi.offsetof("ncclConfig_t", "commName")
    assert make_config("nccl", 21805).ptr.netName == ffi.NULL
    with pytest.raises(ConfigError, match="needs NCCL >= 2.27"):
        make_config("nccl", 21805, CTAPolicy=1)
    with pytest.raises(ConfigError, match="RCCL"):
        make_config("rccl", 22203, commName="x")
    with pytest.raises(ConfigError, match="no field"):
        make_config("nccl", 22809, blockng=0)
    with pytest.raises(ConfigError, match="must be an int"):
        make_config("nccl", 22809, blocking="no")


# ---------------------------------------------------------------------------------------------------------
# resolution and its errors


def test_env_lib_missing_file(clean_env, tmp_path):
    missing = str(tmp_path / "nowhere" / "libnccl.so.2")
    clean_env.setenv("HETCCL_NCCL_LIB", missing)
    with pytest.raises(TransportError, match="HETCCL_NCCL_LIB") as err:
        ccl.load_nccl()
    assert missing in str(err.value) and "no such file" in str(err.value)
    assert isinstance(err.value, HetcclError)
    clean_env.setenv("HETCCL_RCCL_LIB", str(tmp_path / "librccl.so"))
    with pytest.raises(TransportError, match="HETCCL_RCCL_LIB=.*librccl.so: no such file"):
        ccl.load_rccl()


def test_env_lib_without_symbols(clean_env):
    libm = _libm()
    for var, load, symbol in (("HETCCL_NCCL_LIB", ccl.load_nccl, "ncclGetVersion"),
                              ("HETCCL_RCCL_LIB", ccl.load_rccl, "ncclGetVersion")):
        clean_env.setenv(var, libm)
        with pytest.raises(TransportError) as err:
            load()
        msg = str(err.value)
        assert var in msg and libm in msg and "lacks the symbols" in msg and symbol in msg, msg
        clean_env.delenv(var)


def test_env_lib_not_a_library(clean_env, tmp_path):
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_text("not an ELF file")
    clean_env.setenv("HETCCL_NCCL_LIB", str(tmp_path))  # a directory holding libnccl.so.2 works too
    with pytest.raises(TransportError, match="cannot be loaded"):
        ccl.load_nccl()


def _fake_site(tmp_path, monkeypatch, rel: str, target: str) -> str:
    """site-packages-like dir on sys.path with `target` copied to `rel` (e.g. nvidia/nccl/lib/libnccl.so.2)."""
    site = tmp_path / "site"
    dest = site / rel
    dest.parent.mkdir(parents=True)
    shutil.copy(target, dest)
    # only this site holds an `nvidia` package, whatever wheels the machine has installed
    others = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "nvidia"))]
    monkeypatch.setattr(sys, "path", [str(site), *others])
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    importlib.invalidate_caches()
    return str(dest)


def test_nothing_found_lists_every_place(clean_env, tmp_path):
    clean_env.setattr(ccl, "system_names", lambda *a: ["libhetccl-test-absent.so.2"])
    clean_env.setattr(ccl, "package_dirs", lambda name: [str(tmp_path / name)])
    with pytest.raises(TransportError) as err:
        ccl.load_nccl()
    msg = str(err.value)
    for part in ("HETCCL_NCCL_LIB: not set", "nvidia-nccl-cu12/cu13 wheel", "not installed",
                 "libhetccl-test-absent.so.2", "pip install nvidia-nccl-cu12", "set HETCCL_NCCL_LIB"):
        assert part in msg, msg
    clean_env.setattr(ccl, "rocm_lib_dirs", lambda: [str(tmp_path / "rocm" / "lib")])
    with pytest.raises(TransportError) as err:
        ccl.load_rccl()
    msg = str(err.value)
    for part in ("HETCCL_RCCL_LIB: not set", str(tmp_path / "rocm" / "lib" / "librccl.so"),
                 "libhetccl-test-absent.so.2", "HETCCL_RCCL_LIB=/path/to/librccl.so"):
        assert part in msg, msg
    # a candidate given as a path that is not there is skipped and named, the search goes on to the next
    clean_env.setattr(ccl, "_nccl_candidates", lambda: [ccl.Candidate("x", str(tmp_path / "libnccl.so.2")),
                                                        ccl.Candidate("y", "libhetccl-test-absent.so.2")])
    with pytest.raises(TransportError, match=r"no usable NCCL >= 2.18 found: tried HETCCL_NCCL_LIB: not set; "
                                             r"x \(.*libnccl.so.2\): no such file; y \(libhetccl-test-absent.so.2\): "
                                             r".*set HETCCL_NCCL_LIB"):
        ccl.load_nccl()


def test_wheel_layout_is_searched(clean_env, tmp_path):
    libm = _libm()
    clean_env.setattr(ccl, "system_names", lambda *a: [])
    where = _fake_site(tmp_path, clean_env, "nvidia/nccl/lib/libnccl.so.2", libm)
    with pytest.raises(TransportError) as err:
        ccl.load_nccl()
    assert f"nvidia-nccl wheel ({where}): loads but lacks the symbols ncclGetVersion" in str(err.value)


def test_cuda13_wheel_layout_is_searched(clean_env, tmp_path):
    libm = _libm()
    clean_env.setattr(ccl, "system_names", lambda *a: [])
    where = _fake_site(tmp_path, clean_env, "nvidia/cu13/lib/libnccl.so.2", libm)
    assert ccl._nccl_candidates() == [ccl.Candidate("nvidia-nccl wheel", where)]


# ---------------------------------------------------------------------------------------------------------
# stub libraries: what the wrappers pass and how they read the answers (needs a C compiler, no GPU)

FAKE_NCCL = r"""
#include <stdio.h>
#include <stdint.h>
#include <stddef.h>
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { size_t size; unsigned int magic; unsigned int version; int blocking; int cga;
                 int minc; int maxc; const char *netName; } head_t;
static char last[512];
#define LOG(...) snprintf(last, sizeof last, __VA_ARGS__)
#define P(x) ((unsigned long)(uintptr_t)(x))
const char *fake_last(void) { return last; }
static unsigned sum(ncclUniqueId id) {
  unsigned s = 0; for (int i = 0; i < 128; i++) s = s * 31u + (unsigned char)id.internal[i]; return s; }
int ncclGetVersion(int *v) { *v = 22809; return 0; }
int ncclGetUniqueId(ncclUniqueId *u) { for (int i = 0; i < 128; i++) u->internal[i] = (char)(i * 7); return 0; }
int ncclCommInitRank(ncclComm_t *c, int n, ncclUniqueId id, int r) {
  *c = (ncclComm_t)(uintptr_t)(0x1000 + r); LOG("init %d %d %u", n, r, sum(id)); return n > 0 ? 0 : 4; }
int ncclCommInitRankConfig(ncclComm_t *c, int n, ncclUniqueId id, int r, void *cfg) {
  head_t *h = cfg; *c = (ncclComm_t)(uintptr_t)(0x1000 + r);
  LOG("initcfg %d %d %u %zu %x %u %d %s", n, r, sum(id), h->size, h->magic, h->version, h->blocking,
      h->netName ? h->netName : "(null)");
  return h->blocking == 0 ? 7 : 0; }
int ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *nc, void *cfg) {
  *nc = color < 0 ? NULL : (ncclComm_t)(uintptr_t)(0x2000 + color * 16 + key);
  LOG("split %lx %d %d %d", P(c), color, key, cfg != NULL); return 0; }
int ncclCommFinalize(ncclComm_t c) { LOG("finalize %lx", P(c)); return 7; }
int ncclCommDestroy(ncclComm_t c) { LOG("destroy %lx", P(c)); return 0; }
int ncclCommAbort(ncclComm_t c) { LOG("abort %lx", P(c)); return 0; }
int ncclCommGetAsyncError(ncclComm_t c, int *e) { *e = 6; return 0; }
int ncclCommCount(ncclComm_t c, int *n) { *n = 4; return 0; }
int ncclCommUserRank(ncclComm_t c, int *r) { *r = (int)(P(c) - 0x1000); return 0; }
const char *ncclGetErrorString(int r) { static char b[64]; snprintf(b, sizeof b, "fake error %d", r); return b; }
const char *ncclGetLastError(ncclComm_t c) { return "fake last error"; }
int ncclAllReduce(const void *s, void *d, size_t n, int dt, int op, ncclComm_t c, void *st) {
  LOG("allreduce %lx %lx %zu %d %d %lx %lx", P(s), P(d), n, dt, op, P(c), P(st)); return n == 13 ? 2 : 0; }
int ncclAllGather(const void *s, void *d, size_t n, int dt, ncclComm_t c, void *st) {
  LOG("allgather %lx %lx %zu %d %lx %lx", P(s), P(d), n, dt, P(c), P(st)); return 0; }
int ncclReduceScatter(const void *s, void *d, size_t n, int dt, int op, ncclComm_t c, void *st) {
  LOG("reducescatter %lx %lx %zu %d %d %lx %lx", P(s), P(d), n, dt, op, P(c), P(st)); return 0; }
int ncclBroadcast(const void *s, void *d, size_t n, int dt, int root, ncclComm_t c, void *st) {
  LOG("broadcast %lx %lx %zu %d %d %lx %lx", P(s), P(d), n, dt, root, P(c), P(st)); return 0; }
int ncclReduce(const void *s, void *d, size_t n, int dt, int op, int root, ncclComm_t c, void *st) {
  LOG("reduce %lx %lx %zu %d %d %d %lx %lx", P(s), P(d), n, dt, op, root, P(c), P(st)); return 0; }
int ncclSend(const void *s, size_t n, int dt, int peer, ncclComm_t c, void *st) {
  LOG("send %lx %zu %d %d %lx %lx", P(s), n, dt, peer, P(c), P(st)); return 0; }
int ncclRecv(void *d, size_t n, int dt, int peer, ncclComm_t c, void *st) {
  LOG("recv %lx %zu %d %d %lx %lx", P(d), n, dt, peer, P(c), P(st)); return 0; }
int ncclGroupStart(void) { LOG("groupstart"); return 0; }
int ncclGroupEnd(void) { LOG("groupend"); return 7; }
"""

def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler to build the stub NCCL library")
    out = tmp_path_factory.mktemp("stubs")
    (out / "libnccl.c").write_text(FAKE_NCCL)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out / "libnccl.so.2"), str(out / "libnccl.c")], check=True)
    return {"libnccl.so.2": str(out / "libnccl.so.2")}


def _last(path: str) -> str:
    ffi = cffi.FFI()
    ffi.cdef("const char *fake_last(void);")
    return ffi.string(ffi.dlopen(path).fake_last()).decode()


def test_stub_nccl_wrappers(clean_env, stubs):
    path = stubs["libnccl.so.2"]
    clean_env.setenv("HETCCL_NCCL_LIB", path)
    nccl = ccl.load_nccl()
    assert nccl is ccl.load_nccl()  # cached per file
    assert (nccl.vendor, nccl.version, nccl.version_code) == ("nccl", (2, 28, 9), 22809)
    assert nccl.path == os.path.realpath(path) and nccl.ffi is ccl.get_ffi()

    uid = nccl.get_unique_id()
    assert uid == bytes((i * 7) % 256 for i in range(128))
    s = 0
    for b in uid:
        s = (s * 31 + b) & 0xFFFFFFFF
    comm = nccl.comm_init_rank(4, uid, 2)  # the 128-byte struct goes by value
    assert _last(path) == f"init 4 2 {s}"
    assert nccl.comm_user_rank(comm) == 2 and nccl.comm_count(comm) == 4
    cfg = nccl.new_config(blocking=0, netName="Socket")
    comm = nccl.comm_init_rank(4, bytes_to_unique_id(uid), 3, config=cfg)  # in progress is not an error
    assert _last(path) == f"initcfg 4 3 {s} 80 cafebeef 22809 0 Socket"
    assert nccl.comm_get_async_error(comm) == CclResult.REMOTE_ERROR

    with pytest.raises(TransportError) as err:
        nccl.comm_init_rank(0, uid, 0)
    msg = str(err.value)
    for part in ("NCCL 2.28.9", "nranks=0", "ncclInvalidArgument (4)", "fake error 4", "fake last error",
                 "NCCL_DEBUG=WARN"):
        assert part in msg, msg

    assert nccl.comm_split(comm, 1, 5) is not None and _last(path) == "split 1003 1 5 0"
    assert nccl.comm_split(comm, ccl.SPLIT_NOCOLOR, 0) is None

    stream = 0xABC0
    assert nccl.all_reduce(0x10, 0x20, 1000, DType.BFLOAT16, ReduceOp.MAX, comm, stream) == 0
    assert _last(path) == "allreduce 10 20 1000 9 2 1003 abc0"
    nccl.all_reduce(0x10, 0x10, 5, DType.FLOAT32, ReduceOp.AVG, comm)  # default stream: NULL
    assert _last(path) == "allreduce 10 10 5 7 4 1003 0"
    with pytest.raises(TransportError, match=r"ncclAllReduce\(count=13\) failed: ncclSystemError \(2\)"):
        nccl.all_reduce(0x10, 0x20, 13, DType.INT8, ReduceOp.SUM, comm, stream)
    nccl.all_gather(0x10, 0x20, 7, DType.INT64, comm, stream)
    assert _last(path) == "allgather 10 20 7 4 1003 abc0"
    nccl.reduce_scatter(0x10, 0x20, 8, DType.FLOAT16, ReduceOp.PROD, comm, stream)
    assert _last(path) == "reducescatter 10 20 8 6 1 1003 abc0"
    nccl.broadcast(0x10, 0x20, 9, DType.UINT8, 1, comm, stream)
    assert _last(path) == "broadcast 10 20 9 1 1 1003 abc0"
    nccl.reduce(0x10, 0x20, 10, DType.FLOAT64, ReduceOp.MIN, 3, comm, stream)
    assert _last(path) == "reduce 10 20 10 8 3 3 1003 abc0"
    assert nccl.group_start() == 0
    nccl.send(0x30, 11, DType.INT32, 1, comm, stream)
    assert _last(path) == "send 30 11 2 1 1003 abc0"
    nccl.recv(0x40, 12, CclDataType.UINT64, 0, comm, stream)
    assert _last(path) == "recv 40 12 5 0 1003 abc0"
    assert nccl.group_end() == CclResult.IN_PROGRESS
    assert nccl.comm_finalize(comm) == CclResult.IN_PROGRESS
    nccl.comm_abort(comm)
    assert _last(path) == "abort 1003"
    nccl.comm_destroy(comm)
    assert _last(path) == "destroy 1003"


def test_stub_nccl_found_through_the_wheel_layout(clean_env, tmp_path, stubs):
    clean_env.setattr(ccl, "system_names", lambda *a: [])
    where = _fake_site(tmp_path, clean_env, "nvidia/nccl/lib/libnccl.so.2", stubs["libnccl.so.2"])
    nccl = ccl.load_nccl()
    assert nccl.path == os.path.realpath(where) and nccl.version == (2, 28, 9)


# ---------------------------------------------------------------------------------------------------------
# a real NCCL, when one can be found (HETCCL_NCCL_LIB, the nvidia-nccl wheel, the system); never a GPU call


@pytest.fixture(scope="module")
def real_nccl():
    try:
        lib = ccl.load_nccl()
    except TransportError as exc:
        pytest.skip(f"no real NCCL on this machine ({str(exc)[:120]}...)")
    return lib


def test_real_nccl_version_and_error_strings(real_nccl):
    ffi = real_nccl.ffi
    v = ffi.new("int *")
    assert real_nccl.lib.ncclGetVersion(v) == 0
    assert decode_version(v[0]) == real_nccl.version >= (2, 18, 0)
    assert real_nccl.error_string(0) == "no error"
    for code in list(CclResult)[1:8]:
        assert real_nccl.error_string(code)
    assert "invalid argument" in real_nccl.error_string(CclResult.INVALID_ARGUMENT)
    msg = real_nccl.describe(CclResult.REMOTE_ERROR, "ncclAllReduce")
    assert "remote process exited" in msg and "ncclCommAbort" in msg


def test_real_nccl_header_matches_the_declarations(real_nccl, tmp_path):
    header = os.path.join(os.path.dirname(os.path.dirname(real_nccl.path)), "include", "nccl.h")
    cc = _compiler()
    if not os.path.exists(header) or cc is None:
        pytest.skip("no nccl.h next to the library, or no C compiler")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "cuda_runtime.h").write_text(
        "#define CUDART_VERSION 12000\ntypedef void *cudaStream_t;\ntypedef void *cudaEvent_t;\n")
    (stub / "cuda_fp16.h").write_text("")
    (stub / "cuda_bf16.h").write_text("")
    ffi = ccl.get_ffi()
    fields = [f for f, _ in ffi.typeof("ncclConfig_t").fields]
    enums = {**ffi.typeof("ncclDataType_t").relements, **ffi.typeof("ncclRedOp_t").relements}
    lines = [f'printf("{f} %zu\\n", offsetof(ncclConfig_t, {f}));' for f in fields if f != "size"]
    lines += [f'printf("{n} %d\\n", (int){n});' for n in enums]
    lines += ['printf("uid %zu\\n", sizeof(ncclUniqueId));', 'printf("api_magic %u\\n", (unsigned)NCCL_API_MAGIC);']
    (tmp_path / "check.c").write_text(textwrap.dedent("""\
        #include <stdio.h>
        #include <stddef.h>
        #include "nccl.h"
        #ifndef NCCL_API_MAGIC
        #define NCCL_API_MAGIC 0xcafebeef
        #endif
        int main(void) {
        """) + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "check"
    subprocess.run([cc, "-I", str(stub), "-I", os.path.dirname(header), str(tmp_path / "check.c"), "-o", str(exe)],
                   check=True)
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.splitlines())
    for f in fields:
        if f != "size":
            assert int(got[f]) == ffi.offsetof("ncclConfig_t", f), f
    for n, v in enums.items():
        assert int(got[n]) == v, n
    assert int(got["uid"]) == 128 and int(got["api_magic"]) == ccl.CONFIG_MAGIC


# ---------------------------------------------------------------------------------------------------------
# on a GPU machine only (torch with CUDA and a real NCCL); skipped everywhere else


@pytest.fixture(scope="module")
def gpu():
    torch = pytest.importorskip("torch", reason="the GPU checks use torch for device memory")
    if not torch.cuda.is_available():
        pytest.skip("no GPU visible")
    try:
        nccl = ccl.load_nccl()
    except TransportError as exc:
        pytest.skip(f"no NCCL: {exc}")
    return torch, nccl


def _wait(poll, what: str, timeout: float = 120.0):
    import time

    deadline = time.monotonic() + timeout
    while True:
        res = poll()
        if res is not None:
            return res
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not finish in {timeout} s")
        time.sleep(0.001)


def test_gpu_nccl_one_rank_non_blocking(gpu, monkeypatch):
    torch, nccl = gpu
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(0)
    comm = nccl.comm_init_rank(1, nccl.get_unique_id(), 0, config=nccl.new_config(blocking=0))
    state = _wait(lambda: (lambda r: None if r == CclResult.IN_PROGRESS else r)(nccl.comm_get_async_error(comm)),
                  "non-blocking init")
    assert state == CclResult.SUCCESS
    assert nccl.comm_count(comm) == 1 and nccl.comm_user_rank(comm) == 0
    x = torch.arange(1000, dtype=torch.float32, device="cuda:0")
    y = torch.empty_like(x)
    stream = torch.cuda.current_stream(0).cuda_stream
    nccl.all_reduce(x.data_ptr(), y.data_ptr(), x.numel(), DType.FLOAT32, ReduceOp.SUM, comm, stream)
    _wait(lambda: (lambda r: None if r == CclResult.IN_PROGRESS else r)(nccl.comm_get_async_error(comm)),
          "non-blocking all_reduce")
    torch.cuda.synchronize(0)
    assert torch.equal(x, y)
    nccl.comm_finalize(comm)
    _wait(lambda: (lambda r: None if r == CclResult.IN_PROGRESS else r)(nccl.comm_get_async_error(comm)),
          "finalize")
    nccl.comm_destroy(comm)


def test_gpu_nccl_two_ranks_one_process(gpu, monkeypatch):
    torch, nccl = gpu
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    uid = nccl.get_unique_id()
    nccl.group_start()
    comms = []
    for r in range(2):
        torch.cuda.set_device(r)
        comms.append(nccl.comm_init_rank(2, uid, r))
    nccl.group_end()
    torch_dtypes = {DType.INT8: torch.int8, DType.UINT8: torch.uint8, DType.INT32: torch.int32,
                    DType.INT64: torch.int64, DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
                    DType.FLOAT32: torch.float32, DType.FLOAT64: torch.float64}
    try:
        for dt, tdt in torch_dtypes.items():
            xs = [torch.full((4096,), r + 1, dtype=tdt, device=f"cuda:{r}") for r in range(2)]
            ys = [torch.empty(8192, dtype=tdt, device=f"cuda:{r}") for r in range(2)]
            nccl.group_start()
            for r in range(2):
                nccl.all_reduce(xs[r].data_ptr(), xs[r].data_ptr(), 4096, dt, ReduceOp.SUM, comms[r],
                                torch.cuda.current_stream(r).cuda_stream)
            nccl.group_end()
            nccl.group_start()
            for r in range(2):
                nccl.all_gather(xs[r].data_ptr(), ys[r].data_ptr(), 4096, dt, comms[r],
                                torch.cuda.current_stream(r).cuda_stream)
            nccl.group_end()
            for r in range(2):
                torch.cuda.synchronize(r)
                assert (xs[r] == 3).all(), dt
                assert (ys[r] == 3).all(), dt
    finally:
        for c in comms:
            nccl.comm_destroy(c)


def test_stream_memops_declarations_and_unavailability(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream memory operations (GPU-signalled cross-island link) parse, and fail with a clear
    Unavailable (a TransportError the link turns into the CPU-signalled fallback) where they cannot run."""
    from hetccl.bindings import streamops

    ffi = cffi.FFI()
    ffi.cdef(streamops.CDEF)
    monkeypatch.setattr(streamops, "_cache", {})
    monkeypatch.setenv("HETCCL_STREAM_MEMOPS", "0")
    with pytest.raises(streamops.Unavailable, match="HETCCL_STREAM_MEMOPS=0"):
        streamops.load_streamops("cuda")
    monkeypatch.delenv("HETCCL_STREAM_MEMOPS")
    monkeypatch.setenv("HETCCL_HIP_LIB", "/nonexistent/libamdhip64.so")
    with pytest.raises(streamops.Unavailable, match="cannot be loaded") as info:
        streamops.load_streamops("hip")
    assert isinstance(info.value, TransportError)
    if ctypes.util.find_library("cuda") is None:  # CI: no GPU driver
        with pytest.raises(streamops.Unavailable, match="libcuda"):
            streamops.load_streamops("cuda")
