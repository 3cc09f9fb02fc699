"""Processes that join a job and end without closing anything, for tests/test_exit.py and
benchmarks/exit_trials.py.

As a rank: `python tests/exit_workers.py API HOW`
  API  torch: dist.init_process_group("hetccl") | sync: hetccl.init_sync() | async: await hetccl.init() under
       hetccl.run
  HOW  return: falls off the end | exit3: sys.exit(3) | raise: an uncaught exception | gone: the last rank
       leaves at once with os._exit(0) (no exit step at all), the others return normally, so their closing
       barrier waits for a peer that is gone
Each rank writes "rank R exiting at T" (T: time.time()) just before it ends: an exit code 0 without it would be a
crash during set-up, not a clean exit.

As a library: `run_job(api, how)` starts the ranks (directly, or under `hetccl run` with launcher=True) and
returns every rank's exit code and output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
APIS = ("torch", "sync", "async")
HOWS = ("return", "exit3", "raise", "gone")
EXPECTED_RC = {"return": 0, "exit3": 3, "raise": 1, "gone": 0}
CRASH_RCS = (-11, 139, -6, 134, -7, 135)  # SIGSEGV, SIGABRT, SIGBUS (as a signal, or as a shell's 128 + n)


def _announce(rank: int) -> None:
    os.write(1, f"rank {rank} exiting at {time.time():.3f}\n".encode())  # one write: ranks share nothing


def _end(rank: int, size: int, how: str) -> None:
    if how == "gone" and rank == size - 1:
        _announce(rank)
        os._exit(0)
    _announce(rank)
    if how == "exit3":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError(f"rank {rank}: an uncaught exception after init (on purpose)")


def rank_main(api: str, how: str) -> None:
    if api == "torch":
        import torch.distributed as dist

        import hetccl.torch  # noqa: F401  (registers the backend)

        dist.init_process_group("hetccl")
        _end(dist.get_rank(), dist.get_world_size(), how)
    elif api == "sync":
        import hetccl

        comm = hetccl.init_sync()
        _end(comm.rank, comm.size, how)
    else:
        import hetccl

        async def main() -> None:
            comm = await hetccl.init()
            _end(comm.rank, comm.size, how)

        hetccl.run(main())


@dataclass
class JobResult:
    api: str
    how: str
    rcs: list[int | None]  # None: killed by the harness after the deadline (a hang)
    outs: list[str]
    errs: list[str]
    exit_s: list[float | None]  # from a rank's "exiting" line to its process end, as seen from here

    def report(self) -> str:
        return "\n".join(f"--- {self.api}/{self.how} rank {r} rc={rc}\n{o}{e[-3000:]}"
                         for r, (rc, o, e) in enumerate(zip(self.rcs, self.outs, self.errs, strict=True)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(api: str, how: str, n: int = 2, timeout: float = 90.0, launcher: bool = False,
            env: dict[str, str] | None = None) -> JobResult:
    """Start n ranks of `exit_workers.py API HOW`; wait at most `timeout` s (then kill: rc None)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), api, how]
    base = dict(os.environ, **(env or {}))
    base.setdefault("HETCCL_TIMEOUT", "30")
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    if launcher:  # `hetccl run` reports one exit code for the job: the first failing rank's
        procs = [subprocess.Popen([sys.executable, "-m", "hetccl", "run", "-n", str(n), "--", *cmd], env=base,
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    else:  # every rank's own exit code (a launcher stops the others once one fails, hiding their end)
        port, hport = _free_port(), _free_port()
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n),
                    HETCCL_WORLD_SIZE=str(n), HETCCL_ADDR=f"127.0.0.1:{hport}", HETCCL_SECRET=os.urandom(8).hex())
        procs = [subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r), HETCCL_RANK=str(r),
                                                HETCCL_LOCAL_RANK=str(r)),
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(n)]
    deadline = time.monotonic() + timeout
    ends: list[float | None] = [None] * len(procs)
    while None in ends and time.monotonic() < deadline:  # each process's end, seen within 20 ms
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.time()
        time.sleep(0.02)
    rcs: list[int | None] = []
    outs, errs = [], []
    for p, end in zip(procs, ends, strict=True):
        if end is None:
            p.kill()
        o, e = p.communicate()  # small outputs: the pipes never filled while we polled
        rcs.append(None if end is None else p.returncode)
        outs.append(o)
        errs.append(e if end is not None else e + f"\n[killed by the test after {timeout:.0f} s: a hang]")
    exit_s: list[float | None] = []
    for o, end in zip(outs, ends, strict=True):
        stamps = [float(line.rsplit(" ", 1)[1]) for line in o.splitlines() if " exiting at " in line]
        exit_s.append(end - max(stamps) if stamps and end is not None else None)
    return JobResult(api, how, rcs, outs, errs, exit_s)


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
