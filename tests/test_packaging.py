"""What `pip install .` (not -e) puts in place: the wheel holds every package under hetccl/ and the native
library, so the transports the entry points name import from an installed copy, away from the source tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from rankrun import ROOT


@pytest.mark.timeout(300)
def test_wheel_holds_every_package_and_imports_outside_the_tree(tmp_path: Path) -> None:
    # from a copy: setuptools' build/ in the tree keeps what earlier builds put there, missing packages included
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__",
                                                             "tests", "benchmarks", "*.so"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=280)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("hetccl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(str(p.parent.relative_to(ROOT)) for p in (Path(ROOT) / "hetccl").rglob("__init__.py"))
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert any(n.startswith("hetccl/_native") and n.endswith(".so") for n in names), sorted(names)[:20]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # every built-in transport class the entry points name loads from the installed copy
    probe = ("import sys, hetccl, hetccl.testing.transport_conformance;"
             "from hetccl.transports import registry;"
             "assert hetccl.__file__.startswith(sys.argv[1]), hetccl.__file__;"
             "[registry.load(n) for n in ('tcp', 'shm', 'verbs')]; print('loaded')")
    run = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and "loaded" in run.stdout, run.stderr[-3000:]
