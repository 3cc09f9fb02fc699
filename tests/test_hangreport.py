"""hangreport.analyse: the state line of each rank, from flight-recorder answers (no processes needed)."""

from __future__ import annotations

from types import SimpleNamespace

from hetccl.hangreport import analyse
from hetccl.wire import CollOp, Fingerprint


def _answer(next_seq: int, inflight: list[int], recent: list[dict]) -> dict:
    return {"host": "h", "pid": 1, "comms": {"1": {"next_seq": next_seq, "inflight": inflight, "waiting_for": [],
                                                   "recent": recent}}}


def _rec(seq: int, state: str, took: float | None) -> dict:
    return {"seq": seq, "what": f"all_reduce #{seq}", "state": state, "started_s_ago": 10.0, "took_s": took}


def test_states_of_each_rank() -> None:
    comm = SimpleNamespace(members=[0, 1, 2, 3], rank=0)
    fp = Fingerprint(1, 1, CollOp.ALL_REDUCE, 6, 10)
    answers = {
        0: _answer(2, [1], [_rec(0, "done", 0.1), _rec(1, "running", None)]),
        1: _answer(2, [], [_rec(0, "done", 0.1), _rec(1, "failed", 10.05)]),  # timed out just before answering
        2: _answer(1, [], [_rec(0, "done", 0.1)]),
        3: _answer(2, [], [_rec(0, "done", 0.1), _rec(1, "done", 0.2)]),
    }
    rep = analyse(comm, fp, 10.0, answers)  # type: ignore[arg-type]
    states = [r["state"] for r in rep["ranks"]]
    assert states[0].startswith("inside #1")
    assert states[1] == "gave up on #1 (failed after 10.1 s)"
    assert states[2].startswith("behind: has not started")
    assert states[3] == "finished #1"
    assert rep["behind"] == [2] and rep["no_answer"] == []
    rep = analyse(comm, fp, 10.0, {g: a for g, a in answers.items() if g != 3})  # type: ignore[arg-type]
    assert rep["no_answer"] == [3] and rep["ranks"][3]["state"].startswith("no answer")
