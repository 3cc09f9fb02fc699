#!/usr/bin/env bash
# One-time (idempotent) set-up for benchmarks/compare_cpu.py on Debian 12 (root):
#   - Debian's Open MPI 4.1 (openmpi-bin, libopenmpi-dev) for mpirun and to build mpi4py against,
#   - mpi4py built from source (--no-binary) into the project's venv, so it links Debian's libmpi.
# torch (CPU) and numpy are expected in the venv already (hetccl's dev environment).
# Usage:  bash benchmarks/setup.sh            (VENV defaults to <repo>/.venv)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${VENV:-$(cd "$HERE/.." && pwd)/.venv}
PY="$VENV/bin/python"
export DEBIAN_FRONTEND=noninteractive

[ -x "$PY" ] || { echo "setup.sh: no python at $PY (set VENV=...)" >&2; exit 1; }

need_apt=()
for pkg in openmpi-bin libopenmpi-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends "${need_apt[@]}"
else
    echo "setup.sh: openmpi-bin and libopenmpi-dev already installed"
fi

if "$PY" -c "from mpi4py import MPI" 2>/dev/null; then
    echo "setup.sh: mpi4py already importable in $VENV"
else
    # build against the system Open MPI (mpicc from libopenmpi-dev), never a bundled MPI wheel
    "$PY" -m pip install --no-binary mpi4py mpi4py
fi

"$PY" - <<'PY'
import numpy, torch
from mpi4py import MPI
import hetccl
print("torch", torch.__version__, "| numpy", numpy.__version__, "| hetccl", getattr(hetccl, "__version__", "?"))
print(MPI.Get_library_version().splitlines()[0])
PY
mpirun --version | head -1
