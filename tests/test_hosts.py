"""HETCCL_HOST: ranks on one machine acting as separate hosts (issue 16, item 3).

Ranks with different names reach each other by TCP only (no shared memory, no zero-copy link); ranks with one
name on one machine still share memory. Checked on real rank processes and real sockets: the transport each
rank chose per peer, `hetccl topo`, and every collective, through the native API and through the torch
backend under torchrun (where every rank gets the same environment, so HETCCL_HOST lists one name per local
rank).
"""

from __future__ import annotations

import json
import sys

import pytest
from rankrun import run_ranks
from test_tools import TOPO_RANK, _hetccl

from hetccl.config import Settings, host_for, parse_host
from hetccl.errors import ConfigError

# ---- the setting -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,names", [("a", ("a",)), (" box-1.rack_2 ", ("box-1.rack_2",)),
                                        ("a,a,b,b", ("a", "a", "b", "b")), ("x" * 64, ("x" * 64,))])
def test_host_names_accepted(text, names):
    assert parse_host(text) == names
    assert parse_host(None) == ()


@pytest.mark.parametrize("text,why", [("", "set but empty"), ("  ", "set but empty"), ("a,,b", "empty name"),
                                      ("a,", "empty name"), ("x" * 65, "must be 1-64"), ("a/b", "must be 1-64"),
                                      ("a b", "must be 1-64"), ("{local_rank}", "must be 1-64"),
                                      ("hôte", "must be 1-64")])
def test_bad_host_names_are_refused_naming_the_variable(text, why):
    with pytest.raises(ConfigError, match=f"HETCCL_HOST.*{why}"):
        Settings.from_env({"HETCCL_HOST": text})


def test_one_name_per_local_rank():
    """A list is indexed by the process's local rank as its launcher set it (HETCCL_LOCAL_RANK, LOCAL_RANK,
    SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK); without one, or without an entry for it, it is an error, never a
    guess (a communicator's own rank would differ between a job and its subgroups)."""
    assert Settings.from_env({}).host is None
    assert Settings.from_env({"HETCCL_HOST": "a"}).host == "a"
    for var in ("HETCCL_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        assert Settings.from_env({"HETCCL_HOST": "a,a,b,b", var: "2"}).host == "b", var
    with pytest.raises(ConfigError, match="HETCCL_HOST='a,a,b,b' gives one host per local rank, but no local rank"):
        Settings.from_env({"HETCCL_HOST": "a,a,b,b"})
    with pytest.raises(ConfigError, match="names 4 hosts, one per local rank, but this process has local rank 4"):
        Settings.from_env({"HETCCL_HOST": "a,a,b,b", "LOCAL_RANK": "4"})
    assert host_for((), 3) is None


@pytest.mark.timeout(30)
def test_init_refuses_a_bad_host_before_the_rendezvous(monkeypatch):
    import hetccl

    monkeypatch.setenv("HETCCL_HOST", "a,b")
    monkeypatch.setenv("HETCCL_LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="names 2 hosts, one per local rank, but this process has local rank 2"):
        hetccl.run(hetccl.init(rank=2, world_size=3, addr="127.0.0.1:9", timeout=20))


def test_info_shows_the_host(monkeypatch):
    from hetccl.info import host_line

    monkeypatch.setenv("HETCCL_HOST", "a,b")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("HETCCL_LOCAL_RANK", raising=False)
    assert host_line().endswith("/b (HETCCL_HOST: acts as host 'b')")
    monkeypatch.setenv("HETCCL_HOST", "a b")
    proc = _hetccl("info", env={"HETCCL_HOST": "a b"})
    assert proc.returncode == 0 and "refused: HETCCL_HOST='a b'" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("names,link", [(("a", "a"), True), (("a", "b"), False), ((None, None), True),
                                        (("a", None), False)])
def test_zero_copy_link_only_between_leaders_of_one_host(monkeypatch, names, link):
    """The link between two GPU leaders is made only where the topology says they share a host: with
    HETCCL_HOST names a and b (or one named and one not) they stage through the transports instead."""
    import asyncio
    from types import SimpleNamespace

    from hetccl import hierarchical
    from hetccl.bootstrap import Topology, host_identity

    monkeypatch.delenv("HETCCL_PAIRLINK", raising=False)
    fab = SimpleNamespace(topology=Topology([host_identity(x) for x in names]),
                          records=[{"island": "nvidia-0"}, {"island": "nvidia-1"}])
    lay = SimpleNamespace(leaders=SimpleNamespace(size=2, members=[0, 1]), link="the link")
    got = asyncio.run(hierarchical._zero_copy_link(SimpleNamespace(fabric=fab), lay, None))
    assert got == ("the link" if link else None)


# ---- real ranks ------------------------------------------------------------------------------------------

HOSTS = ["a", "a", "b", "b"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
def test_two_hosts_on_one_machine(transports):
    """4 ranks, HETCCL_HOST=a,a,b,b: shared memory inside each host, TCP across (every rank checks the transport
    it chose per peer and the topology), then every collective and send/recv."""
    run_ranks(4, "workers:every_op", env={"HETCCL_HOST": ",".join(HOSTS), "HETCCL_TRANSPORTS": transports},
              timeout=110, hosts=HOSTS, counts=[0, 1, 7, 4099, 70_000], dtypes=["float32", "bfloat16", "int64"],
              ops=["sum", "max", "avg"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "lazy_from", "lazy"), [("lazy", None, True), ("auto", "6", True),
                                                         ("auto", "7", False)])
def test_connections_on_first_use(mode: str, lazy_from: str | None, lazy: bool):
    """HETCCL_CONNECT=lazy (issue 32), or auto in a job of at least HETCCL_CONNECT_LAZY_FROM ranks: 6 ranks, each
    its own host over TCP, connect only the peers their collectives use (a ring all_reduce: its neighbours), and
    every collective and p2p still works. auto in a smaller job connects every pair at init."""
    env = {"HETCCL_HOST": ",".join(f"h{r}" for r in range(6)), "HETCCL_TRANSPORTS": "tcp", "HETCCL_CONNECT": mode}
    if lazy_from is not None:
        env["HETCCL_CONNECT_LAZY_FROM"] = lazy_from
    run_ranks(6, "workers:connects_on_first_use" if lazy else "workers:connects_at_init", env=env, timeout=110)


@pytest.mark.timeout(120)
def test_socket_max_rate_paces_every_connection():
    """HETCCL_SOCKET_MAX_RATE: two hosts over TCP with two connections a pair, each paced at half the rate by the
    kernel; a 4 MiB all_reduce at 8 MB/s takes its time and stays exact."""
    env = {"HETCCL_HOST": "h0,h1", "HETCCL_TRANSPORTS": "tcp", "HETCCL_SOCKET_LANES": "2",
           "HETCCL_SOCKET_PUMP_BYTES": "4096", "HETCCL_SOCKET_MAX_RATE": "8M"}
    run_ranks(2, "workers:paced", env=env, timeout=110, rate=8 << 20)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", [None, "64K"])
def test_ring_chunk_is_the_slowest_transports(setting):
    """The ring chunk of a communicator grows from 1 MiB up to what its slowest transport declares (tcp 4 MiB
    across the two hosts, shm none inside one) while a block keeps 4 chunks; HETCCL_CHUNK_BYTES fixes it. A ring
    all_reduce of several chunks per block is exact with it."""
    env = {"HETCCL_HOST": ",".join(HOSTS), "HETCCL_ALGO": "ring"}
    if setting:
        env["HETCCL_CHUNK_BYTES"] = setting
    run_ranks(4, "test_hosts:ring_chunks", env=env, timeout=110, setting=setting)


async def ring_chunks(comm, setting) -> None:
    """(In the rank processes.)"""
    import numpy as np

    from hetccl import DType
    from hetccl.params import parse_size
    from hetccl.scheduler import CollCtx

    fixed = parse_size(setting) if setting else None
    world, local = ((fixed, fixed),) * 2 if fixed else ((1 << 20, 4 << 20), (1 << 20, 1 << 20))
    assert (comm.chunk_bytes, comm.chunk_max_bytes) == world
    sub = await comm.split(HOSTS.index(HOSTS[comm.rank]))
    assert (sub.chunk_bytes, sub.chunk_max_bytes) == local
    ctx = CollCtx(comm, None, DType.FLOAT32, None)
    mib = 1 << 18  # float32 elements in 1 MiB
    if not fixed:  # 1 MiB chunks while a block is under 4 MiB, then a quarter block, up to 4 MiB
        assert [ctx.num_chunks(k * mib) for k in (1, 2, 4, 8, 16, 32, 64)] == [1, 2, 4, 4, 4, 8, 16]
    count = 24 * mib + 12345  # over 4 ranks: blocks of 6 MiB, in 4 chunks of 1.5 MiB (64 KiB chunks if fixed)
    for c in (comm, sub):
        x = np.arange(count, dtype=np.float32) % 1000 + c.rank
        await c.all_reduce(x)
        expect = (np.arange(count, dtype=np.float32) % 1000) * c.size + sum(range(c.size))
        assert np.array_equal(x, expect)
    await sub.close()


@pytest.mark.timeout(90)
def test_topo_shows_the_hosts():
    proc = _hetccl("run", "-n", "4", "--no-tag-output", "--", sys.executable, "-c", TOPO_RANK, "topo", "--json",
                   env={"HETCCL_HOST": "a,a,b,b"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    topo = json.loads(proc.stdout)
    assert [r["host_name"] for r in topo["ranks"]] == HOSTS
    assert len({r["host"] for r in topo["ranks"]}) == 2
    assert [r["local_rank"] for r in topo["ranks"]] == [0, 1, 0, 1]
    for p in topo["pairs"]:
        same = HOSTS[p["a"]] == HOSTS[p["b"]]
        assert p["same_host"] == same and p["transport"] == ("shm" if same else "tcp"), p
    assert topo["world"]["kind"] == "tcp"  # so the ring chunk grows from 1 MiB to tcp's declared 4 MiB
    assert (topo["world"]["chunk_bytes"], topo["world"]["chunk_max_bytes"]) == (1 << 20, 4 << 20)
    proc = _hetccl("run", "-n", "4", "--", sys.executable, "-c", TOPO_RANK, "topo",
                   env={"HETCCL_HOST": "a,a,b,b", "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 rank(s), 2 host(s)" in proc.stdout and "/a " in proc.stdout and "/b " in proc.stdout, proc.stdout


HOSTS_64 = [f"h{r // 8}" for r in range(64)]  # 8 hosts of 8 ranks


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_64_ranks_as_8_hosts_native():
    """64 ranks as 8 hosts of 8 (shared memory inside a host, TCP between, the hierarchy's leaders): every
    collective, send/recv and collectives in flight, each rank checking its fabric first (issue 32)."""
    run_ranks(64, "workers:every_op", env={"HETCCL_HOST": ",".join(HOSTS_64), "HETCCL_TIMEOUT": "120"},
              timeout=380, hosts=HOSTS_64, counts=[0, 1, 1000], dtypes=["float32", "int64"],
              ops=["sum", "max"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_64_ranks_as_8_hosts_torch():
    """The same 64 ranks under torchrun (`--nproc-per-node 64`, HETCCL_HOST indexed by LOCAL_RANK): each rank
    checks its fabric, then every op of the torch backend on CPU tensors (issue 32)."""
    pytest.importorskip("torch")
    from test_torch_backend import run_torchrun

    run_torchrun(64, "ops", "float32", env={"HETCCL_HOST": ",".join(HOSTS_64), "TEST_CHECK_HOSTS": ",".join(HOSTS_64),
                                            "HETCCL_TIMEOUT": "120"}, timeout=380)


@pytest.mark.timeout(150)
def test_torch_backend_under_torchrun_on_two_hosts():
    """torchrun --standalone --nproc-per-node 4, every rank with HETCCL_HOST=a,a,b,b (the entry of its
    LOCAL_RANK): each rank checks its fabric, then every op of the torch backend on CPU tensors."""
    pytest.importorskip("torch")
    from test_torch_backend import run_torchrun

    run_torchrun(4, "ops", "float32", env={"HETCCL_HOST": ",".join(HOSTS), "TEST_CHECK_HOSTS": ",".join(HOSTS)},
                 timeout=140)


@pytest.mark.timeout(90)
def test_metrics_ports_count_every_rank_on_the_machine():
    """Ranks acting as different hosts still share the machine's ports: HETCCL_METRICS_PORT + the rank's index
    on the machine, not its local rank on its host (both ranks of HETCCL_HOST=a,b are local rank 0)."""
    pytest.importorskip("prometheus_client")
    from test_observe import _free_port_pair

    run_ranks(2, "test_hosts:scrape_each_other", env={"HETCCL_HOST": "a,b", "HETCCL_METRICS_PORT":
                                                      str(_free_port_pair())})


async def scrape_each_other(comm) -> None:
    """(In the rank processes.) Rank q serves at base + q; each rank reads both exporters."""
    import asyncio
    import os

    from observe_workers import _scrape

    fab = comm._fabric
    assert fab.topology.local_rank(comm.rank) == 0 and fab.topology.machine_rank(comm.rank) == comm.rank
    base = int(os.environ["HETCCL_METRICS_PORT"])
    await comm.barrier()  # every rank's exporter is up (each starts at the end of its own init)
    for q in range(comm.size):
        text = await asyncio.to_thread(_scrape, base + q)
        assert f'rank="{q}"' in text, text[-2000:]
    await comm.barrier()
