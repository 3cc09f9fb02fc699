"""A /dev/shm too small for hetccl's segments: a clear TransportError on the rank that could not make one,
never a SIGBUS when a page of a segment that tmpfs cannot back is first touched. Each case runs in its own
mount namespace with a small tmpfs on /dev/shm (needs root or user namespaces; skipped without them)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from rankrun import ROOT

SCRIPT = """
import asyncio, numpy as np, hetccl
async def main():
    comm = await hetccl.init()
    b = np.ones(1024, np.float32)
    await comm.all_reduce(b)
    assert b[0] == comm.size, b[0]
    print("rank", comm.rank, "all_reduce ok", flush=True)
    await comm.close()
asyncio.run(main())
"""


def _two_ranks_in_small_shm(tmp_path, size: str) -> tuple[int, str]:
    """SCRIPT on 2 ranks (`hetccl run`) in a mount namespace whose /dev/shm is a tmpfs of `size`: exit code and
    output."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    probe = subprocess.run([unshare, "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}")
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HETCCL_TIMEOUT="20", HETCCL_SHM_FASTPATH_BYTES="1M")
    cmd = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec \"$@\""
    proc = subprocess.run([unshare, "-m", "sh", "-c", cmd, "sh", sys.executable, "-m", "hetccl", "run", "-n", "2",
                           "--", sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size,segment", [("3m", "hetccl-"), ("11m", "-fast-")])
def test_full_dev_shm_is_a_clear_error(tmp_path, size: str, segment: str) -> None:
    """3 MiB: the shm transport's rings do not fit; 11 MiB: they do, and the fast path's segment of the
    second rank does not. Either way a rank exits 1 with the TransportError naming /dev/shm."""
    rc, out = _two_ranks_in_small_shm(tmp_path, size)
    assert rc == 1, out[-3000:]
    assert "/dev/shm cannot hold shared segment" in out and segment in out, out[-3000:]
    assert f"signal {int(signal.SIGBUS)}" not in out and "SIGBUS" not in out, out[-3000:]


@pytest.mark.timeout(150)
def test_enough_dev_shm_runs(tmp_path) -> None:
    """The same job in a tmpfs large enough for both ranks' rings and fast-path segments runs: the check
    refuses only what does not fit."""
    rc, out = _two_ranks_in_small_shm(tmp_path, "16m")
    assert rc == 0 and out.count("all_reduce ok") == 2, out[-3000:]
