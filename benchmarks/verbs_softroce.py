"""Point-to-point bandwidth of hetccl's verbs transport next to perftest's ib_write_bw, on the soft-RoCE
test bed (for information only: under QEMU emulation the numbers say nothing about hardware).

Run from the repository root on the host (after `pip install -e .` and with the guest wheels in
.guest-site/, see tests/test_rdma_guest.py):

    tests/rdma-testbed/run-in-guest --share . --env PYTHONPATH=/host/.guest-site:/host \
        -- python3 benchmarks/verbs_softroce.py

It prints a markdown table (MB/s, 10^6 bytes per second): ib_write_bw (RDMA WRITE, one QP, rxe0 to itself)
and hetccl send/recv ping-pong over verbs and, for scale, over TCP inside the same guest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "rdma")]
SIZES = [64 << 10, 1 << 20, 4 << 20]


def ib_write_bw(size: int, iters: int = 200) -> float | None:
    dev, gid = os.environ.get("RDMA_TESTBED_DEV", "rxe0"), os.environ.get("RDMA_TESTBED_GID_INDEX", "1")
    ip = os.environ.get("RDMA_TESTBED_IP", "127.0.0.1")
    args = ["ib_write_bw", "-d", dev, "-x", gid, "-F", "-s", str(size), "-n", str(iters)]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(2)
    try:
        client = subprocess.run([*args, ip], capture_output=True, text=True, timeout=300)
    finally:
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    for line in client.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0] == str(size) and re.match(r"^\d+(\.\d+)?$", fields[3]):
            return float(fields[3]) * 1.048576  # perftest's MB/sec is MiB/s
    print(client.stdout[-2000:], client.stderr[-2000:], file=sys.stderr)
    return None


def hetccl_bw(transport: str) -> dict[int, float]:
    import json

    from rankrun import run_ranks

    env = {"HETCCL_TRANSPORTS": transport, "HETCCL_TIMEOUT": "120",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "rdma"), os.environ.get("PYTHONPATH", "")])}
    proc = run_ranks(2, "verbs_workers:bandwidth", env=env, timeout=600, sizes=SIZES, iters=10)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BW "))
    return {r["bytes"]: r["MBps"] for r in json.loads(line[3:])}


def main() -> None:
    perf = {s: ib_write_bw(s) for s in SIZES}
    verbs, tcp = hetccl_bw("verbs"), hetccl_bw("tcp")
    print("| message | ib_write_bw | hetccl verbs | hetccl tcp |")
    print("|---:|---:|---:|---:|")
    for s in SIZES:
        p = f"{perf[s]:.1f}" if perf[s] is not None else "n/a"
        print(f"| {s >> 10} KiB | {p} | {verbs[s]:.1f} | {tcp[s]:.1f} |")


if __name__ == "__main__":
    main()
