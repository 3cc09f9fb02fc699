"""cffi ABI-mode binding of the NCCL API that hetccl uses; RCCL exports the same API and is bound by the same
declarations.

Nothing is compiled: `CDEF` is parsed by cffi and the library is dlopen'ed at run time. `load_nccl()` looks in
order at `$HETCCL_NCCL_LIB`, the `nvidia-nccl-cu12` / `nvidia-nccl-cu13` wheel (`nvidia/nccl/lib/libnccl.so.2`
in site-packages, found without importing torch), then the system `libnccl.so.2`. `load_rccl()` looks at
`$HETCCL_RCCL_LIB`, `$ROCM_PATH/lib` and `/opt/rocm/lib`, the ROCm libraries bundled in a ROCm torch wheel
(found without importing torch), then the system `librccl.so`. Loaded libraries are cached per file.

Streams are `void *` (a `cudaStream_t` or `hipStream_t`, e.g. `torch.cuda.current_stream().cuda_stream` or
`cupy.cuda.get_current_stream().ptr`); device buffers are `void *` too. The thin wrappers of `CclLibrary`
accept plain integers for both, and hetccl's `DType` / `ReduceOp` for types and operations.

`ncclConfig_t` is declared with the fields of NCCL 2.28 (the struct is versioned and append-only). Like
NCCL_CONFIG_INITIALIZER, `CclLibrary.new_config()` fills it with `size`, `magic` 0xcafebeef, `version` =
NCCL_VERSION(major, minor, patch) of the *loaded* library and every field NCCL_CONFIG_UNDEF_INT (INT_MIN) or
NULL; `size` covers only the fields that the loaded library reads (NCCL copies `size` bytes and keeps its
defaults for the rest), so one declaration serves every NCCL >= 2.18 and RCCL, whose struct shares the prefix
up to `trafficClass`. Never pass a config that was not made that way: NCCL rejects or misreads it.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable
from typing import Any

from ..dtypes import DType, ReduceOp
from ..errors import ConfigError, TransportError
from .search import (
    Candidate,
    Tried,
    Unusable,
    file_of_symbol,
    name_missing,
    package_dirs,
    rocm_lib_dirs,
    search_library,
    short_oserror,
    system_names,
)

# ---------------------------------------------------------------------------------------------------------
# Declarations (from NCCL's public nccl.h; RCCL's rccl.h declares the same functions and values)

CDEF = r"""
typedef struct ncclComm *ncclComm_t;
typedef void *cudaStream_t;                 /* cudaStream_t for NCCL, hipStream_t for RCCL */

typedef struct { char internal[128]; } ncclUniqueId;

typedef enum {
    ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
    ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7,
    ncclTimeout = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
    ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

typedef struct {
    size_t size;                 /* bytes of this struct that the library may read */
    unsigned int magic;          /* 0xcafebeef */
    unsigned int version;        /* NCCL_VERSION code */
    int blocking;                /* 2.14 */
    int cgaClusterSize;          /* 2.17 */
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;              /* 2.18 */
    int trafficClass;            /* 2.25 (RCCL: present with splitShare) */
    const char *commName;
    int collnetEnable;           /* 2.27 */
    int CTAPolicy;
    int shrinkShare;
    int nvlsCTAs;
    int nChannelsPerNetPeer;     /* 2.28 */
    int nvlinkCentricSched;
} ncclConfig_t;

ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
"""

# every symbol above; a library without one of them is refused (ncclCommSplit needs NCCL/RCCL >= 2.18)
REQUIRED_SYMBOLS = (
    "ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommInitRankConfig", "ncclCommSplit",
    "ncclCommFinalize", "ncclCommDestroy", "ncclCommAbort", "ncclCommGetAsyncError", "ncclCommCount",
    "ncclCommUserRank", "ncclGetErrorString", "ncclGetLastError", "ncclAllReduce", "ncclAllGather",
    "ncclReduceScatter", "ncclBroadcast", "ncclReduce", "ncclSend", "ncclRecv", "ncclGroupStart",
    "ncclGroupEnd",
)

UNIQUE_ID_BYTES = 128
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
SPLIT_NOCOLOR = -1


_ffi: Any = None
_ffi_lock = threading.Lock()


def get_ffi() -> Any:
    """The cffi FFI with CDEF parsed, made once (every loaded NCCL/RCCL shares it, so cdata such as a
    unique id or a config made for one is valid for all)."""
    global _ffi
    if _ffi is None:
        with _ffi_lock:
            if _ffi is None:
                import cffi

                ffi = cffi.FFI()
                ffi.cdef(CDEF)
                _ffi = ffi
    return _ffi


class CclResult(enum.IntEnum):
    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7
    TIMEOUT = 8  # newer NCCL only (not in 2.28)


class CclDataType(enum.IntEnum):
    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9


class CclRedOp(enum.IntEnum):
    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4  # NCCL >= 2.10


_DTYPES = {
    DType.INT8: CclDataType.INT8, DType.UINT8: CclDataType.UINT8, DType.INT32: CclDataType.INT32,
    DType.INT64: CclDataType.INT64, DType.FLOAT16: CclDataType.FLOAT16, DType.BFLOAT16: CclDataType.BFLOAT16,
    DType.FLOAT32: CclDataType.FLOAT32, DType.FLOAT64: CclDataType.FLOAT64,
}
_OPS = {
    ReduceOp.SUM: CclRedOp.SUM, ReduceOp.PROD: CclRedOp.PROD, ReduceOp.MIN: CclRedOp.MIN,
    ReduceOp.MAX: CclRedOp.MAX, ReduceOp.AVG: CclRedOp.AVG,
}


def ccl_dtype(dtype: DType | CclDataType) -> CclDataType:
    """NCCL's ncclDataType_t for a hetccl DType (a CclDataType passes through)."""
    if type(dtype) is CclDataType:
        return dtype
    try:
        return _DTYPES[DType(dtype)]
    except (KeyError, ValueError):
        raise ConfigError(f"dtype {dtype!r} has no NCCL/RCCL equivalent; use one of "
                          f"{', '.join(d.name.lower() for d in _DTYPES)}") from None


def ccl_op(op: ReduceOp | CclRedOp) -> CclRedOp:
    """NCCL's ncclRedOp_t for a hetccl ReduceOp (a CclRedOp passes through)."""
    if type(op) is CclRedOp:
        return op
    try:
        return _OPS[ReduceOp(op)]
    except (KeyError, ValueError):
        raise ConfigError(f"reduce op {op!r} has no NCCL/RCCL equivalent; use sum, prod, min, max or avg") from None


def version_code(major: int, minor: int, patch: int) -> int:
    """NCCL_VERSION(major, minor, patch): the integer ncclGetVersion returns and ncclConfig_t.version holds."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def decode_version(code: int) -> tuple[int, int, int]:
    """(major, minor, patch) from an NCCL_VERSION code (2.8.4 -> 2804, 2.28.9 -> 22809)."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


# ---------------------------------------------------------------------------------------------------------
# Unique ids: 128 opaque bytes, sent to the other ranks over hetccl's control plane


def unique_id_to_bytes(uid: Any) -> bytes:
    """The 128 bytes of an ncclUniqueId (a `ncclUniqueId *` or `ncclUniqueId` cdata)."""
    ffi = get_ffi()
    if ffi.typeof(uid) is ffi.typeof("ncclUniqueId"):
        uid = ffi.addressof(uid)
    if ffi.typeof(uid) is not ffi.typeof("ncclUniqueId *"):
        raise ConfigError(f"expected an ncclUniqueId cdata, got {ffi.typeof(uid).cname}")
    return bytes(ffi.buffer(uid, UNIQUE_ID_BYTES))


def bytes_to_unique_id(data: bytes | bytearray | memoryview) -> Any:
    """A new `ncclUniqueId *` holding `data` (exactly 128 bytes, as unique_id_to_bytes gives)."""
    raw = bytes(data)
    if len(raw) != UNIQUE_ID_BYTES:
        raise ConfigError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}; pass the bytes that "
                          "unique_id_to_bytes / CclLibrary.get_unique_id produced on the root rank")
    ffi = get_ffi()
    uid = ffi.new("ncclUniqueId *")
    ffi.memmove(uid, raw, UNIQUE_ID_BYTES)
    return uid


def _as_unique_id(uid: Any) -> Any:
    if isinstance(uid, bytes | bytearray | memoryview):
        return bytes_to_unique_id(uid)
    ffi = get_ffi()
    if ffi.typeof(uid) is ffi.typeof("ncclUniqueId"):
        return ffi.addressof(uid)
    return uid


# ---------------------------------------------------------------------------------------------------------
# ncclConfig_t

# field -> first NCCL version code that reads it; fields are in declaration order and the versions only grow
_CONFIG_FIELDS: dict[str, int] = {
    "blocking": 21400, "cgaClusterSize": 21700, "minCTAs": 21700, "maxCTAs": 21700, "netName": 21700,
    "splitShare": 21800, "trafficClass": 22500, "commName": 22500, "collnetEnable": 22700, "CTAPolicy": 22700,
    "shrinkShare": 22700, "nvlsCTAs": 22700, "nChannelsPerNetPeer": 22800, "nvlinkCentricSched": 22800,
}
# RCCL's ncclConfig_t is NCCL's up to trafficClass; what follows differs or is absent
_RCCL_CONFIG_FIELDS = ("blocking", "cgaClusterSize", "minCTAs", "maxCTAs", "netName", "splitShare", "trafficClass")
_STRING_FIELDS = ("netName", "commName")


def config_fields(vendor: str, version: int) -> list[str]:
    """The ncclConfig_t fields that `vendor` ('nccl'/'rccl') at NCCL_VERSION code `version` reads."""
    if vendor == "rccl":
        return list(_RCCL_CONFIG_FIELDS)
    return [f for f, since in _CONFIG_FIELDS.items() if version >= since]


class CclConfig:
    """An ncclConfig_t made like NCCL_CONFIG_INITIALIZER for one library; pass `.ptr` to
    ncclCommInitRankConfig / ncclCommSplit. Keeps the strings it points to alive."""

    __slots__ = ("ptr", "fields", "_keep")

    def __init__(self, ptr: Any, fields: dict[str, Any], keep: list[Any]):
        self.ptr, self.fields, self._keep = ptr, fields, keep

    def __repr__(self) -> str:
        return f"CclConfig(size={self.ptr.size}, version={self.ptr.version}, {self.fields})"


def make_config(vendor: str, version: int, **fields: Any) -> CclConfig:
    """ncclConfig_t for `vendor` ('nccl'/'rccl') at NCCL_VERSION code `version`, every field undefined
    (NCCL picks its default) except those given by their NCCL names, e.g. blocking=0 (non-blocking
    communicator: calls may return ncclInProgress), netName="IB", splitShare=1. A field the library
    does not read is refused rather than silently ignored."""
    ffi = get_ffi()
    allowed = config_fields(vendor, version)
    name = "RCCL" if vendor == "rccl" else "NCCL"
    for key in fields:
        if key not in _CONFIG_FIELDS:
            raise ConfigError(f"ncclConfig_t has no field {key!r}; known fields: {', '.join(_CONFIG_FIELDS)}")
        if key not in allowed and fields[key] is not None:
            have = ".".join(map(str, decode_version(version)))
            if vendor == "rccl":
                why = "RCCL's ncclConfig_t ends at trafficClass"
            else:
                why = f"it needs NCCL >= {'.'.join(map(str, decode_version(_CONFIG_FIELDS[key])))}"
            raise ConfigError(f"ncclConfig_t.{key} is not read by the loaded {name} {have} ({why}); leave it unset "
                              "or load a newer library (HETCCL_NCCL_LIB / HETCCL_RCCL_LIB)")
    cfg = ffi.new("ncclConfig_t *")
    # like NCCL_CONFIG_INITIALIZER: every user field undefined (INT_MIN) or NULL
    for key in _CONFIG_FIELDS:
        if key not in _STRING_FIELDS:
            setattr(cfg, key, CONFIG_UNDEF_INT)
    # `size` covers only what this library reads (rounded up to the struct's alignment, as a sizeof would be)
    unread = [f for f in _CONFIG_FIELDS if f not in allowed]
    size = ffi.offsetof("ncclConfig_t", unread[0]) if unread else ffi.sizeof("ncclConfig_t")
    align = ffi.alignof("ncclConfig_t")
    cfg.size = (size + align - 1) // align * align
    cfg.magic = CONFIG_MAGIC
    cfg.version = version
    keep: list[Any] = []
    given: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None:
            continue
        if key in _STRING_FIELDS:
            buf = ffi.new("char[]", str(value).encode())
            keep.append(buf)
            setattr(cfg, key, buf)
        else:
            try:
                setattr(cfg, key, int(value))
            except (TypeError, ValueError, OverflowError):
                raise ConfigError(f"ncclConfig_t.{key} must be an int, got {value!r}") from None
        given[key] = value
    return CclConfig(cfg, given, keep)


# ---------------------------------------------------------------------------------------------------------
# Errors

_HINTS: dict[int, str] = {
    CclResult.UNHANDLED_CUDA_ERROR: (
        "a {rt} call inside {name} failed: check that the buffers are device memory of the communicator's GPU, "
        "that the stream belongs to that GPU and that the device is healthy; NCCL_DEBUG=WARN prints the {rt} error"),
    CclResult.SYSTEM_ERROR: (
        "a system call or the network failed (socket, /dev/shm too small in a container, or a peer process "
        "died); NCCL_DEBUG=WARN shows which, NCCL_SOCKET_IFNAME picks the interface"),
    CclResult.INTERNAL_ERROR: (
        "{name} hit an internal check, often a peer that died or ranks running different {name} versions; "
        "rerun with NCCL_DEBUG=INFO"),
    CclResult.INVALID_ARGUMENT: (
        "an argument was refused (null or host pointer, count, dtype, op, root or peer out of range, a stream "
        "of another device, a config not made by new_config); NCCL_DEBUG=WARN names it"),
    CclResult.INVALID_USAGE: (
        "the API was used out of order: ranks issuing different collectives, a communicator used after "
        "destroy/abort, two ranks on one GPU, or unbalanced ncclGroupStart/End"),
    CclResult.REMOTE_ERROR: (
        "a peer process died or the network between ranks failed; abort this communicator "
        "(ncclCommAbort) and create a new one"),
    CclResult.IN_PROGRESS: (
        "the operation is still running on a non-blocking communicator; poll ncclCommGetAsyncError until it "
        "leaves ncclInProgress"),
    CclResult.TIMEOUT: "{name} gave up waiting for peers; check that every rank made the same call",
}


def _result_name(code: int) -> str:
    try:
        return "nccl" + "".join(w.capitalize() for w in CclResult(code).name.split("_"))
    except ValueError:
        return f"ncclResult {code}"


# ---------------------------------------------------------------------------------------------------------
# A loaded library


def _vp(ffi: Any, x: Any, ctype: str = "void *") -> Any:
    if x is None:
        return ffi.NULL
    if isinstance(x, int):
        return ffi.cast(ctype, x)
    return x


class CclLibrary:
    """One loaded NCCL or RCCL. `lib` is the raw cffi library (every function of CDEF), `ffi` its FFI;
    the methods are thin wrappers that take integers for pointers and streams, hetccl dtypes/ops, and
    raise TransportError through `check`."""

    def __init__(self, vendor: str, path: str, lib: Any, version: int):
        self.vendor = vendor  # "nccl" | "rccl"
        self.name = "RCCL" if vendor == "rccl" else "NCCL"
        self.runtime = "HIP" if vendor == "rccl" else "CUDA"
        self.path = path
        self.lib = lib
        self.ffi = get_ffi()
        self.version_code = version
        self.version = decode_version(version)

    def __repr__(self) -> str:
        return f"CclLibrary({self.vendor} {'.'.join(map(str, self.version))} at {self.path})"

    # -- errors
    def error_string(self, result: int) -> str:
        s = self.lib.ncclGetErrorString(int(result))
        return self.ffi.string(s).decode(errors="replace") if s != self.ffi.NULL else ""

    def last_error(self, comm: Any = None) -> str:
        s = self.lib.ncclGetLastError(comm if comm is not None else self.ffi.NULL)
        return self.ffi.string(s).decode(errors="replace") if s != self.ffi.NULL else ""

    def check(self, result: int, what: str, comm: Any = None, allow_in_progress: bool = False) -> int:
        """Return `result` when it is ncclSuccess (or ncclInProgress with allow_in_progress), else raise
        TransportError naming the call, the library's error string, its last error and what to do."""
        if result == 0 or (allow_in_progress and result == CclResult.IN_PROGRESS):
            return int(result)
        raise TransportError(self.describe(result, what, comm))

    def describe(self, result: int, what: str, comm: Any = None) -> str:
        msg = (f"{self.name} {'.'.join(map(str, self.version))} {what} failed: {_result_name(result)} "
               f"({int(result)}): {self.error_string(result)}")
        try:
            last = self.last_error(comm)
        except Exception:  # never hide the original error
            last = ""
        if last:
            msg += f" (last error: {last.strip()})"
        hint = _HINTS.get(int(result))
        if hint:
            msg += "; " + hint.format(name=self.name, rt=self.runtime)
        return msg

    # -- setup
    def get_unique_id(self) -> bytes:
        """ncclGetUniqueId on the root rank; the 128 bytes go to every rank (bytes_to_unique_id there)."""
        uid = self.ffi.new("ncclUniqueId *")
        self.check(self.lib.ncclGetUniqueId(uid), "ncclGetUniqueId")
        return unique_id_to_bytes(uid)

    def new_config(self, **fields: Any) -> CclConfig:
        """An ncclConfig_t for this library (see make_config), e.g. new_config(blocking=0)."""
        return make_config(self.vendor, self.version_code, **fields)

    def comm_init_rank(self, nranks: int, unique_id: Any, rank: int, config: CclConfig | None = None) -> Any:
        """A new communicator (ncclComm_t) of `nranks` with this process as `rank`, on the current device.
        With a non-blocking config the call may return before the communicator is ready: poll
        comm_get_async_error until it is no longer IN_PROGRESS."""
        uid = _as_unique_id(unique_id)
        out = self.ffi.new("ncclComm_t *")
        what = f"communicator init (nranks={nranks}, rank={rank})"
        if config is None:
            self.check(self.lib.ncclCommInitRank(out, nranks, uid[0], rank), what)
        else:
            self.check(self.lib.ncclCommInitRankConfig(out, nranks, uid[0], rank, config.ptr), what,
                       comm=out[0], allow_in_progress=True)
        return out[0]

    def comm_split(self, comm: Any, color: int, key: int, config: CclConfig | None = None) -> Any:
        """ncclCommSplit; None for color=SPLIT_NOCOLOR (this rank joins no new communicator)."""
        out = self.ffi.new("ncclComm_t *")
        self.check(self.lib.ncclCommSplit(comm, color, key, out, config.ptr if config else self.ffi.NULL),
                   f"ncclCommSplit(color={color}, key={key})", comm=comm, allow_in_progress=True)
        return None if out[0] == self.ffi.NULL else out[0]

    def comm_get_async_error(self, comm: Any) -> int:
        """The communicator's state: SUCCESS, IN_PROGRESS (non-blocking work still running) or an error."""
        out = self.ffi.new("ncclResult_t *")
        self.check(self.lib.ncclCommGetAsyncError(comm, out), "ncclCommGetAsyncError", comm=comm)
        return int(out[0])

    def comm_count(self, comm: Any) -> int:
        out = self.ffi.new("int *")
        self.check(self.lib.ncclCommCount(comm, out), "ncclCommCount", comm=comm)
        return int(out[0])

    def comm_user_rank(self, comm: Any) -> int:
        out = self.ffi.new("int *")
        self.check(self.lib.ncclCommUserRank(comm, out), "ncclCommUserRank", comm=comm)
        return int(out[0])

    def comm_finalize(self, comm: Any) -> int:
        return self.check(self.lib.ncclCommFinalize(comm), "ncclCommFinalize", comm=comm, allow_in_progress=True)

    def comm_destroy(self, comm: Any) -> int:
        return self.check(self.lib.ncclCommDestroy(comm), "ncclCommDestroy", comm=comm, allow_in_progress=True)

    def comm_abort(self, comm: Any) -> int:
        """Abort in-flight work and free the communicator (the way out after an async error or a timeout)."""
        return self.check(self.lib.ncclCommAbort(comm), "ncclCommAbort", comm=comm, allow_in_progress=True)

    # -- operations; each returns SUCCESS or IN_PROGRESS (non-blocking communicators) and raises otherwise.
    # The hot path: the error message is only built on failure.
    def _done(self, res: int, what: Callable[[], str], comm: Any) -> int:
        if res == 0 or res == CclResult.IN_PROGRESS:
            return res
        raise TransportError(self.describe(res, what(), comm))

    def group_start(self) -> int:
        return self.check(self.lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> int:
        return self.check(self.lib.ncclGroupEnd(), "ncclGroupEnd", allow_in_progress=True)

    def all_reduce(self, send: Any, recv: Any, count: int, dtype: DType | CclDataType, op: ReduceOp | CclRedOp,
                   comm: Any, stream: Any = None) -> int:
        ffi = self.ffi
        res = self.lib.ncclAllReduce(_vp(ffi, send), _vp(ffi, recv), count, ccl_dtype(dtype), ccl_op(op), comm,
                                     _vp(ffi, stream, "cudaStream_t"))
        return self._done(res, lambda: f"ncclAllReduce(count={count})", comm)

    def all_gather(self, send: Any, recv: Any, sendcount: int, dtype: DType | CclDataType, comm: Any,
                   stream: Any = None) -> int:
        ffi = self.ffi
        res = self.lib.ncclAllGather(_vp(ffi, send), _vp(ffi, recv), sendcount, ccl_dtype(dtype), comm,
                                     _vp(ffi, stream, "cudaStream_t"))
        return self._done(res, lambda: f"ncclAllGather(sendcount={sendcount})", comm)

    def reduce_scatter(self, send: Any, recv: Any, recvcount: int, dtype: DType | CclDataType,
                       op: ReduceOp | CclRedOp, comm: Any, stream: Any = None) -> int:
        ffi = self.ffi
        res = self.lib.ncclReduceScatter(_vp(ffi, send), _vp(ffi, recv), recvcount, ccl_dtype(dtype), ccl_op(op),
                                         comm, _vp(ffi, stream, "cudaStream_t"))
        return self._done(res, lambda: f"ncclReduceScatter(recvcount={recvcount})", comm)

    def broadcast(self, send: Any, recv: Any, count: int, dtype: DType | CclDataType, root: int, comm: Any,
                  stream: Any = None) -> int:
        ffi = self.ffi
        res = self.lib.ncclBroadcast(_vp(ffi, send), _vp(ffi, recv), count, ccl_dtype(dtype), root, comm,
                                     _vp(ffi, stream, "cudaStream_t"))
        return self._done(res, lambda: f"ncclBroadcast(count={count}, root={root})", comm)

    def reduce(self, send: Any, recv: Any, count: int, dtype: DType | CclDataType, op: ReduceOp | CclRedOp,
               root: int, comm: Any, stream: Any = None) -> int:
        ffi = self.ffi
        res = self.lib.ncclReduce(_vp(ffi, send), _vp(ffi, recv), count, ccl_dtype(dtype), ccl_op(op), root, comm,
                                  _vp(ffi, stream, "cudaStream_t"))
        return self._done(res, lambda: f"ncclReduce(count={count}, root={root})", comm)

    def send(self, buf: Any, count: int, dtype: DType | CclDataType, peer: int, comm: Any, stream: Any = None) -> int:
        ffi = self.ffi
        res = self.lib.ncclSend(_vp(ffi, buf), count, ccl_dtype(dtype), peer, comm, _vp(ffi, stream, "cudaStream_t"))
        return self._done(res, lambda: f"ncclSend(count={count}, peer={peer})", comm)

    def recv(self, buf: Any, count: int, dtype: DType | CclDataType, peer: int, comm: Any, stream: Any = None) -> int:
        ffi = self.ffi
        res = self.lib.ncclRecv(_vp(ffi, buf), count, ccl_dtype(dtype), peer, comm, _vp(ffi, stream, "cudaStream_t"))
        return self._done(res, lambda: f"ncclRecv(count={count}, peer={peer})", comm)


# ---------------------------------------------------------------------------------------------------------
# Finding and loading

_cache: dict[tuple[str, str], CclLibrary] = {}  # (vendor, resolved file) -> library
_lock = threading.RLock()


def _open(vendor: str, path: str) -> CclLibrary:
    """dlopen `path` (a file or a bare soname), check its symbols and version; cached per resolved file."""
    ffi = get_ffi()
    is_file = os.sep in path
    key = os.path.realpath(path) if is_file else None
    if key is not None and (vendor, key) in _cache:
        return _cache[vendor, key]
    name = "RCCL" if vendor == "rccl" else "NCCL"
    try:
        # RTLD_DEEPBIND: the library's calls into itself bind to its own symbols, not to those of another build
        # already loaded globally (torch preloads its NCCL with RTLD_GLOBAL); each island may run its own build
        lib = ffi.dlopen(path, ffi.RTLD_NOW | ffi.RTLD_LOCAL | getattr(ffi, "RTLD_DEEPBIND", os.RTLD_DEEPBIND))
    except OSError as exc:
        raise Unusable(f"cannot be loaded: {short_oserror(exc)}") from None
    missing = []
    for sym in REQUIRED_SYMBOLS:
        try:
            getattr(lib, sym)
        except AttributeError:
            missing.append(sym)
    if missing:
        ffi.dlclose(lib)
        what = ("is not an NCCL/RCCL library" if "ncclGetVersion" in missing
                else f"is older than the {name} 2.18 that hetccl needs")
        raise Unusable(f"loads but lacks the symbols {name_missing(missing)}: it {what}")
    if key is None:
        key = file_of_symbol(path, "ncclGetVersion") or path
        if (vendor, key) in _cache:
            ffi.dlclose(lib)
            return _cache[vendor, key]
    code = ffi.new("int *")
    res = lib.ncclGetVersion(code)
    if res != 0:
        ffi.dlclose(lib)
        raise Unusable(f"ncclGetVersion failed with ncclResult {res}")
    loaded = CclLibrary(vendor, key, lib, int(code[0]))
    _cache[vendor, key] = loaded
    return loaded


def _load(vendor: str, env: str, default_file: str, candidates: Callable[[], list[Candidate | Tried]],
          searched: str, install: str) -> CclLibrary:
    what = "RCCL >= 2.18" if vendor == "rccl" else "NCCL >= 2.18"
    with _lock:
        return search_library(what, env, default_file, candidates, lambda p: _open(vendor, p), searched, install)


def _nccl_candidates() -> list[Candidate | Tried]:
    out: list[Candidate | Tried] = []
    dirs = package_dirs("nvidia")
    wheel = [os.path.join(d, sub, "lib", "libnccl.so.2") for d in dirs for sub in ("nccl", "cu13", "cu12")]
    found = [p for p in wheel if os.path.isfile(p)]
    if found:
        out += [Candidate("nvidia-nccl wheel", p) for p in found]
    elif dirs:
        out.append(Tried("nvidia-nccl-cu12/cu13 wheel", os.path.join(dirs[0], "nccl", "lib", "libnccl.so.2"),
                         "not installed"))
    else:
        out.append(Tried("nvidia-nccl-cu12/cu13 wheel", "site-packages/nvidia/nccl/lib/libnccl.so.2",
                         "not installed (no 'nvidia' package on sys.path)"))
    out += [Candidate("system", n) for n in system_names("nccl", ("libnccl.so.2", "libnccl.so"))]
    return out


def _rccl_candidates() -> list[Candidate | Tried]:
    out: list[Candidate | Tried] = []
    for d in rocm_lib_dirs():
        files = [os.path.join(d, n) for n in ("librccl.so", "librccl.so.1")]
        present = [f for f in files if os.path.exists(f)]
        out += [Candidate("ROCm", f) for f in present] or [Tried("ROCm", files[0], "no such file")]
    for d in package_dirs("torch"):  # a ROCm build of torch bundles its RCCL in torch/lib
        lib_dir = os.path.join(d, "lib")
        if os.path.isdir(lib_dir):
            out += [Candidate("torch wheel", os.path.join(lib_dir, n)) for n in sorted(os.listdir(lib_dir))
                    if n.startswith("librccl.so")]
    out += [Candidate("system", n) for n in system_names("rccl", ("librccl.so.1", "librccl.so"))]
    return out


def load_nccl() -> CclLibrary:
    """NCCL from $HETCCL_NCCL_LIB, else the nvidia-nccl-cu12/cu13 wheel, else the system libnccl.so.2."""
    return _load("nccl", "HETCCL_NCCL_LIB", "libnccl.so.2", _nccl_candidates,
                 "the nvidia-nccl-cu12/cu13 wheel and the system libnccl.so.2",
                 "Install NCCL with `pip install nvidia-nccl-cu12` (CUDA 12) or `pip install nvidia-nccl-cu13` "
                 "(CUDA 13), or set HETCCL_NCCL_LIB=/path/to/libnccl.so.2")


def load_rccl() -> CclLibrary:
    """RCCL from $HETCCL_RCCL_LIB, else $ROCM_PATH/lib and /opt/rocm/lib, a ROCm torch wheel, the system."""
    return _load("rccl", "HETCCL_RCCL_LIB", "librccl.so", _rccl_candidates,
                 "$ROCM_PATH/lib, /opt/rocm/lib, a ROCm torch wheel and the system librccl.so",
                 "Install ROCm's rccl package (e.g. `apt install rccl`), set ROCM_PATH to the ROCm install, or set "
                 "HETCCL_RCCL_LIB=/path/to/librccl.so")


def load(vendor: str) -> CclLibrary:
    """load_nccl() for 'nccl' / 'nvidia', load_rccl() for 'rccl' / 'amd'."""
    v = vendor.lower()
    if v in ("nccl", "nvidia", "cuda"):
        return load_nccl()
    if v in ("rccl", "amd", "rocm", "hip"):
        return load_rccl()
    raise ConfigError(f"unknown collective library vendor {vendor!r}; use 'nccl' or 'rccl'")
