"""The verbs transport, tested for real: tests/rdma/ runs inside a QEMU guest with soft-RoCE (rdma_rxe),
booted by the test bed in ../shared/rdma-testbed (or $RDMA_TESTBED_DIR; read its README).

The guest has Python 3.11, numpy, pytest and pyverbs but no network: hetccl's other dependencies go in as
wheels for CPython 3.11 installed into `.guest-site/` (git-ignored, made here with pip, pinned to this
environment's versions), and the native extension built on this host (`hetccl/_native.abi3.so`, from
`pip install -e .`) is shared with the guest; the host's glibc must not be newer than the guest's (Debian 12:
2.36). Slow (two guest boots, about 2-3 minutes each under TCG emulation), never skipped: without the test
bed, or without what building it needs, it fails and says what to install or run."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rankrun import ROOT

TESTBED = Path(os.environ.get("RDMA_TESTBED_DIR") or ROOT.parent / "shared" / "rdma-testbed")
CACHE = Path(os.environ.get("RDMA_TESTBED_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rdma-testbed")
GUEST_SITE = ROOT / ".guest-site"
GUEST_PYTHON = "3.11"
GUEST_DEPS = ["msgpack", "uvloop", "cffi", "rich", "numpy", "ml_dtypes", "pytest", "pytest-timeout"]
APT = "qemu-system-x86 qemu-utils mmdebstrap e2fsprogs debian-archive-keyring"

pytestmark = [pytest.mark.slow]


def _ensure_image() -> None:
    if not (TESTBED / "run-in-guest").is_file():
        pytest.fail(f"the soft-RoCE test bed is not at {TESTBED}; set RDMA_TESTBED_DIR to the rdma-testbed folder")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.fail(f"qemu-system-x86_64 is missing, so the soft-RoCE guest cannot boot; install: apt-get install "
                    f"-y --no-install-recommends {APT} (.ci/run does this)")
    built = all((CACHE / f).is_file() for f in ("vmlinuz", "initrd.img", "rootfs.ext4"))
    if os.geteuid() != 0:
        if not built:
            pytest.fail(f"the test-bed image is not built in {CACHE} and building it needs root: run "
                        f"sudo -E {TESTBED / 'build-image'}")
        return
    missing = [t for t in ("mmdebstrap", "mke2fs") if shutil.which(t) is None]
    if missing and not built:
        pytest.fail(f"building the test-bed image needs {missing}; install: apt-get install -y "
                    f"--no-install-recommends {APT}")
    if not missing:  # a no-op (< 0.1 s) when the cached image is up to date
        proc = subprocess.run([str(TESTBED / "build-image")], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"build-image failed (rc {proc.returncode}); it needs a Debian mirror:\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _ensure_guest_site() -> None:
    pins = []
    for name in GUEST_DEPS:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(name)
    stamp = GUEST_SITE / ".hetccl-stamp"
    want = f"cp{GUEST_PYTHON}\n" + "\n".join(sorted(pins)) + "\n"
    if stamp.is_file() and stamp.read_text() == want:
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--target", str(GUEST_SITE),
           "--python-version", GUEST_PYTHON, "--only-binary=:all:", *pins]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"could not fetch the guest's Python dependencies ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    stamp.write_text(want)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("net", ["dummy", "veth"])
def test_verbs_transport_in_soft_roce_guest(net: str) -> None:
    """tests/rdma/ (2 and 4 ranks, HETCCL_TRANSPORTS=verbs: every collective, p2p, large messages, a dead
    peer) inside the guest, over one rxe device (`dummy`) and over two rxe devices on a veth pair (`veth`)."""
    if not any((ROOT / "hetccl").glob("_native*.so")):
        pytest.fail("hetccl/_native*.so is not built; run `pip install -e .` or `python native/build.py`")
    _ensure_image()
    _ensure_guest_site()
    cmd = [str(TESTBED / "run-in-guest"), "--share", str(ROOT), "--net", net, "--timeout", "1500",
           "--env", "PYTHONPATH=/host/.guest-site:/host", "--env", "HETCCL_RDMA_GUEST=1",
           "--env", "PYTHONDONTWRITEBYTECODE=1", "--",
           "python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestConfigWarning",
           "--durations=5", "tests/rdma"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1650, cwd=ROOT)
    out = proc.stdout + proc.stderr
    hint = {124: " (the guest timed out)", 125: " (the guest did not report: boot failure?)",
            126: " (soft-RoCE set-up failed in the guest)"}.get(proc.returncode, "")
    assert proc.returncode == 0, \
        f"tests/rdma in the guest (--net {net}) exited {proc.returncode}{hint}:\n{out[-12000:]}"
    assert " passed" in out and "failed" not in out, out[-6000:]
