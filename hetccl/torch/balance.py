"""Uneven shares of each global batch, so that islands of different speed finish their steps together.

A synchronous job runs at its slowest rank's pace. Here rank i takes b_i samples of each global batch of B
(sum b_i = B), and the gradient every replica applies stays the global-batch mean, sum_i (b_i / B) g_i:

    from hetccl.torch import balance
    bal = balance.Balancer(global_batch=256)              # shares="auto" (measured), "equal", or [b_0, ...]
    sampler = balance.BatchSampler(dataset, bal, seed=0)  # in place of DistributedSampler + batch_size
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=sampler.collate())
    model = DDP(model)                                    # or fully_shard(model), or a plain module
    bal.attach(model)                                     # the gradient weighting (and the timing, for auto)
    for epoch in ...:
        sampler.set_epoch(epoch)
        for x, y in loader: ...                           # the loss code does not change

Weighting: `attach` scales the gradient that flows back into the model's outputs by w_i = b_i W / B, so the
average that DDP (any reducer or comm hook) or FSDP2 takes over W ranks is the global mean. A rank with a share of
0 runs its step on an empty batch, and so still takes part in every collective.

Auto shares: the first steps run the equal split, then a probe of uneven shares; each rank times its own part
of the step at both sizes (from the batch handed out, through the data's loading, the forward and the backward,
to the gradients' last wait: its waits for the other ranks left out, _StepTimer), fits cost = a_i + c_i b, and
rank 0 picks the integer shares that minimise the slowest rank's predicted step under each rank's cap (given,
or what its measured peak memory allows: `memory`), then broadcasts them. Every `check_every` steps it looks
again, and re-balances when a rank's step drifted by more than `drift`. The decisions happen in the sampler, at
the same batch on every rank, so they need the sampler to be iterated in the training loop's order (DataLoader
workers and prefetching are fine).
"""

from __future__ import annotations

import gc
import heapq
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only
from torch.utils.data import Sampler, default_collate

from hetccl import observe
from hetccl.errors import ConfigError

log = logging.getLogger("hetccl.balance")

# the per-rank statistics that auto mode gathers at each decision: a, c, ready, recent time, recent share,
# recent count, noise (the standard error of its medians, relative)
# what a decision of rank 0 is, as its reason starts (broadcast with the shares: every rank logs the same kind)
_KINDS = ("calibrated", "drift", "refined")


def solve(costs: Sequence[tuple[float, float]], total: int, caps: Sequence[int] | None = None) -> list[int]:
    """Integer shares summing to `total` that minimise max_i (a_i + c_i b_i) with 0 <= b_i <= cap_i: one
    sample at a time to the rank that would finish it first (optimal for costs that grow with b)."""
    n = len(costs)
    caps = list(caps) if caps is not None else [total] * n
    if sum(min(c, total) for c in caps) < total:
        raise ConfigError(f"balance: the ranks' caps {list(caps)} hold fewer than the global batch of {total} "
                          "samples; raise the caps or lower global_batch")
    shares = [0] * n
    heap = [(a + c, i) for i, (a, c) in enumerate(costs) if caps[i] > 0]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        if shares[i] < caps[i]:
            a, c = costs[i]
            heapq.heappush(heap, (a + c * (shares[i] + 1), i))
    return shares


def _equal(total: int, n: int) -> list[int]:
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def _scaled(shares: Sequence[int], total: int) -> list[int]:
    """Shares of a shorter last batch (drop_last=False): proportional, largest remainders first."""
    whole = sum(shares)
    exact = [s * total / whole for s in shares]
    out = [int(e) for e in exact]
    for i in sorted(range(len(shares)), key=lambda i: out[i] - exact[i])[:total - sum(out)]:
        out[i] += 1
    return out


def _by_size(records: Sequence[tuple[int, float]]) -> dict[int, list[float]]:
    """The timed (batch size, seconds) records, grouped by batch size."""
    by_size: dict[int, list[float]] = {}
    for b, t in records:
        by_size.setdefault(b, []).append(t)
    return by_size


def _steps(size: int, global_batch: int, drop_last: bool) -> int:
    """Global batches in an epoch of `size` samples."""
    return size // global_batch if drop_last else -(-size // global_batch)


def _noise(records: Sequence[tuple[int, float]]) -> float:
    """The relative standard error of the median time at each batch size (the largest): 1.25 sigma / sqrt(n),
    sigma from the median absolute deviation. What a measured difference between steps must exceed."""
    worst = 0.0
    for ts in _by_size(records).values():
        med = statistics.median(ts)
        if len(ts) >= 2 and med > 0:
            mad = statistics.median(abs(t - med) for t in ts)
            worst = max(worst, 1.25 * 1.4826 * mad / med / len(ts) ** 0.5)
    return worst


def _fit(records: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """cost = a + c b by least squares over the median time at each batch size; None under two sizes."""
    pts = [(b, statistics.median(ts)) for b, ts in _by_size(records).items() if b > 0]
    if len(pts) < 2:
        return None
    mb = sum(b for b, _ in pts) / len(pts)
    mt = sum(t for _, t in pts) / len(pts)
    var = sum((b - mb) ** 2 for b, _ in pts)
    c = sum((b - mb) * (t - mt) for b, t in pts) / var
    if c <= 0:  # noise larger than the size's effect: a per-sample cost without a fixed part
        return 0.0, max(1e-12, sum(t for _, t in pts) / sum(b for b, _ in pts))
    return max(0.0, mt - c * mb), c


def _memory_fit(records: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """peak = m0 + m1 b, as _fit; a peak that does not grow with the batch (the optimizer's step, say, sets it)
    is m1 = 0, which caps nothing (not _fit's per-sample cost without a fixed part)."""
    pts = sorted((b, statistics.median(ts)) for b, ts in _by_size(records).items() if b > 0)
    if len(pts) < 2:
        return None
    if pts[-1][1] <= pts[0][1]:
        return max(p for _, p in pts), 0.0
    return _fit(records)


class _Step:
    """One training step's stamps (floats on the CPU, CUDA events on the GPU)."""

    __slots__ = ("size", "data", "forward", "backward", "marked")

    def __init__(self, data: tuple[Any, Any] | None, forward: list[tuple[Any, Any]]):
        self.size = 0
        self.data, self.forward = data, forward
        self.backward: tuple[Any, Any] | None = None
        self.marked = False  # the backward's end is awaited

    def last(self) -> Any:
        """The step's last stamp (a handed-on step has a forward)."""
        return (self.backward or self.forward[-1])[1]


class _StepTimer:
    """This rank's own part of each training step, without its waits for the other ranks: from the moment the
    sampler hands out the batch (the data's gather, collation and copy in) through the forward to the end of
    the backward's compute, before the gradients' last wait (an autograd callback queued at the backward's
    start runs before the one of DDP's finalize). Wall time on the CPU; CUDA events on the GPU, so that a rank
    whose stream waited for a peer (the previous step's collectives) counts only what its stream then still had
    to do, and a host-bound rank (launches, the data's gather) counts the time its GPU waited for the host.
    Left out: the data's time where the loader prefetches (more than one batch handed out ahead of the forward:
    workers load it meanwhile), and FSDP2's all_gather waits in the forward (segments around each fully_shard
    module's own hooks). With FSDP2 the backward, which waits for all_gathers too, counts as twice the forward.
    Hands on (batch size, seconds) per training step; `size()` says the size when the forward ends."""

    BACKWARD_PER_FORWARD = 2.0  # where the backward is not timed (FSDP2, or none ran): twice the forward

    def __init__(self, root: torch.nn.Module, size: Callable[[], int], on_done: Callable[[int, float], None]):
        self.size, self.on_done = size, on_done
        self.cuda = any(p.is_cuda for p in root.parameters())
        self.active = False  # a training forward of root is running
        self.depth = 0
        self.open: Any = None  # the start of the running forward segment
        self.step: _Step | None = None  # the step being timed
        self.handed: deque[Any] = deque()  # a stamp per batch the sampler handed out, not yet trained on
        self.pending: deque[_Step] = deque()  # CUDA: read once their events are done
        self.stream: Any = None  # the forward's stream (CUDA): every stamp of a step on it
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            FSDPModule = ()  # noqa: N806
        inner = [m for m in root.modules() if m is not root and isinstance(m, FSDPModule)]
        self.time_backward = not inner and not isinstance(root, FSDPModule)
        for m in [root, *inner]:
            # a prepended hook runs before FSDP2's (which is prepended too, earlier), an appended one after it
            m.register_forward_pre_hook(self._pause, prepend=True)
            m.register_forward_pre_hook(self._enter if m is root else self._resume)
            m.register_forward_hook(self._pause, prepend=True)
            m.register_forward_hook(self._leave if m is root else self._resume)

    def _stamp(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            return ev
        return time.perf_counter()

    def handed_out(self) -> None:
        """The sampler handed out a batch (on the training loop's thread, where the loader has no workers)."""
        if self.cuda:
            self.stream = torch.cuda.current_stream()
        self.handed.append(self._stamp())

    def _enter(self, module: torch.nn.Module, *_: Any) -> None:
        self.depth += 1
        if self.depth == 1 and module.training and torch.is_grad_enabled():
            self._finish()  # the last step, if its backward never ran
            if self.cuda:
                self.stream = torch.cuda.current_stream()
            self.active, self.open = True, self._stamp()
            # one batch handed out and not trained on is this one, loaded since; more were prefetched
            handed = self.handed.popleft() if len(self.handed) == 1 else None
            if self.handed:
                self.handed.popleft()
            self.step = _Step(None if handed is None else (handed, self.open), [])

    def _pause(self, *_: Any) -> None:
        if self.open is not None and self.step is not None:
            self.step.forward.append((self.open, self._stamp()))
            self.open = None

    def _resume(self, *_: Any) -> None:
        if self.active and self.open is None:
            self.open = self._stamp()

    def _leave(self, *_: Any) -> None:
        self.depth -= 1
        if self.depth or not self.active:
            return
        self._pause()
        self.active = False
        assert self.step is not None
        self.step.size = self.size()
        if not self.time_backward:
            self._finish()

    def backward_started(self) -> None:
        """The loss's gradient reached the model's outputs (_OutputGrad): stamp the backward's end."""
        if self.time_backward and self.step is not None and not self.step.marked and not self.active:
            self.step.marked = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        step = self.step
        if step is not None and step.marked and step.forward:
            step.backward = (step.forward[-1][1], self._stamp())
            self._finish()

    def _finish(self) -> None:
        """Hand the step on (CUDA: once its events are done)."""
        step, self.step = self.step, None
        if step is None or not step.forward:
            return
        if self.cuda:
            self.pending.append(step)
        else:
            self.on_done(step.size, self._seconds(step))

    def _seconds(self, step: _Step) -> float:
        def span(seg: tuple[Any, Any]) -> float:
            return seg[0].elapsed_time(seg[1]) / 1e3 if self.cuda else seg[1] - seg[0]

        forward = sum(span(s) for s in step.forward)
        backward = span(step.backward) if step.backward else self.BACKWARD_PER_FORWARD * forward
        return (span(step.data) if step.data else 0.0) + forward + backward

    def collect(self) -> None:
        """CUDA: hand on the steps whose events have completed."""
        while self.pending and self.pending[0].last().query():
            step = self.pending.popleft()
            self.on_done(step.size, self._seconds(step))


class _OutputGrad(torch.autograd.Function):
    """Identity forward on a model output; its backward, the first node the loss's gradient reaches, scales the
    gradient by w (w = 0: zeros, even where the gradient is NaN, as the loss of an empty batch makes it) and,
    with a timer, tells it that the backward runs (the timer then queues a callback for the backward's end)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: float, timer: _StepTimer | None) -> torch.Tensor:  # type: ignore[override]
        ctx.w, ctx.timer = w, timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.timer is not None:
            ctx.timer.backward_started()
        if ctx.w == 1.0:
            return g, None, None
        return (g * ctx.w if ctx.w else torch.zeros_like(g)), None, None


# of a rank's memory, what auto shares may plan to use. The rest is the allocator's slack: the peak fitted is of
# the bytes handed out, and the caching allocator's segments hold more (28.6 MiB reserved but unallocated, about one
# activation, ended a plan of 162 MiB in a 180 MiB limit on an H100, 2026-12-06)
MEMORY_HEADROOM = 0.9


def cuda_memory(root: torch.nn.Module) -> Callable[[], tuple[float, float]] | None:
    """Auto mode's memory gauge for a model on a CUDA device (None elsewhere): each call gives the peak bytes the
    caching allocator handed out since the last call (then starts a new window) and the bytes it may hold (the
    device's total, times the process's memory fraction where one is set)."""
    dev = next((p.device for p in root.parameters() if p.is_cuda), None)
    if dev is None:
        return None
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # not in every torch

    def gauge() -> tuple[float, float]:
        peak = torch.cuda.max_memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        total = torch.cuda.get_device_properties(dev).total_memory
        return float(peak), float(total * (fraction(dev) if fraction is not None else 1.0))
    return gauge


class Balancer:
    """This rank's share of each global batch, and the gradient weighting that keeps the average exact.

    shares: "auto" (measured and re-balanced), "equal", or a list of W integers summing to global_batch.
    cap: the most samples this rank may take per step (auto mode; each rank passes its own).
    memory: auto mode's gauge of this rank's memory, a callable giving (the peak bytes since its last call, the
    bytes this rank may use); it is read before each training forward, the peak fitted as m0 + m1 b, and the
    rank's cap lowered to what fits in MEMORY_HEADROOM of its memory. "auto": the CUDA caching allocator's
    peak for a model on a GPU (cuda_memory), none elsewhere; None: no gauge. Before the gauge has seen two batch
    sizes, the calibration's probe (a third more for some ranks) grows a rank only as far as its peak, scaled in
    proportion to the batch, fits.
    group: the process group (default WORLD); without torch.distributed initialised, one rank."""

    def __init__(self, global_batch: int, shares: str | Sequence[int] = "auto", *, group: Any = None,
                 cap: int | None = None, warmup: int = 3, calibrate_steps: int = 8, check_every: int = 10,
                 drift: float = 0.15, memory: Callable[[], tuple[float, float]] | str | None = "auto"):
        self.group = group
        if not (memory is None or memory == "auto" or callable(memory)):
            raise ConfigError(f"balance: memory must be 'auto', None or a callable giving (peak bytes, bytes this "
                              f"rank may use) (got {memory!r})")
        self.memory = memory  # auto mode's gauge of this rank's memory (resolved by attach: cuda_memory)
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ConfigError(f"balance: global_batch must be a positive integer (got {global_batch!r})")
        self.global_batch = global_batch
        if cap is not None and cap < 0:
            raise ConfigError(f"balance: cap must be >= 0 (got {cap}); 0 gives this rank no samples")
        self.cap = global_batch if cap is None else min(cap, global_batch)
        self.warmup, self.calibrate_steps = warmup, max(1, calibrate_steps)
        self.check_every, self.drift = max(1, check_every), drift
        if isinstance(shares, str):
            if shares not in ("auto", "equal"):
                raise ConfigError(f"balance: shares must be 'auto', 'equal' or a list of {self.world} integers "
                                  f"(got {shares!r})")
            self.mode = shares
            if global_batch < self.world:
                raise ConfigError(f"balance: a global batch of {global_batch} cannot give each of the {self.world} "
                                  f"ranks a sample with shares={shares!r}; raise global_batch to at least "
                                  f"{self.world} or give the shares as a list (0 for the ranks left out)")
            self.shares = _equal(global_batch, self.world)
        else:
            self.mode = "fixed"
            self.shares = self._check_list(shares)
        self.step = 0  # batches handed out so far (every epoch)
        self.history: list[tuple[int, list[int], str]] = []
        self.attached = False
        self._issued: deque[tuple[int, int]] = deque()  # (this rank's share, batch total), consumed by forward
        self._records: deque[tuple[int, float]] = deque(maxlen=8 * self.check_every + 16)
        self._peaks: deque[tuple[int, float]] = deque(maxlen=8 * self.check_every + 16)  # (share, peak bytes)
        self._memory_limit = 0.0  # bytes this rank may use (its gauge's last reading; 0: no gauge)
        self._gauged = 0  # readings of the memory gauge (one before each training forward)
        self._recent: deque[tuple[int, float]] = deque(maxlen=max(3, self.check_every // 2))
        self._model: list[tuple[float, float]] | None = None  # rank 0: each rank's (a, c)
        self._calibrated = False
        self._last_check = 0
        self.caps = [self.cap] * self.world
        # rank 0: the lowest cap each rank's memory fit has set; kept, for a later fit may miss it (once a rank
        # sits at its cap, its peaks window holds one batch size only) or creep above it (a refit on peaks at
        # the cap itself, a few per cent over each time)
        self._memory_held: dict[int, tuple[int, str]] = {}
        self._before_probe = list(self.shares)
        self._timer: _StepTimer | None = None
        self._seen = 0  # forwards timed (the first `warmup` are not recorded)
        self._last = (self.shares[self.rank], global_batch)  # (share, batch total) of the last training forward
        if self.mode == "auto":
            self._check_caps_now()
        capped = self.mode == "auto" and self.shares != _equal(global_batch, self.world)
        self._decided(self.shares, "initial " + self.mode + (" split" if self.mode != "fixed" else " shares")
                      + (f" within the ranks' caps {self.caps}" if capped else ""))

    # ---- checks ------------------------------------------------------------------------------------------
    def _check_list(self, shares: Sequence[int]) -> list[int]:
        try:
            out = [int(s) for s in shares]
        except (TypeError, ValueError):
            out = []
        if len(out) != self.world or any(s < 0 or s != v for s, v in zip(out, shares, strict=True)):
            raise ConfigError(f"balance: shares must be {self.world} non-negative integers, one per rank "
                              f"(got {list(shares)})")
        if sum(out) != self.global_batch:
            raise ConfigError(f"balance: the shares {out} sum to {sum(out)}, not to the global batch of "
                              f"{self.global_batch}; make them add up, or pass shares='auto'")
        return out

    def _check_caps_now(self) -> None:
        caps = [int(v) for v in self._gather([float(self.cap)])[:, 0].tolist()]
        if max(caps) < 1:
            raise ConfigError(f"balance: every rank's cap is below 1 ({caps}): no rank may take a sample; give "
                              "at least one rank cap >= 1")
        if sum(caps) < self.global_batch:
            raise ConfigError(f"balance: the ranks' caps {caps} hold fewer than the global batch of "
                              f"{self.global_batch} samples; raise the caps or lower global_batch")
        self.caps = caps
        if any(s > c for s, c in zip(self.shares, caps, strict=True)):
            self.shares = solve([(0.0, 1.0)] * self.world, self.global_batch, caps)

    # ---- collectives of auto mode (a few per decision, none in between) ----------------------------------
    def _device(self) -> torch.device:
        if self.world > 1 and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather(self, row: list[float]) -> torch.Tensor:
        mine = torch.tensor(row, dtype=torch.float64, device=self._device())
        if self.world == 1:
            return mine.reshape(1, -1).cpu()
        out = torch.empty(self.world * len(row), dtype=torch.float64, device=mine.device)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine, group=self.group)
        return out.reshape(self.world, -1).cpu()

    def _broadcast(self, shares: list[int]) -> list[int]:
        if self.world == 1:
            return shares
        t = torch.tensor(shares, dtype=torch.int64, device=self._device())
        dist.broadcast(t, dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return [int(v) for v in t.tolist()]

    # ---- the plan, batch by batch ------------------------------------------------------------------------
    def next_shares(self, total: int | None = None) -> list[int]:
        """The shares of the next global batch (of `total` samples, the global batch unless the last one is
        short): called by BatchSampler once per batch, on every rank in the same order."""
        total = self.global_batch if total is None else total
        k = self.step
        self.step += 1
        if self.mode == "auto":
            self._plan(k)
        shares = self.shares if total == self.global_batch else _scaled(self.shares, total)
        self._issued.append((shares[self.rank], total))
        return shares

    def _plan(self, k: int) -> None:
        probe_at = self.warmup + self.calibrate_steps
        if k == probe_at and not self._calibrated:
            self._before_probe = list(self.shares)
            probe = self._probe(self._probe_caps())
            if probe != self.shares:
                self._decided(probe, "calibration: uneven shares to time a second batch size")
        if (k >= 2 * probe_at and not self._calibrated) or (self._calibrated and k - self._last_check
                                                           >= self.check_every):
            self._decide(k)

    def _probe_caps(self) -> list[int]:
        """Every rank: the caps of the calibration's probe. A rank whose memory gauge has seen one batch size
        only, b0 at a peak p0, may grow to what fits in MEMORY_HEADROOM of its memory if the peak grows as
        b p0 / b0 (a peak m0 + m1 b with m0 >= 0 grows no faster), so that the probe's larger batch does not run
        it out of memory before the fit has two sizes."""
        b0 = self.shares[self.rank]
        seen = [p for b, p in self._peaks if b == b0]
        row = [float(b0), max(seen) if seen else 0.0, self._memory_limit]
        caps = list(self.caps)
        for i, (b, peak, limit) in enumerate(self._gather(row).tolist()):
            if b >= 1 and peak > 0 and limit > 0:
                caps[i] = min(caps[i], max(int(b), int(MEMORY_HEADROOM * limit * b / peak)))
        return caps

    def _probe(self, caps: list[int]) -> list[int]:
        """Shares a third off the current ones, alternately up and down (the sum unchanged), within the caps: in
        each pair of ranks the first goes up, or down where its cap holds it."""
        out = list(self.shares)
        for i in range(0, self.world - 1, 2):
            lo, hi = (i, i + 1) if caps[i] > out[i] else (i + 1, i)  # lo gives, hi takes
            d = min(max(1, out[hi] // 3), out[lo], caps[hi] - out[hi])
            if d > 0:
                out[hi], out[lo] = out[hi] + d, out[lo] - d
        return out

    def _decide(self, k: int) -> None:
        """Every rank: send its fit and recent step time; rank 0 chooses; its choice is broadcast."""
        if self._timer is not None:
            self._timer.collect()
        fit = _fit(list(self._records))
        recent = [(b, t) for b, t in self._recent if b == self._recent[-1][0]]
        rt = statistics.median(t for _, t in recent) if recent else 0.0
        rb = recent[-1][0] if recent else 0
        noise = _noise(recent if self._calibrated else list(self._records))
        mem = _memory_fit(list(self._peaks)) if self._memory_limit > 0 else None
        row = [fit[0] if fit else 0.0, fit[1] if fit else 0.0, 1.0 if fit else 0.0, rt, float(rb),
               float(len(recent)), noise, mem[0] if mem else 0.0, mem[1] if mem else 0.0, self._memory_limit]
        stats = self._gather(row)
        new, reason = self._choose(k, stats.tolist()) if self.rank == 0 else (None, "")
        kind = 0 if new is None else 1 + _KINDS.index(reason.split(":")[0])
        got = self._broadcast((new or self.shares) + [kind])
        self._last_check = k
        if got[-1]:
            self._calibrated = True
            self._recent.clear()
            if got[:-1] != self.shares:
                self._decided(got[:-1], reason or f"{_KINDS[got[-1] - 1]}: chosen by rank 0")

    def _choose(self, k: int, rows: list[list[float]]) -> tuple[list[int] | None, str]:
        """Rank 0: the new shares (None: keep them) and why."""
        caps, held = self._memory_caps(rows)
        # a change must promise a step shorter by more than the noise of the timings (twice their largest
        # standard error), by drift/3 at least; a gain of 2 drift is always taken (a few noisy steps must not
        # hide a rank several times slower)
        gain = min(2 * self.drift, max(self.drift / 3, 2 * max(r[6] for r in rows)))
        if not self._calibrated:
            late = k > 2 * (self.warmup + self.calibrate_steps) + 4 * self.check_every
            if not late and not all(r[2] for r, cap in zip(rows, caps, strict=True) if cap >= 1):
                return None, ""  # a rank has not timed two batch sizes yet: ask again next batch
            # a rank that never timed two sizes (shares of 1, or a cap): its per-sample cost alone
            self._model = [(r[0], r[1]) if r[2] else (0.0, r[3] / r[4] if r[4] else 1.0) for r in rows]
            shares = solve(self._model, self.global_batch, caps)
            base = self._before_probe
            if all(b <= c for b, c in zip(base, caps, strict=True)) and \
                    self._worst(shares) > (1 - gain) * self._worst(base):
                return base, "calibrated: the ranks' steps are within the noise of each other; " + \
                    self._describe(base) + held
            return shares, "calibrated: " + self._describe(shares) + held
        assert self._model is not None
        # each rank's measured step at its current share corrects its cost (the fixed part stays): a drift, or
        # the calibration's error. A change of more than half is taken whole (a rank really slowed down); a
        # smaller one half-way, so that the step-to-step noise of a busy machine does not walk the shares.
        drifted, measured = [], []
        for i, (_, _, _, rt, rb, rn, *_) in enumerate(rows):
            a, c = self._model[i]
            pred = a + c * rb
            if rn < 3 or rb < 1 or pred <= 0:
                measured.append(pred)
                continue
            measured.append(rt)
            if abs(rt / pred - 1) > self.drift:
                drifted.append(f"rank {i}'s step went from {pred * 1e3:.1f} to {rt * 1e3:.1f} ms at {int(rb)} "
                               "samples")
            seen = (a, (rt - a) / rb) if rt > a else (0.0, rt / rb)
            keep = 0.0 if abs(rt / pred - 1) > 0.5 else 0.5
            self._model[i] = (keep * a + (1 - keep) * seen[0], keep * c + (1 - keep) * seen[1])
        shares = solve(self._model, self.global_batch, caps)
        over = any(s > c for s, c in zip(self.shares, caps, strict=True))  # a memory cap the shares now pass
        if not over and (shares == self.shares or self._worst(shares) > (1 - gain) * self._worst(self.shares)):
            return None, ""  # not worth a change: within the noise of a step
        why = "drift: " + "; ".join(drifted) if drifted else \
            "refined: measured steps " + ", ".join(f"{t * 1e3:.1f}" for t in measured) + " ms"
        return shares, why + "; " + self._describe(shares) + held

    def _memory_caps(self, rows: list[list[float]]) -> tuple[list[int], str]:
        """The ranks' caps (given), lowered where a rank's measured peak memory, fitted as m0 + m1 b, would pass
        MEMORY_HEADROOM of what it may use, or where an earlier fit did (_memory_held: a memory cap never rises);
        and what that held back, for the decision's reason."""
        caps = list(self.caps)
        for i, r in enumerate(rows):
            m0, m1, limit = r[7], r[8], r[9]
            if limit > 0 and m1 > 0:
                fits = max(0, int((MEMORY_HEADROOM * limit - m0) // m1))
                if fits < self._memory_held.get(i, (caps[i], ""))[0]:
                    self._memory_held[i] = (fits, f"rank {i} at most {fits} samples ({m0 / 2**20:.0f} MiB + "
                                                  f"{m1 / 2**10:.1f} KiB/sample of {limit / 2**20:.0f} MiB)")
        held = []
        for i, (fits, why) in sorted(self._memory_held.items()):
            if fits < caps[i]:
                caps[i] = fits
                held.append(why)
        if sum(caps) < self.global_batch:
            log.warning("balance: the ranks' memory holds %d samples of the global batch of %d (%s); the shares "
                        "keep to the given caps", sum(caps), self.global_batch, "; ".join(held))
            return list(self.caps), ""
        return caps, "; memory: " + "; ".join(held) if held else ""

    def _worst(self, shares: list[int]) -> float:
        """The slowest rank's predicted step under shares."""
        assert self._model is not None
        return max(a + c * b for (a, c), b in zip(self._model, shares, strict=True))

    def _describe(self, shares: list[int]) -> str:
        assert self._model is not None
        per = ", ".join(f"rank {i} {a * 1e3:.2f} ms + {c * 1e6:.1f} us/sample"
                        for i, (a, c) in enumerate(self._model))
        return f"{per}; predicted step {self._worst(shares) * 1e3:.1f} ms"

    def _decided(self, shares: list[int], reason: str) -> None:
        self.shares = list(shares)
        self.history.append((self.step, list(shares), reason))
        if self.rank == 0:
            log.info("balance: from batch %d the shares are %s (%s)", self.step, shares, reason)
        observe.balance_shares(self.rank, self.shares, reason)

    # ---- the model side ----------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> Balancer:
        """Weight the gradients of `model` (a DDP module, a fully_shard module or a plain one) by this rank's
        share, and time its steps for auto mode. One training forward per batch of the sampler."""
        if self.attached:
            raise ConfigError("balance: attach() was called twice; the gradients would be weighted twice")
        root = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        root.register_forward_hook(self._weigh)  # before the timer's last hook: the size is known when it ends
        if self.mode == "auto":
            self._timer = _StepTimer(root, lambda: self._last[0], self._record)
            if self.memory == "auto":
                self.memory = cuda_memory(root)
            if self.memory is not None:
                root.register_forward_pre_hook(self._gauge)
        self.attached = True
        return self

    def _record(self, b: int, seconds: float) -> None:
        self._seen += 1
        if self._seen > self.warmup:
            self._records.append((b, seconds))
            self._recent.append((b, seconds))

    def _gauge(self, module: torch.nn.Module, args: Any) -> None:
        """Before each training forward: the peak memory of the step before it (its forward, backward and
        optimizer step), recorded against that step's share."""
        if not (module.training and torch.is_grad_enabled()):
            return
        peak, self._memory_limit = self.memory()  # type: ignore[misc,operator]
        # counted here, not by the timings (_seen): on the GPU those are read only when the shares are decided
        self._gauged += 1
        if self._gauged > self.warmup + 1:  # the first reading follows no step; the warm-up steps' are not kept
            self._peaks.append((self._last[0], float(peak)))

    def _weigh(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return None
        self._last = self._issued.popleft() if self._issued else (self.shares[self.rank], self.global_batch)
        b, total = self._last
        w = b * self.world / total
        timer = self._timer if self._timer is not None and self._timer.time_backward else None
        if w == 1.0 and timer is None:
            return None

        return tree_map_only(torch.Tensor, lambda t: _OutputGrad.apply(t, w, timer)
                             if t.requires_grad and t.is_floating_point() else t, output)

    def mean(self, value: torch.Tensor | float) -> torch.Tensor:
        """The global-batch mean of a per-rank mean (a loss, an accuracy) of the batch this rank last trained
        on: sum_i b_i value_i / B, the same on every rank (a rank with a share of 0 counts for nothing)."""
        b, total = self._last
        t = torch.as_tensor(value).detach().to(torch.float64).reshape(())
        out = (t * b if b else torch.zeros((), dtype=torch.float64)).to(self._device())
        if self.world > 1:
            dist.all_reduce(out, group=self.group)
        return out.cpu() / total

    def require_weighting(self) -> None:
        if not self.attached:
            raise ConfigError("balance: the sampler hands out uneven shares, but no model's gradients are weighted "
                              "by them, so DDP / FSDP2 would average them wrongly; call balancer.attach(model) "
                              "before iterating the sampler")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether exc is an allocator's out-of-memory: CUDA's (torch.OutOfMemoryError, ROCm's too) or the CPU
    allocator's (a RuntimeError that says it cannot allocate)."""
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return isinstance(exc, (oom, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc)))


def find_cap(trial: Callable[[int], Any], upper: int, *, lower: int = 1) -> int:
    """This rank's cap found by trying, for Balancer(cap=...): the largest batch size in [lower, upper] at which
    `trial(b)` ran without running out of memory, or lower - 1 if none did (0: the rank takes no samples).

    trial(b) runs what one training step of b samples allocates on this rank alone, without collectives: the
    forward and backward of the module before DDP wraps it (and its optimizer's step, whose states take memory
    from the first step on). Each rank calls it before training, so an out-of-memory lowers the cap instead of
    ending the job; inside the wrapped step it could not (DDP's or FSDP2's collectives would be half issued on
    that rank). It tries `upper` first, then bisects: about log2(upper) trials where the upper one does not fit.
    Gradients the trials leave are the caller's to clear (`model.zero_grad(set_to_none=True)`)."""
    if not 1 <= lower <= upper:
        raise ConfigError(f"balance.find_cap: need 1 <= lower <= upper (got lower={lower}, upper={upper})")
    fits, fails = lower - 1, upper + 1  # the largest size known to run, the smallest known not to
    b = upper
    while fits + 1 < fails:
        failed = False
        try:
            trial(b)
        except Exception as exc:
            if not _out_of_memory(exc):
                raise
            failed = True  # released below, out of the handler: its traceback holds the trial's tensors
        if failed:
            fails = b
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        else:
            fits = b
        log.debug("balance.find_cap: %d samples %s", b, "ran out of memory" if failed else "fit")
        b = (fits + fails) // 2
    log.info("balance.find_cap: this rank's cap is %d samples (%s)", fits,
             f"{fails} ran out of memory" if fails <= upper else "the upper bound fit")
    return fits


def global_batches(size: int, global_batch: int, seed: int, shuffle: bool = True, drop_last: bool = True
                   ) -> Iterator[list[int]]:
    """An epoch's global batches of a data set of `size` samples, as BatchSampler cuts them (its seed plus the
    epoch): what a single process trains on, for a reference run."""
    idx = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist() if shuffle else \
        list(range(size))
    for k in range(_steps(size, global_batch, drop_last)):
        yield idx[k * global_batch:(k + 1) * global_batch]


class BatchSampler(Sampler[list[int]]):
    """Each step's global batch of the data set (the same one a single process with this seed draws: a
    permutation seeded by seed + epoch, cut into batches of global_batch), and this rank's slice of it. Use it as
    a DataLoader's batch_sampler, with `collate()` as its collate_fn (it keeps empty batches well formed)."""

    def __init__(self, data: Any, balancer: Balancer, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        self.data = data
        self.size = data if isinstance(data, int) else len(data)
        self.balancer, self.shuffle, self.seed, self.drop_last = balancer, shuffle, seed, drop_last
        self.epoch = 0
        if self.size < balancer.global_batch and drop_last:
            raise ConfigError(f"balance: the data set has {self.size} samples, fewer than one global batch of "
                              f"{balancer.global_batch}; lower global_batch or pass drop_last=False")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return _steps(self.size, self.balancer.global_batch, self.drop_last)

    def global_batches(self) -> Iterator[list[int]]:
        """The epoch's global batches, whole (what a single process trains on)."""
        return global_batches(self.size, self.balancer.global_batch, self.seed + self.epoch, self.shuffle,
                              self.drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        bal = self.balancer
        bal.require_weighting()
        bal._issued.clear()  # batches handed out by an iterator abandoned mid-epoch (a break, prefetching) never ran
        for batch in self.global_batches():
            shares = bal.next_shares(len(batch))
            lo = sum(shares[:bal.rank])
            if bal._timer is not None:  # after next_shares: a decision's collectives are not this batch's time
                bal._timer.handed_out()
            yield batch[lo:lo + shares[bal.rank]]

    def collate(self, inner: Callable[[list[Any]], Any] = default_collate) -> Callable[[list[Any]], Any]:
        """`inner` (default_collate), except that an empty batch (a share of 0) comes out as the collation of
        one sample cut to length 0, so the model still runs its step."""
        data = self.data

        def collate(samples: list[Any]) -> Any:
            if samples:
                return inner(samples)
            if isinstance(data, int):
                raise ConfigError("balance: an empty batch needs the data set itself: pass it to BatchSampler")
            return tree_map_only(torch.Tensor, lambda t: t[:0], inner([data[0]]))

        return collate


def lightning_callback(global_batch: int, shares: str | Sequence[int] = "auto", **kwargs: Any) -> Any:
    """A PyTorch Lightning Callback that makes a Balancer once the process group is up (`callback.balancer`,
    for the BatchSampler of `train_dataloader`) and attaches it to the strategy's wrapped module, whose forward
    is `training_step`: the loss it returns carries the weighting, and its time the compute. Pass
    `use_distributed_sampler=False` to the Trainer, so that Lightning leaves the batch sampler alone:

        cb = balance.lightning_callback(256)
        class Model(pl.LightningModule):
            def train_dataloader(self):
                s = balance.BatchSampler(ds, cb.balancer, seed=0)
                return DataLoader(ds, batch_sampler=s, collate_fn=s.collate())
        pl.Trainer(callbacks=[cb], use_distributed_sampler=False, strategy="ddp", ...).fit(Model())
    """
    try:
        import lightning.pytorch as pl
    except ImportError:  # the standalone package
        import pytorch_lightning as pl

    class BalanceCallback(pl.Callback):
        def __init__(self) -> None:
            self.balancer: Balancer | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage == "fit" and self.balancer is None:
                self.balancer = Balancer(global_batch, shares, **kwargs)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            assert self.balancer is not None
            model = trainer.strategy.model  # DDP(wrapper of the LightningModule) once the strategy set it up
            if model is None or model is pl_module:
                raise ConfigError("balance: the Lightning strategy has not wrapped the module (no DDP); use "
                                  "strategy='ddp' (or DDPStrategy) with the balance callback")
            self.balancer.attach(model)

    return BalanceCallback()
