"""The command line: hetccl bench (spawns its own ranks, checks every result), hetccl info, hetccl run."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys

import pytest
from rankrun import ROOT


def _hetccl(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith(("HETCCL_", "RANK", "WORLD_SIZE"))}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "hetccl", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_bench_spawns_ranks_and_checks_results(tmp_path, nprocs: int) -> None:
    out = tmp_path / "bench.json"
    # the default --ops: every collective of the API (gather, scatter and reduce used to be left out)
    proc = _hetccl("bench", "--nprocs", str(nprocs), "-b", "4K", "-e", "64K", "-f", "4", "-n", "3", "-w", "1",
                   "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter"):
        assert f"# {op}  (" in text
    assert "Out of bounds values : 0 OK" in text
    rows = json.loads(out.read_text())["results"]
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                       "all_to_all", "gather", "scatter"}
    assert all(r["oop_wrong"] == 0 for r in rows)
    assert all(r["nranks"] == nprocs for r in rows)
    sizes = sorted({r["size"] for r in rows if r["op"] == "all_reduce"})
    assert sizes == [4096, 16384, 65536]


@pytest.mark.timeout(60)
def test_bench_rejects_bad_flags() -> None:
    proc = _hetccl("bench", "--ops", "nonsense")
    assert proc.returncode != 0 and "unknown op" in proc.stderr


@pytest.mark.timeout(60)
def test_info_lists_transports() -> None:
    proc = _hetccl("info")
    assert proc.returncode == 0, proc.stderr
    assert "tcp" in proc.stdout and "shm" in proc.stdout and "native" in proc.stdout
    assert "transport_api : 2" in proc.stdout
    assert "pairlink" in proc.stdout and "device memory" in proc.stdout  # the zero-copy links, declared


@pytest.mark.timeout(60)
def test_run_reports_failing_rank() -> None:
    code = "import os, sys; sys.exit(7 if os.environ['HETCCL_RANK'] == '1' else 0)"
    proc = _hetccl("run", "-n", "3", "--", sys.executable, "-c", code)
    assert proc.returncode == 7
    assert "rank 1 failed with exit code 7" in proc.stderr


@pytest.mark.timeout(60)
def test_run_needs_a_command() -> None:
    proc = _hetccl("run", "-n", "2")
    assert proc.returncode == 2 and "give the command" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args,says,rc", [
    (["-n", "0", "--", sys.executable, "-c", "pass"], "hetccl run: -n 0: give the number of ranks to start", 2),
    (["-n", "-3", "--", sys.executable, "-c", "pass"], "hetccl run: -n -3: give the number of ranks to start", 2),
    (["-n", "2"], "hetccl run: give the command to launch", 2),
    (["-n", "2", "--timeout", "0", "--", sys.executable, "-c", "pass"], "hetccl run: timeout=0.0: pass a number", 2),
    (["-n", "2", "--", "/no/such/program"], "hetccl run: cannot start '/no/such/program': No such file", 127),
])
def test_run_bad_input_is_one_line(args: list[str], says: str, rc: int) -> None:
    """`hetccl run -n 0` used to end in a ConfigError traceback, a missing program in a FileNotFoundError one."""
    proc = _hetccl("run", *args)
    assert proc.returncode == rc
    assert proc.stderr.startswith(says) and proc.stderr.count("\n") == 1, proc.stderr


FAILING_JOB = """
import numpy as np, hetccl
async def main():
    comm = await hetccl.init()
    buf = np.ones(1000, np.float32)
    print(f"rank {comm.rank} ready", flush=True)
    for _ in range(3):
        await comm.all_reduce(buf)
    if comm.rank == 1:
        raise ValueError("rank 1 gives up")
    await comm.all_reduce(buf)
    await comm.close()
hetccl.run(main())
"""


@pytest.mark.timeout(90)
def test_run_shows_a_failure_once() -> None:
    """Rank 1 of 3 raises: its traceback once, then one summary line. It used to be every rank's traceback (the
    others' PeerLostError), interleaved, then rank 1's last lines again: ~60 lines."""
    proc = _hetccl("run", "-n", "3", "--", sys.executable, "-c", FAILING_JOB, timeout=80)
    assert proc.returncode == 1, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"[{r}] rank {r} ready" for r in range(3)]
    err = proc.stderr.splitlines()
    assert err.count("[1] Traceback (most recent call last):") == 1 and "Traceback" not in "".join(
        ln for ln in err if not ln.startswith("[1] "))
    tb = err.index("[1] Traceback (most recent call last):")
    assert err[tb:] == [ln for ln in err[tb:] if ln.startswith("[1] ")][:len(err) - tb - 1] + [err[-1]]
    assert err[-2] == "[1] ValueError: rank 1 gives up"
    # the others are stopped, or have failed themselves meanwhile (a lost peer): either is said in that one line
    assert re.fullmatch(r"hetccl run: rank 1 failed with exit code 1(; (ranks 0, 2|rank [02]) failed too \(output "
                        r"not shown\))?(; (ranks 0, 2 were|rank [02] was) stopped)?", err[-1]), err[-1]
    assert "PeerLostError" not in proc.stderr and "lost rank" not in proc.stderr


@pytest.mark.timeout(60)
def test_info_wraps_reasons_instead_of_cutting_them() -> None:
    """`hetccl info` used to cut each vendor library's reason at 200 characters, mid-word."""
    proc = _hetccl("info", env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for line in lines:  # wrapped at the terminal's width; only a single word longer than a line may exceed it
        assert len(line) <= 80 or " " not in line.strip(), line
    start = next(i for i, ln in enumerate(lines) if ln.startswith("  nccl "))
    entry = [lines[start]] + list(itertools.takewhile(lambda ln: ln.startswith(" " * 11), lines[start + 1:]))
    text = " ".join(ln.strip() for ln in entry)
    if "no usable NCCL" in text:  # the reason ends with what to do, and nothing of it is lost
        assert text.endswith("HETCCL_NCCL_LIB=/path/to/libnccl.so.2"), text


@pytest.mark.timeout(60)
def test_info_says_why_an_island_label_is_refused() -> None:
    proc = _hetccl("info", env={"HETCCL_ISLAND": "banana"})
    assert proc.returncode == 0, proc.stderr
    assert "island        : refused: HETCCL_ISLAND='banana': an island label starts with its vendor" in proc.stdout


@pytest.mark.timeout(60)
def test_run_of_a_quiet_job_adds_nothing() -> None:
    """A job that prints one line per rank shows just those lines, tagged. Every rank used to print an INFO line
    too: importing pyverbs (the verbs transport's availability check) called logging.basicConfig(level=INFO)."""
    code = ("import hetccl\nasync def main():\n    c = await hetccl.init()\n    print('hello from', c.rank)\n"
            "    await c.close()\nhetccl.run(main())\n")
    proc = _hetccl("run", "-n", "2", "--", sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0] hello from 0", "[1] hello from 1"]
    assert proc.stderr == ""


KILLED_JOB = """
import os, signal, numpy as np, hetccl
async def main():
    comm = await hetccl.init()
    buf = np.ones(1000, np.float32)
    for i in range(200):
        await comm.all_reduce(buf)
        if comm.rank == 1 and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
    await comm.close()
hetccl.run(main())
"""


@pytest.mark.timeout(90)
def test_run_blames_the_killed_rank_not_the_peers_that_lost_it() -> None:
    """Rank 1 is killed: its peers raise PeerLostError at once, maybe before the launcher sees rank 1's end.
    The report names rank 1 and shows none of the consequences."""
    proc = _hetccl("run", "-n", "3", "--", sys.executable, "-c", KILLED_JOB, timeout=80)
    assert proc.returncode == 137, proc.stderr
    assert proc.stderr.startswith("hetccl run: rank 1 failed with exit code 137 (killed by SIGKILL)"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
