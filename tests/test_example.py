"""examples/train_ddp.py (a CNN on scikit-learn's bundled digits, DDP) on "hetccl" and on "gloo" from the same
seed: the per-step losses of every rank agree to a relative 1e-6, launched by `hetccl run` and by torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_ddp.py"
N = 2
STEPS = 20


def train(launcher: str, backend: str, out: Path, *extra: str) -> list[dict]:
    env = dict(os.environ)
    env.setdefault("HETCCL_TIMEOUT", "60")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    args = [str(EXAMPLE), "--backend", backend, "--epochs", "1", "--steps", str(STEPS), "--losses-out", str(out),
            *extra]
    if launcher == "hetccl":
        cmd = [sys.executable, "-m", "hetccl", "run", "-n", str(N), "--", sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(N), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{cmd}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert f"backend {backend} ranks {N} steps {STEPS}" in proc.stdout, proc.stdout
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(N)]


def same_losses(got: list[dict], want: list[dict], what: str) -> None:
    for r in range(N):
        a, b = got[r]["losses"], want[r]["losses"]
        assert len(a) == len(b) == STEPS, (what, r, len(a), len(b))
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            assert abs(x - y) <= 1e-6 * abs(y), f"{what}: rank {r} step {step}: {x} vs gloo {y}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_losses_match_gloo(tmp_path):
    gloo = train("hetccl", "gloo", tmp_path / "gloo")
    hetccl = train("hetccl", "hetccl", tmp_path / "hetccl")
    same_losses(hetccl, gloo, "hetccl under hetccl run")
    assert gloo[0]["losses"] != gloo[1]["losses"]  # the ranks trained on different shards
    assert gloo[0]["losses"][-1] < gloo[0]["losses"][0]  # and it learns
    under_torchrun = train("torchrun", "hetccl", tmp_path / "torchrun")
    same_losses(under_torchrun, gloo, "hetccl under torchrun")
