"""Four ranks on two "hosts": two network namespaces joined by a veth pair, two ranks in each.

Shared memory inside each namespace, TCP across; TCP everywhere with HETCCL_TRANSPORTS=tcp; and a link that
goes down in the middle of large all_reduces must end every rank with a hetccl error, not a hang.

The functions at the bottom run inside the rank processes (RANK_MAIN imports this module by name).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

import hetccl

PER_HOST = 2
WORLD = 2 * PER_HOST


def _expected(hosts, tcp_only: bool) -> dict[str, object]:
    return {"addrs": [hosts.addr[hosts.host_of(r, PER_HOST)] for r in range(WORLD)], "tcp_only": tcp_only}


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_two_hosts_shm_inside_tcp_across(hosts) -> None:
    t0 = time.monotonic()
    ranks = hosts.start_ranks("test_multihost:mh_matrix", PER_HOST, **_expected(hosts, tcp_only=False),
                              counts=[0, 1, 7, 4099, 300_000], dtypes=["float32", "bfloat16", "int64", "int8"],
                              ops=["sum", "max", "avg"])
    hosts.check_all_ok(ranks, 150, "matrix on 2 hosts x 2 ranks (shm inside, tcp across)")
    for rk in ranks:
        assert f"rank {rk.rank} fabric ok" in rk.stdout(), hosts.report(ranks)
    print(f"4 ranks on 2 namespaces: {time.monotonic() - t0:.1f} s")


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_two_hosts_tcp_only(hosts) -> None:
    ranks = hosts.start_ranks("test_multihost:mh_matrix", PER_HOST, env={"HETCCL_TRANSPORTS": "tcp"},
                              **_expected(hosts, tcp_only=True), counts=[0, 1, 7, 4099, 65_537],
                              dtypes=["float32", "int32"], ops=["sum", "min"])
    hosts.check_all_ok(ranks, 150, "matrix on 2 hosts x 2 ranks with HETCCL_TRANSPORTS=tcp")
    for rk in ranks:
        assert f"rank {rk.rank} fabric ok" in rk.stdout(), hosts.report(ranks)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(180)
def test_link_down_ends_every_rank_with_an_error(hosts) -> None:
    """vethA goes down while 4 ranks loop on large all_reduces with HETCCL_TIMEOUT=5: every rank exits
    within ~20 s with CollectiveTimeout or PeerLostError (the worker exits 0 only for a HetcclError)."""
    timeout = 5.0
    ranks = hosts.start_ranks("test_multihost:mh_until_error", PER_HOST, env={"HETCCL_TIMEOUT": str(timeout)})
    hosts.wait_output(ranks, "started", 60, "ranks did not start their all_reduce loop")
    time.sleep(0.5)  # a few more all_reduces in flight across the link
    hosts.exec(0, "ip", "link", "set", hosts.veth[0], "down")
    t_down = time.monotonic()
    hosts.check_all_ok(ranks, 40, "after the link went down")
    exited = {rk.rank: round(rk.ended - t_down, 1) for rk in ranks}
    errors, closes = {}, {}
    for rk in ranks:
        m = re.search(r"error (\w+) at ([\d.]+) ", rk.stdout())
        assert m and m.group(1) in ("CollectiveTimeout", "PeerLostError"), \
            f"rank {rk.rank} did not report a hetccl error\n" + hosts.report(ranks)
        errors[rk.rank] = round(float(m.group(2)) - t_down, 1)  # CLOCK_MONOTONIC is machine-wide
        m = re.search(r"closed in ([\d.]+) s", rk.stdout())
        closes[rk.rank] = float(m.group(1)) if m else None
    summary = f"link down -> error (s): {errors}; close took (s): {closes}; exit (s): {exited}"
    print(summary)
    assert max(errors.values()) < timeout + 5, summary + "\n" + hosts.report(ranks)
    # ~20 s: the error after HETCCL_TIMEOUT, then the closing barrier (bounded by HETCCL_TIMEOUT + 10 s on
    # ranks that cannot reach the store any more), plus start-up slack on a small machine
    assert max(exited.values()) < 25, summary + "\n" + hosts.report(ranks)


# ---- run inside the rank processes ----------------------------------------------------------------------

async def mh_matrix(comm: hetccl.Communicator, addrs: list[str], tcp_only: bool, **matrix_args: object) -> None:
    """Check the fabric (2 hosts; shm to the local peer, tcp to remote ones; listeners on the veth address),
    then run workers.matrix."""
    import workers

    fab = comm._fabric
    r, n = comm.rank, comm.size
    assert n == len(addrs), (n, addrs)
    assert fab.topology.num_hosts == 2, fab.topology.hosts
    local = [p for p in range(n) if addrs[p] == addrs[r]]
    assert fab.topology.local_ranks(r) == local, (fab.topology.hosts, local)
    want = {p: "tcp" if tcp_only or p not in local else "shm" for p in range(n) if p != r}
    assert fab.peer_transport == want, f"rank {r}: peer_transport {fab.peer_transport} != {want}"
    for p in range(n):
        rec = fab.records[p]["transports"]
        assert "tcp" in rec, f"rank {p} has no tcp listener: {rec}"
        assert rec["tcp"]["host"] == addrs[p], f"rank {p}'s tcp listener is on {rec['tcp']['host']}, not {addrs[p]}"
        assert ("shm" in rec) == (not tcp_only), f"rank {p} transports {sorted(rec)}"
    print(f"rank {r} fabric ok: {fab.peer_transport}", flush=True)
    await workers.matrix(comm, **matrix_args)


async def mh_until_error(comm: hetccl.Communicator, count: int = 4 << 20, max_s: float = 90.0) -> None:
    """Large all_reduces until one fails. A HetcclError: print its class and when it came, close the
    communicator, print how long that took, and return (exit 0). Anything else, or no error at all within
    max_s: an exception, so the rank exits non-zero."""
    buf = np.ones(count, np.float32)
    t0 = time.monotonic()
    i = 0
    try:
        while time.monotonic() - t0 < max_s:
            await comm.all_reduce(buf)
            i += 1
            if i == 1 and comm.rank == 0:
                print("started", flush=True)
    except hetccl.HetcclError as exc:
        print(f"rank {comm.rank}: error {type(exc).__name__} at {time.monotonic():.3f} after {i} all_reduces: "
              f"{exc}", flush=True)
        t1 = time.monotonic()
        await comm.close()
        print(f"rank {comm.rank}: closed in {time.monotonic() - t1:.1f} s", flush=True)
        return
    raise AssertionError(f"rank {comm.rank}: {i} all_reduces in {max_s} s and no error")
