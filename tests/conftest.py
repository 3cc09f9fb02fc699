import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/rdma/ needs RDMA devices: it runs inside the soft-RoCE guest, started by test_rdma_guest.py
collect_ignore = [] if os.environ.get("HETCCL_RDMA_GUEST") == "1" else ["rdma"]


# hetccl's parameter table (hetccl/params.py) reads each variable once per process: tests that change the
# environment get a fresh read, at the start of every test and after each monkeypatch.setenv / delenv
@pytest.fixture(autouse=True)
def _fresh_params():
    from hetccl import params

    params.reload()
    yield
    params.reload()


@pytest.fixture
def monkeypatch(monkeypatch):
    """pytest's monkeypatch; changing the environment through it makes hetccl read its parameters again."""
    from hetccl import params

    def rereading(change):
        def changed(*args, **kwargs):
            change(*args, **kwargs)
            params.reload()

        return changed

    monkeypatch.setenv = rereading(monkeypatch.setenv)
    monkeypatch.delenv = rereading(monkeypatch.delenv)
    return monkeypatch


# the two-host test bed (network namespaces joined by a veth pair) of test_multihost.py and test_faults.py
@pytest.fixture
def hosts(tmp_path):
    """Two namespaces with a veth pair; skips where namespaces cannot be built; always cleans up."""
    from netns import NetnsUnavailable, TwoHosts

    h = TwoHosts(tmp_path)
    try:
        try:
            h.create()
        except NetnsUnavailable as exc:
            pytest.skip(f"cannot build network namespaces here: {exc}")
        yield h
    finally:
        h.destroy()
