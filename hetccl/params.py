"""Every HETCCL_* setting in one table, like NCCL's ``NCCL_PARAM``: name, type, default, bounds or choices,
a one-line doc and the module that owns it. Nothing else in the package reads the environment for a setting.

Why one central table (with an ``owner`` column) rather than declarations next to the code, NCCL's style:
README's environment table, `hetccl info`'s "settings in effect" and `config.Settings` are all made from it,
and those need every parameter without importing every module (the GPU modules load vendor libraries, the
torch backend imports torch). The ``owner`` column keeps the link to the code; tests/test_params.py checks
that each owner exists and names its parameter.

Reading. ``get(name)`` reads the variable once per process (a forked child reads again) and caches the parsed
value (``reload()`` forgets the cache: the test hook). Unset or empty means the default. A bad value is a
``ConfigError`` that names the variable and says what is allowed; on/off switches all read 1/0, true/false,
on/off, yes/no. ``lookup(name, env)`` parses from an explicit mapping instead (``Settings.from_env(env)``);
``convert(name, value)`` checks a value given in code (``hetccl.init(settings={...})``): a string is parsed as in
the environment.

Scope. Parameters with a ``field`` are per communicator: `config.Settings` holds them, and
``hetccl.init(settings=...)`` may set them in code. The others are process-wide (read once, mostly where their
module is imported). The rank variables (HETCCL_RANK, HETCCL_WORLD_SIZE, HETCCL_LOCAL_RANK,
HETCCL_LOCAL_WORLD_SIZE, HETCCL_ADDR, HETCCL_LAUNCHED: ``config.RANK_VARIABLES``) are not settings: they say
who this process is and where the job meets, come from the launcher beside torchrun's, Slurm's and Open MPI's
equivalents, and are read by `config.identity_from_env` (and written by the launcher).

This module is layer 0: it imports only the standard library and `errors`.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

KINDS = ("int", "float", "size", "bool", "choice", "str", "list")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def parse_size(text: str) -> int:
    """'4K', '64M', '1G', '4096' -> bytes (powers of two, like nccl-tests)."""
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        value = int(float(s) * mult)
    except (ValueError, OverflowError):
        raise ConfigError(f"cannot read size {text!r}; write e.g. 4096, 64K, 1M") from None
    if value < 0:
        raise ConfigError(f"size {text!r} must be >= 0")
    return value


def format_size(n: int) -> str:
    for suffix, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{suffix}"
    return str(n)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # one of KINDS
    default: Any  # the typed value when unset (None: unset, the owner decides)
    doc: str  # one line: what it does (README's "meaning")
    owner: str  # the module that reads it
    lo: float | None = None  # bounds of int / float / size, inclusive
    hi: float | None = None
    lo_open: bool = False  # lo itself is refused (a float that must be > lo)
    choices: tuple[str, ...] = ()  # choice: allowed values (matched without regard to case)
    field: str | None = None  # the config.Settings field it fills (per communicator; settable in code)
    parse: Callable[[str], Any] | None = None  # a custom reader of the text (raises ConfigError)
    shown: str | None = None  # README's default column when the default alone does not say it
    empty_error: str | None = None  # set-but-empty is refused with this hint (else empty = unset)
    secret: bool = False  # never printed
    agree: bool = False  # the same on every rank (checked at start-up: else ranks issue different messages)

    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        d = self.default
        if d is None or d == "" or d == [] or d == ():
            return "unset"
        if self.kind == "bool":
            return "1" if d else "0"
        if self.kind == "size":
            return format_size(d)
        if isinstance(d, float) and d.is_integer():
            return str(int(d))
        return str(d)

    def allowed(self) -> str:
        """What a value may be, for error messages."""
        if self.kind == "bool":
            return "use 1/0, true/false, on/off or yes/no"
        if self.kind == "choice":
            return "use " + ", ".join(self.choices[:-1]) + " or " + self.choices[-1]
        what = {"int": "a whole number", "float": "a number", "size": "a size (e.g. 4096, 64K, 1M)"}.get(self.kind)
        if what is None:
            return ""
        if self.lo is not None and self.hi is not None:
            fmt = format_size if self.kind == "size" else _num
            return f"{what} between {fmt(self.lo)} and {fmt(self.hi)}"  # type: ignore[arg-type]
        if self.lo is not None:
            fmt = format_size if self.kind == "size" else _num
            return f"{what} {'>' if self.lo_open else '>='} {fmt(self.lo)}"  # type: ignore[arg-type]
        return what


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# ---- custom readers (their messages name the variable and the form) ----

def _ib_devices(text: str) -> list[tuple[str, int]]:
    """'mlx5_0', 'mlx5_0:1', or a comma list ('rxe0,rxe1') from which each rank takes entry local_rank % len."""
    out = []
    for item in (t.strip() for t in str(text).split(",")):
        if not item:
            continue
        name, sep, port = item.partition(":")
        if not name or any(c.isspace() or c == "/" for c in name):
            raise ConfigError(f"HETCCL_IB_DEVICE entry {item!r} is not a device name; write e.g. mlx5_0 or "
                              "mlx5_0:1 (see `ibv_devices`)")
        try:
            num = int(port) if sep else 1
        except ValueError:
            raise ConfigError(f"HETCCL_IB_DEVICE entry {item!r}: port {port!r} is not a number") from None
        if not 1 <= num <= 255:
            raise ConfigError(f"HETCCL_IB_DEVICE entry {item!r}: port must be 1..255")
        out.append((name, num))
    return out


def _ib_gid_index(text: str | None) -> int | None:
    if text is None or str(text).strip() == "":
        return None
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"HETCCL_IB_GID_INDEX={text!r} is not an integer; see `show_gids` or "
                          "/sys/class/infiniband/<dev>/ports/1/gids") from None
    if not 0 <= value <= 65535:
        raise ConfigError(f"HETCCL_IB_GID_INDEX={text!r} must be between 0 and 65535")
    return value


DEFAULT_WAIT_NOTICE = (10.0, 30.0)  # a rank waiting to join says so after 10 s, then every 30 s


def _wait_notice(text: str | None) -> tuple[float, float]:
    """'first[,every]' seconds (default 10,30); 0 turns the lines off; inf = never."""
    if text is None or str(text).strip() == "":
        return DEFAULT_WAIT_NOTICE
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2 or not all(math.isfinite(v) and v >= 0 for v in values):
        raise ConfigError(f"HETCCL_WAIT_NOTICE={text!r}: write first[,every] in seconds, e.g. 10,30 (the "
                          "default), or 0 for no waiting lines")
    first = values[0]
    every = values[1] if len(values) == 2 else DEFAULT_WAIT_NOTICE[1]
    return (first, every if every > 0 else math.inf) if first > 0 else (math.inf, math.inf)


def parse_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise ConfigError(f"HETCCL_METRICS_PORT={text!r} is not a port number; e.g. HETCCL_METRICS_PORT=9400"
                          ) from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"HETCCL_METRICS_PORT={text!r}: the port must be 1..65535")
    return port


def _skews(text: str) -> list[float]:
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"HETCCL_TEST_CLOCK_SKEW_US={text!r}: write microseconds per rank, e.g. 0,5000") from None


HOST_NAME_MAX = 64
_HOST_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _host_names(text: str) -> tuple[str, ...]:
    """HETCCL_HOST: one name, or one per local rank (config.host_for picks this process's)."""
    names = tuple(t.strip() for t in str(text).split(","))
    for name in names:
        if not name:
            raise ConfigError(f"HETCCL_HOST={text!r} has an empty name; write one name (HETCCL_HOST=a) or one per "
                              "local rank (HETCCL_HOST=a,a,b,b), or unset HETCCL_HOST")
        if len(name) > HOST_NAME_MAX or not set(name) <= _HOST_NAME_CHARS:
            raise ConfigError(f"HETCCL_HOST={text!r}: host name {name[:80]!r} must be 1-{HOST_NAME_MAX} letters, "
                              "digits, '.', '_' or '-'")
    return names


def _stream_order(text: str) -> bool | None:
    """HETCCL_TORCH_STREAM_ORDER: auto -> None (decided at init), else an on/off switch."""
    t = str(text).strip().lower()
    if t == "auto":
        return None
    if t in _TRUE or t in _FALSE:
        return t in _TRUE
    raise ConfigError(f"HETCCL_TORCH_STREAM_ORDER={text!r}: use auto (the default), 1 (required) or 0 (never)")


def _lower(text: str) -> str:
    return text.strip().lower()


_P = Param
TABLE: dict[str, Param] = {p.name: p for p in (
    # ---- per communicator (config.Settings) ----
    _P("HETCCL_SECRET", "str", "", "job secret for the HMAC challenge on every control and data connection "
       "(or `hetccl.init(secret=...)`)", "hetccl.auth", field="secret", shown="generated by `hetccl run`",
       secret=True),
    _P("HETCCL_TIMEOUT", "float", 300.0, "seconds any collective or bootstrap step may wait", "hetccl.communicator",
       lo=0, lo_open=True, field="timeout"),
    _P("HETCCL_WAIT_NOTICE", "list", DEFAULT_WAIT_NOTICE, "`first[,every]` seconds: a rank waiting to join (for rank "
       "0's store, for ranks that have not arrived, under torchrun for rank 0's address) prints one line on stderr "
       "after `first` s, then every `every` s, e.g. `hetccl: rank 1: 3 of 4 ranks joined; missing: 2 (40 s of "
       "300)`; `0` turns the lines off", "hetccl.waits", field="wait_notice", parse=_wait_notice, shown="10,30"),
    _P("HETCCL_TRANSPORTS", "list", None, "comma list restricting transports (`shm`, `verbs`, `tcp`, plugins), e.g. "
       "`tcp`, `shm,tcp` or `verbs`; the order does not matter (priority does); an unknown or unusable name is a "
       "`ConfigError` saying why", "hetccl.transports.registry", field="transports",
       shown="all available (shm inside a host, verbs across hosts when an RDMA device is active, else tcp)"),
    _P("HETCCL_ALGO", "str", None, "`ring` or `latency` (aliases `tree`, `rd`) for every collective, or per op: "
       "`all_reduce=ring,broadcast=tree`", "hetccl.algorithms", field="algo", parse=_lower, shown="cost model",
       agree=True),
    _P("HETCCL_CHUNK_BYTES", "size", None, "pipeline chunk of the ring algorithms", "hetccl.algorithms.ring",
       lo=4096, field="chunk_bytes", agree=True,
       shown="1M, growing with a block (a quarter of it) up to the chunk the communicator's slowest transport "
       "declares: 4M over TCP, none over shm and verbs"),
    _P("HETCCL_SOCKET_PUMP_BYTES", "size", None, "TCP payloads of at least this many bytes are sent and received "
       "by native threads (one per direction and peer) instead of the event loop, so a ring step's send and "
       "receive copy on two cores at once; 0 = never", "hetccl.transports.tcp",
       shown="1M with 8 or more usable cores, else 0 (never: with few cores the loop threads already use them)"),
    _P("HETCCL_CONNECT", "choice", "auto", "when TCP peers connect: `eager`, every pair at init; `lazy`, each rank "
       "dials a peer the first time it sends to it or waits for it (one connection per direction), so a rank opens "
       "connections to the peers its collectives use, not to all; `auto`: lazy in jobs of "
       "`HETCCL_CONNECT_LAZY_FROM` ranks or more, else eager", "hetccl.transports.tcp",
       choices=("auto", "eager", "lazy"), agree=True),
    _P("HETCCL_CONNECT_LAZY_FROM", "int", 256, "`HETCCL_CONNECT=auto` connects lazily from this many ranks: an eager "
       "rank holds about 2 open files a peer, so near 500 ranks it passes the usual soft limit of 1,024; below, "
       "eager connections spare the first collective their set-up", "hetccl.transports.tcp", lo=2, agree=True),
    _P("HETCCL_SOCKET_LANES", "int", None, "TCP connections per peer pair; a payload of at least "
       "`HETCCL_SOCKET_PUMP_BYTES` is split over all of them, each moved by its own pump threads (one connection "
       "tops out at ~2 GB/s each way on loopback); the two ranks use the smaller of their values",
       "hetccl.transports.tcp",
       lo=1, hi=16, shown="3 with 8 or more usable cores, else 1 (and 1 when the pumps are off, or under "
       "`HETCCL_SOCKET_MAX_RATE`)"),
    _P("HETCCL_SOCKET_MAX_RATE", "size", None, "the most bytes a second this rank sends to one TCP peer, split "
       "evenly over the pair's connections (the kernel's pacing, `SO_MAX_PACING_RATE`; one connection unless "
       "`HETCCL_SOCKET_LANES` says more, since a payload below the split size crosses one connection only): leaves "
       "a shared link's bandwidth to other traffic, or makes loopback behave as a link of that rate (`1250M` is "
       "10 Gbit/s)",
       "hetccl.transports.tcp", lo=1 << 20, shown="none (no cap)"),
    _P("HETCCL_BIND_ADDR", "str", None, "address data listeners bind to", "hetccl.netio", field="bind_addr",
       shown="the local address that routes to `HETCCL_ADDR`"),
    _P("HETCCL_SOCKET_IFNAME", "str", None, "network interface whose IPv4 address the listeners bind to (like "
       "`NCCL_SOCKET_IFNAME`; `HETCCL_BIND_ADDR` wins)", "hetccl.netio", field="socket_ifname"),
    _P("HETCCL_IB_DEVICE", "list", [], "RDMA device for the verbs transport, `name` or `name:port` (see "
       "`ibv_devices`); a comma list (`mlx5_0,mlx5_1`) gives local rank i entry i mod length",
       "hetccl.transports.verbs", field="ib_devices", parse=_ib_devices, shown="the first device with an active "
       "port 1"),
    _P("HETCCL_IB_GID_INDEX", "int", None, "GID index (RoCE)", "hetccl.transports.verbs", lo=0, hi=65535,
       field="ib_gid_index", parse=_ib_gid_index, shown="a RoCE v2 GID holding an IPv4 address, else the first "
       "non-empty one; InfiniBand: 0 (LID routing)"),
    # ---- process-wide ----
    _P("HETCCL_IB_SLOTS", "int", 16, "verbs receive ring: data slots per peer", "hetccl.transports.verbs",
       lo=2, hi=4096),
    _P("HETCCL_IB_SLOT_BYTES", "size", 128 << 10, "verbs receive ring: slot size, a power of two (the same on "
       "every rank)", "hetccl.transports.verbs", lo=4096, hi=1 << 30),
    _P("HETCCL_IB_REG_MIN", "size", 32 << 10, "verbs: the message size from which sends go straight from "
       "registered user memory", "hetccl.transports.verbs"),
    _P("HETCCL_SHM_SLOT_BYTES", "size", 256 << 10, "shared-memory ring: slot size", "hetccl.transports.shm",
       lo=4096, hi=1 << 30),
    _P("HETCCL_SHM_FASTPATH_BYTES", "size", 1 << 20, "small-message fast path: a collective of a group whose ranks "
       "all share this host's memory (all_reduce, broadcast, all_gather, reduce_scatter, barrier) exchanges through a "
       "dedicated shared segment, in C, when each rank's part is at most this many bytes (for groups of more than "
       "4 ranks, 2/(ranks - 2) of it: every rank reads every rank's part); a larger all_reduce of at most 8 ranks "
       "runs there too, in pieces of `HETCCL_SHM_PIECE_BYTES`; `0` turns it off",
       "hetccl.fastpath", lo=0, hi=16 << 20, agree=True),
    _P("HETCCL_SHM_PIECE_BYTES", "size", 1 << 20, "fast path: the piece of an all_reduce above "
       "`HETCCL_SHM_FASTPATH_BYTES`, reduce-scattered and all-gathered through the segment one piece at a time "
       "(small enough that a piece and its slots stay in a core's L2)", "hetccl.fastpath", lo=4096, hi=16 << 20,
       agree=True),
    _P("HETCCL_SHM_SINGLE_COPY", "bool", True, "fast path: an all_reduce above `HETCCL_SHM_FASTPATH_BYTES` copies "
       "straight between the ranks' buffers with the kernel's cross-memory attach (`process_vm_readv`/`writev`) "
       "where every rank may do so (same user, no Yama or seccomp refusal: tried at set-up); `0`: the pieces",
       "hetccl.fastpath"),
    _P("HETCCL_SHM_SLOTS", "int", 16, "shared-memory ring: slots per peer", "hetccl.transports.shm", lo=2,
       hi=4096),
    _P("HETCCL_STORE_EXTERNAL", "bool", False, "`1`: rank 0 does not host the store (it runs at `HETCCL_ADDR` "
       "already)", "hetccl.bootstrap"),
    _P("HETCCL_HOST", "list", None, "the host this rank acts as, on top of the machine it runs on: ranks on one "
       "machine with different names are different hosts (no shared memory and no zero-copy link between them: "
       "TCP, or verbs; `hetccl topo` and the cost model show them apart), ranks with the same name share memory as "
       "usual, and ranks on different machines never do; NCCL inside an island sees them apart too (`NCCL_HOSTID` "
       "is set to the host identity unless already set). One name (`a`) for this process, or a comma list "
       "(`a,a,b,b`, for launchers that give every rank one environment, like torchrun) from which the process with "
       "local rank i in its environment (`HETCCL_LOCAL_RANK`, `LOCAL_RANK`, `SLURM_LOCALID` or "
       "`OMPI_COMM_WORLD_LOCAL_RANK`) takes entry i; a list without such a variable or without an entry for it, an "
       "empty name, or a name that is not 1-64 of `A-Z a-z 0-9 . _ -` is a `ConfigError`", "hetccl.bootstrap",
       parse=_host_names, empty_error="unset HETCCL_HOST instead", shown="unset (one host per machine and network "
       "namespace)"),
    _P("HETCCL_ISLAND", "str", None, "this rank's island label (`nvidia`, `amd`, `cpu`, or `nvidia-a`/`nvidia-b`... "
       "to split one vendor into several islands); any other prefix, or a GPU vendor whose devices this host "
       "lacks (`/dev/nvidiactl`, `/dev/kfd`), is a `ConfigError`", "hetccl.config", shown="detected"),
    _P("HETCCL_NCCL_LIB", "str", None, "NCCL library (file or folder) to load instead of the one found",
       "hetccl.bindings.ccl", shown="searched (`hetccl info` lists it)"),
    _P("HETCCL_RCCL_LIB", "str", None, "RCCL library (file or folder) to load instead of the one found",
       "hetccl.bindings.ccl", shown="searched (`hetccl info` lists it)"),
    _P("HETCCL_HIP_LIB", "str", None, "HIP runtime whose driver calls (copies, events, stream memory operations) "
       "the cross-island link uses on AMD GPUs", "hetccl.bindings.streamops", shown="libamdhip64.so"),
    _P("HETCCL_PAIRLINK", "bool", True, "`0`: GPU island leaders on one host stage through hetccl's transports "
       "instead of the zero-copy link (a pair of leaders, or a ring of three or more)", "hetccl.gpu.pairlink",
       agree=True),
    _P("HETCCL_PAIRLINK_DIRECT_BYTES", "size", 1 << 20, "messages up to this size take the link's direct path (one "
       "stream, the reduction reads the peer's slot through the GPU's mapping of host memory); larger ones "
       "pipeline by chunk", "hetccl.gpu.pairlink"),
    _P("HETCCL_PAIRLINK_SMALL", "bool", True, "`0`: small cross-island messages (up to `HETCCL_CROSS_SMALL_BYTES`) "
       "make a host round trip instead of taking the GPU-signalled link", "hetccl.gpu.staging", agree=True),
    _P("HETCCL_PAIRLINK_PLACE", "choice", "receiver", "which NUMA node each direction's ring of the link lives on: "
       "`receiver` (near the GPU that reads it), `sender`, or `none` (wherever the creating leader runs)",
       "hetccl.gpu.pairlink", choices=("receiver", "sender", "none")),
    _P("HETCCL_PAIRLINK_SLOTS", "int", 16, "slots per direction of the zero-copy link", "hetccl.gpu.pairlink",
       lo=2, hi=4096),
    _P("HETCCL_STAGE_BYTES", "size", 4 << 20, "cross-island chunk (pipeline and link slot size)",
       "hetccl.gpu.staging", lo=4096, agree=True),
    _P("HETCCL_STAGED_RING", "bool", True, "`0`: GPU island leaders that no zero-copy link joins "
       "all-gather each staged chunk and reduce it locally instead of running a ring reduced on the devices",
       "hetccl.gpu.staging", agree=True),
    _P("HETCCL_CROSS_COMPRESS", "choice", "none", "`bf16`, `fp16` or `fp8` (e4m3, a scale per 1024 values): the bytes "
       "of all_reduce, reduce_scatter and all_gather of floats that cross between island leaders are cast to it, "
       "then reduced in the caller's dtype; inside islands, and on the zero-copy link between GPUs of one host, "
       "nothing changes", "hetccl.compress",
       choices=("none", "bf16", "fp16", "fp8"), field="cross_compress", agree=True),
    _P("HETCCL_CROSS_COMPRESS_MIN", "size", 64 << 10, "collectives smaller than this stay uncompressed under "
       "HETCCL_CROSS_COMPRESS (a loss or a metric stays exact)", "hetccl.compress", field="cross_compress_min",
       agree=True),
    _P("HETCCL_CROSS_SMALL_BYTES", "size", 256 << 10, "cross-island all_reduces up to this size go through host "
       "memory in one piece where the GPU-signalled link is not used", "hetccl.gpu.staging", agree=True),
    _P("HETCCL_WORDS_YIELD_US", "float", 0.0, "after each new wait, the stream-order watcher looks for the words "
       "that GPU streams store between sched_yield calls this long (microseconds) before it sleeps 20 us between "
       "looks: a small cross-island collective's host step starts sooner, for a core kept busy meanwhile",
       "hetccl.gpu.streamorder", lo=0.0, hi=1e6),
    _P("HETCCL_STREAM_MEMOPS", "bool", True, "`0`: the cross-island link is signalled by the CPU instead of GPU "
       "stream memory operations", "hetccl.bindings.streamops"),
    _P("HETCCL_GPU_BLOCKING", "bool", False, "`1`: device collectives return once complete instead of once enqueued "
       "on the stream (like `TORCH_NCCL_BLOCKING_WAIT`)", "hetccl.gpu.vendor_comm"),
    _P("HETCCL_WATCHDOG_PERIOD_MS", "float", 50.0, "how often the GPU watchdog checks in-flight device collectives "
       "(deadline, NCCL async error, lost peers)", "hetccl.gpu.vendor_comm", lo=0, lo_open=True),
    _P("HETCCL_TORCH_CUDA", "choice", "direct", "`staged`: the torch backend copies CUDA tensors through host "
       "memory instead of hetccl's device path", "hetccl.torch.backend", choices=("direct", "staged")),
    _P("HETCCL_TORCH_STREAM_ORDER", "choice", None, "a torch all_reduce, broadcast, all_gather or reduce_scatter "
       "of CUDA tensors across islands is ordered on the caller's stream and returns at once, as "
       "inside one island; `auto`: wherever every rank can (CUDA's eager module loading, which `import hetccl.torch` "
       "chooses before CUDA starts, and GPU stream memory operations), agreed at init, else the caller's thread "
       "waits for the collective's end; `1`: required (a `ConfigError` at init where a rank cannot); `0`: never",
       "hetccl.torch.backend", choices=("auto", "1", "0"), parse=_stream_order, shown="auto", agree=True),
    _P("HETCCL_TORCH_EARLY_COPIES", "bool", True, "an ordered collective's copies out of the caller's data run "
       "on a second stream, beside earlier collectives still waiting for their host steps (DDP's step 0.71x, "
       "FSDP2's 0.90x on one H100); `0`: behind them, on the collective stream", "hetccl.torch.backend"),
    _P("HETCCL_TORCH_ENQUEUE_THREAD", "bool", False, "experimental: an ordered collective is planned and enqueued "
       "on its stream by a thread of its process group, and the caller's thread only checks the call and records "
       "where its stream stands (held 0.27-0.44 ms against 0.31-0.87 per blocking op on one H100); it stalled in "
       "one GPU test (several all_reduces in flight), so `0`, the default: by the caller's thread",
       "hetccl.torch.backend"),
    _P("HETCCL_TORCH_ALIAS", "list", [], "torch backend names (`nccl`, `gloo`) that mean hetccl; set by `hetccl "
       "run --torch-backend-alias`", "hetccl.torch.alias.sitecustomize", parse=lambda t: [
           a.strip().lower() for a in t.split(",") if a.strip()]),
    _P("HETCCL_DUMP_DIR", "str", None, "folder for hang reports (JSON), written when a collective times out",
       "hetccl.hangreport", shown="unset (logged only)"),
    _P("HETCCL_HANG_REPORT", "bool", True, "`0` turns the hang report (what every rank was doing, gathered on a "
       "timeout) off", "hetccl.scheduler"),
    _P("HETCCL_REPORT_WAIT", "float", 5.0, "how long the hang report waits for the other ranks' answers (s; at most "
       "a quarter of the timeout)", "hetccl.hangreport", lo=0),
    _P("HETCCL_FLIGHT_RECORDS", "int", 64, "collectives remembered per communicator for the hang report",
       "hetccl.flight", lo=1, hi=1 << 20),
    _P("HETCCL_DEBUG", "choice", None, "`WARN`, `INFO` or `DEBUG` (like `NCCL_DEBUG`): the \"hetccl\" logger's "
       "level, printed on stderr as `hetccl host:pid:rank LEVEL ...` unless the application configured logging "
       "itself. INFO: one line per rank at init (island, transport per peer, the cost model's crossover sizes); "
       "DEBUG: one line per collective", "hetccl.observe",
       choices=("WARN", "INFO", "DEBUG", "WARNING", "ERROR", "TRACE")),
    _P("HETCCL_TRACE", "str", None, "write a Chrome trace / Perfetto JSON per rank: collectives, chunks, sends and "
       "receive waits on one timeline. `%r` or `{rank}` in the path becomes the rank; else `t.json` gives "
       "`t.rank0.json`, ...", "hetccl.observe", empty_error="give a file path, e.g. HETCCL_TRACE=/tmp/trace.json"),
    _P("HETCCL_TRACE_MAX_EVENTS", "int", 1_000_000, "events kept per rank's trace; later ones are counted and "
       "dropped", "hetccl.observe.trace", lo=0),
    _P("HETCCL_TEST_CLOCK_SKEW_US", "list", [], "tests only: per-rank shift of the trace clock in microseconds "
       "(`0,5000000`), which the clock correction must remove", "hetccl.observe.trace", parse=_skews),
    _P("HETCCL_TEST_RECORDS_TREE_DEAF", "bool", False, "tests only: this rank's inbox of the bootstrap's records "
       "tree is bound but never listens, so its parent's push is refused as an unreachable rank's would be (the "
       "parent pushes to this rank's children instead), and this rank reads the records from the store at once "
       "instead of waiting for the tree", "hetccl.bootstrap"),
    _P("HETCCL_METRICS_PORT", "int", None, "serve Prometheus metrics (`pip install 'hetccl[metrics]'`) on this port "
       "+ the rank's index on its machine (its local rank, unless `HETCCL_HOST` splits the machine): bytes and "
       "operations per collective, transport and peer, latency histograms, errors by "
       "class", "hetccl.observe", lo=1, hi=65535, parse=parse_port),
    _P("HETCCL_METRICS_ADDR", "str", None, "address the metrics server binds to (`0.0.0.0` for all)",
       "hetccl.observe", shown="as `HETCCL_BIND_ADDR`"),
    _P("HETCCL_BENCH_PROGRESS", "bool", False, "`1`: `hetccl bench` under a launcher prints progress lines",
       "hetccl.bench"),
)}
del _P


def parse(p: Param, raw: str | None) -> Any:
    """The value of ``p`` for the text ``raw`` (None or empty: the default)."""
    if raw is None or raw.strip() == "":
        if raw is not None and p.empty_error:
            raise ConfigError(f"{p.name} is set but empty: {p.empty_error}")
        return p.default
    text = raw.strip()
    if p.parse is not None:
        return p.parse(text)
    if p.kind == "str":
        return text
    if p.kind == "list":
        return [t.strip().lower() for t in text.split(",") if t.strip()]
    if p.kind == "bool":
        low = text.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ConfigError(f"{p.name}={raw!r} is not an on/off switch; {p.allowed()}")
    if p.kind == "choice":
        for c in p.choices:
            if c.lower() == text.lower():
                return c
        raise ConfigError(f"{p.name}={raw!r}: {p.allowed()}")
    try:
        if p.kind == "int":
            value: float = int(text)
        elif p.kind == "float":
            value = float(text)
        else:
            value = parse_size(text)
    except (ValueError, ConfigError):
        noun = {"int": "an integer", "float": "a number", "size": "a size"}[p.kind]
        raise ConfigError(f"{p.name}={raw!r} is not {noun}; {p.allowed()}") from None
    return _bounded(p, value, raw)


def _bounded(p: Param, value: float, shown: object) -> Any:
    ok = math.isfinite(value)
    if ok and p.lo is not None:
        ok = value > p.lo if p.lo_open else value >= p.lo
    if ok and p.hi is not None:
        ok = value <= p.hi
    if not ok:
        raise ConfigError(f"{p.name}={shown!r} is out of range; {p.allowed()}")
    return value


def param(name: str) -> Param:
    try:
        return TABLE[name]
    except KeyError:
        raise KeyError(f"{name} is not a hetccl parameter (hetccl/params.py lists them)") from None


_cache: dict[str, Any] = {}
_raw: dict[str, str | None] = {}  # what the environment said when first asked


def get(name: str) -> Any:
    """The value of parameter ``name`` from the environment, read and parsed once (then cached)."""
    try:
        return _cache[name]
    except KeyError:
        pass
    p = param(name)
    if name not in _raw:
        _raw[name] = os.environ.get(name)
    value = parse(p, _raw[name])  # a bad value raises here, every time it is asked for
    _cache[name] = value
    return value


def agreed(settings: Any = None) -> dict[str, str]:
    """The values of the parameters every rank must share (`agree`), as text: from `settings` (config.Settings)
    for those it holds, else from the environment. Bootstrap compares them across ranks."""
    out = {}
    for p in TABLE.values():
        if p.agree:
            value = getattr(settings, p.field) if settings is not None and p.field else get(p.name)
            out[p.name] = str(value)
    return out


def is_set(name: str) -> bool:
    """Whether the environment gives ``name`` a (non-empty) value."""
    param(name)
    if name not in _raw:
        _raw[name] = os.environ.get(name)
    raw = _raw[name]
    return raw is not None and raw.strip() != ""


def reload() -> None:
    """Forget what was read: the next get() reads the environment again (tests; after changing os.environ)."""
    _cache.clear()
    _raw.clear()


if hasattr(os, "register_at_fork"):  # a forked child is a new process: it reads its own environment
    os.register_at_fork(after_in_child=reload)


def lookup(name: str, env: Mapping[str, str] | None = None) -> Any:
    """``get(name)``, or the value in the mapping ``env`` (parsed now, not cached) when one is given."""
    if env is None:
        return get(name)
    return parse(param(name), env.get(name))


def convert(name: str, value: Any) -> Any:
    """A value given in code for parameter ``name``, checked like the environment's (a string is parsed)."""
    p = param(name)
    if value is None:
        return p.default
    if isinstance(value, str):
        return parse(p, value)
    bad = ConfigError(f"{name}={value!r} ({type(value).__name__}) is not allowed; "
                      f"{p.allowed() or 'give a ' + p.kind}")
    if p.kind == "bool":
        if not isinstance(value, bool):
            raise bad
        return value
    if p.kind in ("int", "size", "float"):
        if isinstance(value, bool) or not isinstance(value, int if p.kind != "float" else (int, float)):
            raise bad
        return _bounded(p, float(value) if p.kind == "float" else value, value)
    if p.kind == "list" and p.parse is None:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad
        return [v.strip().lower() for v in value if v.strip()]
    if p.kind in ("choice",):
        raise bad
    return value  # a custom form given already parsed (e.g. ib_devices as [(name, port)])


def settings_params() -> list[Param]:
    """The per-communicator parameters (those `config.Settings` holds), in table order."""
    return [p for p in TABLE.values() if p.field]


def in_effect(env: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every parameter's value now: {name: {"value", "source" ("environment" or "default"), or "error"}}."""
    env = os.environ if env is None else env
    out: dict[str, dict[str, Any]] = {}
    for p in TABLE.values():
        raw = env.get(p.name)
        source = "environment" if raw is not None and raw.strip() != "" else "default"
        try:
            value = parse(p, raw)
        except ConfigError as exc:
            out[p.name] = {"source": source, "error": str(exc)}
            continue
        shown = "(set)" if p.secret and value else (p.default_text() if source == "default" else value)
        out[p.name] = {"source": source, "value": shown}
    return out


def unknown(env: Mapping[str, str], known: Iterable[str] = ()) -> list[tuple[str, str | None]]:
    """The HETCCL_* variables of env that are no setting (nor one of `known`), each with the closest name that
    is (None where none is close): a misspelt setting would otherwise do nothing."""
    names = set(TABLE) | set(known)
    return [(k, next(iter(difflib.get_close_matches(k, names, n=1, cutoff=0.6)), None))
            for k in sorted(env) if k.startswith("HETCCL_") and k not in names]


_warned: set[str] = set()


def warn_unknown(known: Iterable[str] = ()) -> None:
    """Log a warning, once per process and name, for each unknown HETCCL_* variable of the environment."""
    for name, close in unknown(os.environ, known):
        if name not in _warned:
            _warned.add(name)
            hint = f"; did you mean {close}?" if close else ""
            logging.getLogger("hetccl").warning("hetccl: %s is not a hetccl setting and does nothing%s (`hetccl "
                                                "info` lists the settings)", name, hint)


# README rows for the rank variables (config.RANK_VARIABLES): not parameters, but the reader looks here first
RANK_ROWS = (
    "| `HETCCL_RANK`, `HETCCL_WORLD_SIZE`, `HETCCL_LOCAL_RANK` | this process's place in the job (else `RANK`/"
    "`WORLD_SIZE`/`LOCAL_RANK` of torchrun, `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_LOCALID`, `OMPI_COMM_WORLD_RANK`/"
    "`_SIZE`/`_LOCAL_RANK`, in that order) | set by the launcher |",
    "| `HETCCL_ADDR` | `host:port` of the rendezvous store that rank 0 serves (else `MASTER_ADDR`/`MASTER_PORT`; "
    "under torchrun, whose agent holds `MASTER_PORT`, a free port published through torchrun's store); the port is "
    "required when there is more than one rank | set by the launcher |",
)


def markdown_rows(params: Iterable[Param] | None = None) -> str:
    """README's environment table: the rank variables, then one row per parameter."""
    rows = ["| variable | meaning | default |", "|---|---|---|", *RANK_ROWS]
    for p in TABLE.values() if params is None else params:
        rows.append(f"| `{p.name}` | {p.doc} | {p.default_text()} |")
    return "\n".join(rows) + "\n"


README_BEGIN = "<!-- params: generated by `python -m hetccl.params --readme`; edit hetccl/params.py -->\n"
README_END = "<!-- params: end -->\n"


def update_readme(text: str) -> str:
    """README text with the generated rows between the markers replaced by the table's."""
    head, sep, rest = text.partition(README_BEGIN)
    _, sep2, tail = rest.partition(README_END)
    if not sep or not sep2:
        raise ValueError("README has no params markers")
    return head + README_BEGIN + markdown_rows() + README_END + tail


def main(argv: list[str] | None = None) -> int:
    """`python -m hetccl.params`: print the rows; `--readme [PATH]`: rewrite README.md's rows."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--readme":
        path = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = update_readme(text)
        if new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
        return 0
    sys.stdout.write(markdown_rows())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
