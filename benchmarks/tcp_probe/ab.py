"""ab.py ROUNDS name:ENV=V,ENV=V@TREE ... -> interleaved runs of plain.py (SIZES env), median per config and size.
A name starting with 'gloo' runs benchmarks/anchor_gloo.py from TREE instead."""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

PY = os.environ.get("PY", sys.executable)
HERE = os.path.dirname(os.path.abspath(__file__))
rounds = int(sys.argv[1])
cfgs = []
for a in sys.argv[2:]:
    name, _, rest = a.partition(":")
    rest, _, tree = rest.partition("@")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    cfgs.append((name, env, tree or os.getcwd()))
sizes = os.environ.get("SIZES", "64M")
res = {}  # (name, nb) -> [ms]
cpu = {}
for r in range(rounds):
    order = cfgs[r % len(cfgs) :] + cfgs[: r % len(cfgs)]
    for name, env, tree in order:
        e = dict(
            os.environ, HETCCL_TRANSPORTS="tcp", PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""), **env
        )
        if name.startswith("gloo"):
            js = tempfile.mktemp(suffix=".json")
            szs = sizes.split(",")
            for s in szs:
                p = subprocess.run(
                    [
                        PY,
                        os.path.join(tree, "benchmarks/anchor_gloo.py"),
                        "--nprocs",
                        "2",
                        "-b",
                        s,
                        "-e",
                        s,
                        "--ops",
                        "all_reduce",
                        "--json",
                        js,
                    ],
                    env=e,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                try:
                    d = json.load(open(js))
                except Exception:
                    print(name, "FAILED", p.stdout[-800:], p.stderr[-1500:], flush=True)
                    continue
                txt = json.dumps(d)
                for row in d.get("results") or d.get("rows") or []:
                    nb = row.get("size") or row.get("bytes")
                    t = row.get("time_us") or row.get("ip_time_us") or row.get("time")
                    if nb and t:
                        res.setdefault((name, int(nb)), []).append(float(t) / 1e3)
                if r == 0 and s == szs[0]:
                    print("gloo json sample:", txt[:400], flush=True)
            continue
        p = subprocess.run(
            [PY, "-m", "hetccl", "run", "-n", "2", "--", PY, os.path.join(HERE, "plain.py")],
            env=e,
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=600,
        )
        got = re.findall(r"RESULT (\d+) ([\d.]+) ([\d.]+)", p.stdout)
        if not got:
            print(name, "FAILED", p.stdout[-800:], p.stderr[-1500:], flush=True)
            continue
        for nb, ms, c in got:
            res.setdefault((name, int(nb)), []).append(float(ms))
            cpu.setdefault((name, int(nb)), []).append(float(c))
    print(f"round {r + 1} done", flush=True)
for (name, nb), v in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    med = statistics.median(v)
    c = cpu.get((name, nb))
    print(
        f"{nb >> 10:>7d}K {name:14s} median {med:9.3f} ms  busbw {nb / med / 1e6:6.3f} GB/s  "
        f"cpu/iter/rank0 {statistics.median(c) if c else float('nan'):7.2f} ms  all {' '.join(f'{x:.2f}' for x in v)}",
        flush=True,
    )
