"""Rank bodies for tests/test_balance.py: `python tests/balance_workers.py CASE` under torchrun or `hetccl run`.
Exit code 0 means every check passed. Each rank also trains the single-process reference itself (the same
global batches, one model), so it checks its own replica against it."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import DataLoader, TensorDataset

import hetccl.torch  # noqa: F401  (registers the "hetccl" backend)
from hetccl.errors import ConfigError
from hetccl.torch import balance

B, STEPS, LR = 16, 4, 0.1
for _var in ("HETCCL_ISLAND", "HETCCL_HOST"):  # TEST_<VAR>: one value per rank, indexed by the global rank
    if os.environ.get("TEST_" + _var):
        os.environ[_var] = os.environ["TEST_" + _var].split(",")[int(os.environ["RANK"])]


def _data(n: int = 8 * B) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.1 * torch.randn(n, 1, generator=g))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


class SlowPerSample(torch.nn.Module):
    """Sleeps a + c * batch in its forward: a rank made deliberately slower per sample (the balancer's fixture)."""

    def __init__(self, a: float, c: float):
        super().__init__()
        self.a, self.c = a, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.a + self.c * len(x))
        return x


class SlowData(torch.utils.data.Dataset):
    """`inner`, whose batches take c * batch seconds to load: a rank slowed outside its model (a host-bound
    rank's data gather), which the balancer must see too."""

    def __init__(self, inner: TensorDataset, c: float):
        self.inner, self.c = inner, c

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        return self.inner[i]

    def __getitems__(self, idx: list[int]) -> list[Any]:
        time.sleep(self.c * len(idx))
        return [self.inner[i] for i in idx]


def _reference(ds: TensorDataset, steps: int, batch: int = B, model: torch.nn.Module | None = None,
               lr: float = LR) -> list[torch.Tensor]:
    """One process over the same global batches (seed 0, as _train's sampler), of `model` (default _model())."""
    model = _model() if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _, idx in zip(range(steps), balance.global_batches(len(ds), batch, 0), strict=False):
        x, y = ds[idx]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(model: torch.nn.Module, bal: balance.Balancer, ds: TensorDataset, steps: int, slow: Any = None,
           lr: float = LR) -> list[float]:
    sampler = balance.BatchSampler(ds, bal, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=sampler.collate())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for k, (x, y) in zip(range(steps), loader, strict=False):
        if slow is not None:
            slow(k)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(bal.mean(loss.detach() if len(x) else 0.0)))
    return losses


def _shard(model: torch.nn.Sequential) -> None:
    """fully_shard each Linear layer, then the root (a recipe's layout)."""
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
        if err > tol:
            raise AssertionError(f"rank {dist.get_rank()}: {what}: parameter {i} off by {err:.3g} relative (> {tol})")


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().clone())
    return out


def case_exact() -> None:
    """DDP (default reducer, torch's and hetccl's comm hooks) and FSDP2, shares uneven and with a 0: every
    replica equals the single-process run over the same global batches."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from hetccl.torch import hooks

    dist.init_process_group("hetccl")
    n = dist.get_world_size()
    _errors(n)
    ds = _data()
    want = _reference(ds, STEPS)
    uneven = [3, B - 3 - (n - 2)] + [1] * (n - 2)
    zero = [0, B - (n - 2)] + [1] * (n - 2)
    cases = [("ddp", uneven, None, 1e-5), ("ddp", zero, None, 1e-5),
             ("ddp", uneven, default_hooks.allreduce_hook, 1e-5), ("ddp", uneven, hooks.allreduce_hook, 1e-5),
             ("ddp", uneven, default_hooks.fp16_compress_hook, 5e-3),
             ("ddp", uneven, hooks.bf16_compress_hook, 3e-2),
             ("fsdp2", uneven, None, 1e-5), ("fsdp2", zero, None, 1e-5)]
    for kind, shares, hook, tol in cases:
        what = f"{kind} shares {shares} hook {getattr(hook, '__module__', '')}.{getattr(hook, '__name__', None)}"
        model = _model()
        if kind == "ddp":
            model = DDP(model)
            if hook is not None:
                model.register_comm_hook(None, hook)
        else:
            _shard(model)
        bal = balance.Balancer(B, shares).attach(model)
        losses = _train(model, bal, ds, STEPS)
        _close(_params(model), want, tol, what)
        assert len(set(losses)) == len(losses) and all(x == x for x in losses), (what, losses)
    # without the weighting, uneven shares are averaged per rank: far off (the check above can fail)
    model = DDP(_model())
    bal = balance.Balancer(B, uneven)
    bal.attached = True  # pretend: the sampler's guard is what stops this in real use
    _train(model, bal, ds, STEPS)
    try:
        _close(_params(model), want, 1e-3, "unweighted")
    except AssertionError:
        pass
    else:
        raise AssertionError("uneven shares without the weighting matched the reference: the check is blind")
    dist.destroy_process_group()


def _errors(n: int) -> None:
    """Bad shares, caps and use each raise a ConfigError that says what to do, on every rank."""
    for kw, match in [({"global_batch": B, "shares": [B] + [1] * (n - 1)}, "sum to"),
                      ({"global_batch": B, "shares": [B]}, f"{n} non-negative integers"),
                      ({"global_batch": B, "shares": ["x"] * n}, f"{n} non-negative integers"),
                      ({"global_batch": n - 1, "shares": "equal"}, "cannot give each"),
                      ({"global_batch": n - 1, "shares": "auto"}, "cannot give each"),
                      ({"global_batch": B, "shares": "fast"}, "'auto', 'equal'"),
                      ({"global_batch": B, "cap": 0}, "below 1"),
                      ({"global_batch": B, "cap": 1}, "hold fewer"),
                      ({"global_batch": B, "memory": "cuda"}, "a callable giving")]:
        try:
            balance.Balancer(**kw)
        except ConfigError as exc:
            assert match in str(exc), (kw, exc)
        else:
            raise AssertionError(f"no ConfigError for {kw}")
    bal = balance.Balancer(B, "equal")
    try:
        next(iter(balance.BatchSampler(_data(), bal)))
    except ConfigError as exc:
        assert "attach(model)" in str(exc), exc
    else:
        raise AssertionError("a sampler without the weighting was iterated")


def case_auto(kind: str, out: str) -> None:
    """auto shares on two ranks: rank 1 three times slower per sample (DDP: in its data loading; FSDP2: in its
    forward); at batch 40 rank 0 becomes five times slower. The shares follow, and the replicas still equal the
    single-process run. "ddp-memory": rank 0's memory gauge reads 1 MB + 10 KB per sample of the step's batch,
    of a memory that holds 36 samples within MEMORY_HEADROOM (what the balancer is told, as a GPU's allocator
    would tell it)."""
    dist.init_process_group("hetccl")
    r = dist.get_rank()
    batch = 64
    ds = _data(batch * 64)
    want = _reference(ds, 70, batch)
    # per-sample costs well above a loaded 2-core machine's sleep jitter (at 0.1 ms a sample, CI once fitted the
    # fast rank's cost at a third of its real one and gave it 58 of the 64 samples)
    slow = SlowPerSample(0.002, 0.0003 * (3 if r == 1 and kind == "fsdp2" else 1))
    model = torch.nn.Sequential(slow, *_model())
    seen = [0]  # the batch size of the last training forward (read by the gauge before the next one)
    model.register_forward_hook(lambda _, args, out: seen.__setitem__(0, len(args[0])))
    memory = None
    if kind == "ddp-memory" and r == 0:
        limit = (1e6 + 1e4 * 36.5) / balance.MEMORY_HEADROOM
        memory = lambda: (1e6 + 1e4 * seen[0], limit)  # noqa: E731
    if kind == "fsdp2":
        _shard(model)
    else:
        model = DDP(model)
    bal = balance.Balancer(batch, "auto", check_every=5, memory=memory).attach(model)

    def drift(k: int) -> None:
        if k == 40 and r == 0:
            slow.c = 0.0015

    _train(model, bal, SlowData(ds, 0.0006) if r == 1 and kind != "fsdp2" else ds, 70, slow=drift)
    _close(_params(model), want, 1e-5, f"auto {kind}")
    with open(f"{out}.{r}", "w") as f:
        json.dump({"history": bal.history, "shares": bal.shares}, f)
    dist.destroy_process_group()


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


def case_found_cap(out: str) -> None:
    """Rank 1's memory is limited for real (RLIMIT_AS, with MALLOC_MMAP_THRESHOLD_ fixed so that freed tensors
    give their address space back) to 40 MiB over what it uses after a first step (53 samples of this model's
    step, at about 0.75 MiB of activations a sample):
    balance.find_cap finds its cap by trying, through real out-of-memory errors of the CPU allocator, and the
    auto shares then keep it there while rank 0 takes the rest, where the equal split (64) runs out of memory.
    The replicas still equal the single-process run."""
    import resource

    torch.set_num_threads(1)  # no thread pool grows the address space under the limit
    dist.init_process_group("hetccl")
    r = dist.get_rank()
    batch, width = 128, 65536

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(batch * 4, 8, generator=g), torch.randn(batch * 4, 1, generator=g))
    # a small step: at LR (0.1) this wide model diverges (loss 1e25 by step 4), and one process alone then ends
    # 8e-5 apart from itself with the batch summed in two parts; at 1e-4 the loss stays near 1, summing in parts
    # moves the result by 1e-8, and a plain average instead of the weighted one by 9e-4 (2026-12-07)
    lr = 1e-4
    want = _reference(ds, 4, batch, make(), lr)
    model = DDP(make())  # its parameters broadcast: the group's threads and connections are up
    local = model.module

    def trial(b: int) -> None:
        torch.nn.functional.mse_loss(local(torch.randn(b, 8)), torch.randn(b, 1)).backward()

    cap, oom = batch, ""
    if r == 1:
        trial(8)  # the gradients' buffers are allocated once, before the limit
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + (40 << 20), resource.RLIM_INFINITY))
        try:
            trial(64)
        except RuntimeError as exc:
            oom = str(exc)
        assert "can't allocate memory" in oom, f"the equal share, 64 samples, ran within the limit ({oom!r})"
        cap = balance.find_cap(trial, batch)
        assert 16 <= cap < 64, cap
    bal = balance.Balancer(batch, "auto", cap=cap).attach(model)
    _train(model, bal, ds, 4, lr=lr)  # with rank 1's limit still on
    _close(_params(model), want, 1e-5, "found cap")
    with open(f"{out}.{r}", "w") as f:
        json.dump({"history": bal.history, "cap": cap}, f)
    dist.destroy_process_group()


def case_gpu_memory(out: str) -> None:
    """Rank 0 on the GPU, whose memory (torch.cuda.set_per_process_memory_fraction) holds about 450 samples of
    this model's step (measured alone first), beside rank 1 on the CPU, slowed: auto shares would give the
    GPU nearly the whole batch of 512, and keep it within its memory instead (the CUDA caching allocator's peak,
    balance.cuda_memory). No CUDA out-of-memory; the decision names the cap. TEST_HETCCL_ISLAND=nvidia-0,cpu-0.
    A ballast of 1 GiB stands for a real model's fixed memory: the 10 % that MEMORY_HEADROOM keeps back must hold
    the allocator's fragmentation, about one activation (28 MiB here); without it the limit was 180 MiB and the
    planned 446 samples ran out of memory with 28.6 MiB reserved but unallocated (H100, 2026-12-06)."""
    r = int(os.environ["RANK"])
    dev = torch.device("cuda", 0) if r == 0 else torch.device("cpu")
    cap = None
    batch, width = 512, 16384  # wide and shallow: the activations (about 128 KiB a sample) outweigh the weights

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        slow = SlowPerSample(0.001, 0.0002 if r == 1 else 0.0)  # the CPU rank made far slower per sample
        return torch.nn.Sequential(slow, torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)).to(dev)

    if r == 0:
        torch.cuda.set_device(dev)
        ballast = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # noqa: F841 (held to the end)
        alone, peaks = make(), []
        for b in (64, 256):
            torch.cuda.reset_peak_memory_stats(dev)
            alone(torch.randn(b, 64, device=dev)).square().mean().backward()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated(dev))
        m1 = (peaks[1] - peaks[0]) / 192
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction((peaks[0] + m1 * (450 - 64)) / balance.MEMORY_HEADROOM / total, dev)
        # the cap found by trying, through real CUDA out-of-memory errors (8x the batch, 512 MiB of activations,
        # cannot fit beside the ballast): the gauge, which keeps MEMORY_HEADROOM back, binds below it
        cap = balance.find_cap(lambda b: alone(torch.randn(b, 64, device=dev)).square().mean().backward(), 8 * batch)
        assert 450 <= cap < 8 * batch, cap
        del alone
        torch.cuda.empty_cache()
    dist.init_process_group("hetccl")
    model = DDP(make())
    bal = balance.Balancer(batch, "auto", check_every=5, cap=cap if r == 0 else None).attach(model)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(batch * 64, 64, generator=g), torch.randn(batch * 64, 1, generator=g))
    sampler = balance.BatchSampler(ds, bal, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=sampler.collate())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _, (x, y) in zip(range(45), loader, strict=False):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
    with open(f"{out}.{r}", "w") as f:
        json.dump({"history": bal.history}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[f"case_{sys.argv[1]}"](*sys.argv[2:])
