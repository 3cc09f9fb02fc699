"""Rank bodies for tests/test_torch_backend.py and tests/test_torch_gpu.py: `python tests/torch_workers.py CASE
[ARGS...]` under `hetccl run` (which sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT). Exit code 0 means every
check passed. TORCH_TEST_DEVICE=cuda runs the same cases on CUDA tensors (rank i on GPU i % device_count)."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import hetccl.torch  # noqa: F401  (registers the "hetccl" backend)
from hetccl.torch.backend import UnsupportedError

# torch 2.13 names (all_gather_single / reduce_scatter_single), falling back to the older ones
ALL_GATHER_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DTYPES = {"float32": torch.float32, "int64": torch.int64, "bfloat16": torch.bfloat16}
DEVICE = os.environ.get("TORCH_TEST_DEVICE", "cpu")
if os.environ.get("TEST_ISLANDS"):  # per-rank island labels ("nvidia-0,nvidia-1"), indexed by the global rank
    os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[int(os.environ["RANK"])]
if os.environ.get("TEST_NCCL_HOSTIDS"):  # NCCL runs every rank as its own host: an island of two ranks on one GPU
    os.environ["NCCL_HOSTID"] = f"h{os.environ['RANK']}"
if os.environ.get("TEST_NCCL_LIBS"):  # per-rank NCCL libraries (HETCCL_NCCL_LIB; empty: hetccl's default search)
    _lib = os.environ["TEST_NCCL_LIBS"].split(",")[int(os.environ["RANK"])]
    if _lib:
        os.environ["HETCCL_NCCL_LIB"] = _lib


def _device() -> torch.device:
    """This rank's device: the CPU, or (TORCH_TEST_DEVICE=cuda) GPU local_rank % device_count, made current."""
    if DEVICE == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("HETCCL_LOCAL_RANK", "0")))
    dev = torch.device(DEVICE, local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _init(backend: str = "hetccl") -> torch.device:
    dev = _device()
    dist.init_process_group(backend)
    if backend == "hetccl" and os.environ.get("TEST_CHECK_HOSTS"):  # HETCCL_HOST's name of every rank: check
        from workers import check_hosts

        pg = dist.distributed_c10d._get_default_group()._get_backend(dev)
        check_hosts(pg.comm.async_comm._fabric, os.environ["TEST_CHECK_HOSTS"].split(","))
    return dev


def premul_readable() -> bool:
    """Whether this torch shows a PREMUL_SUM's factor to Python (2.13 does, 2.11 does not)."""
    try:
        dist._make_nccl_premul_sum(0.5).factor  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _eq(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        if got.shape == want.shape and got.device == want.device and got.is_floating_point():
            diff = (got.double() - want.double()).abs()
            where = f"; {int((diff > 0).sum())} of {diff.numel()} elements differ, at most by {diff.max().item():.3g}"
        else:
            where = ""
        torch.set_printoptions(threshold=20, edgeitems=3)  # the message must fit the launcher's tail
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got!r}, want {want!r}{where}"
                             f"{_held_error()}")


def _held_error() -> str:
    """The error of an ordered collective that this rank's backend holds for its next call, if any: a wrong
    result read before that call is its symptom, not its cause."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        for dev in ("cuda", "cpu"):
            broken = getattr(pg._get_backend(torch.device(dev)), "broken", None)
            if broken is not None:
                return f"; the backend holds: {broken!r}"
    except Exception:  # noqa: BLE001 (only a hint for the message)
        pass
    return ""


def _val(r: int, shape: tuple[int, ...], dtype: torch.dtype, base: int = 0) -> torch.Tensor:
    """Small integers (exact in bf16 too) that depend on rank and position."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) % 7) + r + 1 + base).reshape(shape).to(dtype)


def case_ops(dtype_name: str) -> None:
    dt = DTYPES[dtype_name]
    torch.set_default_device(_init())  # every tensor below is made on this rank's device
    r, n = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "hetccl", dist.get_backend()
    everyone = [_val(q, (3, 4), dt) for q in range(n)]

    # all_reduce: every op
    stacked = torch.stack([e.to(torch.float64) for e in everyone])
    want = {"SUM": stacked.sum(0), "PRODUCT": stacked.prod(0), "MIN": stacked.min(0).values,
            "MAX": stacked.max(0).values}
    for name, exp in want.items():
        t = _val(r, (3, 4), dt)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        _eq(t, exp.to(dt), f"all_reduce {name}")
    if dt.is_floating_point:
        t = _val(r, (3, 4), dt) * n  # multiples of n so the mean is exact
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        _eq(t, (stacked * n).mean(0).to(dt), "all_reduce AVG")

    # non-contiguous tensor
    base = _val(r, (4, 3), dt)
    t = base.t()
    assert not t.is_contiguous()
    dist.all_reduce(t)
    _eq(base, sum(_val(q, (4, 3), dt).to(torch.float64) for q in range(n)).to(dt), "all_reduce non-contiguous")

    # all_gather (list) and all_gather_into_tensor
    outs = [torch.zeros(3, 4, dtype=dt) for _ in range(n)]
    dist.all_gather(outs, _val(r, (3, 4), dt))
    for q in range(n):
        _eq(outs[q], everyone[q], f"all_gather[{q}]")
    big = torch.zeros(n * 3, 4, dtype=dt)
    ALL_GATHER_TENSOR(big, _val(r, (3, 4), dt))
    _eq(big, torch.cat(everyone), "all_gather_into_tensor")

    # reduce_scatter (list) and reduce_scatter_tensor
    ins = [_val(r, (2, 3), dt, base=q) for q in range(n)]
    out = torch.zeros(2, 3, dtype=dt)
    dist.reduce_scatter(out, ins)
    exp = sum(_val(q, (2, 3), dt, base=r).to(torch.float64) for q in range(n))
    _eq(out, exp.to(dt), "reduce_scatter")
    out = torch.zeros(2, 3, dtype=dt)
    REDUCE_SCATTER_TENSOR(out, torch.cat(ins))
    _eq(out, exp.to(dt), "reduce_scatter_tensor")
    src = torch.cat(ins).reshape(n * 2, 3)
    REDUCE_SCATTER_TENSOR(src[r * 2:(r + 1) * 2], src)  # in place: the output is this rank's slice of the input
    _eq(src[r * 2:(r + 1) * 2], exp.to(dt), "reduce_scatter_tensor in place")

    # uneven lists (FSDP2's parts whose size does not divide): rank q's part has q + 1 rows
    outs = [torch.zeros(q + 1, 2, dtype=dt) for q in range(n)]
    dist.all_gather(outs, _val(r, (r + 1, 2), dt))
    for q in range(n):
        _eq(outs[q], _val(q, (q + 1, 2), dt), f"all_gather uneven [{q}]")
    parts = [_val(r, (q + 1, 2), dt, base=q) for q in range(n)]
    mine = torch.zeros(r + 1, 2, dtype=dt)
    dist.reduce_scatter(mine, parts)
    _eq(mine, sum(_val(q, (r + 1, 2), dt, base=r).to(torch.float64) for q in range(n)).to(dt),
        "reduce_scatter uneven")

    # large all_gather / reduce_scatter (GPU only): between GPU leaders they cross in pieces (a stage chunk of
    # every leader's block a piece, the last one short), in place too (FSDP2's all_gather; the output a slice
    # of the input, as NCCL allows); exact small integers that vary along the block
    if torch.get_default_device().type == "cuda" and dt == torch.float32:
        m = 1_300_003

        def block(q: int, base: int = 0) -> torch.Tensor:
            return ((torch.arange(m) % 1013) + 3 * q + base).to(dt)

        every = torch.cat([block(q) for q in range(n)])
        big = torch.zeros(n * m, dtype=dt)
        ALL_GATHER_TENSOR(big, block(r))
        _eq(big, every, "large all_gather_into_tensor")
        big = torch.zeros(n * m, dtype=dt)
        big[r * m:(r + 1) * m] = block(r)
        ALL_GATHER_TENSOR(big, big[r * m:(r + 1) * m])
        _eq(big, every, "large all_gather_into_tensor in place")
        src = torch.cat([block(r, base=q) for q in range(n)])
        want_rs = sum(block(q, base=r).to(torch.float64) for q in range(n)).to(dt)
        out = torch.zeros(m, dtype=dt)
        REDUCE_SCATTER_TENSOR(out, src)
        _eq(out, want_rs, "large reduce_scatter_tensor")
        REDUCE_SCATTER_TENSOR(src[r * m:(r + 1) * m], src)
        _eq(src[r * m:(r + 1) * m], want_rs, "large reduce_scatter_tensor in place")
        # past 16 stage chunks the pieces grow (hierarchical._chunks): 64.9 MiB in 16 pieces of 4.05 MiB, the last
        # short, reduced in spans of 7
        t = (torch.arange(17_000_003) % 977 + r).to(dt)
        dist.all_reduce(t)
        _eq(t, (torch.arange(17_000_003) % 977 * n + n * (n - 1) // 2).to(dt), "all_reduce past 16 stage chunks")

    # broadcast, reduce from every root
    for root in range(n):
        t = _val(r, (5,), dt)
        dist.broadcast(t, src=root)
        _eq(t, _val(root, (5,), dt), f"broadcast root {root}")
        t = _val(r, (5,), dt)
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        if r == root:
            _eq(t, sum(_val(q, (5,), dt).to(torch.float64) for q in range(n)).to(dt), f"reduce root {root}")

    # all_to_all_single: equal and uneven splits; all_to_all (lists)
    inp = torch.cat([_val(r, (2,), dt, base=10 * q) for q in range(n)])
    out = torch.zeros(2 * n, dtype=dt)
    dist.all_to_all_single(out, inp)
    _eq(out, torch.cat([_val(q, (2,), dt, base=10 * r) for q in range(n)]), "all_to_all_single")
    isplits = [q + 1 for q in range(n)]  # rank r sends q+1 rows to rank q
    osplits = [r + 1] * n
    inp = torch.cat([_val(r, (q + 1, 2), dt, base=10 * q) for q in range(n)])
    out = torch.zeros(sum(osplits), 2, dtype=dt)
    dist.all_to_all_single(out, inp, output_split_sizes=osplits, input_split_sizes=isplits)
    _eq(out, torch.cat([_val(q, (r + 1, 2), dt, base=10 * r) for q in range(n)]), "all_to_all_single uneven")
    outs = [torch.zeros(3, dtype=dt) for _ in range(n)]
    dist.all_to_all(outs, [_val(r, (3,), dt, base=10 * q) for q in range(n)])
    for q in range(n):
        _eq(outs[q], _val(q, (3,), dt, base=10 * r), f"all_to_all[{q}]")

    # gather, scatter
    for root in range(n):
        gl = [torch.zeros(4, dtype=dt) for _ in range(n)] if r == root else None
        dist.gather(_val(r, (4,), dt), gl, dst=root)
        if r == root:
            for q in range(n):
                _eq(gl[q], _val(q, (4,), dt), f"gather root {root} [{q}]")
        t = torch.zeros(4, dtype=dt)
        sl = [_val(q, (4,), dt, base=root) for q in range(n)] if r == root else None
        dist.scatter(t, sl, src=root)
        _eq(t, _val(r, (4,), dt, base=root), f"scatter root {root}")

    # coalesced: all_gather_coalesced (lists), and the coalescing manager's fast paths
    # torch's layout: output_tensor_lists[rank][input]
    outs = [[torch.zeros(2, dtype=dt), torch.zeros(3, 1, dtype=dt)] for _ in range(n)]
    dist.all_gather_coalesced(outs, [_val(r, (2,), dt), _val(r, (3, 1), dt, base=5)])
    for q in range(n):
        _eq(outs[q][0], _val(q, (2,), dt), f"all_gather_coalesced[{q}][0]")
        _eq(outs[q][1], _val(q, (3, 1), dt, base=5), f"all_gather_coalesced[{q}][1]")
    from torch.distributed.distributed_c10d import _coalescing_manager

    ts = [_val(r, (4,), dt), _val(r, (2, 2), dt, base=3)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    _eq(ts[0], sum(_val(q, (4,), dt).to(torch.float64) for q in range(n)).to(dt), "coalesced all_reduce[0]")
    _eq(ts[1], sum(_val(q, (2, 2), dt, base=3).to(torch.float64) for q in range(n)).to(dt), "coalesced all_reduce[1]")
    bigs = [torch.zeros(n * 2, dtype=dt), torch.zeros(n * 3, dtype=dt)]
    with _coalescing_manager():
        ALL_GATHER_TENSOR(bigs[0], _val(r, (2,), dt))
        ALL_GATHER_TENSOR(bigs[1], _val(r, (3,), dt, base=1))
    _eq(bigs[0], torch.cat([_val(q, (2,), dt) for q in range(n)]), "coalesced all_gather_single[0]")
    _eq(bigs[1], torch.cat([_val(q, (3,), dt, base=1) for q in range(n)]), "coalesced all_gather_single[1]")
    outs = [torch.zeros(2, 3, dtype=dt), torch.zeros(1, dtype=dt)]
    with _coalescing_manager():
        REDUCE_SCATTER_TENSOR(outs[0], torch.cat(ins))
        REDUCE_SCATTER_TENSOR(outs[1], torch.cat([_val(r, (1,), dt, base=q) for q in range(n)]))
    _eq(outs[0], exp.to(dt), "coalesced reduce_scatter_single[0]")
    _eq(outs[1], sum(_val(q, (1,), dt, base=r).to(torch.float64) for q in range(n)).to(dt),
        "coalesced reduce_scatter_single[1]")

    # send / recv around a ring, and batch_isend_irecv both ways at once
    t = _val(r, (6,), dt)
    got = torch.zeros(6, dtype=dt)
    nxt, prv = (r + 1) % n, (r - 1) % n
    if r % 2 == 0:
        dist.send(t, nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(t, nxt)
    _eq(got, _val(prv, (6,), dt), "send/recv")
    got_p, got_n = torch.zeros(6, dtype=dt), torch.zeros(6, dtype=dt)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, got_p, prv),
                                   dist.P2POp(dist.isend, t, prv), dist.P2POp(dist.irecv, got_n, nxt)])
    for q in reqs:
        q.wait()
    _eq(got_p, _val(prv, (6,), dt), "batch_isend_irecv from previous")
    _eq(got_n, _val(nxt, (6,), dt), "batch_isend_irecv from next")

    # PREMUL_SUM (FSDP2's gradient divide factor): sum of inputs * factor; integers are rejected
    if dt.is_floating_point and not premul_readable():  # torch 2.11 does not show the factor to Python
        try:
            dist.all_reduce(_val(r, (3, 4), dt), op=dist._make_nccl_premul_sum(0.5))
        except UnsupportedError as e:
            assert "PREMUL_SUM" in str(e), e
        else:
            raise AssertionError("PREMUL_SUM without a readable factor should be refused")
    elif dt.is_floating_point:
        t = _val(r, (3, 4), dt)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        _eq(t, (stacked.sum(0) * 0.5).to(dt), "all_reduce PREMUL_SUM")
        out = torch.zeros(2, 3, dtype=dt)
        src = torch.cat(ins)
        keep = src.clone()
        REDUCE_SCATTER_TENSOR(out, src, op=dist._make_nccl_premul_sum(torch.tensor([0.25], dtype=torch.float64)))
        _eq(out, (exp * 0.25).to(dt), "reduce_scatter_tensor PREMUL_SUM")
        _eq(src, keep, "reduce_scatter_tensor PREMUL_SUM leaves its input alone")
    else:
        try:
            dist.all_reduce(torch.ones(2, dtype=dt), op=dist._make_nccl_premul_sum(0.5))
        except Exception as e:  # noqa: BLE001
            # torch 2.11 hides the factor, which is refused first
            assert ("PREMUL_SUM needs a floating-point tensor" if premul_readable() else "PREMUL_SUM") in str(e), e
        else:
            raise AssertionError("PREMUL_SUM on integers should be rejected")

    # unsupported options raise clearly
    try:
        dist.all_reduce(torch.ones(2, dtype=dt), op=dist.ReduceOp.BAND)
    except Exception as e:  # noqa: BLE001
        assert "reduce op BAND is not supported" in str(e), e
    else:
        raise AssertionError("BAND should be rejected")

    dist.barrier()
    dist.destroy_process_group()


def case_async() -> None:
    torch.set_default_device(_init())  # every tensor below is made on this rank's device
    r, n = dist.get_rank(), dist.get_world_size()
    ts = [torch.full((1000,), float(r + i)) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]  # several in flight at once
    for i, w in enumerate(works):
        if i % 2:
            w.wait()
        else:
            res = w.get_future().wait()
            _eq(res[0], ts[i], "future result is the tensor")
        _eq(ts[i], torch.full((1000,), float(sum(q + i for q in range(n)))), f"async all_reduce {i}")
    big = torch.zeros(n * 3)
    w = ALL_GATHER_TENSOR(big, torch.full((3,), float(r)), async_op=True)
    fut = w.get_future().then(lambda f: f.value()[0].sum().item())
    total = fut.wait()
    assert total == 3 * sum(range(n)), total
    w = dist.barrier(async_op=True)
    w.wait()
    assert w.is_completed()
    if torch.cuda.is_available() and ts[0].is_cuda:
        _wait_orders_streams(r, n)
    # collectives still in flight when the group is destroyed end first, as ncclCommDestroy lets queued work
    # finish: no rank's close runs ahead of them (on the GPU, an ordered one's host side had not started when
    # the peers were told "closed after" the one before it, 2026-12-06)
    tail = [torch.full((1 << 18,), float(r + i)) for i in range(4)]
    for t in tail:
        dist.all_reduce(t, async_op=True)
    dist.destroy_process_group()
    if tail[0].is_cuda:
        torch.cuda.synchronize()
    for i, t in enumerate(tail):
        _eq(t, torch.full((1 << 18,), float(sum(q + i for q in range(n)))), f"all_reduce {i} in flight at destroy")


def _wait_orders_streams(r: int, n: int) -> None:
    """An all_reduce issued on a side stream behind ~50 ms of GPU work, waited for on the default stream: the
    default stream's next read must see the sum. wait() has to order the streams (ProcessGroupNCCL's wait());
    a Work that merely says "done" lets the read run first and see this rank's own value."""
    side = torch.cuda.Stream()
    for rnd in range(3):
        t = torch.full((4 << 20,), float(r + 1 + rnd))  # made on the default stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: the collective runs late on the side stream
            w = dist.all_reduce(t, async_op=True)
        t.record_stream(side)
        w.wait()  # on the default stream
        got = t[-1].clone()  # queued on the default stream
        want = torch.tensor(float(sum(q + 1 + rnd for q in range(n))), device="cpu")
        _eq(got.cpu(), want, f"wait() ordering, round {rnd}")
    # DDP's compress hooks: the collective on the default stream behind ~50 ms of GPU work, then a `then`
    # callback (torch runs it on a pool stream, made to wait for the future's events) reads the result. The
    # events must be recorded on the collective's stream: on a fresh stream (what torch.cuda.ExternalStream(0)
    # gives) the read runs at once and sees this rank's own value.
    for rnd in range(3):
        t = torch.full((4 << 20,), float(r + 1 + rnd))
        torch.cuda._sleep(100_000_000)
        fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0][-1:].clone())
        want = torch.tensor([float(sum(q + 1 + rnd for q in range(n)))], device="cpu")
        _eq(fut.wait().cpu(), want, f"future then() ordering, round {rnd}")


def case_subgroup() -> None:
    torch.set_default_device(_init())  # every tensor below is made on this rank's device
    r, n = dist.get_rank(), dist.get_world_size()
    members = [0, n - 1]
    g = dist.new_group(members, backend="hetccl")
    odd = dist.new_group([q for q in range(n) if q % 2 == 1], backend="hetccl")
    if r in members:
        t = torch.full((4,), float(r + 1))
        dist.all_reduce(t, group=g)
        _eq(t, torch.full((4,), float(1 + n)), "subgroup all_reduce")
        t = torch.full((2,), float(r))
        dist.broadcast(t, src=n - 1, group=g)  # global rank
        _eq(t, torch.full((2,), float(n - 1)), "subgroup broadcast")
        assert dist.get_world_size(g) == 2 and dist.get_rank(g) == members.index(r)
    if r % 2 == 1:
        t = torch.full((3,), 1.0)
        dist.all_reduce(t, group=odd)
        _eq(t, torch.full((3,), float(len([q for q in range(n) if q % 2 == 1]))), "odd subgroup")
    t = torch.ones(2)
    dist.all_reduce(t)  # the world group still works after the subgroups
    _eq(t, torch.full((2,), float(n)), "world after subgroup")
    dist.barrier()
    dist.destroy_process_group()


def _train(model: torch.nn.Module, dev: torch.device, r: int) -> list[float]:
    """Three SGD steps on rank r's own random batches (16 features in, 4 out); the per-step losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + r)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=gen).to(dev), torch.randn(8, 4, generator=gen).to(dev)
        opt.zero_grad()
        # in fp32 whatever the parameters' dtype (mse_loss's backward on CUDA rejects a bf16 input with an fp32
        # target: "Found dtype Float but expected BFloat16")
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def case_ddp(backend: str, out_path: str, hook: str = "none") -> None:
    dev = _init(backend)
    r = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(  # several buckets
        model, device_ids=[dev.index] if dev.type == "cuda" else None, bucket_cap_mb=0.001)
    if hook != "none":
        # hetccl's hooks on hetccl; on Gloo torch's built-in ones (the same arithmetic), except bf16, which torch
        # refuses without NCCL: there Gloo runs hetccl's hook too, so only the backend differs
        if backend == "hetccl" or hook == "bf16":
            from hetccl.torch import hooks
        else:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks
        ddp.register_comm_hook(None, getattr(hooks, f"{hook}_hook" if hook == "allreduce" else f"{hook}_compress_hook"))
    losses = _train(ddp, dev, r)
    params = [p.detach().clone() for p in model.parameters()]
    for p in params:  # DDP keeps replicas identical
        ref = p.clone()
        dist.broadcast(ref, src=0)
        _eq(p, ref, "replicas identical")
    with open(f"{out_path}.{r}", "w") as f:
        json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


def case_compressed() -> None:
    """HETCCL_CROSS_COMPRESS on this rank's tensors through torch (the GPU tests' paths; TEST_CPU_RANKS: ranks
    on CPU tensors, a CPU island beside GPU ones): bf16 and fp8 in turn (the settings switched on every rank at
    the same point), all_reduce (sum, avg, max), reduce_scatter and all_gather of float32 and bfloat16 against an
    fp64 reference within the wire's bound (tests/workers.py), and that the bytes were cast where a wire carries
    them (1 + 2^-12 is in neither format), or not on the zero-copy link (TEST_COMPRESS_LINK=1)."""
    import numpy as np
    from workers import WIRE_BYTES, _lossy, _within

    dev = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    settings = dist.distributed_c10d._get_default_group()._get_backend(dev).comm.async_comm.settings
    if str(r) in os.environ.get("TEST_CPU_RANKS", "").split(","):
        dev = torch.device("cpu")
    link = os.environ.get("TEST_COMPRESS_LINK") == "1"
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}

    def tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.float32)).to(dev, getattr(torch, dtype))

    def host(t: torch.Tensor) -> np.ndarray:
        return t.float().cpu().numpy()

    for wire in ("bf16", "fp8"):
        settings.cross_compress = wire
        for dtype in ("float32", "bfloat16"):
            lossy = None if link or WIRE_BYTES[wire] >= (4 if dtype == "float32" else 2) else wire
            for count in (7, 20_000, 300_000):
                tag = f"{wire} {dtype} count={count}"
                for op, rop in ops.items():
                    ins = [_lossy(q, count, dtype, 0) for q in range(n)]
                    t = tensor(ins[r], dtype)
                    dist.all_reduce(t, rop)
                    _within(host(t), ins, op, dtype, lossy, f"all_reduce {op} {tag}")
                ins = [_lossy(q, n * count, dtype, 2) for q in range(n)]
                out = torch.zeros(count, device=dev, dtype=getattr(torch, dtype))
                dist.reduce_scatter_tensor(out, tensor(ins[r], dtype))
                _within(host(out), [a[r * count:(r + 1) * count] for a in ins], "sum", dtype, lossy,
                        f"reduce_scatter {tag}")
                every = torch.zeros(n * count, device=dev, dtype=getattr(torch, dtype))
                dist.all_gather_into_tensor(every, tensor(_lossy(r, count, dtype, 3), dtype))
                for q in range(n):
                    _within(host(every[q * count:(q + 1) * count]), [_lossy(q, count, dtype, 3)], "sum", dtype, lossy,
                            f"all_gather {tag} block {q}")
        odd = torch.full((300_000,), 1 + 2.0 ** -12, device=dev)
        dist.all_reduce(odd)
        want = n * (1 + 2.0 ** -12) if link else float(n)
        assert bool((odd == want).all()), f"all_reduce {wire}: {odd[:3].tolist()}, want {want} (link {link})"
    settings.cross_compress = "none"
    dist.barrier()
    print(f"rank {r}: compressed collectives within bound ({dev})", flush=True)
    dist.destroy_process_group()


def case_error_feedback() -> None:
    """HETCCL_CROSS_COMPRESS=fp8 with hetccl.torch.hooks.error_feedback_hook: DDP, 200 SGD steps of an
    ill-conditioned least squares (one feature in 64 at scale 1, the rest at 0.02: their gradients are small
    beside the largest one of their fp8 group), on this rank's device. The run without compression, with fp8
    alone and with fp8 and error feedback, one after the other (the communicator's settings switched on every
    rank at the same point): feedback ends within 1 % of the uncompressed loss and closer to it than fp8 alone,
    which differs. Each run has one step that overflows (its loss times inf) and is skipped, as GradScaler skips
    one: feedback must carry nothing of it into the next steps."""
    from hetccl.torch import hooks

    dev = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    settings = dist.distributed_c10d._get_default_group()._get_backend(dev).comm.async_comm.settings
    d, rows = 1024, 2048
    gen = torch.Generator().manual_seed(0)
    scale = torch.where(torch.arange(d) % 64 == 0, 1.0, 0.02)
    x = torch.randn(rows * n, d, generator=gen) * scale
    y = x @ torch.randn(d, generator=gen)
    x, y = x.to(dev), y.to(dev)  # the GPU tests: the device packs what crosses (gpu/codec.py)
    mine = slice(r * rows, (r + 1) * rows)

    def train(wire: str, hook: object, state: object) -> float:
        settings.cross_compress = wire
        model = torch.nn.Linear(d, 1, bias=False).to(dev)
        torch.nn.init.zeros_(model.weight)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(200):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x[mine]).squeeze(1), y[mine])
            (loss * math.inf if step == 100 else loss).backward()
            if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
                opt.step()
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x).squeeze(1), y).item()

    plain = train("none", hooks.allreduce_hook, None)
    fp8 = train("fp8", hooks.allreduce_hook, None)
    fed = train("fp8", hooks.error_feedback_hook, hooks.ErrorFeedback())
    print(f"rank {r}: loss uncompressed {plain:.7g}, fp8 {fp8:.7g}, fp8 + error feedback {fed:.7g}", flush=True)
    assert fp8 != plain, "fp8 changed nothing: the gradients were not compressed"
    assert abs(fed - plain) <= 0.01 * plain, (fed, plain)
    assert abs(fed - plain) < abs(fp8 - plain), (fed, fp8, plain)
    dist.destroy_process_group()


def _fsdp_model() -> torch.nn.Module:
    # 33 and 5 rows do not split evenly over 2 or 3 ranks: FSDP2 pads its shards
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 4))


def case_fsdp(backend: str, out_path: str, variant: str = "plain") -> None:
    """FSDP2 `fully_shard` training, a few SGD steps; the losses go to OUT_PATH.RANK for comparison with Gloo."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dev = _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _fsdp_model().to(dev)
    kw: dict = {}
    if variant not in ("plain", "mesh", "hsdp", "bf16-keep", "divide"):
        raise SystemExit(f"unknown variant {variant}")
    if variant == "mesh" or (variant != "hsdp" and dev.type == "cpu" and torch.cuda.is_available()):
        # an explicit DeviceMesh with a dimension name (and on a GPU machine the only way to keep FSDP2 on the CPU)
        kw["mesh"] = init_device_mesh(dev.type, (n,), mesh_dim_names=("dp",))
    if variant == "hsdp":  # 2-D mesh: replicate over every rank, shard over one (all_reduce on a subgroup)
        kw["mesh"] = init_device_mesh(dev.type, (n, 1), mesh_dim_names=("replicate", "shard"))
    if variant == "bf16-keep":
        # parameters gathered in bf16, gradients reduced in fp32; they stay unsharded from forward to backward
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw["reshard_after_forward"] = False
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, **kw)
    fully_shard(model, **kw)
    if variant == "divide":
        # A divide factor other than the world size: FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM(1 / factor),
        # which Gloo rejects; Gloo gets the same arithmetic as a SUM followed by a division.
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(float(n + 1))
                if backend == "gloo":  # NCCL has PREMUL_SUM itself
                    m.set_force_sum_reduction_for_comms(True)
    if backend == "hetccl":
        assert dist.group.WORLD.group_name, "group name"  # what DeviceMesh reads
    losses = _train(model, dev, r)
    full = [p.full_tensor().detach() for p in model.parameters()]  # gathers the shards: identical everywhere
    for p in full:
        ref = p.clone()
        dist.broadcast(ref, src=0)
        _eq(p, ref, "unsharded parameters identical")
    with open(f"{out_path}.{r}", "w") as f:
        json.dump({"losses": losses, "params": [p.double().sum().item() for p in full]}, f)
    dist.barrier()
    dist.destroy_process_group()


def case_fsdp_recipe(backend: str, out_path: str, reduce_dtype: str = "float32") -> None:
    """FSDP2 as a recipe runs it: bf16 parameters with `reduce_dtype` reduction, reshard_after_forward true on
    the inner layers and false on the root, AdamW, two micro-batches per step with gradient accumulation
    (`set_requires_gradient_sync(False)` on the first), then the distributed checkpoint's full and sharded state
    dicts. The losses, the full state dict's sums and every rank's shard sums go to OUT_PATH.RANK. With
    TEST_NCCL_HOSTS, NCCL runs every rank as its own host (two ranks on one GPU, over its socket transport)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if backend == "nccl" and os.environ.get("TEST_NCCL_HOSTS"):
        os.environ["NCCL_HOSTID"] = f"h{os.environ.get('LOCAL_RANK', '0')}"
    dev = _init(backend)
    r = dist.get_rank()
    torch.manual_seed(0)
    model = _fsdp_model().to(dev)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + r)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)  # the first micro-batch accumulates without a reduction
            x, y = torch.randn(8, 16, generator=gen).to(dev), torch.randn(8, 4, generator=gen).to(dev)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded = get_model_state_dict(model)
    shards = {k: v.to_local().double().sum().item() for k, v in sharded.items()}
    with open(f"{out_path}.{r}", "w") as f:
        json.dump({"losses": losses, "full": {k: v.double().sum().item() for k, v in full.items()},
                   "shards": shards}, f)
    dist.barrier()
    dist.destroy_process_group()


def case_held() -> None:
    """The caller's thread is not held by a cross-island collective of CUDA tensors: each op at 16 MiB, issued
    behind ~50 ms of queued compute, returns (async_op=False, so its wait() too) long before that compute ends,
    and the results are right once the stream gets there. Also: a Work waited on from another stream orders
    that stream, and the collectives' results feed the next ones in stream order."""
    dev = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    a = torch.randn(4096, 4096, device=dev)

    def busy(ms: float) -> None:  # queue about `ms` of matrix work on the current stream
        for _ in range(max(1, int(ms / per))):
            torch.mm(a, a)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) * 1000 / 20
    count = 4 << 20  # 16 MiB of float32
    held = {}
    # the first round warms up (pinned staging buffers are allocated once, as NCCL sets up on first use); the
    # second is measured
    for op in [*(f"{o} warm-up" for o in ("all_reduce", "broadcast", "reduce_scatter", "all_gather")),
               "all_reduce", "broadcast", "reduce_scatter", "all_gather"]:
        x = torch.full((count,), float(r + 1), device=dev)
        big = torch.empty(n * count, device=dev)
        dist.barrier()
        torch.cuda.synchronize()
        busy(50)
        name = op.split()[0]
        if name == "reduce_scatter":  # queued before the clock starts: only the collective is timed
            big.fill_(float(r + 1))
        t0 = time.perf_counter()
        if name == "all_reduce":
            dist.all_reduce(x)
        elif name == "broadcast":
            dist.broadcast(x, src=0)
        elif name == "reduce_scatter":
            dist.reduce_scatter_tensor(x, big)
        else:
            dist.all_gather_into_tensor(big, x)
        if op == name:
            held[op] = (time.perf_counter() - t0) * 1000
        want = {"all_reduce": n * (n + 1) / 2, "broadcast": 1.0, "reduce_scatter": n * (n + 1) / 2}
        if name == "all_gather":
            for q in range(n):
                _eq(big[q * count:(q + 1) * count:4096], torch.full((count // 4096,), float(q + 1), device=dev),
                    f"all_gather part {q}")
        else:
            _eq(x[::4096], torch.full((x.numel() // 4096,), want[name], device=dev), op)
    # the queued compute took ~50 ms; a held thread would have waited for it (generous: a loaded machine)
    for op, ms in held.items():
        assert ms < 25, f"rank {r}: {op} held the caller's thread {ms:.1f} ms (queued compute ~50 ms)"
    # a side stream's collective, waited on from the default stream; chained in stream order
    side = torch.cuda.Stream()
    x = torch.full((count,), float(r + 1), device=dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        busy(20)
        work = dist.all_reduce(x, async_op=True)
    work.wait()  # the default stream now waits for it
    # a kernel this process never launched, behind a collective still held on the stream: under lazy module
    # loading its launch would wait for the GPU while holding the GIL, which the host side needs (a deadlock
    # on 2026-12-04; gpu/streamorder.loading_problem); `import hetccl.torch` chose eager loading
    assert os.environ.get("CUDA_MODULE_LOADING") == "EAGER", os.environ.get("CUDA_MODULE_LOADING")
    busy(20)
    y = torch.full((count,), float(r + 1), device=dev)
    dist.all_reduce(y)
    _eq(torch.special.bessel_j0(y[::4096] * 0), torch.ones(count // 4096, device=dev), "a first launch")
    x.mul_(2)
    dist.all_reduce(x)
    _eq(x[::4096], torch.full((count // 4096,), 2.0 * n * n * (n + 1) / 2, device=dev), "chained all_reduce")
    # a host-only collective right behind one whose root still waits for its copy: both in issue order everywhere
    busy(20)
    x.fill_(float(r + 7))
    dist.broadcast(x, src=0)
    dist.barrier()
    _eq(x[::4096], torch.full((count // 4096,), 7.0, device=dev), "broadcast before a barrier")
    print(f"rank {r}: held ms " + ", ".join(f"{k} {v:.2f}" for k, v in held.items()), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def case_anysource() -> None:
    """Receive from any source (dist.recv/irecv without src), on 3+ ranks: the sender is reported (return value,
    Work._source_rank()), tags are honoured, and a receive from a given rank posted after one from any source
    never takes a message out of that rank's order."""
    _init()
    r, n = dist.get_rank(), dist.get_world_size()
    others = [q for q in range(n) if q != 0]
    # 1. every peer sends two messages to rank 0, which receives them from any source (recv, then irecv)
    if r == 0:
        got = []
        for _ in others:
            for how in ("recv", "irecv"):
                t = torch.full((10,), -1.0)
                if how == "recv":
                    src = dist.recv(t)
                else:
                    w = dist.irecv(t)
                    w.wait()
                    src = w._source_rank()
                assert torch.equal(t, torch.full((10,), float(src))), (how, src, t)
                got.append(src)
        assert sorted(got) == sorted(others * 2), got
    else:
        dist.send(torch.full((10,), float(r)), 0)
        dist.send(torch.full((10,), float(r)), 0)
    # 2. tags: rank 1 sends tag 7 then tag 5; a receive of tag 5 from any source takes the second one
    if r == 1:
        dist.send(torch.tensor([71.0]), 0, tag=7)
        dist.send(torch.tensor([51.0]), 0, tag=5)
    elif r == 0:
        t = torch.zeros(1)
        assert dist.recv(t, tag=5) == 1 and t.item() == 51.0, t
        assert dist.recv(t, src=1, tag=7) == 1 and t.item() == 71.0, t
    # 3. order: rank 0 posts any (A), from rank 2 (B), any (C); rank 1 sends one message, rank 2 two (in order)
    if r == 0:
        ts = [torch.zeros(1) for _ in range(3)]
        works = [dist.irecv(ts[0], tag=3), dist.irecv(ts[1], src=2, tag=3), dist.irecv(ts[2], tag=3)]
        for w in works:
            w.wait()
        srcs = [works[0]._source_rank(), 2, works[2]._source_rank()]
        vals = [t.item() for t in ts]
        for s, v in zip(srcs, vals, strict=True):
            assert int(v) // 100 == s, (srcs, vals)
        assert [v for v in vals if v >= 200] == [200.0, 201.0], vals  # rank 2's messages in its order
        assert sorted(vals) == [100.0, 200.0, 201.0], vals
    elif r == 1:
        dist.send(torch.tensor([100.0]), 0, tag=3)
    elif r == 2:
        dist.send(torch.tensor([200.0]), 0, tag=3)
        dist.send(torch.tensor([201.0]), 0, tag=3)
    # 4. a subgroup: the sender is reported as a global rank
    g = dist.new_group([0, n - 1])
    if r == 0:
        t = torch.zeros(2)
        assert dist.recv(t, group=g) == n - 1 and t.tolist() == [9.0, 9.0], t
    elif r == n - 1:
        dist.send(torch.full((2,), 9.0), 0, group=g)
    dist.barrier()
    dist.destroy_process_group()


def case_work_error() -> None:
    """A collective that fails (here: it times out, its peer never joins) raises from Work.wait() and from the
    blocking call, as with Gloo; it must not look like a success. Its message says where the rank behind is."""
    import datetime

    os.environ.pop("HETCCL_TIMEOUT", None)  # the process group's timeout applies only without it
    dist.init_process_group("hetccl", timeout=datetime.timedelta(seconds=2))
    r = dist.get_rank()
    if r == 0:
        for how in ("blocking", "async"):
            try:
                if how == "blocking":
                    dist.barrier()
                else:
                    dist.all_reduce(torch.ones(3), async_op=True).wait()
            except hetccl.CollectiveTimeout as e:
                assert "did not complete within 2 s" in str(e), e
                # the hang report says where the rank behind stands: rank 1's main thread, in this function
                assert "rank 1 MainThread at tests/torch_workers.py:" in str(e) and "in case_work_error" in str(e), e
            else:
                raise AssertionError(f"a {how} collective that timed out returned normally")
    store = dist.distributed_c10d._get_default_store()
    if r == 0:
        store.set("work_error_done", "1")
    else:  # stays up meanwhile: rank 0's collectives must time out, not see a lost peer
        store.wait(["work_error_done"], datetime.timedelta(seconds=60))
    dist.destroy_process_group()


def case_gather_coalesced(backend: str, out_path: str) -> None:
    """all_gather_coalesced with as many inputs as ranks (the square case, where a transposed layout fits the
    shapes and goes unnoticed): writes the outputs for the test to compare with Gloo's."""
    _init(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    inputs = [torch.tensor([10 * i + r + 1, 10 * i + r + 1]) for i in range(n)]
    outs = [[torch.zeros(2, dtype=torch.int64) for _ in range(n)] for _ in range(n)]
    dist.all_gather_coalesced(outs, inputs)
    with open(f"{out_path}.{r}", "w") as f:
        json.dump([[t.tolist() for t in row] for row in outs], f)
    dist.destroy_process_group()


def case_inflight() -> None:
    """Many collectives in flight at once (what DDP's buckets and async_op=True do), of sizes that take every
    cross-island path (small, direct, chunked over several pipeline chunks), each fed by work queued on a side
    stream just before: every result checked."""
    dev = _init()
    torch.set_default_device(dev)
    r, n = dist.get_rank(), dist.get_world_size()
    side = torch.cuda.Stream() if dev.type == "cuda" else None
    counts = [1, 1000, 70_000, 300_000, 2_500_000, 5_000_000]  # 4 B .. 20 MB of fp32
    for rnd in range(3):
        works, checks = [], []
        for i, c in enumerate(counts):
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # produced on the side stream, reduced on it
                    t = torch.full((c,), float(r + 1)).mul_(i + 1 + rnd)
                    works.append(dist.all_reduce(t, async_op=True))
            else:
                t = torch.full((c,), float(r + 1)).mul_(i + 1 + rnd)
                works.append(dist.all_reduce(t, async_op=True))
            checks.append((t, float((i + 1 + rnd) * n * (n + 1) // 2), f"all_reduce {c} round {rnd}"))
            g = torch.zeros(n * (c // 4 + 1))
            works.append(ALL_GATHER_TENSOR(g, torch.full((c // 4 + 1,), float(r + i)), async_op=True))
            checks.append((g, torch.cat([torch.full((c // 4 + 1,), float(q + i)) for q in range(n)]),
                           f"all_gather {c}"))
            o = torch.zeros(c // 4 + 1)
            works.append(REDUCE_SCATTER_TENSOR(o, torch.full((n * (c // 4 + 1),), float(r + 1)), async_op=True))
            checks.append((o, float(n * (n + 1) // 2), f"reduce_scatter {c}"))
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        for w in works:
            w.wait()
        for t, want, what in checks:
            want = want if isinstance(want, torch.Tensor) else torch.full_like(t, want)
            _eq(t, want, what)
    # collectives in flight that read what an earlier one in flight writes, no wait between them: each must see
    # the earlier result (a collective's copies out may run early on the GPU, beside the ones before it, only
    # where they read nothing those write)
    s = n * (n + 1) // 2
    for c in (1000, 2_500_000):
        t = torch.full((c,), float(r + 1))
        chain = [dist.all_reduce(t, async_op=True) for _ in range(3)]
        g = torch.zeros(n * c)
        chain.append(ALL_GATHER_TENSOR(g, t, async_op=True))
        o = torch.zeros(c // n)
        chain.append(REDUCE_SCATTER_TENSOR(o, t[:n * (c // n)], async_op=True))
        for w in chain:
            w.wait()
        _eq(t, torch.full_like(t, float(s * n * n)), f"3 all_reduces of one tensor in flight ({c})")
        _eq(g, torch.full_like(g, float(s * n * n)), f"all_gather of an all_reduce in flight ({c})")
        _eq(o, torch.full_like(o, float(s * n ** 3)), f"reduce_scatter of an all_reduce in flight ({c})")
    dist.barrier()
    dist.destroy_process_group()


def case_device_id() -> None:
    """init_process_group(device_id=...), as torch recommends and Lightning does; then ops and a subgroup."""
    dev = _device()
    dist.init_process_group("hetccl", device_id=dev)
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(r + 1), device=dev)
    dist.all_reduce(t)
    _eq(t, torch.full((1000,), float(n * (n + 1) // 2), device=dev), "all_reduce after device_id")
    g = dist.new_group(list(range(n)))
    t = torch.ones(10, device=dev)
    dist.all_reduce(t, group=g)
    _eq(t, torch.full((10,), float(n), device=dev), "subgroup all_reduce after device_id")
    dist.barrier()
    dist.destroy_process_group()


def case_peer_fails(how: str) -> None:
    """Rank 1 dies (or hangs) after a few collectives; rank 0 must get a hetccl error from wait() or the next
    collective, never a stale result, and print it. Both exit 0 so that the launcher lets rank 0 report."""
    import time

    import hetccl

    dev = _init()
    r = dist.get_rank()
    for _ in range(3):
        t = torch.ones(1 << 20, device=dev)
        dist.all_reduce(t)
        _eq(t, torch.full((1 << 20,), 2.0, device=dev), "all_reduce before the failure")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    if r == 1:
        time.sleep(1.0)  # rank 0 has finished the collectives above and is in the loop below
        if how == "dead":
            os._exit(0)
        time.sleep(float(os.environ["HETCCL_TIMEOUT"]) * 4)
        os._exit(0)
    t0 = time.monotonic()
    stale = 0
    try:
        for i in range(1000):
            t = torch.ones(1 << 20, device=dev)
            dist.all_reduce(t, async_op=True).wait()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if t[0].item() != 2.0:
                # inside one island a collective returns once enqueued (as with NCCL): the one enqueued before the
                # failure was seen is aborted, and the next call must raise
                stale += 1
                if stale > 1 or os.environ.get("TEST_ISLANDS"):
                    raise AssertionError(f"all_reduce {i} after the failure returned {t[0].item()}, not an error")
    except Exception as exc:  # noqa: BLE001 (a Work's future may hand the error back as a RuntimeError)
        said = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, hetccl.HetcclError) and not any(
                k in said for k in ("PeerLostError", "CollectiveTimeout", "CommAbortedError")):
            raise
        print(f"rank 0 got {said} after {time.monotonic() - t0:.1f} s", flush=True)
    else:
        raise AssertionError("1000 all_reduces with a failed peer all succeeded")
    sys.stdout.flush()
    os._exit(0)


def case_ddp_peer_raises() -> None:
    """DDP; rank 1 raises in its fourth step (as a CUDA out-of-memory would) and exits with that error. Rank 0,
    in that step's backward or the next, gets an error that names rank 1 (DDP's reducer crashed it with SIGSEGV
    before: it read the error as tensors), prints it and exits 0."""
    dev = _init()
    r = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).to(dev))
    try:
        for step in range(20):
            loss = model(torch.randn(32, 64, device=dev)).square().mean()
            if r == 1 and step == 3:
                raise MemoryError("rank 1 ran out of memory (the test's)")
            loss.backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 (through DDP's future: a RuntimeError that carries hetccl's message)
        print(f"rank 0 got {type(exc).__name__}: {exc}", flush=True)
        os._exit(0)
    raise AssertionError("rank 0 trained on after rank 1 failed")


def case_nccl_builds() -> None:
    """Every op on islands that each load their own NCCL build (TEST_NCCL_LIBS); each rank then prints the
    library its island used, for the test to check that the builds differ."""
    case_ops("float32")
    from hetccl.bindings.ccl import load_nccl

    lib = load_nccl()
    print(f"rank {os.environ['RANK']} island {os.environ.get('HETCCL_ISLAND')} nccl "
          f"{'.'.join(map(str, lib.version))} {lib.path}", flush=True)


def case_label_mismatch() -> None:
    """CUDA tensors on ranks labelled as CPU islands: a ConfigError naming the rank, label and device."""
    from hetccl.errors import ConfigError

    dev = _init()
    try:
        dist.all_reduce(torch.ones(4, device=dev))
    except ConfigError as exc:
        assert "island label" in str(exc) and "cpu-" in str(exc) and f"GPU {dev.index}" in str(exc), exc
        print(f"ConfigError: {exc}", flush=True)
    else:
        raise AssertionError("CUDA tensors on a CPU island were accepted")
    os._exit(0)


def case_lazy_loading(mode: str) -> None:
    """CUDA_MODULE_LOADING=LAZY on the ranks in TEST_LAZY_RANKS (set here, before CUDA starts, as a user's own
    setting). mode "auto": the group holds the thread for cross-island collectives (a blocking all_reduce behind
    queued compute returns only after it) and gets the right sum; mode "1": a ConfigError at init that names
    the lazy rank and what to set."""
    from hetccl.errors import ConfigError

    r = int(os.environ["RANK"])
    lazy = r in [int(q) for q in os.environ["TEST_LAZY_RANKS"].split(",")]
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"  # import hetccl.torch chose it (no CUDA call yet)
    if lazy:
        os.environ["CUDA_MODULE_LOADING"] = "LAZY"
    try:
        dev = _init()
    except ConfigError as exc:
        assert mode == "1", exc
        assert "HETCCL_TORCH_STREAM_ORDER" in str(exc), exc
        assert "CUDA_MODULE_LOADING=EAGER" in str(exc) or not lazy, exc
        print(f"ConfigError: {exc}", flush=True)
        os._exit(0)
    assert mode == "auto", "the stream order was accepted under lazy module loading"
    a = torch.randn(4096, 4096, device=dev)
    x = torch.full((1 << 20,), float(r + 1), device=dev)
    torch.cuda.synchronize()
    for _ in range(20):
        torch.mm(a, a)
    dist.all_reduce(x)
    busy = not torch.cuda.current_stream().query()
    _eq(x[::4096], torch.full((256,), 3.0, device=dev), "all_reduce")
    assert not busy, "the caller's stream still had work after a held all_reduce returned"
    print(f"rank {r}: held by the lazy group", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    case, args = sys.argv[1], sys.argv[2:]
    os.environ.setdefault("HETCCL_TIMEOUT", "60")
    if os.environ.get("TEST_STACKS_AFTER"):  # debugging a hang: every thread's Python stack on stderr after N s
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TEST_STACKS_AFTER"]), exit=False)
    globals()[f"case_{case}"](*args)
    # Every check passed and the process group is destroyed. Skip interpreter teardown: a rare (< 1 in 50)
    # "terminate called without an active exception" abort was seen there in a *gloo* rank on this 2-core
    # machine, from C++ threads torch leaves behind; it is not what these tests check.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
