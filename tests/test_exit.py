"""A process that joins a job and exits without closing anything exits cleanly: the right code, no crash, no
hang (hetccl.lifecycle). Real 2-rank jobs, one per API and way of ending; benchmarks/exit_trials.py repeats them
many times (before the fix, init-then-return under torch crashed a rank with SIGSEGV in about half the runs).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from exit_workers import CRASH_RCS, EXPECTED_RC, ROOT, run_job

from hetccl.lifecycle import CLOSE_SLACK_S, EXIT_WAIT_S, JOIN_S

# from a rank's last line to its process end: the exit step's bound, plus interpreter teardown under load
EXIT_BOUND_S = EXIT_WAIT_S + CLOSE_SLACK_S + JOIN_S + 10.0


def check(api: str, how: str) -> None:
    res = run_job(api, how)
    report = res.report()
    want = EXPECTED_RC[how]
    for rank, (rc, out, took) in enumerate(zip(res.rcs, res.outs, res.exit_s, strict=True)):
        gone = how == "gone" and rank == len(res.rcs) - 1
        assert rc is not None, f"rank {rank} hung at exit\n{report}"
        assert rc not in CRASH_RCS, f"rank {rank} crashed at exit (rc {rc})\n{report}"
        assert rc == want, f"rank {rank} exited {rc}, expected {want}\n{report}"
        assert f"rank {rank} exiting at" in out, f"rank {rank} never reached its end\n{report}"
        if not gone:
            assert took is not None and took < EXIT_BOUND_S, f"rank {rank} took {took} s to exit\n{report}"
    if how == "raise":
        assert all("an uncaught exception after init" in e for e in res.errs), report


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["return", "exit3", "raise"])
@pytest.mark.parametrize("api", ["torch", "sync", "async"])
def test_exit_without_close(api: str, how: str) -> None:
    if api == "torch":
        pytest.importorskip("torch")
    check(api, how)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("api", ["torch", "sync"])
def test_exit_after_a_peer_is_gone(api: str) -> None:
    """The last rank leaves at once (os._exit, no exit step): the others' closing barrier gives up after
    EXIT_WAIT_S and they exit 0 in bounded time."""
    if api == "torch":
        pytest.importorskip("torch")
    check(api, "gone")


@pytest.mark.timeout(150)
def test_hetccl_run_reports_the_exit_code() -> None:
    """Under `hetccl run`, sys.exit(3) without close is reported as the job's exit code 3 (not a signal)."""
    res = run_job("sync", "exit3", launcher=True)
    assert res.rcs == [3], res.report()
    assert "exit code 3" in res.errs[0], res.report()


def run_python(code: str) -> None:
    """One single-rank process running `code`; it must exit 0."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, HETCCL_SECRET="test"))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_close_all_twice_and_after_close_is_harmless() -> None:
    """lifecycle.close_all finds nothing once everything is closed (a program that closed its communicators)."""
    code = ("import hetccl, hetccl.lifecycle as lc\n"
            "c = hetccl.init_sync(rank=0, world_size=1)\n"
            "c.close(); c.close(); lc.close_all(); lc.close_all()\n"
            "assert not c._runner.thread.is_alive()\n"
            "c2 = hetccl.init_sync(rank=0, world_size=1)\n"
            "lc.close_all()\n"
            "assert not c2._runner.thread.is_alive() and c2._comm._closed\n"
            "c2.close()\n")
    run_python(code)


def test_forked_child_leaves_the_parents_communicator_alone() -> None:
    """A child forked after init that runs the exit step (lifecycle.close_all, as its atexit would) must not
    close the parent's connections: the parent still runs collectives afterwards. (The child leaves with
    os._exit, as multiprocessing's children do: a forked child's normal interpreter exit crashes in libuv's
    own exit handler, uv__threadpool_cleanup joining the parent's threads, with or without hetccl's step.)"""
    code = ("import os, numpy as np, hetccl, hetccl.lifecycle as lc\n"
            "c = hetccl.init_sync(rank=0, world_size=1)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    lc.close_all()\n"
            "    os._exit(0 if not c._comm._closed else 5)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "assert os.waitstatus_to_exitcode(status) == 0, status\n"
            "a = np.ones(4, np.float32); c.all_reduce(a); assert not c._comm._closed\n"
            "c.close()\n")
    run_python(code)
