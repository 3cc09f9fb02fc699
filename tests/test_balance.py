"""hetccl.torch.balance: uneven shares of each global batch, exact averaging, and shares from measured speed,
under torchrun through the hetccl backend, with CPU islands on shared memory and between "hosts" over TCP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from test_torch_backend import HERE, run_torchrun  # noqa: E402

from hetccl.errors import ConfigError  # noqa: E402
from hetccl.torch import balance  # noqa: E402

WORKERS = HERE / "balance_workers.py"


def test_solve_minimises_the_slowest_rank() -> None:
    assert balance.solve([(0.0, 1.0), (0.0, 3.0)], 64) == [48, 16]
    assert balance.solve([(0.002, 1e-4), (0.002, 3e-4)], 64) == [48, 16]
    assert balance.solve([(0.0, 1.0), (0.0, 3.0)], 64, [40, 64]) == [40, 24]  # a cap
    assert balance.solve([(0.0, 1.0), (0.0, 1.0), (0.0, 1.0)], 7, [7, 0, 7]) == [4, 0, 3]  # cap 0: left out
    with pytest.raises(ConfigError, match="hold fewer"):
        balance.solve([(0.0, 1.0)] * 2, 64, [10, 10])


def test_a_memory_cap_never_rises() -> None:
    """Rank 0's choice of memory caps, for two ranks (the rows they send: rank 0's peak = m0 + m1 b of a
    limit, rank 1 without a gauge): a fit that allows 36 samples caps rank 0 at 36; a later fit that allows
    more (a refit on peaks at the cap itself), or none (the peaks window then holds one batch size only), keeps
    36, as the reason says."""
    bal = balance.Balancer(64, "auto", memory=None)  # one process: rank 0's side of a world of two, below
    bal.caps = [64, 64]
    mib = float(1 << 20)

    def rank0_cap(m0: float, m1: float) -> tuple[int, str]:
        caps, why = bal._memory_caps([[0.0] * 7 + [m0, m1, 100 * mib], [0.0] * 10])
        return caps[0], why

    assert rank0_cap(54 * mib, mib) == (36, "; memory: rank 0 at most 36 samples (54 MiB + 1024.0 KiB/sample of "
                                            "100 MiB)")  # (0.9 * 100 - 54) / 1
    assert rank0_cap(50 * mib, mib)[0] == 36
    assert rank0_cap(0.0, 0.0)[0] == 36
    assert rank0_cap(60 * mib, mib)[0] == 30  # lower: taken


def test_global_batches_are_one_process_batches() -> None:
    import torch

    got = list(balance.global_batches(50, 16, seed=3))
    assert [len(b) for b in got] == [16, 16, 16]
    assert got[0] == torch.randperm(50, generator=torch.Generator().manual_seed(3)).tolist()[:16]
    assert [len(b) for b in balance.global_batches(50, 16, 3, drop_last=False)] == [16, 16, 16, 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,islands", [(2, None), (3, "cpu-0,cpu-0,cpu-1")])
def test_uneven_shares_train_as_one_process(n: int, islands: str | None) -> None:
    """DDP (its reducer; torch's allreduce and fp16 hooks, hetccl's allreduce and bf16 hooks) and FSDP2, with
    uneven shares and a rank with none: every replica equals one process over the same global batches (1e-5;
    the compressing hooks within their dtype), where the same shares unweighted are far off. Bad shares, caps
    and a sampler without the weighting are ConfigErrors."""
    run_torchrun(n, "exact", script=WORKERS, env={"TEST_HETCCL_ISLAND": islands} if islands else None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,env", [("ddp", {"TEST_HETCCL_ISLAND": "cpu-0,cpu-1"}),
                                      ("fsdp2", {"TEST_HETCCL_HOST": "a,b"}),
                                      ("ddp-memory", {"TEST_HETCCL_ISLAND": "cpu-0,cpu-1"})])
def test_auto_shares_follow_measured_speed(tmp_path: Path, kind: str, env: dict[str, str]) -> None:
    """Rank 1 three times slower per sample (DDP: in its data loading, outside the model, as a host-bound GPU
    rank's gather; FSDP2: in its forward), then from batch 40 rank 0 five times slower (a deliberately slowed
    rank): calibration gives the fast rank about 3/4 of the batch (with a memory that holds fewer, what it holds),
    the drift moves it back, and the replicas still equal one process."""
    out = tmp_path / "auto"
    if kind == "ddp":  # the decisions in the trace too
        env = {**env, "HETCCL_TRACE": str(tmp_path / "trace.json")}
    run_torchrun(2, "auto", kind, str(out), script=WORKERS, env=env)
    hist = [json.loads((tmp_path / f"auto.{r}").read_text())["history"] for r in range(2)]
    assert [h[:2] for h in hist[0]] == [h[:2] for h in hist[1]], "every rank took the same decisions"
    calibrated = [h for h in hist[0] if h[2].startswith("calibrated")]
    assert calibrated and calibrated[0][0] <= 26, hist[0]
    if kind == "ddp-memory":  # rank 0's memory holds 36 samples: its cap, not its speed, sets its share
        assert calibrated[0][1][0] == 36 and "memory: rank 0 at most 36 samples" in calibrated[0][2], hist[0]
        assert all(h[1][0] <= 36 for h in hist[0]), hist[0]  # the calibration's probe too
    else:
        assert 40 <= calibrated[0][1][0] <= 54, hist[0]  # ideal 48 of 64
    assert any(h[0] > 40 and h[2].startswith("drift") for h in hist[0]), hist[0]
    assert 16 <= hist[0][-1][1][0] <= 30, hist[0]  # ideal 24
    if kind == "ddp":
        for r in range(2):
            evs = json.loads((tmp_path / f"trace.rank{r}.json").read_text())["traceEvents"]
            marks = [e["args"] for e in evs if e.get("cat") == "balance" and e["name"] == "shares"]
            assert [m["shares"] for m in marks] == [h[1] for h in hist[r]], (marks, hist[r])
            assert any(m["reason"].startswith("calibrated") for m in marks), marks


@pytest.mark.timeout(120)
def test_a_cap_found_by_trying_keeps_a_rank_within_its_memory(tmp_path: Path) -> None:
    """Rank 1's address space limited for real: balance.find_cap finds its cap through the CPU allocator's real
    out-of-memory errors (the equal share runs out, checked first), and auto shares train within it, two
    islands, the replicas equal to one process (tests/balance_workers.py found_cap)."""
    run_torchrun(2, "found_cap", str(tmp_path / "cap"), script=WORKERS,
                 env={"TEST_HETCCL_ISLAND": "cpu-0,cpu-1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    cap = json.loads((tmp_path / "cap.1").read_text())["cap"]
    hist = json.loads((tmp_path / "cap.0").read_text())["history"]
    assert all(h[1] == [128 - cap, cap] for h in hist) and f"caps [128, {cap}]" in hist[0][2], (cap, hist)


def test_example_matches_its_reference(tmp_path: Path) -> None:
    """examples/train_balanced.py, auto shares with a slowed rank, ends where its one-process --reference ends."""
    import subprocess
    import sys

    from test_torch_backend import ROOT, job_env

    small = ["--global-batch", "512", "--steps", "16", "--skip", "0", "--width", "64", "--depth", "2"]
    example = ROOT / "examples" / "train_balanced.py"
    run_torchrun(2, *small, "--shares", "auto", "--slow-rank", "1", "--slow-factor", "3", "--json",
                 str(tmp_path / "auto.json"), script=example)
    subprocess.run([sys.executable, str(example), *small, "--reference", "--json", str(tmp_path / "ref.json")],
                   env=job_env(), cwd=ROOT, check=True, capture_output=True, timeout=60)
    got, want = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("auto", "ref"))
    assert len(got["step_seconds"]) == 16 and got["samples_per_s"] > 0
    assert got["shares"][0]["shares"] == [256, 256] and len(got["shares"]) >= 2, got["shares"]
    for key in ("final_loss", "param_abs_sum"):
        assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (key, got[key], want[key])


@pytest.mark.timeout(120)
def test_lightning_trainer_with_uneven_shares(tmp_path: Path) -> None:
    """A Lightning Trainer (its own launcher, DDPStrategy on hetccl) with the balance callback and sampler: the
    replicas equal one process over the same global batches."""
    pytest.importorskip("lightning")
    import subprocess
    import sys

    from test_torch_backend import ROOT, job_env

    out = tmp_path / "lt"
    proc = subprocess.run([sys.executable, str(HERE / "lightning_balanced.py"), "12,52", str(out)], env=job_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for r in range(2):
        res = json.loads((tmp_path / f"lt.{r}").read_text())
        assert res["backend"] == "hetccl" and res["shares"] == [12, 52], res
        assert res["err"] <= 1e-5, res
