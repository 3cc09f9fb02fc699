"""The "hetccl" torch.distributed backend on real rank processes (launched by `hetccl run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKERS = HERE / "torch_workers.py"


def run_torch(n: int, *args: str, timeout: float = 110.0, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    """Run `tests/torch_workers.py ARGS` on n ranks under `hetccl run`; assert every rank exits 0."""
    cmd = [sys.executable, "-m", "hetccl", "run", "-n", str(n), "--", sys.executable, str(WORKERS), *args]
    proc = subprocess.run(cmd, env=job_env(env), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} on {n} ranks exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


def torchrun_cmd(n: int, script: Path, *args: str, launch: list[str] | None = None) -> list[str]:
    """torchrun (`python -m torch.distributed.run`) on `script`: `--standalone` with n ranks unless `launch`
    gives the launcher's own arguments."""
    launch = ["--standalone", "--nproc-per-node", str(n)] if launch is None else launch
    return [sys.executable, "-m", "torch.distributed.run", *launch, str(script), *args]


def job_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test job's ranks: ours, plus `env`, this checkout first on PYTHONPATH, and a 60 s
    HETCCL_TIMEOUT unless given."""
    env = dict(os.environ, **(env or {}))
    env.setdefault("HETCCL_TIMEOUT", "60")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_torchrun(n: int, *args: str, timeout: float = 110.0, env: dict[str, str] | None = None,
                 script: Path = WORKERS) -> subprocess.CompletedProcess:
    """The same under torchrun (`--standalone`, its default: every GPU visible to every rank)."""
    proc = subprocess.run(torchrun_cmd(n, script, *args), env=job_env(env), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} on {n} ranks under torchrun exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


TORCHRUN_INIT = HERE / "torchrun_init.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync", "twice"])
def test_hetccl_init_under_torchrun_standalone(mode):
    """hetccl's own init() from torchrun's environment alone: torchrun's store holds MASTER_PORT, so the ranks
    meet through it instead of rank 0 failing to listen there (issue 15)."""
    proc = run_torchrun(2, mode, script=TORCHRUN_INIT, env={"HETCCL_TIMEOUT": "30"})
    assert proc.stdout.count("torchrun init ok") == (4 if mode == "twice" else 2), proc.stdout
    assert "Address already in use" not in proc.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transports", ["shm,tcp", "tcp"])
def test_hetccl_init_under_torchrun_c10d_two_nodes(transports):
    """Two torchrun agents ("nodes" 0 and 1, 2 ranks each) meet through a c10d rendezvous on one machine; the 4
    ranks then join hetccl through the agents' shared store."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = job_env({"HETCCL_TIMEOUT": "30", "HETCCL_TRANSPORTS": transports})
    procs = [subprocess.Popen(torchrun_cmd(4, TORCHRUN_INIT, "async", launch=[
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"hetccl-test-{port}", "--max-restarts", "0"]),
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append((p.wait(120), *p.communicate()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    report = "\n".join(f"--- node {i} rc={rc}\n{out}\n{err[-4000:]}" for i, (rc, out, err) in enumerate(outs))
    assert all(rc == 0 for rc, _, _ in outs), report
    oks = "".join(out for _, out, _ in outs)
    for r in range(4):
        assert f"torchrun init ok rank {r}/4 (async)" in oks, report


def test_import_registers_backend_idempotently():
    import hetccl.torch as ht

    ht.register()
    ht.register()
    assert "hetccl" in dist.Backend.backend_list
    assert dist.Backend.backend_list.count("hetccl") == 1
    assert dist.Backend("hetccl") == "hetccl"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_ops(n, dtype):
    run_torch(n, "ops", dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_async_work_and_futures(n):
    run_torch(n, "async")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_subgroups(n):
    run_torch(n, "subgroup")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", ["none", "allreduce", "bf16", "fp16"])
def test_ddp_matches_gloo(tmp_path, hook):
    """DDP with the default reducer ("none") and with each hetccl.torch.hooks hook; Gloo runs torch's built-in
    hook of the same kind (the same arithmetic: a 2-rank sum is exact in any order), so losses agree to 1e-6."""
    n = 2
    losses = {}
    for backend in ("hetccl", "gloo"):
        out = tmp_path / backend
        run_torch(n, "ddp", backend, str(out), hook)
        losses[backend] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)]
    for r in range(n):
        assert len(losses["hetccl"][r]) == 3
        close(losses["hetccl"][r], losses["gloo"][r], 1e-6, f"rank {r} DDP losses (hook {hook})")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3])
def test_recv_from_any_source(n):
    run_torch(n, "anysource")


@pytest.mark.timeout(120)
def test_failed_collective_raises_from_wait():
    run_torch(2, "work_error")


def check_ddp_peer_raises(env: dict[str, str]) -> None:
    """tests/torch_workers.py ddp_peer_raises under torchrun, whose monitor waits 5 s before it stops the other
    rank (time for rank 0 to report): rank 0 names rank 1 and its error, and no rank dies of a signal."""
    launch = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "5"]
    proc = subprocess.run(torchrun_cmd(2, WORKERS, "ddp_peer_raises", launch=launch), env=job_env(env), cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    said = proc.stdout + proc.stderr[-6000:]
    got = next((x for x in proc.stdout.splitlines() if x.startswith("rank 0 got")), None)
    assert got is not None and "rank 1" in got and "out of memory" in got, said
    assert "SIGSEGV" not in proc.stderr and "exitcode: -11" not in proc.stderr, said


@pytest.mark.timeout(120)
def test_a_rank_that_raises_in_ddp_is_named_by_its_peer():
    """Two CPU islands on one host (shared memory between them)."""
    check_ddp_peer_raises({"TEST_ISLANDS": "cpu-0,cpu-1", "HETCCL_TIMEOUT": "20"})


@pytest.mark.timeout(120)
def test_all_gather_coalesced_layout_matches_gloo(tmp_path):
    """torch's layout output_tensor_lists[rank][input], in the square case (2 ranks, 2 inputs) where the
    transposed layout also fits the shapes: hetccl's outputs equal Gloo's, and both are rank-major."""
    n = 2
    res = {}
    for backend in ("hetccl", "gloo"):
        out = tmp_path / backend
        run_torch(n, "gather_coalesced", backend, str(out))
        res[backend] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)]
    want = [[[10 * i + q + 1] * 2 for i in range(n)] for q in range(n)]  # [rank q][input i]
    for r in range(n):
        assert res["gloo"][r] == want, res["gloo"][r]
        assert res["hetccl"][r] == res["gloo"][r], (r, res)


def close(got: list[float], want: list[float], tol: float, what: str) -> None:
    """Each value of hetccl's run within relative `tol` of the reference backend's (Gloo, or NCCL on GPUs)."""
    assert len(got) == len(want), (what, got, want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= tol * abs(b), f"{what} [{i}]: hetccl {a} vs reference {b}"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,variant", [(2, "plain"), (3, "mesh"), (2, "hsdp"), (2, "bf16-keep"), (2, "divide")])
def test_fsdp2_matches_gloo(tmp_path, n, variant):
    """FSDP2 `fully_shard` (uneven shards, all_gather_single / reduce_scatter_single with AVG or PREMUL_SUM,
    DeviceMesh group names, a 2-D mesh's subgroups) trains to the same losses and parameters as on Gloo."""
    res = {}
    for backend in ("hetccl", "gloo"):
        out = tmp_path / backend
        run_torch(n, "fsdp", backend, str(out), variant)
        res[backend] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)]
    # "divide" is PREMUL_SUM(1/3) on hetccl and SUM-then-divide on Gloo: equal up to rounding
    tol = 1e-6
    for r in range(n):
        got, want = res["hetccl"][r], res["gloo"][r]
        assert len(got["losses"]) == 3
        close(got["losses"], want["losses"], tol, f"rank {r} losses ({variant})")
        close(got["params"], want["params"], tol, f"rank {r} parameter sums ({variant})")
    assert res["hetccl"][0]["losses"] != res["hetccl"][1]["losses"]  # the ranks saw different data


UNMODIFIED = r"""
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # an unmodified script that asks for Gloo
t = torch.full((5,), float(dist.get_rank() + 1))
dist.all_reduce(t)
n = dist.get_world_size()
assert torch.equal(t, torch.full((5,), n * (n + 1) / 2)), t
import os
os.write(1, f"backend {dist.get_backend()}\n".encode())  # one write: the ranks share stdout
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_unmodified_script_runs_on_hetccl_through_the_alias() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hetccl", "run", "-n", "2", "--torch-backend-alias", "nccl,gloo",
                           "--", sys.executable, "-c", UNMODIFIED], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("backend hetccl") == 2, proc.stdout
