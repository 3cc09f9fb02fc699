"""Local process launcher: start N ranks of one command on this host (like ``torchrun --standalone``).

Each child gets the parent environment, plus ``env``, plus the rank variables read by
:mod:`hetccl.config` (``HETCCL_RANK``, ``HETCCL_WORLD_SIZE``, ``HETCCL_LOCAL_RANK``,
``HETCCL_LOCAL_WORLD_SIZE``, ``HETCCL_ADDR``, ``HETCCL_SECRET``, ``HETCCL_LAUNCHED``) and their torchrun
counterparts (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``). Rank 0 hosts the rendezvous store on ``HETCCL_ADDR``.

Output: each rank's stdout and stderr come through pipes and are read line by line; every line is written
whole (ranks never interleave mid-line) to the launcher's stdout or stderr, prefixed with the rank (``[1] ...``,
like ``mpirun --tag-output``) unless ``tag_output=False``. Python children run unbuffered
(``PYTHONUNBUFFERED=1`` unless set), so that their lines arrive as they are printed.

A failure is shown once. A Python traceback on a rank's stderr is held back (up to ``tail_lines`` lines) while
the rank dies; the rank that failed first (the earliest traceback, else the first non-zero exit) is the one
reported: its traceback, then one summary line, e.g. ``hetccl run: rank 1 failed with exit code 1; ranks 0, 2
were stopped``. The other ranks' output from then on (their tracebacks are consequences: a lost peer) is not
shown. A held traceback of a rank that keeps running (it was logged, not fatal) is shown after
``HOLD_QUIET_S`` seconds of quiet, and at once if the rank exits 0.

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

from . import params

__all__ = ["launch"]

POLL_INTERVAL_S = 0.02  # how often children are polled
TERM_GRACE_S = 5.0  # SIGTERM -> SIGKILL grace when the launcher stops the job itself
SIGNAL_GRACE_S = 10.0  # how long forwarded SIGINT/SIGTERM may take before SIGKILL
READER_JOIN_S = 2.0  # how long to wait for a rank's output to drain after it exited
SETTLE_S = 2.0  # after a failure: how long the rank that failed first (a traceback) may take to exit by itself
HOLD_QUIET_S = 3.0  # a held traceback of a rank still running is shown after this much quiet...
HOLD_MAX_S = 10.0  # ...or this long after it began
DELAY_S = 0.25  # every line waits this long before it is written: time to see whether a traceback follows
_MAX_LINE = 1 << 16  # longer lines are forwarded in pieces of this size
_TRACEBACK = b"Traceback (most recent call last):"
_CONSEQUENCE = b"hetccl.errors.PeerLostError: "
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_sleep = time.sleep  # one indirection, so that tests can interrupt the poll loop
_out_lock = threading.Lock()


def _bad_argument(message: str) -> ValueError:
    try:  # hetccl.errors.ConfigError is a ValueError; plain ValueError if that module is absent
        from hetccl.errors import ConfigError
    except ImportError:  # pragma: no cover
        return ValueError(message)
    return ConfigError(message)


def _write(which: str, data: bytes | str) -> None:
    """Write to the launcher's *current* sys.stdout or sys.stderr (``which``), whole lines at a time, under
    one lock for both streams, never raising."""
    with _out_lock:
        stream = sys.stdout if which == "stdout" else sys.stderr
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
        except (OSError, ValueError):  # closed or broken: keep the children's pipes drained anyway
            pass


def _write_stderr(data: bytes | str) -> None:
    _write("stderr", data)


def _say(message: str) -> None:
    _write_stderr(f"hetccl run: {message}\n")


class _Output:
    """Where every rank's lines go: tagged, whole, held back while a traceback may be a dying rank's."""

    def __init__(self, tag: bool, hold_lines: int):
        self._tag = tag
        self._hold_lines = hold_lines
        self._lock = threading.Lock()
        self.held: dict[int, list[bytes]] = {}  # rank -> tagged lines of its traceback, not shown yet
        self._held_dropped: dict[int, int] = {}
        self._held_times: dict[int, tuple[float, float]] = {}  # rank -> (first line, last line)
        self.traceback_at: dict[int, float] = {}  # rank -> when its first traceback began
        self._triggers: set[int] = set()  # ranks whose held lines contain a traceback
        # (when read, rank, "stdout" | "stderr", tagged line): written DELAY_S after it was read
        self._queue: collections.deque[tuple[float, int, str, bytes]] = collections.deque()
        self.muted: set[int] = set()

    def line(self, rank: int, which: str, data: bytes) -> None:
        """A line from a rank's pipe (called by its reader thread): queued, or held with a traceback."""
        if not data.endswith(b"\n"):
            data += b"\n"
        out = b"[%d] %s" % (rank, data) if self._tag else data
        with self._lock:
            if rank in self.muted:
                return
            now = time.monotonic()
            if which == "stderr":
                if data.startswith(_TRACEBACK) and rank not in self._triggers:
                    self._triggers.add(rank)
                    self.traceback_at.setdefault(rank, now)
                    self._hold(rank, now)
                    # other ranks' stderr of the last moments may be the consequence (a lost peer): hold it too
                    keep = collections.deque()
                    for entry in self._queue:
                        if entry[2] == "stderr" and entry[1] != rank:
                            self._hold(entry[1], now).append(entry[3])
                        else:
                            keep.append(entry)
                    self._queue = keep
                elif rank not in self.held and any(r != rank for r in self._triggers):
                    self._hold(rank, now)  # while another rank's traceback is held: maybe a consequence
                if rank in self.held:
                    block = self.held[rank]
                    block.append(out)
                    if len(block) > self._hold_lines:
                        del block[0]
                        self._held_dropped[rank] += 1
                    self._held_times[rank] = (self._held_times[rank][0], now)
                    return
            self._queue.append((now, rank, which, out))

    def _hold(self, rank: int, now: float) -> list[bytes]:
        if rank not in self.held:
            self.held[rank] = []
            self._held_dropped[rank] = 0
            self._held_times[rank] = (now, now)
        return self.held[rank]

    def flush(self, everything: bool = False) -> None:
        """Write the queued lines that are due (all of them with ``everything``), in the order they came."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._queue or not (everything or self._queue[0][0] + DELAY_S <= now):
                    return
                _, _, which, out = self._queue.popleft()
                _write(which, out)  # a muted rank's lines left in the queue came before the failure

    def _take(self, rank: int) -> list[bytes]:
        self._triggers.discard(rank)
        block = self.held.pop(rank, [])
        dropped = self._held_dropped.pop(rank, 0)
        self._held_times.pop(rank, None)
        if dropped:
            note = b"... (%d earlier lines of this traceback not shown)\n" % dropped
            block.insert(0, b"[%d] %s" % (rank, note) if self._tag else note)
        return block

    def show(self, rank: int) -> bool:
        """Write the rank's held lines now (after what is queued); False if there were none."""
        self.flush(everything=True)
        with self._lock:
            block = self._take(rank)
            if block:
                _write("stderr", b"".join(block))
        return bool(block)

    def mute(self, ranks: list[int], since: float) -> None:
        """Drop these ranks' held lines, their queued lines read at or after `since` (when the failure began),
        and everything they write from now on. What they printed before the failure still comes out."""
        with self._lock:
            for rank in ranks:
                self.muted.add(rank)
                self._take(rank)
            self._queue = collections.deque(e for e in self._queue
                                            if e[1] not in self.muted or e[0] < since)

    def release_stale(self, procs: list[subprocess.Popen]) -> None:
        """Show held lines that were not a dying rank's: the rank exited 0, or stays alive and quiet, or (lines
        held only because another rank's traceback was) no rank's traceback is held any more."""
        now = time.monotonic()
        for rank in list(self.held):
            code = procs[rank].poll()
            first, last = self._held_times.get(rank, (now, now))
            with self._lock:
                trigger = rank in self._triggers
                others = any(r != rank for r in self._triggers)
            if code == 0 or (code is None and (now - last >= HOLD_QUIET_S or now - first >= HOLD_MAX_S)
                             ) or (code is None and not trigger and not others):
                self.show(rank)
                if trigger:
                    with self._lock:  # it was not fatal: no sign of which rank failed first
                        self.traceback_at.pop(rank, None)

    def tracebacks(self) -> dict[int, float]:
        """rank -> when its (possibly fatal) traceback began."""
        with self._lock:
            return dict(self.traceback_at)

    def lost_a_peer(self, rank: int) -> bool:
        """Whether the rank's held traceback is hetccl's news that another rank died (a consequence, not a cause:
        the dead rank's exit may be seen after its peers' tracebacks began)."""
        with self._lock:
            return any(_CONSEQUENCE in line for line in self.held.get(rank, ()))


class _Pump(threading.Thread):
    """Reads one rank's stdout or stderr pipe line by line into the job's _Output."""

    def __init__(self, rank: int, which: str, pipe, output: _Output):
        super().__init__(name=f"hetccl-launch-{which}-{rank}", daemon=True)
        self._rank, self._which, self._pipe, self._output = rank, which, pipe, output

    def run(self) -> None:
        try:
            while True:
                line = self._pipe.readline(_MAX_LINE)
                if not line:
                    break
                self._output.line(self._rank, self._which, line)
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


def _stop_all(procs: list[subprocess.Popen], sig: int | None, grace: float, hurry=lambda: False,
              tick=lambda: None) -> list[int]:
    """Send ``sig`` (None: nothing, it was sent already) to the ranks still running, give them
    ``grace`` seconds (less if ``hurry()`` turns true), SIGKILL the rest and reap everyone.
    Returns the ranks that had to be SIGKILLed."""
    if sig is not None:
        for p in procs:
            _send(p, sig)
    deadline = time.monotonic() + grace
    while _running(procs) and time.monotonic() < deadline and not hurry():
        tick()
        _sleep(POLL_INTERVAL_S)
    killed = _running(procs)
    for rank in killed:
        _send(procs[rank], signal.SIGKILL)
    for p in procs:
        p.wait()
    return killed


def _join_pumps(pumps: list[_Pump]) -> None:
    """Let the readers forward what the (now dead) ranks wrote last. A grandchild that kept a pipe open would
    block its reader for ever, hence the bounded wait (readers are daemon threads)."""
    deadline = time.monotonic() + READER_JOIN_S
    for pump in pumps:
        pump.join(max(0.0, deadline - time.monotonic()))


def _plural(ranks: list[int], one: str, many: str) -> str:
    return f"rank {ranks[0]} {one}" if len(ranks) == 1 else f"ranks {_ranks_text(ranks)} {many}"


def launch(
    nprocs: int,
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    addr: str = "127.0.0.1",
    port: int | None = None,
    secret: str | None = None,
    tail_lines: int = 200,
    timeout: float | None = None,
    tag_output: bool = True,
) -> int:
    """Run ``nprocs`` copies of ``cmd`` (an argv list, no shell) as ranks 0..nprocs-1 of one job.

    Returns 0 when every rank exits 0; else the exit code of the rank that failed first (128 + signum for a
    rank killed by a signal), after stopping the others and printing that rank's traceback (its last
    ``tail_lines`` lines at most) and one summary line; 124 when ``timeout`` seconds passed first; 128 + signum
    when the launcher got SIGINT or SIGTERM (forwarded to every rank). Every output line of a rank is prefixed
    with ``[rank] `` unless ``tag_output`` is False. No child is left running when this returns or raises.
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
    base_env.setdefault("PYTHONUNBUFFERED", "1")  # lines through our pipes as they are printed
    if secret is None:
        secret = params.lookup("HETCCL_SECRET", base_env) or secrets.token_hex(32)
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
    pumps: list[_Pump] = []
    output = _Output(tag_output, max(tail_lines, 1))
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
            proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            for which, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                pump = _Pump(rank, which, pipe, output)
                pump.start()
                pumps.append(pump)

        exited_at: dict[int, float] = {}
        while True:
            if received:
                return _on_signal(procs, pumps, output, received)
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank not in exited_at and proc.poll() is not None:
                    exited_at[rank] = now
            if any(procs[r].returncode != 0 for r in exited_at):
                return _on_failure(procs, pumps, output, exited_at, hurry=lambda: bool(received))
            output.release_stale(procs)
            output.flush()
            if len(exited_at) == nprocs:
                _join_pumps(pumps)
                for rank in range(nprocs):
                    output.show(rank)
                output.flush(everything=True)
                return 0
            if timeout is not None and now - start >= timeout:
                still = _running(procs)
                output.flush(everything=True)
                _say(
                    f"timed out after {timeout:g} s; ranks still running: {_ranks_text(still)}; killing them"
                )
                _stop_all(procs, signal.SIGTERM, TERM_GRACE_S, hurry=lambda: bool(received), tick=output.flush)
                _join_pumps(pumps)
                output.flush(everything=True)
                return 124
            _sleep(POLL_INTERVAL_S)
    finally:
        try:
            if _running(procs):  # an exception (KeyboardInterrupt, failed Popen...) got us here
                _stop_all(procs, signal.SIGTERM, TERM_GRACE_S)
            for proc in procs:
                proc.wait()
            output.flush(everything=True)
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)


def _on_failure(procs: list[subprocess.Popen], pumps: list[_Pump], output: _Output, exited_at: dict[int, float],
                hurry) -> int:
    """Find the rank that failed first, give it a moment to exit by itself, stop the others (SIGKILL at once
    if the launcher gets SIGINT/SIGTERM meanwhile), then show its traceback and one summary line."""

    def first_failed() -> int:
        failed = {r: t for r, t in exited_at.items() if procs[r].returncode != 0}
        cutoff = min(failed.values())
        tracebacks = output.tracebacks()
        # a rank whose traceback began before the first failed exit is dying too, and was first: the others
        # most likely failed because of it (a lost peer)
        events = {r: min(tracebacks.get(r, t), t) for r, t in failed.items()}
        events.update({r: t for r, t in tracebacks.items() if r not in exited_at and t <= cutoff})
        return min(events, key=lambda r: (output.lost_a_peer(r), events[r], r))

    origin = first_failed()
    # when the failure began: its traceback, or its exit, which the launcher sees up to one poll late (the peers
    # that lost it may have said so in between; from then on their lines are consequences)
    began = min(output.tracebacks().get(origin, float("inf")),
                exited_at.get(origin, time.monotonic()) - 2 * POLL_INTERVAL_S)
    output.mute([r for r in range(len(procs)) if r != origin], since=began)
    deadline = time.monotonic() + SETTLE_S
    while procs[origin].poll() is None and time.monotonic() < deadline and not hurry():
        output.flush()
        _sleep(POLL_INTERVAL_S)
    if procs[origin].poll() is None or procs[origin].returncode == 0:
        # it did not die after all: report the first rank that exited with an error
        origin = min((r for r in exited_at if procs[r].returncode != 0), key=lambda r: (exited_at[r], r))
    now = time.monotonic()
    for rank, proc in enumerate(procs):
        if rank not in exited_at and proc.poll() is not None:
            exited_at[rank] = now
    failed_too = sorted(r for r in exited_at if r != origin and procs[r].returncode != 0)
    others = _running(procs)
    if others:
        killed = _stop_all(procs, signal.SIGTERM, TERM_GRACE_S, hurry, tick=output.flush)
        if killed:
            _say(f"{_plural(killed, 'ignored', 'ignored')} SIGTERM for {TERM_GRACE_S:g} s; killed")
    _join_pumps(pumps)
    output.show(origin)
    code = procs[origin].returncode
    summary = f"rank {origin} failed with exit code {_describe_exit(code)}"
    if failed_too:
        summary += f"; {_plural(failed_too, 'failed too', 'failed too')} (output not shown)"
    if others:
        summary += f"; {_plural(others, 'was stopped', 'were stopped')}"
    _say(summary)
    return _exit_code(code)


def _on_signal(procs: list[subprocess.Popen], pumps: list[_Pump], output: _Output, received: list[int]) -> int:
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
    output.flush(everything=True)
    _say(f"got {name}; forwarded it to every rank, waiting up to {SIGNAL_GRACE_S:g} s for them to exit")
    killed = _stop_all(procs, None, SIGNAL_GRACE_S, hurry=forward_new, tick=output.flush)
    if killed:
        _say(f"ranks {_ranks_text(killed)} still running after {name}; killed them")
    _join_pumps(pumps)
    output.flush(everything=True)
    output.mute(list(range(len(procs))), since=time.monotonic())  # the ranks' tracebacks of the interrupt are noise
    return 128 + first
