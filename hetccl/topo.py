"""`hetccl topo` (also `hetccl info --topo`): run under a launcher, it joins the job and rank 0 prints the
islands, hosts and ranks, and the transport and algorithm choice between each pair of ranks, as tables.

    hetccl run -n 3 -- hetccl topo

Every rank publishes the transport it chose for each peer through the rendezvous store; rank 0 reads them
all, so the table shows each side's real choice (they agree unless HETCCL_TRANSPORTS differs per rank).
Other ranks print nothing.
"""

from __future__ import annotations

import sys
from typing import Any

MAX_PAIR_ROWS = 256  # larger jobs get a summary of pairs per transport instead of one row per pair


async def gather_topology(comm: Any) -> dict[str, Any] | None:
    """Collective over the job: the topology as rank 0 sees it (None on other ranks)."""
    from . import algorithms
    from .observe import crossover

    fab = comm._fabric
    await fab.store.set(f"{fab.job}/topo/{fab.rank}", {str(p): t for p, t in fab.peer_transport.items()})
    if fab.rank != 0:
        return None
    choices = [await fab.store.get(f"{fab.job}/topo/{r}") for r in range(fab.size)]
    override = algorithms.parse_override(fab.settings.algo)
    world_kind = fab.transport_kind(list(range(fab.size)))
    world_costs = fab.costs_of(world_kind)
    chunk, chunk_max = fab.ring_chunk(list(range(fab.size)))

    def pair_costs(ta: str, tb: str) -> Any:  # the slower of the two sides' declared figures
        return fab.costs_of(fab.slowest_transport({ta, tb}) or "tcp")

    pairs = []
    for a in range(fab.size):
        for b in range(a + 1, fab.size):
            ta, tb = choices[a].get(str(b), "?"), choices[b].get(str(a), "?")
            pairs.append({"a": a, "b": b, "transport": ta if ta == tb else f"{ta}/{tb}",
                          "same_host": fab.topology.same_host(a, b),
                          "all_reduce": crossover("all_reduce", 2, pair_costs(ta, tb), override)})
    islands: dict[str, list[int]] = {}
    for r, rec in enumerate(fab.records):
        islands.setdefault(rec.get("island", "cpu"), []).append(r)
    return {
        "size": fab.size,
        "ranks": [{"rank": r, "hostname": rec.get("hostname", "?"), "host": rec.get("host", "?"),
                   "host_name": rec.get("host_name"), "pid": rec.get("pid"), "island": rec.get("island", "cpu"),
                   "local_rank": fab.topology.local_rank(r)} for r, rec in enumerate(fab.records)],
        "islands": islands,
        "pairs": pairs,
        "world": {"kind": world_kind, "chunk_bytes": chunk, "chunk_max_bytes": chunk_max,
                  "algorithms": {op: crossover(op, fab.size, world_costs, override) for op in algorithms.CHOOSABLE}},
    }


def render(topo: dict[str, Any], file: Any = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from .observe import chunk_span

    console = Console(file=file or sys.stdout, width=max(100, Console().width), highlight=False)
    n = topo["size"]
    hosts: dict[str, list[int]] = {}
    for r in topo["ranks"]:
        hosts.setdefault(r["host"], []).append(r["rank"])
    nisl = len(topo["islands"])
    console.print(f"[bold]hetccl job[/]: {n} rank(s), {len(hosts)} host(s), {nisl} island(s)"
                  + (" (collectives are hierarchical across islands)" if nisl > 1 else ""))

    t = Table(title="islands", box=box.SIMPLE_HEAVY)
    for col in ("island", "ranks", "hosts", "leader"):
        t.add_column(col)
    for isl, ranks in topo["islands"].items():
        hs = sorted({host_label(topo["ranks"][r]) for r in ranks})
        t.add_row(isl, _ranges(ranks), ", ".join(hs), str(ranks[0]))
    console.print(t)

    t = Table(title="ranks", box=box.SIMPLE_HEAVY)
    for col in ("rank", "host", "local rank", "pid", "island"):
        t.add_column(col, justify="right" if col in ("rank", "local rank", "pid") else "left")
    for r in topo["ranks"]:
        t.add_row(str(r["rank"]), host_label(r), str(r["local_rank"]), str(r["pid"]), r["island"])
    console.print(t)

    pairs = topo["pairs"]
    if len(pairs) <= MAX_PAIR_ROWS:
        t = Table(title="rank pairs", box=box.SIMPLE_HEAVY)
        for col in ("ranks", "same host", "transport", "2-rank all_reduce"):
            t.add_column(col)
        for p in pairs:
            t.add_row(f"{p['a']} <-> {p['b']}", "yes" if p["same_host"] else "no", p["transport"], p["all_reduce"])
    else:
        t = Table(title=f"rank pairs ({len(pairs)}), by transport", box=box.SIMPLE_HEAVY)
        for col in ("transport", "pairs", "2-rank all_reduce"):
            t.add_column(col)
        by: dict[str, list[dict[str, Any]]] = {}
        for p in pairs:
            by.setdefault(p["transport"], []).append(p)
        for tr, ps in sorted(by.items()):
            t.add_row(tr, str(len(ps)), ps[0]["all_reduce"])
    console.print(t)

    w = topo["world"]
    t = Table(title="world communicator: algorithm by message size", box=box.SIMPLE_HEAVY,
              caption=f"{n} ranks over {w['kind']}, chunk {chunk_span(w)}; HETCCL_ALGO overrides",
              min_width=72)
    t.add_column("collective")
    t.add_column("choice")
    for op, choice in w["algorithms"].items():
        t.add_row(op, choice)
    for op in ("all_to_all", "gather", "scatter"):
        t.add_row(op, "direct")
    console.print(t)


def host_label(rank: dict[str, Any]) -> str:
    """How a rank's host is shown: its hostname, and the HETCCL_HOST name it acts as ("box/a")."""
    name = rank.get("host_name")
    return f"{rank['hostname']}/{name}" if name else rank["hostname"]


def _ranges(ranks: list[int]) -> str:
    from .observe import rank_ranges

    return ",".join(rank_ranges(ranks))


async def _main(as_json: bool) -> int:
    import hetccl

    comm = await hetccl.init()
    try:
        topo = await gather_topology(comm)
        if topo is not None:
            if as_json:
                import json

                print(json.dumps(topo, indent=1))
            else:
                render(topo)
    finally:
        await comm.close()
    return 0


def main(as_json: bool = False) -> int:
    from .bench import _under_launcher

    if not _under_launcher():
        print("hetccl topo: run it under a launcher so that it can join the job, e.g. "
              "hetccl run -n 3 -- hetccl topo", file=sys.stderr)
        return 2
    import hetccl

    return int(hetccl.run(_main(as_json)))
