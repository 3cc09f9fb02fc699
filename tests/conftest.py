import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/rdma/ needs RDMA devices: it runs inside the soft-RoCE guest, started by test_rdma_guest.py
collect_ignore = [] if os.environ.get("HETCCL_RDMA_GUEST") == "1" else ["rdma"]


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
