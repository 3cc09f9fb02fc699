"""Real rank processes for the reliability scripts (fault_trials.py, fuzz_control.py, soak.py).

`Job.spawn(n, "module:function", env, workdir, **kwargs)` starts n processes directly (no launcher, so that
nobody kills the survivors when one rank dies), each in its own session with stdout/stderr in files. Each
process runs `comm = await hetccl.init()` then `await function(comm, **kwargs)`; the function owns closing
and exiting. Ranks report to the driver with one JSON object per stdout line (`emit`), which the driver
reads back with `Job.events`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

RANK_MAIN = r"""
import asyncio, faulthandler, importlib, json, signal, sys
sys.path.insert(0, {here!r})
import hetccl
mod, fn = {target!r}.split(":")
kwargs = json.loads({kwargs!r})
faulthandler.register(signal.SIGUSR2)  # Job.dump_stacks: the threads' stacks, even with the loop blocked
def dump_tasks():
    for t in asyncio.all_tasks():
        t.print_stack(limit=12, file=sys.stderr)
    sys.stderr.flush()
async def main():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)  # and every asyncio task's
    comm = await hetccl.init()
    await getattr(importlib.import_module(mod), fn)(comm, **kwargs)
hetccl.run(main())
"""

_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def emit(kind: str, **fields: object) -> None:
    """One JSON line on stdout, in one write (a rank process's report to the driver)."""
    fields.update(kind=kind, t=time.monotonic())  # CLOCK_MONOTONIC: comparable across processes
    os.write(1, (json.dumps(fields) + "\n").encode())


def finish_report(lines: list[str], why: list[str], out: Path | None, workdir: Path) -> int:
    """The end of a reliability script: the verdict line, the report printed (and written to `out`), the rank
    output removed on a pass and kept on a failure; the exit status."""
    import shutil

    lines += ["", "result: " + ("PASS" if not why else "FAIL: " + "; ".join(why))]
    print("\n".join(lines), flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
    if not why:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"rank output kept under {workdir}")
    return 0 if not why else 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def listening_tcp_ports() -> set[int]:
    """Ports in LISTEN state in this network namespace (IPv4 and IPv6)."""
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            next(f)
            for line in f:
                parts = line.split()
                if parts[3] == "0A":
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def unix_sockets_matching(text: str) -> list[str]:
    """Unix sockets (abstract names included, shown with a leading @) whose name contains `text`."""
    out = []
    with contextlib.suppress(OSError), open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and text in parts[7]:
                out.append(parts[7])
    return out


@dataclass
class Job:
    workdir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    store_port: int = 0
    secret: str = ""
    started: float = 0.0

    @classmethod
    def spawn(cls, n: int, target: str, env: dict[str, str], workdir: Path, nice: int = 0,
              **kwargs: object) -> Job:
        workdir.mkdir(parents=True, exist_ok=True)
        job = cls(workdir, store_port=free_port(), secret=secrets.token_hex(16), started=time.monotonic())
        code = RANK_MAIN.format(here=str(HERE), target=target, kwargs=json.dumps(kwargs))
        base = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("HETCCL_")}
        base.update(HETCCL_WORLD_SIZE=str(n), HETCCL_ADDR=f"127.0.0.1:{job.store_port}",
                    HETCCL_SECRET=job.secret, HETCCL_TIMEOUT="30", PYTHONUNBUFFERED="1")
        base.update(env)
        cmd = [sys.executable, "-c", code]
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        for r in range(n):
            renv = dict(base, HETCCL_RANK=str(r), HETCCL_LOCAL_RANK=str(r))
            with open(workdir / f"rank{r}.out", "wb") as fo, open(workdir / f"rank{r}.err", "wb") as fe:
                job.procs.append(subprocess.Popen(cmd, env=renv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo,
                                                  stderr=fe, start_new_session=True))
        return job

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def events(self, rank: int) -> list[dict]:
        out = []
        with contextlib.suppress(OSError):
            for line in (self.workdir / f"rank{rank}.out").read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        out.append(json.loads(line))
        return out

    def event(self, rank: int, kind: str) -> dict | None:
        for ev in self.events(rank):
            if ev.get("kind") == kind:
                return ev
        return None

    def stderr_tail(self, rank: int, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / f"rank{rank}.err").read_text(errors="replace")[-n:]
        return ""

    def wait_event(self, ranks: list[int], kind: str, timeout: float) -> bool:
        """Until every rank in `ranks` has emitted `kind` (False on timeout or when one of them exited)."""
        deadline = time.monotonic() + timeout
        while True:
            if all(self.event(r, kind) is not None for r in ranks):
                return True
            if time.monotonic() > deadline or any(self.procs[r].poll() is not None for r in ranks):
                return False
            time.sleep(0.02)

    def wait_exit(self, ranks: list[int], timeout: float) -> dict[int, float]:
        """Wait up to `timeout` s for `ranks` to exit; {rank: monotonic time seen exited} for those that did."""
        deadline = time.monotonic() + timeout
        seen: dict[int, float] = {}
        while True:
            for r in ranks:
                if r not in seen and self.procs[r].poll() is not None:
                    seen[r] = time.monotonic()
            if len(seen) == len(ranks) or time.monotonic() > deadline:
                return seen
            time.sleep(0.01)

    def dump_stacks(self, ranks: list[int]) -> None:
        """Ask ranks still running to print their asyncio tasks and threads' stacks to their stderr file (a
        hung rank's post-mortem), and give them a moment to do it."""
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            for r in ranks:
                if self.procs[r].poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.procs[r].pid, sig)
            time.sleep(0.5)

    def kill(self, rank: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[rank].pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
