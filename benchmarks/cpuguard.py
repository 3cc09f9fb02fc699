"""Contention guard for benchmarks on a shared machine (the logic of shared/anchors/cpumon.py and the
anchors' benchcommon.foreign_cpu, reorganised as a background sampler).

A thread reads utime+stime of every process from /proc once per `interval` seconds and keeps, per
interval, the CPU used by *foreign* processes: everything that is not this process or one of its
descendants (so every rank of every backend we launch is ours, whatever its command line), minus kernel
threads (which mostly serve our own traffic). 100 % = one full core.

  guard = CpuGuard(interval=1.0); guard.start()
  ...  run something between wall times a and b ...
  pct, top = guard.foreign_over(a, b)   # mean foreign CPU over [a, b], top consumers
  guard.wait_quiet(thresh=25, max_wait=60)
"""

from __future__ import annotations

import os
import threading
import time

_HZ = os.sysconf("SC_CLK_TCK")


def snapshot() -> tuple[float, dict[int, tuple[int, int, int, str]]]:
    """(wall time, {pid: (starttime, utime+stime ticks, ppid, comm)})."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                st = f.read()
            rp = st.rfind(")")
            fields = st[rp + 2:].split()
            out[int(name)] = (int(fields[19]), int(fields[11]) + int(fields[12]), int(fields[1]),
                              st[st.find("(") + 1:rp])
        except (OSError, IndexError, ValueError):
            continue
    return time.time(), out


def _ours(procs: dict, root: int) -> set[int]:
    """root and its descendants in this snapshot."""
    memo: dict[int, bool] = {}

    def is_ours(pid: int) -> bool:
        chain = []
        while pid not in memo:
            if pid == root:
                memo[pid] = True
                break
            info = procs.get(pid)
            if info is None or pid <= 1:
                memo[pid] = False
                break
            chain.append(pid)
            pid = info[2]
        res = memo[pid]
        for p in chain:
            memo[p] = res
        return res

    return {p for p in procs if is_ours(p)}


def foreign_between(s0, s1, root: int) -> tuple[float, list[tuple[float, str]]]:
    """(% of one core used by foreign processes between two snapshots, [(pct, comm), ...] largest first)."""
    t0, p0 = s0
    t1, p1 = s1
    dt = max(1e-3, t1 - t0)
    ours = _ours(p1, root) | _ours(p0, root)
    tot, top = 0.0, []
    for pid, (start, cpu, ppid, comm) in p1.items():
        if pid in ours or pid == 2 or ppid == 2:  # ours, kthreadd and kernel threads
            continue
        prev = p0.get(pid)
        d = cpu - (prev[1] if prev and prev[0] == start else 0)
        if d <= 0:
            continue
        pct = 100.0 * d / _HZ / dt
        tot += pct
        top.append((pct, comm))
    top.sort(reverse=True)
    return tot, top


class CpuGuard(threading.Thread):
    def __init__(self, interval: float = 1.0, root: int | None = None):
        super().__init__(name="cpuguard", daemon=True)
        self.interval = interval
        self.root = os.getpid() if root is None else root
        self.samples: list[tuple[float, float, float, str]] = []  # (t0, t1, foreign %, top)
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        prev = snapshot()
        while not self._stop.wait(self.interval):
            cur = snapshot()
            pct, top = foreign_between(prev, cur, self.root)
            with self._lock:
                self.samples.append((prev[0], cur[0], pct,
                                     ",".join("%s:%.0f" % (c, p) for p, c in top[:3] if p >= 1)))
            prev = cur

    def stop(self) -> None:
        self._stop.set()

    def wait_past(self, t: float, timeout: float = 5.0) -> None:
        """Block until a sample ending at or after wall time t exists."""
        end = time.time() + timeout
        while time.time() < end:
            with self._lock:
                if self.samples and self.samples[-1][1] >= t:
                    return
            time.sleep(0.05)

    def foreign_over(self, a: float, b: float) -> tuple[float, str]:
        """Overlap-weighted mean foreign CPU % over [a, b] and the top consumers seen meanwhile."""
        if b - a < self.interval:  # judge a short point by at least one whole sample around it
            mid = 0.5 * (a + b)
            a, b = mid - 0.5 * self.interval, mid + 0.5 * self.interval
        self.wait_past(b)
        num = den = 0.0
        tops: dict[str, float] = {}
        with self._lock:
            samples = list(self.samples)
        for t0, t1, pct, top in samples:
            ov = min(b, t1) - max(a, t0)
            if ov <= 0:
                continue
            num += pct * ov
            den += ov
            for item in filter(None, top.split(",")):
                c, _, p = item.rpartition(":")
                tops[c] = max(tops.get(c, 0.0), float(p))
        best = sorted(tops.items(), key=lambda kv: -kv[1])[:3]
        return (num / den if den else 0.0), ",".join("%s:%.0f" % kv for kv in best)

    def mean_since(self, a: float) -> float:
        with self._lock:
            xs = [(t1 - t0, p) for t0, t1, p, _ in self.samples if t1 > a]
        tot = sum(w for w, _ in xs)
        return sum(w * p for w, p in xs) / tot if tot else 0.0

    def wait_quiet(self, thresh: float, max_wait: float, window: float = 2.0, log=None) -> tuple[float, bool]:
        """Sleep until foreign CPU over the last `window` s is below thresh, or max_wait passed.
        Returns (seconds waited, whether it is quiet now)."""
        t0 = time.time()
        last_log = 0.0
        with self._lock:
            have_past = bool(self.samples) and self.samples[0][0] <= t0 - window
        if have_past and self.foreign_over(t0 - window, t0)[0] < thresh:
            return 0.0, True  # the last `window` seconds were quiet already
        if max_wait <= 0:
            return 0.0, False
        while True:
            now = time.time()
            self.wait_past(now + window)
            pct, top = self.foreign_over(now, now + window)
            if pct < thresh:
                return time.time() - t0, True
            if time.time() - t0 > max_wait:
                if log:
                    log("foreign load still %.0f%% of a core (%s) after %.0f s; going on" % (
                        pct, top, time.time() - t0))
                return time.time() - t0, False
            if log and time.time() - last_log > 10:
                log("waiting for foreign load to clear: %.0f%% of a core (%s)" % (pct, top))
                last_log = time.time()
