"""FSDP2 and DDP step time, collective times, host-held time and overlap: hetccl against NCCL, side by side in one run,
two ranks on ONE GPU (torchrun, every GPU visible, rank i on GPU i % device_count).

    python benchmarks/fsdp_step.py --out fsdp-h200.md --json fsdp-h200.json            # the GPU machine, ~3-5 min
    python benchmarks/fsdp_step.py --quick --out /tmp/fsdp-quick.md                    # GPU smoke test, ~2 min
    .venv/bin/python benchmarks/fsdp_step.py --device cpu --quick --out /tmp/fsdp_cpu.md  # CPU smoke test

Each variant is one `torchrun --standalone --nproc-per-node 2` job (environment: SAFE below plus the variant's):

- "nccl hosts" (nccl): `NCCL_HOSTID=h<local rank>` (set by the worker before init) makes the ranks two hosts to
  NCCL, so it lets them share a GPU and joins them through its network transport; `NCCL_P2P_DISABLE=1
  NCCL_SHM_DISABLE=1` too (the report names the network NCCL chose, from its INFO lines);
- "hetccl hosts" (hetccl): islands nvidia-0 / nvidia-1 and `HETCCL_HOST=h0,h1`: each rank its own host (TCP, or
  verbs where an RDMA device is active);
- "hetccl link" (hetccl): islands nvidia-0 / nvidia-1 on one host: hetccl's zero-copy link between islands.
- "hetccl hosts late": hosts with `HETCCL_TORCH_EARLY_COPIES=0` (copies out behind the collectives before them);
- "hetccl hosts held", "hetccl link held": hosts and link with `HETCCL_TORCH_STREAM_ORDER=0`; "hetccl hosts
  thread", "hetccl link thread": with `HETCCL_TORCH_ENQUEUE_THREAD=1` (the process group's enqueuing thread, not
  the caller's, plans and enqueues the ordered collectives' device side; experimental); "hetccl hosts bf16",
  "hetccl hosts fp8": hosts with `HETCCL_CROSS_COMPRESS`, and "hetccl hosts bf16 ef", "hetccl hosts fp8 ef" with
  DDP's error feedback hook too (the compressed ones run only when named in --variants).

With `--device cpu` (a smoke test of the same code, CPU tensors) the anchor is `gloo` (loopback TCP), the islands are
cpu-0 / cpu-1 ("hetccl link" then has no GPU link: the islands meet over shared memory), the model is smaller and the
held/overlap part is skipped.

Parts (`--only fsdp,ddp,ops,overlap`), all through torch.distributed:
1. fsdp: an 8-layer transformer (nn.TransformerEncoderLayer(1024, 16, 4096) x 8 = 100.8M parameters, plus an
   embedding and an output head over a vocabulary of 8192, 16.8M more), `fully_shard` per layer and on the root,
   MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), AdamW, batch 8 x 128 tokens; torch.manual_seed(0)
   before building the model on every backend, the data from a generator seeded by (rank, step). 5 warm-up + 30 timed
   steps (--quick 2 + 5), each bracketed by synchronize; step time = the slowest rank's, the table gives the median.
   Rank 0's losses are compared with the anchor's (equal within 1e-6 relative?).
2. ddp: the same model in DistributedDataParallel, bf16 autocast, AdamW; the same steps.
3. ops: all_gather_into_tensor (bf16, output 4/16/25/64/100 MiB; in place, FSDP2's form, 16/64/100 MiB),
   reduce_scatter_tensor (fp32, input 8/16/50/64/200 MiB), all_reduce (fp32, 8/16/50/64/200 MiB). Per size: the first
   call is checked (rank-valued inputs), k warm-up calls back to back (the pinned staging of k calls in flight is
   allocated once, as in a training loop's steady state), then per repetition a barrier + synchronize, k calls back
   to back, synchronize; time = elapsed / k (k 5, --quick 2), the slowest rank's, median of 3 repetitions (--quick
   1). algbw = bytes / time (the output of all_gather, the input of reduce_scatter, the buffer of all_reduce), busbw
   = algbw x (n-1)/n (all_gather, reduce_scatter), x 2(n-1)/n (all_reduce), as nccl-tests.
4. overlap (GPU only): (a) held: ~8 ms of matmuls queued on the current stream (their count calibrated once with CUDA
   events, the same count on both ranks), then how long the blocking `dist.<op>(..., async_op=False)` keeps the Python
   thread (time.perf_counter), for all_reduce, broadcast, reduce_scatter_tensor, all_gather_into_tensor at 16 MiB fp32;
   median of 5. NCCL only enqueues (microseconds); a path that waits on the host for the data shows the queued
   compute in it. (b) overlap: a 25 MiB bf16 all_gather_into_tensor issued on a side stream while the matmuls run on
   the default stream: compute alone, all_gather alone (side stream), both together, each bracketed by synchronize,
   medians of 5 (slowest rank); ratio = together / max(alone): 1.0 is full overlap, (sum / max) is none.

Both ranks share the one GPU, so every compute figure is that of two processes time-sharing it (the calibrated
"8 ms" is 8 ms of wall time while the other rank runs its own matmuls).

Time on the H200 (1 GPU, 16 cores), estimated from the repository's earlier runs (hetccl over other hosts ~2-4 GB/s
busbw on this GPU, NCCL sockets ~4 GB/s): per variant ~15-20 s of start-up (torchrun, CUDA, the communicators), FSDP
~10-20 s (35 steps of ~0.2-0.4 s: 2 x 235 MB of bf16 all_gathers and 470 MB of fp32 reduce_scatters a step over
sockets), DDP ~5-10 s, ops ~10-25 s (the 200 MiB points dominate), held/overlap ~5 s: ~1-1.5 min a variant, ~3-5 min
for the three. A job gets --timeout s (300, --quick 180), and the whole run --deadline s (480): a job never runs past
the deadline, and variants that find no time left are reported as skipped, so the run stays inside a 10-minute
command even when a job hangs. A failed job does not stop the others: its error (the last lines of its stderr, NCCL
INFO lines left out) goes into the report, with whatever parts it finished (each rank rewrites its JSON after every
part). Full logs: --logs DIR (default: next to --out as <out>.logs/, else a temporary directory)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PARTS = ("fsdp", "ddp", "ops", "overlap")
MIB = 1 << 20
# op -> (dtype, sizes in MiB: the output of all_gather, the input of reduce_scatter, the buffer of all_reduce)
OP_SIZES = {"all_gather": ("bfloat16", (4, 16, 25, 64, 100)),
            "all_gather in place": ("bfloat16", (16, 64, 100)),  # FSDP2's: the input is the rank's block of out
            "reduce_scatter": ("float32", (8, 16, 50, 64, 200)),
            "all_reduce": ("float32", (8, 16, 50, 64, 200))}
HELD_OPS = ("all_reduce", "broadcast", "reduce_scatter", "all_gather")
BUSBW = {"all_gather": lambda n: (n - 1) / n, "all_gather in place": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n,
         "all_reduce": lambda n: 2 * (n - 1) / n}
# model shapes: full (the GPU), small (CPU), tiny (CPU --quick)
MODELS = {"full": {"vocab": 8192, "d": 1024, "heads": 16, "ff": 4096, "layers": 8},
          "small": {"vocab": 2048, "d": 256, "heads": 8, "ff": 1024, "layers": 4},
          "tiny": {"vocab": 512, "d": 64, "heads": 4, "ff": 256, "layers": 2}}
BATCH, SEQ = 8, 128
MATMUL_N = 4096  # the queued compute: bf16 matmuls of this square size (~0.2 ms each on an H200)
LOSS_RTOL = 1e-6


def variants(device: str, n: int) -> dict[str, tuple[str, dict[str, str], str]]:
    """name -> (backend, environment, what it is); the first is the anchor the others are compared with."""
    vendor = "nvidia" if device == "cuda" else "cpu"
    islands = ",".join(f"{vendor}-{i}" for i in range(n))
    hosts = ",".join(f"h{i}" for i in range(n))
    if device == "cuda":
        anchor = ("nccl hosts", "nccl", {"BENCH_NCCL_HOSTID": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                                         "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"},
                  "NCCL, NCCL_HOSTID=h<local rank>: the ranks are two hosts to NCCL (its network transport)")
        link = "two islands on one host: the zero-copy link"
    else:
        anchor = ("gloo", "gloo", {"GLOO_SOCKET_IFNAME": "lo"}, "Gloo over loopback TCP")
        link = "two islands on one host (CPU: no GPU link, shared memory)"
    return {anchor[0]: anchor[1:],
            "hetccl hosts": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_HOST": hosts},
                             f"islands {islands}, HETCCL_HOST={hosts}: each rank its own host (the default: "
                             "collectives ordered on the caller's stream)"),
            "hetccl link": ("hetccl", {"TEST_ISLANDS": islands}, f"islands {islands}, {link} (ordered, the default)"),
            "hetccl hosts late": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_HOST": hosts,
                                             "HETCCL_TORCH_EARLY_COPIES": "0"},
                                  "hetccl hosts, HETCCL_TORCH_EARLY_COPIES=0: copies out on the collective stream"),
            "hetccl hosts held": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_HOST": hosts,
                                             "HETCCL_TORCH_STREAM_ORDER": "0"},
                                  "hetccl hosts, HETCCL_TORCH_STREAM_ORDER=0: the caller's thread waits"),
            "hetccl link held": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_TORCH_STREAM_ORDER": "0"},
                                 "hetccl link, HETCCL_TORCH_STREAM_ORDER=0: the caller's thread waits"),
            "hetccl hosts thread": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_HOST": hosts,
                                               "HETCCL_TORCH_ENQUEUE_THREAD": "1"},
                                    "hetccl hosts, HETCCL_TORCH_ENQUEUE_THREAD=1: the enqueuing thread (experimental)"),
            "hetccl link thread": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_TORCH_ENQUEUE_THREAD": "1"},
                                   "hetccl link, HETCCL_TORCH_ENQUEUE_THREAD=1: the enqueuing thread (experimental)"),
            **{f"hetccl hosts {w}": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_HOST": hosts,
                                                "HETCCL_CROSS_COMPRESS": w},
                                     f"hetccl hosts, HETCCL_CROSS_COMPRESS={w}: the bytes between the hosts in {w}")
               for w in ("bf16", "fp8")},
            **{f"hetccl hosts {w} ef": ("hetccl", {"TEST_ISLANDS": islands, "HETCCL_HOST": hosts,
                                                   "HETCCL_CROSS_COMPRESS": w, "BENCH_DDP_HOOK": "error_feedback"},
                                        f"hetccl hosts {w}, DDP with hetccl.torch.hooks.error_feedback_hook")
               for w in ("bf16", "fp8")}}


# ------------------------------------------------------------------------------------------------ worker
class LM(torch.nn.Module):
    """Embedding, `layers` encoder layers (post-norm, no dropout), a final norm, an output head; the loss is
    next-token cross entropy in fp32."""

    def __init__(self, vocab: int, d: int, heads: int, ff: int, layers: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
                                          for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


class Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.a, self.dist = a, dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if os.environ.get("TEST_ISLANDS"):  # per-rank island labels, indexed by the global rank (as the tests do)
            os.environ["HETCCL_ISLAND"] = os.environ["TEST_ISLANDS"].split(",")[self.rank]
        if os.environ.get("BENCH_NCCL_HOSTID"):  # NCCL: every rank its own host (so two may share a GPU)
            os.environ["NCCL_HOSTID"] = f"h{local}"
        if a.backend == "hetccl":
            import hetccl.torch  # noqa: F401  (registers the "hetccl" backend)
        if a.device == "cuda":
            idx = local % torch.cuda.device_count()
            torch.cuda.set_device(idx)
            self.dev = torch.device("cuda", idx)
            self.sync = torch.cuda.synchronize
            dist.init_process_group(a.backend, device_id=self.dev, timeout=datetime.timedelta(seconds=300))
        else:
            self.dev = torch.device("cpu")
            self.sync = lambda: None
            dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=300))
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.out: dict = {"rank": self.rank, "world": self.world, "errors": {}, "done": [],
                          "meta": {"torch": torch.__version__, "device": str(self.dev),
                                   "island": os.environ.get("HETCCL_ISLAND"), "host": os.environ.get("HETCCL_HOST"),
                                   "nccl_hostid": os.environ.get("NCCL_HOSTID")}}
        if a.device == "cuda":
            self.out["meta"]["gpu"] = torch.cuda.get_device_name(self.dev)
            self.out["meta"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        self.save()

    def save(self) -> None:
        path = Path(f"{self.a.json}.{self.rank}.json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.out))
        tmp.replace(path)

    def run(self) -> None:
        for part in self.a.parts:
            if part == "overlap" and self.dev.type != "cuda":
                self.out["overlap"] = {"skipped": "no CUDA device"}
                continue
            t0 = time.perf_counter()
            try:
                self.out[part] = getattr(self, "part_" + part)()
                self.out["done"].append(part)
            except Exception:  # recorded; the next part runs
                self.out["errors"][part] = traceback.format_exc()[-4000:]
                print(f"rank {self.rank}: part {part} failed:\n{self.out['errors'][part]}", file=sys.stderr, flush=True)
            self.out.setdefault("part_s", {})[part] = time.perf_counter() - t0
            self.save()
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
        self.dist.barrier()
        self.sync()
        self.dist.destroy_process_group()

    # -------------------------------------------------------------------------------- training steps
    def build(self) -> tuple[torch.nn.Module, int]:
        torch.manual_seed(0)
        model = LM(**MODELS[self.a.model]).to(self.dev)
        return model, sum(p.numel() for p in model.parameters())

    def batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        vocab = MODELS[self.a.model]["vocab"]
        for step in range(count):
            g = torch.Generator().manual_seed(1_000_003 * (self.rank + 1) + step)
            tok = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
            out.append((tok[:, :-1].to(self.dev), tok[:, 1:].to(self.dev)))
        return out

    def train(self, model: torch.nn.Module, autocast: bool) -> dict:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        warm, steps = self.a.warmup_steps, self.a.steps
        data = self.batches(warm + steps)
        times, losses = [], []
        for i, (x, y) in enumerate(data):
            self.sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            loss.backward()
            opt.step()
            self.sync()
            el = time.perf_counter() - t0
            losses.append(loss.item())
            if i >= warm:
                times.append(el * 1e3)
        return {"step_ms": times, "losses": losses}

    def part_fsdp(self) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model, count = self.build()
        if self.rank == 0:
            print(f"model: {count} parameters ({count / 1e6:.1f}M; {MODELS[self.a.model]})", flush=True)
        mesh = init_device_mesh(self.dev.type, (self.world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        res = self.train(model, autocast=False)
        res["params"] = count
        return res

    def part_ddp(self) -> dict:
        from torch.nn.parallel import DistributedDataParallel

        model, count = self.build()
        ddp = DistributedDataParallel(model, device_ids=[self.dev.index] if self.dev.type == "cuda" else None)
        if os.environ.get("BENCH_DDP_HOOK") == "error_feedback":
            from hetccl.torch import hooks

            ddp.register_comm_hook(hooks.ErrorFeedback(), hooks.error_feedback_hook)
        res = self.train(ddp, autocast=True)
        res["params"] = count
        return res

    # -------------------------------------------------------------------------------- collectives
    def numel(self, mib: float, dtype: torch.dtype) -> int:
        """Elements of a buffer of `mib` MiB (/ --size-div), a multiple of the world size."""
        esize = torch.tensor([], dtype=dtype).element_size()
        n = int(mib * MIB / self.a.size_div) // esize
        return max(self.world, n - n % (self.world * 64))

    def op_call(self, op: str, dtype: torch.dtype, mib: float):
        """(the call, its check, the buffer bytes) for one op and size; inputs hold rank + 1."""
        dist, n, r = self.dist, self.world, self.rank
        total = self.numel(mib, dtype)
        want = float(n * (n + 1) // 2)
        if op.startswith("all_gather"):
            out = torch.empty(total, dtype=dtype, device=self.dev)
            k = total // n
            inp = out[r * k:(r + 1) * k] if op.endswith("in place") else torch.empty(k, dtype=dtype, device=self.dev)
            inp.fill_(r + 1)
            expect = torch.arange(1, n + 1, dtype=dtype, device=self.dev).view(n, 1)
            return (lambda **kw: self.all_gather(out, inp, **kw)), (lambda: bool((out.view(n, -1) == expect).all()))
        if op == "reduce_scatter":
            inp = torch.full((total,), r + 1, dtype=dtype, device=self.dev)
            out = torch.empty(total // n, dtype=dtype, device=self.dev)
            return (lambda **kw: self.reduce_scatter(out, inp, **kw)), (lambda: bool((out == want).all()))
        buf = torch.full((total,), r + 1, dtype=dtype, device=self.dev)
        if op == "all_reduce":
            def check() -> bool:
                ok = bool((buf == want).all())
                buf.zero_()  # the timed calls then sum zeros: no growth
                return ok
            return (lambda **kw: dist.all_reduce(buf, **kw)), check
        if op == "broadcast":
            return (lambda **kw: dist.broadcast(buf, 0, **kw)), (lambda: bool((buf == 1).all()))
        raise ValueError(op)

    def part_ops(self) -> dict:
        dist, k = self.dist, self.a.k
        res: dict = {}
        for op, (dtype_name, sizes) in OP_SIZES.items():
            dtype = getattr(torch, dtype_name)
            rows = []
            for mib in sizes:
                call, check = self.op_call(op, dtype, mib)
                call()
                self.sync()
                ok = check()
                for _ in range(k):  # warm-up as timed: staging buffers for k calls in flight, as a training loop
                    call()          # keeps them from step to step (their first allocation is not the op's time)
                self.sync()
                times = []
                for _ in range(self.a.reps):
                    dist.barrier()
                    self.sync()
                    t0 = time.perf_counter()
                    for _ in range(k):
                        call()
                    self.sync()
                    times.append((time.perf_counter() - t0) / k)
                rows.append({"bytes": self.numel(mib, dtype) * dtype.itemsize, "mib": mib, "times": times, "ok": ok})
                del call, check
            res[op] = rows
        return res

    # -------------------------------------------------------------------------------- held time, overlap
    def part_overlap(self) -> dict:
        dist, reps, dev = self.dist, self.a.overlap_reps, self.dev
        a = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=torch.bfloat16)
        b = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=torch.bfloat16)
        c = torch.empty_like(a)

        def compute(count: int) -> None:
            for _ in range(count):
                torch.mm(a, b, out=c)

        compute(5)
        dist.barrier()
        self.sync()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        compute(20)
        e1.record()
        self.sync()
        per = e0.elapsed_time(e1) / 20
        count = torch.tensor([max(1, math.ceil(self.a.compute_ms / per))], device=dev, dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the same compute on both ranks
        count = int(count.item())

        def timed(fn) -> list[float]:
            out = []
            for _ in range(reps):
                dist.barrier()
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                out.append((time.perf_counter() - t0) * 1e3)
            return out

        res: dict = {"matmul_ms": per, "matmuls": count, "compute_ms": timed(lambda: compute(count)), "held_ms": {}}
        for op in HELD_OPS:
            call, check = self.op_call(op, torch.float32, 16 * self.a.size_div)  # 16 MiB whatever --size-div
            call()
            self.sync()
            res.setdefault("held_ok", {})[op] = check()
            held = []
            for _ in range(reps):
                dist.barrier()
                self.sync()
                compute(count)
                t0 = time.perf_counter()
                call(async_op=False)
                held.append((time.perf_counter() - t0) * 1e3)
                self.sync()
            res["held_ms"][op] = held
            del call, check

        total = self.numel(25 * self.a.size_div, torch.bfloat16)
        inp = torch.full((total // self.world,), self.rank + 1, dtype=torch.bfloat16, device=dev)
        out = torch.empty(total, dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream()

        def gather() -> None:  # the input is ready (synchronized before): no wait on the default stream
            with torch.cuda.stream(side):
                self.all_gather(out, inp)

        def both() -> None:
            compute(count)
            gather()

        gather()
        self.sync()
        res["overlap_bytes"] = total * 2
        res["alone_compute_ms"] = timed(lambda: compute(count))
        res["alone_gather_ms"] = timed(gather)
        res["together_ms"] = timed(both)
        return res


def worker(a: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    Worker(a).run()


# ------------------------------------------------------------------------------------------------ driver
def tail(text: str, lines: int = 40) -> str:
    """The last lines of a job's stderr before torchrun's own failure report (NCCL INFO lines left out), and the
    ranks and exit codes that report names."""
    keep = [ln for ln in text.splitlines() if " NCCL INFO " not in ln]
    cut = next((i for i, ln in enumerate(keep) if "elastic" in ln and ("failed (exitcode" in ln
                                                                         or "death signal" in ln)), None)
    if cut is None:
        return "\n".join(keep[-lines:])
    summary = [ln.strip() for ln in keep[cut:] if ln.strip().startswith(("rank ", "exitcode ", "traceback "))]
    return "\n".join(keep[max(0, cut - lines):cut] + ["[torchrun] " + " ".join(summary)])


def elementwise_max(lists: list[list[float]]) -> list[float]:
    return [max(v) for v in zip(*lists, strict=False)] if lists else []


def merge(ranks: list[dict]) -> dict:
    """One variant's per-rank JSONs -> the slowest rank's times, rank 0's losses, every rank's errors."""
    res: dict = {"meta": ranks[0].get("meta", {}) if ranks else {}, "errors": {}}
    for r in ranks:
        for part, err in r.get("errors", {}).items():
            res["errors"].setdefault(part, f"rank {r['rank']}: {err}")
    for part in ("fsdp", "ddp"):
        got = [r[part] for r in ranks if isinstance(r.get(part), dict)]
        if len(got) == len(ranks) and got:
            res[part] = {"step_ms": elementwise_max([g["step_ms"] for g in got]), "losses": got[0]["losses"],
                         "losses_by_rank": [g["losses"] for g in got], "params": got[0]["params"]}
    got = [r["ops"] for r in ranks if isinstance(r.get("ops"), dict)]
    if got and len(got) == len(ranks):
        res["ops"] = {op: [{**row, "times": elementwise_max([g[op][i]["times"] for g in got]),
                            "ok": all(g[op][i]["ok"] for g in got)} for i, row in enumerate(rows)]
                      for op, rows in got[0].items()}
    got = [r["overlap"] for r in ranks if isinstance(r.get("overlap"), dict)]
    if got and len(got) == len(ranks):
        if "skipped" in got[0]:
            res["overlap"] = got[0]
        else:
            o = {k: got[0][k] for k in ("matmul_ms", "matmuls", "overlap_bytes")}
            for key in ("compute_ms", "alone_compute_ms", "alone_gather_ms", "together_ms"):
                o[key] = elementwise_max([g[key] for g in got])
            o["held_ms"] = {op: elementwise_max([g["held_ms"][op] for g in got]) for op in got[0]["held_ms"]}
            o["held_ok"] = {op: all(g["held_ok"][op] for g in got) for op in got[0]["held_ok"]}
            res["overlap"] = o
    return res


def run_variant(a: argparse.Namespace, name: str, backend: str, extra: dict[str, str], tmp: Path, logs: Path,
                limit: float) -> dict:
    slug = name.replace(" ", "_")
    prefix = tmp / slug
    for f in tmp.glob(slug + ".*"):
        f.unlink()
    env = dict(os.environ, **SAFE, **extra)
    env.setdefault("HETCCL_TIMEOUT", "120")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           __file__, "--worker", "--backend", backend, "--device", a.device, "--json", str(prefix),
           "--only", ",".join(a.parts), "--model", a.model, "--steps", str(a.steps),
           "--warmup-steps", str(a.warmup_steps), "--k", str(a.k), "--reps", str(a.reps),
           "--overlap-reps", str(a.overlap_reps), "--size-div", str(a.size_div), "--compute-ms", str(a.compute_ms)]
    out_log, err_log = logs / f"{slug}.out", logs / f"{slug}.err"
    t0 = time.time()
    timed_out = False
    with open(out_log, "w") as fo, open(err_log, "w") as fe:
        proc = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # torchrun and its ranks: the session this job started
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode if proc.returncode is not None else -9
    wall = time.time() - t0
    ranks = []
    for r in range(a.nproc):
        p = Path(f"{prefix}.{r}.json")
        if p.exists():
            ranks.append(json.loads(p.read_text()))
    res = merge(ranks) if len(ranks) == a.nproc else {"errors": {}}
    res.update(rc=rc, wall_s=wall, timed_out=timed_out, ranks=ranks, backend=backend, env=extra)
    err = err_log.read_text(errors="replace")
    both = out_log.read_text(errors="replace") + "\n" + err  # NCCL's INFO lines go to stdout
    nets = sorted({ln.split("Using network", 1)[1].strip() for ln in both.splitlines() if "Using network" in ln})
    res["nccl_network"] = ", ".join(nets)
    if rc != 0 or timed_out or len(ranks) != a.nproc:
        why = f"timed out after {limit:.0f} s" if timed_out else f"rc {rc}"
        res["failure"] = why + "\n" + tail(err)
    return res


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_variant(name: str, res: dict, anchor: str, ref: dict | None) -> None:
    print(f"== {name}: rc {res['rc']} in {res['wall_s']:.0f} s" + (" (TIMED OUT)" if res["timed_out"] else ""),
          flush=True)
    for part in ("fsdp", "ddp"):
        if part in res:
            same = ""
            if ref is not None and part in ref and ref is not res:
                rel, eq = losses_vs(res[part]["losses"], ref[part]["losses"])
                same = f"; {'equal' if eq else 'NOT equal'} to {anchor}'s within {LOSS_RTOL:g} (max rel. {rel:.2e})"
            print(f"   {part}: {res[part]['params']} parameters, step {med(res[part]['step_ms']):.2f} ms, losses "
                  f"{res[part]['losses'][0]:.6f} .. {res[part]['losses'][-1]:.6f}{same}", flush=True)
    for op, rows in res.get("ops", {}).items():
        for row in rows:
            t = med(row["times"])
            print(f"   {op:15s} {row['bytes'] / MIB:>8g} MiB {t * 1e3:9.3f} ms {row['bytes'] / t / 1e9:7.2f} GB/s algbw"
                  + ("" if row["ok"] else "  WRONG RESULT"), flush=True)
    o = res.get("overlap", {})
    if "held_ms" in o:
        print("   held " + ", ".join(f"{op} {med(v):.2f} ms" for op, v in o["held_ms"].items())
              + f"; compute {med(o['compute_ms']):.2f} ms", flush=True)
        print(f"   overlap: compute {med(o['alone_compute_ms']):.2f}, all_gather {med(o['alone_gather_ms']):.2f}, "
              f"together {med(o['together_ms']):.2f} ms", flush=True)
    for part, err in res.get("errors", {}).items():
        print(f"   part {part} FAILED: {err.strip().splitlines()[-1]}", flush=True)
    if "failure" in res:
        print("   " + res["failure"].replace("\n", "\n   "), flush=True)


def losses_vs(got: list[float], ref: list[float]) -> tuple[float, bool]:
    if len(got) != len(ref):
        return float("inf"), False
    rel = max((abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref, strict=True)), default=0.0)
    return rel, rel <= LOSS_RTOL


def machine() -> str:
    gpu = ""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        gpu = "; ".join(ln.strip() for ln in q.stdout.splitlines() if ln.strip()) if q.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{gpu or 'no GPU (nvidia-smi absent or failed)'}; {os.cpu_count()} CPUs ({cpu}); {platform.node()}"


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def report(a: argparse.Namespace, results: dict[str, dict], skipped: dict[str, str], total_s: float) -> str:
    names = list(results)
    vs = variants(a.device, a.nproc)
    anchor = next(iter(vs))
    L = [f"# FSDP2 / DDP step, collectives, held time and overlap: hetccl vs {anchor} ({a.device}, {a.nproc} ranks"
         + (", one GPU" if a.device == "cuda" else "") + ")", ""]
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    L += [f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
          f"- machine: {machine()}",
          f"- command: `{' '.join(shlex.quote(x) for x in [sys.executable, *sys.argv])}`",
          f"- torch {torch.__version__}" + (f", NCCL {'.'.join(map(str, nccl))}" if nccl else "")
          + f", python {platform.python_version()}, hetccl tree {git_rev()}",
          f"- environment of every job: `{' '.join(f'{k}={v}' for k, v in SAFE.items())}`",
          f"- model: {MODELS[a.model]}, batch {BATCH} x {SEQ} tokens, {a.warmup_steps} warm-up + {a.steps} timed steps;"
          f" ops: k {a.k}, {a.reps} repetition(s)" + (f", sizes / {a.size_div:g}" if a.size_div != 1 else "")
          + f"; total {total_s:.0f} s", ""]

    L += ["| variant | backend | environment | job | what |", "|---|---|---|---|---|"]
    for name in names:
        r = results[name]
        env = " ".join(f"{k}={v}" for k, v in r["env"].items() if not k.startswith("NCCL_DEBUG"))
        job = f"rc {r['rc']}, {r['wall_s']:.0f} s" + (", timed out" if r["timed_out"] else "")
        part_s = r["ranks"][0].get("part_s", {}) if r.get("ranks") else {}
        if part_s:
            job += " (" + ", ".join(f"{k} {v:.0f} s" for k, v in part_s.items()) + ")"
        what = vs[name][2] + (f" (NCCL network: {r['nccl_network']})" if r.get("nccl_network") else "")
        L.append(f"| {name} | {r['backend']} | `{env}` | {job} | {what} |")
    for name, why in skipped.items():
        L.append(f"| {name} | | | skipped | {why} |")
    L.append("")

    def ratio(x: float, ref: float | None) -> str:
        return f"{x / ref:.2f}x" if ref and not math.isnan(x) else "-"

    for part, title in (("fsdp", "FSDP2 step (fully_shard per layer + root, bf16 params, fp32 reduce, AdamW)"),
                        ("ddp", "DDP step (bf16 autocast, AdamW)")):
        if part not in a.parts:
            continue
        params = next((r[part]["params"] for r in results.values() if part in r), None)
        ref = med(results[anchor][part]["step_ms"]) if part in results.get(anchor, {}) else None
        L += [f"## {title}" + (f", {params / 1e6:.1f}M parameters" if params else ""), "",
              f"| variant | median step ms | min | max | vs {anchor} | loss first .. last | losses vs {anchor} "
              "(max rel. diff, rank 0) |", "|---|---|---|---|---|---|---|"]
        for name in names:
            r = results[name]
            if part not in r:
                L.append(f"| {name} | failed | | | | | |")
                continue
            s = r[part]["step_ms"]
            loss = r[part]["losses"]
            cmp = "-"
            if name != anchor and part in results.get(anchor, {}):
                rel, same = losses_vs(loss, results[anchor][part]["losses"])
                cmp = f"{'equal' if same else 'DIFFERENT'} within {LOSS_RTOL:g} ({rel:.2e})"
            L.append(f"| {name} | {med(s):.2f} | {min(s):.2f} | {max(s):.2f} | {ratio(med(s), ref)} | "
                     f"{loss[0]:.6f} .. {loss[-1]:.6f} | {cmp} |")
        L.append("")

    if "ops" in a.parts:
        L += ["## Collectives through torch.distributed (time ms / busbw GB/s, slowest rank, median)", ""]
        for op, (dtype, _) in OP_SIZES.items():
            have = [n for n in names if op in results[n].get("ops", {})]
            if not have:
                L += [f"{op}: no results", ""]
                continue
            rows0 = results[have[0]]["ops"][op]
            what = {"reduce_scatter": "input", "all_reduce": "buffer"}.get(op, "output")
            L += [f"### {op} ({dtype}, size = {what})", "",
                  "| size | " + " | ".join(have) + f" | busbw vs {anchor} |",
                  "|---|" + "---|" * len(have) + "---|"]
            for i, row0 in enumerate(rows0):
                cells, bws = [], {}
                for n in have:
                    row = results[n]["ops"][op][i]
                    t = med(row["times"])
                    bw = row["bytes"] / t / 1e9 * BUSBW[op](a.nproc)
                    bws[n] = bw
                    cells.append(f"{t * 1e3:.2f} ms / {bw:.2f}" + ("" if row["ok"] else " **WRONG**"))
                rel = ", ".join(f"{n} {ratio(bws[n], bws.get(anchor))}" for n in have if n != anchor)
                L.append(f"| {row0['bytes'] / MIB:g} MiB | " + " | ".join(cells) + f" | {rel or '-'} |")
            L.append("")

    if "overlap" in a.parts:
        L += ["## Held time and overlap", ""]
        if a.device != "cuda":
            L += ["Skipped: --device cpu (no CUDA streams to overlap with; the part is GPU only).", ""]
        else:
            have = [n for n in names if "held_ms" in results[n].get("overlap", {})]
            if have:
                L += ["Held: ms the blocking call `dist.<op>(..., async_op=False)` keeps the Python thread after ~"
                      f"{a.compute_ms:g} ms of matmuls were queued on the current stream; 16 MiB fp32; slowest rank, "
                      "median of %d." % a.overlap_reps, "",
                      "| op | " + " | ".join(have) + " |", "|---|" + "---|" * len(have)]
                for op in HELD_OPS:
                    cells = [f"{med(results[n]['overlap']['held_ms'][op]):.3f}"
                             + ("" if results[n]["overlap"]["held_ok"][op] else " **WRONG**") for n in have]
                    L.append(f"| {op} | " + " | ".join(cells) + " |")
                cells = [f"{med(results[n]['overlap']['compute_ms']):.2f} ({results[n]['overlap']['matmuls']} x "
                         f"{results[n]['overlap']['matmul_ms']:.3f})" for n in have]
                L += ["| (queued compute, ms: matmuls x ms each) | " + " | ".join(cells) + " |", ""]
                nbytes = results[have[0]]["overlap"]["overlap_bytes"]
                L += [f"Overlap: a {nbytes / MIB:g} MiB bf16 all_gather_into_tensor on a side stream while the matmuls "
                      "run on the default stream; ms, slowest rank, median of %d; ratio = together / max(alone) "
                      "(1.00 = full overlap; the no-overlap bound is sum / max)." % a.overlap_reps, "",
                      "| variant | compute alone | all_gather alone | together | ratio | no-overlap bound |",
                      "|---|---|---|---|---|---|"]
                for n in have:
                    o = results[n]["overlap"]
                    c, g, t = med(o["alone_compute_ms"]), med(o["alone_gather_ms"]), med(o["together_ms"])
                    L.append(f"| {n} | {c:.2f} | {g:.2f} | {t:.2f} | {t / max(c, g):.2f} | {(c + g) / max(c, g):.2f} |")
                L.append("")
            else:
                L += ["No variant finished this part.", ""]

    fails = {n: r for n, r in results.items() if r.get("failure") or r.get("errors")}
    if fails or skipped:
        L += ["## Errors", ""]
        for n, r in fails.items():
            for part, err in r.get("errors", {}).items():
                L += [f"**{n}**, part {part}:", "", "```", err.strip()[-3000:], "```", ""]
            if r.get("failure"):
                L += [f"**{n}**, job:", "", "```", r["failure"].strip(), "```", ""]
        for n, why in skipped.items():
            L += [f"**{n}**: skipped, {why}", ""]
    return "\n".join(L)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="2 + 5 steps, k 2, 1 repetition (CPU: the tiny model, "
                   "sizes / 16)")
    p.add_argument("--variants", default="", help="comma list of variant names (default: all)")
    p.add_argument("--only", default=",".join(PARTS), help="comma list of parts: " + ",".join(PARTS))
    p.add_argument("--out", default="", help="markdown report")
    p.add_argument("--json", default="", help="raw numbers (the driver); the workers' JSON prefix (--worker)")
    p.add_argument("--logs", default="", help="directory for each job's stdout/stderr")
    p.add_argument("--timeout", type=float, default=None, help="s per torchrun job (300, --quick 180)")
    p.add_argument("--deadline", type=float, default=480, help="s for the whole run (0: none)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", choices=tuple(MODELS), default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--k", type=int, default=None, help="ops back to back per timed repetition")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--overlap-reps", type=int, default=5)
    p.add_argument("--size-div", type=float, default=None, help="divide the op sizes (CPU --quick: 16)")
    p.add_argument("--compute-ms", type=float, default=8.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    q, cpu = a.quick, a.device == "cpu"
    a.model = a.model or ("full" if not cpu else "tiny" if q else "small")
    a.steps = a.steps if a.steps is not None else 5 if q else 30
    a.warmup_steps = a.warmup_steps if a.warmup_steps is not None else 2 if q else 5
    a.k = a.k or (2 if q else 5)
    a.reps = a.reps or (1 if q else 3)
    a.size_div = a.size_div or (16.0 if q and cpu else 1.0)
    a.timeout = a.timeout or (180.0 if q else 300.0)
    a.parts = [x for x in a.only.split(",") if x]
    bad = [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"--only: unknown part(s) {bad}; choose from {PARTS}")
    if a.worker:
        worker(a)
        return

    table = variants(a.device, a.nproc)
    chosen = ([x.strip() for x in a.variants.split(",") if x.strip()]
              or [v for v in table if not table[v][1].get("HETCCL_CROSS_COMPRESS")])  # compressed: when named
    bad = [x for x in chosen if x not in table]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {list(table)}")
    if a.logs:
        logs = Path(a.logs)
    elif a.out:
        logs = Path(a.out + ".logs")
    else:
        logs = Path(tempfile.mkdtemp(prefix="fsdp_step_logs."))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"variants {chosen}, parts {a.parts}, model {a.model}; logs in {logs}", flush=True)
    start = time.time()
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="fsdp_step.") as tmp:
        for name in chosen:
            backend, extra, _ = table[name]
            limit = a.timeout
            if a.deadline:
                left = a.deadline - (time.time() - start)
                if left < 30:
                    skipped[name] = f"no time left before --deadline {a.deadline:.0f} s"
                    print(f"== {name}: skipped ({skipped[name]})", flush=True)
                    continue
                limit = min(limit, left)
            results[name] = run_variant(a, name, backend, extra, Path(tmp), logs, limit)
            anchor = next(iter(table))
            print_variant(name, results[name], anchor, results.get(anchor))
    total = time.time() - start
    text = report(a, results, skipped, total)
    print(text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
        print(f"report: {a.out}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": sys.argv, "total_s": total, "skipped": skipped,
                                            "results": results}, indent=1))
        print(f"raw numbers: {a.json}", flush=True)


if __name__ == "__main__":
    main()
