"""Two "hosts" on one machine: two Linux network namespaces joined by a veth pair, and rank processes
started inside them with `ip netns exec`.

The addresses (10.77.0.1/24 and 10.77.0.2/24) exist only on the veth pair inside the namespaces this module
creates, so no traffic leaves the machine and parallel runs (each with its own pid-based namespace names)
do not clash. hetccl tells hosts apart by hostname + boot id + network-namespace inode, so ranks in the two
namespaces are two hosts: shared memory inside each, TCP across.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankrun import HERE, RANK_MAIN, ROOT

IP_TIMEOUT = 15.0  # seconds for one `ip` command
_counter = itertools.count()

# variables of other rank sources, or hetccl settings, that must not leak from the test's environment
_SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
          "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")


class NetnsUnavailable(Exception):
    """Namespaces or veth pairs cannot be created here (not root, no CAP_SYS_ADMIN/CAP_NET_ADMIN, no veth)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"


@dataclass
class Rank:
    rank: int
    ns: str
    proc: subprocess.Popen
    out: Path
    err: Path
    started: float
    ended: float | None = None

    def stdout(self) -> str:
        return _tail(self.out, 1 << 20)

    def report(self) -> str:
        rc = self.proc.returncode
        took = f"{self.ended - self.started:.1f}s" if self.ended is not None else "still running"
        return (f"=== rank {self.rank} (netns {self.ns}) rc={rc} after {took}\n"
                f"--- stdout tail ---\n{_tail(self.out, 1500)}\n--- stderr tail ---\n{_tail(self.err, 3000)}")


@dataclass
class TwoHosts:
    """Namespaces `ns[0]`, `ns[1]` with veth ends `veth[0]`, `veth[1]` holding `addr[0]`, `addr[1]`."""

    workdir: Path
    ns: tuple[str, str] = ("", "")
    veth: tuple[str, str] = ("vethA", "vethB")
    addr: tuple[str, str] = ("10.77.0.1", "10.77.0.2")
    prefix: int = 24
    ranks: list[Rank] = field(default_factory=list)
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.ns[0]:
            tag = f"hetccl-{os.getpid()}-{next(_counter)}-{secrets.token_hex(2)}"
            self.ns = (f"{tag}-a", f"{tag}-b")

    # -- namespaces -----------------------------------------------------------------------------------
    def create(self) -> None:
        """Build both namespaces and the veth pair. NetnsUnavailable when the machine does not allow it."""
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2 (`ip`) is not installed")
        for ns in self.ns:
            self.created.append(ns)  # before: a half-made one is deleted too (the names are ours alone)
            proc = _ip("netns", "add", ns, check=False)
            if proc.returncode != 0:
                raise NetnsUnavailable(f"`ip netns add` failed: {proc.stderr.strip()}")
        # both ends are created directly inside their namespaces: the fixed names never touch the root one
        proc = _ip("link", "add", self.veth[0], "netns", self.ns[0], "type", "veth",
                   "peer", "name", self.veth[1], "netns", self.ns[1], check=False)
        if proc.returncode != 0:
            raise NetnsUnavailable(f"cannot create a veth pair: {proc.stderr.strip()}")
        for ns, veth, addr in zip(self.ns, self.veth, self.addr, strict=True):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{self.prefix}", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Until the link is up both ways (DAD does not apply to IPv4, but carrier takes a moment)."""
        probe = ("import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                 "s.connect((sys.argv[1],9));print(s.getsockname()[0])")
        deadline = time.monotonic() + timeout
        while True:
            ok = True
            for i in (0, 1):
                proc = self.exec(i, sys.executable, "-c", probe, self.addr[1 - i], check=False)
                ok = ok and proc.returncode == 0 and proc.stdout.strip() == self.addr[i]
                link = _ip("-n", self.ns[i], "-o", "link", "show", self.veth[i], check=False).stdout
                ok = ok and "LOWER_UP" in link
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"veth pair never came up: {link!r}")
            time.sleep(0.05)

    def exec(self, host: int, *cmd: str, check: bool = True, timeout: float = IP_TIMEOUT
             ) -> subprocess.CompletedProcess:
        """Run a short command inside namespace `host` (0 or 1)."""
        proc = subprocess.run(["ip", "netns", "exec", self.ns[host], *cmd], capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{cmd} in {self.ns[host]} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def free_port(self, host: int) -> int:
        """A port that is free on host's veth address (probed inside the namespace)."""
        code = ("import socket,sys\ns=socket.socket()\ns.bind((sys.argv[1],0))\nprint(s.getsockname()[1])")
        return int(self.exec(host, sys.executable, "-c", code, self.addr[host]).stdout)

    def link(self, host: int, up: bool) -> None:
        _ip("-n", self.ns[host], "link", "set", self.veth[host], "up" if up else "down")

    # -- ranks ----------------------------------------------------------------------------------------
    def host_of(self, rank: int, per_host: int) -> int:
        return rank // per_host

    def start_ranks(self, target: str, per_host: int = 2, env: dict[str, str] | None = None,
                    **kwargs: object) -> list[Rank]:
        """`per_host` ranks in each namespace; rank 0 hosts the store on host 0's veth address. Each rank
        runs rankrun.RANK_MAIN: hetccl.init() from HETCCL_* variables, then `await target(comm, **kwargs)`."""
        world = 2 * per_host
        store = f"{self.addr[0]}:{self.free_port(0)}"
        code = RANK_MAIN.format(tests=str(HERE), target=target, kwargs=json.dumps(kwargs))
        base = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("HETCCL_")}
        base.update(HETCCL_WORLD_SIZE=str(world), HETCCL_ADDR=store, HETCCL_SECRET=secrets.token_hex(16),
                    HETCCL_TIMEOUT="30", PYTHONUNBUFFERED="1")
        base.update(env or {})
        for r in range(world):
            host = self.host_of(r, per_host)
            renv = dict(base, HETCCL_RANK=str(r), HETCCL_LOCAL_RANK=str(r % per_host))
            out, err = self.workdir / f"rank{r}.out", self.workdir / f"rank{r}.err"
            with open(out, "wb") as fo, open(err, "wb") as fe:
                proc = subprocess.Popen(["ip", "netns", "exec", self.ns[host], sys.executable, "-c", code],
                                        env=renv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                        start_new_session=True)
            self.ranks.append(Rank(r, self.ns[host], proc, out, err, time.monotonic()))
        return self.ranks[-world:]

    def wait(self, ranks: list[Rank], timeout: float) -> bool:
        """Wait for every rank to exit, up to `timeout` seconds in all; False if any is still running."""
        deadline = time.monotonic() + timeout
        pending = list(ranks)
        while pending:
            for rk in list(pending):
                if rk.proc.poll() is not None:
                    rk.ended = time.monotonic()
                    pending.remove(rk)
            if pending:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
        return True

    def report(self, ranks: list[Rank]) -> str:
        return "\n".join(rk.report() for rk in ranks)

    def wait_output(self, ranks: list[Rank], text: str, timeout: float, what: str) -> None:
        """Wait until rank 0 of `ranks` prints `text`; if a rank exits first or `timeout` passes, kill them and
        fail with every rank's output."""
        deadline = time.monotonic() + timeout
        while text not in ranks[0].stdout():
            if any(rk.proc.poll() is not None for rk in ranks) or time.monotonic() > deadline:
                self.kill(ranks)
                raise AssertionError(f"{what}\n" + self.report(ranks))
            time.sleep(0.05)

    def check_all_ok(self, ranks: list[Rank], timeout: float, what: str) -> None:
        """Every rank exits 0 within `timeout`; otherwise kill them and fail with every rank's output."""
        finished = self.wait(ranks, timeout)
        if not finished:
            self.kill(ranks)
        if not finished or any(rk.proc.returncode != 0 for rk in ranks):
            head = f"{what}: " + (f"ranks still running after {timeout:.0f} s (killed)" if not finished
                                  else "rank exit codes " + str([rk.proc.returncode for rk in ranks]))
            raise AssertionError(head + "\n" + self.report(ranks))

    def kill(self, ranks: list[Rank]) -> None:
        """SIGKILL each rank's own process group (start_new_session) and reap it."""
        for rk in ranks:
            if rk.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rk.proc.pid, signal.SIGKILL)
        for rk in ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rk.proc.wait(timeout=10)
            if rk.ended is None and rk.proc.returncode is not None:
                rk.ended = time.monotonic()

    def destroy(self) -> None:
        """Kill every rank started here and delete the namespaces (the veth pair goes with them)."""
        try:
            self.kill(self.ranks)
        finally:
            for ns in self.created:
                with contextlib.suppress(Exception):
                    _ip("netns", "del", ns, check=False)
            self.created.clear()
