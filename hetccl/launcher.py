"""Local process launcher: start N ranks of one command on this host (like ``torchrun --standalone``).

Each child gets the parent environment, plus ``env``, plus the rank variables read by
:mod:`hetccl.config` (``HETCCL_RANK``, ``HETCCL_WORLD_SIZE``, ``HETCCL_LOCAL_RANK``,
``HETCCL_LOCAL_WORLD_SIZE``, ``HETCCL_ADDR``, ``HETCCL_SECRET``, ``HETCCL_LAUNCHED``) and their torchrun
counterparts (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``). Rank 0 hosts the rendezvous store on ``HETCCL_ADDR``.

Children's stdout is inherited untouched; their stderr goes through a pipe, is forwarded line by line
to the launcher's stderr, and the last ``tail_lines`` lines of each rank are kept so that a failing
rank's last words can be repeated in the failure report.

Only the standard library is needed here.
"""

from __future__ import annotations

import collections
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["launch"]

POLL_INTERVAL_S = 0.02  # how often children are polled
TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL grace when the launcher stops the job itself
SIGNAL_GRACE_S = 10.0  # how long forwarded SIGINT/SIGTERM may take before SIGKILL
READER_JOIN_S = 2.0  # how long to wait for a rank's stderr to drain after it exited
_MAX_LINE = 1 << 16  # longer stderr lines are forwarded (and kept) in pieces of this size
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_sleep = time.sleep  # one indirection, so that tests can interrupt the poll loop
_stderr_lock = threading.Lock()


def _bad_argument(message: str) -> ValueError:
    try:  # hetccl.errors.ConfigError is a ValueError; plain ValueError if that module is absent
        from hetccl.errors import ConfigError
    except ImportError:  # pragma: no cover
        return ValueError(message)
    return ConfigError(message)


def _write_stderr(data: bytes | str) -> None:
    """Write to the launcher's *current* sys.stderr, whole lines at a time, never raising."""
    with _stderr_lock:
        stream = sys.stderr
        if stream is None:
            return
        try:
            if isinstance(data, str):
                stream.write(data)
                stream.flush()
                return
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode(errors="replace"))
                stream.flush()
        except (OSError, ValueError):  # stderr closed or broken: keep the child's pipe drained anyway
            pass


def _say(message: str) -> None:
    _write_stderr(f"hetccl run: {message}\n")


class _StderrPump(threading.Thread):
    """Reads one rank's stderr pipe: forwards each line at once and keeps the last ones."""

    def __init__(self, rank: int, pipe, tail_lines: int):
        super().__init__(name=f"hetccl-launch-stderr-{rank}", daemon=True)
        self._pipe = pipe
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)

    def run(self) -> None:
        try:
            while True:
                line = self._pipe.readline(_MAX_LINE)
                if not line:
                    break
                _write_stderr(line)
                self.tail.append(line.decode(errors="replace").rstrip("\r\n"))
        except (OSError, ValueError):
            pass
        finally:
            try:
                self._pipe.close()
            except OSError:
                pass


def _pick_port(addr: str) -> int:
    """A port that was free on ``addr`` a moment ago: bind (addr, 0), read it, close."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise _bad_argument(
            f"cannot resolve launch address {addr!r} ({exc}); pass addr='127.0.0.1'"
        ) from None
    family, socktype, proto, _, sockaddr = infos[0]
    with socket.socket(family, socktype, proto) as sock:
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            raise _bad_argument(
                f"cannot bind {addr!r} to find a free port ({exc}); pass an address of this host"
            ) from None
        return sock.getsockname()[1]


def _exit_code(returncode: int) -> int:
    """Popen's returncode -> shell convention (signal death is 128 + signum)."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{_exit_code(returncode)} (killed by {name})"
    return str(returncode)


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _running(procs: list[subprocess.Popen]) -> list[int]:
    return [rank for rank, p in enumerate(procs) if p.poll() is None]


def _send(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_all(procs: list[subprocess.Popen], sig: int | None, grace: float, hurry=lambda: False) -> list[int]:
    """Send ``sig`` (None: nothing, it was sent already) to the ranks still running, give them
    ``grace`` seconds (less if ``hurry()`` turns true), SIGKILL the rest and reap everyone.
    Returns the ranks that had to be SIGKILLed."""
    if sig is not None:
        for p in procs:
            _send(p, sig)
    deadline = time.monotonic() + grace
    while _running(procs) and time.monotonic() < deadline and not hurry():
        _sleep(POLL_INTERVAL_S)
    killed = _running(procs)
    for rank in killed:
        _send(procs[rank], signal.SIGKILL)
    for p in procs:
        p.wait()
    return killed


def _join_pumps(pumps: list[_StderrPump]) -> None:
    """Let the stderr readers forward what the (now dead) ranks wrote last. A grandchild that kept the
    pipe open would block its reader for ever, hence the bounded wait (readers are daemon threads)."""
    deadline = time.monotonic() + READER_JOIN_S
    for pump in pumps:
        pump.join(max(0.0, deadline - time.monotonic()))


def launch(
    nprocs: int,
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    addr: str = "127.0.0.1",
    port: int | None = None,
    secret: str | None = None,
    tail_lines: int = 20,
    timeout: float | None = None,
) -> int:
    """Run ``nprocs`` copies of ``cmd`` (an argv list, no shell) as ranks 0..nprocs-1 of one job.

    Returns 0 when every rank exits 0; else the exit code of the first rank that failed (128 + signum
    for a rank killed by a signal), after stopping the others and printing that rank's last stderr
    lines; 124 when ``timeout`` seconds passed first; 128 + signum when the launcher got SIGINT or
    SIGTERM (forwarded to every rank). No child is left running when this returns or raises.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise _bad_argument(f"nprocs={nprocs!r}: pass the number of ranks to start, a whole number >= 1")
    if isinstance(cmd, str | bytes):
        raise _bad_argument(f"cmd={cmd!r} is a string: pass an argv list, e.g. [sys.executable, 'train.py']")
    cmd = [os.fspath(part) for part in cmd]
    if not cmd or not cmd[0]:
        raise _bad_argument(
            "cmd is empty: pass the program and its arguments, e.g. [sys.executable, 'train.py']"
        )
    if isinstance(tail_lines, bool) or not isinstance(tail_lines, int) or tail_lines < 0:
        raise _bad_argument(f"tail_lines={tail_lines!r}: pass a whole number >= 0")
    if timeout is not None and not timeout > 0:
        raise _bad_argument(f"timeout={timeout!r}: pass a number of seconds > 0, or None for no limit")
    if port is not None and not (isinstance(port, int) and 0 <= port <= 65535):
        raise _bad_argument(f"port={port!r}: pass a TCP port 1..65535, or None to pick a free one")
    if not addr:
        raise _bad_argument("addr is empty: pass the address rank 0 listens on, e.g. '127.0.0.1'")
    if secret is not None and not secret:
        raise _bad_argument("secret is empty: pass a non-empty job secret, or None to generate one")

    base_env = dict(os.environ)
    base_env.update(env or {})
    if secret is None:
        secret = base_env.get("HETCCL_SECRET") or secrets.token_hex(32)
    if not port:
        port = _pick_port(addr)
    host = addr.strip("[]")
    hetccl_addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    received: list[int] = []  # signals caught while launching (appended by the handler)
    previous_handlers: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _FORWARDED_SIGNALS:
            previous_handlers[sig] = signal.signal(sig, lambda signum, _frame: received.append(signum))

    procs: list[subprocess.Popen] = []
    pumps: list[_StderrPump] = []
    start = time.monotonic()
    try:
        for rank in range(nprocs):
            child_env = dict(base_env)
            child_env.update(
                HETCCL_RANK=str(rank),
                HETCCL_WORLD_SIZE=str(nprocs),
                HETCCL_LOCAL_RANK=str(rank),
                HETCCL_LOCAL_WORLD_SIZE=str(nprocs),
                HETCCL_ADDR=hetccl_addr,
                HETCCL_SECRET=secret,
                HETCCL_LAUNCHED="1",
                RANK=str(rank),
                WORLD_SIZE=str(nprocs),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(nprocs),
                MASTER_ADDR=host,
                MASTER_PORT=str(port),
            )
            proc = subprocess.Popen(cmd, env=child_env, stdout=None, stderr=subprocess.PIPE)
            procs.append(proc)
            pump = _StderrPump(rank, proc.stderr, tail_lines)
            pump.start()
            pumps.append(pump)

        first_failure: int | None = None
        while True:
            if received:
                return _on_signal(procs, pumps, received)
            for rank, proc in enumerate(procs):
                if proc.poll() not in (None, 0):
                    first_failure = rank  # lowest rank among those seen failing in the same poll
                    break
            if first_failure is not None:
                return _on_failure(procs, pumps, first_failure, hurry=lambda: bool(received))
            if not _running(procs):
                _join_pumps(pumps)
                return 0
            if timeout is not None and time.monotonic() - start >= timeout:
                still = _running(procs)
                _say(
                    f"timed out after {timeout:g} s; ranks still running: {_ranks_text(still)}; killing them"
                )
                _stop_all(procs, signal.SIGTERM, TERM_GRACE_S, hurry=lambda: bool(received))
                _join_pumps(pumps)
                return 124
            _sleep(POLL_INTERVAL_S)
    finally:
        try:
            if _running(procs):  # an exception (KeyboardInterrupt, failed Popen...) got us here
                _stop_all(procs, signal.SIGTERM, TERM_GRACE_S)
            for proc in procs:
                proc.wait()
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)


def _on_failure(procs: list[subprocess.Popen], pumps: list[_StderrPump], rank: int, hurry) -> int:
    """Stop the other ranks (SIGKILL at once if the launcher gets SIGINT/SIGTERM meanwhile), report."""
    code = procs[rank].returncode
    others = _running(procs)
    if others:
        killed = _stop_all(procs, signal.SIGTERM, TERM_GRACE_S, hurry)
        if killed:
            _say(f"ranks {_ranks_text(killed)} ignored SIGTERM for {TERM_GRACE_S:g} s; killed them")
    _join_pumps(pumps)
    lines = list(pumps[rank].tail)
    report = [
        f"hetccl run: rank {rank} failed with exit code {_describe_exit(code)}; "
        f"last stderr lines of rank {rank}:"
    ]
    report += [f"    {line}" for line in lines] if lines else ["    (no stderr output)"]
    if others:
        report.append(f"hetccl run: stopped ranks {_ranks_text(others)}")
    _write_stderr("\n".join(report) + "\n")
    return _exit_code(code)


def _on_signal(procs: list[subprocess.Popen], pumps: list[_StderrPump], received: list[int]) -> int:
    first = received[0]
    forwarded = 0

    def forward_new() -> bool:
        """Forward signals that arrived since the last call; True once a second signal came (hurry)."""
        nonlocal forwarded
        while forwarded < len(received):
            for proc in procs:
                _send(proc, received[forwarded])
            forwarded += 1
        return len(received) > 1

    forward_new()
    name = signal.Signals(first).name
    _say(f"got {name}; forwarded it to every rank, waiting up to {SIGNAL_GRACE_S:g} s for them to exit")
    killed = _stop_all(procs, None, SIGNAL_GRACE_S, hurry=forward_new)
    if killed:
        _say(f"ranks {_ranks_text(killed)} still running after {name}; killed them")
    _join_pumps(pumps)
    return 128 + first
