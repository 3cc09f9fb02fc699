import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# tests/rdma/ needs RDMA devices: it runs inside the soft-RoCE guest, started by test_rdma_guest.py
collect_ignore = [] if os.environ.get("HETCCL_RDMA_GUEST") == "1" else ["rdma"]
