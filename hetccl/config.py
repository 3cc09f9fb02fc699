"""Configuration from the environment: who am I (rank sources), deadlines, chunking, choices.

Rank sources are read in a fixed order: HETCCL_*, torchrun, Slurm, Open MPI. The first source whose rank
variable is set wins; a source that is only partly set is an error naming the missing variable.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from .errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_PORT = 0  # never a fixed port: the launcher picks a free one
DEFAULT_WAIT_NOTICE = (10.0, 30.0)  # a rank waiting to join says so after 10 s, then every 30 s
MAX_SOCKET_NSTREAMS = 64
DEFAULT_SOCKET_BUF_BYTES = 4 << 20

# (source name, rank var, size var, local-rank var, how the address is found)
_RANK_SOURCES = (
    ("hetccl", "HETCCL_RANK", "HETCCL_WORLD_SIZE", "HETCCL_LOCAL_RANK"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)


def _env_int(name: str, env: dict[str, str]) -> int:
    raw = env.get(name)
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to a whole number") from None


def env_float(name: str, default: float, env: dict[str, str] | None = None) -> float:
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw!r} must be a finite number > 0")
    return value


def env_int(name: str, default: int, lo: int, hi: int, env: dict[str, str] | None = None) -> int:
    """An integer variable in [lo, hi]; `default` when unset or empty."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={raw!r} must be between {lo} and {hi}")
    return value


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_socket_nstreams() -> int:
    """TCP connections per peer pair when HETCCL_SOCKET_NSTREAMS is unset: one per 4 usable cores, 1 to 4. Each
    stream's copies run on threads of their own; on 2 cores extra streams only add thread hand-offs
    (benchmarks/results/tcp-streams-2026-12-01.md), on many cores they copy in parallel."""
    return max(1, min(4, usable_cores() // 4))


def default_socket_offload_bytes() -> int:
    """TCP payloads from this size are moved by worker threads when HETCCL_SOCKET_OFFLOAD_BYTES is unset: 64 KiB
    with 4 usable cores or more; below that a hand-off to a thread costs more than the copy it takes off the
    event loop (1 MiB all_reduce 1.7x slower on 2 cores), so only payloads of 8 MiB and more go there."""
    return 64 << 10 if usable_cores() >= 4 else 8 << 20


def parse_ib_devices(text: str) -> list[tuple[str, int]]:
    """HETCCL_IB_DEVICE: 'mlx5_0', 'mlx5_0:1', or a comma list ('rxe0,rxe1') from which each rank takes
    entry local_rank % len (one NIC per local rank, as on multi-rail hosts). [] when unset."""
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


def parse_ib_gid_index(text: str | None) -> int | None:
    """HETCCL_IB_GID_INDEX: the GID table index for RoCE (None = pick a RoCE v2 IPv4 GID automatically)."""
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


def parse_wait_notice(text: str | None) -> tuple[float, float]:
    """HETCCL_WAIT_NOTICE: 'first[,every]' seconds before a waiting rank's first line on stderr and between the
    next ones (default 10,30); 0 turns the lines off."""
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


def parse_addr(text: str, default_port: int = DEFAULT_PORT, *, name: str | None = None) -> tuple[str, int]:
    """'host:port', '[v6]:port', 'host' (-> default_port). With ``name`` (the variable or argument it came from)
    the port is required: a job of several ranks meets at a port every rank must know."""
    text = text.strip()
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    try:
        value = int(port) if port else default_port
    except ValueError:
        raise ConfigError(f"address {text!r} is not host:port") from None
    if not 0 <= value <= 65535:
        raise ConfigError(f"address {text!r}: port must be 0..65535")
    if name is not None and value == 0:
        raise ConfigError(f"{name}={text!r} needs host:port (e.g. {host or '127.0.0.1'}:29500): rank 0 serves "
                          "the rendezvous at that port and every rank must know it (hetccl run picks a free one)")
    return host or "127.0.0.1", value


@dataclass
class Identity:
    rank: int
    world_size: int
    local_rank: int
    addr: tuple[str, int] | None
    source: str
    meet: str | None = None  # "torchrun": addr is torchrun's own store; meet through it (hetccl/torchrun.py)


def identity_from_env(env: dict[str, str] | None = None) -> Identity:
    env = dict(os.environ if env is None else env)
    for source, rank_var, size_var, local_var in _RANK_SOURCES:
        if rank_var not in env:
            continue
        if size_var not in env:
            raise ConfigError(f"{rank_var} is set but {size_var} is missing ({source} launch); set {size_var}")
        rank, size = _env_int(rank_var, env), _env_int(size_var, env)
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"{rank_var}={rank} and {size_var}={size}: need {size_var} >= 1 and "
                              f"0 <= {rank_var} < {size_var}")
        local = _env_int(local_var, env) if local_var in env else None
        addr, meet = None, None
        if "HETCCL_ADDR" in env:
            addr = parse_addr(env["HETCCL_ADDR"], name="HETCCL_ADDR" if size > 1 else None)
        elif source == "torchrun" or "MASTER_ADDR" in env:
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                missing = "MASTER_ADDR" if "MASTER_ADDR" not in env else "MASTER_PORT"
                raise ConfigError(f"{source} launch: {missing} is missing; set it or HETCCL_ADDR=host:port")
            addr = (env["MASTER_ADDR"], _env_int("MASTER_PORT", env))
            if source == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
                    and env.get("TORCHELASTIC_RUN_ID"):
                meet = "torchrun"  # torchrun's agent serves its store at MASTER_PORT: rank 0 cannot listen there
        if addr is None and size > 1:
            raise ConfigError(
                f"{source} launch: no rendezvous address; set HETCCL_ADDR=host:port "
                "(or MASTER_ADDR and MASTER_PORT)"
            )
        if local is None:
            local = rank if size == 1 else -1  # learnt from the topology exchange
        return Identity(rank, size, local, addr, source, meet)
    raise ConfigError(
        "cannot tell this process's rank: set HETCCL_RANK and HETCCL_WORLD_SIZE and HETCCL_ADDR "
        "(or launch with `hetccl run -n N`, torchrun, srun or mpirun), or pass rank=, world_size=, addr="
    )


@dataclass
class Settings:
    """Knobs read once per communicator; tests and callers may override fields."""

    timeout: float = DEFAULT_TIMEOUT_S
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    algo: str | None = None
    transports: list[str] | None = None
    secret: bytes = b""
    bind_addr: str | None = None
    max_frame_bytes: int = 1 << 20  # control-plane frames
    unexpected_bytes: int = 256 << 20  # per-peer buffer for data that arrives before its receive
    ib_devices: list[tuple[str, int]] = field(default_factory=list)  # HETCCL_IB_DEVICE (verbs)
    ib_gid_index: int | None = None  # HETCCL_IB_GID_INDEX (verbs, RoCE)
    wait_notice: tuple[float, float] = DEFAULT_WAIT_NOTICE  # HETCCL_WAIT_NOTICE (first, every) in s; inf = never
    socket_nstreams: int = field(default_factory=default_socket_nstreams)  # HETCCL_SOCKET_NSTREAMS
    socket_buf_bytes: int = DEFAULT_SOCKET_BUF_BYTES  # HETCCL_SOCKET_BUF_BYTES: SO_SNDBUF/SO_RCVBUF
    socket_offload_bytes: int = field(default_factory=default_socket_offload_bytes)  # HETCCL_SOCKET_OFFLOAD_BYTES
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, timeout: float | None = None) -> Settings:
        env = os.environ if env is None else env
        s = cls()
        s.timeout = timeout if timeout is not None else env_float("HETCCL_TIMEOUT", DEFAULT_TIMEOUT_S, env)
        if s.timeout <= 0:
            raise ConfigError("timeout must be > 0 seconds")
        if env.get("HETCCL_CHUNK_BYTES"):
            s.chunk_bytes = parse_size(env["HETCCL_CHUNK_BYTES"])
            if s.chunk_bytes < 4096:
                raise ConfigError("HETCCL_CHUNK_BYTES must be >= 4096")
        if env.get("HETCCL_ALGO"):
            s.algo = env["HETCCL_ALGO"].strip().lower()
        if env.get("HETCCL_TRANSPORTS"):
            s.transports = [t.strip().lower() for t in env["HETCCL_TRANSPORTS"].split(",") if t.strip()]
        s.secret = env.get("HETCCL_SECRET", "").encode()
        s.bind_addr = env.get("HETCCL_BIND_ADDR") or None
        if not s.bind_addr and env.get("HETCCL_SOCKET_IFNAME"):  # like NCCL_SOCKET_IFNAME: an interface name
            from .netio import interface_addr

            s.bind_addr = interface_addr(env["HETCCL_SOCKET_IFNAME"].strip())
        s.ib_devices = parse_ib_devices(env.get("HETCCL_IB_DEVICE", ""))
        s.ib_gid_index = parse_ib_gid_index(env.get("HETCCL_IB_GID_INDEX"))
        s.wait_notice = parse_wait_notice(env.get("HETCCL_WAIT_NOTICE"))
        s.socket_nstreams = env_int("HETCCL_SOCKET_NSTREAMS", s.socket_nstreams, 1, MAX_SOCKET_NSTREAMS, env)
        if env.get("HETCCL_SOCKET_BUF_BYTES", "").strip():
            s.socket_buf_bytes = parse_size(env["HETCCL_SOCKET_BUF_BYTES"])
            if not 4096 <= s.socket_buf_bytes <= 1 << 30:
                raise ConfigError(f"HETCCL_SOCKET_BUF_BYTES={env['HETCCL_SOCKET_BUF_BYTES']!r} must be between "
                                  "4K and 1G")
        if env.get("HETCCL_SOCKET_OFFLOAD_BYTES", "").strip():
            s.socket_offload_bytes = parse_size(env["HETCCL_SOCKET_OFFLOAD_BYTES"])
            if s.socket_offload_bytes < 4096:
                raise ConfigError(f"HETCCL_SOCKET_OFFLOAD_BYTES={env['HETCCL_SOCKET_OFFLOAD_BYTES']!r} must be "
                                  ">= 4K")
        return s
