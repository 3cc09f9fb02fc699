# Source this first on a bare GPU machine that has torch but neither hetccl's other needs nor network access:
#   . benchmarks/device_preamble.sh && python3 -m pytest tests/test_torch_gpu.py ...
# It installs the wheels in .whl/ (cffi, pycparser, pytest-asyncio, expecttest for python 3.12, fetched
# beforehand with `pip download --only-binary=:all: --python-version 3.12 ... -d .whl`) into /tmp/site, builds
# hetccl's native module in place, puts a `hetccl` command on PATH, and keeps NVLink multicast off.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 native/build.py >/dev/null || { echo native build failed; exit 1; }
mkdir -p /tmp/bin; printf '#!/bin/sh\nexec python3 -m hetccl "$@"\n' >/tmp/bin/hetccl; chmod +x /tmp/bin/hetccl; export PATH=/tmp/bin:$PATH
