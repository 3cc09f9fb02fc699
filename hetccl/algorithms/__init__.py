"""Algorithm families and the choice between them.

- `ring`: bandwidth-optimal pipelined rings/chains (all_reduce, reduce_scatter, all_gather, broadcast, reduce)
- `latency`: recursive doubling, binomial trees, direct exchanges (few rounds, for small messages)
- `direct`: personalised exchanges (all_to_all, gather, scatter) — the only family for those

`choose()` picks ring or latency with an alpha-beta cost model whose constants come from the properties the
communicator's transports declare (`TransportProperties`: latency, ring step, bandwidth; the slowest transport
of the communicator sets them, see `Fabric.transport_costs`); HETCCL_ALGO overrides it,
either globally (`ring`, `latency`) or per collective (`all_reduce=ring,broadcast=latency`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..errors import ConfigError

RING, LATENCY = "ring", "latency"
_ALIASES = {"ring": RING, "latency": LATENCY, "tree": LATENCY, "rd": LATENCY, "recursive_doubling": LATENCY}
CHOOSABLE = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")

# Effective constants, calibrated with `hetccl bench` on a 2-core host (see README): per-round cost of a ring
# step (it pays per-chunk task overhead), per-round cost of a latency-algorithm step, per-byte wire time,
# per-byte reduction time. With these the all_reduce crossover for 2 ranks lands near 4 MiB on shared
# memory (recursive doubling reduces straight out of the shared slot) and near 512 KiB on TCP.
REDUCE_S_PER_BYTE = 1 / 16e9  # host reduction: the same whatever moved the bytes


class LinkCosts(NamedTuple):
    """The alpha-beta constants of one communicator, in seconds: a ring step, a latency-algorithm round, one
    byte on the wire, one byte reduced."""

    ring_step: float
    round: float
    byte: float
    reduce_byte: float

    @classmethod
    def of(cls, latency_us: float, ring_step_us: float, bandwidth_gb_s: float) -> LinkCosts:
        """From a transport's declared figures (`transports.base.TransportProperties`)."""
        return cls(ring_step_us / 1e6, latency_us / 1e6, 1 / (bandwidth_gb_s * 1e9), REDUCE_S_PER_BYTE)

    @classmethod
    def declared(cls, props: Any) -> LinkCosts:
        """From a transport's `TransportProperties`."""
        return cls.of(props.latency_us, props.ring_step_us, props.bandwidth_gb_s)


# The figures the built-in transports declare (shm: ShmTransport.properties, tcp: TcpTransport.properties;
# tests/test_registry.py checks they agree), by name, for tools and tests that reason about a kind of link
# without a fabric. A running communicator uses its transports' declared properties, plugins' included.
COSTS = {"shm": LinkCosts.of(5, 85, 8), "tcp": LinkCosts.of(20, 18, 2)}


def parse_override(text: str | None) -> dict[str, str]:
    """'ring' -> every op; 'all_reduce=ring,broadcast=tree' -> per op."""
    if not text:
        return {}
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        op, _, algo = part.rpartition("=")
        op = op.strip().lower()
        name = algo.strip().lower()
        algo = _ALIASES.get(name)
        if name == "direct":  # it used to alias latency: a name that did something other than it says
            raise ConfigError(f"HETCCL_ALGO={text!r}: direct is not a choice; it is the only algorithm of "
                              "all_to_all, gather and scatter (algorithms/direct.py). Choose ring or latency (tree/rd)")
        if algo is None:
            raise ConfigError(f"HETCCL_ALGO={text!r}: algorithms are ring or latency (tree/rd)")
        if op:
            if op not in CHOOSABLE:
                raise ConfigError(f"HETCCL_ALGO={text!r}: {op!r} is not one of {', '.join(CHOOSABLE)}")
            out[op] = algo
        else:
            out.update({k: algo for k in CHOOSABLE})
    return out


def estimate(op: str, algo: str, nbytes: int, n: int, kind: str | LinkCosts) -> float:
    """Seconds op takes with algo on n ranks; kind: the communicator's LinkCosts, or a built-in's name."""
    a_ring, a_lat, b, g = kind if isinstance(kind, tuple) else COSTS.get(kind, COSTS["tcp"])
    lg = math.ceil(math.log2(n)) if n > 1 else 0
    frac = (n - 1) / n
    if op == "all_reduce":
        if algo == RING:
            return 2 * (n - 1) * a_ring + frac * nbytes * (2 * b + g)
        p = n.bit_length() - 1  # recursive doubling runs on the largest power of two <= n
        fold = 0 if n & (n - 1) == 0 else 2
        return (p + fold) * a_lat + (p + fold) * nbytes * b + p * nbytes * g
    a = a_ring if algo == RING else a_lat
    if op in ("broadcast", "reduce"):
        gg = g if op == "reduce" else 0.0
        if algo == RING:
            return (n - 1) * a + nbytes * (b + gg) * (1 + 0.05 * (n - 2))
        return lg * (a + nbytes * (b + gg))
    # all_gather / reduce_scatter: the direct exchange moves the same bytes in one round but lands all
    # peers' traffic on each rank at once
    gg = g if op == "reduce_scatter" else 0.0
    if algo == RING:
        return (n - 1) * a + frac * nbytes * (b + gg)
    return a + frac * nbytes * (b * (1 + 0.25 * (n - 2)) + gg) + (n - 1) * 1e-6


def choose(op: str, nbytes: int, n: int, kind: str | LinkCosts, override: dict[str, str]) -> str:
    if op in override:
        return override[op]
    if n <= 1:
        return LATENCY
    return min((RING, LATENCY), key=lambda algo: estimate(op, algo, nbytes, n, kind))
