"""all_reduce, all_gather and reduce_scatter between CPU islands (async API), side by side in one run.

    python benchmarks/islands_cpu.py [--ranks 2] [--sizes 16M,64M] [--paths shm,hosts] [--repo OTHER_CHECKOUT]
                                     [--compress none,bf16,fp8] [--link-gbit 10] [--device cuda]

Every rank is its own island (HETCCL_ISLAND=cpu-<rank>); "shm" keeps them on one host (shared memory between
them), "hosts" makes each rank its own host (HETCCL_HOST=h0,h1,...: TCP between them). Per op and size: one
checked call, 2 warm-up calls, then --iters timed calls, each `barrier; t0; op; t1`; the time of a call is the
slowest rank's, and the table shows the median with nccl-tests' bus bandwidth (all_reduce 2(n-1)/n, all_gather
and reduce_scatter (n-1)/n of size / time; size: all_gather's output, reduce_scatter's input). --repo imports
hetccl from another checkout (its native library built), for a before/after in one run: the two are
interleaved size by size. --compress runs each HETCCL_CROSS_COMPRESS value as a variant (interleaved too), with
its time against the first one's. The "veth" path (root, 2 ranks) puts the two ranks in two network namespaces
joined by a veth pair shaped to --link-gbit (tc tbf on both ends): two hosts on an Ethernet link of that rate,
where loopback TCP costs what a memory copy costs. The "paced" path needs neither root nor `ip`: "hosts" with
HETCCL_SOCKET_MAX_RATE at --link-gbit (the kernel paces each rank's sends to its peer at that rate).
`--device cuda` makes every rank a GPU island (nvidia-<rank>, all on cuda:0, CUDA tensors through the same async
API, a synchronize before each call's end): on one GPU with the veth or paced path, GPU islands on two hosts
joined by a link of that rate, with host staging between them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchcommon import bus_factor, parse_size  # noqa: E402
from rankproc import free_port  # noqa: E402

OPS = ("all_reduce", "all_gather", "all_gather in place", "reduce_scatter")  # in place: FSDP2's all_gather


async def rank_main(sizes: list[int], iters: int, device: str = "cpu") -> None:
    import hetccl
    import numpy as np

    if device == "cuda":
        import torch

        torch.cuda.set_device(0)

        def full(count: int, value: float) -> object:
            return torch.full((count,), value, dtype=torch.float32, device="cuda")
        settle = torch.cuda.synchronize
    else:
        def full(count: int, value: float) -> object:
            return np.full(count, value, np.float32)

        def settle() -> None:
            pass
    comm = await hetccl.init()
    n, r = comm.size, comm.rank
    rows = []
    t = np.zeros(1, np.float64)
    for size in sizes:
        for op in OPS:
            count = size // 4
            if op == "all_reduce":
                buf = full(count, r + 1)
                call, want = functools.partial(comm.all_reduce, buf), n * (n + 1) / 2
            elif op.startswith("all_gather"):
                buf = full(count // n * n, 0)
                k = count // n
                inp = buf[r * k:(r + 1) * k] if op.endswith("in place") else full(k, 0)
                inp[:] = r + 1
                call, want = functools.partial(comm.all_gather, buf, inp), None
            else:
                inp, buf = full(count // n * n, r + 1), full(count // n, 0)
                call, want = functools.partial(comm.reduce_scatter, buf, inp), n * (n + 1) / 2
            await call()
            settle()
            if want is not None:
                assert float(buf[0]) == want and float(buf[-1]) == want, (op, buf[0], want)
            else:
                k = count // n
                assert all(float(buf[q * k]) == q + 1 for q in range(n)), op
            for _ in range(2):
                await call()
            settle()
            times = []
            for _ in range(iters):
                await comm.barrier()
                t0 = time.perf_counter()
                await call()
                settle()
                t[0] = time.perf_counter() - t0
                await comm.all_reduce(t, op="max")
                times.append(float(t[0]))
            med = statistics.median(times)
            busbw = size / med / 1e9 * bus_factor(op.split()[0], n)
            rows.append({"op": op, "size": size, "ms": med * 1e3, "busbw": busbw})
    if r == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    await comm.close()


def run_job(n: int, path: str, sizes: list[int], iters: int, repo: str | None, compress: str | None = None,
            link_gbit: float = 10.0, device: str = "cpu") -> list[dict]:
    port = free_port()
    env = dict(os.environ)
    if compress is not None:
        env["HETCCL_CROSS_COMPRESS"] = compress
    root = repo or str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    procs = []
    hosts = _shaped_link(link_gbit) if path == "veth" else None
    addr = f"127.0.0.1:{port}" if hosts is None else f"{hosts.addr[0]}:{hosts.free_port(0)}"
    kind = "nvidia" if device == "cuda" else "cpu"
    for r in range(n):
        e = dict(env, HETCCL_RANK=str(r), HETCCL_WORLD_SIZE=str(n), HETCCL_ADDR=addr,
                 HETCCL_ISLAND=f"{kind}-{r}", HETCCL_LOCAL_RANK=str(r), HETCCL_SECRET="islands-bench-secret")
        if path in ("hosts", "paced"):
            e["HETCCL_HOST"] = ",".join(f"h{q}" for q in range(n))
        if path == "paced":
            e["HETCCL_SOCKET_MAX_RATE"] = str(int(link_gbit * 1e9 / 8))
        code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import asyncio, islands_cpu; "
                f"asyncio.run(islands_cpu.rank_main({sizes!r}, {iters}, {device!r}))")
        cmd = [sys.executable, "-c", code]
        if hosts is not None:
            cmd = ["ip", "netns", "exec", hosts.ns[r % 2], *cmd]
        procs.append(subprocess.Popen(cmd, env=e, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    rows: list[dict] = []
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"rank {r} ({path}, repo {root}) exited {p.returncode}:\n{err[-3000:]}")
            for line in out.splitlines():
                if line.startswith("ROWS "):
                    rows = json.loads(line[5:])
    finally:
        if hosts is not None:
            hosts.destroy()
    return rows


def _shaped_link(gbit: float):  # -> tests/netns.TwoHosts
    """Two network namespaces joined by a veth pair that carries at most `gbit` Gbit/s each way."""
    import tempfile

    sys.path.insert(0, str(HERE.parent / "tests"))
    from netns import TwoHosts

    hosts = TwoHosts(Path(tempfile.mkdtemp(prefix="islands-veth-")))
    hosts.create()
    burst = max(1 << 20, int(gbit * 1e9 / 8 / 100))  # 10 ms of the rate: tbf's bucket outlasts the kernel's tick
    for i in (0, 1):
        hosts.exec(i, "tc", "qdisc", "add", "dev", hosts.veth[i], "root", "tbf", "rate", f"{gbit}gbit",
                   "burst", str(burst), "latency", "50ms")
    return hosts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--paths", default="shm,hosts")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repo", default=None, help="another checkout to compare against (before)")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions of each job")
    ap.add_argument("--link-gbit", type=float, default=10.0, help="the veth and paced paths' rate, Gbit/s each way")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the islands' memory")
    ap.add_argument("--compress", default=None, help="HETCCL_CROSS_COMPRESS values to compare, e.g. none,bf16,fp8")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    variants: list[tuple[str, str | None, str | None]] = [("this", None, None)]
    if args.compress:
        variants = [(c, None, c) for c in args.compress.split(",")]
    if args.repo:
        variants.append(("before", args.repo, None))
    what = "GPU islands on cuda:0" if args.device == "cuda" else "CPU islands"
    print(f"# {what}, {args.ranks} ranks, each its own island; {time.strftime('%Y-%m-%d')}, "
          f"{os.cpu_count()} CPUs; {' '.join(sys.argv)}")
    ratio = f" | time against {variants[0][0]}" if len(variants) > 1 else ""
    print("| path | op | size | " + " | ".join(f"{v} ms / busbw GB/s" for v, _, _ in variants) + ratio + " |")
    print("|---|---|---|" + "---|" * (len(variants) + bool(ratio)))
    for path in args.paths.split(","):
        got: dict[str, list[list[dict]]] = {v: [] for v, _, _ in variants}
        for _ in range(args.reps):
            for v, repo, compress in variants:  # interleaved
                got[v].append(run_job(args.ranks, path, sizes, args.iters, repo, compress, args.link_gbit,
                                          args.device))
        first = variants[0][0]
        for i in range(len(got[first][0])):
            cells, ms_of = [], {}
            for v, _, _ in variants:
                ms_of[v] = statistics.median(rows[i]["ms"] for rows in got[v])
                bw = statistics.median(rows[i]["busbw"] for rows in got[v])
                cells.append(f"{ms_of[v]:.1f} / {bw:.2f}")
            if ratio:
                cells.append(" / ".join(f"{ms_of[v] / ms_of[first]:.2f}x" for v, _, _ in variants[1:]))
            row = got[first][0][i]
            print(f"| {path} | {row['op']} | {row['size'] >> 20} MiB | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
