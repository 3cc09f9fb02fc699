"""cffi (out-of-line, API mode) builder for the native extension module ``hetccl._native``.

Used two ways:

* by setuptools at install time: ``setup(cffi_modules=["native/build.py:ffibuilder"])`` picks up the
  module-level ``ffibuilder`` and puts the compiled module into the ``hetccl`` package;
* for development: ``python native/build.py`` compiles in a scratch folder (``build/cffi``) and copies
  the extension into ``hetccl/`` next to the Python sources (as ``_native.abi3.so``, the name
  setuptools gives it, removing stale copies under other names).

The C sources are ``hetccl_native.h`` (also the cdef) and ``hetccl_native.c`` beside this file.
Portability: no ``-march=native``; on x86_64 the hot loops use gcc function multi-versioning
(``target_clones``), selected inside the C source, so one binary runs everywhere and uses AVX2 where
the CPU has it.
"""

from __future__ import annotations

import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODULE = "hetccl._native"


def _read(name: str) -> str:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def _compile_args() -> list[str]:
    if sys.platform == "win32":
        return ["/O2"]
    return ["-O3", "-std=gnu11", "-fno-strict-aliasing"]


def make_ffibuilder(module: str = MODULE, defines: tuple[str, ...] = ()) -> FFI:
    """A builder for the extension. `defines` (e.g. "HCCL_NO_TARGET_CLONES", "HCCL_NO_EXPLICIT_SIMD")
    select build variants; the tests use them to check the portable kernels on any CPU."""
    builder = FFI()
    builder.cdef(_read("hetccl_native.h"))
    # the .c text is compiled inside cffi's generated wrapper; its `#include "hetccl_native.h"` is
    # found through include_dirs
    builder.set_source(
        module,
        _read("hetccl_native.c"),
        include_dirs=[HERE],
        define_macros=[(d, "1") for d in defines],
        libraries=[] if sys.platform == "win32" else ["m"],  # the wire formats' ldexpf / frexpf
        extra_compile_args=_compile_args(),
    )
    return builder


ffibuilder = make_ffibuilder()


def build_inplace(verbose: bool = False) -> str:
    """Compile into build/cffi and copy the extension into hetccl/; return the installed path."""
    import importlib.machinery
    import shutil

    tmpdir = os.path.join(ROOT, "build", "cffi")
    os.makedirs(tmpdir, exist_ok=True)
    built = ffibuilder.compile(tmpdir=tmpdir, verbose=verbose)
    pkg = os.path.join(ROOT, "hetccl")
    os.makedirs(pkg, exist_ok=True)  # only the folder: never creates hetccl/__init__.py
    # cffi modules use the stable ABI, and setuptools names them _native.abi3.so: use the same name so
    # that a dev build and `pip install -e .` replace each other instead of one shadowing the other
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    name = "_native.abi3.so" if ".abi3.so" in suffixes else os.path.basename(built)
    dest = os.path.join(pkg, name)
    # copy next to the target, then rename over it: a process that has the old module mapped keeps
    # its (unlinked) file instead of seeing it change under it
    tmp = f"{dest}.tmp{os.getpid()}"
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)
    for suffix in suffixes:  # stale builds under other names would be imported first
        other = os.path.join(pkg, "_native" + suffix)
        if other != dest and os.path.exists(other):
            os.remove(other)
    return dest


if __name__ == "__main__":
    print(build_inplace(verbose="-v" in sys.argv[1:]))
