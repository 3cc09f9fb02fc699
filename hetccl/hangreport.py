"""Hang report: when a collective times out, what every rank of its communicator was doing.

The rank whose collective timed out asks every other rank of the communicator, over the data connections
(a REPORT_TAG control message), to write its flight records (`flight.py`: recent collectives, what is in
flight) into the rendezvous store under one key, writes its own, and reads them back for a bounded time
(HETCCL_REPORT_WAIT, default 5 s, at most a quarter of HETCCL_TIMEOUT and at least 1 s). A rank whose event
loop is alive answers even when it is not inside a collective; a dead rank, or one whose loop is blocked,
does not, and the report says so. The report names the ranks that are behind (they have not started the
collective that timed out) and what each one waits for. Each answer also says where the rank's Python threads
and its event loop's tasks stand (their innermost frames, as `py-spy dump` would, bounded): a rank behind is
most often stuck in its own code or in a call that never returns, and that line names it. The report is
logged at ERROR on the "hetccl" logger, shown on stderr even without logging set up, and written as JSON
under HETCCL_DUMP_DIR when that is set.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import params
from .matching import REPORT_TAG
from .wire import Fingerprint

if TYPE_CHECKING:
    from .bootstrap import Fabric
    from .scheduler import GroupView

log = logging.getLogger("hetccl")
RECENT = 16  # records per communicator in a report
FRAMES = 6  # innermost frames of each thread or task in an answer
STACKS = 16  # threads, and tasks, in an answer


@functools.cache
def _stdlib() -> tuple[str, ...]:
    """The standard library's folders (looked up at the first report, not at import)."""
    import sysconfig

    return tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})


def _frames(frames: Any) -> list[str]:
    """`file:line in function`, innermost first, from (frame, lineno) pairs innermost first."""
    out = []
    for f, line in frames:
        path = f.f_code.co_filename
        out.append(f"{'/'.join(path.split(os.sep)[-2:])}:{line} in {getattr(f.f_code, 'co_qualname', f.f_code.co_name)}"
                   + (" (stdlib)" if path.startswith(_stdlib()) else ""))
        if len(out) == FRAMES:
            break
    return out


def _await_chain(coro: Any) -> list[tuple[Any, int]]:
    """A task's coroutines, innermost first: each suspended one and the one it awaits."""
    chain = []
    while coro is not None and len(chain) < 64:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        chain.append((frame, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain[::-1]


def chain(frames: list[str]) -> str:
    """A thread's or task's innermost frames on one line, innermost first (four of them)."""
    return " <- ".join(frames[:4])


def thread_frames(ident: int | None) -> list[str]:
    """The innermost frames of thread `ident` now ([] where it has ended)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return _frames(traceback.walk_stack(frame)) if frame is not None else []


def stacks() -> dict[str, list[dict[str, Any]]]:
    """Where this process stands: each Python thread but the caller (the loop, answering) and each task of the
    running loop but the caller's, by name, with its innermost frames."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    threads = [{"name": names.get(ident, str(ident))[:60], "frames": _frames(traceback.walk_stack(frame))}
               for ident, frame in sorted(sys._current_frames().items()) if ident != me][:STACKS]
    tasks = []
    try:
        current = asyncio.current_task()
        pending = sorted((t for t in asyncio.all_tasks() if t is not current),
                         key=lambda t: (len(t.get_name()), t.get_name()))  # Task-2 before Task-10
    except RuntimeError:  # no running loop
        pending = []
    for t in pending[:STACKS]:
        tasks.append({"name": t.get_name()[:60], "frames": _frames(_await_chain(t.get_coro()))})
    return {"threads": threads, "tasks": tasks}


def where(answer: dict[str, Any]) -> str:
    """One line for a rank: its main thread's innermost frame outside the standard library, or, where the
    main thread runs the event loop (the async API), its first task's."""
    def first(entries: list[dict[str, Any]]) -> str:
        for e in entries:
            own = [f for f in e["frames"] if not f.endswith("(stdlib)")]
            if own:
                return f"{e['name']} at {own[0]}"
        return ""
    main = [t for t in answer.get("threads", []) if t["name"] == "MainThread"]
    return first(main) or first(answer.get("tasks", []))


def records_of(fab: Fabric) -> dict[str, Any]:
    """This rank's answer: every live communicator's recent collectives and what is in flight."""
    now = time.monotonic()
    comms = {}
    for cid, comm in list(fab.comms.items()):
        if comm.closed and not comm.flight.inflight:
            continue
        waiting = sorted({comm.group_rank(ep.peer) for ep in comm.peers.values()
                          for k in fab.matchers[ep.peer].posted if k[0] == cid})
        comms[str(cid)] = {"rank": comm.rank, "size": comm.size, "next_seq": comm.next_seq,
                           "inflight": sorted(comm.flight.inflight), "waiting_for": waiting,
                           "recent": comm.flight.snapshot(now)[-RECENT:]}
    return {"rank": fab.rank, "host": socket.gethostname(), "pid": os.getpid(), "comms": comms,
            "lost": sorted(fab.lost), **stacks()}


def answer(fab: Fabric, peer: int, payload: bytes) -> None:
    """A peer asked for our records (its collective timed out): write them where it said."""
    import msgpack

    try:
        msg = msgpack.unpackb(payload, max_str_len=512, max_bin_len=0, max_array_len=0, max_map_len=2)
        key = str(msg["key"])
    except Exception:  # noqa: BLE001 (malformed control message: ignored, like any malformed frame)
        log.warning("hetccl: rank %d ignored a malformed report request from rank %d", fab.rank, peer)
        return
    if not key.startswith(f"{fab.job}/hang/") or fab.store is None:
        return

    async def write() -> None:
        try:
            await fab.store.set(f"{key}/{fab.rank}", records_of(fab))
        except Exception as exc:  # noqa: BLE001 (the report is best effort)
            log.warning("hetccl: rank %d could not answer a report request: %r", fab.rank, exc)

    task = asyncio.ensure_future(write())
    fab._notices.add(task)
    task.add_done_callback(fab._notices.discard)


async def gather(comm: GroupView, fp: Fingerprint, waited: float) -> dict[str, Any]:
    """Collect every rank's records for the timed-out collective fp (bounded), analyse them, log the report,
    write HETCCL_DUMP_DIR/…json; returns the report."""
    fab = comm.fabric
    key = f"{fab.job}/hang/{fp.comm:x}/{fp.seq}/{secrets.token_hex(4)}"
    others = [g for g in comm.members if g != fab.rank]
    import msgpack

    fab.tell(others, fp, REPORT_TAG, msgpack.packb({"key": key}))
    answers: dict[int, Any] = {fab.rank: records_of(fab)}
    # bounded: the report must not hold the error back for long (at most a quarter of the deadline)
    wait = min(params.get("HETCCL_REPORT_WAIT"), max(1.0, comm.settings.timeout / 4))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    if fab.store is not None and others:
        # poll with short requests: the store client is one connection, and a blocking get would hold it
        # while this rank's own answer to another reporter waits behind it
        pending = set(others)
        try:
            async with asyncio.timeout(wait + 0.2):  # an unreachable store must not stretch it either
                while pending and loop.time() < deadline:
                    for g in sorted(pending):
                        if await fab.store.check(f"{key}/{g}"):
                            answers[g] = await fab.store.get(f"{key}/{g}", timeout=1.0)
                            pending.discard(g)
                    if pending:
                        await asyncio.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 (the store may be gone with rank 0: report what we have)
            if not isinstance(exc, TimeoutError):
                log.warning("hetccl: hang report incomplete: %r", exc)
    report = analyse(comm, fp, waited, answers)
    log.error("%s", format_report(report))
    dump = params.get("HETCCL_DUMP_DIR")
    if dump:
        try:
            Path(dump).mkdir(parents=True, exist_ok=True)
            path = Path(dump) / f"hang-{fab.job}-rank{fab.rank}-comm{fp.comm:x}-seq{fp.seq}.json"
            path.write_text(json.dumps(report, indent=1))
            report["file"] = str(path)
        except OSError as exc:
            log.warning("hetccl: could not write the hang report under %s: %s", dump, exc)
    return report


def analyse(comm: GroupView, fp: Fingerprint, waited: float, answers: dict[int, Any]) -> dict[str, Any]:
    cid = str(fp.comm)
    ranks = []
    for r, g in enumerate(comm.members):
        a = answers.get(g)
        entry: dict[str, Any] = {"rank": r, "job_rank": g}
        if a is None:
            entry["state"] = "no answer: dead, or its event loop is blocked (stuck outside hetccl)"
            ranks.append(entry)
            continue
        c = a["comms"].get(cid)
        entry.update(host=a["host"], pid=a["pid"], threads=a.get("threads", []), tasks=a.get("tasks", []),
                     where=where(a))
        if c is None:
            entry["state"] = "has not joined this communicator (or closed it)"
        else:
            started = c["next_seq"]  # sequence numbers this rank has issued: 0 .. next_seq-1
            entry.update(inflight=c["inflight"], waiting_for=c["waiting_for"], recent=c["recent"])
            last = next((x for x in reversed(c["recent"]) if x["state"] != "running"), None)
            entry["last_done"] = last["what"] if last else None
            running = [x for x in c["recent"] if x["state"] == "running"]
            entry["running"] = [x["what"] for x in running]
            entry["behind"] = started <= fp.seq
            if entry["behind"]:
                entry["state"] = (f"behind: has not started {fp.describe()} (next it would issue is #{started}"
                                  f"{', is inside ' + ', '.join(entry['running']) if running else ''})")
            elif fp.seq in c["inflight"]:
                entry["state"] = (f"inside #{fp.seq}" + (f", waiting for data from ranks {c['waiting_for']}"
                                                         if c["waiting_for"] else ""))
            else:
                mine = next((x for x in c["recent"] if x["seq"] == fp.seq), None)
                failed = mine is not None and mine["state"] == "failed" and mine["took_s"] is not None  # timed out too
                entry["state"] = (f"gave up on #{fp.seq} (failed after {mine['took_s']:.1f} s)" if failed
                                  else f"finished #{fp.seq}") + (f", now inside {', '.join(entry['running'])}"
                                                                 if running else "")
        ranks.append(entry)
    behind = [e["rank"] for e in ranks if e.get("behind")]
    silent = [e["rank"] for e in ranks if "host" not in e]
    return {"collective": fp.describe(), "communicator": f"{fp.comm:#x}", "reporter": comm.rank,
            "waited_s": round(waited, 1), "behind": behind, "no_answer": silent, "ranks": ranks}


def summary(rep: dict[str, Any]) -> str:
    """The report in one clause of the timeout's message: who is behind and where (three ranks at most)."""
    at = [f"rank {e['rank']} {e['where']}" for e in rep["ranks"] if e.get("behind") and e.get("where")][:3]
    return (f"hang report: ranks behind {rep['behind']}" + (f" ({'; '.join(at)})" if at else "")
            + f", no answer from {rep['no_answer']}"
            + (f" (written to {rep['file']})" if "file" in rep else " (logged)"))


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"hetccl hang report: {rep['collective']} on communicator {rep['communicator']} timed out on rank "
             f"{rep['reporter']} after {rep['waited_s']} s"]
    if rep["behind"]:
        lines.append(f"  ranks behind (never started it): {rep['behind']}")
    if rep["no_answer"]:
        lines.append(f"  ranks that did not answer: {rep['no_answer']}")
    for e in rep["ranks"]:
        at = f"{e['host']}:{e['pid']}" if "host" in e else "?"
        done = f"; last done: {e['last_done']}" if e.get("last_done") else ""
        lines.append(f"  rank {e['rank']} ({at}): {e['state']}{done}")
        if e.get("behind"):  # the suspects: where each of their threads and tasks stands
            for kind in ("threads", "tasks"):
                for t in e.get(kind, []):
                    lines.append(f"    {kind[:-1]} {t['name']}: {chain(t['frames'])}")
    return "\n".join(lines)
