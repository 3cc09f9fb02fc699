"""Run a test function on N real rank processes (launched by hetccl's own launcher).

`run_ranks(n, "module:function", **kwargs)` starts n processes; each joins the job with hetccl.init(),
calls `await function(comm, **kwargs)` and closes. The test passes when every rank exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

RANK_MAIN = r"""
import asyncio, json, os, sys, importlib
sys.path.insert(0, {tests!r})
if os.environ.get("TEST_ISLANDS"):  # per-rank island labels for heterogeneous tests: "nvidia,nvidia,cpu,cpu"
    os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[int(os.environ["HETCCL_RANK"])]
if os.environ.get("TEST_RANK_ENV"):  # per-rank settings: {{"NAME": [rank 0's value, rank 1's, ...]}}
    for k, vals in json.loads(os.environ["TEST_RANK_ENV"]).items():
        os.environ[k] = vals[int(os.environ["HETCCL_RANK"])]
import hetccl
mod, fn = {target!r}.split(":")
kwargs = json.loads({kwargs!r})
async def main():
    func = getattr(importlib.import_module(mod), fn)
    if getattr(func, "no_init", False):
        await func(**kwargs)
        return
    comm = await hetccl.init()
    try:
        await func(comm, **kwargs)
    finally:
        await comm.close()
hetccl.run(main())
"""


def run_ranks(n: int, target: str, env: dict[str, str] | None = None, timeout: float = 90.0,
              expect_rc: int | None = 0, **kwargs: object) -> subprocess.CompletedProcess:
    """Launch n ranks through `python -m hetccl run` and return the finished process."""
    code = RANK_MAIN.format(tests=str(HERE), target=target, kwargs=json.dumps(kwargs))
    full_env = dict(os.environ)
    full_env.setdefault("HETCCL_TIMEOUT", "30")
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "hetccl", "run", "-n", str(n), "--", sys.executable, "-c", code]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    proc.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    if expect_rc is not None and proc.returncode != expect_rc:
        raise AssertionError(f"{target} on {n} ranks exited {proc.returncode} (expected {expect_rc})\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


def spawn_ranks(n: int, target: str, env: dict[str, str] | None = None, **kwargs: object
                ) -> list[subprocess.Popen]:
    """Start n ranks directly (no launcher: nobody kills the survivors when one rank dies)."""
    import secrets
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = RANK_MAIN.format(tests=str(HERE), target=target, kwargs=json.dumps(kwargs))
    base = dict(os.environ)
    base.setdefault("HETCCL_TIMEOUT", "30")
    base.update(env or {})
    base.update(HETCCL_WORLD_SIZE=str(n), HETCCL_ADDR=f"127.0.0.1:{port}", HETCCL_SECRET=secrets.token_hex(8))
    procs = []
    for r in range(n):
        e = dict(base, HETCCL_RANK=str(r), HETCCL_LOCAL_RANK=str(r))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=e, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every process (killing stragglers after `timeout`); (returncode, stdout, stderr) each."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            se += "\n[killed by the test: did not finish in time]"
        out.append((p.returncode, so, se))
    return out


def ranks_report(results: list[tuple[int, str, str]]) -> str:
    """Every rank's exit code, stdout and the end of its stderr: the message of a failed assertion."""
    return "\n".join(f"--- rank {r} rc={rc}\n{out}{err[-2000:]}" for r, (rc, out, err) in enumerate(results))


def assert_victim_named(results: list[tuple[int, str, str]], victim: int) -> None:
    """After a rank died on purpose (a *_die_midway worker: exit code 17): every survivor exited 0 having
    printed the PeerLostError it raised, naming the victim (or -1 where the loss had no single rank)."""
    report = ranks_report(results)
    for rank, (rc, out, _err) in enumerate(results):
        if rank == victim:
            assert rc == 17, report
        else:
            assert rc == 0, report
            assert f"PeerLostError rank={victim}" in out or "PeerLostError rank=-1" in out, report
