"""Transport registry: built-ins plus plugins from the entry-point group `hetccl.transports`.

A plugin is a `Transport` subclass exposed as `name = "module:Class"` in that group (docs/transports.md). The
registry checks the interface version it declares (a v1 plugin is refused with `TransportVersionError` saying
what to change) and its declared `TransportProperties`, and `available()` reports each transport with the
reason it cannot be used here, for `hetccl info`.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import Any

from ..errors import ConfigError, TransportVersionError
from .base import SUPPORTED_API_VERSIONS, TRANSPORT_API_VERSION, DeviceLink, Transport, TransportProperties

log = logging.getLogger("hetccl")

BUILTIN = {
    "tcp": "hetccl.transports.tcp:TcpTransport",
    "shm": "hetccl.transports.shm:ShmTransport",
    "verbs": "hetccl.transports.verbs:VerbsTransport",
}


# Zero-copy device-memory links between the GPU island leaders of one host (base.DeviceLink): the hierarchy's
# leaders step takes the one device_link() picks; `hetccl info` lists them with what they declare.
LINKS = {
    "pairlink": "hetccl.gpu.pairlink:PairLink",
    "ringlink": "hetccl.gpu.ringlink:RingLink",
}


def _load(spec: str) -> type[Transport]:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def discover() -> dict[str, str]:
    """name -> 'module:Class' for built-ins and installed plugins (plugins cannot shadow built-ins)."""
    found = dict(BUILTIN)
    try:
        for ep in entry_points(group="hetccl.transports"):
            found.setdefault(ep.name, ep.value)
    except Exception as exc:  # a broken distribution must not break every job
        log.warning("hetccl: reading entry points failed: %s", exc)
    return found


def load(name: str) -> type[Transport]:
    specs = discover()
    if name not in specs:
        raise ConfigError(f"unknown transport {name!r}; known: {', '.join(sorted(specs))}")
    try:
        cls = _load(specs[name])
    except Exception as exc:
        raise ConfigError(f"transport {name!r} ({specs[name]}) failed to load: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise ConfigError(f"transport {name!r} ({specs[name]}) is not a hetccl Transport subclass")
    check_version(name, specs[name], cls)
    if not isinstance(getattr(cls, "properties", None), TransportProperties):
        raise ConfigError(f"transport {name!r} ({specs[name]}) declares no TransportProperties: set the class "
                          "attribute properties = TransportProperties(latency_us=..., ring_step_us=..., "
                          "bandwidth_gb_s=...) (docs/transports.md)")
    return cls


# What a plugin written for an older interface must change (docs/transports.md, "Porting from v1").
PORTING = {
    1: "interface v2 moved message matching into the core: take each endpoint's matcher from "
       "ctx.new_matcher(peer) instead of constructing Matcher; import DROP/Matcher from hetccl.matching; replace "
       "the capabilities flags with properties = TransportProperties(latency_us=..., ring_step_us=..., "
       "bandwidth_gb_s=...); register_memory is no longer part of the interface; then set api_version = 2",
}


def check_version(name: str, spec: str, cls: type[Transport]) -> None:
    version = cls.api_version
    if version in SUPPORTED_API_VERSIONS:
        return
    speaks = ", ".join(f"v{v}" for v in sorted(SUPPORTED_API_VERSIONS))
    if version in PORTING:
        raise TransportVersionError(
            f"transport {name!r} ({spec}) implements transport interface v{version}, which this hetccl no longer "
            f"loads (it speaks {speaks}). To port it: {PORTING[version]} (docs/transports.md)")
    if version is None:
        raise TransportVersionError(
            f"transport {name!r} ({spec}) declares no api_version; set api_version = {TRANSPORT_API_VERSION} once "
            "it implements the interface of docs/transports.md")
    raise TransportVersionError(
        f"transport {name!r} ({spec}) implements interface v{version}; this hetccl speaks {speaks}; upgrade hetccl "
        "or use a release of the plugin for this interface")


def available() -> dict[str, str | None]:
    """name -> None when usable, else why not."""
    out: dict[str, str | None] = {}
    for name in discover():
        try:
            out[name] = load(name).unavailable_reason()
        except ConfigError as exc:
            out[name] = str(exc)
    return out


def selected(wanted: list[str] | None) -> list[type[Transport]]:
    """Usable transport classes, restricted to `wanted` (HETCCL_TRANSPORTS) when given, best first."""
    names = wanted if wanted else list(discover())
    classes = []
    for name in names:
        try:
            cls = load(name)
        except ConfigError as exc:
            if wanted:
                raise
            log.warning("hetccl: skipping transport plugin %s: %s", name, exc)  # a broken plugin asked by nobody
            continue
        reason = cls.unavailable_reason()
        if reason is not None:
            if wanted:
                raise ConfigError(f"HETCCL_TRANSPORTS asks for {name!r}, which is unavailable: {reason}")
            log.debug("hetccl: transport %s unavailable: %s", name, reason)
            continue
        classes.append(cls)
    return sorted(classes, key=lambda c: -c.priority)


def links() -> dict[str, type[DeviceLink]]:
    """name -> device link class (base.DeviceLink), every one declaring TransportProperties."""
    out = {}
    for name, spec in LINKS.items():
        cls: Any = _load(spec)
        assert issubclass(cls, DeviceLink) and isinstance(cls.properties, TransportProperties), spec
        out[name] = cls
    return out


def device_link(leaders: int) -> type[DeviceLink] | None:
    """The usable device-memory link that joins this many leaders of one host, best declared bandwidth first;
    None when there is none (the leaders then stage through the transports). Decided from settings and the
    count alone, so every leader gets the same answer."""
    fits = [c for c in links().values()
            if c.properties.device_memory and c.min_ranks <= leaders <= (c.max_ranks or leaders)
            and c.unavailable_reason() is None]
    return max(fits, key=lambda c: c.properties.speed(), default=None)
