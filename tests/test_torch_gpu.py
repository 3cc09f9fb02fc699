"""The "hetccl" torch.distributed backend with CUDA tensors: every collective, async work, DDP (default reducer
and each hook) and FSDP2 against NCCL (or Gloo where one GPU has to carry both ranks).

The same rank bodies as the CPU tests (tests/torch_workers.py) with TORCH_TEST_DEVICE=cuda: rank i uses GPU
i % device_count. They need CUDA; on CPU-only machines (CI) they skip with the reason. Written against APIs
present in torch 2.11 and 2.13."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_marks import GPU_ENV, NGPU, needs_1, needs_2
from test_torch_backend import check_ddp_peer_raises, close, job_env, run_torch, run_torchrun

# NCCL can't put two ranks on one GPU; Gloo takes CUDA tensors for all_reduce / broadcast (what DDP uses)
REFERENCE = "nccl" if NGPU >= 2 else "gloo"
CUDA_ENV = {"TORCH_TEST_DEVICE": "cuda", **GPU_ENV}
# two ranks of the same checks: one island on two GPUs; with one GPU, where NCCL cannot hold both ranks, each rank
# is its own island and both share the GPU (the cross-island path)
PAIR_ENV = CUDA_ENV if NGPU >= 2 else {**CUDA_ENV, "TEST_ISLANDS": "nvidia-0,nvidia-1"}


@needs_1
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_ops_on_cuda_tensors(dtype):
    """Every op (all_reduce with each reduce op and PREMUL_SUM, all_gather, all_gather_into_tensor, coalesced
    forms, reduce_scatter, broadcast, reduce, all_to_all with and without splits, gather, scatter, send/recv,
    batch_isend_irecv, barrier) on CUDA tensors, results checked on every rank."""
    run_torch(2, "ops", dtype, env=PAIR_ENV, timeout=280)


@needs_1
@pytest.mark.timeout(300)
def test_async_work_on_cuda_tensors():
    run_torch(2, "async", env=PAIR_ENV, timeout=280)


@needs_1
@pytest.mark.timeout(300)
def test_subgroups_on_cuda_tensors():
    run_torch(2, "subgroup", env=PAIR_ENV, timeout=280)


@needs_1
@pytest.mark.timeout(600)
@pytest.mark.parametrize("hook", ["none", "allreduce", "bf16", "fp16"])
def test_ddp_cuda_matches_reference(tmp_path, hook):
    """DDP on CUDA: a few steps on "hetccl" and on NCCL (Gloo with one GPU) give the same losses."""
    n = 2
    losses = {}
    for backend in ("hetccl", REFERENCE):
        out = tmp_path / backend
        run_torch(n, "ddp", backend, str(out), hook, env=PAIR_ENV if backend == "hetccl" else CUDA_ENV,
                  timeout=280)
        losses[backend] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)]
    for r in range(n):
        # the same kernels on both sides; 1e-5 leaves room for a reference that reduces in another order
        close(losses["hetccl"][r], losses[REFERENCE][r], 1e-5, f"rank {r} DDP losses (hook {hook})")


@needs_2
@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ["plain", "bf16-keep", "divide"])
def test_fsdp2_cuda_matches_nccl(tmp_path, variant):
    """FSDP2 `fully_shard` on CUDA ("divide": NCCL's own PREMUL_SUM against hetccl's)."""
    if variant == "divide":
        import torch.distributed as dist

        try:
            dist._make_nccl_premul_sum(0.5).factor  # noqa: B018
        except (AttributeError, RuntimeError):
            pytest.skip("this torch does not show a PREMUL_SUM factor to Python (torch 2.11): hetccl refuses "
                        "PREMUL_SUM there with UnsupportedError (checked by the ops test)")
    n = 2
    res = {}
    for backend in ("hetccl", "nccl"):
        out = tmp_path / backend
        run_torch(n, "fsdp", backend, str(out), variant, env=CUDA_ENV, timeout=280)
        res[backend] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(n)]
    for r in range(n):
        close(res["hetccl"][r]["losses"], res["nccl"][r]["losses"], 1e-5, f"rank {r} FSDP2 losses ({variant})")
        close(res["hetccl"][r]["params"], res["nccl"][r]["params"], 1e-5, f"rank {r} FSDP2 parameters ({variant})")


# --- two islands under torchrun, every GPU visible to every rank (torchrun's default) -------------------------
# rank i is island nvidia-i on GPU i; the ways between islands: the zero-copy link, host staging over shared
# memory, TCP, and each rank acting as its own host (HETCCL_HOST, one name per local rank: no link, no shm)
TWO_ISLANDS = {**CUDA_ENV, "TEST_ISLANDS": "nvidia-0,nvidia-1"}
PATHS = {"link": {}, "shm": {"HETCCL_PAIRLINK": "0"}, "tcp": {"HETCCL_PAIRLINK": "0", "HETCCL_TRANSPORTS": "tcp"},
         "hosts": {"HETCCL_HOST": "h0,h1", "TEST_CHECK_HOSTS": "h0,h1"}}
# the link for large messages, small all_reduces by the host round trip (copies only, no kernel)
LINK_SMALL_HOST = {"HETCCL_PAIRLINK_SMALL": "0"}


ORDERS = {"held": {"HETCCL_TORCH_STREAM_ORDER": "0"}, "stream": {}, "late": {"HETCCL_TORCH_EARLY_COPIES": "0"},
          "thread": {"HETCCL_TORCH_ENQUEUE_THREAD": "1"}}
# the enqueuing thread's known failure (H100, 2026-12-07): in `async` (8 all_reduces in flight, waited for in turn)
# rank 0's host side waited for the arrival of its copy out of the second one, and the peer timed out
THREAD_HANGS = pytest.mark.xfail(strict=True, reason="HETCCL_TORCH_ENQUEUE_THREAD=1 stalls in the async case")


@needs_1
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path,order", [(p, o) for p in sorted(PATHS) for o in ("held", "stream")] +
                         [(p, "late") for p in ("hosts", "shm", "tcp")] +  # the link stages nothing
                         [("link-small-host", "stream")] +
                         [pytest.param(p, "thread", marks=THREAD_HANGS) for p in ("hosts", "link")])
def test_two_islands_every_op(path, order):
    """Every op, async work, and many collectives in flight fed from a side stream (the wrong results, stalls
    and mismatches seen with both GPUs visible), some reading what one before them still writes, on each
    cross-island path (with one GPU both islands share it, rank i on GPU i % count, as the three- and four-island
    tests do); "stream": the default stream order (ordered collectives mixed with the ops the loop does on the
    device), "held": HETCCL_TORCH_STREAM_ORDER=0, "late": HETCCL_TORCH_EARLY_COPIES=0 (the copies out of the
    caller's data on the collective stream, behind the collectives before it; the default puts them on a second
    stream), "thread": HETCCL_TORCH_ENQUEUE_THREAD=1 (the process group's enqueuing thread plans and enqueues the
    device side; experimental, off by default: the caller's thread does it); "link-small-host": the link with
    HETCCL_PAIRLINK_SMALL=0."""
    env = {**TWO_ISLANDS, **PATHS.get(path, LINK_SMALL_HOST), **ORDERS[order]}
    run_torchrun(2, "ops", "float32", env=env, timeout=280)
    run_torchrun(2, "async", env=env, timeout=280)
    run_torchrun(2, "inflight", env=env, timeout=280)


@needs_2
@pytest.mark.timeout(600)
def test_one_island_in_flight_under_torchrun():
    run_torchrun(2, "inflight", env=CUDA_ENV, timeout=280)


def _ddp_losses(tmp_path, backend: str, hook: str, env: dict[str, str]) -> list[list[float]]:
    out = tmp_path / f"{backend}-{hook}-{len(env)}"
    run_torchrun(2, "ddp", backend, str(out), hook, env=env, timeout=280)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


@needs_1
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path,hook", [(p, "none") for p in sorted(PATHS)] +
                         [("link", h) for h in ("allreduce", "bf16", "fp16")])
def test_two_islands_ddp_matches_nccl(tmp_path, path, hook):
    """DDP (several buckets in flight) over two islands gives NCCL's losses (the crash seen on every path); with
    one GPU, where NCCL cannot hold both ranks, both islands share it and Gloo gives the reference."""
    want = _ddp_losses(tmp_path, REFERENCE, hook, CUDA_ENV)
    got = _ddp_losses(tmp_path, "hetccl", hook, {**TWO_ISLANDS, **PATHS[path]})
    for r in range(2):
        close(got[r], want[r], 1e-5, f"rank {r} DDP losses over two islands ({path}, hook {hook})")


@needs_2
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_two_islands_fsdp2_matches_nccl(tmp_path, path):
    res = {}
    for backend, env in (("nccl", CUDA_ENV), ("hetccl", {**TWO_ISLANDS, **PATHS[path]})):
        out = tmp_path / backend
        run_torchrun(2, "fsdp", backend, str(out), "plain", env=env, timeout=280)
        res[backend] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    for r in range(2):
        close(res["hetccl"][r]["losses"], res["nccl"][r]["losses"], 1e-5, f"rank {r} FSDP2 losses ({path})")
        close(res["hetccl"][r]["params"], res["nccl"][r]["params"], 1e-5, f"rank {r} FSDP2 parameters ({path})")


@needs_1
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path,reduce_dtype", [(p, "float32") for p in sorted(PATHS)] + [("hosts", "bfloat16")]
                         + [("hosts-stream", "float32"), ("link-stream", "float32")])
def test_two_islands_fsdp2_recipe_matches_nccl(tmp_path, path, reduce_dtype):
    """FSDP2 across two islands as recipes run it (bf16 parameters, fp32 or bf16 reduction, reshard_after_forward
    true and false, gradient accumulation, the distributed checkpoint's full and sharded state dicts) gives NCCL's
    losses and state; with one GPU, NCCL runs the two ranks as two hosts (NCCL_HOSTID per rank). "-stream": the
    default stream order (over the link, the pair link's collectives enqueued on the caller's stream); the others
    HETCCL_TORCH_STREAM_ORDER=0."""
    base, _, order = path.partition("-")
    mine = {**TWO_ISLANDS, **PATHS[base], **({} if order == "stream" else {"HETCCL_TORCH_STREAM_ORDER": "0"})}
    res = {}
    for backend, env in (("nccl", {**CUDA_ENV, "TEST_NCCL_HOSTS": "1"}), ("hetccl", mine)):
        out = tmp_path / backend
        run_torchrun(2, "fsdp_recipe", backend, str(out), reduce_dtype, env=env, timeout=280)
        res[backend] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    for r in range(2):
        got, want = res["hetccl"][r], res["nccl"][r]
        close(got["losses"], want["losses"], 1e-6, f"rank {r} FSDP2 losses ({path}, {reduce_dtype} reduction)")
        assert got["full"].keys() == want["full"].keys(), f"rank {r}: full state dict keys"
        close(list(got["full"].values()), list(want["full"].values()), 1e-6, f"rank {r} full state dict ({path})")
        close(list(got["shards"].values()), list(want["shards"].values()), 1e-6, f"rank {r} shards ({path})")


@needs_1
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_two_islands_collectives_do_not_hold_the_thread(path):
    """A blocking cross-island collective of CUDA tensors behind ~50 ms of queued compute returns well before
    that compute ends (stream-ordered by default, gpu/streamorder.py), with the right results in stream order."""
    run_torchrun(2, "held", env={**TWO_ISLANDS, **PATHS[path]}, timeout=280)


@needs_1
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lazy_ranks", ["0", "1", "0,1"])
def test_stream_order_under_lazy_module_loading(lazy_ranks):
    """CUDA_MODULE_LOADING=LAZY set by the user on some ranks, which the stream order cannot work under (a first
    kernel launch behind an ordered collective would deadlock): by default the whole group holds the thread
    instead and its collectives are right, and the lazy rank says why; HETCCL_TORCH_STREAM_ORDER=1 is a
    ConfigError on every rank that names the lazy rank."""
    env = {**TWO_ISLANDS, "TEST_LAZY_RANKS": lazy_ranks}
    proc = run_torchrun(2, "lazy_loading", "auto", env=env, timeout=200)
    assert proc.stdout.count("held by the lazy group") == 2, proc.stdout
    lazy = lazy_ranks.split(",")
    assert proc.stderr.count("hold the caller's thread until they end") == len(lazy), proc.stderr[-3000:]
    proc = run_torchrun(2, "lazy_loading", "1", env={**env, "HETCCL_TORCH_STREAM_ORDER": "1"}, timeout=200)
    assert proc.stdout.count("ConfigError") == 2, proc.stdout
    for line in (x for x in proc.stdout.splitlines() if "ConfigError" in x):
        assert any(f"rank {q}" in line or f"rank(s) {q}" in line for q in lazy), line


@needs_1
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", ["hosts", "link"])
@pytest.mark.parametrize("islands", ["aabb", "aab"])
def test_islands_of_several_ranks_stream_ordered(islands, path):
    """Islands of two ranks (and one of one) on one GPU, NCCL inside each island (NCCL_HOSTID per rank lets it
    hold two ranks of one GPU), the stream order by default: the island steps enqueued in NCCL on the caller's
    stream, the leaders' step on the host. Every op, collectives in flight from a side stream, and the thread not
    held (with the right results in stream order; islands of unequal width gather and reduce-scatter in padded
    blocks); "hosts": each island its own host."""
    names = [f"nvidia-{x}" for x in islands]  # rank i in island islands[i]
    env = {**CUDA_ENV, "TEST_ISLANDS": ",".join(names), "TEST_NCCL_HOSTIDS": "1", **PATHS[path]}
    if path == "hosts":
        env.update(HETCCL_HOST=",".join(islands), TEST_CHECK_HOSTS=",".join(islands))
    n = len(names)
    run_torchrun(n, "ops", "float32", env=env, timeout=280)
    run_torchrun(n, "inflight", env=env, timeout=280)
    run_torchrun(n, "held", env=env, timeout=280)


# --- three and four islands (issue 16, item 4) ------------------------------------------------------------------
# n processes under torchrun, every GPU visible, rank i is island nvidia-i on GPU i % device_count: with fewer GPUs
# than islands, several islands share a GPU (each island's NCCL communicator has one rank), so one GPU will do.
# "link" (the default settings) joins three or more GPU leaders of one host by the zero-copy ring (gpu/ringlink.py),
# "shm" stages through shared memory, and "hosts" makes every rank its own host (HETCCL_HOST=h0,h1,...), so TCP
# joins them.
def _islands_env(islands: str, path: str, hosts: str | None = None) -> dict[str, str]:
    n = islands.count(",") + 1
    env = {**CUDA_ENV, "TEST_ISLANDS": islands, **PATHS[path]}
    if path == "hosts":
        hosts = hosts or ",".join(f"h{i}" for i in range(n))
        env.update(HETCCL_HOST=hosts, TEST_CHECK_HOSTS=hosts)
    return env


@needs_1
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("n", [3, 4])
def test_many_islands_every_op(n, path):
    """Every op (ops: each reduce op, AVG, PREMUL_SUM, all_gather, reduce_scatter, broadcast and reduce from every
    root, all_to_all, gather, scatter, send/recv, barrier), async work, and collectives in flight fed from a side
    stream, with every process its own island, on each cross-island path."""
    env = _islands_env(",".join(f"nvidia-{i}" for i in range(n)), path)
    run_torchrun(n, "ops", "float32", env=env, timeout=280)
    run_torchrun(n, "ops", "bfloat16", env=env, timeout=280)
    run_torchrun(n, "async", env=env, timeout=280)
    run_torchrun(n, "inflight", env=env, timeout=280)


@needs_2
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_unequal_islands_every_op(path):
    """Islands of 2, 1 and 1 ranks (nvidia-a on GPUs 0 and 1, nvidia-b and nvidia-c on GPUs 0 and 1 again); with
    "hosts" each island is its own host."""
    env = _islands_env("nvidia-a,nvidia-a,nvidia-b,nvidia-c", path, hosts="a,a,b,c")
    run_torchrun(4, "ops", "float32", env=env, timeout=280)
    run_torchrun(4, "inflight", env=env, timeout=280)


@needs_2
@pytest.mark.timeout(300)
@pytest.mark.parametrize("islands", ["one", "two"])
def test_device_id(islands):
    """init_process_group("hetccl", device_id=cuda:i), which Lightning passes (it failed at init)."""
    run_torchrun(2, "device_id", env=TWO_ISLANDS if islands == "two" else CUDA_ENV, timeout=280)


@needs_2
@pytest.mark.timeout(300)
@pytest.mark.parametrize("islands", ["one", "two"])
@pytest.mark.parametrize("how", ["dead", "stuck"])
def test_peer_failure_surfaces(islands, how):
    """A dead or stuck peer ends rank 0's collectives in a hetccl error (from wait() or the next call), never
    in a stale result or a hang."""
    env = {**(TWO_ISLANDS if islands == "two" else CUDA_ENV), "HETCCL_TIMEOUT": "5"}
    proc = run_torchrun(2, "peer_fails", how, env=env, timeout=200)
    assert "rank 0 got" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    want = "PeerLostError" if how == "dead" else "CollectiveTimeout"
    line = next(x for x in proc.stdout.splitlines() if "rank 0 got" in x)
    assert want in line or (how == "dead" and "lost" in line), line


@needs_1
@pytest.mark.timeout(150)
@pytest.mark.parametrize("order", ["stream", "held"])
def test_a_rank_that_raises_in_ddp_is_named_by_its_peer_on_gpu(order):
    """Two GPU islands as other hosts, DDP: rank 1 raises mid-training; rank 0 gets an error naming it, and no
    rank dies of a signal (tests/torch_workers.py ddp_peer_raises)."""
    held = {"HETCCL_TORCH_STREAM_ORDER": "0"} if order == "held" else {}
    check_ddp_peer_raises({**TWO_ISLANDS, **PATHS["hosts"], **held, "HETCCL_TIMEOUT": "20"})


@needs_2
@pytest.mark.timeout(300)
def test_cpu_label_with_cuda_tensors_is_refused():
    proc = run_torchrun(2, "label_mismatch", env={**CUDA_ENV, "TEST_ISLANDS": "cpu-a,cpu-b"}, timeout=200)
    assert proc.stdout.count("ConfigError") == 2, proc.stdout


# --- a real client: PyTorch Lightning's Trainer with DDPStrategy(process_group_backend=...) ------------------
def _lightning_losses(tmp_path, backend: str, env: dict[str, str]) -> list[list[float]]:
    out = tmp_path / f"lightning-{backend}-{len(env)}"
    script = Path(__file__).resolve().parent / "lightning_train.py"
    proc = subprocess.run([sys.executable, str(script), backend, str(out)], env=job_env(env), cwd=script.parent.parent,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"Lightning on {backend} exited {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    res = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert all(x["backend"] == backend for x in res), res
    return [x["losses"] for x in res]


@needs_2
@pytest.mark.timeout(900)
@pytest.mark.parametrize("islands", ["one", "two"])
def test_lightning_trainer_matches_nccl(tmp_path, islands):
    """Trainer(accelerator="gpu", devices=2, strategy=DDPStrategy(process_group_backend="hetccl")): Lightning
    launches the ranks and passes device_id (it failed at init); the losses are NCCL's."""
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (the GPU machine has it)")
    want = _lightning_losses(tmp_path, "nccl", CUDA_ENV)
    got = _lightning_losses(tmp_path, "hetccl", TWO_ISLANDS if islands == "two" else CUDA_ENV)
    for r in range(2):
        assert len(got[r]) == len(want[r]) > 0, (len(got[r]), len(want[r]))
        close(got[r], want[r], 1e-5, f"rank {r} Lightning losses ({islands} island(s))")


# --- a different NCCL build in each island --------------------------------------------------------------------
# Two builds of one CCL that never talk to each other directly: the closest stand-in here for NCCL beside RCCL.
# tests/build_nccl.sh builds a second NCCL from source (sm_90, the collectives these tests use) on the GPU machine.
NCCL_B = os.environ.get("HETCCL_TEST_NCCL_LIB_B", "")


@needs_2
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", ["link", "shm"])
def test_each_island_its_own_nccl_build(path):
    """4 ranks on 2 GPUs, every GPU visible: island nvidia-a (ranks 0, 1 on GPUs 0, 1) loads hetccl's default
    NCCL, island nvidia-b (ranks 2, 3) loads the build named by HETCCL_TEST_NCCL_LIB_B (HETCCL_NCCL_LIB). Every
    op is checked, and each rank reports the library its island ran."""
    if not NCCL_B:
        pytest.skip("set HETCCL_TEST_NCCL_LIB_B to a second NCCL build (bash tests/build_nccl.sh SRC OUT builds one "
                    "with nvcc)")
    env = {**CUDA_ENV, **PATHS[path], "TEST_ISLANDS": "nvidia-a,nvidia-a,nvidia-b,nvidia-b",
           "TEST_NCCL_LIBS": f",,{NCCL_B},{NCCL_B}"}
    proc = run_torchrun(4, "nccl_builds", env=env, timeout=500)
    libs = {}
    for line in proc.stdout.splitlines():
        if " nccl " in line and line.startswith("rank "):
            parts = line.split()
            libs[int(parts[1])] = (parts[3], parts[5], parts[6])
    assert sorted(libs) == [0, 1, 2, 3], proc.stdout[-3000:]
    assert libs[0][1:] == libs[1][1:] and libs[2][1:] == libs[3][1:], libs
    assert libs[2][2] == str(Path(NCCL_B).resolve()) or libs[2][2] == NCCL_B, libs
    assert libs[0][1:] != libs[2][1:], f"both islands ran the same NCCL: {libs}"
    print(f"islands' NCCL builds: {libs}")


# --- PyTorch's own distributed test suite, its CUDA half --------------------------------------------------------
SHARDS = 8  # drivers at once: each test spawns its 2 ranks afresh (the harness initialises CUDA at import)


@needs_2
@pytest.mark.timeout(900)
@pytest.mark.parametrize("islands", ["one", "two"])
def test_torch_distributed_suite_on_cuda(tmp_path, islands):
    """tests/torch_conformance.py --cuda: the tests that skip without CUDA, on 2 GPUs, one island and two islands
    with both GPUs visible to both ranks. Nothing may fail or error, skips need a known reason; counts printed."""
    pytest.importorskip("expecttest")
    from test_torch_conformance import judge, suite_env

    here = Path(__file__).resolve().parent
    env = {**suite_env(2), **GPU_ENV}
    if islands == "two":
        env["HETCCL_CONFORMANCE_ISLANDS"] = "nvidia-0,nvidia-1"
    procs = [subprocess.Popen([sys.executable, str(here / "torch_conformance.py"), "--cuda", "--shard",
                               f"{k}/{SHARDS}", "--json", str(tmp_path / f"{k}.json")], env=env, cwd=here.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in range(1, SHARDS + 1)]
    logs = [p.communicate(timeout=840)[0] for p in procs]
    tests: dict[str, dict] = {}
    for k in range(1, SHARDS + 1):
        out = tmp_path / f"{k}.json"
        assert out.exists(), f"shard {k} wrote no results:\n{logs[k - 1][-3000:]}"
        tests.update(json.loads(out.read_text())["tests"])
    counts: dict[str, int] = {}
    for r in tests.values():
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"torch's CUDA tests, {islands} island(s): {len(tests)} run: {counts}")
    judge(tests, f"CUDA tests, {islands} island(s): {counts}")
    assert counts.get("passed", 0) > 0, counts


@needs_1
@pytest.mark.timeout(600)
def test_balanced_gpu_and_cpu_islands_match_one_process(tmp_path):
    """A GPU island (rank 0) and a CPU island (rank 1) in one DDP job with auto shares (hetccl.torch.balance):
    the GPU rank is given most of each global batch, and the replicas end where one process over the same global
    batches ends (examples/train_balanced.py and its --reference, the CPU; 1e-4 for the two devices' rounding)."""
    root = Path(__file__).resolve().parent.parent
    example = root / "examples" / "train_balanced.py"
    small = ["--global-batch", "2048", "--steps", "30", "--skip", "0", "--width", "256", "--depth", "4"]
    run_torchrun(2, *small, "--gpu-ranks", "0", "--shares", "auto", "--json", str(tmp_path / "auto.json"),
                 script=example, env=GPU_ENV, timeout=280)
    subprocess.run([sys.executable, str(example), *small, "--reference", "--json", str(tmp_path / "ref.json")],
                   env=job_env(), cwd=root, check=True, capture_output=True, timeout=120)
    got, want = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("auto", "ref"))
    assert got["shares"][-1]["shares"][0] > 1024, got["shares"]
    for key in ("final_loss", "param_abs_sum"):
        assert abs(got[key] - want[key]) <= 1e-4 * abs(want[key]), (key, got[key], want[key])


# HETCCL_CROSS_COMPRESS between GPU islands: over other hosts, ordered (the default) and through the loop; over
# shared memory; on the zero-copy link (never compressed); and a CPU island beside a GPU one, as other hosts
COMPRESSED = {"hosts-stream": PATHS["hosts"], "hosts-held": {**PATHS["hosts"], "HETCCL_TORCH_STREAM_ORDER": "0"},
              "shm-stream": PATHS["shm"], "link-stream": {"TEST_COMPRESS_LINK": "1"},
              "gpu+cpu-hosts": {"TEST_ISLANDS": "nvidia-0,cpu-0", "TEST_CPU_RANKS": "1", "HETCCL_HOST": "h0,h1"}}


@needs_1
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", sorted(COMPRESSED))
def test_compressed_collectives_between_gpu_islands(path):
    """bf16 and fp8 between the islands' leaders, every op and float dtype against an fp64 reference within the
    wire's bound (the device packs: gpu/codec.py), and the bytes cast where a wire carries them; 64K chunks so
    that an op spans several."""
    env = {**TWO_ISLANDS, "HETCCL_CROSS_COMPRESS_MIN": "0", "HETCCL_STAGE_BYTES": "64K", **COMPRESSED[path]}
    run_torchrun(2, "compressed", env=env, timeout=280)


@needs_1
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["hosts-stream", "hosts-held"])
def test_error_feedback_on_gpu_islands_keeps_the_uncompressed_loss(path):
    """DDP across two GPU islands as other hosts with fp8 between them: error feedback (the device's round trip)
    ends within 1 % of the uncompressed loss and closer than fp8 alone (tests/torch_workers.py error_feedback)."""
    env = {**TWO_ISLANDS, **COMPRESSED[path], "HETCCL_CROSS_COMPRESS": "fp8", "HETCCL_CROSS_COMPRESS_MIN": "0"}
    print(run_torchrun(2, "error_feedback", env=env, timeout=280).stdout)


@needs_1
@pytest.mark.timeout(300)
def test_auto_shares_keep_a_gpu_rank_within_its_memory(tmp_path):
    """A GPU island beside a far slower CPU island, the GPU's memory limited to about 450 samples of the step
    (tests/balance_workers.py gpu_memory): the balancer's CUDA gauge caps the GPU's share below what its speed
    asks, no CUDA out-of-memory ends the job, and the decision names the cap."""
    workers = Path(__file__).resolve().parent / "balance_workers.py"
    run_torchrun(2, "gpu_memory", str(tmp_path / "mem"), script=workers,
                 env={**GPU_ENV, "TEST_HETCCL_ISLAND": "nvidia-0,cpu-0"}, timeout=280)
    hist = json.loads((tmp_path / "mem.0").read_text())["history"]
    capped = [h for h in hist if "memory: rank 0 at most" in h[2]]
    assert capped, "\n".join(map(str, hist))
    # the limit is 450 samples of the model alone; under DDP the gauge's fit found 471, then 463 (H100,
    # 2026-12-07), and the speeds alone ask about 503: capped is below 485, and never above the cap it names
    for h in capped:
        named = int(re.search(r"rank 0 at most (\d+) samples", h[2]).group(1))
        assert h[1][0] <= named, "\n".join(map(str, hist))
    assert all(h[1][0] <= 485 for h in hist), "\n".join(map(str, hist))
