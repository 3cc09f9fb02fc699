#!/usr/bin/env bash
# Build a second NCCL from source, for tests/test_torch_gpu.py::test_each_island_its_own_nccl_build (one island
# runs hetccl's default NCCL, the other this build: two CCL builds that never talk to each other directly).
#
#   bash tests/build_nccl.sh SRC OUT        # SRC: an NCCL source tree or a .tar.gz of one (e.g. `git archive
#                                           # --prefix=nccl/ v2.27.7-1 | gzip` of github.com/NVIDIA/nccl)
#   HETCCL_TEST_NCCL_LIB_B=OUT/lib/libnccl.so.2 python -m pytest tests/test_torch_gpu.py -k nccl_build
#
# Needs nvcc (CUDA_HOME, else the nvcc on PATH). Only the GPU's own architecture is built (NCCL_ARCH, default
# 90: Hopper) and only the kernels those tests run (every collective in float32 and the types hetccl's torch
# tests use; ONLY_FUNCS, NCCL's own filter), which takes minutes instead of an hour.
set -euo pipefail
src=${1:?usage: build_nccl.sh SRC OUT}
out=$(mkdir -p "${2:?usage: build_nccl.sh SRC OUT}" && cd "$2" && pwd)
arch=${NCCL_ARCH:-90}
funcs=${NCCL_ONLY_FUNCS:-"AllReduce * (f32|bf16|i32|i64|f16) * *|Reduce * (f32|bf16|i32|i64) * *|ReduceScatter * (f32|bf16|i32|i64) * *|AllGather * *|Broadcast * *|SendRecv"}
nvcc=$(command -v nvcc || true)
cuda_home=${CUDA_HOME:-${nvcc:+$(dirname "$(dirname "$nvcc")")}}
[ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ] || { echo "build_nccl.sh: no nvcc (set CUDA_HOME)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -d "$src" ]; then
  cp -a "$src" "$work/nccl"
else
  mkdir "$work/nccl" && tar -xzf "$src" -C "$work/nccl" --strip-components=1
fi
cd "$work/nccl"
make -j"$(nproc)" src.build CUDA_HOME="$cuda_home" BUILDDIR="$work/build" \
     NVCC_GENCODE="-gencode=arch=compute_$arch,code=sm_$arch" ONLY_FUNCS="$funcs" >"$work/make.log" 2>&1 \
  || { tail -40 "$work/make.log" >&2; exit 1; }
mkdir -p "$out/lib"
cp -L "$work/build/lib/libnccl.so" "$out/lib/libnccl.so.2"
echo "build_nccl.sh: $(ls -l "$out/lib/libnccl.so.2") (sm_$arch)"
