"""`hetccl topo` under a real launch, and `hetccl bench` tooling: --plot (with anchors), --compare, and
the progress bar on a terminal (a real pseudo-terminal)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest
from rankrun import ROOT

TOPO_RANK = ("import os, sys; isl = os.environ.get('TEST_ISLANDS');\n"
             "isl and os.environ.__setitem__('HETCCL_ISLAND', isl.split(',')[int(os.environ['HETCCL_RANK'])])\n"
             "from hetccl.cli import main; sys.exit(main(sys.argv[1:]))")


def _hetccl(*args: str, env: dict[str, str] | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HETCCL_", "RANK", "WORLD_SIZE"))}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "hetccl", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.mark.timeout(90)
def test_topo_tables_under_a_launcher() -> None:
    proc = _hetccl("run", "-n", "3", "--", sys.executable, "-c", TOPO_RANK, "topo",
                   env={"TEST_ISLANDS": "cpu-a,cpu-b,cpu-b", "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(ln.startswith("[0] ") for ln in proc.stdout.splitlines())  # rank 0 prints, `hetccl run` tags
    out = "\n".join(ln[4:] for ln in proc.stdout.splitlines())
    assert out.count("hetccl job: 3 rank(s), 1 host(s), 2 island(s)") == 1  # rank 0 only
    lines = out.splitlines()
    isl = {ln.split()[0]: ln.split()[1] for ln in lines if ln.strip().startswith("cpu-")}
    assert isl == {"cpu-a": "0", "cpu-b": "1-2"}
    pairs = [ln.split() for ln in lines if "<->" in ln]
    assert [p[:3] for p in pairs] == [["0", "<->", "1"], ["0", "<->", "2"], ["1", "<->", "2"]]
    assert all(p[3] == "yes" and p[4] == "shm" and "ring" in p[5] for p in pairs)
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        assert any(ln.split()[:1] == [op] and ("<=" in ln or "always" in ln) for ln in lines), op
    assert "algorithm by message size" in out


@pytest.mark.timeout(90)
def test_topo_json_over_tcp_and_info_flag() -> None:
    proc = _hetccl("run", "-n", "2", "--no-tag-output", "--", sys.executable, "-c", TOPO_RANK, "info", "--topo",
                   "--json",
                   env={"HETCCL_TRANSPORTS": "tcp", "HETCCL_ALGO": "all_reduce=ring"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    topo = json.loads(proc.stdout)
    assert topo["size"] == 2 and [r["rank"] for r in topo["ranks"]] == [0, 1]
    assert topo["pairs"] == [{"a": 0, "b": 1, "transport": "tcp", "same_host": True,
                              "all_reduce": "ring (HETCCL_ALGO)"}]
    assert topo["world"]["kind"] == "tcp"
    assert topo["world"]["algorithms"]["all_reduce"] == "ring (HETCCL_ALGO)"
    assert "<=ring" in topo["world"]["algorithms"]["broadcast"] or "always" in topo["world"]["algorithms"]["broadcast"]


def test_topo_outside_a_launcher_says_how() -> None:
    proc = _hetccl("topo")
    assert proc.returncode == 2 and "hetccl run -n 3 -- hetccl topo" in proc.stderr


def _rows(op: str, sizes: list[int], busbw: list[float], ip: bool = True) -> list[dict]:
    out = []
    for s, b in zip(sizes, busbw, strict=True):
        row = {"op": op, "nranks": 2, "size": s, "count": s // 4, "oop_time_us": s / b / 1e3, "oop_busbw": b,
               "oop_algbw": b, "oop_wrong": 0}
        if ip:
            row.update(ip_busbw=2 * b, ip_time_us=s / b / 2e3, ip_algbw=2 * b, ip_wrong=0)
        out.append(row)
    return out


def _write(path, rows) -> str:
    path.write_text(json.dumps({"tool": "hetccl", "nranks": 2, "results": rows}))
    return str(path)


def test_compare_prints_per_size_ratios(tmp_path) -> None:
    a = _write(tmp_path / "a.json", _rows("all_reduce", [4096, 65536], [1.0, 4.0])
               + _rows("broadcast", [4096], [2.0], ip=False))
    b = _write(tmp_path / "b.json", _rows("all_reduce", [4096, 65536, 1 << 20], [2.0, 2.0, 9.0], ip=False)
               + _rows("broadcast", [4096], [3.0], ip=False))
    proc = _hetccl("bench", "--compare", a, b)
    assert proc.returncode == 0, proc.stderr
    rows = {(ln.split()[0], int(ln.split()[1])): ln for ln in proc.stdout.splitlines() if not ln.startswith("#")}
    assert set(rows) == {("all_reduce", 4096), ("all_reduce", 65536), ("broadcast", 4096)}  # common sizes only
    assert rows["all_reduce", 4096].split("|")[1].split() == ["1.000", "2.000", "2.000"]
    assert rows["all_reduce", 65536].split("|")[1].split() == ["4.000", "2.000", "0.500"]
    assert rows["all_reduce", 4096].split("|")[2].split() == ["n/a"]  # B has no in-place numbers
    assert rows["broadcast", 4096].split("|")[1].split() == ["2.000", "3.000", "1.500"]
    assert "all_reduce: geometric mean ratio 1.000 over 2 size(s)" in proc.stdout
    bad = _hetccl("bench", "--compare", a, str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "cannot read results" in bad.stderr


def _png_ok(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from PIL import Image  # matplotlib depends on pillow

    img = Image.open(path).convert("L")
    w, h = img.size
    assert w >= 400 and h >= 300
    import numpy as np

    colours = len(np.unique(np.asarray(img)))
    assert colours > 20  # axes, text and curves, not a blank canvas


@pytest.mark.timeout(180)
def test_bench_plot_with_anchor(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    anchor = _write(tmp_path / "gloo.json", _rows("all_reduce", [4096, 16384], [0.01, 0.02]))
    png, out = tmp_path / "bw.png", tmp_path / "run.json"
    proc = _hetccl("bench", "--nprocs", "2", "-b", "4K", "-e", "16K", "-n", "3", "-w", "1", "--ops",
                   "all_reduce,broadcast", "--json", str(out), "--plot", str(png), "--anchor", f"gloo={anchor}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"# plot: {png}" in proc.stdout
    _png_ok(png)
    # plotting saved results needs no job
    png2 = tmp_path / "again.png"
    proc = _hetccl("bench", "--plot", str(png2), "--results", str(out), "--anchor", f"gloo={anchor}")
    assert proc.returncode == 0, proc.stderr
    _png_ok(png2)
    bad = _hetccl("bench", "--anchor", f"gloo={anchor}")
    assert bad.returncode != 0 and "go with --plot" in bad.stderr
    bad = _hetccl("bench", "--plot", str(png2), "--results", str(png))
    assert bad.returncode == 2 and "cannot read results" in bad.stderr


def _bench_on_a_pty(*extra: str, stdout_too: bool = False) -> tuple[int, bytes, str]:
    """`hetccl bench` with stderr on a real pseudo-terminal (and stdout too with ``stdout_too``, as in a terminal
    or tmux); returns its exit code, what reached the terminal, and stdout when that was a pipe."""
    import pty

    master, slave = pty.openpty()
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HETCCL_", "RANK", "WORLD_SIZE"))}
    proc = subprocess.Popen([sys.executable, "-m", "hetccl", "bench", "--nprocs", "2", "-b", "4K", "-e", "16K",
                             "-n", "3", "-w", "1", "--ops", "all_reduce", *extra], cwd=ROOT, env=full,
                            stdin=subprocess.DEVNULL, stdout=slave if stdout_too else subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the terminal's last writer closed
                    data = b""
                seen += data
                if not data and proc.poll() is not None:
                    break
            elif proc.poll() is not None:
                break
        if stdout_too:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            stdout = ""
        else:
            stdout = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, seen, stdout


def _screen(tty: bytes) -> list[str]:
    """The lines a terminal shows for this output: \\r returns to column 0, ESC[K erases to the end of the line,
    other escape sequences draw nothing."""
    import re

    lines, line, col = [], [], 0
    text = tty.decode(errors="replace").replace("\r\n", "\n")
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\x1b":
            m = re.match(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\n]*(\x07|\n)?", text[i:])
            seq = m.group(0) if m else ch
            if seq == "\x1b[K":
                del line[col:]
            i += len(seq)
            continue
        if ch == "\n":
            lines.append("".join(line))
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
        i += 1
    if line:
        lines.append("".join(line))
    return lines


@pytest.mark.timeout(120)
def test_bench_progress_bar_on_a_terminal_only() -> None:
    rc, tty, stdout = _bench_on_a_pty()
    assert rc == 0 and "Out of bounds values : 0 OK" in stdout
    text = tty.decode(errors="replace")
    assert "━" in text and "/4" in text and "all_reduce" in text, text[-2000:]  # 2 sizes x (oop, in-place)
    assert "━" not in stdout  # the table on stdout stays clean
    assert [ln for ln in _screen(tty) if ln.strip()] == []  # and the progress line is erased at the end
    rc, tty, stdout = _bench_on_a_pty("--no-progress")
    assert rc == 0 and "━" not in tty.decode(errors="replace")


@pytest.mark.timeout(120)
def test_bench_progress_and_table_share_a_terminal_without_colliding() -> None:
    """stdout and stderr on one terminal (as in tmux): the progress line used to be drawn by rank 0 on the
    terminal while the table came from elsewhere, and table lines landed in the middle of the bar."""
    import re

    rc, tty, _ = _bench_on_a_pty(stdout_too=True)
    assert rc == 0, tty[-3000:]
    assert "━".encode() in tty  # the progress line was drawn...
    screen = _screen(tty)
    assert not any("━" in ln or "╸" in ln for ln in screen), screen  # ...and erased every time
    rows = [ln for ln in screen if re.match(r"\s+\d+\s+\d+\s+float32", ln)]
    assert [ln.split()[0] for ln in rows] == ["4096", "16384"], screen
    row = r"\s+\d+\s+\d+\s+float32\s+sum\s+-1 \|\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+0 \|\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+0"
    for ln in rows:
        assert re.fullmatch(row, ln), ln
    assert "# Out of bounds values : 0 OK" in screen
    header = screen.index("# all_reduce  (redop sum, root -1)")
    assert re.fullmatch(r"#\s+\|\s+out-of-place\s+\|\s+in-place\s*", screen[header + 1]), screen[header + 1]


def test_bench_default_ops_are_every_collective_of_the_api() -> None:
    from hetccl.bench import parse_args
    from hetccl.communicator import Communicator

    collectives = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
                   "scatter")
    assert all(callable(getattr(Communicator, op, None)) for op in collectives)
    assert sorted(parse_args([]).ops.split(",")) == sorted(collectives)


def test_bench_sizes_read_4k_1m_64m(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from hetccl.bench import plot, size_label

    assert [size_label(x) for x in (512, 4096, 65536, 1 << 20, 64 << 20, 1 << 30, 6144)] == [
        "512", "4K", "64K", "1M", "64M", "1G", "6K"]
    rows = [{"op": "all_reduce", "size": 4096 << (2 * k), "oop_busbw": 1.0 + k} for k in range(8)]
    ticks = plot(str(tmp_path / "p.png"), {"hetccl": rows})
    assert ticks["all_reduce"] == ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"]
