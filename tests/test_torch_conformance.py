"""PyTorch's own distributed test suite against the "hetccl" backend (tests/torch_conformance.py, CPU): the whole
file on 2 ranks (but DESELECTED), and the subgroup tests that need 8 ranks. Nothing may fail or error, every
skip must have an expected reason (torch_conformance.SKIP_REASONS), and the passed count must not drop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "torch_conformance.py"
# passed at torch 2.13 (2 ranks: 88 of 282 selected, 194 skipped by the harness; 8 ranks: 19 of 19)
MIN_PASSED = {2: 88, 8: 19}


def suite_env(world_size: int) -> dict[str, str]:
    """The driver's environment: ours without the harness's own variables (it sets them) or HETCCL_TIMEOUT (each
    test sets its group's timeout), this checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("BACKEND", "TEMP_DIR", "INIT_METHOD", "HETCCL_TIMEOUT")}
    env.update(WORLD_SIZE=str(world_size), PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    return env


def judge(tests: dict[str, dict], summary: str) -> None:
    """Fail on any test that failed or errored, and on any skip whose reason is not in SKIP_REASONS."""
    bad = {n: r for n, r in tests.items() if r["outcome"] not in ("passed", "skipped")}
    report = "\n".join(f"{n}: {r['outcome']}\n{r['detail']}" for n, r in sorted(bad.items()))
    assert not bad, f"{len(bad)} of torch's tests failed on hetccl ({summary}):\n{report}"
    sys.path.insert(0, str(HERE))
    from torch_conformance import SKIP_REASONS

    unexpected = {n: r["detail"] for n, r in tests.items() if r["outcome"] == "skipped"
                  and not any(re.match(p, r["detail"].strip()) for p in SKIP_REASONS)}
    assert not unexpected, f"skipped for a reason not in SKIP_REASONS: {unexpected}"


def run_suite(world_size: int, tmp_path: Path, timeout: float) -> dict:
    out = tmp_path / f"conformance-{world_size}.json"
    proc = subprocess.run([sys.executable, str(DRIVER), "--json", str(out)], env=suite_env(world_size), cwd=HERE.parent,
                          capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"the driver wrote no results (rc {proc.returncode})\n{proc.stdout[-3000:]}\n" \
                         f"{proc.stderr[-6000:]}"
    data = json.loads(out.read_text())
    print(f"torch conformance, {world_size} ranks: {data['summary']}")
    judge(data["tests"], str(data["summary"]))
    passed = data["summary"]["counts"].get("passed", 0)
    assert passed >= MIN_PASSED[world_size], f"only {passed} passed: {data['summary']}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data


@pytest.mark.timeout(1500)
def test_torch_distributed_suite_two_ranks(tmp_path: Path) -> None:
    run_suite(2, tmp_path, timeout=1400)


@pytest.mark.timeout(600)
def test_torch_distributed_suite_subgroups_eight_ranks(tmp_path: Path) -> None:
    run_suite(8, tmp_path, timeout=540)
