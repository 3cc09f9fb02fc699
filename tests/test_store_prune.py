"""The store drops a communicator's keys once every rank of it has closed (store `prune`, Fabric.close).

On real rank processes: with rank 0 hosting the store (the host prunes after its wait, no request), and with
an external store that outlives the job (the rank whose arrival completes the closed count prunes); a close
must take no longer than it did (no wait on a pruned key).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest
from rankrun import HERE, RANK_MAIN, ROOT, run_ranks

from hetccl.store import StoreServer

pytestmark = pytest.mark.timeout(60)

SECRET = "prune-test-secret"
CLOSE_UNDER_S = 3.0  # a close takes tens of ms here; a wait on a pruned key would take the barrier's 10 s


def test_rank0_store_keeps_no_keys_of_the_closed_world_and_splits() -> None:
    proc = run_ranks(3, "workers:keys_pruned_on_close", splits=3, close_under_s=CLOSE_UNDER_S, timeout=60)
    assert "store keys before close" in proc.stdout, proc.stdout[-2000:]
    assert proc.stdout.count("closed in") == 3, proc.stdout[-2000:]


async def _run_job(port: int, n: int, splits: int) -> None:
    """n ranks of one job, started directly, on the external store at 127.0.0.1:port."""
    code = RANK_MAIN.format(tests=str(HERE), target="workers:keys_pruned_on_close",
                            kwargs=json.dumps({"splits": splits, "close_under_s": CLOSE_UNDER_S}))
    base = dict(os.environ, HETCCL_TIMEOUT="30", HETCCL_WORLD_SIZE=str(n), HETCCL_ADDR=f"127.0.0.1:{port}",
                HETCCL_SECRET=SECRET, HETCCL_STORE_EXTERNAL="1")
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, env=dict(base, HETCCL_RANK=str(r), HETCCL_LOCAL_RANK=str(r)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE) for r in range(n)]
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 50)
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}\n{out.decode()[-2000:]}\n{err.decode()[-4000:]}"
        assert b"closed in" in out, out.decode()[-2000:]


async def test_external_store_keeps_no_keys_of_closed_jobs() -> None:
    """Jobs one after another on one store that none of their ranks hosts: after each, none of its keys (nor of
    its splits) is left, and the store does not grow with the number of jobs."""
    server = StoreServer("127.0.0.1", 0, SECRET.encode())
    port = await server.start()
    try:
        sizes, jobs = [], []
        for _ in range(2):
            # the `job` key names the store's current job: the next one starts without it (rank 0 sets it anew)
            server.data.pop("job", None)
            t0 = time.monotonic()
            await _run_job(port, 2, splits=2)
            jobs.append(server.data["job"])
            left = sorted(k for k in server.data if k.startswith(f"{jobs[-1]}/"))
            assert not left, f"the store kept {len(left)} keys of job {jobs[-1]} ({time.monotonic() - t0:.1f} s): " \
                             f"{left[:8]}"
            assert not server.events, sorted(server.events)[:8]
            sizes.append(len(server.data))
        assert jobs[0] != jobs[1] and sizes == [1, 1], (jobs, sizes, sorted(server.data)[:8])
    finally:
        await server.close()
