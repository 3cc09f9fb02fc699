"""The transport interface, version 2 (docs/transports.md is the plugin author's guide).

A transport moves frames between two ranks; the core matches them to receives. It is created once per process
fabric with a `TransportContext`, declares what it is (`properties`: latency, ring step, bandwidth, same host
only, device memory, memory registration: the cost model and the fabric read them), publishes what peers need
to reach it (`listen`), connects to the peers it can reach (`connect`) and hands back one `Endpoint` per peer.
Endpoints are message-oriented:

- `send(fp, tag, src)` returns once `src` may be reused.
- `post_recv(fp, tag, dst, reduce)` returns an awaitable completed when the message (comm, seq, tag) has
  landed in `dst` — or, with `reduce`, has been reduced into `dst` (dst = dst OP incoming), which lets a
  shared-memory transport reduce straight out of the shared segment.

Matching is the core's (`hetccl.matching`): every endpoint takes its peer's `Matcher` from
`ctx.new_matcher(peer)`, posts receives into it and asks it where each arriving frame goes (`take`, `land`).
The transport never builds a matcher, never reads control tags and never looks inside one beyond that API.

Versioning: `TRANSPORT_API_VERSION` grows when this contract changes; a plugin declares the version it
implements in `api_version` and the registry refuses one it does not know (like NCCL's ncclNet_vN), saying
what to change for a version it knows of (registry.PORTING).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..matching import Matcher
from ..wire import Fingerprint

if TYPE_CHECKING:
    from ..config import Settings
    from ..store import StoreClient

TRANSPORT_API_VERSION = 2
SUPPORTED_API_VERSIONS = frozenset({2})


@dataclass(frozen=True)
class TransportProperties:
    """What a transport (or a device link) declares about itself (class attribute `properties`).

    - `latency_us`, `ring_step_us`, `bandwidth_gb_s`: the cost model's figures (`algorithms.LinkCosts.of`):
      one round of a latency algorithm (a small message there and its answer back), one step of a pipelined
      ring (per-chunk overheads included), and sustained bandwidth per peer in GB/s (10^9 bytes/s). The slowest
      transport of a communicator (lowest bandwidth, then highest latency) sets its costs.
    - `same_host_only`: reaches only ranks on its own host; the fabric never offers it another host's peer.
    - `device_memory`: moves device (GPU) buffers itself (the zero-copy links; `registry.device_link` reads it).
    - `registers_memory`: registers buffers with a NIC (RDMA); it does so itself, on first use, through a cache
      (informational: no core decision depends on it).
    - `ring_chunk_bytes`: the largest ring pipeline chunk it wants while HETCCL_CHUNK_BYTES is unset (0: none,
      chunks stay 1 MiB). A large block's chunk grows up to it (`scheduler.CollCtx.num_chunks`), so a transport
      whose every frame costs much (TCP: framing, matching and pump hand-offs) moves more per frame; the
      slowest transport of a communicator sets it, so every rank cuts alike.
    `hetccl info` prints every field.
    """

    latency_us: float
    ring_step_us: float
    bandwidth_gb_s: float
    same_host_only: bool = False
    device_memory: bool = False
    registers_memory: bool = False
    ring_chunk_bytes: int = 0

    def __post_init__(self) -> None:
        for f in ("latency_us", "ring_step_us", "bandwidth_gb_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
                raise ValueError(f"TransportProperties.{f} must be a positive number, not {v!r}")
        v = self.ring_chunk_bytes
        if not isinstance(v, int) or isinstance(v, bool) or not (v == 0 or 4096 <= v <= 1 << 30):
            raise ValueError(f"TransportProperties.ring_chunk_bytes must be 0 (the default chunk) or 4096..1 GiB "
                             f"bytes, not {v!r}")

    def speed(self) -> tuple[float, float]:
        """The order transports are compared in: bandwidth first, then the lower latency."""
        return self.bandwidth_gb_s, -self.latency_us

    def slower_than(self, other: TransportProperties) -> bool:
        return self.speed() < other.speed()

    def describe(self) -> str:
        flags = [f for f in ("same_host_only", "device_memory", "registers_memory") if getattr(self, f)]
        chunk = f", ring chunk {self.ring_chunk_bytes >> 10} KiB" if self.ring_chunk_bytes else ""
        return (f"{self.latency_us:g} us, ring step {self.ring_step_us:g} us, {self.bandwidth_gb_s:g} GB/s{chunk}"
                + "".join(f", {f.replace('_', ' ')}" for f in flags))


@dataclass
class TransportContext:
    rank: int
    size: int
    job: str  # job id: every connection of one job carries it
    host_id: str
    settings: Settings
    store: StoreClient
    bind_host: str
    local_ranks: list[int] = field(default_factory=list)  # filled after the topology exchange
    # every rank on this machine, also those acting as other hosts (HETCCL_HOST): they share its CPUs
    machine_ranks: list[int] = field(default_factory=list)
    # transports report a lost peer here; the fabric then fails every pending operation, on every endpoint,
    # with that error (a collective stuck on a healthy peer must not outwait the dead one)
    on_peer_lost: Callable[[int, BaseException], None] = lambda peer, exc: None
    # the core's matcher for a peer (the fabric's: Fabric._new_matcher); None: a plain Matcher (tests, tools)
    matcher_factory: Callable[[int], Matcher] | None = None

    @property
    def secret(self) -> bytes:
        return self.settings.secret

    def new_matcher(self, peer: int) -> Matcher:
        """The matcher an endpoint to `peer` delivers its frames to: call it once per endpoint, at creation."""
        if self.matcher_factory is not None:
            return self.matcher_factory(peer)
        return Matcher(self.rank, peer, self.settings.unexpected_bytes)


class Transport(abc.ABC):
    name: ClassVar[str]
    api_version: ClassVar[int | None] = None  # every transport declares the interface version it implements
    properties: ClassVar[TransportProperties]  # every transport declares them (the registry checks)
    priority: ClassVar[int] = 0  # the highest-priority transport that reaches a peer is chosen

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when usable in this process, else a sentence saying why not (shown by `hetccl info`)."""
        return None

    def __init__(self, ctx: TransportContext):
        self.ctx = ctx

    @abc.abstractmethod
    async def listen(self) -> dict[str, Any]:
        """Start accepting; return the msgpack-able address record peers need."""

    @abc.abstractmethod
    def can_reach(self, peer: int, peer_record: dict[str, Any], same_host: bool) -> bool:
        """Whether this transport can connect to `peer` (whose record came from its listen())."""

    @abc.abstractmethod
    async def connect(self, peers: dict[int, dict[str, Any]]) -> dict[int, Endpoint]:
        """Connect to every peer in `peers` (rank -> record); all ranks call this collectively."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release sockets, segments and tasks; idempotent."""


class Endpoint(abc.ABC):
    """One peer's connection. `matcher` is the core's (from ctx.new_matcher(peer)), set at creation."""

    peer: int
    matcher: Matcher

    @abc.abstractmethod
    async def send(self, fp: Fingerprint, tag: int, src: np.ndarray) -> None: ...

    @abc.abstractmethod
    def post_recv(self, fp: Fingerprint, tag: int, dst: np.ndarray,
                  reduce: Callable[[np.ndarray, Any], None] | None = None) -> asyncio.Future: ...

    def cancel(self, comm: int, seq: int, exc: BaseException) -> None:
        """Drop receives of one collective (after a timeout or error elsewhere)."""
        self.matcher.cancel(comm, seq, exc)

    def fail(self, exc: BaseException) -> None:
        """Fail everything pending on this endpoint, and everything posted later, with exc."""
        self.matcher.fail_all(exc)

    @abc.abstractmethod
    async def close(self) -> None: ...


class DeviceLink:
    """A zero-copy device-memory link between the GPU island leaders of one host (gpu/pairlink.py for two,
    gpu/ringlink.py for three or more). Not a per-peer Transport: it carries the leaders' step of a hierarchical
    collective from device to device through shared host memory. It declares itself the same way (`name`,
    `properties`, `unavailable_reason`), is listed by the registry (`registry.LINKS`, `hetccl info`), and the
    hierarchy takes the one `registry.device_link(leaders)` picks from those declarations."""

    name: ClassVar[str]
    properties: ClassVar[TransportProperties]
    min_ranks: ClassVar[int] = 2  # how many leaders it joins
    max_ranks: ClassVar[int | None] = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None


# Names of interface v1 that v2 removed: importing one says what replaced it (a v1 plugin then fails to load
# with that sentence, see registry.load).
_MOVED = "moved to hetccl.matching (the core owns matching); an endpoint takes its matcher from ctx.new_matcher(peer)"
_REMOVED = {
    "Capability": "declare properties = TransportProperties(...) instead (docs/transports.md)",
    **{n: _MOVED for n in ("DROP", "RecvRequest", "AnySource", "mismatch_error", "NOTICE_TAG", "REPORT_TAG",
                           "GOODBYE_TAG", "CONTROL_TAGS", "NOTICE_MAX_BYTES", "HELD_NOTICES", "P2P_HIGH")},
}


def __getattr__(name: str) -> Any:
    if name in _REMOVED:
        raise ImportError(f"hetccl.transports.base.{name} was removed in transport interface v2: {_REMOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
