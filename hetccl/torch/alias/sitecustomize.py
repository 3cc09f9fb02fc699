"""Loaded at start-up by every rank of `hetccl run --torch-backend-alias ...` (this folder is put first on
PYTHONPATH): an unmodified script that asks torch.distributed for "nccl" or "gloo" gets hetccl instead.

Nothing heavy is imported here: a meta-path hook waits until the script itself imports
torch.distributed.distributed_c10d, then registers the "hetccl" backend and wraps init_process_group so that
the aliased backend names (HETCCL_TORCH_ALIAS, comma separated) are replaced by "hetccl" (the backend itself is
imported at that call: torch.distributed is still being initialised when distributed_c10d has just run).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "torch.distributed.distributed_c10d"


def _patch(module) -> None:
    # not through hetccl.params: this runs at start-up without importing hetccl (tests/test_params.py: EXEMPT)
    aliases = {a.strip().lower() for a in os.environ.get("HETCCL_TORCH_ALIAS", "").split(",") if a.strip()}
    original = module.init_process_group

    def init_process_group(backend=None, *args, **kwargs):
        if isinstance(backend, str) and backend.lower() in aliases:
            import hetccl.torch  # noqa: F401  (registers the backend; torch.distributed is complete by now)

            backend = "hetccl"
        return original(backend, *args, **kwargs)

    init_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    module.init_process_group = init_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = init_process_group


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # once, and let the real finders locate it
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("HETCCL_TORCH_ALIAS"):
    sys.meta_path.insert(0, _Finder())
