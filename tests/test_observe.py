"""Observability: HETCCL_TRACE files from real multi-rank jobs, the Prometheus exporter scraped over HTTP,
HETCCL_DEBUG logging, and the configuration errors."""

from __future__ import annotations

import json
import logging
import socket
import sys
from collections import defaultdict

import pytest
from rankrun import run_ranks

import hetccl
from hetccl import observe
from hetccl.observe import trace as trace_mod

OVERLAPPING = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"}  # no rank can finish
EPS_US = 0.01  # float rounding of ts/dur in microseconds


def _load(path) -> dict:
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list)
    return doc


def _check_nesting(events: list[dict]) -> None:
    """Spans on one lane (pid, tid) never partly overlap: each is inside or after the previous ones."""
    lanes = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            lanes[e["pid"], e["tid"]].append(e)
    for spans in lanes.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []
        for e in spans:
            while stack and stack[-1] <= e["ts"] + EPS_US:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + EPS_US, f"span {e} partly overlaps its lane"
            stack.append(end)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nranks,transports", [(3, "shm"), (2, "tcp")])
def test_trace_files_from_a_real_job(tmp_path, nranks: int, transports: str) -> None:
    skews = ["0", "2500000", "-1700000"][:nranks]  # rank clocks 2.5 s ahead / 1.7 s behind: corrected
    run_ranks(nranks, "observe_workers:trace_job", out=str(tmp_path / "ran"),
              env={"HETCCL_TRACE": str(tmp_path / "trace-%r.json"), "HETCCL_ALGO": "ring",
                   "HETCCL_CHUNK_BYTES": "4K", "HETCCL_TRANSPORTS": transports,
                   "HETCCL_TEST_CLOCK_SKEW_US": ",".join(skews)})
    docs = [_load(tmp_path / f"trace-{r}.json") for r in range(nranks)]
    ran = [json.loads((tmp_path / f"ran.rank{r}.json").read_text()) for r in range(nranks)]
    colls: list[dict[tuple[int, int], dict]] = []
    for r, doc in enumerate(docs):
        other = doc["otherData"]
        assert other["rank"] == r and other["world_size"] == nranks
        # the NTP-style exchange found the injected skew (within its own error bound plus a little)
        assert abs(other["clock_offset_us"] + float(skews[r])) <= other["clock_error_us"] + 500, other
        assert set(other["peers"].values()) == {transports}
        evs = doc["traceEvents"]
        assert all(e["pid"] == r for e in evs)
        names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
        assert names and all(n.startswith(f"rank {r} ") for n in names)
        mine = {(e["args"]["comm"], e["args"]["seq"]): e for e in evs if e.get("cat") == "collective"}
        # every collective the rank ran is there, in order, with its size, dtype and algorithm
        assert [mine[k]["name"] for k in sorted(mine)] == ran[r]
        for e in mine.values():
            assert e["args"]["status"] == "ok" and e["dur"] > 0
            assert e["args"]["algo"] == {"all_to_all": "direct", "barrier": "latency"}.get(e["name"], "ring")
        first = mine[min(mine)]
        assert first["name"] == "all_reduce" and first["args"]["bytes"] == nranks * 4096 * 4
        assert first["args"]["dtype"] == "float32"
        # chunk and transport events sit inside their collective's span, on this rank
        chunks = [e for e in evs if e.get("cat") == "chunk"]
        ops = [e for e in evs if e.get("cat") == "transport"]
        assert {e["args"]["nchunks"] for e in chunks if e["args"]["seq"] == first["args"]["seq"]} == {4}
        assert {e["name"] for e in ops} == {"send", "recv"}
        assert {e["args"]["transport"] for e in ops} == {transports}
        for e in chunks + ops:
            c = mine[e["args"]["comm"], e["args"]["seq"]]
            assert c["ts"] - EPS_US <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"] + EPS_US, (e, c)
        # the ring all_reduce moves 2(n-1) blocks per rank: each chunk's sends and receives are there
        sent = sum(e["args"]["bytes"] for e in ops if e["name"] == "send" and e["args"]["seq"] == 0)
        got = sum(e["args"]["bytes"] for e in ops if e["name"] == "recv" and e["args"]["seq"] == 0)
        assert sent == got == 2 * (nranks - 1) * 4096 * 4
        _check_nesting(evs)
        colls.append(mine)
    # one timeline: the same collective overlaps on every rank after the offset correction
    err = sum(d["otherData"]["clock_error_us"] for d in docs)
    for key in colls[0]:
        spans = [c[key] for c in colls]
        assert len({s["name"] for s in spans}) == 1
        start = max(s["ts"] for s in spans)
        end = min(s["ts"] + s["dur"] for s in spans)
        if spans[0]["name"] in OVERLAPPING:
            assert start <= end + err, (key, spans)


@pytest.mark.timeout(60)
def test_trace_name_and_cap(tmp_path, monkeypatch) -> None:
    assert trace_mod.trace_path("/x/t.json", 3) == "/x/t.rank3.json"
    assert trace_mod.trace_path("/x/t-%r.json", 3) == "/x/t-3.json"
    assert trace_mod.trace_path("/x/{rank}/t", 1) == "/x/1/t"
    assert trace_mod.trace_path("/x/t", 2) == "/x/t.rank2"
    path = tmp_path / "capped.json"
    tr = trace_mod.Tracer(str(path), 0, 0, 10, 5000, None, {"hostname": "h", "island": "cpu"})
    for i in range(12000):
        tr.span("transport", "send", i * 1000, i * 1000 + 500, 0, {"i": i})
        assert len(tr.buf) <= trace_mod.FLUSH_EVERY  # memory stays bounded: written out as it goes
    tr.close()
    evs = json.loads(path.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in evs) == 5000
    trunc = [e for e in evs if e["name"] == "trace truncated"]
    assert trunc and trunc[0]["args"]["dropped_events"] == 7000


def _free_port_pair() -> int:
    """Two consecutive free ports below the kernel's ephemeral range: a port that the test binds to 0 to find
    would be free again at once, and the ranks' own listeners (bound to 0 too) could take it before the exporter
    starts. Below the range nothing is handed out unasked."""
    import random

    try:
        lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    for _ in range(200):
        base = random.randrange(max(1024, lo - 12000), lo - 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
        except OSError:
            continue
        return base
    raise RuntimeError("no two consecutive free ports below the ephemeral range")


def _series(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transports", ["shm", "tcp"])
def test_metrics_scraped_during_a_real_job(tmp_path, transports: str) -> None:
    pytest.importorskip("prometheus_client")
    base = _free_port_pair()
    run_ranks(2, "observe_workers:metrics_job", out=str(tmp_path / "m"),
              env={"HETCCL_METRICS_PORT": str(base), "HETCCL_ALGO": "ring", "HETCCL_CHUNK_BYTES": "4K",
                   "HETCCL_TRANSPORTS": transports})
    for r in range(2):
        texts = json.loads((tmp_path / f"m.rank{r}.json").read_text())
        for port_rank, text in texts.items():
            who, other = int(port_rank), 1 - int(port_rank)
            s = _series(text)

            def get(name: str, s: dict = s, **labels: str) -> float:
                return s.get((name, frozenset(labels.items())), 0.0)

            info = [dict(k[1]) for k in s if k[0] == "hetccl_rank_info"]
            assert info and info[0]["rank"] == str(who) and info[0]["local_rank"] == str(who)
            assert get("hetccl_collective_ops_total", op="all_reduce", algo="ring") == 3
            assert get("hetccl_collective_bytes_total", op="all_reduce", algo="ring") == 3 * 4096 * 4
            # two all_gathers + the one inside split() (2 int64 per rank) that makes the mismatch's sub-communicator
            assert get("hetccl_collective_ops_total", op="all_gather", algo="ring") == 3
            assert get("hetccl_collective_bytes_total", op="all_gather", algo="ring") == 2 * 2 * 1024 * 4 + 2 * 16
            assert get("hetccl_collective_seconds_count", op="all_reduce") == 3
            assert get("hetccl_errors_total", op="all_reduce", error="CollectiveMismatchError") == 1
            for d in ("send", "recv"):
                lab = {"transport": transports, "peer": str(other), "direction": d}
                # ring all_gather on 2 ranks: each rank's 4 KiB block goes to the other once per call
                assert get("hetccl_transport_bytes_total", op="all_gather", **lab) == 2 * 1024 * 4 + 16
                # ring all_reduce: half the buffer each phase (+ what the mismatched one sent before failing)
                ar = get("hetccl_transport_bytes_total", op="all_reduce", **lab)
                assert 3 * 4096 * 4 <= ar <= 3 * 4096 * 4 + 64, ar
                assert get("hetccl_transport_ops_total", op="all_gather", **lab) == 3
            if who == r:  # our own exporter, read after our barrier
                assert get("hetccl_collective_ops_total", op="barrier", algo="latency") == 1


def test_metrics_config_errors(monkeypatch) -> None:
    from hetccl.observe import metrics

    with pytest.raises(hetccl.ConfigError, match="not a port"):
        metrics.parse_port("http")
    with pytest.raises(hetccl.ConfigError, match="1..65535"):
        metrics.parse_port("70000")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if it were not installed
    with pytest.raises(hetccl.ConfigError, match=r"hetccl\[metrics\]"):
        metrics.require_client()


@pytest.mark.timeout(60)
async def test_init_refuses_metrics_port_without_prometheus_client(monkeypatch) -> None:
    monkeypatch.setenv("HETCCL_METRICS_PORT", "9400")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(hetccl.ConfigError, match="prometheus_client is not installed"):
        await hetccl.init(rank=0, world_size=1, addr="127.0.0.1:0")


@pytest.mark.timeout(60)
def test_debug_logging_lines(tmp_path) -> None:
    proc = run_ranks(2, "observe_workers:trace_job", out=str(tmp_path / "ran"),
                     env={"HETCCL_DEBUG": "DEBUG", "HETCCL_ISLAND": ""})
    host = socket.gethostname()
    lines = proc.stderr.splitlines()
    for r in range(2):
        init = [ln for ln in lines if f"hetccl {host}:" in ln and f":{r} INFO init rank {r}/2" in ln]
        assert len(init) == 1, proc.stderr[-3000:]
        assert "island cpu" in init[0] and f"peers {1 - r}:shm" in init[0]
        assert "all_reduce=latency<" in init[0] and "<=ring" in init[0]
        debug = [ln for ln in lines if f":{r} DEBUG rank {r}: " in ln]
        assert len(debug) == len(json.loads((tmp_path / f"ran.rank{r}.json").read_text()))
        assert any("all_reduce #0 dtype=float32" in ln for ln in debug)
        # small collectives of this one-host group take the shared-memory fast path, reported as such
        assert any("all_reduce #0 dtype=float32" in ln and "B, fast) ok" in ln for ln in debug), debug


def test_debug_env_respects_application_config(monkeypatch) -> None:
    lg = logging.getLogger("hetccl")
    saved = (lg.level, list(lg.handlers), getattr(lg, "_hetccl_configured", False))
    try:
        with pytest.raises(hetccl.ConfigError, match="HETCCL_DEBUG"):
            observe.configure_logging({"HETCCL_DEBUG": "LOUD"})
        # the application configured the hetccl logger itself: left alone
        lg._hetccl_configured = False
        lg.setLevel(logging.ERROR)
        observe.configure_logging({"HETCCL_DEBUG": "DEBUG"})
        assert lg.level == logging.ERROR and lg.handlers == saved[1]
        # not configured: level set, a prefixed stderr handler added when the root has none
        lg.setLevel(logging.NOTSET)
        monkeypatch.setattr(logging.getLogger(), "handlers", [])
        observe.configure_logging({"HETCCL_DEBUG": "INFO"})
        assert lg.level == logging.INFO and len(lg.handlers) == len(saved[1]) + 1
        assert "hetccl_prefix" in lg.handlers[-1].formatter._fmt
    finally:
        lg.setLevel(saved[0])
        lg.handlers[:] = saved[1]
        lg._hetccl_configured = saved[2]


async def test_store_time_command() -> None:
    import time

    from hetccl.store import StoreClient, StoreServer

    srv = StoreServer("127.0.0.1", 0, b"s")
    port = await srv.start()
    cli = StoreClient("127.0.0.1", port, b"s", 10.0)
    try:
        await cli.connect()
        t0 = time.perf_counter_ns()
        ts = await cli.time()
        assert t0 <= ts <= time.perf_counter_ns()  # same host: the same monotonic clock
        offset, err = await trace_mod.clock_offset(cli, skew_ns=7_000_000_000)
        assert abs(offset + 7_000_000_000) <= err
    finally:
        cli.close()
        await srv.close()


@pytest.mark.parametrize("kind", ["shm", "tcp"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_crossover_is_where_the_cost_model_switches(kind: str, n: int) -> None:
    from hetccl import algorithms

    for op in algorithms.CHOOSABLE:
        first, at, other = observe.crossover_bytes(op, n, kind)
        if at is None:
            assert algorithms.choose(op, 1 << 40, n, kind, {}) == first
            assert observe.crossover(op, n, kind, {}) == f"{first} always"
            continue
        assert algorithms.choose(op, at - 1, n, kind, {}) == first != other
        assert algorithms.choose(op, at, n, kind, {}) == other
        assert observe.crossover(op, n, kind, {}) == f"{first}<{observe.fmt_bytes(at)}<={other}"
    assert observe.crossover("broadcast", n, kind, {"broadcast": "ring"}) == "ring (HETCCL_ALGO)"
    assert observe.rank_ranges([0, 1, 2, 5, 7, 8]) == ["0-2", "5", "7-8"]
