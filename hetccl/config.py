"""Configuration from the environment: who am I (rank sources), and the per-communicator Settings.

The settings themselves (name, type, default, bounds, doc) are declared in hetccl/params.py; `Settings` is
built from that table. Only the rank variables (RANK_VARIABLES and the launchers' own) are read here directly.

Rank sources are read in a fixed order: HETCCL_*, torchrun, Slurm, Open MPI. The first source whose rank
variable is set wins; a source that is only partly set is an error naming the missing variable.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import params
from .errors import ConfigError
from .params import DEFAULT_WAIT_NOTICE, parse_size  # noqa: F401  (config's names: callers import them here)

DEFAULT_TIMEOUT_S: float = params.TABLE["HETCCL_TIMEOUT"].default
DEFAULT_CHUNK_BYTES = 1 << 20  # the ring chunk when neither HETCCL_CHUNK_BYTES nor the slowest transport says
DEFAULT_PORT = 0  # never a fixed port: the launcher picks a free one

# the rank variables: who this process is and where the job meets. Not settings (hetccl/params.py): the
# launcher writes them and identity_from_env reads them, beside torchrun's, Slurm's and Open MPI's own
RANK_VARIABLES = ("HETCCL_RANK", "HETCCL_WORLD_SIZE", "HETCCL_LOCAL_RANK", "HETCCL_LOCAL_WORLD_SIZE", "HETCCL_ADDR",
                  "HETCCL_LAUNCHED")

# (source name, rank var, size var, local-rank var, how the address is found)
_RANK_SOURCES = (
    ("hetccl", "HETCCL_RANK", "HETCCL_WORLD_SIZE", "HETCCL_LOCAL_RANK"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _env_int(name: str, env: Mapping[str, str]) -> int:
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


def parse_ib_devices(text: str) -> list[tuple[str, int]]:
    """HETCCL_IB_DEVICE: 'mlx5_0', 'mlx5_0:1', or a comma list ('rxe0,rxe1') from which each rank takes
    entry local_rank % len (one NIC per local rank, as on multi-rail hosts). [] when unset."""
    return params.parse(params.TABLE["HETCCL_IB_DEVICE"], str(text))


def parse_host(text: str | None) -> tuple[str, ...]:
    """HETCCL_HOST as a tuple of names (params.py checks them); () when unset."""
    return params.parse(params.TABLE["HETCCL_HOST"], text) or ()


def env_local_rank(env: Mapping[str, str]) -> int | None:
    """This process's local rank as its launcher set it (HETCCL_LOCAL_RANK, LOCAL_RANK, SLURM_LOCALID,
    OMPI_COMM_WORLD_LOCAL_RANK, the first one set), None if none is."""
    for _source, _rank_var, _size_var, local_var in _RANK_SOURCES:
        if local_var in env:
            return _env_int(local_var, env)
    return None


def host_for(names: tuple[str, ...], local_rank: int | None) -> str | None:
    """The HETCCL_HOST name of the process whose launcher gave it `local_rank` (None: no launcher said); None when
    HETCCL_HOST is unset. A list needs a local rank inside it."""
    if not names:
        return None
    if len(names) == 1:
        return names[0]
    listed = ",".join(names)
    if local_rank is None or local_rank < 0:
        raise ConfigError(f"HETCCL_HOST={listed!r} gives one host per local rank, but no local rank is set in this "
                          "process's environment (HETCCL_LOCAL_RANK, LOCAL_RANK, SLURM_LOCALID or "
                          "OMPI_COMM_WORLD_LOCAL_RANK); set one, or give this process a single name")
    if local_rank >= len(names):
        raise ConfigError(f"HETCCL_HOST={listed!r} names {len(names)} hosts, one per local rank, but this process "
                          f"has local rank {local_rank}; list a host for every local rank")
    return names[local_rank]


def parse_ib_gid_index(text: str | None) -> int | None:
    """HETCCL_IB_GID_INDEX: the GID table index for RoCE (None = pick a RoCE v2 IPv4 GID automatically)."""
    return params.parse(params.TABLE["HETCCL_IB_GID_INDEX"], None if text is None else str(text))


def parse_wait_notice(text: str | None) -> tuple[float, float]:
    """HETCCL_WAIT_NOTICE: 'first[,every]' seconds before a waiting rank's first line on stderr and between the
    next ones (default 10,30); 0 turns the lines off."""
    return params.parse(params.TABLE["HETCCL_WAIT_NOTICE"], None if text is None else str(text))


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


def _default(name: str) -> Any:
    value = params.TABLE[name].default
    return field(default_factory=lambda: list(value)) if isinstance(value, list) else value


@dataclass
class Settings:
    """Knobs read once per communicator; tests and callers may override fields. The fields filled from the
    environment are the parameters of hetccl/params.py that name a ``field`` (their defaults come from there)."""

    timeout: float = _default("HETCCL_TIMEOUT")
    chunk_bytes: int | None = _default("HETCCL_CHUNK_BYTES")  # None: the slowest transport's (Fabric.ring_chunk)
    algo: str | None = _default("HETCCL_ALGO")
    transports: list[str] | None = _default("HETCCL_TRANSPORTS")
    secret: bytes = b""  # HETCCL_SECRET, or hetccl.init(secret=...)
    bind_addr: str | None = _default("HETCCL_BIND_ADDR")
    socket_ifname: str | None = _default("HETCCL_SOCKET_IFNAME")  # resolved into bind_addr by resolve()
    max_frame_bytes: int = 1 << 20  # control-plane frames
    unexpected_bytes: int = 256 << 20  # per-peer buffer for data that arrives before its receive
    ib_devices: list[tuple[str, int]] = _default("HETCCL_IB_DEVICE")  # verbs
    ib_gid_index: int | None = _default("HETCCL_IB_GID_INDEX")  # verbs, RoCE
    wait_notice: tuple[float, float] = _default("HETCCL_WAIT_NOTICE")  # (first, every) in s; inf = never
    cross_compress: str = _default("HETCCL_CROSS_COMPRESS")  # compress.py
    cross_compress_min: int = _default("HETCCL_CROSS_COMPRESS_MIN")
    host: str | None = None  # HETCCL_HOST: the host this process acts as (its entry, for a list)
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, timeout: float | None = None) -> Settings:
        """From the environment (the parameter table's cached values), or from the mapping ``env``."""
        s = cls()
        for p in params.settings_params():
            if p.name != "HETCCL_TIMEOUT" or timeout is None:  # the argument wins: the variable is not read
                s._set(p.name, params.lookup(p.name, env))
        if timeout is not None:
            s.timeout = _check_timeout(timeout)
        s.host = host_for(params.lookup("HETCCL_HOST", env), env_local_rank(os.environ if env is None else env))
        return s.resolve()

    @classmethod
    def build(cls, settings: Settings | Mapping[str, Any] | None = None, *, secret: str | bytes | None = None,
              timeout: float | None = None) -> Settings:
        """What hetccl.init() runs with: ``settings`` as given (a Settings, checked), or the environment's with
        the mapping ``settings`` on top (keys: parameter names such as "HETCCL_TIMEOUT", or field names such
        as "timeout"; values checked like the environment's); then ``secret`` and ``timeout`` when given."""
        if isinstance(settings, Settings):
            s = dataclasses.replace(settings)
            s.check()
        elif settings is None or isinstance(settings, Mapping):
            s = cls.from_env()
            for key, value in (settings or {}).items():
                p = _settings_param(key)
                s._set(p.name, params.convert(p.name, value))
        else:
            raise ConfigError(f"settings={settings!r}: give a hetccl Settings or a mapping of parameter names "
                              "(e.g. {'HETCCL_TIMEOUT': 60}) to values")
        if secret is not None:
            if not isinstance(secret, (str, bytes)):
                raise ConfigError(f"secret must be str or bytes, not {type(secret).__name__}")
            s.secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        if timeout is not None:
            s.timeout = _check_timeout(timeout)
        return s.resolve()

    def check(self) -> None:
        """Check every field that comes from the parameter table, as the environment's values are."""
        for p in params.settings_params():
            value = getattr(self, p.field)  # type: ignore[arg-type]
            if p.name == "HETCCL_SECRET":
                if not isinstance(value, (bytes, str)):
                    raise ConfigError(f"Settings.secret must be bytes or str, not {type(value).__name__}")
                continue
            self._set(p.name, params.convert(p.name, value))

    def resolve(self) -> Settings:
        """Derived fields: an interface name (HETCCL_SOCKET_IFNAME) becomes the bind address unless one is set."""
        if not self.bind_addr and self.socket_ifname:  # like NCCL_SOCKET_IFNAME: an interface name
            from .netio import interface_addr

            self.bind_addr = interface_addr(self.socket_ifname.strip())
        return self

    def _set(self, name: str, value: Any) -> None:
        if name == "HETCCL_SECRET":
            value = value.encode() if isinstance(value, str) else value
        setattr(self, params.TABLE[name].field, value)  # type: ignore[arg-type]


def _check_timeout(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ConfigError(f"timeout={timeout!r}: must be a number of seconds > 0")
    return float(timeout)


def _settings_param(key: str) -> params.Param:
    """The table's parameter for a key of a settings mapping: its name or its Settings field."""
    for p in params.settings_params():
        if key in (p.name, p.field):
            return p
    if key in params.TABLE:
        raise ConfigError(f"{key} is process-wide, not a per-communicator setting: set it in the environment")
    known = ", ".join(f"{p.name} ({p.field})" for p in params.settings_params())
    raise ConfigError(f"settings key {key!r} is not a hetccl setting; known: {known}")


ISLAND_VENDORS = ("nvidia", "amd", "cpu")


def vendor_devices(vendor: str) -> bool:
    """Whether this host shows GPU device nodes of ``vendor`` (NVIDIA's driver: /dev/nvidiactl or /dev/nvidia0;
    AMD's: /dev/kfd). A CPU label needs nothing."""
    if vendor == "nvidia":
        return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
    if vendor == "amd":
        return os.path.exists("/dev/kfd")
    return True


def island_vendor(label: str) -> str:
    """The vendor an island label starts with ('nvidia-a' is an NVIDIA island named a), lower case."""
    return label.split("-", 1)[0].split(":", 1)[0].lower()


def island_label() -> str:
    """This rank's island: HETCCL_ISLAND, else the GPU vendor whose device nodes this host has, else cpu.
    Ranks with different labels never share a vendor CCL (how heterogeneity is emulated on one vendor).
    A label must start with a known vendor, and a GPU vendor's label needs that vendor's devices on this host
    (``HETCCL_ISLAND=nvidia`` on a machine without an NVIDIA GPU would fail later, inside the vendor library)."""
    label = params.get("HETCCL_ISLAND") or ""
    if label:
        vendor = island_vendor(label)
        if vendor not in ISLAND_VENDORS:
            raise ConfigError(f"HETCCL_ISLAND={label!r}: an island label starts with its vendor, one of "
                              f"{', '.join(ISLAND_VENDORS)}, optionally followed by -<name> to split a vendor into "
                              "several islands (e.g. nvidia-0, amd-a, cpu)")
        if not vendor_devices(vendor):
            nodes = "/dev/kfd" if vendor == "amd" else "/dev/nvidiactl"
            raise ConfigError(f"HETCCL_ISLAND={label!r} names a {vendor} island, but this host has no {vendor} GPU "
                              f"({nodes} is missing); label this rank cpu (or cpu-<name>), or leave HETCCL_ISLAND "
                              "unset to detect it")
        return label
    if os.path.exists("/dev/nvidiactl"):
        return "nvidia"
    if os.path.exists("/dev/kfd"):
        return "amd"
    return "cpu"
