"""HETCCL_METRICS_PORT: a Prometheus exporter per rank (needs `pip install hetccl[metrics]`).

Rank r listens on HETCCL_METRICS_PORT + its local rank (its index among the ranks of its host), on the
address hetccl binds its transports to (HETCCL_BIND_ADDR, else the address that routes to the rendezvous
store); HETCCL_METRICS_ADDR overrides it (0.0.0.0 for every interface). Series (own registry, so an
application's default registry is untouched):

- hetccl_collective_ops_total{op,algo}, hetccl_collective_bytes_total{op,algo}: completed collectives
  (bytes as nccl-tests counts them: the larger buffer)
- hetccl_collective_seconds{op}: latency histogram of completed collectives
- hetccl_transport_ops_total{op,transport,peer,direction}, hetccl_transport_bytes_total{...}: sends and
  receives of collectives' algorithms, per peer (global rank) and transport
- hetccl_errors_total{op,error}: failed collectives by exception class (CollectiveTimeout, PeerLostError...)
- hetccl_rank_info{rank,world_size,local_rank,island,host}: 1
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import ConfigError
from ..params import parse_port

BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def require_client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("HETCCL_METRICS_PORT is set but prometheus_client is not installed; "
                          "pip install 'hetccl[metrics]' (or unset HETCCL_METRICS_PORT)") from None
    return prometheus_client


class Metrics:
    def __init__(self, owner: Any, registry: Any):
        pc = require_client()
        self.owner, self.registry = owner, registry
        self.server: Any = None
        self.port = 0
        self.ops = pc.Counter("hetccl_collective_ops", "completed collectives", ["op", "algo"], registry=registry)
        self.bytes = pc.Counter("hetccl_collective_bytes", "bytes of completed collectives", ["op", "algo"],
                                registry=registry)
        self.seconds = pc.Histogram("hetccl_collective_seconds", "collective latency", ["op"], buckets=BUCKETS,
                                    registry=registry)
        self.t_ops = pc.Counter("hetccl_transport_ops", "transport operations of collectives",
                                ["op", "transport", "peer", "direction"], registry=registry)
        self.t_bytes = pc.Counter("hetccl_transport_bytes", "bytes moved by transport operations",
                                  ["op", "transport", "peer", "direction"], registry=registry)
        self.errors = pc.Counter("hetccl_errors", "failed collectives by error class", ["op", "error"],
                                 registry=registry)
        self.share = pc.Gauge("hetccl_batch_share", "this rank's share of the global batch (hetccl.torch.balance)",
                              registry=registry)
        self.rebalances = pc.Counter("hetccl_balance_changes", "changes of the batch shares, by kind", ["kind"],
                                     registry=registry)
        self.info = pc.Gauge("hetccl_rank_info", "this rank", ["rank", "world_size", "local_rank", "island", "host"],
                             registry=registry)
        self._children: dict[tuple[Any, ...], Any] = {}

    @classmethod
    def start(cls, fab: Any, raw_port: str, addr: str) -> Metrics:
        pc = require_client()
        local = fab.topology.local_rank(fab.rank)
        port = parse_port(raw_port) + fab.topology.machine_rank(fab.rank)  # HETCCL_HOST hosts share the machine
        m = cls(fab, pc.CollectorRegistry())
        rec = fab.records[fab.rank] if fab.records else {}
        m.info.labels(str(fab.rank), str(fab.size), str(local), rec.get("island", "?"),
                      rec.get("hostname", "?")).set(1)
        try:
            m.server = pc.start_http_server(port, addr=addr, registry=m.registry)
        except OSError as exc:
            raise ConfigError(f"HETCCL_METRICS_PORT: rank {fab.rank} cannot listen on {addr}:{port} "
                              f"(base port + local rank {local}): {exc}") from None
        m.port, m.addr = port, addr
        return m

    def _child(self, metric: Any, *labels: Any) -> Any:
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def collective(self, op: str, algo: str, nbytes: int, seconds: float, status: str) -> None:
        if status != "ok":
            self._child(self.errors, op, status).inc()
            return
        self._child(self.ops, op, algo).inc()
        self._child(self.bytes, op, algo).inc(nbytes)
        self._child(self.seconds, op).observe(seconds)

    def transport(self, op: str, transport: str, peer: int, direction: str, nbytes: int) -> None:
        self._child(self.t_ops, op, transport, str(peer), direction).inc()
        self._child(self.t_bytes, op, transport, str(peer), direction).inc(nbytes)

    def balance(self, share: int, kind: str) -> None:
        self.share.set(share)
        self._child(self.rebalances, kind).inc()

    def stop(self) -> None:
        srv = self.server
        self.server = None
        if isinstance(srv, tuple):  # prometheus_client >= 0.17: (server, thread)
            with contextlib.suppress(Exception):
                srv[0].shutdown()
                srv[0].server_close()
